"""Helpers for the ring / worker-pool tests that must be importable by workers.

Worker processes are fresh interpreters, so anything they run (custom sources, the
raw-ring producer) must live in an importable module, not in a test file.
The test files put this folder on ``sys.path`` and ``import ring_helpers``;
every worker gets the consumer's ``sys.path``.

Run as a script, it is the body of subprocess-based tests :

    python ring_helpers.py parent ROOT OUT       start a Loader, report pids, then block
    python ring_helpers.py onecpu ROOT OUT       a full run meant for ``taskset -c 0``
    python ring_helpers.py exit                  print a pid and exit (a dead pid)
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
EPOCHS = 8          # fast-consumer epochs of the one-CPU run


# ---- a small corpus of real-photo JPEGs ---------------------------------------------
def make_corpus(root, n_images=48, seed=0, classes=3):
    """An ImageFolder tree of ``n_images`` JPEGs cut from real photographs.

    Uses ``echo_native.corpus.build_corpus`` when it is there; otherwise cuts
    small JPEGs out of scikit-image's photographs with Pillow.
    """
    root = Path(root)
    try:
        from echo_native.lab.corpus import build_corpus
    except ImportError:
        build_corpus = None
    if build_corpus is not None:
        return Path(build_corpus(root, n_images=n_images, seed=seed, classes=classes))
    from PIL import Image
    import skimage.data as data

    photos = [data.astronaut(), data.coffee(), data.chelsea(), data.rocket()]
    rng = np.random.default_rng(seed)
    for i in range(n_images):
        src = photos[i % len(photos)]
        h, w = src.shape[:2]
        ch, cw = int(rng.integers(h // 2, h)), int(rng.integers(w // 2, w))
        y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
        im = Image.fromarray(src[y:y + ch, x:x + cw])
        scale = rng.uniform(300, 480) / max(im.size)
        im = im.resize((max(1, int(im.size[0] * scale)), max(1, int(im.size[1] * scale))))
        d = root / f"class_{i % classes:02d}"
        d.mkdir(parents=True, exist_ok=True)
        im.save(d / f"img_{i:05d}.jpg", quality=int(rng.integers(80, 96)))
    return root


# ---- sources that misbehave inside workers ----------------------------------------------
class _Wrapped:
    """A source that delegates to another one (labels, describe, read)."""

    def __init__(self, base):
        self.base = base
        self.labels = base.labels

    def __len__(self):
        return len(self.base)

    def describe(self, i):
        return self.base.describe(i)

    def read(self, i):
        return self.base.read(i)


class SlowSource(_Wrapped):
    """Every read takes ``delay`` seconds (makes batches slow enough to kill mid-way).

    With ``log`` (a path), each read first appends its sample id as a line there, from
    whichever worker process made it."""

    def __init__(self, base, delay, log=None):
        super().__init__(base)
        self.delay, self.log = delay, log

    def read(self, i):
        if self.log is not None:
            with open(self.log, "a") as f:  # one short append: whole lines, any process
                f.write(f"{int(i)}\n")
        time.sleep(self.delay)
        return self.base.read(i)


class RaisingSource(_Wrapped):
    """Reading one of ``bad`` raises an unexpected (non-OSError) exception."""

    def __init__(self, base, bad):
        super().__init__(base)
        self.bad = frozenset(int(b) for b in bad)

    def read(self, i):
        if int(i) in self.bad:
            raise LookupError(f"ring_helpers: deliberate failure reading sample {i}")
        return self.base.read(i)


class HangingSource(_Wrapped):
    """Reading one of ``bad`` never returns (a hung network filesystem, say)."""

    def __init__(self, base, bad):
        super().__init__(base)
        self.bad = frozenset(int(b) for b in bad)

    def read(self, i):
        if int(i) in self.bad:
            while True:
                time.sleep(3600)
        return self.base.read(i)


# ---- raw ring protocol: a producer that writes checksummed slots --------------------------
def pattern(ticket, nbytes):
    """The bytes a producer writes for ``ticket`` in every sample row."""
    rng = np.random.default_rng([int(ticket), 0x5EED])
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


def checksum(arr):
    """A cheap order-sensitive checksum of a uint8 array (int64, non-negative)."""
    a = np.asarray(arr, dtype=np.uint8).astype(np.int64)
    return int((a * (np.arange(a.size, dtype=np.int64) % 65521 + 1)).sum() % (2**61 - 1))


def fill_slot(ring, ticket):
    """Write ``ticket``'s pattern + checksums into its slot (the producer's job)."""
    slot = ring.slots[ticket % ring.layout.nslots]
    B, S = ring.layout.batch_size, ring.layout.sample_bytes
    for j in range(B):
        row = pattern(ticket * B + j, S)
        slot.pixels[j] = row
        slot.labels[j] = checksum(row)
        slot.sample_ids[j] = ticket * B + j
    ring.write_meta(ticket, B, 0, 0, [_marker(ticket)])


def _marker(ticket):
    """A failure record naming the ticket: the consumer checks the slot's meta is its own."""
    from echo_native.ring import Failure
    return Failure(ticket, 0, f"ticket {ticket}", "")


def verify_slot(ring, ticket):
    """Check a published slot as the consumer sees it; returns a list of problems."""
    slot = ring.slots[ticket % ring.layout.nslots]
    B = ring.layout.batch_size
    problems = []
    count, error, failures, report = ring.read_meta(ticket)
    if (count, error, failures, report) != (B, 0, 0, [_marker(ticket)]):
        problems.append(f"ticket {ticket}: meta {(count, error, failures, report)!r}")
    for j in range(B):
        if int(slot.sample_ids[j]) != ticket * B + j:
            problems.append(f"ticket {ticket} row {j}: id {int(slot.sample_ids[j])}")
        if checksum(slot.pixels[j]) != int(slot.labels[j]):
            problems.append(f"ticket {ticket} row {j}: checksum mismatch")
        if not np.array_equal(slot.pixels[j], pattern(ticket * B + j, ring.layout.sample_bytes)):
            problems.append(f"ticket {ticket} row {j}: pixels differ from the pattern")
    return problems


def raw_producer(ring, total, delay=0.0, timeout=20.0):
    """Take tickets until ``total`` are handed out; fill, publish.  Returns tickets filled."""
    done = []
    while True:
        t = ring.take_ticket()
        if t >= total:
            return done
        rc = ring.wait_free(t, timeout)
        if rc != 0:
            raise RuntimeError(f"producer: wait_free({t}) returned {rc}")
        if delay:
            time.sleep(delay)
        fill_slot(ring, t)
        ring.publish(t)
        done.append(t)


def raw_producer_main(ring, total, delay, conn):
    """Process entry point: run :func:`raw_producer`, send what it did (or the error)."""
    try:
        conn.send(("ok", raw_producer(ring, total, delay)))
    except BaseException as e:  # reported to the test
        conn.send(("error", repr(e)))
    finally:
        conn.close()


# ---- process inspection (psutil when available, /proc otherwise) ---------------------------
def proc_state(pid):
    """'R', 'S', 'Z', ... from /proc, or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def alive(pid):
    """Running (not gone and not a zombie)."""
    return proc_state(pid) not in (None, "Z")


def descendants(pid=None):
    """Pids of every live (non-zombie) descendant of ``pid`` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            return {p.pid for p in psutil.Process(pid).children(recursive=True)
                    if p.status() != psutil.STATUS_ZOMBIE}
        except psutil.NoSuchProcess:
            return set()
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def cpu_seconds(pid):
    """User + system CPU seconds of a process from /proc/<pid>/stat (0.0 if gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pids():
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def _memfd_label(text, prefix):
    """The ring label in a /proc link or maps path ``/memfd:<label> (deleted)``, if it
    starts with ``prefix``."""
    text = text.strip()
    if text.endswith(" (deleted)"):
        text = text[:-len(" (deleted)")]
    if text.startswith("/memfd:" + prefix):
        return text[len("/memfd:"):]
    return None


def memfd_holders(prefix="echo_native-", maps=True):
    """``{label: {pid: {"fd", "map"}}}``: every process (that this user may inspect)
    holding a memfd ring whose label starts with ``prefix``, by an open descriptor
    ("fd") and, with ``maps``, by a mapping ("map").  A memfd's memory is freed exactly
    when it has no holder left."""
    out = {}
    for pid in _pids():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = []
        for fd in fds:
            try:
                label = _memfd_label(os.readlink(f"/proc/{pid}/fd/{fd}"), prefix)
            except OSError:
                continue
            if label:
                out.setdefault(label, {}).setdefault(pid, set()).add("fd")
        if not maps:
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            parts = line.split(None, 5)
            label = _memfd_label(parts[5], prefix) if len(parts) == 6 else None
            if label:
                out.setdefault(label, {}).setdefault(pid, set()).add("map")
    return out


def segments(pid):
    """Ring segments created by ``pid`` that can still be reached, named as a ring's
    name less its leading "/": named segments in /dev/shm (``echo_native-<pid>-...``,
    the fallback) and memfd rings (``memfd:echo_native-<pid>-...``) that some process
    still holds a descriptor of.  (A memfd's memory lasts until its mappings go too:
    see :func:`ring_memory`.)"""
    prefix = f"echo_native-{pid}-"
    try:
        named = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    except FileNotFoundError:
        named = []
    held = ["memfd:" + label for label in memfd_holders(prefix, maps=False)]
    return sorted(named + held)


def ring_memory(pid):
    """``{ring name: sorted pids}`` of the memfd rings created by ``pid`` whose memory is
    still held, by a descriptor or a mapping, by any process."""
    return {"/memfd:" + label: sorted(holders)
            for label, holders in memfd_holders(f"echo_native-{pid}-").items()}


def shmem_bytes():
    """Shmem of /proc/meminfo (memfd and /dev/shm pages of the whole machine), in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem line in /proc/meminfo")


# ---- subprocess bodies --------------------------------------------------------------------
def _parent_main(root, out):
    """Start a process-mode Loader, report (pid, worker pids, ring name), then block."""
    import echo_native as en

    src = en.ImageFolder(root)
    L = en.Loader(src, batch_size=4, image_size=32, workers=2, worker_mode="process",
                  slots=2, seed=1)
    with L:
        next(iter(L))                    # workers are up and the ring is full
        info = {"pid": os.getpid(), "workers": L.worker_pids(), "ring": L.ring_name}
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, out)
        while True:                      # until SIGKILLed by the test
            time.sleep(1)


def _onecpu_main(root, out):
    """Three phases with 2 process workers; wall times and CPU use of each side.

    fast:   EPOCHS epochs, null consumer (progress: every id, promptly)
    sleepy: the workers' reads sleep, the consumer waits (a spinning consumer
            would be the only runnable task and burn the core)
    slow:   the consumer sleeps per batch, the ring stays full (spinning
            workers would burn the core)
    """
    import echo_native as en

    src = en.ImageFolder(root)
    info = {"n": len(src), "affinity": sorted(os.sched_getaffinity(0)), "ids": []}
    t0 = time.perf_counter()
    with en.Loader(src, batch_size=8, image_size=160, workers=2, worker_mode="process",
                   slots=3, seed=5, timeout=30) as L:
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(EPOCHS):
            for batch in L:
                info["ids"].extend(int(i) for i in batch.sample_ids)
        info["fast_wall"] = time.perf_counter() - w0
        info["fast_consumer_cpu"] = time.process_time() - c0
        pids = L.worker_pids()
        wcpu0, w1 = sum(cpu_seconds(p) for p in pids), time.perf_counter()
        for batch in L:
            time.sleep(0.1)
        info["slow_wall"] = time.perf_counter() - w1
        info["slow_worker_cpu"] = sum(cpu_seconds(p) for p in pids) - wcpu0
        info["restarts"] = L.stats()["worker_restarts"]
    with en.Loader(SlowSource(src, 0.01), batch_size=4, image_size=16, workers=2,
                   worker_mode="process", slots=2, seed=5, timeout=30) as L:
        next(iter(L))                   # started
        c0, w0 = time.process_time(), time.perf_counter()
        for batch in L:
            pass
        info["sleepy_wall"] = time.perf_counter() - w0
        info["sleepy_consumer_cpu"] = time.process_time() - c0
    info["total"] = time.perf_counter() - t0
    with open(out, "w") as f:
        json.dump(info, f)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    import ring_helpers as _rh  # the importable copy, so pickles name `ring_helpers`

    cmd = sys.argv[1]
    if cmd == "parent":
        _rh._parent_main(sys.argv[2], sys.argv[3])
    elif cmd == "onecpu":
        _rh._onecpu_main(sys.argv[2], sys.argv[3])
    elif cmd == "exit":
        print(os.getpid())
    else:
        raise SystemExit(f"unknown command {cmd!r}")


def wait_until_holding(loader, worker, timeout=10.0):
    """Block until ``worker`` holds a ticket the consumer has not taken and that is not
    yet published (so the consumer must wait for it); return that ticket.

    (A claim can still name a ticket the worker has just published and the
    consumer already took: such a worker holds nothing.)"""
    ring, deadline = loader.ring, time.monotonic() + timeout
    while time.monotonic() < deadline:
        t = ring.claim(worker) - 1
        if loader.position <= t < 2**63 and not ring.is_published(t):
            return t
        time.sleep(0.0005)
    raise AssertionError(f"worker {worker} never held a ticket within {timeout} s")

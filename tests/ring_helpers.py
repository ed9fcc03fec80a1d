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
EPOCHS = 4          # progress epochs of the one-CPU run
WINDOW = 0.5        # seconds each waiting side is watched for in that run


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


class GatedSource(_Wrapped):
    """Every read waits until the file ``gate`` exists (workers that cannot make progress
    until the test lets them); a gate still shut after ``limit`` seconds fails the read."""

    def __init__(self, base, gate, limit=120.0):
        super().__init__(base)
        self.gate, self.limit = str(gate), float(limit)

    def read(self, i):
        deadline = time.monotonic() + self.limit
        while not os.path.exists(self.gate):
            if time.monotonic() > deadline:
                raise RuntimeError(f"ring_helpers: the gate {self.gate} stayed shut")
            time.sleep(0.01)
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
    from echo_native.failures import Failure
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


# ---- waiting on a condition, never on the clock ------------------------------------------
def wait_for(condition, what, timeout=60.0, poll=0.005):
    """Return once ``condition()`` is true; fail naming ``what`` after ``timeout`` seconds.

    The timeout is a hang guard, generous on purpose: a slow or busy machine only
    makes the wait longer, never the test's outcome different."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(poll)


# The futex system call's number, which /proc/<pid>/task/<tid>/syscall shows first while a
# thread is blocked in it (Linux's own numbering, per architecture).
FUTEX_SYSCALL = {"x86_64": 202, "aarch64": 98, "riscv64": 98, "ppc64le": 221,
                 "s390x": 238, "loongarch64": 98}.get(os.uname().machine)


def _mappings(pid, label):
    """Address ranges of ``pid``'s mappings whose path contains ``label``."""
    spans = []
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and label in parts[5]:
                    lo, hi = parts[0].split("-")
                    spans.append((int(lo, 16), int(hi, 16)))
    except OSError:
        pass
    return spans


def asleep_on_ring(pid, tid=None, ring_name="echo_native-"):
    """True while thread ``tid`` of ``pid`` (its main thread by default) is blocked in a
    futex wait on a word of the ring ``ring_name`` (any echo_native ring by default):
    asleep in the ring's wait, not merely descheduled or queued for the GIL."""
    assert FUTEX_SYSCALL is not None, f"no futex syscall number for {os.uname().machine}"
    tid = pid if tid is None else tid
    try:
        with open(f"/proc/{pid}/task/{tid}/syscall") as f:
            fields = f.read().split()
    except OSError:
        return False
    if len(fields) < 2 or fields[0] != str(FUTEX_SYSCALL):
        return False
    addr = int(fields[1], 16)
    label = ring_name.lstrip("/")
    return any(lo <= addr < hi for lo, hi in _mappings(pid, label))


PF_EXITING = 0x4   # include/linux/sched.h: set as a task starts to exit
SIGKILL_BIT = 1 << (9 - 1)


def doomed(pid):
    """True when ``pid`` is gone, a zombie, exiting, or has a SIGKILL pending: a signal
    sent to it before this call can no longer leave it looking alive."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return True
    if fields[0] in ("Z", "X", "x") or int(fields[6]) & PF_EXITING:
        return True
    pending = int(status["SigPnd"].strip(), 16) | int(status["ShdPnd"].strip(), 16)
    return bool(pending & SIGKILL_BIT)


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


def _task_cpu_seconds(tid):
    """User + system CPU seconds of thread ``tid`` of this process."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _onecpu_main(root, out):
    """Three phases with 2 process workers on one CPU; CPU use of the waiting side.

    progress:    EPOCHS epochs, null consumer: every id arrives
    full ring:   the consumer holds a batch and the workers, with every slot filled,
                 sleep in the ring's wait: their CPU over a WINDOW of it (spinning
                 workers would share the core between them, the consumer asleep)
    no data:     the workers' reads wait on a shut gate and the consumer sleeps in the
                 ring's wait for a batch: its CPU over a WINDOW of it (a spinning
                 consumer would be the only runnable task and take the core)

    Each window starts once the waiting side is asleep on the ring (/proc shows it in
    a futex wait on the ring's memory), so what is measured is the wait itself,
    whatever the machine's speed or load.
    """
    import threading

    import echo_native as en

    src = en.ImageFolder(root)
    info = {"n": len(src), "affinity": sorted(os.sched_getaffinity(0)), "ids": [],
            "window": WINDOW}
    with en.Loader(src, batch_size=8, image_size=160, workers=2, worker_mode="process",
                   slots=3, seed=5, timeout=60) as L:
        for _ in range(EPOCHS):
            for batch in L:
                info["ids"].extend(int(i) for i in batch.sample_ids)
        it = iter(L)
        next(it)                        # held: the workers fill the other slots and wait
        pids = L.worker_pids()
        for pid in pids:
            wait_for(lambda p=pid: asleep_on_ring(p, ring_name=L.ring_name),
                     f"worker {pid} asleep on the full ring")
        cpu0 = sum(cpu_seconds(p) for p in pids)
        time.sleep(WINDOW)
        info["full_ring_worker_cpu"] = sum(cpu_seconds(p) for p in pids) - cpu0
        info["restarts"] = L.stats()["worker_restarts"]
    gate = out + ".gate"
    with en.Loader(GatedSource(src, gate), batch_size=4, image_size=16, workers=2,
                   worker_mode="process", slots=2, seed=5, timeout=60) as L:
        L.start()
        main, spent = threading.get_native_id(), {}

        def measure():
            wait_for(lambda: asleep_on_ring(os.getpid(), main, L.ring_name),
                     "the consumer asleep waiting for a batch")
            cpu0 = _task_cpu_seconds(main)
            time.sleep(WINDOW)
            spent["cpu"] = _task_cpu_seconds(main) - cpu0
            open(gate, "w").close()

        th = threading.Thread(target=measure)
        th.start()
        info["gated_ids"] = [int(i) for i in L.next_batch().sample_ids]
        th.join()
        info["waiting_consumer_cpu"] = spent["cpu"]
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


def wait_until_holding(loader, worker, timeout=60.0):
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

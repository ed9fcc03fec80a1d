"""The ring's memory: a memfd with no name, reserved and sized up front.

* A 64 MB ``/dev/shm`` (Docker's default, made here with a private mount
  namespace) runs a ring larger than it, since a memfd is not bounded by that
  mount; the named fallback forced there fails at ``start()`` with one clear
  error instead of SIGBUS in the workers.
* A ring larger than the memory available (or one slot of it, as a
  65535 x 65535 sample makes) fails at ``start()``, before anything is
  allocated and before any worker starts, saying the bytes needed, the bytes
  available and what to change.
* Every page is reserved when the ring is made, and a SIGKILLed consumer leaves
  no memory behind once its workers have noticed and exited; the memfd path
  never reads or writes ``/dev/shm``.
* The named fallback (memfd unavailable: ``ENOSYS``) sweeps only segments it can
  prove dead: this user's, made in this PID namespace since this boot, whose
  owner pid is gone.  Another user's, another namespace's (a live ring of a
  container sharing ``/dev/shm``) and an older version's are kept with a
  ``RuntimeWarning``, and ``start()`` goes on.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import echo_native as en
from echo_native import _ring
from echo_native import memory as mem
from echo_native import ring as rg
from echo_native.memory import RingMemoryError, remove_stale_segments
from echo_native.ring import Ring

TESTS = Path(__file__).resolve().parent.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
import ring_helpers as rh  # noqa: E402

MB = 2**20

# Named segments are planted in, swept from and listed in the machine's one /dev/shm:
# under pytest-xdist these tests share one worker (with test_faults.py's sweeps), so no
# sweep removes a segment another test planted and expects to find.
pytestmark = pytest.mark.xdist_group("dev_shm")


def _dead_pid():
    out = subprocess.run([sys.executable, str(TESTS / "ring_helpers.py"), "exit"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def _mine():
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"echo_native-{os.getpid()}-")}


# ---- a 64 MB /dev/shm, in a private mount namespace -------------------------------------------
_SMALL_SHM_SCRIPT = r'''
import json, os, sys, warnings
import echo_native as en
from echo_native import memory as mem
from echo_native import ring as rg

root, case = sys.argv[1], sys.argv[2]
st = os.statvfs("/dev/shm")
out = {"shm_bytes": st.f_blocks * st.f_frsize, "listing": sorted(os.listdir("/dev/shm"))}
# 512 px crops, 24 per batch, 4 slots: a 75 MiB ring, more than the 64 MB mount.
L = en.Loader(en.ImageFolder(root), batch_size=24, image_size=512, workers=2, slots=4,
              worker_mode="process", seed=1, timeout=60)
if case == "backstop":
    # Without the check up front, the reservation itself fails (ENOSPC), never a SIGBUS.
    mem.memory_available = lambda *a, **k: (None, "")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        with L:
            out["ring"] = L.ring_name
            out["backing"] = getattr(L.ring, "backing", None)
            out["total_bytes"] = L.ring.layout.total_bytes
            # Two epochs of two batches: every slot written whole, 75 MiB of pixels.
            out["ids"] = sorted(int(i) for _ in range(2) for b in L for i in b.sample_ids)
            out["stats"] = L.stats()
            out["shm_used"] = (st.f_blocks - os.statvfs("/dev/shm").f_bfree) * st.f_frsize
    except MemoryError as e:
        out["error"] = [type(e).__name__, str(e), e.needed, e.available]
        out["workers"] = L.worker_pids()
out["warnings"] = [str(w.message) for w in caught]
out["listing_after"] = sorted(os.listdir("/dev/shm"))
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def small_shm(tmp_path_factory):
    """A command prefix that runs its command with a fresh 64 MB tmpfs on /dev/shm, in a
    mount namespace of its own (the host's /dev/shm is untouched)."""
    mount = "mount -t tmpfs -o size=64m tmpfs /dev/shm && exec \"$0\" \"$@\""
    probe = [sys.executable, "-c", ("import os; s = os.statvfs('/dev/shm'); assert "
                                    "s.f_blocks * s.f_frsize <= 64 * 2**20 "
                                    "and not os.listdir('/dev/shm')")]
    errors = []
    for prefix in (["unshare", "-m"], ["unshare", "-r", "-m"]):
        cmd = prefix + ["sh", "-c", mount] + probe
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            errors.append(f"{' '.join(prefix)}: {e}")
            continue
        if out.returncode == 0:
            return lambda *args: prefix + ["sh", "-c", mount] + list(args)
        errors.append(f"{' '.join(prefix)}: {out.stderr.strip() or out.returncode}")
    pytest.skip("cannot mount a private 64 MB /dev/shm (unshare -m not permitted here): "
                + "; ".join(errors))


def _run_small_shm(small_shm, tmp_path, corpus_root, case, backing=None):
    script = tmp_path / "small_shm.py"
    script.write_text(_SMALL_SHM_SCRIPT)
    env = dict(os.environ)
    env.pop(mem.BACKING_ENV, None)
    if backing:
        env[mem.BACKING_ENV] = backing
    proc = subprocess.run(small_shm(sys.executable, str(script), str(corpus_root), case),
                          capture_output=True, text=True, timeout=240, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_memfd_ring_larger_than_a_64mb_dev_shm_runs(small_shm, tmp_path, corpus_root):
    """A 75 MiB ring on a 64 MB /dev/shm, every slot written whole: two epochs with every
    id once each, no worker death (a named segment there dies of SIGBUS), and /dev/shm
    stays empty."""
    out = _run_small_shm(small_shm, tmp_path, corpus_root, "run")
    assert out["shm_bytes"] <= 64 * MB
    assert out["backing"] == "memfd" and out["ring"].startswith("/memfd:echo_native-")
    assert out["total_bytes"] > out["shm_bytes"]
    assert out["ids"] == sorted(list(range(48)) * 2)
    assert out["stats"]["worker_restarts"] == 0 and out["stats"]["failures"] == {}
    assert out["listing"] == out["listing_after"] == [] and out["shm_used"] == 0
    assert not [w for w in out["warnings"] if "died" in w]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["checked", "backstop"])
def test_named_fallback_on_a_64mb_dev_shm_fails_at_start_clearly(small_shm, tmp_path,
                                                                  corpus_root, case):
    """The named fallback forced on a 64 MB /dev/shm: start() raises one RingMemoryError
    naming the bytes needed, the space free in /dev/shm and what to change; no worker
    starts, nothing is left in /dev/shm.  Without the check up front ("backstop"), the
    reservation (fallocate) fails the same way: never a SIGBUS later."""
    out = _run_small_shm(small_shm, tmp_path, corpus_root, case, backing="shm")
    kind, msg, needed, available = out["error"]
    assert kind == "RingMemoryError"
    assert needed > 64 * MB and f"needs {needed:,} bytes" in msg
    if case == "checked":
        assert available <= 64 * MB and f"{available:,} bytes" in msg
        assert "free space in /dev/shm (statvfs)" in msg
    else:
        assert "No space left on device" in msg
    for knob in ("batch_size", "slots", "image_size", "--shm-size", "batch_size=24, slots=4"):
        assert knob in msg, knob
    assert out["workers"] == [] and out["listing_after"] == []
    assert "ring" not in out


# ---- larger than the machine ---------------------------------------------------------------
def _never_decoded(n=8):
    """A source no worker can decode a byte of (so that a start the check failed to stop
    would not fill a huge ring on today's code either)."""
    return en.Samples([b"not an image"] * n, np.zeros(n, np.int64))


@pytest.mark.timeout(60)  # reserving the ring first would take minutes, or the machine
def test_ring_larger_than_memory_fails_at_start_before_allocating():
    """slots x batch x sample far beyond the memory available: start() raises one
    RingMemoryError (a MemoryError) at once, naming needed and available bytes and the
    settings, with no worker started and no memory taken."""
    available, where = mem.memory_available()
    assert available is not None and where
    side = 2048                                     # 12 MiB a sample
    per_slot = 16 * side * side * 3
    slots = max(2, 4 * available // per_slot)        # 4x the memory available
    L = en.Loader(_never_decoded(), batch_size=16, image_size=side, slots=int(slots),
                  workers=1, on_error="skip", timeout=10)
    with pytest.raises(RingMemoryError) as info:
        L.start()
    e = info.value
    assert isinstance(e, MemoryError)
    assert e.needed > 3 * available and e.limit == where
    msg = str(e)
    assert f"needs {e.needed:,} bytes" in msg and f"{e.available:,} bytes" in msg
    assert where in msg
    for knob in ("batch_size", "slots", "image_size", f"slots={slots}", "batch_size=16"):
        assert knob in msg, knob
    assert L.ring is None and L.worker_pids() == []
    assert rh.ring_memory(os.getpid()) == {}


@pytest.mark.parametrize("size, message", [(70000, "at most 65535"), (65535, "slot")])
def test_impossible_image_sizes_are_refused(size, message):
    """image_size=70000 is refused at construction; 65535 (a 12 GiB sample) when one slot
    of it exceeds the memory available, at start(), with the clear error."""
    if size > 65535:
        with pytest.raises(ValueError, match=message):
            en.Loader(_never_decoded(), batch_size=8, image_size=size)
        return
    available, _ = mem.memory_available()
    batch = int(available // (size * size * 3)) + 1  # one slot more than all of it
    L = en.Loader(_never_decoded(), batch_size=batch, image_size=size, slots=2, workers=1,
                  on_error="skip", timeout=10)
    with pytest.raises(RingMemoryError, match="not even one slot fits") as info:
        L.start()
    assert f"{size * size * 3:,} bytes" in str(info.value)
    assert L.ring is None and L.worker_pids() == []


def test_create_refuses_before_allocating():
    """Ring.create checks the whole size first: a 2**50-byte geometry (legal, absurd) is a
    RingMemoryError at once, and an impossible one a ValueError; neither leaves anything."""
    with pytest.raises(RingMemoryError, match=r"needs [\d,]+ bytes"):
        Ring.create(4, 1024, 2**38)
    with pytest.raises(ValueError, match="impossible ring geometry"):
        Ring.create(2, 2**20, 2**44)
    assert rh.ring_memory(os.getpid()) == {} and not _mine()


# ---- reserved up front, freed on every exit --------------------------------------------------
_CONSUMER_SCRIPT = r'''
import json, os, sys, time
import echo_native as en
root, out = sys.argv[1], sys.argv[2]
# 256 px crops, 256 per batch, 5 slots: a 240 MiB ring (48 images fill a fraction of it).
L = en.Loader(en.ImageFolder(root), batch_size=256, image_size=256, workers=2, slots=5,
              worker_mode="process", seed=1, timeout=60)
with L:
    next(iter(L))
    info = {"pid": os.getpid(), "workers": L.worker_pids(), "ring": L.ring_name,
            "total_bytes": L.ring.layout.total_bytes}
    with open(out + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(out + ".tmp", out)
    while True:
        time.sleep(1)
'''


def _memfd_bytes(pid, ring_name):
    """Bytes of memory the memfd ``ring_name`` holds (its file's allocated blocks, read
    through ``pid``'s descriptor of it): the ring's own accounting, untouched by
    whatever else the machine does with shared memory."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        link = f"/proc/{pid}/fd/{fd}"
        try:
            if os.readlink(link).startswith(ring_name):
                return os.stat(link).st_blocks * 512
        except OSError:
            continue
    raise AssertionError(f"process {pid} holds no descriptor of {ring_name}")


@pytest.mark.timeout(120)
def test_memory_reserved_at_start_and_freed_after_a_consumer_sigkill(corpus_root, tmp_path):
    """The whole ring is in memory (the memfd's allocated blocks) once start() returns,
    not only the pages written; kill -9 of the consumer: its workers exit within their
    0.25 s poll and no process holds the memfd any more (descriptor or mapping), which
    is when the kernel frees its pages, without anyone unlinking anything."""
    script, out = tmp_path / "consumer.py", tmp_path / "consumer.json"
    script.write_text(_CONSUMER_SCRIPT)
    p = subprocess.Popen([sys.executable, str(script), str(corpus_root), str(out)],
                         stderr=subprocess.PIPE)
    try:
        while not out.exists():
            assert p.poll() is None, p.stderr.read().decode()[-3000:]
            time.sleep(0.05)
        info = json.loads(out.read_text())
        pid, workers, total = info["pid"], info["workers"], info["total_bytes"]
        assert total > 200 * MB
        # Reserved, not just sized (ftruncate alone allocates nothing): 48 decoded images
        # would touch ~10 MiB of it.
        assert _memfd_bytes(pid, info["ring"]) >= total
        assert set(rh.ring_memory(pid)[info["ring"]]) == {pid, *workers}
        os.kill(pid, signal.SIGKILL)
        # The workers follow their consumer; the wait ends or the test's timeout fails it.
        while rh.ring_memory(pid) or any(rh.alive(w) for w in workers):
            time.sleep(0.05)
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"echo_native-{pid}-")]
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
        p.stderr.close()


@pytest.mark.timeout(60)
def test_memfd_path_never_touches_dev_shm(corpus_root, monkeypatch):
    """A process-mode run on a memfd ring never sweeps, lists or writes /dev/shm: the
    workers map the memfd they inherited (and closed their descriptor of)."""
    def forbidden(*a, **k):
        raise AssertionError("the memfd path looked at /dev/shm")

    real_statvfs = os.statvfs

    def statvfs(path):
        if str(path).startswith("/dev/shm"):
            forbidden()
        return real_statvfs(path)

    before = set(os.listdir("/dev/shm"))
    monkeypatch.setattr(rg, "remove_stale_segments", forbidden)
    monkeypatch.setattr(os, "statvfs", statvfs)
    with en.Loader(en.ImageFolder(corpus_root), batch_size=8, image_size=32, workers=2,
                   worker_mode="process", seed=2) as L:
        batches = sum(1 for _ in L)
        name, workers = L.ring_name, L.worker_pids()
        # The consumer holds the memfd open and mapped; each worker maps it and has
        # closed the descriptor it inherited (one may still be importing: wait for it).
        want = {os.getpid(): {"fd", "map"}, **{w: {"map"} for w in workers}}
        while rh.memfd_holders(name[len("/memfd:"):]) != {name[len("/memfd:"):]: want}:
            time.sleep(0.05)  # until the test's timeout
        for w in workers:
            with open(f"/proc/{w}/maps") as f:
                maps = f.read()
            assert name in maps and "/dev/shm/" not in maps
            assert not [t for t in _links(w) if "memfd:" in t]   # its copy closed once mapped
    assert batches == len(L)
    # Only names this run could have made: other processes may use /dev/shm meanwhile.
    ours = tuple(f"echo_native-{p}-" for p in (os.getpid(), *workers))
    assert not [n for n in set(os.listdir("/dev/shm")) - before if n.startswith(ours)]


def _links(pid):
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return out


# ---- the named fallback -------------------------------------------------------------------------
def test_fallback_to_named_where_memfd_is_unavailable(monkeypatch, corpus_root):
    """memfd_create failing with ENOSYS (an old kernel): the ring is a named segment in
    /dev/shm, named with this pid, PID namespace and boot; a process-mode run works and
    close() removes it.  ECHO_NATIVE_RING_BACKING=shm forces the same; =memfd refuses
    the fallback; anything else is a ValueError."""
    def no_memfd(label, size):
        raise OSError(errno.ENOSYS, "memfd_create: Function not implemented")

    monkeypatch.setattr(rg, "_memfd_segment", no_memfd)
    ns, boot = mem._origin()
    with en.Loader(en.ImageFolder(corpus_root), batch_size=8, image_size=32, workers=2,
                   worker_mode="process", seed=2) as L:
        name = L.ring_name
        assert L.ring.backing == "shm"
        assert name.startswith(f"/echo_native-{os.getpid()}-{ns}-{boot}-")
        assert name[1:] in _mine()
        assert sum(1 for _ in L) == len(L)
    assert name[1:] not in _mine()
    monkeypatch.setenv(mem.BACKING_ENV, "memfd")
    with pytest.raises(OSError, match="memfd_create"):
        Ring.create(2, 1, 8)
    monkeypatch.undo()
    monkeypatch.setenv(mem.BACKING_ENV, "shm")
    r = Ring.create(2, 1, 8)
    assert r.backing == "shm" and r.name[1:] in _mine()
    r.unlink()
    monkeypatch.setenv(mem.BACKING_ENV, "tmpfs")
    with pytest.raises(ValueError, match="ECHO_NATIVE_RING_BACKING"):
        Ring.create(2, 1, 8)


@pytest.fixture
def planted():
    """Segments planted in /dev/shm, removed afterwards."""
    names = []

    def plant(name, uid=None):
        seg = _ring.Segment(name, 4096, create=True)
        del seg
        names.append(name)
        if uid is not None:
            os.chown("/dev/shm" + name, uid, -1)
        return name[1:]

    yield plant
    for name in names:
        try:
            os.unlink("/dev/shm" + name)
        except FileNotFoundError:
            pass


def _start_named(corpus_root, monkeypatch):
    """A Loader on the named fallback: start(), one batch, close(); the warnings it gave."""
    monkeypatch.setenv(mem.BACKING_ENV, "shm")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with en.Loader(en.ImageFolder(corpus_root), batch_size=8, image_size=16, workers=1,
                       worker_mode="thread") as L:
            assert not L.ring_name.startswith("/memfd:") and len(L.next_batch()) == 8
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_sweep_keeps_another_users_segment_and_start_goes_on(planted, corpus_root,
                                                             monkeypatch):
    """A leftover of another user (its job was OOM-killed; sticky /dev/shm would refuse the
    unlink anyway) is kept with a warning naming its uid, and start() succeeds."""
    ns, boot = mem._origin()
    dead = _dead_pid()
    if os.geteuid() == 0:
        foreign = planted(f"/echo_native-{dead}-{ns}-{boot}-0000000000aa", uid=65534)
        uid = 65534
    else:   # cannot give a file away: be another user instead
        foreign = planted(f"/echo_native-{dead}-{ns}-{boot}-0000000000aa")
        uid = os.geteuid()
        monkeypatch.setattr(rg.os, "geteuid", lambda: uid + 1)
    warned = _start_named(corpus_root, monkeypatch)
    assert foreign in os.listdir("/dev/shm")
    assert any(foreign in w and f"uid {uid}" in w for w in warned), warned


def test_sweep_survives_an_unlink_it_is_refused(planted, corpus_root, monkeypatch):
    """An unlink refused (PermissionError) never stops start(): the segment is kept with a
    warning saying so."""
    ns, boot = mem._origin()
    stuck = planted(f"/echo_native-{_dead_pid()}-{ns}-{boot}-0000000000bb")
    real = _ring.unlink

    def refuse(name):
        if name[1:] == stuck:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real(name)

    monkeypatch.setattr(rg._ring, "unlink", refuse)
    warned = _start_named(corpus_root, monkeypatch)
    assert stuck in os.listdir("/dev/shm")
    assert any(stuck in w and "Operation not permitted" in w for w in warned), warned


def test_sweep_keeps_a_live_ring_of_another_pid_namespace(planted, corpus_root, monkeypatch):
    """A ring made in another PID namespace (a container sharing /dev/shm), whose pid is
    dead here but may be alive there, is never removed; nor one from another boot, nor an
    older version's name that records no namespace (the old sweep removed it, and with
    it a live ring); a dead owner's in this namespace is.  start() warns and goes on."""
    ns, boot = mem._origin()
    dead = _dead_pid()
    other_ns = planted(f"/echo_native-{dead}-{ns + 1}-{boot}-0000000000cc")
    other_boot = planted(f"/echo_native-{dead}-{ns}-{'f' * 32}-0000000000dd")
    legacy = planted(f"/echo_native-{dead}-0000000000ee")
    stale = planted(f"/echo_native-{dead}-{ns}-{boot}-0000000000ff")
    warned = _start_named(corpus_root, monkeypatch)
    listing = os.listdir("/dev/shm")
    assert other_ns in listing and other_boot in listing and legacy in listing
    assert stale not in listing
    text = " ".join(warned)
    assert f"{other_ns} (made in another PID namespace" in text
    assert f"{other_boot} (made in another boot" in text
    assert f"{legacy} (from an older echo_native" in text
    with pytest.warns(RuntimeWarning, match="another PID namespace"):
        assert remove_stale_segments() == []              # and never later either


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_available_memory_counts_the_memory_cgroup(monkeypatch, version):
    """A container's memory limit bounds the ring as MemAvailable does (memfd pages are
    charged to the creator's cgroup): headroom = limit - (usage - reclaimable page
    cache), the tightest over the cgroup and its ancestors; "max" means no limit."""
    GiB = 2**30
    if version == "v2":
        files = {"/proc/self/cgroup": "0::/job/step\n",
                 "/sys/fs/cgroup/job/memory.max": str(4 * GiB),
                 "/sys/fs/cgroup/job/memory.current": str(3 * GiB),
                 "/sys/fs/cgroup/job/memory.stat": f"anon 1\ninactive_file {GiB}\n"
                                                   f"active_file {GiB // 2}\n",
                 "/sys/fs/cgroup/job/step/memory.max": "max",
                 "/sys/fs/cgroup/job/step/memory.current": str(GiB)}
        where = "/sys/fs/cgroup/job"
    else:
        files = {"/proc/self/cgroup": "5:cpu:/x\n4:memory:/job\n0::/\n",
                 "/sys/fs/cgroup/memory/job/memory.limit_in_bytes": str(4 * GiB),
                 "/sys/fs/cgroup/memory/job/memory.usage_in_bytes": str(3 * GiB),
                 "/sys/fs/cgroup/memory/job/memory.stat":
                     f"total_inactive_file {GiB}\ntotal_active_file {GiB // 2}\n",
                 "/sys/fs/cgroup/memory/memory.limit_in_bytes": str(2**63 - 4096),
                 "/sys/fs/cgroup/memory/memory.usage_in_bytes": str(GiB)}
        where = "/sys/fs/cgroup/memory/job"
    files["/proc/meminfo"] = f"MemTotal: {64 * 2**20} kB\nMemAvailable: {32 * 2**20} kB\n"
    monkeypatch.setattr(mem, "_read", lambda path: files.get(path))
    headroom, what = mem._cgroup_headroom()
    assert headroom == 4 * GiB - (3 * GiB - GiB - GiB // 2) and where in what
    assert mem.memory_available() == (headroom, what)
    with pytest.raises(RingMemoryError, match=f"{headroom:,} bytes .*memory cgroup limit"):
        Ring.create(2, 1, 3 * GiB)

"""Faults around the ring and the worker pool: killed and failing workers, hung
reads, a killed parent, every exit path's cleanup, leaks over many start/stop
cycles, and corrupt files under each on_error policy."""
from __future__ import annotations

import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import echo_native as en
from echo_native import _ring
from echo_native import memory as mem
from echo_native.memory import remove_stale_segments
from echo_native.ring import Ring

TESTS = Path(__file__).resolve().parent.parent      # ring_helpers.py lives there
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
import ring_helpers as rh  # noqa: E402


def _own_segments():
    return set(rh.segments(os.getpid()))


def _gone(ring_name, pids):
    """Assert the ring is let go of (close() closes its memfd before it returns), then
    wait until every pid has exited and assert that no process holds the ring's memory
    any more (descriptor or mapping); the calling test's timeout marker bounds the
    wait."""
    assert ring_name[1:] not in _own_segments(), f"{ring_name} is still held open"
    while any(rh.alive(p) for p in pids):
        time.sleep(0.05)
    gc.collect()
    assert ring_name not in rh.ring_memory(os.getpid()), "the ring's memory is still held"


def _epoch(loader):
    return [b.copy() for b in loader]


def _same(a, b):
    return len(a) == len(b) and all(
        np.array_equal(x.sample_ids, y.sample_ids) and np.array_equal(x.images, y.images)
        and np.array_equal(x.labels, y.labels) and np.array_equal(x.flips, y.flips)
        for x, y in zip(a, b))


def _reference(src, **kw):
    with en.Loader(src, worker_mode="thread", workers=2, **kw) as L:
        return _epoch(L)


# ---- a worker killed mid-epoch --------------------------------------------------------------
@pytest.mark.timeout(120)
def test_sigkill_worker_mid_batch_epoch_completes(corpus_root):
    """SIGKILLed workers mid-batch are replaced; the epoch has every id once, same pixels.

    A dead worker is noticed and its batch redone by the supervisor, not by the
    consumer's timeout: that is 600 s here, past the test's own timeout.
    """
    src = en.ImageFolder(corpus_root)
    kw = dict(batch_size=4, image_size=32, seed=9, slots=3)
    ref = _reference(src, **kw)
    got, killed = [], []
    with pytest.warns(RuntimeWarning, match="died"):
        with en.Loader(rh.SlowSource(src, 0.02), workers=2, worker_mode="process",
                       timeout=600, **kw) as L:
            it = iter(L)
            got.append(next(it).copy())
            for i, batch in enumerate(it, start=1):
                if i in (1, 6):                   # kill worker 0, later worker 1
                    w = 0 if i == 1 else 1
                    rh.wait_until_holding(L, w, timeout=60)
                    killed.append(L.worker_pids()[w])
                    os.kill(killed[-1], signal.SIGKILL)
                got.append(batch.copy())
            stats = L.stats()
            pids_after = L.worker_pids()
    ids = np.concatenate([b.sample_ids for b in got])
    assert sorted(ids.tolist()) == list(range(len(src)))      # every id exactly once
    assert _same(got, ref)                                     # redone batches are identical
    assert stats["worker_restarts"] >= 2
    assert not set(killed) & set(pids_after)


@pytest.mark.timeout(120)
def test_second_death_while_the_first_replacement_boots(corpus_root, tmp_path):
    """Worker 0 dies; its ticket goes to a replacement still starting its interpreter
    (it has claimed nothing yet) when worker 1 dies too.  The replacement owes that
    ticket: it must not be handed out a second time (two fills of one ticket wedge
    the ring), and the epoch still has every id once with the same pixels.  The reads
    wait on a shut gate until both deaths, so each worker still holds the ticket it
    was seen holding when it is killed."""
    src = en.ImageFolder(corpus_root)
    kw = dict(batch_size=4, image_size=32, seed=5, slots=4)
    ref = _reference(src, **kw)
    gate = tmp_path / "gate"
    with pytest.warns(RuntimeWarning, match="died"):
        with en.Loader(rh.GatedSource(src, gate), workers=2, worker_mode="process",
                       timeout=60, **kw) as L:
            pool, given = L._pool, []
            spawn = pool._spawn

            def spy(index, redo, send=True):
                given.append((index, list(redo)))
                return spawn(index, redo, send)
            pool._spawn = spy
            held = [rh.wait_until_holding(L, w) for w in (0, 1)]
            for w in (0, 1):  # the second death lands before the first replacement boots
                p = pool._workers[w]
                os.kill(p.pid, signal.SIGKILL)
                p.join(60)   # returns once it is dead: the check below must see the death
                assert not p.is_alive()
                pool.check(L.position)
            gate.touch()
            got = _epoch(L)
    redone = [t for _, redo in given for t in redo]
    assert sorted(redone) == sorted(set(redone)), f"a ticket handed out twice: {given}"
    assert set(held) <= set(redone)
    assert _same(got, ref)


@pytest.mark.timeout(120)
def test_workers_outlive_the_thread_that_started_them(corpus_root):
    """A loader started from a thread that then ends (a user's prefetch thread): the
    parent-death signal follows the forking thread, not the process, so the workers
    must not have been forked by that thread; none dies and none is replaced."""
    src = en.ImageFolder(corpus_root)
    L = en.Loader(src, batch_size=4, image_size=32, workers=2, worker_mode="process",
                  timeout=60)
    def start_and_wait_for_a_batch():   # the workers are up (and armed) when it ends
        L.start()
        deadline = time.monotonic() + 30
        while not L.ring.is_published(0) and time.monotonic() < deadline:
            time.sleep(0.01)
    try:
        starter = threading.Thread(target=start_and_wait_for_a_batch)
        starter.start()
        tid = starter.native_id
        starter.join()
        pids = L.worker_pids()
        # join() returns before the kernel has ended the thread; once its task is gone
        # from /proc, any parent-death signal it caused has been sent.
        rh.wait_for(lambda: not os.path.exists(f"/proc/self/task/{tid}"),
                    "the starter thread's end")
        assert not [p for p in pids if rh.doomed(p)], "a worker died with the starter thread"
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # "worker died; restarting it" would raise
            ids = np.concatenate([b.sample_ids.copy() for b in L])
        assert sorted(ids.tolist()) == list(range(len(src)))
        assert L.stats()["worker_restarts"] == 0 and L.worker_pids() == pids
    finally:
        L.close()


@pytest.mark.timeout(120)   # hang guard (the wait for both workers to block, the epoch)
def test_sigkill_all_workers_while_ring_is_full(corpus_root):
    """Killing every worker while each waits on a full ring: their tickets are redone."""
    src = en.ImageFolder(corpus_root)
    kw = dict(batch_size=6, image_size=24, seed=2, slots=2)
    ref = _reference(src, **kw)
    with pytest.warns(RuntimeWarning, match="died"):
        with en.Loader(src, workers=2, worker_mode="process", timeout=30, **kw) as L:
            it = iter(L)
            got = [next(it).copy()]
            # slot 1 filled, slot 0 held by the consumer: both workers hold later
            # tickets (2 and 3) and sleep waiting for a free slot
            rh.wait_for(lambda: L._ring.is_published(1) and all(
                2 < L._ring.claim(i) < 2**63 for i in range(2)), "both workers past the ring")
            for pid in L.worker_pids():
                rh.wait_for(lambda p=pid: rh.asleep_on_ring(p, ring_name=L.ring_name),
                            f"worker {pid} asleep waiting for a free slot")
            held = sorted(L._ring.claim(i) - 1 for i in range(2))
            for pid in L.worker_pids():
                os.kill(pid, signal.SIGKILL)
            got.extend(b.copy() for b in it)
            assert L.stats()["worker_restarts"] >= 2
    assert held == [2, 3]                        # they were past the ring, waiting
    assert _same(got, ref)


# ---- exceptions and hangs inside workers ----------------------------------------------------
@pytest.mark.parametrize("mode", ["process", "thread"])
def test_unexpected_exception_in_worker_reaches_consumer_with_traceback(corpus_root, mode):
    """A non-OSError raised by read() surfaces as WorkerError carrying the worker's traceback."""
    src = en.ImageFolder(corpus_root)
    L = en.Loader(rh.RaisingSource(src, []), batch_size=4, image_size=16, workers=2, seed=3,
                  worker_mode=mode)
    bad = int(L.plan.epoch_order(0)[10])            # in batch 2
    L = en.Loader(rh.RaisingSource(src, [bad]), batch_size=4, image_size=16, workers=2,
                  seed=3, worker_mode=mode, timeout=30)
    delivered = 0
    with L:
        name = L.ring_name
        with pytest.raises(en.WorkerError) as ei:
            for _ in L:
                delivered += 1
    msg = str(ei.value)
    assert delivered == 2
    assert "Traceback (most recent call last)" in msg
    assert "LookupError" in msg and f"deliberate failure reading sample {bad}" in msg
    assert "batch 2" in msg
    assert name[1:] not in _own_segments()


@pytest.mark.slow
@pytest.mark.timeout(120)   # hang guard: waiting for the killed workers to exit
def test_hung_worker_trips_the_timeout(corpus_root):
    """Workers hung in read(): the consumer gets TimeoutError naming the wait, not before
    the 2 s timeout, and close() kills the hung workers after its grace instead of
    waiting for them forever (the test's timeout would fail it)."""
    src = en.ImageFolder(corpus_root)
    L = en.Loader(rh.HangingSource(src, range(len(src))), batch_size=4, image_size=16,
                  workers=2, worker_mode="process", timeout=2)
    with L:
        name, pids = L.ring_name, L.worker_pids()
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError) as ei:
            L.next_batch()
        waited = time.perf_counter() - t0
    msg = str(ei.value)
    del ei                  # its traceback holds the consumer's frames, so the ring's mapping
    assert waited >= 2.0                       # not before the timeout
    assert "waited 2 s for batch 0" in msg and "timeout" in msg
    assert "worker" in msg
    _gone(name, pids)


# ---- the parent dies -----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(120)   # hang guard: the child's start, the workers' exit
def test_parent_sigkilled_workers_exit_and_segment_removed(corpus_root, tmp_path):
    """kill -9 of the process owning a Loader: its workers exit, and once they have, no
    process holds the ring's memory (memfd: nothing to unlink), and /dev/shm has nothing."""
    out = tmp_path / "parent.json"
    p = subprocess.Popen([sys.executable, str(TESTS / "ring_helpers.py"), "parent",
                          str(corpus_root), str(out)], stderr=subprocess.PIPE)
    try:
        while not out.exists():
            assert p.poll() is None, p.stderr.read().decode()[-3000:]
            time.sleep(0.05)
        info = json.loads(out.read_text())
        pid, workers = info["pid"], info["workers"]
        assert info["ring"] == f"/{rh.segments(pid)[0]}"
        assert info["ring"].startswith(f"/memfd:echo_native-{pid}-")
        # The parent holds it by descriptor and mapping, each worker by mapping alone.
        assert set(rh.ring_memory(pid)[info["ring"]]) == {pid, *workers}
        assert all(rh.alive(w) for w in workers)
        os.kill(pid, signal.SIGKILL)
        # Not reaped yet: the parent is a zombie, which must count as dead.
        while any(rh.alive(w) for w in workers) or rh.ring_memory(pid):
            time.sleep(0.05)
        assert rh.proc_state(pid) == "Z"
        assert not [w for w in workers if rh.alive(w)], "workers outlived their parent"
        assert rh.segments(pid) == [] and rh.ring_memory(pid) == {}, "the ring survived"
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
        p.stderr.close()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"echo_native-{pid}-")]


def _dead_pid():
    out = subprocess.run([sys.executable, str(TESTS / "ring_helpers.py"), "exit"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def _named(pid, tag, origin=None):
    """A named-segment name as the /dev/shm fallback makes them (origin: this process's
    pid namespace and boot unless given)."""
    ns, boot = origin or mem._origin()
    return f"/echo_native-{pid}-{ns}-{boot}-{tag}"


@pytest.mark.xdist_group("dev_shm")   # sweeps /dev/shm: one worker with test_shm.py
@pytest.mark.timeout(60)   # hang guard: waiting for the child to become a zombie
def test_remove_stale_segments_of_dead_and_zombie_owners():
    """Named segments (the fallback) of exited or zombie owners in this PID namespace are
    unlinked; a live owner's is kept."""
    dead = _dead_pid()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    names = {}
    try:
        while rh.proc_state(zombie.pid) != "Z":
            time.sleep(0.01)
        names = {"dead": _named(dead, "abc123def456"),
                 "zombie": _named(zombie.pid, "00ff00ff00ff"),
                 "live": _named(os.getpid(), "feedfacecafe")}
        for name in names.values():
            del_me = _ring.Segment(name, 4096, create=True)
            del del_me                                       # unmapped, name stays
        removed = remove_stale_segments()
        assert names["dead"][1:] in removed and names["zombie"][1:] in removed
        assert names["live"][1:] not in removed
        listing = os.listdir("/dev/shm")
        assert names["dead"][1:] not in listing and names["zombie"][1:] not in listing
        assert names["live"][1:] in listing
    finally:
        zombie.wait()
        for name in names.values():
            _ring.unlink(name)


@pytest.mark.xdist_group("dev_shm")   # sweeps /dev/shm: one worker with test_shm.py
def test_named_ring_create_cleans_stale_segments_and_memfd_never_looks():
    """Ring.create of a named ring (the fallback) removes segments whose owner is gone;
    a memfd ring (the default) never reads or touches /dev/shm."""
    stale = _named(_dead_pid(), "0123456789ab")
    seg = _ring.Segment(stale, 4096, create=True)
    del seg
    assert stale[1:] in os.listdir("/dev/shm")
    try:
        r = Ring.create(2, 1, 8)                       # memfd
        assert r.backing == "memfd" and stale[1:] in os.listdir("/dev/shm")
        r.unlink()
        r = Ring.create(2, 1, 8, backing="shm")
        try:
            assert r.backing == "shm" and r.name[1:] in os.listdir("/dev/shm")
            assert stale[1:] not in os.listdir("/dev/shm")
        finally:
            r.unlink()
    finally:
        _ring.unlink(stale)


# ---- every exit path removes the segment -----------------------------------------------------
@pytest.mark.timeout(60)   # hang guard: waiting for the workers to exit
@pytest.mark.parametrize("exc", [KeyboardInterrupt, ValueError])
def test_exception_inside_with_removes_segment(corpus_root, exc):
    """KeyboardInterrupt or an error inside `with Loader` stops workers and unlinks the ring."""
    src = en.ImageFolder(corpus_root)
    with pytest.raises(exc):
        with en.Loader(src, batch_size=4, image_size=16, workers=2) as L:
            name, pids = L.ring_name, L.worker_pids()
            assert name[1:] in _own_segments() and len(pids) == 2
            L.next_batch()
            raise exc()
    _gone(name, pids)


@pytest.fixture
def terminal_ctrl_c():
    """Ctrl-C raising KeyboardInterrupt, as in a terminal, for the test's duration: a test
    run started as a background job of a non-interactive shell inherits SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.slow
@pytest.mark.timeout(60)   # hang guard: a worker that kept reading would run past it
def test_ctrl_c_while_waiting_for_a_batch_removes_segment(corpus_root, tmp_path,
                                                           terminal_ctrl_c):
    """A real SIGINT while blocked in next_batch raises KeyboardInterrupt and cleans up:
    the workers finish the batch in hand and take no new ticket from the closed ring.

    Every read is logged: the reads after the interrupt are those of at most one
    ticket per worker (4 samples each), never of a ticket taken after the close.
    """
    log = tmp_path / "reads"
    src = rh.SlowSource(en.ImageFolder(corpus_root), 0.5, log=str(log))

    def interrupt_mid_batch(L):
        for w in range(2):   # each worker is reading a batch it holds
            rh.wait_until_holding(L, w, timeout=60)
        rh.wait_for(lambda: rh.asleep_on_ring(os.getpid(), ring_name=L.ring_name),
                    "the consumer asleep in next_batch")
        os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        with en.Loader(src, batch_size=4, image_size=16, workers=2) as L:
            name, pids = L.ring_name, L.worker_pids()
            sender = threading.Thread(target=interrupt_mid_batch, args=(L,))
            sender.start()
            L.next_batch()                     # needs 2 s of reads; interrupted in the wait
    sender.join()
    _gone(name, pids)
    reads = log.read_text().split() if log.exists() else []
    assert len(reads) <= 2 * 4, f"{len(reads)} reads: a ticket was taken after the close"
    assert len(reads) == len(set(reads))


@pytest.mark.timeout(60)   # hang guard: waiting for the workers to exit
@pytest.mark.parametrize("mode", ["process", "thread"])
def test_garbage_collected_loader_removes_segment(corpus_root, mode):
    """An un-closed Loader in a reference cycle, collected by gc, stops workers and unlinks."""
    src = en.ImageFolder(corpus_root)
    L = en.Loader(src, batch_size=4, image_size=16, workers=2, worker_mode=mode)
    it = iter(L)
    batch = next(it)
    name, pids = L.ring_name, L.worker_pids()
    L.cycle = L                                 # only the cycle collector can free it
    assert name[1:] in _own_segments()
    del L, it, batch
    gc.collect()
    _gone(name, pids)


def test_close_is_idempotent_and_reopens(corpus_root):
    """close() twice is harmless; starting again makes a new ring and works."""
    src = en.ImageFolder(corpus_root)
    L = en.Loader(src, batch_size=8, image_size=16, workers=1, worker_mode="thread")
    L.start()
    first = L.ring_name
    L.close()
    L.close()
    assert L.ring_name is None and first[1:] not in _own_segments()
    with L:
        assert L.ring_name != first
        assert len(L.next_batch()) == 8
    assert not _own_segments() & {L.ring_name}


# ---- no leaks over many start/stop cycles ------------------------------------------------------
def _fds():
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("threads, processes", [(10, 2),
                                                 pytest.param(100, 10, marks=pytest.mark.slow)])
def test_start_stop_cycles_leak_nothing(corpus_root, threads, processes):
    """Thread-mode and process-mode start/stop cycles (10 + 2; 100 + 10 in the slow run)
    leave no segment, process, fd or thread."""
    src = en.ImageFolder(corpus_root)

    def cycle(mode):
        with en.Loader(src, batch_size=4, image_size=16, workers=2, slots=2,
                       worker_mode=mode) as L:
            L.next_batch()
            return L.ring_name, L.worker_pids()

    cycle("process")                             # warm-up: lazily imported modules
    cycle("thread")
    gc.collect()
    fds0, kids0, threads0 = _fds(), rh.descendants(), set(threading.enumerate())
    segs0 = _own_segments()
    names, pids = [], []
    for _ in range(threads):
        names.append(cycle("thread")[0])
    for _ in range(processes):
        name, p = cycle("process")
        names.append(name)
        pids.extend(p)
    gc.collect()
    assert len(set(names)) == threads + processes and len(set(pids)) == 2 * processes
    assert _own_segments() == segs0
    assert not set(names) & set(rh.ring_memory(os.getpid()))     # every ring's memory freed
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"echo_native-{os.getpid()}-")]
    assert not [p for p in pids if rh.alive(p)]
    assert rh.descendants() == kids0             # no worker left behind
    # No thread started here is left (one an earlier test left may end meanwhile).
    assert not set(threading.enumerate()) - threads0
    assert _fds() <= fds0, f"open fds grew from {fds0} to {_fds()}"


# ---- corrupt files inside a dataset -------------------------------------------------------------
@pytest.fixture
def corrupt_folder(corpus_root, tmp_path):
    """24 good JPEGs + a truncated JPEG, random bytes named .jpg, and a file deleted after
    listing.  Returns (source, {sample id: (path, reason)})."""
    root = tmp_path / "corrupt"
    files = sorted(Path(corpus_root).rglob("*.jpg"))[:24]
    for i, f in enumerate(files):
        d = root / f"class_{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, d / f.name)
    good = files[0].read_bytes()
    (root / "class_0" / "zz_truncated.jpg").write_bytes(good[:len(good) * 2 // 5])
    rng = np.random.default_rng(0)
    (root / "class_1" / "zz_random.jpg").write_bytes(rng.integers(0, 256, 5000, np.uint8)
                                                     .tobytes())
    (root / "class_2" / "zz_missing.jpg").write_bytes(good)
    src = en.ImageFolder(root)
    (root / "class_2" / "zz_missing.jpg").unlink()           # listed, then gone
    bad = {}
    for i in range(len(src)):
        p = src.path(i)
        if "zz_" in p:
            bad[i] = (p, "read" if "missing" in p else "decode")
    assert len(src) == 27 and len(bad) == 3
    return src, bad


def _collect(loader):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        batches = _epoch(loader)
    return batches, [w for w in rec if issubclass(w.category, en.SampleFailureWarning)]


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_corrupt_files_replace(corrupt_folder, mode):
    """on_error='replace': full batches, replaced samples not fresh, failures counted and named."""
    src, bad = corrupt_folder
    with en.Loader(src, batch_size=5, image_size=32, workers=2, worker_mode=mode, seed=4,
                   on_error="replace") as L:
        batches, warned = _collect(L)
        stats = L.stats()
    assert [len(b) for b in batches] == [5, 5, 5, 5, 5, 2]
    ids = np.concatenate([b.sample_ids for b in batches])
    fresh = np.concatenate([b.fresh for b in batches])
    assert int((~fresh).sum()) == 3
    assert not set(ids.tolist()) & set(bad)                  # a bad sample is never delivered
    fresh_ids = ids[fresh].tolist()
    assert sorted(fresh_ids) == sorted(set(range(len(src))) - set(bad))   # each once
    assert stats["failures"] == {"decode": 2, "read": 1}
    assert stats["fresh"] == 24 and stats["delivered"] == 27
    for path, _ in bad.values():
        assert any(path in str(w.message) and "replaced" in str(w.message) for w in warned), path
    # a replacement carries the replacement sample's label and pixels
    for b in batches:
        for j in np.flatnonzero(~b.fresh):
            rid = int(b.sample_ids[j])
            assert b.labels[j] == src.labels[rid]
            ref, _, _ = en.decode_random_crop(src.read(rid), (32, 32), 4, 0, rid, 0)
            assert np.array_equal(b.images[j], ref)


def test_corrupt_files_skip(corrupt_folder):
    """on_error='skip': bad samples are dropped, batches shrink, every good id once."""
    src, bad = corrupt_folder
    with en.Loader(src, batch_size=5, image_size=32, workers=2, seed=4, on_error="skip") as L:
        batches, warned = _collect(L)
        stats = L.stats()
    sizes = [len(b) for b in batches]
    assert len(batches) == 6 and sum(sizes) == 24 and min(sizes[:5]) < 5
    ids = np.concatenate([b.sample_ids for b in batches]).tolist()
    assert sorted(ids) == sorted(set(range(len(src))) - set(bad))
    assert all(b.fresh.all() for b in batches)
    assert stats["failures"] == {"decode": 2, "read": 1}
    for path, _ in bad.values():
        assert any(path in str(w.message) and "skipped" in str(w.message) for w in warned), path


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_corrupt_files_raise(corrupt_folder, mode):
    """on_error='raise': DecodeError naming the first bad file, after the good batches before it."""
    src, bad = corrupt_folder
    L = en.Loader(src, batch_size=5, image_size=32, workers=2, worker_mode=mode, seed=4,
                  on_error="raise")
    order = L.plan.epoch_order(0).tolist()
    first = min(order.index(i) for i in bad)
    expected_path = bad[order[first]][0]
    delivered = 0
    with L:
        name = L.ring_name
        with pytest.raises(en.DecodeError, match=re.escape(expected_path)) as ei:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", en.SampleFailureWarning)
                for _ in L:
                    delivered += 1
    assert delivered == first // 5
    assert ei.value.path == expected_path
    assert isinstance(ei.value, ValueError)
    assert name[1:] not in _own_segments()


def test_more_failures_than_the_report_holds_are_all_counted():
    """A batch whose failures overflow the slot's report area still counts every one."""
    import echo_helpers as eh
    bad = [b"not an image at all " * 4 + bytes([i]) for i in range(120)]
    blobs = bad + eh.photo_jpegs(8, 40, 48)
    names = [f"/data/{'deep/' * 12}bad_{i:03d}.jpg" for i in range(len(blobs))]
    src = en.Samples(blobs, names=names)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with en.Loader(src, batch_size=128, image_size=16, workers=1, worker_mode="thread",
                       on_error="skip", shuffle=False) as ld:
            batch = ld.next_batch()
            failures = ld.stats()["failures"]
    assert len(batch) == 8
    assert sum(failures.values()) == 120 and failures.get("unreported", 0) > 0
    named = [str(w.message) for w in caught if "/data/deep/" in str(w.message)]
    assert named and all("bad_" in m for m in named)

"""The shared-memory ring: slot protocol by hand, multi-process stress with
checksums, Loader output checked pixel for pixel, determinism, and no spinning
on one CPU."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import echo_native as en
from echo_native import _ring
from echo_native.ring import Ring
from echo_native.workers import Plan

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import ring_helpers as rh  # noqa: E402

WAIT_OK, WAIT_TIMEOUT, WAIT_CLOSED = _ring.WAIT_OK, _ring.WAIT_TIMEOUT, _ring.WAIT_CLOSED
FEW = settings(max_examples=10, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow,
                                      HealthCheck.function_scoped_fixture])


# ---- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory):
    return rh.make_corpus(tmp_path_factory.getbasetemp() / "ring_corpus_48", 48, seed=1,
                          classes=3)


@pytest.fixture(scope="module")
def blobs(corpus_root):
    src = en.ImageFolder(corpus_root)
    return [src.read(i) for i in range(len(src))], np.asarray(src.labels)


@pytest.fixture
def ring():
    r = Ring.create(3, 2, 64)
    yield r
    r.close()
    r.unlink()


def _own_segments():
    return rh.segments(os.getpid())


# ---- the slot protocol, by hand ---------------------------------------------------------------
def test_create_layout_and_initial_sequence(ring):
    """A new ring names itself /echo_native-<pid>-<hex>, exists in /dev/shm and starts free."""
    assert ring.name.startswith(f"/echo_native-{os.getpid()}-")
    assert ring.name[1:] in _own_segments()
    assert ring.layout.nslots == 3 and ring.layout.batch_size == 2
    assert ring.next_ticket == 0 and not ring.closed
    for t in range(3):                       # slot t is free for ticket t, nothing published
        assert ring.seq(t) == 2 * t and not ring.is_published(t)
        assert ring.layout.slot(t) % 4096 == 0
        assert (ring.layout.slot(t) + ring.layout.pixels) % 4096 == 0


def test_create_refuses_one_slot():
    """A ring needs two slots at least; one is refused with a clear ValueError."""
    with pytest.raises(ValueError, match="at least 2 slots"):
        Ring.create(1, 4, 16)


def test_tickets_go_round_the_slots_in_order(ring):
    """Hand-driven producer/consumer: tickets 0..8 lap 3 slots, each read back exactly."""
    for t in range(9):
        assert ring.take_ticket() == t
        assert ring.wait_free(t, 1.0) == WAIT_OK
        # the next lap's ticket is not free until this one is consumed
        assert ring.wait_free(t + 3, 0.01) == WAIT_TIMEOUT
        rh.fill_slot(ring, t)
        ring.publish(t)
        assert ring.is_published(t)
        assert ring.wait_filled(t, 1.0) == WAIT_OK
        assert rh.verify_slot(ring, t) == []
        ring.release(t)
        assert ring.seq(t) == 2 * (t + 3)
        assert ring.wait_free(t + 3, 0.01) == WAIT_OK
    assert ring.next_ticket == 9


def test_wait_timeouts_return_wait_timeout(ring):
    """Waiting for an unpublished ticket or a busy slot returns WAIT_TIMEOUT after ~timeout."""
    t0 = time.perf_counter()
    assert ring.wait_filled(0, 0.15) == WAIT_TIMEOUT
    elapsed = time.perf_counter() - t0
    assert 0.14 <= elapsed < 1.0
    t0 = time.perf_counter()
    assert ring.wait_free(3, 0.1) == WAIT_TIMEOUT       # slot 0 still waits for ticket 0
    assert 0.09 <= time.perf_counter() - t0 < 1.0


def test_wait_sleeps_instead_of_spinning(ring):
    """A 0.5 s wait for a ticket that never comes burns (almost) no CPU: it sleeps on a futex."""
    c0, t0 = time.thread_time(), time.perf_counter()
    assert ring.wait_filled(0, 0.5) == WAIT_TIMEOUT
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    assert wall >= 0.49
    assert cpu < 0.05, f"waiting 0.5 s used {cpu:.3f} s of CPU"


def test_publish_wakes_a_sleeping_consumer(ring):
    """A consumer asleep in wait_filled wakes promptly when another thread publishes."""
    result = {}

    def consumer():
        t0 = time.perf_counter()
        result["rc"] = ring.wait_filled(0, 10.0)
        result["woke"] = time.perf_counter()
        result["t0"] = t0

    th = threading.Thread(target=consumer)
    th.start()
    time.sleep(0.2)                          # the consumer is past its spin, asleep
    rh.fill_slot(ring, ring.take_ticket())
    published = time.perf_counter()
    ring.publish(0)
    th.join(5)
    assert not th.is_alive()
    assert result["rc"] == WAIT_OK
    assert result["woke"] - published < 0.5
    assert rh.verify_slot(ring, 0) == []


def test_close_wakes_waiters_with_wait_closed(ring):
    """close() wakes both a waiting consumer and a waiting producer with WAIT_CLOSED."""
    rcs = {}

    def wait(kind, fn, ticket):
        t0 = time.perf_counter()
        rcs[kind] = (fn(ticket, 30.0), time.perf_counter() - t0)

    threads = [threading.Thread(target=wait, args=("consumer", ring.wait_filled, 0)),
               threading.Thread(target=wait, args=("producer", ring.wait_free, 3))]
    for th in threads:
        th.start()
    time.sleep(0.2)
    ring.close()
    for th in threads:
        th.join(5)
    assert not any(th.is_alive() for th in threads)
    assert ring.closed
    for kind in ("consumer", "producer"):
        rc, took = rcs[kind]
        assert rc == WAIT_CLOSED, kind
        assert took < 2.0, f"{kind} woke only after {took:.2f} s"


def test_pickle_attaches_by_name(ring):
    """A pickled Ring is just its name; unpickling attaches to the same memory and layout."""
    data = pickle.dumps(ring)
    assert len(data) < 300                   # the name, never the slot memory
    other = pickle.loads(data)
    assert other.name == ring.name and other.layout == ring.layout
    rh.fill_slot(other, other.take_ticket())
    other.publish(0)
    assert ring.next_ticket == 1
    assert ring.wait_filled(0, 1.0) == WAIT_OK
    assert rh.verify_slot(ring, 0) == []
    del other
    assert ring.name[1:] in _own_segments()   # dropping an attached copy removes nothing


def test_attach_of_a_missing_name_fails_clearly():
    """Attaching a name that does not exist raises OSError naming the segment."""
    name = f"/echo_native-{os.getpid()}-0000deadbeef"
    with pytest.raises(OSError, match="echo_native-.*0000deadbeef"):
        Ring.attach(name)


def test_attach_of_a_non_ring_segment_fails_clearly():
    """Attaching shared memory that is not an echo_native ring raises ValueError saying so."""
    name = f"/echo_native_test-{os.getpid()}-notaring"
    seg = _ring.Segment(name, 8192, create=True)
    try:
        np.frombuffer(seg, np.uint8)[:64] = 7  # some other program's bytes
        with pytest.raises(ValueError, match="not an echo_native ring"):
            Ring.attach(name)
    finally:
        seg.unlink()
        del seg


def test_unlink_removes_the_segment_and_views_stay_valid():
    """unlink() removes the name at once; existing views stay readable until dropped."""
    r = Ring.create(2, 1, 8)
    rh.fill_slot(r, r.take_ticket())
    view = r.slots[0].pixels
    r.unlink()
    assert r.name[1:] not in _own_segments()
    assert np.array_equal(view[0], rh.pattern(0, 8))
    with pytest.raises(OSError):
        Ring.attach(r.name)


# ---- protocol stress: producers in threads and in processes --------------------------------
def _consume(ring, total, delay, timeout=20.0):
    problems = []
    for t in range(total):
        rc = ring.wait_filled(t, timeout)
        assert rc == WAIT_OK, f"consumer: wait_filled({t}) returned {rc}"
        problems += rh.verify_slot(ring, t)
        if delay:
            time.sleep(delay)
        ring.release(t)
    return problems


@FEW
@given(nslots=st.integers(2, 5), batch=st.integers(1, 6), sample_bytes=st.integers(1, 3000),
       producers=st.integers(1, 4), total=st.integers(1, 40),
       consumer_delay=st.sampled_from([0.0, 0.0005, 0.003]),
       producer_delay=st.sampled_from([0.0, 0.0005, 0.003]))
def test_stress_thread_producers(nslots, batch, sample_bytes, producers, total, consumer_delay,
                                 producer_delay):
    """Thread producers: every ticket is published once, read in order, checksums intact."""
    r = Ring.create(nslots, batch, sample_bytes)
    done, errors = [], []

    def body():
        try:
            done.extend(rh.raw_producer(r, total, producer_delay))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=body) for _ in range(producers)]
    try:
        for th in threads:
            th.start()
        problems = _consume(r, total, consumer_delay)
        for th in threads:
            th.join(10)
        assert not errors, errors
        assert problems == []
        assert sorted(done) == list(range(total))        # each ticket filled exactly once
    finally:
        r.close()
        for th in threads:
            th.join(10)
        r.unlink()


@pytest.mark.slow
@FEW
@given(nslots=st.integers(2, 4), batch=st.integers(1, 4), sample_bytes=st.integers(1, 70000),
       producers=st.integers(1, 3), total=st.integers(1, 30),
       consumer_delay=st.sampled_from([0.0, 0.002]),
       producer_delay=st.sampled_from([0.0, 0.002]))
def test_stress_process_producers(nslots, batch, sample_bytes, producers, total, consumer_delay,
                                  producer_delay):
    """Producer processes attach by name: every ticket once, in order, checksums intact."""
    ctx = mp.get_context("forkserver")
    r = Ring.create(nslots, batch, sample_bytes)
    procs, conns = [], []
    try:
        for _ in range(producers):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=rh.raw_producer_main, args=(r, total, producer_delay, child))
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        problems = _consume(r, total, consumer_delay)
        done = []
        for c in conns:
            assert c.poll(20), "a producer process sent nothing"
            status, value = c.recv()
            assert status == "ok", value
            done.extend(value)
        assert problems == []
        assert sorted(done) == list(range(total))
    finally:
        r.close()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
            p.close()
        for c in conns:
            c.close()
        r.unlink()


# ---- the Loader: order, pixels, determinism ---------------------------------------------------
def _expected_ids(plan, epoch):
    order = plan.epoch_order(epoch)
    return [order[b * plan.batch_size:(b + 1) * plan.batch_size]
            for b in range(plan.batches_per_epoch)]


def _check_epoch(L, batches, blobs, labels, epoch, size, seed, reference_cache):
    """Every batch of ``epoch`` holds exactly the planned ids with the reference pixels."""
    expected = _expected_ids(L.plan, epoch)
    assert len(batches) == len(expected)
    for b, (batch, ids) in enumerate(zip(batches, expected)):
        assert batch.epoch == epoch
        assert np.array_equal(batch.sample_ids, ids), f"epoch {epoch} batch {b}: wrong ids"
        assert np.array_equal(batch.labels, labels[ids])
        assert batch.fresh.all() and not batch.echo_index.any()
        assert batch.images.shape == (len(ids), size, size, 3)
        for j, sid in enumerate(ids):
            key = (epoch, int(sid))
            if key not in reference_cache:
                reference_cache[key] = en.decode_random_crop(blobs[sid], (size, size), seed,
                                                             epoch, int(sid), 0)
            img, box, flip = reference_cache[key]
            assert np.array_equal(batch.images[j], img), \
                f"epoch {epoch} batch {b} sample {sid}: pixels differ from decode_random_crop"
            assert bool(batch.flips[j]) == bool(flip)
            assert np.allclose(batch.boxes[j], box)


@pytest.mark.slow
@FEW
@given(n=st.integers(1, 48), batch_size=st.integers(1, 16), slots=st.integers(2, 5),
       workers=st.integers(1, 3), mode=st.sampled_from(["process", "thread"]),
       size=st.sampled_from([16, 32, 40]), drop_last=st.booleans(),
       consumer_delay=st.sampled_from([0.0, 0.01]), seed=st.integers(0, 2**31))
def test_loader_stress_pixels_and_order(blobs, n, batch_size, slots, workers, mode, size,
                                        drop_last, consumer_delay, seed):
    """Loader over 2 epochs: batches in ticket order, each image equal to decode_random_crop."""
    data, labels = blobs
    if drop_last and batch_size > n:
        batch_size = n
    src = en.Samples(data[:n], labels[:n])
    cache = {}
    with en.Loader(src, batch_size=batch_size, image_size=size, workers=workers, slots=slots,
                   worker_mode=mode, seed=seed, drop_last=drop_last, timeout=30) as L:
        for epoch in range(2):
            assert L.epoch == epoch
            got = []
            for batch in L:
                got.append(batch.copy())
                if consumer_delay:
                    time.sleep(consumer_delay)
            _check_epoch(L, got, data, labels[:n], epoch, size, seed, cache)
        stats = L.stats()
        name = L.ring_name
    per_epoch = sum(len(ids) for ids in _expected_ids(L.plan, 0))
    assert stats["batches"] == 2 * len(L)
    assert stats["fresh"] == stats["delivered"] == 2 * per_epoch
    assert stats["failures"] == {} and stats["worker_restarts"] == 0
    assert name[1:] not in _own_segments()


def test_epoch_is_a_permutation_and_batches_keep_their_size(corpus_root):
    """One epoch of an ImageFolder yields every sample id once, in full batches but the last."""
    src = en.ImageFolder(corpus_root)
    with en.Loader(src, batch_size=10, image_size=24, workers=2, worker_mode="thread",
                   seed=3) as L:
        sizes, ids = [], []
        for batch in L:
            sizes.append(len(batch))
            ids.extend(batch.sample_ids.tolist())
            assert batch.images.dtype == np.uint8 and batch.images.flags.c_contiguous
    assert sizes == [10, 10, 10, 10, 8]
    assert sorted(ids) == list(range(len(src)))


def test_batch_arrays_are_views_of_the_ring(corpus_root):
    """Batch arrays are zero-copy views into the shared segment (no copy at hand-off)."""
    src = en.ImageFolder(corpus_root)
    with en.Loader(src, batch_size=8, image_size=32, workers=1, worker_mode="thread") as L:
        batch = L.next_batch()
        for arr in (batch.images, batch.labels, batch.sample_ids, batch.boxes):
            assert not arr.flags.owndata
            assert arr.base is not None
        seg = L._ring.segment
        lo = np.frombuffer(seg, np.uint8).ctypes.data
        addr = batch.images.ctypes.data
        assert lo <= addr < lo + seg.size
        kept = batch.copy()
        assert kept.images.flags.owndata


def _run(corpus_root, workers, mode, seed, epochs=2, slots=None, batch_size=8):
    src = en.ImageFolder(corpus_root)
    out = []
    with en.Loader(src, batch_size=batch_size, image_size=32, workers=workers, slots=slots,
                   worker_mode=mode, seed=seed) as L:
        for _ in range(epochs):
            out.extend(b.copy() for b in L)
    return out


def _same(a, b):
    return len(a) == len(b) and all(
        x.epoch == y.epoch and np.array_equal(x.sample_ids, y.sample_ids)
        and np.array_equal(x.labels, y.labels) and np.array_equal(x.images, y.images)
        and np.array_equal(x.boxes, y.boxes) and np.array_equal(x.flips, y.flips)
        for x, y in zip(a, b))


def test_same_seed_same_batches_whatever_workers_and_mode(corpus_root):
    """The same seed gives identical batches with 1 or 2 workers, processes or threads."""
    ref = _run(corpus_root, 1, "process", seed=7)
    assert _same(ref, _run(corpus_root, 2, "process", seed=7, slots=2))
    assert _same(ref, _run(corpus_root, 2, "thread", seed=7))
    assert _same(ref, _run(corpus_root, 3, "thread", seed=7, slots=5))
    # and the check can fail: another seed changes order and crops
    assert not _same(ref, _run(corpus_root, 1, "thread", seed=8))


def test_epochs_differ_but_each_is_reproducible(corpus_root):
    """Epoch 1 reshuffles and re-crops; re-running epoch 1 reproduces it exactly."""
    a = _run(corpus_root, 2, "thread", seed=11, epochs=2)
    b = _run(corpus_root, 1, "thread", seed=11, epochs=2)
    half = len(a) // 2
    assert _same(a, b)
    assert not np.array_equal(np.concatenate([x.sample_ids for x in a[:half]]),
                              np.concatenate([x.sample_ids for x in a[half:]]))


def test_plan_order_is_a_pure_function_of_seed_and_epoch():
    """Plan.epoch_order depends only on (seed, epoch) and is a permutation."""
    t = en.RandomResizedCrop((8, 8))
    p = Plan(100, 7, t, seed=4)              # (samples, batch size, transform)
    q = Plan(100, 3, t, seed=4)
    assert np.array_equal(p.epoch_order(3), q.epoch_order(3))
    assert sorted(p.epoch_order(3).tolist()) == list(range(100))
    assert not np.array_equal(p.epoch_order(3), p.epoch_order(4))
    assert p.batches_per_epoch == 15
    assert Plan(100, 7, p.transform, drop_last=True).batches_per_epoch == 14


# ---- no spinning on one CPU ------------------------------------------------------------------
@pytest.mark.slow
def test_one_cpu_progresses_without_spinning(corpus_root, tmp_path):
    """Pinned to one CPU with 2 workers: completes promptly, and waiting sides sleep."""
    cpu = min(os.sched_getaffinity(0))
    out = tmp_path / "onecpu.json"
    cmd = [sys.executable, str(HERE / "ring_helpers.py"), "onecpu", str(corpus_root), str(out)]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", str(cpu)] + cmd
        pre = None
    else:
        def pre():
            os.sched_setaffinity(0, {cpu})
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, preexec_fn=pre)
    took = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(out.read_text())
    assert info["affinity"] == [cpu]
    n = info["n"]
    assert sorted(info["ids"]) == sorted(list(range(n)) * rh.EPOCHS)
    assert info["restarts"] == 0
    assert took < 30, f"one-CPU run took {took:.1f} s"
    # Fast phase: a consumer waiting for workers on the same core sleeps.
    assert info["fast_consumer_cpu"] < 0.2 * info["fast_wall"] + 0.01, info
    # Sleepy phase: the workers sleep in read(); a spinning consumer would be
    # the only runnable task and take the whole core (measured: ~90% when the
    # futex wait is replaced by a sched_yield loop; ~1% as built).
    assert info["sleepy_consumer_cpu"] < 0.25 * info["sleepy_wall"], info
    # Slow phase: the ring is full and the workers wait for free slots; they
    # decode one epoch (~0.05 s) and must sleep the rest (spinning: ~100%).
    assert info["slow_worker_cpu"] < 0.5 * info["slow_wall"], info

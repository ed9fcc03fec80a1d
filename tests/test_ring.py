"""The shared-memory ring (``echo_native.ring``): the slot protocol by hand, waits
that sleep instead of spinning, attach by name, and thread/process stress with
checksums.  The Loader on top of it is in ``test_loader.py``."""
from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import pickle
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from echo_native import _ring
from echo_native.ring import Ring

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import ring_helpers as rh  # noqa: E402

WAIT_OK, WAIT_TIMEOUT, WAIT_CLOSED = _ring.WAIT_OK, _ring.WAIT_TIMEOUT, _ring.WAIT_CLOSED
FEW = settings(max_examples=10, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow,
                                      HealthCheck.function_scoped_fixture])


# ---- fixtures ------------------------------------------------------------------------------
@pytest.fixture
def ring():
    """A 3-slot ring of 2 x 64-byte samples, closed and unlinked afterwards."""
    r = Ring.create(3, 2, 64)
    yield r
    r.close()
    r.unlink()


def _own_segments():
    return rh.segments(os.getpid())


# ---- the slot protocol, by hand ---------------------------------------------------------------
def test_create_layout_and_initial_sequence(ring):
    """A new ring is a memfd named /memfd:echo_native-<pid>-<hex> (what /proc shows for
    it), held open by this process, with no file in /dev/shm, and starts free."""
    assert ring.name.startswith(f"/memfd:echo_native-{os.getpid()}-")
    assert ring.backing == "memfd"
    assert ring.name[1:] in _own_segments()
    assert os.readlink(f"/proc/self/fd/{ring.segment.fd}") == ring.name + " (deleted)"
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"echo_native-{os.getpid()}-")]
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


@pytest.mark.timeout(30)
def test_wait_timeouts_return_wait_timeout(ring):
    """Waiting for an unpublished ticket or a busy slot returns WAIT_TIMEOUT."""
    assert ring.wait_filled(0, 0.15) == WAIT_TIMEOUT
    assert ring.wait_free(3, 0.1) == WAIT_TIMEOUT       # slot 0 still waits for ticket 0


@pytest.mark.timing
def test_wait_sleeps_instead_of_spinning(ring):
    """A 0.5 s wait for a ticket that never comes burns (almost) no CPU: it sleeps on a futex.

    Timing is the behaviour: the wait lasts the 0.5 s and the thread is off the CPU for
    (nearly) all of it (CPU time < 10% of the wall time).
    """
    c0, t0 = time.thread_time(), time.perf_counter()
    assert ring.wait_filled(0, 0.5) == WAIT_TIMEOUT
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    assert wall >= 0.49
    assert cpu < 0.05, f"waiting 0.5 s used {cpu:.3f} s of CPU"


@pytest.mark.timeout(30)
def test_publish_wakes_a_sleeping_consumer(ring):
    """A consumer asleep in wait_filled wakes when another thread publishes (not at its
    30 s timeout)."""
    result = {}

    def consumer():
        result["rc"] = ring.wait_filled(0, 30.0)

    th = threading.Thread(target=consumer)
    th.start()
    rh.wait_for(lambda: rh.asleep_on_ring(os.getpid(), th.native_id, ring.name),
                "the consumer asleep in wait_filled")
    rh.fill_slot(ring, ring.take_ticket())
    ring.publish(0)
    th.join(5)
    assert not th.is_alive()  # still asleep 5 s into a 30 s wait: the publish did not wake it
    assert result["rc"] == WAIT_OK
    assert rh.verify_slot(ring, 0) == []


@pytest.mark.timeout(30)
def test_close_wakes_waiters_with_wait_closed(ring):
    """close() wakes both a waiting consumer and a waiting producer with WAIT_CLOSED."""
    rcs = {}

    def wait(kind, fn, ticket):
        rcs[kind] = fn(ticket, 30.0)

    threads = [threading.Thread(target=wait, args=("consumer", ring.wait_filled, 0)),
               threading.Thread(target=wait, args=("producer", ring.wait_free, 3))]
    for th in threads:
        th.start()
    for th in threads:
        rh.wait_for(lambda tid=th.native_id: rh.asleep_on_ring(os.getpid(), tid, ring.name),
                    f"{th.name} asleep in its wait")
    ring.close()
    for th in threads:
        th.join(5)
    # Still waiting after 5 s of a 30 s wait: close() did not wake them.
    assert not any(th.is_alive() for th in threads)
    assert ring.closed
    assert rcs == {"consumer": WAIT_CLOSED, "producer": WAIT_CLOSED}


def test_pickle_attaches_by_name(ring):
    """A pickled Ring is just its name; unpickling attaches to the same memory and layout
    (a memfd ring's name is found among this process's descriptors)."""
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
    """unlink() lets go of the ring at once (a memfd's descriptor is closed, so it can no
    longer be attached); existing views stay readable, and the memory is freed when the
    last of them is dropped."""
    r = Ring.create(2, 1, 8)
    rh.fill_slot(r, r.take_ticket())
    view = r.slots[0].pixels
    name = r.name
    r.unlink()
    assert name[1:] not in _own_segments()
    assert np.array_equal(view[0], rh.pattern(0, 8))
    with pytest.raises(OSError):
        Ring.attach(name)
    assert rh.ring_memory(os.getpid()).get(name) == [os.getpid()]  # the mapping, still
    del r, view
    assert name not in rh.ring_memory(os.getpid())                # freed


def test_a_handle_passes_the_ring_to_a_child_as_a_descriptor():
    """A memfd ring reaches a child process as an inherited descriptor (pass_fds): the
    child maps it, closes its copy, and writes into the same memory; the descriptor is
    close-on-exec, so no other child gets it."""
    import subprocess
    r = Ring.create(2, 1, 8)
    try:
        handle = r.handle()
        assert handle[0] == "fd" and handle[2] == r.name
        code = ("import os, pickle, sys; from echo_native.ring import Ring; "
                "r = Ring.from_handle(pickle.loads(bytes.fromhex(sys.argv[1]))); "
                "fd = int(sys.argv[2]); "
                "print(os.path.exists(f'/proc/self/fd/{fd}'), r.name, r.take_ticket())")
        arg = pickle.dumps(handle).hex()
        out = subprocess.run([sys.executable, "-c", code, arg, str(handle[1])],
                             pass_fds=(handle[1],), capture_output=True, text=True, check=True)
        assert out.stdout.split() == ["False", r.name, "0"]      # closed its copy once mapped
        assert r.next_ticket == 1                                # the same memory
        other = subprocess.run(["ls", f"/proc/self/fd/{handle[1]}"], capture_output=True,
                               check=False)
        assert other.returncode != 0                             # not inherited without pass_fds
    finally:
        r.unlink()


LIVE_READS = 250_000   # live samples the racing reader catches before it stops (~1.5 s here)


def test_reading_words_never_pair_a_live_sample_with_a_cleared_time():
    """A worker sets and clears its reading words as fast as it can while the consumer
    reads them as its stall watchdog does: a live sample must always come with a start
    time the worker stored (a cleared 0 would read as a read stalled since boot).  The
    race runs until the reader has caught LIVE_READS live samples, at any speed."""
    r = Ring.create(2, 1, 64)
    stop = mmap.mmap(-1, 1)                   # shared with the forked worker
    first_ms = int(time.monotonic() * 1000)   # every start time the worker stores is later
    pid = os.fork()
    if pid == 0:  # the worker: one sample after another, until the reader has enough
        try:
            sid = 0
            while not stop[0]:
                r.set_reading(0, sid)
                r.set_reading(0)
                sid += 1
        finally:
            os._exit(0)
    try:
        seen, torn, deadline = 0, 0, time.monotonic() + 120
        while seen < LIVE_READS and time.monotonic() < deadline:
            sid1, since_ms = r.segment.reading_load(0)
            if sid1:
                seen += 1
                torn += since_ms < first_ms
            elif os.waitpid(pid, os.WNOHANG) != (0, 0):
                pid = None   # reaped
                break
        assert seen == LIVE_READS, f"{seen} live samples seen (the worker ended or 120 s)"
        assert torn == 0, f"{torn} of {seen} reads paired a live sample with a cleared time"
    finally:
        stop[0] = 1
        if pid is not None:
            os.waitpid(pid, 0)
        r.close()
        r.unlink()


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

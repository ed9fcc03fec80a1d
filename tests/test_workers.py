"""The workers (``echo_native.workers``) and their supervisor (``echo_native.pool``) as
units: the Plan that says which samples each ticket holds (a pure function of seed and
epoch); one ticket filled into a real ring in-process (the samples in plan order, the
failure records under each ``on_error``, stand-ins keyed by (seed, epoch, sample,
attempt), a sample no stand-in can replace, a source's read that raises anything);
the worker loop (redo tickets, a ticket already past, a ring that closes, a source it
cannot use, a bug in a source); and the WorkerPool in thread mode (start, check, close,
an error escaping a thread, the accounting of tickets a dead worker left unfinished).

Sources are in-memory JPEGs cut from real photographs.  Killed, failing and hung worker
processes end to end are in ``robustness/test_faults.py``; rank sharding of the plan in
``test_distributed.py``.
"""
from __future__ import annotations

import errno
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

import echo_native as en
from echo_native import workers
from echo_native.errors import ReadLimitError
from echo_native.failures import NO_SAMPLE, Failure
from echo_native.plan import Plan
from echo_native.pool import WorkerPool
from echo_native.remote import StoreUnavailableError
from echo_native.ring import (ERR_DECODE, ERR_NONE, ERR_WORKER, OK, REASON_DECODE, REASON_LIMIT,
                              REASON_NONE, REASON_READ, REPLACED, WAIT_OK, Ring)

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import ring_helpers as rh  # noqa: E402
import sources_helpers as sh  # noqa: E402

pytestmark = pytest.mark.timeout(120)

N, B, SIZE = 12, 5, (8, 8)     # 3 tickets an epoch: 5, 5 and 2 samples
CROP = en.CenterCrop(SIZE)
WAIT_S = 60.0                  # a hang guard on every wait, never a pace


@pytest.fixture(scope="module")
def blobs():
    return sh.photo_jpegs(N, seed=23)


class Scripted(en.Samples):
    """In-memory JPEGs whose reads the test scripts: ``bad`` ids read as bytes that are no
    image, ``raises`` maps an id to the exception its read raises; every read is logged."""

    def __init__(self, blobs, bad=(), raises=None):
        super().__init__(blobs, 100 + np.arange(len(blobs)),
                         names=[f"s{i}.jpg" for i in range(len(blobs))])
        self.bad, self.raises, self.reads = set(bad), dict(raises or {}), []

    def read(self, i):
        self.reads.append(int(i))
        if i in self.raises:
            raise self.raises[i]
        if i in self.bad:
            return b"not an image at all"
        return super().read(i)


def plan_of(on_error="replace", seed=3, transform=CROP):
    return Plan(N, B, transform, seed=seed, on_error=on_error)


@contextmanager
def ring_for(plan, nslots=2):
    ring = Ring.create(nslots, plan.batch_size, plan.transform.sample_bytes)
    try:
        yield ring
    finally:
        ring.close()
        ring.unlink()


def ids_of(plan, ticket):
    epoch, b = divmod(ticket, plan.batches_per_epoch)
    return plan.epoch_order(epoch)[b * B:(b + 1) * B].tolist()


def filled(ring, ticket):
    """(meta, sample ids, labels, status, reason) of a filled ticket's slot."""
    meta = ring.read_meta(ticket)
    slot = ring.slots[ticket % ring.layout.nslots]
    n = meta.count
    return (meta, slot.sample_ids[:n].tolist(), slot.labels[:n].tolist(),
            slot.status[:n].tolist(), slot.reason[:n].tolist())


# ---- the plan --------------------------------------------------------------------------------
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


# ---- filling one ticket ------------------------------------------------------------------------
def test_fill_writes_the_tickets_samples_in_plan_order(blobs):
    """Each ticket's slot holds the plan's samples for it (the epoch's last one short, the
    next epoch in its own order), their labels and center crops, all OK, no failures."""
    plan = plan_of()
    src = Scripted(blobs)
    with ring_for(plan) as ring:
        filler = workers._Filler(ring, plan, src)
        for ticket in (0, 2, 4):
            filler.fill(ticket)
            meta, ids, labels, status, reason = filled(ring, ticket)
            assert ids == ids_of(plan, ticket) and len(ids) == (2 if ticket == 2 else B)
            assert meta == (len(ids), ERR_NONE, 0, [])
            assert labels == [100 + i for i in ids]
            assert status == [OK] * len(ids) and reason == [0] * len(ids)
            pixels = ring.slots[ticket % 2].pixels
            for row, sid in enumerate(ids):
                want = en.decode_center_crop(blobs[sid], SIZE)
                assert np.array_equal(pixels[row].reshape(want.shape), want)
        assert ids_of(plan, 4) != ids_of(plan, 1)     # epoch 1 is its own order


def _hard_to_replace(plan, ticket):
    """A sample of ``ticket`` whose first replacement is another sample outside the ticket:
    failing both makes the fill go on to a second attempt."""
    ids = ids_of(plan, ticket)
    epoch = ticket // plan.batches_per_epoch
    for sid in ids:
        first = plan.replacement(epoch, sid, 0)
        if first != sid and first not in ids:
            return sid, first
    raise AssertionError("no such sample for this seed: pick another seed")


def test_replace_puts_the_keyed_stand_in_in_the_failed_samples_place(blobs):
    """on_error="replace": the failed sample's row holds its first replacement (by seed,
    epoch, sample and attempt) that reads, marked REPLACED with the failure's reason; the
    record names the sample; another filler, in another ring, writes the very same slot."""
    plan = plan_of("replace")
    sid, first = _hard_to_replace(plan, 0)
    bad = {sid, first}
    attempts = []
    for attempt in range(workers._MAX_REPLACEMENTS):
        attempts.append(plan.replacement(0, sid, attempt))
        if attempts[-1] not in bad:
            break
    expect = attempts[-1]
    assert len(attempts) >= 2 and expect not in bad
    slots = []
    for _ in range(2):
        src = Scripted(blobs, bad=bad)
        with ring_for(plan) as ring:
            workers._Filler(ring, plan, src).fill(0)
            meta, ids, labels, status, reason = filled(ring, 0)
            slots.append(bytes(ring.slots[0].pixels))
        row = ids_of(plan, 0).index(sid)
        want = [expect if i == sid else i for i in ids_of(plan, 0)]
        assert ids == want and labels == [100 + i for i in want]
        assert status == [REPLACED if i == row else OK for i in range(B)]
        assert reason == [REASON_DECODE if i == row else 0 for i in range(B)]
        assert meta.count == B and meta.error == ERR_NONE and meta.failures == 1
        [rec] = meta.records
        assert (rec.sample_id, rec.reason, rec.path, rec.dropped) == \
            (sid, REASON_DECODE, f"s{sid}.jpg", False)
        assert "not an image" in rec.message
        # read: the sample, then its stand-ins by attempt until one reads
        at = src.reads.index(sid)
        assert src.reads[at:at + 1 + len(attempts)] == [sid] + attempts
    assert slots[0] == slots[1]


def test_stand_ins_depend_on_seed_epoch_sample_and_attempt():
    """Plan.replacement is a pure function of (seed, epoch, sample, attempt), in range, and
    changes with each of them."""
    p, q = plan_of(seed=3), plan_of(seed=4)
    draws = {(s, e, i, a): (p if s == 3 else q).replacement(e, i, a)
             for s in (3, 4) for e in range(3) for i in range(N) for a in range(4)}
    assert all(0 <= r < N for r in draws.values())
    assert all(plan_of(seed=s).replacement(e, i, a) == r for (s, e, i, a), r in draws.items())
    for axis in range(4):
        pairs = [(r, draws[k[:axis] + (k[axis] + 1,) + k[axis + 1:]])
                 for k, r in draws.items()
                 if k[:axis] + (k[axis] + 1,) + k[axis + 1:] in draws]
        assert sum(a != b for a, b in pairs) > len(pairs) // 2, f"axis {axis} barely matters"


def test_skip_packs_the_good_samples_and_records_the_bad(blobs):
    """on_error="skip": the batch is the good samples in order, packed at the front; the
    failed ones are recorded in order, each once, and nothing is read in their place."""
    plan = plan_of("skip")
    ids = ids_of(plan, 0)
    bad = {ids[0], ids[3]}
    src = Scripted(blobs, bad=bad)
    with ring_for(plan) as ring:
        workers._Filler(ring, plan, src).fill(0)
        meta, got, labels, status, _ = filled(ring, 0)
    assert got == [i for i in ids if i not in bad] and status == [OK] * 3
    assert labels == [100 + i for i in got]
    assert meta.count == 3 and meta.error == ERR_NONE and meta.failures == 2
    assert [(r.sample_id, r.reason, r.dropped) for r in meta.records] == \
        [(ids[0], REASON_DECODE, False), (ids[3], REASON_DECODE, False)]
    assert src.reads == ids


def test_raise_ends_the_fill_at_the_failed_sample(blobs):
    """on_error="raise": the slot says ERR_DECODE with the samples before the failure and
    one record for it; nothing after it is read."""
    plan = plan_of("raise")
    ids = ids_of(plan, 0)
    src = Scripted(blobs, bad={ids[2]})
    with ring_for(plan) as ring:
        workers._Filler(ring, plan, src).fill(0)
        meta, got, _, _, _ = filled(ring, 0)
    assert (meta.count, meta.error, meta.failures) == (2, ERR_DECODE, 1)
    assert got == ids[:2] and [r.sample_id for r in meta.records] == [ids[2]]
    assert src.reads == ids[:3]


def test_a_sample_that_every_stand_in_fails_is_dropped(blobs):
    """Nothing reads: each sample and each of its stand-ins are tried once, and every
    record says the sample was dropped; the batch is empty, not an error."""
    plan = plan_of("replace")
    src = Scripted(blobs, bad=range(N))
    with ring_for(plan) as ring:
        workers._Filler(ring, plan, src).fill(0)
        meta = ring.read_meta(0)
    assert (meta.count, meta.error, meta.failures) == (0, ERR_NONE, B)
    assert [r.sample_id for r in meta.records] == ids_of(plan, 0)
    assert all(r.dropped and r.reason == REASON_DECODE for r in meta.records)
    assert len(src.reads) == B * (1 + workers._MAX_REPLACEMENTS)


@pytest.mark.parametrize("error, reason, message", [
    (OSError(errno.EIO, "disk on fire"), REASON_READ, "cannot read: disk on fire"),
    (ReadLimitError(errno.EFBIG, "over max_file_bytes"), REASON_LIMIT,
     "refused: over max_file_bytes"),
    (MemoryError(), REASON_LIMIT, "out of memory reading it"),
    (KeyboardInterrupt("stop"), REASON_READ, "Scripted.read({sid}) raised KeyboardInterrupt: stop"),
    (SystemExit(), REASON_READ, "Scripted.read({sid}) raised SystemExit"),
    (GeneratorExit("closed"), REASON_READ, "Scripted.read({sid}) raised GeneratorExit: closed"),
])
def test_what_a_read_raises_becomes_that_samples_failure(blobs, error, reason, message):
    """An OSError, a refused read, MemoryError, and a BaseException (KeyboardInterrupt,
    SystemExit) raised by the source's read() fail that one sample, with its reason and a
    message saying what happened; the rest of the batch is filled."""
    plan = plan_of("skip")
    ids = ids_of(plan, 0)
    sid = ids[1]
    src = Scripted(blobs, raises={sid: error})
    with ring_for(plan) as ring:
        workers._Filler(ring, plan, src).fill(0)
        meta, got, _, _, _ = filled(ring, 0)
    assert got == [i for i in ids if i != sid] and meta.error == ERR_NONE
    assert meta.records == [Failure(sid, reason, f"s{sid}.jpg", message.format(sid=sid))]


def test_a_stalled_sample_fails_with_its_reason_without_being_read(blobs):
    """A sample a predecessor hung or died on is not read again: it fails as a read
    failure with the supervisor's reason, and is replaced like any other."""
    plan = plan_of("replace")
    ids = ids_of(plan, 0)
    sid = ids[4]
    src = Scripted(blobs)
    with ring_for(plan) as ring:
        workers._Filler(ring, plan, src, stalled={sid: "its read stalled for 99 s"}).fill(0)
        meta, got, _, status, _ = filled(ring, 0)
    assert sid not in src.reads
    assert got[4] == plan.replacement(0, sid, 0) and status[4] == REPLACED
    assert meta.records == [Failure(sid, REASON_READ, f"s{sid}.jpg",
                                    "its read stalled for 99 s")]


def test_a_store_that_is_down_fails_the_batch_whatever_on_error_says(blobs):
    """An unreachable store is no sample's failure: the slot is a worker error naming the
    object and saying the run stops, even with on_error="skip"."""
    plan = plan_of("skip")
    sid = ids_of(plan, 0)[2]
    down = StoreUnavailableError(errno.ECONNREFUSED, "connection refused", "s3://b/k.jpg",
                                 "s3://endpoint")
    src = Scripted(blobs, raises={sid: down})
    with ring_for(plan) as ring:
        workers._Filler(ring, plan, src).fill(0)
        meta = ring.read_meta(0)
    assert (meta.count, meta.error, meta.failures) == (0, ERR_WORKER, 0)
    [rec] = meta.records
    assert (rec.sample_id, rec.reason, rec.path) == (NO_SAMPLE, REASON_NONE, "s3://b/k.jpg")
    assert "connection refused" in rec.message and "whatever on_error says" in rec.message


class Hinted(Scripted):
    """A source with a prefetch hook that takes ``upcoming=``, logging each hint."""

    def __init__(self, blobs):
        super().__init__(blobs)
        self.hints = []

    def prefetch(self, ids, upcoming=()):
        self.hints.append((list(map(int, ids)), list(map(int, upcoming))))


def test_prefetch_hears_the_batch_and_the_one_its_worker_likely_fills_next(blobs):
    """A prefetch hook taking ``upcoming=`` gets the ticket's samples and those of the
    ticket one stride on (the stride between this worker's last two tickets), none across
    an epoch's end; a hook without it gets the ticket's samples only."""
    plan = Plan(N, 2, CROP, seed=5)              # 6 tickets an epoch
    src = Hinted(blobs)
    with ring_for(plan, nslots=6) as ring:
        filler = workers._Filler(ring, plan, src)
        for ticket in (0, 2, 4, 5):
            filler.fill(ticket)

    def ids(t):
        epoch, b = divmod(t, 6)
        return plan.epoch_order(epoch)[2 * b:2 * b + 2].tolist()

    assert src.hints == [(ids(0), ids(1)), (ids(2), ids(4)), (ids(4), []), (ids(5), [])]

    class Plain(Scripted):
        def __init__(self, blobs):
            super().__init__(blobs)
            self.hints = []

        def prefetch(self, ids):
            self.hints.append(list(map(int, ids)))

    plain = Plain(blobs)
    with ring_for(plan) as ring:
        workers._Filler(ring, plan, plain).fill(1)
    assert plain.hints == [ids(1)]


# ---- the worker loop -------------------------------------------------------------------------
@contextmanager
def worker_thread(ring, plan, src, index=0, redo=()):
    """run_worker on a thread, stopped (and the ring closed) on the way out."""
    stop, errors = threading.Event(), []

    def body():
        try:
            workers.run_worker(ring, index, plan, src, redo, stop=stop)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    th = threading.Thread(target=body, daemon=True)
    th.start()
    try:
        yield th
    finally:
        stop.set()
        ring.close()
        th.join(WAIT_S)
    assert not th.is_alive(), "run_worker did not return after stop and close"
    assert errors == []


def test_redo_tickets_come_first_and_one_already_past_is_not_filled_again(blobs):
    """A predecessor's tickets 0 (published after all) and 1 (lost): the worker leaves 0's
    slot as it is, fills 1, then goes on with fresh tickets from the counter (2, once the
    consumer hands 0's slot on)."""
    plan = plan_of()
    src = Scripted(blobs)
    with ring_for(plan) as ring:
        assert (ring.take_ticket(), ring.take_ticket()) == (0, 1)
        rh.fill_slot(ring, 0)
        ring.publish(0)
        with worker_thread(ring, plan, src, redo=[0, 1]):
            assert ring.wait_filled(1, WAIT_S) == WAIT_OK
            assert filled(ring, 1)[1] == ids_of(plan, 1)
            assert rh.verify_slot(ring, 0) == []      # ticket 0 as its first filler left it
            ring.release(0)
            assert ring.wait_filled(2, WAIT_S) == WAIT_OK
            assert filled(ring, 2)[1] == ids_of(plan, 2)
        assert src.reads[:B] == ids_of(plan, 1)


def test_the_worker_returns_when_the_ring_closes(blobs):
    """With every slot full and no consumer, a worker waits; closing the ring ends it."""
    plan = plan_of()
    ring = Ring.create(2, B, CROP.sample_bytes)
    try:
        done = threading.Event()

        def body():
            workers.run_worker(ring, 0, plan, Scripted(blobs))
            done.set()

        th = threading.Thread(target=body, daemon=True)
        th.start()
        assert ring.wait_filled(1, WAIT_S) == WAIT_OK    # both slots full: it now waits
        assert not done.is_set()
        ring.close()
        th.join(WAIT_S)
        assert done.is_set()
    finally:
        ring.unlink()


def test_a_bug_in_the_source_fails_the_ticket_with_the_traceback_and_the_sample(blobs):
    """An unexpected exception in read() is no sample's failure: the ticket carries one
    record with the worker, the sample it was on (named) and the traceback; the worker
    goes on to the next ticket."""
    plan = plan_of("replace")
    sid = ids_of(plan, 0)[3]
    src = Scripted(blobs, raises={sid: LookupError("deliberate bug in read")})
    with ring_for(plan) as ring, worker_thread(ring, plan, src, index=2):
        assert ring.wait_filled(0, WAIT_S) == WAIT_OK
        meta = ring.read_meta(0)
        assert (meta.count, meta.error) == (0, ERR_WORKER)
        [rec] = meta.records
        assert (rec.sample_id, rec.reason, rec.path) == (NO_SAMPLE, REASON_NONE, "")
        assert rec.message.startswith("worker 2 (pid ")
        assert f"on sample {sid} (s{sid}.jpg):" in rec.message
        assert "Traceback" in rec.message and "LookupError: deliberate bug in read" in rec.message
        assert ring.wait_filled(1, WAIT_S) == WAIT_OK
        assert ring.read_meta(1).error == ERR_NONE


class BadLabels:
    """A source whose labels are not integers."""

    labels = [0.5] * N

    def __len__(self):
        return N

    def describe(self, i):
        return f"<{i}>"

    def read(self, i):
        raise AssertionError("never read: the worker cannot use this source")


def test_a_source_the_worker_cannot_use_fails_each_ticket_saying_why(blobs):
    """A source that fails the worker's own checks (labels that are not integers) does
    not kill the worker (its replacement would die the same way): every ticket it takes
    is a worker error saying why."""
    plan = plan_of()
    with ring_for(plan) as ring, worker_thread(ring, plan, BadLabels(), index=3):
        for ticket in (0, 1):
            assert ring.wait_filled(ticket, WAIT_S) == WAIT_OK
            meta = ring.read_meta(ticket)
            assert (meta.count, meta.error) == (0, ERR_WORKER)
            [rec] = meta.records
            assert rec.sample_id == NO_SAMPLE
            assert rec.message.startswith("worker 3 (pid ") and \
                "cannot use the source: ValueError" in rec.message


# ---- the pool: redo accounting ------------------------------------------------------------------
class _RacyRing:
    """A ring through which a live worker takes (and records) a new ticket at the worst
    moment for the supervisor: after it has read the claims, before it reads the counter."""

    def __init__(self, ring, live_worker):
        self._ring, self._live = ring, live_worker
        self.claims_read, self.raced = False, None

    def __getattr__(self, name):
        return getattr(self._ring, name)

    def claim(self, worker):
        self.claims_read = True
        return self._ring.claim(worker)

    @property
    def next_ticket(self):
        if self.claims_read and self.raced is None:
            self.raced = self._ring.take_ticket()
            self._ring.set_claim(self._live, self.raced + 1)
        return self._ring.next_ticket


def test_lost_tickets_exclude_tickets_taken_after_the_claims_were_read():
    """Redo accounting: a ticket a live worker takes mid-check is not 'lost' (no double fill)."""
    ring = Ring.create(4, 1, 8)
    try:
        for t in range(3):
            assert ring.take_ticket() == t
        rh.fill_slot(ring, 0)
        ring.publish(0)               # ticket 0 done; worker 0 died holding ticket 1
        ring.set_claim(1, 2 + 1)      # worker 1 (alive) holds ticket 2
        racy = _RacyRing(ring, live_worker=1)
        pool = WorkerPool(racy, Plan(10, 1, en.RandomResizedCrop((8, 8))), None, 2,
                          mode="thread")
        lost = pool._lost_tickets(0)
        assert lost == [1], f"tickets {lost} would be filled again"
        assert racy.raced in (None, 3)
    finally:
        ring.unlink()


# ---- the pool in thread mode -------------------------------------------------------------------
def test_a_thread_pool_fills_every_ticket_once_and_close_ends_its_threads(blobs):
    """Two thread workers over a 3-slot ring: two epochs of tickets arrive in the plan's
    order, each sample once an epoch, check() finds nothing wrong, no process is started;
    close() closes the ring and every worker thread has ended when it returns."""
    plan = plan_of()
    src = Scripted(blobs)
    with ring_for(plan, nslots=3) as ring:
        pool = WorkerPool(ring, plan, src, 2, mode="thread")
        pool.start()
        try:
            threads = list(pool._workers)
            assert all(isinstance(t, threading.Thread) for t in threads) and pool.pids() == []
            for epoch in range(2):
                got = []
                for ticket in range(epoch * 3, epoch * 3 + 3):
                    assert ring.wait_filled(ticket, WAIT_S) == WAIT_OK
                    assert pool.check(ticket) is None
                    meta, ids, _, _, _ = filled(ring, ticket)
                    assert meta.error == ERR_NONE and ids == ids_of(plan, ticket)
                    got += ids
                    ring.release(ticket)
                assert sorted(got) == list(range(N))
        finally:
            pool.close(timeout=WAIT_S)
        assert ring.closed
        assert not any(t.is_alive() for t in threads)
        assert pool._workers == [None, None]


class Escape(BaseException):
    """Not an Exception: what the worker loop does not catch."""


class Escaping:
    """A transform whose apply raises :class:`Escape` (a bug past every handler)."""

    sample_bytes = CROP.sample_bytes

    def apply(self, dec, data, key, slot, i):
        raise Escape("escaped the worker loop")


def test_an_error_that_escapes_a_worker_thread_is_raised_by_check(blobs):
    """A thread worker ended by an error no handler takes: the pool's next check() raises
    RuntimeError from it, for the consumer (not a silent hang)."""
    plan = plan_of(transform=Escaping())
    with ring_for(plan) as ring:
        pool = WorkerPool(ring, plan, Scripted(blobs), 1, mode="thread")
        pool.start()
        raised = []

        def surfaced():
            try:
                pool.check(0)
            except RuntimeError as e:
                raised.append(e)
                return True
            return False

        try:
            rh.wait_for(surfaced, "the worker thread's error raised by check()", WAIT_S)
        finally:
            pool.close(timeout=WAIT_S)
    assert str(raised[0]) == "a worker thread failed"
    assert isinstance(raised[0].__cause__, Escape)


def test_a_pool_says_who_holds_a_ticket_it_waits_for():
    """waiting_on: no claim is "no worker has claimed it"; a claim without a sample being
    read names the worker; an unknown worker mode is refused by name."""
    plan = plan_of()
    with ring_for(plan) as ring:
        pool = WorkerPool(ring, plan, None, 3, mode="thread")
        assert pool.holder(5) is None
        assert pool.waiting_on(5) == "no worker has claimed it"
        ring.set_claim(2, 5 + 1)
        assert pool.holder(5) == 2 and pool.waiting_on(5) == "worker 2 holds it"
    with pytest.raises(ValueError, match="worker mode must be 'process' or 'thread', got 'fork'"):
        WorkerPool(None, plan, None, 1, mode="fork")


class _BrokenDescribe(Scripted):
    def describe(self, i):
        raise RuntimeError("describe() is broken")


@pytest.mark.parametrize("bad", ["decode", "read"])
def test_a_broken_describe_still_lets_on_error_handle_the_sample(blobs, bad):
    """A source whose describe() raises: the failed sample is still handled by on_error
    ("skip" here), named by a stand-in that says what happened, not a worker error."""
    plan = plan_of("skip")
    ids = ids_of(plan, 0)
    src = _BrokenDescribe(blobs, bad={ids[1]} if bad == "decode" else (),
                          raises={ids[1]: OSError(5, "I/O error")} if bad == "read" else None)
    with ring_for(plan) as ring:
        workers._Filler(ring, plan, src).fill(0)
        meta, got, *_ = filled(ring, 0)
    assert meta.error == ERR_NONE and got == [i for i in ids if i != ids[1]]
    (record,) = meta.records
    assert record.sample_id == ids[1] and "describe() raised" in record.path

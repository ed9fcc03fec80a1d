"""The echo stages (``echo_native.echo.stages``) against a scripted upstream.

No ring, no workers, no pixels: a :class:`ScriptedUpstream` hands out fresh batches of
sample ids in the order a plan would, and :class:`IdExamples` stores and emits ids, so
each test checks a stage's own decisions exactly (what is emitted, how often, in what
order, what a resume re-reads) on any machine.  How the ring's pixels are stored and
re-augmented is in ``test_pipeline.py`` and ``test_backends.py``.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from echo_native.backends.array import ArrayDevice
from echo_native.batch import Fresh
from echo_native.echo.auto import AutoEcho
from echo_native.echo.stages import BatchEcho, ExampleEcho, PassThrough


# ---- the scripted upstream --------------------------------------------------------------
class ScriptedUpstream:
    """Fresh batches of ``n`` samples per epoch, ``B`` per batch, ids in a per-epoch
    permutation of ``seed``; each takes ``fill_s`` of scripted upstream time.  Implements
    the Upstream protocol and records what the stage does with it."""

    workers = 1

    def __init__(self, n=40, B=8, seed=0, fill_s=0.0, failed=()):
        self.n, self.B, self.seed, self.fill_s = n, B, seed, fill_s
        self.batches_per_epoch = -(-n // B)
        self.samples_per_epoch = n
        self.sharded = False
        self.failed = set(failed)   # ids whose rows are stand-ins (ok=False)
        self.position = 0
        self._held = None
        self.released = []          # tickets handed back
        self.ready_now = True

    @property
    def epoch(self):
        return self.position // self.batches_per_epoch

    @property
    def left_in_epoch(self):
        return self.batches_per_epoch - self.position % self.batches_per_epoch

    def id_space(self):
        return self.n

    def epoch_ids(self, epoch):
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def _fresh(self, ticket):
        epoch, b = divmod(ticket, self.batches_per_epoch)
        ids = self.epoch_ids(epoch)[b * self.B:(b + 1) * self.B]
        ok = np.array([i not in self.failed for i in ids])
        return Fresh(ticket, epoch, b, ids, ok, {"ids": ids.copy()}, self.fill_s)

    def next_fresh(self):
        if self._held is not None:
            self.released.append(self._held)
        ticket, self._held = self.position, self.position
        self.position += 1
        return self._fresh(ticket)

    def ready(self):
        return self.ready_now

    def held(self):
        return None if self._held is None else self._fresh(self._held)

    def hand_off(self):
        ticket, self._held = self._held, None
        return lambda: self.released.append(ticket)

    def state_at(self, ticket):
        return {"ticket": int(ticket)}

    def seek(self, ticket):
        self.position, self._held = ticket, None


@dataclasses.dataclass
class Out:
    """An emitted batch as these tests see it."""

    sample_ids: np.ndarray
    echo_index: np.ndarray
    fresh: np.ndarray
    epoch: int

    def __len__(self):
        return len(self.sample_ids)


class IdExamples:
    """Stores and emits sample ids only (the ring's version stores pixels)."""

    def allocate(self, capacity):
        self.ids = np.full(capacity, -1, np.int64)

    def free(self):
        pass

    def store(self, entries, fresh):
        self.ids[entries] = fresh.payload["ids"]

    def make(self, entries, sample_ids, echo_index, fresh, epochs, epoch):
        assert np.array_equal(self.ids[entries], sample_ids)  # the entries hold those ids
        return None, Out(sample_ids.copy(), echo_index.copy(), fresh.copy(), epoch)

    def pass_through(self, fresh):
        return Out(fresh.sample_ids.copy(), np.zeros(fresh.count, np.int64), fresh.ok.copy(),
                   fresh.epoch), True

    def keep(self, fresh):
        return Out(fresh.sample_ids.copy(), np.zeros(fresh.count, np.int64), fresh.ok.copy(),
                   fresh.epoch)

    def repeat(self, kept, echo, epoch):
        return Out(kept.sample_ids.copy(), np.full(len(kept), echo, np.int64),
                   kept.fresh & (echo == 0), epoch)


class AheadDevice(ArrayDevice):
    """A host device that makes each batch ahead (the CPU backend's one-in-flight path)."""

    prepares_ahead = True


def make(kind, upstream=None, factor=2.0, auto=None, capacity=32, window=4, drop_last=False,
         device=None, seed=0):
    upstream = upstream or ScriptedUpstream()
    kw = dict(seed=seed, batch_size=upstream.B, drop_last=drop_last,
              device=device or ArrayDevice(np), factor=None if auto else factor, auto=auto)
    args = (upstream, IdExamples(), lambda parts: parts)
    if kind == "pass":
        stage = PassThrough(*args, **kw)
    elif kind == "batch":
        stage = BatchEcho(*args, window=window, **kw)
    else:
        stage = ExampleEcho(*args, capacity=capacity, **kw)
    stage.start()
    return stage


def epoch_of(stage):
    return list(stage.batches())


def ids_of(batches):
    return np.concatenate([b.sample_ids for b in batches])


# ---- pass-through ------------------------------------------------------------------------
def test_pass_through_hands_out_each_fresh_batch_once_in_order():
    """e = 1: the epoch's fresh batches as they come, each handed back once copied."""
    up = ScriptedUpstream(n=20, B=8)
    stage = make("pass", up)
    batches = epoch_of(stage)
    assert [len(b) for b in batches] == [8, 8, 4]
    assert np.array_equal(ids_of(batches), up.epoch_ids(0))
    assert up.released == [0, 1, 2]
    assert stage.batches_in(1) == 3 and stage.books.fresh == 20


def test_pass_through_delivers_a_batch_taken_before_an_interruption():
    """A fresh batch taken but never delivered (the consumer was interrupted inside the
    stage) is delivered by the next iteration, not lost; one delivered is not repeated."""
    up = ScriptedUpstream(n=24, B=8)
    stage = make("pass", up)
    up.next_fresh()              # taken, never delivered
    assert np.array_equal(ids_of(epoch_of(stage)), up.epoch_ids(0))


# ---- example echo ------------------------------------------------------------------------
@pytest.mark.parametrize("e", [1.0, 2.0, 3.0])
@pytest.mark.parametrize("ahead", [False, True])
def test_example_echo_emits_every_sample_e_times_per_epoch(e, ahead):
    """Integer e: every id e times per epoch (echo index 0 .. e-1, the 0th fresh), for
    either device rhythm; batches are full but for the last."""
    up = ScriptedUpstream(n=40, B=8)
    stage = make("example", up, factor=e, device=AheadDevice(np) if ahead else None)
    for epoch in range(2):
        batches = epoch_of(stage)
        ids = ids_of(batches)
        assert np.bincount(ids, minlength=40).tolist() == [int(e)] * 40
        for sid in range(40):
            echoes = np.concatenate([b.echo_index[b.sample_ids == sid] for b in batches])
            assert sorted(echoes.tolist()) == list(range(int(e)))
        fresh = np.concatenate([b.fresh for b in batches])
        assert np.array_equal(fresh, np.concatenate([b.echo_index == 0 for b in batches]))
        assert {b.epoch for b in batches} == {epoch}
        assert all(len(b) == 8 for b in batches[:-1])
        assert len(batches) == stage.batches_in(epoch)


def test_example_echo_keeps_repeats_out_of_one_batch_and_apart():
    """With a buffer of 4 batches, no batch holds an id twice and no id is in two
    consecutive batches until the epoch's tail, where fewer distinct ids remain."""
    stage = make("example", ScriptedUpstream(n=64, B=8), factor=2.0, capacity=32)
    batches = epoch_of(stage)
    body = batches[:-3]
    assert all(len(set(b.sample_ids.tolist())) == len(b) for b in body)
    assert all(not set(a.sample_ids.tolist()) & set(b.sample_ids.tolist())
               for a, b in zip(body, body[1:]))


@pytest.mark.parametrize("n, e, capacity, drop_last", [
    (44, 2.0, 32, False), (44, 2.5, 32, False), (64, 3.0, 32, False), (44, 2.5, 32, True),
    (5, 3.0, 16, False)])
def test_the_end_of_an_epoch_never_puts_an_example_twice_in_a_batch(n, e, capacity,
                                                                    drop_last):
    """At the epoch's end fewer distinct examples remain than a batch's worth of repeats:
    no batch holds an id twice (short batches instead), every batch but the last is
    full where the epoch has a batch of examples, each id comes its count of times
    (drop_last: only full batches, less than one batch dropped), and batches_in counts
    the batches.  Five examples at e = 3 make three batches of five, not one of eight
    and one of seven."""
    stage = make("example", ScriptedUpstream(n=n, B=8), factor=e, capacity=capacity,
                 drop_last=drop_last)
    for epoch in range(2):
        batches = epoch_of(stage)
        assert all(len(set(b.sample_ids.tolist())) == len(b) for b in batches)
        want = stage.counts(stage.draws(epoch), np.arange(n))
        got = np.bincount(ids_of(batches), minlength=n)
        if drop_last:
            assert all(len(b) == 8 for b in batches)
            assert (got <= want).all() and 0 <= want.sum() - got.sum() < 8
        else:
            assert got.tolist() == want.tolist()
            assert all(len(b) == min(8, n) for b in batches[:-1])
        assert len(batches) == stage.batches_in(epoch)


def test_fractional_echo_is_floor_plus_one_with_the_fraction():
    """e = 2.5: each id 2 or 3 times; their mean is 2.5 within sampling error, and the
    counts are the same whatever the buffer size (a pure function of seed and epoch)."""
    counts = []
    for capacity in (16, 48):
        stage = make("example", ScriptedUpstream(n=400, B=8), factor=2.5, capacity=capacity)
        counts.append(np.bincount(ids_of(epoch_of(stage)), minlength=400))
    assert np.array_equal(counts[0], counts[1])
    assert set(counts[0].tolist()) == {2, 3}
    assert abs(counts[0].mean() - 2.5) < 4 * np.sqrt(0.25 / 400)


def test_example_echo_drop_last_drops_only_the_short_tail():
    """drop_last: every emitted batch is full; what is dropped is less than one batch."""
    stage = make("example", ScriptedUpstream(n=44, B=8), factor=2.0, drop_last=True)
    batches = epoch_of(stage)
    assert all(len(b) == 8 for b in batches)
    assert 88 - 8 < sum(len(b) for b in batches) <= 88
    assert len(batches) == stage.batches_in(0)


def test_a_stand_in_is_never_counted_fresh():
    """Rows whose sample failed upstream (ok=False) are emitted but never fresh, and the
    stage's books count only the samples' own rows as fresh."""
    up = ScriptedUpstream(n=24, B=8, failed={3, 17})
    stage = make("example", up, factor=2.0)
    batches = epoch_of(stage)
    fresh_ids = np.concatenate([b.sample_ids[b.fresh] for b in batches])
    assert sorted(fresh_ids.tolist()) == sorted(set(range(24)) - {3, 17})
    assert stage.books.fresh == 22


@pytest.mark.parametrize("ahead", [False, True])
def test_leaving_an_epoch_early_loses_and_repeats_nothing(ahead):
    """Breaking out after k batches and iterating again continues the same epoch: across
    both iterations every id is emitted e times and fresh once, as in one epoch, and the
    batches made ahead of the break are delivered first, not dropped."""
    stage = make("example", ScriptedUpstream(), factor=2.0,
                 device=AheadDevice(np) if ahead else None)
    first = []
    for batch in stage.batches():
        first.append(batch)
        if len(first) == 3:
            break
    rest = epoch_of(stage)
    both = first + rest
    assert np.bincount(ids_of(both), minlength=40).tolist() == [2] * 40
    fresh = np.concatenate([b.sample_ids[b.fresh] for b in both])
    assert sorted(fresh.tolist()) == list(range(40))
    assert {b.epoch for b in both} == {0} and stage.epoch == 1


def test_the_state_rereads_from_the_oldest_unsent_batch_and_skips_what_was_sent():
    """Saved mid-epoch, a state points at the oldest fresh batch with an example not yet
    emitted fresh and lists the ids from there on that were: a stage restored from it
    emits each remaining id fresh exactly once."""
    up = ScriptedUpstream(n=64, B=8)
    stage = make("example", up, factor=2.0)
    it = stage.batches()
    before = [next(it) for _ in range(5)]
    state = stage.state()
    it.close()
    sent = set(ids_of(before)[np.concatenate([b.fresh for b in before])].tolist())
    assert set(state["skip"]) <= sent
    restored_up = ScriptedUpstream(n=64, B=8)
    restored_up.seek(state["parent"]["ticket"])
    restored = make("example", restored_up, factor=2.0)
    restored.reset(state["skip"])
    after = epoch_of(restored)
    fresh_after = ids_of(after)[np.concatenate([b.fresh for b in after])]
    assert sorted(sent | set(fresh_after.tolist())) == list(range(64))
    assert not sent & set(fresh_after.tolist())


def test_the_ledger_stays_bounded_over_epochs():
    """The ledger of first emissions holds a few batches, not the epoch."""
    stage = make("example", ScriptedUpstream(n=200, B=8), factor=2.0, capacity=16)
    for _ in range(2):
        for _ in stage.batches():
            batches, ids = stage.ledger.size()
            assert batches <= 4 and ids <= 16


# ---- auto echo ---------------------------------------------------------------------------
class ScriptedClockAuto(AutoEcho):
    """AutoEcho fed scripted rates: whatever the stage measured, the upstream took
    ``up_s`` per fresh batch and the consumer ``down_s`` per delivered batch."""

    def __init__(self, up_s, down_s, **kw):
        super().__init__(8.0, **kw)
        self.up_s, self.down_s = up_s, down_s

    def upstream(self, seconds):
        super().upstream(self.up_s)

    def consumer(self, seconds):
        super().consumer(self.down_s)


@pytest.mark.parametrize("kind", ["example", "batch"])
def test_auto_echo_settles_at_headroom_times_r(kind):
    """Upstream 3x slower than the consumer: e settles at exactly 1.1 x 3 = 3.3, and the
    second epoch emits 3 or 4 of each id (of each batch, for batch echo)."""
    auto = ScriptedClockAuto(up_s=0.3, down_s=0.1)
    # fill_s > 0: the upstream reports its work per batch, as the ring's workers do.
    stage = make(kind, ScriptedUpstream(n=160, B=8, fill_s=0.3), auto=auto, capacity=32)
    epoch_of(stage)
    assert stage.e == pytest.approx(3.3)
    counts = np.bincount(ids_of(epoch_of(stage)), minlength=160)
    assert set(counts.tolist()) <= {3, 4}


def test_auto_echo_counts_a_stall_only_when_nothing_is_left_to_emit():
    """The consumer stalls (less than a batch to emit and no fresh batch ready) only
    after the first fill; the controller hears of each such stall."""
    stalls = []

    class Counting(AutoEcho):
        def stalled(self):
            stalls.append(len(stalls))

    up = ScriptedUpstream(n=64, B=8)
    up.ready_now = False
    stage = make("example", up, auto=Counting(1.0, start=1.0), capacity=8)
    epoch_of(stage)
    # A one-batch buffer at e = 1 is empty at every refill after the first.
    assert len(stalls) == up.batches_per_epoch - 1
    up2 = ScriptedUpstream(n=64, B=8)
    stalls.clear()
    stage = make("example", up2, auto=Counting(1.0, start=1.0), capacity=8)
    epoch_of(stage)
    assert not stalls  # fresh batches were always ready


# ---- batch echo --------------------------------------------------------------------------
@pytest.mark.parametrize("e", [2.0, 3.0])
def test_batch_echo_repeats_whole_batches_never_back_to_back(e):
    """Every fresh batch e times per epoch as a whole; the same batch is never emitted
    twice in a row while the window holds another."""
    up = ScriptedUpstream(n=48, B=8)
    stage = make("batch", up, factor=e, window=3)
    batches = epoch_of(stage)
    keys = [tuple(b.sample_ids.tolist()) for b in batches]
    fresh_batches = [tuple(up.epoch_ids(0)[i:i + 8].tolist()) for i in range(0, 48, 8)]
    assert sorted(keys) == sorted(fresh_batches * int(e))
    assert all(a != b for a, b in zip(keys, keys[1:]))
    assert len(batches) == stage.batches_in(0)
    assert all((b.echo_index == 0).all() == b.fresh.all() for b in batches)


def test_batch_echo_restored_skips_batches_emitted_before_the_save():
    """A state saved after some batches were emitted fresh: the restored stage does not
    emit them fresh again, and emits every other batch fresh once."""
    up = ScriptedUpstream(n=48, B=8)
    stage = make("batch", up, factor=2.0, window=3)
    it = stage.batches()
    before = [next(it) for _ in range(4)]
    state = stage.state()
    it.close()
    restored_up = ScriptedUpstream(n=48, B=8)
    restored_up.seek(state["parent"]["ticket"])
    restored = make("batch", restored_up, factor=2.0, window=3)
    restored.reset(state["skip"])
    after = epoch_of(restored)
    fresh = [set(b.sample_ids.tolist()) for b in before + after if b.fresh.all()]
    assert sorted(i for s in fresh for i in s) == list(range(48))

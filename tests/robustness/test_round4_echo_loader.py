"""Round four against EchoLoader and the echo stages (issue 40).

What a user gets: a batch the echo buffer refuses is named once and dropped, its
entries back, and iterating goes on; the wrapped loader's batches may be of any
size; iterating after close() (after a ``with`` block) starts where the stream
stood; an ``augment`` that raises loses no emission; ``state_dict()`` works with
any buffer; a state is checked whole before anything is loaded, and refused by
name when it belongs to another wrapped loader; ``len()`` counts the sampler's
examples; a wrapped generator that dies mid-epoch says so.

The wrapped loaders here are small host-side loaders of NumPy batches (a resumable
one stands in for torchdata's StatefulDataLoader), so every test runs in well under
a second.
"""
from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest

import echo_native as en

pytestmark = pytest.mark.timeout(60)


class Batches:
    """A resumable loader of the given batches (dicts of NumPy arrays): one pass is an
    epoch; ``state_dict()`` says where the pass stands, as StatefulDataLoader's does."""

    def __init__(self, batches):
        self.batches = list(batches)
        self.pos = 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        while self.pos < len(self.batches):
            b = self.batches[self.pos]
            self.pos += 1
            yield b
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


class Plain:
    """The same batches, not resumable: each iteration is a new pass (a DataLoader's)."""

    def __init__(self, batches):
        self.batches = list(batches)

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


def rows(sizes, start=0):
    """Batches of the given sizes over consecutive ids: ``x`` an int64 id column, ``v``
    rows of 3 floats that repeat the id."""
    out, at = [], start
    for n in sizes:
        ids = np.arange(at, at + n, dtype=np.int64)
        out.append({"x": ids, "v": np.repeat(ids[:, None], 3, axis=1).astype(np.float32)})
        at += n
    return out


def ids_of(batches):
    return [int(i) for b in batches for i in b["x"]]


def counts(batches, n):
    return np.bincount(ids_of(batches), minlength=n).tolist()


def drain(el, tries=10, errors=(ValueError, TypeError)):
    """Iterate ``el`` to the end of its epoch, catching (and counting) up to ``tries``
    errors and iterating on, as a training loop that logs and goes on would."""
    got, caught = [], []
    for _ in range(tries):
        try:
            for b in el:
                got.append(b)
            return got, caught
        except errors as err:
            caught.append(err)
    raise AssertionError(f"still failing after {tries} tries: {caught[-1]}")


# -- item 1: a batch the buffer refuses ------------------------------------------------------
def _bad(kind, n=16, start=0):
    b = rows([n], start)[0]
    if kind == "dtype":
        b["v"] = b["v"].astype(np.float64)
    elif kind == "shape":
        b["v"] = np.repeat(b["x"][:, None], 4, axis=1).astype(np.float32)
    elif kind == "keys":
        b["w"] = b.pop("v")
    elif kind == "0-d":
        b["v"] = np.float32(1.0) * np.ones((), np.float32)
    elif kind == "short list":
        b["names"] = ["a"] * (n - 3)
    return b


@pytest.mark.parametrize("kind", ["dtype", "shape", "keys", "0-d", "short list"])
@pytest.mark.parametrize("echo", [2, en.Echo(2, placement="batch")])
def test_a_refused_batch_is_named_once_dropped_and_iteration_goes_on(kind, echo):
    if kind == "shape" and isinstance(echo, en.Echo):
        pytest.skip("batch echo keeps whole batches: their shapes may vary")
    batches = rows([16] * 10)
    batches[3] = _bad(kind, start=48)
    el = en.EchoLoader(Batches(batches), echo=echo, shuffle_buffer=64)
    for epoch in range(2):   # the next epoch (where the leak used to spin) too
        el.set_epoch(epoch)
        got, caught = drain(el)
        assert len(caught) == 1, [str(e) for e in caught]
        assert "fresh batch 3 of epoch" in str(caught[0]), str(caught[0])
        c = counts(got, 160)
        assert c[48:64] == [0] * 16 and c[:48] + c[64:] == [2] * 144
        if el.stage.__class__.__name__ == "ExampleEcho":
            assert el.stage.buffer.free == 64   # every entry back


# -- item 2: batch sizes that vary ---------------------------------------------------------
@pytest.mark.parametrize("sizes, batch_size", [
    ([4, 8, 16, 32, 40, 12], None),        # growing
    ([24, 40, 7, 33, 1, 40, 40, 3], None),  # dynamic
    ([32] * 6, 8),                          # batch_size= smaller than the wrapped loader's
    ([0, 16, 16, 16, 9], None),             # an empty first batch
    ([16, 0, 16, 0, 0, 16], None),          # empty batches in the middle
])
@pytest.mark.parametrize("echo", [2, 3, en.Echo(2, placement="batch")])
def test_any_batch_size_is_echoed_exactly(sizes, batch_size, echo):
    n = sum(sizes)
    if batch_size is not None and isinstance(echo, en.Echo):
        with pytest.raises(ValueError, match="batch_size= does not apply to batch echo"):
            en.EchoLoader(Batches(rows(sizes)), echo=echo, batch_size=batch_size)
        return
    el = en.EchoLoader(Batches(rows(sizes)), echo=echo, batch_size=batch_size, seed=3)
    e = 2 if isinstance(echo, en.Echo) else echo
    for epoch in range(2):
        el.set_epoch(epoch)
        got = list(el)
        assert counts(got, n) == [e] * n
        assert all(len(b["x"]) for b in got)   # no empty batch delivered
        if not isinstance(echo, en.Echo):
            B = el.stage.batch_size
            assert all(len(set(b["x"].tolist())) == len(b["x"]) <= B for b in got)


def test_an_empty_batch_is_neither_counted_nor_delivered():
    el = en.EchoLoader(Batches(rows([16, 0, 16])), echo=1)
    got = list(el)
    assert [len(b["x"]) for b in got] == [16, 16] and el.stats()["batches"] == 2


# -- item 6: iterating after close() ---------------------------------------------------------
@pytest.mark.parametrize("echo", [2, 1, en.Echo(2, placement="batch")])
def test_iterating_after_a_with_block_starts_where_the_stream_stood(echo):
    """Closed mid-epoch, the next iteration reads on from the state a state_dict() would
    give: every example fresh exactly once (the echoes owed by examples emitted before
    the close are dropped, as across a resume); closed at an epoch's end, the next
    iteration is the next epoch, whole."""
    e = 1 if echo == 1 else 2
    el = en.EchoLoader(Batches(rows([8] * 12)), echo=echo, seed=5, with_info=True)
    with el:
        got = []
        for b in el:
            got.append(b)
            if len(got) == 7:
                break
    got += list(el)            # the rest of the epoch, after close()
    fresh = [int(i) for b, info in got for i in b["x"][info["fresh"]]]
    assert sorted(fresh) == list(range(96))
    assert 1 <= min(counts([b for b, _ in got], 96)) <= max(counts([b for b, _ in got], 96)) <= e
    with el:                   # a whole epoch in a block, then the next one after it
        el.set_epoch(1)
        assert counts([b for b, _ in el], 96) == [e] * 96
    assert counts([b for b, _ in el], 96) == [e] * 96 and el.epoch == 3


@pytest.mark.parametrize("echo", [2, 1, en.Echo(2, placement="batch")])
def test_a_loader_without_state_reads_its_next_epoch_after_close_mid_epoch(echo):
    """A DataLoader-like loader (each iteration a new pass, no state_dict()) cannot be read
    on from the middle: the next epoch, whole, with a warning saying so (was a false
    "yielded more batches than its len()", or an AttributeError)."""
    e = 1 if echo == 1 else 2
    el = en.EchoLoader(Plain(rows([8] * 12)), echo=echo, seed=5)
    it = iter(el)
    [next(it) for _ in range(5)]
    el.close()
    with pytest.warns(RuntimeWarning, match="rest of epoch 0 is not read; epoch 1 starts"):
        got = list(el)
    assert counts(got, 96) == [e] * 96 and el.epoch == 2


# -- item 4: augment raising -----------------------------------------------------------------
class FlakyAugment:
    """Raises on the calls numbered in ``fail`` (a transient fault: a full disk while
    logging, a CUDA OOM retried), else passes the batch through."""

    def __init__(self, fail):
        self.fail, self.calls = set(fail), 0

    def __call__(self, batch, keys):
        self.calls += 1
        if self.calls in self.fail:
            raise RuntimeError(f"augment failed on call {self.calls}")
        return batch


@pytest.mark.parametrize("e", [2, 1])
def test_an_augment_that_raises_loses_no_emission(e):
    """Two transient failures of augment= in epoch 0, caught by the loop: every example
    still comes e times and fresh once, and state_dict() works in the epochs after."""
    aug = FlakyAugment({4, 20})
    el = en.EchoLoader(Batches(rows([16] * 25)), echo=e, augment=aug, seed=2,
                       with_info=True)
    for epoch in range(2):
        el.set_epoch(epoch)
        got, caught = drain(el, errors=(RuntimeError,))
        assert len(caught) == (2 if epoch == 0 else 0)
        assert counts([b for b, _ in got], 400) == [e] * 400
        fresh = [int(i) for b, info in got for i in b["x"][info["fresh"]]]
        assert sorted(fresh) == list(range(400))
        assert el.state_dict()["skip"] == []   # the ledger holds nothing forever


def test_an_emission_that_raises_is_booked_only_when_made():
    """The stage level: a make() that raises leaves the buffer's books as they were."""
    aug = FlakyAugment({1})
    el = en.EchoLoader(Batches(rows([16] * 4)), echo=2, augment=aug, shuffle_buffer=32)
    with pytest.raises(RuntimeError):
        next(iter(el))
    buf = el.stage.buffer
    assert int(buf.next_echo.sum()) == 0 and buf.pending == 2 * len(buf)
    got = list(el)
    assert counts(got, 64) == [2] * 64


# -- item 3: states kept cover the buffer ----------------------------------------------------
@pytest.mark.parametrize("sizes, kw", [
    ([1] * 300, dict(batch_size=64)),                  # batches of 1, batch_size=64
    ([16] * 400, dict(shuffle_buffer=4096)),           # a large buffer over small batches
    ([4] * 300, dict(echo=en.Echo(2, placement="batch"), shuffle_buffer=4 * 128)),
])
def test_state_dict_works_whatever_the_buffer_holds(sizes, kw):
    n = sum(sizes)
    kw = {"echo": 2, **kw}
    el = en.EchoLoader(Batches(rows(sizes)), seed=1, with_info=True, **kw)
    it = iter(el)
    before = [next(it) for _ in range(3)]
    state = el.state_dict()
    el.close()
    again = en.EchoLoader(Batches(rows(sizes)), seed=1, with_info=True, **kw)
    again.load_state_dict(state)
    after = list(again)
    fresh = [int(i) for b, info in before + after for i in b["x"][info["fresh"]]]
    assert sorted(fresh) == list(range(n))


def test_the_kept_states_stay_bounded_by_the_buffer():
    """States are kept from the oldest batch with an example still unsent on: as far back
    as the buffer holds an example waiting (a few buffers' worth of batches at most, in
    practice), never the whole epoch of 2,000 batches."""
    el = en.EchoLoader(Batches(rows([2] * 2000)), echo=2, batch_size=8, shuffle_buffer=64)
    most = 0
    for _ in el:
        most = max(most, len(el.upstream._states))
    assert 32 <= most < 300


# -- item 8: a state saved with echo > 1, loaded at echo = 1 ---------------------------------
@pytest.mark.parametrize("saved_echo", [2, 3])
def test_a_state_saved_with_echo_loads_at_echo_1_without_repeats(saved_echo):
    el = en.EchoLoader(Batches(rows([16] * 25)), echo=saved_echo, seed=7, with_info=True)
    it = iter(el)
    before = [next(it) for _ in range(9)]
    state = el.state_dict()
    assert state["skip"]   # emitted ahead of the state's position
    el.close()
    one = en.EchoLoader(Batches(rows([16] * 25)), echo=1, seed=7, with_info=True)
    one.load_state_dict(state)
    after = list(one)
    fresh = [int(i) for b, info in before + after for i in b["x"][info["fresh"]]]
    assert sorted(fresh) == list(range(400))
    assert all(info["fresh"].all() for _, info in after)


def test_a_ring_state_saved_with_echo_loads_at_echo_1_without_repeats():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import echo_helpers as eh

    data = (eh.photo_jpegs(96, 16, 16, seed=3), np.arange(96) % 4)
    kw = dict(batch_size=8, image_size=8, workers=1, seed=2)
    with eh.small_ring(data, echo=2.0, **kw) as ring:
        it = iter(ring)
        before = []
        for _ in range(7):
            b = next(it)
            before.append((b.sample_ids.copy(), b.fresh.copy()))
        state = ring.state_dict()
    assert state["skip"]
    with eh.small_ring(data, echo=1, **kw) as one:
        one.load_state_dict(state)
        after = [(b.sample_ids.copy(), b.fresh.copy()) for b in one]
    fresh = [int(i) for ids, f in before + after for i in ids[f]]
    assert sorted(fresh) == list(range(96))


# -- item 11: the state validator -------------------------------------------------------------
class Watched(Batches):
    """Records load_state_dict calls: a bad state must be refused before any."""

    batch_size = 16

    def __init__(self, batches):
        super().__init__(batches)
        self.loaded = 0

    def load_state_dict(self, state):
        self.loaded += 1
        super().load_state_dict(state)


P = "state['parent']"   # where the wrapped loader's position is, in an EchoLoader's state


@pytest.mark.parametrize("key, value, says", [
    ("ticket", -5, f"{P}['ticket']"), ("epoch", -3, f"{P}['epoch']"),
    ("ticket", 2**70, f"{P}['ticket']"), ("epoch", 2**70, f"{P}['epoch']"),
    ("ticket", "3", f"{P}['ticket']"), ("ticket", 3.0, f"{P}['ticket']"),
    ("ticket", True, f"{P}['ticket']"), ("index", -1, f"{P}['index']"),
    ("index", 26, f"{P}['index']"), ("first_id", "0", f"{P}['first_id']"),
    ("first_id", 10**6, f"{P}['first_id']"), ("skip", "all", "state['skip']"),
    ("skip", [1.5], "state['skip']"), ("skip", [3, 3], "state['skip']"),
    ("skip", list(range(400)), "state['skip']"), ("seed", 8, "seed=8"),
    ("placement", "batch", "placement='batch'"), ("seed", 2**64, "state['seed']"),
])
def test_a_bad_state_is_refused_by_name_before_anything_is_loaded(key, value, says):
    el = en.EchoLoader(Watched(rows([16] * 25)), echo=2, seed=7)
    it = iter(el)
    [next(it) for _ in range(3)]
    state = el.state_dict()
    (state if key in state else state["parent"])[key] = value
    fresh = en.EchoLoader(Watched(rows([16] * 25)), echo=2, seed=7)
    with pytest.raises((ValueError, TypeError)) as err:
        fresh.load_state_dict(state)
    assert says in str(err.value), str(err.value)
    assert fresh.iterable.loaded == 0


@pytest.mark.parametrize("missing", ["ticket", "epoch", "index", "first_id", "wrapped", "skip"])
def test_a_state_missing_a_key_is_refused_naming_it(missing):
    el = en.EchoLoader(Watched(rows([16] * 25)), echo=2)
    state = el.state_dict()
    at = state if missing in state else state["parent"]
    del at[missing]
    where = "state" if at is state else r"state\['parent'\]"
    with pytest.raises(ValueError, match=f"{where} has no {missing!r}"):
        en.EchoLoader(Watched(rows([16] * 25)), echo=2).load_state_dict(state)


def test_a_valid_state_still_loads_and_the_rest_is_exact():
    el = en.EchoLoader(Watched(rows([16] * 25)), echo=2, seed=7, with_info=True)
    it = iter(el)
    before = [next(it) for _ in range(6)]
    state = el.state_dict()
    again = en.EchoLoader(Watched(rows([16] * 25)), echo=2, seed=7, with_info=True)
    again.load_state_dict(state)
    fresh = [int(i) for b, info in before + list(again) for i in b["x"][info["fresh"]]]
    assert sorted(fresh) == list(range(400)) and again.iterable.loaded == 1


# -- item 12: a state from another wrapped loader; a live state dict --------------------------
@pytest.mark.parametrize("other", [
    lambda: Watched(rows([16] * 20)),                       # another length
    lambda: type("W8", (Watched,), {"batch_size": 8})(rows([8] * 25)),   # another batch size
])
def test_a_state_of_another_wrapped_loader_is_refused(other):
    el = en.EchoLoader(Watched(rows([16] * 25)), echo=2)
    it = iter(el)
    [next(it) for _ in range(3)]
    state = el.state_dict()
    target = en.EchoLoader(other(), echo=2)
    with pytest.raises(ValueError, match="would not continue exactly"):
        target.load_state_dict(state)
    assert target.iterable.loaded == 0


def test_a_state_of_a_loader_shuffled_with_another_seed_is_refused():
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, DistributedSampler

    class Resumable(DataLoader):   # what a StatefulDataLoader adds, reduced to the API
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            self.loaded = True

    data = torch.utils.data.TensorDataset(torch.arange(64))

    def by_generator(seed):
        return Resumable(data, batch_size=8, shuffle=True,
                         generator=torch.Generator().manual_seed(seed))

    def by_sampler(seed):
        return Resumable(data, batch_size=8,
                         sampler=DistributedSampler(data, num_replicas=2, rank=0, seed=seed))

    for make in (by_generator, by_sampler):
        el = en.EchoLoader(make(11), echo=2)
        it = iter(el)
        next(it)
        state = el.state_dict()
        assert state["parent"]["upstream_seed"] == 11
        other = en.EchoLoader(make(12), echo=2)
        with pytest.raises(ValueError, match="upstream_seed=11, this EchoLoader has "
                                             "upstream_seed=12"):
            other.load_state_dict(state)
        assert not hasattr(other.iterable, "loaded")
        en.EchoLoader(make(11), echo=2).load_state_dict(state)   # the same seed loads


class Live(Batches):
    """A loader whose state_dict() hands out its live dict, changed as it reads."""

    def __init__(self, batches):
        super().__init__(batches)
        self._state = {"pos": 0}

    def __iter__(self):
        while self._state["pos"] < len(self.batches):
            b = self.batches[self._state["pos"]]
            self._state["pos"] += 1
            yield b
        self._state["pos"] = 0

    def state_dict(self):
        return self._state

    def load_state_dict(self, state):
        self._state = state   # kept by reference, as a careless loader would


def test_a_live_state_dict_is_copied_not_kept_by_reference():
    el = en.EchoLoader(Live(rows([16] * 25)), echo=2, seed=3, with_info=True)
    it = iter(el)
    before = [next(it) for _ in range(8)]
    state = el.state_dict()
    again = en.EchoLoader(Live(rows([16] * 25)), echo=2, seed=3, with_info=True)
    again.load_state_dict(state)
    after = list(again)
    fresh = [int(i) for b, info in before + after for i in b["x"][info["fresh"]]]
    assert sorted(fresh) == list(range(400))
    assert state["parent"]["wrapped"]["pos"] < 25   # the state did not move on with the loader


# -- item 9: len() with a sampler that is not the whole dataset ------------------------------
def test_len_counts_the_samplers_examples():
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, DistributedSampler, SubsetRandomSampler

    data = torch.utils.data.TensorDataset(torch.arange(1000))
    shard = DistributedSampler(data, num_replicas=4, rank=1, shuffle=True, seed=0)
    subset = SubsetRandomSampler(list(range(0, 1000, 10)),
                                 generator=torch.Generator().manual_seed(0))
    for sampler, n in ((shard, 250), (subset, 100)):
        for echo, drop_last in ((2, False), (2, True), (1, False),
                                (en.Echo(2, placement="batch"), False)):
            dl = DataLoader(data, batch_size=16, sampler=sampler, drop_last=drop_last)
            el = en.EchoLoader(dl, echo=echo, seed=1)
            expected = len(el)
            got = list(el)
            assert len(got) == expected, (sampler, echo, drop_last)
            assert el.upstream.samples_per_epoch == (n // 16 * 16 if drop_last else n)


# -- item 13: a wrapped generator that raises mid-epoch ---------------------------------------
def test_a_generator_that_raises_mid_epoch_says_the_epoch_ends_there():
    def gen():
        for i, b in enumerate(rows([16] * 25)):
            if i == 7:
                raise OSError("disk gone")
            yield b

    el = en.EchoLoader(gen(), echo=2)
    with pytest.raises(OSError, match="disk gone"):
        list(el)
    with pytest.warns(RuntimeWarning, match=r"raised \(OSError: disk gone\) after 7 batches"):
        rest = list(el)
    assert counts(rest, 112).count(2) <= 112


def test_a_loader_shorter_than_its_len_is_named():
    class Short(Batches):
        def __len__(self):
            return 30

    with pytest.warns(RuntimeWarning, match=r"after 25 batches, short of its len\(\) \(30\)"):
        list(en.EchoLoader(Short(rows([16] * 25)), echo=1))


# -- item 16b: seeds past 2**63 ----------------------------------------------------------------
def test_seeds_past_2_63_augment_and_draw_by_the_whole_seed():
    from echo_native.echo.counts import echo_draws, shuffle_rng

    seen = {}

    def augment(batch, keys):
        seen.setdefault("seed", keys[0, 0].view(np.uint64) if keys.dtype == np.int64 else None)
        return batch

    for seed in (2**63, 2**64 - 1):
        seen.clear()
        list(en.EchoLoader(Batches(rows([8] * 4)), echo=2, augment=augment, seed=seed))
        assert int(seen["seed"]) == seed
    a, b = echo_draws(2**63, 0, 64), echo_draws(2**63 + 1, 0, 64)
    assert not np.array_equal(a, b)
    assert not np.array_equal(shuffle_rng(2**63, 0).random(8), shuffle_rng(2**63 + 1, 0).random(8))


def test_an_echo_rings_on_batch_keys_carry_a_seed_past_2_63():
    """EchoRing's on_batch keys are int64 like augment's: a seed >= 2**63 is its 64 bits
    (keys[:, 0].view(np.uint64)), never an OverflowError."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import echo_helpers as eh

    seen = []

    def on_batch(images, xp, keys):
        seen.append(int(keys[0, 0:1].view(np.uint64)[0]))

    data = (eh.photo_jpegs(16, 16, 16, seed=4), np.arange(16) % 2)
    for seed in (2**63 + 5, 2**64 - 1):
        seen.clear()
        with eh.small_ring(data, echo=1, batch_size=8, image_size=8, workers=1, seed=seed,
                           on_batch=on_batch) as ring:
            assert sum(len(b) for b in ring) == 16
        assert seen == [seed, seed]


def test_seeds_below_2_63_keep_their_draws():
    from echo_native.echo.counts import echo_draws

    for seed in (0, 7, 2**40 + 3, 2**63 - 1):
        old = np.random.Generator(np.random.Philox(key=[seed, 0x6563686F],
                                                   counter=[3, 0, 0, 0])).random(32)
        assert np.array_equal(echo_draws(seed, 3, 32), old)


# -- item 17: batches that require grad --------------------------------------------------------
@pytest.mark.parametrize("echo", [2, en.Echo(2, placement="batch")])
def test_batches_that_require_grad_never_pull_the_buffer_into_autograd(echo):
    torch = pytest.importorskip("torch")
    w = torch.ones(1, requires_grad=True)

    def batches():
        for i in range(40):
            yield {"x": torch.arange(i * 8, i * 8 + 8), "v": torch.ones(8, 3) * w}

    for b in en.EchoLoader(batches(), echo=echo):
        assert b["v"].grad_fn is None and not b["v"].requires_grad


# -- item 19: messages and edges -----------------------------------------------------------
@pytest.mark.parametrize("echo", [2, 1])
def test_a_0d_leaf_is_named_as_such_in_every_mode(echo):
    batches = rows([16] * 4)
    batches[0]["v"] = np.ones((), np.float32)
    with pytest.raises(ValueError, match=r"batch\['v'\] is a 0-d array"):
        list(en.EchoLoader(Batches(batches), echo=echo))


def test_a_batch_nested_3000_deep_is_refused_by_name():
    deep = {"x": np.arange(4)}
    for _ in range(3000):
        deep = {"d": deep}
    with pytest.raises(ValueError, match="nested deeper than Python's recursion limit"):
        list(en.EchoLoader(iter([deep]), echo=2))


def test_len_of_a_plain_iterable_says_what_is_missing():
    class Sized:
        def __len__(self):
            return 4

        def __iter__(self):
            return iter(rows([8] * 4))

    with pytest.raises(TypeError, match="does not say how many") as err:
        len(en.EchoLoader(Sized(), echo=2, batch_size=8))
    assert "give batch_size=" not in str(err.value)


# -- items 7 and 14: the memory budget, and max_buffer_bytes for batch echo --------------------
def _big(n_batches=6, B=16, row_bytes=64 << 10):
    return [{"x": np.arange(i * B, i * B + B), "v": np.zeros((B, row_bytes), np.uint8)}
            for i in range(n_batches)]


def test_a_buffer_over_the_memory_available_is_refused_at_the_first_batch(monkeypatch):
    from echo_native import memory

    monkeypatch.setattr(memory, "memory_available",
                        lambda backing="memfd", shm_dir=None: (100 << 20, "memory cgroup "
                                                               "limit 104,857,600 bytes in /x"))
    el = en.EchoLoader(Batches(_big()), echo=2, shuffle_buffer=1024)   # 64 MiB
    with pytest.raises(en.RingMemoryError) as err:
        next(iter(el))
    msg = str(err.value)
    assert "shuffle_buffer" in msg and "memory cgroup limit" in msg, msg
    assert err.value.available == 100 << 20 and err.value.needed > 100 << 20
    ok = en.EchoLoader(Batches(_big()), echo=2, shuffle_buffer=256)    # 16 MiB: fits
    assert counts(list(ok), 96) == [2] * 96


def test_batch_echo_window_is_held_to_max_buffer_bytes_and_the_memory_available(monkeypatch):
    from echo_native import memory

    batch = en.Echo(2, placement="batch")
    with pytest.raises(MemoryError, match="max_buffer_bytes=4,194,304"):
        next(iter(en.EchoLoader(Batches(_big()), echo=batch, max_buffer_bytes=4 << 20)))
    monkeypatch.setattr(memory, "memory_available",
                        lambda backing="memfd", shm_dir=None: (80 << 20, "MemAvailable"))
    with pytest.raises(en.RingMemoryError, match="batch echo's window"):
        next(iter(en.EchoLoader(Batches(_big()), echo=batch, shuffle_buffer=16 * 32)))
    assert counts(list(en.EchoLoader(Batches(_big()), echo=batch)), 96) == [2] * 96


# -- item 15: an endless stream ---------------------------------------------------------------
def test_the_draws_of_an_endless_epoch_stay_bounded_and_exact():
    from echo_native.echo.counts import echo_draws
    from echo_native.echo.stages import EpochDraws

    d = EpochDraws(9, 2, 0)
    for start in range(0, 5_000_000, 250_000):
        ids = np.arange(start, start + 64)
        got = d[ids]
        assert len(d._d) <= 2 * EpochDraws.WINDOW
    assert np.array_equal(got, echo_draws(9, 2, start + 64)[start:])
    assert np.array_equal(d[np.arange(10, 20)], echo_draws(9, 2, 20)[10:])   # back again


# -- item 18: close() from a watchdog thread -------------------------------------------------
class Stuck(Batches):
    """A resumable loader whose batch ``stick_at`` never comes until its workers are shut
    down (``_shutdown_workers``, as a torch DataLoader iterator's), which makes the
    waiting ``next()`` raise, as a DataLoader whose workers exited does."""

    def __init__(self, batches, stick_at):
        super().__init__(batches)
        self.stick_at = stick_at
        self.inside = threading.Event()
        self.released = threading.Event()

    def __iter__(self):
        return StuckIter(self)


class StuckIter:
    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        return self

    def __next__(self):
        lo = self.loader
        if lo.pos == lo.stick_at and not lo.released.is_set():
            lo.inside.set()
            if not lo.released.wait(timeout=30):
                raise AssertionError("never released")
            raise RuntimeError("DataLoader worker (pid 123) exited unexpectedly")
        if lo.pos >= len(lo.batches):
            lo.pos = 0
            raise StopIteration
        lo.pos += 1
        return lo.batches[lo.pos - 1]

    def _shutdown_workers(self):
        self.loader.released.set()


def test_a_watchdog_thread_can_close_a_loader_stuck_in_the_wrapped_loader():
    loader = Stuck(rows([8] * 12), stick_at=6)
    el = en.EchoLoader(loader, echo=2, seed=1, with_info=True)
    got, errors = [], []

    def consume():
        try:
            for b in el:
                got.append(b)
        except Exception as err:   # what the consumer sees: the loader's error, or closed
            errors.append(err)

    t = threading.Thread(target=consume)
    t.start()
    assert loader.inside.wait(timeout=30)
    with pytest.raises(RuntimeError, match="set_epoch while another thread is inside next"):
        el.set_epoch(3)
    el.close()                    # from this (watchdog) thread: no error
    t.join(timeout=30)
    assert not t.is_alive() and len(errors) == 1, errors
    assert el.stage.buffer is None   # the rest of close() ran in the consumer's thread
    rest = list(el)               # and iterating again reads on
    fresh = [int(i) for b, info in got + rest for i in b["x"][info["fresh"]]]
    assert sorted(fresh) == list(range(96))


def test_close_from_another_thread_while_a_batch_is_read_ends_that_iterator():
    gate, inside = threading.Event(), threading.Event()

    def slow():
        for i, b in enumerate(rows([8] * 6)):
            if i == 2:
                inside.set()
                assert gate.wait(timeout=30)
            yield b

    el = en.EchoLoader(slow(), echo=1)
    it = iter(el)
    got, errors = [], []

    def consume():
        try:
            for b in it:
                got.append(b)
        except RuntimeError as err:
            errors.append(err)

    t = threading.Thread(target=consume)
    t.start()
    assert inside.wait(timeout=30)
    el.close()
    gate.set()
    t.join(timeout=30)
    assert not t.is_alive()
    assert len(errors) == 1 and "closed" in str(errors[0]), errors
    assert len(got) == 3   # the batch in flight was delivered, then the iterator ended


# -- item 5: a caught Ctrl-C ------------------------------------------------------------------
def _interrupted(make_iterable, interrupts=300, seed=0):
    """Iterate with SIGINT sent to the main thread every 1-8 ms (at most ``interrupts`` of
    them), catching each KeyboardInterrupt and iterating on, as a training loop that
    catches Ctrl-C to save and go on would.  Returns what ``collect`` kept."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler or \
            threading.current_thread() is not threading.main_thread():
        pytest.skip("SIGINT has a handler of its own here, or tests run off the main thread")
    stop, go, sent = threading.Event(), threading.Event(), [0]
    first = threading.Event()

    def sender():
        rng = np.random.default_rng(seed)
        go.wait(timeout=30)   # only once the loop below catches what it sends
        while sent[0] < interrupts and not stop.is_set():
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            sent[0] += 1
            first.set()
            stop.wait(rng.uniform(0.001, 0.008))

    got, caught = [], 0
    t = threading.Thread(target=sender, daemon=True)
    t.start()
    try:
        loader = make_iterable()
        epoch = loader.epoch
        for _ in range(100 * interrupts):
            it = None
            try:
                go.set()
                # The iteration starts once the sender runs (its first interrupt lands
                # here, in the loop's own handler): a short epoch cannot end before any
                # interrupt was sent, however the threads are scheduled.
                first.wait(timeout=30)
                it = iter(loader)
                for item in it:
                    got.append(item)   # a C call: no signal lands between for and append
                break
            except KeyboardInterrupt:
                caught += 1
                if loader.epoch != epoch:
                    break   # it came with the epoch's end: the epoch is whole
            # Closed here, not by the garbage collector: an interrupt in a finalizer is
            # "unraisable" (and pytest's hook for those may itself be interrupted).
            for _ in range(100):
                try:
                    if it is not None:
                        it.close()
                    break
                except KeyboardInterrupt:
                    continue
        else:
            raise AssertionError("never finished the epoch")
    finally:
        stop.set()
        # A signal sent just before the stop may land in the join or just after it.
        for _ in range(100):
            try:
                t.join(timeout=10)
                time.sleep(0.05)
                break
            except KeyboardInterrupt:
                continue
    # Interrupts were sent and caught (held ones coalesce: fewer are caught than sent).
    assert sent[0] >= 1 and caught >= 1, (caught, sent[0], len(got))
    return got


@pytest.mark.parametrize("echo", [2, 1, en.Echo(2, placement="batch")])
def test_a_caught_ctrl_c_neither_loses_nor_repeats_an_example(echo):
    """Batches of 8 from a loader that works a little for each (so interrupts land inside
    the echo stage and the wrapped loader alike): after every interrupt is caught,
    each of 4,000 examples was fresh exactly once in the epoch."""
    class Loader:
        """A DataLoader-like loader: its iterator works a little for each batch (an
        interrupt inside it, a second one while a first is held, leaves it usable)."""

        def __len__(self):
            return 500

        def __iter__(self):
            return LoaderIter()

    class LoaderIter:
        def __init__(self):
            self.batches, self.pos = rows([8] * 500), 0

        def __next__(self):
            sum(range(20000))   # a little work per batch
            if self.pos == len(self.batches):
                raise StopIteration
            self.pos += 1
            return self.batches[self.pos - 1]

    el = en.EchoLoader(Loader(), echo=echo, seed=1, with_info=True)
    got = _interrupted(lambda: el)
    fresh = [int(i) for b, info in got for i in b["x"][info["fresh"]]]
    assert sorted(fresh) == list(range(4000))


@pytest.mark.parametrize("echo", [2.0, en.Echo(2, placement="batch"),
                                  en.Echo(2, placement="before_augment")])
def test_a_caught_ctrl_c_loses_no_batch_of_an_echo_ring(echo):
    """The same against EchoRing's echo stages (the batch's ids are owned arrays when
    echoing, so the batches themselves are kept)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import echo_helpers as eh

    data = (eh.photo_jpegs(400, 16, 16, seed=3), np.arange(400) % 4)
    with eh.small_ring(data, echo=echo, batch_size=8, image_size=8, workers=1, seed=2) as ring:
        assert ring._iteration.hold_interrupts
        got = _interrupted(lambda: ring)
        fresh = [int(i) for b in got for i in b.sample_ids[b.fresh]]
    assert sorted(fresh) == list(range(400))


class Waiting:
    """A loader whose batch ``at`` waits for ``release`` (a slow or stuck loader)."""

    def __init__(self, at):
        self.at, self.inside, self.release = at, threading.Event(), threading.Event()

    def __len__(self):
        return 12

    def __iter__(self):
        return WaitingIter(self)


class WaitingIter:
    def __init__(self, loader):
        self.loader, self.batches, self.pos = loader, rows([8] * 12), 0

    def __next__(self):
        lo = self.loader
        if self.pos == lo.at and not lo.release.is_set():
            lo.inside.set()
            if not lo.release.wait(timeout=30):
                raise TimeoutError("the wait was never interrupted nor released")
        if self.pos == len(self.batches):
            raise StopIteration
        self.pos += 1
        return self.batches[self.pos - 1]


def _signal_when_inside(loader, presses, then_release, done=None):
    """Once the loader waits: ``presses`` Ctrl-Cs (until ``done`` is set, when given: two
    signals sent close together may reach the process as one, so pressing goes on
    until the interrupt has landed), then the release if asked."""
    def run():
        if loader.inside.wait(timeout=30):
            for _ in range(presses):
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                if done is not None and done.wait(0.05):
                    break
                time.sleep(0.05)   # let each land on its own (not an assertion)
            if then_release:
                loader.release.set()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_one_ctrl_c_in_a_slow_loader_is_held_until_its_batch_is_kept():
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler or \
            threading.current_thread() is not threading.main_thread():
        pytest.skip("SIGINT has a handler of its own here, or tests run off the main thread")
    loader = Waiting(at=4)
    el = en.EchoLoader(loader, echo=2, seed=1, with_info=True)
    t = _signal_when_inside(loader, presses=1, then_release=True)
    got, caught = [], 0
    for _ in range(5):
        try:
            for b in el:
                got.append(b)
            break
        except KeyboardInterrupt:
            caught += 1
    t.join(timeout=30)
    assert caught == 1 and loader.release.is_set()
    fresh = [int(i) for b, info in got for i in b["x"][info["fresh"]]]
    assert sorted(fresh) == list(range(96))


def test_a_second_ctrl_c_interrupts_a_stuck_loader():
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler or \
            threading.current_thread() is not threading.main_thread():
        pytest.skip("SIGINT has a handler of its own here, or tests run off the main thread")
    loader = Waiting(at=4)
    el = en.EchoLoader(loader, echo=2, seed=1, with_info=True)
    done = threading.Event()
    t = _signal_when_inside(loader, presses=40, then_release=False, done=done)
    got = []
    with pytest.raises(KeyboardInterrupt):
        try:
            for b in el:
                got.append(b)
        finally:
            done.set()
    t.join(timeout=30)
    assert not loader.release.is_set()   # interrupted inside the wait, not after it
    loader.release.set()
    got += list(el)                      # and iterating on loses nothing
    fresh = [int(i) for b, info in got for i in b["x"][info["fresh"]]]
    assert sorted(fresh) == list(range(96))

"""Elastic resume: the states of all N ranks of a job resumed by a job of M ranks.

The ranks of each job are simulated in one process (``rank=``/``world_size=``;
``tests/test_distributed.py`` runs the real thing under torchrun).  References:
the epoch's global order (what the saved job had not emitted fresh, split as
``DistributedSampler`` splits an epoch), and a fresh M-rank job for the next epoch.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

import echo_native as en
from echo_native import merge_states

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import sources_helpers as sh

N = 45   # odd: 2 and 3 ranks both pad
B = 8
SEED = 5


@pytest.fixture(scope="module")
def samples():
    return en.Samples(sh.photo_jpegs(N, 36, 44, seed=21), np.arange(N) % 4)


def _ring(samples, rank, world, echo=2, placement="before_augment", workers=1,
          mode="thread", **kw):
    return en.EchoRing(samples, batch_size=B, image_size=16, echo=echo, placement=placement,
                       workers=workers, worker_mode=mode, seed=SEED, rank=rank,
                       world_size=world, **kw)


def _fresh(batches):
    return [int(s) for ids, fresh, _ in batches for s in ids[fresh]]


def _stream(batches):
    return [ids.tolist() for ids, _, _ in batches]


def _save(make, world, stops, through_json=True):
    """Run ``stops[r]`` batches on each rank ``r`` of a ``world``-rank job made by
    ``make(rank, world)``; returns the fresh ids emitted (all ranks) and the states."""
    fresh, states = [], []
    for rank in range(world):
        with make(rank, world) as ring:
            fresh += _fresh(sh.run_epoch(ring, stops[rank]))
            state = ring.state_dict()
        states.append(json.loads(json.dumps(state)) if through_json else state)
    return fresh, states


def _resume(make, world, states):
    """Each rank of a ``world``-rank job loads ``states`` and runs the rest of the
    epoch and the next one: per rank (len before, batches, next epoch's batches)."""
    out = []
    for rank in range(world):
        ring = make(rank, world)
        ring.load_state_dict(states)
        with ring:
            expected = len(ring)
            rest = sh.run_epoch(ring)
            nxt = sh.run_epoch(ring)
        out.append((expected, rest, nxt))
    return out


def _flat(lists):
    return [x for part in lists for x in part]


def _left(order, consumed):
    gone = set(consumed)
    return [int(i) for i in order if int(i) not in gone]


def _split(ids, world):
    """``ids`` over ``world`` ranks as DistributedSampler splits an epoch (wrapping)."""
    padded = np.resize(np.asarray(ids, np.int64), math.ceil(len(ids) / world) * world)
    return [sorted(padded[r::world].tolist()) for r in range(world)]


CASES = [(1, "before_augment"), (2, "before_augment"), (2, "after_augment"), (2, "batch"),
         (2.5, "before_augment")]
WORLDS = [(2, 3, 2), (3, 2, 1), (2, 1, 1), (1, 2, 3)]


@pytest.mark.parametrize("old,new,stop", WORLDS)
@pytest.mark.parametrize("echo,placement", CASES)
def test_rest_of_epoch_split_over_new_ranks(samples, echo, placement, old, new, stop):
    """N -> M ranks (other worker counts): the samples the old ranks had not emitted
    fresh are emitted fresh once, split as DistributedSampler splits an epoch; the new
    ranks take equal steps; the next epoch is a fresh M-rank job's."""
    def saving(rank, world):
        return _ring(samples, rank, world, echo, placement, workers=2)

    def resuming(rank, world):
        return _ring(samples, rank, world, echo, placement, workers=1 + rank % 2)

    before, states = _save(saving, old, [stop] * old)
    order = saving(0, 1).loader.plan.global_order(0)
    left = _left(order, before)
    resumed = _resume(resuming, new, states)
    assert [sorted(_fresh(rest)) for _, rest, _ in resumed] == _split(left, new)
    steps = [len(rest) for _, rest, _ in resumed]
    assert len(set(steps)) == 1 and steps[0] > 0, steps
    if placement != "batch" and echo != 1:
        # len() counts what the epoch has left (it counts the whole epoch for
        # echo=1 and batch echo, as after any mid-epoch resume)
        assert [e for e, _, _ in resumed] == steps
    for rank, (_, _, nxt) in enumerate(resumed):
        with _ring(samples, rank, new, echo, placement) as ring:
            ring.set_epoch(1)
            ref = sh.run_epoch(ring)
        assert _stream(nxt) == _stream(ref), rank
        assert _fresh(nxt) == _fresh(ref)


def test_loader_resumed_batches_hold_the_right_pixels(samples):
    """A Loader resumed 2 -> 3 ranks (process workers): each sample of the rest is the
    very pixels and label an uninterrupted run gives it in that epoch."""
    def loader(rank, world, workers=1, mode="thread"):
        return en.Loader(samples, B, image_size=16, workers=workers, worker_mode=mode,
                         seed=SEED, rank=rank, world_size=world)

    with loader(0, 1, 2) as ld:
        ref = {int(i): (img.copy(), int(lab)) for b in ld
               for i, img, lab in zip(b.sample_ids, b.images, b.labels)}
    before, states = _save(loader, 2, [2, 2])
    seen = []
    for rank in range(3):
        ld = loader(rank, 3, 2, "process")
        ld.load_state_dict(states)
        with ld:
            assert ld.epoch == 0 and ld.left_in_epoch == 1
            for b in ld:
                assert len(b) == 5  # the 13 left, padded to 15
                for i, img, lab in zip(b.sample_ids, b.images, b.labels):
                    assert np.array_equal(img, ref[int(i)][0]) and lab == ref[int(i)][1]
                    seen.append(int(i))
    order = loader(0, 1).plan.global_order(0)
    assert sorted(seen) == sorted(_flat(_split(_left(order, before), 3)))


def test_resume_twice_in_one_epoch(samples):
    """2 -> 3 -> 2 ranks inside one epoch: across the three jobs each sample of the
    epoch is emitted fresh once, up to each job's own padding."""
    def make(rank, world):
        return _ring(samples, rank, world, 2)

    order = make(0, 1).loader.plan.global_order(0)
    first, states = _save(make, 2, [1, 1])
    after_first = _left(order, first)
    second, states = _save(lambda r, w: _loaded(make(r, w), states), 3, [1, 1, 1])
    assert set(second) <= set(after_first)
    # 3 ranks pad the rest of the epoch to a multiple of 3 with samples they share: those
    # (and only those) may be fresh on two ranks, depending on where the echo stage puts
    # them in its batches.
    pad = -len(after_first) % 3
    assert len(second) == 3 * B and len(second) - len(set(second)) <= pad
    assert len(json.dumps(states)) < 10_000  # the history of the first resume rides along
    resumed = _resume(make, 2, states)
    last = [i for _, rest, _ in resumed for i in _fresh(rest)]
    assert sorted(last) == sorted(_flat(_split(_left(after_first, second), 2)))
    assert set(first) | set(second) | set(last) == set(range(N))
    assert not set(first) & set(second) and not (set(first) | set(second)) & set(last)


def _loaded(ring, states):
    ring.load_state_dict(states)
    return ring


def test_own_state_inside_a_resumed_epoch(samples):
    """One rank's own state, saved inside an epoch resumed from all ranks, resumes in
    a job of the same size exactly: the rest of that rank's stream."""
    def make(rank, world):
        return _ring(samples, rank, world, 2)

    _, states = _save(make, 2, [1, 1])
    with _loaded(make(1, 3), states) as ring:
        whole = sh.run_epoch(ring)
    with _loaded(make(1, 3), states) as ring:
        part = sh.run_epoch(ring, 1)
        own = json.loads(json.dumps(ring.state_dict()))
    assert own["parent"]["resumed"]["world_size"] == 2 and own["parent"]["world_size"] == 3
    with _loaded(make(1, 3), own) as ring:
        rest = sh.run_epoch(ring)
        assert ring.epoch == 1
    assert sorted(_fresh(part) + _fresh(rest)) == sorted(_fresh(whole))
    with pytest.raises(ValueError, match="all 3 ranks"):
        make(1, 2).load_state_dict(own)


def test_saved_at_epoch_end_gives_a_fresh_jobs_next_epoch(samples):
    """States saved at an epoch's end resume as a fresh M-rank job at the next epoch."""
    def make(rank, world):
        return _ring(samples, rank, world, 2)

    _, states = _save(make, 2, [None, None])
    assert [s["parent"]["epoch"] for s in states] == [1, 1]
    resumed = _resume(make, 3, states)
    for rank, (_, rest, _) in enumerate(resumed):
        with make(rank, 3) as ring:
            ring.set_epoch(1)
            assert _stream(rest) == _stream(sh.run_epoch(ring))


def test_a_rank_done_with_its_shard_while_others_are_not(samples):
    """A rank whose state stands at the next epoch's start (its last batch already
    emitted) counts as done with the epoch; the others' rest is split."""
    def make(rank, world):
        return en.Loader(samples, B, image_size=16, workers=1, worker_mode="thread",
                         seed=SEED, rank=rank, world_size=world)

    before, states = _save(make, 2, [None, 1])
    assert [s["epoch"] for s in states] == [1, 0]
    assert merge_states(states)["epoch"] == 0
    got = []
    for rank in range(2):
        with _loaded(make(rank, 2), states) as ld:
            got.append(sorted(int(i) for b in ld for i in b.sample_ids))
    order = make(0, 1).plan.global_order(0)
    assert got == _split(_left(order, before), 2)


def test_leaving_the_resumed_epoch_makes_it_whole(samples):
    """set_epoch back to the resumed epoch runs it whole, as a fresh job."""
    def make(rank, world):
        return _ring(samples, rank, world, 2)

    _, states = _save(make, 2, [1, 1])
    with _loaded(make(0, 3), states) as ring:
        sh.run_epoch(ring)
        ring.set_epoch(0)
        again = sh.run_epoch(ring)
        assert "resumed" not in ring.state_dict()
    with make(0, 3) as ring:
        assert _stream(again) == _stream(sh.run_epoch(ring))


@pytest.mark.parametrize("drop_last", [False, True])
def test_rest_follows_the_plans_rule(samples, drop_last):
    """Evaluation shards (no padding) split the rest unevenly, each sample once;
    drop_last truncates it to full batches on every rank, as it does an epoch."""
    def make(rank, world):
        return en.Loader(samples, 4, image_size=16, workers=1, worker_mode="thread",
                         seed=SEED, rank=rank, world_size=world, shuffle=drop_last,
                         drop_last=drop_last)

    before, states = _save(make, 2, [2, 2])
    left = _left(make(0, 1).plan.global_order(0), before)
    got = []
    for rank in range(3):
        with _loaded(make(rank, 3), states) as ld:
            got.append([b.sample_ids.tolist() for b in ld])
    if drop_last:
        per = len(left) // 3 // 4 * 4
        assert all(len(_flat(g)) == per and all(len(b) == 4 for b in g) for g in got)
        ids = _flat(_flat(got))
        assert len(set(ids)) == len(ids) == 3 * per and set(ids) <= set(left)
    else:
        assert [_flat(g) for g in got] == [left[r::3] for r in range(3)]


def test_one_rank_state_in_another_world_size_raises(samples):
    """A single rank's state given to a job of another size asks for all ranks' states;
    the same state in a same-sized job still resumes as before."""
    _, states = _save(lambda r, w: _ring(samples, r, w, 2), 2, [1, 1])
    for world in (1, 3):
        with pytest.raises(ValueError, match="needs the states of all 2 ranks"):
            _ring(samples, 0, world, 2).load_state_dict(states[0])
    ring = _ring(samples, 1, 2, 2)
    ring.load_state_dict(states[1])
    assert ring.loader.position == states[1]["parent"]["ticket"]


def test_merge_states_checks_one_job(samples):
    """merge_states refuses a missing or repeated rank, mixed jobs and mixed epochs."""
    _, states = _save(lambda r, w: _ring(samples, r, w, 2), 3, [1, 1, 1])
    merged = merge_states(reversed(states))
    jobs = merged["parent"]
    assert [s["rank"] for s in jobs["ranks"]] == [0, 1, 2]
    assert jobs["world_size"] == 3 and jobs["epoch"] == 0
    assert [s["consumed"] for s in jobs["ranks"]] == [s["skip"] for s in states]
    assert {k: v for k, v in merged.items() if k != "parent"} == {
        "echo": 2.0, "placement": "before_augment"}
    assert json.loads(json.dumps(merged)) == merged
    with pytest.raises(ValueError, match=r"missing rank\(s\) \[1\]"):
        merge_states([states[0], states[2]])
    with pytest.raises(ValueError, match=r"\[2\] given twice"):
        merge_states([states[0], states[2], states[2]])

    def other(**kw):
        return dict(states[2], parent=dict(states[2]["parent"], **kw))

    with pytest.raises(ValueError, match="disagree on seed"):
        merge_states([states[0], states[1], other(seed=1)])
    with pytest.raises(ValueError, match="disagree on placement"):
        merge_states([states[0], states[1], dict(states[2], placement="batch")])
    with pytest.raises(ValueError, match="disagree on echo"):
        merge_states([states[0], states[1], dict(states[2], echo=3.0)])
    with pytest.raises(ValueError, match="different epochs"):
        merge_states([states[0], states[1], other(ticket=states[2]["parent"]["ticket"] + 5)])
    with pytest.raises(ValueError, match="no states"):
        merge_states([])
    with pytest.raises(TypeError, match="list"):
        merge_states(states[0])
    with pytest.raises(ValueError, match="placement"):
        _ring(samples, 0, 2, 2, "after_augment").load_state_dict(states)
    with pytest.raises(ValueError, match="seed"):
        en.EchoRing(samples, batch_size=B, image_size=16, echo=2, workers=1, seed=9,
                    rank=0, world_size=2).load_state_dict(merged)
    other = en.Samples([samples.read(i) for i in range(N - 1)], samples.labels[:N - 1])
    with pytest.raises(ValueError, match="44"):
        en.EchoRing(other, batch_size=B, image_size=16, echo=2, workers=1, seed=SEED,
                    rank=0, world_size=2).load_state_dict(states)


def test_list_and_merged_state_resume_alike(samples):
    """The list of states and merge_states of it resume identically."""
    _, states = _save(lambda r, w: _ring(samples, r, w, 2), 2, [1, 2])
    runs = []
    for given in (states, merge_states(states)):
        with _loaded(_ring(samples, 0, 3, 2), given) as ring:
            runs.append(_stream(sh.run_epoch(ring)))
    assert runs[0] == runs[1]


@pytest.mark.filterwarnings("ignore::echo_native.SampleFailureWarning")
@pytest.mark.parametrize("placement", ["before_augment", "batch"])
def test_stand_ins_do_not_count_as_consumed(samples, placement):
    """With broken files replaced by stand-ins, 2 ranks saved mid-epoch and resumed by
    one: every good id gets exactly one fresh emission over the two jobs."""
    n, bad = 40, {3, 11, 19, 27, 35}
    src = en.Samples([b"broken" if i in bad else samples.read(i) for i in range(n)],
                     np.arange(n) % 4)

    def make(rank, world):
        return en.EchoRing(src, batch_size=4, image_size=16, seed=4, workers=1,
                           worker_mode="thread", rank=rank, world_size=world,
                           echo=en.Echo(2, placement=placement, shuffle_buffer=8))

    before, states = _save(make, 2, [3, 4])
    after = [i for _, rest, _ in _resume(make, 1, states) for i in _fresh(rest)]
    assert sorted(before + after) == sorted(set(range(n)) - bad)

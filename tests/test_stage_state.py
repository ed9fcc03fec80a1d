"""An echo stage's state (``echo_native.echo.state``): the loader's nested in it under
``parent``, as Grain's iterators nest theirs, and the states earlier versions saved
flat (every key at the top, ``skip`` beside ``ticket``), which keep loading: one
rank's, all ranks' (a list, or merged), one saved inside an epoch resumed from all
ranks, and an EchoLoader's.

The ``OLD_*`` dicts are literal: what the version before the nesting wrote for the
runs the tests repeat (each test checks that the nested state of the same run holds
the very same values).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import echo_native as en
from echo_native import resume
from echo_native.echo.state import STAGE_KEYS, loader_terms, split_state
from echo_native.plan import Plan

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import sources_helpers as sh

N, B, SEED = 24, 4, 5
PLAN = {"seed": SEED, "total_samples": N, "batch_size": B, "shuffle": True, "pad": True,
        "drop_last": False}
ECHO = {"echo": 2.0, "placement": "before_augment"}

#: One rank of one, after 3 batches.
OLD_SINGLE = {"ticket": 1, "epoch": 0, "batches_per_epoch": 6, **PLAN, "world_size": 1,
              "rank": 0, "skip": [2, 8, 12, 14, 18, 19, 23], **ECHO}
#: Both ranks of two, after 2 batches each; and the merge_states of them.
OLD_RANKS = [
    {"ticket": 0, "epoch": 0, "batches_per_epoch": 3, **PLAN, "world_size": 2, "rank": 0,
     "skip": [0, 7, 10, 14, 15, 16, 18, 21], **ECHO},
    {"ticket": 0, "epoch": 0, "batches_per_epoch": 3, **PLAN, "world_size": 2, "rank": 1,
     "skip": [1, 2, 3, 4, 9, 11, 17, 22], **ECHO}]
OLD_MERGED = {**PLAN, **ECHO, "world_size": 2, "epoch": 0, "ranks": OLD_RANKS}
#: One rank resuming OLD_RANKS, after 1 batch: its history holds their skips.
OLD_RESUMED = {"ticket": 4, "epoch": 0, "batches_per_epoch": 6, **PLAN, "world_size": 1,
               "rank": 0, "resumed": OLD_MERGED, "skip": [5, 8, 13, 20], **ECHO}
#: An EchoLoader (echo=2, seed=7, shuffle_buffer=16) over 6 batches, after 3 batches.
OLD_LOADER = {"ticket": 0, "epoch": 0, "index": 0, "first_id": 0, "wrapped": {"pos": 0},
              "upstream_batches": 6, "upstream_samples": None, "upstream_batch_size": 4,
              "upstream_seed": None, "skip": [1, 2, 3, 4, 7, 8, 9, 11, 14, 15], "echo": 2.0,
              "placement": "after_augment", "seed": 7}


@pytest.fixture(scope="module")
def samples():
    return en.Samples(sh.photo_jpegs(N, 36, 44, seed=21), np.arange(N) % 4)


def _ring(samples, rank=0, world=1):
    return en.EchoRing(samples, batch_size=B, image_size=16, echo=2, workers=1,
                       worker_mode="thread", seed=SEED, rank=rank, world_size=world)


def _flat(state):
    """A nested state's keys all at the top, as the version before the nesting wrote."""
    return {**state["parent"], **{k: v for k, v in state.items() if k != "parent"}}


def _saved(make, stops):
    """Rank r of a len(stops)-rank job runs stops[r] batches: fresh ids, states."""
    fresh, states = [], []
    for rank, stop in enumerate(stops):
        with make(rank, len(stops)) as ring:
            fresh += [int(i) for ids, f, _ in sh.run_epoch(ring, stop) for i in ids[f]]
            states.append(ring.state_dict())
    return fresh, states


def _rest(ring, state):
    """The rest of the epoch after loading ``state``: (ids, fresh) per batch."""
    ring.load_state_dict(state)
    with ring:
        return [(ids.tolist(), f.tolist()) for ids, f, _ in sh.run_epoch(ring)]


def _fresh(batches):
    return [i for ids, f in batches for i, x in zip(ids, f) if x]


# ---- the format ----------------------------------------------------------------------------
def test_a_ring_state_nests_the_loaders_and_resume_knows_no_stage_key(samples):
    """EchoRing's state: the loader's state at the re-read ticket under 'parent', the
    stage's skip, echo and placement beside it; the loader's format (resume) names none
    of the stage's keys."""
    with _ring(samples) as ring:
        sh.run_epoch(ring, 3)
        state = ring.state_dict()
        assert state["parent"] == ring.loader.state_at(state["parent"]["ticket"])
    assert set(state) == {"parent", *STAGE_KEYS}
    loader_keys = set(resume._STATE_KEYS) | resume._RANK_KEYS
    assert not loader_keys & set(STAGE_KEYS) and not loader_keys & {"index", "first_id"}


def test_split_tells_a_nested_state_from_an_old_flat_one():
    """Nested: the parent and the rest.  Old flat: the stage's keys out, the rest the
    loader's, and the loader states inside it (a merge's ranks, a resumed history) in the
    loader's terms: each rank's skip as its consumed, the stage's keys left out."""
    nested = {"parent": {"ticket": 3}, "skip": [1], **ECHO}
    assert split_state(nested) == ({"ticket": 3}, {"skip": [1], **ECHO})
    parent, own = split_state(OLD_RESUMED)
    assert own == {"skip": [5, 8, 13, 20], **ECHO}
    assert {k: v for k, v in parent.items() if k != "resumed"} == {
        k: v for k, v in OLD_RESUMED.items() if k not in {"resumed", "skip", *ECHO}}
    history = parent["resumed"]
    assert set(history) == set(PLAN) | {"world_size", "epoch", "ranks"}
    assert [r["consumed"] for r in history["ranks"]] == [r["skip"] for r in OLD_RANKS]
    assert not any({"skip", *ECHO} & set(r) for r in history["ranks"])
    assert loader_terms(OLD_RANKS[1]) == {**history["ranks"][1]}
    plain = resume.state_at(Plan(N, B, en.CenterCrop(8), seed=SEED), 2)   # a Loader's
    assert split_state(plain) == (plain, {}) and loader_terms(plain) == plain


def test_merge_states_of_nested_and_of_old_flat_states_agree(samples):
    """en.merge_states of the nested states of a job and of the same states saved flat
    are one merged state: the loader's merge of the parents, each rank's skip as its
    consumed, with the stage's echo and placement once; loader states merge as before."""
    _, states = _saved(lambda r, w: _ring(samples, r, w), [2, 2])
    assert [_flat(s) for s in states] == OLD_RANKS
    merged = en.merge_states(states)
    assert en.merge_states(OLD_RANKS) == merged == en.merge_states(states[::-1])
    assert {k: v for k, v in merged.items() if k != "parent"} == ECHO
    assert merged["parent"] == resume.merge_states([loader_terms(s) for s in states])
    assert [r["consumed"] for r in merged["parent"]["ranks"]] == [s["skip"] for s in states]
    plain = [s["parent"] for s in states]
    assert en.merge_states(plain) == resume.merge_states(plain)
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] has no 'echo'"):
        en.merge_states([states[0], {**states[1]["parent"], "skip": []}])
    with pytest.raises(ValueError, match=r"state\['skip'\] must be a list of distinct"):
        en.merge_states([states[0], dict(states[1], skip=[3, 3])])
    with pytest.raises(ValueError, match=r"state\['parent'\] must be the upstream's state"):
        en.merge_states([states[0], dict(states[1], parent=[0])])


def test_a_loader_given_a_stage_state_says_where_its_own_is(samples):
    """A Loader handed an EchoRing's state (nested) is told that the loader's is inside."""
    with _ring(samples) as ring:
        state = ring.state_dict()
    with pytest.raises(ValueError, match="nests its upstream's state under 'parent'"):
        ring.loader.load_state_dict(state)


# ---- old flat states keep loading ----------------------------------------------------------
def test_an_old_flat_ring_state_loads_as_the_nested_one(samples):
    """One rank's state saved flat resumes as the nested state of the same run does: every
    id of the epoch fresh once across the save, the skipped ones not again."""
    with _ring(samples) as ring:
        before = [(ids.tolist(), f.tolist()) for ids, f, _ in sh.run_epoch(ring, 3)]
        state = ring.state_dict()
    assert _flat(state) == OLD_SINGLE
    old = _rest(_ring(samples), OLD_SINGLE)
    assert old == _rest(_ring(samples), state)
    assert sorted(_fresh(before + old)) == list(range(N))


@pytest.mark.parametrize("given", ["list", "merged"])
def test_old_flat_rank_states_resume_another_world_size_as_nested_ones(samples, given):
    """All ranks' states saved flat (a list, or merged by the version before), loaded by a
    job of another size, give each new rank the stream the nested states give it: the
    samples no old rank had emitted fresh, each once, the skipped ones not again."""
    fresh, states = _saved(lambda r, w: _ring(samples, r, w), [2, 2])
    old = OLD_RANKS if given == "list" else OLD_MERGED
    rests = [_rest(_ring(samples, r, 3), old) for r in range(3)]
    assert rests == [_rest(_ring(samples, r, 3), states) for r in range(3)]
    new = [i for rest in rests for i in _fresh(rest)]
    assert set(fresh) | set(new) == set(range(N)) and not set(fresh) & set(new)


def test_an_old_flat_state_inside_a_resumed_epoch_loads(samples):
    """A rank's state saved flat inside an epoch resumed from all ranks (its history holds
    their skips, flat too) continues as the nested state of the same run: the history's
    skipped ids stay out of the rest."""
    _, states = _saved(lambda r, w: _ring(samples, r, w), [2, 2])
    ring = _ring(samples)
    ring.load_state_dict(states)
    with ring:
        sh.run_epoch(ring, 1)
        state = ring.state_dict()
    assert _flat(state)["skip"] == OLD_RESUMED["skip"]
    assert split_state(OLD_RESUMED)[0] == state["parent"]
    rest = _rest(_ring(samples), OLD_RESUMED)
    assert rest == _rest(_ring(samples), state) and len(rest) == 2
    assert not set(_fresh(rest)) & set(OLD_RESUMED["skip"])


class Batches:
    """A resumable loader of 6 batches of 4 ids (as torchdata's StatefulDataLoader)."""

    def __init__(self):
        self.batches = [{"x": np.arange(i * 4, i * 4 + 4)} for i in range(6)]
        self.pos = 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        while self.pos < len(self.batches):
            self.pos += 1
            yield self.batches[self.pos - 1]
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


def test_an_old_flat_echo_loader_state_loads_as_the_nested_one():
    """EchoLoader's state nests the wrapped loader's position (its state, counts and what
    it was) under 'parent'; one saved flat loads as it does: every id fresh once."""
    def make():
        return en.EchoLoader(Batches(), echo=2, seed=7, shuffle_buffer=16, with_info=True)

    el = make()
    it = iter(el)
    before = [next(it) for _ in range(3)]
    state = el.state_dict()
    assert set(state) == {"parent", *STAGE_KEYS, "seed"} and "wrapped" in state["parent"]
    assert _flat(state) == OLD_LOADER
    runs = []
    for given in (OLD_LOADER, state):
        again = make()
        again.load_state_dict(given)
        runs.append([(b["x"].tolist(), info["fresh"].tolist()) for b, info in again])
    assert runs[0] == runs[1]
    seen = [(b["x"].tolist(), info["fresh"].tolist()) for b, info in before]
    assert sorted(_fresh(seen + runs[0])) == list(range(24))
    with pytest.raises(ValueError, match=r"state\['index'\] is 9, past"):
        make().load_state_dict(dict(OLD_LOADER, index=9))

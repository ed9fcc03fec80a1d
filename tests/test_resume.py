"""Resume's state format, its checks, and merging the ranks of a job
(``echo_native.resume``) as units, on states made by :func:`resume.state_at` from plans,
without a ring.

Resuming end to end (a job of any size continuing another, stand-ins not counted as
consumed) is in ``test_elastic.py``; a bad ticket, a set_epoch that is no epoch, and a
state of other shuffle/drop_last/pad settings through EchoRing in
``robustness/test_misuse.py``.
"""
from __future__ import annotations

import numpy as np
import pytest

import echo_native as en
from echo_native import resume
from echo_native.plan import Plan, ResumedPlan
from echo_native.resume import (MAX_TICKET, check_epoch, check_state, check_state_values,
                                merge_states, state_at)

N, B, SEED = 20, 4, 5
CROP = en.CenterCrop(8)


def plan(rank=0, world=1, **kw):
    return Plan(N, B, CROP, seed=SEED, rank=rank, world_size=world, **kw)


def job(tickets, **kw):
    """The states of a job of len(tickets) ranks, rank r at tickets[r]."""
    world = len(tickets)
    return [state_at(plan(r, world, **kw), t) for r, t in enumerate(tickets)]


# ---- one state's values ----------------------------------------------------------------
def test_state_at_says_where_a_loader_stands_under_its_plan():
    """A state is the ticket, its epoch and every plan setting that decides the stream."""
    p = Plan(N, B, CROP, seed=SEED, shuffle=False, drop_last=True, rank=1, world_size=3,
             pad=False)
    assert state_at(p, 7) == {"ticket": 7, "epoch": 7 // p.batches_per_epoch,
                              "batches_per_epoch": p.batches_per_epoch, "seed": SEED,
                              "world_size": 3, "rank": 1, "total_samples": N,
                              "batch_size": B, "shuffle": False, "pad": False,
                              "drop_last": True}
    assert p.batches_per_epoch == 1 and state_at(p, 7)["epoch"] == 7


def test_state_at_carries_the_history_only_inside_the_resumed_epoch():
    """A resumed plan's state holds the merged states it came from while at a ticket of
    the resumed epoch (its end included), and not before or after."""
    base = plan()
    rp = ResumedPlan(**{f: getattr(base, f) for f in ("total_samples", "batch_size",
                                                       "transform", "seed")},
                     resumed_epoch=1, rest=np.arange(6), resumed_batches=2)
    history = {"epoch": 1, "ranks": []}
    bpe = base.batches_per_epoch                  # 5: the resumed epoch is tickets 8, 9
    assert rp.first_ticket == 2 * bpe - 2
    inside = [t for t in range(3 * bpe) if "resumed" in state_at(rp, t, history)]
    assert inside == [2 * bpe - 2, 2 * bpe - 1, 2 * bpe]
    assert state_at(rp, 2 * bpe - 1, history)["resumed"] is history
    assert "resumed" not in state_at(rp, 2 * bpe - 1)


@pytest.mark.parametrize("key, bad", [
    ("ticket", MAX_TICKET + 1),
    ("epoch", -1), ("epoch", 1.0),
    ("batches_per_epoch", 0), ("total_samples", 0), ("batch_size", 2.0),
    ("world_size", 0), ("rank", -1), ("rank", "0"),
    ("seed", 2**64), ("seed", -1),
    ("shuffle", 1), ("pad", "yes"), ("drop_last", None),
    ("consumed", [3, -1]), ("consumed", [1.0]), ("consumed", "12"), ("consumed", {4}),
    ("resumed", []), ("resumed", "merged"),
])
def test_each_key_of_a_state_is_checked_naming_it(key, bad):
    """A value of the wrong type or range under any key is a ValueError naming the key and
    what it must be."""
    state = state_at(plan(), 3)
    state[key] = bad
    with pytest.raises(ValueError, match=rf"^state\['{key}'\] must be "):
        check_state_values(state)


def test_what_a_state_may_hold_is_accepted():
    """The largest ticket, NumPy integers and bools, a consumed list as an array, none, a
    merged history, and keys this module does not know pass."""
    state = state_at(plan(), 3)
    state.update(ticket=MAX_TICKET, epoch=np.int64(2), seed=2**64 - 1, shuffle=np.bool_(True),
                 consumed=np.array([0, 4], np.int64), resumed={"epoch": 0}, placement="batch")
    check_state_values(state)
    check_state_values({"ticket": 0})


def test_a_state_must_be_a_dict_with_a_ticket():
    """Not a dict is a TypeError naming the type; a dict without 'ticket' is not a state."""
    with pytest.raises(TypeError, match=r"a state must be a dict from state_dict\(\), got list"):
        check_state_values([("ticket", 0)])
    with pytest.raises(ValueError, match=r"state has no 'ticket'"):
        check_state_values({"epoch": 0})


def test_check_epoch_bounds_the_epoch_by_the_ring_words():
    """An epoch is an integer from 0 to MAX_TICKET // batches_per_epoch (NumPy's too, made
    an int); one more is refused naming the bound."""
    top = MAX_TICKET // 7
    got = check_epoch(np.int64(top), 7)
    assert got == top and type(got) is int
    with pytest.raises(ValueError, match=rf"^epoch must be between 0 and {top}, got {top + 1}"):
        check_epoch(top + 1, 7)
    with pytest.raises(TypeError, match="epoch must be an integer"):
        check_epoch(np.float64(1), 7)


@pytest.mark.parametrize("key, value", [("seed", 6), ("rank", 1), ("batch_size", 5),
                                        ("total_samples", 21), ("batches_per_epoch", 6)])
def test_a_state_another_plan_would_not_continue_is_refused_naming_the_setting(key, value):
    """A rank's state from a job with another seed, rank, batch size, source size or epoch
    length: a ValueError with the saved and this plan's value."""
    p = plan(0, 2)
    state = state_at(p, 2)
    mine = state[key]
    state[key] = value
    with pytest.raises(ValueError, match=rf"^state was saved with {key}={value}, this loader "
                                         rf"has {key}={mine};"):
        check_state(p, state)


def test_an_older_state_without_the_plan_settings_is_checked_by_what_it_has():
    """A state holding only a ticket (and what it has) continues the plan it is given."""
    check_state(plan(), {"ticket": 3})
    check_state(plan(1, 2), {"ticket": 3, "rank": 1, "world_size": 2})


# ---- merging the ranks of a job -------------------------------------------------------------
def test_merge_orders_the_ranks_and_keeps_the_job_settings_once():
    """The merged state holds each setting the ranks share once, the interrupted epoch,
    and the ranks' own states ordered by rank, their own keys (ticket, consumed) kept
    there and their histories left out."""
    states = job([1, 0, 2])                       # 2 tickets an epoch: rank 2 is done
    states[1]["consumed"] = [7]
    states[2]["resumed"] = None
    merged = merge_states([states[2], states[0], states[1]])
    assert {k: v for k, v in merged.items() if k != "ranks"} == {
        "batch_size": B, "drop_last": False, "pad": True, "seed": SEED, "shuffle": True,
        "total_samples": N, "world_size": 3, "epoch": 0}
    assert [s["rank"] for s in merged["ranks"]] == [0, 1, 2]
    assert [s["ticket"] for s in merged["ranks"]] == [1, 0, 2]
    assert merged["ranks"][1]["consumed"] == [7] and "resumed" not in merged["ranks"][2]


@pytest.mark.parametrize("key, value", [("total_samples", 21), ("batch_size", 5),
                                        ("shuffle", False), ("pad", False),
                                        ("drop_last", True), ("world_size", 4),
                                        ("echo_factor", 3.0)])
def test_states_that_disagree_on_a_job_setting_are_not_one_job(key, value):
    """Every key but the ranks' own (ticket, epoch, rank, consumed, resumed,
    batches_per_epoch) must agree, keys this module does not know included: the message
    names the key and the values."""
    states = job([1, 1])
    for s in states:
        s.setdefault(key, 2.0)          # a later stage's key, where the plan has none
    states[1][key] = value
    with pytest.raises(ValueError, match=rf"^merge_states: the states disagree on {key} \("):
        merge_states(states)


def test_the_ranks_own_keys_may_differ():
    """Ranks stand at different tickets, with different consumed lists and, without padding,
    different epoch lengths: they merge."""
    states = [state_at(Plan(17, B, CROP, seed=SEED, rank=r, world_size=2, pad=False), t)
              for r, t in ((0, 2), (1, 1))]
    states[0]["consumed"] = [1, 2]
    assert [s["batches_per_epoch"] for s in states] == [3, 2]
    merged = merge_states(states)
    assert merged["epoch"] == 0 and [s["ticket"] for s in merged["ranks"]] == [2, 1]
    assert merged["ranks"][0]["consumed"] == [1, 2] and "batches_per_epoch" not in merged


def test_ranks_must_be_the_jobs_own_each_once():
    """Every rank of the world once: a rank beyond the world is named with the ranks got."""
    states = job([1, 1])
    extra = dict(states[1], rank=2)
    with pytest.raises(ValueError, match=r"world_size=2\) once: got ranks \[0, 1, 2\]$"):
        merge_states(states + [extra])


@pytest.mark.parametrize("bad", [{"ticket": 3}, {"ticket": 3, "rank": 0, "world_size": 1},
                                 "state.pt", None])
def test_merge_takes_rank_states_only(bad):
    """An entry that is not one rank's state_dict() (keys missing, a file name) is refused,
    showing it."""
    with pytest.raises(ValueError, match=r"^merge_states takes the state_dict\(\) of each "
                                         r"rank, got "):
        merge_states([bad])


def test_a_merged_state_is_not_merged_again():
    """merge_states of [a merged state] is refused (it is not a rank's state)."""
    merged = merge_states(job([1, 1]))
    with pytest.raises(ValueError, match=r"^merge_states takes the state_dict\(\) of each rank"):
        merge_states([merged])


def test_the_epoch_is_the_earliest_ranks_and_a_rank_done_with_it_may_stand_at_the_next():
    """A rank that finished its share stands at the next epoch's first ticket: the merged
    epoch is the others'; one a ticket further is from another epoch."""
    bpe = plan(0, 2).batches_per_epoch
    assert merge_states(job([2, bpe]))["epoch"] == 0
    assert merge_states(job([bpe + 1, 2 * bpe]))["epoch"] == 1
    with pytest.raises(ValueError, match=rf"different epochs \(rank 0 at ticket 2, rank 1 at "
                                         rf"ticket {bpe + 1}\)"):
        merge_states(job([2, bpe + 1]))


def test_histories_of_the_epoch_must_agree_and_older_ones_are_dropped():
    """The ranks' 'resumed' entries for the merged epoch must be the same and are carried
    once; entries of an earlier epoch are the past, not carried."""
    this = {"epoch": 0, "ranks": [{"ticket": 1}]}
    states = job([1, 2])
    for s in states:
        s["resumed"] = this
    assert merge_states(states)["resumed"] == this
    states[1]["resumed"] = {"epoch": 0, "ranks": [{"ticket": 2}]}
    with pytest.raises(ValueError, match="different resumed jobs"):
        merge_states(states)
    later = job([6, 7])
    for s in later:
        s["resumed"] = this                 # epoch 0's, the job now in epoch 1
    assert "resumed" not in merge_states(later)


# ---- what a merged job left of its epoch -------------------------------------------------
def test_the_rest_of_the_epoch_is_what_no_rank_consumed_split_over_the_new_ranks():
    """A 2-rank job at tickets 2 and 1 (rank 1 also consumed one later sample, listed):
    what is left of the epoch is the global order less those, and 3 new ranks split it
    as their plan's rule (no padding: every left sample once)."""
    old = [plan(r, 2) for r in range(2)]
    states = [state_at(old[0], 2), state_at(old[1], 1)]
    later = int(old[1].epoch_order(0)[2 * B])
    states[1]["consumed"] = [later]
    merged = merge_states(states)
    consumed = set(old[0].epoch_order(0)[:2 * B].tolist()) | \
        set(old[1].epoch_order(0)[:B].tolist()) | {later}
    left = [int(i) for i in old[0].global_order(0) if int(i) not in consumed]
    new = [plan(r, 3, pad=False) for r in range(3)]
    rests = [resume.resumed_plan(p, None, merged) for p in new]
    assert all(isinstance(r, ResumedPlan) and r.resumed_epoch == 0 for r in rests)
    assert [r.rest.tolist() for r in rests] == [left[r::3] for r in range(3)]
    assert [r.resumed_batches for r in rests] == [-(-len(left[r::3]) // B) for r in range(3)]


def test_a_job_that_consumed_nothing_resumes_no_differently():
    """States all at the epoch's first ticket, nothing consumed: no resumed plan (the epoch
    is read whole, as usual)."""
    merged = merge_states(job([0, 0]))
    assert resume.resumed_plan(plan(0, 3), None, merged) is None


def test_a_merged_state_another_plan_cannot_resume_is_refused():
    """No ranks, another seed or another shuffle: refused, naming what differs."""
    merged = merge_states(job([1, 1]))
    with pytest.raises(ValueError, match="a merged state needs 'ranks'"):
        resume.check_merged(plan(), {k: v for k, v in merged.items() if k != "ranks"})
    for key, value in (("seed", SEED + 1), ("shuffle", False)):
        base = Plan(N, B, CROP, seed=SEED if key != "seed" else value,
                    shuffle=key != "shuffle")
        with pytest.raises(ValueError, match=rf"saved with {key}=.*this loader has {key}="):
            resume.check_merged(base, merged)
    bad = dict(merged, ranks=[dict(merged["ranks"][0], ticket=-1)])
    with pytest.raises(ValueError, match=r"state\['ticket'\]"):
        resume.check_merged(plan(), bad)


def test_merge_states_refuses_a_setting_some_ranks_lack():
    """A setting in one rank's state and missing from another's (a key this module does
    not know, such as placement) means the states are not from one job: refused, naming the key."""
    base = {"ticket": 3, "rank": 0, "world_size": 2, "batches_per_epoch": 5, "seed": 0,
            "placement": "before_augment"}
    other = {k: v for k, v in base.items() if k != "placement"}
    other["rank"] = 1
    with pytest.raises(ValueError, match="rank\\(s\\) \\[1\\] has no 'placement'"):
        merge_states([base, other])

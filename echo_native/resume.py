"""Resume: the state format, its checks, and a job of any size resuming another's.

A state is a small dict of plain values (JSON and pickle) that
:meth:`Loader.state_dict` writes: the ``ticket`` of the next fresh batch and the
plan's settings.  Loaded by a rank of a job of the same size, the stream
continues exactly.  The states of *all* ranks (:func:`merge_states`) resume a
job of any size: the samples of the interrupted epoch that no saved rank had
consumed are split over the new ranks (:func:`resumed_plan`), and the epochs
after it are a fresh job's.

A consumer that takes a batch's samples out of order (an echo stage) says in a
rank's state which samples of the batches from its ticket on it had already
consumed (``consumed``), and a merge leaves them out too.  Such a stage saves
the loader's state nested in its own, under ``parent`` (as Grain's iterators
do), and puts it in these terms itself before a merge: this module knows the
loader's keys only.  Keys it does not know are carried, and checked to agree
across ranks.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from echo_native._checks import is_int
from echo_native.plan import Plan, ResumedPlan, share

#: Keys that differ between the ranks of one job; every other key must agree.
_RANK_KEYS = {"ticket", "epoch", "rank", "consumed", "resumed", "batches_per_epoch"}


#: A resume position beyond this is no real job's (and would overflow the ring's words).
MAX_TICKET = 2**62


def is_id_list(v):
    """Whether ``v`` is a list (tuple, 1-D array) of distinct sample ids."""
    return isinstance(v, (list, tuple, np.ndarray)) and \
        all(is_int(x) and 0 <= x <= MAX_TICKET for x in v) and \
        len(set(int(x) for x in v)) == len(v)


#: The type of each key a state may hold, and the test its value must pass.
_STATE_KEYS = {
    "ticket": ("an integer >= 0", lambda v: is_int(v) and 0 <= v <= MAX_TICKET),
    "epoch": ("an integer in [0, 2**62]", lambda v: is_int(v) and 0 <= v <= MAX_TICKET),
    "batches_per_epoch": ("a positive integer", lambda v: is_int(v) and v >= 1),
    "total_samples": ("a positive integer", lambda v: is_int(v) and v >= 1),
    "batch_size": ("a positive integer", lambda v: is_int(v) and v >= 1),
    "world_size": ("a positive integer", lambda v: is_int(v) and v >= 1),
    "rank": ("an integer >= 0", lambda v: is_int(v) and v >= 0),
    "seed": ("an integer in [0, 2**64)", lambda v: is_int(v) and 0 <= v < 2**64),
    "shuffle": ("True or False", lambda v: isinstance(v, (bool, np.bool_))),
    "pad": ("True or False", lambda v: isinstance(v, (bool, np.bool_))),
    "drop_last": ("True or False", lambda v: isinstance(v, (bool, np.bool_))),
    "consumed": ("a list of distinct sample ids", is_id_list),
    "resumed": ("a merged state or None", lambda v: v is None or isinstance(v, dict)),
}


def check_state_values(state, required=("ticket",), owner="a Loader", keys=None,
                       name="state"):
    """Refuse a state whose values are not what :meth:`Loader.state_dict` writes, naming
    the key: a float, string or bool ticket, a negative or absurd one, a wrong type
    anywhere, a key missing (a state edited by hand, or from another program).  Nothing
    is loaded before this passes.  ``keys``: a stage's own keys, checked as the loader's
    are (``{key: (what it must be, test)}``); ``name``: where ``state`` is, for the
    messages (``"state['parent']"`` for a stage's upstream's)."""
    if not isinstance(state, dict):
        raise TypeError(f"a state must be a dict from state_dict(), got "
                        f"{type(state).__name__}")
    for key in required:
        if key not in state:
            # A stage's state holds its upstream's under 'parent': said, as a state given
            # to the wrong object is the likely mistake.
            nested = " (it nests its upstream's state under 'parent': a stage's state " \
                     "loads into that stage)" if "parent" in state else ""
            raise ValueError(f"{name} has no {key!r}: it is not a state_dict() of "
                             f"{owner}{nested}")
    for key, (what, ok) in {**_STATE_KEYS, **(keys or {})}.items():
        if key in state and not ok(state[key]):
            raise ValueError(f"{name}[{key!r}] must be {what}, got {state[key]!r:.80}")


def check_epoch(epoch, batches_per_epoch):
    """``epoch`` as an int, or a clear error (``set_epoch(1.5)`` or ``set_epoch('2')``
    must not read part of an epoch or compare strings)."""
    if not is_int(epoch):
        raise TypeError(f"epoch must be an integer, got {epoch!r}")
    if not 0 <= epoch <= MAX_TICKET // batches_per_epoch:
        raise ValueError(f"epoch must be between 0 and {MAX_TICKET // batches_per_epoch}, "
                         f"got {epoch}")
    return int(epoch)


def check_state(plan, state):
    """Refuse one rank's state that this plan cannot continue exactly (another seed,
    source, batch size, shuffle, padding or world size), naming the setting."""
    check_state_values(state)
    world = state.get("world_size", plan.world_size)
    if world != plan.world_size:
        raise ValueError(f"state was saved by rank {state.get('rank')} of world_size={world}, "
                         f"this loader has world_size={plan.world_size}: resuming in a job "
                         f"of another size needs the states of all {world} ranks (gather "
                         f"them, e.g. with torch.distributed.all_gather_object, and pass the "
                         f"list, or echo_native.merge_states of it, to load_state_dict)")
    for key, mine in (("seed", plan.seed), ("rank", plan.rank),
                      ("batches_per_epoch", plan.batches_per_epoch),
                      ("total_samples", plan.total_samples), ("batch_size", plan.batch_size),
                      ("shuffle", plan.shuffle), ("drop_last", plan.drop_last),
                      ("pad", plan.pad)):
        if key in state and state[key] != mine:
            raise ValueError(f"state was saved with {key}={state[key]}, this loader has "
                             f"{key}={mine}; the fresh stream would not continue exactly "
                             f"(samples would be read twice or never)")


def merge_states(states):
    """The loader states of all ranks of a job, as one state any job can resume from.

    (``echo_native.merge_states`` takes an echo stage's states as well, and puts
    them in these terms before calling this.)  Pass the result (or the list itself) to ``load_state_dict`` of every rank
    of the resuming job, whatever its world size and worker count: the samples
    of the interrupted epoch that no saved rank had consumed are split over the
    new ranks, each sample once (up to :class:`Shard`'s padding), with equal
    steps per rank, and the epochs after it are a fresh job's.

    Parameters
    ----------
    states : sequence of dict
        The ``state_dict()`` of every rank of one job (a :class:`Loader`'s, with
        ``consumed`` where its consumer took samples ahead of the ticket), taken
        at the same step, in any order: gathered
        with ``torch.distributed.all_gather_object``, or one file per rank.

    Returns
    -------
    dict
        Plain values (JSON and pickle): the job's ``seed``, ``world_size`` and
        other plan settings, the interrupted ``epoch``, and ``ranks``, the
        states ordered by rank.

    Raises
    ------
    ValueError
        When the states are not one job saved at one step: a rank missing or
        given twice, different seeds, world sizes or plans, or
        states from different epochs.
    """
    if isinstance(states, dict):
        raise TypeError("merge_states takes the list of every rank's state_dict(), got one "
                        "dict")
    states = list(states)
    if not states:
        raise ValueError("merge_states: no states given")
    for s in states:
        if not isinstance(s, dict) or "ranks" in s or \
                not {"ticket", "rank", "world_size", "batches_per_epoch"} <= set(s):
            raise ValueError(f"merge_states takes the state_dict() of each rank, got {s!r:.200}")
        check_state_values(s)
    merged = shared([{k: v for k, v in s.items() if k not in _RANK_KEYS} for s in states],
                    [s.get("rank") for s in states])
    world = merged["world_size"]
    ranks = sorted(int(s["rank"]) for s in states)
    if ranks != list(range(world)):
        twice = sorted({r for r in ranks if ranks.count(r) > 1})
        missing = sorted(set(range(world)) - set(ranks))
        wrong = [f"missing rank(s) {missing}"] if missing else []
        wrong += [f"rank(s) {twice} given twice"] if twice else []
        raise ValueError(f"merge_states needs the state of every rank of the job "
                         f"(world_size={world}) once: "
                         f"{'; '.join(wrong) or f'got ranks {ranks}'}")
    states = sorted(states, key=lambda s: int(s["rank"]))
    # A rank whose last emission of an epoch is behind it stands at the next epoch's
    # start while the others finish theirs: that rank has consumed its whole shard.
    epoch = min(int(s["ticket"]) // int(s["batches_per_epoch"]) for s in states)
    late = [s for s in states if int(s["ticket"]) > (epoch + 1) * int(s["batches_per_epoch"])]
    if late:
        raise ValueError(f"merge_states: the states are from different epochs (rank "
                         f"{states[0]['rank']} at ticket {states[0]['ticket']}, rank "
                         f"{late[0]['rank']} at ticket {late[0]['ticket']}); save every "
                         f"rank's state at the same step")
    histories = [s.get("resumed") for s in states]
    histories = [h if h is not None and h.get("epoch") == epoch else None for h in histories]
    if any(h != histories[0] for h in histories):
        raise ValueError("merge_states: the states come from different resumed jobs (their "
                         "'resumed' entries differ)")
    merged["epoch"] = epoch
    merged["ranks"] = [{k: v for k, v in s.items() if k != "resumed"} for s in states]
    if histories[0] is not None:
        merged["resumed"] = histories[0]
    return merged


def shared(states, ranks):
    """The keys of ``states`` (one per rank, ``ranks`` their numbers), each once: every
    state must hold each key, with one value.  A ValueError names the key otherwise."""
    merged = {}
    for key in sorted({k for s in states for k in s}):
        missing = [r for s, r in zip(states, ranks) if key not in s]
        if missing:
            raise ValueError(f"merge_states: the state of rank(s) {missing} has no {key!r} "
                             f"where the others have one: they are not from one job")
        values = {repr(s[key]) for s in states}
        if len(values) > 1:
            raise ValueError(f"merge_states: the states disagree on {key} "
                             f"({', '.join(sorted(values))}): they are not from one job")
        merged[key] = states[0][key]
    return merged


def saved_plan(base, state):
    """The plan one saved rank ran, rebuilt from its state and this loader's plan."""
    plan = dataclasses.replace(base, rank=int(state["rank"]),
                               world_size=int(state["world_size"]),
                               **{k: state[k] for k in ("total_samples", "batch_size",
                                                        "shuffle", "pad", "drop_last")
                                  if k in state})
    if plan.total_samples != base.total_samples:
        raise ValueError(f"states were saved over {plan.total_samples} samples, this "
                         f"loader's source has {base.total_samples}")
    if plan.batches_per_epoch != state["batches_per_epoch"]:
        raise ValueError(f"the state of rank {plan.rank} has batches_per_epoch="
                         f"{state['batches_per_epoch']}, its plan rebuilt here has "
                         f"{plan.batches_per_epoch}: the source, batch size or padding "
                         f"changed (older states lack them: resume with the saved ones)")
    return plan


def epoch_left(base, source, merged):
    """``(epoch, left, consumed)`` for the job of ``merged``: the samples of its
    interrupted epoch that none of its ranks had consumed (read and, with echo,
    emitted fresh), in the epoch's order, and whether any of the epoch was
    consumed (by it or by the job it resumed from)."""
    epoch, states = int(merged["epoch"]), merged["ranks"]
    history = merged.get("resumed")
    plans = [saved_plan(base, s) for s in states]
    if history is not None:
        order = epoch_left(base, source, history)[1]
    else:
        order = plans[0].global_order(epoch, source)
    read, done = [], []
    for state, plan in zip(states, plans):
        bpe, B = plan.batches_per_epoch, plan.batch_size
        if history is not None:
            shard, k = share(order, plan)
        else:
            shard, k = plan.epoch_order(epoch, source), bpe
        # Batches before the state's ticket were all consumed; the ids of later
        # ones that were (an echo stage emitted them before the save) are listed.
        taken = min(max(int(state["ticket"]) - (epoch + 1) * bpe + k, 0), k)
        read.append(shard[:k * B])
        done.append(shard[:taken * B])
        done.append(np.asarray(state.get("consumed", ()), np.int64))
    read, done = np.concatenate(read), np.concatenate(done)
    left = order[np.isin(order, read) & ~np.isin(order, done)]
    return epoch, left, len(done) > 0 or history is not None


def resumed_plan(base, source, merged):
    """This rank's :class:`ResumedPlan` for what the job of ``merged`` left of its
    epoch, or None when that job had consumed nothing of it (then the epoch is read
    whole, as usual)."""
    epoch, left, consumed = epoch_left(base, source, merged)
    if not consumed:
        return None
    rest, k = share(left, base)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Plan)}
    return ResumedPlan(**fields, resumed_epoch=epoch, rest=rest, resumed_batches=k)


def check_merged(base, merged):
    """Refuse a merged state that ``base`` cannot resume (another seed or shuffle), and
    check every rank's values."""
    ranks = merged.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        raise ValueError("a merged state needs 'ranks', the list of every rank's state "
                         "(see echo_native.merge_states)")
    for s in ranks:
        check_state_values(s)
    for key in ("seed", "shuffle"):
        if merged.get(key, getattr(base, key)) != getattr(base, key):
            raise ValueError(f"states were saved with {key}={merged[key]}, this loader "
                             f"has {key}={getattr(base, key)}; the epoch's order would "
                             f"not be the same")


def state_at(plan, ticket, history=None):
    """The state of a loader at ``ticket`` under ``plan`` (``history``: the merged
    states an elastically resumed epoch came from, while in that epoch)."""
    bpe = plan.batches_per_epoch
    state = {"ticket": int(ticket), "epoch": int(ticket) // bpe, "batches_per_epoch": bpe,
             "seed": plan.seed, "world_size": plan.world_size, "rank": plan.rank,
             "total_samples": plan.total_samples, "batch_size": plan.batch_size,
             "shuffle": plan.shuffle, "pad": plan.pad, "drop_last": plan.drop_last}
    if history is not None and plan.covers(ticket):
        state["resumed"] = history
    return state

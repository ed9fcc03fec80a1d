"""An echo stage's state: its upstream's nested under ``parent``, its own keys beside it.

As Grain's iterators do, a stage saves its upstream's state inside its own::

    {"parent": <the upstream's state at the ticket a resume re-reads from>,
     "skip": [ids of the parent's batches from that ticket on, already emitted fresh],
     "echo": e, "placement": p}

(an :class:`~echo_native.EchoLoader`'s also holds its ``seed``; its parent is the
wrapped loader's position, :mod:`echo_native.echo.iterable`).  Restored, the stage
re-reads from the parent's ticket and emits the ``skip`` ids no more
(:mod:`echo_native.echo.ledger`).

The loader's state format (:mod:`echo_native.resume`) knows none of these keys.  An
elastic resume merges loader states, so the stage puts each rank's state in the
loader's terms first (:func:`loader_terms`: the parent, with the stage's ``skip`` as
the loader's ``consumed``, the samples taken ahead of the ticket), and checks its own
keys itself.  A state saved before the nesting had every key flat at the top (``skip``
beside ``ticket``): :func:`split_state` tells the two apart, so old checkpoints, single
or merged, keep loading.
"""
from __future__ import annotations

import numpy as np

from echo_native.resume import check_state_values, is_id_list, shared
from echo_native.resume import merge_states as merge_loader_states


def _is_factor(v):
    return v == "auto" if isinstance(v, str) else \
        isinstance(v, (int, float, np.integer, np.floating)) and \
        not isinstance(v, (bool, np.bool_)) and v >= 1


#: A stage's own keys, and the test each value must pass.
STAGE_KEYS = {
    "skip": ("a list of distinct sample ids", is_id_list),
    "echo": ("a number >= 1 or 'auto'", _is_factor),
    "placement": ("a placement name", lambda v: isinstance(v, str)),
}


def nest(parent, skip, **own):
    """A stage's state: its upstream's ``parent`` state, the ids emitted fresh from the
    parent's ticket on (``skip``), and the facade's own settings."""
    return {"parent": parent, "skip": [int(i) for i in skip], **own}


def split_state(state, own=tuple(STAGE_KEYS)):
    """``(parent, own)`` of a stage's state: its upstream's state and the stage's keys.

    A flat state (saved before the nesting, or a loader's own) is split by key names:
    ``own`` are the stage's, the rest is the parent's.  Its nested loader states (a
    merged state's ``ranks``, a resumed epoch's history) come out in the loader's
    terms, each rank's ``skip`` as its ``consumed``."""
    if "parent" in state:
        return state["parent"], {k: v for k, v in state.items() if k != "parent"}
    return _loader_part(state, own), {k: state[k] for k in own if k in state}


def _loader_part(flat, own, rank=False):
    out = {k: v for k, v in flat.items() if k not in own}
    if rank and "skip" in flat:
        out["consumed"] = flat["skip"]
    if isinstance(out.get("resumed"), dict):
        out["resumed"] = _loader_part(out["resumed"], own)
    if isinstance(out.get("ranks"), list):
        out["ranks"] = [_loader_part(r, own, rank=True) if isinstance(r, dict) else r
                        for r in out["ranks"]]
    return out


def checked_split(state, owner, own=tuple(STAGE_KEYS), required=(),
                  parent_required=("ticket",), parent_keys=None, merged=True):
    """:func:`split_state`, after refusing what no ``state_dict()`` writes, naming the key:
    the stage's own keys (``required`` of them), and the parent's as far as the stage
    knows them (``parent_keys`` beside the loader's, which a loader checks again).  A
    merged parent (with ``ranks``, where ``merged``) is the loader's to check."""
    if not isinstance(state, dict):
        raise TypeError(f"a state must be a dict from state_dict(), got "
                        f"{type(state).__name__}")
    if "parent" in state and not isinstance(state["parent"], dict):
        raise ValueError(f"state['parent'] must be the upstream's state (a dict), got "
                         f"{state['parent']!r:.80}")
    parent, mine = split_state(state, own)
    check_state_values(mine, required, owner, STAGE_KEYS)
    check_state_values(parent, () if merged and "ranks" in parent else parent_required, owner,
                       parent_keys, "state['parent']" if "parent" in state else "state")
    return parent, mine


def loader_terms(state):
    """One rank's stage state as the loader's merge reads it: the parent, with the ids
    the stage had emitted from the parent's ticket on as the samples it ``consumed``."""
    parent, own = checked_split(state, "an EchoRing")
    return {**parent, "consumed": list(own["skip"])} if "skip" in own else parent


def merge_states(states):
    """The states of all ranks of a job, as one state any job can resume from.

    Pass the result (or the list itself) to ``load_state_dict`` of every rank
    of the resuming job, whatever its world size and worker count: the samples
    of the interrupted epoch that no saved rank had consumed (with echo: emitted
    fresh) are split over the new ranks, each sample once (up to
    :class:`~echo_native.Shard`'s padding), with equal steps per rank, and the
    epochs after it are a fresh job's.

    Parameters
    ----------
    states : sequence of dict
        The ``state_dict()`` of every rank of one job (a :class:`~echo_native.Loader`'s
        or an :class:`~echo_native.EchoRing`'s, old flat ones too), taken at the same
        step, in any order: gathered with ``torch.distributed.all_gather_object``,
        or one file per rank.

    Returns
    -------
    dict
        Plain values (JSON and pickle).  Loader states merge into the job's
        ``seed``, ``world_size`` and other plan settings, the interrupted
        ``epoch``, and ``ranks``, the states ordered by rank
        (:func:`echo_native.resume.merge_states`).  Echo stage states merge into
        ``{"parent": <that, each rank's skip as its consumed>, "echo": e,
        "placement": p}``.

    Raises
    ------
    ValueError
        When the states are not one job saved at one step: a rank missing or
        given twice, different seeds, world sizes, plans, echo factors or
        placements, or states from different epochs.
    """
    if isinstance(states, dict):
        return merge_loader_states(states)   # refused, saying a list is wanted
    states = list(states)
    if not any(isinstance(s, dict) and ("parent" in s or set(STAGE_KEYS) & set(s))
               for s in states):
        return merge_loader_states(states)
    for s in states:
        if not isinstance(s, dict):
            raise ValueError(f"merge_states takes the state_dict() of each rank, got "
                             f"{s!r:.200}")
    parents = [loader_terms(s) for s in states]
    merged = merge_loader_states(parents)
    # The stage's own keys (skip went into the parents) are the job's: they must agree.
    owns = [split_state(s)[1] for s in states]
    own = shared([{k: v for k, v in o.items() if k != "skip"} for o in owns],
                 [p.get("rank") for p in parents])
    return {"parent": merged, **own}

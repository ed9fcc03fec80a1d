"""The echo spec: how many times, and where, each fresh example is repeated.

Data echoing (Choi, Passos, Shallue, Dahl, arXiv 1907.05550) emits each fresh
example e times when the upstream cannot keep up with the accelerator.  The
paper's placements: before augmentation (every repeat re-augmented: the best
variant on every image workload), after augmentation, and whole batches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from echo_native._checks import either, flag, is_number, number, optional_positive_int

PLACEMENTS = ("before_augment", "after_augment", "batch")


@dataclass(frozen=True)
class Echo:
    """How examples are repeated (the paper's echo factor and placement).

    Parameters
    ----------
    factor : float >= 1 or "auto", default 2.0
        Emissions per fresh example: floor(e), plus one more with probability
        frac(e).  1 means no echo (an exact pass-through of the ring).  "auto"
        picks e from measured stalls, between 1 and ``max_echo``.
    placement : {"before_augment", "after_augment", "batch"}, default "before_augment"
        Where repeats are made.  "before_augment" keeps a decoded canvas per
        example and gives every repeat its own crop and flip (the paper's best
        variant); "after_augment" repeats the augmented image; "batch" repeats
        whole batches (the weakest variant, for comparison).
    shuffle_buffer : int, optional
        Examples held by the echo stage (default 4 x batch_size, at least 2 x
        batch_size).  Memory: shuffle_buffer x bytes per example.
    max_echo : float, default 4.0
        Upper bound of e for ``factor="auto"``.
    canvas_side : int, optional
        before_augment: the canvas's shorter side is at least this (default: the
        larger side of the output).
    canvas_max_pixels : int, optional
        before_augment: canvases are shrunk to at most this many pixels (default
        2 x canvas_side^2), which fixes the memory per example.
    flip : bool, default False
        after_augment: each repeat draws its own horizontal flip.
    threads : int, optional
        Threads that make the emissions on the CPU (re-augmentation, gathers),
        sharing each batch's rows; default: one per core the process may use
        (``os.sched_getaffinity``).  The pixels are the same for any count.
    """

    factor: float = 2.0
    placement: str = "before_augment"
    shuffle_buffer: int = None
    max_echo: float = 4.0
    canvas_side: int = None
    canvas_max_pixels: int = None
    flip: bool = False
    threads: int = None

    def __post_init__(self):
        f = self.factor
        if isinstance(f, str):
            if f != "auto":
                raise ValueError(f"Echo: factor must be a number >= 1 or 'auto', got {f!r}")
        elif not is_number(f) or not 1 <= f < math.inf:
            raise ValueError(f"Echo: factor must be a number >= 1 (1 means no echo) or 'auto', "
                             f"got {f!r}")
        else:
            object.__setattr__(self, "factor", float(f))
        if self.placement not in PLACEMENTS:
            raise ValueError(f"Echo: placement must be one of {PLACEMENTS}, got "
                             f"{self.placement!r}")
        object.__setattr__(self, "max_echo",
                           number("Echo", "max_echo", self.max_echo, 1.0, math.inf, True))
        for name in ("shuffle_buffer", "canvas_side", "canvas_max_pixels", "threads"):
            object.__setattr__(self, name, optional_positive_int("Echo", name,
                                                                 getattr(self, name)))
        object.__setattr__(self, "flip", flag("Echo", "flip", self.flip))
        if self.flip and self.placement != "after_augment":
            raise ValueError("Echo: flip=True re-draws the flip of repeated augmented images; "
                             "it applies to placement='after_augment' only")

    @property
    def auto(self):
        return self.factor == "auto"

    @property
    def off(self):
        """True for a fixed e of 1: the ring passes straight through."""
        return self.factor == 1.0


#: EchoRing's flat shorthands of the original contract, by the Echo field they set.
SHORTHANDS = {"placement": "placement", "shuffle_buffer": "shuffle_buffer",
              "max_echo": "max_echo", "canvas_side": "canvas_side",
              "canvas_max_pixels": "canvas_max_pixels", "echo_flip": "flip"}


def fold_echo(owner, echo, given=None):
    """``echo=`` as an :class:`Echo`, with the flat shorthands ``given`` (taken out of a
    constructor's keywords by their :data:`SHORTHANDS` names) folded in."""
    given = given or {}
    if isinstance(echo, Echo):
        either(owner, "echo=Echo(...)", echo, given)
        return echo
    if not (isinstance(echo, str) or is_number(echo)):
        raise ValueError(f"echo must be an echo_native.Echo, a number >= 1 or 'auto', got "
                         f"{echo!r}")
    try:
        return Echo(echo, **given)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace("Echo: factor", "echo")) from None

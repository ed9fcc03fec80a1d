"""The seam between an echo stage and whatever makes fresh batches.

An echo stage (:mod:`echo_native.echo.stages`) reads fresh batches through this
protocol and nothing else: the ring's consumer end (:class:`echo_native.Loader`)
implements it, and so does a wrapper around any iterator of batches
(:class:`echo_native.EchoLoader`).  Positions are *tickets*: the number of the
fresh batch counted from epoch 0, so ``ticket // batches_per_epoch`` is its
epoch.
"""
from __future__ import annotations

from typing import Optional, Protocol

import numpy as np

from echo_native.batch import Fresh


class EpochEnd(Exception):
    """Raised by :meth:`Upstream.next_fresh` when the epoch has no fresh batch left, by an
    upstream that cannot tell in advance (``batches_per_epoch`` None): a wrapped iterator
    that was exhausted.  The next ``next_fresh`` starts the next epoch."""


class Upstream(Protocol):
    """What an echo stage needs from the stage before it."""

    #: Fresh batches per epoch (the epoch's last one may be short), or None when the
    #: upstream cannot tell: the epoch then ends where :meth:`next_fresh` raises
    #: :class:`EpochEnd`.
    batches_per_epoch: Optional[int]
    #: Processes (or threads) making fresh batches in parallel: the upstream's time per
    #: batch, for auto echo, is each batch's ``fill_s`` divided by it.
    workers: int

    @property
    def position(self) -> int:
        """The ticket of the next fresh batch."""

    @property
    def epoch(self) -> int:
        """The epoch of the next fresh batch."""

    @property
    def left_in_epoch(self) -> Optional[int]:
        """Fresh batches still to come in the current epoch (None: unknown)."""

    def next_fresh(self) -> Fresh:
        """The next fresh batch, waiting for it (with the upstream's own timeout).

        The batch is *held* until :meth:`hand_off` (or the next ``next_fresh``)."""

    def ready(self) -> bool:
        """True when :meth:`next_fresh` would not wait."""

    def held(self) -> Optional[Fresh]:
        """The batch taken last and still held, or None: a stage interrupted between
        taking a batch and using it (a Ctrl-C the training loop caught) picks it up
        here on its next iteration instead of losing it."""

    def hand_off(self):
        """Stop holding the batch taken last, and return a function that gives its
        memory back: for a stage that copies out of it asynchronously (to a GPU)
        and calls the function once the copies are done."""

    #: Samples this upstream reads per epoch.
    samples_per_epoch: int
    #: True when the data is split over several ranks: per-example echo counts are then
    #: drawn per position in the rank's share, so that every rank emits the same total
    #: and takes the same number of steps under a fractional e.
    sharded: bool

    def id_space(self) -> int:
        """Sample ids are in [0, id_space), as far as known now (per-example echo counts
        are drawn over it, and further as larger ids come)."""

    def epoch_ids(self, epoch) -> np.ndarray:
        """The ids this upstream reads in ``epoch``, in its order."""

    def state_at(self, ticket) -> dict:
        """The upstream's state for a resume at ``ticket`` (plain values)."""

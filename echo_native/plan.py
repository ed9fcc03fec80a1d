"""Which samples each batch holds: the sampling plan, shared by every process.

A *ticket* is a batch number in an endless stream of epochs.  What a ticket
holds is a pure function of the ticket and the :class:`Plan` (seed, epoch
permutation, batch size, this rank's share), so any worker can fill any
ticket, and a ticket whose worker died is simply filled again with identical
bytes.  :class:`Shard` says which part of the data a rank reads, as torch's
``DistributedSampler``; :class:`ResumedPlan` is a plan whose interrupted epoch
reads only what a saved job left of it (:mod:`echo_native.resume`).
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import numpy as np

from echo_native import _kernel
from echo_native.decode import DecodeLimits
from echo_native.protocol import hook

#: What a sample that cannot be read or decoded becomes (see :class:`echo_native.Loader`).
ON_ERROR = ("replace", "skip", "raise")


@dataclass(frozen=True)
class Shard:
    """Which part of the data this process reads, as torch's ``DistributedSampler``.

    Parameters
    ----------
    rank, world_size : int, optional
        This process's index and the number of processes.  Default: torchrun's
        ``RANK`` and ``WORLD_SIZE`` environment variables, else a single process.
    pad : bool, optional
        True: every rank reads the same number of samples, the last ones wrapping
        around to the start of the epoch's order (``DistributedSampler``'s
        padding: a few samples are read twice per epoch, and every rank takes the
        same number of steps).  False: each sample exactly once across ranks;
        ranks then differ by at most one sample, so by at most one batch.
        Default: pad when shuffling (training), not otherwise (evaluation).
    """

    rank: int = None
    world_size: int = None
    pad: bool = None

    def __post_init__(self):
        for name in ("rank", "world_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, np.integer)) or isinstance(v, bool)):
                raise TypeError(f"Shard: {name} must be an integer, got {v!r}")
        if self.pad is not None and not isinstance(self.pad, bool):
            raise TypeError(f"Shard: pad must be True, False or None, got {self.pad!r}")
        if self.world_size is not None or self.rank is not None:
            distributed_rank(self.rank, self.world_size)  # range checks, naming the values

    def resolve(self, shuffle):
        """``(rank, world_size, pad)`` with the defaults filled in."""
        rank, world_size = distributed_rank(self.rank, self.world_size)
        return rank, world_size, bool(shuffle) if self.pad is None else self.pad


def distributed_rank(rank=None, world_size=None):
    """(rank, world_size): given explicitly, else from torchrun's RANK/WORLD_SIZE, else (0, 1)."""
    try:
        if world_size is None:
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if rank is None:
            rank = int(os.environ.get("RANK", "0")) if world_size > 1 else 0
        rank, world_size = int(rank), int(world_size)
    except ValueError:
        raise ValueError(f"RANK/WORLD_SIZE must be integers, got RANK="
                         f"{os.environ.get('RANK')!r}, WORLD_SIZE="
                         f"{os.environ.get('WORLD_SIZE')!r}") from None
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, "
                         f"world_size={world_size}")
    return rank, world_size


@dataclass(frozen=True)
class Plan:
    """Everything a worker needs to fill any ticket, identically in every process.

    Sharding follows torch's ``DistributedSampler``: every rank draws the same
    global order for (seed, epoch) and takes every ``world_size``-th sample from
    position ``rank``.  With ``pad`` the order is first padded by wrapping
    around to a multiple of ``world_size`` (or, with ``drop_last``, truncated),
    so all ranks yield the same number of batches; without it each sample goes
    to exactly one rank and the ranks differ by at most one sample.
    """

    total_samples: int
    batch_size: int
    transform: object
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False
    on_error: str = "replace"
    decode: DecodeLimits = DecodeLimits()
    rank: int = 0
    world_size: int = 1
    pad: bool = True

    @property
    def num_samples(self):
        """Samples this rank reads per epoch."""
        n, world = self.total_samples, self.world_size
        if world == 1:
            return n
        if self.drop_last:
            return n // world
        if self.pad:
            return math.ceil(n / world)
        return len(range(self.rank, n, world))

    @property
    def batches_per_epoch(self):
        if self.drop_last:
            return self.num_samples // self.batch_size
        return math.ceil(self.num_samples / self.batch_size)

    def ticket_size(self, ticket):
        """Samples ticket ``ticket`` asks for (the batch size, less in an epoch's last batch)."""
        b = ticket % self.batches_per_epoch
        return min(self.batch_size, self.num_samples - b * self.batch_size)

    def global_order(self, epoch, source=None):
        """The epoch's order over all samples: a pure function of (seed, epoch)."""
        if not self.shuffle:
            return np.arange(self.total_samples, dtype=np.int64)
        own = hook(source, "epoch_order") if source is not None else None
        if own is not None:
            return np.asarray(own(self.seed, epoch), dtype=np.int64)
        # The key as uint64 explicitly: numpy reads [2**63, tag] as float64, which made
        # the seeds past 2**63 share orders; below 2**63 the bits are the same as ever.
        key = np.array([int(self.seed), 0x6F72646572], np.uint64)
        gen = np.random.Generator(np.random.Philox(key=key, counter=[epoch, 0, 0, 0]))
        return gen.permutation(self.total_samples).astype(np.int64)

    def epoch_order(self, epoch, source=None):
        """This rank's share of the epoch's order."""
        order = self.global_order(epoch, source)
        if self.world_size == 1:
            return order
        if not self.pad and not self.drop_last:
            return order[self.rank::self.world_size]
        need = self.num_samples * self.world_size
        if need > len(order):
            order = np.resize(order, need)  # wraps around, as DistributedSampler pads
        return order[:need][self.rank::self.world_size]

    def replacement(self, epoch, sample_id, attempt):
        """A deterministic stand-in for a sample that failed."""
        words = _kernel.philox4x64((sample_id, epoch, attempt, 0), (self.seed, 0x7265706C))
        return int(words[0] % self.total_samples)


@dataclass(frozen=True, eq=False)
class ResumedPlan(Plan):
    """A :class:`Plan` whose epoch ``resumed_epoch`` reads only ``rest``, this rank's
    share of what an interrupted job left of it, in ``resumed_batches`` batches.

    Tickets keep counting whole epochs (``ticket // batches_per_epoch`` is the
    epoch), so those batches are the epoch's last tickets.  ``epoch_order`` is
    what the epoch reads; the workers' view (:meth:`for_workers`) lays it out
    at the positions of those tickets, as they slice it by batch.
    """

    resumed_epoch: int = 0
    rest: np.ndarray = dataclasses.field(default=None, repr=False)
    resumed_batches: int = 0
    aligned: bool = False

    @property
    def first_ticket(self):
        """The ticket of the resumed epoch's first batch."""
        return (self.resumed_epoch + 1) * self.batches_per_epoch - self.resumed_batches

    def covers(self, ticket):
        """Whether ``ticket`` is a position this plan resumed (up to the epoch's end)."""
        return self.first_ticket <= ticket <= (self.resumed_epoch + 1) * self.batches_per_epoch

    def for_workers(self):
        return dataclasses.replace(self, aligned=True)

    def epoch_order(self, epoch, source=None):
        if epoch != self.resumed_epoch:
            return super().epoch_order(epoch, source)
        if not self.aligned:
            return self.rest
        # Never read: the tickets before first_ticket are not handed out.
        head = np.zeros((self.batches_per_epoch - self.resumed_batches) * self.batch_size,
                        np.int64)
        return np.concatenate([head, self.rest])

    def ticket_size(self, ticket):
        if ticket // self.batches_per_epoch != self.resumed_epoch:
            return super().ticket_size(ticket)
        b = ticket - self.first_ticket
        return max(0, min(self.batch_size, len(self.rest) - b * self.batch_size))


def share(order, plan):
    """This rank's part of ``order`` and its batch count, under the rule of ``plan``
    (its rank, world size, padding, truncation and batch size)."""
    over = dataclasses.replace(plan, total_samples=len(order), shuffle=False)
    return np.asarray(order, np.int64)[over.epoch_order(0)], over.batches_per_epoch

"""How many times each example is emitted, and the generators that order emissions.

Every draw is a pure function of (seed, epoch, ...), from counter-based Philox
streams with a tag of their own, so emissions never depend on workers or timing.
Non-integer e: floor(e) emissions, plus one more with probability frac(e).
"""
from __future__ import annotations

import math

import numpy as np

_TAG_COUNTS = 0x6563686F  # "echo"
_TAG_SHUFFLE = 0x73687566  # "shuf"
_TAG_BATCH = 0x62617463  # "batc"


def _generator(seed, tag, epoch, extra=0):
    # The key as uint64: a plain list of a seed >= 2**63 would go through float64 (so
    # 2**63 and 2**63 + 1 drew alike); below 2**63 the key, and so the draws, are the same.
    key = np.array([int(seed), tag], np.uint64)
    return np.random.Generator(np.random.Philox(key=key, counter=[epoch, extra, 0, 0]))


def echo_draws(seed, epoch, num):
    """One uniform draw per example (or batch) of an epoch, from which its count follows.

    Fixed and auto echo share these draws: auto echo holding a constant e emits
    exactly what the fixed e would, and its counts never consume the shuffle
    generator, so its emission order differs from fixed e's only where e does.
    """
    return _generator(seed, _TAG_COUNTS, epoch).random(num)


def echo_draws_at(seed, epoch, start, num):
    """``echo_draws(seed, epoch, start + num)[start:]``, without drawing the first
    ``start``: Philox makes its outputs four to a counter block, so the generator skips
    ``start // 4`` blocks and the rest of the way."""
    g = _generator(seed, _TAG_COUNTS, epoch)
    g.bit_generator.advance(start // 4)
    return g.random(num + start % 4)[start % 4:]


def counts_from(draws, echo):
    """floor(echo) emissions each, plus one where the draw falls below frac(echo)."""
    base = int(math.floor(echo))
    return base + (np.asarray(draws) < echo - base).astype(np.int32)


def echo_counts(seed, epoch, num, echo):
    """Emissions per example for ``num`` examples (or batches) of one epoch.

    floor(echo) each, plus one with probability frac(echo); exact for integer e.
    """
    return counts_from(echo_draws(seed, epoch, num), echo)


def shuffle_rng(seed, epoch):
    """The generator that orders emissions within an epoch."""
    return _generator(seed, _TAG_SHUFFLE, epoch)


def batch_rng(seed, epoch, index):
    """The generator of the batch ops (MixUp/CutMix) of the ``index``-th batch of an epoch."""
    return _generator(seed, _TAG_BATCH, epoch, index)


class EpochDraws:
    """The :func:`echo_draws` of one epoch, per sample id, drawn as far as the ids reach
    (the draws of the first n ids do not depend on how many more are drawn).

    When the data is sharded they are drawn per position in the rank's share
    (``order``, the ids this rank reads in the epoch), so that every rank emits the
    same total and takes the same number of steps under a fractional e."""

    #: Ids past the epoch's known size are drawn in windows of at least this many: an
    #: endless stream's ids grow without bound, and its draws must not be kept from 0.
    WINDOW = 1 << 16

    def __init__(self, seed, epoch, size, order=None):
        self.seed, self.epoch = seed, epoch
        self._d = echo_draws(seed, epoch, size)
        self._lo = 0   # the id of self._d[0]
        self._sharded = order is not None
        if self._sharded:
            self._d[order] = echo_draws(seed, epoch, len(order))

    def __getitem__(self, ids):
        ids = np.asarray(ids, np.int64)
        if len(ids) and (ids.max() >= self._lo + len(self._d) or ids.min() < self._lo):
            if self._sharded:
                raise IndexError(f"sample id {ids.max()} is outside the {len(self._d)} ids of "
                                 f"the sharded data")
            lo, hi = int(ids.min()), int(ids.max()) + 1
            self._lo = lo
            self._d = echo_draws_at(self.seed, self.epoch, lo, max(2 * (hi - lo), self.WINDOW))
        return self._d[ids - self._lo]


def example_batches(total, most, n, B, drop_last):
    """Batches of example echo in an epoch of ``n`` examples emitted ``total`` times, at most
    ``most`` times each, ``B`` distinct ones per batch: full batches and a short last one,
    unless the epoch has too few examples for that (fewer than a batch, or one example's
    repeats outnumbering the batches): then its repeats get batches of their own.

    Exact when the buffer holds the whole epoch or (ceil(e) + 1) x B examples; a smaller
    buffer (2 or 3 x B) with a short last fresh batch may end an epoch with an extra short
    batch, when its last fresh examples' repeats outnumber the batches left to carry them."""
    if drop_last:
        return 0 if n < B else total // B
    return max(math.ceil(total / B), most)

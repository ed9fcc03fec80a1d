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

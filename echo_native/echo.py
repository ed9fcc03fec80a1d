"""Stage 5 of the pipeline: data echoing (Choi et al., arXiv 1907.05550).

When reading + decoding cannot keep up with the accelerator, each fresh
example is emitted e times instead of once.  This module holds the parts that
decide *what* is emitted; :mod:`echo_native.backends` decide *how* the pixels
are produced (NumPy + native kernel on CPU, CuPy on GPU).

- :func:`echo_counts`: floor(e) emissions per example plus one more with
  probability frac(e), a pure function of (seed, epoch, sample id).
- :class:`ExampleBuffer`: the shuffle buffer *after* the echo stage.  Each
  fresh example is stored once with the number of emissions it has left; a
  batch picks distinct examples at random, so repeats of one example never
  share a batch while the buffer holds at least a batch of distinct examples,
  and land a random distance apart.
- :class:`BatchWindow`: batch echoing, whole batches repeated in a shuffled
  window (the paper's weakest variant, kept for comparison).
- :class:`AutoEcho`: picks e from measured stalls, capped by ``max_echo``.
"""
from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass

import numpy as np

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
    """

    factor: float = 2.0
    placement: str = "before_augment"
    shuffle_buffer: int = None
    max_echo: float = 4.0
    canvas_side: int = None
    canvas_max_pixels: int = None
    flip: bool = False

    def __post_init__(self):
        f = self.factor
        if isinstance(f, str):
            if f != "auto":
                raise ValueError(f"Echo: factor must be a number >= 1 or 'auto', got {f!r}")
        elif (not isinstance(f, (int, float, np.integer, np.floating)) or isinstance(f, bool)
              or not 1 <= f < math.inf):
            raise ValueError(f"Echo: factor must be a number >= 1 (1 means no echo) or 'auto', "
                             f"got {f!r}")
        else:
            object.__setattr__(self, "factor", float(f))
        if self.placement not in PLACEMENTS:
            raise ValueError(f"Echo: placement must be one of {PLACEMENTS}, got "
                             f"{self.placement!r}")
        m = self.max_echo
        if (not isinstance(m, (int, float, np.integer, np.floating)) or isinstance(m, bool)
                or not 1 <= m < math.inf):
            raise ValueError(f"Echo: max_echo must be a number >= 1, got {m!r}")
        object.__setattr__(self, "max_echo", float(m))
        for name in ("shuffle_buffer", "canvas_side", "canvas_max_pixels"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, np.integer)) or isinstance(v, bool)
                                  or v <= 0):
                raise ValueError(f"Echo: {name} must be a positive integer, got {v!r}")
        if not isinstance(self.flip, (bool, np.bool_)):
            raise TypeError(f"Echo: flip must be True or False, got {self.flip!r}")
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


_TAG_COUNTS = 0x6563686F  # "echo"
_TAG_SHUFFLE = 0x73687566  # "shuf"
_TAG_BATCH = 0x62617463  # "batc"


def _generator(seed, tag, epoch, extra=0):
    return np.random.Generator(np.random.Philox(key=[seed, tag], counter=[epoch, extra, 0, 0]))


def echo_draws(seed, epoch, num):
    """One uniform draw per example (or batch) of an epoch, from which its count follows.

    Fixed and auto echo share these draws: auto echo holding a constant e emits
    exactly what the fixed e would, and its counts never consume the shuffle
    generator, so its emission order differs from fixed e's only where e does.
    """
    return _generator(seed, _TAG_COUNTS, epoch).random(num)


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


class ExampleBuffer:
    """Fixed-capacity store of prepared examples with their remaining emissions.

    Pixels live in ``pixels``, one row of ``entry_bytes`` per entry, allocated
    by ``xp.empty`` (an array module, or a device backend, which allocates on
    its own GPU and stream); bookkeeping stays in host NumPy arrays because it
    is tiny and drives Python control flow.
    """

    def __init__(self, capacity, entry_bytes, xp=np):
        self.capacity = int(capacity)
        self.pixels = xp.empty((self.capacity, int(entry_bytes)), np.uint8)
        c = self.capacity
        self.sample_id = np.zeros(c, np.int64)
        self.label = np.zeros(c, np.int64)
        self.ok = np.zeros(c, bool)              # the stored sample is the one asked for
        self.remaining = np.zeros(c, np.int32)   # emissions left
        self.next_echo = np.zeros(c, np.int32)   # echo index of the next emission
        self.epoch = np.zeros(c, np.int64)
        self.ticket = np.zeros(c, np.int64)      # fresh batch the example came in
        self.shape = np.zeros((c, 2), np.int32)
        self.source_hw = np.zeros((c, 2), np.int32)
        self.scale = np.ones((c, 2), np.float32)
        self.box = np.zeros((c, 4), np.float32)
        self.flip = np.zeros(c, bool)
        self.last = np.zeros(c, bool)            # emitted in the previous batch
        self._free = list(range(c - 1, -1, -1))

    def __len__(self):
        """Entries holding an example (with emissions left)."""
        return self.capacity - len(self._free)

    @property
    def free(self):
        return len(self._free)

    @property
    def pending(self):
        """Emissions still owed by the stored examples."""
        return int(self.remaining.sum())

    def active(self):
        return np.flatnonzero(self.remaining > 0)

    def allocate(self, n):
        if n > len(self._free):
            raise RuntimeError(f"echo buffer full: {n} entries asked, {len(self._free)} free")
        entries = np.array([self._free.pop() for _ in range(n)], dtype=np.int64)
        return entries

    def retire(self, entries):
        entries = np.asarray(entries)
        self.remaining[entries] = 0
        self._free.extend(int(e) for e in entries)
        self._settle()

    def choose(self, n, rng):
        """``n`` entries to emit: distinct while enough are active, with repeats only in
        the last batches of an epoch, when fewer than ``n`` distinct examples remain.

        Entries emitted in the previous batch sit this one out while the others
        suffice, so an example never lands in two adjacent batches while the
        buffer holds two batches' worth of active examples."""
        active = self.active()
        rested = active[~self.last[active]]
        if len(rested) >= n:
            return rng.choice(rested, size=n, replace=False)
        if len(active) >= n:
            return rng.choice(active, size=n, replace=False)
        picks = list(active)
        left = self.remaining[active].copy() - 1
        while len(picks) < n:
            avail = active[left > 0]
            if len(avail) == 0:
                break
            take = rng.choice(avail, size=min(n - len(picks), len(avail)), replace=False)
            picks.extend(take)
            left[np.searchsorted(active, take)] -= 1
        return np.asarray(picks, dtype=np.int64)

    def recount(self, entries, totals):
        """Entries owe ``totals`` emissions in all now (auto echo moved e): what is
        left is the new total less the emissions made, at least the first one;
        entries with none left are freed."""
        entries = np.asarray(entries, np.int64)
        left = np.maximum(np.asarray(totals, np.int32) - self.next_echo[entries], 0)
        self.remaining[entries] = left
        self._free.extend(int(e) for e in entries[left == 0])
        self._settle()

    def emit(self, entries):
        """Record one emission of each entry; returns their echo indices."""
        echo = np.empty(len(entries), np.int64)
        self.last[:] = False
        self.last[entries] = True
        # A loop, not fancy indexing: an entry may appear twice in a tail batch.
        for i, e in enumerate(entries):
            echo[i] = self.next_echo[e]
            self.next_echo[e] += 1
            self.remaining[e] -= 1
            if self.remaining[e] == 0:
                self._free.append(int(e))
        self._settle()
        return echo

    def _settle(self):
        # Once empty, start over from the initial free list: which entries an
        # epoch uses (and so its emission order) then depends on (seed, epoch)
        # only, not on the epochs before it (set_epoch, resume at an epoch start).
        if len(self._free) == self.capacity:
            self._free = list(range(self.capacity - 1, -1, -1))
            self.last[:] = False

    def clear(self):
        self.retire(self.active())


class BatchWindow:
    """Batch echoing: a window of whole batches, each repeated its count of times."""

    def __init__(self, size):
        self.size = int(size)
        self.batches = []   # [batch, remaining, emitted, ticket]
        self._last = None   # the entry emitted last

    def __len__(self):
        return len(self.batches)

    def add(self, batch, count, ticket=None):
        self.batches.append([batch, int(count), 0, ticket])

    def take(self, rng, fresh_first=False):
        """A random batch of the window, not the one just emitted when there is a choice
        (or, with ``fresh_first``, the oldest never emitted); returns (batch, echo index,
        ticket)."""
        unsent = [e for e in self.batches if e[2] == 0] if fresh_first else []
        if unsent:
            entry = unsent[0]
        else:
            pool = [e for e in self.batches if e is not self._last] or self.batches
            entry = pool[int(rng.integers(len(pool)))]
        echo = entry[2]
        entry[1] -= 1
        entry[2] += 1
        if entry[1] == 0:  # by identity: entries hold arrays, == would compare them
            self.batches = [e for e in self.batches if e is not entry]
        self._last = entry
        return entry[0], echo, entry[3]


class AutoEcho:
    """The echo factor of ``echo="auto"``: the e that keeps the accelerator busy with
    data that still teaches, measured while training.

    **Rate model.**  ``t_up`` is the upstream's time per fresh batch (worker fill
    time / workers: its capacity, not counting time the workers sat on a full
    ring) and ``t_down`` the consumer's time per delivered batch, including the
    ring's own emission work (re-augmentation, normalisation) but not the time it
    blocked on the upstream; each is the median of its last 15 observations, so
    an evaluation pass, a checkpoint or a slow file moves neither.  At e = R =
    t_up / t_down the consumer is exactly fed; below it the accelerator waits,
    above it repeats stand in for fresh data that was never short, and each
    one costs a whole step: in wall time, e above R can at best tie with e = R,
    when a repeat teaches as much as a fresh example.  The target is therefore
    just above R, ``headroom`` x R (1.1), against the rates' wander; repeats are
    kept rather than evicted while the buffer has room, so the upstream fills
    the ring and waits and the consumer does not.  Each stall that still
    happens raises a correction factor (up to 1.5) that decays by 0.5% per
    batch.

    **Loss feedback** (optional, :meth:`EchoRing.report`).  With per-example
    losses the controller compares echoed rows with fresh ones.  Once repeats
    are clearly easier (smoothed loss ratio < 0.8: the model is fitting them) a
    cap on e falls by 3% per report, down to 1, so that fresh data, not
    memorised repeats, fills the steps; it recovers while the ratio is >= 0.9.
    It never raises e above the rate target: that would add steps, not
    progress.  Without feedback the cap is ``max_echo``.

    When e moves, the examples in the echo buffer are recounted at the new e
    (their per-example draws are fixed), so the buffer follows e at once instead
    of draining the counts it was filled with.  That makes a high start cheap:
    it starts at e = 4 (at most ``max_echo``), so an upstream-bound job runs at
    a useful e from its first batch, and a job that needs less gives back the
    surplus repeats once the rates are known, a few batches in.

    Every change of more than 0.05 is recorded in :attr:`trace` (at most the
    last 256) with its reason: ``"stall"`` (before the rates are known, or the
    correction), ``"rates"`` or ``"loss"``.
    """

    HEADROOM = 1.1
    START = 4.0            # e before the rates are known (at most max_echo)
    WINDOW = 15            # the rates are medians of the last WINDOW observations
    SMOOTHING = 0.2        # weight of a new report in the running loss ratio
    WARM = 3               # observations of each rate before the model is used
    DEADBAND = 0.05        # a rate-driven change of e smaller than this share is ignored
    TRACE = 256

    def __init__(self, max_echo=4.0, start=None, headroom=HEADROOM, clock=None):
        if max_echo < 1:
            raise ValueError(f"max_echo must be >= 1, got {max_echo}")
        if headroom < 1:
            raise ValueError(f"headroom must be >= 1, got {headroom}")
        self.max_echo = float(max_echo)
        self.headroom = float(headroom)
        start = self.START if start is None else start
        self.value = float(min(max(start, 1.0), max_echo))
        self.cap = self.max_echo
        self.t_up = self.t_down = None
        self._ups = collections.deque(maxlen=self.WINDOW)
        self._downs = collections.deque(maxlen=self.WINDOW)
        self._n_loss = 0
        self._boost = 1.0
        self._loss_ratio = None
        self._clock = clock or time.perf_counter
        self._t0 = self._clock()
        self.batches = 0
        self.trace = []

    # -- observations ------------------------------------------------------------------
    def upstream(self, seconds):
        """A fresh batch took the upstream ``seconds`` of capacity (fill time / workers)."""
        if seconds > 0:
            self._ups.append(seconds)
            self.t_up = float(np.median(self._ups))
            self._update("rates")

    def consumer(self, seconds):
        """The consumer (with the ring's own work) spent ``seconds`` on a batch."""
        self.batches += 1
        if seconds > 0:
            self._downs.append(seconds)
            self.t_down = float(np.median(self._downs))
        self._boost = max(1.0, self._boost * 0.995)
        self._update("rates")

    def stalled(self):
        """The consumer waited for fresh data with no repeat left to emit."""
        if self._warm:
            self._boost = min(1.5, self._boost * 1.1)
            self._update("stall")
        else:  # no rates yet: climb quickly, as a stall costs a whole step
            self._set(min(self.max_echo, self.cap, self.value * 1.15 + 0.05), "stall")

    def losses(self, losses, echo_index):
        """Per-example losses of a delivered batch and the echo index of each row."""
        losses = np.asarray(losses, dtype=np.float64)
        echo_index = np.asarray(echo_index)
        ok = np.isfinite(losses)
        fresh, echoed = losses[ok & (echo_index == 0)], losses[ok & (echo_index > 0)]
        if not len(fresh) or not len(echoed) or fresh.mean() <= 0:
            return
        self._loss_ratio = self._mean(self._loss_ratio, echoed.mean() / fresh.mean())
        self._n_loss += 1
        if self._n_loss < 5:
            return
        if self._loss_ratio >= 0.9:
            self.cap = min(self.max_echo, self.cap * 1.03 + 0.01)
        elif self._loss_ratio < 0.8:
            self.cap = max(1.0, self.cap * 0.97)
        self._update("loss")

    # -- the decision -------------------------------------------------------------------
    @property
    def _warm(self):
        return len(self._ups) >= self.WARM and len(self._downs) >= self.WARM

    @property
    def R(self):
        """t_up / t_down as measured so far (nan before both are known)."""
        if self.t_up is None or not self.t_down:
            return float("nan")
        return self.t_up / self.t_down

    @property
    def loss_ratio(self):
        """Smoothed mean loss of echoed rows / fresh rows (None without feedback)."""
        return self._loss_ratio

    def _mean(self, old, new):
        return new if old is None else old + self.SMOOTHING * (new - old)

    def _update(self, reason):
        if self._warm:
            target = self.headroom * self._boost * self.R
            target = min(self.max_echo, self.cap, max(1.0, target))
            if reason == "rates" and abs(target - self.value) < self.DEADBAND * self.value:
                return  # the measured rates jitter; e follows only real changes
            self._set(target, reason)
        elif self.value > self.cap:
            self._set(self.cap, reason)

    def _set(self, value, reason):
        value = max(1.0, value)
        if abs(value - self.value) > 0.05:
            self.trace.append({"t_s": round(self._clock() - self._t0, 3), "batch": self.batches,
                               "echo": round(value, 3), "reason": reason,
                               "R": None if math.isnan(self.R) else round(self.R, 3)})
            del self.trace[:-self.TRACE]
        self.value = value

    def counts(self, draws):
        """Emissions at the current e for examples with these :func:`echo_draws`."""
        return counts_from(draws, self.value)


def buffer_bytes(entries, entry_bytes):
    """Human-readable size of an echo buffer, for error messages."""
    n = entries * entry_bytes
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{math.ceil(n / 2**20)} MiB"

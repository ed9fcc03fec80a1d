"""The shuffle buffer after the echo stage, and the window of batch echoing.

- :class:`ExampleBuffer`: each fresh example is stored once with the number of
  emissions it has left; a batch picks distinct examples at random, so repeats
  of one example never share a batch and land a random distance apart.
- :class:`BatchWindow`: batch echoing, whole batches repeated in a shuffled
  window (the paper's weakest variant, kept for comparison).
"""
from __future__ import annotations

import math

import numpy as np


class ExampleBuffer:
    """The books of the shuffle buffer: which entries hold an example, which sample
    it is, and how many emissions it has left.

    The examples themselves (pixels, canvases, a user's tensors) live in the
    entries of a store of the same capacity, owned by whoever makes the
    emissions (:mod:`echo_native.echo.images`, :mod:`echo_native.echo.pytree`);
    these books are tiny host arrays that drive Python control flow.
    """

    def __init__(self, capacity):
        self.capacity = c = int(capacity)
        self.sample_id = np.zeros(c, np.int64)
        self.ok = np.zeros(c, bool)              # the stored sample is the one asked for
        self.remaining = np.zeros(c, np.int32)   # emissions left
        self.next_echo = np.zeros(c, np.int32)   # echo index of the next emission
        self.epoch = np.zeros(c, np.int64)
        self.ticket = np.zeros(c, np.int64)      # fresh batch the example came in
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

    def choose(self, n, rng, closing=False):
        """Up to ``n`` distinct entries to emit (fewer only when fewer are active).

        Entries emitted in the previous batch sit this one out while the others
        suffice, so an example never lands in two adjacent batches while the
        buffer holds two batches' worth of active examples.

        ``closing``: no fresh example joins before the epoch ends.  The entries
        with the most emissions left go first (among equals, the rested ones,
        then at random): spreading the repeats keeps as many distinct examples
        for the last batches as there can be, so every batch but the epoch's last
        is full whenever the pending emissions allow it, and none ever holds an
        example twice."""
        active = self.active()
        k = min(n, len(active))
        if closing:
            # Most left first; among equals, those that sat the last batch out.
            shuffled = rng.permutation(active)
            order = np.lexsort((self.last[shuffled], -self.remaining[shuffled]))
            return rng.permutation(shuffled[order[:k]])
        rested = active[~self.last[active]]
        return rng.choice(rested if len(rested) >= k else active, size=k, replace=False)

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
        """Every entry free (a new stream position), whatever was held or taken."""
        self.remaining[:] = 0
        self._free = list(range(self.capacity - 1, -1, -1))
        self.last[:] = False


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

    def choose(self, rng, fresh_first=False):
        """The entry :meth:`take` would emit, not yet booked (:meth:`book` it once its
        emission is made): ``[batch, remaining, emitted, ticket]``."""
        unsent = [e for e in self.batches if e[2] == 0] if fresh_first else []
        if unsent:
            return unsent[0]
        pool = [e for e in self.batches if e is not self._last] or self.batches
        return pool[int(rng.integers(len(pool)))]

    def book(self, entry):
        """One emission of ``entry`` (from :meth:`choose`) made."""
        entry[1] -= 1
        entry[2] += 1
        if entry[1] == 0:  # by identity: entries hold arrays, == would compare them
            self.batches = [e for e in self.batches if e is not entry]
        self._last = entry

    def take(self, rng, fresh_first=False):
        """A random batch of the window, not the one just emitted when there is a choice
        (or, with ``fresh_first``, the oldest never emitted); returns (batch, echo index,
        ticket)."""
        entry = self.choose(rng, fresh_first)
        echo = entry[2]
        self.book(entry)
        return entry[0], echo, entry[3]


def buffer_bytes(entries, entry_bytes):
    """Human-readable size of an echo buffer, for error messages."""
    n = entries * entry_bytes
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{math.ceil(n / 2**20)} MiB"

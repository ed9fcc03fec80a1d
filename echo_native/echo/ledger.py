"""The ledger of fresh examples: which had their first emission, for an exact resume.

An echo stage holds fresh examples for a while before it emits them, so the
position of the fresh stream (the upstream's next batch) runs ahead of what the
consumer has seen.  A saved state therefore points at the oldest fresh batch
with an example still waiting for its first emission, and lists the examples of
that batch and later ones that were already emitted (``skip``): a resume reads
from there and emits each of those examples fresh exactly once, never twice and
never not at all.  The echoes still owed for examples emitted before the save
are dropped (the buffer itself is not saved: a few kilobytes of state, valid
for any worker count).
"""
from __future__ import annotations


class FreshLedger:
    """Per fresh batch (ticket): how many of its examples await their first emission,
    and the sample ids that had it."""

    def __init__(self):
        self._unsent = {}     # ticket -> examples still to be emitted for the first time
        self._sent = {}       # ticket -> ids emitted fresh (own samples, not stand-ins)
        self.skip = set()     # ids a restored state says were emitted before its save

    def __contains__(self, ticket):
        return ticket in self._unsent

    def size(self):
        """``(batches, ids)`` the ledger holds: bounded by the buffer, not the epoch."""
        return len(self._unsent), sum(len(ids) for ids in self._sent.values())

    def add(self, ticket, waiting):
        """A fresh batch came in, ``waiting`` of its examples to be emitted."""
        self._unsent[ticket], self._sent[ticket] = int(waiting), []

    def emitted_whole(self, ticket, sample_ids):
        """Every example of fresh batch ``ticket`` had its first emission at once (batch
        echo, pass-through); ``sample_ids`` are its own samples (not stand-ins)."""
        self._unsent[ticket], self._sent[ticket] = 0, list(sample_ids)
        self._forget()

    def sent(self, tickets, sample_ids, own):
        """First emissions, one per row, of fresh batches ``tickets``; ``own`` is False for
        a stand-in (a replacement for a sample that failed), whose id did not get its
        own fresh emission and must still get it after a resume."""
        for t, sid, mine in zip(tickets.tolist(), sample_ids.tolist(), own.tolist()):
            self._unsent[t] -= 1
            if mine:
                self._sent[t].append(sid)
        self._forget()

    def drop(self, ticket, count):
        """``count`` examples of fresh batch ``ticket`` will never be emitted (the rest of
        a batch dropped part way into the buffer)."""
        if ticket in self._unsent:
            self._unsent[ticket] = max(0, self._unsent[ticket] - int(count))
            self._forget()

    def oldest(self):
        """The oldest fresh batch with an example still unsent, or None: a state taken
        now reads from there, so the upstream keeps its state from there on."""
        return min((t for t, left in self._unsent.items() if left), default=None)

    def _forget(self):
        """Drop batches that are fully sent and older than any partly sent one."""
        oldest = min((t for t, left in self._unsent.items() if left), default=None)
        for t in [t for t in self._unsent if oldest is None or t < oldest]:
            if not self._unsent[t]:
                del self._unsent[t], self._sent[t]

    def position(self, upstream_position):
        """``(ticket, skip)`` of a state: the oldest batch with an example still unsent
        (else the upstream's position) and the ids emitted from there on."""
        pending = [t for t, left in self._unsent.items() if left]
        ticket = min(pending) if pending else upstream_position
        skip = {sid for t, ids in self._sent.items() if t >= ticket for sid in ids}
        # Ids skipped since a restore were emitted before the state it came from.
        return ticket, sorted(skip | self.skip)

    def clear(self, skip=()):
        """A new stream position; ``skip`` the ids a restored state says were emitted."""
        self._unsent, self._sent = {}, {}
        self.skip = set(int(s) for s in skip)

    def end_epoch(self):
        """The epoch is done: what a restored state skipped is behind us."""
        self.skip = set()

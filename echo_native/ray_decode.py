"""The Ray side of :mod:`echo_native.ray`: what a decoding actor does with a ticket.

A Ray Dataset's input rows are *tickets* (batch numbers of the project's
:class:`~echo_native.plan.Plan`); its output rows are samples, keyed by sample id.
Each actor holds one :class:`~echo_native.workers._Filler` (one native decoder),
and fills a ticket exactly as a local worker fills a ring slot: the same ids from
the plan, the same crop, DCT scale, ops and detection window, keyed by (seed,
epoch, sample id, echo index), the same ``on_error`` policy.  The slot it fills
is host memory (:class:`HostSlot`) instead of shared memory, and leaves the actor
as columns of a NumPy batch.

This module imports no Ray: the actor class is plain Python, which Ray's
``map_batches`` instantiates on the cluster.
"""
from __future__ import annotations

import os
import pickle
import time
import traceback
from types import SimpleNamespace

import numpy as np

from echo_native.failures import NO_SAMPLE, Failure, decode_failures, encode_failures
from echo_native.ring import COLUMNS as RECORD
from echo_native.ring import ERR_WORKER, REASON_NONE, REPORT_BYTES, Meta, Record
from echo_native.workers import _Filler, describe

#: Columns of a trainer-bound batch besides the pixels, one per slot array (the ring's
#: record table, echo_native.ring.COLUMNS): per sample, and per object.
COLUMNS = tuple(name for name, _, rows, _ in RECORD if rows == "sample")
OBJECT_COLUMNS = tuple(name for name, _, rows, _ in RECORD if rows == "object")


class HostSlot:
    """A ring slot's arrays in plain host memory: what a worker's transform writes and
    what an echo stage reads (``pixels`` is (batch, sample_bytes) uint8)."""

    def __init__(self, batch_size, sample_bytes, record=Record()):
        B = int(batch_size)
        for name, dtype, rows, width in RECORD:
            setattr(self, name, np.zeros(record.shape(rows, width, B), dtype))
        self.pixels = np.empty((B, int(sample_bytes)), np.uint8)


class _Rows:
    """Rows ``[start, stop)`` of a :class:`HostSlot`, as a slot of their own (views):
    the tickets of one task fill one block's memory, which leaves the actor whole."""

    def __init__(self, slot, start, stop):
        for name, value in vars(slot).items():
            setattr(self, name, value[start:stop])


class _OneSlot:
    """The part of :class:`~echo_native.ring.Ring` a :class:`_Filler` writes to: one
    slot, and the meta of the ticket filled last."""

    def __init__(self, batch_size, sample_bytes, record):
        self.layout = SimpleNamespace(nslots=1, record=record)
        self.shape = (batch_size, sample_bytes, record)
        self.slots = [HostSlot(*self.shape)]
        self.meta = None

    def write_meta(self, ticket, count, error, failures_total, records=(), fill_s=0.0,
                   warned=0):
        report, dropped = encode_failures(records, REPORT_BYTES)
        self.meta = (int(count), int(error), int(failures_total), report, float(fill_s),
                     int(warned))
        return dropped

    def set_reading(self, worker, sample_id=None):
        """Only for the shared ring's supervisor: there is none here."""


class TicketDecoder:
    """``map_batches`` callable class: a batch of tickets in, their samples out.

    Parameters
    ----------
    job : bytes
        ``echo_native.pool.ship(plan, source)``: the plan (its transform, seed,
        shard, ``on_error``, decode limits) and the source, as every worker gets them.
        For a stream shared by ranks (:func:`echo_native.ray.split`), ``plan`` is a
        tuple of every rank's plan, and the input rows name their ``rank``.
    record : Record
        The sizes of a sample's record (the loader's: object slots for a detection
        source; echo_native.ray refuses other object fields).
    trainer : bool
        True: every ticket also carries its meta (count, error kind, failure
        records, fill time), at least one row per ticket, for the trainer's
        upstream to tell that a ticket is complete and what failed.  False: only
        the samples (the public :func:`echo_native.ray.dataset`).
    """

    def __init__(self, job, record=Record(), trainer=True):
        plan, self.source = pickle.loads(job)
        # One plan per rank of a shared stream; its tickets always ship the batch's
        # full rows (padding past the samples kept), so that Ray's split, which deals
        # rows, deals whole tickets round the ranks in turn.
        self.plans = tuple(plan) if isinstance(plan, (tuple, list)) else (plan,)
        self.shared = isinstance(plan, (tuple, list))
        self.plan = self.plans[0]
        self.trainer = bool(trainer)
        transform = self.plan.transform
        self.size = getattr(transform, "size", None)   # None: a canvas, variable size
        self.ring = _OneSlot(self.plan.batch_size, transform.sample_bytes, record)
        self.max_objects = record.max_objects
        self.filler = _Filler(self.ring, self.plan, self.source)
        self._fillers = {0: self.filler}
        # This instance, on every row it sends: a restarted or replaced actor is a new
        # one, so the trainer counts how many decoded for it (``stats()["ray_actors"]``).
        self.instance = int.from_bytes(os.urandom(8), "little") >> 1

    def _filler(self, rank):
        filler = self._fillers.get(rank)
        if filler is None:
            filler = self._fillers[rank] = _Filler(self.ring, self.plans[rank], self.source)
            filler.dec = self.filler.dec   # one native decoder per actor, whatever the rank
        return filler

    def fill(self, ticket, rank=0, slot=None):
        """Fill one ticket (of ``rank``'s plan) into ``slot`` (default: the actor's own,
        reused: a canvas ticket, whose rows are copied out):
        ``(slot, meta)``, meta as :meth:`_OneSlot.write_meta` keeps it.  A source
        that raises (a bug, not a bad sample) becomes the ticket's worker error with
        its traceback, as a local worker reports it."""
        if slot is not None:
            self.ring.slots[0] = slot
        self.ring.meta = None
        filler = self._filler(rank)
        t0 = time.perf_counter()
        try:
            filler.fill(ticket)
        except Exception:  # noqa: BLE001 - reported to the trainer, which raises it
            sid, where = filler.current, ""
            if sid is not None:
                where = f" on sample {sid} ({describe(self.source, sid)})"
            filler.current = None
            self.ring.write_meta(ticket, 0, ERR_WORKER, 0, [Failure(
                NO_SAMPLE, REASON_NONE, "",
                f"Ray actor (pid {os.getpid()}){where}:\n{traceback.format_exc()}")],
                time.perf_counter() - t0)
        return self.ring.slots[0], self.ring.meta

    def __call__(self, batch):
        """Input rows: ``ticket``, and optionally ``count`` (that many consecutive
        tickets from it) and ``rank``; their samples out, ticket after ticket."""
        def column(name, default):
            return np.asarray(batch[name]).reshape(-1) if name in batch else \
                np.full(len(tickets), default, np.int64)
        tickets = np.asarray(batch["ticket"]).reshape(-1)
        counts, ranks = column("count", 1), column("rank", 0)
        work = [(int(t) + i, int(r)) for t, c, r in zip(tickets, counts, ranks)
                for i in range(int(c))]
        B, group = self.plan.batch_size, None
        if self.size is not None:   # crops: every ticket into its rows of one block
            # A new block each call: the batch it becomes may be a view of it (Arrow
            # takes NumPy memory as it is), never memory an earlier batch points into.
            group = HostSlot(B * len(work), *self.ring.shape[1:])
        parts = [self._rows(t, r, None if group is None else _Rows(group, k * B, (k + 1) * B))
                 for k, (t, r) in enumerate(work)]
        out = {k: _concat([p[k] for p in parts]) for k in parts[0] if k != "image"}
        if group is not None:
            whole = all(len(p["image"]) == B for p in parts)
            out["image"] = group.pixels.reshape(len(work) * B, *self.size, 3) if whole \
                else _concat([p["image"] for p in parts])
        return out

    def _rows(self, ticket, rank=0, slot=None):
        slot, (count, error, failures, report, fill_s, warned) = self.fill(ticket, rank, slot)
        epoch = ticket // self.plan.batches_per_epoch
        # The trainer needs a row even for a ticket that kept no sample (its meta); a
        # shared stream's ticket ships all its rows (see __init__).
        n = len(slot.labels) if self.shared else max(count, 1) if self.trainer else count
        out = {"sample_id": slot.sample_ids[:n].copy(), "label": slot.labels[:n].copy(),
               "epoch": np.full(n, epoch, np.int64), "ticket": np.full(n, ticket, np.int64)}
        if self.shared:
            out["rank"] = np.full(n, rank, np.int32)
        if self.trainer:
            out["row"] = np.arange(n, dtype=np.int32)
            out["actor"] = np.full(n, self.instance, np.int64)
            out["count"] = np.full(n, count, np.int32)
            out["error"] = np.full(n, error, np.uint8)
            out["failures"] = np.full(n, failures, np.int32)
            out["fill_s"] = np.full(n, fill_s, np.float64)
            out["warned"] = np.full(n, warned, np.int32)
            reports = np.empty(n, object)
            reports[:] = b""
            if n:
                reports[0] = bytes(report)
            out["report"] = reports
        for name in COLUMNS[2:] + (OBJECT_COLUMNS if self.max_objects else ()):
            out[name] = getattr(slot, name)[:n].copy()
        if self.size is not None:
            out["image"] = slot.pixels[:n].reshape(n, *self.size, 3)
        else:
            # A canvas ships the pixels it has, not the budget reserved for the largest.
            canvas = np.empty(n, object)
            for i in range(n):
                h, w = (int(v) for v in slot.shapes[i])
                canvas[i] = slot.pixels[i, :h * w * 3].tobytes() if i < count else b""
            out["canvas"] = canvas
        return out


def _concat(arrays):
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def meta_of(count, error, failures, report):
    """The :class:`~echo_native.ring.Meta` of a ticket from its shipped columns."""
    records = decode_failures(np.frombuffer(report, np.uint8)) if len(report) else []
    return Meta(int(count), int(error), int(failures), records)

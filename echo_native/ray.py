"""Decode on a Ray cluster, echo on the trainer, resume exactly (extra ``[ray]``).

Switching between local and cluster decode is one import::

    from echo_native.ray import EchoRing      # instead of: from echo_native import EchoRing

- :func:`dataset`: a ``ray.data.Dataset`` of decoded examples, planned by the
  project's own :class:`~echo_native.plan.Plan` (seed, epoch, shard), decoded in
  ``map_batches`` by an actor class holding the fused kernel
  (:class:`~echo_native.ray_decode.TicketDecoder`).  Its input rows are tickets
  (batch numbers), its output rows samples keyed by ``sample_id``.
- :class:`EchoRing`: :class:`echo_native.EchoRing`'s interface and echo stages,
  whose upstream (:class:`RayLoader`) reads that dataset's stream instead of a
  shared-memory ring.  Before augmentation the cluster ships each example's
  DCT-scaled canvas and the trainer re-crops every emission; after augmentation
  and batch echo it ships crops.

Why tickets and not Ray's own order: Ray's iterators neither follow a seed's
order nor resume mid-epoch (ray-project/ray#37633).  Here every ticket's ids,
crops and echo counts are pure functions of the plan, so the trainer can put
the stream back in order, drop a row Ray delivers twice after a retry (counted
in ``stats()["duplicates"]``), and after ``load_state_dict`` plan the rest of an
epoch on the cluster with no id repeated or lost, for any number of ranks.

Ranks: each rank makes its own ``EchoRing(..., rank=r, world_size=n)``, whose
dataset holds that rank's share of the plan; or the ranks read one Ray stream
(:func:`split`: ``streaming_split(n, equal=True)``, one :class:`Split` a rank).
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from types import SimpleNamespace

import numpy as np

try:
    import ray
    import ray.data
except ImportError as _e:  # pragma: no cover - the extra is missing
    raise ImportError("echo_native.ray needs Ray Data: pip install 'echo_native[ray]' "
                      "(or pip install 'ray[data]>=2.60')") from _e

from echo_native._checks import positive_int
from echo_native.batch import Fresh
from echo_native.loader import Loader, WorkerError, _shutdown
from echo_native.pipeline import EchoRing as _LocalEchoRing
from echo_native.pool import ship
from echo_native.ring import OK, WAIT_CLOSED, WAIT_OK, WAIT_TIMEOUT, Record
from echo_native.ray_decode import COLUMNS, OBJECT_COLUMNS, HostSlot, TicketDecoder, meta_of

__all__ = ["EchoRing", "RayLoader", "Split", "dataset", "split"]

#: Tickets one trainer-side dataset covers, in whole epochs (at least one): a new
#: dataset starts a new actor pool (seconds), and its input rows cost the trainer
#: about a millisecond each to make (``from_items``).
TICKETS_PER_DATASET = 1000
#: Ray's batches fetched ahead of the stream's thread (``iter_batches``).
PREFETCH = 2
#: Images per Ray block (several small tickets to a task), and at most this many tickets.
BLOCK_IMAGES = 256
MAX_TICKETS_PER_BLOCK = 8
#: Blocks per actor Ray may hold decoded ahead (see RayStream).
AHEAD_BLOCKS = 4


def _concurrency(concurrency):
    """Decoding actors: as given, else one per CPU of the cluster ``ray.init()`` joined."""
    if concurrency is not None:
        # None: one actor per CPU of the cluster.
        return positive_int("echo_native.ray", "concurrency", concurrency)
    if not ray.is_initialized():
        ray.init()
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def tickets_per_block(plan):
    """Tickets one Ray task decodes into one block, about BLOCK_IMAGES images: Ray's
    cost is per block as much as per byte (measured, docs/ray.md)."""
    return max(1, min(MAX_TICKETS_PER_BLOCK, -(-BLOCK_IMAGES // plan.batch_size)))


def build_dataset(plan, source, starts, length, *, concurrency, record=Record(), trainer=False,
                  job=None, ahead_bytes=None, shared=False):
    """The Dataset of ``length`` tickets of ``plan`` from each of ``starts`` (one
    stream: one start; a stream shared by ranks: each rank's, its rows dealt in turn
    and named by rank).  An input row is a run of consecutive tickets of one rank
    (:func:`tickets_per_block`), one task and one block; the samples come out.

    ``preserve_order`` is set on this dataset's own context (not the process's), so
    Ray delivers the tickets in the plan's order; the trainer puts them in order
    anyway, and this keeps how far it must look ahead to one block.
    ``ahead_bytes`` bounds the object store the execution may fill ahead of the
    reader (Ray's default is a share of the node's memory: epochs of decoded
    images, decoded for a trainer that may stop, on cores the trainer needs)."""
    if length < 1:
        raise ValueError("no tickets to read")
    if job is None:
        job = ship(plan, source)
    ctx = ray.data.DataContext.get_current()
    progress = ctx.enable_progress_bars
    g = tickets_per_block(plan)
    rows = [dict(ticket=int(s) + c, count=min(g, length - c), **({"rank": r} if shared else {}))
            for c in range(0, length, g) for r, s in enumerate(starts)]
    ds = ray.data.from_items(rows, override_num_blocks=len(rows))
    ds = ds.map_batches(TicketDecoder, batch_size=1,
                        compute=ray.data.ActorPoolStrategy(size=concurrency), num_cpus=1,
                        fn_constructor_kwargs=dict(job=job, record=record,
                                                   trainer=trainer),
                        batch_format="numpy", zero_copy_batch=True)
    ds.context.execution_options.preserve_order = True
    if ahead_bytes is not None:
        limits = ds.context.execution_options.resource_limits
        ds.context.execution_options.resource_limits = limits.copy(
            object_store_memory=float(ahead_bytes))
    if shared:
        # A run's rows stay one block (Ray slices a block past its target size): the
        # split deals blocks.
        block_bytes = g * plan.batch_size * plan.transform.sample_bytes
        ds.context.target_max_block_size = max(ds.context.target_max_block_size or 0,
                                               4 * block_bytes)
    ds.context.enable_progress_bars = progress and not trainer
    return ds


class RayStream:
    """The trainer's end of one Ray stream: what :class:`Loader` reads as its ring
    (``wait_filled``, ``read_meta``, ``release``, ...) and supervises as its pool
    (``check``, ``waiting_on``, ``close``).

    A thread reads Ray's batches, from ticket ``first`` on (datasets of its own, or
    a :class:`Split`, once), and assembles each ticket's rows into a
    :class:`~echo_native.ray_decode.HostSlot`; it holds at most ``nslots`` tickets
    (assembling, or complete and not yet given back), which bounds the trainer's
    memory as the ring's slots do.  A row seen before (Ray retried its task after a
    fault) is dropped and counted.
    """

    restarts = 0

    def __init__(self, loader, first, nslots, concurrency, start=True, split=None):
        self.plan, self.source = loader._work, loader.source
        self.bpe, self.first = self.plan.batches_per_epoch, int(first)
        self.concurrency, self.record = concurrency, loader.record
        transform = self.plan.transform
        self.fixed = getattr(transform, "size", None) is not None
        self.layout = SimpleNamespace(nslots=int(nslots), record=self.record)
        self.name = f"ray-stream-{os.getpid()}-{id(self):x}"
        B = self.plan.batch_size
        # What Ray may hold decoded ahead: twice the trainer's slots, or four blocks
        # per actor.  Ray splits the budget between its operators and keeps finished
        # blocks back to deliver them in order: measured, with three blocks an actor
        # or fewer only one of two actors works.
        self.ahead_tickets = max(2 * int(nslots),
                                 AHEAD_BLOCKS * concurrency * tickets_per_block(self.plan))
        self.ahead_bytes = self.ahead_tickets * B * transform.sample_bytes
        self._free = [HostSlot(B, transform.sample_bytes, self.record)
                      for _ in range(int(nslots))]
        self._cond = threading.Condition()
        self._partial = {}     # ticket -> [slot, rows seen (bool[B]), meta or None, bytes]
        self._done = {}        # ticket -> (slot, Meta, fill_s, warned, bytes)
        self._complete = set()  # tickets assembled (a later copy of their rows is a repeat)
        self._stop, self._error = False, None
        self.duplicates = self.bytes = self.rows = 0
        self.actors = set()    # the decoding actor instances that sent rows
        self.assemble_s = 0.0  # the trainer's time putting Ray's rows into slots
        self._slot_wait_s = 0.0
        self.split, self._ended = split, False
        self.job = ship(self.plan, self.source) if split is None else None
        self.reading = None    # the epoch whose dataset is being read
        self._thread = threading.Thread(target=self._pull, daemon=True,
                                        name="echo_native-ray-stream")
        if start:
            self._thread.start()

    # -- the thread ---------------------------------------------------------------------
    def _pull(self):
        ticket = self.first
        try:
            if self.split is not None:
                self.reading = (ticket, self.split.end)
                self._read(self.split.iterator)
                with self._cond:
                    self._ended = True
                    self._cond.notify_all()
                return
            while not self._stop:
                # Several epochs per dataset: each new one starts its actor pool (seconds),
                # and training reads epoch after epoch.
                epochs = max(1, TICKETS_PER_DATASET // self.bpe)
                end = (ticket // self.bpe + epochs) * self.bpe
                ds = build_dataset(self.plan, self.source, [ticket], end - ticket,
                                   concurrency=self.concurrency, record=self.record,
                                   trainer=True, job=self.job, ahead_bytes=self.ahead_bytes)
                self.reading = (ticket, end)
                if not self._read(ds):
                    return
                ticket = end
        except BaseException as e:  # noqa: BLE001 - raised to the consumer by check()
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _read(self, ds):
        """Read a dataset (or a split's iterator) to its end; False once stopped."""
        before, ours = set(threading.enumerate()), ()
        batches = iter(ds.iter_batches(batch_size=None, batch_format="numpy",
                                       prefetch_batches=PREFETCH))
        try:
            for cols in batches:
                t0, self._slot_wait_s = time.perf_counter(), 0.0
                ours = ours or [t for t in threading.enumerate() if t not in before]
                if self._stop or not self._take(cols):
                    return False
                self.assemble_s += time.perf_counter() - t0 - self._slot_wait_s
        finally:
            batches.close()   # stops the dataset's execution and its actors
            # and its fetching threads, soon: one still in ray.get when the user shuts
            # Ray down aborts the process (Ray's core worker).
            deadline = time.monotonic() + 5.0
            for t in ours:
                if t.name == "iter_threaded":
                    t.join(max(0.0, deadline - time.monotonic()))
        return True

    def _take(self, cols):
        """Assemble a batch of Ray's rows into their tickets' slots; False once stopped."""
        tickets, rows = np.asarray(cols["ticket"]), np.asarray(cols["row"])
        self.actors.update(np.unique(cols["actor"]).tolist())
        if self.split is not None and (np.asarray(cols["rank"]) != self.split.rank).any():
            other = int(np.asarray(cols["rank"])[np.asarray(cols["rank"]) != self.split.rank][0])
            raise RuntimeError(
                f"rank {self.split.rank} of a shared stream got batch {int(tickets[0])} of rank "
                f"{other}: Ray's streaming_split did not deal the tickets round the ranks in "
                f"turn (it does with the order preserved and every ticket's rows in one "
                f"block of the same size)")
        # Booked when the consumer takes the ticket: what crossed for what it used.
        per_row = sum(_nbytes(v) for v in cols.values()) / max(1, len(tickets))
        for t in np.unique(tickets):
            sel, t = np.flatnonzero(tickets == t), int(t)
            with self._cond:
                if t < self.first or t in self._complete:
                    self.duplicates += len(sel)
                    continue
                entry = self._partial.get(t)
                t0 = time.perf_counter()
                while entry is None and not self._free and not self._stop:
                    self._cond.wait(0.25)
                self._slot_wait_s += time.perf_counter() - t0
                if self._stop:
                    return False
                if entry is None:
                    entry = self._partial[t] = [self._free.pop(), None, None, 0.0]
                    entry[1] = np.zeros(len(entry[0].labels), bool)
                entry[3] += per_row * len(sel)
            slot, seen = entry[0], entry[1]
            r = rows[sel]
            new = ~seen[r]
            self.duplicates += int(np.count_nonzero(~new))
            sel, r = sel[new], r[new]
            seen[r] = True
            self.rows += len(r)
            self._copy(cols, sel, r, slot)
            at0 = sel[r == 0]
            if len(at0):
                j = int(at0[0])
                entry[2] = (meta_of(cols["count"][j], cols["error"][j], cols["failures"][j],
                                    cols["report"][j]),
                            float(cols["fill_s"][j]), int(cols["warned"][j]))
            if entry[2] is not None and seen[:max(entry[2][0].count, 1)].all():
                with self._cond:
                    del self._partial[t]
                    self._complete.add(t)
                    self._done[t] = [slot, *entry[2], entry[3]]
                    self._cond.notify_all()
        return True

    def _copy(self, cols, sel, r, slot):
        slot.sample_ids[r] = cols["sample_id"][sel]
        slot.labels[r] = cols["label"][sel]
        for name in COLUMNS[2:] + (OBJECT_COLUMNS if self.record.max_objects else ()):
            getattr(slot, name)[r] = cols[name][sel]
        if self.fixed:
            slot.pixels[r] = np.asarray(cols["image"][sel]).reshape(len(sel), -1)
        else:
            canvas = cols["canvas"]
            for j, row in zip(sel, r):
                data = canvas[j]
                slot.pixels[row, :len(data)] = np.frombuffer(data, np.uint8)

    # -- the ring's face (Loader reads these) ----------------------------------------------
    def wait_filled(self, ticket, timeout):
        with self._cond:
            ok = self._cond.wait_for(lambda: ticket in self._done or self._error is not None
                                     or self._stop, timeout)
            if self._stop:
                return WAIT_CLOSED
            return WAIT_OK if ok and ticket in self._done else WAIT_TIMEOUT

    def is_published(self, ticket):
        return ticket in self._done

    def read_meta(self, ticket):
        return self._done[ticket][1]

    def fill_seconds(self, ticket):
        return self._done[ticket][2]

    def warned(self, ticket):
        return self._done[ticket][3]

    def slot_of(self, ticket):
        return self._done[ticket][0]

    def book(self, ticket):
        """The consumer took ``ticket``: what crossed for it counts (once)."""
        done = self._done[ticket]
        self.bytes += done[4]
        done[4] = 0.0

    def release(self, ticket):
        with self._cond:
            done = self._done.pop(ticket, None)
            if done is not None:
                self._free.append(done[0])
                self._cond.notify_all()
            if len(self._complete) > 4 * self.bpe + 64:
                # Only tickets a retry could still send again need remembering.
                self._complete = {t for t in self._complete if t >= ticket - self.bpe}

    def unlink(self):
        """Nothing shared to remove: the slots are this process's memory."""

    # -- the pool's face -----------------------------------------------------------------
    def check(self, ticket):
        err = self._error
        if err is not None:
            raise WorkerError(f"the Ray stream failed while the trainer waited for batch "
                              f"{ticket} (epoch {ticket // self.bpe}): {type(err).__name__}: "
                              f"{err}") from err
        if self._ended and not self.is_published(ticket):
            raise WorkerError(
                f"rank {self.split.rank}'s share of the shared stream ended (batches "
                f"[{self.split.first}, {self.split.end}), epochs up to "
                f"{(self.split.end - 1) // self.bpe}) without batch {ticket}: make a new "
                f"split() from where the ranks stand (its epochs=) for more")

    def waiting_on(self, ticket):
        return (f"the Ray cluster has not delivered it ({self.concurrency} decoding actors, "
                f"reading tickets [{self.reading[0]}, {self.reading[1]}) of "
                f"{self.bpe} per epoch, {len(self._partial)} batches in assembly)"
                if self.reading else "the Ray dataset has not started")

    def pids(self):
        return []

    def close(self, timeout=30.0):
        """Stop reading: the thread closes Ray's iterator (which stops the dataset and
        its actors) when it returns from the batch it waits for, if any."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)


def _nbytes(column):
    if isinstance(column, np.ndarray) and column.dtype != object:
        return column.nbytes
    return sum(len(v) if isinstance(v, (bytes, bytearray)) else np.asarray(v).nbytes
               for v in column)


class RayLoader(Loader):
    """:class:`~echo_native.loader.Loader` whose tickets are filled on a Ray cluster.

    Everything that depends on the plan is the Loader's own (order, shards,
    ``state_dict``, ``load_state_dict``, elastic resume, ``on_error``, failure
    reports); only where a ticket's samples come from changes: a
    :class:`RayStream` in place of the ring and its workers."""

    concurrency = None
    #: What the streams of this loader delivered: rows Ray sent twice (dropped), bytes
    #: and rows received.  A stream's books join them when it stops.
    _ray_totals = None
    _ray_actors = None

    _split = None

    @classmethod
    def adopt(cls, loader, concurrency=None, split=None):
        """Turn a Loader that has not started into a RayLoader (same plan and books),
        reading its own datasets, or its rank's share of a shared stream (``split``)."""
        if loader.ring is not None:
            raise RuntimeError("adopt() takes a loader that has not started")
        if loader.rules:
            raise ValueError(f"echo_native.ray carries boxes, not {' or '.join(loader.rules)} "
                             f"yet: decode this source with echo_native.EchoRing")
        if split is not None:
            if not isinstance(split, Split):
                raise TypeError(f"split= takes one of the Split objects echo_native.ray.split() "
                                f"returns, got {type(split).__name__}")
            if split.key != _key(loader):
                raise ValueError(f"this ring's plan is not the one rank {split.rank} of the "
                                 f"split was made for ({_key(loader)} != {split.key}: seed, "
                                 f"samples, batch, rank, world size, shuffle, drop_last, "
                                 f"bytes per sample): give split() the ring's own keywords")
        loader.__class__ = cls
        loader.concurrency = None if concurrency is None else _concurrency(concurrency)
        loader._split = split
        loader._ray_totals = {"duplicates": 0, "bytes": 0, "rows": 0, "assemble_s": 0.0}
        loader._ray_actors = set()
        return loader

    def _stop(self):
        stream = self._ring
        try:
            super()._stop()
        finally:
            if stream is not None:
                for k in self._ray_totals:
                    self._ray_totals[k] += getattr(stream, k)
                self._ray_actors |= stream.actors

    def start(self):
        if self._ring is not None:
            return self
        split = self._split
        if split is not None:
            split.claim(self._ticket)
            concurrency = split.concurrency
        else:
            concurrency = _concurrency(self.concurrency)
        self.workers = concurrency   # auto echo divides a ticket's fill time by them
        stream = RayStream(self, self._ticket, self.slots, concurrency, split=split)
        self._ring = self._pool = stream
        self._owner_pid = os.getpid()
        # Device watchers are not called: Ray's batches are not a ring to page-lock, and
        # a GPU backend stages its copies from the slots instead.
        self._finalizer = weakref.finalize(self, _shutdown, self._owner_pid, stream, stream,
                                           ())
        self._stats.start()
        return self

    def _fresh(self, ticket, count):
        stream = self._ring
        slot = stream.slot_of(ticket)
        return Fresh(ticket, ticket // len(self), ticket % len(self), slot.sample_ids[:count],
                     slot.status[:count] == OK, slot, stream.fill_seconds(ticket))

    def next_fresh(self):
        fresh = super().next_fresh()
        self._ring.book(fresh.ticket)
        return fresh

    def ready(self):
        return self._ring is not None and self._ring.is_published(self._ticket)

    @property
    def read_ahead(self):
        """Batches that may be decoded ahead of the consumer while it runs: the
        trainer's slots, what Ray may hold in its object store, and its prefetch."""
        s = self._ring
        if s is None:
            return None
        return s.layout.nslots + s.ahead_tickets + PREFETCH * tickets_per_block(s.plan)

    def dataset(self, epoch=None):
        """The ``ray.data.Dataset`` of the samples of ``epoch`` (default: the current
        one, from the current position: the rest of an epoch resumed mid-way)."""
        bpe = self.plan.batches_per_epoch
        epoch = self.epoch if epoch is None else int(epoch)
        first = max(self._ticket, epoch * bpe) if epoch == self.epoch else epoch * bpe
        return build_dataset(self._work, self.source, [first], (epoch + 1) * bpe - first,
                             concurrency=_concurrency(self.concurrency),
                             record=self.record)

    def stats(self):
        out = super().stats()
        s = self._ring
        books = {k: v + (getattr(s, k) if s is not None else 0)
                 for k, v in self._ray_totals.items()}
        books["concurrency"] = s.concurrency if s is not None else self.concurrency
        # Decoding actor instances heard from: each stream starts `concurrency` of them,
        # and Ray's restart of one (its worker or node lost) is a new one.
        books["actors"] = len(self._ray_actors | (s.actors if s is not None else set()))
        out["ray"] = books
        return out


class EchoRing(_LocalEchoRing):
    """:class:`echo_native.EchoRing`, decoding on the Ray cluster ``ray.init()`` joined.

    Parameters
    ----------
    source, and every keyword of :class:`echo_native.EchoRing`
        The same meaning; ``workers=`` sets only the trainer's slots (how many
        batches it assembles ahead: ``Workers(slots=...)``) and the timeout.
    concurrency : int, optional
        Decoding actors (one native decoder and one CPU each); default one per CPU
        of the cluster.
    split : Split, optional
        This rank's share of a stream shared by all ranks (:func:`split`): the
        ring reads it once, from its first batch (load the same state into the
        ring as into ``split()``), and ``rank``/``world_size`` default to its own.

    ``stats()`` adds ``duplicates`` (rows Ray delivered twice after a retry,
    dropped), ``ray_bytes`` (what crossed from the cluster),
    ``ray_bytes_per_fresh``, and ``ray_actors`` (the decoding actor instances
    that delivered rows: more than ``concurrency`` per stream when Ray
    restarted one after losing its process or node).
    """

    def __init__(self, source, batch_size=256, *, concurrency=None, split=None, **kwargs):
        if split is not None:
            kwargs.setdefault("rank", getattr(split, "rank", None))
            kwargs.setdefault("world_size", getattr(split, "world_size", None))
        super().__init__(source, batch_size, **kwargs)
        # Nothing has started: the loader becomes the Ray stream's reader, and the echo
        # stage built over it reads through it unchanged.
        RayLoader.adopt(self.loader, concurrency, split)

    def dataset(self, epoch=None):
        """The ``ray.data.Dataset`` this ring reads for ``epoch`` (see :func:`dataset`)."""
        return self.loader.dataset(epoch)

    def stats(self):
        out = super().stats()
        ray_books = self.loader.stats()["ray"]
        out["duplicates"] = ray_books["duplicates"]
        out["ray_bytes"] = ray_books["bytes"]
        out["ray_bytes_per_fresh"] = ray_books["bytes"] / out["fresh"] if out["fresh"] else 0.0
        out["ray_assemble_s"] = ray_books["assemble_s"]
        out["concurrency"] = ray_books["concurrency"]
        out["ray_actors"] = ray_books["actors"]
        return out


def dataset(source, batch_size=256, *, epoch=0, concurrency=None, **kwargs):
    """A ``ray.data.Dataset`` of the decoded examples of ``epoch``, in the plan's order.

    Takes :class:`echo_native.EchoRing`'s keywords (``augment``, ``seed``,
    ``shuffle``, ``on_error``, ``rank``/``world_size``, ``echo``/``placement``,
    ...): the rows are what that ring's workers would make for the epoch.  Rows
    are samples: ``sample_id``, ``label``, ``epoch``, ``ticket`` (the batch of
    the plan), ``status`` (0 the sample asked for, 1 a stand-in for a failed
    one), ``flip``, ``boxes`` (the crop in the original), ``shapes``, and
    ``image`` (H, W, 3) uint8, or, echoing before augmentation, ``canvas`` (the
    DCT-scaled canvas's bytes, ``shapes`` high and wide) with ``source_hw`` and
    ``canvas_scale``; detection sources add ``obj_*``.  ``batch_size`` is the
    plan's batch (a ticket's size), not Ray's.
    """
    kwargs.setdefault("device", "cpu")
    ring = EchoRing(source, batch_size, concurrency=concurrency, **kwargs)
    try:
        ring.loader.set_epoch(epoch)
        return ring.dataset(epoch)
    finally:
        ring.close()


def _key(loader):
    """What a rank's ring and its share of a shared stream must agree on."""
    p = loader._base
    return (int(p.seed), p.total_samples, p.batch_size, p.rank, p.world_size, bool(p.shuffle),
            bool(p.drop_last), int(p.transform.sample_bytes))


class Split:
    """One rank's share of a stream shared by ``world_size`` ranks (:func:`split`):
    ``streaming_split``'s iterator, and the batches ``[first, end)`` of the rank's
    plan it delivers.  It pickles (Ray's iterator does), so a driver can make the
    splits and hand one to each rank's process; a rank reads it once."""

    def __init__(self, iterator, rank, world_size, first, end, concurrency, key):
        self.iterator, self.rank, self.world_size = iterator, rank, world_size
        self.first, self.end, self.concurrency, self.key = first, end, concurrency, key
        self._claimed = False

    def claim(self, ticket):
        if self._claimed:
            raise RuntimeError(
                f"rank {self.rank}'s share of the shared stream is read once, from its start, "
                f"and this ring has read it (a close(), seek or load_state_dict after iterating "
                f"starts the stream again): make a new split() from where the ranks stand")
        if ticket != self.first:
            raise ValueError(
                f"rank {self.rank} stands at batch {ticket}, its share of the shared stream "
                f"starts at batch {self.first}: load the same state into the ring as into "
                f"split(state=...)")
        self._claimed = True

    def __repr__(self):
        return (f"Split(rank={self.rank}, world_size={self.world_size}, batches "
                f"[{self.first}, {self.end}))")


def split(source, batch_size=256, world_size=2, *, epochs=1, state=None, concurrency=None,
          **kwargs):
    """n ranks reading one Ray stream: ``streaming_split(n, equal=True)`` of one dataset
    of every rank's tickets, from where the ranks stand to the end of ``epochs``
    epochs, dealt in turn (runs of equal size, order preserved: Ray's split deals
    them back the same way), decoded by one pool of ``concurrency`` actors.  One
    :class:`Split` per rank, for ``EchoRing(source, batch_size, split=s, **kwargs)``.
    ``state``: what every rank's ring loads (the list of every saved rank's state,
    any world size: the elastic rules), so that the stream starts where they stand.
    The ranks must stand level; make a new split after ``epochs`` (docs/ray.md)."""
    n = positive_int("echo_native.ray.split", "world_size", world_size)
    epochs = positive_int("echo_native.ray.split", "epochs", epochs)
    kwargs.setdefault("device", "cpu")
    rings = [EchoRing(source, batch_size, rank=r, world_size=n, concurrency=concurrency,
                      **kwargs) for r in range(n)]
    try:
        if state is not None:
            for ring in rings:
                ring.load_state_dict(state)
        loaders = [ring.loader for ring in rings]
        bpe = loaders[0].batches_per_epoch
        firsts = [lo.position for lo in loaders]
        ends = [(f // bpe + epochs) * bpe for f in firsts]
        if len({e - f for f, e in zip(firsts, ends)}) != 1:
            raise ValueError(
                f"the ranks stand at different steps (batches {firsts} of {bpe} per epoch, "
                f"or shards of unequal length: shuffle=False without drop_last or pad): a "
                f"shared stream deals every rank's batches in turn, and needs them level")
        length = ends[0] - firsts[0]
        concurrency = _concurrency(concurrency)
        plan = loaders[0]._work
        source = loaders[0].source   # a path made a source
        job = ship(tuple(lo._work for lo in loaders), source)
        slots = loaders[0].slots
        ahead = n * 2 * int(slots) + AHEAD_BLOCKS * concurrency * tickets_per_block(plan)
        ds = build_dataset(plan, source, firsts, length, shared=True,
                           concurrency=concurrency, record=loaders[0].record,
                           trainer=True, job=job,
                           ahead_bytes=ahead * plan.batch_size * plan.transform.sample_bytes)
        iterators = ds.streaming_split(n, equal=True)
        return [Split(it, r, n, firsts[r], ends[r], concurrency, _key(lo))
                for r, (it, lo) in enumerate(zip(iterators, loaders))]
    finally:
        for ring in rings:
            ring.close()

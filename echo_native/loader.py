"""The ring's consumer end: ordered zero-copy batches, supervision, clean-up.

:class:`Loader` owns the ring and the worker pool, hands out batches in ticket
order as zero-copy views of their slot, supervises the workers while it waits
(a dead one is replaced and its ticket redone), and cleans up on every exit
path.  It is the :class:`~echo_native.echo.upstream.Upstream` of the echo
stages (``next_fresh``, ``held``, ``hand_off``, ...); used on its own, it
yields :class:`~echo_native.batch.Batch` es of uint8 images.

Slot lifetime: a batch's arrays are views into its slot, and the slot goes
back to the workers when the next batch is requested (or on
:meth:`Batch.release`).  Copy what you need to keep (``batch.copy()``).
"""
from __future__ import annotations

import functools
import os
import sys
import time
import warnings
import weakref

import numpy as np

from echo_native._checks import flag, is_int, positive_int
from echo_native._iteration import NOT_PICKLABLE, IterationGuard, Started
from echo_native.augment import Program, WithOps
from echo_native.batch import Batch, Books, Columns, Fresh
from echo_native.errors import DecodeError
from echo_native.failures import REASONS, FailureReport
from echo_native.plan import ON_ERROR, Plan
from echo_native.resume import (check_epoch, check_merged, check_state, merge_states,
                                resumed_plan, state_at)
from echo_native.memory import WORKER_BYTES, MemoryBudget, RingMemoryError
from echo_native.ring import ERR_DECODE, ERR_WORKER, MAX_OBJECTS, OK, WAIT_OK, Record, Ring
from echo_native.source import _source_name, as_source, check_labels
from echo_native.targets import OBJECT_FIELDS, source_targets
from echo_native.specs import check_batch_size, fold
from echo_native.pool import WorkerPool, ship
from echo_native.protocol import hook

#: Object slots per detection sample (``max_objects``): COCO's most crowded image has 93.
DEFAULT_MAX_OBJECTS = 128


class WorkerError(RuntimeError):
    """A worker raised an unexpected exception, or the source's store is unreachable; the
    message carries the cause (a traceback, or the store's URL and error)."""


class Loader(Started):
    """Batches of decoded, augmented images from a source, through shared memory.

    One iteration is one epoch (``len(loader)`` batches); iterate again for the
    next.  Batches come in a fixed order for a seed, whatever the worker count.
    :class:`echo_native.EchoRing` adds echoing, normalisation and devices on top.

    Parameters
    ----------
    source : ImageFolder, FileList, TarShards, Samples, or any object with ``len``,
        ``labels``, ``read(i) -> bytes`` and ``describe(i)``.
    batch_size : int
        Samples per batch; the last batch of an epoch may be short (see ``drop_last``).
    augment : RandomResizedCrop or CenterCrop, default RandomResizedCrop(224)
        What each sample becomes, decoded and augmented by the workers.
    workers : int or Workers, default: the CPUs this process may use
        Worker processes (or threads) decoding in parallel; a :class:`Workers` spec
        also sets the mode, the ring's slots and the timeouts (``slots=``,
        ``timeout=``, ``sample_timeout=``, ``worker_mode=`` are its shorthands).
    seed : int, default 0
        Shuffling and every augmentation are pure functions of it.
    shuffle : bool, default True
        Visit samples in a random order per epoch; False keeps the source's order.
    drop_last : bool, default False
        Drop the epoch's last batch when it is short.
    on_error : {"replace", "skip", "raise"}, default "replace"
        A sample that cannot be read or decoded is replaced by a deterministic other
        sample (``fresh=False``), skipped (a shorter batch), or raised as ``DecodeError``;
        every failure is counted in ``stats()["failures"]`` and reported with its path.
        A batch left with no sample is not yielded, and an epoch in which every sample
        failed ends in one ``DecodeError`` naming the first file and the source.
    shard : Shard, default Shard() (torchrun's RANK/WORLD_SIZE)
        This process's part of the data.
    decode : DecodeLimits, default DecodeLimits()
        Strictness and decompression-bomb limits.
    max_objects : int, default 128
        For a source with detection targets (:class:`CocoDetection`, or any source
        with ``targets(i)``): the most objects one sample may have; a sample with more
        fails (``on_error``) naming this setting.  ``batch.objects`` holds the
        boxes after each sample's crop and flip.

    Shorthands: ``image_size=``, ``scale=``, ``ratio=``, ``flip_p=`` make the
    ``RandomResizedCrop``; ``strict=`` the ``DecodeLimits``; ``rank=``,
    ``world_size=`` the ``Shard``.
    """

    def __init__(self, source, batch_size, *, augment=None, workers=None, seed=0, shuffle=True,
                 drop_last=False, on_error="replace", shard=None, decode=None,
                 max_objects=DEFAULT_MAX_OBJECTS, **shorthands):
        specs = fold("Loader", augment, decode, shard, workers, shorthands)
        transform = specs.crop
        if specs.ops:  # the workers run the ops (EchoRing splits them off for its stage)
            transform = WithOps(transform, Program(specs.ops, transform.size))
        self._setup(as_source(source, "Loader"), batch_size, specs, transform, seed, shuffle,
                    drop_last, on_error, max_objects)

    @classmethod
    def from_specs(cls, source, batch_size, specs, transform, *, seed=0, shuffle=True,
                   drop_last=False, on_error="replace", max_objects=DEFAULT_MAX_OBJECTS):
        """A loader of folded :class:`~echo_native.specs.Specs` (what :class:`EchoRing`
        makes; nothing is checked twice), its workers applying ``transform``."""
        loader = cls.__new__(cls)
        loader._setup(source, batch_size, specs, transform, seed, shuffle, drop_last, on_error,
                      max_objects)
        return loader

    def _setup(self, source, batch_size, specs, transform, seed, shuffle, drop_last, on_error,
               max_objects=DEFAULT_MAX_OBJECTS):
        batch_size = check_batch_size(batch_size)
        n = len(source)
        if n == 0:
            raise ValueError("the source is empty")
        check_labels(source)  # here, once: a bad label would crash-loop the workers
        # The sizes of a sample's record in the ring: object slots only for a source
        # with targets, and rows for each object field its objects carry (keypoints,
        # a mask), with what that field's emissions follow (rules: name -> e.g. the
        # source's Keypoints).
        self.record, self.rules = Record(), {}
        if source_targets(source) is not None:
            sizes = {"max_objects": positive_int("", "max_objects", max_objects, 1,
                                                 MAX_OBJECTS)}
            for f in OBJECT_FIELDS:
                size, rule = f.carried(source, transform.sample_bytes)
                if size:
                    sizes[f.size], self.rules[f.name] = size, rule
            self.record = Record(**sizes)
        elif getattr(specs.crop, "iou_crop", None) is not None:
            raise ValueError(f"RandomIoUCrop crops around the boxes of each sample, but the "
                             f"source {_source_name(source)} has none: give a source with "
                             f"targets (CocoDetection, FileList(..., targets=True), "
                             f"TarShards(..., targets=True), or a targets(i) method)")
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        if not is_int(seed) or not 0 <= seed < 2**64:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
        shuffle, drop_last = flag("", "shuffle", shuffle), flag("", "drop_last", drop_last)
        rank, world_size, pad = specs.shard.resolve(shuffle)
        self.source = source
        self.specs = specs
        self.workers = specs.workers.processes
        self.slots = specs.workers.ring_slots
        self.timeout = specs.workers.timeout
        self.sample_timeout = specs.workers.sample_timeout
        self.plan = Plan(total_samples=n, batch_size=batch_size, transform=transform,
                         seed=int(seed), shuffle=shuffle, drop_last=drop_last,
                         on_error=on_error, decode=specs.decode, rank=rank,
                         world_size=world_size, pad=pad)
        # What an echo stage reads of the plan (the same for a resumed plan).
        self.batches_per_epoch = self.plan.batches_per_epoch
        self.samples_per_epoch = self.plan.num_samples
        self.sharded = self.plan.world_size > 1
        if self.plan.batches_per_epoch == 0:
            raise ValueError(f"batch_size {batch_size} is larger than the "
                             f"{self.plan.num_samples} samples of this rank's shard "
                             f"(drop_last=True would yield nothing)")
        self._worker_mode = specs.workers.mode
        # Pickled once, here: a source that cannot reach worker processes is
        # refused at construction, not at the first batch.
        self._job = ship(self.plan, source) if self._worker_mode == "process" else None
        # self.plan is the base plan, or for an elastic resume one whose
        # interrupted epoch reads only what the saved job left (ResumedPlan);
        # the workers get its view laid out by ticket, _work.
        self._base = self._work = self.plan
        self._history = None       # the merged states that plan was derived from
        self._ring = self._pool = None
        self._ticket = 0           # next ticket the consumer takes
        self._held = None          # ticket whose slot the consumer still reads
        self._finalizer = None
        self._watchers = []        # (opened(ring), closing()) of stages that map the ring
        self._stats = Books()
        self._failures = FailureReport(self.plan.on_error)
        # This epoch's reads, for the error of an epoch that delivers nothing: [epoch,
        # samples asked, samples delivered, failures by reason, first failure or None].
        self._tally = [None, 0, 0, {}, None]
        # Memory the stages after the loader will take besides the ring, checked with it
        # at start: [(what, bytes, setting to lower)] (an echo buffer, see EchoRing).
        self.memory_extra = ()
        self._iteration = IterationGuard("Loader")
        self._owner_pid = os.getpid()  # a forked child must neither use nor stop the ring

    def __reduce__(self):
        raise TypeError(NOT_PICKLABLE.format(type(self).__name__))

    # -- life cycle -------------------------------------------------------------------
    def start(self):
        if self._ring is not None:
            if os.getpid() != self._owner_pid:
                raise RuntimeError(
                    f"this {type(self).__name__} was started in process {self._owner_pid}; "
                    f"a forked child (pid {os.getpid()}) cannot read its ring, whose workers "
                    f"and slots belong to the parent: make a new one in the child")
            return self
        shape = getattr(self.plan.transform, "sample_bytes")
        try:
            # Every page reserved now, after a check against the memory available:
            # a ring that does not fit fails here, before any worker starts.
            ring = Ring.create(self.slots, self.plan.batch_size, shape, self._ticket,
                               budget=self._budget(), record=self.record)
        except RingMemoryError as e:
            t = self.plan.transform
            per = ", ".join(f"{k}={getattr(t, k)!r}" for k in ("size", "min_side", "max_pixels")
                            if hasattr(t, k))
            err = RingMemoryError(f"{e} This loader: batch_size={self.plan.batch_size}, "
                                  f"slots={self.slots}, {shape:,} bytes per sample "
                                  f"({type(t).__name__}({per})).", e.needed, e.available,
                                  e.limit)
            err.parts = e.parts
            raise err from None
        pool, opened = None, []
        try:
            pool = WorkerPool(ring, self._work, self.source, self.workers, self._worker_mode,
                              self._job, sample_timeout=self.sample_timeout)
            # Stages that hold on to the ring's memory (a GPU backend pins it)
            # take it before any worker writes; one that refuses stops the start.
            for watcher in self._watchers:
                watcher[0](ring)
                opened.append(watcher)
            pool.start()
        except BaseException:  # a worker that cannot start, a refused device: leak nothing
            _shutdown(os.getpid(), ring, pool, opened)
            raise
        self._ring, self._pool = ring, pool
        self._owner_pid = os.getpid()
        # Runs on close(), garbage collection and interpreter exit alike; the
        # stages that took the ring let go of it first.  Only in this process: a
        # child forked from it inherits the finalizer, and must not stop the
        # parent's workers when it exits.
        self._finalizer = weakref.finalize(self, _shutdown, self._owner_pid, ring, pool, opened)
        self._stats.start()
        return self

    def _budget(self):
        """What the pipeline needs besides the ring: its worker processes (a remote
        source's block cache and prefetch in each), the consumer's margin, and what
        the stages after the loader declared (:attr:`memory_extra`)."""
        options = hook(self.source, "remote_options")
        remote = options.cache_bytes + options.prefetch_bytes if options else 0
        processes = self.workers if self._worker_mode == "process" else 0
        return MemoryBudget.for_pipeline(workers=processes, extra=self.memory_extra,
                                         worker_bytes=WORKER_BYTES + remote)

    def close(self):
        """Stop the workers and remove the shared memory.  Idempotent.

        Iterators taken before ``close()`` are finished (their next ``next()``
        raises); iterating again, or ``start()``, starts new workers where the
        stream stood."""
        self._iteration.end()
        self._stop()

    def _stop(self):
        self._held = None
        try:
            if self._finalizer is not None:
                self._finalizer()
        finally:
            self._ring = self._pool = None

    def watch_ring(self, opened, closing):
        """Call ``opened(ring)`` whenever a ring is created (a seek makes a new one)
        and ``closing(ring)`` before it is removed: for stages that hold on to its
        memory, such as a GPU backend that page-locks it.  ``closing`` runs only
        for a ring ``opened`` accepted."""
        if self._ring is not None:
            raise RuntimeError("watch_ring must be called before the loader starts")
        self._watchers.append((opened, closing))

    def seek(self, ticket):
        """Continue from ``ticket`` (a batch number counted from epoch 0).

        Workers may already have filled batches past the current position, so
        moving anywhere but the next ticket restarts them at the new position.
        Moving back, or out of an epoch resumed from all ranks' states
        (:meth:`load_state_dict`), makes every epoch whole again.
        """
        ticket = int(ticket)
        if ticket < 0:
            raise ValueError(f"ticket must be >= 0, got {ticket}")
        plan = self.plan
        if plan is not self._base and not (ticket >= self._ticket and plan.covers(ticket)):
            plan = self._base
        self._move(ticket, plan, self._history if plan is self.plan else None)

    def _move(self, ticket, plan, history):
        """Go to ``ticket`` under ``plan``, restarting the workers if they run."""
        if ticket == self._ticket and plan is self.plan:
            return
        running = self._ring is not None
        if running:
            self._stop()
        self._ticket = ticket
        self._tally = [None, 0, 0, {}, None]  # an epoch read again is counted afresh
        if plan is not self.plan:
            self.plan, self._history = plan, history
            self._work = plan if plan is self._base else plan.for_workers()
            self._job = ship(self._work, self.source) if self._worker_mode == "process" \
                else None
        if running:
            self.start()

    def set_epoch(self, epoch):
        """Start the next iteration at ``epoch`` (as with ``DistributedSampler.set_epoch``).

        Calling it with the epoch the loader is already in costs nothing, and
        keeps a position restored mid-epoch by ``load_state_dict``.
        """
        epoch = check_epoch(epoch, len(self))
        if self._ticket // len(self) != epoch:
            self.seek(epoch * len(self))

    def state_dict(self):
        """Where the fresh stream stands: restoring it continues with the next batch.

        A small dict of plain values (JSON and pickle): ``ticket``, ``epoch``, this
        rank's ``rank`` and ``world_size``, and the plan's ``seed``,
        ``total_samples``, ``batch_size``, ``batches_per_epoch``, ``shuffle``,
        ``pad`` and ``drop_last``, which let the states of all ranks be resumed
        by a job of another size (:func:`merge_states`).  In an epoch resumed
        that way it also holds the merged states it came from (``resumed``).
        """
        return self.state_at(self._ticket)

    def state_at(self, ticket):
        """:meth:`state_dict` for a position ``ticket`` (an echo stage's lags the
        loader's: it holds fresh examples it has not emitted yet)."""
        return state_at(self.plan, ticket, self._history)

    def load_state_dict(self, state):
        """Continue from saved state (before iterating; any worker count).

        Parameters
        ----------
        state : dict or sequence of dict
            This rank's own :meth:`state_dict`, in a job of the same world size:
            the rank continues its stream exactly.  Or the states of all ranks of
            the saved job (a list in any order, or :func:`merge_states` of it),
            in a job of any world size: the samples of the interrupted epoch that
            no saved rank had consumed are split over this job's ranks in the
            epoch's order, with equal steps per rank as in any epoch (the padding
            or truncation of :class:`Shard`), and the epochs after it are those
            of a fresh job of this size.  A rank's state may list the samples of
            its batches from the ticket on that its consumer had already taken
            (``consumed``: an echo stage's, put in these terms by the stage),
            and the merge leaves them out too.

        Raises
        ------
        ValueError
            A state from another seed, source size or batch count; one rank's
            state given to a job of another world size (all ranks' are needed).
        """
        if not isinstance(state, (dict, list, tuple)):
            raise TypeError(f"load_state_dict takes a state_dict() (a dict), or the list of "
                            f"every rank's, got {type(state).__name__}")
        if not isinstance(state, dict) or "ranks" in state:
            merged = merge_states(state) if not isinstance(state, dict) else state
            return self._resume_elastic(merged)
        check_state(self._base, state)
        self._iteration.end()
        ticket, plan, history = int(state["ticket"]), self._base, state.get("resumed")
        if history is not None:
            # A rank of an elastically resumed epoch: its shard came from the history.
            plan = self._resumed_plan(history)
            if plan is None or not plan.covers(ticket):
                plan, history = self._base, None
        self._move(ticket, plan, history)

    def _resume_elastic(self, merged):
        base = self._base
        check_merged(base, merged)
        self._iteration.end()
        plan = resumed_plan(base, self.source, merged)
        if plan is None:  # nothing of the epoch consumed yet: a whole epoch as usual
            self._move(merged["epoch"] * base.batches_per_epoch, base, None)
        else:
            self._move(plan.first_ticket, plan, merged)

    def _resumed_plan(self, merged):
        return resumed_plan(self._base, self.source, merged)

    @property
    def ring(self):
        """The shared-memory ring while running, else None."""
        return self._ring

    @property
    def position(self):
        """The ticket (batch number since epoch 0) the next batch will have."""
        return self._ticket

    @property
    def left_in_epoch(self):
        """Batches still to come in the current epoch."""
        return len(self) - self._ticket % len(self)

    @property
    def ring_name(self):
        """The ring's name while running, else None: ``/memfd:echo_native-<pid>-<hex>``
        for the usual memfd ring (no file anywhere: what ``/proc/<pid>/fd`` and
        ``/proc/<pid>/maps`` show for it), ``/echo_native-...`` for a named segment in
        ``/dev/shm`` (the fallback)."""
        return None if self._ring is None else self._ring.name

    def worker_pids(self):
        return [] if self._pool is None else self._pool.pids()

    # -- iteration -----------------------------------------------------------------------
    def __len__(self):
        return self.plan.batches_per_epoch

    @property
    def epoch(self):
        """The epoch the next batch belongs to."""
        return self._ticket // len(self)

    def __iter__(self):
        """The rest of the current epoch (all of it unless resumed mid-epoch)."""
        return self._iteration.iterate(self._epoch_batches)

    def _epoch_batches(self):
        self.start()
        epoch, delivered = self.epoch, 0
        for _ in range(self.left_in_epoch):
            batch = self.next_batch()
            # A batch whose every sample failed (skipped, or no stand-in decoded) holds
            # nothing to train on, and a 0-length batch breaks a training step.
            if len(batch):
                delivered += 1
                yield batch
        if not delivered:
            self.check_delivered(epoch, "Loader")

    def check_delivered(self, epoch, owner="Loader"):
        """Raise :class:`DecodeError` when every sample read in ``epoch`` failed, naming
        how many, the first failure (its file and reason) and the source: called by an
        iteration that delivered no batch, where that is the cause."""
        tally_epoch, asked, delivered, failures, first = self._tally
        if tally_epoch != epoch or delivered or not failures:
            return
        by = ", ".join(f"{reason} {n}" for reason, n in sorted(failures.items()))
        where = ""
        if first is not None:
            path = first.path if first.path and first.path.isprintable() else repr(first.path)
            where = f"; the first: {path}: {' '.join(first.message.split())}"
        raise DecodeError(
            f"{owner}: every one of the {asked} samples read in epoch {epoch} failed, so "
            f"the epoch has no batch to deliver (failures by reason: {by}){where}. Check "
            f"that the source points at its images: {_source_name(self.source)}")

    def next_batch(self) -> Batch:
        """The next batch in ticket order (releasing the previous one's slot)."""
        fresh = self.next_fresh()
        slot, n = fresh.payload, fresh.count
        h, w = _image_shape(self.plan.transform)
        return Batch.from_columns(
            slot.pixels[:n].reshape(n, h, w, 3), Columns.of_slot(slot, n),
            sample_ids=fresh.sample_ids, fresh=fresh.ok, echo_index=np.zeros(n, np.int64),
            epoch=fresh.epoch, sanitize=self.specs.sanitize, rules=self.rules,
            release=functools.partial(self.release, fresh.ticket))

    # -- the Upstream of the echo stages ---------------------------------------------------
    # (batches_per_epoch, samples_per_epoch, sharded: attributes set by _setup)

    def id_space(self):
        return self.plan.total_samples

    def epoch_ids(self, epoch):
        return self.plan.epoch_order(epoch, self.source)

    def _fresh(self, ticket, count):
        ring = self._ring
        slot = ring.slots[ticket % ring.layout.nslots]
        return Fresh(ticket, ticket // len(self), ticket % len(self), slot.sample_ids[:count],
                     slot.status[:count] == OK, slot, ring.fill_seconds(ticket))

    def held(self):
        """The batch taken last whose slot the consumer still holds (neither released nor
        handed off), or None.

        A stage interrupted between taking a batch and using it (Ctrl-C caught by
        the training loop) picks it up here on its next iteration instead of
        losing it."""
        ticket, ring = self._held, self._ring
        if ticket is None or ring is None:
            return None
        return self._fresh(ticket, ring.read_meta(ticket).count)

    def next_fresh(self) -> Fresh:
        """The next published slot in ticket order, as a :class:`Fresh` batch whose
        payload is the slot's views.

        Releases the previously held slot first; raises the worker's error, or
        DecodeError under ``on_error="raise"``.
        """
        self.start()
        self._release_held()
        ticket = self._ticket
        self._wait(ticket)
        self._ticket += 1
        self._held = ticket
        ring = self._ring
        count, error, failures, records = ring.read_meta(ticket)
        if error == ERR_WORKER:
            self._release_held()
            detail = "\n".join(r.message for r in records) or "(no traceback)"
            raise WorkerError(f"a worker failed while filling batch {ticket}:\n{detail}")
        self._count(ticket, count, failures, records)
        if failures:
            self._failures.sample_failures(records, failures)
        if error == ERR_DECODE:
            self._release_held()
            if not records:  # cannot happen: a lone record is clipped to fit, never dropped
                raise DecodeError(f"{failures} samples of batch {ticket} failed")
            raise DecodeError(records[-1].message, records[-1].path)
        dropped = self.plan.ticket_size(ticket) - count
        self._failures.dropped(dropped)
        if (ticket + 1) % len(self) == 0:
            self._failures.end_epoch(ticket // len(self))
        fresh = self._fresh(ticket, count)
        self._stats.batches += 1
        self._stats.delivered += count
        self._stats.fresh += int(np.count_nonzero(fresh.ok))
        self._stats.warned += ring.warned(ticket)
        return fresh

    def _count(self, ticket, count, failures, records):
        """Book a batch's reads into its epoch's tally (a new epoch starts a new one)."""
        epoch = ticket // len(self)
        if self._tally[0] != epoch:
            self._tally = [epoch, 0, 0, {}, None]
        tally = self._tally
        tally[1] += self.plan.ticket_size(ticket)
        tally[2] += count
        by = tally[3]
        for r in records:
            reason = REASONS.get(r.reason, "other")
            by[reason] = by.get(reason, 0) + 1
        if failures > len(records):  # more than the slot's report area could name
            by["unreported"] = by.get("unreported", 0) + failures - len(records)
        if tally[4] is None and records:
            tally[4] = records[0]

    def release(self, ticket):
        """Give the slot of ``ticket`` back to the workers if the consumer still holds it."""
        if self._held == ticket:
            self._release_held()

    def hand_off(self):
        """Stop holding the slot of the batch just taken, and return a function that
        gives it back to the workers: for a stage that reads the slot
        asynchronously (a copy to a GPU) and releases it when that is done.  The
        function does nothing once the ring it belongs to is gone."""
        ticket, ring = self._held, self._ring
        self._held = None
        # A weak reference: a stage holding the function must not keep the loader alive.
        return functools.partial(_release_in, weakref.ref(self), ring, ticket)

    def _release_held(self):
        if self._held is not None and self._ring is not None:
            self._ring.release(self._held)
        self._held = None

    def _wait(self, ticket):
        ring, pool = self._ring, self._pool
        t0 = time.perf_counter()
        deadline = t0 + self.timeout
        while True:
            # Short sleeps so that a dead worker is noticed within a second and
            # Ctrl-C is honoured; the sleep itself is a futex wait, not a spin.
            rc = ring.wait_filled(ticket, 0.2)
            if rc == WAIT_OK:
                break
            pool.check(ticket)
            if time.perf_counter() > deadline:
                who = pool.waiting_on(ticket)
                raise TimeoutError(f"waited {self.timeout:.0f} s for batch {ticket} "
                                   f"(slot {ticket % ring.layout.nslots}); {who}. A worker may "
                                   f"be hung on a sample; raise `timeout` if a batch really "
                                   f"takes that long")
        self._stats.wait_s += time.perf_counter() - t0

    def ready(self):
        """True when the next batch is already published (taking it will not wait)."""
        return self._ring is not None and self._ring.is_published(self._ticket)

    def stats(self):
        occupancy = 0.0
        if self._ring is not None:
            ready = sum(self._ring.is_published(t)
                        for t in range(self._ticket, self._ticket + self._ring.layout.nslots))
            occupancy = ready / self._ring.layout.nslots
        return {
            **self._stats.rates(),
            "ring_occupancy": occupancy,
            "failures": dict(self._failures.counts),
            "accepted_with_warnings": self._stats.warned,
            "dropped": self._failures.total_dropped,
            "worker_restarts": self._pool.restarts if self._pool else 0,
        }


def _image_shape(transform):
    size = getattr(transform, "size", None)
    if size is None:
        raise TypeError(f"{type(transform).__name__} makes variable-size canvases; read them "
                        f"with next_fresh() (the echo stage does)")
    return (size, size) if isinstance(size, int) else tuple(size)


def _release_in(loader_ref, ring, ticket):
    loader = loader_ref()
    if loader is not None and ticket is not None and ring is not None and ring is loader._ring:
        ring.release(ticket)


def _shutdown(owner_pid, ring, pool, watchers=()):
    """Let the watchers go, stop the workers, let go of the ring (close a memfd's
    descriptor, unlink a named segment; the memory goes with the last mapping): all of
    it even if a step fails; the first failure is raised afterwards (not at interpreter
    exit, where CUDA may already be gone).  Nothing in any process but the ring's
    owner: a forked child's mappings go with it, and the ring stays the parent's."""
    if os.getpid() != owner_pid:
        return
    error = None
    for _, closing in watchers:
        try:
            closing(ring)
        except BaseException as e:  # a Ctrl-C here too: the workers must still stop
            error = error or e
    try:
        if pool is not None:
            pool.close()
    finally:
        ring.unlink()
    if error is not None:
        if sys.is_finalizing():
            warnings.warn(f"releasing the ring's memory failed: {error!r}", RuntimeWarning)
        else:
            raise error

"""Stage 4 of the pipeline: the consumer end of the ring.

:class:`Loader` owns the ring and the worker pool, hands out batches in ticket
order as zero-copy views of their slot, supervises the workers while it waits
(a dead one is replaced and its ticket redone), and cleans up on every exit
path.  The echo stage (:mod:`echo_native.echo`) sits on top of it.

Slot lifetime: a batch's arrays are views into its slot, and the slot goes
back to the workers when the next batch is requested (or on
:meth:`Batch.release`).  Copy what you need to keep (``batch.copy()``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass

import numpy as np

from echo_native.decode import DecodeLimits
from echo_native.errors import DecodeError
from echo_native.ring import ERR_DECODE, ERR_WORKER, MAX_WORKERS, OK, REASONS, Ring
from echo_native.transforms import RandomResizedCrop, output_size
from echo_native.augment import Program, WithOps, split_augment
from echo_native.workers import (ON_ERROR, Plan, Shard, WorkerPool,  # noqa: F401
                                 distributed_rank, ship)


class WorkerError(RuntimeError):
    """A worker raised an unexpected exception; the message carries its traceback."""


class SampleFailureWarning(UserWarning):
    """A sample could not be read or decoded and was replaced or skipped."""


@dataclass
class Batch:
    """One batch.

    Straight from the ring (echo=1 on the CPU), the arrays are views of the
    slot until the next batch is requested or :meth:`release` is called.
    From :class:`EchoRing` otherwise (echoing, normalising, on a GPU), images
    live in rotating output buffers (two; three on a GPU, so that the copy of
    the next batch overlaps the work on this one), valid until the batch after
    next is requested, and until ``close()``.  Either way ``copy()`` what you
    keep longer.  The arrays export DLPack: ``torch.from_dlpack(batch.images)``
    shares the memory.  On a GPU, images are a ``DeviceArray`` (or a
    ``BFloat16Array``) whose every export orders the stream it is taken on
    after the batch and the pipeline's reuse of the buffer after that stream
    (docs/gpu.md).
    """

    images: np.ndarray       # (B, H, W, 3) uint8
    labels: np.ndarray       # (B,) int64
    sample_ids: np.ndarray   # (B,) int64, indices into the source
    fresh: np.ndarray        # (B,) bool: first emission of a sample read this epoch
    echo_index: np.ndarray   # (B,) int64: 0 for the fresh emission, 1.. for echoes
    boxes: np.ndarray        # (B, 4) float32: crop (top, left, height, width) in the original
    flips: np.ndarray        # (B,) bool
    epoch: int = 0
    _release: object = None
    targets: object = None   # (B, classes) float32 soft targets with Mix, else None

    def __len__(self):
        return len(self.labels)

    def release(self):
        """Give the slot back to the workers now; the arrays must not be used after."""
        if self._release is not None:
            self._release()
            self._release = None

    def copy(self):
        """A batch that owns its memory (survives the slot's reuse)."""
        return Batch(self.images.copy(), self.labels.copy(), self.sample_ids.copy(),
                     self.fresh.copy(), self.echo_index.copy(), self.boxes.copy(),
                     self.flips.copy(), self.epoch,
                     targets=None if self.targets is None else self.targets.copy())


def _is_int(x):
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _default_workers():
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


_SOURCE_KINDS = "en.ImageFolder(root), en.FileList(list, root=...), en.TarShards([...]) or " \
    "en.Samples(blobs, labels)"


def as_source(source, owner="EchoRing"):
    """The source a loader reads, checked at construction so that nothing fails later
    in the workers.

    A folder path (``str`` or ``os.PathLike``) becomes ``ImageFolder(path)``, the
    source a path most often means; any other path, and any object that is not a
    source (``len``, ``labels``, ``read(i)``, ``describe(i)``), is refused here,
    naming the argument and the sources there are."""
    if isinstance(source, (str, bytes, os.PathLike)):
        path = os.fsdecode(source)
        if os.path.isdir(path):
            from echo_native.source import ImageFolder

            return ImageFolder(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{owner}: source {path!r} does not exist (a folder path "
                                    f"is read as en.ImageFolder(path))")
        raise TypeError(f"{owner}: source {path!r} is a file, not a folder; a file is read "
                        f"by en.FileList({path!r}, root=...) (a 'path,label' list) or "
                        f"en.TarShards([{path!r}]) (a tar shard)")
    missing = [name for name in ("__len__", "labels", "read") if not hasattr(source, name)]
    if missing:
        raise TypeError(f"{owner}: source must be {_SOURCE_KINDS}, or an object with len(), "
                        f"labels and read(i) (and optionally describe(i)); got "
                        f"{type(source).__name__} (no {', '.join(missing)})")
    for name in ("read", "describe"):
        if not callable(getattr(source, name, len)):
            raise TypeError(f"{owner}: source.{name} must be a method, got "
                            f"{type(getattr(source, name)).__name__}")
    return source


class IterationGuard:
    """One live iteration at a time, over a stream that must not be read twice.

    Iterating again takes over from an earlier iterator (whose next ``next()``
    raises instead of reading on), as leaving a ``for`` loop early and starting
    another does; ``close()`` ends every iterator taken before it; and a
    ``next()`` while another thread is inside one is refused, never served
    twice.  Each step holds a lock only while the stream moves, not while the
    consumer works on its batch.
    """

    def __init__(self, owner):
        self._owner = owner
        self._lock = threading.Lock()
        self._token = None      # the live iterator's
        self._source = None     # its generator of batches, to close on take-over

    def iterate(self, make):
        """Batches of the generator ``make()`` returns, guarded."""
        token = object()
        with self._step():
            self._close_source()
            self._token, self._source = token, make()
        source = self._source
        try:
            while True:
                with self._step():
                    if self._token is not token:
                        raise RuntimeError(
                            f"this {self._owner} iterator was superseded: the {self._owner} "
                            f"was closed, or iterated again, since it was taken (one "
                            f"iteration at a time; start a new `for` loop over it)")
                    try:
                        batch = next(source)
                    except StopIteration:
                        self._token = self._source = None
                        return
                yield batch
        finally:
            # Left early (break, an exception): the stream stops here, and a later
            # iteration continues from it.  (Only this generator can hold the lock
            # for its own token; the timeout is a guard, not a wait.)
            if self._token is token and self._lock.acquire(timeout=60):
                try:
                    self._close_source()
                    self._token = None
                finally:
                    self._lock.release()

    def end(self):
        """End every live iterator (close())."""
        with self._step():
            self._close_source()
            self._token = None

    def _close_source(self):
        source, self._source = self._source, None
        if source is not None:
            source.close()

    @contextlib.contextmanager
    def _step(self):
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(f"this {self._owner} is being iterated by another thread: one "
                               f"thread at a time may take its batches (give each thread its "
                               f"own {self._owner}, or hand batches over through a queue)")
        try:
            yield
        finally:
            self._lock.release()


def fold_shorthands(owner, augment, decode, shard, shorthands):
    """The ``augment``, ``decode`` and ``shard`` specs, with the flat keyword
    shorthands of the public contract (``image_size``, ``scale``, ``ratio``,
    ``flip_p``, ``strict``, ``rank``, ``world_size``) folded in.  A shorthand
    given next to the spec it belongs to is an error: which one would win is
    not obvious."""
    augment, ops = split_augment(owner, augment)
    crop_keys = {"image_size": "size", "scale": "scale", "ratio": "ratio", "flip_p": "flip_p"}
    crop = {crop_keys[k]: shorthands.pop(k) for k in list(shorthands) if k in crop_keys}
    if crop:
        if augment is not None:
            raise TypeError(f"{owner}: give either augment= or {', '.join(sorted(crop))}, "
                            f"not both")
        if "size" in crop:  # errors should name what the user wrote
            crop["size"] = output_size(crop["size"], "image_size")
        augment = RandomResizedCrop(**crop)
    if augment is None:
        augment = RandomResizedCrop()
    if ops:  # a plain Loader (uint8): the workers run the ops; EchoRing splits them off first
        augment = WithOps(augment, Program(ops, augment.size))
    if "strict" in shorthands:
        strict = shorthands.pop("strict")
        if decode is not None:
            raise TypeError(f"{owner}: give either decode= or strict=, not both")
        decode = DecodeLimits(strict=strict)
    if decode is None:
        decode = DecodeLimits()
    if not isinstance(decode, DecodeLimits):
        raise TypeError(f"{owner}: decode must be an echo_native.DecodeLimits, got {decode!r}")
    ranks = {k: shorthands.pop(k) for k in ("rank", "world_size") if k in shorthands}
    if ranks:
        if shard is not None:
            raise TypeError(f"{owner}: give either shard= or rank=/world_size=, not both")
        shard = Shard(**ranks)
    if shard is None:
        shard = Shard()
    if not isinstance(shard, Shard):
        raise TypeError(f"{owner}: shard must be an echo_native.Shard, got {shard!r}")
    return augment, decode, shard


class Loader:
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
    workers : int, default: the CPUs this process may use
        Worker processes (or threads) decoding in parallel, at most ``ring.MAX_WORKERS``.
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
    shard : Shard, default Shard() (torchrun's RANK/WORLD_SIZE)
        This process's part of the data.
    decode : DecodeLimits, default DecodeLimits()
        Strictness and decompression-bomb limits.
    slots : int, default max(4, 2 x workers)
        Batch slots in the shared-memory ring.
    timeout : float, default 120
        Seconds to wait for one batch before raising ``TimeoutError``.
    sample_timeout : float or None, default 60
        Seconds one sample may take to read and decode in a worker process before
        that worker is replaced and the sample reported as failed (a read that
        hangs on a stalled network mount cannot be interrupted from inside).
        None disables it; thread workers cannot be replaced and ignore it.
    worker_mode : {"process", "thread"}, default "process"
        Worker processes are fresh interpreters that never run your ``__main__``
        (no main guard needed); the source reaches them pickled by value, so a
        class defined in your script or notebook works.  Threads suit sources
        whose ``read`` releases the GIL (the decode always does).

    Shorthands: ``image_size=``, ``scale=``, ``ratio=``, ``flip_p=`` make the
    ``RandomResizedCrop``; ``strict=`` the ``DecodeLimits``; ``rank=``,
    ``world_size=`` the ``Shard``.
    """

    def __init__(self, source, batch_size, *, augment=None, workers=None, seed=0, shuffle=True,
                 drop_last=False, on_error="replace", shard=None, decode=None, slots=None,
                 timeout=120.0, sample_timeout=60.0, worker_mode="process", **shorthands):
        source = as_source(source, "Loader")
        augment, decode, shard = fold_shorthands("Loader", augment, decode, shard, shorthands)
        if shorthands:
            raise TypeError(f"Loader got unexpected keyword argument(s) "
                            f"{', '.join(sorted(shorthands))}")
        if not hasattr(augment, "apply") or not hasattr(augment, "sample_bytes"):
            raise TypeError(f"augment must be an echo_native.RandomResizedCrop or CenterCrop, "
                            f"got {augment!r}")
        n = len(source)
        if not _is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        if n == 0:
            raise ValueError("the source is empty")
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        if not isinstance(timeout, (int, float, np.integer, np.floating)) or \
                isinstance(timeout, bool):
            raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
        if not timeout > 0:  # also refuses NaN, which would disable the timeout
            raise ValueError(f"timeout must be positive, got {timeout}")
        if sample_timeout is not None and (
                not isinstance(sample_timeout, (int, float, np.integer, np.floating))
                or isinstance(sample_timeout, bool) or not sample_timeout > 0):
            raise ValueError(f"sample_timeout must be a positive number of seconds or None, "
                             f"got {sample_timeout!r}")
        if not _is_int(seed) or not 0 <= seed < 2**64:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
        if not isinstance(shuffle, (bool, np.bool_)):
            raise TypeError(f"shuffle must be True or False, got {shuffle!r}")
        if not isinstance(drop_last, (bool, np.bool_)):
            raise TypeError(f"drop_last must be True or False, got {drop_last!r}")
        if worker_mode not in ("process", "thread"):
            raise ValueError(f"worker_mode must be 'process' or 'thread', got {worker_mode!r}")
        if workers is not None and (not _is_int(workers) or not 1 <= workers <= MAX_WORKERS):
            raise ValueError(f"workers must be an integer from 1 to {MAX_WORKERS}, got "
                             f"{workers!r}")
        if slots is not None and (not _is_int(slots) or slots < 2):
            raise ValueError(f"slots must be an integer >= 2, got {slots!r}")
        rank, world_size, pad = shard.resolve(shuffle)
        self.source = source
        self.workers = min(_default_workers(), MAX_WORKERS) if workers is None else int(workers)
        self.slots = slots or max(4, 2 * self.workers)
        self.timeout = float(timeout)
        self.sample_timeout = None if sample_timeout is None else float(sample_timeout)
        self.plan = Plan(total_samples=n, batch_size=int(batch_size), transform=augment,
                         seed=int(seed), shuffle=bool(shuffle), drop_last=bool(drop_last),
                         on_error=on_error, decode=decode, rank=rank, world_size=world_size,
                         pad=pad)
        if self.plan.batches_per_epoch == 0:
            raise ValueError(f"batch_size {batch_size} is larger than the "
                             f"{self.plan.num_samples} samples of this rank's shard "
                             f"(drop_last=True would yield nothing)")
        self._worker_mode = worker_mode
        # Pickled once, here: a source that cannot reach worker processes is
        # refused at construction, not at the first batch.
        self._job = ship(self.plan, source) if worker_mode == "process" else None
        # self.plan is the base plan, or for an elastic resume one whose
        # interrupted epoch reads only what the saved job left (_ResumedPlan);
        # the workers get its view laid out by ticket, _work.
        self._base = self._work = self.plan
        self._history = None       # the merged states that plan was derived from
        self._ring = self._pool = None
        self._ticket = 0           # next ticket the consumer takes
        self._held = None          # ticket whose slot the consumer still reads
        self._finalizer = None
        self._watchers = []        # (opened(ring), closing()) of stages that map the ring
        self._stats = _Counters()
        self._iteration = IterationGuard("Loader")
        self._owner_pid = os.getpid()  # a forked child must neither use nor stop the ring

    def __reduce__(self):
        raise TypeError(_NOT_PICKLABLE.format(type(self).__name__))

    # -- life cycle -------------------------------------------------------------------
    def start(self):
        if self._ring is not None:
            if os.getpid() != self._owner_pid:
                raise RuntimeError(
                    f"this {type(self).__name__} was started in process {self._owner_pid}; "
                    f"a forked child (pid {os.getpid()}) cannot read its ring, whose workers "
                    f"and slots belong to the parent: make a new one in the child")
            return self
        from echo_native.ring import RingMemoryError

        shape = getattr(self.plan.transform, "sample_bytes")
        try:
            # Every page reserved now, after a check against the memory available:
            # a ring that does not fit fails here, before any worker starts.
            ring = Ring.create(self.slots, self.plan.batch_size, shape, self._ticket)
        except RingMemoryError as e:
            t = self.plan.transform
            per = ", ".join(f"{k}={getattr(t, k)!r}" for k in ("size", "min_side", "max_pixels")
                            if hasattr(t, k))
            raise RingMemoryError(f"{e} This loader: batch_size={self.plan.batch_size}, "
                                  f"slots={self.slots}, {shape:,} bytes per sample "
                                  f"({type(t).__name__}({per})).", e.needed, e.available,
                                  e.limit) from None
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
        self._stats.started = time.perf_counter()
        return self

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
        return self._state_at(self._ticket)

    def _state_at(self, ticket):
        """:meth:`state_dict` for a position ``ticket`` (an echo stage's may lag the
        loader's)."""
        p = self.plan
        bpe = p.batches_per_epoch
        state = {"ticket": int(ticket), "epoch": int(ticket) // bpe, "batches_per_epoch": bpe,
                 "seed": p.seed, "world_size": p.world_size, "rank": p.rank,
                 "total_samples": p.total_samples, "batch_size": p.batch_size,
                 "shuffle": p.shuffle, "pad": p.pad, "drop_last": p.drop_last}
        if self._history is not None and p.covers(ticket):
            state["resumed"] = self._history
        return state

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
            of a fresh job of this size.

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
        _check_state(self, state)
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
        ranks = merged.get("ranks")
        if not isinstance(ranks, list) or not ranks:
            raise ValueError("a merged state needs 'ranks', the list of every rank's state "
                             "(see echo_native.merge_states)")
        for s in ranks:
            check_state_values(s)
        for key in ("seed", "shuffle"):
            if merged.get(key, getattr(base, key)) != getattr(base, key):
                raise ValueError(f"states were saved with {key}={merged[key]}, this loader "
                                 f"has {key}={getattr(base, key)}; the epoch's order would "
                                 f"not be the same")
        plan = self._resumed_plan(merged)
        if plan is None:  # nothing of the epoch consumed yet: a whole epoch as usual
            self._move(merged["epoch"] * base.batches_per_epoch, base, None)
        else:
            self._move(plan.first_ticket, plan, merged)

    def _resumed_plan(self, merged):
        """This rank's plan for what the job of ``merged`` left of its epoch, or None
        when it had consumed nothing of it."""
        epoch, left, consumed = _epoch_left(self._base, self.source, merged)
        if not consumed:
            return None
        rest, k = _share(left, self._base)
        fields = {f.name: getattr(self._base, f.name) for f in dataclasses.fields(Plan)}
        return _ResumedPlan(**fields, resumed_epoch=epoch, rest=rest, resumed_batches=k)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

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
        for _ in range(self.left_in_epoch):
            yield self.next_batch()

    def next_batch(self) -> Batch:
        """The next batch in ticket order (releasing the previous one's slot)."""
        return self.batch_of(self.next_filled())

    def batch_of(self, filled) -> Batch:
        """A :class:`Batch` of views into the slot of ``filled``."""
        slot, count = filled.slot, filled.count
        h, w = _image_shape(self.plan.transform)
        fresh = slot.status[:count] == OK
        return Batch(images=slot.pixels[:count].reshape(count, h, w, 3),
                     labels=slot.labels[:count], sample_ids=slot.sample_ids[:count], fresh=fresh,
                     echo_index=np.zeros(count, dtype=np.int64), boxes=slot.boxes[:count],
                     flips=slot.flip[:count].view(bool), epoch=filled.epoch,
                     _release=functools.partial(self.release, filled.ticket))

    def held(self):
        """The batch taken last whose slot the consumer still holds (neither released nor
        handed off), as a :class:`Filled`, or None.

        A stage interrupted between taking a batch and using it (Ctrl-C caught by
        the training loop) picks it up here on its next iteration instead of
        losing it."""
        ticket, ring = self._held, self._ring
        if ticket is None or ring is None:
            return None
        count = ring.read_meta(ticket).count
        return Filled(ticket, ticket // len(self), ring.slots[ticket % ring.layout.nslots], count)

    def next_filled(self) -> "Filled":
        """The next published slot in ticket order, for stages that read slots directly.

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
        if failures:
            self._report_failures(records, failures)
        if error == ERR_DECODE:
            self._release_held()
            if not records:  # cannot happen: a lone record is clipped to fit, never dropped
                raise DecodeError(f"{failures} samples of batch {ticket} failed")
            raise DecodeError(records[-1].message, records[-1].path)
        dropped = self.plan.ticket_size(ticket) - count
        if dropped:
            self._stats.dropped += dropped
            if self.plan.on_error == "replace":
                warnings.warn(f"{dropped} failed sample(s) of batch {ticket} could not be "
                              f"replaced either (every stand-in failed too): dropped, the "
                              f"batch has {count} samples", SampleFailureWarning, stacklevel=3)
        if (ticket + 1) % len(self) == 0:
            self._summarize_epoch(ticket // len(self))
        slot = ring.slots[ticket % ring.layout.nslots]
        self._stats.batches += 1
        self._stats.delivered += count
        self._stats.fresh += int(np.count_nonzero(slot.status[:count] == OK))
        self._stats.warned += ring.warned(ticket)
        return Filled(ticket, ticket // len(self), slot, count)

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
            if rc == 0:
                break
            pool.check(ticket)
            if time.perf_counter() > deadline:
                holder = pool.holder(ticket)
                who = "no worker has claimed it" if holder is None else f"worker {holder} holds it"
                raise TimeoutError(f"waited {self.timeout:.0f} s for batch {ticket} "
                                   f"(slot {ticket % ring.layout.nslots}); {who}. A worker may "
                                   f"be hung on a sample; raise `timeout` if a batch really "
                                   f"takes that long")
        self._stats.stall_s += time.perf_counter() - t0

    def ready(self):
        """True when the next batch is already published (taking it will not wait)."""
        return self._ring is not None and self._ring.is_published(self._ticket)

    def _report_failures(self, records, failures):
        """One warning per failed file, the first time it fails; later failures of the
        same file (every epoch reads it again) are counted, and told in the epoch's
        summary (:meth:`_summarize_epoch`)."""
        action = self._action()
        books = self._stats
        for r in records:
            self._count_failure(REASONS.get(r.reason, "other"))
            if r.path in books.reported:
                books.repeats += 1
                continue
            books.reported.add(r.path)
            # A name with control characters (newline, tab, U+2028) or undecodable
            # bytes is shown escaped, so it cannot break or forge a log line; the
            # exact name is the warning's ``failure.path``.
            shown = r.path if r.path and r.path.isprintable() else repr(r.path)
            w = SampleFailureWarning(f"{shown}: {' '.join(r.message.split())} "
                                     f"(sample {r.sample_id}, {action})")
            w.failure = r
            warnings.warn(w, stacklevel=4)
        if failures > len(records):  # more than the slot's report area could name
            self._count_failure("unreported", failures - len(records))

    def _action(self):
        return {"replace": "replaced", "skip": "skipped", "raise": "raised"}[
            self.plan.on_error]

    def _count_failure(self, reason, n=1):
        books = self._stats
        books.failures[reason] = books.failures.get(reason, 0) + n
        books.epoch_failures[reason] = books.epoch_failures.get(reason, 0) + n

    def _summarize_epoch(self, epoch):
        """At the end of an epoch in which samples failed: one warning with the counts,
        so that what the per-file warnings left out (files already named, samples the
        slot's report could not name) is still said."""
        books = self._stats
        counts, repeats = books.epoch_failures, books.repeats
        books.epoch_failures, books.repeats = {}, 0
        total = sum(counts.values())
        if not total:
            return
        by = ", ".join(f"{reason} {n}" for reason, n in sorted(counts.items()))
        quiet = []
        if repeats:
            quiet.append(f"{repeats} of files already named in an earlier warning")
        if counts.get("unreported"):
            quiet.append(f"{counts['unreported']} whose paths did not fit the batch's report")
        w = SampleFailureWarning(
            f"epoch {epoch}: {total} sample(s) failed ({by}), {self._action()}"
            f"{'; not warned one by one: ' + '; '.join(quiet) if quiet else ''}; "
            f"totals in stats()['failures']")
        w.failure = None
        warnings.warn(w, stacklevel=4)

    def stats(self):
        s = self._stats
        elapsed = max(time.perf_counter() - s.started, 1e-9) if s.started else 0.0
        occupancy = 0.0
        if self._ring is not None:
            ready = sum(self._ring.is_published(t)
                        for t in range(self._ticket, self._ticket + self._ring.layout.nslots))
            occupancy = ready / self._ring.layout.nslots
        return {
            "batches": s.batches,
            "fresh": s.fresh,
            "delivered": s.delivered,
            "fresh_per_s": s.fresh / elapsed if elapsed else 0.0,
            "delivered_per_s": s.delivered / elapsed if elapsed else 0.0,
            "stall_s": s.stall_s,
            "ring_occupancy": occupancy,
            "failures": dict(s.failures),
            "accepted_with_warnings": s.warned,
            "dropped": s.dropped,
            "worker_restarts": self._pool.restarts if self._pool else 0,
        }


@dataclass
class Filled:
    """A published slot: ticket, epoch, the slot's views and how many samples it holds."""

    ticket: int
    epoch: int
    slot: object
    count: int


class _Counters:
    def __init__(self):
        self.started = 0.0
        self.batches = self.fresh = self.delivered = self.dropped = self.warned = 0
        self.stall_s = 0.0
        self.failures = {}
        self.epoch_failures = {}   # this epoch's, for its summary
        self.repeats = 0           # this epoch's failures of files named before
        self.reported = set()      # paths named in a warning already


def _image_shape(transform):
    size = getattr(transform, "size", None)
    if size is None:
        raise TypeError(f"{type(transform).__name__} makes variable-size canvases; read them "
                        f"with next_filled() (the echo stage does)")
    return (size, size) if isinstance(size, int) else tuple(size)


#: A resume position beyond this is no real job's (and would overflow the ring's words).
MAX_TICKET = 2**62

#: The type of each key a state may hold, and the test its value must pass.
_STATE_KEYS = {
    "ticket": ("an integer >= 0", lambda v: _is_int(v) and 0 <= v <= MAX_TICKET),
    "epoch": ("an integer >= 0", lambda v: _is_int(v) and v >= 0),
    "batches_per_epoch": ("a positive integer", lambda v: _is_int(v) and v >= 1),
    "total_samples": ("a positive integer", lambda v: _is_int(v) and v >= 1),
    "batch_size": ("a positive integer", lambda v: _is_int(v) and v >= 1),
    "world_size": ("a positive integer", lambda v: _is_int(v) and v >= 1),
    "rank": ("an integer >= 0", lambda v: _is_int(v) and v >= 0),
    "seed": ("an integer in [0, 2**64)", lambda v: _is_int(v) and 0 <= v < 2**64),
    "shuffle": ("True or False", lambda v: isinstance(v, (bool, np.bool_))),
    "pad": ("True or False", lambda v: isinstance(v, (bool, np.bool_))),
    "drop_last": ("True or False", lambda v: isinstance(v, (bool, np.bool_))),
    "skip": ("a list of sample ids", lambda v: isinstance(v, (list, tuple, np.ndarray))
             and all(_is_int(x) and x >= 0 for x in v)),
    "resumed": ("a merged state or None", lambda v: v is None or isinstance(v, dict)),
}


def check_state_values(state):
    """Refuse a state whose values are not what :meth:`Loader.state_dict` writes, naming
    the key: a float, string or bool ticket, a negative or absurd one, a wrong type
    anywhere (a state edited by hand, or from another program)."""
    if not isinstance(state, dict):
        raise TypeError(f"a state must be a dict from state_dict(), got "
                        f"{type(state).__name__}")
    if "ticket" not in state:
        raise ValueError("state has no 'ticket': it is not a state_dict() of a Loader or "
                         "EchoRing")
    for key, (what, ok) in _STATE_KEYS.items():
        if key in state and not ok(state[key]):
            raise ValueError(f"state[{key!r}] must be {what}, got {state[key]!r:.80}")


def check_epoch(epoch, batches_per_epoch):
    """``epoch`` as an int, or a clear error (``set_epoch(1.5)`` or ``set_epoch('2')``
    must not read part of an epoch or compare strings)."""
    if not _is_int(epoch):
        raise TypeError(f"epoch must be an integer, got {epoch!r}")
    if not 0 <= epoch <= MAX_TICKET // batches_per_epoch:
        raise ValueError(f"epoch must be between 0 and {MAX_TICKET // batches_per_epoch}, "
                         f"got {epoch}")
    return int(epoch)


def _check_state(owner, state):
    check_state_values(state)
    plan = owner._base
    world = state.get("world_size", plan.world_size)
    if world != plan.world_size:
        raise ValueError(f"state was saved by rank {state.get('rank')} of world_size={world}, "
                         f"this loader has world_size={plan.world_size}: resuming in a job "
                         f"of another size needs the states of all {world} ranks (gather "
                         f"them, e.g. with torch.distributed.all_gather_object, and pass the "
                         f"list, or echo_native.merge_states of it, to load_state_dict)")
    for key, mine in (("seed", plan.seed), ("rank", plan.rank),
                      ("batches_per_epoch", plan.batches_per_epoch),
                      ("total_samples", plan.total_samples), ("batch_size", plan.batch_size),
                      ("shuffle", plan.shuffle), ("drop_last", plan.drop_last),
                      ("pad", plan.pad)):
        if key in state and state[key] != mine:
            raise ValueError(f"state was saved with {key}={state[key]}, this loader has "
                             f"{key}={mine}; the fresh stream would not continue exactly "
                             f"(samples would be read twice or never)")


# ---- elastic resume: the states of all ranks, resumed by a job of any size ------------
_JOB_KEYS = ("seed", "world_size", "total_samples", "batch_size", "shuffle", "pad",
             "drop_last", "placement")


def merge_states(states):
    """The states of all ranks of a job, as one state any job can resume from.

    Pass the result (or the list itself) to ``load_state_dict`` of every rank
    of the resuming job, whatever its world size and worker count: the samples
    of the interrupted epoch that no saved rank had consumed are split over the
    new ranks, each sample once (up to :class:`Shard`'s padding), with equal
    steps per rank, and the epochs after it are a fresh job's.

    Parameters
    ----------
    states : sequence of dict
        The ``state_dict()`` of every rank of one job (a :class:`Loader`'s or an
        :class:`EchoRing`'s), taken at the same step, in any order: gathered
        with ``torch.distributed.all_gather_object``, or one file per rank.

    Returns
    -------
    dict
        Plain values (JSON and pickle): the job's ``seed``, ``world_size`` and
        other plan settings, the interrupted ``epoch``, and ``ranks``, the
        states ordered by rank.

    Raises
    ------
    ValueError
        When the states are not one job saved at one step: a rank missing or
        given twice, different seeds, world sizes, plans or placements, or
        states from different epochs.
    """
    if isinstance(states, dict):
        raise TypeError("merge_states takes the list of every rank's state_dict(), got one "
                        "dict")
    states = list(states)
    if not states:
        raise ValueError("merge_states: no states given")
    for s in states:
        if not isinstance(s, dict) or "ranks" in s or \
                not {"ticket", "rank", "world_size", "batches_per_epoch"} <= set(s):
            raise ValueError(f"merge_states takes the state_dict() of each rank, got {s!r:.200}")
        check_state_values(s)
    merged = {}
    for key in _JOB_KEYS:
        values = {repr(s[key]) for s in states if key in s}
        if len(values) > 1:
            raise ValueError(f"merge_states: the states disagree on {key} "
                             f"({', '.join(sorted(values))}): they are not from one job")
        if values:
            merged[key] = next(s[key] for s in states if key in s)
    world = merged["world_size"]
    ranks = sorted(int(s["rank"]) for s in states)
    if ranks != list(range(world)):
        twice = sorted({r for r in ranks if ranks.count(r) > 1})
        missing = sorted(set(range(world)) - set(ranks))
        wrong = [f"missing rank(s) {missing}"] if missing else []
        wrong += [f"rank(s) {twice} given twice"] if twice else []
        raise ValueError(f"merge_states needs the state of every rank of the job "
                         f"(world_size={world}) once: "
                         f"{'; '.join(wrong) or f'got ranks {ranks}'}")
    states = sorted(states, key=lambda s: int(s["rank"]))
    # A rank whose last emission of an epoch is behind it stands at the next epoch's
    # start while the others finish theirs: that rank has consumed its whole shard.
    epoch = min(int(s["ticket"]) // int(s["batches_per_epoch"]) for s in states)
    late = [s for s in states if int(s["ticket"]) > (epoch + 1) * int(s["batches_per_epoch"])]
    if late:
        raise ValueError(f"merge_states: the states are from different epochs (rank "
                         f"{states[0]['rank']} at ticket {states[0]['ticket']}, rank "
                         f"{late[0]['rank']} at ticket {late[0]['ticket']}); save every "
                         f"rank's state at the same step")
    histories = [s.get("resumed") for s in states]
    histories = [h if h is not None and h.get("epoch") == epoch else None for h in histories]
    if any(h != histories[0] for h in histories):
        raise ValueError("merge_states: the states come from different resumed jobs (their "
                         "'resumed' entries differ)")
    merged["epoch"] = epoch
    merged["ranks"] = [{k: v for k, v in s.items() if k != "resumed"} for s in states]
    if histories[0] is not None:
        merged["resumed"] = histories[0]
    return merged


@dataclass(frozen=True, eq=False)
class _ResumedPlan(Plan):
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


def _share(order, plan):
    """This rank's part of ``order`` and its batch count, under the rule of ``plan``
    (its rank, world size, padding, truncation and batch size)."""
    over = dataclasses.replace(plan, total_samples=len(order), shuffle=False)
    return np.asarray(order, np.int64)[over.epoch_order(0)], over.batches_per_epoch


def _saved_plan(base, state):
    """The plan one saved rank ran, rebuilt from its state and this loader's plan."""
    plan = dataclasses.replace(base, rank=int(state["rank"]),
                               world_size=int(state["world_size"]),
                               **{k: state[k] for k in ("total_samples", "batch_size",
                                                        "shuffle", "pad", "drop_last")
                                  if k in state})
    if plan.total_samples != base.total_samples:
        raise ValueError(f"states were saved over {plan.total_samples} samples, this "
                         f"loader's source has {base.total_samples}")
    if plan.batches_per_epoch != state["batches_per_epoch"]:
        raise ValueError(f"the state of rank {plan.rank} has batches_per_epoch="
                         f"{state['batches_per_epoch']}, its plan rebuilt here has "
                         f"{plan.batches_per_epoch}: the source, batch size or padding "
                         f"changed (older states lack them: resume with the saved ones)")
    return plan


def _epoch_left(base, source, merged):
    """``(epoch, left, consumed)`` for the job of ``merged``: the samples of its
    interrupted epoch that none of its ranks had consumed (read and, with echo,
    emitted fresh), in the epoch's order, and whether any of the epoch was
    consumed (by it or by the job it resumed from)."""
    epoch, states = int(merged["epoch"]), merged["ranks"]
    history = merged.get("resumed")
    plans = [_saved_plan(base, s) for s in states]
    if history is not None:
        order = _epoch_left(base, source, history)[1]
    else:
        order = plans[0].global_order(epoch, source)
    read, done = [], []
    for state, plan in zip(states, plans):
        bpe, B = plan.batches_per_epoch, plan.batch_size
        if history is not None:
            shard, k = _share(order, plan)
        else:
            shard, k = plan.epoch_order(epoch, source), bpe
        # Batches before the state's ticket were all consumed; the ids of later
        # ones that were (emitted before the save) are its skip list.
        taken = min(max(int(state["ticket"]) - (epoch + 1) * bpe + k, 0), k)
        read.append(shard[:k * B])
        done.append(shard[:taken * B])
        done.append(np.asarray(state.get("skip", ()), np.int64))
    read, done = np.concatenate(read), np.concatenate(done)
    left = order[np.isin(order, read) & ~np.isin(order, done)]
    return epoch, left, len(done) > 0 or history is not None


def _release_in(loader_ref, ring, ticket):
    loader = loader_ref()
    if loader is not None and ticket is not None and ring is not None and ring is loader._ring:
        ring.release(ticket)


_NOT_PICKLABLE = ("a {0} cannot be pickled: it owns worker processes and shared memory "
                  "that only its own process may use. Pickle (or send) its source and specs "
                  "instead, and build a new {0} from them where it is needed")


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

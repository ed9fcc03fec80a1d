"""Stage 3 of the pipeline: workers that turn tickets into filled slots.

A ticket is a batch number in an endless stream of epochs.  What a ticket
holds is a pure function of the ticket and the :class:`Plan` (seed, epoch
permutation, batch size), and every augmentation is keyed by (seed, epoch,
sample id, echo index), so any worker can fill any ticket, and a ticket whose
worker died is simply filled again by another with identical bytes.

Workers are processes by default (started with ``forkserver``, which is safe
alongside CUDA), or threads: the native kernel releases the GIL for all byte
work, so threads scale too when the source's reads release it as well.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import threading
import time
import traceback
import warnings
from dataclasses import dataclass

import numpy as np

from echo_native import _kernel
from echo_native.decode import DEFAULT_MAX_PIXELS, DEFAULT_MAX_SCANS
from echo_native.errors import DecodeError
from echo_native.ring import (CLAIM_PENDING, ERR_DECODE, ERR_NONE, ERR_WORKER, OK, REPLACED,
                              Ring, _pid_alive)

ON_ERROR = ("replace", "skip", "raise")
_REASON_DECODE, _REASON_READ = 1, 2
_MAX_REPLACEMENTS = 16
# How long one wait sleeps before re-checking the world (owner alive, ring
# closed).  Bounds how late a worker notices its parent died.
_POLL_S = 0.25


# ---- which samples each ticket holds ------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Everything a worker needs to fill any ticket, identically in every process.

    Sharding follows torch's ``DistributedSampler``: every rank draws the same
    global order for (seed, epoch), pads it by wrapping around to a multiple of
    ``world_size`` (or, with ``drop_last``, truncates it), and takes every
    ``world_size``-th sample from position ``rank``.  So ranks are disjoint
    (apart from the padding) and all yield the same number of batches.
    """

    total_samples: int
    batch_size: int
    transform: object
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False
    on_error: str = "replace"
    strict: bool = True
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_scans: int = DEFAULT_MAX_SCANS
    rank: int = 0
    world_size: int = 1

    @property
    def num_samples(self):
        """Samples this rank reads per epoch."""
        if self.world_size == 1:
            return self.total_samples
        if self.drop_last:
            return self.total_samples // self.world_size
        return math.ceil(self.total_samples / self.world_size)

    @property
    def batches_per_epoch(self):
        if self.drop_last:
            return self.num_samples // self.batch_size
        return math.ceil(self.num_samples / self.batch_size)

    def global_order(self, epoch, source=None):
        """The epoch's order over all samples: a pure function of (seed, epoch)."""
        if not self.shuffle:
            return np.arange(self.total_samples, dtype=np.int64)
        if source is not None and hasattr(source, "epoch_order"):
            return np.asarray(source.epoch_order(self.seed, epoch), dtype=np.int64)
        gen = np.random.Generator(np.random.Philox(key=[self.seed, 0x6F72646572],
                                                   counter=[epoch, 0, 0, 0]))
        return gen.permutation(self.total_samples).astype(np.int64)

    def epoch_order(self, epoch, source=None):
        """This rank's share of the epoch's order."""
        order = self.global_order(epoch, source)
        if self.world_size == 1:
            return order
        need = self.num_samples * self.world_size
        if need > len(order):
            order = np.resize(order, need)  # wraps around, as DistributedSampler pads
        return order[:need][self.rank::self.world_size]

    def replacement(self, epoch, sample_id, attempt):
        """A deterministic stand-in for a sample that failed."""
        words = _kernel.philox4x64((sample_id, epoch, attempt, 0), (self.seed, 0x7265706C))
        return int(words[0] % self.total_samples)


class _EpochCache:
    def __init__(self, plan, source):
        self.plan, self.source, self.epoch, self.order = plan, source, None, None

    def ticket(self, ticket):
        bpe = self.plan.batches_per_epoch
        epoch, b = divmod(ticket, bpe)
        if epoch != self.epoch:
            self.epoch, self.order = epoch, self.plan.epoch_order(epoch, self.source)
        B = self.plan.batch_size
        return epoch, self.order[b * B:(b + 1) * B]


# ---- filling one slot -----------------------------------------------------------
class _Filler:
    def __init__(self, ring: Ring, plan: Plan, source):
        self.ring, self.plan, self.source = ring, plan, source
        self.dec = _kernel.Decoder(plan.max_pixels, plan.max_scans, plan.strict)
        self.epochs = _EpochCache(plan, source)
        self.labels = np.asarray(source.labels, dtype=np.int64)

    def _produce(self, sid, epoch, slot, i):
        """Read + decode one sample into position i of the slot, or raise _SampleFailure."""
        try:
            data = self.source.read(sid)
        except OSError as e:
            raise _SampleFailure(_REASON_READ, self.source.describe(sid),
                                 f"cannot read: {e.strerror or e}") from None
        try:
            self.plan.transform.apply(self.dec, data, (self.plan.seed, epoch, sid, 0), slot, i)
        except (DecodeError, ValueError) as e:
            raise _SampleFailure(_REASON_DECODE, self.source.describe(sid), str(e)) from None

    def fill(self, ticket):
        t0 = time.perf_counter()
        plan, slot = self.plan, self.ring.slots[ticket % self.ring.layout.nslots]
        epoch, ids = self.epochs.ticket(ticket)
        count, failures, report = 0, 0, []
        for sid in ids:
            sid = int(sid)
            try:
                self._produce(sid, epoch, slot, count)
                status, used = OK, sid
            except _SampleFailure as f:
                failures += 1
                slot.reason[count] = f.reason
                message = " ".join(f.message.split())  # one line per failure
                report.append(f"{sid}\t{f.reason}\t{f.path}\t{message}")
                if plan.on_error == "raise":
                    self.ring.write_meta(ticket, count, ERR_DECODE, failures,
                                         "\n".join(report).encode())
                    return
                if plan.on_error == "skip":
                    continue
                used = self._replace(epoch, sid, slot, count)
                if used is None:
                    continue
                status = REPLACED
            slot.labels[count] = self.labels[used]
            slot.sample_ids[count] = used
            slot.status[count] = status
            if status == OK:
                slot.reason[count] = 0
            count += 1
        self.ring.write_meta(ticket, count, ERR_NONE, failures, "\n".join(report).encode(),
                             time.perf_counter() - t0)

    def _replace(self, epoch, sid, slot, i):
        for attempt in range(_MAX_REPLACEMENTS):
            rid = self.plan.replacement(epoch, sid, attempt)
            try:
                self._produce(rid, epoch, slot, i)
                return rid
            except _SampleFailure:
                continue
        return None


class _SampleFailure(Exception):
    def __init__(self, reason, path, message):
        super().__init__(message)
        self.reason, self.path, self.message = reason, path, message


# ---- the worker loop --------------------------------------------------------------
def run_worker(ring, index, plan, source, redo=(), owner_pid=None, stop=None):
    """Claim tickets and fill slots until the ring closes or its owner dies.

    ``redo`` lists tickets a dead predecessor left unfinished; they come first.
    The claim word says which ticket this worker holds, so the supervisor can
    tell which ones a crash lost.
    """
    filler = _Filler(ring, plan, source)
    redo = list(redo)
    # Stop taking tickets once the ring is closed (a free slot would otherwise
    # keep a process worker decoding for nobody until close() kills it).
    while not (stop is not None and stop.is_set()) and not ring.closed:
        if redo:
            ticket = redo.pop(0)
            ring.set_claim(index, ticket + 1)
        else:
            ring.set_claim(index, CLAIM_PENDING)
            ticket = ring.take_ticket()
            ring.set_claim(index, ticket + 1)
        while True:
            rc = ring.wait_free(ticket, _POLL_S)
            if rc == 0:
                break
            if rc == 2 or (stop is not None and stop.is_set()):
                return
            if owner_pid is not None and not _pid_alive(owner_pid):
                _orphaned(ring)
                return
        try:
            filler.fill(ticket)
        except Exception:
            ring.write_meta(ticket, 0, ERR_WORKER, 0,
                            f"worker {index} (pid {os.getpid()}):\n{traceback.format_exc()}"
                            .encode())
        ring.publish(ticket)
        ring.set_claim(index, 0)


def _orphaned(ring):
    # The consumer died without closing (SIGKILL, OOM): nobody else will
    # remove the segment, so the first worker to notice does.
    try:
        ring.unlink()
    except OSError:
        pass


def _process_main(ring, index, plan, source, redo, owner_pid):
    try:
        run_worker(ring, index, plan, source, redo, owner_pid)
    except KeyboardInterrupt:
        pass  # Ctrl-C reaches the whole process group; the consumer handles it


# ---- the supervisor ------------------------------------------------------------------
class WorkerPool:
    """Starts the workers, replaces those that die, and stops them all on close.

    A worker dying now and then (the OOM killer, a bad library) is replaced
    for as long as the run lasts; only a crash loop, more than
    ``max_restarts`` deaths within ``restart_window`` seconds, is an error.
    """

    def __init__(self, ring, plan, source, workers, mode="process", start_method=None,
                 max_restarts=8, restart_window=60.0):
        if mode not in ("process", "thread"):
            raise ValueError(f"worker mode must be 'process' or 'thread', got {mode!r}")
        self.ring, self.plan, self.source = ring, plan, source
        self.mode, self.count = mode, workers
        self.max_restarts, self.restart_window = max_restarts, restart_window
        self.restarts = 0
        self._recent = []  # times of recent deaths
        self._stop = threading.Event()
        self._workers = [None] * workers
        self._thread_errors = []
        if mode == "process":
            self._ctx = mp.get_context(start_method or "forkserver")
            if (start_method or "forkserver") == "forkserver":
                self._ctx.set_forkserver_preload(["echo_native.workers"])

    def start(self):
        for i in range(self.count):
            self._spawn(i, ())

    def _spawn(self, index, redo):
        if self.mode == "process":
            p = self._ctx.Process(target=_process_main, name=f"echo_native-worker-{index}",
                                  args=(self.ring, index, self.plan, self.source, list(redo),
                                        os.getpid()), daemon=True)
            p.start()
        else:
            def body():
                try:
                    run_worker(self.ring, index, self.plan, self.source, redo, stop=self._stop)
                except BaseException as e:  # surfaced by check()
                    self._thread_errors.append(e)
            p = threading.Thread(target=body, name=f"echo_native-worker-{index}", daemon=True)
            p.start()
        self._workers[index] = p

    def pids(self):
        return [w.pid for w in self._workers if self.mode == "process" and w is not None]

    def holder(self, ticket):
        """Index of the worker holding ``ticket``, or None."""
        for i in range(self.count):
            if self.ring.claim(i) == ticket + 1:
                return i
        return None

    def check(self, consumer_ticket):
        """Replace dead workers and re-issue the tickets they held."""
        if self._thread_errors:
            raise RuntimeError("a worker thread failed") from self._thread_errors[0]
        if self.mode != "process":
            return
        dead = [i for i, p in enumerate(self._workers) if p.exitcode is not None]
        if not dead:
            return
        self.restarts += len(dead)
        now = time.monotonic()
        self._recent = [t for t in self._recent if now - t < self.restart_window]
        self._recent += [now] * len(dead)
        if len(self._recent) > self.max_restarts:
            codes = {i: self._workers[i].exitcode for i in dead}
            raise RuntimeError(f"echo_native workers keep dying (exit codes {codes}): "
                               f"{len(self._recent)} deaths in {self.restart_window:.0f} s, "
                               f"giving up")
        for i in dead:
            self._workers[i].join(0)
            self.ring.set_claim(i, 0)
        lost = self._lost_tickets(consumer_ticket)
        for n, i in enumerate(dead):
            warnings.warn(f"echo_native worker {i} died (exit code {self._workers[i].exitcode});"
                          f" restarting it", RuntimeWarning, stacklevel=3)
            self._spawn(i, lost[n::len(dead)])

    def _lost_tickets(self, consumer_ticket):
        # A live worker may be between taking a ticket and recording it; wait
        # until none is, so every ticket handed out is either recorded,
        # published, or lost with the dead.  Read the ticket counter first:
        # a ticket a live worker takes after the claims are read must not
        # count as lost (it would be filled twice, the second time into a
        # slot the consumer may already have handed to the next lap).
        end = self.ring.next_ticket
        deadline = time.monotonic() + 2.0
        while any(self.ring.claim(i) == CLAIM_PENDING for i in range(self.count)):
            if time.monotonic() > deadline:
                break
            time.sleep(0.001)
        held = {self.ring.claim(i) - 1 for i in range(self.count) if self.ring.claim(i)}
        return [t for t in range(consumer_ticket, end)
                if t not in held and not self.ring.is_published(t)]

    def close(self, timeout=5.0):
        self._stop.set()
        self.ring.close()
        deadline = time.monotonic() + timeout
        for p in self._workers:
            if p is None:
                continue
            p.join(max(0.0, deadline - time.monotonic()))
            if self.mode == "process" and p.is_alive():
                p.kill()
                p.join(1.0)
        if self.mode == "process":
            for p in self._workers:
                if p is not None:
                    p.close()
        self._workers = [None] * self.count

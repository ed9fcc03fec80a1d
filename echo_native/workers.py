"""Stage 3 of the pipeline: workers that turn tickets into filled slots.

A ticket is a batch number in an endless stream of epochs.  What a ticket
holds is a pure function of the ticket and the :class:`Plan` (seed, epoch
permutation, batch size), and every augmentation is keyed by (seed, epoch,
sample id, echo index), so any worker can fill any ticket, and a ticket whose
worker died is simply filled again by another with identical bytes.

Workers are processes by default (fresh interpreters that never run the
user's ``__main__``, safe alongside CUDA, started and supervised by
:mod:`echo_native.pool`), or threads: the native kernel releases the GIL for
all byte work, so threads scale too when the source's reads release it as well.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import sys
import time
import traceback

import numpy as np

from echo_native.decode import Decoder
from echo_native.errors import DecodeError, ReadLimitError
from echo_native.plan import Plan
from echo_native.protocol import hook
from echo_native.targets import OBJECT_FIELDS, as_targets, source_targets
from echo_native.remote import StoreUnavailableError
from echo_native.failures import NO_SAMPLE, Failure
from echo_native.transforms import Canvas
from echo_native.memory import pid_alive
from echo_native.ring import (WAIT_CLOSED, WAIT_OK, CLAIM_PENDING, ERR_DECODE, ERR_NONE,
                              ERR_WORKER, OBJ_CROWD, OBJ_DROPPED, OK, REASON_DECODE,
                              REASON_LIMIT, REASON_NONE, REASON_READ, REPLACED, Ring)

_MAX_REPLACEMENTS = 16
# How long one wait sleeps before re-checking the world (owner alive, ring
# closed).  Bounds how late a worker notices its parent died.
_POLL_S = 0.25


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
def describe(source, sid):
    """``source.describe(sid)``, or a stand-in naming the source when that fails too."""
    fn = hook(source, "describe")
    if fn is None:
        return f"sample {sid}"
    try:
        return str(fn(sid))
    except Exception as e:  # noqa: BLE001 - a custom source's describe() may be broken
        return f"<sample {sid} of {type(source).__name__}; describe() raised {e!r}>"


class _Filler:
    def __init__(self, ring: Ring, plan: Plan, source, index=None, stalled=None):
        from echo_native.source import check_labels

        self.ring, self.plan, self.source = ring, plan, source
        self.index = index            # this worker's words in the ring header
        # sample id -> why it is not read again (its read hung past sample_timeout, or
        # killed its worker repeatedly, in a predecessor): it fails with that message.
        self.stalled = stalled or {}
        self.dec = Decoder(plan.decode)
        self.epochs = _EpochCache(plan, source)
        self.labels = check_labels(source)
        self.targets = source_targets(source)   # a detection source's targets(i), or None
        record = ring.layout.record
        self.max_objects = record.max_objects
        # The object fields this record carries, each with its size (rows per object).
        self.fields = [(f, getattr(record, f.size)) for f in OBJECT_FIELDS
                       if getattr(record, f.size)]
        # A canvas (echo before augmentation) samples the source at its own scale.
        self._canvas = isinstance(plan.transform, Canvas)
        self._takes_targets = getattr(plan.transform, "takes_targets", False)
        self.current = None           # the sample being read and decoded, for error reports
        self.prefetch = hook(source, "prefetch")
        self._ahead = _takes_upcoming(self.prefetch)  # also hint the batch likely next
        self._last_ticket = None

    def _produce(self, sid, epoch, slot, i):
        """Read + decode one sample into position i of the slot, or raise _SampleFailure."""
        if sid in self.stalled:
            raise _SampleFailure(REASON_READ, describe(self.source, sid), self.stalled[sid])
        self.current = sid
        try:
            if self.index is None:
                self._read_decode(sid, epoch, slot, i)
            else:
                self.ring.set_reading(self.index, sid)
                try:
                    self._read_decode(sid, epoch, slot, i)
                finally:
                    self.ring.set_reading(self.index)
        except _SampleFailure:
            self.current = None
            raise
        self.current = None

    def _read_decode(self, sid, epoch, slot, i):
        try:
            data = self.source.read(sid)
        except StoreUnavailableError as e:
            raise _StoreDown(e) from None
        except ReadLimitError as e:
            raise _SampleFailure(REASON_LIMIT, describe(self.source, sid),
                                 f"refused: {e.strerror or e}") from None
        except OSError as e:
            raise _SampleFailure(REASON_READ, describe(self.source, sid),
                                 f"cannot read: {e.strerror or e}") from None
        except MemoryError:
            raise _SampleFailure(REASON_LIMIT, describe(self.source, sid),
                                 "out of memory reading it") from None
        except Exception:
            raise  # a bug in the source: the worker's traceback, naming the sample
        except BaseException as e:  # noqa: BLE001 - SystemExit, KeyboardInterrupt, ...
            # Raised by the source's own read() (SIGINT never reaches a worker): it would
            # end the worker, and every replacement after it, on this same sample.
            text = str(e)
            raise _SampleFailure(REASON_READ, describe(self.source, sid),
                                 f"{type(self.source).__name__}.read({sid}) raised "
                                 f"{type(e).__name__}{': ' + text if text else ''}") from None
        key = (self.plan.seed, epoch, sid, 0)
        try:
            if self.targets is None:
                self.plan.transform.apply(self.dec, data, key, slot, i)
            else:
                self._apply_with_targets(sid, data, key, slot, i)
        except (DecodeError, ValueError) as e:
            raise _SampleFailure(REASON_DECODE, describe(self.source, sid), str(e)) from None
        except MemoryError as e:
            raise _SampleFailure(REASON_LIMIT, describe(self.source, sid),
                                 f"out of memory decoding it ({e})") from None

    def _apply_with_targets(self, sid, data, key, slot, i):
        """The transform, with sample ``sid``'s targets written beside its pixels (source
        pixels: boxes follow the crop at the consumer).  Bad targets, or more objects than
        the slots hold, fail the sample (ValueError)."""
        h, w = self.dec.size(data)
        try:
            # Checked against the decoded image: boxes up to 1 px past it are clipped,
            # targets made for another size fail the sample instead of landing wrong.
            t = as_targets(self.targets(sid), f"the targets of {describe(self.source, sid)}",
                           image_hw=(h, w))
        except OSError as e:
            raise ValueError(f"cannot read its targets: {e.strerror or e}") from None
        n = len(t)
        if n > self.max_objects:
            raise _SampleFailure(REASON_LIMIT, describe(self.source, sid),
                                 f"refused: it has {n} objects, more than max_objects="
                                 f"{self.max_objects} (raise max_objects= of the EchoRing or "
                                 f"Loader)")
        slot.obj_count[i] = n
        slot.obj_boxes[i, :n] = t.boxes
        slot.obj_labels[i, :n] = t.labels
        slot.obj_flags[i, :n] = t.iscrowd.astype(np.uint8) * OBJ_CROWD
        if self._takes_targets:
            dropped = self.plan.transform.apply(self.dec, data, key, slot, i, targets=t)
            slot.obj_flags[i, :n] |= np.asarray(dropped, np.uint8) * OBJ_DROPPED
        else:
            self.plan.transform.apply(self.dec, data, key, slot, i)
        for field, size in self.fields:  # where the decode just put the image
            field.write(getattr(slot, field.column)[i, :n], t.fields.get(field.name), size,
                        window=slot.boxes[i], flip=bool(slot.flip[i]), shape=slot.shapes[i],
                        image_hw=(h, w), scale=slot.canvas_scale[i] if self._canvas else None)

    def fill(self, ticket):
        t0 = time.perf_counter()
        plan, slot = self.plan, self.ring.slots[ticket % self.ring.layout.nslots]
        epoch, ids = self.epochs.ticket(ticket)
        if self.prefetch is not None:
            # Remote sources fetch the batch's samples ahead while this thread decodes,
            # and tar shards also the blocks of the batch this worker likely fills next.
            if self._ahead:
                self.prefetch(ids, upcoming=self._upcoming(ticket))
            else:
                self.prefetch(ids)
        try:
            self._fill(ticket, t0, plan, slot, epoch, ids)
        except _StoreDown as down:
            # Not one sample's failure, whatever on_error says: the batch fails with the
            # store's name and the cause, and the consumer raises it.
            self.current = None
            self.ring.write_meta(ticket, 0, ERR_WORKER, 0, [Failure(
                NO_SAMPLE, REASON_NONE, down.error.filename or "",
                f"{down.error}. A store that cannot be reached stops the run whatever "
                f"on_error says (it is not one bad sample): check the endpoint, the network "
                f"and the storage_options, or raise RemoteOptions.retry_timeout to wait "
                f"longer for it")])

    def _fill(self, ticket, t0, plan, slot, epoch, ids):
        count, failures, warned, records = 0, 0, 0, []
        for sid in ids:
            sid = int(sid)
            try:
                self._produce(sid, epoch, slot, count)
                warned += self.dec.harmless_warnings > 0
                status, used = OK, sid
            except _SampleFailure as f:
                failures += 1
                slot.reason[count] = f.reason
                records.append(Failure(sid, f.reason, f.path, f.message))
                if plan.on_error == "raise":
                    self.ring.write_meta(ticket, count, ERR_DECODE, failures, records)
                    return
                if plan.on_error == "skip":
                    continue
                used = self._replace(epoch, sid, slot, count)
                if used is None:  # every stand-in failed too: the batch is one shorter
                    records[-1] = dataclasses.replace(records[-1], dropped=True)
                    continue
                status = REPLACED
            slot.labels[count] = self.labels[used]
            slot.sample_ids[count] = used
            slot.status[count] = status
            if status == OK:
                slot.reason[count] = 0
            count += 1
        self.ring.write_meta(ticket, count, ERR_NONE, failures, records,
                             time.perf_counter() - t0, warned)

    def _upcoming(self, ticket):
        """The samples of the ticket this worker will likely take next (its last stride
        of tickets on), or none when that is in another epoch."""
        last, self._last_ticket = self._last_ticket, ticket
        stride = ticket - last if last is not None and 0 < ticket - last <= 256 else 1
        bpe = self.plan.batches_per_epoch
        if (ticket + stride) // bpe != ticket // bpe:
            return ()
        return self.epochs.ticket(ticket + stride)[1]

    def _replace(self, epoch, sid, slot, i):
        for attempt in range(_MAX_REPLACEMENTS):
            rid = self.plan.replacement(epoch, sid, attempt)
            try:
                self._produce(rid, epoch, slot, i)
                return rid
            except _SampleFailure:
                continue
        return None


def _takes_upcoming(prefetch):
    """Whether a source's ``prefetch`` hook takes ``upcoming=`` (the built-in ones do)."""
    if prefetch is None:
        return False
    import inspect

    try:
        return "upcoming" in inspect.signature(prefetch).parameters
    except (TypeError, ValueError):
        return False


class _SampleFailure(Exception):
    def __init__(self, reason, path, message):
        super().__init__(message)
        self.reason, self.path, self.message = reason, path, message


class _StoreDown(Exception):
    """The source's store is unreachable: not a sample failure (see fill())."""

    def __init__(self, error):
        super().__init__(str(error))
        self.error = error


# ---- the worker loop --------------------------------------------------------------
def run_worker(ring, index, plan, source, redo=(), owner_pid=None, stop=None, stalled=None):
    """Claim tickets and fill slots until the ring closes or its owner dies.

    ``redo`` lists tickets a dead predecessor left unfinished; they come first.
    The claim word says which ticket this worker holds, so the supervisor can
    tell which ones a crash lost.  ``stalled`` maps samples that hung or killed a
    predecessor to why: they fail with that message without being read again.
    """
    try:
        filler, unusable = _Filler(ring, plan, source, index, stalled), None
    except Exception as e:  # noqa: BLE001 - e.g. labels that are not 64-bit integers
        # Dying here would only start a replacement that dies the same way: every
        # ticket this worker takes fails instead, with the reason, for the consumer.
        filler, unusable = None, f"{type(e).__name__}: {e}"
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
            if rc == WAIT_OK:
                break
            if rc == WAIT_CLOSED or (stop is not None and stop.is_set()):
                return
            if owner_pid is not None and not pid_alive(owner_pid):
                _orphaned(ring)
                return
            if ring.is_past(ticket):
                break
        if rc != WAIT_OK:
            # Filled by another worker: a ticket re-issued after a crash whose first
            # fill landed after all.  Filling it again would corrupt the next lap.
            ring.set_claim(index, 0)
            continue
        try:
            if unusable is not None:
                ring.write_meta(ticket, 0, ERR_WORKER, 0, [Failure(
                    NO_SAMPLE, REASON_NONE, "", f"worker {index} (pid {os.getpid()}) cannot "
                                                f"use the source: {unusable}")])
            else:
                filler.fill(ticket)
        except Exception:
            # No sample's failure: one record with no sample id, carrying the traceback
            # and the sample it happened on.
            sid, where = filler.current, ""
            if sid is not None:
                where = f" on sample {sid} ({describe(source, sid)})"
            ring.write_meta(ticket, 0, ERR_WORKER, 0, [Failure(
                NO_SAMPLE, REASON_NONE, "",
                f"worker {index} (pid {os.getpid()}){where}:\n{traceback.format_exc()}")])
        ring.publish(ticket)
        ring.set_claim(index, 0)


def _orphaned(ring):
    # The consumer died without closing (SIGKILL, OOM).  A memfd ring has no
    # name: its memory goes when the last worker holding it exits, which the
    # caller is about to do.  A named ring (the /dev/shm fallback) would stay:
    # nobody else will remove it, so the first worker to notice does.
    if ring.backing != "shm":
        return
    try:
        ring.unlink()
    except OSError:
        pass


# ---- the worker process -----------------------------------------------------------
def worker_main():
    """Entry point of a worker process (``python -c``): read the job, fill slots."""
    # Ctrl-C is the consumer's to handle (a training loop may catch it and go
    # on); a worker stops when the ring closes or its owner is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stdin = sys.stdin.buffer
    sys.path[:] = pickle.load(stdin)
    handle, index, redo, owner_pid, job, stalled = pickle.load(stdin)
    _die_with(owner_pid)
    # Maps the ring and closes the inherited descriptor: the mapping alone
    # holds the memory, and goes with this process.
    ring = Ring.from_handle(handle)
    plan, source = pickle.loads(job)
    run_worker(ring, index, plan, source, redo, owner_pid, stalled=stalled)


def _die_with(owner_pid):
    """Have the kernel SIGKILL this worker when its consumer dies.

    A worker notices a dead owner between samples (it polls), but not while a
    read is blocked in the kernel; the parent-death signal reaches it there too.
    Linux only; elsewhere the polling remains."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != owner_pid:  # it died before the signal was armed
        os._exit(0)

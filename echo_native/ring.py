"""Stage 2 of the pipeline: the shared-memory ring of batch slots.

Workers decode straight into a slot; the consumer reads the same bytes
through NumPy views, so a batch crosses the process boundary without a copy.

The memory is an anonymous memory file (``memfd_create``): no name in
``/dev/shm``, nothing to sweep or leak, not bounded by the size of the
``/dev/shm`` mount.  Worker processes receive it as a file descriptor, and it
is freed when the last process holding it (descriptor or mapping) is gone,
however they end.  Every page is reserved when the ring is created, after a
check against the memory available, so a ring that does not fit fails at
:meth:`Ring.create` with :class:`RingMemoryError` and never later with SIGBUS.
Where ``memfd_create`` is unavailable (``ENOSYS``), or when the environment
says ``ECHO_NATIVE_RING_BACKING=shm``, the ring is a named POSIX
shared-memory object in ``/dev/shm`` instead (see
:func:`echo_native.memory.remove_stale_segments`).

The hand-off protocol (tickets, one sequence word per slot, futex sleep) and
the byte layout of the segment are defined once, in C, in
``src/ring/en_ring.h``; this module reads every offset from the compiled
module and names things.

Segment layout (slots start page-aligned)::

    header  en_ring_header: magic, version, geometry, closed flag, next ticket,
            per-worker claims (MAX_WORKERS of them)
    slot 0  en_ring_slot: seq | count | ticket | error kind | failures | fill time | warned
            | failure records (REPORT_BYTES)
            labels i64[B] | sample ids i64[B] | status u8[B] | reason u8[B]
            flip u8[B] | boxes f32[B, 4] | image shape i32[B, 2] | source shape i32[B, 2]
            canvas scale f32[B, 2] | object count u16[B] | object boxes f32[B, M, 4]
            object labels i64[B, M] | object flags u8[B, M] | keypoints f32[B, M, K, 3]
            | masks u8[B, M, Q] | (page) pixels u8[B, S]
    slot 1  ...

``S`` is the bytes reserved per sample: H*W*3 for final crops, or a canvas
budget when echoing before augmentation.  For a canvas, "source shape" is the
original image size and "canvas scale" maps canvas pixels to original pixels
(original = canvas * scale), so every echo can draw its crop in the
original's coordinates.  ``M``, ``K`` and ``Q`` are the record's sizes
(:class:`Record`, from the row kinds of ``en_ring.h``): ``M`` is ``max_objects``,
the object slots of a detection sample (0 without targets), with their boxes, xyxy
in the original's pixels, labels and flags (``OBJ_CROWD``, ``OBJ_DROPPED``), whatever
crop the worker drew (boxes follow crops at the consumer: :mod:`echo_native.boxes`);
``K`` keypoints and ``Q`` mask bytes per object (:mod:`echo_native.targets`).

Failed samples travel as binary, length-prefixed records
(:mod:`echo_native.failures`); what a ring may take of the machine's memory,
and the ``/dev/shm`` fallback's names, are :mod:`echo_native.memory`.
"""
from __future__ import annotations

import errno
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from echo_native import _ring
from echo_native.failures import decode_failures, encode_failures
from echo_native.memory import (BACKING_ENV, PREFIX, MemoryBudget, _check_budget, _shm_name,
                                _too_big, remove_stale_segments)

PAGE = _ring.PAGE
MAGIC = _ring.MAGIC
VERSION = _ring.VERSION
#: Worker indexes run from 0 to MAX_WORKERS - 1 (one claim word each in the header).
MAX_WORKERS = _ring.MAX_WORKERS
REPORT_BYTES = _ring.REPORT_BYTES
HEADER_BYTES = _ring.HEADER_BYTES
#: Ring names that begin so are memfd rings: ``/memfd:echo_native-<pid>-<hex>``, what
#: ``/proc/<pid>/fd`` and ``/proc/<pid>/maps`` show for them.
MEMFD_PREFIX = _ring.MEMFD_PREFIX

#: Claim word value while a worker is between taking a ticket and recording it.
CLAIM_PENDING = _ring.CLAIM_PENDING

#: What a wait on a slot's word returns: the word came, the timeout passed, or the ring
#: is closing.
WAIT_OK, WAIT_TIMEOUT, WAIT_CLOSED = _ring.WAIT_OK, _ring.WAIT_TIMEOUT, _ring.WAIT_CLOSED

# Slot error kinds.
ERR_NONE, ERR_WORKER, ERR_DECODE = _ring.ERR_NONE, _ring.ERR_WORKER, _ring.ERR_DECODE

# Per-sample status.
OK, REPLACED, SKIPPED = _ring.STATUS_OK, _ring.STATUS_REPLACED, _ring.STATUS_SKIPPED
# Per-object flag bits; the most objects a sample's slots may hold.
OBJ_CROWD, OBJ_DROPPED, MAX_OBJECTS = _ring.OBJ_CROWD, _ring.OBJ_DROPPED, _ring.MAX_OBJECTS
MAX_KEYPOINTS = _ring.MAX_KEYPOINTS
# Per-sample failure reasons (stats key names).
REASON_NONE, REASON_DECODE = _ring.REASON_NONE, _ring.REASON_DECODE
REASON_READ, REASON_LIMIT = _ring.REASON_READ, _ring.REASON_LIMIT

_H = {name: f[0] for name, f in _ring.HEADER_FIELDS.items()}   # header field offsets
_S = {name: f[0] for name, f in _ring.SLOT_FIELDS.items()}     # slot field offsets


def _dtype(fields, itemsize, skip=()):
    """A structured dtype over a C struct, from its field table (native-endian)."""
    names = [n for n in fields if n not in skip]
    formats = [f"=u{fields[n][2]}" if fields[n][1] == fields[n][2]
               else (f"=u{fields[n][2]}", fields[n][1] // fields[n][2]) for n in names]
    return np.dtype({"names": names, "formats": formats,
                     "offsets": [fields[n][0] for n in names], "itemsize": itemsize})


# The slot's metadata words (the report bytes are read through SlotView.report_area).
_SLOT_META = _dtype(_ring.SLOT_FIELDS, _ring.SLOT_HEADER_BYTES, skip=("report",))


def _saturate(name, value):
    """value, capped at what the slot's field ``name`` holds."""
    return min(value, int(np.iinfo(_SLOT_META[name]).max))


# ---- layout -----------------------------------------------------------------------------
#: A sample's record in a slot, the one definition (EN_RING_COLUMNS in en_ring.h):
#: ``(name, dtype, rows, width)`` per column, in slot order; ``rows`` is "sample" (a row
#: per sample) or a kind of :data:`ROW_KINDS`, ``width`` a row's elements.
COLUMNS = _ring.COLUMNS

#: The record's row kinds beyond a row per sample (EN_RING_ROW_KINDS in en_ring.h):
#: ``(kind, parent, size, limit)``: a column of ``kind`` ("object", "keypoint", "mask")
#: has ``size`` rows (``max_objects``, ``max_keypoints``, ``mask_bytes``) per row of
#: its ``parent`` kind.
ROW_KINDS = _ring.ROW_KINDS
_SIZES = tuple(size for _, _, size, _ in ROW_KINDS)


class Record:
    """The sizes of a sample's record: for each row kind of :data:`ROW_KINDS`, its rows
    per row of its parent, 0 where the record does not carry the kind.

    ``Record(max_objects=128, max_keypoints=17)``; ``record.max_objects``.  One value
    travels whole from the loader to the ring's layout, the workers and the echo
    buffer, so that a new kind of row is a line of the C table, not a parameter of
    each of them.  Hashable; ``Record()`` is a record of per-sample columns only."""

    __slots__ = ("sizes",)

    def __init__(self, **sizes):
        unknown = sorted(set(sizes) - set(_SIZES))
        if unknown:
            raise TypeError(f"unknown record sizes {unknown}: a record has {list(_SIZES)}")
        object.__setattr__(self, "sizes", tuple(int(sizes.get(n, 0)) for n in _SIZES))

    def __getattr__(self, name):
        try:
            return self.sizes[_SIZES.index(name)]
        except ValueError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        raise AttributeError("a Record is read-only")

    def __reduce__(self):
        return _record, (self.as_dict(),)

    def __eq__(self, other):
        return isinstance(other, Record) and self.sizes == other.sizes

    def __hash__(self):
        return hash(self.sizes)

    def __repr__(self):
        return f"Record({', '.join(f'{n}={v}' for n, v in self.as_dict().items() if v)})"

    def as_dict(self):
        return dict(zip(_SIZES, self.sizes))

    def rows(self, samples):
        """Each row kind's shape for ``samples`` samples: ``{"sample": (samples,),
        "object": (samples, max_objects), "keypoint": (samples, max_objects,
        max_keypoints), ...}``."""
        out = {"sample": (int(samples),)}
        for (kind, parent, _, _), size in zip(ROW_KINDS, self.sizes):
            out[kind] = out[parent] + (size,)
        return out

    def shape(self, rows, width, samples):
        """The shape of a column of ``rows`` and ``width`` for ``samples`` samples."""
        return self.rows(samples)[rows] + ((width,) if width > 1 else ())

    def nbytes(self):
        """The bytes of one sample's record (every column of :data:`COLUMNS`), without
        its pixels: what an echo buffer keeps per entry besides them."""
        return sum(int(np.prod(self.shape(rows, width, 1))) * np.dtype(dtype).itemsize
                   for _, dtype, rows, width in COLUMNS)


def _record(sizes):
    return Record(**sizes)


def _offset(name):
    return property(lambda self: self._c[name], doc=f"byte offset of {name} (see en_ring.h)")


@dataclass(frozen=True)
class Layout:
    """Byte offsets of one slot for a batch size and per-sample pixel budget,
    as ``en_ring_compute_layout`` places them (ValueError for a geometry it refuses)."""

    nslots: int
    batch_size: int
    sample_bytes: int
    record: Record = Record()
    _c: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_c", _ring.layout(self.nslots, self.batch_size,
                                                    self.sample_bytes,
                                                    **self.record.as_dict()))

    # The offset in a slot of each column of COLUMNS (an attribute of its name, set
    # below), of the pixels (u8[B, sample_bytes], page-aligned); and the bytes of a slot
    # (a page multiple) and of the whole segment.
    pixels, slot_bytes, total_bytes = map(_offset, ("pixels", "slot_bytes", "total_bytes"))

    def slot(self, i):
        return HEADER_BYTES + (i % self.nslots) * self.slot_bytes

    def column_shape(self, rows, width):
        """The shape of a column's array in one slot: (B,), (B, max_objects), (B,
        max_objects, max_keypoints), ... by its rows, and the row's width when it is
        more than one element."""
        return self.record.shape(rows, width, self.batch_size)


for _name, *_ in COLUMNS:
    setattr(Layout, _name, _offset(_name))


class Meta(NamedTuple):
    """What a published slot says besides its arrays (see :meth:`Ring.read_meta`)."""

    count: int
    error: int
    failures: int          # samples that failed, named in ``records`` or not
    records: list          # list[Failure], as many as fit the slot's report area


def _backing(backing):
    choice = (backing or os.environ.get(BACKING_ENV) or "auto").strip().lower()
    if choice not in ("auto", "memfd", "shm"):
        raise ValueError(f"ring backing must be 'auto', 'memfd' or 'shm' ({BACKING_ENV}), "
                         f"got {choice!r}")
    return choice


#: errno values that mean "no memfd_create here": an old kernel, or a seccomp filter.
_NO_MEMFD = (errno.ENOSYS, errno.EPERM)
#: errno values that mean "the memory cannot be reserved".
_NO_ROOM = (errno.ENOMEM, errno.ENOSPC, errno.EFBIG)


def _memfd_segment(label, size):
    return _ring.Segment.memfd(label, size)


class SlotView:
    """Zero-copy NumPy views of one slot's arrays."""

    def __init__(self, buf, layout: Layout, index: int):
        b, B, base = buf, layout.batch_size, layout.slot(index)
        self.base = base
        # One view per column of the record (COLUMNS), named as in C.
        for name, dtype, rows, width in COLUMNS:
            shape = layout.column_shape(rows, width)
            setattr(self, name, np.frombuffer(b, dtype, int(np.prod(shape)),
                                              base + getattr(layout, name)).reshape(shape))
        self.pixels = np.frombuffer(b, np.uint8, layout.sample_bytes * B,
                                    base + layout.pixels).reshape(B, layout.sample_bytes)
        self.report_area = np.frombuffer(b, np.uint8, REPORT_BYTES, base + _S["report"])
        # One structured view, so each metadata word is addressed by its C name.
        self.meta = np.ndarray((), _SLOT_META, b, base)


class Ring:
    """A ring of ``nslots`` batch slots in shared memory (a memfd; see the module).

    Create it in the consumer with :meth:`create`.  Worker processes get it with
    :meth:`handle` / :meth:`from_handle` (a memfd travels as a descriptor, so
    ``subprocess.Popen(pass_fds=...)``); a pickled Ring attaches by :attr:`name`
    (a memfd ring's is found among its creator's descriptors, so only while the
    creator holds it, by its user).  Only the creator lets go of it
    (:meth:`unlink`); views into it stay valid until they are dropped.
    """

    def __init__(self, segment, layout: Layout):
        self.segment = segment
        self.layout = layout
        self.buf = memoryview(segment)
        self.slots = [SlotView(self.buf, layout, i) for i in range(layout.nslots)]

    # -- life cycle ------------------------------------------------------------
    @classmethod
    def create(cls, nslots, batch_size, sample_bytes, first_ticket=0, backing=None, *,
               budget=None, record=Record()):
        """A new ring, every page reserved.

        ``record``: the sizes of a sample's record (:class:`Record`): object slots per
        sample for sources with detection targets, keypoints per object, ...

        ``backing``: "memfd", "shm" (a named segment in /dev/shm) or "auto" (memfd
        where the kernel has it); default: ``$ECHO_NATIVE_RING_BACKING``, else "auto".
        ``budget``: a :class:`MemoryBudget` of what the pipeline adds besides the
        ring (worker processes, the consumer, an echo buffer), checked with it;
        default: the ring alone.
        ValueError for a geometry that cannot exist, :class:`RingMemoryError` (a
        MemoryError) for one that does not fit the memory available, checked before
        anything is allocated.
        """
        if nslots < 2:
            raise ValueError(f"a ring needs at least 2 slots, got {nslots}")
        if budget is None:
            budget = MemoryBudget()
        elif not isinstance(budget, MemoryBudget):
            raise TypeError(f"budget must be a MemoryBudget, got {budget!r}")
        choice = _backing(backing)
        if not isinstance(record, Record):
            raise TypeError(f"record must be a Record, got {record!r}")
        layout = Layout(int(nslots), int(batch_size), int(sample_bytes), record)
        seg = None
        if choice != "shm":
            available, where = _check_budget(layout, budget, "memfd")
            label = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
            try:
                seg = _memfd_segment(label, layout.total_bytes)
            except OSError as e:
                if e.errno in _NO_ROOM:
                    raise _too_big(layout, "memfd", available, where,
                                   e.strerror or str(e), budget) from None
                if choice == "memfd" or e.errno not in _NO_MEMFD:
                    raise
        if seg is None:
            remove_stale_segments()  # first: what it frees counts as available
            available, where = _check_budget(layout, budget, "shm")
            try:
                seg = _ring.Segment(_shm_name(), layout.total_bytes, create=True)
            except OSError as e:
                if e.errno in _NO_ROOM:
                    raise _too_big(layout, "shm", available, where,
                                   e.strerror or str(e), budget) from None
                raise
        try:
            seg.ring_init(layout.nslots, layout.batch_size, layout.sample_bytes,
                          first_ticket, os.getpid(), **layout.record.as_dict())
        except BaseException:
            seg.unlink()
            raise
        return cls(seg, layout)

    @classmethod
    def attach(cls, name):
        """Attach by name: ``/echo_native-...`` (named) or ``/memfd:echo_native-...``."""
        return cls._checked(_ring.Segment(name), name)

    @classmethod
    def _checked(cls, seg, name):
        try:
            c = seg.ring_check()
        except ValueError as e:
            raise ValueError(f"shared memory {name} is not an echo_native ring this build "
                             f"can read: {e}") from None
        return cls(seg, Layout(c["nslots"], c["batch"], c["sample_bytes"],
                               Record(**c["record"])))

    def handle(self):
        """How a child process reaches this ring: ``("fd", fd, name)`` for a memfd (the
        child must inherit ``fd``: ``Popen(pass_fds=(fd,))``), ``("name", name)`` for a
        named segment.  Picklable; give it to :meth:`from_handle` in the child."""
        if self.backing == "memfd":
            if self.segment.fd < 0:
                raise ValueError(f"ring {self.name} has no descriptor to pass: only its "
                                 f"creator does, until unlink()")
            return ("fd", self.segment.fd, self.name)
        return ("name", self.name)

    @classmethod
    def from_handle(cls, handle):
        """The ring of a :meth:`handle`, in the process that received it; an inherited
        descriptor is closed once mapped (the mapping keeps the memory)."""
        if handle[0] == "fd":
            _, fd, name = handle
            return cls._checked(_ring.Segment.from_fd(int(fd), name), name)
        return cls.attach(handle[1])

    def __reduce__(self):
        return (Ring.attach, (self.name,))

    @property
    def name(self):
        """``/memfd:echo_native-<pid>-<hex>`` (memfd: how /proc shows it) or
        ``/echo_native-<pid>-<pid-ns>-<boot id>-<hex>`` (a file in /dev/shm)."""
        return self.segment.name

    @property
    def backing(self):
        """Either "memfd" or "shm"."""
        return self.segment.backing

    def unlink(self):
        """The creator lets go: a named segment's name is removed, a memfd's descriptor
        closed.  The memory goes when the last mapping does (views stay valid)."""
        self.segment.unlink()

    # -- header words ------------------------------------------------------------
    @property
    def closed(self):
        return self.segment.seq_load(_H["closed"]) != 0

    def close(self):
        """Tell every waiter the ring is closing and wake them all."""
        self.segment.seq_publish(_H["closed"], 1)
        for i in range(self.layout.nslots):
            self.segment.wake(self.layout.slot(i) + _S["seq"])

    @property
    def next_ticket(self):
        return self.segment.load64(_H["next_ticket"])

    def take_ticket(self):
        return self.segment.ticket_take(_H["next_ticket"])

    def claim(self, worker):
        """Worker ``worker``'s claim word; ValueError unless 0 <= worker < MAX_WORKERS."""
        return self.segment.claim_load(worker)

    def set_claim(self, worker, value):
        self.segment.claim_store(worker, value)

    def reading(self, worker):
        """``(sample id, seconds so far)`` that worker ``worker`` is reading and decoding,
        or None between samples."""
        sid1, since_ms = self.segment.reading_load(worker)
        if not sid1:
            return None
        return sid1 - 1, max(0.0, time.monotonic() - since_ms / 1000.0)

    def set_reading(self, worker, sample_id=None):
        """Worker side: now reading ``sample_id`` (None: done with it)."""
        if sample_id is None:
            self.segment.reading_store(worker, 0, 0)  # the id only: the time stays
        else:
            self.segment.reading_store(worker, sample_id + 1, int(time.monotonic() * 1000))

    # -- slot words --------------------------------------------------------------
    def seq(self, ticket):
        return self.segment.seq_load(self.layout.slot(ticket) + _S["seq"])

    def is_published(self, ticket):
        return self.seq(ticket) == _ring.seq_filled(ticket)

    def is_past(self, ticket):
        """True once ``ticket`` is filled in its slot, or consumed and the slot handed on:
        whoever still holds it must not fill it again (the words wrap modulo 2**32)."""
        ahead = (self.seq(ticket) - _ring.seq_free(ticket)) % 2**32
        return 0 < ahead < 2**31

    def wait_free(self, ticket, timeout):
        """Producer side: sleep until the slot of ``ticket`` is free for it."""
        return self.segment.seq_wait(self.layout.slot(ticket) + _S["seq"],
                                     _ring.seq_free(ticket), _H["closed"], timeout)

    def wait_filled(self, ticket, timeout):
        """Consumer side: sleep until ``ticket`` is published in its slot."""
        return self.segment.seq_wait(self.layout.slot(ticket) + _S["seq"],
                                     _ring.seq_filled(ticket), _H["closed"], timeout)

    def publish(self, ticket):
        self.segment.seq_publish(self.layout.slot(ticket) + _S["seq"], _ring.seq_filled(ticket))

    def release(self, ticket):
        """Consumer side: hand the slot of ``ticket`` to ticket + nslots."""
        self.segment.seq_publish(self.layout.slot(ticket) + _S["seq"],
                                 _ring.seq_free(ticket + self.layout.nslots))

    def write_meta(self, ticket, count, error, failures_total, records=(), fill_s=0.0,
                   warned=0):
        """Producer side: the slot's count, error kind, failure total and records
        (Failure objects; those that do not fit the report area are dropped
        whole, the total still counts them), and how many of its samples decoded
        with harmless warnings.  Returns how many records were dropped."""
        slot = self.slots[ticket % self.layout.nslots]
        data, dropped = encode_failures(records, REPORT_BYTES)
        meta = slot.meta
        meta["fill_us"] = _saturate("fill_us", int(fill_s * 1e6))
        meta["count"] = count
        meta["error"] = error
        meta["failures"] = _saturate("failures", int(failures_total))
        meta["warned"] = _saturate("warned", int(warned))
        meta["report_len"] = len(data)
        meta["ticket"] = ticket
        slot.report_area[:len(data)] = np.frombuffer(data, np.uint8)
        return dropped

    def fill_seconds(self, ticket):
        """Time the worker spent filling this ticket's slot."""
        return int(self.slots[ticket % self.layout.nslots].meta["fill_us"]) * 1e-6

    def warned(self, ticket):
        """Samples of this ticket's slot accepted with harmless decoder warnings."""
        return int(self.slots[ticket % self.layout.nslots].meta["warned"])

    def read_meta(self, ticket):
        """Consumer side: :class:`Meta` (count, error kind, failure total, records)
        of a published slot."""
        slot = self.slots[ticket % self.layout.nslots]
        meta = slot.meta
        n = min(int(meta["report_len"]), REPORT_BYTES)
        return Meta(int(meta["count"]), int(meta["error"]), int(meta["failures"]),
                    decode_failures(slot.report_area[:n]))

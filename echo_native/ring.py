"""Stage 2 of the pipeline: the shared-memory ring of batch slots.

Workers decode straight into a slot; the consumer reads the same bytes
through NumPy views, so a batch crosses the process boundary without a copy.
The hand-off protocol (tickets, one sequence word per slot, futex sleep) is in
``src/ring/en_ring.h``; this module fixes the byte layout and names things.

Segment layout (all offsets in bytes; slots start page-aligned)::

    header  magic, geometry, closed flag, next ticket, per-worker claims
    slot 0  seq | count | ticket | error kind | failures | report text
            labels i64[B] | sample ids i64[B] | status u8[B] | reason u8[B]
            flip u8[B] | boxes f32[B, 4] | image shape u16[B, 2] | source shape i32[B, 2]
            canvas scale f32[B, 2] | (page) pixels u8[B, S]
    slot 1  ...

``S`` is the bytes reserved per sample: H*W*3 for final crops, or a canvas
budget when echoing before augmentation.  For a canvas, "source shape" is the
original image size and "canvas scale" maps canvas pixels to original pixels
(original = canvas * scale), so every echo can draw its crop in the
original's coordinates.
"""
from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass

import numpy as np

from echo_native import _ring

PAGE = 4096
MAGIC = 0x31474E4952484345  # "ECHRING1"
MAX_WORKERS = 64
REPORT_BYTES = 4096
PREFIX = "echo_native-"

# Header fields.
_H_MAGIC, _H_NSLOTS, _H_BATCH, _H_SAMPLE_BYTES = 0, 8, 12, 16
_H_SLOT_BYTES, _H_OWNER, _H_CLOSED, _H_NEXT_TICKET = 24, 32, 36, 40
_H_CLAIMS = 64
HEADER_BYTES = PAGE  # _H_CLAIMS + 8 * MAX_WORKERS fits with room to spare

# Per-slot fields.
_S_SEQ, _S_COUNT, _S_TICKET, _S_ERROR, _S_FAILURES, _S_REPORT_LEN = 0, 4, 8, 16, 20, 24
_S_FILL_US = 28  # microseconds the worker spent filling the slot (upstream cost)
_S_REPORT = 64

#: Claim word value while a worker is between taking a ticket and recording it.
CLAIM_PENDING = 2**64 - 1

# Slot error kinds.
ERR_NONE, ERR_WORKER, ERR_DECODE = 0, 1, 2

# Per-sample status.
OK, REPLACED, SKIPPED = 0, 1, 2
# Per-sample failure reasons (stats key names).
REASONS = {0: "none", 1: "decode", 2: "read", 3: "limit"}


def _align(n, a):
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Layout:
    """Byte offsets of one slot for a batch size and per-sample pixel budget."""

    nslots: int
    batch_size: int
    sample_bytes: int

    @property
    def labels(self):
        return _S_REPORT + REPORT_BYTES

    @property
    def sample_ids(self):
        return self.labels + 8 * self.batch_size

    @property
    def status(self):
        return self.sample_ids + 8 * self.batch_size

    @property
    def reason(self):
        return self.status + self.batch_size

    @property
    def flip(self):
        return self.reason + self.batch_size

    @property
    def boxes(self):
        return _align(self.flip + self.batch_size, 16)

    @property
    def shapes(self):
        return self.boxes + 16 * self.batch_size

    @property
    def source_hw(self):
        return _align(self.shapes + 4 * self.batch_size, 8)

    @property
    def canvas_scale(self):
        return self.source_hw + 8 * self.batch_size

    @property
    def pixels(self):
        return _align(self.canvas_scale + 8 * self.batch_size, PAGE)

    @property
    def slot_bytes(self):
        return _align(self.pixels + self.sample_bytes * self.batch_size, PAGE)

    @property
    def total_bytes(self):
        return HEADER_BYTES + self.nslots * self.slot_bytes

    def slot(self, i):
        return HEADER_BYTES + (i % self.nslots) * self.slot_bytes


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    # A killed process stays a zombie until its parent reaps it, and kill(0)
    # still succeeds on a zombie: it is dead all the same (its workers must not
    # wait for it to be reaped, nor its segments survive).
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        return True  # no /proc to ask: trust kill(0)
    return state not in (b"Z", b"X")


def remove_stale_segments(shm_dir="/dev/shm"):
    """Unlink ring segments whose owning process is gone (e.g. it was SIGKILLed).

    Returns the names removed.  Called whenever a new ring is created.
    """
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        m = re.fullmatch(re.escape(PREFIX) + r"(\d+)-[0-9a-f]+", name)
        if m and not _pid_alive(int(m.group(1))):
            _ring.unlink("/" + name)
            removed.append(name)
    return removed


class SlotView:
    """Zero-copy NumPy views of one slot's arrays."""

    def __init__(self, buf, layout: Layout, index: int):
        b, B, base = buf, layout.batch_size, layout.slot(index)
        self.base = base
        self.labels = np.frombuffer(b, np.int64, B, base + layout.labels)
        self.sample_ids = np.frombuffer(b, np.int64, B, base + layout.sample_ids)
        self.status = np.frombuffer(b, np.uint8, B, base + layout.status)
        self.reason = np.frombuffer(b, np.uint8, B, base + layout.reason)
        self.flip = np.frombuffer(b, np.uint8, B, base + layout.flip)
        self.boxes = np.frombuffer(b, np.float32, 4 * B, base + layout.boxes).reshape(B, 4)
        self.shapes = np.frombuffer(b, np.uint16, 2 * B, base + layout.shapes).reshape(B, 2)
        self.source_hw = np.frombuffer(b, np.int32, 2 * B, base + layout.source_hw).reshape(B, 2)
        self.canvas_scale = np.frombuffer(b, np.float32, 2 * B,
                                          base + layout.canvas_scale).reshape(B, 2)
        self.pixels = np.frombuffer(b, np.uint8, layout.sample_bytes * B,
                                    base + layout.pixels).reshape(B, layout.sample_bytes)
        self.report_area = np.frombuffer(b, np.uint8, REPORT_BYTES, base + _S_REPORT)


class Ring:
    """A ring of ``nslots`` batch slots in POSIX shared memory.

    Create it in the consumer with :meth:`create`; it pickles by name only and
    each worker attaches lazily on unpickling.  Only the creator unlinks the
    name (:meth:`unlink`); views into it stay valid until they are dropped.
    """

    def __init__(self, segment, layout: Layout):
        self.segment = segment
        self.layout = layout
        self.buf = memoryview(segment)
        self.slots = [SlotView(self.buf, layout, i) for i in range(layout.nslots)]

    # -- life cycle ------------------------------------------------------------
    @classmethod
    def create(cls, nslots, batch_size, sample_bytes, first_ticket=0):
        if nslots < 2:
            raise ValueError(f"a ring needs at least 2 slots, got {nslots}")
        remove_stale_segments()
        layout = Layout(int(nslots), int(batch_size), int(sample_bytes))
        name = f"/{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        seg = _ring.Segment(name, layout.total_bytes, create=True)
        head = np.frombuffer(seg, np.uint64, 8, 0)
        head[0] = MAGIC
        words = np.frombuffer(seg, np.uint32, 16, 0)
        words[_H_NSLOTS // 4] = layout.nslots
        words[_H_BATCH // 4] = layout.batch_size
        words[_H_OWNER // 4] = os.getpid()
        head[_H_SAMPLE_BYTES // 8] = layout.sample_bytes
        head[_H_SLOT_BYTES // 8] = layout.slot_bytes
        ring = cls(seg, layout)
        head[_H_NEXT_TICKET // 8] = first_ticket
        for t in range(first_ticket, first_ticket + layout.nslots):  # each slot free for its ticket
            seg.seq_publish(layout.slot(t) + _S_SEQ, (2 * t) & 0xFFFFFFFF)
        return ring

    @classmethod
    def attach(cls, name):
        seg = _ring.Segment(name)
        if seg.size < HEADER_BYTES or np.frombuffer(seg, np.uint64, 1, 0)[0] != MAGIC:
            raise ValueError(f"shared memory {name} is not an echo_native ring")
        words = np.frombuffer(seg, np.uint32, 16, 0)
        sample_bytes = int(np.frombuffer(seg, np.uint64, 8, 0)[_H_SAMPLE_BYTES // 8])
        layout = Layout(int(words[_H_NSLOTS // 4]), int(words[_H_BATCH // 4]), sample_bytes)
        return cls(seg, layout)

    def __reduce__(self):
        return (Ring.attach, (self.name,))

    @property
    def name(self):
        return self.segment.name

    def unlink(self):
        self.segment.unlink()

    # -- header words ------------------------------------------------------------
    @property
    def closed(self):
        return self.segment.seq_load(_H_CLOSED) != 0

    def close(self):
        """Tell every waiter the ring is closing and wake them all."""
        self.segment.seq_publish(_H_CLOSED, 1)
        for i in range(self.layout.nslots):
            self.segment.wake(self.layout.slot(i) + _S_SEQ)

    @property
    def next_ticket(self):
        return self.segment.load64(_H_NEXT_TICKET)

    def take_ticket(self):
        return self.segment.ticket_take(_H_NEXT_TICKET)

    def claim(self, worker):
        return self.segment.load64(_H_CLAIMS + 8 * worker)

    def set_claim(self, worker, value):
        self.segment.store64(_H_CLAIMS + 8 * worker, value)

    # -- slot words --------------------------------------------------------------
    def seq(self, ticket):
        return self.segment.seq_load(self.layout.slot(ticket) + _S_SEQ)

    def is_published(self, ticket):
        return self.seq(ticket) == (2 * ticket + 1) & 0xFFFFFFFF

    def wait_free(self, ticket, timeout):
        """Producer side: sleep until the slot of ``ticket`` is free for it."""
        return self.segment.seq_wait(self.layout.slot(ticket) + _S_SEQ,
                                     (2 * ticket) & 0xFFFFFFFF, _H_CLOSED, timeout)

    def wait_filled(self, ticket, timeout):
        """Consumer side: sleep until ``ticket`` is published in its slot."""
        return self.segment.seq_wait(self.layout.slot(ticket) + _S_SEQ,
                                     (2 * ticket + 1) & 0xFFFFFFFF, _H_CLOSED, timeout)

    def publish(self, ticket):
        self.segment.seq_publish(self.layout.slot(ticket) + _S_SEQ, (2 * ticket + 1) & 0xFFFFFFFF)

    def release(self, ticket):
        """Consumer side: hand the slot of ``ticket`` to ticket + nslots."""
        nxt = ticket + self.layout.nslots
        self.segment.seq_publish(self.layout.slot(ticket) + _S_SEQ, (2 * nxt) & 0xFFFFFFFF)

    def _slot_words(self, ticket):
        base = self.layout.slot(ticket)
        return np.frombuffer(self.buf, np.uint32, 8, base), base

    def write_meta(self, ticket, count, error, failures, report: bytes, fill_s=0.0):
        words, base = self._slot_words(ticket)
        words[_S_FILL_US // 4] = min(int(fill_s * 1e6), 0xFFFFFFFF)
        words[_S_COUNT // 4] = count
        words[_S_ERROR // 4] = error
        words[_S_FAILURES // 4] = failures
        if len(report) > REPORT_BYTES:
            # Keep the newest whole lines: under on_error="raise" the last one is
            # the sample to raise for.  The failure count still covers them all.
            report = report[-REPORT_BYTES:]
            report = report[report.find(b"\n") + 1:]
        words[_S_REPORT_LEN // 4] = len(report)
        np.frombuffer(self.buf, np.uint64, 1, base + _S_TICKET)[0] = ticket
        self.slots[ticket % self.layout.nslots].report_area[:len(report)] = np.frombuffer(
            report, np.uint8)

    def fill_seconds(self, ticket):
        """Time the worker spent filling this ticket's slot."""
        return int(self._slot_words(ticket)[0][_S_FILL_US // 4]) * 1e-6

    def read_meta(self, ticket):
        """(count, error kind, failures, report text) of a published slot."""
        words, base = self._slot_words(ticket)
        n = int(words[_S_REPORT_LEN // 4])
        report = bytes(self.slots[ticket % self.layout.nslots].report_area[:n])
        return (int(words[_S_COUNT // 4]), int(words[_S_ERROR // 4]),
                int(words[_S_FAILURES // 4]), report.decode("utf-8", "replace"))

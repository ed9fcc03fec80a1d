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
shared-memory object in ``/dev/shm`` instead (see :func:`remove_stale_segments`).

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
            flip u8[B] | boxes f32[B, 4] | image shape u16[B, 2] | source shape i32[B, 2]
            canvas scale f32[B, 2] | (page) pixels u8[B, S]
    slot 1  ...

``S`` is the bytes reserved per sample: H*W*3 for final crops, or a canvas
budget when echoing before augmentation.  For a canvas, "source shape" is the
original image size and "canvas scale" maps canvas pixels to original pixels
(original = canvas * scale), so every echo can draw its crop in the
original's coordinates.

Failed samples travel as binary, length-prefixed records (en_ring_failure:
sample id, reason, path length, message length, then the path's raw bytes and
the UTF-8 message): :func:`encode_failures` / :func:`decode_failures` are
the one codec, so no byte of a file name can split or forge a record.
"""
from __future__ import annotations

import errno
import os
import re
import secrets
import time
import struct
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from echo_native import _ring

PAGE = _ring.PAGE
MAGIC = _ring.MAGIC
VERSION = _ring.VERSION
#: Worker indexes run from 0 to MAX_WORKERS - 1 (one claim word each in the header).
MAX_WORKERS = _ring.MAX_WORKERS
REPORT_BYTES = _ring.REPORT_BYTES
HEADER_BYTES = _ring.HEADER_BYTES
PREFIX = "echo_native-"
#: Ring names that begin so are memfd rings: ``/memfd:echo_native-<pid>-<hex>``, what
#: ``/proc/<pid>/fd`` and ``/proc/<pid>/maps`` show for them.
MEMFD_PREFIX = _ring.MEMFD_PREFIX
#: Environment variable choosing the ring's memory: ``memfd``, ``shm`` (the named
#: ``/dev/shm`` fallback), or ``auto`` (the default: memfd, shm only where memfd is
#: unavailable).
BACKING_ENV = "ECHO_NATIVE_RING_BACKING"
SHM_DIR = "/dev/shm"

#: Claim word value while a worker is between taking a ticket and recording it.
CLAIM_PENDING = _ring.CLAIM_PENDING
#: Sample id of a failure record that is no sample's (a worker's traceback).
NO_SAMPLE = _ring.NO_SAMPLE

# Slot error kinds.
ERR_NONE, ERR_WORKER, ERR_DECODE = _ring.ERR_NONE, _ring.ERR_WORKER, _ring.ERR_DECODE

# Per-sample status.
OK, REPLACED, SKIPPED = _ring.STATUS_OK, _ring.STATUS_REPLACED, _ring.STATUS_SKIPPED
# Per-sample failure reasons (stats key names).
REASON_NONE, REASON_DECODE = _ring.REASON_NONE, _ring.REASON_DECODE
REASON_READ, REASON_LIMIT = _ring.REASON_READ, _ring.REASON_LIMIT
REASONS = {REASON_NONE: "none", REASON_DECODE: "decode", REASON_READ: "read",
           REASON_LIMIT: "limit"}

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


def _struct(fields, size):
    """A struct.Struct packing a C struct's fields in offset order, padding as zeros."""
    fmt, at = "=", 0
    for name, (offset, nbytes, width) in sorted(fields.items(), key=lambda kv: kv[1][0]):
        if nbytes != width:
            raise TypeError(f"field {name} is an array; _struct packs scalars")
        fmt += "x" * (offset - at) + {1: "B", 2: "H", 4: "I", 8: "Q"}[width]
        at = offset + nbytes
    return struct.Struct(fmt + "x" * (size - at)), [
        n for n, _ in sorted(fields.items(), key=lambda kv: kv[1][0])]


_FAILURE, _FAILURE_ORDER = _struct(_ring.FAILURE_FIELDS, _ring.FAILURE_HEADER_BYTES)
_CLIP_MARK = b"[...]"


def _align(n, a):
    return (n + a - 1) // a * a


# ---- failure records ------------------------------------------------------------------
@dataclass(frozen=True)
class Failure:
    """One failed sample as it crosses the ring.

    ``path`` is a str; bytes that are not valid UTF-8 are carried through
    ``os.fsencode``/``os.fsdecode`` (surrogate escapes), so ``os.fsencode(path)``
    gives back the file's exact name.  ``clipped`` says the path or message
    was shortened (around a ``[...]`` mark) to fit the slot.
    """

    sample_id: int
    reason: int
    path: str
    message: str
    clipped: bool = False

    def __post_init__(self):
        object.__setattr__(self, "path", os.fsdecode(self.path))
        object.__setattr__(self, "message", str(self.message))


def _utf8_start(data, i):
    """The nearest index <= i that does not split a UTF-8 sequence."""
    while 0 < i < len(data) and data[i] & 0xC0 == 0x80:
        i -= 1
    return i


def _clip(data, n):
    """``data`` cut to at most n bytes by replacing its middle with the clip mark:
    the head of a message says what failed, the tail of a path and of a
    traceback says where."""
    if len(data) <= n:
        return data
    if n <= len(_CLIP_MARK):
        return data[:_utf8_start(data, n)]
    keep = n - len(_CLIP_MARK)
    head = _utf8_start(data, keep // 2)
    tail = len(data) - (keep - head)
    while tail < len(data) and data[tail] & 0xC0 == 0x80:  # do not start mid-character
        tail += 1
    return data[:head] + _CLIP_MARK + data[tail:]


def _path_bytes(path):
    try:
        return os.fsencode(path)
    except UnicodeEncodeError:  # a lone surrogate fsdecode cannot have made
        return path.encode("utf-8", "surrogatepass")


def _encode_one(rec, capacity):
    """One record's bytes (padded), its path and message clipped so that it fits
    ``capacity`` on its own; None if not even an empty record fits."""
    room = capacity // _ring.FAILURE_ALIGN * _ring.FAILURE_ALIGN - _FAILURE.size
    if room < 0:
        return None
    path = _path_bytes(rec.path)
    msg = rec.message.encode("utf-8", "surrogatepass")  # any str round-trips
    clipped = rec.clipped
    if len(path) + len(msg) > room:
        # The path gets what the message leaves, and at least half when both are long.
        path = _clip(path, min(len(path), max(room - len(msg), room // 2)))
        msg = _clip(msg, room - len(path))
        clipped = True
    if not 0 <= rec.sample_id <= NO_SAMPLE or not 0 <= rec.reason <= 0xFF:
        raise ValueError(f"sample id {rec.sample_id} / reason {rec.reason} do not fit a "
                         f"failure record")
    values = {"sample_id": rec.sample_id, "path_len": len(path), "message_len": len(msg),
              "reason": rec.reason, "flags": _ring.FAILURE_CLIPPED if clipped else 0}
    body = _FAILURE.pack(*(values[n] for n in _FAILURE_ORDER)) + path + msg
    return body + bytes(_align(len(body), _ring.FAILURE_ALIGN) - len(body))


def encode_failures(records, capacity=REPORT_BYTES):
    """Pack failure records into at most ``capacity`` bytes: ``(data, dropped)``.

    Records are kept in order until one does not fit; it and every later one
    are dropped whole and counted in ``dropped``.  A record too long to fit
    even alone is clipped (its ``clipped`` flag set) rather than dropped.
    """
    out, dropped = bytearray(), 0
    for rec in records:
        if not isinstance(rec, Failure):
            raise TypeError(f"failure records must be Failure objects, got {rec!r}")
        data = None if dropped else _encode_one(rec, capacity)
        if data is None or len(out) + len(data) > capacity:
            dropped += 1
            continue
        out += data
    return bytes(out), dropped


def _text(data):
    try:
        return data.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:  # not written by encode_failures
        return data.decode("utf-8", "replace")


def decode_failures(data):
    """The records :func:`encode_failures` packed into ``data``, in order.

    ValueError if a record runs past the end (the bytes are not such a packing).
    """
    data = bytes(data)
    out, at, size = [], 0, _FAILURE.size
    while at < len(data):
        if at + size > len(data):
            raise ValueError(f"failure record at byte {at} is cut short")
        values = dict(zip(_FAILURE_ORDER, _FAILURE.unpack_from(data, at)))
        path_end = at + size + values["path_len"]
        end = path_end + values["message_len"]
        if end > len(data):
            raise ValueError(f"failure record at byte {at} claims {end - at} bytes, "
                             f"{len(data) - at} are left")
        out.append(Failure(values["sample_id"], values["reason"],
                           os.fsdecode(data[at + size:path_end]), _text(data[path_end:end]),
                           bool(values["flags"] & _ring.FAILURE_CLIPPED)))
        at = _align(end, _ring.FAILURE_ALIGN)
    return out


# ---- layout -----------------------------------------------------------------------------
def _offset(name, doc):
    return property(lambda self: self._c[name], doc=doc)


@dataclass(frozen=True)
class Layout:
    """Byte offsets of one slot for a batch size and per-sample pixel budget,
    as ``en_ring_compute_layout`` places them (ValueError for a geometry it refuses)."""

    nslots: int
    batch_size: int
    sample_bytes: int
    _c: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_c", _ring.layout(self.nslots, self.batch_size,
                                                    self.sample_bytes))

    labels = _offset("labels", "labels i64[B]")
    sample_ids = _offset("sample_ids", "sample ids i64[B]")
    status = _offset("status", "status u8[B]")
    reason = _offset("reason", "failure reason u8[B]")
    flip = _offset("flip", "flip u8[B]")
    boxes = _offset("boxes", "boxes f32[B, 4]")
    shapes = _offset("shapes", "image shape u16[B, 2]")
    source_hw = _offset("source_hw", "source shape i32[B, 2]")
    canvas_scale = _offset("canvas_scale", "canvas scale f32[B, 2]")
    pixels = _offset("pixels", "pixels u8[B, S], page-aligned")
    slot_bytes = _offset("slot_bytes", "bytes per slot, a page multiple")
    total_bytes = _offset("total_bytes", "bytes of the whole segment")

    def slot(self, i):
        return HEADER_BYTES + (i % self.nslots) * self.slot_bytes


class Meta(NamedTuple):
    """What a published slot says besides its arrays (see :meth:`Ring.read_meta`)."""

    count: int
    error: int
    failures: int          # samples that failed, named in ``records`` or not
    records: list          # list[Failure], as many as fit the slot's report area


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


# ---- the named fallback: whose segments may be removed -------------------------------------
_NAMED = re.compile(re.escape(PREFIX) + r"(\d+)-(\d+)-([0-9a-f]{32})-[0-9a-f]+")
_LEGACY = re.compile(re.escape(PREFIX) + r"(\d+)-[0-9a-f]+")


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _origin():
    """(pid-namespace inode, boot id) of this process, each None if unknown: a pid
    means the same process only within both."""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = None
    boot = _read("/proc/sys/kernel/random/boot_id")
    boot = boot.replace("-", "").lower() if boot else None
    if boot is not None and not re.fullmatch(r"[0-9a-f]{32}", boot):
        boot = None
    return ns, boot


def _shm_name():
    """A new named segment's name: ``/echo_native-<pid>-<pid-ns inode>-<boot id>-<hex>``."""
    ns, boot = _origin()
    return f"/{PREFIX}{os.getpid()}-{ns or 0}-{boot or '0' * 32}-{secrets.token_hex(6)}"


def remove_stale_segments(shm_dir=SHM_DIR):
    """Unlink named ring segments (the ``/dev/shm`` fallback) proven left behind.

    A segment is removed only when all of this holds: this user owns it (``os.stat``),
    its name records this PID namespace and this boot (a pid from another container
    sharing ``/dev/shm``, or from before a reboot, says nothing here), and that pid is
    gone (a zombie counts as gone).  Every other segment is kept: a live owner's
    silently, the rest (another user's, another namespace's or boot's, a name from an
    older version that records neither, one that cannot be unlinked) with one
    ``RuntimeWarning`` naming them and why.  Never raises.

    Returns the names removed.  Called before a named ring is created (never for a
    memfd ring, which has no name to leave behind).
    """
    removed, kept = [], []
    try:
        names = sorted(os.listdir(shm_dir))
    except OSError:
        return removed
    ns, boot = _origin()
    uid = os.geteuid()
    for name in names:
        m, legacy = _NAMED.fullmatch(name), _LEGACY.fullmatch(name)
        if not (m or legacy):
            continue
        try:
            st = os.stat(os.path.join(shm_dir, name))
        except OSError:
            continue  # gone meanwhile
        if st.st_uid != uid:
            kept.append(f"{name} (owned by uid {st.st_uid}: only its owner can tell "
                        f"whether it is in use)")
            continue
        if not m:
            kept.append(f"{name} (from an older echo_native that did not record its PID "
                        f"namespace: its owner pid may live in another container)")
            continue
        pid, seg_ns, seg_boot = int(m.group(1)), int(m.group(2)), m.group(3)
        if ns is None or boot is None or seg_ns != ns or seg_boot != boot:
            where = ("another boot" if ns is not None and seg_ns == ns else
                     "another PID namespace (a container sharing /dev/shm?)")
            kept.append(f"{name} (made in {where}: pid {pid} cannot be checked from here)")
            continue
        if _pid_alive(pid):
            continue  # a live ring
        try:
            _ring.unlink("/" + name)
        except OSError as e:
            kept.append(f"{name} (owner pid {pid} is gone but unlinking failed: "
                        f"{e.strerror or e})")
            continue
        removed.append(name)
    if kept:
        warnings.warn(
            f"echo_native kept {len(kept)} ring segment(s) in {shm_dir} that may be in use: "
            f"{'; '.join(kept)}. Each holds memory until removed; delete one by hand "
            f"(rm {shm_dir}/NAME) once you know its owner is gone.", RuntimeWarning,
            stacklevel=2)
    return removed


# ---- how much memory a ring may take ------------------------------------------------------
class RingMemoryError(MemoryError):
    """The ring does not fit the memory available; raised by :meth:`Ring.create` (so by
    ``Loader.start()``) before any worker starts.  ``needed`` and ``available`` are
    bytes (``needed`` counts what the :class:`MemoryBudget` adds to the ring),
    ``limit`` says where ``available`` comes from, ``parts`` lists what ``needed``
    is made of, each with the setting that sizes it."""

    def __init__(self, message, needed=None, available=None, limit=None):
        super().__init__(message)
        self.needed, self.available, self.limit = needed, available, limit
        self.parts = []  # [(what, bytes, setting to lower)], the ring first


def _gib(n):
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _meminfo_available():
    text = _read("/proc/meminfo") or ""
    m = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.MULTILINE)
    return None if m is None else int(m.group(1)) * 1024


def _cgroup_headroom():
    """(bytes, description) of the tightest memory cgroup limit above this process
    (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) minus its usage less reclaimable
    page cache, or None when no limit applies."""
    best = None
    for line in (_read("/proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            root, files = "/sys/fs/cgroup", ("memory.max", "memory.current")
            cache = ("inactive_file", "active_file")
        elif "memory" in controllers.split(","):
            root, files = "/sys/fs/cgroup/memory", ("memory.limit_in_bytes",
                                                    "memory.usage_in_bytes")
            cache = ("total_inactive_file", "total_active_file")
        else:
            continue
        # The cgroup and each ancestor (a container may see its own as the root).
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            d = os.path.join(root, *parts[:depth])
            limit, usage = _read(os.path.join(d, files[0])), _read(os.path.join(d, files[1]))
            if not limit or not usage or not limit.isdigit() or not usage.isdigit():
                continue
            limit, usage = int(limit), int(usage)
            if limit >= 2**60:
                continue  # "unlimited"
            stat = dict(l.split() for l in (_read(os.path.join(d, "memory.stat")) or "")
                        .splitlines() if len(l.split()) == 2)
            usage -= sum(int(stat.get(k, 0)) for k in cache)
            room = max(0, limit - max(0, usage))
            if best is None or room < best[0]:
                best = (room, f"memory cgroup limit {limit:,} bytes in {d}")
    return best


def memory_available(backing="memfd", shm_dir=SHM_DIR):
    """The bytes a new ring may take, and where that figure comes from: the least of
    ``MemAvailable`` (``/proc/meminfo``), the memory cgroup's headroom, and, for a
    named ring, the free space of ``shm_dir`` (``os.statvfs``).  (None, "") when
    nothing can be read."""
    limits = []
    mem = _meminfo_available()
    if mem is not None:
        limits.append((mem, "MemAvailable in /proc/meminfo"))
    cg = _cgroup_headroom()
    if cg is not None:
        limits.append(cg)
    if backing == "shm":
        try:
            st = os.statvfs(shm_dir)
            limits.append((st.f_bavail * st.f_frsize, f"free space in {shm_dir} (statvfs)"))
        except OSError:
            pass
    if not limits:
        return None, ""
    return min(limits)


#: Memory one worker process takes besides the ring, counted by :class:`MemoryBudget`:
#: a worker's anonymous memory (interpreter, numpy, the native kernel, a decode of an
#: ImageNet-sized JPEG) measured at about 25 MiB, with room for larger images.
WORKER_BYTES = 64 * 2**20
#: What the consumer process may still add once the pipeline runs (batch copies,
#: the training loop's own arrays), counted by :class:`MemoryBudget`.
CONSUMER_BYTES = 64 * 2**20


@dataclass(frozen=True)
class MemoryBudget:
    """Everything a pipeline adds to the machine's (or its memory cgroup's) memory
    besides its ring, checked with the ring in one place, :meth:`Ring.create`, before
    anything is allocated: a pipeline that does not fit fails at start with
    :class:`RingMemoryError`, never with the OOM killer later.

    Parameters
    ----------
    workers : int
        Worker processes that will be started (0 for thread workers).
    worker_bytes : int
        Each worker process's own memory (a margin; :data:`WORKER_BYTES`), plus
        whatever per-worker memory the caller knows of (a remote source's block
        cache).
    consumer_bytes : int
        What the consumer process may still add (a margin; :data:`CONSUMER_BYTES`).
    extra : tuple of (what, bytes, setting)
        Other memory the pipeline will allocate, each named with the setting that
        sizes it, e.g. ``(("the echo buffer", 3 << 30, "shuffle_buffer"),)``.

    The total is checked against the least of ``MemAvailable`` and the memory
    cgroup's headroom (:func:`memory_available`); a named ring must also fit the
    free space of ``/dev/shm``.  ``MemoryBudget()`` with no argument counts nothing
    but the ring (what :meth:`Ring.create` checks by default).
    """

    workers: int = 0
    worker_bytes: int = WORKER_BYTES
    consumer_bytes: int = 0
    extra: tuple = ()

    def __post_init__(self):
        for name in ("workers", "worker_bytes", "consumer_bytes"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"MemoryBudget: {name} must be a non-negative integer, "
                                 f"got {v!r}")
        items = tuple(tuple(e) for e in self.extra)
        for e in items:
            if len(e) != 3 or not isinstance(e[0], str) or not isinstance(e[2], str) or \
                    not isinstance(e[1], (int, np.integer)) or isinstance(e[1], bool) or e[1] < 0:
                raise ValueError(f"MemoryBudget: each extra must be (what, bytes >= 0, "
                                 f"setting), got {e!r}")
        object.__setattr__(self, "extra", items)

    @classmethod
    def for_pipeline(cls, workers=0, extra=(), worker_bytes=WORKER_BYTES):
        """The budget a loader checks: its worker processes and the consumer with the
        default margins, plus ``extra``."""
        return cls(workers, worker_bytes, CONSUMER_BYTES, extra)

    def parts(self, ring_bytes):
        """``[(what, bytes, setting to lower)]``: the ring first, then the rest."""
        out = [("the ring", int(ring_bytes), "batch_size, slots or the bytes per sample")]
        if self.workers:
            out.append((f"{self.workers} worker process(es) at {_gib(self.worker_bytes)} each",
                        self.workers * self.worker_bytes, "workers"))
        if self.consumer_bytes:
            out.append(("the consumer's margin", self.consumer_bytes, ""))
        out += [(what, int(n), setting) for what, n, setting in self.extra if n]
        return out

    def needed(self, ring_bytes):
        """Bytes the pipeline needs in all, the ring's ``ring_bytes`` included."""
        return sum(n for _, n, _ in self.parts(ring_bytes))


def _too_big(layout, backing, available, where, cause=None, budget=None):
    L = layout
    budget = budget or MemoryBudget()
    needed = budget.needed(L.total_bytes)
    what = (f"the ring needs {L.total_bytes:,} bytes ({_gib(L.total_bytes)}: {L.nslots} slots "
            f"of {L.slot_bytes:,} bytes, each {L.batch_size} samples x {L.sample_bytes:,} "
            f"bytes)")
    others = budget.parts(L.total_bytes)[1:]
    if others:
        what += (", and with " + ", ".join(
            f"{w} ({_gib(n)}{f', lower {s}' if s else ''})" for w, n, s in others)
            + f" the pipeline needs {needed:,} bytes ({_gib(needed)})")
    if available is not None:
        have = f"only {available:,} bytes ({_gib(available)}) are available ({where})"
        if L.slot_bytes > available:
            have += ": not even one slot fits"
    else:
        have = "the memory could not be reserved"
    if cause is not None:
        have += f"; reserving it failed: {cause}"
    fix = ("Lower batch_size, slots, or the bytes per sample (image_size; canvas_side or "
           "canvas_max_pixels when echoing before augmentation)")
    settings = [s for _, n, s in others if s and n]
    if settings:
        fix += ", or " + ", ".join(dict.fromkeys(settings))
    if backing == "shm":
        fix += (f"; this ring lives in {SHM_DIR} (the named fallback): make it larger "
                f"(docker run --shm-size=...), or leave {BACKING_ENV} unset where the kernel "
                f"has memfd_create")
    err = RingMemoryError(f"{what}, but {have}. {fix}.", needed, available, where)
    err.parts = budget.parts(L.total_bytes)
    return err


def _check_budget(layout, budget, backing):
    """Raise RingMemoryError unless the ring (in ``backing``) and the rest of ``budget``
    fit: the total against RAM and the cgroup, a named ring also against /dev/shm."""
    available, where = memory_available("memfd")
    if available is not None and budget.needed(layout.total_bytes) > available:
        raise _too_big(layout, backing, available, where, budget=budget)
    if backing == "shm":
        available, where = memory_available("shm")
        if available is not None and layout.total_bytes > available:
            raise _too_big(layout, backing, available, where, budget=MemoryBudget())
    return available, where


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
               budget=None):
        """A new ring, every page reserved.

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
        layout = Layout(int(nslots), int(batch_size), int(sample_bytes))
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
                          first_ticket, os.getpid())
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
        return cls(seg, Layout(c["nslots"], c["batch"], c["sample_bytes"]))

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

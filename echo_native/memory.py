"""How much memory a ring may take, and the names of the ``/dev/shm`` fallback.

Every page of a ring is reserved when it is created, after a check of
everything the pipeline will add against the memory available (the least of
``MemAvailable``, the memory cgroup's headroom and, for a named ring, the free
space of ``/dev/shm``): a pipeline that does not fit fails at start with
:class:`RingMemoryError`, naming each part and the setting that sizes it,
never with SIGBUS or the OOM killer later (:class:`MemoryBudget`).

Where ``memfd_create`` is unavailable the ring is a named segment in
``/dev/shm``; its name records the creator's pid, PID namespace and boot, so
that :func:`remove_stale_segments` removes only what is proven left behind.
"""
from __future__ import annotations

import os
import re
import secrets
import warnings
from dataclasses import dataclass

import numpy as np

from echo_native import _ring

PREFIX = "echo_native-"
#: Environment variable choosing the ring's memory: ``memfd``, ``shm`` (the named
#: ``/dev/shm`` fallback), or ``auto`` (the default: memfd, shm only where memfd is
#: unavailable).
BACKING_ENV = "ECHO_NATIVE_RING_BACKING"
SHM_DIR = "/dev/shm"


def pid_alive(pid):
    """Whether process ``pid`` runs (a zombie does not)."""
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
        if pid_alive(pid):
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


def check_buffer(owner, what, nbytes, setting):
    """Refuse a host buffer of ``nbytes`` (an echo stage's shuffle buffer or batch window)
    that, with the consumer's margin, does not fit the memory available (the same
    :class:`MemoryBudget` and :func:`memory_available` a ring is checked against):
    :class:`RingMemoryError` naming the bytes, where the figure comes from and the
    ``setting`` that sizes the buffer, never the OOM killer later."""
    budget = MemoryBudget.for_pipeline(extra=((what, int(nbytes), setting),))
    needed = budget.needed(0)
    available, where = memory_available("memfd")
    if available is None or needed <= available:
        return
    err = RingMemoryError(
        f"{owner}: {what} needs {int(nbytes):,} bytes ({_gib(nbytes)}), with the consumer's "
        f"margin {needed:,} bytes ({_gib(needed)}), but only {available:,} bytes "
        f"({_gib(available)}) are available ({where}): lower {setting}", needed, available,
        where)
    err.parts = [p for p in budget.parts(0) if p[1]]
    raise err

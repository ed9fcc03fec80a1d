"""Failed samples as they cross the ring: length-prefixed binary records.

A worker that cannot read or decode a sample writes a record into the slot's
report area (``en_ring_failure`` in ``src/ring/en_ring.h``: sample id, reason,
flags, path length, message length, then the path's raw bytes and the UTF-8
message); the consumer reads them back and warns, naming the file.  Lengths,
not separators: no byte of a file name can split or forge a record.
:func:`encode_failures` / :func:`decode_failures` are the one codec.
"""
from __future__ import annotations

import os
import struct
import warnings
from dataclasses import dataclass

from echo_native import _ring

REPORT_BYTES = _ring.REPORT_BYTES
#: Sample id of a failure record that is no sample's (a worker's traceback).
NO_SAMPLE = _ring.NO_SAMPLE


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


@dataclass(frozen=True)
class Failure:
    """One failed sample as it crosses the ring.

    ``path`` is a str; bytes that are not valid UTF-8 are carried through
    ``os.fsencode``/``os.fsdecode`` (surrogate escapes), so ``os.fsencode(path)``
    gives back the file's exact name.  ``clipped`` says the path or message
    was shortened (around a ``[...]`` mark) to fit the slot; ``dropped`` that the
    batch holds nothing for the sample (every stand-in failed too).
    """

    sample_id: int
    reason: int
    path: str
    message: str
    clipped: bool = False
    dropped: bool = False

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
    flags = (_ring.FAILURE_CLIPPED if clipped else 0) | \
        (_ring.FAILURE_DROPPED if rec.dropped else 0)
    values = {"sample_id": rec.sample_id, "path_len": len(path), "message_len": len(msg),
              "reason": rec.reason, "flags": flags}
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
                           bool(values["flags"] & _ring.FAILURE_CLIPPED),
                           bool(values["flags"] & _ring.FAILURE_DROPPED)))
        at = _align(end, _ring.FAILURE_ALIGN)
    return out


# ---- what the consumer tells the user -------------------------------------------------
#: Slot reason codes (``en_ring.h``) by the name ``stats()["failures"]`` counts them under.
REASONS = {_ring.REASON_NONE: "none", _ring.REASON_DECODE: "decode",
           _ring.REASON_READ: "read", _ring.REASON_LIMIT: "limit"}


class SampleFailureWarning(UserWarning):
    """A sample could not be read or decoded and was replaced, skipped or dropped.

    ``failure`` is its :class:`Failure` (the exact path included), or None for the
    summary that ends an epoch in which samples failed."""


class FailureReport:
    """The consumer's account of failed samples: counts by reason, one warning per
    failed file the first time it fails (later failures of the same file, which
    every epoch reads again, are counted), and a summary at the end of each epoch
    in which samples failed, so that what the per-file warnings left out (files
    already named, samples a slot's report could not name) is still said."""

    _ACTIONS = {"replace": "replaced", "skip": "skipped", "raise": "raised"}

    def __init__(self, on_error):
        self.action = self._ACTIONS[on_error]
        self.on_error = on_error
        self.counts = {}            # reason -> failures since start
        self.total_dropped = 0      # samples dropped since start (no stand-in either)
        self._epoch = {}            # this epoch's counts, for its summary
        self._repeats = 0           # this epoch's failures of files named before
        self._dropped = 0           # this epoch's dropped samples
        self._named = set()         # paths named in a warning already

    def _count(self, reason, n=1):
        self.counts[reason] = self.counts.get(reason, 0) + n
        self._epoch[reason] = self._epoch.get(reason, 0) + n

    def sample_failures(self, records, failures):
        """A batch's ``records`` (and ``failures`` in all, the unnamed ones included)."""
        for r in records:
            self._count(REASONS.get(r.reason, "other"))
            if r.path in self._named:
                self._repeats += 1
                continue
            self._named.add(r.path)
            # A name with control characters (newline, tab, U+2028) or undecodable
            # bytes is shown escaped, so it cannot break or forge a log line; the
            # exact name is the warning's ``failure.path``.
            shown = r.path if r.path and r.path.isprintable() else repr(r.path)
            what = "dropped: every stand-in failed too" if r.dropped else self.action
            w = SampleFailureWarning(f"{shown}: {' '.join(r.message.split())} "
                                     f"(sample {r.sample_id}, {what})")
            w.failure = r
            warnings.warn(w, stacklevel=5)
        if failures > len(records):  # more than the slot's report area could name
            self._count("unreported", failures - len(records))

    def dropped(self, n):
        self.total_dropped += n
        self._dropped += n

    def end_epoch(self, epoch):
        """The summary warning of an epoch in which samples failed."""
        counts, repeats, dropped = self._epoch, self._repeats, self._dropped
        self._epoch, self._repeats, self._dropped = {}, 0, 0
        total = sum(counts.values())
        if not total:
            return
        by = ", ".join(f"{reason} {n}" for reason, n in sorted(counts.items()))
        quiet = []
        if repeats:
            quiet.append(f"{repeats} of files already named in an earlier warning")
        if counts.get("unreported"):
            quiet.append(f"{counts['unreported']} whose paths did not fit the batch's report")
        action = self.action
        if dropped and self.on_error == "replace":
            action = f"{action} ({dropped} dropped: every stand-in failed too)"
        w = SampleFailureWarning(
            f"epoch {epoch}: {total} sample(s) failed ({by}), {action}"
            f"{'; not warned one by one: ' + '; '.join(quiet) if quiet else ''}; "
            f"totals in stats()['failures']")
        w.failure = None
        warnings.warn(w, stacklevel=5)

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

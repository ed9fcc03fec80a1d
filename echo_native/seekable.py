"""Seekable JPEGs: crops that entropy-decode only their own blocks, pixels unchanged.

A baseline JPEG's entropy-coded data has no random access: a crop's decode reads every
block from the top of the image to the crop's last row, across the full width.  Restart
markers are JPEG's one random-access point (the DC predictors reset, the coder restarts
byte-aligned).  :func:`transcode` rewrites a JPEG losslessly -- the same quantised DCT
coefficients, one baseline scan, optimised Huffman tables -- with a restart marker every
``restart`` MCUs, and stores an index of where every restart segment starts in APP9
segments right after SOI.  The result is an ordinary JPEG to every decoder; to
``echo_native`` it is seekable: a crop is decoded from a small JPEG assembled in memory
from the crop's MCUs (plus one MCU of margin where fancy upsampling and the kernel's
column margin read), by the kernel's own code, with pixels identical to decoding the
original.

The index travels inside the file, so every source (tar shards written with
``write_shards(..., seekable=True)``, an ImageFolder of transcoded files, Parquet) takes
the seekable path with no other change: :class:`echo_native.decode.Decoder` sends every
JPEG whose first segment is the index there.  An index that disagrees with its file (a
truncated segment, offsets out of bounds, a forged DRI, anything else) is detected and
the plain path decodes the file, which refuses it by name when the file itself is
unsound.  See docs/seekable.md for the format and the measured trade-offs.
"""
from __future__ import annotations

from dataclasses import dataclass

from echo_native import _seek
from echo_native.errors import DecodeError

#: The default restart segment: 128 pixels of width (8 MCUs of 4:2:0 or 4:2:2, 16 of
#: 4:4:4 or greyscale), from the bytes/speed curve of benchmarks/bench_seekable.py
#: (docs/seekable.md): as fast as a marker every 1-4 MCUs on both corpora (a crop's
#: columns round out to 128 px, but fewer markers and DC resets pay for it), at a
#: fraction of the bytes.  A marker costs the same bytes whatever the MCU covers, so the
#: default is a width in pixels, not a count of MCUs (4:4:4 has 4x the MCUs of 4:2:0).
DEFAULT_RESTART_PX = 128
#: ``restart=DEFAULT``: :data:`DEFAULT_RESTART_PX` wide segments.
DEFAULT = None
#: ``restart=ROW``: one restart segment per MCU row (crops then decode whole rows).
ROW = _seek.ROW
SIGNATURE = b"ENSEEK\x00\x01"

__all__ = ["DEFAULT", "DEFAULT_RESTART_PX", "ROW", "SeekDecoder", "Transcoded", "check_restart",
           "index_info", "is_seekable", "make_seekable", "transcode"]


@dataclass(frozen=True)
class Transcoded:
    """What :func:`transcode` made: the seekable bytes and the facts of their index."""
    data: bytes
    interval: int          # MCUs per restart segment (divides an MCU row)
    segments: int
    index_bytes: int       # of which the APP9 index segments
    width: int
    height: int
    mcu: tuple             # (height, width) of one MCU, pixels
    progressive_in: bool   # the input was progressive (the output never is)


def is_seekable(data) -> bool:
    """True when ``data`` starts with a seekable index (checks the signature only; the
    decode checks the index against the file)."""
    return (len(data) >= 14 and data[0] == 0xFF and data[1] == 0xD8 and data[2] == 0xFF
            and data[3] == 0xE9 and bytes(data[6:14]) == SIGNATURE)


def check_restart(restart):
    """ValueError unless ``restart`` is a number of MCUs >= 1, ``ROW`` or ``DEFAULT``."""
    if restart is not DEFAULT and (not isinstance(restart, int) or isinstance(restart, bool)
                                   or restart < 0):
        raise ValueError(f"restart must be a number of MCUs >= 1, ROW (0) or DEFAULT (None), "
                         f"got {restart!r}")


def transcode(data, restart: int | None = DEFAULT, *, max_pixels: int | None = None,
              max_scans: int | None = None, max_memory: int | None = None) -> Transcoded:
    """Rewrite a JPEG losslessly as a seekable one (see the module's docstring).

    ``restart``: MCUs per restart interval; a crop takes whole segments, so the interval
    used is the largest divisor of an MCU row's count not above it (``ROW``: one segment
    per MCU row; ``DEFAULT``: segments :data:`DEFAULT_RESTART_PX` pixels wide).

    Refuses, with :class:`DecodeError` naming why, what it cannot keep exact: damaged
    data (libjpeg would substitute coefficients), colour spaces other than YCbCr and
    greyscale (CMYK, YCCK, RGB-coded), 12-bit and lossless JPEG.  The limits
    default to the decoder's (:class:`echo_native.DecodeLimits`).
    """
    check_restart(restart)
    px = 0
    if restart is DEFAULT:
        restart, px = 1, DEFAULT_RESTART_PX
    kw = {k: v for k, v in (("max_pixels", max_pixels), ("max_scans", max_scans),
                            ("max_memory", max_memory)) if v is not None}
    buf = data if not isinstance(data, bytearray) else bytes(data)
    out, facts = _seek.transcode(buf, restart, px, **kw)
    return Transcoded(out, facts["interval"], facts["segments"], facts["index_bytes"],
                      facts["width"], facts["height"], facts["mcu"], facts["progressive_in"])


def make_seekable(data, restart: int | None = DEFAULT) -> tuple[bytes, str | None]:
    """``(bytes, None)`` seekable, or ``(data, reason)`` unchanged when it cannot be
    transcoded losslessly (not a JPEG, CMYK, damaged, ...): what a shard writer stores.
    An input that already is seekable is kept as it is."""
    if is_seekable(data):
        return bytes(data), None
    if not (len(data) >= 2 and data[0] == 0xFF and data[1] == 0xD8):
        return bytes(data), "not a JPEG"
    try:
        return transcode(data, restart).data, None
    except DecodeError as e:
        return bytes(data), str(e)


def index_info(data) -> dict | None:
    """The index's facts (image and MCU size, interval, bytes), ``None`` for a file
    without one; ``ValueError`` saying how an index disagrees with its file."""
    return _seek.parse(data if not isinstance(data, bytearray) else bytes(data))


class SeekDecoder:
    """The crop methods of ``_kernel.Decoder`` for seekable files (decode.Decoder's
    dispatch sends them here); whole-image decodes go to the kernel itself."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.seeker = _seek.Seeker()
        self._last = self.seeker

    def set_limits(self, max_pixels, max_scans, strict, max_memory):
        self.seeker.set_limits(max_pixels, max_scans, strict, max_memory)

    @property
    def warnings(self) -> int:
        return self._last.warnings

    @property
    def harmless_warnings(self) -> int:
        return self._last.harmless_warnings

    @property
    def last_scale(self) -> int:
        return self._last.last_scale

    def stats(self) -> dict:
        return self.seeker.stats()

    def info(self, data):
        self._last = self.kernel
        return self.kernel.info(data)

    def decode(self, data):
        self._last = self.kernel
        return self.kernel.decode(data)

    def decode_canvas(self, data, min_side, max_pixels, out):
        self._last = self.kernel
        return self.kernel.decode_canvas(data, min_side, max_pixels, out)

    def decode_crop(self, data, box, size, flip, out):
        self._last = self.seeker
        return self.seeker.decode_crop(data, box, size, flip, out)

    def decode_random_crop(self, data, size, seed, epoch, sample_id, echo_index, scale, ratio,
                           flip_p, out):
        self._last = self.seeker
        return self.seeker.decode_random_crop(data, size, seed, epoch, sample_id, echo_index,
                                              scale, ratio, flip_p, out)

    def decode_center_crop(self, data, resize, size, out):
        self._last = self.seeker
        return self.seeker.decode_center_crop(data, resize, size, out)

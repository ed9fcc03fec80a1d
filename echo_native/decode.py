"""Stage 1 of the pipeline: image bytes to RGB pixels.

:class:`Decoder` is the one place that decides how bytes become pixels: JPEG
through the fused native kernel (libjpeg-turbo region-of-interest decode at a
DCT scale, antialiased resize, flip, one header parse, GIL released), every
other format Pillow can open through Pillow and then the same native resize,
so crop/resize/flip semantics do not depend on the format.  The module-level
functions use one :class:`Decoder` per thread.  :class:`DecodeLimits` says
what a decode may cost and how strict it is.
"""
from __future__ import annotations

import io
import re
import threading
import zlib
from dataclasses import dataclass

import numpy as np

from echo_native import _kernel
from echo_native._checks import CENTER_CROP_FRACTION, is_int
from echo_native.errors import DecodeError
from echo_native.seekable import SeekDecoder, is_seekable

DEFAULT_MAX_PIXELS = _kernel.DEFAULT_MAX_PIXELS
DEFAULT_MAX_SCANS = _kernel.DEFAULT_MAX_SCANS
DEFAULT_MAX_MEMORY = _kernel.DEFAULT_MAX_MEMORY


@dataclass(frozen=True)
class DecodeLimits:
    """What a decode may cost, and what it accepts.

    Parameters
    ----------
    strict : bool, default True
        Refuse images whose pixels are not all really in the file: a JPEG
        that is truncated, whose entropy-coded data is corrupt, that has junk
        inside or at the end of a scan (before a restart marker, between scans
        or before EOI: surplus bytes are what corrupt entropy data leaves) or
        whose scans end before the image is complete; any format Pillow cannot
        fully decode.  Harmless defects are accepted, with exactly the pixels
        of the clean file: junk between header segments (padding after an EXIF
        block, stray bytes before a DQT, DHT, SOF, SOS, DRI, APPn or COM),
        unknown or malformed APPn contents (EXIF, JFIF version, Adobe
        transform, ICC), PNG metadata chunks with a bad CRC;
        :attr:`Decoder.harmless_warnings` counts them.  A crop decodes only the
        rows it needs; below them it still refuses what one pass over the bytes
        shows a full decode would refuse (a truncated file, a marker that
        cannot be there, restart markers out of order).  ``False`` accepts data
        loss too: rows past a truncation come out mid-grey and corrupt segments
        as libjpeg reconstructs them.
    max_pixels : int, default 89,478,485 (Pillow's ``MAX_IMAGE_PIXELS``)
        Decompression-bomb guard on the declared width x height, any format.
    max_scans : int, default 256
        Progressive JPEG scans allowed before the file is refused (a crafted
        file can otherwise make the decoder loop over thousands of scans).
    max_memory : int, default 512 MiB
        Bytes of decoder working memory one image may need, computed from its
        header before anything is allocated, the same for every entry point:
        for JPEG the whole-image coefficient buffers of a progressive (or other
        multi-scan) file, 128 bytes per 8x8 block per component, plus the
        full-size RGB image (width x height x 3); for other formats Pillow's
        decoded image (1, 2 or 4 bytes a pixel by mode), its RGB conversion (4)
        and the array (3, built in chunks then joined: 6).  Both match the
        measured peak within 1%.  A 24-megapixel JPEG needs 72 MB (baseline)
        to 216 MB (progressive 4:4:4), a 24-megapixel RGB PNG 336 MB; a 1 MB
        progressive 4:4:4 file declaring 89 megapixels would need 805 MB and an
        89-megapixel PNG 1.25 GB: both are refused from the header.
    """

    strict: bool = True
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_scans: int = DEFAULT_MAX_SCANS
    max_memory: int = DEFAULT_MAX_MEMORY

    def __post_init__(self):
        if not isinstance(self.strict, (bool, np.bool_)):
            raise TypeError(f"DecodeLimits: strict must be True or False, got {self.strict!r}")
        for name in ("max_pixels", "max_scans", "max_memory"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ValueError(f"DecodeLimits: {name} must be a positive integer, got "
                                 f"{value!r}")
        for name in ("max_pixels", "max_memory"):
            if getattr(self, name) >= 2**63:
                raise ValueError(f"DecodeLimits: {name} must be below 2**63, got "
                                 f"{getattr(self, name)}")
        if self.max_scans >= 2**31:
            raise ValueError(f"DecodeLimits: max_scans must be below 2**31, got "
                             f"{self.max_scans}")


def is_jpeg(data) -> bool:
    """True when the bytes start with a JPEG SOI marker."""
    return len(data) >= 2 and data[0] == 0xFF and data[1] == 0xD8


class Decoder:
    """Bytes of any image format to pixels, with one set of :class:`DecodeLimits`.

    Every method takes encoded bytes and hands them to the native kernel when
    they are a JPEG, else to Pillow followed by the same native resampler.
    Not thread-safe: one per thread (workers each own one).
    """

    def __init__(self, limits: DecodeLimits = DecodeLimits()):
        self.kernel = _kernel.Decoder()
        self._pillow = _PillowDecoder(self.kernel)
        self._last = self.kernel
        self._seek = None  # made on the first seekable file (echo_native.seekable)
        self.limits = None
        self.set_limits(limits)

    def set_limits(self, limits: DecodeLimits):
        if limits != self.limits:
            self.kernel.set_limits(limits.max_pixels, limits.max_scans, limits.strict,
                                   limits.max_memory)
            self._pillow.max_pixels = limits.max_pixels
            self._pillow.max_memory = limits.max_memory
            if self._seek is not None:
                self._seek.set_limits(limits.max_pixels, limits.max_scans, limits.strict,
                                      limits.max_memory)
            self.limits = limits

    def _for(self, data):
        # The only place that tells formats apart.  A seekable JPEG's index is its first
        # segment (APP9, echo_native.seekable): two byte compares keep plain JPEGs on the
        # kernel with no further cost.
        if not is_jpeg(data):
            self._last = self._pillow
        elif len(data) > 14 and data[3] == 0xE9 and data[2] == 0xFF and is_seekable(data):
            self._last = self._seeker()
        else:
            self._last = self.kernel
        return self._last

    def _seeker(self):
        if self._seek is None:
            self._seek = SeekDecoder(self.kernel)
            lim = self.limits
            self._seek.set_limits(lim.max_pixels, lim.max_scans, lim.strict, lim.max_memory)
        return self._seek

    @property
    def warnings(self) -> int:
        """Data-loss warnings of the last call (truncated or corrupt image data): what
        strict mode refuses, counted when ``strict=False`` decodes on.  Crops count
        those in the rows they decoded."""
        return self._last.warnings

    @property
    def harmless_warnings(self) -> int:
        """Harmless warnings of the last call, accepted in strict mode: junk between
        header segments, odd APPn contents, PNG metadata chunks with a bad CRC
        (dropped before Pillow decodes)."""
        return self._last.harmless_warnings

    def size(self, data):
        """``(height, width)`` from the header, without decoding pixels."""
        h, w, _, _ = self._for(data).info(data)
        return h, w

    def decode(self, data):
        """The whole image, ``(H, W, 3)`` uint8 RGB."""
        return self._for(data).decode(data)

    def crop(self, data, box, size, flip=False, out=None):
        """Box of the original resized to ``size`` (and flipped); returns the pixels."""
        return self._for(data).decode_crop(data, box, size, flip, out)

    def random_crop(self, data, size, key, scale, ratio, flip_p, out):
        """RandomResizedCrop + flip drawn from ``key`` = (seed, epoch, sample id, echo
        index), into ``out``; returns ``(box, flip)``."""
        return self._for(data).decode_random_crop(data, size, *key, scale, ratio, flip_p, out)

    def center_crop(self, data, resize, size, out=None):
        """Resize(resize) + CenterCrop(size) into ``out``; returns the box."""
        return self._for(data).decode_center_crop(data, resize, size, out)

    def canvas(self, data, min_side, max_pixels=2**64 - 1, out=None):
        """The canvas echoing before augmentation keeps (see ``_kernel.canvas_plan``):
        ``(canvas, (scale_y, scale_x), (source_height, source_width))``."""
        return self._for(data).decode_canvas(data, min_side, max_pixels, out)

    def resize(self, image, box, size, flip=False, out=None):
        """The same resampling for an ``(H, W, 3)`` image already in memory."""
        return self.kernel.resize(image, box, size, flip, out)


class _PillowDecoder:
    """The kernel's decoding methods for every format that is not JPEG: Pillow
    decodes, the native resampler crops and resizes (same arithmetic as JPEG)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.max_pixels = DEFAULT_MAX_PIXELS
        self.max_memory = DEFAULT_MAX_MEMORY
        # Pillow refuses whatever loses data (it raises); warnings it only prints
        # are not counted (catching them is not thread-safe).  What is counted:
        # PNG metadata chunks with a bad CRC, dropped so that Pillow decodes.
        self.warnings = 0
        self.harmless_warnings = 0

    def info(self, data):
        from PIL import Image

        try:
            with Image.open(io.BytesIO(data)) as im:
                return im.size[1], im.size[0], len(im.getbands()), False
        except Exception as e:
            raise _not_an_image(data, e) from None

    def decode(self, data):
        self.warnings = self.harmless_warnings = 0
        image, self.harmless_warnings = _pillow_decode(data, self.max_pixels, self.max_memory)
        return image

    def decode_crop(self, data, box, size, flip, out):
        return self.kernel.resize(self.decode(data), box, size, flip, out)

    def decode_random_crop(self, data, size, seed, epoch, sample_id, echo_index, scale, ratio,
                           flip_p, out):
        image = self.decode(data)
        box, flip = _kernel.random_resized_crop_params(seed, epoch, sample_id, echo_index,
                                                       image.shape[0], image.shape[1], scale,
                                                       ratio, flip_p)
        self.kernel.resize(image, box, size, flip, out)
        return box, flip

    def decode_center_crop(self, data, resize, size, out):
        image = self.decode(data)
        box = _kernel.center_crop_box(image.shape[0], image.shape[1], resize, size)
        self.kernel.resize(image, box, size, False, out)
        return box

    def decode_canvas(self, data, min_side, max_pixels, out):
        from PIL import Image

        image = self.decode(data)
        source = (int(image.shape[0]), int(image.shape[1]))
        plan = _kernel.canvas_plan(*source, min_side, max_pixels)
        if plan["denom"] > 1:  # Pillow's box reduction stands in for DCT scaling
            image = np.asarray(Image.fromarray(image).reduce(plan["denom"]))
        h, w = plan["shape"]
        if out is None:
            out = np.empty(h * w * 3, np.uint8)
        flat = _kernel.flat_buffer(out)
        if flat.size < h * w * 3:
            raise ValueError(f"canvas buffer holds {flat.size} bytes, a {h}x{w} canvas needs "
                             f"{h * w * 3}")
        canvas = flat[:h * w * 3].reshape(h, w, 3)
        if (h, w) == plan["reduced"]:
            canvas[...] = image
        else:
            self.kernel.resize(np.ascontiguousarray(image), (0, 0) + plan["reduced"], (h, w),
                               False, canvas)
        return canvas, plan["scale"], source


def _not_an_image(data, e):
    if len(data) == 0:
        return DecodeError("empty input (0 bytes)")
    from PIL import UnidentifiedImageError

    if isinstance(e, UnidentifiedImageError):
        # Pillow's own message names the BytesIO object it was given (an address that
        # differs per call): say what the bytes are instead.
        head = bytes(memoryview(data)[:8])
        return DecodeError(f"not an image: no format recognised ({len(data)} bytes, "
                           f"starting {head!r})")
    message = _ADDRESS.sub("", str(e))
    return DecodeError(f"not a decodable image ({type(e).__name__}: {message})")


#: `` <_io.BytesIO object at 0x7f...>`` in a library's message: an address, not the input.
_ADDRESS = re.compile(r" ?<[\w.]+ object at 0x[0-9a-fA-F]+>")


_local = threading.local()


def _decoder(strict=True, max_pixels=DEFAULT_MAX_PIXELS, max_scans=DEFAULT_MAX_SCANS,
             max_memory=DEFAULT_MAX_MEMORY):
    """This thread's :class:`Decoder`, set to the given limits."""
    limits = DecodeLimits(bool(strict), max_pixels, max_scans, max_memory)
    dec = getattr(_local, "decoder", None)
    if dec is None:
        dec = _local.decoder = Decoder(limits)
    else:
        dec.set_limits(limits)
    return dec


def _pillow_pixel_bytes(mode):
    """Bytes a pixel of ``mode`` takes in a Pillow image (its storage, not the file's)."""
    if mode in ("1", "L", "P"):
        return 1
    if mode.startswith("I;16"):
        return 2
    return 4   # every multi-band mode (RGB included) and I, F


def pillow_memory(width, height, mode):
    """Working memory (bytes) the Pillow path needs for a ``width`` x ``height`` image of
    ``mode``: the decoded image, its RGB conversion (4 bytes a pixel in Pillow) and the
    ``(H, W, 3)`` array, which ``tobytes`` builds from chunks and then joins (3 + 3).
    Measured peak growth matches within 1%."""
    return width * height * (_pillow_pixel_bytes(mode) + 4 + 3 + 3)


def _pillow_decode(data, max_pixels, max_memory=DEFAULT_MAX_MEMORY):
    """``(rgb, harmless)``: Pillow's RGB decode, and how many harmless defects were set
    aside for it (PNG metadata chunks with a bad CRC, which Pillow alone refuses)."""
    try:
        return _pillow_rgb(data, max_pixels, max_memory, limits_only=False), 0
    except _PillowRefused as refused:
        fixed, dropped = _png_without_broken_metadata(data)
        if not dropped:
            raise refused.error from None
    try:
        return _pillow_rgb(fixed, max_pixels, max_memory, limits_only=False), dropped
    except _PillowRefused as refused:
        raise refused.error from None


class _PillowRefused(Exception):
    """Pillow could not decode the bytes (``error`` is the DecodeError to raise)."""

    def __init__(self, error):
        super().__init__(str(error))
        self.error = error


def _pillow_rgb(data, max_pixels, max_memory=DEFAULT_MAX_MEMORY, limits_only=True):
    """Pillow's RGB decode under the limits.  A refusal by Pillow itself is a
    DecodeError, or (``limits_only=False``) a _PillowRefused carrying it, so the
    caller can tell it from a refusal by the limits."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
            if w * h > max_pixels:
                raise DecodeError(
                    f"image declares {w}x{h} = {w * h} pixels, over the decompression-bomb "
                    f"limit max_pixels={max_pixels}")
            need = pillow_memory(w, h, im.mode)
            if need > max_memory:
                raise DecodeError(
                    f"{im.format or 'image'} {w}x{h} ({im.mode}) needs {need} bytes of decoder "
                    f"memory (Pillow's image, its RGB conversion and the array), over the "
                    f"limit max_memory={max_memory}")
            return np.asarray(im.convert("RGB"))
    except DecodeError:
        raise
    except Image.DecompressionBombError as e:
        raise DecodeError(f"decompression bomb refused by Pillow: {e}") from None
    except Exception as e:  # Pillow raises many types for bad data
        if limits_only:
            raise _not_an_image(data, e) from None
        raise _PillowRefused(_not_an_image(data, e)) from None


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_without_broken_metadata(data):
    """``(png, n)``: the PNG without its n ancillary chunks (metadata: tEXt, zTXt, iTXt,
    eXIf, tIME, gAMA ...; lower-case first letter) whose CRC is wrong, which Pillow
    refuses the whole file for although no pixel depends on them.  ``(None, 0)`` when
    there are none, the data is not a PNG, or its chunk structure is broken (then
    Pillow's refusal stands)."""
    mv = memoryview(data).cast("B")
    if bytes(mv[:8]) != _PNG_SIGNATURE:
        return None, 0
    keep, dropped, pos = [bytes(mv[:8])], 0, 8
    while pos + 12 <= len(mv):
        end = pos + 12 + int.from_bytes(mv[pos:pos + 4], "big")
        if end > len(mv):
            return None, 0
        kind = bytes(mv[pos + 4:pos + 8])
        if kind[0] & 0x20 and zlib.crc32(mv[pos + 4:end - 4]) != int.from_bytes(
                mv[end - 4:end], "big"):
            dropped += 1
        else:
            keep.append(bytes(mv[pos:end]))
        pos = end
        if kind == b"IEND":
            break
    if not dropped:
        return None, 0
    keep.append(bytes(mv[pos:]))
    return b"".join(keep), dropped


def _as_bytes(data):
    if isinstance(data, (bytes, bytearray, memoryview)):
        return data
    if isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 1:
        if not data.flags.c_contiguous:
            raise ValueError("data must be a contiguous uint8 array, got one with stride "
                             f"{data.strides[0]}")
        return data
    raise TypeError(f"data must be a bytes-like object, got {type(data).__name__}")


def decode(data, *, strict=True, max_pixels=DEFAULT_MAX_PIXELS,
           max_scans=DEFAULT_MAX_SCANS, max_memory=DEFAULT_MAX_MEMORY) -> np.ndarray:
    """Decode a whole image to an ``(H, W, 3)`` uint8 RGB array.

    ``strict``, ``max_pixels``, ``max_scans`` and ``max_memory`` are the
    :class:`DecodeLimits`.
    """
    return _decoder(strict, max_pixels, max_scans, max_memory).decode(_as_bytes(data))


def decode_crop(data, box, size, flip=False, out=None, *, strict=True,
                max_pixels=DEFAULT_MAX_PIXELS, max_scans=DEFAULT_MAX_SCANS,
                max_memory=DEFAULT_MAX_MEMORY) -> np.ndarray:
    """Fused crop + resize (+ horizontal flip).

    ``box=(top, left, height, width)`` is in full-resolution pixels (fractions
    allowed); ``size=(h, w)`` is the output.  The JPEG is decoded at the largest
    DCT scale 1/d, d in (1, 2, 4, 8), that keeps the box at least ``size`` on
    both sides, and only the rows and columns the resampling filter reads are
    decoded.  Resampling follows Pillow's ``BILINEAR`` (antialiased when
    shrinking).  Writes into ``out`` (an ``(h, w, 3)`` uint8 array with
    contiguous rows) when given and returns it.
    """
    return _decoder(strict, max_pixels, max_scans, max_memory).crop(
        _as_bytes(data), _box4(box), size, flip, out)


def decode_random_crop(data, size, seed, epoch, sample_id, echo_index=0, *,
                       scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip_p=0.5, out=None,
                       strict=True, max_pixels=DEFAULT_MAX_PIXELS, max_scans=DEFAULT_MAX_SCANS,
                       max_memory=DEFAULT_MAX_MEMORY):
    """torchvision-style RandomResizedCrop + RandomHorizontalFlip, fused with decoding.

    The crop and flip are a pure function of ``(seed, epoch, sample_id,
    echo_index)`` and the image size (see :func:`random_resized_crop_params`).
    Returns ``(image, box, flip)``.
    """
    data = _as_bytes(data)
    dec = _decoder(strict, max_pixels, max_scans, max_memory)
    if out is None:
        out = np.empty((*_pair(size), 3), dtype=np.uint8)
    box, flip = dec.random_crop(data, size, (seed, epoch, sample_id, echo_index), scale, ratio,
                                flip_p, out)
    return out, box, flip


def decode_center_crop(data, size, resize=None, out=None, *, strict=True,
                       max_pixels=DEFAULT_MAX_PIXELS, max_scans=DEFAULT_MAX_SCANS,
                       max_memory=DEFAULT_MAX_MEMORY):
    """Evaluation transform: ``Resize(resize)`` then ``CenterCrop(size)``, fused.

    ``size`` is an int (square) or ``(height, width)``; ``resize`` (the shorter
    side after resizing, as :class:`CenterCrop`'s) defaults to
    ``round(max(size) / 0.875)`` (256 for 224).  The two torchvision steps become one resampling of the matching
    box of the original, so there is one rounding instead of two.
    """
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        size = (_positive_int("size", size),) * 2
    size = _pair(size)
    resize = default_resize(size) if resize is None else _positive_int("resize", resize)
    data = _as_bytes(data)
    if out is None:
        out = np.empty((*size, 3), dtype=np.uint8)
    _decoder(strict, max_pixels, max_scans, max_memory).center_crop(data, resize, size, out)
    return out


def default_resize(size):
    """torchvision's evaluation convention: resize to ``size / 0.875`` (224 -> 256)."""
    return int(round(max(size) / CENTER_CROP_FRACTION))


def decode_canvas(data, min_side, out=None, *, strict=True, max_pixels=DEFAULT_MAX_PIXELS,
                  max_scans=DEFAULT_MAX_SCANS, max_memory=DEFAULT_MAX_MEMORY):
    """The whole image at the coarsest DCT scale whose shorter side stays >= ``min_side``.

    This is what echoing before augmentation stores: a canvas from which every
    echo cuts its own random crop with :func:`resize_crop`.  ``out`` may be any
    large-enough writable uint8 buffer; returns ``(canvas, scale)`` where
    ``canvas`` is an ``(h, w, 3)`` view of it and ``scale`` the reduction factor
    (box coordinates on the canvas are the original's divided by ``scale``).
    Non-JPEG images are decoded by Pillow and reduced by the same rule.
    """
    min_side = _positive_int("min_side", min_side)
    canvas, (scale, _), _ = _decoder(strict, max_pixels, max_scans, max_memory).canvas(
        _as_bytes(data), min_side, out=out)
    return canvas, int(scale)


def resize_crop(image, box, size, flip=False, out=None) -> np.ndarray:
    """Crop ``box`` of an ``(H, W, 3)`` uint8 image, resize to ``size``, optionally flip.

    The same resampling as :func:`decode_crop`, for canvases already in memory.
    """
    return _decoder().resize(np.ascontiguousarray(image), _box4(box), size, flip, out)


def image_size(data, *, max_pixels=DEFAULT_MAX_PIXELS,
               max_memory=DEFAULT_MAX_MEMORY) -> tuple[int, int]:
    """``(height, width)`` from the header, without decoding pixels (a JPEG over
    ``max_pixels`` or ``max_memory`` is refused from its header here too)."""
    return _decoder(max_pixels=max_pixels, max_memory=max_memory).size(_as_bytes(data))


def _box4(box):
    """``box`` as four floats; a wrong type or length is a TypeError naming ``box``
    (range checks against the image stay in the kernel)."""
    try:
        t = tuple(float(v) for v in box)
    except (TypeError, ValueError):
        raise TypeError(f"box must be (top, left, height, width), got {box!r}") from None
    if len(t) != 4:
        raise TypeError(f"box must be (top, left, height, width), got {box!r}")
    return t


def _positive_int(name, value):
    """``value`` as a positive int (at most 65535); errors name the argument."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be an integer, got {value!r}") from None
    if n <= 0 or n > 65535:
        raise ValueError(f"{name} must be positive and at most 65535, got {value!r}")
    return n


def _pair(size):
    # Checked before decode_random_crop allocates the output, with the kernel's rule.
    return _kernel.check_size(size)


random_resized_crop_params = _kernel.random_resized_crop_params
center_crop_box = _kernel.center_crop_box
pick_scale = _kernel.pick_scale

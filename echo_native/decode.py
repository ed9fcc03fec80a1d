"""Stage 1 of the pipeline: JPEG (or other image) bytes to RGB pixels.

JPEG goes through the fused native kernel (libjpeg-turbo region-of-interest
decode at a DCT scale, antialiased resize, flip, in one pass with the GIL
released).  Everything else Pillow can open goes through Pillow, then through
the same native resize, so crop/resize/flip semantics do not depend on the
format.  Each thread gets its own :class:`~echo_native._kernel.Decoder`.
"""
from __future__ import annotations

import io
import threading

import numpy as np

from echo_native import _kernel
from echo_native.errors import DecodeError

DEFAULT_MAX_PIXELS = _kernel.DEFAULT_MAX_PIXELS
DEFAULT_MAX_SCANS = _kernel.DEFAULT_MAX_SCANS

_local = threading.local()


def _decoder(max_pixels, max_scans, strict):
    dec = getattr(_local, "decoder", None)
    if dec is None:
        dec = _local.decoder = _kernel.Decoder()
    dec.set_limits(max_pixels, max_scans, strict)
    return dec


def is_jpeg(data) -> bool:
    """True when the bytes start with a JPEG SOI marker."""
    return len(data) >= 2 and data[0] == 0xFF and data[1] == 0xD8


def _pillow_rgb(data, max_pixels):
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
            if w * h > max_pixels:
                raise DecodeError(
                    f"image declares {w}x{h} = {w * h} pixels, over the decompression-bomb "
                    f"limit max_pixels={max_pixels}")
            return np.asarray(im.convert("RGB"))
    except DecodeError:
        raise
    except Image.DecompressionBombError as e:
        raise DecodeError(f"decompression bomb refused by Pillow: {e}") from None
    except Exception as e:  # Pillow raises many types for bad data
        if len(data) == 0:
            raise DecodeError("empty input (0 bytes)") from None
        raise DecodeError(f"not a decodable image ({type(e).__name__}: {e})") from None


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
           max_scans=DEFAULT_MAX_SCANS) -> np.ndarray:
    """Decode a whole image to an ``(H, W, 3)`` uint8 RGB array.

    ``strict=True`` refuses JPEGs that libjpeg can only partly decode (truncated
    or corrupt entropy data).  With ``strict=False`` such a file decodes: rows
    past a truncation are filled with mid-grey (libjpeg's behaviour) and
    corrupt segments come out as libjpeg reconstructs them.
    """
    data = _as_bytes(data)
    if is_jpeg(data):
        return _decoder(max_pixels, max_scans, strict).decode(data)
    return _pillow_rgb(data, max_pixels)


def decode_crop(data, box, size, flip=False, out=None, *, strict=True,
                max_pixels=DEFAULT_MAX_PIXELS, max_scans=DEFAULT_MAX_SCANS) -> np.ndarray:
    """Fused crop + resize (+ horizontal flip).

    ``box=(top, left, height, width)`` is in full-resolution pixels (fractions
    allowed); ``size=(h, w)`` is the output.  The JPEG is decoded at the largest
    DCT scale 1/d, d in (1, 2, 4, 8), that keeps the box at least ``size`` on
    both sides, and only the rows and columns the resampling filter reads are
    decoded.  Resampling follows Pillow's ``BILINEAR`` (antialiased when
    shrinking).  Writes into ``out`` (an ``(h, w, 3)`` uint8 array with
    contiguous rows) when given and returns it.
    """
    data = _as_bytes(data)
    box = _box4(box)
    dec = _decoder(max_pixels, max_scans, strict)
    if is_jpeg(data):
        return dec.decode_crop(data, box, size, flip, out)
    return dec.resize(_pillow_rgb(data, max_pixels), box, size, flip, out)


def decode_random_crop(data, size, seed, epoch, sample_id, echo_index=0, *,
                       scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip_p=0.5, out=None,
                       strict=True, max_pixels=DEFAULT_MAX_PIXELS, max_scans=DEFAULT_MAX_SCANS):
    """torchvision-style RandomResizedCrop + RandomHorizontalFlip, fused with decoding.

    The crop and flip are a pure function of ``(seed, epoch, sample_id,
    echo_index)`` and the image size (see :func:`random_resized_crop_params`).
    Returns ``(image, box, flip)``.
    """
    data = _as_bytes(data)
    dec = _decoder(max_pixels, max_scans, strict)
    if out is None:
        out = np.empty((*_pair(size), 3), dtype=np.uint8)
    if is_jpeg(data):
        box, flip = dec.decode_random_crop(data, size, seed, epoch, sample_id, echo_index,
                                           scale, ratio, flip_p, out)
        return out, box, flip
    image = _pillow_rgb(data, max_pixels)
    box, flip = _kernel.random_resized_crop_params(seed, epoch, sample_id, echo_index,
                                                   image.shape[0], image.shape[1], scale,
                                                   ratio, flip_p)
    return dec.resize(image, box, size, flip, out), box, flip


def decode_center_crop(data, size, resize_size=None, out=None, *, strict=True,
                       max_pixels=DEFAULT_MAX_PIXELS, max_scans=DEFAULT_MAX_SCANS):
    """Evaluation transform: ``Resize(resize_size)`` then ``CenterCrop(size)``, fused.

    ``resize_size`` defaults to ``round(size / 0.875)`` (256 for 224).  The two
    torchvision steps become one resampling of the matching box of the
    original, so there is one rounding instead of two.
    """
    side = _positive_int("size", size)
    resize_side = int(round(side / 0.875)) if resize_size is None else \
        _positive_int("resize_size", resize_size)
    data = _as_bytes(data)
    dec = _decoder(max_pixels, max_scans, strict)
    if is_jpeg(data):
        h, w, _, _ = dec.info(data)
        box = _kernel.center_crop_box(h, w, resize_side, side)
        return dec.decode_crop(data, box, (side, side), False, out)
    image = _pillow_rgb(data, max_pixels)
    box = _kernel.center_crop_box(image.shape[0], image.shape[1], resize_side, side)
    return dec.resize(image, box, (side, side), False, out)


def decode_canvas(data, min_side, out=None, *, strict=True, max_pixels=DEFAULT_MAX_PIXELS,
                  max_scans=DEFAULT_MAX_SCANS):
    """The whole image at the coarsest DCT scale whose shorter side stays >= ``min_side``.

    This is what echoing before augmentation stores: a canvas from which every
    echo cuts its own random crop with :func:`resize_crop`.  ``out`` may be any
    large-enough writable uint8 buffer; returns ``(canvas, scale)`` where
    ``canvas`` is an ``(h, w, 3)`` view of it and ``scale`` the DCT denominator
    (box coordinates on the canvas are the original's divided by ``scale``).
    Non-JPEG images are decoded by Pillow and reduced by the same rule.
    """
    min_side = _positive_int("min_side", min_side)  # here so the Pillow path refuses it too
    data = _as_bytes(data)
    dec = _decoder(max_pixels, max_scans, strict)
    if is_jpeg(data):
        return dec.decode_canvas(data, min_side, out)
    image = _pillow_rgb(data, max_pixels)
    h, w = image.shape[:2]
    d = 8
    while d > 1 and (-(-h // d) < min_side or -(-w // d) < min_side):
        d //= 2
    if d > 1:
        from PIL import Image
        image = np.asarray(Image.fromarray(image).reduce(d))
    if out is not None:
        flat = np.asarray(out)
        # Same checks as the JPEG path: a non-contiguous array would be copied
        # by reshape (the canvas would never reach `out`), another dtype cast.
        if (flat.dtype != np.uint8 or not flat.flags.c_contiguous
                or not flat.flags.writeable):
            raise ValueError("out must be a writable contiguous uint8 buffer, got "
                             f"{flat.dtype} contiguous={flat.flags.c_contiguous} "
                             f"writeable={flat.flags.writeable}")
        flat = flat.reshape(-1)
        if flat.size < image.size:
            raise ValueError(f"canvas buffer holds {flat.size} bytes, a {image.shape[0]}x"
                             f"{image.shape[1]} canvas needs {image.size}")
        view = flat[: image.size].reshape(image.shape)
        view[...] = image
        image = view
    return image, d


def resize_crop(image, box, size, flip=False, out=None) -> np.ndarray:
    """Crop ``box`` of an ``(H, W, 3)`` uint8 image, resize to ``size``, optionally flip.

    The same resampling as :func:`decode_crop`, for canvases already in memory.
    """
    return _decoder(DEFAULT_MAX_PIXELS, DEFAULT_MAX_SCANS, True).resize(
        np.ascontiguousarray(image), _box4(box), size, flip, out)


def image_size(data, *, max_pixels=DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """``(height, width)`` from the header, without decoding pixels."""
    data = _as_bytes(data)
    if is_jpeg(data):
        h, w, _, _ = _decoder(max_pixels, DEFAULT_MAX_SCANS, True).info(data)
        return h, w
    from PIL import Image
    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.size[1], im.size[0]
    except Exception as e:
        raise DecodeError(f"not a decodable image ({type(e).__name__}: {e})") from None


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

"""Stage 1b of the pipeline: what each sample becomes (the augmentation specs).

A transform is a small frozen spec that validates itself.  Workers call
``apply`` to write sample ``i`` of a ring slot: its pixels and the metadata
that says how they were made (crop box, flip, shapes).  Bad data raises
:class:`~echo_native.errors.DecodeError` (or ``ValueError``); the worker applies
the error policy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from echo_native import _kernel
from echo_native.decode import _pillow_rgb, is_jpeg

def check_crop_args(scale, ratio, flip_p):
    """Refuse bad RandomResizedCrop arguments up front (ValueError naming them): inside
    a worker they would fail every sample."""
    _kernel.random_resized_crop_params(0, 0, 0, 0, 1, 1, scale, ratio, flip_p)


def _size2(size):
    return (int(size), int(size)) if isinstance(size, int) else (int(size[0]), int(size[1]))


@dataclass(frozen=True)
class RandomResizedCrop:
    """torchvision's RandomResizedCrop + RandomHorizontalFlip, fused with decoding."""

    size: tuple
    scale: tuple = (0.08, 1.0)
    ratio: tuple = (3 / 4, 4 / 3)
    flip_p: float = 0.5

    def __post_init__(self):
        check_crop_args(self.scale, self.ratio, self.flip_p)

    @property
    def sample_bytes(self):
        h, w = _size2(self.size)
        return h * w * 3

    def apply(self, dec, data, key, slot, i):
        seed, epoch, sid, echo = key
        size = _size2(self.size)
        out = slot.pixels[i].reshape(*size, 3)
        if is_jpeg(data):
            box, flip = dec.decode_random_crop(data, size, seed, epoch, sid, echo, self.scale,
                                               self.ratio, self.flip_p, out)
        else:
            image = _pillow_rgb(data, dec.limits["max_pixels"])
            box, flip = _kernel.random_resized_crop_params(
                seed, epoch, sid, echo, image.shape[0], image.shape[1], self.scale, self.ratio,
                self.flip_p)
            dec.resize(image, box, size, flip, out)
        slot.boxes[i] = box
        slot.flip[i] = flip
        slot.shapes[i] = size


@dataclass(frozen=True)
class CenterCrop:
    """Evaluation transform: Resize(resize_size) + CenterCrop(size), fused."""

    size: int
    resize_size: int

    @property
    def sample_bytes(self):
        return self.size * self.size * 3

    def apply(self, dec, data, key, slot, i):
        size = (self.size, self.size)
        out = slot.pixels[i].reshape(*size, 3)
        if is_jpeg(data):
            h, w, _, _ = dec.info(data)
            box = _kernel.center_crop_box(h, w, self.resize_size, self.size)
            dec.decode_crop(data, box, size, False, out)
        else:
            image = _pillow_rgb(data, dec.limits["max_pixels"])
            box = _kernel.center_crop_box(image.shape[0], image.shape[1], self.resize_size,
                                          self.size)
            dec.resize(image, box, size, False, out)
        slot.boxes[i] = box
        slot.flip[i] = False
        slot.shapes[i] = size


@dataclass(frozen=True)
class Canvas:
    """The whole image, kept for echoing before augmentation.

    Decoded at the coarsest DCT scale whose shorter side is still >=
    ``min_side``; if that canvas exceeds ``max_pixels`` (very elongated or very
    large images) it is shrunk uniformly to fit, so the per-sample budget, and
    with it the ring and echo-buffer memory, is fixed.  The crop of each
    emission is drawn later, in the original's coordinates.
    """

    min_side: int
    max_pixels: int

    @property
    def sample_bytes(self):
        return self.max_pixels * 3

    def apply(self, dec, data, key, slot, i):
        row = slot.pixels[i]
        if is_jpeg(data):
            H, W, _, _ = dec.info(data)
            ch, cw, d = dec.canvas_shape(data, self.min_side)
            if ch * cw <= self.max_pixels:
                dec.decode_canvas(data, self.min_side, row)
                shape, scale = (ch, cw), (float(d), float(d))
            else:
                canvas, d = dec.decode_canvas(data, self.min_side)
                shape, scale = self._fit(dec, canvas, H * W, row)
                scale = (scale[0] * d, scale[1] * d)
        else:
            canvas = _pillow_rgb(data, dec.limits["max_pixels"])
            H, W = canvas.shape[:2]
            if H * W <= self.max_pixels:
                row[:canvas.size] = canvas.reshape(-1)
                shape, scale = (H, W), (1.0, 1.0)
            else:
                shape, scale = self._fit(dec, canvas, H * W, row)
        slot.shapes[i] = shape
        slot.source_hw[i] = (H, W)
        slot.canvas_scale[i] = scale
        slot.boxes[i] = (0, 0, H, W)
        slot.flip[i] = False

    def _fit(self, dec, canvas, source_pixels, row):
        ch, cw = canvas.shape[:2]
        t = math.sqrt(self.max_pixels / (ch * cw))
        h, w = max(1, int(ch * t)), max(1, int(cw * t))
        dec.resize(canvas, (0, 0, ch, cw), (h, w), False, row[:h * w * 3].reshape(h, w, 3))
        return (h, w), (ch / h, cw / w)

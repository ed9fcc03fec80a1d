"""Stage 1b of the pipeline: what each sample becomes (the augmentation specs).

A spec is a small frozen object that validates itself when it is made, so a
mistake is reported where the user wrote it, not as a failed sample inside a
worker.  Workers call ``apply`` to write sample ``i`` of a ring slot: its
pixels and the metadata that says how they were made (crop box, flip,
shapes).  How the bytes are decoded is :class:`echo_native.decode.Decoder`'s
business; bad data raises :class:`~echo_native.errors.DecodeError` and the
worker applies the error policy.

- :class:`RandomResizedCrop`: training, torchvision's RandomResizedCrop +
  RandomHorizontalFlip, drawn from (seed, epoch, sample id, echo index).
- :class:`CenterCrop`: evaluation, torchvision's Resize + CenterCrop.
- :class:`Canvas`: what echoing before augmentation keeps (internal).

An echo redraws what follows the geometry: a crop spec's ``redraw`` writes each
emission's crop box and flip into the rows of its record
(:class:`~echo_native.batch.Columns`) and says how to make its pixels from the
stored one (:class:`Redrawn`); :class:`Stored` is the spec of an echo after
augmentation, the stored image itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from echo_native import _kernel
from echo_native._checks import size_pair
from echo_native.decode import default_resize


def _pair_of_floats(value, name, owner):
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise TypeError(f"{owner}: {name} must be a pair of numbers, got {value!r}") from None
    return lo, hi


def check_crop_args(scale, ratio, flip_p):
    """Refuse bad RandomResizedCrop arguments up front (ValueError naming them): inside
    a worker they would fail every sample."""
    _kernel.random_resized_crop_params(0, 0, 0, 0, 1, 1, scale, ratio, flip_p)


class Redrawn(NamedTuple):
    """How an emission's pixels come from its stored entry, after ``redraw``.

    ``canvas_boxes`` (n, 4) float64: the crop on each stored canvas (re-augmentation),
    or None to gather the stored images as they are, mirrored where ``mirror`` (n,)
    bool says.  ``placed``: for windows reaching past the image (a zoom-out), ``(rows,
    canvas boxes, output rectangles)`` of the part on the image, else None."""

    canvas_boxes: object = None
    mirror: object = None
    placed: object = None


def emission_flips(seed, epochs, sample_ids, echo_index, flip_p):
    """Each emission's flip as a RandomResizedCrop draws it: its own Philox block, so
    the image's size does not matter."""
    ones = np.ones((len(sample_ids), 2), np.int32)
    return _kernel.random_resized_crops(seed, epochs, sample_ids,
                                        np.asarray(echo_index, np.int32), ones,
                                        ones.astype(np.float32), ones, flip_p=flip_p)[1]


class _FixedSize:
    """A transform whose every sample is ``size`` = (height, width) RGB pixels."""

    size: tuple

    @property
    def sample_bytes(self):
        h, w = self.size
        return h * w * 3

    def _pixels(self, slot, i):
        return slot.pixels[i].reshape(*self.size, 3)


@dataclass(frozen=True)
class RandomResizedCrop(_FixedSize):
    """torchvision's ``RandomResizedCrop(size, scale, ratio)`` + ``RandomHorizontalFlip(flip_p)``,
    fused with the decode.

    Parameters
    ----------
    size : int or (height, width), default 224
        Output size; stored as ``(height, width)``.
    scale : (float, float), default (0.08, 1.0)
        Range of the crop's area as a fraction of the image's.
    ratio : (float, float), default (3/4, 4/3)
        Range of the crop's aspect ratio (width / height), drawn log-uniformly.
    flip_p : float, default 0.5
        Probability of a horizontal flip.

    Every crop and flip is a pure function of (seed, epoch, sample id, echo
    index): any worker draws the same, and every echo draws its own.
    """

    size: tuple = (224, 224)
    scale: tuple = (0.08, 1.0)
    ratio: tuple = (3 / 4, 4 / 3)
    flip_p: float = 0.5

    def __post_init__(self):
        name = type(self).__name__
        set_ = object.__setattr__
        set_(self, "size", size_pair(self.size, f"{name}: size"))
        set_(self, "scale", _pair_of_floats(self.scale, "scale", name))
        set_(self, "ratio", _pair_of_floats(self.ratio, "ratio", name))
        try:
            set_(self, "flip_p", float(self.flip_p))
        except (TypeError, ValueError):
            raise TypeError(f"{name}: flip_p must be a number, got {self.flip_p!r}") from None
        try:
            check_crop_args(self.scale, self.ratio, self.flip_p)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None

    def apply(self, dec, data, key, slot, i):
        out = self._pixels(slot, i)
        box, flip = dec.random_crop(data, self.size, key, self.scale, self.ratio, self.flip_p,
                                    out)
        slot.boxes[i] = box
        slot.flip[i] = flip
        slot.shapes[i] = self.size

    def redraw(self, seed, epochs, sample_ids, echo_index, columns):
        """Each emission's crop and flip of a stored canvas, drawn in the original's
        coordinates from (seed, epoch, sample id, echo index), as a worker draws them,
        then mapped onto the canvas, in one native call."""
        boxes, flips, canvas = _kernel.random_resized_crops(
            seed, epochs, sample_ids, np.asarray(echo_index, np.int32), columns.source_hw,
            columns.canvas_scale, columns.shapes, self.scale, self.ratio, self.flip_p)
        columns.boxes[:] = boxes
        columns.flip[:] = flips
        return Redrawn(canvas_boxes=canvas)


@dataclass(frozen=True)
class Stored:
    """An echo after augmentation: the stored image, cropped once by the worker.  With
    ``redraw_flip`` (``Echo(flip=True)``) each echo draws its own flip, the fresh
    emission keeps the worker's."""

    flip_p: float
    redraw_flip: bool = False

    def redraw(self, seed, epochs, sample_ids, echo_index, columns):
        if not self.redraw_flip:
            return Redrawn()
        redo = np.asarray(echo_index) > 0
        drawn = emission_flips(seed, epochs, sample_ids, echo_index, self.flip_p)
        stored = columns.flip.view(bool)
        mirror = redo & (drawn != stored)
        columns.flip[:] = np.where(redo, drawn, stored)
        return Redrawn(mirror=mirror)


@dataclass(frozen=True)
class CenterCrop(_FixedSize):
    """Evaluation: torchvision's ``Resize(resize)`` + ``CenterCrop(size)``, fused.

    Parameters
    ----------
    size : int or (height, width), default 224
        Output size; stored as ``(height, width)``.
    resize : int, optional
        The shorter side after resizing (torchvision's ``Resize(int)``);
        default ``round(max(size) / 0.875)``: 256 for 224.

    The two torchvision steps are one resampling of the matching box of the
    original (one rounding instead of two), decoded at a reduced DCT scale when
    the box is at least twice the output size.  Against torchvision's own
    pipeline on the same file the pixels differ by about one level on average
    (``tests/test_evaluation.py`` states the bound).
    """

    size: tuple = (224, 224)
    resize: int = None
    #: Never flipped (an echo after augmentation redraws no flip either).
    flip_p = 0.0

    def __post_init__(self):
        name = type(self).__name__
        object.__setattr__(self, "size", size_pair(self.size, f"{name}: size"))
        if self.resize is None:
            object.__setattr__(self, "resize", default_resize(self.size))
        elif (not isinstance(self.resize, (int, np.integer)) or isinstance(self.resize, bool)
              or not 0 < self.resize <= 65535):
            raise ValueError(f"{name}: resize must be a positive integer (the shorter side "
                             f"after resizing), got {self.resize!r}")
        object.__setattr__(self, "resize", int(self.resize))

    def apply(self, dec, data, key, slot, i):
        out = self._pixels(slot, i)
        slot.boxes[i] = dec.center_crop(data, self.resize, self.size, out)
        slot.flip[i] = False
        slot.shapes[i] = self.size


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

    def __post_init__(self):
        if self.min_side <= 0 or self.max_pixels < self.min_side * self.min_side:
            raise ValueError(f"canvas_max_pixels ({self.max_pixels}) must be at least "
                             f"canvas_side^2 ({self.min_side * self.min_side})")

    @property
    def sample_bytes(self):
        return self.max_pixels * 3

    def apply(self, dec, data, key, slot, i):
        canvas, scale, source = dec.canvas(data, self.min_side, self.max_pixels, slot.pixels[i])
        slot.shapes[i] = canvas.shape[:2]
        slot.source_hw[i] = source
        slot.canvas_scale[i] = scale
        slot.boxes[i] = (0, 0) + tuple(source)
        slot.flip[i] = False


def canvas_for(crop: RandomResizedCrop, side=None, max_pixels=None):
    """The :class:`Canvas` that echoing before augmentation keeps for ``crop``: shorter
    side at least ``side`` (default the crop's larger output side), at most
    ``max_pixels`` (default 2 x side^2)."""
    side = int(side or max(crop.size))
    budget = int(max_pixels or 2 * side * side)
    return Canvas(min_side=side, max_pixels=budget)

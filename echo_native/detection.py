"""Stage 1b, for detection: box-aware geometry with torchvision v2's semantics.

``augment=[RandomZoomOut(...), RandomIoUCrop(), RandomHorizontalFlip(),
Resize((300, 300)), SanitizeBoundingBoxes(), ColorJitter(...)]``: SSD's
training transforms as torchvision's detection reference composes them, with
the same parameters and distributions.  The geometric steps fold into one
:class:`BoxCrop`: a window of the source image (reaching outside it where
the zoom-out pads), a flip and the output size.  It is drawn before decoding,
from the sample's boxes and the key (seed, epoch, sample id, echo index), so
the fused ROI + DCT-scaled decode still reads only the window; a zoom-out's
padding is filled around the decoded part.  The boxes follow at the consumer
(:mod:`echo_native.boxes`), for fresh examples and every echo alike.

The order is torchvision's reference order and the only one accepted:
``[RandomZoomOut] [RandomIoUCrop] [RandomHorizontalFlip] Resize
[SanitizeBoundingBoxes]``, then per-example ops.  ``Resize`` takes a fixed
``(height, width)``: a batch holds images of one size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from echo_native._checks import is_int, number, positive_int, size_pair
from echo_native._ring import OBJ_DROPPED
from echo_native.transforms import Redrawn, _FixedSize

__all__ = ["RandomZoomOut", "RandomIoUCrop", "RandomHorizontalFlip", "Resize",
           "SanitizeBoundingBoxes", "BoxCrop", "split_geometry"]

_TAG = 0x626F786372  # "boxcr": the geometry's own Philox key word, apart from the crop's
#: IoU-crop rounds before the image is left as it is.  torchvision loops until a round
#: draws the "leave" option or finds a crop; with no qualifying crop that takes 7 rounds
#: on average, and 100 end it with probability 1 - (6/7)^100 (all but 2e-7).
_ROUNDS = 100


def _fill(owner, fill):
    values = (fill,) * 3 if is_int(fill) else tuple(fill) if isinstance(fill, (tuple, list)) \
        else None
    if values is None or len(values) != 3 or not all(is_int(v) and 0 <= v <= 255
                                                     for v in values):
        raise ValueError(f"{owner}: fill must be an integer 0-255 or an (R, G, B) triple of "
                         f"them, got {fill!r}")
    return tuple(int(v) for v in values)


def _range(owner, name, value, lo, hi=math.inf):
    try:
        a, b = (float(v) for v in value)
    except (TypeError, ValueError):
        raise TypeError(f"{owner}: {name} must be a pair of numbers, got {value!r}") from None
    if not (lo <= a <= b <= hi) or not math.isfinite(a + b):
        raise ValueError(f"{owner}: {name} must be (low, high) with {lo} <= low <= high"
                         f"{' <= ' + str(hi) if hi != math.inf else ''}, got {value!r}")
    return a, b


@dataclass(frozen=True)
class RandomZoomOut:
    """torchvision v2's ``RandomZoomOut``: with probability ``p``, place the image on a
    canvas ``r`` times its size (``r`` uniform in ``side_range``) at a random offset,
    the rest ``fill``."""

    fill: object = 0
    side_range: tuple = (1.0, 4.0)
    p: float = 0.5

    def __post_init__(self):
        object.__setattr__(self, "fill", _fill("RandomZoomOut", self.fill))
        object.__setattr__(self, "side_range",
                           _range("RandomZoomOut", "side_range", self.side_range, 1.0, 64.0))
        object.__setattr__(self, "p", number("RandomZoomOut", "p", self.p, 0.0, 1.0))


@dataclass(frozen=True)
class RandomIoUCrop:
    """torchvision v2's ``RandomIoUCrop`` (SSD's crop): a minimum IoU drawn from
    ``sampler_options`` (1.0 or more: leave the image), then up to ``trials`` crops
    of ``min_scale``-``max_scale`` of each side and an aspect ratio in range, kept when
    some box's centre is inside it and that box overlaps it by the minimum IoU.
    Boxes whose centres fall outside are dropped (``SanitizeBoundingBoxes``)."""

    min_scale: float = 0.3
    max_scale: float = 1.0
    min_aspect_ratio: float = 0.5
    max_aspect_ratio: float = 2.0
    sampler_options: tuple = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0)
    trials: int = 40

    def __post_init__(self):
        name, set_ = "RandomIoUCrop", object.__setattr__
        lo, hi = _range(name, "(min_scale, max_scale)", (self.min_scale, self.max_scale),
                        0.0, 1.0)
        if lo <= 0.0:
            raise ValueError(f"{name}: min_scale must be > 0, got {self.min_scale!r}")
        set_(self, "min_scale", lo)
        set_(self, "max_scale", hi)
        a, b = _range(name, "(min_aspect_ratio, max_aspect_ratio)",
                      (self.min_aspect_ratio, self.max_aspect_ratio), 0.0)
        set_(self, "min_aspect_ratio", a)
        set_(self, "max_aspect_ratio", b)
        try:
            options = tuple(float(v) for v in self.sampler_options)
        except (TypeError, ValueError):
            options = ()
        if not options or not all(math.isfinite(v) and v >= 0 for v in options):
            raise ValueError(f"{name}: sampler_options must be minimum IoUs >= 0 (1.0: leave "
                             f"the image), got {self.sampler_options!r}")
        set_(self, "sampler_options", options)
        set_(self, "trials", positive_int(name, "trials", self.trials, 1, 10_000))


@dataclass(frozen=True)
class RandomHorizontalFlip:
    """torchvision's ``RandomHorizontalFlip(p)``; the boxes are mirrored with the image."""

    p: float = 0.5

    def __post_init__(self):
        object.__setattr__(self, "p", number("RandomHorizontalFlip", "p", self.p, 0.0, 1.0))


@dataclass(frozen=True)
class Resize:
    """torchvision's ``Resize((height, width))``: the window to a fixed output size.

    A shorter side with a ``max_size`` (detection models' own resize) gives every
    image its own size, which one batch array cannot hold: give both sides here and
    let the model resize further if it must."""

    size: tuple

    def __post_init__(self):
        if is_int(self.size):
            raise ValueError(f"Resize: size must be (height, width): a single number resizes "
                             f"the shorter side and gives every image its own shape, which a "
                             f"batch cannot hold; got {self.size!r}")
        object.__setattr__(self, "size", size_pair(self.size, "Resize: size"))


@dataclass(frozen=True)
class SanitizeBoundingBoxes:
    """torchvision v2's ``SanitizeBoundingBoxes``: drop boxes (and their labels)
    narrower or lower than ``min_size``, smaller than ``min_area``, or outside the
    image, and those a ``RandomIoUCrop`` dropped.  Applied to ``batch.objects``."""

    min_size: float = 1.0
    min_area: float = 1.0

    def __post_init__(self):
        for name in ("min_size", "min_area"):
            object.__setattr__(self, name, number("SanitizeBoundingBoxes", name,
                                                  getattr(self, name), 0.0))


GEOMETRY = (RandomZoomOut, RandomIoUCrop, RandomHorizontalFlip, Resize, SanitizeBoundingBoxes)


@dataclass(frozen=True)
class BoxCrop(_FixedSize):
    """The geometric steps of a detection ``augment=`` list, folded: an optional
    zoom-out, an optional IoU crop, a flip with probability ``flip_p``, the resize
    to ``size``.  Workers call :meth:`apply`; echoes before augmentation call
    :meth:`draw` for every emission."""

    size: tuple
    zoom_out: RandomZoomOut = None
    iou_crop: RandomIoUCrop = None
    flip_p: float = 0.0

    #: Workers pass the sample's targets to ``apply`` (its boxes steer the IoU crop).
    takes_targets = True

    def draw(self, key, image_hw, boxes):
        """``(window, flip, dropped)`` for the sample keyed ``key`` = (seed, epoch, sample
        id, echo index), an image of ``image_hw`` and its ``boxes`` (N, 4) xyxy in source
        pixels: the window ``(top, left, height, width)`` in source pixels, whether to
        flip, and which boxes the IoU crop dropped ((N,) bool)."""
        seed, epoch, sample_id, echo_index = (int(v) for v in key)
        rng = np.random.Generator(np.random.Philox(
            key=np.array([seed & (2**64 - 1), _TAG], np.uint64), counter=[epoch, sample_id, echo_index, 0]))
        h, w = (int(v) for v in image_hw)
        boxes = np.asarray(boxes, np.float32).reshape(-1, 4)
        # The current canvas as a window of the source: (top, left, height, width).
        top, left, ch, cw = 0, 0, h, w
        z = self.zoom_out
        if z is not None and rng.random() < z.p:
            r = z.side_range[0] + rng.random() * (z.side_range[1] - z.side_range[0])
            cw, ch = int(w * r), int(h * r)
            u = rng.random(2)
            pad_left, pad_top = int((cw - w) * u[0]), int((ch - h) * u[1])
            top, left = -pad_top, -pad_left
        dropped = np.zeros(len(boxes), bool)
        if self.iou_crop is not None:
            crop = _iou_crop(self.iou_crop, rng, ch, cw, boxes - np.float32(
                [left, top, left, top]))
            if crop is not None:
                ct, cl, ch, cw, within = crop
                top, left, dropped = top + ct, left + cl, ~within
        flip = self.flip_p > 0 and rng.random() < self.flip_p
        return (top, left, ch, cw), bool(flip), dropped

    def apply(self, dec, data, key, slot, i, targets=None):
        """Draw the geometry from ``targets``' boxes, decode the window into position
        ``i`` of the slot, record it; returns which boxes the IoU crop dropped."""
        if targets is not None and targets.image_hw is not None:
            ih, iw = targets.image_hw  # checked against this image's header by the worker
        else:
            ih, iw = dec.size(data)
        boxes = np.zeros((0, 4), np.float32) if targets is None else targets.boxes
        window, flip, dropped = self.draw(key, (ih, iw), boxes)
        decode_window(dec, data, (ih, iw), window, flip, self._pixels(slot, i),
                      self.zoom_out.fill if self.zoom_out is not None else (0, 0, 0))
        slot.boxes[i] = window
        slot.flip[i] = flip
        slot.shapes[i] = self.size
        slot.source_hw[i] = (ih, iw)
        return dropped

    def redraw(self, seed, epochs, sample_ids, echo_index, columns):
        """Each emission's window and flip (:meth:`draw`, from the stored boxes), and
        which boxes its IoU crop drops, written into ``columns``; the window mapped onto
        the stored canvas, and for windows a zoom-out takes past the image the part on
        it (:class:`~echo_native.transforms.Redrawn`)."""
        n = len(columns)
        windows, flags = columns.boxes, columns.obj_flags
        for k in range(n):
            count = int(columns.obj_count[k])
            windows[k], columns.flip[k], drop = self.draw(
                (seed, epochs[k], sample_ids[k], echo_index[k]), columns.source_hw[k],
                columns.obj_boxes[k, :count])
            # This emission's IoU crop, in place of the one the worker drew.
            flags[k] &= np.uint8(~OBJ_DROPPED & 0xFF)
            flags[k, :count] |= drop.astype(np.uint8) * np.uint8(OBJ_DROPPED)
        sources = windows.astype(np.float64)
        hw = columns.source_hw.astype(np.float64)
        outside = (sources[:, 0] < 0) | (sources[:, 1] < 0) | \
            (sources[:, 0] + sources[:, 2] > hw[:, 0]) | (sources[:, 1] + sources[:, 3] > hw[:, 1])
        rows = np.flatnonzero(outside)
        rects = np.zeros((len(rows), 4), np.int64)
        flips = columns.flip.view(bool)
        for j, k in enumerate(rows):
            part = inner_rect(hw[k], windows[k], self.size, flips[k])
            if part is None:  # the window misses the image: all fill (a nominal box)
                part = ((0, 0, 0, 0), (0.0, 0.0, 1.0, 1.0))
            rects[j], sources[k] = part
        # Onto the canvas: canvas pixels = original pixels / scale, kept inside it.
        scale = columns.canvas_scale.astype(np.float64)
        chw = columns.shapes.astype(np.float64)
        canvas = np.empty((n, 4), np.float64)
        canvas[:, 0] = sources[:, 0] / scale[:, 0]
        canvas[:, 1] = sources[:, 1] / scale[:, 1]
        canvas[:, 2] = np.minimum(sources[:, 2] / scale[:, 0], chw[:, 0] - canvas[:, 0])
        canvas[:, 3] = np.minimum(sources[:, 3] / scale[:, 1], chw[:, 1] - canvas[:, 1])
        placed = (rows, canvas[rows], rects) if len(rows) else None
        return Redrawn(canvas_boxes=canvas, placed=placed)


def _iou_crop(spec, rng, h, w, boxes):
    """torchvision v2's RandomIoUCrop parameters on an ``h`` x ``w`` canvas whose boxes
    are ``boxes`` (canvas pixels, float32): ``(top, left, height, width, within)`` or
    None to leave the image."""
    if not len(boxes):
        # No box can have its centre in a crop: torchvision draws options until "leave"
        # comes up, so the image is left as it is, whatever the draws.
        return None
    cx = np.float32(0.5) * (boxes[:, 0] + boxes[:, 2])
    cy = np.float32(0.5) * (boxes[:, 1] + boxes[:, 3])
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    options = spec.sampler_options
    for _ in range(_ROUNDS):
        min_iou = options[int(rng.integers(len(options)))]
        if min_iou >= 1.0:
            return None
        for _ in range(spec.trials):
            r = spec.min_scale + (spec.max_scale - spec.min_scale) * rng.random(2)
            new_w, new_h = int(w * r[0]), int(h * r[1])
            if new_h == 0 or not (spec.min_aspect_ratio <= new_w / new_h
                                  <= spec.max_aspect_ratio):
                continue
            u = rng.random(2)
            left, top = int((w - new_w) * u[0]), int((h - new_h) * u[1])
            right, bottom = left + new_w, top + new_h
            if left == right or top == bottom:
                continue
            within = (left < cx) & (cx < right) & (top < cy) & (cy < bottom)
            if not within.any():
                continue
            if _iou(boxes[within], areas[within], (left, top, right, bottom)).max() < min_iou:
                continue
            return top, left, new_h, new_w, within
    return None


def _iou(boxes, areas, crop):
    """IoU of each xyxy box (of ``areas``) with one crop, in float32 as torchvision's
    ``box_iou``."""
    x1, y1, x2, y2 = (np.float32(v) for v in crop)
    iw = np.maximum(np.minimum(boxes[:, 2], x2) - np.maximum(boxes[:, 0], x1), 0)
    ih = np.maximum(np.minimum(boxes[:, 3], y2) - np.maximum(boxes[:, 1], y1), 0)
    inter = iw * ih
    return inter / (areas + (x2 - x1) * (y2 - y1) - inter)


def inner_rect(image_hw, window, size, flip):
    """Where the image lies in the output of ``window`` resized to ``size``: the
    ``(y0, y1, x0, x1)`` output rows and columns whose pixel centres fall inside the
    image, and the source box ``(top, left, height, width)`` that resamples onto
    exactly them; None when the window misses the image."""
    ih, iw = image_hw
    top, left, wh, ww = (float(v) for v in window)
    oh, ow = size
    sy, sx = oh / wh, ow / ww
    y0, y1 = max(0, math.ceil(-top * sy - 0.5)), min(oh, math.ceil((ih - top) * sy - 0.5))
    x0, x1 = max(0, math.ceil(-left * sx - 0.5)), min(ow, math.ceil((iw - left) * sx - 0.5))
    if y1 <= y0 or x1 <= x0:
        return None
    st, sl = max(0.0, top + y0 / sy), max(0.0, left + x0 / sx)
    sh, sw = min(ih - st, (y1 - y0) / sy), min(iw - sl, (x1 - x0) / sx)
    if flip:
        x0, x1 = ow - x1, ow - x0
    return (y0, y1, x0, x1), (st, sl, sh, sw)


def decode_window(dec, data, image_hw, window, flip, out, fill):
    """Decode ``window`` of the image into ``out`` (resized, flipped): the fused crop
    decode when the window lies inside the image, else the part inside it into its
    place and ``fill`` around it."""
    top, left, wh, ww = window
    ih, iw = image_hw
    if top >= 0 and left >= 0 and top + wh <= ih and left + ww <= iw:
        dec.crop(data, window, out.shape[:2], flip, out)
        return
    out[...] = np.asarray(fill, np.uint8)
    inner = inner_rect(image_hw, window, out.shape[:2], flip)
    if inner is not None:
        (y0, y1, x0, x1), box = inner
        dec.crop(data, box, (y1 - y0, x1 - x0), flip, out[y0:y1, x0:x1])


def split_geometry(owner, augment):
    """``(BoxCrop, SanitizeBoundingBoxes or None, rest)`` when ``augment`` (a list)
    starts with detection geometry, else None.  Steps out of order, repeated, or
    without a ``Resize`` are a ValueError naming them."""
    if not isinstance(augment, (list, tuple)) or not augment or \
            not isinstance(augment[0], GEOMETRY):
        return None
    steps, k = {}, 0
    order = [type(s).__name__ for s in augment if isinstance(s, GEOMETRY)]
    while k < len(augment) and isinstance(augment[k], GEOMETRY):
        steps.setdefault(type(augment[k]), []).append(augment[k])
        k += 1
    rest = tuple(augment[k:])
    expected = [c.__name__ for c in GEOMETRY if c in steps]
    if any(len(v) > 1 for v in steps.values()) or order[:k] != expected or \
            any(isinstance(s, GEOMETRY) for s in rest):
        raise ValueError(f"{owner}: detection geometry goes in torchvision's reference order, "
                         f"each step at most once, before the per-example ops: "
                         f"[RandomZoomOut] [RandomIoUCrop] [RandomHorizontalFlip] Resize "
                         f"[SanitizeBoundingBoxes]; got {order}")
    if Resize not in steps:
        raise ValueError(f"{owner}: detection geometry needs a Resize((height, width)) after "
                         f"its crop and flip (a batch holds images of one size); got {order}")
    one = {c: v[0] for c, v in steps.items()}
    flip = one.get(RandomHorizontalFlip)
    crop = BoxCrop(size=one[Resize].size, zoom_out=one.get(RandomZoomOut),
                   iou_crop=one.get(RandomIoUCrop), flip_p=flip.p if flip else 0.0)
    return crop, one.get(SanitizeBoundingBoxes), rest

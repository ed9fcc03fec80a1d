"""Where an image's boxes land: a batch's source boxes through its crops and flips.

Every geometry this pipeline applies to an image is one *window* of the
source image, ``(top, left, height, width)`` in source pixels (it may reach
outside the image: zoom-out), an optional horizontal flip, and a resize of the
window to the output size.  Boxes follow it with torchvision v2's arithmetic,
step by step as ``transforms.v2.functional`` applies it to ``BoundingBoxes``
(float32 throughout):

1. crop: ``boxes - (left, top, left, top)``, clamped to the window;
2. boxes that a ``RandomIoUCrop`` marked (centre outside the crop) become
   ``(0, 0, 0, 0)``, as torchvision zeroes them for ``SanitizeBoundingBoxes``;
3. flip: ``x1, x2 = w - x2, w - x1``;
4. resize: times ``(W / w, H / h, W / w, H / h)``, then clamped to the output canvas
   ``[0, W] x [0, H]``: torchvision does not clamp here, and a float32 rounding past
   the canvas's edge makes its ``SanitizeBoundingBoxes`` drop a visible object
   (docs/detection-semantics.md, "Deliberate differences").  Boxes never leave the
   canvas after any step.

:func:`map_boxes` does it for a whole batch at once, on padded arrays;
:func:`sanitize` is ``SanitizeBoundingBoxes``'s test of which boxes are kept.
Both are NumPy, so they run wherever the batch's metadata is (the consumer),
for fresh examples and for every echo alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from echo_native._ring import OBJ_CROWD, OBJ_DROPPED
from echo_native.targets import FIELDS, given_fields

__all__ = ["map_boxes", "sanitize", "pack", "SourceObjects", "Objects"]

#: Per-object flag bits, as the ring's obj_flags carry them (src/ring/en_ring.h).
CROWD, DROPPED = OBJ_CROWD, OBJ_DROPPED


def map_boxes(boxes, windows, flips, size, dropped=None):
    """Source boxes ``(B, M, 4)`` xyxy through each row's window, flip and resize.

    Parameters
    ----------
    boxes : (B, M, 4) float32, xyxy in source pixels (padding rows are ignored
        by the caller: they map like any box)
    windows : (B, 4), each row's ``(top, left, height, width)`` in source pixels
    flips : (B,) bool
    size : (H, W) of the output
    dropped : (B, M) bool or None, boxes whose centre fell outside an IoU crop

    Returns (B, M, 4) float32, xyxy in output pixels, inside ``[0, W] x [0, H]``.
    """
    boxes = np.asarray(boxes, np.float32)
    windows = np.asarray(windows, np.float64)
    out_h, out_w = (int(v) for v in size)
    top, left = windows[:, 0, None], windows[:, 1, None]
    height, width = windows[:, 2, None], windows[:, 3, None]
    shift = np.stack([left, top, left, top], axis=-1).astype(np.float32)  # (B, 1, 4)
    b = boxes - shift
    # Clamped to the window as float32, like torchvision's clamp_bounding_boxes.
    np.clip(b[..., 0::2], 0, width[..., None].astype(np.float32), out=b[..., 0::2])
    np.clip(b[..., 1::2], 0, height[..., None].astype(np.float32), out=b[..., 1::2])
    if dropped is not None:
        b[np.asarray(dropped, bool)] = 0.0
    flips = np.asarray(flips, bool)
    if flips.any():
        w = width[flips].astype(np.float32)                       # (F, 1)
        x1, x2 = b[flips, :, 0], b[flips, :, 2]
        b[flips, :, 0], b[flips, :, 2] = w - x2, w - x1
    # The ratios are Python floats in torchvision, multiplied in the boxes' float32.
    ratios = np.empty((len(b), 1, 4), np.float32)
    ratios[:, 0, 0::2] = (out_w / width).astype(np.float32)
    ratios[:, 0, 1::2] = (out_h / height).astype(np.float32)
    b *= ratios
    # torchvision stops here, and its float32 ratio can put a box that ends on the
    # window's edge past the canvas (75 * float32(160 / 75) = 160.0000153), which
    # SanitizeBoundingBoxes then drops although the object is fully visible.  Clamped,
    # a box never leaves the canvas; only coordinates past it change.
    np.clip(b[..., 0::2], 0, np.float32(out_w), out=b[..., 0::2])
    np.clip(b[..., 1::2], 0, np.float32(out_h), out=b[..., 1::2])
    return b


def sanitize(boxes, valid, size, min_size=1.0, min_area=1.0):
    """Which boxes ``SanitizeBoundingBoxes(min_size, min_area)`` keeps: ``valid`` and
    at least ``min_size`` wide and high, at least ``min_area`` in area, with every
    coordinate in the ``size = (H, W)`` image."""
    b = np.asarray(boxes, np.float32)
    h, w = (float(v) for v in size)
    ws, hs = b[..., 2] - b[..., 0], b[..., 3] - b[..., 1]
    keep = np.asarray(valid, bool) & (ws >= min_size) & (hs >= min_size)
    keep &= ws * hs >= min_area
    keep &= (b >= 0).all(axis=-1)
    keep &= (b[..., 0] <= w) & (b[..., 2] <= w) & (b[..., 1] <= h) & (b[..., 3] <= h)
    return keep


def pack(keep, *arrays, width=None):
    """The kept entries of each row moved to its front, in order, padded to ``width``
    (default: the largest number kept in a row): ``(valid, *packed)``.

    ``keep`` is (B, M) bool; each array is (B, M, ...).  Padding entries are zero."""
    keep = np.asarray(keep, bool)
    counts = keep.sum(axis=1)
    m = int(counts.max(initial=0)) if width is None else int(width)
    if m < counts.max(initial=0):
        raise ValueError(f"a batch row keeps {int(counts.max())} boxes, more than the "
                         f"{m} its padded arrays hold")
    rows, cols = np.nonzero(keep)
    # Position of each kept entry within its row: its rank among that row's kept ones.
    # (Starts as cumsum - counts: right for a batch of no rows too, every sample failed.)
    starts = np.cumsum(counts) - counts
    slots = np.arange(len(rows)) - np.repeat(starts, counts)
    valid = np.zeros((len(keep), m), bool)
    valid[rows, slots] = True
    packed = []
    for a in arrays:
        a = np.asarray(a)
        out = np.zeros((len(keep), m) + a.shape[2:], a.dtype)
        out[rows, slots] = a[rows, cols]
        packed.append(out)
    return (valid, *packed)


@dataclass
class SourceObjects:
    """The objects of some rows as their source gave them: padded ``boxes`` (n, M, 4)
    xyxy in source pixels, ``labels`` (n, M), ``flags`` (n, M) (:data:`CROWD`,
    :data:`DROPPED`) and ``counts`` (n,), host arrays; ``fields``, what the records
    hold of each object field they carry (name -> its ``stored`` form: keypoints
    (n, M, K, 3) in source pixels, the bit-packed masks, ...)."""

    boxes: np.ndarray
    labels: np.ndarray
    flags: np.ndarray
    counts: np.ndarray
    fields: dict = None

    def map(self, windows, flips, size, sanitize_spec=None, width=None, rules=None,
            redrawn=None):
        """The :class:`Objects` of these rows after each row's window, flip and resize
        to ``size``, kept as ``sanitize_spec`` (a SanitizeBoundingBoxes or None) says,
        packed to the front of each row, padded to ``width`` (default the most a row
        keeps); each object field follows (``rules``: name -> what the field's
        emission follows, e.g. the source's :class:`~echo_native.keypoints.Keypoints`;
        ``redrawn``: how the images came from the stored ones)."""
        m = self.boxes.shape[1]
        valid = np.arange(m) < self.counts[:, None]
        dropped = (self.flags & DROPPED).astype(bool)
        boxes = map_boxes(self.boxes, windows, flips, size, dropped)
        keep = valid
        if sanitize_spec is not None:
            keep = sanitize(boxes, valid, size, sanitize_spec.min_size, sanitize_spec.min_area)
        crowd = (self.flags & CROWD).astype(bool)
        # Which object each kept entry is: the fields emit only those.
        valid, boxes, labels, crowd, cols = pack(keep, boxes, self.labels, crowd,
                                                 np.broadcast_to(np.arange(m), keep.shape),
                                                 width=width)
        rules = rules or {}
        fields = {name: FIELDS[name].emit(stored, valid, cols, windows, flips, size, redrawn,
                                          rules.get(name))
                  for name, stored in (self.fields or {}).items()}
        return Objects(boxes, labels, valid, crowd, tuple(int(v) for v in size), fields)


@dataclass
class Objects:
    """A batch's objects: ``boxes`` (B, M, 4) float32, xyxy in output pixels;
    ``labels`` (B, M) int64; ``valid`` (B, M) bool; ``iscrowd`` (B, M) bool.  Each
    row's valid objects come first; ``M`` is the most any row holds (or
    ``max_boxes``).  ``canvas_size`` is the images' ``(height, width)`` the boxes lie
    on (None when unknown).  ``fields`` holds each object field the source carries
    (:data:`~echo_native.targets.OBJECT_FIELDS`), also an attribute of its name, None
    where the source carries none: ``keypoints`` (B, M, K, 3) float32, each object's
    x, y and visibility in output pixels (:mod:`echo_native.keypoints`); ``masks``
    (B, M, H, W) uint8, each object's mask (0/1) on the images
    (:mod:`echo_native.masks`).  The arrays export DLPack, on the batch's device."""

    boxes: np.ndarray
    labels: np.ndarray
    valid: np.ndarray
    iscrowd: np.ndarray
    canvas_size: tuple = None
    fields: dict = None

    def __post_init__(self):
        self.fields = given_fields("Objects", self.fields or {})

    def __getattr__(self, name):  # a field: its array, None where the source has none
        if name in FIELDS:
            return self.__dict__.get("fields", {}).get(name)
        raise AttributeError(f"'Objects' object has no attribute {name!r}")

    @property
    def counts(self):
        """Valid objects per row."""
        return self.valid.sum(axis=1)

    def arrays(self):
        """Every array: boxes, labels, valid, iscrowd, then each field's."""
        return [self.boxes, self.labels, self.valid, self.iscrowd, *self.fields.values()]

    def _like(self, f):
        return Objects(*(f(a) for a in (self.boxes, self.labels, self.valid, self.iscrowd)),
                       self.canvas_size, {k: f(v) for k, v in self.fields.items()})

    def copy(self):
        return self._like(lambda a: a.copy())

    def to(self, xp):
        """The same objects as arrays of the array module ``xp`` (e.g. CuPy)."""
        return self._like(xp.asarray)

    def to_torchvision(self):
        """One ``{"boxes": (n, 4) float32, "labels": (n,) int64}`` dict of torch tensors
        per image, on the batch's device, sharing its memory: what torchvision's
        detection models take as ``targets``; with keypoints, ``"keypoints"`` (n, K, 3)
        float32 too, as ``keypointrcnn_resnet50_fpn`` takes them; with masks, ``"masks"``
        (n, H, W) uint8, as ``maskrcnn_resnet50_fpn`` takes them.

        Where torchvision imports, the boxes are ``tv_tensors.BoundingBoxes`` (format
        XYXY, ``canvas_size`` the images' (height, width)), so that a ``transforms.v2``
        step applied afterwards moves them with the image; where it does not (not
        installed, or its compiled ops failing to load), plain tensors.  torch and
        torchvision are imported here, on the first call, not by ``import echo_native``.
        """
        try:
            import torch
        except ImportError as e:
            raise ImportError(f"to_torchvision() makes torch tensors, and torch does not "
                              f"import here ({e}): install torch, or read the NumPy arrays "
                              f"of batch.objects") from e
        boxes, labels = torch.from_dlpack(self.boxes), torch.from_dlpack(self.labels)
        counts = [int(c) for c in np.asarray(_host(self.counts))]
        tv = _tv_tensors() if self.canvas_size is not None else None
        if tv is None:
            out = [{"boxes": boxes[i, :n], "labels": labels[i, :n]}
                   for i, n in enumerate(counts)]
        else:
            canvas = tuple(int(v) for v in self.canvas_size)
            out = [{"boxes": tv.BoundingBoxes(boxes[i, :n], format="XYXY", canvas_size=canvas),
                    "labels": labels[i, :n]} for i, n in enumerate(counts)]
        for name, value in self.fields.items():
            value, field = torch.from_dlpack(value), FIELDS[name]
            for i, n in enumerate(counts):
                out[i][name] = field.torchvision(value[i, :n], tv)
        return out


#: torchvision's tv_tensors module once imported, False once it failed to (not asked again:
#: a failing import costs its time on every batch otherwise), None before the first ask.
_TV_TENSORS = None


def _tv_tensors():
    """torchvision.tv_tensors, or None where torchvision does not import."""
    global _TV_TENSORS
    if _TV_TENSORS is None:
        try:
            from torchvision import tv_tensors
        except Exception:  # noqa: BLE001 - torchvision without its ops raises RuntimeError
            tv_tensors = False
        _TV_TENSORS = tv_tensors
    return _TV_TENSORS or None


def _host(a):
    get = getattr(a, "get", None)  # a CuPy array
    return get() if callable(get) else a

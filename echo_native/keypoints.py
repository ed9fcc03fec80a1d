"""A pose's keypoints: which point mirrors which, and where points land.

A source with pose targets (``CocoDetection(..., keypoints=True)``) gives each
object ``K`` keypoints ``(x, y, visibility)`` in source pixels, COCO's
convention: visibility 0 (not labelled, and then x = y = 0), 1 (labelled, not
visible) or 2 (visible).  They ride in the sample's record beside the boxes
(the ring's ``obj_keypoints`` column; :data:`KEYPOINTS` is the field) and follow
the same geometry, a window of the source, a flip and a resize, with torchvision
v2's ``KeyPoints`` arithmetic (float32, step by step as ``transforms.v2.functional``
applies it):

1. crop: ``points - (left, top)``;
2. flip, in the window: ``x = (width - 1) - x``, and each point takes its
   mirror's place (``flip_indices``: a left eye becomes a right eye), as the
   detection reference's keypoint flip does;
3. resize: times ``(W / width, H / height)``;
4. a point outside the output, ``[0, W - 1] x [0, H - 1]`` (``ClampKeyPoints``'s
   canvas), becomes unlabelled: ``(0, 0, 0)``.

The window is the one the boxes take (:mod:`echo_native.boxes`): a crop box of
the image, or reaching past it for a zoom-out.  The flip is drawn in the window
before the resize, the order of torchvision's detection pipelines.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from echo_native._checks import numbers, read_only
from echo_native.labels import _source_name
from echo_native.protocol import ObjectField

__all__ = ["KEYPOINTS", "Keypoints", "map_keypoints", "flip_indices", "source_keypoints"]

#: The sides a keypoint's name may say, each with its mirror.
_MIRROR = {"left": "right", "right": "left", "l": "r", "r": "l"}


def _mirror_name(name):
    """``name`` with its side swapped (a ``_``, ``-``, ``.`` or space separated word, or
    a camelCase ``left``/``right`` prefix), keeping its case; None without a side."""
    parts = re.split(r"([_\-\s.])", name)
    for i, part in enumerate(parts):
        other = _MIRROR.get(part.lower())
        if other is None:
            m = re.match(r"(?i)(left|right)(?=[A-Z0-9])", part)
            if m is None:
                continue
            other, part = _MIRROR[m.group(1).lower()], m.group(1)
            rest = parts[i][len(part):]
        else:
            rest = ""
        if part.isupper() and len(part) > 1:
            other = other.upper()
        elif part[0].isupper():
            other = other.capitalize()
        parts[i] = other + rest
        return "".join(parts)
    return None


def flip_indices(names):
    """For each keypoint name, the index of its mirror image (its own where it has no
    side): ``left_eye`` <-> ``right_eye``; ValueError naming a side without its pair."""
    index = {n: i for i, n in enumerate(names)}
    out = []
    for name in names:
        mirror = _mirror_name(name)
        if mirror is None:
            out.append(index[name])
        elif mirror in index:
            out.append(index[mirror])
        else:
            raise ValueError(f"keypoint {name!r} has a side but no {mirror!r} among "
                             f"{list(names)}: give the flip indices explicitly")
    return out


@dataclass(frozen=True, eq=False)
class Keypoints:
    """The keypoints a source's objects carry: their ``names`` and ``flip`` (K,) int64,
    the index of each point's mirror image (an involution; default from the names,
    see :func:`flip_indices`)."""

    names: tuple
    flip: np.ndarray = None

    def __post_init__(self):
        names = tuple(str(n) for n in self.names)
        if not names:
            raise ValueError("Keypoints: no keypoint names")
        if len(set(names)) != len(names):
            raise ValueError(f"Keypoints: names repeat: {list(names)}")
        flip = flip_indices(names) if self.flip is None else self.flip
        flip = np.asarray(flip, np.int64)
        k = len(names)
        if flip.shape != (k,) or ((flip < 0) | (flip >= k)).any() or \
                (flip[flip] != np.arange(k)).any():
            raise ValueError(f"Keypoints: flip must pair the {k} points (a permutation that "
                             f"is its own inverse), got {flip.tolist()}")
        flip.flags.writeable = False
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "flip", flip)

    def __len__(self):
        return len(self.names)


def source_keypoints(source):
    """The :class:`Keypoints` a source's objects carry (its ``keypoints`` hook), or None;
    TypeError naming the source for anything else (names alone do not say which point
    mirrors which)."""
    spec = KEYPOINTS.given(source)
    if spec is not None and not isinstance(spec, Keypoints):
        raise TypeError(f"the source {_source_name(source)}'s keypoints must be an "
                        f"echo_native.Keypoints (the names, and which point mirrors which) "
                        f"or None, got {type(spec).__name__}")
    return spec


def map_keypoints(points, windows, flips, size, flip=None):
    """Source keypoints ``(B, M, K, 3)`` (x, y, visibility) through each row's window,
    flip and resize to ``size`` = (H, W); ``flip`` (K,) the mirror of each point (None:
    no swap).  Returns (B, M, K, 3) float32 in output pixels; a point outside the output
    or unlabelled is (0, 0, 0)."""
    p = np.array(points, np.float32, copy=True)
    windows = np.asarray(windows, np.float64)
    out_h, out_w = (int(v) for v in size)
    top = windows[:, 0].astype(np.float32)[:, None, None]
    left = windows[:, 1].astype(np.float32)[:, None, None]
    height, width = windows[:, 2, None, None], windows[:, 3, None, None]
    x, y = p[..., 0], p[..., 1]
    x -= left
    y -= top
    flips = np.asarray(flips, bool)
    if flips.any():
        w1 = (width[flips] - 1).astype(np.float32)              # (F, 1, 1)
        x[flips] = w1 - x[flips]
        if flip is not None:
            p[flips] = p[flips][:, :, np.asarray(flip, np.int64)]
            x, y = p[..., 0], p[..., 1]
    # The ratios are Python floats in torchvision, multiplied in the points' float32.
    x *= (out_w / width).astype(np.float32)
    y *= (out_h / height).astype(np.float32)
    keep = (p[..., 2] > 0) & (x >= 0) & (x <= out_w - 1) & (y >= 0) & (y <= out_h - 1)
    p[~keep] = 0.0
    return p


class _KeypointsField(ObjectField):
    """Each object's ``K`` keypoints: ``Targets.keypoints`` (N, K, 3), in the record as
    written (source pixels), mapped at each emission (:func:`map_keypoints`)."""

    name, size, column = "keypoints", "max_keypoints", "obj_keypoints"

    def carried(self, source, sample_bytes):
        spec = source_keypoints(source)
        return (0, None) if spec is None else (len(spec), spec)

    def check(self, value, n, image_hw, where):
        """(N, K, 3): finite x and y, visibility 0, 1 or 2, as read-only float32."""
        k = numbers(value, where, "keypoints", np.float32)
        if k.size == 0 and n == 0:
            k = k.reshape(0, k.shape[1] if k.ndim == 3 else 0, 3)
        if k.ndim != 3 or k.shape[0] != n or k.shape[2] != 3:
            raise ValueError(f"{where}: keypoints must have shape (N, K, 3) (x, y, "
                             f"visibility) for the {n} objects, got shape {k.shape}")
        with np.errstate(over="ignore", invalid="ignore"):
            k32 = k.astype(np.float32)
            bad = ~np.isfinite(k32).all(axis=2) | ~np.isin(k32[..., 2], (0, 1, 2))
        if bad.any():
            i, j = (int(v) for v in np.argwhere(bad)[0])
            raise ValueError(f"{where}: object {i}: keypoint {j} {k[i, j].tolist()} is not "
                             f"a finite x, y with visibility 0, 1 or 2")
        return read_only(k32)

    def to_json(self, value):
        return value.tolist()

    def equal(self, a, b):
        return np.array_equal(a, b)

    def write(self, out, value, size, **placed):
        out[...] = 0.0  # an object without keypoints: none labelled
        if value is not None:
            if value.shape[1] != size:
                raise ValueError(f"its objects have {value.shape[1]} keypoints, the "
                                 f"source's have {size}")
            out[...] = value

    def emit(self, stored, valid, cols, windows, flips, size, redrawn, rule):
        points = map_keypoints(stored, windows, flips, size,
                               None if rule is None else rule.flip)
        out = points[np.arange(len(points))[:, None], cols]
        out[~np.asarray(valid, bool)] = 0.0
        return out


#: The keypoints field of a record (:class:`~echo_native.protocol.ObjectField`).
KEYPOINTS = _KeypointsField()

"""Detection targets of one image: :class:`Targets`, checked, and their JSON form.

A sample's targets are its objects: ``boxes`` (N, 4) float32 ``x1, y1, x2, y2``
in the source image's pixels (x to the right, y down, a pixel k covering
[k, k + 1)), ``labels`` (N,) int64 and ``iscrowd`` (N,) bool, with the image's
``(height, width)`` when it is known.  A source carries targets when it has a
callable ``targets(i)`` and its ``has_targets`` is not False
(:func:`source_targets`); like ``read``, ``targets(i)`` runs in the workers and
returns a :class:`Targets` or the dict form :func:`as_targets` takes.

Beside an image (``x.jpg`` in a folder, ``<key>.jpg`` in a tar shard), its
targets are ``x.json``::

    {"boxes": [[x1, y1, x2, y2], ...], "labels": [3, ...], "iscrowd": [0, ...],
     "image_hw": [480, 640]}

(``iscrowd`` and ``image_hw`` optional).  That file is data from wherever the
images came from: it is read up to :data:`MAX_JSON_BYTES` and checked like any
other targets, and anything wrong with it is a ValueError naming it.
"""
from __future__ import annotations

import json
import math

import numpy as np

from echo_native._checks import numbers, read_only, shown
from echo_native.keypoints import KEYPOINTS
from echo_native.masks import MASKS
from echo_native.protocol import hook

__all__ = ["MAX_JSON_BYTES", "OBJECT_FIELDS", "Targets", "as_targets", "source_targets",
           "targets_from_json", "targets_to_json"]

#: Largest targets JSON read (about 200,000 boxes; an image has at most a few hundred).
MAX_JSON_BYTES = 16 * 2**20

#: How far a box may reach past the image (in pixels) and be clipped to it: COCO's
#: boxes are rounded to 2 decimals from polygons, so some reach a fraction of a pixel
#: out.  Further than that is an error, not rounding.
TOLERANCE_PX = 1.0

#: What an object may carry beside its box and label, one kind per module
#: (:class:`~echo_native.protocol.ObjectField`), each in its column of the record.
OBJECT_FIELDS = (KEYPOINTS, MASKS)
FIELDS = {f.name: f for f in OBJECT_FIELDS}


def given_fields(owner, fields):
    """``fields`` (name -> value) without the None values; TypeError naming ``owner``
    for a name that is no object field."""
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise TypeError(f"{owner} got unknown fields {unknown}: objects carry {list(FIELDS)}")
    return {k: v for k, v in fields.items() if v is not None}


class Targets:
    """The objects of one image: ``boxes`` (N, 4) float32 xyxy in source pixels,
    ``labels`` (N,) int64, ``iscrowd`` (N,) bool (read-only arrays), ``image_hw``,
    the image's (height, width) or None, and for each field of :data:`OBJECT_FIELDS`
    its value, or None: ``keypoints``, (N, K, 3) float32 x, y and COCO visibility (0,
    1, 2) per object (:mod:`echo_native.keypoints`); ``masks``, each object's mask as
    polygons or RLE (:class:`~echo_native.masks.Segments`; given as a list of COCO
    segmentations, see :func:`~echo_native.masks.as_segments`).

    ``Targets(boxes, labels, iscrowd=None, image_hw=None, keypoints=None, masks=None)``
    checks its input as :func:`as_targets` does (ValueError naming the first bad
    object); ``len()`` is the number of objects; two are equal when every array,
    field and ``image_hw`` are.  Read-only."""

    __slots__ = ("boxes", "labels", "iscrowd", "image_hw", "fields")

    def __init__(self, boxes, labels, iscrowd=None, image_hw=None, **fields):
        _set(self, *_checked(boxes, labels, iscrowd, image_hw, "Targets",
                             given_fields("Targets", fields)))

    def __getattr__(self, name):  # a field: its value, None where the objects lack it
        if name in FIELDS:
            return self.fields.get(name)
        raise AttributeError(f"'Targets' object has no attribute {name!r}")

    def __setattr__(self, name, value):
        raise AttributeError("Targets are read-only")

    def __len__(self):
        return int(self.labels.shape[0])

    def __eq__(self, other):
        if not isinstance(other, Targets):
            return NotImplemented
        return (self.image_hw == other.image_hw and np.array_equal(self.boxes, other.boxes)
                and np.array_equal(self.labels, other.labels)
                and np.array_equal(self.iscrowd, other.iscrowd)
                and self.fields.keys() == other.fields.keys()
                and all(FIELDS[k].equal(v, other.fields[k]) for k, v in self.fields.items()))

    __hash__ = None

    def __repr__(self):
        return f"Targets({len(self)} objects, image_hw={self.image_hw})"

    def __reduce__(self):  # unpickled as is: it was checked when made
        return _trusted, (self.boxes, self.labels, self.iscrowd, self.image_hw, self.fields)


def _set(t, boxes, labels, iscrowd, image_hw, fields):
    for name, value in (("boxes", boxes), ("labels", labels), ("iscrowd", iscrowd),
                        ("image_hw", image_hw), ("fields", fields)):
        object.__setattr__(t, name, value)
    return t


def _view(a):
    return read_only(a.view()) if isinstance(a, np.ndarray) else a


def _trusted(boxes, labels, iscrowd, image_hw=None, fields=None):
    """A Targets of arrays already checked (of the right dtypes and shapes) and
    ``fields`` (name -> checked value) made without checking them again, e.g. a
    source's slices of its own packed arrays."""
    return _set(object.__new__(Targets), read_only(np.asarray(boxes, np.float32).view()),
                read_only(np.asarray(labels, np.int64).view()),
                read_only(np.asarray(iscrowd, bool).view()),
                None if image_hw is None else (int(image_hw[0]), int(image_hw[1])),
                {k: _view(v) for k, v in given_fields("Targets", fields or {}).items()})


def _image_hw(hw, where):
    if hw is None:
        return None
    try:
        h, w = hw
    except (TypeError, ValueError):
        raise ValueError(f"{where}: image_hw must be (height, width), got {shown(hw)}") \
            from None
    out = []
    for v in (h, w):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer, float,
                                                                 np.floating)) \
                or not math.isfinite(v) or v != int(v) or not 1 <= v < 2**31:
            raise ValueError(f"{where}: image_hw must be two positive integers, got "
                             f"{shown(hw)}")
        out.append(int(v))
    return tuple(out)


def _checked(boxes, labels, iscrowd, image_hw, where, fields):
    """The checked arrays (boxes clipped to the image within the tolerance), and the
    checked ``fields`` (name -> value, None left out)."""
    hw = _image_hw(image_hw, where)
    b = numbers(boxes, where, "boxes", np.float64)
    if b.size == 0 and b.shape in ((0,), (0, 4)):
        b = np.zeros((0, 4))
    if b.ndim != 2 or b.shape[1] != 4:
        raise ValueError(f"{where}: boxes must have shape (N, 4) (x1, y1, x2, y2), got "
                         f"shape {b.shape}")
    n = b.shape[0]
    b = b.astype(np.float64)
    lab = numbers(labels, where, "labels", np.int64)
    if lab.ndim != 1 or lab.shape[0] != n:
        raise ValueError(f"{where}: {n} boxes need {n} labels in one dimension, got shape "
                         f"{lab.shape}")
    if lab.dtype.kind == "b":
        raise ValueError(f"{where}: labels must be integers, got booleans")
    if lab.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            bad = np.flatnonzero(~np.isfinite(lab) | (lab != np.round(lab))
                                 | (np.abs(lab) >= 2.0**63))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{where}: object {i}: label {float(lab[i])!r} is not an "
                             f"integer")
    elif lab.dtype.kind == "u" and lab.size and int(lab.max()) >= 2**63:
        i = int(np.argmax(lab))
        raise ValueError(f"{where}: object {i}: label {int(lab[i])} does not fit int64")
    lab = lab.astype(np.int64)
    bad = np.flatnonzero(lab < 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{where}: object {i}: label {int(lab[i])} is negative")
    if iscrowd is None:
        crowd = np.zeros(n, bool)
    else:
        c = numbers(iscrowd, where, "iscrowd", bool)
        if c.ndim != 1 or c.shape[0] != n:
            raise ValueError(f"{where}: {n} boxes need {n} iscrowd flags in one dimension, "
                             f"got shape {c.shape}")
        bad = np.flatnonzero((c != 0) & (c != 1))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{where}: object {i}: iscrowd is {c[i].item()!r}, not 0 or 1")
        crowd = c.astype(bool)
    bad = np.flatnonzero(~np.isfinite(b).all(axis=1))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{where}: object {i}: box {b[i].tolist()} holds a non-finite number")
    bad = np.flatnonzero((b[:, 2] < b[:, 0]) | (b[:, 3] < b[:, 1]))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{where}: object {i}: box {b[i].tolist()} has x2 < x1 or y2 < y1 "
                         f"(boxes are x1, y1, x2, y2)")
    if hw is not None:
        h, w = hw
        t = TOLERANCE_PX
        out = (b[:, 0] < -t) | (b[:, 1] < -t) | (b[:, 2] > w + t) | (b[:, 3] > h + t)
        bad = np.flatnonzero(out)
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{where}: object {i}: box {b[i].tolist()} lies outside the "
                             f"{h}x{w} (height x width) image by more than {t:g} px")
        np.clip(b[:, 0::2], 0, w, out=b[:, 0::2])
        np.clip(b[:, 1::2], 0, h, out=b[:, 1::2])
    with np.errstate(over="ignore"):
        b32 = b.astype(np.float32)
    if not np.isfinite(b32).all():  # finite in float64, too large for float32
        i = int(np.flatnonzero(~np.isfinite(b32).all(axis=1))[0])
        raise ValueError(f"{where}: object {i}: box {b[i].tolist()} does not fit float32")
    checked = {name: FIELDS[name].check(value, n, hw, where)
               for name, value in fields.items() if value is not None}
    return read_only(b32), read_only(lab), read_only(crowd), hw, checked


def as_targets(value, where, image_hw=None) -> Targets:
    """``value`` (a :class:`Targets`, or a dict with ``boxes`` (N, 4) xyxy, ``labels``
    (N,) and optionally ``iscrowd`` (N,), ``image_hw``, ``keypoints`` (N, K, 3) and
    ``masks`` (N COCO segmentations)) as a checked Targets.

    ``image_hw`` (height, width), when given, is the image's size: boxes reaching
    past it by at most 1 px are clipped to it, further is an error.  A ValueError
    names ``where`` and the first bad object's index: non-finite numbers, x2 < x1
    or y2 < y1, shapes and lengths that disagree, labels that are not
    non-negative integers, iscrowd flags other than 0/1, and a size that disagrees
    with the value's own ``image_hw``."""
    hw = _image_hw(image_hw, where)
    if isinstance(value, Targets):
        if hw is None or value.image_hw == hw:
            return value
        if value.image_hw is not None:
            raise ValueError(f"{where}: targets for a {value.image_hw[0]}x{value.image_hw[1]}"
                             f" image, the image is {hw[0]}x{hw[1]} (height x width)")
        return _trusted(*_checked(value.boxes, value.labels, value.iscrowd, hw, where,
                                  value.fields))
    if not isinstance(value, dict):
        raise ValueError(f"{where}: targets must be a Targets or a dict with 'boxes' and "
                         f"'labels', got {type(value).__name__}")
    missing = [k for k in ("boxes", "labels") if k not in value]
    if missing:
        raise ValueError(f"{where}: targets without {' and '.join(repr(k) for k in missing)}"
                         f" (keys: {shown(sorted(map(str, value)))})")
    own = _image_hw(value.get("image_hw"), where)
    if own is not None and hw is not None and own != hw:
        raise ValueError(f"{where}: targets for a {own[0]}x{own[1]} image, the image is "
                         f"{hw[0]}x{hw[1]} (height x width)")
    return _trusted(*_checked(value["boxes"], value["labels"], value.get("iscrowd"),
                              hw or own, where, {name: value.get(name) for name in FIELDS}))


def targets_from_json(data, where, image_hw=None) -> Targets:
    """Targets from their JSON form (bytes), checked as :func:`as_targets` does; any
    input that is not valid targets (not JSON, not UTF-8, nested too deeply, over
    :data:`MAX_JSON_BYTES`) is a ValueError naming ``where``."""
    if len(data) > MAX_JSON_BYTES:
        raise ValueError(f"{where}: targets JSON of {len(data):,} bytes, over the limit of "
                         f"{MAX_JSON_BYTES:,}")
    try:
        doc = json.loads(bytes(data))
    except RecursionError:  # "[[[[...": nested past the parser's stack
        raise ValueError(f"{where}: not targets JSON (nested too deeply)") from None
    except ValueError as e:  # also UnicodeDecodeError, and integers of too many digits
        raise ValueError(f"{where}: not targets JSON ({shown(str(e), 120)})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: targets JSON must be an object with 'boxes' and "
                         f"'labels', got {type(doc).__name__}")
    for key in ("boxes", "labels", "iscrowd", *FIELDS):
        if key in doc and not isinstance(doc[key], list):
            raise ValueError(f"{where}: {key!r} must be a list, got {type(doc[key]).__name__}")
    try:
        return as_targets(doc, where, image_hw)
    except RecursionError:  # a deep list inside "boxes", nested past numpy's converter
        raise ValueError(f"{where}: not targets JSON (nested too deeply)") from None
    except (TypeError, OverflowError) as e:  # numbers numpy cannot hold
        raise ValueError(f"{where}: bad targets JSON ({shown(str(e), 120)})") from None


def targets_to_json(t: Targets) -> bytes:
    """The JSON form of ``t`` (float32 boxes are written exactly: they read back equal)."""
    doc = {"boxes": t.boxes.tolist(), "labels": t.labels.tolist(),
           "iscrowd": t.iscrowd.astype(np.uint8).tolist()}
    if t.image_hw is not None:
        doc["image_hw"] = list(t.image_hw)
    for name, value in t.fields.items():
        doc[name] = FIELDS[name].to_json(value)
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("ascii")


def source_targets(source):
    """``source.targets`` (a callable ``i -> Targets or dict``) when the source carries
    targets: it has a callable ``targets`` and its ``has_targets`` is not False
    (built-in sources with optional targets say whether they are on); else None."""
    fn = hook(source, "targets")
    if not callable(fn) or hook(source, "has_targets", True) is False:
        return None
    return fn

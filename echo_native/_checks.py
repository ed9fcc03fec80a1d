"""Validators and constants shared by the specs: one definition each.

Every spec checks its own arguments when it is made, so a mistake is reported
where the user wrote it (naming the argument), never as a failed sample in a
worker.  The checks all read the same way: ``owner: name must be ..., got ...``.
"""
from __future__ import annotations

import math
import os

import numpy as np

#: Image file endings a folder or a tar shard is read for (torchvision's ``IMG_EXTENSIONS``).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

#: torchvision's evaluation convention: resize the shorter side to size / 0.875 (224 -> 256).
CENTER_CROP_FRACTION = 0.875


def is_int(x):
    """An integer, NumPy's included, and not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def is_number(x):
    """A real number, NumPy's included, and not a bool."""
    return isinstance(x, (int, float, np.integer, np.floating)) and \
        not isinstance(x, (bool, np.bool_))


def number(owner, name, v, lo=-math.inf, hi=math.inf, hi_open=False):
    """``v`` as a float in [lo, hi] (or [lo, hi)), else a ValueError naming it."""
    if not is_number(v) or not (lo <= v < hi if hi_open else lo <= v <= hi):
        bound = f"[{lo}, {hi})" if hi_open else f"[{lo}, {hi}]"
        raise ValueError(f"{owner}: {name} must be a number in {bound}, got {v!r}")
    return float(v)


def positive_int(owner, name, v, lo=1, hi=None):
    """``v`` as an int in [lo, hi], else a ValueError naming it."""
    if not is_int(v) or v < lo or (hi is not None and v > hi):
        if hi is not None:
            what = f"an integer from {lo} to {hi}"
        else:
            what = "a positive integer" if lo == 1 else f"an integer >= {lo}"
        raise ValueError(f"{owner}: {name} must be {what}, got {v!r}")
    return int(v)


def optional_positive_int(owner, name, v):
    """None, or a positive int (ValueError naming it)."""
    return None if v is None else positive_int(owner, name, v)


def seconds(owner, name, v, optional=False):
    """A positive, finite number of seconds (None allowed with ``optional``): NaN or
    infinity would disable the wait it bounds.  Not a number: TypeError, or for an
    ``optional`` one ValueError (the original contract's two errors)."""
    if v is None and optional:
        return None
    what = "a positive number of seconds" + (" or None" if optional else "")
    if not is_number(v):
        raise (ValueError if optional else TypeError)(f"{owner}: {name} must be {what}, "
                                                      f"got {v!r}")
    if not 0 < v < math.inf:
        raise ValueError(f"{owner}: {name} must be {what}, got {v!r}")
    return float(v)


def flag(owner, name, v):
    """True or False (NumPy's bool too), else a TypeError naming it."""
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{owner}: {name} must be True or False, got {v!r}")
    return bool(v)


def choice(owner, name, v, choices):
    if v not in choices:
        raise ValueError(f"{owner}: {name} must be one of {choices}, got {v!r}")
    return v


def size_pair(size, owner="size"):
    """``size`` (an int for a square, or ``(height, width)``) as a checked pair."""
    if is_int(size):
        size = (size, size)
    try:
        h, w = size
    except (TypeError, ValueError):
        raise TypeError(f"{owner} must be an int or (height, width), got {size!r}") from None
    for v in (h, w):
        if not is_int(v):
            raise TypeError(f"{owner} must be an int or (height, width) of ints, got {size!r}")
        if not 0 < v <= 65535:
            raise ValueError(f"{owner} must be positive and at most 65535, got {size!r}")
    return int(h), int(w)


def cpus():
    """The CPUs this process may run on (its affinity, else the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


class Taken(dict):
    """Shorthands taken for one spec, by the spec's field names; ``written`` keeps the
    keywords as the user wrote them, for messages."""

    written = ()


def take(keywords, names):
    """The keywords named in ``names`` (a tuple, or a dict renaming them), removed from
    ``keywords``: a constructor's flat shorthands for one spec."""
    written = [k for k in keywords if k in names]
    taken = Taken((names[k] if isinstance(names, dict) else k, keywords.pop(k))
                  for k in written)
    taken.written = tuple(written)
    return taken


def either(owner, spec_text, spec, given, given_text=None):
    """Refuse a shorthand given next to the spec it belongs to (which would win is not
    obvious)."""
    if given and spec is not None:
        names = getattr(given, "written", ()) or given
        raise TypeError(f"{owner}: give either {spec_text} or "
                        f"{given_text or ', '.join(sorted(names))}, not both")


def read_only(a):
    """``a``, made read-only."""
    a.flags.writeable = False
    return a


def shown(value, n=60):
    """repr(value), cut to ``n`` characters."""
    text = repr(value)
    return text if len(text) <= n else text[:n - 3] + "..."


def numbers(value, where, what, dtype):
    """``value`` as a numeric array (lists, tuples, arrays; no strings or objects)."""
    if isinstance(value, (str, bytes, dict)):
        raise ValueError(f"{where}: {what} must be numbers, got {type(value).__name__}")
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError, OverflowError) as e:  # ragged lists, huge integers
        raise ValueError(f"{where}: {what} are not a regular array of numbers ({e})") from None
    if arr.size == 0:
        return np.asarray(arr, dtype)
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"{where}: {what} must be numbers, got an array of {arr.dtype}"
                         + (f" ({shown(arr.flat[0], 40)} ...)" if arr.dtype.kind == "O"
                            else ""))
    return arr

"""A source's labels, checked once: one integer per sample, never truncated.

Labels come from user code (lists, CSV columns through pandas, NumPy arrays of any
kind), so what reaches the workers is checked here first: an int64 array, or an
error that names the source, the first offending index and its value.
"""
from __future__ import annotations

import math

import numpy as np


def _source_name(source):
    if type(source).__repr__ is object.__repr__:  # an address names nothing to the user
        return type(source).__name__
    try:
        text = repr(source)
    except Exception:  # noqa: BLE001 - a user's __repr__ may fail; the type still names it
        text = f"<{type(source).__name__}>"
    return text if len(text) <= 120 else text[:117] + "..."


def check_labels(source, labels=None) -> np.ndarray:
    """The labels of ``source`` (or ``labels``, for it) as a checked int64 array.

    One label per sample (``len(source)`` of them, one-dimensional); each an
    integer that fits 64 bits (int64, or a uint64 below 2**63), or a float with an
    integral value (1.0: labels read from a CSV through pandas come as floats).
    A non-integral or non-finite float (2.5, nan) is refused rather than
    truncated, as are strings, None and values out of range (2**63, 2**64,
    numpy's uint64 maximum).  Raises TypeError (no labels, not numbers) or
    ValueError (wrong length, out of range, not integral) naming the source and
    the first offending index and value.
    """
    name = _source_name(source)
    if labels is None:
        try:
            labels = source.labels
        except AttributeError:
            raise TypeError(f"the source {name} has no `labels` (an integer per sample)") \
                from None
    if isinstance(labels, (str, bytes)) or not hasattr(labels, "__len__") and \
            not isinstance(labels, np.ndarray):
        raise TypeError(f"labels of {name} must be a sequence of integers, got "
                        f"{type(labels).__name__}")
    try:
        arr = np.asarray(labels)
        if not isinstance(labels, np.ndarray) and arr.dtype.kind not in "biu":
            # Python values that numpy would coerce (2**63 among ints becomes a float):
            # checked one by one, exactly.
            arr = np.asarray(labels, dtype=object)
    except (ValueError, TypeError) as e:  # ragged nesting and the like
        raise TypeError(f"labels of {name} are not a flat sequence of integers ({e})") from None
    try:
        n = len(source)
    except TypeError:
        n = None
    if arr.ndim != 1 or (n is not None and arr.shape[0] != n):
        raise ValueError(f"labels of {name}: expected {n if n is not None else 'one per sample'}"
                         f" labels in one dimension, got shape {arr.shape}")
    kind = arr.dtype.kind
    if kind == "b":
        return arr.astype(np.int64)
    if kind == "i":
        return arr.astype(np.int64, copy=False)
    if kind == "u":
        bad = np.flatnonzero(arr > np.iinfo(np.int64).max)
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"labels of {name}: label {i} is {int(arr[i])}, which does not "
                             f"fit a 64-bit signed integer")
        return arr.astype(np.int64)
    if kind == "f":
        with np.errstate(invalid="ignore"):
            bad = np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr))
                                 | (np.abs(arr) >= 2.0**63))
        if bad.size:
            i = int(bad[0])
            raise ValueError(_not_integral(name, i, float(arr[i])))
        return arr.astype(np.int64)
    if kind == "O":
        out = np.empty(arr.shape[0], np.int64)
        for i, v in enumerate(arr.tolist()):
            if isinstance(v, (bool, int, np.integer)):
                v = int(v)
            elif isinstance(v, (float, np.floating)):
                if not (math.isfinite(v) and v == int(v)):
                    raise ValueError(_not_integral(name, i, float(v)))
                v = int(v)
            else:
                raise TypeError(_not_a_label(name, i, v))
            if not -2**63 <= v < 2**63:
                raise ValueError(f"labels of {name}: label {i} is {v}, which does not fit a "
                                 f"64-bit signed integer")
            out[i] = v
        return out
    for i, v in enumerate(arr.tolist()):  # strings, bytes, ...: name the first one
        raise TypeError(_not_a_label(name, i, v))
    raise TypeError(f"labels of {name} must be integers, got an array of {arr.dtype}")


def _not_integral(name, i, v):
    if math.isfinite(v) and v == int(v):  # integral, but 2**63 or more in magnitude
        return (f"labels of {name}: label {i} is {v!r}, which does not fit a 64-bit signed "
                f"integer")
    return (f"labels of {name}: label {i} is {v!r}, not an integer (float labels must have "
            f"integral values: a class index is never truncated)")


def _not_a_label(name, i, v):
    return (f"labels of {name}: label {i} is {repr(v)[:40]} ({type(v).__name__}), not an "
            f"integer")

"""Real photographs for tests: scikit-image's bundled photos, resampled to any size."""
from __future__ import annotations

import functools

import numpy as np
from PIL import Image


@functools.lru_cache(maxsize=None)
def photo(name: str) -> np.ndarray:
    """A scikit-image photograph as a read-only uint8 array (RGB, or 2-D for gray ones)."""
    import skimage.data

    arr = np.ascontiguousarray(getattr(skimage.data, name)())
    assert arr.dtype == np.uint8, name
    if arr.ndim == 3:
        arr = np.ascontiguousarray(arr[..., :3])
    arr.setflags(write=False)
    return arr


def fit(arr: np.ndarray, height: int, width: int) -> np.ndarray:
    """Resample a photograph to exactly height x width (real content, any aspect)."""
    im = Image.fromarray(arr).resize((width, height), Image.LANCZOS)
    return np.asarray(im)

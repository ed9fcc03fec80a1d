"""What the torchvision reference tests share: the import (a module-level skip where
torchvision cannot load) and the tolerance of a zoom-out's boxes.

torchvision's compiled ops do not load next to the CPU build of torch (they link
libtorch_cuda), and importing torchvision then fails with a RuntimeError, not an
ImportError; PyPI's default torch + torchvision pair (a CUDA build, run on the CPU) loads
them.  ``.ci/run``'s step "torchvision: reference tests" makes a venv with that pair
and runs this folder there.
"""
from __future__ import annotations

import numpy as np
import pytest

try:
    import torch
    from torchvision import tv_tensors
    from torchvision.transforms import v2
    from torchvision.transforms.v2 import functional as F
except Exception as exc:  # noqa: BLE001 - torchvision without its ops: RuntimeError
    pytest.skip(f"torchvision v2 reference tests: torchvision does not import here ({exc!r}); "
                f".ci/run's step 'torchvision: reference tests' runs them in a venv with "
                f"torch and torchvision installed", allow_module_level=True)

__all__ = ["F", "tolerance", "torch", "tv_tensors", "v2"]


def tolerance(boxes, pad, window_hw, size):
    """How far ``map_boxes`` may be from torchvision for one image: 1e-4 output px, plus,
    after a zoom-out's padding ``pad`` (left, top, right, bottom), one float32 rounding of
    the padded canvas's coordinates scaled by the resize.  torchvision adds the padding
    in float32 before it subtracts the crop's offset (F.pad, then F.crop); ``map_boxes``
    subtracts the window's offset once, the correctly rounded result."""
    if not any(pad):
        return np.float32(1e-4)
    extent = np.float32(max(float(np.abs(boxes).max(initial=0.0)), 1.0) + max(pad))
    ratio = max(size[1] / window_hw[1], size[0] / window_hw[0])
    return np.float32(1e-4 + ratio * np.spacing(extent))

"""Stage 6 of the pipeline: where the echo buffer lives and how emissions are made.

A device backend turns echo-buffer entries into an output batch:
``store`` (slot -> buffer), ``gather`` (repeat prepared images),
``crop_resize`` (re-augment canvases), ``flip`` and ``normalize``.  The CPU
backend uses NumPy and the native resampler (GIL released).  The bookkeeping
that decides *which* entries to emit (:mod:`echo_native.echo`) is the same
for every backend.
"""
from __future__ import annotations

import numpy as np

from echo_native import _kernel

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
LAYOUTS = ("NHWC", "NCHW")


def resolve(device):
    """A backend for ``device``: "cpu", "cuda", "cuda:N" or "auto"."""
    if device in (None, "cpu"):
        return CpuDevice()
    if device == "auto":
        return CpuDevice() if not _cuda_available() else _cuda_device("cuda")
    if isinstance(device, str) and (device == "cuda" or device.startswith("cuda:")):
        return _cuda_device(device)
    raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {device!r}")


def _cuda_available():
    try:
        import cupy
    except ImportError:
        return False
    try:
        return bool(cupy.is_available())
    except Exception:
        return False


def _cuda_device(device):
    try:
        import cupy  # noqa: F401
    except ImportError:
        raise RuntimeError(f"device={device!r} needs CuPy: pip install 'echo_native[gpu]' "
                           f"(CUDA 12) or 'echo_native[gpu13]' (CUDA 13)") from None
    if not _cuda_available():
        raise RuntimeError(f"device={device!r} but CuPy finds no usable CUDA device "
                           f"(cupy.is_available() is False); use device='cpu' or 'auto'")
    raise RuntimeError(f"device={device!r}: the CUDA backend is not part of this build yet; "
                       f"use device='cpu' (device='auto' falls back to it)")


class CpuDevice:
    """Echo buffer in host memory; re-augmentation by the native resampler."""

    name = "cpu"
    xp = np

    def __init__(self):
        self._dec = _kernel.Decoder()

    def store(self, buffer, entries, slot, count, fixed_shape):
        """Copy ``count`` samples of a slot into buffer entries."""
        if fixed_shape:
            buffer.pixels[entries] = slot.pixels[:count]
            return
        for i, e in enumerate(entries):
            h, w = slot.shapes[i]
            n = int(h) * int(w) * 3
            buffer.pixels[e, :n] = slot.pixels[i, :n]

    def gather(self, buffer, entries, out):
        np.take(buffer.pixels, entries, axis=0, out=out.reshape(len(entries), -1))

    def flip(self, images, mask):
        if mask.any():
            images[mask] = images[mask][:, :, ::-1]

    def crop_resize(self, buffer, entries, boxes, flips, out):
        """Re-augment: crop box i of canvas ``entries[i]``, resize into out[i], flip."""
        size = out.shape[1:3]
        for i, e in enumerate(entries):
            h, w = buffer.shape[e]
            canvas = buffer.pixels[e, :h * w * 3].reshape(h, w, 3)
            self._dec.resize(canvas, boxes[i], size, bool(flips[i]), out[i])

    def normalize(self, images, mean, std, layout, out):
        """(x / 255 - mean) / std in one pass per channel into a float buffer."""
        scale = (1.0 / (255.0 * np.asarray(std, np.float32))).astype(np.float32)
        shift = (-np.asarray(mean, np.float32) / np.asarray(std, np.float32)).astype(np.float32)
        src = images if layout == "NHWC" else images.transpose(0, 3, 1, 2)
        bshape = (1, 1, 1, 3) if layout == "NHWC" else (1, 3, 1, 1)
        np.multiply(src, scale.reshape(bshape), out=out, casting="unsafe")
        out += shift.reshape(bshape).astype(out.dtype)
        return out

    def empty(self, shape, dtype):
        return np.empty(shape, dtype=dtype)

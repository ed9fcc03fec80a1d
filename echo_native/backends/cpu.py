"""The CPU backend: echo buffer in host memory, re-augmentation by the native kernel."""
from __future__ import annotations

import numpy as np

from echo_native import _kernel
from echo_native.backends.array import ArrayDevice

class CpuDevice(ArrayDevice):
    """Echo buffer in host memory; re-augmentation by the native resampler with the
    GIL released, numerically identical to the fused decode path."""

    name = "cpu"
    host_resident = True

    def __init__(self):
        super().__init__(np)
        self._dec = _kernel.Decoder()

    def store(self, buffer, entries, slot, count, fixed_shape):
        if fixed_shape:
            buffer.pixels[entries] = slot.pixels[:count]
            return
        for i, e in enumerate(entries):
            n = int(slot.shapes[i][0]) * int(slot.shapes[i][1]) * 3
            buffer.pixels[e, :n] = slot.pixels[i, :n]

    def gather(self, buffer, entries, out):
        np.take(buffer.pixels, entries, axis=0, out=out.reshape(len(entries), -1))

    def to_device(self, host, out=None):
        if out is None:
            return host
        out[...] = host
        return out

    def crop_resize(self, buffer, entries, boxes, flips, out):
        size = out.shape[1:3]
        for i, e in enumerate(entries):
            h, w = buffer.shape[e]
            canvas = buffer.pixels[e, :h * w * 3].reshape(h, w, 3)
            self._dec.resize(canvas, boxes[i], size, bool(flips[i]), out[i])

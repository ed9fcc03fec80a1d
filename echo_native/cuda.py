"""The CUDA-only parts of the GPU backend, kept thin (CuPy).

Everything array-shaped is inherited from :class:`echo_native.device.ArrayDevice`
running on CuPy.  What is here cannot be written against an array module:

- the ring's shared memory is page-locked for the GPU (``cudaHostRegister``),
  or, where registration is refused, batches are staged through a pinned
  buffer;
- host-to-device copies run asynchronously on a dedicated stream, and a slot
  goes back to the workers only once its copy has completed (an event per
  copy, FFCV's slot/stream/event pattern);
- re-augmentation of canvases is one raw kernel launch per batch: every output
  pixel computes its own antialiased bilinear weights (Pillow's filter) over
  its canvas window;
- each batch handed to the consumer is ordered after our stream, so DLPack
  consumers (torch, JAX, CuPy) see finished data without a device-wide sync.
"""
from __future__ import annotations

import numpy as np

from echo_native.device import ArrayDevice

_KERNEL = r"""
__device__ __forceinline__ double tri(double x) {
    x = fabs(x);
    return x < 1.0 ? 1.0 - x : 0.0;
}

extern "C" __global__ void crop_resize(
        const unsigned char* __restrict__ pixels, long long entry_bytes,
        const long long* __restrict__ entries, const int* __restrict__ shapes,
        const double* __restrict__ boxes, const unsigned char* __restrict__ flips,
        int out_h, int out_w, unsigned char* __restrict__ out) {
    const int b = blockIdx.y;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= out_h * out_w) return;
    const int oy = idx / out_w, ox = idx % out_w;
    const unsigned char* src = pixels + entries[b] * entry_bytes;
    const int h = shapes[2 * b], w = shapes[2 * b + 1];
    const double top = boxes[4 * b], left = boxes[4 * b + 1];
    const double sy = boxes[4 * b + 2] / out_h, sx = boxes[4 * b + 3] / out_w;
    const double fy = fmax(sy, 1.0), fx = fmax(sx, 1.0);
    const int sxo = flips[b] ? out_w - 1 - ox : ox;
    const double cy = top + (oy + 0.5) * sy, cx = left + (sxo + 0.5) * sx;
    const int y0 = max((int)(cy - fy + 0.5), 0), y1 = min((int)(cy + fy + 0.5), h);
    const int x0 = max((int)(cx - fx + 0.5), 0), x1 = min((int)(cx + fx + 0.5), w);
    double wxs = 0.0;
    for (int x = x0; x < x1; x++) wxs += tri((x - cx + 0.5) / fx);
    double wys = 0.0, r = 0.0, g = 0.0, bl = 0.0;
    for (int y = y0; y < y1; y++) {
        const double wy = tri((y - cy + 0.5) / fy);
        if (wy == 0.0) continue;
        wys += wy;
        const unsigned char* row = src + (size_t)y * w * 3;
        double rr = 0.0, gg = 0.0, bb = 0.0;
        for (int x = x0; x < x1; x++) {
            const double wx = tri((x - cx + 0.5) / fx);
            const unsigned char* p = row + x * 3;
            rr += wx * p[0];
            gg += wx * p[1];
            bb += wx * p[2];
        }
        r += wy * rr;
        g += wy * gg;
        bl += wy * bb;
    }
    const double norm = (wys > 0.0 && wxs > 0.0) ? 1.0 / (wys * wxs) : 0.0;
    unsigned char* o = out + ((size_t)b * out_h * out_w + idx) * 3;
    o[0] = (unsigned char)fmin(fmax(floor(r * norm + 0.5), 0.0), 255.0);
    o[1] = (unsigned char)fmin(fmax(floor(g * norm + 0.5), 0.0), 255.0);
    o[2] = (unsigned char)fmin(fmax(floor(bl * norm + 0.5), 0.0), 255.0);
}
"""


class CudaDevice(ArrayDevice):
    """Echo buffer, copies and re-augmentation on one GPU."""

    name = "cuda"

    def __init__(self, index=0):
        import cupy

        super().__init__(cupy)
        self.cupy = cupy
        self.index = int(index)
        self.device = cupy.cuda.Device(self.index)
        with self.device:
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self._kernel = cupy.RawKernel(_KERNEL, "crop_resize")
        self._registered = None   # (pointer) of the registered ring mapping
        self._staging = None      # pinned fallback
        self._pending = None      # event of the last copy out of a slot
        self.registration = "none"

    # -- ring memory ---------------------------------------------------------------------------
    def attach(self, ring):
        """Page-lock the ring mapping so copies out of slots are true async DMA."""
        rt = self.cupy.cuda.runtime
        buf = np.frombuffer(ring.buf, np.uint8)
        ptr, size = buf.ctypes.data, buf.nbytes
        try:
            with self.device:
                rt.hostRegister(ptr, size, rt.hostRegisterPortable)
            self._registered = ptr
            self.registration = "registered"
        except self.cupy.cuda.runtime.CUDARuntimeError:
            # Some kernels/containers refuse to pin shared memory: stage instead.
            self.registration = "pinned-staging"

    def detach(self):
        if self._registered is not None:
            self.copied()
            with self.device:
                self.cupy.cuda.runtime.hostUnregister(self._registered)
            self._registered = None

    def _host_source(self, host):
        """A host array the copy engine can read asynchronously."""
        if self._registered is not None:
            return host
        import cupyx
        if self._staging is None or self._staging.nbytes < host.nbytes:
            self._staging = cupyx.empty_pinned(host.nbytes, dtype=np.uint8)
        # The previous copy must be done before the staging buffer is reused.
        self.copied()
        view = self._staging[:host.nbytes].reshape(host.shape)
        view[...] = host
        return view

    def _copy_in(self, dst, host):
        with self.device:
            dst.set(self._host_source(np.ascontiguousarray(host)), stream=self.stream)
            self._pending = self.stream.record()

    def copied(self):
        if self._pending is not None:
            self._pending.synchronize()
            self._pending = None

    # -- array operations on our stream ---------------------------------------------------
    def empty(self, shape, dtype):
        with self.device:
            return self.cupy.empty(shape, dtype=dtype)

    def to_device(self, host, out=None):
        if out is None:
            out = self.empty(host.shape, host.dtype)
        self._copy_in(out, host)
        return out

    def store(self, buffer, entries, slot, count, fixed_shape):
        cp = self.cupy
        with self.device, self.stream:
            if fixed_shape:
                staged = cp.empty((count, buffer.pixels.shape[1]), dtype=cp.uint8)
                self._copy_in(staged, slot.pixels[:count])
                buffer.pixels[cp.asarray(entries)] = staged
            else:
                for i, e in enumerate(entries):
                    n = int(slot.shapes[i][0]) * int(slot.shapes[i][1]) * 3
                    self._copy_in(buffer.pixels[int(e), :n], slot.pixels[i, :n])
            self._pending = self.stream.record()

    def gather(self, buffer, entries, out):
        with self.device, self.stream:
            super().gather(buffer, entries, out)

    def flip(self, images, mask):
        with self.device, self.stream:
            super().flip(images, mask)

    def normalize(self, images, mean, std, layout, out):
        with self.device, self.stream:
            return super().normalize(images, mean, std, layout, out)

    def crop_resize(self, buffer, entries, boxes, flips, out):
        cp = self.cupy
        n = len(entries)
        oh, ow = out.shape[1:3]
        with self.device, self.stream:
            args = (buffer.pixels, np.int64(buffer.pixels.shape[1]),
                    cp.asarray(np.asarray(entries, np.int64)),
                    cp.asarray(np.ascontiguousarray(buffer.shape[entries], np.int32)),
                    cp.asarray(np.ascontiguousarray(boxes, np.float64)),
                    cp.asarray(np.asarray(flips, np.uint8)), np.int32(oh), np.int32(ow), out)
            threads = 256
            self._kernel(((oh * ow + threads - 1) // threads, n), (threads,), args)

    def ready(self, batch):
        """Order the consumer's current stream after everything we queued."""
        with self.device:
            self.cupy.cuda.get_current_stream().wait_event(self.stream.record())
        return batch

"""Stage 6 of the pipeline: where the echo buffer lives and how emissions are made.

A device backend turns echo-buffer entries into an output batch:
``store`` (ring slot -> buffer), ``gather`` (repeat prepared images),
``crop_resize`` (re-augment canvases), ``flip``, ``normalize`` and
``to_device`` (a fresh batch that is not echoed).  :class:`ArrayDevice` writes
all of it once against an array module (NumPy or CuPy); the CPU backend only
swaps in the native resampler, and the CUDA backend (:mod:`echo_native.cuda`)
adds what is CUDA-only: registered ring memory, a copy stream, events, and a
raw resampling kernel.  The bookkeeping that decides *which* entries to emit
(:mod:`echo_native.echo`) is the same for every backend.
"""
from __future__ import annotations

import collections
import math

import numpy as np

from echo_native import _dlpack, _kernel

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
LAYOUTS = ("NHWC", "NCHW")
DTYPES = ("float32", "float16", "bfloat16")


def storage_dtype(dtype):
    """The array dtype that holds a normalised output of ``dtype`` (bfloat16 as its bits)."""
    return np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(dtype)


def output_dtype(out):
    """The name of the normalised dtype an output array holds (inverse of storage_dtype)."""
    return "bfloat16" if out.dtype == np.uint16 else out.dtype.name


def bfloat16_bits(values):
    """float32 -> bfloat16 bits (uint16), rounding to nearest even as torch does.

    Normalised pixels are finite (std > 0), so NaN needs no special case here."""
    u = np.ascontiguousarray(values, np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


def resolve(device):
    """A backend for ``device``: "cpu", "cuda", "cuda:N", "auto", or a backend object
    (an :class:`ArrayDevice`, e.g. ``ArrayDevice(numpy)`` to run the GPU code path
    on the CPU)."""
    if isinstance(device, ArrayDevice):
        return device
    if device in (None, "cpu"):
        return CpuDevice()
    if device == "auto":
        return CpuDevice() if not cuda_available() else _cuda_device("cuda")
    if isinstance(device, str) and (device == "cuda" or device.startswith("cuda:")):
        return _cuda_device(device)
    raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {device!r}")


def cuda_available():
    try:
        import cupy
    except ImportError:
        return False
    try:
        return bool(cupy.is_available())
    except Exception:
        return False


def _cuda_device(device):
    index = 0
    if ":" in device:
        try:
            index = int(device.split(":", 1)[1])
        except ValueError:
            index = -1
        if index < 0:
            raise ValueError(f"device must be 'cuda' or 'cuda:N' with N a device number, got "
                             f"{device!r}")
    try:
        import cupy
    except ImportError:
        raise RuntimeError(f"device={device!r} needs CuPy: pip install 'echo_native[gpu]' "
                           f"(CUDA 12) or 'echo_native[gpu13]' (CUDA 13), or use "
                           f"device='cpu'") from None
    if not cuda_available():
        raise RuntimeError(f"device={device!r} but CuPy finds no usable CUDA device "
                           f"(cupy.is_available() is False); use device='cpu' or 'auto'")
    count = cupy.cuda.runtime.getDeviceCount()
    if index >= count:
        raise ValueError(f"device={device!r} but CuPy sees {count} CUDA device(s): "
                         f"use cuda:0 .. cuda:{count - 1}")
    from echo_native.cuda import CudaDevice
    return CudaDevice(index)


def pillow_weights(in0, in1, in_size, out_size):
    """Dense (out_size, in_size) float64 weights of Pillow's antialiased bilinear filter
    for the interval [in0, in1) resampled to out_size pixels."""
    scale = (in1 - in0) / out_size
    fs = max(scale, 1.0)
    w = np.zeros((out_size, in_size))
    for i in range(out_size):
        center = in0 + (i + 0.5) * scale
        lo = max(int(center - fs + 0.5), 0)
        hi = min(int(center + fs + 0.5), in_size)
        x = np.arange(lo, hi)
        k = np.clip(1.0 - np.abs((x - center + 0.5) / fs), 0.0, None)
        total = k.sum()
        if total > 0:
            w[i, lo:hi] = k / total
    return w


class ArrayDevice:
    """Every emission step over an array module ``xp`` (NumPy or CuPy)."""

    name = "array"

    def __init__(self, xp=np):
        self.xp = xp

    #: The backend's arrays are the host arrays themselves: a fresh batch can be
    #: handed out as the ring slot's view, without a copy.
    host_resident = False
    device_id = 0

    def describe(self):
        """One line for stats(): the backend and how fresh batches reach it."""
        return self.name

    # -- life cycle hooks (CUDA registers ring memory, orders streams) --------------
    def attach(self, ring):
        """Called whenever the loader has created its ring (start, and after a seek)."""

    def detach(self, ring=None):
        """Called before ``ring`` goes away: nothing may still be reading it."""
        self.drain()

    def release_after_copies(self, release):
        """``release()`` gives a ring slot back to the workers; call it once every
        copy out of the slot has completed.  Copies here are synchronous: now."""
        release()

    def drain(self):
        """Return every slot still waiting for its copies."""

    def reuse(self, array):
        """Called before an output buffer is overwritten with a new batch."""
        return array

    def ready(self, batch):
        """Called on each batch before it reaches the consumer."""
        return batch

    def order_consumer(self, stream, event):
        """DLPack export on ``stream``: make it wait for the batch (no-op on the host)."""

    def copy_out(self, array, after=None):
        """A copy of an output array (made after event ``after``), and the event after
        which the copy is complete."""
        return array.copy(), None

    # -- moving pixels -------------------------------------------------------------------
    def empty(self, shape, dtype):
        return self.xp.empty(shape, dtype=dtype)

    def to_device(self, host, out=None):
        """A copy of ``host`` (ring memory, about to be reused) on the device."""
        if out is None:
            return self.xp.array(host, copy=True)
        out[...] = self.xp.asarray(host)
        return out

    def store(self, buffer, entries, slot, count, fixed_shape):
        """Copy ``count`` samples of a slot into buffer entries."""
        xp = self.xp
        if fixed_shape:
            buffer.pixels[xp.asarray(entries)] = xp.asarray(slot.pixels[:count])
            return
        for i, e in enumerate(entries):
            n = int(slot.shapes[i][0]) * int(slot.shapes[i][1]) * 3
            buffer.pixels[int(e), :n] = xp.asarray(slot.pixels[i, :n])

    def copy(self, src, out):
        """Device to device: a repeated batch."""
        out[...] = src
        return out

    def gather(self, buffer, entries, out):
        xp = self.xp
        xp.take(buffer.pixels, xp.asarray(entries), axis=0, out=out.reshape(len(entries), -1))

    def flip(self, images, mask):
        idx = np.flatnonzero(mask)
        if len(idx):
            idx = self.xp.asarray(idx)
            images[idx] = images[idx][:, :, ::-1]

    def crop_resize(self, buffer, entries, boxes, flips, out):
        """Re-augment: crop box i of canvas ``entries[i]``, resize into out[i], flip.

        One separable weighted sum in float, rounded once (the native CPU path
        rounds between its two passes, as Pillow does: they agree within 1-2
        levels)."""
        xp = self.xp
        oh, ow = out.shape[1:3]
        for i, e in enumerate(entries):
            h, w = (int(v) for v in buffer.shape[e])
            top, left, bh, bw = (float(v) for v in boxes[i])
            wy = pillow_weights(top, top + bh, h, oh)
            wx = pillow_weights(left, left + bw, w, ow)
            if flips[i]:
                wx = wx[::-1]
            canvas = buffer.pixels[int(e), :h * w * 3].reshape(h, w, 3).astype(xp.float32)
            rows = xp.asarray(wy, dtype=xp.float32)
            cols = xp.asarray(np.ascontiguousarray(wx), dtype=xp.float32)
            res = xp.einsum("oh,hwc->owc", rows, canvas)
            res = xp.einsum("pw,owc->opc", cols, res)
            out[i] = xp.clip(xp.floor(res + 0.5), 0, 255).astype(xp.uint8)

    def normalize(self, images, mean, std, layout, out):
        """(x / 255 - mean) / std into ``out``, NHWC or NCHW: float32, float16, or
        bfloat16 held as its bits in a uint16 array (see :func:`storage_dtype`)."""
        xp = self.xp
        bshape = (1, 1, 1, 3) if layout == "NHWC" else (1, 3, 1, 1)
        scale = xp.asarray(1.0 / (255.0 * np.asarray(std)), dtype=xp.float32).reshape(bshape)
        shift = xp.asarray(-np.asarray(mean) / np.asarray(std), dtype=xp.float32).reshape(bshape)
        src = images if layout == "NHWC" else images.transpose(0, 3, 1, 2)
        if out.dtype == xp.float32:
            xp.multiply(src, scale, out=out)
            out += shift
        elif out.dtype == xp.uint16:
            out[...] = bfloat16_bits(src * scale + shift)
        else:
            out[...] = src * scale + shift
        return out


class SlotReturns:
    """Ring slots waiting for the copies out of them before going back to the workers.

    Each entry is (event, release): ``event`` (``.done``, ``.synchronize()``,
    as a CUDA event) completes after the slot's copies, ``release()`` hands
    the slot back.  Slots go back as soon as their events are seen done; at
    most ``in_flight`` wait, so the host only ever waits for an older copy,
    never for the one it has just queued.
    """

    def __init__(self, in_flight=1):
        self.in_flight = in_flight
        self._queue = collections.deque()

    def __len__(self):
        return len(self._queue)

    def add(self, event, release):
        self._queue.append((event, release))
        self.poll()

    def poll(self, keep=None):
        keep = self.in_flight if keep is None else keep
        queue = self._queue
        while queue and (len(queue) > keep or queue[0][0].done):
            event, release = queue.popleft()
            event.synchronize()
            release()

    def drain(self):
        self.poll(0)


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


class BFloat16Array:
    """A normalised batch in bfloat16, a type NumPy and CuPy do not have.

    ``bits`` holds it as uint16 (NumPy on the CPU, CuPy on a GPU);
    ``__dlpack__`` exports it with DLPack's bfloat16 type code, so
    ``torch.from_dlpack(a)`` and ``jax.dlpack.from_dlpack(a)`` give bfloat16
    tensors sharing the memory, ordered after the pipeline's stream on a GPU.
    """

    dtype = "bfloat16"

    def __init__(self, bits, device=None):
        if bits.dtype != np.uint16:
            raise TypeError(f"bfloat16 bits must be uint16, got {bits.dtype}")
        self.bits = bits
        self.device = device
        self.event = None  # set by a GPU backend: the batch is complete after it

    @property
    def shape(self):
        return self.bits.shape

    @property
    def ndim(self):
        return self.bits.ndim

    def __len__(self):
        return len(self.bits)

    def __repr__(self):
        return f"BFloat16Array(shape={self.shape}, on={type(self.bits).__module__})"

    def to_float32(self):
        """The values as float32 (exact: bfloat16 is float32's upper half), same array module."""
        return (self.bits.astype(np.uint32) << 16).view(np.float32)

    def __array__(self, dtype=None, copy=None):
        # NumPy has no bfloat16 of its own: never let it make an object array.
        if self._on_gpu():
            raise TypeError("a bfloat16 batch on the GPU does not convert to NumPy "
                            "implicitly: use .to_float32().get() or .bits.get()")
        if dtype is not None:
            if copy is False:
                raise ValueError("bfloat16 -> another dtype needs a copy")
            return self.to_float32().astype(dtype, copy=False)
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError("NumPy has no bfloat16 type: use .to_float32(), .bits (uint16), "
                            "np.asarray(a, np.float32), or install ml_dtypes") from None
        view = self.bits.view(ml_dtypes.bfloat16)
        return view.copy() if copy else view

    def copy(self):
        if self.device is None:
            return BFloat16Array(self.bits.copy())
        bits, event = self.device.copy_out(self.bits, self.event)
        out = BFloat16Array(bits, self.device)
        out.event = event
        return out

    def _on_gpu(self):
        return hasattr(self.bits, "__cuda_array_interface__")

    def __dlpack_device__(self):
        if not self._on_gpu():
            return (_dlpack.KDL_CPU, 0)
        return (_dlpack.KDL_CUDA, self.device.device_id if self.device else self.bits.device.id)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"this bfloat16 batch lives on {self.__dlpack_device__()}, "
                              f"not {tuple(dl_device)}")
        source = self.copy() if copy else self
        bits = source.bits
        if self._on_gpu():
            if self.device is not None:
                self.device.order_consumer(stream, source.event)
            ptr = bits.data.ptr
        else:
            ptr = bits.ctypes.data
        kind, index = self.__dlpack_device__()
        # Legacy capsule: every consumer accepts it, whatever max_version it offers.
        return _dlpack.capsule(bits, ptr, bits.shape, [s // 2 for s in bits.strides], kind,
                               index, _dlpack.KDL_BFLOAT, 16)


def buffer_bytes(entries, entry_bytes):
    """Human-readable size of an echo buffer, for error messages."""
    n = entries * entry_bytes
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{math.ceil(n / 2**20)} MiB"

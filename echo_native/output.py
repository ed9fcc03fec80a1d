"""What the consumer receives: the output contract and the types that carry it.

Batches are uint8 NHWC unless an :class:`Output` asks for normalisation, in
which case they are float32, float16 or bfloat16 in NHWC or NCHW.  NumPy and
CuPy have no bfloat16, so such a batch is a :class:`BFloat16Array` whose
``__dlpack__`` hands torch and JAX a real bfloat16 tensor.  The backends
(:mod:`echo_native.backends`) compute into these types.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from echo_native import _dlpack

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
LAYOUTS = ("NHWC", "NCHW")
DTYPES = ("float32", "float16", "bfloat16")




@dataclass(frozen=True)
class Output:
    """What a batch's images are: the output contract (DALI's ``crop_mirror_normalize``).

    Parameters
    ----------
    normalize : True, (mean, std) or False, default True
        True: ``(x / 255 - mean) / std`` with ImageNet's mean and std; a pair of
        3-tuples in [0, 1] units for others; False: uint8 pixels as decoded.
    layout : {"NHWC", "NCHW"}, default "NHWC"
        Axis order of normalised output (uint8 output is NHWC).
    dtype : {"float32", "float16", "bfloat16"}, default "float32"
        Type of normalised output; "uint8" (the only choice) without normalisation.
        A bfloat16 batch is a :class:`BFloat16Array` (DLPack gives torch and JAX
        real bfloat16 tensors).

    ``output=None`` means uint8 NHWC, the same as ``Output(normalize=False)``.
    Normalisation runs once per batch where the batch is (on the GPU for
    ``device="cuda"``), into one of two alternating buffers.
    """

    normalize: object = True
    layout: str = "NHWC"
    dtype: str = None

    def __post_init__(self):
        n = self.normalize
        if n is True:
            stats = (IMAGENET_MEAN, IMAGENET_STD)
        elif n is False or n is None:
            stats = None
        else:
            try:
                mean, std = n
                mean, std = tuple(float(m) for m in mean), tuple(float(s) for s in std)
            except (TypeError, ValueError):
                raise ValueError(f"Output: normalize must be True, False or (mean, std), got "
                                 f"{n!r}") from None
            if len(mean) != 3 or len(std) != 3 or not min(std) > 0 or \
                    not all(np.isfinite(mean + std)):
                raise ValueError(f"Output: normalize needs 3 finite means and 3 positive stds, "
                                 f"got {n!r}")
            stats = (mean, std)
        if stats is None or n is True:
            object.__setattr__(self, "normalize", stats is not None)
        else:
            object.__setattr__(self, "normalize", stats)
        if self.layout not in LAYOUTS:
            raise ValueError(f"Output: layout must be one of {LAYOUTS}, got {self.layout!r}")
        if stats is None:
            if self.dtype not in (None, "uint8"):
                raise ValueError(f"Output: dtype={self.dtype!r} needs normalize=True (or "
                                 f"(mean, std)); without normalisation batches are uint8")
            if self.layout != "NHWC":
                raise ValueError(f"Output: layout={self.layout!r} applies to normalised "
                                 f"output; uint8 batches are NHWC")
            object.__setattr__(self, "dtype", "uint8")
        else:
            dtype = "float32" if self.dtype is None else self.dtype
            if dtype not in DTYPES:
                raise ValueError(f"Output: dtype of normalised output must be one of {DTYPES}, "
                                 f"got {self.dtype!r}")
            object.__setattr__(self, "dtype", dtype)

    @property
    def normalized(self):
        """True unless the batches are uint8 pixels."""
        return self.normalize is not False

    @property
    def mean(self):
        """Per-channel mean in [0, 1] units, or None without normalisation."""
        if self.normalize is False:
            return None
        return IMAGENET_MEAN if self.normalize is True else self.normalize[0]

    @property
    def std(self):
        """Per-channel std in [0, 1] units, or None without normalisation."""
        if self.normalize is False:
            return None
        return IMAGENET_STD if self.normalize is True else self.normalize[1]


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

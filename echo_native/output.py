"""What the consumer receives: the output contract and the types that carry it.

Batches are uint8 NHWC unless an :class:`Output` asks for normalisation, in
which case they are float32, float16 or bfloat16 in NHWC or NCHW.  NumPy and
CuPy have no bfloat16, so such a batch is a :class:`BFloat16Array` whose
``__dlpack__`` hands torch and JAX a real bfloat16 tensor.  On a GPU the other
dtypes come as a :class:`DeviceArray`: CuPy's array, exported so that the
pipeline learns every stream a consumer reads it on.  The backends
(:mod:`echo_native.backends`) compute into these types.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from echo_native import _dlpack
from echo_native._checks import either

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
    ``device="cuda"``), into the device's rotating output buffers (three).
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


#: DLPack type codes (dlpack.h), by NumPy dtype kind: kDLInt, kDLUInt, kDLFloat.
_DLPACK_KIND = {"i": 0, "u": 1, "f": 2}


def _capsule(array, code, bits, device_id):
    """A DLPack capsule over a CuPy array (a CUDA pointer), ``code``/``bits`` its type."""
    return _dlpack.capsule(array, array.data.ptr, array.shape,
                           [s // array.itemsize for s in array.strides], _dlpack.KDL_CUDA,
                           device_id, code, bits)


def bfloat16_bits(values):
    """float32 -> bfloat16 bits (uint16), rounding to nearest even as torch does.

    Normalised pixels are finite (std > 0), so NaN needs no special case here."""
    u = np.ascontiguousarray(values, np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


def _exported(batch, dl_device, copy):
    """What a ``__dlpack__(dl_device=..., copy=...)`` call exports: the batch itself, or
    a copy when asked; a device other than the batch's is a BufferError."""
    if dl_device is not None and tuple(dl_device) != batch.__dlpack_device__():
        raise BufferError(f"this {type(batch).__name__} lives on "
                          f"{batch.__dlpack_device__()}, not {tuple(dl_device)}")
    return batch.copy() if copy else batch


def _forwarded(held, name):
    """The read-only attribute ``name`` of the array a wrapper holds in ``held``."""
    return property(lambda self: getattr(getattr(self, held), name),
                    doc=f"``{held}.{name}``")


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
        self.reused = device is not None  # in an output buffer the pipeline will overwrite

    shape, ndim = (_forwarded("bits", name) for name in ("shape", "ndim"))

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
        out.event, out.reused = event, False
        return out

    def _on_gpu(self):
        return hasattr(self.bits, "__cuda_array_interface__")

    def __dlpack_device__(self):
        if not self._on_gpu():
            return (_dlpack.KDL_CPU, 0)
        return (_dlpack.KDL_CUDA, self.device.device_id if self.device else self.bits.device.id)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        source = _exported(self, dl_device, copy)
        bits = source.bits
        kind, index = self.__dlpack_device__()
        if self._on_gpu():
            if self.device is not None:
                # The consumer's stream waits for the batch, and the pipeline for that
                # stream before it overwrites the buffer (a copy is the consumer's own).
                self.device.order_consumer(stream, source.event, remember=source.reused)
            # Legacy capsule: every consumer accepts it, whatever max_version it offers.
            return _capsule(bits, _dlpack.KDL_BFLOAT, 16, index)
        return _dlpack.capsule(bits, bits.ctypes.data, bits.shape, [s // 2 for s in bits.strides],
                               kind, index, _dlpack.KDL_BFLOAT, 16)


class DeviceArray:
    """A batch's array on a GPU: its uint8, float32 or float16 images, its Mix
    targets, or what ``on_batch`` returned.

    ``array`` is the backend's own array (CuPy): for images, one of the
    pipeline's rotating output buffers; for the others, made for that batch and
    held by the pipeline until the consumer's reads of it are done.  What the wrapper adds is that every way out of it
    tells the pipeline which stream will read the batch: that stream is ordered
    after the batch, and the pipeline's stream waits for it before it
    overwrites the buffer.  CuPy's own export would only do the first, so a
    consumer that reads late on a stream of its own (JAX, torch under
    ``torch.cuda.stream(s)``) could see the buffer overwritten.

    - ``torch.from_dlpack(x)``, ``jax.dlpack.from_dlpack(x)``,
      ``cupy.from_dlpack(x)``: ``__dlpack__(stream=s)`` (no copy);
    - ``cupy.asarray(x)``: ``__cuda_array_interface__``, which names the
      current CuPy stream of the batch's device (no copy);
    - ``x.get()``: a NumPy copy; ``x.copy()``: a copy on the GPU that outlives
      the buffer (made on the current stream).

    NumPy conversion is refused (``np.asarray(x)``), as CuPy refuses it.
    """

    def __init__(self, array, device, event=None, reused=True):
        self.array = array
        self.device = device
        self.event = event      # the batch is complete after it (None: already)
        self.reused = reused    # a view of an output buffer the pipeline will overwrite

    shape, dtype, ndim, size, nbytes = (_forwarded("array", name) for name in
                                        ("shape", "dtype", "ndim", "size", "nbytes"))

    def __len__(self):
        return len(self.array)

    def __repr__(self):
        return (f"DeviceArray(shape={self.shape}, dtype={self.dtype}, "
                f"device=cuda:{self.device.device_id})")

    def __array__(self, dtype=None, copy=None):
        raise TypeError("a batch on the GPU does not convert to NumPy implicitly: use "
                        ".get(), or cupy.asnumpy(x)")

    def get(self):
        """The batch as a NumPy array (waits for it)."""
        return self.device.to_host(self.array, self.event)

    def copy(self):
        """A copy on the GPU, made on the current stream after the batch is complete;
        the pipeline never overwrites it."""
        array, event = self.device.copy_out(self.array, self.event)
        return DeviceArray(array, self.device, event, reused=False)

    @property
    def __cuda_array_interface__(self):
        # Taking the interface is taking the batch: the stream it names (the current
        # CuPy stream of the batch's device) is ordered after the batch and remembered.
        return self.device.array_interface(self.array, self.event, remember=self.reused)

    def __dlpack_device__(self):
        return (_dlpack.KDL_CUDA, self.device.device_id)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        source = _exported(self, dl_device, copy)
        array = source.array
        self.device.order_consumer(stream, source.event, remember=source.reused)
        try:
            code = _DLPACK_KIND[array.dtype.kind]
        except KeyError:
            raise BufferError(f"no DLPack export for {array.dtype}") from None
        # Legacy capsule: every consumer accepts it, whatever max_version it offers.
        return _capsule(array, code, 8 * array.itemsize, self.device.device_id)


#: EchoRing's flat shorthands of the original contract that make its Output.
SHORTHANDS = ("normalize", "layout", "dtype")


def fold_output(owner, output, given=None):
    """``output=`` as an :class:`Output`, with the flat ``normalize``/``layout``/``dtype``
    (:data:`SHORTHANDS`) ``given`` folded in."""
    given = given or {}
    if given:
        either(owner, "output=Output(...)", output, given)
        if not given.get("normalize"):
            # The flat contract checked layout and dtype but used them only with
            # normalisation: check them the same way, then give uint8.
            Output(normalize=True, layout=given.get("layout", "NHWC"),
                   dtype=given.get("dtype", "float32"))
            return Output(normalize=False)
        return Output(**given)
    if output is None:
        return Output(normalize=False)
    if not isinstance(output, Output):
        raise TypeError(f"output must be an echo_native.Output or None, got {output!r}")
    return output

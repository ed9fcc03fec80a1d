"""Thin bindings over the C kernel (src/kernel/en_*.c).

Every byte-level call runs with the GIL released; the GIL is taken again only
to turn a failure status into an exception.  Argument checks live here, the
pixels never leave C.
"""
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t, UINT64_MAX
from libc.string cimport memcpy
cimport numpy as cnp
import enum

import numpy as np

from echo_native.errors import DecodeError

cnp.import_array()

# The components live in the .pxi files included at the end rather than in extensions of
# their own: the Decoder's methods span decoding and resizing over one C decoder, and
# separate modules would each link their own copy of the C kernel.  This file holds what
# several components share.


cdef extern from "en_kernel.h" nogil:
    ctypedef struct en_decoder:
        pass
    ctypedef struct en_box:
        double top, left, height, width
    ctypedef struct en_rrc_spec:
        double scale_lo, scale_hi, ratio_lo, ratio_hi, flip_p
    ctypedef struct en_key:
        uint64_t seed, epoch, sample_id, echo_index

    int EN_OK, EN_ERR_DECODE, EN_ERR_LIMIT, EN_ERR_ARG, EN_ERR_NOMEM
    const char *en_decoder_errmsg(const en_decoder *d)


cdef int _raise(en_decoder *d, int status) except -1:
    msg = en_decoder_errmsg(d).decode("utf-8", "replace")
    if status == EN_ERR_ARG:
        raise ValueError(msg)
    if status == EN_ERR_NOMEM:
        raise MemoryError(msg)
    raise DecodeError(msg)


cdef en_box _box(box) except *:
    try:
        top, left, height, width = box
    except (TypeError, ValueError):
        raise TypeError(f"box must be (top, left, height, width), got {box!r}") from None
    cdef en_box b
    b.top, b.left, b.height, b.width = float(top), float(left), float(height), float(width)
    return b


cpdef tuple check_size(size):
    """(height, width) of an output size, or TypeError/ValueError saying what is wrong."""
    try:
        h, w = size
        h, w = int(h), int(w)
    except (TypeError, ValueError):
        raise TypeError(f"size must be (height, width), got {size!r}") from None
    if h <= 0 or w <= 0 or h > 65535 or w > 65535:
        raise ValueError(f"size must be positive and at most 65535, got {size!r}")
    return h, w


cdef cnp.ndarray _output(out, int h, int w):
    """A fresh (h, w, 3) uint8 array, or `out` checked to be one we may write."""
    if out is None:
        return np.empty((h, w, 3), dtype=np.uint8)
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy.ndarray, got {type(out).__name__}")
    shape, strides = out.shape, out.strides
    if out.dtype != np.uint8 or shape != (h, w, 3):
        raise ValueError(f"out must be a ({h}, {w}, 3) uint8 array, got {shape} {out.dtype}")
    if not out.flags.writeable:
        raise ValueError("out is read-only")
    if strides[2] != 1 or strides[1] != 3 or strides[0] < w * 3:
        raise ValueError(f"out rows must be contiguous RGB pixels, got strides {strides}")
    return out


def _array(x, name, dtype, ndim, writable=False):
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(x).__name__}")
    if x.dtype != dtype or x.ndim != ndim or not x.flags.c_contiguous or \
            (writable and not x.flags.writeable):
        raise ValueError(f"{name} must be a C-contiguous{' writable' if writable else ''} "
                         f"{ndim}-d {np.dtype(dtype).name} array, got {x.dtype} shape {x.shape} "
                         f"contiguous={x.flags.c_contiguous} writeable={x.flags.writeable}")
    return x


include "_kernel_decode.pxi"
include "_kernel_resize.pxi"
include "_kernel_draws.pxi"
include "_kernel_ops.pxi"
include "_kernel_pool.pxi"

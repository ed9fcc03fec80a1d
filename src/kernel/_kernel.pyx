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
# several components share; _kernel_args.pxi, what _seek's Seeker shares with them too.
include "_kernel_args.pxi"


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

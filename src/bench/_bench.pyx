"""Benchmark-only helpers: the libjpeg-turbo decode-only ceiling."""
from libc.stdint cimport uint8_t
import numpy as np


cdef extern from "roi_ceiling.h" nogil:
    int roi_decode_only(const unsigned char *data, unsigned long length, int top, int left,
                        int height, int width, int denom, unsigned char *scratch,
                        unsigned long scratch_cap)


cdef uint8_t[::1] _scratch = np.empty(3 * 65536, dtype=np.uint8)


def roi_decode(const uint8_t[::1] data not None, int top, int left, int height, int width,
               int denom):
    """Decode only the crop's rows and columns at 1/denom; returns rows decoded."""
    cdef int rows
    with nogil:
        rows = roi_decode_only(&data[0], data.shape[0], top, left, height, width, denom,
                               &_scratch[0], _scratch.shape[0])
    if rows < 0:
        raise ValueError("libjpeg-turbo could not decode the crop")
    return rows

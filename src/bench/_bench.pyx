"""Benchmark-only helpers: the libjpeg-turbo decode-only ceiling."""
from libc.stdint cimport uint8_t
import numpy as np


cdef extern from "roi_ceiling.h" nogil:
    int roi_decode_only(const unsigned char *data, unsigned long length, int top, int left,
                        int height, int width, int denom, int mode, unsigned char *scratch,
                        unsigned long scratch_cap, unsigned long *need)


cdef uint8_t[::1] _scratch = np.empty(3 * 65536, dtype=np.uint8)


#: What :func:`roi_decode` does once at the crop's first row (roi_ceiling.h).
MODES = {"rgb": 0, "ycc": 1, "entropy": 2, "finish": 3, "store": 4}


def roi_decode(const uint8_t[::1] data not None, int top, int left, int height, int width,
               int denom, mode="rgb"):
    """Decode only the crop's rows and columns at 1/denom; returns rows decoded.

    mode: "rgb" stops after the crop's last row (the ceiling); "ycc" outputs YCbCr
    (libjpeg's plane interleave then costs about what its SIMD colour conversion
    does); "entropy" skips the crop's rows (entropy decoding only);
    "finish" also decodes to the end of the file and fails on any warning, as a
    decoder that checks the whole file does; "store" keeps every row of the crop
    (in a buffer kept from call to call), as a decoder that returns the crop does.
    """
    global _scratch
    cdef int rows, m = MODES[mode]
    cdef unsigned long need = 0
    cdef uint8_t[::1] buf
    while True:
        buf = _scratch  # held: another thread may replace the global meanwhile
        with nogil:
            rows = roi_decode_only(&data[0], data.shape[0], top, left, height, width, denom, m,
                                   &buf[0], buf.shape[0], &need)
        if rows != -2 or need <= <unsigned long>buf.shape[0]:
            break
        _scratch = np.empty(need, dtype=np.uint8)  # once per new largest crop
    if rows < 0:
        why = {-3: "libjpeg-turbo warned (corrupt or truncated data)"}
        raise ValueError(f"libjpeg-turbo could not decode the crop: "
                         f"{why.get(rows, 'decode error')}")
    return rows

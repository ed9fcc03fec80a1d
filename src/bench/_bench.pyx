"""Benchmark-only helpers: the libjpeg-turbo decode-only ceiling."""
from libc.stdint cimport uint8_t
import numpy as np


cdef extern from "roi_ceiling.h" nogil:
    int roi_decode_only(const unsigned char *data, unsigned long length, int top, int left,
                        int height, int width, int denom, int mode, unsigned char *scratch,
                        unsigned long scratch_cap)


cdef uint8_t[::1] _scratch = np.empty(3 * 65536, dtype=np.uint8)


#: What :func:`roi_decode` does once at the crop's first row (roi_ceiling.h).
MODES = {"rgb": 0, "ycc": 1, "entropy": 2, "finish": 3}


def roi_decode(const uint8_t[::1] data not None, int top, int left, int height, int width,
               int denom, mode="rgb"):
    """Decode only the crop's rows and columns at 1/denom; returns rows decoded.

    mode: "rgb" stops after the crop's last row (the ceiling); "ycc" skips the
    colour conversion; "entropy" skips the crop's rows (entropy decoding only);
    "finish" also decodes to the end of the file and fails on any warning, as a
    decoder that checks the whole file does.
    """
    cdef int rows, m = MODES[mode]
    with nogil:
        rows = roi_decode_only(&data[0], data.shape[0], top, left, height, width, denom, m,
                               &_scratch[0], _scratch.shape[0])
    if rows < 0:
        why = {-2: "a row is wider than the scratch buffer",
               -3: "libjpeg-turbo warned (corrupt or truncated data)"}
        raise ValueError(f"libjpeg-turbo could not decode the crop: "
                         f"{why.get(rows, 'decode error')}")
    return rows

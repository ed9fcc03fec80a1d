# The decoder's types and the argument checks of its crop calls, shared by the two bindings
# that drive it: _kernel.pyx (Decoder) and _seek.pyx (Seeker, whose crop methods take the
# same arguments and must refuse and accept exactly what Decoder's do).  Included, not
# cimported: the helpers are cdef functions each module compiles for itself, as each
# compiles the C kernel (setup.py puts src/kernel on Cython's include path for _seek).

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


cdef en_rrc_spec _spec(scale, ratio, double flip_p) except *:
    cdef en_rrc_spec spec
    spec.scale_lo, spec.scale_hi = float(scale[0]), float(scale[1])
    spec.ratio_lo, spec.ratio_hi = float(ratio[0]), float(ratio[1])
    spec.flip_p = flip_p
    if not (0 < spec.scale_lo <= spec.scale_hi <= 1):
        raise ValueError(f"scale must satisfy 0 < lo <= hi <= 1, got {tuple(scale)!r}")
    if not (0 < spec.ratio_lo <= spec.ratio_hi):
        raise ValueError(f"ratio must satisfy 0 < lo <= hi, got {tuple(ratio)!r}")
    if not (0 <= flip_p <= 1):
        raise ValueError(f"flip_p must be in [0, 1], got {flip_p}")
    return spec


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

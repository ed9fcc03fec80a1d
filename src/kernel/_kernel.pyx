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


cdef extern from "en_kernel.h" nogil:
    ctypedef struct en_decoder:
        pass
    ctypedef struct en_limits:
        uint64_t max_pixels
        int max_scans
        int strict
        uint64_t max_memory
    ctypedef struct en_image_info:
        int width, height, components, progressive, colorspace
    ctypedef struct en_box:
        double top, left, height, width
    ctypedef struct en_rrc_spec:
        double scale_lo, scale_hi, ratio_lo, ratio_hi, flip_p
    ctypedef struct en_key:
        uint64_t seed, epoch, sample_id, echo_index

    int EN_OK, EN_ERR_DECODE, EN_ERR_LIMIT, EN_ERR_ARG, EN_ERR_NOMEM
    uint64_t EN_DEFAULT_MAX_PIXELS
    int EN_DEFAULT_MAX_SCANS
    uint64_t EN_DEFAULT_MAX_MEMORY

    en_decoder *en_decoder_new()
    void en_decoder_free(en_decoder *d)
    void en_decoder_set_limits(en_decoder *d, en_limits limits)
    en_limits en_decoder_get_limits(const en_decoder *d)
    const char *en_decoder_errmsg(const en_decoder *d)
    int en_decoder_warnings(const en_decoder *d)
    int en_decoder_harmless_warnings(const en_decoder *d)
    uint64_t en_decoder_last_memory(const en_decoder *d)
    int en_decoder_last_scale(const en_decoder *d)
    ctypedef struct en_profile:
        uint64_t calls, header_ns, start_ns, skip_ns, rows_ns, tail_ns, hpass_ns, vpass_ns
        uint64_t finish_ns
    void en_decoder_profile(en_decoder *d, int on)
    en_profile en_decoder_get_profile(const en_decoder *d)
    int en_jpeg_info(en_decoder *d, const uint8_t *data, size_t length, en_image_info *info)
    int en_jpeg_decode(en_decoder *d, const uint8_t *data, size_t length, uint8_t *out,
                       size_t out_cap, size_t stride)
    int en_pick_scale(en_box box, int out_h, int out_w)
    int en_jpeg_decode_crop(en_decoder *d, const uint8_t *data, size_t length, en_box box,
                            int out_h, int out_w, int flip, uint8_t *out, size_t stride)
    ctypedef struct en_canvas:
        int denom, reduced_height, reduced_width, height, width
        double scale_y, scale_x
        int source_height, source_width
    void en_canvas_plan(int height, int width, int min_side, uint64_t max_pixels, en_canvas *c)
    int en_jpeg_decode_canvas(en_decoder *d, const uint8_t *data, size_t length, int min_side,
                              uint64_t max_pixels, uint8_t *out, size_t out_cap,
                              en_canvas *canvas)
    int en_resize_rgb(en_decoder *d, const uint8_t *src, int h, int w, size_t src_stride,
                      en_box box, int out_h, int out_w, int flip, uint8_t *out, size_t stride)
    void en_philox4x64(const uint64_t *ctr, const uint64_t *key, uint64_t *out)
    void en_random_resized_crop(en_key key, int height, int width, en_rrc_spec spec,
                                en_box *box, int *flip)
    en_box en_center_crop_box(int height, int width, int resize_side, int out_h, int out_w)
    int en_jpeg_decode_center_crop(en_decoder *d, const uint8_t *data, size_t length,
                                   int resize_side, int out_h, int out_w, uint8_t *out,
                                   size_t stride, en_box *box)
    int en_jpeg_decode_random_crop(en_decoder *d, const uint8_t *data, size_t length,
                                   en_key key, en_rrc_spec spec, int out_h, int out_w,
                                   uint8_t *out, size_t stride, en_box *box, int *flip)
    int EN_DRAW_COLOR_JITTER, EN_DRAW_GRAYSCALE, EN_DRAW_TRIVIAL_WIDE, EN_DRAW_ERASING
    enum: EN_DRAW_NUMBERS
    ctypedef struct en_draw_kind:
        const char *name
        int kind, numbers, steps
    const en_draw_kind en_draw_kinds[]
    ctypedef struct en_op_spec:
        int kind
        double v[EN_DRAW_NUMBERS]
    int en_ops_steps(const en_op_spec *ops, int nops)
    void en_ops_draw(const en_op_spec *ops, int nops, int steps, uint64_t seed,
                     const int64_t *epochs, const int64_t *sample_ids,
                     const int64_t *echo_index, int64_t n, int h, int w, int32_t *codes,
                     float *args)


cdef extern from "en_ops.h" nogil:
    int OP_ARGS_C "OP_ARGS"
    int en_op_count()
    const char *en_op_name(int code)
    int en_op_counts(int code)
    int en_op_maps(int code)
    const char *en_cuda_source()
    int en_ops_check(const int32_t *codes, const float *args, int64_t n, int steps, int h,
                     int w, char *msg, size_t cap)
    void en_ops_apply(uint8_t *images, int64_t n, int h, int w, const int32_t *codes,
                      const float *args, int steps, uint8_t *scratch)
    ctypedef struct en_reaug:
        pass
    en_reaug *en_reaug_new(int threads)
    void en_reaug_free(en_reaug *r)
    int en_reaug_threads(const en_reaug *r)
    int en_reaug_run(en_reaug *r, const uint8_t *pixels, int64_t row_bytes,
                     const int64_t *entries, const int32_t *shapes, const double *boxes,
                     const uint8_t *flips, int64_t n, int out_h, int out_w, uint8_t *out,
                     const int32_t *codes, const float *args, int steps, char *msg, size_t cap)
    int en_reaug_apply(en_reaug *r, uint8_t *images, int64_t n, int h, int w,
                       const int32_t *codes, const float *args, int steps)
    void en_reaug_gather(en_reaug *r, const uint8_t *pixels, int64_t row_bytes,
                         const int64_t *entries, int64_t n, int h, int w, uint8_t *out,
                         const uint8_t *mirror)
    void en_store_rows(uint8_t *dst, int64_t dst_row_bytes, const int64_t *entries,
                       const uint8_t *src, int64_t src_row_bytes, const int64_t *nbytes,
                       int64_t n)


DEFAULT_MAX_PIXELS = EN_DEFAULT_MAX_PIXELS
DEFAULT_MAX_SCANS = EN_DEFAULT_MAX_SCANS
DEFAULT_MAX_MEMORY = EN_DEFAULT_MAX_MEMORY

# A valid address for zero-length input; the C side checks the length first.
cdef uint8_t _EMPTY[1]


cdef inline const uint8_t *_bytes_ptr(const uint8_t[::1] data):
    return &data[0] if data.shape[0] > 0 else _EMPTY


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


def flat_buffer(out):
    """``out`` as a flat uint8 view of the same memory, or ValueError: a canvas is written
    into the first bytes of any writable contiguous uint8 buffer."""
    arr = np.asarray(out)
    # reshape(-1) of a non-contiguous array is a copy: the canvas would be
    # written there and `out` left untouched.  Refuse it instead.
    if arr.dtype != np.uint8 or not arr.flags.c_contiguous or not arr.flags.writeable:
        raise ValueError(f"out must be a writable contiguous uint8 buffer, got {arr.dtype} "
                         f"contiguous={arr.flags.c_contiguous} "
                         f"writeable={arr.flags.writeable}")
    return arr.reshape(-1)


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


cdef int _check_canvases(const uint8_t[:, ::1] pixels, const int64_t[::1] entries,
                         const int32_t[:, ::1] shapes, const double[:, ::1] boxes,
                         const uint8_t[::1] flips, uint8_t[:, :, :, ::1] o) except -1:
    """ValueError / IndexError unless every entry is a row of ``pixels`` holding a canvas
    of ``shapes[entry]`` and boxes, flips and outputs match the entries."""
    cdef Py_ssize_t n = entries.shape[0], i
    if boxes.shape[0] != n or flips.shape[0] != n or o.shape[0] < n:
        raise ValueError(f"{n} entries need {n} boxes, flips and output images, got "
                         f"{boxes.shape[0]}, {flips.shape[0]} and {o.shape[0]}")
    if boxes.shape[1] != 4 or shapes.shape[1] != 2 or o.shape[3] != 3:
        raise ValueError("boxes must be (n, 4), shapes (rows, 2) and out (n, h, w, 3)")
    cdef Py_ssize_t rows = pixels.shape[0], row_bytes = pixels.shape[1]
    cdef int64_t e
    for i in range(n):
        e = entries[i]
        if e < 0 or e >= rows or e >= shapes.shape[0]:
            raise IndexError(f"entry {e} is outside the {rows} rows of pixels")
        if shapes[e, 0] <= 0 or shapes[e, 1] <= 0 or \
                <Py_ssize_t>shapes[e, 0] * shapes[e, 1] * 3 > row_bytes:
            raise ValueError(f"entry {e}: a {shapes[e, 0]}x{shapes[e, 1]} canvas does not "
                             f"fit a row of {row_bytes} bytes")
    return 0


cdef class Decoder:
    """One libjpeg decompressor and its scratch buffers, reused call after call.

    Not thread-safe: give each thread its own (the module-level functions in
    :mod:`echo_native.decode` do this for you).
    """
    cdef en_decoder *_d

    def __cinit__(self, max_pixels=EN_DEFAULT_MAX_PIXELS, max_scans=EN_DEFAULT_MAX_SCANS,
                  strict=True, max_memory=EN_DEFAULT_MAX_MEMORY):
        self._d = en_decoder_new()
        if self._d == NULL:
            raise MemoryError("cannot allocate a JPEG decoder")
        self.set_limits(max_pixels, max_scans, strict, max_memory)

    def __dealloc__(self):
        en_decoder_free(self._d)

    def set_limits(self, max_pixels, max_scans, strict, max_memory=EN_DEFAULT_MAX_MEMORY):
        if max_pixels <= 0 or max_scans <= 0 or max_memory <= 0:
            raise ValueError(f"max_pixels, max_scans and max_memory must be positive, got "
                             f"{max_pixels}, {max_scans} and {max_memory}")
        cdef en_limits lim
        lim.max_pixels = max_pixels
        lim.max_scans = max_scans
        lim.strict = 1 if strict else 0
        lim.max_memory = max_memory
        en_decoder_set_limits(self._d, lim)

    @property
    def limits(self):
        cdef en_limits lim = en_decoder_get_limits(self._d)
        return {"max_pixels": lim.max_pixels, "max_scans": lim.max_scans,
                "strict": bool(lim.strict), "max_memory": lim.max_memory}

    @property
    def last_scale(self):
        """DCT denominator (1, 2, 4 or 8) the last decode used."""
        return en_decoder_last_scale(self._d)

    @property
    def warnings(self):
        """Data-loss warnings of the last call: truncated or corrupt image data, junk
        inside or after a scan (what strict mode refuses; lenient mode decodes on)."""
        return en_decoder_warnings(self._d)

    @property
    def harmless_warnings(self):
        """Harmless warnings of the last call: junk between header segments, odd APPn
        contents (never refused)."""
        return en_decoder_harmless_warnings(self._d)

    @property
    def last_memory(self):
        """Working memory (bytes) the last header parsed needs, as max_memory counts it:
        the coefficient buffers of a multi-scan file plus width * height * 3."""
        return en_decoder_last_memory(self._d)

    def profile(self, on=True):
        """Start (zeroing the counters) or stop (keeping them) timing the crop and
        canvas calls; see :meth:`stages`.  Costs two clock reads per stage while on."""
        en_decoder_profile(self._d, 1 if on else 0)

    def stages(self):
        """Seconds spent per stage by the crop and canvas calls (decode_crop,
        decode_random_crop, decode_center_crop, decode_canvas) since :meth:`profile`
        turned timing on, and ``calls`` (a canvas's rows are the whole image's, and its
        finish reads the file to its end):

        header   header, table and limit checks, the box and its DCT scale
        start    ``jpeg_start_decompress``: all of a multi-scan file's entropy decode
        skip     skipping to the crop's first row (entropy decode only)
        rows     the crop's rows: entropy decode, IDCT, chroma upsampling, colour
        tail     strict mode's look at the bytes below the crop
        hpass    horizontal resampling pass (the flip is folded in)
        vpass    vertical resampling pass, written straight into the output
        finish   releasing libjpeg's state
        """
        cdef en_profile p = en_decoder_get_profile(self._d)
        return {"calls": p.calls, "header": p.header_ns * 1e-9, "start": p.start_ns * 1e-9,
                "skip": p.skip_ns * 1e-9, "rows": p.rows_ns * 1e-9, "tail": p.tail_ns * 1e-9,
                "hpass": p.hpass_ns * 1e-9, "vpass": p.vpass_ns * 1e-9,
                "finish": p.finish_ns * 1e-9}

    def info(self, const uint8_t[::1] data not None):
        """(height, width, components, progressive) from the JPEG header."""
        cdef en_image_info info
        cdef int st
        cdef const uint8_t *src = _bytes_ptr(data)
        with nogil:
            st = en_jpeg_info(self._d, src, data.shape[0], &info)
        if st:
            _raise(self._d, st)
        return info.height, info.width, info.components, bool(info.progressive)

    def decode(self, const uint8_t[::1] data not None):
        h, w, _, _ = self.info(data)
        cdef cnp.ndarray out = np.empty((h, w, 3), dtype=np.uint8)
        cdef uint8_t *p = <uint8_t *>cnp.PyArray_DATA(out)
        cdef size_t cap = out.nbytes, stride = w * 3
        cdef int st
        cdef const uint8_t *src = _bytes_ptr(data)
        with nogil:
            st = en_jpeg_decode(self._d, src, data.shape[0], p, cap, stride)
        if st:
            _raise(self._d, st)
        return out

    def decode_crop(self, const uint8_t[::1] data not None, box, size, flip=False, out=None):
        cdef en_box b = _box(box)
        oh, ow = check_size(size)
        cdef cnp.ndarray o = _output(out, oh, ow)
        cdef uint8_t *p = <uint8_t *>cnp.PyArray_DATA(o)
        cdef size_t stride = o.strides[0]
        cdef int st, f = 1 if flip else 0, h = oh, w = ow
        cdef const uint8_t *src = _bytes_ptr(data)
        with nogil:
            st = en_jpeg_decode_crop(self._d, src, data.shape[0], b, h, w, f, p,
                                     stride)
        if st:
            _raise(self._d, st)
        return o

    def decode_random_crop(self, const uint8_t[::1] data not None, size, uint64_t seed,
                           uint64_t epoch, uint64_t sample_id, uint64_t echo_index=0,
                           scale=(0.08, 1.0), ratio=(3.0 / 4.0, 4.0 / 3.0), double flip_p=0.5,
                           out=None):
        """RandomResizedCrop + flip drawn from the key, fused with the decode.

        Returns (box, flip) where box is (top, left, height, width).
        """
        oh, ow = check_size(size)
        cdef en_rrc_spec spec = _spec(scale, ratio, flip_p)
        cdef cnp.ndarray o = _output(out, oh, ow)
        cdef uint8_t *p = <uint8_t *>cnp.PyArray_DATA(o)
        cdef size_t stride = o.strides[0]
        cdef en_key key
        key.seed, key.epoch, key.sample_id, key.echo_index = seed, epoch, sample_id, echo_index
        cdef en_box b
        cdef int st, f = 0, h = oh, w = ow
        cdef const uint8_t *src = _bytes_ptr(data)
        with nogil:
            st = en_jpeg_decode_random_crop(self._d, src, data.shape[0], key, spec,
                                            h, w, p, stride, &b, &f)
        if st:
            _raise(self._d, st)
        return (int(b.top), int(b.left), int(b.height), int(b.width)), bool(f)

    def decode_center_crop(self, const uint8_t[::1] data not None, int resize_side, size,
                           out=None):
        """Resize(resize_side) + CenterCrop(size) fused with the decode, one header parse.

        Returns the box of the original that was resampled."""
        oh, ow = check_size(size)
        if resize_side <= 0:
            raise ValueError(f"resize_side must be positive, got {resize_side}")
        cdef cnp.ndarray o = _output(out, oh, ow)
        cdef uint8_t *p = <uint8_t *>cnp.PyArray_DATA(o)
        cdef size_t stride = o.strides[0]
        cdef en_box b
        cdef int st, h = oh, w = ow
        cdef const uint8_t *src = _bytes_ptr(data)
        with nogil:
            st = en_jpeg_decode_center_crop(self._d, src, data.shape[0], resize_side, h, w, p,
                                            stride, &b)
        if st:
            _raise(self._d, st)
        return b.top, b.left, b.height, b.width

    def decode_canvas(self, const uint8_t[::1] data not None, int min_side,
                      uint64_t max_pixels=UINT64_MAX, out=None):
        """The whole image at the coarsest DCT scale keeping its shorter side >= min_side,
        shrunk uniformly if it holds more than max_pixels; one header parse.

        `out` may be any writable contiguous uint8 buffer large enough (a ring slot's
        row); the canvas fills its first h*w*3 bytes.  Returns (canvas, (scale_y,
        scale_x), (source_height, source_width)): canvas is an (h, w, 3) view, and
        canvas pixel (y, x) starts at original pixel (y * scale_y, x * scale_x).
        """
        if min_side <= 0:
            raise ValueError(f"min_side must be positive, got {min_side}")
        if max_pixels == 0:
            raise ValueError("max_pixels must be positive")
        cdef en_canvas c
        cdef int st
        cdef uint8_t[::1] buf
        cdef const uint8_t *src = _bytes_ptr(data)
        if out is None:
            with nogil:
                st = en_jpeg_decode_canvas(self._d, src, data.shape[0], min_side, max_pixels,
                                           NULL, 0, &c)
            if st:
                _raise(self._d, st)
            out = np.empty(<size_t>c.height * c.width * 3, dtype=np.uint8)
        buf = flat_buffer(out)
        cdef uint8_t *p = &buf[0] if buf.shape[0] else _EMPTY
        cdef size_t cap = buf.shape[0]
        with nogil:
            st = en_jpeg_decode_canvas(self._d, src, data.shape[0], min_side, max_pixels, p,
                                       cap, &c)
        if st:
            _raise(self._d, st)
        canvas = np.asarray(buf)[: c.height * c.width * 3].reshape(c.height, c.width, 3)
        return canvas, (c.scale_y, c.scale_x), (c.source_height, c.source_width)

    def resize(self, image, box, size, flip=False, out=None):
        """Crop `box` of an (H, W, 3) uint8 image and resize it, like decode_crop."""
        cdef const uint8_t[:, :, ::1] src
        try:
            src = image
        except (TypeError, ValueError, BufferError) as e:
            raise TypeError(f"image must be a C-contiguous (H, W, 3) uint8 array: {e}") from None
        if src.shape[2] != 3:
            raise ValueError(f"image must have 3 channels, got shape {np.shape(image)}")
        cdef en_box b = _box(box)
        oh, ow = check_size(size)
        cdef cnp.ndarray o = _output(out, oh, ow)
        cdef uint8_t *p = <uint8_t *>cnp.PyArray_DATA(o)
        cdef size_t stride = o.strides[0], sstride = src.strides[0]
        cdef int st, f = 1 if flip else 0, h = oh, w = ow
        cdef int ih = src.shape[0], iw = src.shape[1]
        if ih == 0 or iw == 0:
            raise ValueError("image is empty")
        with nogil:
            st = en_resize_rgb(self._d, &src[0, 0, 0], ih, iw, sstride, b, h, w, f, p, stride)
        if st:
            _raise(self._d, st)
        return o

    def resize_batch(self, const uint8_t[:, ::1] pixels not None,
                     const int64_t[::1] entries not None, const int32_t[:, ::1] shapes not None,
                     const double[:, ::1] boxes not None, const uint8_t[::1] flips not None,
                     out not None):
        """Re-augment stored canvases in one call: for each i, crop ``boxes[i]`` of the
        canvas in row ``entries[i]`` of ``pixels`` (``shapes[entries[i]]`` = (h, w), its
        first h*w*3 bytes), resize it into ``out[i]`` and flip it where ``flips[i]``.
        The same resampling as :meth:`resize`, with the GIL released for the batch."""
        cdef uint8_t[:, :, :, ::1] o = out
        cdef Py_ssize_t n = entries.shape[0], i
        _check_canvases(pixels, entries, shapes, boxes, flips, o)
        cdef int64_t e
        cdef int oh = o.shape[1], ow = o.shape[2], st = 0, ch, cw
        cdef size_t stride = o.strides[1]
        cdef en_box b
        with nogil:
            for i in range(n):
                e = entries[i]
                ch, cw = shapes[e, 0], shapes[e, 1]
                b.top, b.left, b.height, b.width = boxes[i, 0], boxes[i, 1], boxes[i, 2], boxes[i, 3]
                st = en_resize_rgb(self._d, &pixels[e, 0], ch, cw, <size_t>cw * 3, b, oh, ow,
                                   flips[i] != 0, &o[i, 0, 0, 0], stride)
                if st:
                    break
        if st:
            _raise(self._d, st)
        return out

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


def random_resized_crop_params(uint64_t seed, uint64_t epoch, uint64_t sample_id,
                               uint64_t echo_index, int height, int width,
                               scale=(0.08, 1.0), ratio=(3.0 / 4.0, 4.0 / 3.0),
                               double flip_p=0.5):
    """((top, left, height, width), flip) for one key, as the fused decode draws it."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    cdef en_rrc_spec spec = _spec(scale, ratio, flip_p)
    cdef en_key key
    key.seed, key.epoch, key.sample_id, key.echo_index = seed, epoch, sample_id, echo_index
    cdef en_box b
    cdef int f
    en_random_resized_crop(key, height, width, spec, &b, &f)
    return (int(b.top), int(b.left), int(b.height), int(b.width)), bool(f)


def random_resized_crops(uint64_t seed, const int64_t[::1] epochs not None,
                         const int64_t[::1] sample_ids not None,
                         const int32_t[::1] echo_index not None,
                         const int32_t[:, ::1] source_hw not None,
                         const float[:, ::1] canvas_scale not None,
                         const int32_t[:, ::1] canvas_hw not None,
                         scale=(0.08, 1.0), ratio=(3.0 / 4.0, 4.0 / 3.0), double flip_p=0.5):
    """RandomResizedCrop of many emissions at once, each drawn exactly as
    :func:`random_resized_crop_params` draws it for (seed, epochs[i], sample_ids[i],
    echo_index[i]) on an image of ``source_hw[i]``, and mapped onto its stored canvas
    (``canvas_hw[i]``, ``canvas_scale[i]`` original pixels per canvas pixel).

    Returns (boxes, flips, canvas_boxes): float32 (n, 4) boxes in the original
    image, bool (n,), float64 (n, 4) boxes on the canvases.  The mapping divides in
    float32 and clamps to the canvas, so a box never reaches past its canvas.
    """
    cdef Py_ssize_t n = sample_ids.shape[0], i
    if epochs.shape[0] != n or echo_index.shape[0] != n or source_hw.shape[0] != n or \
            canvas_scale.shape[0] != n or canvas_hw.shape[0] != n:
        raise ValueError("every per-emission array must have the same length")
    if source_hw.shape[1] != 2 or canvas_scale.shape[1] != 2 or canvas_hw.shape[1] != 2:
        raise ValueError("source_hw, canvas_scale and canvas_hw must be (n, 2)")
    for i in range(n):
        if source_hw[i, 0] <= 0 or source_hw[i, 1] <= 0:
            raise ValueError(f"image size must be positive, got "
                             f"{source_hw[i, 0]}x{source_hw[i, 1]}")
        if not (canvas_scale[i, 0] > 0 and canvas_scale[i, 1] > 0):
            raise ValueError(f"canvas scale must be positive, got "
                             f"{canvas_scale[i, 0]}, {canvas_scale[i, 1]}")
    cdef en_rrc_spec spec = _spec(scale, ratio, flip_p)
    boxes = np.empty((n, 4), np.float32)
    flips = np.empty(n, bool)
    canvas_boxes = np.empty((n, 4), np.float64)
    cdef float[:, ::1] bx = boxes
    cdef uint8_t[::1] fl = flips.view(np.uint8)
    cdef double[:, ::1] cb = canvas_boxes
    cdef en_key key
    cdef en_box b
    cdef int f
    cdef float sy, sx
    cdef double ch, cw, top, left
    with nogil:
        for i in range(n):
            key.seed, key.epoch = seed, <uint64_t>epochs[i]
            key.sample_id, key.echo_index = <uint64_t>sample_ids[i], <uint64_t>echo_index[i]
            en_random_resized_crop(key, source_hw[i, 0], source_hw[i, 1], spec, &b, &f)
            bx[i, 0], bx[i, 1], bx[i, 2], bx[i, 3] = b.top, b.left, b.height, b.width
            fl[i] = f
            sy, sx = canvas_scale[i, 0], canvas_scale[i, 1]
            ch, cw = canvas_hw[i, 0], canvas_hw[i, 1]
            top = min(<double>(<float>b.top / sy), ch)
            left = min(<double>(<float>b.left / sx), cw)
            cb[i, 0], cb[i, 1] = top, left
            cb[i, 2] = min(<double>(<float>b.height / sy), ch - top)
            cb[i, 3] = min(<double>(<float>b.width / sx), cw - left)
    return boxes, flips, canvas_boxes

cdef int _check_gather(const uint8_t[:, ::1] pixels, const int64_t[::1] entries,
                       uint8_t[:, :, :, ::1] o, const uint8_t[::1] mirror) except -1:
    """ValueError / IndexError unless every entry is a row of ``pixels`` holding an
    image of ``o``'s (h, w, 3) and the mirror flags (if any) match the entries."""
    cdef Py_ssize_t n = entries.shape[0], i, rows = pixels.shape[0]
    if o.shape[0] < n or o.shape[3] != 3 or pixels.shape[1] < o.shape[1] * o.shape[2] * 3:
        raise ValueError(f"{n} entries of {pixels.shape[1]} bytes do not fit out "
                         f"{(o.shape[0], o.shape[1], o.shape[2], o.shape[3])} (n, h, w, 3)")
    if mirror is not None and mirror.shape[0] != n:
        raise ValueError(f"{n} entries need {n} mirror flags, got {mirror.shape[0]}")
    for i in range(n):
        if entries[i] < 0 or entries[i] >= rows:
            raise IndexError(f"entry {entries[i]} is outside the {rows} rows of pixels")
    return 0


def gather_rows(const uint8_t[:, ::1] pixels not None, const int64_t[::1] entries not None,
                out not None, const uint8_t[::1] mirror=None):
    """``out[i] = pixels[entries[i]]`` as an (h, w, 3) image, mirrored left to right where
    ``mirror[i]``: a batch of stored examples gathered in one call with the GIL released
    (after-augmentation echo, made on a host thread while the consumer trains)."""
    cdef uint8_t[:, :, :, ::1] o = out
    _check_gather(pixels, entries, o, mirror)
    cdef Py_ssize_t n = entries.shape[0], i, y, x
    cdef Py_ssize_t h = o.shape[1], w = o.shape[2], row = w * 3, size = h * row
    cdef const uint8_t *src
    cdef uint8_t *dst
    with nogil:
        for i in range(n):
            src = &pixels[entries[i], 0]
            dst = &o[i, 0, 0, 0]
            if mirror is None or not mirror[i]:
                memcpy(dst, src, size)
                continue
            for y in range(h):
                for x in range(w):
                    memcpy(dst + y * row + x * 3, src + y * row + (w - 1 - x) * 3, 3)
    return out


def center_crop_box(int height, int width, int resize_side, size):
    """Box of the original that Resize(resize_side) + CenterCrop(size) keeps; ``size`` is
    an int (square) or (height, width)."""
    oh, ow = check_size((size, size) if isinstance(size, int) else size)
    if min(height, width, resize_side) <= 0:
        raise ValueError("sizes must be positive")
    cdef en_box b = en_center_crop_box(height, width, resize_side, oh, ow)
    return b.top, b.left, b.height, b.width


def canvas_plan(int height, int width, int min_side, uint64_t max_pixels=UINT64_MAX):
    """The canvas of a ``height`` x ``width`` image, by the rule every format follows:
    a dict with ``denom`` (reduction factor 1, 2, 4 or 8), ``reduced`` (h, w) at
    that factor, ``shape`` (h, w) of the canvas after fitting ``max_pixels``,
    ``scale`` (original pixels per canvas pixel, y and x)."""
    if min(height, width, min_side) <= 0 or max_pixels == 0:
        raise ValueError("sizes must be positive")
    cdef en_canvas c
    en_canvas_plan(height, width, min_side, max_pixels, &c)
    return {"denom": c.denom, "reduced": (c.reduced_height, c.reduced_width),
            "shape": (c.height, c.width), "scale": (c.scale_y, c.scale_x)}


def pick_scale(box, size):
    """DCT denominator decode_crop uses for `box` resized to `size`."""
    oh, ow = check_size(size)
    return en_pick_scale(_box(box), oh, ow)


def philox4x64(ctr, key):
    """Philox4x64-10 block (exposed for known-answer tests)."""
    cdef uint64_t c[4]
    cdef uint64_t k[2]
    cdef uint64_t o[4]
    for i in range(4):
        c[i] = ctr[i]
    k[0], k[1] = key[0], key[1]
    en_philox4x64(c, k, o)
    return o[0], o[1], o[2], o[3]


# -- augmentation programs (kernels.cu on the host, src/kernel/en_ops.cpp) -------------------

#: Float arguments per step of a program.
OP_ARGS = OP_ARGS_C

#: The op codes (src/kernel/en_opcodes.h, the one definition): ``Op.BRIGHTNESS`` ...
Op = enum.IntEnum("Op", [(en_op_name(c).decode(), c) for c in range(en_op_count())])
#: Ops that read their image's per-channel histogram, and ops that are a lookup table
#: per channel (how the CUDA backend plans its launches).
OPS_COUNTING = frozenset(Op(c) for c in range(en_op_count()) if en_op_counts(c))
OPS_TABLES = frozenset(Op(c) for c in range(en_op_count()) if en_op_maps(c))


def op_names():
    """The op codes' names, indexed by code, as the kernels number them."""
    return tuple(op.name for op in Op)


def cuda_source():
    """The CUDA C++ source of the GPU backend's kernels (kernels.cu, its op codes in
    place): what NVRTC compiles on a GPU, the text this module's CPU ops were built
    from, so the two cannot drift apart."""
    return en_cuda_source().decode()


def _array(x, name, dtype, ndim, writable=False):
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(x).__name__}")
    if x.dtype != dtype or x.ndim != ndim or not x.flags.c_contiguous or \
            (writable and not x.flags.writeable):
        raise ValueError(f"{name} must be a C-contiguous{' writable' if writable else ''} "
                         f"{ndim}-d {np.dtype(dtype).name} array, got {x.dtype} shape {x.shape} "
                         f"contiguous={x.flags.c_contiguous} writeable={x.flags.writeable}")
    return x


def check_ops(codes, args, shape):
    """ValueError (TypeError for a non-array) unless ``codes`` (int32 (n, K)) and ``args``
    (float32 (n, K, 8)) are valid programs for images of ``shape`` = (n, h, w, 3): every
    code one of the ops and every argument in its op's range.  The message names the row,
    the step and the value."""
    _array(codes, "codes", np.int32, 2)
    _array(args, "args", np.float32, 3)
    try:
        n, h, w, c = (int(v) for v in shape)
    except (TypeError, ValueError):
        raise ValueError(f"images must be (n, h, w, 3), got shape {shape!r}") from None
    steps = codes.shape[1]
    if c != 3 or codes.shape[0] != n or args.shape[0] != n or args.shape[1] != steps or \
            args.shape[2] != OP_ARGS_C:
        raise ValueError(f"images (n, h, w, 3), codes (n, K) and args (n, K, {OP_ARGS_C}) "
                         f"must agree, got {tuple(shape)}, {codes.shape} and {args.shape}")
    if n == 0 or steps == 0:
        return
    cdef const int32_t[:, ::1] cv = codes
    cdef const float[:, :, ::1] av = args
    cdef char msg[200]
    if en_ops_check(&cv[0, 0], &av[0, 0, 0], n, <int>steps, h, w, msg, sizeof(msg)):
        raise ValueError(msg.decode("utf-8", "replace"))


def apply_ops(images, codes, args):
    """Run a program per image, in place: step k of row i applies op ``codes[i, k]`` with
    arguments ``args[i, k]`` to ``images[i]`` as steps 0 .. k-1 left it.

    ``images`` is a C-contiguous writable (n, h, w, 3) uint8 array, ``codes`` int32
    (n, K), ``args`` float32 (n, K, 8); the ops and their arguments are listed in
    :data:`Op` (src/kernel/en_opcodes.h).  Everything is checked first
    (:func:`check_ops`); the pixels are then changed with the GIL released, by the
    CUDA backend's own kernel source, so the bytes equal the GPU's.  Returns ``images``.
    """
    _array(images, "images", np.uint8, 4, writable=True)
    check_ops(codes, args, images.shape)
    cdef int64_t n = images.shape[0]
    cdef int h = images.shape[1], w = images.shape[2], steps = codes.shape[1]
    if n == 0 or steps == 0:
        return images
    cdef uint8_t[:, :, :, ::1] iv = images
    cdef const int32_t[:, ::1] cv = codes
    cdef const float[:, :, ::1] av = args
    cdef uint8_t[::1] scratch = np.empty(<Py_ssize_t>h * w * 3, np.uint8)
    with nogil:
        en_ops_apply(&iv[0, 0, 0, 0], n, h, w, &cv[0, 0], &av[0, 0, 0], steps, &scratch[0])
    return images


# -- the per-example ops' draws (src/kernel/en_augment.c) ------------------------------------

#: Kinds of op spec :func:`draw_ops` takes (one row of numbers per op; en_kernel.h).
DRAW_COLOR_JITTER = EN_DRAW_COLOR_JITTER
DRAW_GRAYSCALE = EN_DRAW_GRAYSCALE
DRAW_TRIVIAL_WIDE = EN_DRAW_TRIVIAL_WIDE
DRAW_ERASING = EN_DRAW_ERASING
#: Numbers in a spec row after its kind (a row is 1 + DRAW_NUMBERS float64).
DRAW_NUMBERS = EN_DRAW_NUMBERS


cdef dict _draw_kinds():
    cdef dict out = {}
    cdef size_t i = 0
    while en_draw_kinds[i].name != NULL:
        d = en_draw_kinds[i]
        out[d.kind] = (d.name.decode(), d.numbers, d.steps)
        i += 1
    return out


#: kind -> (name, numbers its spec uses, program steps it takes): EN_DRAW_LIST in
#: en_kernel.h, the one definition of the spec format.
DRAWS = _draw_kinds()


def ops_steps(const double[:, ::1] specs not None):
    """Program steps the op ``specs`` (see :func:`draw_ops`) need."""
    cdef en_op_spec[64] ops
    cdef int nops = _op_specs(specs, ops)
    return en_ops_steps(ops, nops)


cdef int _op_specs(const double[:, ::1] specs, en_op_spec *ops) except -1:
    cdef Py_ssize_t nops = specs.shape[0], k, j
    if nops > 64:
        raise ValueError(f"at most 64 ops per program, got {nops}")
    if nops and specs.shape[1] != 1 + EN_DRAW_NUMBERS:
        raise ValueError(f"op specs must be (ops, {1 + EN_DRAW_NUMBERS}): kind and "
                         f"{EN_DRAW_NUMBERS} numbers, got {tuple(specs.shape)}")
    for k in range(nops):
        ops[k].kind = <int>specs[k, 0]
        if ops[k].kind != specs[k, 0] or not EN_DRAW_COLOR_JITTER <= ops[k].kind <= \
                EN_DRAW_ERASING:
            raise ValueError(f"op spec {k}: kind {specs[k, 0]!r} is not one of "
                             f"{EN_DRAW_COLOR_JITTER} .. {EN_DRAW_ERASING}")
        for j in range(EN_DRAW_NUMBERS):
            ops[k].v[j] = specs[k, 1 + j]
    return <int>nops


def draw_ops(const double[:, ::1] specs not None, uint64_t seed, epochs, sample_ids,
             echo_index, size):
    """The per-example programs of ``len(sample_ids)`` images of ``size`` = (h, w): row i
    drawn from Philox keyed by (seed, epochs[i], sample_ids[i], echo_index[i]) (numbers
    or arrays, broadcast), a pure function of its key, with torchvision's
    distributions.  ``specs`` (float64 (ops, 13)) has one row per op, its kind
    (``DRAW_*``) and its numbers (en_kernel.h; echo_native.augment builds them).
    Returns (codes int32 (n, steps), args float32 (n, steps, OP_ARGS)), the batch
    drawn in one call with the GIL released."""
    cdef en_op_spec[64] ops
    cdef int nops = _op_specs(specs, ops)
    h, w = check_size(size)
    ids = np.ascontiguousarray(sample_ids, np.int64).reshape(-1)
    cdef Py_ssize_t n = ids.shape[0]
    ep = np.ascontiguousarray(np.broadcast_to(np.asarray(epochs, np.int64), (n,)))
    ei = np.ascontiguousarray(np.broadcast_to(np.asarray(echo_index, np.int64), (n,)))
    cdef int steps = en_ops_steps(ops, nops)
    codes = np.zeros((n, steps), np.int32)
    args = np.zeros((n, steps, OP_ARGS_C), np.float32)
    if n == 0 or steps == 0:
        return codes, args
    cdef const int64_t[::1] e = ep, i = ids, x = ei
    cdef int32_t[:, ::1] cv = codes
    cdef float[:, :, ::1] av = args
    cdef int hh = h, ww = w
    with nogil:
        en_ops_draw(ops, nops, steps, seed, &e[0], &i[0], &x[0], n, hh, ww, &cv[0, 0],
                    &av[0, 0, 0])
    return codes, args


# -- re-augmentation on a pool of native threads (src/kernel/en_ops.cpp) ---------------------

def store_rows(dst not None, const int64_t[::1] entries not None, src not None,
               const int64_t[::1] nbytes not None):
    """Row ``entries[i]`` of ``dst`` (a (rows, row_bytes) uint8 array) = the first
    ``nbytes[i]`` bytes of row i of ``src`` ((n, src_row_bytes) uint8), for every i, in one
    call with the GIL released: a batch of variable-size canvases into the echo buffer."""
    cdef uint8_t[:, ::1] d = dst
    cdef const uint8_t[:, ::1] s_ = src
    cdef Py_ssize_t n = entries.shape[0], i
    if nbytes.shape[0] != n or s_.shape[0] < n:
        raise ValueError(f"{n} entries need {n} byte counts and source rows, got "
                         f"{nbytes.shape[0]} and {s_.shape[0]}")
    for i in range(n):
        if entries[i] < 0 or entries[i] >= d.shape[0]:
            raise IndexError(f"entry {entries[i]} is outside the {d.shape[0]} rows of dst")
        if nbytes[i] < 0 or nbytes[i] > d.shape[1] or nbytes[i] > s_.shape[1]:
            raise ValueError(f"row {i}: {nbytes[i]} bytes do not fit rows of {d.shape[1]} "
                             f"(dst) and {s_.shape[1]} (src) bytes")
    if n == 0:
        return dst
    with nogil:
        en_store_rows(&d[0, 0], d.shape[1], &entries[0], &s_[0, 0], s_.shape[1], &nbytes[0], n)
    return dst


cdef class Reaugmenter:
    """A pool of ``threads`` native threads (the calling thread is one of them) that
    re-augments a batch of echoed canvases, its rows shared out among the threads:
    crop + resize + flip and the row's op program in one task per row.  A row's bytes
    never depend on another row or on the thread that made it, so every thread count
    gives the same batch.  The GIL is released while a batch is made; the threads
    sleep between batches.  One batch at a time (calls are serialised)."""
    cdef en_reaug *_r

    def __cinit__(self, int threads=1):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        with nogil:
            self._r = en_reaug_new(threads)
        if self._r == NULL:
            raise MemoryError(f"cannot start a pool of {threads} re-augmentation threads")

    def __dealloc__(self):
        if self._r != NULL:
            with nogil:
                en_reaug_free(self._r)

    @property
    def threads(self):
        return en_reaug_threads(self._r)

    def run(self, const uint8_t[:, ::1] pixels not None, const int64_t[::1] entries not None,
            const int32_t[:, ::1] shapes not None, const double[:, ::1] boxes not None,
            const uint8_t[::1] flips not None, out not None, codes=None, args=None):
        """For each i: crop ``boxes[i]`` of the canvas in row ``entries[i]`` of ``pixels``
        (``shapes[entries[i]]`` = (h, w)), resize it into ``out[i]``, flip it where
        ``flips[i]``, then run its program ``codes[i]`` / ``args[i]`` (see
        :func:`apply_ops`; None: no ops).  The bytes of :meth:`Decoder.resize_batch`
        followed by :func:`apply_ops`.  Returns ``out``."""
        cdef uint8_t[:, :, :, ::1] o = out
        _check_canvases(pixels, entries, shapes, boxes, flips, o)
        cdef Py_ssize_t n = entries.shape[0]
        cdef int steps = 0
        cdef const int32_t *cp = NULL
        cdef const float *ap = NULL
        cdef const int32_t[:, ::1] cv
        cdef const float[:, :, ::1] av
        if (codes is None) != (args is None):
            raise ValueError("codes and args come together (or neither)")
        if codes is not None:
            check_ops(codes, args, (n, o.shape[1], o.shape[2], 3))
            steps = codes.shape[1]
            if n and steps:
                cv, av = codes, args
                cp, ap = &cv[0, 0], &av[0, 0, 0]
            else:
                steps = 0
        if n == 0:
            return out
        cdef char msg[600]
        cdef int st
        with nogil:
            st = en_reaug_run(self._r, &pixels[0, 0], pixels.shape[1], &entries[0],
                              &shapes[0, 0], &boxes[0, 0], &flips[0], n, o.shape[1],
                              o.shape[2], &o[0, 0, 0, 0], cp, ap, steps, msg, sizeof(msg))
        if st:
            text = msg.decode("utf-8", "replace")
            if st == EN_ERR_NOMEM:
                raise MemoryError(text)
            raise ValueError(text)
        return out

    def apply(self, images, codes, args):
        """:func:`apply_ops` with the batch's rows shared out among the threads."""
        _array(images, "images", np.uint8, 4, writable=True)
        check_ops(codes, args, images.shape)
        cdef int64_t n = images.shape[0]
        cdef int h = images.shape[1], w = images.shape[2], steps = codes.shape[1], st
        if n == 0 or steps == 0:
            return images
        cdef uint8_t[:, :, :, ::1] iv = images
        cdef const int32_t[:, ::1] cv = codes
        cdef const float[:, :, ::1] av = args
        with nogil:
            st = en_reaug_apply(self._r, &iv[0, 0, 0, 0], n, h, w, &cv[0, 0], &av[0, 0, 0],
                                steps)
        if st:
            raise MemoryError(f"out of memory for the ops' scratch image ({h} x {w})")
        return images

    def gather(self, const uint8_t[:, ::1] pixels not None, const int64_t[::1] entries not None,
               out not None, const uint8_t[::1] mirror=None):
        """:func:`gather_rows` with the batch's rows shared out among the threads."""
        cdef uint8_t[:, :, :, ::1] o = out
        _check_gather(pixels, entries, o, mirror)
        cdef Py_ssize_t n = entries.shape[0]
        cdef Py_ssize_t h = o.shape[1], w = o.shape[2]
        if n == 0:
            return out
        cdef const uint8_t *mp = NULL
        if mirror is not None:
            mp = &mirror[0]
        with nogil:
            en_reaug_gather(self._r, &pixels[0, 0], pixels.shape[1], &entries[0], n, <int>h,
                            <int>w, &o[0, 0, 0, 0], mp)
        return out

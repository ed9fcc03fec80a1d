# Included by _kernel.pyx: JPEG decoding -- the Decoder (one libjpeg decompressor, its
# limits, warnings and stage timings) and its entry points (whole image, crop, random and
# centre crop fused with the resize, canvas), with the rules they plan by (DCT scale,
# canvas shape).  C side: en_decoder.c, en_jpeg.c.


cdef extern from "en_kernel.h" nogil:
    ctypedef struct en_limits:
        uint64_t max_pixels
        int max_scans
        int strict
        uint64_t max_memory
    ctypedef struct en_image_info:
        int width, height, components, progressive, colorspace

    uint64_t EN_DEFAULT_MAX_PIXELS
    int EN_DEFAULT_MAX_SCANS
    uint64_t EN_DEFAULT_MAX_MEMORY

    en_decoder *en_decoder_new()
    void en_decoder_free(en_decoder *d)
    void en_decoder_set_limits(en_decoder *d, en_limits limits)
    en_limits en_decoder_get_limits(const en_decoder *d)
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
    int en_jpeg_decode_center_crop(en_decoder *d, const uint8_t *data, size_t length,
                                   int resize_side, int out_h, int out_w, uint8_t *out,
                                   size_t stride, en_box *box)
    int en_jpeg_decode_random_crop(en_decoder *d, const uint8_t *data, size_t length,
                                   en_key key, en_rrc_spec spec, int out_h, int out_w,
                                   uint8_t *out, size_t stride, en_box *box, int *flip)


DEFAULT_MAX_PIXELS = EN_DEFAULT_MAX_PIXELS
DEFAULT_MAX_SCANS = EN_DEFAULT_MAX_SCANS
DEFAULT_MAX_MEMORY = EN_DEFAULT_MAX_MEMORY

# A valid address for zero-length input; the C side checks the length first.
cdef uint8_t _EMPTY[1]


cdef inline const uint8_t *_bytes_ptr(const uint8_t[::1] data):
    return &data[0] if data.shape[0] > 0 else _EMPTY


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
        return _resize_image(self._d, image, box, size, flip, out)

    def resize_batch(self, const uint8_t[:, ::1] pixels not None,
                     const int64_t[::1] entries not None, const int32_t[:, ::1] shapes not None,
                     const double[:, ::1] boxes not None, const uint8_t[::1] flips not None,
                     out not None):
        """Re-augment stored canvases in one call: for each i, crop ``boxes[i]`` of the
        canvas in row ``entries[i]`` of ``pixels`` (``shapes[entries[i]]`` = (h, w), its
        first h*w*3 bytes), resize it into ``out[i]`` and flip it where ``flips[i]``.
        The same resampling as :meth:`resize`, with the GIL released for the batch."""
        cdef uint8_t[:, :, :, ::1] o = out
        _resize_canvases(self._d, pixels, entries, shapes, boxes, flips, o)
        return out


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

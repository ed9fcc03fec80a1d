"""Bindings over the seekable-JPEG core (src/seek/en_*.c): the lossless transcoder, the
index parser, the sub-image assembler and the crop entry points that use them.

Byte-level calls run with the GIL released, as in ``_kernel``.  The crop methods take the
same arguments as ``_kernel.Decoder``'s and give the same pixels.
"""
from libc.stdint cimport uint8_t, uint64_t
from libc.stdlib cimport free
cimport numpy as cnp

import numpy as np

from echo_native._kernel import check_size
from echo_native.errors import DecodeError

cnp.import_array()

# The kernel's types and its crop calls' argument checks (_box, _spec, _output, _raise):
# one definition for Decoder and Seeker, so both refuse the same arguments in the same words.
include "_kernel_args.pxi"


cdef extern from "en_kernel.h" nogil:
    ctypedef struct en_limits:
        uint64_t max_pixels
        int max_scans
        int strict
        uint64_t max_memory
    enum:
        EN_DEFAULT_MAX_PIXELS, EN_DEFAULT_MAX_SCANS, EN_DEFAULT_MAX_MEMORY
    void en_decoder_set_limits(en_decoder *d, en_limits limits)
    int en_decoder_warnings(const en_decoder *d)
    int en_decoder_harmless_warnings(const en_decoder *d)
    int en_decoder_last_scale(const en_decoder *d)


cdef extern from "en_seek.h" nogil:
    enum:
        EN_SEEK_ROW
    ctypedef struct en_transcode_opts:
        int restart
        int restart_px
        uint64_t max_pixels
        int max_scans
        uint64_t max_memory
    ctypedef struct en_transcode_result:
        uint8_t *data
        size_t len
        size_t index_bytes
        int interval, segments, width, height, mcu_w, mcu_h, progressive_in
    int en_seek_transcode(const uint8_t *data, size_t len, en_transcode_opts opts,
                          en_transcode_result *res, char *errmsg, size_t errcap)
    ctypedef struct en_seek_index:
        int width, height, ncomp, mcu_w, mcu_h, mcus_per_row, mcu_rows, interval, segs_per_row
        size_t scan_offset, scan_len, lens_len
    ctypedef struct en_seeker:
        pass
    ctypedef struct en_seek_stats:
        uint64_t seek, whole, plain, fallback, bytes_in
    en_seeker *en_seeker_new()
    void en_seeker_free(en_seeker *s)
    en_decoder *en_seeker_decoder(en_seeker *s)
    const char *en_seeker_why(const en_seeker *s)
    int en_seeker_parse(en_seeker *s, const uint8_t *data, size_t len, en_seek_index *ix)
    en_seek_stats en_seeker_stats(const en_seeker *s)
    int en_seek_assemble(en_seeker *s, const uint8_t *data, size_t len, int r0, int r1,
                         int c0, int c1, const uint8_t **out, size_t *out_len)
    int en_seek_decode_crop(en_seeker *s, const uint8_t *data, size_t len, en_box box,
                            int out_h, int out_w, int flip, uint8_t *out, size_t stride)
    int en_seek_decode_random_crop(en_seeker *s, const uint8_t *data, size_t len, en_key key,
                                   en_rrc_spec spec, int out_h, int out_w, uint8_t *out,
                                   size_t stride, en_box *box, int *flip)
    int en_seek_decode_center_crop(en_seeker *s, const uint8_t *data, size_t len,
                                   int resize_side, int out_h, int out_w, uint8_t *out,
                                   size_t stride, en_box *box)


#: The restart interval meaning "one segment per MCU row".
ROW = EN_SEEK_ROW

cdef uint8_t _EMPTY[1]


cdef inline const uint8_t *_ptr(const uint8_t[::1] data):
    return &data[0] if data.shape[0] > 0 else _EMPTY


def transcode(const uint8_t[::1] data not None, int restart=1, int restart_px=0,
              uint64_t max_pixels=EN_DEFAULT_MAX_PIXELS, int max_scans=EN_DEFAULT_MAX_SCANS,
              uint64_t max_memory=EN_DEFAULT_MAX_MEMORY):
    """(seekable JPEG bytes, facts dict).  ``restart``: MCUs per restart interval (the
    largest divisor of an MCU row's count not above it), or ``ROW`` (0) for one per MCU row;
    ``restart_px`` > 0 instead asks for segments that many pixels wide.
    DecodeError names what stops a lossless transcode (damaged data, CMYK, ...)."""
    cdef en_transcode_opts o
    cdef en_transcode_result r
    cdef char msg[512]
    cdef int st
    o.restart, o.restart_px = restart, restart_px
    o.max_pixels, o.max_scans, o.max_memory = max_pixels, max_scans, max_memory
    cdef const uint8_t *p = _ptr(data)
    cdef size_t n = data.shape[0]
    with nogil:
        st = en_seek_transcode(p, n, o, &r, msg, 512)
    if st:
        text = msg.decode("utf-8", "replace")
        if st == EN_ERR_ARG:
            raise ValueError(text)
        if st == EN_ERR_NOMEM:
            raise MemoryError(text)
        raise DecodeError(text)
    try:
        out = (<char *>r.data)[:r.len]
    finally:
        free(r.data)
    return out, {"interval": r.interval, "segments": r.segments, "index_bytes": r.index_bytes,
                 "width": r.width, "height": r.height, "mcu": (r.mcu_h, r.mcu_w),
                 "progressive_in": bool(r.progressive_in)}


def parse(data):
    """The index's facts as a dict, None for a file without one; ValueError (its reason)
    for an index that disagrees with the file."""
    return Seeker().parse(data)


cdef dict _facts(en_seek_index *ix):
    return {"width": ix.width, "height": ix.height, "components": ix.ncomp,
            "mcu": (ix.mcu_h, ix.mcu_w), "mcus": (ix.mcu_rows, ix.mcus_per_row),
            "interval": ix.interval, "scan_offset": ix.scan_offset,
            "scan_bytes": ix.scan_len, "index_bytes": 40 + 8 * ix.mcu_rows + ix.lens_len}


cdef class Seeker:
    """A kernel decoder (the kernel's own code, compiled in) plus the sub-image buffer.

    Not thread-safe: one per thread, as ``_kernel.Decoder``.
    """
    cdef en_seeker *_s

    def __cinit__(self, max_pixels=EN_DEFAULT_MAX_PIXELS, max_scans=EN_DEFAULT_MAX_SCANS,
                  strict=True, max_memory=EN_DEFAULT_MAX_MEMORY):
        self._s = en_seeker_new()
        if self._s == NULL:
            raise MemoryError("cannot allocate a JPEG decoder")
        self.set_limits(max_pixels, max_scans, strict, max_memory)

    def __dealloc__(self):
        en_seeker_free(self._s)

    def set_limits(self, max_pixels, max_scans, strict, max_memory=EN_DEFAULT_MAX_MEMORY):
        if max_pixels <= 0 or max_scans <= 0 or max_memory <= 0:
            raise ValueError(f"max_pixels, max_scans and max_memory must be positive, got "
                             f"{max_pixels}, {max_scans} and {max_memory}")
        cdef en_limits lim
        lim.max_pixels, lim.max_scans = max_pixels, max_scans
        lim.strict, lim.max_memory = 1 if strict else 0, max_memory
        en_decoder_set_limits(en_seeker_decoder(self._s), lim)

    @property
    def warnings(self):
        return en_decoder_warnings(en_seeker_decoder(self._s))

    @property
    def harmless_warnings(self):
        return en_decoder_harmless_warnings(en_seeker_decoder(self._s))

    @property
    def last_scale(self):
        return en_decoder_last_scale(en_seeker_decoder(self._s))

    @property
    def why(self):
        """Why the last call left the seekable path ("" when it did not)."""
        return en_seeker_why(self._s).decode("utf-8", "replace")

    def stats(self):
        """Calls by path: ``seek`` (sub-image), ``whole`` (the crop needed every MCU),
        ``plain`` (no index), ``fallback`` (an index that disagrees with its file), and
        ``bytes_in``, the entropy-coded bytes the sub-images copied."""
        cdef en_seek_stats s = en_seeker_stats(self._s)
        return {"seek": s.seek, "whole": s.whole, "plain": s.plain, "fallback": s.fallback,
                "bytes_in": s.bytes_in}

    def parse(self, const uint8_t[::1] data not None):
        """The index's facts as a dict, None for a file without one; ValueError (its
        reason) for an index that disagrees with the file."""
        cdef en_seek_index ix
        cdef int r
        cdef const uint8_t *p = _ptr(data)
        cdef size_t n = data.shape[0]
        with nogil:
            r = en_seeker_parse(self._s, p, n, &ix)
        if r == 0:
            return None
        if r < 0:
            raise ValueError(self.why)
        return _facts(&ix)

    def assemble(self, const uint8_t[::1] data not None, int r0, int r1, int c0, int c1):
        """The sub-image of MCU rows [r0, r1) and columns [c0, c1) as JPEG bytes (columns
        whole restart segments); ValueError naming what disagrees."""
        cdef const uint8_t *out
        cdef size_t n = 0
        cdef int st
        cdef const uint8_t *p = _ptr(data)
        cdef size_t length = data.shape[0]
        with nogil:
            st = en_seek_assemble(self._s, p, length, r0, r1, c0, c1, &out, &n)
        if st:
            raise ValueError(self.why)
        return (<const char *>out)[:n]

    def decode_crop(self, const uint8_t[::1] data not None, box, size, flip=False, out=None):
        cdef en_box b = _box(box)
        oh, ow = check_size(size)
        cdef cnp.ndarray o = _output(out, oh, ow)
        cdef uint8_t *p = <uint8_t *>cnp.PyArray_DATA(o)
        cdef size_t stride = o.strides[0]
        cdef int st, f = 1 if flip else 0, h = oh, w = ow
        cdef const uint8_t *src = _ptr(data)
        cdef size_t n = data.shape[0]
        with nogil:
            st = en_seek_decode_crop(self._s, src, n, b, h, w, f, p, stride)
        if st:
            _raise(en_seeker_decoder(self._s), st)
        return o

    def decode_random_crop(self, const uint8_t[::1] data not None, size, uint64_t seed,
                           uint64_t epoch, uint64_t sample_id, uint64_t echo_index=0,
                           scale=(0.08, 1.0), ratio=(3.0 / 4.0, 4.0 / 3.0), double flip_p=0.5,
                           out=None):
        oh, ow = check_size(size)
        cdef en_rrc_spec spec = _spec(scale, ratio, flip_p)
        cdef cnp.ndarray o = _output(out, oh, ow)
        cdef uint8_t *p = <uint8_t *>cnp.PyArray_DATA(o)
        cdef size_t stride = o.strides[0]
        cdef en_key key
        key.seed, key.epoch, key.sample_id, key.echo_index = seed, epoch, sample_id, echo_index
        cdef en_box b
        cdef int st, f = 0, h = oh, w = ow
        cdef const uint8_t *src = _ptr(data)
        cdef size_t n = data.shape[0]
        with nogil:
            st = en_seek_decode_random_crop(self._s, src, n, key, spec, h, w, p, stride, &b,
                                            &f)
        if st:
            _raise(en_seeker_decoder(self._s), st)
        return (int(b.top), int(b.left), int(b.height), int(b.width)), bool(f)

    def decode_center_crop(self, const uint8_t[::1] data not None, int resize_side, size,
                           out=None):
        oh, ow = check_size(size)
        if resize_side <= 0:
            raise ValueError(f"resize_side must be positive, got {resize_side}")
        cdef cnp.ndarray o = _output(out, oh, ow)
        cdef uint8_t *p = <uint8_t *>cnp.PyArray_DATA(o)
        cdef size_t stride = o.strides[0]
        cdef en_box b
        cdef int st, h = oh, w = ow
        cdef const uint8_t *src = _ptr(data)
        cdef size_t n = data.shape[0]
        with nogil:
            st = en_seek_decode_center_crop(self._s, src, n, resize_side, h, w, p, stride, &b)
        if st:
            _raise(en_seeker_decoder(self._s), st)
        return b.top, b.left, b.height, b.width

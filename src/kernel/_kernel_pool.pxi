# Included by _kernel.pyx: a batch of the echo buffer's rows in one call -- canvases
# stored into rows, rows gathered into a batch, and canvases re-augmented (crop, resize,
# flip, op program) on the Reaugmenter's pool of native threads, a row per task.  The
# plain functions run on the calling thread; the pool's methods share the rows out.
# C side: en_pool.cpp.


cdef extern from "en_pool.h" nogil:
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

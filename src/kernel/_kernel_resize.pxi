# Included by _kernel.pyx: resampling pixels that are already decoded -- a crop of one
# image, or of a batch of canvases held in the echo buffer's rows -- with the fused
# decode's resampler, so a re-augmented echo has the bytes a fresh decode_crop of the
# canvas would.  Decoder.resize and Decoder.resize_batch call these with their decoder,
# whose resampler keeps its scratch from call to call.  C side: en_resize.c
# (en_resize_rgb, in en_jpeg.c, checks the box against the image).


cdef extern from "en_kernel.h" nogil:
    int en_resize_rgb(en_decoder *d, const uint8_t *src, int h, int w, size_t src_stride,
                      en_box box, int out_h, int out_w, int flip, uint8_t *out, size_t stride)


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


cdef object _resize_image(en_decoder *d, image, box, size, flip, out):
    """Decoder.resize: the output array, or the exception a bad argument or a failed
    resize raises."""
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
        st = en_resize_rgb(d, &src[0, 0, 0], ih, iw, sstride, b, h, w, f, p, stride)
    if st:
        _raise(d, st)
    return o


cdef int _resize_canvases(en_decoder *d, const uint8_t[:, ::1] pixels,
                          const int64_t[::1] entries, const int32_t[:, ::1] shapes,
                          const double[:, ::1] boxes, const uint8_t[::1] flips,
                          uint8_t[:, :, :, ::1] o) except -1:
    """Decoder.resize_batch into ``o``: every row checked first, then the batch with the
    GIL released, stopping at the first row that fails."""
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
            st = en_resize_rgb(d, &pixels[e, 0], ch, cw, <size_t>cw * 3, b, oh, ow,
                               flips[i] != 0, &o[i, 0, 0, 0], stride)
            if st:
                break
    if st:
        _raise(d, st)
    return 0

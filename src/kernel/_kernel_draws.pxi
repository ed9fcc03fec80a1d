# Included by _kernel.pyx: the per-example draws, each a pure function of its key (seed,
# epoch, sample id, echo index) through Philox -- a RandomResizedCrop box and flip, and
# an op program from its specs -- so an echo redraws exactly what a fresh decode of the
# same key draws, on any thread, in any order.  Also the deterministic centre-crop box.
# C side: en_augment.c.


cdef extern from "en_kernel.h" nogil:
    void en_philox4x64(const uint64_t *ctr, const uint64_t *key, uint64_t *out)
    void en_random_resized_crop(en_key key, int height, int width, en_rrc_spec spec,
                                en_box *box, int *flip)
    en_box en_center_crop_box(int height, int width, int resize_side, int out_h, int out_w)
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


# -- crops -----------------------------------------------------------------------------------

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


def center_crop_box(int height, int width, int resize_side, size):
    """Box of the original that Resize(resize_side) + CenterCrop(size) keeps; ``size`` is
    an int (square) or (height, width)."""
    oh, ow = check_size((size, size) if isinstance(size, int) else size)
    if min(height, width, resize_side) <= 0:
        raise ValueError("sizes must be positive")
    cdef en_box b = en_center_crop_box(height, width, resize_side, oh, ow)
    return b.top, b.left, b.height, b.width


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


# -- op programs ------------------------------------------------------------------------------

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

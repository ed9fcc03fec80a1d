# Included by _kernel.pyx: the augmentation programs on the host -- the op codes, the
# check of a batch of programs, and running them in place.  The C++ behind them is the
# CUDA backend's own kernels.cu built for the CPU, so both devices give the same bytes.
# C side: en_ops.cpp (codes: en_opcodes.h).


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

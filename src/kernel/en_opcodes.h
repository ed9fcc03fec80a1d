/*
 * The op codes of the per-image augmentation programs, defined once.
 *
 * kernels.cu (on a GPU through NVRTC, and on the CPU through en_ops.cpp) and the
 * binding (`_kernel.Op`, `_kernel.OP_ARGS`, which the Python specs in
 * echo_native/augment.py draw programs with) all read them here.  Plain C,
 * no includes: NVRTC compiles it as it is.
 *
 * A program is codes int32 (n, K) and args float32 (n, K, OP_ARGS): step k of
 * row i applies op codes[i, k] with args[i, k] to image i as the steps before
 * left it.  Arguments by op (unused ones are ignored; en_ops_check refuses
 * values out of range):
 *
 *   NONE          identity
 *   BRIGHTNESS    a0 = factor >= 0: p * f
 *   CONTRAST      a0 = factor >= 0: f p + (1 - f) m, m the image's mean luma
 *   SATURATION    a0 = factor >= 0: f p + (1 - f) luma(pixel)
 *   HUE           a0 = shift in [-0.5, 0.5]: torchvision's adjust_hue
 *   GRAYSCALE     luma on all three channels
 *   ERASE         a0..a3 = top, left, height, width (whole numbers; clipped to
 *                 the image), a4..a6 = fill R, G, B in [0, 255]
 *   SHARPNESS     a0 = factor >= 0: ImageEnhance.Sharpness
 *   POSTERIZE     a0 = bits, a whole number in 1..8: ImageOps.posterize
 *   SOLARIZE      a0 = threshold: p >= t ? 255 - p : p
 *   AUTOCONTRAST  per channel, ImageOps.autocontrast(cutoff=0)
 *   EQUALIZE      per channel, ImageOps.equalize
 *   AFFINE        a0..a5 = inverse map (source x = a0 x' + a1 y' + a2, source y =
 *                 a3 x' + a4 y' + a5 at output pixel centres), nearest pixel,
 *                 a6 = fill outside: Image.transform(AFFINE, NEAREST)
 *
 * Non-integer results are rounded half up and clamped to 0..255.
 */
#ifndef EN_OPCODES_H
#define EN_OPCODES_H

/* X(name, code, reads its image's histogram, is a lookup table per channel) */
#define EN_OP_LIST(X)                                                               \
    X(NONE, 0, 0, 0) X(BRIGHTNESS, 1, 0, 1) X(CONTRAST, 2, 1, 1) X(SATURATION, 3, 0, 0) \
    X(HUE, 4, 0, 0) X(GRAYSCALE, 5, 0, 0) X(ERASE, 6, 0, 0) X(SHARPNESS, 7, 0, 0)       \
    X(POSTERIZE, 8, 0, 1) X(SOLARIZE, 9, 0, 1) X(AUTOCONTRAST, 10, 1, 1)                \
    X(EQUALIZE, 11, 1, 1) X(AFFINE, 12, 0, 0)

#define EN_OP_ENUM_(name, code, counts, maps) OP_##name = code,
enum { EN_OP_LIST(EN_OP_ENUM_) OP_COUNT };
#undef EN_OP_ENUM_

/* Float arguments per step. */
#define OP_ARGS 8

#endif

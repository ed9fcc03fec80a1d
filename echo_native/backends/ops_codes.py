"""Op codes of the per-image augmentation programs (``kernels.cu``, both devices).

A program is ``codes`` int32 (n, K) and ``args`` float32 (n, K, ARGS): step k of
row i applies op ``codes[i, k]`` with ``args[i, k]`` to image i as the steps
before left it.  Arguments by op (unused ones are ignored; ranges are checked
by ``_kernel.check_ops``):

=============  ==================================================================
NONE           identity
BRIGHTNESS     a0 = factor >= 0: p * f
CONTRAST       a0 = factor >= 0: f p + (1 - f) m, m the image's mean luma
SATURATION     a0 = factor >= 0: f p + (1 - f) luma(pixel)
HUE            a0 = shift in [-0.5, 0.5]: torchvision's adjust_hue
GRAYSCALE      luma on all three channels
ERASE          a0..a3 = top, left, height, width (whole numbers; clipped to the
               image), a4..a6 = fill R, G, B in [0, 255]
SHARPNESS      a0 = factor >= 0: ImageEnhance.Sharpness
POSTERIZE      a0 = bits, a whole number in 1..8: ImageOps.posterize
SOLARIZE       a0 = threshold: p >= t ? 255 - p : p
AUTOCONTRAST   per channel, ImageOps.autocontrast(cutoff=0)
EQUALIZE       per channel, ImageOps.equalize
AFFINE         a0..a5 = inverse map (source x = a0 x' + a1 y' + a2, source y =
               a3 x' + a4 y' + a5 at output pixel centres), nearest pixel,
               a6 = fill outside: Image.transform(AFFINE, NEAREST)
=============  ==================================================================

Non-integer results are rounded half up and clamped to 0..255.  The kernels
number the ops the same way (``_kernel.op_names()``; the tests compare).
"""
from __future__ import annotations

NONE = 0
BRIGHTNESS = 1
CONTRAST = 2
SATURATION = 3
HUE = 4
GRAYSCALE = 5
ERASE = 6
SHARPNESS = 7
POSTERIZE = 8
SOLARIZE = 9
AUTOCONTRAST = 10
EQUALIZE = 11
AFFINE = 12

#: Float arguments per step.
ARGS = 8

#: Op name by code.
NAMES = ("NONE", "BRIGHTNESS", "CONTRAST", "SATURATION", "HUE", "GRAYSCALE", "ERASE",
         "SHARPNESS", "POSTERIZE", "SOLARIZE", "AUTOCONTRAST", "EQUALIZE", "AFFINE")

#: Ops that read their image's per-channel histogram (``op_counts`` in kernels.cu).
COUNTING = frozenset({CONTRAST, AUTOCONTRAST, EQUALIZE})
#: Ops that are a lookup table per channel (``op_maps`` in kernels.cu).
TABLES = frozenset({BRIGHTNESS, CONTRAST, POSTERIZE, SOLARIZE, AUTOCONTRAST, EQUALIZE})

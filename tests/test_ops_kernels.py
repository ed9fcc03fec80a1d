"""The per-image augmentation programs (kernels.cu's ops_*, run on the CPU by
``_kernel.apply_ops``): each op against Pillow (torchvision's formula for hue),
programs against their steps one by one, rows against each other, hostile
programs, the CPU device's ordering, and the GPU against the CPU bit for bit.

Tolerances, in levels of 0..255, and why:

- exact: POSTERIZE, SOLARIZE, EQUALIZE (integer tables, as Pillow's), ERASE,
  AFFINE by whole pixels, NONE;
- the kernels round half up where Pillow truncates (its blends, autocontrast):
  BRIGHTNESS and SHARPNESS sit 0 or +1 above Pillow, AUTOCONTRAST within 1;
- CONTRAST and SATURATION blend towards a float luma (mean luma for contrast)
  where Pillow blends towards the rounded one: the values before rounding differ
  by at most |1 - f| / 2 <= 1/2 for factors in [0, 2], so rounding half up
  against truncating still gives 0 or +1;
- GRAYSCALE: float luma rounded vs Pillow's fixed point, within 1;
- HUE: float32 in the 0..255 scale vs torchvision's formula in float64, within 1;
- AFFINE with rotations and shears: Pillow steps through the output in 16.16
  fixed point, so a pixel centre that maps within about 2^-16 of a source pixel
  edge may land on the neighbour: under 0.5% of pixels differ (0.07% measured
  for a 23 degree rotation, none for the shears).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageEnhance, ImageOps

from echo_native import _kernel
from echo_native._kernel import Op as op
from echo_native.backends.array import ArrayDevice
from echo_native.backends.cpu import CpuDevice
from echo_native.echo.images import ImageStore
from photos import fit, photo

ROOT = Path(__file__).resolve().parents[1]

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")


def batch(h=64, w=80, noise=2, seed=0):
    """Real photographs resampled to h x w, then uniform noise images, then a flat one and
    a two-level one (degenerate histograms)."""
    rng = np.random.default_rng(seed)
    imgs = [fit(photo(name), h, w) for name in PHOTOS]
    imgs += [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(noise)]
    imgs.append(np.full((h, w, 3), 97, np.uint8))
    two = np.where(rng.random((h, w, 1)) < 0.3, 40, 200).astype(np.uint8).repeat(3, -1)
    imgs.append(two)
    return np.ascontiguousarray(np.stack(imgs))


def program(n, code, a=(), steps=1):
    """Every row runs op ``code`` with arguments ``a`` (then NONE)."""
    codes = np.zeros((n, steps), np.int32)
    args = np.zeros((n, steps, _kernel.OP_ARGS), np.float32)
    codes[:, 0] = code
    args[:, 0, :len(a)] = a
    return codes, args


def run(images, code, a=()):
    out = images.copy()
    _kernel.apply_ops(out, *program(len(out), code, a))
    return out


def random_args(rng, code, h, w):
    """Valid arguments of op ``code`` for an h x w image, drawn over their whole range."""
    a = np.zeros(_kernel.OP_ARGS, np.float32)
    if code in (op.BRIGHTNESS, op.CONTRAST, op.SATURATION, op.SHARPNESS):
        a[0] = rng.choice([0.0, 1.0, rng.uniform(0, 2.5)])
    elif code == op.HUE:
        a[0] = rng.choice([-0.5, 0.5, rng.uniform(-0.5, 0.5)])
    elif code == op.ERASE:
        eh, ew = rng.integers(0, h + 2), rng.integers(0, w + 2)
        a[:4] = rng.integers(-2, h + 1), rng.integers(-2, w + 1), eh, ew
        a[4:7] = rng.uniform(0, 255, 3)
    elif code == op.POSTERIZE:
        a[0] = rng.integers(1, 9)
    elif code == op.SOLARIZE:
        a[0] = rng.uniform(-10, 300)
    elif code == op.AFFINE:
        t = rng.uniform(-0.8, 0.8)
        a[:6] = (math.cos(t), math.sin(t), rng.uniform(-w, w), -math.sin(t),
                 math.cos(t) + rng.uniform(-0.3, 0.3), rng.uniform(-h, h))
        a[6] = rng.integers(0, 256)
    return a


def random_programs(rng, n, steps, h, w):
    """Valid programs using every op (each code comes up at least once when n * steps
    >= 13)."""
    codes = rng.permutation(np.resize(np.arange(len(op)), n * steps)).reshape(n, steps)
    args = np.zeros((n, steps, _kernel.OP_ARGS), np.float32)
    for i in range(n):
        for k in range(steps):
            args[i, k] = random_args(rng, codes[i, k], h, w)
    return codes.astype(np.int32), args


def diff(got, ref):
    return got.astype(np.int16) - np.asarray(ref).astype(np.int16)


def pillow_each(images, fn):
    return np.stack([np.asarray(fn(Image.fromarray(im))) for im in images])


# -- the codes ----------------------------------------------------------------------------------
def test_op_codes_come_from_one_header():
    """The op codes are defined once, in src/kernel/en_opcodes.h: the binding's ``Op``
    numbers them as its list does, and the CUDA source NVRTC compiles carries that list
    (no second copy of the numbers anywhere)."""
    header = (ROOT / "src" / "kernel" / "en_opcodes.h").read_text()
    listed = re.findall(r"X\((\w+), (\d+), [01], [01]\)", header)
    assert [(o.name, str(o.value)) for o in op] == listed
    assert _kernel.op_names() == tuple(name for name, _ in listed)
    assert _kernel.OP_ARGS == int(re.search(r"#define OP_ARGS (\d+)", header).group(1))
    source = _kernel.cuda_source()
    assert "#define EN_OP_LIST(X)" in source and '#include "en_opcodes.h"' not in source
    assert "OP_NONE = 0" not in (ROOT / "src" / "kernel" / "kernels.cu").read_text()


# -- each op against Pillow ---------------------------------------------------------------------
@pytest.mark.parametrize("f", [0.0, 0.45, 1.0, 1.37, 2.5])
def test_brightness_is_pillows_rounded_half_up(f):
    """p * f rounded half up: Pillow truncates the same float product, so 0 or +1."""
    x = batch()
    d = diff(run(x, op.BRIGHTNESS, [f]), pillow_each(x, lambda im: ImageEnhance.Brightness(im)
                                                      .enhance(f)))
    assert d.min() >= 0 and d.max() <= 1
    if f in (0.0, 1.0):
        assert not d.any()


@pytest.mark.parametrize("f", [0.0, 0.3, 1.0, 1.6, 2.0])
def test_contrast_matches_pillow(f):
    """Blend with the mean luma: 0 or +1 from Pillow (its mean rounded to an integer,
    its blend truncated)."""
    x = batch()
    d = diff(run(x, op.CONTRAST, [f]), pillow_each(x, lambda im: ImageEnhance.Contrast(im)
                                                    .enhance(f)))
    assert d.min() >= 0 and d.max() <= 1 and d.mean() < 0.6
    if f == 1.0:
        assert not d.any()


def test_contrast_mean_is_the_exact_luma_mean():
    """f = 0 gives every pixel the image's mean luma 0.299 R + 0.587 G + 0.114 B,
    rounded half up, computed exactly (from integer sums)."""
    x = batch()
    m = (x.astype(np.float64) @ [0.299, 0.587, 0.114]).mean(axis=(1, 2))
    got = run(x, op.CONTRAST, [0.0])
    np.testing.assert_array_equal(got, np.broadcast_to(np.floor(m + 0.5)[:, None, None, None],
                                                       x.shape))


@pytest.mark.parametrize("f", [0.0, 0.5, 1.0, 1.8])
def test_saturation_matches_pillow_color(f):
    """Blend with the pixel's float luma: 0 or +1 from ImageEnhance.Color (rounded luma,
    truncating blend)."""
    x = batch()
    d = diff(run(x, op.SATURATION, [f]), pillow_each(x, lambda im: ImageEnhance.Color(im)
                                                      .enhance(f)))
    assert d.min() >= 0 and d.max() <= 1 and d.mean() < 0.6
    if f == 1.0:
        assert not d.any()


def test_grayscale_matches_pillow_convert_l():
    """Rounded float luma on all three channels: within 1 of convert('L'), mostly equal."""
    x = batch()
    got = run(x, op.GRAYSCALE)
    assert (got == got[..., :1]).all()
    d = diff(got[..., 0], pillow_each(x, lambda im: im.convert("L")))
    assert np.abs(d).max() <= 1 and np.abs(d).mean() < 0.05


def hue_reference(img, shift):
    """torchvision's tensor adjust_hue, in float64: RGB -> HSV, h = (h + shift) mod 1,
    HSV -> RGB (rounded half up here)."""
    x = img.astype(np.float64) / 255.0
    r, g, b = x[..., 0], x[..., 1], x[..., 2]
    v, lo = x.max(-1), x.min(-1)
    same = v == lo
    cr = v - lo
    s = cr / np.where(same, 1.0, v)
    div = np.where(same, 1.0, cr)
    rc, gc, bc = (v - r) / div, (v - g) / div, (v - b) / div
    h = (v == r) * (bc - gc) + ((v == g) & (v != r)) * (2.0 + rc - bc) + \
        ((v != g) & (v != r)) * (4.0 + gc - rc)
    h = np.fmod(h / 6.0 + 1.0, 1.0)
    h = np.mod(h + shift, 1.0)
    i = np.floor(h * 6.0)
    f = h * 6.0 - i
    i = i.astype(int) % 6
    p = np.clip(v * (1 - s), 0, 1)
    q = np.clip(v * (1 - s * f), 0, 1)
    t = np.clip(v * (1 - s * (1 - f)), 0, 1)
    table = [(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)]
    out = np.zeros_like(x)
    for k, chans in enumerate(table):
        out[i == k] = np.stack(chans, -1)[i == k]
    return np.floor(out * 255.0 + 0.5).astype(np.uint8)


@pytest.mark.parametrize("shift", [-0.5, -0.23, 0.0, 0.1, 0.4999, 0.5])
def test_hue_matches_torchvision_formula(shift):
    """Within 1 level of torchvision's adjust_hue formula in float64; grey pixels keep
    their value; a zero shift changes nothing."""
    x = batch()
    got = run(x, op.HUE, [shift])
    d = diff(got, hue_reference(x, shift))
    assert np.abs(d).max() <= 1 and np.abs(d).mean() < 0.01
    grey = (x == x[..., :1]).all(-1)
    np.testing.assert_array_equal(got[grey], x[grey])
    if shift == 0.0:
        np.testing.assert_array_equal(got, x)


def test_erase_fills_the_clipped_rectangle():
    """The rectangle, clipped to the image, takes the fill (rounded half up); nothing
    else changes."""
    x = batch(h=20, w=30, noise=1)
    n = len(x)
    boxes = [(3, 4, 5, 6), (-3, -2, 6, 40), (15, 25, 100, 100), (0, 0, 0, 7), (19, 29, 1, 1),
             (25, 0, 3, 3), (0, 0, 20, 30)]
    codes, args = program(n, op.ERASE)
    ref = x.copy()
    for i in range(n):
        top, left, h, w = boxes[i % len(boxes)]
        fill = (10.4, 127.5, 254.6)
        args[i, 0, :7] = (top, left, h, w) + fill
        ref[i, max(top, 0):max(top + h, 0), max(left, 0):max(left + w, 0)] = (10, 128, 255)
    out = x.copy()
    _kernel.apply_ops(out, codes, args)
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("f", [0.0, 0.4, 1.0, 1.9])
def test_sharpness_matches_pillow(f):
    """ImageEnhance.Sharpness: the same rounded SMOOTH image and border, a blend rounded
    half up where Pillow truncates: 0 or +1."""
    x = batch()
    d = diff(run(x, op.SHARPNESS, [f]), pillow_each(x, lambda im: ImageEnhance.Sharpness(im)
                                                     .enhance(f)))
    assert d.min() >= 0 and d.max() <= 1
    assert not d[:, 0].any() and not d[:, -1].any() and not d[:, :, 0].any()
    if f in (0.0, 1.0):
        assert not d.any()


@pytest.mark.parametrize("bits", range(1, 9))
def test_posterize_is_pillows(bits):
    x = batch()
    np.testing.assert_array_equal(run(x, op.POSTERIZE, [bits]),
                                  pillow_each(x, lambda im: ImageOps.posterize(im, bits)))


@pytest.mark.parametrize("t", [0, 1, 97, 128, 200.5, 255, 256])
def test_solarize_is_pillows(t):
    x = batch()
    np.testing.assert_array_equal(run(x, op.SOLARIZE, [t]),
                                  pillow_each(x, lambda im: ImageOps.solarize(im, t)))


def test_autocontrast_matches_pillow():
    """Per channel, lo .. hi stretched to 0 .. 255, rounded half up where Pillow
    truncates: within 1; a flat channel is left alone; lo and hi land on 0 and 255."""
    x = batch()
    x[0] = (x[0] // 2 + 40).astype(np.uint8)  # a narrow range to stretch
    got = run(x, op.AUTOCONTRAST)
    d = diff(got, pillow_each(x, ImageOps.autocontrast))
    assert d.min() >= 0 and d.max() <= 1
    np.testing.assert_array_equal(got[-2], x[-2])  # flat
    assert got[0].reshape(-1, 3).min(0).tolist() == [0, 0, 0]
    assert got[0].reshape(-1, 3).max(0).tolist() == [255, 255, 255]


def test_equalize_is_pillows():
    """Pillow's integer LUT, exactly; flat and two-level images included."""
    x = batch(noise=3)
    x[1] = (x[1] // 3).astype(np.uint8)
    np.testing.assert_array_equal(run(x, op.EQUALIZE), pillow_each(x, ImageOps.equalize))


def pillow_affine(img, a, fill):
    im = Image.fromarray(img)
    return np.asarray(im.transform(im.size, Image.Transform.AFFINE, tuple(float(v) for v in a),
                                   Image.Resampling.NEAREST, fillcolor=(fill,) * 3))


def test_affine_translation_is_pillows():
    """Whole-pixel translations (TranslateX/Y) exactly as Image.transform, fill outside."""
    x = batch()
    for tx, ty in [(0, 0), (5, 0), (0, -7), (-13, 9), (200, 0)]:
        a = (1, 0, tx, 0, 1, ty, 128)
        got = run(x, op.AFFINE, a)
        ref = np.stack([pillow_affine(im, a[:6], 128) for im in x])
        np.testing.assert_array_equal(got, ref)


def _centred(m, h, w):
    """The inverse map about the image centre for a 2x2 matrix m (torchvision's way)."""
    cx, cy = w * 0.5, h * 0.5
    (a, b), (d, e) = m
    return (a, b, cx - a * cx - b * cy, d, e, cy - d * cx - e * cy)


@pytest.mark.parametrize("kind", ["rotate", "shear_x", "shear_y", "mix"])
def test_affine_rotation_and_shear_match_pillow(kind):
    """Rotations and shears: under 0.5% of pixels differ from Pillow (its 16.16 fixed-point
    stepping at source pixel edges), and where they differ, ours is the source pixel
    at the exactly computed position."""
    x = batch(noise=1)
    h, w = x.shape[1:3]
    t = math.radians(23.0)
    m = {"rotate": ((math.cos(t), math.sin(t)), (-math.sin(t), math.cos(t))),
         "shear_x": ((1, 0.3), (0, 1)), "shear_y": ((1, 0), (-0.21, 1)),
         "mix": ((0.9, 0.2), (-0.35, 1.1))}[kind]
    a = _centred(m, h, w) + (17,)
    got = run(x, op.AFFINE, a)
    ref = np.stack([pillow_affine(im, a[:6], 17) for im in x])
    differ = (got != ref).any(-1)
    assert differ.mean() < 0.005
    # Exact positions in float64: ours must agree wherever the source point is not
    # within float32 rounding of a pixel edge.
    yy, xx = np.mgrid[0:h, 0:w] + 0.5
    sx = a[0] * xx + a[1] * yy + a[2]
    sy = a[3] * xx + a[4] * yy + a[5]
    edge = (np.abs(sx - np.round(sx)) < 1e-4) | (np.abs(sy - np.round(sy)) < 1e-4)
    inside = (sx >= 0) & (sx < w) & (sy >= 0) & (sy < h)
    xi = np.clip(np.floor(sx), 0, w - 1).astype(int)
    yi = np.clip(np.floor(sy), 0, h - 1).astype(int)
    exact = np.where(inside[None, ..., None], x[:, yi, xi], 17)
    np.testing.assert_array_equal(got[:, ~edge], exact[:, ~edge])


# -- programs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_program_is_its_steps_in_order(seed):
    """A K-step program gives exactly what its steps give applied one after another."""
    rng = np.random.default_rng(seed)
    x = batch(h=24, w=31, noise=2, seed=seed)
    n, steps = len(x), 5
    codes, args = random_programs(rng, n, steps, 24, 31)
    got = x.copy()
    _kernel.apply_ops(got, codes, args)
    ref = x.copy()
    for k in range(steps):
        _kernel.apply_ops(ref, np.ascontiguousarray(codes[:, k:k + 1]),
                          np.ascontiguousarray(args[:, k:k + 1]))
    np.testing.assert_array_equal(got, ref)
    assert (got != x).any()


def test_rows_are_independent_and_none_rows_untouched():
    """Each row's result is what it gives alone; rows of NONE only keep their pixels."""
    rng = np.random.default_rng(7)
    x = batch(h=16, w=20, noise=3)
    n = len(x)
    codes, args = random_programs(rng, n, 4, 16, 20)
    codes[2] = op.NONE
    args[2] = rng.uniform(-1e9, 1e9, args[2].shape)  # ignored by NONE
    got = x.copy()
    _kernel.apply_ops(got, codes, args)
    np.testing.assert_array_equal(got[2], x[2])
    for i in range(n):
        alone = x[i:i + 1].copy()
        _kernel.apply_ops(alone, codes[i:i + 1].copy(), args[i:i + 1].copy())
        np.testing.assert_array_equal(got[i], alone[0])


def test_empty_programs_and_batches_are_no_ops():
    x = batch(h=5, w=6, noise=0)
    out = x.copy()
    _kernel.apply_ops(out, np.zeros((len(x), 0), np.int32), np.zeros((len(x), 0, 8), np.float32))
    np.testing.assert_array_equal(out, x)
    _kernel.apply_ops(np.zeros((0, 5, 6, 3), np.uint8), np.zeros((0, 3), np.int32),
                      np.zeros((0, 3, 8), np.float32))


@pytest.mark.parametrize("h,w", [(1, 1), (1, 7), (2, 2), (3, 3), (5, 1)])
def test_tiny_images(h, w):
    """Every op on images smaller than the sharpness window: no crash, sharpness keeps
    its all-border image."""
    rng = np.random.default_rng(h * 10 + w)
    x = rng.integers(0, 256, (13, h, w, 3), dtype=np.uint8)
    codes, args = random_programs(rng, 13, 3, h, w)
    out = x.copy()
    _kernel.apply_ops(out, codes, args)
    if h < 3 or w < 3:
        np.testing.assert_array_equal(run(x, op.SHARPNESS, [1.7]), x)


# -- hostile programs ---------------------------------------------------------------------------
HOSTILE = [
    (13, [], r"row 1, step 2: op code 13 is not one of 0 \.\. 12"),
    (-1, [], "op code -1"),
    (op.BRIGHTNESS, [math.nan], "BRIGHTNESS factor must be finite and >= 0, got args.0. = nan"),
    (op.CONTRAST, [-0.5], "CONTRAST factor must be finite and >= 0"),
    (op.SATURATION, [math.inf], "SATURATION factor"),
    (op.SHARPNESS, [-math.inf], "SHARPNESS factor"),
    (op.HUE, [0.51], r"HUE hue shift must be in -0\.5 \.\. 0\.5, got args.0. = 0\.51"),
    (op.HUE, [math.nan], "HUE hue shift"),
    (op.POSTERIZE, [0], r"POSTERIZE bits must be a whole number in 1 \.\. 8, got args.0. = 0"),
    (op.POSTERIZE, [9], "POSTERIZE bits"),
    (op.POSTERIZE, [2.5], "POSTERIZE bits"),
    (op.SOLARIZE, [math.nan], "SOLARIZE threshold must be finite"),
    (op.ERASE, [1.5, 0, 2, 2, 0, 0, 0], "ERASE top, left, height and width must be whole"),
    (op.ERASE, [0, 0, -1, 2, 0, 0, 0], r"ERASE height and width must be >= 0, got args.2."),
    (op.ERASE, [1e30, 0, 2, 2, 0, 0, 0], "ERASE top, left"),
    (op.ERASE, [0, 0, 2, 2, 0, 256, 0], r"ERASE fill must be in 0 \.\. 255, got args.5. = 256"),
    (op.ERASE, [0, 0, 2, 2, 0, 0, math.nan], "ERASE fill"),
    (op.AFFINE, [1, 0, math.inf, 0, 1, 0, 0], r"AFFINE the map's coefficients must be finite"),
    (op.AFFINE, [1, 0, 0, 0, 1, 0, -1], "AFFINE fill"),
]


@pytest.mark.parametrize("code,a,match", HOSTILE)
def test_hostile_arguments_are_refused_by_row_step_and_value(code, a, match):
    """A bad code or argument is a ValueError naming the row, the step and the value,
    before any pixel changes."""
    x = batch(h=6, w=7, noise=0)[:3]
    codes = np.full((3, 4), op.BRIGHTNESS, np.int32)
    args = np.ones((3, 4, 8), np.float32)
    codes[1, 2] = code
    args[1, 2] = 0
    args[1, 2, :len(a)] = a
    out = x.copy()
    with pytest.raises(ValueError, match=match):
        _kernel.apply_ops(out, codes, args)
    np.testing.assert_array_equal(out, x)
    with pytest.raises(ValueError, match="row 1, step 2"):
        _kernel.check_ops(codes, args, x.shape)


def test_bad_arrays_are_refused():
    x = batch(h=6, w=7, noise=0)[:2].copy()
    codes, args = program(2, op.BRIGHTNESS, [1.2])
    with pytest.raises(ValueError, match="codes must be a C-contiguous 2-d int32"):
        _kernel.apply_ops(x, codes.astype(np.int64), args)
    with pytest.raises(ValueError, match="args must be a C-contiguous 3-d float32"):
        _kernel.apply_ops(x, codes, args.astype(np.float64))
    with pytest.raises(ValueError, match=r"codes \(n, K\) and args \(n, K, 8\) must agree"):
        _kernel.apply_ops(x, codes, args[:, :, :7].copy())
    with pytest.raises(ValueError, match="must agree"):
        _kernel.apply_ops(x, codes[:1].copy(), args)
    with pytest.raises(ValueError, match="must agree"):
        _kernel.apply_ops(np.zeros((2, 6, 7, 4), np.uint8), codes, args)
    with pytest.raises(ValueError, match="images must be a C-contiguous writable"):
        _kernel.apply_ops(x[:, :, ::2], codes, args)
    ro = x.copy()
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="writable"):
        _kernel.apply_ops(ro, codes, args)
    with pytest.raises(ValueError, match="uint8"):
        _kernel.apply_ops(x.astype(np.float32), codes, args)
    with pytest.raises(TypeError, match="codes must be a numpy.ndarray"):
        _kernel.apply_ops(x, codes.tolist(), args)
    with pytest.raises(ValueError, match="images must be 1 .. 65535"):
        _kernel.check_ops(codes, args, (2, 0, 7, 3))


_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                    st.sampled_from([0.0, 1.0, 2.0, 8.0, 255.0, -1.0, 0.5, 3.0]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 3), h=st.integers(1, 9), w=st.integers(1, 9), steps=st.integers(0, 4),
       data=st.data())
def test_random_programs_never_escape_and_are_deterministic(n, h, w, steps, data):
    """Any program: refused with ValueError and nothing changed, or run twice to the same
    bytes; the bytes around the images are never written."""
    codes = np.array(data.draw(st.lists(st.integers(-2, 14), min_size=n * steps,
                                        max_size=n * steps)), np.int32).reshape(n, steps)
    args = np.array(data.draw(st.lists(_floats, min_size=n * steps * 8,
                                       max_size=n * steps * 8)), np.float32)
    args = args.reshape(n, steps, 8)
    rng = np.random.default_rng(n * 100 + h * 10 + w)
    guarded = rng.integers(0, 256, (n + 2, h, w, 3), dtype=np.uint8)
    before = guarded.copy()
    images = guarded[1:-1]
    try:
        _kernel.check_ops(codes, args, images.shape)
    except ValueError:
        with pytest.raises(ValueError, match=r"row \d+, step \d+"):
            _kernel.apply_ops(images, codes, args)
        np.testing.assert_array_equal(guarded, before)
        return
    _kernel.apply_ops(images, codes, args)
    again = before[1:-1].copy()
    _kernel.apply_ops(again, codes, args)
    np.testing.assert_array_equal(images, again)
    np.testing.assert_array_equal(guarded[0], before[0])
    np.testing.assert_array_equal(guarded[-1], before[-1])


# -- the devices --------------------------------------------------------------------------------
def test_array_device_augment_is_apply_ops():
    rng = np.random.default_rng(3)
    x = batch(h=12, w=14)
    codes, args = random_programs(rng, len(x), 3, 12, 14)
    ref = x.copy()
    _kernel.apply_ops(ref, codes, args)
    got = x.copy()
    assert ArrayDevice(np).augment(got, codes, args) is None
    np.testing.assert_array_equal(got, ref)


def _canvas_buffer(h=40, w=50):
    canvases = [fit(photo(name), h, w) for name in PHOTOS]
    buf = ImageStore(len(canvases), h * w * 3)
    for i, c in enumerate(canvases):
        buf.pixels[i] = c.reshape(-1)
        buf.shape[i] = (h, w)
    return buf


def test_cpu_device_augments_after_the_crop_on_its_thread():
    """CpuDevice queues the program behind the batch's crop on its one thread: the
    result is the crop's output augmented, the job is what synchronize waits for, the
    caller's arrays may change meanwhile; a bad program raises at the call."""
    rng = np.random.default_rng(11)
    buf = _canvas_buffer()
    entries = np.array([3, 0, 2, 1, 0, 3])
    boxes = np.array([[2.0, 3.0, 30.0, 40.0]] * len(entries))
    flips = np.arange(len(entries)) % 2 == 0
    codes, args = random_programs(rng, len(entries), 4, 24, 24)
    ref = np.empty((len(entries), 24, 24, 3), np.uint8)
    # The reference: the crop on the native path, then the program.
    _kernel.Decoder().resize_batch(buf.pixels, entries.astype(np.int64), buf.shape, boxes,
                                   flips.astype(np.uint8), ref)
    _kernel.apply_ops(ref, codes, args)
    dev = CpuDevice()
    try:
        for _ in range(3):
            out = np.zeros_like(ref)
            crop = dev.crop_resize(buf, entries, boxes, flips, out)
            job = dev.augment(out, codes, args)
            assert job is not None and job is not crop
            codes_saved, args_saved = codes.copy(), args.copy()
            codes[:] = op.NONE  # the job took copies
            args[:] = 0
            dev.synchronize(job)
            assert crop.done()
            np.testing.assert_array_equal(out, ref)
            codes[:], args[:] = codes_saved, args_saved
        bad = args.copy()
        bad[0, 0, 0] = math.nan
        codes[0, 0] = op.BRIGHTNESS
        with pytest.raises(ValueError, match="row 0, step 0"):
            dev.augment(out, codes, bad)
        with pytest.raises(ValueError, match="C-contiguous writable"):
            dev.augment(out[:, ::2], codes, args)
    finally:
        dev.release_buffers()


def test_cpu_device_augment_reports_its_crops_failure():
    """When the crop before it fails, the augment job fails with the crop's error (its
    pixels were never written); reported to the caller that waited for it, it is not
    raised again by the clean-up, and an error nobody waited for is raised by it."""
    buf = _canvas_buffer()
    dev = CpuDevice()
    out = np.zeros((2, 8, 8, 3), np.uint8)
    dev.crop_resize(buf, np.array([0, 99]), np.array([[0.0, 0.0, 8.0, 8.0]] * 2),
                    np.zeros(2, bool), out)
    job = dev.augment(out, *program(2, op.GRAYSCALE))
    with pytest.raises(IndexError, match="entry 99"):
        dev.synchronize(job)
    dev.release_buffers()
    dev = CpuDevice()
    dev.crop_resize(buf, np.array([99]), np.array([[0.0, 0.0, 8.0, 8.0]]), np.zeros(1, bool),
                    out)
    with pytest.raises(IndexError, match="entry 99"):
        dev.release_buffers()
    assert dev._host is None  # the host thread ended all the same


def _cuda():
    cupy = pytest.importorskip("cupy")
    try:
        if not cupy.is_available():
            pytest.skip("CuPy finds no CUDA device")
    except Exception as e:  # a driver-less machine
        pytest.skip(f"no CUDA: {e}")
    from echo_native.backends.cuda import CudaDevice
    return cupy, CudaDevice(0)


@pytest.mark.gpu
@pytest.mark.parametrize("steps", [1, 4, 5])
def test_cuda_augment_is_the_cpus_bit_for_bit(steps):
    """CudaDevice.augment (the kernels through NVRTC on the GPU) gives apply_ops's bytes,
    every op, even and odd step counts; a NONE column and a bad program included."""
    cupy, dev = _cuda()
    rng = np.random.default_rng(steps)
    x = np.concatenate([batch(h=57, w=71, noise=3, seed=steps)] * 2)
    codes, args = random_programs(rng, len(x), steps, 57, 71)
    codes[:, 0] = op.NONE
    ref = x.copy()
    _kernel.apply_ops(ref, codes, args)
    with dev.device:
        images = cupy.asarray(x)
        cupy.cuda.Device().synchronize()  # the upload ran on another stream than ours
    assert dev.augment(images, codes, args) is None
    dev.stream.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(images), ref)
    bad = args.copy()
    codes[2, -1], bad[2, -1, 0] = op.POSTERIZE, 0
    with pytest.raises(ValueError, match=f"row 2, step {steps - 1}"):
        dev.augment(images, codes, bad)

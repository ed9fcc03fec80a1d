"""Per-image augmentation programs on the CPU: ``_kernel.apply_ops`` (kernels.cu built
for the host), one thread, on a batch of 128 x 224 x 224 photographs::

    python -m pytest benchmarks/bench_ops.py -q

Programs (drawn once, the same every round):

color_jitter    ColorJitter(0.4, 0.4, 0.4, 0.1): brightness, contrast, saturation and
                hue, in a random order per image (four steps)
trivial_augment TrivialAugmentWide: one of its 14 ops per image at a random magnitude
                (identity, shears, translations, rotation, brightness, colour,
                contrast, sharpness, posterize, solarize, autocontrast, equalize)

Each round restores the batch first (a copy, included in the time: about 1% of it)
so that every round runs the program on the same pixels.  ``extra_info["img_per_s"]``
holds the throughput; the test prints it too.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from PIL import Image

from echo_native import _kernel
from echo_native._kernel import Op as op

BATCH, SIZE = 128, 224
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "camera")


@pytest.fixture(scope="module")
def images():
    import skimage.data

    photos = []
    for name in PHOTOS:
        arr = getattr(skimage.data, name)()
        arr = np.stack([arr] * 3, -1) if arr.ndim == 2 else arr[..., :3]
        photos.append(np.asarray(Image.fromarray(arr).resize((SIZE, SIZE), Image.BILINEAR)))
    return np.ascontiguousarray(np.stack([photos[i % len(photos)] for i in range(BATCH)]))


def color_jitter(rng, n):
    codes = np.stack([rng.permutation([op.BRIGHTNESS, op.CONTRAST, op.SATURATION, op.HUE])
                      for _ in range(n)]).astype(np.int32)
    args = np.zeros((n, 4, _kernel.OP_ARGS), np.float32)
    factors = rng.uniform(0.6, 1.4, (n, 4))
    factors[codes == op.HUE] = rng.uniform(-0.1, 0.1, n)
    args[..., 0] = factors
    return codes, args


def trivial_augment(rng, n):
    codes = np.zeros((n, 1), np.int32)
    args = np.zeros((n, 1, _kernel.OP_ARGS), np.float32)
    c = SIZE * 0.5
    for i in range(n):
        kind = rng.integers(14)
        m = rng.uniform(0, 1) * rng.choice([-1, 1])
        a = args[i, 0]
        if kind == 0:
            continue  # identity
        if kind in (1, 2):  # shear x / y by up to 0.99
            s = 0.99 * m
            codes[i] = op.AFFINE
            a[:7] = (1, s, -s * c, 0, 1, 0, 0) if kind == 1 else (1, 0, 0, s, 1, -s * c, 0)
        elif kind in (3, 4):  # translate by up to 32 pixels
            t = round(32 * m)
            codes[i] = op.AFFINE
            a[:7] = (1, 0, t, 0, 1, 0, 0) if kind == 3 else (1, 0, 0, 0, 1, t, 0)
        elif kind == 5:  # rotate by up to 135 degrees about the centre
            t = math.radians(135 * m)
            ct, st = math.cos(t), math.sin(t)
            codes[i] = op.AFFINE
            a[:7] = (ct, st, c - ct * c - st * c, -st, ct, c + st * c - ct * c, 0)
        elif kind in (6, 7, 8, 9):
            codes[i] = (op.BRIGHTNESS, op.SATURATION, op.CONTRAST, op.SHARPNESS)[kind - 6]
            a[0] = 1 + 0.99 * m
        elif kind == 10:
            codes[i], a[0] = op.POSTERIZE, rng.integers(2, 9)
        elif kind == 11:
            codes[i], a[0] = op.SOLARIZE, rng.uniform(0, 255)
        else:
            codes[i] = (op.AUTOCONTRAST, op.EQUALIZE)[kind - 12]
    return codes, args


@pytest.mark.benchmark(group="ops")
@pytest.mark.parametrize("name", ["color_jitter", "trivial_augment"])
def test_apply_ops(benchmark, images, name):
    codes, args = {"color_jitter": color_jitter, "trivial_augment": trivial_augment}[name](
        np.random.default_rng(0), BATCH)
    work = images.copy()

    def one_batch():
        work[...] = images
        _kernel.apply_ops(work, codes, args)

    benchmark.pedantic(one_batch, rounds=5, iterations=1, warmup_rounds=1)
    rate = BATCH / benchmark.stats.stats.mean
    benchmark.extra_info.update(images=BATCH, size=SIZE, program=name, img_per_s=rate)
    print(f"\n{name}: {rate:,.0f} img/s ({BATCH} x {SIZE} x {SIZE}, one thread)")

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

**Per thread, against another build** (``test_colour_ops_per_thread``): the CPU time
(this thread's, so other load on a shared machine hardly moves it) per 224 px image
of each colour op alone and of the ColorJitter program, in this tree and, with
``ECHO_NATIVE_BENCH_BEFORE=<another checkout, built in place>``, in that one, the
two measured in alternating subprocesses (``ECHO_NATIVE_BENCH_OPS_PAIRS`` pairs,
default 5); the ratio before / after is taken per pair and reported as median
(min-max)::

    ECHO_NATIVE_BENCH_BEFORE=/path/to/old/checkout \
        python -m pytest benchmarks/bench_ops.py -s -k per_thread
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

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


# ---- per thread, against another build ------------------------------------------------------
PER_THREAD = r"""
import json, sys, time
import numpy as np
from PIL import Image
import skimage.data
from echo_native import _kernel
from echo_native._kernel import Op as op
photos = []
for name in ("astronaut", "coffee", "chelsea", "rocket", "camera"):
    arr = getattr(skimage.data, name)()
    arr = np.stack([arr] * 3, -1) if arr.ndim == 2 else arr[..., :3]
    photos.append(np.asarray(Image.fromarray(arr).resize((224, 224), Image.BILINEAR)))
n = 64
images = np.ascontiguousarray(np.stack([photos[i % 5] for i in range(n)]))
rng = np.random.default_rng(0)
def program(codes, factors):
    args = np.zeros((n, codes.shape[1], _kernel.OP_ARGS), np.float32)
    args[..., 0] = factors
    return np.ascontiguousarray(codes, np.int32), args
one = lambda code, lo, hi: program(np.full((n, 1), code), rng.uniform(lo, hi, (n, 1)))
order = np.stack([rng.permutation([op.BRIGHTNESS, op.CONTRAST, op.SATURATION, op.HUE])
                  for _ in range(n)])
factors = np.where(order == op.HUE, rng.uniform(-0.1, 0.1, (n, 4)), rng.uniform(0.6, 1.4, (n, 4)))
programs = {"brightness": one(op.BRIGHTNESS, 0.6, 1.4), "contrast": one(op.CONTRAST, 0.6, 1.4),
            "saturation": one(op.SATURATION, 0.6, 1.4), "hue": one(op.HUE, -0.1, 0.1),
            "color_jitter": program(order, factors)}
out = {}
work = images.copy()
for name, (codes, args) in programs.items():
    best = float("inf")
    for _ in range(5):
        work[...] = images
        t0 = time.thread_time()
        _kernel.apply_ops(work, codes, args)
        best = min(best, time.thread_time() - t0)
    out[name] = best / n
print(json.dumps(out))
"""


def _per_thread(tree):
    env = {**os.environ, "PYTHONPATH": tree}
    r = subprocess.run([sys.executable, "-c", PER_THREAD], env=env, capture_output=True,
                       text=True, timeout=600, cwd="/", check=False)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.benchmark(group="ops-per-thread")
def test_colour_ops_per_thread(benchmark):
    """CPU time per image of the colour ops on one thread, here and (optionally) in the
    build at ECHO_NATIVE_BENCH_BEFORE, in alternating subprocesses."""
    before = os.environ.get("ECHO_NATIVE_BENCH_BEFORE")
    pairs = int(os.environ.get("ECHO_NATIVE_BENCH_OPS_PAIRS", "5"))
    import echo_native
    # this build: the tree the running echo_native was imported from
    here = str(Path(echo_native.__file__).resolve().parents[1])
    runs = {"after": [], "before": []}

    def pair():
        runs["after"].append(_per_thread(here))
        if before:
            runs["before"].append(_per_thread(before))

    benchmark.pedantic(pair, rounds=pairs, iterations=1)
    names = list(runs["after"][0])
    lines = ["", f"Colour ops, one thread, CPU time per 224 px image (median of {pairs} runs):",
             "| op | after, us | before, us | before / after, median (min-max) |",
             "|---|---:|---:|---|"]
    result = {}
    for name in names:
        after = [r[name] for r in runs["after"]]
        row = {"after_s": statistics.median(after)}
        if runs["before"]:
            old = [r[name] for r in runs["before"]]
            ratio = [b / a for a, b in zip(after, old)]
            row.update(before_s=statistics.median(old), speedup=statistics.median(ratio),
                       speedup_min=min(ratio), speedup_max=max(ratio))
            lines.append(f"| {name} | {row['after_s'] * 1e6:,.0f} | {row['before_s'] * 1e6:,.0f}"
                         f" | {row['speedup']:.2f} ({min(ratio):.2f}-{max(ratio):.2f}) |")
        else:
            lines.append(f"| {name} | {row['after_s'] * 1e6:,.0f} | - | - |")
        result[name] = row
    benchmark.extra_info.update(result)
    print("\n".join(lines))

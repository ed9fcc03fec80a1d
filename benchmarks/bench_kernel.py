"""Single-thread kernel throughput: fused decode + RandomResizedCrop vs. its peers.

All benchmarks share one corpus (preloaded bytes) and the same boxes and flips,
and each timed round is one pass over the whole corpus, so every benchmark
processes exactly the same images.  Compare them as ratios::

    python -m pytest benchmarks/bench_kernel.py --benchmark-json=/tmp/kernel.json -q
    python benchmarks/report.py /tmp/kernel.json

Roles (stored in ``extra_info["role"]``, read by ``report.py``):

fused           ``Decoder.decode_random_crop``: parameters, ROI + DCT-scaled decode,
                antialiased bilinear resize, flip, into a preallocated buffer
fused_crop      ``Decoder.decode_crop`` with the boxes given (the contract's entry point)
fused_api       the public ``echo_native.decode_random_crop`` (thread-local decoder)
ceiling         libjpeg-turbo ROI decode alone, in C, same boxes, same DCT scale, stopping
                after the crop's last row (the fastest correct ROI decode)
ceiling_finish  the same, then decoding to the end of the file and refusing any
                warning, as a decoder that checks the whole file does
ceiling_store   the ceiling keeping every row of the crop, as a decoder that returns
                it does (the ceiling itself decodes every row into one reused row)
pillow          torchvision-style Pillow: open, resize(BILINEAR, box), flip, asarray
pillow_draft    the same with ``draft`` to the kernel's DCT scale before the resize
pillow_simd, pillow_simd_draft
                the two above when the installed PIL is Pillow-SIMD (its version ends in
                ``.postN``; README: how to install it in place of Pillow), so a run
                reports the Pillow it actually measured
"""
from __future__ import annotations

import io
import time

import numpy as np
import pytest
from PIL import Image

import echo_native as en
from echo_native import _kernel
from echo_native.lab import _bench

PIL_VERSION = Image.__version__
# Pillow-SIMD installs the same PIL package; only its version (12.1.1.post0) tells it apart.
IS_PILLOW_SIMD = "post" in PIL_VERSION
PIL_FLAVOUR = f"Pillow-SIMD {PIL_VERSION}" if IS_PILLOW_SIMD else f"Pillow {PIL_VERSION}"
PIL_ROLE = "pillow_simd" if IS_PILLOW_SIMD else "pillow"


# --- the pipelines, one pass over the corpus each -------------------------------------

def fused_pass(dec, wl, out):
    size, seed, epoch, scale, ratio, flip_p = wl.size, wl.seed, wl.epoch, wl.scale, wl.ratio, \
        wl.flip_p
    for s in wl.samples:
        dec.decode_random_crop(s.data, size, seed, epoch, s.sample_id, 0, scale, ratio, flip_p,
                               out)


def fused_crop_pass(dec, wl, out):
    size = wl.size
    for s in wl.samples:
        dec.decode_crop(s.data, s.box, size, s.flip, out)


def fused_api_pass(wl, out):
    size, seed, epoch = wl.size, wl.seed, wl.epoch
    for s in wl.samples:
        en.decode_random_crop(s.data, size, seed, epoch, s.sample_id, out=out)


def ceiling_pass(wl, mode="rgb"):
    roi = _bench.roi_decode
    for s in wl.samples:
        top, left, h, w = s.box
        roi(s.data, top, left, h, w, s.denom, mode)


def pillow_one(s, out_wh, draft):
    """torchvision's pil_loader + RandomResizedCrop + RandomHorizontalFlip + asarray.

    torchvision converts every image with ``convert("RGB")``, which copies the
    whole decoded image even when it is already RGB; here only non-RGB images
    are converted, which makes this baseline a little faster (stricter) than
    torchvision itself.  The resize reads the box directly (``box=``) instead of
    ``crop`` + ``resize``, also the faster of the two equivalent forms.
    """
    im = Image.open(io.BytesIO(s.data))
    top, left, h, w = s.box
    d = s.denom if draft else 1
    if d > 1:
        im.draft("RGB", (s.width // d, s.height // d))
    if im.mode != "RGB":
        im = im.convert("RGB")
    im = im.resize(out_wh, Image.Resampling.BILINEAR,
                   box=(left / d, top / d, (left + w) / d, (top + h) / d))
    if s.flip:
        im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(im)


def pillow_pass(wl, draft):
    out_wh = (wl.size[1], wl.size[0])
    for s in wl.samples:
        pillow_one(s, out_wh, draft)


# --- checks (not timed): every pipeline does the same work -----------------------------

def test_same_work(workload, out_buffer):
    """Boxes, flips and DCT scales agree across pipelines; outputs are close."""
    dec = _kernel.Decoder()
    worst = 0.0
    for s in workload.samples:
        box, flip = dec.decode_random_crop(s.data, workload.size, workload.seed, workload.epoch,
                                           s.sample_id, 0, workload.scale, workload.ratio,
                                           workload.flip_p, out_buffer)
        assert (tuple(box), flip) == (tuple(s.box), s.flip), s.sample_id
        assert dec.last_scale == s.denom, s.sample_id
        top, left, h, w = s.box
        assert _bench.roi_decode(s.data, top, left, h, w, s.denom) > 0
        im = Image.open(io.BytesIO(s.data))
        if s.denom > 1:
            im.draft("RGB", (s.width // s.denom, s.height // s.denom))
        assert im.size == (-(-s.width // s.denom), -(-s.height // s.denom)), s.sample_id
        if s.sample_id % 10 == 0:
            ref = pillow_one(s, workload.size[::-1], draft=True).astype(np.int16)
            worst = max(worst, float(np.abs(out_buffer.astype(np.int16) - ref).mean()))
    assert worst < 2.0, f"fused output differs from Pillow draft+resize by {worst:.2f} levels"


# --- benchmarks -----------------------------------------------------------------------

@pytest.mark.benchmark(group="kernel")
def test_fused(benchmark, workload, out_buffer):
    dec = _kernel.Decoder()
    workload.run(benchmark, lambda: fused_pass(dec, workload, out_buffer),
                 role="fused", label="fused kernel (Decoder.decode_random_crop)")


@pytest.mark.benchmark(group="kernel")
def test_fused_crop(benchmark, workload, out_buffer):
    dec = _kernel.Decoder()
    workload.run(benchmark,
                 lambda: fused_crop_pass(dec, workload, out_buffer),
                 role="fused_crop", label="fused kernel, boxes given (Decoder.decode_crop)")


@pytest.mark.benchmark(group="kernel")
def test_fused_api(benchmark, workload, out_buffer):
    workload.run(benchmark, lambda: fused_api_pass(workload, out_buffer),
                 role="fused_api", label="public en.decode_random_crop(out=...)")


@pytest.mark.benchmark(group="kernel")
def test_ceiling(benchmark, workload):
    workload.run(benchmark, lambda: ceiling_pass(workload),
                 role="ceiling", label="libjpeg-turbo ROI decode only (C, same crops)")


@pytest.mark.benchmark(group="kernel")
def test_pillow(benchmark, workload):
    workload.run(benchmark, lambda: pillow_pass(workload, draft=False),
                 role=PIL_ROLE, label=f"torchvision-style {PIL_FLAVOUR}, no draft",
                 pil=PIL_FLAVOUR)


@pytest.mark.benchmark(group="kernel")
def test_pillow_draft(benchmark, workload):
    workload.run(benchmark, lambda: pillow_pass(workload, draft=True),
                 role=f"{PIL_ROLE}_draft", label=f"torchvision-style {PIL_FLAVOUR} + draft",
                 pil=PIL_FLAVOUR)


def interleaved_times(passes, rounds):
    """Seconds of each pass per round, every pass once per round in an order rotated
    each round (after one untimed warm-up of each), so a slow spell of a shared
    machine hits them all alike and ratios can be paired by round."""
    names = list(passes)
    for fn in passes.values():
        fn()
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            passes[name]()
            times[name].append(time.perf_counter() - t0)
    return times


@pytest.mark.benchmark(group="kernel-interleaved")
def test_interleaved(benchmark, workload, out_buffer):
    """Every pipeline once per round, the order rotated each round, so a slow
    spell of a shared machine hits them all alike; ratios are taken within a
    round (paired) and reported as median and best over the rounds.  Then one
    profiled pass splits the fused kernel's time into stages."""
    dec = _kernel.Decoder()
    passes = {
        "fused": lambda: fused_pass(dec, workload, out_buffer),
        "fused_crop": lambda: fused_crop_pass(dec, workload, out_buffer),
        "ceiling": lambda: ceiling_pass(workload),
        "ceiling_finish": lambda: ceiling_pass(workload, "finish"),
        "ceiling_store": lambda: ceiling_pass(workload, "store"),
        PIL_ROLE: lambda: pillow_pass(workload, draft=False),
        f"{PIL_ROLE}_draft": lambda: pillow_pass(workload, draft=True),
    }
    times = interleaved_times(passes, workload.rounds)
    dec.profile(True)
    fused_pass(dec, workload, out_buffer)
    dec.profile(False)
    stages = dec.stages()
    calls = stages.pop("calls")
    ratios = {f"{a}/{b}": [tb / ta for ta, tb in zip(times[a], times[b])]
              for a, b in (("fused", "ceiling"), ("fused", "ceiling_finish"),
                           ("fused", "ceiling_store"), ("fused_crop", "ceiling"),
                           ("fused", PIL_ROLE), ("fused", f"{PIL_ROLE}_draft"))}
    rates = {name: {"best": workload.n / min(t), "median": workload.n / float(np.median(t))}
             for name, t in times.items()}
    summary = {name: {"median": float(np.median(v)), "best": max(v), "worst": min(v)}
               for name, v in ratios.items()}
    total = sum(stages.values())
    split = {k: v / total for k, v in stages.items()}
    benchmark.extra_info.update(interleaved={"rates": rates, "ratios": summary,
                                             "pil": PIL_FLAVOUR,
                                             "stages": split, "rounds": workload.rounds,
                                             "images": workload.n,
                                             "us_per_image": total / calls * 1e6})
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    print(f"\n{workload.n} images x {workload.rounds} interleaved rounds; PIL is {PIL_FLAVOUR}")
    for name, rate in rates.items():
        print(f"  {name:15s} {rate['best']:7,.0f} img/s best, {rate['median']:7,.0f} median")
    for name, v in summary.items():
        print(f"  {name:25s} median {v['median']:.3f}  best {v['best']:.3f}  "
              f"worst {v['worst']:.3f}")
    print("  fused stages: " + ", ".join(f"{k} {v:.1%}" for k, v in split.items()))


@pytest.mark.benchmark(group="kernel-canvas")
def test_canvas_budgets(benchmark, workload, out_buffer):
    """What a fresh example costs echoing before augmentation: the canvas (whole image,
    shrunk to ``Echo(canvas_max_pixels=...)``) against the crop the other placements
    decode, per budget, interleaved as above; ratios of rates, paired by round."""
    dec = _kernel.Decoder()
    side = max(workload.size)
    budgets = {"2x": 2 * side * side, "3x": 3 * side * side, "4x": 4 * side * side,
               "unbounded": 2**63}
    canvas = np.empty(4 * side * side * 3, np.uint8)
    big = max(s.height * s.width * 3 for s in workload.samples)
    unbounded = np.empty(big, np.uint8)

    def canvas_pass(budget):
        out = unbounded if budget > 4 * side * side else canvas
        for s in workload.samples:
            dec.decode_canvas(s.data, side, budget, out)

    passes = {"crop": lambda: fused_crop_pass(dec, workload, out_buffer)}
    passes.update({name: (lambda b=b: canvas_pass(b)) for name, b in budgets.items()})
    times = interleaved_times(passes, workload.rounds)
    ratios = {name: float(np.median([tc / tn for tc, tn in zip(times["crop"], times[name])]))
              for name in budgets}
    over = sum(s.height * s.width > budgets["2x"] for s in workload.samples) / workload.n
    benchmark.extra_info.update(canvas={"canvas_over_crop": ratios, "over_default": over})
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    print(f"\ncanvas rate / crop rate ({over:.0%} of the images exceed the default budget): "
          + ", ".join(f"{name} {v:.2f}" for name, v in ratios.items()))

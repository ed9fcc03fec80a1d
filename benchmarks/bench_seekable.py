"""Seekable JPEGs (echo_native.seekable): RandomResizedCrop 224 past libjpeg-turbo's ROI
ceiling, and what the restart interval costs in bytes.

Every pass is one pass over the same preloaded corpus (benchmarks/conftest.py's workload:
the same boxes and flips as bench_kernel.py), so the figures compare as ratios::

    python -m pytest benchmarks/bench_seekable.py -q -s
    ECHO_NATIVE_BENCH_WALLPAPERS=40 python -m pytest benchmarks/bench_seekable.py -q -s \\
        -k hires   # multi-megapixel photographs (Debian's wallpaper packages)

Roles (``extra_info["role"]``):

ceiling         libjpeg-turbo ROI decode alone, in C, of the crop at its DCT scale, on the
                ORIGINAL files (bench_kernel.py's ceiling: the fastest correct ROI decode)
fused           today's kernel (``Decoder.decode_crop``) on the original files
seek_<k>        the kernel on seekable files with a restart marker every k MCUs
                (``seek_row``: every MCU row; ``seek_64px``, ``seek_128px``: every 64 or
                128 pixels of width, the latter the default), through the seekable path
                (the crop's MCUs assembled into a sub-image, then decoded): same boxes,
                same pixels
seekable        the default interval (``seekable.DEFAULT``), timed alone

The curve (``test_restart_curve``) reports, per interval, the bytes against the
originals (index included) and the rate against the ceiling, interleaved round by round
(a slow spell of a shared machine hits every pass alike; ratios are paired by round).
``test_transcode_rate`` reports the transcoder's rate on one core.
"""
from __future__ import annotations

import glob
import os
import time

import numpy as np
import pytest

import echo_native as en
from benchenv import env_int
from echo_native import _kernel, _seek, seekable
from echo_native.lab import _bench

INTERVALS = {"seek_1": 1, "seek_2": 2, "seek_4": 4, "seek_8": 8, "seek_row": seekable.ROW,
             "seek_64px": "64px", "seek_128px": seekable.DEFAULT}
SIZE = (224, 224)
WALLPAPER_DIRS = ("/usr/share/wallpapers", "/usr/share/backgrounds")


def _converted(datas, restart):
    if isinstance(restart, str):  # segments this many pixels wide
        px = int(restart[:-2])
        out = []
        for d in datas:
            try:
                out.append(_seek.transcode(d, 1, px)[0])
            except en.DecodeError:
                out.append(d)
        return out
    return [seekable.make_seekable(d, restart)[0] for d in datas]


def _passes(samples, converted, out):
    """name -> one pass over the corpus; samples: (data, box, flip, denom)."""
    kern, seeker = _kernel.Decoder(), _seek.Seeker()

    def ceiling():
        roi = _bench.roi_decode
        for data, (top, left, h, w), _, denom in samples:
            roi(data, top, left, h, w, denom)

    def fused():
        for data, box, flip, _ in samples:
            kern.decode_crop(data, box, SIZE, flip, out)

    def seek(files):
        def run():
            for f, (_, box, flip, _) in zip(files, samples):
                seeker.decode_crop(f, box, SIZE, flip, out)
        return run

    passes = {"ceiling": ceiling, "fused": fused}
    passes.update({name: seek(files) for name, files in converted.items()})
    return passes, seeker


def interleaved(passes, rounds):
    """(wall, cpu) seconds per pass per round, the order rotated each round, one warm-up
    each.  The CPU time of this thread (time.thread_time) is what a pass cost whatever
    else the machine ran meanwhile: on a loaded shared machine the wall-time ratios
    wander from round to round, the CPU-time ones much less."""
    names = list(passes)
    for fn in passes.values():
        fn()
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t0, c0 = time.perf_counter(), time.thread_time()
            passes[n]()
            cpu[n].append(time.thread_time() - c0)
            wall[n].append(time.perf_counter() - t0)
    return wall, cpu


def _report(benchmark, title, samples, originals, converted, times):
    n = len(samples)
    orig_bytes = sum(map(len, originals))
    wall, cpu = times
    rows = {}
    for name, t in wall.items():
        ratio = [tc / tx for tc, tx in zip(wall["ceiling"], t)]
        cratio = [tc / tx for tc, tx in zip(cpu["ceiling"], cpu[name])]
        row = {"rate_median": n / float(np.median(t)), "rate_best": n / min(t),
               "over_ceiling_median": float(np.median(ratio)), "over_ceiling_best": max(ratio),
               "cpu_rate_median": n / float(np.median(cpu[name])),
               "cpu_over_ceiling_median": float(np.median(cratio))}
        if name in converted:
            row["bytes"] = sum(map(len, converted[name])) / orig_bytes - 1
        rows[name] = row
    benchmark.extra_info.update(curve=rows, images=n, title=title)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    print(f"\n{title}: {n} images, {len(wall['ceiling'])} interleaved rounds "
          f"(x ceiling: median of paired rounds, by wall time and by this thread's CPU time)")
    print(f"  {'pass':10s} {'img/s':>8s} {'x ceiling':>10s} {'(best)':>7s} {'cpu img/s':>10s} "
          f"{'x ceiling':>10s} {'bytes':>8s}")
    for name, r in rows.items():
        b = f"{r['bytes']:+.2%}" if "bytes" in r else ""
        print(f"  {name:10s} {r['rate_median']:8,.0f} {r['over_ceiling_median']:10.3f} "
              f"{r['over_ceiling_best']:7.3f} {r['cpu_rate_median']:10,.0f} "
              f"{r['cpu_over_ceiling_median']:10.3f} {b:>8s}")
    return rows


def _samples(datas):
    out = []
    for sid, data in enumerate(datas):
        h, w = en.image_size(data)
        box, flip = en.random_resized_crop_params(1234, 0, sid, 0, h, w)
        out.append((data, box, flip, en.pick_scale(box, SIZE)))
    return out


def _check_same_pixels(samples, converted, out):
    """Not timed: the seekable pass gives the kernel's pixels, crop for crop."""
    kern, seeker = _kernel.Decoder(), _seek.Seeker()
    other = np.empty_like(out)
    for files in converted.values():
        for f, (data, box, flip, _) in list(zip(files, samples))[::7]:
            kern.decode_crop(data, box, SIZE, flip, out)
            seeker.decode_crop(f, box, SIZE, flip, other)
            assert np.array_equal(out, other)


@pytest.mark.benchmark(group="seekable")
def test_restart_curve(benchmark, workload, out_buffer):
    """Bytes against speed for a restart marker every 1, 2, 4, 8 MCUs and every row."""
    datas = [s.data for s in workload.samples]
    samples = _samples(datas)
    converted = {name: _converted(datas, k) for name, k in INTERVALS.items()}
    _check_same_pixels(samples, converted, out_buffer)
    passes, seeker = _passes(samples, converted, out_buffer)
    times = interleaved(passes, workload.rounds)
    _report(benchmark, "ImageNet-sized corpus", samples, datas, converted, times)
    print("  seekable path:", seeker.stats())


@pytest.mark.benchmark(group="seekable")
def test_seekable(benchmark, workload, out_buffer):
    """The default interval alone, in pytest-benchmark's own timing."""
    datas = [s.data for s in workload.samples]
    samples = _samples(datas)
    files = _converted(datas, seekable.DEFAULT)
    passes, _ = _passes(samples, {"seekable": files}, out_buffer)
    workload.run(benchmark, passes["seekable"], role="seekable",
                 label=f"seekable files, restart every {seekable.DEFAULT_RESTART_PX} px")


@pytest.mark.benchmark(group="seekable")
def test_transcode_rate(benchmark, workload):
    """Transcoding (read coefficients, write baseline + restart markers, index), one core."""
    datas = [s.data for s in workload.samples]
    mp = sum(np.prod(en.image_size(d)) for d in datas) / 1e6

    def run():
        for d in datas:
            seekable.make_seekable(d)

    workload.run(benchmark, run, role="transcode", label="transcode, one core")
    t = benchmark.stats.stats.median
    benchmark.extra_info.update(images_per_s=len(datas) / t, mpix_per_s=mp / t)
    print(f"\ntranscode: {len(datas) / t:,.0f} images/s, {mp / t:,.1f} MP/s on one core")


def _wallpapers(limit):
    """The largest JPEG of each wallpaper (a package ships each at several sizes), of
    at least 2 MP."""
    best = {}
    for d in WALLPAPER_DIRS:
        for path in glob.glob(os.path.join(d, "**", "*.jp*g"), recursive=True):
            with open(path, "rb") as f:
                data = f.read()
            try:
                h, w = en.image_size(data)
            except en.DecodeError:
                continue
            name = os.path.relpath(path, d).split(os.sep)[0]
            if h * w >= 2_000_000 and h * w > best.get(name, (0, b""))[0]:
                best[name] = (h * w, data)
    return [best[k][1] for k in sorted(best)][:limit]


@pytest.mark.benchmark(group="seekable")
@pytest.mark.parametrize("coding", ["baseline", "progressive"])
def test_hires_curve(benchmark, out_buffer, coding):
    """Multi-megapixel photographs: Debian's plasma-workspace-wallpapers (or
    gnome-backgrounds' JPEGs), every one of at least 2 MP, up to
    ECHO_NATIVE_BENCH_WALLPAPERS (default 40); baseline and progressive originals apart
    (a progressive original has no ROI decode to speak of: every scan is read whole)."""
    datas = _wallpapers(env_int("ECHO_NATIVE_BENCH_WALLPAPERS", 40))
    if not datas:
        pytest.skip("no JPEG wallpapers of 2 MP or more under /usr/share/wallpapers or "
                    "/usr/share/backgrounds: apt-get install plasma-workspace-wallpapers")
    kern = _kernel.Decoder()
    datas = [d for d in datas if bool(kern.info(d)[3]) == (coding == "progressive")]
    if not datas:
        pytest.skip(f"no {coding} wallpapers of 2 MP or more")
    samples = _samples(datas)
    converted = {name: _converted(datas, k) for name, k in INTERVALS.items()}
    _check_same_pixels(samples, converted, out_buffer)
    passes, seeker = _passes(samples, converted, out_buffer)
    times = interleaved(passes, env_int("ECHO_NATIVE_BENCH_ROUNDS", 5))
    mp = float(np.mean([np.prod(en.image_size(d)) for d in datas])) / 1e6
    _report(benchmark, f"{coding} wallpapers ({mp:.1f} MP mean)", samples, datas, converted, times)
    print("  seekable path:", seeker.stats())

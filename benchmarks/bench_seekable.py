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

``test_loader_gain`` (does the kernel's gain reach the consumer?): the corpus written to
tar shards twice, plain and seekable (``write_shards(..., seekable=True)``), read by a
``Loader`` with 2 process workers each (RandomResizedCrop 224 + flip, batches of
ECHO_NATIVE_BENCH_BATCH, default 64, ~6 passes over the shards a round, null consumer),
interleaved round by round with one thread running the kernel alone on the same bytes
and the same kind of crops (the Loader's seed and keys): ``kernel_plain``
(``_kernel.Decoder``) and ``kernel_seek`` (``_seek.Seeker``).  Reported: the delivered
img/s of each, loader seek/plain, kernel seek/plain, and their quotient (the share of the
kernel's gain carried through; target >= 0.9), by wall time (medians of paired rounds,
and each pass's fastest round) and by CPU time (the workers' processes for the Loader,
the thread's for the kernel).

``test_progressive_per_mp`` (progressive originals after transcoding): the seekable
kernel's RandomResizedCrop rate in megapixels of original per second on the wallpapers
transcoded from progressive originals against those transcoded from baseline ones, and
against the progressive photographs' own baseline twins (each re-encoded by Pillow from
its pixels with its own tables and sampling: the same content and density), interleaved,
with the kernel on the originals for comparison.  It checks that each twin pair
(baseline and progressive files of the same coefficients) transcodes to the same bytes.
"""
from __future__ import annotations

import glob
import io
import os
import time

import numpy as np
import pytest

import echo_native as en
from benchenv import env_int, workers_cpu_seconds
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


# ---- the Loader: is the kernel's gain carried through? ---------------------------------------
LOADER_WORKERS = 2
LOADER_SEED = 1234
SCALE, RATIO, FLIP_P = (0.08, 1.0), (3.0 / 4.0, 4.0 / 3.0), 0.5


@pytest.fixture(scope="module")
def shard_pair(folder, tmp_path_factory):
    """The benchmark corpus written to tar shards twice, plain and seekable, same order."""
    out = {}
    for name, seek in (("plain", False), ("seekable", True)):
        d = tmp_path_factory.mktemp(f"shards_{name}")
        paths = en.write_shards(folder, d, shard_size="16MB", seekable=seek, progress=False)
        out[name] = en.TarShards(list(paths))
    assert len(out["plain"]) == len(out["seekable"]) == len(folder)
    return out


class _LoaderStream:
    """A Loader kept alive for the test: idle between its rounds (a full ring, sleeping
    workers), drained of what it read ahead meanwhile before each timed round."""

    def __init__(self, src, batch):
        self.L = en.Loader(src, batch_size=batch, image_size=SIZE[0], workers=LOADER_WORKERS,
                           worker_mode="process", seed=LOADER_SEED, drop_last=True,
                           timeout=120)
        self.L.start()
        self.batch = batch
        for _ in range(3 * self.L.slots):       # warm-up: workers started, pages cached
            self.L.next_batch()

    def settle(self, timeout=30.0):
        """Until the ring is full (every slot but the held one published)."""
        deadline = time.monotonic() + timeout
        full = (self.L.slots - 1) / self.L.slots - 1e-9
        while self.L.stats()["ring_occupancy"] < full and time.monotonic() < deadline:
            time.sleep(0.005)

    def timed(self, batches):
        """(wall s, the workers' CPU s) of ``batches`` whole batches after a drain."""
        for _ in range(self.L.slots):
            self.L.next_batch()
        c0, t0 = workers_cpu_seconds(), time.perf_counter()
        images = 0
        for _ in range(batches):
            images += len(self.L.next_batch())
        wall, cpu = time.perf_counter() - t0, workers_cpu_seconds() - c0
        assert images == batches * self.batch
        return wall, cpu

    def close(self):
        self.L.close()


@pytest.mark.benchmark(group="seekable")
def test_loader_gain(benchmark, workload, shard_pair, out_buffer):
    """Loader with 2 workers on seekable shards against the same shards plain, beside the
    kernel alone (one thread) on the same bytes and crops, interleaved round by round."""
    batch = env_int("ECHO_NATIVE_BENCH_BATCH", 64)
    n = len(shard_pair["plain"])
    batches = max(16, 6 * n // batch)            # ~6 passes over the shards a round
    datas = {k: [src.read(i) for i in range(n)] for k, src in shard_pair.items()}
    assert sum(map(seekable.is_seekable, datas["seekable"])) >= 0.9 * n
    assert not any(map(seekable.is_seekable, datas["plain"]))
    kern, seeker = _kernel.Decoder(), _seek.Seeker()
    epoch = [0]
    epochs = -(-batches * batch // n)             # as many images a round as the Loader

    def kernel_pass(dec, files):
        def run():
            for e in range(epoch[0] * epochs, (epoch[0] + 1) * epochs):
                for sid, data in enumerate(files):
                    dec.decode_random_crop(data, SIZE, LOADER_SEED, e, sid, 0, SCALE, RATIO,
                                           FLIP_P, out_buffer)
        return run

    # Not timed: the two shard sets give the same pixels for the Loader's crops (epoch 0).
    other = np.empty_like(out_buffer)
    for sid in range(0, n, 7):
        a = kern.decode_random_crop(datas["plain"][sid], SIZE, LOADER_SEED, 0, sid, 0, SCALE,
                                    RATIO, FLIP_P, out_buffer)
        b = seeker.decode_random_crop(datas["seekable"][sid], SIZE, LOADER_SEED, 0, sid, 0,
                                      SCALE, RATIO, FLIP_P, other)
        assert a == b and np.array_equal(out_buffer, other)

    streams = {"loader_plain": _LoaderStream(shard_pair["plain"], batch),
               "loader_seek": _LoaderStream(shard_pair["seekable"], batch)}
    kernels = {"kernel_plain": kernel_pass(kern, datas["plain"]),
               "kernel_seek": kernel_pass(seeker, datas["seekable"])}
    names = ["kernel_plain", "kernel_seek", "loader_plain", "loader_seek"]
    rounds = workload.rounds
    # (wall s, CPU s, images) per pass per round
    times = {k: [] for k in names}
    try:
        for fn in kernels.values():
            fn()
        for r in range(rounds):
            epoch[0] = r
            for name in names[r % 4:] + names[:r % 4]:
                for s in streams.values():
                    s.settle()               # nothing else decodes during the timed pass
                if name in kernels:
                    t0, c0 = time.perf_counter(), time.thread_time()
                    kernels[name]()
                    times[name].append((time.perf_counter() - t0, time.thread_time() - c0,
                                        n * epochs))
                else:
                    wall, cpu = streams[name].timed(batches)
                    times[name].append((wall, cpu, batches * batch))
    finally:
        for s in streams.values():
            s.close()

    def rates(name, i):
        return [t[2] / t[i] for t in times[name]]

    out = {}
    for label, i in (("wall", 0), ("cpu", 1)):
        loader = [s / p for s, p in zip(rates("loader_seek", i), rates("loader_plain", i))]
        kernel = [s / p for s, p in zip(rates("kernel_seek", i), rates("kernel_plain", i))]
        carried = [lo / k for lo, k in zip(loader, kernel)]
        out[label] = {"rates": {k: float(np.median(rates(k, i))) for k in names},
                      "loader_seek_over_plain": float(np.median(loader)),
                      "kernel_seek_over_plain": float(np.median(kernel)),
                      "carried": float(np.median(carried)),
                      "carried_rounds": [round(c, 3) for c in carried]}
    # The best round of each pass: other load on a shared machine only ever slows a
    # round down, so the fastest rounds are the least disturbed ones.
    best = {k: max(rates(k, 0)) for k in names}
    lb, kb = best["loader_seek"] / best["loader_plain"], best["kernel_seek"] / best["kernel_plain"]
    out["best"] = {"rates": best, "loader_seek_over_plain": lb, "kernel_seek_over_plain": kb,
                   "carried": lb / kb}
    benchmark.extra_info.update(role="loader_gain", images=n, workers=LOADER_WORKERS,
                                batch_size=batch, rounds=rounds, target_carried=0.9, **out)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    print(f"\nLoader ({LOADER_WORKERS} process workers, batch {batch}, {batches} batches a "
          f"round) on tar shards of {n} images, plain vs seekable, {rounds} interleaved "
          f"rounds")
    print(f"  {'by':5s} {'loader plain':>12s} {'loader seek':>12s} {'kernel plain':>12s} "
          f"{'kernel seek':>12s} {'loader x':>9s} {'kernel x':>9s} {'carried':>8s}")
    for label, o in out.items():
        r = o["rates"]
        print(f"  {label:5s} {r['loader_plain']:12,.0f} {r['loader_seek']:12,.0f} "
              f"{r['kernel_plain']:12,.0f} {r['kernel_seek']:12,.0f} "
              f"{o['loader_seek_over_plain']:9.3f} {o['kernel_seek_over_plain']:9.3f} "
              f"{o['carried']:8.3f}")
    print("  (img/s; 'wall', 'cpu': medians, 'cpu' in images per CPU second of the Loader's "
          "workers, of the kernel's thread, ratios paired by round; 'best': each pass's "
          "fastest round by wall time; carried = loader x / kernel x, target >= 0.9)")
    print("  carried per round (wall):", out["wall"]["carried_rounds"])


# ---- progressive originals after transcoding ---------------------------------------------------
def _sampling(data):
    """'4:4:4', '4:2:0', ... or 'grey', from a seekable file's index."""
    info = seekable.index_info(data)
    if info["components"] == 1:
        return "grey"
    return {(8, 8): "4:4:4", (8, 16): "4:2:2", (16, 16): "4:2:0",
            (16, 8): "4:4:0"}.get(tuple(info["mcu"]), "other")


def _twins(data):
    """The photograph ``data`` re-encoded by Pillow from its pixels, baseline and
    progressive, with its own quantisation tables and sampling (``quality="keep"``): two
    files of the same coefficients, the same content and density as ``data``."""
    from PIL import Image

    out = []
    for progressive in (False, True):
        with Image.open(io.BytesIO(data)) as im:
            buf = io.BytesIO()
            im.save(buf, "JPEG", quality="keep", progressive=progressive)
        out.append(buf.getvalue())
    return out


@pytest.mark.benchmark(group="seekable")
def test_progressive_per_mp(benchmark, out_buffer):
    """Seekable-kernel RandomResizedCrop 224, megapixels of original per second, on the
    wallpapers transcoded from progressive originals against baseline originals, in the
    same run (interleaved, paired by round): against every baseline wallpaper, and
    against each progressive photograph's own baseline twin (the same content, tables and
    sampling)."""
    datas = _wallpapers(env_int("ECHO_NATIVE_BENCH_WALLPAPERS", 40))
    if not datas:
        pytest.skip("no JPEG wallpapers of 2 MP or more under /usr/share/wallpapers or "
                    "/usr/share/backgrounds: apt-get install plasma-workspace-wallpapers")
    kern = _kernel.Decoder()
    by = {c: [d for d in datas if bool(kern.info(d)[3]) == (c == "progressive")]
          for c in ("baseline", "progressive")}
    if not by["baseline"] or not by["progressive"]:
        pytest.skip("the wallpapers need baseline and progressive JPEGs of 2 MP or more: "
                    f"found {len(by['baseline'])} and {len(by['progressive'])}")
    # Twins: a progressive file and a baseline one of the same coefficients transcode to
    # the same bytes, so the coding itself cannot change the rate after transcoding.
    twins = [_twins(d) for d in by["progressive"]]
    for base, prog in twins:
        assert bool(kern.info(prog)[3]) and not kern.info(base)[3]
        assert seekable.transcode(base).data == seekable.transcode(prog).data
    by["twin"] = [base for base, _ in twins]
    conv = {c: _converted(ds, seekable.DEFAULT) for c, ds in by.items()}
    assert all(map(seekable.is_seekable, conv["progressive"]))
    samples = {c: _samples(ds) for c, ds in by.items()}
    for c in by:
        _check_same_pixels(samples[c], {"seek": conv[c]}, out_buffer)
    seeker = _seek.Seeker()
    sets = {"orig_baseline": (by["baseline"], samples["baseline"], kern),
            "orig_progressive": (by["progressive"], samples["progressive"], kern),
            "seek_baseline": (conv["baseline"], samples["baseline"], seeker),
            "seek_progressive": (conv["progressive"], samples["progressive"], seeker),
            "seek_twin": (conv["twin"], samples["twin"], seeker)}
    mp = {name: sum(float(np.prod(en.image_size(f))) for f in files) / 1e6
          for name, (files, _, _) in sets.items()}
    mb = {name: sum(map(len, files)) / 1e6 for name, (files, _, _) in sets.items()}

    def run(files, smp, dec):
        def go():
            for f, (_, box, flip, _) in zip(files, smp):
                dec.decode_crop(f, box, SIZE, flip, out_buffer)
        return go

    passes = {name: run(*spec) for name, spec in sets.items()}
    rounds = env_int("ECHO_NATIVE_BENCH_ROUNDS", 5)
    wall, cpu = interleaved(passes, rounds)
    rows = {name: {"images": len(sets[name][0]), "mp_mean": mp[name] / len(sets[name][0]),
                   "bits_per_pixel": 8 * mb[name] / mp[name],
                   "mp_per_s": mp[name] / float(np.median(wall[name])),
                   "cpu_mp_per_s": mp[name] / float(np.median(cpu[name])),
                   "cpu_mb_per_s": mb[name] / float(np.median(cpu[name]))}
            for name in passes}

    def paired(a, b, times, per):
        return float(np.median([(per[a] / ta) / (per[b] / tb)
                                for ta, tb in zip(times[a], times[b])]))

    ratios = {}
    for label, a, b in (("originals, kernel", "orig_progressive", "orig_baseline"),
                        ("transcoded, every baseline", "seek_progressive", "seek_baseline"),
                        ("transcoded, baseline twins", "seek_progressive", "seek_twin")):
        ratios[label] = {"per_mp_wall": paired(a, b, wall, mp),
                         "per_mp_cpu": paired(a, b, cpu, mp),
                         "per_byte_cpu": paired(a, b, cpu, mb)}
    benchmark.extra_info.update(role="progressive_per_mp", rows=rows, ratios=ratios,
                                twins_identical=len(twins), rounds=rounds, target=1.0)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    print(f"\nRandomResizedCrop 224 per megapixel of original, progressive vs baseline "
          f"wallpapers, {rounds} interleaved rounds, medians")
    print(f"  {'pass':17s} {'files':>5s} {'MP mean':>8s} {'bits/px':>8s} {'MP/s':>8s} "
          f"{'cpu MP/s':>9s} {'cpu MB/s':>9s}  sampling")
    for name, r in rows.items():
        smp = [_sampling(f) for f in conv[name.split("_")[1]]]
        smp = ", ".join(f"{k} {smp.count(k)}" for k in sorted(set(smp)))
        print(f"  {name:17s} {r['images']:5d} {r['mp_mean']:8.1f} {r['bits_per_pixel']:8.2f} "
              f"{r['mp_per_s']:8.1f} {r['cpu_mp_per_s']:9.1f} {r['cpu_mb_per_s']:9.1f}  {smp}")
    print("  progressive / baseline (target: 1.0 per MP after transcoding):")
    for label, r in ratios.items():
        print(f"    {label:27s} per MP {r['per_mp_wall']:.3f} (wall) {r['per_mp_cpu']:.3f} (cpu); "
              f"per coded byte {r['per_byte_cpu']:.3f} (cpu)")
    print(f"  twins: {len(twins)} baseline/progressive pairs of the same coefficients (each "
          f"progressive wallpaper re-encoded from its pixels, its own tables) transcode to "
          f"the same bytes")

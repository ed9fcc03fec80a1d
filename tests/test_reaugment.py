"""Re-augmentation on the CPU across threads, the native store and draws, and auto echo's
capacity model.

- ``_kernel.Reaugmenter`` (a pool of native threads sharing a batch's rows) and
  ``CpuDevice`` on it: the same bytes for 1, 2 and 4 threads, equal to the
  single-thread path (``Decoder.resize_batch`` then ``apply_ops``); gathers too;
  errors name the row or entry and never leave the pool stuck.
- ``_kernel.store_rows`` (a batch of canvases into the echo buffer in one call):
  the bytes of the per-example copy it replaces.
- ``_kernel.draw_ops`` (the per-example ops' parameters for a batch in one call):
  pure functions of the key, with torchvision's distributions, compared with a
  sampler written here from torchvision's definitions over NumPy's generator
  (fixed seeds, generous bounds).
- The colour ops' vector code gives the bytes of the scalar build
  (``ECHO_NATIVE_SIMD=none``).
- Auto echo's capacity: on scripted rates, e is capped at headroom x t_up / t_echo
  with the reason "capacity", and never set where the model delivers fewer
  examples per second than at e = 1; the echo stage reports its time per emission.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import echo_native as en
from echo_native import _kernel
from echo_native._kernel import Op as op
from echo_native.augment import Program
from echo_native.backends.array import ArrayDevice
from echo_native.backends.cpu import CpuDevice
from echo_native.echo.auto import AutoEcho
from echo_native.echo.images import ImageStore

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import echo_helpers as eh  # noqa: E402
from test_echo_stages import ScriptedUpstream, epoch_of, make  # noqa: E402
from test_ops_kernels import random_programs  # noqa: E402

THREADS = (1, 2, 4)


# ---- canvases -------------------------------------------------------------------------------
def canvases(rng, count, max_side=60):
    """An ImageStore of ``count`` canvases of varied sizes cut from real photographs."""
    import skimage.data

    photo = skimage.data.astronaut()
    store = ImageStore(count, max_side * max_side * 3)
    for e in range(count):
        h, w = (int(v) for v in rng.integers(12, max_side + 1, 2))
        y, x = int(rng.integers(0, 512 - h)), int(rng.integers(0, 512 - w))
        store.pixels[e, :h * w * 3] = photo[y:y + h, x:x + w].reshape(-1)
        store.shape[e] = (h, w)
    return store


def boxes_for(rng, store, entries):
    """A valid crop box on each entry's canvas, fractional like a drawn one."""
    out = np.empty((len(entries), 4))
    for i, e in enumerate(entries):
        h, w = store.shape[e]
        bh, bw = rng.uniform(2, h), rng.uniform(2, w)
        out[i] = rng.uniform(0, h - bh), rng.uniform(0, w - bw), bh, bw
    return out


def reference(store, entries, boxes, flips, size, codes=None, args=None):
    """The single-thread path: the batched resampler, then the programs."""
    out = np.empty((len(entries), *size, 3), np.uint8)
    _kernel.Decoder().resize_batch(store.pixels, np.asarray(entries, np.int64), store.shape,
                                   boxes, np.asarray(flips, np.uint8), out)
    if codes is not None:
        _kernel.apply_ops(out, codes, args)
    return out


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(5)
    store = canvases(rng, 24)
    entries = rng.integers(0, 24, 37)
    boxes = boxes_for(rng, store, entries)
    flips = rng.random(37) < 0.5
    codes, args = random_programs(rng, 37, 5, 20, 28)
    return store, entries, boxes, flips, codes, args


# ---- the pool ---------------------------------------------------------------------------------
@pytest.mark.parametrize("threads", THREADS)
def test_pool_makes_the_single_thread_paths_bytes(batch, threads):
    """Reaugmenter.run with 1, 2 or 4 threads gives the bytes of the batched resampler
    followed by apply_ops, row for row, with and without programs."""
    store, entries, boxes, flips, codes, args = batch
    pool = _kernel.Reaugmenter(threads)
    assert pool.threads == threads
    for c, a in ((codes, args), (None, None)):
        want = reference(store, entries, boxes, flips, (20, 28), c, a)
        for _ in range(3):  # the pool is reused batch after batch
            got = np.zeros_like(want)
            pool.run(store.pixels, np.asarray(entries, np.int64), store.shape, boxes,
                     flips.astype(np.uint8), got, c, a)
            np.testing.assert_array_equal(got, want)


def test_cpu_device_batches_are_the_same_for_any_thread_count(batch):
    """CpuDevice.reaugment (the echo stage's call) with 1, 2 and 4 threads: identical
    batches, equal to the single-thread path; the job reports its time."""
    store, entries, boxes, flips, codes, args = batch
    want = reference(store, entries, boxes, flips, (20, 28), codes, args)
    for threads in THREADS:
        dev = CpuDevice(threads)
        try:
            assert dev.threads == threads
            out = np.zeros_like(want)
            job = dev.reaugment(store, entries, boxes, flips, out, codes, args)
            dev.synchronize(job)
            np.testing.assert_array_equal(out, want)
            assert dev.job_seconds(job) > 0
        finally:
            dev.release_buffers()


@pytest.mark.parametrize("threads", THREADS)
def test_pool_gather_is_gather_rows(threads):
    """Reaugmenter.gather: the bytes of gather_rows, mirrored rows included."""
    rng = np.random.default_rng(8)
    pixels = rng.integers(0, 256, (9, 7 * 5 * 3 + 4), dtype=np.uint8)
    entries = rng.integers(0, 9, 23).astype(np.int64)
    mirror = (rng.random(23) < 0.5).astype(np.uint8)
    for m in (mirror, None):
        want = _kernel.gather_rows(pixels, entries, np.empty((23, 7, 5, 3), np.uint8), m)
        got = _kernel.Reaugmenter(threads).gather(pixels, entries,
                                                  np.zeros((23, 7, 5, 3), np.uint8), m)
        np.testing.assert_array_equal(got, want)


def test_pool_apply_is_apply_ops(batch):
    """Reaugmenter.apply: the programs of apply_ops, the rows shared out."""
    rng = np.random.default_rng(9)
    images = rng.integers(0, 256, (37, 20, 28, 3), dtype=np.uint8)
    _, _, _, _, codes, args = batch
    want = _kernel.apply_ops(images.copy(), codes, args)
    for threads in THREADS:
        got = _kernel.Reaugmenter(threads).apply(images.copy(), codes, args)
        np.testing.assert_array_equal(got, want)


def test_pool_errors_name_the_row_and_the_pool_goes_on(batch):
    """A bad entry, a box outside its canvas, a lone codes array, a bad program and a
    thread count below 1 are refused with what is wrong; after a failed row the pool
    makes the next batch as before."""
    store, entries, boxes, flips, codes, args = batch
    pool = _kernel.Reaugmenter(2)
    e64 = np.asarray(entries, np.int64)
    out = np.zeros((len(entries), 20, 28, 3), np.uint8)
    bad = e64.copy()
    bad[3] = 24
    with pytest.raises(IndexError, match="entry 24 is outside the 24 rows"):
        pool.run(store.pixels, bad, store.shape, boxes, flips.astype(np.uint8), out)
    outside = boxes.copy()
    outside[[5, 9], 2] = 1000.0
    with pytest.raises(ValueError, match=r"row 5: box .* is not inside"):
        pool.run(store.pixels, e64, store.shape, outside, flips.astype(np.uint8), out)
    with pytest.raises(ValueError, match="codes and args come together"):
        pool.run(store.pixels, e64, store.shape, boxes, flips.astype(np.uint8), out, codes)
    nan = args.copy()
    nan[2, 1, 0] = math.nan
    wrong = codes.copy()
    wrong[2, 1] = op.BRIGHTNESS
    with pytest.raises(ValueError, match="row 2, step 1"):
        pool.run(store.pixels, e64, store.shape, boxes, flips.astype(np.uint8), out, wrong,
                 nan)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        _kernel.Reaugmenter(0)
    with pytest.raises(ValueError, match="threads must be a positive integer"):
        en.Echo(2, threads=0)
    pool.run(store.pixels, e64, store.shape, boxes, flips.astype(np.uint8), out, codes, args)
    np.testing.assert_array_equal(out, reference(store, entries, boxes, flips, (20, 28),
                                                 codes, args))


@pytest.mark.parametrize("placement", ["before_augment", "after_augment"])
def test_echo_ring_emissions_are_the_same_for_1_2_and_4_threads(placement):
    """An EchoRing with rich ops, Echo(threads=1, 2, 4): the same emissions (ids, echo
    indices, boxes, flips and pixels) in the same order."""
    data = (eh.photo_jpegs(24, 40, 56, seed=7), np.arange(24) % 3)
    augment = [en.RandomResizedCrop(20), en.ColorJitter(0.4, 0.4, 0.4, 0.1),
               en.RandomGrayscale(0.3), en.TrivialAugmentWide(), en.RandomErasing(p=0.5)]
    runs = []
    for threads in THREADS:
        with en.EchoRing(eh.samples_of(data), batch_size=8, augment=augment, workers=2,
                         seed=3, timeout=60,
                         echo=en.Echo(2.5, placement=placement, threads=threads)) as ring:
            assert ring.device.threads == threads
            runs.append(eh.collect(ring, epochs=2))
    for other in runs[1:]:
        for a_epoch, b_epoch in zip(runs[0], other):
            assert len(a_epoch) == len(b_epoch)
            for a, b in zip(a_epoch, b_epoch):
                for key in ("ids", "echo", "boxes", "flips", "images"):
                    np.testing.assert_array_equal(a[key], b[key])


def test_cpu_threads_default_to_the_affinity_mask():
    """Echo(threads=None) sizes the pool from os.sched_getaffinity; a number overrides it."""
    assert CpuDevice().threads == len(os.sched_getaffinity(0))
    dev = CpuDevice()
    dev.use_threads(3)
    assert dev.threads == 3
    dev.use_threads(None)
    assert dev.threads == len(os.sched_getaffinity(0))


# ---- storing a batch of canvases ----------------------------------------------------------------
def test_store_rows_is_the_per_example_copy():
    """store_rows copies each canvas's h * w * 3 bytes into its entry's row and nothing
    else: the bytes of the per-example loop it replaces, on CpuDevice.store too."""
    rng = np.random.default_rng(4)

    class Slot:
        pass

    slot = Slot()
    n, cap = 11, 3000
    slot.pixels = rng.integers(0, 256, (16, cap), dtype=np.uint8)
    slot.shapes = rng.integers(1, 31, (16, 2)).astype(np.int32)
    entries = rng.permutation(20)[:n]
    want = ImageStore(20, cap)
    want.pixels[...] = 7
    for i, e in enumerate(entries):  # the per-example copy
        k = int(slot.shapes[i, 0]) * int(slot.shapes[i, 1]) * 3
        want.pixels[e, :k] = slot.pixels[i, :k]
    for store in (ArrayDevice(np).store, CpuDevice().store):
        got = ImageStore(20, cap)
        got.pixels[...] = 7
        store(got, entries, slot, n, False)
        np.testing.assert_array_equal(got.pixels, want.pixels)
    with pytest.raises(ValueError, match="do not fit"):
        _kernel.store_rows(got.pixels, np.array([0], np.int64), slot.pixels,
                           np.array([cap + 1], np.int64))
    with pytest.raises(IndexError, match="entry 20 is outside"):
        _kernel.store_rows(got.pixels, np.array([20], np.int64), slot.pixels,
                           np.array([3], np.int64))


# ---- the native draws -----------------------------------------------------------------------
N = 6000


def ks_distance(a, b):
    """The two-sample Kolmogorov-Smirnov statistic of samples a and b."""
    a, b = np.sort(np.asarray(a, float)), np.sort(np.asarray(b, float))
    grid = np.concatenate([a, b])
    return np.abs(np.searchsorted(a, grid, "right") / len(a) -
                  np.searchsorted(b, grid, "right") / len(b)).max()


def assert_same_distribution(ours, ref, what):
    """Two samples from one continuous distribution: the KS distance stays below its
    critical value at a significance of 1e-6 (the seeds are fixed: a failure is a real
    difference in distribution, not bad luck)."""
    n, m = len(ours), len(ref)
    bound = math.sqrt(-0.5 * math.log(1e-6 / 2)) * math.sqrt((n + m) / (n * m))
    d = ks_distance(ours, ref)
    assert d < bound, f"{what}: KS distance {d:.4f} >= {bound:.4f}"


def erasing_reference(rng, n, h, w, p, scale, ratio):
    """torchvision's RandomErasing.get_params, written here from its definition, over
    NumPy's generator: (erased, top, left, height, width) per image."""
    out = []
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(n):
        if rng.random() >= p:
            out.append((0, 0, 0, 0, 0))
            continue
        for _ in range(10):
            area = h * w * rng.uniform(*scale)
            aspect = math.exp(rng.uniform(*log_ratio))
            eh, ew = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
            if eh < h and ew < w:
                out.append((1, rng.integers(0, h - eh + 1), rng.integers(0, w - ew + 1),
                            eh, ew))
                break
        else:
            out.append((0, 0, 0, 0, 0))
    return np.array(out, float)


def test_random_erasing_draws_have_torchvisions_distribution():
    """Erased share, box sides and corner positions of the native draws against
    torchvision's procedure sampled here, on a small image where many tries fail."""
    h, w = 20, 36
    spec = en.RandomErasing(p=0.6, scale=(0.05, 0.5), ratio=(0.3, 3.3))
    codes, args = Program([spec], (h, w)).draw(11, 0, np.arange(N), 0)
    ours = np.where((codes[:, 0] == op.ERASE)[:, None],
                    np.c_[np.ones(N), args[:, 0, :4]], 0.0)
    ref = erasing_reference(np.random.default_rng(1), N, h, w, 0.6, (0.05, 0.5), (0.3, 3.3))
    share = ours[:, 0].mean(), ref[:, 0].mean()
    assert abs(share[0] - share[1]) < 5 * math.sqrt(0.25 * 2 / N), share
    for k, name in ((1, "top"), (2, "left"), (3, "height"), (4, "width")):
        assert_same_distribution(ours[ours[:, 0] == 1, k], ref[ref[:, 0] == 1, k], name)
    assert ((ours[:, 3] < h) & (ours[:, 4] < w)).all()
    assert ((ours[:, 1] + ours[:, 3] <= h) & (ours[:, 2] + ours[:, 4] <= w)).all()


def test_color_jitter_draws_have_torchvisions_distribution():
    """Each factor uniform on its range (KS against uniform draws), the adjustments in
    the 24 orders of randperm(4) equally often, independent of the factors."""
    spec = en.ColorJitter(0.4, (0.2, 1.7), 0.6, 0.2)
    codes, args = Program([spec], (8, 8)).draw(2, 5, np.arange(N), 3)
    rng = np.random.default_rng(2)
    for code, (lo, hi) in ((op.BRIGHTNESS, (0.6, 1.4)), (op.CONTRAST, (0.2, 1.7)),
                           (op.SATURATION, (0.4, 1.6)), (op.HUE, (-0.2, 0.2))):
        v = args[..., 0][codes == code]
        assert len(v) == N
        assert_same_distribution(v, rng.uniform(lo, hi, N), op(code).name)
        # the factor does not depend on where the adjustment came in the order
        first = args[:, 0, 0][codes[:, 0] == code]
        assert_same_distribution(first, v, f"{op(code).name} when first")
    orders = np.unique(codes, axis=0, return_counts=True)[1]
    assert len(orders) == 24
    sd = math.sqrt(N * (1 / 24) * (23 / 24))
    assert np.abs(orders - N / 24).max() < 5 * sd, orders


def test_trivial_augment_and_grayscale_draws_are_uniform_over_their_choices():
    """TrivialAugmentWide: each of the 14 ops and each magnitude bin about equally often,
    the sign of the signed ops a fair coin; RandomGrayscale: its probability."""
    spec = en.TrivialAugmentWide(num_magnitude_bins=5)
    codes, args = Program([spec], (30, 30)).draw(4, 1, np.arange(N), 0)
    c, a = codes[:, 0], args[:, 0]
    # bits 8 - round(bin / (4 / 6)), rounded half to even as torch.round: bins 0 .. 4 give
    # 8 - (0, 2, 3, 4, 6)
    posterize = a[c == op.POSTERIZE, 0]
    values, counts = np.unique(posterize, return_counts=True)
    assert values.tolist() == [2, 4, 5, 6, 8]
    k = len(posterize)
    assert np.abs(counts - k / 5).max() < 5 * math.sqrt(k * 0.16), counts
    enh = np.isin(c, (op.BRIGHTNESS, op.SATURATION, op.CONTRAST, op.SHARPNESS))
    factors = a[enh, 0]
    assert abs((factors < 1).mean() - (factors > 1).mean()) < 5 * math.sqrt(1 / len(factors))
    assert abs(np.mean(factors == 1) - 1 / 5) < 5 * math.sqrt(0.16 / len(factors))
    share = {code: np.mean(c == code) for code in (op.NONE, op.BRIGHTNESS, op.SATURATION,
                                                   op.CONTRAST, op.SHARPNESS, op.POSTERIZE,
                                                   op.SOLARIZE, op.AUTOCONTRAST, op.EQUALIZE)}
    sd = math.sqrt((1 / 14) * (13 / 14) / N)
    assert all(abs(s - 1 / 14) < 5 * sd for s in share.values()), share
    assert abs(np.mean(c == op.AFFINE) - 5 / 14) < 5 * math.sqrt((5 / 14) * (9 / 14) / N)
    gray = Program([en.RandomGrayscale(0.3)], (4, 4)).draw(4, 1, np.arange(N), 0)[0]
    assert abs(np.mean(gray == op.GRAYSCALE) - 0.3) < 5 * math.sqrt(0.21 / N)


def test_draws_are_pure_functions_of_the_key():
    """A row's program depends on (seed, epoch, sample id, echo index) alone: the same
    in any batch, order or size, drawn one by one or all at once; any part of the key
    changes it."""
    ops = [en.ColorJitter(0.4, 0.4, 0.4, 0.1), en.RandomGrayscale(0.5), en.TrivialAugmentWide(),
           en.RandomErasing(p=0.5)]
    prog = Program(ops, (24, 24))
    ids = np.arange(200) * 7919
    echo = np.arange(200) % 4
    codes, args = prog.draw(9, 3, ids, echo)
    perm = np.random.default_rng(0).permutation(200)
    c2, a2 = prog.draw(9, 3, ids[perm], echo[perm])
    np.testing.assert_array_equal(c2, codes[perm])
    np.testing.assert_array_equal(a2, args[perm])
    for i in (0, 57, 199):
        c1, a1 = prog.draw(9, 3, ids[i:i + 1], echo[i])
        np.testing.assert_array_equal(c1[0], codes[i])
        np.testing.assert_array_equal(a1[0], args[i])
    for changed in (prog.draw(10, 3, ids, echo), prog.draw(9, 4, ids, echo),
                    prog.draw(9, 3, ids + 1, echo), prog.draw(9, 3, ids, echo + 1)):
        assert (changed[1] != args).any(axis=(1, 2)).mean() > 0.9


# ---- the vector code of the colour ops --------------------------------------------------------
SIMD_SCRIPT = """
import hashlib, numpy as np
from echo_native import _kernel
from echo_native._kernel import Op as op
rng = np.random.default_rng(12)
images = rng.integers(0, 256, (20, 17, 23, 3), dtype=np.uint8)
images[:4] = images[:4, :, :, :1]  # grey pixels
codes = np.array([[op.HUE, op.SATURATION, op.GRAYSCALE, op.CONTRAST]] * 20, np.int32)
codes[::3] = codes[::3, ::-1]
args = np.zeros((20, 4, _kernel.OP_ARGS), np.float32)
args[..., 0] = rng.uniform(0.0, 2.0, (20, 4))
args[:, :, 0] = np.where(codes == op.HUE, rng.uniform(-0.5, 0.5, (20, 4)), args[..., 0])
args[5, :, 0] = np.where(codes[5] == op.HUE, 0.5, args[5, :, 0])
print(hashlib.sha256(_kernel.apply_ops(images, codes, args).tobytes()).hexdigest())
"""


def test_vector_colour_ops_are_the_scalar_builds_bytes():
    """Hue, saturation, grayscale and contrast on vector registers (AVX2 where the CPU
    has it) and on the baseline build (ECHO_NATIVE_SIMD=none) give the same bytes."""
    digests = []
    for simd in ("", "none"):
        env = {**os.environ, "ECHO_NATIVE_SIMD": simd}
        r = subprocess.run([sys.executable, "-c", SIMD_SCRIPT], env=env, capture_output=True,
                           text=True, timeout=120, check=False)
        assert r.returncode == 0, r.stderr
        digests.append(r.stdout.strip())
    assert digests[0] == digests[1]


# ---- auto echo's capacity ----------------------------------------------------------------------
class ScriptedRates(AutoEcho):
    """AutoEcho on scripted rates: the upstream takes ``up_s`` per fresh batch, the
    consumer ``down_s`` and the echo stage ``echo_s`` per emitted batch, whatever the
    stage measured (what it measured is kept)."""

    def __init__(self, up_s, down_s, echo_s, **kw):
        super().__init__(8.0, **kw)
        self.up_s, self.down_s, self.echo_s = up_s, down_s, echo_s
        self.measured_echo = []

    def upstream(self, seconds):
        super().upstream(self.up_s)

    def consumer(self, seconds):
        super().consumer(self.down_s)

    def emission(self, seconds):
        self.measured_echo.append(seconds)
        super().emission(self.echo_s)


def delivered(e, up_s, down_s, echo_s):
    """Batches per second the model delivers at e."""
    return min(e / up_s, 1 / down_s, 1 / echo_s)


@pytest.mark.parametrize("up_s, down_s, echo_s, want, reason", [
    (0.3, 0.1, 0.2, 1.1 * 1.5, "capacity"),   # the stage caps e below the rates' 3.3
    (0.3, 0.1, 0.4, 1.0, "capacity"),         # slower than the upstream: no echo
    (0.3, 0.1, 0.01, 3.3, "rates"),           # ample capacity: the rates decide
    (0.3, 0.2, 0.1, 1.65, "rates"),           # the consumer binds before the stage
])
def test_auto_echo_is_capped_by_the_echo_stages_capacity(up_s, down_s, echo_s, want, reason):
    """On scripted rates an example-echo stage settles at exactly min(1.1 R,
    1.1 t_up / t_echo) (at least 1), and the trace names the cap that decided it."""
    auto = ScriptedRates(up_s, down_s, echo_s)
    # fill_s > 0: the upstream reports its work per batch, as the ring's workers do.
    stage = make("example", ScriptedUpstream(n=160, B=8, fill_s=up_s), auto=auto, capacity=32)
    epoch_of(stage)
    epoch_of(stage)
    assert stage.e == pytest.approx(want)
    assert auto.trace[-1]["reason"] == reason
    assert auto.trace[-1]["capacity"] == pytest.approx(up_s / echo_s)
    stats = stage.stats()
    assert stats["echo_trace"][-1]["reason"] == reason
    # the model never delivers fewer batches per second at the chosen e than at e = 1
    assert delivered(stage.e, up_s, down_s, echo_s) >= delivered(1.0, up_s, down_s, echo_s)


def test_auto_echo_never_chooses_an_e_that_delivers_less_than_one():
    """Over a grid of scripted rates the e chosen delivers, in the model, at least what
    e = 1 delivers, and within the headroom of the best e up to max_echo."""
    for up_s in (0.05, 0.2, 0.6):
        for down_s in (0.01, 0.1, 0.3):
            for echo_s in (0.005, 0.08, 0.25, 0.9):
                auto = ScriptedRates(up_s, down_s, echo_s)
                for _ in range(AutoEcho.WINDOW):
                    auto.emission(0.0)
                    auto.upstream(0.0)
                    auto.consumer(0.0)
                e = auto.value
                best = max(delivered(x, up_s, down_s, echo_s) for x in np.linspace(1, 8, 141))
                got = delivered(e, up_s, down_s, echo_s)
                assert got >= delivered(1.0, up_s, down_s, echo_s), (up_s, down_s, echo_s, e)
                assert got >= best / AutoEcho.HEADROOM - 1e-9, (up_s, down_s, echo_s, e)


class TimedDevice(ArrayDevice):
    """A host device whose every job took the device 0.25 s (it says so)."""

    prepares_ahead = True
    times_jobs = True

    def job_seconds(self, job):
        return 0.25


def test_the_echo_stage_reports_its_own_time_per_emission():
    """Each emitted batch handed over is reported to auto echo once, as the time of the
    call that started it plus the device's own time for it."""
    auto = ScriptedRates(0.3, 0.1, 0.01)
    stage = make("example", ScriptedUpstream(n=40, B=8), auto=auto, capacity=16,
                 device=TimedDevice(np))
    batches = epoch_of(stage)
    assert len(auto.measured_echo) == len(batches)
    assert all(s >= 0.25 for s in auto.measured_echo)
    auto = ScriptedRates(0.3, 0.1, 0.01)
    stage = make("example", ScriptedUpstream(n=40, B=8), auto=auto, capacity=16)
    assert len(auto.measured_echo) == 0
    batches = epoch_of(stage)
    assert len(auto.measured_echo) == len(batches)
    assert all(0 < s < 0.25 for s in auto.measured_echo)  # no device time, only the call's


@pytest.mark.parametrize("gather", ["gather_rows", "pool"])
def test_a_gather_that_does_not_fit_is_refused_before_any_copy(gather):
    """Both gathers (one call, the thread pool) refuse rows too short for the output, a
    mirror mask of another length and an entry outside the rows, naming them."""
    pool = _kernel.Reaugmenter(2)
    run = _kernel.gather_rows if gather == "gather_rows" else pool.gather
    pixels = np.zeros((4, 2 * 3 * 3), np.uint8)
    with pytest.raises(ValueError, match="do not fit out"):
        run(pixels, np.array([0], np.int64), np.zeros((1, 3, 3, 3), np.uint8))
    with pytest.raises(ValueError, match="need 1 mirror flags"):
        run(pixels, np.array([0], np.int64), np.zeros((1, 2, 3, 3), np.uint8),
            np.zeros(2, np.uint8))
    with pytest.raises(IndexError, match="entry 4 is outside the 4 rows"):
        run(pixels, np.array([4], np.int64), np.zeros((1, 2, 3, 3), np.uint8))

"""The data-echoing stage and the EchoRing API (CPU backend).

What is checked, against references computed here (never against numbers
copied from the implementation):

- statistics of the emission stream: each sample fresh once per epoch and
  emitted e times (exactly for integer e, in expectation for fractional e), no
  duplicate inside a batch unless fewer than a batch of distinct examples is
  left, repeats spread over several batches, more so with a bigger buffer;
- placement semantics: before-augmentation echoes are new crops of the source
  (checked against ``decode_crop`` / ``resize_crop``), after-augmentation echoes
  are byte copies (or exact flips), batch echo repeats whole batches;
- determinism over worker counts and worker modes; echo=1 is the bare Loader,
  without a copy; DLPack hand-off to NumPy and PyTorch without a copy;
- auto echo follows the ratio of upstream to consumer speed;
- argument errors, memory over epochs and shared-memory cleanup.
"""
from __future__ import annotations

import math
import os
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import echo_native as en

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import echo_helpers as eh  # noqa: E402

EXAMPLE_PLACEMENTS = ("before_augment", "after_augment")
PLACEMENTS = EXAMPLE_PLACEMENTS + ("batch",)


def _cuda_usable():
    """CuPy imports and sees a CUDA device (then "auto" picks CUDA: not this file's job)."""
    try:
        import cupy
        return bool(cupy.is_available())
    except Exception:
        return False


# ---- corpora (real photographs, small so that a test takes well under a second) ----
@pytest.fixture(scope="module")
def small():
    """64 JPEGs of 48x64 with 5 labels."""
    blobs = eh.photo_jpegs(64, 48, 64, seed=1)
    return blobs, np.arange(64) % 5


@pytest.fixture(scope="module")
def large():
    """400 JPEGs of 32x40 (for statistics over many examples)."""
    blobs = eh.photo_jpegs(400, 32, 40, seed=2)
    return blobs, np.arange(400) % 7


def _src(data):
    return en.Samples(*data)


def _ring(data, **kw):
    kw.setdefault("batch_size", 8)
    kw.setdefault("image_size", 24)
    kw.setdefault("workers", 2)
    kw.setdefault("seed", 0)
    kw.setdefault("timeout", 60)
    return en.EchoRing(_src(data), **kw)


def _flat(batches, key):
    return np.concatenate([b[key] for b in batches])


# ---- statistics -------------------------------------------------------------------------
@pytest.mark.parametrize("placement", EXAMPLE_PLACEMENTS)
@pytest.mark.parametrize("e", [2, 3])
def test_integer_echo_emits_each_sample_e_times(small, placement, e):
    """Integer e: per epoch each sample is fresh once and emitted exactly e times (index 0..e-1)."""
    n = len(small[0])
    with _ring(small, echo=e, placement=placement) as ring:
        epochs = eh.collect(ring, epochs=2, copy_images=False)
        stats = ring.stats()
    for k, batches in enumerate(epochs):
        assert len(batches) == batches[0]["announced"] == math.ceil(n * e / 8)
        assert all(b["epoch"] == k for b in batches)
        ids, echo, fresh = _flat(batches, "ids"), _flat(batches, "echo"), _flat(batches, "fresh")
        assert Counter(ids.tolist()) == {i: e for i in range(n)}
        assert sorted(ids[fresh].tolist()) == list(range(n)), "each sample fresh exactly once"
        assert np.array_equal(fresh, echo == 0)
        for sid, em in eh.emissions(batches).items():
            assert [x for _, _, x in em] == list(range(e)), f"sample {sid}: echo order"
        labels = _flat(batches, "labels")
        assert np.array_equal(labels, small[1][ids])
    assert stats["fresh"] == 2 * n and stats["delivered"] == 2 * n * e
    assert stats["effective_echo"] == pytest.approx(e)
    assert stats["echo_factor"] == e


@pytest.mark.parametrize("placement", EXAMPLE_PLACEMENTS)
def test_fractional_echo_mean_within_tolerance(large, placement):
    """e=2.5, 400 samples: 2 or 3 emissions each, mean 2.5 +- 4 binomial SDs, redrawn per epoch."""
    n, e = len(large[0]), 2.5
    with _ring(large, echo=e, placement=placement, batch_size=16, image_size=16) as ring:
        epochs = eh.collect(ring, epochs=2, copy_images=False)
    extra = []
    for batches in epochs:
        ids = _flat(batches, "ids")
        counts = np.bincount(ids, minlength=n)
        assert set(counts.tolist()) <= {2, 3}
        sd = math.sqrt(0.25 / n)
        assert abs(counts.mean() - e) <= 4 * sd, counts.mean()
        fresh = _flat(batches, "fresh")
        assert np.array_equal(np.sort(ids[fresh]), np.arange(n))
        assert len(batches) == batches[0]["announced"] == math.ceil(counts.sum() / 16)
        extra.append(set(np.flatnonzero(counts == 3).tolist()))
    assert extra[0] != extra[1], "the same samples got the extra emission in both epochs"


def test_fractional_batch_echo_counts(large):
    """Batch echo, e=2.5: each fresh batch is delivered 2 or 3 times, about half of them 3 times."""
    n = len(large[0])
    with _ring(large, echo=2.5, placement="batch", batch_size=4, image_size=16) as ring:
        batches = eh.collect(ring, copy_images=False)[0]
    assert len(batches) == batches[0]["announced"]
    fresh_ids = _flat(batches, "ids")[_flat(batches, "fresh")]
    assert np.array_equal(np.sort(fresh_ids), np.arange(n))
    reps = Counter(tuple(b["ids"].tolist()) for b in batches)
    assert len(reps) == n // 4
    assert set(reps.values()) <= {2, 3}
    share3 = sum(v == 3 for v in reps.values()) / len(reps)
    assert abs(share3 - 0.5) <= 4 * math.sqrt(0.25 / len(reps)), share3


def test_duplicates_in_batch_only_when_unavoidable(large):
    """Any shuffle_buffer: a batch has duplicates only when < B distinct examples remain."""
    B, e = 16, 3
    rates = {}
    for mult in (2, 4, 8, 16):
        with _ring(large, echo=e, placement="after_augment", batch_size=B, image_size=8,
                   shuffle_buffer=mult * B, seed=7) as ring:
            batches = eh.collect(ring, copy_images=False)[0]
        dups = 0
        for j, b in enumerate(batches):
            d = len(b["ids"]) - len(set(b["ids"].tolist()))
            if d:
                left = set(_flat(batches[j:], "ids").tolist())
                assert len(left) < B, (f"buffer {mult}xB: batch {j} of {len(batches)} has {d} "
                                       f"duplicates while {len(left)} distinct examples remain")
            dups += d
        assert dups <= (B - 1) * (e - 1), (mult, dups)
        rates[mult] = dups / sum(len(b["ids"]) for b in batches)
    print("in-batch duplicate rate by shuffle_buffer / batch_size:", rates)


def test_repeat_gaps_are_spread_and_grow_with_buffer(large):
    """Repeat gaps vary, skip the adjacent batch, grow with the buffer (~ shuffle_buffer / B)."""
    B, e = 16, 2
    means = []
    for mult in (2, 4, 8, 16):
        with _ring(large, echo=e, placement="after_augment", batch_size=B, image_size=8,
                   shuffle_buffer=mult * B, seed=11) as ring:
            batches = eh.collect(ring, copy_images=False)[0]
        gaps = eh.repeat_gaps(batches)
        assert len(gaps) == len(large[0]) * (e - 1)
        if mult > 2:  # a 2-batch buffer simply alternates its two halves
            assert len(set(gaps.tolist())) > 2, f"buffer {mult}xB: {Counter(gaps.tolist())}"
        assert 0.4 * mult <= gaps.mean() <= 1.5 * mult, (mult, gaps.mean())
        # Examples of the previous batch sit one out: adjacent repeats only in the
        # epoch's tail, when fewer than two batches' worth of examples remain.
        assert np.mean(gaps <= 1) <= 0.05, (mult, Counter(gaps.tolist()))
        means.append(gaps.mean())
    assert means == sorted(means), f"mean gap does not grow with the buffer: {means}"


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("e", [1, 2.5])
def test_len_matches_delivery(small, placement, drop_last, e):
    """len(ring) is the number of batches an epoch delivers; drop_last=True: only full ones."""
    data = (small[0][:60], small[1][:60])
    with _ring(data, echo=e, placement=placement, drop_last=drop_last,
               image_size=16) as ring:
        for batches in eh.collect(ring, epochs=2, copy_images=False):
            sizes = [len(b["ids"]) for b in batches]
            assert len(sizes) == batches[0]["announced"]
            if drop_last:
                assert min(sizes) == 8, sizes
            else:
                assert sum(sizes) >= 60 and max(sizes) == 8 and min(sizes) >= 1


# ---- placement semantics ----------------------------------------------------------------
def _source_hw(blob):
    return en.image_size(blob)


def test_before_augment_echoes_are_new_crops_of_the_source(small):
    """before_augment: each emission is its own crop of the source, equal to decode_crop of its box.

    Full-resolution canvas (canvas_side = the shorter side): the tight reference resizes the
    full decode with the same resampler (mean <= 0.1, max <= 2: boxes are reported as
    float32); decode_crop may decode at DCT scale 1/2 for large boxes, hence mean <= 3.
    """
    blobs, _ = small
    size, seed = 24, 5
    with _ring(small, echo=3, placement="before_augment", image_size=size, seed=seed,
               canvas_side=48) as ring:
        batches = eh.collect(ring)[0]
    full = {}
    for b in batches:
        for img, sid, box, flip, j in zip(b["images"], b["ids"], b["boxes"], b["flips"],
                                          b["echo"]):
            sid = int(sid)
            H, W = _source_hw(blobs[sid])
            want_box, want_flip = en.random_resized_crop_params(seed, 0, sid, int(j), H, W)
            assert np.allclose(box, want_box, atol=1e-3) and bool(flip) == bool(want_flip)
            if sid not in full:
                full[sid] = en.decode(blobs[sid])
            tight = en.resize_crop(full[sid], tuple(map(float, box)), (size, size), bool(flip))
            d = np.abs(tight.astype(np.int16) - img)
            assert d.mean() <= 0.1 and d.max() <= 2, (sid, j, d.mean(), d.max())
            ref = en.decode_crop(blobs[sid], tuple(map(float, box)), (size, size), bool(flip))
            assert np.abs(ref.astype(np.int16) - img).mean() <= 3.0, (sid, j)
    for sid, em in eh.emissions(batches).items():
        boxes = [tuple(batches[j]["boxes"][r]) for j, r, _ in em]
        assert len(set(boxes)) == len(boxes), f"sample {sid}: repeated crop {boxes}"
        pixels = [batches[j]["images"][r].tobytes() for j, r, _ in em]
        assert len(set(pixels)) == len(pixels), f"sample {sid}: identical echoes"


def test_before_augment_default_canvas(small):
    """before_augment, default canvas: each emission is its box resized from the DCT-reduced canvas.

    Exact reference: decode_canvas + resize_crop of box / scale.  Against decode_crop of the
    full image only mean <= 6: small crops are upsampled from a canvas whose shorter side
    is just image_size, where decode_crop decodes them at full resolution.
    """
    blobs, _ = small
    size = 24
    with _ring(small, echo=2, placement="before_augment", image_size=size, seed=3) as ring:
        batches = eh.collect(ring)[0]
    diffs = []
    for b in batches:
        for img, sid, box, flip in zip(b["images"], b["ids"], b["boxes"], b["flips"]):
            canvas, d = en.decode_canvas(blobs[int(sid)], size)
            assert d > 1, "these images should get a reduced canvas"
            want = en.resize_crop(canvas, _canvas_box(box, (d, d), canvas.shape), (size, size),
                                  bool(flip))
            dd = np.abs(want.astype(np.int16) - img)
            assert dd.mean() <= 0.1 and dd.max() <= 2, (int(sid), dd.mean(), dd.max())
            ref = en.decode_crop(blobs[int(sid)], tuple(map(float, box)), (size, size),
                                 bool(flip))
            diffs.append(np.abs(ref.astype(np.int16) - img).mean())
    assert np.mean(diffs) <= 6.0, np.mean(diffs)


def _canvas_box(box, scale, shape):
    """A box in original coordinates mapped onto a canvas reduced by ``scale`` (y, x)."""
    ch, cw = shape[:2]
    top, left = float(box[0]) / scale[0], float(box[1]) / scale[1]
    return (top, left, min(float(box[2]) / scale[0], ch - top),
            min(float(box[3]) / scale[1], cw - left))


def test_before_augment_boxes_in_original_coordinates_for_budget_canvases(images):
    """Canvases shrunk to the pixel budget (3:1 images) report boxes in original coordinates.

    The reference rebuilds the budget canvas (decode_canvas + uniform shrink to
    canvas_max_pixels) and resizes the box from it (mean <= 0.1, max <= 2).
    """
    wide = images.fit(images.photo("rocket"), 64, 192)
    tall = images.fit(images.photo("astronaut"), 180, 60)
    blobs = [images.pil_jpeg(wide, 92), images.pil_jpeg(tall, 92)] * 4
    size, seed = 16, 2
    budget = 2 * size * size
    with _ring((blobs, np.zeros(8)), batch_size=4, echo=3, placement="before_augment",
               image_size=size, seed=seed) as ring:
        batches = eh.collect(ring)[0]
    own_closer = total = 0
    for b in batches:
        for img, sid, box, flip, j in zip(b["images"], b["ids"], b["boxes"], b["flips"],
                                          b["echo"]):
            H, W = _source_hw(blobs[int(sid)])
            top, left, h, w = map(float, box)
            assert 0 <= top and 0 <= left and top + h <= H + 1e-3 and left + w <= W + 1e-3
            want_box, _ = en.random_resized_crop_params(seed, 0, int(sid), int(j), H, W)
            assert np.allclose(box, want_box, atol=1e-3)
            canvas, d = en.decode_canvas(blobs[int(sid)], size)
            ch, cw = canvas.shape[:2]
            assert ch * cw > budget, "the test wants canvases over the budget"
            t = math.sqrt(budget / (ch * cw))
            sh, sw = max(1, int(ch * t)), max(1, int(cw * t))
            shrunk = en.resize_crop(canvas, (0, 0, ch, cw), (sh, sw))
            scale = (ch / sh * d, cw / sw * d)
            want = en.resize_crop(shrunk, _canvas_box(box, scale, shrunk.shape), (size, size),
                                  bool(flip))
            dd = np.abs(want.astype(np.int16) - img)
            assert dd.mean() <= 0.1 and dd.max() <= 2, (int(sid), dd.mean(), dd.max())
            # The box is the one that was cut: decode_crop of this box is closer than
            # decode_crop of the mirrored box position.
            own = en.decode_crop(blobs[int(sid)], (top, left, h, w), (size, size), bool(flip))
            other = en.decode_crop(blobs[int(sid)], (H - top - h, W - left - w, h, w),
                                   (size, size), bool(flip))
            total += 1
            own_closer += (np.abs(own.astype(np.int16) - img).mean()
                           < np.abs(other.astype(np.int16) - img).mean())
    assert own_closer >= 0.75 * total, (own_closer, total)


def test_after_augment_echoes_are_identical_copies(small):
    """after_augment: the fresh emission is decode_crop of its box, every echo a byte copy of it."""
    blobs, _ = small
    size = 24
    with _ring(small, echo=3, placement="after_augment", image_size=size, seed=4) as ring:
        batches = eh.collect(ring)[0]
    for sid, em in eh.emissions(batches).items():
        first = batches[em[0][0]]
        r0 = em[0][1]
        assert em[0][2] == 0 and first["fresh"][r0]
        img0 = first["images"][r0]
        ref = en.decode_crop(blobs[sid], tuple(map(float, first["boxes"][r0])), (size, size),
                             bool(first["flips"][r0]))
        assert np.abs(ref.astype(np.int16) - img0).max() <= 1
        for j, r, _ in em[1:]:
            assert np.array_equal(batches[j]["images"][r], img0), f"sample {sid}"
            assert np.array_equal(batches[j]["boxes"][r], first["boxes"][r0])
            assert batches[j]["flips"][r] == first["flips"][r0]


def test_after_augment_echo_flip(small):
    """after_augment + echo_flip: each echo is the fresh image or its mirror, as flips says."""
    with _ring(small, echo=4, placement="after_augment", image_size=24, seed=6,
               echo_flip=True) as ring:
        batches = eh.collect(ring)[0]
    same = mirrored = 0
    for sid, em in eh.emissions(batches).items():
        j0, r0, _ = em[0]
        img0, flip0 = batches[j0]["images"][r0], bool(batches[j0]["flips"][r0])
        for j, r, _ in em[1:]:
            img, flip = batches[j]["images"][r], bool(batches[j]["flips"][r])
            if flip == flip0:
                assert np.array_equal(img, img0), f"sample {sid}: same flip, other pixels"
                same += 1
            else:
                assert np.array_equal(img, img0[:, ::-1]), f"sample {sid}: not a mirror"
                mirrored += 1
    total = same + mirrored
    assert total == 64 * 3
    assert 0.25 <= mirrored / total <= 0.75, (same, mirrored)


def test_batch_echo_repeats_whole_batches(small):
    """Batch echo: echo batches repeat a fresh batch exactly, e times, not all back to back."""
    e = 3
    with _ring(small, echo=e, placement="batch", image_size=24, seed=8) as ring:
        batches = eh.collect(ring)[0]
    fresh = {}
    for b in batches:
        assert len(set(b["echo"].tolist())) == 1, "one echo index per batch"
        key = tuple(b["ids"].tolist())
        if b["echo"][0] == 0:
            assert b["fresh"].all() and key not in fresh
            fresh[key] = b
        else:
            assert key in fresh, "an echo batch before its fresh batch"
            f = fresh[key]
            for k in ("labels", "images", "boxes", "flips"):
                assert np.array_equal(b[k], f[k]), k
            assert not b["fresh"].any()
    assert len(fresh) == 8
    seq = [tuple(b["ids"].tolist()) for b in batches]
    assert Counter(seq) == {k: e for k in fresh}
    assert sorted(np.concatenate([np.array(k) for k in fresh]).tolist()) == list(range(64))
    adjacent = sum(a == b for a, b in zip(seq, seq[1:]))
    assert adjacent < len(fresh) * (e - 1), "every repeat came back to back"


def test_echo_outputs_survive_the_next_batch(small):
    """An echoing ring's batch stays intact while the next one is produced (two output buffers)."""
    for placement in PLACEMENTS:
        with _ring(small, echo=2, placement=placement, image_size=16) as ring:
            it = iter(ring)
            prev = next(it)
            keep = prev.images.copy()
            for cur in it:
                assert np.array_equal(prev.images, keep), placement
                assert not np.shares_memory(prev.images, cur.images)
                prev, keep = cur, cur.images.copy()


# ---- determinism -----------------------------------------------------------------------
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_same_seed_same_batches_any_workers(small, placement):
    """Fixed e: same seed, same batches with 1/2 worker processes or threads; other seed differs."""
    def run(**kw):
        with _ring(small, echo=2.5, placement=placement, image_size=16, **kw) as ring:
            return [b for ep in eh.collect(ring, epochs=2) for b in ep]

    ref = run(workers=1, seed=3)
    for kw in ({"workers": 2}, {"workers": 2, "worker_mode": "thread"}):
        got = run(seed=3, **kw)
        assert len(got) == len(ref), kw
        for a, b in zip(ref, got):
            for k in ("ids", "echo", "fresh", "labels", "images", "boxes", "flips"):
                assert np.array_equal(a[k], b[k]), (kw, k)
    other = run(workers=2, seed=4)
    assert (len(other) != len(ref) or
            any(not np.array_equal(a["ids"], b["ids"]) for a, b in zip(ref, other)))


# ---- echo = 1 ---------------------------------------------------------------------------------
def test_echo_one_is_the_loader_without_a_copy(small):
    """echo=1 yields the bare Loader's batches; the images are the ring slot itself (no copy)."""
    src = _src(small)
    with en.Loader(src, 8, image_size=24, workers=2, seed=9) as loader:
        want = [b.copy() for _ in range(2) for b in loader]
    with en.EchoRing(src, batch_size=8, image_size=24, echo=1, workers=2, seed=9) as ring:
        got = []
        for _ in range(2):
            assert len(ring) == len(want) // 2
            for b in ring:
                slots = [s.pixels for s in ring.loader._ring.slots]
                hits = [i for i, s in enumerate(slots) if b.images.ctypes.data == s.ctypes.data]
                assert len(hits) == 1 and np.shares_memory(b.images, slots[hits[0]])
                assert b.fresh.all() and not b.echo_index.any()
                got.append(b.copy())
    assert len(got) == len(want)
    for a, b in zip(want, got):
        for k in ("sample_ids", "labels", "images", "boxes", "flips"):
            assert np.array_equal(getattr(a, k), getattr(b, k)), k
        assert a.epoch == b.epoch


# ---- interop -------------------------------------------------------------------------------------
@pytest.mark.parametrize("e", [1, 2])
def test_dlpack_shares_memory(small, e):
    """torch/numpy.from_dlpack of batch.images share its memory, for echo=1 and echo=2."""
    torch = pytest.importorskip("torch")
    with _ring(small, echo=e, placement="after_augment") as ring:
        for i, b in enumerate(ring):
            t = torch.from_dlpack(b.images)
            assert t.data_ptr() == b.images.ctypes.data
            assert tuple(t.shape) == b.images.shape and t.dtype == torch.uint8
            assert np.array_equal(t.numpy(), b.images)
            a = np.from_dlpack(b.images)
            assert a.ctypes.data == b.images.ctypes.data and np.shares_memory(a, b.images)
            lab = torch.from_dlpack(b.labels)
            assert lab.data_ptr() == b.labels.ctypes.data
            if i == 3:
                break


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("normalize", [True, ((0.5, 0.25, 0.75), (0.2, 0.3, 0.4))])
def test_normalize_matches_manual(small, layout, normalize):
    """normalize gives float32 (x / 255 - mean) / std in the asked layout; DLPack without copy."""
    torch = pytest.importorskip("torch")
    if normalize is True:
        mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    else:
        mean, std = normalize
    mean = np.asarray(mean, np.float64)
    std = np.asarray(std, np.float64)
    with _ring(small, echo=2, seed=12) as raw:
        want = [b["images"] for b in eh.collect(raw)[0]]
    with _ring(small, echo=2, seed=12, normalize=normalize, layout=layout) as ring:
        k = 0
        for b in ring:
            x = b.images
            assert x.dtype == np.float32
            ref = (want[k].astype(np.float64) / 255.0 - mean) / std
            if layout == "NCHW":
                ref = ref.transpose(0, 3, 1, 2)
            assert x.shape == ref.shape
            np.testing.assert_allclose(x, ref, atol=1e-5, rtol=1e-5)
            assert torch.from_dlpack(x).data_ptr() == x.ctypes.data
            k += 1
    assert k == len(want)


# ---- auto echo ------------------------------------------------------------------------------
def test_auto_echo_rises_when_upstream_is_slow(small):
    """Auto echo: upstream ~32x slower than the consumer makes e rise above 1.5 (<= max_echo)."""
    n = 48
    src = eh.SleepySource(small[0][:n], small[1][:n], delay=0.02)
    with en.EchoRing(src, batch_size=8, image_size=16, echo="auto", placement="after_augment",
                     workers=1, seed=0, timeout=60) as ring:
        epochs = eh.collect(ring, epochs=2, step=lambda b: time.sleep(0.005),
                            copy_images=False)
        s = ring.stats()
    for batches in epochs:
        fresh_ids = _flat(batches, "ids")[_flat(batches, "fresh")]
        assert np.array_equal(np.sort(fresh_ids), np.arange(n))
    assert 1.5 < s["echo_factor"] <= 4.0, s
    assert s["effective_echo"] > 1.5, s
    last = _flat(epochs[-1], "ids")
    assert len(last) / n > 1.5
    assert 4 < s["estimated_R"] < 500, s


def test_auto_echo_rises_for_batch_placement(small):
    """Auto echo with placement='batch': a ~32x slower upstream makes e rise above 1.5."""
    n = 48
    src = eh.SleepySource(small[0][:n], small[1][:n], delay=0.02)
    with en.EchoRing(src, batch_size=8, image_size=16, echo="auto", placement="batch",
                     workers=1, seed=0, timeout=60) as ring:
        epochs = eh.collect(ring, epochs=2, step=lambda b: time.sleep(0.005),
                            copy_images=False)
        s = ring.stats()
    assert s["echo_factor"] > 1.5 and len(_flat(epochs[-1], "ids")) / n > 1.5, s


def test_auto_echo_stays_near_one_when_upstream_is_fast(small):
    """Auto echo: upstream much faster than a 50 ms consumer keeps e and delivered/fresh <= 1.2."""
    src = _src(small)
    with en.EchoRing(src, batch_size=8, image_size=8, echo="auto", placement="before_augment",
                     workers=2, seed=0) as ring:
        eh.collect(ring, epochs=3, step=lambda b: time.sleep(0.05), copy_images=False)
        s = ring.stats()
    assert s["echo_factor"] <= 1.2, s
    assert s["effective_echo"] <= 1.2, s
    assert s["estimated_R"] < 1.0, s


def test_auto_echo_falls_back_when_consumer_slows(small):
    """Auto echo: e rises for a fast consumer, then falls to <= 1.2 once the consumer is slower."""
    n = 48
    src = eh.SleepySource(small[0][:n], small[1][:n], delay=0.005)
    with en.EchoRing(src, batch_size=8, image_size=16, echo="auto", placement="after_augment",
                     workers=1, seed=0, timeout=60) as ring:
        eh.collect(ring, epochs=1, step=lambda b: time.sleep(0.001), copy_images=False)
        high = ring.stats()["echo_factor"]
        assert high > 1.5, ring.stats()
        trace = []
        for _ in range(4):
            batches = eh.collect(ring, epochs=1, step=lambda b: time.sleep(0.08),
                                 copy_images=False)[0]
            trace.append((ring.stats()["echo_factor"], len(_flat(batches, "ids")) / n))
            if trace[-1][0] <= 1.2:
                break
    assert trace[-1][0] <= 1.2, (high, trace)
    assert trace[-1][0] < high


# ---- arguments -------------------------------------------------------------------------------
BAD_ARGS = [
    ({"echo": 0.5}, "echo"),
    ({"echo": 0}, "echo"),
    ({"echo": float("nan")}, "echo"),
    ({"echo": "fast"}, "echo"),
    ({"placement": "during_augment"}, "placement"),
    ({"batch_size": 65}, "batch_size"),
    ({"image_size": 0}, "image_size"),
    ({"image_size": -3}, "image_size"),
    ({"shuffle_buffer": 15}, "shuffle_buffer"),
    ({"normalize": "imagenet"}, "normalize"),
    ({"normalize": ((0.5, 0.5), (0.2, 0.2))}, "normalize"),
    ({"normalize": ((0.5,) * 3, (0.2, 0.0, 0.2))}, "normalize"),
    ({"layout": "HWC"}, "layout"),
    ({"echo": "auto", "max_echo": 0.5}, "max_echo"),
]


@pytest.mark.parametrize("kwargs,name", BAD_ARGS, ids=[f"{n}-{i}" for i, (_, n) in
                                                        enumerate(BAD_ARGS)])
def test_bad_arguments_raise_value_error(small, kwargs, name):
    """Wrong arguments raise ValueError at construction naming the argument, leaving no segment."""
    before = set(os.listdir("/dev/shm"))
    kw = {"batch_size": 8, "image_size": 16, **kwargs}
    with pytest.raises(ValueError, match=name):
        en.EchoRing(_src(small), **kw)
    assert not {f for f in set(os.listdir("/dev/shm")) - before
                if f.startswith(f"echo_native-{os.getpid()}-")}


def test_cuda_without_cuda_is_a_one_line_runtime_error(small):
    """device='cuda' without CUDA: one-line RuntimeError saying how to install it or to use cpu."""
    if _cuda_usable():
        pytest.skip("CUDA is usable here; the CUDA backend has its own tests")
    with pytest.raises(RuntimeError) as info:
        en.EchoRing(_src(small), batch_size=8, image_size=16, device="cuda")
    msg = str(info.value)
    assert "\n" not in msg
    assert "pip install" in msg or "cpu" in msg, msg
    with pytest.raises(ValueError, match="device"):
        en.EchoRing(_src(small), batch_size=8, image_size=16, device="tpu")


def test_auto_device_falls_back_to_cpu(small):
    """device='auto' without CUDA runs on the CPU backend and delivers NumPy batches."""
    if _cuda_usable():
        pytest.skip("CUDA is usable here: device='auto' picks it")
    with _ring(small, echo=2, device="auto", image_size=16) as ring:
        assert ring.device.name == "cpu"
        b = next(iter(ring))
        assert isinstance(b.images, np.ndarray) and b.images.shape == (8, 16, 16, 3)


# ---- memory and cleanup -------------------------------------------------------------------------
def test_memory_flat_over_epochs_and_segment_removed(small):
    """Six epochs: consumer RSS flat (< 8 MiB) after epoch 2; the /dev/shm segment goes on close."""
    ring = _ring(small, echo=2, placement="before_augment", image_size=160, batch_size=16)
    with ring:
        path = eh.shm_path(ring.loader.ring_name)
        assert os.path.exists(path)
        rss = []
        for _ in range(6):
            for b in ring:
                b.images.sum(dtype=np.int64)
            rss.append(eh.rss_bytes())
        epoch_bytes = 2 * 64 * 160 * 160 * 3
    assert not os.path.exists(path), "ring segment left in /dev/shm"
    growth = rss[-1] - rss[1]
    assert growth < 8 * 2**20, f"RSS grew {growth / 2**20:.1f} MiB over epochs 3-6: {rss}"
    assert 4 * epoch_bytes > 4 * 8 * 2**20


def test_segment_removed_when_the_consumer_raises(small):
    """An exception in the with-block stops the workers and removes the shared-memory segment."""
    with pytest.raises(KeyError):
        with _ring(small, echo=2, placement="before_augment") as ring:
            path = eh.shm_path(ring.loader.ring_name)
            for i, _ in enumerate(ring):
                if i == 2:
                    raise KeyError("consumer failed")
    assert not os.path.exists(path)
    assert ring.loader.worker_pids() == []

"""RandomResizedCrop's augmentation parameters: the Philox generator behind them and the
crop boxes and flips (``random_resized_crop_params``), checked against torchvision.

The reference for the crop distribution is a transcription of torchvision's
``RandomResizedCrop.get_params`` (ten tries of a uniform area fraction and a
log-uniform aspect ratio, rounded; a uniform position; then the centre crop
at the clamped ratio) driven by numpy's generator.  Distributions are compared
with two-sample Kolmogorov-Smirnov statistics at fixed seeds, so the test is
deterministic; the thresholds sit well above the sampling noise.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import echo_native as en
from echo_native._kernel import philox4x64

M64 = (1 << 64) - 1


# ---------------------------------------------------------------------------
# references


def torchvision_get_params(rng, height, width, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision.transforms.RandomResizedCrop.get_params, with numpy's generator."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect_ratio = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = int(rng.integers(0, height - h + 1))
            j = int(rng.integers(0, width - w + 1))
            return i, j, h, w
    return torchvision_fallback(height, width, ratio)


def torchvision_fallback(height, width, ratio=(3 / 4, 4 / 3)):
    """torchvision's fallback after ten failed tries: a centre crop at the clamped ratio."""
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w = width
        h = height
    return (height - h) // 2, (width - w) // 2, h, w


def clamped_fallback(height, width, ratio):
    """torchvision's fallback with each side at least one pixel.

    torchvision can round a side to 0 (e.g. a 1x1 image with ratio (0.5, 0.5))
    and then fails in resized_crop; the kernel clamps that side to 1 instead."""
    _, _, h, w = torchvision_fallback(height, width, ratio)
    h, w = max(h, 1), max(w, 1)
    return (height - h) // 2, (width - w) // 2, h, w


def numpy_philox(ctr, key):
    """One Philox4x64-10 block from numpy: numpy increments its counter before each block."""
    c = sum(int(w) << (64 * i) for i, w in enumerate(ctr))
    c = (c - 1) % (1 << 256)
    counter = np.array([(c >> (64 * i)) & M64 for i in range(4)], dtype=np.uint64)
    gen = np.random.Philox(counter=counter, key=np.array(key, dtype=np.uint64))
    return tuple(int(v) for v in gen.random_raw(4))


def ks_statistic(a, b):
    """Two-sample Kolmogorov-Smirnov statistic sup |F_a - F_b|."""
    a, b = np.sort(np.asarray(a, float)), np.sort(np.asarray(b, float))
    grid = np.concatenate([a, b])
    fa = np.searchsorted(a, grid, side="right") / len(a)
    fb = np.searchsorted(b, grid, side="right") / len(b)
    return float(np.abs(fa - fb).max())


def crop_stats(boxes, flips, height, width):
    boxes = np.asarray(boxes, float)
    top, left, h, w = boxes.T
    return {
        "area fraction": h * w / (height * width),
        "log aspect ratio": np.log(w / h),
        "relative top": (top + 0.5) / (height - h + 1),
        "relative left": (left + 0.5) / (width - w + 1),
        "flip": np.asarray(flips, float),
    }


# ---------------------------------------------------------------------------
# Philox


# Random123's published known-answer vectors for philox4x64-10 (kat_vectors).
KAT = [
    ((0, 0, 0, 0), (0, 0),
     (0x16554D9ECA36314C, 0xDB20FE9D672D0FDC, 0xD7E772CEE186176B, 0x7E68B68AEC7BA23B)),
    ((M64, M64, M64, M64), (M64, M64),
     (0x87B092C3013FE90B, 0x438C3C67BE8D0224, 0x9CC7D7C69CD777B6, 0xA09CAEBF594F0BA0)),
    ((0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0, 0x082EFA98EC4E6C89),
     (0x452821E638D01377, 0xBE5466CF34E90C6C),
     (0xA528F45403E61D95, 0x38C72DBD566E9788, 0xA5A1610E72FD18B5, 0x57BD43B5E52B7FE6)),
]


@pytest.mark.parametrize("ctr,key,expected", KAT)
def test_philox_known_answers(ctr, key, expected):
    """philox4x64 reproduces Random123's published known-answer vectors."""
    assert tuple(philox4x64(ctr, key)) == expected


def test_philox_matches_numpy():
    """philox4x64 equals numpy.random.Philox block for block, counter borrow included."""
    rng = np.random.default_rng(2024)
    cases = [((0, 5, 0, 0), (1, 2)), ((0, 0, 0, 1), (M64, 0)), ((1, 0, 0, 0), (0, M64))]
    for _ in range(200):
        ctr = tuple(int(v) for v in rng.integers(0, M64, size=4, dtype=np.uint64, endpoint=True))
        key = tuple(int(v) for v in rng.integers(0, M64, size=2, dtype=np.uint64, endpoint=True))
        cases.append((ctr, key))
    for ctr, key in cases:
        assert tuple(philox4x64(ctr, key)) == numpy_philox(ctr, key), (ctr, key)


def test_philox_avalanche():
    """Flipping one counter or key bit changes about half of the 256 output bits."""
    base_ctr, base_key = (12345, 678, 9, 10), (31337, 4242)
    base = philox4x64(base_ctr, base_key)
    changed = []
    for word in range(6):
        for bit in (0, 17, 63):
            ctr, key = list(base_ctr), list(base_key)
            if word < 4:
                ctr[word] ^= 1 << bit
            else:
                key[word - 4] ^= 1 << bit
            out = philox4x64(ctr, key)
            changed.append(sum(bin(a ^ b).count("1") for a, b in zip(base, out)))
    assert 100 < np.mean(changed) < 156 and min(changed) > 80


# ---------------------------------------------------------------------------
# RandomResizedCrop parameters: a pure function of the key


def test_params_deterministic_for_a_key():
    """The same (seed, epoch, sample_id, echo_index) and image size give the same crop/flip."""
    for key in [(0, 0, 0, 0), (7, 3, 123456, 2), (2**64 - 1, 2**63, 2**40, 9)]:
        first = en.random_resized_crop_params(*key, 480, 640)
        for _ in range(3):
            assert en.random_resized_crop_params(*key, 480, 640) == first


@pytest.mark.parametrize("field", ["seed", "epoch", "sample_id", "echo_index"])
def test_params_differ_across_each_key_field(field):
    """Changing any one key field gives a different crop (almost always) and fresh flips."""
    base = dict(seed=11, epoch=2, sample_id=1000, echo_index=1)
    boxes, flips = [], []
    for v in range(1, 301):
        key = dict(base, **{field: base[field] + v})
        box, flip = en.random_resized_crop_params(key["seed"], key["epoch"], key["sample_id"],
                                                  key["echo_index"], 480, 640)
        boxes.append(box)
        flips.append(flip)
    ref, _ = en.random_resized_crop_params(*base.values(), 480, 640)
    assert len(set(boxes)) >= 290, f"only {len(set(boxes))} distinct boxes over 300 keys"
    assert sum(b == ref for b in boxes) <= 3
    assert 100 < sum(flips) < 200


def test_key_fields_are_not_interchangeable():
    """Swapping two key fields' values gives another crop (fields are not mixed symmetrically)."""
    same = 0
    for a in range(1, 40):
        b = a + 17
        k1 = en.random_resized_crop_params(a, b, 5, 0, 500, 500)
        k2 = en.random_resized_crop_params(b, a, 5, 0, 500, 500)
        k3 = en.random_resized_crop_params(5, 0, a, b, 500, 500)
        k4 = en.random_resized_crop_params(5, 0, b, a, 500, 500)
        same += (k1 == k2) + (k3 == k4)
    assert same <= 2


def test_consecutive_samples_are_uncorrelated():
    """Area fractions of consecutive sample ids and echo indices show no correlation."""
    n = 4000
    a = np.array([en.random_resized_crop_params(3, 0, i, 0, 600, 600)[0] for i in range(n)])
    frac = a[:, 2] * a[:, 3] / 600**2
    assert abs(np.corrcoef(frac[:-1], frac[1:])[0, 1]) < 0.05
    e = np.array([en.random_resized_crop_params(3, 0, 77, i, 600, 600)[0] for i in range(n)])
    efrac = e[:, 2] * e[:, 3] / 600**2
    assert abs(np.corrcoef(efrac[:-1], efrac[1:])[0, 1]) < 0.05
    assert abs(np.corrcoef(frac, efrac)[0, 1]) < 0.05


def _possible(lo_val, hi_val, lo, hi):
    """Whether the closed interval [lo_val, hi_val] meets [lo, hi]."""
    return hi_val >= lo - 1e-9 and lo_val <= hi + 1e-9


@settings(max_examples=1500, deadline=None, database=None, derandomize=True)
@given(height=st.integers(1, 5000), width=st.integers(1, 5000),
       seed=st.integers(0, 2**64 - 1), epoch=st.integers(0, 1000),
       sample_id=st.integers(0, 2**40), echo=st.integers(0, 16),
       scale_lo=st.floats(0.01, 1.0), scale_span=st.floats(0.0, 1.0),
       ratio_lo=st.floats(0.1, 3.0), ratio_span=st.floats(1.0, 4.0))
def test_box_always_inside_and_consistent(height, width, seed, epoch, sample_id, echo,
                                          scale_lo, scale_span, ratio_lo, ratio_span):
    """Every box is integral, inside the image, and a valid draw or exactly the fallback."""
    scale = (scale_lo, scale_lo + (1 - scale_lo) * scale_span)
    ratio = (ratio_lo, ratio_lo * ratio_span)
    (top, left, h, w), flip = en.random_resized_crop_params(seed, epoch, sample_id, echo,
                                                            height, width, scale, ratio)
    assert all(isinstance(v, int) for v in (top, left, h, w)) and isinstance(flip, bool)
    assert 1 <= h <= height and 1 <= w <= width
    assert 0 <= top <= height - h and 0 <= left <= width - w
    if (top, left, h, w) == clamped_fallback(height, width, ratio):
        return
    # A draw: the rounded sides come from an area fraction and ratio inside the ranges.
    area = height * width
    assert _possible((w - 0.5) * (h - 0.5) / area, (w + 0.5) * (h + 0.5) / area, *scale)
    assert _possible((w - 0.5) / (h + 0.5), (w + 0.5) / max(h - 0.5, 1e-9), *ratio)


@pytest.mark.parametrize("height,width", [(2000, 3), (3, 2000), (1, 1), (10000, 7), (5, 900)])
def test_extreme_aspect_falls_back_to_torchvision_centre_crop(height, width):
    """Images far outside the ratio range always get torchvision's centre-crop fallback."""
    expected = torchvision_fallback(height, width)
    for sample_id in range(50):
        box, _ = en.random_resized_crop_params(0, 0, sample_id, 0, height, width)
        assert box == expected


def test_fallback_with_custom_ranges():
    """scale=(1,1), ratio=(1,1): the centre square of a landscape photo, all of a square one."""
    p = en.random_resized_crop_params
    assert p(1, 2, 3, 4, 300, 451, (1, 1), (1, 1))[0] == (0, 75, 300, 300)
    assert p(1, 2, 3, 4, 451, 300, (1, 1), (1, 1))[0] == (75, 0, 300, 300)
    assert p(1, 2, 3, 4, 256, 256, (1, 1), (1, 1))[0] == (0, 0, 256, 256)
    # The image's own ratio and full scale: the whole image, whichever way it is reached.
    assert en.random_resized_crop_params(1, 2, 3, 4, 200, 300, (1, 1), (1.5, 1.5))[0] == (
        0, 0, 200, 300)
    # torchvision would round the width of this fallback to 0; the kernel keeps one pixel.
    assert en.random_resized_crop_params(0, 0, 0, 0, 1, 1, (1, 1), (0.5, 0.5))[0] == (0, 0, 1, 1)


@pytest.mark.parametrize("height,width", [(480, 640), (500, 375), (224, 224), (300, 1000),
                                          (1000, 300), (64, 48)])
def test_distribution_matches_torchvision(height, width):
    """Area fraction, log aspect, position and flip rate match torchvision's (two-sample KS)."""
    n = 8000
    ours = [en.random_resized_crop_params(2024, 1, i, 0, height, width) for i in range(n)]
    rng = np.random.default_rng(height * 10007 + width)
    ref_boxes = [torchvision_get_params(rng, height, width) for _ in range(n)]
    ref_flips = rng.random(n) < 0.5
    a = crop_stats([b for b, _ in ours], [f for _, f in ours], height, width)
    b = crop_stats(ref_boxes, ref_flips, height, width)
    # Critical value at alpha = 1e-4 for n = m = 8000 is about 0.031.
    for name in ("area fraction", "log aspect ratio", "relative top", "relative left"):
        d = ks_statistic(a[name], b[name])
        assert d < 0.035, f"{name}: KS distance {d:.4f}"
    # Flip: binomial(8000, 0.5) has sd 0.0056; four sd of slack.
    assert abs(a["flip"].mean() - 0.5) < 0.023


def test_distribution_with_custom_scale_and_ratio():
    """Non-default scale/ratio ranges follow the same algorithm."""
    n, height, width = 8000, 400, 600
    scale, ratio = (0.25, 0.5), (0.5, 2.0)
    ours = [en.random_resized_crop_params(9, 0, i, 3, height, width, scale, ratio)[0]
            for i in range(n)]
    rng = np.random.default_rng(5)
    ref = [torchvision_get_params(rng, height, width, scale, ratio) for _ in range(n)]
    a, b = crop_stats(ours, np.zeros(n), height, width), crop_stats(ref, np.zeros(n), height, width)
    for name in ("area fraction", "log aspect ratio", "relative top", "relative left"):
        assert ks_statistic(a[name], b[name]) < 0.035, name


@pytest.mark.parametrize("p", [0.0, 0.2, 1.0])
def test_flip_probability(p):
    """flip_p is the flip rate: never at 0, always at 1, about p in between."""
    flips = [en.random_resized_crop_params(4, 4, i, 0, 100, 100, flip_p=p)[1] for i in range(5000)]
    rate = np.mean(flips)
    if p in (0.0, 1.0):
        assert rate == p
    else:
        assert abs(rate - p) < 4 * math.sqrt(p * (1 - p) / 5000)


def test_ks_statistic_detects_a_wrong_algorithm():
    """The KS check has power: a uniform (not log-uniform) aspect ratio is caught at the same n."""
    n, height, width = 8000, 480, 640
    rng = np.random.default_rng(1)
    ref = [torchvision_get_params(rng, height, width) for _ in range(n)]
    wrong = []
    for _ in range(n):   # ratio uniform on [3/4, 4/3], scale uniform on [0.2, 1]
        t = height * width * rng.uniform(0.2, 1.0)
        r = rng.uniform(3 / 4, 4 / 3)
        w, h = int(round(math.sqrt(t * r))), int(round(math.sqrt(t / r)))
        wrong.append((0, 0, min(h, height), min(w, width)))
    a = crop_stats(ref, np.zeros(n), height, width)
    b = crop_stats(wrong, np.zeros(n), height, width)
    assert ks_statistic(a["area fraction"], b["area fraction"]) > 0.05
    assert ks_statistic(a["log aspect ratio"], b["log aspect ratio"]) > 0.035


# ---- many emissions at once (the echo stage's re-augmentation) ------------------------------
@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(seed=st.integers(0, 2**64 - 1), n=st.integers(1, 40), data=st.data())
def test_batched_crops_are_the_single_draws_mapped_onto_canvases(seed, n, data):
    """``random_resized_crops`` draws exactly what ``random_resized_crop_params`` draws for
    each key, and maps each box onto its canvas inside the canvas."""
    from echo_native._kernel import random_resized_crops
    ints = st.integers(1, 3000)
    hw = np.array(data.draw(st.lists(st.tuples(ints, ints), min_size=n, max_size=n)), np.int32)
    denom = np.array(data.draw(st.lists(st.sampled_from([1, 2, 4, 8, 2.5, 1.75]),
                                        min_size=n, max_size=n)), np.float32)
    scales = np.stack([denom, denom], axis=1)
    canvas = np.maximum(1, np.ceil(hw / scales)).astype(np.int32)
    epochs = np.array(data.draw(st.lists(st.integers(0, 99), min_size=n, max_size=n)), np.int64)
    ids = np.array(data.draw(st.lists(st.integers(0, 2**40), min_size=n, max_size=n)), np.int64)
    echo = np.array(data.draw(st.lists(st.integers(0, 7), min_size=n, max_size=n)), np.int32)
    boxes, flips, cboxes = random_resized_crops(seed, epochs, ids, echo, hw, scales, canvas,
                                                flip_p=0.3)
    for i in range(n):
        box, flip = en.random_resized_crop_params(seed, int(epochs[i]), int(ids[i]), int(echo[i]),
                                                  int(hw[i, 0]), int(hw[i, 1]), flip_p=0.3)
        assert tuple(boxes[i]) == box and bool(flips[i]) == flip
        top, left, h, w = cboxes[i]
        ch, cw = canvas[i]
        assert top == pytest.approx(min(box[0] / denom[i], ch), rel=1e-6)
        assert left == pytest.approx(min(box[1] / denom[i], cw), rel=1e-6)
        assert 0 <= top and 0 <= left and h >= 0 and w >= 0
        assert top + h <= ch + 1e-9 and left + w <= cw + 1e-9


def test_batched_crops_name_a_bad_image_size():
    from echo_native._kernel import random_resized_crops
    one = np.ones((1, 2), np.int32)
    with pytest.raises(ValueError, match="image size must be positive, got 0x5"):
        random_resized_crops(0, np.zeros(1, np.int64), np.zeros(1, np.int64),
                             np.zeros(1, np.int32), np.array([[0, 5]], np.int32),
                             one.astype(np.float32), one)
    with pytest.raises(ValueError, match="same length"):
        random_resized_crops(0, np.zeros(2, np.int64), np.zeros(1, np.int64),
                             np.zeros(1, np.int32), one, one.astype(np.float32), one)


def test_batched_resize_equals_one_resize_per_image():
    """``Decoder.resize_batch`` over canvases stored in rows is ``Decoder.resize`` of each,
    byte for byte, flips and repeated entries included."""
    from echo_native._kernel import Decoder
    rng = np.random.default_rng(4)
    shapes = np.array([[90, 120], [61, 47], [200, 33], [5, 9]], np.int32)
    row = int((shapes[:, 0] * shapes[:, 1]).max()) * 3 + 7
    pixels = rng.integers(0, 256, (len(shapes), row), dtype=np.uint8)
    entries = np.array([2, 0, 3, 1, 0], np.int64)
    boxes = np.array([[10.5, 3, 150, 20.25], [0, 0, 90, 120], [1, 2, 3, 4], [7, 5.5, 40, 30],
                      [20, 30, 10, 10]], np.float64)
    flips = np.array([1, 0, 1, 1, 0], np.uint8)
    dec = Decoder()
    out = np.zeros((len(entries), 24, 32, 3), np.uint8)
    dec.resize_batch(pixels, entries, shapes, boxes, flips, out)
    for i, e in enumerate(entries):
        h, w = shapes[e]
        canvas = pixels[e, :h * w * 3].reshape(h, w, 3)
        want = dec.resize(canvas, tuple(boxes[i]), (24, 32), bool(flips[i]))
        assert np.array_equal(out[i], want), i


def test_batched_resize_refuses_what_does_not_fit():
    from echo_native._kernel import Decoder
    dec = Decoder()
    pixels = np.zeros((2, 30), np.uint8)
    one = np.zeros((1, 4), np.float64)
    one[0, 2:] = 1
    out = np.zeros((1, 4, 4, 3), np.uint8)
    with pytest.raises(ValueError, match="entry 1: a 4x3 canvas does not fit a row of 30 bytes"):
        dec.resize_batch(pixels, np.array([1], np.int64), np.array([[2, 2], [4, 3]], np.int32),
                         one, np.zeros(1, np.uint8), out)
    with pytest.raises(IndexError, match="entry 2 is outside the 2 rows"):
        dec.resize_batch(pixels, np.array([2], np.int64), np.array([[2, 2], [2, 2]], np.int32),
                         one, np.zeros(1, np.uint8), out)

"""MixUp / CutMix (``echo_native.mix``) and the user's batch op (``on_batch``).

What is checked, against references computed here:

- the spec names its bad values; a uint8 output is refused;
- the draws follow timm's ``Mixup`` (mode "batch"): no mix with probability
  1 - prob, CutMix share = switch_prob, lambda ~ Beta(alpha, alpha) (mean and
  variance), CutMix lambda = the area kept, boxes inside the image,
  ``cutmix_minmax`` sides in range;
- soft targets: label smoothing and lambda exactly as timm's ``mixup_target``;
- through a ring: the delivered images are the unmixed batch mixed with its
  reverse (MixUp) or with its reverse's box pasted in (CutMix), in both layouts;
  draws are independent of the worker count and new for every echo;
- bfloat16 output: the float32 run's mixed batch rounded once to bfloat16 (bit for
  bit, what torch's cast of it gives), the same targets; ``on_batch`` sees the
  delivered bfloat16 batch;
- ``on_batch`` sees NumPy, the per-row keys, may work in place or return an array.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import echo_helpers as eh
import echo_native as en
from echo_native.echo import batch_rng
from echo_native.mix import Mix, mix_params, soft_targets
from echo_native.output import BFloat16Array, bfloat16_bits


@pytest.fixture(scope="module")
def small():
    blobs = eh.photo_jpegs(48, 40, 56, seed=3)
    return blobs, np.arange(48) % 6


def _ring(small, **kw):
    kw.setdefault("output", en.Output(normalize=True, layout="NCHW"))
    kw.setdefault("echo", 2)
    return eh.small_ring(small, image_size=16, **kw)


# ---- the spec -----------------------------------------------------------------------------
@pytest.mark.parametrize("kw,match", [
    ({"mixup_alpha": -1}, "mixup_alpha must be a number in"),
    ({"cutmix_alpha": "1"}, "cutmix_alpha must be a number in"),
    ({"mixup_alpha": 0}, "both 0, nothing would be mixed"),
    ({"prob": 1.5}, "prob must be a number in"),
    ({"switch_prob": -0.1}, "switch_prob must be a number in"),
    ({"label_smoothing": 1.0}, r"label_smoothing must be a number in \[0.0, 1.0\)"),
    ({"num_classes": 0}, "num_classes must be a positive integer"),
    ({"cutmix_minmax": (0.5, 0.2)}, "0 < lo < hi <= 1"),
    ({"cutmix_minmax": "ab"}, r"must be \(lo, hi\)"),
])
def test_spec_names_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        Mix(**kw)


def test_ring_refuses_mix_without_float_output(small):
    with pytest.raises(ValueError, match=r"Mix needs float images.*got uint8"):
        eh.small_ring(small, mix=Mix())
    with pytest.raises(ValueError, match=r"Mix needs float images.*got uint8"):
        eh.small_ring(small, mix=Mix(), output=en.Output(normalize=False))
    with pytest.raises(TypeError, match="mix must be an echo_native.Mix"):
        _ring(small, mix={"mixup_alpha": 1})
    with pytest.raises(TypeError, match="on_batch must be callable"):
        _ring(small, on_batch=3)


# ---- the draws ----------------------------------------------------------------------------
def _draws(spec, n=4000, h=32, w=48):
    return [mix_params(spec, np.random.default_rng(i), h, w) for i in range(n)]


def test_prob_and_switch_prob():
    draws = _draws(Mix(mixup_alpha=0.8, cutmix_alpha=1.0, prob=0.6, switch_prob=0.25))
    mixed = [(lam, box) for lam, box in draws if not (lam == 1.0 and box is None)]
    assert len(mixed) / len(draws) == pytest.approx(0.6, abs=0.03)
    cut = sum(box is not None for _, box in mixed)
    assert cut / len(mixed) == pytest.approx(0.25, abs=0.03)
    assert all(lam == 1.0 and box is None for lam, box in _draws(Mix(prob=0.0), 200))


@pytest.mark.parametrize("alpha", [0.2, 1.0, 2.0])
def test_mixup_lambda_is_beta(alpha):
    lam = np.array([lam for lam, _ in _draws(Mix(mixup_alpha=alpha))])
    assert lam.mean() == pytest.approx(0.5, abs=0.02)
    assert lam.var() == pytest.approx(1 / (4 * (2 * alpha + 1)), rel=0.1)


def test_cutmix_lambda_is_the_area_kept_and_boxes_are_inside():
    h, w = 32, 48
    for lam, box in _draws(Mix(mixup_alpha=0, cutmix_alpha=1.0), 2000, h, w):
        top, bottom, left, right = box
        assert 0 <= top <= bottom <= h and 0 <= left <= right <= w
        assert lam == pytest.approx(1 - (bottom - top) * (right - left) / (h * w))
    uncorrected = _draws(Mix(mixup_alpha=0, cutmix_alpha=1.0, correct_lam=False), 2000, h, w)
    # Without the correction lambda is the Beta draw: the box (clipped at the border) is
    # at most the (1 - lam) share of the image.
    for lam, (top, bottom, left, right) in uncorrected:
        assert (bottom - top) * (right - left) <= (1 - lam) * h * w + 1e-9


def test_cutmix_minmax_sides():
    h, w = 40, 60
    for lam, (top, bottom, left, right) in _draws(Mix(mixup_alpha=0, cutmix_minmax=(0.25, 0.5)), 1000, h, w):
        assert 10 <= bottom - top < 20 and 15 <= right - left < 30
        assert 0 <= top and bottom <= h and 0 <= left and right <= w
        assert lam == pytest.approx(1 - (bottom - top) * (right - left) / (h * w))


def test_soft_targets_match_timm_mixup_target():
    labels = np.array([0, 2, 1, 2])
    t = soft_targets(np, labels, 3, 0.7, 0.1)
    off, on = 0.1 / 3, 1 - 0.1 + 0.1 / 3
    one = np.full((4, 3), off)
    one[np.arange(4), labels] = on
    rev = np.full((4, 3), off)
    rev[np.arange(4), labels[::-1]] = on
    np.testing.assert_allclose(t, 0.7 * one + 0.3 * rev, rtol=1e-6)
    assert t.dtype == np.float32 and np.allclose(t.sum(1), 1.0)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 2\)"):
        soft_targets(np, labels, 2, 1.0, 0.0)


# ---- through a ring ---------------------------------------------------------------------
def _batches(ring):
    return [(b.images.copy(), b.labels.copy(), b.sample_ids.copy(), b.echo_index.copy(),
             None if b.targets is None else b.targets.copy()) for b in ring]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("spec", [Mix(mixup_alpha=0.4), Mix(mixup_alpha=0, cutmix_alpha=1.0),
                                  Mix(mixup_alpha=1.0, cutmix_alpha=1.0, prob=0.7)])
def test_ring_mixes_each_batch_with_its_reverse(small, layout, spec):
    out = en.Output(normalize=True, layout=layout)
    with _ring(small, output=out) as ring:
        plain = _batches(ring)
    with _ring(small, output=out, mix=spec) as ring:
        mixed = _batches(ring)
    assert len(plain) == len(mixed)
    cut = 0
    for k, ((x, y, ids, _, _), (xm, ym, idm, _, t)) in enumerate(zip(plain, mixed)):
        np.testing.assert_array_equal(ids, idm)
        lam, box = mix_params(spec, batch_rng(0, 0, k), 16, 16)
        if box is None:
            want = x * np.float32(lam) + x[::-1] * np.float32(1 - lam)
        else:
            cut += 1
            top, bottom, left, right = box
            want = x.copy()
            region = (slice(None), slice(top, bottom), slice(left, right))
            if layout == "NCHW":
                region = (slice(None), slice(None)) + region[1:]
            want[region] = x[::-1][region]
        np.testing.assert_allclose(xm, want, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(t, soft_targets(np, y, 6, lam, 0.1), rtol=1e-6)
        assert t.shape == (len(y), 6) and np.allclose(t.sum(1), 1.0)
    if spec.cutmix_alpha and not spec.mixup_alpha:
        assert cut == len(mixed)


BFLOAT16_SPECS = [Mix(mixup_alpha=0.4, cutmix_alpha=0), Mix(mixup_alpha=0, cutmix_alpha=1.0),
                  Mix(mixup_alpha=1.0, cutmix_alpha=1.0, switch_prob=0.5)]


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("spec", BFLOAT16_SPECS)
def test_bfloat16_mix_is_the_float32_mix_rounded_once(small, layout, spec):
    """dtype="bfloat16" with a Mix: normalised and mixed in float32, rounded once, so
    the bits are the float32 run's (same images, same draws) through bfloat16_bits,
    and torch gets a bfloat16 tensor equal to its own cast of the float32 batch.  The
    targets do not depend on the dtype."""
    try:
        import torch
    except ImportError:
        torch = None
    runs = {}
    for dtype in ("float32", "bfloat16"):
        with _ring(small, output=en.Output(normalize=True, layout=layout, dtype=dtype),
                   mix=spec) as ring:
            runs[dtype] = _batches(ring)
    assert len(runs["float32"]) == len(runs["bfloat16"]) > 0
    kinds = set()
    for k, (f, b) in enumerate(zip(runs["float32"], runs["bfloat16"])):
        x, xb = f[0], b[0]
        assert isinstance(xb, BFloat16Array) and xb.shape == x.shape
        np.testing.assert_array_equal(xb.bits, bfloat16_bits(x))
        np.testing.assert_array_equal(f[2], b[2])
        np.testing.assert_array_equal(b[4], f[4])
        assert b[4].dtype == np.float32
        if torch is not None:
            t = torch.from_dlpack(xb)
            assert t.dtype == torch.bfloat16 and tuple(t.shape) == x.shape
            assert torch.equal(t, torch.from_numpy(x).to(torch.bfloat16))
        kinds.add("cutmix" if mix_params(spec, batch_rng(0, 0, k), 16, 16)[1] else "mixup")
    assert kinds == ({"mixup"} if not spec.cutmix_alpha else {"cutmix"} if not spec.mixup_alpha
                     else {"mixup", "cutmix"})


def test_bfloat16_mix_on_batch_sees_the_delivered_batch(small):
    """on_batch after a bfloat16 Mix gets the rounded BFloat16Array that is delivered,
    as it does for bfloat16 without a Mix; what it writes in place is delivered."""
    seen = []

    def op(images, xp, keys):
        assert isinstance(images, BFloat16Array) and xp is np
        seen.append(images.bits.copy())
        images.bits[:, 0] = 0

    out = en.Output(normalize=True, dtype="bfloat16")
    with _ring(small, output=out, mix=BFLOAT16_SPECS[0]) as ring:
        plain = _batches(ring)
    with _ring(small, output=out, mix=BFLOAT16_SPECS[0], on_batch=op) as ring:
        hooked = _batches(ring)
    assert len(seen) == len(plain) == len(hooked)
    for bits, p, h in zip(seen, plain, hooked):
        np.testing.assert_array_equal(bits, p[0].bits)
        want = p[0].bits.copy()
        want[:, 0] = 0
        np.testing.assert_array_equal(h[0].bits, want)


def test_ring_mix_is_independent_of_workers_and_new_for_each_echo(small):
    spec = Mix(mixup_alpha=0.5, cutmix_alpha=1.0)
    runs = []
    for workers in (1, 2):
        with _ring(small, workers=workers, mix=spec) as ring:
            runs.append(_batches(ring))
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[4], b[4])
    lams = [mix_params(spec, batch_rng(0, 0, k), 16, 16)[0] for k in range(len(runs[0]))]
    assert len(set(lams)) == len(lams)  # every emitted batch draws afresh


def test_num_classes_from_the_source_or_the_spec(small):
    with _ring(small, mix=Mix(num_classes=10)) as ring:
        assert next(iter(ring)).targets.shape[1] == 10
    with _ring(small, mix=Mix()) as ring:
        assert ring.delivery.num_classes == 6


def test_on_batch_sees_numpy_and_the_row_keys(small):
    seen = []

    def op(images, xp, keys):
        seen.append(keys.copy())
        assert xp is np and images.dtype == np.float32
        images *= 0  # in place

    with _ring(small, on_batch=op, seed=7) as ring:
        for b in ring:
            k = seen[-1]
            assert k.shape == (len(b), 4) and k.dtype == np.int64
            assert (k[:, 0] == 7).all() and (k[:, 1] == b.epoch).all()
            np.testing.assert_array_equal(k[:, 2], b.sample_ids)
            np.testing.assert_array_equal(k[:, 3], b.echo_index)
            assert not np.asarray(b.images).any()

    with _ring(small, on_batch=lambda images, xp, keys: images + 1) as ring:
        with _ring(small) as plain_ring:
            for b, p in zip(ring, plain_ring):
                np.testing.assert_allclose(b.images, p.images + 1)
    with _ring(small, on_batch=lambda images, xp, keys: images[:, :1]) as ring:
        with pytest.raises(ValueError, match="on_batch returned float32"):
            next(iter(ring))


def test_targets_survive_copy(small):
    with _ring(small, mix=Mix()) as ring:
        b = next(iter(ring))
        c = b.copy()
    assert c.targets is not b.targets and np.array_equal(c.targets, b.targets)
    assert math.isclose(float(c.targets.sum()), len(c))

"""Per-example ops after the crop (echo_native/augment.py): their specs, the
distribution of their parameters against torchvision's semantics, the keys
they are drawn from, and where the pipeline applies them for each echo
placement.  The pixels each op produces for fixed parameters are checked
against Pillow in tests/test_ops_kernels.py.
"""
from __future__ import annotations

import math
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import echo_native as en
from echo_native import _kernel
from echo_native.augment import Program, rotation
from echo_native._kernel import Op as op

sys.path.insert(0, str(Path(__file__).parent))
import echo_helpers as eh  # noqa: E402

N = 4000  # draws per distribution check


def _draw(ops, n=N, size=(32, 48), seed=3, echo=0, mean=None, std=None):
    prog = Program(ops, size, mean, std)
    return prog.draw(seed, 0, np.arange(n), echo)


# ---- specs --------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, match", [
    (lambda: en.ColorJitter(brightness=-0.1), "brightness"),
    (lambda: en.ColorJitter(hue=0.6), "hue"),
    (lambda: en.ColorJitter(contrast=(1.5, 0.5)), "min > max"),
    (lambda: en.ColorJitter(saturation="x"), "saturation"),
    (lambda: en.ColorJitter(p=1.5), "p"),
    (lambda: en.RandomGrayscale(p=-0.1), "p"),
    (lambda: en.RandomErasing(scale=(0.1, 1.5)), "scale"),
    (lambda: en.RandomErasing(value="random"), "not supported"),
    (lambda: en.RandomErasing(value=(0, 0)), "3 numbers"),
    (lambda: en.TrivialAugmentWide(num_magnitude_bins=1), "num_magnitude_bins"),
    (lambda: en.TrivialAugmentWide(fill=300), "fill"),
])
def test_spec_errors_name_the_argument(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_augment_list_errors(tmp_path):
    src = en.Samples(eh.photo_jpegs(4, 32, 32, seed=0), [0, 1, 2, 3])
    with pytest.raises(ValueError, match="empty"):
        en.EchoRing(src, 2, augment=[])
    with pytest.raises(TypeError, match="per-example ops"):
        en.EchoRing(src, 2, augment=[en.RandomResizedCrop(16), en.RandomResizedCrop(16)])
    with pytest.raises(ValueError, match="follow a RandomResizedCrop"):
        en.EchoRing(src, 2, augment=[en.CenterCrop(16), en.ColorJitter(0.4)], echo=1)
    with pytest.raises(ValueError, match="follow a RandomResizedCrop"):
        en.Loader(src, 2, augment=[en.CenterCrop(16), en.RandomGrayscale()])


# ---- parameter distributions ------------------------------------------------------------
def test_color_jitter_factors_orders_and_probability():
    """Factors uniform on [max(0, 1 - b), 1 + b] (hue on [-h, h]); the adjustments in
    all 24 orders, equally often; p gates the whole jitter."""
    codes, args = _draw([en.ColorJitter(0.4, 0.5, 0.6, 0.1)])
    assert codes.shape == (N, 4) and (codes > 0).all()
    for code, (lo, hi) in ((op.BRIGHTNESS, (0.6, 1.4)), (op.CONTRAST, (0.5, 1.5)),
                           (op.SATURATION, (0.4, 1.6)), (op.HUE, (-0.1, 0.1))):
        v = args[..., 0][codes == code]
        assert len(v) == N
        assert lo <= v.min() and v.max() <= hi
        # uniform: each quarter of the range holds a quarter (+- 5 binomial SDs)
        q = np.histogram(v, bins=4, range=(lo, hi))[0]
        assert np.abs(q - N / 4).max() < 5 * math.sqrt(N * 3 / 16), q
    orders = Counter(map(tuple, codes.tolist()))
    assert len(orders) == 24
    assert max(orders.values()) < 2 * N / 24
    half = _draw([en.ColorJitter(0.4, p=0.5)])[0]
    assert abs((half[:, 0] != op.NONE).mean() - 0.5) < 5 * math.sqrt(0.25 / N)


def test_color_jitter_skips_identity_adjustments():
    codes, _ = _draw([en.ColorJitter(brightness=0.3)], n=200)
    assert (codes[:, 0] == op.BRIGHTNESS).all() and (codes[:, 1:] == op.NONE).all()
    codes, args = _draw([en.ColorJitter(brightness=(0.0, 0.0))], n=10)
    assert (codes[:, 0] == op.BRIGHTNESS).all() and (args[:, 0, 0] == 0).all()


def test_random_grayscale_probability():
    codes, _ = _draw([en.RandomGrayscale(p=0.2)])
    assert set(np.unique(codes).tolist()) == {op.NONE, op.GRAYSCALE}
    assert abs((codes == op.GRAYSCALE).mean() - 0.2) < 5 * math.sqrt(0.16 / N)


def test_random_erasing_boxes_follow_torchvision():
    """Boxes inside the image, area within scale x image area (up to rounding of the
    sides), aspect within ratio, placed uniformly; p gates it; the fill is the
    value in the delivered space (0 after normalising: the mean colour)."""
    h, w = 32, 48
    spec = en.RandomErasing(p=0.7, scale=(0.05, 0.3), ratio=(0.5, 2.0), value=0)
    codes, args = _draw([spec], size=(h, w), mean=(0.5, 0.4, 0.3), std=(0.2, 0.2, 0.2))
    erased = codes[:, 0] == op.ERASE
    assert abs(erased.mean() - 0.7) < 5 * math.sqrt(0.21 / N)
    top, left, eh_, ew = (args[erased, 0, k] for k in range(4))
    assert (top >= 0).all() and (left >= 0).all()
    assert (top + eh_ <= h).all() and (left + ew <= w).all()
    assert (eh_ < h).all() and (ew < w).all()
    area = eh_ * ew / (h * w)
    assert area.min() > 0.05 * 0.6 and area.max() < 0.3 * 1.4
    aspect = eh_ / ew
    assert aspect.min() > 0.5 * 0.6 and aspect.max() < 2.0 * 1.6
    assert np.array_equal(np.unique(args[erased, 0, 4:7], axis=0),
                          [[128, 102, 77]])  # round(255 * mean)
    # the top-left corner is spread over the free range, not stuck at one side
    assert (top / np.maximum(1, h - eh_)).std() > 0.2
    raw = _draw([en.RandomErasing(p=1, value=(1.0, 0.5, 0.0))], n=50)[1]
    assert np.array_equal(np.unique(raw[:, 0, 4:7], axis=0), [[255, 128, 0]])


def test_trivial_augment_wide_ops_and_magnitudes():
    """Each of the 14 ops about equally often; magnitudes from the wide bins with a
    random sign for signed ops."""
    spec = en.TrivialAugmentWide()
    codes, args = _draw([spec], size=(40, 40))
    c, a = codes[:, 0], args[:, 0]
    share = {k: np.mean(c == k) for k in (op.NONE, op.BRIGHTNESS, op.SATURATION, op.CONTRAST,
                                          op.SHARPNESS, op.POSTERIZE, op.SOLARIZE,
                                          op.AUTOCONTRAST, op.EQUALIZE, op.AFFINE)}
    sd = math.sqrt((1 / 14) * (13 / 14) / N)
    for k in (op.NONE, op.BRIGHTNESS, op.SATURATION, op.CONTRAST, op.SHARPNESS, op.POSTERIZE,
              op.SOLARIZE, op.AUTOCONTRAST, op.EQUALIZE):
        assert abs(share[k] - 1 / 14) < 5 * sd, (k, share[k])
    assert abs(share[op.AFFINE] - 5 / 14) < 5 * math.sqrt((5 / 14) * (9 / 14) / N)
    factors = a[np.isin(c, (op.BRIGHTNESS, op.SATURATION, op.CONTRAST, op.SHARPNESS)), 0]
    assert factors.min() >= 0.01 - 1e-6 and factors.max() <= 1.99 + 1e-6
    assert (factors < 1).mean() == pytest.approx(0.5, abs=0.1)  # signed
    bins = {round(1 + 0.99 * b / 30, 5) for b in range(31)} | \
        {round(1 - 0.99 * b / 30, 5) for b in range(31)}
    assert {round(float(f), 5) for f in factors} <= bins
    assert set(a[c == op.POSTERIZE, 0].tolist()) == {2, 3, 4, 5, 6, 7, 8}
    sol = a[c == op.SOLARIZE, 0]
    assert sol.min() >= 0 and sol.max() <= 255
    shears = a[(c == op.AFFINE) & (a[:, 0] == 1) & (a[:, 4] == 1) & (a[:, 2] == 0) & (a[:, 5] == 0)]
    assert np.abs(shears[:, [1, 3]]).max() <= 0.99 + 1e-6
    shifts = a[(c == op.AFFINE) & (a[:, 1] == 0) & (a[:, 3] == 0) & (a[:, 0] == 1)]
    assert np.abs(shifts[:, [2, 5]]).max() <= 32 and (shifts[:, [2, 5]] % 1 == 0).all()


def test_rotation_is_pillows_rotate():
    """The inverse map of Rotate, run by the AFFINE op, gives Pillow's rotate."""
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (30, 44, 3), np.uint8)
    for deg in (0.0, 17.0, -45.5, 90.0, 135.0, 200.0):
        m = rotation(deg, 30, 44)
        codes = np.array([[op.AFFINE]], np.int32)
        args = np.zeros((1, 1, 8), np.float32)
        args[0, 0, :6] = m
        ours = img[None].copy()
        _kernel.apply_ops(ours, codes, args)
        want = np.asarray(Image.fromarray(img).rotate(deg, Image.NEAREST))
        # Pillow maps in 16.16 fixed point, the kernel in float: they may differ only
        # where the source coordinate is a tie, exactly on a pixel boundary.
        ys, xs = np.nonzero((ours[0] != want).any(-1))
        sx = m[0] * (xs + 0.5) + m[1] * (ys + 0.5) + m[2]
        sy = m[3] * (xs + 0.5) + m[4] * (ys + 0.5) + m[5]
        tie = np.minimum(np.abs(sx - np.round(sx)), np.abs(sy - np.round(sy)))
        assert len(ys) < 0.05 * 30 * 44 and (tie < 1e-6).all(), deg


# ---- keys ----------------------------------------------------------------------------------
def test_draws_are_pure_functions_of_the_key():
    ops = [en.ColorJitter(0.4, 0.4, 0.4, 0.1), en.RandomGrayscale(0.5),
           en.TrivialAugmentWide(), en.RandomErasing(p=0.5)]
    prog = Program(ops, (24, 24))
    ids = np.arange(64)
    a = prog.draw(1, 2, ids, 0)
    b = prog.draw(1, 2, ids[::-1], 0)  # another order, another batch: the same per id
    assert np.array_equal(a[0], b[0][::-1]) and np.array_equal(a[1], b[1][::-1])
    for other in (prog.draw(1, 2, ids, 1), prog.draw(1, 3, ids, 0), prog.draw(2, 2, ids, 0)):
        assert not np.array_equal(a[1], other[1])


# ---- in the pipeline ------------------------------------------------------------------------
RICH = [en.ColorJitter(0.4, 0.4, 0.4, 0.1), en.RandomGrayscale(0.2), en.RandomErasing(p=0.5)]


@pytest.fixture(scope="module")
def photos():
    return eh.photo_jpegs(32, 48, 64, seed=4), np.arange(32) % 4


def _emissions(data, **kw):
    kw.setdefault("augment", [en.RandomResizedCrop(24)] + RICH)
    kw = {"batch_size": 8, "workers": 2, "seed": 0, "timeout": 60, **kw}
    with en.EchoRing(eh.samples_of(data), **kw) as ring:
        batches = eh.collect(ring, epochs=1)[0]
    out = {}
    for b in batches:
        for img, sid, e, box, flip in zip(b["images"], b["ids"], b["echo"], b["boxes"],
                                          b["flips"]):
            out[(int(sid), int(e))] = (img, tuple(box), bool(flip))
    return out


def _plain(data, **kw):
    """The same emissions with the crop alone."""
    return _emissions(data, augment=en.RandomResizedCrop(24), **kw)


def test_before_augment_draws_the_ops_afresh_for_every_emission(photos):
    """Every emission is its crop with its own ops: the crops are those of the crop
    alone; the ops change pixels, differently for each echo of a sample."""
    rich = _emissions(photos, echo=2, placement="before_augment")
    plain = _plain(photos, echo=2, placement="before_augment")
    assert rich.keys() == plain.keys() == {(i, e) for i in range(32) for e in (0, 1)}
    assert all(rich[k][1:] == plain[k][1:] for k in rich), "ops moved a crop"
    changed = [not np.array_equal(rich[k][0], plain[k][0]) for k in rich]
    assert np.mean(changed) > 0.9
    diffs = [np.abs(rich[(i, 0)][0].astype(int) - plain[(i, 0)][0]).mean() -
             np.abs(rich[(i, 1)][0].astype(int) - plain[(i, 1)][0]).mean() for i in range(32)]
    assert np.std(diffs) > 1.0, "every echo was jittered alike"


@pytest.mark.parametrize("placement", ["after_augment", "batch"])
def test_after_augment_and_batch_repeat_the_ops_drawn_once(photos, placement):
    rich = _emissions(photos, echo=2, placement=placement)
    for i in range(32):
        assert np.array_equal(rich[(i, 0)][0], rich[(i, 1)][0])
    plain = _plain(photos, echo=2, placement=placement)
    assert np.mean([not np.array_equal(rich[k][0], plain[k][0]) for k in rich]) > 0.9


def test_fresh_pixels_agree_across_placements_and_worker_counts(photos):
    """A fresh emission's ops depend only on (seed, epoch, sample id, 0): the workers
    (echo 1, any count) and the echo stage (before augmentation) make the same
    pixels, up to the resampling of the canvas the latter crops from."""
    one = _emissions(photos, echo=1, workers=1)
    two = _emissions(photos, echo=1, workers=2)
    assert one.keys() == two.keys()
    assert all(np.array_equal(one[k][0], two[k][0]) for k in one)
    after = _emissions(photos, echo=2, placement="after_augment", workers=1)
    assert all(np.array_equal(one[k][0], after[k][0]) for k in one)


def test_loader_takes_the_augment_list(photos):
    src = eh.samples_of(photos)
    with en.Loader(src, 8, augment=[en.RandomResizedCrop(24)] + RICH, workers=1) as a, \
            en.Loader(src, 8, augment=en.RandomResizedCrop(24), workers=1) as b:
        x, y = next(iter(a)), next(iter(b))
        assert np.array_equal(x.sample_ids, y.sample_ids)
        assert np.array_equal(x.boxes, y.boxes)
        assert not np.array_equal(np.asarray(x.images), np.asarray(y.images))


def test_each_op_spec_is_the_c_tables_format():
    """The draw-spec format is one table (EN_DRAW_LIST in en_kernel.h, _kernel.DRAWS):
    each op's row is its kind and the table's count of numbers (zeros after them), and
    its program steps are the table's."""
    from echo_native import _kernel
    from echo_native.augment import SPEC

    assert SPEC == 1 + _kernel.DRAW_NUMBERS
    assert sorted(_kernel.DRAWS) == [_kernel.DRAW_COLOR_JITTER, _kernel.DRAW_GRAYSCALE,
                                     _kernel.DRAW_TRIVIAL_WIDE, _kernel.DRAW_ERASING]
    ops = [en.ColorJitter(0.4, 0.4, 0.4, 0.1), en.RandomGrayscale(0.2),
           en.TrivialAugmentWide(), en.RandomErasing()]
    for op in ops:
        row = op.spec(lambda value: (0.0, 0.0, 0.0))   # fill: RGB of a fill value
        name, numbers, steps = _kernel.DRAWS[int(row[0])]
        assert row.shape == (SPEC,) and not row[1 + numbers:].any(), name
        assert op.steps == steps == _kernel.ops_steps(row[None, :]), name

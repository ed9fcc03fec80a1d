"""Correctness of the fused JPEG kernel against Pillow, on real photographs.

References: Pillow's own decode (``Image.open().convert("RGB")``), Pillow's
``draft`` for DCT-scaled decodes and Pillow's ``resize(size, BILINEAR, box)``
for the resampling.  Pillow bundles its own libjpeg-turbo, so the decoders
agree to within one level, not bit for bit by construction.
"""
from __future__ import annotations

import concurrent.futures
import io
import math
import zlib

import numpy as np
import pytest
from PIL import Image

import echo_native as en
from echo_native import _kernel

SUBSAMPLED = ("baseline-4:2:0", "progressive-4:2:2", "sampling-4:4:0", "sampling-4:1:1",
              "arithmetic", "restart-blocks", "ycck-adobe", "baseline-4:4:4", "gray")


def expected_scale(box, size):
    """The documented DCT-scale rule: the largest d in (8, 4, 2, 1) with box / d >= size."""
    _, _, bh, bw = box
    for d in (8, 4, 2):
        if bh / d >= size[0] and bw / d >= size[1]:
            return d
    return 1


def expected_canvas_scale(h, w, min_side):
    """The canvas rule: the coarsest d whose ceil(side / d) keeps both sides >= min_side."""
    for d in (8, 4, 2):
        if math.ceil(h / d) >= min_side and math.ceil(w / d) >= min_side:
            return d
    return 1


def random_box(rng, h, w, min_frac=0.05):
    """A random box inside an h x w image; fractional coordinates half of the time."""
    bh = rng.uniform(max(min_frac * h, min(h, 1.0)), h)
    bw = rng.uniform(max(min_frac * w, min(w, 1.0)), w)
    top = rng.uniform(0, h - bh)
    left = rng.uniform(0, w - bw)
    if rng.random() < 0.5:
        top, left = math.floor(top), math.floor(left)
        bh, bw = max(1, math.floor(bh)), max(1, math.floor(bw))
    return (top, left, bh, bw)


def full_scale_cases(rng, h, w, n):
    """(box, size) pairs that decode at full scale, including the whole image and edges."""
    cases = [((0, 0, h, w), (h, w)), ((0, 0, h, w), (max(1, h // 2 + 1), max(1, w // 2 + 1)))]
    while len(cases) < n:
        box = random_box(rng, h, w)
        size = (int(rng.integers(max(1, int(box[2] / 2) + 1), int(box[2] * 2) + 3)),
                int(rng.integers(max(1, int(box[3] / 2) + 1), int(box[3] * 2) + 3)))
        if expected_scale(box, size) == 1:
            cases.append((box, size))
    return cases


def scaled_case(rng, h, w, denom):
    """A (box, size) pair for which the documented rule picks exactly ``denom``."""
    for _ in range(200):
        box = random_box(rng, h, w, min_frac=0.3)
        oh = int(box[2] / denom * rng.uniform(0.55, 1.0))
        ow = int(box[3] / denom * rng.uniform(0.55, 1.0))
        if oh >= 1 and ow >= 1 and expected_scale(box, (oh, ow)) == denom:
            return box, (oh, ow)
    # Thin images: the whole image shrunk by denom (floor(x) > x / 2 for x >= 1,
    # so 2 * denom never fits).
    box, size = (0, 0, h, w), (h // denom, w // denom)
    assert expected_scale(box, size) == denom, f"no box of a {h}x{w} image decodes at 1/{denom}"
    return box, size


# ---------------------------------------------------------------------------
# full decode


def test_decode_matches_pillow(jpeg_kind):
    """decode() returns a C-contiguous HxWx3 uint8 image within 1 level of Pillow's decode."""
    img = en.decode(jpeg_kind.data)
    assert img.dtype == np.uint8 and img.flags.c_contiguous
    assert img.shape == jpeg_kind.expected.shape
    d = np.abs(img.astype(int) - jpeg_kind.expected)
    assert d.max() <= 1, f"{jpeg_kind.name}: max diff {d.max()}"


def test_decode_close_to_source(jpeg_kind):
    """decode() reproduces the source photograph (colour conversion, CMYK/YCCK inversion)."""
    img = en.decode(jpeg_kind.data)
    err = np.abs(img.astype(float) - jpeg_kind.source).mean()
    assert err <= jpeg_kind.source_tol, f"{jpeg_kind.name}: mean error {err:.2f} vs source"


def test_image_size_matches_header(jpeg_kind):
    """image_size() reads (height, width) from the header as Pillow does."""
    with Image.open(io.BytesIO(jpeg_kind.data)) as im:
        w, h = im.size
    assert en.image_size(jpeg_kind.data) == (h, w)


def test_bytes_like_inputs_are_equivalent(images):
    """bytes, bytearray, memoryview and 1-D uint8 arrays decode identically."""
    data = images.sample("progressive-4:2:0").data
    ref = en.decode(data)
    for form in (bytearray(data), memoryview(data), np.frombuffer(data, np.uint8)):
        np.testing.assert_array_equal(en.decode(form), ref)
        np.testing.assert_array_equal(en.decode_crop(form, (10, 20, 100, 90), (50, 45)),
                                      en.decode_crop(data, (10, 20, 100, 90), (50, 45)))


# ---------------------------------------------------------------------------
# fused crop + resize


def test_crop_full_scale_matches_pillow(jpeg_kind, images):
    """decode_crop at DCT scale 1 is within mean 1.5 of Pillow resize(BILINEAR, box)."""
    h, w = jpeg_kind.expected.shape[:2]
    rng = np.random.default_rng(zlib.crc32(jpeg_kind.name.encode()))   # stable across runs
    for box, size in full_scale_cases(rng, h, w, 6):
        got = en.decode_crop(jpeg_kind.data, box, size)
        ref = images.pil_crop(jpeg_kind.data, box, size, 1)
        d = images.diff(got, ref)
        assert d.mean() <= 1.5, f"{jpeg_kind.name} box={box} size={size}: mean {d.mean():.3f}"


def test_crop_region_decode_equals_full_decode(jpeg_kind):
    """Decoding only the crop's rows/columns gives exactly the pixels of a full decode + resize."""
    full = en.decode(jpeg_kind.data)
    h, w = full.shape[:2]
    rng = np.random.default_rng(7)
    cases = full_scale_cases(rng, h, w, 8)
    # Boxes starting and ending on iMCU boundaries, upscaled, stress the edges of
    # the decoded region, where chroma upsampling needs neighbours outside it.
    for top, left in ((16, 16), (8, 32), (0, min(w - 1, 48))):
        if top < h - 1 and left < w - 1:
            bh, bw = min(h - top, 16), min(w - left, 16)
            cases.append(((top, left, bh, bw), (bh * 3, bw * 3)))
    for box, size in cases:
        got = en.decode_crop(jpeg_kind.data, box, size)
        ref = en.resize_crop(full, box, size)
        d = np.abs(got.astype(int) - ref)
        assert d.max() == 0, f"{jpeg_kind.name} box={box} size={size}: max {d.max()}"


@pytest.mark.parametrize("denom", [2, 4, 8])
def test_crop_scaled_matches_pillow_draft(jpeg_kind, images, denom):
    """A scaled decode_crop uses the documented DCT scale and matches Pillow draft + resize."""
    h, w = jpeg_kind.expected.shape[:2]
    if min(h, w) < denom:
        # No crop of this image can be decoded at 1/denom: the kernel must not try.
        assert en.pick_scale((0, 0, h, w), (1, 1)) < denom
        img = en.decode_crop(jpeg_kind.data, (0, 0, h, w), (1, 1))
        assert img.shape == (1, 1, 3)
        return
    # DCT scaling blurs more than an antialiased resize; more so on detail-dense small images.
    blur_tol = 4.0 if min(h, w) >= 200 else 8.0
    rng = np.random.default_rng(denom * 1000 + len(jpeg_kind.name))
    dec = _kernel.Decoder()
    for _ in range(3):
        box, size = scaled_case(rng, h, w, denom)
        assert en.pick_scale(box, size) == denom
        got = dec.decode_crop(jpeg_kind.data, box, size)
        assert dec.last_scale == denom
        np.testing.assert_array_equal(got, en.decode_crop(jpeg_kind.data, box, size))
        ref = images.pil_crop(jpeg_kind.data, box, size, denom)
        if ref is not None:
            d = images.diff(got, ref)
            assert d.mean() <= 1.5, f"{jpeg_kind.name} 1/{denom} box={box}: mean {d.mean():.3f}"
        # Against the full-scale resize only DCT scaling's own blur separates them.
        full = images.pil_crop(jpeg_kind.data, box, size, 1)
        assert images.diff(got, full).mean() <= blur_tol


def test_crop_scaled_equals_canvas_resize(images):
    """decode_crop at scale 1/d equals resize_crop of the 1/d canvas with the box divided by d."""
    for name in SUBSAMPLED:
        sample = images.sample(name)
        h, w = sample.expected.shape[:2]
        rng = np.random.default_rng(3)
        for denom in (2, 4, 8):
            canvas, scale = en.decode_canvas(sample.data, math.ceil(min(h, w) / denom))
            assert scale == denom
            for _ in range(3):
                box, size = scaled_case(rng, h, w, denom)
                got = en.decode_crop(sample.data, box, size)
                ref = en.resize_crop(canvas, tuple(v / denom for v in box), size)
                d = np.abs(got.astype(int) - ref)
                assert d.max() == 0, f"{name} 1/{denom} box={box} size={size}: max {d.max()}"


def test_pick_scale_rule():
    """pick_scale follows the documented rule, including exact boundaries and non-square outputs."""
    rng = np.random.default_rng(11)
    for _ in range(2000):
        box = (0.0, 0.0, float(rng.uniform(1, 3000)), float(rng.uniform(1, 3000)))
        size = (int(rng.integers(1, 600)), int(rng.integers(1, 600)))
        assert en.pick_scale(box, size) == expected_scale(box, size)
    assert en.pick_scale((0, 0, 1792, 1792), (224, 224)) == 8
    assert en.pick_scale((0, 0, 1791, 1792), (224, 224)) == 4
    assert en.pick_scale((0, 0, 448, 4000), (224, 224)) == 2
    assert en.pick_scale((0, 0, 447, 4000), (224, 224)) == 1


def test_flip_is_exact_mirror(jpeg_kind):
    """flip=True is exactly the horizontal mirror of flip=False, at every scale."""
    h, w = jpeg_kind.expected.shape[:2]
    rng = np.random.default_rng(5)
    cases = full_scale_cases(rng, h, w, 3)
    for denom in (2, 8):
        if min(h, w) >= 2 * denom:
            cases.append(scaled_case(rng, h, w, denom))
    for box, size in cases:
        plain = en.decode_crop(jpeg_kind.data, box, size)
        flipped = en.decode_crop(jpeg_kind.data, box, size, flip=True)
        np.testing.assert_array_equal(flipped, plain[:, ::-1])
    full = en.decode(jpeg_kind.data)
    box, size = cases[-1]
    np.testing.assert_array_equal(en.resize_crop(full, box, size, flip=True),
                                  en.resize_crop(full, box, size)[:, ::-1])


# ---------------------------------------------------------------------------
# caller buffers


def test_out_buffer_written_in_place(images):
    """decode_crop/resize_crop/center/random crop write into `out` and return that very array."""
    data = images.sample("baseline-4:2:0").data
    box, size = (20.5, 30, 200, 301.25), (96, 128)
    out = np.full((*size, 3), 7, np.uint8)
    assert en.decode_crop(data, box, size, out=out) is out
    np.testing.assert_array_equal(out, en.decode_crop(data, box, size))
    out[...] = 7
    full = en.decode(data)
    assert en.resize_crop(full, box, size, out=out) is out
    np.testing.assert_array_equal(out, en.resize_crop(full, box, size))
    sq = np.zeros((64, 64, 3), np.uint8)
    assert en.decode_center_crop(data, 64, out=sq) is sq
    np.testing.assert_array_equal(sq, en.decode_center_crop(data, 64))
    img, box2, flip = en.decode_random_crop(data, size, 1, 2, 3, out=out)
    assert img is out
    np.testing.assert_array_equal(out, en.decode_crop(data, box2, size, flip=flip))


@pytest.mark.parametrize("source", ["jpeg", "png"])
def test_out_view_with_row_stride(images, source):
    """`out` may be a view into a wider array (row stride > width*3); nothing else is touched."""
    data = images.sample("progressive-4:2:0").data if source == "jpeg" else images.other("png-rgb")
    size = (70, 90)
    big = np.full((100, 200, 3), 7, np.uint8)
    view = big[11:11 + size[0], 23:23 + size[1]]
    assert view.strides[0] == 200 * 3
    box = (5.5, 10.25, 250, 380)
    ret = en.decode_crop(data, box, size, flip=True, out=view)
    assert ret is view
    np.testing.assert_array_equal(view, en.decode_crop(data, box, size, flip=True))
    mask = np.ones(big.shape[:2], bool)
    mask[11:11 + size[0], 23:23 + size[1]] = False
    assert (big[mask] == 7).all(), "pixels outside the out view were written"


def test_canvas_out_buffer(images):
    """decode_canvas fills the first h*w*3 bytes of a larger caller buffer, returns a view."""
    for data in (images.sample("baseline-4:4:4").data, images.other("png-rgb")):
        ref, scale = en.decode_canvas(data, 60)
        buf = np.full(ref.size + 1000, 9, np.uint8)
        canvas, s2 = en.decode_canvas(data, 60, out=buf)
        assert s2 == scale and np.shares_memory(canvas, buf)
        np.testing.assert_array_equal(canvas, ref)
        assert (buf[ref.size:] == 9).all()
        ba = bytearray(ref.size)
        canvas, _ = en.decode_canvas(data, 60, out=ba)
        assert bytes(ba) == ref.tobytes()


# ---------------------------------------------------------------------------
# evaluation transform and canvas


def torchvision_center_crop(data, size, resize_side, denom=1, images=None):
    """torchvision Resize(resize_side, BILINEAR) + CenterCrop(size) on Pillow (two resamplings)."""
    with Image.open(io.BytesIO(data)) as im:
        w, h = im.size
    im = images.pil_draft(data, denom) if denom > 1 else Image.open(io.BytesIO(data)).convert("RGB")
    if w <= h:
        rw, rh = resize_side, int(resize_side * h / w)
    else:
        rh, rw = resize_side, int(resize_side * w / h)
    im = im.resize((rw, rh), Image.BILINEAR)
    top = int(round((rh - size) / 2.0))
    left = int(round((rw - size) / 2.0))
    return np.asarray(im.crop((left, top, left + size, top + size)))


@pytest.mark.parametrize("name", ["baseline-4:2:0", "gray", "cmyk-adobe", "progressive-4:4:4",
                                  "tall-2000x3", "wide-3x2000", "tiny-1x1", "odd-97x61-4:2:2"])
@pytest.mark.parametrize("size,resize_side", [(224, None), (64, 73), (32, None), (128, 300)])
def test_center_crop_matches_torchvision_pipeline(images, name, size, resize_side):
    """decode_center_crop equals Pillow Resize+CenterCrop (exact at scale 1, else DCT blur)."""
    sample = images.sample(name)
    h, w = sample.expected.shape[:2]
    side = resize_side or int(round(size / 0.875))
    got = en.decode_center_crop(sample.data, size, resize_side)
    assert got.shape == (size, size, 3)
    box = en.center_crop_box(h, w, side, size)
    np.testing.assert_array_equal(got, en.decode_crop(sample.data, box, (size, size)))
    denom = en.pick_scale(box, (size, size))
    tv = torchvision_center_crop(sample.data, size, side, images=images)
    d = images.diff(got, tv)
    if denom == 1:
        assert d.max() <= 1, f"max {d.max()}"
    else:
        assert d.mean() <= 4.0, f"1/{denom}: mean {d.mean():.2f}"
        ref = images.pil_crop(sample.data, box, (size, size), denom)
        if ref is not None:
            assert images.diff(got, ref).mean() <= 1.5


def test_center_crop_default_resize_is_size_over_0875(images):
    """The default resize side is round(size / 0.875): 256 for 224."""
    data = images.sample("baseline-4:2:0").data
    np.testing.assert_array_equal(en.decode_center_crop(data, 224),
                                  en.decode_center_crop(data, 224, 256))
    np.testing.assert_array_equal(en.decode_center_crop(data, 100),
                                  en.decode_center_crop(data, 100, 114))


@pytest.mark.parametrize("min_side", [1, 3, 37, 64, 100, 150, 299, 300, 301, 5000])
def test_canvas_shape_rule_and_pixels(jpeg_kind, images, min_side):
    """decode_canvas: coarsest DCT scale with both sides >= min_side; pixels = Pillow draft."""
    h, w = jpeg_kind.expected.shape[:2]
    canvas, scale = en.decode_canvas(jpeg_kind.data, min_side)
    d = expected_canvas_scale(h, w, min_side)
    assert scale == d
    assert canvas.shape == (math.ceil(h / d), math.ceil(w / d), 3)
    ref = images.pil_draft(jpeg_kind.data, d)
    if ref is None:
        # Pillow's draft cannot reach 1/d on a side shorter than d.  A 1/d IDCT
        # is close to the d x d block average of the edge-padded image (exactly
        # so at 1/8, where only the DC coefficient is used).
        full = en.decode(jpeg_kind.data).astype(float)
        ph, pw = canvas.shape[0] * d - h, canvas.shape[1] * d - w
        padded = np.pad(full, ((0, ph), (0, pw), (0, 0)), mode="edge")
        blocks = padded.reshape(canvas.shape[0], d, canvas.shape[1], d, 3).mean(axis=(1, 3))
        err = np.abs(canvas - blocks)
        assert err.mean() <= 10 and err.max() <= 24, (err.mean(), err.max())
        return
    assert images.diff(canvas, np.asarray(ref)).max() <= 1


# ---------------------------------------------------------------------------
# resampling alone


@pytest.mark.parametrize("name", ["astronaut", "coffee", "chelsea", "camera"])
def test_resize_crop_matches_pillow(images, name):
    """resize_crop is Pillow's antialiased BILINEAR resize(box), fractional boxes included."""
    img = images.photo(name)
    if img.ndim == 2:
        img = np.repeat(img[..., None], 3, axis=-1)
    h, w = img.shape[:2]
    rng = np.random.default_rng(19)
    cases = [((0, 0, h, w), (224, 224)), ((0, 0, h, w), (3 * h, 2 * w)),
             ((h - 1, w - 1, 1, 1), (5, 7)), ((0.25, 0.5, 0.5, 0.75), (4, 4))]
    cases += [(random_box(rng, h, w, 0.001), (int(rng.integers(1, 400)), int(rng.integers(1, 400))))
              for _ in range(40)]
    for box, size in cases:
        got = en.resize_crop(img, box, size)
        d = images.diff(got, images.pil_resize(img, box, size))
        assert d.max() <= 2 and d.mean() <= 0.5, f"box={box} size={size}: {d.max()} {d.mean()}"
    # A non-contiguous input view gives the same answer as its contiguous copy.
    view = img[::2, ::3]
    np.testing.assert_array_equal(en.resize_crop(view, (3, 4, 50, 60), (30, 30)),
                                  en.resize_crop(view.copy(), (3, 4, 50, 60), (30, 30)))


# ---------------------------------------------------------------------------
# other formats through Pillow


def test_other_format_decode_matches_pillow(other_format, images):
    """Non-JPEG formats decode to exactly Pillow's RGB conversion."""
    name, data = other_format
    img = en.decode(data)
    ref = images.pil_decode(data)
    assert img.dtype == np.uint8 and img.shape == ref.shape
    np.testing.assert_array_equal(img, ref)
    assert en.image_size(data) == ref.shape[:2]


def test_other_format_same_crop_semantics(other_format, images):
    """Non-JPEG crop/flip/random/center/canvas calls follow JPEG semantics on Pillow's pixels."""
    name, data = other_format
    rgb = images.pil_decode(data)
    h, w = rgb.shape[:2]
    rng = np.random.default_rng(23)
    for box, size in full_scale_cases(rng, h, w, 4) + [((0, 0, h, w), (8, 8))]:
        got = en.decode_crop(data, box, size)
        np.testing.assert_array_equal(got, en.resize_crop(rgb, box, size))
        assert images.diff(got, images.pil_resize(rgb, box, size)).mean() <= 1.5
        np.testing.assert_array_equal(en.decode_crop(data, box, size, flip=True), got[:, ::-1])
    img, box, flip = en.decode_random_crop(data, (32, 48), seed=3, epoch=1, sample_id=9)
    assert (box, flip) == en.random_resized_crop_params(3, 1, 9, 0, h, w)
    np.testing.assert_array_equal(img, en.decode_crop(data, box, (32, 48), flip=flip))
    center = en.decode_center_crop(data, 40)
    np.testing.assert_array_equal(
        center, en.resize_crop(rgb, en.center_crop_box(h, w, 46, 40), (40, 40)))
    for min_side in (1, 20, 10000):
        canvas, d = en.decode_canvas(data, min_side)
        assert d == expected_canvas_scale(h, w, min_side)
        ref = np.asarray(Image.fromarray(rgb).reduce(d)) if d > 1 else rgb
        np.testing.assert_array_equal(canvas, ref)


# ---------------------------------------------------------------------------
# threads


def test_threads_match_serial_results(images):
    """Concurrent decodes (GIL released, one decoder per thread) give the serial results."""
    names = ["baseline-4:2:0", "progressive-4:2:2", "cmyk-adobe", "gray", "arithmetic",
             "ycck-adobe", "restart-rows", "sampling-4:4:0"]
    jobs = []
    for i, name in enumerate(names * 4):
        data = images.sample(name).data
        h, w = images.sample(name).expected.shape[:2]
        jobs.append((data, (i % 7, i % 5, h - 10, w - 12), (60 + i, 50 + i), bool(i % 2)))
    serial = [en.decode_crop(*job) for job in jobs]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        parallel = list(pool.map(lambda job: en.decode_crop(*job), jobs))
    for a, b in zip(serial, parallel):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------
# decode_random_crop: RandomResizedCrop's parameters fused with the decode


@pytest.mark.parametrize("name", ["baseline-4:2:0", "progressive-4:4:4", "gray", "cmyk-adobe",
                                  "tall-2000x3", "tiny-1x1", "arithmetic"])
def test_decode_random_crop_equals_decode_crop(images, name):
    """decode_random_crop returns the params' box/flip and exactly decode_crop's pixels for them."""
    sample = images.sample(name)
    h, w = sample.expected.shape[:2]
    for sample_id in range(6):
        for echo in (0, 1):
            img, box, flip = en.decode_random_crop(sample.data, (56, 72), 77, 3, sample_id, echo)
            assert (box, flip) == en.random_resized_crop_params(77, 3, sample_id, echo, h, w)
            np.testing.assert_array_equal(img, en.decode_crop(sample.data, box, (56, 72),
                                                              flip=flip))


def test_decode_random_crop_custom_ranges_and_out(images):
    """Custom scale/ratio/flip_p pass through to the box; `out` is filled in place."""
    data = images.sample("baseline-4:2:2").data
    h, w = images.sample("baseline-4:2:2").expected.shape[:2]
    out = np.zeros((40, 40, 3), np.uint8)
    img, box, flip = en.decode_random_crop(data, (40, 40), 5, 6, 7, 8, scale=(0.5, 0.6),
                                           ratio=(1.0, 1.5), flip_p=1.0, out=out)
    assert img is out and flip is True
    assert (box, flip) == en.random_resized_crop_params(5, 6, 7, 8, h, w, (0.5, 0.6), (1.0, 1.5),
                                                        1.0)
    np.testing.assert_array_equal(out, en.decode_crop(data, box, (40, 40), flip=True))


def test_echoes_of_a_sample_get_different_crops(images):
    """Echo indices 0..7 of one sample re-augment it: distinct crops of the same image."""
    data = images.sample("progressive-4:2:0").data
    boxes = {en.decode_random_crop(data, (32, 32), 1, 0, 42, e)[1] for e in range(8)}
    assert len(boxes) == 8


def test_stage_profile_counts_crop_calls_and_their_time(images):
    """Decoder.profile/stages: off by default (no calls counted), on it counts each crop
    entry point once and charges every stage a share of time that adds up to no more
    than the calls' own wall time; turning it on again starts from zero; the pixels
    are the same with and without profiling."""
    import time

    data = images.sample("baseline-4:2:0").data
    dec = _kernel.Decoder()
    out, ref = np.empty((96, 128, 3), np.uint8), np.empty((96, 128, 3), np.uint8)
    box = (20.5, 30, 200, 301.25)
    dec.decode_crop(data, box, (96, 128), False, ref)
    assert dec.stages()["calls"] == 0
    dec.profile(True)
    t0 = time.perf_counter_ns()
    for k in range(5):
        dec.decode_crop(data, box, (96, 128), False, out)
        dec.decode_random_crop(data, (96, 128), 0, 0, k, 0, (0.08, 1.0), (0.75, 4 / 3), 0.5,
                               np.empty((96, 128, 3), np.uint8))
    wall = (time.perf_counter_ns() - t0) * 1e-9
    st = dec.stages()
    np.testing.assert_array_equal(out, ref)
    assert st["calls"] == 10
    spent = {k: v for k, v in st.items() if k != "calls"}
    assert set(spent) == {"header", "start", "skip", "rows", "tail", "hpass", "vpass",
                          "finish"}
    assert all(v >= 0 for v in spent.values())
    assert spent["rows"] > 0 and spent["hpass"] > 0 and spent["vpass"] > 0
    assert 0 < sum(spent.values()) <= wall
    dec.profile(False)
    dec.decode_crop(data, box, (96, 128), False, out)
    assert dec.stages() == st
    dec.profile(True)
    assert dec.stages()["calls"] == 0


@pytest.mark.parametrize("budget, shrunk", [(2**62, False), (500, True)])
def test_stage_profile_counts_canvas_calls_whole(images, budget, shrunk):
    """A canvas call is one call, and its time is all charged to some stage; only a
    canvas shrunk to its budget spends time resampling."""
    import time

    data = images.sample("baseline-4:2:0").data
    dec = _kernel.Decoder()
    out = np.empty(3 * 1024 * 1024, np.uint8)
    dec.profile(True)
    t0 = time.perf_counter_ns()
    canvas, _, _ = dec.decode_canvas(data, 16, budget, out)
    wall = (time.perf_counter_ns() - t0) * 1e-9
    st = dec.stages()
    assert st.pop("calls") == 1
    assert (canvas.shape[0] * canvas.shape[1] <= 500) == shrunk
    assert st["rows"] > 0 and st["finish"] > 0
    assert (st["hpass"] > 0 and st["vpass"] > 0) == shrunk
    assert 0 < sum(st.values()) <= wall


_SIMD_CASES = r"""
import io, sys
import numpy as np
from PIL import Image
import echo_native as en

rng = np.random.default_rng(2024)
outs = []
# Resampling alone: tiny and odd widths (rows shorter than the 16-byte loads),
# upsampling and downsampling, fractional boxes, both flips, output widths that
# are not multiples of the four pixels stored together.
for _ in range(300):
    h, w = int(rng.integers(1, 70)), int(rng.integers(1, 70))
    img = rng.integers(0, 256, (h, w, 3), np.uint8)
    bh, bw = rng.uniform(0.5, h), rng.uniform(0.5, w)
    box = (rng.uniform(0, h - bh), rng.uniform(0, w - bw), bh, bw)
    size = (int(rng.integers(1, 90)), int(rng.integers(1, 90)))
    outs.append(en.resize_crop(img, box, size, flip=bool(rng.integers(2))))
# The fused JPEG path: decoded and resampled in pieces of rows.
photo = rng.integers(0, 256, (37, 53, 3), np.uint8).repeat(7, 0).repeat(5, 1)
buf = io.BytesIO()
Image.fromarray(photo).save(buf, "JPEG", quality=90)
data = buf.getvalue()
for k in range(100):
    img, box, flip = en.decode_random_crop(data, (int(rng.integers(1, 300)),
                                                  int(rng.integers(1, 300))), 0, 0, k)
    outs.append(img)
np.savez(sys.argv[1], *outs)
"""


def test_simd_resampler_is_bit_exact_with_the_scalar_code(tmp_path):
    """The SIMD passes (AVX-512 where the CPU has it, AVX2 when capped to it:
    paired multiply-adds, grouped stores, windowed and 16-byte loads, rows
    resampled in pieces while decoding) give the scalar code's bytes on every
    case, including rows narrower than a load and outputs of any width."""
    import os
    import subprocess
    import sys

    script = tmp_path / "cases.py"
    script.write_text(_SIMD_CASES)
    runs = {}
    for name, env in (("simd", {}), ("avx2", {"ECHO_NATIVE_SIMD": "avx2"}),
                      ("scalar", {"ECHO_NATIVE_SIMD": "none"})):
        out = tmp_path / f"{name}.npz"
        subprocess.run([sys.executable, str(script), str(out)], check=True, timeout=300,
                       env={**os.environ, **env})
        runs[name] = np.load(out)
    assert {len(r.files) for r in runs.values()} == {400}
    for key in runs["scalar"].files:
        for name in ("simd", "avx2"):
            np.testing.assert_array_equal(runs[name][key], runs["scalar"][key],
                                          err_msg=f"{name} {key}")

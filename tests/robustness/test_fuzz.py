"""Fuzzing the decoders with hypothesis: random bytes, bit flips, overwrites,
truncations and spliced segments of real photographs' JPEGs (and other formats).

Every call must either return a well-formed HxWx3 uint8 array or raise
DecodeError: any other exception, a hang or a crash is a bug.  Runs are
derandomised (the same examples every run) so CI is reproducible.  Each fuzz test
runs a fifth of its budget in the default run and the whole of it as ``<name>_full``
under ``python -m pytest -m slow``; raise ECHO_NATIVE_FUZZ_SCALE to fuzz longer
locally.
"""
from __future__ import annotations

import functools
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import echo_native as en
from jpegs import fx  # the committed JPEG fixtures (tests/data/jpeg)
from echo_native import _kernel

SCALE = float(os.environ.get("ECHO_NATIVE_FUZZ_SCALE", "1"))
MAX_PIXELS = 4_000_000   # keeps lenient decodes of inflated headers quick


QUICK = 5   # the default run fuzzes 1/QUICK of each budget; ``-m slow`` the whole of it


def fuzz_settings(n):
    return settings(max_examples=max(1, int(n * SCALE)), deadline=None, database=None,
                    derandomize=True, suppress_health_check=list(HealthCheck))


def fuzz(n, **strategies):
    """The decorated body as two tests: ``n // QUICK`` examples in the default run and
    the whole budget of ``n`` under the ``slow`` marker (``python -m pytest -m slow``);
    both derandomised, so the quick run's inputs are the same every time."""
    def make(body):
        quick = fuzz_settings(max(1, n // QUICK))(given(**strategies)(body))
        full = pytest.mark.slow(fuzz_settings(n)(given(**strategies)(body)))
        return quick, full
    return make


SEED_KINDS = ["baseline-4:2:0", "progressive-4:4:4", "gray", "cmyk-adobe", "ycck-adobe",
              "arithmetic-progressive", "restart-rows", "sampling-4:4:0", "many-scans-190"]


#: Seeds read from tests/data/jpeg (small files of the kinds Pillow cannot write).
FIXTURE_SEEDS = {"ycck-adobe": "ycck-adobe.jpg", "arithmetic-progressive":
                 "arith-progressive-restart.jpg", "sampling-4:4:0": "sampling-440.jpg",
                 "many-scans-190": "progressive-190-scans.jpg"}


@functools.lru_cache(maxsize=None)
def seed_files(images):
    """Small JPEGs of photographs (every coding variant), the fuzzing starting points."""
    out = []
    for name in SEED_KINDS:
        sample = images.sample(name)
        img = sample.source[:40, :56]
        if name == "gray":
            data = images.pil_jpeg(img[..., 0], 85)
        elif name in FIXTURE_SEEDS:  # variants Pillow cannot write: committed files
            data = fx.read(FIXTURE_SEEDS[name])
        elif name.startswith("cmyk"):
            data = images.pil_encode(images.rgb_to_ink(img), "JPEG", "CMYK", quality=85)
        elif name == "restart-rows":
            data = images.pil_jpeg(img, 85, restart_marker_rows=1)
        elif name == "progressive-4:4:4":
            data = images.pil_jpeg(img, 85, subsampling="4:4:4", progressive=True)
        else:
            data = images.pil_jpeg(img, 85)
        en.decode(data)   # every seed is valid
        out.append(data)
    return tuple(out)


class Seeds:
    """Holds the seed files without letting hypothesis print them in every report."""

    def __init__(self, files):
        self.files = files

    def __getitem__(self, i):
        return self.files[i]

    def __repr__(self):
        return f"<{len(self.files)} seed JPEGs: {', '.join(SEED_KINDS)}>"


@pytest.fixture(scope="module")
def seeds(images):
    """The seed JPEGs, built once."""
    return Seeds(seed_files(images))


@pytest.fixture(autouse=True)
def still_correct_afterwards(images):
    """After each fuzz test, this thread's decoder still decodes real files like Pillow."""
    yield
    for name in ("baseline-4:2:0", "progressive-4:2:2", "cmyk-adobe", "arithmetic"):
        s = images.sample(name)
        assert np.abs(en.decode(s.data).astype(int) - s.expected).max() <= 1
        h, w = s.expected.shape[:2]
        crop = en.decode_crop(s.data, (5, 7, h - 10, w - 20), (64, 64))
        ref = images.pil_crop(s.data, (5, 7, h - 10, w - 20), (64, 64), 1)
        assert np.abs(crop.astype(int) - ref).mean() <= 1.5


def outcome(fn, *args, **kwargs):
    """Run one decode: a well-formed image, or None for DecodeError; anything else fails."""
    try:
        img = fn(*args, **kwargs)
    except en.DecodeError as e:
        assert str(e), "DecodeError without a message"
        return None
    if isinstance(img, tuple):
        img = img[0]
    assert isinstance(img, np.ndarray) and img.dtype == np.uint8
    assert img.ndim == 3 and img.shape[2] == 3 and min(img.shape) >= 1
    return img


def exercise(data, strict, box_frac=(0.1, 0.2, 0.5, 0.6), size=(12, 16)):
    """Every decoding entry point on one input; checks shapes agree with the header."""
    img = outcome(en.decode, data, strict=strict, max_pixels=MAX_PIXELS)
    if img is not None:
        # The header the decode used declares the shape it returned.
        info = _kernel.Decoder(max_pixels=MAX_PIXELS, strict=strict).info(data)
        assert info[:2] == img.shape[:2]
        if strict:
            assert en.image_size(data, max_pixels=MAX_PIXELS) == img.shape[:2]
        h, w = img.shape[:2]
        t, l, bh, bw = box_frac
        box = (t * h, l * w, max(bh * h, 0.5), max(bw * w, 0.5))
        box = (min(box[0], h - box[2]), min(box[1], w - box[3]), box[2], box[3])
        crop = outcome(en.decode_crop, data, box, size, strict=strict, max_pixels=MAX_PIXELS)
        assert crop is None or crop.shape == (*size, 3)
    outcome(en.decode_canvas, data, 8, strict=strict, max_pixels=MAX_PIXELS)
    outcome(en.decode_random_crop, data, size, 1, 2, 3, strict=strict, max_pixels=MAX_PIXELS)
    return img


def _random_bytes(data, prefix):
    """Arbitrary bytes (with and without a JPEG SOI in front) never escape as another exception."""
    exercise(prefix + data, strict=True)
    exercise(prefix + data, strict=False)


test_random_bytes, test_random_bytes_full = fuzz(
    2500, data=st.binary(max_size=1500),
    prefix=st.sampled_from([b"", b"\xff\xd8", b"\xff\xd8\xff"]))(_random_bytes)


def _valid_headers_random_entropy_data(seeds, which, body, strict):
    """Real tables and frame header followed by random entropy-coded data."""
    data = seeds[which]
    sos = data.find(b"\xff\xda")
    sos_end = sos + 2 + int.from_bytes(data[sos + 2:sos + 4], "big")
    img = exercise(data[:sos_end] + body + b"\xff\xd9", strict=strict)
    if img is not None:
        assert img.shape[:2] == en.image_size(data)


test_valid_headers_random_entropy_data, test_valid_headers_random_entropy_data_full = fuzz(
    1000, which=st.integers(0, len(SEED_KINDS) - 1), body=st.binary(min_size=0, max_size=3000),
    strict=st.booleans())(_valid_headers_random_entropy_data)


def _bit_flips(seeds, which, flips, header_bias, strict):
    """1-8 bit flips anywhere (or concentrated in the headers and tables) of every seed kind."""
    data = bytearray(seeds[which])
    span = data.find(b"\xff\xda") + 14 if header_bias else len(data)
    for frac, bit in flips:
        data[int(frac * span)] ^= 1 << bit
    exercise(bytes(data), strict=strict)


test_bit_flips, test_bit_flips_full = fuzz(
    4000, which=st.integers(0, len(SEED_KINDS) - 1),
    flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 7)),
                   min_size=1, max_size=8),
    header_bias=st.booleans(), strict=st.booleans())(_bit_flips)


def _overwrites_truncation_and_splices(seeds, which, edits, cut, splice, strict):
    """Byte overwrites, truncation at any point and a marker segment copied elsewhere."""
    data = bytearray(seeds[which])
    for frac, blob in edits:
        pos = int(frac * len(data))
        data[pos:pos + len(blob)] = blob
    if splice:
        # Copy the segment starting at the first marker after `cut` to the front.
        start = data.find(b"\xff", 2 + int(cut * (len(data) - 2)))
        if start > 0:
            end = data.find(b"\xff", start + 2)
            data[2:2] = data[start:end if end > 0 else len(data)]
    else:
        data = data[:max(0, int(cut * len(data)))]
    exercise(bytes(data), strict=strict)


test_overwrites_truncation_and_splices, test_overwrites_truncation_and_splices_full = fuzz(
    1500, which=st.integers(0, len(SEED_KINDS) - 1),
    edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True),
                             st.binary(min_size=1, max_size=6)), max_size=4),
    cut=st.floats(0.0, 1.0), splice=st.booleans(),
    strict=st.booleans())(_overwrites_truncation_and_splices)


def _other_formats_bit_flips(images, fmt, flips, cut):
    """Corrupted PNG/GIF/BMP/WebP/TIFF through the Pillow path: an image or DecodeError."""
    data = bytearray(images.other(fmt)[:20000])   # small prefix: truncation included
    for frac, bit in flips:
        data[int(frac * len(data))] ^= 1 << bit
    data = bytes(data[:max(1, int(cut * len(data)))])
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # Pillow warns about truncated/odd files
        exercise(data, strict=True)


test_other_formats_bit_flips, test_other_formats_bit_flips_full = fuzz(
    600, fmt=st.sampled_from(["png-rgb", "png-rgba", "gif", "bmp", "webp-lossless", "tiff"]),
    flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 7)),
                   min_size=1, max_size=6),
    cut=st.floats(0.3, 1.0))(_other_formats_bit_flips)


def test_many_decoders_after_fuzzing_match_pillow(images):
    """After all the fuzzing above, every input kind still decodes exactly like Pillow."""
    for name in images.KIND_NAMES:
        s = images.sample(name)
        assert np.abs(en.decode(s.data).astype(int) - s.expected).max() <= 1, name

"""Bad input: every failure is a DecodeError (or ValueError/TypeError for bad
arguments) that says what is wrong, never a hang (each test has a timeout) and
never a crash.  Where failing fast is the point (the pixel and scan limits), the
``timing`` tests bound the time too.

Broken files are made by byte surgery on real photographs' JPEGs: the frame
header (SOF), the tables (DQT, DHT), the scan header (SOS) and the entropy data.
"""
from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import textwrap
import time
import tracemalloc

import numpy as np
import pytest

import echo_native as en
from echo_native import _kernel

# The committed JPEG fixtures (tests/data/jpeg/): the variants Pillow cannot write.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "data"))
import jpeg_fixtures as fx  # noqa: E402

# Hang guard for every test here: a hostile input must never hang the decoder.
pytestmark = pytest.mark.timeout(120)

# Bound of the `timing` tests, where failing fast is the behaviour (the pixel and
# scan limits exist to bound the work a hostile file can cause): about 6x the
# slowest such refusal measured on a 2-core machine (0.33 s: 999 scans of a
# 300 x 451 image read leniently before max_scans=999 stops it).
FAST_S = 2.0


def raises_decode_error(pattern, fn, *args, **kwargs):
    """Assert fn(*args) raises DecodeError (a ValueError) matching pattern; return it."""
    with pytest.raises(en.DecodeError, match=pattern) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, ValueError)
    return info.value


def raises_fast(pattern, fn, *args, **kwargs):
    """raises_decode_error, for at most FAST_S seconds of this thread's CPU (where the
    decoder runs; CPU time, which other load on the machine does not inflate)."""
    t0 = time.thread_time()
    err = raises_decode_error(pattern, fn, *args, **kwargs)
    spent = time.thread_time() - t0
    assert spent < FAST_S, f"took {spent:.3f} s of CPU to fail"
    return err


ALL_CALLS = {
    "decode": lambda data, **kw: en.decode(data, **kw),
    "decode_crop": lambda data, **kw: en.decode_crop(data, (0, 0, 1, 1), (1, 1), **kw),
    "decode_random_crop": lambda data, **kw: en.decode_random_crop(data, (8, 8), 0, 0, 0, **kw),
    "decode_center_crop": lambda data, **kw: en.decode_center_crop(data, 8, **kw),
    "decode_canvas": lambda data, **kw: en.decode_canvas(data, 8, **kw),
}


@pytest.fixture(scope="module")
def jpeg(images):
    """A baseline 4:2:0 JPEG of a photograph (300 x 451)."""
    return images.sample("baseline-4:2:0").data


@pytest.fixture(scope="module")
def progressive(images):
    """A progressive 4:2:0 JPEG of a photograph (300 x 451)."""
    return images.sample("progressive-4:2:0").data


def assert_still_decodes(images, name="baseline-4:2:0"):
    s = images.sample(name)
    assert np.abs(en.decode(s.data).astype(int) - s.expected).max() <= 1


# ---------------------------------------------------------------------------
# not an image at all


@pytest.mark.parametrize("call", sorted(ALL_CALLS))
def test_empty_input(call):
    """Zero bytes: DecodeError saying the input is empty, from every entry point."""
    raises_decode_error("empty", ALL_CALLS[call], b"")


@pytest.mark.parametrize("data", [
    b"\x00", b"hello", bytes(range(256)) * 8, b"GIF89a" + b"\x00" * 40,
    b"\x89PNG\r\n\x1a\n" + b"\x00" * 30, b"RIFF\x10\x00\x00\x00WEBPVP8 ",
])
def test_non_image_bytes(data):
    """Bytes no decoder recognises (or broken other-format headers) give DecodeError
    saying so, with no object address in the message."""
    pattern = r"not an image: no format recognised|not a decodable image"
    for err in (raises_decode_error(pattern, en.decode, data),
                raises_decode_error(pattern, en.decode_crop, data, (0, 0, 1, 1), (1, 1))):
        assert "object at 0x" not in str(err)
    with pytest.raises(en.DecodeError):
        en.image_size(data)


def test_text_file_named_jpg(tmp_path):
    """A text file with a .jpg name is refused as not an image, with its size and first bytes."""
    path = tmp_path / "holiday.jpg"
    path.write_text("This is not a photograph.\n" * 20)
    raises_decode_error(r"not an image: no format recognised \(520 bytes, starting b'This is '\)",
                        en.decode, path.read_bytes())


@pytest.mark.parametrize("data", [b"\xff\xd8", b"\xff\xd8\xff", b"\xff\xd8\xff\xd9"])
def test_bare_jpeg_markers(data):
    """An SOI with nothing behind it is reported as a truncated JPEG / a JPEG with no image."""
    raises_decode_error("truncated JPEG|contains no image|Premature end", en.decode, data)


# ---------------------------------------------------------------------------
# truncation


def _input(images, name):
    """(bytes, Pillow's decode) of a conftest input kind or a committed fixture (*.jpg)."""
    if name.endswith(".jpg"):
        data = fx.read(name)
        return data, images.pil_decode(data)
    sample = images.sample(name)
    return sample.data, sample.expected


# Arithmetic-coded inputs are committed fixtures (jpegtran -arithmetic; Pillow cannot
# write them).
TRUNCATION_INPUTS = ["baseline-4:2:0", "progressive-4:2:0", "gray", "arith-sequential.jpg",
                     "arith-progressive-restart.jpg", "restart-blocks", "cmyk-adobe"]


@pytest.mark.parametrize("name", TRUNCATION_INPUTS)
@pytest.mark.parametrize("keep", [0.3, 0.6, 0.95])
def test_truncated_strict_raises(images, name, keep):
    """Strict mode refuses a JPEG cut short, naming the premature end."""
    data, expected = _input(images, name)
    cut = data[:int(len(data) * keep)]
    raises_decode_error(r"(?i)premature end", en.decode, cut)
    h, w = expected.shape[:2]
    # A crop reaching the bottom rows needs the missing data too.
    raises_decode_error(r"(?i)premature end", en.decode_crop, cut, (h - 20, 0, 20, w), (10, 10))


@pytest.mark.parametrize("name", TRUNCATION_INPUTS)
def test_truncated_lenient_returns_image(images, name):
    """strict=False returns a full-size image whose top rows are the real picture."""
    data, expected = _input(images, name)
    h, w = expected.shape[:2]
    cut = data[:int(len(data) * 0.7)]
    img = en.decode(cut, strict=False)
    assert img.shape == (h, w, 3) and img.dtype == np.uint8
    crop = en.decode_crop(cut, (0, 0, h, w), (h // 2, w // 2), strict=False)
    assert crop.shape == (h // 2, w // 2, 3)
    if "progressive" not in name:
        # Sequential files decode top-down: the first quarter of the rows is intact.
        top = h // 4
        assert np.abs(img[:top].astype(int) - expected[:top]).max() <= 1
    if name.startswith("arith-"):
        return   # what follows a truncation differs between libjpeg-turbo versions here
    # Pillow decodes the same truncated file with the same libjpeg recovery.
    from PIL import Image, ImageFile
    import io
    ImageFile.LOAD_TRUNCATED_IMAGES = True
    try:
        ref = np.asarray(Image.open(io.BytesIO(cut)).convert("RGB"))
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = False
    assert np.abs(img.astype(int) - ref).mean() <= 1.0


# ---------------------------------------------------------------------------
# corrupt headers and tables


def _dht(images, data):
    return images.find_segment(data, 0xC4)


def _dqt(images, data):
    return images.find_segment(data, 0xDB)


def _sof(images, data):
    return images.find_segment(data, images.SOF_MARKERS)


def _sos(images, data):
    return images.find_segment(data, 0xDA)


CORRUPTIONS = {
    # name: (function(images, data) -> corrupted bytes, message pattern)
    "huffman-counts-overflow": (lambda im, d: im.patch(d, _dht(im, d) + 5, bytes([255] * 16)),
                                "Bogus Huffman table"),
    "huffman-bad-index": (lambda im, d: im.patch(d, _dht(im, d) + 4, bytes([0x1F])),
                          "Bogus DHT index"),
    "huffman-bad-symbols": (lambda im, d: im.patch(d, _dht(im, d) + 21, b"\xff" * 4),
                            "Bogus Huffman table"),
    "huffman-undefined": (lambda im, d: im.patch(d, _sos(im, d) + 6, bytes([0x33])),
                          "Huffman table 0x03 was not defined"),
    "quant-bad-index": (lambda im, d: im.patch(d, _dqt(im, d) + 4, bytes([0x0F])),
                        "Bogus DQT index"),
    "quant-bad-precision": (lambda im, d: im.patch(d, _dqt(im, d) + 4, bytes([0x20])),
                            "Bogus marker length|Bogus DQT"),
    "quant-zeros": (lambda im, d: im.patch(d, _dqt(im, d) + 5, bytes(64)),
                    "quantization table 0: entry 0 is zero"),
    "quant-undefined": (lambda im, d: im.patch(d, _sof(im, d) + 12, bytes([3])),
                        "Quantization table 0x03 was not defined"),
    "marker-length-short": (lambda im, d: im.patch(d, _dqt(im, d) + 2, b"\x00\x03"),
                            "Bogus marker length"),
    "sof-no-components": (lambda im, d: im.patch(d, _sof(im, d) + 9, b"\x00"),
                          "Empty JPEG image|Bogus"),
    "sof-bad-sampling": (lambda im, d: im.patch(d, _sof(im, d) + 11, b"\x55"),
                         "Bogus sampling factors"),
    "sof-zero-sampling": (lambda im, d: im.patch(d, _sof(im, d) + 11, b"\x00"),
                          "Bogus sampling factors"),
    "sos-bad-component": (lambda im, d: im.patch(d, _sos(im, d) + 5, b"\x09"),
                          "Invalid component ID 9 in SOS"),
    "sos-too-many-components": (lambda im, d: im.patch(d, _sos(im, d) + 4, b"\x05"),
                                "Bogus marker length"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_tables_and_headers(images, jpeg, corruption):
    """Each corrupt table/header is a DecodeError naming the defect, from every entry point."""
    make, pattern = CORRUPTIONS[corruption]
    bad = make(images, jpeg)
    assert bad != jpeg and len(bad) == len(jpeg)
    for call in ALL_CALLS.values():
        raises_decode_error(pattern, call, bad)
    assert_still_decodes(images)


@pytest.mark.parametrize("name", ["baseline-4:2:0", "progressive-4:2:0", "restart-blocks"])
def test_corrupt_entropy_data(images, name):
    """Broken entropy-coded data is refused in strict mode wherever the decode reaches it."""
    data = images.sample(name).data
    h, w = images.sample(name).expected.shape[:2]
    bad = images.patch(data, len(data) // 2, b"\xff\x17" * 8)   # a reserved marker mid-scan
    pattern = r"(?i)corrupt JPEG data|premature end"
    raises_decode_error(pattern, en.decode, bad)
    raises_decode_error(pattern, en.decode_canvas, bad, 8)
    raises_decode_error(pattern, en.decode_crop, bad, (0, 0, h, w), (16, 16))
    # Lenient mode: an unknown marker mid-scan is fatal unless restart markers let
    # libjpeg resynchronise, in which case the image comes back.
    if name == "restart-blocks":
        assert en.decode(bad, strict=False).shape == (h, w, 3)
    else:
        raises_decode_error("Unsupported marker type 0x17", en.decode, bad, strict=False)
    # A byte flip without markers is only a warning: lenient mode returns an image.
    flipped = images.patch(data, len(data) // 2, bytes([data[len(data) // 2] ^ 0x5A]))
    if flipped[len(data) // 2] != 0xFF and data[len(data) // 2 - 1] != 0xFF:
        assert en.decode(flipped, strict=False).shape == (h, w, 3)


@pytest.mark.timeout(60)   # hang guard: ~1000 decodes of a 300 x 451 photo take ~0.3 s
@pytest.mark.parametrize("flip_at", ["DQT", "DHT"])
def test_table_bit_flips_never_escape(images, jpeg, flip_at):
    """Every single-bit flip in the quantisation / Huffman tables decodes or raises DecodeError."""
    start = images.find_segment(jpeg, 0xDB if flip_at == "DQT" else 0xC4)
    length = int.from_bytes(jpeg[start + 2:start + 4], "big")
    raised = 0
    for offset in range(start, start + 2 + min(length, 60)):
        for bit in range(8):
            bad = bytearray(jpeg)
            bad[offset] ^= 1 << bit
            try:
                img = en.decode(bytes(bad))
            except en.DecodeError:
                raised += 1
            else:
                assert img.ndim == 3 and img.shape[2] == 3 and img.dtype == np.uint8
    assert raised > 0
    assert_still_decodes(images)


# ---------------------------------------------------------------------------
# dimensions


@pytest.mark.parametrize("hw", [(0, 0), (0, 451), (300, 0)])
def test_zero_dimensions(images, jpeg, hw):
    """A frame header declaring an empty image is refused."""
    bad = images.set_sof_size(jpeg, *hw)
    for call in ALL_CALLS.values():
        raises_decode_error("Empty JPEG image|empty image", call, bad)


def test_decompression_bomb_refused_before_allocation(images, jpeg):
    """65500 x 65500 trips the pixel limit from the header alone: fast, without allocating.

    Timing is the behaviour: the limit must refuse from the header, before any work
    (decoding even a fraction of 4.3 gigapixels would take far longer than FAST_S).
    """
    bomb = images.set_sof_size(jpeg, 65500, 65500)
    tracemalloc.start()
    try:
        for call in ALL_CALLS.values():
            raises_fast(r"65500x65500 = 4290250000 pixels.*max_pixels=89478485", call, bomb)
        with pytest.raises(en.DecodeError, match="decompression-bomb"):
            en.image_size(bomb)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20 * 2**20, f"{peak / 2**20:.0f} MiB allocated before refusing"


def test_dimension_over_jpeg_maximum(images, jpeg):
    """65535 x 65535 exceeds libjpeg's maximum dimension and is refused by name."""
    raises_decode_error("Maximum supported image dimension", en.decode,
                        images.set_sof_size(jpeg, 65535, 65535))


def test_max_pixels_is_configurable_and_exact(jpeg):
    """max_pixels refuses images strictly larger than it and accepts one exactly at it."""
    h, w = en.image_size(jpeg)
    assert en.decode(jpeg, max_pixels=h * w).shape == (h, w, 3)
    raises_decode_error(f"{w}x{h} = {h * w} pixels", en.decode, jpeg, max_pixels=h * w - 1)
    raises_decode_error("max_pixels", en.decode_crop, jpeg, (0, 0, 10, 10), (5, 5),
                        max_pixels=1000)
    with pytest.raises(ValueError, match="positive"):
        en.decode(jpeg, max_pixels=0)


def test_other_format_bomb_refused(images):
    """A PNG whose header declares 65500 x 65500 is refused by the same limit, fast.

    Timing is the behaviour: the refusal comes from the header, before Pillow decodes.
    """
    import struct
    import zlib
    png = bytearray(images.other("png-1x1"))
    assert png[12:16] == b"IHDR"
    png[16:24] = struct.pack(">II", 65500, 65500)
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])))
    for call in ALL_CALLS.values():
        raises_fast(r"(?i)decompression.bomb", call, bytes(png))


# ---------------------------------------------------------------------------
# the committed JPEG fixtures (tests/data/jpeg/: the variants Pillow cannot write)


def test_committed_fixtures_are_the_variants_they_are_named_for():
    """Every file in tests/data/jpeg/ is listed in jpeg_fixtures.FIXTURES and its README, and
    has the frame type, precision, scan count and restart interval its entry gives."""
    on_disk = sorted(f for f in os.listdir(fx.DIR) if f.endswith(".jpg"))
    assert on_disk == sorted(fx.FIXTURES)
    with open(os.path.join(fx.DIR, "README.md")) as f:
        readme = f.read()
    for name, spec in fx.FIXTURES.items():
        st = fx.structure(fx.read(name))
        want = (spec.sof, spec.precision, spec.scans, (spec.restart,) if spec.restart else ())
        assert (st.sof, st.precision, st.scans, st.restart) == want, name
        assert (st.rst_markers > 0) == bool(spec.restart), name
        assert f"| `{name}` |" in readme, name


# Every committed fixture the decoder supports (all but the lossless and 12-bit files).
DECODABLE_FIXTURES = [n for n in fx.FIXTURES
                      if not n.startswith(("lossless-", "twelve-bit-"))]


@pytest.mark.parametrize("name", DECODABLE_FIXTURES)
def test_committed_fixture_decodes_to_pillows_pixels(images, name):
    """Each supported variant (arithmetic, custom and many-scan progressive, restart
    intervals, 4:4:0 / 4:1:1 sampling with partial MCUs, plain CMYK, YCCK) decodes to
    exactly Pillow's pixels, and an unscaled crop is exactly that part of the image."""
    data = fx.read(name)
    full = en.decode(data, max_scans=2000)
    np.testing.assert_array_equal(full, images.pil_decode(data))
    h, w = full.shape[:2]
    top, left, ch, cw = h // 3, w // 4, h // 2, w // 2
    np.testing.assert_array_equal(
        en.decode_crop(data, (top, left, ch, cw), (ch, cw), max_scans=2000),
        full[top:top + ch, left:left + cw])


# ---------------------------------------------------------------------------
# unsupported coding processes


def test_twelve_bit_refused_by_name(images, jpeg):
    """12-bit (SOF0 or SOF1 with precision 12) and 16-bit samples are refused, saying so."""
    sof = _sof(images, jpeg)
    for marker in (0xC0, 0xC1):
        bad = images.patch(jpeg, sof + 1, bytes([marker]))
        bad = images.patch(bad, sof + 4, bytes([12]))
        err = raises_decode_error("precision 12", en.decode, bad)
        assert "8-bit" in str(err)
    raises_decode_error("precision 16", en.decode, images.patch(jpeg, sof + 4, bytes([16])))


@pytest.mark.parametrize("marker,name", [(0xC3, "lossless"), (0xCB, "lossless"),
                                         (0xC5, "hierarchical"), (0xC7, "hierarchical lossless")])
def test_lossless_and_hierarchical_refused_by_name(images, jpeg, marker, name):
    """Lossless (SOF3/SOF11) and hierarchical frames are refused with the process named."""
    bad = images.patch(jpeg, _sof(images, jpeg) + 1, bytes([marker]))
    for call in ALL_CALLS.values():
        raises_decode_error(f"SOF type 0x{marker:02x} \\({name} JPEG is not supported\\)", call, bad)


def test_extended_sequential_8bit_decodes(images, jpeg):
    """SOF1 (extended sequential, 8-bit, Huffman) is a supported process and decodes like SOF0."""
    ext = images.patch(jpeg, _sof(images, jpeg) + 1, b"\xc1")
    np.testing.assert_array_equal(en.decode(ext), en.decode(jpeg))


# Real files of the unsupported processes (committed fixtures, written by libjpeg-turbo 3):
# the byte-patched frames above only relabel a baseline file; these carry real lossless
# predictors and 12-bit tables and data.
LOSSLESS_FILES = ["lossless-rgb.jpg", "lossless-gray-16bit.jpg"]


def _refused_by_every_call(data, pattern):
    for call in ALL_CALLS.values():
        raises_decode_error(pattern, call, data)
        raises_decode_error(pattern, call, data, strict=False)
    raises_decode_error(pattern, en.image_size, data)


@pytest.mark.parametrize("name", LOSSLESS_FILES)
def test_real_lossless_file_refused_by_name(name):
    """A lossless JPEG (SOF3, 8-bit RGB or 16-bit gray) is refused by every entry point,
    strict or not, naming the lossless process."""
    data = fx.read(name)
    st = fx.structure(data)
    assert (st.sof, st.precision) == (0xC3, fx.FIXTURES[name].precision)
    _refused_by_every_call(data, re.escape(fx.UNSUPPORTED_LOSSLESS))


def test_real_twelve_bit_file_refused_by_name():
    """A 12-bit JPEG (SOF1, precision 12) is refused by every entry point, strict or not,
    saying that only 8-bit JPEG is supported."""
    data = fx.read("twelve-bit-rgb.jpg")
    st = fx.structure(data)
    assert (st.sof, st.precision) == (0xC1, 12)
    _refused_by_every_call(data, re.escape(fx.UNSUPPORTED_12BIT))


def test_unsupported_files_in_a_folder_are_skipped_by_name(tmp_path):
    """Among the committed fixtures, on_error='skip' drops exactly the lossless, 12-bit and
    over-the-scan-limit files, each warned about with its path and reason; every other
    file is delivered once."""
    refusals = {"lossless-rgb.jpg": fx.UNSUPPORTED_LOSSLESS,
                "lossless-gray-16bit.jpg": fx.UNSUPPORTED_LOSSLESS,
                "twelve-bit-rgb.jpg": fx.UNSUPPORTED_12BIT,
                "progressive-1135-scans.jpg": "more than 256 scans"}
    for i, name in enumerate(sorted(fx.FIXTURES)):
        folder = tmp_path / f"class_{i % 2}"
        folder.mkdir(exist_ok=True)
        (folder / name).write_bytes(fx.read(name))
    src = en.ImageFolder(tmp_path)
    names = [os.path.basename(src.path(i)) for i in range(len(src))]
    assert sorted(names) == sorted(fx.FIXTURES)
    import warnings
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with en.Loader(src, batch_size=4, image_size=32, workers=1, seed=0, on_error="skip",
                       worker_mode="thread") as loader:
            ids = [int(i) for b in loader for i in b.sample_ids]
            failures = loader.stats()["failures"]
    assert sorted(ids) == [i for i, n in enumerate(names) if n not in refusals]
    assert failures == {"decode": len(refusals)}
    messages = [str(w.message) for w in rec if issubclass(w.category, en.SampleFailureWarning)]
    for name, reason in refusals.items():
        path = src.path(names.index(name))
        assert any(m.startswith(f"{path}: ") and reason in m for m in messages), (name, messages)


# ---------------------------------------------------------------------------
# progressive scan limit


def _duplicate_last_scan(images, data, copies):
    """The progressive JPEG with its last scan repeated (libjpeg warns: bogus progression)."""
    last_sos = data.rfind(b"\xff\xda")
    eoi = data.rfind(b"\xff\xd9")
    scan = data[last_sos:eoi]
    return data[:eoi] + scan * copies + data[eoi:]


def test_scan_limit_valid_file_over_1000_scans(images):
    """A valid 1135-scan progressive file is refused at the default limit by every entry
    point, and decodes to Pillow's pixels when allowed."""
    data = fx.read("progressive-1135-scans.jpg")
    assert images.count_scans(data) == 1135
    err = raises_decode_error(r"more than 256 scans \(max_scans\)", en.decode, data)
    assert isinstance(err, ValueError)
    for call in ALL_CALLS.values():
        raises_decode_error("max_scans", call, data)
    img = en.decode(data, max_scans=2000)
    np.testing.assert_array_equal(img, images.pil_decode(data))


# Valid progressive files of many scans: Pillow's standard progression, a custom scan
# script with successive approximation (cjpeg -scans), the most scans cjpeg writes, and
# libjpeg scripts of one scan per coefficient (the last three are committed fixtures).
SCAN_FILES = ["progressive-4:2:0", "progressive-script.jpg", "progressive-97-scans.jpg",
              "progressive-190-scans.jpg", "progressive-1135-scans.jpg"]


@pytest.mark.parametrize("name", SCAN_FILES)
def test_scan_limit_is_exact(images, name):
    """max_scans=N decodes a valid N-scan file to Pillow's pixels and refuses it at N-1;
    the default limit (256) decides the same way."""
    if name in fx.FIXTURES:
        data, n = fx.read(name), fx.FIXTURES[name].scans
        assert images.count_scans(data) == n
    else:
        data = images.sample(name).data
        n = images.count_scans(data)
    ref = images.pil_decode(data)
    np.testing.assert_array_equal(en.decode(data, max_scans=n), ref)
    raises_decode_error(f"more than {n - 1} scans", en.decode, data, max_scans=n - 1)
    h, w = en.image_size(data)
    box = (h // 4, w // 4, h // 2, w // 2)
    assert en.decode_crop(data, box, (9, 9), max_scans=n).shape == (9, 9, 3)
    raises_decode_error(f"more than {n - 1} scans", en.decode_crop, data, box, (9, 9),
                        max_scans=n - 1)
    if n <= 256:
        np.testing.assert_array_equal(en.decode(data), ref)
    else:
        raises_decode_error(r"more than 256 scans \(max_scans\)", en.decode, data)


def test_scan_limit_repeated_scans(images, progressive):
    """Thousands of repeated scans: bogus progression (strict) or max_scans (lenient) refuse.

    Timing is the behaviour: the scan limit exists to bound the work such a file causes
    (read in full, the 2000 scans take about twice as long as the 999 allowed here).
    """
    data = _duplicate_last_scan(images, progressive, 2000)
    assert images.count_scans(data) > 2000
    raises_fast(r"(?i)progression|scans", en.decode, data)
    raises_fast(r"more than 256 scans", en.decode, data, strict=False)
    raises_fast(r"more than 999 scans", en.decode, data, strict=False, max_scans=999)


# ---------------------------------------------------------------------------
# arithmetic coding (supported: libjpeg-turbo decodes it)


ARITH_FILES = ["arith-sequential.jpg", "arith-progressive.jpg", "arith-restart.jpg",
               "arith-progressive-restart.jpg"]


@pytest.mark.parametrize("name", ARITH_FILES)
def test_arithmetic_transcode_decodes_to_the_source_pixels(images, name):
    """A JPEG losslessly re-coded with jpegtran -arithmetic (sequential, progressive, with
    restart markers) gives the Huffman original's pixels, and Pillow's, from every path."""
    arith, src = fx.read(name), fx.read("chelsea-baseline.jpg")
    assert fx.structure(arith).sof == fx.FIXTURES[name].sof in (0xC9, 0xCA)
    assert fx.structure(src).sof == 0xC0
    full = en.decode(arith)
    np.testing.assert_array_equal(full, en.decode(src))
    np.testing.assert_array_equal(full, images.pil_decode(arith))
    # A crop inside, one reaching the bottom-right corner, one DCT-scaled by 1/8.
    for box, size in (((10, 20, 60, 90), (32, 48)), ((50, 64, 46, 64), (46, 64)),
                      ((0, 0, 96, 128), (12, 16))):
        np.testing.assert_array_equal(en.decode_crop(arith, box, size),
                                      en.decode_crop(src, box, size))
    np.testing.assert_array_equal(en.decode_canvas(arith, 24)[0], en.decode_canvas(src, 24)[0])


def test_arithmetic_corrupt_is_decode_error(images):
    """Corrupt arithmetic-coded data is reported (strict) or decoded leniently, never a crash."""
    data = fx.read("arith-sequential.jpg")
    shape = images.pil_decode(data).shape
    rng = np.random.default_rng(4)
    for _ in range(20):
        bad = bytearray(data)
        for pos in rng.integers(700, len(data) - 2, size=3):
            bad[pos] = int(rng.integers(0, 255)) if bad[pos] != 0xFF else 0xFF
        bad = bytes(bad)
        with pytest.raises(en.DecodeError, match=r"(?i)corrupt|arithmetic|premature|marker"):
            en.decode(bad)
        try:
            img = en.decode(bad, strict=False)
        except en.DecodeError:
            pass
        else:
            assert img.shape == shape


# ---------------------------------------------------------------------------
# bad arguments


def test_bad_data_types():
    """Non-bytes data is a TypeError naming the type."""
    for bad in (None, "x.jpg", 5, 1.5, [0xFF, 0xD8], np.zeros((4, 4), np.uint8),
                np.zeros(8, np.float32)):
        with pytest.raises(TypeError, match="bytes-like"):
            en.decode(bad)
        with pytest.raises(TypeError):
            en.decode_crop(bad, (0, 0, 1, 1), (1, 1))


@pytest.mark.parametrize("box", [(-1, 0, 10, 10), (0, -0.5, 10, 10), (0, 0, 301, 10),
                                 (0, 0, 10, 452), (290, 0, 11, 10), (0, 445, 10, 7),
                                 (0, 0, 0, 10), (0, 0, 10, -3), (float("nan"), 0, 10, 10),
                                 (0, 0, float("inf"), 10)])
def test_box_outside_image(images, jpeg, box):
    """A box not inside the image is a ValueError saying so (JPEG and Pillow paths, resize_crop)."""
    with pytest.raises(ValueError, match="not inside the 300x451 image") as info:
        en.decode_crop(jpeg, box, (8, 8))
    assert not isinstance(info.value, en.DecodeError), "a bad argument is not a bad file"
    with pytest.raises(ValueError, match="not inside"):
        en.decode_crop(images.other("png-rgb"), box, (8, 8))
    with pytest.raises(ValueError, match="not inside"):
        en.resize_crop(images.sample("baseline-4:2:0").expected, box, (8, 8))


@pytest.mark.parametrize("box", [(0, 0, 10), "abcd", None, 5, (0, 0, "a", 4)])
def test_box_wrong_type(jpeg, box):
    """A box that is not four numbers is a TypeError/ValueError."""
    with pytest.raises((TypeError, ValueError), match="box|could not convert"):
        en.decode_crop(jpeg, box, (8, 8))


@pytest.mark.parametrize("size", [(0, 8), (8, 0), (-1, 8), (70000, 8)])
def test_size_out_of_range(jpeg, size):
    """Zero, negative or oversized output sizes are ValueErrors."""
    with pytest.raises(ValueError, match="size must be positive"):
        en.decode_crop(jpeg, (0, 0, 10, 10), size)
    with pytest.raises(ValueError, match="size must be positive"):
        en.decode_random_crop(jpeg, size, 0, 0, 0)


@pytest.mark.parametrize("size", [(8,), 8, None, "ab"])
def test_size_wrong_type(jpeg, size):
    """A size that is not two integers is a TypeError."""
    with pytest.raises(TypeError, match="size"):
        en.decode_crop(jpeg, (0, 0, 10, 10), size)


def test_bad_out_buffers(jpeg):
    """Wrong shape/dtype, read-only, non-contiguous or non-array `out` is refused, untouched."""
    size = (16, 24)
    box = (0, 0, 100, 100)
    ro = np.zeros((*size, 3), np.uint8)
    ro.setflags(write=False)
    cases = [
        (np.zeros((16, 25, 3), np.uint8), ValueError, r"\(16, 24, 3\) uint8"),
        (np.zeros((16, 24, 4), np.uint8), ValueError, r"\(16, 24, 3\) uint8"),
        (np.zeros((16, 24, 3), np.float32), ValueError, "uint8"),
        (ro, ValueError, "read-only"),
        (np.zeros((16, 48, 3), np.uint8)[:, ::2], ValueError, "contiguous"),
        (np.zeros((16, 24, 3), np.uint8, order="F"), ValueError, "contiguous"),
        (np.zeros((16, 24, 3), np.uint8)[::-1], ValueError, "contiguous"),
        (bytearray(16 * 24 * 3), TypeError, "numpy.ndarray"),
        ([[0] * 24] * 16, TypeError, "numpy.ndarray"),
    ]
    for out, exc, pattern in cases:
        before = np.array(out, copy=True) if isinstance(out, np.ndarray) else None
        with pytest.raises(exc, match=pattern):
            en.decode_crop(jpeg, box, size, out=out)
        with pytest.raises(exc, match=pattern):
            en.resize_crop(np.zeros((50, 50, 3), np.uint8), (0, 0, 50, 50), size, out=out)
        if before is not None:
            np.testing.assert_array_equal(out, before)


def test_bad_canvas_buffers(images, jpeg):
    """decode_canvas refuses small, read-only, non-uint8, non-contiguous buffers (both paths)."""
    png = images.other("png-rgb")
    ro = np.zeros(10**6, np.uint8)
    ro.setflags(write=False)
    for data in (jpeg, png):
        with pytest.raises(ValueError, match="needs"):
            en.decode_canvas(data, 100, out=np.zeros(100, np.uint8))
        for out in (ro, np.zeros(10**6, np.float32), np.zeros((1000, 2000), np.uint8)[:, ::2]):
            with pytest.raises(ValueError, match="writable contiguous uint8"):
                en.decode_canvas(data, 100, out=out)
        for bad in (0, -1):
            with pytest.raises(ValueError, match="min_side must be positive"):
                en.decode_canvas(data, bad)


def test_bad_image_for_resize_crop():
    """resize_crop refuses images that are not (H, W, 3) uint8 and non-empty."""
    box, size = (0, 0, 2, 2), (2, 2)
    with pytest.raises((TypeError, ValueError)):
        en.resize_crop(np.zeros((4, 4), np.uint8), box, size)
    with pytest.raises(ValueError, match="3 channels"):
        en.resize_crop(np.zeros((4, 4, 4), np.uint8), box, size)
    with pytest.raises(TypeError, match="uint8"):
        en.resize_crop(np.zeros((4, 4, 3), np.float32), box, size)
    with pytest.raises(ValueError):
        en.resize_crop(np.zeros((0, 4, 3), np.uint8), (0, 0, 0, 0), size)


def test_bad_augmentation_parameters(jpeg):
    """Out-of-range scale, ratio, flip_p or image size are ValueErrors; negative keys overflow."""
    p = en.random_resized_crop_params
    for kwargs in ({"scale": (0.0, 1.0)}, {"scale": (0.5, 0.4)}, {"scale": (0.1, 1.5)},
                   {"ratio": (0.0, 1.0)}, {"ratio": (2.0, 1.0)}, {"flip_p": 1.5},
                   {"flip_p": -0.1}):
        with pytest.raises(ValueError):
            p(0, 0, 0, 0, 100, 100, **kwargs)
        with pytest.raises(ValueError):
            en.decode_random_crop(jpeg, (8, 8), 0, 0, 0, **kwargs)
    with pytest.raises(ValueError, match="positive"):
        p(0, 0, 0, 0, 0, 100)
    with pytest.raises(OverflowError):   # keys are uint64
        p(-1, 0, 0, 0, 100, 100)
    with pytest.raises(ValueError, match="positive"):
        en.decode_center_crop(jpeg, 0)
    with pytest.raises(ValueError, match="positive"):
        en.center_crop_box(100, 100, 0, 10)
    with pytest.raises(ValueError, match="positive"):
        en.decode(jpeg, max_scans=0)


def test_decoder_reusable_after_every_error(images, jpeg):
    """After each kind of failure the same thread's decoder still decodes correctly."""
    bads = [b"", b"junk", jpeg[:1000], images.set_sof_size(jpeg, 65500, 65500),
            images.patch(jpeg, _dht(images, jpeg) + 5, bytes([255] * 16))]
    for bad in bads:
        with pytest.raises(en.DecodeError):
            en.decode(bad)
        with pytest.raises(en.DecodeError):
            en.decode_crop(bad, (0, 0, 10, 10), (5, 5))
        assert_still_decodes(images)
        assert_still_decodes(images, "progressive-4:2:2")
    with pytest.raises(ValueError):
        en.decode_crop(jpeg, (0, 0, 1000, 10), (5, 5))
    assert_still_decodes(images)


def _strip_segments(images, data, marker):
    out = bytearray(data[:2])
    for m, pos, length in images.segments(data):
        if m == 0xDA:
            return bytes(out + data[pos:])
        if m != marker:
            out += data[pos:pos + 2 + length]
    raise AssertionError("no SOS")


def test_no_table_state_leaks_between_images(images):
    """A file's decode never depends on the tables of files decoded before on the same decoder."""
    src = images.photo("chelsea")
    std = images.pil_jpeg(src, 90)                    # libjpeg's standard Huffman tables
    custom = images.pil_jpeg(src, 90, optimize=True)  # its own optimised tables
    no_dht = _strip_segments(images, std, 0xC4)       # Motion-JPEG style: standard tables
    ref = images.pil_decode(std)
    dec = _kernel.Decoder()
    np.testing.assert_array_equal(dec.decode(no_dht), ref)
    dec.decode(custom)                                 # leaves custom tables behind in libjpeg
    np.testing.assert_array_equal(dec.decode(no_dht), ref)
    # A file using a quantisation table it never defines is refused even if the
    # previous file defined that table.
    no_dqt = _strip_segments(images, std, 0xDB)
    dec.decode(std)
    with pytest.raises(en.DecodeError, match="Quantization table 0x00 was not defined"):
        dec.decode(no_dqt)


def test_decode_error_pickles_with_message():
    """DecodeError crosses process boundaries with its message and path."""
    err = en.DecodeError("Bogus marker length", path="/data/x.jpg")
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, en.DecodeError) and isinstance(back, ValueError)
    assert str(back) == "/data/x.jpg: Bogus marker length" and back.path == "/data/x.jpg"


# ---------------------------------------------------------------------------
# crash guard


def test_hostile_corpus_in_subprocess(images, jpeg, progressive, tmp_path):
    """The whole hostile corpus, run in a child interpreter, ends with exit status 0 (no crash)."""
    corpus = [b"", b"\xff\xd8", jpeg[:100], jpeg[:len(jpeg) // 2],
              images.set_sof_size(jpeg, 65500, 65500), images.set_sof_size(jpeg, 0, 0),
              images.set_sof_size(jpeg, 1, 65500), images.set_sof_size(jpeg, 65500, 1),
              images.set_sof_size(progressive, 2000, 3000)[:3000],
              _duplicate_last_scan(images, progressive, 300)]
    corpus += [make(images, jpeg) for make, _ in CORRUPTIONS.values()]
    rng = np.random.default_rng(99)
    for _ in range(200):
        bad = bytearray(progressive)
        for pos in rng.integers(0, 700, size=4):
            bad[pos] = int(rng.integers(0, 256))
        corpus.append(bytes(bad))
    path = tmp_path / "corpus.pkl"
    path.write_bytes(pickle.dumps(corpus))
    script = textwrap.dedent("""
        import faulthandler, pickle, sys
        faulthandler.enable()
        import echo_native as en
        corpus = pickle.load(open(sys.argv[1], "rb"))
        kinds = {}
        for data in corpus:
            for strict in (True, False):
                for call in (lambda: en.decode(data, strict=strict, max_pixels=10**7),
                             lambda: en.decode_crop(data, (0, 0, 1, 1), (4, 4), strict=strict),
                             lambda: en.decode_canvas(data, 16, strict=strict)):
                    try:
                        call()
                        kinds["ok"] = kinds.get("ok", 0) + 1
                    except ValueError as e:
                        kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
        print(kinds)
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    assert proc.returncode == 0, f"child died ({proc.returncode}):\n{proc.stderr[-3000:]}"
    assert "DecodeError" in proc.stdout

"""Strict mode refuses lost pixels, not harmless header junk.

The report behind this: on a collection of real-world JPEGs, four files Pillow
decodes were refused in strict mode for "N extraneous bytes before marker 0xdb"
(or 0xe1) -- bytes between header segments that libjpeg skips whole, no pixel
affected -- and a fifth for "1214 extraneous bytes before marker 0xd0" (junk
inside the scan, garbage pixels).  The kernel now classifies each libjpeg
warning by its code and the decoder's state (src/kernel/en_jpeg.c, data_loss):

* harmless, accepted in strict mode (counted in ``Decoder.harmless_warnings``):
  junk before a header marker ahead of the first scan (APPn, COM, DQT, DHT,
  SOFn, SOS, DRI), unknown/odd APPn contents, a malformed EXIF block;
* data loss, refused in strict mode (and decoded, grey-filled or as libjpeg
  recovers it, with ``strict=False``): truncation (mid-scan or between
  progressive scans), junk where a restart marker was expected, junk after a
  scan (between scans or before EOI: surplus bytes at the end of a scan are
  what corrupt entropy-coded data leaves behind; see test_junk_before_eoi).

Every file here is generated from a real photograph by byte surgery and
compared with Pillow: accepted files decode to exactly Pillow's pixels, refused
files are refused with a message naming the cause.
"""
from __future__ import annotations

import io
import os
import struct
import sys
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile

import echo_native as en

# The committed JPEG fixtures (tests/data/jpeg/): restart intervals as libjpeg writes them.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"))
import jpeg_fixtures as fx  # noqa: E402

pytestmark = pytest.mark.timeout(120)

# Junk without 0xFF bytes (with an 0xFF, libjpeg and Pillow would read a marker).
JUNK = b"junk\x00\x01\x02 padding\x7f"
# What the report's fifth file had before its RST0.
JUNK_1214 = bytes((i * 37 + 11) % 255 for i in range(1214))


def segment(marker: int, payload: bytes) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload


def pillow(data: bytes) -> np.ndarray:
    """Pillow's decode, as the issue defines the reference."""
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


def pillow_truncated(data: bytes) -> np.ndarray:
    """Pillow's decode of a truncated file (LOAD_TRUNCATED_IMAGES only for this call)."""
    ImageFile.LOAD_TRUNCATED_IMAGES = True
    try:
        return pillow(data)
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = False


def insert_before(images, data: bytes, marker: int, junk: bytes = JUNK) -> bytes:
    pos = images.find_segment(data, marker)
    return data[:pos] + junk + data[pos:]


def sos_offsets(data: bytes) -> list[int]:
    """Offsets of every SOS marker (0xFF 0xDA cannot occur inside entropy-coded data)."""
    out, pos = [], data.find(b"\xff\xda")
    while pos >= 0:
        out.append(pos)
        pos = data.find(b"\xff\xda", pos + 2)
    return out


def rst_offsets(data: bytes) -> list[int]:
    sos = data.find(b"\xff\xda")
    return [i for i in range(sos, len(data) - 1)
            if data[i] == 0xFF and 0xD0 <= data[i + 1] <= 0xD7]


def refused(pattern, fn, *args, **kwargs) -> str:
    with pytest.raises(en.DecodeError, match=pattern) as info:
        fn(*args, **kwargs)
    return str(info.value)


def full_box_crop(data, **kw):
    h, w = en.image_size(data)
    return en.decode_crop(data, (0, 0, h, w), (h // 3, w // 3), **kw)


def full_box_random_crop(data, **kw):
    """decode_random_crop whose draw is the whole image (scale 1, the image's ratio)."""
    h, w = en.image_size(data)
    img, box, _ = en.decode_random_crop(data, (h // 4, w // 4), 1, 2, 3, scale=(1.0, 1.0),
                                        ratio=(w / h, w / h), **kw)
    assert box == (0, 0, h, w)
    return img


def canvas(data, **kw):
    return en.decode_canvas(data, 16, **kw)[0]


# Every entry point that decodes the whole image (or reads it to its end).
WHOLE = {"decode": en.decode, "decode_crop": full_box_crop,
         "decode_random_crop": full_box_random_crop, "decode_canvas": canvas}


# ---------------------------------------------------------------------------
# inputs


@pytest.fixture(scope="module")
def sequential(images):
    """A real photograph as a camera writes it: JFIF APP0, EXIF APP1, COM, DQT, SOF0,
    DHT, DRI (a restart marker every MCU row), SOS."""
    exif = Image.Exif()
    exif[0x010F] = "EchoCam"
    exif[0x0110] = "Model 1"
    data = images.pil_jpeg(images.photo("chelsea"), 90, exif=exif.tobytes(),
                           comment=b"a real photograph", restart_marker_rows=1)
    markers = [m for m, _, _ in images.segments(data)]
    for m in (0xE0, 0xE1, 0xFE, 0xDB, 0xC0, 0xC4, 0xDD, 0xDA):
        assert m in markers, hex(m)
    assert len(rst_offsets(data)) > 10
    return data


@pytest.fixture(scope="module")
def progressive(images):
    data = images.pil_jpeg(images.photo("coffee")[::2, ::2], 90, progressive=True)
    assert len(sos_offsets(data)) >= 6
    return data


@pytest.fixture(scope="module")
def plain(images):
    """Baseline 4:2:0 without restart markers."""
    return images.pil_jpeg(images.photo("astronaut")[::2, ::2], 90)


# ---------------------------------------------------------------------------
# harmless: accepted, pixels exactly Pillow's (and the clean file's)


HEADER_MARKERS = {"APP1": 0xE1, "COM": 0xFE, "DQT": 0xDB, "SOF": 0xC0, "DHT": 0xC4,
                  "DRI": 0xDD, "SOS": 0xDA}


def assert_accepted_like_clean(bad, clean, harmless=1):
    """bad decodes to Pillow's pixels, which are the clean file's, through every entry
    point, counting `harmless` harmless warnings and no data loss."""
    ref = pillow(bad)
    np.testing.assert_array_equal(ref, pillow(clean))
    dec = en.Decoder()
    np.testing.assert_array_equal(dec.decode(bad), ref)
    assert (dec.warnings, dec.harmless_warnings) == (0, harmless)
    h, w = ref.shape[:2]
    assert en.image_size(bad) == (h, w)
    box = (h * 0.2, w * 0.1, h * 0.5, w * 0.6)
    np.testing.assert_array_equal(en.decode_crop(bad, box, (40, 56), flip=True),
                                  en.decode_crop(clean, box, (40, 56), flip=True))
    for key in [(7, 0, 1), (7, 1, 1), (9, 4, 2)]:
        a, box_a, flip_a = en.decode_random_crop(bad, (48, 48), *key)
        b, box_b, flip_b = en.decode_random_crop(clean, (48, 48), *key)
        assert (box_a, flip_a) == (box_b, flip_b)
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(en.decode_center_crop(bad, 32),
                                  en.decode_center_crop(clean, 32))
    np.testing.assert_array_equal(canvas(bad), canvas(clean))
    for call in WHOLE.values():   # also through the whole-image crop paths
        np.testing.assert_array_equal(call(bad), call(clean))


@pytest.mark.parametrize("where", sorted(HEADER_MARKERS))
def test_junk_before_header_marker_is_harmless(images, sequential, where):
    """Junk before APP1, COM, DQT, SOF, DHT, DRI or SOS (ahead of the first scan)."""
    bad = insert_before(images, sequential, HEADER_MARKERS[where])
    assert_accepted_like_clean(bad, sequential)


@pytest.mark.parametrize("where", ["SOF2", "first SOS", "DHT"])
def test_junk_in_progressive_header_is_harmless(images, progressive, where):
    marker = {"SOF2": 0xC2, "first SOS": 0xDA, "DHT": 0xC4}[where]
    bad = insert_before(images, progressive, marker, JUNK * 3)
    assert_accepted_like_clean(bad, progressive)


def test_report_padding_after_exif_block(images, sequential):
    """The report's files: a run of padding after the EXIF block (an APP1 whose length
    leaves bytes behind it), then the DQT: '... extraneous bytes before marker 0xdb'."""
    app1 = images.find_segment(sequential, 0xE1)
    length = int.from_bytes(sequential[app1 + 2:app1 + 4], "big")
    end = app1 + 2 + length
    rest = sequential[end:]
    # Move the DQT right behind the padding: APP1, 300 zero bytes, DQT ...
    without_com = rest[rest.find(b"\xff\xdb"):]
    clean = sequential[:end] + without_com
    bad = sequential[:end] + bytes(300) + without_com
    dec = en.Decoder(en.DecodeLimits(strict=False))
    dec.decode(bad)
    assert (dec.warnings, dec.harmless_warnings) == (0, 1)
    assert_accepted_like_clean(bad, clean)


def test_junk_right_after_soi_is_harmless(images, sequential):
    """Junk between SOI and APP0.  Pillow refuses this file outright (it wants a marker
    at byte 2); libjpeg skips the junk like any other header junk, and the pixels are
    exactly the clean file's (Pillow's decode of that)."""
    bad = sequential[:2] + JUNK + sequential[2:]
    with pytest.raises(Exception):
        pillow(bad)
    dec = en.Decoder()
    np.testing.assert_array_equal(dec.decode(bad), pillow(sequential))
    assert (dec.warnings, dec.harmless_warnings) == (0, 1)


def _exif_tiff(body: bytes) -> bytes:
    return segment(0xE1, b"Exif\x00\x00" + body)


MALFORMED_APPN = {
    # TIFF header with an unknown byte order and an IFD offset far past the block.
    "exif-garbage-header": lambda d, im: _insert_app(im, d, _exif_tiff(
        b"XX\x00\x2a\xff\xff\xff\xf0" + bytes(range(40)))),
    # Valid header, five IFD entries whose values point past the end of the block.
    "exif-entries-past-end": lambda d, im: _insert_app(im, d, _exif_tiff(
        b"MM\x00\x2a\x00\x00\x00\x08\x00\x05" + b"\x01\x0f\x00\x02\x7f\xff\xff\xff\x00\x00"
        b"\x10\x00" * 5)),
    # An EXIF block whose length field is shorter than its contents: the rest is
    # junk before the next marker (one harmless warning).
    "exif-length-short": lambda d, im: _insert_app(im, d, _short(_exif_tiff(
        b"MM\x00\x2a\x00\x00\x00\x08\x00\x00" + bytes(30)), 20)),
    # An APP7 nobody defines, with arbitrary bytes.
    "app7-unknown": lambda d, im: _insert_app(im, d, segment(0xE7, b"\x00\x01garbage\x7e")),
    # JFIF major version 2 (libjpeg: "unknown JFIF revision number", a warning).
    "jfif-version-2": lambda d, im: im.patch(d, im.find_segment(d, 0xE0) + 9, b"\x02"),
}
MALFORMED_HARMLESS_COUNT = {"exif-length-short": 1, "jfif-version-2": 1}


def _insert_app(images, data, seg):
    pos = images.find_segment(data, 0xDB)
    return data[:pos] + seg + data[pos:]


def _short(seg: bytes, length: int) -> bytes:
    return seg[:2] + struct.pack(">H", length) + seg[4:]


@pytest.mark.filterwarnings("ignore:.*EXIF.*:UserWarning", "ignore:Tag data:UserWarning")
@pytest.mark.parametrize("case", sorted(MALFORMED_APPN))
def test_malformed_exif_and_odd_appn_are_harmless(images, plain, case):
    bad = MALFORMED_APPN[case](plain, images)
    with Image.open(io.BytesIO(bad)) as im:   # Pillow decodes it too
        assert im.size == Image.open(io.BytesIO(plain)).size
    assert_accepted_like_clean(bad, plain, harmless=MALFORMED_HARMLESS_COUNT.get(case, 0))


def test_unknown_adobe_transform_is_harmless(images):
    """An Adobe APP14 with transform code 7: libjpeg warns and takes the default (YCbCr
    for three components), as Pillow does: the same pixels as Pillow's."""
    rgb = images.pil_jpeg(images.photo("chelsea"), 92, keep_rgb=True)
    bad = images.patch(rgb, images.find_segment(rgb, 0xEE) + 15, b"\x07")
    dec = en.Decoder()
    np.testing.assert_array_equal(dec.decode(bad), pillow(bad))
    assert (dec.warnings, dec.harmless_warnings) == (0, 1)


def test_harmless_and_data_loss_counted_apart(images, sequential):
    """Header junk and a truncation in one file: lenient counts one of each; strict refuses
    for the truncation, naming it, not the junk."""
    bad = insert_before(images, sequential, 0xDB)
    bad = bad[:len(bad) * 2 // 3]
    dec = en.Decoder(en.DecodeLimits(strict=False))
    dec.decode(bad)
    assert dec.harmless_warnings == 1 and dec.warnings >= 1
    msg = refused(r"Premature end of JPEG file", en.decode, bad)
    assert "extraneous" not in msg


# ---------------------------------------------------------------------------
# data loss: refused in strict mode, naming the cause; decoded with strict=False


def assert_refused_everywhere(bad, pattern):
    msgs = [refused(pattern, call, bad) for call in WHOLE.values()]
    assert all("strict mode" in m for m in msgs), msgs
    return msgs[0]


def test_junk_before_restart_marker(images, sequential):
    """Junk where a restart marker was expected (the report's fifth file: 1214 bytes
    before RST0): refused, naming the junk and the restart marker; strict=False gives
    Pillow's pixels (the same libjpeg recovery)."""
    rst = rst_offsets(sequential)
    mid = rst[len(rst) // 2]
    # Junk inside the restart interval: the blocks after it decode to garbage.
    garbage = sequential[:mid - 40] + JUNK_1214 + sequential[mid - 40:]
    msg = assert_refused_everywhere(
        garbage, r"extraneous bytes before marker 0xd[0-7]|premature end of data segment|"
                 r"bad Huffman code")
    lenient = en.decode(garbage, strict=False)
    np.testing.assert_array_equal(lenient, pillow(garbage))
    assert not np.array_equal(lenient, pillow(sequential))
    # Junk right before an RST: libjpeg skips it, but it is junk inside a scan all the same.
    bad = sequential[:mid] + JUNK + sequential[mid:]
    msg = assert_refused_everywhere(bad, r"extraneous bytes before marker 0xd[0-7]")
    assert "restart marker" in msg
    dec = en.Decoder(en.DecodeLimits(strict=False))
    np.testing.assert_array_equal(dec.decode(bad), pillow(bad))
    assert dec.warnings == 1 and dec.harmless_warnings == 0


# Restart markers as libjpeg writes them (committed fixtures, made with cjpeg -restart and
# jpegtran): every MCU row, every 3 rows, every MCU, every 5 MCUs, in a progressive file.
RESTART_FILES = ["restart-rows-1.jpg", "restart-rows-3.jpg", "restart-mcus-1.jpg",
                 "restart-mcus-5.jpg", "restart-progressive.jpg"]


# restart-rows-3.jpg has a single RST0; the arithmetic-coded files restart the same way.
@pytest.mark.parametrize("name", [n for n in RESTART_FILES if n != "restart-rows-3.jpg"]
                         + ["arith-restart.jpg", "arith-progressive-restart.jpg"])
def test_junk_before_restart_marker_libjpeg_files(name):
    """The same with libjpeg's own restart intervals (Huffman and arithmetic): junk before
    the first RST3 is refused, naming it; strict=False gives Pillow's pixels."""
    data = fx.read(name)
    rst3 = next(r for r in rst_offsets(data) if data[r + 1] == 0xD3)
    bad = data[:rst3] + JUNK + data[rst3:]
    assert_refused_everywhere(bad, r"extraneous bytes before marker 0xd3.*restart marker")
    np.testing.assert_array_equal(en.decode(bad, strict=False), pillow(bad))


@pytest.mark.parametrize("name", RESTART_FILES)
def test_restart_intervals_decode_like_the_file_without_them(name):
    """A file with restart markers (any interval, sequential or progressive) is accepted
    in strict mode with no warning, and every entry point -- crops that skip rows across
    intervals too -- gives the pixels of the same coefficients coded without them."""
    data, clean = fx.read(name), fx.read("restart-none.jpg")
    spec, st = fx.FIXTURES[name], fx.structure(data)
    assert st.restart == (spec.restart,) and fx.structure(clean).restart == ()
    if st.scans == 1:   # 4:2:0: 16 x 16 MCUs; a marker between intervals, none at the end
        mcus = -(-st.height // 16) * -(-st.width // 16)
        assert st.rst_markers == -(-mcus // spec.restart) - 1
    assert_accepted_like_clean(data, clean, harmless=0)
    h, w = st.height, st.width
    for box, size in (((50, 0, 40, w), (20, 64)), ((70, 90, 26, 38), (26, 38)),
                      ((h - 9, w - 17, 9, 17), (3, 5))):
        np.testing.assert_array_equal(en.decode_crop(data, box, size),
                                      en.decode_crop(clean, box, size))


@pytest.mark.parametrize("kind", ["sequential", "progressive"])
def test_junk_before_eoi(images, sequential, progressive, kind):
    """Junk after the last scan, before EOI, is refused: surplus bytes at the end of a
    scan are indistinguishable, to libjpeg, from what corrupt entropy-coded data leaves
    (a corrupted byte desynchronises the decoder, which then finishes its blocks early:
    for most corrupt arithmetic-coded files and many Huffman ones it is the only
    warning), so strict mode cannot accept it without accepting garbled scans.
    strict=False returns the intact pixels, Pillow's."""
    clean = sequential if kind == "sequential" else progressive
    bad = clean[:-2] + JUNK + clean[-2:]
    msg = assert_refused_everywhere(bad, r"extraneous bytes before marker 0xd9")
    assert "surplus" in msg
    dec = en.Decoder(en.DecodeLimits(strict=False))
    np.testing.assert_array_equal(dec.decode(bad), pillow(bad))
    np.testing.assert_array_equal(dec.decode(bad), pillow(clean))
    assert dec.warnings == 1


def test_corrupt_arithmetic_scan_with_only_surplus_is_refused(images):
    """Why junk before EOI is data loss: corrupt arithmetic-coded data whose only warning
    is surplus bytes before EOI decodes to garbage.  Strict mode refuses it."""
    data = fx.read("arith-sequential.jpg")
    clean = pillow(data)
    rng = np.random.default_rng(4)
    seen = 0
    for _ in range(10):
        bad = bytearray(data)
        for pos in rng.integers(700, len(data) - 2, size=3):
            if bad[pos] != 0xFF and bad[pos - 1] != 0xFF:
                bad[pos] = int(rng.integers(0, 255))
        bad = bytes(bad)
        dec = en.Decoder(en.DecodeLimits(strict=False))
        try:
            img = dec.decode(bad)
        except en.DecodeError:
            continue
        msg = refused(r"(?i)corrupt JPEG data", en.decode, bad)
        if "before marker 0xd9" in msg:
            seen += 1
            assert np.abs(img.astype(int) - clean).mean() > 5
    assert seen >= 3


def test_junk_between_progressive_scans(images, progressive):
    """Junk after a complete scan, before the next SOS: the scan had surplus bytes."""
    sos = sos_offsets(progressive)
    bad = progressive[:sos[3]] + JUNK + progressive[sos[3]:]
    msg = assert_refused_everywhere(bad, r"extraneous bytes before marker 0xda")
    assert "surplus" in msg
    np.testing.assert_array_equal(en.decode(bad, strict=False), pillow(bad))


@pytest.mark.parametrize("keep", [0.4, 0.8])
def test_truncated_mid_scan(images, plain, keep):
    """Cut inside the scan: refused ('Premature end of JPEG file'); strict=False fills the
    rows after the cut with mid-grey and keeps those before it."""
    clean = pillow(plain)
    bad = plain[:int(len(plain) * keep)]
    msg = assert_refused_everywhere(bad, r"Premature end of JPEG file")
    # The refusal says what decoding on would do, not that it was done: strict mode
    # delivers no grey rows.
    assert "strict=False" in msg and "would fill the missing rows with grey" in msg, msg
    assert "rows are filled" not in msg, msg
    img = en.decode(bad, strict=False)
    assert img.shape == clean.shape
    assert (img[-8:] == 128).all(), "rows after the cut are mid-grey"
    top = int(clean.shape[0] * keep * 0.5)
    np.testing.assert_array_equal(img[:top], clean[:top])
    assert np.abs(img.astype(int) - pillow_truncated(bad)).mean() <= 1.0


def test_truncated_between_progressive_scans(images, progressive):
    """Cut exactly at an SOS: every scan so far is complete but the image is not (the
    refinement scans are missing): refused; strict=False returns the coarser image."""
    sos = sos_offsets(progressive)
    bad = progressive[:sos[len(sos) // 2]]
    assert_refused_everywhere(bad, r"Premature end of JPEG file")
    img = en.decode(bad, strict=False)
    clean = pillow(progressive)
    assert img.shape == clean.shape and not np.array_equal(img, clean)
    assert np.abs(img.astype(int) - clean).mean() < 12   # the picture, at lower precision
    assert np.abs(img.astype(int) - pillow_truncated(bad)).mean() <= 1.0


def test_lenient_counts_data_loss(images, plain):
    dec = en.Decoder(en.DecodeLimits(strict=False))
    dec.decode(plain)
    assert (dec.warnings, dec.harmless_warnings) == (0, 0)
    dec.decode(plain[:len(plain) // 2])
    assert dec.warnings >= 1 and dec.harmless_warnings == 0


# ---------------------------------------------------------------------------
# crops: the rows a crop decodes are classified like a full decode's; below them,
# strict mode refuses what one pass over the bytes shows a full decode refuses


def _top_crop(data, **kw):
    h, w = en.image_size(data)
    return en.decode_crop(data, (0, 0, h // 4, w // 2), (16, 24), **kw)


def test_crop_above_truncation_is_refused(images, plain):
    """A truncated file is refused by a crop that never reaches the cut: a full decode
    would refuse it, and a scan of the bytes shows it (no EOI).  strict=False returns
    the intact top crop."""
    bad = plain[:len(plain) * 3 // 4]
    refused(r"Premature end of JPEG file.*truncated", _top_crop, bad)
    np.testing.assert_array_equal(_top_crop(bad, strict=False), _top_crop(plain))
    out = np.full((16, 24, 3), 7, np.uint8)   # a refused crop leaves `out` untouched
    h, w = en.image_size(bad)
    refused(r"Premature end", en.decode_crop, bad, (0, 0, h // 4, w // 2), (16, 24), out=out)
    assert (out == 7).all()


def test_crop_above_impossible_marker_is_refused(images, plain):
    """A reserved marker in the scan below the crop: a full decode refuses it."""
    sos = plain.find(b"\xff\xda")
    bad = images.patch(plain, (sos + len(plain) * 3) // 4, b"\xff\x17")
    refused(r"premature end of data segment", en.decode, bad)   # the scan stops at it
    refused(r"marker 0x17 inside or right after the scan", _top_crop, bad)


def test_crop_above_restart_markers_out_of_order_is_refused(images, sequential):
    """Two RST markers swapped below the crop: a full decode resynchronises (data lost)."""
    rst = rst_offsets(sequential)
    a, b = rst[-4], rst[-3]
    bad = images.patch(images.patch(sequential, a, sequential[b:b + 2]), b,
                       sequential[a:a + 2])
    refused(r"RST|restart", en.decode, bad)
    refused(r"RST\d follows RST\d.*out of sequence", _top_crop, bad)


def test_crop_below_damage_is_refused(images, sequential):
    """Damage above the crop is in data the crop decodes (to skip to its rows): refused."""
    rst = rst_offsets(sequential)
    bad = sequential[:rst[2]] + JUNK + sequential[rst[2]:]
    h, w = en.image_size(bad)
    refused(r"extraneous bytes before marker 0xd2", en.decode_crop, bad,
            (h * 0.6, 0, h * 0.3, w), (16, 32))


def test_crop_reaching_last_row_classifies_like_full_decode(images, plain):
    """A crop that decodes the scan to its last row reads the markers after it, as a
    full decode does: junk before EOI is refused there too."""
    bad = plain[:-2] + JUNK + plain[-2:]
    h, w = en.image_size(bad)
    refused(r"extraneous bytes before marker 0xd9", en.decode_crop, bad,
            (h - 20, 0, 20, w), (8, 32))
    # Resize(4) + CenterCrop(4): the box is the full height, reaching the last row.
    assert en.center_crop_box(h, w, 4, 4)[2] == h
    refused(r"extraneous bytes before marker 0xd9", en.decode_center_crop, bad, 4,
            resize=4)


def test_crop_above_undetectable_damage_documented(images, sequential, plain):
    """What one pass over the bytes cannot see -- junk before a restart marker or before
    EOI below the crop -- needs entropy-decoding the rest of the scan, which a crop exists
    to skip.  Such a crop is returned (its rows intact: identical to the clean file's)
    although a full decode refuses the file."""
    rst = rst_offsets(sequential)
    below = sequential[:rst[-3]] + JUNK + sequential[rst[-3]:]
    refused(r"extraneous", en.decode, below)
    np.testing.assert_array_equal(_top_crop(below), _top_crop(sequential))
    eoi = plain[:-2] + JUNK + plain[-2:]
    refused(r"extraneous", en.decode, eoi)
    np.testing.assert_array_equal(_top_crop(eoi), _top_crop(plain))


def test_progressive_crops_see_every_warning(images, progressive):
    """Progressive files are read to EOI before the first row comes out: a crop of any
    rows refuses exactly what the full decode refuses."""
    sos = sos_offsets(progressive)
    for bad in (progressive[:sos[-2]], progressive[:-2] + JUNK + progressive[-2:],
                progressive[:sos[2]] + JUNK + progressive[sos[2]:]):
        full = refused(r"strict mode", en.decode, bad)
        crop = refused(r"strict mode", _top_crop, bad)
        assert crop == full
        _top_crop(bad, strict=False)


# ---------------------------------------------------------------------------
# the Pillow path: the same rule


def _png_chunks(data):
    pos = 8
    while pos + 12 <= len(data):
        n = int.from_bytes(data[pos:pos + 4], "big")
        yield data[pos + 4:pos + 8], pos, 12 + n
        pos += 12 + n


def _png_with_text(images):
    from PIL import PngImagePlugin
    info = PngImagePlugin.PngInfo()
    info.add_text("Comment", "a real photograph")
    im = Image.fromarray(images.photo("coffee")[::3, ::3])
    buf = io.BytesIO()
    im.save(buf, "PNG", pnginfo=info, exif=b"Exif\x00\x00MM\x00\x2a\x00\x00\x00\x08\x00\x00")
    return buf.getvalue()


def test_png_metadata_chunk_with_bad_crc_is_harmless(images):
    """A tEXt chunk whose CRC is wrong: Pillow refuses the whole file, although no pixel
    depends on it.  The Pillow path sets the chunk aside (one harmless warning) and
    returns the pixels of the clean file, Pillow's."""
    png = _png_with_text(images)
    pos = next(p for kind, p, _ in _png_chunks(png) if kind == b"tEXt")
    bad = images.patch(png, pos + 9, bytes([png[pos + 9] ^ 0x20]))
    with pytest.raises(Exception):
        pillow(bad)
    dec = en.Decoder()
    np.testing.assert_array_equal(dec.decode(bad), pillow(png))
    assert (dec.warnings, dec.harmless_warnings) == (0, 1)
    np.testing.assert_array_equal(en.decode_crop(bad, (10, 20, 80, 90), (20, 30)),
                                  en.decode_crop(png, (10, 20, 80, 90), (20, 30)))
    np.testing.assert_array_equal(canvas(bad), canvas(png))
    a, _, _ = en.decode_random_crop(bad, (24, 24), 1, 2, 3)
    b, _, _ = en.decode_random_crop(png, (24, 24), 1, 2, 3)
    np.testing.assert_array_equal(a, b)
    dec.decode(png)
    assert dec.harmless_warnings == 0


def test_png_malformed_exif_is_harmless(images):
    """An eXIf chunk with a valid CRC and garbage inside: Pillow decodes, so do we."""
    png = _png_with_text(images)
    kind, pos, n = next(c for c in _png_chunks(png) if c[0] == b"eXIf")
    body = b"XX\x00\x2a\xff\xff\xff\xf0" + bytes(range(20))
    chunk = (struct.pack(">I", len(body)) + b"eXIf" + body
             + struct.pack(">I", zlib.crc32(b"eXIf" + body)))
    bad = png[:pos] + chunk + png[pos + n:]
    np.testing.assert_array_equal(en.decode(bad), pillow(bad))
    np.testing.assert_array_equal(en.decode(bad), pillow(png))


def test_png_pixel_damage_still_refused(images):
    """Truncated or with a corrupt IHDR, a PNG is refused in both modes (Pillow's
    LOAD_TRUNCATED_IMAGES stays off: there is no per-call way to set it)."""
    png = _png_with_text(images)
    for bad in (png[:len(png) // 2], images.patch(png, 29, b"\x00\x00\x00\x00")):
        for strict in (True, False):
            with pytest.raises(en.DecodeError):
                en.decode(bad, strict=strict)
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


# ---------------------------------------------------------------------------
# through a ring: accepted files are delivered and counted, refused ones replaced


@pytest.mark.parametrize("placement", ["before_augment", "after_augment"])
def test_ring_counts_files_accepted_with_warnings(images, sequential, plain, placement):
    """In strict mode a ring delivers files with header junk as themselves (fresh, never
    replaced), counts each of them once in stats()["accepted_with_warnings"], and
    replaces a truncated file, counted apart as a failure."""
    junk = insert_before(images, sequential, 0xDB)
    truncated = plain[:len(plain) // 2]
    blobs = [plain, junk, sequential, junk, truncated, plain, junk, sequential]
    labels = np.arange(len(blobs))
    with en.EchoRing(en.Samples(blobs, labels), 4, echo=en.Echo(2, placement=placement),
                     image_size=32, workers=2, seed=1, timeout=60) as ring:
        with pytest.warns(en.SampleFailureWarning):
            fresh = sorted(int(s) for b in ring for s, f in zip(b.sample_ids, b.fresh) if f)
        stats = ring.stats()
    assert fresh == [0, 1, 2, 3, 5, 6, 7]
    assert stats["accepted_with_warnings"] == 3
    assert sum(stats["failures"].values()) == 1

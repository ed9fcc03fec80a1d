"""Seekable JPEGs (echo_native.seekable, src/seek/): the lossless transcoder, its index,
the sub-image assembler, and crops whose pixels are those of today's kernel on the
original file, bit for bit."""
from __future__ import annotations

import io
import os
import re
import struct

import numpy as np
import pytest
from PIL import Image

import echo_native as en
from echo_native import _kernel, _seek, seekable
from echo_native.decode import Decoder, DecodeLimits
from jpegs import TESTS, find_segment, segments
from photos import fit, photo


def pil_jpeg(arr, **opts) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", **opts)
    return buf.getvalue()


# Pillow's subsampling codes: 0 = 4:4:4, 1 = 4:2:2, 2 = 4:2:0.
VARIANTS = {
    "444": dict(subsampling=0),
    "422": dict(subsampling=1),
    "420": dict(subsampling=2),
    "420-progressive": dict(subsampling=2, progressive=True),
    "422-progressive": dict(subsampling=1, progressive=True),
    "gray": dict(gray=True),
}


def make(variant, h, w, quality=88, name="astronaut"):
    opts = dict(VARIANTS[variant])
    gray = opts.pop("gray", False)
    arr = fit(photo("camera" if gray else name), h, w)
    return pil_jpeg(arr, quality=quality, **opts)


def fixture(name):
    with open(os.path.join(TESTS, "data", "jpeg", name), "rb") as f:
        return f.read()


def random_boxes(rng, h, w, n):
    """Boxes of every shape, including ones touching each edge and corner."""
    boxes = []
    for i in range(n):
        bh, bw = rng.uniform(1, h), rng.uniform(1, w)
        top, left = rng.uniform(0, h - bh), rng.uniform(0, w - bw)
        edge = i % 6
        if edge == 1:
            top = 0.0
        elif edge == 2:
            top = h - bh
        elif edge == 3:
            left = 0.0
        elif edge == 4:
            left = w - bw
        elif edge == 5:
            top, left = h - bh, w - bw
        boxes.append((top, left, bh, bw))
    return boxes


def check_crops(orig, seek, rng, n, sizes=((224, 224), (32, 48), (7, 5), (64, 20))):
    """n random crops of the original (the kernel) and the seekable file (the seek path):
    identical pixels; returns the DCT scales and how many took the seekable path."""
    kern, seeker = _kernel.Decoder(), _seek.Seeker()
    h, w, _, _ = kern.info(orig)
    scales = set()
    for i, box in enumerate(random_boxes(rng, h, w, n)):
        size = sizes[i % len(sizes)]
        flip = bool(i & 1)
        want = kern.decode_crop(orig, box, size, flip)
        scales.add(kern.last_scale)
        got = seeker.decode_crop(seek, box, size, flip)
        assert seeker.last_scale == kern.last_scale
        assert np.array_equal(got, want), (box, size, flip, seeker.why)
    stats = seeker.stats()
    assert stats["fallback"] == 0 and stats["plain"] == 0, (stats, seeker.why)
    return scales, stats["seek"]


# --- the transcoder ---------------------------------------------------------------------

@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_transcode_is_lossless(variant):
    orig = make(variant, 157, 221)
    t = seekable.transcode(orig, restart=1)
    kern = _kernel.Decoder()
    assert np.array_equal(kern.decode(t.data), kern.decode(orig))
    # Every decoder reads it: Pillow too, with the same pixels as from the original.
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(t.data))),
                          np.asarray(Image.open(io.BytesIO(orig))))
    markers = [m for m, _, _ in segments(t.data)]
    assert 0xC0 in markers or 0xC1 in markers  # baseline, progressive or not before
    assert 0xC2 not in markers
    assert t.progressive_in == ("progressive" in variant)
    sampling = variant.split("-")[0]
    assert t.mcu == (16 if sampling == "420" else 8, 8 if sampling in ("444", "gray") else 16)
    rows, cols = -(-157 // t.mcu[0]), -(-221 // t.mcu[1])
    assert t.interval == 1 and t.segments == rows * cols
    info = seekable.index_info(t.data)
    assert info["mcus"] == (rows, cols) and info["interval"] == 1
    assert seekable.is_seekable(t.data) and not seekable.is_seekable(orig)


def test_restart_interval_divides_the_row():
    # 25 MCUs a row (400 px, 4:2:0): 4 does not divide it, 5 does; 32 MCUs: 4 divides it.
    d25 = make("420", 64, 400)
    assert seekable.transcode(d25, 4).interval == 1
    assert seekable.transcode(d25, 5).interval == 5
    assert seekable.transcode(d25, 7).interval == 5
    assert seekable.transcode(d25, seekable.ROW).interval == 25
    assert seekable.transcode(d25, 99).interval == 25
    d32 = make("420", 64, 512)
    assert seekable.transcode(d32, 4).interval == 4
    assert seekable.transcode(d32, 6).interval == 4
    with pytest.raises(ValueError, match="restart"):
        seekable.transcode(d32, -1)
    # The default: segments 128 px wide, whatever the MCU (8 MCUs of 4:2:0, 16 of 4:4:4;
    # 50 MCUs of 4:4:4 a row: 10 divides it).
    assert seekable.transcode(d32).interval == 8
    assert seekable.transcode(make("444", 64, 512)).interval == 16
    assert seekable.transcode(make("444", 64, 400)).interval == 10
    assert seekable.transcode(make("gray", 64, 400)).interval == 10


def test_optimised_tables_pay_for_the_markers():
    """Pillow writes the standard Huffman tables: the optimised ones of the transcode
    more than pay for a marker per MCU row."""
    orig = make("420", 375, 500)
    assert len(seekable.transcode(orig, seekable.ROW).data) < len(orig)


def test_transcode_refuses_by_name():
    with pytest.raises(en.DecodeError, match="colour space"):
        seekable.transcode(fixture("cmyk-plain.jpg"))
    with pytest.raises(en.DecodeError, match="12"):
        seekable.transcode(fixture("twelve-bit-rgb.jpg"))
    orig = make("420", 120, 160)
    with pytest.raises(en.DecodeError, match="damaged|Premature"):
        seekable.transcode(orig[: len(orig) * 2 // 3])
    with pytest.raises(en.DecodeError, match="not a JPEG"):
        seekable.transcode(b"GIF89a....")
    with pytest.raises(en.DecodeError, match="max_pixels"):
        seekable.transcode(orig, max_pixels=100)
    data, why = seekable.make_seekable(fixture("cmyk-plain.jpg"))
    assert data == fixture("cmyk-plain.jpg") and "colour space" in why
    data, why = seekable.make_seekable(orig)
    assert why is None and seekable.is_seekable(data)
    assert seekable.make_seekable(data) == (data, None)  # already seekable: kept


# --- pixels identical to the kernel on the original -------------------------------------

@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("restart", [1, 2, seekable.ROW])
def test_crops_identical(variant, restart):
    rng = np.random.default_rng(hash((variant, restart)) & 0xFFFF)
    # Odd sizes: partial MCUs at the right and bottom edges.
    orig = make(variant, 333, 517)
    seek = seekable.transcode(orig, restart).data
    scales, used = check_crops(orig, seek, rng, 48)
    assert used >= 24  # most crops took the seekable path
    assert {1, 2} <= scales


def test_every_dct_scale_and_large_images():
    """1/8 only comes with boxes 8x the output: a larger image, small outputs."""
    orig = make("420", 900, 1203)
    seek = seekable.transcode(orig, 4).data
    scales, _ = check_crops(orig, seek, np.random.default_rng(5), 40,
                            sizes=((24, 24), (48, 40), (100, 90), (224, 224)))
    assert scales == {1, 2, 4, 8}


@pytest.mark.parametrize("name", ["sampling-411.jpg", "sampling-440.jpg",
                                  "sampling-440-progressive.jpg", "arith-sequential.jpg",
                                  "restart-mcus-5.jpg", "progressive-190-scans.jpg"])
def test_committed_variants(name):
    orig = fixture(name)
    seek = seekable.transcode(orig, 1).data
    check_crops(orig, seek, np.random.default_rng(len(name)), 30,
                sizes=((16, 16), (40, 30), (5, 9)))


@pytest.mark.parametrize("h,w", [(1, 1), (3, 900), (900, 3), (17, 17), (16, 32)])
def test_tiny_and_elongated(h, w):
    orig = make("420", h, w)
    seek = seekable.transcode(orig, 1).data
    check_crops(orig, seek, np.random.default_rng(h * w), 12, sizes=((4, 4), (1, 3)))


def test_public_api_takes_the_seekable_path():
    orig = make("420", 375, 500)
    seek = seekable.transcode(orig).data
    dec = Decoder()
    out_a, out_b = np.empty((224, 224, 3), np.uint8), np.empty((224, 224, 3), np.uint8)
    for i in range(20):
        ka = en.decode_random_crop(orig, (224, 224), 3, 1, i, out=out_a)
        kb = en.decode_random_crop(seek, (224, 224), 3, 1, i, out=out_b)
        assert ka[1:] == kb[1:] and np.array_equal(out_a, out_b)
        box = dec.random_crop(seek, (96, 96), (3, 1, i, 0), (0.08, 1.0), (0.75, 4 / 3), 0.5,
                              np.empty((96, 96, 3), np.uint8))
        assert box == dec.random_crop(orig, (96, 96), (3, 1, i, 0), (0.08, 1.0),
                                      (0.75, 4 / 3), 0.5, np.empty((96, 96, 3), np.uint8))
    assert np.array_equal(en.decode_crop(seek, (100.5, 30.25, 120, 200), (64, 64), True),
                          en.decode_crop(orig, (100.5, 30.25, 120, 200), (64, 64), True))
    assert np.array_equal(en.decode_center_crop(seek, (224, 224)),
                          en.decode_center_crop(orig, (224, 224)))
    # The whole image and the canvas come from the kernel, unchanged.
    assert np.array_equal(en.decode(seek), en.decode(orig))
    stats = dec._seek.stats()
    assert stats["seek"] + stats["whole"] == 20 and stats["fallback"] == 0
    assert stats["bytes_in"] < 20 * seekable.index_info(seek)["scan_bytes"]
    plain = Decoder()
    plain.crop(orig, (0, 0, 100, 100), (32, 32))
    assert plain._seek is None  # plain JPEGs never reach the seekable code


# --- the assembler -------------------------------------------------------------------------

def test_assembled_subimage_is_a_jpeg_of_the_region():
    orig = make("422", 200, 320)  # 20 MCUs a row: interval 2
    seek = seekable.transcode(orig, 2).data
    info = seekable.index_info(seek)
    mh, mw = info["mcu"]
    full = _kernel.Decoder().decode(orig).astype(np.int16)
    s = _seek.Seeker()
    sub = s.assemble(seek, 3, 7, 4, 12)
    im = np.asarray(Image.open(io.BytesIO(sub)))  # any decoder reads it
    assert im.shape == (4 * mh, 8 * mw, 3)
    region = full[3 * mh:7 * mh, 4 * mw:12 * mw]
    # Identical away from the sub-image's edges (upsampling replicates at an edge).
    assert np.array_equal(im[2:-2, 2:-2], region[2:-2, 2:-2])
    with pytest.raises(ValueError, match="whole restart segments"):
        s.assemble(seek, 0, 1, 1, 3)  # columns not on the interval
    with pytest.raises(ValueError, match="whole restart segments"):
        s.assemble(seek, 0, 99, 0, 2)
    with pytest.raises(ValueError, match="no seekable index"):
        s.assemble(orig, 0, 1, 0, 2)


def test_index_split_over_several_segments():
    """An index over 64 KiB spans several APP9 segments, put back together."""
    orig = make("444", 2000, 2400, quality=95)
    t = seekable.transcode(orig, 1)
    assert t.index_bytes > 65536
    assert sum(1 for m, _, _ in segments(t.data) if m == 0xE9) >= 2
    check_crops(orig, t.data, np.random.default_rng(9), 6, sizes=((224, 224), (64, 64)))


# --- bad input -------------------------------------------------------------------------------

def _index_field(data, offset):
    """File position of index field `offset` (the first APP9 segment's blob)."""
    return 4 + 2 + len(seekable.SIGNATURE) + offset


@pytest.fixture(scope="module")
def pair():
    orig = make("420", 240, 320)
    return orig, seekable.transcode(orig, 2).data


def _patched(data, pos, new):
    return data[:pos] + new + data[pos + len(new):]


BOX, SIZE = (150.0, 100.0, 80.0, 120.0), (40, 40)


def _both(orig, strict=True):
    """The kernel's pixels of the original, and a fresh seeker."""
    want = _kernel.Decoder(strict=strict).decode_crop(orig, BOX, SIZE)
    return want, _seek.Seeker(strict=strict)


@pytest.mark.parametrize("what,field,value,reason", [
    ("row offset", 40 + 8 * 5, 77, "row"),
    ("scan length out of bounds", 28, 10**8, "past the"),
    ("scan offset", 24, 3, "scan starts"),
    ("width", 0, 321, "SOF says"),
    ("interval", 20, 3, "does not divide|DRI says"),
    ("lengths", 32, 5, "fields make"),
])
def test_index_disagreeing_with_a_sound_file_falls_back(pair, what, field, value, reason):
    orig, seek = pair
    bad = _patched(seek, _index_field(seek, field), struct.pack("<I", value))
    want, seeker = _both(orig)
    assert np.array_equal(seeker.decode_crop(bad, BOX, SIZE), want)  # the plain path
    assert seeker.stats()["fallback"] == 1, what
    assert re.search(reason, seeker.why), seeker.why
    with pytest.raises(ValueError, match=reason):
        seekable.index_info(bad)


def test_segment_lengths_disagreeing_fall_back(pair):
    orig, seek = pair
    info = seekable.index_info(seek)
    # The varint lengths start after the 40-byte fields and the row table.
    pos = _index_field(seek, 40 + 8 * info["mcus"][0])
    bad = _patched(seek, pos, bytes([seek[pos] ^ 0x01]))
    want, seeker = _both(orig)
    assert np.array_equal(seeker.decode_crop(bad, (0, 0, 100, 100), SIZE),
                          _kernel.Decoder().decode_crop(orig, (0, 0, 100, 100), SIZE))
    assert seeker.stats()["fallback"] == 1
    assert "segment" in seeker.why or "add up" in seeker.why


def test_truncated_segment_is_refused_by_name(pair):
    orig, seek = pair
    info = seekable.index_info(seek)
    cut = info["scan_offset"] + info["scan_bytes"] // 3
    bad = seek[:cut] + seek[cut + 40:]  # 40 bytes gone from a segment mid-scan
    seeker = _seek.Seeker()
    with pytest.raises(en.DecodeError) as e:
        seeker.decode_crop(bad, (200.0, 10.0, 30.0, 30.0), SIZE)
    assert "seekable index" in str(e.value)
    # Truncated at the end: no EOI, offsets past the file.
    with pytest.raises(en.DecodeError, match="seekable index.*past the"):
        seeker.decode_crop(seek[: len(seek) - 300], BOX, SIZE)


def test_forged_dri(pair):
    orig, seek = pair
    pos = find_segment(seek, {0xDD}) + 4
    bad = _patched(seek, pos, struct.pack(">H", 4))
    seeker = _seek.Seeker()
    # The file itself is unsound now (RST markers every 2 MCUs, DRI says 4): refused,
    # naming the index's disagreement as well.
    with pytest.raises(en.DecodeError, match="DRI says 4"):
        seeker.decode_crop(bad, BOX, SIZE)
    lenient = _seek.Seeker(strict=False)
    lenient.decode_crop(bad, BOX, SIZE)  # strict=False decodes on, as the kernel does
    assert lenient.stats()["fallback"] == 1


def test_corrupt_entropy_data_in_the_crop_is_refused(pair):
    orig, seek = pair
    info = seekable.index_info(seek)
    # Garble bytes in the middle of the scan without touching markers.
    pos = info["scan_offset"] + info["scan_bytes"] * 2 // 3
    body = bytes(b if b != 0xFF else 0x00 for b in seek[pos:pos + 20])
    bad = _patched(seek, pos, bytes(x ^ 0x5A if x not in (0xFF, 0xA5) else x for x in body))
    kern = _kernel.Decoder()
    seeker = _seek.Seeker()
    try:
        kern.decode(bad)
    except en.DecodeError:
        with pytest.raises(en.DecodeError):
            for i in range(40):  # some crop covers the damage
                seeker.decode_random_crop(bad, (32, 32), 0, 0, i, scale=(0.5, 1.0))
    else:  # the garbling decoded without a warning: nothing to refuse, pixels must agree
        for i in range(10):
            a = kern.decode_random_crop(bad, (32, 32), 0, 0, i)
            assert a == seeker.decode_random_crop(bad, (32, 32), 0, 0, i)


def test_limits_apply_to_the_original(pair):
    orig, seek = pair
    with pytest.raises(en.DecodeError, match="max_pixels"):
        _seek.Seeker(max_pixels=1000).decode_crop(seek, BOX, SIZE)
    with pytest.raises(ValueError, match="not inside"):
        _seek.Seeker().decode_crop(seek, (0, 0, 500, 10), SIZE)
    dec = Decoder(DecodeLimits(max_pixels=1000))
    with pytest.raises(en.DecodeError, match="max_pixels"):
        dec.crop(seek, BOX, SIZE)


# --- shards ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """An ImageFolder: JPEGs of every subsampling (one progressive), a PNG, a CMYK JPEG."""
    root = tmp_path_factory.mktemp("seekfolder")
    files = {}
    for k, variant in enumerate(["420", "444", "422-progressive", "gray", "420", "422"]):
        files[f"a/{k}.jpg"] = make(variant, 90 + 17 * k, 130 + 11 * k)
    png = io.BytesIO()
    Image.fromarray(fit(photo("astronaut"), 50, 70)).save(png, "PNG")
    files["b/png.png"] = png.getvalue()
    files["b/cmyk.jpg"] = fixture("cmyk-plain.jpg")
    for rel, data in files.items():
        (root / rel).parent.mkdir(exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def test_write_shards_seekable_read_back(folder, tmp_path):
    plain = en.write_shards(folder, tmp_path / "plain", max_count=3, progress=False)
    seek = en.write_shards(folder, tmp_path / "seek", max_count=3, progress=False,
                           seekable=True, workers=3)
    assert len(seek) == len(plain) and seek.samples == plain.samples == 8
    assert [name for name, _ in seek.not_seekable] == [str(folder / "b" / "cmyk.jpg")]
    a, b = en.TarShards(list(plain)), en.TarShards(list(seek))
    assert len(a) == len(b) == 8 and list(a.labels) == list(b.labels)
    dec, kern = Decoder(), Decoder()
    seekable_count = 0
    for i in range(len(a)):
        orig, data = a.read(i), b.read(i)
        seekable_count += seekable.is_seekable(data)
        for k in range(4):
            out_a, out_b = np.empty((24, 24, 3), np.uint8), np.empty((24, 24, 3), np.uint8)
            key = (7, 0, i, k)
            assert (kern.random_crop(orig, (24, 24), key, (0.08, 1), (0.75, 4 / 3), 0.5, out_a)
                    == dec.random_crop(data, (24, 24), key, (0.08, 1), (0.75, 4 / 3), 0.5,
                                       out_b))
            assert np.array_equal(out_a, out_b)
    assert seekable_count == 6
    assert dec._seek.stats()["seek"] > 0 and kern._seek is None
    # Through the pipeline: a ring over the seekable shards delivers the same batches.
    batches = []
    for src in (a, b):
        with en.EchoRing(src, batch_size=4, image_size=32, echo=1, workers=1, seed=3) as ring:
            batches.append([(bt.sample_ids.copy(), np.asarray(bt.images).copy())
                            for bt in ring])
    for (ia, xa), (ib, xb) in zip(*batches):
        assert np.array_equal(ia, ib) and np.array_equal(xa, xb)


def test_write_shards_resumes(folder, tmp_path):
    whole = en.write_shards(folder, tmp_path / "whole", max_count=3, progress=False,
                            seekable=True)
    out = tmp_path / "cut"
    en.write_shards(folder, out, max_count=3, progress=False, seekable=True)
    # An interrupted run: the last shard never got its index, a temporary is left over.
    (out / "shard-000002.tar.idx").unlink()
    (out / ".shard-000003.tar.x.tmp").write_bytes(b"partial")
    again = en.write_shards(folder, out, max_count=3, progress=False, seekable=True,
                            resume=True)
    assert again.resumed == 2 and again.samples == 2
    assert [os.path.basename(p) for p in again] == [os.path.basename(p) for p in whole]
    for p, q in zip(whole, again):
        assert open(p, "rb").read() == open(q, "rb").read()
    assert not list(out.glob(".shard-*"))
    with pytest.raises(ValueError, match="resume"):
        en.write_shards(folder, out, resume=True, overwrite=True)


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_crops_identical_sweep(variant):
    """The long property sweep: many sizes, intervals, qualities and crops (minutes)."""
    rng = np.random.default_rng(hash(variant) & 0xFFFF)
    for h, w in ((31, 47), (240, 320), (377, 501), (1001, 777)):
        for quality in (60, 95):
            orig = make(variant, h, w, quality=quality, name="coffee")
            for restart in (1, 2, 3, 4, 8, seekable.ROW, seekable.DEFAULT):
                seek = seekable.transcode(orig, restart).data
                check_crops(orig, seek, rng, 60,
                            sizes=((224, 224), (24, 24), (57, 31), (3, 200), (100, 9)))


def test_existing_shards_repacked_seekable(folder, tmp_path):
    """A folder of plain shards read as a source (what `echo-native shards SRC DST
    --seekable` does with one) becomes seekable shards of the same samples."""
    from echo_native.shards import shard_files
    plain = en.write_shards(folder, tmp_path / "plain", max_count=3, progress=False)
    assert shard_files(tmp_path / "plain") == list(plain)
    src = en.TarShards(shard_files(tmp_path / "plain"))
    seek = en.write_shards(src, tmp_path / "seek", max_count=3, progress=False,
                           seekable=True, restart=seekable.ROW, workers=2)
    b = en.TarShards(list(seek))
    assert list(b.labels) == list(src.labels)
    for i in range(len(src)):
        data = b.read(i)
        if seekable.is_seekable(data):
            info = seekable.index_info(data)
            assert info["interval"] == info["mcus"][1]  # restart=ROW
            assert np.array_equal(en.decode(data), en.decode(src.read(i)))
        else:
            assert data == src.read(i)

#!/usr/bin/env python3
"""Generate the hostile-input corpus as files: ``python fuzz/hostile_corpus.py OUTDIR``.

The corpus itself is not checked in: every file is made from scikit-image's
photographs by the builders the tests use (``tests/jpegs.py``: Pillow, byte
surgery) and from the tests' committed JPEG fixtures (``tests/data/jpeg/``: the
arithmetic, many-scan, lossless, 12-bit, CMYK/YCCK and restart-interval files that
Pillow cannot write), so it needs no compiler or command-line tool.  Generation is
deterministic (fixed seeds), so the same corpus comes out on every machine with the
same Pillow.

Every file must make every public entry point raise ``DecodeError`` (or
``ValueError``/``TypeError``) or return a correct image, quickly, with bounded
memory (``tests/robustness/test_hostile_corpus.py`` checks that).  Categories:

  trunc-*       truncated at every segment boundary (and inside segments / scans)
  flip-*        single-bit flips in SOF, DQT, DHT, SOS, DRI and APP14 segments
  corrupt-*     named table/header corruptions (bad indices, zero quant tables ...)
  dims-*        wrong SOF dimensions: larger/smaller than the data, 0x0, 65500^2, 65535^2
  scans-*       thousands of progressive scans (valid 1135-scan file, repeated scans)
  cmyk-*        CMYK/YCCK with and without the Adobe marker
  precision-*   12-bit / 16-bit (patched SOF precision and real 12-bit / lossless
                files), lossless, hierarchical
  arith-*       arithmetic coding (jpegtran -arithmetic fixtures), corrupt arithmetic data
  restart-*     restart interval mismatches (DRI changed, added, removed; RST renumbered),
                libjpeg's own restart intervals
  notjpeg-*     PNG/GIF/WebP/BMP/TIFF/text/HTML/empty/random files named .jpg
  regress-*     regression inputs from fuzzing (see fuzz/README.md)

``manifest.json`` in OUTDIR maps each file name to its category and what is
expected: ``"error"`` (must raise), ``"image"`` (must decode in strict mode) or
``"any"`` (either, but a decoded image must match Pillow when Pillow decodes it).
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
_TESTS = os.path.join(os.path.dirname(_HERE), "tests")
for _p in (_TESTS, os.path.join(_TESTS, "data")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import jpegs as C  # noqa: E402  (the tests' photo/encoder/byte-surgery helpers)
import jpeg_fixtures as fx  # noqa: E402  (the committed JPEGs Pillow cannot write)

ERROR, IMAGE, ANY = "error", "image", "any"


class Corpus:
    def __init__(self):
        self.files: dict[str, tuple[bytes, str, str]] = {}

    def add(self, name: str, data: bytes, expect: str = ANY):
        name = name.replace(":", "").replace(" ", "_") + ".jpg"
        assert name not in self.files, name
        self.files[name] = (bytes(data), name.split("-")[0], expect)


# ---------------------------------------------------------------------------
# seed JPEGs (small, so "every boundary" stays a few hundred files)


def _small(name="chelsea", h=64, w=96):
    return C.fit(C.photo(name), h, w)


def bases() -> dict[str, bytes]:
    src = _small()
    ink = C.rgb_to_ink(_small("astronaut"))
    return {
        "baseline": C.pil_jpeg(src, 85),
        "progressive": C.pil_jpeg(src, 85, progressive=True),
        "restart": C.pil_jpeg(src, 85, restart_marker_blocks=2),
        "gray": C.pil_jpeg(_small("camera"), 85),
        "cmyk": C.pil_encode(ink, "JPEG", "CMYK", quality=85),
        "arith": fx.read("arith-sequential.jpg"),
        "arithprog": fx.read("arith-progressive-restart.jpg"),   # restart every 16 MCUs
    }


def marker_offsets(data: bytes) -> list[int]:
    """Offsets of every marker (0xFF followed by a non-zero, non-fill byte), headers and scans."""
    out = []
    i = 2
    while True:
        i = data.find(b"\xff", i)
        if i < 0 or i + 1 >= len(data):
            return out
        if data[i + 1] not in (0x00, 0xFF):
            out.append(i)
        i += 1


# ---------------------------------------------------------------------------
# categories


def truncations(c: Corpus, base: dict[str, bytes]):
    for bname, data in base.items():
        cuts = set()
        for off in marker_offsets(data):
            cuts.update((off, off + 1, off + 2, off + 4))   # at, inside marker, inside length
        cuts.update((0, 1, 2, 3, len(data) - 2, len(data) - 1))
        for cut in sorted(x for x in cuts if 0 <= x < len(data)):
            # A cut just before EOI leaves a complete image (libjpeg warns, strict refuses).
            c.add(f"trunc-{bname}-{cut:06d}", data[:cut], ANY if cut >= len(data) - 2 else ERROR)
        for frac in (0.25, 0.5, 0.75, 0.9):
            c.add(f"trunc-{bname}-frac{int(frac * 100)}", data[:int(len(data) * frac)], ERROR)


def bit_flips(c: Corpus, base: dict[str, bytes], per_segment=24):
    rng = np.random.default_rng(8)
    names = {0xC0: "SOF0", 0xC2: "SOF2", 0xC9: "SOF9", 0xCA: "SOF10", 0xC4: "DHT",
             0xDB: "DQT", 0xDA: "SOS", 0xDD: "DRI", 0xEE: "APP14", 0xCC: "DAC"}
    for bname in ("baseline", "progressive", "restart", "cmyk", "arith"):
        data = base[bname]
        for marker, pos, length in C.segments(data):
            if marker not in names:
                continue
            span = 2 + length
            offs = rng.integers(pos + 1, pos + span, size=per_segment)
            bits = rng.integers(0, 8, size=per_segment)
            for k, (o, b) in enumerate(zip(offs, bits)):
                bad = bytearray(data)
                bad[o] ^= 1 << int(b)
                c.add(f"flip-{bname}-{names[marker]}@{pos}-{k:02d}-o{o}b{b}", bad)
        # Multi-byte overwrites across all the headers at once.
        sos = data.find(b"\xff\xda")
        for k in range(24):
            bad = bytearray(data)
            for o in rng.integers(2, sos + 10, size=4):
                bad[o] = int(rng.integers(0, 256))
            c.add(f"flip-{bname}-headers-multi-{k:02d}", bad)


def corruptions(c: Corpus, base: dict[str, bytes]):
    d = base["baseline"]
    dht, dqt = C.find_segment(d, 0xC4), C.find_segment(d, 0xDB)
    sof, sos = C.find_segment(d, C.SOF_MARKERS), C.find_segment(d, 0xDA)
    cases = {
        "huffman-counts-overflow": (dht + 5, bytes([255] * 16)),
        "huffman-bad-index": (dht + 4, bytes([0x1F])),
        "huffman-bad-symbols": (dht + 21, b"\xff" * 4),
        "huffman-undefined": (sos + 6, bytes([0x33])),
        "huffman-zero-counts": (dht + 5, bytes(16)),
        "quant-bad-index": (dqt + 4, bytes([0x0F])),
        "quant-bad-precision": (dqt + 4, bytes([0x20])),
        "quant-zeros": (dqt + 5, bytes(64)),
        "quant-undefined": (sof + 12, bytes([3])),
        "marker-length-short": (dqt + 2, b"\x00\x03"),
        "marker-length-huge": (dqt + 2, b"\xff\xff"),
        "sof-no-components": (sof + 9, b"\x00"),
        "sof-5-components": (sof + 9, b"\x05"),
        "sof-bad-sampling": (sof + 11, b"\x55"),
        "sof-zero-sampling": (sof + 11, b"\x00"),
        "sof-sampling-4x4": (sof + 11, b"\x44"),
        "sof-dup-component-id": (sof + 13, bytes([d[sof + 10]])),
        "sos-bad-component": (sos + 5, b"\x09"),
        "sos-too-many-components": (sos + 4, b"\x05"),
        "sos-zero-components": (sos + 4, b"\x00"),
        "sos-bad-spectral": (sos + 4 + 1 + 2 * d[sos + 4], b"\x05\x02"),
        "soi-twice": (2, b"\xff\xd8"),
        "eoi-early": (sof, b"\xff\xd9"),
    }
    for name, (off, new) in cases.items():
        c.add(f"corrupt-{name}", C.patch(d, off, new), ERROR)
    # No tables at all (Motion-JPEG style without DHT uses the standard tables: decodes).
    c.add("corrupt-no-dqt", _strip(d, 0xDB), ERROR)
    c.add("corrupt-no-dht", _strip(d, 0xC4), ANY)
    c.add("corrupt-no-sof", _strip(d, 0xC0), ERROR)
    c.add("corrupt-no-sos", d[:sos] + b"\xff\xd9", ERROR)
    c.add("corrupt-reserved-marker-midscan",
          C.patch(d, (sos + len(d)) // 2, b"\xff\x17" * 4), ERROR)
    c.add("corrupt-entropy-zeros", d[:sos + 20] + bytes(len(d) - sos - 22) + b"\xff\xd9", ANY)
    c.add("corrupt-entropy-ones", d[:sos + 20] + b"\xfe" * (len(d) - sos - 22) + b"\xff\xd9",
          ANY)


def _strip(data: bytes, marker: int) -> bytes:
    out, last = bytearray(data[:2]), 2
    for m, pos, length in C.segments(data):
        if m != marker:
            out += data[pos:pos + 2 + length]
        last = pos + 2 + length
    return bytes(out + data[last:])


def dimensions(c: Corpus, base: dict[str, bytes]):
    for bname in ("baseline", "progressive"):
        d = base[bname]
        h, w = 64, 96
        for hh, ww in [(h * 2, w), (h, w * 2), (h * 8, w * 8), (h // 2, w // 2), (1, 1), (8, 8),
                       (h + 1, w + 1), (1, 65500), (65500, 1), (2000, 3000)]:
            c.add(f"dims-{bname}-{hh}x{ww}", C.set_sof_size(d, hh, ww), ANY)
        for hh, ww in [(0, 0), (0, w), (h, 0)]:
            c.add(f"dims-{bname}-{hh}x{ww}", C.set_sof_size(d, hh, ww), ERROR)
        for hh, ww in [(65500, 65500), (65535, 65535), (65535, 1), (1, 65535), (9460, 9460)]:
            # 65535 is over libjpeg's JPEG_MAX_DIMENSION; 9460^2 is just over max_pixels.
            c.add(f"dims-{bname}-{hh}x{ww}", C.set_sof_size(d, hh, ww), ERROR)
        c.add(f"dims-{bname}-4000x4000-truncated", C.set_sof_size(d, 4000, 4000)[:600], ERROR)


def many_scans(c: Corpus, base: dict[str, bytes]):
    valid = fx.read("progressive-1135-scans.jpg")
    assert C.count_scans(valid) == 1135
    c.add("scans-valid-1135", valid, ERROR)   # over the default max_scans
    c.add("scans-valid-190", fx.read("progressive-190-scans.jpg"), IMAGE)
    c.add("scans-valid-97", fx.read("progressive-97-scans.jpg"), IMAGE)
    c.add("scans-valid-script-12", fx.read("progressive-script.jpg"), IMAGE)
    p = base["progressive"]
    last, eoi = p.rfind(b"\xff\xda"), p.rfind(b"\xff\xd9")
    for n in (300, 2000, 5000):
        c.add(f"scans-repeated-last-{n}", p[:eoi] + p[last:eoi] * n + p[eoi:], ERROR)
    # Thousands of empty (header-only) scans of one component.
    first = p.find(b"\xff\xda")
    sos_len = int.from_bytes(p[first + 2:first + 4], "big")
    hdr = p[first:first + 2 + sos_len]
    c.add("scans-empty-headers-3000", p[:eoi] + hdr * 3000 + p[eoi:], ERROR)
    # Thousands of scans in a baseline file (not allowed: multiple scans must be progressive
    # or non-interleaved; libjpeg reports it, the limit catches it otherwise).
    b = base["baseline"]
    bl, be = b.rfind(b"\xff\xda"), b.rfind(b"\xff\xd9")
    c.add("scans-baseline-repeated-1500", b[:be] + b[bl:be] * 1500 + b[be:], ERROR)
    # Arithmetic progressive with repeated scans.
    a = base["arithprog"]
    al, ae = a.rfind(b"\xff\xda"), a.rfind(b"\xff\xd9")
    c.add("scans-arith-repeated-1200", a[:ae] + a[al:ae] * 1200 + a[ae:], ERROR)


def cmyk(c: Corpus, base: dict[str, bytes]):
    rgb = _small("astronaut")
    ycck = fx.read("ycck-adobe.jpg")
    c.add("cmyk-plain-no-adobe", fx.read("cmyk-plain.jpg"), IMAGE)
    c.add("cmyk-adobe", base["cmyk"], IMAGE)
    c.add("cmyk-adobe-stripped", _strip(base["cmyk"], 0xEE), IMAGE)
    c.add("cmyk-ycck-adobe", ycck, IMAGE)
    c.add("cmyk-ycck-no-adobe", _strip(ycck, 0xEE), IMAGE)
    c.add("cmyk-progressive-no-adobe", fx.read("cmyk-plain-progressive.jpg"), IMAGE)
    # An Adobe marker claiming YCCK on plain CMYK data, and one claiming CMYK on YCCK data.
    d = base["cmyk"]
    app14 = C.find_segment(d, 0xEE)
    c.add("cmyk-adobe-says-ycck", C.patch(d, app14 + 15, b"\x02"), ANY)
    c.add("cmyk-adobe-bad-transform", C.patch(d, app14 + 15, b"\x07"), ANY)
    # RGB (3-component) files with an Adobe marker saying CMYK transform.
    rgbfile = C.pil_jpeg(rgb, 90, keep_rgb=True)
    c.add("cmyk-rgb-adobe", rgbfile, IMAGE)


def precision(c: Corpus, base: dict[str, bytes]):
    for bname in ("baseline", "progressive"):
        d = base[bname]
        sof = C.find_segment(d, C.SOF_MARKERS)
        for marker in (0xC0, 0xC1, 0xC2):
            for bits in (12, 16, 0, 7):
                bad = C.patch(C.patch(d, sof + 1, bytes([marker])), sof + 4, bytes([bits]))
                c.add(f"precision-{bname}-sof{marker & 0xF}-{bits}bit", bad, ERROR)
        for marker in (0xC3, 0xC5, 0xC6, 0xC7, 0xCB, 0xCD, 0xCE, 0xCF):
            c.add(f"precision-{bname}-sof{marker:02x}", C.patch(d, sof + 1, bytes([marker])),
                  ERROR)
    c.add("precision-sof1-8bit", C.patch(base["baseline"],
                                         C.find_segment(base["baseline"], C.SOF_MARKERS) + 1,
                                         b"\xc1"), IMAGE)
    # Real files of the unsupported processes (libjpeg-turbo 3 wrote them), whole and cut.
    for name in ("lossless-rgb.jpg", "lossless-gray-16bit.jpg", "twelve-bit-rgb.jpg"):
        d = fx.read(name)
        stem = name[:-4]
        c.add(f"precision-real-{stem}", d, ERROR)
        c.add(f"precision-real-{stem}-truncated", d[:len(d) // 2], ERROR)
        c.add(f"precision-real-{stem}-headers-only", d[:d.find(b"\xff\xda") + 4], ERROR)


def arithmetic(c: Corpus, base: dict[str, bytes]):
    c.add("arith-sequential", base["arith"], IMAGE)
    c.add("arith-progressive-restart", base["arithprog"], IMAGE)
    rng = np.random.default_rng(12)
    for k in range(20):
        bad = bytearray(base["arith"])
        sos = bad.find(b"\xff\xda")
        for o in rng.integers(sos + 14, len(bad) - 2, size=3):
            if bad[o] != 0xFF and bad[o - 1] != 0xFF:
                bad[o] = int(rng.integers(0, 255))
        c.add(f"arith-corrupt-{k:02d}", bad, ANY)
    c.add("arith-jpegtran-progressive", fx.read("arith-progressive.jpg"), IMAGE)
    c.add("arith-jpegtran-restart-rows-1", fx.read("arith-restart.jpg"), IMAGE)


def restarts(c: Corpus, base: dict[str, bytes]):
    d = base["restart"]
    dri = C.find_segment(d, 0xDD)
    interval = int.from_bytes(d[dri + 4:dri + 6], "big")
    for new in sorted({0, 1, interval - 1, interval + 1, interval * 2, 7, 65535}):
        if new >= 0 and new != interval:
            c.add(f"restart-dri-{interval}-to-{new}",
                  C.patch(d, dri + 4, new.to_bytes(2, "big")), ANY)
    c.add("restart-dri-removed", _strip(d, 0xDD), ANY)
    # A DRI added to a file without restart markers.
    b = base["baseline"]
    sof = C.find_segment(b, C.SOF_MARKERS)
    for n in (1, 4):
        c.add(f"restart-dri-added-{n}", b[:sof] + b"\xff\xdd\x00\x04" + n.to_bytes(2, "big")
              + b[sof:], ANY)
    # RST markers renumbered / dropped / duplicated.
    sos = d.find(b"\xff\xda")
    rsts = [i for i in range(sos, len(d) - 1) if d[i] == 0xFF and 0xD0 <= d[i + 1] <= 0xD7]
    assert len(rsts) > 4
    c.add("restart-rst-swapped", C.patch(C.patch(d, rsts[1], d[rsts[2]:rsts[2] + 2]),
                                         rsts[2], d[rsts[1]:rsts[1] + 2]), ANY)
    c.add("restart-rst-all-rst0", bytes(
        x if not (i - 1 in set(rsts)) else 0xD0 for i, x in enumerate(d)), ANY)
    c.add("restart-rst-dropped", d[:rsts[3]] + d[rsts[3] + 2:], ANY)
    c.add("restart-rst-duplicated", d[:rsts[3]] + d[rsts[3]:rsts[3] + 2] * 2 + d[rsts[3] + 2:],
          ANY)
    c.add("restart-rst-injected-in-baseline",
          C.patch(b, (b.find(b"\xff\xda") + len(b)) // 2, b"\xff\xd3"), ANY)
    # libjpeg's own intervals (cjpeg / jpegtran fixtures): every MCU, every 5 MCUs
    # (straddling rows), every 3 rows, in a progressive file; and the densest one damaged.
    for name in ("restart-mcus-1.jpg", "restart-mcus-5.jpg", "restart-rows-3.jpg",
                 "restart-progressive.jpg"):
        c.add(f"restart-libjpeg-{name[8:-4]}", fx.read(name), IMAGE)
    dense = fx.read("restart-mcus-1.jpg")
    dri = C.find_segment(dense, 0xDD)
    c.add("restart-libjpeg-mcus-1-dri-to-2", C.patch(dense, dri + 4, b"\x00\x02"), ANY)
    c.add("restart-libjpeg-mcus-1-dri-removed", _strip(dense, 0xDD), ANY)


def not_jpeg(c: Corpus, base: dict[str, bytes]):
    for name in C.OTHER_FORMAT_NAMES:
        data = C.other_format_bytes(name)
        c.add(f"notjpeg-{name}", data, IMAGE)   # decodes through Pillow
        c.add(f"notjpeg-{name}-truncated", data[:len(data) // 3], ERROR)
        c.add(f"notjpeg-{name}-header-only", data[:40], ERROR)
    c.add("notjpeg-empty", b"", ERROR)
    c.add("notjpeg-text", b"This is not a photograph.\n" * 20, ERROR)
    c.add("notjpeg-html", b"<!DOCTYPE html><html><body>404 Not Found</body></html>\n", ERROR)
    c.add("notjpeg-zeros", bytes(4096), ERROR)
    c.add("notjpeg-random", np.random.default_rng(3).integers(0, 256, 4096, np.uint8).tobytes(),
          ERROR)
    c.add("notjpeg-soi-only", b"\xff\xd8", ERROR)
    c.add("notjpeg-soi-eoi", b"\xff\xd8\xff\xd9", ERROR)
    c.add("notjpeg-soi-ff-run", b"\xff\xd8" + b"\xff" * 10000, ERROR)
    c.add("notjpeg-soi-text", b"\xff\xd8" + b"not really a jpeg" * 10, ERROR)
    c.add("notjpeg-png-named-jpg-wrong-crc",
          C.patch(C.other_format_bytes("png-rgb"), 29, b"\x00\x00\x00\x00"), ANY)


# Regression inputs: each is a byte recipe (never a blob) reproducing a fuzzer finding.
# Add a function here per finding; see fuzz/README.md.
REGRESSIONS: dict[str, tuple] = {}


def regressions(c: Corpus, base: dict[str, bytes]):
    for name, (make, expect) in REGRESSIONS.items():
        c.add(f"regress-{name}", make(base), expect)


def build(outdir: str) -> dict:
    """Write every corpus file and manifest.json into ``outdir``; return the manifest."""
    os.makedirs(outdir, exist_ok=True)
    c = Corpus()
    base = bases()
    truncations(c, base)
    bit_flips(c, base)
    corruptions(c, base)
    dimensions(c, base)
    many_scans(c, base)
    cmyk(c, base)
    precision(c, base)
    arithmetic(c, base)
    restarts(c, base)
    not_jpeg(c, base)
    regressions(c, base)
    manifest = {}
    for name, (data, category, expect) in sorted(c.files.items()):
        with open(os.path.join(outdir, name), "wb") as f:
            f.write(data)
        manifest[name] = {"category": category, "expect": expect, "bytes": len(data)}
    with open(os.path.join(outdir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    return manifest


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print(__doc__.split("\n\n")[0], file=sys.stderr)
        return 2
    manifest = build(argv[0])
    cats = {}
    for v in manifest.values():
        cats[v["category"]] = cats.get(v["category"], 0) + 1
    total = sum(v["bytes"] for v in manifest.values())
    print(f"{len(manifest)} files, {total / 2**20:.1f} MiB in {argv[0]}: "
          + ", ".join(f"{k} {n}" for k, n in sorted(cats.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Test inputs for the native JPEG kernel, built from real photographs.

Every JPEG here is encoded from one of scikit-image's bundled photographs
(never noise or flat colour), by Pillow, or, for the variants Pillow cannot
write (4:4:0 and 4:1:1 sampling, YCCK, CMYK without an Adobe marker,
arithmetic coding, 190-scan progressive), read from the committed fixtures
(``tests/data/jpeg``).  Also here: the Pillow references every decode is
compared with, JPEG byte surgery, and the non-JPEG formats.  The fixtures
that hand these to tests are in ``conftest.py``.
"""
from __future__ import annotations

import functools
import io
import os
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np
from PIL import Image

TESTS = os.path.dirname(os.path.abspath(__file__))
for _path in (TESTS, os.path.join(TESTS, "data")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import jpeg_fixtures as fx  # noqa: E402  (tests/data: the committed JPEG variants)
import make_jpeg_fixtures  # noqa: E402  (its inks(), the fixtures' CMYK source)

# ---------------------------------------------------------------------------
# photographs


from photos import fit, photo  # noqa: E402  (re-exported for fuzz/hostile_corpus.py)


def rgb_to_ink(rgb: np.ndarray) -> np.ndarray:
    """Printer inks (C, M, Y, K; 0 = no ink) whose Pillow CMYK->RGB conversion is ``rgb``.

    Grey-component replacement: K takes the common darkness, C/M/Y the rest,
    so all four channels carry real image structure.
    """
    rgb = rgb.astype(np.float64)
    k = 255.0 - rgb.max(axis=-1)
    room = np.where(k < 255.0, 255.0 - k, 1.0)
    cmy = 255.0 * (255.0 - rgb - k[..., None]) / room[..., None]
    ink = np.concatenate([cmy, k[..., None]], axis=-1)
    return np.clip(np.round(ink), 0, 255).astype(np.uint8)


def ink_to_rgb(ink: np.ndarray) -> np.ndarray:
    """Pillow's CMYK -> RGB (each ink darkens multiplicatively), via Pillow itself."""
    return np.asarray(Image.fromarray(np.ascontiguousarray(ink), "CMYK").convert("RGB"))


# ---------------------------------------------------------------------------
# encoders


def pil_encode(arr: np.ndarray, fmt: str, mode: str | None = None, **opts) -> bytes:
    """Encode an array with Pillow (``mode`` overrides the inferred mode, e.g. CMYK)."""
    im = Image.fromarray(np.ascontiguousarray(arr), mode) if mode else Image.fromarray(
        np.ascontiguousarray(arr))
    buf = io.BytesIO()
    im.save(buf, fmt, **opts)
    return buf.getvalue()


def pil_jpeg(arr: np.ndarray, quality: int = 90, **opts) -> bytes:
    """A JPEG written by Pillow (subsampling, progressive, restart_marker_* ... pass through)."""
    return pil_encode(arr, "JPEG", quality=quality, **opts)


# The writer's source: tests/c/jpegtool.c (compiled on first use).
# ---------------------------------------------------------------------------
# references and byte surgery


def _to_rgb(im: Image.Image) -> Image.Image:
    # Pillow assumes every CMYK JPEG is Adobe-inverted.  libjpeg's convention
    # (and the kernel's) is that only files with an Adobe marker are; a CMYK
    # JPEG without one stores plain ink.  Undo Pillow's inversion for those.
    if im.format == "JPEG" and im.mode == "CMYK" and "adobe" not in im.info:
        return Image.fromarray(255 - np.asarray(im), "CMYK").convert("RGB")
    return im.convert("RGB")


def pil_decode(data: bytes) -> np.ndarray:
    """Pillow's decode of any format, converted to RGB (the reference)."""
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(_to_rgb(im))


def pil_draft(data: bytes, denom: int) -> Image.Image | None:
    """The JPEG decoded by Pillow at DCT scale 1/denom, or None where Pillow cannot.

    Pillow's draft only reaches 1/d when both sides are at least d pixels; for
    smaller images it silently picks a finer scale, which is refused here.
    """
    im = Image.open(io.BytesIO(data))
    w, h = im.size
    if denom > 1:
        if min(w, h) < denom:
            return None
        im.draft(im.mode, (w // denom, h // denom))
        want = (-(-w // denom), -(-h // denom))
        assert im.size == want, f"Pillow draft gave {im.size}, wanted 1/{denom} = {want}"
    return _to_rgb(im)


def pil_crop(data: bytes, box, size, denom: int = 1) -> np.ndarray | None:
    """Pillow's reference for decode_crop: draft to 1/denom, then resize(box, BILINEAR)."""
    im = pil_draft(data, denom)
    if im is None:
        return None
    top, left, h, w = box
    pbox = (left / denom, top / denom, (left + w) / denom, (top + h) / denom)
    return np.asarray(im.resize((size[1], size[0]), Image.BILINEAR, box=pbox))


def pil_resize(image: np.ndarray, box, size) -> np.ndarray:
    """Pillow's resize(size, BILINEAR, box) of an RGB array."""
    top, left, h, w = box
    im = Image.fromarray(np.ascontiguousarray(image))
    return np.asarray(im.resize((size[1], size[0]), Image.BILINEAR,
                                box=(left, top, left + w, top + h)))


def diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| as int, after asserting equal shapes."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return np.abs(a.astype(np.int32) - b.astype(np.int32))


SOF_MARKERS = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def segments(data: bytes):
    """(marker, offset of the 0xFF, segment length incl. the 2 length bytes) up to SOS.

    Yields the SOS segment too (its entropy data follows it)."""
    pos = 2
    while pos + 4 <= len(data):
        assert data[pos] == 0xFF, f"no marker at {pos}"
        marker = data[pos + 1]
        if marker == 0xFF:
            pos += 1
            continue
        length = int.from_bytes(data[pos + 2:pos + 4], "big")
        yield marker, pos, length
        if marker == 0xDA:
            return
        pos += 2 + length


def find_segment(data: bytes, markers) -> int:
    """Offset of the first segment whose marker is in ``markers``."""
    markers = {markers} if isinstance(markers, int) else set(markers)
    for marker, pos, _ in segments(data):
        if marker in markers:
            return pos
    raise AssertionError(f"no marker {markers} in the JPEG")


def patch(data: bytes, offset: int, new: bytes) -> bytes:
    """A copy of ``data`` with ``new`` written at ``offset``."""
    out = bytearray(data)
    out[offset:offset + len(new)] = new
    return bytes(out)


def set_sof_size(data: bytes, height: int, width: int) -> bytes:
    """The JPEG with its frame header declaring height x width (the data is unchanged)."""
    sof = find_segment(data, SOF_MARKERS)
    return patch(data, sof + 5, height.to_bytes(2, "big") + width.to_bytes(2, "big"))


def count_scans(data: bytes) -> int:
    """Number of SOS markers (scans) in a JPEG."""
    return data.count(b"\xff\xda")


# ---------------------------------------------------------------------------
# the JPEG input kinds


@dataclass(frozen=True)
class Sample:
    """One encoded input: its bytes, what it was encoded from, and the expected decode."""
    name: str
    data: bytes
    source: np.ndarray      # RGB the file was encoded from
    expected: np.ndarray    # reference RGB decode (Pillow's unless noted)
    source_tol: float       # allowed mean |decode - source| (lossy coding)


def _gray3(arr):
    return np.repeat(arr[..., None], 3, axis=-1)


def _make(name, data, source, tol, expected=None):
    exp = pil_decode(data) if expected is None else expected
    return Sample(name, data, source, exp, tol)


def _chelsea():
    return photo("chelsea")   # 300 x 451: odd width, height not a multiple of 16


def _coffee_small():
    return photo("coffee")[60:260, 100:397]   # 200 x 297


def _ink_photo():
    rgb = photo("astronaut")[40:240, 120:371]   # 200 x 251
    ink = rgb_to_ink(rgb)
    return ink, ink_to_rgb(ink)


def _build_kind(name: str) -> Sample:
    b = KIND_BUILDERS[name]
    return b()


KIND_BUILDERS: dict[str, Callable[[], Sample]] = {}


def kind(name):
    def deco(fn):
        KIND_BUILDERS[name] = fn
        return fn
    return deco


for _ss in ("4:4:4", "4:2:2", "4:2:0"):
    for _prog in (False, True):
        def _b(ss=_ss, prog=_prog, n=f"{'progressive' if _prog else 'baseline'}-{_ss}"):
            src = _chelsea()
            return _make(n, pil_jpeg(src, 90, subsampling=ss, progressive=prog), src, 3.0)
        KIND_BUILDERS[f"{'progressive' if _prog else 'baseline'}-{_ss}"] = _b


# The variants Pillow cannot write come from the committed fixtures (tests/data/jpeg/):
# the suite needs no encoder, compiler or command-line tool on any machine.
def _fixture(name, kind, crop, tol, source=None):
    src = fx.crop(crop) if source is None else source
    return _make(kind, fx.read(name), src, tol)


def _fixture_inks():
    return ink_to_rgb(make_jpeg_fixtures.inks(fx.crop("astronaut")))


@kind("sampling-4:4:0")
def _k440():
    return _fixture("sampling-440.jpg", "sampling-4:4:0", "chelsea-odd", 3.0)


@kind("sampling-4:1:1")
def _k411():
    return _fixture("sampling-411.jpg", "sampling-4:1:1", "chelsea-odd", 3.5)


@kind("sampling-4:4:0-progressive")
def _k440p():
    return _fixture("sampling-440-progressive.jpg", "sampling-4:4:0-progressive",
                    "chelsea-odd", 3.0)


@kind("restart-blocks")
def _krb():
    src = _chelsea()
    data = pil_jpeg(src, 90, subsampling="4:2:0", restart_marker_blocks=3)
    assert b"\xff\xdd" in data[:1000], "Pillow wrote no DRI marker"
    return _make("restart-blocks", data, src, 3.0)


@kind("restart-rows")
def _krr():
    src = _chelsea()
    data = pil_jpeg(src, 90, subsampling="4:2:2", restart_marker_rows=1)
    assert b"\xff\xdd" in data[:1000], "Pillow wrote no DRI marker"
    return _make("restart-rows", data, src, 3.0)


@kind("restart-progressive")
def _krp():
    src = _coffee_small()
    data = pil_jpeg(src, 90, progressive=True, restart_marker_blocks=2)
    assert b"\xff\xdd" in data, "Pillow wrote no DRI marker"
    return _make("restart-progressive", data, src, 3.0)


@kind("gray")
def _kg():
    src = photo("camera")[100:400, 50:461]
    return _make("gray", pil_jpeg(src, 90), _gray3(src), 3.0)


@kind("gray-progressive")
def _kgp():
    src = photo("coins")
    return _make("gray-progressive", pil_jpeg(src, 90, progressive=True), _gray3(src), 3.0)


@kind("rgb-colorspace")
def _krgb():
    src = _chelsea()
    data = pil_jpeg(src, 92, keep_rgb=True)
    assert b"Adobe" in data[:200], "keep_rgb did not write an RGB (Adobe transform 0) JPEG"
    return _make("rgb-colorspace", data, src, 3.0)


@kind("cmyk-adobe")
def _kcmyk():
    ink, rgb = _ink_photo()
    data = pil_encode(ink, "JPEG", "CMYK", quality=95)   # Pillow writes Adobe-inverted CMYK
    assert b"Adobe" in data[:200]
    return _make("cmyk-adobe", data, rgb, 3.0)


@kind("cmyk-adobe-progressive")
def _kcmykp():
    ink, rgb = _ink_photo()
    data = pil_encode(ink, "JPEG", "CMYK", quality=95, progressive=True)
    return _make("cmyk-adobe-progressive", data, rgb, 3.0)


@kind("ycck-adobe")
def _kycck():
    # YCCK (Adobe transform 2), stored the Adobe way (inverted).
    return _fixture("ycck-adobe.jpg", "ycck-adobe", None, 3.5, source=_fixture_inks())


@kind("cmyk-plain")
def _kcmyk_plain():
    # CMYK without an Adobe marker: plain (non-inverted) ink, as libjpeg defines it.
    return _fixture("cmyk-plain.jpg", "cmyk-plain", None, 3.0, source=_fixture_inks())


@kind("arithmetic")
def _karith():
    return _fixture("arith-sequential.jpg", "arithmetic", "chelsea", 3.0)


@kind("arithmetic-progressive")
def _karithp():
    return _fixture("arith-progressive-restart.jpg", "arithmetic-progressive", "chelsea", 3.0)


@kind("many-scans-190")
def _kscans():
    data = fx.read("progressive-190-scans.jpg")
    assert count_scans(data) == 190
    return _make("many-scans-190", data, fx.crop("coffee"), 3.5)


@kind("quality-5")
def _kq5():
    src = _chelsea()
    return _make("quality-5", pil_jpeg(src, 5), src, 16.0)


@kind("quality-100")
def _kq100():
    src = _chelsea()
    return _make("quality-100", pil_jpeg(src, 100, subsampling="4:4:4"), src, 1.0)


def _sized(name, h, w, tol, photo_name="astronaut", gray=False, **opts):
    def build():
        src = photo(photo_name)
        src = fit(src, h, w)
        data = pil_jpeg(src, 95, **opts)
        return _make(name, data, _gray3(src) if gray else src, tol)
    KIND_BUILDERS[name] = build


# Tiny images are mostly block edges: compare to Pillow exactly, to the source loosely.
_sized("tiny-1x1", 1, 1, 25.0, subsampling="4:2:0")
_sized("tiny-1x1-gray", 1, 1, 25.0, photo_name="camera", gray=True)
_sized("tiny-1x1-progressive", 1, 1, 25.0, progressive=True)
_sized("tiny-2x2-4:2:0", 2, 2, 25.0, subsampling="4:2:0")
_sized("tiny-3x5-4:2:2", 3, 5, 25.0, photo_name="rocket", subsampling="4:2:2")
_sized("tall-2000x3", 2000, 3, 10.0, photo_name="rocket", subsampling="4:2:0")
_sized("wide-3x2000", 3, 2000, 10.0, photo_name="rocket", subsampling="4:2:0")
_sized("wide-1x1000-progressive", 1, 1000, 10.0, photo_name="coffee", progressive=True)
_sized("odd-17x33-4:2:0", 17, 33, 8.0, photo_name="chelsea", subsampling="4:2:0")
_sized("odd-97x61-4:2:2", 97, 61, 6.0, photo_name="coffee", subsampling="4:2:2")


KIND_NAMES = tuple(KIND_BUILDERS)


@functools.lru_cache(maxsize=None)
def jpeg_sample(name: str) -> Sample:
    """The Sample for one input kind (built once per session)."""
    return _build_kind(name)


# ---------------------------------------------------------------------------
# other formats (through Pillow)


def _png16():
    src = photo("camera")[::2, ::2].astype(np.uint16) * 257
    im = Image.fromarray(src)
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def _gif():
    im = Image.fromarray(_coffee_small()).quantize(colors=200)
    buf = io.BytesIO()
    im.save(buf, "GIF")
    return buf.getvalue()


OTHER_FORMAT_BUILDERS: dict[str, Callable[[], bytes]] = {
    "png-rgb": lambda: pil_encode(_chelsea(), "PNG"),
    "png-rgba": lambda: pil_encode(np.dstack([_coffee_small(), fit(photo("camera"), 200, 297)]),
                                   "PNG"),
    "png-gray": lambda: pil_encode(photo("coins"), "PNG"),
    "png-gray16": _png16,
    "png-1x1": lambda: pil_encode(fit(photo("astronaut"), 1, 1), "PNG"),
    "webp-lossless": lambda: pil_encode(_chelsea(), "WEBP", lossless=True),
    "webp-lossy": lambda: pil_encode(_coffee_small(), "WEBP", quality=80),
    "bmp": lambda: pil_encode(_coffee_small(), "BMP"),
    "gif": _gif,
    "tiff": lambda: pil_encode(fit(photo("rocket"), 150, 3000 // 13), "TIFF"),
}
OTHER_FORMAT_NAMES = tuple(OTHER_FORMAT_BUILDERS)


@functools.lru_cache(maxsize=None)
def other_format_bytes(name: str) -> bytes:
    return OTHER_FORMAT_BUILDERS[name]()

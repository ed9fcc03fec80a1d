"""Test inputs for the native JPEG kernel, built in memory from real photographs.

Every JPEG here is encoded from one of scikit-image's bundled photographs
(never noise or flat colour), either by Pillow or, for the variants Pillow
cannot write (4:4:0 and 4:1:1 sampling, YCCK, CMYK without an Adobe marker,
arithmetic coding, custom progressive scan scripts), by a 90-line libjpeg
writer (``tests/c/jpegtool.c``) compiled once per session against the system
libjpeg -- the same compiler and headers the package itself is built with, so
it is available wherever the package builds.  Nothing is skipped for lack of a
tool.

Fixtures:
  ``images``      session factory: photos, encoders, Pillow references, byte surgery
  ``corpus_root`` an ImageFolder tree of 48 real-photo JPEGs (per test module)
  ``jpeg_kind``   parametrised over every JPEG input kind in :data:`KINDS`
  ``other_format``  parametrised over the non-JPEG formats in :data:`OTHER_FORMATS`
"""
from __future__ import annotations

import atexit
import functools
import io
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
from PIL import Image

# The helper modules (ring_helpers, echo_helpers, sources_helpers) live in this folder;
# make them importable from test files in subfolders too (and, through sys.path, in
# forkserver workers).
TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

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
JPEGTOOL_C = os.path.join(TESTS, "c", "jpegtool.c")


class LibjpegWriter:
    """The compiled libjpeg writer; built on first use, removed at exit."""

    def __init__(self):
        self._dir = None
        self._exe = None

    def _build(self):
        self._dir = tempfile.mkdtemp(prefix="en-jpegtool-")
        atexit.register(shutil.rmtree, self._dir, True)
        exe = os.path.join(self._dir, "jpegtool")
        cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
        proc = subprocess.run([*cc, "-O1", "-o", exe, JPEGTOOL_C, "-ljpeg"], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                "cannot build the test-only libjpeg writer (needs a C compiler and the "
                "libjpeg headers, the same as building echo_native itself):\n" + proc.stderr)
        self._exe = exe

    def __call__(self, arr: np.ndarray, in_space: str, jpeg_space: str, quality: int = 90,
                 sampling: str = "-", progressive: int = 0, arithmetic: bool = False,
                 restart_rows: int = 0, adobe: int = -1) -> bytes:
        """Encode ``arr`` (H x W x C uint8) with libjpeg.

        ``progressive``: 0 sequential, 1 libjpeg's standard progression, n >= 2 a
        script of ``1 + 63 * components * (n - 1)`` scans.  ``adobe``: -1 libjpeg's
        default for the colour space, 0/1 force the Adobe marker off/on.
        """
        if self._exe is None:
            self._build()
        arr = np.ascontiguousarray(arr, dtype=np.uint8)
        nc = 1 if arr.ndim == 2 else arr.shape[2]
        fd, raw = tempfile.mkstemp(dir=self._dir, suffix=".raw")
        out = raw[:-4] + ".jpg"
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(arr.tobytes())
            cmd = [self._exe, raw, out, str(arr.shape[1]), str(arr.shape[0]), str(nc),
                   in_space, jpeg_space, str(quality), sampling, str(progressive),
                   str(int(arithmetic)), str(restart_rows), str(adobe)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"libjpeg writer failed: {proc.stderr}")
            with open(out, "rb") as f:
                return f.read()
        finally:
            for p in (raw, out):
                if os.path.exists(p):
                    os.unlink(p)


libjpeg = LibjpegWriter()


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


@kind("sampling-4:4:0")
def _k440():
    src = _chelsea()
    return _make("sampling-4:4:0", libjpeg(src, "rgb", "ycc", 90, "1x2,1x1,1x1"), src, 3.0)


@kind("sampling-4:1:1")
def _k411():
    src = _chelsea()
    return _make("sampling-4:1:1", libjpeg(src, "rgb", "ycc", 90, "4x1,1x1,1x1"), src, 3.5)


@kind("sampling-4:4:0-progressive")
def _k440p():
    src = _coffee_small()
    data = libjpeg(src, "rgb", "ycc", 90, "1x2,1x1,1x1", progressive=1)
    return _make("sampling-4:4:0-progressive", data, src, 3.0)


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
    # libjpeg encodes CMYK input as YCCK (Adobe transform 2); stored the Adobe way (inverted).
    ink, rgb = _ink_photo()
    data = libjpeg(255 - ink, "cmyk", "ycck", 95)
    assert b"Adobe" in data[:200]
    return _make("ycck-adobe", data, rgb, 3.5)


@kind("cmyk-plain")
def _kcmyk_plain():
    # CMYK without an Adobe marker: plain (non-inverted) ink, as libjpeg defines it.
    ink, rgb = _ink_photo()
    data = libjpeg(ink, "cmyk", "cmyk", 95, adobe=0)
    assert b"Adobe" not in data[:200]
    return _make("cmyk-plain", data, rgb, 3.0)


@kind("arithmetic")
def _karith():
    src = _chelsea()
    data = libjpeg(src, "rgb", "ycc", 90, "2x2,1x1,1x1", arithmetic=True)
    assert find_segment(data, SOF_MARKERS) == find_segment(data, 0xC9), "not SOF9"
    return _make("arithmetic", data, src, 3.0)


@kind("arithmetic-progressive")
def _karithp():
    src = _coffee_small()
    data = libjpeg(src, "rgb", "ycc", 90, "2x1,1x1,1x1", progressive=1, arithmetic=True,
                   restart_rows=2)
    assert find_segment(data, SOF_MARKERS) == find_segment(data, 0xCA), "not SOF10"
    return _make("arithmetic-progressive", data, src, 3.0)


@kind("many-scans-190")
def _kscans():
    src = _coffee_small()
    data = libjpeg(src, "rgb", "ycc", 90, "2x2,1x1,1x1", progressive=2)
    assert count_scans(data) == 190
    return _make("many-scans-190", data, src, 3.0)


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


# ---------------------------------------------------------------------------
# fixtures


class Images:
    """Everything above, as one session fixture."""
    photo = staticmethod(photo)
    fit = staticmethod(fit)
    pil_jpeg = staticmethod(pil_jpeg)
    pil_encode = staticmethod(pil_encode)
    libjpeg = staticmethod(libjpeg)
    pil_decode = staticmethod(pil_decode)
    pil_draft = staticmethod(pil_draft)
    pil_crop = staticmethod(pil_crop)
    pil_resize = staticmethod(pil_resize)
    diff = staticmethod(diff)
    segments = staticmethod(segments)
    find_segment = staticmethod(find_segment)
    patch = staticmethod(patch)
    set_sof_size = staticmethod(set_sof_size)
    count_scans = staticmethod(count_scans)
    rgb_to_ink = staticmethod(rgb_to_ink)
    ink_to_rgb = staticmethod(ink_to_rgb)
    sample = staticmethod(jpeg_sample)
    other = staticmethod(other_format_bytes)
    SOF_MARKERS = SOF_MARKERS
    KIND_NAMES = KIND_NAMES
    OTHER_FORMAT_NAMES = OTHER_FORMAT_NAMES


@pytest.fixture(scope="session")
def images() -> Images:
    """Photographs, encoders, Pillow references and JPEG byte surgery."""
    return Images()


@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory):
    """An ImageFolder tree of 48 JPEGs cut from real photographs, 3 classes (the ring,
    loader, worker and fault tests' corpus; ``ring_helpers.make_corpus``)."""
    import ring_helpers as rh

    return rh.make_corpus(tmp_path_factory.getbasetemp() / "ring_corpus_48", 48, seed=1,
                          classes=3)


@pytest.fixture
def jpeg_kind(request) -> Sample:
    """One JPEG input kind (parametrised over all of them)."""
    return jpeg_sample(request.param)


@pytest.fixture
def other_format(request) -> tuple[str, bytes]:
    """(name, bytes) of one non-JPEG format (parametrised over all of them)."""
    return request.param, other_format_bytes(request.param)


def pytest_generate_tests(metafunc):
    if "jpeg_kind" in metafunc.fixturenames:
        metafunc.parametrize("jpeg_kind", KIND_NAMES, indirect=True)
    if "other_format" in metafunc.fixturenames:
        metafunc.parametrize("other_format", OTHER_FORMAT_NAMES, indirect=True)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``--dist loadgroup``, pyproject.toml), each test file runs on
    one worker, so a module-scoped fixture (a corpus, the soak run, the hostile corpus's
    checker, a server) is built once rather than once per worker.  Tests marked with
    their own ``xdist_group`` (those sharing the host's /dev/shm) keep it."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))

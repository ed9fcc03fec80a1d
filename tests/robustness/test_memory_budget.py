"""DecodeLimits.max_memory: the decoder's working memory, bounded from the header.

Before it, memory per decode was bounded only by max_pixels: a 1 MB progressive
4:4:4 JPEG declaring tens of megapixels cost +500 MiB (libjpeg keeps the whole
image's DCT coefficients for a progressive decode), a small PNG declaring a
large image +1.2 GiB and seconds of Pillow.  Now every entry point computes the
requirement from the header (JPEG: coefficient buffers of a multi-scan file +
width x height x 3; Pillow: the decoded image, its RGB conversion and the
array) and refuses beyond the budget before allocating anything.
"""
from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest

import echo_native as en
from echo_native import _kernel

pytestmark = pytest.mark.timeout(120)

MiB = 2**20

ALL_CALLS = {
    "decode": lambda data, **kw: en.decode(data, **kw),
    "decode_crop": lambda data, **kw: en.decode_crop(data, (0, 0, 1, 1), (1, 1), **kw),
    "decode_random_crop": lambda data, **kw: en.decode_random_crop(data, (8, 8), 0, 0, 0, **kw),
    "decode_center_crop": lambda data, **kw: en.decode_center_crop(data, 8, **kw),
    "decode_canvas": lambda data, **kw: en.decode_canvas(data, 8, **kw),
    "image_size": lambda data, **kw: en.image_size(
        data, **{k: v for k, v in kw.items() if k in ("max_memory", "max_pixels")}),
}


def sof_components(data: bytes):
    """(width, height, [(h_samp, v_samp), ...]) from a JPEG's frame header."""
    pos = 2
    while True:
        marker = data[pos + 1]
        length = int.from_bytes(data[pos + 2:pos + 4], "big")
        if marker in (0xC0, 0xC1, 0xC2, 0xC9, 0xCA):
            h, w, n = struct.unpack(">HHB", data[pos + 5:pos + 10])
            comps = [(data[pos + 11 + 3 * i] >> 4, data[pos + 11 + 3 * i] & 15)
                     for i in range(n)]
            return w, h, comps
        pos += 2 + length


def expected_need(data: bytes, multi_scan: bool) -> int:
    """libjpeg's whole-image coefficient arrays (jdcoefct.c), plus width x height x 3."""
    w, h, comps = sof_components(data)
    hmax = max(c[0] for c in comps)
    vmax = max(c[1] for c in comps)
    coefs = 0
    if multi_scan:
        for hs, vs in comps:
            wb = math.ceil(w * hs / (hmax * 8))
            hb = math.ceil(h * vs / (vmax * 8))
            coefs += math.ceil(wb / hs) * hs * math.ceil(hb / vs) * vs * 64 * 2
    return coefs + w * h * 3


@pytest.fixture(scope="module")
def prog444(images):
    """A progressive 4:4:4 JPEG of a photograph (the worst case per pixel)."""
    return images.pil_jpeg(images.photo("chelsea"), 90, progressive=True, subsampling="4:4:4")


def test_default_and_validation():
    """512 MiB by default; max_memory is validated like the other limits."""
    assert en.DecodeLimits().max_memory == 512 * MiB == _kernel.DEFAULT_MAX_MEMORY
    assert _kernel.Decoder().limits["max_memory"] == 512 * MiB
    for bad in (0, -1, 1.5, "1", True, None):
        with pytest.raises(ValueError, match="DecodeLimits: max_memory must be a positive"):
            en.DecodeLimits(max_memory=bad)
    with pytest.raises(ValueError, match="max_memory must be below 2\\*\\*63"):
        en.DecodeLimits(max_memory=2**63)
    with pytest.raises(ValueError, match="max_memory"):
        en.decode(b"\xff\xd8", max_memory=0)
    assert en.DecodeLimits(max_memory=np.int64(10**9)).max_memory == 10**9


@pytest.mark.parametrize("name,multi", [("progressive-4:4:4", True), ("progressive-4:2:0", True),
                                        ("baseline-4:2:0", False), ("sampling-4:1:1", False),
                                        ("sampling-4:4:0-progressive", True),
                                        ("gray-progressive", True), ("cmyk-adobe-progressive", True)])
def test_requirement_is_computed_from_the_header(images, name, multi):
    """The kernel's requirement is the coefficient arrays libjpeg allocates (multi-scan
    files only) plus the full-size RGB image, whatever the sampling."""
    data = images.sample(name).data
    k = _kernel.Decoder()
    k.info(data)
    assert k.last_memory == expected_need(data, multi)


def test_progressive_444_over_budget_is_refused(images, prog444):
    """A budget one byte short refuses the file from every entry point, naming the bytes
    and max_memory; at the exact budget and under the default it decodes to Pillow's
    pixels."""
    need = expected_need(prog444, True)
    w, h, _ = sof_components(prog444)
    coefs = need - w * h * 3
    assert coefs == 3 * math.ceil(w / 8) * math.ceil(h / 8) * 128
    for name, call in ALL_CALLS.items():
        for strict in (True, False):
            kw = {"max_memory": need - 1} if name == "image_size" else \
                {"max_memory": need - 1, "strict": strict}
            with pytest.raises(en.DecodeError) as info:
                call(prog444, **kw)
            msg = str(info.value)
            assert f"needs {need} bytes" in msg, (name, msg)
            assert f"{coefs} of coefficient buffers" in msg
            assert f"max_memory={need - 1}" in msg and "progressive" in msg
    ref = images.pil_decode(prog444)
    np.testing.assert_array_equal(en.decode(prog444, max_memory=need), ref)
    np.testing.assert_array_equal(en.decode(prog444), ref)
    dec = en.Decoder(en.DecodeLimits(max_memory=need - 1))
    with pytest.raises(en.DecodeError, match="max_memory"):
        dec.decode(prog444)
    dec.set_limits(en.DecodeLimits(max_memory=need))
    np.testing.assert_array_equal(dec.decode(prog444), ref)


@pytest.mark.timeout(60)
def test_small_progressive_file_declaring_a_large_image(images, prog444):
    """A ~60 KB progressive 4:4:4 file whose header declares 9000 x 8000 (72 MP, under
    max_pixels): 648 MB of working memory, refused by default from the header, fast."""
    bomb = images.set_sof_size(prog444, 8000, 9000)
    assert len(bomb) < 100_000
    need = expected_need(bomb, True)
    assert need == 3 * math.ceil(9000 / 8) * 1000 * 128 + 72_000_000 * 3 > 512 * MiB
    for call in ALL_CALLS.values():
        with pytest.raises(en.DecodeError, match=f"needs {need} bytes.*max_memory=536870912"):
            call(bomb)
    # The same dimensions in a baseline file need only the RGB image: within budget.
    base = images.set_sof_size(images.sample("baseline-4:4:4").data, 8000, 9000)
    k = _kernel.Decoder()
    assert k.info(base)[:2] == (8000, 9000) and k.last_memory == 72_000_000 * 3


def test_refusal_allocates_nothing(images, prog444, tmp_path):
    """Peak memory of a child process does not grow when it refuses the bomb (before the
    budget, libjpeg allocated the coefficient arrays first: +450 MB here)."""
    bomb = images.set_sof_size(prog444, 7000, 9000)
    path = tmp_path / "bomb.jpg"
    path.write_bytes(bomb)
    script = textwrap.dedent("""
        import sys, echo_native as en
        def status(key):
            for line in open("/proc/self/status"):
                if line.startswith(key):
                    return int(line.split()[1]) // 1024
        data = open(sys.argv[1], "rb").read()
        try:
            en.decode(data)
        except en.DecodeError:
            pass
        open("/proc/self/clear_refs", "w").write("5")   # reset the peak (VmHWM)
        before = status("VmRSS")
        for call in (lambda: en.decode(data), lambda: en.decode(data, strict=False),
                     lambda: en.decode_crop(data, (0, 0, 9, 9), (3, 3))):
            try:
                call()
            except en.DecodeError as e:
                assert "max_memory" in str(e), e
        print(status("VmHWM") - before)
    """)
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS")
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.strip()) < 32, f"peak grew {out.stdout.strip()} MiB"


# ---------------------------------------------------------------------------
# the Pillow path


def _png_declaring(images, width, height, color_type=2):
    """A real photograph's PNG whose IHDR declares width x height (CRC fixed)."""
    png = bytearray(images.other("png-rgb"))
    assert png[12:16] == b"IHDR"
    png[16:24] = struct.pack(">II", width, height)
    png[25] = color_type
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])))
    return bytes(png)


@pytest.mark.timeout(60)
def test_large_png_refused_quickly(images):
    """A small PNG declaring 9000 x 9000 RGBA (81 MP, under max_pixels): Pillow's decode
    would need 1.1 GB (and seconds); refused from the header by every entry point."""
    png = _png_declaring(images, 9000, 9000, color_type=6)
    need = 9000 * 9000 * (4 + 4 + 3 + 3)
    for name, call in ALL_CALLS.items():
        if name == "image_size":   # Pillow's header read: size only, nothing decoded
            assert call(png) == (9000, 9000)
            continue
        with pytest.raises(en.DecodeError,
                           match=f"PNG 9000x9000 \\(RGBA\\) needs {need} bytes.*max_memory="):
            call(png)


@pytest.mark.parametrize("fmt,mode_bytes", [("png-rgb", 4), ("png-gray", 1), ("png-gray16", 2),
                                            ("gif", 1), ("webp-lossy", 4)])
def test_pillow_budget_is_exact(images, fmt, mode_bytes):
    """Pillow-path requirement: (mode bytes + 4 + 3 + 3) per pixel; refused one byte
    short, decoded (Pillow's pixels) at the budget."""
    data = images.other(fmt)
    h, w = en.image_size(data)
    need = h * w * (mode_bytes + 10)
    with pytest.raises(en.DecodeError, match=f"needs {need} bytes.*max_memory={need - 1}"):
        en.decode(data, max_memory=need - 1)
    with pytest.raises(en.DecodeError, match="max_memory"):
        en.decode_crop(data, (0, 0, 4, 4), (2, 2), max_memory=need - 1)
    np.testing.assert_array_equal(en.decode(data, max_memory=need), images.pil_decode(data))


def test_every_test_image_fits_the_default(images):
    """Normal images fit comfortably: every input kind and format decodes under the
    default, and a 24-megapixel progressive 4:4:4 header needs under half of it."""
    for name in images.KIND_NAMES:
        k = _kernel.Decoder()
        k.info(images.sample(name).data)
        assert k.last_memory < 8 * MiB
    for name in images.OTHER_FORMAT_NAMES:
        en.decode(images.other(name))
    big = images.set_sof_size(images.sample("progressive-4:4:4").data, 4000, 6000)
    k = _kernel.Decoder()
    k.info(big)
    assert k.last_memory == 3 * 750 * 500 * 128 + 24_000_000 * 3 < 256 * MiB

"""The committed JPEG fixtures (``tests/data/jpeg/``): what each file is and how to read it.

These are the JPEG variants that Pillow cannot write (arithmetic coding, custom scan
scripts, more than a few hundred scans, lossless, 12-bit, plain CMYK and YCCK, restart
intervals counted in MCUs).  They are committed so that the tests read them on any
machine, with no encoder, compiler or command-line tool installed.
``tests/data/make_jpeg_fixtures.py`` regenerates them (and ``jpeg/README.md``) from
:data:`FIXTURES` where those tools exist.

:func:`structure` walks a file's markers in pure Python (no decoder), so a test can
check that a fixture is the variant it is named after before asserting what the
decoder does with it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jpeg")

# Photograph crops (scikit-image's bundled photos; rows, then columns) the fixtures are
# encoded from.  Tests compare decodes against these where the coding is lossless.
CROPS = {
    "chelsea": ("chelsea", (60, 156), (160, 288)),         # 96 x 128
    "rocket": ("rocket", (150, 246), (260, 388)),          # 96 x 128
    "chelsea-small": ("chelsea", (0, 48), (0, 64)),        # 48 x 64
    "chelsea-odd": ("chelsea", (50, 147), (100, 229)),     # 97 x 129: partial MCUs
    "astronaut": ("astronaut", (100, 148), (180, 244)),    # 48 x 64
    "camera": ("camera", (200, 248), (200, 264)),          # 48 x 64, grayscale
    "coffee": ("coffee", (60, 124), (100, 196)),           # 64 x 96
}

UNSUPPORTED_LOSSLESS = "SOF type 0xc3 (lossless JPEG is not supported)"
UNSUPPORTED_12BIT = "Unsupported JPEG data precision 12 (only 8-bit JPEG is supported"


@dataclass(frozen=True)
class Fixture:
    """One committed file: how it was made, what it covers, what a decoder must do."""
    name: str
    made_by: str        # the command or call that writes it (the generator runs exactly this)
    exercises: str
    expected: str
    # Structure the file must have (checked by the tests with structure()):
    sof: int            # frame marker: 0xC0 baseline ... 0xCA arithmetic progressive
    precision: int      # sample bits
    scans: int
    restart: int = 0    # restart interval in MCUs (DRI); 0 for none


FIXTURES: dict[str, Fixture] = {f.name: f for f in (
    Fixture("chelsea-baseline.jpg",
            "cjpeg -quality 90 chelsea.ppm",
            "the Huffman source the jpegtran transcodes below are made from",
            "decodes to Pillow's pixels", 0xC0, 8, 1),
    Fixture("arith-sequential.jpg",
            "jpegtran -arithmetic chelsea-baseline.jpg",
            "arithmetic coding, sequential (SOF9)",
            "decodes to exactly the pixels of chelsea-baseline.jpg (same coefficients) and "
            "to Pillow's", 0xC9, 8, 1),
    Fixture("arith-progressive.jpg",
            "jpegtran -arithmetic -progressive chelsea-baseline.jpg",
            "arithmetic coding, progressive (SOF10), libjpeg's standard 10-scan script",
            "as arith-sequential.jpg", 0xCA, 8, 10),
    Fixture("arith-restart.jpg",
            "jpegtran -arithmetic -restart 1 chelsea-baseline.jpg",
            "arithmetic coding with a restart marker every MCU row (8 MCUs)",
            "as arith-sequential.jpg", 0xC9, 8, 1, 8),
    Fixture("arith-progressive-restart.jpg",
            "jpegtran -arithmetic -progressive -restart 16B chelsea-baseline.jpg",
            "arithmetic progressive with a restart marker every 16 MCUs (two MCU rows in "
            "the interleaved DC scans, one block row in the luma AC scans)",
            "as arith-sequential.jpg", 0xCA, 8, 10, 16),
    Fixture("progressive-script.jpg",
            "cjpeg -quality 90 -scans progressive-script.txt chelsea.ppm",
            "a custom scan script: one DC scan per component, spectral bands of different "
            "point transforms, successive-approximation refinement of those bands",
            "decodes to Pillow's pixels; max_scans=12 accepts it, 11 refuses it", 0xC2, 8, 12),
    Fixture("progressive-97-scans.jpg",
            "cjpeg -quality 90 -scans progressive-97.txt chelsea-small.ppm",
            "the most scans cjpeg writes: DC, then each component's AC in bands of two",
            "decodes to Pillow's pixels; max_scans=97 accepts it, 96 refuses it", 0xC2, 8, 97),
    Fixture("progressive-190-scans.jpg",
            "tests/c/jpegtool (libjpeg), coffee.ppm, 4:2:0, progressive=2",
            "190 valid scans, one per AC coefficient and component",
            "decodes to Pillow's pixels (under the default limit of 256 scans)", 0xC2, 8, 190),
    Fixture("progressive-1135-scans.jpg",
            "tests/c/jpegtool (libjpeg), coffee.ppm, 4:4:4, progressive=7",
            "1135 valid scans (every AC coefficient refined bit by bit): over any scan limit",
            "refused: 'more than 256 scans (max_scans)'; max_scans=1135 decodes it to Pillow's "
            "pixels, 1134 refuses it", 0xC2, 8, 1135),
    Fixture("restart-none.jpg",
            "cjpeg -quality 90 rocket.ppm",
            "the reference the restart files are compared with (no DRI)",
            "decodes to Pillow's pixels", 0xC0, 8, 1),
    Fixture("restart-rows-1.jpg",
            "cjpeg -quality 90 -restart 1 rocket.ppm",
            "a restart marker every MCU row (8 MCUs)",
            "decodes to exactly restart-none.jpg's pixels; junk before an RST is refused in "
            "strict mode", 0xC0, 8, 1, 8),
    Fixture("restart-rows-3.jpg",
            "cjpeg -quality 90 -restart 3 rocket.ppm",
            "a restart marker every 3 MCU rows (24 MCUs: two intervals)",
            "as restart-rows-1.jpg", 0xC0, 8, 1, 24),
    Fixture("restart-mcus-1.jpg",
            "cjpeg -quality 90 -restart 1B rocket.ppm",
            "a restart marker after every MCU (the densest)",
            "as restart-rows-1.jpg", 0xC0, 8, 1, 1),
    Fixture("restart-mcus-5.jpg",
            "cjpeg -quality 90 -restart 5B rocket.ppm",
            "restart intervals of 5 MCUs, which straddle MCU rows of 8; the last one is 3 MCUs",
            "as restart-rows-1.jpg", 0xC0, 8, 1, 5),
    Fixture("restart-progressive.jpg",
            "jpegtran -progressive -restart 2B restart-none.jpg",
            "restart markers in every scan of a progressive file",
            "as restart-rows-1.jpg", 0xC2, 8, 10, 2),
    Fixture("sampling-440.jpg",
            "cjpeg -quality 90 -sample 1x2,1x1,1x1 chelsea-odd.ppm",
            "4:4:0 chroma (halved vertically only), partial MCUs on both edges",
            "decodes to Pillow's pixels", 0xC0, 8, 1),
    Fixture("sampling-411.jpg",
            "cjpeg -quality 90 -sample 4x1,1x1,1x1 chelsea-odd.ppm",
            "4:1:1 chroma (a quarter horizontally), 32-pixel-wide MCUs, partial on both edges",
            "decodes to Pillow's pixels", 0xC0, 8, 1),
    Fixture("sampling-440-progressive.jpg",
            "cjpeg -quality 90 -sample 1x2,1x1,1x1 -progressive chelsea-odd.ppm",
            "4:4:0 chroma in a progressive file",
            "decodes to Pillow's pixels", 0xC2, 8, 10),
    Fixture("lossless-rgb.jpg",
            "imagecodecs.jpeg8_encode(astronaut, lossless=True, predictor=1)",
            "lossless JPEG (SOF3), 8-bit RGB",
            f"refused: DecodeError '{UNSUPPORTED_LOSSLESS}'", 0xC3, 8, 1),
    Fixture("lossless-gray-16bit.jpg",
            "imagecodecs.jpeg8_encode(camera * 257, lossless=True, predictor=1, "
            "bitspersample=16)",
            "lossless JPEG (SOF3), 16-bit grayscale",
            f"refused: DecodeError '{UNSUPPORTED_LOSSLESS}'", 0xC3, 16, 1),
    Fixture("twelve-bit-rgb.jpg",
            "imagecodecs.jpeg8_encode(astronaut spread to 12 bits, level=90, bitspersample=12)",
            "12-bit extended sequential JPEG (SOF1, precision 12)",
            f"refused: DecodeError '{UNSUPPORTED_12BIT} ...)'", 0xC1, 12, 1),
    Fixture("cmyk-plain.jpg",
            "tests/c/jpegtool (libjpeg), CMYK in, CMYK out, no Adobe marker",
            "plain (not inverted) CMYK, as libjpeg defines it without an Adobe marker",
            "decodes to Pillow's pixels", 0xC0, 8, 1),
    Fixture("cmyk-plain-progressive.jpg",
            "tests/c/jpegtool (libjpeg), CMYK in, CMYK out, progressive, no Adobe marker",
            "progressive four-component JPEG without an Adobe marker",
            "decodes to Pillow's pixels", 0xC2, 8, 18),
    Fixture("ycck-adobe.jpg",
            "tests/c/jpegtool (libjpeg), inverted CMYK in, YCCK out (Adobe transform 2)",
            "YCCK with the Adobe marker",
            "decodes to Pillow's pixels", 0xC0, 8, 1),
)}


def path(name: str) -> str:
    """The fixture's path; FileNotFoundError naming it and the generator when it is missing."""
    if name not in FIXTURES:
        raise KeyError(f"{name!r} is not a fixture in {DIR} (known: {', '.join(FIXTURES)})")
    p = os.path.join(DIR, name)
    if not os.path.exists(p):
        raise FileNotFoundError(f"{p} is missing: it is committed with the tests; "
                                "tests/data/make_jpeg_fixtures.py regenerates it")
    return p


def read(name: str) -> bytes:
    """The fixture's bytes."""
    with open(path(name), "rb") as f:
        return f.read()


def crop(name: str):
    """The photograph crop :data:`CROPS` names (uint8, RGB or 2-D gray)."""
    from photos import photo   # tests/photos.py (scikit-image's photographs)

    photo_name, (r0, r1), (c0, c1) = CROPS[name]
    return photo(photo_name)[r0:r1, c0:c1]


@dataclass(frozen=True)
class Structure:
    """What a JPEG's markers say (read without decoding)."""
    sof: int
    precision: int
    height: int
    width: int
    components: int
    scans: int
    restart: tuple[int, ...]    # every DRI interval, in file order
    rst_markers: int            # RSTn markers inside the entropy-coded data
    adobe: bool                 # has an Adobe APP14 segment


def structure(data: bytes) -> Structure:
    """Walk every marker of a JPEG (headers, each scan's entropy data, EOI)."""
    if data[:2] != b"\xff\xd8":
        raise ValueError("not a JPEG: no SOI marker")
    sof = precision = height = width = ncomp = None
    scans = rst = 0
    restart: list[int] = []
    adobe = False
    pos, n = 2, len(data)
    while pos < n:
        if data[pos] != 0xFF:
            raise ValueError(f"no marker at byte {pos}")
        while pos < n and data[pos] == 0xFF:    # fill bytes
            pos += 1
        if pos >= n:
            raise ValueError("ends in fill bytes")
        marker = data[pos]
        pos += 1
        if marker == 0xD9:
            break
        length = int.from_bytes(data[pos:pos + 2], "big")
        body = data[pos + 2:pos + length]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            sof, precision = marker, body[0]
            height, width = int.from_bytes(body[1:3], "big"), int.from_bytes(body[3:5], "big")
            ncomp = body[5]
        elif marker == 0xDD:
            restart.append(int.from_bytes(body[:2], "big"))
        elif marker == 0xEE and body.startswith(b"Adobe"):
            adobe = True
        pos += length
        if marker == 0xDA:
            scans += 1
            # Entropy-coded data runs to the next marker that is neither a stuffed 0xFF00
            # nor a restart marker.
            while True:
                pos = data.find(b"\xff", pos)
                if pos < 0 or pos + 1 >= n:
                    raise ValueError("scan data runs to the end of the file (no EOI)")
                nxt = data[pos + 1]
                if nxt == 0x00 or nxt == 0xFF:
                    pos += 1
                elif 0xD0 <= nxt <= 0xD7:
                    rst += 1
                    pos += 2
                else:
                    break
    if sof is None:
        raise ValueError("no frame header (SOFn)")
    return Structure(sof, precision, height, width, ncomp, scans, tuple(restart), rst, adobe)

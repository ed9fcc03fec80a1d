#!/usr/bin/env python3
"""Regenerate the committed JPEG fixtures in tests/data/jpeg/ and their README.md.

    python tests/data/make_jpeg_fixtures.py            write every fixture and README.md
    python tests/data/make_jpeg_fixtures.py --check    regenerate into a temporary folder
                                                       and compare byte for byte
    python tests/data/make_jpeg_fixtures.py NAME ...   only these fixtures (README too)

The tests need none of the tools below: they read the committed files.  This script
is for changing or re-checking the fixtures.  Each file comes from a crop of one of
scikit-image's photographs (tests/photos.py) and is written by:

  cjpeg, jpegtran     libjpeg-turbo's tools: ``apt-get install libjpeg-turbo-progs``
  imagecodecs         ``pip install imagecodecs`` (libjpeg-turbo 3 inside): the lossless
                      and 12-bit files, which libjpeg-turbo 2.1's tools cannot write
  tests/c/jpegtool.c  the tests' libjpeg writer, compiled here with ``cc ... -ljpeg``
                      (``apt-get install build-essential libjpeg62-turbo-dev``): more
                      scans than cjpeg's script limit of 100, CMYK and YCCK input

Byte-for-byte output needs the versions in COMMITTED_WITH (other versions may choose
other Huffman tables or markers); the script says which differ.  A fixture whose tool
is missing is left as committed and listed (exit status 2); a changed file under
--check is exit status 1.  Every file is checked against what jpeg_fixtures.FIXTURES
says it is (frame type, precision, scans, restart interval) before it is written.
"""
from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import numpy as np
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
for _p in (HERE, TESTS):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import jpeg_fixtures as fx  # noqa: E402

JPEGTOOL_C = os.path.join(TESTS, "c", "jpegtool.c")

# The tool versions the committed files were written with.
COMMITTED_WITH = {
    "libjpeg-turbo-progs": "2.1.5",     # cjpeg / jpegtran -version
    "imagecodecs": "2026.3.6",          # libjpeg-turbo 3.1.3 inside
    "libjpeg (jpegtool)": "2.1.5",      # the library tests/c/jpegtool.c links
}

# A custom progressive script: one DC scan per component (non-interleaved), the luma AC
# in three bands with different point transforms, then successive-approximation
# refinements (the first only of the band coded at Al=3), chroma refined separately.
SCRIPT_CUSTOM = """\
0: 0 0 0 0;
1: 0 0 0 0;
2: 0 0 0 0;
0: 1 2 0 3;
0: 3 9 0 2;
0: 10 63 0 2;
0: 1 2 3 2;
0: 1 63 2 1;
0: 1 63 1 0;
1: 1 63 0 1;
1: 1 63 1 0;
2: 1 63 0 0;
"""

# As many scans as cjpeg's script reader takes (100): interleaved DC, then every
# component's AC coefficients in bands of two (1 + 3 * 32 = 97 scans).
SCRIPT_97 = "0 1 2: 0 0 0 0;\n" + "".join(
    f"{c}: {k} {min(k + 1, 63)} 0 0;\n" for c in range(3) for k in range(1, 64, 2))


class MissingTool(Exception):
    pass


class Tools:
    """The encoders, found on first use; MissingTool names what to install."""

    def __init__(self, work: str):
        self.work = work
        self._jpegtool = None

    # -- libjpeg-turbo's command-line tools
    def _exe(self, name):
        exe = shutil.which(name)
        if exe is None:
            raise MissingTool(f"{name} (apt-get install libjpeg-turbo-progs)")
        return exe

    def cjpeg(self, args: list[str], crop: str) -> bytes:
        ppm = self.ppm(crop)
        return self._run([self._exe("cjpeg"), *args, ppm])

    def jpegtran(self, args: list[str], source: bytes) -> bytes:
        src = os.path.join(self.work, "jpegtran-in.jpg")
        with open(src, "wb") as f:
            f.write(source)
        return self._run([self._exe("jpegtran"), *args, src])

    def script(self, name: str, text: str) -> str:
        p = os.path.join(self.work, name)
        with open(p, "w") as f:
            f.write(text)
        return p

    def ppm(self, crop: str) -> str:
        p = os.path.join(self.work, crop + ".ppm")
        Image.fromarray(np.ascontiguousarray(fx.crop(crop))).save(p, "PPM")
        return p

    @staticmethod
    def _run(cmd) -> bytes:
        proc = subprocess.run(cmd, capture_output=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr.decode(errors='replace')}")
        return proc.stdout

    # -- imagecodecs (libjpeg-turbo 3: lossless and 12-bit encoders)
    @staticmethod
    def imagecodecs():
        try:
            import imagecodecs
        except ImportError:
            raise MissingTool("imagecodecs (pip install imagecodecs)") from None
        return imagecodecs

    # -- tests/c/jpegtool.c over the system libjpeg
    def jpegtool(self, arr, in_space, jpeg_space, quality, sampling="-", progressive=0,
                 adobe=-1) -> bytes:
        if self._jpegtool is None:
            if not os.path.exists(JPEGTOOL_C):
                raise MissingTool(f"{JPEGTOOL_C} (the tests' libjpeg writer)")
            cc = sysconfig.get_config_var("CC") or "cc"
            exe = os.path.join(self.work, "jpegtool")
            proc = subprocess.run([*cc.split(), "-O1", "-o", exe, JPEGTOOL_C, "-ljpeg"],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise MissingTool("a C compiler and the libjpeg headers (apt-get install "
                                  f"build-essential libjpeg62-turbo-dev):\n{proc.stderr}")
            self._jpegtool = exe
        arr = np.ascontiguousarray(arr, dtype=np.uint8)
        raw, out = os.path.join(self.work, "in.raw"), os.path.join(self.work, "out.jpg")
        with open(raw, "wb") as f:
            f.write(arr.tobytes())
        nc = 1 if arr.ndim == 2 else arr.shape[2]
        self._run([self._jpegtool, raw, out, str(arr.shape[1]), str(arr.shape[0]), str(nc),
                   in_space, jpeg_space, str(quality), sampling, str(progressive), "0", "0",
                   str(adobe)])
        with open(out, "rb") as f:
            return f.read()


def inks(rgb: np.ndarray) -> np.ndarray:
    """Printer inks for a photograph: K the darkness, C/M/Y each channel's shortfall."""
    rgb = rgb.astype(np.int16)
    top = rgb.max(axis=-1, keepdims=True)
    return np.concatenate([top - rgb, 255 - top], axis=-1).astype(np.uint8)


def twelve_bit(arr: np.ndarray) -> np.ndarray:
    """8-bit samples spread over 12 bits (0 -> 0, 255 -> 4095)."""
    a = arr.astype(np.uint16)
    return (a << 4) | (a >> 4)


# name -> recipe(tools, made) -> bytes; ``made`` holds the fixtures written before it.
RECIPES = {
    "chelsea-baseline.jpg": lambda t, m: t.cjpeg(["-quality", "90"], "chelsea"),
    "arith-sequential.jpg": lambda t, m: t.jpegtran(["-arithmetic"], m["chelsea-baseline.jpg"]),
    "arith-progressive.jpg": lambda t, m: t.jpegtran(["-arithmetic", "-progressive"],
                                                     m["chelsea-baseline.jpg"]),
    "arith-restart.jpg": lambda t, m: t.jpegtran(["-arithmetic", "-restart", "1"],
                                                 m["chelsea-baseline.jpg"]),
    "arith-progressive-restart.jpg": lambda t, m: t.jpegtran(
        ["-arithmetic", "-progressive", "-restart", "16B"], m["chelsea-baseline.jpg"]),
    "progressive-script.jpg": lambda t, m: t.cjpeg(
        ["-quality", "90", "-scans", t.script("progressive-script.txt", SCRIPT_CUSTOM)],
        "chelsea"),
    "progressive-97-scans.jpg": lambda t, m: t.cjpeg(
        ["-quality", "90", "-scans", t.script("progressive-97.txt", SCRIPT_97)],
        "chelsea-small"),
    "progressive-190-scans.jpg": lambda t, m: t.jpegtool(
        fx.crop("coffee"), "rgb", "ycc", 90, "2x2,1x1,1x1", progressive=2),
    "progressive-1135-scans.jpg": lambda t, m: t.jpegtool(
        fx.crop("coffee"), "rgb", "ycc", 90, progressive=7),
    "restart-none.jpg": lambda t, m: t.cjpeg(["-quality", "90"], "rocket"),
    "restart-rows-1.jpg": lambda t, m: t.cjpeg(["-quality", "90", "-restart", "1"], "rocket"),
    "restart-rows-3.jpg": lambda t, m: t.cjpeg(["-quality", "90", "-restart", "3"], "rocket"),
    "restart-mcus-1.jpg": lambda t, m: t.cjpeg(["-quality", "90", "-restart", "1B"], "rocket"),
    "restart-mcus-5.jpg": lambda t, m: t.cjpeg(["-quality", "90", "-restart", "5B"], "rocket"),
    "restart-progressive.jpg": lambda t, m: t.jpegtran(["-progressive", "-restart", "2B"],
                                                       m["restart-none.jpg"]),
    "sampling-440.jpg": lambda t, m: t.cjpeg(["-quality", "90", "-sample", "1x2,1x1,1x1"],
                                             "chelsea-odd"),
    "sampling-411.jpg": lambda t, m: t.cjpeg(["-quality", "90", "-sample", "4x1,1x1,1x1"],
                                             "chelsea-odd"),
    "sampling-440-progressive.jpg": lambda t, m: t.cjpeg(
        ["-quality", "90", "-sample", "1x2,1x1,1x1", "-progressive"], "chelsea-odd"),
    "lossless-rgb.jpg": lambda t, m: t.imagecodecs().jpeg8_encode(
        np.ascontiguousarray(fx.crop("astronaut")), lossless=True, predictor=1),
    "lossless-gray-16bit.jpg": lambda t, m: t.imagecodecs().jpeg8_encode(
        fx.crop("camera").astype(np.uint16) * 257, lossless=True, predictor=1,
        bitspersample=16),
    "twelve-bit-rgb.jpg": lambda t, m: t.imagecodecs().jpeg8_encode(
        twelve_bit(fx.crop("astronaut")), level=90, bitspersample=12),
    "cmyk-plain.jpg": lambda t, m: t.jpegtool(
        inks(fx.crop("astronaut")), "cmyk", "cmyk", 90, adobe=0),
    "cmyk-plain-progressive.jpg": lambda t, m: t.jpegtool(
        inks(fx.crop("astronaut")), "cmyk", "cmyk", 90, progressive=1, adobe=0),
    "ycck-adobe.jpg": lambda t, m: t.jpegtool(
        255 - inks(fx.crop("astronaut")), "cmyk", "ycck", 90),
}
assert list(RECIPES) == list(fx.FIXTURES), "RECIPES and jpeg_fixtures.FIXTURES differ"


def verify(name: str, data: bytes, made: dict[str, bytes]):
    """The file is the variant FIXTURES says, and where a reference exists, decodes to it."""
    spec, st = fx.FIXTURES[name], fx.structure(data)
    got = (st.sof, st.precision, st.scans, st.restart[0] if st.restart else 0)
    want = (spec.sof, spec.precision, spec.scans, spec.restart)
    if got != want:
        raise AssertionError(f"{name}: (SOF, precision, scans, restart) is {got}, "
                             f"jpeg_fixtures.FIXTURES says {want}")
    if name.startswith(("lossless-", "twelve-bit-")):
        ic = Tools.imagecodecs()
        back = ic.jpeg8_decode(data)
        if name == "lossless-rgb.jpg":
            assert np.array_equal(back, fx.crop("astronaut")), name
        elif name == "lossless-gray-16bit.jpg":
            assert np.array_equal(back, fx.crop("camera").astype(np.uint16) * 257), name
        else:
            err = np.abs(back.astype(np.int32) - twelve_bit(fx.crop("astronaut"))).mean()
            assert err < 16 * 3, (name, err)     # within ~3 levels of 8 bits
    elif name.startswith("arith-"):
        # Lossless transcodes: Pillow (libjpeg-turbo) gives the source's pixels.
        assert np.array_equal(_pillow(data), _pillow(made["chelsea-baseline.jpg"])), name
    elif name.startswith("restart-") and name != "restart-none.jpg":
        assert np.array_equal(_pillow(data), _pillow(made["restart-none.jpg"])), name


def _pillow(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


def versions() -> dict[str, str]:
    """The tool versions found here ('missing' where absent)."""
    found = {}
    exe = shutil.which("cjpeg")
    if exe:
        out = subprocess.run([exe, "-version"], capture_output=True, text=True)
        m = re.search(r"version (\S+)", out.stdout + out.stderr)
        found["libjpeg-turbo-progs"] = m.group(1) if m else "unknown"
    else:
        found["libjpeg-turbo-progs"] = "missing"
    try:
        import imagecodecs
        found["imagecodecs"] = imagecodecs.__version__
    except ImportError:
        found["imagecodecs"] = "missing"
    dpkg = shutil.which("dpkg-query")
    lib = "unknown"
    if dpkg:
        out = subprocess.run([dpkg, "-W", "-f", "${Version}", "libjpeg62-turbo-dev"],
                             capture_output=True, text=True)
        m = re.match(r"(?:\d+:)?([\d.]+)", out.stdout)
        lib = m.group(1) if out.returncode == 0 and m else "unknown"
    found["libjpeg (jpegtool)"] = lib
    return found


def readme(sizes: dict[str, int]) -> str:
    rows = []
    for f in fx.FIXTURES.values():
        cells = [f"`{f.name}`", f"{sizes[f.name]:,}", f"`{f.made_by}`", f.exercises, f.expected]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    crops = "\n".join(f"- `{k}`: `skimage.data.{p}()[{r0}:{r1}, {c0}:{c1}]`"
                      for k, (p, (r0, r1), (c0, c1)) in fx.CROPS.items())
    used = "\n".join(f"- {k} {v}" for k, v in COMMITTED_WITH.items())
    return f"""# JPEG test fixtures

Small JPEGs of the variants Pillow cannot write, committed so that the tests cover them
on every machine with nothing installed: no `cjpeg`/`jpegtran`, no compiler, no
`imagecodecs`.  `tests/data/jpeg_fixtures.py` describes each file (the table below is
written from it) and reads their markers; the tests check that each file has the frame
type, precision, scan count and restart interval it is named for before asserting what
the decoder does with it.

Regenerate (byte for byte with the tool versions below) or check:

    python tests/data/make_jpeg_fixtures.py            # rewrite every file and this README
    python tests/data/make_jpeg_fixtures.py --check    # compare a fresh generation with these

Made with:

{used}

`cjpeg`/`jpegtran`: `apt-get install libjpeg-turbo-progs`;
`imagecodecs`: `pip install imagecodecs` (libjpeg-turbo 3 inside; the lossless and
12-bit files, which libjpeg-turbo 2.1's tools cannot write); `tests/c/jpegtool.c` (the
tests' libjpeg writer) for more scans than cjpeg's script limit of 100 and for CMYK /
YCCK input.  The `.ppm` inputs are these photograph crops (Pillow writes the PPM):

{crops}

The `tests/c/jpegtool.c` files encode the same crops as raw samples: the CMYK files
printer inks computed from the astronaut crop (`make_jpeg_fixtures.inks`; YCCK stores them inverted,
as Adobe does).  The 12-bit file spreads the astronaut crop over 12 bits (`a << 4 | a >> 4`).

| file | bytes | made by | exercises | expected outcome |
|---|---:|---|---|---|
""" + "\n".join(rows) + f"""

`progressive-script.txt` (custom scan script):

```
{SCRIPT_CUSTOM.rstrip()}
```

`progressive-97.txt`: `0 1 2: 0 0 0 0;` then `C: k k+1 0 0;` for each component C and
k = 1, 3, ..., 63 (the last band is `63 63`).
"""


def generate(names, outdir, tools) -> tuple[dict[str, bytes], list[str]]:
    made: dict[str, bytes] = {}
    missing: list[str] = []
    for name in fx.FIXTURES:
        try:
            data = RECIPES[name](tools, made)
        except MissingTool as e:
            missing.append(f"{name}: needs {e}")
            # Later recipes may build on this one: use the committed file.
            committed = os.path.join(fx.DIR, name)
            if os.path.exists(committed):
                with open(committed, "rb") as f:
                    made[name] = f.read()
            continue
        verify(name, data, made)
        made[name] = data
        if name in names:
            with open(os.path.join(outdir, name), "wb") as f:
                f.write(data)
    return made, missing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="fixture file names (default: all)")
    ap.add_argument("--check", action="store_true",
                    help="regenerate into a temporary folder and compare with the committed files")
    a = ap.parse_args(argv)
    unknown = [n for n in a.names if n not in fx.FIXTURES]
    if unknown:
        ap.error(f"unknown fixture(s) {', '.join(unknown)}; known: {', '.join(fx.FIXTURES)}")
    names = set(a.names or fx.FIXTURES)
    found = versions()
    for tool, want in COMMITTED_WITH.items():
        if found[tool] not in (want, "missing"):
            print(f"note: {tool} {found[tool]} here, the committed files were made with "
                  f"{want}: bytes may differ", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="jpeg-fixtures-") as work:
        outdir = os.path.join(work, "out") if a.check else fx.DIR
        os.makedirs(outdir, exist_ok=True)
        made, missing = generate(names, outdir, Tools(work))
        sizes = {n: len(made[n]) if n in made else 0 for n in fx.FIXTURES}
        text = readme(sizes)
        status = 0
        if a.check:
            for name in sorted(names):
                if name not in made or name in {m.split(":")[0] for m in missing}:
                    continue
                with open(os.path.join(fx.DIR, name), "rb") as f:
                    same = f.read() == made[name]
                print(f"{'same   ' if same else 'DIFFERS'} {name}")
                status |= 0 if same else 1
            with open(os.path.join(fx.DIR, "README.md")) as f:
                same = f.read() == text
            print(f"{'same   ' if same else 'DIFFERS'} README.md")
            status |= 0 if same else 1
        else:
            with open(os.path.join(fx.DIR, "README.md"), "w") as f:
                f.write(text)
            print(f"wrote {len(names) - len(missing)} fixture(s) and README.md to {fx.DIR}")
    for m in missing:
        print(f"not made (left as committed): {m}", file=sys.stderr)
    return status or (2 if missing else 0)


if __name__ == "__main__":
    sys.exit(main())

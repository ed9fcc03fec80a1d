#!/usr/bin/env python3
"""Coverage-guided fuzzing of the native decode entry points with atheris (libFuzzer).

    python fuzz/fuzz_decode.py [libFuzzer flags] CORPUS_DIR [SEED_DIR ...]
    python fuzz/fuzz_decode.py CRASH_FILE            # reproduce one input

Usually run through ``fuzz/run.sh SECONDS``, which generates the seed corpus
with ``fuzz/hostile_corpus.py`` first.  Each input is the file's bytes, used
unchanged (so seeds are real JPEGs and the mutator works on them directly); the
call parameters are derived from a CRC of the bytes:

  * ``decode`` (strict or lenient),
  * ``decode_crop`` with a box inside/overlapping the declared image and an
    output size from the CRC (1..64 per side, flip on/off),
  * ``decode_canvas`` with ``min_side`` 1..300,
  * ``decode_random_crop`` / ``decode_center_crop``, and ``Decoder.info``.

Any exception other than ``DecodeError``/``ValueError``/``TypeError`` is a
crash (libFuzzer writes ``crash-<sha1>`` and exits non-zero); so are native
faults (SIGSEGV/abort), > ``-rss_limit_mb`` memory and > ``-timeout`` seconds.

Native coverage: libFuzzer sees Python branches (atheris instruments
``echo_native``'s Python modules) and, only if the extension was built with
``clang -fsanitize=fuzzer-no-link`` (``fuzz/run.sh`` with ``FUZZ_INSTRUMENT=1``),
the branches of the kernel's own C code.  libjpeg-turbo itself (the Debian
shared library) is never instrumented, so its parser's branches give no
coverage feedback either way.
"""
from __future__ import annotations

import os
import sys
import sysconfig
import warnings
import zlib

import atheris

# echo_native is imported on the first input, once atheris.Fuzz() has loaded
# libFuzzer (globally): an extension built with -fsanitize-coverage
# (FUZZ_INSTRUMENT=1) needs its __sanitizer_cov_* symbols when it is loaded.
en = _kernel = _dec = ALLOWED = None
MAX_PIXELS = 8_000_000     # keeps each lenient decode of an inflated header well under 1 s


def _export_libfuzzer(load=False):
    """Make the running libFuzzer's __sanitizer_cov_* symbols visible to later dlopens.

    atheris loads its libFuzzer core privately (RTLD_LOCAL); re-open that same
    library with RTLD_GLOBAL (RTLD_NOLOAD: no second copy) so an extension built
    with -fsanitize-coverage can bind its coverage callbacks to it.  ``load``: load
    it if it is not (a script that imports the instrumented build outside a fuzzing
    run, to write seeds with it).
    """
    import ctypes
    core = os.path.join(os.path.dirname(atheris.__file__),
                        "core_with_libfuzzer" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    try:
        ctypes.CDLL(core, mode=os.RTLD_GLOBAL | (0 if load else os.RTLD_NOLOAD))
    except OSError:
        pass   # not loaded (e.g. running a single input without libFuzzer)


def _load():
    global en, _kernel, _dec, ALLOWED
    _export_libfuzzer()
    with atheris.instrument_imports(include=["echo_native"]):
        import echo_native as en
        from echo_native import _kernel
    if os.environ.get("FUZZ_PRINT_MODULE"):
        print(f"fuzzing {_kernel.__file__}", file=sys.stderr)
    ALLOWED = (en.DecodeError, ValueError, TypeError)
    _dec = _kernel.Decoder(max_pixels=MAX_PIXELS, max_scans=256, strict=True)
    # Pillow's DecompressionBombWarning for mutated PNG/GIF headers is noise here.
    warnings.simplefilter("ignore")


def one_input(data: bytes):
    if en is None:
        _load()
    h = zlib.crc32(data)
    strict = bool(h & 1)
    mode = (h >> 1) % 6
    kw = dict(strict=strict, max_pixels=MAX_PIXELS)
    try:
        if mode == 0:
            img = en.decode(data, **kw)
            assert img.ndim == 3 and img.shape[2] == 3, img.shape
        elif mode in (1, 2):
            try:
                ih, iw = en.image_size(data)
            except ALLOWED:
                ih, iw = 64, 64
            r = h >> 4
            top, left = (r % (ih + 8)) - 4, ((r >> 8) % (iw + 8)) - 4
            bh, bw = 1 + (r >> 16) % max(1, ih), 1 + (r >> 24) % max(1, iw)
            if mode == 2:   # fractional boxes
                top, left, bh, bw = top + 0.25, left + 0.5, bh + 0.75, bw + 0.125
            size = (1 + (h >> 9) % 64, 1 + (h >> 15) % 64)
            out = en.decode_crop(data, (top, left, bh, bw), size, flip=bool(h & 8), **kw)
            assert out.shape == (*size, 3), out.shape
        elif mode == 3:
            canvas, d = en.decode_canvas(data, 1 + (h >> 4) % 300, **kw)
            assert d in (1, 2, 4, 8) and canvas.ndim == 3, (d, canvas.shape)
        elif mode == 4:
            out, _, _ = en.decode_random_crop(data, (17, 23), h, 1, 2, **kw)
            assert out.shape == (17, 23, 3)
        else:
            _dec.set_limits(MAX_PIXELS, 256, strict)
            try:
                _dec.info(data)
            except ALLOWED:
                pass
            out = en.decode_center_crop(data, 1 + (h >> 4) % 40, **kw)
            assert out.shape[2] == 3
    except ALLOWED:
        pass


def main():
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()

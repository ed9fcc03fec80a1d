#!/usr/bin/env python3
"""Fuzzing of the seekable-JPEG index parser and sub-image assembler (src/seek/en_seek.c).

    python fuzz/fuzz_seekable.py --seeds DIR        # write the seed corpus (seekable files)
    python fuzz/fuzz_seekable.py [libFuzzer flags] CORPUS_DIR SEED_DIR   # atheris
    python fuzz/fuzz_seekable.py CRASH_FILE         # reproduce one input
    python fuzz/fuzz_seekable.py --mutate N SEED_DIR   # N random mutations, no atheris

Seeds are seekable JPEGs (echo_native.seekable.transcode of the tests' photographs, every
subsampling, greyscale, a progressive original, several restart intervals, an index
split over several APP9 segments), so the mutator works on real indexes.  As in
fuzz_decode.py each input is used unchanged and the call comes from a CRC of its bytes:

  * ``seekable.index_info`` (the parser alone),
  * ``Seeker.assemble`` of an MCU rectangle from the CRC (the assembler alone); a
    sub-image it returns must be a JPEG the kernel's header parser reads, of the
    rectangle's size,
  * ``Seeker.decode_crop`` / ``decode_random_crop`` strict and lenient (parser,
    assembler and the kernel on the sub-image, or the plain-path fallback).

Any exception other than ``DecodeError``/``ValueError``/``TypeError`` is a crash, and so
is a strict crop whose pixels differ from the kernel's plain decode of the same bytes
when both succeed: restart segments decode independently, so a crop through a sound index
must match whatever the rest of the file holds.  ``--mutate`` runs the same checks over
bit flips, byte overwrites, insertions, deletions and truncations of the seeds, for
machines without atheris (the CI's fuzz/run.sh uses atheris).
"""
from __future__ import annotations

import os
import random
import sys
import warnings
import zlib

en = _seek = _kernel = seekable = ALLOWED = None
MAX_PIXELS = 8_000_000


def _load(instrument=True):
    global en, _seek, _kernel, seekable, ALLOWED
    if instrument:
        import atheris

        from fuzz_decode import _export_libfuzzer
        _export_libfuzzer()   # the instrumented build binds its coverage callbacks to it
        with atheris.instrument_imports(include=["echo_native"]):
            import echo_native as en
            from echo_native import _kernel, _seek, seekable
    else:
        import echo_native as en
        from echo_native import _kernel, _seek, seekable
    ALLOWED = (en.DecodeError, ValueError, TypeError)
    warnings.simplefilter("ignore")


def one_input(data: bytes):
    if en is None:
        _load()
    h = zlib.crc32(data)
    strict = bool(h & 1)
    mode = (h >> 1) % 4
    try:
        if mode == 0:
            info = seekable.index_info(data)
            if info is not None:
                assert info["interval"] >= 1 and info["scan_offset"] < len(data), info
            return
        seeker = _seek.Seeker(max_pixels=MAX_PIXELS, strict=strict)
        if mode == 1:
            r = h >> 4
            r0, c0 = r % 8, (r >> 3) % 8
            r1, c1 = r0 + 1 + (r >> 6) % 6, c0 + 1 + (r >> 9) % 6
            sub = seeker.assemble(data, r0, r1, c0, c1)
            info = seekable.index_info(data)  # assemble succeeded: so does the parse
            mh, mw = info["mcu"]
            sh, sw, _, _ = _kernel.Decoder(max_pixels=MAX_PIXELS).info(sub)
            assert sh == min(r1 * mh, info["height"]) - r0 * mh, (sh, info)
            assert sw == min(c1 * mw, info["width"]) - c0 * mw, (sw, info)
            return
        kern = _kernel.Decoder(max_pixels=MAX_PIXELS, strict=strict)
        try:
            ih, iw = en.image_size(data)
        except ALLOWED:
            ih, iw = 64, 64
        if mode == 2:
            r = h >> 4
            top, left = r % max(1, ih), (r >> 8) % max(1, iw)
            bh, bw = 1 + (r >> 16) % max(1, ih - top), 1 + (r >> 24) % max(1, iw - left)
            box, size, flip = (top + 0.25, left, bh - 0.25, bw), (1 + h % 40, 1 + (h >> 7) % 40), \
                bool(h & 4)
            got = seeker.decode_crop(data, box, size, flip)
            assert got.shape == (*size, 3)
            if strict:
                try:
                    want = kern.decode_crop(data, box, size, flip)
                except ALLOWED:
                    return
                assert (got == want).all(), ("seekable crop differs", box, size, seeker.why)
        else:
            got = seeker.decode_random_crop(data, (17, 23), h, 1, 2)
            assert got[0][2] > 0
    except ALLOWED:
        pass


def make_seeds(out):
    """Seekable seeds from the tests' photographs (tests/photos.py)."""
    import io

    from PIL import Image
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "tests"))
    from photos import fit, photo

    try:   # an instrumented build (fuzz/run.sh) needs libFuzzer's symbols to load
        from fuzz_decode import _export_libfuzzer
        _export_libfuzzer(load=True)
    except ImportError:
        pass   # no atheris: an ordinary build, which needs none
    from echo_native import seekable as sk
    os.makedirs(out, exist_ok=True)
    n = 0
    for sub, gray, prog, (h, w), restart in [
            (2, False, False, (61, 93), 1), (1, False, False, (50, 77), 2),
            (0, False, False, (40, 41), sk.ROW), (2, False, True, (70, 64), 4),
            (0, True, False, (33, 80), 1), (2, False, False, (17, 300), sk.DEFAULT),
            (0, False, False, (700, 900), 1)]:
        arr = fit(photo("camera" if gray else "astronaut"), h, w)
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, "JPEG", quality=80, subsampling=sub, progressive=prog)
        data = sk.transcode(buf.getvalue(), restart).data
        with open(os.path.join(out, f"seek-{n:02d}.jpg"), "wb") as f:
            f.write(data)
        n += 1
    print(f"{n} seekable seeds in {out}")


def mutate_loop(n, seed_dir, rng_seed=0):
    """n random mutations of the seeds through one_input, without atheris."""
    _load(instrument=False)
    seeds = [open(os.path.join(seed_dir, f), "rb").read() for f in sorted(os.listdir(seed_dir))]
    rng = random.Random(rng_seed)
    for i in range(n):
        d = bytearray(rng.choice(seeds))
        for _ in range(1 + rng.randrange(4)):
            k = rng.randrange(5)
            p = rng.randrange(len(d))
            if k == 0:
                d[p] ^= 1 << rng.randrange(8)
            elif k == 1:
                d[p] = rng.choice((0x00, 0xFF, 0xD0 + rng.randrange(8), rng.randrange(256)))
            elif k == 2:
                d[p:p] = bytes(rng.randrange(256) for _ in range(1 + rng.randrange(8)))
            elif k == 3:
                del d[p:p + 1 + rng.randrange(16)]
            else:
                del d[p:]
            if not d:
                d = bytearray(b"\xff\xd8")
        data = bytes(d)
        try:
            one_input(data)
        except BaseException:
            path = f"seekable-crash-{zlib.crc32(data):08x}.jpg"
            with open(path, "wb") as f:
                f.write(data)
            print(f"crash after {i} inputs: {path}", file=sys.stderr)
            raise
    print(f"{n} mutated inputs: no crash")


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--seeds":
        make_seeds(sys.argv[2])
        return
    if len(sys.argv) == 4 and sys.argv[1] == "--mutate":
        mutate_loop(int(sys.argv[2]), sys.argv[3])
        return
    import atheris
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()

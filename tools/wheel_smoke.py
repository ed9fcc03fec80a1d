"""Smoke test of an installed echo_native wheel, run from outside the source tree.

    python tools/wheel_smoke.py [--consumer torch|numpy] [--hidden PATH ...]

In a fresh interpreter: decodes a JPEG, runs one epoch of an EchoRing (echo=2,
RandomResizedCrop + ColorJitter, normalised NCHW) over a small generated ImageFolder,
hands every batch to the consumer through DLPack without a copy (torch: bfloat16
batches, exported by echo_native's own DLPack capsule; numpy, for machines without
torch such as cibuildwheel's test step: float32), and checks from /proc/self/maps that
the libjpeg in this process is the copy bundled in the wheel (echo_native.libs/),
never the system's.  ``--hidden PATH`` names a file the caller
made unreadable (an empty file bind-mounted over it, tools/wheel_smoke.sh): it must
be empty here, so the check cannot pass with the system library merely unused.
Exits non-zero with one line naming the failed check; prints one summary line.
"""
from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
from pathlib import Path


def fail(msg: str) -> None:
    sys.exit(f"wheel smoke: FAILED: {msg}")


def make_folder(root: Path, classes: int, per_class: int) -> int:
    """An ImageFolder of smooth synthetic JPEGs of assorted sizes (encoded by Pillow,
    whose wheel carries its own libjpeg)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    n = 0
    for c in range(classes):
        d = root / f"class_{c}"
        d.mkdir(parents=True)
        for i in range(per_class):
            h, w = int(rng.integers(80, 200)), int(rng.integers(80, 200))
            y, x = np.mgrid[0:h, 0:w].astype(np.float32)
            phase = rng.uniform(0, 6.28, 3)
            img = np.stack([127 + 120 * np.sin(x / (7 + k) + y / (11 + 2 * k) + phase[k])
                            for k in range(3)], axis=-1).astype(np.uint8)
            Image.fromarray(img).save(d / f"{i:03d}.jpg", quality=90)
            n += 1
    return n


def mapped_libjpeg(pkg_dir: Path) -> list[str]:
    """Paths of every libjpeg mapped into this process: one must be the copy bundled in
    the wheel, and none may come from outside this environment (Pillow's wheel maps its
    own bundled copy too, under pillow.libs/)."""
    libs = pkg_dir.parent / "echo_native.libs"
    mapped = sorted({line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                     if "libjpeg" in line.rsplit("/", 1)[-1]})
    if not any(m.startswith(str(libs) + os.sep) for m in mapped):
        fail(f"no libjpeg from {libs} is mapped after a decode (mapped: {mapped})")
    prefix = str(Path(sys.prefix).resolve()) + os.sep
    foreign = [m for m in mapped if not m.startswith(prefix)]
    if foreign:
        fail(f"libjpeg loaded from outside this environment: {foreign}")
    return mapped


def take_torch(batch, classes: int) -> int:
    """A bfloat16 batch into torch through echo_native's DLPack capsule: same memory,
    same values; its size."""
    import torch

    x = torch.from_dlpack(batch.images)
    y = torch.from_dlpack(batch.labels)
    if tuple(x.shape[1:]) != (3, 64, 64) or x.dtype != torch.bfloat16:
        fail(f"batch images reach torch as {tuple(x.shape)} {x.dtype}")
    if x.data_ptr() != batch.images.bits.ctypes.data:
        fail("torch.from_dlpack copied the batch")
    if not torch.equal(x.float(), torch.from_numpy(batch.images.to_float32())):
        fail("torch's bfloat16 values differ from the batch's")
    check_labels(y.numpy(), x.shape[0], classes)
    return int(x.shape[0])


def take_numpy(batch, classes: int) -> int:
    """A float32 batch into NumPy through DLPack: same memory; its size."""
    import numpy as np

    x = np.from_dlpack(batch.images)
    if x.shape[1:] != (3, 64, 64) or x.dtype != np.float32:
        fail(f"batch images reach NumPy as {x.shape} {x.dtype}")
    if not np.shares_memory(x, batch.images):
        fail("numpy.from_dlpack copied the batch")
    if not np.isfinite(x).all():
        fail("non-finite values in a normalised batch")
    check_labels(np.from_dlpack(batch.labels), x.shape[0], classes)
    return int(x.shape[0])


def check_labels(y, n: int, classes: int) -> None:
    if y.shape != (n,) or not 0 <= int(y.min()) <= int(y.max()) < classes:
        fail(f"labels {y.tolist()} do not match a batch of {n} from {classes} classes")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", action="append", default=[],
                    help="a file that must read as empty here (hidden by the caller)")
    ap.add_argument("--source-tree", help="the checkout, which must not be imported from")
    ap.add_argument("--consumer", choices=("torch", "numpy"), default="torch",
                    help="the framework the batches are handed to by DLPack")
    args = ap.parse_args(argv)
    for path in args.hidden:
        if os.path.getsize(path) != 0:
            fail(f"{path} is not hidden ({os.path.getsize(path)} bytes)")

    import numpy as np
    from PIL import Image

    import echo_native as en

    pkg = Path(en.__file__).resolve().parent
    if not pkg.is_relative_to(Path(sys.prefix).resolve()):
        fail(f"echo_native imported from {pkg}, not from this environment ({sys.prefix})")
    if args.source_tree and pkg.is_relative_to(Path(args.source_tree).resolve()):
        fail(f"echo_native imported from the source tree ({pkg})")

    with tempfile.TemporaryDirectory(prefix="en-smoke-") as tmp:
        root = Path(tmp) / "data"
        n = make_folder(root, classes=3, per_class=16)

        # decode: the kernel against Pillow's own decode of the same file
        data = next(root.rglob("*.jpg")).read_bytes()
        img = en.decode(data)
        ref = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        if img.shape != ref.shape or img.dtype != np.uint8:
            fail(f"decode gave {img.shape} {img.dtype}, Pillow {ref.shape}")
        diff = float(np.abs(img.astype(np.int16) - ref).mean())
        if diff > 1.0:
            fail(f"decode differs from Pillow by {diff:.2f} levels on average")
        libs = mapped_libjpeg(pkg)

        # one epoch of an EchoRing with echo=2 and per-example ops, batches by DLPack
        take = take_torch if args.consumer == "torch" else take_numpy
        ring = en.EchoRing(
            en.ImageFolder(root), batch_size=8,
            augment=[en.RandomResizedCrop(64), en.ColorJitter(0.4, 0.4, 0.4, 0.1)],
            echo=2, workers=2, seed=0,
            output=en.Output(normalize=True, layout="NCHW",
                             dtype="bfloat16" if args.consumer == "torch" else "float32"))
        delivered = batches = 0
        with ring:
            for batch in ring:
                delivered += take(batch, classes=3)
                batches += 1
            stats = ring.stats()
        if stats["fresh"] != n:
            fail(f"one epoch read {stats['fresh']} fresh examples, the folder has {n}")
        if delivered != stats["delivered"] or not n < delivered <= 2 * n:
            fail(f"echo=2 delivered {delivered} for {n} fresh examples "
                 f"(stats: {stats['delivered']})")
    print(f"wheel smoke: ok: echo_native {en.__version__} from {pkg}; decode matches Pillow "
          f"({diff:.2f}); one epoch echo=2: {n} fresh, {delivered} delivered in {batches} "
          f"batches to {args.consumer} by DLPack; libjpeg: {', '.join(libs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

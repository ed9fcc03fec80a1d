"""Fashion-MNIST (Debian's ``dataset-fashion-mnist``) as a JPEG ``ImageFolder``.

Debian ships the original IDX files, gzip-compressed, under
``/usr/share/datasets/fashion-mnist``::

    train-images-idx3-ubyte.gz  train-labels-idx1-ubyte.gz   (60,000 images)
    t10k-images-idx3-ubyte.gz   t10k-labels-idx1-ubyte.gz    (10,000 images)

:func:`build_fashion_mnist` writes them as 28x28 grayscale JPEGs to
``OUT/train/<class>/<index>.jpg`` and ``OUT/test/<class>/<index>.jpg`` (class
folders are named ``0_t-shirt_top`` ... ``9_ankle_boot`` so that their sorted
order is the label order).  A manifest written last marks a complete tree; an
existing complete tree with the same parameters is returned at once.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import struct
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

__all__ = ["FASHION_MNIST_DIR", "FASHION_CLASSES", "DatasetMissing", "load_idx",
           "load_fashion_mnist", "build_fashion_mnist", "default_fashion_mnist"]

FASHION_MNIST_DIR = Path(os.environ.get("ECHO_NATIVE_FASHION_MNIST",
                                        "/usr/share/datasets/fashion-mnist"))
FASHION_CLASSES = ("t-shirt_top", "trouser", "pullover", "dress", "coat", "sandal", "shirt",
                   "sneaker", "bag", "ankle_boot")
MANIFEST = "echo_native_fashion_mnist.json"
_FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
          "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}


class DatasetMissing(FileNotFoundError):
    """The Debian dataset package is not installed (message says how to install it)."""


def load_idx(path) -> np.ndarray:
    """An IDX file (optionally gzip-compressed) as a NumPy uint8 array."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    ndim = data[3]
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(shape)):
        raise ValueError(f"{path}: {body.size} bytes of data for shape {shape}")
    return body.reshape(shape)


def load_fashion_mnist(split: str, source_dir=None):
    """``(images (N,28,28) uint8, labels (N,) uint8)`` of ``split`` ("train" or "test")."""
    d = Path(source_dir) if source_dir else FASHION_MNIST_DIR
    images, labels = (d / f for f in _FILES[split])
    if not images.exists() or not labels.exists():
        raise DatasetMissing(f"Fashion-MNIST not found under {d}: apt-get install "
                             f"dataset-fashion-mnist")
    x, y = load_idx(images), load_idx(labels)
    if len(x) != len(y):
        raise ValueError(f"{images}: {len(x)} images but {len(y)} labels")
    return x, y


def _class_dir(label: int) -> str:
    return f"{label}_{FASHION_CLASSES[label]}"


def _encode_chunk(args):
    root, start, images, labels, quality = args
    from PIL import Image

    for k, (img, lab) in enumerate(zip(images, labels)):
        buf = io.BytesIO()
        Image.fromarray(img, mode="L").save(buf, format="JPEG", quality=quality)
        with open(os.path.join(root, _class_dir(int(lab)), f"{start + k:05d}.jpg"), "wb") as f:
            f.write(buf.getvalue())
    return len(images)


def build_fashion_mnist(out, quality: int = 90, limit_train=None, limit_test=None,
                        source_dir=None, processes=None, progress=None) -> Path:
    """Write the JPEG ImageFolder tree under ``out`` and return ``out``.

    ``limit_train``/``limit_test`` keep only the first N images of each split (a
    deterministic subset, for tests).  ``processes`` encoders (default: cores).
    """
    out = Path(out)
    params = {"quality": int(quality), "limit_train": limit_train, "limit_test": limit_test}
    man = out / MANIFEST
    if man.exists():
        try:
            if json.loads(man.read_text()).get("params") == params:
                return out
        except ValueError:
            pass
    splits = {s: load_fashion_mnist(s, source_dir) for s in ("train", "test")}
    limits = {"train": limit_train, "test": limit_test}
    jobs = []
    for split, (x, y) in splits.items():
        n = len(x) if limits[split] is None else min(len(x), int(limits[split]))
        root = out / split
        if root.exists():
            shutil.rmtree(root)
        for c in range(len(FASHION_CLASSES)):
            (root / _class_dir(c)).mkdir(parents=True, exist_ok=True)
        step = 2000
        jobs += [(str(root), s, x[s:min(n, s + step)], y[s:min(n, s + step)], int(quality))
                 for s in range(0, n, step)]
    processes = processes or len(os.sched_getaffinity(0))
    done = 0
    if processes <= 1 or len(jobs) <= 1:
        for j in jobs:
            done += _encode_chunk(j)
            if progress:
                progress(done)
    else:
        with ProcessPoolExecutor(processes) as ex:
            for k in ex.map(_encode_chunk, jobs):
                done += k
                if progress:
                    progress(done)
    man.write_text(json.dumps({"params": params, "classes": [_class_dir(c) for c in
                                                             range(len(FASHION_CLASSES))],
                               "train": sum(len(j[2]) for j in jobs if j[0].endswith("train")),
                               "test": sum(len(j[2]) for j in jobs if j[0].endswith("test"))}))
    return out


def default_fashion_mnist(quality: int = 90) -> Path:
    """The full JPEG tree, cached under the user's cache directory, built on first use."""
    from echo_native.lab.corpus import default_cache_dir

    return build_fashion_mnist(default_cache_dir() / f"fashion-mnist-q{int(quality)}",
                               quality=quality)

"""Helpers for the source / sharding / resume tests (importable by workers).

Worker processes are fresh interpreters: anything a worker runs should live in an
importable module, not in a test file.  ``tests/test_source.py`` and
``tests/test_distributed.py`` put this folder on ``sys.path`` and
``import sources_helpers``.

Everything here builds its data from scikit-image's photographs (real
content, never noise): small JPEGs, an ImageFolder tree of them, and
WebDataset-style tar shards holding the very same bytes.
"""
from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import numpy as np

import echo_helpers

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")


def photo_jpegs(n, height=40, width=48, seed=0, quality=88):
    """``n`` distinct JPEGs of ``height`` x ``width``, random crops of real photographs."""
    return echo_helpers.photo_jpegs(n, height, width, seed, quality)


def write_folder(root, blobs, labels, classes=None):
    """An ImageFolder tree: ``root/<class name>/img_<i>.jpg``; returns the root."""
    root = Path(root)
    classes = classes or [f"class_{c:02d}" for c in range(int(max(labels)) + 1)]
    for i, (data, lab) in enumerate(zip(blobs, labels)):
        d = root / classes[int(lab)]
        d.mkdir(parents=True, exist_ok=True)
        (d / f"img_{i:05d}.jpg").write_bytes(data)
    return root


def _add(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    tar.addfile(info, io.BytesIO(data))


def write_shards(folder, blobs, labels, shards, missing_cls=(), extra_members=True):
    """WebDataset shards of the samples: sample i goes to shard ``i % shards`` as
    ``<key>.jpg`` + ``<key>.cls`` (key ``s<i>``); returns the shard paths.

    ``missing_cls`` lists samples whose ``.cls`` member is left out.  With
    ``extra_members``, every shard also holds a directory entry and a
    ``.json`` member that the reader must ignore.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"shard-{s:03d}.tar" for s in range(shards)]
    tars = [tarfile.open(p, "w", format=tarfile.USTAR_FORMAT) for p in paths]
    try:
        if extra_members:
            for t in tars:
                d = tarfile.TarInfo("meta")
                d.type = tarfile.DIRTYPE
                t.addfile(d)
        for i, (data, lab) in enumerate(zip(blobs, labels)):
            t = tars[i % shards]
            key = f"s{i:05d}"
            _add(t, f"{key}.jpg", data)
            if i not in missing_cls:
                _add(t, f"{key}.cls", f"{int(lab)}\n".encode())
            if extra_members:
                _add(t, f"{key}.json", b'{"note": "ignored"}')
    finally:
        for t in tars:
            t.close()
    return [str(p) for p in paths]



def run_epoch(ring, limit=None):
    """Iterate the current epoch of ``ring`` (an EchoRing or Loader), copying the ids:
    the list of (sample_ids, fresh, labels) of each batch; stops after ``limit`` batches."""
    out = []
    for b in ring:
        out.append((np.array(b.sample_ids), np.array(b.fresh), np.array(b.labels)))
        if limit is not None and len(out) >= limit:
            break
    return out


def empty_tree(root, n_files, n_classes, ext=".jpg"):
    """``n_files`` empty files spread over ``n_classes`` class folders."""
    root = Path(root)
    per = -(-n_files // n_classes)
    made = 0
    for c in range(n_classes):
        d = root / f"n{c:08d}"
        d.mkdir(parents=True, exist_ok=True)
        for j in range(min(per, n_files - made)):
            fd = os.open(d / f"n{c:08d}_{j:07d}{ext}", os.O_CREAT | os.O_WRONLY, 0o644)
            os.close(fd)
            made += 1
    return root


class NotInConsumer:
    """Wraps a source; ``read`` refuses to run in the process that built it (the
    consumer), so a pipeline that read files in the consumer would fail."""

    def __init__(self, base):
        self.base, self.labels, self.owner = base, base.labels, os.getpid()
        if hasattr(base, "epoch_order"):  # keep the source's own epoch order
            self.epoch_order = base.epoch_order

    def __len__(self):
        return len(self.base)

    def describe(self, i):
        return self.base.describe(i)

    def read(self, i):
        if os.getpid() == self.owner:
            raise RuntimeError(f"sample {i} was read in the consumer process")
        return self.base.read(i)


class Drawn:
    """A source as a user writes one over images a test drew: ``items`` hold each
    sample's JPEG bytes first, then what its ``targets(i)`` are made of (the subclass
    says how); every label is 0 (detection samples have no class of their own)."""

    def __init__(self, items):
        self.items = list(items)
        self.labels = np.zeros(len(self.items), np.int64)

    def __len__(self):
        return len(self.items)

    def read(self, i):
        return self.items[i][0]

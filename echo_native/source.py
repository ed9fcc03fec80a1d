"""Stage 0 of the pipeline: where the bytes come from.

A source is an indexable set of samples: ``len(source)``, ``source.labels``
(an int64 array), ``source.read(i) -> bytes`` and ``source.describe(i)`` (a
path or name for error messages).  Sources are pickled into the worker
processes and ``read`` runs there, never in the consumer.  They hold their
index compactly (packed arrays, not a Python object per sample) so that
shipping one to a worker stays cheap for millions of files.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

#: Same set as torchvision's ``IMG_EXTENSIONS``.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class _PackedPaths:
    """Many relative paths in one UTF-8 blob plus an offsets array."""

    def __init__(self, paths):
        encoded = [os.fsencode(p) for p in paths]
        self.offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=self.offsets[1:])
        self.blob = b"".join(encoded)

    def __len__(self):
        return len(self.offsets) - 1

    def __getitem__(self, i):
        return os.fsdecode(self.blob[self.offsets[i]:self.offsets[i + 1]])


class ImageFolder:
    """Class sub-folders to integer labels, ordered exactly as torchvision's ``ImageFolder``.

    ``root/<class>/**/<file>``: classes are the sorted sub-folder names, files
    are walked in sorted order and kept when their extension (any case) is in
    ``extensions``.  ``classes`` and ``class_to_idx`` match torchvision.
    """

    def __init__(self, root, extensions=IMG_EXTENSIONS):
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"ImageFolder root {str(self.root)!r} is not a directory")
        exts = tuple(e.lower() for e in extensions)
        with os.scandir(self.root) as it:
            self.classes = sorted(e.name for e in it if e.is_dir())
        if not self.classes:
            raise ValueError(f"ImageFolder root {str(self.root)!r} has no class sub-folders")
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        paths, labels = [], []
        for idx, cls in enumerate(self.classes):
            for dirpath, dirnames, filenames in os.walk(self.root / cls, followlinks=True):
                dirnames.sort()
                rel = os.path.relpath(dirpath, self.root)
                for name in sorted(filenames):
                    if name.lower().endswith(exts):
                        paths.append(os.path.join(rel, name))
                        labels.append(idx)
        if not paths:
            raise ValueError(f"ImageFolder root {str(self.root)!r} holds no files with "
                             f"extensions {', '.join(exts)}")
        self._paths = _PackedPaths(paths)
        self.labels = np.asarray(labels, dtype=np.int64)

    def __len__(self):
        return len(self.labels)

    def path(self, i) -> str:
        return os.path.join(self.root, self._paths[i])

    def describe(self, i) -> str:
        return self.path(i)

    def read(self, i) -> bytes:
        with open(self.path(i), "rb") as f:
            return f.read()

    def __repr__(self):
        return f"ImageFolder({str(self.root)!r}, {len(self)} samples, {len(self.classes)} classes)"


class Samples:
    """In-memory samples: a list of encoded images and their labels (tests, small data)."""

    def __init__(self, blobs, labels=None, names=None):
        self._blobs = [bytes(b) for b in blobs]
        if labels is None:
            labels = np.zeros(len(self._blobs), dtype=np.int64)
        self.labels = np.asarray(labels, dtype=np.int64)
        if self.labels.shape != (len(self._blobs),):
            raise ValueError(f"Samples got {len(self._blobs)} images but {self.labels.size} labels")
        if names is not None and len(names) != len(self._blobs):
            raise ValueError(f"Samples got {len(self._blobs)} images but {len(names)} names")
        self._names = None if names is None else [str(n) for n in names]

    def __len__(self):
        return len(self._blobs)

    def describe(self, i) -> str:
        return self._names[i] if self._names else f"<sample {i}>"

    def read(self, i) -> bytes:
        return self._blobs[i]

    def __repr__(self):
        return f"Samples({len(self)} samples)"

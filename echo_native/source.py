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


class _Files:
    """A source of files named by packed relative paths under ``root``."""

    root: Path
    labels: np.ndarray
    _paths: _PackedPaths

    def __len__(self):
        return len(self.labels)

    def path(self, i) -> str:
        return os.path.join(self.root, self._paths[i])

    def describe(self, i) -> str:
        return self.path(i)

    def read(self, i) -> bytes:
        with open(self.path(i), "rb") as f:
            return f.read()


class ImageFolder(_Files):
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
            # sorted(os.walk(...)) as torchvision: folders in path-string order
            # ("a/b-c" before "a/b/x"), not depth first.
            for dirpath, _, filenames in sorted(os.walk(self.root / cls, followlinks=True)):
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


class FileList(_Files):
    """Samples listed in a text/CSV file (or given as rows) of ``path,label``.

    Relative paths are resolved against ``root`` (default: the list file's
    folder).  Blank lines and lines starting with ``#`` are ignored; a first
    (non-comment) line ``path,label`` is taken as a header.
    """

    def __init__(self, path_or_rows, root=None):
        if isinstance(path_or_rows, (str, os.PathLike)):
            list_path = Path(path_or_rows)
            if not list_path.is_file():
                raise FileNotFoundError(f"FileList {str(list_path)!r} does not exist")
            with open(list_path, newline="") as f:
                lines = f.read().splitlines()
            rows = []
            for n, line in enumerate(lines, 1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                path, sep, label = line.rpartition(",")
                if not sep:
                    raise ValueError(f"{list_path}:{n}: expected 'path,label', got {line!r}")
                if not rows and label.strip().lower() == "label":  # header
                    continue
                rows.append((path.strip(), label.strip(), f"{list_path}:{n}"))
            self.root = Path(root) if root is not None else list_path.parent
        else:
            rows = [(str(p), lab, f"row {n}") for n, (p, lab) in enumerate(path_or_rows)]
            self.root = Path(root) if root is not None else Path(".")
        if not rows:
            where = str(path_or_rows) if isinstance(path_or_rows, (str, os.PathLike)) else "rows"
            raise ValueError(f"FileList {where!r} has no samples")
        labels = []
        for path, label, where in rows:
            try:
                labels.append(int(label))
            except (TypeError, ValueError):
                raise ValueError(f"{where}: label {label!r} of {path!r} is not an integer") \
                    from None
        self._paths = _PackedPaths([p for p, _, _ in rows])
        self.labels = np.asarray(labels, dtype=np.int64)

    def __repr__(self):
        return f"FileList({len(self)} samples, root={str(self.root)!r})"


class TarShards:
    """WebDataset-style tar shards: members ``<key>.jpg`` (or .jpeg/.png/.webp) and
    ``<key>.cls`` (the integer label) grouped by key.

    The shards are indexed once (member headers only, data is skipped), so a
    worker reads a sample with one positioned read from the shard, never
    extracting anything.  Epoch order keeps reads mostly sequential: shards are
    visited in an order shuffled per epoch and samples are shuffled within a
    window of ``shuffle_buffer`` consecutive samples (like WebDataset's buffer).
    A sample without a ``.cls`` member gets label -1.
    """

    IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")

    def __init__(self, urls_or_paths, shuffle_buffer=1000):
        import tarfile

        if isinstance(urls_or_paths, (str, os.PathLike)):
            urls_or_paths = [urls_or_paths]
        self.shards = [str(p) for p in urls_or_paths]
        if not self.shards:
            raise ValueError("TarShards needs at least one shard")
        self.shuffle_buffer = int(shuffle_buffer)
        shard_of, offsets, sizes, labels, keys, starts = [], [], [], [], [], [0]
        for s, shard in enumerate(self.shards):
            if not os.path.isfile(shard):
                raise FileNotFoundError(f"tar shard {shard!r} does not exist")
            images, classes = {}, {}
            try:
                with tarfile.open(shard, "r:") as tar:
                    for m in tar:
                        if not m.isfile():
                            continue
                        key, dot, ext = m.name.rpartition(".")
                        ext = "." + ext.lower()
                        if ext in self.IMAGE_EXTS:
                            images[key] = (m.offset_data, m.size)
                        elif ext == ".cls":
                            classes[key] = (m.offset_data, m.size)
            except tarfile.TarError as e:
                raise ValueError(f"tar shard {shard!r} is not a readable tar file: {e}") from None
            with open(shard, "rb") as f:
                for key in sorted(images):
                    off, size = images[key]
                    label = -1
                    if key in classes:
                        f.seek(classes[key][0])
                        text = f.read(classes[key][1]).strip()
                        try:
                            label = int(text)
                        except ValueError:
                            raise ValueError(f"{shard}: {key}.cls holds {text[:20]!r}, not an "
                                             f"integer label") from None
                    shard_of.append(s)
                    offsets.append(off)
                    sizes.append(size)
                    labels.append(label)
                    keys.append(key)
            starts.append(len(offsets))
        if not offsets:
            raise ValueError(f"no image members in the {len(self.shards)} tar shard(s)")
        self._shard = np.asarray(shard_of, np.int32)
        self._offset = np.asarray(offsets, np.int64)
        self._size = np.asarray(sizes, np.int64)
        self._starts = np.asarray(starts, np.int64)
        self._keys = _PackedPaths(keys)
        self.labels = np.asarray(labels, np.int64)
        self._files = {}  # shard index -> descriptor, opened on first read in each process

    def __len__(self):
        return len(self.labels)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_files"] = {}  # open files stay in the process that opened them
        return state

    def __del__(self):
        for fd in (getattr(self, "_files", None) or {}).values():
            try:
                os.close(fd)
            except OSError:
                pass

    def describe(self, i) -> str:
        return f"{self.shards[self._shard[i]]}:{self._keys[i]}"

    def read(self, i) -> bytes:
        s = int(self._shard[i])
        fd = self._files.get(s)
        if fd is None:
            fd = os.open(self.shards[s], os.O_RDONLY)
            # Reader threads may race here: keep whichever descriptor won.
            if self._files.setdefault(s, fd) != fd:
                os.close(fd)
                fd = self._files[s]
        size = int(self._size[i])
        data = os.pread(fd, size, int(self._offset[i]))
        if len(data) != size:
            raise OSError(f"short read: {len(data)} of {size} bytes")
        return data

    def epoch_order(self, seed, epoch):
        """Shards in a per-epoch order, samples shuffled within windows."""
        gen = np.random.Generator(np.random.Philox(key=[seed, 0x7461727368], counter=[epoch, 0, 0, 0]))
        parts = [np.arange(self._starts[s], self._starts[s + 1])
                 for s in gen.permutation(len(self.shards))]
        order = np.concatenate(parts)
        w = max(1, self.shuffle_buffer)
        for start in range(0, len(order), w):
            gen.shuffle(order[start:start + w])
        return order

    def __repr__(self):
        return f"TarShards({len(self.shards)} shards, {len(self)} samples)"

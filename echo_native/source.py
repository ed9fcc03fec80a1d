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
import errno
import stat
from pathlib import Path

import numpy as np

from echo_native.errors import ReadLimitError

#: Same set as torchvision's ``IMG_EXTENSIONS``.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

#: Largest file a built-in source reads (``max_file_bytes``): ImageNet's largest
#: training JPEG is about 15 MB; a bigger "image" is a mistake or an attack, and
#: reading it would take that much memory in a worker.
DEFAULT_MAX_FILE_BYTES = 64 * 2**20


def _check_max_file_bytes(owner, value):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{owner}: max_file_bytes must be a positive integer, got {value!r}")
    return int(value)


def read_file(path, max_file_bytes=DEFAULT_MAX_FILE_BYTES) -> bytes:
    """The bytes of a regular file of at most ``max_file_bytes``.

    Opened without blocking and checked before reading: a FIFO, a device or a
    socket named ``x.jpg`` would hang or stream forever, and a huge (or sparse)
    file would take its size in memory.  Raises :class:`ReadLimitError` (an
    ``OSError``) for those, ``OSError`` for the rest.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ReadLimitError(errno.EINVAL, f"not a regular file ({_file_kind(st.st_mode)})")
        if st.st_size > max_file_bytes:
            raise ReadLimitError(errno.EFBIG, f"{st.st_size} bytes, over the limit "
                                              f"max_file_bytes={max_file_bytes}")
        # The file may grow between fstat and read: never take more than the limit.
        chunks, left = [], max_file_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            raise ReadLimitError(errno.EFBIG, f"grew past the limit "
                                              f"max_file_bytes={max_file_bytes} while read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _file_kind(mode):
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a plain file"


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
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES

    def __len__(self):
        return len(self.labels)

    def path(self, i) -> str:
        return os.path.join(self.root, self._paths[i])

    def describe(self, i) -> str:
        return self.path(i)

    def read(self, i) -> bytes:
        return read_file(self.path(i), self.max_file_bytes)


def _dir_id(path):
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _walk_acyclic(top, above=()):
    """``os.walk(top, followlinks=True)`` that does not enter a directory (device,
    inode) it is already inside: a link back up the tree (``a/loop -> ..``) would
    otherwise be listed forever.  Otherwise the same directories as ``os.walk``,
    so the listing matches torchvision's wherever torchvision's terminates.
    ``above`` are the ids of directories above ``top``."""
    inside = {os.path.normpath(top): frozenset(above) | {_dir_id(top)}}
    for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
        ancestors = inside.pop(os.path.normpath(dirpath))
        keep = []
        for name in dirnames:
            child = os.path.join(dirpath, name)
            try:
                cid = _dir_id(child)
            except OSError:  # a dangling link, as os.walk would skip it
                continue
            if cid not in ancestors:
                keep.append(name)
                inside[os.path.normpath(child)] = ancestors | {cid}
        dirnames[:] = keep
        yield dirpath, dirnames, filenames


class ImageFolder(_Files):
    """Class sub-folders to integer labels, ordered exactly as torchvision's ``ImageFolder``.

    ``root/<class>/**/<file>``: classes are the sorted sub-folder names, files
    are walked in sorted order and kept when their extension (any case) is in
    ``extensions``.  ``classes`` and ``class_to_idx`` match torchvision.
    Symbolic links are followed as torchvision does, except into a directory
    the walk is already inside (``a/loop -> ..`` would otherwise list files
    forever).  ``read`` refuses
    non-regular files and files over ``max_file_bytes`` (a sample failure
    naming the file).
    """

    def __init__(self, root, extensions=IMG_EXTENSIONS, max_file_bytes=DEFAULT_MAX_FILE_BYTES):
        self.max_file_bytes = _check_max_file_bytes("ImageFolder", max_file_bytes)
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
        root_id = _dir_id(self.root)
        for idx, cls in enumerate(self.classes):
            # sorted(os.walk(...)) as torchvision: folders in path-string order
            # ("a/b-c" before "a/b/x"), not depth first.
            for dirpath, _, filenames in sorted(_walk_acyclic(self.root / cls, [root_id])):
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
    (non-comment) line ``path,label`` is taken as a header.  Labels are
    64-bit signed integers.  ``read`` refuses non-regular files and files over
    ``max_file_bytes``.
    """

    def __init__(self, path_or_rows, root=None, max_file_bytes=DEFAULT_MAX_FILE_BYTES):
        self.max_file_bytes = _check_max_file_bytes("FileList", max_file_bytes)
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
                value = int(label)
            except (TypeError, ValueError):
                raise ValueError(f"{where}: label {label!r} of {path!r} is not an integer") \
                    from None
            if not -2**63 <= value < 2**63:
                raise ValueError(f"{where}: label {label!r} of {path!r} does not fit a 64-bit "
                                 f"integer")
            labels.append(value)
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

    def __init__(self, urls_or_paths, shuffle_buffer=1000, max_file_bytes=DEFAULT_MAX_FILE_BYTES):
        import tarfile

        self.max_file_bytes = _check_max_file_bytes("TarShards", max_file_bytes)
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
                            if not -2**63 <= label < 2**63:
                                raise ValueError
                        except ValueError:
                            raise ValueError(f"{shard}: {key}.cls holds {text[:20]!r}, not a "
                                             f"64-bit integer label") from None
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
        if size > self.max_file_bytes:
            raise ReadLimitError(errno.EFBIG, f"{size} bytes, over the limit "
                                              f"max_file_bytes={self.max_file_bytes}")
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

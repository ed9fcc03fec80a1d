"""Parquet files of encoded images, and Hugging Face ``datasets``, as a source.

The Hugging Face hub keeps image data sets as Parquet: an ``image`` column of
structs ``{bytes, path}`` (or plain binary), an integer ``label`` column, and the
``ClassLabel`` names in the schema's ``huggingface`` metadata.  ``ParquetImages``
reads those files where they are (local, or by URL through fsspec) and hands each
image's encoded bytes to the decoder as a view into Arrow's buffer: no Pillow, no
Python copy per image.

Parquet cannot read one cell of a column: the unit of reading is a row group's
column chunk.  So a worker reads a row group once and keeps it (a per-process
cache bounded in bytes) while the samples of that row group come by, and the
epoch order keeps those samples close together: row groups in an order shuffled
per epoch, samples shuffled within windows of ``shuffle_buffer`` (as tar shards
are read).  A ``datasets.Dataset`` is different: its Arrow table is memory-mapped,
so any row costs the same and the order is a plain permutation.

pyarrow (and, for a Dataset, ``datasets``) is imported only when one is used.
"""
from __future__ import annotations

import errno
import os
import threading
import time
from collections import OrderedDict

import numpy as np

from echo_native import prefetch as _prefetch
from echo_native import remote as _remote
from echo_native.errors import ReadLimitError
from echo_native.files import DEFAULT_MAX_FILE_BYTES, _check_max_file_bytes, read_file
from echo_native.source import _LAZY, check_labels
from echo_native.parquet_index import (BOX_FORMATS, DatasetIndex, FileIndex, objects_targets,
                                       pyarrow)

__all__ = ["ParquetImages", "from_datasets", "DEFAULT_MAX_ROW_GROUP_BYTES"]

#: Largest image column chunk of one row group a worker reads (uncompressed): the
#: Hugging Face writers put about 100 images in a row group (10-50 MB); a row group
#: far larger would take that much memory in every worker, so it is refused at
#: construction, naming it, unless the limit is raised.
DEFAULT_MAX_ROW_GROUP_BYTES = 256 * 2**20

#: Row groups each worker process keeps (bytes of image cells).  The samples shuffled
#: together (``shuffle_buffer`` of them) should fit, or row groups are read again.
DEFAULT_CACHE_BYTES = 512 * 2**20

#: How long a row group that failed to read fails its samples before it is tried again.
_BROKEN_S = 30.0


class _Cells:
    """The image cells of one Arrow array (a row group's, or one chunk of a table):
    offsets and the data buffer, so that a cell is a slice of that buffer, not a copy."""

    __slots__ = ("offsets", "data", "view", "valid", "paths", "objects", "nbytes")

    def __init__(self, arr, objects=None):
        pa = pyarrow()
        paths = None
        if pa.types.is_struct(arr.type):
            fields = dict(zip([f.name for f in arr.type], arr.flatten()))  # struct nulls applied
            binary, paths = fields["bytes"], fields.get("path")
        else:
            binary = arr
        if hasattr(pa.types, "is_binary_view") and pa.types.is_binary_view(binary.type):
            binary = binary.cast(pa.binary())  # views have no single offsets buffer
        wide = pa.types.is_large_binary(binary.type)
        bufs = binary.buffers()
        n = len(binary)
        if bufs[1] is None:  # an array of no rows
            self.offsets = np.zeros(n + 1, np.int64)
        else:
            self.offsets = np.frombuffer(bufs[1], np.int64 if wide else np.int32)[
                binary.offset:binary.offset + n + 1]
        self.data = bufs[2]
        self.view = None if self.data is None else memoryview(self.data).cast("B").toreadonly()
        self.valid = None if binary.null_count == 0 else \
            np.asarray(binary.is_valid().to_numpy(zero_copy_only=False))
        self.paths = paths
        self.objects = objects
        self.nbytes = binary.nbytes + (objects.nbytes if objects is not None else 0)

    def get(self, row):
        """The cell's bytes as a read-only memoryview, or None for a null cell."""
        if self.valid is not None and not self.valid[row]:
            return None
        a, b = int(self.offsets[row]), int(self.offsets[row + 1])
        if self.data is None or a == b:
            return memoryview(b"")
        # Arrow's buffers export signed chars ('b'); the kernel takes unsigned bytes, and
        # any other format would send the image down the slower Pillow path.
        return self.view[a:b]

    def path(self, row):
        if self.paths is None or not self.paths[row].is_valid:
            return None
        return self.paths[row].as_py()


class _Broken:
    """A row group that could not be read: its samples fail with this, without reading
    it again for each of them, for ``_BROKEN_S`` (a transient store error may pass)."""

    __slots__ = ("error", "nbytes", "until")

    def __init__(self, error):
        self.error, self.nbytes = error, 0
        self.until = time.monotonic() + _BROKEN_S


def _is_dataset(obj):
    mod = type(obj).__module__ or ""
    return mod.split(".")[0] == "datasets" and hasattr(obj, "features")


class ParquetImages:
    """Images kept in Parquet files (the Hugging Face hub's layout), or a Hugging Face
    ``datasets.Dataset``, as a source.

    ``paths``: one file, a list, a glob (``data/train-*.parquet``) or a folder (its
    ``*.parquet`` files, sorted, sub-folders included) of Parquet files, local or
    URLs of any fsspec protocol (``s3://``, ``gs://``, ``https://``) read by range
    through :mod:`echo_native.remote` (``storage_options``, ``remote``); or a
    ``datasets.Dataset`` (:func:`from_datasets`), whose Arrow table is read in place.

    ``image`` names the column of encoded images: structs with a ``bytes`` field
    (the ``datasets.Image`` feature) or plain binary.  ``label`` names an integer
    column (``None``: no labels, every label -1).  ``classes`` (and
    ``class_to_idx``) come from the ``ClassLabel`` names in the Hugging Face schema
    metadata when they are there, else ``classes`` is None.

    ``targets``: the column of Hugging Face style objects (``{"bbox": [[...], ...],
    "category": [...]}``, or a list of such structs; optionally ``iscrowd``), with
    boxes in ``box_format`` (``"xywh"``, COCO's and the hub's usual one, ``"xyxy"``
    or ``"cxcywh"``); each sample then carries :class:`~echo_native.targets.Targets`
    as :class:`~echo_native.CocoDetection`'s do.

    Workers read whole row groups (only the columns they need; remote ones in one
    range request each, fetched ahead while the batch before decodes) and keep up
    to ``cache_bytes`` of them.  A row group whose image column is larger than
    ``max_row_group_bytes`` is refused here, as are missing columns (the error lists
    those there are), columns of the wrong type, files that are not Parquet
    (naming the file) and columns whose type or class names change between files.
    A null cell, a cell over ``max_file_bytes`` and a row group that cannot be read
    are sample failures under the pipeline's ``on_error``, named by file, row group
    and row; a cell that is not an image fails its decode, named the same way.
    A null cell with a ``path`` (``datasets`` writes those for images it was given
    by path) is read from that path when the Parquet file (or the Dataset) is local.
    """

    has_targets = False  # set per instance by targets=

    def __init__(self, paths, image="image", label="label", *, targets=None, box_format="xywh",
                 filesystem=None, storage_options=None, remote=None, shuffle_buffer=1000,
                 max_file_bytes=DEFAULT_MAX_FILE_BYTES,
                 max_row_group_bytes=DEFAULT_MAX_ROW_GROUP_BYTES,
                 cache_bytes=DEFAULT_CACHE_BYTES):
        self.max_file_bytes = _check_max_file_bytes("ParquetImages", max_file_bytes)
        for name, v in (("max_row_group_bytes", max_row_group_bytes),
                        ("cache_bytes", cache_bytes), ("shuffle_buffer", shuffle_buffer)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ParquetImages: {name} must be a positive integer, got {v!r}")
        if not isinstance(image, str):
            raise TypeError(f"ParquetImages: image= must be a column name, got {image!r}")
        if label is not None and not isinstance(label, str):
            raise TypeError(f"ParquetImages: label= must be a column name or None, got "
                            f"{label!r}")
        if targets is not None and not isinstance(targets, str):
            raise TypeError(f"ParquetImages: targets= must be a column name or None, got "
                            f"{targets!r}")
        if box_format not in BOX_FORMATS:
            raise ValueError(f"ParquetImages: box_format must be one of "
                             f"{', '.join(map(repr, BOX_FORMATS))}, got {box_format!r}")
        self.image, self.label, self.box_format = image, label, box_format
        self.targets_column = targets
        self.has_targets = targets is not None
        self.shuffle_buffer = int(shuffle_buffer)
        self.cache_bytes = int(cache_bytes)
        if remote is not None and not isinstance(remote, _remote.RemoteOptions):
            raise TypeError(f"remote= must be a RemoteOptions, got {remote!r}")
        if (type(paths).__module__ or "").split(".")[0] == "datasets":
            # A Dataset; a DatasetDict or IterableDataset is refused there, saying why.
            self._index = DatasetIndex(paths, image, label, targets)
        else:
            self._index = FileIndex(paths, image, label, targets, filesystem, storage_options,
                                    remote, int(max_row_group_bytes))
        self.labels = self._index.labels  # len() below is the labels' length
        self.classes = self._index.classes
        self.labels = check_labels(self, self.labels)
        self.class_to_idx = None if self.classes is None else \
            {c: i for i, c in enumerate(self.classes)}
        self._lock = None     # per process: the cache below
        self._cache = None    # row group -> _Cells (or _Broken), least recently used first
        self._cached = 0
        self._blocks = None   # remote row groups' bytes, fetched ahead (per process)

    # -- the source interface ----------------------------------------------------------
    def __len__(self):
        return len(self.labels)

    def __getstate__(self):
        state = self.__dict__.copy()
        state.update(_lock=None, _cache=None, _cached=0, _blocks=None)  # per process
        return state

    def __repr__(self):
        classes = "" if self.classes is None else f", {len(self.classes)} classes"
        return f"ParquetImages({self._index.what}, {len(self)} samples{classes})"

    @property
    def remote_options(self):
        """The RemoteOptions of the object store the files are in, or None (a hook of
        :class:`echo_native.Source`: worker caches count against the memory budget)."""
        store = getattr(self._index, "store", None)   # a Dataset's index reads no store
        return store.options if store is not None else None

    def describe(self, i) -> str:
        return self._index.describe(int(i))

    def read(self, i):
        """Sample ``i``'s encoded image: a read-only memoryview into the row group's
        Arrow buffer (bytes when it came from a ``path``)."""
        i = int(i)
        cells, row = self._cells(i)
        data = cells.get(row)
        if data is None:
            return self._null_cell(cells, row, i)
        if len(data) > self.max_file_bytes:
            raise ReadLimitError(errno.EFBIG, f"image cell of {len(data)} bytes, over the "
                                              f"limit max_file_bytes={self.max_file_bytes}")
        return data

    def targets(self, i):
        """Sample ``i``'s :class:`~echo_native.targets.Targets`, from its objects cell
        (with ``targets=``); ValueError naming the row when the cell is not valid."""
        if not self.has_targets:
            raise ValueError(f"{self!r} was made without targets=")
        cells, row = self._cells(int(i))
        cell = cells.objects[row].as_py() if cells.objects is not None else None
        return objects_targets(cell, self.box_format, f"the {self.targets_column!r} cell of "
                                                      f"{self.describe(i)}")

    def epoch_order(self, seed, epoch):
        """Row groups in an order shuffled per epoch, samples shuffled within windows of
        ``shuffle_buffer`` (Parquet files); a plain permutation (a Dataset)."""
        gen = np.random.Generator(np.random.Philox(
            key=np.array([int(seed), 0x70617271], np.uint64), counter=[epoch, 0, 0, 0]))
        starts = self._index.group_starts
        if starts is None:
            return gen.permutation(len(self)).astype(np.int64)
        parts = [np.arange(starts[g], starts[g + 1], dtype=np.int64)
                 for g in gen.permutation(len(starts) - 1)]
        order = np.concatenate(parts)
        w = self.shuffle_buffer
        for start in range(0, len(order), w):
            gen.shuffle(order[start:start + w])
        return order

    def prefetch(self, ids, upcoming=()):
        """Hint: the samples this worker reads next.  The row groups of remote ones are
        fetched ahead (those of ``upcoming`` after), within ``remote``'s limits."""
        index = self._index
        if not getattr(index, "remote_any", False):
            return
        blocks, seen = [], set()
        for i in list(ids) + list(upcoming):
            g = index.group_of(int(i))
            if g in seen or not index.is_remote_group(g):
                continue
            seen.add(g)
            if self._cache is not None and g in self._cache:
                continue
            key = index.block_key(g)
            blocks.append((key, key[2] - key[1]))
        if blocks:
            self._block_cache().hint(blocks)

    # -- row groups, read once per process ---------------------------------------------
    def _cells(self, i):
        g, row = self._index.locate(i)
        entry = self._cached_group(g)
        if isinstance(entry, _Broken):
            raise OSError(errno.EIO, entry.error)
        return entry, row

    def _cached_group(self, g):
        if self._lock is None:
            with _LAZY:
                if self._lock is None:
                    self._cache, self._lock = OrderedDict(), threading.Lock()
        with self._lock:
            entry = self._cache.get(g)
            if entry is not None and not (isinstance(entry, _Broken) and
                                          time.monotonic() > entry.until):
                self._cache.move_to_end(g)
                return entry
        # Read outside the lock: a thread worker's other readers go on meanwhile (two
        # threads may read the same row group once each; the second copy is dropped).
        entry = self._read_group(g)
        with self._lock:
            old = self._cache.pop(g, None)
            if old is not None:
                self._cached -= old.nbytes
            while self._cache and self._cached + entry.nbytes > self.cache_bytes:
                self._cached -= self._cache.popitem(last=False)[1].nbytes
            self._cache[g] = entry
            self._cached += entry.nbytes
        return entry

    def _read_group(self, g):
        index = self._index
        fetch = None
        if index.is_remote_group(g):
            key = index.block_key(g)
            opts = index.store.options

            def fetch():
                return self._block_cache().get(key, key[2] - key[1], opts.retry_timeout + 5.0)
        try:
            arr, objects = index.read_group(g, fetch)
            return _Cells(arr, objects)
        except _remote.StoreUnavailableError:
            raise  # the store, not this row group: it stops the run, whatever on_error says
        except (OSError, ValueError, MemoryError, pyarrow().ArrowException) as e:
            # pyarrow's errors are of many kinds (ArrowInvalid is a ValueError,
            # ArrowNotImplementedError is not): all are this row group's.
            text = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            return _Broken(f"{index.group_name(g)} cannot be read: {text}")

    def _block_cache(self):
        if self._blocks is None:
            with _LAZY:
                if self._blocks is None:
                    self._blocks = _prefetch.BlockCache(self._index.fetch_block,
                                                        self._index.store.options)
        return self._blocks

    def _null_cell(self, cells, row, i):
        path = cells.path(row)
        local = path is not None and self._index.allows_paths(i)
        if local and not _remote.is_url(path):
            base = self._index.base_folder(i)
            if not os.path.isabs(path) and base is not None:
                path = os.path.join(base, path)
            if os.path.isabs(path):
                return read_file(path, self.max_file_bytes)
        why = "the image cell is null"
        if path is not None:
            why += (f" (it names only a path, {path[:200]!r}, which is not read: "
                    f"{'a relative path in a Dataset' if local else 'from a remote file'}); "
                    f"embed the images' bytes (datasets' embed_table_storage, or "
                    f"push_to_hub)")
        raise OSError(errno.ENODATA, why)


def from_datasets(dataset, image="image", label="label", **kwargs):
    """A Hugging Face ``datasets.Dataset`` (from ``load_from_disk``,
    ``load_dataset("parquet", ...)``, ``Dataset.from_dict``...) as a source:
    ``ParquetImages(dataset, image, label, **kwargs)``.  Its Arrow table is read in
    the workers as it is stored (memory-mapped, shipped to them by path), so no
    image is decoded in Python; rows follow the Dataset's own order (after
    ``shuffle``, ``select`` or ``train_test_split`` too)."""
    if not _is_dataset(dataset):
        raise TypeError(f"from_datasets takes a datasets.Dataset, got "
                        f"{type(dataset).__name__}")
    return ParquetImages(dataset, image, label, **kwargs)

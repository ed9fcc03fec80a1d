"""Where each sample of a Parquet source lies: files, footers, row groups, checks.

:class:`FileIndex` lists Parquet files (local, by URL, or through a given fsspec
filesystem), reads their footers once in the consumer, checks the columns and
the size of every row group there, and keeps what a worker needs to read one row
group: its file, its number and the byte range of the columns read.
:class:`DatasetIndex` does the same for a ``datasets.Dataset``, whose memory-mapped
Arrow table needs no footer.  Both pickle small: footers and arrays, never an
open file or a connection.
"""
from __future__ import annotations

import errno
import glob as _glob
import json
import os
import threading

import numpy as np

from echo_native import remote as _remote

#: Box formats an objects column may declare (``box_format=``).
BOX_FORMATS = ("xywh", "xyxy", "cxcywh")

#: Open local Parquet files each worker process keeps.
_OPEN_FILES = 32

#: Guards the lazy creation of each index's lock (reader threads may race).
_OPENING = threading.Lock()


def pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401 - the submodule, loaded once here
    except ImportError:
        raise ImportError("ParquetImages needs pyarrow: pip install pyarrow") from None
    return pyarrow


def _columns_error(what, kind, name, names):
    shown = ", ".join(repr(n) for n in names[:40]) + (", ..." if len(names) > 40 else "")
    hint = " (label=None: no labels)" if kind == "label" else ""
    return ValueError(f"{what} has no {kind} column {name!r}{hint}; its columns are: {shown}")


def _check_image_type(t, what, name):
    pa = pyarrow()
    binary = (pa.types.is_binary, pa.types.is_large_binary) + \
        ((pa.types.is_binary_view,) if hasattr(pa.types, "is_binary_view") else ())
    if pa.types.is_struct(t):
        fields = {f.name: f.type for f in t}
        if "bytes" not in fields:
            raise ValueError(f"{what}: image column {name!r} is a struct without a 'bytes' "
                             f"field ({t}); expected the datasets.Image layout "
                             f"struct<bytes: binary, path: string>, or binary")
        t = fields["bytes"]
    if not any(test(t) for test in binary):
        raise ValueError(f"{what}: image column {name!r} is {t}, not encoded images "
                         f"(binary, or a struct with a 'bytes' field)")


def _check_label_type(t, what, name):
    pa = pyarrow()
    if not (pa.types.is_integer(t) or pa.types.is_boolean(t)):
        raise ValueError(f"{what}: label column {name!r} is {t}, not integers")


def hf_class_names(metadata, column):
    """The ClassLabel names of ``column`` in a Hugging Face schema metadata dict (or the
    ``category`` ClassLabel of an objects column), else None."""
    if not metadata or b"huggingface" not in metadata:
        return None
    try:
        info = json.loads(metadata[b"huggingface"])
        feature = (info.get("info") or {}).get("features", {}).get(column)
    except (ValueError, AttributeError):
        return None
    return _class_label(feature)


def _class_label(feature, depth=0):
    if not isinstance(feature, dict) or depth > 4:
        return None
    if feature.get("_type") == "ClassLabel" and isinstance(feature.get("names"), list):
        return [str(n) for n in feature["names"]]
    if "_type" in feature and feature["_type"] not in ("Sequence", "List", "LargeList"):
        return None
    inner = feature.get("feature", feature)
    if inner is not feature:  # a list of class labels (an objects column's categories)
        names = _class_label(inner, depth + 1)
        if names is not None:
            return names
    if isinstance(inner, dict):
        for key in ("category", "categories", "label", "labels"):
            names = _class_label(inner.get(key), depth + 1)
            if names is not None:
                return names
    return None


def _leaves(schema, column):
    """Indices of the Parquet leaf columns of top-level ``column``."""
    return [j for j in range(len(schema))
            if schema.column(j).path == column or schema.column(j).path.startswith(column + ".")]


class _Sparse(_remote.RangeReader):
    """A remote Parquet file as pyarrow reads one row group of it: the bytes of that
    row group's columns, fetched in one range request; anything else (pyarrow asks for
    nothing else when given the footer) read by range as it comes."""

    def __init__(self, block, start, size, fallback):
        super().__init__(size)
        self._block, self._start, self._fallback = block, start, fallback

    def _range(self, start, end):
        lo = start - self._start
        if lo >= 0 and end - self._start <= len(self._block):
            return memoryview(self._block)[lo:end - self._start]
        return self._fallback(start, end)


class FileIndex:
    """Parquet files: their footers, checked, and where every row group lies."""

    def __init__(self, paths, image, label, targets, filesystem, storage_options, remote,
                 max_row_group_bytes):
        pyarrow()  # the ImportError that says what to install, before anything else
        self.image, self.label, self.targets = image, label, targets
        self.fs = filesystem
        if isinstance(paths, (str, bytes, os.PathLike)):
            paths = [paths]
        try:
            paths = [os.fsdecode(p) for p in paths]
        except TypeError:
            raise TypeError(f"ParquetImages takes a path, a list of paths, a glob, a folder or "
                            f"a datasets.Dataset; got {type(paths).__name__}") from None
        if not paths:
            raise ValueError("ParquetImages needs at least one Parquet file")
        self.store = None
        if filesystem is None and any(_remote.is_url(p) for p in paths):
            self.store = _remote.RemoteStore(storage_options, remote)
        self.files = []
        for p in paths:
            self.files += self._list(p)
        self.is_remote = [self.store is not None and _remote.is_url(f) for f in self.files]
        self.remote_any = any(self.is_remote)
        self.names = [_remote.redact(f) if r else f for f, r in zip(self.files, self.is_remote)]
        self.what = self.names[0] if len(self.files) == 1 else \
            f"{len(self.files)} files: {self.names[0]}, ..."
        footers = self._footers()
        self.meta = [m for m, _, _ in footers]
        self.sizes = [s for _, s, _ in footers]
        schemas = [sch for _, _, sch in footers]
        self._check_schemas(schemas)
        self.classes = self._classes(schemas)
        cols = [image] + ([targets] if targets else [])
        group_file, group_rg, starts, ranges = [], [], [0], []
        for f, meta in enumerate(self.meta):
            leaves = sorted(j for c in cols for j in _leaves(meta.schema, c))
            images = _leaves(meta.schema, image)
            for rg in range(meta.num_row_groups):
                info = meta.row_group(rg)
                size = sum(info.column(j).total_uncompressed_size for j in images)
                if size > max_row_group_bytes:
                    raise ValueError(
                        f"{self.names[f]}: row group {rg} holds {size:,} bytes of images "
                        f"({info.num_rows:,} rows), over max_row_group_bytes="
                        f"{max_row_group_bytes:,} (every worker would hold it in memory); "
                        f"rewrite the file with smaller row groups (pyarrow's "
                        f"row_group_size=) or raise max_row_group_bytes")
                lo = hi = None
                for j in leaves:
                    c = info.column(j)
                    first = c.data_page_offset
                    if c.has_dictionary_page and c.dictionary_page_offset:
                        first = min(first, c.dictionary_page_offset)
                    lo = first if lo is None else min(lo, first)
                    end = first + c.total_compressed_size
                    hi = end if hi is None else max(hi, end)
                group_file.append(f)
                group_rg.append(rg)
                starts.append(starts[-1] + info.num_rows)
                ranges.append((lo or 0, hi or 0))
        if starts[-1] == 0:
            raise ValueError(f"ParquetImages: {self.what} holds no rows")
        self.group_file = np.asarray(group_file, np.int32)
        self.group_rg = np.asarray(group_rg, np.int32)
        self.group_starts = np.asarray(starts, np.int64)
        self.ranges = np.asarray(ranges, np.int64).reshape(-1, 2)
        self.labels = self._labels() if label is not None else \
            np.full(starts[-1], -1, np.int64)
        self._open = None  # per process: file number -> pyarrow ParquetFile
        self._lock = None  # per process: guards those

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_open"] = state["_lock"] = None  # open files stay in the process that opened them
        return state

    # -- listing ---------------------------------------------------------------------
    def _list(self, p):
        if self.fs is not None:
            return self._list_fs(self.fs, p, lambda x: x)
        if _remote.is_url(p):
            protocol = p.split("://", 1)[0]
            if protocol.lower() in ("http", "https"):
                # No listing over HTTP (fsspec's would GET the file to look for links in
                # it): a URL names one file.
                return [p]
            fs, _ = self.store.filesystem(p)
            return self.store.retrying(
                f"listing {_remote.redact(p)}",
                lambda timeout: self._list_fs(fs, fs._strip_protocol(p),
                                              lambda x: f"{protocol}://{x}"),
                passthrough=(FileNotFoundError,), url=p)
        p = str(_remote.local_path(p))
        if _glob.has_magic(p):
            found = sorted(f for f in _glob.glob(p, recursive=True) if os.path.isfile(f))
            if not found:
                raise FileNotFoundError(f"ParquetImages: no file matches {p!r}")
            return found
        if os.path.isdir(p):
            found = sorted(os.path.join(d, n) for d, _, names in os.walk(p) for n in names
                           if n.endswith(".parquet"))
            if not found:
                raise FileNotFoundError(f"ParquetImages: folder {p!r} holds no .parquet files")
            return found
        if not os.path.exists(p):
            raise FileNotFoundError(f"ParquetImages: {p!r} does not exist")
        return [p]

    @staticmethod
    def _list_fs(fs, p, name):
        if _glob.has_magic(p):
            found = sorted(x for x in fs.glob(p) if fs.isfile(x))
            if not found:
                raise FileNotFoundError(f"ParquetImages: no file matches {p!r}")
            return [name(x) for x in found]
        if fs.isdir(p):
            found = sorted(x for x in fs.find(p) if x.endswith(".parquet"))
            if not found:
                raise FileNotFoundError(f"ParquetImages: folder {p!r} holds no .parquet files")
            return [name(x) for x in found]
        if not fs.exists(p):
            raise FileNotFoundError(f"ParquetImages: {p!r} does not exist")
        return [name(p)]

    # -- footers ---------------------------------------------------------------------
    def _footers(self):
        return self._per_file(self._footer)

    def _file_object(self, f, block_bytes=64 << 10):
        """(an open binary file of file ``f``, its size).  Remote: buffered in blocks of
        ``block_bytes``, the size of the tail pyarrow reads first for the footer, so
        that a footer or a small label column costs one request."""
        path = self.files[f]
        if self.fs is not None:
            return self.fs.open(path, "rb"), int(self.fs.size(path))
        if self.is_remote[f]:
            try:
                size = self.store.info(path)["size"]
            except _remote.RemoteReadError as e:
                if e.errno == errno.ENOENT and not isinstance(e, _remote.StoreUnavailableError):
                    raise FileNotFoundError(f"Parquet file {self.names[f]!r} does not "
                                            f"exist") from None
                raise
            if size is None:
                raise _remote.RemoteReadError(errno.EIO, "the server does not tell the "
                                                         "object's size; a Parquet file needs "
                                                         "one to be read by range",
                                              self.names[f])
            return self.store.open(path, size, self.names[f], block_bytes), size
        return open(path, "rb"), os.stat(path).st_size

    def _footer(self, f):
        pq = pyarrow().parquet
        fobj, size = self._file_object(f)
        with fobj:
            try:
                pf = pq.ParquetFile(fobj)
                return pf.metadata, size, pf.schema_arrow
            except (_remote.RemoteReadError, FileNotFoundError):
                raise
            except (OSError, ValueError, pyarrow().ArrowException) as e:
                # Every Arrow error: a damaged footer can raise ArrowNotImplementedError
                # ("integers with more than 64 bits"), not only ArrowInvalid.
                raise ValueError(f"{self.names[f]}: not a Parquet file pyarrow can read "
                                 f"({e})") from None

    def _check_schemas(self, schemas):
        first = schemas[0]
        for f, schema in enumerate(schemas):
            names = schema.names
            for kind, col, check in (("image", self.image, _check_image_type),
                                     ("label", self.label, _check_label_type),
                                     ("targets", self.targets, None)):
                if col is None:
                    continue
                if col not in names:
                    raise _columns_error(self.names[f], kind, col, names)
                t = schema.field(col).type
                if check is not None:
                    check(t, self.names[f], col)
                t0 = first.field(col).type
                if t != t0:
                    raise ValueError(f"the schema changes between files: column {col!r} is "
                                     f"{t0} in {self.names[0]} but {t} in {self.names[f]}; "
                                     f"a source reads files of one schema")

    def _classes(self, schemas):
        col = self.label if self.label is not None else self.targets
        if col is None:
            return None
        found = [hf_class_names(s.metadata, col) for s in schemas]
        for f, names in enumerate(found):
            if names != found[0]:
                raise ValueError(f"the class names of column {col!r} change between files: "
                                 f"{self.names[0]} has {len(found[0] or [])} "
                                 f"({(found[0] or [])[:3]}...), {self.names[f]} has "
                                 f"{len(names or [])} ({(names or [])[:3]}...)")
        return found[0]

    def _labels(self):
        return np.concatenate(self._per_file(self._file_labels))

    def _per_file(self, fn):
        """``[fn(f) for f in files]``; on a pool when some are remote (a request or more
        each), in order, the first error raised."""
        if not self.remote_any or len(self.files) == 1:
            return [fn(f) for f in range(len(self.files))]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(16, len(self.files))) as pool:
            return list(pool.map(fn, range(len(self.files))))

    def _file_labels(self, f):
        pa = pyarrow()
        fobj, _ = self._file_object(f)
        with fobj:
            try:
                col = pa.parquet.ParquetFile(fobj, metadata=self.meta[f]).read(
                    columns=[self.label], use_threads=False).column(0)
            except (_remote.RemoteReadError, FileNotFoundError):
                raise
            except (OSError, ValueError, pa.ArrowException) as e:
                raise ValueError(f"{self.names[f]}: its label column {self.label!r} "
                                 f"cannot be read ({e})") from None
        if col.null_count:
            at = int(np.flatnonzero(~np.asarray(col.is_valid()))[0])
            meta = self.meta[f]
            rg = 0
            while at >= meta.row_group(rg).num_rows:
                at -= meta.row_group(rg).num_rows
                rg += 1
            raise ValueError(f"{self.names[f]}: row group {rg}, row {at}: the label "
                             f"{self.label!r} is null")
        return np.asarray(col.to_numpy(), np.int64) if len(col) else np.zeros(0, np.int64)

    # -- what a worker asks ------------------------------------------------------------
    def locate(self, i):
        g = int(np.searchsorted(self.group_starts, i, "right")) - 1
        return g, i - int(self.group_starts[g])

    def group_of(self, i):
        return self.locate(i)[0]

    def is_remote_group(self, g):
        return self.is_remote[self.group_file[g]]

    def block_key(self, g):
        lo, hi = self.ranges[g]
        return int(self.group_file[g]), int(lo), int(hi)

    def fetch_block(self, key):
        f, start, end = key
        return self.store.read_range(self.files[f], start, end,
                                     what=f"{self.names[f]} bytes {start}-{end}")

    def describe(self, i):
        g, row = self.locate(i)
        return f"{self.group_name(g)}, row {row}"

    def group_name(self, g):
        return f"{self.names[self.group_file[g]]}: row group {int(self.group_rg[g])}"

    def allows_paths(self, i):
        return not self.is_remote[self.group_file[self.locate(i)[0]]] and self.fs is None

    def base_folder(self, i):
        return os.path.dirname(os.path.abspath(self.files[self.group_file[self.locate(i)[0]]]))

    def read_group(self, g, fetch=None):
        """(image cells, objects cells or None) of row group ``g``, as Arrow arrays."""
        pq = pyarrow().parquet
        f, rg = int(self.group_file[g]), int(self.group_rg[g])
        cols = [self.image] + ([self.targets] if self.targets else [])
        if fetch is not None:
            _, start, _ = self.block_key(g)
            url, name = self.files[f], self.names[f]
            src = _Sparse(fetch(), start, self.sizes[f], lambda a, b: self.store.read_range(
                url, a, b, what=f"{name} bytes {a}-{b}"))
            pf = pq.ParquetFile(src, metadata=self.meta[f], pre_buffer=False)
            table = pf.read_row_group(rg, columns=cols, use_threads=False)
        else:
            if self._lock is None:
                with _OPENING:
                    if self._lock is None:
                        self._lock = threading.Lock()
            # One reader per open file: thread workers share this index.
            with self._lock:
                table = self._opened(f).read_row_group(rg, columns=cols, use_threads=False)
        want = self.group_starts[g + 1] - self.group_starts[g]
        if table.num_rows != want:
            raise OSError(errno.EIO, f"{table.num_rows} rows read, the footer says {want}")
        out = []
        for k in range(len(cols)):
            col = table.column(k)
            out.append(col.chunk(0) if col.num_chunks == 1 else col.combine_chunks())
        return out[0], (out[1] if self.targets else None)

    def _opened(self, f):
        pq = pyarrow().parquet
        if self._open is None:
            self._open = {}
        pf = self._open.get(f)
        if pf is None:
            while len(self._open) >= _OPEN_FILES:
                old = self._open.pop(next(iter(self._open)))
                try:
                    old.close()
                except Exception:  # noqa: BLE001 - closing is best effort
                    pass
            if self.fs is not None:
                pf = pq.ParquetFile(self.fs.open(self.files[f], "rb"), metadata=self.meta[f])
            else:
                pf = pq.ParquetFile(self.files[f], metadata=self.meta[f])
            self._open[f] = pf
        return pf


class DatasetIndex:
    """A ``datasets.Dataset``: its Arrow table, read where it lies (memory-mapped from its
    cache files, which is how the Dataset pickles into the workers)."""

    group_starts = None  # any row costs the same: no locality to keep
    remote_any = False

    def __init__(self, dataset, image, label, targets):
        pa = pyarrow()
        if not hasattr(dataset, "data") or not hasattr(dataset, "_indices"):
            raise TypeError(f"ParquetImages takes a map-style datasets.Dataset, got "
                            f"{type(dataset).__name__} (an IterableDataset has no rows to "
                            f"index; a DatasetDict needs a split: dataset['train'])")
        self.image, self.label, self.targets = image, label, targets
        self.dataset = dataset
        files = [c.get("filename") for c in (dataset.cache_files or [])]
        self.what = ("datasets.Dataset " + os.path.basename(os.path.dirname(files[0])) + "/"
                     + os.path.basename(files[0]) + (", ..." if len(files) > 1 else "")) \
            if files else "in-memory datasets.Dataset"
        table = dataset.data.table
        names = table.schema.names
        for kind, col, check in (("image", image, _check_image_type),
                                 ("label", label, _check_label_type),
                                 ("targets", targets, None)):
            if col is None:
                continue
            if col not in names:
                raise _columns_error(self.what, kind, col, names)
            if check is not None:
                check(table.schema.field(col).type, self.what, col)
        rows = None
        if dataset._indices is not None:
            rows = np.asarray(dataset._indices.column(0).to_numpy(), np.int64)
        self.rows = rows
        n = len(dataset)
        if label is None:
            self.labels = np.full(n, -1, np.int64)
        else:
            col = table.column(label)
            if rows is not None:
                col = col.take(pa.array(rows))
            if col.null_count:
                at = int(np.flatnonzero(~np.asarray(col.is_valid()))[0])
                raise ValueError(f"{self.what}: row {self.row(at)}: the label {label!r} is null")
            self.labels = np.asarray(col.to_numpy(), np.int64)
        feature = (dataset.features or {}).get(label if label is not None else targets)
        names = getattr(feature, "names", None)
        if names is None and feature is not None:
            try:
                names = _class_label(_feature_dict(feature))
            except Exception:  # noqa: BLE001 - names are a convenience, never an error
                names = None
        self.classes = list(names) if names is not None else None
        self._batches = None  # per process: record batches and where they start

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_batches"] = None
        return state

    def row(self, i):
        return int(self.rows[i]) if self.rows is not None else int(i)

    def _layout(self):
        if self._batches is None:
            cols = [self.image] + ([self.targets] if self.targets else [])
            # Batches align the columns' chunks (zero-copy slices of the mapped table).
            batches = self.dataset.data.table.select(cols).to_batches()
            starts = np.zeros(len(batches) + 1, np.int64)
            np.cumsum([b.num_rows for b in batches], out=starts[1:])
            self._batches = (batches, starts)
        return self._batches

    def locate(self, i):
        r = self.row(i)
        _, starts = self._layout()
        g = int(np.searchsorted(starts, r, "right")) - 1
        return g, r - int(starts[g])

    def group_of(self, i):
        return self.locate(i)[0]

    def is_remote_group(self, g):
        return False

    def describe(self, i):
        return f"{self.what}: row {self.row(i)}"

    def group_name(self, g):
        return f"{self.what}: record batch {g}"

    def allows_paths(self, i):
        return True

    def base_folder(self, i):
        return None

    def read_group(self, g, fetch=None):
        batch = self._layout()[0][g]
        return batch.column(0), (batch.column(1) if self.targets else None)


def _feature_dict(feature):
    from datasets import Features

    return Features({"x": feature}).to_dict()["x"]



def objects_targets(cell, box_format, where):
    """A Hugging Face objects cell (``{"bbox": [...], "category": [...]}`` or a list of
    ``{"bbox", "category"}``) as the dict :func:`~echo_native.targets.as_targets` takes,
    boxes turned from ``box_format`` to xyxy.  ValueError naming ``where``."""
    if cell is None:
        raise ValueError(f"{where} is null")
    if isinstance(cell, list):  # a list of objects, each a struct
        if not all(isinstance(o, dict) for o in cell):
            raise ValueError(f"{where}: expected objects with 'bbox' and 'category', got "
                             f"{repr(cell)[:80]}")
        cell = {k: [o.get(k) for o in cell] for k in (cell[0] if cell else {"bbox": 0})}
    if not isinstance(cell, dict):
        raise ValueError(f"{where}: expected {{'bbox': [...], 'category': [...]}}, got "
                         f"{type(cell).__name__}")
    boxes = cell.get("bbox", cell.get("boxes"))
    labels = next((cell[k] for k in ("category", "categories", "label", "labels")
                   if k in cell), None)
    if boxes is None or labels is None:
        raise ValueError(f"{where}: expected fields 'bbox' and 'category', got "
                         f"{sorted(cell)}")
    for k, b in enumerate(boxes):
        if b is None or len(b) != 4:
            raise ValueError(f"{where}: object {k}'s bbox is {repr(b)[:60]}, not 4 numbers")
    if any(v is None for v in labels):
        raise ValueError(f"{where}: object {labels.index(None)}'s category is null")
    b = np.asarray(boxes, np.float64).reshape(-1, 4)
    if box_format == "xywh":
        b = np.concatenate([b[:, :2], b[:, :2] + b[:, 2:]], axis=1)
    elif box_format == "cxcywh":
        b = np.concatenate([b[:, :2] - b[:, 2:] / 2, b[:, :2] + b[:, 2:] / 2], axis=1)
    out = {"boxes": b, "labels": labels}
    crowd = cell.get("iscrowd", cell.get("is_crowd"))
    if crowd is not None:
        out["iscrowd"] = [bool(c) for c in crowd]
    return out

"""Stage 0 of the pipeline: where the bytes come from.

A source is an indexable set of samples: ``len(source)``, ``source.labels``
(an int64 array), ``source.read(i) -> bytes`` and ``source.describe(i)`` (a
path or name for error messages).  Sources are pickled into the worker
processes and ``read`` runs there, never in the consumer.  They hold their
index compactly (packed arrays, not a Python object per sample) so that
shipping one to a worker stays cheap for millions of files.
"""
from __future__ import annotations

import errno
import math
import operator
import os
import threading
import warnings
from pathlib import Path

import numpy as np

from echo_native import prefetch as _prefetch
from echo_native import remote as _remote
from echo_native._checks import IMAGE_EXTENSIONS
from echo_native.errors import ReadLimitError
from echo_native.files import (  # noqa: F401 - DEFAULT_MAX_FILE_BYTES, read_file: named here too
    DEFAULT_MAX_FILE_BYTES,
    _check_max_file_bytes,
    _dir_id,
    _PackedPaths,
    _walk_once,
    read_file,
)
from echo_native.protocol import Source
from echo_native.labels import (  # noqa: F401 - check_labels and _source_name: named here too
    _not_a_label,
    _not_integral,
    _source_name,
    check_labels,
)
from echo_native.targets import MAX_JSON_BYTES, as_targets, targets_from_json

#: Same set as torchvision's ``IMG_EXTENSIONS``.
IMG_EXTENSIONS = IMAGE_EXTENSIONS



#: Most files an ImageFolder lists (``max_samples``): a guard against a tree that
#: lists far more than it should (links fanning out), not a limit real data sets reach.
DEFAULT_MAX_SAMPLES = 50_000_000

#: Largest list file a FileList reads from a URL.
_MAX_LIST_BYTES = 2**31

#: Guards the per-process objects sources create lazily (reader threads may race).
_LAZY = threading.Lock()



def _prefetcher_of(src, create):
    """The calling thread's :class:`~echo_native.prefetch.Prefetcher` of a remote source
    (made on first use when ``create``).  Thread workers share one source, and each
    reads exactly the samples it hinted: one wish list per thread, so that a hint
    never cancels another thread's reads ahead."""
    table = src._prefetchers
    if table is None:
        if not create:
            return None
        with _LAZY:
            if src._prefetchers is None:
                src._prefetchers = {}
            table = src._prefetchers
    me = threading.get_ident()
    pf = table.get(me)
    if pf is None and create:
        pf = table[me] = _prefetch.Prefetcher(src._fetch, src._store.options)
    return pf


class _Files:
    """A source of files named by packed relative paths under ``root`` (a folder or,
    for :class:`FileList`, a URL), or by URLs."""

    root: Path
    labels: np.ndarray
    _paths: _PackedPaths
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    _store = None        # a RemoteStore when some paths are URLs
    _prefetchers = None  # per process and thread, never pickled

    def __len__(self):
        return len(self.labels)

    @property
    def remote_options(self):
        """The RemoteOptions of the object store some paths name, or None (a hook of
        :class:`echo_native.Source`: worker caches count against the memory budget)."""
        return self._store.options if self._store is not None else None

    def path(self, i) -> str:
        p = self._paths[i]
        if self._store is not None and _remote.is_url(p):
            return p
        return os.path.join(self.root, p)

    def describe(self, i) -> str:
        p = self.path(i)
        return _remote.redact(p) if self._store is not None and _remote.is_url(p) else p

    def read(self, i) -> bytes:
        p = self.path(i)
        if self._store is None or not _remote.is_url(p):
            return read_file(p, self.max_file_bytes)
        pf = _prefetcher_of(self, create=False)
        if pf is not None:
            opts = self._store.options
            data = pf.take(i, opts.retry_timeout + 5.0)
            if data is not None:
                return data
        return self._fetch(i)

    def _fetch(self, i):
        return self._store.read_all(self.path(i), self.max_file_bytes, what=self.describe(i))

    def prefetch(self, ids, upcoming=()):
        """Hint: the samples this worker reads next, in order (remote ones are fetched
        ahead).  ``upcoming`` (a guess at the batch after) is not fetched: a wrong guess
        would cost a whole object each."""
        if self._store is None:
            return
        ids = [int(i) for i in ids if _remote.is_url(self.path(int(i)))]
        if not ids:
            return
        opts = self._store.options
        # Sizes are unknown before the response: each counts as an equal share of the budget.
        share = max(1, opts.prefetch_bytes // max(1, opts.prefetch))
        _prefetcher_of(self, create=True).hint(ids, [share] * len(ids))

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_prefetchers", None)
        return state


class ImageFolder(_Files):
    """Class sub-folders to integer labels, ordered exactly as torchvision's ``ImageFolder``.

    ``root/<class>/**/<file>``: classes are the sorted sub-folder names, files
    are walked in sorted order and kept when their extension (any case) is in
    ``extensions``.  ``classes`` and ``class_to_idx`` match torchvision.
    Symbolic links are followed as torchvision does, except that within a class
    each real folder (device, inode) is walked once: a link back up the tree
    (``a/loop -> ..``) or a second link to a folder already listed (links fanning
    out, which torchvision lists once per path: exponentially many) is skipped,
    with one warning saying how many.  A class folder linked from another class
    is still listed in both, as torchvision does.  More than ``max_samples``
    files is a ValueError naming the limit (a guard against a tree that lists
    far more than it holds).  ``read`` refuses non-regular files and files over
    ``max_file_bytes`` (a sample failure naming the file).
    """

    def __init__(self, root, extensions=IMG_EXTENSIONS, max_file_bytes=DEFAULT_MAX_FILE_BYTES,
                 max_samples=DEFAULT_MAX_SAMPLES):
        self.max_file_bytes = _check_max_file_bytes("ImageFolder", max_file_bytes)
        if not isinstance(max_samples, (int, np.integer)) or isinstance(max_samples, bool) \
                or max_samples < 1:
            raise ValueError(f"ImageFolder: max_samples must be a positive integer, got "
                             f"{max_samples!r}")
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"ImageFolder root {str(self.root)!r} is not a directory")
        # One string is one extension, as in torchvision (not a tuple of its letters).
        exts = (extensions,) if isinstance(extensions, str) else tuple(extensions)
        if not exts or not all(isinstance(e, str) and e for e in exts):
            raise TypeError(f"ImageFolder extensions must be a string or strings, got "
                            f"{extensions!r}")
        exts = tuple(e.lower() for e in exts)
        with os.scandir(self.root) as it:
            self.classes = sorted(e.name for e in it if e.is_dir())
        if not self.classes:
            raise ValueError(f"ImageFolder root {str(self.root)!r} has no class sub-folders")
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        paths, labels, skipped = [], [], []
        root_id = _dir_id(self.root)
        for idx, cls in enumerate(self.classes):
            # sorted(os.walk(...)) as torchvision: folders in path-string order
            # ("a/b-c" before "a/b/x"), not depth first.
            walked, found = [], 0
            for dirpath, _, filenames in _walk_once(self.root / cls, {root_id}, skipped):
                images = [n for n in filenames if n.lower().endswith(exts)]
                found += len(images)
                if len(paths) + found > max_samples:  # stops the walk, not only the list
                    raise ValueError(
                        f"ImageFolder root {str(self.root)!r} lists more than max_samples="
                        f"{max_samples:,} files (class {cls!r}, reached in "
                        f"{os.path.relpath(dirpath, self.root)!r}); pass a larger max_samples "
                        f"if the data set really is that large")
                walked.append((dirpath, images))
            for dirpath, images in sorted(walked):
                rel = os.path.relpath(dirpath, self.root)
                for name in sorted(images):
                    paths.append(os.path.join(rel, name))
                    labels.append(idx)
        if skipped:
            shown = [os.path.relpath(p, self.root) for p in skipped[:3]]
            warnings.warn(f"ImageFolder {str(self.root)!r}: {len(skipped)} link(s) to folders "
                          f"already listed in the same class were not followed again "
                          f"({', '.join(repr(p) for p in shown)}"
                          f"{', ...' if len(skipped) > 3 else ''}): each real folder is "
                          f"listed once per class", RuntimeWarning, stacklevel=2)
        if not paths:
            raise ValueError(f"ImageFolder root {str(self.root)!r} holds no files with "
                             f"extensions {', '.join(exts)}")
        self._paths = _PackedPaths(paths)
        self.labels = np.asarray(labels, dtype=np.int64)

    def __repr__(self):
        return f"ImageFolder({str(self.root)!r}, {len(self)} samples, {len(self.classes)} classes)"


class Samples:
    """In-memory samples: a list of encoded images and their labels (tests, small data),
    and optionally their detection ``targets`` (one :class:`~echo_native.targets.Targets`
    or dict per image, checked here)."""

    has_targets = False  # also for subclasses that do not call this __init__

    def __init__(self, blobs, labels=None, names=None, targets=None):
        self._blobs = [bytes(b) for b in blobs]
        if labels is None:
            labels = np.zeros(len(self._blobs), dtype=np.int64)
        if hasattr(labels, "__len__") and len(labels) != len(self._blobs):
            raise ValueError(f"Samples got {len(self._blobs)} images but {len(labels)} labels")
        self.labels = check_labels(self, labels)
        if names is not None and len(names) != len(self._blobs):
            raise ValueError(f"Samples got {len(self._blobs)} images but {len(names)} names")
        self._names = None if names is None else [str(n) for n in names]
        self.has_targets = targets is not None
        if self.has_targets:
            if len(targets) != len(self._blobs):
                raise ValueError(f"Samples got {len(self._blobs)} images but {len(targets)} "
                                 f"targets")
            self._targets = [as_targets(t, f"targets of {self.describe(i)}")
                             for i, t in enumerate(targets)]

    def __len__(self):
        return len(self._blobs)

    def targets(self, i):
        if not self.has_targets:
            raise ValueError(f"{self!r} was made without targets")
        return self._targets[i]

    def describe(self, i) -> str:
        return self._names[i] if self._names else f"<sample {i}>"

    def read(self, i) -> bytes:
        return self._blobs[i]

    def __repr__(self):
        return f"Samples({len(self)} samples)"


def _check_remote_entry(path, scheme, where, list_name):
    """Refuse an entry of a remote list that would leave its store: a local path, a
    ``file://`` URL, or a URL of another scheme."""
    if _remote.is_url(path):
        if path.split("://", 1)[0].lower() == scheme:
            return
        what = f"a {path.split('://', 1)[0]}:// URL"
    elif path.lower().startswith("file:") or os.path.isabs(path) or path.startswith("~"):
        what = "a local path"
    else:
        return  # relative: resolved against the list's location
    shown = path if path.isprintable() and len(path) <= 200 else repr(path[:200])
    raise ValueError(f"{where}: {shown} is {what} in the remote list {list_name}; entries of "
                     f"a list read from {scheme}:// are read from there (relative paths "
                     f"against the list's folder, or {scheme}:// URLs). Pass "
                     f"FileList(..., trust_list=True) to read such entries as given")


def _row_label(path, label, where):
    """A FileList row's label as an int: text is parsed as an integer; a float only with
    an integral value (pandas gives a label column with gaps as floats); a bool is not a
    label.  ``int()`` alone would truncate 1.5 and take True for class 1 without a word."""
    shown = repr(label)[:60]
    value = None
    if isinstance(label, (bool, np.bool_)):
        why = "a bool, not an integer"
    elif isinstance(label, (float, np.floating)):
        f = float(label)
        if math.isfinite(f) and f == int(f):
            value = int(f)
        why = "not an integer (float labels must have integral values: a class index is " \
              "never truncated)"
    elif isinstance(label, str):
        try:
            value = int(label)
        except ValueError:
            pass
        why = "not an integer"
    else:
        try:
            value = operator.index(label)  # int, numpy integers: exact
        except TypeError:
            pass
        why = "not an integer"
    if value is None:
        raise ValueError(f"{where}: label {shown} of {path!r} is {why}")
    if not -2**63 <= value < 2**63:
        raise ValueError(f"{where}: label {shown} of {path!r} does not fit a 64-bit integer")
    return value


class FileList(_Files):
    """Samples listed in a text/CSV file (or given as rows) of ``path,label``.

    Relative paths are resolved against ``root`` (default: the list file's
    folder).  Blank lines and lines starting with ``#`` are ignored; a first
    (non-comment) line ``path,label`` is taken as a header.  Labels are
    64-bit signed integers; in rows given as Python values, a float only with an
    integral value (3.0), and never a bool (a ValueError names the row).  ``read`` refuses non-regular files and files over
    ``max_file_bytes``.

    The list, ``root`` and the listed paths may also be URLs of any fsspec
    protocol (``s3://bucket/train.csv``, rows ``s3://bucket/img/1.jpg,3``):
    each remote sample is one request, fetched ahead and retried as ``remote``
    (a :class:`~echo_native.remote.RemoteOptions`) says; ``storage_options``
    go to fsspec.

    A list read from a URL is data from that store, not instructions for this
    machine: its relative paths resolve against the list's own location, and its
    URLs must be of the list's scheme.  A local path (``/etc/...``, ``file://``)
    or a URL of another scheme in it is refused at construction, naming the line,
    unless ``trust_list=True`` says to read the entries as given.

    ``targets=True``: each image carries detection targets in a JSON file beside
    it, its path less the extension plus ``.json`` (``img/1.jpg`` ->
    ``img/1.json``; :mod:`echo_native.targets`), read by ``targets(i)`` in the
    workers.  A missing or invalid one is that sample's failure, naming the file.
    """

    has_targets = False  # set per instance by targets=

    def __init__(self, path_or_rows, root=None, max_file_bytes=DEFAULT_MAX_FILE_BYTES, *,
                 storage_options=None, remote=None, trust_list=False, targets=False):
        self.max_file_bytes = _check_max_file_bytes("FileList", max_file_bytes)
        self.has_targets = bool(targets)
        if isinstance(path_or_rows, str):
            path_or_rows = _remote.local_path(path_or_rows)
        if isinstance(root, str):
            root = _remote.local_path(root)
        list_url = _remote.is_url(path_or_rows)
        store = None
        if list_url or _remote.is_url(root):
            store = _remote.RemoteStore(storage_options, remote)
        if isinstance(path_or_rows, (str, os.PathLike)):
            if list_url:
                name = _remote.redact(path_or_rows)
                try:
                    text = store.read_all(path_or_rows, _MAX_LIST_BYTES,
                                          limit="the list size limit").decode("utf-8")
                except _remote.RemoteReadError as e:
                    if e.errno == errno.ENOENT and \
                            not isinstance(e, _remote.StoreUnavailableError):
                        raise FileNotFoundError(f"FileList {name!r} does not exist") from None
                    raise
                lines = text.splitlines()
                list_path = name
            else:
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
            if root is not None:
                self.root = root if _remote.is_url(root) else Path(root)
            elif list_url:
                self.root = path_or_rows.split("?", 1)[0].rsplit("/", 1)[0]
            else:
                self.root = list_path.parent
            if list_url and not trust_list:
                scheme = path_or_rows.split("://", 1)[0].lower()
                for path, _, where in rows:
                    _check_remote_entry(path, scheme, where, list_path)
        else:
            rows = [(str(p), lab, f"row {n}") for n, (p, lab) in enumerate(path_or_rows)]
            self.root = (root if _remote.is_url(root) else Path(root)) if root is not None \
                else Path(".")
        if store is None and any(_remote.is_url(p) for p, _, _ in rows):
            store = _remote.RemoteStore(storage_options, remote)
        if store is None and remote is not None and not isinstance(remote,
                                                                   _remote.RemoteOptions):
            raise TypeError(f"remote= must be a RemoteOptions, got {remote!r}")
        self._store = store
        if not rows:
            where = str(path_or_rows) if isinstance(path_or_rows, (str, os.PathLike)) else "rows"
            raise ValueError(f"FileList {where!r} has no samples")
        labels = [_row_label(path, label, where) for path, label, where in rows]
        self._paths = _PackedPaths([p for p, _, _ in rows])
        self.labels = np.asarray(labels, dtype=np.int64)

    def targets(self, i):
        """Sample ``i``'s :class:`~echo_native.targets.Targets`, read from the JSON file
        beside its image (with ``targets=True``); ValueError naming that file when it
        is missing, too large or not valid targets."""
        if not self.has_targets:
            raise ValueError(f"{self!r} was made without targets=True")
        path = self.path(i)
        url = self._store is not None and _remote.is_url(path)
        # A query string (a signed URL) signs the image, not its targets: dropped.
        path = os.path.splitext(path.split("?", 1)[0] if url else path)[0] + ".json"
        where = _remote.redact(path) if url else path
        try:
            if url:
                data = self._store.read_all(path, MAX_JSON_BYTES, what=where,
                                            limit="the targets JSON limit")
            else:
                data = read_file(path, MAX_JSON_BYTES)
        except ReadLimitError as e:
            raise ValueError(f"{where}: {e.strerror}") from None
        except OSError as e:
            if e.errno != errno.ENOENT or isinstance(e, _remote.StoreUnavailableError):
                raise
            raise ValueError(f"{where}: no targets file beside the image "
                             f"{self.describe(i)}") from None
        return targets_from_json(data, where)

    def __repr__(self):
        root = _remote.redact(self.root) if _remote.is_url(self.root) else str(self.root)
        targets = ", targets=True" if self.has_targets else ""
        return f"FileList({len(self)} samples, root={root!r}{targets})"


_SOURCE_KINDS = "en.ImageFolder(root), en.FileList(list, root=...), en.TarShards([...]) or " \
    "en.Samples(blobs, labels)"


def as_source(source, owner="EchoRing"):
    """The source a loader reads, checked at construction so that nothing fails later
    in the workers.

    A folder path (``str`` or ``os.PathLike``) becomes ``ImageFolder(path)``, the
    source a path most often means; any other path, and any object that is not a
    source (``len``, ``labels``, ``read(i)``, ``describe(i)``), is refused here,
    naming the argument and the sources there are."""
    if isinstance(source, (str, bytes, os.PathLike)):
        path = os.fsdecode(source)
        if os.path.isdir(path):
            return ImageFolder(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{owner}: source {path!r} does not exist (a folder path "
                                    f"is read as en.ImageFolder(path))")
        raise TypeError(f"{owner}: source {path!r} is a file, not a folder; a file is read "
                        f"by en.FileList({path!r}, root=...) (a 'path,label' list) or "
                        f"en.TarShards([{path!r}]) (a tar shard)")
    if not isinstance(source, Source):
        missing = [name for name in ("__len__", "labels", "read") if not hasattr(source, name)]
        raise TypeError(f"{owner}: source must be {_SOURCE_KINDS}, or an object with len(), "
                        f"labels and read(i) (and optionally describe(i)); got "
                        f"{type(source).__name__} (no {', '.join(missing)})")
    for name in ("read", "describe"):
        if not callable(getattr(source, name, len)):
            raise TypeError(f"{owner}: source.{name} must be a method, got "
                            f"{type(getattr(source, name)).__name__}")
    return source

"""Object storage under the sources: URLs read through fsspec, by byte range, with retries.

A source that names ``s3://``, ``gs://``, ``http(s)://`` (any fsspec protocol)
holds a :class:`RemoteStore` and reads through it.  Three things make remote
reads behave like local ones inside a pipeline:

* Filesystems are opened lazily in each process and never pickled: a source is
  pickled into worker processes, and a live connection pool (or an event loop
  thread) cannot cross that boundary, exactly as an open file descriptor cannot.
* Every call is bounded: a per-request timeout, retries with exponential backoff
  on transient errors (5xx, a reset or refused connection, a timeout) up to a
  number of attempts and a total time, and no retry on permanent ones (403, 404,
  a bad range).  Whatever fails ends as a :class:`RemoteReadError` (an
  ``OSError``) naming the object, which the workers' ``on_error`` policy handles
  like any unreadable file.
* Tar shards are read in large blocks (many samples per request), kept in a
  small per-process :class:`BlockCache` bounded in bytes and fetched ahead on a
  few threads while the worker decodes; separate objects (a file list) are
  fetched ahead one request each by a :class:`Prefetcher`.  Both are bounded
  in requests and bytes in flight.

Credentials come from wherever fsspec and its backend take them (environment,
config files, instance roles); nothing here logs them, and every URL shown in a
message has its user info and query string removed (:func:`redact`).

fsspec is imported only when a URL is used: local data never needs it.
"""
from __future__ import annotations

import copy
import errno
import os
import random
import re
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from echo_native.errors import ReadLimitError

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")


def is_url(location) -> bool:
    """True for ``scheme://...`` other than ``file://`` (which is read as a local path)."""
    if not isinstance(location, str):
        return False
    m = _SCHEME.match(location)
    return bool(m) and m.group(1).lower() != "file"


def local_path(location):
    """``file:///x`` -> ``/x``; anything else unchanged (a str or os.PathLike)."""
    if isinstance(location, str) and location[:7].lower() == "file://":
        from urllib.parse import unquote, urlsplit

        return unquote(urlsplit(location).path)
    return location


def redact(url: str) -> str:
    """``url`` without user info, query string or fragment: safe to show and log."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _redact_text(text: str) -> str:
    """Every URL inside ``text`` redacted (backends put request URLs in their messages)."""
    return _URL_IN_TEXT.sub(lambda m: redact(m.group(0)), text)


class RemoteReadError(OSError):
    """Reading an object failed for good: a permanent error (403, 404, a deleted
    object) or transient errors that outlasted the retry budget.

    ``filename`` names the object (its URL, redacted, and the member key where
    there is one), ``strerror`` says what went wrong; ``str()`` is both."""

    def __str__(self):
        return f"{self.filename}: {self.strerror}" if self.filename else str(self.strerror)


@dataclass(frozen=True)
class RemoteOptions:
    """How a source reads from object storage (ignored for local files).

    Parameters
    ----------
    prefetch : int
        Samples each worker process keeps in flight ahead of the one it decodes
        (0: no prefetch, every read waits for its request).
    prefetch_bytes : int
        Bytes those samples may hold at once (fetched but not yet decoded, or on
        their way); a sample bigger than the budget is read when it is needed.
    threads : int
        Fetch threads per process.
    attempts : int
        Tries per request, the first included (transient errors only).
    retry_timeout : float
        Seconds one read may spend in total, retries and backoff included.  Keep
        it under the pipeline's ``sample_timeout`` (60 s by default), which would
        otherwise replace the worker first.
    request_timeout : float
        Seconds one request may take.
    backoff, max_backoff : float
        The first retry waits about ``backoff`` seconds, doubling up to ``max_backoff``
        (with jitter, so workers that failed together do not retry together).
    block_bytes : int
        Tar shards are read in blocks of at most this many bytes, one request
        each, cut at sample boundaries (a sample never straddles two blocks; one
        larger than a block is read on its own).  0: one request per sample.
    cache_bytes : int
        Bytes of blocks each worker process keeps (least recently used dropped
        first).  Must be at least ``block_bytes``.  Samples shuffled together
        (``TarShards``'s ``shuffle_buffer`` consecutive samples) should fit in it,
        or blocks are read again.
    """

    prefetch: int = 16
    prefetch_bytes: int = 64 * 2**20
    threads: int = 4
    attempts: int = 8
    retry_timeout: float = 45.0
    request_timeout: float = 20.0
    backoff: float = 0.1
    max_backoff: float = 5.0
    block_bytes: int = 8 * 2**20
    cache_bytes: int = 128 * 2**20

    def __post_init__(self):
        for name in ("prefetch", "prefetch_bytes", "threads", "attempts", "block_bytes",
                     "cache_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"RemoteOptions: {name} must be a non-negative integer, "
                                 f"got {v!r}")
        if self.threads < 1 or self.attempts < 1:
            raise ValueError(f"RemoteOptions: threads and attempts must be >= 1, got "
                             f"threads={self.threads}, attempts={self.attempts}")
        for name in ("retry_timeout", "request_timeout", "backoff", "max_backoff"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
                raise ValueError(f"RemoteOptions: {name} must be a number >= 0, got {v!r}")
        if not self.request_timeout > 0 or not self.retry_timeout > 0:
            raise ValueError("RemoteOptions: request_timeout and retry_timeout must be > 0")
        if self.block_bytes and self.cache_bytes < self.block_bytes:
            raise ValueError(f"RemoteOptions: cache_bytes ({self.cache_bytes}) must hold at "
                             f"least one block (block_bytes={self.block_bytes})")


# Errors that no retry can fix.  Everything else (5xx as EIO/EBUSY/EREMOTEIO, a
# refused or reset connection, a timeout, a backend's own exception types) is
# worth another try while the budget lasts.
_PERMANENT_ERRNOS = {errno.EINVAL, errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOSYS,
                     errno.ENAMETOOLONG, errno.EISDIR, errno.ENOTDIR, errno.EFBIG}


def is_permanent(e: BaseException) -> bool:
    """True when retrying ``e`` cannot help (a missing or forbidden object, a bad request)."""
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError,
                      NotADirectoryError, ReadLimitError, RemoteReadError)):
        return True
    if isinstance(e, (ValueError, TypeError, NotImplementedError)):
        return True
    if isinstance(e, (TimeoutError, ConnectionError)):
        return False
    if isinstance(e, OSError) and e.errno in _PERMANENT_ERRNOS:
        return True
    status = getattr(e, "status", None) or getattr(e, "status_code", None)
    if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
        return True
    return False


def _error_text(e: BaseException) -> str:
    if isinstance(e, FileNotFoundError):
        what = "no such object (deleted?)"
    elif isinstance(e, PermissionError):
        what = "access denied"
    else:
        what = type(e).__name__
    detail = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    detail = " ".join(_redact_text(detail).split())[:300]
    return f"{what}: {detail}" if detail else what


def _errno_of(e):
    if isinstance(e, FileNotFoundError):
        return errno.ENOENT
    if isinstance(e, PermissionError):
        return errno.EACCES
    return errno.EIO


class RemoteStore:
    """fsspec filesystems for URLs, one per protocol, opened lazily in each process.

    ``storage_options`` go to the filesystem as given (e.g. ``{"endpoint_url":
    ..., "anon": True}`` for s3fs).  Pickles without its filesystems.
    """

    def __init__(self, storage_options=None, options=None):
        self.storage_options = dict(storage_options or {})
        self.options = options if options is not None else RemoteOptions()
        if not isinstance(self.options, RemoteOptions):
            raise TypeError(f"remote= must be a RemoteOptions, got {self.options!r}")
        self._fs = {}
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_fs"], state["_lock"] = {}, None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def __repr__(self):  # never the storage options: they may hold credentials
        return f"RemoteStore({sorted(self.storage_options)!r} options)"

    # -- filesystems -------------------------------------------------------------------
    def filesystem(self, url):
        """(fs, path inside it) for ``url``; the filesystem is created once per process."""
        try:
            import fsspec
        except ImportError:
            raise ImportError(f"reading {redact(url)} needs fsspec (and its backend, e.g. "
                              f"s3fs for s3://): pip install 'echo_native[remote]'") from None
        protocol = url.split("://", 1)[0].lower()
        with self._lock:
            if self._pid != os.getpid():  # a fork: the parent's connections are not ours
                self._fs, self._pid = {}, os.getpid()
            fs = self._fs.get(protocol)
            if fs is None:
                cls = fsspec.get_filesystem_class(protocol)
                fs = cls(**self._options_for(protocol))
                self._fs[protocol] = fs
        return fs, fs._strip_protocol(url)

    def _options_for(self, protocol):
        opts = dict(self.storage_options)
        if protocol in ("s3", "s3a"):
            # Bound every request inside botocore as well (its defaults are 60 s each).
            config = dict(opts.get("config_kwargs") or {})
            config.setdefault("connect_timeout", min(10.0, self.options.request_timeout))
            config.setdefault("read_timeout", self.options.request_timeout)
            opts["config_kwargs"] = config
        return opts

    def _call(self, fs, method, *args, **kwargs):
        from fsspec.asyn import AsyncFileSystem

        if isinstance(fs, AsyncFileSystem) and not fs.asynchronous:
            # fsspec's sync() bounds the wait on its event loop thread.
            kwargs["timeout"] = self.options.request_timeout
        return getattr(fs, method)(*args, **kwargs)

    # -- calls with retries ------------------------------------------------------------
    def retrying(self, what, fn, passthrough=()):
        """``fn()`` with the retry policy; failures become a RemoteReadError about ``what``
        (except those of the ``passthrough`` types, raised as they are)."""
        opts = self.options
        start = time.monotonic()
        deadline = start + opts.retry_timeout
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - every backend error is classified
                if isinstance(e, (RemoteReadError, ReadLimitError) + tuple(passthrough)):
                    raise
                if is_permanent(e):
                    raise RemoteReadError(_errno_of(e), _error_text(e), what) from None
                wait = min(opts.max_backoff, opts.backoff * 2 ** (attempt - 1))
                wait *= 0.5 + 0.5 * random.random()
                now = time.monotonic()
                if attempt >= opts.attempts or now + wait >= deadline:
                    raise RemoteReadError(
                        errno.EIO, f"gave up after {attempt} tries in {now - start:.1f} s; "
                                   f"last error {_error_text(e)}", what) from None
                time.sleep(wait)

    def read_range(self, url, start, end, what=None):
        """Bytes ``[start, end)`` of the object at ``url``."""
        what = what or redact(url)

        def once():
            fs, path = self.filesystem(url)
            return self._call(fs, "cat_file", path, start=start, end=end)
        data = self.retrying(what, once)
        if len(data) != end - start:
            raise RemoteReadError(errno.EIO, f"short read: {len(data)} of {end - start} "
                                             f"bytes (object changed?)", what)
        return data

    def read_all(self, url, max_bytes, what=None):
        """The whole object at ``url``, refused (ReadLimitError) when over ``max_bytes``."""
        what = what or redact(url)

        def once():
            fs, path = self.filesystem(url)
            return self._call(fs, "cat_file", path, start=0, end=max_bytes + 1)
        data = self.retrying(what, once)
        if len(data) > max_bytes:
            raise ReadLimitError(errno.EFBIG, f"over the limit max_file_bytes={max_bytes}")
        return data

    def info(self, url):
        """``{"size": int, "etag": str or None}`` of the object at ``url``."""
        def once():
            fs, path = self.filesystem(url)
            info = self._call(fs, "info", path)
            if info.get("type") == "directory":
                raise IsADirectoryError(errno.EISDIR, "is a directory")
            return info
        info = self.retrying(redact(url), once)
        etag = info.get("ETag") or info.get("etag") or info.get("md5Hash") or info.get("mtime")
        size = info.get("size")
        return {"size": None if size is None else int(size),
                "etag": None if etag is None else str(etag)}

    def put_file(self, local, url):
        """Upload the local file ``local`` to ``url`` (an object appears whole or not at all)."""
        def once():
            fs, path = self.filesystem(url)
            return fs.put_file(local, path)
        self.retrying(f"uploading to {redact(url)}", once)

    def put_bytes(self, data, url):
        """Write the small object ``url`` holding ``data``."""
        def once():
            fs, path = self.filesystem(url)
            return fs.pipe_file(path, data)
        self.retrying(f"uploading to {redact(url)}", once)

    def open(self, url, **kwargs):
        """A file object for streaming ``url`` (scanning a shard's headers)."""
        fs, path = self.filesystem(url)
        return fs.open(path, "rb", **kwargs)


# ---- prefetch ---------------------------------------------------------------------
class Prefetcher:
    """Fetches hinted samples ahead on a few daemon threads, bounded in count and bytes.

    ``hint(ids, sizes)`` replaces the wish list (a worker's next samples, in the
    order it will read them); ``take(i)`` returns the fetched bytes of ``i`` (or
    raises what fetching it raised), or None when ``i`` was not prefetched and
    the caller should read it itself.  Samples hinted but never taken (a batch
    abandoned under ``on_error="raise"``) are dropped at the next hint.
    Threads are daemons: a blocked request never keeps a worker process from
    exiting.
    """

    def __init__(self, fetch, options: RemoteOptions):
        self._fetch, self.options = fetch, options
        self._lock = threading.RLock()
        self._wanted = deque()     # (id, size) hinted, not yet started
        self._held = {}            # id -> (future, size): started, not yet taken
        self._bytes = 0            # sizes of the held ones
        self._jobs = deque()
        self._ready = threading.Condition(self._lock)
        self._threads = []
        self._idle = 0             # threads waiting for a job

    def hint(self, ids, sizes):
        if self.options.prefetch == 0:
            return
        with self._lock:
            self._wanted = deque()  # first, so that releases below start nothing stale
            keep = set(ids)
            for i in [i for i in self._held if i not in keep]:
                self._drop(i)
            self._wanted = deque((i, s) for i, s in zip(ids, sizes) if i not in self._held)
            self._start_more()

    def take(self, i, timeout):
        with self._lock:
            entry = self._held.pop(i, None)
            if entry is None:
                return None
        fut, size = entry
        try:
            return fut.result(timeout)
        except FutureTimeout:
            raise RemoteReadError(errno.ETIMEDOUT, f"prefetch did not finish in "
                                                   f"{timeout:.0f} s", f"sample {i}") from None
        finally:
            fut.add_done_callback(lambda _f: self._release(size))

    def _drop(self, i):
        fut, size = self._held.pop(i)
        fut.cancel()
        fut.add_done_callback(lambda _f: self._release(size))

    def _release(self, size):
        with self._lock:
            self._bytes -= size
            self._start_more()

    def _start_more(self):
        opts = self.options
        while self._wanted and len(self._held) < opts.prefetch:
            i, size = self._wanted[0]
            if size > opts.prefetch_bytes:
                self._wanted.popleft()  # over the whole budget: read when it is needed
                continue
            if self._bytes + size > opts.prefetch_bytes:
                break  # resumes when taken samples give their bytes back
            self._wanted.popleft()
            fut = Future()
            self._held[i] = (fut, size)
            self._bytes += size
            self._jobs.append((fut, i))
            self._ready.notify()
        # One new thread for each job that no idle thread will take, up to the limit.
        for _ in range(min(opts.threads - len(self._threads), len(self._jobs) - self._idle)):
            t = threading.Thread(target=self._run, name="echo_native-prefetch", daemon=True)
            self._threads.append(t)
            t.start()

    def _run(self):
        while True:
            with self._lock:
                while not self._jobs:
                    self._idle += 1
                    woken = self._ready.wait(timeout=30.0)
                    self._idle -= 1
                    if not woken and not self._jobs:
                        self._threads.remove(threading.current_thread())
                        return  # idle: a thread comes back with the next job
                fut, i = self._jobs.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(self._fetch(i))
            except BaseException as e:  # noqa: BLE001 - handed to take()
                fut.set_exception(e)


# ---- blocks ------------------------------------------------------------------------
class BlockCache:
    """Blocks of objects (byte ranges holding many samples) for one process: a
    least-recently-used cache bounded by ``options.cache_bytes``, filled on demand
    or ahead of time.

    ``fetch(key)`` reads block ``key`` (a hashable naming an object and a byte
    range) and returns its bytes.  ``get(key, size, timeout)`` returns a block
    from the cache, from a fetch already under way (waiting at most
    ``timeout``), or else by fetching it in the calling thread.  ``hint(blocks)``
    names the blocks the calling thread will need next, in order, as ``(key,
    size)`` pairs; those not cached are fetched on daemon threads, with at most
    ``options.threads`` requests and ``options.prefetch_bytes`` bytes in flight.
    Hints beyond what the cache holds are left out (they would push out blocks
    still to be read).  A block whose fetch failed is remembered for
    ``options.retry_timeout`` seconds: its other samples fail at once with the
    same error instead of each trying it again.

    Memory: at most ``cache_bytes`` cached, plus blocks in flight (at most
    ``prefetch_bytes`` fetched ahead, plus the one each reading thread may be
    fetching itself).
    """

    _MAX_FAILED = 1024

    def __init__(self, fetch, options: RemoteOptions):
        self._fetch, self.options = fetch, options
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._cache = OrderedDict()   # key -> bytes, least recently used first
        self.cached_bytes = 0
        self.peak_bytes = 0           # most bytes ever cached at once
        self._flying = {}             # key -> (future, size): being fetched
        self.flying_bytes = 0
        self._failed = OrderedDict()  # key -> (exception, time it failed)
        self._wanted = {}             # hinting thread -> deque of (key, size) not started
        self._jobs = deque()
        self._threads = []
        self._idle = 0
        self.requests = 0             # blocks fetched, failed ones included

    def get(self, key, size, timeout):
        with self._lock:
            data = self._cache.get(key)
            if data is not None:
                self._cache.move_to_end(key)
                return data
            failed = self._failure(key)
            if failed is not None:
                raise copy.copy(failed)  # a new object: the cached one's traceback stays short
            entry = self._flying.get(key)
            mine = entry is None
            if mine:
                fut = Future()
                self._flying[key] = (fut, size)
                self.flying_bytes += size
            else:
                fut = entry[0]
        if mine:
            self._run_fetch(key, size, fut)
        try:
            return fut.result(timeout)
        except FutureTimeout:
            raise RemoteReadError(errno.ETIMEDOUT, f"block fetch did not finish in "
                                                   f"{timeout:.0f} s", None) from None

    def hint(self, blocks):
        if self.options.prefetch == 0:
            return
        me = threading.get_ident()
        with self._lock:
            hinting = len(self._wanted) + (me not in self._wanted)
            budget = self.options.cache_bytes // hinting
            wanted, total = deque(), 0
            for key, size in blocks:
                if total + size > budget:
                    break
                total += size
                if key in self._cache:
                    self._cache.move_to_end(key)
                elif key not in self._flying and self._failure(key) is None:
                    wanted.append((key, size))
            self._wanted[me] = wanted
            self._start_more()

    def _failure(self, key):
        entry = self._failed.get(key)
        if entry is None:
            return None
        if time.monotonic() - entry[1] < self.options.retry_timeout:
            return entry[0]
        del self._failed[key]
        return None

    def _run_fetch(self, key, size, fut):
        try:
            data = self._fetch(key)
        except BaseException as e:  # noqa: BLE001 - handed to every reader of the block
            self._finish(key, size, fut, None, e)
        else:
            self._finish(key, size, fut, data, None)

    def _finish(self, key, size, fut, data, exc):
        with self._lock:
            self._flying.pop(key, None)
            self.flying_bytes -= size
            self.requests += 1
            if exc is None:
                self._insert(key, data)
            else:
                self._failed[key] = (exc, time.monotonic())
                while len(self._failed) > self._MAX_FAILED:
                    self._failed.popitem(last=False)
            self._start_more()
        if exc is None:
            fut.set_result(data)
        else:
            fut.set_exception(exc)

    def _insert(self, key, data):
        n, limit = len(data), self.options.cache_bytes
        if n > limit:
            return
        old = self._cache.pop(key, None)
        if old is not None:
            self.cached_bytes -= len(old)
        while self._cache and self.cached_bytes + n > limit:
            self.cached_bytes -= len(self._cache.popitem(last=False)[1])
        self._cache[key] = data
        self.cached_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.cached_bytes)

    def _start_more(self):
        opts = self.options
        progressed = True
        while progressed and len(self._flying) < opts.threads:
            progressed = False
            for who, wanted in list(self._wanted.items()):
                while wanted and (wanted[0][0] in self._cache or wanted[0][0] in self._flying):
                    wanted.popleft()
                if not wanted:
                    del self._wanted[who]
                    continue
                key, size = wanted[0]
                if size > opts.prefetch_bytes:
                    wanted.popleft()  # over the whole budget: read when it is needed
                    progressed = True
                    continue
                if self.flying_bytes + size > opts.prefetch_bytes or \
                        len(self._flying) >= opts.threads:
                    continue
                wanted.popleft()
                fut = Future()
                self._flying[key] = (fut, size)
                self.flying_bytes += size
                self._jobs.append((key, size, fut))
                self._ready.notify()
                progressed = True
        while len(self._jobs) > self._idle and len(self._threads) < opts.threads:
            t = threading.Thread(target=self._run, name="echo_native-blocks", daemon=True)
            self._threads.append(t)
            self._idle += 1  # counted idle until it takes a job
            t.start()

    def _run(self):
        me = threading.current_thread()
        while True:
            with self._lock:
                while not self._jobs:
                    if not self._ready.wait(timeout=30.0) and not self._jobs:
                        self._idle -= 1
                        self._threads.remove(me)
                        return  # idle: a thread comes back with the next job
                key, size, fut = self._jobs.popleft()
                self._idle -= 1
            self._run_fetch(key, size, fut)
            with self._lock:
                self._idle += 1

"""Object storage under the sources: URLs read through fsspec, by byte range, with retries.

A source that names ``s3://``, ``gs://``, ``http(s)://`` (any fsspec protocol)
holds a :class:`RemoteStore` and reads through it.  Three things make remote
reads behave like local ones inside a pipeline:

* Filesystems are opened lazily in each process and never pickled: a source is
  pickled into worker processes, and a live connection pool (or an event loop
  thread) cannot cross that boundary, exactly as an open file descriptor cannot.
* Every call is bounded in time: retries with exponential backoff on transient
  errors (5xx, a reset or refused connection, a timeout) within a number of
  attempts and one total budget that includes the request in flight (each try
  gets at most what is left of it), and no retry on permanent ones (403, 404, a
  bad range).  Whatever fails ends as a :class:`RemoteReadError` (an ``OSError``)
  naming the object, which the workers' ``on_error`` policy handles like any
  unreadable file; when no try reached the store at all (connection refused,
  no such host), the store is down, not the object, and the error is a
  :class:`StoreUnavailableError`, which stops a run whatever ``on_error`` says.
* Every read is bounded in bytes: :meth:`RemoteStore.read_range` and
  :meth:`RemoteStore.read_all` are the one read every remote path goes through,
  and they stop reading a response at the bytes asked for (+ one byte, to see
  that there is more), whatever the server sends: a server that ignores
  ``Range`` and streams a huge body costs at most the limit plus one chunk of
  memory.
* Tar shards are read in large blocks (many samples per request), kept in a
  small per-process block cache bounded in bytes and fetched ahead on a few
  threads while the worker decodes; separate objects (a file list) are fetched
  ahead one request each (:mod:`echo_native.prefetch`).

Credentials come from wherever fsspec and its backend take them (environment,
config files, instance roles); nothing here logs them, and every URL shown in a
message has its user info and query string removed (:func:`redact`).

fsspec is imported only when a URL is used: local data never needs it.
"""
from __future__ import annotations

import copy
import errno
import io
import os
import random
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from echo_native.errors import ReadLimitError
from echo_native.remote_errors import (RemoteReadError, StoreUnavailableError, _errno_of,
                                       _error_text, _is_timeout, _status, is_permanent,
                                       is_url, local_path, redact, unreachable)

__all__ = ["RemoteOptions", "RemoteStore", "RemoteReadError", "StoreUnavailableError",
           "is_url", "local_path", "redact"]

#: A response body is read this much at a time: a read stops at most this far past
#: the bytes it asked for, whatever the server sends.
READ_CHUNK = 1 << 20


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
        Seconds one read may take in all: every try, the request in flight
        included (a try gets at most what is left), and the backoff between them.
        Keep it well under the pipeline's ``sample_timeout`` (60 s by default),
        which would otherwise replace the worker first.
    request_timeout : float
        Seconds one request may take (less when less of ``retry_timeout`` is left).
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
    retry_timeout: float = 25.0
    request_timeout: float = 10.0
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
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0 \
                    or v == float("inf"):
                raise ValueError(f"RemoteOptions: {name} must be a finite number >= 0, "
                                 f"got {v!r}")
        if not self.request_timeout > 0 or not self.retry_timeout > 0:
            raise ValueError("RemoteOptions: request_timeout and retry_timeout must be > 0")
        if self.block_bytes and self.cache_bytes < self.block_bytes:
            raise ValueError(f"RemoteOptions: cache_bytes ({self.cache_bytes}) must hold at "
                             f"least one block (block_bytes={self.block_bytes})")


# Errors that no retry can fix.  Everything else (5xx as EIO/EBUSY/EREMOTEIO, a
# refused or reset connection, a timeout, a backend's own exception types) is
# worth another try while the budget lasts.
class _Answer:
    """What one bounded GET brought back: ``data`` (at most the bytes asked for plus
    one), whether the server answered with the range (``partial``), and, for a
    range it could not satisfy (HTTP 416), ``empty``."""

    __slots__ = ("data", "partial", "empty")

    def __init__(self, data, partial, empty=False):
        self.data, self.partial, self.empty = data, partial, empty


async def _read_body(read, most):
    """At most ``most`` bytes from an async ``read(n)`` (which returns b"" at the end)."""
    chunks, got = [], 0
    while got < most:
        chunk = await read(min(READ_CHUNK, most - got))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


async def _http_get(fs, url, start, last, most):
    """GET bytes ``start..last`` (inclusive) of ``url`` through fsspec's HTTP session,
    reading at most ``most`` bytes of the body."""
    session = await fs.set_session()
    kw = dict(fs.kwargs)
    headers = dict(kw.pop("headers", None) or {})
    headers["Range"] = f"bytes={start}-{last}"
    encode = getattr(fs, "encode_url", None)
    async with session.get(encode(url) if encode else url, headers=headers, **kw) as r:
        if r.status == 416:
            return _Answer(b"", False, empty=True)
        if r.status in (404, 410):
            raise FileNotFoundError(errno.ENOENT, f"HTTP {r.status} {r.reason or ''}".strip())
        r.raise_for_status()
        partial = r.status == 206
        # Leaving the block without reading the rest closes the connection: a body
        # larger than asked is never drained.
        return _Answer(await _read_body(r.content.read, most), partial)


async def _s3_get(fs, path, start, last, most):
    """The same for s3fs: get_object with a Range, its body read at most ``most`` bytes."""
    bucket, key, version = fs.split_path(path)
    kw = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{last}"}
    if version:
        kw["VersionId"] = version
    try:
        resp = await fs._call_s3("get_object", **kw)
    except OSError as e:
        if "InvalidRange" in str(e) or _status(e.__cause__) == 416:
            return _Answer(b"", False, empty=True)
        raise
    body = resp["Body"]
    try:
        partial = bool(resp.get("ContentRange"))
        return _Answer(await _read_body(body.read, most), partial)
    finally:
        body.close()


class RangeReader(io.RawIOBase):
    """A seekable raw file of ``size`` bytes whose reads are ranges ``_range(start,
    end)`` (a subclass's): what a buffered reader, a tar scan or pyarrow reads through."""

    def __init__(self, size):
        super().__init__()
        self._size, self._pos = size, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self._pos

    def seek(self, offset, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b):
        end = min(self._size, self._pos + len(b))
        if end <= self._pos:
            return 0
        data = self._range(self._pos, end)
        n = len(data)
        b[:n] = data
        self._pos += n
        return n

    def _range(self, start, end):
        raise NotImplementedError


class _RangeFile(RangeReader):
    """A remote object as a seekable raw file, every read one bounded range request
    through the store's retries: what a tar header scan reads through a buffer."""

    def __init__(self, store, url, size, what):
        super().__init__(size)
        self._store, self._url, self._what = store, url, what

    def _range(self, start, end):
        return self._store.read_range(self._url, start, end,
                                      what=f"{self._what} bytes {start}-{end}")


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

    def endpoint(self, url):
        """The store ``url`` lives in, as an error names it: the configured endpoint
        (S3-compatible servers) or the URL's scheme and host, redacted."""
        from urllib.parse import urlsplit

        configured = self.storage_options.get("endpoint_url") or (
            self.storage_options.get("client_kwargs") or {}).get("endpoint_url")
        if isinstance(configured, str) and configured:
            return redact(configured)
        parts = urlsplit(url)
        return redact(f"{parts.scheme}://{parts.netloc}")

    def _call(self, fs, method, *args, timeout=None, **kwargs):
        from fsspec.asyn import AsyncFileSystem

        if isinstance(fs, AsyncFileSystem) and not fs.asynchronous:
            # fsspec's sync() bounds the wait on its event loop thread (and cancels
            # the request when it is over).
            kwargs["timeout"] = timeout or self.options.request_timeout
        return getattr(fs, method)(*args, **kwargs)

    # -- calls with retries ------------------------------------------------------------
    def retrying(self, what, fn, passthrough=(), url=None):
        """``fn(timeout)`` with the retry policy, ``timeout`` being what the try may
        take: ``request_timeout``, or less when less of ``retry_timeout`` is left (the
        budget includes the request in flight).  Failures become a RemoteReadError
        about ``what`` (except those of the ``passthrough`` types, raised as they
        are); when no try reached the store of ``url``, a StoreUnavailableError."""
        opts = self.options
        start = time.monotonic()
        deadline = start + opts.retry_timeout
        attempt, all_unreachable = 0, True
        while True:
            attempt += 1
            timeout = min(opts.request_timeout, deadline - time.monotonic())
            try:
                if timeout <= 0:
                    raise TimeoutError("retry budget spent")
                return fn(timeout)
            except Exception as e:  # noqa: BLE001 - every backend error is classified
                if isinstance(e, (RemoteReadError, ReadLimitError) + tuple(passthrough)):
                    raise
                if is_permanent(e):
                    raise RemoteReadError(_errno_of(e), _error_text(e), what) from None
                all_unreachable = all_unreachable and unreachable(e)
                wait = min(opts.max_backoff, opts.backoff * 2 ** (attempt - 1))
                wait *= 0.5 + 0.5 * random.random()
                now = time.monotonic()
                if attempt >= opts.attempts or now + wait >= deadline:
                    tries = f"{attempt} {'try' if attempt == 1 else 'tries'}"
                    if all_unreachable and url is not None:
                        where = self.endpoint(url)
                        raise StoreUnavailableError(
                            errno.ECONNREFUSED if "refused" in _error_text(e)
                            else errno.EHOSTUNREACH,
                            f"the store at {where} is unreachable ({_error_text(e)}); gave up "
                            f"after {tries} in {now - start:.1f} s (retry_timeout="
                            f"{opts.retry_timeout:g} s)", what, where) from None
                    raise RemoteReadError(
                        errno.ETIMEDOUT if _is_timeout(e) else errno.EIO,
                        f"gave up after {tries} in {now - start:.1f} s (retry_timeout="
                        f"{opts.retry_timeout:g} s); last error {_error_text(e, timeout)}",
                        what) from None
                time.sleep(wait)

    def _get(self, url, start, last, most, timeout):
        """One bounded GET of bytes ``start..last`` (inclusive): an :class:`_Answer`
        holding at most ``most`` bytes of the body, however much the server sends.

        HTTP(S) and S3 stream the body and stop; other fsspec backends are asked for
        the range through ``cat_file`` (bounded as far as the backend honours it)."""
        fs, path = self.filesystem(url)
        from fsspec.asyn import AsyncFileSystem, sync

        kind = type(fs).__module__.split(".")[0]
        if isinstance(fs, AsyncFileSystem) and not fs.asynchronous:
            if type(fs).__name__ == "HTTPFileSystem" and hasattr(fs, "set_session"):
                return sync(fs.loop, _http_get, fs, url, start, last, most, timeout=timeout)
            if kind == "s3fs" and hasattr(fs, "_call_s3") and hasattr(fs, "split_path"):
                return sync(fs.loop, _s3_get, fs, path, start, last, most, timeout=timeout)
        data = self._call(fs, "cat_file", path, start=start, end=last + 1, timeout=timeout)
        return _Answer(data[:most], True)

    def read_range(self, url, start, end, what=None):
        """Bytes ``[start, end)`` of the object at ``url``: never more read, and an error
        when the server sends anything else (fewer bytes: the object changed; more,
        or the start of the object for a range further in: it ignored ``Range``)."""
        what = what or redact(url)
        want = end - start
        if want <= 0:
            return b""

        def once(timeout):
            return self._get(url, start, end - 1, want + 1, timeout)
        ans = self.retrying(what, once, url=url)
        if start and not ans.partial and not ans.empty:
            raise RemoteReadError(errno.EINVAL, f"the server ignored the byte range "
                                                f"{start}-{end - 1} (it sent the object from "
                                                f"its start): reading parts of an object needs "
                                                f"a server that honours Range requests", what)
        data = ans.data
        if len(data) > want and ans.partial:
            raise RemoteReadError(errno.EIO, f"the server sent more than the {want} bytes "
                                             f"asked for", what)
        data = data[:want]  # a whole object sent for a range from its start: its head
        if len(data) != want:
            raise RemoteReadError(errno.EIO, f"short read: {len(data)} of {want} bytes "
                                             f"(object changed?)", what)
        return data

    def read_all(self, url, max_bytes, what=None, limit="max_file_bytes"):
        """The whole object at ``url``, refused (ReadLimitError) when over ``max_bytes``,
        which is also the most ever read of it (+ one byte): ``limit`` names the setting
        in that error."""
        what = what or redact(url)

        def once(timeout):
            return self._get(url, 0, max_bytes, max_bytes + 1, timeout)
        ans = self.retrying(what, once, url=url)
        if len(ans.data) > max_bytes:
            raise ReadLimitError(errno.EFBIG, f"over the limit {limit}={max_bytes}")
        return ans.data

    def info(self, url):
        """``{"size": int, "etag": str or None}`` of the object at ``url``."""
        def once(timeout):
            fs, path = self.filesystem(url)
            info = self._call(fs, "info", path, timeout=timeout)
            if info.get("type") == "directory":
                raise IsADirectoryError(errno.EISDIR, "is a directory")
            return info
        info = self.retrying(redact(url), once, url=url)
        etag = info.get("ETag") or info.get("etag") or info.get("md5Hash") or info.get("mtime")
        size = info.get("size")
        return {"size": None if size is None else int(size),
                "etag": None if etag is None else str(etag)}

    def put_file(self, local, url):
        """Upload the local file ``local`` to ``url`` (an object appears whole or not at all)."""
        def once(timeout):
            fs, path = self.filesystem(url)
            return fs.put_file(local, path)
        self.retrying(f"uploading to {redact(url)}", once, url=url)

    def put_bytes(self, data, url):
        """Write the small object ``url`` holding ``data``."""
        def once(timeout):
            fs, path = self.filesystem(url)
            return fs.pipe_file(path, data)
        self.retrying(f"uploading to {redact(url)}", once, url=url)

    def open(self, url, size, what=None, block_bytes=8 * 2**20):
        """``url`` (of ``size`` bytes) as a seekable, buffered file whose every read is
        one bounded range request of about ``block_bytes`` (scanning a shard's headers)."""
        return io.BufferedReader(_RangeFile(self, url, size, what or redact(url)),
                                 buffer_size=block_bytes)


def _result(fut, timeout):
    """``fut.result(timeout)``, raising a copy of the fetch's error rather than the error
    itself.  The stored one stays with the future, which a fetch thread may hold a while:
    raised through this thread, it would carry a traceback of this thread's frames, and
    keep them, and everything they refer to (a worker's ring), alive with it."""
    try:
        return fut.result(timeout)
    except FutureTimeout:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised, as a copy when it can be made
        # Drop what raising it here just attached: this thread's frames, and the error
        # this thread was handling (a stand-in is read while a failure is handled).
        e.__traceback__ = e.__context__ = None
        try:
            fresh = copy.copy(e)
        except Exception:  # noqa: BLE001 - an exception type copy cannot rebuild
            fresh = e
        raise fresh from None

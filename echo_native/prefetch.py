"""Remote reads ahead of the decode: samples hinted to a :class:`Prefetcher`, tar-shard
blocks in a :class:`BlockCache`.

Both fetch on a few daemon threads of the worker process while it decodes, and
both are bounded: in requests in flight, and in bytes held
(``RemoteOptions.prefetch``, ``prefetch_bytes``, ``cache_bytes``).  Every fetch
goes through the bounded reads of :mod:`echo_native.remote`.
"""
from __future__ import annotations

import copy
import errno
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from echo_native.remote import RemoteOptions, RemoteReadError, _result


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
            return _result(fut, timeout)
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
            return _result(fut, timeout)
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
            # Kept (remembered as the block's failure) without its traceback or the
            # errors it was raised while handling: run on a reader's thread, their frames
            # would keep that reader's whole stack (a worker's ring) alive with it.
            e.__traceback__ = e.__context__ = e.__cause__ = None
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

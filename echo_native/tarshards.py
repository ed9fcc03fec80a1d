"""WebDataset-style tar shards as a source: ``TarShards``, read in place.

A shard is a tar of ``<key>.jpg`` (or another image format) and ``<key>.cls``
members, local or in object storage.  Its index (where each member's bytes
lie) comes from a ``.idx`` sidecar written with it (:mod:`echo_native.tarindex`,
checked against the shard before it is trusted), or from one scan of the
shard; a worker then reads each sample's bytes by offset, remote shards in
blocks of a batch's samples (:mod:`echo_native.remote`).
"""
from __future__ import annotations

import errno
import os
import warnings

import numpy as np

from echo_native import prefetch as _prefetch
from echo_native import remote as _remote
from echo_native import tarindex
from echo_native.errors import ReadLimitError
from echo_native.files import DEFAULT_MAX_FILE_BYTES, _check_max_file_bytes, _PackedPaths
from echo_native.source import _LAZY, _prefetcher_of
from echo_native.targets import MAX_JSON_BYTES, targets_from_json

#: Block size of the one streaming read that indexes a remote shard without a sidecar.
_SCAN_BLOCK = 8 * 2**20


def _index_cache_dir(index_cache):
    """Where indexes of scanned remote shards are kept (None: nowhere)."""
    if index_cache is False:
        return None
    if index_cache is not None:
        return os.fspath(index_cache)
    base = os.environ.get("ECHO_NATIVE_CACHE")
    if base:
        return os.path.join(base, "index")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "echo_native", "index")



class TarShards:
    """WebDataset-style tar shards: members ``<key>.jpg`` (or .jpeg/.png/.webp) and
    ``<key>.cls`` (the integer label) grouped by key.

    The shards are indexed once (member headers only, data is skipped), so a
    worker reads a sample with one positioned read from the shard, never
    extracting anything.  Epoch order keeps reads mostly sequential: shards are
    visited in an order shuffled per epoch and samples are shuffled within a
    window of ``shuffle_buffer`` consecutive samples (like WebDataset's buffer).
    A sample without a ``.cls`` member gets label -1.

    Shards may be local paths or URLs of any fsspec protocol (``s3://``,
    ``gs://``, ``https://``; ``file://`` is a local path).  Remote shards are
    read in blocks of many consecutive samples, one byte-range request each
    (``remote.block_bytes``), kept in a per-process cache bounded in bytes
    (``remote.cache_bytes``) and fetched ahead by each worker; requests are
    retried on transient errors as ``remote`` (a
    :class:`~echo_native.remote.RemoteOptions`) says.  A sample that cannot be
    read is a sample failure naming ``url:key``, under the pipeline's
    ``on_error``.  ``storage_options`` go to fsspec (e.g.
    ``{"endpoint_url": ...}`` for an S3-compatible server); credentials come
    from the environment as fsspec's backend takes them.

    Each shard's index comes from its ``<shard>.idx`` sidecar when there is a
    valid one (``echo-native make-shards`` writes them), else from scanning the
    shard's headers.  A scanned remote shard's index is kept in ``index_cache``
    (default ``$ECHO_NATIVE_CACHE/index``, else ``$XDG_CACHE_HOME/echo_native/index``,
    else ``~/.cache/echo_native/index``; ``False``: keep none), under a hash of its
    URL, size and ETag, so a changed object is indexed again.  ``write_index=True``
    also writes the sidecar next to each scanned shard, remote ones included.

    ``targets=True``: the samples carry detection targets, each in a ``<key>.json``
    member (:mod:`echo_native.targets`; :func:`~echo_native.write_shards` writes
    them from a source with targets), read from the same shard by
    ``targets(i)`` (remote ones in the same block as the image).  A sample
    without one, or with one that is not valid targets, is a sample failure
    naming ``shard:key.json``; shards with no such member at all are refused here.
    """

    IMAGE_EXTS = tarindex.IMAGE_EXTS

    has_targets = False  # set per instance by targets=

    def __init__(self, urls_or_paths, shuffle_buffer=1000, max_file_bytes=DEFAULT_MAX_FILE_BYTES,
                 *, storage_options=None, remote=None, index_cache=None, write_index=False,
                 targets=False):
        self.max_file_bytes = _check_max_file_bytes("TarShards", max_file_bytes)
        if isinstance(urls_or_paths, (str, os.PathLike)):
            urls_or_paths = [urls_or_paths]
        self.shards = [str(_remote.local_path(p)) if not _remote.is_url(str(p)) else str(p)
                       for p in urls_or_paths]
        if not self.shards:
            raise ValueError("TarShards needs at least one shard")
        self.shuffle_buffer = int(shuffle_buffer)
        self._remote_shard = [_remote.is_url(s) for s in self.shards]
        self._store = None
        if any(self._remote_shard):
            self._store = _remote.RemoteStore(storage_options, remote)
        elif remote is not None and not isinstance(remote, _remote.RemoteOptions):
            raise TypeError(f"remote= must be a RemoteOptions, got {remote!r}")
        self._names = [_remote.redact(s) if r else s
                       for s, r in zip(self.shards, self._remote_shard)]
        indexes = self._indexes(index_cache, write_index)
        for name, index in zip(self._names, indexes):
            if index.damage is not None:  # once per shard, here in the consumer
                at, what = index.damage
                warnings.warn(f"tar shard {name} is damaged at byte {at:,}: {what}; its "
                              f"{len(index)} complete sample(s) before that are kept, the "
                              f"rest of it is not read", RuntimeWarning, stacklevel=2)
        shard_of, offsets, sizes, labels, keys, starts = [], [], [], [], [], [0]
        for s, index in enumerate(indexes):
            shard_of.extend([s] * len(index))
            offsets.extend(index.offsets)
            sizes.extend(index.sizes)
            labels.extend(index.labels)
            keys.extend(index.keys)
            starts.append(len(offsets))
        if not offsets:
            raise ValueError(f"no image members in the {len(self.shards)} tar shard(s)")
        self._shard = np.asarray(shard_of, np.int32)
        self._offset = np.asarray(offsets, np.int64)
        self._size = np.asarray(sizes, np.int64)
        self._starts = np.asarray(starts, np.int64)
        self._keys = _PackedPaths(keys)
        self.labels = np.asarray(labels, np.int64)
        self.has_targets = bool(targets)
        self._json_offset = self._json_size = None
        if self.has_targets:
            self._json_offset, self._json_size = self._json_members(indexes)
        self._files = {}  # shard index -> descriptor, opened on first read in each process
        self._prefetchers = None  # remote reads ahead, per process and thread, on first hint
        self._blocks = None  # remote blocks cached and read ahead, per process
        self._plans = {}  # shard index -> its blocks, worked out on first use in each process

    def _json_members(self, indexes):
        offsets, sizes = [], []
        for index in indexes:
            if index.json_offsets is None:
                offsets += [-1] * len(index)
                sizes += [0] * len(index)
            else:
                offsets += index.json_offsets
                sizes += index.json_sizes
        offsets = np.asarray(offsets, np.int64)
        if not (offsets >= 0).any():
            shown = ", ".join(self._names[:2]) + (", ..." if len(self._names) > 2 else "")
            raise ValueError(f"TarShards(targets=True): no sample of the {len(self.shards)} "
                             f"shard(s) ({shown}) has a <key>.json member (its targets); "
                             f"write them with write_shards(source_with_targets, ...)")
        return offsets, np.asarray(sizes, np.int64)

    def _indexes(self, index_cache, write_index):
        local = [self._local_index(s, write_index) if not r else None
                 for s, r in zip(self.shards, self._remote_shard)]
        remote = [i for i, r in enumerate(self._remote_shard) if r]
        if remote:
            cache = _index_cache_dir(index_cache)
            # One HEAD (and perhaps a sidecar GET) per shard: many in parallel.
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(min(16, len(remote))) as pool:
                found = pool.map(lambda i: self._remote_index(i, cache, write_index), remote)
                for i, index in zip(remote, found):
                    local[i] = index
        return local

    def _local_index(self, shard, write_index):
        if not os.path.isfile(shard):
            raise FileNotFoundError(f"tar shard {shard!r} does not exist")
        side = tarindex.sidecar(shard)
        size = os.stat(shard).st_size
        if os.path.isfile(side):
            try:
                data = tarindex.read_limited(side, tarindex.max_index_bytes(size))
                return tarindex.TarIndex.from_json(data, size)
            except (OSError, ValueError) as e:
                warnings.warn(f"{side}: {e}; scanning the shard instead", RuntimeWarning,
                              stacklevel=4)
        index = tarindex.scan_file(shard)
        if write_index:
            tarindex.write_atomic(side, index.to_json())
        return index

    def _remote_index(self, s, cache, write_index):
        url, name, store = self.shards[s], self._names[s], self._store
        try:
            info = store.info(url)
        except _remote.RemoteReadError as e:
            if e.errno == errno.ENOENT and not isinstance(e, _remote.StoreUnavailableError):
                raise FileNotFoundError(f"tar shard {name!r} does not exist") from None
            raise  # the real cause (a 5xx, a refused connection...), naming the shard
        size = info["size"]
        if size is None:
            raise _remote.RemoteReadError(errno.EIO, "the server does not tell the object's "
                                                     "size (no Content-Length); a tar shard "
                                                     "needs one to be read by range", name)
        limit = tarindex.max_index_bytes(size)
        cached = None
        if cache:
            import hashlib

            ident = "\0".join([url, str(size), str(info["etag"])]).encode("utf-8",
                                                                          "surrogatepass")
            cached = os.path.join(cache, hashlib.sha256(ident).hexdigest()[:40] + ".idx")
            try:
                return tarindex.TarIndex.from_json(tarindex.read_limited(cached, limit), size)
            except (OSError, ValueError):
                pass
        index = None
        if "?" not in url:  # a signed URL's query does not sign its sidecar
            try:
                data = store.read_all(tarindex.sidecar(url), limit,
                                      what=tarindex.sidecar(name),
                                      limit="the index size limit for this shard")
                index = tarindex.TarIndex.from_json(data, size)
            except _remote.StoreUnavailableError:
                raise
            except _remote.RemoteReadError as e:
                if e.errno != errno.ENOENT:
                    warnings.warn(f"{e}; scanning the shard instead", RuntimeWarning,
                                  stacklevel=5)
            except ReadLimitError as e:
                warnings.warn(f"{tarindex.sidecar(name)}: {e.strerror}; scanning the shard "
                              f"instead", RuntimeWarning, stacklevel=5)
            except ValueError as e:
                warnings.warn(f"{tarindex.sidecar(name)}: {e}; scanning the shard instead",
                              RuntimeWarning, stacklevel=5)
        if index is None:
            # Headers only would be a request per member; reading the shard through a
            # large buffer is far fewer requests (each a bounded, retried range read),
            # once.
            with store.open(url, size, what=name, block_bytes=_SCAN_BLOCK) as f:
                index = tarindex.scan(f, name, size)
            if write_index:
                store.put_bytes(index.to_json(), tarindex.sidecar(url))
        if cached:
            try:
                os.makedirs(cache, exist_ok=True)
                tarindex.write_atomic(cached, index.to_json())
            except OSError:
                pass  # a read-only cache only costs a scan next time
        return index

    def __len__(self):
        return len(self.labels)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_files"] = {}  # open files stay in the process that opened them
        state["_prefetchers"] = None  # and so do fetch threads (the store drops its connections)
        state["_blocks"], state["_plans"] = None, {}  # and cached blocks
        return state

    def __del__(self):
        for fd in (getattr(self, "_files", None) or {}).values():
            try:
                os.close(fd)
            except OSError:
                pass

    @property
    def remote_options(self):
        """The RemoteOptions of the object store the shards are in, or None (a hook of
        :class:`echo_native.Source`: worker caches count against the memory budget)."""
        return self._store.options if self._store is not None else None

    def describe(self, i) -> str:
        return f"{self._names[self._shard[i]]}:{self._keys[i]}"

    def read(self, i) -> bytes:
        s = int(self._shard[i])
        size = int(self._size[i])
        if size > self.max_file_bytes:
            raise ReadLimitError(errno.EFBIG, f"{size} bytes, over the limit "
                                              f"max_file_bytes={self.max_file_bytes}")
        if self._remote_shard[s]:
            return self._read_remote(i)
        return self._pread(s, int(self._offset[i]), size)

    def _pread(self, s, offset, size):
        fd = self._files.get(s)
        if fd is None:
            fd = os.open(self.shards[s], os.O_RDONLY)
            # Reader threads may race here: keep whichever descriptor won.
            if self._files.setdefault(s, fd) != fd:
                os.close(fd)
                fd = self._files[s]
        data = os.pread(fd, size, offset)
        if len(data) != size:
            raise OSError(f"short read: {len(data)} of {size} bytes")
        return data

    def targets(self, i):
        """Sample ``i``'s :class:`~echo_native.targets.Targets`, from its ``<key>.json``
        member (with ``targets=True``); ValueError naming that member when it is
        missing or not valid targets."""
        if not self.has_targets:
            raise ValueError(f"{self!r} was made without targets=True")
        where = f"{self.describe(i)}.json"
        offset, size = int(self._json_offset[i]), int(self._json_size[i])
        if offset < 0:
            raise ValueError(f"{where}: no such member in the shard (a sample without "
                             f"targets)")
        if size > MAX_JSON_BYTES:
            raise ValueError(f"{where}: targets JSON of {size:,} bytes, over the limit of "
                             f"{MAX_JSON_BYTES:,}")
        s = int(self._shard[i])
        if self._remote_shard[s]:
            data = self._read_remote(i, offset, size, where)
        else:
            data = self._pread(s, offset, size)
        return targets_from_json(data, where)

    def prefetch(self, ids, upcoming=()):
        """Hint: the samples this worker reads next, in order.  The blocks of remote
        samples among them are fetched ahead, then those of ``upcoming`` (a guess at
        the batch after) and the block that follows the last one in its shard, within
        ``remote``'s limits; local samples need nothing."""
        if self._store is None:
            return
        ids = self._remote_ids(ids)
        if not self._store.options.block_bytes:
            if ids:
                self._hint_samples(ids)
            return
        upcoming = self._remote_ids(upcoming)
        if not ids and not upcoming:
            return
        blocks, seen, alone, last = [], set(), [], {}
        for k, i in enumerate(ids + upcoming):
            s = int(self._shard[i])
            b, start, end = self._block(s, i)
            if b < 0:
                if k < len(ids):
                    alone.append(i)
            elif (s, b) not in seen:
                seen.add((s, b))
                blocks.append(((s, start, end), end - start))
                last[s] = max(last.get(s, -1), b)
        for s, b in last.items():  # read ahead: the block that follows in the shard
            plan = self._plans[s]
            if b + 1 < len(plan[1]) and (s, b + 1) not in seen:
                start, end = int(plan[1][b + 1]), int(plan[2][b + 1])
                blocks.append(((s, start, end), end - start))
        self._block_cache().hint(blocks)
        if alone:
            self._hint_samples(alone)

    def _remote_ids(self, ids):
        return [int(i) for i in ids if self._remote_shard[self._shard[i]]
                and self._size[i] <= self.max_file_bytes]

    def _hint_samples(self, ids):
        _prefetcher_of(self, create=True).hint(ids, [int(self._size[i]) for i in ids])

    def _fetch(self, i):
        off, size = int(self._offset[i]), int(self._size[i])
        return self._store.read_range(self.shards[self._shard[i]], off, off + size,
                                      what=self.describe(i))

    def _fetch_block(self, key):
        s, start, end = key
        return self._store.read_range(self.shards[s], start, end,
                                      what=f"{self._names[s]} bytes {start}-{end}")

    def _block_cache(self):
        blocks = self._blocks
        if blocks is None:
            with _LAZY:
                if self._blocks is None:
                    self._blocks = _prefetch.BlockCache(self._fetch_block, self._store.options)
                blocks = self._blocks
        return blocks

    def _plan(self, s):
        """Shard ``s`` cut into blocks: (block of each sample or -1 for one read on its
        own, block starts, block ends), samples taken in byte order.  A block starts
        at a sample's data and ends at one's end, spans at most ``block_bytes``, and
        a gap between samples (other members) of over a quarter of that, and over
        64 KiB, ends it."""
        plan = self._plans.get(s)
        if plan is not None:
            return plan
        lo, hi = int(self._starts[s]), int(self._starts[s + 1])
        offs, sizes = self._offset[lo:hi], self._size[lo:hi]
        if self._json_offset is not None:  # a sample's span takes its targets in too
            jo, js = self._json_offset[lo:hi], self._json_size[lo:hi]
            has = jo >= 0
            first = np.where(has, np.minimum(offs, jo), offs)
            sizes = np.where(has, np.maximum(offs + sizes, jo + js), offs + sizes) - first
            offs = first
        limit = self._store.options.block_bytes
        gap = max(limit // 4, 64 << 10)
        block_of = np.full(hi - lo, -1, np.int32)
        starts, ends = [], []
        for j in np.argsort(offs, kind="stable").tolist():
            o, n = int(offs[j]), int(sizes[j])
            if n > limit:
                continue  # read on its own
            if starts and max(ends[-1], o + n) - starts[-1] <= limit and o - ends[-1] <= gap:
                ends[-1] = max(ends[-1], o + n)
            else:
                starts.append(o)
                ends.append(o + n)
            block_of[j] = len(starts) - 1
        plan = (block_of, np.asarray(starts, np.int64), np.asarray(ends, np.int64))
        return self._plans.setdefault(s, plan)

    def _block(self, s, i):
        """(block number, start, end) of sample ``i`` in shard ``s``; block -1: read alone."""
        block_of, starts, ends = self._plan(s)
        b = int(block_of[i - self._starts[s]])
        if b < 0:
            return -1, 0, 0
        return b, int(starts[b]), int(ends[b])

    def _read_remote(self, i, offset=None, size=None, what=None):
        """Sample ``i``'s image (or, given ``offset``, ``size`` and ``what``, another of
        its members) from the block that holds it, or read on its own."""
        opts = self._store.options
        wait = opts.retry_timeout + 5.0  # the fetch's own budget, plus a grace
        member = offset is not None
        if not member:
            offset, size = int(self._offset[i]), int(self._size[i])
        if opts.block_bytes:
            s = int(self._shard[i])
            b, start, end = self._block(s, i)
            if b >= 0:
                try:
                    block = self._block_cache().get((s, start, end), end - start, wait)
                except _remote.StoreUnavailableError:
                    raise  # the store, not this sample: it names the store and the object
                except OSError as e:
                    # The block's error, told about this sample.
                    raise _remote.RemoteReadError(e.errno or errno.EIO,
                                                  e.strerror or str(e),
                                                  what or self.describe(i)) from None
                if start <= offset and offset + size <= end:
                    return bytes(memoryview(block)[offset - start:offset - start + size])
        if member:
            shard = self.shards[self._shard[i]]
            return self._store.read_range(shard, offset, offset + size, what=what)
        pf = _prefetcher_of(self, create=False)
        if pf is not None:
            data = pf.take(i, wait)
            if data is not None:
                return data
        return self._fetch(i)

    def epoch_order(self, seed, epoch):
        """Shards in a per-epoch order, samples shuffled within windows."""
        # The key as uint64: numpy reads [2**63, tag] as float64, and seeds past 2**63
        # would then share orders.
        key = np.array([int(seed), 0x7461727368], np.uint64)
        gen = np.random.Generator(np.random.Philox(key=key, counter=[epoch, 0, 0, 0]))
        parts = [np.arange(self._starts[s], self._starts[s + 1])
                 for s in gen.permutation(len(self.shards))]
        order = np.concatenate(parts)
        w = max(1, self.shuffle_buffer)
        for start in range(0, len(order), w):
            gen.shuffle(order[start:start + w])
        return order

    def __repr__(self):
        return f"TarShards({len(self.shards)} shards, {len(self)} samples)"

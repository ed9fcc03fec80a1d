"""Sources on object storage: TarShards and FileList over a real S3-compatible server.

The server is moto's S3 (a WSGI app) served on a free localhost port by this
module, with a handler that tracks its connections so that ``stop()`` is a real
outage: the listening socket and every kept-alive connection are closed.  A small
HTTP proxy in front of it can fail every k-th GET with 503 or answer 403 for
chosen objects, and logs what it forwarded.  References are the same shards
read from local disk.
"""
from __future__ import annotations

import errno
import http.client
import http.server
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

import echo_native as en  # noqa: E402
from echo_native import remote  # noqa: E402
from echo_native import remote_errors  # noqa: E402
from echo_native.errors import ReadLimitError  # noqa: E402
from echo_native.prefetch import BlockCache, Prefetcher  # noqa: E402
from echo_native.remote import (RemoteOptions, RemoteReadError,  # noqa: E402
                                RemoteStore)
from echo_native.source import FileList  # noqa: E402
from echo_native.tarshards import TarShards

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import sources_helpers as sh  # noqa: E402

N = 36
CLASSES = 3
SHARDS = 3
# Short budgets: a test that has to give up does so in seconds.  Small blocks (a few
# samples each): every shard is several blocks, so an epoch makes a few dozen requests.
FAST = RemoteOptions(prefetch=6, threads=3, attempts=20, retry_timeout=25.0,
                     request_timeout=5.0, backoff=0.05, max_backoff=1.0,
                     block_bytes=8 << 10, cache_bytes=64 << 10)

pytestmark = pytest.mark.timeout(120)


# ---- the server -------------------------------------------------------------------------
class S3Server:
    """moto's S3 on 127.0.0.1; ``stop()`` drops every connection, ``start()`` comes back on
    the same port with the same objects (moto keeps them in this process)."""

    def __init__(self):
        self.port = 0
        self._server = None
        self._conns = set()
        self.requests = 0

    def start(self):
        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import WSGIRequestHandler, make_server

        conns, server = self._conns, self

        class Handler(WSGIRequestHandler):
            def setup(self):
                super().setup()
                conns.add(self.connection)

            def finish(self):
                conns.discard(self.connection)
                super().finish()

            def log_request(self, *args, **kwargs):
                server.requests += 1

        app = DomainDispatcherApplication(create_backend_app)
        self._server = make_server("127.0.0.1", self.port, app, threaded=True,
                                   request_handler=Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self):
        self._server.shutdown()
        self._server.server_close()
        for c in list(self._conns):
            try:
                c.shutdown(socket.SHUT_RDWR)
                c.close()
            except OSError:
                pass

    @property
    def endpoint(self):
        return f"http://127.0.0.1:{self.port}"


class FaultProxy:
    """Forwards HTTP to ``port``; fails every ``fail_every``-th GET with 503, answers 403 for
    paths ending in a member of ``forbid`` and for GETs of ranges of ``(path suffix, first
    byte)`` in ``forbid_from``, and logs (method, path, range) per request."""

    def __init__(self, port):
        self.port, self.fail_every, self.forbid, self.forbid_from = port, 0, set(), set()
        self.log, self.failed, self._gets = [], 0, 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy._lock:
                    proxy.log.append((self.command, self.path, self.headers.get("Range")))
                    fail = False
                    if self.command == "GET":
                        proxy._gets += 1
                        fail = bool(proxy.fail_every) and proxy._gets % proxy.fail_every == 0
                    forbidden = any(self.path.split("?")[0].endswith(f) for f in proxy.forbid)
                    rng = self.headers.get("Range") or ""
                    forbidden |= self.command == "GET" and any(
                        self.path.split("?")[0].endswith(f) and rng.startswith(f"bytes={b}-")
                        for f, b in proxy.forbid_from)
                if forbidden or fail:
                    proxy.failed += fail
                    code, status = ("AccessDenied", 403) if forbidden else \
                        ("ServiceUnavailable", 503)
                    err = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                           f"<Message>injected</Message></Error>").encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(err)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(err)
                    return
                conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding", "content-length",
                                         "server", "date"):
                        self.send_header(k, v)
                length = resp.getheader("Content-Length") if self.command == "HEAD" \
                    else str(len(data))
                self.send_header("Content-Length", length or "0")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def endpoint(self):
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def gets(self, suffix):
        return [e for e in self.log if e[0] == "GET" and e[1].split("?")[0].endswith(suffix)]

    def close(self):
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture(scope="module")
def s3_env():
    """Credentials for the fake server, never real ones."""
    mp = pytest.MonkeyPatch()
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        mp.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        mp.delenv(k, raising=False)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def s3_server(s3_env):
    """A moto S3 server on a free localhost port for the module."""
    server = S3Server().start()
    yield server
    server.stop()


def s3fs_for(endpoint):
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)


def upload(endpoint, bucket, paths):
    """Put local files into ``bucket`` (created); returns their s3:// URLs."""
    fs = s3fs_for(endpoint)
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    urls = []
    for p in paths:
        key = f"{bucket}/{os.path.basename(p)}"
        fs.put_file(str(p), key)
        urls.append(f"s3://{key}")
    return urls


# ---- data -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus():
    return sh.photo_jpegs(N, seed=21), np.arange(N) % CLASSES


@pytest.fixture(scope="module")
def local_shards(corpus, tmp_path_factory):
    blobs, labels = corpus
    return sh.write_shards(tmp_path_factory.mktemp("shards"), blobs, labels, SHARDS)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("index-cache")


@pytest.fixture(scope="module")
def bucket_shards(s3_server, local_shards):
    return upload(s3_server.endpoint, "shards", local_shards)


def remote_tar(urls, endpoint, cache, **kw):
    kw.setdefault("remote", FAST)
    return TarShards(urls, storage_options={"endpoint_url": endpoint}, index_cache=cache, **kw)


def collect(it):
    fresh, ids, labels = [], [], []
    for b in it:
        fresh.extend(np.asarray(b.sample_ids)[np.asarray(b.fresh)].tolist())
        ids.extend(np.asarray(b.sample_ids).tolist())
        labels.extend(np.asarray(b.labels).tolist())
    return fresh, ids, labels


def sample_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, en.SampleFailureWarning)]


# ---- unit: names, options, prefetch -------------------------------------------------------
def test_urls_are_redacted_and_file_urls_are_local():
    """User info and query strings never reach a message; file:// is a local path."""
    assert remote.is_url("s3://b/k") and remote.is_url("https://h/x.tar")
    assert not remote.is_url("/data/x.tar") and not remote.is_url("file:///data/x.tar")
    assert remote.local_path("file:///data/a%20b.tar") == "/data/a b.tar"
    url = "https://user:s3cret@host.example:8443/p/shard.tar?X-Amz-Signature=abc&t=1#frag"
    assert remote.redact(url) == "https://host.example:8443/p/shard.tar"
    text = remote_errors._redact_text(f"GET {url} failed")
    assert "s3cret" not in text and "Signature" not in text and "host.example" in text
    store = RemoteStore({"key": "AKIA-secret", "secret": "hush"})
    assert "hush" not in repr(store) and "AKIA-secret" not in repr(store)


def test_remote_options_validate():
    """RemoteOptions refuses nonsense limits by name."""
    with pytest.raises(ValueError, match="prefetch"):
        RemoteOptions(prefetch=-1)
    with pytest.raises(ValueError, match="threads"):
        RemoteOptions(threads=0)
    with pytest.raises(ValueError, match="retry_timeout"):
        RemoteOptions(retry_timeout=0)
    with pytest.raises(ValueError, match="cache_bytes"):
        RemoteOptions(block_bytes=8 << 20, cache_bytes=4 << 20)
    RemoteOptions(block_bytes=0, cache_bytes=0)  # one request per sample: no cache needed
    with pytest.raises(TypeError, match="RemoteOptions"):
        TarShards("s3://b/x.tar", remote={"prefetch": 2})


def test_prefetcher_bounds_count_and_bytes():
    """In flight never exceeds the count or byte budget; results and errors reach take()."""
    lock = threading.Lock()
    state = {"now": 0, "peak": 0}
    gate = threading.Event()

    def fetch(i):
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
        gate.wait(5)
        time.sleep(0.002)
        with lock:
            state["now"] -= 1
        if i == 7:
            raise RemoteReadError(errno.ENOENT, "gone", f"obj:{i}")
        return bytes([i]) * 10

    pf = Prefetcher(fetch, RemoteOptions(prefetch=4, prefetch_bytes=25, threads=8))
    ids = list(range(12))
    pf.hint(ids, [10] * 12)
    deadline = time.monotonic() + 30
    while state["now"] < 2 and time.monotonic() < deadline:  # both fetches under way
        time.sleep(0.005)
    assert len(pf._held) == 2 and pf._bytes == 20  # 25 bytes hold two 10-byte samples
    assert state["now"] == 2                       # and no third fetch was started
    gate.set()
    for i in ids:
        if i == 7:
            with pytest.raises(RemoteReadError, match="obj:7"):
                pf.take(i, 10)
        else:
            assert pf.take(i, 10) == bytes([i]) * 10
    assert state["peak"] <= 2
    assert pf.take(99, 1) is None  # never hinted: the caller reads it
    pf.hint([1, 2, 3], [10, 1000, 10])  # over the whole budget: skipped, not blocking
    assert pf.take(1, 10) == b"\x01" * 10 and pf.take(3, 10) == b"\x03" * 10
    assert pf.take(2, 1) is None
    pf.hint([5], [10])
    pf.hint([6], [10])  # 5 was dropped: its bytes come back
    assert pf.take(6, 10) == b"\x06" * 10
    deadline = time.monotonic() + 5
    while pf._bytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pf._bytes == 0 and pf._held == {}


def test_block_cache_bounds_bytes_and_requests():
    """The LRU never holds more than cache_bytes; fetches ahead stay within threads and
    prefetch_bytes; a failed block fails its readers at once, without a second request."""
    lock = threading.Lock()
    state = {"now": 0, "peak": 0, "calls": Counter()}

    def fetch(key):
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
            state["calls"][key] += 1
        time.sleep(0.003)
        with lock:
            state["now"] -= 1
        if key == "bad":
            raise RemoteReadError(errno.ENOENT, "no such object (deleted?)", "obj bytes 0-9")
        return bytes([key % 256]) * (100 + key % 7)

    opts = RemoteOptions(threads=3, prefetch_bytes=350, cache_bytes=1000, block_bytes=200)
    cache = BlockCache(fetch, opts)
    rng = np.random.default_rng(0)
    for step in range(60):
        keys = [int(k) for k in rng.integers(0, 40, size=6)]
        cache.hint([(k, 100 + k % 7) for k in keys])
        assert cache.flying_bytes <= opts.prefetch_bytes
        for k in keys[:3]:
            assert cache.get(k, 100 + k % 7, 10) == bytes([k]) * (100 + k % 7)
            assert cache.cached_bytes <= opts.cache_bytes
    deadline = time.monotonic() + 5
    while cache.flying_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cache.peak_bytes <= opts.cache_bytes and cache.cached_bytes <= opts.cache_bytes
    assert state["peak"] <= opts.threads + 1  # 3 ahead + the one read on demand here
    assert cache.requests == sum(state["calls"].values())
    for _ in range(3):
        with pytest.raises(RemoteReadError, match="no such object"):
            cache.get("bad", 10, 10)
    assert state["calls"]["bad"] == 1


def test_local_use_does_not_import_fsspec(local_shards):
    """Local shards read through os.pread, without fsspec being imported."""
    code = ("import sys, echo_native as en; t = en.TarShards(sys.argv[1:]); t.read(0); "
            "t.prefetch([0, 1]); assert 'fsspec' not in sys.modules, 'fsspec imported'")
    subprocess.run([sys.executable, "-c", code, *local_shards], check=True, cwd=HERE.parent,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=60)


# ---- TarShards on S3 ----------------------------------------------------------------------
def test_s3_shards_equal_local(bucket_shards, local_shards, s3_server, cache):
    """Shards on S3 give the same samples, labels, order and names as the local copies;
    the source pickles without its filesystem and reads again after unpickling."""
    tar = remote_tar(bucket_shards, s3_server.endpoint, cache)
    loc = TarShards(local_shards)
    assert len(tar) == len(loc) == N
    assert tar.labels.tolist() == loc.labels.tolist()
    assert [tar.read(i) for i in range(N)] == [loc.read(i) for i in range(N)]
    assert [tar.describe(i).replace("s3://shards/", "") for i in range(N)] == \
        [os.path.basename(loc.describe(i)) for i in range(N)]
    assert np.array_equal(tar.epoch_order(3, 1), loc.epoch_order(3, 1))
    assert len(list(Path(cache).glob("*.idx"))) >= SHARDS  # scanned once, kept locally
    tar.prefetch(range(N))
    blob = pickle.dumps(tar)
    assert b"S3FileSystem" not in blob and b"Thread" not in blob
    clone = pickle.loads(blob)
    assert clone._store._fs == {} and clone._prefetchers is None
    assert clone.read(N - 1) == loc.read(N - 1)


def test_sidecar_and_cache_spare_the_scan(s3_server, local_shards, tmp_path):
    """write_index puts <shard>.idx beside the object; a fresh cache reads it instead of the
    shard; a warm cache needs neither."""
    proxy = FaultProxy(s3_server.port)
    try:
        urls = upload(s3_server.endpoint, "sidecar", local_shards)
        opts = {"endpoint_url": proxy.endpoint}
        first = TarShards(urls, storage_options=opts, index_cache=tmp_path / "a",
                          write_index=True, remote=FAST)
        fs = s3fs_for(s3_server.endpoint)
        assert all(fs.exists(u[len("s3://"):] + ".idx") for u in urls)
        assert proxy.gets(".tar")  # no sidecar yet: the shards were scanned
        proxy.log.clear()
        second = TarShards(urls, storage_options=opts, index_cache=tmp_path / "b", remote=FAST)
        assert not proxy.gets(".tar") and len(proxy.gets(".tar.idx")) == SHARDS
        proxy.log.clear()
        third = TarShards(urls, storage_options=opts, index_cache=tmp_path / "b", remote=FAST)
        assert not proxy.gets(".tar") and not proxy.gets(".tar.idx")
        for t in (second, third):
            assert t.labels.tolist() == first.labels.tolist()
            assert [t.read(i) for i in (0, N - 1)] == [first.read(i) for i in (0, N - 1)]
    finally:
        proxy.close()


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_s3_each_sample_once_per_epoch(bucket_shards, s3_server, cache, mode):
    """Loader and EchoRing(echo=1) over S3: every sample exactly once per epoch, read in the
    workers (never the consumer), labels from .cls."""
    tar = remote_tar(bucket_shards, s3_server.endpoint, cache, shuffle_buffer=5)
    src = sh.NotInConsumer(tar) if mode == "process" else tar
    with en.Loader(src, 7, image_size=24, workers=2, seed=5, worker_mode=mode) as ld:
        for epoch in range(2):
            ld.set_epoch(epoch)
            fresh, ids, labs = collect(ld)
            assert sorted(fresh) == list(range(N)) and sorted(ids) == list(range(N))
            assert labs == [int(tar.labels[i]) for i in ids]
            assert ids == tar.epoch_order(5, epoch).tolist()
            assert not ld.stats()["failures"]
    with en.EchoRing(src, batch_size=8, image_size=24, echo=1, workers=2, seed=5,
                     worker_mode=mode) as ring:
        fresh, ids, _ = collect(ring)
        assert sorted(fresh) == list(range(N)) and Counter(ids) == Counter(range(N))


@pytest.mark.slow  # seconds of injected back-off
def test_injected_503s_are_retried(s3_server, bucket_shards, cache):
    """Every 4th GET answered 503: retried with backoff; nothing lost, duplicated or failed."""
    proxy = FaultProxy(s3_server.port)
    try:
        tar = remote_tar(bucket_shards, proxy.endpoint, cache)
        proxy.fail_every = 4
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with en.Loader(tar, 6, image_size=24, workers=2, seed=1) as ld:
                fresh, ids, _ = collect(ld)
                stats = ld.stats()
        assert sample_warnings(caught) == []
        assert not stats["failures"]
        assert sorted(fresh) == list(range(N)) and sorted(ids) == list(range(N))
        assert proxy.failed >= N // 8  # the faults did happen
    finally:
        proxy.close()


@pytest.mark.slow  # waits out a server restart
def test_server_restart_mid_epoch(s3_env, local_shards, tmp_path):
    """The server goes down (every connection dropped) mid-epoch and comes back: the run
    waits it out and delivers every sample exactly once, with no failures."""
    server = S3Server().start()
    try:
        urls = upload(server.endpoint, "restart", local_shards)
        tar = remote_tar(urls, server.endpoint, tmp_path, shuffle_buffer=4)
        fresh, ids, after = [], [], None
        # Two slots: the workers cannot have read ahead past the outage.
        with en.Loader(tar, 3, image_size=24, workers=2, seed=2, slots=2) as ld:
            for k, b in enumerate(ld):
                fresh.extend(np.asarray(b.sample_ids)[np.asarray(b.fresh)].tolist())
                ids.extend(np.asarray(b.sample_ids).tolist())
                if k == 1:
                    server.stop()
                    time.sleep(2.0)  # workers keep failing and backing off meanwhile
                    server.start()
                    after = server.requests
            stats = ld.stats()
        assert after is not None and server.requests > after  # reads did wait for the restart
        assert not stats["failures"]
        assert sorted(fresh) == list(range(N)) and sorted(ids) == list(range(N))
    finally:
        server.stop()


@pytest.mark.parametrize("on_error", ["replace", "skip", "raise"])
def test_deleted_object_goes_through_on_error(s3_server, local_shards, tmp_path, on_error):
    """A shard deleted after indexing: each of its samples is a read failure under on_error,
    named s3://bucket/shard:key, counted, never a crash."""
    bucket = f"deleted-{on_error}"
    urls = upload(s3_server.endpoint, bucket, local_shards)
    tar = remote_tar(urls, s3_server.endpoint, tmp_path)
    s3fs_for(s3_server.endpoint).rm_file(urls[1][len("s3://"):])
    gone = [i for i in range(N) if tar.describe(i).startswith(urls[1] + ":")]
    assert len(gone) == N // SHARDS
    with pytest.raises(RemoteReadError) as ei:
        tar.read(gone[0])
    assert ei.value.errno == errno.ENOENT and tar.describe(gone[0]) in str(ei.value)
    mode = "process" if on_error == "skip" else "thread"
    ld = en.Loader(tar, 6, image_size=24, workers=2, seed=4, on_error=on_error,
                   worker_mode=mode)
    with ld:
        if on_error == "raise":
            with pytest.raises(en.DecodeError) as ei, warnings.catch_warnings():
                warnings.simplefilter("ignore", en.SampleFailureWarning)
                collect(ld)
            assert ei.value.path in {tar.describe(i) for i in gone}
            assert "no such object" in str(ei.value)
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fresh, ids, _ = collect(ld)
        stats = ld.stats()
    msgs = sample_warnings(caught)
    summary = [m for m in msgs if m.startswith("epoch 0: ")]
    assert len(summary) == 1 and f"failed (read {len(gone)})" in summary[0]
    msgs = [m for m in msgs if m not in summary]
    assert len(msgs) == len(gone)
    assert sorted(m.split(": ", 1)[0] for m in msgs) == sorted(tar.describe(i) for i in gone)
    assert all("no such object" in m for m in msgs)
    assert stats["failures"] == {"read": len(gone)}
    assert sorted(fresh) == [i for i in range(N) if i not in gone]
    assert not set(ids) & set(gone)


def test_forbidden_object_fails_fast(s3_server, bucket_shards, cache):
    """403 is permanent: not retried, an error naming the object and saying access denied."""
    proxy = FaultProxy(s3_server.port)
    try:
        tar = remote_tar(bucket_shards, proxy.endpoint, cache)
        victim = [i for i in range(N) if tar.describe(i).startswith(bucket_shards[2] + ":")][0]
        proxy.forbid.add(bucket_shards[2].rsplit("/", 1)[1])
        proxy.log.clear()
        with pytest.raises(RemoteReadError) as ei:
            tar.read(victim)
        assert ei.value.errno == errno.EACCES
        assert f"{tar.describe(victim)}: access denied" in str(ei.value)
        assert len(proxy.gets(".tar")) == 1
    finally:
        proxy.close()


def test_unreachable_server_gives_up_within_budget(s3_env):
    """Nothing listening: transient errors are retried, then one error that says the store
    is unreachable, naming it and the object (the budget bounds the whole read)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # botocore's own retries off, so the count below is ours.
    store = RemoteStore({"endpoint_url": f"http://127.0.0.1:{port}",
                         "config_kwargs": {"retries": {"max_attempts": 1}}},
                        RemoteOptions(attempts=3, retry_timeout=20.0, request_timeout=3.0,
                                      backoff=0.01, max_backoff=0.02))
    with pytest.raises(RemoteReadError) as ei:
        store.read_range("s3://nobody/shard.tar", 0, 10, what="s3://nobody/shard.tar:000001")
    assert isinstance(ei.value, remote.StoreUnavailableError)
    assert ei.value.errno == errno.ECONNREFUSED
    assert ei.value.endpoint == f"http://127.0.0.1:{port}"
    msg = str(ei.value)
    assert msg.startswith("s3://nobody/shard.tar:000001: the store at http://127.0.0.1:")
    assert "connection refused" in msg and "gave up after 3 tries" in msg


# ---- FileList on S3 -----------------------------------------------------------------------
def test_filelist_from_s3(s3_server, corpus, tmp_path):
    """A list on S3 with relative rows (resolved against the list's prefix) and full URLs."""
    blobs, labels = corpus
    root = sh.write_folder(tmp_path / "f", blobs[:12], labels[:12])
    files = sorted(root.rglob("*.jpg"))
    fs = s3fs_for(s3_server.endpoint)
    fs.mkdir("lists")
    rows = []
    for k, f in enumerate(files):
        rel = f"img/{f.name}"
        fs.put_file(str(f), f"lists/data/{rel}")
        rows.append(f"{rel},{k}" if k % 2 else f"s3://lists/data/{rel},{k}")
    fs.pipe_file("lists/data/train.csv", ("path,label\n" + "\n".join(rows) + "\n").encode())
    src = FileList("s3://lists/data/train.csv", storage_options={
        "endpoint_url": s3_server.endpoint}, remote=FAST)
    assert len(src) == 12 and src.labels.tolist() == list(range(12))
    assert [src.read(i) for i in range(12)] == [f.read_bytes() for f in files]
    assert src.describe(1) == f"s3://lists/data/img/{files[1].name}"
    with en.Loader(src, 5, image_size=16, workers=2, seed=0) as ld:
        fresh, ids, labs = collect(ld)
    assert sorted(fresh) == list(range(12)) and labs == ids
    small = FileList("s3://lists/data/train.csv", storage_options={
        "endpoint_url": s3_server.endpoint}, remote=FAST, max_file_bytes=100)
    with pytest.raises(ReadLimitError):
        small.read(0)
    with pytest.raises(FileNotFoundError, match="s3://lists/none.csv"):
        FileList("s3://lists/none.csv", storage_options={"endpoint_url": s3_server.endpoint},
                 remote=FAST)


# ---- blocks -------------------------------------------------------------------------------
def _blocks(tar):
    return sum(len(tar._plan(s)[1]) for s in range(len(tar.shards)))


def test_blocks_cut_the_requests(s3_server, bucket_shards, local_shards, cache):
    """Samples are read in blocks: reading every sample makes one GET per block, not one
    per sample; an epoch through two workers makes about that many; the bytes cached per
    process never exceed cache_bytes; block_bytes=0 is one GET per sample again."""
    proxy = FaultProxy(s3_server.port)
    try:
        loc = TarShards(local_shards)
        opts = RemoteOptions(prefetch=6, threads=3, attempts=20, retry_timeout=25.0,
                             request_timeout=5.0, backoff=0.05, max_backoff=1.0,
                             block_bytes=24 << 10, cache_bytes=64 << 10)
        tar = remote_tar(bucket_shards, proxy.endpoint, cache, remote=opts)
        k = _blocks(tar)
        assert SHARDS < k <= N // 4  # samples share blocks, several blocks per shard
        for s in range(SHARDS):  # no sample straddles two blocks
            block_of, starts, ends = tar._plan(s)
            for j, b in enumerate(block_of.tolist()):
                i = int(tar._starts[s]) + j
                assert starts[b] <= tar._offset[i] and tar._offset[i] + tar._size[i] <= ends[b]
            assert (ends - starts).max() <= opts.block_bytes
        proxy.log.clear()
        assert [tar.read(i) for i in range(N)] == [loc.read(i) for i in range(N)]
        assert len(proxy.gets(".tar")) == k
        proxy.log.clear()
        fresh_tar = remote_tar(bucket_shards, proxy.endpoint, cache, shuffle_buffer=6,
                               remote=opts)
        with en.Loader(fresh_tar, 6, image_size=24, workers=2, seed=3,
                       worker_mode="thread") as ld:
            fresh, ids, _ = collect(ld)
        assert sorted(fresh) == list(range(N)) and sorted(ids) == list(range(N))
        gets = len(proxy.gets(".tar"))
        assert k <= gets <= 2 * k and gets < N // 2, (gets, k)
        assert fresh_tar._blocks.peak_bytes <= opts.cache_bytes
        proxy.log.clear()
        per_sample = remote_tar(bucket_shards, proxy.endpoint, cache,
                                remote=RemoteOptions(block_bytes=0, prefetch=0))
        assert [per_sample.read(i) for i in range(N)] == [loc.read(i) for i in range(N)]
        # One GET per sample, of exactly its bytes.  The thread workers' prefetchers
        # above may still finish a block read they started (daemon threads, bounded):
        # such a GET must be one of the planned blocks, nothing else.
        name = [url.rsplit("/", 1)[1] for url in per_sample.shards]
        shard = np.searchsorted(per_sample._starts, np.arange(N), side="right") - 1
        want = sorted((name[shard[i]], f"bytes={int(per_sample._offset[i])}-"
                       f"{int(per_sample._offset[i] + per_sample._size[i]) - 1}")
                      for i in range(N))
        blocks = {(name[sh], f"bytes={int(a)}-{int(b) - 1}") for sh in range(SHARDS)
                  for a, b in zip(*tar._plan(sh)[1:])}
        got = [(path.rsplit("/", 1)[1], rng) for _, path, rng in proxy.gets(".tar")]
        assert sorted(g for g in got if g not in blocks or g in want) == want
        assert all(g in blocks for g in got if g not in want), got
    finally:
        proxy.close()


def test_small_cache_still_delivers_every_sample(s3_server, bucket_shards, cache):
    """A cache of a single block (blocks pushed out before all their samples are read):
    every sample exactly once, the bound held, reads made again as needed."""
    opts = RemoteOptions(prefetch=6, threads=3, attempts=20, retry_timeout=25.0,
                         request_timeout=5.0, backoff=0.05, max_backoff=1.0,
                         block_bytes=8 << 10, cache_bytes=8 << 10)
    tar = remote_tar(bucket_shards, s3_server.endpoint, cache, remote=opts, shuffle_buffer=12)
    with en.Loader(tar, 6, image_size=24, workers=2, seed=8, worker_mode="thread") as ld:
        fresh, ids, _ = collect(ld)
        assert not ld.stats()["failures"]
    assert sorted(fresh) == list(range(N)) and sorted(ids) == list(range(N))
    assert tar._blocks.peak_bytes <= opts.cache_bytes


def test_failed_block_fails_only_its_samples(s3_server, bucket_shards, local_shards, cache):
    """A block answered 403: each of its samples fails with its own url:key (one request
    for the block, not one per sample); every other sample reads."""
    proxy = FaultProxy(s3_server.port)
    try:
        loc = TarShards(local_shards)
        tar = remote_tar(bucket_shards, proxy.endpoint, cache)
        block_of, starts, _ = tar._plan(1)
        victims = [int(tar._starts[1]) + j for j, b in enumerate(block_of.tolist()) if b == 1]
        assert 1 < len(victims) < N // SHARDS
        name = bucket_shards[1].rsplit("/", 1)[1]
        proxy.forbid_from.add((name, int(starts[1])))
        proxy.log.clear()
        for i in range(N):
            if i in victims:
                with pytest.raises(RemoteReadError) as ei:
                    tar.read(i)
                assert ei.value.errno == errno.EACCES
                assert str(ei.value).startswith(f"{tar.describe(i)}: access denied")
            else:
                assert tar.read(i) == loc.read(i)
        assert len([g for g in proxy.gets(name) if g[2].startswith(f"bytes={starts[1]}-")]) == 1
    finally:
        proxy.close()

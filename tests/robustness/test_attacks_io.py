"""Attacks on the I/O side, reproduced the way they were reported: remote reads against
a real HTTP server on localhost (``http.server`` in a thread), and planted symbolic links
in a shared output folder.

Each server path has a behaviour: a file served with ``Range`` support, a body streamed
without end that ignores ``Range``, a 206 that sends more than the range, an HTTP status,
or silence (the request is read, never answered).  Budgets are set through
``RemoteOptions`` so that a test that has to give up does so in seconds, and no test
asserts how long anything took: the errors and what they say are what is checked.
"""
from __future__ import annotations

import errno
import http.server
import io
import os
import re
import socket
import sys
import tarfile
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("fsspec")

import echo_native as en  # noqa: E402
from echo_native import tarindex  # noqa: E402
from echo_native.errors import ReadLimitError  # noqa: E402
from echo_native.remote import (RemoteOptions, RemoteReadError, RemoteStore,  # noqa: E402
                                StoreUnavailableError)
from echo_native.shards import write_shards  # noqa: E402

HERE = Path(__file__).resolve().parent.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import ring_helpers as rh  # noqa: E402
import sources_helpers as sh  # noqa: E402

pytestmark = pytest.mark.timeout(120)

MiB = 2**20
# Small budgets: a read that must give up does so after a few quick tries.
QUICK = RemoteOptions(prefetch=0, attempts=3, retry_timeout=10.0, request_timeout=10.0,
                      backoff=0.01, max_backoff=0.05)


# ---- the server -----------------------------------------------------------------------------
class Server:
    """An HTTP/1.1 server on 127.0.0.1.  ``files[path]`` is served with Range support (206);
    ``routes[path]`` is a behaviour ``fn(handler, head)`` instead.  ``requests`` counts
    (method, path); ``sent[path]`` counts body bytes written; ``done[path]`` is set each
    time a request for it ends."""

    def __init__(self):
        self.files, self.routes = {}, {}
        self.requests, self.sent = Counter(), Counter()
        self.done = {}
        self.release = threading.Event()  # lets silent handlers go
        self._lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                self._serve(False)

            def do_HEAD(self):
                self._serve(True)

            def _serve(self, head):
                path = self.path.split("?", 1)[0]
                with server._lock:
                    server.requests[(self.command, path)] += 1
                    done = server.done.setdefault(path, threading.Event())
                try:
                    route = server.routes.get(path)
                    if route is not None:
                        route(self, head)
                    elif path in server.files:
                        serve_bytes(self, head, server.files[path])
                    else:
                        answer(self, head, 404)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True
                finally:
                    done.set()

            def count(self, n):
                with server._lock:
                    server.sent[self.path.split("?", 1)[0]] += n

        self._http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        threading.Thread(target=self._http.serve_forever, daemon=True).start()

    def url(self, path):
        return f"http://127.0.0.1:{self._http.server_address[1]}{path}"

    def close(self):
        self.release.set()
        self._http.shutdown()
        self._http.server_close()


def answer(h, head, status, body=b""):
    h.send_response(status)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    if not head and body:
        h.wfile.write(body)
        h.count(len(body))


def serve_bytes(h, head, data):
    m = re.fullmatch(r"bytes=(\d+)-(\d*)", h.headers.get("Range") or "")
    if m is None:
        h.send_response(200)
        body = data
    else:
        start = int(m.group(1))
        last = min(int(m.group(2)) if m.group(2) else len(data) - 1, len(data) - 1)
        if start >= len(data):
            return answer(h, head, 416)
        body = data[start:last + 1]
        h.send_response(206)
        h.send_header("Content-Range", f"bytes {start}-{last}/{len(data)}")
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    if not head:
        h.wfile.write(body)
        h.count(len(body))


def endless(total):
    """A body of ``total`` zero bytes, 200 whatever Range says, written until the client
    goes away."""
    def route(h, head):
        h.send_response(200)
        h.send_header("Content-Length", str(total))
        h.end_headers()
        if head:
            return
        chunk = bytes(64 << 10)
        left = total
        while left > 0:
            n = min(left, len(chunk))
            h.wfile.write(chunk[:n])
            h.count(n)
            left -= n
    return route


def overlong(data, extra):
    """206 for the range asked, with ``extra`` bytes more in the body than it holds."""
    def route(h, head):
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", h.headers.get("Range") or "")
        start, last = (int(m.group(1)), int(m.group(2))) if m else (0, len(data) - 1)
        h.send_response(206)
        h.send_header("Content-Range", f"bytes {start}-{last}/{len(data)}")
        h.send_header("Content-Length", str(last + 1 - start + extra))
        h.end_headers()
        if head:
            return
        h.wfile.write(data[start:last + 1])
        h.count(last + 1 - start)
        chunk, left = bytes(64 << 10), extra
        while left > 0:
            n = min(left, len(chunk))
            h.wfile.write(chunk[:n])
            h.count(n)
            left -= n
    return route


def status_then_file(code, times, data):
    """``code`` for the first ``times`` requests (any method), then ``data`` as a file."""
    seen = Counter()

    def route(h, head):
        seen["n"] += 1
        if seen["n"] <= times:
            return answer(h, head, code, b"injected")
        serve_bytes(h, head, data)
    return route


def silent(server):
    """Read the request, never answer; the connection closes when the test ends."""
    def route(h, head):
        server.release.wait(60)
        h.close_connection = True
    return route


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


@pytest.fixture(scope="module")
def jpegs():
    return sh.photo_jpegs(8, seed=31)


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shard_bytes(blobs, labels):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i, (blob, label) in enumerate(zip(blobs, labels)):
            for name, data in ((f"{i:06d}.jpg", blob), (f"{i:06d}.cls", str(label).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


# ---- 2: write_shards and planted links -------------------------------------------------------
def test_write_shards_never_follows_planted_links(tmp_path, jpegs):
    """Links planted at every temporary name write_shards used to use (and at its final
    names) are never written through: the files they point at keep their bytes, the shards
    and their sidecars are regular files, complete, readable, mode 0666 less the umask."""
    out = tmp_path / "shared"
    out.mkdir()
    victims = {}
    for name in ("shard-000000.tar", "shard-000001.tar"):
        for planted in (f".{name}.tmp-{os.getpid()}", f"{name}.idx.tmp-{os.getpid()}",
                        f".{name}.idx.tmp-{os.getpid()}"):
            victim = tmp_path / f"victim-{planted.strip('.')}"
            victim.write_bytes(b"precious " + planted.encode())
            os.symlink(victim, out / planted)
            victims[victim] = victim.read_bytes()
    src = en.Samples(jpegs, np.arange(len(jpegs)) % 3)
    shards = write_shards(src, out, max_count=4, progress=False)
    assert [os.path.basename(p) for p in shards] == ["shard-000000.tar", "shard-000001.tar"]
    for victim, data in victims.items():
        assert victim.read_bytes() == data, f"{victim} was written through a planted link"
    mode = 0o666 & ~tarindex.umask()
    for p in shards:
        for f in (p, tarindex.sidecar(p)):
            assert not os.path.islink(f) and os.path.isfile(f)
            assert os.stat(f).st_mode & 0o777 == mode
    tar = en.TarShards(shards)
    assert [tar.read(i) for i in range(len(tar))] == jpegs
    # Nothing of ours is left behind: only the planted links and the shards.
    left = sorted(n for n in os.listdir(out) if not os.path.islink(out / n))
    assert left == ["shard-000000.tar", "shard-000000.tar.idx", "shard-000001.tar",
                    "shard-000001.tar.idx"]


def test_index_write_never_follows_a_planted_link(tmp_path, jpegs):
    """TarShards(write_index=True) writes the sidecar through mkstemp + rename: a link at
    the old predictable temporary name keeps its target's bytes."""
    shard = tmp_path / "s.tar"
    shard.write_bytes(_shard_bytes(jpegs[:3], [0, 1, 2]))
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.symlink(victim, tmp_path / f"s.tar.idx.tmp-{os.getpid()}")
    en.TarShards([shard], write_index=True)
    assert victim.read_bytes() == b"precious"
    assert tarindex.TarIndex.from_json((tmp_path / "s.tar.idx").read_bytes()).keys == \
        ["000000", "000001", "000002"]


# ---- 3: one bounded remote read --------------------------------------------------------------
def test_a_server_that_ignores_range_is_read_no_further_than_the_limit(server):
    """A server that ignores Range and streams 512 MiB for a 1 MiB limit: the sample is
    refused as over max_file_bytes, and the read stopped after the limit plus one chunk
    (what the server managed to send is bounded by that plus the sockets' buffers)."""
    server.routes["/big.jpg"] = endless(512 * MiB)
    src = en.FileList([(server.url("/big.jpg"), 0)], max_file_bytes=MiB, remote=QUICK)
    with pytest.raises(ReadLimitError) as ei:
        src.read(0)
    assert ei.value.errno == errno.EFBIG and "max_file_bytes=1048576" in str(ei.value)
    assert server.done["/big.jpg"].wait(60), "the server is still sending"
    assert server.sent["/big.jpg"] < 64 * MiB, server.sent["/big.jpg"]


def test_a_206_longer_than_its_range_is_refused_and_bounded(server, jpegs):
    """A tar shard whose server answers each range with 206 and 256 MiB more than asked:
    the block read stops one byte past the range and fails, naming the shard."""
    data = _shard_bytes(jpegs[:4], [0, 1, 2, 3])
    server.files["/s.tar"] = data
    tar = en.TarShards([server.url("/s.tar")], remote=QUICK, index_cache=False)
    server.routes["/s.tar"] = overlong(data, 256 * MiB)
    with pytest.raises(RemoteReadError, match="sent more than the .* bytes asked for") as ei:
        tar.read(0)
    assert server.url("/s.tar") in str(ei.value)
    assert server.done["/s.tar"].wait(60)
    assert server.sent["/s.tar"] < 64 * MiB, server.sent["/s.tar"]


def test_a_server_that_ignores_range_inside_a_shard_is_named(server, jpegs):
    """A block further in than the start, answered with the whole object (200): refused at
    once as a server that does not honour Range, not read through."""
    data = _shard_bytes(jpegs[:4], [0, 1, 2, 3])
    server.files["/s.tar"] = data
    tar = en.TarShards([server.url("/s.tar")], remote=QUICK, index_cache=False)
    server.files.pop("/s.tar")
    server.routes["/s.tar"] = endless(256 * MiB)
    with pytest.raises(RemoteReadError, match="ignored the byte range"):
        tar.read(0)
    assert server.requests[("GET", "/s.tar")] >= 1


def test_an_oversized_remote_index_is_not_read_whole(server, jpegs):
    """A sidecar streamed without end: read up to the index limit of its shard, refused
    with a warning, and the shard scanned instead."""
    data = _shard_bytes(jpegs[:4], [0, 1, 2, 3])
    server.files["/s.tar"] = data
    server.routes["/s.tar.idx"] = endless(256 * MiB)
    with pytest.warns(RuntimeWarning, match=r"s\.tar\.idx: over the limit the index size"):
        tar = en.TarShards([server.url("/s.tar")], remote=QUICK, index_cache=False)
    assert [tar.read(i) for i in range(4)] == jpegs[:4]
    assert server.done["/s.tar.idx"].wait(60)
    assert server.sent["/s.tar.idx"] < 64 * MiB


# ---- 5: the store is down ---------------------------------------------------------------------
@pytest.mark.parametrize("on_error, mode", [("replace", "process"), ("skip", "thread"),
                                             ("raise", "thread")])
def test_a_store_that_is_down_stops_the_run_with_its_url_and_cause(on_error, mode):
    """Connection refused on every try: whatever on_error says, the run stops with one
    error naming the store, the object and the cause, after one read's budget (not a
    stand-in after another, not a timeout that names nothing)."""
    port = closed_port()
    rows = [(f"http://127.0.0.1:{port}/img/{i}.jpg", i % 2) for i in range(8)]
    src = en.FileList(rows, remote=RemoteOptions(prefetch=2, attempts=3, retry_timeout=10.0,
                                                 request_timeout=5.0, backoff=0.01,
                                                 max_backoff=0.05))
    with en.Loader(src, batch_size=4, image_size=16, workers=1, on_error=on_error,
                   worker_mode=mode, timeout=300) as ld:
        with pytest.raises(en.WorkerError) as ei:
            for _ in ld:
                pass
        stats = ld.stats()
    msg = str(ei.value)
    assert f"the store at http://127.0.0.1:{port} is unreachable" in msg
    assert "connection refused" in msg and f"http://127.0.0.1:{port}/img/" in msg
    assert "whatever on_error says" in msg
    assert not stats["failures"]  # not counted as samples that failed


def test_an_unknown_host_is_a_store_that_is_down():
    """A name that does not resolve (.invalid never does) is the store being unreachable,
    named as such, not a missing object."""
    store = RemoteStore(options=RemoteOptions(attempts=1, retry_timeout=60.0,
                                              request_timeout=60.0))
    with pytest.raises(StoreUnavailableError) as ei:
        store.read_all("http://no-such-host.invalid/x.jpg", MiB)
    assert ei.value.endpoint == "http://no-such-host.invalid"
    assert "no such host" in str(ei.value)
    assert str(ei.value).startswith("http://no-such-host.invalid/x.jpg: the store at")


def test_store_unavailable_survives_pickling_and_copy():
    """The error crosses process boundaries (and the block cache's copy) whole."""
    import copy
    import pickle

    e = StoreUnavailableError(errno.ECONNREFUSED, "down", "s3://b/k", "http://h:1")
    for c in (pickle.loads(pickle.dumps(e)), copy.copy(e)):
        assert type(c) is StoreUnavailableError and str(c) == str(e)
        assert c.endpoint == "http://h:1" and c.errno == errno.ECONNREFUSED


# ---- 8: the retry budget holds, the request in flight included -------------------------------
def test_a_silent_server_costs_no_more_than_the_budget(server):
    """Against a server that never answers, the one try is cut at the budget (1 s) rather
    than given the request timeout (30 s): the error says the try was given no more than
    what was left of retry_timeout."""
    server.routes["/x.jpg"] = silent(server)
    store = RemoteStore(options=RemoteOptions(attempts=5, retry_timeout=1.0,
                                              request_timeout=30.0, backoff=0.01))
    with pytest.raises(RemoteReadError) as ei:
        store.read_all(server.url("/x.jpg"), MiB)
    msg = str(ei.value)
    assert ei.value.errno == errno.ETIMEDOUT and not isinstance(ei.value, StoreUnavailableError)
    given = float(re.search(r"no answer within ([0-9.]+) s", msg).group(1))
    assert given <= 1.0, msg
    assert "(retry_timeout=1 s)" in msg and server.url("/x.jpg") in msg


def test_default_budget_sits_well_under_sample_timeout():
    """With the defaults, a read gives up (its budget, plus the grace its prefetch wait
    adds) in under half the pipeline's default sample_timeout."""
    opts = RemoteOptions()
    sample_timeout = en.Workers().sample_timeout
    assert opts.request_timeout < opts.retry_timeout
    assert opts.retry_timeout + 5.0 <= sample_timeout / 2


def test_the_consumer_can_name_the_remote_read_that_hangs(server):
    """While a worker waits on a silent server, the pool says which worker holds the
    batch, which sample it is reading and its URL: what the consumer's timeout names."""
    server.routes["/hang.jpg"] = silent(server)
    rows = [(server.url("/hang.jpg"), 0)] + [(server.url(f"/ok{i}.jpg"), 0) for i in range(3)]
    src = en.FileList(rows, remote=RemoteOptions(prefetch=0, attempts=2, retry_timeout=60.0,
                                                 request_timeout=60.0, backoff=0.01))
    ld = en.Loader(src, batch_size=4, image_size=16, workers=1, shuffle=False,
                   on_error="skip", timeout=300)
    with ld:
        ld.start()
        pool, ring = ld._pool, ld.ring
        rh.wait_for(lambda: ring.reading(0) is not None and pool.holder(0) is not None,
                    "the worker inside the read of sample 0")
        text = pool.waiting_on(0)
        server.release.set()  # let the read fail, so that close() does not wait on it
    assert text.startswith("worker 0 holds it and has been reading and decoding sample 0 ")
    assert server.url("/hang.jpg") in text


# ---- 9: missing is not the same as down -------------------------------------------------------
def test_tarshards_on_a_closed_port_says_the_store_is_down():
    """Nothing listening: not "does not exist" at once, but retried, then the cause."""
    url = f"http://127.0.0.1:{closed_port()}/train/s.tar"
    with pytest.raises(StoreUnavailableError) as ei:
        en.TarShards([url], remote=QUICK, index_cache=False)
    msg = str(ei.value)
    assert not isinstance(ei.value, FileNotFoundError)
    assert msg.startswith(url) and "connection refused" in msg and "gave up after 3 tries" in msg


def test_tarshards_on_http_500_names_the_status_after_retrying(server):
    """HTTP 500 on every request: retried within the budget, then an error that says 500."""
    server.routes["/s.tar"] = lambda h, head: answer(h, head, 500, b"broken")
    with pytest.raises(RemoteReadError) as ei:
        en.TarShards([server.url("/s.tar")], remote=QUICK, index_cache=False)
    msg = str(ei.value)
    assert not isinstance(ei.value, FileNotFoundError) and "does not exist" not in msg
    assert "HTTP 500" in msg and "gave up after 3 tries" in msg
    assert server.requests[("HEAD", "/s.tar")] >= 3


def test_tarshards_rides_out_transient_500s(server, jpegs):
    """Two 500s, then the shard: read as if nothing happened."""
    data = _shard_bytes(jpegs[:4], [0, 1, 2, 3])
    server.routes["/s.tar"] = status_then_file(500, 2, data)
    tar = en.TarShards([server.url("/s.tar")], remote=QUICK, index_cache=False)
    assert [tar.read(i) for i in range(4)] == jpegs[:4]
    assert tar.labels.tolist() == [0, 1, 2, 3]


def test_tarshards_404_is_a_missing_shard(server):
    """A real 404 is still "does not exist", at once."""
    with pytest.raises(FileNotFoundError, match="does not exist"):
        en.TarShards([server.url("/gone.tar")], remote=QUICK, index_cache=False)


# ---- 14: a remote list names only what its store holds ----------------------------------------
def _serve_list(server, tmp_path, jpegs, entries):
    server.files["/lists/img/a.jpg"] = jpegs[0]
    server.files["/lists/train.csv"] = ("path,label\n" + "\n".join(
        f"{p},{lab}" for p, lab in entries) + "\n").encode()
    return server.url("/lists/train.csv")


def test_a_remote_list_cannot_make_workers_read_local_files(server, tmp_path, jpegs):
    """A list served over HTTP naming an absolute local path: refused at construction,
    naming the line, the entry and the option that allows it."""
    local = tmp_path / "private.jpg"
    local.write_bytes(jpegs[1])
    url = _serve_list(server, tmp_path, jpegs, [("img/a.jpg", 0), (str(local), 1)])
    with pytest.raises(ValueError) as ei:
        en.FileList(url, remote=QUICK)
    msg = str(ei.value)
    assert "train.csv:3" in msg and str(local) in msg and "a local path" in msg
    assert "trust_list=True" in msg
    trusted = en.FileList(url, remote=QUICK, trust_list=True)  # the user's explicit choice
    assert trusted.path(1) == str(local) and trusted.read(1) == jpegs[1]


@pytest.mark.parametrize("entry, what", [("file:///etc/hostname", "a local path"),
                                         ("~/.ssh/id_rsa", "a local path"),
                                         ("s3://bucket/x.jpg", "a s3:// URL")])
def test_a_remote_list_refuses_other_schemes(server, tmp_path, jpegs, entry, what):
    """file://, ~ and URLs of another scheme in an HTTP list are refused by name."""
    url = _serve_list(server, tmp_path, jpegs, [(entry, 0)])
    with pytest.raises(ValueError, match=re.escape(what)):
        en.FileList(url, remote=QUICK)


def test_a_remote_list_resolves_against_its_own_location(server, tmp_path, jpegs):
    """Relative entries and URLs of the list's own scheme are read from the store."""
    server.files["/other/b.jpg"] = jpegs[2]
    url = _serve_list(server, tmp_path, jpegs, [("img/a.jpg", 0),
                                                (server.url("/other/b.jpg"), 1)])
    src = en.FileList(url, remote=QUICK)
    assert src.path(0) == server.url("/lists/img/a.jpg")
    assert [src.read(0), src.read(1)] == [jpegs[0], jpegs[2]]
    assert server.requests[("GET", "/lists/img/a.jpg")] == 1

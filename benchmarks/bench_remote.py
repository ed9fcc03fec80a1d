"""The same tar shards read from local disk and from an S3 server, through the full pipeline,
in one run.

    python -m pytest benchmarks/bench_remote.py -s --benchmark-json=/tmp/remote.json

The corpus (``echo_native.lab.corpus``'s, ECHO_NATIVE_BENCH_REMOTE_N images, default
1200: more than the S3 workers' caches hold together) is packed once by
``echo_native.shards.write_shards`` into shards of ECHO_NATIVE_BENCH_REMOTE_SHARD
bytes (default 2 MB), with their ``.idx`` sidecars.  The same shard files are
read by ``echo_native.Loader`` (2 process workers, 224x224 RandomResizedCrop +
flip, uint8, null consumer), both with the same ``shuffle_buffer``
(ECHO_NATIVE_BENCH_REMOTE_SHUFFLE samples, default 64):

local    ``TarShards`` over the local files (os.pread)
s3       ``TarShards`` over ``s3://`` URLs of the same files, served by moto's S3 server
         (``python -m moto.server``, a separate process on localhost) through s3fs:
         shards read in blocks (``RemoteOptions.block_bytes``, default 8 MiB, so here
         a block is a whole 2 MB shard), one GET each, fetched ahead by each worker,
         with a block cache of ECHO_NATIVE_BENCH_REMOTE_CACHE bytes per worker
         (default 12 MiB: the blocks of a worker's batch and of its next one, and
         far less than the corpus, so every epoch reads every block from the
         server again, as with a data set much larger than the cache)

Both pipelines are started once; each round times one whole epoch (every
sample once), and the rounds alternate between the two, so the ratio compares
neighbouring rounds on a shared machine.  At the end the img/s of both (median
round) and the ratio s3/local are printed and written to
``benchmarks/results/remote.json``, with the GETs of shard data the server
answered per s3 epoch (counted from its request log).

What the ratio includes: moto is a Python server that copies the whole object
for every range request and runs on the same cores as the workers, so it is a
pessimistic stand-in for a real object store (which serves from other
machines); small shards keep its per-request copy small.

Environment:
  ECHO_NATIVE_BENCH_REMOTE_N       images (default 1200)
  ECHO_NATIVE_BENCH_BATCH          batch size (default 64)
  ECHO_NATIVE_BENCH_REMOTE_ROUNDS  timed epochs per pipeline (default 5)
  ECHO_NATIVE_BENCH_REMOTE_SHARD   shard size in bytes (default 2000000)
  ECHO_NATIVE_BENCH_REMOTE_SHUFFLE shuffle_buffer of both sources (default 64)
  ECHO_NATIVE_BENCH_REMOTE_CACHE   RemoteOptions.cache_bytes of the s3 source (default 12 MiB)
  ECHO_NATIVE_BENCH_REMOTE_BLOCK   RemoteOptions.block_bytes of the s3 source (default
                                   8 MiB; 0: one GET per sample)
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

import echo_native as en
from benchenv import env_int, wait_for_port
from echo_native.remote import RemoteOptions
from echo_native.shards import write_shards

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

N_IMAGES = env_int("ECHO_NATIVE_BENCH_REMOTE_N", 1200)
BATCH = env_int("ECHO_NATIVE_BENCH_BATCH", 64)
ROUNDS = env_int("ECHO_NATIVE_BENCH_REMOTE_ROUNDS", 5)
SHARD = env_int("ECHO_NATIVE_BENCH_REMOTE_SHARD", 2_000_000)
SHUFFLE = env_int("ECHO_NATIVE_BENCH_REMOTE_SHUFFLE", 64)
CACHE = env_int("ECHO_NATIVE_BENCH_REMOTE_CACHE", 12 * 2**20)
BLOCK = env_int("ECHO_NATIVE_BENCH_REMOTE_BLOCK", RemoteOptions().block_bytes)
WORKERS = 2
TARGET = 0.8
RESULTS = Path(__file__).resolve().parent / "results" / "remote.json"

_times: dict = {"local": [], "s3": []}
_server_cpu: list = []   # moto's CPU seconds per sample, in the s3 rounds
_server_pid: list = []
_server_log: list = []   # the server's request log (a file)
_server_gets: list = []  # GETs of shard data per s3 round


def _shard_gets():
    """GETs of shard data the server has logged so far."""
    with open(_server_log[0], "rb") as f:
        return f.read().count(b'"GET /bench/shard-')


def _cpu_s(pid):
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory):
    """moto's S3 server in its own process on a free port."""
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("moto") / "requests.log"
    _server_log.append(log)
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                 str(port)], stdout=subprocess.DEVNULL, stderr=err, env=env)
    wait_for_port(port, proc, "moto server")
    _server_pid.append(proc.pid)
    old = {k: os.environ.get(k) for k in env if k.startswith("AWS_")}
    os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
    yield f"http://127.0.0.1:{port}"
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def shard_sets(s3_endpoint, tmp_path_factory):
    import s3fs

    from echo_native.lab import corpus

    try:
        root = corpus.default_corpus(n_images=N_IMAGES, seed=env_int("ECHO_NATIVE_BENCH_SEED", 0))
    except ImportError as e:
        pytest.skip(str(e))
    src = en.Samples([p.read_bytes() for p in corpus.corpus_files(root)])
    local = write_shards(src, tmp_path_factory.mktemp("shards"), shard_size=SHARD,
                         progress=False)
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True)
    fs.mkdir("bench")
    for p in local:
        for f in (p, p + ".idx"):
            fs.put_file(f, f"bench/{os.path.basename(f)}")
    urls = [f"s3://bench/{os.path.basename(p)}" for p in local]
    return local, urls


@pytest.fixture(scope="module")
def loaders(shard_sets, s3_endpoint, tmp_path_factory):
    local, urls = shard_sets
    sources = {
        "local": en.TarShards(local, shuffle_buffer=SHUFFLE),
        "s3": en.TarShards(urls, shuffle_buffer=SHUFFLE,
                           storage_options={"endpoint_url": s3_endpoint},
                           index_cache=tmp_path_factory.mktemp("cache"),
                           remote=RemoteOptions(block_bytes=BLOCK,
                                                cache_bytes=max(CACHE, BLOCK))),
    }
    out = {}
    for name, src in sources.items():
        ld = en.Loader(src, BATCH, image_size=224, workers=WORKERS, seed=0)
        ld.__enter__()
        for _ in ld:  # warm-up epoch: interpreters, connections, page cache
            pass
        out[name] = (ld, len(src))
    yield out
    for ld, _ in out.values():
        ld.__exit__(None, None, None)
    _report(shard_sets)


def _epoch(ld):
    n = 0
    for b in ld:
        n += len(b.sample_ids)
    return n


def _timed(ld, n):
    t0 = time.perf_counter()
    got = _epoch(ld)
    dt = time.perf_counter() - t0
    assert got == n
    return dt


@pytest.mark.parametrize("name", ["local", "s3"])
def test_epoch(benchmark, loaders, name):
    ld, n = loaders[name]
    benchmark.extra_info.update(images=n, source=name, workers=WORKERS, batch=BATCH)
    benchmark.pedantic(_epoch, args=(ld,), rounds=ROUNDS, iterations=1)


def test_paired_rounds(loaders):
    """Alternating epochs of the two, for the ratio."""
    for _ in range(ROUNDS):
        for name in ("local", "s3"):
            ld, n = loaders[name]
            c0, g0 = _cpu_s(_server_pid[0]), _shard_gets()
            _times[name].append(n / _timed(ld, n))
            if name == "s3":
                _server_cpu.append((_cpu_s(_server_pid[0]) - c0) / n)
                _server_gets.append(_shard_gets() - g0)


def _report(shard_sets):
    if not _times["local"] or not _times["s3"]:
        return
    local = statistics.median(_times["local"])
    s3 = statistics.median(_times["s3"])
    ratio = s3 / local
    local_paths, _ = shard_sets
    n_images = len(en.TarShards(local_paths))
    result = {
        "local_img_per_s": local, "s3_img_per_s": s3, "ratio": ratio, "target": TARGET,
        "rounds": ROUNDS, "workers": WORKERS, "batch": BATCH, "shards": len(local_paths),
        "shard_bytes": SHARD, "shuffle_buffer": SHUFFLE, "block_bytes": BLOCK,
        "cache_bytes": max(CACHE, BLOCK), "images": n_images,
        "s3_gets_per_epoch": statistics.median(_server_gets), "per_round": _times,
        "cpus": len(os.sched_getaffinity(0)),
        "server_cpu_ms_per_sample": 1000 * statistics.median(_server_cpu),
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nlocal shards: {local:,.0f} img/s; s3 (moto on localhost): {s3:,.0f} img/s; "
          f"ratio {ratio:.2f} (target >= {TARGET}); {result['s3_gets_per_epoch']:.0f} GETs "
          f"of shard data per epoch of {n_images} images; the S3 server used "
          f"{result['server_cpu_ms_per_sample']:.1f} ms CPU per sample; {RESULTS}")

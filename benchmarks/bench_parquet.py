"""Images kept as Parquet (the Hugging Face hub's layout), read three ways, in one run.

    python -m pytest benchmarks/bench_parquet.py -s --benchmark-json=/tmp/parquet.json

The corpus (``echo_native.lab.corpus``'s, ECHO_NATIVE_BENCH_PARQUET_N images,
default 600) is written once as Parquet by ``datasets`` itself
(``Dataset.from_dict(...).cast_column("image", Image())`` with the bytes embedded,
a ``ClassLabel`` label, ``to_parquet``: its row groups of 100 images), and the
same JPEG files are an ImageFolder.  Every pipeline does 224x224
RandomResizedCrop (scale 0.08-1, ratio 3/4-4/3) + horizontal flip, uint8, with
2 workers and a null consumer:

hf        what users run today on those files: ``datasets.load_dataset("parquet")``
          with ``set_transform`` decoding every image with Pillow (the Image
          feature) and cropping with torchvision's RandomResizedCrop + flip when
          torchvision imports, else the same in Pillow as torchvision does it
          (``echo_native.lab.peers.rrc_params`` + ``resize(BILINEAR, box)``), in a
          torch ``DataLoader`` (shuffled, 2 workers, prefetch 4)
parquet   ``EchoRing(ParquetImages(files), echo=1)``: row groups read once per
          worker, the fused kernel decodes each crop
folder    ``EchoRing(ImageFolder(root), echo=1)`` over the same JPEG files
s3        (ECHO_NATIVE_BENCH_PARQUET_S3=1) ``parquet`` over ``s3://`` URLs of the same
          files, served by moto's S3 server in its own process on localhost

Each pipeline is started once, warmed, and read epoch after epoch (full batches,
``drop_last``).  The rounds alternate between pipelines, so the ratios compare
neighbouring rounds on a shared machine; before a round every other pipeline has
refilled its read-ahead (ring slots, a DataLoader's prefetch queue) and sleeps,
the measured one's read-ahead is taken untimed, then ECHO_NATIVE_BENCH_PARQUET_BATCHES
batches are timed: no side gets a head start or competes with another's refill.
The median img/s of each and the ratios parquet/hf (target >= 2.5),
parquet/folder (target >= 0.95) and s3/folder are printed and written to
``benchmarks/results/parquet.json``.

Environment:
  ECHO_NATIVE_BENCH_PARQUET_N       images (default 600)
  ECHO_NATIVE_BENCH_BATCH           batch size (default 64)
  ECHO_NATIVE_BENCH_PARQUET_ROUNDS  timed rounds per pipeline (default 5)
  ECHO_NATIVE_BENCH_PARQUET_BATCHES batches per timed round (default 16)
  ECHO_NATIVE_BENCH_PARQUET_S3      1: also the s3 pipeline (needs s3fs and moto)
"""
from __future__ import annotations

import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import echo_native as en
from benchenv import env_int, wait_for_port

datasets = pytest.importorskip("datasets")
pytest.importorskip("pyarrow")
torch = pytest.importorskip("torch")

N_IMAGES = env_int("ECHO_NATIVE_BENCH_PARQUET_N", 600)
BATCH = env_int("ECHO_NATIVE_BENCH_BATCH", 64)
ROUNDS = env_int("ECHO_NATIVE_BENCH_PARQUET_ROUNDS", 5)
TIMED_BATCHES = env_int("ECHO_NATIVE_BENCH_PARQUET_BATCHES", 16)
WITH_S3 = env_int("ECHO_NATIVE_BENCH_PARQUET_S3", 0) == 1
WORKERS = 2
SIZE = 224
TARGETS = {"parquet/hf": 2.5, "parquet/folder": 0.95}
RESULTS = Path(__file__).resolve().parent / "results" / "parquet.json"

_rates: dict = {}


def _torchvision_transform():
    """torchvision's RandomResizedCrop + flip + PILToTensor, or None where it does not
    import (the project's venv has torch without a matching torchvision)."""
    try:
        from torchvision import transforms as T
    except Exception:  # noqa: BLE001 - a broken install raises more than ImportError
        return None
    return T.Compose([T.RandomResizedCrop(SIZE, antialias=True), T.RandomHorizontalFlip(),
                      T.PILToTensor()])


class PillowRRC:
    """torchvision's RandomResizedCrop + flip + PILToTensor, written in Pillow as
    torchvision does it (the peer where torchvision does not load)."""

    def __init__(self, seed=0):
        self.rng = random.Random(seed)

    def __call__(self, im):
        from PIL import Image

        from echo_native.lab.peers import rrc_params

        top, left, h, w = rrc_params(self.rng, im.height, im.width)
        im = im.resize((SIZE, SIZE), Image.BILINEAR, box=(left, top, left + w, top + h))
        if self.rng.random() < 0.5:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.array(im)).permute(2, 0, 1)


def _hf_transform():
    crop = _torchvision_transform() or PillowRRC()

    def transform(batch):
        # What a user's set_transform does: the Image feature has decoded each image
        # (Pillow, whole) by the time it gets here.
        return {"pixel_values": [crop(im.convert("RGB")) for im in batch["image"]],
                "label": batch["label"]}
    return transform


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from echo_native.lab import corpus

    try:
        root = corpus.default_corpus(n_images=N_IMAGES, seed=env_int("ECHO_NATIVE_BENCH_SEED", 0))
    except ImportError as e:
        pytest.skip(str(e))
    folder = en.ImageFolder(root)
    blobs = [Path(folder.path(i)).read_bytes() for i in range(len(folder))]
    feats = datasets.Features({"image": datasets.Image(),
                               "label": datasets.ClassLabel(names=folder.classes)})
    ds = datasets.Dataset.from_dict({"image": [{"bytes": b, "path": None} for b in blobs],
                                     "label": folder.labels.tolist()}, features=feats)
    out = tmp_path_factory.mktemp("parquet")
    paths = []
    for k in range(2):  # two files, as the hub shards a split
        part = ds.shard(2, k, contiguous=True)
        p = out / f"train-{k:05d}-of-00002.parquet"
        part.to_parquet(str(p))
        paths.append(str(p))
    return root, paths, tmp_path_factory.mktemp("hf-cache")


def _s3_urls(paths, tmp_path_factory):
    """moto's S3 server in its own process, the files uploaded: (urls, options, stop)."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    import s3fs

    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    os.environ.update(env)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, **env})
    wait_for_port(port, proc, "moto server")
    endpoint = f"http://127.0.0.1:{port}"
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
    fs.mkdir("bench")
    for p in paths:
        fs.put_file(p, f"bench/{os.path.basename(p)}")

    def stop():
        proc.terminate()
        proc.wait(10)
    return [f"s3://bench/{os.path.basename(p)}" for p in paths], \
        {"endpoint_url": endpoint}, stop


class RingStream:
    """An EchoRing (echo=1) read epoch after epoch; ``ahead``: the batches it holds ready."""

    def __init__(self, src):
        self.ring = en.EchoRing(src, batch_size=BATCH, image_size=SIZE, echo=1,
                                workers=WORKERS, seed=0, drop_last=True)
        self.ring.__enter__()
        self.ahead = self.ring.loader.slots if hasattr(self.ring, "loader") else 4
        self.it = self._batches()

    def _batches(self):
        while True:
            for b in self.ring:
                yield len(b.sample_ids)

    def next(self):
        return next(self.it)

    def settle(self, timeout=30.0):
        """Until its ring is full: its workers asleep, not competing with a timed round."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            occupancy = self.ring.stats().get("ring_occupancy", 1.0)
            if occupancy >= (self.ahead - 1) / self.ahead - 1e-9:
                return
            time.sleep(0.01)

    def close(self):
        self.ring.__exit__(None, None, None)


class HfStream:
    """``datasets`` + set_transform in a torch DataLoader, read epoch after epoch."""

    def __init__(self, paths, cache):
        ds = datasets.load_dataset("parquet", data_files=paths, split="train",
                                   cache_dir=str(cache))
        ds.set_transform(_hf_transform())
        g = torch.Generator().manual_seed(0)
        self.dl = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=True, generator=g,
                                              num_workers=WORKERS, persistent_workers=True,
                                              drop_last=True, prefetch_factor=2)
        self.ahead = 2 * WORKERS  # prefetch_factor x workers
        self.it = self._batches()
        self.last_used = time.monotonic()

    def _batches(self):
        while True:
            for b in self.dl:
                yield len(b["label"])

    def next(self):
        n = next(self.it)
        self.last_used = time.monotonic()
        return n

    def settle(self):
        """No public way to ask a DataLoader whether its queue is full: the time its
        workers take to refill it (~150 img/s per worker and more)."""
        left = self.last_used + 1.0 + self.ahead * BATCH / (150.0 * WORKERS) - time.monotonic()
        if left > 0:
            time.sleep(left)

    def close(self):
        del self.it


@pytest.fixture(scope="module")
def pipelines(files, tmp_path_factory):
    root, paths, cache = files
    made = {"hf": HfStream(paths, cache),
            "parquet": RingStream(en.ParquetImages(paths)),
            "folder": RingStream(en.ImageFolder(root))}
    stop = None
    if WITH_S3:
        urls, opts, stop = _s3_urls(paths, tmp_path_factory)
        made["s3"] = RingStream(en.ParquetImages(urls, storage_options=opts))
    for name, stream in made.items():
        for _ in range(stream.ahead + 2):  # warm-up: interpreters, page cache, connections
            stream.next()
        _rates[name] = []
    yield made
    for stream in made.values():
        stream.close()
    if stop is not None:
        stop()
    _report()


def test_paired_rounds(pipelines):
    """Round-robin rounds of every pipeline, for the ratios.  Before a round, every other
    pipeline has refilled its read-ahead and sleeps, and what the measured one read
    ahead while idle is taken untimed: no side gets a head start or competes."""
    for _ in range(ROUNDS):
        for name, stream in pipelines.items():
            for other, s in pipelines.items():
                if other != name:
                    s.settle()
            for _ in range(stream.ahead):
                stream.next()
            t0 = time.perf_counter()
            n = sum(stream.next() for _ in range(TIMED_BATCHES))
            dt = time.perf_counter() - t0
            assert n == TIMED_BATCHES * BATCH
            _rates[name].append(n / dt)


def _report():
    if not all(_rates.values()):
        return
    med = {k: statistics.median(v) for k, v in _rates.items()}
    ratios = {"parquet/hf": med["parquet"] / med["hf"],
              "parquet/folder": med["parquet"] / med["folder"]}
    if "s3" in med:
        ratios["s3/folder"] = med["s3"] / med["folder"]
    result = {"img_per_s": med, "ratios": ratios, "targets": TARGETS, "rounds": ROUNDS,
              "workers": WORKERS, "batch": BATCH, "images": N_IMAGES,
              "hf_crop": "torchvision" if _torchvision_transform() else "pillow",
              "per_round": _rates, "cpus": len(os.sched_getaffinity(0))}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print("\n" + "; ".join(f"{k}: {v:,.0f} img/s" for k, v in med.items()))
    print("; ".join(f"{k} {v:.2f}" + (f" (target >= {TARGETS[k]})" if k in TARGETS else "")
                    for k, v in ratios.items()) + f"; {RESULTS}")

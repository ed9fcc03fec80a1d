"""Ring + worker pipeline throughput vs a torch DataLoader, NVIDIA DALI's CPU pipeline, SPDL
and turboloader, on the same files in one run.

    python -m pytest benchmarks/bench_pipeline.py -s --benchmark-json=/tmp/pipeline.json

Every benchmark reads the same JPEG files from disk (page cache) and makes
224x224 RandomResizedCrop (scale 0.08-1, ratio 3/4-4/3) + random horizontal
flip crops, uint8.  Measured, each as images/s (best and median round):

loader_w1, loader_w2   ``echo_native.Loader`` (process workers, shared-memory ring),
                       null consumer, steady state
torch_w1, torch_w2     torch ``DataLoader`` (fork workers, default collate) over a
                       torchvision-style Dataset: Pillow open + convert("RGB") ->
                       ``RandomResizedCrop.get_params`` (torch RNG, exactly as
                       torchvision) -> ``resize(size, BILINEAR, box)`` -> random
                       horizontal flip -> PILToTensor (copy, CHW).  torchvision
                       itself does not install beside the CPU torch wheel here,
                       so these are torchvision's Pillow calls, not torchvision.
dali_w1, dali_w2       NVIDIA DALI's CPU pipeline (``echo_native.lab.peers.dali_pipeline``,
                       ``pip install nvidia-dali-cuda120``, no GPU needed):
                       ``readers.file(random_shuffle=True)`` ->
                       ``decoders.image_random_crop`` (same area and aspect ranges)
                       -> ``resize`` (linear, antialiased) -> ``flip`` on a coin,
                       ``num_threads`` = 1 or 2, batches taken as NumPy (a
                       zero-copy view).  Without DALI installed these rows are
                       left out and the summary says so.
spdl_w1, spdl_w2       SPDL 0.8's thread pipeline (``echo_native.lab.peers.spdl_pipeline``,
                       ``pip install spdl==0.8.0`` + FFmpeg's shared libraries):
                       ``.pipe(decode, concurrency=W)`` -> ``.aggregate(B)`` ->
                       collate, ``num_threads=W``; each decode demuxes the file,
                       draws the same RandomResizedCrop box and flip, and decodes
                       through a per-image FFmpeg filter (crop -> bilinear scale ->
                       rgb24 -> hflip), uint8.  Its source hands out samples only
                       as batches are taken, so it runs exactly 2 batches ahead.
turbo_wT,              turboloader's fused ``train_aug`` loader (``pip install
turbo_noaa_wT          turboloader``) over the files packed once into a TAR
                       (cached, untimed), antialias on and off: its own
                       RandomResizedCrop on the whole image decoded at a DCT
                       scale, float32 output.  Its pool has T = the machine's
                       cores threads (no setting), so these rows exist only
                       where T is 1 or 2, beside the Loader at as many workers;
                       no read-ahead (``prefetch_batches=0``): the pool decodes
                       each batch as it is asked for, so nothing runs between
                       rounds.
kernel                 ``echo_native.decode_random_crop`` in a loop, one thread,
                       bytes preloaded (the per-core ceiling the workers scale)

and the consumer's cost per batch once the batch is ready:

consumer_loader_b256   ``Loader.next_batch()`` for a 256x224x224x3 batch already in
                       the ring (workers have filled every slot first)
consumer_loader_b32    the same for a 32-image batch (O(1) in batch size?)
consumer_torch_b256    ``next(iterator)`` of a torch DataLoader whose worker already
                       collated the 256-image batch (IPC receive + rebuild)
assembly_torch_b256    per-batch time of a torch DataLoader whose dataset returns a
                       ready tensor: worker-side collate + IPC, no decoding

Throughput is measured in steady state.  All the pipelines (``ROLES``) are started
once and stay alive (an idle one has a full ring or prefetch queue and sleeping
workers); before a timed round every other pipeline is left to finish
refilling, the measured one is drained of what it prefetched while idle
(untimed), and then a fixed number of full batches (``drop_last``) is timed,
so no side gets a head start or competes with another's refill.
``test_paired_rounds`` measures them round-robin, so each ratio compares
rounds a few seconds apart (the machine may be shared); its per-cycle medians
are the headline ratios.

At the end of the module a ratio table is printed (visible with ``-s``) and
written to ``benchmarks/results/pipeline.json``, with the CPU time other
processes used during the run (a disturbed run says so).

Environment (besides the corpus settings in ``conftest.py``):
  ECHO_NATIVE_BENCH_BATCH            batch size of the throughput runs (default 64)
  ECHO_NATIVE_BENCH_PIPELINE_ROUNDS  timed rounds per throughput benchmark (default 3)
  ECHO_NATIVE_BENCH_PAIRED_ROUNDS    round-robin cycles of test_paired_rounds (default 5)
  ECHO_NATIVE_BENCH_HANDOFF_ROUNDS   timed rounds per consumer-cost benchmark (default 15)
"""
from __future__ import annotations

import collections
import json
import math
import statistics
import threading
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest

import echo_native as en
from benchenv import Repeat, env_int, load_mark, load_since
from echo_native.lab import peers

torch = pytest.importorskip("torch")

SIZE = 224
SCALE = (0.08, 1.0)
RATIO = (3.0 / 4.0, 4.0 / 3.0)
SEED = 1234
HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "pipeline.json"
TORCH_LABEL = "torch DataLoader + torchvision-style Pillow transforms"
DALI_LABEL = "NVIDIA DALI CPU pipeline: image_random_crop + resize + flip"
SPDL_LABEL = "SPDL thread pipeline: FFmpeg decode + per-image crop/scale/flip filter"
TURBO_LABEL = "turboloader train_aug over a TAR, float32, antialias {}"


def _missing(check):
    """None when the peer's package imports, else why not (with what to install)."""
    try:
        check()
    except ImportError as e:
        return str(e)
    return None


# The optional peers: their rows are left out without them, and the summary says why.
DALI_MISSING = _missing(peers.import_dali)
SPDL_MISSING = _missing(peers.import_spdl)
TURBO_MISSING = _missing(peers.import_turboloader)
TURBO_THREADS = peers.turboloader_threads()

# Design targets of Loader / peer, per worker count (None: reported, no target).
TARGETS = {"torch": {1: 2.5, 2: 4.0}, "dali": {1: None, 2: 3.0}, "spdl": {1: None, 2: 1.0},
           "turbo": {1: None, 2: None}, "turbo_noaa": {1: None, 2: None}}
PEERS = {"torch": "torch DataLoader", "dali": "DALI CPU", "spdl": "SPDL",
         "turbo": "turboloader", "turbo_noaa": "turboloader (no antialias)"}


BATCH = env_int("ECHO_NATIVE_BENCH_BATCH", 64)
ROUNDS = env_int("ECHO_NATIVE_BENCH_PIPELINE_ROUNDS", 3)
HANDOFF_ROUNDS = env_int("ECHO_NATIVE_BENCH_HANDOFF_ROUNDS", 15)
PAIRED_ROUNDS = env_int("ECHO_NATIVE_BENCH_PAIRED_ROUNDS", 5)

_results: dict = {}




@pytest.fixture(scope="module", autouse=True)
def report():
    """Print the ratio table and save the numbers when the module's benchmarks are done."""
    mark = load_mark()
    yield
    _results["_machine"] = load_since(mark)
    if len(_results) > 1:
        _finish(_results)


# ---- torchvision-style peer -------------------------------------------------------------------
def rrc_get_params(width, height, scale=SCALE, ratio=RATIO):
    """torchvision.transforms.RandomResizedCrop.get_params, verbatim (torch RNG)."""
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = torch.randint(0, height - h + 1, size=(1,)).item()
            j = torch.randint(0, width - w + 1, size=(1,)).item()
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class TorchvisionStyleFolder(torch.utils.data.Dataset):
    """ImageFolder(transform=Compose([RandomResizedCrop(224), RandomHorizontalFlip(),
    PILToTensor()])) made of the same Pillow calls torchvision makes."""

    def __init__(self, paths, labels, size=SIZE):
        self.paths, self.labels, self.size = list(paths), [int(x) for x in labels], size

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        from PIL import Image

        with open(self.paths[index], "rb") as f:      # torchvision's pil_loader
            img = Image.open(f)
            img = img.convert("RGB")
        i, j, h, w = rrc_get_params(*img.size)
        img = img.resize((self.size, self.size), Image.BILINEAR, box=(j, i, j + w, i + h))
        if torch.rand(1) < 0.5:                        # RandomHorizontalFlip
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        # PILToTensor: a copy of the pixels, HWC -> CHW
        return torch.from_numpy(np.array(img, copy=True)).permute(2, 0, 1), self.labels[index]


class _Constant(torch.utils.data.Dataset):
    """A ready 3x224x224 uint8 tensor per sample: isolates collate + IPC."""

    def __init__(self, n):
        self.n = n
        self.img = torch.randint(0, 256, (3, SIZE, SIZE), dtype=torch.uint8)

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return self.img, index


def _torch_loader(ds, batch_size, workers, prefetch_factor=2):
    g = torch.Generator().manual_seed(SEED)
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=True, generator=g,
                                       num_workers=workers, drop_last=True,
                                       prefetch_factor=prefetch_factor,
                                       persistent_workers=False)


# ---- streams: next() returns the batch's image count ----------------------------------------
class LoaderStream:
    label = "echo_native Loader (process workers, shm ring)"

    def __init__(self, src, workers, batch_size):
        self.L = en.Loader(src, batch_size=batch_size, image_size=SIZE, workers=workers,
                           worker_mode="process", seed=SEED, drop_last=True, timeout=120)
        self.L.start()
        self.ahead = self.L.slots          # batches it can hold ready

    def next(self):
        return len(self.L.next_batch())

    def settle(self, timeout=30.0):
        """Until the ring is full (every slot but the held one published)."""
        deadline = time.monotonic() + timeout
        while self.L.stats()["ring_occupancy"] < (self.L.slots - 1) / self.L.slots - 1e-9:
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)

    def close(self):
        self.L.close()


class TorchStream:
    label = TORCH_LABEL

    def __init__(self, src, workers, batch_size):
        ds = TorchvisionStyleFolder([src.path(i) for i in range(len(src))], src.labels)
        self.dl = _torch_loader(Repeat(ds, 10_000), batch_size, workers)
        self.it = iter(self.dl)
        self.ahead = 2 * workers           # prefetch_factor x workers
        self.last_used = time.monotonic()
        self.refill_s = 1.0 + 2 * batch_size / 300.0

    def next(self):
        n = int(next(self.it)[0].shape[0])
        self.last_used = time.monotonic()
        return n

    def settle(self):
        """Until its workers have had time to fill the prefetch queue (no public way to ask):
        prefetch_factor x workers batches take ~0.3 s at ~450 img/s per worker."""
        left = self.last_used + self.refill_s - time.monotonic()
        if left > 0:
            time.sleep(left)

    def close(self):
        del self.it                        # shuts its workers down


class DaliStream:
    """DALI's CPU pipeline, driven by ``schedule_run()`` + ``outputs()`` (what ``run()``
    does), so that ``settle`` can wait for exactly the batches it prefetches."""
    label = DALI_LABEL

    def __init__(self, src, workers, batch_size):
        # no pad_last_batch: the reader streams across epochs, every batch full
        self.pipe = peers.dali_pipeline(src, batch_size, workers, SIZE, SEED,
                                        pad_last_batch=False)
        self.ahead = self.pipe.prefetch_queue_depth   # batches it runs ahead
        self.ready = collections.deque()
        self.pipe.schedule_run()           # the first call queues `ahead` runs
        self.in_flight = self.ahead

    def next(self):
        if self.ready:
            out = self.ready.popleft()
        else:
            out = self.pipe.outputs()
            self.in_flight -= 1
        self.pipe.schedule_run()
        self.in_flight += 1
        return len(peers.dali_batch(out)[0])

    def settle(self):
        """Until the runs it has queued are done (their outputs kept for ``next``)."""
        while self.in_flight:
            self.ready.append(self.pipe.outputs())
            self.in_flight -= 1

    def close(self):
        self.ready.clear()
        self.pipe = None                   # the last reference: DALI shuts its threads down


class SpdlStream:
    """SPDL's pipeline fed by a source that hands out samples only against credit: one
    batch's worth each time a batch is taken, ``ahead`` batches at the start.  So it
    runs exactly ``ahead`` batches ahead, and ``settle`` waits for those (its collate
    stage counts the batches it finishes).  The source never ends (epoch after epoch,
    each shuffled): every batch is full."""
    label = SPDL_LABEL
    ahead = 2

    def __init__(self, src, workers, batch_size):
        self.batch_size, self.n = batch_size, len(src)
        self.cond = threading.Condition()
        self.credit = 0                    # samples the source may still hand out
        self.issued = self.done = 0        # batches asked for / finished
        self.closed = False
        self.pipe, self.decode = peers.spdl_pipeline(
            src, batch_size, workers, SIZE, SEED, source=self._source(),
            buffer=self.ahead + 1, collate=self._collate)
        self.pipe.start(timeout=60)
        self._issue(self.ahead)

    def _source(self):
        epoch = 0
        while True:
            for i in np.random.default_rng([SEED, epoch]).permutation(self.n):
                with self.cond:
                    if not self.cond.wait_for(lambda: self.credit or self.closed, timeout=60):
                        raise TimeoutError("SPDL's source waited 60 s for a batch to be taken")
                    if self.closed:
                        return
                    self.credit -= 1
                yield epoch, int(i)
            epoch += 1

    def _collate(self, items):
        batch = peers.spdl_collate(items)
        with self.cond:
            self.done += 1
            self.cond.notify_all()
        return batch

    def _issue(self, batches):
        with self.cond:
            self.issued += batches
            self.credit += batches * self.batch_size
            self.cond.notify_all()

    def next(self):
        self._issue(1)
        return len(self.pipe.get_item(timeout=60)[0])

    def settle(self):
        """Until every batch handed out is finished (waiting in the sink)."""
        with self.cond:
            done = self.cond.wait_for(
                lambda: self.done >= self.issued or self.decode.failures, timeout=60)
        # a file it could not decode leaves a batch short of its last sample
        assert not self.decode.failures, f"SPDL could not decode: {self.decode.errors}"
        if not done:
            raise TimeoutError(f"SPDL finished {self.done} of {self.issued} batches in 60 s")

    def close(self):
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.pipe.stop(timeout=60)


class TurboStream:
    """turboloader without read-ahead, epoch after epoch (``drop_last``: every batch full);
    each ``next`` is one batch decoded by its whole pool, in the calling thread and the
    pool's."""
    ahead = 0

    def __init__(self, src, workers, batch_size, antialias=True):
        self.label = TURBO_LABEL.format("on" if antialias else "off")
        self.loader = peers.TurboLoader(src, batch_size, SIZE, SEED, antialias=antialias,
                                        prefetch_batches=0, drop_last=True)
        if not len(self.loader):
            raise pytest.UsageError(f"turboloader needs at least {batch_size} files for one "
                                    f"full batch (ECHO_NATIVE_BENCH_N={len(src)})")
        self.it = self._forever()

    def _forever(self):
        while True:
            yield from self.loader

    def next(self):
        return len(next(self.it)[0])

    def settle(self):
        pass

    def close(self):
        self.it.close()
        self.loader.close()


class KernelStream:
    """One thread running the fused kernel over the preloaded bytes of the same files."""
    label = "echo_native.decode_random_crop, one thread, bytes preloaded"
    ahead = 0

    def __init__(self, src, batch_size):
        self.data = [src.read(i) for i in range(len(src))]
        self.out = np.empty((SIZE, SIZE, 3), np.uint8)
        self.batch_size, self.pos = batch_size, 0

    def settle(self):
        pass

    def next(self):
        for _ in range(self.batch_size):
            sid = self.pos % len(self.data)
            en.decode_random_crop(self.data[sid], (SIZE, SIZE), SEED, 0, sid, out=self.out)
            self.pos += 1
        return self.batch_size

    def close(self):
        pass


ROLES = {  # role -> (kind, workers), in the order of a paired cycle
    "kernel": ("kernel", 1),
    "loader_w1": ("loader", 1), "torch_w1": ("torch", 1), "dali_w1": ("dali", 1),
    "spdl_w1": ("spdl", 1),
    "loader_w2": ("loader", 2), "torch_w2": ("torch", 2), "dali_w2": ("dali", 2),
    "spdl_w2": ("spdl", 2),
}
if TURBO_THREADS in (1, 2):
    ROLES |= {f"turbo_w{TURBO_THREADS}": ("turbo", TURBO_THREADS),
              f"turbo_noaa_w{TURBO_THREADS}": ("turbo_noaa", TURBO_THREADS)}
_LEFT_OUT = {"dali": DALI_MISSING, "spdl": SPDL_MISSING, "turbo": TURBO_MISSING,
             "turbo_noaa": TURBO_MISSING}
ROLES = {role: spec for role, spec in ROLES.items() if not _LEFT_OUT.get(spec[0])}
STREAMS = {"loader": LoaderStream, "torch": TorchStream, "dali": DaliStream,
           "spdl": SpdlStream, "turbo": TurboStream,
           "turbo_noaa": partial(TurboStream, antialias=False)}


class Streams:
    """Every pipeline of the comparison, started once and kept alive for the module.

    A pipeline that is not being measured is idle: its ring (or prefetch queue)
    is full and its workers sleep, so it takes no CPU from the one measured.
    """

    def __init__(self, src):
        self.src, self.live = src, {}
        self.batches = max(4, (3 * len(src)) // BATCH)   # ~3 passes over the files a round

    def get(self, role):
        if role not in self.live:
            kind, w = ROLES[role]
            if kind == "kernel":
                stream = KernelStream(self.src, BATCH)
            else:
                stream = STREAMS[kind](self.src, w, BATCH)
            self.live[role] = stream
            for _ in range(2):                # warm-up: workers started, caches hot
                for _ in range(stream.ahead + 1):
                    stream.next()
        return self.live[role]

    def settle(self, role):
        """Wait until every other pipeline has refilled its prefetch and gone to sleep,
        so that none of them decodes during ``role``'s timed round."""
        for other, stream in self.live.items():
            if other != role:
                stream.settle()

    def drain(self, role):
        """Take (untimed) what the pipeline prefetched while it was not measured."""
        self.settle(role)
        stream = self.get(role)
        for _ in range(stream.ahead):
            stream.next()

    def timed(self, role):
        """One timed round of ``batches`` whole batches; returns seconds."""
        stream = self.get(role)
        t0 = time.perf_counter()
        images = 0
        for _ in range(self.batches):
            images += stream.next()
        took = time.perf_counter() - t0
        assert images == self.batches * BATCH
        return took

    def close(self):
        for stream in self.live.values():
            stream.close()
        self.live.clear()


@pytest.fixture(scope="module")
def streams(folder):
    s = Streams(folder)
    yield s
    s.close()


def _throughput(benchmark, streams, role):
    stream = streams.get(role)
    times = []

    def timed():
        times.append(streams.timed(role))

    images = streams.batches * BATCH
    benchmark.extra_info.update(role=role, label=stream.label, images=images,
                                workers=ROLES[role][1], batch_size=BATCH,
                                files=len(streams.src))
    benchmark.pedantic(timed, setup=lambda: streams.drain(role), rounds=ROUNDS, iterations=1)
    _results[role] = {"label": stream.label, "workers": ROLES[role][1],
                      "images_per_round": images, "best": images / min(times),
                      "median": images / statistics.median(times), "rounds": len(times)}


# ---- benchmarks ------------------------------------------------------------------------------------
@pytest.mark.benchmark(group="pipeline")
@pytest.mark.parametrize("workers", [1, 2])
def test_loader_throughput(benchmark, streams, workers):
    """Images/s of Loader (process workers) with a null consumer."""
    _throughput(benchmark, streams, f"loader_w{workers}")


@pytest.mark.benchmark(group="pipeline")
@pytest.mark.parametrize("workers", [1, 2])
def test_torch_dataloader_throughput(benchmark, streams, workers):
    """Images/s of torch DataLoader + torchvision-style Pillow transforms, null consumer."""
    _throughput(benchmark, streams, f"torch_w{workers}")


@pytest.mark.benchmark(group="pipeline")
@pytest.mark.parametrize("workers", [1, 2])
def test_dali_cpu_throughput(benchmark, streams, workers):
    """Images/s of NVIDIA DALI's CPU pipeline with ``workers`` threads, null consumer."""
    if DALI_MISSING:
        pytest.skip(DALI_MISSING)
    _throughput(benchmark, streams, f"dali_w{workers}")


@pytest.mark.benchmark(group="pipeline")
@pytest.mark.parametrize("workers", [1, 2])
def test_spdl_throughput(benchmark, streams, workers):
    """Images/s of SPDL's thread pipeline with ``workers`` threads, null consumer."""
    if SPDL_MISSING:
        pytest.skip(SPDL_MISSING)
    _throughput(benchmark, streams, f"spdl_w{workers}")


@pytest.mark.benchmark(group="pipeline")
@pytest.mark.parametrize("antialias", [True, False], ids=["antialias", "no_antialias"])
def test_turboloader_throughput(benchmark, streams, antialias):
    """Images/s of turboloader's fused loader (its pool: the machine's cores), null
    consumer."""
    if TURBO_MISSING:
        pytest.skip(TURBO_MISSING)
    role = f"turbo{'' if antialias else '_noaa'}_w{TURBO_THREADS}"
    if role not in ROLES:
        pytest.skip(f"turboloader's pool has {TURBO_THREADS} threads (the machine's cores, "
                    f"no setting): no Loader row with as many workers to set it beside")
    _throughput(benchmark, streams, role)


@pytest.mark.benchmark(group="pipeline")
def test_kernel_single_thread(benchmark, streams):
    """Images/s of decode_random_crop in one thread over the same files (bytes preloaded)."""
    _throughput(benchmark, streams, "kernel")


@pytest.mark.benchmark(group="pipeline-paired")
def test_paired_rounds(benchmark, streams):
    """All the pipelines measured round-robin, so each ratio compares adjacent rounds."""
    order = list(ROLES)
    paired = {r: [] for r in order}

    def cycle():
        for role in order:
            streams.drain(role)
            paired[role].append(streams.timed(role))

    images = streams.batches * BATCH
    benchmark.extra_info.update(role="paired_cycle", roles=order, images_per_role=images)
    benchmark.pedantic(cycle, rounds=PAIRED_ROUNDS, iterations=1)
    rate = {r: [images / t for t in paired[r]] for r in order}
    n = len(rate["kernel"])

    def per_round(values):
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    out = {"rounds": n, "rates_median": {r: statistics.median(v) for r, v in rate.items()}}
    for w in (1, 2):
        for peer in PEERS:
            if f"{peer}_w{w}" in rate:
                out[f"loader_w{w} / {peer}_w{w}"] = per_round(
                    [rate[f"loader_w{w}"][i] / rate[f"{peer}_w{w}"][i] for i in range(n)])
        out[f"loader_w{w} / (kernel x {w})"] = per_round(
            [rate[f"loader_w{w}"][i] / (w * rate["kernel"][i]) for i in range(n)])
    _results["paired"] = out


def _ring_full(L):
    """True when every slot but the one the consumer holds is published."""
    need = (L.slots - 1) / L.slots
    return L.stats()["ring_occupancy"] >= need - 1e-9


@pytest.mark.benchmark(group="pipeline-handoff")
@pytest.mark.parametrize("batch_size", [256, 32])
def test_consumer_cost_loader(benchmark, folder, batch_size):
    """Time of Loader.next_batch() when the batch is already in a full ring."""
    if len(folder) < batch_size:
        pytest.skip(f"needs at least {batch_size} files (ECHO_NATIVE_BENCH_N={len(folder)})")
    times = []
    with en.Loader(folder, batch_size=batch_size, image_size=SIZE, workers=2, slots=3,
                   worker_mode="process", seed=SEED, drop_last=True, timeout=120) as L:

        def wait_full():
            deadline = time.monotonic() + 60
            while not _ring_full(L):
                assert time.monotonic() < deadline, "the workers never filled the ring"
                time.sleep(0.005)

        held = {}

        def handoff():
            # the previous batch is dropped inside the timed region, as in a training loop
            t0 = time.perf_counter()
            held.pop("batch", None)
            held["batch"] = L.next_batch()
            times.append(time.perf_counter() - t0)
            assert held["batch"].images.shape == (batch_size, SIZE, SIZE, 3)

        for _ in range(2):
            wait_full()
            handoff()
        times.clear()
        benchmark.extra_info.update(role=f"consumer_loader_b{batch_size}",
                                    label=f"Loader.next_batch(), {batch_size}x224x224x3 ready",
                                    batch_size=batch_size)
        benchmark.pedantic(handoff, setup=wait_full, rounds=HANDOFF_ROUNDS, iterations=1)
        held.clear()
    _results[f"consumer_loader_b{batch_size}"] = _ms(times, batch_size)


@pytest.mark.benchmark(group="pipeline-handoff")
def test_consumer_cost_torch(benchmark):
    """Time of next(DataLoader iterator) when the worker has already collated the batch."""
    batch_size = 256
    dl = _torch_loader(_Constant(batch_size * 1000), batch_size, workers=1)
    state = {"it": iter(dl)}
    times = []

    def wait_ready():
        time.sleep(0.4)                     # the worker collates its 2 prefetched batches

    held = {}

    def handoff():
        # the previous batch is dropped inside the timed region, as in a training loop
        # (for torch that unmaps its shared-memory storage)
        t0 = time.perf_counter()
        held.pop("batch", None)
        held["batch"] = next(state["it"])
        times.append(time.perf_counter() - t0)
        assert held["batch"][0].shape == (batch_size, 3, SIZE, SIZE)

    try:
        for _ in range(2):
            wait_ready()
            handoff()
        times.clear()
        benchmark.extra_info.update(role="consumer_torch_b256",
                                    label="torch next(it), 256x3x224x224 already collated",
                                    batch_size=batch_size)
        benchmark.pedantic(handoff, setup=wait_ready, rounds=HANDOFF_ROUNDS, iterations=1)
    finally:
        held.clear()
        state.clear()                       # shuts the iterator's worker down
    _results["consumer_torch_b256"] = _ms(times, batch_size)


@pytest.mark.benchmark(group="pipeline-handoff")
def test_batch_assembly_torch(benchmark):
    """Per-batch time of a torch DataLoader that only collates + ships ready tensors."""
    batch_size = 256
    dl = _torch_loader(_Constant(batch_size * 1000), batch_size, workers=1)
    state = {"it": iter(dl)}
    times = []
    per_round = 8

    def stream():
        t0 = time.perf_counter()
        for _ in range(per_round):
            next(state["it"])
        times.append((time.perf_counter() - t0) / per_round)

    try:
        for _ in range(3):
            next(state["it"])
        benchmark.extra_info.update(role="assembly_torch_b256",
                                    label="torch DataLoader collate + IPC per 256-batch",
                                    batch_size=batch_size)
        benchmark.pedantic(stream, rounds=max(3, HANDOFF_ROUNDS // 3), iterations=1)
    finally:
        state.clear()
    _results["assembly_torch_b256"] = _ms(times, batch_size)


def _ms(times, batch_size):
    return {"batch_size": batch_size, "best_ms": 1e3 * min(times),
            "median_ms": 1e3 * statistics.median(times), "rounds": len(times)}


# ---- the summary ------------------------------------------------------------------------------------
def _dali_version():
    import nvidia.dali

    return f"nvidia-dali {nvidia.dali.__version__}, CPU only"


def _peer_versions():
    """One line per optional peer: its version, or why its rows are left out."""
    from importlib.metadata import version

    lines = [f"DALI rows left out, DALI is not installed: {DALI_MISSING}" if DALI_MISSING
             else f"DALI: {_dali_version()}",
             f"SPDL rows left out: {SPDL_MISSING}" if SPDL_MISSING
             else f"SPDL: spdl {version('spdl')}, thread pipeline, FFmpeg on the CPU"]
    if TURBO_MISSING:
        lines.append(f"turboloader rows left out: {TURBO_MISSING}")
    elif TURBO_THREADS not in (1, 2):
        lines.append(f"turboloader rows left out: its pool has {TURBO_THREADS} threads (the "
                     f"machine's cores, no setting), beside no 1- or 2-worker Loader row")
    else:
        lines.append(f"turboloader: {version('turboloader')}, {TURBO_THREADS} threads (its "
                     f"pool, sized to the cores); float32 output, its own crop on a DCT-scaled "
                     f"whole image; packed TAR read from the page cache")
    return lines


def _ratio(num, den, key):
    if num in _results and den in _results:
        return _results[num][key] / _results[den][key]
    return None


def _finish(res):
    rows, ratios = [], []
    kinds = list(dict.fromkeys(kind for kind, _ in ROLES.values()))
    for role in sorted(ROLES, key=lambda r: kinds.index(ROLES[r][0])):   # kernel, loader, peers
        if role in res:
            r = res[role]
            rows.append(f"| {role} | {r['label']} | {r['workers']} | {r['best']:,.0f} | "
                        f"{r['median']:,.0f} |")

    def add(label, value_best, value_median, target, higher=True):
        if value_best is None:
            return
        if target is None:
            verdict = ""
        else:
            ok = [(v >= target) if higher else (v <= target) for v in (value_best, value_median)]
            verdict = "met" if all(ok) else ("met (best only)" if ok[0] else "**missed**")
        tgt = "-" if target is None else (f">= {target:g}" if higher else f"<= {target:g}")
        ratios.append((label, value_best, value_median, tgt, verdict))

    for w in (1, 2):
        for peer, name in PEERS.items():
            add(f"Loader / {name}, {w} worker(s)",
                _ratio(f"loader_w{w}", f"{peer}_w{w}", "best"),
                _ratio(f"loader_w{w}", f"{peer}_w{w}", "median"), TARGETS[peer][w])
    for w in (1, 2):
        if f"loader_w{w}" in res and "kernel" in res:
            add(f"scaling efficiency, {w} worker(s): Loader / (kernel x {w})",
                res[f"loader_w{w}"]["best"] / (w * res["kernel"]["best"]),
                res[f"loader_w{w}"]["median"] / (w * res["kernel"]["median"]), 0.9)
    for peer, name in PEERS.items():
        if f"{peer}_w1" in res and f"{peer}_w2" in res:
            add(f"{name} 2 workers / 1 worker", _ratio(f"{peer}_w2", f"{peer}_w1", "best"),
                _ratio(f"{peer}_w2", f"{peer}_w1", "median"), None)
    for key, label, target in (
            ("consumer_loader_b256", "Loader consumer cost, 256x224x224x3 batch (ms)", 1.0),
            ("consumer_loader_b32", "Loader consumer cost, 32x224x224x3 batch (ms)", 1.0),
            ("consumer_torch_b256", "torch consumer cost, next() of a ready 256-batch (ms)",
             None),
            ("assembly_torch_b256", "torch collate + IPC per 256-batch, worker side (ms)",
             None)):
        if key in res:
            add(label, res[key]["best_ms"], res[key]["median_ms"], target, higher=False)
    if "consumer_loader_b256" in res and "consumer_loader_b32" in res:
        add("Loader consumer cost b256 / b32 (O(1) in batch size: ~1)",
            res["consumer_loader_b256"]["best_ms"] / res["consumer_loader_b32"]["best_ms"],
            res["consumer_loader_b256"]["median_ms"] / res["consumer_loader_b32"]["median_ms"],
            None)
    if "consumer_loader_b256" in res and "consumer_torch_b256" in res:
        add("torch consumer cost / Loader consumer cost, 256-batch",
            res["consumer_torch_b256"]["best_ms"] / res["consumer_loader_b256"]["best_ms"],
            res["consumer_torch_b256"]["median_ms"] / res["consumer_loader_b256"]["median_ms"],
            None)
    if "consumer_loader_b256" in res and "assembly_torch_b256" in res:
        add("torch (collate + IPC) / Loader consumer cost, 256-batch",
            res["assembly_torch_b256"]["best_ms"] / res["consumer_loader_b256"]["best_ms"],
            res["assembly_torch_b256"]["median_ms"] / res["consumer_loader_b256"]["median_ms"],
            None)

    m = res.get("_machine", {})
    lines = ["", f"Pipeline benchmark: {BATCH}-image batches, 224x224 RandomResizedCrop + flip, "
             f"uint8, same files; {m.get('cores', '?')} cores; other processes used "
             f"{m.get('other_cpu_s', float('nan')):.1f} CPU-s during the "
             f"{m.get('wall_s', float('nan')):.0f} s run "
             f"({m.get('other_cores_avg', float('nan')):.2f} cores on average: "
             f"well above 0.1 means the numbers are disturbed)",
             *_peer_versions(),
             "", "| role | pipeline | workers | img/s (best round) | img/s (median round) |",
             "|---|---|---:|---:|---:|", *rows,
             "", "| ratio / cost | best | median | target | |", "|---|---:|---:|---:|---|"]
    for label, b, m, tgt, verdict in ratios:
        lines.append(f"| {label} | {b:.3f} | {m:.3f} | {tgt} | {verdict} |")
    paired = res.get("paired")
    if paired:
        lines += ["", f"Paired rounds ({paired['rounds']} cycles, the "
                  f"{len(paired['rates_median'])} pipelines measured back to back in each): "
                  "per-cycle ratios",
                  "", "| ratio | median | min | max | target | |", "|---|---:|---:|---:|---:|---|"]
        keys = [(f"loader_w{w} / {peer}_w{w}", TARGETS[peer][w])
                for w in (1, 2) for peer in PEERS]
        keys += [(f"loader_w{w} / (kernel x {w})", 0.9) for w in (1, 2)]
        for key, target in keys:
            if key not in paired:
                continue
            v = paired[key]
            if target is None:
                tgt, verdict = "-", ""
            else:
                tgt = f">= {target:g}"
                verdict = ("met" if v["median"] >= target else "**missed**") + " (median)"
            lines.append(f"| {key} | {v['median']:.3f} | {v['min']:.3f} | {v['max']:.3f} | "
                         f"{tgt} | {verdict} |")
        rates = ", ".join(f"{r} {v:,.0f}" for r, v in paired["rates_median"].items())
        lines += ["", f"Median img/s in the paired cycles: {rates}"]
    print("\n".join(lines))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump({"batch_size": BATCH, "results": res,
                   "dali": _dali_version() if not DALI_MISSING else None,
                   "dali_missing": DALI_MISSING, "spdl_missing": SPDL_MISSING,
                   "turboloader_missing": TURBO_MISSING,
                   "turboloader_threads": TURBO_THREADS,
                   "ratios": [dict(zip(("label", "best", "median", "target", "verdict"), r))
                              for r in ratios]}, f, indent=1)

"""Per-example ops and echo on the CPU: what echoing before augmentation delivers against
no echo and against the CPU-work bound, on the same files in one run.

    python -m pytest benchmarks/bench_augment.py -s

Every pipeline reads the same JPEG files from disk (page cache; the corpus of
``conftest.py``, as ``bench_pipeline.py``) and delivers 224x224 uint8 images, with 2
workers and a null consumer unless said otherwise.  The "rich" setting is
RandomResizedCrop 224 (scale 0.08-1, ratio 3/4-4/3) + horizontal flip +
``ColorJitter(0.4, 0.4, 0.4, 0.1)`` + ``RandomErasing(p=0.5, scale=(0.02, 0.33),
ratio=(0.3, 3.3), value=0)``; "crop" is the crop and flip alone.

**CPU costs** (one thread, in this process, over the corpus; printed first):

D        CPU time per image of the decode into the canvas (what a worker does per fresh
         example before augmentation: ``Decoder.canvas``)
A        CPU time per emission of the crop + resize (+ the ops' draws and the ops) from
         the canvas: what the echo stage does per emission (crop and rich)
D1       the fused decode + crop of echo = 1 (``decode_random_crop``) and, rich, + ops

With W workers on C cores (C = the process's affinity mask), before_augment at e
cannot deliver more than ``min(e x fresh, C / (D / e + A))`` images/s: ``fresh`` is
the upstream's measured rate of canvases (role ``canvas``) and the second term is
the CPU-work bound.  The target is >= 0.9 x that bound, and never below echo = 1.
On a machine shared with other work the C cores are not all there; the CPU this
run's processes used per emitted image, against D / e + A, says how close the
pipeline came to the work alone on the cores it did get (1.0: no overhead).

**Paired rounds** (images/s; every pipeline started once and measured round-robin):

echo1_X       ``EchoRing(echo=1)`` (the Loader's batches), X = crop or rich
echoE_X       ``EchoRing(echo=E, placement="before_augment")``, E = 2, 4
canvas        the upstream of before_augment alone: the workers' canvases
                 (``Loader.next_fresh`` over the ``Canvas`` transform), fresh images/s
stepP4_X      ``EchoRing(echo=4)``, placement P = before or after, under a 20 ms
                 consumer step (a sleep: an accelerator does not use the host CPU)
torch_X       ``echo_native.lab.peers.torch_loader(rich=...)``, 2 workers: torch
                 DataLoader over torchvision's Pillow calls (see the peers module)
views_X       (with ``ECHO_NATIVE_BENCH_AUGMENT_PROTOTYPE=1``) the other design for
                 re-augmentation, prototyped: each worker decodes a canvas once and
                 writes the e = 2 views itself; the consumer stores them in a
                 buffer and gathers batches of distinct examples on the pool
                 (docs/design.md, "Re-augmentation on every core")

**The echo stage alone** (no worker running, a buffer of 256 canvases of the corpus):
the stage's own emission path (``ImageExamples.make``, one batch in flight as the
stage keeps it) with ``Echo(threads=1)``, 2 and all cores; emitted images/s.

How it is timed: in each cycle every pipeline is measured in turn: first the machine
is left to settle (every worker process of this run idle: the other pipelines have
refilled), then the measured pipeline is drained of what it prefetched while idle
(untimed), then ``ECHO_NATIVE_BENCH_AUGMENT_BATCHES`` batches (x e for echo roles)
are timed.  Ratios are taken per cycle (rounds seconds apart, so a shared machine's
load moves both sides) and reported as median (min-max) over the cycles.

At the end a table is printed (visible with ``-s``) and written to
``benchmarks/results/augment.json``, with the CPU time other processes used during
the run (a disturbed run says so).

Environment (besides the corpus settings in ``conftest.py``):
  ECHO_NATIVE_BENCH_BATCH             batch size (default 64)
  ECHO_NATIVE_BENCH_AUGMENT_ROUNDS    paired cycles (default 5, at least 3 recommended)
  ECHO_NATIVE_BENCH_AUGMENT_BATCHES   batches timed per pipeline and cycle (default 16)
  ECHO_NATIVE_BENCH_AUGMENT_PEERS     0: leave the torch DataLoaders out (default 1)
  ECHO_NATIVE_BENCH_AUGMENT_PROTOTYPE 1: add the worker-side prototype (default 0)
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import echo_native as en
from benchenv import env_int, load_mark, load_since, own_cpu_seconds, workers_cpu_seconds
from echo_native import _kernel
from echo_native.augment import Program
from echo_native.echo.images import ImageExamples, ImageStore
from echo_native.specs import fold
from echo_native.transforms import canvas_for

SIZE = 224
SEED = 1234
WORKERS = 2
STEP_S = 0.020
HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "augment.json"

BATCH = env_int("ECHO_NATIVE_BENCH_BATCH", 64)
ROUNDS = env_int("ECHO_NATIVE_BENCH_AUGMENT_ROUNDS", 5)
BATCHES = env_int("ECHO_NATIVE_BENCH_AUGMENT_BATCHES", 16)
PEERS = env_int("ECHO_NATIVE_BENCH_AUGMENT_PEERS", 1)
PROTOTYPE = env_int("ECHO_NATIVE_BENCH_AUGMENT_PROTOTYPE", 0)
CORES = len(os.sched_getaffinity(0))

RICH_LABEL = "crop + flip + ColorJitter(0.4, 0.4, 0.4, 0.1) + RandomErasing(p=0.5)"
CROP_LABEL = "crop + flip"


def _label(rich):
    return RICH_LABEL if rich else CROP_LABEL


def _echo(e, placement, threads=None):
    """``Echo(e, placement, threads=...)``; a build without the threads field (the code
    before the pool) takes the default."""
    if threads is None:
        return en.Echo(e, placement=placement)
    try:
        return en.Echo(e, placement=placement, threads=threads)
    except TypeError:
        return None


# role: dict(kind, rich, e, placement, step, threads)
ROLES = {}
for _x, _rich in (("crop", False), ("rich", True)):
    ROLES[f"echo1_{_x}"] = dict(kind="echo", rich=_rich, e=1, placement="before_augment",
                                step=False, label=f"EchoRing echo=1, {_label(_rich)}")
    for _e in (2, 4):
        ROLES[f"echo{_e}_{_x}"] = dict(kind="echo", rich=_rich, e=_e, placement="before_augment",
                                       step=False,
                                       label=f"EchoRing echo={_e} before_augment, {_label(_rich)}")
if _echo(2, "before_augment", 1) is not None:  # a build with Echo(threads=)
    for _x, _rich in (("crop", False), ("rich", True)):
        ROLES[f"echo2_{_x}_t1"] = dict(kind="echo", rich=_rich, e=2, placement="before_augment",
                                       step=False, threads=1,
                                       label=f"EchoRing echo=2 before_augment, Echo(threads=1), "
                                             f"{_label(_rich)}")
ROLES["canvas"] = dict(kind="canvas", rich=False, e=1, step=False,
                       label="the workers' canvases alone (before_augment's upstream), fresh")
for _x, _rich in (("crop", False), ("rich", True)):
    for _p in ("before", "after"):
        ROLES[f"step{_p}4_{_x}"] = dict(
            kind="echo", rich=_rich, e=4, placement=f"{_p}_augment", step=True,
            label=f"EchoRing echo=4 {_p}_augment, 20 ms step, {_label(_rich)}")
if PEERS:
    for _x, _rich in (("crop", False), ("rich", True)):
        ROLES[f"torch_{_x}"] = dict(kind="torch", rich=_rich, e=1, step=False,
                                    label=f"torch DataLoader + torchvision's calls, "
                                          f"{_label(_rich)}")
if PROTOTYPE:
    for _x, _rich in (("crop", False), ("rich", True)):
        ROLES[f"views_{_x}"] = dict(kind="views", rich=_rich, e=2, step=False,
                                    label=f"prototype: workers write e=2 views, {_label(_rich)}")

# (numerator, denominator, meaning, target on the median)
RATIOS = [
    ("echo2_rich", "echo1_rich", "rich: e=2 / echo=1", 1.0),
    *((f"echo2_{x}", f"echo2_{x}_t1", f"{x} e=2: the pool on every core / one thread", None)
      for x in ("crop", "rich") if f"echo2_{x}_t1" in ROLES),
    ("echo4_rich", "echo1_rich", "rich: e=4 / echo=1", 1.0),
    ("echo2_crop", "echo1_crop", "crop: e=2 / echo=1", 1.25),
    ("echo4_crop", "echo1_crop", "crop: e=4 / echo=1", 1.0),
    ("stepbefore4_crop", "stepafter4_crop", "crop, 20 ms step: before / after e=4", 0.9),
    ("stepbefore4_rich", "stepafter4_rich", "rich, 20 ms step: before / after e=4", 0.9),
]
if PEERS:
    RATIOS.append(("echo1_rich", "torch_rich", "echo_native / torch, rich", 2.0))
    RATIOS.append(("echo1_crop", "torch_crop", "echo_native / torch, crop", None))
if PROTOTYPE:
    RATIOS.append(("views_crop", "echo2_crop", "crop e=2: workers' views / echo stage pool",
                   None))
    RATIOS.append(("views_rich", "echo2_rich", "rich e=2: workers' views / echo stage pool",
                   None))

_results: dict = {}


def _ops(rich):
    return [en.ColorJitter(0.4, 0.4, 0.4, 0.1), en.RandomErasing(p=0.5)] if rich else []


def _augment(rich):
    crop = en.RandomResizedCrop(SIZE)
    return [crop, *_ops(rich)] if rich else crop


def settle(timeout=30.0, window=0.15, quiet=0.03):
    """Until every worker process of this run is idle (used under ``quiet`` CPU-s in a
    ``window``-s window): the pipelines not measured have refilled and sleep."""
    deadline = time.monotonic() + timeout
    c0 = workers_cpu_seconds()
    while time.monotonic() < deadline:
        time.sleep(window)
        c1 = workers_cpu_seconds()
        if c1 - c0 < quiet:
            return
        c0 = c1


# ---- the prototype of re-augmentation in the workers ------------------------------------------
class WorkerViews:
    """Prototype (benchmark only): a worker decodes each sample's canvas once and writes
    its ``e`` views (crop, resize, flip, ops; echo index 0 .. e-1, the keys the echo
    stage would use) one under the other in the slot's row."""

    def __init__(self, crop, ops, e):
        self.crop, self.e = crop, int(e)
        self.canvas = canvas_for(crop)
        self.program = Program(ops, crop.size)
        self.size = (self.e * crop.size[0], crop.size[1])
        self._scratch = self._dec = None

    @property
    def sample_bytes(self):
        return self.size[0] * self.size[1] * 3

    def apply(self, dec, data, key, slot, i):
        if self._scratch is None:   # per worker process
            self._scratch = np.empty(self.canvas.max_pixels * 3, np.uint8)
            self._dec = _kernel.Decoder()
        canvas, scale, source = dec.canvas(data, self.canvas.min_side, self.canvas.max_pixels,
                                           self._scratch)
        seed, epoch, sid, _ = key
        e, (h, w), (ch, cw) = self.e, self.crop.size, canvas.shape[:2]
        idx = np.arange(e, dtype=np.int32)
        boxes, flips, cboxes = _kernel.random_resized_crops(
            seed, np.full(e, epoch, np.int64), np.full(e, sid, np.int64), idx,
            np.tile(np.asarray(source, np.int32), (e, 1)),
            np.tile(np.asarray(scale, np.float32), (e, 1)),
            np.tile(np.asarray([ch, cw], np.int32), (e, 1)),
            self.crop.scale, self.crop.ratio, self.crop.flip_p)
        out = slot.pixels[i].reshape(e, h, w, 3)
        self._dec.resize_batch(self._scratch[None], np.zeros(e, np.int64),
                               np.array([[ch, cw]], np.int32), cboxes,
                               flips.view(np.uint8), out)
        if self.program:
            codes, args = self.program.draw(seed, epoch, np.full(e, sid), idx)
            _kernel.apply_ops(out, codes, args)
        slot.boxes[i] = boxes[0]
        slot.flip[i] = flips[0]
        slot.shapes[i] = self.size


def _ship_by_value():
    """The prototype's transform reaches the workers by value (this module is not on
    their path)."""
    import cloudpickle
    cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ---- streams: next() returns the batch's image count ----------------------------------------
class EchoStream:
    def __init__(self, src, role):
        r = ROLES[role]
        self.e, self.step = r["e"], r["step"]
        self.ring = en.EchoRing(src, batch_size=BATCH, augment=_augment(r["rich"]),
                                echo=_echo(self.e, r["placement"], r.get("threads")),
                                workers=WORKERS,
                                seed=SEED, timeout=120)
        self.ring.start()
        slots = self.ring.loader.slots
        # what the ring and the echo buffer hold ready while the pipeline is idle
        self.ahead = int(math.ceil(self.e)) * (slots + 4) + 2
        self.gen = self._stream()

    def _stream(self):
        while True:                        # epoch after epoch
            yield from self.ring

    def next(self, timed=False):
        b = next(self.gen)
        assert b.images.shape[1:] == (SIZE, SIZE, 3) and b.images.dtype.name == "uint8"
        if timed and self.step:
            time.sleep(STEP_S)
        return len(b)

    def close(self):
        self.gen.close()
        self.ring.close()


class CanvasStream:
    """before_augment's upstream alone: the workers' canvases, taken and given back."""

    def __init__(self, src, role):
        crop = en.RandomResizedCrop(SIZE)
        specs = fold("Loader", crop, None, None, WORKERS, {})
        self.L = en.Loader.from_specs(src, BATCH, specs, canvas_for(crop), seed=SEED,
                                      drop_last=True)
        self.L.start()
        self.ahead, self.e = self.L.slots, 1

    def next(self, timed=False):
        return self.L.next_fresh().count

    def close(self):
        self.L.close()


class TorchStream:
    def __init__(self, src, role):
        torch = pytest.importorskip("torch")
        from echo_native.lab import peers
        self.torch = torch
        self.dl = peers.torch_loader(src, BATCH, WORKERS, size=SIZE, seed=SEED,
                                     rich=ROLES[role]["rich"], passes=10_000, drop_last=True)
        self.it = iter(self.dl)
        self.ahead, self.e = 4 * WORKERS, 1   # prefetch_factor x workers

    def next(self, timed=False):
        images = next(self.it)[0]
        assert images.shape == (BATCH, 3, SIZE, SIZE) and images.dtype == self.torch.uint8
        return int(images.shape[0])

    def close(self):
        del self.it                        # shuts its workers down
        self.dl = None


class ViewsStream:
    """The prototype: the workers' e views stored in a buffer of 4 x batch x e images,
    batches of distinct examples gathered out of it on the CPU backend's pool."""

    def __init__(self, src, role):
        from echo_native.backends.cpu import CpuDevice
        _ship_by_value()
        r = ROLES[role]
        self.e = r["e"]
        crop = en.RandomResizedCrop(SIZE)
        specs = fold("Loader", crop, None, None, WORKERS, {})
        self.L = en.Loader.from_specs(src, BATCH, specs, WorkerViews(crop, _ops(r["rich"]), self.e),
                                      seed=SEED, drop_last=True)
        self.L.start()
        self.device = CpuDevice()
        self.cap = 4 * BATCH * self.e
        self.store = ImageStore(self.cap, SIZE * SIZE * 3)
        self.outs = [np.empty((BATCH, SIZE, SIZE, 3), np.uint8) for _ in range(3)]
        self.rng = np.random.default_rng(0)
        self.pending, self.at, self.k = [], 0, 0
        self.ahead = self.L.slots * self.e + 2

    def next(self, timed=False):
        if not self.pending:
            fresh = self.L.next_fresh()
            n = fresh.count * self.e
            entries = (np.arange(n) + self.at) % self.cap
            self.at = (self.at + n) % self.cap
            self.device.store(self.store, entries, _Rows(fresh.payload.pixels, fresh.count, n),
                              n, True)
            order = self.rng.permutation(entries)
            self.pending = [order[j * BATCH:(j + 1) * BATCH] for j in range(self.e)]
        entries = self.pending.pop(0)
        out = self.outs[self.k % 3]
        self.k += 1
        self.device.synchronize(self.device.gather(self.store, entries, out))
        return len(entries)

    def close(self):
        self.device.release_buffers()
        self.L.close()


class _Rows:
    """A slot's rows of e views seen as n = count x e rows of one image each."""

    def __init__(self, pixels, count, n):
        self.pixels = pixels[:count].reshape(n, -1)


STREAMS = {"echo": EchoStream, "canvas": CanvasStream, "torch": TorchStream,
           "views": ViewsStream}


class Streams:
    """Every pipeline, started once; measured one at a time while the others sleep."""

    def __init__(self, src):
        self.src, self.live = src, {}

    def get(self, role):
        if role not in self.live:
            stream = STREAMS[ROLES[role]["kind"]](self.src, role)
            self.live[role] = stream
            for _ in range(2 * (stream.ahead + 1)):   # warm-up: workers up, caches hot
                stream.next()
        return self.live[role]

    def drain(self, role):
        """Settle the machine, then take (untimed) what ``role`` prefetched while idle."""
        stream = self.get(role)
        settle()
        for _ in range(stream.ahead):
            stream.next()

    def timed(self, role):
        """One timed round: (images, seconds, CPU-seconds of this process and its
        workers)."""
        stream = self.get(role)
        count = BATCHES * max(1, int(math.ceil(stream.e)))
        c0, t0 = own_cpu_seconds(), time.perf_counter()
        images = sum(stream.next(timed=True) for _ in range(count))
        took = time.perf_counter() - t0
        return images, took, own_cpu_seconds() - c0

    def close(self):
        for stream in self.live.values():
            stream.close()
        self.live.clear()


@pytest.fixture(scope="module")
def files(workload):
    return [s.data for s in workload.samples]


@pytest.fixture(scope="module")
def streams(folder):
    if len(folder) < 4 * BATCH:
        pytest.skip(f"needs at least {4 * BATCH} files (ECHO_NATIVE_BENCH_N={len(folder)})")
    s = Streams(folder)
    yield s
    s.close()


@pytest.fixture(scope="module", autouse=True)
def report():
    """Print the table and save the numbers when the module's benchmark is done."""
    mark = load_mark()
    yield
    _results["_machine"] = load_since(mark)
    if any(k in _results for k in ("rates", "costs", "stage")):
        _finish(_results)


def _spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "per_cycle": values}


# ---- the CPU costs -----------------------------------------------------------------------------
def _canvases(files, count):
    """``count`` canvases of the corpus in an ImageStore, as the echo buffer holds them."""
    crop = en.RandomResizedCrop(SIZE)
    canvas = canvas_for(crop)
    store = ImageStore(count, canvas.max_pixels * 3)
    dec = en.Decoder()
    for e in range(count):
        view, scale, source = dec.canvas(files[e % len(files)], canvas.min_side,
                                         canvas.max_pixels, store.pixels[e])
        store.shape[e] = view.shape[:2]
        store.source_hw[e] = source
        store.scale[e] = scale
    return store


def _cpu(fn, repeat=3):
    """Least CPU seconds (this thread) of ``repeat`` runs of ``fn()``."""
    best = math.inf
    for _ in range(repeat):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best


@pytest.mark.benchmark(group="augment-costs")
def test_cpu_costs(benchmark, files):
    """D, A and D1 in CPU-seconds per image, one thread (see the module docstring)."""
    n = min(len(files), 256)
    crop = en.RandomResizedCrop(SIZE)
    canvas = canvas_for(crop)
    dec = en.Decoder()
    scratch = np.empty(canvas.max_pixels * 3, np.uint8)
    out = np.empty((SIZE, SIZE, 3), np.uint8)

    def decode_canvases():
        for data in files[:n]:
            dec.canvas(data, canvas.min_side, canvas.max_pixels, scratch)

    def decode_crops():
        for i, data in enumerate(files[:n]):
            dec.random_crop(data, crop.size, (SEED, 0, i, 0), crop.scale, crop.ratio,
                            crop.flip_p, out)

    store = _canvases(files, n)
    entries = np.arange(n, dtype=np.int64)
    images = np.empty((n, SIZE, SIZE, 3), np.uint8)
    kdec = _kernel.Decoder()
    costs = {}

    def emissions(rich, echo):
        def run():
            _, flips, boxes = _kernel.random_resized_crops(
                SEED, np.zeros(n, np.int64), entries, np.full(n, echo, np.int32),
                store.source_hw[:n], store.scale[:n], store.shape[:n], crop.scale,
                crop.ratio, crop.flip_p)
            kdec.resize_batch(store.pixels, entries, store.shape, boxes, flips.view(np.uint8),
                              images)
            if rich:
                codes, args = Program(_ops(True), crop.size).draw(SEED, 0, entries, echo)
                _kernel.apply_ops(images, codes, args)
        return run

    def ops_on_crops():
        codes, args = Program(_ops(True), crop.size).draw(SEED, 0, entries, 0)
        _kernel.apply_ops(images, codes, args)

    def measure():
        costs["D"] = _cpu(decode_canvases) / n
        costs["D1_crop"] = _cpu(decode_crops) / n
        costs["ops_rich"] = _cpu(ops_on_crops) / n
        costs["D1_rich"] = costs["D1_crop"] + costs["ops_rich"]
        costs["A_crop"] = _cpu(emissions(False, 1)) / n
        costs["A_rich"] = _cpu(emissions(True, 1)) / n

    benchmark.pedantic(measure, rounds=1, iterations=1)
    _results["costs"] = costs
    _results["cores"] = CORES


def bound(costs, rich, e, fresh):
    """0.9 x min(e x fresh, C / (D / e + A)) images/s."""
    a = costs["A_rich" if rich else "A_crop"]
    return 0.9 * min(e * fresh, CORES / (costs["D"] / e + a))


# ---- the paired rounds -------------------------------------------------------------------------
@pytest.mark.benchmark(group="augment-paired")
def test_paired_rounds(benchmark, streams):
    """Every pipeline measured round-robin, so each ratio compares adjacent rounds."""
    order = list(ROLES)
    for role in order:                     # start (and warm) them all before any timing
        streams.get(role)
    rates = {r: [] for r in order}
    cpu = {r: [] for r in order}

    def cycle():
        for role in order:
            streams.drain(role)
            images, took, used = streams.timed(role)
            rates[role].append(images / took)
            cpu[role].append(used / images)

    benchmark.extra_info.update(roles=order, batches_per_round=BATCHES, batch_size=BATCH,
                                workers=WORKERS, files=len(streams.src))
    benchmark.pedantic(cycle, rounds=ROUNDS, iterations=1)
    n = len(rates[order[0]])
    _results["rates"] = {r: {"label": ROLES[r]["label"], "best": max(v),
                             "median": statistics.median(v), "per_cycle": v,
                             "cpu_ms_per_image": 1e3 * statistics.median(cpu[r])}
                         for r, v in rates.items()}
    _results["ratios"] = {}
    for num, den, meaning, target in RATIOS:
        per = [rates[num][i] / rates[den][i] for i in range(n)]
        _results["ratios"][f"{num} / {den}"] = {"meaning": meaning, "target": target,
                                                **_spread(per)}
    costs = _results.get("costs")
    if costs:
        # emitted / min(e x fresh, C / (D/e + A)) per cycle (target >= 0.9)
        _results["bound"] = {}
        for x, rich in (("crop", False), ("rich", True)):
            for e in (2, 4):
                role = f"echo{e}_{x}"
                per = [rates[role][i] / (bound(costs, rich, e, rates["canvas"][i]) / 0.9)
                       for i in range(n)]
                # The same against the cores the pipeline got: (D/e + A) over the CPU it
                # used per emitted image (workers and consumer); 1 is the work alone.
                work = costs["D"] / e + costs["A_rich" if rich else "A_crop"]
                _results["bound"][role] = {
                    "bound_img_s": statistics.median(bound(costs, rich, e, f)
                                                     for f in rates["canvas"]),
                    "work_efficiency": _spread([work / c for c in cpu[role]]),
                    **_spread(per)}
    _results["cycles"] = n
    _results["files"] = len(streams.src)


# ---- the echo stage alone ----------------------------------------------------------------------
class _Outputs:
    """The delivery's rotating output buffers, three per shape."""

    def __init__(self):
        self.buffers, self.k = {}, 0

    def next(self, kind, shape, dtype=np.uint8):
        key = (kind, tuple(shape))
        if key not in self.buffers:
            self.buffers[key] = [np.zeros(shape, dtype) for _ in range(3)]  # pages touched
        self.k += 1
        return self.buffers[key][self.k % 3]


@pytest.mark.benchmark(group="augment-stage")
def test_echo_stage_alone(benchmark, files):
    """The echo stage's emission path on a filled buffer, no worker running, with 1, 2 and
    all threads, round-robin: emitted images/s and the ratio to 1 thread per cycle."""
    from echo_native.backends.cpu import CpuDevice

    capacity = 4 * BATCH
    store = _canvases(files, capacity)
    counts = sorted({1, 2, CORES})
    if _echo(2, "before_augment", 1) is None:
        counts = [None]  # a build without Echo(threads=): its one host thread
    rates = {(x, t): [] for x in ("crop", "rich") for t in counts}
    stages = {}
    for x, rich in (("crop", False), ("rich", True)):
        for t in counts:
            device = CpuDevice()
            crop = en.RandomResizedCrop(SIZE)
            examples = ImageExamples(device, _Outputs(), crop, Program(_ops(rich), crop.size),
                                     _echo(2, "before_augment", t), SEED, store.pixels.shape[1])
            examples.stored = store
            stages[(x, t)] = (device, examples)
    rng = np.random.default_rng(0)
    # about a second per measurement at one thread on this kind of machine
    batches = {"crop": 8 * BATCHES, "rich": 2 * BATCHES}

    def emit(device, examples, k):
        entries = rng.choice(capacity, BATCH, replace=False).astype(np.int64)
        ids = entries + capacity * k
        return examples.make(entries, ids, np.ones(BATCH, np.int64), np.zeros(BATCH, bool),
                             np.zeros(BATCH, np.int64), 0)[0]

    def run(device, examples, count):
        last = None
        for k in range(count):            # one batch in flight, as the stage keeps it
            job = emit(device, examples, k)
            if last is not None:
                device.synchronize(last)
            last = job
        device.synchronize(last)

    for key in stages:
        run(*stages[key], 4)               # warm-up: pools started, buffers touched

    def cycle():
        for key, (device, examples) in stages.items():
            count = batches[key[0]]
            t0 = time.perf_counter()
            run(device, examples, count)
            rates[key].append(count * BATCH / (time.perf_counter() - t0))

    benchmark.pedantic(cycle, rounds=ROUNDS, iterations=1)
    for device, _ in stages.values():
        device.release_buffers()
    stage = {}
    for x in ("crop", "rich"):
        base = rates[(x, counts[0])]
        for t in counts:
            v = rates[(x, t)]
            stage[f"{x} threads={t if t is not None else 'host'}"] = {
                "img_s": _spread(v), "vs_1": _spread([a / b for a, b in zip(v, base)])}
    _results["stage"] = stage


# ---- the report --------------------------------------------------------------------------------
def _mm(r, fmt="{:.2f}"):
    return f"{fmt.format(r['median'])} ({fmt.format(r['min'])}-{fmt.format(r['max'])})"


def _finish(res):
    m = res["_machine"]
    lines = ["", (f"Echo on the CPU: {BATCH}-image batches, 224x224 uint8, {WORKERS} workers, "
                  f"{res.get('files', '?')} files, {res.get('cycles', '?')} paired cycles; "
                  f"{m['cores']} cores; other processes used {m['other_cpu_s']:.1f} CPU-s "
                  f"during the {m['wall_s']:.0f} s run ({m['other_cores_avg']:.2f} cores on "
                  f"average: well above 0.1 means the numbers are disturbed)")]
    costs = res.get("costs")
    if costs:
        lines += ["", "CPU per image, one thread: " + ", ".join(
            f"{k} {v * 1e3:.3f} ms" for k, v in costs.items())]
    if "rates" in res:
        lines += ["", "| role | pipeline | img/s (best cycle) | img/s (median cycle) | "
                      "CPU ms per image |", "|---|---|---:|---:|---:|"]
        for role, r in res["rates"].items():
            lines.append(f"| {role} | {r['label']} | {r['best']:,.0f} | {r['median']:,.0f} | "
                         f"{r['cpu_ms_per_image']:.3f} |")
        lines += ["", "| ratio | meaning | median (min-max) | target |", "|---|---|---|---|"]
        for key, r in res["ratios"].items():
            tgt = "-" if r["target"] is None else \
                f">= {r['target']:g} " + ("met" if r["median"] >= r["target"] else "**missed**")
            lines.append(f"| {key} | {r['meaning']} | {_mm(r)} | {tgt} |")
    if "bound" in res:
        lines += ["", "| role | 0.9 x min(e x fresh, C / (D/e + A)), img/s | emitted / "
                      "min(...) | target | (D/e + A) / CPU used per image |",
                  "|---|---:|---|---|---|"]
        for role, r in res["bound"].items():
            ok = "met" if r["median"] >= 0.9 else "**missed**"
            lines.append(f"| {role} | {r['bound_img_s']:,.0f} | {_mm(r)} | >= 0.9 {ok} | "
                         f"{_mm(r['work_efficiency'])} |")
    if "stage" in res:
        lines += ["", "| echo stage alone (buffer filled, no workers) | img/s median (min-max) |"
                      " vs the first row |", "|---|---|---|"]
        for key, r in res["stage"].items():
            lines.append(f"| {key} | {_mm(r['img_s'], '{:,.0f}')} | {_mm(r['vs_1'])} |")
    print("\n".join(lines))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump({"batch_size": BATCH, "workers": WORKERS, "batches_per_round": BATCHES,
                   "image_size": SIZE, "seed": SEED, **res}, f, indent=1, default=str)

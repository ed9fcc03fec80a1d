"""Per-example ops (ColorJitter + RandomErasing) in the ring workers vs in torch DataLoader
workers, on the same files in one run.

    python -m pytest benchmarks/bench_augment.py -s

Every pipeline reads the same JPEG files from disk (page cache; the corpus of
``conftest.py``, as ``bench_pipeline.py``) and delivers 224x224 uint8 images,
with 2 workers and a null consumer.  The "rich" setting is RandomResizedCrop 224
(scale 0.08-1, ratio 3/4-4/3) + horizontal flip + ``ColorJitter(0.4, 0.4, 0.4,
0.1)`` + ``RandomErasing(p=0.5, scale=(0.02, 0.33), ratio=(0.3, 3.3), value=0)``;
"crop" is the crop and flip alone.  Measured, each as images/s:

loader_rich   ``en.Loader(folder, batch, augment=[RandomResizedCrop(224),
              ColorJitter(0.4, 0.4, 0.4, 0.1), RandomErasing(p=0.5)], workers=2)``
loader_crop   the same Loader with only ``RandomResizedCrop(224)``: loader_rich /
              loader_crop is what the ops cost us
torch_rich    ``echo_native.lab.peers.torch_loader(rich=True)``, 2 workers: torch
              DataLoader over torchvision's Pillow calls for the crop and flip,
              ColorJitter's Pillow path (ImageEnhance + HSV hue), PILToTensor, and
              RandomErasing's tensor path (torchvision itself does not install
              beside the CPU torch wheel here)
torch_crop    the same DataLoader with ``rich=False`` (crop, flip, PILToTensor)
echo_rich     ``en.EchoRing(folder, batch, augment=<the rich list>, echo=2,
              placement="before_augment", workers=2)``: every emission, fresh or
              echoed, draws its own crop and ops; emitted images/s

How it is timed: all five pipelines are started once and stay alive (an idle
one has a full ring or prefetch queue and sleeping workers); the torch
DataLoaders stream many passes over the files in one iterator (no epoch
restarts) and both Loaders and DataLoaders drop short batches.  In each cycle
every pipeline is measured in turn: first the machine is left to settle (every
worker process of this run idle: all the other pipelines have refilled), then
the measured pipeline is drained of what it prefetched while idle (untimed),
then ``ECHO_NATIVE_BENCH_AUGMENT_BATCHES`` batches are timed.  The ratios are
taken per cycle (rounds a few seconds apart, so a shared machine's load moves
both sides) and reported as median, min and max over the cycles.

At the end a table is printed (visible with ``-s``) and written to
``benchmarks/results/augment.json``, with the CPU time other processes used
during the run (a disturbed run says so).

Environment (besides the corpus settings in ``conftest.py``):
  ECHO_NATIVE_BENCH_BATCH            batch size (default 64)
  ECHO_NATIVE_BENCH_AUGMENT_ROUNDS   paired cycles (default 5, at least 3 recommended)
  ECHO_NATIVE_BENCH_AUGMENT_BATCHES  batches timed per pipeline and cycle (default 16)
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest

import echo_native as en
from benchenv import env_int, load_mark, load_since, workers_cpu_seconds
from echo_native.lab import peers

torch = pytest.importorskip("torch")

SIZE = 224
SEED = 1234
WORKERS = 2
HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "augment.json"

BATCH = env_int("ECHO_NATIVE_BENCH_BATCH", 64)
ROUNDS = env_int("ECHO_NATIVE_BENCH_AUGMENT_ROUNDS", 5)
BATCHES = env_int("ECHO_NATIVE_BENCH_AUGMENT_BATCHES", 16)

RICH_LABEL = "crop + flip + ColorJitter(0.4, 0.4, 0.4, 0.1) + RandomErasing(p=0.5)"
CROP_LABEL = "crop + flip"
# role: (kind, rich, label)
ROLES = {
    "loader_rich": ("loader", True, f"echo_native Loader, {RICH_LABEL}"),
    "loader_crop": ("loader", False, f"echo_native Loader, {CROP_LABEL}"),
    "torch_rich": ("torch", True, f"torch DataLoader + torchvision's calls, {RICH_LABEL}"),
    "torch_crop": ("torch", False, f"torch DataLoader + torchvision's calls, {CROP_LABEL}"),
    "echo_rich": ("echo", True, (f"echo_native EchoRing echo=2 before_augment, {RICH_LABEL} "
                                 f"(emitted)")),
}
# (numerator, denominator, meaning, target on the median)
RATIOS = (
    ("loader_rich", "torch_rich", "echo_native / torch, rich", 2.0),
    ("loader_crop", "torch_crop", "echo_native / torch, crop only", None),
    ("loader_rich", "loader_crop", "echo_native rich / crop (what the ops cost us)", None),
    ("torch_rich", "torch_crop", "torch rich / crop (what the ops cost torch)", None),
    ("echo_rich", "loader_rich", "EchoRing e=2 emitted / Loader, rich", None),
)

_results: dict = {}


def _augment(rich):
    crop = en.RandomResizedCrop(SIZE)
    if not rich:
        return crop
    return [crop, en.ColorJitter(0.4, 0.4, 0.4, 0.1), en.RandomErasing(p=0.5)]




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


# ---- streams: next() returns the batch's image count ----------------------------------------
class LoaderStream:
    def __init__(self, src, rich):
        self.L = en.Loader(src, BATCH, augment=_augment(rich), workers=WORKERS, seed=SEED,
                           drop_last=True, timeout=120)
        self.L.start()
        self.ahead = self.L.slots

    def next(self):
        b = self.L.next_batch()
        assert b.images.shape == (BATCH, SIZE, SIZE, 3) and b.images.dtype.name == "uint8"
        return len(b)

    def close(self):
        self.L.close()


class TorchStream:
    def __init__(self, src, rich):
        self.dl = peers.torch_loader(src, BATCH, WORKERS, size=SIZE, seed=SEED, rich=rich,
                                     passes=10_000, drop_last=True)
        self.it = iter(self.dl)
        self.ahead = 4 * WORKERS           # prefetch_factor x workers

    def next(self):
        images = next(self.it)[0]
        assert images.shape == (BATCH, 3, SIZE, SIZE) and images.dtype == torch.uint8
        return int(images.shape[0])

    def close(self):
        del self.it                        # shuts its workers down
        self.dl = None


class EchoStream:
    def __init__(self, src, rich):
        self.ring = en.EchoRing(src, batch_size=BATCH, augment=_augment(rich), echo=2,
                                placement="before_augment", workers=WORKERS, seed=SEED,
                                timeout=120)
        self.ring.start()
        self.ahead = 2 * self.ring.loader.slots   # two emissions per fresh batch held ready
        self.gen = self._stream()

    def _stream(self):
        while True:                        # epoch after epoch
            yield from self.ring

    def next(self):
        b = next(self.gen)
        assert b.images.shape[1:] == (SIZE, SIZE, 3) and b.images.dtype.name == "uint8"
        return len(b)

    def close(self):
        self.gen.close()
        self.ring.close()


STREAMS = {"loader": LoaderStream, "torch": TorchStream, "echo": EchoStream}


class Streams:
    """Every pipeline, started once; measured one at a time while the others sleep."""

    def __init__(self, src):
        self.src, self.live = src, {}

    def get(self, role):
        if role not in self.live:
            kind, rich, _ = ROLES[role]
            stream = STREAMS[kind](self.src, rich)
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
        """One timed round of ``BATCHES`` batches: (images, seconds)."""
        stream = self.get(role)
        t0 = time.perf_counter()
        images = sum(stream.next() for _ in range(BATCHES))
        return images, time.perf_counter() - t0

    def close(self):
        for stream in self.live.values():
            stream.close()
        self.live.clear()


@pytest.fixture(scope="module")
def streams(folder):
    if len(folder) < 2 * BATCH:
        pytest.skip(f"needs at least {2 * BATCH} files (ECHO_NATIVE_BENCH_N={len(folder)})")
    s = Streams(folder)
    yield s
    s.close()


@pytest.fixture(scope="module", autouse=True)
def report():
    """Print the table and save the numbers when the module's benchmark is done."""
    mark = load_mark()
    yield
    _results["_machine"] = load_since(mark)
    if "rates" in _results:
        _finish(_results)


# ---- the benchmark ---------------------------------------------------------------------------
@pytest.mark.benchmark(group="augment-paired")
def test_paired_rounds(benchmark, streams):
    """The five pipelines measured round-robin, so each ratio compares adjacent rounds."""
    order = list(ROLES)
    for role in order:                     # start (and warm) them all before any timing
        streams.get(role)
    rates = {r: [] for r in order}

    def cycle():
        for role in order:
            streams.drain(role)
            images, took = streams.timed(role)
            rates[role].append(images / took)

    benchmark.extra_info.update(roles=order, batches_per_round=BATCHES, batch_size=BATCH,
                                workers=WORKERS, files=len(streams.src))
    benchmark.pedantic(cycle, rounds=ROUNDS, iterations=1)
    n = len(rates[order[0]])
    _results["rates"] = {r: {"label": ROLES[r][2], "best": max(v),
                             "median": statistics.median(v), "per_cycle": v}
                         for r, v in rates.items()}
    _results["ratios"] = {}
    for num, den, meaning, target in RATIOS:
        per = [rates[num][i] / rates[den][i] for i in range(n)]
        _results["ratios"][f"{num} / {den}"] = {
            "meaning": meaning, "median": statistics.median(per), "min": min(per),
            "max": max(per), "best_over_best": max(rates[num]) / max(rates[den]),
            "target": target, "per_cycle": per}
    _results["cycles"] = n
    _results["files"] = len(streams.src)


def _finish(res):
    m = res["_machine"]
    head = (f"Per-example ops: {BATCH}-image batches, 224x224 uint8, {WORKERS} workers, "
            f"same {res.get('files', '?')} files; {res['cycles']} paired cycles of "
            f"{BATCHES} batches per pipeline; {m['cores']} cores; other processes used "
            f"{m['other_cpu_s']:.1f} CPU-s during the {m['wall_s']:.0f} s run "
            f"({m['other_cores_avg']:.2f} cores on average: well above 0.1 means the "
            f"numbers are disturbed)")
    lines = ["", head,
             "", "| role | pipeline | img/s (best cycle) | img/s (median cycle) |",
             "|---|---|---:|---:|"]
    for role, r in res["rates"].items():
        lines.append(f"| {role} | {r['label']} | {r['best']:,.0f} | {r['median']:,.0f} |")
    lines += ["", "| ratio | meaning | median | min | max | best / best | target |",
              "|---|---|---:|---:|---:|---:|---|"]
    for key, r in res["ratios"].items():
        if r["target"] is None:
            tgt = "-"
        else:
            tgt = f">= {r['target']:g} " + ("met" if r["median"] >= r["target"] else
                                            "**missed**") + " (median)"
        lines.append(f"| {key} | {r['meaning']} | {r['median']:.2f} | {r['min']:.2f} | "
                     f"{r['max']:.2f} | {r['best_over_best']:.2f} | {tgt} |")
    print("\n".join(lines))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump({"batch_size": BATCH, "workers": WORKERS, "batches_per_round": BATCHES,
                   "image_size": SIZE, "seed": SEED, **res}, f, indent=1)

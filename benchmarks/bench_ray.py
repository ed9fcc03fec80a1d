"""Decode on a Ray cluster: echo_native.ray against Ray Data's own image path and a local
ring, on the same cores and files, in one run.

    python -m pytest benchmarks/bench_ray.py -s -p no:cacheprovider

The corpus is ``echo_native.lab.corpus``'s (ECHO_NATIVE_BENCH_RAY_N images, default
600, ImageNet's sizes).  Every pipeline makes 224x224 RandomResizedCrop (scale
0.08-1, ratio 3/4-4/3) + horizontal flip, uint8, with 2 decoding workers, read by
a null consumer in batches of ECHO_NATIVE_BENCH_BATCH (default 64):

raydata   Ray Data's own path: ``ray.data.read_images(root, mode="RGB")`` (Pillow,
          whole images, in read tasks) + ``map_batches`` of torchvision's
          RandomResizedCrop + flip where torchvision imports, else the same in
          Pillow as torchvision does it (``echo_native.lab.peers.rrc_params`` +
          ``resize(BILINEAR, box)``), 2 tasks each, ``iter_batches``
ray       ``echo_native.ray.EchoRing(ImageFolder(root), echo=1, concurrency=2)``:
          2 decoding actors with the fused kernel, the trainer's stream
local     ``echo_native.EchoRing(ImageFolder(root), echo=1, workers=2)``

One Ray instance serves both Ray pipelines.  Rounds alternate between pipelines
(the order rotating); in a round each pipeline runs alone: it is started, warmed
(actors, interpreters, page cache: 8 batches), then
ECHO_NATIVE_BENCH_RAY_BATCHES batches are timed, and it is closed: a live Ray
Data execution keeps its driver-side scheduler busy even when backpressured, and
would tax whichever pipeline is timed beside it.  The CPU that every process of the
run spends in a timed window is booked by role (consumer, Ray's actors, Ray's
system processes, Ray Data's workers, local workers).  Printed and written to
``benchmarks/results/ray.json``: the median img/s of each; the ratios ray/raydata
(target >= 5) and ray/local (target >= 0.7); where the Ray ring's time goes
beside the local ring's (the decode in the actors per image, the trainer's
assembly of Ray's rows, the rest: Ray's serialisation, object store and
scheduling); and the bytes that cross from the cluster per fresh example for
each placement (crops: after augmentation and batch echo; DCT-scaled canvases:
before augmentation).

test_local_nodes (``-k nodes``, run alone or first: it makes its own clusters) checks
docs/ray.md's model against local clusters of 1, 2 and 3 one-CPU nodes, one actor per
node, the trainer on the head: the delivered rate, the CPU per image by role, and the
cores other work left free (``benchmarks/results/ray_nodes.json``).

Environment:
  ECHO_NATIVE_BENCH_RAY_N        images (default 600)
  ECHO_NATIVE_BENCH_BATCH        batch size (default 64)
  ECHO_NATIVE_BENCH_RAY_ROUNDS   timed rounds per pipeline (default 4)
  ECHO_NATIVE_BENCH_RAY_BATCHES  batches per timed round (default 24)
  ECHO_NATIVE_BENCH_RAY_NODES    node counts of test_local_nodes (default 1,2,3)
  ECHO_NATIVE_BENCH_RAY_NODE_ROUNDS   rounds of them (default 2)
  ECHO_NATIVE_BENCH_RAY_NODE_BATCHES  batches timed per run (default 96)
"""
from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import echo_native as en
from benchenv import env_int, proc_table

ray = pytest.importorskip("ray", reason="needs the [ray] extra (ray[data])")
pytest.importorskip("ray.data")
# RandomCrops reaches Ray's workers by value: the benchmarks folder is not on their path.
# (Ray pickles map_batches' callable with its own copy of cloudpickle.)
import ray.cloudpickle  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

N_IMAGES = env_int("ECHO_NATIVE_BENCH_RAY_N", 600)
BATCH = env_int("ECHO_NATIVE_BENCH_BATCH", 64)
ROUNDS = env_int("ECHO_NATIVE_BENCH_RAY_ROUNDS", 4)
TIMED_BATCHES = env_int("ECHO_NATIVE_BENCH_RAY_BATCHES", 24)
WORKERS = 2
SIZE = 224
TARGETS = {"ray/raydata": 5.0, "ray/local": 0.7}
RESULTS = Path(__file__).resolve().parent / "results" / "ray.json"
# Passes over the files in Ray Data's one execution (each epoch a user iterates
# starts a new actor pool: these 8 fewer of them).  Not many more: Ray Data's driver
# plans every path, and 46,800 kept it busy for minutes.
EPOCHS = 8
AHEAD_BATCHES = 4       # the rings' slots (Workers(slots=4))
WARM_BATCHES = 8
# What the Ray ring lets Ray hold ahead (echo_native.ray.RayStream), Ray Data's path too.
RAY_AHEAD = max(2 * AHEAD_BATCHES, 4 * WORKERS)
# test_local_nodes: local clusters of these many 1-CPU nodes, batches timed in each.
NODES = [int(k) for k in os.environ.get("ECHO_NATIVE_BENCH_RAY_NODES", "1,2,3").split(",")]
NODE_BATCHES = env_int("ECHO_NATIVE_BENCH_RAY_NODE_BATCHES", 96)
NODE_ROUNDS = env_int("ECHO_NATIVE_BENCH_RAY_NODE_ROUNDS", 2)
NODE_RESULTS = RESULTS.with_name("ray_nodes.json")
NODE_STORE_BYTES = 768 << 20
CORES = len(os.sched_getaffinity(0))

_rates: dict = {}
_books: dict = {}
_cpu: dict = {}         # pipeline -> role -> CPU seconds in its timed windows
_cpu_images: dict = {}


def _crop():
    """torchvision's RandomResizedCrop + flip on a PIL image, or the same in Pillow."""
    try:
        from torchvision import transforms as T

        tv = T.Compose([T.RandomResizedCrop(SIZE, antialias=True), T.RandomHorizontalFlip()])
        return lambda im, rng: tv(im)
    except Exception:  # noqa: BLE001 - a broken install raises more than ImportError
        pass
    from PIL import Image

    from echo_native.lab.peers import rrc_params

    def crop(im, rng):
        top, left, h, w = rrc_params(rng, im.height, im.width)
        im = im.resize((SIZE, SIZE), Image.BILINEAR, box=(left, top, left + w, top + h))
        return im.transpose(Image.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else im
    return crop


class RandomCrops:
    """The ``map_batches`` callable of Ray Data's path: a batch of decoded images in,
    224x224 crops out (what a user writes, torchvision-style, per row)."""

    def __init__(self):
        self.crop, self.rng = _crop(), random.Random(os.getpid())

    def __call__(self, batch):
        from PIL import Image

        out = [np.asarray(self.crop(Image.fromarray(im), self.rng)) for im in batch["image"]]
        return {"image": np.stack(out)}


class Stream:
    """A pipeline read epoch after epoch, one batch at a time (its size)."""

    def __init__(self, make_iter):
        self.make_iter = make_iter
        self.it = self._batches()

    def _batches(self):
        while True:
            for n in self.make_iter():
                yield n

    def next(self):
        return next(self.it)

    def close(self):
        # Before ray.shutdown(): an iterator collected after it crashes Ray's core worker.
        self.it.close()


class RingStream(Stream):
    def __init__(self, ring):
        self.ring = ring.__enter__()
        super().__init__(lambda: (len(b) for b in self.ring))


    def close(self):
        super().close()
        self.ring.__exit__(None, None, None)


def _raydata(root):
    files = [str(en.ImageFolder(root).path(i)) for i in range(N_IMAGES)]
    ds = ray.data.read_images(files * EPOCHS, mode="RGB", concurrency=WORKERS)
    ds = ds.map_batches(RandomCrops, batch_size=BATCH, batch_format="numpy",
                        compute=ray.data.ActorPoolStrategy(size=WORKERS), num_cpus=1)
    ds.context.enable_progress_bars = False
    # Read-ahead bounded as the Ray ring's is (Ray's default fills a share of the
    # node's memory, decoding on the cores another pipeline is being timed on).
    limits = ds.context.execution_options.resource_limits
    ds.context.execution_options.resource_limits = limits.copy(
        object_store_memory=float(RAY_AHEAD * BATCH * SIZE * SIZE * 3))

    def epoch():
        for b in ds.iter_batches(batch_size=BATCH, batch_format="numpy", prefetch_batches=2,
                                 drop_last=True):
            yield len(b["image"])
    return Stream(epoch)


@pytest.fixture(scope="module")
def pipelines():
    """Makers of the three pipelines (each round starts and closes its own: a live Ray
    Data execution keeps its driver-side scheduler busy even when backpressured, on
    the cores another pipeline is being timed on)."""
    import echo_native.ray as er
    from echo_native.lab import corpus

    try:
        root = corpus.default_corpus(n_images=N_IMAGES, seed=env_int("ECHO_NATIVE_BENCH_SEED", 0))
    except ImportError as e:
        pytest.skip(str(e))
    ray.init(num_cpus=2 * WORKERS, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    kw = dict(image_size=SIZE, echo=1, seed=0, drop_last=True, slots=AHEAD_BATCHES)
    try:
        yield {"raydata": lambda: _raydata(root),
               "ray": lambda: RingStream(er.EchoRing(en.ImageFolder(root), BATCH,
                                                     concurrency=WORKERS, **kw)),
               "local": lambda: RingStream(en.EchoRing(en.ImageFolder(root), BATCH,
                                                       workers=WORKERS, **kw))}
        _books["bytes_per_fresh"] = _placement_bytes(er, root)
    finally:
        ray.shutdown()
    _report()


def _placement_bytes(er, root):
    """What crosses from the cluster per fresh example, by placement (a few batches)."""
    out = {}
    for placement in ("after_augment", "before_augment"):
        ring = er.EchoRing(en.ImageFolder(root), BATCH, image_size=SIZE, echo=2.0,
                           placement=placement, concurrency=WORKERS, seed=0)
        with ring:
            it = iter(ring)
            for _ in range(4):
                next(it)
            del it
            out[placement] = ring.stats()["ray_bytes_per_fresh"]
    return out


def _role(pid, me):
    """Who a process of this run is, by its command line (Ray names its workers
    ``ray::<actor or task>``)."""
    if pid == me:
        return "consumer"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    if "TicketDecoder" in cmd:
        return "ray actors (fused kernel)"
    if "RandomCrops" in cmd or "ReadImage" in cmd:
        return "raydata workers (Pillow)"
    if "ray" in cmd.split(" ", 1)[0] or "raylet" in cmd or "gcs_server" in cmd or \
            "/ray/" in cmd:
        return "ray system"
    return "local workers"


def cpu_by_role():
    """CPU seconds so far of this process and its descendants, by :func:`_role`."""
    table, me = proc_table(), os.getpid()
    kids = {}
    for pid, row in table.items():
        kids.setdefault(row[0], []).append(pid)
    out, todo, seen = {}, [me], set()
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in table:
            continue
        seen.add(pid)
        todo += kids.get(pid, [])
        role = _role(pid, me)
        out[role] = out.get(role, 0.0) + table[pid][1] / os.sysconf("SC_CLK_TCK")
    return out


def _cpu_jiffies():
    """(busy, steal) ticks of the whole machine so far (/proc/stat's first line)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return sum(v[:8]) - v[3] - v[4] - v[7], v[7]


def _streams_ended(timeout=120.0):
    """Wait for the rings' stream threads, and the threads of Ray Data's iterators they
    closed, to end before Ray does: one still getting a block when Ray shuts down
    aborts the process (Ray's core worker), or connects again (Ray's auto-init)."""
    import threading

    names = ("echo_native-ray-stream", "iter_threaded", "StreamingExecutor")
    deadline = time.monotonic() + timeout
    while any(t.name.startswith(names) for t in threading.enumerate()):
        if time.monotonic() > deadline:
            raise RuntimeError("a ring's stream thread did not end")
        time.sleep(0.05)


def _node_run(root, k):
    """One local Cluster of ``k`` 1-CPU nodes (the head, where the trainer runs, and k - 1
    more), one decoding actor per node: the delivered rate, the CPU per image by role,
    and the cores other work left free in the timed window."""
    from ray.cluster_utils import Cluster

    import echo_native.ray as er

    # Each node's object store holds what Ray decodes ahead (a local Cluster's default,
    # 150 MB, would spill it to disk).
    store = {"object_store_memory": NODE_STORE_BYTES}
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                      **store})
    stream = None
    try:
        for _ in range(k - 1):
            c.add_node(num_cpus=1, **store)
        c.wait_for_nodes(timeout=120)
        ray.init(address=c.address, log_to_driver=False, configure_logging=False)
        stream = RingStream(er.EchoRing(en.ImageFolder(root), BATCH, concurrency=k,
                                        image_size=SIZE, echo=1, seed=0, drop_last=True,
                                        slots=AHEAD_BATCHES))
        for _ in range(WARM_BATCHES):
            stream.next()
        c0, (b0, s0), t0 = cpu_by_role(), _cpu_jiffies(), time.perf_counter()
        n = sum(stream.next() for _ in range(NODE_BATCHES))
        dt = time.perf_counter() - t0
        c1, (b1, s1) = cpu_by_role(), _cpu_jiffies()
        stats = stream.ring.stats()
    finally:
        if stream is not None:
            stream.close()
        _streams_ended()
        ray.shutdown()
        c.shutdown()
    tick = os.sysconf("SC_CLK_TCK")
    roles = {r: max(0.0, v - c0.get(r, 0.0)) for r, v in c1.items()}
    run = sum(v for r, v in roles.items() if r != "gone")
    others = max(0.0, (b1 - b0) / tick - run)          # other work's CPU, this run's aside
    return {"nodes": k, "img_per_s": n / dt, "seconds": dt,
            "cpu_ms_per_image": {r: 1e3 * v / n for r, v in sorted(roles.items()) if v > 0},
            "cores_used": run / dt, "cores_free": max(0.0, CORES - others / dt),
            "steal_cores": (s1 - s0) / tick / dt, "ray_actors": stats["ray_actors"],
            "ray_bytes_per_fresh": stats["ray_bytes_per_fresh"]}


def model(runs):
    """The measured model's prediction for each run of k nodes (c: CPU ms per image):

        rate(k) = min(k * 1000 / c_actor,  1000 * cores_free / c_total(k))
        c_total(k) = c_actor + c_trainer + c_daemons + (k - 1) / k * c_move

    k nodes decode at most one core's worth each, and processes sharing cores deliver
    at most what the free cores give at their total cost per image.  A ticket decoded
    off the trainer's node is moved to it by Ray's object managers (c_move of their
    CPU per image; (k - 1) / k of the tickets with one actor per node).  c_actor,
    c_trainer and c_daemons are the one-node runs' (nothing moves), c_move the
    two-node runs' extra daemon CPU; three nodes are predicted, not fitted."""
    def med(k, role):
        vals = [r["cpu_ms_per_image"].get(role, 0.0) for r in runs if r["nodes"] == k]
        return statistics.median(vals) if vals else None

    actor, trainer, daemons = "ray actors (fused kernel)", "consumer", "ray system"
    c = {"actor": med(1, actor), "trainer": med(1, trainer), "daemons": med(1, daemons)}
    c["move"] = (2 * (med(2, daemons) - c["daemons"])) if med(2, daemons) is not None \
        else 0.0

    def rate(k, cores_free):
        total = c["actor"] + c["trainer"] + c["daemons"] + (k - 1) / k * c["move"]
        return min(1e3 * k / c["actor"], 1e3 * cores_free / total)
    return rate, c


def test_local_nodes():
    """The model in docs/ray.md against 1, 2 and 3 local nodes (ECHO_NATIVE_BENCH_RAY_NODES),
    each a local ray.cluster_utils.Cluster of its own, ECHO_NATIVE_BENCH_RAY_NODE_ROUNDS
    rounds (the order rotating).  On a machine of CORES cores the nodes share them:
    the check is that prediction and measurement agree given the cores (other work
    on the machine is measured, /proc/stat, and left out of the cores free)."""
    from echo_native.lab import corpus

    try:
        root = corpus.default_corpus(n_images=N_IMAGES, seed=env_int("ECHO_NATIVE_BENCH_SEED", 0))
    except ImportError as e:
        pytest.skip(str(e))
    if ray.is_initialized():
        ray.shutdown()
    runs = [_node_run(root, k) for r in range(NODE_ROUNDS)
            for k in NODES[r % len(NODES):] + NODES[:r % len(NODES)]]
    rate, c = model(runs)
    for r in runs:
        r["predicted_img_per_s"] = rate(r["nodes"], r["cores_free"])
        r["measured_over_predicted"] = r["img_per_s"] / r["predicted_img_per_s"]
    out = {"runs": runs, "model_ms_per_image": c, "cores": CORES, "batch": BATCH,
           "images": N_IMAGES, "batches_timed": NODE_BATCHES}
    NODE_RESULTS.parent.mkdir(exist_ok=True)
    NODE_RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print("\nmodel, CPU ms per image: " + ", ".join(f"{k} {v:.2f}" for k, v in c.items()) +
          f"; {CORES} cores")
    for r in sorted(runs, key=lambda r: r["nodes"]):
        cpu = ", ".join(f"{role} {v:.2f}" for role, v in r["cpu_ms_per_image"].items())
        print(f"{r['nodes']} node(s): {r['img_per_s']:,.0f} img/s, predicted "
              f"{r['predicted_img_per_s']:,.0f} ({r['measured_over_predicted']:.2f}); cores "
              f"free {r['cores_free']:.2f}, used {r['cores_used']:.2f}; CPU ms/img: {cpu}; "
              f"actors {r['ray_actors']}")
    print(NODE_RESULTS)


def test_paired_rounds(pipelines):
    """Rounds of every pipeline in turn (the order rotating), for the ratios: each starts
    alone, is warmed (actors, interpreters, page cache), has ECHO_NATIVE_BENCH_RAY_BATCHES
    batches timed and is closed.  The CPU each process of the run spends in the timed
    window is booked by role: a cost per image other work on a shared machine does not
    inflate."""
    names = list(pipelines)
    for r in range(ROUNDS):
        for name in names[r % len(names):] + names[:r % len(names)]:
            stream = pipelines[name]()
            try:
                for _ in range(WARM_BATCHES):
                    stream.next()
                c0 = cpu_by_role()
                t0 = time.perf_counter()
                n = sum(stream.next() for _ in range(TIMED_BATCHES))
                dt = time.perf_counter() - t0
                c1 = cpu_by_role()
                if isinstance(stream, RingStream):
                    _books[name] = stream.ring.stats()
                    _books[name + "_fill_s"] = stream.ring.stage.books.fill_s
            finally:
                stream.close()
            assert n == TIMED_BATCHES * BATCH
            _rates.setdefault(name, []).append(n / dt)
            cpu = _cpu.setdefault(name, {})
            for role, v in c1.items():
                cpu[role] = cpu.get(role, 0.0) + max(0.0, v - c0.get(role, 0.0))
            _cpu_images[name] = _cpu_images.get(name, 0) + n


def _report():
    if not all(_rates.values()):
        return
    med = {k: statistics.median(v) for k, v in _rates.items()}
    ratios = {"ray/raydata": med["ray"] / med["raydata"], "ray/local": med["ray"] / med["local"]}
    # The same ratios round by round (neighbouring rounds see the same load on a
    # shared machine), and their medians.
    paired = {k: [r[a] / r[b] for r in
                  [dict(zip(_rates, vals)) for vals in zip(*_rates.values())]]
              for k, (a, b) in {"ray/raydata": ("ray", "raydata"),
                                "ray/local": ("ray", "local")}.items()}
    ray_s, local_s = _books["ray"], _books["local"]
    # Per image, in core-seconds of the 2 cores: what each ring costs at its rate, and
    # the parts of the Ray ring's that can be told apart.
    per_image = {
        "local_cost_ms": 1e3 * WORKERS / med["local"],
        "ray_cost_ms": 1e3 * WORKERS / med["ray"],
        "local_decode_ms": 1e3 * _books["local_fill_s"] / max(1, local_s["fresh"]),
        "ray_decode_ms": 1e3 * _books["ray_fill_s"] / max(1, ray_s["fresh"]),
        "ray_assembly_ms": 1e3 * ray_s["ray_assemble_s"] / max(1, ray_s["fresh"]),
    }
    per_image["ray_rest_ms"] = (per_image["ray_cost_ms"] - per_image["ray_decode_ms"] -
                                per_image["ray_assembly_ms"])
    result = {"img_per_s": med, "ratios": ratios, "targets": TARGETS, "rounds": ROUNDS,
              "paired_ratios": paired,
              "cpu_ms_per_image": {k: {role: round(1e3 * v / _cpu_images[k], 3)
                                       for role, v in sorted(roles.items()) if v > 0}
                                   for k, roles in _cpu.items()},
              "paired_ratio_medians": {k: statistics.median(v) for k, v in paired.items()},
              "workers": WORKERS, "batch": BATCH, "images": N_IMAGES,
              "per_image": per_image,
              "bytes_per_fresh": {**_books["bytes_per_fresh"],
                                  "echo1": ray_s["ray_bytes_per_fresh"]},
              "duplicates": ray_s["duplicates"],
              "raydata_crop": "torchvision" if _crop().__name__ == "<lambda>" else "pillow",
              "per_round": _rates, "cpus": len(os.sched_getaffinity(0))}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print("\n" + "; ".join(f"{k}: {v:,.0f} img/s" for k, v in med.items()))
    print("; ".join(f"{k} {v:.2f} (target >= {TARGETS[k]}; round by round "
                    f"{', '.join(f'{x:.2f}' for x in paired[k])})" for k, v in ratios.items()))
    print("per image: " + ", ".join(f"{k} {v:.2f}" for k, v in per_image.items()))
    for k, roles in result["cpu_ms_per_image"].items():
        print(f"CPU ms per image, {k}: " + ", ".join(f"{r} {v:.2f}" for r, v in roles.items()))
    print("bytes per fresh example: " + ", ".join(
        f"{k} {v:,.0f}" for k, v in result["bytes_per_fresh"].items()) + f"; {RESULTS}")

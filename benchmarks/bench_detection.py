"""Detection pipeline throughput: EchoRing vs torch DataLoader + torchvision v2 and
torch DataLoader + albumentations, on the same COCO-format folder in one run.

    python -m pytest benchmarks/bench_detection.py -s -q --benchmark-json=/tmp/detection.json

(run it with an interpreter where torchvision imports: the torchvision and
albumentations peers are skipped elsewhere, and the summary says why.)

The data are **generated**: the first N images of the built-in ImageNet-like
corpus (``echo_native.lab.corpus``, real-photo JPEGs, 300-640 px on the longer
side), each given 2-4 boxes at random places and sizes (6-60% of each side) with
random labels out of 20 categories, written as a COCO instances JSON beside the
image files.  The boxes do not frame real objects, which no loader can tell: the
work (decode, crop, flip, resize, box arithmetic) is that of real detection data.

Every pipeline applies torchvision's SSD training geometry, uint8 out, at 300 x 300
(``RandomPhotometricDistort`` is left out on every side), with 2 worker processes:

echo        ``EchoRing(CocoDetection(...), echo=1, workers=2)`` with
            ``[RandomZoomOut(fill=mean), RandomIoUCrop(), RandomHorizontalFlip(),
            Resize((300, 300)), SanitizeBoundingBoxes()]``; per batch the consumer
            takes the images as a torch tensor (DLPack, NHWC, no copy) and the
            targets from ``batch.objects.to_torchvision()``.
torchvision torch ``DataLoader(num_workers=2)`` over ``torchvision.datasets.CocoDetection``
            (PIL decode) wrapped by ``wrap_dataset_for_transforms_v2`` with
            ``v2.Compose([RandomZoomOut(fill=mean), RandomIoUCrop(),
            RandomHorizontalFlip(), Resize((300, 300)), ToImage(),
            SanitizeBoundingBoxes()])``, geometry on the PIL image as torchvision's
            detection reference does with its PIL backend; the workers collate the
            images into one CHW uint8 tensor and the targets into a list.
albu        torch ``DataLoader(num_workers=2)`` over a Dataset reading the same JSON:
            ``cv2.imread`` + RGB, then ``A.Compose([A.RandomSizedBBoxSafeCrop(300, 300),
            A.HorizontalFlip()], bbox_params=A.BboxParams(format="pascal_voc"))``
            (albumentations has no SSD zoom-out or IoU crop: its box-safe crop keeps
            every box and resizes in the same call, so this peer does less than the
            others), collated like the torchvision peer; OpenCV one thread per worker.

All three are started once and kept alive; in each cycle every pipeline in turn is
timed over the same number of whole batches after the others have refilled their
prefetch (so none decodes during another's round) and its own prefetch has been
drained (untimed).  Reported per pipeline: images/s, median and min-max over the
cycles; and the per-cycle ratios echo/torchvision and echo/albu, median and min-max.

``test_echo_before_augment_upstream_bound``: one worker (the other core is the
consumer's and the re-augmentation's), a null consumer, the geometry without
``RandomZoomOut`` (before_augment refuses it): ``EchoRing(echo=1)`` against
``EchoRing(echo=Echo(2, placement="before_augment"))``, timed in rounds of ~3 epochs,
alternating which goes first;
reported are the delivered and fresh images/s of each and delivered(e=2) /
delivered(e=1) (the e=1 ring's delivered rate is its fresh rate).

Targets (issue 36): echo >= 2.5x torchvision and > 1x albu; e=2 before_augment
>= 1.6x the fresh rate.  The table is printed at the end of the module (``-s``) and
written to ``benchmarks/results/detection.json``.

Environment: ECHO_NATIVE_DET_N (images, default 256), ECHO_NATIVE_DET_BATCH (32),
ECHO_NATIVE_DET_ROUNDS (cycles, default 5), ECHO_NATIVE_BENCH_SEED (corpus seed).
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np
import pytest
from benchenv import Repeat, env_int, load_mark, load_since

import echo_native as en

torch = pytest.importorskip("torch")

SIZE = (300, 300)
MEAN_FILL = (124, 116, 104)     # torchvision's detection reference fills a zoom-out with it
WORKERS = 2
SEED = 1234
CATEGORIES = 20
N = env_int("ECHO_NATIVE_DET_N", 256)
BATCH = env_int("ECHO_NATIVE_DET_BATCH", 32)
ROUNDS = env_int("ECHO_NATIVE_DET_ROUNDS", 5)
RESULTS = Path(__file__).resolve().parent / "results" / "detection.json"
TARGETS = {"torchvision": 2.5, "albu": 1.0, "before_augment_e2": 1.6}


def _missing(check):
    """None when the peer imports, else why not."""
    try:
        check()
    except Exception as e:  # noqa: BLE001 - torchvision without its ops raises RuntimeError
        return f"{type(e).__name__}: {e}"
    return None


def _import_tv():
    import pycocotools  # noqa: F401 - torchvision's CocoDetection needs it
    import torchvision  # noqa: F401
    from torchvision.transforms import v2  # noqa: F401


def _import_albu():
    import albumentations  # noqa: F401
    import cv2  # noqa: F401


TV_MISSING = _missing(_import_tv)
ALBU_MISSING = _missing(_import_albu)

_results: dict = {}


# ---- the data -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    """(images_root, annotation_json): N corpus JPEGs with 2-4 random boxes each (copies:
    CocoDetection refuses links that lead out of its root)."""
    from echo_native.lab import corpus

    try:
        src_root = corpus.default_corpus(n_images=N, seed=env_int("ECHO_NATIVE_BENCH_SEED", 0))
    except ImportError as e:
        pytest.skip(str(e))
    root = tmp_path_factory.mktemp("coco")
    rng = np.random.default_rng(SEED)
    images, annotations = [], []
    for i, path in enumerate(corpus.corpus_files(src_root)[:N]):
        name = f"{i:06d}.jpg"
        (root / name).write_bytes(data := path.read_bytes())
        h, w = en.image_size(data)
        images.append({"id": i + 1, "file_name": name, "height": h, "width": w})
        for _ in range(int(rng.integers(2, 5))):
            bw, bh = (float(v) for v in rng.uniform(0.06, 0.6, 2) * (w, h))
            x, y = float(rng.uniform(0, w - bw)), float(rng.uniform(0, h - bh))
            annotations.append({"id": len(annotations) + 1, "image_id": i + 1,
                                "category_id": int(rng.integers(1, CATEGORIES + 1)),
                                "bbox": [round(x, 2), round(y, 2), round(bw, 2), round(bh, 2)],
                                "area": round(bw * bh, 2), "iscrowd": 0})
    ann = root / "instances.json"
    ann.write_text(json.dumps({
        "images": images, "annotations": annotations,
        "categories": [{"id": k, "name": f"class{k}"} for k in range(1, CATEGORIES + 1)]}))
    return root, ann


def ssd_geometry(zoom_out=True):
    zoom = [en.RandomZoomOut(fill=MEAN_FILL, side_range=(1.0, 4.0))] if zoom_out else []
    return zoom + [en.RandomIoUCrop(), en.RandomHorizontalFlip(), en.Resize(SIZE),
                   en.SanitizeBoundingBoxes()]


# ---- peers: torch Datasets (module level: the DataLoader's workers pickle nothing here,
# they fork, but the collate and worker init must be plain functions) ----------------------
def collate_detection(items):
    """Images (all 300 x 300 after Resize) stacked CHW uint8; targets as a list."""
    images, targets = zip(*items)
    return torch.stack([torch.as_tensor(im) for im in images]), list(targets)


def _one_cv2_thread(_worker_id):
    import cv2

    cv2.setNumThreads(1)


def torchvision_dataset(root, ann):
    from torchvision import datasets, tv_tensors  # noqa: F401
    from torchvision.transforms import v2

    tf = v2.Compose([v2.RandomZoomOut(fill=MEAN_FILL, side_range=(1.0, 4.0)), v2.RandomIoUCrop(),
                     v2.RandomHorizontalFlip(), v2.Resize(SIZE), v2.ToImage(),
                     v2.SanitizeBoundingBoxes()])
    ds = datasets.CocoDetection(str(root), str(ann), transforms=tf)
    return datasets.wrap_dataset_for_transforms_v2(ds, target_keys=("boxes", "labels"))


class AlbuCoco(torch.utils.data.Dataset):
    """A COCO folder read with json, decoded by OpenCV, augmented by albumentations."""

    def __init__(self, root, ann):
        import albumentations as A

        doc = json.loads(Path(ann).read_text())
        per_image = {im["id"]: [] for im in doc["images"]}
        for a in doc["annotations"]:
            per_image[a["image_id"]].append(a)
        self.items = []
        for im in doc["images"]:
            anns = per_image[im["id"]]
            boxes = [[x, y, x + w, y + h] for x, y, w, h in (a["bbox"] for a in anns)]
            self.items.append((str(Path(root) / im["file_name"]), boxes,
                               [a["category_id"] for a in anns]))
        self.tf = A.Compose([A.RandomSizedBBoxSafeCrop(height=SIZE[0], width=SIZE[1]),
                             A.HorizontalFlip(p=0.5)],
                            bbox_params=A.BboxParams(format="pascal_voc",
                                                     label_fields=["labels"], min_area=1.0))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        import cv2

        path, boxes, labels = self.items[index]
        img = cv2.cvtColor(cv2.imread(path, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
        out = self.tf(image=img, bboxes=boxes, labels=labels)
        target = {"boxes": torch.as_tensor(np.asarray(out["bboxes"], np.float32).reshape(-1, 4)),
                  "labels": torch.as_tensor(np.asarray(out["labels"], np.int64))}
        return torch.from_numpy(out["image"]).permute(2, 0, 1), target


# ---- streams: next() returns the batch's image count ----------------------------------------
class RingStream:
    """An EchoRing read epoch after epoch; the consumer takes the images and the targets
    as torch tensors, as a training step would."""

    def __init__(self, source, augment, echo, workers):
        self.ring = en.EchoRing(source, batch_size=BATCH, augment=augment, echo=echo,
                                workers=workers, seed=SEED, drop_last=True)
        self.ring.start()
        self.ahead = self.ring.loader.slots
        self.it = self._forever()
        self.fresh = 0

    def _forever(self):
        while True:
            yield from self.ring

    def next(self):
        b = next(self.it)
        torch.from_dlpack(b.images)
        b.objects.to_torchvision()
        self.fresh += int(np.count_nonzero(b.fresh))
        return len(b)

    def settle(self, timeout=30.0):
        """Until the ring is full (every slot but the held one published)."""
        slots = self.ring.loader.slots
        deadline = time.monotonic() + timeout
        while self.ring.stats()["ring_occupancy"] < (slots - 1) / slots - 1e-9:
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)

    def close(self):
        self.it.close()
        self.ring.close()


class _Counted(torch.utils.data.Dataset):
    """Counts the samples its workers have finished, in memory shared with them (fork),
    so that ``TorchStream.settle`` can wait for exactly the prefetched batches."""

    def __init__(self, ds):
        import multiprocessing

        self.ds, self.done = ds, multiprocessing.get_context("fork").Value("q", 0)

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, index):
        item = self.ds[index]
        with self.done.get_lock():
            self.done.value += 1
        return item


class TorchStream:
    """A torch DataLoader over a Dataset, collated in the workers, endless."""

    def __init__(self, ds, workers):
        g = torch.Generator().manual_seed(SEED)
        self.ds = _Counted(Repeat(ds, 100_000))
        self.dl = torch.utils.data.DataLoader(
            self.ds, batch_size=BATCH, shuffle=True, generator=g,
            num_workers=workers, drop_last=True, collate_fn=collate_detection,
            worker_init_fn=_one_cv2_thread if not ALBU_MISSING else None,
            prefetch_factor=2, persistent_workers=False, multiprocessing_context="fork")
        self.it = iter(self.dl)
        self.ahead = 2 * workers                   # prefetch_factor x workers
        self.taken = 0

    def next(self):
        n = int(next(self.it)[0].shape[0])
        self.taken += 1
        return n

    def settle(self, timeout=120.0):
        """Until every batch the iterator has asked its workers for is made: the ones
        taken plus ``ahead`` more (collate, after the count, is a small share)."""
        want = (self.taken + self.ahead) * BATCH
        deadline = time.monotonic() + timeout
        while self.ds.done.value < want and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self):
        del self.it                                # shuts its workers down


class Streams:
    """The pipelines of one comparison, started once and kept alive for the module."""

    def __init__(self, makers):
        self.makers, self.live = makers, {}

    def get(self, role):
        if role not in self.live:
            stream = self.makers[role]()
            self.live[role] = stream
            for _ in range(2 * (stream.ahead + 1)):   # warm-up: workers up, caches hot
                stream.next()
        return self.live[role]

    def timed(self, role, batches):
        """Drain ``role``'s prefetch (untimed) once the others have refilled theirs, then
        time ``batches`` batches; returns (images, seconds, fresh images)."""
        for other, s in self.live.items():
            if other != role:
                s.settle()
        stream = self.get(role)
        for _ in range(stream.ahead):
            stream.next()
        fresh0 = getattr(stream, "fresh", 0)
        t0 = time.perf_counter()
        images = sum(stream.next() for _ in range(batches))
        took = time.perf_counter() - t0
        return images, took, getattr(stream, "fresh", 0) - fresh0

    def close(self):
        for s in self.live.values():
            s.close()
        self.live.clear()


def _start(streams, makers):
    """Every pipeline started and warmed up (untimed) before the first cycle."""
    for role in makers:
        streams.get(role)


def _spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# ---- benchmarks -----------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def report():
    """Print the table and save the numbers when the module's benchmarks are done."""
    mark = load_mark()
    yield
    if not _results:
        return
    _results["_machine"] = load_since(mark)
    _results["_settings"] = {"images": N, "batch": BATCH, "rounds": ROUNDS, "size": SIZE,
                             "workers": WORKERS, "torchvision_missing": TV_MISSING,
                             "albumentations_missing": ALBU_MISSING}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(_results, indent=2, default=str))
    print("\n== detection pipelines, images/s (median, min-max over cycles)")
    for role, row in _results.get("pipelines", {}).items():
        r = row["images_per_s"]
        print(f"  {role:12s} {r['median']:8.0f}  ({r['min']:.0f}-{r['max']:.0f})  {row['label']}")
    for peer, row in _results.get("ratios", {}).items():
        print(f"  echo / {peer:12s} {row['median']:.2f}x ({row['min']:.2f}-{row['max']:.2f})"
              f"  target >= {TARGETS[peer]}")
    for peer in ("torchvision", "albu"):
        missing = TV_MISSING if peer == "torchvision" else ALBU_MISSING
        if missing:
            print(f"  {peer}: left out ({missing})")
    up = _results.get("before_augment")
    if up:
        print("== echo e=2 before_augment, 1 worker, upstream-bound (images/s, median, min-max)")
        for role in ("e1", "e2"):
            d, f = up[role]["delivered_per_s"], up[role]["fresh_per_s"]
            print(f"  {role}: delivered {d['median']:.0f} ({d['min']:.0f}-{d['max']:.0f}), "
                  f"fresh {f['median']:.0f} ({f['min']:.0f}-{f['max']:.0f})")
        r = up["ratio"]
        print(f"  delivered e=2 / fresh rate (e=1): {r['median']:.2f}x "
              f"({r['min']:.2f}-{r['max']:.2f})  target >= {TARGETS['before_augment_e2']}")
    print(f"  machine: {_results['_machine']}")


LABELS = {"echo": "echo_native EchoRing echo=1 (fused ROI decode, SSD geometry)",
          "torchvision": "torch DataLoader + torchvision CocoDetection + transforms.v2 (PIL)",
          "albu": "torch DataLoader + albumentations (cv2 decode, RandomSizedBBoxSafeCrop)"}


@pytest.mark.benchmark(group="detection")
def test_paired_rounds(benchmark, coco):
    """Images/s of the three detection pipelines at 2 workers, timed round-robin."""
    root, ann = coco
    makers = {"echo": lambda: RingStream(en.CocoDetection(root, ann), ssd_geometry(), 1,
                                         WORKERS)}
    if not TV_MISSING:
        makers["torchvision"] = lambda: TorchStream(torchvision_dataset(root, ann), WORKERS)
    if not ALBU_MISSING:
        makers["albu"] = lambda: TorchStream(AlbuCoco(root, ann), WORKERS)
    streams = Streams(makers)
    batches = max(4, N // BATCH)
    rates = {role: [] for role in makers}

    def cycle():
        for role in makers:
            images, took, _ = streams.timed(role, batches)
            assert images == batches * BATCH
            rates[role].append(images / took)

    try:
        benchmark.extra_info.update(images_per_round=batches * BATCH, workers=WORKERS,
                                    batch_size=BATCH, files=N)
        benchmark.pedantic(cycle, setup=lambda: _start(streams, makers),
                           rounds=ROUNDS, iterations=1)
    finally:
        streams.close()
    _results["pipelines"] = {role: {"label": LABELS[role], "images_per_s": _spread(v)}
                             for role, v in rates.items()}
    _results["ratios"] = {peer: _spread([e / p for e, p in zip(rates["echo"], rates[peer])])
                          for peer in makers if peer != "echo"}
    benchmark.extra_info.update(ratios=_results["ratios"])


@pytest.mark.benchmark(group="detection-echo")
def test_echo_before_augment_upstream_bound(benchmark, coco):
    """Delivered images/s of echo e=2 before_augment vs the fresh rate (e=1), 1 worker."""
    root, ann = coco
    geometry = ssd_geometry(zoom_out=False)
    makers = {"e1": lambda: RingStream(en.CocoDetection(root, ann), geometry, 1, 1),
              "e2": lambda: RingStream(en.CocoDetection(root, ann), geometry,
                                       en.Echo(2, placement="before_augment"), 1)}
    streams = Streams(makers)
    batches = max(12, 3 * N // BATCH)     # ~3 epochs: a round long enough to span the
    rounds = {role: [] for role in makers}  # echo buffer's refills
    order = list(makers)

    def cycle():
        for role in order:
            rounds[role].append(streams.timed(role, batches))
        order.reverse()                   # e1 first, then e2 first: drift cancels out

    try:
        benchmark.pedantic(cycle, setup=lambda: _start(streams, makers),
                           rounds=ROUNDS, iterations=1)
    finally:
        streams.close()
    out = {role: {"delivered_per_s": _spread([i / t for i, t, _ in v]),
                  "fresh_per_s": _spread([f / t for _, t, f in v])}
           for role, v in rounds.items()}
    out["ratio"] = _spread([(i2 / t2) / (i1 / t1) for (i1, t1, _), (i2, t2, _)
                            in zip(rounds["e1"], rounds["e2"])])
    _results["before_augment"] = out
    benchmark.extra_info.update(ratio=out["ratio"])

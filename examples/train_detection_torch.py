"""Train torchvision's SSDlite detector on a COCO-format folder, fed by EchoRing with echo.

What it shows:
  - ``CocoDetection(images_root, annotation_json)``: COCO's instances format,
    categories mapped to contiguous labels from 1 (0 is the background);
  - torchvision's SSD training geometry as the ring's augment (RandomZoomOut,
    RandomIoUCrop, RandomHorizontalFlip, Resize, SanitizeBoundingBoxes), drawn
    before decoding, with echo after augmentation: each image's boxes are
    repeated with its pixels;
  - the batch handed to the model as torchvision's detection models take it:
    images as float32 NCHW in [0, 1] (``torch.from_dlpack``, no copy; the model
    normalises them itself) and ``batch.objects.to_torchvision()``, one
    ``{"boxes", "labels"}`` dict per image, boxes xyxy in output pixels.

Run it in a venv where torchvision's compiled ops load: PyPI's default torch +
torchvision pair (``python -m venv tv-venv && tv-venv/bin/pip install -e .
'torch==2.14.1' 'torchvision==0.29.1'``), not the README's CPU torch 2.13.0, next to
which torchvision does not load (the script then says so in one line). With no arguments it makes a small COCO-format folder
out of the built-in corpus, 2-4 boxes per image at random places with random
labels: the boxes frame nothing, so the loss falls only as far as the model
learns the boxes' statistics; it exercises the pipeline and the model.

    python examples/train_detection_torch.py --steps 20
    python examples/train_detection_torch.py --data /data/coco/train2017 \\
        --annotations /data/coco/annotations/instances_train2017.json --steps 1000

Like most training scripts it has no ``if __name__ == "__main__":`` guard:
EchoRing's worker processes never run this file.
"""
import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

try:
    from torchvision.models.detection import ssdlite320_mobilenet_v3_large
except (ImportError, RuntimeError, OSError) as e:
    # PyPI's torchvision links libtorch_cuda: its compiled ops do not load next to a CPU
    # build of torch (the README's venv has torch 2.13.0+cpu).  One line, not a traceback.
    raise SystemExit(
        f"train_detection_torch.py needs torchvision, which does not load here ({e}); run it "
        f"in a venv with PyPI's default torch + torchvision pair: python -m venv tv-venv && "
        f"tv-venv/bin/pip install -e . 'torch==2.14.1' 'torchvision==0.29.1' && "
        f"tv-venv/bin/python examples/train_detection_torch.py --steps 20") from None

import echo_native as en
from echo_native.lab import corpus

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--data", help="the images folder of a COCO-format data set "
                                   "(default: a small one generated from the built-in corpus)")
parser.add_argument("--annotations", help="its instances JSON (needed with --data)")
parser.add_argument("--images", type=int, default=64, help="images of the generated data set")
parser.add_argument("--size", type=int, default=320, help="output side (SSDlite's is 320)")
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
parser.add_argument("--echo", type=float, default=2.0, help="echo factor, after augmentation")
parser.add_argument("--workers", type=int, default=2, help="decoding processes")
parser.add_argument("--lr", type=float, default=0.01)
args = parser.parse_args()
if bool(args.data) != bool(args.annotations):
    parser.error("--data and --annotations go together")


def make_coco(folder, n, categories=5, seed=0):
    """A COCO-format folder: ``n`` corpus images with 2-4 random boxes each (copies:
    CocoDetection refuses links that lead out of its root).  Returns (images_root,
    annotation_json)."""
    src = corpus.corpus_files(corpus.default_corpus())[:n]
    rng = np.random.default_rng(seed)
    images, annotations = [], []
    for i, path in enumerate(src):
        name = f"{i:06d}.jpg"
        (folder / name).write_bytes(data := path.read_bytes())
        h, w = en.image_size(data)
        images.append({"id": i + 1, "file_name": name, "height": h, "width": w})
        for _ in range(int(rng.integers(2, 5))):
            bw, bh = (float(v) for v in rng.uniform(0.1, 0.6, 2) * (w, h))
            x, y = float(rng.uniform(0, w - bw)), float(rng.uniform(0, h - bh))
            annotations.append({"id": len(annotations) + 1, "image_id": i + 1,
                                "category_id": int(rng.integers(1, categories + 1)),
                                "bbox": [x, y, bw, bh], "area": bw * bh, "iscrowd": 0})
    ann = folder / "instances.json"
    ann.write_text(json.dumps({"images": images, "annotations": annotations,
                               "categories": [{"id": k, "name": f"class{k}"}
                                              for k in range(1, categories + 1)]}))
    return folder, ann


scratch = None
if args.data:
    images_root, annotations = Path(args.data), Path(args.annotations)
else:
    scratch = tempfile.TemporaryDirectory(prefix="coco-")
    images_root, annotations = make_coco(Path(scratch.name), args.images)

# ---- data -------------------------------------------------------------------------------
# torchvision's detection reference drops images without annotations for training.
coco = en.CocoDetection(images_root, annotations, keep_empty=False)
size = (args.size, args.size)
ssd = [en.RandomZoomOut(fill=(124, 116, 104), side_range=(1.0, 4.0)),  # the mean colour
       en.RandomIoUCrop(), en.RandomHorizontalFlip(), en.Resize(size),
       en.SanitizeBoundingBoxes()]
# Mean 0, std 1: x / 255 in [0, 1], what torchvision's detection models take.
out = en.Output(normalize=((0.0, 0.0, 0.0), (1.0, 1.0, 1.0)), layout="NCHW")
ring = en.EchoRing(coco, args.batch_size, augment=ssd,
                   echo=en.Echo(args.echo, placement="after_augment"), output=out,
                   workers=args.workers, seed=0)

# ---- the model --------------------------------------------------------------------------
torch.manual_seed(0)
model = ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None,
                                      num_classes=len(coco.categories))  # with the background
model.train()
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=4e-5)
print(f"{len(coco)} images, {len(coco.categories) - 1} categories, {size[0]}x{size[1]}, "
      f"echo {args.echo} (after_augment), {args.workers} workers")

# ---- the loop ---------------------------------------------------------------------------
step, t0 = 0, time.perf_counter()
with ring:
    while step < args.steps:
        for batch in ring:
            images = list(torch.from_dlpack(batch.images))   # (B, 3, H, W) float32, no copy
            targets = batch.objects.to_torchvision()
            losses = model(images, targets)        # {"bbox_regression", "classification"}
            loss = sum(losses.values())
            if not math.isfinite(loss.item()):
                raise SystemExit(f"step {step}: the loss is {loss.item()}")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            parts = ", ".join(f"{k} {v.item():.3f}" for k, v in losses.items())
            print(f"step {step}: loss {loss.item():.4f} ({parts}), "
                  f"{int(batch.objects.valid.sum())} boxes")
            if step >= args.steps:
                break
    s = ring.stats()

print(f"done: {step} steps in {time.perf_counter() - t0:.1f} s, {s['fresh']} fresh images, "
      f"{s['delivered']} delivered (effective echo {s['effective_echo']:.2f}), "
      f"failures {s['failures'] or 0}")
if scratch is not None:
    scratch.cleanup()

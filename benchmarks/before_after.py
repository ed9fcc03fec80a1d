"""The same jobs on one folder, for comparing two trees of echo_native: run it once per
tree (PYTHONPATH=<tree>), alternating, and compare the JSON lines it prints.

    python benchmarks/before_after.py FOLDER LABEL

Jobs (images/s after the first batch and images per CPU second, two epochs, 2 workers,
RandomResizedCrop 224):
Loader, EchoRing(echo=1), echo 2 before augmentation, echo 2 after augmentation; then
detection on the folder's images as a COCO folder (2-4 boxes each, written once beside
it, FOLDER.coco): SSD geometry at 300 px, echo 2 before and after augmentation; the
same with each object's mask (a polygon in its box) and its 5 keypoints.
docs/results.md ("The house, round two/three: before and after") used it."""
import json, os, resource, sys, time
import numpy as np
import echo_native as en

folder, which = sys.argv[1], sys.argv[2]
out = {"tree": which}

def cpu_seconds():
    """CPU time of this process and of its children that ended (the workers, once the
    pipeline is closed): work done, which a shared machine's load does not inflate."""
    own, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                 resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def rate(make, epochs=2):
    """Images/s after the first batch (wall time), and images per CPU second of the
    whole run (workers included)."""
    c0 = cpu_seconds()
    with make() as it:
        n, t0, total = 0, None, 0
        for e in range(epochs + 1):
            if hasattr(it, "set_epoch"):
                it.set_epoch(e)
            for b in it:
                total += len(b)
                if t0 is None:           # the first batch starts the clock (workers up)
                    t0 = time.perf_counter()
                    continue
                n += len(b)
        wall = n / (time.perf_counter() - t0)
    return [round(wall, 1), round(total / (cpu_seconds() - c0), 1)]


out["loader"] = rate(lambda: en.Loader(folder, 64, image_size=224, workers=2, seed=0))
out["echo1"] = rate(lambda: en.EchoRing(folder, 64, image_size=224, workers=2, echo=1, seed=0))
out["before_e2"] = rate(lambda: en.EchoRing(folder, 64, image_size=224, workers=2, echo=2,
                                            placement="before_augment", seed=0))
out["after_e2"] = rate(lambda: en.EchoRing(folder, 64, image_size=224, workers=2, echo=2,
                                           placement="after_augment", seed=0))

def coco_folder(folder):
    """FOLDER's JPEGs as a COCO folder with 2-4 random boxes each, each with a polygon
    and 5 keypoints inside it (made once)."""
    root = folder.rstrip("/") + ".coco2"
    ann = os.path.join(root, "instances.json")
    if os.path.exists(ann):
        return root, ann
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(0)
    images, anns = [], []
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs
                   if f.lower().endswith((".jpg", ".jpeg")))
    for i, path in enumerate(files):
        data = open(path, "rb").read()
        name = f"{i:06d}.jpg"
        with open(os.path.join(root, name), "wb") as f:
            f.write(data)
        h, w = en.image_size(data)
        images.append({"id": i + 1, "file_name": name, "height": h, "width": w})
        for _ in range(int(rng.integers(2, 5))):
            bw, bh = (float(v) for v in rng.uniform(0.06, 0.6, 2) * (w, h))
            x, y = float(rng.uniform(0, w - bw)), float(rng.uniform(0, h - bh))
            anns.append({"id": len(anns) + 1, "image_id": i + 1, "category_id": 1,
                         "bbox": [x, y, bw, bh], "iscrowd": 0})
    # Masks and keypoints from a second stream: the boxes are those of earlier runs.
    extra = np.random.default_rng(1)
    for a in anns:
        x, y, bw, bh = a["bbox"]
        angles = np.sort(extra.uniform(0, 2 * np.pi, 8))
        radii = extra.uniform(0.3, 0.5, 8)
        a["segmentation"] = [np.column_stack([x + bw * (0.5 + radii * np.cos(angles)),
                                              y + bh * (0.5 + radii * np.sin(angles))])
                             .ravel().round(2).tolist()]
        points = extra.uniform(0, 1, (5, 2)) * (bw, bh) + (x, y)
        a["keypoints"] = np.column_stack([points.round(2), np.full(5, 2)]).ravel().tolist()
        a["num_keypoints"] = 5
    with open(ann + ".tmp", "w") as f:
        json.dump({"images": images, "annotations": anns,
                   "categories": [{"id": 1, "name": "thing", "keypoints": POINTS}]}, f)
    os.replace(ann + ".tmp", ann)
    return root, ann


POINTS = ["nose", "left_eye", "right_eye", "left_ear", "right_ear"]
coco = en.CocoDetection(*coco_folder(folder))
ssd = [en.RandomZoomOut(fill=(124, 116, 104), side_range=(1.0, 4.0)), en.RandomIoUCrop(),
       en.RandomHorizontalFlip(), en.Resize((300, 300)), en.SanitizeBoundingBoxes()]
for placement in ("before_augment", "after_augment"):
    out[f"detect_{placement.split('_')[0]}_e2"] = rate(lambda: en.EchoRing(
        coco, 32, augment=ssd, workers=2, echo=en.Echo(2, placement=placement), seed=0))
# Each object's mask (rasterised in the workers) and keypoints, through the same jobs.
coco = en.CocoDetection(*coco_folder(folder), keypoints=True, masks=True)
for placement in ("before_augment", "after_augment"):
    out[f"fields_{placement.split('_')[0]}_e2"] = rate(lambda: en.EchoRing(
        coco, 32, augment=ssd, workers=2, echo=en.Echo(2, placement=placement), seed=0))
print(json.dumps(out))

"""Detection: a source's boxes follow every crop, flip and echo to ``batch.objects``.

The images are drawn so that the boxes can be checked against the pixels: each
object is a solid rectangle whose colour is its label's, on a grey background,
so wherever ``batch.objects`` puts a box, the image must show that colour at
its centre.  That holds only if the boxes went through the very crop, flip and
resize the pixels did, for fresh examples and every echo placement alike.
"""
from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
from PIL import Image

import echo_native as en
from echo_native.boxes import map_boxes, pack, sanitize

COLOURS = np.array([[128, 128, 128], [230, 30, 30], [30, 200, 40], [40, 60, 230],
                    [240, 220, 30], [200, 40, 220]], np.uint8)  # label k: COLOURS[k]; 0 is the ground


class Rectangles:
    """A detection source as a user writes one: ``read(i)`` and ``targets(i)``."""

    def __init__(self, n=24, seed=0, image_hw=True):
        rng = np.random.default_rng(seed)
        self.blobs, self.targets_ = [], []
        for _ in range(n):
            h, w = (int(v) for v in rng.integers(96, 200, 2))
            img = np.empty((h, w, 3), np.uint8)
            img[...] = COLOURS[0]
            boxes, labels = [], []
            # One object per cell of a 2x2 grid, so that none overlaps another.
            for cy in range(2):
                for cx in range(2):
                    if rng.random() < 0.3:
                        continue
                    ch, cw = h // 2, w // 2
                    bh, bw = (int(v) for v in rng.integers(12, [ch - 2, cw - 2]))
                    y0 = cy * ch + int(rng.integers(0, ch - bh))
                    x0 = cx * cw + int(rng.integers(0, cw - bw))
                    label = int(rng.integers(1, len(COLOURS)))
                    img[y0:y0 + bh, x0:x0 + bw] = COLOURS[label]
                    boxes.append([x0, y0, x0 + bw, y0 + bh])
                    labels.append(label)
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, "JPEG", quality=95)
            self.blobs.append(buf.getvalue())
            t = {"boxes": np.asarray(boxes, np.float32).reshape(-1, 4),
                 "labels": np.asarray(labels, np.int64)}
            if image_hw:
                t["image_hw"] = (h, w)
            self.targets_.append(t)
        self.labels = np.zeros(n, np.int64)

    def __len__(self):
        return len(self.blobs)

    def read(self, i):
        return self.blobs[i]

    def targets(self, i):
        t = self.targets_[i]
        return {k: v for k, v in t.items() if k != "image_hw"}


SSD = [en.RandomZoomOut(fill=tuple(int(v) for v in COLOURS[0]), side_range=(1.0, 2.0), p=0.5),
       en.RandomIoUCrop(), en.RandomHorizontalFlip(), en.Resize((96, 96)),
       en.SanitizeBoundingBoxes(min_size=2.0)]


def _check_pixels(batch, min_side=6.0):
    """Every kept box of at least ``min_side`` pixels shows its label's colour at its
    centre (returns how many were checked)."""
    objects, images = batch.objects, np.asarray(batch.images)
    checked = 0
    for i in range(len(batch)):
        for box, label in zip(objects.boxes[i][objects.valid[i]],
                              objects.labels[i][objects.valid[i]]):
            x1, y1, x2, y2 = box
            if x2 - x1 < min_side or y2 - y1 < min_side:
                continue
            px = images[i, int((y1 + y2) / 2), int((x1 + x2) / 2)].astype(int)
            assert np.abs(px - COLOURS[label]).max() <= 48, \
                (i, box, label, px, batch.crop_boxes[i], batch.flips[i])
            checked += 1
    return checked


def _run(source, augment, echo, batches=6, **kw):
    with en.EchoRing(source, batch_size=8, augment=augment, echo=echo, workers=1,
                     seed=3, **kw) as ring:
        out = []
        for b in ring:
            out.append(b.copy())
            if len(out) == batches:
                break
        return out, ring.stats()


@pytest.mark.parametrize("echo", [
    1, en.Echo(2, placement="after_augment", flip=True), en.Echo(2, placement="batch")],
    ids=["fresh", "after_augment+flip", "batch"])
def test_boxes_follow_the_pixels_through_zoom_out_iou_crop_and_flip(echo):
    """After RandomZoomOut, RandomIoUCrop, flip and resize, each kept box frames its
    object in the delivered image, for fresh batches and repeats alike."""
    batches, _ = _run(Rectangles(), SSD, echo)
    assert sum(_check_pixels(b) for b in batches) >= 20
    assert all(b.objects.boxes.dtype == np.float32 and b.objects.labels.dtype == np.int64
               for b in batches)


@pytest.mark.parametrize("zoom_out", [False, True], ids=["iou_crop", "zoom_out+iou_crop"])
def test_every_emission_before_augmentation_draws_its_own_crop_and_its_boxes_follow(zoom_out):
    """Echo before augmentation: the repeats of a sample carry different crops (with a
    zoom-out, the image placed on fill), and the boxes of each repeat frame the objects
    of that repeat's pixels."""
    augment = SSD if zoom_out else [en.RandomIoUCrop(), en.RandomHorizontalFlip(),
                                    en.Resize((96, 96)), en.SanitizeBoundingBoxes(min_size=2.0)]
    batches, _ = _run(Rectangles(), augment, en.Echo(2, placement="before_augment"),
                      batches=8)
    if zoom_out:  # some emission reached past its image: the ground colour at a corner
        # (at least two output rows of fill above the image)
        zoomed = [(b, i) for b in batches for i in range(len(b))
                  if -b.crop_boxes[i][0] * 96 / b.crop_boxes[i][2] >= 2]
        assert zoomed
        for b, i in zoomed:
            assert np.abs(np.asarray(b.images)[i, 0, 0].astype(int) - COLOURS[0]).max() <= 8
    assert sum(_check_pixels(b) for b in batches) >= 20
    windows = {}
    for b in batches:
        for sid, e, box in zip(b.sample_ids, b.echo_index, b.crop_boxes):
            windows.setdefault(int(sid), {})[int(e)] = tuple(box)
    repeated = [w for w in windows.values() if len(w) > 1]
    assert repeated and any(len(set(w.values())) > 1 for w in repeated)


def test_objects_equal_the_source_boxes_mapped_by_hand():
    """batch.objects are the source's boxes shifted by the crop, clamped, flipped and
    scaled, written out box by box in float64 here (no IoU crop: nothing dropped)."""
    src = Rectangles(16, seed=5)
    augment = [en.RandomZoomOut(fill=0, p=1.0), en.RandomHorizontalFlip(), en.Resize((64, 80))]
    batches, _ = _run(src, augment, 1, batches=2)
    for b in batches:
        for i, sid in enumerate(b.sample_ids):
            t = src.targets_[int(sid)]
            top, left, h, w = (float(v) for v in b.crop_boxes[i])
            want = []
            for x1, y1, x2, y2 in t["boxes"].astype(np.float64):
                x1, x2 = np.clip([x1 - left, x2 - left], 0, w)
                y1, y2 = np.clip([y1 - top, y2 - top], 0, h)
                if b.flips[i]:
                    x1, x2 = w - x2, w - x1
                want.append([x1 * 80 / w, y1 * 64 / h, x2 * 80 / w, y2 * 64 / h])
            n = int(b.objects.counts[i])
            assert n == len(want)
            np.testing.assert_allclose(b.objects.boxes[i, :n], np.reshape(want, (-1, 4)),
                                       atol=1e-3)
            assert b.objects.labels[i, :n].tolist() == t["labels"].tolist()


def test_the_same_seed_gives_the_same_objects():
    """Objects are a pure function of (seed, epoch, sample, echo index)."""
    one, _ = _run(Rectangles(), SSD, en.Echo(2, placement="after_augment", flip=True), 4)
    two, _ = _run(Rectangles(), SSD, en.Echo(2, placement="after_augment", flip=True), 4)
    for a, b in zip(one, two):
        assert np.array_equal(a.sample_ids, b.sample_ids)
        assert np.array_equal(a.objects.boxes, b.objects.boxes)
        assert np.array_equal(a.objects.valid, b.objects.valid)


def test_a_sample_with_more_objects_than_max_objects_fails_naming_the_setting():
    """More objects than the ring's slots: that sample fails (counted, replaced), with
    a message naming max_objects; the others come through."""
    src = Rectangles(12)
    src.targets_[0] = {"boxes": np.tile([[1, 1, 9, 9]], (5, 1)).astype(np.float32),
                       "labels": np.ones(5, np.int64)}
    with pytest.warns(en.SampleFailureWarning, match="max_objects=4"):
        batches, stats = _run(src, SSD, 1, batches=2, max_objects=4, shuffle=False)
    assert sum(stats["failures"].values()) >= 1
    assert 0 not in np.concatenate([b.sample_ids for b in batches])


def test_a_loader_delivers_objects_too():
    """The Loader alone (no echo stage) maps the boxes of its slots the same way."""
    src = Rectangles()
    with en.Loader(src, 8, augment=SSD, workers=1, seed=3) as loader:
        batches = [b.copy() for _, b in zip(range(3), loader)]
    assert sum(_check_pixels(b) for b in batches) >= 10
    assert all(b.objects.valid.shape == b.objects.labels.shape for b in batches)


def test_an_image_whose_size_differs_from_its_annotation_fails():
    """Targets that say another image size than the decoded one: the sample fails with
    both sizes in the message, never a box in the wrong place."""
    src = Rectangles(12)
    real = src.targets

    def targets(i):
        t = dict(real(i))
        t["image_hw"] = (7, 9) if i == 2 else src.targets_[i]["image_hw"]
        return t
    src.targets = targets
    with pytest.warns(en.SampleFailureWarning, match="7x9"):
        _run(src, SSD, 1, batches=2, shuffle=False)


@pytest.mark.parametrize("augment, match", [
    ([en.RandomHorizontalFlip(), en.RandomIoUCrop(), en.Resize((32, 32))], "reference order"),
    ([en.RandomIoUCrop(), en.RandomHorizontalFlip()], "needs a Resize"),
    ([en.RandomIoUCrop(), en.RandomIoUCrop(), en.Resize((32, 32))], "at most once"),
])
def test_geometry_out_of_order_is_refused_naming_the_order(augment, match):
    with pytest.raises(ValueError, match=match):
        en.EchoRing(Rectangles(4), batch_size=2, augment=augment, echo=1)


def test_settings_that_cannot_keep_boxes_right_are_refused():
    """An IoU crop without boxes, Mix (blended images) and a shorter-side Resize are refused at construction, each naming what to do."""
    plain = en.Samples(Rectangles(4).blobs)
    with pytest.raises(ValueError, match="RandomIoUCrop crops around the boxes"):
        en.EchoRing(plain, batch_size=2, augment=[en.RandomIoUCrop(), en.Resize((32, 32))])
    with pytest.raises(ValueError, match="Mix blends whole images"):
        en.EchoRing(Rectangles(4), batch_size=2, augment=SSD, output=en.Output(normalize=True),
                    mix=en.Mix(mixup_alpha=0.2, num_classes=6))
    with pytest.raises(ValueError, match="must be \\(height, width\\)"):
        en.Resize(300)


def test_classification_crops_carry_boxes_too():
    """A RandomResizedCrop (with flip) moves boxes as well: a source with targets under
    the classification crop still gets batch.objects that frame its objects."""
    augment = [en.RandomResizedCrop(96, scale=(0.5, 1.0)), en.SanitizeBoundingBoxes(2.0)]
    batches, _ = _run(Rectangles(), augment, 1, batches=3)
    assert sum(_check_pixels(b) for b in batches) >= 10


class EdgeObjects:
    """Images whose five objects all touch the image's edges: the whole frame (label 1),
    and a bar along the top, bottom, left and right side (labels 2-5)."""

    def __init__(self, n=24, seed=0):
        rng = np.random.default_rng(seed)
        self.blobs, self.targets_ = [], []
        for _ in range(n):
            h, w = (int(v) for v in rng.integers(60, 240, 2))
            bh, bw = (int(v) for v in rng.integers(8, [h // 2, w // 2]))
            buf = io.BytesIO()
            Image.fromarray(np.full((h, w, 3), 128, np.uint8)).save(buf, "JPEG")
            self.blobs.append(buf.getvalue())
            self.targets_.append({
                "boxes": np.float32([[0, 0, w, h], [0, 0, w, bh], [0, h - bh, w, h],
                                     [0, 0, bw, h], [w - bw, 0, w, h]]),
                "labels": np.arange(1, 6, dtype=np.int64), "image_hw": (h, w)})
        self.labels = np.zeros(n, np.int64)

    def __len__(self):
        return len(self.blobs)

    def read(self, i):
        return self.blobs[i]

    def targets(self, i):
        return self.targets_[i]


def _visible_without_a_box(batch, source, size, margin=1e-3):
    """(visible objects, those of them without a box in ``batch.objects``): an object is
    visible when its part inside the row's crop window, scaled to the output ``size`` in
    float64, is more than ``margin`` past SanitizeBoundingBoxes()' 1 px and 1 px²."""
    out_h, out_w = size
    visible = missing = 0
    for i, sid in enumerate(batch.sample_ids):
        top, left, wh, ww = (float(v) for v in batch.crop_boxes[i])
        t = source.targets_[int(sid)]
        kept = set(batch.objects.labels[i][batch.objects.valid[i]].tolist())
        for (x1, y1, x2, y2), label in zip(t["boxes"].astype(np.float64), t["labels"]):
            sx = (min(x2, left + ww) - max(x1, left)) * out_w / ww
            sy = (min(y2, top + wh) - max(y1, top)) * out_h / wh
            if min(sx, sy) > 1 + margin and sx * sy > 1 + margin:
                visible += 1
                missing += int(label) not in kept
    return visible, missing


@pytest.mark.parametrize("echo", [1, en.Echo(2, placement="after_augment", flip=True)],
                         ids=["fresh", "after_augment+flip"])
def test_no_visible_object_at_the_edge_loses_its_box_to_rounding(echo):
    """Crops that touch every edge of the image (objects along each side, and one as large
    as the image): every object visible in the output keeps its box.  torchvision's own
    float32 resize puts such a box at e.g. 75 * float32(160 / 75) = 160.0000153 > 160,
    and its SanitizeBoundingBoxes then drops an object that is fully visible; the boxes
    here never leave the canvas (docs/detection-semantics.md, deliberate differences)."""
    src = EdgeObjects(96)
    augment = [en.RandomResizedCrop(160, scale=(0.02, 1.0)), en.SanitizeBoundingBoxes()]
    batches, _ = _run(src, augment, echo, batches=24)
    counts = np.array([_visible_without_a_box(b, src, (160, 160)) for b in batches])
    visible, missing = counts.sum(axis=0)
    assert visible >= 300
    assert missing == 0, f"{missing} of {visible} visible objects without a box"
    for b in batches:
        kept = b.objects.boxes[b.objects.valid]
        assert kept.min() >= 0 and kept.max() <= 160


@pytest.mark.parametrize("size", [(160, 160), (300, 300), (17, 9), (96, 128)])
def test_a_box_reaching_the_windows_edges_ends_on_the_canvas_edges(size):
    """A box covering its whole window, for every window side from 1 to 400 px, flipped or
    not: after the resize it is the output canvas within a float32 rounding, never past
    its edges, and SanitizeBoundingBoxes keeps it."""
    sides = np.arange(1, 401)
    windows = np.stack([sides * 0 + 3, sides * 0 + 5, sides, sides[::-1]], axis=1)
    boxes = np.float32([[5, 3, 5 + w, 3 + h] for _, _, h, w in windows])[:, None]
    out_h, out_w = size
    for flip in (False, True):
        out = map_boxes(boxes, windows, np.full(len(sides), flip), size)
        canvas = np.float32([0, 0, out_w, out_h])
        np.testing.assert_allclose(out[:, 0], np.broadcast_to(canvas, (len(sides), 4)),
                                   rtol=0, atol=1e-4)
        past = (out[:, 0, 2] > out_w) | (out[:, 0, 3] > out_h)
        assert not past.any(), (windows[past][:3], out[past, 0][:3])
        assert sanitize(out, np.ones((len(sides), 1), bool), size).all()


def test_to_torchvision_gives_each_image_its_boxes_and_labels():
    """to_torchvision(): one dict per image of float32 (n, 4) boxes and int64 labels, the
    valid objects only, sharing the batch's memory."""
    torch = pytest.importorskip("torch")
    batches, _ = _run(Rectangles(), SSD, 1, batches=1)
    b = batches[0]
    targets = b.to_torchvision()
    assert len(targets) == len(b)
    for i, t in enumerate(targets):
        n = int(b.objects.counts[i])
        assert t["boxes"].dtype == torch.float32 and t["boxes"].shape == (n, 4)
        assert t["labels"].dtype == torch.int64
        assert np.array_equal(t["boxes"].numpy(), b.objects.boxes[i, :n])


def test_pack_moves_kept_objects_to_the_front_in_order():
    keep = np.array([[False, True, True], [True, False, False], [False, False, False]])
    valid, vals = pack(keep, np.arange(9).reshape(3, 3))
    assert valid.tolist() == [[True, True], [True, False], [False, False]]
    assert vals.tolist() == [[1, 2], [3, 0], [0, 0]]
    with pytest.raises(ValueError, match="more than the 1"):
        pack(keep, np.zeros((3, 3)), width=1)


def test_sanitize_drops_small_and_outside_boxes():
    boxes = np.array([[[0, 0, 10, 10], [5, 5, 5.5, 20], [0, 0, 40, 10], [-1, 0, 3, 3]]],
                     np.float32)
    keep = sanitize(boxes, np.ones((1, 4), bool), (32, 32))
    assert keep.tolist() == [[True, False, False, False]]
    out = map_boxes(boxes[:, :1], np.array([[2, 3, 20, 20]]), np.array([True]), (40, 40))
    np.testing.assert_allclose(out[0, 0], [2 * 13, 0, 2 * 20, 2 * 8])


def test_a_coco_folder_trains_through_the_ring_with_echo(tmp_path):
    """A COCO-format folder (instances JSON beside the images) through EchoRing with
    echo: CocoDetection's boxes reach batch.objects framing their objects, under
    contiguous labels that map back to the categories."""
    import json

    src = Rectangles(16, seed=9)
    images, annotations = [], []
    for i, (blob, t) in enumerate(zip(src.blobs, src.targets_)):
        (tmp_path / f"{i:03d}.jpg").write_bytes(blob)
        h, w = t["image_hw"]
        images.append({"id": 100 + i, "file_name": f"{i:03d}.jpg", "height": h, "width": w})
        for box, label in zip(t["boxes"].tolist(), t["labels"].tolist()):
            x1, y1, x2, y2 = box
            annotations.append({"id": len(annotations) + 1, "image_id": 100 + i,
                                "category_id": 10 * label, "bbox": [x1, y1, x2 - x1, y2 - y1],
                                "area": (x2 - x1) * (y2 - y1), "iscrowd": 0})
    categories = [{"id": 10 * k, "name": f"c{k}"} for k in range(1, len(COLOURS))]
    (tmp_path / "instances.json").write_text(json.dumps(
        {"images": images, "annotations": annotations, "categories": categories}))
    coco = en.CocoDetection(tmp_path, tmp_path / "instances.json")
    # Contiguous labels in category order are this test's colour indexes again.
    assert [coco.label_to_category[k] for k in range(1, len(COLOURS))] == \
        [10 * k for k in range(1, len(COLOURS))]
    batches, stats = _run(coco, SSD, en.Echo(2, placement="after_augment"), batches=4)
    assert sum(_check_pixels(b) for b in batches) >= 10
    assert not stats["failures"]

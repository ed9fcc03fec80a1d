"""Keypoints: a pose's points follow every crop, zoom-out, flip, resize and echo.

The images are drawn so that the keypoints can be checked against the pixels:
each object is a grey body with a coloured dot at each of its keypoints, one
colour per keypoint name, so wherever ``batch.objects.keypoints`` puts point j,
the image must show colour j there, or, after a flip, the colour of j's mirror
(a left eye drawn on the left becomes the right eye once mirrored, and the flip
swaps their indices).  That holds only if the points went through the very
geometry the pixels did, for fresh examples and every echo placement alike.
"""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

import echo_native as en
from sources_helpers import Drawn
from echo_native.keypoints import flip_indices, map_keypoints

NAMES = ("nose", "left_eye", "right_eye", "tail")
FLIP = [0, 2, 1, 3]
# keypoint j: DOTS[j]; the ground and the bodies are greys, far from every dot
DOTS = np.array([[230, 30, 30], [30, 200, 40], [40, 60, 230], [240, 220, 30]], np.uint8)
GROUND, BODY = (128, 128, 128), (90, 90, 90)
R = 5  # a dot's half side, in source pixels


def _pose_image(rng, h, w):
    """An image of one or two bodies with their dots: (jpeg, boxes, keypoints)."""
    img = np.empty((h, w, 3), np.uint8)
    img[...] = GROUND
    boxes, points = [], []
    for cx in range(int(rng.integers(1, 3))):
        cw = w // 2
        bw, bh = int(rng.integers(40, cw - 4)), int(rng.integers(40, h - 8))
        x0, y0 = cx * cw + int(rng.integers(0, cw - bw)), int(rng.integers(0, h - bh))
        img[y0:y0 + bh, x0:x0 + bw] = BODY
        pts = np.zeros((len(NAMES), 3), np.float32)
        for j in range(len(NAMES)):
            if j == 3 and rng.random() < 0.3:
                continue  # not labelled: (0, 0, 0)
            x = int(rng.integers(x0 + R, x0 + bw - R))
            y = int(rng.integers(y0 + R, y0 + bh - R))
            img[y - R:y + R + 1, x - R:x + R + 1] = DOTS[j]
            pts[j] = (x, y, 2)
        # Dots of one body may overlap: the later one shows, so keep only those on top.
        for j in range(len(NAMES)):
            if pts[j, 2] and not (img[int(pts[j, 1]), int(pts[j, 0])] == DOTS[j]).all():
                pts[j] = 0
        boxes.append([x0, y0, x0 + bw, y0 + bh])
        points.append(pts)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=95)
    return buf.getvalue(), np.float32(boxes), np.stack(points)


class Poses(Drawn):
    """A pose source as a user writes one: ``read``, ``targets`` with keypoints, and the
    ``keypoints`` hook naming them."""

    keypoints = en.Keypoints(NAMES)

    def __init__(self, n=16, seed=0):
        rng = np.random.default_rng(seed)
        super().__init__(_pose_image(rng, *(int(v) for v in rng.integers(110, 190, 2)))
                         for _ in range(n))

    def targets(self, i):
        _, boxes, points = self.items[i]
        return {"boxes": boxes, "labels": np.ones(len(boxes), np.int64), "keypoints": points}


def _check_points(batch):
    """Every visible keypoint shows its colour (its mirror's after a flip) in the
    delivered image; returns how many were checked."""
    objects, images = batch.objects, np.asarray(batch.images)
    h, w = images.shape[1:3]
    checked = 0
    for i in range(len(batch)):
        for pts in objects.keypoints[i][objects.valid[i]]:
            for j, (x, y, v) in enumerate(pts):
                if v == 0:
                    assert x == 0 and y == 0
                    continue
                assert 0 <= x <= w - 1 and 0 <= y <= h - 1
                want = DOTS[FLIP[j]] if batch.flips[i] else DOTS[j]
                px = images[i, int(round(y)), int(round(x))].astype(int)
                assert np.abs(px - want).max() <= 60, (i, j, (x, y), px, want,
                                                       batch.crop_boxes[i], batch.flips[i])
                checked += 1
    return checked


SSD = [en.RandomZoomOut(fill=GROUND, side_range=(1.0, 1.6), p=0.5), en.RandomIoUCrop(),
       en.RandomHorizontalFlip(), en.Resize((160, 160))]


@pytest.mark.parametrize("echo", [
    1, en.Echo(2, placement="before_augment"),
    en.Echo(2, placement="after_augment", flip=True), en.Echo(2, placement="batch")],
    ids=["fresh", "before_augment", "after_augment+flip", "batch"])
def test_keypoints_follow_the_pixels_through_every_crop_flip_and_echo(echo):
    """After a zoom-out, an IoU crop, a flip and the resize, each visible keypoint sits on
    its dot in the delivered image, for fresh batches and every echo placement; a flip
    swaps left and right."""
    checked, flipped, invisible = 0, 0, 0
    with en.EchoRing(Poses(), batch_size=4, augment=SSD, echo=echo, workers=1,
                     seed=5) as ring:
        for batch in ring:
            pts = batch.objects.keypoints
            assert pts.dtype == np.float32 and pts.shape[-2:] == (len(NAMES), 3)
            assert pts.shape[:2] == batch.objects.boxes.shape[:2]
            checked += _check_points(batch)
            flipped += int(np.asarray(batch.flips).sum())
            invisible += int((pts[batch.objects.valid][..., 2] == 0).sum())
    assert checked >= 40 and flipped > 0 and invisible > 0


def test_to_torchvision_carries_the_keypoints_of_each_image():
    """``to_torchvision()`` adds the kept objects' keypoints, (n, K, 3), as
    keypointrcnn_resnet50_fpn takes them."""
    torch = pytest.importorskip("torch")
    with en.EchoRing(Poses(4), batch_size=4, augment=SSD[2:], echo=1, workers=1) as ring:
        batch = next(iter(ring))
        rows = batch.to_torchvision()
        for i, row in enumerate(rows):
            n = int(batch.objects.valid[i].sum())
            assert row["keypoints"].shape == (n, len(NAMES), 3)
            assert torch.equal(row["keypoints"],
                               torch.from_numpy(batch.objects.keypoints[i, :n].copy()))


def test_map_keypoints_crops_flips_resizes_and_hides_what_leaves_the_output():
    """The arithmetic of torchvision v2's KeyPoints: minus (left, top), x = w - 1 - x in a
    flipped window with the mirror's index, times the output over the window; a point
    outside [0, W - 1] x [0, H - 1], or unlabelled, is (0, 0, 0)."""
    pts = np.float32([[[[10, 20, 2], [30, 40, 1], [0, 0, 0], [5, 90, 2]]]])
    window = np.float32([[10, 4, 50, 40]])  # top, left, height, width
    out = map_keypoints(pts, window, [False], (100, 80))
    np.testing.assert_allclose(out[0, 0, 0], [(10 - 4) * 2, (20 - 10) * 2, 2])
    np.testing.assert_allclose(out[0, 0, 1], [(30 - 4) * 2, (40 - 10) * 2, 1])
    assert (out[0, 0, 2:] == 0).all()   # unlabelled; and past the window's bottom
    flipped = map_keypoints(pts, window, [True], (100, 80), flip=FLIP)
    # point 1 takes point 2's place (unlabelled) and point 2 point 1's, mirrored
    assert (flipped[0, 0, 1] == 0).all()
    np.testing.assert_allclose(flipped[0, 0, 2], [(39 - (30 - 4)) * 2, 60, 1])
    np.testing.assert_allclose(flipped[0, 0, 0], [(39 - (10 - 4)) * 2, 20, 2])


def test_flip_pairs_come_from_the_names():
    coco = ["nose", "left_eye", "right_eye", "left_ear", "right_ear", "left_shoulder",
            "right_shoulder", "left_elbow", "right_elbow", "left_wrist", "right_wrist",
            "left_hip", "right_hip", "left_knee", "right_knee", "left_ankle", "right_ankle"]
    assert flip_indices(coco) == [0, 2, 1, 4, 3, 6, 5, 8, 7, 10, 9, 12, 11, 14, 13, 16, 15]
    assert flip_indices(["leftHand", "rightHand", "L_foot", "R_foot", "head"]) == [1, 0, 3, 2, 4]
    with pytest.raises(ValueError, match="left_eye.*right_eye"):
        en.Keypoints(["nose", "left_eye"])
    with pytest.raises(ValueError, match="pair"):
        en.Keypoints(["a", "b"], flip=[1, 1])
    assert en.Keypoints(["a", "b"], flip=[1, 0]).flip.tolist() == [1, 0]


def _coco_pose(tmp_path, annotations_keypoints, names=NAMES):
    root = tmp_path / "images"
    root.mkdir()
    source = Poses(2)
    images, anns = [], []
    for k, (blob, boxes, _) in enumerate(source.items):
        (root / f"{k}.jpg").write_bytes(blob)
        h, w = Image.open(io.BytesIO(blob)).size[::-1]
        images.append({"id": k + 1, "file_name": f"{k}.jpg", "height": h, "width": w})
        for box, kp in zip(boxes, annotations_keypoints(k, len(boxes))):
            x0, y0, x1, y1 = (float(v) for v in box)
            ann = {"id": len(anns) + 1, "image_id": k + 1, "category_id": 1,
                   "bbox": [x0, y0, x1 - x0, y1 - y0], "iscrowd": 0}
            if kp is not None:
                ann["keypoints"] = kp
            anns.append(ann)
    path = tmp_path / "person_keypoints.json"
    path.write_text(json.dumps({"images": images, "annotations": anns, "categories": [
        {"id": 1, "name": "person", "keypoints": list(names), "skeleton": [[1, 2]]}]}))
    return root, path, source


def test_coco_keypoints_are_read_with_their_flip_pairs(tmp_path):
    """``CocoDetection(..., keypoints=True)`` reads each annotation's keypoints (none
    labelled where an annotation has none), pairs them by name, and batches carry them."""
    def kps(k, n):
        return [[float(v) for v in Poses(2).items[k][2][j].ravel()] if j else None
                for j in range(n)]
    root, ann, source = _coco_pose(tmp_path, kps)
    coco = en.CocoDetection(root, ann, keypoints=True)
    assert coco.keypoints.names == NAMES and coco.keypoints.flip.tolist() == FLIP
    for i in range(len(coco)):
        t = coco.targets(i)
        want = source.items[i][2].copy()
        want[0] = 0  # its first annotation has no keypoints
        assert t.keypoints.shape == (len(t), len(NAMES), 3)
        np.testing.assert_array_equal(t.keypoints, want)
    assert en.CocoDetection(root, ann).targets(0).keypoints is None
    with en.EchoRing(coco, batch_size=2, augment=SSD[2:], echo=1, workers=1) as ring:
        batch = next(iter(ring))
        assert batch.objects.keypoints.shape[-2:] == (len(NAMES), 3)
        assert _check_points(batch) >= 1


@pytest.mark.parametrize("bad", [[1.0, 2.0, 2], [1.0, 2.0, 3] * 4, ["x", 2.0, 2] * 4,
                                 ["1.5", 2.0, 2] * 4, [True, 2.0, 2] * 4,
                                 [float("nan"), 2.0, 2] * 4, "12"],
                         ids=["short", "visibility", "string", "numeric string", "bool", "nan",
                              "not a list"])
def test_bad_coco_keypoints_are_named(tmp_path, bad):
    root, ann, _ = _coco_pose(tmp_path, lambda k, n: [bad] * n)
    with pytest.raises(ValueError, match="annotation id 1: keypoints must be 12 finite "
                                         "numbers, x, y and visibility 0, 1 or 2"):
        en.CocoDetection(root, ann, keypoints=True)


def test_coco_keypoints_need_the_names(tmp_path):
    root, ann, _ = _coco_pose(tmp_path, lambda k, n: [None] * n)
    doc = json.loads(ann.read_text())
    del doc["categories"][0]["keypoints"]
    ann.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="keypoint names"):
        en.CocoDetection(root, ann, keypoints=True)


def test_targets_check_their_keypoints():
    boxes, labels = np.float32([[0, 0, 4, 4]]), np.int64([1])
    with pytest.raises(ValueError, match=r"keypoints must have shape \(N, K, 3\)"):
        en.Targets(boxes, labels, keypoints=np.zeros((2, 3, 3)))
    with pytest.raises(ValueError, match="object 0: keypoint 1"):
        en.Targets(boxes, labels, keypoints=np.float32([[[1, 1, 2], [np.nan, 1, 2]]]))
    t = en.Targets(boxes, labels, keypoints=[[[1, 2, 2]]])
    assert t.keypoints.dtype == np.float32 and t == en.Targets(boxes, labels,
                                                               keypoints=[[[1, 2, 2]]])
    assert t != en.Targets(boxes, labels)


def test_a_keypoints_hook_that_is_not_a_keypoints_spec_is_refused_by_name():
    class Named(Poses):
        keypoints = list(NAMES)   # names alone say nothing of which point mirrors which

    with pytest.raises(TypeError, match="keypoints must be an echo_native.Keypoints"):
        en.EchoRing(Named(4), batch_size=2, augment=SSD[2:], echo=1, workers=1)


def test_the_echo_buffer_counts_its_records_in_the_memory_check():
    """With keypoints, an entry's record (objects and their points) is counted with its
    pixels in the memory the echo buffer asks for at start."""
    from echo_native.ring import Record

    with en.EchoRing(Poses(4), batch_size=2, augment=SSD[2:], workers=1,
                     echo=en.Echo(2, placement="after_augment"), max_objects=8) as ring:
        (what, nbytes, setting), = ring.loader.memory_extra
        per_entry = 160 * 160 * 3 + Record(max_objects=8, max_keypoints=len(NAMES)).nbytes()
        # 8 objects of 17 points (x, y, visibility as float32) are in it.
        assert per_entry - 160 * 160 * 3 - Record(max_objects=8).nbytes() == 8 * len(NAMES) * 12
        assert nbytes == ring.shuffle_buffer * per_entry and setting == "shuffle_buffer"

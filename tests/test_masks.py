"""Instance masks: COCO polygons and RLE follow every crop, zoom-out, flip, resize and echo.

The images are drawn so that the masks can be checked against the pixels: each
object is a solid shape of its own colour on a grey ground (a pentagon given as a
polygon, or an ellipse given as RLE, list or compressed), in its own column of
the image so that none overlaps another.  Wherever ``batch.objects.masks`` says an
object is, the delivered image must show its colour, and where the image shows
its colour, the mask must say so.  That holds only if each mask went through the
very geometry its image did, for fresh examples and every echo placement alike.
"""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageDraw

import echo_native as en
from sources_helpers import Drawn
from echo_native.targets import as_targets, targets_from_json, targets_to_json
from echo_native.masks import (Segments, as_segments, pack_masks, rasterise, rle_from_string,
                               rle_to_string, unpack_masks)

GROUND = (128, 128, 128)
# object c of an image: COLOURS[c], far from the grey ground and from each other
COLOURS = np.array([[230, 30, 30], [30, 200, 40], [40, 60, 230]], np.uint8)
SSD = [en.RandomZoomOut(fill=GROUND, side_range=(1.0, 1.6), p=0.5), en.RandomIoUCrop(),
       en.RandomHorizontalFlip(), en.Resize((160, 160))]


def rle_of(mask):
    """COCO's RLE counts of a boolean (h, w) mask: column-major runs from a run of 0s."""
    flat = mask.T.ravel().astype(np.int8)
    bounds = np.r_[0, np.flatnonzero(np.diff(flat)) + 1, flat.size]
    counts = np.diff(bounds).tolist()
    return [0] + counts if flat[0] else counts


def _shape_image(rng, h, w):
    """(jpeg, boxes, masks, labels): a pentagon (polygon), an ellipse (list RLE) and an
    ellipse (compressed RLE), one per third of the image, label c + 1 colour c."""
    img = np.empty((h, w, 3), np.uint8)
    img[...] = GROUND
    boxes, masks = [], []
    cw = w // 3
    yy, xx = np.mgrid[:h, :w] + 0.5
    for c in range(3):
        bw, bh = int(rng.integers(30, cw - 6)), int(rng.integers(30, h - 10))
        x0, y0 = c * cw + int(rng.integers(2, cw - bw - 2)), int(rng.integers(2, h - bh - 2))
        if c == 0:
            t = np.sort(rng.uniform(0, 2 * np.pi, 5))
            poly = np.stack([x0 + bw / 2 * (1 + np.cos(t)), y0 + bh / 2 * (1 + np.sin(t))], 1)
            # Drawn 4x over and reduced: each pixel coloured when most of it is inside
            # (Pillow's own fill takes whole-pixel vertices and both edges).
            big = Image.new("L", (4 * w, 4 * h), 0)
            ImageDraw.Draw(big).polygon((4 * poly).ravel().tolist(), fill=1)
            inside = np.asarray(big, np.float32).reshape(h, 4, w, 4).mean(axis=(1, 3)) >= 0.5
            mask = [poly.ravel().tolist()]
        else:
            inside = ((xx - x0 - bw / 2) / (bw / 2)) ** 2 + ((yy - y0 - bh / 2) / (bh / 2)) ** 2 <= 1
            counts = rle_of(inside)
            mask = {"counts": counts if c == 1 else rle_to_string(counts), "size": [h, w]}
        img[inside] = COLOURS[c]
        boxes.append([x0, y0, x0 + bw, y0 + bh])
        masks.append(mask)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=95)
    return buf.getvalue(), np.float32(boxes), masks, np.arange(1, 4, dtype=np.int64)


class Shapes(Drawn):
    """A source as a user writes one: ``read``, ``targets`` with masks, the ``masks`` hook."""

    masks = True

    def __init__(self, n=12, seed=0):
        rng = np.random.default_rng(seed)
        super().__init__(_shape_image(rng, int(rng.integers(110, 190)),
                                      int(rng.integers(150, 230))) for _ in range(n))

    def targets(self, i):
        _, boxes, masks, labels = self.items[i]
        return {"boxes": boxes, "labels": labels, "masks": masks}


def _eroded(m):
    """The pixels of ``m`` whose four neighbours are in it too (away from its edge, where
    the image's resampling blends the object into the ground)."""
    e = m.copy()
    e[1:] &= m[:-1]
    e[:-1] &= m[1:]
    e[:, 1:] &= m[:, :-1]
    e[:, :-1] &= m[:, 1:]
    return e


def _check_masks(batch, min_area=100):
    """Every kept mask of at least ``min_area`` pixels covers its object in the image: >=
    90% of its pixels away from its edge show the object's colour, and >= 90% of the
    pixels inside its box that show the colour fully are in it.  Returns how many."""
    objects, images = batch.objects, np.asarray(batch.images).astype(np.int16)
    masks = np.asarray(objects.masks)
    assert masks.dtype == np.uint8 and masks.shape == objects.boxes.shape[:2] + images.shape[1:3]
    assert set(np.unique(masks)) <= {0, 1}
    assert not masks[~objects.valid].any()  # padding entries are empty
    checked = 0
    for i in range(len(batch)):
        for j in np.flatnonzero(objects.valid[i]):
            m = masks[i, j].astype(bool)
            diff = np.abs(images[i] - COLOURS[objects.labels[i, j] - 1]).max(axis=-1)
            x0, y0, x1, y1 = objects.boxes[i, j]
            if x1 <= x0:
                continue  # dropped by an IoU crop: its box zeroed, its mask kept (torchvision)
            box, near = np.zeros_like(m), np.zeros_like(m)
            box[int(y0):int(np.ceil(y1)), int(x0):int(np.ceil(x1))] = True
            # An RLE pixel sampled nearest reaches half a source pixel past the box (up
            # to 1.5 output pixels where an IoU crop enlarges 3 times); nothing further.
            near[max(int(y0) - 2, 0):int(np.ceil(y1)) + 2, max(int(x0) - 2, 0):int(np.ceil(x1)) + 2] = True
            assert not (m & ~near).any(), "a mask reaches past its object's box"
            if m.sum() < min_area:
                continue  # too small to tell its edge from its inside
            core, solid = _eroded(m), (diff <= 30) & box
            where = (i, j, batch.crop_boxes[i], bool(batch.flips[i]), int(batch.echo_index[i]))
            assert (diff[core] <= 60).mean() >= 0.9, where
            assert m[solid].mean() >= 0.9, where
            checked += 1
    return checked


@pytest.mark.parametrize("echo", [
    1, en.Echo(2, placement="before_augment"),
    en.Echo(2, placement="after_augment", flip=True), en.Echo(2, placement="batch")],
    ids=["fresh", "before_augment", "after_augment+flip", "batch"])
def test_masks_follow_the_pixels_through_every_crop_flip_and_echo(echo):
    """After a zoom-out, an IoU crop, a flip and the resize, each kept mask covers its
    object in the delivered image, for fresh batches and every echo placement, for
    polygons, list RLE and compressed RLE alike."""
    checked, flipped, kinds = 0, 0, set()
    with en.EchoRing(Shapes(16), batch_size=4, augment=SSD, echo=echo, workers=1,
                     seed=5) as ring:
        for batch in ring:
            checked += _check_masks(batch)
            flipped += int(np.asarray(batch.flips).sum())
            kinds |= set(batch.objects.labels[batch.objects.valid].tolist())
    assert checked >= 30 and flipped > 0 and kinds == {1, 2, 3}


def test_masks_follow_a_random_resized_crop_before_augmentation():
    """The classification crop takes masks too: canvases stored, each emission's crop of
    the mask resampled from the canvas's."""
    checked = 0
    with en.EchoRing(Shapes(8), batch_size=4, echo=en.Echo(2, placement="before_augment"),
                     augment=[en.RandomResizedCrop(128, scale=(0.3, 1.0))], workers=1,
                     seed=3) as ring:
        for batch in ring:
            checked += _check_masks(batch)
    assert checked >= 20


def test_the_echo_buffer_counts_each_entrys_masks_in_the_memory_check():
    """An echo buffer entry keeps its objects' bit-packed masks (a bit per pixel of the
    stored image, per object slot): the memory asked for at start counts them."""
    from echo_native.ring import Record

    with en.EchoRing(Shapes(4), batch_size=2, augment=SSD[2:], workers=1,
                     echo=en.Echo(2, placement="after_augment"), max_objects=8) as ring:
        (what, nbytes, setting), = ring.loader.memory_extra
        pixels = ring.loader.plan.transform.sample_bytes
        masks = 8 * -(-pixels // 3 // 8)      # 8 objects, a bit per pixel each
        assert nbytes == ring.shuffle_buffer * (pixels + Record(max_objects=8).nbytes()
                                                + masks)


def test_to_torchvision_carries_the_masks_of_each_image():
    """``to_torchvision()`` adds the kept objects' masks, (n, H, W) uint8, as
    maskrcnn_resnet50_fpn takes them; copies and ``to`` carry them."""
    torch = pytest.importorskip("torch")
    with en.EchoRing(Shapes(4), batch_size=4, augment=SSD[2:], echo=1, workers=1) as ring:
        batch = next(iter(ring))
        rows = batch.to_torchvision()
        for i, row in enumerate(rows):
            n = int(batch.objects.valid[i].sum())
            assert row["masks"].shape == (n, 160, 160) and row["masks"].dtype == torch.uint8
            assert torch.equal(row["masks"].as_subclass(torch.Tensor),
                               torch.from_numpy(batch.objects.masks[i, :n].copy()))
        kept = batch.copy()
        assert np.array_equal(kept.objects.masks, batch.objects.masks)
        assert np.array_equal(batch.objects.to(np).masks, batch.objects.masks)


# ---- rasterising -------------------------------------------------------------------------------
def test_a_polygon_covers_the_pixels_whose_centres_it_holds():
    seg = as_segments([[[10, 10, 50, 10, 50, 40, 10, 40]], [[0, 0, 10, 0, 0, 10]]], 2)
    full = rasterise(seg, (0, 0, 100, 120), False, (100, 120), (100, 120))
    want = np.zeros((100, 120), bool)
    want[10:40, 10:50] = True
    assert np.array_equal(full[0], want)
    y, x = np.mgrid[:100, :120] + 0.5
    assert np.array_equal(full[1], (x + y <= 10))
    # half the size, flipped, through a window reaching past the image (zoom-out)
    half = rasterise(seg, (-20, -20, 120, 140), True, (60, 70), (100, 120))
    ys, xs = (np.arange(60) + 0.5) * 2 - 20, 140 - (np.arange(70) + 0.5) * 2 - 20
    want = (ys[:, None] >= 10) & (ys[:, None] < 40) & (xs >= 10) & (xs < 50)
    assert np.array_equal(half[0], want)


def _centres_inside(parts, h, w):
    """Brute force: each pixel centre against every edge of each part (even-odd, an
    edge counted on the half-open span of its ys), unioned over the parts."""
    y, x = np.mgrid[:h, :w] + 0.5
    out = np.zeros((h, w), bool)
    for p in parts:
        inside = np.zeros((h, w), bool)
        for (x0, y0), (x1, y1) in zip(p, np.roll(p, -1, axis=0)):
            if y0 == y1:
                continue
            crosses = (np.minimum(y0, y1) <= y) & (y < np.maximum(y0, y1))
            at = x0 + (y - y0) * (x1 - x0) / (y1 - y0)
            inside ^= crosses & (at < x)
        out |= inside
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.tuples(st.floats(-8, 48), st.floats(-8, 40)), min_size=3,
                         max_size=9), min_size=1, max_size=3))
def test_a_polygon_fill_is_exact_point_sampling(parts):
    """Polygons (several parts, concave, self-crossing, reaching past the canvas) fill
    exactly the pixels whose centre is inside, by the even-odd rule, as a brute-force
    test of every centre against every edge finds (centres on an edge aside: there the
    two ways of computing the crossing may round apart)."""
    from echo_native.masks import _fill

    parts = [np.asarray(p, np.float64) for p in parts]
    got, want = _fill(parts, 32, 40), _centres_inside(parts, 32, 40)
    y, x = np.mgrid[:32, :40] + 0.5
    near = np.zeros_like(want)
    for p in parts:
        for (x0, y0), (x1, y1) in zip(p, np.roll(p, -1, axis=0)):
            if y0 != y1:
                at = x0 + (y - y0) * (x1 - x0) / (y1 - y0)
                span = (np.minimum(y0, y1) <= y) & (y < np.maximum(y0, y1))
                near |= span & (np.abs(at - x) < 1e-6)
            near |= (np.abs(y - y0) < 1e-6) | (np.abs(y - y1) < 1e-6)
    assert np.array_equal(got[~near], want[~near])


def test_rle_is_sampled_at_each_output_pixel():
    m = np.zeros((40, 60), bool)
    m[5:30, 10:50] = True
    m[12:20, 20:30] = False
    seg = as_segments([{"counts": rle_of(m), "size": [40, 60]}], 1, (40, 60))
    assert np.array_equal(rasterise(seg, (0, 0, 40, 60), False, (40, 60), (40, 60))[0], m)
    assert np.array_equal(rasterise(seg, (0, 0, 40, 60), True, (40, 60), (40, 60))[0],
                          m[:, ::-1])
    # a window (top 4, left 6, 20 x 30) at twice the size: nearest source pixels
    out = rasterise(seg, (4, 6, 20, 30), False, (40, 60), (40, 60))[0]
    assert np.array_equal(out, m[4:24, 6:36].repeat(2, 0).repeat(2, 1))
    # a canvas at a third of the size samples the source at its own scale
    canvas = rasterise(seg, (0, 0, 40, 60), False, (14, 20), (40, 60), scale=(3.0, 3.0))[0]
    want = np.zeros((14, 20), bool)
    want[:13] = m[1::3, 1::3]  # row 13 samples y = 40.5, past the image
    assert np.array_equal(canvas, want)


def test_packed_masks_unpack_to_themselves():
    rng = np.random.default_rng(0)
    m = rng.random((3, 7, 13)) < 0.5
    packed = pack_masks(m, 20)
    assert packed.shape == (3, 20) and not packed[:, -(20 - (7 * 13 + 7) // 8):].any()
    assert np.array_equal(unpack_masks(packed, (7, 13)), m)
    with pytest.raises(ValueError, match="record holds 5"):
        pack_masks(m, 5)


# ---- COCO's forms -------------------------------------------------------------------------------
# Written by hand: a 4 x 5 mask, column-major runs of 0s and 1s, and the compressed
# string pycocotools' encode gives for it.
HAND = np.array([[0, 0, 0, 0, 1],
                 [0, 1, 1, 1, 0],
                 [0, 1, 1, 1, 0],
                 [0, 0, 0, 0, 0]], bool)
HAND_COUNTS = [5, 2, 2, 2, 2, 2, 1, 1, 3]
HAND_STRING = "522000OO2"


def test_compressed_rle_decodes_to_the_hand_made_raster():
    assert rle_from_string(HAND_STRING).tolist() == HAND_COUNTS
    assert rle_to_string(HAND_COUNTS) == HAND_STRING
    assert rle_from_string("3213S3M").tolist() == [3, 2, 1, 5, 100, 2]  # pycocotools'
    for counts in (HAND_COUNTS, HAND_STRING, HAND_STRING.encode()):
        seg = as_segments([{"counts": counts, "size": [4, 5]}], 1, (4, 5))
        assert np.array_equal(rasterise(seg, (0, 0, 4, 5), False, (4, 5), (4, 5))[0], HAND)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**31), max_size=40))
def test_compressed_rle_round_trips(counts):
    assert rle_from_string(rle_to_string(counts)).tolist() == counts


def _coco(tmp_path, segmentations):
    """A COCO folder of Shapes(2)'s images with ``segmentations(k, masks)`` per image."""
    root = tmp_path / "images"
    root.mkdir()
    source = Shapes(2)
    images, anns = [], []
    for k, (blob, boxes, masks, labels) in enumerate(source.items):
        (root / f"{k}.jpg").write_bytes(blob)
        h, w = Image.open(io.BytesIO(blob)).size[::-1]
        images.append({"id": k + 1, "file_name": f"{k}.jpg", "height": h, "width": w})
        for box, seg, label in zip(boxes, segmentations(k, masks), labels):
            x0, y0, x1, y1 = (float(v) for v in box)
            ann = {"id": len(anns) + 1, "image_id": k + 1, "category_id": int(label),
                   "bbox": [x0, y0, x1 - x0, y1 - y0], "iscrowd": int(isinstance(seg, dict))}
            if seg is not None:
                ann["segmentation"] = seg
            anns.append(ann)
    path = tmp_path / "instances.json"
    path.write_text(json.dumps({"images": images, "annotations": anns, "categories": [
        {"id": c, "name": f"c{c}"} for c in (1, 2, 3)]}))
    return root, path, source


def test_coco_masks_are_read_and_follow_the_pixels(tmp_path):
    """``CocoDetection(..., masks=True)`` keeps each annotation's segmentation (polygons,
    list and compressed RLE), packed; batches carry them onto the images."""
    root, ann, source = _coco(tmp_path, lambda k, masks: masks)
    coco = en.CocoDetection(root, ann, masks=True)
    assert coco.masks is True and en.CocoDetection(root, ann).targets(0).masks is None
    for i in range(len(coco)):
        t = coco.targets(i)
        want = as_segments(source.items[i][2], 3, t.image_hw)
        assert isinstance(t.masks, Segments) and t.masks == want
        assert t.masks.rle(1)[0].tolist() == source.items[i][2][1]["counts"]
        assert t.masks.rle(2)[0].tolist() == rle_from_string(source.items[i][2][2]["counts"]).tolist()
    with en.EchoRing(coco, batch_size=2, augment=SSD, echo=1, workers=1) as ring:
        batch = next(iter(ring))
        assert _check_masks(batch) >= 2


def test_an_annotation_without_a_segmentation_has_an_empty_mask(tmp_path):
    root, ann, _ = _coco(tmp_path, lambda k, masks: [None, masks[1], []])
    t = en.CocoDetection(root, ann, masks=True).targets(0)
    full = rasterise(t.masks, (0, 0) + t.image_hw, False, t.image_hw, t.image_hw)
    assert not full[0].any() and full[1].any() and not full[2].any()


@pytest.mark.parametrize("bad, message", [
    (lambda hw: [[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]], "a polygon must be an even number of "
                                                       "finite coordinates"),
    (lambda hw: [[1.0, "2", 3.0, 4.0, 5.0, 6.0]], "a polygon must be a list of numbers"),
    (lambda hw: [[1.0, float("nan"), 3.0, 4.0, 5.0, 6.0]], "a polygon must be an even number"),
    (lambda hw: "12", "a mask is polygons"),
    (lambda hw: {"counts": [1, 2], "size": hw}, "RLE counts must be runs >= 0 covering"),
    (lambda hw: {"counts": [hw[0] * hw[1] + 10, -10], "size": hw}, "RLE counts must be runs"),
    (lambda hw: {"counts": "52!", "size": hw}, "bad compressed RLE counts"),
    (lambda hw: {"counts": "52P", "size": hw}, "bad compressed RLE counts"),
    (lambda hw: {"counts": [20], "size": [4, 5]}, r"RLE of a 4x5 image, the image is \d+x"),
    (lambda hw: {"counts": [20], "size": "4x5"}, "RLE size must be"),
    (lambda hw: {"counts": [1.5], "size": hw}, "RLE counts must be integers"),
], ids=["odd", "string", "nan", "not a mask", "short", "negative", "character", "unfinished",
        "size", "size type", "float counts"])
def test_bad_segmentations_are_named(tmp_path, bad, message):
    def segmentations(k, masks):
        hw = list(Image.open(io.BytesIO(Shapes(2).items[k][0])).size[::-1])
        return [masks[0], bad(hw) if k else masks[1], masks[2]]
    root, ann, _ = _coco(tmp_path, segmentations)
    with pytest.raises(ValueError, match=f"instances.json: annotation id 5: {message}"):
        en.CocoDetection(root, ann, masks=True)


def test_parts_of_fewer_than_three_points_are_dropped():
    seg = as_segments([[[0, 0, 5, 5], [1, 1, 9, 1, 1, 9]]], 1)
    assert len(seg.polygons(0)) == 1 and seg.polygons(0)[0].shape == (3, 2)


def test_targets_check_and_carry_their_masks():
    boxes, labels = np.float32([[0, 0, 4, 4], [1, 1, 2, 2]]), np.int64([1, 2])
    masks = [[[0, 0, 4, 0, 4, 4]], {"counts": HAND_STRING, "size": [4, 5]}]
    t = en.Targets(boxes, labels, image_hw=(4, 5), masks=masks)
    assert t == en.Targets(boxes, labels, image_hw=(4, 5), masks=masks)
    assert t != en.Targets(boxes, labels, image_hw=(4, 5))
    back = targets_from_json(targets_to_json(t), "t.json")
    assert back.masks == t.masks
    with pytest.raises(ValueError, match=r"Targets: masks must be a list of one mask per "
                                         r"object \(2\)"):
        en.Targets(boxes, labels, masks=masks[:1])
    with pytest.raises(ValueError, match="Targets: object 1: RLE of a 4x5 image, the image "
                                         "is 8x8"):
        en.Targets(boxes, labels, image_hw=(8, 8), masks=masks)
    # checked against the image once it is known (a worker's as_targets)
    loose = en.Targets(boxes, labels, masks=masks)
    with pytest.raises(ValueError, match="object 1: RLE of a 4x5 image"):
        as_targets(loose, "here", image_hw=(8, 8))

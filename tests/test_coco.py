"""CocoDetection: a COCO-format folder (real JPEGs at the annotated sizes, an instances
file written here) read as a source with targets.

References: the annotation file's own values (bbox x, y, w, h against boxes x1, y1, x2,
y2), the files on disk, pycocotools where it is installed (its boxes and category
lists), and the same targets read back from tar shards written from the source.
"""
from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

from echo_native import shards
from echo_native.coco import CocoDetection
from echo_native.targets import source_targets
from echo_native.tarshards import TarShards

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import echo_helpers  # noqa: E402

#: (height, width) of each image; ids are given out of order on purpose.
SIZES = [(40, 48), (32, 56), (48, 40), (40, 40), (24, 64)]
IDS = [42, 7, 100, 3, 58]
CATEGORIES = [{"id": 18, "name": "dog"}, {"id": 1, "name": "person"},
              {"id": 90, "name": "toothbrush"}, {"id": 3, "name": "car"}]
NAN = float("nan")


def annotations():
    """Annotations over IDS (image 3 gets none), in an order that is not by image; one box
    reaches 0.4 px past its image's right edge (COCO's rounding), one is a crowd, one is
    zero-sized, one image is in a sub-folder."""
    return [
        {"id": 1, "image_id": 42, "bbox": [1.5, 2.25, 10.0, 20.0], "category_id": 18,
         "iscrowd": 0, "area": 200.0, "segmentation": [[1, 2, 3, 4, 5, 6]]},
        {"id": 2, "image_id": 7, "bbox": [0, 0, 56, 32], "category_id": 1, "iscrowd": 1},
        {"id": 5, "image_id": 42, "bbox": [40.0, 30.0, 8.4, 10.0], "category_id": 90,
         "iscrowd": 0},
        {"id": 3, "image_id": 100, "bbox": [5, 5, 0, 0], "category_id": 3},
        {"id": 9, "image_id": 42, "bbox": [0.0, 0.0, 1.0, 1.0], "category_id": 1,
         "iscrowd": 0},
        {"id": 4, "image_id": 58, "bbox": [10, 4, 20, 12.5], "category_id": 3, "iscrowd": 0},
    ]


def coco_doc():
    images = [{"id": i, "file_name": f"{'sub/' if i == 58 else ''}{i:012d}.jpg",
               "width": w, "height": h, "license": 1}
              for i, (h, w) in zip(IDS, SIZES)]
    return {"info": {"year": 2017}, "images": images, "annotations": annotations(),
            "categories": [dict(c) for c in CATEGORIES]}


@pytest.fixture(scope="module")
def photos():
    """A JPEG at each annotated size (crops of real photographs), made once."""
    return [echo_helpers.photo_jpegs(1, h, w, seed=k)[0] for k, (h, w) in enumerate(SIZES)]


@pytest.fixture
def coco(tmp_path, photos):
    """A COCO folder: ``images/`` (real JPEGs at the annotated sizes) and
    ``instances.json``; returns (images root, annotation path, document)."""
    doc = coco_doc()
    root = tmp_path / "images"
    for data, im in zip(photos, doc["images"]):
        path = root / im["file_name"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    ann = tmp_path / "instances.json"
    ann.write_text(json.dumps(doc))
    return root, ann, doc


def expected(doc, image_id, label_of):
    """(xyxy boxes clipped to the image, labels, iscrowd) of ``image_id``, from the file."""
    im = next(i for i in doc["images"] if i["id"] == image_id)
    rows = [a for a in doc["annotations"] if a["image_id"] == image_id]
    boxes = np.asarray([[x, y, x + w, y + h] for x, y, w, h in (a["bbox"] for a in rows)],
                       np.float64).reshape(-1, 4)
    boxes[:, 0::2] = boxes[:, 0::2].clip(0, im["width"])
    boxes[:, 1::2] = boxes[:, 1::2].clip(0, im["height"])
    return (boxes.astype(np.float32), [label_of[a["category_id"]] for a in rows],
            [bool(a.get("iscrowd", 0)) for a in rows])


def test_a_coco_folder_is_a_source_with_targets(coco):
    """Images sorted by id; each one's bytes and path; labels zeros; targets: bbox xywh as
    xyxy pixels (0.4 px past the edge clipped), categories as labels 1.. in id order,
    iscrowd, in the file's order, with the image's size."""
    root, ann, doc = coco
    src = CocoDetection(root, ann)
    assert len(src) == 5 and src.image_ids.tolist() == sorted(IDS)
    assert src.labels.dtype == np.int64 and src.labels.tolist() == [0] * 5
    assert src.has_targets and source_targets(src) == src.targets
    assert src.category_to_label == {1: 1, 3: 2, 18: 3, 90: 4}
    assert src.label_to_category == {1: 1, 2: 3, 3: 18, 4: 90}
    assert src.categories == ["__background__", "person", "car", "dog", "toothbrush"]
    assert src.num_classes == 5 and src.num_annotations == 6
    by_id = {im["id"]: im for im in doc["images"]}
    for i, image_id in enumerate(src.image_ids.tolist()):
        im = by_id[image_id]
        assert src.describe(i) == os.path.join(root, im["file_name"])
        assert src.read(i) == (root / im["file_name"]).read_bytes()
        t = src.targets(i)
        boxes, labels, crowd = expected(doc, image_id, src.category_to_label)
        assert np.array_equal(t.boxes, boxes), image_id
        assert t.labels.tolist() == labels and t.iscrowd.tolist() == crowd
        assert t.image_hw == (im["height"], im["width"])
    t42 = src.targets(src.image_ids.tolist().index(42))
    assert t42.boxes.tolist()[1] == [40.0, 30.0, 48.0, 40.0]  # 48.4 clipped to the width
    assert len(src.targets(0)) == 0 and src.targets(0).boxes.shape == (0, 4)  # image 3
    assert repr(src) == (f"CocoDetection({str(root)!r}, {str(ann)!r}, 5 images, "
                         f"6 annotations, 4 categories)")


def test_keep_empty_false_drops_images_without_annotations(coco):
    """keep_empty=False: image 3 (no annotation) is left out; the rest keep their order
    and targets."""
    root, ann, _ = coco
    every = CocoDetection(root, ann)
    kept = CocoDetection(root, ann, keep_empty=False)
    assert kept.image_ids.tolist() == [7, 42, 58, 100]
    for i in range(len(kept)):
        j = every.image_ids.tolist().index(int(kept.image_ids[i]))
        assert kept.targets(i) == every.targets(j) and kept.describe(i) == every.describe(j)


def test_category_ids_as_labels_when_asked(coco):
    """contiguous_labels=False: labels are the category ids (gaps named N/A, as
    torchvision's COCO category list); a category id 0 is refused (0 is the background)."""
    root, ann, doc = coco
    src = CocoDetection(root, ann, contiguous_labels=False)
    assert src.category_to_label == {1: 1, 3: 3, 18: 18, 90: 90}
    assert src.num_classes == 91 and len(src.categories) == 91
    assert src.categories[18] == "dog" and src.categories[2] == "N/A"
    assert src.targets(src.image_ids.tolist().index(42)).labels.tolist() == [18, 90, 1]
    doc["categories"].append({"id": 0, "name": "zero"})
    ann.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"category id 0: is not a label \(with "
                                         r"contiguous_labels=False"):
        CocoDetection(root, ann, contiguous_labels=False)


def _break(doc, what):
    """``doc`` with one fault of kind ``what``."""
    a, im = doc["annotations"], doc["images"]
    if what == "negative width":
        a[2]["bbox"] = [4, 4, -2, 3]
    elif what == "outside":
        a[2]["bbox"] = [40.0, 30.0, 9.5, 10.0]
    elif what == "below":
        a[2]["bbox"] = [1.0, -1.5, 2.0, 2.0]
    elif what == "unknown image":
        a[2]["image_id"] = 5
    elif what == "unknown category":
        a[2]["category_id"] = 2
    elif what == "nan":
        a[2]["bbox"] = [1.0, NAN, 2.0, 2.0]
    elif what == "inf":
        a[2]["bbox"] = [1.0, 1.0, float("inf"), 2.0]
    elif what in ("bbox", "image_id", "category_id"):
        del a[2][what]
    elif what == "short bbox":
        a[2]["bbox"] = [1, 2, 3]
    elif what == "string bbox":
        a[2]["bbox"] = ["1", 2, 3, 4]
    elif what == "bool bbox":
        a[2]["bbox"] = [True, 2, 3, 4]
    elif what == "string image id":
        a[2]["image_id"] = "42"
    elif what == "bool category":
        a[2]["category_id"] = True
    elif what == "crowd 2":
        a[2]["iscrowd"] = 2
    elif what == "annotation not an object":
        a[2] = [1, 2]
    elif what == "duplicate image":
        im[3]["id"] = 42
    elif what == "no width":
        del im[3]["width"]
    elif what == "zero height":
        im[3]["height"] = 0
    elif what == "float width":
        im[3]["width"] = 40.5
    elif what == "string image id in images":
        im[3]["id"] = "3"
    elif what == "duplicate category":
        doc["categories"].append({"id": 18, "name": "cat"})
    elif what.startswith("file "):
        im[3]["file_name"] = json.loads(what[5:])
    return doc


@pytest.mark.parametrize("what, why", [
    ("negative width", r"annotation id 5: \(image id 42\) bbox \[4.0, 4.0, -2.0, 3.0\] has a "
                       r"negative width or height$"),
    ("outside", r"annotation id 5: \(image id 42\) bbox \[40.0, 30.0, 9.5, 10.0\] lies outside "
                r"its 40x48 \(height x width\) image by more than 1 px$"),
    ("below", r"annotation id 5: .* lies outside its 40x48"),
    ("unknown image", r"annotation id 5: image_id 5 is not in 'images'$"),
    ("unknown category", r"annotation id 5: category_id 2 is not in 'categories'$"),
    ("nan", r"annotation id 5: \(image id 42\) bbox \[1.0, nan, 2.0, 2.0\] holds a non-finite "
            r"number$"),
    ("inf", r"annotation id 5: .* holds a non-finite number$"),
    ("bbox", r"annotation id 5: no 'bbox'$"),
    ("image_id", r"annotation id 5: no 'image_id'$"),
    ("category_id", r"annotation id 5: no 'category_id'$"),
    ("short bbox", r"annotation id 5: bbox \[1, 2, 3\] is not \[x, y, width, height\] numbers$"),
    ("string bbox", r"annotation id 5: bbox \['1', 2, 3, 4\] is not \[x, y, width, height\]"),
    ("bool bbox", r"annotation id 5: bbox \[True, 2, 3, 4\] is not"),
    ("string image id", r"annotation id 5: image_id '42' is not an integer$"),
    ("bool category", r"annotation id 5: category_id True is not an integer$"),
    ("crowd 2", r"annotation id 5: iscrowd is 2, not 0 or 1$"),
    ("annotation not an object", r"annotation #2: expected an object, got list$"),
    ("duplicate image", r"image id 42: listed twice in 'images'$"),
    ("no width", r"image id 3: no 'width'$"),
    ("zero height", r"image id 3: width and height must be positive integers, got 40 x 0$"),
    ("float width", r"image id 3: width and height must be positive integers"),
    ("string image id in images", r"image #3: id '3' is not an integer$"),
    ("duplicate category", r"category id 18: listed twice in 'categories'$"),
    ('file "../outside.jpg"', r"image id 3: file_name '../outside.jpg' leaves images_root "
                              r"\(absolute, through '..', or with a NUL\)$"),
    ('file "sub/../../outside.jpg"', r"image id 3: file_name 'sub/../../outside.jpg' leaves"),
    ('file "/etc/passwd"', r"image id 3: file_name '/etc/passwd' leaves images_root"),
    ('file "a\\\\..\\\\..\\\\b.jpg"', r"image id 3: file_name .* leaves images_root"),
    ('file "x\\u0000.jpg"', r"image id 3: file_name 'x\\x00.jpg' leaves images_root"),
    ('file ""', r"image id 3: file_name must be a non-empty string, got ''$"),
    ('file 17', r"image id 3: file_name must be a non-empty string, got '17'$"),
    ('file "\\ud800.jpg"', r"image id 3: file_name '\\ud800.jpg' is not a valid path$"),
])
def test_a_malformed_annotation_file_is_refused_naming_the_file_and_the_id(coco, what, why):
    """Each fault found in the file is one ValueError at construction naming the file and
    the annotation (or image, or category) that holds it."""
    root, ann, doc = coco
    ann.write_text(json.dumps(_break(doc, what)))
    with pytest.raises(ValueError, match=f"^{ann}: " + why) as e:
        CocoDetection(root, ann)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text, why", [
    ("[]", r"not a COCO annotation file \(no 'images' list\)$"),
    ('{"annotations": []}', r"not a COCO annotation file \(no 'images' list\)$"),
    ("{", r"not a COCO annotation file \("),
    ("[" * 50_000, r"not a COCO annotation file"),
    ('{"images": [], "annotations": {}}', r"'annotations' must be a list$"),
    ('{"images": []}', r"no images$"),
], ids=["list", "no images", "cut", "deep", "annotations dict", "empty"])
def test_what_is_not_an_instances_file_is_refused_naming_it(coco, text, why):
    """Not JSON, not the instances format, nothing in it: a ValueError naming the file."""
    root, ann, _ = coco
    ann.write_text(text)
    with pytest.raises(ValueError, match=f"^{ann}: " + why):
        CocoDetection(root, ann)


def test_the_annotation_file_and_images_are_read_within_their_limits(coco, tmp_path):
    """An annotation file over max_annotation_bytes, or that is a FIFO, is refused naming
    it; a missing images_root or file is named; an image over max_file_bytes, or missing,
    fails when read (a sample failure), not at construction."""
    root, ann, doc = coco
    with pytest.raises(ValueError, match=rf"^{ann}: \d+ bytes, over the limit "
                                         rf"max_file_bytes=100$"):
        CocoDetection(root, ann, max_annotation_bytes=100)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=rf"^{fifo}: not a regular file \(a FIFO\)$"):
        CocoDetection(root, fifo)
    with pytest.raises(FileNotFoundError, match="images_root"):
        CocoDetection(tmp_path / "nope", ann)
    with pytest.raises(FileNotFoundError, match="annotation file"):
        CocoDetection(root, tmp_path / "nope.json")
    src = CocoDetection(root, ann, max_file_bytes=200)
    with pytest.raises(OSError, match="over the limit max_file_bytes=200"):
        src.read(0)
    os.unlink(root / doc["images"][3]["file_name"])  # image id 3, the first by id
    with pytest.raises(FileNotFoundError):
        CocoDetection(root, ann).read(0)


def test_through_tar_shards_the_targets_are_identical(coco, tmp_path):
    """CocoDetection -> write_shards -> TarShards(targets=True): every sample's image bytes
    and targets (boxes, labels, iscrowd, size) are the source's, in the source's order."""
    root, ann, _ = coco
    src = CocoDetection(root, ann)
    out = shards.write_shards(src, tmp_path / "shards", max_count=2, progress=False)
    assert out.samples == len(src) and not out.failures
    tar = TarShards(out, targets=True)
    assert len(tar) == len(src)
    for i in range(len(src)):
        assert tar.read(i) == src.read(i)
        assert tar.targets(i) == src.targets(i)
    local = tmp_path / "local"
    assert shards.write_shards(src, local, targets=False, progress=False).samples == len(src)
    with pytest.raises(ValueError, match="no sample of the 1 shard"):
        TarShards(sorted(str(p) for p in local.glob("*.tar")), targets=True)


def test_a_source_pickles_small_and_whole_to_a_worker(coco):
    """Pickled (as to a worker process) the source reads the same bytes and targets."""
    root, ann, _ = coco
    src = CocoDetection(root, ann)
    back = pickle.loads(pickle.dumps(src))
    assert len(back) == len(src) and back.category_to_label == src.category_to_label
    for i in range(len(src)):
        assert back.targets(i) == src.targets(i) and back.read(i) == src.read(i)


def test_a_hundred_thousand_annotations_are_held_in_packed_arrays(tmp_path):
    """100,000 annotations over 10,000 images: read, checked, and pickled in under 25
    bytes per annotation plus 80 per image (no Python object per annotation)."""
    n_img, per = 10_000, 10
    rng = np.random.default_rng(0)
    xy = rng.uniform(0, 300, (n_img * per, 2)).round(2)
    wh = rng.uniform(0, 300, (n_img * per, 2)).round(2)
    doc = {"images": [{"id": i, "file_name": f"train/{i:012d}.jpg", "width": 640,
                       "height": 640} for i in range(n_img)],
           "annotations": [{"id": k, "image_id": k // per, "bbox": [*xy[k], *wh[k]],
                            "category_id": 1 + k % 80, "iscrowd": int(k % 97 == 0),
                            "area": float(wh[k, 0] * wh[k, 1])}
                           for k in range(n_img * per)],
           "categories": [{"id": c, "name": f"c{c}"} for c in range(1, 81)]}
    ann = tmp_path / "big.json"
    ann.write_text(json.dumps(doc))
    src = CocoDetection(tmp_path, ann)
    assert len(src) == n_img and src.num_annotations == n_img * per
    t = src.targets(1234)
    k = 1234 * per
    np.testing.assert_allclose(t.boxes, np.concatenate([xy[k:k + per], xy[k:k + per]
                                                        + wh[k:k + per]], axis=1), rtol=1e-6)
    assert t.labels.tolist() == [1 + j % 80 for j in range(k, k + per)]
    size = len(pickle.dumps(src))
    assert size < 25 * n_img * per + 80 * n_img, size


def test_the_boxes_and_categories_match_pycocotools(coco):
    """pycocotools' own reading of the file: the same images, each with the same boxes
    (xywh -> xyxy, clipped) and categories, in the same order."""
    pytest.importorskip("pycocotools", reason="pycocotools is not installed (an optional "
                                              "reference: pip install pycocotools)")
    from pycocotools.coco import COCO

    root, ann, _ = coco
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # it prints its progress
        ref = COCO(str(ann))
    src = CocoDetection(root, ann)
    assert src.image_ids.tolist() == sorted(ref.getImgIds())
    assert sorted(src.category_to_label) == sorted(ref.getCatIds())
    for i, image_id in enumerate(src.image_ids.tolist()):
        info = ref.loadImgs(image_id)[0]
        anns = ref.loadAnns(ref.getAnnIds(imgIds=image_id))
        boxes = np.asarray([[x, y, x + w, y + h] for x, y, w, h in (a["bbox"] for a in anns)],
                           np.float64).reshape(-1, 4)
        boxes[:, 0::2] = boxes[:, 0::2].clip(0, info["width"])
        boxes[:, 1::2] = boxes[:, 1::2].clip(0, info["height"])
        t = src.targets(i)
        assert np.array_equal(t.boxes, boxes.astype(np.float32))
        assert [src.label_to_category[lab] for lab in t.labels.tolist()] == \
            [a["category_id"] for a in anns]
        assert [src.categories[lab] for lab in t.labels.tolist()] == \
            [ref.loadCats(a["category_id"])[0]["name"] for a in anns]
        assert t.iscrowd.tolist() == [bool(a.get("iscrowd", 0)) for a in anns]
        assert src.describe(i).endswith(info["file_name"])


def test_an_id_or_file_name_with_a_newline_cannot_break_the_message(coco, tmp_path):
    """An annotation id holding a newline, in a file whose name holds one: the error is
    still one line, the id and the name shown escaped."""
    root, _, doc = coco
    doc["annotations"][0]["id"] = "7\nERROR forged"
    doc["annotations"][0]["bbox"] = [0, 0, -1, 1]
    ann = tmp_path / "odd\nname.json"
    ann.write_text(json.dumps(doc))
    with pytest.raises(ValueError) as e:
        CocoDetection(root, ann)
    assert "\n" not in str(e.value)
    assert str(e.value).startswith(repr(str(ann)) + ": annotation id '7\\nERROR forged': ")

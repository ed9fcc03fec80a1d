"""Detection as a first-time user meets it: ``batch.to_torchvision()`` without having
imported torch, its boxes as torchvision's ``BoundingBoxes`` where torchvision loads, and
a source whose samples all fail (a wrong ``images_root``, unreadable files) ending in
one clear error, never in an empty batch or a silent empty epoch.

The torch and torchvision checks run in fresh interpreters: whether the library imports
torch itself can only be seen in a process that has not imported it, and a stand-in
``torchvision`` package on ``PYTHONPATH`` (one that loads, one that fails as torchvision
without its compiled ops does) pins both paths wherever the real one cannot load.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import echo_native as en

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def _jpeg(h, w, value=128):
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), value, np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


# -- to_torchvision: torch imported lazily, tv_tensors where torchvision loads ------------

#: Runs in a fresh interpreter: a detection batch from in-memory samples, then
#: ``to_torchvision()`` with torch not imported beforehand; prints what came back as JSON.
PROBE = textwrap.dedent('''
    import io, json, sys
    import numpy as np
    from PIL import Image
    import echo_native as en

    def jpeg(h, w):
        buf = io.BytesIO()
        Image.fromarray(np.full((h, w, 3), 128, np.uint8)).save(buf, "JPEG")
        return buf.getvalue()

    blobs = [jpeg(40, 48), jpeg(32, 56), jpeg(48, 40), jpeg(40, 40)]
    targets = [{"boxes": [[4, 4, 20, 30], [30, 10, 48, 40]], "labels": [1, 2]},
               {"boxes": [[0, 0, 56, 32]], "labels": [3]},
               {"boxes": [], "labels": []},
               {"boxes": [[10, 10, 30, 30]], "labels": [4]}]
    src = en.Samples(blobs, targets=targets)
    assert "torch" not in sys.modules, "echo_native imported torch"
    with en.Loader(src, 4, augment=[en.RandomHorizontalFlip(), en.Resize((24, 32))],
                   workers=1, worker_mode="thread", shuffle=False) as loader:
        batch = next(iter(loader))
        assert "torch" not in sys.modules, "the loader imported torch"
        out = batch.to_torchvision()
        import torch
        rows = []
        for i, t in enumerate(out):
            b = t["boxes"]
            n = int(batch.objects.counts[i])
            rows.append({"type": type(b).__module__ + "." + type(b).__name__,
                         "format": str(getattr(b, "format", None)),
                         "canvas_size": [int(v) for v in getattr(b, "canvas_size", ())],
                         "is_tensor": isinstance(b, torch.Tensor),
                         "dtype": str(b.dtype), "shape": list(b.shape),
                         "labels": t["labels"].tolist(),
                         "equal": bool(np.array_equal(b.as_subclass(torch.Tensor).numpy(),
                                                      batch.objects.boxes[i, :n])),
                         "shared": b.data_ptr() == torch.from_dlpack(
                             batch.objects.boxes).data_ptr() + i * batch.objects.boxes.strides[0]
                         if n else True})
    print("RESULT " + json.dumps(rows))
''')

#: A torchvision stand-in whose tv_tensors.BoundingBoxes records its format and canvas
#: size, as the real one does (a torch.Tensor subclass sharing the data).
FAKE_TV = {
    "__init__.py": "",
    "tv_tensors.py": textwrap.dedent('''
        import torch

        class BoundingBoxFormat:
            XYXY = "BoundingBoxFormat.XYXY"

        class BoundingBoxes(torch.Tensor):
            def __new__(cls, data, *, format, canvas_size):
                assert format in ("XYXY", BoundingBoxFormat.XYXY), format
                t = torch.as_tensor(data).as_subclass(cls)
                t.format = BoundingBoxFormat.XYXY
                t.canvas_size = tuple(canvas_size)
                return t
    '''),
}

#: torchvision without its compiled ops (a CPU torch beside a CUDA torchvision): its
#: import fails with a RuntimeError, not an ImportError.
BROKEN_TV = {"__init__.py": 'raise RuntimeError("operator torchvision::nms does not exist")\n'}


def _probe(tmp_path, package=None):
    """Run PROBE in a fresh interpreter, ``package`` (files) as ``torchvision`` on its
    path: the rows it printed."""
    pytest.importorskip("torch")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    paths = [str(REPO)]
    if package is not None:
        root = tmp_path / "stand_in"
        (root / "torchvision").mkdir(parents=True)
        for name, text in package.items():
            (root / "torchvision" / name).write_text(text)
        paths.insert(0, str(root))
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(v for v in proc.stdout.splitlines() if v.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _check_rows(rows, boxes_type):
    assert [r["labels"] for r in rows] == [[1, 2], [3], [], [4]]
    for r in rows:
        assert r["type"] == boxes_type and r["is_tensor"], r
        assert r["dtype"] == "torch.float32" and r["shape"][1:] == [4], r
        assert r["equal"] and r["shared"], r


def test_to_torchvision_imports_torch_itself(tmp_path):
    """A caller that never imported torch gets its tensors (torch is imported when
    to_torchvision() needs it); without torchvision installed, plain tensors."""
    rows = _probe(tmp_path, {"__init__.py": 'raise ImportError("No module named torchvision")\n'})
    _check_rows(rows, "torch.Tensor")


def test_to_torchvision_gives_bounding_boxes_where_torchvision_loads(tmp_path):
    """With a torchvision that loads, each image's boxes are tv_tensors.BoundingBoxes in
    XYXY on the batch's (height, width) canvas, sharing the batch's memory."""
    rows = _probe(tmp_path, FAKE_TV)
    _check_rows(rows, "torchvision.tv_tensors.BoundingBoxes")
    assert all(r["format"] == "BoundingBoxFormat.XYXY" and r["canvas_size"] == [24, 32]
               for r in rows), rows


def test_to_torchvision_gives_plain_tensors_where_torchvision_fails_to_load(tmp_path):
    """torchvision installed but failing at import (its ops not loading: a RuntimeError):
    plain tensors, as documented, never that error."""
    rows = _probe(tmp_path, BROKEN_TV)
    _check_rows(rows, "torch.Tensor")


# -- a source whose samples fail: one clear error, never an empty batch -------------------

SIZES = [(40, 48), (32, 56), (48, 40), (40, 40), (36, 44), (44, 36), (40, 52), (52, 40)]
DETECTION = [en.RandomHorizontalFlip(), en.Resize((32, 32)), en.SanitizeBoundingBoxes()]
ECHOES = [1, 2, en.Echo(2, placement="batch")]
ECHO_IDS = ["echo1", "example_echo", "batch_echo"]


@pytest.fixture
def coco(tmp_path):
    """A COCO folder of 8 images, two boxes each: (images root, annotation file)."""
    root = tmp_path / "images"
    root.mkdir()
    images, annotations = [], []
    for k, (h, w) in enumerate(SIZES):
        name = f"{k:012d}.jpg"
        (root / name).write_bytes(_jpeg(h, w, 40 + 20 * k))
        images.append({"id": 100 + k, "file_name": name, "height": h, "width": w})
        for j, bbox in enumerate([[2, 3, 10, 12], [w - 16, h - 14, 16, 14]]):
            annotations.append({"id": len(annotations) + 1, "image_id": 100 + k,
                                "category_id": 1 + j, "bbox": bbox, "iscrowd": 0})
    ann = tmp_path / "instances.json"
    ann.write_text(json.dumps({"images": images, "annotations": annotations, "categories": [
        {"id": 1, "name": "a"}, {"id": 2, "name": "b"}]}))
    return root, ann


def _epoch(source, echo, **kw):
    """The lengths of one epoch's batches through EchoRing (echo=None: the Loader alone),
    failure warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", en.SampleFailureWarning)
        if echo is None:
            with en.Loader(source, 4, workers=1, **kw) as loader:
                return [len(b) for b in loader]
        with en.EchoRing(source, 4, echo=echo, workers=1, **kw) as ring:
            return [len(b) for b in ring]


@pytest.mark.parametrize("on_error", ["replace", "skip"])
@pytest.mark.parametrize("echo", [None] + ECHOES, ids=["loader"] + ECHO_IDS)
def test_a_coco_images_root_without_the_images_is_one_clear_error(coco, tmp_path, echo,
                                                                  on_error):
    """CocoDetection given an images_root that holds none of its files: the epoch ends in
    one DecodeError saying every sample failed, naming the first file and the source (its
    root), not in numpy's broadcast error or an epoch of nothing."""
    _, ann = coco
    wrong = tmp_path / "train2017"
    wrong.mkdir()
    source = en.CocoDetection(wrong, ann)
    with pytest.raises(en.DecodeError) as info:
        _epoch(source, echo, augment=DETECTION, on_error=on_error)
    message = str(info.value)
    assert "every one of the 8 samples" in message, message
    assert str(wrong / "000000000000.jpg") in message or \
        any(str(wrong / f"{k:012d}.jpg") in message for k in range(8)), message
    assert f"CocoDetection({str(wrong)!r}" in message, message
    assert "broadcast" not in message


@pytest.mark.parametrize("echo", [None] + ECHOES, ids=["loader"] + ECHO_IDS)
def test_a_batch_whose_images_are_all_missing_is_left_out_under_skip(coco, echo):
    """on_error="skip" with one batch's worth of images missing: the other batch comes
    through with its objects; no empty batch reaches the training loop."""
    root, ann = coco
    for k in range(4):
        (root / f"{k:012d}.jpg").unlink()
    source = en.CocoDetection(root, ann)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", en.SampleFailureWarning)
        if echo is None:
            with en.Loader(source, 4, workers=1, augment=DETECTION, on_error="skip",
                           shuffle=False) as loader:
                batches = [b.copy() for b in loader]
        else:
            with en.EchoRing(source, 4, echo=echo, workers=1, augment=DETECTION,
                             on_error="skip", shuffle=False) as ring:
                batches = [b.copy() for b in ring]
    assert batches and all(len(b) > 0 for b in batches), [len(b) for b in batches]
    ids = {int(s) for b in batches for s in b.sample_ids}
    assert ids == {4, 5, 6, 7}
    for b in batches:
        assert (b.objects.counts == 2).all() and b.objects.canvas_size == (32, 32)


@pytest.mark.parametrize("on_error", ["replace", "skip"])
@pytest.mark.parametrize("echo", [None] + ECHOES, ids=["loader"] + ECHO_IDS)
def test_an_image_folder_whose_every_file_fails_is_one_clear_error(tmp_path, echo, on_error):
    """An ImageFolder where no file decodes: never an epoch of empty batches, nor one of
    nothing ending without a word; one DecodeError naming a file, its reason and the
    folder."""
    folder = tmp_path / "photos"
    (folder / "cat").mkdir(parents=True)
    for k in range(6):
        (folder / "cat" / f"{k}.jpg").write_bytes(b"this is not a jpeg %d" % k)
    source = en.ImageFolder(folder)
    with pytest.raises(en.DecodeError) as info:
        _epoch(source, echo, augment=en.RandomResizedCrop(16), on_error=on_error)
    message = str(info.value)
    assert "every one of the 6 samples" in message and "/cat/" in message, message
    assert "not an image" in message or "not a decodable image" in message, message
    assert f"ImageFolder({str(folder)!r}" in message, message

"""The peers the lab measures against (``echo_native.lab.peers``): NVIDIA DALI's CPU
pipeline and the torch DataLoader with torchvision-style Pillow transforms.

Inputs are JPEGs of real photographs (tests/photos.py) of mixed sizes and aspects
in an ImageFolder tree whose class names are not in creation order and which has
an empty class folder (a class index without files, in both listings).  The
DALI tests need ``nvidia-dali-cuda120`` (CPU only, no GPU) and the torch ones
torch; each skips without its package.
"""
from __future__ import annotations

import collections
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import echo_native as en
from echo_native.lab import peers

TESTS = Path(__file__).resolve().parent.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
from photos import fit, photo  # noqa: E402

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")
CLASSES = ("zebra", "cat", "b_empty", "dog")     # sorted: b_empty, cat, dog, zebra
N, BATCH, SIZE = 21, 8, 32


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """21 photo JPEGs (36-120 px a side) in classes cat, dog, zebra; b_empty has none."""
    root = tmp_path_factory.mktemp("peers_folder")
    rng = np.random.default_rng(7)
    for name in CLASSES:
        (root / name).mkdir()
    for i in range(N):
        h, w = (int(x) for x in rng.integers(36, 121, size=2))
        cls = ("zebra", "cat", "dog")[i % 3]
        pixels = fit(photo(PHOTOS[i % len(PHOTOS)]), h, w)
        Image.fromarray(pixels).save(root / cls / f"img_{i:03d}.jpg", quality=90)
    return en.ImageFolder(root)


def _truth(folder):
    return {folder.path(i): int(folder.labels[i]) for i in range(len(folder))}


# ---- DALI --------------------------------------------------------------------------
def test_dali_missing_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)     # import nvidia.dali fails
    with pytest.raises(ImportError, match="pip install nvidia-dali-cuda120"):
        peers.import_dali()
    with pytest.raises(ImportError, match="pip install nvidia-dali-cuda120"):
        peers.dali_loader("/nonexistent", 8, 1)


def test_dali_epoch_batches_and_labels(folder):
    pytest.importorskip("nvidia.dali")
    truth = _truth(folder)
    assert folder.classes == ["b_empty", "cat", "dog", "zebra"]
    with peers.dali_loader(folder, BATCH, workers=2, size=SIZE, seed=3,
                           with_paths=True) as loader:
        assert loader.n == N and len(loader) == 3
        for _ in range(2):                   # every epoch: each file once, then it ends
            batches = list(loader)
            assert [len(b[0]) for b in batches] == [8, 8, 5]
            seen = collections.Counter()
            for images, labels, paths in batches:
                assert images.shape == (len(paths), SIZE, SIZE, 3)
                assert images.dtype == np.uint8
                assert labels.dtype == np.int64 and labels.shape == (len(paths),)
                # real crops of photographs, not blank or padded output
                assert all(im.std() > 5 for im in images)
                assert [truth[p] for p in paths] == labels.tolist()
                seen.update(paths)
            assert seen == collections.Counter(list(truth))   # every file exactly once


def test_dali_labels_match_imagefolder_order_aside(folder):
    """Without paths: the epoch's labels are ImageFolder's labels, as a multiset."""
    pytest.importorskip("nvidia.dali")
    with peers.dali_loader(folder, 16, workers=1, size=SIZE, seed=0) as loader:
        labels = np.concatenate([lab for _, lab in loader])
    assert sorted(labels.tolist()) == sorted(folder.labels.tolist())
    assert set(labels.tolist()) == {1, 2, 3}            # b_empty (0) has no files


def test_dali_abandoned_epoch_is_run_out(folder):
    pytest.importorskip("nvidia.dali")
    with peers.dali_loader(folder, BATCH, workers=1, size=SIZE, with_paths=True) as loader:
        it = iter(loader)
        next(it)
        del it                               # a consumer breaks out of the epoch
        paths = [p for _, _, batch in loader for p in batch]
    assert sorted(paths) == sorted(_truth(folder))


def test_dali_pipeline_streams_full_batches_without_padding(folder):
    """``pad_last_batch=False`` (the benchmark's setting): the reader runs across
    epochs, every batch full."""
    pytest.importorskip("nvidia.dali")
    pipe = peers.dali_pipeline(folder, BATCH, 1, SIZE, seed=1, pad_last_batch=False)
    sizes = []
    for _ in range(4):
        images, labels = peers.dali_batch(pipe.run())
        sizes.append(len(images))
        assert images.shape[1:] == (SIZE, SIZE, 3) and len(labels) == len(images)
    assert sizes == [BATCH] * 4
    assert pipe.device_id is None            # CPU only: DALI never picked a GPU


def test_dali_refuses_a_tree_it_lists_differently(folder, tmp_path):
    """DALI reads only files directly inside each class folder; ImageFolder walks
    deeper.  The peer says so instead of measuring a different file set."""
    pytest.importorskip("nvidia.dali")
    nested = tmp_path / "cls" / "sub"
    nested.mkdir(parents=True)
    Image.fromarray(fit(photo("coffee"), 40, 48)).save(tmp_path / "cls" / "a.jpg")
    Image.fromarray(fit(photo("rocket"), 40, 48)).save(nested / "b.jpg")
    with pytest.raises(ValueError, match="directly inside each class folder"):
        peers.dali_loader(en.ImageFolder(tmp_path), 2, 1)


def test_cli_bench_has_the_dali_row_and_ratio(folder, tmp_path, capsys):
    pytest.importorskip("nvidia.dali")
    from echo_native.lab.cli import main

    js = tmp_path / "b.json"
    rc = main(["bench", str(folder.root), "--echo", "1", "--placements", "batch",
               "--batch-size", "8", "--image-size", "32", "--workers", "1",
               "--json", str(js), "--chart", str(tmp_path / "b.png")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| x DALI |" in out and "NVIDIA DALI CPU pipeline" in out
    data = json.loads(js.read_text())
    assert "dali" not in data["peers_missing"]
    dali = [r for r in data["rows"] if r["pipeline"].startswith("NVIDIA DALI")]
    assert len(dali) == 1 and dali[0]["x_dali"] == 1.0 and dali[0]["fresh_per_s"] > 0
    # Ratios are paired by run: the median of ring run i over DALI run i.
    ring = [r for r in data["rows"] if r["pipeline"] == "echo_native"]
    peer_runs = [run["delivered_per_s"] for run in dali[0]["runs"]]
    assert ring and all(
        r["x_dali"] == pytest.approx(statistics.median(
            run["delivered_per_s"] / p for run, p in zip(r["runs"], peer_runs, strict=True)))
        for r in ring)


# ---- torch ---------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 1])
def test_torch_epoch_batches_and_labels(folder, workers):
    torch = pytest.importorskip("torch")
    loader = peers.torch_loader(folder, BATCH, workers, size=SIZE, seed=5)
    batches = list(loader)
    assert [len(b[0]) for b in batches] == [8, 8, 5]
    for images, labels in batches:
        assert images.dtype == torch.uint8 and images.shape[1:] == (3, SIZE, SIZE)
        assert labels.dtype == torch.int64 and labels.shape == (len(images),)
        assert all(float(im.float().std()) > 5 for im in images)
    labels = torch.cat([lab for _, lab in batches]).tolist()
    assert sorted(labels) == sorted(folder.labels.tolist())


def test_torch_dataset_item_is_the_photo_crop(folder):
    """Sample i is file i, label i: same crop box and flip as rrc_params draws, CHW."""
    pytest.importorskip("torch")
    ds = peers.PillowImageFolder(folder, size=SIZE, seed=9)
    import random

    for i in (0, 7, 20):
        image, label = ds[i]
        assert label == int(folder.labels[i])
        rng = random.Random(9 * 1_000_003 + i)
        with Image.open(folder.path(i)) as im:
            top, left, h, w = peers.rrc_params(rng, im.height, im.width)
            want = im.convert("RGB").resize((SIZE, SIZE), Image.BILINEAR,
                                            box=(left, top, left + w, top + h))
        if rng.random() < 0.5:
            want = want.transpose(Image.FLIP_LEFT_RIGHT)
        np.testing.assert_array_equal(image.permute(1, 2, 0).numpy(), np.asarray(want))

"""The SPDL and turboloader peers (``echo_native.lab.peers``) and their rows in
``echo-native-lab bench``.

Inputs are JPEGs of real photographs (tests/photos.py) of mixed sizes in an ImageFolder
whose class names are not in creation order, and, where a sample's identity has to be
read back from turboloader's float32 crops, JPEGs of one flat colour each.  The tests
that run a peer skip, with the reason, only when its package is not installed or (SPDL)
FFmpeg's shared libraries are not: they come from the system (``apt-get install -y
libavformat59 libavcodec59 libavfilter8 libavutil57 libswscale6 libavdevice59``), not from
``pip install spdl==0.8.0 turboloader``.  CI installs all of them and sets
``ECHO_NATIVE_REQUIRE_PEERS=1``, under which a peer that does not load fails its tests;
the rest run everywhere.
"""
from __future__ import annotations

import collections
import importlib.util
import json
import os
import statistics
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import echo_native as en
from echo_native.lab import peers
from echo_native.lab.cli import main

TESTS = Path(__file__).resolve().parent.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
from cli_helpers import cli_error  # noqa: E402
from photos import fit, photo  # noqa: E402

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")
CLASSES = ("zebra", "cat", "dog")               # sorted: cat, dog, zebra
N, BATCH, SIZE = 21, 8, 32


def _needs(module, install):
    """Skip when ``module`` is not installed, and only then: an installed package that
    fails to load must fail the test."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed ({install})")


def _needs_spdl():
    """Skip where SPDL is not installed, or where it is but FFmpeg's shared libraries are
    not (they come from the system, not from pip: :data:`peers.SPDL_APT`), with the
    reason.  Where the peers are required (``ECHO_NATIVE_REQUIRE_PEERS=1``, as CI sets
    after installing them) a peer that does not load fails instead of skipping."""
    _needs("spdl", peers.SPDL_INSTALL)
    try:
        peers.import_spdl()
    except ImportError as e:
        if os.environ.get("ECHO_NATIVE_REQUIRE_PEERS") == "1":
            raise
        pytest.skip(str(e))


def _write_folder(root, images):
    """``images[i]`` as ``<class>/img_<i>.jpg``, class i % 3; an ImageFolder over them."""
    for name in CLASSES:
        (root / name).mkdir(parents=True, exist_ok=True)
    for i, pixels in enumerate(images):
        Image.fromarray(pixels).save(root / CLASSES[i % 3] / f"img_{i:03d}.jpg", quality=95)
    return en.ImageFolder(root)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """21 photo JPEGs, 36-120 px a side, in classes cat, dog and zebra."""
    rng = np.random.default_rng(11)
    images = [fit(photo(PHOTOS[i % len(PHOTOS)]), *(int(x) for x in rng.integers(36, 121, 2)))
              for i in range(N)]
    return _write_folder(tmp_path_factory.mktemp("peers_more"), images)


# 13 flat colours, each channel a multiple of 40 apart from every other colour's somewhere
COLOURS = [(40 * (k % 3) + 20, 40 * ((k // 3) % 3) + 20, 120 + 40 * (k // 9)) for k in range(13)]


@pytest.fixture(scope="module")
def colours(tmp_path_factory):
    """13 JPEGs of one flat colour each (COLOURS[i] in img_<i>.jpg), 40-100 px a side."""
    rng = np.random.default_rng(5)
    images = [np.full((*(int(x) for x in rng.integers(40, 101, 2)), 3), c, np.uint8)
              for c in COLOURS]
    return _write_folder(tmp_path_factory.mktemp("peers_colours"), images)


def _colour(path):
    """The colour file ``img_<i>.jpg`` of the colours fixture was written in: COLOURS[i]."""
    return COLOURS[int(Path(path).stem.split("_")[1])]


def _epoch(loader):
    """One epoch as (batch sizes, all images, labels, ids)."""
    batches = list(loader)
    return ([len(b[0]) for b in batches], np.concatenate([b[0] for b in batches]),
            np.concatenate([b[1] for b in batches]), np.concatenate([b[2] for b in batches]))


def _pillow_crop(path, box, flip, size):
    """What torchvision's RandomResizedCrop + flip makes of ``box``: Pillow's bilinear."""
    top, left, h, w = box
    with Image.open(path) as im:
        out = im.convert("RGB").resize((size, size), Image.BILINEAR,
                                       box=(left, top, left + w, top + h))
    if flip:
        out = out.transpose(Image.FLIP_LEFT_RIGHT)
    return np.asarray(out, dtype=np.int16)


# ---- SPDL ----------------------------------------------------------------------------
def test_spdl_missing_names_the_pip_command(monkeypatch):
    """Without SPDL, building its peer fails at once with the pip line to install it."""
    for name in ("spdl", "spdl.io", "spdl.pipeline"):
        monkeypatch.setitem(sys.modules, name, None)        # import spdl.io fails
    with pytest.raises(ImportError, match=r"pip install spdl==0\.8\.0"):
        peers.import_spdl()
    with pytest.raises(ImportError, match=r"pip install spdl==0\.8\.0"):
        peers.spdl_loader("/nonexistent", 8, 1)


def test_spdl_without_ffmpeg_names_the_apt_line(monkeypatch):
    """SPDL installed but FFmpeg's libraries missing: an ImportError naming the apt line,
    before any pipeline starts."""
    _needs("spdl", peers.SPDL_INSTALL)
    import spdl.io

    def no_ffmpeg(*args, **kwargs):
        raise RuntimeError("Failed to import libspdl. libavutil.so.57: cannot open")

    monkeypatch.setattr(peers, "_SPDL_CHECKED", False)
    monkeypatch.setattr(spdl.io, "demux_image", no_ffmpeg)
    with pytest.raises(ImportError, match="apt-get install -y libavformat59 .*libavdevice59"):
        peers.import_spdl()


def test_spdl_epochs_yield_each_sample_once(folder):
    """Each epoch: ceil(N/B) uint8 (b, 32, 32, 3) batches of real crops, every file once
    with its own label; the next epoch draws another order and other crops."""
    _needs_spdl()
    with peers.spdl_loader(folder, BATCH, workers=2, size=SIZE, seed=3, with_ids=True) as loader:
        assert len(loader) == 3
        epochs = []
        for _ in range(2):
            sizes, images, labels, ids = _epoch(loader)
            assert sizes == [8, 8, 5]
            assert images.dtype == np.uint8 and images.shape == (N, SIZE, SIZE, 3)
            assert collections.Counter(ids.tolist()) == collections.Counter(range(N))
            assert labels.dtype == np.int64 and labels.tolist() == folder.labels[ids].tolist()
            assert all(im.std() > 5 for im in images)       # photographs, not blank output
            epochs.append((ids, images[np.argsort(ids)]))
        assert loader.failures == 0
    assert epochs[0][0].tolist() != epochs[1][0].tolist()
    assert not np.array_equal(epochs[0][1], epochs[1][1])


def test_spdl_crop_is_the_drawn_box_and_flip(folder):
    """Every image is the RandomResizedCrop box and flip drawn for (seed, epoch, sample)
    as Pillow's bilinear makes it: a few grey levels off on average (FFmpeg's chroma
    upsampling and swscale's rounding are not Pillow's), far closer than the same crop
    mirrored."""
    _needs_spdl()
    with peers.spdl_loader(folder, BATCH, workers=2, size=SIZE, seed=7, with_ids=True) as loader:
        _, images, _, ids = _epoch(loader)
    flips, diffs = set(), []
    for image, i in zip(images, ids.tolist()):
        with Image.open(folder.path(i)) as im:
            h, w = im.height, im.width
        box, flip = peers.spdl_draw(7, 0, i, h, w)
        flips.add(flip)
        diff = np.abs(image.astype(np.int16) -
                      _pillow_crop(folder.path(i), box, flip, SIZE)).mean()
        mirrored = np.abs(image.astype(np.int16) -
                          _pillow_crop(folder.path(i), box, not flip, SIZE)).mean()
        assert diff < mirrored / 2, (i, box, flip, diff, mirrored)
        diffs.append(diff)
    assert statistics.mean(diffs) < 4 and max(diffs) < 10, diffs
    assert flips == {True, False}


def test_spdl_abandoned_epoch_is_run_out(folder):
    """A consumer that breaks out of an epoch gets a whole next epoch, every file once."""
    _needs_spdl()
    with peers.spdl_loader(folder, BATCH, workers=1, size=SIZE, with_ids=True) as loader:
        it = iter(loader)
        next(it)
        del it
        _, _, _, ids = _epoch(loader)
    assert sorted(ids.tolist()) == list(range(N))


def test_spdl_counts_a_file_it_cannot_decode(folder, tmp_path):
    """A file FFmpeg cannot read is dropped from the epoch, counted and named; the others
    all arrive.  (The pipeline runs on into the next epoch, so the count may already hold
    that epoch's failure too.)"""
    _needs_spdl()
    root = tmp_path / "bad"
    for i in range(5):
        (root / CLASSES[i % 3]).mkdir(parents=True, exist_ok=True)
        (root / CLASSES[i % 3] / f"img_{i}.jpg").write_bytes(Path(folder.path(i)).read_bytes())
    broken = root / "cat" / "img_9.jpg"
    broken.write_bytes(b"\xff\xd8\xff\xe0 this is no JPEG")
    bad = en.ImageFolder(root)
    with peers.spdl_loader(bad, 4, workers=2, size=SIZE, with_ids=True) as loader:
        _, _, _, ids = _epoch(loader)
        assert loader.failures >= 1
        assert all(e.startswith(f"{broken}: ") for e in loader.errors), loader.errors
    broken_id = [str(bad.path(i)) for i in range(len(bad))].index(str(broken))
    assert sorted(ids.tolist()) == sorted(set(range(len(bad))) - {broken_id})


# ---- turboloader ---------------------------------------------------------------------
def test_turboloader_missing_names_the_pip_command(monkeypatch, folder, tmp_path):
    """Without turboloader, building its peer fails at once with the pip line, before
    anything is packed."""
    monkeypatch.setitem(sys.modules, "turboloader", None)
    with pytest.raises(ImportError, match="pip install turboloader"):
        peers.import_turboloader()
    with pytest.raises(ImportError, match="pip install turboloader"):
        peers.turbo_loader(folder, 8, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_pack_tar_member_k_is_file_k_and_is_reused(folder, tmp_path):
    """The TAR holds file k as member k (ustar, a .jpg name), is written once and reused
    while the files stay the same, and only the most recent archives are kept."""
    tar_path = peers.pack_tar(folder, tmp_path)
    with tarfile.open(tar_path) as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == [f"{k:08d}.jpg" for k in range(N)]
        assert all(tar.extractfile(m).read() == Path(folder.path(k)).read_bytes()
                   for k, m in enumerate(members))
    assert tar_path.read_bytes()[257:262] == b"ustar"
    inode = tar_path.stat().st_ino
    assert peers.pack_tar(folder, tmp_path) == tar_path and tar_path.stat().st_ino == inode
    # other file sets: a new archive each, and the oldest goes beyond `keep`
    sub = tmp_path / "other"
    made = [tar_path]
    for k in range(2):
        for c in CLASSES:
            (sub / str(k) / c).mkdir(parents=True)
        Image.fromarray(fit(photo("coffee"), 40 + k, 50)).save(sub / str(k) / "cat" / "a.jpg")
        made.append(peers.pack_tar(en.ImageFolder(sub / str(k)), tmp_path, keep=2))
    assert len(set(made)) == 3
    assert sorted(tmp_path.glob("*.tar")) == sorted(made[1:])


def test_pack_tar_refuses_a_file_that_is_not_a_jpeg(tmp_path):
    """turboloader would serve a PNG as a black image: packing refuses it by name and
    leaves no partial archive."""
    root = tmp_path / "mixed"
    (root / "cat").mkdir(parents=True)
    Image.fromarray(fit(photo("coffee"), 40, 48)).save(root / "cat" / "a.jpg")
    Image.fromarray(fit(photo("rocket"), 40, 48)).save(root / "cat" / "b.png")
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"only JPEG files; .*b\.png is not one"):
        peers.pack_tar(en.ImageFolder(root), cache)
    assert list(cache.iterdir()) == []


@pytest.mark.parametrize("antialias", [True, False])
def test_turboloader_epochs_yield_each_sample_once(colours, tmp_path, antialias):
    """Each epoch: float32 (b, 32, 32, 3) batches in [0, 1], every file once with its own
    label and its own pixels (each file is one colour); epochs differ in order."""
    _needs("turboloader", peers.TURBO_INSTALL)
    n = len(colours)
    orders = []
    with peers.turbo_loader(colours, 4, SIZE, seed=2, antialias=antialias, with_ids=True,
                            cache_dir=tmp_path) as loader:
        assert len(loader) == 4
        for _ in range(2):
            sizes, images, labels, ids = _epoch(loader)
            assert sizes == [4, 4, 4, 1]
            assert images.dtype == np.float32 and images.shape == (n, SIZE, SIZE, 3)
            assert 0.0 <= images.min() and images.max() <= 1.0
            assert collections.Counter(ids.tolist()) == collections.Counter(range(n))
            assert labels.tolist() == colours.labels[ids].tolist()
            want = np.asarray([_colour(colours.path(i)) for i in ids], np.float32) / 255
            assert np.abs(images.mean(axis=(1, 2)) - want).max() < 8 / 255
            orders.append(ids.tolist())
        assert loader.failures == 0
    assert orders[0] != orders[1]


def test_turboloader_antialias_switch_changes_the_resize(folder, tmp_path):
    """Same seed and epoch, so the same samples and crops: with antialias on and off the
    pixels differ (the switch reaches the resize), by less than a different crop would."""
    _needs("turboloader", peers.TURBO_INSTALL)
    out = {}
    for aa in (True, False):
        with peers.turbo_loader(folder, BATCH, SIZE, seed=4, antialias=aa, with_ids=True,
                                cache_dir=tmp_path) as loader:
            _, images, _, ids = _epoch(loader)
        out[aa] = images[np.argsort(ids)]
        assert np.array_equal(np.sort(ids), np.arange(N))
    diff = np.abs(out[True] - out[False]).mean(axis=(1, 2, 3))
    assert diff.max() > 0
    assert diff.mean() < np.abs(out[True] - out[True][::-1]).mean()


# ---- echo-native-lab bench -----------------------------------------------------------
def test_bench_has_spdl_and_turboloader_rows(folder, tmp_path, capsys):
    """A real run: a row per peer (turboloader twice, antialias on and off) with its rate
    over echo_native e=1 paired by run, its note and thread count, in the table, the peer
    table, the JSON and the verdict."""
    _needs_spdl()
    _needs("turboloader", peers.TURBO_INSTALL)
    js = tmp_path / "b.json"
    rc = main(["bench", str(folder.root), "--peers", "spdl,turboloader", "--echo", "1",
               "--placements", "batch", "--batch-size", "8", "--image-size", "32",
               "--workers", "1", "--repeats", "2", "--json", str(js),
               "--chart", str(tmp_path / "b.png")])
    assert rc == 0
    out = capsys.readouterr().out
    data = json.loads(js.read_text())
    assert data["peers_missing"] == {}
    rows = {r["pipeline"]: r for r in data["rows"]}
    spdl = rows["SPDL thread pipeline (FFmpeg decode + crop/scale/flip filter)"]
    aa = rows["turboloader train_aug (TAR, float32, antialias on)"]
    noaa = rows["turboloader train_aug (TAR, float32, antialias off)"]
    ring = rows["echo_native"]
    assert len(data["rows"]) == 4 and ring["x_e1"] == 1.0
    for r in (spdl, aa, noaa):
        per = [a["delivered_per_s"] / b["delivered_per_s"]
               for a, b in zip(r["runs"], ring["runs"], strict=True)]
        assert r["x_e1"] == pytest.approx(statistics.median(per))
        assert r["x_e1_range"] == pytest.approx([min(per), max(per)])
        assert r["failures"] == 0 and r["fresh_per_s"] > 0
    assert spdl["workers"] == 1 and "FFmpeg decodes the whole image" in spdl["note"]
    threads = peers.turboloader_threads()
    assert aa["workers"] == noaa["workers"] == threads
    assert "float32" in aa["note"] and f"{threads} threads" in aa["note"] and \
        "not --workers 1" in aa["note"]
    assert "antialias off" in noaa["note"]
    assert "| x SPDL | x turbo | x turbo no-AA |" in out
    assert "| SPDL | 1 | " in out and "/ echo_native e=1" in out
    verdict = out.strip().splitlines()[-1]
    assert "SPDL" in verdict and "turboloader (no antialias)" in verdict


def test_bench_missing_peers_are_skipped_rows(folder, tmp_path, monkeypatch, capsys):
    """SPDL and turboloader not installed: the bench still runs, and each peer's row in
    the peer table says 'skipped:' with the pip line to install it."""
    for name in ("spdl", "spdl.io", "spdl.pipeline", "turboloader"):
        monkeypatch.setitem(sys.modules, name, None)
    js = tmp_path / "b.json"
    rc = main(["bench", str(folder.root), "--peers", "spdl,turboloader", "--echo", "1",
               "--placements", "batch", "--batch-size", "8", "--image-size", "32",
               "--workers", "1", "--repeats", "1", "--json", str(js),
               "--chart", str(tmp_path / "b.png")])
    assert rc == 0
    out, err = capsys.readouterr()
    data = json.loads(js.read_text())
    assert set(data["peers_missing"]) == {"spdl", "turboloader", "turboloader_noaa"}
    assert [r["pipeline"] for r in data["rows"]] == ["echo_native"]
    lines = {line.split(" | ")[0]: line for line in out.splitlines() if "skipped:" in line}
    assert "pip install spdl==0.8.0" in lines["| SPDL"]
    assert "pip install turboloader" in lines["| turboloader"]
    assert "pip install turboloader" in lines["| turboloader (no antialias)"]
    assert "no SPDL peer in this run" in err
    assert "no peer ran" in out.strip().splitlines()[-1]


def test_bench_unknown_peer_is_a_usage_error(folder, capsys):
    """--peers with a name it does not know: one usage line listing the known ones."""
    cli_error(main, "echo-native-lab", capsys, ["bench", str(folder.root), "--peers", "ffcv"],
              "unknown peer 'ffcv'", "torch, dali, spdl, turboloader")

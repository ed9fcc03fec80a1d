"""``echo-native-lab`` (the lab's command line): bench, make-dataset, demo errors.

Commands run in-process through :func:`echo_native.lab.cli.main` (fast); one test
runs the real ``python -m echo_native.lab`` to check that a user error prints one
line and no traceback.  Inputs are small folders of JPEGs cut from real
photographs (tests/sources_helpers.py) or from Debian's Fashion-MNIST.  The demo's
own run is tests/lab/test_demo.py.
"""
from __future__ import annotations

import ast
import gzip
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import echo_native.lab
from echo_native.lab import cli, datasets
from echo_native.lab.cli import main

TESTS = Path(__file__).resolve().parent.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
import sources_helpers as sh  # noqa: E402
from cli_helpers import cli_error  # noqa: E402

BENCH_ROW_KEYS = {"pipeline", "placement", "echo", "workers", "wall_s", "fresh_per_s",
                  "delivered_per_s", "effective_echo", "stall_s", "ring_occupancy", "failures"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """24 JPEGs (40x48, real photographs) in 3 classes."""
    root = tmp_path_factory.mktemp("lab_cli_folder")
    return str(sh.write_folder(root, sh.photo_jpegs(24, seed=3), np.arange(24) % 3))


def _error(capsys, argv, *needles):
    return cli_error(main, 'echo-native-lab', capsys, argv, *needles)


# ---- bench ---------------------------------------------------------------------------
def test_bench_json_schema(folder, tmp_path, capsys):
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    rc = main(["bench", folder, "--no-peers", "--echo", "1,2", "--placements",
               "before_augment,batch", "--batch-size", "8", "--image-size", "32",
               "--workers", "1", "--json", str(js), "--chart", str(png)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| pipeline |" in out
    data = json.loads(js.read_text())
    assert data["images"] == 24
    assert data["args"]["echo"] == [1, 2] and data["args"]["batch_size"] == 8
    assert len(data["rows"]) == 3  # e=1, then e=2 for each placement
    for row in data["rows"]:
        assert BENCH_ROW_KEYS <= set(row)
        assert row["pipeline"] == "echo_native"
        assert row["fresh_per_s"] > 0 and row["delivered_per_s"] >= row["fresh_per_s"] * 0.99
        assert row["failures"] == 0
    assert [r["echo"] for r in data["rows"]] == [1, 2, 2]
    assert [r["placement"] for r in data["rows"]] == ["after_augment", "before_augment",
                                                      "batch"]


# ---- errors a user can hit -----------------------------------------------------------
def test_missing_folder(tmp_path, capsys):
    _error(capsys, ["bench", str(tmp_path / "nope"), "--no-peers"], "no such folder")


def test_empty_folder(tmp_path, capsys):
    _error(capsys, ["bench", str(tmp_path), "--no-peers"], "no class sub-folders")


def test_jpegs_without_class_folders(tmp_path, capsys):
    for i, data in enumerate(sh.photo_jpegs(3)):
        (tmp_path / f"{i}.jpg").write_bytes(data)
    _error(capsys, ["bench", str(tmp_path), "--no-peers"], "no class sub-folders",
           "<class>")


def test_too_few_samples_for_batch(folder, capsys):
    _error(capsys, ["bench", folder, "--no-peers", "--batch-size", "64"],
           "24 images, fewer than --batch-size 64")


def test_no_gpu_for_device_cuda(folder, capsys):
    from echo_native.backends import cuda_available
    if cuda_available():
        pytest.skip("a CUDA device is available here: the error path cannot be reached")
    _error(capsys, ["bench", folder, "--no-peers", "--batch-size", "8", "--device", "cuda"],
           "--device cuda")


def test_demo_no_gpu_for_device_cuda(folder, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("torch sees a CUDA GPU here")
    _error(capsys, ["demo", "--data", folder, "--device", "cuda"], "no CUDA GPU")


def test_bad_placement_and_echo(folder, capsys):
    small = ["bench", folder, "--no-peers", "--batch-size", "8"]
    _error(capsys, [*small, "--placements", "sideways"], "unknown placement")
    _error(capsys, [*small, "--echo", "0.5"], "echo factors")


def test_missing_dataset_package(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(datasets, "FASHION_MNIST_DIR", tmp_path / "absent")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no cached tree either
    _error(capsys, ["make-dataset", "fashion-mnist", str(tmp_path / "out")],
           "apt-get install dataset-fashion-mnist")
    # the demo without --data builds the dataset, so it needs the package too
    pytest.importorskip("torch")
    _error(capsys, ["demo"], "apt-get install dataset-fashion-mnist")


def test_user_error_in_a_real_process_has_no_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "echo_native.lab", "bench", str(tmp_path / "x"),
                        "--no-peers"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"echo-native-lab: error: {tmp_path / 'x'}: "
                                             f"no such folder"]


# ---- make-dataset --------------------------------------------------------------------
def _write_idx(path, arr):
    arr = np.asarray(arr, np.uint8)
    head = bytes([0, 0, 8, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    with gzip.open(path, "wb") as f:
        f.write(head + arr.tobytes())


@pytest.fixture
def fake_fashion_dir(tmp_path):
    """IDX files in Debian's layout whose images are real photographs (28x28 gray)."""
    d = tmp_path / "fm"
    d.mkdir()
    import io
    photos = [np.asarray(Image.open(io.BytesIO(b)).convert("L").resize((28, 28)))
              for b in sh.photo_jpegs(30, seed=5)]
    x = np.stack(photos)
    _write_idx(d / "train-images-idx3-ubyte.gz", x[:20])
    _write_idx(d / "train-labels-idx1-ubyte.gz", np.arange(20) % 10)
    _write_idx(d / "t10k-images-idx3-ubyte.gz", x[20:])
    _write_idx(d / "t10k-labels-idx1-ubyte.gz", np.arange(10) % 10)
    return d, x


def test_load_idx_roundtrip_and_bad_magic(fake_fashion_dir, tmp_path):
    d, x = fake_fashion_dir
    np.testing.assert_array_equal(datasets.load_idx(d / "train-images-idx3-ubyte.gz"), x[:20])
    bad = tmp_path / "bad.idx"
    bad.write_bytes(b"\x00\x00\x0d\x01" + struct.pack(">I", 1) + b"\x00" * 4)
    with pytest.raises(ValueError, match="not an unsigned-byte IDX"):
        datasets.load_idx(bad)


def test_make_dataset_fashion_mnist_layout(fake_fashion_dir, tmp_path, monkeypatch, capsys):
    d, x = fake_fashion_dir
    monkeypatch.setattr(datasets, "FASHION_MNIST_DIR", d)
    out = tmp_path / "tree"
    assert main(["make-dataset", "fashion-mnist", str(out), "--limit-test", "5"]) == 0
    assert "20 train + 5 test JPEGs" in capsys.readouterr().out
    import echo_native as en
    train, test = en.ImageFolder(out / "train"), en.ImageFolder(out / "test")
    assert len(train) == 20 and len(test) == 5
    assert train.classes == [f"{i}_{c}" for i, c in enumerate(datasets.FASHION_CLASSES)]
    # labels survive; pixels survive up to JPEG loss; files are grayscale 28x28
    i = int(np.flatnonzero(train.labels == 3)[0])
    with Image.open(train.path(i)) as im:
        assert im.mode == "L" and im.size == (28, 28) and im.format == "JPEG"
        k = int(Path(train.path(i)).stem)
        assert k % 10 == 3
        assert np.abs(np.asarray(im, float) - x[k]).mean() < 8
    # a complete tree with the same parameters is reused
    mtime = (out / datasets.MANIFEST).stat().st_mtime_ns
    assert main(["make-dataset", "fashion-mnist", str(out), "--limit-test", "5"]) == 0
    assert (out / datasets.MANIFEST).stat().st_mtime_ns == mtime


@pytest.mark.skipif(not (datasets.FASHION_MNIST_DIR / "t10k-images-idx3-ubyte.gz").exists(),
                    reason="Debian's dataset-fashion-mnist is not installed")
def test_make_dataset_real_fashion_mnist_subset(tmp_path, capsys):
    out = tmp_path / "fm"
    assert main(["make-dataset", "fashion-mnist", str(out), "--limit-train", "100",
                 "--limit-test", "50"]) == 0
    import echo_native as en
    train = en.ImageFolder(out / "train")
    assert len(train) == 100 and len(en.ImageFolder(out / "test")) == 50
    assert en.decode(train.read(0)).shape == (28, 28, 3)


def test_make_dataset_imagenet_like(tmp_path, capsys):
    out = tmp_path / "corpus"
    assert main(["make-dataset", "imagenet-like", str(out), "--images", "12"]) == 0
    import echo_native as en
    assert len(en.ImageFolder(out)) == 12
    _error(capsys, ["make-dataset", "imagenet-like", str(tmp_path / "c2"), "--images", "0"],
           "--images")


def test_make_dataset_out_is_a_file(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    _error(capsys, ["make-dataset", "imagenet-like", str(f)], "not a folder")


def test_parser_has_the_lab_commands():
    sub = cli.build_parser()._subparsers._group_actions[0].choices
    assert set(sub) == {"bench", "make-dataset", "demo"}


def test_only_the_lab_cli_imports_a_cli():
    """The lab's modules (demo, corpus, ...) never import a command line: no cycle."""
    lab = Path(echo_native.lab.__file__).parent
    scanned = set()
    for path in sorted(lab.glob("*.py")):
        if path.name in ("cli.py", "__main__.py"):
            continue
        scanned.add(path.name)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            bad = [n for n in names if n in ("echo_native.cli", "echo_native.lab.cli")
                   or (getattr(node, "level", 0) and "cli" in n.split("."))]
            assert not bad, f"{path.name}:{node.lineno} imports {bad}"
    assert "demo.py" in scanned

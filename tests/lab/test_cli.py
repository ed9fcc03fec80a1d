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
import importlib.util
import json
import random
import statistics
import struct
import subprocess
import sys
from contextlib import contextmanager
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


def test_bench_real_run_with_peers_pairs_each_run(folder, tmp_path, capsys):
    """A real run beside the torch peer (when installed; each other peer's real run is in
    its own test): every row holds --repeats runs, and its ratio is the median of the
    runs' ratios to the same run of the peer."""
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    rc = main(["bench", folder, "--echo", "1,2", "--placements", "before_augment",
               "--batch-size", "8", "--image-size", "32", "--workers", "1", "--repeats", "2",
               "--peers", "torch", "--json", str(js), "--chart", str(png)])
    assert rc == 0
    data = json.loads(js.read_text())
    ran = [p for p in ("torch",) if p not in data["peers_missing"]]   # --peers torch
    assert ("torch" in ran) == (importlib.util.find_spec("torch") is not None)
    assert [r["pipeline"] for r in data["rows"]] == \
        [cli.PEERS[p][0] for p in ran] + ["echo_native"] * 2
    for row in data["rows"]:
        assert BENCH_ROW_KEYS <= set(row) and len(row["runs"]) == row["repeats"] == 2
        rates = [r["delivered_per_s"] for r in row["runs"]]
        assert row["delivered_range"] == [min(rates), max(rates)]
        for peer in cli.PEERS:
            base = next((b for b in data["rows"] if b["pipeline"] == cli.PEERS[peer][0]), None)
            if base is None:
                assert row[f"x_{peer}"] is None
                continue
            per = [a["delivered_per_s"] / b["delivered_per_s"]
                   for a, b in zip(row["runs"], base["runs"])]
            assert row[f"x_{peer}_runs"] == pytest.approx(per)
            assert row[f"x_{peer}"] == pytest.approx(statistics.median(per))
    assert png.stat().st_size > 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("echo_native: ")


# ---- bench: repeats, ratios, verdict and chart (fake pipelines) ----------------------
WARM_UP = 1e9  # a warm-up epoch's rate: any figure holding it counted the warm-up


class FakeBench:
    """Stands in for the pipelines' sessions: records every build and epoch in order, and
    hands out rates from a seeded RNG (the warm-up epoch of each build gets WARM_UP)."""

    def __init__(self, seed=0, dali_error=None):
        self.rng = random.Random(seed)
        self.calls = []      # ("open" | "epoch", label)
        self.timed = {}      # label -> delivered img/s of each timed epoch
        self.dali_error = dali_error

    @contextmanager
    def _session(self, label, pipeline, placement, echo):
        self.calls.append(("open", label))
        epochs = 0

        def epoch():
            nonlocal epochs
            self.calls.append(("epoch", label))
            epochs += 1
            e = 1 if echo == "auto" else echo
            if epochs == 1:
                delivered = WARM_UP
            else:
                delivered = self.rng.uniform(100, 1000) * e
                self.timed.setdefault(label, []).append(delivered)
            return {"pipeline": pipeline, "placement": placement, "echo": echo, "workers": 1,
                    "wall_s": 1.0, "fresh_per_s": delivered / e, "delivered_per_s": delivered,
                    "effective_echo": float(e), "stall_s": 0.0, "ring_occupancy": 0.5,
                    "failures": 0}
        yield epoch

    def install(self, monkeypatch, missing=None):
        monkeypatch.setattr(cli, "_peers_missing", lambda: dict(missing or {}))
        monkeypatch.setattr(cli, "_torch_session", lambda folder, args: self._session(
            "torch", cli.PEERS["torch"][0], "-", 1))
        monkeypatch.setattr(cli, "_dali_session", self._dali)
        monkeypatch.setattr(cli, "_ring_session", lambda folder, args, e, placement:
                            self._session(f"{placement} e={e}", "echo_native", placement, e))

    def _dali(self, folder, args):
        if self.dali_error is not None:
            raise self.dali_error
        return self._session("dali", cli.PEERS["dali"][0], "-", 1)


def _fake_bench(folder, tmp_path, monkeypatch, *extra, repeats=3, fake=None, missing=None):
    fake = fake or FakeBench()
    fake.install(monkeypatch, missing)
    js, png = tmp_path / "f.json", tmp_path / "f.png"
    # The fake stands in for torch and DALI; the other peers (SPDL, turboloader) are left
    # out so that none runs for real where it happens to be installed.
    rc = main(["bench", folder, "--echo", "1,2,4", "--placements", "before_augment,batch",
               "--batch-size", "8", "--repeats", str(repeats), "--json", str(js),
               "--chart", str(png), "--peers", "torch,dali", *extra])
    assert rc == 0
    return fake, json.loads(js.read_text()), png


LABELS = ["torch", "dali", "after_augment e=1", "before_augment e=2", "before_augment e=4",
          "batch e=2", "batch e=4"]
# the same pipelines as the progress bar names them
BAR_LABELS = ["torch", "DALI", "echo_native e=1", *LABELS[3:]]


def test_bench_runs_are_round_robin_each_after_a_warm_up(folder, tmp_path, monkeypatch,
                                                        capsys):
    """Cycle after cycle, every pipeline once (torch, DALI, e=1, the echo rows), each built
    afresh and timed on its second epoch."""
    fake, _, _ = _fake_bench(folder, tmp_path, monkeypatch)
    one_run = lambda label: [("open", label), ("epoch", label), ("epoch", label)]  # noqa: E731
    assert fake.calls == [c for _ in range(3) for label in LABELS for c in one_run(label)]


def test_bench_rows_are_medians_of_timed_runs_with_paired_ratios(folder, tmp_path,
                                                                monkeypatch, capsys):
    """Rows report the median and min-max of the timed epochs (never the warm-up); ratios
    are the median of each cycle's row over that cycle's peer."""
    fake, data, _ = _fake_bench(folder, tmp_path, monkeypatch)
    rows = dict(zip(LABELS, data["rows"], strict=True))
    assert data["repeats"] == 3
    for label, row in rows.items():
        timed = fake.timed[label]
        assert len(timed) == 3 and WARM_UP not in [r["delivered_per_s"] for r in row["runs"]]
        assert row["delivered_per_s"] == pytest.approx(statistics.median(timed))
        assert row["delivered_range"] == pytest.approx([min(timed), max(timed)])
        fresh = [r["fresh_per_s"] for r in row["runs"]]
        assert row["fresh_per_s"] == pytest.approx(statistics.median(fresh))
        assert row["fresh_range"] == pytest.approx([min(fresh), max(fresh)])
        for peer in ("torch", "dali"):
            per = [a / b for a, b in zip(timed, fake.timed[peer])]
            assert row[f"x_{peer}_runs"] == pytest.approx(per)
            assert row[f"x_{peer}"] == pytest.approx(statistics.median(per))
            assert row[f"x_{peer}_range"] == pytest.approx([min(per), max(per)])
    # the data tell pairing apart from a ratio of medians
    e1, torch = fake.timed["after_augment e=1"], fake.timed["torch"]
    assert statistics.median(e1) / statistics.median(torch) != \
        pytest.approx(rows["after_augment e=1"]["x_torch"])
    table = capsys.readouterr().out
    lo, hi = rows["batch e=4"]["delivered_range"]
    assert f"{rows['batch e=4']['delivered_per_s']:,.0f} ({lo:,.0f}-{hi:,.0f})" in table


def test_bench_verdict_quotes_the_paired_medians(folder, tmp_path, monkeypatch, capsys):
    """The last line: e=1 against both peers (median, min-max), then the echo row quoted."""
    _, data, _ = _fake_bench(folder, tmp_path, monkeypatch)
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    e1 = next(r for r in data["rows"] if r["echo"] == 1 and r["pipeline"] == "echo_native")
    for peer, name in (("torch", "torch DataLoader"), ("dali", "DALI CPU")):
        lo, hi = e1[f"x_{peer}_range"]
        assert f"{e1[f'x_{peer}']:.1f}x ({lo:.1f}-{hi:.1f}) {name}" in verdict, verdict
    assert "median and min-max of 3 paired runs" in verdict
    # before_augment is preferred over the faster batch echo: the paper's best placement
    top = max((r for r in data["rows"] if r["placement"] == "before_augment"),
              key=lambda r: r["delivered_per_s"])
    assert f"with echo={top['echo']} before_augment it delivers " \
           f"{top['effective_echo']:.1f}x its fresh rate ({top['x_torch']:.1f}x torch " \
           f"DataLoader)" in verdict


def test_bench_verdict_names_only_the_peers_that_ran(folder, tmp_path, monkeypatch, capsys):
    """A missing peer is reported on stderr, has no column, no ratio and no verdict word."""
    _, data, _ = _fake_bench(folder, tmp_path, monkeypatch,
                             missing={"dali": "the DALI peer needs NVIDIA DALI (test)"})
    out, err = capsys.readouterr()
    assert "no DALI peer in this run: the DALI peer needs NVIDIA DALI (test)" in err
    assert data["peers_missing"] == {"dali": "the DALI peer needs NVIDIA DALI (test)"}
    assert all(r["x_dali"] is None for r in data["rows"])
    assert "| x torch |" in out and "x DALI" not in out
    verdict = out.strip().splitlines()[-1]
    assert "torch DataLoader" in verdict and "DALI" not in verdict


def test_bench_peer_that_cannot_be_built_is_dropped(folder, tmp_path, monkeypatch, capsys):
    """DALI refusing the folder (it lists other files) drops DALI alone, in the first cycle:
    the others still have every run."""
    fake = FakeBench(dali_error=ValueError("DALI's file reader lists 3 files"))
    _, data, _ = _fake_bench(folder, tmp_path, monkeypatch, fake=fake)
    assert "no DALI peer in this run: DALI's file reader lists 3 files" in \
        capsys.readouterr().err
    assert data["peers_missing"] == {"dali": "DALI's file reader lists 3 files"}
    assert [len(r["runs"]) for r in data["rows"]] == [3] * (len(LABELS) - 1)
    assert "dali" not in [label for _, label in fake.calls]


def test_bench_verdict_without_peers_says_so(folder, tmp_path, monkeypatch, capsys):
    """--no-peers: no ratio, and the verdict says why."""
    _, data, _ = _fake_bench(folder, tmp_path, monkeypatch, "--no-peers", repeats=2)
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    e1 = data["rows"][0]
    assert f"{e1['delivered_per_s']:,.0f} img/s at e=1; no peer ran (--no-peers), so no " \
           f"ratio (median of 2 runs)" in verdict
    assert "torch" not in verdict and "DALI" not in verdict


def test_bench_progress_bar_counts_runs_and_names_the_pipeline(folder, tmp_path,
                                                                monkeypatch, capsys):
    """One bar over every (pipeline, repeat) run; its description names the one running."""
    bars = []

    class Bar:
        def __init__(self, total):
            self.total, self.descs, self.done = total, [], 0
            bars.append(self)

        def set_description(self, desc):
            self.descs.append(desc)

        def update(self, n=1):
            self.done += n

        def refresh(self):
            pass

        def close(self):
            pass

        @staticmethod
        def write(msg, file=None):
            print(msg, file=file)

    monkeypatch.setattr(cli, "_progress", Bar)
    _fake_bench(folder, tmp_path, monkeypatch, repeats=2)
    (bar,) = bars
    assert bar.total == bar.done == 2 * len(LABELS)
    assert bar.descs == [f"{label} ({c}/2)" for c in (1, 2) for label in BAR_LABELS]


def test_bench_chart_is_written(folder, tmp_path, monkeypatch, capsys):
    """A PNG is written (bars with error bars, labels and legend are checked by eye)."""
    pytest.importorskip("matplotlib")
    _, data, png = _fake_bench(folder, tmp_path, monkeypatch, repeats=2)
    assert f"chart: {png}" in capsys.readouterr().out
    with Image.open(png) as im:
        assert im.format == "PNG" and im.width > im.height > 200


def test_bench_repeats_must_be_positive(folder, capsys):
    for n in ("0", "-2"):
        line = _error(capsys, ["bench", folder, "--no-peers", "--repeats", n],
                      f"--repeats must be >= 1, got {n}")
        assert "\n" not in line


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
    assert set(sub) == {"bench", "make-dataset", "demo", "lm-demo"}


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

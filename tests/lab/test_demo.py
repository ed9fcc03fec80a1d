"""The echo training demo runs end to end on a tiny subset (not a performance test).

Data: the first images of Debian's ``dataset-fashion-mnist`` converted to JPEG when
the package is installed (CI installs it), otherwise 28x28 grayscale crops of real
photographs (scikit-image's), one photograph per class -- so the test never skips.
"""
from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest

pytest.importorskip("torch")

import echo_native as en  # noqa: E402
from echo_native.lab import datasets  # noqa: E402
from echo_native.lab.cli import main  # noqa: E402
from echo_native.lab.demo import (ThrottledSource, auto_verdict, markdown_table,  # noqa: E402
                                  summarize, sweep_table)

RUN_KEYS = {"echo", "placement", "seed", "reached", "fresh_to_target", "wall_to_target_s",
            "steps_to_target", "final_acc", "fresh", "steps", "wall_s", "effective_echo",
            "stall_s", "final_echo", "echo_trace", "curve"}
ROW_KEYS = {"echo", "placement", "seeds", "reached"}


def _photo_tree(root, n_train=320, n_test=160):
    """Fallback data: 28x28 gray crops of 10 real photographs, class = photograph."""
    import skimage.data
    from PIL import Image

    names = ("camera", "coins", "moon", "page", "clock", "grass", "gravel", "brick",
             "astronaut", "coffee")
    photos = []
    for n in names:
        a = getattr(skimage.data, n)()
        photos.append(np.asarray(Image.fromarray(a).convert("L")))
    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("test", n_test)):
        for i in range(n):
            c = i % 10
            p = photos[c]
            s = int(rng.integers(min(p.shape) // 4, min(p.shape) // 2))
            y, x = int(rng.integers(0, p.shape[0] - s)), int(rng.integers(0, p.shape[1] - s))
            im = Image.fromarray(p[y:y + s, x:x + s]).resize((28, 28), Image.BILINEAR)
            d = root / split / f"{c}_{names[c]}"
            d.mkdir(parents=True, exist_ok=True)
            im.save(d / f"{i:05d}.jpg", quality=90)
    return root


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo_data")
    if (datasets.FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz").exists():
        return datasets.build_fashion_mnist(root, limit_train=320, limit_test=160), "fashion"
    return _photo_tree(root), "photos"


@pytest.mark.slow  # four trainings: the slow run (-m slow) has it
def test_demo_end_to_end(tiny, tmp_path, capsys):
    data, kind = tiny
    js, png = tmp_path / "demo.json", tmp_path / "demo.png"
    rc = main(["demo", "--data", str(data), "--seeds", "1", "--echo", "1,2",
               "--batch-size", "32", "--max-fresh", "640", "--eval-every", "160",
               "--target", "0.15", "--R", "3", "--upstream-seconds", "0.3", "--quiet",
               "--json", str(js), "--chart", str(png)])
    assert rc == 0, kind
    out = capsys.readouterr().out
    assert "| echo | placement |" in out
    rep = json.loads(js.read_text())
    assert rep["train_images"] == 320 and rep["test_images"] == 160
    assert rep["step_ms"] > 0 and rep["upstream_img_per_s"] > 0 and rep["measured_R"] > 0
    # e=1 once, e=2 for every placement (one seed: the mean and spread over seeds are
    # test_summary_marks_unreached_settings's)
    assert len(rep["runs"]) == 1 + 3
    for r in rep["runs"]:
        assert RUN_KEYS <= set(r)
        assert r["curve"], r
        assert all(0.0 <= a <= 1.0 for *_, a in r["curve"])
        assert r["fresh"] <= 640 + 32
        if r["echo"] == 2:
            assert r["steps"] > r["fresh"] / 32  # echoed examples mean more steps per fresh
    placements = {(r["echo"], r["placement"]) for r in rep["runs"]}
    assert placements == {(1, "none"), (2, "before_augment"), (2, "after_augment"),
                          (2, "batch")}
    assert len(rep["rows"]) == 4
    for row in rep["rows"]:
        assert ROW_KEYS <= set(row)
        if row["reached"] == row["seeds"]:
            assert row["fresh_mean"] > 0 and row["wall_mean"] > 0
    try:
        import matplotlib  # noqa: F401

        assert png.stat().st_size > 1000
    except ImportError:
        assert "no chart" in out


def test_demo_data_errors(tiny, tmp_path, capsys):
    data, _ = tiny
    assert main(["demo", "--data", str(tmp_path / "absent")]) == 2
    assert "no such folder" in capsys.readouterr().err
    (tmp_path / "only" / "train").mkdir(parents=True)
    assert main(["demo", "--data", str(tmp_path / "only")]) == 2
    err = capsys.readouterr().err
    assert "no test/ folder" in err and "echo-native-lab make-dataset fashion-mnist" in err
    assert err.startswith("echo-native-lab: error: ")
    assert main(["demo", "--data", str(data), "--batch-size", "1000"]) == 2
    assert "fewer than --batch-size 1000" in capsys.readouterr().err
    assert main(["demo", "--data", str(data), "--target", "1.5"]) == 2
    assert "--target" in capsys.readouterr().err


def test_throttled_source(tiny, monkeypatch):
    """ThrottledSource keeps the inner source's labels and bytes, pickles, and each read
    sleeps its delay first (the delay is what throttles the upstream)."""
    data, _ = tiny
    inner = en.ImageFolder(os.path.join(data, "train"))
    idx = np.array([5, 2, 9])
    src = ThrottledSource(inner, 0.01, idx)
    assert len(src) == 3
    np.testing.assert_array_equal(src.labels, inner.labels[idx])
    assert src.read(1) == inner.read(2) and src.describe(0) == inner.describe(5)
    import echo_native.lab.demo as demo_mod
    slept = []
    monkeypatch.setattr(demo_mod.time, "sleep", slept.append)
    src.read(0)
    monkeypatch.undo()
    assert slept == [0.01]
    clone = pickle.loads(pickle.dumps(src))  # workers receive it pickled
    assert clone.read(2) == inner.read(9)


def test_summary_marks_unreached_settings():
    runs = [{"echo": 1, "placement": "none", "seed": s, "reached": True,
             "fresh_to_target": 1000 + 100 * s, "wall_to_target_s": 2.0, "steps_to_target": 20}
            for s in range(3)]
    runs += [{"echo": 2, "placement": "batch", "seed": s, "reached": s != 1,
              "fresh_to_target": 500 if s != 1 else None, "wall_to_target_s": 1.0,
              "steps_to_target": 20} for s in range(3)]
    rows = summarize(runs)
    base, batch = rows
    assert base["fresh_mean"] == pytest.approx(1100) and base["fresh_std"] == pytest.approx(100)
    assert base["fresh_reduction"] == pytest.approx(1.0)
    assert batch["reached"] == 2 and "fresh_mean" not in batch
    table = markdown_table(rows, 0.8)
    assert "not reached" in table and "2/3" in table and "1,100 ± 100" in table


@pytest.mark.slow   # six trainings; the sweep's tables and verdict: the unit tests below
def test_sweep_end_to_end(tiny, tmp_path, capsys):
    """--sweep runs fixed factors and echo="auto" at each R, with the losses reported to
    the ring, and prints the wall-time table with auto against the best fixed e."""
    data, kind = tiny
    js, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    rc = main(["demo", "--data", str(data), "--seeds", "1", "--echo", "1,2,auto",
               "--placements", "before_augment", "--sweep", "2,3", "--batch-size", "32",
               "--max-fresh", "640", "--eval-every", "160", "--target", "0.15",
               "--min-step-ms", "5", "--upstream-seconds", "0.3", "--quiet",
               "--json", str(js), "--chart", str(png)])
    assert rc == 0, kind
    out = capsys.readouterr().out
    assert "| R (measured) | e = 1 | e = 2 | e = auto | auto / best fixed | auto / e = 1 |" in out
    rep = json.loads(js.read_text())
    assert [b["R"] for b in rep["per_R"]] == [2.0, 3.0]
    for block in rep["per_R"]:
        assert {r["echo"] for r in block["rows"]} == {1, 2, "auto"}
        assert block["step_ms"] >= 5.0
        one = json.loads((tmp_path / f"sweep-R{block['R']:g}.json").read_text())
        auto = [r for r in one["runs"] if r["echo"] == "auto"]
        # Where auto settles follows the measured rates (the machine's); that it stays
        # within its bounds does not.  Its decisions on given rates: tests/test_echo.py.
        assert len(auto) == 1 and 1.0 <= auto[0]["final_echo"] <= one["config"]["max_echo"]
        assert all(t["reason"] in ("stall", "rates", "loss") for t in auto[0]["echo_trace"])
        assert all(RUN_KEYS <= set(r) for r in one["runs"])


def _rows(walls):
    return [{"echo": e, "placement": "before_augment", "seeds": 3, "reached": 3,
             "wall_mean": w, "wall_std": 0.1} for e, w in walls.items()]


def test_auto_verdict_and_sweep_table():
    rows = _rows({1: 10.0, 2: 6.0, 4: 4.0, 6: 5.0, "auto": 4.4})
    v = auto_verdict(rows)
    assert v["best_fixed_echo"] == 4 and v["auto_vs_best"] == pytest.approx(1.1)
    assert v["auto_vs_e1"] == pytest.approx(0.44)
    unreached = rows[:-1] + [{"echo": "auto", "placement": "before_augment", "seeds": 3,
                              "reached": 1}]
    assert auto_verdict(unreached)["auto_vs_best"] is None
    per_R = [{"R": 2.0, "measured_R": 1.98, "rows": rows, "verdict": v},
             {"R": 6.0, "measured_R": 5.9, "rows": unreached,
              "verdict": auto_verdict(unreached)}]
    table = sweep_table(per_R, 0.72)
    assert "| R (measured) | e = 1 | e = 2 | e = 4 | e = 6 | e = auto |" in table
    assert "| 2 (1.98) | 10.0 ± 0.1 | 6.0 ± 0.1 | 4.0 ± 0.1 | 5.0 ± 0.1 | 4.4 ± 0.1 | " \
           "1.10 (best e = 4) | 0.44 |" in table
    assert "not reached (1/3)" in table


def test_sweep_arguments_are_checked(tiny, capsys):
    data, _ = tiny
    assert main(["demo", "--data", str(data), "--sweep", "2,-1"]) == 2
    assert "--sweep needs positive ratios" in capsys.readouterr().err
    assert main(["demo", "--data", str(data), "--min-step-ms", "-3"]) == 2
    assert "--min-step-ms must be >= 0" in capsys.readouterr().err
    assert main(["demo", "--data", str(data), "--echo", "0.5,auto"]) == 2
    assert "numbers >= 1 or 'auto'" in capsys.readouterr().err

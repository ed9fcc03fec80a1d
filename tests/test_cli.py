"""``echo-native`` (the library's command line): ``profile``, exit codes, one-line errors.

Commands run in-process through :func:`echo_native.cli.main` (fast); one test
runs the real ``python -m echo_native`` to check that a user error prints one
line and no traceback.  Inputs are small folders of JPEGs cut from real
photographs (tests/sources_helpers.py).  The lab's commands (``bench``,
``make-dataset``, ``demo``) are tested in tests/lab/test_cli.py.
"""
from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from echo_native import cli, profile
from echo_native.cli import main, recommend

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import sources_helpers as sh  # noqa: E402
from cli_helpers import cli_error  # noqa: E402

PROFILE_KEYS = {"dir", "images", "batch_size", "image_size", "workers", "upstream_img_per_s",
                "t_upstream_ms", "t_downstream_ms", "step_time_from", "R", "input_bound",
                "recommended_echo", "recommended_placement", "max_echo",
                "steps_per_s_no_echo", "steps_per_s_recommended", "step_speedup"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """24 JPEGs (40x48, real photographs) in 3 classes."""
    root = tmp_path_factory.mktemp("cli_folder")
    return str(sh.write_folder(root, sh.photo_jpegs(24, seed=3), np.arange(24) % 3))


def _error(capsys, argv, *needles):
    return cli_error(main, 'echo-native', capsys, argv, *needles)


class ScriptedClock:
    """A clock that moves only when the code under test sleeps on it (its ``sleep``):
    what a trial or a measurement decides then depends on the script, never on the
    machine's speed."""

    def __init__(self, tick=0.0):
        self.t, self.tick, self.slept = 0.0, tick, []

    def __call__(self):
        now = self.t
        self.t += self.tick   # a ticking clock: every reading is one tick later
        return now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.t += seconds


TRIAL_BATCHES = 12   # the CLI's auto trial in these tests: exactly this many batches


@pytest.fixture
def bounded_trial(monkeypatch):
    """The CLI's auto trial ends after TRIAL_BATCHES batches (at any speed: its seconds
    are made too long to end it first), and time_step stops after its 3 timed calls."""
    def trial(*args, **kw):
        return profile.trial_auto(*args, **{**kw, "seconds": 3600.0, "batches": TRIAL_BATCHES})
    monkeypatch.setattr(cli, "trial_auto", trial)
    monkeypatch.setattr(cli, "time_step", functools.partial(profile.time_step, min_s=0.0))


# ---- profile -------------------------------------------------------------------------
def _profile(folder, tmp_path, *extra):
    js = tmp_path / "p.json"
    rc = main(["profile", folder, "--batch-size", "8", "--image-size", "32", "--workers", "1",
               "--seconds", "0.3", "--min-batches", "4", "--auto-seconds", "1.5",
               "--json", str(js), *extra])
    assert rc == 0
    data = json.loads(js.read_text())
    assert PROFILE_KEYS <= set(data)
    assert data["upstream_img_per_s"] > 0
    assert data["recommended_placement"] == "before_augment"
    assert 1.0 <= data["recommended_echo"] <= data["max_echo"]
    return data


def test_profile_consumer_bound(folder, tmp_path, capsys, monkeypatch):
    """A 100 s step: R < 1, no echo recommended, and the auto trial's one sleep is cut at
    the trial's end (on the trial's clock, scripted here), so it sees one batch and says
    that is too few to measure."""
    clock = ScriptedClock()
    monkeypatch.setattr(cli, "trial_auto", functools.partial(profile.trial_auto, clock=clock,
                                                             sleep=clock.sleep))
    data = _profile(folder, tmp_path, "--step-ms", "100000")
    assert data["R"] < 1 and not data["input_bound"]
    assert data["recommended_echo"] == 1.0
    out = capsys.readouterr().out
    assert "no echo needed" in out
    # A 100 s step: the trial's sleep is cut at the trial's end, on the trial's clock
    # (not one started before the ring), so it sees exactly one batch and says so.
    assert data["auto_trial"]["batches"] == 1 and not data["auto_trial"]["measured"]
    assert clock.slept == [1.5]   # --auto-seconds, not the 100 s step
    assert "only 1 batch, too few to measure the rates" in out


def test_profile_input_bound_is_capped(folder, tmp_path, capsys, bounded_trial):
    """A 0.1 us step: input bound, the recommendation capped at --max-echo, and the auto
    trial's result printed and saved as it ran."""
    data = _profile(folder, tmp_path, "--step-ms", "0.0001", "--max-echo", "3")
    assert data["R"] > 3 and data["input_bound"]
    assert data["recommended_echo"] == 3.0
    out = capsys.readouterr().out
    assert "recommended echo=3" in out and "before_augment" in out
    # The auto trial: where auto goes depends on the measured rates (the consumer's time
    # per batch is the ring's own work here), so only its bounds and its report are
    # checked; where auto goes for given rates is test_echo's to show, with scripted ones.
    trial = data["auto_trial"]
    assert trial["measured"] and trial["batches"] == TRIAL_BATCHES
    assert 1.0 <= trial["echo"] <= 3.0
    # batches of at most 8 (the last of an epoch may be short); repeats or not, never
    # fewer deliveries than fresh examples
    assert TRIAL_BATCHES < trial["delivered"] <= 8 * TRIAL_BATCHES
    assert 0 < trial["fresh"] <= trial["delivered"]
    # Without loss feedback there is no "loss" or "probe"; "capacity" is there whenever
    # the echo stage's own rate caps e, which depends on how loaded the machine is.
    assert {t["reason"] for t in trial["trace"]} <= {"stall", "rates", "capacity"}
    assert f"echo='auto' for 1.5 s: e = {trial['echo']:.2f} after {trial['batches']} " \
           f"batches" in out and f"{len(trial['trace'])} changes of e" in out
    if trial["trace"]:
        last = trial["trace"][-1]
        assert f"e -> {last['echo']:.2f}  ({last['reason']}" in out


def test_profile_model_fn_file_and_module(folder, tmp_path, monkeypatch, capsys,
                                          bounded_trial):
    """--model-fn as file:function and module:function: timed on real batches; a name
    that is not there, a module that cannot be imported, a bad spec and a missing file
    are one-line errors."""
    mod = tmp_path / "my_step.py"
    mod.write_text("import time\nSEEN, SPENT = [], []\n"
                   "def step(batch):\n    t0 = time.perf_counter()\n"
                   "    SEEN.append(batch.images.shape)\n    time.sleep(0.02)\n"
                   "    SPENT.append(time.perf_counter() - t0)\n")
    data = _profile(folder, tmp_path, "--model-fn", f"{mod}:step")
    assert data["t_downstream_ms"] >= 20    # fn sleeps 20 ms per call
    assert data["step_time_from"].startswith("--model-fn")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = _profile(folder, tmp_path, "--model-fn", "my_step:step")
    import my_step
    assert my_step.SEEN and set(my_step.SEEN) == {(8, 32, 32, 3)}
    # time_step's 2 warm-up calls and 3 timed ones, then the auto trial's consumer; the
    # step time is the timed calls' mean as the step itself measured them (their sum
    # would be 3 times that), whatever each call took
    assert len(my_step.SPENT) == 5 + TRIAL_BATCHES
    mean_ms = 1000 * sum(my_step.SPENT[2:5]) / 3
    assert mean_ms <= data["t_downstream_ms"] < 2 * mean_ms
    small = ["--batch-size", "8"]
    _error(capsys, ["profile", folder, *small, "--model-fn", "my_step:nope"], "no callable")
    _error(capsys, ["profile", folder, *small, "--model-fn", "no_such_module_xyz:f"],
           "cannot import")
    _error(capsys, ["profile", folder, *small, "--model-fn", "justaname"], "module:function")
    _error(capsys, ["profile", folder, *small, "--model-fn", f"{tmp_path}/none.py:f"],
           "no such file")


def test_profile_needs_a_step_time(folder, capsys):
    _error(capsys, ["profile", folder], "--step-ms")
    _error(capsys, ["profile", folder, "--step-ms", "-1"], "positive")


@pytest.mark.parametrize("t_up,t_down,cap,R,e", [
    (4.0, 1.0, 4.0, 4.0, 4.0),
    (10.0, 1.0, 4.0, 10.0, 4.0),
    (2.5, 1.0, 4.0, 2.5, 2.5),
    (0.5, 1.0, 4.0, 0.5, 1.0),
    (1.0, 0.3, 8.0, 1 / 0.3, 3.3),
])
def test_recommend_rule(t_up, t_down, cap, R, e):
    got_R, got_e = recommend(t_up, t_down, cap)
    assert got_R == pytest.approx(R)
    assert got_e == pytest.approx(e)


def test_recommend_is_the_profile_modules():
    assert cli.recommend is profile.recommend


def test_measure_upstream_counts_fresh_images(folder):
    """A real run: a positive, finite rate of fresh images."""
    import echo_native as en

    up = profile.measure_upstream(en.ImageFolder(folder), 8, 32, 1, seconds=0.1, min_batches=3)
    assert up > 0 and np.isfinite(up)


@pytest.mark.parametrize("seconds, min_batches, batches", [(1.0, 3, 6), (0.1, 5, 5)])
def test_measure_upstream_runs_for_seconds_and_min_batches(folder, seconds, min_batches,
                                                           batches):
    """On a clock that ticks 0.25 s per reading: the rate is over the batches after the
    warm-up ones, until both ``seconds`` and ``min_batches`` are reached, exactly."""
    import echo_native as en

    clock = ScriptedClock(tick=0.25)
    up = profile.measure_upstream(en.ImageFolder(folder), 8, 32, 1, seconds=seconds,
                                  min_batches=min_batches, clock=clock)
    # t0 is the first reading; each batch from min_batches on reads the clock once, and
    # the last reading (one tick later) divides: 8 images per batch.
    readings = batches - min_batches + 1
    assert up == pytest.approx(8 * batches / (0.25 * (readings + 1)))


def test_time_step_times_one_real_batch(folder):
    """Warm-up calls, then at least 3 timed calls (min_s=0 stops right after them), each
    on a real batch."""
    import echo_native as en

    shapes = []
    t = profile.time_step(lambda b: shapes.append(b.images.shape), en.ImageFolder(folder),
                          8, 32, 1, min_s=0.0, warmup=2, max_calls=5)
    assert t > 0
    assert len(shapes) == 2 + 3 and set(shapes) == {(8, 32, 32, 3)}


@pytest.mark.parametrize("min_s, max_calls, timed", [(0.1, 50, 5), (10.0, 7, 7), (0.0, 50, 3)])
def test_time_step_stops_at_min_s_or_max_calls(folder, min_s, max_calls, timed):
    """A step that takes 20 ms on a scripted clock: timed over the calls until min_s
    (at least 3) or max_calls, the average exactly 20 ms."""
    import echo_native as en

    clock, calls = ScriptedClock(), []

    def step(batch):
        calls.append(batch.images.shape)
        clock.sleep(0.02)

    t = profile.time_step(step, en.ImageFolder(folder), 8, 32, 1, min_s=min_s, warmup=2,
                          max_calls=max_calls, clock=clock)
    assert t == pytest.approx(0.02)
    assert len(calls) == 2 + timed


def test_trial_auto_cuts_a_long_step_at_its_end(folder):
    """A step time longer than the trial: its one sleep is cut at the trial's end, on
    the trial's own clock, and the trial has seen one batch."""
    import echo_native as en

    clock = ScriptedClock()
    s = profile.trial_auto(3600.0, en.ImageFolder(folder), 8, 32, 1, seconds=0.2,
                           clock=clock, sleep=clock.sleep)
    assert s["batches"] == 1 and clock.slept == [pytest.approx(0.2)]


def test_trial_auto_sleeps_each_step_until_its_end(folder):
    """A step of 0.125 s in a 1 s trial: exactly 8 batches, each step slept in full."""
    import echo_native as en

    clock = ScriptedClock()
    s = profile.trial_auto(0.125, en.ImageFolder(folder), 8, 32, 1, seconds=1.0,
                           clock=clock, sleep=clock.sleep)
    assert s["batches"] == 8 and clock.slept == [0.125] * 8


def test_trial_auto_stops_after_its_batches(folder):
    """batches=3: a callable consumer sees exactly 3 batches, each a real full batch
    (the epoch's first three: at any e, 24 images fill three batches first)."""
    import echo_native as en

    shapes = []
    s = profile.trial_auto(lambda b: shapes.append(b.images.shape), en.ImageFolder(folder),
                           8, 32, 1, seconds=3600.0, batches=3)
    assert s["batches"] == 3 and shapes == [(8, 32, 32, 3)] * 3
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="batches must be an integer >= 1"):
            profile.trial_auto(1.0, en.ImageFolder(folder), 8, 32, 1, batches=bad)


# ---- errors a user can hit -----------------------------------------------------------
def test_missing_folder(tmp_path, capsys):
    _error(capsys, ["profile", str(tmp_path / "nope"), "--step-ms", "1"], "no such folder")


def test_dir_is_a_file(tmp_path, capsys):
    f = tmp_path / "file.jpg"
    f.write_bytes(b"x")
    _error(capsys, ["profile", str(f), "--step-ms", "1"], "not a folder")


def test_empty_folder(tmp_path, capsys):
    _error(capsys, ["profile", str(tmp_path), "--step-ms", "1"], "no class sub-folders")


def test_folder_without_jpegs(tmp_path, capsys):
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "notes.txt").write_text("not an image")
    _error(capsys, ["profile", str(tmp_path), "--step-ms", "1"], "no files with extensions")


def test_jpegs_without_class_folders(tmp_path, capsys):
    for i, data in enumerate(sh.photo_jpegs(3)):
        (tmp_path / f"{i}.jpg").write_bytes(data)
    _error(capsys, ["profile", str(tmp_path), "--step-ms", "1"], "no class sub-folders",
           "<class>")


def test_too_few_samples_for_batch(folder, capsys):
    _error(capsys, ["profile", folder, "--step-ms", "1", "--batch-size", "25"],
           "24 images, fewer than --batch-size 25")


@pytest.mark.parametrize("flag,value", [("--batch-size", "0"), ("--image-size", "0"),
                                        ("--workers", "-1")])
def test_bad_sizes_are_one_line_errors(folder, capsys, flag, value):
    _error(capsys, ["profile", folder, "--step-ms", "10", flag, value], flag, ">= 1")


@pytest.mark.parametrize("flag", ["--step-ms", "--seconds", "--max-echo", "--auto-seconds"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_numbers_are_refused(folder, capsys, flag, value):
    _error(capsys, ["profile", folder, "--step-ms", "10", flag, value], flag, "finite")


def test_bad_max_echo(folder, capsys):
    _error(capsys, ["profile", folder, "--step-ms", "1", "--max-echo", "0.5"], "--max-echo")


def test_no_gpu_for_device_cuda(folder, capsys):
    from echo_native.backends import cuda_available
    if cuda_available():
        pytest.skip("a CUDA device is available here: the error path cannot be reached")
    _error(capsys, ["profile", folder, "--batch-size", "8", "--step-ms", "1", "--device",
                    "cuda"], "--device cuda")


@pytest.mark.parametrize("command", ["bench", "make-dataset", "demo"])
def test_lab_commands_point_to_the_lab_cli(command, capsys):
    _error(capsys, [command, "--help"], f"echo-native-lab {command}")


def test_parser_has_only_the_library_commands():
    sub = cli.build_parser()._subparsers._group_actions[0].choices
    assert set(sub) == {"profile", "make-shards", "shards"}   # shards: make-shards' alias
    assert sub["shards"] is sub["make-shards"]


def test_user_error_in_a_real_process_has_no_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "echo_native", "profile", str(tmp_path / "x"),
                        "--step-ms", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"echo-native: error: {tmp_path / 'x'}: "
                                             f"no such folder"]

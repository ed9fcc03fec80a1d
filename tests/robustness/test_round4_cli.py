"""Round four against the ``echo-native`` command line: hostile arguments to ``profile``
and ``make-shards``, and where ``profile`` writes its JSON.

What a user gets: one line naming the argument, exit status 2 (a bad argument, found
before anything is measured) or 1 (a failure while running: memory, the step function,
the store), never a traceback; ``--min-batches`` cannot keep a measurement running for
ever; the JSON is written only when asked, atomically, never through a planted link.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from echo_native import cli, profile
from echo_native.cli import main

HERE = Path(__file__).resolve().parent.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import sources_helpers as sh  # noqa: E402
from cli_helpers import cli_error  # noqa: E402

pytestmark = pytest.mark.timeout(180)

PROG = "echo-native"
QUICK = ["--batch-size", "8", "--image-size", "32", "--workers", "1", "--seconds", "0.1",
         "--min-batches", "2", "--auto-seconds", "0", "--step-ms", "5"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("round4_cli")
    return str(sh.write_folder(root, sh.photo_jpegs(24, seed=3), np.arange(24) % 3))


@pytest.fixture
def no_measuring(monkeypatch):
    """measure_upstream answers at once (counted): what a test checks is the command's
    handling, not the pipeline's speed."""
    calls = []

    def upstream(*args, **kw):
        calls.append("upstream")
        return (1000.0, kw["min_batches"]) if kw.get("with_batches") else 1000.0
    monkeypatch.setattr(cli, "measure_upstream", upstream)
    return calls


def _one_line(capsys, rc, expected_rc, *needles):
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == expected_rc, err
    assert "Traceback" not in "\n".join(err)
    line = err[-1]
    assert line.startswith(f"{PROG}: error: "), err
    for n in needles:
        assert n in line, line
    return line


# -- item 24: hostile arguments ---------------------------------------------------------
@pytest.mark.parametrize("flag, value", [
    ("--image-size", "100000"), ("--workers", "1000"), ("--workers", "-3"),
    ("--seed", "-1"), ("--seed", str(2**70)), ("--seed", str(2**64)),
    ("--min-batches", "0"), ("--batch-size", str(2**40)),
])
def test_a_hostile_profile_argument_is_one_line_before_anything_runs(folder, capsys,
                                                                    no_measuring, flag, value):
    # These were 17-81-line tracebacks from deep in the library, some after measuring.
    argv = ["profile", folder, *QUICK, flag, value]
    line = cli_error(main, PROG, capsys, argv, flag, value)
    assert no_measuring == [], line


def test_a_json_into_a_missing_folder_is_refused_before_measuring(folder, tmp_path, capsys,
                                                                  no_measuring):
    target = tmp_path / "nope" / "p.json"
    cli_error(main, PROG, capsys, ["profile", folder, *QUICK, "--json", str(target)],
              "--json", str(target.parent))
    cli_error(main, PROG, capsys, ["profile", folder, *QUICK, "--json", str(tmp_path)],
              "--json", "folder")
    assert no_measuring == []


def test_a_model_fn_that_fails_on_a_batch_is_one_line(folder, capsys, no_measuring):
    # os.getcwd takes no argument: calling it on a batch is the step's failure, not ours.
    rc = main(["profile", folder, *QUICK[:-2], "--model-fn", "os:getcwd"])
    _one_line(capsys, rc, 1, "--model-fn os:getcwd", "TypeError")


def test_a_model_fn_module_that_fails_to_import_is_one_line(folder, tmp_path, capsys,
                                                           no_measuring):
    bad = tmp_path / "broken_step.py"
    bad.write_text("raise RuntimeError('no GPU here')\ndef step(b):\n    pass\n")
    cli_error(main, PROG, capsys, ["profile", folder, *QUICK[:-2], "--model-fn",
                                   f"{bad}:step"], "--model-fn", "RuntimeError", "no GPU here")
    bad.write_text("def step(b)\n")
    cli_error(main, PROG, capsys, ["profile", folder, *QUICK[:-2], "--model-fn",
                                   f"{bad}:step"], "--model-fn", "SyntaxError")


def test_a_ring_that_does_not_fit_is_one_line_naming_the_flags(folder, capsys):
    # 8 x 60000 x 60000 RGB per slot: refused from its size at start, nothing allocated.
    rc = main(["profile", folder, *QUICK, "--image-size", "60000"])
    _one_line(capsys, rc, 1, "--image-size", "--batch-size")


@pytest.mark.filterwarnings("ignore::echo_native.SampleFailureWarning")
def test_a_folder_whose_every_file_fails_is_one_line(tmp_path, capsys):
    """Every file of the folder fails to decode: the epoch has no batch, and the command
    says so in one line naming the first file (exit 1), not a traceback."""
    root = tmp_path / "broken"
    (root / "a").mkdir(parents=True)
    for i in range(16):
        (root / "a" / f"bad{i:02d}.jpg").write_bytes(b"not a jpeg %d" % i)
    rc = main(["profile", str(root), *QUICK])
    _one_line(capsys, rc, 1, "every one of", "bad")


def test_min_batches_cannot_run_past_the_measuring_deadline(folder, capsys, monkeypatch):
    # A scripted clock, a quarter second per reading: the deadline is reached after a
    # known number of batches, whatever the machine's speed.  Before, a billion batches
    # kept it measuring for days.
    class Clock:
        t = 0.0

        def __call__(self):
            self.t += 0.25
            return self.t
    clock = Clock()
    monkeypatch.setattr(cli, "measure_upstream",
                        functools.partial(profile.measure_upstream, clock=clock))
    rc = main(["profile", folder, *QUICK, "--min-batches", "1000000000"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "--min-batches 1000000000" in err and "not reached" in err, err
    limit = cli.measuring_deadline(0.1)
    assert limit <= clock.t <= limit + 1.0


def test_measure_upstream_stops_at_max_seconds_with_the_batches_it_has(folder):
    import echo_native as en

    readings = []

    def clock():
        readings.append(None)
        return 0.25 * len(readings)
    up, batches = profile.measure_upstream(en.ImageFolder(folder), 8, 32, 1, seconds=0.1,
                                           min_batches=10**9, max_seconds=2.0, clock=clock,
                                           with_batches=True)
    # t0 is the first reading; each batch reads the clock once; 2.0 s is 8 readings on.
    assert batches == 8 and up == pytest.approx(8 * 8 / 2.0)


def test_make_shards_to_a_store_without_credentials_is_one_line(folder, tmp_path, capsys,
                                                                monkeypatch):
    pytest.importorskip("s3fs")
    for var in list(os.environ):
        if var.startswith("AWS_"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-role lookup
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    rc = main(["make-shards", folder, "s3://no-such-bucket-echo/x", "-q"])
    _one_line(capsys, rc, 1, "s3://no-such-bucket-echo/x", "credentials")


def test_hostile_arguments_in_a_real_process_print_one_line(folder, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for args in (["--workers", "1000"], ["--seed", "-1"], ["--image-size", "100000"]):
        p = subprocess.run([sys.executable, "-m", "echo_native", "profile", folder, *QUICK,
                            *args], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                           env=env)
        assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
        assert args[0] in p.stderr


# -- item 23: the JSON, only when asked, atomically, not through links ------------------
def test_profile_writes_no_json_unless_asked(folder, tmp_path, capsys, monkeypatch,
                                             no_measuring):
    monkeypatch.chdir(tmp_path)
    assert main(["profile", folder, *QUICK]) == 0
    assert os.listdir(tmp_path) == []
    assert "JSON" not in capsys.readouterr().out


def test_profile_json_replaces_a_planted_link_and_never_writes_through_it(
        folder, tmp_path, capsys, no_measuring):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    js = tmp_path / "p.json"
    os.symlink(victim, js)
    assert main(["profile", folder, *QUICK, "--json", str(js)]) == 0
    assert victim.read_text() == "keep me"
    assert not js.is_symlink() and json.loads(js.read_text())["batch_size"] == 8
    assert sorted(os.listdir(tmp_path)) == ["p.json", "victim.txt"]  # no temporary left
    assert oct(js.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask

"""The README says what runs: its usage block works pasted into a plain script, the
defaults and flags it names are the code's, and every file it links exists."""
from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys

import echo_native as en

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def _blocks(kind="python"):
    return re.findall(rf"^```{kind}\n(.*?)^```", _readme(), flags=re.S | re.M)


def test_one_usage_block_shows_training_validation_and_echo_around_a_loader():
    """The README has one usage block, with a training ring, a validation ring and an
    EchoLoader around a torch DataLoader, that imports nothing from the lab."""
    (block,) = _blocks()
    for needle in ("en.EchoRing(", "en.CenterCrop(", "en.EchoLoader(", "DataLoader("):
        assert needle in block, needle
    assert "echo_native.lab" not in block


def test_the_usage_block_runs_as_a_plain_script(tmp_path):
    """The usage block, saved as train.py and run with ``python train.py`` from another
    folder (no main guard), exits 0 and prints one line per epoch."""
    script = tmp_path / "train.py"
    script.write_text(_blocks()[0])
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(en.__file__))}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=570, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = proc.stdout.split("\n")
    assert lines[0].split()[:2] == ["0", "128"] and lines[1].split()[:2] == ["1", "128"]


def test_the_quick_start_has_exactly_two_commands():
    """Quick start: one command installs and runs the main job, one installs and runs the
    tests (the second is what CI runs verbatim)."""
    quick = _readme().split("## Quick start", 1)[1]
    (commands,) = re.findall(r"```bash\n(.*?)```", quick, flags=re.S)[:1]
    lines = [line for line in commands.splitlines() if line.strip()]
    assert lines == ['python -m pip install -e ".[bench]" "torch==2.13.0" && echo-native-lab bench',
                     'python -m pip install -e ".[test]" "torch==2.13.0" && python -m pytest']
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert lines[1] in f.read()


def test_the_defaults_the_readme_states_are_the_codes():
    """echo=2.0 before augmentation, batch_size=256, on_error="replace", uint8 output:
    what the README says a user meets first is what EchoRing does."""
    text = _readme()
    params = inspect.signature(en.EchoRing).parameters
    assert "`echo=2.0`" in text and params["echo"].default == 2.0
    assert '(`placement="before_augment"`)' in text and en.Echo().placement == "before_augment"
    assert "`batch_size=256`" in text and params["batch_size"].default == 256
    assert '`on_error="replace"`' in text and params["on_error"].default == "replace"
    assert "uint8 NHWC images" in text and params["output"].default is None
    assert en.Workers().count is None  # "the CPUs the process may use"


def test_the_examples_accept_the_flags_the_readme_gives_them():
    """Each example named in the README takes --data, --val-data and --steps."""
    text = _readme()
    for name in ("train_torch.py", "train_jax.py", "custom_loop_numpy.py"):
        assert name in text
        with open(os.path.join(ROOT, "examples", name)) as f:
            source = f.read()
        for flag in ("--data", "--val-data", "--steps"):
            assert f'"{flag}"' in source, (name, flag)


def test_every_link_and_path_in_the_readme_exists():
    """Every docs/ link, tool and benchmark the README names is in the tree."""
    text = _readme()
    paths = set(re.findall(r"\]\(((?:docs|tools|benchmarks|examples)/[^)#]+)\)", text))
    paths |= set(re.findall(r"`((?:tools|benchmarks|examples|src)/[\w./-]+\.\w+)`", text))
    paths |= set(re.findall(r"(benchmarks/bench_\w+\.py)", text))
    assert paths
    for path in sorted(paths):
        assert os.path.exists(os.path.join(ROOT, path)), path


def test_the_readme_is_a_front_door():
    """The README stays short (about 200 lines); the details live in docs/."""
    assert len(_readme().splitlines()) <= 200

"""examples/train_detection_torch.py runs as a user starts it and trains torchvision's
SSDlite on a generated COCO-format folder through EchoRing with echo.

It needs torchvision whose compiled ops load (the detection model and its losses use
them): ``.ci/run``'s step "torchvision: reference tests" runs this folder in a venv of
its own; elsewhere the module skips (``tv_reference``).
"""
from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import tv_reference  # noqa: F401 - the module-level skip where torchvision cannot load

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_detection_torch.py"
STEP = re.compile(r"^step (\d+): loss (\S+) ", re.MULTILINE)
STEPS = 3


def run(args, cwd, timeout=480):
    """A fresh interpreter from ``cwd``, its process group killed on a timeout:
    (exit code, output)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, *map(str, args)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{EXAMPLE.name} did not finish in {timeout} s:\n"
                             + out.decode(errors="replace")[-4000:]) from None
    return proc.returncode, out.decode(errors="replace")


def test_detection_example_trains_with_finite_losses(tmp_path):
    """The example exits 0 after the steps asked for, each printing a finite loss, and
    ends with its done line (no sample failed)."""
    rc, out = run([EXAMPLE, "--steps", STEPS, "--batch-size", 4, "--images", 16,
                   "--workers", 2], cwd=tmp_path)
    assert rc == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    steps = STEP.findall(out)
    assert [int(s) for s, _ in steps] == list(range(1, STEPS + 1)), out[-4000:]
    losses = [float(v) for _, v in steps]
    assert all(math.isfinite(v) and v > 0 for v in losses), losses
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"done: {STEPS} steps") and last.endswith("failures 0"), last

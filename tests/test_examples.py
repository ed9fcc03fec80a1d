"""The scripts in examples/ run as users start them: ``python examples/x.py ...``, torchrun.

Each runs in a fresh interpreter from a temporary working directory, on a small
ImageFolder of real photographs (three classes of eight JPEGs) built here, for
a few steps.  The examples have no main guard, like most training scripts, so
these runs also check that EchoRing's workers never execute the script.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from photos import fit, photo

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = ("train_torch.py", "train_jax.py", "custom_loop_numpy.py")
CLASSES = ("astronaut", "coffee", "chelsea")
PER_CLASS = 8
N = len(CLASSES) * PER_CLASS  # 24
B = 4                          # 6 batches per epoch, none short
SMALL = ["--image-size", "32", "--batch-size", str(B)]
DONE = re.compile(r"done: (\d+) steps, (\d+) fresh images, (\d+) delivered")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """An ImageFolder: one class per photograph, eight different crops of it at varied sizes."""
    root = tmp_path_factory.mktemp("example-data")
    for name in CLASSES:
        img = photo(name)
        h, w = img.shape[:2]
        (root / name).mkdir()
        for i in range(PER_CLASS):
            top, left = (i % 3) * h // 8, (i // 3) * w // 8
            arr = fit(img[top:top + h * 5 // 8, left:left + w * 5 // 8], 40 + 4 * i, 56)
            Image.fromarray(arr).save(root / name / f"{i:02d}.jpg", quality=90)
    return root


def run(args, cwd, timeout=240):
    """Run a command as a user would (no torchrun variables inherited); (exit code, output)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.Popen([str(a) for a in args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{args} did not finish in {timeout} s:\n"
                    + out.decode(errors="replace")[-4000:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out.decode(errors="replace")


def example(script, *args, cwd):
    return run([sys.executable, EXAMPLES / script, *args], cwd)


def finished(rc, out, steps):
    """The run exited 0 without a traceback and ended with the done line: (fresh, delivered)."""
    assert rc == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    last = out.strip().splitlines()[-1]
    m = DONE.match(last)
    assert m, f"last line is not the done line: {last!r}\n{out[-3000:]}"
    assert int(m.group(1)) == steps, last
    return int(m.group(2)), int(m.group(3))


def val_accuracy(out):
    """The final top-1; it must be a whole number of the N validation images."""
    acc = float(re.search(r"val top-1 ([0-9.]+)\s*$", out.strip()).group(1))
    assert 0.0 <= acc <= 1.0
    assert abs(acc * N - round(acc * N)) < 1e-3 * N, acc  # printed with 3 decimals
    return acc


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- every example -------------------------------------------------------------------------
@pytest.mark.parametrize("script", [  # JAX's import takes seconds: slow with test_jax_example
    pytest.param(s, marks=pytest.mark.slow) if s == "train_jax.py" else s for s in SCRIPTS])
def test_example_is_a_plain_script_with_help(script, tmp_path):
    """No main guard (the way users write them), a docstring that says how to run it, --help."""
    text = (EXAMPLES / script).read_text()
    assert not re.search(r"^if __name__ ==", text, re.MULTILINE)
    doc = text.split('"""')[1]
    assert f"python examples/{script}" in doc
    if script == "train_torch.py":
        assert "torchrun --nproc_per_node=2 examples/train_torch.py" in doc
    if script == "train_jax.py":
        pytest.importorskip("jax")
    rc, out = example(script, "--help", cwd=tmp_path)
    assert rc == 0, out
    assert out.startswith("usage:") and "--steps" in out and "--echo" in out


def test_detection_example_without_torchvision_says_where_it_runs(tmp_path):
    """Where torchvision does not load (the README's venv: not installed, or PyPI's build
    beside a CPU torch), the detection example ends in one line naming the venv recipe
    that runs it, not a traceback."""
    try:
        from torchvision.models.detection import ssdlite320_mobilenet_v3_large  # noqa: F401
    except (ImportError, RuntimeError, OSError):
        pass
    else:
        pytest.skip("torchvision loads here: tests/torchvision_ref runs the example")
    rc, out = example("train_detection_torch.py", "--steps", "1", cwd=tmp_path)
    assert rc == 1, out
    assert "Traceback" not in out, out
    assert "needs torchvision" in out and "'torchvision==0.29.1'" in out, out
    assert len(out.strip().splitlines()) == 1, out


# ---- PyTorch -------------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("echo,placement", [("2", "before_augment"),
                                             pytest.param("auto", "batch", marks=pytest.mark.slow)])
def test_torch_example(data, tmp_path, echo, placement):
    pytest.importorskip("torch")
    rc, out = example("train_torch.py", "--data", data, "--steps", 3, *SMALL, "--workers", 2,
                      "--echo", echo, "--placement", placement, cwd=tmp_path)
    fresh, delivered = finished(rc, out, 3)
    assert delivered == 3 * B and 0 < fresh <= N
    assert "world size 1 (one process)" in out
    assert re.search(r"^epoch 0: step 3, loss [0-9.]+, val top-1", out, re.MULTILINE), out
    val_accuracy(out)


@pytest.mark.slow   # three trainings (the ring's own resume: test_distributed, test_elastic)
@pytest.mark.timeout(300)
def test_torch_checkpoint_and_resume(data, tmp_path):
    """--steps stops and saves; --resume continues the same fresh stream, across an epoch."""
    torch = pytest.importorskip("torch")
    ckpt = tmp_path / "ckpt.pt"
    common = ["--data", data, *SMALL, "--workers", 1, "--echo", 1, "--checkpoint", ckpt]

    rc, out = example("train_torch.py", *common, "--steps", 3, cwd=tmp_path)
    assert finished(rc, out, 3) == (3 * B, 3 * B)
    first = torch.load(ckpt)
    assert (first["epoch"], first["step"]) == (0, 3)
    # three batches of the fresh stream (the loader's position, nested in the stage's)
    assert [r["parent"]["ticket"] for r in first["ring"]] == [3]
    assert set(first) >= {"model", "optimizer"}

    rc, out = example("train_torch.py", *common, "--steps", 5, "--resume", cwd=tmp_path)
    assert f"resumed from {ckpt}: epoch 0, step 3" in out
    # Two more steps, and only two more batches read: the stream went on, not restarted.
    assert finished(rc, out, 5) == (2 * B, 2 * B)
    second = torch.load(ckpt)
    assert (second["epoch"], second["step"]) == (0, 5)
    assert [r["parent"]["ticket"] for r in second["ring"]] == [5]
    assert not torch.equal(second["model"]["fc.weight"], first["model"]["fc.weight"])

    rc, out = example("train_torch.py", *common, "--steps", 8, "--resume", cwd=tmp_path)
    assert "epoch 0, step 5" in out
    assert finished(rc, out, 8) == (3 * B, 3 * B)  # the last batch of epoch 0, two of epoch 1
    assert re.search(r"^epoch 0: step 6,", out, re.MULTILINE), out
    assert re.search(r"^epoch 1: step 8,", out, re.MULTILINE), out
    third = torch.load(ckpt)
    assert (third["epoch"], third["step"]) == (1, 8)
    assert [r["parent"]["ticket"] for r in third["ring"]] == [8]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torch_resume_with_echo(data, tmp_path):
    """With echo the saved position is the oldest batch with examples still unsent."""
    torch = pytest.importorskip("torch")
    ckpt = tmp_path / "ckpt.pt"
    common = ["--data", data, *SMALL, "--workers", 2, "--echo", 2, "--checkpoint", ckpt]
    rc, out = example("train_torch.py", *common, "--steps", 4, cwd=tmp_path)
    finished(rc, out, 4)
    state = torch.load(ckpt)["ring"][0]
    assert state["echo"] == 2.0 and state["skip"]  # emitted examples of batches not done yet
    rc, out = example("train_torch.py", *common, "--steps", 9, "--resume", cwd=tmp_path)
    assert "epoch 0, step 4" in out
    finished(rc, out, 9)
    assert torch.load(ckpt)["step"] == 9


@pytest.mark.slow   # a real torchrun of the library: test_distributed.py
@pytest.mark.timeout(300)
def test_torch_example_under_torchrun(data, tmp_path):
    """torchrun, two ranks, gloo: DDP, one printer, every rank's ring position saved."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torch.distributed.run")
    ckpt = tmp_path / "ddp.pt"
    rc, out = run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                   "--nproc_per_node=2", f"--master_port={free_port()}",
                   EXAMPLES / "train_torch.py", "--data", data, "--steps", 3, *SMALL,
                   "--workers", 1, "--checkpoint", ckpt], cwd=tmp_path)
    fresh, delivered = finished(rc, out, 3)
    assert "world size 2 (DDP, gloo)" in out
    assert len(DONE.findall(out)) == 1 and out.count("epoch 0: step 3") == 1  # rank 0 only
    assert delivered == 3 * B and fresh <= N // 2  # rank 0 reads only its half
    val_accuracy(out)  # summed over both ranks' shares: a whole number of all N images
    saved = torch.load(ckpt)
    assert saved["step"] == 3
    assert [(r["parent"]["rank"], r["parent"]["world_size"]) for r in saved["ring"]] == \
        [(0, 2), (1, 2)]


# ---- JAX -----------------------------------------------------------------------------------
@pytest.mark.slow   # an example training (JAX's import and compile take seconds)
@pytest.mark.timeout(300)
def test_jax_example(data, tmp_path):
    pytest.importorskip("jax")
    rc, out = example("train_jax.py", "--data", data, "--steps", 3, *SMALL, "--workers", 2,
                      cwd=tmp_path)
    fresh, delivered = finished(rc, out, 3)
    assert delivered == 3 * B and 0 < fresh <= N
    assert re.search(r"^epoch 0: step 3, loss [0-9.]+, val top-1", out, re.MULTILINE), out
    val_accuracy(out)


# ---- NumPy, the bare loop ------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("echo", ["1", "2"])
def test_numpy_custom_loop(data, tmp_path, echo):
    steps = 8  # 32 deliveries from 24 images: with echo 2 some must be repeats
    rc, out = example("custom_loop_numpy.py", "--data", data, "--steps", steps, "--echo", echo,
                      "--batch-size", B, "--step-ms", 1, "--workers", 1, cwd=tmp_path)
    fresh, delivered = finished(rc, out, steps)
    assert delivered == steps * B
    repeats = int(re.search(r"(\d+) repeats", out).group(1))
    if echo == "1":
        assert repeats == 0 and fresh == delivered  # epoch 0 and the first batches of epoch 1
    else:
        assert repeats >= delivered - N and repeats > 0
        assert fresh <= N  # one epoch of fresh data was enough for 32 deliveries
    for key in ("fresh_per_s", "delivered_per_s", "effective_echo", "echo_factor",
                "estimated_R", "stall_s", "ring_occupancy", "failures"):
        assert re.search(rf"^  {key} ", out, re.MULTILINE), key
    assert re.search(r"^  failures +\{\}$", out, re.MULTILINE)  # every photo decodes

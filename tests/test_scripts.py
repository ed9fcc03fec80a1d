"""EchoRing works wherever a training loop lives, started the way users start it.

Each test writes a small training script *without* a main guard, with a source
class (holding a lambda) defined in the script itself, and runs it in a fresh
interpreter: ``python train.py``, ``python -c``, ``python - < file``,
``python -m pkg.mod``, IPython, a Jupyter notebook (through nbclient and a real
ipykernel).  Worker processes must never run the user's ``__main__`` (which would
build a second ring in every worker), and the script-defined class must reach
them by value.  Ctrl-C that the loop catches must neither kill the workers nor
lose a sample.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from PIL import Image

import echo_native as en
from photos import fit, photo

TESTS = os.path.dirname(os.path.abspath(__file__))
N = 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Real-photo JPEGs in one class folder."""
    root = tmp_path_factory.mktemp("script-data")
    (root / "a").mkdir()
    for i, name in enumerate(["astronaut", "coffee", "chelsea", "rocket"] * 3):
        arr = fit(photo(name), 60 + 4 * i, 80)
        Image.fromarray(arr).save(root / "a" / f"{i:02d}.jpg", quality=90)
    return root


def _script(folder, body="", mode="process", echo=2, slow=0.0, workers=2):
    """A training script as a user writes it: no main guard, its own source class."""
    return textwrap.dedent(f"""\
        import glob, os, signal, sys, time
        import numpy as np
        import echo_native as en

        class Files:
            # defined here, in __main__: reaches the workers by value
            def __init__(self, paths):
                self.paths = paths
                self.labels = np.arange(len(paths)) % 3
                # a lambda, too (slow > 0 stands for a slow upstream)
                self.load = lambda p: (time.sleep({slow}), open(p, "rb").read())[1]
            def __len__(self):
                return len(self.paths)
            def read(self, i):
                return self.load(self.paths[i])
            def describe(self, i):
                return self.paths[i]

        paths = sorted(glob.glob(os.path.join({str(folder)!r}, "*", "*.jpg")))
        ring = en.EchoRing(Files(paths), 4, augment=en.RandomResizedCrop(32), echo={echo},
                           workers={workers}, worker_mode={mode!r}, seed=1)
        seen = []
        with ring:
            pids = ring.loader.worker_pids()
    """) + textwrap.indent(textwrap.dedent(body or """\
        for batch in ring:
            seen += [int(s) for s, f in zip(batch.sample_ids, batch.fresh) if f]
    """), "    ") + textwrap.dedent("""\
            same_workers = pids == ring.loader.worker_pids()
            restarts = ring.stats()["worker_restarts"]
        assert sorted(seen) == list(range(len(paths))), sorted(seen)
        print("RESULT", len(seen), restarts, same_workers)
    """)


def _as_in_a_terminal():
    """A script started from a terminal gets Ctrl-C at its default; a background job of a
    non-interactive shell (how some CI runners start the tests) inherits it ignored, and
    Python then installs no KeyboardInterrupt handler at all."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _run(args, cwd, stdin=None, **kw):
    proc = subprocess.run(args, cwd=cwd, input=stdin, capture_output=True, text=True,
                          timeout=240, preexec_fn=_as_in_a_terminal, **kw)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return proc.stdout


def _result(out):
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT")][-1]
    _, n, restarts, same = line.split()
    return int(n), int(restarts), same == "True"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["script", "dash-c", "stdin", "module"])
def test_plain_script_without_main_guard(folder, tmp_path, how):
    """python train.py / -c / - < file / -m pkg.mod: one full epoch, nothing re-run in the
    workers (a re-run would start more rings and print more than one RESULT)."""
    code = _script(folder)
    if how == "script":
        (tmp_path / "train.py").write_text(code)
        out = _run([sys.executable, "train.py"], tmp_path)
    elif how == "dash-c":
        out = _run([sys.executable, "-c", code], tmp_path)
    elif how == "stdin":
        out = _run([sys.executable, "-"], tmp_path, stdin=code)
    else:
        (tmp_path / "pkg").mkdir()
        (tmp_path / "pkg" / "__init__.py").write_text("")
        (tmp_path / "pkg" / "mod.py").write_text(code)
        out = _run([sys.executable, "-m", "pkg.mod"], tmp_path)
    assert out.count("RESULT") == 1
    assert _result(out) == (N, 0, True)


@pytest.mark.timeout(300)
def test_ipython_session(folder, tmp_path):
    """The same loop typed into IPython (its __main__ is an interactive namespace)."""
    (tmp_path / "train.py").write_text(_script(folder))
    out = _run([sys.executable, "-m", "IPython", "--quick", "--no-banner", "--colors=NoColor",
                "-c", "%run -i train.py"], tmp_path)
    assert _result(out) == (N, 0, True)


@pytest.mark.slow  # starts a Jupyter kernel
@pytest.mark.timeout(300)
def test_jupyter_notebook(folder, tmp_path):
    """A notebook executed for real by nbclient on an ipykernel: a source class defined in
    a cell reaches the workers, and a second cell iterates the same ring again."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    code = _script(folder)
    cells = [nbformat.v4.new_code_cell(code),
             nbformat.v4.new_code_cell("ring.start()\n"
                                       "again = sum(len(b) for b in ring)\n"
                                       "ring.close()\n"
                                       "print('AGAIN', again)")]
    nb = nbformat.v4.new_notebook(cells=cells)
    nbclient.NotebookClient(nb, timeout=200, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    out = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert _result(out) == (N, 0, True)
    assert f"AGAIN {2 * N}" in out  # echo=2: every example twice


# The user's step, which the signal interrupts: short sleeps, so that a signal handled by
# another thread (Python runs the handler in the main thread between bytecodes) ends it
# too; a minute without one fails the script.
_STEP_UNTIL_SIGNAL = """\
t_end = time.monotonic() + 60
while time.monotonic() < t_end:
    time.sleep(0.01)
raise AssertionError("no KeyboardInterrupt within 60 s")
"""

_CTRL_C_BODY = """\
    interrupted = taken = 0
    while True:
        try:
            for batch in ring:
                seen += [int(s) for s, f in zip(batch.sample_ids, batch.fresh) if f]
                taken += 1
                if taken in (1, 2) and interrupted < taken:
                    interrupted += 1
                    {send}
                    {step}
            break
        except KeyboardInterrupt:
            print("caught Ctrl-C", file=sys.stderr)
    assert interrupted == 2, interrupted
"""


def _ctrl_c_body(send, step=_STEP_UNTIL_SIGNAL):
    """The loop of _CTRL_C_BODY with ``send`` (how the signal is sent) and ``step``."""
    pad = "\n" + " " * 20
    return _CTRL_C_BODY.format(send=send, step=pad.join(step.strip().splitlines()))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["process", "thread"])
@pytest.mark.parametrize("echo", [1, 2])
def test_caught_ctrl_c_keeps_workers_and_samples(folder, tmp_path, mode, echo):
    """SIGINT to the whole process group (a terminal's or Jupyter's Ctrl-C), caught by the
    loop: the same workers go on, no restart is counted, every sample is delivered once."""
    body = _ctrl_c_body("os.killpg(os.getpgrp(), signal.SIGINT)")
    (tmp_path / "train.py").write_text(_script(folder, body, mode=mode, echo=echo))
    out = _run([sys.executable, "train.py"], tmp_path, start_new_session=True)
    assert _result(out) == (N, 0, True)


@pytest.mark.timeout(300)
def test_ctrl_c_while_the_consumer_waits(folder, tmp_path):
    """Ctrl-C while the consumer is blocked on a slow upstream: caught, iteration goes on."""
    # A thread sends the signal once the consumer sleeps in the ring's wait for the next
    # batch (echo=1: every batch waits for the slow worker), so it lands in that wait.
    body = (f"sys.path.insert(0, {str(TESTS)!r})\n"
            "import threading\nimport ring_helpers as rh\n"
            "def interrupt_when_waiting(name):\n"
            "    rh.wait_for(lambda: rh.asleep_on_ring(os.getpid(), ring_name=name),\n"
            "                'the consumer asleep in the ring')\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            + textwrap.dedent(_ctrl_c_body(
                "threading.Thread(target=interrupt_when_waiting,\n"
                "                 args=(ring.loader.ring_name,)).start()",
                "pass  # the signal arrives while the ring waits for the next batch")))
    (tmp_path / "train.py").write_text(_script(folder, body, echo=1, slow=0.15, workers=1))
    out = _run([sys.executable, "train.py"], tmp_path, start_new_session=True)
    assert _result(out)[1:] == (0, True)


def test_uncaught_ctrl_c_cleans_up(folder, tmp_path):
    """An uncaught Ctrl-C ends the script with KeyboardInterrupt and leaves no worker and
    no shared-memory segment behind."""
    body = "for batch in ring:\n    os.kill(os.getpid(), signal.SIGINT)\n" + \
        textwrap.indent(_STEP_UNTIL_SIGNAL, "    ")
    code = _script(folder, body).replace("seen = []", "seen = []\nprint('NAME', end=' ')")
    code = code.replace("pids = ring.loader.worker_pids()",
                        "pids = ring.loader.worker_pids()\n"
                        "    print(ring.loader.ring_name, *pids, flush=True)")
    (tmp_path / "train.py").write_text(code)
    proc = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, start_new_session=True,
                          preexec_fn=_as_in_a_terminal)
    assert proc.returncode != 0
    assert proc.stderr.rstrip().splitlines()[-1] == "KeyboardInterrupt", proc.stderr[-2000:]
    import ring_helpers as rh

    words = proc.stdout.split()
    name, pids = words[1], [int(p) for p in words[2:4]]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # A memfd ring: no process holds its memory (descriptor or mapping), and nothing
    # of the script's is in /dev/shm.
    assert name.startswith("/memfd:echo_native-"), name
    assert rh.memfd_holders(name[len("/memfd:"):]) == {}
    script_pid = name.split("-")[1]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"echo_native-{script_pid}-")]


def test_source_that_cannot_reach_workers_fails_at_construction(folder):
    """A source holding a lock is refused when the ring is built, with what to do."""
    import threading

    class Locked(en.Samples):
        def __init__(self, blobs):
            super().__init__(blobs)
            self.lock = threading.Lock()

    blobs = [open(p, "rb").read() for p in sorted(folder.glob("a/*.jpg"))]
    with pytest.raises(TypeError, match=r"cannot be sent to worker processes .*"
                                        r"worker_mode='thread'"):
        en.EchoRing(Locked(blobs), 4, workers=1)
    ring = en.EchoRing(Locked(blobs), 4, workers=1, worker_mode="thread", echo=1)
    with ring:
        assert sum(len(b) for b in ring) == len(blobs)


def test_workers_never_import_the_main_module(folder, tmp_path):
    """A script that counts its own executions: run once, whatever the workers do."""
    marker = tmp_path / "runs.txt"
    code = f"open({str(marker)!r}, 'a').write('x')\n" + _script(folder)
    (tmp_path / "train.py").write_text(code)
    _run([sys.executable, "train.py"], tmp_path)
    assert marker.read_text() == "x"


def test_batch_echo_resumes_after_an_interrupted_iteration(folder):
    """Leaving the loop early and iterating again finishes the epoch without losing the
    batches the echo window held (batch placement)."""
    src = en.ImageFolder(folder)
    ring = en.EchoRing(src, 2, echo=en.Echo(2, placement="batch"), workers=1,
                       augment=en.RandomResizedCrop(16))
    fresh = []
    with ring:
        for i, b in enumerate(ring):
            fresh += [int(s) for s, f in zip(b.sample_ids, b.fresh) if f]
            if i == 2:
                break
        for b in ring:
            fresh += [int(s) for s, f in zip(b.sample_ids, b.fresh) if f]
    assert sorted(fresh) == list(range(len(src)))
    np.testing.assert_array_equal(np.unique(fresh), np.arange(len(src)))

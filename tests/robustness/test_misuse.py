"""Misuse of a ring from the consumer's side: forks, threads, stale iterators, pickling,
edited states, and the wrong thing where a source belongs.

Each test reproduces an attack of the red team's third round (issue 31: items 1, 6, 7,
10 and 11) or the front-door findings of issue 30, the way a user would run into it.
"""
from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest

import echo_native as en

WAIT_S = 60  # a guard against a hang, never a measure of speed


def _ring(root, **kw):
    kw = {"batch_size": 8, "image_size": 16, "workers": 1, "echo": 1, "timeout": 60, **kw}
    return en.EchoRing(en.ImageFolder(root), **kw)


def _run(script, *args):
    """Run a script as a user would (``python script.py``), importing the same echo_native
    as this test."""
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(en.__file__))}
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True,
                          text=True, timeout=WAIT_S * 2, env=env)


def _wait_until(condition, what):
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.005)


# ---- forks ---------------------------------------------------------------------------
_FORK_SCRIPT = """
import os, sys, warnings
import echo_native as en
warnings.simplefilter("error", RuntimeWarning)  # "worker died; restarting it" fails the run
ring = en.EchoRing(en.ImageFolder(sys.argv[1]), batch_size=4, image_size=16, workers=2,
                   echo=1, shuffle=False, timeout=60)
it = iter(ring)
ids = [next(it).sample_ids.copy() for _ in range(4)]
pid = os.fork()
if pid == 0:
    # What an evaluation or checkpoint helper does: use the ring (refused), then exit
    # normally, which runs every finalizer of the copied interpreter.
    try:
        next(iter(ring))
    except RuntimeError as e:
        print("child refused:", e, flush=True)
    sys.exit(0)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0
ids += [b.sample_ids.copy() for b in it]
ids = sorted(int(i) for b in ids for i in b)
assert ids == list(range(len(ring.loader.source))), ids
assert ring.stats()["worker_restarts"] == 0
ring.close()
print("parent ok", len(ids), flush=True)
"""


def test_a_forked_child_that_exits_normally_leaves_the_parents_ring_alone(corpus_root,
                                                                          tmp_path):
    """A child made by os.fork() that ends with sys.exit neither stops the parent's
    workers nor reads its ring: the parent finishes its epoch with every sample once."""
    script = tmp_path / "fork.py"
    script.write_text(_FORK_SCRIPT)
    r = _run(script, corpus_root)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "child refused: this Loader was started in process" in r.stdout
    assert "parent ok 48" in r.stdout


# ---- concurrent and stale iteration ---------------------------------------------------
class _Gated:
    """A source whose reads wait for a gate: a consumer asking for a batch then waits
    inside next() for as long as the test wants."""

    def __init__(self, root):
        self.inner = en.ImageFolder(root)
        self.labels = self.inner.labels
        self.gate = threading.Event()

    def __len__(self):
        return len(self.inner)

    def read(self, i):
        if not self.gate.wait(WAIT_S):
            raise OSError("gate never opened")
        return self.inner.read(i)

    def describe(self, i):
        return self.inner.describe(i)


@pytest.mark.parametrize("echo", [1, 2])
def test_two_threads_iterating_one_ring_get_an_error_not_duplicates(corpus_root, echo):
    """A second thread asking for a batch while another is inside next() is refused with a
    clear error; nothing is delivered twice and the ring goes on to a whole next epoch."""
    source = _Gated(corpus_root)
    ring = en.EchoRing(source, batch_size=8, image_size=16, workers=1, echo=echo,
                       worker_mode="thread", timeout=WAIT_S)
    with ring:
        first = iter(ring)
        got, errors = [], []
        waiter = threading.Thread(target=lambda: got.append(next(first).copy()))
        waiter.start()
        _wait_until(ring._iteration._lock.locked, "the first thread is inside next()")
        with pytest.raises(RuntimeError, match="being iterated by another thread"):
            next(iter(ring))
        source.gate.set()
        waiter.join(WAIT_S)
        assert len(got) == 1 and not errors
        ids = list(got[0].sample_ids[got[0].fresh])
        ids += [int(i) for b in first for i in b.sample_ids[b.fresh]]
        assert sorted(ids) == list(range(len(source)))
        # The ring stays usable: the next epoch is whole.
        ids = [int(i) for b in ring for i in b.sample_ids[b.fresh]]
        assert sorted(ids) == list(range(len(source)))


def test_a_new_iteration_takes_over_from_an_abandoned_one(corpus_root):
    """Iterating again while an older iterator is still alive continues the stream; the
    old iterator then refuses to read on instead of delivering samples a second time."""
    with _ring(corpus_root, echo=2) as ring:
        old = iter(ring)
        seen = [int(i) for i in next(old).sample_ids]
        for batch in ring:
            seen += [int(i) for i in batch.sample_ids]
        with pytest.raises(RuntimeError, match="superseded"):
            next(old)
        assert len(seen) == 2 * len(ring.loader.source)
        assert np.bincount(seen).tolist() == [2] * len(ring.loader.source)


def test_an_iterator_taken_before_close_does_not_restart_the_workers(corpus_root):
    """close() finishes the iterators taken before it: the next next() raises and no
    worker starts; iterating the ring anew starts again where the stream stood."""
    ring = _ring(corpus_root)
    it = iter(ring)
    next(it)
    ring.close()
    with pytest.raises(RuntimeError, match="closed"):
        next(it)
    assert ring.loader.ring is None and ring.loader.worker_pids() == []
    with ring:
        assert sum(len(b) for b in ring) == len(ring.loader.source) - 8


def test_a_ring_refuses_to_be_pickled_and_says_what_to_send_instead(corpus_root):
    """pickle.dumps of a ring or loader is a TypeError that says to send the source and
    the specs, not "cannot pickle 'module' object"."""
    ring = _ring(corpus_root)
    for obj in (ring, ring.loader):
        with pytest.raises(TypeError, match="source and specs"):
            pickle.dumps(obj)
    ring.close()


# ---- states and epochs ---------------------------------------------------------------
@pytest.mark.parametrize("key, value", [("shuffle", False), ("drop_last", True), ("pad", False)])
def test_a_state_saved_with_other_settings_is_refused_by_name(corpus_root, key, value):
    """A state saved with another shuffle, drop_last or pad setting is a ValueError naming
    the setting (it would read some samples twice and others never)."""
    kw = {"shuffle": True, "drop_last": False, "shard": en.Shard(pad=True)}
    other = dict(kw)
    other["shard" if key == "pad" else key] = en.Shard(pad=value) if key == "pad" else value
    with _ring(corpus_root, **other) as saved:
        next(iter(saved))
        state = saved.state_dict()
    ring = _ring(corpus_root, **kw)
    with pytest.raises(ValueError, match=f"{key}={state['parent'][key]}"):
        ring.load_state_dict(state)
    ring.close()


@pytest.mark.parametrize("ticket", [-1, 2**63, 1.5, "3", True, None, 2.0])
def test_a_state_with_a_bad_ticket_is_refused_by_name(corpus_root, ticket):
    """A ticket that is not a non-negative integer of a real job is a ValueError naming
    'ticket', at load time (never a raw OverflowError, nor a failure later)."""
    ring = _ring(corpus_root)
    state = ring.state_dict()
    state["parent"]["ticket"] = ticket
    with pytest.raises(ValueError, match=r"state\['parent'\]\['ticket'\]"):
        ring.load_state_dict(state)
    with pytest.raises(ValueError, match=r"state\['parent'\]\['ticket'\]"):
        en.merge_states([state])
    with pytest.raises(TypeError, match="load_state_dict takes"):
        ring.load_state_dict("state.pt")
    ring.close()


@pytest.mark.parametrize("epoch, error", [(1.5, TypeError), ("2", TypeError), (True, TypeError),
                                          (-1, ValueError), (2**62, ValueError)])
def test_set_epoch_refuses_what_is_not_an_epoch(corpus_root, epoch, error):
    """set_epoch(1.5) or set_epoch('2') is refused by name, never a partial epoch or a
    string comparison; the ring then still reads a whole epoch."""
    with _ring(corpus_root) as ring:
        with pytest.raises(error, match="epoch"):
            ring.set_epoch(epoch)
        with pytest.raises(error, match="epoch"):
            ring.loader.set_epoch(epoch)
        ring.set_epoch(np.int64(1))
        assert sum(len(b) for b in ring) == len(ring.loader.source)


# ---- the front door ------------------------------------------------------------------
def test_a_folder_path_where_a_source_belongs_is_an_image_folder(corpus_root):
    """EchoRing("/data/train") reads the folder as en.ImageFolder (str and PathLike)."""
    for path in (str(corpus_root), corpus_root):
        with en.EchoRing(path, batch_size=8, image_size=16, workers=1, echo=1,
                         shuffle=False) as ring:
            assert isinstance(ring.loader.source, en.ImageFolder)
            assert sum(len(b) for b in ring) == 48


@pytest.mark.parametrize("cls", [en.EchoRing, en.Loader])
def test_what_is_not_a_source_is_refused_at_construction(corpus_root, tmp_path, cls):
    """A missing path, a file path, or an object that is not a source is refused when the
    ring is made, naming the argument and the sources there are; no worker starts."""
    with pytest.raises(FileNotFoundError, match="does not exist"):
        cls(str(tmp_path / "no-such-folder"), batch_size=8)
    listing = tmp_path / "train.csv"
    listing.write_text("a.jpg,0\n")
    with pytest.raises(TypeError, match=r"en\.FileList"):
        cls(str(listing), batch_size=8)
    for thing in (object(), [b"jpeg bytes"], 42, {"a": 1}):
        with pytest.raises(TypeError, match=r"source must be en\.ImageFolder"):
            cls(thing, batch_size=8)


def test_a_bad_file_is_warned_about_once_and_summed_up_each_epoch(corpus_root, tmp_path):
    """A non-image named .jpg is named in one warning (its path, no object address), not
    once per epoch; every epoch with failures ends with one summary that counts it."""
    root = tmp_path / "data"
    shutil.copytree(corpus_root, root)
    bad = root / sorted(os.listdir(root))[0] / "zz-not-an-image.jpg"
    bad.write_bytes(b"this is a text file, not a JPEG" * 10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with en.EchoRing(en.ImageFolder(root), batch_size=7, image_size=16, workers=1,
                         echo=2, timeout=60) as ring:
            for _ in range(3):
                for _ in ring:
                    pass
    messages = [str(w.message) for w in caught if issubclass(w.category, en.SampleFailureWarning)]
    named = [m for m in messages if "zz-not-an-image.jpg" in m]
    summaries = [m for m in messages if m.startswith("epoch ")]
    assert len(named) == 1 and "not an image" in named[0], messages
    assert not any(" at 0x" in m for m in messages), messages
    assert [m.split(":")[0] for m in summaries] == ["epoch 0", "epoch 1", "epoch 2"], messages
    assert "1 of files already named" in summaries[1], summaries
    assert ring.stats()["failures"] == {"decode": 3}


_SCRIPT_WARNINGS = """
import sys, warnings
import echo_native as en
ring = en.EchoRing(en.ImageFolder(sys.argv[1]), batch_size=7, image_size=16, workers=1, echo=1, timeout=60)
with ring:
    for _ in range(3):
        for _ in ring:
            pass
"""


def test_a_plain_script_prints_one_warning_per_bad_file(corpus_root, tmp_path):
    """Run as a user runs it (a plain script, Python's default warning filters): the bad
    file's warning is printed once over three epochs, plus one summary per epoch."""
    root = tmp_path / "data"
    shutil.copytree(corpus_root, root)
    (root / sorted(os.listdir(root))[0] / "broken.jpg").write_bytes(b"plain text, not a JPEG")
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT_WARNINGS)
    r = _run(script, root)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "SampleFailureWarning" in line]
    assert sum("broken.jpg" in line for line in lines) == 1, r.stderr
    assert sum("sample(s) failed" in line for line in lines) == 3, r.stderr
    assert " at 0x" not in r.stderr


class _MostlyBroken:
    """40 samples of which only every tenth decodes: a failed sample's 16 stand-ins all
    fail often enough that some samples are dropped, others replaced."""

    def __init__(self, root):
        self.good = en.ImageFolder(root)
        self.labels = np.zeros(40, np.int64)

    def __len__(self):
        return 40

    def read(self, i):
        return self.good.read(i) if i % 10 == 0 else b"not an image " + bytes([i])

    def describe(self, i):
        return f"sample-{i}.jpg"


def test_each_failure_warning_says_what_happened_to_its_sample(corpus_root):
    """With on_error="replace", a failed sample whose stand-ins all failed too is warned
    about as dropped, one that was replaced as replaced: the counts match the batches
    (rows that are stand-ins) and stats()["dropped"]."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with en.EchoRing(_MostlyBroken(corpus_root), batch_size=8, image_size=16, workers=1,
                         echo=1, shuffle=False, timeout=60) as ring:
            batches = [b.copy() for b in ring]
            stats = ring.stats()
    per_file = [str(w.message) for w in caught
                if issubclass(w.category, en.SampleFailureWarning) and w.message.failure]
    replaced = [m for m in per_file if m.endswith("replaced)")]
    dropped = [m for m in per_file if m.endswith("dropped: every stand-in failed too)")]
    assert len(replaced) + len(dropped) == len(per_file) == 36
    assert len(dropped) == stats["dropped"] > 0
    assert len(replaced) == sum(int((~b.fresh).sum()) for b in batches) > 0
    assert sum(len(b) for b in batches) == 40 - stats["dropped"]

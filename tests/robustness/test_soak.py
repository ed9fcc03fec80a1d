"""Soak: 8 epochs of an echoing EchoRing with two workers SIGKILLed, leak checks after close.

The CI-sized run of ``benchmarks/soak.py`` (see its docstring for the long target).
Only what is robust to noise is asserted: exact fresh coverage per epoch, one
restart per kill, RSS growth after warm-up under a loose bound, and nothing
(segment, process, fd) left after ``close()``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT / "tests", ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
import ring_helpers as rh  # noqa: E402
import soak  # noqa: E402

# A soak: slow (`python -m pytest -m slow`).  The default run keeps its parts: kills
# mid-epoch in test_faults.py, leaks over start/stop cycles and exit paths there too.
pytestmark = pytest.mark.slow

EPOCHS, KILL_AT = 8, (2, 5)
RSS_BOUND = 16 * soak.MIB   # loose: growth seen here is well under 1 MiB
WARMUP = 2


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = rh.make_corpus(tmp_path_factory.getbasetemp() / "soak_corpus_96", 96, seed=3,
                          classes=4)
    return soak.run_soak(root, epochs=EPOCHS, kill_at=KILL_AT, batch_size=8, image_size=32,
                         seed=4)


def test_every_epoch_has_exact_fresh_coverage(result):
    """Each epoch delivers every sample fresh exactly once, kills or not."""
    n = result["config"]["images"]
    assert len(result["records"]) == EPOCHS
    for r in result["records"]:
        assert r["coverage_ok"], (r["epoch"], r["fresh"], r["fresh_unique"], n)
        assert r["fresh"] == r["fresh_unique"] == n
        assert r["delivered"] >= n      # echo=2 repeats, never fewer than the fresh ones


def test_worker_restarts_equal_kills(result):
    """Each SIGKILL gives exactly one restart (and one 'died' warning); killed pids are gone."""
    kills = result["kills"]
    assert [k["epoch"] for k in kills] == list(KILL_AT)
    assert result["worker_restarts"] == len(kills) == result["died_warnings"]
    recs = result["records"]
    for k in kills:
        after = recs[k["epoch"]]["worker_pids"]
        assert k["pid"] not in after and len(after) == 2


def test_consumer_rss_flat_after_warmup(result):
    """Consumer RSS over epochs 2..end grows less than the loose bound."""
    g = soak.growth(result["records"], "consumer_rss", WARMUP)
    assert g < RSS_BOUND, f"consumer RSS grew {g / soak.MIB:.1f} MiB"


def test_worker_rss_bounded_after_warmup(result):
    """No worker (replacements included) exceeds the warm-up workers' RSS by the bound."""
    assert all(v is not None for r in result["records"] for v in r["worker_rss"])
    g = soak.worker_growth(result["records"], WARMUP)
    assert g < RSS_BOUND, f"worker RSS grew {g / soak.MIB:.1f} MiB"


def test_steady_segments_children_fds_while_running(result):
    """While running: one segment, and a constant child and fd count across the kills."""
    recs = result["records"]
    assert {r["segments"] for r in recs} == {1}
    assert len({r["children"] for r in recs}) == 1
    assert max(r["fds"] for r in recs) - min(r["fds"] for r in recs) <= 1


def test_nothing_left_after_close(result):
    """After close: no segment, no worker or other child process, fd count back to the start."""
    a = result["after_close"]
    assert a["segments_left"] == [] and not a["ring_segment_exists"]
    assert a["ring_memory_held"] == []       # no process maps the memfd: its memory is freed
    assert a["workers_alive"] == []
    assert a["children_left"] == []
    assert a["fds_after"] <= a["fds_before"], (a["fds_before"], a["fds_after"])
    assert soak.problems(result, RSS_BOUND, WARMUP) == []


def test_problems_reports_each_kind_of_leak(result):
    """The checker the script exits on flags coverage, restart, segment, child and fd faults."""
    import copy

    bad = copy.deepcopy(result)
    bad["records"][3]["coverage_ok"] = False
    bad["worker_restarts"] += 1
    bad["after_close"].update(segments_left=["memfd:echo_native-1-ab"], workers_alive=[4242],
                              children_left=[4243], fds_after=bad["after_close"]["fds_before"] + 1,
                              ring_memory_held=[4244])
    bad["records"][-1]["consumer_rss"] = bad["records"][WARMUP]["consumer_rss"] + 64 * soak.MIB
    text = "\n".join(soak.problems(bad, RSS_BOUND, WARMUP))
    for word in ("epoch 3", "worker_restarts", "segments", "worker processes", "child",
                 "fds", "consumer RSS", "memory still held"):
        assert word in text, word

"""The data-echoing stage (``echo_native.echo``): echo counts, the shuffle buffer
after the echo stage, batch echoing and the auto echo factor, observed in the
emission stream of an EchoRing (CPU backend).

What is checked, against references computed here (never against numbers
copied from the implementation):

- echo counts: each sample fresh once per epoch and emitted e times (exactly
  for integer e, in expectation for fractional e, redrawn each epoch);
- the example buffer: no duplicate inside a batch unless fewer than a batch of
  distinct examples is left, repeats spread over several batches, more so with
  a bigger buffer;
- batch echo (BatchWindow): whole batches repeated, 2 or 3 times for e=2.5;
- auto echo (AutoEcho) follows the ratio of upstream to consumer speed.

How EchoRing places, copies and hands out the echoes is in ``test_pipeline.py``.
"""
from __future__ import annotations

import math
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import echo_native as en

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import echo_helpers as eh  # noqa: E402

EXAMPLE_PLACEMENTS = ("before_augment", "after_augment")


# ---- corpora (real photographs, small so that a test takes well under a second) ----
@pytest.fixture(scope="module")
def small():
    """64 JPEGs of 48x64 with 5 labels."""
    blobs = eh.photo_jpegs(64, 48, 64, seed=1)
    return blobs, np.arange(64) % 5


@pytest.fixture(scope="module")
def large():
    """400 JPEGs of 32x40 (for statistics over many examples)."""
    blobs = eh.photo_jpegs(400, 32, 40, seed=2)
    return blobs, np.arange(400) % 7


_src, _ring, _flat = eh.samples_of, eh.small_ring, eh.flat


# ---- echo counts and the example buffer: statistics of the emission stream ----------
@pytest.mark.parametrize("placement", EXAMPLE_PLACEMENTS)
@pytest.mark.parametrize("e", [2, 3])
def test_integer_echo_emits_each_sample_e_times(small, placement, e):
    """Integer e: per epoch each sample is fresh once and emitted exactly e times (index 0..e-1)."""
    n = len(small[0])
    with _ring(small, echo=e, placement=placement) as ring:
        epochs = eh.collect(ring, epochs=2, copy_images=False)
        stats = ring.stats()
    for k, batches in enumerate(epochs):
        assert len(batches) == batches[0]["announced"] == math.ceil(n * e / 8)
        assert all(b["epoch"] == k for b in batches)
        ids, echo, fresh = _flat(batches, "ids"), _flat(batches, "echo"), _flat(batches, "fresh")
        assert Counter(ids.tolist()) == {i: e for i in range(n)}
        assert sorted(ids[fresh].tolist()) == list(range(n)), "each sample fresh exactly once"
        assert np.array_equal(fresh, echo == 0)
        for sid, em in eh.emissions(batches).items():
            assert [x for _, _, x in em] == list(range(e)), f"sample {sid}: echo order"
        labels = _flat(batches, "labels")
        assert np.array_equal(labels, small[1][ids])
    assert stats["fresh"] == 2 * n and stats["delivered"] == 2 * n * e
    assert stats["effective_echo"] == pytest.approx(e)
    assert stats["echo_factor"] == e


@pytest.mark.parametrize("placement", EXAMPLE_PLACEMENTS)
def test_fractional_echo_mean_within_tolerance(large, placement):
    """e=2.5, 400 samples: 2 or 3 emissions each, mean 2.5 +- 4 binomial SDs, redrawn per epoch."""
    n, e = len(large[0]), 2.5
    with _ring(large, echo=e, placement=placement, batch_size=16, image_size=16) as ring:
        epochs = eh.collect(ring, epochs=2, copy_images=False)
    extra = []
    for batches in epochs:
        ids = _flat(batches, "ids")
        counts = np.bincount(ids, minlength=n)
        assert set(counts.tolist()) <= {2, 3}
        sd = math.sqrt(0.25 / n)
        assert abs(counts.mean() - e) <= 4 * sd, counts.mean()
        fresh = _flat(batches, "fresh")
        assert np.array_equal(np.sort(ids[fresh]), np.arange(n))
        assert len(batches) == batches[0]["announced"] == math.ceil(counts.sum() / 16)
        extra.append(set(np.flatnonzero(counts == 3).tolist()))
    assert extra[0] != extra[1], "the same samples got the extra emission in both epochs"


def test_fractional_batch_echo_counts(large):
    """Batch echo, e=2.5: each fresh batch is delivered 2 or 3 times, about half of them 3 times."""
    n = len(large[0])
    with _ring(large, echo=2.5, placement="batch", batch_size=4, image_size=16) as ring:
        batches = eh.collect(ring, copy_images=False)[0]
    assert len(batches) == batches[0]["announced"]
    fresh_ids = _flat(batches, "ids")[_flat(batches, "fresh")]
    assert np.array_equal(np.sort(fresh_ids), np.arange(n))
    reps = Counter(tuple(b["ids"].tolist()) for b in batches)
    assert len(reps) == n // 4
    assert set(reps.values()) <= {2, 3}
    share3 = sum(v == 3 for v in reps.values()) / len(reps)
    assert abs(share3 - 0.5) <= 4 * math.sqrt(0.25 / len(reps)), share3


def test_duplicates_in_batch_only_when_unavoidable(large):
    """Any shuffle_buffer: a batch has duplicates only when < B distinct examples remain."""
    B, e = 16, 3
    rates = {}
    for mult in (2, 4, 8, 16):
        with _ring(large, echo=e, placement="after_augment", batch_size=B, image_size=8,
                   shuffle_buffer=mult * B, seed=7) as ring:
            batches = eh.collect(ring, copy_images=False)[0]
        dups = 0
        for j, b in enumerate(batches):
            d = len(b["ids"]) - len(set(b["ids"].tolist()))
            if d:
                left = set(_flat(batches[j:], "ids").tolist())
                assert len(left) < B, (f"buffer {mult}xB: batch {j} of {len(batches)} has {d} "
                                       f"duplicates while {len(left)} distinct examples remain")
            dups += d
        assert dups <= (B - 1) * (e - 1), (mult, dups)
        rates[mult] = dups / sum(len(b["ids"]) for b in batches)
    print("in-batch duplicate rate by shuffle_buffer / batch_size:", rates)


def test_repeat_gaps_are_spread_and_grow_with_buffer(large):
    """Repeat gaps vary, skip the adjacent batch, grow with the buffer (~ shuffle_buffer / B)."""
    B, e = 16, 2
    means = []
    for mult in (2, 4, 8, 16):
        with _ring(large, echo=e, placement="after_augment", batch_size=B, image_size=8,
                   shuffle_buffer=mult * B, seed=11) as ring:
            batches = eh.collect(ring, copy_images=False)[0]
        gaps = eh.repeat_gaps(batches)
        assert len(gaps) == len(large[0]) * (e - 1)
        if mult > 2:  # a 2-batch buffer simply alternates its two halves
            assert len(set(gaps.tolist())) > 2, f"buffer {mult}xB: {Counter(gaps.tolist())}"
        assert 0.4 * mult <= gaps.mean() <= 1.5 * mult, (mult, gaps.mean())
        # Examples of the previous batch sit one out: adjacent repeats only in the
        # epoch's tail, when fewer than two batches' worth of examples remain.
        assert np.mean(gaps <= 1) <= 0.05, (mult, Counter(gaps.tolist()))
        means.append(gaps.mean())
    assert means == sorted(means), f"mean gap does not grow with the buffer: {means}"


# ---- batch echo ---------------------------------------------------------------------
def test_batch_echo_repeats_whole_batches(small):
    """Batch echo: echo batches repeat a fresh batch exactly, e times, not all back to back."""
    e = 3
    with _ring(small, echo=e, placement="batch", image_size=24, seed=8) as ring:
        batches = eh.collect(ring)[0]
    fresh = {}
    for b in batches:
        assert len(set(b["echo"].tolist())) == 1, "one echo index per batch"
        key = tuple(b["ids"].tolist())
        if b["echo"][0] == 0:
            assert b["fresh"].all() and key not in fresh
            fresh[key] = b
        else:
            assert key in fresh, "an echo batch before its fresh batch"
            f = fresh[key]
            for k in ("labels", "images", "boxes", "flips"):
                assert np.array_equal(b[k], f[k]), k
            assert not b["fresh"].any()
    assert len(fresh) == 8
    seq = [tuple(b["ids"].tolist()) for b in batches]
    assert Counter(seq) == {k: e for k in fresh}
    assert sorted(np.concatenate([np.array(k) for k in fresh]).tolist()) == list(range(64))
    adjacent = sum(a == b for a, b in zip(seq, seq[1:]))
    assert adjacent < len(fresh) * (e - 1), "every repeat came back to back"


# ---- auto echo ------------------------------------------------------------------------
def test_auto_echo_rises_when_upstream_is_slow(small):
    """Auto echo: upstream ~32x slower than the consumer makes e rise above 1.5 (<= max_echo)."""
    n = 48
    src = eh.SleepySource(small[0][:n], small[1][:n], delay=0.02)
    with en.EchoRing(src, batch_size=8, image_size=16, echo="auto", placement="after_augment",
                     workers=1, seed=0, timeout=60) as ring:
        epochs = eh.collect(ring, epochs=2, step=lambda b: time.sleep(0.005),
                            copy_images=False)
        s = ring.stats()
    for batches in epochs:
        fresh_ids = _flat(batches, "ids")[_flat(batches, "fresh")]
        assert np.array_equal(np.sort(fresh_ids), np.arange(n))
    assert 1.5 < s["echo_factor"] <= 4.0, s
    assert s["effective_echo"] > 1.5, s
    last = _flat(epochs[-1], "ids")
    assert len(last) / n > 1.5
    assert 4 < s["estimated_R"] < 500, s


def test_auto_echo_rises_for_batch_placement(small):
    """Auto echo with placement='batch': a ~32x slower upstream makes e rise above 1.5."""
    n = 48
    src = eh.SleepySource(small[0][:n], small[1][:n], delay=0.02)
    with en.EchoRing(src, batch_size=8, image_size=16, echo="auto", placement="batch",
                     workers=1, seed=0, timeout=60) as ring:
        epochs = eh.collect(ring, epochs=2, step=lambda b: time.sleep(0.005),
                            copy_images=False)
        s = ring.stats()
    assert s["echo_factor"] > 1.5 and len(_flat(epochs[-1], "ids")) / n > 1.5, s


def test_auto_echo_stays_near_one_when_upstream_is_fast(small):
    """Auto echo: upstream much faster than a 50 ms consumer keeps e and delivered/fresh <= 1.2."""
    src = _src(small)
    with en.EchoRing(src, batch_size=8, image_size=8, echo="auto", placement="before_augment",
                     workers=2, seed=0) as ring:
        eh.collect(ring, epochs=3, step=lambda b: time.sleep(0.05), copy_images=False)
        s = ring.stats()
    assert s["echo_factor"] <= 1.2, s
    assert s["effective_echo"] <= 1.2, s
    assert s["estimated_R"] < 1.0, s


def test_auto_echo_falls_back_when_consumer_slows(small):
    """Auto echo: e rises for a fast consumer, then falls to <= 1.2 once the consumer is slower."""
    n = 48
    src = eh.SleepySource(small[0][:n], small[1][:n], delay=0.005)
    with en.EchoRing(src, batch_size=8, image_size=16, echo="auto", placement="after_augment",
                     workers=1, seed=0, timeout=60) as ring:
        eh.collect(ring, epochs=1, step=lambda b: time.sleep(0.001), copy_images=False)
        high = ring.stats()["echo_factor"]
        assert high > 1.5, ring.stats()
        trace = []
        for _ in range(4):
            batches = eh.collect(ring, epochs=1, step=lambda b: time.sleep(0.08),
                                 copy_images=False)[0]
            trace.append((ring.stats()["echo_factor"], len(_flat(batches, "ids")) / n))
            if trace[-1][0] <= 1.2:
                break
    assert trace[-1][0] <= 1.2, (high, trace)
    assert trace[-1][0] < high

"""The data-echoing stage (``echo_native.echo``): echo counts, the shuffle buffer
after the echo stage, batch echoing and the auto echo factor, observed in the
emission stream of an EchoRing (CPU backend).

What is checked, against references computed here (never against numbers
copied from the implementation):

- echo counts: each sample fresh once per epoch and emitted e times (exactly
  for integer e, in expectation for fractional e, redrawn each epoch);
- the example buffer: never a duplicate inside a batch (the epoch's last batches
  are short instead), repeats spread over several batches, more so with a bigger
  buffer;
- batch echo (BatchWindow): whole batches repeated, 2 or 3 times for e=2.5;
- auto echo (AutoEcho): its decisions on simulated rates, stalls and losses
  (headroom x R, bounds, the stall correction, the loss cap, the trace), and in a
  ring: it follows the ratio of upstream to consumer speed and takes losses
  through ``EchoRing.report``.

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
from echo_native.echo import stage, stages
from echo_native.echo import AutoEcho

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import echo_helpers as eh  # noqa: E402

EXAMPLE_PLACEMENTS = ("before_augment", "after_augment")
PLACEMENTS = (*EXAMPLE_PLACEMENTS, "batch")


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


def test_no_batch_ever_holds_an_example_twice(large):
    """Any shuffle_buffer: no batch holds an example twice, not even at the end of an epoch
    (its last batches are short instead), and every example still comes e times."""
    B, e = 16, 3
    for mult in (2, 4, 8, 16):
        with _ring(large, echo=e, placement="after_augment", batch_size=B, image_size=8,
                   shuffle_buffer=mult * B, seed=7) as ring:
            batches = eh.collect(ring, copy_images=False)[0]
        for j, b in enumerate(batches):
            d = len(b["ids"]) - len(set(b["ids"].tolist()))
            assert d == 0, f"buffer {mult}xB: batch {j} of {len(batches)} has {d} duplicates"
        ids = _flat(batches, "ids")
        assert set(Counter(ids.tolist()).values()) == {e}, mult


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


def test_recount_follows_a_new_e_and_keeps_first_emissions():
    """Auto echo recounts the buffer when e moves: the new total less the emissions
    made, never dropping an example's first emission; entries left with none are freed."""
    from echo_native.echo import ExampleBuffer

    buf = ExampleBuffer(4)
    entries = buf.allocate(4)
    buf.remaining[entries] = 2
    buf.emit(entries[:2])                    # entries 0, 1 made 1 of their 2
    buf.recount(entries, [4, 1, 1, 3])       # e rose for 0 and 3, fell for 1 and 2
    assert buf.remaining[entries].tolist() == [3, 0, 1, 3]
    assert buf.free == 1 and len(buf) == 3   # entry 1 is done and freed
    buf.recount(buf.active(), [1, 1, 1])
    assert buf.remaining[entries].tolist() == [0, 0, 1, 1]  # unsent ones keep their first


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


# ---- auto echo in a ring: what the ring measures and what it does with e ----------------
# The rates a ring measures depend on the machine, so the tests below never assert where
# a measured rate takes e.  They check what the ring reports to its AutoEcho against a
# scripted clock or lower bounds that sleeps guarantee, and what it does with e against
# scripted rates (ScriptedAuto), where every decision is exact.
class ScriptedClock:
    """A clock that moves only when told to (``sleep``, or ``t`` set by a test)."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, seconds):
        self.t += seconds


class _TimeOn:
    """The ``time`` module with ``perf_counter`` read from a scripted clock."""

    def __init__(self, clock):
        self.perf_counter = clock

    def __getattr__(self, name):
        return getattr(time, name)


class ScriptedAuto(AutoEcho):
    """AutoEcho on scripted rates: whatever the ring measured, each fresh batch took the
    upstream ``up_s`` and each delivered batch the consumer ``down_s`` (a test may change
    them mid-run).  What the ring reported is kept; its stalls, which depend on timing,
    are counted and not acted on (the stall correction has its own test below)."""

    up_s, down_s = 0.06, 0.02   # R = 3

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.measured_up, self.measured_down, self.stalls = [], [], 0

    def upstream(self, seconds):
        self.measured_up.append(seconds)
        super().upstream(self.up_s)

    def consumer(self, seconds):
        self.measured_down.append(seconds)
        super().consumer(self.down_s)

    def stalled(self):
        self.stalls += 1


@pytest.fixture
def scripted(monkeypatch):
    """Rings made in the test run echo="auto" on a ScriptedAuto (``ring.stage.auto``); the
    class returned is the test's own, so rates set on it stay in the test."""
    cls = type("ScriptedAuto", (ScriptedAuto,), {})
    monkeypatch.setattr(stages, "AutoEcho", cls)  # what make_stage builds
    return cls


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_ring_reports_the_consumer_time_less_its_waits(small, scripted, monkeypatch,
                                                        placement):
    """On a scripted clock where each wait for a fresh batch lasts 1000 s and each
    consumer step 0.25 s: every hand-out after the first is reported to auto echo as
    exactly 0.25 s (the step and the ring's own work, which takes no scripted time),
    never with the waits; stats() counts the same step time and waits."""
    clock = ScriptedClock()
    for module in (stage, stages):  # the base times the takes, a stage its work
        monkeypatch.setattr(module, "time", _TimeOn(clock))
    with _ring(small, echo="auto", placement=placement) as ring:
        take = ring.loader.next_fresh

        def waits_1000_s():
            fresh = take()
            clock.sleep(1000.0)
            return fresh
        ring.loader.next_fresh = waits_1000_s
        batches = eh.collect(ring, step=lambda b: clock.sleep(0.25), copy_images=False)[0]
        s, auto = ring.stats(), ring.stage.auto
    fresh_batches = len(small[0]) // 8
    assert len(auto.measured_down) == len(batches) - 1
    assert auto.measured_down == [pytest.approx(0.25)] * (len(batches) - 1)
    assert s["consumer_s"] == pytest.approx(0.25 * len(batches))
    assert s["stall_s"] == pytest.approx(1000.0 * fresh_batches)
    assert len(auto.measured_up) == fresh_batches


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_ring_reports_the_upstream_time_per_worker(small, scripted, placement):
    """Each fresh batch is reported to auto echo once, as its fill time over the worker
    count: a worker whose reads sleep 10 ms fills a batch of 8 in at least 80 ms, so
    with 2 workers each report is at least 40 ms."""
    n = 24
    src = eh.SleepySource(small[0][:n], small[1][:n], delay=0.01)
    with en.EchoRing(src, batch_size=8, image_size=16, echo="auto", placement=placement,
                     workers=2, seed=0, timeout=60) as ring:
        eh.collect(ring, copy_images=False)
        auto = ring.stage.auto
    assert len(auto.measured_up) == n // 8
    assert min(auto.measured_up) >= 8 * 0.01 / 2, auto.measured_up


def _fresh_once_per_epoch(epochs, n):
    for batches in epochs:
        fresh_ids = _flat(batches, "ids")[_flat(batches, "fresh")]
        assert np.array_equal(np.sort(fresh_ids), np.arange(n))


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_auto_echo_rises_to_the_rates_target_in_a_ring(small, scripted, placement):
    """Upstream 3x slower per batch than the consumer: e settles at exactly
    1.1 x R = 3.3 in every placement, with "rates" as the reason; each epoch has every
    sample fresh once, and the second delivers 3 or 4 emissions of each (batch echo:
    of each fresh batch), 3.3 on average."""
    n = len(small[0])
    with _ring(small, echo="auto", placement=placement) as ring:
        epochs = eh.collect(ring, epochs=2, copy_images=False)
        s, auto = ring.stats(), ring.stage.auto
    _fresh_once_per_epoch(epochs, n)
    assert s["echo_factor"] == pytest.approx(3.3) and auto.R == pytest.approx(3.0)
    assert s["echo_trace"][-1]["reason"] == "rates"
    assert s["echo_trace"][-1]["echo"] == pytest.approx(3.3)
    counts = np.bincount(_flat(epochs[1], "ids"), minlength=n)
    assert set(counts.tolist()) <= {3, 4}
    expected_sd = math.sqrt(0.21 / (n if placement != "batch" else n // 8))
    assert abs(counts.mean() - 3.3) <= 4 * expected_sd, counts.mean()


def test_auto_echo_falls_to_one_when_the_upstream_is_fast(small, scripted):
    """Upstream twice as fast as the consumer: e falls from its start (4) to exactly 1
    once the rates are known, and the next epoch delivers each sample exactly once."""
    scripted.up_s, scripted.down_s = 0.01, 0.02
    n = len(small[0])
    with _ring(small, echo="auto", placement="before_augment") as ring:
        epochs = eh.collect(ring, epochs=2, copy_images=False)
        s = ring.stats()
    _fresh_once_per_epoch(epochs, n)
    assert s["echo_trace"][0]["echo"] < AutoEcho.START and s["echo_factor"] == 1.0
    assert sorted(_flat(epochs[1], "ids").tolist()) == list(range(n))
    assert len(epochs[1]) == epochs[1][0]["announced"] == n // 8


def test_auto_echo_falls_back_when_the_consumer_slows(small, scripted):
    """e at 3.3 for a fast consumer; the consumer slows to twice the upstream's time per
    batch: within the next epoch e falls to 1 ("rates"), and the epoch after delivers
    each sample once."""
    n = len(small[0])
    with _ring(small, echo="auto", placement="after_augment") as ring:
        eh.collect(ring, copy_images=False)
        high = ring.stats()["echo_factor"]
        ring.stage.auto.down_s = 0.12
        eh.collect(ring, copy_images=False)
        s = ring.stats()
        last = eh.collect(ring, copy_images=False)[0]
    assert high == pytest.approx(3.3)
    assert s["echo_factor"] == 1.0 and s["echo_trace"][-1]["reason"] == "rates"
    assert sorted(_flat(last, "ids").tolist()) == list(range(n))


@pytest.mark.parametrize("placement", EXAMPLE_PLACEMENTS)
def test_auto_echo_held_at_e_emits_what_fixed_e_does(small, monkeypatch, placement):
    """Auto and fixed echo share the per-example count draws and never draw counts from
    the shuffle generator: auto held at a fractional start e emits that fixed e's stream,
    row for row (which examples get the extra emission included)."""
    streams = {}
    for echo in (2.5, "auto"):
        with monkeypatch.context() as m:
            m.setattr(AutoEcho, "START", 2.5)
            m.setattr(AutoEcho, "_set", lambda self, value, reason: None)  # held at start
            with _ring(small, echo=echo, placement=placement, seed=5) as ring:
                streams[echo] = [(_flat(b, "ids").tolist(), _flat(b, "echo").tolist())
                                 for b in eh.collect(ring, epochs=2, copy_images=False)]
    first = np.bincount(streams[2.5][0][0])  # epoch 0: 2 or 3 emissions per example
    assert set(first.tolist()) == {2, 3}, "the per-example draws were never consulted"
    assert streams["auto"] == streams[2.5]


# ---- auto echo decisions on simulated rates and losses ---------------------------------
class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _run(auto, t_up, t_down, batches, clock=None, e=None):
    """Feed ``batches`` steady observations: a fresh batch every ~e delivered ones."""
    for i in range(batches):
        if clock is not None:
            clock.t += t_down
        auto.consumer(t_down)
        if i % max(1, round(e or auto.value)) == 0:
            auto.upstream(t_up)
    return auto.value


@pytest.mark.parametrize("R,max_echo,want", [(3.0, 4.0, 3.3), (2.0, 4.0, 2.2), (6.0, 4.0, 4.0),
                                             (6.0, 10.0, 6.6), (0.5, 4.0, 1.0),
                                             (1.0, 4.0, 1.1)])
def test_auto_targets_headroom_times_R_within_bounds(R, max_echo, want):
    """With steady rates auto settles at 1.1 x R = 1.1 t_up / t_down, at least 1 and
    at most max_echo: the consumer is fed with slack and never waits."""
    auto = AutoEcho(max_echo)
    assert _run(auto, t_up=R * 0.02, t_down=0.02, batches=60) == pytest.approx(want)
    assert auto.R == pytest.approx(R)


def test_auto_counts_the_rings_own_work_as_consumer_time():
    """A consumer that spends more per batch (its step plus the ring's re-augmentation)
    lowers R and with it e: the model uses what consumer() is told, nothing else."""
    lean, busy = AutoEcho(8.0), AutoEcho(8.0)
    _run(lean, t_up=0.1, t_down=0.020, batches=40)
    _run(busy, t_up=0.1, t_down=0.025, batches=40)
    assert lean.value == pytest.approx(5.5) and busy.value == pytest.approx(4.4)


def test_auto_tracks_a_change_of_rates():
    """The upstream slows down mid-run: e follows from ~1.1 to ~3.3 within a few dozen
    batches, and the trace says why and when."""
    clock = _Clock()
    auto = AutoEcho(4.0, clock=clock)
    _run(auto, 0.02, 0.02, 40, clock)
    assert auto.value == pytest.approx(1.1, abs=0.01)
    _run(auto, 0.06, 0.02, 80, clock)
    assert auto.value == pytest.approx(3.3, abs=0.05)
    last = auto.trace[-1]
    assert auto.R == pytest.approx(3.0, abs=0.01)
    assert last["reason"] == "rates" and 2.5 < last["R"] <= 3.0
    assert [t["t_s"] for t in auto.trace] == sorted(t["t_s"] for t in auto.trace)
    assert last["t_s"] > 40 * 0.02 and last["batch"] > 40



def test_auto_shrugs_off_a_pause():
    """An evaluation pass or a checkpoint: one consumer step and one upstream batch take a
    second each.  The rates are medians, so e does not move."""
    auto = AutoEcho(4.0)
    _run(auto, 0.04, 0.02, 40)
    before = len(auto.trace)
    auto.consumer(1.0)
    auto.upstream(1.0)
    _run(auto, 0.04, 0.02, 5)
    assert auto.value == pytest.approx(2.2) and len(auto.trace) == before

def test_auto_stalls_before_rates_climb_fast_and_after_add_a_bounded_correction():
    auto = AutoEcho(8.0)
    for _ in range(5):
        auto.stalled()
    early = auto.value
    assert early > 1.5 * AutoEcho.START and all(t["reason"] == "stall" for t in auto.trace)
    _run(auto, 0.04, 0.02, 30)
    assert auto.value == pytest.approx(2.2, abs=0.01)
    for _ in range(50):  # stalls despite the model: the correction, capped at 1.5x
        auto.stalled()
    assert auto.value == pytest.approx(2.2 * 1.5, abs=0.01)
    assert auto.trace[-1]["reason"] == "stall"
    _run(auto, 0.04, 0.02, 400)  # no more stalls: the correction decays away
    assert auto.value == pytest.approx(2.2, rel=AutoEcho.DEADBAND)


def _losses(rng, n, ratio):
    """Per-example losses of a batch: half fresh (mean 1), half echoed (mean ``ratio``)."""
    echo_index = np.arange(n) % 2
    losses = rng.gamma(20.0, 1 / 20.0, n) * np.where(echo_index > 0, ratio, 1.0)
    return losses, echo_index


def test_auto_loss_feedback_lowers_e_once_repeats_are_learnt_and_never_raises_it():
    """Repeats as hard as fresh data leave e at the rate target (more repeats would add
    steps, not progress); repeats clearly easier (the model fits them) bring it down
    to 1, step by step, with "loss" as the reason; once they are hard again e climbs
    back to the rate target."""
    rng = np.random.default_rng(0)
    auto = AutoEcho(8.0)
    _run(auto, 0.06, 0.02, 30)
    assert auto.value == pytest.approx(3.3)
    for _ in range(60):
        auto.losses(*_losses(rng, 64, 0.97))
    assert auto.value == pytest.approx(3.3) and auto.loss_ratio == pytest.approx(0.97, abs=0.03)
    for _ in range(60):
        auto.losses(*_losses(rng, 64, 0.5))
    assert 1.0 < auto.value < 3.3  # the cap is on its way down
    assert auto.trace[-1]["reason"] == "loss"
    for _ in range(200):
        auto.losses(*_losses(rng, 64, 0.5))
    assert auto.value == 1.0
    for _ in range(300):
        auto.losses(*_losses(rng, 64, 1.0))
    _run(auto, 0.06, 0.02, 5)
    assert auto.value == pytest.approx(3.3)


def test_auto_loss_feedback_ignores_batches_without_both_kinds():
    auto = AutoEcho(4.0)
    _run(auto, 0.06, 0.02, 30)
    for _ in range(50):
        auto.losses(np.full(8, 0.1), np.zeros(8))          # all fresh
        auto.losses(np.full(8, 0.1), np.ones(8))           # all echoed
        auto.losses(np.array([np.nan, 1.0]), np.array([0, 1]))  # no finite fresh loss
    assert auto.loss_ratio is None and auto.value == pytest.approx(3.3)


def test_auto_never_leaves_its_bounds_and_keeps_a_short_trace():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=100, deadline=None, database=None, derandomize=True)
    @given(st.floats(1.0, 16.0), st.lists(st.tuples(
        st.sampled_from(["up", "down", "stall", "loss"]), st.floats(0.0, 10.0)), max_size=300))
    def check(max_echo, events):
        auto = AutoEcho(max_echo)
        rng = np.random.default_rng(1)
        for kind, x in events:
            if kind == "up":
                auto.upstream(x)
            elif kind == "down":
                auto.consumer(x)
            elif kind == "stall":
                auto.stalled()
            else:
                auto.losses(*_losses(rng, 16, x))
            assert 1.0 <= auto.value <= max_echo
            assert 1.0 <= auto.cap <= max_echo
        assert len(auto.trace) <= AutoEcho.TRACE
    check()


def test_auto_spec_errors():
    with pytest.raises(ValueError, match="max_echo must be >= 1"):
        AutoEcho(0.5)
    with pytest.raises(ValueError, match="headroom must be >= 1"):
        AutoEcho(4.0, headroom=0.9)


# ---- report(): losses into a ring ------------------------------------------------------------
def test_report_takes_per_example_losses_from_any_framework(small):
    torch = pytest.importorskip("torch")
    with _ring(small, echo="auto", placement="before_augment") as ring:
        with pytest.raises(RuntimeError, match="no batch has been delivered yet"):
            ring.report([1.0])
        for batch in ring:
            n = len(batch)
            ring.report(torch.ones(n, requires_grad=True) * 2)   # autograd, like a real loss
            ring.report(np.ones(n, np.float32))
            ring.report([0.5] * n)
            with pytest.raises(ValueError, match=rf"one loss per row of the last batch \({n}\), "
                                                 r"got shape \(\) \(use reduction='none'\)"):
                ring.report(torch.tensor(1.0))
            with pytest.raises(ValueError, match="one loss per row"):
                ring.report(np.ones(n + 1))
            break
    with _ring(small, echo=2) as ring:  # a fixed e takes losses and ignores them
        batch = next(iter(ring))
        ring.report(np.ones(len(batch)))
        assert ring.stats()["echo_trace"] == [] and ring.stats()["echo_loss_ratio"] is None


def test_report_lowers_auto_echo_when_repeats_are_learnt(small, scripted):
    """Upstream 3x slower: auto echo rises to 3.3; a consumer whose echoed rows have a
    much lower loss than fresh ones (a model memorising them) brings e down to exactly
    1, step by step, and the trace says it was the loss."""
    with _ring(small, echo="auto", placement="before_augment") as ring:
        eh.collect(ring, copy_images=False)
        high = ring.stats()["echo_factor"]

        def memorising(batch):
            ring.report(np.where(np.asarray(batch.echo_index) > 0, 0.2, 1.0))
        for _ in range(12):  # epochs shrink as e falls
            eh.collect(ring, step=memorising, copy_images=False)
            if ring.stats()["echo_factor"] == 1.0:
                break
        s = ring.stats()
    assert high == pytest.approx(3.3)
    assert s["echo_factor"] == 1.0 and s["echo_loss_ratio"] < 0.5, s
    assert any(t["reason"] == "loss" for t in s["echo_trace"]), s["echo_trace"]

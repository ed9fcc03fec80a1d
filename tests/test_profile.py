"""The numbers behind ``echo-native profile`` (``echo_native.profile``) as units: the
recommendation rule on exact inputs, and the measurements' control flow on scripted
clocks (a clock that moves only when the code under test sleeps on it, or one reading
later per reading), so what they decide never depends on the machine's speed.

How the CLI drives these, and the cases it already pins (the rule's table, a numeric
step longer than the trial, a trial ended by ``batches``, ``time_step``'s stopping
rules), are in ``test_cli.py``.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

import echo_native as en
from echo_native import profile

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import sources_helpers as sh  # noqa: E402

pytestmark = pytest.mark.timeout(120)

N, B = 20, 8   # an epoch of batches of 8, 8 and 4


@pytest.fixture(scope="module")
def source():
    """20 JPEGs cut from real photographs, 2 classes."""
    return en.Samples(sh.photo_jpegs(N, seed=11), np.arange(N) % 2)


class Clock:
    """Scripted time: each reading is ``tick`` later than the last, and ``sleep`` moves it."""

    def __init__(self, tick=0.0):
        self.t, self.tick, self.readings, self.slept = 0.0, tick, 0, []

    def __call__(self):
        now = self.t
        self.t += self.tick
        self.readings += 1
        return now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.t += seconds


# ---- recommend ------------------------------------------------------------------------
@pytest.mark.parametrize("t_up, t_down, cap, e", [
    (0.3, 0.1, 4.0, 3.0),    # R = 2.9999999999999996: 3.0, not 2.9
    (0.7, 0.1, 8.0, 7.0),    # R = 6.999999999999999: 7.0, not 6.9
    (2.99, 1.0, 4.0, 2.9),   # rounded down, never up
    (1.05, 1.0, 4.0, 1.0),
    (1.0, 1.0, 4.0, 1.0),
    (0.0, 1.0, 4.0, 1.0),    # nothing upstream: no echo
])
def test_recommend_rounds_down_to_one_decimal_exactly(t_up, t_down, cap, e):
    """e is R rounded down to one decimal, R's float error (0.3 / 0.1 = 2.999...) not
    costing a tenth; R itself is returned as computed."""
    R, got = profile.recommend(t_up, t_down, cap)
    assert got == e and R == t_up / t_down


@pytest.mark.parametrize("t_down", [0.0, -1.0])
def test_recommend_with_no_downstream_time_is_infinitely_input_bound(t_down):
    """A step that takes no time (or a nonsensical negative one): R is infinite and e is
    the cap, never a ZeroDivisionError."""
    R, e = profile.recommend(1.0, t_down, 3.0)
    assert math.isinf(R) and R > 0 and e == 3.0


def test_recommend_applies_a_fractional_cap_rounded_down():
    """A cap of 2.55 gives at most 2.5; an integer cap gives a float factor."""
    assert profile.recommend(10.0, 1.0, 2.55) == (10.0, 2.5)
    _, e = profile.recommend(10.0, 1.0, 3)
    assert e == 3.0 and isinstance(e, float)


# ---- measure_upstream ---------------------------------------------------------------
def test_measure_upstream_counts_the_images_of_every_batch_across_epochs(source):
    """Over epochs of 8, 8 and 4 images: the warm-up batches (the ring's slots) are
    skipped, the rate is over the images of the batches after them, short ones counted
    as short, the epochs running on until min_batches is reached."""
    clock = Clock(tick=1.0)
    ring_slots = en.Loader(source, B, image_size=16, workers=1).slots
    up = profile.measure_upstream(source, B, 16, 1, seconds=0.0, min_batches=5, clock=clock)
    sizes = [8, 8, 4] * 10   # the warm-up alone (at least 4 slots) spans an epoch
    counted = sizes[ring_slots:ring_slots + 5]
    # t0 is the first reading; the fifth counted batch reads the clock once to test the
    # time (1 s later) and once more to divide (2 s after t0).
    assert clock.readings == 3
    assert up == sum(counted) / 2.0


# ---- time_step ---------------------------------------------------------------------------
def test_time_step_calls_fn_on_one_real_batch_every_time(source):
    """Every call, warm-up and timed, gets the same real batch of the pipeline's output."""
    seen = []
    profile.time_step(lambda b: seen.append(b), source, B, 16, 1, min_s=0.0, warmup=1,
                      max_calls=50, clock=Clock())
    assert len(seen) == 1 + 3
    assert all(b is seen[0] for b in seen)
    assert seen[0].images.shape == (B, 16, 16, 3) and len(set(seen[0].sample_ids)) == B


def test_time_step_max_calls_wins_over_the_three_call_minimum(source):
    """max_calls=2: two timed calls, even though three are the minimum otherwise; no warm-up
    with warmup=0; the time is the mean of the two on the step's clock."""
    clock, calls = Clock(), []

    def step(batch):
        calls.append(clock.t)
        clock.sleep(0.5 if len(calls) == 1 else 1.5)

    t = profile.time_step(step, source, B, 16, 1, min_s=100.0, warmup=0, max_calls=2,
                          clock=clock)
    assert len(calls) == 2 and t == 1.0


# ---- trial_auto --------------------------------------------------------------------------
def test_trial_auto_a_callable_step_longer_than_the_trial_gives_one_batch(source):
    """A consumer (a callable) whose one step outlasts the trial: exactly one batch, and the
    trial never sleeps (the consumer spends the time)."""
    clock, seen = Clock(), []

    def step(batch):
        seen.append(len(batch))
        clock.sleep(10.0)

    stats = profile.trial_auto(step, source, B, 16, 1, seconds=1.0, clock=clock,
                               sleep=lambda s: pytest.fail(f"the trial slept {s} s"))
    assert seen == [B] and stats["batches"] == 1
    assert clock.slept == [10.0]


def test_trial_auto_of_no_time_consumes_nothing(source):
    """seconds=0: the trial ends before its first batch and reports zero batches."""
    seen = []
    stats = profile.trial_auto(seen.append, source, B, 16, 1, seconds=0.0, clock=Clock())
    assert seen == [] and stats["batches"] == 0 and stats["delivered"] == 0


def test_trial_auto_runs_across_epochs_until_its_batches(source):
    """batches=9 over a 20-image source: the trial goes on into the next epochs and stops
    after exactly 9 batches, each at most a batch."""
    seen = []
    stats = profile.trial_auto(lambda b: seen.append((b.epoch, len(b))), source, B, 16, 1,
                               seconds=3600.0, batches=9, clock=Clock())
    assert len(seen) == 9 and stats["batches"] == 9
    assert seen[-1][0] >= 1 and all(0 < n <= B for _, n in seen)


def test_trial_auto_a_zero_step_sleeps_zero_each_batch(source):
    """A step time of 0 (an int): the trial sleeps 0 s per batch and ends by its batches."""
    clock = Clock()
    stats = profile.trial_auto(0, source, B, 16, 1, seconds=5.0, batches=4, clock=clock,
                               sleep=clock.sleep)
    assert stats["batches"] == 4 and clock.slept == [0.0] * 4


def test_trial_auto_runs_auto_echo_up_to_max_echo(source, monkeypatch):
    """The trial's ring echoes with ``Echo("auto", max_echo=...)`` as given, on the given
    seed; whatever auto measures, its factor and every step of its trace stay in
    [1, max_echo], each step saying why."""
    made = []

    class Recorded(en.EchoRing):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            made.append(self)

    monkeypatch.setattr(en, "EchoRing", Recorded)
    stats = profile.trial_auto(lambda b: None, source, B, 16, 1, seconds=3600.0,
                               max_echo=1.5, seed=7, batches=12, clock=Clock())
    assert len(made) == 1 and made[0].spec == en.Echo("auto", max_echo=1.5)
    assert made[0].loader.plan.seed == 7
    assert 1.0 <= stats["echo_factor"] <= 1.5
    assert all(1.0 <= t["echo"] <= 1.5 for t in stats["echo_trace"])
    # No loss is fed back, so every reason but "loss" may appear, depending on the machine.
    assert {t["reason"] for t in stats["echo_trace"]} <= {"stall", "rates", "capacity", "probe"}


@pytest.mark.parametrize("cap", [0.5, 0, float("nan"), "4"])
def test_recommend_refuses_a_cap_below_one(cap):
    """An echo cap below 1 (or not a number) is refused: e is never below 1."""
    with pytest.raises(ValueError, match="echo cap"):
        profile.recommend(5.0, 1.0, cap)

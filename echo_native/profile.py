"""Measuring a pipeline against its consumer: the numbers behind ``echo-native profile``.

Data echoing pays when the input pipeline (upstream) is slower per batch than the
training step (downstream).  :func:`measure_upstream` measures the pipeline's fresh
images/s with a null consumer, :func:`time_step` times the user's step on a real
batch, and :func:`recommend` applies the rule e ~ R = t_upstream / t_downstream.
:func:`trial_auto` runs ``echo="auto"`` against the consumer for a few seconds and
returns where it went and why (its trace).

Only the library and the standard library are used here (no torch, no lab).
"""
from __future__ import annotations

import math
import time

from echo_native._checks import is_int, is_number

__all__ = ["measure_upstream", "time_step", "recommend", "trial_auto"]


def measure_upstream(source, batch_size, image_size, workers, seconds=2.0, min_batches=8,
                     placement="after_augment", clock=None, max_seconds=None,
                     with_batches=False):
    """Fresh images/s of the pipeline with a null consumer (echo=1), after warm-up.

    ``source`` is anything ``EchoRing`` reads (an ``ImageFolder``, a wrapper of one).
    The batches prepared before the clock starts are skipped; then the clock runs for
    at least ``min_batches`` batches and ``seconds``, but never past ``max_seconds``
    when given (then with the batches it has: a huge ``min_batches`` on a slow
    pipeline must not measure for days).  ``clock`` (seconds, default
    ``time.perf_counter``) is what times it: tests pass a scripted one.
    ``with_batches``: returns ``(images/s, batches timed)``.
    """
    import echo_native as en

    clock = clock or time.perf_counter
    ring = en.EchoRing(source, batch_size=batch_size, image_size=image_size, echo=1,
                       placement=placement, workers=workers, seed=0)
    skip = ring.loader.slots  # batches prepared before the clock starts
    n = k = seen = 0
    t0 = None
    with ring:
        while True:
            for batch in ring:
                seen += 1
                if seen == skip:
                    t0 = clock()
                    continue
                if t0 is None:
                    continue
                n += len(batch)
                k += 1
                if max_seconds is None:
                    if k >= min_batches and clock() - t0 >= seconds:
                        rate = n / (clock() - t0)
                        return (rate, k) if with_batches else rate
                    continue
                elapsed = clock() - t0  # every batch: the deadline holds before min_batches
                if k >= min_batches and elapsed >= seconds or elapsed >= max_seconds:
                    rate = n / elapsed
                    return (rate, k) if with_batches else rate


def time_step(fn, source, batch_size, image_size, workers, seed=0, device="cpu",
              min_s=1.0, warmup=2, max_calls=50, clock=None):
    """Seconds per call of ``fn(batch)`` on a real batch from the pipeline: after
    ``warmup`` calls, at least 3 timed calls and ``min_s`` seconds, at most
    ``max_calls`` calls, on ``clock`` (default ``time.perf_counter``)."""
    import echo_native as en

    clock = clock or time.perf_counter
    ring = en.EchoRing(source, batch_size=batch_size, image_size=image_size, echo=1,
                       workers=workers, seed=seed, device=device)
    with ring:
        batch = next(iter(ring))
        for _ in range(warmup):
            fn(batch)
        n, t0 = 0, clock()
        while n < max_calls and (n < 3 or clock() - t0 < min_s):
            fn(batch)
            n += 1
        return (clock() - t0) / n


def recommend(t_up, t_down, cap=4.0):
    """The paper's rule: e ~ R = t_up / t_down, at least 1 and at most ``cap``.

    Returns ``(R, e)``; ``e`` is rounded down to one decimal (fractional factors work).
    """
    if not is_number(cap) or not cap >= 1:
        raise ValueError(f"the echo cap must be a number >= 1, got {cap!r}")
    R = t_up / t_down if t_down > 0 else float("inf")
    e = min(float(cap), max(1.0, R))
    e = math.floor(e * 10 + 1e-9) / 10
    return R, e


def trial_auto(step, source, batch_size, image_size, workers, seconds=5.0, max_echo=4.0,
               seed=0, device="cpu", batches=None, clock=None, sleep=None):
    """Run ``echo="auto"`` for ``seconds`` against a consumer and return the ring's
    ``stats()``: ``echo_factor`` where auto got to, ``echo_trace`` how.

    ``step`` is the consumer: a callable ``step(batch)``, or a step time in seconds that
    the trial sleeps per batch.  A sleep is cut at the trial's end, on the trial's own
    clock, so a step longer than the trial ends it after one batch.  ``batches`` ends
    the trial after that many batches if it has not ended before.  ``clock`` and
    ``sleep`` (default ``time.perf_counter`` and ``time.sleep``) are the trial's time:
    tests pass scripted ones, whose sleep moves their clock.
    """
    import echo_native as en

    if batches is not None and (not is_int(batches) or batches < 1):
        raise ValueError(f"trial_auto: batches must be an integer >= 1 or None, got {batches!r}")
    clock = clock or time.perf_counter
    sleep = sleep or time.sleep
    limit = math.inf if batches is None else batches
    ring = en.EchoRing(source, batch_size=batch_size, image_size=image_size,
                       echo=en.Echo("auto", max_echo=max_echo), workers=workers, seed=seed,
                       device=device)
    with ring:
        end = clock() + seconds
        if callable(step):
            consume = step
        else:
            def consume(batch, step_s=float(step)):
                sleep(max(0.0, min(step_s, end - clock())))
        n = 0
        while clock() < end and n < limit:
            for batch in ring:
                consume(batch)
                n += 1
                if clock() >= end or n >= limit:
                    break
        return ring.stats()

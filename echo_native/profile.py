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

__all__ = ["measure_upstream", "time_step", "recommend", "trial_auto"]


def measure_upstream(source, batch_size, image_size, workers, seconds=2.0, min_batches=8,
                     placement="after_augment"):
    """Fresh images/s of the pipeline with a null consumer (echo=1), after warm-up.

    ``source`` is anything ``EchoRing`` reads (an ``ImageFolder``, a wrapper of one).
    The batches prepared before the clock starts are skipped; then the clock runs for
    at least ``min_batches`` batches and ``seconds``.
    """
    import echo_native as en

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
                    t0 = time.perf_counter()
                    continue
                if t0 is None:
                    continue
                n += len(batch)
                k += 1
                if k >= min_batches and time.perf_counter() - t0 >= seconds:
                    return n / (time.perf_counter() - t0)


def time_step(fn, source, batch_size, image_size, workers, seed=0, device="cpu",
              min_s=1.0, warmup=2, max_calls=50):
    """Seconds per call of ``fn(batch)`` on a real batch from the pipeline."""
    import echo_native as en

    ring = en.EchoRing(source, batch_size=batch_size, image_size=image_size, echo=1,
                       workers=workers, seed=seed, device=device)
    with ring:
        batch = next(iter(ring))
        for _ in range(warmup):
            fn(batch)
        n, t0 = 0, time.perf_counter()
        while n < max_calls and (n < 3 or time.perf_counter() - t0 < min_s):
            fn(batch)
            n += 1
        return (time.perf_counter() - t0) / n


def recommend(t_up, t_down, cap=4.0):
    """The paper's rule: e ~ R = t_up / t_down, at least 1 and at most ``cap``.

    Returns ``(R, e)``; ``e`` is rounded down to one decimal (fractional factors work).
    """
    R = t_up / t_down if t_down > 0 else float("inf")
    e = min(float(cap), max(1.0, R))
    e = math.floor(e * 10 + 1e-9) / 10
    return R, e


def trial_auto(step, source, batch_size, image_size, workers, seconds=5.0, max_echo=4.0,
               seed=0, device="cpu"):
    """Run ``echo="auto"`` for ``seconds`` against a consumer and return the ring's
    ``stats()``: ``echo_factor`` where auto got to, ``echo_trace`` how.

    ``step`` is the consumer: a callable ``step(batch)``, or a step time in seconds that
    the trial sleeps per batch.  A sleep is cut at the trial's end, on the trial's own
    clock, so a step longer than the trial ends it after one batch.
    """
    import echo_native as en

    ring = en.EchoRing(source, batch_size=batch_size, image_size=image_size,
                       echo=en.Echo("auto", max_echo=max_echo), workers=workers, seed=seed,
                       device=device)
    with ring:
        end = time.perf_counter() + seconds
        if callable(step):
            consume = step
        else:
            def consume(batch, step_s=float(step)):
                time.sleep(max(0.0, min(step_s, end - time.perf_counter())))
        while time.perf_counter() < end:
            for batch in ring:
                consume(batch)
                if time.perf_counter() >= end:
                    break
        return ring.stats()

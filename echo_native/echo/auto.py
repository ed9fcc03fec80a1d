"""``echo="auto"``: the echo factor that keeps the accelerator busy, measured while
training (see :class:`AutoEcho`)."""
from __future__ import annotations

import collections
import math
import time

import numpy as np

from echo_native.echo.counts import counts_from


class AutoEcho:
    """The echo factor of ``echo="auto"``: the e that keeps the accelerator busy with
    data that still teaches, measured while training.

    **Rate model.**  ``t_up`` is the upstream's time per fresh batch (worker fill
    time / workers: its capacity, not counting time the workers sat on a full
    ring) and ``t_down`` the consumer's time per delivered batch, including the
    ring's own emission work (re-augmentation, normalisation) but not the time it
    blocked on the upstream; each is the median of its last 15 observations, so
    an evaluation pass, a checkpoint or a slow file moves neither.  At e = R =
    t_up / t_down the consumer is exactly fed; below it the accelerator waits,
    above it repeats stand in for fresh data that was never short, and each
    one costs a whole step: in wall time, e above R can at best tie with e = R,
    when a repeat teaches as much as a fresh example.  The target is therefore
    just above R, ``headroom`` x R (1.1), against the rates' wander; repeats are
    kept rather than evicted while the buffer has room, so the upstream fills
    the ring and waits and the consumer does not.  Each stall that still
    happens raises a correction factor (up to 1.5) that decays by 0.5% per
    batch.

    **Loss feedback** (optional, :meth:`EchoRing.report`).  With per-example
    losses the controller compares echoed rows with fresh ones.  Once repeats
    are clearly easier (smoothed loss ratio < 0.8: the model is fitting them) a
    cap on e falls by 3% per report, down to 1, so that fresh data, not
    memorised repeats, fills the steps; it recovers while the ratio is >= 0.9.
    It never raises e above the rate target: that would add steps, not
    progress.  Without feedback the cap is ``max_echo``.

    **Capacity.**  The echo stage has a throughput of its own: ``t_echo``, its time
    per emitted batch (making the pixels: the draws and the re-augmentation or the
    gather, on all its threads; the median of the last 15), which the device
    reports (:meth:`emission`).  Whatever e is, the stage emits at most one batch
    per ``t_echo``, while the upstream feeds e batches per ``t_up``: above
    ``t_up / t_echo`` the stage, not the upstream, limits what is delivered, and a
    higher e would only spend fresh examples (on the CPU, the stage's threads
    would also take cores from the workers).  So e is also capped at
    ``headroom`` x t_up / t_echo (at least 1), and a change of e that this cap
    decides is recorded with the reason ``"capacity"``.  The consumer's time then
    leaves out its waits for the echo stage's own work, which ``t_echo`` counts
    (for a device that times that work; see :meth:`Stage.batches`), so the
    rates' R is the consumer's and the cap is the stage's.  Under this model the
    delivered rate at the chosen e, min(e / t_up, 1 / t_down, 1 / t_echo), is
    never below its value at e = 1.

    When e moves, the examples in the echo buffer are recounted at the new e
    (their per-example draws are fixed), so the buffer follows e at once instead
    of draining the counts it was filled with.  That makes a high start cheap:
    it starts at e = 4 (at most ``max_echo``), so an upstream-bound job runs at
    a useful e from its first batch, and a job that needs less gives back the
    surplus repeats once the rates are known, a few batches in.

    Every change of more than 0.05 is recorded in :attr:`trace` (at most the
    last 256) with its reason: ``"stall"`` (before the rates are known, or the
    correction), ``"rates"``, ``"capacity"``, ``"loss"`` or ``"probe"`` (see
    :meth:`fed`).
    """

    HEADROOM = 1.1
    START = 4.0            # e before the rates are known (at most max_echo)
    WINDOW = 15            # the rates are medians of the last WINDOW observations
    SMOOTHING = 0.2        # weight of a new report in the running loss ratio
    WARM = 3               # observations of each rate before the model is used
    DEADBAND = 0.05        # a rate-driven change of e smaller than this share is ignored
    TRACE = 256
    PROBE = 15             # fresh batches fed without a wait before e is probed lower
    PROBE_STEP = 0.15      # the share e is lowered by a probe

    def __init__(self, max_echo=4.0, start=None, headroom=HEADROOM, clock=None):
        if max_echo < 1:
            raise ValueError(f"max_echo must be >= 1, got {max_echo}")
        if headroom < 1:
            raise ValueError(f"headroom must be >= 1, got {headroom}")
        self.max_echo = float(max_echo)
        self.headroom = float(headroom)
        start = self.START if start is None else start
        self.value = float(min(max(start, 1.0), max_echo))
        self.cap = self.max_echo
        self.t_up = self.t_down = self.t_echo = None
        self._ups = collections.deque(maxlen=self.WINDOW)
        self._downs = collections.deque(maxlen=self.WINDOW)
        self._echoes = collections.deque(maxlen=self.WINDOW)
        self._n_loss = 0
        self._boost = 1.0
        self._loss_ratio = None
        self._clock = clock or time.perf_counter
        self._t0 = self._clock()
        self.batches = 0
        self.trace = []
        self._fed = 0           # fresh batches in a row the consumer did not wait for

    # -- observations ------------------------------------------------------------------
    def upstream(self, seconds):
        """A fresh batch took the upstream ``seconds`` of capacity (fill time / workers)."""
        if seconds > 0:
            self._fed = 0
            self._ups.append(seconds)
            self.t_up = float(np.median(self._ups))
            self._update("rates")

    def fed(self):
        """A fresh batch came without the consumer waiting for it, from an upstream whose
        time can be measured only while it is the bottleneck (a wrapped loader that
        works ahead: then its time per batch is the time between batches).  After
        :attr:`PROBE` such batches in a row e is lowered by :attr:`PROBE_STEP` (reason
        ``"probe"``) and the upstream's rate is measured afresh: a loader that has
        become fast enough is found out, and a wait puts e back at 1.1 x R."""
        self._fed += 1
        if self._fed >= self.PROBE and self.value > 1.0:
            self._fed = 0
            self._ups.clear()
            self.t_up = None
            self._set(max(1.0, self.value * (1.0 - self.PROBE_STEP)), "probe")

    def consumer(self, seconds):
        """The consumer (with the ring's own work) spent ``seconds`` on a batch."""
        self.batches += 1
        if seconds > 0:
            self._downs.append(seconds)
            self.t_down = float(np.median(self._downs))
        self._boost = max(1.0, self._boost * 0.995)
        self._update("rates")

    def emission(self, seconds):
        """The echo stage took ``seconds`` to make an emitted batch (its own work, on
        all its threads)."""
        if seconds > 0:
            self._echoes.append(seconds)
            self.t_echo = float(np.median(self._echoes))

    def stalled(self):
        """The consumer waited for fresh data with no repeat left to emit."""
        if self._warm:
            self._boost = min(1.5, self._boost * 1.1)
            self._update("stall")
        else:  # no rates yet: climb quickly, as a stall costs a whole step
            self._set(min(self.max_echo, self.cap, self.value * 1.15 + 0.05), "stall")

    def losses(self, losses, echo_index):
        """Per-example losses of a delivered batch and the echo index of each row."""
        losses = np.asarray(losses, dtype=np.float64)
        echo_index = np.asarray(echo_index)
        ok = np.isfinite(losses)
        fresh, echoed = losses[ok & (echo_index == 0)], losses[ok & (echo_index > 0)]
        if not len(fresh) or not len(echoed) or fresh.mean() <= 0:
            return
        self._loss_ratio = self._mean(self._loss_ratio, echoed.mean() / fresh.mean())
        self._n_loss += 1
        if self._n_loss < 5:
            return
        if self._loss_ratio >= 0.9:
            self.cap = min(self.max_echo, self.cap * 1.03 + 0.01)
        elif self._loss_ratio < 0.8:
            self.cap = max(1.0, self.cap * 0.97)
        self._update("loss")

    # -- the decision -------------------------------------------------------------------
    @property
    def _warm(self):
        return len(self._ups) >= self.WARM and len(self._downs) >= self.WARM

    @property
    def R(self):
        """t_up / t_down as measured so far (nan before both are known)."""
        if self.t_up is None or not self.t_down:
            return float("nan")
        return self.t_up / self.t_down

    @property
    def capacity(self):
        """t_up / t_echo: the e at which the echo stage emits exactly as fast as the
        upstream feeds it (None before enough emissions are timed)."""
        if self.t_up is None or not self.t_echo or len(self._echoes) < self.WARM:
            return None
        return self.t_up / self.t_echo

    @property
    def loss_ratio(self):
        """Smoothed mean loss of echoed rows / fresh rows (None without feedback)."""
        return self._loss_ratio

    def _mean(self, old, new):
        return new if old is None else old + self.SMOOTHING * (new - old)

    def _update(self, reason):
        if self._warm:
            target = self.headroom * self._boost * self.R
            capacity = self.capacity
            if capacity is not None and self.headroom * capacity < min(target, self.max_echo,
                                                                       self.cap):
                target, reason = self.headroom * capacity, "capacity"
            target = min(self.max_echo, self.cap, max(1.0, target))
            if reason in ("rates", "capacity") and \
                    abs(target - self.value) < self.DEADBAND * self.value:
                return  # the measured rates jitter; e follows only real changes
            self._set(target, reason)
        elif self.value > self.cap:
            self._set(self.cap, reason)

    def _set(self, value, reason):
        value = max(1.0, value)
        if abs(value - self.value) > 0.05:
            capacity = self.capacity
            self.trace.append({"t_s": round(self._clock() - self._t0, 3), "batch": self.batches,
                               "echo": round(value, 3), "reason": reason,
                               "R": None if math.isnan(self.R) else round(self.R, 3),
                               "capacity": None if capacity is None else round(capacity, 3)})
            del self.trace[:-self.TRACE]
        self.value = value

    def counts(self, draws):
        """Emissions at the current e for examples with these :func:`echo_draws`."""
        return counts_from(draws, self.value)

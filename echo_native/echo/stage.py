"""The echo stage's base: the steps every placement shares, written once.

A stage reads fresh batches through :class:`~echo_native.echo.upstream.Upstream`
and hands out batches made by ``finish``; *what* it stores and emits is the
business of its ``examples`` (:mod:`echo_native.echo.images` for ring slots and
the device, :mod:`echo_native.echo.pytree` for a user's batches).  :class:`Stage`
owns the timed take of a fresh batch, the epoch left early and reset, the books
of :meth:`Stage.stats`, and the ledger of first emissions that makes a resume
exact; :func:`check_stage_args` checks what every facade takes from the user.
The placements are :mod:`echo_native.echo.stages`.
"""
from __future__ import annotations

import threading
import time

from echo_native._checks import is_int
from echo_native._iteration import _Sigint
from echo_native.batch import Books
from echo_native.echo.counts import counts_from
from echo_native.echo.ledger import FreshLedger
from echo_native.echo.state import nest


def check_stage_args(seed, batch_size, shuffle_buffer):
    """What the echo stages take from the user, checked once for every facade:
    ``(seed, batch_size, shuffle_buffer)`` as ints; ``batch_size`` may be None (an
    :class:`EchoLoader` reads it from its first batch), ``shuffle_buffer`` None for its
    default (4 x batch_size).  ValueError naming the argument otherwise."""
    if not is_int(seed) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    for name, v in (("batch_size", batch_size), ("shuffle_buffer", shuffle_buffer)):
        if v is not None and (not is_int(v) or v < 1):
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if batch_size is not None:
        shuffle_capacity(shuffle_buffer, batch_size)
    return (int(seed), None if batch_size is None else int(batch_size),
            None if shuffle_buffer is None else int(shuffle_buffer))


def shuffle_capacity(shuffle_buffer, batch_size):
    """The shuffle buffer's entries: ``shuffle_buffer``, 4 x batch_size by default; at
    least 2 x batch_size, so that a batch of distinct examples can always be drawn
    while the next fresh batch comes in."""
    capacity = 4 * batch_size if shuffle_buffer is None else shuffle_buffer
    if capacity < 2 * batch_size:
        raise ValueError(f"shuffle_buffer must be at least 2 x batch_size "
                         f"({2 * batch_size}), got {capacity}")
    return capacity


def name_batch(err, fresh):
    """Say in ``err``'s message which fresh batch it was about (once: the batch is
    dropped), keeping its type for the caller's ``except``."""
    if isinstance(err, MemoryError):
        return  # the buffer's size, not this batch, is what it is about
    if err.args and isinstance(err.args[0], str) and "(fresh batch " not in err.args[0]:
        err.args = (f"{err.args[0]} (fresh batch {fresh.index} of epoch {fresh.epoch}: it is "
                    f"dropped, and iterating again goes on after it)",) + err.args[1:]


class Emission:
    """One emitted batch on its way to the consumer: the job making its pixels, the first
    emissions it carries (booked at hand-over), what the examples made for ``finish``
    (``made``: a :class:`~echo_native.batch.Batch` of ring examples, a user's batch for
    :class:`EchoLoader`), the batch once handed over, and the seconds the call that
    started it took."""

    __slots__ = ("job", "sent", "made", "batch", "made_s")

    def __init__(self, job, sent, made, made_s=0.0):
        self.job, self.sent, self.made, self.batch = job, sent, made, None
        self.made_s = made_s


class Stage:
    """The steps every placement shares.

    Parameters
    ----------
    upstream : Upstream
    examples : what stores and emits examples (``store``, ``make``, ``pass_through``,
        ``keep``, ``repeat``; see :mod:`echo_native.echo.images`)
    finish : callable(made) -> batch, the delivery of what the examples made
    factor : float, or None with ``auto`` (an :class:`~echo_native.echo.auto.AutoEcho`)
    device : where the emissions are made (``release_after_copies``, ``synchronize``)
    """

    def __init__(self, upstream, examples, finish, *, seed, batch_size, drop_last, device,
                 factor=1.0, auto=None):
        self.upstream, self.examples, self.finish = upstream, examples, finish
        self.seed, self.batch_size, self.drop_last = seed, batch_size, drop_last
        self.device, self.factor, self.auto = device, factor, auto
        self.books = Books()
        self.ledger = FreshLedger()
        self.last_echo_index = None   # of the batch delivered last, for loss feedback
        self._unfinished = None       # epoch of an iteration left early

    # -- the factor and the epoch -----------------------------------------------------
    @property
    def e(self):
        """The echo factor in use (auto's current choice)."""
        return self.auto.value if self.auto is not None else self.factor

    @property
    def epoch(self):
        """The epoch the next iteration works on (one left early continues)."""
        return self.upstream.epoch if self._unfinished is None else self._unfinished

    def open_epoch(self):
        """The epoch an iteration works on: the upstream's, unless an earlier iteration
        was left early (break, a caught Ctrl-C) and its epoch is not done yet, although
        all its fresh batches may have been taken already."""
        if self._unfinished is None:
            self._unfinished = self.upstream.epoch
        return self._unfinished

    def end_epoch(self):
        self.ledger.end_epoch()
        self._unfinished = None

    def start(self):
        self.books.start()

    def reset(self, skip=()):
        """A new stream position (set_epoch, a restored state): forget what an
        interrupted epoch left; ``skip`` the ids a restored state says were emitted."""
        self.ledger.clear(skip)
        self._unfinished = None

    def close(self):
        """The upstream is stopping: let go of work in flight."""

    # -- fresh batches ------------------------------------------------------------------
    def take(self):
        """The next fresh batch, its wait and its upstream cost booked."""
        t0 = time.perf_counter()
        S = _Sigint
        if S.installed and threading.current_thread() is threading.main_thread():
            # Nothing taken yet: a Ctrl-C held around this step may end the wait.  The
            # count goes up and back down in this frame (no call between the raise and
            # the try, none in the finally): a context manager's __exit__ starts with a
            # check where the interrupt could skip the decrement.
            if S.caught:
                S.caught = False
                raise KeyboardInterrupt
            S.open += 1
            try:
                fresh = self.upstream.next_fresh()
            finally:
                S.open -= 1
        else:
            fresh = self.upstream.next_fresh()
        self.books.wait_s += time.perf_counter() - t0
        self.books.fill_s += fresh.fill_s
        if self.auto is not None:
            if fresh.fill_s > 0:
                self.auto.upstream(fresh.fill_s / max(1, self.upstream.workers))
            else:  # the upstream did not say (it kept up): auto echo may probe lower
                self.auto.fed()
        return fresh

    def recover(self):
        """The fresh batch taken before an interruption and not used yet, or None.

        A Ctrl-C caught by the training loop between the upstream handing over a
        batch and the stage using it leaves the batch held upstream; the next
        iteration picks it up here instead of losing it.  One the stage has in use
        (:meth:`in_use`) is left alone; one it stored already goes back upstream."""
        held = self.upstream.held()
        if held is None or self.in_use(held):
            return None
        if held.ticket in self.ledger:
            self.release()
            return None
        return held

    def in_use(self, fresh):
        """Whether the stage still uses held ``fresh`` (a placement's own business)."""
        return False

    def counts(self, draws, keys):
        """Emissions of the examples (or batches) ``keys`` at the e in use, from their
        draws."""
        d = draws[keys]
        return self.auto.counts(d) if self.auto is not None else counts_from(d, self.factor)

    def release(self):
        """The fresh batch taken last goes back upstream once the copies out of it are done."""
        self.device.release_after_copies(self.upstream.hand_off())

    def book_fresh(self, count):
        self.books.fresh += int(count)
        self.books.fresh_batches += 1

    # -- emissions ----------------------------------------------------------------------
    def batches(self):
        """One epoch of batches (the rest of one left early), booked: the consumer's time
        between two batches, less the time the stage blocked on the upstream and on its
        own timed work (see :meth:`wait_for_device`), is what auto echo weighs against
        the upstream's."""
        books, auto = self.books, self.auto
        last = waited = echoed = None
        for batch in self.emit_epoch():
            if not len(batch):
                # Nothing to train on (every sample failed, or the upstream's batch was
                # empty), and a 0-length batch breaks a training step: neither counted
                # nor timed as one.
                continue
            now = time.perf_counter()
            if auto is not None and last is not None:
                auto.consumer(now - last - (books.wait_s - waited) -
                              (books.echo_wait_s - echoed))
            last, waited, echoed = now, books.wait_s, books.echo_wait_s
            books.delivered += len(batch)
            books.batches += 1
            self.last_echo_index = batch.echo_index
            yield batch
            books.consumer_s += time.perf_counter() - now

    def emit_epoch(self):
        raise NotImplementedError

    def wait_for_device(self, job=None):
        """``device.synchronize(job)``; on a device that times its jobs (its
        ``job_seconds``), the wait is booked as the echo stage's, which auto echo
        counts through the jobs' own times instead."""
        if not getattr(self.device, "times_jobs", False):
            self.device.synchronize(job)
            return
        t0 = time.perf_counter()
        try:
            self.device.synchronize(job)
        finally:
            self.books.echo_wait_s += time.perf_counter() - t0

    def batches_in(self, epoch):
        """Batches the epoch will deliver (auto echo: at the current e)."""
        raise NotImplementedError

    def state(self):
        """The stage's state, its upstream's nested in it (:mod:`echo_native.echo.state`):
        the upstream's state at the position a resume re-reads from (``parent``), and
        the ids emitted from there on (``skip``)."""
        ticket, skip = self.ledger.position(self.upstream.position)
        return nest(self.upstream.state_at(ticket), skip)

    def stats(self):
        b = self.books
        t_down = b.consumer_s / b.batches if b.batches else 0.0
        workers = max(1, self.upstream.workers)
        t_up = b.fill_s / workers / b.fresh_batches if b.fresh_batches else 0.0
        return {
            **b.rates(),
            "effective_echo": b.delivered / b.fresh if b.fresh else 0.0,
            "echo_factor": self.e,
            # echo="auto": every change of e, when (t_s, batch), to what, and why.
            "echo_trace": list(self.auto.trace) if self.auto else [],
            "echo_loss_ratio": self.auto.loss_ratio if self.auto else None,
            "estimated_R": t_up / t_down if t_down > 0 else float("nan"),
            "consumer_s": b.consumer_s,
        }


def _known(count, what="batches"):
    if count is None:
        raise TypeError(f"len() needs the {what} per epoch, and the upstream does not say "
                        f"how many (a DataLoader over a dataset with len() does)")
    return count

"""The echo stages, one per placement, and :func:`make_stage`, which picks one.

Each is a :class:`~echo_native.echo.stage.Stage` (the steps they share):

- :class:`PassThrough` (e = 1): each fresh batch as it comes;
- :class:`ExampleEcho` (before / after augmentation): examples into a shuffle
  buffer with their echo counts, batches of distinct examples out of it;
- :class:`BatchEcho`: whole batches repeated through a shuffled window.

:func:`make_stage` builds the one an :class:`~echo_native.echo.spec.Echo` spec asks
for, for :class:`EchoRing` and :class:`EchoLoader` alike.
"""
from __future__ import annotations

import collections
import math
import time

import numpy as np

from echo_native._iteration import deferred_interrupts
from echo_native.echo.auto import AutoEcho
from echo_native.echo.buffer import BatchWindow, ExampleBuffer
from echo_native.echo.counts import (  # noqa: F401 - EpochDraws, example_batches: named here too
    EpochDraws,
    echo_counts,
    example_batches,
    shuffle_rng,
)
from echo_native.echo.stage import (  # noqa: F401 - the base's names, importable from here too
    Emission,
    Stage,
    _known,
    name_batch,
    shuffle_capacity,
)
from echo_native.echo.upstream import EpochEnd


class PassThrough(Stage):
    """e = 1: every fresh batch as it comes, on the device and in the output format."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._delivered = None   # ticket of the last batch handed out

    def in_use(self, fresh):
        # Delivered: the batch is its memory, which goes back with the next one.
        return fresh.ticket == self._delivered

    def emit_epoch(self):
        up = self.upstream
        held = self.recover()
        if held is not None:
            yield self._deliver(held)
        left = up.left_in_epoch
        while left is None or left > 0:
            try:
                fresh = self.take()
            except EpochEnd:
                return
            left = None if left is None else left - 1
            yield self._deliver(fresh)

    def _deliver(self, fresh):
        check = getattr(self.examples, "check", None)
        if check is not None:
            try:
                check(fresh)
            except Exception as err:
                self.release()  # dropped: named once, and iteration goes on after it
                name_batch(err, fresh)
                raise
        skip = self.ledger.skip
        if skip:
            # Resumed from a state saved with echo > 1: its examples emitted before the
            # save (ahead of its position) are left out, never delivered fresh twice.
            keep = ~np.isin(fresh.sample_ids, list(skip)) | ~fresh.ok
            made, copied = self.examples.pass_through(fresh, None if keep.all() else keep)
        else:
            keep = None
            made, copied = self.examples.pass_through(fresh)
        with deferred_interrupts():
            self.book_fresh(np.count_nonzero(fresh.ok if keep is None else fresh.ok & keep))
            if copied:  # the batch's pixels were copied out: the fresh batch goes back
                self.release()
            # else the batch is the fresh batch's memory; it goes back with the next one.
            self._delivered = fresh.ticket
        return self.finish(made)

    def batches_in(self, epoch):
        return _known(self.upstream.batches_per_epoch)


class ExampleEcho(Stage):
    """Example echoing, before or after augmentation: each fresh example goes into a
    shuffle buffer with its echo count, and each batch is drawn from it.

    The buffer is kept as full as a whole fresh batch allows, blocking for data:
    with a fixed e the emission order then depends only on the seed, and every
    batch is drawn from a full buffer of distinct examples.  Auto echo does the
    same (repeats are kept, never evicted for fresh data), and tells its
    controller when the consumer stalls: less than a batch left to emit and no
    fresh batch ready.  Waiting early costs no throughput: upstream-bound, the
    rate is the upstream's times e either way; consumer-bound, the buffer is
    full anyway.
    """

    def __init__(self, *args, capacity, **kw):
        super().__init__(*args, **kw)
        self.capacity = int(capacity)
        self.buffer = None
        self._stash = []   # emissions made and not delivered by an iteration left early
        self._part = None  # a fresh batch partly stored (see _add)

    def in_use(self, fresh):
        # Partly stored (see _add): the rest of it is stored before anything else.
        return self._part is not None and self._part[0] is fresh

    def start(self):
        super().start()
        if self.buffer is None:
            self.examples.allocate(self.capacity)   # MemoryError: the caller explains
            self.buffer = ExampleBuffer(self.capacity)

    def reset(self, skip=()):
        super().reset(skip)
        self._drop_stash()
        self._part = None
        if self.buffer is not None:
            self.buffer.clear()

    def close(self):
        self._drop_stash()
        self._part = None
        self.buffer = None
        self.examples.free()

    def _drop_stash(self):
        if self._stash:
            self.device.synchronize()
            self._stash = []

    def draws(self, epoch):
        """The :class:`EpochDraws` of this epoch."""
        up = self.upstream
        return EpochDraws(self.seed, epoch, up.id_space(),
                          up.epoch_ids(epoch) if up.sharded else None)

    def batches_in(self, epoch):
        B, n = self.batch_size, _known(self.upstream.samples_per_epoch, "examples")
        if self.auto is not None:
            total = round(n * self.auto.value)
            return example_batches(total, math.ceil(self.auto.value), n, B, self.drop_last)
        counts = self.counts(self.draws(epoch), self.upstream.epoch_ids(epoch))
        return example_batches(int(counts.sum()), int(counts.max(initial=0)), n, B,
                               self.drop_last)

    def emit_epoch(self):
        up, buf, B, auto = self.upstream, self.buffer, self.batch_size, self.auto
        epoch = self.open_epoch()
        draws = self.draws(epoch)
        echo_now = self.e           # auto echo: the e the buffer's counts were made at
        rng = shuffle_rng(self.seed, epoch)
        bpe = up.batches_per_epoch
        fresh_left = math.inf if bpe is None else max(0, (epoch + 1) * bpe - up.position)
        held = self.recover()
        if held is not None:
            self._add(held, draws)
        # A device that prepares ahead makes the next batch (re-augmented, or gathered
        # from the buffer) while the consumer works on this one, so one emission stays
        # in flight across each yield.
        keep = 1 if self.device.prepares_ahead else 0
        made = collections.deque(self._stash)
        self._stash = []
        try:
            while True:
                while len(made) > keep:
                    batch = self._hand_over(made[0])
                    yield batch
                    made.popleft()
                if made:
                    self.wait_for_device()  # _fill may reuse the entries it reads
                moved, ended = self._fill(draws, fresh_left)
                fresh_left = 0 if ended else fresh_left - moved
                # Fresh examples still to join: batches to come, or the rest of one
                # larger than the free entries (stored as entries free up).
                coming = fresh_left > 0 or self._part is not None
                # Distinct examples only: an example's repeats never share a batch, so
                # the epoch's last batches may be short rather than hold one twice.
                want = min(B, len(buf))
                if want < B and coming:
                    continue  # _fill blocks for more fresh data (and with fewer than B
                    # entries held, more than B are free: the rest of a batch fits)
                if want == 0 or (want < B and self.drop_last):
                    while made:
                        batch = self._hand_over(made[0])
                        yield batch
                        made.popleft()
                    if want:
                        buf.clear()  # drop_last: the short last batch is not emitted
                    self.end_epoch()
                    return
                self._emit(buf.choose(B, rng, closing=not coming), epoch, made)
                if auto is not None and auto.value != echo_now:
                    echo_now = auto.value
                    live = buf.active()
                    buf.recount(live, self.counts(draws, buf.sample_id[live]))
        except GeneratorExit:
            made.popleft()  # closed at a yield: the consumer has that batch
            raise
        finally:
            # Left early (break, Ctrl-C): what was made waits for the next iteration,
            # kept before the wait for its pixels, which a second Ctrl-C may cut short.
            self._stash = list(made)
            self.device.synchronize()

    def _fill(self, draws, fresh_left):
        """Move fresh batches into the buffer while a whole batch's worth of entries is
        free: ``(moved, ended)``, ended when the upstream said the epoch had no more.
        A fresh batch of more examples than are free (the wrapped loader's batches
        need not be the emitted size) goes in as entries free up."""
        buf, B, moved = self.buffer, self.batch_size, 0
        while True:
            if self._part is not None:
                if not self._store_part():
                    return moved, False   # the buffer is full: emit first
                continue
            if fresh_left - moved <= 0 or buf.free < B:
                return moved, False
            if self.auto is not None and buf.pending < B and not self.upstream.ready() and \
                    self.books.batches:  # the first fill is start-up, not a stall
                self.auto.stalled()
            try:
                fresh = self.take()
            except EpochEnd:
                return moved, True
            moved += 1
            self._add(fresh, draws)

    def _add(self, fresh, draws):
        """A fresh batch into the buffer (as much of it as fits), its memory back upstream
        once it is all in."""
        k = np.asarray(self.counts(draws, fresh.sample_ids), np.int32)
        skip = self.ledger.skip
        if skip:  # resumed: these had their fresh emission before the save
            k[np.isin(fresh.sample_ids, list(skip)) & fresh.ok] = 0
        # [fresh batch, its counts, its rows to store, rows stored so far]
        self._part = [fresh, k, np.flatnonzero(k > 0), 0]
        self._store_part()

    def _store_part(self):
        """Store the rows of the fresh batch in ``_part`` that fit; True once it is all in.

        A store the examples refuse (a batch of another structure, dtype or shape)
        gives its entries back and drops the batch: the error names it once, and
        iterating again goes on after it."""
        fresh, k, rows, done = self._part
        buf = self.buffer
        first = done == 0
        whole = first and fresh.count <= buf.free
        if whole:   # the whole batch at once (every store does this for ring slots)
            take = np.arange(fresh.count)
        elif not getattr(self.examples, "stores_rows", False):
            return False   # stored whole only: once as many entries are free
        else:       # its examples with emissions to make, as many as are free
            take = rows[done:done + min(len(rows) - done, buf.free)]
            if not len(take):
                return False
        with deferred_interrupts():
            entries = buf.allocate(len(take))
            try:
                if whole:
                    self.examples.store(entries, fresh)
                else:
                    self.examples.store(entries, fresh, take)
            except Exception as err:
                buf.retire(entries)
                if not first:   # its other rows will never be stored, nor sent
                    self.ledger.drop(fresh.ticket, len(rows) - done)
                self._part = None
                self.release()
                name_batch(err, fresh)
                raise
            buf.sample_id[entries] = fresh.sample_ids[take]
            buf.ok[entries] = fresh.ok[take]
            buf.remaining[entries] = k[take]
            buf.next_echo[entries] = 0
            buf.epoch[entries] = fresh.epoch
            buf.ticket[entries] = fresh.ticket
            if whole:
                zero = entries[k == 0]
                if len(zero):
                    buf.retire(zero)
            if first:
                self.ledger.add(fresh.ticket, len(rows))
                self.book_fresh(np.count_nonzero(fresh.ok[rows]))
            done = len(rows) if whole else done + len(take)
            self._part[3] = done
            if done < len(rows):
                return False
            self._part = None
            self.release()
        return True

    def _emit(self, entries, epoch, made):
        """Emit buffer ``entries`` into ``made``: start making the pixels (a device that
        prepares ahead makes them in the background), then book the echo.  Booked
        only once made: an emission that raises (an ``augment`` that fails) is chosen
        again by the next iteration, and a Ctrl-C never parts the books from ``made``."""
        buf = self.buffer
        sample_ids, tickets = buf.sample_id[entries].copy(), buf.ticket[entries].copy()
        echo_index = buf.next_echo[entries].astype(np.int64)
        first = echo_index == 0
        ok = buf.ok[entries]
        t0 = time.perf_counter()
        job, emitted = self.examples.make(entries, sample_ids, echo_index, first & ok,
                                           buf.epoch[entries], epoch)
        emission = Emission(job, (tickets[first], sample_ids[first], ok[first]), emitted,
                            time.perf_counter() - t0)
        with deferred_interrupts():
            buf.emit(entries)
            made.append(emission)

    def _hand_over(self, emission):
        """The batch of an emission, ready for the consumer.  Its first emissions count
        as sent (for :meth:`state`) only now, so a batch made ahead and never delivered
        is read again after a resume."""
        if emission.batch is None:
            self.wait_for_device(emission.job)  # its pixels, not those made after it
            if self.auto is not None:
                # The echo stage's own time for the batch: the call that started it and
                # the device's work on it (auto echo's capacity).
                busy = self.device.job_seconds(emission.job)
                self.auto.emission(emission.made_s + (busy or 0.0))
            batch = self.finish(emission.made)
            with deferred_interrupts():
                self.ledger.sent(*emission.sent)
                emission.batch = batch
        return emission.batch

    def fill_level(self):
        return len(self.buffer) / self.buffer.capacity if self.buffer is not None else 0.0


class BatchEcho(Stage):
    """Batch echoing: whole fresh batches, each emitted its count of times, drawn at
    random from a window of batches (never the one just emitted when there is a
    choice).  The window outlives one iteration: leaving the loop early and
    iterating again goes on with the batches it holds."""

    def __init__(self, *args, window, **kw):
        super().__init__(*args, **kw)
        self.window_size = int(window)
        self._window = None   # (epoch, BatchWindow)

    def reset(self, skip=()):
        super().reset(skip)
        self._window = None

    def batches_in(self, epoch):
        up, B = self.upstream, self.batch_size
        counts = echo_counts(self.seed, epoch, _known(up.batches_per_epoch), self.e)
        n = up.samples_per_epoch
        if self.drop_last and n is not None and n % B:
            counts = counts[:-1]  # the short last batch is never delivered
        return int(counts.sum())

    def emit_epoch(self):
        up = self.upstream
        epoch = self.open_epoch()
        nb = up.batches_per_epoch
        draws = EpochDraws(self.seed, epoch, nb or 0)   # per fresh batch of the epoch
        rng = shuffle_rng(self.seed, epoch)
        if self._window is None or self._window[0] != epoch:
            self._window = (epoch, BatchWindow(self.window_size))
        window = self._window[1]
        held = self.recover()
        if held is not None:
            self._add(window, held, draws)
        ended = nb is not None and up.position >= (epoch + 1) * nb
        while True:
            while not ended and self._want_fresh(window):
                try:
                    self._add(window, self.take(), draws)
                except EpochEnd:
                    ended = True
                    break
                ended = nb is not None and up.position >= (epoch + 1) * nb
            if not len(window):
                self._window = None
                self.end_epoch()
                return
            entry = window.choose(rng, fresh_first=self.auto is not None)
            kept, echo, ticket = entry[0], entry[2], entry[3]
            if self.drop_last and len(kept) < self.batch_size:
                with deferred_interrupts():
                    window.book(entry)
                    if echo == 0:
                        self.ledger.emitted_whole(ticket, kept.sample_ids[kept.fresh].tolist())
                continue
            # Made, then booked: an emission that raises (an augment that fails) is
            # chosen again by the next iteration.
            batch = self.finish(self.examples.repeat(kept, echo, epoch))
            with deferred_interrupts():
                window.book(entry)
                if echo == 0:
                    self.ledger.emitted_whole(ticket, kept.sample_ids[kept.fresh].tolist())
            yield batch

    def _add(self, window, fresh, draws):
        """A fresh batch into the window, as a copy."""
        skip = self.ledger.skip
        if skip and np.isin(fresh.sample_ids[fresh.ok], list(skip)).all():
            self.release()  # resumed: this batch was emitted before the save
            return
        try:
            kept = self.examples.keep(fresh)  # owns its memory: the fresh batch goes back below
        except Exception as err:
            self.release()   # dropped: its error is raised once, and iteration goes on after it
            name_batch(err, fresh)
            raise
        self.book_fresh(np.count_nonzero(fresh.ok))
        with deferred_interrupts():
            self.release()
            window.add(kept, int(self.counts(draws, [fresh.index])[0]), fresh.ticket)
            self.ledger.add(fresh.ticket, 1)

    def _want_fresh(self, window):
        """Pull the next fresh batch now?  While the window has room (repeats are kept);
        auto echo counts a stall when no batch is left to repeat and no fresh one is
        ready."""
        if len(window) >= window.size:
            return False
        if self.auto is not None and not len(window) and not self.upstream.ready() and \
                self.books.batches:
            self.auto.stalled()
        return True


def make_stage(echo, upstream, examples, finish, *, seed, batch_size, shuffle_buffer,
               drop_last, device):
    """The stage an :class:`~echo_native.echo.spec.Echo` spec asks for: pass-through at
    e = 1, batch echo over a window of ``shuffle_buffer // batch_size`` batches, else
    example echo through a shuffle buffer of ``shuffle_buffer`` entries (see
    :func:`shuffle_capacity`); with auto echo, its controller."""
    capacity = shuffle_capacity(shuffle_buffer, batch_size)
    kw = dict(seed=seed, batch_size=batch_size, drop_last=drop_last, device=device,
              factor=None if echo.auto else echo.factor,
              auto=AutoEcho(echo.max_echo) if echo.auto else None)
    if echo.off:
        stage = PassThrough(upstream, examples, finish, **kw)
    elif echo.placement == "batch":
        stage = BatchEcho(upstream, examples, finish, window=max(2, capacity // batch_size),
                          **kw)
    else:
        stage = ExampleEcho(upstream, examples, finish, capacity=capacity, **kw)
    stage.shuffle_buffer = capacity
    return stage

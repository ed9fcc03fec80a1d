"""The public feeder: :class:`EchoRing` = source -> workers -> ring -> echo -> device.

Reading order of the pipeline: :mod:`source`, :mod:`decode`, :mod:`transforms`,
:mod:`ring`, :mod:`workers`, :mod:`loader`, :mod:`echo`, :mod:`output`,
:mod:`mix`, :mod:`backends`, then this module, which only wires them together
from the specs and keeps the books (:meth:`EchoRing.stats`).
"""
from __future__ import annotations

import collections
import contextlib
import math
import signal
import threading
import time

import numpy as np

from echo_native import _kernel
from echo_native.transforms import CenterCrop, RandomResizedCrop, canvas_for
from echo_native.ring import OK
from echo_native.loader import (_NOT_PICKLABLE, Batch, IterationGuard, Loader, as_source,
                                 check_epoch, fold_shorthands)
from echo_native.echo import (AutoEcho, BatchWindow, Echo, ExampleBuffer, batch_rng,
                              buffer_bytes, counts_from, echo_counts, echo_draws,
                              shuffle_rng)
from echo_native.output import BFloat16Array, Output, storage_dtype
from echo_native.mix import Mix, mix_params
from echo_native.augment import Program, WithOps, split_augment
from echo_native.backends import resolve


class EchoRing:
    """Framework-agnostic feeder with data echoing: source -> workers -> ring -> echo -> device.

    Each argument that groups several decisions is a small spec that validates
    itself; the constructor only wires them.

    Parameters
    ----------
    source : ImageFolder, FileList, TarShards, Samples, or any object with ``len``,
        ``labels``, ``read(i) -> bytes`` and ``describe(i)``.
    batch_size : int, default 256
    augment : RandomResizedCrop, CenterCrop or list, default RandomResizedCrop(224)
        What each sample becomes.  ``CenterCrop(224, resize=256)`` with ``echo=1``
        and ``shuffle=False`` is the evaluation path: every sample once, in order.
        A list is a RandomResizedCrop followed by per-example ops
        (:class:`ColorJitter`, :class:`RandomGrayscale`, :class:`TrivialAugmentWide`,
        :class:`RandomErasing`), drawn afresh for every emission before
        augmentation (see :mod:`echo_native.augment` for the other placements).
    echo : Echo, float >= 1 or "auto", default 2.0
        A number or "auto" is ``Echo(factor)``; see :class:`Echo` for placement,
        shuffle buffer, ``max_echo`` and the canvas budget.
    output : Output, optional
        Normalisation, layout and dtype of the images; None gives uint8 NHWC.
    workers : int, default: the CPUs this process may use
        Decoding worker processes.
    device : "cpu", "cuda", "cuda:N", "auto", or a backend object, default "cpu"
        Where the echo buffer lives and batches are delivered.
    seed : int, default 0
        Order, augmentation and echo counts are pure functions of it.
    shuffle : bool, default True
        Random order per epoch; False keeps the source's order.
    drop_last : bool, default False
        Drop the epoch's last batch when it is short.
    on_error : {"replace", "skip", "raise"}, default "replace"
        What a sample that cannot be read or decoded becomes (see :class:`Loader`).
    shard : Shard, optional
        This process's part of the data (default: torchrun's RANK/WORLD_SIZE).
    decode : DecodeLimits, optional
        Strict decoding and decompression-bomb limits.
    slots, timeout, sample_timeout, worker_mode : see :class:`Loader`.
    mix : Mix, optional
        MixUp / CutMix with soft targets (timm's ``Mixup``), drawn afresh for every
        emitted batch; ``batch.targets`` holds the (B, num_classes) float32 targets.
        Needs a normalised ``output``.  With dtype "bfloat16" the batch is
        normalised and mixed in float32, then rounded to bfloat16 once (what
        mixing in float32 and casting gives in torch).
    on_batch : callable, optional
        ``on_batch(images, xp, keys)``: your own op on each batch where it lives
        (after normalisation and ``mix``; a bfloat16 batch as the
        :class:`BFloat16Array` delivered), ``xp`` its array module (NumPy or
        CuPy), ``keys`` a host (B, 4) int64 array of (seed, epoch, sample id, echo
        index) per row, the key the crop is drawn from, to derive per-emission
        randomness.  Change ``images`` in place (return None) or return an array
        of the same shape and dtype.

    Shorthands (the flat names of the original contract, still supported):
    ``image_size``, ``scale``, ``ratio``, ``flip_p`` build the
    ``RandomResizedCrop``; ``placement``, ``shuffle_buffer``, ``max_echo``,
    ``canvas_side``, ``canvas_max_pixels``, ``echo_flip`` the ``Echo``;
    ``normalize``, ``layout``, ``dtype`` the ``Output``; ``strict`` the
    ``DecodeLimits``; ``rank``, ``world_size`` the ``Shard``.  Giving a
    shorthand together with the spec it belongs to is a ``TypeError``.
    """

    def __init__(self, source, batch_size=256, *, augment=None, echo=2.0, output=None,
                 workers=None, device="cpu", seed=0, shuffle=True, drop_last=False,
                 on_error="replace", shard=None, decode=None, slots=None, timeout=120.0,
                 sample_timeout=60.0, worker_mode="process", mix=None, on_batch=None,
                 **shorthands):
        source = as_source(source, "EchoRing")
        echo = _fold_echo(echo, shorthands)
        output = _fold_output(output, shorthands)
        augment, ops = split_augment("EchoRing", augment)
        augment, decode, shard = fold_shorthands("EchoRing", augment, decode, shard, shorthands)
        if shorthands:
            raise TypeError(f"EchoRing got unexpected keyword argument(s) "
                            f"{', '.join(sorted(shorthands))}")
        if not isinstance(augment, (RandomResizedCrop, CenterCrop)):
            raise TypeError(f"augment must be an echo_native.RandomResizedCrop or CenterCrop, "
                            f"got {augment!r}")
        if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool) or \
                batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if isinstance(augment, CenterCrop) and not echo.off and echo.placement == "before_augment":
            raise ValueError("CenterCrop is deterministic: echoing it before augmentation would "
                             "repeat identical images at the cost of a canvas each; use echo=1 "
                             "(evaluation) or Echo(..., placement='after_augment')")
        if mix is not None:
            if not isinstance(mix, Mix):
                raise TypeError(f"mix must be an echo_native.Mix or None, got {mix!r}")
            if not output.normalized:
                raise ValueError("Mix needs float images to mix: give output=Output(normalize="
                                 "True) (got uint8)")
        if on_batch is not None and not callable(on_batch):
            raise TypeError(f"on_batch must be callable(images, xp, keys), got {on_batch!r}")
        self.mix, self.on_batch = mix, on_batch
        self._mix_in_float32 = mix is not None and output.dtype == "bfloat16"
        self.spec = echo
        self.augment, self.output = augment, output
        self.auto, self.placement = echo.auto, echo.placement
        self.echo = echo.factor
        self.passthrough = echo.off
        self.batch_size = int(batch_size)
        self.size = augment.size
        self.drop_last = bool(drop_last)
        shuffle_buffer = 4 * self.batch_size if echo.shuffle_buffer is None else \
            echo.shuffle_buffer
        if shuffle_buffer < 2 * self.batch_size:
            raise ValueError(f"shuffle_buffer must be at least 2 x batch_size "
                             f"({2 * self.batch_size}), got {shuffle_buffer}")
        self.shuffle_buffer = shuffle_buffer
        self.device = resolve(device)
        self._auto = AutoEcho(echo.max_echo) if self.auto else None
        # The ops run per emission where the echo stage makes the pixels, else in the
        # workers, once per fresh sample.
        self.program = Program(ops, augment.size, output.mean, output.std)
        if echo.placement == "before_augment" and not self.passthrough:
            transform = canvas_for(augment, echo.canvas_side, echo.canvas_max_pixels)
        elif self.program:
            transform = WithOps(augment, self.program)
        else:
            transform = augment
        # Echo stages need every sample of the epoch; echo=1 is the Loader itself.
        self.loader = Loader(source, self.batch_size, augment=transform, workers=workers,
                             slots=slots, seed=seed, shuffle=shuffle,
                             drop_last=self.drop_last and self.passthrough, on_error=on_error,
                             shard=shard, decode=decode, timeout=timeout,
                             sample_timeout=sample_timeout,
                             worker_mode=worker_mode)
        self.seed = self.loader.plan.seed
        self.num_classes = None if mix is None else (mix.num_classes or _num_classes(source))
        self._emitted = (None, 0)  # (epoch, batches emitted in it): the key of a batch op
        n, shard_n = len(source), self.loader.plan.num_samples
        if self.batch_size > shard_n:
            where = "the source" if shard_n == n else "this rank's shard"
            raise ValueError(f"batch_size {batch_size} is larger than the {shard_n} samples of "
                             f"{where}")
        # Resume bookkeeping: per fresh batch (ticket), how many of its examples
        # still await their first emission, and which ids already had it.
        self._unsent = {}
        self._sent = {}
        self._skip = set()
        self._buffer = None
        self._window = None        # (epoch, BatchWindow) of batch echo
        self._unfinished = None    # epoch of an echo iteration left early
        self._stash = []           # its emissions made but not delivered, oldest first
        self._last_echo_index = None  # of the batch delivered last, for report()
        self._yielded = None       # ticket of the last batch passed straight through
        self._outputs = {}
        self._books = _Books()
        self._iteration = IterationGuard("EchoRing")
        # The device follows the ring through restarts (a seek makes a new one).
        self.loader.watch_ring(self.device.attach, self.device.detach)

    def __reduce__(self):
        raise TypeError(_NOT_PICKLABLE.format(type(self).__name__))

    @property
    def image_size(self):
        """Output ``(height, width)`` (the augment spec's size)."""
        return self.size

    # -- life cycle -------------------------------------------------------------------
    def start(self):
        self.loader.start()
        if self._buffer is None and not self.passthrough and self.placement != "batch":
            try:
                self._buffer = ExampleBuffer(self.shuffle_buffer,
                                             self.loader.plan.transform.sample_bytes, self.device)
            except MemoryError:
                self.close()  # the workers are running already: stop them
                raise MemoryError(self._buffer_too_big()) from None
        if self._books.started == 0.0:
            self._books.started = time.perf_counter()
        return self

    def _buffer_too_big(self):
        """What the echo buffer needs and the settings that would halve it (each of them
        a real change: shuffle_buffer never goes below its minimum of 2 x batch_size)."""
        B, n = self.batch_size, self.shuffle_buffer
        transform = self.loader.plan.transform
        halve = []
        if n >= 4 * B:
            halve.append(f"shuffle_buffer={n // 2}")
        if self.placement == "before_augment":
            halve.append(f"Echo(canvas_max_pixels={transform.max_pixels // 2})")
        if B >= 2:
            halve.append(f"batch_size={B // 2} with shuffle_buffer={n // 2}")
        return (f"the echo buffer of {n} examples needs {buffer_bytes(n, transform.sample_bytes)}"
                f" on {self.device.name}, which could not be allocated; each of these halves "
                f"it: {'; '.join(halve)}")

    def close(self):
        """Stop workers, free shared memory.  Idempotent; also runs on GC and at exit.
        Every batch delivered so far stops being valid (``copy()`` what you keep), and
        every iterator taken before it is finished (its next ``next()`` raises);
        iterating again starts new workers where the stream stood."""
        self._iteration.end()
        self.loader.close()
        self._drop_stash()
        try:
            if self._buffer is not None or self._outputs:
                # Work the consumer queued may still read the last batches: the device
                # orders its reuse of this memory after it before the memory goes back.
                self.device.release_buffers()
        finally:
            self._buffer = None
            self._outputs = {}

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    # -- epochs ------------------------------------------------------------------------
    @property
    def epoch(self):
        """The epoch the next iteration works on (one left early continues)."""
        return self.loader.epoch if self._unfinished is None else self._unfinished

    def __len__(self):
        """Batches in the coming epoch (for echo="auto", the count at the current e;
        ranks of an auto-echo job may then differ: use a fixed e with DDP)."""
        B = self.batch_size
        if self.passthrough:
            return len(self.loader)
        if self.placement == "batch":
            counts = echo_counts(self.seed, self.epoch, len(self.loader), self._e())
            if self.drop_last and self.loader.plan.num_samples % B:
                counts = counts[:-1]  # the short last batch is never delivered
            return int(counts.sum())
        if self.auto:
            total = round(self.loader.plan.num_samples * self._auto.value)
        else:
            counts = counts_from(self._example_draws(self.epoch), self.echo)
            plan = self.loader.plan
            total = int(counts[plan.epoch_order(self.epoch, self.loader.source)].sum())
        return total // B if self.drop_last else math.ceil(total / B)

    def _e(self):
        return self._auto.value if self.auto else self.echo

    def __iter__(self):
        return self._iteration.iterate(self._batches)

    def _batches(self):
        self.start()
        if self.passthrough:
            gen = self._passthrough()
        elif self.placement == "batch":
            gen = self._batch_echo()
        else:
            gen = self._example_echo()
        books, auto = self._books, self._auto
        last = waited = None
        for batch in gen:
            now = time.perf_counter()
            if auto is not None and last is not None:
                # From one hand-out to the next: the consumer's step and the ring's own
                # work, less the time the ring blocked on the upstream.
                auto.consumer(now - last - (books.wait_s - waited))
            last, waited = now, books.wait_s
            books.delivered += len(batch)
            books.batches += 1
            self._last_echo_index = batch.echo_index
            yield batch
            books.consumer_s += time.perf_counter() - now

    def _passthrough(self):
        loader = self.loader
        held = loader.held()
        if held is not None and held.ticket != self._yielded:
            # Taken before an interruption (Ctrl-C) but never delivered.
            yield self._deliver(loader.batch_of(held), held.ticket)
        for _ in range(loader.left_in_epoch):
            t0 = time.perf_counter()
            filled = loader.next_filled()
            self._books.wait_s += time.perf_counter() - t0
            self._note_fill()
            yield self._deliver(loader.batch_of(filled), filled.ticket)

    def _deliver(self, b, ticket):
        """A batch straight from the ring, on the device and in the output format."""
        self._books.fresh += int(b.fresh.sum())
        self._books.fresh_batches += 1
        if not self.device.host_resident:
            # The slot goes back once its pixels are copied: keep what else it holds.
            images = self.device.to_device(b.images, self._output("images", b.images.shape))
            b = Batch(images, b.labels.copy(), b.sample_ids.copy(), b.fresh.copy(),
                      b.echo_index, b.boxes.copy(), b.flips.copy(), b.epoch)
            self.device.release_after_copies(self.loader.hand_off())
        # else the batch is the slot itself; it goes back with the next batch.
        self._yielded = ticket
        return self._finish(b.images, b.labels, b.sample_ids, b.fresh, b.echo_index, b.boxes,
                            b.flips, b.epoch)

    def _note_fill(self):
        """Add the upstream cost (worker fill time) of the batch just taken."""
        self._observe_upstream(self.loader.position - 1)

    def _observe_upstream(self, ticket):
        fill_s = self.loader.ring.fill_seconds(ticket)
        self._books.fill_s += fill_s
        if self._auto is not None:
            self._auto.upstream(fill_s / max(1, self.loader.workers))

    # -- example echo (before / after augmentation) -----------------------------------
    def _open_epoch(self):
        """The epoch an iteration works on: the loader's, unless an earlier iteration of
        an echo stage was left early (break, a caught Ctrl-C) and its epoch is not done
        yet, although all its fresh batches may have been taken from the ring."""
        if self._unfinished is None:
            self._unfinished = self.loader.epoch
        return self._unfinished

    def _example_echo(self):
        loader, buf, B = self.loader, self._buffer, self.batch_size
        epoch = self._open_epoch()
        counts = self._example_draws(epoch)  # auto echo: per sample id, for its counts
        echo_now = self._e()  # auto echo: the e the buffer's counts were made at
        if not self.auto:
            counts = counts_from(counts, self.echo)
        rng = shuffle_rng(self.seed, epoch)
        fresh_left = max(0, (epoch + 1) * len(loader) - loader.position)
        fixed = self.placement == "after_augment"
        held = loader.held()
        if held is not None:  # taken before an interruption (Ctrl-C)
            if held.ticket in self._unsent:
                self.device.release_after_copies(loader.hand_off())  # stored already
            else:
                self._store(buf, held, counts, rng, fixed)
        # Emissions made and not yet delivered, oldest first.  A host device that
        # prepares ahead makes the next batch (re-augmented, or gathered from the
        # buffer after augmentation) while the consumer works on this one, so one
        # emission stays in flight across each yield.
        ahead = self.device.prepares_ahead
        keep = 1 if ahead else 0
        made = collections.deque(self._stash)
        self._stash = []
        try:
            while True:
                while len(made) > keep:
                    batch = self._hand_over(made[0])
                    yield batch
                    made.popleft()
                if made:
                    self.device.synchronize()  # _fill may reuse the canvases it reads
                fresh_left -= self._fill(buf, counts, rng, fresh_left, fixed)
                pending = buf.pending
                want = min(B, pending)
                if want < B and fresh_left > 0:
                    continue  # _fill blocks for more fresh data
                if pending == 0 or (want < B and self.drop_last):
                    while made:
                        batch = self._hand_over(made[0])
                        yield batch
                        made.popleft()
                    if pending:
                        buf.clear()  # drop_last: the short last batch is not emitted
                    self._skip = set()
                    self._unfinished = None
                    return
                made.append(self._emit(buf, entries=buf.choose(want, rng), epoch=epoch))
                if self.auto and self._auto.value != echo_now:
                    echo_now = self._auto.value
                    live = buf.active()
                    buf.recount(live, counts_from(counts[buf.sample_id[live]], echo_now))
        except GeneratorExit:
            made.popleft()  # closed at a yield: the consumer has that batch
            raise
        finally:
            # Left early (break, Ctrl-C): what was made waits for the next iteration,
            # kept before the wait for its pixels, which a second Ctrl-C may cut short.
            self._stash = list(made)
            self.device.synchronize()

    def _example_draws(self, epoch):
        """The :func:`echo_draws` of this epoch, per sample id.

        With several ranks they are drawn per position in the rank's shard, the
        same draws on every rank, so that every rank emits the same total and
        takes the same number of steps under a fractional e.
        """
        draws = echo_draws(self.seed, epoch, len(self.loader.source))
        plan = self.loader.plan
        if plan.world_size > 1:
            order = plan.epoch_order(epoch, self.loader.source)
            draws[order] = echo_draws(self.seed, epoch, len(order))
        return draws

    def _fill(self, buf, counts, rng, fresh_left, fixed):
        """Move fresh batches from the ring into the buffer; returns how many were moved.

        Keep the buffer as full as a whole slot allows, blocking for data: with
        a fixed e the emission order then depends only on the seed, and every
        batch is drawn from a full buffer of distinct examples.  Auto echo does
        the same (repeats are kept, never evicted for fresh data; taking fresh
        data early would leave a few examples to fill whole batches back to
        back) and tells its controller when the consumer stalls: less than a
        batch left to emit and no fresh batch ready.  Waiting early costs no
        throughput: upstream-bound, the rate is the upstream's times e either
        way; consumer-bound, the buffer is full anyway.
        """
        moved, B = 0, self.batch_size
        while fresh_left - moved > 0:
            if buf.free < B:
                break
            if self.auto and buf.pending < B and not self.loader.ready() and \
                    self._books.batches:  # the first fill is start-up, not a stall
                self._auto.stalled()
            t0 = time.perf_counter()
            filled = self.loader.next_filled()
            self._books.wait_s += time.perf_counter() - t0
            self._store(buf, filled, counts, rng, fixed)
            moved += 1
        return moved

    def _store(self, buf, filled, counts, rng, fixed):
        """A fresh batch into the echo buffer, its slot back to the workers."""
        ids = filled.slot.sample_ids[:filled.count]
        k = self._auto.counts(counts[ids]) if self.auto else counts[ids]
        with _deferred_interrupts():
            self._add(buf, filled, k, fixed)
            self.device.release_after_copies(self.loader.hand_off())

    def _add(self, buf, filled, k, fixed):
        slot, n = filled.slot, filled.count
        entries = buf.allocate(n)
        self.device.store(buf, entries, slot, n, fixed)
        buf.sample_id[entries] = slot.sample_ids[:n]
        buf.label[entries] = slot.labels[:n]
        buf.ok[entries] = slot.status[:n] == OK
        buf.remaining[entries] = k
        buf.next_echo[entries] = 0
        buf.epoch[entries] = filled.epoch
        buf.ticket[entries] = filled.ticket
        buf.shape[entries] = slot.shapes[:n]
        buf.source_hw[entries] = slot.source_hw[:n]
        buf.scale[entries] = slot.canvas_scale[:n]
        buf.box[entries] = slot.boxes[:n]
        buf.flip[entries] = slot.flip[:n].view(bool)
        if self._skip:  # resumed: these already had their fresh emission before the save
            done = np.isin(buf.sample_id[entries], list(self._skip)) & buf.ok[entries]
            buf.remaining[entries[done]] = 0
        zero = entries[buf.remaining[entries] == 0]
        if len(zero):
            buf.retire(zero)
        live = entries[buf.remaining[entries] > 0]
        self._unsent[filled.ticket] = len(live)
        self._sent[filled.ticket] = []
        self._books.fresh += int(np.count_nonzero(buf.ok[live]))
        self._books.fresh_batches += 1
        self._observe_upstream(filled.ticket)

    def _emit(self, buf, entries, epoch):
        """Emit buffer ``entries``: book the echo and start making the pixels (a host
        device that prepares ahead makes them in the background).  The batch reaches
        the consumer through :meth:`_hand_over`."""
        sample_ids = buf.sample_id[entries].copy()
        tickets = buf.ticket[entries].copy()
        with _deferred_interrupts():
            echo_index = buf.emit(entries)
        first = echo_index == 0
        images = self._output("images", (len(entries), *self.size, 3))
        job = None
        if self.placement == "after_augment":
            boxes, flips = buf.box[entries].copy(), buf.flip[entries].copy()
            mirror = None
            if self.spec.flip:
                redo = echo_index > 0
                # The flip has a Philox block of its own: the image size does not matter.
                ones = np.ones((len(entries), 2), np.int32)
                new = _kernel.random_resized_crops(
                    self.seed, buf.epoch[entries], sample_ids, echo_index.astype(np.int32),
                    ones, ones.astype(np.float32), ones, flip_p=self.augment.flip_p)[1]
                mirror = redo & (new != flips)
                flips = np.where(redo, new, flips)
            job = self.device.gather(buf, entries, images, mirror)
        else:
            boxes, flips, canvas_boxes = self._crop_params(buf, entries, sample_ids, echo_index)
            job = self.device.crop_resize(buf, entries, canvas_boxes, flips, images)
            if self.program:
                codes, args = self.program.draw(self.seed, buf.epoch[entries], sample_ids,
                                                echo_index)
                job = self.device.augment(images, codes, args) or job
        fresh = (echo_index == 0) & buf.ok[entries]
        return _Emission(
            job=job,
            sent=(tickets[first], sample_ids[first], buf.ok[entries][first]),
            parts=(images, buf.label[entries].copy(), sample_ids, fresh, echo_index, boxes,
                   flips, epoch))

    def _hand_over(self, emission):
        """The batch of an emission, ready for the consumer.  Its samples count as
        sent (for :meth:`state_dict`) only now, so a batch prepared ahead and never
        delivered is read again after a resume."""
        if emission.batch is None:
            self.device.synchronize(emission.job)  # its pixels, not those made after it
            batch = self._finish(*emission.parts)
            with _deferred_interrupts():
                self._note_sent(*emission.sent)
                emission.batch = batch
        return emission.batch

    def _drop_stash(self):
        """Forget emissions an interrupted iteration left (seek, new epoch, close)."""
        if self._stash:
            self.device.synchronize()
            self._stash = []

    def _note_sent(self, tickets, sample_ids, ok):
        """First emissions of fresh batches ``tickets``; ``ok`` is False for a stand-in
        (a replacement for a sample that failed), whose id did not get its own fresh
        emission and must still get it after a resume."""
        for t, sid, own in zip(tickets.tolist(), sample_ids.tolist(), ok.tolist()):
            self._unsent[t] -= 1
            if own:
                self._sent[t].append(sid)
        # Forget batches that are fully sent and older than any partly sent one.
        oldest = min((t for t, left in self._unsent.items() if left), default=None)
        for t in [t for t in self._unsent if oldest is None or t < oldest]:
            if not self._unsent[t]:
                del self._unsent[t], self._sent[t]

    # -- resume ------------------------------------------------------------------------------
    def state_dict(self):
        """Position in the fresh stream, for exact resume.

        Restoring it re-reads from the oldest fresh batch that still had
        examples waiting for their first emission, and skips the examples of
        those batches that were already emitted, so across the save no sample
        is read fresh twice or skipped.  The echo buffer itself is not saved:
        echoes still owed for examples emitted before the save are dropped.

        The dict holds plain values (JSON and pickle): :meth:`Loader.state_dict`'s
        at that ticket, plus ``skip``, ``echo`` and ``placement``.  The states of
        all ranks together resume in a job of another world size (see
        :meth:`load_state_dict`).
        """
        pending = [t for t, left in self._unsent.items() if left]
        ticket = min(pending) if pending else self.loader.position
        skip = {sid for t, ids in self._sent.items() if t >= ticket for sid in ids}
        # Ids skipped since a restore were emitted before the state it came from.
        skip = sorted(skip | self._skip)
        state = self.loader._state_at(ticket)
        state.update(skip=skip, echo=self.echo, placement=self.placement)
        return state

    def load_state_dict(self, state):
        """Continue from saved state (before iterating; any worker count).

        Parameters
        ----------
        state : dict or sequence of dict
            This rank's own :meth:`state_dict`, in a job of the same world size,
            or the states of all ranks of the saved job (a list, or
            :func:`echo_native.merge_states` of it), in a job of any world size:
            the samples no saved rank had emitted fresh are split over this
            job's ranks, each read fresh once, with equal steps per rank (see
            :meth:`Loader.load_state_dict`).
        """
        if not isinstance(state, (dict, list, tuple)):
            raise TypeError(f"load_state_dict takes a state_dict() (a dict), or the list of "
                            f"every rank's, got {type(state).__name__}")
        if not isinstance(state, dict):
            state = list(state)
        saved = state if isinstance(state, list) else [state] + state.get("ranks", [])
        for s in saved:
            if isinstance(s, dict) and s.get("placement", self.placement) != self.placement:
                raise ValueError(f"state was saved with placement={s['placement']!r}, this "
                                 f"ring has {self.placement!r}")
        self._iteration.end()  # an iterator of the old stream must not read the new one
        self.loader.load_state_dict(state)
        # Resumed from all ranks, the plan leaves out what was emitted: nothing to skip.
        elastic = isinstance(state, list) or "ranks" in state
        self._skip = set() if elastic else set(int(s) for s in state.get("skip", ()))
        self._unsent, self._sent = {}, {}
        self._drop_stash()
        self._window = self._unfinished = None
        if self._buffer is not None:
            self._buffer.clear()

    def set_epoch(self, epoch):
        """As ``DistributedSampler.set_epoch``: the next iteration is ``epoch``."""
        epoch = check_epoch(epoch, len(self.loader))
        if self.epoch != epoch:
            self._iteration.end()
            self._skip = set()
            self._drop_stash()
            self._window = self._unfinished = None
            if self._buffer is not None:
                self._buffer.clear()
        self.loader.set_epoch(epoch)

    def _crop_params(self, buf, entries, sample_ids, echo_index):
        """RandomResizedCrop of each emission, drawn in the original image's
        coordinates from (seed, epoch, sample id, echo index), then mapped
        onto the stored canvas: (boxes, flips, canvas boxes), in one native call."""
        crop = self.augment
        return _kernel.random_resized_crops(
            self.seed, buf.epoch[entries], sample_ids, np.asarray(echo_index, np.int32),
            buf.source_hw[entries], buf.scale[entries], buf.shape[entries], crop.scale,
            crop.ratio, crop.flip_p)

    def _output(self, kind, shape, dtype=np.uint8, count=None):
        """The next of the device's rotating output buffers of ``kind`` (its
        ``output_buffers``: two on the host, three on a GPU), ``shape[0]`` rows: a
        delivered batch stays valid until the batch after next either way.  Scratch
        that never reaches the consumer needs only ``count=1``."""
        full = (self.batch_size,) + tuple(shape[1:])
        count = count or max(2, int(self.device.output_buffers))
        slot = self._outputs.get(kind)
        if slot is None or slot[0][0].shape != full or slot[0][0].dtype != dtype or \
                len(slot[0]) != count:
            if slot is not None:
                self.device.release_buffers()  # the old buffers go back to the device
            slot = self._outputs[kind] = [[self.device.empty(full, dtype)
                                           for _ in range(count)], count - 1]
        slot[1] = (slot[1] + 1) % count
        return self.device.reuse(slot[0][slot[1]][:shape[0]])

    # -- batch echo ------------------------------------------------------------------------
    def _batch_echo(self):
        loader = self.loader
        epoch = self._open_epoch()
        nb = len(loader)
        # auto echo: the draws, for counts at the e of the moment
        counts = echo_draws(self.seed, epoch, nb) if self.auto else \
            echo_counts(self.seed, epoch, nb, self.echo)
        rng = shuffle_rng(self.seed, epoch)
        # The window outlives one iteration: leaving the loop early (break, a
        # caught Ctrl-C) and iterating again goes on with the batches it holds.
        if self._window is None or self._window[0] != epoch:
            self._window = (epoch, BatchWindow(max(2, self.shuffle_buffer // self.batch_size)))
        window = self._window[1]
        held = loader.held()
        if held is not None:  # taken before an interruption (Ctrl-C)
            if held.ticket in self._unsent:
                self.device.release_after_copies(loader.hand_off())  # in the window already
            else:
                self._window_add(window, loader.batch_of(held), held.ticket, counts, rng, nb)
        while True:
            while loader.position < (epoch + 1) * nb and self._want_fresh_batch(window):
                t0 = time.perf_counter()
                b = loader.next_batch()
                self._books.wait_s += time.perf_counter() - t0
                self._note_fill()
                self._window_add(window, b, loader.position - 1, counts, rng, nb)
            if not len(window):
                self._skip = set()
                self._window = None
                self._unfinished = None
                return
            with _deferred_interrupts():
                b, echo, ticket = window.take(rng, fresh_first=self.auto)
                if echo == 0:
                    self._unsent[ticket] = 0
                    self._sent[ticket] = b.sample_ids[b.fresh].tolist()  # not stand-ins
                    none = np.empty(0, np.int64)
                    self._note_sent(none, none, none)  # forget older, fully sent batches
            if self.drop_last and len(b) < self.batch_size:
                continue
            images = self.device.copy(b.images, self._output("images", b.images.shape))
            yield self._finish(images, b.labels.copy(), b.sample_ids.copy(),
                               b.fresh & (echo == 0), np.full(len(b), echo, np.int64),
                               b.boxes.copy(), b.flips.copy(), epoch)

    def _window_add(self, window, b, ticket, counts, rng, nb):
        """A fresh batch (the slot's views) into the batch-echo window, as a copy."""
        if self._skip and np.isin(b.sample_ids[b.fresh], list(self._skip)).all():
            b.release()  # resumed: this batch was emitted before the save
            return
        self._books.fresh += int(b.fresh.sum())
        self._books.fresh_batches += 1
        batch = b.copy() if self.device.host_resident else \
            Batch(self.device.to_device(b.images), b.labels.copy(), b.sample_ids.copy(),
                  b.fresh.copy(), b.echo_index.copy(), b.boxes.copy(), b.flips.copy(),
                  b.epoch)  # owns its memory: the slot goes back to the workers below
        with _deferred_interrupts():
            self.device.release_after_copies(self.loader.hand_off())
            k = counts[ticket % nb]
            window.add(batch, self._auto.counts(k) if self.auto else k, ticket)
            self._unsent[ticket], self._sent[ticket] = 1, []

    def _want_fresh_batch(self, window):
        """Batch echo: pull the next fresh batch now?  While the window has room (as
        in :meth:`_fill`: repeats are kept); auto echo counts a stall when no
        batch is left to repeat and no fresh one is ready."""
        if len(window) >= window.size:
            return False
        if self.auto and not len(window) and not self.loader.ready() and self._books.batches:
            self._auto.stalled()
        return True

    # -- output ------------------------------------------------------------------------------
    def _finish(self, images, labels, sample_ids, fresh, echo_index, boxes, flips, epoch):
        out_spec = self.output
        if out_spec.normalized:
            mean, std = out_spec.mean, out_spec.std
            n, h, w, _ = images.shape
            shape = (n, h, w, 3) if out_spec.layout == "NHWC" else (n, 3, h, w)
            if self._mix_in_float32:
                # NumPy and CuPy cannot mix bfloat16, and mixing rounded pixels would
                # round twice: mix the float32 batch, round once (_batch_ops).  The
                # scratch never leaves _finish, so one buffer does.
                out = self._output("mix scratch", shape, np.float32, count=1)
            else:
                out = self._output("normalized", shape, storage_dtype(out_spec.dtype))
            images = self.device.normalize(images, mean, std, out_spec.layout, out)
            if out.dtype == np.uint16:
                images = BFloat16Array(images, self.device)
        targets = None
        if self.mix is not None or self.on_batch is not None:
            images, targets = self._batch_ops(images, labels, sample_ids, echo_index, epoch)
        return self.device.ready(Batch(images, labels, sample_ids, fresh, echo_index, boxes,
                                       np.asarray(flips, bool), epoch, targets=targets))

    def _batch_ops(self, images, labels, sample_ids, echo_index, epoch):
        """MixUp/CutMix, then the user's op, on the batch where it lives.  Their draws
        are keyed by (seed, epoch, batch index in the epoch): every emission, an echo
        included, draws afresh, and never depending on workers or timing."""
        last_epoch, k = self._emitted
        k = k if last_epoch == epoch else 0
        self._emitted = (epoch, k + 1)
        targets = None
        if self.mix is not None:
            rng = batch_rng(self.seed, epoch, k)
            h, w = self.size
            lam, box = mix_params(self.mix, rng, h, w)
            self.device.mix(images, lam, box, self.output.layout)
            targets = self.device.targets(labels, self.num_classes, lam,
                                          self.mix.label_smoothing)
            if self._mix_in_float32:
                bits = self._output("normalized", images.shape, np.uint16)
                images = BFloat16Array(self.device.to_bfloat16(images, bits), self.device)
        if self.on_batch is not None:
            keys = np.empty((len(labels), 4), np.int64)
            keys[:, 0], keys[:, 1] = self.seed, epoch
            keys[:, 2], keys[:, 3] = sample_ids, echo_index
            # On the device's stream: after the batch's kernels, before ready()'s event.
            out = self.device.run_user_op(self.on_batch, images, keys)
            if out is not None:
                if tuple(out.shape) != tuple(images.shape) or out.dtype != images.dtype:
                    raise ValueError(f"on_batch returned {out.dtype} {tuple(out.shape)}, "
                                     f"expected {images.dtype} {tuple(images.shape)} (or None "
                                     f"after changing images in place)")
                images = out
        return images, targets

    # -- books --------------------------------------------------------------------------------
    def report(self, losses):
        """Per-example training losses of the batch delivered last (``echo="auto"``).

        ``losses`` has one value per row, e.g. ``F.cross_entropy(logits, y,
        reduction="none")``: a PyTorch tensor (on any device), a JAX, CuPy or NumPy
        array, or a list.  Auto echo compares the loss of echoed rows with fresh
        ones and lowers e once repeats have become clearly easier than fresh data
        (see :class:`echo_native.echo.AutoEcho`).  With a fixed e it does nothing.
        Call it after the step, before taking the next batch.
        """
        if self._last_echo_index is None:
            raise RuntimeError("report(): no batch has been delivered yet")
        values = _host_floats(losses)
        n = len(self._last_echo_index)
        if values.shape != (n,):
            raise ValueError(f"report() takes one loss per row of the last batch ({n}), got "
                             f"shape {values.shape} (use reduction='none')")
        if self._auto is not None:
            self._auto.losses(values, self._last_echo_index)

    def stats(self):
        """Rates and counters since start (see README, "Reading stats()")."""
        s = self._books
        elapsed = time.perf_counter() - s.started if s.started else 0.0
        low = self.loader.stats()
        t_down = s.consumer_s / s.batches if s.batches else 0.0
        t_up = s.fill_s / max(1, self.loader.workers) / s.fresh_batches if s.fresh_batches else 0.0
        return {
            "fresh": s.fresh,
            "delivered": s.delivered,
            "batches": s.batches,
            "fresh_per_s": s.fresh / elapsed if elapsed else 0.0,
            "delivered_per_s": s.delivered / elapsed if elapsed else 0.0,
            "effective_echo": s.delivered / s.fresh if s.fresh else 0.0,
            "echo_factor": self._e(),
            # echo="auto": every change of e, when (t_s, batch), to what, and why.
            "echo_trace": list(self._auto.trace) if self._auto else [],
            "echo_loss_ratio": self._auto.loss_ratio if self._auto else None,
            "estimated_R": t_up / t_down if t_down > 0 else float("nan"),
            "stall_s": s.wait_s,
            "consumer_s": s.consumer_s,
            "ring_occupancy": low["ring_occupancy"],
            "buffer_fill": (len(self._buffer) / self._buffer.capacity) if self._buffer else 0.0,
            "failures": low["failures"],
            "accepted_with_warnings": low["accepted_with_warnings"],
            "dropped": low["dropped"],
            "worker_restarts": low["worker_restarts"],
            "device": self.device.describe(),
        }


def _num_classes(source):
    classes = getattr(source, "classes", None)
    if classes is not None and len(classes):
        return len(classes)
    labels = np.asarray(source.labels)
    return int(labels.max()) + 1 if len(labels) else 1


def _host_floats(values):
    """A 1-D float64 NumPy copy of losses from any framework, without importing one."""
    if hasattr(values, "detach"):       # torch: leave autograd, then the device
        values = values.detach()
    if hasattr(values, "cpu"):
        values = values.cpu()
    elif hasattr(values, "get") and hasattr(values, "__cuda_array_interface__"):  # CuPy
        values = values.get()
    values = np.asarray(values, dtype=np.float64)
    return values.reshape(-1) if values.ndim else values


class _Emission:
    """One emitted batch on its way to the consumer: its parts for ``_finish``, the
    fresh samples it sends (booked at hand-over), and the batch once handed over."""

    __slots__ = ("job", "sent", "parts", "batch")

    def __init__(self, job, sent, parts):
        self.job, self.sent, self.parts, self.batch = job, sent, parts, None


class _Books:
    def __init__(self):
        self.started = 0.0
        self.fresh = self.delivered = self.batches = self.fresh_batches = 0
        self.wait_s = self.consumer_s = self.fill_s = 0.0


@contextlib.contextmanager
def _deferred_interrupts():
    """Hold a Ctrl-C until the block is done.

    The block moves examples between the ring, the echo buffer and a batch; a
    KeyboardInterrupt in its middle would lose an example or emit one twice,
    and a training loop may catch the interrupt and iterate on.  Only the main
    thread receives KeyboardInterrupt, and only there can the handler be
    swapped; a handler the user installed is left alone.
    """
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    caught = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if caught:
            raise KeyboardInterrupt


def _fold_echo(echo, shorthands):
    """``echo=`` as an :class:`Echo`, with the flat shorthands folded in."""
    keys = {"placement": "placement", "shuffle_buffer": "shuffle_buffer",
            "max_echo": "max_echo", "canvas_side": "canvas_side",
            "canvas_max_pixels": "canvas_max_pixels", "echo_flip": "flip"}
    given = {keys[k]: shorthands.pop(k) for k in list(shorthands) if k in keys}
    if isinstance(echo, Echo):
        if given:
            raise TypeError(f"EchoRing: give either echo=Echo(...) or "
                            f"{', '.join(sorted(given))}, not both")
        return echo
    if not isinstance(echo, (str, int, float, np.integer, np.floating)) or \
            isinstance(echo, bool):
        raise ValueError(f"echo must be an echo_native.Echo, a number >= 1 or 'auto', got "
                         f"{echo!r}")
    try:
        return Echo(echo, **given)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace("Echo: factor", "echo")) from None


def _fold_output(output, shorthands):
    """``output=`` as an :class:`Output`, with ``normalize``/``layout``/``dtype`` folded in."""
    given = {k: shorthands.pop(k) for k in ("normalize", "layout", "dtype") if k in shorthands}
    if given:
        if output is not None:
            raise TypeError(f"EchoRing: give either output=Output(...) or "
                            f"{', '.join(sorted(given))}, not both")
        if not given.get("normalize"):
            # The flat contract checked layout and dtype but used them only with
            # normalisation: check them the same way, then give uint8.
            Output(normalize=True, layout=given.get("layout", "NHWC"),
                   dtype=given.get("dtype", "float32"))
            return Output(normalize=False)
        return Output(**given)
    if output is None:
        return Output(normalize=False)
    if not isinstance(output, Output):
        raise TypeError(f"output must be an echo_native.Output or None, got {output!r}")
    return output

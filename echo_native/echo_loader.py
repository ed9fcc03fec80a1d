"""Echo for any pipeline: :class:`EchoLoader` wraps an existing loader in one line.

The data-echoing paper puts its echo stage after whatever the bottleneck is,
in image, detection and language-model workloads alike.  ``EchoLoader`` is
that stage for a loader you already have (a torch ``DataLoader``, Hugging
Face ``datasets``, Grain, a tokenizer over text shards, a generator): the
same echo stages :class:`EchoRing` runs (:mod:`echo_native.echo.stages`),
over an :class:`~echo_native.echo.iterable.IterableUpstream`, with the user's batches stored and
gathered where they live (:mod:`echo_native.echo.pytree`).
"""
from __future__ import annotations

import copy
import warnings

import numpy as np

from echo_native._checks import is_int
from echo_native._iteration import IterationGuard, Started
from echo_native.backends.array import ArrayDevice
from echo_native.echo.pytree import PytreeExamples
from echo_native.echo.spec import Echo, fold_echo
from echo_native.echo.iterable import STATE_KEYS as UPSTREAM_KEYS
from echo_native.echo.iterable import (IterableUpstream, _declared_batch_size,
                                       _refuse_non_loader, _shuffle_seed)
from echo_native.echo.stage import check_stage_args
from echo_native.echo.state import STAGE_KEYS, checked_split, nest
from echo_native.echo.stages import BatchEcho, make_stage
from echo_native.echo.upstream import EpochEnd
from echo_native.resume import check_epoch

#: An EchoLoader's own keys in its state: the stage's, and its seed (a flat state, saved
#: before the nesting, holds them beside the wrapped loader's position).
_OWN_KEYS = (*STAGE_KEYS, "seed")


class EchoLoader(Started):
    """Data echoing around any loader: an iterable of batches in, the same kind out.

    Parameters
    ----------
    iterable : any iterable of batches (a torch ``DataLoader``, a Hugging Face
        dataset's ``ds.iter(batch_size=...)`` or ``ds.batch(n)``; a generator
        function's result is one epoch only).  Not a path (use :class:`EchoRing` for
        a folder of images) and not a Hugging Face dataset of single examples: both
        are refused here.
        Batches are NumPy arrays, torch tensors (CPU or CUDA), JAX or CuPy arrays,
        ``pyarrow`` tables, or dicts, lists, tuples, namedtuples or dataclasses of
        them; every array holds one row per example (the batch dimension first); a
        list whose length is the batch size holds one value per example (a string, a
        list of token ids, a ragged array) and follows its example whole (the rule:
        :mod:`echo_native.echo.pytree`).
    echo : float >= 1, "auto", or Echo, default 2.0
        As :class:`EchoRing`'s.  A number uses ``placement="before_augment"`` with
        ``augment`` and ``"after_augment"`` without; ``Echo(e, placement="batch")``
        repeats whole batches.  ``"auto"``: e follows the measured ratio of the
        time spent waiting on the wrapped loader to the consumer's time between
        batches, with :class:`EchoRing`'s controller and ``stats()["echo_trace"]``.
    augment : callable(batch, keys) or None
        Before augmentation: run on every emitted batch (each repeat is augmented
        afresh); ``keys`` is a host (B, 4) int64 array of (seed, epoch, example id,
        echo index) per row (a seed >= 2**63 as its 64 bits: ``keys[:, 0].view(np.uint64)``
        is the seed) to draw its randomness from.  Return the augmented
        batch (or None after changing it in place).
    seed : int, default 0
        Echo counts and the order of emissions are pure functions of it.
    batch_size : int, optional
        Examples per emitted batch (default: the wrapped loader's first batch's).
    shuffle_buffer : int, optional
        Examples held by the echo stage (default 4 x batch_size, at least 2 x).  A
        batch never holds an example twice: the epoch's last batch may be short, as
        ``DataLoader(drop_last=False)``'s.  ``len()`` is exact with a buffer of at
        least (ceil(e) + 1) x batch_size (the default up to e = 3); a smaller one may
        end an epoch with one more short batch, when its last fresh examples' repeats
        outnumber the batches left.
    max_buffer_bytes : int or None, default 4 GiB
        The most the shuffle buffer (batch echo: its window of batch copies) may
        hold (None: no cap of its own); more is a MemoryError at the first batch
        naming the setting to lower.
        A buffer in host memory is also checked then against the memory available
        (``MemAvailable``, the memory cgroup's headroom), as :class:`EchoRing`'s
        is: ``RingMemoryError`` naming ``shuffle_buffer``, never the OOM killer.
    drop_last : bool, default False
        Drop the epoch's short batches (its last, when short).
    with_info : bool, default False
        Yield ``(batch, info)``, ``info`` a dict of per-row ``sample_ids``,
        ``echo_index`` (0 for the fresh emission) and ``fresh``.
    """

    def __init__(self, iterable, echo=2.0, *, augment=None, seed=0, batch_size=None,
                 shuffle_buffer=None, max_buffer_bytes=4 << 30, drop_last=False,
                 with_info=False):
        _refuse_non_loader(iterable)
        if not hasattr(iterable, "__iter__"):
            raise TypeError(f"EchoLoader wraps an iterable of batches, got "
                            f"{type(iterable).__name__}")
        if augment is not None and not callable(augment):
            raise TypeError(f"augment must be callable(batch, keys), got {augment!r}")
        seed, batch_size, shuffle_buffer = check_stage_args(seed, batch_size, shuffle_buffer)
        if max_buffer_bytes is not None and (not is_int(max_buffer_bytes) or
                                             max_buffer_bytes < 1):
            raise ValueError(f"max_buffer_bytes must be a positive integer or None (no cap), "
                             f"got {max_buffer_bytes!r}")
        self.spec = _placed(fold_echo("EchoLoader", echo), augment)
        if batch_size is not None and self.spec.placement == "batch" and not self.spec.off:
            raise ValueError("batch_size= does not apply to batch echo, which repeats the "
                             "wrapped loader's batches whole: set the wrapped loader's batch "
                             "size instead")
        self.augment, self.seed = augment, int(seed)
        self.batch_size, self.drop_last, self.with_info = batch_size, bool(drop_last), with_info
        self._shuffle_buffer = shuffle_buffer
        self.examples = PytreeExamples(augment, self.seed, max_buffer_bytes)
        self.resumable = hasattr(iterable, "state_dict") and hasattr(iterable, "load_state_dict")
        # The wrapped states from the oldest fresh batch with an example still unsent on,
        # for a state there: as many batches as the shuffle buffer holds back.
        self.upstream = IterableUpstream(iterable, keep_states=self.resumable)
        self.iterable = iterable
        self.stage = None
        self._restored_skip = ()
        self._reopen = None     # what close() left for the next iteration (see close)
        self._iteration = IterationGuard("EchoLoader", hold_interrupts=True)

    # -- the stage, made at the first batch (its size is the wrapped loader's) --------------
    def _make_stage(self, B):
        stage = self._new_stage(B, self._shuffle_buffer)
        if isinstance(stage, BatchEcho):
            self.examples.window = stage.window_size
        stage.start()
        return stage

    def _new_stage(self, B, shuffle_buffer):
        return make_stage(self.spec, self.upstream, self.examples, self._finish, seed=self.seed,
                          batch_size=B, shuffle_buffer=shuffle_buffer,
                          drop_last=self.drop_last, device=ArrayDevice(np))

    def _finish(self, emitted):
        return emitted

    def _ensure_stage(self):
        if self.stage is None:
            fresh = self.upstream.next_fresh()   # held: the stage takes it first
            while not fresh.count and self.batch_size is None:
                # An empty batch says nothing of the batch size: the first with examples
                # does (and an empty batch has nothing to echo).
                self.upstream.hand_off()
                fresh = self.upstream.next_fresh()
            self.stage = self._make_stage(self.batch_size or fresh.count)
            self.upstream.oldest_needed = self.stage.ledger.oldest
            if self._restored_skip:
                self.stage.ledger.clear(self._restored_skip)

    # -- iteration ---------------------------------------------------------------------------
    def __iter__(self):
        return self._iteration.iterate(self._batches)

    def _batches(self):
        self._reopened()
        try:
            self._ensure_stage()
        except EpochEnd:
            return  # the wrapped loader yielded nothing this epoch
        self.stage.start()   # again after close(): the buffer it let go of
        for emitted in self.stage.batches():
            if self.with_info:
                yield emitted.batch, {"sample_ids": emitted.sample_ids,
                                      "echo_index": emitted.echo_index,
                                      "fresh": emitted.fresh}
            else:
                yield emitted.batch

    def __len__(self):
        """Batches in the coming epoch, as the stage counts them, where the wrapped loader
        has a length (for example echo, from its dataset's length; for auto, at the
        current e)."""
        up, echo, name = self.upstream, self.spec, type(self.iterable).__name__
        if up.batches_per_epoch is None:
            raise TypeError(f"the wrapped {name} has no len()")
        example_echo = not echo.off and echo.placement != "batch"
        if example_echo and up.samples_per_epoch is None:
            raise TypeError(f"EchoLoader: len() needs the examples per epoch, and the wrapped "
                            f"{name} does not say how many (a DataLoader over a dataset with "
                            f"len() does)")
        stage = self.stage
        if stage is None:  # not made yet (no batch taken): one like it, never started
            B = self.batch_size or _declared_batch_size(self.iterable)
            if B is None and example_echo:
                raise TypeError(f"EchoLoader: len() needs the emitted batch size, and the "
                                f"wrapped {name} does not say it: give batch_size=, or take "
                                f"a batch first")
            # Without it, pass-through and batch echo count the wrapped loader's batches
            # (batch echo's short last batch is then counted: take a batch first to know
            # it).  The count depends on neither the batch size nor the buffer's: the
            # buffer is checked when the stage is made for iterating.
            stage = self._new_stage(B or 1, None)
        return stage.batches_in(self.epoch)

    @property
    def epoch(self):
        return self.stage.epoch if self.stage is not None else self.upstream.epoch

    def set_epoch(self, epoch):
        """As ``DistributedSampler.set_epoch``: the next iteration is ``epoch``; passed on
        to the wrapped loader (its own ``set_epoch``, or its sampler's)."""
        epoch = check_epoch(epoch, self.upstream.batches_per_epoch or 1)
        if self._iteration.busy():
            raise RuntimeError("EchoLoader.set_epoch while another thread is inside next(): "
                               "call it from the iterating thread between epochs; to stop a "
                               "loader stuck in the wrapped loader, close() it (any thread)")
        if epoch != self.epoch:
            self._iteration.end()
        self._reopen = None
        self._to_epoch(epoch)

    def _to_epoch(self, epoch):
        for target in (self.iterable, getattr(self.iterable, "sampler", None),
                       getattr(getattr(self.iterable, "batch_sampler", None), "sampler", None),
                       getattr(self.iterable, "dataset", None)):
            if target is not None and hasattr(target, "set_epoch"):
                target.set_epoch(epoch)
                break
        if epoch != self.epoch:
            if self.stage is not None:
                self.stage.reset()
            self.upstream.set_epoch(epoch)

    # -- resume ------------------------------------------------------------------------------
    def state_dict(self):
        """Where the fresh stream stands, for a resume that neither repeats nor loses a
        fresh example: ``parent``, the wrapped loader's position from before the oldest
        fresh batch with an example not yet emitted (its own ``state_dict()`` under
        ``wrapped``, the batch and example counts, what the wrapped loader was), the
        ids emitted since (``skip``), ``echo``, ``placement`` and ``seed``
        (:mod:`echo_native.echo.state`).  Needs a wrapped loader with
        ``state_dict``/``load_state_dict`` (torchdata's ``StatefulDataLoader``, a
        Hugging Face ``IterableDataset``...)."""
        if not hasattr(self.iterable, "state_dict"):
            raise TypeError(f"EchoLoader.state_dict needs a wrapped loader with state_dict() "
                            f"and load_state_dict() (e.g. torchdata's StatefulDataLoader); "
                            f"{type(self.iterable).__name__} has none")
        if self._reopen is not None and "parent" in self._reopen:
            state = copy.deepcopy(self._reopen)   # closed: where the next iteration starts
        elif self.stage is None:
            state = nest(self.upstream.state_at(self.upstream.position),
                         sorted(self._restored_skip))
        else:
            state = self.stage.state()
        state.update(echo=self.spec.factor, placement=self.spec.placement, seed=self.seed)
        return state

    def load_state_dict(self, state):
        """Continue from a :meth:`state_dict` (of an EchoLoader over the same wrapped
        loader: the same length, batch size and order).  Every value is checked, and
        refused naming its key, before anything is loaded.  A state saved flat, before
        the wrapped loader's position was nested in it, loads too."""
        parent, own = self._check_state(state)
        self._iteration.end()
        self._reopen = None
        self._load(parent, own["skip"])

    def _check_state(self, state):
        """``(parent, own)`` of ``state`` once every value is one this loader can
        continue from; a ValueError (TypeError) naming the key otherwise."""
        parent, own = checked_split(state, "an EchoLoader", own=_OWN_KEYS, required=("skip",),
                                    parent_required=("ticket", "epoch", "index", "first_id",
                                                     "wrapped"),
                                    parent_keys=UPSTREAM_KEYS, merged=False)
        at = "state['parent']" if "parent" in state else "state"
        if not self.resumable:
            raise TypeError(f"EchoLoader.load_state_dict needs a wrapped loader with "
                            f"state_dict() and load_state_dict(); "
                            f"{type(self.iterable).__name__} has none")
        up = self.upstream
        mine = {"seed": self.seed, "placement": self.spec.placement,
                "upstream_batches": up.batches_per_epoch,
                "upstream_samples": up.samples_per_epoch,
                # Only a declared one: the largest batch yet differs from run to run.
                "upstream_batch_size": _declared_batch_size(self.iterable),
                "upstream_seed": _shuffle_seed(self.iterable)}
        for key, value in mine.items():
            theirs = (own if key in _OWN_KEYS else parent).get(key)
            if theirs is not None and value is not None and theirs != value:
                what = {"upstream_batches": "batches per epoch (len())",
                        "upstream_samples": "examples per epoch",
                        "upstream_batch_size": "batch size",
                        "upstream_seed": "shuffle seed"}.get(key, key)
                raise ValueError(f"state was saved with {key}={theirs!r}, this EchoLoader has "
                                 f"{key}={value!r}: the wrapped loader's {what} differs, and "
                                 f"its stream would not continue exactly (examples read twice "
                                 f"or never)")
        # Where the state stands must be inside an epoch of this wrapped loader: ids are
        # positions in the epoch's stream, at most B per batch.
        nb, B = up.batches_per_epoch, _declared_batch_size(self.iterable)
        index, first = parent["index"], parent["first_id"]
        if nb is not None and index > nb:
            raise ValueError(f"{at}['index'] is {index}, past the wrapped loader's {nb} "
                             f"batches per epoch")
        n = up.samples_per_epoch or (nb * B if nb and B else None)
        if (n is not None and first > n) or (B is not None and first > index * B):
            raise ValueError(f"{at}['first_id'] is {first}, more examples than "
                             f"{index} batches of the wrapped loader hold"
                             + (f" (an epoch has {n})" if n is not None else ""))
        if n is not None:
            skip = [int(i) for i in own["skip"]]
            if skip and max(skip) >= n:
                raise ValueError(f"state['skip'] lists example {max(skip)}, past the "
                                 f"{n} of an epoch of the wrapped loader")
            if first < n and sum(i >= first for i in skip) >= n - first:
                raise ValueError(f"state['skip'] lists every example from {first} to the end "
                                 f"of the epoch ({n}) as emitted, yet the state stands before "
                                 f"them: it is not a state_dict() of this EchoLoader")
        return parent, own

    def _load(self, parent, skip):
        self.upstream.load(parent)
        skip = tuple(int(i) for i in skip)
        if self.stage is not None:
            self.stage.reset(skip)
        else:
            self._restored_skip = skip

    # -- books --------------------------------------------------------------------------------
    def stats(self):
        """Fresh and delivered counts and rates, the effective echo, auto echo's trace, the
        time spent waiting for the wrapped loader, and the shuffle buffer's bytes."""
        if self.stage is None:
            return {"fresh": 0, "delivered": 0, "effective_echo": 0.0, "buffer_bytes": 0}
        return {**self.stage.stats(), "buffer_bytes": self.examples.nbytes}

    def close(self):
        """End iteration, let go of the wrapped loader's iterator (its workers) and of the
        shuffle buffer.  Idempotent.  Iterating again starts where the stream stood
        (as :class:`EchoRing`'s): closed mid-epoch, a wrapped loader with
        ``state_dict()`` is read again from where :meth:`state_dict` says, so no
        example is lost or repeated; one without reads its next epoch (a warning
        says what was left unread), and an iterator (a generator) reads on."""
        if not self._iteration.stop(then=self.close):
            # Another thread is inside next(), blocked in the wrapped loader (a watchdog
            # stopping a stuck loader): a loader with worker processes is told to stop
            # them, which ends that wait with its error; the rest of close() runs in that
            # thread as its iteration ends.
            self.upstream.interrupt()
            return
        if self._reopen is None and self.stage is not None and self._mid_epoch():
            self._reopen = {"epoch": self.epoch}
            if self.resumable:
                try:
                    self._reopen = self.state_dict()
                except Exception as err:   # close() must close: read on as without state
                    warnings.warn(f"EchoLoader.close: the state to continue from could not "
                                  f"be taken ({type(err).__name__}: {err})", RuntimeWarning,
                                  stacklevel=2)
        self.upstream.close()
        if self.stage is not None:
            self.stage.close()

    def _mid_epoch(self):
        up = self.upstream
        return up.held() is not None or up._index > 0 or self.stage._unfinished is not None

    def _reopened(self):
        """Iterating after close(): back where the stream stood (see :meth:`close`)."""
        state, self._reopen = self._reopen, None
        if state is None:
            return
        if "parent" in state:   # a state_dict(), taken as close() closed
            self._load(state["parent"], state["skip"])
            return
        it = self.iterable
        if iter(it) is it:   # an iterator reads on; what the buffer held is gone
            what = "its examples held in the shuffle buffer are not emitted"
            self.stage.reset()
        else:
            what = f"the rest of epoch {state['epoch']} is not read; epoch " \
                   f"{state['epoch'] + 1} starts"
            self._to_epoch(state["epoch"] + 1)
        warnings.warn(f"EchoLoader was closed mid-epoch and the wrapped {type(it).__name__} "
                      f"has no state_dict() to continue from: {what} (wrap a loader with "
                      f"state_dict(), e.g. torchdata's StatefulDataLoader, to continue "
                      f"exactly)", RuntimeWarning, stacklevel=4)

    def start(self):
        """Nothing to start before the first batch (the ``with`` block's entry)."""
        return self


def _placed(echo, augment):
    """The placement an EchoLoader uses: before augmentation needs ``augment``."""
    if echo.placement == "before_augment" and augment is None:
        return Echo(echo.factor, "after_augment", echo.shuffle_buffer, echo.max_echo)
    if echo.placement != "before_augment" and augment is not None and not echo.off:
        raise ValueError(f"augment= runs on every emission before augmentation; with "
                         f"placement={echo.placement!r} the wrapped loader augments")
    if echo.flip or echo.canvas_side or echo.canvas_max_pixels:
        raise ValueError("Echo's flip, canvas_side and canvas_max_pixels apply to EchoRing's "
                         "images, not to EchoLoader")
    return echo

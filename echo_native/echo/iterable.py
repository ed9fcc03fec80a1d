"""A user's loader as an :class:`~echo_native.echo.upstream.Upstream`:
:class:`IterableUpstream` reads fresh batches from any iterator of batches (a torch
``DataLoader``, Hugging Face ``datasets``, a generator) for :class:`EchoLoader`'s
echo stage, and the helpers below read what a wrapped loader tells of itself: its
length, batch size and shuffle seed, or that it is not a loader of batches at all.
"""
from __future__ import annotations

import collections
import copy
import os
import time
import warnings

import numpy as np

from echo_native._checks import is_int
from echo_native._iteration import deferred_interrupts, second_press
from echo_native.batch import Fresh
from echo_native.echo.upstream import EpochEnd
from echo_native.resume import MAX_TICKET

#: A wait for the wrapped loader shorter than this share of the time between two of its
#: batches says it kept up (the consumer did not wait for it).
_WAIT_SHARE = 0.05

#: The keys of this upstream's state beside ``ticket``, ``epoch`` and the wrapped
#: loader's own state (``wrapped``), and the test each value must pass: where in its
#: epoch the wrapped loader's state stands, and what the wrapped loader was (a state
#: loaded into another would read examples twice or never).
STATE_KEYS = {
    "index": ("an integer in [0, 2**62]", lambda v: is_int(v) and 0 <= v <= MAX_TICKET),
    "first_id": ("an integer in [0, 2**62]", lambda v: is_int(v) and 0 <= v <= MAX_TICKET),
    "upstream_batches": ("a positive integer or None",
                         lambda v: v is None or is_int(v) and 1 <= v <= MAX_TICKET),
    "upstream_samples": ("an integer >= 0 or None",
                         lambda v: v is None or is_int(v) and 0 <= v <= MAX_TICKET),
    "upstream_batch_size": ("a positive integer or None",
                            lambda v: v is None or is_int(v) and 1 <= v <= MAX_TICKET),
    "upstream_seed": ("an integer or None", lambda v: v is None or is_int(v)),
}


class IterableUpstream:
    """The :class:`~echo_native.echo.upstream.Upstream` of a wrapped iterable of batches.

    One pass over ``iterable`` is an epoch; its batches get tickets (batch numbers
    since the start) and their examples ids (positions in the epoch's stream).
    The time per fresh batch it reports to auto echo is the time between two of
    its batches when the consumer waited for the second (the loader was the
    bottleneck, so that is its pace), and nothing when it did not (it kept up).
    """

    workers = 1
    sharded = False

    def __init__(self, iterable, keep_states=False):
        self.iterable = iterable
        try:
            self.batches_per_epoch = len(iterable)
        except TypeError:
            self.batches_per_epoch = None
        self.samples_per_epoch = _samples_per_epoch(iterable)
        self.largest = 0           # examples in the largest batch yet
        #: Called for the oldest ticket a state may still need (the ledger's oldest
        #: batch with an unsent example), None until the stage exists.
        self.oldest_needed = None
        self.position = 0          # ticket of the next fresh batch
        self._epoch = 0
        self._index = 0            # the next fresh batch's number in its epoch
        self._next_id = 0          # the id of the next example in the epoch
        self._it = None
        self._held = None
        self._last = None          # when the previous fresh batch arrived
        self._keep = keep_states   # keep the wrapped states, for state_at
        self._states = collections.OrderedDict()
        self._raised = None        # what the wrapped generator raised, ending it

    @property
    def epoch(self):
        # A batch taken and not yet handed to the stage is of its own epoch, even when it
        # was the epoch's last and the count has moved on (a loader of one batch).
        return self._held.epoch if self._held is not None else self._epoch

    @property
    def left_in_epoch(self):
        if self.batches_per_epoch is None:
            return None
        return max(0, self.batches_per_epoch - self._index)

    def id_space(self):
        return max(self._next_id, self.samples_per_epoch or 0)

    def epoch_ids(self, epoch):
        if self.samples_per_epoch is None:
            raise TypeError("the wrapped loader does not say how many examples an epoch has")
        return np.arange(self.samples_per_epoch)

    def ready(self):
        return True  # a wrapped loader cannot say; waits are measured in next_fresh

    def next_fresh(self):
        if self._keep:
            self._snapshot()
        if self._it is None:
            self._it = iter(self.iterable)
        t0 = time.perf_counter()
        # A Ctrl-C inside the wrapped loader would kill a generator, and one after its
        # batch is out and before it is held would lose the batch: the first is held
        # until the batch is, a second raises at once (to stop a stuck loader).
        with deferred_interrupts():
            try:
                with second_press():
                    batch = next(self._it)
            except StopIteration:
                self._ended_early()
                self._next_epoch()
                raise EpochEnd from None
            except Exception as err:
                self._failed(err)
                raise
            now = time.perf_counter()
            waited, period = now - t0, now - (self._last if self._last is not None else t0)
            self._last = now
            n = _rows(batch, self._index, self._epoch)
            self.largest = max(self.largest, n)
            ids = np.arange(self._next_id, self._next_id + n, dtype=np.int64)
            fresh = Fresh(self.position, self._epoch, self._index, ids, np.ones(n, bool),
                          batch,
                          period if waited > _WAIT_SHARE * period and waited > 1e-4 else 0.0)
            self._held, self.position = fresh, self.position + 1
            self._index, self._next_id = self._index + 1, self._next_id + n
        if self._index == self.batches_per_epoch:
            self._end_of_iterator()
        return fresh

    def _failed(self, err):
        """The wrapped loader raised: a generator is finished by it, and its next
        ``next()`` ends the epoch (said then, by :meth:`_ended_early`)."""
        if self._it is not None and getattr(self._it, "gi_frame", 1) is None:
            self._raised = f"{type(err).__name__}: {err}"

    def _ended_early(self):
        """Say so when an epoch ends short: after the wrapped generator raised, or before
        the wrapped loader's len()."""
        name = type(self.iterable).__name__
        if self._raised is not None:
            warnings.warn(f"EchoLoader: the wrapped {name} raised ({self._raised:.200}) after "
                          f"{self._index} batches of epoch {self._epoch} and cannot go on "
                          f"(a generator ends when it raises): the epoch ends there",
                          RuntimeWarning, stacklevel=4)
        elif self.batches_per_epoch is not None and self._index < self.batches_per_epoch:
            warnings.warn(f"EchoLoader: the wrapped {name} ended epoch {self._epoch} after "
                          f"{self._index} batches, short of its len() "
                          f"({self.batches_per_epoch})", RuntimeWarning, stacklevel=4)

    def _end_of_iterator(self):
        """The epoch's last batch (by the wrapped loader's len()) is out: run its iterator
        to its end now, so that a loader with worker processes stops them at once, and
        a loader whose len() was short of its batches is found out."""
        try:
            next(self._it)
        except StopIteration:
            self._next_epoch()
            return
        raise RuntimeError(f"the wrapped {type(self.iterable).__name__} yielded more batches "
                           f"than its len() ({self.batches_per_epoch})")

    def _next_epoch(self):
        self._it, self._last, self._raised = None, None, None
        self._epoch, self._index, self._next_id = self._epoch + 1, 0, 0

    def held(self):
        return self._held

    def hand_off(self):
        self._held = None
        return _nothing

    # -- resume ----------------------------------------------------------------------------
    def _snapshot(self):
        """The wrapped loader's state before the next fresh batch, for a resume there: a
        copy (a loader may hand out its live dict and change it as it reads), kept while
        a state may need it (from the oldest batch with an example not yet emitted)."""
        self._states[self.position] = self._here()
        oldest = self.oldest_needed() if self.oldest_needed is not None else None
        if oldest is None:
            oldest = self.position if self.oldest_needed is not None else -1
        while self._states and next(iter(self._states)) < oldest:
            self._states.popitem(last=False)

    @property
    def batch_size(self):
        """The wrapped loader's batch size where it says, else its largest batch yet."""
        return _declared_batch_size(self.iterable) or self.largest or None

    def _here(self):
        return {"ticket": self.position, "epoch": self._epoch, "index": self._index,
                "first_id": self._next_id,
                "wrapped": copy.deepcopy(self.iterable.state_dict())}

    def state_at(self, ticket):
        if ticket == self.position and ticket not in self._states:
            state = self._here()
        elif ticket not in self._states:
            raise RuntimeError(f"EchoLoader: the wrapped loader's state before batch {ticket} "
                               f"was not kept")
        else:
            state = copy.deepcopy(self._states[ticket])
        state.update(upstream_batches=self.batches_per_epoch,
                     upstream_samples=self.samples_per_epoch,
                     upstream_batch_size=self.batch_size,
                     upstream_seed=_shuffle_seed(self.iterable))
        return state

    def load(self, state):
        self.iterable.load_state_dict(copy.deepcopy(state["wrapped"]))
        self._it, self._held, self._last = None, None, None
        self.position, self._epoch = int(state["ticket"]), int(state["epoch"])
        self._index, self._next_id = int(state["index"]), int(state["first_id"])
        self._states.clear()

    def set_epoch(self, epoch):
        """A new epoch from its start (the wrapped loader's own ``set_epoch`` is called by
        :meth:`EchoLoader.set_epoch`)."""
        self._it, self._held, self._last = None, None, None
        self._epoch, self._index, self._next_id = epoch, 0, 0
        if self.batches_per_epoch is not None:
            # Tickets count whole epochs where the length is known, as the ring's do:
            # ticket // batches_per_epoch is the epoch.
            self.position = epoch * self.batches_per_epoch

    def close(self):
        # Dropping the iterator lets a loader with worker processes shut them down.
        self._it, self._held = None, None

    def interrupt(self):
        """From another thread, while the consumer waits in the wrapped iterator: stop its
        worker processes where it has them (a torch DataLoader's iterator), which ends
        the wait with the loader's own error."""
        shutdown = getattr(self._it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def _nothing():
    pass


def _rows(batch, index, epoch):
    from echo_native.echo.pytree import batch_size

    where = f"(fresh batch {index} of epoch {epoch}: it is dropped, and iterating again " \
            f"goes on after it)"
    try:
        n = batch_size(batch)
    except ValueError as err:
        raise ValueError(f"{err} {where}") from None
    if n is None:
        raise ValueError(f"EchoLoader: a batch must hold an array (or a list) with one row per "
                         f"example, got {type(batch).__name__} {where}")
    return n


def _refuse_non_loader(iterable):
    """What is not a loader of batches, refused by name before the first batch: a path (its
    characters would be taken for batches) or a Hugging Face dataset of single examples
    (each example would be taken for a batch: its token ids for examples)."""
    if isinstance(iterable, (str, bytes, os.PathLike)):
        raise TypeError(f"EchoLoader wraps a loader of batches (a torch DataLoader, a "
                        f"generator of batches), got the path {os.fsdecode(iterable)!r}: for "
                        f"a folder or file list of images use en.EchoRing(path)")
    cls = type(iterable)
    if cls.__module__.split(".")[0] == "echo_native" and cls.__name__ in ("Loader", "EchoRing"):
        # Its batches are views of ring slots whose objects are padded per batch:
        # EchoRing runs the same echo stages on the slots themselves.
        raise TypeError(f"EchoLoader wraps another library's loader; an echo_native "
                        f"{cls.__name__} echoes its own batches: use en.EchoRing(source, "
                        f"batch_size, echo=...) (the same stages on the ring's slots, "
                        f"zero-copy, each echo re-augmented)")
    if cls.__module__.split(".")[0] != "datasets":
        return
    if cls.__name__ in ("DatasetDict", "IterableDatasetDict"):
        raise TypeError(f"EchoLoader wraps a loader of batches, got a Hugging Face "
                        f"{cls.__name__} of splits {list(iterable)}: pick a split and pass "
                        f"DataLoader(ds[split], batch_size=...)")
    single = _single_example_column(iterable)
    if single is not None:
        raise TypeError(f"EchoLoader wraps a loader of batches, got a Hugging Face "
                        f"{cls.__name__} of single examples (its column {single!r} holds one "
                        f"value, not a list of a batch's): pass DataLoader(ds, batch_size=...) "
                        f"(every epoch), ds.iter(batch_size=...) (one epoch), or "
                        f"ds.batch(batch_size) (a dataset of batches)")


def _single_example_column(ds):
    """A column of a Hugging Face dataset whose feature is not a list: its items are single
    examples (``ds.batch(n)`` makes every column a list).  None when every column is a list
    or the dataset does not say (a streamed one without features)."""
    features = getattr(ds, "features", None)
    if not features:
        return None
    for name, feature in features.items():
        if not isinstance(feature, (list, tuple)) and \
                type(feature).__name__ not in ("List", "LargeList", "Sequence"):
            return name
    return None


def _samples_per_epoch(iterable):
    """Examples per epoch where the wrapped loader says: a torch DataLoader's, as its
    ``len()`` counts batches (its batch sampler's sampler: a ``DistributedSampler``'s
    share, a ``SubsetRandomSampler``'s subset), else its dataset's length.  None when
    it cannot say (a custom batch sampler, batches straight from the dataset)."""
    batch_sampler = getattr(iterable, "batch_sampler", None)
    sampler = getattr(batch_sampler, "sampler", None)
    if batch_sampler is not None and sampler is not None and \
            hasattr(batch_sampler, "batch_size"):
        try:
            n = len(sampler)
        except TypeError:   # an IterableDataset's: its own length, if it has one
            return _dataset_len(iterable)
        B = batch_sampler.batch_size
        return n // B * B if getattr(batch_sampler, "drop_last", False) and B else n
    if batch_sampler is not None or hasattr(iterable, "sampler"):
        # A custom batch sampler, or a DataLoader(batch_size=None) whose dataset's items
        # are the batches: the examples per epoch are not known in advance.
        return None if batch_sampler is not None or getattr(iterable, "batch_size", 1) is None \
            else _dataset_len(iterable)
    return _dataset_len(iterable)


def _shuffle_seed(iterable):
    """The seed of the wrapped loader's order where it says: a ``DistributedSampler``'s
    ``seed``, or the ``initial_seed()`` of the generator given to its sampler or to the
    DataLoader; None when it draws one afresh (or is not a torch DataLoader)."""
    sampler = getattr(getattr(iterable, "batch_sampler", None), "sampler", None) or \
        getattr(iterable, "sampler", None)
    seed = getattr(sampler, "seed", None)
    if is_int(seed):
        return int(seed)
    for gen in (getattr(sampler, "generator", None), getattr(iterable, "generator", None)):
        initial = getattr(gen, "initial_seed", None)
        if callable(initial):
            try:
                return int(initial())
            except Exception:
                return None
    return None


def _declared_batch_size(iterable):
    """The wrapped loader's batch size where it says (a DataLoader's), else None."""
    b = getattr(iterable, "batch_size", None)
    return int(b) if is_int(b) and b > 0 else None


def _dataset_len(iterable):
    """Examples per epoch where the wrapped loader says (a torch DataLoader's dataset)."""
    dataset = getattr(iterable, "dataset", None)
    try:
        n = len(dataset) if dataset is not None else None
    except TypeError:
        return None
    if n is not None and getattr(iterable, "drop_last", False):
        b = getattr(iterable, "batch_size", None)
        n = n // b * b if b else n
    return n

"""The public feeder: :class:`EchoRing` = source -> workers -> ring -> echo -> device.

It folds its arguments into specs once (:mod:`echo_native.specs`), and wires
the parts that do the work: a :class:`~echo_native.loader.Loader` (the ring
and its workers), an echo stage over it (:mod:`echo_native.echo.stages`), the
device backend (:mod:`echo_native.backends`) and the delivery
(:mod:`echo_native.delivery`).  It holds no state machine of its own.
"""
from __future__ import annotations

import numpy as np

from echo_native._checks import take
from echo_native._iteration import NOT_PICKLABLE, IterationGuard, Started
from echo_native.augment import Program, WithOps
from echo_native.backends import resolve
from echo_native.delivery import Delivery
from echo_native.echo.buffer import buffer_bytes
from echo_native.echo.images import ImageExamples
from echo_native.echo.spec import SHORTHANDS as echo_shorthands
from echo_native.echo.spec import fold_echo
from echo_native.echo.stage import check_stage_args
from echo_native.echo.state import checked_split, merge_states
from echo_native.echo.stages import make_stage
from echo_native.loader import DEFAULT_MAX_OBJECTS, Loader
from echo_native.mix import Mix
from echo_native.output import SHORTHANDS as output_shorthands
from echo_native.output import fold_output
from echo_native.protocol import hook
from echo_native.resume import check_epoch
from echo_native.source import as_source
from echo_native.specs import fold
from echo_native.targets import source_targets
from echo_native.transforms import CenterCrop, canvas_for


class EchoRing(Started):
    """Framework-agnostic feeder with data echoing: source -> workers -> ring -> echo -> device.

    Parameters
    ----------
    source : ImageFolder, FileList, TarShards, Samples, a folder path (read as
        ``ImageFolder(path)``), or any object with ``len``, ``labels`` and
        ``read(i) -> bytes`` (and optionally ``describe(i)``, its name in messages).
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
    workers : int or Workers, default: the CPUs this process may use
        Decoding worker processes; :class:`Workers` also sets the mode, the ring's
        slots and the timeouts.
    device : "cpu", "cuda", "cuda:N", "auto", or a backend object, default "cpu"
        Where the echo buffer lives and batches are delivered.
    seed : int, default 0
        Order, augmentation and echo counts are pure functions of it.
    shuffle : bool, default True
        Random order per epoch; False keeps the source's order.
    drop_last : bool, default False
        Drop the epoch's last batch when it is short.
    on_error : {"replace", "skip", "raise"}, default "replace"
        What a sample that cannot be read or decoded becomes (see :class:`Loader`).  No
        batch without samples is yielded; an epoch whose every sample failed raises one
        ``DecodeError`` naming the first file and the source.
    shard : Shard, optional
        This process's part of the data (default: torchrun's RANK/WORLD_SIZE).
    decode : DecodeLimits, optional
        Strict decoding and decompression-bomb limits.
    mix : Mix, optional
        MixUp / CutMix with soft targets (timm's ``Mixup``), drawn afresh for every
        emitted batch; ``batch.targets`` holds the (B, num_classes) float32 targets.
        Needs a normalised ``output``.  With dtype "bfloat16" the batch is
        normalised and mixed in float32, then rounded to bfloat16 once (what
        mixing in float32 and casting gives in torch).
    max_objects : int, default 128
        For a source with detection targets: the most objects one sample may have
        (the ring's object slots); ``batch.objects`` holds each batch's boxes after
        every emission's crop and flip (see :class:`echo_native.Objects`).
    on_batch : callable, optional
        ``on_batch(images, xp, keys)``: your own op on each batch where it lives
        (after normalisation and ``mix``; a bfloat16 batch as the
        :class:`BFloat16Array` delivered), ``xp`` its array module (NumPy or
        CuPy), ``keys`` a host (B, 4) int64 array of (seed, epoch, sample id, echo
        index) per row, the key the crop is drawn from, to derive per-emission
        randomness.  Change ``images`` in place (return None) or return an array
        of the same shape and dtype.  On a GPU it runs with the ring's device
        current and the pipeline's stream as CuPy's current stream (after the
        batch's kernels, before delivery); work queued through another
        framework's streams is not ordered.

    Shorthands (the flat names of the original contract, still supported):
    ``image_size``, ``scale``, ``ratio``, ``flip_p`` build the
    ``RandomResizedCrop``; ``placement``, ``shuffle_buffer``, ``max_echo``,
    ``canvas_side``, ``canvas_max_pixels``, ``echo_flip`` the ``Echo``;
    ``normalize``, ``layout``, ``dtype`` the ``Output``; ``strict`` the
    ``DecodeLimits``; ``rank``, ``world_size`` the ``Shard``; ``slots``,
    ``timeout``, ``sample_timeout``, ``worker_mode`` the ``Workers``.  Giving a
    shorthand together with the spec it belongs to is a ``TypeError``.
    """

    def __init__(self, source, batch_size=256, *, augment=None, echo=2.0, output=None,
                 workers=None, device="cpu", seed=0, shuffle=True, drop_last=False,
                 on_error="replace", shard=None, decode=None, mix=None, on_batch=None,
                 max_objects=DEFAULT_MAX_OBJECTS, **shorthands):
        source = as_source(source, "EchoRing")
        shorthands = dict(shorthands)
        echo = fold_echo("EchoRing", echo, take(shorthands, echo_shorthands))
        output = fold_output("EchoRing", output, take(shorthands, output_shorthands))
        specs = fold("EchoRing", augment, decode, shard, workers, shorthands)
        crop = specs.crop
        seed, batch_size, shuffle_buffer = check_stage_args(seed, batch_size,
                                                            echo.shuffle_buffer)
        if not echo.off and echo.flip and crop.flip_p == 0:   # flip: after_augment only
            raise ValueError(f"{type(crop).__name__} draws no flip (flip_p=0), so "
                             f"Echo(flip=True) would redraw none: leave flip=False, or use "
                             f"a crop that flips (RandomResizedCrop(flip_p=...), "
                             f"RandomHorizontalFlip())")
        if isinstance(crop, CenterCrop) and not echo.off and echo.placement == "before_augment":
            raise ValueError("CenterCrop is deterministic: echoing it before augmentation would "
                             "repeat identical images at the cost of a canvas each; use echo=1 "
                             "(evaluation) or Echo(..., placement='after_augment')")
        if mix is not None:
            if not isinstance(mix, Mix):
                raise TypeError(f"mix must be an echo_native.Mix or None, got {mix!r}")
            if not output.normalized:
                raise ValueError("Mix needs float images to mix: give output=Output(normalize="
                                 "True) (got uint8)")
        detection = source_targets(source) is not None
        if detection and mix is not None:
            raise ValueError("Mix blends whole images, so a sample's boxes would no longer "
                             "describe its pixels: leave mix=None for a source with targets")
        if on_batch is not None and not callable(on_batch):
            raise TypeError(f"on_batch must be callable(images, xp, keys), got {on_batch!r}")
        self.spec, self.augment, self.output, self.mix = echo, crop, output, mix
        # The specs' main choices, under the names of the original contract.
        self.image_size, self.placement, self.echo = crop.size, echo.placement, echo.factor
        self.batch_size = batch_size
        self.device = resolve(device)
        if getattr(crop, "zoom_out", None) is not None and not echo.off and \
                echo.placement == "before_augment" and not self.device.host_resident:
            raise ValueError(f"RandomZoomOut with echo before augmentation runs on the host "
                             f"only (not on {self.device.name}): use Echo(..., "
                             f"placement='after_augment') or 'batch' there, or leave "
                             f"RandomZoomOut out (RandomIoUCrop and the flip are redrawn "
                             f"for every emission)")
        # The ops run per emission where the echo stage makes the pixels, else in the
        # workers, once per fresh sample.
        self.program = Program(specs.ops, crop.size, output.mean, output.std)
        before = echo.placement == "before_augment" and not echo.off
        if before:
            transform = canvas_for(crop, echo.canvas_side, echo.canvas_max_pixels)
        elif self.program:
            transform = WithOps(crop, self.program)
        else:
            transform = crop
        # Echo stages need every sample of the epoch; echo=1 is the Loader itself.
        self.loader = Loader.from_specs(source, batch_size, specs, transform, seed=seed,
                                        shuffle=shuffle, drop_last=drop_last and echo.off,
                                        on_error=on_error, max_objects=max_objects)
        self.sanitize = specs.sanitize
        plan = self.loader.plan
        if batch_size > plan.num_samples:
            where = "the source" if plan.num_samples == plan.total_samples else \
                "this rank's shard"
            raise ValueError(f"batch_size {batch_size} is larger than the {plan.num_samples} "
                             f"samples of {where}")
        self.seed = plan.seed
        num_classes = None if mix is None else mix.num_classes or _num_classes(source)
        self.delivery = Delivery(self.device, batch_size, crop.size, self.seed, output, mix,
                                 on_batch, num_classes)
        examples = ImageExamples(self.device, self.delivery.outputs, crop, self.program, echo,
                                 self.seed, transform.sample_bytes, self.loader.record,
                                 self.sanitize, self.loader.rules)
        self.stage = make_stage(echo, self.loader, examples, self.delivery.finish,
                                seed=self.seed, batch_size=batch_size,
                                shuffle_buffer=shuffle_buffer, drop_last=bool(drop_last),
                                device=self.device)
        self.shuffle_buffer = capacity = self.stage.shuffle_buffer
        if not echo.off:
            # The echo buffer (or batch echo's window of batch copies), checked with the
            # ring at start: refused there, never OOM-killed later.  Its records (the
            # objects of detection samples and their fields) live in host memory on
            # every device; its pixels too on the CPU.
            held = capacity if echo.placement != "batch" else \
                (max(2, capacity // batch_size) + 1) * batch_size
            per_entry = self.loader.record.nbytes()
            if self.device.host_resident:
                per_entry += transform.sample_bytes
            self.loader.memory_extra = (("the echo buffer", held * per_entry,
                                         "shuffle_buffer"),)
        # A caught Ctrl-C is held while a batch moves through the stages, so that it
        # neither loses nor repeats one (the waits for a fresh batch stay interruptible).
        self._iteration = IterationGuard("EchoRing", hold_interrupts=True)
        # The device follows the ring through restarts (a seek makes a new one).
        self.loader.watch_ring(self.device.attach, self.device.detach)

    def __reduce__(self):
        raise TypeError(NOT_PICKLABLE.format(type(self).__name__))

    # -- life cycle -------------------------------------------------------------------
    def start(self):
        self.loader.start()
        try:
            self.stage.start()
        except MemoryError:
            self.close()  # the workers are running already: stop them
            raise MemoryError(self._buffer_too_big()) from None
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
        in_use = getattr(self.stage, "buffer", None) is not None
        self.stage.close()
        self.delivery.close(in_use)

    # -- epochs ------------------------------------------------------------------------
    @property
    def epoch(self):
        """The epoch the next iteration works on (one left early continues)."""
        return self.stage.epoch

    def __len__(self):
        """Batches in the coming epoch (for echo="auto", the count at the current e;
        ranks of an auto-echo job may then differ: use a fixed e with DDP)."""
        return self.stage.batches_in(self.epoch)

    def __iter__(self):
        return self._iteration.iterate(self._batches)

    def _batches(self):
        self.start()
        epoch, delivered = self.epoch, 0
        for batch in self.stage.batches():
            # A batch whose every sample failed (on_error="skip", or no stand-in decoded)
            # holds nothing to train on, and a 0-length batch breaks a training step.
            if len(batch):
                delivered += 1
                yield batch
        if not delivered:
            self.loader.check_delivered(epoch, "EchoRing")

    def set_epoch(self, epoch):
        """As ``DistributedSampler.set_epoch``: the next iteration is ``epoch``."""
        epoch = check_epoch(epoch, len(self.loader))
        if self.epoch != epoch:
            self._iteration.end()
            self.stage.reset()
        self.loader.set_epoch(epoch)

    # -- resume ------------------------------------------------------------------------
    def state_dict(self):
        """Position in the fresh stream, for exact resume.

        Restoring it re-reads from the oldest fresh batch that still had
        examples waiting for their first emission, and skips the examples of
        those batches that were already emitted, so across the save no sample
        is read fresh twice or skipped.  The echo buffer itself is not saved:
        echoes still owed for examples emitted before the save are dropped.

        The dict holds plain values (JSON and pickle), the loader's nested in it
        (:mod:`echo_native.echo.state`): ``parent``, :meth:`Loader.state_dict`'s at
        that ticket; ``skip``, the ids emitted fresh from there on; ``echo`` and
        ``placement``.  The states of all ranks together resume in a job of
        another world size (see :meth:`load_state_dict`).
        """
        state = self.stage.state()
        state.update(echo=self.echo, placement=self.placement)
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
            :meth:`Loader.load_state_dict`).  A state saved flat, before the
            loader's was nested in it, loads too.
        """
        if not isinstance(state, (dict, list, tuple)):
            raise TypeError(f"load_state_dict takes a state_dict() (a dict), or the list of "
                            f"every rank's, got {type(state).__name__}")
        if not isinstance(state, dict):
            state = merge_states(state)
        parent, own = checked_split(state, "an EchoRing")
        if own.get("placement", self.placement) != self.placement:
            raise ValueError(f"state was saved with placement={own['placement']!r}, this "
                             f"ring has {self.placement!r}")
        self._iteration.end()  # an iterator of the old stream must not read the new one
        self.loader.load_state_dict(parent)
        # Resumed from all ranks, the plan leaves out what was emitted: nothing to skip.
        self.stage.reset(() if "ranks" in parent else own.get("skip", ()))

    # -- books ------------------------------------------------------------------------
    def report(self, losses):
        """Per-example training losses of the batch delivered last (``echo="auto"``).

        ``losses`` has one value per row, e.g. ``F.cross_entropy(logits, y,
        reduction="none")``: a PyTorch tensor (on any device), a JAX, CuPy or NumPy
        array, or a list.  Auto echo compares the loss of echoed rows with fresh
        ones and lowers e once repeats have become clearly easier than fresh data
        (see :class:`echo_native.echo.auto.AutoEcho`).  With a fixed e it does nothing.
        Call it after the step, before taking the next batch.
        """
        echo_index = self.stage.last_echo_index
        if echo_index is None:
            raise RuntimeError("report(): no batch has been delivered yet")
        values = _host_floats(losses)
        if values.shape != (len(echo_index),):
            raise ValueError(f"report() takes one loss per row of the last batch "
                             f"({len(echo_index)}), got shape {values.shape} (use "
                             f"reduction='none')")
        if self.stage.auto is not None:
            self.stage.auto.losses(values, echo_index)

    def stats(self):
        """Rates and counters since start: fresh and delivered examples (counts and per
        second), the effective echo factor, auto echo's trace, the estimated ratio R
        of upstream to consumer time, the time spent waiting for fresh data, ring and
        echo-buffer occupancy, failures by reason, worker restarts and the device."""
        low = self.loader.stats()
        fill = getattr(self.stage, "fill_level", None)
        return {
            **self.stage.stats(),
            "ring_occupancy": low["ring_occupancy"],
            "buffer_fill": fill() if fill is not None else 0.0,
            "failures": low["failures"],
            "accepted_with_warnings": low["accepted_with_warnings"],
            "dropped": low["dropped"],
            "worker_restarts": low["worker_restarts"],
            "device": self.device.describe(),
        }


def _num_classes(source):
    classes = hook(source, "classes")
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

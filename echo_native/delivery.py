"""The last step before the consumer: an emission becomes the batch it receives.

:class:`Delivery` owns everything between the echo stage and ``for batch in
ring``: the rotating output buffers the pixels are made into, normalisation
(layout, dtype, bfloat16), MixUp / CutMix with soft targets, the user's
``on_batch`` op, and the device's hand-off (``ready``: on a GPU, the events a
consumer's stream waits on).  All of it runs where the batch lives, NumPy on
the host or CuPy on a GPU, through the device backend.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from echo_native.echo.counts import batch_rng
from echo_native.mix import mix_params
from echo_native.output import BFloat16Array, storage_dtype


class OutputBuffers:
    """The device's rotating output buffers, per kind of array.

    A delivered batch stays valid until the batch after next: two buffers on the
    host, three where the device makes a batch ahead while the consumer works on
    one (``device.output_buffers``).  Scratch that never reaches the consumer
    needs only one."""

    def __init__(self, device, batch_size):
        self.device, self.batch_size = device, batch_size
        self._kinds = {}   # kind -> [buffers, index of the one handed out last]

    def __bool__(self):
        return bool(self._kinds)

    def next(self, kind, shape, dtype=np.uint8, count=None):
        """The next buffer of ``kind``, ``shape[0]`` rows of it."""
        full = (self.batch_size,) + tuple(shape[1:])
        count = count or max(2, int(self.device.output_buffers))
        ring = self._kinds.get(kind)
        if ring is None or ring[0][0].shape != full or ring[0][0].dtype != dtype or \
                len(ring[0]) != count:
            if ring is not None:
                self.device.release_buffers()  # the old buffers go back to the device
            ring = self._kinds[kind] = [[self.device.empty(full, dtype) for _ in range(count)],
                                        count - 1]
        ring[1] = (ring[1] + 1) % count
        return self.device.reuse(ring[0][ring[1]][:shape[0]])

    def clear(self):
        self._kinds = {}


class Delivery:
    """Normalisation, Mix and ``on_batch`` on emitted batches, into output buffers.

    Parameters
    ----------
    device : the backend the batch lives on
    output : :class:`~echo_native.output.Output`
    mix : :class:`~echo_native.mix.Mix` or None
    on_batch : callable(images, xp, keys) or None
    num_classes : classes of the soft targets (with ``mix``)
    """

    def __init__(self, device, batch_size, size, seed, output, mix=None, on_batch=None,
                 num_classes=None):
        self.device, self.size, self.seed = device, tuple(size), seed
        self.output, self.mix, self.on_batch = output, mix, on_batch
        self.num_classes = num_classes
        self.outputs = OutputBuffers(device, batch_size)
        # NumPy and CuPy cannot mix bfloat16, and mixing rounded pixels would round
        # twice: a bfloat16 batch is mixed in float32 and rounded once.
        self._mix_in_float32 = mix is not None and output.dtype == "bfloat16"
        self._emitted = (None, 0)  # (epoch, batches emitted in it): the key of a batch op

    def finish(self, batch):
        """The batch the consumer receives, from an emitted one (:meth:`ImageExamples.
        make`): its images normalised, Mix and ``on_batch`` applied, on the device."""
        images, out_spec = batch.images, self.output
        if out_spec.normalized:
            n, h, w, _ = images.shape
            shape = (n, h, w, 3) if out_spec.layout == "NHWC" else (n, 3, h, w)
            if self._mix_in_float32:
                out = self.outputs.next("mix scratch", shape, np.float32, count=1)
            else:
                out = self.outputs.next("normalized", shape, storage_dtype(out_spec.dtype))
            images = self.device.normalize(images, out_spec.mean, out_spec.std,
                                           out_spec.layout, out)
            if out.dtype == np.uint16:
                images = BFloat16Array(images, self.device)
        targets = None
        if self.mix is not None or self.on_batch is not None:
            images, targets = self._batch_ops(images, batch.labels, batch.sample_ids,
                                              batch.echo_index, batch.epoch)
        objects = batch.objects
        if objects is not None and not self.device.host_resident:
            objects = self.device.objects_to_device(objects)  # beside the images, for DLPack
        return self.device.ready(dataclasses.replace(
            batch, images=images, flips=np.asarray(batch.flips, bool), targets=targets,
            objects=objects))

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
                bits = self.outputs.next("normalized", images.shape, np.uint16)
                images = BFloat16Array(self.device.to_bfloat16(images, bits), self.device)
        if self.on_batch is not None:
            keys = np.empty((len(labels), 4), np.int64)
            # A seed >= 2**63 goes in as its 64 bits (keys[:, 0].view(np.uint64) is the seed).
            keys[:, 0] = self.seed - 2**64 if self.seed >= 2**63 else self.seed
            keys[:, 1] = epoch
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

    def close(self, buffers_in_use):
        """Hand the output buffers (and the echo buffer, ``buffers_in_use``) back to the
        device: work the consumer queued may still read the last batches, so the
        device orders its reuse of this memory after it first."""
        try:
            if buffers_in_use or self.outputs:
                self.device.release_buffers()
        finally:
            self.outputs.clear()

"""How an echo stage stores and emits the examples of ring slots: pixels on the device.

The stage (:mod:`echo_native.echo.stages`) decides *which* examples are emitted
and how often; :class:`ImageExamples` makes their pixels, through the device
backend (:mod:`echo_native.backends`), into the delivery's rotating output
buffers:

- before augmentation, the buffer holds each example's decoded canvas, and
  every emission draws its own RandomResizedCrop and flip (in the original
  image's coordinates, from (seed, epoch, sample id, echo index)) and its own
  per-example ops;
- after augmentation, it holds the augmented image, and an emission is a
  gather (with ``Echo(flip=True)``, a re-drawn flip);
- pass-through and batch echo hand on or copy whole slots.
"""
from __future__ import annotations

import numpy as np

from echo_native import _kernel
from echo_native.batch import Batch


class ImageStore:
    """The entries of the shuffle buffer: one row of ``entry_bytes`` pixels each on the
    device, and what each holds (a canvas's shape, the original's size and the scale
    between them; the worker's crop box and flip for an augmented image)."""

    def __init__(self, capacity, entry_bytes, device=np):
        self.capacity = c = int(capacity)
        self.pixels = device.empty((c, int(entry_bytes)), np.uint8)
        self.label = np.zeros(c, np.int64)
        self.shape = np.zeros((c, 2), np.int32)
        self.source_hw = np.zeros((c, 2), np.int32)
        self.scale = np.ones((c, 2), np.float32)
        self.box = np.zeros((c, 4), np.float32)
        self.flip = np.zeros(c, bool)


class ImageExamples:
    """Stores and emits the examples of ring slots for one :class:`EchoRing`.

    Parameters
    ----------
    device : the backend the pixels live on
    outputs : the delivery's rotating output buffers (``next(kind, shape)``)
    crop : the RandomResizedCrop (or CenterCrop) spec
    program : the per-example ops, drawn per emission before augmentation
    echo : the :class:`~echo_native.echo.spec.Echo` spec
    sample_bytes : bytes per ring sample (a canvas budget before augmentation)
    """

    def __init__(self, device, outputs, crop, program, echo, seed, sample_bytes):
        self.device, self.outputs = device, outputs
        self.crop, self.program, self.seed = crop, program, seed
        self.placement, self.redraw_flip = echo.placement, echo.flip
        self.size = tuple(crop.size)
        self.sample_bytes = int(sample_bytes)
        self.stored = None
        # Threads making the emissions where the device makes them on the host (the
        # CPU backend's pool); None sizes them from the cores.
        device.use_threads(echo.threads)

    # -- the shuffle buffer's entries ---------------------------------------------------
    def allocate(self, capacity):
        if self.stored is None:
            self.stored = ImageStore(capacity, self.sample_bytes, self.device)

    def free(self):
        self.stored = None

    def store(self, entries, fresh):
        """Copy fresh batch ``fresh`` (a ring slot) into buffer ``entries``."""
        slot, n, s = fresh.payload, fresh.count, self.stored
        self.device.store(s, entries, slot, n, self.placement == "after_augment")
        s.label[entries] = slot.labels[:n]
        s.shape[entries] = slot.shapes[:n]
        s.source_hw[entries] = slot.source_hw[:n]
        s.scale[entries] = slot.canvas_scale[:n]
        s.box[entries] = slot.boxes[:n]
        s.flip[entries] = slot.flip[:n].view(bool)

    def make(self, entries, sample_ids, echo_index, fresh, epochs, epoch):
        """Start making the pixels of emitted ``entries``: ``(job, parts)``, the job for
        the device's ``synchronize`` and the parts of the batch for the delivery."""
        s, device = self.stored, self.device
        images = self.outputs.next("images", (len(entries), *self.size, 3))
        if self.placement == "after_augment":
            boxes, flips = s.box[entries].copy(), s.flip[entries].copy()
            mirror = None
            if self.redraw_flip:
                redo = echo_index > 0
                # The flip has a Philox block of its own: the image size does not matter.
                ones = np.ones((len(entries), 2), np.int32)
                new = _kernel.random_resized_crops(
                    self.seed, epochs, sample_ids, echo_index.astype(np.int32), ones,
                    ones.astype(np.float32), ones, flip_p=self.crop.flip_p)[1]
                mirror = redo & (new != flips)
                flips = np.where(redo, new, flips)
            job = device.gather(s, entries, images, mirror)
        else:
            # RandomResizedCrop of each emission, drawn in the original image's
            # coordinates, then mapped onto the stored canvas, in one native call.
            crop = self.crop
            boxes, flips, canvas_boxes = _kernel.random_resized_crops(
                self.seed, epochs, sample_ids, np.asarray(echo_index, np.int32),
                s.source_hw[entries], s.scale[entries], s.shape[entries], crop.scale,
                crop.ratio, crop.flip_p)
            codes = args = None
            if self.program:  # the batch's programs in one native call
                codes, args = self.program.draw(self.seed, epochs, sample_ids, echo_index)
            job = device.reaugment(s, entries, canvas_boxes, flips, images, codes, args)
        return job, (images, s.label[entries].copy(), sample_ids, fresh, echo_index, boxes,
                     flips, epoch)

    # -- whole slots -------------------------------------------------------------------
    def _views(self, fresh):
        slot, n = fresh.payload, fresh.count
        return Batch(images=slot.pixels[:n].reshape(n, *self.size, 3),
                     labels=slot.labels[:n], sample_ids=fresh.sample_ids, fresh=fresh.ok,
                     echo_index=np.zeros(n, np.int64), boxes=slot.boxes[:n],
                     flips=slot.flip[:n].view(bool), epoch=fresh.epoch)

    def pass_through(self, fresh):
        """``(parts, copied)``: the parts of a fresh batch as delivered, and whether its
        pixels were copied out (else the parts are views of the slot)."""
        b = self._views(fresh)
        copied = not self.device.host_resident
        if copied:
            # The slot goes back once its pixels are copied: keep what else it holds.
            images = self.device.to_device(b.images, self.outputs.next("images",
                                                                       b.images.shape))
            b = Batch(images, b.labels.copy(), b.sample_ids.copy(), b.fresh.copy(),
                      b.echo_index, b.boxes.copy(), b.flips.copy(), b.epoch)
        return (b.images, b.labels, b.sample_ids, b.fresh, b.echo_index, b.boxes, b.flips,
                b.epoch), copied

    def keep(self, fresh):
        """A fresh batch that owns its memory (on the device), for batch echo."""
        b = self._views(fresh)
        if self.device.host_resident:
            return b.copy()
        return Batch(self.device.to_device(b.images), b.labels.copy(), b.sample_ids.copy(),
                     b.fresh.copy(), b.echo_index.copy(), b.boxes.copy(), b.flips.copy(),
                     b.epoch)

    def repeat(self, kept, echo, epoch):
        """The parts of one emission of a kept batch (``echo`` 0 for its first)."""
        images = self.device.copy(kept.images, self.outputs.next("images", kept.images.shape))
        return (images, kept.labels.copy(), kept.sample_ids.copy(), kept.fresh & (echo == 0),
                np.full(len(kept), echo, np.int64), kept.boxes.copy(), kept.flips.copy(),
                epoch)

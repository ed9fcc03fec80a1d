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

from echo_native.batch import Batch, Columns
from echo_native.ring import Record
from echo_native.transforms import Stored


class ImageStore:
    """The entries of the shuffle buffer: one row of ``entry_bytes`` pixels each on the
    device, and each entry's record as its ring slot carried it (:class:`~echo_native.
    batch.Columns`, host memory: small, and the batch's metadata lives there)."""

    def __init__(self, capacity, entry_bytes, device=np, record=Record()):
        self.capacity = int(capacity)
        self.pixels = device.empty((self.capacity, int(entry_bytes)), np.uint8)
        self.columns = Columns.allocate(self.capacity, record)

    @property
    def shape(self):
        """Each entry's pixels' (height, width), int32: the canvases the kernels crop."""
        return self.columns.shapes


class ImageExamples:
    """Stores and emits the examples of ring slots for one :class:`EchoRing`.

    Parameters
    ----------
    device : the backend the pixels live on
    outputs : the delivery's rotating output buffers (``next(kind, shape)``)
    crop : the RandomResizedCrop (or CenterCrop, or detection BoxCrop) spec
    program : the per-example ops, drawn per emission before augmentation
    echo : the :class:`~echo_native.echo.spec.Echo` spec
    sample_bytes : bytes per ring sample (a canvas budget before augmentation)
    record : the sizes of a sample's record (:class:`~echo_native.ring.Record`)
    sanitize : the SanitizeBoundingBoxes spec applied to the objects, or None
    rules : what each object field follows, by name (the loader's ``rules``)
    """

    def __init__(self, device, outputs, crop, program, echo, seed, sample_bytes,
                 record=Record(), sanitize=None, rules=None):
        self.record = record
        # What a batch's objects follow besides the crop: given to every batch made.
        self.follow = {"sanitize": sanitize, "rules": rules}
        self.device, self.outputs = device, outputs
        self.program, self.seed = program, seed
        self.after_augment = echo.placement == "after_augment"
        # What redraws an emission's geometry: the crop spec itself before augmentation,
        # the stored image (a flip at most) after it.
        self.geometry = Stored(crop.flip_p, echo.flip) if self.after_augment else crop
        self.size = tuple(crop.size)
        self.fill = getattr(getattr(crop, "zoom_out", None), "fill", None)
        self.sample_bytes = int(sample_bytes)
        self.stored = None
        # Threads making the emissions where the device makes them on the host (the
        # CPU backend's pool); None sizes them from the cores.
        device.use_threads(echo.threads)

    # -- the shuffle buffer's entries ---------------------------------------------------
    def allocate(self, capacity):
        if self.stored is None:
            self.stored = ImageStore(capacity, self.sample_bytes, self.device, self.record)

    def free(self):
        self.stored = None

    def store(self, entries, fresh):
        """Copy fresh batch ``fresh`` (a ring slot) into buffer ``entries``."""
        slot, n, s = fresh.payload, fresh.count, self.stored
        self.device.store(s, entries, slot, n, self.after_augment)
        s.columns.put(entries, Columns.of_slot(slot, n))

    def make(self, entries, sample_ids, echo_index, fresh, epochs, epoch):
        """Start making emitted ``entries``: ``(job, batch)``, the job for the device's
        ``synchronize`` and the batch for the delivery, its images in an output buffer."""
        s, device = self.stored, self.device
        columns = s.columns.take(entries)
        g = self.geometry.redraw(self.seed, epochs, sample_ids, echo_index, columns)
        images = self.outputs.next("images", (len(entries), *self.size, 3))
        flips = columns.flip.view(bool)
        if g.canvas_boxes is None:
            job = device.gather(s, entries, images, g.mirror)
        else:
            codes = args = None
            if self.program:  # the batch's programs in one native call
                codes, args = self.program.draw(self.seed, epochs, sample_ids, echo_index)
            job = device.reaugment(s, entries, g.canvas_boxes, flips, images, codes, args)
            if g.placed is not None:  # zoom-outs: the image inside, fill around it
                rows, inner, rects = g.placed
                job = device.place(s, entries[rows], inner, rects, flips[rows], self.fill,
                                   images, rows, None if codes is None else codes[rows],
                                   None if args is None else args[rows])
        return job, Batch.from_columns(images, columns, sample_ids=sample_ids, fresh=fresh,
                                       echo_index=echo_index, epoch=epoch, redrawn=g,
                                       **self.follow)

    # -- whole slots -------------------------------------------------------------------
    def pass_through(self, fresh, keep=None):
        """``(batch, copied)``: a fresh batch as delivered (only its rows ``keep``, a
        mask, when given: a resume at e = 1 from a state saved with echo leaves out
        what was emitted before the save), and whether its pixels were copied out
        (else the batch's arrays are views of the slot)."""
        slot, n = fresh.payload, fresh.count
        columns, ids, ok = Columns.of_slot(slot, n), fresh.sample_ids, fresh.ok
        images = slot.pixels[:n].reshape(n, *self.size, 3)
        if keep is not None:
            rows = np.flatnonzero(keep)
            columns, ids, ok, images = columns.take(rows), ids[rows], ok[rows], images[rows]
        copied = not self.device.host_resident
        if copied:
            # The slot goes back once its pixels are copied: keep what else it holds.
            images = self.device.to_device(images, self.outputs.next("images", images.shape))
            columns, ids, ok = columns.copy(), ids.copy(), ok.copy()
        return Batch.from_columns(images, columns, sample_ids=ids, fresh=ok,
                                  echo_index=np.zeros(len(ids), np.int64), epoch=fresh.epoch,
                                  **self.follow), copied

    def keep(self, fresh):
        """A fresh batch that owns its memory (on the device), for batch echo."""
        slot, n = fresh.payload, fresh.count
        images = slot.pixels[:n].reshape(n, *self.size, 3)
        images = images.copy() if self.device.host_resident else self.device.to_device(images)
        return Batch.from_columns(images, Columns.of_slot(slot, n).copy(),
                                  sample_ids=fresh.sample_ids.copy(), fresh=fresh.ok.copy(),
                                  echo_index=np.zeros(n, np.int64), epoch=fresh.epoch,
                                  **self.follow)

    def repeat(self, kept, echo, epoch):
        """One emission of a kept batch (``echo`` 0 for its first)."""
        images = self.device.copy(kept.images, self.outputs.next("images", kept.images.shape))
        return Batch(images, kept.labels.copy(), kept.sample_ids.copy(), kept.fresh & (echo == 0),
                     np.full(len(kept), echo, np.int64), kept.crop_boxes.copy(),
                     kept.flips.copy(), epoch,
                     objects=None if kept.objects is None else kept.objects.copy())

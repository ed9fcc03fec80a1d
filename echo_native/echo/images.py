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
from echo_native.boxes import DROPPED, Objects, SourceObjects
from echo_native.detection import BoxCrop, inner_rect


class ImageStore:
    """The entries of the shuffle buffer: one row of ``entry_bytes`` pixels each on the
    device, and what each holds (a canvas's shape, the original's size and the scale
    between them; the worker's crop box and flip for an augmented image)."""

    def __init__(self, capacity, entry_bytes, device=np, max_objects=0):
        self.capacity = c = int(capacity)
        # A detection sample's objects, in source pixels (host memory: small, and the
        # boxes are mapped where the batch's metadata is).
        m = int(max_objects)
        self.obj_boxes = np.zeros((c, m, 4), np.float32)
        self.obj_labels = np.zeros((c, m), np.int64)
        self.obj_flags = np.zeros((c, m), np.uint8)
        self.obj_count = np.zeros(c, np.int64)
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
    max_objects : object slots per sample (detection targets), or 0
    sanitize : the SanitizeBoundingBoxes spec applied to the objects, or None
    """

    def __init__(self, device, outputs, crop, program, echo, seed, sample_bytes,
                 max_objects=0, sanitize=None):
        self.max_objects, self.sanitize = int(max_objects), sanitize
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
            self.stored = ImageStore(capacity, self.sample_bytes, self.device,
                                     self.max_objects)

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
        if self.max_objects:
            s.obj_boxes[entries] = slot.obj_boxes[:n]
            s.obj_labels[entries] = slot.obj_labels[:n]
            s.obj_flags[entries] = slot.obj_flags[:n]
            s.obj_count[entries] = slot.obj_count[:n]

    def _objects(self, source, windows, flips):
        """The batch's :class:`~echo_native.boxes.Objects` (None without targets)."""
        if not self.max_objects:
            return None
        return source.map(windows, flips, self.size, self.sanitize)

    def _stored_objects(self, entries, dropped=None):
        s = self.stored
        flags = s.obj_flags[entries]
        if dropped is not None:  # this emission's IoU crop, in place of the stored one's
            flags = (flags & ~np.uint8(DROPPED)) | dropped.astype(np.uint8) * np.uint8(DROPPED)
        return SourceObjects(s.obj_boxes[entries], s.obj_labels[entries], flags,
                             s.obj_count[entries])

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
            objects = self._objects(self._stored_objects(entries), boxes, flips) \
                if self.max_objects else None
        elif isinstance(self.crop, BoxCrop):
            boxes, flips, canvas_boxes, dropped, placed = self._box_crops(
                entries, sample_ids, echo_index, epochs)
            codes = args = None
            if self.program:
                codes, args = self.program.draw(self.seed, epochs, sample_ids, echo_index)
            job = device.reaugment(s, entries, canvas_boxes, flips, images, codes, args)
            if placed is not None:  # zoom-outs: the image inside, fill around it
                rows, inner, rects = placed
                job = device.place(s, entries[rows], inner, rects, flips[rows],
                                   self.crop.zoom_out.fill, images, rows,
                                   None if codes is None else codes[rows],
                                   None if args is None else args[rows])
            objects = self._objects(self._stored_objects(entries, dropped), boxes, flips) \
                if self.max_objects else None
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
            objects = self._objects(self._stored_objects(entries), boxes, flips) \
                if self.max_objects else None
        return job, (images, s.label[entries].copy(), sample_ids, fresh, echo_index, boxes,
                     flips, epoch, objects)

    def _box_crops(self, entries, sample_ids, echo_index, epochs):
        """A detection crop of each emission (:meth:`BoxCrop.draw`, from the stored
        boxes), in the original's pixels and mapped onto the stored canvas; and for the
        windows a zoom-out takes past the image, ``(rows, canvas boxes, output
        rectangles)`` of the part on the image (else None)."""
        s, n = self.stored, len(entries)
        windows = np.zeros((n, 4), np.float32)
        flips = np.zeros(n, bool)
        dropped = np.zeros((n, s.obj_boxes.shape[1]), bool)
        for k, e in enumerate(entries):
            count = int(s.obj_count[e])
            window, flips[k], drop = self.crop.draw(
                (self.seed, epochs[k], sample_ids[k], echo_index[k]), s.source_hw[e],
                s.obj_boxes[e, :count])
            windows[k] = window
            dropped[k, :count] = drop
        sources = windows.astype(np.float64)
        hw = s.source_hw[entries].astype(np.float64)
        outside = (sources[:, 0] < 0) | (sources[:, 1] < 0) | \
            (sources[:, 0] + sources[:, 2] > hw[:, 0]) | (sources[:, 1] + sources[:, 3] > hw[:, 1])
        rows = np.flatnonzero(outside)
        rects = np.zeros((len(rows), 4), np.int64)
        for j, k in enumerate(rows):
            part = inner_rect(hw[k], windows[k], self.size, flips[k])
            if part is None:  # the window misses the image: all fill (a nominal box)
                part = ((0, 0, 0, 0), (0.0, 0.0, 1.0, 1.0))
            rects[j], sources[k] = part
        # Onto the canvas: canvas pixels = original pixels / scale, kept inside it.
        scale = s.scale[entries].astype(np.float64)
        chw = s.shape[entries].astype(np.float64)
        canvas = np.empty((n, 4), np.float64)
        canvas[:, 0] = sources[:, 0] / scale[:, 0]
        canvas[:, 1] = sources[:, 1] / scale[:, 1]
        canvas[:, 2] = np.minimum(sources[:, 2] / scale[:, 0], chw[:, 0] - canvas[:, 0])
        canvas[:, 3] = np.minimum(sources[:, 3] / scale[:, 1], chw[:, 1] - canvas[:, 1])
        placed = (rows, canvas[rows], rects) if len(rows) else None
        return windows, flips, canvas, dropped, placed

    # -- whole slots -------------------------------------------------------------------
    def _views(self, fresh):
        slot, n = fresh.payload, fresh.count
        flips = slot.flip[:n].view(bool)
        objects = self._objects(SourceObjects.of_slot(slot, n, copy=False), slot.boxes[:n],
                                flips) if self.max_objects else None
        return Batch(images=slot.pixels[:n].reshape(n, *self.size, 3),
                     labels=slot.labels[:n], sample_ids=fresh.sample_ids, fresh=fresh.ok,
                     echo_index=np.zeros(n, np.int64), crop_boxes=slot.boxes[:n],
                     flips=flips, epoch=fresh.epoch, objects=objects)

    def pass_through(self, fresh, keep=None):
        """``(parts, copied)``: the parts of a fresh batch as delivered (only its rows
        ``keep``, a mask, when given: a resume at e = 1 from a state saved with echo
        leaves out what was emitted before the save), and whether its pixels were
        copied out (else the parts are views of the slot)."""
        b = self._views(fresh)
        if keep is not None:
            rows = np.flatnonzero(keep)
            o = b.objects
            b = Batch(b.images[rows], b.labels[rows], b.sample_ids[rows], b.fresh[rows],
                      b.echo_index[rows], b.crop_boxes[rows], b.flips[rows], b.epoch,
                      objects=None if o is None else Objects(
                          o.boxes[rows], o.labels[rows], o.valid[rows], o.iscrowd[rows],
                          o.canvas_size))
        copied = not self.device.host_resident
        if copied:
            # The slot goes back once its pixels are copied: keep what else it holds.
            images = self.device.to_device(b.images, self.outputs.next("images",
                                                                       b.images.shape))
            b = Batch(images, b.labels.copy(), b.sample_ids.copy(), b.fresh.copy(),
                      b.echo_index, b.crop_boxes.copy(), b.flips.copy(), b.epoch,
                      objects=b.objects)
        return (b.images, b.labels, b.sample_ids, b.fresh, b.echo_index, b.crop_boxes, b.flips,
                b.epoch, b.objects), copied

    def keep(self, fresh):
        """A fresh batch that owns its memory (on the device), for batch echo."""
        b = self._views(fresh)
        if self.device.host_resident:
            return b.copy()
        return Batch(self.device.to_device(b.images), b.labels.copy(), b.sample_ids.copy(),
                     b.fresh.copy(), b.echo_index.copy(), b.crop_boxes.copy(), b.flips.copy(),
                     b.epoch, objects=b.objects)

    def repeat(self, kept, echo, epoch):
        """The parts of one emission of a kept batch (``echo`` 0 for its first)."""
        images = self.device.copy(kept.images, self.outputs.next("images", kept.images.shape))
        return (images, kept.labels.copy(), kept.sample_ids.copy(), kept.fresh & (echo == 0),
                np.full(len(kept), echo, np.int64), kept.crop_boxes.copy(), kept.flips.copy(),
                epoch, None if kept.objects is None else kept.objects.copy())

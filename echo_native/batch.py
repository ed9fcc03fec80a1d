"""What crosses from the ring to the consumer: a sample's record (:class:`Columns`), a
:class:`Batch`, and the :class:`Fresh` batch an echo stage takes from its upstream.

A batch's arrays are views where they can be: of a ring slot (echo=1 on the
CPU, valid until the next batch is requested or :meth:`Batch.release`), or of
the pipeline's rotating output buffers.  ``copy()`` what you keep longer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from echo_native.boxes import SourceObjects
from echo_native.ring import COLUMNS, ROW_KINDS, Record
from echo_native.targets import OBJECT_FIELDS


def _per_object():
    parent = {kind: p for kind, p, _, _ in ROW_KINDS}

    def under_objects(kind):
        while kind != "object" and kind in parent:
            kind = parent[kind]
        return kind == "object"

    return frozenset(name for name, _, rows, _ in COLUMNS if under_objects(rows))


#: The columns whose axis 1 is a sample's object slots (objects, and the rows of each
#: object's fields): only a row's first ``obj_count`` slots hold its objects.
PER_OBJECT = _per_object()


class Columns:
    """Named per-sample arrays, one per column of a slot's record (:data:`~echo_native.
    ring.COLUMNS`, the table in ``en_ring.h``): labels, sample ids, status, the crop box
    and flip, the canvas's shape, the source's size and their scale, and the objects.

    Rows are samples.  ``Columns.of_slot`` views a ring slot; the echo buffer is
    ``Columns.allocate(capacity, record)``, filled with :meth:`put`; an emission
    takes its rows (:meth:`take`, a copy its crop spec then redraws).  A new per-sample
    field is a row of the C table, and every holder of a record follows it.

    Copies move only the object slots in use (up to the most objects a row holds): a
    record has room for ``max_objects``, a mask's bytes each, and most samples hold a
    few; the slots past a row's ``obj_count`` are never read.
    """

    __slots__ = ("arrays",)

    def __init__(self, arrays):
        self.arrays = dict(arrays)

    @classmethod
    def allocate(cls, rows, record=Record()):
        """Zeroed columns of ``rows`` samples of ``record``'s sizes (a
        :class:`~echo_native.ring.Record`)."""
        return cls({name: np.zeros(record.shape(kind, width, int(rows)), dtype)
                    for name, dtype, kind, width in COLUMNS})

    @classmethod
    def of_slot(cls, slot, n):
        """Views of the first ``n`` rows of each column of ``slot`` (a ring slot's view,
        or anything with the columns as attributes)."""
        return cls({name: getattr(slot, name)[:n] for name, *_ in COLUMNS})

    def __getattr__(self, name):
        try:
            return self.arrays[name]
        except KeyError:
            raise AttributeError(name) from None

    def __len__(self):
        return len(self.arrays["labels"])

    @property
    def max_objects(self):
        return self.arrays["obj_boxes"].shape[1]

    def _used(self, counts):
        """Object slots worth copying for rows of ``counts`` objects: the most a row
        holds, at least one where the record has slots (its batches have objects)."""
        return min(self.max_objects, max(int(np.max(counts, initial=0)), 1))

    def take(self, rows):
        """Rows ``rows`` (indices or a mask) of every column, copied."""
        m = self._used(self.arrays["obj_count"][rows])
        return Columns({name: a[rows, :m] if name in PER_OBJECT else a[rows]
                        for name, a in self.arrays.items()})

    def put(self, rows, other):
        """Write ``other``'s rows into rows ``rows``, column by column."""
        m = other._used(other.arrays["obj_count"])
        for name, a in self.arrays.items():
            if name in PER_OBJECT:
                a[rows, :m] = other.arrays[name][:, :m]
            else:
                a[rows] = other.arrays[name]

    def copy(self):
        m = self._used(self.arrays["obj_count"])
        return Columns({name: a[:, :m].copy() if name in PER_OBJECT else a.copy()
                        for name, a in self.arrays.items()})

    def to(self, xp):
        """The columns as arrays of the array module ``xp`` (NumPy, CuPy)."""
        return Columns({name: xp.asarray(a) for name, a in self.arrays.items()})

    def objects(self):
        """The rows' :class:`~echo_native.boxes.SourceObjects` (views), with each
        object field the records carry (a column of more than 0 rows per object)."""
        return SourceObjects(self.obj_boxes, self.obj_labels, self.obj_flags,
                             self.obj_count.astype(np.int64),
                             {f.name: f.stored(self) for f in OBJECT_FIELDS
                              if self.arrays[f.column].shape[2]})


@dataclass
class Batch:
    """One batch.

    Straight from the ring (echo=1 on the CPU), the arrays are views of the
    slot until the next batch is requested or :meth:`release` is called.
    From :class:`EchoRing` otherwise (echoing, normalising, on a GPU), images
    live in the device's rotating output buffers (three, so that the next batch
    is made while the consumer works on this one), valid until the batch after
    next is requested, and until ``close()``.  Either way ``copy()`` what you
    keep longer.  The arrays export DLPack: ``torch.from_dlpack(batch.images)``
    shares the memory.  On a GPU, images are a ``DeviceArray`` (or a
    ``BFloat16Array``) whose every export orders the stream it is taken on
    after the batch and the pipeline's reuse of the buffer after that stream
    (docs/gpu.md).
    """

    images: np.ndarray       # (B, H, W, 3) uint8
    labels: np.ndarray       # (B,) int64
    sample_ids: np.ndarray   # (B,) int64, indices into the source
    fresh: np.ndarray        # (B,) bool: first emission of a sample read this epoch
    echo_index: np.ndarray   # (B,) int64: 0 for the fresh emission, 1.. for echoes
    crop_boxes: np.ndarray   # (B, 4) float32: the crop (top, left, height, width) in the
                             # original image (detection boxes are ``objects``)
    flips: np.ndarray        # (B,) bool
    epoch: int = 0
    _release: object = None
    targets: object = None   # (B, classes) float32 soft targets with Mix, else None
    objects: object = None   # Objects (detection: boxes after the crop, labels), else None

    def __len__(self):
        return len(self.labels)

    @classmethod
    def from_columns(cls, images, columns, *, sample_ids, fresh, echo_index, epoch,
                     sanitize=None, rules=None, redrawn=None, release=None):
        """The batch of ``images`` whose records are ``columns``: labels, crop boxes and
        flips are the columns' (views), and with object columns the objects mapped
        through each row's crop and flip onto the images (``sanitize``: the
        SanitizeBoundingBoxes spec, or None; ``rules``: what each object field follows,
        by name, e.g. the source's :class:`~echo_native.keypoints.Keypoints`;
        ``redrawn``: how the images came from stored ones,
        :class:`~echo_native.transforms.Redrawn`; None: they are the stored images)."""
        flips = columns.flip.view(bool)
        objects = None
        if columns.max_objects:
            objects = columns.objects().map(columns.boxes, flips, images.shape[1:3],
                                            sanitize, rules=rules, redrawn=redrawn)
        return cls(images, columns.labels, sample_ids, fresh, echo_index, columns.boxes, flips,
                   epoch, _release=release, objects=objects)

    def to_torchvision(self):
        """The detection targets as torchvision's detection models take them: one
        ``{"boxes", "labels"}`` dict of torch tensors per image, the boxes
        ``tv_tensors.BoundingBoxes`` (XYXY, on the images' canvas) where torchvision
        imports, plain tensors where it does not; torch is imported here, when first
        needed (see :meth:`echo_native.Objects.to_torchvision`)."""
        if self.objects is None:
            raise ValueError("this batch has no objects: its source has no detection targets")
        return self.objects.to_torchvision()

    @property
    def boxes(self):
        """The former name of :attr:`crop_boxes` (the crop windows, not detection
        boxes: those are :attr:`objects`)."""
        return self.crop_boxes

    def release(self):
        """Give the slot back to the workers now; the arrays must not be used after."""
        if self._release is not None:
            self._release()
            self._release = None

    def copy(self):
        """A batch that owns its memory (survives the slot's reuse)."""
        return Batch(self.images.copy(), self.labels.copy(), self.sample_ids.copy(),
                     self.fresh.copy(), self.echo_index.copy(), self.crop_boxes.copy(),
                     self.flips.copy(), self.epoch,
                     targets=None if self.targets is None else self.targets.copy(),
                     objects=None if self.objects is None else self.objects.copy())


@dataclass
class Fresh:
    """A fresh batch as an echo stage takes it from its upstream (the ring's consumer
    end, :class:`echo_native.loader.Loader`, or a wrapped iterator of batches).

    ``sample_ids`` and ``ok`` are per row: the sample's id, and whether the row is
    the sample asked for (False for a stand-in that replaced a failed sample).
    ``payload`` is what the stage stores or emits: the ring slot's views, or the
    user's batch.  ``fill_s`` is the upstream's work for it (seconds), for auto echo.
    """

    ticket: int
    epoch: int
    index: int            # the fresh batch's number within its epoch
    sample_ids: np.ndarray
    ok: np.ndarray
    payload: object
    fill_s: float = 0.0

    @property
    def count(self):
        return len(self.sample_ids)


class Books:
    """What a loader or an echo stage counts since it started, for ``stats()``."""

    def __init__(self):
        self.started = 0.0
        self.fresh = self.delivered = self.batches = self.fresh_batches = self.warned = 0
        self.wait_s = self.consumer_s = self.fill_s = 0.0
        # Time spent waiting for the echo stage's own work on a device that times it
        # (auto echo weighs that work as the stage's capacity, not as consumer time).
        self.echo_wait_s = 0.0

    def start(self):
        if not self.started:
            self.started = time.perf_counter()

    def rates(self):
        """The counts, and the fresh and delivered examples per second since start."""
        elapsed = time.perf_counter() - self.started if self.started else 0.0
        return {"fresh": self.fresh, "delivered": self.delivered, "batches": self.batches,
                "fresh_per_s": self.fresh / elapsed if elapsed else 0.0,
                "delivered_per_s": self.delivered / elapsed if elapsed else 0.0,
                "stall_s": self.wait_s}

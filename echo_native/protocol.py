"""What a source is: the :class:`Source` protocol and its optional hooks.

A source is an indexable set of encoded samples.  Three members make one; the
rest are hooks the pipeline uses when a source has them, each for one purpose:

===================  ==========================================================
``len(source)``      the number of samples; sample ids are ``0 .. len - 1``
``source.labels``    one integer per sample (checked once: ``labels.check_labels``)
``source.read(i)``   sample ``i``'s encoded bytes (any bytes-like object), run in a
                     worker; an exception is that sample's failure, under ``on_error``
``describe(i)``      a path or name for messages (default: ``sample i``)
``classes``          class names, ``classes[label]`` (Mix's class count, reports)
``targets(i)``       detection targets of sample ``i`` (``Targets`` or its dict),
                     with ``has_targets`` False when a source that can carry them
                     does not
``<field>``          for each kind of per-object target beside boxes and labels
                     (:class:`ObjectField`, ``targets.OBJECT_FIELDS``), a hook of
                     its name says whether its objects carry it: ``keypoints``, the
                     ``Keypoints`` (names, flip pairs) of pose targets; ``masks``,
                     True where they carry masks (polygons or RLE)
``epoch_order``      ``(seed, epoch) -> ids``: the source's own shuffle (shards read
                     in sequence, row groups whole); the plan's otherwise
``prefetch``         ``(ids, upcoming=())``: a hint of the samples a worker reads
                     next, so remote bytes arrive before the decode asks
``remote_options``   the ``RemoteOptions`` of a source that reads object storage
                     (its worker caches count against the memory budget)
===================  ==========================================================

The pipeline asks for a hook with :func:`hook`, never ``getattr`` on a private
name, so this table is the whole of what it may use.  A small source::

    class Blobs:
        def __init__(self, blobs, labels):
            self.blobs, self.labels = blobs, np.asarray(labels)

        def __len__(self):
            return len(self.blobs)

        def read(self, i):
            return self.blobs[i]

    isinstance(Blobs([b"..."], [0]), en.Source)   # True: EchoRing(Blobs(...)) takes it
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["HOOKS", "ObjectField", "Source", "hook"]


@runtime_checkable
class Source(Protocol):
    """The three members every source has (the hooks are in :data:`HOOKS`)."""

    labels: Any

    def __len__(self) -> int: ...

    def read(self, i: int) -> Any: ...


#: The optional hooks, and what each is for (this module's docstring has the table).
HOOKS = {
    "describe": "a path or name of sample i, for messages",
    "classes": "class names, classes[label]",
    "targets": "detection targets of sample i",
    "has_targets": "False where a source that can carry targets carries none",
    "epoch_order": "(seed, epoch) -> the epoch's order of sample ids",
    "prefetch": "(ids, upcoming=()) -> None: the samples a worker reads next",
    "remote_options": "the RemoteOptions of a source that reads object storage",
}


def hook(source, name, default=None):
    """``source``'s hook ``name`` (one of :data:`HOOKS`), or ``default`` where it has
    none.  A name outside the table is a KeyError: the pipeline uses no other (an
    object field's hook is :meth:`ObjectField.given`)."""
    if name not in HOOKS:
        raise KeyError(f"{name!r} is not a source hook (echo_native.protocol.HOOKS: "
                       f"{', '.join(HOOKS)})")
    return getattr(source, name, default)


class ObjectField:
    """One kind of per-object target beside an object's box and label: what the
    pipeline does with it, all in the kind's own module (:mod:`echo_native.keypoints`,
    :mod:`echo_native.masks`).  A new kind is that module, a column and a row kind of
    the record (``EN_RING_COLUMNS`` and ``EN_RING_ROW_KINDS`` in ``en_ring.h``), a
    line of ``targets.OBJECT_FIELDS``, and the sources that give it.

    A subclass names itself: ``name``, the attribute of ``Targets`` and ``Objects``,
    the key of the targets' JSON form and of ``to_torchvision()``, and the source
    hook that says it is carried; ``size``, its row kind's size in the record
    (``max_keypoints``); ``column``, its column of the record (``obj_keypoints``).
    """

    name = size = column = None

    def given(self, source):
        """The source's hook of this field's name, or None."""
        return getattr(source, self.name, None)

    def carried(self, source, sample_bytes):
        """``(size, rule)`` for a source with targets: the field's rows per object in a
        record of ``sample_bytes`` pixel bytes per sample, and what its emissions follow
        besides the geometry (given back to :meth:`emit`); ``(0, None)`` where the
        source's objects do not carry it."""
        raise NotImplementedError

    def check(self, value, n, image_hw, where):
        """``value`` for ``n`` objects of an image of ``image_hw`` (or None), checked
        (read-only); ValueError naming ``where`` and the first bad object."""
        raise NotImplementedError

    def to_json(self, value):
        """``value`` as JSON data that :meth:`check` takes back."""
        raise NotImplementedError

    def equal(self, a, b):
        return a == b

    def write(self, out, value, size, *, window, flip, shape, image_hw, scale):
        """Write one sample's ``value`` (checked; None: its objects carry none) into
        ``out``, the rows of its objects in the slot's column, after the decode:
        ``window`` (top, left, height, width) of the ``image_hw`` source, ``flip``, the
        stored image's ``shape`` and, for a canvas, its ``scale`` (else None).  A
        ValueError fails the sample."""
        raise NotImplementedError

    def stored(self, columns):
        """What emissions read of this field in records ``columns`` (views)."""
        return getattr(columns, self.column)

    def emit(self, stored, valid, cols, windows, flips, size, redrawn, rule):
        """The kept objects' values on the emitted images of ``size``: entry ``(i, j)``,
        where ``valid``, is object ``cols[i, j]`` of row ``i``, through the row's
        ``windows`` and ``flips`` (``redrawn``: how the images came from the stored ones,
        a :class:`~echo_native.transforms.Redrawn`, or None; ``rule``: from
        :meth:`carried`)."""
        raise NotImplementedError

    def torchvision(self, value, tv):
        """One image's ``value`` (torch) as torchvision's models take it (``tv``: its
        tv_tensors module, or None)."""
        return value

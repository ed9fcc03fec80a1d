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
``keypoints``        the ``Keypoints`` (names, flip pairs) its targets' objects
                     carry, for pose targets
``masks``            True where its targets' objects carry masks (``Targets.masks``:
                     polygons or RLE), rasterised into each sample's record
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

__all__ = ["HOOKS", "Source", "hook"]


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
    "keypoints": "the Keypoints (names, flip pairs) its targets' objects carry",
    "masks": "True where its targets' objects carry masks (polygons or RLE)",
    "epoch_order": "(seed, epoch) -> the epoch's order of sample ids",
    "prefetch": "(ids, upcoming=()) -> None: the samples a worker reads next",
    "remote_options": "the RemoteOptions of a source that reads object storage",
}


def hook(source, name, default=None):
    """``source``'s hook ``name`` (one of :data:`HOOKS`), or ``default`` where it has
    none.  A name outside the table is a KeyError: the pipeline uses no other."""
    if name not in HOOKS:
        raise KeyError(f"{name!r} is not a source hook (echo_native.protocol.HOOKS: "
                       f"{', '.join(HOOKS)})")
    return getattr(source, name, default)

"""The constructor's arguments as specs, folded and checked once, in one place.

Each argument that groups decisions is a small frozen spec that validates
itself (``RandomResizedCrop``, ``DecodeLimits``, ``Shard``, :class:`Workers`,
``Echo``, ``Output``).  The flat keywords of the original public contract
(``image_size=``, ``scale=``, ``placement=``, ``normalize=``, ``rank=``,
``slots=``, ...) keep working: :func:`fold` turns them into the spec they belong
to, for :class:`~echo_native.loader.Loader` and :class:`~echo_native.EchoRing`
alike, and refuses a shorthand given next to its own spec (which would win is
not obvious).  The ``Echo`` and ``Output`` shorthands of EchoRing are folded
beside their specs (``fold_echo``, ``fold_output``) with the same helpers.
"""
from __future__ import annotations

from dataclasses import dataclass

from echo_native._checks import choice, cpus, either, is_int, positive_int, seconds, size_pair, \
    take
from echo_native.augment import check_ops, split_augment
from echo_native.decode import DecodeLimits
from echo_native.detection import BoxCrop, SanitizeBoundingBoxes, split_geometry
from echo_native.plan import Shard
from echo_native.ring import MAX_WORKERS
from echo_native.transforms import CenterCrop, RandomResizedCrop

WORKER_MODES = ("process", "thread")


@dataclass(frozen=True)
class Workers:
    """Who makes the fresh batches, and how long they may take.

    Parameters
    ----------
    count : int, default: the CPUs this process may use (at most ``MAX_WORKERS``)
        Worker processes (or threads) decoding in parallel.
    mode : {"process", "thread"}, default "process"
        Worker processes are fresh interpreters that never run your ``__main__``
        (no main guard needed); the source reaches them pickled by value, so a
        class defined in your script or notebook works.  Threads suit sources
        whose ``read`` releases the GIL (the decode always does).
    slots : int, default max(4, 2 x count)
        Batch slots in the shared-memory ring.
    timeout : float, default 120
        Seconds to wait for one batch before raising ``TimeoutError``.
    sample_timeout : float or None, default 60
        Seconds one sample may take to read and decode in a worker process before
        that worker is replaced and the sample reported as failed (a read that
        hangs on a stalled network mount cannot be interrupted from inside).
        None disables it; thread workers cannot be replaced and ignore it.
    """

    count: int = None
    mode: str = "process"
    slots: int = None
    timeout: float = 120.0
    sample_timeout: float = 60.0

    def __post_init__(self):
        if self.count is not None:
            positive_int("Workers", "count", self.count, 1, MAX_WORKERS)
        choice("Workers", "mode", self.mode, WORKER_MODES)
        if self.slots is not None:
            positive_int("Workers", "slots", self.slots, 2)
        object.__setattr__(self, "timeout", seconds("Workers", "timeout", self.timeout))
        object.__setattr__(self, "sample_timeout", seconds(
            "Workers", "sample_timeout", self.sample_timeout, optional=True))

    @property
    def processes(self):
        """Workers this spec starts (``count``, or the CPUs this process may use)."""
        return min(cpus(), MAX_WORKERS) if self.count is None else int(self.count)

    @property
    def ring_slots(self):
        return self.slots or max(4, 2 * self.processes)


@dataclass(frozen=True)
class Specs:
    """Every spec of one loader or ring, folded and checked."""

    crop: object          # RandomResizedCrop, CenterCrop or a detection BoxCrop
    ops: tuple            # per-example ops after the crop
    decode: DecodeLimits
    shard: Shard
    workers: Workers
    sanitize: object = None  # SanitizeBoundingBoxes of a detection list, or None


#: Shorthand -> (spec, field) for every flat keyword of the original contract.
_CROP = {"image_size": "size", "scale": "scale", "ratio": "ratio", "flip_p": "flip_p"}
_WORKERS = {"slots": "slots", "timeout": "timeout", "sample_timeout": "sample_timeout",
            "worker_mode": "mode"}


def fold(owner, augment=None, decode=None, shard=None, workers=None, shorthands=None):
    """The :class:`Specs` of ``owner`` ("Loader", "EchoRing") from its arguments and the
    flat shorthands left in ``shorthands`` (an EchoRing folds its ``Echo`` and
    ``Output`` ones first: :func:`echo_native.echo.spec.fold_echo`,
    :func:`echo_native.output.fold_output`).  Leftover keywords are a TypeError
    naming them."""
    shorthands = dict(shorthands or {})
    geometry = split_geometry(owner, augment)
    if geometry is not None:
        crop, sanitize, rest = geometry
        ops = check_ops(owner, rest, "the steps after the detection geometry")
    else:
        sanitize = None
        if isinstance(augment, (list, tuple)) and len(augment) > 1 and \
                isinstance(augment[1], SanitizeBoundingBoxes):
            # [RandomResizedCrop(...), SanitizeBoundingBoxes(), ops...]: boxes follow the crop.
            sanitize, augment = augment[1], [augment[0], *augment[2:]]
        crop, ops = split_augment(owner, augment)
    given = take(shorthands, _CROP)
    either(owner, "augment=", crop, given)
    if given:
        if "size" in given:  # errors should name what the user wrote
            given["size"] = size_pair(given["size"], "image_size")
        crop = RandomResizedCrop(**given)
    crop = RandomResizedCrop() if crop is None else crop
    if not isinstance(crop, (RandomResizedCrop, CenterCrop, BoxCrop)):
        raise TypeError(f"{owner}: augment must be an echo_native.RandomResizedCrop or "
                        f"CenterCrop, got {crop!r}")

    if "strict" in shorthands:
        either(owner, "decode=", decode, {"strict"}, "strict=")
        decode = DecodeLimits(strict=shorthands.pop("strict"))
    decode = DecodeLimits() if decode is None else decode
    if not isinstance(decode, DecodeLimits):
        raise TypeError(f"{owner}: decode must be an echo_native.DecodeLimits, got {decode!r}")

    ranks = take(shorthands, ("rank", "world_size"))
    either(owner, "shard=", shard, ranks, "rank=/world_size=")
    shard = Shard(**ranks) if ranks else (Shard() if shard is None else shard)
    if not isinstance(shard, Shard):
        raise TypeError(f"{owner}: shard must be an echo_native.Shard, got {shard!r}")

    workers = _fold_workers(owner, workers, take(shorthands, _WORKERS))
    if shorthands:
        raise TypeError(f"{owner} got unexpected keyword argument(s) "
                        f"{', '.join(sorted(shorthands))}")
    return Specs(crop, ops, decode, shard, workers, sanitize)


def _fold_workers(owner, workers, given):
    if isinstance(workers, Workers):
        either(owner, "workers=Workers(...)", workers, given)
        return workers
    if workers is not None and not is_int(workers):
        raise ValueError(f"{owner}: workers must be a number of workers or an "
                         f"echo_native.Workers, got {workers!r}")
    try:
        return Workers(count=workers, **given)
    except (TypeError, ValueError) as e:
        # Name what the user wrote: workers=, slots=, timeout=, worker_mode=.
        message = str(e).replace("Workers: count", "workers").replace("Workers: mode",
                                                                      "worker_mode")
        raise type(e)(message.replace("Workers: ", "")) from None


def check_batch_size(batch_size):
    if not is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    return int(batch_size)


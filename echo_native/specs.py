"""The constructor's arguments as specs, folded and checked once, in one place.

Each argument that groups decisions is a small frozen spec that validates
itself (``RandomResizedCrop``, ``DecodeLimits``, ``Shard``, :class:`Workers`,
``Echo``, ``Output``).  The flat keywords of the original public contract
(``image_size=``, ``scale=``, ``placement=``, ``normalize=``, ``rank=``,
``slots=``, ...) keep working: :func:`fold` turns them into the spec they belong
to, for :class:`~echo_native.loader.Loader` and :class:`~echo_native.EchoRing`
alike, and refuses a shorthand given next to its own spec (which would win is
not obvious).
"""
from __future__ import annotations

from dataclasses import dataclass

from echo_native._checks import choice, cpus, is_int, is_number, positive_int, seconds, \
    size_pair
from echo_native.augment import split_augment
from echo_native.decode import DecodeLimits
from echo_native.echo.spec import Echo
from echo_native.output import Output
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

    crop: object          # RandomResizedCrop or CenterCrop
    ops: tuple            # per-example ops after the crop
    decode: DecodeLimits
    shard: Shard
    workers: Workers
    echo: Echo = None     # EchoRing only
    output: Output = None


#: Shorthand -> (spec, field) for every flat keyword of the original contract.
_CROP = {"image_size": "size", "scale": "scale", "ratio": "ratio", "flip_p": "flip_p"}
_WORKERS = {"slots": "slots", "timeout": "timeout", "sample_timeout": "sample_timeout",
            "worker_mode": "mode"}
_ECHO = {"placement": "placement", "shuffle_buffer": "shuffle_buffer", "max_echo": "max_echo",
         "canvas_side": "canvas_side", "canvas_max_pixels": "canvas_max_pixels",
         "echo_flip": "flip"}
_OUTPUT = ("normalize", "layout", "dtype")


def _take(shorthands, names):
    return {names[k] if isinstance(names, dict) else k: shorthands.pop(k)
            for k in list(shorthands) if k in names}


def _either(owner, spec_text, spec, given, given_text=None):
    if given and spec is not None:
        raise TypeError(f"{owner}: give either {spec_text} or "
                        f"{given_text or ', '.join(sorted(given))}, not both")


def fold(owner, augment=None, decode=None, shard=None, workers=None, shorthands=None, *,
         with_echo=False, echo=2.0, output=None):
    """The :class:`Specs` of ``owner`` ("Loader" or "EchoRing") from its arguments and
    flat shorthands; ``with_echo`` for EchoRing (``echo``, ``output`` and their
    shorthands).  Leftover keywords are a TypeError naming them."""
    shorthands = dict(shorthands or {})
    crop, ops = split_augment(owner, augment)
    given = _take(shorthands, _CROP)
    _either(owner, "augment=", crop, given)
    if given:
        if "size" in given:  # errors should name what the user wrote
            given["size"] = size_pair(given["size"], "image_size")
        crop = RandomResizedCrop(**given)
    crop = RandomResizedCrop() if crop is None else crop
    if not isinstance(crop, (RandomResizedCrop, CenterCrop)):
        raise TypeError(f"{owner}: augment must be an echo_native.RandomResizedCrop or "
                        f"CenterCrop, got {crop!r}")

    if "strict" in shorthands:
        _either(owner, "decode=", decode, {"strict"}, "strict=")
        decode = DecodeLimits(strict=shorthands.pop("strict"))
    decode = DecodeLimits() if decode is None else decode
    if not isinstance(decode, DecodeLimits):
        raise TypeError(f"{owner}: decode must be an echo_native.DecodeLimits, got {decode!r}")

    ranks = _take(shorthands, ("rank", "world_size"))
    _either(owner, "shard=", shard, ranks, "rank=/world_size=")
    shard = Shard(**ranks) if ranks else (Shard() if shard is None else shard)
    if not isinstance(shard, Shard):
        raise TypeError(f"{owner}: shard must be an echo_native.Shard, got {shard!r}")

    workers = _fold_workers(owner, workers, _take(shorthands, _WORKERS))

    if with_echo:
        echo = fold_echo(owner, echo, _take(shorthands, _ECHO))
        output = _fold_output(owner, output, _take(shorthands, _OUTPUT))
    else:
        echo = output = None
    if shorthands:
        raise TypeError(f"{owner} got unexpected keyword argument(s) "
                        f"{', '.join(sorted(shorthands))}")
    return Specs(crop, ops, decode, shard, workers, echo, output)


def _fold_workers(owner, workers, given):
    if isinstance(workers, Workers):
        _either(owner, "workers=Workers(...)", workers, given)
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


def fold_echo(owner, echo, given):
    """``echo=`` as an :class:`Echo`, with the flat shorthands folded in."""
    if isinstance(echo, Echo):
        _either(owner, "echo=Echo(...)", echo, given)
        return echo
    if not (isinstance(echo, str) or is_number(echo)):
        raise ValueError(f"echo must be an echo_native.Echo, a number >= 1 or 'auto', got "
                         f"{echo!r}")
    try:
        return Echo(echo, **given)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace("Echo: factor", "echo")) from None


def _fold_output(owner, output, given):
    """``output=`` as an :class:`Output`, with ``normalize``/``layout``/``dtype`` folded in."""
    if given:
        _either(owner, "output=Output(...)", output, given)
        if not given.get("normalize"):
            # The flat contract checked layout and dtype but used them only with
            # normalisation: check them the same way, then give uint8.
            Output(normalize=True, layout=given.get("layout", "NHWC"),
                   dtype=given.get("dtype", "float32"))
            return Output(normalize=False)
        return Output(**given)
    if output is None:
        return Output(normalize=False)
    if not isinstance(output, Output):
        raise TypeError(f"output must be an echo_native.Output or None, got {output!r}")
    return output


def check_batch_size(batch_size):
    if not is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    return int(batch_size)


"""Stage 1c of the pipeline: per-example ops after the crop, drawn per emission.

``augment=[RandomResizedCrop(224), ColorJitter(0.4, 0.4, 0.4), RandomErasing()]``:
the crop first (fused with the decode), then these ops, each with torchvision's
semantics:

- :class:`ColorJitter`: brightness, contrast, saturation and hue in a random order.
- :class:`RandomGrayscale`.
- :class:`TrivialAugmentWide`: one of its 14 ops at a random magnitude.
- :class:`RandomErasing`: a random rectangle filled with a constant.

Every random parameter is a pure function of (seed, epoch, sample id, echo
index), like the crop's, so nothing depends on workers or timing and a resume
is exact: a batch's parameters are drawn in one native call
(``_kernel.draw_ops``, src/kernel/en_augment.c) from Philox under a tag of the
ops' own, with torchvision's distributions.  The ops compile into a *program*
per image (:class:`Program`: op codes and arguments, ``_kernel.Op``:
src/kernel/en_opcodes.h), which one kernel
source runs on both devices: natively on the CPU (in the workers for fresh
examples, in the batched re-augmentation for echoes) and as CUDA kernels on the
echo buffer's output on a GPU.

Where the ops are drawn depends on the echo placement:

==================  ==========================================================
``before_augment``  every emission draws every op afresh (echo index in the key)
``after_augment``   drawn once, by the worker, for the stored example; repeats
                    are that example (``Echo(flip=True)`` still redraws the flip)
``batch``           drawn once, by the worker; the batch repeats as it is
echo = 1            drawn by the worker
==================  ==========================================================
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from echo_native import _kernel
from echo_native._checks import number
from echo_native.transforms import CenterCrop, RandomResizedCrop

__all__ = ["ColorJitter", "RandomGrayscale", "TrivialAugmentWide", "RandomErasing", "Program",
           "WithOps", "check_ops", "split_augment"]

ARGS = _kernel.OP_ARGS  # arguments per program step (src/kernel/en_opcodes.h)
# An op's row of numbers for the native draws: its kind, then _kernel.DRAW_NUMBERS
# parameters; the format of each kind is EN_DRAW_LIST (en_kernel.h), read through
# _kernel.DRAWS: kind -> (name, numbers used, program steps).
SPEC = 1 + _kernel.DRAW_NUMBERS


def _spec_row(kind, *numbers):
    name, used, _ = _kernel.DRAWS[kind]
    if len(numbers) != used:  # a spec out of step with the C table: a bug of ours
        raise AssertionError(f"a {name} spec has {used} numbers, got {len(numbers)}")
    row = np.zeros(SPEC, np.float64)
    row[0] = kind
    row[1:1 + len(numbers)] = numbers
    return row


def _steps(kind):
    """The program steps an op of ``kind`` takes (EN_DRAW_LIST)."""
    return _kernel.DRAWS[kind][2]


def _range(owner, name, value, center, bound=(0.0, math.inf)):
    """torchvision's ``_check_input``: a number v means [center - v, center + v]
    (clipped at the lower bound), a pair is the range itself."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{owner}: {name} must be a number or a (min, max) pair, "
                             f"got {value!r}")
        lo, hi = (number(owner, name, v, *bound) for v in value)
        if lo > hi:
            raise ValueError(f"{owner}: {name} range {value!r} has min > max")
        return lo, hi
    v = number(owner, name, value, 0.0)
    lo, hi = center - v, center + v
    if center == 0.0 and hi > bound[1]:
        raise ValueError(f"{owner}: {name} must be at most {bound[1]}, got {value!r}")
    return max(lo, bound[0]), hi


def _probability(owner, p):
    return number(owner, "p", p, 0.0, 1.0)


@dataclass(frozen=True)
class ColorJitter:
    """torchvision's ``ColorJitter(brightness, contrast, saturation, hue)``.

    A number b means a factor drawn uniformly from [max(0, 1 - b), 1 + b] (hue:
    a shift from [-h, h], h <= 0.5); a pair is the range itself.  The four
    adjustments run in a random order, as torchvision's do; ``p`` is the
    probability that the jitter applies at all (``RandomApply``).
    """

    brightness: object = 0.0
    contrast: object = 0.0
    saturation: object = 0.0
    hue: object = 0.0
    p: float = 1.0

    steps = _steps(_kernel.DRAW_COLOR_JITTER)

    def __post_init__(self):
        name, set_ = type(self).__name__, object.__setattr__
        for field in ("brightness", "contrast", "saturation"):
            set_(self, field, _range(name, field, getattr(self, field), 1.0))
        set_(self, "hue", _range(name, "hue", self.hue, 0.0, (-0.5, 0.5)))
        set_(self, "p", _probability(name, self.p))

    def spec(self, fill):
        """Its row of numbers for the native draws (en_kernel.h): each adjustment whose
        range is not the identity gets a factor (hue: a shift) uniform on its range,
        in the order of a uniform permutation of the four, as torchvision's."""
        return _spec_row(_kernel.DRAW_COLOR_JITTER, self.p, *self.brightness, *self.contrast,
                         *self.saturation, *self.hue)


@dataclass(frozen=True)
class RandomGrayscale:
    """torchvision's ``RandomGrayscale(p)``: 0.299 R + 0.587 G + 0.114 B in all channels."""

    p: float = 0.1

    steps = _steps(_kernel.DRAW_GRAYSCALE)

    def __post_init__(self):
        object.__setattr__(self, "p", _probability(type(self).__name__, self.p))

    def spec(self, fill):
        return _spec_row(_kernel.DRAW_GRAYSCALE, self.p)


@dataclass(frozen=True)
class RandomErasing:
    """torchvision's ``RandomErasing(p, scale, ratio, value)``.

    With probability ``p`` a rectangle of area ``scale`` x the image's and aspect
    ratio ``ratio`` (log-uniform; ten tries to fit, else nothing is erased) is
    filled with ``value``: a number or an (R, G, B) triple in the space the
    batch is delivered in, as torchvision's after ``Normalize``; with a
    normalising output 0 is the mean colour, else values are in [0, 1] of 255.
    """

    p: float = 0.5
    scale: tuple = (0.02, 0.33)
    ratio: tuple = (0.3, 3.3)
    value: object = 0.0

    steps = _steps(_kernel.DRAW_ERASING)

    def __post_init__(self):
        name, set_ = type(self).__name__, object.__setattr__
        set_(self, "p", _probability(name, self.p))
        for field, lo in (("scale", 0.0), ("ratio", 1e-6)):
            pair = _range(name, field, tuple(getattr(self, field)), 0.0, (lo, math.inf))
            set_(self, field, pair)
        if self.scale[1] > 1:
            raise ValueError(f"{name}: scale must lie in [0, 1], got {self.scale!r}")
        value = self.value
        if isinstance(value, str):
            raise ValueError(f"{name}: value={value!r} is not supported; give a number or an "
                             f"(R, G, B) triple")
        values = tuple(value) if isinstance(value, (tuple, list)) else (value,) * 3
        if len(values) != 3:
            raise ValueError(f"{name}: value must be a number or 3 numbers, got {value!r}")
        set_(self, "value", tuple(number(name, "value", v) for v in values))

    def spec(self, fill):
        """Ten tries at an area uniform on ``scale`` x the image's and an aspect ratio
        log-uniform on ``ratio``; the first that fits is placed uniformly
        (torchvision's ``get_params``), filled with ``fill(value)``."""
        return _spec_row(_kernel.DRAW_ERASING, self.p, *self.scale, math.log(self.ratio[0]),
                         math.log(self.ratio[1]), *fill(self.value))


@dataclass(frozen=True)
class TrivialAugmentWide:
    """torchvision's ``TrivialAugmentWide(num_magnitude_bins, fill)`` (its PIL path).

    One op per image, uniformly from Identity, ShearX, ShearY, TranslateX,
    TranslateY, Rotate, Brightness, Color, Contrast, Sharpness, Posterize,
    Solarize, AutoContrast and Equalize, at a magnitude bin drawn uniformly
    (a random sign for the signed ops); the wide magnitude ranges: shear 0.99,
    translation 32 px, rotation 135 degrees, enhancement factors 1 +- 0.99,
    posterize 8..2 bits, solarize thresholds 255..0.  Geometric ops sample the
    nearest pixel and fill uncovered pixels with ``fill`` (0..255).
    """

    num_magnitude_bins: int = 31
    fill: int = 0

    steps = _steps(_kernel.DRAW_TRIVIAL_WIDE)
    OPS = ("Identity", "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness",
           "Color", "Contrast", "Sharpness", "Posterize", "Solarize", "AutoContrast",
           "Equalize")

    def __post_init__(self):
        name = type(self).__name__
        bins = self.num_magnitude_bins
        if not isinstance(bins, (int, np.integer)) or isinstance(bins, bool) or bins < 2:
            raise ValueError(f"{name}: num_magnitude_bins must be an integer >= 2, got {bins!r}")
        object.__setattr__(self, "fill", number(name, "fill", self.fill, 0, 255))

    def spec(self, fill):
        """One op of :attr:`OPS` uniformly, at a magnitude bin uniform on
        ``num_magnitude_bins``, a random sign for the signed ops (shears, translations,
        rotation and the four enhancements): torchvision's ``_augmentation_space``
        mapped to the kernels' ops (shears and translations as affine maps about the
        origin, translations by ``int(magnitude)`` pixels, rotation about the centre
        as :func:`rotation`)."""
        return _spec_row(_kernel.DRAW_TRIVIAL_WIDE, self.num_magnitude_bins, self.fill)


def rotation(degrees, h, w):
    """Pillow's ``rotate(degrees)`` about the image centre as an inverse affine map."""
    a = -math.radians(degrees % 360.0)
    c, s = round(math.cos(a), 15), round(math.sin(a), 15)
    cx, cy = w / 2.0, h / 2.0
    return (c, s, c * -cx + s * -cy + cx, -s, c, -s * -cx + c * -cy + cy)


OPS = (ColorJitter, RandomGrayscale, TrivialAugmentWide, RandomErasing)


def split_augment(owner, augment):
    """``augment=`` as (crop spec, per-example ops): a list or tuple is the crop
    followed by ops; a single spec has no ops."""
    if not isinstance(augment, (list, tuple)):
        return augment, ()
    if not augment:
        raise ValueError(f"{owner}: augment=[] is empty; start it with a RandomResizedCrop")
    crop, ops = augment[0], tuple(augment[1:])
    if not isinstance(crop, (RandomResizedCrop, CenterCrop)):
        raise TypeError(f"{owner}: augment must be an echo_native.RandomResizedCrop or "
                        f"CenterCrop, or a list that starts with one, got {augment!r} (an "
                        f"output size is image_size=)")
    if ops and not isinstance(crop, RandomResizedCrop):
        raise ValueError(f"{owner}: per-example ops follow a RandomResizedCrop (training); "
                         f"got {crop!r} first")
    return crop, check_ops(owner, ops)


def check_ops(owner, ops, where="augment[1:]"):
    """``ops`` as a tuple, each a per-example op (TypeError naming the first that is not)."""
    ops = tuple(ops)
    for o in ops:
        if not isinstance(o, OPS):
            names = ", ".join(c.__name__ for c in OPS)
            raise TypeError(f"{owner}: {where} must be per-example ops ({names}), got {o!r}")
    return ops


class Program:
    """The ops of one ``augment=`` list for images of ``size``, compiled per image.

    ``fill(value)`` maps a :class:`RandomErasing` value to the (R, G, B) pixel
    it stands for (the output's normalisation decides).
    """

    def __init__(self, ops, size, mean=None, std=None):
        self.ops, self.size = tuple(ops), tuple(size)
        self.steps = sum(o.steps for o in self.ops)
        self.mean, self.std = mean, std
        self.specs = np.ascontiguousarray(
            np.stack([o.spec(self._fill) for o in self.ops]) if self.ops
            else np.zeros((0, SPEC)), np.float64)

    def __bool__(self):
        return bool(self.ops)

    def _fill(self, value):
        if self.mean is None:  # the [0, 1] scale of ToTensor
            px = [v * 255.0 for v in value]
        else:
            px = [(m + v * s) * 255.0 for v, m, s in zip(value, self.mean, self.std)]
        return tuple(float(min(255.0, max(0.0, math.floor(p + 0.5)))) for p in px)

    def draw(self, seed, epochs, sample_ids, echo_index):
        """(codes, args) of the images keyed (seed, epoch, sample id, echo index):
        int32 (n, steps) and float32 (n, steps, 8), the batch in one native call."""
        return _kernel.draw_ops(self.specs, int(seed), epochs, sample_ids, echo_index,
                                self.size)

    def __repr__(self):
        return f"Program({list(self.ops)!r}, size={self.size})"


class WithOps:
    """A crop spec followed by a :class:`Program`, run by the workers: each fresh
    sample's ops are drawn with echo index 0 and applied where its pixels are."""

    def __init__(self, crop, program):
        self.crop, self.program = crop, program

    @property
    def size(self):
        return self.crop.size

    @property
    def sample_bytes(self):
        return self.crop.sample_bytes

    @property
    def takes_targets(self):
        return getattr(self.crop, "takes_targets", False)

    def apply(self, dec, data, key, slot, i, **targets):
        dropped = self.crop.apply(dec, data, key, slot, i, **targets)
        seed, epoch, sample_id, echo_index = key
        codes, args = self.program.draw(seed, epoch, [sample_id], echo_index)
        h, w = self.crop.size
        _kernel.apply_ops(slot.pixels[i].reshape(1, h, w, 3), codes, args)
        return dropped

    def __repr__(self):
        return f"WithOps({self.crop!r}, {list(self.program.ops)!r})"

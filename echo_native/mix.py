"""The last step before the consumer: MixUp / CutMix and the user's own batch op.

:class:`Mix` is timm's ``Mixup`` (mode "batch") as a spec: with probability
``prob`` a batch is mixed, by CutMix with probability ``switch_prob`` when both
alphas are set, else by MixUp, with lambda ~ Beta(alpha, alpha); row i is mixed
with row B-1-i (the batch reversed) and the targets become soft:
``lam * smooth(label) + (1 - lam) * smooth(reversed label)``.  The draws come
from a generator keyed by (seed, epoch, batch index in the epoch), so they never
depend on workers or timing; every emitted batch draws afresh, an echo included.

The pixels are mixed where the batch lives (NumPy on the host, CuPy on a GPU),
after normalisation: mixing commutes with the affine normalisation, and a
normalised batch is float, which a mix needs.  A bfloat16 output is normalised
and mixed in float32 and rounded to bfloat16 once at the end (to nearest even),
bit for bit what mixing in float32 and then casting gives in torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from echo_native._checks import number

__all__ = ["Mix", "mix_params", "soft_targets"]


@dataclass(frozen=True)
class Mix:
    """MixUp and CutMix with soft targets, timm's ``Mixup`` semantics (mode "batch").

    Parameters (timm's names and defaults)
    ----------
    mixup_alpha : float, default 1.0
        Beta(alpha, alpha) for MixUp's lambda; 0 disables MixUp.
    cutmix_alpha : float, default 0.0
        Beta(alpha, alpha) for CutMix's lambda; 0 disables CutMix.
    prob : float, default 1.0
        Probability that a batch is mixed at all.
    switch_prob : float, default 0.5
        With both alphas set: probability of CutMix instead of MixUp.
    label_smoothing : float, default 0.1
        Targets are ``1 - s + s/C`` on the label and ``s/C`` elsewhere before mixing.
    num_classes : int, optional
        Default: from the source (``len(source.classes)``, else max label + 1).
    cutmix_minmax : (float, float), optional
        CutMix box sides as fractions of the image, drawn uniformly in [lo, hi)
        instead of from lambda (lambda is then the kept area); sets cutmix_alpha
        to 1, as timm does.
    correct_lam : bool, default True
        CutMix: lambda is the area actually kept after clipping the box.

    Needs a normalised output (``Output(normalize=...)``), float32, float16 or
    bfloat16; float32 and float16 batches are mixed in their dtype, bfloat16 ones in
    float32 and rounded once.  ``batch.targets`` is (B, num_classes) float32 on the
    batch's device, whatever the dtype: on a GPU a :class:`~echo_native.output.DeviceArray`,
    ordered for its consumer and valid as long as the images are.
    """

    mixup_alpha: float = 1.0
    cutmix_alpha: float = 0.0
    prob: float = 1.0
    switch_prob: float = 0.5
    label_smoothing: float = 0.1
    num_classes: int = None
    cutmix_minmax: tuple = None
    correct_lam: bool = True

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "mixup_alpha", number("Mix", "mixup_alpha", self.mixup_alpha, 0.0))
        set_(self, "cutmix_alpha", number("Mix", "cutmix_alpha", self.cutmix_alpha, 0.0))
        if self.mixup_alpha == 0 and self.cutmix_alpha == 0 and self.cutmix_minmax is None:
            raise ValueError("Mix: mixup_alpha and cutmix_alpha are both 0, nothing would be "
                             "mixed (give one of them, or no Mix)")
        set_(self, "prob", number("Mix", "prob", self.prob, 0.0, 1.0))
        set_(self, "switch_prob", number("Mix", "switch_prob", self.switch_prob, 0.0, 1.0))
        set_(self, "label_smoothing",
             number("Mix", "label_smoothing", self.label_smoothing, 0.0, 1.0, hi_open=True))
        c = self.num_classes
        if c is not None and (not isinstance(c, (int, np.integer)) or isinstance(c, bool)
                              or c < 1):
            raise ValueError(f"Mix: num_classes must be a positive integer, got {c!r}")
        mm = self.cutmix_minmax
        if mm is not None:
            set_(self, "cutmix_alpha", 1.0)  # as timm: the box sides replace lambda's draw
            try:
                lo, hi = (float(v) for v in mm)
            except (TypeError, ValueError):
                raise ValueError(f"Mix: cutmix_minmax must be (lo, hi), got {mm!r}") from None
            if not 0 < lo < hi <= 1:
                raise ValueError(f"Mix: cutmix_minmax must satisfy 0 < lo < hi <= 1, got {mm!r}")
            set_(self, "cutmix_minmax", (lo, hi))
        if not isinstance(self.correct_lam, (bool, np.bool_)):
            raise TypeError(f"Mix: correct_lam must be True or False, got {self.correct_lam!r}")


def mix_params(spec, rng, height, width):
    """One batch's draws, in timm's order: ``(lam, box)`` where ``box`` is None for
    MixUp (or no mix, lam = 1) and ``(top, bottom, left, right)`` for CutMix."""
    lam, cutmix = 1.0, False
    if rng.random() < spec.prob:
        if spec.mixup_alpha > 0 and spec.cutmix_alpha > 0:
            cutmix = rng.random() < spec.switch_prob
            alpha = spec.cutmix_alpha if cutmix else spec.mixup_alpha
            lam = float(rng.beta(alpha, alpha))
        elif spec.mixup_alpha > 0:
            lam = float(rng.beta(spec.mixup_alpha, spec.mixup_alpha))
        else:
            cutmix = True
            if spec.cutmix_alpha > 0:
                lam = float(rng.beta(spec.cutmix_alpha, spec.cutmix_alpha))
    if not cutmix:
        return lam, None
    if spec.cutmix_minmax is not None:
        lo, hi = spec.cutmix_minmax
        ch = int(rng.integers(int(height * lo), max(int(height * hi), int(height * lo) + 1)))
        cw = int(rng.integers(int(width * lo), max(int(width * hi), int(width * lo) + 1)))
        top = int(rng.integers(0, max(height - ch, 1)))
        left = int(rng.integers(0, max(width - cw, 1)))
        box = (top, top + ch, left, left + cw)
    else:
        ratio = math.sqrt(1.0 - lam)
        ch, cw = int(height * ratio), int(width * ratio)
        cy, cx = int(rng.integers(0, height)), int(rng.integers(0, width))
        box = (min(max(cy - ch // 2, 0), height), min(max(cy + ch // 2, 0), height),
               min(max(cx - cw // 2, 0), width), min(max(cx + cw // 2, 0), width))
    if spec.correct_lam or spec.cutmix_minmax is not None:
        lam = 1.0 - (box[1] - box[0]) * (box[3] - box[2]) / float(height * width)
    return lam, box


def soft_targets(xp, labels, num_classes, lam, smoothing):
    """``lam * smooth(labels) + (1 - lam) * smooth(labels reversed)``, float32 (B, C)."""
    if hasattr(labels, "__cuda_array_interface__"):
        # Labels already on the GPU: checking them waits for them (the pipeline's
        # labels are host arrays, checked below without a wait).
        labels = xp.asarray(labels, dtype=xp.int64)
        lo, hi = (int(labels.min()), int(labels.max())) if len(labels) else (0, 0)
    else:
        host = np.asarray(labels, dtype=np.int64)
        lo, hi = (int(host.min()), int(host.max())) if len(host) else (0, 0)
        labels = xp.asarray(host)
    if lo < 0 or hi >= num_classes:
        raise ValueError(f"Mix: labels must be in [0, {num_classes}), got {lo}..{hi} "
                         f"(set Mix(num_classes=...))")
    off = smoothing / num_classes
    on = 1.0 - smoothing + off
    rows = xp.arange(len(labels))
    y = xp.full((len(labels), num_classes), off, dtype=xp.float32)
    y[rows, labels] = on
    flipped = xp.full((len(labels), num_classes), off, dtype=xp.float32)
    flipped[rows, labels[::-1]] = on
    return (y * xp.float32(lam) + flipped * xp.float32(1.0 - lam)).astype(xp.float32)

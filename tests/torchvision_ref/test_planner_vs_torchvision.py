"""The detection planner (``BoxCrop.draw``) against torchvision v2's own ``RandomZoomOut``,
``RandomIoUCrop`` and ``RandomHorizontalFlip``.

Three checks:

* replay: our planner's uniform draws, fed to torchvision's transforms in place of
  ``torch.rand`` / ``torch.randint``, make torchvision choose the same canvas, crop and
  flip; the whole SSD chain (``RandomZoomOut, RandomIoUCrop, RandomHorizontalFlip,
  Resize, SanitizeBoundingBoxes``) then gives our ``map_boxes`` + ``sanitize`` boxes and
  kept set (ours also keeps a box torchvision's float32 resize put past the canvas's
  edge: ``map_boxes`` clamps it, a deliberate difference).  This pins the algorithm draw
  for draw (the order of the draws, the float arithmetic of the sizes and offsets, the
  centre test and the IoU test);
* invariants of our draws over many keys: the canvas and crop bounds, the aspect range,
  a box centre inside every IoU crop with the drawn minimum IoU met, the dropped marks;
* distributions: our draws against torchvision's own random draws (its generator, fixed
  seeds), two-sample Kolmogorov-Smirnov on the crop and canvas sizes and offsets and
  exact tests on the frequencies, at p > 1e-6: loose enough never to fail by chance,
  so only coarse differences show (an IoU crop scale range 10 % short gives p ~ 1e-16, a
  zoom-out side range 10 % short only p ~ 1e-5); the replay pins the exact arithmetic.
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats
from tv_reference import tolerance, torch, tv_tensors, v2

from echo_native import detection as det
from echo_native.boxes import map_boxes, sanitize

_Generator = np.random.Generator


class _Recorder:
    """A NumPy Generator that records every uniform and integer draw, in order."""

    log: ClassVar[list] = []

    def __init__(self, bit_generator):
        self._g = _Generator(bit_generator)

    def random(self, size=None):
        v = self._g.random(size)
        self.log.append(("rand", np.atleast_1d(v).copy()))
        return v

    def integers(self, *args, **kwargs):
        v = self._g.integers(*args, **kwargs)
        self.log.append(("int", np.atleast_1d(v).copy()))
        return v


def _replaying(monkeypatch, log, flip_p):
    """torch.rand / torch.randint answering from ``log`` (float64: the planner's own
    arithmetic), each call checked against the kind and count drawn there."""
    queue = list(log)

    def rand(*size, **_):
        n = int(np.prod(size[0] if len(size) == 1 and isinstance(size[0], (tuple, list))
                        else size))
        if not queue:
            # The planner draws no flip at p == 0; torchvision always draws one.
            assert flip_p == 0.0, "torchvision drew more uniforms than the planner"
            return torch.full((n,), 0.5, dtype=torch.float64)
        kind, v = queue.pop(0)
        assert kind == "rand" and v.size == n, f"torch.rand({n}) where the planner drew {kind} {v}"
        return torch.from_numpy(v.astype(np.float64))

    def randint(low=0, high=None, size=(1,), **_):
        kind, v = queue.pop(0)
        assert kind == "int" and v.size == int(np.prod(size)), f"torch.randint where the " \
                                                               f"planner drew {kind} {v}"
        assert low <= v.min() and v.max() < high
        return torch.from_numpy(v.astype(np.int64))

    monkeypatch.setattr(torch, "rand", rand)
    monkeypatch.setattr(torch, "randint", randint)
    return queue


def _boxes(rng, h, w, n):
    """``n`` annotation-like boxes (xyxy, inside the image, most at least a pixel)."""
    x = np.sort(rng.uniform(0, w, (n, 2)), axis=1)
    y = np.sort(rng.uniform(0, h, (n, 2)), axis=1)
    b = np.float32(np.stack([x[:, 0], y[:, 0], x[:, 1], y[:, 1]], axis=1))
    return np.round(b, 1) if rng.random() < 0.5 else b


specs = st.fixed_dictionaries({
    "zoom": st.one_of(st.none(), st.builds(
        lambda lo, span, p: det.RandomZoomOut(fill=0, side_range=(lo, lo + span), p=p),
        st.sampled_from([1.0, 1.5]), st.sampled_from([0.0, 0.5, 3.0]),
        st.sampled_from([0.5, 1.0, 0.0]))),
    "iou": st.one_of(st.none(), st.builds(
        lambda scales, aspects, options, trials: det.RandomIoUCrop(
            *scales, *aspects, sampler_options=options, trials=trials),
        st.sampled_from([(0.3, 1.0), (0.5, 0.9), (0.1, 1.0)]),
        st.sampled_from([(0.5, 2.0), (0.8, 1.25)]),
        st.sampled_from([(0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0), (0.5, 1.0), (0.0, 0.9, 1.0)]),
        st.sampled_from([40, 3]))),
    "flip": st.sampled_from([0.0, 0.5, 1.0]),
    "size": st.sampled_from([(300, 300), (64, 96), (17, 9)]),
})


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(spec=specs, seed=st.integers(0, 2**63 - 1))
def test_replayed_draws_give_torchvisions_boxes(monkeypatch, spec, seed):
    """Fed the planner's own uniform draws, torchvision's SSD chain picks the same canvas,
    crop and flip, and its boxes and kept set are map_boxes' and sanitize's."""
    crop = det.BoxCrop(size=spec["size"], zoom_out=spec["zoom"], iou_crop=spec["iou"],
                       flip_p=spec["flip"])
    steps = ([v2.RandomZoomOut(fill=0, side_range=spec["zoom"].side_range, p=spec["zoom"].p)]
             if spec["zoom"] else [])
    if spec["iou"]:
        s = spec["iou"]
        steps.append(v2.RandomIoUCrop(s.min_scale, s.max_scale, s.min_aspect_ratio,
                                      s.max_aspect_ratio, list(s.sampler_options), s.trials))
    steps += [v2.RandomHorizontalFlip(spec["flip"]), v2.Resize(list(spec["size"])),
              v2.SanitizeBoundingBoxes()]
    chain = v2.Compose(steps)
    rng = np.random.default_rng(seed)
    for k in range(10):
        # Sides of at least 10 px: torchvision's RandomIoUCrop divides by a crop height
        # of int(h * scale), which must not be 0.
        h, w = (int(v) for v in rng.integers(10, 80, 2))
        boxes = _boxes(rng, h, w, int(rng.integers(1, 7)))
        key = (seed, k, int(rng.integers(0, 2**31)), int(rng.integers(0, 4)))
        _Recorder.log = []
        with monkeypatch.context() as m:
            m.setattr(np.random, "Generator", _Recorder)
            window, flip, dropped = crop.draw(key, (h, w), boxes)
        log = _Recorder.log
        ours = map_boxes(boxes[None], np.array([window]), np.array([flip]), spec["size"],
                         dropped[None])
        keep = sanitize(ours, np.ones((1, len(boxes)), bool), spec["size"])[0]
        with monkeypatch.context() as m:
            queue = _replaying(m, log, spec["flip"])
            out = chain({"image": tv_tensors.Image(torch.zeros(1, h, w, dtype=torch.uint8)),
                         "boxes": tv_tensors.BoundingBoxes(torch.from_numpy(boxes), format="XYXY",
                                                           canvas_size=(h, w)),
                         "labels": torch.arange(len(boxes))})
            assert not queue, f"torchvision left the planner's draws {queue} unused"
        assert tuple(out["image"].shape[-2:]) == tuple(spec["size"])
        kept = out["labels"].numpy()
        # A zoom-out pads by at most 3 sides (side_range up to 4): the rounding bound.
        pad = (3 * max(h, w),) * 4 if spec["zoom"] else (0, 0, 0, 0)
        tol = tolerance(boxes, pad, window[2:], spec["size"])
        # torchvision's set; beyond it only boxes that reach the canvas's right or bottom
        # edge, which its float32 resize put past it (map_boxes clamps them).
        ours_kept = np.flatnonzero(keep).tolist()
        assert set(kept.tolist()) <= set(ours_kept), (key, (h, w), boxes, window)
        out_h, out_w = spec["size"]
        for j in sorted(set(ours_kept) - set(kept.tolist())):
            assert ours[0, j, 2] >= out_w - tol or ours[0, j, 3] >= out_h - tol, \
                (key, (h, w), boxes, window, j, ours[0, j])
        ref = out["boxes"].as_subclass(torch.Tensor).numpy()
        err = np.abs(ours[0, kept] - ref).max(initial=0.0)
        assert err <= tol, (key, (h, w), boxes, window, ours[0, kept], ref)


# -- invariants of the planner's own draws -------------------------------------------


def _iou(boxes, crop):
    """IoU in float64 of each xyxy box with the crop (left, top, right, bottom)."""
    b = boxes.astype(np.float64)
    iw = np.clip(np.minimum(b[:, 2], crop[2]) - np.maximum(b[:, 0], crop[0]), 0, None)
    ih = np.clip(np.minimum(b[:, 3], crop[3]) - np.maximum(b[:, 1], crop[1]), 0, None)
    inter = iw * ih
    union = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1]) + (crop[2] - crop[0]) * (
        crop[3] - crop[1]) - inter
    return inter / union


@pytest.mark.parametrize("min_iou", [0.0, 0.5, 0.9])
def test_iou_crop_invariants(min_iou):
    """Every IoU crop lies in the image, within the scale and aspect ranges, holds a box
    centre strictly inside with the drawn minimum IoU, and drops exactly the boxes whose
    centre is outside; the image is left whole only for the "leave" option or where no
    crop could qualify."""
    # Options (min_iou, leave): every crop made must meet min_iou.
    spec = det.RandomIoUCrop(min_scale=0.3, max_scale=0.9, min_aspect_ratio=0.5,
                             max_aspect_ratio=2.0, sampler_options=(min_iou, 1.0), trials=40)
    crop = det.BoxCrop(size=(32, 32), iou_crop=spec)
    rng = np.random.default_rng(7)
    cropped, n = 0, 1500
    for k in range(n):
        # Near-square images: a crop within the aspect range always exists.
        h = int(rng.integers(20, 400))
        w = int(h * rng.uniform(0.75, 1.33))
        boxes = _boxes(rng, h, w, int(rng.integers(1, 8)))
        if rng.random() < 0.5:  # a large box, so that high minimum IoUs can be met
            t, l_ = rng.uniform(0, 0.2, 2)
            boxes = np.concatenate([boxes, np.float32([[l_ * w, t * h, (l_ + 0.7) * w,
                                                        (t + 0.7) * h]])])
        (top, left, ch, cw), flip, dropped = crop.draw((3, 0, k, 0), (h, w), boxes)
        assert not flip
        if (top, left, ch, cw) == (0, 0, h, w):
            assert not dropped.any()
            continue
        cropped += 1
        assert 0 <= top and 0 <= left and top + ch <= h and left + cw <= w
        assert int(w * 0.3) <= cw <= int(w * 0.9) and int(h * 0.3) <= ch <= int(h * 0.9)
        assert 0.5 <= cw / ch <= 2.0
        cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
        inside = (left < cx) & (cx < left + cw) & (top < cy) & (cy < top + ch)
        assert np.array_equal(~dropped, inside)
        ious = _iou(boxes[inside], (left, top, left + cw, top + ch))
        assert ious.max() >= min_iou - 1e-6
    # A crop is made whenever the first option drawn is min_iou and a crop qualifies:
    # at IoU 0 that is every time the leave option is not drawn first (p = 1/2).
    if min_iou == 0.0:
        assert stats.binomtest(cropped, n, 0.5).pvalue > 1e-6
    assert cropped >= 20  # (24 at IoU 0.9, with these seeds)


def test_zoom_out_canvas_invariants():
    """A zoom-out's canvas is r times the image for one r in side_range on both sides,
    holds the whole image, and is drawn with probability p."""
    zoom = det.RandomZoomOut(side_range=(1.2, 3.5), p=0.6)
    crop = det.BoxCrop(size=(32, 32), zoom_out=zoom)
    rng = np.random.default_rng(8)
    zoomed, n = 0, 3000
    for k in range(n):
        h, w = (int(v) for v in rng.integers(10, 700, 2))
        (top, left, ch, cw), _, dropped = crop.draw((4, 1, k, 2), (h, w), np.zeros((0, 4)))
        assert dropped.shape == (0,)
        if (top, left, ch, cw) == (0, 0, h, w):
            continue
        zoomed += 1
        assert top <= 0 and left <= 0 and -top + h <= ch and -left + w <= cw
        # int(h * r) and int(w * r) for one r in [1.2, 3.5]
        r_lo = max(ch / h, cw / w)
        r_hi = min((ch + 1) / h, (cw + 1) / w)
        assert r_lo < r_hi and r_lo <= 3.5 and r_hi > 1.2
    assert stats.binomtest(zoomed, n, 0.6).pvalue > 1e-6


# -- distributions against torchvision's own random draws ----------------------------

_H, _W = 240, 320
# One box large enough to meet every minimum IoU now and then, three smaller ones.
_BOXES = np.float32([[20, 30, 120, 150], [150, 40, 300, 200], [60, 160, 110, 230],
                     [200, 10, 230, 60], [30, 20, 260, 200]])
N = 3000


def _same(a, b, what):
    p = stats.ks_2samp(a, b).pvalue
    assert p > 1e-6, f"{what}: ours and torchvision's differ (KS p = {p:.2g})"


def test_iou_crop_distribution_matches_torchvision():
    """Over 3,000 draws each, our IoU crops' widths, heights and offsets are distributed
    as torchvision's RandomIoUCrop draws them, and leave the image whole as often."""
    crop = det.BoxCrop(size=(32, 32), iou_crop=det.RandomIoUCrop())
    ours = np.array([crop.draw((11, 0, k, 0), (_H, _W), _BOXES)[0] for k in range(N)], float)
    torch.manual_seed(0)
    t = v2.RandomIoUCrop()
    inputs = [tv_tensors.Image(torch.zeros(1, _H, _W, dtype=torch.uint8)),
              tv_tensors.BoundingBoxes(torch.from_numpy(_BOXES), format="XYXY",
                                       canvas_size=(_H, _W))]
    theirs = []
    for _ in range(N):
        p = t.make_params(inputs)
        theirs.append([p["top"], p["left"], p["height"], p["width"]] if p else
                      [0, 0, _H, _W])
    theirs = np.array(theirs, float)
    whole_o = (ours == [0, 0, _H, _W]).all(axis=1)
    whole_t = (theirs == [0, 0, _H, _W]).all(axis=1)
    # Left whole: the leave option drawn before a round finds a crop (rounds at a high
    # minimum IoU may fail, so at least its 1 in 7).
    table = [[whole_o.sum(), N - whole_o.sum()], [whole_t.sum(), N - whole_t.sum()]]
    p = stats.fisher_exact(table).pvalue
    assert p > 1e-6, f"left whole {table[0][0]} times in {N}, torchvision {table[1][0]}: p {p:.2g}"
    o, t_ = ours[~whole_o], theirs[~whole_t]
    for j, what in enumerate(["top", "left", "height", "width"]):
        _same(o[:, j], t_[:, j], f"IoU crop {what}")
    _same(o[:, 3] / o[:, 2], t_[:, 3] / t_[:, 2], "IoU crop aspect")


def test_zoom_out_distribution_matches_torchvision():
    """Over 3,000 draws each, our zoom-out canvases' sizes and the image's offset in
    them are distributed as torchvision's RandomZoomOut draws them, at the same rate."""
    crop = det.BoxCrop(size=(32, 32), zoom_out=det.RandomZoomOut(side_range=(1.0, 4.0), p=0.5))
    ours = np.array([crop.draw((12, 0, k, 0), (_H, _W), _BOXES)[0] for k in range(N)], float)
    torch.manual_seed(1)
    t = v2.RandomZoomOut(side_range=(1.0, 4.0), p=0.5)
    # Boxes alone (padding an image 3,000 times costs seconds): the output's canvas is
    # the zoom-out's, and a unit box at the origin lands at the image's offset in it.
    unit = tv_tensors.BoundingBoxes(torch.tensor([[0.0, 0.0, 1.0, 1.0]]), format="XYXY",
                                    canvas_size=(_H, _W))
    theirs = []
    for _ in range(N):
        out = t(unit)
        left, top = (int(v) for v in out[0, :2])
        theirs.append([-top, -left, *out.canvas_size])
    theirs = np.array(theirs, float)
    applied_t = ~(theirs == [0, 0, _H, _W]).all(axis=1)
    applied_o = ~(ours == [0, 0, _H, _W]).all(axis=1)
    for applied in (applied_o, applied_t):
        assert stats.binomtest(int(applied.sum()), N, 0.5).pvalue > 1e-6
    o, t_ = ours[applied_o], theirs[applied_t]
    _same(o[:, 2] / _H, t_[:, 2] / _H, "zoom-out canvas height")
    _same(o[:, 3] / _W, t_[:, 3] / _W, "zoom-out canvas width")
    _same(-o[:, 0] / np.maximum(o[:, 2] - _H, 1), -t_[:, 0] / np.maximum(t_[:, 2] - _H, 1),
          "zoom-out top offset")
    _same(-o[:, 1] / np.maximum(o[:, 3] - _W, 1), -t_[:, 1] / np.maximum(t_[:, 3] - _W, 1),
          "zoom-out left offset")

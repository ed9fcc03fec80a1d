"""Keypoint arithmetic against torchvision v2 itself: ``map_keypoints`` must give the
points ``transforms.v2.functional`` gives ``tv_tensors.KeyPoints`` for the same geometry.

The reference chain per case, as a detection pipeline runs it: ``F.pad`` (a zoom-out's
canvas) -> ``F.crop`` -> ``F.horizontal_flip`` with the points' mirror indices swapped
(the detection reference's keypoint flip) -> ``F.resize``; a point outside
``ClampKeyPoints``'s canvas ``[0, W - 1] x [0, H - 1]``, or unlabelled, is then
``(0, 0, 0)``.  Tolerance as for the boxes (``tv_reference.tolerance``): bit for bit
without a zoom-out, one float32 rounding of the padded canvas's coordinates after one.
"""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tv_reference import F, tolerance, torch, tv_tensors

from echo_native.keypoints import map_keypoints

FLIP = np.array([0, 2, 1, 4, 3])


@st.composite
def case(draw):
    h, w = draw(st.integers(2, 600)), draw(st.integers(2, 600))
    pad = (0, 0, 0, 0)
    if draw(st.booleans()):  # a zoom-out's canvas, then a crop of it
        pad = tuple(draw(st.integers(0, 2 * s)) for s in (w, h, w, h))
    ch, cw = h + pad[1] + pad[3], w + pad[0] + pad[2]
    top, left = draw(st.integers(0, ch - 1)), draw(st.integers(0, cw - 1))
    wh, ww = draw(st.integers(1, ch - top)), draw(st.integers(1, cw - left))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    pts = np.zeros((3, len(FLIP), 3), np.float32)
    pts[..., 0] = rng.uniform(-0.2 * w, 1.2 * w, pts.shape[:2])
    pts[..., 1] = rng.uniform(-0.2 * h, 1.2 * h, pts.shape[:2])
    pts[..., :2] = np.where(rng.random(pts.shape[:2] + (1,)) < 0.3,
                            np.round(pts[..., :2]), pts[..., :2])
    pts[..., 2] = rng.integers(0, 3, pts.shape[:2])
    pts[pts[..., 2] == 0] = 0
    return pts, (h, w), pad, (top, left, wh, ww), draw(st.booleans())


def _reference(pts, hw, pad, window, flip, size):
    top, left, wh, ww = window
    xy = tv_tensors.KeyPoints(torch.from_numpy(pts[..., :2].copy()), canvas_size=hw)
    if any(pad):
        xy = F.pad(xy, list(pad))
    xy = F.crop(xy, top, left, wh, ww)
    vis = torch.from_numpy(pts[..., 2].copy())
    if flip:
        flipped = F.horizontal_flip(xy)
        xy = tv_tensors.wrap(flipped.as_subclass(torch.Tensor)[:, FLIP], like=flipped)
        vis = vis[:, FLIP]
    xy = F.resize(xy, list(size))
    raw = torch.cat([xy.as_subclass(torch.Tensor), vis[..., None]], dim=-1).numpy()
    out = raw.copy()
    x, y = out[..., 0], out[..., 1]
    keep = (out[..., 2] > 0) & (x >= 0) & (x <= size[1] - 1) & (y >= 0) & (y <= size[0] - 1)
    out[~keep] = 0
    return out, raw


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case(), st.sampled_from([(300, 300), (224, 224), (96, 160)]))
def test_keypoints_follow_torchvision_through_pad_crop_flip_resize(c, size):
    pts, hw, pad, window, flip = c
    top, left, wh, ww = window
    # The same window in the source's coordinates (the zoom-out's padding before it).
    ours = map_keypoints(pts[None], np.float64([[top - pad[1], left - pad[0], wh, ww]]),
                         [flip], size, flip=FLIP)[0]
    want, raw = _reference(pts, hw, pad, window, flip, size)
    tol = tolerance(pts[..., :2], pad, (wh, ww), size)
    # A labelled point within the tolerance of the canvas's edge (torchvision's own
    # coordinates) may be kept by one and not the other; every other point must agree.
    x, y = raw[..., 0], raw[..., 1]
    edge = (raw[..., 2] > 0) & (
        (np.minimum(np.abs(x), np.abs(x - (size[1] - 1))) <= tol) |
        (np.minimum(np.abs(y), np.abs(y - (size[0] - 1))) <= tol))
    assert (~edge).sum() >= 10
    np.testing.assert_allclose(ours[~edge], want[~edge], rtol=0, atol=float(tol))

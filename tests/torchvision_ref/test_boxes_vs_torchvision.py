"""Box arithmetic against torchvision v2 itself: ``echo_native.boxes`` must give the boxes
``transforms.v2.functional`` gives ``tv_tensors.BoundingBoxes`` for the same geometry.

The reference chain per case, as torchvision's SSD transforms run it: ``F.pad`` (a
zoom-out's canvas) -> ``F.crop`` -> the IoU crop's dropped boxes set to zero, as
``RandomIoUCrop.transform`` does -> ``F.horizontal_flip`` -> ``F.resize``, then
``SanitizeBoundingBoxes`` for the kept set.  Each hypothesis example is a batch of 41-48
cases sharing one output size (as a batch does): a few drawn by hypothesis, the rest by
NumPy from a drawn seed; over 4,000 cases in all.

Tolerance: bit for bit without a zoom-out; after one, 1e-4 px plus one float32 rounding
of the padded canvas's coordinates, scaled by the resize (``tv_reference.tolerance``).
Against torchvision's boxes clamped to the output canvas: ``map_boxes`` clamps after
the resize, where torchvision's float32 ratio can put a box that ends on the window's
edge past the canvas and ``SanitizeBoundingBoxes`` then drops it (a deliberate
difference, docs/detection-semantics.md); ``sanitize`` keeps those boxes too, and
otherwise exactly torchvision's set.
These tests need a torch whose torchvision ops load: ``.ci/run``'s step "torchvision:
reference tests" runs them in a venv of its own; elsewhere they skip.
"""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tv_reference import F, tolerance, torch, tv_tensors, v2

from echo_native.boxes import map_boxes, sanitize

SETTINGS = settings(max_examples=100, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _coord(draw, extent, edges):
    """One coordinate: an edge exactly (image, canvas or window side), an integer or any
    float32 around the image."""
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return float(draw(st.sampled_from(edges)))
    if kind == 1:
        return float(draw(st.integers(-extent // 2, extent + extent // 2)))
    return draw(st.floats(-0.5 * extent, 1.5 * extent, width=32, allow_nan=False))


@st.composite
def case(draw):
    """One image, its boxes (xyxy, some degenerate, on edges, outside), a window as
    torchvision would reach it (``mode``), a flip and the IoU crop's dropped marks."""
    h, w = draw(st.integers(1, 800)), draw(st.integers(1, 800))
    mode = draw(st.sampled_from(["inside", "zoom", "outside"]))
    pad = (0, 0, 0, 0)  # left, top, right, bottom
    if mode == "zoom":  # RandomZoomOut's canvas (up to 4x each side), then a crop of it
        pad = tuple(draw(st.integers(0, 3 * s)) for s in (w, h, w, h))
    ch, cw = h + pad[1] + pad[3], w + pad[0] + pad[2]
    if mode == "outside":  # a plain F.crop reaching outside the image
        top, left = draw(st.integers(-h, h)), draw(st.integers(-w, w))
        wh, ww = draw(st.integers(1, 2 * h)), draw(st.integers(1, 2 * w))
    else:
        top, left = draw(st.integers(0, ch - 1)), draw(st.integers(0, cw - 1))
        wh, ww = draw(st.integers(1, ch - top)), draw(st.integers(1, cw - left))
    m = draw(st.integers(1, 6))
    xs = [0, w, left - pad[0], left - pad[0] + ww]
    ys = [0, h, top - pad[1], top - pad[1] + wh]
    boxes = []
    for _ in range(m):
        x1, x2 = sorted((_coord(draw, w, xs), _coord(draw, w, xs)))
        y1, y2 = sorted((_coord(draw, h, ys), _coord(draw, h, ys)))
        if draw(st.integers(0, 7)) == 0:  # degenerate: a line or a point
            x2 = x1
        boxes.append((x1, y1, x2, y2))
    return {"hw": (h, w), "pad": pad, "crop": (top, left, wh, ww), "boxes": np.float32(boxes),
            "flip": draw(st.booleans()),
            "dropped": np.array([draw(st.integers(0, 3)) == 0 for _ in range(m)])}


def random_case(rng):
    """One case as :func:`case` draws it, from a NumPy generator: the bulk of each batch
    (hypothesis draws a few cases per example and searches; these add volume cheaply)."""
    h, w = (int(v) for v in rng.integers(1, 801, 2))
    mode = rng.choice(["inside", "zoom", "outside"])
    pad = tuple(int(rng.integers(0, 3 * s + 1)) for s in (w, h, w, h)) \
        if mode == "zoom" else (0, 0, 0, 0)
    ch, cw = h + pad[1] + pad[3], w + pad[0] + pad[2]
    if mode == "outside":
        top, left = int(rng.integers(-h, h + 1)), int(rng.integers(-w, w + 1))
        wh, ww = int(rng.integers(1, 2 * h + 1)), int(rng.integers(1, 2 * w + 1))
    else:
        top, left = int(rng.integers(0, ch)), int(rng.integers(0, cw))
        wh, ww = int(rng.integers(1, ch - top + 1)), int(rng.integers(1, cw - left + 1))
    m = int(rng.integers(1, 9))
    edges = {0: [0, w, left - pad[0], left - pad[0] + ww],
             1: [0, h, top - pad[1], top - pad[1] + wh]}
    b = np.empty((m, 4), np.float32)
    for k in range(4):
        extent = (w, h)[k % 2]
        kind = rng.integers(0, 4, m)
        whole = rng.integers(-extent // 2, extent + extent // 2 + 1, m)
        b[:, k] = np.where(kind == 0, rng.choice(edges[k % 2], m),
                           np.where(kind == 1, whole, rng.uniform(-0.5 * extent, 1.5 * extent, m)))
    b = np.concatenate([np.minimum(b[:, :2], b[:, 2:]), np.maximum(b[:, :2], b[:, 2:])], axis=1)
    line = rng.random(m) < 0.125
    b[line, 2] = b[line, 0]
    return {"hw": (h, w), "pad": pad, "crop": (top, left, wh, ww), "boxes": b,
            "flip": bool(rng.random() < 0.5), "dropped": rng.random(m) < 0.25}


def _torchvision(c, size, min_size, min_area):
    """torchvision v2's boxes for one case, and the indices SanitizeBoundingBoxes keeps."""
    b = tv_tensors.BoundingBoxes(torch.from_numpy(c["boxes"]), format="XYXY",
                                 canvas_size=c["hw"])
    if any(c["pad"]):
        b = F.pad(b, padding=list(c["pad"]))
    b = F.crop(b, *c["crop"])
    b[torch.from_numpy(c["dropped"])] = 0  # RandomIoUCrop's mark for Sanitize
    if c["flip"]:
        b = F.horizontal_flip(b)
    b = F.resize(b, list(size))
    assert tuple(b.canvas_size) == tuple(size)
    labels = torch.arange(len(b))
    out = v2.SanitizeBoundingBoxes(min_size=min_size, min_area=min_area)(
        {"boxes": b, "labels": labels})
    return b.as_subclass(torch.Tensor).numpy(), out["labels"].numpy()


def _on_canvas(boxes, size):
    """torchvision's boxes clamped to the output canvas, as ``map_boxes`` leaves them."""
    h, w = size
    out = boxes.copy()
    np.clip(out[..., 0::2], 0, np.float32(w), out=out[..., 0::2])
    np.clip(out[..., 1::2], 0, np.float32(h), out=out[..., 1::2])
    return out


def _window(c):
    """The case's crop as a window of the source image (a zoom-out's reaches outside)."""
    top, left, wh, ww = c["crop"]
    return (top - c["pad"][1], left - c["pad"][0], wh, ww)


def _padded(cases):
    """The batch's boxes, dropped marks and validity as padded (B, M) arrays."""
    m = max(len(c["boxes"]) for c in cases)
    boxes = np.zeros((len(cases), m, 4), np.float32)
    dropped = np.zeros((len(cases), m), bool)
    valid = np.zeros((len(cases), m), bool)
    for i, c in enumerate(cases):
        n = len(c["boxes"])
        boxes[i, :n], dropped[i, :n], valid[i, :n] = c["boxes"], c["dropped"], True
    return boxes, dropped, valid


@SETTINGS
@given(cases=st.lists(case(), min_size=1, max_size=8), seed=st.integers(0, 2**32 - 1),
       size=st.tuples(st.integers(1, 1024), st.integers(1, 1024)),
       min_size=st.sampled_from([1.0, 1.5, 4.0]), min_area=st.sampled_from([1.0, 2.5, 30.0]))
def test_map_boxes_and_sanitize_match_torchvision(cases, seed, size, min_size, min_area):
    """map_boxes gives torchvision v2's pad/crop/drop/flip/resize boxes, clamped to the
    canvas, within 1e-4 px (bit for bit without a zoom-out), and sanitize keeps
    SanitizeBoundingBoxes' set plus the boxes torchvision's rounding put past the canvas."""
    rng = np.random.default_rng(seed)
    cases = cases + [random_case(rng) for _ in range(40)]
    boxes, dropped, valid = _padded(cases)
    ours = map_boxes(boxes, np.array([_window(c) for c in cases]),
                     np.array([c["flip"] for c in cases]), size, dropped)
    assert ours.dtype == np.float32 and ours.shape == boxes.shape
    keep = sanitize(ours, valid, size, min_size=min_size, min_area=min_area)
    assert not keep[~valid].any()
    for i, c in enumerate(cases):
        n = len(c["boxes"])
        ref, kept = _torchvision(c, size, min_size, min_area)
        clamped = _on_canvas(ref, size)
        err = np.abs(ours[i, :n] - clamped).max()
        tol = tolerance(c["boxes"], c["pad"], c["crop"][2:], size)
        assert err <= tol, (f"case {i} ({c}), output {size}: ours {ours[i, :n].tolist()} vs "
                            f"torchvision {ref.tolist()} clamped, off by {err} > {tol}")
        if not any(c["pad"]):
            assert np.array_equal(ours[i, :n], clamped), f"case {i}: not bit for bit"
        # The rule on torchvision's own boxes; on ours too wherever they agree bit for bit.
        assert np.flatnonzero(sanitize(ref, np.ones(n, bool), size, min_size,
                                       min_area)).tolist() == kept.tolist(), f"case {i}"
        if np.array_equal(ours[i, :n], clamped):
            ours_kept = np.flatnonzero(keep[i, :n])
            assert ours_kept.tolist() == np.flatnonzero(sanitize(
                clamped, np.ones(n, bool), size, min_size, min_area)).tolist(), f"case {i}"
            # torchvision's set, and beyond it only boxes its rounding put past the canvas.
            extra = sorted(set(ours_kept.tolist()) - set(kept.tolist()))
            assert set(kept.tolist()) <= set(ours_kept.tolist()), f"case {i}"
            assert all((ref[j] != clamped[j]).any() for j in extra), f"case {i}: {extra}"


edge = st.sampled_from([0.0, 1.0, -0.0, -1e-3, 0.5, 1.5, 4.0, 30.0, 99.0, 100.0, 100.001, 64.0,
                        -1.0, 2.0])
coordinate = st.one_of(edge, st.floats(-20, 130, width=32, allow_nan=False))


@SETTINGS
@given(boxes=st.lists(st.tuples(coordinate, coordinate, coordinate, coordinate),
                      min_size=1, max_size=200),
       size=st.sampled_from([(100, 64), (64, 100), (1, 1), (100, 100)]),
       min_size=st.sampled_from([1.0, 1.5, 4.0]), min_area=st.sampled_from([1.0, 2.5, 30.0]))
def test_sanitize_keeps_what_torchvision_keeps(boxes, size, min_size, min_area):
    """sanitize keeps exactly SanitizeBoundingBoxes' set for boxes on every threshold and
    image edge, inverted and outside ones included, and never a padding entry."""
    b = np.float32(boxes)
    bb = tv_tensors.BoundingBoxes(torch.from_numpy(b), format="XYXY", canvas_size=size)
    out = v2.SanitizeBoundingBoxes(min_size=min_size, min_area=min_area)(
        {"boxes": bb, "labels": torch.arange(len(b))})
    valid = np.arange(len(b)) % 5 != 4  # every fifth a padding entry
    keep = sanitize(b[None], valid[None], size, min_size=min_size, min_area=min_area)[0]
    expected = [i for i in out["labels"].tolist() if valid[i]]
    assert np.flatnonzero(keep).tolist() == expected

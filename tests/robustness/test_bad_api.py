"""Bad API input across the public surface: a clear ValueError/TypeError naming the
offending argument, never a crash, a leaked segment or a write into a refused buffer.

Only what ``test_hostile.py`` (data types of decode/decode_crop, boxes outside
the image, box/size types of decode_crop, bad ``out`` for decode_crop /
resize_crop, canvas buffers, resize_crop images, augmentation parameters) and
``tests/test_pipeline.py`` (EchoRing: echo, placement, batch_size > samples,
image_size, shuffle_buffer 15, normalize, layout, max_echo) already cover is left out.
"""
from __future__ import annotations

import os
import re

import numpy as np
import pytest

import echo_native as en
import ring_helpers as rh  # noqa: E402

SIZE = (16, 24)


@pytest.fixture(scope="module")
def jpeg(images):
    """A baseline 4:2:0 JPEG of a photograph (300 x 451)."""
    return images.sample("baseline-4:2:0").data


@pytest.fixture(scope="module")
def png(images):
    """A PNG (the Pillow path of every decode function)."""
    return images.other("png-rgb")


def _own_segments():
    """Rings of this process that still exist: named segments and memfds still held."""
    return set(rh.segments(os.getpid())) | set(rh.ring_memory(os.getpid()))


# ---- data --------------------------------------------------------------------------------
DATA_CALLS = {
    "decode_random_crop": lambda d: en.decode_random_crop(d, (8, 8), 0, 0, 0),
    "decode_center_crop": lambda d: en.decode_center_crop(d, 8),
    "decode_canvas": lambda d: en.decode_canvas(d, 8),
    "image_size": lambda d: en.image_size(d),
    "decode": lambda d: en.decode(d),
}


@pytest.mark.parametrize("call", sorted(DATA_CALLS))
@pytest.mark.parametrize("bad", [None, "x.jpg", 5, 1.5, [0xFF, 0xD8], np.zeros((4, 4), np.uint8),
                                 np.zeros(8, np.float32)],
                         ids=["None", "str", "int", "float", "list", "2d-uint8", "float32"])
def test_wrong_data_type_is_type_error_naming_data(call, bad):
    """Non-bytes `data` is a TypeError naming `data` in every decode entry point."""
    with pytest.raises(TypeError, match="data must be a bytes-like"):
        DATA_CALLS[call](bad)


@pytest.mark.parametrize("call", sorted(DATA_CALLS))
def test_strided_uint8_data_is_value_error_not_decode_error(jpeg, call):
    """A non-contiguous uint8 array as `data` is a ValueError naming `data`, not a bad file."""
    buf = np.zeros(2 * len(jpeg), np.uint8)
    buf[::2] = np.frombuffer(jpeg, np.uint8)     # starts with FF D8: takes the JPEG path
    with pytest.raises(ValueError, match="data must be a contiguous") as info:
        DATA_CALLS[call](buf[::2])
    assert not isinstance(info.value, en.DecodeError)


# ---- sizes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [(8,), 8, None, "ab", (8, "x")])
def test_size_wrong_type_random_crop_and_resize_crop(jpeg, size):
    """A `size` that is not two integers is a TypeError naming `size` (random crop, resize_crop)."""
    with pytest.raises(TypeError, match="size"):
        en.decode_random_crop(jpeg, size, 0, 0, 0)
    with pytest.raises(TypeError, match="size"):
        en.resize_crop(np.zeros((50, 50, 3), np.uint8), (0, 0, 50, 50), size)


@pytest.mark.parametrize("size", [(0, 8), (8, -1), (-5, -5), (70000, 8)])
def test_size_out_of_range_resize_crop(size):
    """Zero, negative or oversized `size` for resize_crop is a ValueError naming `size`."""
    with pytest.raises(ValueError, match="size must be positive"):
        en.resize_crop(np.zeros((50, 50, 3), np.uint8), (0, 0, 50, 50), size)


@pytest.mark.parametrize("bad,exc", [((8, 8, 8), TypeError), (None, TypeError), ("ab", TypeError),
                                     (0, ValueError), (-1, ValueError), (70000, ValueError),
                                     (10**12, ValueError)])
def test_center_crop_size_and_canvas_min_side_named(jpeg, png, bad, exc):
    """decode_center_crop `size`/`resize` and decode_canvas `min_side` errors name them."""
    for data in (jpeg, png):
        with pytest.raises(exc, match=r"^size must"):
            en.decode_center_crop(data, bad)
        if bad is not None:             # resize=None is the default
            with pytest.raises(exc, match=r"^resize must"):
                en.decode_center_crop(data, 8, resize=bad)
        with pytest.raises(exc, match=r"^min_side must"):
            en.decode_canvas(data, bad)


# ---- boxes ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("box", [(0, 0, 10), (0, 0, 10, 10, 1), "abcd", None, 5, (0, 0, "a", 4),
                                 [[0, 0], [10, 10]]])
def test_box_wrong_type_names_box(jpeg, png, box):
    """A `box` that is not four numbers is a TypeError naming `box` (decode_crop both paths,
    resize_crop)."""
    for data in (jpeg, png):
        with pytest.raises(TypeError, match="box must be"):
            en.decode_crop(data, box, SIZE)
    with pytest.raises(TypeError, match="box must be"):
        en.resize_crop(np.zeros((50, 50, 3), np.uint8), box, SIZE)


@pytest.mark.parametrize("box", [(-1, 0, 10, 10), (0, 0, 301, 10), (0, 0, 0, 10)])
def test_box_as_numpy_array_checked_like_a_tuple(jpeg, box):
    """A numpy `box` is range-checked like a tuple (outside the image: ValueError, not a crash)."""
    with pytest.raises(ValueError, match="not inside"):
        en.decode_crop(jpeg, np.array(box, np.float64), SIZE)
    out = en.decode_crop(jpeg, np.array([10.5, 20.25, 100, 120]), SIZE)
    np.testing.assert_array_equal(out, en.decode_crop(jpeg, (10.5, 20.25, 100, 120), SIZE))


# ---- out buffers ------------------------------------------------------------------------------
def _bad_outs(shape):
    h, w = shape
    ro = np.zeros((h, w, 3), np.uint8)
    ro.setflags(write=False)
    return [
        (np.zeros((h, w + 1, 3), np.uint8), ValueError,
         r"out must be a \(%d, %d, 3\) uint8" % shape),
        (np.zeros((h, w), np.uint8), ValueError, "out must be a"),
        (np.zeros((h, w, 3), np.float32), ValueError, "uint8"),
        (np.zeros((h, w, 3), np.int8), ValueError, "uint8"),
        (ro, ValueError, "out is read-only"),
        (np.zeros((h, 2 * w, 3), np.uint8)[:, ::2], ValueError, "contiguous"),
        (np.zeros((h, w, 3), np.uint8, order="F"), ValueError, "contiguous"),
        (bytearray(h * w * 3), TypeError, "out must be a numpy.ndarray"),
        ([[0] * w] * h, TypeError, "out must be a numpy.ndarray"),
    ]


def test_bad_out_for_random_and_center_crop(jpeg, png):
    """decode_random_crop / decode_center_crop refuse bad `out` (both paths), untouched."""
    calls = {
        "decode_random_crop": lambda d, out: en.decode_random_crop(d, SIZE, 0, 0, 0, out=out),
        "decode_center_crop": lambda d, out: en.decode_center_crop(d, 16, out=out),
    }
    for name, call in calls.items():
        shape = SIZE if name == "decode_random_crop" else (16, 16)
        for out, exc, pattern in _bad_outs(shape):
            before = np.array(out, copy=True) if isinstance(out, np.ndarray) else None
            for data in (jpeg, png):
                with pytest.raises(exc, match=pattern):
                    call(data, out)
            if before is not None:
                np.testing.assert_array_equal(out, before)


def test_bad_canvas_out_types(jpeg, png):
    """decode_canvas refuses a list or too-small bytearray `out` naming it; a big 2-D one works."""
    for data in (jpeg, png):
        with pytest.raises(ValueError, match="out must be a writable contiguous uint8"):
            en.decode_canvas(data, 100, out=[0] * 10**6)
        with pytest.raises(ValueError, match="needs"):
            en.decode_canvas(data, 100, out=bytearray(10))
        canvas, _ = en.decode_canvas(data, 100, out=np.zeros((1000, 1000), np.uint8))
        assert canvas.ndim == 3 and min(canvas.shape[:2]) >= 100


def test_resize_crop_image_not_an_array():
    """resize_crop with None / nested lists / 4-D arrays as `image`: a TypeError naming it."""
    for image in (None, [[1, 2]], np.zeros((2, 5, 5, 3), np.uint8)):
        with pytest.raises(TypeError, match="image must be"):
            en.resize_crop(image, (0, 0, 1, 1), SIZE)


def test_refused_calls_leave_decoder_working(jpeg):
    """After every refused argument above, the thread's decoder still gives the same pixels."""
    ref = en.decode_crop(jpeg, (0, 0, 200, 300), SIZE)
    for bad in (lambda: en.decode_crop(jpeg, "abcd", SIZE),
                lambda: en.decode_crop(jpeg, (0, 0, 200, 300), SIZE, out=np.zeros(3, np.uint8)),
                lambda: en.decode_center_crop(jpeg, None),
                lambda: en.decode_canvas(jpeg, 10**12)):
        with pytest.raises((TypeError, ValueError)):
            bad()
        np.testing.assert_array_equal(en.decode_crop(jpeg, (0, 0, 200, 300), SIZE), ref)


# ---- Loader / EchoRing arguments -------------------------------------------------------------
@pytest.fixture(scope="module")
def source(images):
    blobs = [images.sample("baseline-4:2:0").data] * 32
    return en.Samples(blobs, np.arange(32) % 3)


COMMON_BAD = [
    ({"batch_size": 0}, ValueError, "batch_size"),
    ({"batch_size": -2}, ValueError, "batch_size"),
    ({"batch_size": 2.5}, ValueError, "batch_size"),
    ({"batch_size": "8"}, ValueError, "batch_size"),
    ({"batch_size": None}, ValueError, "batch_size"),
    ({"workers": 0}, ValueError, "workers"),
    ({"workers": -1}, ValueError, "workers"),
    ({"workers": 1.5}, ValueError, "workers"),
    ({"workers": "two"}, ValueError, "workers"),
    ({"timeout": 0}, ValueError, "timeout"),
    ({"timeout": -1.0}, ValueError, "timeout"),
    ({"timeout": float("nan")}, ValueError, "timeout"),
    ({"timeout": "60"}, TypeError, "timeout"),
    ({"on_error": "ignore"}, ValueError, "on_error"),
    ({"on_error": None}, ValueError, "on_error"),
    ({"seed": -1}, ValueError, "seed"),
    ({"seed": 2**64}, ValueError, "seed"),
    ({"slots": 1}, ValueError, "slots"),
    ({"slots": "x"}, ValueError, "slots"),
    ({"worker_mode": "fiber"}, ValueError, "worker_mode"),
]

ECHO_BAD = COMMON_BAD + [
    ({"echo": float("inf")}, ValueError, "echo"),
    ({"echo": None}, ValueError, "echo"),
    ({"echo": -1}, ValueError, "echo"),
    ({"placement": None}, ValueError, "placement"),
    ({"layout": "nchw"}, ValueError, "layout"),
    ({"dtype": "int8"}, ValueError, "dtype"),
    ({"dtype": "float64"}, ValueError, "dtype"),
    ({"shuffle_buffer": 0}, ValueError, "shuffle_buffer"),
    ({"shuffle_buffer": -5}, ValueError, "shuffle_buffer"),
    ({"scale": (0.0, 1.0)}, ValueError, "scale"),
    ({"scale": (0.9, 0.5)}, ValueError, "scale"),
    ({"ratio": (0.0, 1.0)}, ValueError, "ratio"),
    ({"flip_p": 2.0}, ValueError, "flip_p"),
    ({"flip_p": -0.5}, ValueError, "flip_p"),
]

LOADER_BAD = COMMON_BAD + [
    ({"image_size": 0}, ValueError, "image_size"),
    ({"image_size": -4}, ValueError, "image_size"),
]


def _ids(cases):
    return [f"{next(iter(kw))}={next(iter(kw.values()))!r}" for kw, _, _ in cases]


@pytest.mark.parametrize("placement", ["before_augment", "after_augment"])
@pytest.mark.parametrize("kwargs,exc,name", ECHO_BAD, ids=_ids(ECHO_BAD))
def test_echo_ring_bad_arguments(source, placement, kwargs, exc, name):
    """EchoRing refuses a bad argument at construction naming it, leaving no segment."""
    before = _own_segments()
    kw = {"batch_size": 8, "image_size": 16, "workers": 1, "placement": placement, **kwargs}
    with pytest.raises(exc, match=re.escape(name)):
        en.EchoRing(source, **kw)
    assert _own_segments() <= before   # nothing new (an earlier test's ring may go meanwhile)


def test_echo_ring_canvas_budget_too_small(source):
    """before_augment: canvas_max_pixels below canvas_side^2 is a ValueError naming both."""
    with pytest.raises(ValueError, match=r"canvas_max_pixels \(10\) .*canvas_side"):
        en.EchoRing(source, batch_size=8, image_size=16, workers=1, canvas_max_pixels=10)


@pytest.mark.parametrize("kwargs,exc,name", LOADER_BAD, ids=_ids(LOADER_BAD))
def test_loader_bad_arguments(source, kwargs, exc, name):
    """Loader refuses a bad argument at construction naming it, leaving no segment."""
    before = _own_segments()
    kw = {"batch_size": 8, "image_size": 16, "workers": 1, **kwargs}
    with pytest.raises(exc, match=re.escape(name)):
        en.Loader(source, **kw)
    assert _own_segments() <= before   # nothing new (an earlier test's ring may go meanwhile)


@pytest.mark.parametrize("kwargs,name", [({"scale": (0.0, 1.0)}, "scale"),
                                         ({"ratio": (2.0, 1.0)}, "ratio"),
                                         ({"flip_p": 1.5}, "flip_p")])
def test_random_resized_crop_transform_checked_at_construction(kwargs, name):
    """A RandomResizedCrop with bad parameters fails when made, not in every worker read."""
    with pytest.raises(ValueError, match=name):
        en.RandomResizedCrop((16, 16), **kwargs)


def test_seek_and_set_epoch_negative(source):
    """Loader.seek / set_epoch with a negative position are ValueErrors naming it."""
    L = en.Loader(source, batch_size=8, image_size=16, workers=1, worker_mode="thread")
    with pytest.raises(ValueError, match="ticket"):
        L.seek(-1)
    with pytest.raises(ValueError, match="epoch"):
        L.set_epoch(-1)
    assert L.ring_name is None      # nothing was started


def test_unstartable_workers_leave_no_segment(source, monkeypatch):
    """If the worker pool cannot be made after the ring is, start() removes the segment."""
    import echo_native.loader as loader_mod

    def broken(*a, **k):
        raise ValueError("worker pool refused (test)")

    L = en.Loader(source, batch_size=8, image_size=16, workers=1)
    before = _own_segments()
    monkeypatch.setattr(loader_mod, "WorkerPool", broken)
    with pytest.raises(ValueError, match="refused"):
        L.start()
    assert _own_segments() <= before   # nothing new (an earlier test's ring may go meanwhile)
    assert L.ring_name is None
    monkeypatch.undo()
    with L:                             # and it can still start for real afterwards
        assert len(L.next_batch()) == 8
    assert _own_segments() <= before   # nothing new (an earlier test's ring may go meanwhile)

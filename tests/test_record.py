"""A sample's record as the consumer holds it: Columns of one Record, and the object
fields that ride in it (keypoints, masks) without the holders naming them."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

import echo_native as en
from echo_native.batch import PER_OBJECT, Batch, Columns
from echo_native.boxes import Objects
from echo_native.ring import COLUMNS, Record
from echo_native.targets import FIELDS, OBJECT_FIELDS


def _filled(record, counts, seed=0):
    """Columns of ``len(counts)`` rows, every array random, ``obj_count`` = counts."""
    rng = np.random.default_rng(seed)
    cols = Columns.allocate(len(counts), record)
    for name, a in cols.arrays.items():
        a[...] = rng.integers(0, 200, a.shape).astype(a.dtype)
    cols.obj_count[:] = counts
    return cols


def _used_equal(a, b, counts):
    """Equal in every per-sample column and in each row's first obj_count object slots."""
    for name in a.arrays:
        x, y = a.arrays[name], b.arrays[name]
        if name not in PER_OBJECT:
            assert np.array_equal(x, y), name
        else:
            for i, n in enumerate(counts):
                assert np.array_equal(x[i, :n], y[i, :n]), (name, i)


def test_per_object_columns_are_those_under_the_object_rows():
    assert PER_OBJECT == {name for name, _, rows, _ in COLUMNS if rows != "sample"}
    assert {"obj_boxes", "obj_keypoints", "obj_masks"} <= PER_OBJECT
    assert "obj_count" not in PER_OBJECT


def test_copies_move_only_the_object_slots_in_use_and_lose_nothing():
    """take, put and copy keep every per-sample value and each row's objects (with their
    keypoints and mask bytes), and carry only as many object slots as a row holds."""
    record = Record(max_objects=16, max_keypoints=3, mask_bytes=40)
    src = _filled(record, [2, 5, 0, 1])
    taken = src.take(np.array([3, 1]))
    assert taken.obj_boxes.shape == (2, 5, 4) and taken.obj_masks.shape == (2, 5, 40)
    assert taken.obj_keypoints.shape == (2, 5, 3, 3)
    _used_equal(taken, Columns({k: v[[3, 1]] for k, v in src.arrays.items()}), [1, 5])
    by_mask = src.take(np.array([True, False, False, True]))
    _used_equal(by_mask, Columns({k: v[[0, 3]] for k, v in src.arrays.items()}), [2, 1])
    # An emission of rows that hold no object keeps one (empty) slot: it has objects.
    assert src.take(np.array([2])).max_objects == 1
    assert Columns.allocate(3, Record()).take(np.arange(2)).max_objects == 0

    buffer = _filled(record, [16] * 6, seed=1)      # stale objects in every entry
    buffer.put(np.array([4, 0, 5, 1]), src)
    _used_equal(Columns({k: v[[4, 0, 5, 1]] for k, v in buffer.arrays.items()}), src,
                [2, 5, 0, 1])
    copied = src.copy()
    assert copied.obj_labels.shape == (4, 5)
    _used_equal(copied, src, [2, 5, 0, 1])
    copied.obj_boxes[1, 0] = -1
    assert src.obj_boxes[1, 0, 0] != -1


def test_a_batch_from_trimmed_columns_equals_one_from_whole_columns():
    """The objects a batch maps from an emission's trimmed rows are those of the whole
    record: the slots past a row's count are never read."""
    record = Record(max_objects=12, max_keypoints=2)
    cols = _filled(record, [3, 0, 2])
    cols.obj_flags[:] = 0
    cols.boxes[:] = (0, 0, 50, 60)
    cols.flip[:] = (0, 1, 1)
    cols.obj_keypoints[..., 2] = 2
    for c in (cols.obj_boxes, cols.obj_keypoints[..., :2]):
        c[...] = np.random.default_rng(2).uniform(0, 40, c.shape)
    cols.obj_boxes[..., 2:] = cols.obj_boxes[..., :2] + 5
    rules = {"keypoints": en.Keypoints(["left_eye", "right_eye"])}
    whole = Batch.from_columns(np.zeros((3, 20, 24, 3), np.uint8), cols.copy(),
                               sample_ids=np.arange(3), fresh=np.ones(3, bool),
                               echo_index=np.zeros(3, np.int64), epoch=0, rules=rules)
    trimmed = Batch.from_columns(np.zeros((3, 20, 24, 3), np.uint8), cols.take(np.arange(3)),
                                 sample_ids=np.arange(3), fresh=np.ones(3, bool),
                                 echo_index=np.zeros(3, np.int64), epoch=0, rules=rules)
    a, b = whole.objects, trimmed.objects
    assert list(a.fields) == list(b.fields) == ["keypoints"]
    for x, y in zip(a.arrays(), b.arrays()):
        assert np.array_equal(x, y)
    assert a.valid.sum(axis=1).tolist() == [3, 0, 2]


def test_targets_and_objects_carry_the_listed_fields_only():
    assert [f.name for f in OBJECT_FIELDS] == list(FIELDS) == ["keypoints", "masks"]
    t = en.Targets([[0, 0, 4, 4]], [1], keypoints=[[[1, 2, 2]]])
    assert t.fields.keys() == {"keypoints"} and t.masks is None
    assert pickle.loads(pickle.dumps(t)) == t
    assert t != en.Targets([[0, 0, 4, 4]], [1])
    with pytest.raises(TypeError, match=r"unknown fields \['poses'\].*keypoints"):
        en.Targets([[0, 0, 4, 4]], [1], poses=[[[1, 2, 2]]])
    with pytest.raises(AttributeError):
        t.boxes = None
    o = Objects(np.zeros((1, 1, 4), np.float32), np.zeros((1, 1), np.int64),
                np.ones((1, 1), bool), np.zeros((1, 1), bool), (8, 8),
                {"keypoints": np.zeros((1, 1, 1, 3), np.float32), "masks": None})
    assert list(o.fields) == ["keypoints"] and o.masks is None
    assert o.copy().keypoints.shape == (1, 1, 1, 3)
    with pytest.raises(TypeError, match="unknown fields"):
        Objects(o.boxes, o.labels, o.valid, o.iscrowd, None, {"poses": o.keypoints})
    with pytest.raises(AttributeError):
        o.nothing  # noqa: B018

"""Detection targets: Targets and as_targets, their JSON form, the source protocol, and
targets through FileList (JSON beside each image), the tar index and TarShards.

References: the values written (boxes compared exactly: float32 survives the JSON form
bit for bit), Python's ``tarfile`` for where members lie, and the same shards read
without targets.  CocoDetection's own tests, and the round trip from a COCO folder
through write_shards, are in ``test_coco.py``.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from echo_native import shards, tarindex
from echo_native.source import FileList, Samples
from echo_native.targets import (MAX_JSON_BYTES, Targets, as_targets, source_targets,
                                 targets_from_json, targets_to_json)
from echo_native.tarshards import TarShards

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import sources_helpers as sh  # noqa: E402

BOXES = [[1.5, 2.0, 10.25, 20.0], [0.0, 0.0, 48.0, 40.0], [3.0, 3.0, 3.0, 7.0]]


def sample_targets(k, hw=(40, 48)):
    """Distinct valid targets for image ``k`` (k objects, the last image with none)."""
    rng = np.random.default_rng(k)
    n = k % 4
    xy = rng.uniform(0, [hw[1] / 2, hw[0] / 2], size=(n, 2))
    wh = rng.uniform(0, [hw[1] / 2, hw[0] / 2], size=(n, 2))
    return Targets(np.concatenate([xy, xy + wh], axis=1), rng.integers(1, 9, n),
                   rng.random(n) < 0.3, hw)


# ---- Targets and as_targets -------------------------------------------------------------------
def test_targets_hold_read_only_arrays_of_the_documented_dtypes():
    """boxes (N, 4) float32, labels (N,) int64, iscrowd (N,) bool (zeros by default),
    image_hw a pair of ints; none of the arrays can be written, and the input is copied."""
    boxes = np.asarray(BOXES)
    t = Targets(boxes, [1, 2, 3], image_hw=(40, 48))
    assert t.boxes.dtype == np.float32 and t.boxes.shape == (3, 4)
    assert t.labels.dtype == np.int64 and t.labels.tolist() == [1, 2, 3]
    assert t.iscrowd.dtype == bool and t.iscrowd.tolist() == [False] * 3
    assert t.image_hw == (40, 48) and len(t) == 3
    for a in (t.boxes, t.labels, t.iscrowd):
        with pytest.raises(ValueError, match="read-only"):
            a[0] = 0
    boxes[0, 0] = 99  # the caller's array stays the caller's
    assert t.boxes[0, 0] == np.float32(1.5)
    with pytest.raises(AttributeError):
        t.boxes = None


def test_targets_compare_by_value_and_pickle_as_they_are():
    """Equal arrays and size: equal; any difference: not; a pickled Targets comes back equal
    and read-only."""
    a = Targets(BOXES, [1, 2, 3], [0, 1, 0], (40, 48))
    assert a == Targets(np.asarray(BOXES, np.float32), np.asarray([1, 2, 3]), [False, True, False],
                        (40, 48))
    assert a != Targets(BOXES, [1, 2, 4], [0, 1, 0], (40, 48))
    assert a != Targets(BOXES, [1, 2, 3], [0, 1, 0], None)
    assert a != Targets(BOXES, [1, 2, 3], [0, 0, 0], (40, 48))
    back = pickle.loads(pickle.dumps(a))
    assert back == a and not back.boxes.flags.writeable and back.image_hw == (40, 48)
    assert repr(a) == "Targets(3 objects, image_hw=(40, 48))"


@pytest.mark.parametrize("boxes", [[], np.zeros((0, 4)), np.zeros((0,)), ()])
def test_no_objects_is_valid_targets(boxes):
    """An image without objects: boxes [] or (0, 4), labels []: shape (0, 4) and (0,)."""
    t = as_targets({"boxes": boxes, "labels": []}, "x")
    assert t.boxes.shape == (0, 4) and t.labels.shape == (0,) and t.iscrowd.shape == (0,)
    assert len(t) == 0


def test_as_targets_takes_the_dict_form_lists_or_arrays():
    """{"boxes", "labels", "iscrowd"?, "image_hw"?}: lists, tuples or arrays of any numeric
    dtype; integral float labels are integers; a Targets passes through unchanged."""
    t = as_targets({"boxes": BOXES, "labels": (1.0, 2, 3), "iscrowd": np.array([1, 0, 0]),
                    "image_hw": [40, 48]}, "x")
    assert t.labels.tolist() == [1, 2, 3] and t.iscrowd.tolist() == [True, False, False]
    assert t.image_hw == (40, 48)
    assert np.array_equal(t.boxes, np.asarray(BOXES, np.float32))
    assert as_targets(t, "x") is t and as_targets(t, "x", (40, 48)) is t
    u = as_targets({"boxes": np.asarray(BOXES, np.uint16), "labels": np.arange(3, dtype=np.uint8)},
                   "x")
    assert u.boxes.dtype == np.float32 and u.labels.dtype == np.int64


def test_boxes_within_a_pixel_of_the_image_are_clipped_to_it():
    """COCO's rounding puts boxes up to a fraction of a pixel outside: up to 1 px is clipped
    to the image (x to [0, w], y to [0, h]); the size may come with the value or apart."""
    t = as_targets({"boxes": [[-0.5, -1.0, 48.9, 41.0], [2, 2, 5, 5]], "labels": [1, 2]},
                   "x", (40, 48))
    assert t.boxes.tolist() == [[0.0, 0.0, 48.0, 40.0], [2, 2, 5, 5]]
    u = as_targets({"boxes": [[-0.5, 0, 4, 4]], "labels": [1], "image_hw": (40, 48)}, "x")
    assert u.boxes.tolist() == [[0, 0, 4, 4]]
    free = Targets([[-0.5, 0, 4, 4]], [1])  # no size known: nothing to clip to
    assert free.boxes.tolist() == [[-0.5, 0, 4, 4]]
    clipped = as_targets(free, "x", (40, 48))
    assert clipped.boxes.tolist() == [[0, 0, 4, 4]] and clipped.image_hw == (40, 48)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("value, hw, why", [
    ({"boxes": [[0, 0, 1, 1], [0, NAN, 1, 1]], "labels": [1, 2]}, None,
     r"^img7: object 1: box \[0.0, nan, 1.0, 1.0\] holds a non-finite number$"),
    ({"boxes": [[0, 0, INF, 1]], "labels": [1]}, None, r"object 0: .* non-finite"),
    ({"boxes": [[0, 0, 1e300, 1]], "labels": [1]}, None, r"object 0: .* does not fit float32"),
    ({"boxes": [[5, 0, 4, 1]], "labels": [1]}, None, r"object 0: box \[5.0, 0.0, 4.0, 1.0\] "
                                                     r"has x2 < x1 or y2 < y1"),
    ({"boxes": [[0, 0, 1, 1], [0, 5, 1, 4]], "labels": [1, 1]}, None,
     r"object 1: .* x2 < x1 or y2 < y1"),
    ({"boxes": [[0, 0, 1]], "labels": [1]}, None, r"boxes must have shape \(N, 4\) .* got "
                                                  r"shape \(1, 3\)"),
    ({"boxes": [0, 0, 1, 1], "labels": [1]}, None, r"shape \(4,\)"),
    ({"boxes": [[0, 0, 1, 1], [0, 0, 1]], "labels": [1, 2]}, None, r"not a regular array"),
    ({"boxes": [["0", 0, 1, 1]], "labels": [1]}, None, r"boxes must be numbers"),
    ({"boxes": "0 0 1 1", "labels": [1]}, None, r"boxes must be numbers, got str"),
    ({"boxes": [[0, 0, 1, 1]], "labels": [1, 2]}, None, r"1 boxes need 1 labels .* shape \(2,\)"),
    ({"boxes": [[0, 0, 1, 1]], "labels": [[1]]}, None, r"1 boxes need 1 labels"),
    ({"boxes": [[0, 0, 1, 1]] * 2, "labels": [1, 2.5]}, None,
     r"^img7: object 1: label 2.5 is not an integer$"),
    ({"boxes": [[0, 0, 1, 1]], "labels": [NAN]}, None, r"object 0: label nan is not an integer"),
    ({"boxes": [[0, 0, 1, 1]] * 2, "labels": [3, -1]}, None,
     r"^img7: object 1: label -1 is negative$"),
    ({"boxes": [[0, 0, 1, 1]], "labels": [True]}, None, r"labels must be integers, got booleans"),
    ({"boxes": [[0, 0, 1, 1]], "labels": ["cat"]}, None, r"labels must be numbers"),
    ({"boxes": [[0, 0, 1, 1]], "labels": [2**64 - 1]}, None, r"label 18446744073709551615 does "
                                                            r"not fit int64"),
    ({"boxes": [[0, 0, 1, 1]], "labels": [2**70]}, None, r"labels"),
    ({"boxes": [[0, 0, 1, 1]] * 2, "labels": [1, 1], "iscrowd": [0, 2]}, None,
     r"object 1: iscrowd is 2, not 0 or 1"),
    ({"boxes": [[0, 0, 1, 1]], "labels": [1], "iscrowd": [0, 0]}, None,
     r"1 boxes need 1 iscrowd flags"),
    ({"boxes": [[0, 0, 1, 1], [0, 0, 49.5, 4]], "labels": [1, 1]}, (40, 48),
     r"^img7: object 1: box \[0.0, 0.0, 49.5, 4.0\] lies outside the 40x48 \(height x width\) "
     r"image by more than 1 px$"),
    ({"boxes": [[-1.5, 0, 1, 1]], "labels": [1]}, (40, 48), r"object 0: .* lies outside"),
    ({"boxes": [[0, 0, 1, 41.01]], "labels": [1]}, (40, 48), r"object 0: .* lies outside"),
    ({"boxes": [[0, 0, 1, 1]], "labels": [1], "image_hw": [40, 48]}, (41, 48),
     r"targets for a 40x48 image, the image is 41x48"),
    ({"boxes": [[0, 0, 1, 1]], "labels": [1], "image_hw": [0, 48]}, None,
     r"image_hw must be two positive integers"),
    ({"boxes": [[0, 0, 1, 1]], "labels": [1], "image_hw": 40}, None,
     r"image_hw must be \(height, width\)"),
    ({"boxes": [[0, 0, 1, 1]], "labels": [1], "image_hw": [40.5, 48]}, None,
     r"image_hw must be two positive integers"),
    ({"boxes": [[0, 0, 1, 1]]}, None, r"targets without 'labels'"),
    ({"labels": []}, None, r"targets without 'boxes'"),
    ([[0, 0, 1, 1]], None, r"must be a Targets or a dict .* got list"),
    (None, None, r"got NoneType"),
])
def test_invalid_targets_name_where_and_the_object(value, hw, why):
    """Each way targets can be wrong is a one-line ValueError naming where they came from
    and, for one object's fault, that object's index."""
    with pytest.raises(ValueError, match=why) as e:
        as_targets(value, "img7", hw)
    assert str(e.value).startswith("img7: ") and "\n" not in str(e.value)


def test_a_targets_for_another_image_size_is_refused():
    """A Targets that says its image is 40x48, offered for a 41x48 image: named."""
    t = Targets(BOXES, [1, 2, 3], image_hw=(40, 48))
    with pytest.raises(ValueError, match=r"^y: targets for a 40x48 image, the image is 41x48"):
        as_targets(t, "y", (41, 48))
    with pytest.raises(ValueError, match=r"^Targets: object 0: label -1 is negative"):
        Targets(BOXES[:1], [-1])


# ---- the JSON form ----------------------------------------------------------------------------
def test_the_json_form_round_trips_exactly():
    """targets_to_json then targets_from_json: the same float32 boxes bit for bit (random
    values too), labels, flags and size; the document is the documented shape."""
    rng = np.random.default_rng(3)
    xy = rng.uniform(0, 300, (50, 2)).astype(np.float32)
    t = Targets(np.concatenate([xy, xy + rng.uniform(0, 300, (50, 2))], axis=1),
                rng.integers(0, 2**40, 50), rng.random(50) < 0.5, (700, 650))
    data = targets_to_json(t)
    assert targets_from_json(data, "x") == t
    doc = json.loads(data)
    assert sorted(doc) == ["boxes", "image_hw", "iscrowd", "labels"]
    assert doc["iscrowd"][:3] == t.iscrowd[:3].astype(int).tolist()
    bare = Targets([[1, 2, 3, 4]], [5])
    assert json.loads(targets_to_json(bare)) == {"boxes": [[1, 2, 3, 4]], "labels": [5],
                                                 "iscrowd": [0]}
    assert targets_from_json(targets_to_json(bare), "x") == bare


@pytest.mark.parametrize("data, why", [
    (b"", r"^f.json: not targets JSON \("),
    (b"\xff\xfe\x00junk", r"^f.json: not targets JSON"),
    (b"[" * 100_000 + b"]" * 100_000, r"^f.json: not targets JSON \(nested too deeply\)$"),
    (b'{"boxes": ' + b"[" * 5000 + b"]" * 5000 + b', "labels": []}', r"^f.json: "),
    (b"[1, 2]", r"targets JSON must be an object .* got list"),
    (b'{"boxes": {"a": 1}, "labels": []}', r"'boxes' must be a list, got dict"),
    (b'{"boxes": [], "labels": 3}', r"'labels' must be a list, got int"),
    (b'{"boxes": [[0, 0, NaN, 1]], "labels": [1]}', r"object 0: .* non-finite"),
    (b'{"boxes": [[0, 0, 1e999, 1]], "labels": [1]}', r"object 0: .* non-finite"),
    (b'{"boxes": [[0, 0, 1, 1]], "labels": [' + b"9" * 5000 + b"]}", r"^f.json: not targets"),
    (b'{"boxes": [[0, 0, 1, 1]], "labels": [1], "image_hw": "40x48"}', r"image_hw"),
], ids=["empty", "not utf-8", "deep", "deep boxes", "list", "boxes dict", "labels int", "nan",
        "1e999", "5000 digits", "image_hw string"])
def test_what_is_not_targets_json_is_a_value_error_naming_the_file(data, why):
    """Not JSON, not UTF-8, nested past the parser, the wrong shape or values: a ValueError
    naming the file, never another exception."""
    with pytest.raises(ValueError, match=why):
        targets_from_json(data, "f.json")


def test_a_targets_json_over_the_limit_is_refused_unparsed():
    """Over MAX_JSON_BYTES (16 MiB): refused by its size, naming the limit."""
    data = b" " * (MAX_JSON_BYTES + 1)
    with pytest.raises(ValueError, match=r"^big.json: targets JSON of 16,777,217 bytes, over "
                                         r"the limit of 16,777,216$"):
        targets_from_json(data, "big.json")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_any_bytes_are_targets_or_a_value_error(data):
    """Fuzz: arbitrary bytes never crash the reader; what is read is valid targets."""
    try:
        t = targets_from_json(data, "fuzz")
    except ValueError as e:
        assert str(e).startswith("fuzz: ")
    else:
        assert t.boxes.shape == (len(t), 4) and np.isfinite(t.boxes).all()


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=5)
                     | st.dictionaries(st.text(max_size=5), inner, max_size=4), max_leaves=30)
_keyed = st.fixed_dictionaries({}, optional={"boxes": _json, "labels": _json, "iscrowd": _json,
                                             "image_hw": _json})


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_json, _keyed, st.fixed_dictionaries({
    "boxes": st.lists(st.lists(st.one_of(st.floats(), st.integers(), st.booleans()),
                               min_size=3, max_size=5), max_size=4),
    "labels": st.lists(st.one_of(st.integers(), st.floats()), max_size=4),
    "iscrowd": st.lists(st.integers(-1, 2), max_size=4)})))
def test_any_json_document_is_targets_or_a_value_error(doc):
    """Fuzz over JSON documents (the right keys with wrong values too): valid targets with
    x1 <= x2, y1 <= y2, labels >= 0, or a ValueError naming the input."""
    try:
        data = json.dumps(doc).encode()
    except ValueError:
        return
    try:
        t = targets_from_json(data, "fuzz")
    except ValueError as e:
        assert str(e).startswith("fuzz: ")
    else:
        b = t.boxes
        assert (b[:, 2] >= b[:, 0]).all() and (b[:, 3] >= b[:, 1]).all()
        assert (t.labels >= 0).all() and t.iscrowd.dtype == bool


# ---- the source protocol ----------------------------------------------------------------------
def test_a_source_carries_targets_when_it_has_them_and_does_not_say_otherwise():
    """source_targets: the callable targets of a source; None without one, when it is not
    callable, or when has_targets is False."""
    class With:
        def targets(self, i):
            return {"boxes": [], "labels": []}

    class Off(With):
        has_targets = False

    class NotCallable:
        targets = [1, 2]

    s = With()
    assert source_targets(s) == s.targets
    assert source_targets(Off()) is None and source_targets(NotCallable()) is None
    assert source_targets(object()) is None
    assert source_targets(FileList([("a.jpg", 0)])) is None


# ---- FileList: JSON beside each image ---------------------------------------------------------
@pytest.fixture
def listed(tmp_path):
    """A FileList folder: 6 JPEGs with their targets as JSON beside them (two in a
    sub-folder), and the list."""
    blobs = sh.photo_jpegs(6, seed=5)
    rows, want = [], []
    for k, data in enumerate(blobs):
        rel = f"{'sub/' if k >= 4 else ''}im.{k}.jpg"
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_bytes(data)
        t = sample_targets(k)
        (tmp_path / rel).with_suffix(".json").write_bytes(targets_to_json(t))
        rows.append(f"{rel},{k % 2}")
        want.append(t)
    (tmp_path / "list.csv").write_text("\n".join(rows) + "\n")
    return tmp_path, want


def test_a_file_list_reads_each_images_targets_beside_it(listed):
    """targets=True: targets(i) is the JSON beside image i (path less its extension), the
    same after pickling to a worker; without targets=True the source carries none."""
    root, want = listed
    src = FileList(root / "list.csv", targets=True)
    assert src.has_targets and source_targets(src) == src.targets
    assert [src.targets(i) for i in range(len(src))] == want
    back = pickle.loads(pickle.dumps(src))
    assert [back.targets(i) for i in range(len(src))] == want
    assert "targets=True" in repr(src)
    plain = FileList(root / "list.csv")
    assert source_targets(plain) is None
    with pytest.raises(ValueError, match="made without targets=True"):
        plain.targets(0)


def test_a_missing_or_bad_targets_file_is_that_samples_failure_naming_it(listed):
    """No JSON beside an image, one that is not targets, one over the limit, or a FIFO in
    its place: a ValueError from targets(i) naming the JSON's path; the rest still read."""
    root, want = listed
    src = FileList(root / "list.csv", targets=True)
    (root / "im.0.json").unlink()
    (root / "im.1.json").write_bytes(b'{"boxes": [[0, 0, 1]], "labels": [1]}')
    with open(root / "im.2.json", "wb") as f:
        f.truncate(MAX_JSON_BYTES + 1)
    (root / "im.3.json").unlink()
    os.mkfifo(root / "im.3.json")
    with pytest.raises(ValueError, match=f"^{root}/im.0.json: no targets file beside the image "
                                         f"{root}/im.0.jpg$"):
        src.targets(0)
    with pytest.raises(ValueError, match=rf"^{root}/im.1.json: boxes must have shape"):
        src.targets(1)
    with pytest.raises(ValueError, match=rf"^{root}/im.2.json: 16777217 bytes, over the limit"):
        src.targets(2)
    with pytest.raises(ValueError, match=rf"^{root}/im.3.json: not a regular file \(a FIFO\)"):
        src.targets(3)
    assert src.targets(4) == want[4] and src.targets(5) == want[5]


# ---- the tar index and TarShards --------------------------------------------------------------
def _tar(path, members):
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(scope="module")
def jpegs():
    return sh.photo_jpegs(4, seed=9)


def test_the_index_keeps_each_samples_json_member_and_round_trips_it(tmp_path, jpegs):
    """A ``key.json`` member's offset and size are kept beside its image's (-1, 0 for a
    sample without one); the sidecar holds them as two more numbers per entry and reads
    back the same; an index of a shard without json members is as before."""
    meta = [targets_to_json(sample_targets(k)) for k in range(3)]
    shard = _tar(tmp_path / "s.tar", [("a.jpg", jpegs[0]), ("a.json", meta[0]), ("a.cls", b"1"),
                                      ("b.json", meta[1]), ("b.jpg", jpegs[1]),
                                      ("c.jpg", jpegs[2])])
    index = tarindex.scan_file(shard)
    with tarfile.open(shard) as tar:
        m = {x.name: x for x in tar.getmembers()}
    assert index.json_offsets == [m["a.json"].offset_data, m["b.json"].offset_data, -1]
    assert index.json_sizes == [len(meta[0]), len(meta[1]), 0]
    doc = json.loads(index.to_json())
    assert doc["members"][0][4:] == [m["a.json"].offset_data, len(meta[0])]
    assert len(doc["members"][2]) == 4 and doc["version"] == 1
    back = tarindex.TarIndex.from_json(index.to_json(), index.shard_bytes)
    assert (back.json_offsets, back.json_sizes) == (index.json_offsets, index.json_sizes)
    plain = tarindex.scan_file(_tar(tmp_path / "p.tar", [("a.jpg", jpegs[0]), ("a.cls", b"1")]))
    assert plain.json_offsets is None
    assert [len(e) for e in json.loads(plain.to_json())["members"]] == [4]


def test_a_sidecar_with_a_bad_json_entry_is_refused(tmp_path):
    """A json member's offset off the block grid, past the shard or over another member:
    the sidecar is refused, saying which entry."""
    def doc(members):
        return json.dumps({"format": tarindex.FORMAT, "version": 1, "shard_bytes": 10240,
                           "members": members}).encode()
    for members, why in [([["k", 512, 10, 0, 700, 5]], "out of range"),
                         ([["k", 512, 10, 0, 10240, 5]], "out of range"),
                         ([["k", 512, 10, 0, -2, 0]], "out of range"),
                         ([["k", 512, 10, 0, 1024, -1]], "out of range"),
                         ([["k", 512, 10, 0, 512, 5]], "overlap"),
                         ([["k", 512, 10, 0, 1024]], "bad index entry")]:
        with pytest.raises(ValueError, match=why):
            tarindex.TarIndex.from_json(doc(members))
    ok = tarindex.TarIndex.from_json(doc([["k", 512, 10, 0, 1536, 5], ["l", 2560, 3, 1]]))
    assert ok.json_offsets == [1536, -1] and ok.json_sizes == [5, 0]


def test_a_sample_whose_json_is_cut_off_is_left_out(tmp_path, jpegs):
    """Damage inside a sample's json member (written before its label) leaves the sample
    out: a shard cut short never keeps a sample without its targets."""
    meta = targets_to_json(sample_targets(3))
    shard = _tar(tmp_path / "s.tar", [("a.jpg", jpegs[0]), ("a.json", meta), ("a.cls", b"0"),
                                      ("b.jpg", jpegs[1]), ("b.json", meta), ("b.cls", b"1")])
    with tarfile.open(shard) as tar:
        cut = tar.getmember("b.json").offset_data + 3
    data = shard.read_bytes()[:cut]
    index = tarindex.scan(io.BytesIO(data), "cut", len(data))
    assert index.keys == ["a"] and index.damage is not None


@pytest.fixture
def target_shards(listed, tmp_path):
    """write_shards of the FileList with targets (2 samples a shard), and that source."""
    root, want = listed
    src = FileList(root / "list.csv", targets=True)
    out = shards.write_shards(src, tmp_path / "shards", max_count=2, progress=False)
    return src, out, want


def test_write_shards_writes_targets_that_tar_shards_read_back_identically(target_shards):
    """A source with targets: each sample gets ``key.json`` between its image and label;
    TarShards(targets=True) gives the very same targets (with the image size), the same
    after pickling; the images and labels are read as without targets."""
    src, out, want = target_shards
    assert len(out) == 3
    with tarfile.open(out[0]) as tar:
        assert tar.getnames() == ["000000.jpg", "000000.json", "000000.cls",
                                  "000001.jpg", "000001.json", "000001.cls"]
    tar = TarShards(out, targets=True)
    assert tar.has_targets and source_targets(tar) == tar.targets
    got = [tar.targets(i) for i in range(len(tar))]
    assert got == [as_targets(t, "x", (40, 48)) for t in want]
    assert all(t.image_hw == (40, 48) for t in got)
    back = pickle.loads(pickle.dumps(tar))
    assert [back.targets(i) for i in range(len(tar))] == got
    plain = TarShards(out)
    assert source_targets(plain) is None
    assert [plain.read(i) for i in range(len(plain))] == [src.read(i) for i in range(len(src))]
    assert plain.labels.tolist() == src.labels.tolist()


def test_without_targets_the_shards_are_byte_identical(listed, tmp_path):
    """targets=False (or a source without targets) writes exactly the shards and sidecars
    written before targets existed: image and label members only."""
    root, _ = listed
    a = shards.write_shards(FileList(root / "list.csv", targets=True), tmp_path / "a",
                            targets=False, progress=False)
    b = shards.write_shards(FileList(root / "list.csv"), tmp_path / "b", progress=False)
    for p, q in zip(a, b):
        assert Path(p).read_bytes() == Path(q).read_bytes()
        assert Path(p + ".idx").read_bytes() == Path(q + ".idx").read_bytes()
    with tarfile.open(a[0]) as tar:
        assert not [n for n in tar.getnames() if n.endswith(".json")]
    with pytest.raises(ValueError, match=r"write_shards\(targets=True\): the source .* carries "
                                         r"no targets"):
        shards.write_shards(FileList(root / "list.csv"), tmp_path / "c", targets=True,
                            progress=False)


def test_tar_shards_without_json_members_refuse_targets(listed, tmp_path):
    """TarShards(targets=True) over shards with no json member at all: refused at
    construction, saying how to write them."""
    root, _ = listed
    out = shards.write_shards(FileList(root / "list.csv"), tmp_path / "s", progress=False)
    with pytest.raises(ValueError, match=r"TarShards\(targets=True\): no sample of the 1 "
                                         r"shard\(s\) .* has a <key>.json member"):
        TarShards(out, targets=True)


def test_a_shard_sample_without_or_with_bad_targets_fails_alone(tmp_path, jpegs):
    """In a shard with targets, a sample without ``key.json`` or with an invalid one is a
    ValueError from targets(i) naming ``shard:key.json``; the others read."""
    good = targets_to_json(sample_targets(2))
    shard = _tar(tmp_path / "s.tar", [("a.jpg", jpegs[0]), ("a.json", good),
                                      ("b.jpg", jpegs[1]),
                                      ("c.jpg", jpegs[2]), ("c.json", b"{not json")])
    tar = TarShards([shard], targets=True)
    assert tar.targets(0) == sample_targets(2)
    with pytest.raises(ValueError, match=rf"^{shard}:b.json: no such member in the shard"):
        tar.targets(1)
    with pytest.raises(ValueError, match=rf"^{shard}:c.json: not targets JSON"):
        tar.targets(2)


def test_write_shards_scales_targets_with_a_reencoded_image(listed, tmp_path):
    """max_side re-encodes an image: its boxes and size scale with it (x by the width's
    ratio, y by the height's)."""
    root, want = listed
    src = FileList(root / "list.csv", targets=True)
    out = shards.write_shards(src, tmp_path / "small", max_side=24, progress=False)
    tar = TarShards(out, targets=True)
    for i in range(len(tar)):
        t = tar.targets(i)
        assert t.image_hw == (20, 24)
        np.testing.assert_allclose(t.boxes, want[i].boxes * 0.5, atol=1e-4)
        assert t.labels.tolist() == want[i].labels.tolist()


def test_targets_that_do_not_fit_the_image_leave_the_sample_out(listed, tmp_path):
    """write_shards checks targets against the decoded image: made for another size, or
    invalid, the sample is reported with its path and left out like a bad image."""
    root, _ = listed
    (root / "im.1.json").write_bytes(targets_to_json(Targets([[0, 0, 1, 1]], [1],
                                                             image_hw=(41, 48))))
    (root / "im.2.json").write_bytes(b'{"boxes": [[0, 0, 60, 1]], "labels": [1]}')
    (root / "im.3.json").unlink()
    src = FileList(root / "list.csv", targets=True)
    seen = []
    out = shards.write_shards(src, tmp_path / "s", report=lambda n, m: seen.append((n, m)),
                              progress=False)
    assert out.samples == 3 and len(out.failures) == 3
    msgs = dict(seen)
    assert "targets for a 41x48 image, the image is 40x48" in msgs[src.describe(1)]
    assert "lies outside the 40x48" in msgs[src.describe(2)]
    assert msgs[src.describe(3)].startswith(f"{root}/im.3.json: no targets file")
    with pytest.raises(shards.ShardWriteError, match="41x48"):
        shards.write_shards(src, tmp_path / "t", strict=True, progress=False)


# ---- from object storage ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def s3():
    """A moto S3 server (as in test_remote.py) and an s3fs filesystem on it."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from test_remote import S3Server, s3fs_for

    mp = pytest.MonkeyPatch()
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        mp.setenv(k, v)
    server = S3Server().start()
    try:
        yield server.endpoint, s3fs_for(server.endpoint)
    finally:
        server.stop()
        mp.undo()


def _counting(store):
    """Record every range read of ``store`` (block reads and reads on their own)."""
    calls, read_range = [], store.read_range

    def counted(url, start, end, **kw):
        calls.append((url, start, end))
        return read_range(url, start, end, **kw)
    store.read_range = counted
    return calls


def test_remote_shards_read_targets_from_the_images_blocks(target_shards, s3):
    """Shards in S3: targets read back equal to the local ones; a block that holds an image
    holds its targets too (reading them after the images asks the store for nothing more);
    without blocks each targets member is one range read of exactly its bytes."""
    from echo_native.remote import RemoteOptions

    endpoint, fs = s3
    _, out, _ = target_shards
    fs.mkdir("det")
    urls = []
    for p in out:
        for suffix in ("", ".idx"):
            fs.put_file(p + suffix, f"det/{os.path.basename(p)}{suffix}")
        urls.append(f"s3://det/{os.path.basename(p)}")
    local = TarShards(out, targets=True)
    opts = {"endpoint_url": endpoint}
    tar = TarShards(urls, storage_options=opts, index_cache=False, targets=True,
                    remote=RemoteOptions(prefetch=0, block_bytes=1 << 20))
    calls = _counting(tar._store)
    assert [tar.read(i) for i in range(len(tar))] == [local.read(i) for i in range(len(tar))]
    blocks = len(calls)
    assert blocks == len(urls)  # one block per (small) shard
    assert [tar.targets(i) for i in range(len(tar))] == \
        [local.targets(i) for i in range(len(tar))]
    assert len(calls) == blocks
    alone = TarShards(urls, storage_options=opts, index_cache=False, targets=True,
                      remote=RemoteOptions(prefetch=0, block_bytes=0))
    calls = _counting(alone._store)
    assert [alone.targets(i) for i in range(len(tar))] == \
        [local.targets(i) for i in range(len(tar))]
    assert [end - start for _, start, end in calls] == \
        [int(alone._json_size[i]) for i in range(len(tar))]


def test_a_remote_file_list_reads_targets_beside_its_images(listed, s3):
    """A list in S3 with targets=True reads each image's JSON beside it in the bucket; a
    missing one is a ValueError naming its URL."""
    endpoint, fs = s3
    root, want = listed
    fs.mkdir("flist")
    for p in sorted(root.rglob("*")):
        if p.is_file():
            fs.put_file(str(p), f"flist/{p.relative_to(root)}")
    fs.rm_file("flist/im.2.json")
    src = FileList("s3://flist/list.csv", storage_options={"endpoint_url": endpoint},
                   targets=True)
    got = {i: src.targets(i) for i in range(len(src)) if i != 2}
    assert got == {i: t for i, t in enumerate(want) if i != 2}
    with pytest.raises(ValueError, match=r"^s3://flist/im.2.json: no targets file beside the "
                                         r"image s3://flist/im.2.jpg$"):
        src.targets(2)


def test_in_memory_samples_carry_checked_targets():
    """Samples(..., targets=[...]): each checked at construction (a bad one named by its
    sample), returned by targets(i); without targets the source carries none."""
    blobs = sh.photo_jpegs(2, seed=1)
    src = Samples(blobs, targets=[sample_targets(1), {"boxes": [], "labels": []}])
    assert source_targets(src) == src.targets and src.targets(0) == sample_targets(1)
    assert len(src.targets(1)) == 0
    assert source_targets(Samples(blobs)) is None
    with pytest.raises(ValueError, match=r"^targets of <sample 1>: object 0: label -2 is "
                                         r"negative$"):
        Samples(blobs, targets=[sample_targets(1), {"boxes": [[0, 0, 1, 1]], "labels": [-2]}])
    with pytest.raises(ValueError, match="2 images but 1 targets"):
        Samples(blobs, targets=[sample_targets(1)])

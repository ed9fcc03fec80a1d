"""The ring's binary layout is C's (src/ring/en_ring.h), and failure records have
one binary codec.

* A plain C program (src/ring/examples/ring_demo.c) creates, fills and reads a
  ring with nothing but en_ring.h, and fills a ring Python created.
* Every offset Python uses equals the C struct's ``offsetof``; the static
  layout (alignment of the atomic words, page-aligned pixels, no overlap)
  holds for any geometry; impossible geometries and out-of-range worker
  indexes are refused.
* Failure records survive any path bytes (newline, tab, U+2028, non-UTF-8,
  4 kB, empty), truncate at record boundaries with an exact dropped count, and
  reach the user intact through a Loader.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import echo_native as en
import ring_helpers as rh
from echo_native import _ring
from echo_native import failures as fl
from echo_native import ring as rg
from echo_native.failures import NO_SAMPLE, REPORT_BYTES, Failure, decode_failures, encode_failures
from echo_native.ring import MAX_WORKERS, Layout, Record, Ring

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RING_SRC = ROOT / "src" / "ring"
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import echo_helpers as eh

HOSTILE = [
    "bad\nname.jpg",
    "tab\there.jpg",
    "line\u2028separator.jpg",
    os.fsdecode(b"\xff\xfe.jpg"),                    # not UTF-8: surrogate escapes
    "/" + "d" * 4095,                                # a 4096-byte path
    "",
    "x.jpg\t1\t/etc/forged.jpg\tforged\n7\t1",       # what forged the old text report
]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """ring_demo compiled from its file against en_ring.c alone (strict C11, warnings fatal)."""
    exe = tmp_path_factory.mktemp("ring_demo") / "ring_demo"
    cmd = [os.environ.get("CC", "cc"), "-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic",
           "-O1", "-I", str(RING_SRC), str(RING_SRC / "examples" / "ring_demo.c"),
           str(RING_SRC / "en_ring.c"), "-o", str(exe), "-lrt"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    return exe


SIZES = [size for _, _, size, _ in rg.ROW_KINDS]


def _record(*sizes):
    """The Record of sizes given in the table's order (the rest 0)."""
    return Record(**dict(zip(SIZES, sizes)))


def _layout(nslots, batch, sample_bytes, *sizes):
    return Layout(nslots, batch, sample_bytes, _record(*sizes))


def _c_layout(demo, nslots, batch, sample_bytes, *sizes):
    sizes = list(sizes) + [0] * (len(SIZES) - len(sizes))
    out = subprocess.run([str(demo), "layout", str(nslots), str(batch), str(sample_bytes),
                          *map(str, sizes)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


# ---- a C program uses the ring without Python ---------------------------------------------
def test_c_program_produces_and_consumes_through_the_header(demo):
    """ring_demo forks a producer and consumes several laps in order, checking every byte."""
    out = subprocess.run([str(demo)], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok: 11 tickets through 3 slots")


def test_c_producer_fills_a_ring_python_created(demo):
    """A C producer attaches to Ring.create's segment; Python reads its arrays and its
    binary failure records (a path with tab, newline and non-UTF-8 bytes) exactly."""
    B, S, tickets = 4, 100, 7
    ring = Ring.create(3, B, S)
    proc = subprocess.Popen([str(demo), "produce", ring.name, str(tickets)],
                            stderr=subprocess.PIPE, text=True)
    try:
        for t in range(tickets):
            assert ring.wait_filled(t, 20.0) == _ring.WAIT_OK, f"ticket {t} never came"
            meta = ring.read_meta(t)
            assert (meta.count, meta.error, meta.failures) == (B, rg.ERR_NONE, 1)
            path = os.fsdecode(b"dir\t%d\n\xff\xfe.jpg" % t)
            assert meta.records == [Failure(t * B, rg.REASON_DECODE, path,
                                             f"C failure for ticket {t}")]
            slot = ring.slots[t % 3]
            assert slot.labels.tolist() == [t * 1000 + i for i in range(B)]
            assert slot.sample_ids.tolist() == [t * B + i for i in range(B)]
            k = np.arange(S)
            for i in range(B):
                assert np.array_equal(slot.pixels[i], ((t * 31 + i * 7 + k) % 256).astype(np.uint8))
            ring.release(t)
        assert proc.wait(20) == 0, proc.stderr.read()
        # The producer used the last claim word there is, and gave it back.
        assert ring.claim(MAX_WORKERS - 1) == 0 and ring.next_ticket == tickets + 1
    finally:
        proc.kill()
        proc.wait()
        ring.unlink()


# ---- Python's offsets are C's ------------------------------------------------------------------
@pytest.mark.parametrize("geometry", [(2, 1, 8), (3, 2, 8), (4, 7, 150528), (17, 256, 3 * 224 * 224),
                                      (2, 1000, 0), (0, 4, 8), (2, 0, 8), (2, 2, 2**62),
                                      (3, 5, 8, 1), (4, 32, 270000, 128),
                                      (2, 3, 8, 65535), (2, 3, 8, 65536), (4, 8, 300, 20, 17),
                                      (2, 3, 8, 5, 1024), (2, 3, 8, 5, 1025),
                                      (4, 8, 270000, 20, 0, 11250), (2, 3, 8, 5, 0, 2**32 - 1),
                                      (2, 2**31, 8, 65535, 0, 2**32 - 1)])
def test_python_offsets_equal_the_c_struct_offsets(demo, geometry):
    """Header, slot and failure-record offsets, the constants and the per-sample layout,
    as ring.py uses them, equal what a C compiler makes of en_ring.h."""
    c = _c_layout(demo, *geometry)
    for py, cs in ((_ring.HEADER_FIELDS, c["header"]), (_ring.SLOT_FIELDS, c["slot"]),
                   (_ring.FAILURE_FIELDS, c["failure"])):
        assert {k: v[0] for k, v in py.items()} == {k: v for k, v in cs.items() if k != "sizeof"}
    assert rg._H == {k: v for k, v in c["header"].items() if k != "sizeof"}
    assert rg._S == {k: v for k, v in c["slot"].items() if k != "sizeof"}
    assert _ring.HEADER_STRUCT_BYTES == c["header"]["sizeof"]
    assert _ring.SLOT_HEADER_BYTES == c["slot"]["sizeof"]
    assert fl._FAILURE.size == _ring.FAILURE_HEADER_BYTES == c["failure"]["sizeof"]
    assert (MAX_WORKERS, REPORT_BYTES, rg.PAGE) == (c["max_workers"], c["report_bytes"],
                                                     c["page"])
    # The record header Python packs puts each field where C reads it.
    rec, _ = encode_failures([Failure(0x0102030405060708, 0xAB, "pp", "mmm")])
    f = c["failure"]
    assert int.from_bytes(rec[f["sample_id"]:f["sample_id"] + 8], sys.byteorder) == 0x0102030405060708
    assert int.from_bytes(rec[f["path_len"]:f["path_len"] + 4], sys.byteorder) == 2
    assert int.from_bytes(rec[f["message_len"]:f["message_len"] + 4], sys.byteorder) == 3
    assert rec[f["reason"]] == 0xAB and rec[f["flags"]] == 0
    if c["layout"] is None:
        with pytest.raises(ValueError, match="impossible ring geometry"):
            _layout(*geometry)
        return
    layout = _layout(*geometry)
    sizes = layout.record.as_dict()
    assert {k: sizes[k] if k in sizes else getattr(layout, k) for k in c["layout"]} == \
        c["layout"]


@pytest.mark.parametrize("geometry", [(2, 3, 8), (3, 5, 100, 7), (2, 1, 0, 0)])
def test_a_slot_view_is_the_record_table(geometry):
    """The record is defined once (EN_RING_COLUMNS): each of its columns is a SlotView
    array of the table's dtype and shape at the layout's offset, in the table's order,
    none overlapping the next, all before the pixels."""
    ring = Ring.create(*geometry[:3], record=_record(*geometry[3:]))
    try:
        layout, view = ring.layout, ring.slots[1]
        names = [name for name, *_ in rg.COLUMNS]
        assert names[:2] == ["labels", "sample_ids"] and "obj_flags" in names
        end = 0
        for name, dtype, rows, width in rg.COLUMNS:
            array = getattr(view, name)
            assert array.dtype == np.dtype(dtype), name
            assert array.shape == layout.column_shape(rows, width), name
            start = array.__array_interface__["data"][0] - \
                np.frombuffer(ring.buf, np.uint8, 1, layout.slot(1)).__array_interface__["data"][0]
            assert start == getattr(layout, name) >= end, name
            assert start % np.dtype(dtype).itemsize == 0, name
            end = start + array.nbytes
        assert end <= layout.pixels
    finally:
        ring.unlink()


def test_slot_meta_lands_where_c_reads_it():
    """write_meta stores count, error, failures, ticket, fill time, warned count and report
    length at the C offsets."""
    ring = Ring.create(2, 3, 8)
    try:
        ring.write_meta(5, 3, rg.ERR_DECODE, 9, [Failure(1, 1, "a", "b")], fill_s=0.25,
                        warned=2)
        base = ring.layout.slot(5)

        def word(name, width):
            off = base + _ring.SLOT_FIELDS[name][0]
            return int.from_bytes(ring.buf[off:off + width], sys.byteorder)
        assert (word("count", 4), word("error", 4), word("failures", 4)) == (3, rg.ERR_DECODE, 9)
        assert word("ticket", 8) == 5 and word("fill_us", 4) == 250000
        assert word("report_len", 4) == len(encode_failures([Failure(1, 1, "a", "b")])[0])
        assert ring.fill_seconds(5) == pytest.approx(0.25)
        assert word("warned", 4) == ring.warned(5) == 2
    finally:
        ring.unlink()


def test_the_record_sizes_come_from_the_row_kinds_table():
    """One Record travels whole: its sizes are the table's (EN_RING_ROW_KINDS), each kind's
    rows nest under its parent's, the header holds them where C wrote them, and a ring
    attached by name reads the same Record back."""
    assert [k[:3] for k in rg.ROW_KINDS] == [("object", "sample", "max_objects"),
                                             ("keypoint", "object", "max_keypoints"),
                                             ("mask", "object", "mask_bytes")]
    record = Record(max_objects=3, max_keypoints=5, mask_bytes=7)
    assert record.rows(2) == {"sample": (2,), "object": (2, 3), "keypoint": (2, 3, 5),
                              "mask": (2, 3, 7)}
    assert record.shape("keypoint", 3, 2) == (2, 3, 5, 3)
    assert Record() == Record(max_objects=0) and hash(record) == hash(Record(**record.as_dict()))
    with pytest.raises(TypeError, match="unknown record sizes"):
        Record(max_widgets=1)
    with pytest.raises(ValueError, match="impossible ring geometry"):
        Layout(2, 1, 8, Record(max_keypoints=rg.ROW_KINDS[1][3] + 1))
    ring = Ring.create(2, 4, 64, record=record)
    try:
        off = _ring.HEADER_FIELDS["record"][0]
        assert np.frombuffer(ring.buf, np.uint32, len(SIZES), off).tolist() == [3, 5, 7]
        attached = Ring.attach(ring.name)
        assert attached.layout.record == record and attached.layout == ring.layout
        assert attached.slots[0].obj_keypoints.shape == (4, 3, 5, 3)
        assert attached.slots[0].obj_masks.shape == (4, 3, 7)
        # The bytes an echo buffer keeps per entry: every column of one sample's record.
        assert record.nbytes() == sum(getattr(ring.slots[0], name).nbytes // 4
                                      for name, *_ in rg.COLUMNS)
    finally:
        ring.unlink()


@settings(max_examples=200, deadline=None)
@given(nslots=st.integers(1, 300), batch=st.integers(1, 5000),
       sample_bytes=st.integers(0, 50_000_000), max_objects=st.sampled_from([0, 1, 7, 300]),
       max_keypoints=st.sampled_from([0, 1, 17]), mask_bytes=st.sampled_from([0, 1, 11250]))
def test_static_layout_holds_for_any_geometry(nslots, batch, sample_bytes, max_objects,
                                              max_keypoints, mask_bytes):
    """Per-sample arrays in order, naturally aligned, disjoint, after the slot header;
    pixels and slots page-aligned; atomic words aligned; claims inside the header page."""
    L = _layout(nslots, batch, sample_bytes, max_objects, max_keypoints, mask_bytes)
    B, BM, BMK = batch, batch * max_objects, batch * max_objects * max_keypoints
    arrays = [("labels", 8 * B, 8), ("sample_ids", 8 * B, 8), ("status", B, 1),
              ("reason", B, 1), ("flip", B, 1), ("boxes", 16 * B, 16), ("shapes", 8 * B, 4),
              ("source_hw", 8 * B, 8), ("canvas_scale", 8 * B, 8), ("obj_count", 2 * B, 2),
              ("obj_boxes", 16 * BM, 16), ("obj_labels", 8 * BM, 8), ("obj_flags", BM, 1),
              ("obj_keypoints", 12 * BMK, 4), ("obj_masks", BM * mask_bytes, 1),
              ("pixels", sample_bytes * B, rg.PAGE)]
    end = _ring.SLOT_HEADER_BYTES
    for name, size, align in arrays:
        off = getattr(L, name)
        assert off >= end and off % align == 0, name
        end = off + size
    assert end <= L.slot_bytes and L.slot_bytes % rg.PAGE == 0
    assert L.total_bytes == rg.HEADER_BYTES + nslots * L.slot_bytes
    assert all(L.slot(i) % rg.PAGE == 0 for i in (0, nslots - 1, nslots))
    # the report area ends before the first array
    report_off, report_size, _ = _ring.SLOT_FIELDS["report"]
    assert report_off + report_size <= L.labels and report_size == REPORT_BYTES


def test_atomic_words_are_aligned_and_claims_fit_the_header():
    H, S = _ring.HEADER_FIELDS, _ring.SLOT_FIELDS
    assert H["closed"][1:] == (4, 4) and H["closed"][0] % 4 == 0        # futex word
    assert S["seq"] == (0, 4, 4)                                        # futex word, page-aligned
    assert H["next_ticket"][1:] == (8, 8) and H["next_ticket"][0] % 8 == 0
    off, size, width = H["claims"]
    assert off % 8 == 0 and width == 8 and size == 8 * MAX_WORKERS
    assert off + size <= rg.HEADER_BYTES == rg.PAGE
    assert S["ticket"][0] % 8 == 0


@pytest.mark.parametrize("geometry", [(0, 4, 8), (2, 0, 8), (2, 4, 2**63), (2**32, 1, 1),
                                      (2, 2**20, 2**44), (-1, 4, 8)])
def test_impossible_geometry_is_refused(geometry):
    """No slots, an empty batch, sizes that overflow size_t/off_t: ValueError, no segment."""
    with pytest.raises(ValueError, match="impossible ring geometry"):
        _ring.layout(*geometry)
    before = set(rh.segments(os.getpid())) | set(rh.ring_memory(os.getpid()))
    with pytest.raises(ValueError):
        Ring.create(*geometry)
    assert set(rh.segments(os.getpid())) | set(rh.ring_memory(os.getpid())) == before


def test_attach_refuses_another_layout_version():
    ring = Ring.create(2, 1, 8)
    try:
        off = _ring.HEADER_FIELDS["version"][0]
        np.frombuffer(ring.buf, np.uint32, 1, off)[0] = rg.VERSION + 1
        with pytest.raises(ValueError, match=f"version {rg.VERSION + 1}.*version {rg.VERSION}"):
            Ring.attach(ring.name)
    finally:
        ring.unlink()


# ---- the worker limit -----------------------------------------------------------------------
def test_worker_index_past_the_claim_words_is_refused():
    """Index MAX_WORKERS and beyond (504 used to land on slot 0's sequence word) is a
    ValueError naming the index and the limit, and writes nothing."""
    ring = Ring.create(2, 1, 8)
    try:
        before = bytes(ring.buf)
        for bad in (MAX_WORKERS, 504, 2**40, 2**70, -1):
            with pytest.raises(ValueError, match=rf"worker index {bad}\b.*{MAX_WORKERS} workers"):
                ring.set_claim(bad, 12345)
            with pytest.raises(ValueError, match=rf"worker index {bad}\b"):
                ring.claim(bad)
        assert bytes(ring.buf) == before
        assert ring.seq(0) == 0 and ring.seq(1) == 2
        ring.set_claim(MAX_WORKERS - 1, rg.CLAIM_PENDING)     # the last one is fine
        assert ring.claim(MAX_WORKERS - 1) == rg.CLAIM_PENDING and ring.claim(0) == 0
    finally:
        ring.unlink()


# ---- the failure-record codec ----------------------------------------------------------------
def _records(paths):
    return [Failure(i, rg.REASON_DECODE, p, f"message {i}: tab\there, newline\nthere")
            for i, p in enumerate(paths)]


def test_hostile_paths_round_trip():
    """Newline, tab, U+2028, non-UTF-8 bytes, 4096 bytes, empty: all come back exactly."""
    records = _records(HOSTILE)
    data, dropped = encode_failures(records)
    assert dropped == 0 and len(data) <= REPORT_BYTES
    back = decode_failures(data)
    assert back == records
    assert os.fsencode(back[3].path) == b"\xff\xfe.jpg"
    assert len(os.fsencode(back[4].path)) == 4096 and back[5].path == ""
    assert not any(r.clipped for r in back)


def test_hostile_paths_round_trip_through_a_slot():
    ring = Ring.create(2, 4, 8)
    try:
        records = _records(HOSTILE)
        assert ring.write_meta(3, 4, rg.ERR_NONE, len(records), records) == 0
        assert ring.read_meta(3) == (4, rg.ERR_NONE, len(records), records)
    finally:
        ring.unlink()


def _size(rec):
    body = fl._FAILURE.size + len(os.fsencode(rec.path)) + len(rec.message.encode())
    return -(-body // _ring.FAILURE_ALIGN) * _ring.FAILURE_ALIGN


@pytest.mark.parametrize("slack", [0, -1])
def test_truncation_drops_whole_records_and_counts_them(slack):
    """At a capacity that fits exactly k records (or one byte less), the first k (or
    k - 1) come back whole and every other is counted as dropped."""
    records = [Failure(i, rg.REASON_READ, f"/data/{'x' * (i * 37 % 90)}/{i}.jpg",
                       f"cannot read {i}") for i in range(40)]
    k = 13
    capacity = sum(_size(r) for r in records[:k]) + slack
    data, dropped = encode_failures(records, capacity)
    kept = k if slack == 0 else k - 1
    assert len(data) <= capacity
    assert decode_failures(data) == records[:kept]
    assert dropped == len(records) - kept


def test_more_records_than_a_slot_holds_keep_the_total():
    ring = Ring.create(2, 1, 8)
    try:
        records = [Failure(i, 1, "/p/" + "n" * 200 + str(i), "bad") for i in range(100)]
        dropped = ring.write_meta(0, 0, rg.ERR_NONE, 100, records)
        meta = ring.read_meta(0)
        assert dropped > 0 and len(meta.records) == 100 - dropped
        assert meta.failures == 100 and meta.records == records[:100 - dropped]
    finally:
        ring.unlink()


def test_an_overlong_record_is_clipped_to_fit_with_a_mark():
    """A path and message longer than the whole area are cut in the middle, marked
    and flagged; the file name and the end of a traceback survive."""
    path = "/" + "/".join(["deep"] * 3000) + "/name\u00e9.jpg"
    message = "Traceback (most recent call last):\n" + "  frame\n" * 2000 + "ValueError: boom"
    data, dropped = encode_failures([Failure(7, 1, path, message)], REPORT_BYTES)
    (rec,) = decode_failures(data)
    assert dropped == 0 and len(data) <= REPORT_BYTES and rec.clipped
    assert rec.sample_id == 7 and "[...]" in rec.path and "[...]" in rec.message
    assert rec.path.startswith("/deep/") and rec.path.endswith("/name\u00e9.jpg")
    assert rec.message.startswith("Traceback") and rec.message.endswith("ValueError: boom")


def test_too_small_an_area_drops_everything():
    data, dropped = encode_failures(_records(["a", "b"]), fl._FAILURE.size - 1)
    assert (data, dropped) == (b"", 2)


def test_worker_traceback_record():
    """An ERR_WORKER slot carries one record with no sample id; read_meta gives it back."""
    ring = Ring.create(2, 1, 8)
    try:
        tb = "worker 3 (pid 1):\nTraceback ...\nLookupError: nope"
        ring.write_meta(1, 0, rg.ERR_WORKER, 0, [Failure(NO_SAMPLE, 0, "", tb)])
        assert ring.read_meta(1) == (0, rg.ERR_WORKER, 0, [Failure(NO_SAMPLE, 0, "", tb)])
    finally:
        ring.unlink()


def test_corrupt_record_bytes_are_refused():
    data, _ = encode_failures(_records(["a.jpg"]))
    with pytest.raises(ValueError, match="cut short"):
        decode_failures(data + b"\x01\x02")
    with pytest.raises(ValueError, match="claims"):
        decode_failures(data[:fl._FAILURE.size + 1])
    with pytest.raises(TypeError):
        encode_failures([b"not a record"])


_paths = st.binary(max_size=200).map(os.fsdecode)
_text = st.text(st.characters(exclude_categories=()), max_size=200)   # surrogates too
_failures = st.builds(Failure, st.integers(0, 2**64 - 1), st.integers(0, 255), _paths, _text)


@settings(max_examples=300, deadline=None)
@given(st.lists(_failures, max_size=20))
def test_round_trip_property(records):
    """With room for all, any records come back equal (paths byte for byte)."""
    data, dropped = encode_failures(records, sum(_size_any(r) for r in records))
    back = decode_failures(data)
    assert dropped == 0 and back == records
    assert [os.fsencode(r.path) for r in back] == [os.fsencode(r.path) for r in records]


def _size_any(rec):
    body = fl._FAILURE.size + len(os.fsencode(rec.path)) + len(
        rec.message.encode("utf-8", "surrogatepass"))
    return -(-body // _ring.FAILURE_ALIGN) * _ring.FAILURE_ALIGN


@settings(max_examples=300, deadline=None)
@given(st.lists(_failures, max_size=20), st.integers(0, 1500))
def test_truncation_property(records, capacity):
    """Any capacity: within it, a prefix of the records (clipped ones flagged), the
    rest counted as dropped."""
    data, dropped = encode_failures(records, capacity)
    back = decode_failures(data)
    assert len(data) <= capacity and len(back) + dropped == len(records)
    for got, want in zip(back, records):
        if got.clipped:
            assert (got.sample_id, got.reason) == (want.sample_id, want.reason)
            assert _size_any(got) <= capacity
        else:
            assert got == want


# ---- end to end: hostile names through a Loader ------------------------------------------------
@pytest.mark.parametrize("mode", ["thread", "process"])
def test_loader_names_hostile_paths_exactly(mode):
    """Bad samples named with hostile paths: under on_error='replace' the run completes,
    each failure warns once carrying its exact path (shown escaped when it has control
    characters), and the stats count them all."""
    good = eh.photo_jpegs(17, 24, 32)
    blobs = [b"this is not an image " + bytes([i]) for i in range(len(HOSTILE))] + good
    names = HOSTILE + [f"/good/{i}.jpg" for i in range(len(good))]
    src = en.Samples(blobs, labels=np.arange(len(blobs)), names=names)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with en.Loader(src, batch_size=4, image_size=16, workers=2, worker_mode=mode,
                       on_error="replace", seed=5) as ld:
            batches = [b.copy() for b in ld]
            stats = ld.stats()
    every = [w.message for w in caught if issubclass(w.category, en.SampleFailureWarning)]
    warned = [w for w in every if w.failure is not None]    # one per failed file
    summaries = [str(w) for w in every if w.failure is None]  # one per epoch with failures
    assert summaries == [f"epoch 0: {len(HOSTILE)} sample(s) failed (decode {len(HOSTILE)}), "
                         "replaced; totals in stats()['failures']"]
    assert sorted((w.failure.path for w in warned), key=os.fsencode) == \
        sorted(HOSTILE, key=os.fsencode)
    for w in warned:
        text, path = str(w), w.failure.path
        assert w.failure.sample_id == names.index(path) and not w.failure.clipped
        assert (path if path and path.isprintable() else repr(path)) in text
        assert "replaced" in text
        assert "\n" not in text and "\u2028" not in text
    assert stats["failures"] == {"decode": len(HOSTILE)}
    assert sum(len(b) for b in batches) == len(src) and stats["fresh"] == len(good)
    delivered = np.concatenate([b.sample_ids for b in batches])
    assert not set(delivered.tolist()) & set(range(len(HOSTILE)))


def test_loader_raises_for_a_hostile_path_exactly():
    """on_error='raise': DecodeError whose path is the exact hostile name."""
    name = os.fsdecode(b"evil\n\xff\tname.jpg")
    src = en.Samples([b"garbage"] + eh.photo_jpegs(3, 24, 32), names=[name, "a", "b", "c"])
    with en.Loader(src, batch_size=4, image_size=16, workers=1, worker_mode="thread",
                   on_error="raise", shuffle=False) as ld, warnings.catch_warnings():
        warnings.simplefilter("ignore", en.SampleFailureWarning)
        with pytest.raises(en.DecodeError) as ei:
            ld.next_batch()
    assert ei.value.path == name

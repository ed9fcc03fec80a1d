"""Fuzzing what ParquetImages reads before any image: a Parquet file's footer (the
Thrift metadata: schema, row groups, column chunks and their offsets), its length
word and magic, the Hugging Face schema metadata, and the column chunks a row group
read decodes.

Each input is a small valid file (the hub's layout, several row groups) with bit
flips, overwrites or a truncation, chosen by hypothesis (derandomised: the same
inputs every run).  Whatever the bytes, opening it must either give a source whose
every sample reads as bytes or fails as that sample's error, or raise one clear
error that names the file; never another exception type, a hang or a crash.  The
default run fuzzes a fifth of the budget; ``python -m pytest -m slow`` all of it.
"""
from __future__ import annotations

import io
import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import echo_native as en  # noqa: E402

SCALE = float(os.environ.get("ECHO_NATIVE_FUZZ_SCALE", "1"))
QUICK = 5
#: What a bad file may raise: a refusal that names it (ValueError, the OSError family
#: for reads, TypeError for a schema of the wrong kinds), or DecodeError.
CLEAR = (ValueError, OSError, TypeError, en.DecodeError)


def _settings(n):
    return settings(max_examples=max(1, int(n * SCALE)), deadline=None, database=None,
                    derandomize=True, suppress_health_check=list(HealthCheck))


def _fuzz(n, **strategies):
    def make(body):
        quick = _settings(max(1, n // QUICK))(given(**strategies)(body))
        full = pytest.mark.slow(_settings(n)(given(**strategies)(body)))
        return quick, full
    return make


def _seed_file():
    """A file of 8 tiny JPEGs in the hub's layout: struct image column, ClassLabel
    metadata, row groups of 3."""
    from PIL import Image

    blobs = []
    for i in range(8):
        buf = io.BytesIO()
        Image.new("RGB", (12 + i, 10), (30 * i, 90, 200 - 20 * i)).save(buf, "JPEG")
        blobs.append(buf.getvalue())
    image = pa.array([{"bytes": b, "path": f"img_{i}.jpg"} for i, b in enumerate(blobs)],
                     pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    table = pa.table({"image": image, "label": pa.array(np.arange(8) % 2, pa.int64())})
    meta = b'{"info": {"features": {"image": {"_type": "Image"}, "label": {"names": ' \
           b'["a", "b"], "_type": "ClassLabel"}}}}'
    table = table.replace_schema_metadata({b"huggingface": meta})
    out = io.BytesIO()
    pq.write_table(table, out, row_group_size=3)
    return out.getvalue()


SEED = _seed_file()
FOOTER_LEN = struct.unpack("<I", SEED[-8:-4])[0]
FOOTER_AT = len(SEED) - 8 - FOOTER_LEN


def _open_and_read(path):
    """Open ``path`` and read every sample: the reads that failed, by their error."""
    try:
        src = en.ParquetImages(path)
    except CLEAR as e:
        assert str(path) in str(e) or "Parquet" in str(e), e
        return None
    failed = 0
    for i in range(len(src)):
        try:
            data = src.read(i)
        except CLEAR:
            failed += 1
            continue
        assert len(memoryview(data).cast("B")) >= 0
    assert len(src.labels) == len(src)
    return failed


footer_flips = st.lists(st.tuples(st.integers(0, FOOTER_LEN + 7), st.integers(0, 7)),
                        min_size=1, max_size=8)


@_fuzz(400, flips=footer_flips)
def _footer_bit_flips(tmp_path_factory, flips):
    data = bytearray(SEED)
    for at, bit in flips:
        data[FOOTER_AT + at] ^= 1 << bit
    path = tmp_path_factory.mktemp("fz") / "flip.parquet"
    path.write_bytes(bytes(data))
    _open_and_read(path)


test_footer_bit_flips, test_footer_bit_flips_full = _footer_bit_flips


@_fuzz(200, at=st.integers(0, len(SEED)), junk=st.binary(min_size=1, max_size=16))
def _overwrites(tmp_path_factory, at, junk):
    data = bytearray(SEED)
    data[at:at + len(junk)] = junk
    path = tmp_path_factory.mktemp("fz") / "over.parquet"
    path.write_bytes(bytes(data[:len(SEED) + 16]))
    _open_and_read(path)


test_overwrites, test_overwrites_full = _overwrites


@_fuzz(150, cut=st.integers(0, len(SEED) - 1))
def _truncations(tmp_path_factory, cut):
    path = tmp_path_factory.mktemp("fz") / "cut.parquet"
    path.write_bytes(SEED[:cut])
    with pytest.raises(CLEAR):
        en.ParquetImages(path)     # the footer is gone (or its length word lies)


test_truncations, test_truncations_full = _truncations


@_fuzz(150, length=st.integers(0, 2**32 - 1))
def _footer_length_word(tmp_path_factory, length):
    data = bytearray(SEED)
    data[-8:-4] = struct.pack("<I", length)
    path = tmp_path_factory.mktemp("fz") / "len.parquet"
    path.write_bytes(bytes(data))
    failed = _open_and_read(path)
    if length == FOOTER_LEN:
        assert failed == 0


test_footer_length_word, test_footer_length_word_full = _footer_length_word


def test_the_seed_file_reads_whole(tmp_path):
    """The unmutated seed is a good source: every sample, no failure (so the fuzz tests
    start from a file that works)."""
    path = tmp_path / "seed.parquet"
    path.write_bytes(SEED)
    assert _open_and_read(path) == 0
    src = en.ParquetImages(path)
    assert len(src) == 8 and src.classes == ["a", "b"]


def test_any_arrow_error_of_a_footer_is_the_files_refusal(tmp_path, monkeypatch):
    """A footer flip the fuzzing found (one bit in the Arrow schema's Thrift) makes pyarrow
    raise ArrowNotImplementedError, which is neither a ValueError nor an OSError: every
    Arrow error of a footer is the file's refusal, by name."""
    path = tmp_path / "odd.parquet"
    path.write_bytes(SEED)

    class Refusing:
        def __init__(self, *args, **kwargs):
            raise pa.ArrowNotImplementedError("Integers with more than 64 bits not implemented")

    monkeypatch.setattr(pq, "ParquetFile", Refusing)
    with pytest.raises(ValueError, match=rf"{path}: not a Parquet file pyarrow can read "
                                         rf"\(Integers with more than 64 bits"):
        en.ParquetImages(path)

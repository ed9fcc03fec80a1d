"""ParquetImages over plain HTTP(S): a URL names one Parquet file, read by range (the
footer, then one request per row group), from a real HTTP/1.1 server on localhost with
Range support (tests/robustness/test_attacks_io.py's), and a server that ignores Range.
"""
from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("aiohttp", reason="fsspec's HTTP filesystem needs aiohttp")

import echo_native as en  # noqa: E402
from echo_native.remote import RemoteOptions  # noqa: E402

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))
import sources_helpers as sh  # noqa: E402
from robustness.test_attacks_io import QUICK, Server, endless  # noqa: E402

pytestmark = pytest.mark.timeout(120)
N, GROUP = 12, 4


@pytest.fixture(scope="module")
def parquet():
    """12 photo JPEGs in the hub's layout, row groups of 4, as bytes; and the JPEGs."""
    blobs = sh.photo_jpegs(N, 400, 480, seed=17, quality=95)   # well over the tail reads
    image = pa.array([{"bytes": b, "path": f"img_{i}.jpg"} for i, b in enumerate(blobs)],
                     pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    table = pa.table({"image": image, "label": pa.array(np.arange(N) % 3, pa.int64())})
    out = io.BytesIO()
    pq.write_table(table, out, row_group_size=GROUP)
    return out.getvalue(), blobs


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


def test_a_url_is_one_file_read_by_range(server, parquet):
    """Every sample's bytes as written, labels from the column; the file is never read
    whole: each row group is one ranged GET, read once."""
    data, blobs = parquet
    server.files["/data/train.parquet"] = data
    src = en.ParquetImages(server.url("/data/train.parquet"),
                           remote=RemoteOptions(prefetch=0))
    assert len(src) == N and list(src.labels) == list(np.arange(N) % 3)
    assert [bytes(src.read(i)) for i in range(N)] == blobs
    gets = server.requests[("GET", "/data/train.parquet")]
    # At construction the footer and each row group's label chunk (a read of 64 KiB at
    # most each), then one read per row group for its images: never a GET per sample,
    # never the file twice.
    groups = N // GROUP
    assert len(data) > 2 * (1 + groups) * 64 * 1024
    assert gets <= 1 + 2 * groups, gets
    assert server.sent["/data/train.parquet"] <= len(data) + (1 + groups) * 64 * 1024


def test_a_missing_url_is_named(server):
    with pytest.raises(FileNotFoundError, match=r"/data/none\.parquet"):
        en.ParquetImages(server.url("/data/none.parquet"), remote=QUICK)


def test_a_server_that_ignores_range_is_refused_not_streamed(server):
    """A server that answers every range with an endless 200 must not be read into
    memory: the file fails by name within the budget."""
    server.routes["/data/endless.parquet"] = endless(1 << 40)
    with pytest.raises((ValueError, OSError)) as err:
        en.ParquetImages(server.url("/data/endless.parquet"), remote=QUICK)
    assert "endless.parquet" in str(err.value)

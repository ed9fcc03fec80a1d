"""Damaged tar shards and hostile ``.idx`` sidecars, reproduced on real files.

A shard cut short (inside a member header, inside a member's data, between members)
keeps every sample complete before the cut and says once, with the shard's name and
the byte offset, where the damage is.  A sidecar is checked against its shard before
it is used: too large for the shard, nested past the parser's stack, more entries
than the shard has room for, entries outside the shard, off the 512-byte grid or
overlapping all fall back to a scan of the shard, with a warning saying why.
"""
from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tarfile
import warnings
from pathlib import Path

import pytest

import echo_native as en
from echo_native import tarindex

HERE = Path(__file__).resolve().parent.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import sources_helpers as sh  # noqa: E402

pytestmark = pytest.mark.timeout(120)

N = 8


@pytest.fixture(scope="module")
def jpegs():
    return sh.photo_jpegs(20, seed=41)


def write_shard(path, blobs, labels=None):
    """A shard of ``<key>.jpg`` + ``<key>.cls`` per sample; returns {member name: TarInfo}."""
    labels = list(range(len(blobs))) if labels is None else labels
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i, (blob, label) in enumerate(zip(blobs, labels)):
            for name, data in ((f"{i:06d}.jpg", blob), (f"{i:06d}.cls", str(label).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    with tarfile.open(path) as tar:
        return {m.name: m for m in tar.getmembers()}


def damage_warnings(caught, shard):
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
            and f"tar shard {shard} is damaged" in str(w.message)]


def load(paths):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tar = en.TarShards([str(p) for p in paths])
    return tar, caught


# ---- 12: truncated shards --------------------------------------------------------------------
@pytest.mark.parametrize("where, kept", [
    ("header of 000005.jpg", 5),     # cut inside a member header
    ("data of 000005.jpg", 5),       # cut inside a member's data
    ("header of 000004.cls", 4),     # the image is whole, its label is cut: left out
    ("end of 000007.cls", 8),        # every member whole, the end-of-archive blocks gone
])
def test_a_cut_shard_keeps_every_complete_sample_and_says_where(tmp_path, jpegs, where, kept):
    """A shard cut short keeps every sample complete before the cut, and one warning names
    the shard and the byte offset of the damage; the other shards are untouched."""
    shard = tmp_path / "cut.tar"
    members = write_shard(shard, jpegs[:N])
    other = tmp_path / "whole.tar"
    write_shard(other, jpegs[N:N + 4])
    part, name = where.split(" of ")
    m = members[name]
    cut = {"header": m.offset + 100, "data": m.offset_data + m.size // 2,
           "end": m.offset_data + -(-m.size // 512) * 512}[part]
    os.truncate(shard, cut)
    tar, caught = load([shard, other])
    msgs = damage_warnings(caught, shard)
    assert len(msgs) == 1, [str(w.message) for w in caught]
    at = {"header": m.offset, "data": m.offset, "end": cut}[part]
    assert f"damaged at byte {at:,}" in msgs[0]
    assert f"its {kept} complete sample(s) before that are kept" in msgs[0]
    names = [tar.describe(i) for i in range(len(tar))]
    assert names == [f"{shard}:{k:06d}" for k in range(kept)] + \
        [f"{other}:{k:06d}" for k in range(4)]
    assert [tar.read(i) for i in range(kept)] == jpegs[:kept]
    assert tar.labels.tolist() == list(range(kept)) + [0, 1, 2, 3]


def test_a_cut_shard_trains(tmp_path, jpegs):
    """A Loader over a cut shard delivers its complete samples, every one once."""
    shard = tmp_path / "cut.tar"
    members = write_shard(shard, jpegs[:N])
    os.truncate(shard, members["000006.jpg"].offset_data + 10)
    with pytest.warns(RuntimeWarning, match="is damaged at byte"):
        tar = en.TarShards([shard])
    with en.Loader(tar, 3, image_size=16, workers=1, worker_mode="thread") as ld:
        ids = sorted(int(i) for b in ld for i in b.sample_ids)
        assert not ld.stats()["failures"]
    assert ids == list(range(6))


def test_damage_is_kept_with_the_index(tmp_path, jpegs):
    """write_index on a cut shard records the damage in the sidecar: a later load from
    the sidecar warns the same way (the damage is not forgotten)."""
    shard = tmp_path / "cut.tar"
    members = write_shard(shard, jpegs[:N])
    os.truncate(shard, members["000003.jpg"].offset + 7)
    with pytest.warns(RuntimeWarning, match="damaged at byte"):
        en.TarShards([shard], write_index=True)
    doc = json.loads((tmp_path / "cut.tar.idx").read_bytes())
    assert doc["damage"][0] == members["000003.jpg"].offset
    tar, caught = load([shard])
    assert len(damage_warnings(caught, shard)) == 1 and len(tar) == 3


def test_a_garbage_header_is_damage_not_a_silent_end(tmp_path, jpegs):
    """A member header overwritten with junk (bad checksum) ends the shard there, said."""
    shard = tmp_path / "junk.tar"
    members = write_shard(shard, jpegs[:N])
    at = members["000004.jpg"].offset
    with open(shard, "r+b") as f:
        f.seek(at)
        f.write(b"\xff" * 512)
    tar, caught = load([shard])
    msgs = damage_warnings(caught, shard)
    assert len(msgs) == 1 and f"at byte {at:,}" in msgs[0] and "invalid member header" in msgs[0]
    assert len(tar) == 4


def test_a_whole_shard_is_not_called_damaged(tmp_path, jpegs):
    """A complete shard (tarfile's own padding to a record) gives no warning."""
    shard = tmp_path / "ok.tar"
    write_shard(shard, jpegs[:N])
    tar, caught = load([shard])
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(tar) == N


# ---- 13: hostile sidecars ----------------------------------------------------------------------
@pytest.fixture
def shard20(tmp_path, jpegs):
    shard = tmp_path / "s.tar"
    write_shard(shard, jpegs[:20])
    return shard, tarindex.scan_file(shard)


def _check_fallback(shard, truth, why):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tar = en.TarShards([shard])
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and msgs[0].startswith(f"{shard}.idx: ") and \
        "scanning the shard instead" in msgs[0], msgs
    assert re.search(why, msgs[0]), msgs[0]
    assert [tar.describe(i).rsplit(":", 1)[1] for i in range(len(tar))] == truth.keys
    assert tar._offset.tolist() == truth.offsets and tar.labels.tolist() == truth.labels
    return tar


def _entries(truth):
    return [[k, o, s, lab] for k, o, s, lab in
            zip(truth.keys, truth.offsets, truth.sizes, truth.labels)]


def _sidecar(shard, truth, members, **extra):
    doc = {"format": tarindex.FORMAT, "version": tarindex.VERSION,
           "shard_bytes": truth.shard_bytes, "members": members, **extra}
    Path(f"{shard}.idx").write_text(json.dumps(doc))


def test_a_deeply_nested_sidecar_falls_back_to_a_scan(shard20):
    """'[[[[...' nested 200,000 deep: not a RecursionError, a warning and a scan."""
    shard, truth = shard20
    Path(f"{shard}.idx").write_text("[" * 200_000 + "]" * 200_000)
    _check_fallback(shard, truth, "nested too deeply")


def test_a_huge_sidecar_is_not_read(shard20):
    """A 1 GiB sidecar (sparse) next to a 60 KB shard is refused by its size after reading
    at most the limit: the process grows by far less than the file."""
    shard, truth = shard20
    with open(f"{shard}.idx", "wb") as f:
        f.truncate(2**30)
    code = ("import resource, sys, warnings, echo_native as en\n"
            "warnings.simplefilter('ignore')\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "t = en.TarShards([sys.argv[1]])\n"
            "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "print(len(t), (after - before) // 1024)\n")
    out = subprocess.run([sys.executable, "-c", code, str(shard)], capture_output=True,
                         text=True, timeout=100, check=True, cwd=HERE.parent).stdout.split()
    assert int(out[0]) == 20
    assert int(out[1]) < 64, f"grew by {out[1]} MiB reading the sidecar"
    _check_fallback(shard, truth, r"index file over [\d,]+ bytes")


def test_a_million_entry_sidecar_is_refused(shard20):
    """1,000,000 entries for a 20-member shard: refused (too large for the shard), scanned."""
    shard, truth = shard20
    entries = ",".join(f'["{k:07d}",{512 * (2 * k + 1)},1,0]' for k in range(1_000_000))
    Path(f"{shard}.idx").write_text(
        f'{{"format":"{tarindex.FORMAT}","version":{tarindex.VERSION},'
        f'"shard_bytes":{truth.shard_bytes},"members":[{entries}]}}')
    _check_fallback(shard, truth, r"index file over [\d,]+ bytes, more than any index")


def test_more_entries_than_the_shard_has_room_for(shard20):
    """Under the size limit but more entries than headers fit in the shard: refused."""
    shard, truth = shard20
    room = truth.shard_bytes // 512
    members = [[f"{k:07d}", 512, 1, 0] for k in range(room + 1)]
    _sidecar(shard, truth, members)
    _check_fallback(shard, truth, f"lists {room + 1:,} members, a shard of")


@pytest.mark.parametrize("change, why", [
    (lambda e: e[3].__setitem__(1, e[3][1] + 1), "out of range"),           # off the grid
    (lambda e: e[3].__setitem__(1, 0), "out of range"),                     # before any header
    (lambda e: e[3].__setitem__(2, 10**9), "out of range"),                 # past the end
    (lambda e: e[4].__setitem__(1, e[3][1]), "overlap"),                    # two on one spot
    (lambda e: e[5].__setitem__(0, e[4][0]), "sorted by key, or a key listed twice"),
    (lambda e: e[2].__setitem__(3, 2**63), "out of range"),                 # label too big
])
def test_a_sidecar_that_does_not_fit_its_shard_is_refused(shard20, change, why):
    """Entries outside the shard, off the 512-byte grid, overlapping or repeated: refused,
    the shard scanned."""
    shard, truth = shard20
    members = _entries(truth)
    change(members)
    _sidecar(shard, truth, members)
    _check_fallback(shard, truth, why)


def test_a_valid_sidecar_is_used(shard20):
    """The checks accept what make-shards writes (and the scan agrees with it)."""
    shard, truth = shard20
    Path(f"{shard}.idx").write_bytes(truth.to_json())
    tar, caught = load([shard])
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert tar._offset.tolist() == truth.offsets

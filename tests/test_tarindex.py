"""The tar shard index (``echo_native.tarindex``) as a unit: scanning a shard's headers for
image members and their labels, the ``.idx`` sidecar's format and the checks that tie it
to its shard, and the sidecar's atomic write.

Shards are real tar files written with the standard library's ``tarfile``, holding JPEGs
cut from real photographs.  Cut and hostile shards and sidecars as ``TarShards`` meets
them are in ``robustness/test_attacks_io_tar.py``; the shard writer in ``test_shards.py``.
"""
from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from pathlib import Path

import pytest

from echo_native import tarindex
from echo_native.tarindex import TarIndex

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import sources_helpers as sh  # noqa: E402

BLOCK = 512


@pytest.fixture(scope="module")
def jpegs():
    return sh.photo_jpegs(6, seed=17)


def write_tar(path, members, fmt=tarfile.USTAR_FORMAT):
    """A tar of ``members``, (name, bytes) pairs or ready TarInfos (no data), in order."""
    with tarfile.open(path, "w", format=fmt) as tar:
        for m in members:
            if isinstance(m, tarfile.TarInfo):
                tar.addfile(m)
                continue
            name, data = m
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))
    return path


def members_of(path):
    with tarfile.open(path) as tar:
        return {m.name: m for m in tar.getmembers()}


def entries(index):
    return list(zip(index.keys, index.offsets, index.sizes, index.labels))


def sidecar_doc(shard_bytes, members, **extra):
    doc = {"format": tarindex.FORMAT, "version": tarindex.VERSION,
           "shard_bytes": shard_bytes, "members": members, **extra}
    return json.dumps(doc).encode()


# ---- scanning a shard ------------------------------------------------------------------
def test_scan_lists_images_sorted_by_key_with_the_byte_range_of_their_data(tmp_path, jpegs):
    """Keys come sorted whatever the archive order, each with the offset and size of its
    image's data: those bytes of the shard are exactly the member's."""
    shard = write_tar(tmp_path / "s.tar", [("c.jpg", jpegs[0]), ("c.cls", b"2"),
                                           ("a.jpg", jpegs[1]), ("a.cls", b"0"),
                                           ("b.jpg", jpegs[2]), ("b.cls", b"1")])
    index = tarindex.scan_file(shard)
    assert index.keys == ["a", "b", "c"] and len(index) == 3
    assert index.labels == [0, 1, 2]
    assert index.shard_bytes == os.path.getsize(shard) and index.damage is None
    data = shard.read_bytes()
    assert [data[o:o + n] for o, n in zip(index.offsets, index.sizes)] == \
        [jpegs[1], jpegs[2], jpegs[0]]
    tar = members_of(shard)
    assert index.offsets == [tar[f"{k}.jpg"].offset_data for k in index.keys]


def test_every_image_extension_counts_in_any_case_and_nothing_else(tmp_path, jpegs):
    """Each of IMAGE_EXTS, lower or upper case, is a sample's image; .txt, .json, a name
    that only starts like an image's and a name without an extension are not."""
    images = [(f"k{i}{ext.upper() if i % 2 else ext}", jpegs[i % len(jpegs)])
              for i, ext in enumerate(tarindex.IMAGE_EXTS)]
    others = [("n.txt", b"x"), ("n.json", b"{}"), ("m.jpgx", jpegs[0]), ("plain", jpegs[0])]
    shard = write_tar(tmp_path / "s.tar", images + others)
    index = tarindex.scan_file(shard)
    assert index.keys == sorted(f"k{i}" for i in range(len(tarindex.IMAGE_EXTS)))
    assert ".jpg" in tarindex.IMAGE_EXTS and ".webp" in tarindex.IMAGE_EXTS


def test_a_key_is_the_name_less_its_last_extension(tmp_path, jpegs):
    """Dots inside a name and folders stay in the key: ``a.b.jpg`` pairs with ``a.b.cls``,
    ``d/k.jpg`` with ``d/k.cls``."""
    shard = write_tar(tmp_path / "s.tar", [("a.b.jpg", jpegs[0]), ("a.b.cls", b"5"),
                                           ("d/k.jpg", jpegs[1]), ("d/k.cls", b"6")])
    index = tarindex.scan_file(shard)
    assert list(zip(index.keys, index.labels)) == [("a.b", 5), ("d/k", 6)]


def test_labels_pair_with_their_image_by_key_in_any_order(tmp_path, jpegs):
    """A .cls (any case, surrounding whitespace allowed, before or after its image) is the
    label of the image with its key; an image without one gets -1; a .cls without an image
    makes no sample."""
    shard = write_tar(tmp_path / "s.tar", [
        ("a.cls", b"  7\n"), ("a.jpg", jpegs[0]),
        ("b.jpg", jpegs[1]), ("b.CLS", b"-3"),
        ("c.jpg", jpegs[2]),
        ("lonely.cls", b"9"),
        ("e.jpg", jpegs[3]), ("e.cls", str(2**63 - 1).encode()),
        ("f.jpg", jpegs[4]), ("f.cls", str(-2**63).encode()),
    ])
    index = tarindex.scan_file(shard)
    assert dict(zip(index.keys, index.labels)) == {"a": 7, "b": -3, "c": -1, "e": 2**63 - 1,
                                                   "f": -2**63}


def test_several_images_under_one_key_keep_the_last(tmp_path, jpegs):
    """``k.jpg`` then ``k.png``: one sample, the later member's data."""
    shard = write_tar(tmp_path / "s.tar", [("k.jpg", jpegs[0]), ("k.png", jpegs[1]),
                                           ("k.cls", b"1")])
    index = tarindex.scan_file(shard)
    assert index.keys == ["k"]
    assert index.offsets == [members_of(shard)["k.png"].offset_data]
    assert index.sizes == [len(jpegs[1])]


@pytest.mark.parametrize("label", [b"dog", b"1.5", b"", str(2**63).encode(),
                                   str(-2**63 - 1).encode(), b"7" * 300])
def test_a_label_that_is_not_a_64_bit_integer_names_the_shard_and_member(tmp_path, jpegs,
                                                                         label):
    """A .cls that is not an integer, out of int64's range, empty or longer than any label
    is a ValueError naming the shard and ``<key>.cls``."""
    shard = write_tar(tmp_path / "s.tar", [("ok.jpg", jpegs[0]), ("ok.cls", b"1"),
                                           ("bad.jpg", jpegs[1]), ("bad.cls", label)])
    with pytest.raises(ValueError, match=rf"{shard}: bad\.cls holds .*not a 64-bit integer"):
        tarindex.scan_file(shard)


def test_directories_and_links_named_like_images_are_not_samples(tmp_path, jpegs):
    """A directory ``d.jpg/``, a symbolic and a hard link ``*.jpg`` are skipped (they hold no
    image bytes), and do not shift the real members' offsets."""
    folder = tarfile.TarInfo("d.jpg")
    folder.type = tarfile.DIRTYPE
    sym = tarfile.TarInfo("s.jpg")
    sym.type, sym.linkname = tarfile.SYMTYPE, "real.jpg"
    hard = tarfile.TarInfo("h.jpg")
    hard.type, hard.linkname = tarfile.LNKTYPE, "real.jpg"
    shard = write_tar(tmp_path / "s.tar", [folder, ("real.jpg", jpegs[0]), sym, hard,
                                           ("z.jpg", jpegs[1])])
    index = tarindex.scan_file(shard)
    tar = members_of(shard)
    assert index.keys == ["real", "z"]
    assert index.offsets == [tar["real.jpg"].offset_data, tar["z.jpg"].offset_data]


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_long_names_in_extended_headers_keep_exact_offsets(tmp_path, jpegs, fmt):
    """Names over ustar's 100 bytes take extra header blocks (PAX or GNU): the index still
    points at each image's first data byte."""
    long = "x" * 180
    shard = write_tar(tmp_path / "s.tar", [(f"{long}0.jpg", jpegs[0]), (f"{long}0.cls", b"4"),
                                           (f"{long}1.jpg", jpegs[1])], fmt=fmt)
    index = tarindex.scan_file(shard)
    data = shard.read_bytes()
    assert index.keys == [f"{long}0", f"{long}1"] and index.labels == [4, -1]
    assert [data[o:o + n] for o, n in zip(index.offsets, index.sizes)] == jpegs[:2]
    assert all(o % BLOCK == 0 and o > BLOCK for o in index.offsets)


def test_a_name_that_is_not_utf8_keeps_its_bytes_through_the_sidecar(tmp_path, jpegs):
    """A member name with a byte that is not UTF-8 becomes a key with a surrogate escape,
    and the sidecar (pure ASCII) gives the very same key back."""
    shard = write_tar(tmp_path / "s.tar", [("k\udcff.jpg", jpegs[0]), ("k\udcff.cls", b"3")])
    assert b"k\xff.jpg" in shard.read_bytes()
    index = tarindex.scan_file(shard)
    assert index.keys == ["k\udcff"] and index.labels == [3]
    text = index.to_json()
    text.decode("ascii")
    assert TarIndex.from_json(text, index.shard_bytes).keys == ["k\udcff"]


@pytest.mark.parametrize("blob", [b"", b"hello, not a tar" * 64])
def test_what_is_not_a_tar_is_a_value_error_naming_it(jpegs, blob):
    """An empty file, text, or a JPEG where a shard belongs: ValueError naming the shard."""
    for data in (blob, jpegs[0]):
        with pytest.raises(ValueError, match=r"tar shard 'shard-7' is not a readable tar"):
            tarindex.scan(io.BytesIO(data), "shard-7", len(data))


def test_a_tar_with_no_members_is_an_empty_whole_index():
    """Only end-of-archive blocks: no samples, and no damage."""
    data = b"\0" * 10 * BLOCK
    index = tarindex.scan(io.BytesIO(data), "empty", len(data))
    assert len(index) == 0 and index.damage is None and index.shard_bytes == len(data)


# ---- what a damaged shard yields -----------------------------------------------------------
@pytest.fixture
def three(tmp_path, jpegs):
    """A shard of three samples a, b, c (image then label), and its members."""
    shard = write_tar(tmp_path / "s.tar", [(f"{k}.jpg", jpegs[i]) if j == 0
                                           else (f"{k}.cls", str(i).encode())
                                           for i, k in enumerate("abc") for j in (0, 1)])
    return shard, members_of(shard)


def _scan_cut(shard, length):
    data = shard.read_bytes()[:length]
    return tarindex.scan(io.BytesIO(data), "cut", len(data))


def test_a_shard_cut_at_a_member_boundary_keeps_all_and_says_the_end_is_missing(three):
    """Cut right after the last member's data: every sample kept, the damage at the cut,
    saying the end-of-archive blocks are missing."""
    shard, m = three
    last = m["c.cls"]
    cut = last.offset_data + BLOCK  # one data block: the label
    index = _scan_cut(shard, cut)
    assert index.keys == ["a", "b", "c"] and index.labels == [0, 1, 2]
    assert index.damage[0] == cut and "without its end-of-archive blocks" in index.damage[1]


def test_a_shard_cut_inside_a_header_says_how_much_of_it_is_there(three):
    """Cut 100 bytes into b's image header: a kept, the damage at that header, with the
    bytes of it found and the shard's size."""
    shard, m = three
    at = m["b.jpg"].offset
    index = _scan_cut(shard, at + 100)
    assert index.keys == ["a"]
    why = f"the shard ends inside a member header (100 of {BLOCK} bytes, shard of {at + 100} bytes)"
    assert index.damage == (at, why)


def test_data_running_past_the_end_names_the_member_and_the_byte(three):
    """Cut inside c's image data: a and b kept; the damage at c's header, naming the member
    and where its data would end."""
    shard, m = three
    c = m["c.jpg"]
    cut = c.offset_data + c.size // 2
    index = _scan_cut(shard, cut)
    assert index.keys == ["a", "b"]
    why = (f"member 'c.jpg' runs to byte {c.offset_data + c.size}, past the end of the shard "
           f"({cut} bytes)")
    assert index.damage == (c.offset, why)


def test_a_sample_whose_label_is_cut_is_left_out_with_its_whole_image(three):
    """Cut inside c's label: c's image is whole, but c is left out (its label may be what
    was lost); a and b are kept."""
    shard, m = three
    index = _scan_cut(shard, m["c.cls"].offset_data)
    assert index.keys == ["a", "b"] and index.damage[0] == m["c.cls"].offset


def test_a_junk_header_ends_the_index_there(three):
    """b's image header overwritten with junk: a kept, the damage at that header."""
    shard, m = three
    data = bytearray(shard.read_bytes())
    at = m["b.jpg"].offset
    data[at:at + BLOCK] = b"\x5a" * BLOCK
    index = tarindex.scan(io.BytesIO(bytes(data)), "junk", len(data))
    assert index.keys == ["a"]
    assert index.damage == (at, "an invalid member header (bad checksum or not a tar header)")


def test_a_sample_whose_label_came_first_survives_damage_after_its_image(tmp_path, jpegs):
    """Label before image: damage right after the image's data leaves that sample whole
    (its label was read), so it is kept."""
    shard = write_tar(tmp_path / "s.tar", [("a.cls", b"0"), ("a.jpg", jpegs[0]),
                                           ("b.cls", b"1"), ("b.jpg", jpegs[1])])
    b = members_of(shard)["b.jpg"]
    index = _scan_cut(shard, b.offset_data + -(-b.size // BLOCK) * BLOCK)
    assert index.keys == ["a", "b"] and index.labels == [0, 1] and index.damage is not None


# ---- the sidecar -----------------------------------------------------------------------------
def test_the_sidecar_round_trips_members_and_damage(three):
    """to_json then from_json against the same shard gives the same entries, size and
    damage; the document has the documented shape."""
    shard, m = three
    index = _scan_cut(shard, m["c.jpg"].offset + 10)
    doc = json.loads(index.to_json())
    assert doc["format"] == tarindex.FORMAT and doc["version"] == tarindex.VERSION
    assert doc["members"] == [list(e) for e in entries(index)]
    back = TarIndex.from_json(index.to_json(), index.shard_bytes)
    assert entries(back) == entries(index) and back.shard_bytes == index.shard_bytes
    assert back.damage == index.damage
    whole = tarindex.scan_file(shard)
    assert "damage" not in json.loads(whole.to_json())
    assert TarIndex.from_json(whole.to_json()).damage is None


@pytest.mark.parametrize("data, why", [
    (b"\xff\xfe not json", r"^not an index \("),
    (b"[1, 2]", r"^not an echo_native tar index$"),
    (json.dumps({"format": "webdataset", "version": 1}).encode(), r"^not an echo_native tar"),
    (sidecar_doc(10240, [], version=2), r"^index version '2', this reader knows 1$"),
    (sidecar_doc(True, []), r"^index without a valid shard_bytes$"),
    (sidecar_doc(-512, []), r"^index without a valid shard_bytes$"),
    (sidecar_doc("10240", []), r"^index without a valid shard_bytes$"),
    (sidecar_doc(10240, {"k": [512, 1, 0]}), r"^index without members$"),
    (sidecar_doc(10240, [["k", 512, 1]]), r"^bad index entry"),
    (sidecar_doc(10240, [[7, 512, 1, 0]]), r"^bad index entry"),
    (sidecar_doc(10240, [["k", 512.0, 1, 0]]), r"^bad index entry"),
    (sidecar_doc(10240, [["k", 512, True, 0]]), r"^bad index entry"),
    (sidecar_doc(10240, [["k", 512, -1, 0]]), r"^index entry 'k' out of range"),
    (sidecar_doc(10240, [["k", 512, 1, -2**63 - 1]]), r"^index entry 'k' out of range"),
    (sidecar_doc(10240, [], damage=[1, 2, 3]), r"malformed damage record"),
    (sidecar_doc(10240, [], damage=[-1, "cut"]), r"malformed damage record"),
    (sidecar_doc(10240, [], damage=[10241, "cut"]), r"malformed damage record"),
    (sidecar_doc(10240, [], damage=[512, 7]), r"malformed damage record"),
    (sidecar_doc(10240, [], damage="cut at 512"), r"malformed damage record"),
])
def test_what_is_not_a_sidecar_is_refused_saying_why(data, why):
    """Not JSON, another format or version, a shard size, member list, entry or damage
    record of the wrong shape: ValueError saying which."""
    with pytest.raises(ValueError, match=why):
        TarIndex.from_json(data)


def test_a_sidecar_of_another_shard_size_is_refused():
    """An index made for a shard of another size (a shard rewritten under the same name)
    names both sizes; without a shard size to compare, it is read."""
    data = sidecar_doc(10240, [["k", 512, 100, 1]])
    with pytest.raises(ValueError, match=r"made for a shard of 10240 bytes, the shard has "
                                         r"10752"):
        TarIndex.from_json(data, 10752)
    assert entries(TarIndex.from_json(data)) == [("k", 512, 100, 1)]


def test_from_json_bounds_the_document_by_the_shard_size():
    """A document over max_index_bytes of the shard is refused before it is parsed; one of
    exactly that size is parsed."""
    shard_bytes = 4096
    limit = tarindex.max_index_bytes(shard_bytes)
    assert limit == 2**20 + 1024
    doc = sidecar_doc(shard_bytes, [])
    padded = doc + b" " * (limit - len(doc))
    assert len(TarIndex.from_json(padded, shard_bytes)) == 0
    with pytest.raises(ValueError, match=r"index of 1,049,601 bytes, more than any index of "
                                         r"a shard of 4,096 bytes"):
        TarIndex.from_json(padded + b" ", shard_bytes)


def test_members_packed_as_tightly_as_tar_packs_them_are_accepted():
    """Data blocks rounded up to 512 and one header between members is the tightest a tar
    holds: accepted; one block tighter overlaps; data may end at the shard's last byte,
    not one past it; an empty member is fine."""
    size = 10 * BLOCK
    # 700 bytes of data take 2 blocks, then the next header: next data at 512 + 3 * 512.
    tight = [["a", BLOCK, 700, 0], ["b", 4 * BLOCK, 0, 1], ["c", 5 * BLOCK, size - 5 * BLOCK, 2]]
    index = TarIndex.from_json(sidecar_doc(size, tight), size)
    assert entries(index) == [tuple(e) for e in tight]
    closer = [["a", BLOCK, 700, 0], ["b", 3 * BLOCK, 10, 1]]
    with pytest.raises(ValueError, match=rf"offsets {BLOCK} and {3 * BLOCK} overlap"):
        TarIndex.from_json(sidecar_doc(size, closer), size)
    past = [["a", 5 * BLOCK, size - 5 * BLOCK + 1, 0]]
    with pytest.raises(ValueError, match="out of range"):
        TarIndex.from_json(sidecar_doc(size, past), size)


def test_the_damage_message_read_back_is_bounded():
    """A damage message in a sidecar is cut to 300 characters (it is printed to the user)."""
    index = TarIndex.from_json(sidecar_doc(10240, [], damage=[1024, "m" * 5000]), 10240)
    assert index.damage == (1024, "m" * 300)


def test_read_limited_reads_up_to_the_limit(tmp_path):
    """A file of exactly ``limit`` bytes is read whole; one byte more is refused, saying the
    limit."""
    f = tmp_path / "s.tar.idx"
    f.write_bytes(b"x" * 1000)
    assert tarindex.read_limited(f, 1000) == b"x" * 1000
    with pytest.raises(ValueError, match=r"index file over 999 bytes"):
        tarindex.read_limited(f, 999)


def test_the_sidecar_sits_beside_its_shard():
    """The sidecar of a path or a URL is its name plus ``.idx``."""
    assert tarindex.sidecar("/data/s-000.tar") == "/data/s-000.tar.idx"
    assert tarindex.sidecar("s3://bucket/train/s-001.tar") == "s3://bucket/train/s-001.tar.idx"


# ---- writing a sidecar -------------------------------------------------------------------------
@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield 0o027
    os.umask(old)


def test_write_atomic_replaces_the_file_with_the_umask_mode(tmp_path, umask_027):
    """The new bytes replace the old file whole, with mode 0666 less the umask, and no
    temporary file is left; umask() reads the umask in force."""
    path = tmp_path / "s.tar.idx"
    path.write_bytes(b"old contents, longer than the new ones")
    os.chmod(path, 0o600)
    tarindex.write_atomic(path, b"new")
    assert path.read_bytes() == b"new"
    assert tarindex.umask() == umask_027
    assert os.stat(path).st_mode & 0o777 == 0o640
    assert os.listdir(tmp_path) == ["s.tar.idx"]


def test_write_atomic_replaces_a_link_rather_than_writing_through_it(tmp_path):
    """A symbolic link at the sidecar's path is replaced by a regular file; its target keeps
    its bytes."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    path = tmp_path / "s.tar.idx"
    os.symlink(victim, path)
    tarindex.write_atomic(str(path), b"index")
    assert not path.is_symlink() and path.read_bytes() == b"index"
    assert victim.read_bytes() == b"precious"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    """A write that fails (data that is not bytes) raises, and leaves the old file as it was
    and nothing else behind."""
    path = tmp_path / "s.tar.idx"
    path.write_bytes(b"old")
    with pytest.raises(TypeError):
        tarindex.write_atomic(path, "not bytes")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["s.tar.idx"]


def test_a_zeroed_header_with_members_after_it_is_damage_not_the_end(three):
    """A member header zeroed in the middle of a shard (a hole in a copy) is reported as
    damage at its offset; the samples before it are kept."""
    shard, m = three
    data = bytearray(shard.read_bytes())
    at = m["b.jpg"].offset
    data[at:at + BLOCK] = bytes(BLOCK)
    index = tarindex.scan(io.BytesIO(bytes(data)), "holed", len(data))
    assert index.keys == ["a"]
    assert index.damage == (at, "a zero block where a member header belongs, with data "
                                "after it")


def test_a_member_with_no_key_before_its_extension_is_not_a_sample(tmp_path, jpegs):
    """A member named just ``jpg`` (or ``.jpg``) has no key: it is skipped, never a sample
    with an empty key."""
    shard = write_tar(tmp_path / "s.tar", [("jpg", jpegs[0]), (".jpg", jpegs[1]),
                                           ("a.jpg", jpegs[2]), ("a.cls", b"4")])
    index = tarindex.scan_file(shard)
    assert index.keys == ["a"] and index.labels == [4]

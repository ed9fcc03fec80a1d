"""Data sources: ImageFolder, FileList, TarShards (and the error policy for bad files).

References are computed here, never copied from the implementation:
torchvision's listing algorithm (``find_classes`` + ``make_dataset``)
re-implemented line for line, tar shards written with Python's ``tarfile``
from the same JPEG bytes as a folder tree, and files listed by hand.
"""
from __future__ import annotations

import os
import pickle
import re
import sys
import tarfile
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import echo_native as en
from echo_native.source import IMG_EXTENSIONS, FileList, ImageFolder
from echo_native.tarshards import TarShards

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import sources_helpers as sh  # noqa: E402

N = 30          # samples in the small real-photo corpus
CLASSES = 3


# ---- the same JPEGs as a folder tree and as tar shards ------------------------------------
@pytest.fixture(scope="module")
def corpus():
    """30 distinct 40x48 JPEGs cut from real photographs, labels i % 3."""
    return sh.photo_jpegs(N, seed=11), np.arange(N) % CLASSES


@pytest.fixture(scope="module")
def folder(corpus, tmp_path_factory):
    blobs, labels = corpus
    return sh.write_folder(tmp_path_factory.mktemp("folder"), blobs, labels)


@pytest.fixture(scope="module")
def shards(corpus, tmp_path_factory):
    """The corpus as 3 WebDataset shards (plus a directory entry and .json members)."""
    blobs, labels = corpus
    return sh.write_shards(tmp_path_factory.mktemp("shards"), blobs, labels, 3)


def key_of(tar, i):
    """Original corpus index of TarShards sample i (keys are ``s<index>``)."""
    return int(tar.describe(i).rsplit(":s", 1)[1])


def collect(it):
    """Fresh ids, all ids and labels of one pass over a Loader/EchoRing."""
    fresh, ids, labels = [], [], []
    for b in it:
        fresh.extend(np.asarray(b.sample_ids)[np.asarray(b.fresh)].tolist())
        ids.extend(np.asarray(b.sample_ids).tolist())
        labels.extend(np.asarray(b.labels).tolist())
    return fresh, ids, labels


# ---- ImageFolder ------------------------------------------------------------------------------
def torchvision_listing(root, extensions=IMG_EXTENSIONS):
    """torchvision.datasets.folder.find_classes + make_dataset(allow_empty=True), same logic."""
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    class_to_idx = {c: i for i, c in enumerate(classes)}
    instances = []
    for target_class in sorted(class_to_idx.keys()):
        class_index = class_to_idx[target_class]
        target_dir = os.path.join(root, target_class)
        if not os.path.isdir(target_dir):
            continue
        for r, _, fnames in sorted(os.walk(target_dir, followlinks=True)):
            for fname in sorted(fnames):
                path = os.path.join(r, fname)
                if path.lower().endswith(tuple(extensions)):
                    instances.append((path, class_index))
    return classes, class_to_idx, instances


def _touch(root, *rels):
    for rel in rels:
        p = Path(root, rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"")


@pytest.fixture
def messy_tree(tmp_path):
    """Classes with upper/lower-case names, nested folders whose path order differs from a
    depth-first walk, extensions in any case, non-image files, an empty class, a folder
    named like an image, a symlinked folder and a stray file at the root."""
    root = tmp_path / "tree"
    _touch(root,
           "Zebra/b.JPG", "Zebra/a.jpeg", "Zebra/c.Png", "Zebra/readme.md",
           "cat/x.jpg", "cat/notes.txt", "cat/x.jpg.bak", "cat/Thumbs.db",
           "cat/sub/1.jpg", "cat/sub/2.webp", "cat/sub-2/3.jpg", "cat/sub/deep/4.JPEG",
           "cat/dir.jpg/5.jpg",
           "dog/10.jpg", "dog/9.jpg", "dog/11.TIFF", "dog/12.gif",
           ".hidden/h.jpg",
           "stray.jpg")
    (root / "empty").mkdir()
    os.symlink(root / "dog", root / "cat" / "link")
    return root


def test_imagefolder_matches_torchvision_order(messy_tree):
    """ImageFolder lists classes, files and labels exactly as torchvision's algorithm does."""
    src = ImageFolder(messy_tree)
    classes, class_to_idx, instances = torchvision_listing(str(messy_tree))
    assert src.classes == classes
    assert src.class_to_idx == class_to_idx
    assert [src.path(i) for i in range(len(src))] == [p for p, _ in instances]
    assert src.labels.tolist() == [c for _, c in instances]
    assert src.labels.dtype == np.int64
    # The same, written out by hand: path-string order of folders ("sub-2" before
    # "sub/deep"), sorted files, any-case extensions, non-images ignored.
    rel = [os.path.relpath(src.path(i), messy_tree) for i in range(len(src))]
    assert rel == [".hidden/h.jpg",
                   "Zebra/a.jpeg", "Zebra/b.JPG", "Zebra/c.Png",
                   "cat/x.jpg", "cat/dir.jpg/5.jpg", "cat/link/10.jpg", "cat/link/11.TIFF",
                   "cat/link/9.jpg", "cat/sub/1.jpg", "cat/sub/2.webp", "cat/sub-2/3.jpg",
                   "cat/sub/deep/4.JPEG",
                   "dog/10.jpg", "dog/11.TIFF", "dog/9.jpg"]
    assert src.classes == [".hidden", "Zebra", "cat", "dog", "empty"]
    assert src.labels.tolist() == [0, 1, 1, 1] + [2] * 9 + [3] * 3
    assert src.describe(4) == src.path(4)
    try:  # the real thing, where it is installed
        from torchvision.datasets import ImageFolder as TVImageFolder
    except ImportError:
        return
    tv = TVImageFolder(str(messy_tree), allow_empty=True)
    assert tv.classes == src.classes
    assert [(p, c) for p, c in tv.samples] == list(zip([src.path(i) for i in range(len(src))],
                                                      src.labels.tolist()))


def test_imagefolder_extension_filter_any_case(messy_tree):
    """A custom extension list filters file names case-insensitively, either side."""
    src = ImageFolder(messy_tree, extensions=(".PNG", ".webp", ".tiff"))
    rel = [os.path.relpath(src.path(i), messy_tree) for i in range(len(src))]
    assert rel == ["Zebra/c.Png", "cat/link/11.TIFF", "cat/sub/2.webp", "dog/11.TIFF"]
    assert src.labels.tolist() == [1, 2, 2, 3]
    assert len(src.classes) == 5  # classes do not depend on the filter


def test_imagefolder_one_extension_as_a_string(messy_tree):
    """A string is one extension (as torchvision), not the tuple of its letters."""
    src = ImageFolder(messy_tree, extensions=".webp")
    rel = [os.path.relpath(src.path(i), messy_tree) for i in range(len(src))]
    assert rel == ["cat/sub/2.webp"]
    for bad in ((), ("",), (".jpg", 3)):
        with pytest.raises(TypeError, match="extensions"):
            ImageFolder(messy_tree, extensions=bad)


def test_imagefolder_errors_name_the_path(tmp_path):
    """Missing root, no class folders, or no images raise errors naming the root."""
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        ImageFolder(missing)
    a_file = tmp_path / "file.jpg"
    a_file.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=re.escape(str(a_file))):
        ImageFolder(a_file)
    flat = tmp_path / "flat"
    _touch(flat, "a.jpg", "b.jpg")
    with pytest.raises(ValueError, match=re.escape(str(flat)) + ".*no class"):
        ImageFolder(flat)
    noimg = tmp_path / "noimg"
    _touch(noimg, "a/readme.txt", "b/x.jpg.bak")
    (noimg / "c").mkdir()
    with pytest.raises(ValueError, match=re.escape(str(noimg)) + ".*no files"):
        ImageFolder(noimg)


def test_imagefolder_reads_file_bytes(folder, corpus):
    """read(i) returns the file's bytes and labels follow the class folders."""
    blobs, labels = corpus
    src = ImageFolder(folder)
    assert len(src) == N
    # write_folder names files img_<corpus index>; classes class_00..: sorted = label order
    for i in range(len(src)):
        k = int(Path(src.path(i)).stem.split("_")[1])
        assert src.read(i) == blobs[k]
        assert src.labels[i] == labels[k]


def test_imagefolder_index_is_compact(tmp_path):
    """The listing pickles to about the size of its path bytes: no Python object per sample."""
    root = sh.empty_tree(tmp_path / "many", 3000, 7)
    src = ImageFolder(root)
    assert len(src) == 3000
    path_bytes = sum(len(os.path.relpath(src.path(i), root).encode()) for i in range(len(src)))
    size = len(pickle.dumps(src, protocol=pickle.HIGHEST_PROTOCOL))
    # blob + int64 offsets + int64 labels, plus a little: a pickled list of str would add
    # >= 5 bytes per path on top, a list of tuples far more.
    assert size <= path_bytes + 16 * len(src) + 2048, (size, path_bytes)
    clone = pickle.loads(pickle.dumps(src))
    assert [clone.path(i) for i in (0, 1234, 2999)] == [src.path(i) for i in (0, 1234, 2999)]


# ---- FileList -------------------------------------------------------------------------------
def test_filelist_from_file(folder, corpus, tmp_path):
    """A list file (header, comments, blanks, CRLF) resolves paths against its folder or root=."""
    blobs, labels = corpus
    files = sorted(folder.rglob("*.jpg"))
    absolute = files[5]
    lines = ["# made by hand", "", "path,label",
             f"  {os.path.relpath(files[0], folder)} , 7 ",
             f"{os.path.relpath(files[1], folder)},0",
             "   # indented comment",
             f"{absolute},2",
             f"{os.path.relpath(files[2], folder)},-1", ""]
    lst = folder / "train.csv"
    lst.write_bytes("\r\n".join(lines).encode())
    src = FileList(lst)
    assert len(src) == 4
    assert src.labels.tolist() == [7, 0, 2, -1]
    assert src.path(0) == os.path.join(folder, os.path.relpath(files[0], folder))
    assert src.path(2) == str(absolute)
    for i, f in enumerate([files[0], files[1], absolute, files[2]]):
        assert src.read(i) == f.read_bytes()
        assert src.describe(i) == src.path(i)
    # The list elsewhere, with root= pointing at the images.
    other = tmp_path / "lists" / "val.txt"
    other.parent.mkdir()
    other.write_text(f"{os.path.relpath(files[3], folder)},1\n")
    moved = FileList(other, root=folder)
    assert moved.read(0) == files[3].read_bytes()
    assert moved.labels.tolist() == [1]
    with pytest.raises(FileNotFoundError):
        FileList(other).read(0)  # default root: the list's folder, where it is not


def test_filelist_from_rows(folder, monkeypatch):
    """Rows of (path, label) resolve against root= or the working directory."""
    files = sorted(folder.rglob("*.jpg"))[:3]
    rows = [(os.path.relpath(f, folder), k) for k, f in enumerate(files)]
    src = FileList(rows, root=folder)
    assert src.labels.tolist() == [0, 1, 2]
    assert [src.read(i) for i in range(3)] == [f.read_bytes() for f in files]
    monkeypatch.chdir(folder)
    src = FileList([(Path(p), str(k)) for p, k in rows])
    assert [src.read(i) for i in range(3)] == [f.read_bytes() for f in files]
    with en.Loader(src, 3, image_size=16, workers=1, worker_mode="thread", shuffle=False) as ld:
        (b,) = list(ld)
        assert b.sample_ids.tolist() == [0, 1, 2] and b.labels.tolist() == [0, 1, 2]
        assert b.fresh.all()


def test_filelist_bad_lines_name_file_and_line(tmp_path):
    """A non-integer label or a line without a comma raises ValueError naming file:line."""
    lst = tmp_path / "bad.csv"
    lst.write_text("path,label\n# comment\na.jpg,1\n\nb.jpg,cat\n")
    with pytest.raises(ValueError, match=re.escape(f"{lst}:5") + ".*'cat'.*b.jpg"):
        FileList(lst)
    lst.write_text("a.jpg,1\nb.jpg 2\n")
    with pytest.raises(ValueError, match=re.escape(f"{lst}:2")):
        FileList(lst)
    with pytest.raises(ValueError, match="row 1"):
        FileList([("a.jpg", 0), ("b.jpg", "x")])
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "none.csv"))):
        FileList(tmp_path / "none.csv")
    lst.write_text("# only a comment\npath,label\n")
    with pytest.raises(ValueError, match="no samples"):
        FileList(lst)


# ---- TarShards -------------------------------------------------------------------------------
def test_tarshards_equal_folder(folder, shards):
    """Tar shards of the same JPEGs give the same (bytes, label) pairs as the folder."""
    tar, fold = TarShards(shards), ImageFolder(folder)
    assert len(tar) == len(fold) == N
    pairs_tar = Counter((tar.read(i), int(tar.labels[i])) for i in range(len(tar)))
    pairs_fold = Counter((fold.read(i), int(fold.labels[i])) for i in range(len(fold)))
    assert pairs_tar == pairs_fold
    assert max(pairs_tar.values()) == 1
    for i in range(len(tar)):
        name = tar.describe(i)
        shard, key = name.rsplit(":", 1)
        assert shard in shards and re.fullmatch(r"s\d{5}", key)
        # the member's bytes, as tarfile reads them
        with tarfile.open(shard) as t:
            assert t.extractfile(f"{key}.jpg").read() == tar.read(i)
    # picklable for process workers, and reads again after unpickling
    clone = pickle.loads(pickle.dumps(tar))
    assert clone.read(N - 1) == tar.read(N - 1)


def test_tarshards_each_sample_once_per_epoch(shards, corpus):
    """Loader/EchoRing over tar shards: each sample fresh once per epoch, .cls labels."""
    blobs, labels = corpus
    tar = TarShards(shards, shuffle_buffer=4)
    guarded = sh.NotInConsumer(tar)
    with en.Loader(guarded, 7, image_size=24, workers=2, seed=5) as ld:
        for epoch in range(2):
            ld.set_epoch(epoch)
            fresh, ids, labs = collect(ld)
            assert sorted(fresh) == list(range(N)) and sorted(ids) == list(range(N))
            assert labs == [int(labels[key_of(tar, i)]) for i in ids]
            assert ids == tar.epoch_order(5, epoch).tolist()  # the source's own order
    with en.EchoRing(guarded, batch_size=8, image_size=24, echo=2, workers=2, seed=5) as ring:
        orders = []
        for epoch in range(2):
            ring.set_epoch(epoch)
            fresh, ids, labs = collect(ring)
            assert sorted(fresh) == list(range(N))
            assert Counter(ids) == Counter({i: 2 for i in range(N)})
            assert labs == [int(labels[key_of(tar, i)]) for i in ids]
            orders.append(fresh)
        assert orders[0] != orders[1]


def test_tarshards_epoch_order(tmp_path, corpus):
    """Shard order + window shuffle: pure in (seed, epoch), vary by epoch, reads stay local."""
    blobs, labels = corpus
    paths = sh.write_shards(tmp_path, blobs[:24], labels[:24], 4)  # 6 samples per shard
    tar = TarShards(paths, shuffle_buffer=3)
    shard_of = np.array([paths.index(tar.describe(i).rsplit(":", 1)[0]) for i in range(24)])
    orders = {}
    for seed in (0, 1):
        for epoch in range(6):
            o = np.asarray(tar.epoch_order(seed, epoch))
            assert sorted(o.tolist()) == list(range(24))
            assert np.array_equal(o, tar.epoch_order(seed, epoch))
            assert np.array_equal(o, pickle.loads(pickle.dumps(tar)).epoch_order(seed, epoch))
            # windows of 3 never straddle a shard here: each is 3 consecutive samples of one
            # shard, and a shard's windows come one after the other, in key order
            windows = o.reshape(8, 3)
            for w in windows:
                assert len(set(shard_of[w])) == 1
                assert sorted(w.tolist()) == list(range(min(w), min(w) + 3))
            seq = shard_of[windows[:, 0]]
            assert all(len(set(seq[2 * k:2 * k + 2])) == 1 for k in range(4))
            assert sorted(seq[::2].tolist()) == [0, 1, 2, 3]
            mins = windows.min(axis=1)
            assert (mins[0::2] < mins[1::2]).all()
            orders[seed, epoch] = (tuple(o.tolist()), tuple(seq[::2].tolist()))
    for seed in (0, 1):
        assert len({orders[seed, e][0] for e in range(6)}) == 6          # orders change
        assert len({orders[seed, e][1] for e in range(6)}) >= 2          # shard order too
    assert orders[0, 0] != orders[1, 0]
    # samples are shuffled within their window (not left in key order)
    windows = [orders[0, e][0][k:k + 3] for e in range(6) for k in range(0, 24, 3)]
    assert sum(list(w) != sorted(w) for w in windows) >= len(windows) // 2


def test_tarshards_missing_cls_and_bad_members(tmp_path, corpus):
    """Missing .cls gives label -1; bad .cls/tar/shard paths raise errors naming the shard."""
    blobs, labels = corpus
    paths = sh.write_shards(tmp_path / "a", blobs[:8], labels[:8], 2, missing_cls={3})
    tar = TarShards(paths)
    got = {key_of(tar, i): int(tar.labels[i]) for i in range(len(tar))}
    assert got == {k: (-1 if k == 3 else int(labels[k])) for k in range(8)}
    assert "-1" in TarShards.__doc__

    bad = tmp_path / "badcls.tar"
    with tarfile.open(bad, "w") as t:
        sh._add(t, "k1.jpg", blobs[0])
        sh._add(t, "k1.cls", b"dog")
    with pytest.raises(ValueError, match=re.escape(str(bad)) + ".*k1.cls"):
        TarShards([bad])

    whole = Path(paths[0]).read_bytes()
    cut = tmp_path / "cut.tar"
    cut.write_bytes(whole[:len(whole) // 2 + 100])
    # Cut short: the complete samples before the cut are kept, the damage is warned about
    # once, naming the shard (tests/robustness/test_attacks_tar.py has the details).
    with pytest.warns(RuntimeWarning, match=re.escape(str(cut)) + " is damaged at byte"):
        partial = TarShards([paths[1], cut])
    assert 0 < len(partial) - len(TarShards([paths[1]])) < len(TarShards([paths[0]]))

    junk = tmp_path / "junk.tar"
    junk.write_bytes(blobs[0])
    with pytest.raises(ValueError, match=re.escape(str(junk))):
        TarShards([junk])
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "gone.tar"))):
        TarShards([paths[0], tmp_path / "gone.tar"])
    noimg = tmp_path / "noimg.tar"
    with tarfile.open(noimg, "w") as t:
        sh._add(t, "k1.cls", b"1")
    with pytest.raises(ValueError, match="no image members"):
        TarShards(noimg)
    with pytest.raises(ValueError):
        TarShards([])


@pytest.fixture(scope="module")
def corrupt_shards(corpus, tmp_path_factory):
    """3 shards; sample 4's JPEG member is cut to half its bytes."""
    blobs, labels = corpus
    blobs = list(blobs)
    blobs[4] = blobs[4][:len(blobs[4]) // 2]
    paths = sh.write_shards(tmp_path_factory.mktemp("corrupt"), blobs, labels, 3)
    tar = TarShards(paths)
    bad = [i for i in range(len(tar)) if key_of(tar, i) == 4][0]
    return tar, bad


@pytest.mark.parametrize("on_error", ["replace", "skip", "raise"])
def test_corrupt_tar_member_policy(corrupt_shards, on_error):
    """A truncated JPEG member goes through on_error, named "shard.tar:key"."""
    tar, bad = corrupt_shards
    name = tar.describe(bad)
    assert re.search(r"shard-001\.tar:s00004$", name)
    ring = en.EchoRing(tar, batch_size=8, image_size=24, echo=2, workers=1, on_error=on_error,
                       worker_mode="thread", seed=3)
    with ring:
        if on_error == "raise":
            with pytest.raises(en.DecodeError) as ei, warnings.catch_warnings():
                warnings.simplefilter("ignore", en.SampleFailureWarning)
                collect(ring)
            assert ei.value.path == name and name in str(ei.value)
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fresh, ids, _ = collect(ring)
        stats = ring.stats()
    msgs = [str(w.message) for w in caught if issubclass(w.category, en.SampleFailureWarning)]
    # One warning naming the file, and the epoch's summary counting it.
    assert len(msgs) == 2 and name in msgs[0], msgs
    assert msgs[1].startswith("epoch 0: 1 sample(s) failed (decode 1)"), msgs
    assert stats["failures"] == {"decode": 1}
    assert sorted(fresh) == [i for i in range(N) if i != bad]
    if on_error == "skip":
        assert bad not in ids and len(ids) == 2 * (N - 1)


def test_tar_shard_changed_after_indexing(tmp_path, corpus):
    """A shard cut short after indexing: the lost member is a read failure named shard:key."""
    blobs, labels = corpus
    paths = sh.write_shards(tmp_path, blobs[:12], labels[:12], 2, extra_members=False)
    tar = TarShards(paths)
    last = max(range(len(tar)), key=lambda i: (tar.describe(i).startswith(paths[1]), i))
    with tarfile.open(paths[1]) as t:
        member = t.getmember(tar.describe(last).rsplit(":", 1)[1] + ".jpg")
    os.truncate(paths[1], member.offset_data + member.size // 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with en.Loader(tar, 4, image_size=16, workers=1, worker_mode="thread") as ld:
            fresh, ids, _ = collect(ld)
            stats = ld.stats()
    msgs = [str(w.message) for w in caught if issubclass(w.category, en.SampleFailureWarning)]
    assert len(msgs) == 2 and tar.describe(last) in msgs[0] and "short read" in msgs[0]
    assert msgs[1].startswith("epoch 0: 1 sample(s) failed (read 1)"), msgs
    assert stats["failures"] == {"read": 1}
    assert sorted(fresh) == [i for i in range(12) if i != last]


# ---- a file that vanished after listing --------------------------------------------------
@pytest.mark.parametrize("on_error", ["replace", "skip", "raise"])
def test_missing_file_goes_through_policy(corpus, tmp_path, on_error):
    """A file deleted after listing is a read failure under on_error, reported with its path."""
    blobs, labels = corpus
    root = sh.write_folder(tmp_path / "f", blobs[:16], labels[:16])
    src = ImageFolder(root)
    gone = 9
    os.remove(src.path(gone))
    ld = en.Loader(src, 4, image_size=16, workers=2, on_error=on_error, seed=1)
    with ld:
        if on_error == "raise":
            with pytest.raises(en.DecodeError) as ei, warnings.catch_warnings():
                warnings.simplefilter("ignore", en.SampleFailureWarning)
                collect(ld)
            assert ei.value.path == src.path(gone)
            assert src.path(gone) in str(ei.value) and "cannot read" in str(ei.value)
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fresh, ids, labs = collect(ld)
        stats = ld.stats()
    msgs = [str(w.message) for w in caught if issubclass(w.category, en.SampleFailureWarning)]
    assert len(msgs) == 2 and src.path(gone) in msgs[0], msgs
    assert msgs[1].startswith("epoch 0: 1 sample(s) failed (read 1)"), msgs
    assert stats["failures"] == {"read": 1}
    assert sorted(fresh) == [i for i in range(16) if i != gone]
    assert gone not in ids
    assert labs == [int(src.labels[i]) for i in ids]
    assert len(ids) == (16 if on_error == "replace" else 15)

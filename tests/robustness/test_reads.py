"""Reads that cannot hang or exhaust memory, and nothing lost or silently dropped.

A FIFO, a device or an oversized file named like an image is a sample failure
that names the file, never a hung worker or a stopped run; a directory tree with
symbolic-link loops lists each directory once; samples that cannot be replaced
are counted as dropped; a resumed run gives every good sample its own fresh
emission even when it served as a stand-in before the save.
"""
from __future__ import annotations

import io
import os
import warnings

import numpy as np

import pytest
from PIL import Image

import echo_native as en
import ring_helpers as rh
from photos import fit, photo

NAMES = ["astronaut", "coffee", "chelsea", "rocket"]


def _jpeg(i, h=48, w=64):
    buf = io.BytesIO()
    Image.fromarray(fit(photo(NAMES[i % 4]), h + i % 5, w)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _folder(root, n=8):
    (root / "a").mkdir(parents=True)
    for i in range(n):
        (root / "a" / f"{i:02d}.jpg").write_bytes(_jpeg(i))
    return root


def _fresh_ids(ring):
    ids = []
    with ring:
        for b in ring:
            ids += [int(s) for s, f in zip(b.sample_ids, b.fresh) if f]
        stats = ring.stats()
    return ids, stats


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::echo_native.SampleFailureWarning")
def test_fifo_named_jpg_is_a_failure_not_a_hang(tmp_path):
    """A FIFO in the data set is refused without reading (no writer will ever come);
    the epoch completes and the failure names it."""
    root = _folder(tmp_path / "data")
    fifo = root / "a" / "03b.jpg"
    os.mkfifo(fifo)
    src = en.ImageFolder(root)
    with pytest.warns(en.SampleFailureWarning, match=r"03b\.jpg: refused: not a regular file "
                                                      r"\(a FIFO\)"):
        ids, stats = _fresh_ids(en.EchoRing(src, 4, echo=1, workers=1,
                                            augment=en.RandomResizedCrop(16)))
    assert stats["failures"] == {"limit": 1}
    assert sorted(ids) == sorted(set(range(len(src))) - {src_index(src, fifo)})


def src_index(src, path):
    return [src.describe(i) for i in range(len(src))].index(str(path))


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::echo_native.SampleFailureWarning")
def test_huge_sparse_file_is_refused_by_size(tmp_path):
    """A 64 GiB sparse .jpg (and anything over max_file_bytes) is refused by its size
    before a byte is read."""
    root = _folder(tmp_path / "data")
    huge = root / "a" / "huge.jpg"
    with open(huge, "wb") as f:
        f.truncate(64 * 2**30)
    src = en.ImageFolder(root)
    with pytest.warns(en.SampleFailureWarning,
                      match=r"huge\.jpg: refused: 68719476736 bytes, over the limit "
                            r"max_file_bytes=67108864"):
        ids, stats = _fresh_ids(en.EchoRing(src, 3, echo=1, workers=1,
                                            augment=en.RandomResizedCrop(16)))
    assert stats["failures"] == {"limit": 1} and len(ids) == len(src) - 1
    small = en.ImageFolder(root, max_file_bytes=100)
    with pytest.raises(OSError, match="over the limit max_file_bytes=100"):
        small.read(0)
    with pytest.raises(ValueError, match="max_file_bytes must be a positive integer"):
        en.ImageFolder(root, max_file_bytes=0)


def test_tar_member_over_the_limit_is_refused(tmp_path):
    """TarShards applies max_file_bytes to members, from the index (nothing read)."""
    import tarfile

    shard = tmp_path / "s.tar"
    with tarfile.open(shard, "w") as tar:
        for i in range(2):
            data = _jpeg(i)
            info = tarfile.TarInfo(f"k{i}.jpg")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    src = en.TarShards([shard], max_file_bytes=100)
    with pytest.raises(OSError, match=r"over the limit max_file_bytes=100"):
        src.read(0)
    assert len(en.TarShards([shard]).read(0)) > 100


@pytest.mark.timeout(60)
def test_symlink_loops_are_not_followed_round(tmp_path):
    """a/loop -> ..: the four files once, not 164.  Links between classes (b/back -> a,
    a/forth -> b, a cycle through both) list each class's reachable files once per
    class, as torchvision does for acyclic links, and the listing finishes."""
    root = _folder(tmp_path / "data", n=4)
    os.symlink("..", root / "a" / "loop")
    assert len(en.ImageFolder(root)) == 4
    (root / "b").mkdir()
    (root / "b" / "x.jpg").write_bytes(_jpeg(0))
    os.symlink(root / "a", root / "b" / "back")
    os.symlink(root / "b", root / "a" / "forth")
    src = en.ImageFolder(root)
    listed = sorted(os.path.relpath(src.describe(i), root) for i in range(len(src)))
    assert listed == ["a/00.jpg", "a/01.jpg", "a/02.jpg", "a/03.jpg", "a/forth/x.jpg",
                      "b/back/00.jpg", "b/back/01.jpg", "b/back/02.jpg", "b/back/03.jpg",
                      "b/x.jpg"]


def test_file_list_label_out_of_range_names_the_row(tmp_path):
    """A label that does not fit 64 bits is a ValueError naming the row, not OverflowError."""
    lst = tmp_path / "list.csv"
    lst.write_text(f"path,label\na.jpg,1\nb.jpg,{2**64}\n")
    with pytest.raises(ValueError, match=r"list\.csv:3: label '18446744073709551616' .* does "
                                         r"not fit a 64-bit integer"):
        en.FileList(lst)


@pytest.mark.timeout(60)
def test_unreplaceable_failures_are_counted_as_dropped():
    """All samples broken under on_error='replace': no stand-in can be decoded either;
    the drops are counted and said, and the epoch, left with nothing to deliver, ends in
    one DecodeError naming the count and the first file (never in empty batches)."""
    src = en.Samples([b"not an image %d" % i for i in range(6)], names=[f"bad{i}.jpg"
                                                                       for i in range(6)])
    ring = en.EchoRing(src, 3, echo=1, workers=1, augment=en.RandomResizedCrop(16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(en.DecodeError, match=r"every one of the 6 samples read in epoch 0 "
                                                 r"failed.*; the first: bad\d\.jpg: "):
            _fresh_ids(ring)
    assert ring.stats()["dropped"] == 6
    dropped = [str(w.message) for w in caught if "dropped: every stand-in failed" in
               str(w.message)]
    assert len(dropped) == 6 + 1, dropped   # each file, and the epoch's summary


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore::echo_native.SampleFailureWarning")
@pytest.mark.parametrize("placement", ["before_augment", "after_augment", "batch"])
def test_resume_gives_stand_ins_their_own_fresh_emission(placement):
    """With bad files replaced by good ones, a save mid-epoch and a resume in a new ring:
    every good id gets exactly one fresh emission over the two halves."""
    n, bad = 40, {3, 11, 19, 27, 35}
    blobs = [b"broken" if i in bad else _jpeg(i, 24, 32) for i in range(n)]
    src = en.Samples(blobs, names=[f"s{i}.jpg" for i in range(n)])
    kw = dict(echo=en.Echo(2, placement=placement, shuffle_buffer=8), workers=1, seed=4,
              augment=en.RandomResizedCrop(16))
    first, state = [], None
    with en.EchoRing(src, 4, **kw) as ring:
        for i, b in enumerate(ring):
            first += [int(s) for s, f in zip(b.sample_ids, b.fresh) if f]
            if i == 7:
                state = ring.state_dict()
                break
    second = []
    ring = en.EchoRing(src, 4, **kw)
    ring.load_state_dict(state)
    with ring:
        for b in ring:
            second += [int(s) for s, f in zip(b.sample_ids, b.fresh) if f]
    good = sorted(set(range(n)) - bad)
    assert sorted(first + second) == good


class _HangsOn:
    """In-memory JPEGs whose read of ``stuck`` never returns (a hung network mount); with
    ``mark`` (a path), that read first creates the file, so a test can wait for the hang."""

    def __init__(self, blobs, stuck, mark=None):
        self.blobs, self.stuck, self.mark = blobs, stuck, mark
        self.labels = np.zeros(len(blobs), np.int64)

    def __len__(self):
        return len(self.blobs)

    def read(self, i):
        if i == self.stuck:
            import time
            if self.mark:
                open(self.mark, "w").close()
            time.sleep(3600)
        return self.blobs[i]

    def describe(self, i):
        return f"/mnt/stalled/{i}.jpg"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("echo", [1, 2])
def test_a_read_that_hangs_fails_its_sample_and_the_run_goes_on(echo):
    """A read stuck past sample_timeout: its worker is replaced (not counted as a crash),
    the sample is reported as failed with its path, every other sample arrives."""
    blobs = [_jpeg(i) for i in range(12)]
    ring = en.EchoRing(_HangsOn(blobs, stuck=5), 4, echo=echo, workers=2, sample_timeout=1.0,
                       timeout=60, augment=en.RandomResizedCrop(16))
    with pytest.warns(en.SampleFailureWarning,
                      match=r"/mnt/stalled/5\.jpg: reading it stalled for [0-9]+ s"):
        ids, stats = _fresh_ids(ring)
    assert sorted(ids) == [i for i in range(12) if i != 5]
    # Workers started before the stall may meet the sample again (prefetching the
    # next epoch) and be replaced once each; their replacements skip it.
    assert stats["failures"] == {"read": 1} and 1 <= stats["worker_restarts"] <= 2


def test_sample_timeout_is_checked():
    """A sample_timeout that is not a positive number is refused by name."""
    src = en.Samples([_jpeg(0)] * 4)
    for bad in (0, -1, "5", True):
        with pytest.raises(ValueError, match="sample_timeout must be a positive number"):
            en.Loader(src, 2, sample_timeout=bad)


@pytest.mark.timeout(60)
def test_worker_stuck_in_a_read_dies_with_its_consumer(tmp_path):
    """SIGKILL of the consumer while a worker is blocked in a read: the kernel's
    parent-death signal ends the worker too (it cannot poll from inside the read)."""
    import signal
    import subprocess
    import sys
    import textwrap

    script, mark = tmp_path / "train.py", tmp_path / "stuck"
    script.write_text(textwrap.dedent(f"""\
        import sys, time
        sys.path[:0] = {sys.path!r}
        import echo_native as en
        from robustness.test_reads import _HangsOn, _jpeg
        blobs = [_jpeg(i) for i in range(4)]
        ring = en.EchoRing(_HangsOn(blobs, stuck=0, mark={str(mark)!r}), 2, echo=1, workers=1,
                           shuffle=False, sample_timeout=None,
                           augment=en.RandomResizedCrop(16))
        ring.start()
        print(*ring.loader.worker_pids(), flush=True)
        time.sleep(3600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=tmp_path, start_new_session=True)
    try:
        pid = int(proc.stdout.readline())
        rh.wait_for(mark.exists, "the worker blocked in its read of sample 0")
        proc.kill()
        proc.wait()
        rh.wait_for(lambda: not rh.alive(pid), f"worker {pid} outlived its consumer")
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass

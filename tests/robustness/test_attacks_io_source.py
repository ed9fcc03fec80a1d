"""Hostile sources: a custom read() that raises BaseExceptions or ends its process, labels
that do not fit 64 bits or are not integers, and folder trees whose links fan out.

What a user gets: the sample and the source named, as a sample failure under on_error
(or, for a sample that kills every worker that reads it, after two deaths); labels
checked once, with the offending index and value; each real folder listed once per
class, and a limit on how many files a folder may list.
"""
from __future__ import annotations

import os
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import echo_native as en
from echo_native.source import check_labels

HERE = Path(__file__).resolve().parent.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import sources_helpers as sh  # noqa: E402

pytestmark = pytest.mark.timeout(120)

N = 12
BAD = 5


@pytest.fixture(scope="module")
def jpegs():
    return sh.photo_jpegs(N, seed=51)


class Doomed(BaseException):
    """Neither an Exception nor a system exit: what a library's own control flow may use."""


class Exiting:
    """Sample BAD's read() raises (or, for "_exit", ends its process)."""

    def __init__(self, blobs, how):
        self.blobs, self.how = blobs, how
        self.labels = np.zeros(len(blobs), np.int64)

    def __len__(self):
        return len(self.blobs)

    def describe(self, i):
        return f"mem://exiting/{i}.jpg"

    def read(self, i):
        if i == BAD:
            if self.how == "_exit":
                os._exit(7)
            raise {"SystemExit": SystemExit(3), "KeyboardInterrupt": KeyboardInterrupt(),
                   "Doomed": Doomed("deliberate")}[self.how]
        return self.blobs[i]

    def __repr__(self):
        return "Exiting()"


def _run(src, mode="process"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with en.Loader(src, batch_size=4, image_size=16, workers=2, on_error="skip",
                       worker_mode=mode, seed=2, timeout=120) as ld:
            ids = sorted(int(i) for b in ld for i in b.sample_ids)
            stats = ld.stats()
    return ids, stats, [str(w.message) for w in caught]


# ---- 15: read() that raises BaseException or exits -----------------------------------------
@pytest.mark.parametrize("how, mode", [("SystemExit", "process"), ("KeyboardInterrupt", "process"),
                                       ("Doomed", "process"), ("SystemExit", "thread")])
def test_a_base_exception_in_read_is_that_samples_failure(jpegs, how, mode):
    """SystemExit, KeyboardInterrupt or another BaseException raised by read(): a failure
    of that sample naming it and what was raised, under on_error; no worker dies."""
    ids, stats, msgs = _run(Exiting(jpegs, how), mode)
    assert ids == [i for i in range(N) if i != BAD]
    assert stats["failures"] == {"read": 1} and stats["worker_restarts"] == 0
    named = [m for m in msgs if m.startswith(f"mem://exiting/{BAD}.jpg: ")]
    assert len(named) == 1 and f"Exiting.read({BAD}) raised {how}" in named[0], msgs


def test_a_read_that_ends_its_process_is_named_and_then_skipped(jpegs):
    """os._exit() inside read(): the worker dies, its replacement dies on the same sample;
    after that the sample fails without being read (naming it and why), the rest of the
    epoch arrives, and each death's warning names the sample it happened on.  (The other
    worker, started before the sample was known, may meet it once more in the next
    epoch's tickets it fills ahead: a third death, not counted as a crash.)"""
    ids, stats, msgs = _run(Exiting(jpegs, "_exit"))
    assert ids == [i for i in range(N) if i != BAD]
    assert stats["failures"] == {"read": 1} and stats["worker_restarts"] in (2, 3)
    died = [m for m in msgs if "died (exit code 7)" in m]
    assert len(died) == stats["worker_restarts"]
    assert all(f"while reading sample {BAD} (mem://exiting/{BAD}.jpg)" in m for m in died)
    named = [m for m in msgs if m.startswith(f"mem://exiting/{BAD}.jpg: ")]
    assert len(named) == 1 and "its worker died while reading or decoding it, 2 times" in named[0]


# ---- 15: labels ------------------------------------------------------------------------------
@pytest.mark.parametrize("labels, shown", [([0, 2**64], "18446744073709551616"),
                                           ([0, 2**63], "9223372036854775808"),
                                           ([-2**63 - 1, 0], "-9223372036854775809"),
                                           (np.array([0, 2**64 - 1], np.uint64),
                                            "18446744073709551615")])
def test_samples_labels_out_of_range_name_index_and_value(jpegs, labels, shown):
    """Samples(labels=[2**64]) and the like: a ValueError naming the label's index and
    value, not a raw OverflowError."""
    with pytest.raises(ValueError, match=r"labels of Samples\(2 samples\): label [01] is "
                                         + shown + "[, ]"):
        en.Samples(jpegs[:2], labels)


def test_float_labels_are_refused_unless_integral(jpegs):
    """1.0 and 2.0 are the classes 1 and 2; 2.5 or nan is refused, never truncated."""
    assert en.Samples(jpegs[:2], [1.0, 2.0]).labels.tolist() == [1, 2]
    assert en.Samples(jpegs[:2], np.array([1.0, 2.0], np.float32)).labels.dtype == np.int64
    for bad, text in ((2.5, "2.5"), (float("nan"), "nan"), (float("inf"), "inf")):
        with pytest.raises(ValueError, match=rf"label 1 is {text}, not an integer"):
            en.Samples(jpegs[:2], [0, bad])


class Labelled:
    def __init__(self, blobs, labels):
        self.blobs, self.labels = blobs, labels

    def __len__(self):
        return len(self.blobs)

    def read(self, i):
        return self.blobs[i]

    def __repr__(self):
        return "Labelled()"


@pytest.mark.parametrize("labels, error, match", [
    ([0, 1, 2**64], ValueError, r"label 2 is 18446744073709551616"),
    ([0, 1.5, 2], ValueError, r"label 1 is 1.5, not an integer"),
    ([0, "cat", 2], TypeError, r"label 1 is 'cat' \(str\), not an integer"),
    ([0, None, 2], TypeError, r"label 1 is None"),
    ([0, 1], ValueError, r"expected 3 labels in one dimension, got shape \(2,\)"),
    ([[0], [1], [2]], ValueError, r"expected 3 labels in one dimension, got shape \(3, 1\)"),
])
def test_check_labels_names_the_source_index_and_value(jpegs, labels, error, match):
    """check_labels(source): the source's labels as int64, or an error naming the source,
    the first bad index and its value."""
    with pytest.raises(error, match=r"labels of Labelled\(\)(: | )" + match):
        check_labels(Labelled(jpegs[:3], labels))
    good = check_labels(Labelled(jpegs[:3], [np.uint8(1), True, 2.0]))
    assert good.dtype == np.int64 and good.tolist() == [1, 1, 2]


def test_a_custom_source_with_huge_labels_fails_once_with_the_cause(jpegs):
    """A custom source whose labels do not fit 64 bits: one error naming the source and
    the value (at construction once the loader checks labels, else from the workers),
    never workers dying over and over with the cause only on stderr."""
    src = Labelled(jpegs[:8], [0] * 7 + [2**64])
    with pytest.raises((ValueError, en.WorkerError)) as ei:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # "worker died" would raise
            with en.Loader(src, batch_size=4, image_size=16, workers=2,
                           worker_mode="process", timeout=120) as ld:
                for _ in ld:
                    pass
    assert "labels of Labelled(): label 7 is 18446744073709551616" in str(ei.value)


# ---- 17: links that fan out --------------------------------------------------------------------
def _fan_out(root, levels, jpeg):
    """root/cls -> two links to chain/d1, each d_k two links to d_{k+1}; d_levels holds one
    JPEG: 2 * levels links, 2**levels paths to the one file."""
    chain = root.parent / "chain"
    (chain / f"d{levels}").mkdir(parents=True)
    (chain / f"d{levels}" / "x.jpg").write_bytes(jpeg)
    for k in range(1, levels):
        (chain / f"d{k}").mkdir()
        for link in ("l1", "l2"):
            os.symlink(chain / f"d{k + 1}", chain / f"d{k}" / link)
    (root / "cls").mkdir(parents=True)
    for link in ("l1", "l2"):
        os.symlink(chain / "d1", root / "cls" / link)


def test_links_that_fan_out_list_the_file_once(tmp_path, jpegs):
    """34 links, 17 levels: torchvision would list one file 131,072 times; it is listed
    once, under the first of its names, with a warning that links were not followed."""
    root = tmp_path / "root"
    _fan_out(root, 17, jpegs[0])
    with pytest.warns(RuntimeWarning, match=r"17 link\(s\) to folders already listed in "
                                            r"the same class were not followed again"):
        src = en.ImageFolder(root)
    assert len(src) == 1
    assert os.path.relpath(src.path(0), root) == os.path.join("cls", *["l1"] * 17, "x.jpg")
    assert src.read(0) == jpegs[0]


def test_links_between_classes_still_list_in_each(tmp_path, jpegs):
    """A class folder linked from another class is listed in both (as torchvision does):
    only a second name for a folder within the same class is skipped."""
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    (root / "a" / "1.jpg").write_bytes(jpegs[0])
    os.symlink(root / "a", root / "b" / "also_a")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        src = en.ImageFolder(root)
    assert [os.path.relpath(src.path(i), root) for i in range(len(src))] == \
        ["a/1.jpg", "b/also_a/1.jpg"]
    assert src.labels.tolist() == [0, 1]


def test_max_samples_is_a_clear_limit(tmp_path, jpegs):
    """A folder that lists more than max_samples files: a ValueError naming the limit and
    how to raise it, found during the walk."""
    root = tmp_path / "root"
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(6):
            (root / c / f"{i}.jpg").write_bytes(jpegs[i])
    assert len(en.ImageFolder(root, max_samples=12)) == 12
    with pytest.raises(ValueError, match=re.escape("lists more than max_samples=10 files") +
                       r".*pass a larger max_samples"):
        en.ImageFolder(root, max_samples=10)
    for bad in (0, -1, 2.5, True, "10"):
        with pytest.raises(ValueError, match="max_samples must be a positive integer"):
            en.ImageFolder(root, max_samples=bad)

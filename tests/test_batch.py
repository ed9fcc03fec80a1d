"""What crosses from the ring to the consumer (``echo_native.batch``) as units: a Batch's
copy owns its memory, its release gives the slot back once; the Fresh batch an echo
stage takes; the Books a loader and a stage keep for ``stats()``.

Echo outputs surviving the next batch are in ``test_pipeline.py``; Mix targets through a
copy in ``test_mix.py``.
"""
from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest

import echo_native as en
from echo_native import batch as batch_module
from echo_native.batch import Batch, Books, Fresh

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import sources_helpers as sh  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def views(n=4, h=3, w=5, epoch=2, targets=True):
    """A Batch whose arrays are all views of one buffer (as of a ring slot), and the buffer."""
    buf = np.arange(4096, dtype=np.uint8)
    at = [0]

    def take(shape, dtype):
        dtype = np.dtype(dtype)
        size = int(np.prod(shape)) * dtype.itemsize
        out = buf[at[0]:at[0] + size].view(dtype).reshape(shape)
        at[0] += -(-size // 8) * 8
        return out

    b = Batch(images=take((n, h, w, 3), np.uint8), labels=take((n,), np.int64),
              sample_ids=take((n,), np.int64), fresh=take((n,), np.bool_),
              echo_index=take((n,), np.int64), crop_boxes=take((n, 4), np.float32),
              flips=take((n,), np.bool_), epoch=epoch,
              targets=take((n, 3), np.float32) if targets else None)
    return b, buf


FIELDS = ("images", "labels", "sample_ids", "fresh", "echo_index", "crop_boxes", "flips")


# ---- Batch -----------------------------------------------------------------------------
def test_a_copy_owns_its_memory_and_keeps_every_value():
    """copy(): every array (targets too) equal in value, dtype and shape to the batch's,
    none sharing its memory, so overwriting the slot leaves the copy as it was."""
    b, buf = views()
    c = b.copy()
    before = {f: getattr(b, f).copy() for f in FIELDS + ("targets",)}
    for f in FIELDS + ("targets",):
        orig, mine = getattr(b, f), getattr(c, f)
        assert mine.dtype == orig.dtype and mine.shape == orig.shape
        assert np.array_equal(mine, orig) and not np.shares_memory(mine, buf), f
    assert c.epoch == b.epoch == 2
    buf[:] = 0xAB                        # the slot is reused
    for f in FIELDS + ("targets",):
        assert np.array_equal(getattr(c, f), before[f]), f"{f} changed with the slot"


def test_a_copy_without_targets_has_none_and_does_not_release_the_slot():
    """A batch without soft targets copies as one without; releasing the copy does not
    give back the original's slot (only the original holds it)."""
    b, _ = views(targets=False)
    calls = []
    b._release = lambda: calls.append("released")
    c = b.copy()
    assert c.targets is None
    c.release()
    assert calls == []
    b.release()
    assert calls == ["released"]


def test_release_gives_the_slot_back_once():
    """release() calls the slot's release once, however often it is called; a batch with
    nothing to release does nothing."""
    b, _ = views()
    calls = []
    b._release = lambda: calls.append(1)
    for _ in range(3):
        b.release()
    assert calls == [1]
    lone, _ = views()
    lone.release()                       # no slot: nothing to give back, no error


def test_len_is_the_number_of_samples():
    """len(batch) counts its samples (a short last batch included)."""
    assert len(views(n=4)[0]) == 4
    assert len(views(n=1)[0]) == 1


def test_a_loader_batch_copy_survives_the_slots_reuse_and_release_frees_it_once():
    """Through a real Loader (2 slots, one thread worker): a batch's release hands its slot
    to the workers, who fill it with a later batch; a copy taken before still holds the
    first batch's own center crops."""
    blobs = sh.photo_jpegs(12, seed=31)
    src = en.Samples(blobs, np.arange(12) % 3)
    with en.Loader(src, 4, augment=en.CenterCrop((8, 8)), workers=1, worker_mode="thread",
                   slots=2, shuffle=False) as loader:
        it = iter(loader)
        first = next(it)
        kept = first.copy()
        ring = loader.ring
        assert ring.is_published(0)
        first.release()
        assert not ring.is_published(0) and ring.is_past(0)
        first.release()                  # once: ticket 2's fill is not handed on early
        rest = [b.sample_ids.tolist() for b in it]
    assert rest == [[4, 5, 6, 7], [8, 9, 10, 11]]
    assert kept.sample_ids.tolist() == [0, 1, 2, 3]
    for row, sid in enumerate(kept.sample_ids):
        assert np.array_equal(kept.images[row], en.decode_center_crop(blobs[sid], (8, 8)))


# ---- Fresh -------------------------------------------------------------------------------
def test_fresh_counts_its_rows():
    """Fresh.count is its number of rows (zero for an empty fresh batch)."""
    ids = np.array([5, 2, 9], np.int64)
    f = Fresh(ticket=7, epoch=1, index=2, sample_ids=ids, ok=np.ones(3, bool), payload=None)
    assert f.count == 3 and f.fill_s == 0.0
    assert Fresh(0, 0, 0, np.zeros(0, np.int64), np.zeros(0, bool), None).count == 0


# ---- Books -------------------------------------------------------------------------------
@pytest.fixture
def clock(monkeypatch):
    """The books' clock, scripted: ``clock.t`` is what perf_counter returns."""
    c = types.SimpleNamespace(t=100.0)
    monkeypatch.setattr(batch_module, "time", types.SimpleNamespace(perf_counter=lambda: c.t))
    return c


def test_books_before_start_report_zero_rates(clock):
    """Books never started: counts as they are, rates zero (never a division by zero)."""
    books = Books()
    books.fresh, books.delivered, books.batches, books.wait_s = 3, 6, 2, 0.5
    assert books.rates() == {"fresh": 3, "delivered": 6, "batches": 2, "fresh_per_s": 0.0,
                             "delivered_per_s": 0.0, "stall_s": 0.5}


def test_books_rates_are_per_second_since_the_first_start(clock):
    """Rates divide by the time since start(); a second start() does not restart the
    clock; no time elapsed yet means zero rates."""
    books = Books()
    books.start()
    assert books.rates()["fresh_per_s"] == 0.0
    clock.t = 102.0
    books.start()
    books.fresh, books.delivered, books.batches, books.wait_s = 40, 100, 5, 1.25
    clock.t = 104.0
    assert books.rates() == {"fresh": 40, "delivered": 100, "batches": 5, "fresh_per_s": 10.0,
                             "delivered_per_s": 25.0, "stall_s": 1.25}

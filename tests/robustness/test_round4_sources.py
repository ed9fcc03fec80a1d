"""Round four against the sources: labels given to FileList as Python rows, and the seed's
full documented range in the sampling plan.

What a user gets: a float or bool label in a FileList row is refused naming the row and
the value (a class index is never truncated, as Samples and check_labels refuse 2.5);
every seed in [0, 2**64) keys its own epoch order, exactly.
"""
from __future__ import annotations

import numpy as np
import pytest

import echo_native as en
from echo_native.plan import Plan

pytestmark = pytest.mark.timeout(60)


# -- item 25: float and bool labels in FileList rows -------------------------------------
@pytest.mark.parametrize("label, shown", [
    (1.5, "1.5"), (np.float32(2.5), "2.5"), (float("nan"), "nan"), (float("inf"), "inf"),
    (True, "True"), (np.bool_(False), "False"), (1e30, "1e+30"), (2.0**63, "9.223372036854776e+18"),
])
def test_a_float_or_bool_label_in_a_row_is_refused_not_truncated(label, shown):
    # int(1.5) is 1 and int(True) is 1: the row used to become class 1 without a word.
    with pytest.raises(ValueError) as err:
        en.FileList([("a.jpg", 0), ("b.jpg", label)])
    msg = str(err.value)
    assert "row 1" in msg and "'b.jpg'" in msg and shown in msg, msg


def test_integral_labels_of_every_integer_kind_are_kept_exactly():
    # pandas hands a label column with gaps as floats: 3.0 is class 3, as check_labels says.
    src = en.FileList([("a.jpg", 3.0), ("b.jpg", np.int64(2**63 - 1)), ("c.jpg", "-7"),
                       ("d.jpg", np.uint8(200)), ("e.jpg", np.float64(-4.0)), ("f.jpg", 5)])
    assert src.labels.tolist() == [3, 2**63 - 1, -7, 200, -4, 5]


def test_a_label_that_is_not_a_number_is_refused_naming_the_row():
    for label in (None, [1], object(), "1.0", "one"):
        with pytest.raises(ValueError, match=r"row 0: label .* of 'a\.jpg' is not an integer"):
            en.FileList([("a.jpg", label)])


def test_a_list_file_still_reads_text_labels(tmp_path):
    lst = tmp_path / "list.csv"
    lst.write_text("path,label\na.jpg, 4\nb.jpg,1.5\n")
    with pytest.raises(ValueError, match=r"list\.csv:3: label '1\.5' of 'b\.jpg' is not an "
                                         r"integer"):
        en.FileList(str(lst))


# -- item 16: seeds past 2**63 ----------------------------------------------------------
def _order(seed, epoch=0, n=64):
    return Plan(total_samples=n, batch_size=8, transform=None, seed=seed).global_order(epoch)


@pytest.mark.parametrize("seed", [2**63, 2**64 - 2])
def test_seeds_past_2_63_each_key_their_own_order(seed):
    # The key went through float64 (numpy's array of [2**63, tag]): 2**63 and 2**63 + 1 were
    # one seed, as were the 2**10 seeds around any value past 2**63.
    assert not np.array_equal(_order(seed), _order(seed + 1))
    assert sorted(_order(seed).tolist()) == list(range(64))


def test_seeds_below_2_63_keep_the_order_they_always_had():
    # Saved runs resume on the same order: the key's bits for a seed below 2**63 are unchanged.
    for seed in (0, 1, 12345, 2**63 - 1):
        gen = np.random.Generator(np.random.Philox(key=[seed, 0x6F72646572],
                                                   counter=[3, 0, 0, 0]))
        assert np.array_equal(_order(seed, epoch=3), gen.permutation(64))


def test_the_largest_seed_is_its_own_and_stand_ins_use_the_whole_seed():
    top = 2**64 - 1
    assert not np.array_equal(_order(top), _order(top - 1))
    plan = Plan(total_samples=1000, batch_size=8, transform=None, seed=2**63)
    other = Plan(total_samples=1000, batch_size=8, transform=None, seed=2**63 + 1)
    picks = [plan.replacement(0, s, 0) for s in range(32)]
    assert picks != [other.replacement(0, s, 0) for s in range(32)]


def test_detection_draws_past_2_63_are_keyed_by_the_whole_seed():
    """The detection planner's Philox key, built the same way: two seeds past 2**63 draw
    their own zoom-outs, crops and flips."""
    crop = en.detection.BoxCrop((32, 32), zoom_out=en.RandomZoomOut(), flip_p=0.5)
    boxes = np.float32([[4, 4, 20, 20]])

    def draws(seed):
        return [crop.draw((seed, 0, i, 0), (48, 64), boxes)[0] for i in range(16)]

    assert draws(2**63) != draws(2**63 + 1)
    # below 2**63 the key's bits (so every draw) are what a list key gave
    assert draws(12345) == draws(12345)


def test_tar_shard_orders_past_2_63_are_keyed_by_the_whole_seed(tmp_path):
    """TarShards' per-epoch shard order, keyed the same way."""
    from PIL import Image
    import io

    samples = []
    for i in range(12):
        buf = io.BytesIO()
        Image.new("RGB", (8, 8), (i * 20, 0, 0)).save(buf, "JPEG")
        samples.append(buf.getvalue())
    shards = en.write_shards(en.Samples(samples, labels=[i % 3 for i in range(12)]),
                             tmp_path / "shards", max_count=1)
    source = en.TarShards(shards)
    orders = [tuple(source.epoch_order(s, 0)) for s in (2**63, 2**63 + 1, 2**63 + 2)]
    assert len(set(orders)) > 1
    assert sorted(orders[0]) == list(range(12))

"""EchoLoader over Hugging Face ``datasets`` batches in every format, and plain generators.

A batch of ``datasets`` is a dict of columns (python, numpy, torch formats) or a
``pyarrow.Table`` (arrow format); a token column is a list of per-example lists, a
ragged column a list (or object array) of per-example arrays.  Each test builds a tiny
dataset in memory whose values encode the example's id (row i of "ids" is
[100 i, 100 i + 1, ...]), so a row scrambled across examples cannot pass, and checks:
every emitted row is one example's, whole; each example comes e times per epoch; no
batch holds an example twice; and the batch comes back as the kind that went in.
"""
from __future__ import annotations

import collections

import pytest

import echo_native as en

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
torch = pytest.importorskip("torch")

N, B = 40, 8


def tokens(i):
    """Example i's ragged token ids: 2 to 4 of them, each naming i."""
    return [100 * i + j for j in range(2 + i % 3)]


def fixed(i):
    return [100 * i + j for j in range(3)]


def dataset(columns=("idx", "ids", "fix", "text"), n=N):
    data = {"idx": list(range(n)), "ids": [tokens(i) for i in range(n)],
            "fix": [fixed(i) for i in range(n)], "text": [f"line {i}" for i in range(n)]}
    return datasets.Dataset.from_dict({k: data[k] for k in columns})


class Batches:
    """``ds.iter(batch_size=...)`` afresh at each iteration: a loader of many epochs."""

    def __init__(self, ds, batch_size=B):
        self.ds, self.batch_size = ds, batch_size

    def __iter__(self):
        return iter(self.ds.iter(batch_size=self.batch_size))


def as_list(x):
    return x.tolist() if hasattr(x, "tolist") else list(x)


def plain(v):
    """A batch's value for one example as plain Python (numpy and torch values included)."""
    if hasattr(v, "tolist"):
        return v.tolist()
    return list(v) if isinstance(v, (list, tuple)) else v


def rows_of(batch):
    """The batch's examples as dicts of plain Python values."""
    if isinstance(batch, pa.Table):
        return batch.to_pylist()
    n = len(next(iter(batch.values())))
    return [{k: plain(v[r]) for k, v in batch.items()} for r in range(n)]


def check_whole(rows):
    """Every row is one example's: its token ids, fixed ids and text all name one id."""
    seen = []
    for row in rows:
        i = row["ids"][0] // 100 if "ids" in row else row["fix"][0] // 100
        if "idx" in row:
            assert row["idx"] == i
        if "ids" in row:
            assert row["ids"] == tokens(i), f"example {i}'s tokens came out as {row['ids']}"
        if "fix" in row:
            assert row["fix"] == fixed(i), f"example {i}'s tokens came out as {row['fix']}"
        if "text" in row:
            assert row["text"] == f"line {i}"
        seen.append(i)
    return seen


def check_epoch(batches, e=2, n=N):
    """Rows whole, each example e times, never twice in one batch."""
    ids = []
    for batch in batches:
        seen = check_whole(rows_of(batch))
        assert len(set(seen)) == len(seen), f"a batch holds an example twice: {seen}"
        ids.extend(seen)
    assert collections.Counter(ids) == {i: e for i in range(n)}


# ---- every format, map-style and iterable -------------------------------------------------
@pytest.mark.parametrize("placement", ["after_augment", "batch"])
@pytest.mark.parametrize("iterable", [False, True], ids=["map", "iterable"])
@pytest.mark.parametrize("fmt", [None, "numpy", "torch", "arrow"])
def test_each_example_comes_out_whole_in_every_format(fmt, iterable, placement):
    """Ragged token lists, fixed-length token lists, ids and texts of a dataset's batches,
    in its python, numpy, torch and arrow formats: each emitted row is one example's, each
    example twice per epoch over two epochs, and the batches are of the format's kind (a
    dict of lists stays one, a table comes back as a table of the same schema), whether
    examples or whole batches are repeated."""
    ds = dataset()
    if iterable:
        ds = ds.to_iterable_dataset()
    ds = ds.with_format(fmt)
    el = en.EchoLoader(Batches(ds), echo=en.Echo(2, placement=placement), seed=5)
    first = next(iter(ds.iter(batch_size=B)))
    for epoch in range(2):
        batches = list(el)
        check_epoch(batches)
        for batch in batches:
            assert type(batch) is type(first)
            if isinstance(first, pa.Table):
                assert batch.schema.equals(first.schema)
            else:
                assert set(batch) == set(first)
                for key in ("idx", "fix", "text"):
                    assert type(batch[key]) is type(first[key]), key


@pytest.mark.parametrize("iterable", [False, True], ids=["map", "iterable"])
def test_a_dataset_of_batches_is_a_loader(iterable):
    """``ds.batch(n)`` makes a dataset whose items are batches (every column a list): it is
    a loader of batches, read every epoch, each example whole and twice per epoch."""
    ds = dataset()
    ds = (ds.to_iterable_dataset() if iterable else ds).batch(B)
    el = en.EchoLoader(ds, echo=2, seed=10)
    for epoch in range(2):
        check_epoch(list(el))


def test_a_token_column_alone_is_read_as_rows_not_as_columns():
    """The issue's own case: {"ids": [[0, 1, 2], [100, 101, 102], ...]} and nothing else
    (a tokenizer's output without return_tensors) is 8 rows of 3 tokens, never 3 rows
    mixing the tokens of different examples."""
    batches = list(en.EchoLoader(Batches(dataset(("fix",))), echo=2, seed=1))
    for batch in batches:
        assert isinstance(batch["fix"], list) and all(isinstance(r, list) for r in batch["fix"])
    check_epoch(batches)


def test_a_token_column_beside_an_id_column_keeps_both_whole():
    """The same column beside a right one (the ids): no error blaming the ids, rows whole."""
    batches = list(en.EchoLoader(Batches(dataset(("idx", "ids"))), echo=3, seed=2))
    check_epoch(batches, e=3)


def test_a_ragged_column_that_comes_stacked_in_one_batch_is_still_per_example():
    """Numpy and torch formats stack a ragged column when a batch's rows happen to share a
    length and give a list (an object array) of rows otherwise: both are one value per
    example, whichever comes first, as long as the first is ragged."""
    lengths = [2, 3, 4, 2] * 2 + [3] * 8 + [4, 2, 3, 2] * 2   # the second batch: all 3
    ids = [[100 * i + j for j in range(k)] for i, k in enumerate(lengths)]
    for fmt in ("numpy", "torch"):
        ds = datasets.Dataset.from_dict({"idx": list(range(24)), "ids": ids}).with_format(fmt)
        kinds = [(type(b["ids"]).__name__, str(getattr(b["ids"], "dtype", None)))
                 for b in ds.iter(batch_size=B)]
        assert kinds[0] == kinds[2] != kinds[1]   # the format stacks the second batch
        rows = []
        for batch in en.EchoLoader(Batches(ds), echo=2, seed=3):
            for i, r in zip(as_list(batch["idx"]), batch["ids"]):
                assert as_list(r) == ids[i], f"{fmt}: example {i} came out as {r}"
                rows.append(i)
        assert collections.Counter(rows) == {i: 2 for i in range(24)}


def test_numpy_strings_of_another_width_are_stored():
    """Numpy format gives texts as a fixed-width unicode array whose width follows the
    batch's longest text: a wider one later is stored, not refused."""
    texts = ["a"] * 8 + ["a much longer line"] * 8 + ["bb"] * 8
    ds = datasets.Dataset.from_dict({"idx": list(range(24)), "text": texts})
    out = list(en.EchoLoader(Batches(ds.with_format("numpy")), echo=2, seed=4))
    got = collections.Counter((int(i), str(t)) for b in out for i, t in zip(b["idx"], b["text"]))
    assert got == {(i, t): 2 for i, t in enumerate(texts)}


# ---- plain generators -----------------------------------------------------------------------
def test_a_generator_of_token_lists_with_a_short_last_batch():
    """A generator of dicts of lists (what a tokenizer without return_tensors gives),
    its last batch of 2 examples of 2 tokens each: still 2 rows, not an [x, y] of 2
    columns; tuples stay tuples (the column and its values)."""
    def gen():
        for start in range(0, 18, 8):
            stop = min(start + 8, 18)
            yield {"ids": [[100 * i, 100 * i + 1] for i in range(start, stop)],
                   "pair": tuple((i, -i) for i in range(start, stop))}

    out = list(en.EchoLoader(gen(), echo=2, seed=6))
    seen = []
    for batch in out:
        assert isinstance(batch["pair"], tuple) and all(isinstance(p, tuple)
                                                        for p in batch["pair"])
        for ids, pair in zip(batch["ids"], batch["pair"]):
            i = ids[0] // 100
            assert ids == [100 * i, 100 * i + 1] and pair == (i, -i)
            seen.append(i)
    assert collections.Counter(seen) == {i: 2 for i in range(18)}


def test_a_collated_pair_keeps_its_structure_down_to_a_last_batch_of_two():
    """A DataLoader's collated ``[x, names]`` (a tensor and a list of strings): a list of
    two fields, also in the last batch of two examples, where it has the batch's length."""
    from torch.utils.data import DataLoader

    data = [(torch.full((3,), float(i)), f"n{i}") for i in range(10)]
    dl = DataLoader(data, batch_size=4)
    kinds = {(type(b).__name__, type(b[1]).__name__) for b in dl}   # [tensor, tuple of str]
    out = list(en.EchoLoader(dl, echo=2, seed=7))
    seen = []
    for batch in out:
        assert (type(batch).__name__, type(batch[1]).__name__) in kinds and len(batch) == 2
        x, names = batch
        assert isinstance(x, torch.Tensor) and x.shape[1:] == (3,)
        assert list(names) == [f"n{int(v)}" for v in x[:, 0]]
        seen.extend(int(v) for v in x[:, 0])
    assert collections.Counter(seen) == {i: 2 for i in range(10)}


@pytest.mark.parametrize("placement", ["after_augment", "batch"])
def test_a_repeat_is_not_changed_by_a_consumer_that_edits_its_lists(placement):
    """A consumer that appends to a token list in place (an end-of-sequence id) changes
    that emission only, not the example's repeats still to come."""
    out = []
    echo = en.Echo(2, placement=placement)
    for batch in en.EchoLoader(Batches(dataset(("ids",))), echo=echo, seed=8):
        for row in batch["ids"]:
            out.append(list(row))
            row.append(-1)
    assert all(r == tokens(r[0] // 100) for r in out)
    assert collections.Counter(r[0] // 100 for r in out) == {i: 2 for i in range(N)}


def test_a_detection_loaders_per_image_target_dicts_follow_their_images():
    """A detection collate's ``(images, targets)``: targets a tuple of one dict per image
    with its own number of boxes (the last batch of two images included).  Each target
    dict is one example's value: it comes back whole, beside its image."""
    from torch.utils.data import DataLoader

    def target(i):
        return {"boxes": torch.full((1 + i % 3, 4), float(i)),
                "labels": torch.full((1 + i % 3,), i)}

    data = [(torch.full((3, 2, 2), float(i)), target(i)) for i in range(10)]
    dl = DataLoader(data, batch_size=4, collate_fn=lambda b: (torch.stack([x for x, _ in b]),
                                                              tuple(t for _, t in b)))
    seen = []
    for images, targets in en.EchoLoader(dl, echo=2, seed=9):
        assert isinstance(targets, tuple) and len(targets) == len(images)
        for image, t in zip(images, targets):
            i = int(image[0, 0, 0])
            assert set(t) == {"boxes", "labels"}
            assert torch.equal(t["boxes"], target(i)["boxes"])
            assert torch.equal(t["labels"], target(i)["labels"])
            seen.append(i)
    assert collections.Counter(seen) == {i: 2 for i in range(10)}

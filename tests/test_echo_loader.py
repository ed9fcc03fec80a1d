"""EchoLoader around loaders nobody here wrote: torch's DataLoader (with worker processes),
torchdata's StatefulDataLoader, Hugging Face datasets, plain generators.

Each test states the property it checks: every example echoed e times per epoch (in
expectation for a fractional e), batches of the wrapped loader's own kind and structure,
per-example values following their examples, determinism for a seed, bounded memory,
the wrapped loader's errors reaching the consumer, a clean stop, tensors that never
leave their device, an exact resume, and auto echo's measurements on a scripted clock.
"""
from __future__ import annotations

import collections
import dataclasses
import gc
import multiprocessing
import os
import subprocess
import sys
import time
import traceback

import numpy as np
import pytest

import echo_native as en
from echo_native import echo_loader

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset  # noqa: E402


class Dicts(Dataset):
    """A map-style dataset of dicts: a tensor, its id, and a string that names it."""

    def __init__(self, n=96):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.full((4,), float(i)), "id": i, "name": f"item-{i}"}


def loader(n=96, B=8, workers=2, seed=0, **kw):
    return DataLoader(Dicts(n), batch_size=B, shuffle=True, num_workers=workers,
                      generator=torch.Generator().manual_seed(seed), **kw)


def ids_of(batches):
    return [int(i) for b in batches for i in b["id"]]


def check_rows(batch):
    """Every row is one example: its tensor, id and name agree."""
    assert torch.equal(batch["x"][:, 0].long(), batch["id"])
    assert batch["name"] == [f"item-{int(i)}" for i in batch["id"]]


# ---- echo counts, structure and per-example values ------------------------------------------
@pytest.mark.parametrize("e", [1, 2, 3])
def test_a_dataloader_with_workers_is_echoed_e_times_per_epoch(e):
    """Integer e over a DataLoader with 2 worker processes: each example exactly e times
    per epoch, in dicts like the loader's, rows intact, and never twice in one batch."""
    el = en.EchoLoader(loader(), echo=e, seed=1)
    for epoch in range(2):
        el.set_epoch(epoch)
        batches = list(el)
        assert np.bincount(ids_of(batches), minlength=96).tolist() == [e] * 96
        for b in batches:
            assert set(b) == {"x", "id", "name"} and isinstance(b["x"], torch.Tensor)
            check_rows(b)
        assert all(len(set(b["id"].tolist())) == len(b["id"]) for b in batches)
        assert len(batches) == len(el)
    s = el.stats()
    assert s["effective_echo"] == pytest.approx(e) and s["fresh"] == 2 * 96


@pytest.mark.parametrize("e, buffer", [(2, 24), (3, 40), (4, 40)])
def test_the_end_of_an_epoch_emits_distinct_examples_in_a_short_last_batch(e, buffer):
    """At the end of an epoch fewer distinct examples remain than a batch's worth of
    repeats: no batch holds one twice, every batch but the last is full (as
    DataLoader(drop_last=False)), and len() counts them (a buffer of (ceil(e) + 1)
    batches at least, where that is exact)."""
    el = en.EchoLoader(loader(n=44, workers=0), echo=e, seed=2, shuffle_buffer=buffer)
    for epoch in range(3):
        el.set_epoch(epoch)
        batches = list(el)
        for b in batches:
            assert len(set(b["id"].tolist())) == len(b["id"]), b["id"].tolist()
            check_rows(b)
        assert all(len(b["id"]) == 8 for b in batches[:-1])
        assert len(batches) == len(el)


def test_an_epoch_smaller_than_a_batch_repeats_in_batches_of_its_own():
    """Five examples at e = 3 in batches of 8: three batches of the five, never one of eight
    with an example twice."""
    batches = list(en.EchoLoader([np.arange(5)], echo=3, batch_size=8))
    assert [sorted(b.tolist()) for b in batches] == [[0, 1, 2, 3, 4]] * 3


def test_a_fractional_echo_delivers_e_times_the_fresh_examples_within_one_percent():
    """e = 2.5 over 4,000 examples: delivered / fresh = 2.5 within 1% in one epoch, each
    example 2 or 3 times."""
    data = [np.arange(i, i + 40) for i in range(0, 4000, 40)]
    el = en.EchoLoader(data, echo=2.5, seed=3)
    counts = np.bincount(np.concatenate(list(el)), minlength=4000)
    assert set(counts.tolist()) == {2, 3}
    assert counts.sum() / 4000 == pytest.approx(2.5, rel=0.01)


def test_nested_batches_keep_their_structure():
    """Tuples of a namedtuple and a dataclass, with a per-example list and a constant, come
    back as the same types, rows aligned."""
    Pair = collections.namedtuple("Pair", "a b")

    @dataclasses.dataclass
    class Meta:
        tags: list
        source: str

    def gen():
        for k in range(6):
            ids = np.arange(8 * k, 8 * k + 8)
            yield (Pair(ids, ids * 10.0), Meta([f"t{i}" for i in ids], "corpus"))

    out = list(en.EchoLoader(gen(), echo=2))
    assert sum(len(p.a) for p, _ in out) == 96
    for pair, meta in out:
        assert isinstance(pair, Pair) and isinstance(meta, Meta)
        assert np.array_equal(pair.b, pair.a * 10.0)
        assert meta.tags == [f"t{i}" for i in pair.a] and meta.source == "corpus"


def test_hugging_face_datasets_through_torch_formatting():
    """A Hugging Face dataset built in memory, formatted for torch, in a DataLoader:
    each row twice at e = 2, its text following its id."""
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"id": list(range(60)),
                                     "text": [f"line {i}" for i in range(60)]})
    dl = DataLoader(ds.with_format("torch"), batch_size=6, shuffle=True,
                    generator=torch.Generator().manual_seed(0))
    batches = list(en.EchoLoader(dl, echo=2))
    assert np.bincount(ids_of(batches), minlength=60).tolist() == [2] * 60
    assert all(b["text"] == [f"line {int(i)}" for i in b["id"]] for b in batches)


def test_a_generator_is_one_epoch_and_batch_echo_repeats_whole_batches():
    """Batch placement: each of a generator's batches e times, whole, never back to back
    while another is in the window."""
    def gen():
        for k in range(10):
            yield np.arange(4 * k, 4 * k + 4)

    out = [tuple(b.tolist()) for b in en.EchoLoader(gen(), echo=en.Echo(3, placement="batch"))]
    assert sorted(out) == sorted([tuple(range(4 * k, 4 * k + 4)) for k in range(10)] * 3)
    body = out[:20]   # before the window drains at the epoch's end, where a batch may be alone
    assert all(a != b for a, b in zip(body, body[1:]))


def test_before_augmentation_every_emission_is_augmented_with_its_own_key():
    """augment(batch, keys) runs on every emitted batch, keys giving (seed, epoch, example
    id, echo index) per row: each example's emissions carry echo indices 0 .. e-1."""
    seen = []

    def augment(batch, keys):
        seen.append(keys.copy())
        return batch + 1000 * keys[:, 3]

    data = [np.arange(i, i + 8) for i in range(0, 64, 8)]
    out = np.concatenate(list(en.EchoLoader(data, echo=3, augment=augment, seed=5)))
    keys = np.concatenate(seen)
    assert (keys[:, 0] == 5).all() and (keys[:, 1] == 0).all()
    assert np.array_equal(out % 1000, keys[:, 2])           # the id is the example's row
    assert np.array_equal(out // 1000, keys[:, 3])
    for i in range(64):
        assert sorted(keys[keys[:, 2] == i, 3].tolist()) == [0, 1, 2]


def test_the_same_seed_gives_the_same_batches():
    """Deterministic for a seed (the wrapped loader being deterministic), another seed
    gives another order."""
    def run(seed):
        return np.concatenate(list(en.EchoLoader([np.arange(i, i + 8) for i in range(0, 80, 8)],
                                                 echo=2.5, seed=seed)))

    assert np.array_equal(run(7), run(7))
    assert not np.array_equal(run(7), run(8))


# ---- memory, errors, shutdown -------------------------------------------------------------
def test_a_buffer_over_its_cap_is_refused_naming_the_setting():
    """A shuffle buffer that would hold more than max_buffer_bytes is a MemoryError at the
    first batch naming shuffle_buffer and max_buffer_bytes."""
    data = [np.zeros((8, 1024), np.float64)] * 4
    with pytest.raises(MemoryError, match="max_buffer_bytes=100,000: lower shuffle_buffer"):
        list(en.EchoLoader(data, echo=2, max_buffer_bytes=100_000))


class Failing(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 37:
            raise KeyError(f"sample {i} is missing from the shard index")
        return np.float32(i)


def test_the_wrapped_loaders_error_reaches_the_consumer_with_its_traceback():
    """An exception inside the wrapped loader's worker is raised to the consumer as the
    loader raises it, naming the sample, with the worker's traceback."""
    dl = DataLoader(Failing(), batch_size=8, num_workers=1)
    with pytest.raises(KeyError, match="sample 37 is missing") as info:
        list(en.EchoLoader(dl, echo=2))
    assert "__getitem__" in "".join(traceback.format_exception(info.value))


_DYING = """
import os, sys, numpy as np
import echo_native as en
from torch.utils.data import DataLoader, Dataset

class Dying(Dataset):
    def __len__(self):
        return 60

    def __getitem__(self, i):
        if i == 30:
            os._exit(3)  # a worker killed mid-epoch (the OOM killer, a crash)
        return np.float32(i)

# Batches are NumPy arrays, sent through the result pipe: a collated tensor would
# travel as a file descriptor that the main process fetches from the worker, and a
# worker dead by then fails that fetch with a ConnectionResetError (torch's own race).
dl = DataLoader(Dying(), batch_size=5, num_workers=1, timeout=60, collate_fn=np.stack)
el = en.EchoLoader(dl, echo=2)
try:
    n = sum(len(b) for b in el)
except RuntimeError as e:
    print("raised:", e, flush=True)
    el.close()
    sys.exit(0)
sys.exit(f"no error after {n} examples")
"""


def test_a_dead_worker_of_the_wrapped_loader_stops_iteration_with_its_error(tmp_path):
    """A worker of the wrapped DataLoader that dies is the DataLoader's RuntimeError at
    the consumer, not a hang.  (In a script of its own: torch reports a dead worker
    through a SIGCHLD handler of the whole process.)"""
    script = tmp_path / "dying.py"
    script.write_text(_DYING)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(en.__file__))}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=240, env=env, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "raised: DataLoader worker" in r.stdout and "exited unexpectedly" in r.stdout


def _no_children():
    gc.collect()
    deadline = time.monotonic() + 60
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not multiprocessing.active_children()


def test_breaking_out_early_then_closing_stops_the_wrapped_workers():
    """A consumer that breaks out after a few batches and closes the EchoLoader leaves no
    worker process of the wrapped DataLoader behind."""
    el = en.EchoLoader(loader(n=400, workers=2), echo=2)
    for k, _ in enumerate(el):
        if k == 3:
            break
    el.close()
    _no_children()


def test_leaving_an_epoch_early_and_iterating_again_continues_it():
    """Break after a few batches, iterate again: the two iterations together are one
    epoch, each example twice."""
    el = en.EchoLoader(loader(workers=0), echo=2)
    first = []
    for b in el:
        first.append(b)
        if len(first) == 5:
            break
    rest = list(el)
    assert np.bincount(ids_of(first + rest), minlength=96).tolist() == [2] * 96


# ---- tensors stay on their device ------------------------------------------------------------
class MetaBatches:
    """Batches of tensors on torch's "meta" device: shapes without data, so any copy to
    the host raises.  Stands in for CUDA tensors where there is no GPU."""

    def __len__(self):
        return 6

    def __iter__(self):
        for _ in range(6):
            yield {"x": torch.empty((8, 3, 32, 32), device="meta"),
                   "y": torch.empty((8,), dtype=torch.int64, device="meta")}


@pytest.mark.parametrize("echo", [2, en.Echo(2, placement="batch"), 1])
def test_example_echo_never_copies_device_tensors_to_the_host(echo):
    """Storing and gathering happen on the tensors' device: meta tensors, which cannot be
    copied to the host, come out as meta tensors of the same shapes."""
    out = list(en.EchoLoader(MetaBatches(), echo=echo))
    assert len(out) == 6 * (1 if echo == 1 else 2)
    for b in out:
        assert b["x"].device.type == "meta" and b["x"].shape == (8, 3, 32, 32)
        assert b["y"].device.type == "meta" and b["y"].dtype == torch.int64


# ---- resume ---------------------------------------------------------------------------------
def test_a_resume_neither_repeats_nor_loses_a_fresh_example():
    """Saved mid-epoch around torchdata's StatefulDataLoader and restored into a new job:
    the examples emitted fresh before the save and after the restore are the epoch's,
    each exactly once."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def make():
        dl = stateful.StatefulDataLoader(Dicts(96), batch_size=8, shuffle=True, num_workers=2,
                                         generator=torch.Generator().manual_seed(11))
        return en.EchoLoader(dl, echo=2, seed=4, with_info=True)

    el = make()
    it = iter(el)
    before = [next(it) for _ in range(7)]
    state = el.state_dict()
    el.close()
    restored = make()
    restored.load_state_dict(state)
    after = list(restored)
    fresh = [int(i) for b, info in before + after for i in b["id"][torch.from_numpy(info["fresh"])]]
    assert sorted(fresh) == list(range(96))


def test_state_dict_needs_a_resumable_loader():
    """A wrapped loader without state_dict() makes EchoLoader.state_dict a TypeError that
    says what to wrap instead."""
    with pytest.raises(TypeError, match="StatefulDataLoader"):
        en.EchoLoader([np.arange(4)], echo=2).state_dict()


@pytest.mark.parametrize("path", ["some/path", b"some/path", "pathlib"])
def test_a_path_is_refused_at_construction_naming_echo_ring(path, tmp_path):
    """EchoLoader("some/path") would read the path's characters as batches: refused before
    the first batch, pointing to EchoRing for a folder."""
    path = tmp_path if path == "pathlib" else path
    with pytest.raises(TypeError, match=r"loader of batches.*en\.EchoRing\(path\)"):
        en.EchoLoader(path)


@pytest.mark.parametrize("which", ["Loader", "EchoRing"])
def test_an_echo_native_loader_is_refused_at_construction_naming_echo_ring(which, tmp_path):
    """The library's own loaders yield views of ring slots (objects padded per batch):
    EchoLoader refuses them before a worker starts, pointing to EchoRing, which runs the
    same echo on the slots."""
    from sources_helpers import photo_jpegs, write_folder

    folder = write_folder(tmp_path, photo_jpegs(4), [0, 1, 0, 1])
    loader = getattr(en, which)(folder, 2, image_size=32, workers=1)
    with pytest.raises(TypeError, match=rf"echo_native {which} .*en\.EchoRing\(source"):
        en.EchoLoader(loader, echo=2)
    inner = loader if which == "Loader" else loader.loader
    assert inner.ring is None and inner.worker_pids() == []


@pytest.mark.parametrize("kind", ["Dataset", "IterableDataset"])
def test_a_hugging_face_dataset_of_examples_is_refused_at_construction(kind):
    """A dataset yields single examples (its 'idx' one int each), not batches: refused
    before the first batch, naming its column and what to pass instead."""
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"idx": list(range(8)), "text": ["a"] * 8})
    ds = ds if kind == "Dataset" else ds.to_iterable_dataset()
    with pytest.raises(TypeError, match=rf"Hugging Face {kind} of single examples .*'idx'.*"
                                        rf"DataLoader\(ds, batch_size=.*ds\.iter\(batch_size="
                                        rf".*ds\.batch\(batch_size\)"):
        en.EchoLoader(ds)


def test_a_hugging_face_dataset_dict_is_refused_naming_its_splits():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"idx": list(range(8))})
    with pytest.raises(TypeError, match=r"DatasetDict of splits \['train'\]: pick a split"):
        en.EchoLoader(datasets.DatasetDict(train=ds))


def test_set_epoch_reaches_the_wrapped_sampler():
    """set_epoch is passed to the wrapped loader's sampler (DistributedSampler's contract)."""
    class Sampler(torch.utils.data.Sampler):
        def __init__(self):
            self.epochs = []

        def __iter__(self):
            return iter(range(16))

        def __len__(self):
            return 16

        def set_epoch(self, epoch):
            self.epochs.append(epoch)

    sampler = Sampler()
    el = en.EchoLoader(DataLoader(Dicts(16), batch_size=4, sampler=sampler), echo=2)
    el.set_epoch(3)
    assert sampler.epochs == [3] and el.epoch == 3
    assert len(list(el)) == 8


# ---- auto echo's measurements -----------------------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 0.0

    def perf_counter(self):
        return self.t


def test_the_upstream_reports_its_pace_only_when_the_consumer_waited(monkeypatch):
    """On a scripted clock: a batch the consumer waited 0.3 s for, 0.1 s after the one
    before, reports the 0.4 s between them (the loader's pace); one that was ready at
    once reports nothing (the loader kept up)."""
    clock = Clock()
    from echo_native.echo import iterable

    monkeypatch.setattr(iterable, "time", clock)
    waits = iter([0.0, 0.3, 0.0, 0.5])

    def batches():
        for k in range(4):
            clock.t += next(waits)          # the time next() blocks
            yield np.arange(4)

    up = echo_loader.IterableUpstream(batches())
    reported = []
    for _ in range(4):
        reported.append(up.next_fresh().fill_s)
        clock.t += 0.1                      # the consumer's work before the next batch
    assert reported == [0.0, pytest.approx(0.4), 0.0, pytest.approx(0.6)]


def test_auto_echo_probes_lower_while_the_loader_keeps_up():
    """Fed fresh batches without a wait, auto echo lowers e by 15% every 15 of them
    (reason "probe") down to 1, and forgets the upstream's measured pace."""
    auto = en.echo.AutoEcho(4.0)
    auto.upstream(0.3)
    for _ in range(14):
        auto.fed()
    assert auto.value == 4.0
    auto.fed()
    assert auto.value == pytest.approx(3.4) and auto.trace[-1]["reason"] == "probe"
    assert auto.t_up is None
    for _ in range(15 * 20):
        auto.fed()
    assert auto.value == 1.0
    auto.upstream(0.5)            # a wait resets the count
    assert auto._fed == 0


@pytest.mark.slow  # torch's workers take seconds to stop after each epoch
def test_iterating_again_is_the_next_epoch_and_the_workers_stop_at_each_end():
    """Without set_epoch, each iteration is the next epoch (each example twice in each);
    the wrapped DataLoader's iterator is run to its end with the epoch's last batch, so
    its worker processes are gone between epochs."""
    el = en.EchoLoader(loader(), echo=2)
    for epoch in range(2):
        ids = ids_of(list(el))
        assert np.bincount(ids, minlength=96).tolist() == [2] * 96
        assert el.epoch == epoch + 1
        _no_children()


def test_a_loader_with_more_batches_than_its_len_is_named():
    """A wrapped loader whose len() is short of what it yields is an error naming it,
    not a silently dropped batch."""
    class Liar:
        def __len__(self):
            return 2

        def __iter__(self):
            return iter([np.arange(4), np.arange(4, 8), np.arange(8, 12)])

    with pytest.raises(RuntimeError, match="more batches than its len"):
        list(en.EchoLoader(Liar(), echo=2))


# ---- len() before the first batch, and the buffer's cap ---------------------------------------
def test_len_before_the_first_batch_counts_what_iterating_delivers():
    """len() asks a stage like the one iterating makes: for batch echo with drop_last
    over a loader that declares its batch size (its last batch short), and for example
    echo whose buffer is given for the batch size read at the first batch, len() before
    any batch is what one epoch delivers."""
    for kw in ({"echo": en.Echo(2, placement="batch"), "drop_last": True},
               {"echo": 2, "shuffle_buffer": 24}):
        el = en.EchoLoader(loader(n=44, workers=0), seed=3, **kw)
        expected = len(el)
        assert expected == len(list(el))


def test_max_buffer_bytes_none_leaves_the_buffer_uncapped():
    el = en.EchoLoader(loader(n=32, workers=0), echo=2, seed=0, max_buffer_bytes=None)
    assert sorted(ids_of(el)) == sorted(list(range(32)) * 2)
    with pytest.raises(ValueError, match="max_buffer_bytes must be a positive integer or None"):
        en.EchoLoader(loader(), echo=2, max_buffer_bytes=0)

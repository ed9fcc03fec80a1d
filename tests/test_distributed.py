"""Multi-rank sharding, set_epoch, a real torchrun run, and exact resume.

References: torch's own ``DistributedSampler`` (fed the pipeline's global
permutation), counting over the gathered fresh streams of all ranks, and one
uninterrupted epoch for resume.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import echo_native as en
from echo_native.plan import distributed_rank
from echo_native.transforms import RandomResizedCrop
from echo_native.plan import Plan

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import sources_helpers as sh  # noqa: E402

PLACEMENTS = ("before_augment", "after_augment", "batch")
N = 45   # odd: 2 and 3 ranks both need padding
B = 8


@pytest.fixture(scope="module")
def samples():
    blobs = sh.photo_jpegs(N, 36, 44, seed=21)
    return en.Samples(blobs, np.arange(N) % 4)


def plan(n, rank=0, world_size=1, drop_last=False, shuffle=True, seed=3, batch_size=4):
    return Plan(total_samples=n, batch_size=batch_size, transform=RandomResizedCrop((8, 8)),
                seed=seed, shuffle=shuffle, drop_last=drop_last, rank=rank,
                world_size=world_size)


def fresh_of(batches):
    return [int(s) for ids, fr, _ in batches for s in ids[fr]]


def padded(order, world_size, drop_last=False):
    """The global order as DistributedSampler extends (wraps) or truncates it."""
    n = len(order)
    if drop_last:
        return list(order[:n // world_size * world_size])
    need = math.ceil(n / world_size) * world_size
    return list(np.resize(order, need))


# ---- sharding, plan level --------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("n", [2, 6, 7, 12, 31, 100])
def test_rank_shards_partition_each_epoch(n, world_size):
    """Rank shards: equal length, disjoint up to wrap-around padding, cover every sample."""
    for epoch in (0, 1):
        plans = [plan(n, r, world_size) for r in range(world_size)]
        shards = [p.epoch_order(epoch) for p in plans]
        per_rank = math.ceil(n / world_size)
        assert [len(s) for s in shards] == [per_rank] * world_size
        assert {p.num_samples for p in plans} == {per_rank}
        assert {p.batches_per_epoch for p in plans} == {math.ceil(per_rank / 4)}
        got = Counter(int(i) for s in shards for i in s)
        assert set(got) == set(range(n))
        order = plans[0].global_order(epoch)
        pad = per_rank * world_size - n
        assert got == Counter(order.tolist()) + Counter(order[:pad].tolist())
        for s in shards:
            assert len(set(s.tolist())) == len(s)  # no repeat inside a rank
        # same global order on every rank, a permutation that changes with the epoch
        assert all(np.array_equal(p.global_order(epoch), order) for p in plans)
    if n > 5:
        assert not np.array_equal(plans[0].global_order(0), plans[0].global_order(1))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("n", [6, 7, 12, 31, 100])
def test_drop_last_truncates_shards(n, world_size):
    """drop_last gives floor(n / world_size) samples per rank, disjoint, no padding."""
    shards = [plan(n, r, world_size, drop_last=True).epoch_order(2) for r in range(world_size)]
    per_rank = n // world_size
    assert [len(s) for s in shards] == [per_rank] * world_size
    flat = [int(i) for s in shards for i in s]
    assert len(flat) == len(set(flat)) == per_rank * world_size
    order = plan(n, 0, world_size, drop_last=True).global_order(2)
    assert set(flat) == set(order[:per_rank * world_size].tolist())
    assert {plan(n, r, world_size, drop_last=True, batch_size=4).batches_per_epoch
            for r in range(world_size)} == {per_rank // 4}


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("world_size,n", [(2, 7), (3, 7), (3, 12), (2, 100), (3, 2)])
def test_shards_equal_torch_distributed_sampler(world_size, n, shuffle, drop_last,
                                                monkeypatch):
    """Each rank's share equals torch DistributedSampler's for the same permutation."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DistributedSampler

    p0 = plan(n, 0, world_size, drop_last=drop_last, shuffle=shuffle)
    for epoch in (0, 1):
        order = p0.global_order(epoch)
        monkeypatch.setattr(torch, "randperm",
                            lambda k, generator=None, _o=order: torch.as_tensor(_o.copy()))
        for r in range(world_size):
            ref = DistributedSampler(range(n), num_replicas=world_size, rank=r,
                                     shuffle=shuffle, drop_last=drop_last, seed=3)
            ref.set_epoch(epoch)
            mine = plan(n, r, world_size, drop_last=drop_last, shuffle=shuffle)
            assert mine.epoch_order(epoch).tolist() == list(ref), (r, epoch)
            assert mine.num_samples == len(ref)


def test_rank_and_world_size_from_environment(samples, monkeypatch):
    """RANK/WORLD_SIZE from torchrun's environment are the defaults; explicit arguments win."""
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert distributed_rank() == (2, 3)
    ld = en.Loader(samples, 4, image_size=16, workers=1, worker_mode="thread", seed=3)
    assert (ld.plan.rank, ld.plan.world_size) == (2, 3)
    ring = en.EchoRing(samples, batch_size=4, image_size=16, echo=2, workers=1,
                       worker_mode="thread", seed=3)
    assert (ring.loader.plan.rank, ring.loader.plan.world_size) == (2, 3)
    with ld:
        ids = [int(i) for b in ld for i in b.sample_ids]
    assert ids == plan(N, 2, 3).epoch_order(0).tolist()
    explicit = en.Loader(samples, 4, image_size=16, workers=1, rank=0, world_size=2)
    assert (explicit.plan.rank, explicit.plan.world_size) == (0, 2)
    monkeypatch.delenv("WORLD_SIZE")
    assert distributed_rank() == (0, 1)     # RANK alone (no world) means a single process
    monkeypatch.delenv("RANK")
    assert distributed_rank() == (0, 1)
    assert en.Loader(samples, 4, image_size=16, workers=1).plan.world_size == 1


def test_invalid_rank_raises(samples, monkeypatch):
    """Out-of-range rank/world size (args or env) or a batch over the shard raise ValueError."""
    for rank, world in ((2, 2), (-1, 2), (0, 0), (5, 3)):
        with pytest.raises(ValueError, match="rank"):
            en.Loader(samples, 4, image_size=16, workers=1, rank=rank, world_size=world)
        with pytest.raises(ValueError, match="rank"):
            en.EchoRing(samples, batch_size=4, image_size=16, workers=1, rank=rank,
                        world_size=world)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="rank=2, world_size=2"):
        en.Loader(samples, 4, image_size=16, workers=1)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="shard"):
        en.EchoRing(samples, batch_size=30, image_size=16, workers=1)  # 23 per rank


# ---- sharding through real rings ----------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("echo", [1, 2, 2.5])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_ranks_take_equal_steps_and_cover_epoch(samples, placement, echo, world_size):
    """All ranks take len(ring) equal steps (fractional echo too) and cover the epoch."""
    for epoch in (0, 1):
        steps, fresh = [], Counter()
        for r in range(world_size):
            ring = en.EchoRing(samples, batch_size=B, image_size=16, echo=echo,
                               placement=placement, workers=1, worker_mode="thread", seed=5,
                               rank=r, world_size=world_size)
            ring.set_epoch(epoch)
            expected = len(ring)
            with ring:
                got = sh.run_epoch(ring)
            steps.append(len(got))
            assert expected == len(got)
            fr = fresh_of(got)
            assert len(fr) == len(set(fr))
            fresh.update(fr)
        assert len(set(steps)) == 1, steps
        order = plan(N, 0, world_size, seed=5).global_order(epoch)
        assert fresh == Counter(padded(order, world_size)), epoch


@pytest.mark.parametrize("n", [40, 45])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_drop_last_ranks_equal_full_batches(samples, placement, n):
    """With drop_last every rank yields the same number, len(ring), of full batches."""
    src = en.Samples([samples.read(i) for i in range(n)], samples.labels[:n])
    for echo in (1, 2, 2.5):
        counts = []
        for r in range(3):
            ring = en.EchoRing(src, batch_size=B, image_size=16, echo=echo,
                               placement=placement, workers=1, worker_mode="thread", seed=9,
                               drop_last=True, rank=r, world_size=3)
            expected = len(ring)
            with ring:
                got = sh.run_epoch(ring)
            assert all(len(ids) == B for ids, _, _ in got)
            assert len(got) == expected, (echo, r)
            counts.append(len(got))
        assert len(set(counts)) == 1, (echo, counts)


def test_set_epoch_selects_the_epoch(samples):
    """set_epoch(e) runs epoch e's order; orders change with e; revisiting repeats exactly."""
    ld = en.Loader(samples, B, image_size=16, workers=2, worker_mode="thread", seed=4,
                   rank=1, world_size=2)
    with ld:
        seen = {}
        for epoch in (0, 1, 3, 0, 3):
            ld.set_epoch(epoch)
            ids = [int(i) for b in ld for i in b.sample_ids]
            assert ids == plan(N, 1, 2, seed=4).epoch_order(epoch).tolist()
            seen.setdefault(epoch, ids)
            assert seen[epoch] == ids
        assert seen[0] != seen[1] != seen[3]
    with en.EchoRing(samples, batch_size=B, image_size=16, echo=2, workers=1,
                     worker_mode="thread", seed=4) as ring:
        streams = {}
        for epoch in (0, 1, 0):
            ring.set_epoch(epoch)
            got = sh.run_epoch(ring)
            key = [tuple(ids.tolist()) for ids, _, _ in got]
            assert streams.setdefault(epoch, key) == key
            assert sorted(fresh_of(got)) == list(range(N))
        assert streams[0] != streams[1]
    with pytest.raises(ValueError):
        ld.set_epoch(-1)


# ---- a real torchrun run ------------------------------------------------------------------
def _torchrun(tmp_path, nproc, *args, timeout=180):
    """Run ``dist_worker.py ARGS`` under ``torchrun --standalone`` with ``nproc`` ranks;
    fails the test with the log's tail unless every rank exits cleanly in time."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(HERE / "dist_worker.py"), *map(str, args)]
    proc = subprocess.Popen(cmd, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {timeout} s:\n"
                    + log.decode(errors="replace")[-4000:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    return text


@pytest.mark.slow   # a real torchrun job; the same sharding per rank in one process above
def test_torchrun_two_ranks_gloo(tmp_path):
    """torchrun 2 ranks, gloo: each epoch's gathered fresh ids cover all once + padding."""
    pytest.importorskip("torch.distributed.run")
    n = 45
    root = sh.write_folder(tmp_path / "data", sh.photo_jpegs(n, 36, 44, seed=5),
                           np.arange(n) % 3)
    out = tmp_path / "gathered.json"
    _torchrun(tmp_path, 2, root, out, "2", "process")
    result = json.loads(out.read_text())
    assert result["world_size"] == 2
    epochs = result["epochs"]
    assert len(epochs) == 2
    orders = []
    for epoch, ranks in enumerate(epochs):
        assert [r["rank"] for r in ranks] == [0, 1] and {r["epoch"] for r in ranks} == {epoch}
        assert ranks[0]["pid"] != ranks[1]["pid"]
        steps = {r["steps"] for r in ranks}
        assert len(steps) == 1 and steps == {r["len"] for r in ranks}, ranks
        # echo=2: each rank delivers two emissions of each of its 23 samples
        assert [r["delivered"] for r in ranks] == [2 * 23, 2 * 23]
        fresh = Counter(i for r in ranks for i in r["fresh"])
        assert set(fresh) == set(range(n))
        assert sum(fresh.values()) == 46 and sorted(fresh.values())[-2:] == [1, 2]
        # the one repeat is DistributedSampler's padding: the epoch's first sample
        twice = [i for i, c in fresh.items() if c == 2]
        assert twice == [int(plan(n, seed=7).global_order(epoch)[0])]
        for r in ranks:
            assert sorted(r["fresh"]) == sorted(plan(n, r["rank"], 2, seed=7)
                                                .epoch_order(epoch).tolist())
        orders.append([r["fresh"] for r in ranks])
    assert orders[0][0] != orders[1][0] and orders[0][1] != orders[1][1]
    assert set(orders[0][0]) != set(orders[1][0])


@pytest.mark.slow   # two torchrun jobs per case; the same resume in one process: test_elastic
@pytest.mark.parametrize("old,new", [(2, 1), (1, 2)])
def test_torchrun_elastic_resume(tmp_path, old, new):
    """torchrun, gloo, echo 2: every rank's state, all-gathered mid-epoch and saved,
    resumes in a job of another size; the epoch's rest is read fresh once over the
    new ranks in equal steps, and the next epoch is a fresh job's."""
    pytest.importorskip("torch.distributed.run")
    n = 22
    root = sh.write_folder(tmp_path / "data", sh.photo_jpegs(n, 24, 28, seed=8),
                           np.arange(n) % 2)
    saved, resumed, states = (tmp_path / f for f in ("saved.json", "resumed.json",
                                                     "states.json"))
    _torchrun(tmp_path, old, "elastic", root, saved, 2)
    first = json.loads(saved.read_text())["ranks"]
    states.write_text(json.dumps([r["state"] for r in first]))
    _torchrun(tmp_path, new, "elastic", root, resumed, -1, states)
    second = json.loads(resumed.read_text())["ranks"]
    assert [r["rank"] for r in second] == list(range(new))
    before = [i for r in first for i in r["fresh"]]
    assert [r["steps"] for r in first] == [2] * old and len(before) > 0
    gone = set(before)
    left = [int(i) for i in plan(n, seed=11).global_order(0) if int(i) not in gone]
    padded = np.resize(left, math.ceil(len(left) / new) * new)
    for r in second:
        assert r["epoch"] == 0
        assert sorted(r["fresh"]) == sorted(padded[r["rank"]::new].tolist())
        assert r["steps"] == r["len"] == second[0]["steps"] > 0
        assert sorted(r["next_fresh"]) == sorted(plan(n, r["rank"], new, seed=11)
                                                 .epoch_order(1).tolist())
        assert r["next_steps"] == r["next_len"] == second[0]["next_steps"]


# ---- resume --------------------------------------------------------------------------------
def _ring(samples, placement, echo, workers, mode, **kw):
    return en.EchoRing(samples, batch_size=B, image_size=16, echo=echo, placement=placement,
                       workers=workers, worker_mode=mode, seed=6, **kw)


def _resume_run(samples, placement, echo, stops, **kw):
    """Fresh ids of one epoch run in pieces: after each number of batches in ``stops`` the
    state is saved (through JSON), the ring closed, and a new ring (another worker count
    and mode) loads it; the last piece runs to the end of the epoch."""
    fresh, state, kinds = [], None, [(2, "process"), (1, "thread"), (3, "thread")]
    for piece, k in enumerate(list(stops) + [None]):
        workers, mode = kinds[piece % len(kinds)]
        ring = _ring(samples, placement, echo, workers, mode, **kw)
        if state is not None:
            ring.load_state_dict(state)
        with ring:
            got = sh.run_epoch(ring, k)
            state = json.loads(json.dumps(ring.state_dict()))
        fresh += fresh_of(got)
    return fresh, state


@pytest.mark.parametrize("echo", [1, 2, 2.5])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_resume_continues_fresh_stream_exactly(samples, placement, echo):
    """Stop, save, load into a new ring (other workers), finish: fresh ids = one epoch."""
    with _ring(samples, placement, echo, 2, "thread") as ring:
        whole = fresh_of(sh.run_epoch(ring))
    assert sorted(whole) == list(range(N))
    for k in (1, 3):
        fresh, state = _resume_run(samples, placement, echo, [k])
        assert Counter(fresh) == Counter(whole), k
        assert state["parent"]["ticket"] % math.ceil(N / B) == 0  # the next epoch's start


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_resume_at_epoch_start_repeats_the_batches(samples, placement):
    """Restored at an epoch start, a ring repeats the uninterrupted batches exactly."""
    def take(ring):
        return [(b.sample_ids.tolist(), b.echo_index.tolist(), b.images.copy()) for b in ring]

    with _ring(samples, placement, 2.5, 2, "thread") as ring:
        sh.run_epoch(ring)
        state = ring.state_dict()
        whole = take(ring)
    ring = _ring(samples, placement, 2.5, 1, "process")
    ring.load_state_dict(state)
    with ring:
        assert ring.epoch == 1
        got = take(ring)
    assert [g[:2] for g in got] == [w[:2] for w in whole]
    assert all(np.array_equal(g[2], w[2]) for g, w in zip(got, whole))


@pytest.mark.parametrize("placement", [  # one placement in the quick run, all in -m slow
    p if i == 0 else pytest.param(p, marks=pytest.mark.slow) for i, p in enumerate(PLACEMENTS)])
def test_resume_twice_and_save_right_after_load(samples, placement):
    """A state saved after a restore (with or without more batches) still resumes exactly."""
    for stops in ([2, 2], [1, 1, 1], [3, 0, 1]):
        fresh, _ = _resume_run(samples, placement, 2.5, stops)
        assert sorted(fresh) == list(range(N)), stops


def test_resume_on_a_rank_in_a_later_epoch(samples):
    """Rank 1 of 2 resumed mid-epoch 1 finishes its shard exactly, then runs epoch 2."""
    kw = dict(rank=1, world_size=2)
    ring = _ring(samples, "before_augment", 2, 1, "thread", **kw)
    with ring:
        sh.run_epoch(ring)
        part = fresh_of(sh.run_epoch(ring, 2))
        state = ring.state_dict()
    assert state["parent"]["rank"] == 1 and state["parent"]["world_size"] == 2
    ring = _ring(samples, "before_augment", 2, 2, "thread", **kw)
    ring.load_state_dict(state)
    with ring:
        assert ring.epoch == 1
        rest = fresh_of(sh.run_epoch(ring))
        nxt = fresh_of(sh.run_epoch(ring))
    assert sorted(part + rest) == sorted(plan(N, 1, 2, seed=6).epoch_order(1).tolist())
    assert sorted(nxt) == sorted(plan(N, 1, 2, seed=6).epoch_order(2).tolist())


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_resume_bookkeeping_stays_bounded(samples, placement):
    """The ring's resume bookkeeping (private) holds no more than a window, epoch after epoch."""
    with _ring(samples, placement, 2, 1, "thread", shuffle_buffer=2 * B) as ring:
        for _ in range(3):
            for _ in ring:
                batches, ids = ring.stage.ledger.size()
                assert ids <= 4 * B and batches <= 4, (batches, ids)
        assert ring.state_dict()["skip"] == []


def test_loader_resume_is_exact(samples):
    """Loader resume (other worker count) repeats the uninterrupted batches: ids and pixels."""
    def run(ld, k):
        out = []
        for _ in range(k):
            b = ld.next_batch()
            out.append((b.sample_ids.tolist(), b.images.copy()))
        return out

    bpe = math.ceil(N / B)
    with en.Loader(samples, B, image_size=16, workers=2, seed=2) as ld:
        whole = run(ld, bpe + 3)
    with en.Loader(samples, B, image_size=16, workers=1, worker_mode="thread", seed=2) as ld:
        first = run(ld, 4)
        state = ld.state_dict()
    assert state["ticket"] == 4
    ld = en.Loader(samples, B, image_size=16, workers=3, worker_mode="thread", seed=2)
    ld.load_state_dict(state)
    with ld:
        rest = [(b.sample_ids.tolist(), b.images.copy()) for b in ld]   # rest of epoch 0
        assert ld.epoch == 1
        rest += run(ld, 3)
    got = first + rest
    assert [ids for ids, _ in got] == [ids for ids, _ in whole]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(got, whole))


def test_load_state_dict_mismatch_raises(samples):
    """A state from another seed, world size, rank, batch count or placement is refused."""
    with _ring(samples, "before_augment", 2, 1, "thread") as ring:
        sh.run_epoch(ring, 2)
        state = ring.state_dict()
    bad = [(dict(seed=7), "seed"), (dict(world_size=2, rank=0), "world_size"),
           (dict(placement="after_augment"), "placement")]
    for kw, what in bad:
        placement = kw.pop("placement", "before_augment")
        ring = en.EchoRing(samples, batch_size=B, image_size=16, echo=2, placement=placement,
                           workers=1, worker_mode="thread", seed=kw.pop("seed", 6), **kw)
        with pytest.raises(ValueError, match=what):
            ring.load_state_dict(state)
    ring = en.EchoRing(samples, batch_size=B + 1, image_size=16, echo=2, workers=1, seed=6)
    with pytest.raises(ValueError, match="batches_per_epoch"):
        ring.load_state_dict(state)
    r1 = en.Loader(samples, B, image_size=16, workers=1, seed=6, rank=1, world_size=2)
    r0 = en.Loader(samples, B, image_size=16, workers=1, seed=6, rank=0, world_size=2)
    with pytest.raises(ValueError, match="rank"):
        r0.load_state_dict(r1.state_dict())

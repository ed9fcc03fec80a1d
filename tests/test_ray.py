"""echo_native.ray: decode on a Ray cluster, echo on the trainer, resume exactly.

The tests that start (or reuse) a local Ray instance are marked slow (``python -m
pytest -n 0 tests/test_ray.py -m "slow or not slow"``); the others check the decoding
actor and the refusals without a cluster.  Each cluster test compares the Ray ring with a local ring of the same seed, batch for batch: the
pixels, ids and order must be the same, which is what makes switching one import
safe.  Everything skips where Ray is not installed.
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="echo_native.ray needs the [ray] extra (ray[data])")
pytest.importorskip("ray.data", reason="echo_native.ray needs ray[data]")
cloudpickle = pytest.importorskip("cloudpickle")

import echo_native as en  # noqa: E402
import echo_native.ray as er  # noqa: E402
from echo_native.ray_decode import TicketDecoder  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import ring_helpers as rh  # noqa: E402

# The test's own sources (a slow one, one that records its pid) reach Ray's workers by
# value: the tests folder is not on their path.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SIZE = 32
BATCH = 8


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return rh.make_corpus(tmp_path_factory.mktemp("ray") / "corpus", 48, seed=1, classes=3)


@pytest.fixture(scope="module")
def _session():
    """One local Ray instance for the module (2 CPUs: the machine's), shut down after it;
    a test that needs Ray down (its own cluster) shuts it, and the next one restarts it."""
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def cluster(_session):
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    yield
    assert not _leaked_threads(), "a RayStream thread outlived its ring"


def _leaked_threads():
    import threading

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        alive = [t for t in threading.enumerate() if t.name == "echo_native-ray-stream"]
        if not alive:
            return []
        time.sleep(0.1)
    return alive


def _epochs(ring, n=1):
    out = []
    for epoch in range(n):
        ring.set_epoch(epoch)
        out.append([b.copy() for b in ring])
    return out


def _same(local, remote):
    assert [len(e) for e in local] == [len(e) for e in remote]
    for le, re_ in zip(local, remote):
        for a, b in zip(le, re_):
            np.testing.assert_array_equal(a.sample_ids, b.sample_ids)
            np.testing.assert_array_equal(a.labels, b.labels)
            np.testing.assert_array_equal(a.echo_index, b.echo_index)
            np.testing.assert_array_equal(a.fresh, b.fresh)
            np.testing.assert_array_equal(a.images, b.images)


# -- no cluster: the trainer's assembly of Ray's rows ----------------------------------------
def test_rows_ray_sends_twice_are_dropped_and_counted(corpus):
    """A retried task may deliver rows again: each ticket is assembled once, the repeats
    are dropped and counted, and a ticket is complete only with all its rows (meta
    included), whatever order they come in."""
    ring = er.EchoRing(corpus, BATCH, image_size=SIZE, seed=3, echo=1, concurrency=1)
    loader = ring.loader
    stream = er.RayStream(loader, 0, 4, 1, start=False)
    decoder = TicketDecoder(stream.job, trainer=True)
    cols = decoder({"ticket": np.array([0, 1])})
    first = {k: v[:5] for k, v in cols.items()}          # ticket 0, rows 0-4
    rest = {k: v[3:] for k, v in cols.items()}           # rows 3-7 of 0 (3, 4 again), all of 1
    stream._take(rest)
    assert not stream.is_published(0) and stream.is_published(1)  # 0 lacks rows 0-2
    stream._take(first)
    assert stream.is_published(0)
    assert stream.duplicates == 2
    stream._take(cols)                                   # all of it again: all repeats
    assert stream.duplicates == 2 + 2 * BATCH
    slot = stream.slot_of(0)
    np.testing.assert_array_equal(slot.sample_ids, cols["sample_id"][:BATCH])
    np.testing.assert_array_equal(slot.pixels.reshape(BATCH, SIZE, SIZE, 3),
                                  cols["image"][:BATCH])
    assert stream.read_meta(0).count == BATCH and stream.read_meta(0).error == 0
    stream.close()
    ring.close()


def test_a_task_decodes_a_run_of_tickets_into_one_block(corpus):
    """An input row names a run of tickets (Ray's cost is per block): their samples come
    out ticket after ticket, a short last batch included, as ticket by ticket."""
    ring = er.EchoRing(corpus, 5, image_size=SIZE, seed=3, echo=1, concurrency=1)
    try:
        job = er.RayStream(ring.loader, 0, 4, 1, start=False).job
        run = TicketDecoder(job)({"ticket": np.array([8]), "count": np.array([2])})
        one = [TicketDecoder(job)({"ticket": np.array([t])}) for t in (8, 9)]
        assert run["ticket"].tolist() == [8] * 5 + [9] * 3     # 48 samples: 3 in the last
        for k in ("sample_id", "row", "count", "image"):
            np.testing.assert_array_equal(run[k], np.concatenate([o[k] for o in one]))
        assert er.tickets_per_block(ring.loader.plan) == er.MAX_TICKETS_PER_BLOCK
    finally:
        ring.close()


def test_a_shared_streams_tickets_ship_whole_and_a_rank_refuses_anothers(corpus):
    """A stream shared by ranks (split()): every ticket ships its batch's full rows, even
    the short last one (Ray's split deals rows: equal blocks keep it dealing whole
    tickets in turn), each row names its rank, and a rank given another's rows fails
    naming both, rather than deliver them."""
    from echo_native.pool import ship

    kw = dict(image_size=SIZE, seed=3, echo=1, concurrency=1, shuffle=False)
    rings = [er.EchoRing(corpus, 5, rank=r, world_size=2, **kw) for r in range(2)]
    try:
        loaders = [ring.loader for ring in rings]
        decoder = TicketDecoder(ship(tuple(lo._work for lo in loaders), loaders[0].source))
        last = loaders[0].batches_per_epoch - 1          # 24 samples per rank: 4 of 5
        cols = decoder({"ticket": np.array([0, last]), "rank": np.array([1, 1])})
        assert len(cols["ticket"]) == 10 and set(cols["rank"].tolist()) == {1}
        assert cols["count"].tolist() == [5] * 5 + [4] * 5
        with en.EchoRing(corpus, 5, rank=1, world_size=2, workers=1,
                         **{k: v for k, v in kw.items() if k != "concurrency"}) as local:
            own = [b.sample_ids.copy() for b in local]
        np.testing.assert_array_equal(cols["sample_id"][:5], own[0])
        np.testing.assert_array_equal(cols["sample_id"][5:9], own[last])
        fake = er.Split(None, 0, 2, 0, 5, 1, er._key(loaders[0]))
        stream = er.RayStream(loaders[0], 0, 4, 1, start=False, split=fake)
        with pytest.raises(RuntimeError, match="rank 0 of a shared stream got batch 0 of rank 1"):
            stream._take(cols)
        stream.close()
    finally:
        for ring in rings:
            ring.close()


# -- on a local cluster -----------------------------------------------------------------------
@pytest.mark.slow
def test_dataset_rows_are_the_plans_samples_with_the_local_pixels(corpus, cluster):
    """dataset(): one row per sample, in the plan's order for (seed, epoch), the pixels
    a local ring's workers make."""
    local = en.EchoRing(corpus, BATCH, image_size=SIZE, seed=5, echo=1, workers=1)
    with local:
        local.set_epoch(1)
        want = [b.copy() for b in local]
    ds = er.dataset(corpus, BATCH, image_size=SIZE, seed=5, echo=1, epoch=1, concurrency=2)
    rows = ds.take_all()
    assert [r["sample_id"] for r in rows] == np.concatenate(
        [b.sample_ids for b in want]).tolist()
    assert sorted(r["sample_id"] for r in rows) == list(range(48))
    np.testing.assert_array_equal(np.stack([r["image"] for r in rows]),
                                  np.concatenate([b.images for b in want]))
    assert {r["epoch"] for r in rows} == {1}


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(echo=1), dict(echo=2.0, placement="after_augment"),
                                dict(echo=2.0, placement="batch"), dict(echo=2.0),
                                dict(echo=1.5, augment=[en.RandomResizedCrop(SIZE),
                                                        en.ColorJitter(0.4, 0.4)])],
                         ids=["echo1", "after", "batch", "before", "before-ops"])
def test_every_placement_delivers_the_local_rings_batches(corpus, cluster, kw):
    """Two epochs, batch for batch identical to a local EchoRing of the same seed: crops
    shipped (echo=1, after augmentation, batch echo), or canvases re-cropped on the
    trainer (before augmentation, ops drawn per emission); each id fresh once per
    epoch; what crossed the network is counted per fresh example."""
    kw = dict(kw)
    if "augment" not in kw:
        kw["image_size"] = SIZE
    local = en.EchoRing(corpus, BATCH, seed=11, workers=1, **kw)
    remote = er.EchoRing(corpus, BATCH, seed=11, concurrency=2, **kw)
    with local, remote:
        want, got = _epochs(local, 2), _epochs(remote, 2)
        stats = remote.stats()
    _same(want, got)
    for epoch in got:
        fresh = np.concatenate([b.sample_ids[b.fresh] for b in epoch])
        assert sorted(fresh.tolist()) == list(range(48))
    assert stats["fresh"] == 96 and stats["duplicates"] == 0
    before = kw.get("placement", "before_augment") == "before_augment" and kw["echo"] != 1
    per = stats["ray_bytes_per_fresh"]
    if before:   # a canvas is at least SIZE on its shorter side, more than the crop
        assert per > SIZE * SIZE * 3
    else:        # the crop and its row of metadata, not the canvas
        assert SIZE * SIZE * 3 <= per < 2 * SIZE * SIZE * 3


@pytest.mark.slow
def test_resume_mid_epoch_continues_exactly(corpus, cluster):
    """state_dict() mid-epoch; a new Ray ring loading it delivers what the first one
    would have delivered after it: no fresh id repeated or lost, the same batches a
    local ring resumed from the same state delivers."""
    kw = dict(image_size=SIZE, seed=2, echo=2.0)
    first = er.EchoRing(corpus, BATCH, concurrency=2, **kw)
    with first:
        it = iter(first)
        head = [next(it).copy() for _ in range(5)]
        state = first.state_dict()
        del it
    json.dumps(state)  # plain values
    local = en.EchoRing(corpus, BATCH, workers=1, **kw)
    remote = er.EchoRing(corpus, BATCH, concurrency=2, **kw)
    local.load_state_dict(state)
    remote.load_state_dict(state)
    with local, remote:
        want, tail = [b.copy() for b in local], [b.copy() for b in remote]
    _same([want], [tail])
    fresh = np.concatenate([b.sample_ids[b.fresh] for b in head + tail])
    assert sorted(fresh.tolist()) == list(range(48))


@pytest.mark.slow
def test_elastic_resume_from_two_ranks_to_three(corpus, cluster):
    """Two ranks save mid-epoch; three ranks resume from both states: every id of the
    epoch is read fresh once across the five streams, none twice."""
    kw = dict(image_size=SIZE, seed=4, echo=1, shuffle=True)
    states, seen = [], []
    for rank in range(2):
        ring = er.EchoRing(corpus, 4, rank=rank, world_size=2, concurrency=1, **kw)
        with ring:
            it = iter(ring)
            for _ in range(2):
                seen.append(next(it).sample_ids.copy())
            states.append(ring.state_dict())
            del it
    for rank in range(3):
        ring = er.EchoRing(corpus, 4, rank=rank, world_size=3, concurrency=1, **kw)
        ring.load_state_dict(states)
        with ring:
            seen += [b.sample_ids[b.fresh].copy() for b in ring]
    ids = np.concatenate(seen)
    assert len(set(ids.tolist())) == 48   # every id, the padding's repeats aside
    assert len(ids) - 48 < 3              # a rank's padding wraps at most one id each


class _Folder:
    """An ImageFolder wrapped by a test source whose ``read`` does more."""

    def __init__(self, root):
        self.inner = en.ImageFolder(root)

    def __len__(self):
        return len(self.inner)

    @property
    def labels(self):
        return self.inner.labels

    def describe(self, i):
        return self.inner.describe(i)


class PidSource(_Folder):
    """Samples read slowly, each reader's pid written to ``pids``: the actors to kill."""

    def __init__(self, root, pids, delay):
        super().__init__(root)
        self.pids, self.delay = str(pids), delay

    def read(self, i):
        with open(self.pids, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(self.delay)
        return self.inner.read(i)


@pytest.mark.slow
def test_an_actor_killed_mid_epoch_loses_and_repeats_nothing(corpus, cluster, tmp_path):
    """SIGKILL a decoding actor after the first batch: Ray restarts it and retries its
    ticket, and the trainer still delivers every id exactly once per epoch, in the
    local ring's batches (a repeat Ray sends is dropped and counted)."""
    pids = tmp_path / "pids"
    src = PidSource(corpus, pids, 0.03)
    kw = dict(image_size=SIZE, seed=8, echo=2.0, placement="after_augment")
    local = en.EchoRing(en.ImageFolder(corpus), BATCH, workers=1, **kw)
    remote = er.EchoRing(src, BATCH, concurrency=2, **kw)
    with local, remote:
        want = _epochs(local, 1)
        it = iter(remote)
        got = [next(it).copy()]
        victims = {int(p) for p in pids.read_text().split()}
        assert victims and os.getpid() not in victims
        os.kill(victims.pop(), signal.SIGKILL)
        got += [b.copy() for b in it]
        stats = remote.stats()
    _same(want, [got])
    fresh = np.concatenate([b.sample_ids[b.fresh] for b in got])
    assert sorted(fresh.tolist()) == list(range(48))
    assert stats["duplicates"] >= 0 and stats["fresh"] == 48


@pytest.mark.slow
def test_a_bad_file_follows_on_error_as_locally(corpus, cluster, tmp_path):
    """A truncated file: replaced (counted, named) exactly as by local workers; with
    on_error='raise' the DecodeError names the file."""
    import shutil

    root = tmp_path / "bad"
    shutil.copytree(corpus, root)
    victim = sorted(root.rglob("*.jpg"))[5]
    victim.write_bytes(victim.read_bytes()[:200])
    kw = dict(image_size=SIZE, seed=1, echo=1)
    local = en.EchoRing(root, BATCH, workers=1, **kw)
    remote = er.EchoRing(root, BATCH, concurrency=2, **kw)
    with pytest.warns(en.SampleFailureWarning, match=victim.name):
        with local, remote:
            want, got = _epochs(local), _epochs(remote)
            stats = remote.stats()
    _same(want, got)
    assert stats["failures"] == local.stats()["failures"] and sum(stats["failures"].values())
    strict = er.EchoRing(root, BATCH, concurrency=2, on_error="raise", **kw)
    with strict, pytest.raises(en.DecodeError, match=victim.name):
        for _ in strict:
            pass


@pytest.mark.slow
def test_tar_shards_and_a_detection_source_on_the_cluster(corpus, cluster, tmp_path):
    """The project's other sources decode on the cluster alike: TarShards (pixels as
    the local ring's) and CocoDetection (boxes follow every emission's crop)."""
    shards = en.write_shards(en.ImageFolder(corpus), tmp_path / "shards", max_count=20)
    kw = dict(image_size=SIZE, seed=6, echo=2.0)
    local = en.EchoRing(en.TarShards(shards), BATCH, workers=1, **kw)
    remote = er.EchoRing(en.TarShards(shards), BATCH, concurrency=2, **kw)
    with local, remote:
        _same(_epochs(local), _epochs(remote))

    import echo_helpers
    from test_coco import SIZES, coco_doc

    doc = coco_doc()
    images = tmp_path / "coco"
    for k, ((h, w), im) in enumerate(zip(SIZES, doc["images"])):
        path = images / im["file_name"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(echo_helpers.photo_jpegs(1, h, w, seed=k)[0])
    ann = tmp_path / "instances.json"
    ann.write_text(json.dumps(doc))
    kw = dict(image_size=SIZE, seed=6, echo=2.0, shuffle=False)
    local = en.EchoRing(en.CocoDetection(images, ann), 2, workers=1, **kw)
    remote = er.EchoRing(en.CocoDetection(images, ann), 2, concurrency=1, **kw)
    with local, remote:
        want, got = _epochs(local), _epochs(remote)
    _same(want, got)
    for a, b in zip(want[0], got[0]):
        np.testing.assert_array_equal(a.objects.boxes, b.objects.boxes)
        np.testing.assert_array_equal(a.objects.labels, b.objects.labels)


@pytest.mark.slow
def test_the_example_trains_on_a_two_node_cluster(corpus, _session, tmp_path, monkeypatch):
    """examples/train_ray.py on a local 2-node cluster (ray.cluster_utils.Cluster): it
    connects by address, decodes on both nodes, echoes on the trainer, and says every
    id was delivered fresh once per epoch."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()   # the module's instance: this test runs its own cluster
    # The package this test imports (the source tree, where it is not installed), for the
    # example and the cluster's workers alike.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1,
                                                      "include_dashboard": False})
    try:
        c.add_node(num_cpus=1)
        c.wait_for_nodes(timeout=60)
        out = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "train_ray.py"), str(corpus),
             "--address", c.address, "--epochs", "2", "--batch-size", "8",
             "--image-size", "32", "--expect-nodes", "2"],
            capture_output=True, text=True, timeout=240, cwd=tmp_path)
    finally:
        c.shutdown()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["epoch"] for r in lines] == [0, 1]
    for r in lines:
        assert r["fresh_ids"] == 48 and r["each_once"] and r["nodes"] == 2
        assert np.isfinite(r["loss"])


@pytest.mark.slow
def test_close_mid_epoch_then_iterating_again_goes_on_as_a_local_ring_does(corpus, cluster):
    """close() stops the Ray stream (its thread and its dataset); iterating again starts a
    new one where the ring stood: the batches are a local ring's under the same
    interruption, and no id comes fresh twice."""
    kw = dict(image_size=SIZE, seed=9, echo=2.0, placement="after_augment")
    runs = []
    for ring in (en.EchoRing(corpus, BATCH, workers=1, **kw),
                 er.EchoRing(corpus, BATCH, concurrency=2, **kw)):
        it = iter(ring)
        got = [next(it).copy() for _ in range(3)]
        ring.close()
        with pytest.raises(Exception):
            next(it)   # an iterator taken before close() is finished
        assert not _leaked_threads()
        with ring:
            got += [b.copy() for b in ring]
        runs.append(got)
    _same([runs[0]], [runs[1]])
    fresh = np.concatenate([b.sample_ids[b.fresh] for b in runs[1]])
    assert len(set(fresh.tolist())) == len(fresh)


def _wait_for(what, cond, timeout=120.0):
    """Wait until ``cond()`` is true (polling), or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class HeldSource(_Folder):
    """Every read is logged as ``pid node_id sample_id`` to ``log`` (which actor, on which
    node, reads what); on the node named in the file ``hold``, a read waits while that
    file exists (at most ``timeout`` s), logged first as ``held pid node_id sample_id``."""

    def __init__(self, root, log, hold, timeout=300.0):
        super().__init__(root)
        self.log, self.hold, self.timeout = str(log), str(hold), timeout

    def _held_here(self, node):
        try:
            with open(self.hold) as f:
                return f.read().strip() == node
        except OSError:
            return False

    def read(self, i):
        node = ray.get_runtime_context().get_node_id()
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {node} {i}\n")
        if self._held_here(node):
            with open(self.log, "a") as f:
                f.write(f"held {os.getpid()} {node} {i}\n")
            deadline = time.monotonic() + self.timeout
            while self._held_here(node):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the test never removed {self.hold}")
                time.sleep(0.01)
        return self.inner.read(i)


def _reads(log, held=False):
    """(pid, node id, sample id) of every read logged so far (``held``: of the reads that
    waited)."""
    if not log.exists():
        return []
    lines = [line.split() for line in log.read_text().splitlines()]
    return [(int(p), n, int(i)) for *h, p, n, i in
            (w for w in lines if len(w) == 3 + held and (w[0] == "held") == held)]


def _shutdown_cluster(c):
    """Ray down, then the cluster: a ring's stream thread ends first (it would start
    Ray again through Ray's auto-init, and the cluster refuses to remove the node of a
    connected driver)."""
    try:
        _leaked_threads()
    finally:
        ray.shutdown()
        try:
            c.shutdown()
        except ValueError:   # connected again meanwhile
            ray.shutdown()
            c.shutdown()


@pytest.fixture
def three_node_cluster(_session):
    """A local Cluster: a head with no CPU (the driver's) and three 1-CPU worker nodes,
    this process its driver; shut down on every path."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()   # the module's instance: this test runs its own cluster
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0,
                                                      "include_dashboard": False})
    try:
        for _ in range(3):
            c.add_node(num_cpus=1)
        c.wait_for_nodes(timeout=120)
        ray.init(address=c.address, log_to_driver=False, configure_logging=False)
        yield c
    finally:
        _shutdown_cluster(c)
    assert not _leaked_threads(), "a RayStream thread outlived its ring"


@pytest.mark.slow
def test_a_node_removed_mid_epoch_loses_and_repeats_nothing(corpus, three_node_cluster,
                                                            tmp_path):
    """Two decoding actors on a 3-node cluster; after the first batch, one actor's node is
    chosen, its next read held there, and the node is removed from the cluster while
    the actor is mid-batch.  Ray retries the batch and restarts the actor on the spare
    node: the trainer delivers every id exactly once in every epoch, in the batches of
    a local ring, drops any row Ray sends twice (counted), and counts the new actor."""
    import threading

    c = three_node_cluster
    log, hold = tmp_path / "reads", tmp_path / "hold"
    kw = dict(image_size=SIZE, seed=8, echo=2.0, placement="after_augment", shuffle=False)
    remote = er.EchoRing(HeldSource(corpus, log, hold), BATCH, concurrency=2, **kw)
    driver = ray.get_runtime_context().get_node_id()
    epochs, failed, removed = [[]], [], threading.Event()

    def consume(it):
        # Epoch after epoch (more batches than Ray decodes ahead, so the held actor is
        # given one), until a whole epoch began after the removal and Ray's replacement
        # for the lost actor has delivered rows (once Ray has declared the node dead).
        try:
            epochs[0] += [b.copy() for b in it]
            after = None
            while after is None or len(epochs) <= after or remote.stats()["ray_actors"] <= 2:
                if after is None and removed.is_set():
                    after = len(epochs)
                assert len(epochs) < 500, "Ray's replacement actor never delivered"
                remote.set_epoch(len(epochs))
                epochs.append([b.copy() for b in remote])
        except BaseException as e:  # noqa: BLE001 - raised in the test's thread
            failed.append(e)

    try:
        with remote:
            remote.set_epoch(0)
            it = iter(remote)
            epochs[0].append(next(it).copy())
            node_id = next(n for _, n, _ in _reads(log) if n != driver)  # an actor's node
            hold.write_text(node_id)
            consumer = threading.Thread(target=consume, args=(it,), daemon=True)
            consumer.start()
            _wait_for("the chosen actor to be held mid-batch", lambda: _reads(log, held=True))
            pid = _reads(log, held=True)[0][0]
            victim = next(n for n in c.worker_nodes if n.node_id == node_id)
            c.remove_node(victim, allow_graceful=False)
            removed.set()
            hold.unlink()
            consumer.join(timeout=300)
            assert not consumer.is_alive(), "the consumer did not finish"
            if failed:
                raise failed[0]
            stats = remote.stats()
            ray_books = remote.loader.stats()["ray"]
    finally:
        removed.set()
        hold.unlink(missing_ok=True)   # no actor left waiting, whatever failed
    with en.EchoRing(en.ImageFolder(corpus), BATCH, workers=1, **kw) as local:
        want = _epochs(local, len(epochs))
    _same(want, epochs)
    for epoch in epochs:
        fresh = np.concatenate([b.sample_ids[b.fresh] for b in epoch])
        assert sorted(fresh.tolist()) == list(range(48))
    assert stats["fresh"] == 48 * len(epochs) and stats["concurrency"] == 2
    # The actor on the lost node was replaced: a new instance delivered rows.  Whatever
    # Ray sent twice was dropped and counted (a retry after the node's loss usually
    # sends nothing twice: the lost task's rows never left the node).
    assert stats["ray_actors"] >= 3
    assert stats["duplicates"] == ray_books["duplicates"] >= 0
    assert pid not in {p for p, n, _ in _reads(log) if n != node_id}


def _lockstep(rings, epoch, limit=None):
    """The ranks' batches of ``epoch``, taken in turn as data-parallel ranks take them
    (at most ``limit`` each), copied; per rank."""
    for ring in rings:
        ring.set_epoch(epoch)
    its, out = [iter(ring) for ring in rings], [[] for _ in rings]
    for r in itertools.cycle(range(len(rings))):
        if all(it is None for it in its):
            return out
        if its[r] is not None:
            b = next(its[r], None) if limit is None or len(out[r]) < limit else None
            if b is None:
                its[r] = None
            else:
                out[r].append(b.copy())


@pytest.mark.slow
def test_two_ranks_share_one_stream_through_streaming_split(corpus, cluster):
    """split(): one dataset of both ranks' tickets, streaming_split(2, equal=True), one
    actor pool.  Each rank's batches are a local ring's of that rank, each id fresh
    once per epoch across the ranks; states taken mid-epoch resume the rest of it on a
    new split of 2 ranks or 3 (the elastic rules), as local rings resumed alike do."""
    import contextlib

    kw = dict(image_size=SIZE, seed=4, echo=2.0, shuffle=True)
    splits = er.split(corpus, 4, 2, epochs=2, concurrency=2, **kw)
    assert [(s.rank, s.first, s.end) for s in splits] == [(0, 0, 12), (1, 0, 12)]
    rings = [er.EchoRing(corpus, 4, split=s, **kw) for s in splits]
    with contextlib.ExitStack() as stack:
        for ring in rings:   # all ranks start: Ray's split waits for every one
            stack.enter_context(ring)
        whole = _lockstep(rings, 0)
        head = _lockstep(rings, 1, limit=3)
        states = [ring.state_dict() for ring in rings]
    with pytest.raises(RuntimeError, match="read once"):
        next(iter(rings[0]))
    for r in range(2):
        with en.EchoRing(corpus, 4, rank=r, world_size=2, workers=1, **kw) as local:
            want = _lockstep([local], 0)[0] + _lockstep([local], 1, limit=3)[0]
        _same([want], [whole[r] + head[r]])
    fresh = np.concatenate([b.sample_ids[b.fresh] for b in sum(whole, [])])
    assert sorted(fresh.tolist()) == list(range(48))
    for n in (2, 3):
        resumed = er.split(corpus, 4, n, epochs=1, state=states, concurrency=2, **kw)
        rings = [er.EchoRing(corpus, 4, split=s, **kw) for s in resumed]
        with pytest.raises(ValueError, match="load the same state"):
            rings[0].loader.start()           # not where its share starts
        locals_ = [en.EchoRing(corpus, 4, rank=r, world_size=n, workers=1, **kw)
                   for r in range(n)]
        with contextlib.ExitStack() as stack:
            for ring in rings + locals_:
                ring.load_state_dict(states)
                stack.enter_context(ring)
            tail = _lockstep(rings, 1)
            want = _lockstep(locals_, 1)
        _same(want, tail)
        fresh = np.concatenate([b.sample_ids[b.fresh] for b in sum(head, []) + sum(tail, [])])
        assert set(fresh.tolist()) == set(range(48))
        assert len(fresh) - 48 < n   # a rank's padding wraps at most one id each


@pytest.mark.parametrize("field", ["keypoints", "masks"])
def test_a_source_with_keypoints_or_masks_is_refused_with_what_to_use(field):
    """The Ray path carries boxes only: a source whose objects carry keypoints or masks
    is refused at construction, naming the field, not half-delivered."""
    from test_keypoints import SSD, Poses
    from test_masks import Shapes

    source = Poses(4) if field == "keypoints" else Shapes(4)
    with pytest.raises(ValueError, match=f"carries boxes, not {field} yet.*EchoRing"):
        er.EchoRing(source, batch_size=2, augment=SSD[2:], echo=1)

"""Parquet files of encoded images and Hugging Face datasets as a source: ParquetImages.

The files are written by the tools people use (``datasets``' ``to_parquet`` and
``save_to_disk``, pyarrow's writer with several row groups); the references are
the same JPEG bytes as an ImageFolder, and the pipeline's own contract (every
sample fresh once per epoch, resume with another worker count).
"""
from __future__ import annotations

import json
import pickle
import sys
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import echo_native as en  # noqa: E402

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import sources_helpers as sh  # noqa: E402

N = 20
CLASSES = ["cat", "dog", "owl"]


@pytest.fixture(scope="module")
def corpus():
    blobs = sh.photo_jpegs(N, 30, 36, seed=43)
    return blobs, np.arange(N) % 3


def hf_metadata(names=CLASSES, column="label"):
    """The ``huggingface`` schema metadata ``datasets`` writes for an Image column and a
    ClassLabel column."""
    info = {"info": {"features": {"image": {"_type": "Image"},
                                  column: {"names": list(names), "_type": "ClassLabel"}}}}
    return {b"huggingface": json.dumps(info).encode()}


def write_pyarrow(path, blobs, labels, row_group_size=6, struct=True, metadata=True,
                  extra=None):
    """A Parquet file in the hub's layout written by pyarrow, several row groups."""
    if struct:
        image = pa.array([{"bytes": b, "path": f"img_{i}.jpg"} for i, b in enumerate(blobs)],
                         pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    else:
        image = pa.array(blobs, pa.binary())
    cols = {"image": image, "label": pa.array(np.asarray(labels, np.int64))}
    cols.update(extra or {})
    table = pa.table(cols)
    if metadata:
        table = table.replace_schema_metadata(hf_metadata())
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


@pytest.fixture
def files(corpus, tmp_path):
    """The corpus in 3 pyarrow-written files of row groups of 3 (7 + 7 + 6 rows)."""
    blobs, labels = corpus
    out = tmp_path / "pq"
    out.mkdir()
    cuts = [0, 7, 14, N]
    return [write_pyarrow(out / f"train-{k:05d}-of-00003.parquet", blobs[a:b], labels[a:b],
                          row_group_size=3)
            for k, (a, b) in enumerate(zip(cuts, cuts[1:]))]


def read_all(src):
    return [bytes(src.read(i)) for i in range(len(src))]


def test_files_list_glob_folder_same_samples(files, corpus, tmp_path):
    """A file, a list, a glob and a folder all read the corpus in file then row order:
    the same bytes and labels; ClassLabel names from the metadata; describe names the
    file, row group and row; picklable."""
    blobs, labels = corpus
    folder = files[0].parent
    for arg in (files, str(folder / "train-*.parquet"), folder, [str(f) for f in files]):
        src = en.ParquetImages(arg)
        assert len(src) == N
        assert read_all(src) == blobs
        assert src.labels.tolist() == labels.tolist()
        assert src.classes == CLASSES and src.class_to_idx == {"cat": 0, "dog": 1, "owl": 2}
    one = en.ParquetImages(files[1])
    assert read_all(one) == blobs[7:14]
    assert one.describe(4) == f"{files[1]}: row group 1, row 1"
    clone = pickle.loads(pickle.dumps(src))
    assert bytes(clone.read(N - 1)) == blobs[N - 1]
    view = src.read(0)  # a view of Arrow's buffer, not a copy
    assert isinstance(view, memoryview) and view.readonly
    # Unsigned bytes: Arrow exports signed chars, which the kernel refuses and the decoder
    # would not even recognise as a JPEG (data[0] == -1), sending it down Pillow's path.
    assert view.format == "B" and view[0] == 0xFF


def test_pixels_equal_the_same_bytes_from_a_folder(files, corpus, tmp_path):
    """A Loader over the Parquet files gives each sample the very pixels and label that
    the same JPEG files in a folder give it (listed in the same order, so the same
    sample ids and crops)."""
    blobs, labels = corpus
    root = sh.write_folder(tmp_path / "folder", blobs, labels, CLASSES)
    listed = en.FileList([(f"{CLASSES[lab]}/img_{i:05d}.jpg", int(lab))
                          for i, lab in enumerate(labels)], root=root)

    def run(src):
        with en.Loader(src, 8, image_size=16, workers=2, seed=3) as ld:
            return {int(i): (img.copy(), int(lab)) for b in ld
                    for i, img, lab in zip(b.sample_ids, b.images, b.labels)}

    got, ref = run(en.ParquetImages(files)), run(listed)
    assert sorted(got) == sorted(ref) == list(range(N))
    for i in range(N):
        assert np.array_equal(got[i][0], ref[i][0]) and got[i][1] == ref[i][1] == labels[i]


def test_each_sample_once_per_epoch_and_epoch_order(files, corpus):
    """EchoRing over Parquet: every sample fresh exactly once per epoch with its label;
    the order is the source's (row groups shuffled, windows shuffled), varies by epoch."""
    blobs, labels = corpus
    src = en.ParquetImages(files, shuffle_buffer=4)
    orders = []
    with en.EchoRing(src, batch_size=6, image_size=16, echo=2, workers=2, seed=7) as ring:
        for epoch in range(2):
            ring.set_epoch(epoch)
            fresh, ids, labs = [], [], []
            for b in ring:
                fresh += np.asarray(b.sample_ids)[np.asarray(b.fresh)].tolist()
                ids += np.asarray(b.sample_ids).tolist()
                labs += np.asarray(b.labels).tolist()
            assert sorted(fresh) == list(range(N))
            assert Counter(ids) == Counter({i: 2 for i in range(N)})
            assert labs == [int(labels[i]) for i in ids]
            orders.append(fresh)
    assert orders[0] != orders[1]
    order = src.epoch_order(7, 0)
    assert sorted(order.tolist()) == list(range(N))
    # Locality: each window of 4 spans at most 3 row groups of 3 rows.
    group = [src._index.locate(int(i))[0] for i in order]
    assert all(len(set(group[k:k + 4])) <= 3 for k in range(0, N, 4))


def test_a_worker_reads_each_row_group_once(files):
    """Reading a whole epoch in the source's order reads each row group once (they stay
    cached), not once per sample."""
    src = en.ParquetImages(files)
    calls = Counter()
    real = src._index.read_group

    def counting(g, fetch=None):
        calls[g] += 1
        return real(g, fetch)

    src._index.read_group = counting
    for i in src.epoch_order(0, 0):
        src.read(int(i))
    assert sorted(calls) == list(range(len(src._index.group_starts) - 1))
    assert set(calls.values()) == {1}
    # A cache of one row group's size still reads right, re-reading evicted groups.
    small = en.ParquetImages(files, cache_bytes=1)
    assert [bytes(small.read(i)) for i in (0, 10, 0, 19)] == \
        [bytes(src.read(i)) for i in (0, 10, 0, 19)]


def test_resume_mid_epoch_with_another_worker_count(files, corpus):
    """A Loader stopped mid-epoch (1 worker) and resumed with 2 process workers reads the
    rest of the epoch: each sample exactly once overall, with the same pixels."""
    src = en.ParquetImages(files, shuffle_buffer=5)
    with en.Loader(src, 4, image_size=16, workers=1, seed=11) as ld:
        ref = {int(i): img.copy() for b in ld for i, img in zip(b.sample_ids, b.images)}
    seen = []
    with en.Loader(src, 4, image_size=16, workers=1, seed=11) as ld:
        for k, b in enumerate(ld):
            seen += np.asarray(b.sample_ids).tolist()
            if k == 1:
                break
        state = json.loads(json.dumps(ld.state_dict()))
    ld = en.Loader(src, 4, image_size=16, workers=2, worker_mode="process", seed=11)
    ld.load_state_dict(state)
    with ld:
        for b in ld:
            for i, img in zip(b.sample_ids, b.images):
                assert np.array_equal(img, ref[int(i)])
                seen.append(int(i))
    assert sorted(seen) == list(range(N))


def test_plain_binary_column_and_no_metadata(corpus, tmp_path):
    """An image column of plain binary, no Hugging Face metadata: same bytes, classes None;
    label=None gives labels of -1."""
    blobs, labels = corpus
    p = write_pyarrow(tmp_path / "plain.parquet", blobs, labels, struct=False, metadata=False)
    src = en.ParquetImages(p)
    assert read_all(src) == blobs and src.classes is None
    nolab = en.ParquetImages(p, label=None)
    assert nolab.labels.tolist() == [-1] * N


def test_written_by_datasets(corpus, tmp_path):
    """Files written by ``datasets``: to_parquet of embedded images, save_to_disk's Arrow
    read as a Dataset (also shuffled and selected), load_dataset('parquet'): same bytes,
    labels, class names."""
    datasets = pytest.importorskip("datasets")
    blobs, labels = corpus
    feats = datasets.Features({"image": datasets.Image(),
                               "label": datasets.ClassLabel(names=CLASSES)})
    ds = datasets.Dataset.from_dict(
        {"image": [{"bytes": b, "path": None} for b in blobs], "label": labels.tolist()},
        features=feats)
    ds.to_parquet(str(tmp_path / "ds.parquet"))
    src = en.ParquetImages(tmp_path / "ds.parquet")
    assert read_all(src) == blobs and src.classes == CLASSES
    assert src.labels.tolist() == labels.tolist()
    ds.save_to_disk(str(tmp_path / "saved"))
    disk = datasets.load_from_disk(str(tmp_path / "saved"))
    for d in (disk, en.from_datasets(disk)):
        s = d if isinstance(d, en.ParquetImages) else en.ParquetImages(d)
        assert read_all(s) == blobs and s.classes == CLASSES
        assert s.labels.tolist() == labels.tolist()
    mixed = disk.shuffle(seed=1).select(range(5))
    s = en.ParquetImages(mixed)
    assert read_all(s) == [blobs[j] for j in mixed._indices.column(0).to_pylist()]
    assert s.labels.tolist() == mixed["label"]
    assert pickle.loads(pickle.dumps(s)).describe(0).endswith(
        f"row {mixed._indices.column(0)[0].as_py()}")
    loaded = datasets.load_dataset("parquet", data_files=str(tmp_path / "ds.parquet"),
                                   split="train", cache_dir=str(tmp_path / "cache"))
    s = en.ParquetImages(loaded)
    assert read_all(s) == blobs
    with en.Loader(s, 8, image_size=16, workers=2, worker_mode="process", seed=1) as ld:
        ids = [int(i) for b in ld for i in b.sample_ids]
    assert sorted(ids) == list(range(N))


def test_datasets_images_by_path(corpus, tmp_path):
    """``datasets`` keeps images given by path as path-only cells (to_parquet does not
    embed them): those are read from the path, for local files and Datasets."""
    datasets = pytest.importorskip("datasets")
    blobs, labels = corpus
    paths = []
    for i, b in enumerate(blobs[:5]):
        p = tmp_path / f"{i}.jpg"
        p.write_bytes(b)
        paths.append(str(p))
    ds = datasets.Dataset.from_dict({"image": paths, "label": labels[:5].tolist()}).cast_column(
        "image", datasets.Image())
    ds.to_parquet(str(tmp_path / "bypath.parquet"))
    for src in (en.ParquetImages(tmp_path / "bypath.parquet"), en.ParquetImages(ds)):
        assert read_all(src) == blobs[:5]


def test_missing_and_wrong_columns_are_named(files, corpus, tmp_path):
    """A missing column lists the columns there are; a column of the wrong type says so."""
    with pytest.raises(ValueError, match=r"no image column 'img'; its columns are: 'image', "
                                         r"'label'"):
        en.ParquetImages(files, image="img")
    with pytest.raises(ValueError, match=r"no label column 'labels' \(label=None: no labels\)"):
        en.ParquetImages(files, label="labels")
    with pytest.raises(ValueError, match=r"label column 'image' is struct"):
        en.ParquetImages(files, label="image")
    with pytest.raises(ValueError, match=r"image column 'label' is int64, not encoded images"):
        en.ParquetImages(files, image="label")
    blobs, labels = corpus
    p = write_pyarrow(tmp_path / "strlab.parquet", blobs[:3], labels[:3],
                      extra={"name": pa.array(["a", "b", "c"])})
    with pytest.raises(ValueError, match=r"label column 'name' is string, not integers"):
        en.ParquetImages(p, label="name")


def test_bad_files_are_refused_by_name(files, corpus, tmp_path):
    """A corrupt footer, a missing file, an empty folder, a schema or class names that
    change between files, a row group over the read limit: clear errors naming the file."""
    blobs, labels = corpus
    bad = tmp_path / "bad.parquet"
    data = files[0].read_bytes()
    bad.write_bytes(data[:-20] + b"\0" * 20)  # the footer's length and magic destroyed
    with pytest.raises(ValueError, match=rf"{bad}: not a Parquet file pyarrow can read"):
        en.ParquetImages([files[1], bad])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        en.ParquetImages(tmp_path / "nope.parquet")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no .parquet files"):
        en.ParquetImages(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no file matches"):
        en.ParquetImages(str(tmp_path / "x-*.parquet"))
    plain = write_pyarrow(tmp_path / "plain.parquet", blobs[:3], labels[:3], struct=False)
    with pytest.raises(ValueError, match=r"the schema changes between files: column 'image'"):
        en.ParquetImages([files[0], plain])
    other = tmp_path / "other.parquet"
    table = pq.read_table(files[0]).replace_schema_metadata(hf_metadata(["a", "b", "c", "d"]))
    pq.write_table(table, other)
    with pytest.raises(ValueError, match=r"class names of column 'label' change between files"):
        en.ParquetImages([files[0], other])
    with pytest.raises(ValueError, match=rf"{files[0]}: row group 0 holds [\d,]+ bytes of "
                                         rf"images \(3 rows\), over max_row_group_bytes=100"):
        en.ParquetImages(files, max_row_group_bytes=100)


def test_null_and_non_image_cells_fail_by_row(corpus, tmp_path):
    """A null cell and a cell that is not an image fail their sample under on_error,
    named by file, row group and row; the other samples are read once each."""
    blobs, labels = corpus
    cells = [{"bytes": b, "path": None} for b in blobs[:8]]
    cells[2] = None
    cells[5] = {"bytes": b"not an image at all", "path": None}
    image = pa.array(cells, pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    p = tmp_path / "holes.parquet"
    pq.write_table(pa.table({"image": image, "label": pa.array(labels[:8])}), p,
                   row_group_size=4)
    src = en.ParquetImages(p)
    with pytest.raises(OSError, match="the image cell is null"):
        src.read(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with en.Loader(src, 4, image_size=16, workers=1, seed=0, on_error="skip") as ld:
            ids = [int(i) for b in ld for i in b.sample_ids]
            stats = ld.stats()
    assert sorted(ids) == [0, 1, 3, 4, 6, 7]
    assert stats["failures"] == {"decode": 1, "read": 1}
    said = " ".join(str(w.message) for w in caught)
    assert f"{p}: row group 0, row 2" in said and "the image cell is null" in said
    assert f"{p}: row group 1, row 1" in said and "not an image" in said
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", en.SampleFailureWarning)
        with en.Loader(src, 4, image_size=16, workers=1, seed=0, on_error="raise",
                       shuffle=False) as ld:
            with pytest.raises(Exception, match=rf"{p}: row group 0, row 2"):
                for _ in ld:
                    pass
    # A cell over max_file_bytes is refused by the source, naming the limit.
    small = en.ParquetImages(p, max_file_bytes=10)
    with pytest.raises(OSError, match="over the limit max_file_bytes=10"):
        small.read(0)


def test_null_label_is_refused(corpus, tmp_path):
    """A null label names the file, row group and row."""
    blobs, _ = corpus
    p = tmp_path / "nolab.parquet"
    pq.write_table(pa.table({"image": pa.array(blobs[:6], pa.binary()),
                             "label": pa.array([0, 1, 2, None, 0, 1], pa.int64())}),
                   p, row_group_size=2)
    with pytest.raises(ValueError, match=rf"{p}: row group 1, row 1: the label 'label' is null"):
        en.ParquetImages(p)


def test_not_a_source_argument():
    """What is not a path or a Dataset is refused, saying what is taken."""
    with pytest.raises(TypeError, match="takes a path, a list of paths"):
        en.ParquetImages(12)
    with pytest.raises(ValueError, match="at least one"):
        en.ParquetImages([])
    with pytest.raises(TypeError, match="from_datasets takes a datasets.Dataset"):
        en.from_datasets([1, 2])


# ---- detection --------------------------------------------------------------------------
def boxes_corpus(n=8, seed=4):
    """``n`` JPEGs with 1-3 objects each: (blobs, xywh boxes per image, categories)."""
    rng = np.random.default_rng(seed)
    blobs = sh.photo_jpegs(n, 48, 64, seed=seed)
    boxes, cats = [], []
    for _ in range(n):
        k = int(rng.integers(1, 4))
        x, y = rng.uniform(0, 30, k), rng.uniform(0, 20, k)
        w, h = rng.uniform(4, 30, k), rng.uniform(4, 24, k)
        boxes.append(np.stack([x, y, w, h], 1).round(2).tolist())
        cats.append(rng.integers(0, 3, k).tolist())
    return blobs, boxes, cats


def test_detection_objects_column(tmp_path):
    """An HF-style objects column ({bbox (xywh), category}, written by ``datasets``) gives
    each sample its Targets in xyxy; a ring carries them to batch.objects exactly as a
    source with the same targets does; category names come from the metadata."""
    datasets = pytest.importorskip("datasets")
    blobs, boxes, cats = boxes_corpus()
    feats = datasets.Features({
        "image": datasets.Image(),
        "objects": {"bbox": datasets.Sequence(datasets.Sequence(datasets.Value("float32"),
                                                                length=4)),
                    "category": datasets.Sequence(datasets.ClassLabel(names=CLASSES))}})
    ds = datasets.Dataset.from_dict(
        {"image": [{"bytes": b, "path": None} for b in blobs],
         "objects": [{"bbox": b, "category": c} for b, c in zip(boxes, cats)]},
        features=feats)
    ds.to_parquet(str(tmp_path / "det.parquet"))
    src = en.ParquetImages(tmp_path / "det.parquet", label=None, targets="objects")
    assert src.classes == CLASSES and src.has_targets
    want = []
    for b, c in zip(boxes, cats):
        xyxy = np.asarray(b, np.float32)
        xyxy = np.concatenate([xyxy[:, :2], xyxy[:, :2] + xyxy[:, 2:]], 1)
        want.append({"boxes": xyxy, "labels": np.asarray(c, np.int64)})
    for i in range(len(blobs)):
        t = en.targets.as_targets(src.targets(i), "t")
        np.testing.assert_allclose(t.boxes, want[i]["boxes"], atol=1e-4)
        assert t.labels.tolist() == cats[i]
    ref = en.Samples(blobs, targets=[en.targets.as_targets(src.targets(i), "t")
                                     for i in range(len(blobs))])
    augment = [en.RandomIoUCrop(), en.RandomHorizontalFlip(), en.Resize((32, 32))]

    def run(s):
        with en.Loader(s, 4, augment=augment, workers=1, seed=2, shuffle=False) as ld:
            return [b.copy() for b in ld]

    for a, b in zip(run(src), run(ref)):
        assert np.array_equal(a.sample_ids, b.sample_ids)
        assert np.array_equal(np.asarray(a.images), np.asarray(b.images))
        assert np.array_equal(a.objects.boxes, b.objects.boxes)
        assert np.array_equal(a.objects.labels, b.objects.labels)
    for fmt, row in (("xyxy", [1, 2, 3, 4]), ("cxcywh", [2, 3, 2, 2])):
        from echo_native.parquet_index import objects_targets
        got = objects_targets({"bbox": [row], "category": [1]}, fmt, "w")
        np.testing.assert_allclose(got["boxes"], [[1, 2, 3, 4]])
    with pytest.raises(ValueError, match=r"w: object 0's bbox is \[1, 2, 3\], not 4 numbers"):
        objects_targets({"bbox": [[1, 2, 3]], "category": [1]}, "xywh", "w")
    with pytest.raises(ValueError, match="box_format must be one of"):
        en.ParquetImages(tmp_path / "det.parquet", label=None, targets="objects",
                         box_format="yxyx")


# ---- object storage -----------------------------------------------------------------------
def test_s3_reads_by_row_group(files, corpus):
    """The same files in S3 (moto): same bytes, labels and class names; each row group is
    one range request of its image columns, fetched once per process however many samples
    it holds; a Loader reads every sample once; it pickles without its connections."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from test_remote import S3Server, s3fs_for

    blobs, labels = corpus
    mp = pytest.MonkeyPatch()
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        mp.setenv(k, v)
    server = S3Server().start()
    try:
        fs = s3fs_for(server.endpoint)
        fs.mkdir("parquet-bucket")
        for f in files:
            fs.put_file(str(f), f"parquet-bucket/train/{f.name}")
        opts = {"endpoint_url": server.endpoint}
        fast = en.RemoteOptions(retry_timeout=10.0, request_timeout=5.0, attempts=3)
        for arg in ("s3://parquet-bucket/train", "s3://parquet-bucket/train/*.parquet",
                    [f"s3://parquet-bucket/train/{f.name}" for f in files]):
            src = en.ParquetImages(arg, storage_options=opts, remote=fast)
            assert src.labels.tolist() == labels.tolist() and src.classes == CLASSES
        assert src.describe(0) == f"s3://parquet-bucket/train/{files[0].name}: row group 0, row 0"
        before = server.requests
        order = src.epoch_order(0, 0)
        src.prefetch(order[:6], upcoming=order[6:12])
        assert [bytes(src.read(int(i))) for i in order] == [blobs[int(i)] for i in order]
        groups = len(src._index.group_starts) - 1
        assert server.requests - before == groups  # one GET per row group, none twice
        with en.Loader(src, 6, image_size=16, workers=2, worker_mode="thread", seed=1) as ld:
            ids = [int(i) for b in ld for i in b.sample_ids]
        assert sorted(ids) == list(range(N))
        # As a process worker gets it: without the parent's connections, reading anew.
        clone = pickle.loads(pickle.dumps(src))
        assert bytes(clone.read(N - 1)) == blobs[N - 1]
        with pytest.raises(FileNotFoundError, match="does not exist"):
            en.ParquetImages("s3://parquet-bucket/train/nope.parquet", storage_options=opts,
                             remote=fast)
    finally:
        server.stop()
        mp.undo()


def test_a_damaged_row_group_fails_its_samples_only(corpus, tmp_path):
    """A row group whose pages are damaged (footer intact) fails each of its samples under
    on_error, naming the file and row group; the other row groups' samples come through,
    in thread workers too."""
    blobs, labels = corpus
    p = write_pyarrow(tmp_path / "damaged.parquet", blobs[:9], labels[:9], row_group_size=3)
    col = pq.ParquetFile(p).metadata.row_group(1).column(0)
    data = bytearray(p.read_bytes())
    data[col.data_page_offset:col.data_page_offset + 24] = b"\xff" * 24  # the page header
    p.write_bytes(bytes(data))
    src = en.ParquetImages(p)
    with pytest.raises(OSError, match=rf"{p}: row group 1 cannot be read"):
        src.read(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with en.Loader(src, 3, image_size=16, workers=2, worker_mode="thread", seed=0,
                       on_error="skip") as ld:
            ids = sorted(int(i) for b in ld for i in b.sample_ids)
    assert ids == [0, 1, 2, 6, 7, 8]
    assert "row group 1 cannot be read" in " ".join(str(w.message) for w in caught)


def test_dataset_dict_and_iterable_are_refused():
    """A DatasetDict (pick a split) or an IterableDataset (no rows to index) is refused
    at construction, saying what to pass."""
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"image": [b"x"], "label": [0]})
    with pytest.raises(TypeError, match=r"a DatasetDict needs a split: dataset\['train'\]"):
        en.ParquetImages(datasets.DatasetDict({"train": ds}))
    with pytest.raises(TypeError, match="an IterableDataset has no rows to index"):
        en.ParquetImages(ds.to_iterable_dataset())


def test_a_given_fsspec_filesystem(files, corpus):
    """filesystem= (any fsspec filesystem, here the in-memory one) lists and reads the
    files through it: same bytes and labels, and it pickles to a worker."""
    fsspec = pytest.importorskip("fsspec")
    blobs, labels = corpus
    fs = fsspec.filesystem("memory")
    for f in files:
        fs.pipe_file(f"/pqtest/{f.name}", f.read_bytes())
    try:
        src = en.ParquetImages("/pqtest", filesystem=fs)
        assert read_all(src) == blobs and src.labels.tolist() == labels.tolist()
        assert src.describe(0) == f"/pqtest/{files[0].name}: row group 0, row 0"
        clone = pickle.loads(pickle.dumps(src))
        assert bytes(clone.read(N - 1)) == blobs[N - 1]
    finally:
        fs.rm("/pqtest", recursive=True)


def test_ranks_share_an_epoch(files):
    """Two ranks (no padding) read disjoint halves of the epoch that cover every sample,
    in the source's order split as DistributedSampler splits it."""
    src = en.ParquetImages(files, shuffle_buffer=5)
    seen = []
    for rank in range(2):
        with en.Loader(src, 4, image_size=16, workers=1, worker_mode="thread", seed=9,
                       shard=en.Shard(rank, 2, pad=False)) as ld:
            ids = [int(i) for b in ld for i in b.sample_ids]
        assert ids == src.epoch_order(9, 0)[rank::2].tolist()
        seen += ids
    assert sorted(seen) == list(range(N))

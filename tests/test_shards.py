"""The shard writer: write_shards and ``echo-native make-shards``.

References: the source itself (ImageFolder / FileList read the same files),
Python's ``tarfile`` reading the shards, and the shards read back through
TarShards from local disk and from an S3 server (moto, as in test_remote.py).
"""
from __future__ import annotations

import io
import os
import sys
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import echo_native as en
from echo_native import shards, tarindex
from echo_native.cli import main
from echo_native.source import FileList, ImageFolder
from echo_native.tarshards import TarShards

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import sources_helpers as sh  # noqa: E402

N = 24


@pytest.fixture(scope="module")
def corpus():
    return sh.photo_jpegs(N, seed=31), np.arange(N) % 4


@pytest.fixture
def folder(corpus, tmp_path):
    blobs, labels = corpus
    return sh.write_folder(tmp_path / "src", blobs, labels)


def same_samples(tar, src, keep=None):
    """TarShards ``tar`` holds ``src``'s samples ``keep`` (default all), in order, same
    bytes and labels, with keys equal to the source indices."""
    keep = list(range(len(src))) if keep is None else keep
    assert len(tar) == len(keep)
    assert [tar.read(i) for i in range(len(tar))] == [src.read(k) for k in keep]
    assert tar.labels.tolist() == [int(src.labels[k]) for k in keep]
    assert [int(tar.describe(i).rsplit(":", 1)[1]) for i in range(len(tar))] == keep


def test_parse_size():
    """Sizes with decimal and binary units, or plain bytes; nonsense is refused."""
    assert shards.parse_size("256MB") == 256 * 10**6
    assert shards.parse_size("1GiB") == 2**30 and shards.parse_size("1.5k") == 1500
    assert shards.parse_size("4096") == 4096 and shards.parse_size(77) == 77
    for bad in ("", "MB", "12 parsecs", "-5MB", "1iB"):
        with pytest.raises(ValueError, match="not a size"):
            shards.parse_size(bad)


def test_roundtrip_local(folder, tmp_path):
    """An ImageFolder packs into size-bounded shards with sidecars; TarShards reads the same
    samples (bytes, labels, order); the output is deterministic."""
    src = ImageFolder(folder)
    out = shards.write_shards(folder, tmp_path / "out", shard_size="12kB", progress=False)
    assert out.samples == N and out.failures == [] and len(out) > 2
    assert [os.path.basename(p) for p in out] == [f"shard-{k:06d}.tar" for k in range(len(out))]
    for p in out:
        with tarfile.open(p) as t:
            names = t.getnames()
        assert all(n.endswith((".jpg", ".cls")) for n in names)
        if len(names) > 2:
            assert os.path.getsize(p) <= 12000
        with open(p + ".idx", "rb") as f:
            side = tarindex.TarIndex.from_json(f.read(), os.path.getsize(p))
        scanned = tarindex.scan_file(p)
        assert (side.keys, side.offsets, side.sizes, side.labels) == \
            (scanned.keys, scanned.offsets, scanned.sizes, scanned.labels)
    assert sorted(os.listdir(tmp_path / "out")) == sorted(
        [os.path.basename(p) for p in out] + [os.path.basename(p) + ".idx" for p in out])
    same_samples(TarShards(out), src)
    with pytest.raises(FileExistsError, match="overwrite"):
        shards.write_shards(folder, tmp_path / "out", shard_size="12kB", progress=False)
    again = shards.write_shards(src, tmp_path / "out", shard_size="12kB", overwrite=True,
                                progress=False)
    assert again == out
    other = shards.write_shards(src, tmp_path / "out2", shard_size="12kB", progress=False)
    assert [Path(p).read_bytes() for p in other] == [Path(p).read_bytes() for p in out]
    one = shards.write_shards(src, tmp_path / "out3", max_count=10, progress=False)
    assert [len(TarShards(p)) for p in one] == [10, 10, 4]


def test_filelist_source_and_sidecar_is_used(folder, tmp_path):
    """A path,label list packs with its labels; TarShards takes the index from the sidecar
    (a sidecar that does not match its shard is ignored with a warning)."""
    files = sorted(folder.rglob("*.jpg"))[:9]
    lst = tmp_path / "train.csv"
    lst.write_text("path,label\n" + "".join(f"{f},{100 + k}\n" for k, f in enumerate(files)))
    out = shards.write_shards(str(lst), tmp_path / "out", progress=False)
    assert len(out) == 1
    tar = TarShards(out)
    same_samples(tar, FileList(lst))
    idx = out[0] + ".idx"
    doc = Path(idx).read_text()
    Path(idx).write_text(doc.replace(",100]", ",555]", 1))  # the sidecar is what is read
    assert TarShards(out).labels[0] == 555
    Path(idx).write_text(doc.replace('"shard_bytes":', '"shard_bytes":1', 1))
    with pytest.warns(RuntimeWarning, match="shard_bytes|bytes"):
        assert TarShards(out).labels[0] == 100


def test_bad_inputs_are_reported_skipped_or_strict(folder, tmp_path):
    """Unreadable, empty, truncated and non-image inputs: named, counted, skipped; --strict
    stops at the first, leaving only complete shards behind."""
    good = sorted(folder.rglob("*.jpg"))
    (folder / "class_01" / "empty.jpg").write_bytes(b"")
    (folder / "class_01" / "text.jpg").write_bytes(b"hello, not an image\n")
    data = good[0].read_bytes()
    (folder / "class_02" / "cut.jpg").write_bytes(data[:len(data) // 2])
    os.symlink(folder / "nowhere.jpg", folder / "class_03" / "dangling.jpg")
    src = ImageFolder(folder)
    bad = {i for i in range(len(src)) if Path(src.path(i)).name in
           ("empty.jpg", "text.jpg", "cut.jpg", "dangling.jpg")}
    seen = []
    out = shards.write_shards(src, tmp_path / "out", shard_size="16kB", progress=False,
                              report=lambda name, msg: seen.append((name, msg)))
    assert sorted(name for name, _ in out.failures) == sorted(src.path(i) for i in bad)
    assert seen == out.failures and out.samples == len(src) - len(bad)
    same_samples(TarShards(out), src, [i for i in range(len(src)) if i not in bad])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shards.write_shards(src, tmp_path / "w", progress=False)
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert sorted(m.split(": ", 1)[0] for m in msgs) == sorted(
        f"skipped {src.path(i)}" for i in bad)
    with pytest.raises(shards.ShardWriteError, match=r"class_01/empty\.jpg"):
        shards.write_shards(src, tmp_path / "strict", shard_size="16kB", strict=True,
                            progress=False)
    left = sorted(os.listdir(tmp_path / "strict"))
    assert not [n for n in left if n.startswith(".")]  # no temporary file left
    for n in left:
        if n.endswith(".tar"):
            assert len(TarShards(str(tmp_path / "strict" / n))) > 0


class _Interrupting:
    """A source whose read of sample ``at`` raises KeyboardInterrupt (Ctrl-C mid-run)."""

    def __init__(self, base, at):
        self.base, self.at, self.labels = base, at, base.labels

    def __len__(self):
        return len(self.base)

    def describe(self, i):
        return self.base.describe(i)

    def read(self, i):
        if i == self.at:
            raise KeyboardInterrupt
        return self.base.read(i)


def test_interrupted_run_leaves_no_truncated_shard(folder, tmp_path):
    """Interrupted mid-shard: only finished shards carry final names, and each is whole."""
    src = ImageFolder(folder)
    with pytest.raises(KeyboardInterrupt):
        shards.write_shards(_Interrupting(src, 15), tmp_path / "out", max_count=4,
                            progress=False)
    names = sorted(os.listdir(tmp_path / "out"))
    assert names == [f"shard-{k:06d}.tar{e}" for k in range(3) for e in ("", ".idx")]
    tar = TarShards(sorted(str(tmp_path / "out" / n) for n in names if n.endswith(".tar")))
    same_samples(tar, src, list(range(12)))


def test_max_side_reencodes_large_images_only(tmp_path, corpus):
    """Images over --max-side are re-encoded as JPEG with the longer side = max_side and the
    aspect kept; smaller ones keep their exact bytes."""
    blobs, _ = corpus
    root = tmp_path / "src"
    (root / "a").mkdir(parents=True)
    big = Image.fromarray(en.decode(blobs[0])).resize((300, 120))
    buf = io.BytesIO()
    big.save(buf, "PNG")
    (root / "a" / "0big.png").write_bytes(buf.getvalue())
    (root / "a" / "1small.jpg").write_bytes(blobs[1])
    out = shards.write_shards(root, tmp_path / "out", max_side=100, progress=False)
    assert out.reencoded == 1
    tar = TarShards(out)
    with tarfile.open(out[0]) as t:
        assert sorted(t.getnames()) == ["000000.cls", "000000.jpg", "000001.cls", "000001.jpg"]
    small = en.decode(tar.read(0))
    assert small.shape == (40, 100, 3) and tar.read(0)[:3] == b"\xff\xd8\xff"
    assert tar.read(1) == blobs[1]
    ref = np.asarray(big.resize((100, 40), Image.Resampling.LANCZOS), dtype=np.float64)
    assert np.abs(small.astype(np.float64) - ref).mean() < 6


def test_hostile_file_names(tmp_path, corpus):
    """Names with spaces, newlines, tabs, quotes and non-UTF-8 bytes pack like any other;
    a bad one is reported escaped, so it cannot break or forge a report line."""
    blobs, _ = corpus
    root = os.fsencode(tmp_path / "src")
    names = [b"with space.jpg", b"new\nline.jpg", b"tab\there.jpg", b"caf\xe9.jpg",
             b"\xff\xfe bytes.JPG", b"--option.jpg", b"quote'\"back\\slash.jpg",
             b"x" * 200 + b".jpg"]
    for c, cls in enumerate([b"plain", b"cl\xe4ss\nname"]):
        os.makedirs(os.path.join(root, cls))
        for k, n in enumerate(names):
            with open(os.path.join(root, cls, n), "wb") as f:
                f.write(blobs[(c * len(names) + k) % len(blobs)])
    with open(os.path.join(root, b"plain", b"bad\n[forged] line\xff.jpg"), "wb") as f:
        f.write(b"not an image")
    src = ImageFolder(os.fsdecode(root))
    assert len(src) == 2 * len(names) + 1
    bad = [i for i in range(len(src)) if "forged" in src.path(i)]
    out = shards.write_shards(src, tmp_path / "out", shard_size="20kB", progress=False,
                              report=lambda *a: None)
    assert [name for name, _ in out.failures] == [src.path(bad[0])]
    same_samples(TarShards(out), src, [i for i in range(len(src)) if i not in bad])
    shown = shards.shown(src.path(bad[0]))
    assert "\n" not in shown and "forged" in shown and "\\n" in shown


def test_cli_make_shards(folder, tmp_path, capsys):
    """``echo-native make-shards``: writes shards and says so; bad input is one line, exit 2;
    --strict with a corrupt input exits 1 naming it."""
    rc = main(["make-shards", str(folder), str(tmp_path / "out"), "--shard-size", "16kB"])
    cap = capsys.readouterr()
    assert rc == 0 and f"wrote {N} samples in" in cap.out and "0 inputs skipped" in cap.out
    same_samples(TarShards(sorted(str(p) for p in (tmp_path / "out").glob("*.tar"))),
                 ImageFolder(folder))
    assert main(["make-shards", str(folder), str(tmp_path / "out")]) == 2
    assert "--overwrite" in capsys.readouterr().err
    for args, needle in ((["--shard-size", "lots"], "--shard-size"),
                         (["--max-side", "0"], "--max-side"),
                         (["--quality", "101"], "--quality")):
        assert main(["make-shards", str(folder), str(tmp_path / "o2"), *args]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1
    assert main(["make-shards", str(tmp_path / "missing"), str(tmp_path / "o3")]) == 2
    assert "no such folder" in capsys.readouterr().err
    (folder / "class_00" / "zzz.jpg").write_bytes(b"junk")
    assert main(["make-shards", str(folder), str(tmp_path / "o4"), "--quiet"]) == 0
    cap = capsys.readouterr()
    assert cap.out == "" and "zzz.jpg" in cap.err
    assert main(["make-shards", str(folder), str(tmp_path / "o5"), "--strict", "-q"]) == 1
    assert "zzz.jpg" in capsys.readouterr().err


# ---- to object storage ----------------------------------------------------------------------
def test_write_to_s3_reads_identically(folder, tmp_path, capsys):
    """Shards written to S3 (by the function and by the command) read back through TarShards
    exactly as the local ones do, index from the uploaded sidecars."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from test_remote import S3Server, s3fs_for

    mp = pytest.MonkeyPatch()
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        mp.setenv(k, v)
    server = S3Server().start()
    try:
        fs = s3fs_for(server.endpoint)
        fs.mkdir("made")
        opts = {"endpoint_url": server.endpoint}
        local = shards.write_shards(folder, tmp_path / "local", shard_size="16kB",
                                    progress=False)
        up = shards.write_shards(folder, "s3://made/train", shard_size="16kB", progress=False,
                                 storage_options=opts)
        assert [u.rsplit("/", 1)[1] for u in up] == [os.path.basename(p) for p in local]
        assert [fs.cat_file(u[5:]) for u in up] == [Path(p).read_bytes() for p in local]
        assert all(fs.exists(u[5:] + ".idx") for u in up)
        assert not [p for p in fs.find("made") if "tmp" in p]
        remote_tar = TarShards(up, storage_options=opts, index_cache=False)
        same_samples(remote_tar, ImageFolder(folder))
        rc = main(["make-shards", str(folder), "s3://made/cli", "--shard-size", "16kB", "-q",
                   "-o", f"endpoint_url={server.endpoint}"])
        assert rc == 0, capsys.readouterr().err
        assert sorted(fs.ls("made/cli")) == sorted(
            f"made/cli/{os.path.basename(p)}{e}" for p in local for e in ("", ".idx"))
    finally:
        server.stop()
        mp.undo()

"""``echo-native shards`` (``make-shards``): a folder packed into seekable shards, shards
re-packed seekable, an interrupted run resumed, and the flags checked in one line."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import echo_native as en
from echo_native import seekable
from echo_native.cli import main
from echo_native.shards import shard_files

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import sources_helpers as sh  # noqa: E402
from cli_helpers import cli_error  # noqa: E402

pytestmark = pytest.mark.timeout(180)
N = 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    blobs = sh.photo_jpegs(N, 48, 64, seed=29)
    return sh.write_folder(tmp_path_factory.mktemp("shards_cli"), blobs, np.arange(N) % 3)


def _samples(out):
    src = en.TarShards(shard_files(out))
    return src, [bytes(src.read(i)) for i in range(len(src))]


def test_a_folder_becomes_seekable_shards_with_the_same_pixels(folder, tmp_path, capsys):
    out = tmp_path / "seek"
    assert main(["shards", str(folder), str(out), "--seekable", "--workers", "2",
                 "--max-count", "5"]) == 0
    assert "0 not seekable" in capsys.readouterr().out
    src, blobs = _samples(out)
    assert len(src) == N and len(shard_files(out)) == 3
    assert all(seekable.is_seekable(b) for b in blobs)
    plain = en.ImageFolder(folder)
    for i in range(N):   # the same image, pixel for pixel, through the same decoder
        np.testing.assert_array_equal(en.decode(blobs[i]), en.decode(plain.read(i)))
    assert list(src.labels) == list(plain.labels)


def test_shards_are_repacked_seekable(folder, tmp_path, capsys):
    plain = tmp_path / "plain"
    assert main(["shards", str(folder), str(plain), "-q"]) == 0
    _, before = _samples(plain)
    assert not any(seekable.is_seekable(b) for b in before)
    out = tmp_path / "seek"
    assert main(["shards", str(plain), str(out), "--seekable", "-q"]) == 0
    src, after = _samples(out)
    assert len(after) == N and all(seekable.is_seekable(b) for b in after)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(en.decode(a), en.decode(b))


def test_resume_keeps_the_complete_shards_and_goes_on(folder, tmp_path, capsys):
    out = tmp_path / "seek"
    assert main(["shards", str(folder), str(out), "--seekable", "--max-count", "4",
                 "-q"]) == 0
    files = shard_files(out)
    last = Path(files[-1])
    last.unlink()                      # as if the run had stopped before its last shard
    kept = {Path(f).name: Path(f).stat().st_mtime_ns for f in files[:-1]}
    assert main(["shards", str(folder), str(out), "--seekable", "--max-count", "4",
                 "--resume"]) == 0
    assert "shards kept from an interrupted run" in capsys.readouterr().out
    assert {Path(f).name: Path(f).stat().st_mtime_ns for f in shard_files(out)[:-1]} == kept
    src, blobs = _samples(out)
    assert len(src) == N and all(seekable.is_seekable(b) for b in blobs)


@pytest.mark.parametrize("argv, needle", [
    (["--restart", "4"], "--restart needs --seekable"),
    (["--seekable", "--restart", "0"], "--restart must be a number of MCUs >= 1 or 'row'"),
    (["--seekable", "--workers", "0"], "--workers must be >= 1"),
])
def test_bad_flags_are_one_line(folder, tmp_path, capsys, argv, needle):
    cli_error(main, "echo-native", capsys,
              ["shards", str(folder), str(tmp_path / "out"), *argv], needle)

"""Shared fixtures for the kernel benchmarks.

Every benchmark in one run works on the same files, preloaded into memory (I/O
is not measured), with the same RandomResizedCrop boxes and flips, so the
numbers can be compared as ratios even on a shared, noisy machine.

Environment:
  ECHO_NATIVE_BENCH_N        images in the corpus (default 300)
  ECHO_NATIVE_BENCH_SEED     corpus seed (default 0)
  ECHO_NATIVE_BENCH_CORPUS   use this ImageFolder tree instead of the built-in
                             corpus (every *.jpg/*.jpeg below it, sorted; the
                             first N are used)
  ECHO_NATIVE_BENCH_ROUNDS   timed passes over the corpus per benchmark (default 10)
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import echo_native as en
from benchenv import env_int

@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """Benchmarks run in one process: the test suite's ``-n auto`` (pyproject's addopts)
    would make pytest-benchmark switch itself off and swallow the printed reports."""
    if config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput"):
        config.option.numprocesses = 0
        config.option.dist = "no"


SIZE = (224, 224)
AUG_SEED = 1234         # augmentation seed: boxes and flips are a pure function of it
EPOCH = 0
SCALE = (0.08, 1.0)
RATIO = (3.0 / 4.0, 4.0 / 3.0)
FLIP_P = 0.5


@dataclass(frozen=True)
class Sample:
    sample_id: int
    data: bytes
    height: int
    width: int
    box: tuple          # (top, left, height, width) in full-size pixels
    flip: bool
    denom: int          # DCT scale the fused kernel picks for this box


@dataclass(frozen=True)
class Workload:
    """The preloaded corpus and the augmentation every benchmark applies to it."""
    root: Path
    samples: tuple
    rounds: int
    size: tuple = SIZE
    seed: int = AUG_SEED
    epoch: int = EPOCH
    scale: tuple = SCALE
    ratio: tuple = RATIO
    flip_p: float = FLIP_P

    @property
    def n(self):
        return len(self.samples)

    def run(self, benchmark, fn, **extra):
        """Time ``fn()`` (one pass over the whole corpus) for a fixed number of rounds."""
        benchmark.extra_info["images"] = self.n
        benchmark.extra_info["corpus"] = str(self.root)
        benchmark.extra_info.update(extra)
        benchmark.pedantic(fn, rounds=self.rounds, iterations=1, warmup_rounds=1)


def _corpus_files(n):
    custom = os.environ.get("ECHO_NATIVE_BENCH_CORPUS")
    if custom:
        root = Path(custom).expanduser()
        files = sorted(p for p in root.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))
        if not files:
            raise pytest.UsageError(f"ECHO_NATIVE_BENCH_CORPUS={custom}: no JPEG files found")
        return root, files[:n]
    from echo_native.lab import corpus

    try:
        root = corpus.default_corpus(n_images=n, seed=env_int("ECHO_NATIVE_BENCH_SEED", 0))
    except ImportError as e:
        pytest.skip(str(e))
    return root, corpus.corpus_files(root)


@pytest.fixture(scope="session")
def workload() -> Workload:
    n = env_int("ECHO_NATIVE_BENCH_N", 300)
    rounds = env_int("ECHO_NATIVE_BENCH_ROUNDS", 10)
    if n < 1 or rounds < 1:
        raise pytest.UsageError("ECHO_NATIVE_BENCH_N and ECHO_NATIVE_BENCH_ROUNDS must be >= 1")
    root, files = _corpus_files(n)
    samples = []
    for sid, path in enumerate(files):
        data = path.read_bytes()
        h, w = en.image_size(data)
        box, flip = en.random_resized_crop_params(AUG_SEED, EPOCH, sid, 0, h, w)
        samples.append(Sample(sid, data, h, w, box, flip, en.pick_scale(box, SIZE)))
    return Workload(root, tuple(samples), rounds)


@pytest.fixture(scope="module")
def folder(workload, tmp_path_factory):
    """The workload's files as an ImageFolder tree of symlinks: the same files for every
    pipeline a benchmark module compares."""
    root = tmp_path_factory.mktemp("folder")
    for i, path in enumerate(_corpus_files(workload.n)[1]):
        d = root / (path.parent.name or "class_0")
        d.mkdir(exist_ok=True)
        (d / f"{i:06d}_{path.name}").symlink_to(path.resolve())
    src = en.ImageFolder(root)
    assert len(src) == workload.n
    return src


@pytest.fixture
def out_buffer():
    return np.empty((*SIZE, 3), dtype=np.uint8)

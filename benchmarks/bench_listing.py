"""ImageFolder listing: time and memory on a generated tree of empty files.

The tree (default 200,000 empty ``.JPEG`` files in 1,000 class folders, ImageNet-like
names) is created once in a temporary folder; creating it is not timed.  Each timed
round lists the whole tree (warm directory cache, as on the second epoch of a job or
any re-listing).  Compared with torchvision's listing algorithm (``find_classes`` +
``make_dataset``: a list of ``(path, label)`` tuples), re-implemented here because
torchvision is not a dependency::

    python -m pytest benchmarks/bench_listing.py --benchmark-only -s \\
        --benchmark-json=/tmp/listing.json

Environment:
  ECHO_NATIVE_LISTING_N         files in the tree (default 200000)
  ECHO_NATIVE_LISTING_CLASSES   class folders (default 1000)
  ECHO_NATIVE_LISTING_ROUNDS    timed rounds per benchmark (default 5)

Reported in ``extra_info`` (and printed with ``-s``): files, per-file cost (us), the
tracemalloc peak while listing, the memory the finished listing keeps, and for
ImageFolder the size of its packed arrays against a list of Python ``str`` paths and
the pickled size (what each worker process receives).
"""
from __future__ import annotations

import os
import pickle
import sys
import time
import tracemalloc

import pytest

from benchenv import env_int
from echo_native.source import IMG_EXTENSIONS, ImageFolder

N_FILES = env_int("ECHO_NATIVE_LISTING_N", 200000)
N_CLASSES = env_int("ECHO_NATIVE_LISTING_CLASSES", 1000)
ROUNDS = env_int("ECHO_NATIVE_LISTING_ROUNDS", 5)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """N_FILES empty files in N_CLASSES folders (creation time excluded from the timings)."""
    root = tmp_path_factory.mktemp("listing")
    per = -(-N_FILES // N_CLASSES)
    made, t0 = 0, time.perf_counter()
    for c in range(N_CLASSES):
        d = root / f"n{c:08d}"
        d.mkdir()
        for j in range(min(per, N_FILES - made)):
            os.close(os.open(d / f"n{c:08d}_{j:07d}.JPEG", os.O_CREAT | os.O_WRONLY, 0o644))
            made += 1
    created = time.perf_counter() - t0
    print(f"\n[listing] created {made} empty files in {N_CLASSES} folders in {created:.1f} s")
    return root, made


def torchvision_listing(root, extensions=IMG_EXTENSIONS):
    """torchvision.datasets.folder.find_classes + make_dataset: [(path, class_index)]."""
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    class_to_idx = {c: i for i, c in enumerate(classes)}
    instances = []
    for target_class in sorted(class_to_idx):
        class_index = class_to_idx[target_class]
        target_dir = os.path.join(root, target_class)
        for r, _, fnames in sorted(os.walk(target_dir, followlinks=True)):
            for fname in sorted(fnames):
                path = os.path.join(r, fname)
                if path.lower().endswith(extensions):
                    instances.append((path, class_index))
    return instances


def _traced(fn):
    """(result, peak bytes while fn ran, bytes still held by the result)."""
    import gc

    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        result = fn()
        gc.collect()
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak - base, current - base


def _report(benchmark, name, files, peak, kept, **extra):
    mean = benchmark.stats.stats.mean
    info = {"files": files, "per_file_us": mean / files * 1e6, "files_per_s": files / mean,
            "tracemalloc_peak_bytes": peak, "kept_bytes": kept,
            "kept_bytes_per_file": kept / files, **extra}
    benchmark.extra_info.update(info)
    parts = [f"{name}: {files} files, {mean * 1e3:.0f} ms mean "
             f"({info['per_file_us']:.2f} us/file, {info['files_per_s'] / 1e6:.2f} M files/s)",
             f"peak {peak / 2**20:.1f} MiB, kept {kept / 2**20:.1f} MiB "
             f"({info['kept_bytes_per_file']:.0f} B/file)"]
    parts += [f"{k} {v}" for k, v in extra.items()]
    print("\n[listing] " + "; ".join(parts))


def test_imagefolder_listing(benchmark, tree):
    root, files = tree
    src = benchmark.pedantic(ImageFolder, args=(root,), rounds=ROUNDS, iterations=1,
                             warmup_rounds=1)
    assert len(src) == files and len(src.classes) == N_CLASSES
    _, peak, kept = _traced(lambda: ImageFolder(root))
    paths = [os.path.relpath(src.path(i), root) for i in range(len(src))]
    str_list = sys.getsizeof(paths) + sum(sys.getsizeof(p) for p in paths)
    packed = len(src._paths.blob) + src._paths.offsets.nbytes + src.labels.nbytes
    _report(benchmark, "ImageFolder", files, peak, kept,
            packed_bytes=packed, packed_bytes_per_file=round(packed / files, 1),
            str_list_bytes=str_list, str_list_bytes_per_file=round(str_list / files, 1),
            pickled_bytes=len(pickle.dumps(src, protocol=pickle.HIGHEST_PROTOCOL)))


def test_torchvision_style_listing(benchmark, tree):
    root, files = tree
    out = benchmark.pedantic(torchvision_listing, args=(str(root),), rounds=ROUNDS,
                             iterations=1, warmup_rounds=1)
    assert len(out) == files
    _, peak, kept = _traced(lambda: torchvision_listing(str(root)))
    _report(benchmark, "torchvision-style", files, peak, kept,
            pickled_bytes=len(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)))

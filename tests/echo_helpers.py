"""Helpers for the echo-stage tests that must be importable by workers.

Worker processes are fresh interpreters, so a custom source they read from must live
in an importable module, not in a test file.  ``tests/test_echo.py`` and
``tests/test_pipeline.py`` put this folder on ``sys.path`` and ``import
echo_helpers``; every worker gets the consumer's ``sys.path``.
"""
from __future__ import annotations

import io
import os
import time
from collections import defaultdict

import numpy as np

# scikit-image photographs the test JPEGs are cut from (real content, never noise).
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")


def photo_jpegs(n, height, width, seed=0, quality=90):
    """``n`` JPEGs of exactly ``height`` x ``width``, each a random crop of a real photograph
    resized with Lanczos (varied content, so every sample decodes to different pixels)."""
    import skimage.data
    from PIL import Image

    photos = [np.ascontiguousarray(getattr(skimage.data, p)()[..., :3]) for p in PHOTOS]
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        src = photos[i % len(photos)]
        h, w = src.shape[:2]
        ch, cw = int(rng.integers(h // 3, h)), int(rng.integers(w // 3, w))
        y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
        im = Image.fromarray(src[y:y + ch, x:x + cw]).resize((width, height), Image.LANCZOS)
        if rng.random() < 0.5:
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=quality)
        out.append(buf.getvalue())
    return out


class SleepySource:
    """In-memory JPEGs whose ``read`` sleeps ``delay`` seconds: a slow upstream
    (network storage, say) whose speed the test sets."""

    def __init__(self, blobs, labels, delay):
        self.blobs = [bytes(b) for b in blobs]
        self.labels = np.asarray(labels, dtype=np.int64)
        self.delay = float(delay)

    def __len__(self):
        return len(self.blobs)

    def describe(self, i):
        return f"<sleepy sample {i}>"

    def read(self, i):
        time.sleep(self.delay)
        return self.blobs[i]


# ---- reading what a ring delivered ---------------------------------------------------
def collect(ring, epochs=1, step=None, copy_images=True):
    """Iterate ``epochs`` epochs; returns one list of batch records per epoch.

    Each record is a dict of copies (the ring reuses its output buffers), plus
    ``len`` = ``len(ring)`` announced before that epoch.  ``step(batch)`` is
    called on every batch (a consumer's work).
    """
    out = []
    for _ in range(epochs):
        announced = len(ring)
        recs = []
        for b in ring:
            rec = {"ids": b.sample_ids.copy(), "labels": b.labels.copy(),
                   "fresh": b.fresh.copy(), "echo": b.echo_index.copy(),
                   "boxes": b.crop_boxes.copy(), "flips": np.asarray(b.flips, bool).copy(),
                   "epoch": b.epoch}
            if copy_images:
                rec["images"] = np.array(b.images, copy=True)
            if step is not None:
                step(b)
            recs.append(rec)
        for r in recs:
            r["announced"] = announced
        out.append(recs)
    return out


def emissions(batches):
    """sample id -> list of (batch index, row, echo index), in delivery order."""
    pos = defaultdict(list)
    for j, b in enumerate(batches):
        for r, (s, e) in enumerate(zip(b["ids"], b["echo"])):
            pos[int(s)].append((j, r, int(e)))
    return pos


def repeat_gaps(batches):
    """Distances in batches between consecutive emissions of the same example."""
    gaps = [np.diff([j for j, _, _ in v]) for v in emissions(batches).values() if len(v) > 1]
    return np.concatenate(gaps) if gaps else np.zeros(0, np.int64)


def rss_bytes():
    """Resident set size of this process, from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def samples_of(data):
    """(blobs, labels) as an in-memory source."""
    import echo_native as en

    return en.Samples(*data)


def small_ring(data, **kw):
    """An EchoRing over (blobs, labels) with small test defaults (batch 8, 24 px, 2 workers)."""
    import echo_native as en

    kw.setdefault("batch_size", 8)
    kw.setdefault("image_size", 24)
    kw.setdefault("workers", 2)
    kw.setdefault("seed", 0)
    kw.setdefault("timeout", 60)
    return en.EchoRing(samples_of(data), **kw)


def flat(batches, key):
    """One array of ``key`` over a list of batch dicts."""
    return np.concatenate([b[key] for b in batches])

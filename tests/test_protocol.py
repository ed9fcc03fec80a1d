"""The Source protocol: what makes a source, and the optional hooks the pipeline asks
for by name (``echo_native.protocol``)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import echo_native as en
from echo_native import protocol
from echo_native.remote import RemoteOptions

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import sources_helpers as sh  # noqa: E402


class Blobs:
    """The protocol's example: three members, no hook."""

    def __init__(self, blobs, labels):
        self.blobs, self.labels = blobs, np.asarray(labels)

    def __len__(self):
        return len(self.blobs)

    def read(self, i):
        return self.blobs[i]


def test_three_members_make_a_source_and_the_built_ins_are_sources(tmp_path):
    assert isinstance(Blobs([b"x"], [0]), en.Source)
    assert isinstance(en.Samples([b"x"], [0]), en.Source)
    folder = sh.write_folder(tmp_path, sh.photo_jpegs(3, seed=1), [0, 1, 0])
    assert isinstance(en.ImageFolder(folder), en.Source)
    for not_one in (object(), [b"x"], {"labels": [0]}):
        assert not isinstance(not_one, en.Source)


def test_the_protocols_example_runs_in_a_ring():
    """A source with no hook at all: the plan's order, 'sample i' in messages."""
    blobs = sh.photo_jpegs(8, seed=2)
    with en.EchoRing(Blobs(blobs, np.arange(8) % 2), 4, image_size=16, echo=1, workers=1,
                     shuffle=False) as ring:
        ids = [int(i) for b in ring for i in b.sample_ids]
    assert ids == list(range(8))


def test_a_source_without_describe_is_named_by_its_sample_in_failures():
    blobs = sh.photo_jpegs(4, seed=3)
    blobs[2] = b"not an image"
    with pytest.warns(en.SampleFailureWarning, match=r"sample 2"):
        with en.EchoRing(Blobs(blobs, [0] * 4), 4, image_size=16, echo=1, workers=1,
                         on_error="skip") as ring:
            assert sorted(int(i) for b in ring for i in b.sample_ids) == [0, 1, 3]


def test_hooks_are_asked_by_name_and_only_the_table_s():
    src = Blobs([b"x"], [0])
    assert protocol.hook(src, "epoch_order") is None
    assert protocol.hook(src, "has_targets", True) is True
    with pytest.raises(KeyError, match=r"'_store' is not a source hook"):
        protocol.hook(src, "_store")


def test_a_source_s_own_epoch_order_is_the_plans():
    class Reversed(Blobs):
        def epoch_order(self, seed, epoch):
            return np.arange(len(self))[::-1]

    blobs = sh.photo_jpegs(6, seed=4)
    with en.EchoRing(Reversed(blobs, [0] * 6), 3, image_size=16, echo=1, workers=1,
                     seed=9) as ring:
        ids = [int(i) for b in ring for i in b.sample_ids]
    assert ids == [5, 4, 3, 2, 1, 0]


def test_remote_options_count_in_the_memory_budget():
    """A source that reads object storage says so through ``remote_options``: each
    worker's block cache and prefetch count against the budget; a local one adds
    nothing."""
    class Remote(Blobs):
        remote_options = RemoteOptions(cache_bytes=64 * 2**20, prefetch_bytes=32 * 2**20)

    blobs = sh.photo_jpegs(4, seed=5)
    local = en.Loader(Blobs(blobs, [0] * 4), 2, image_size=16, workers=2,
                      worker_mode="process")
    remote = en.Loader(Remote(blobs, [0] * 4), 2, image_size=16, workers=2,
                       worker_mode="process")
    extra = remote._budget().worker_bytes - local._budget().worker_bytes
    assert extra == 96 * 2**20

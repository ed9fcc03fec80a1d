"""The public API: small specs that validate themselves, wired by EchoRing and Loader.

Each spec (RandomResizedCrop, CenterCrop, Echo, Output, DecodeLimits, Shard) names
a bad value where the user wrote it; the flat keywords of the original contract
keep working as shorthands and give the same batches as the specs they build.
"""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

import echo_native as en
from echo_native.ring import MAX_WORKERS
from photos import fit, photo


def _jpegs(n, h=56, w=72, seed=0):
    rng = np.random.default_rng(seed)
    names = ["astronaut", "coffee", "chelsea", "rocket"]
    out = []
    for i in range(n):
        arr = photo(names[i % len(names)])
        arr = np.stack([arr] * 3, -1) if arr.ndim == 2 else arr
        hh, ww = h + int(rng.integers(0, 24)), w + int(rng.integers(0, 24))
        buf = io.BytesIO()
        Image.fromarray(fit(arr, hh, ww)).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


@pytest.fixture(scope="module")
def samples():
    blobs = _jpegs(24)
    return en.Samples(blobs, labels=np.arange(24) % 3, names=[f"s{i}.jpg" for i in range(24)])


def _take(ring, epochs=1):
    out = []
    with ring:
        for epoch in range(epochs):
            ring.set_epoch(epoch)
            for b in ring:
                out.append((b.sample_ids.copy(), np.array(b.images), b.echo_index.copy()))
    return out


# -- every spec validates itself and names the bad value ------------------------------------
@pytest.mark.parametrize("make,exc,match", [
    (lambda: en.RandomResizedCrop(0), ValueError, r"RandomResizedCrop: size must be positive"),
    (lambda: en.RandomResizedCrop((24, "a")), TypeError, r"RandomResizedCrop: size must be"),
    (lambda: en.RandomResizedCrop(24, scale=(0.5, 0.2)), ValueError, r"RandomResizedCrop: scale"),
    (lambda: en.RandomResizedCrop(24, ratio=(0, 1)), ValueError, r"RandomResizedCrop: ratio"),
    (lambda: en.RandomResizedCrop(24, flip_p=1.5), ValueError, r"RandomResizedCrop: flip_p"),
    (lambda: en.RandomResizedCrop(24, scale=3), TypeError, r"RandomResizedCrop: scale must be a"),
    (lambda: en.CenterCrop(24, resize=-1), ValueError, r"CenterCrop: resize must be"),
    (lambda: en.Echo(0.5), ValueError, r"Echo: factor must be a number >= 1"),
    (lambda: en.Echo("sometimes"), ValueError, r"Echo: factor must be .* or 'auto'"),
    (lambda: en.Echo(float("inf")), ValueError, r"Echo: factor"),
    (lambda: en.Echo(2, placement="after"), ValueError, r"Echo: placement must be one of"),
    (lambda: en.Echo(2, max_echo=0.5), ValueError, r"Echo: max_echo must be"),
    (lambda: en.Echo(2, shuffle_buffer=0), ValueError, r"Echo: shuffle_buffer must be"),
    (lambda: en.Echo(2, canvas_side=2.5), ValueError, r"Echo: canvas_side must be"),
    (lambda: en.Echo(2, flip=True), ValueError, r"Echo: flip=True .*after_augment"),
    (lambda: en.Output(layout="CHW"), ValueError, r"Output: layout must be one of"),
    (lambda: en.Output(dtype="float64"), ValueError, r"Output: dtype of normalised output"),
    (lambda: en.Output(normalize=False, dtype="float16"), ValueError, r"Output: dtype='float16'"),
    (lambda: en.Output(normalize=False, layout="NCHW"), ValueError, r"Output: layout='NCHW'"),
    (lambda: en.Output(normalize=((0, 0, 0), (1, 0, 1))), ValueError, r"3 finite means and 3 "
                                                                       r"positive stds"),
    (lambda: en.Output(normalize="imagenet"), ValueError, r"Output: normalize must be"),
    (lambda: en.DecodeLimits(max_pixels=0), ValueError, r"DecodeLimits: max_pixels must be"),
    (lambda: en.DecodeLimits(max_scans=1.5), ValueError, r"DecodeLimits: max_scans must be"),
    (lambda: en.DecodeLimits(strict="yes"), TypeError, r"DecodeLimits: strict must be"),
    (lambda: en.Shard(3, 2), ValueError, r"rank=3, world_size=2"),
    (lambda: en.Shard(0, 2, pad="no"), TypeError, r"Shard: pad must be"),
    (lambda: en.Shard("0", 2), TypeError, r"Shard: rank must be an integer"),
])
def test_specs_name_their_bad_values(make, exc, match):
    """A bad spec value raises at construction with the spec and the value in the message."""
    with pytest.raises(exc, match=match):
        make()


def test_specs_normalise_and_compare_by_value():
    """Specs are frozen values: sizes become (h, w), defaults are filled in, equal specs are
    equal and hashable."""
    assert en.RandomResizedCrop(224).size == (224, 224)
    assert en.RandomResizedCrop((160, 224)) == en.RandomResizedCrop([160, 224])
    assert en.Output().dtype == "float32" and en.Output(False).dtype == "uint8"
    assert en.Output(True).mean == en.output.IMAGENET_MEAN
    assert en.Output(((0.5,) * 3, (0.25,) * 3)).std == (0.25,) * 3
    assert en.Output(((0.5,) * 3, (0.25,) * 3)) != en.Output(True)
    assert en.Echo(2).factor == 2.0 and en.Echo("auto").auto and en.Echo(1).off
    assert len({en.Echo(2), en.Echo(2.0), en.DecodeLimits(), en.DecodeLimits()}) == 2
    with pytest.raises(Exception):
        en.Echo(2).factor = 3  # frozen


# -- EchoRing wires the specs; shorthands are the same thing ----------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("placement", ["before_augment", "after_augment", "batch"])
def test_shorthands_give_the_same_batches_as_specs(samples, placement):
    """The flat keywords of the original contract build exactly the specs' pipeline."""
    flat = en.EchoRing(samples, 8, image_size=(24, 32), scale=(0.3, 1.0), ratio=(0.5, 2.0),
                       flip_p=0.25, echo=2, placement=placement, shuffle_buffer=16,
                       normalize=True, layout="NCHW", dtype="float16", strict=False,
                       rank=0, world_size=1, workers=1, seed=5)
    specs = en.EchoRing(samples, 8,
                        augment=en.RandomResizedCrop((24, 32), scale=(0.3, 1.0),
                                                     ratio=(0.5, 2.0), flip_p=0.25),
                        echo=en.Echo(2, placement=placement, shuffle_buffer=16),
                        output=en.Output(True, layout="NCHW", dtype="float16"),
                        decode=en.DecodeLimits(strict=False), shard=en.Shard(0, 1),
                        workers=1, seed=5)
    a, b = _take(flat), _take(specs)
    assert len(a) == len(b) == len(flat) == 6
    for (ia, xa, ea), (ib, xb, eb) in zip(a, b):
        np.testing.assert_array_equal(ia, ib)
        np.testing.assert_array_equal(ea, eb)
        np.testing.assert_array_equal(xa, xb)
        assert xa.shape[1:] == (3, 24, 32) and xa.dtype == np.float16


@pytest.mark.parametrize("kwargs,match", [
    (dict(augment=en.RandomResizedCrop(16), image_size=16), r"augment= or image_size"),
    (dict(echo=en.Echo(2), placement="batch"), r"echo=Echo\(\.\.\.\) or placement"),
    (dict(output=en.Output(), normalize=True), r"output=Output\(\.\.\.\) or normalize"),
    (dict(decode=en.DecodeLimits(), strict=False), r"decode= or strict="),
    (dict(shard=en.Shard(), rank=0), r"shard= or rank="),
    (dict(image_sise=16), r"unexpected keyword argument\(s\) image_sise"),
    (dict(output="float16"), r"output must be an echo_native.Output"),
    (dict(augment=(16, 16)), r"augment must be an echo_native.RandomResizedCrop"),
    (dict(decode={"strict": False}), r"decode must be an echo_native.DecodeLimits"),
])
def test_ambiguous_or_unknown_arguments_are_type_errors(samples, kwargs, match):
    """A shorthand next to its spec, an unknown keyword or a non-spec is refused by name."""
    with pytest.raises(TypeError, match=match):
        en.EchoRing(samples, 8, workers=1, **kwargs)


def test_arguments_after_batch_size_are_keyword_only(samples):
    """EchoRing(source, batch_size, *, ...): a positional third argument is refused."""
    with pytest.raises(TypeError):
        en.EchoRing(samples, 8, 224)
    with pytest.raises(TypeError):
        en.Loader(samples, 8, en.RandomResizedCrop(16))


def test_echo_number_and_auto_shorthands(samples):
    """echo=2.0 / "auto" / 1 are Echo(2.0) / Echo("auto") / no echo; bad ones name echo."""
    assert en.EchoRing(samples, 8, echo=2.0, workers=1).spec == en.Echo(2.0)
    assert en.EchoRing(samples, 8, echo="auto", max_echo=3, workers=1).spec == \
        en.Echo("auto", max_echo=3)
    assert en.EchoRing(samples, 8, echo=1, workers=1).spec.off
    with pytest.raises(ValueError, match=r"^echo must be"):
        en.EchoRing(samples, 8, echo=0)
    with pytest.raises(ValueError, match=r"echo must be an echo_native.Echo"):
        en.EchoRing(samples, 8, echo=[2])


def test_worker_limit_is_named(samples):
    """More workers than the ring's layout has claim words for is refused up front."""
    with pytest.raises(ValueError, match=rf"workers must be an integer from 1 to {MAX_WORKERS}"):
        en.Loader(samples, 8, workers=MAX_WORKERS + 1)
    with pytest.raises(ValueError, match=rf"from 1 to {MAX_WORKERS}"):
        en.EchoRing(samples, 8, workers=10_000)


# -- what the specs reach ----------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("placement", ["before_augment", "after_augment", "batch"])
def test_non_square_output_in_every_placement(samples, placement):
    """RandomResizedCrop((h, w)) gives (B, h, w, 3) batches whatever the placement; fresh
    after-augment emissions equal the fused decode of the same key."""
    ring = en.EchoRing(samples, 6, augment=en.RandomResizedCrop((20, 36)),
                       echo=en.Echo(2, placement=placement), workers=2, seed=3)
    with ring:
        for batch in ring:
            assert batch.images.shape[1:] == (20, 36, 3)
            if placement != "after_augment":
                continue
            for sid, img, e in zip(batch.sample_ids, batch.images, batch.echo_index):
                ref, _, _ = en.decode_random_crop(samples.read(int(sid)), (20, 36), 3,
                                                  batch.epoch, int(sid), 0)
                np.testing.assert_array_equal(img, ref)


@pytest.mark.timeout(120)
def test_shuffle_false_keeps_source_order(samples):
    """shuffle=False is reachable from EchoRing: fresh samples come in source order."""
    ring = en.EchoRing(samples, 8, echo=1, shuffle=False, workers=2)
    ids = [int(s) for _, batch_ids, _ in [(0, b[0], 0) for b in _take(ring)] for s in batch_ids]
    assert ids == list(range(len(samples)))
    shuffled = en.EchoRing(samples, 8, echo=1, workers=2)
    ids2 = [int(s) for b in _take(shuffled) for s in b[0]]
    assert sorted(ids2) == ids and ids2 != ids


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore::echo_native.SampleFailureWarning")
def test_decode_limits_reach_the_workers(samples):
    """DecodeLimits given to EchoRing is what the workers decode with: a pixel limit below
    the images' size fails them (reported and counted), strict=False accepts a truncated
    file that strict mode replaces."""
    tiny = en.EchoRing(samples, 8, echo=1, workers=1, decode=en.DecodeLimits(max_pixels=100),
                       on_error="skip")
    with tiny:
        with pytest.raises(en.DecodeError, match=r"max_pixels=100"):
            next(iter(tiny))    # every sample fails: the epoch has no batch at all
        failures = tiny.stats()["failures"]
    assert sum(failures.values()) == len(samples)

    blobs = [samples.read(i) for i in range(len(samples))]
    blobs[5] = blobs[5][: len(blobs[5]) // 2]
    cut = en.Samples(blobs, names=[f"s{i}.jpg" for i in range(len(blobs))])
    for limits, expect_failures in ((en.DecodeLimits(), 1), (en.DecodeLimits(strict=False), 0)):
        ring = en.EchoRing(cut, 8, echo=2, workers=1, decode=limits)
        with ring:
            ids = {int(s) for b in ring for s, f in zip(b.sample_ids, b.fresh) if f}
            failures = sum(ring.stats()["failures"].values())
        assert failures == expect_failures
        assert (5 in ids) == (expect_failures == 0)


@pytest.mark.timeout(120)
def test_loader_takes_the_same_specs(samples):
    """Loader accepts augment=, decode= and shard= (and the same shorthands)."""
    loader = en.Loader(samples, 5, augment=en.CenterCrop((12, 20)), shuffle=False,
                       decode=en.DecodeLimits(max_scans=10), shard=en.Shard(1, 2), workers=1)
    assert loader.plan.decode.max_scans == 10
    with loader:
        batches = [b.copy() for b in loader]
    ids = np.concatenate([b.sample_ids for b in batches])
    np.testing.assert_array_equal(ids, np.arange(1, len(samples), 2))
    assert batches[0].images.shape[1:] == (12, 20, 3)
    np.testing.assert_array_equal(batches[0].images[0],
                                  en.decode_center_crop(samples.read(1), (12, 20)))

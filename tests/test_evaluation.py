"""The evaluation path: a validation loader with the training loader's output contract.

``EchoRing(val, B, augment=CenterCrop(224, resize=256), echo=1, shuffle=False,
output=..., device=...)`` must give torchvision's ``Resize(256) + CenterCrop(224)``
pixels (then ``ToTensor() + Normalize(mean, std)``), every sample exactly once, in
source order, and shard over ranks without padding duplicates.

torchvision's own wheel cannot be imported against the CPU build of torch used
here, so the reference is torchvision's PIL code path written out with Pillow:
``Resize(int)`` makes the shorter side ``resize`` and the longer
``int(resize * long / short)`` and resamples with ``Image.BILINEAR`` (antialiased);
``CenterCrop`` crops at ``int(round((H - h) / 2))``, ``int(round((W - w) / 2))``.

Tolerance (in 0-255 levels, measured on the photographs below): where the fused
decode works at full DCT scale the two differ only by rounding, at most 1 level
per pixel (one resampling instead of torchvision's two); where the box is at least
twice the output and the kernel decodes at 1/2, 1/4 or 1/8 DCT scale (the faster
path), the mean difference stays under 1 level (0.2-0.6 measured; single pixels at
edges differ by up to ~12).
"""
from __future__ import annotations

import io
import os

import numpy as np
import pytest
from PIL import Image

import echo_native as en
from echo_native.backends.array import ArrayDevice
from photos import fit, photo

MEAN = np.array(en.output.IMAGENET_MEAN, np.float32)
STD = np.array(en.output.IMAGENET_STD, np.float32)

# (photo, height, width): small ones decode at full scale for 224, large ones at 1/2 or 1/4.
PHOTOS = [("astronaut", 300, 400), ("coffee", 375, 500), ("chelsea", 500, 333),
          ("rocket", 427, 640), ("astronaut", 1100, 900), ("coffee", 960, 1280),
          ("chelsea", 240, 250), ("rocket", 800, 2000)]


def torchvision_eval(data, size, resize):
    """torchvision's Resize(resize) + CenterCrop(size) on a PIL image, as uint8 HWC."""
    with Image.open(io.BytesIO(data)) as im:
        im = im.convert("RGB")
        w, h = im.size
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = resize, int(resize * long / short)
        rw, rh = (new_short, new_long) if w <= h else (new_long, new_short)
        im = im.resize((rw, rh), Image.BILINEAR)
        ch, cw = size
        top, left = int(round((rh - ch) / 2.0)), int(round((rw - cw) / 2.0))
        return np.asarray(im.crop((left, top, left + cw, top + ch)))


def normalize_nchw(pixels):
    """torchvision ToTensor() + Normalize(mean, std) of one HWC uint8 image."""
    x = pixels.astype(np.float32) / 255.0
    return ((x - MEAN) / STD).transpose(2, 0, 1)


@pytest.fixture(scope="module")
def val_folder(tmp_path_factory):
    """An ImageFolder of real photographs at several sizes, two classes, plus a PNG."""
    root = tmp_path_factory.mktemp("val")
    for i, (name, h, w) in enumerate(PHOTOS):
        arr = photo(name)
        arr = np.stack([arr] * 3, -1) if arr.ndim == 2 else arr
        cls = root / f"class{i % 2}"
        cls.mkdir(exist_ok=True)
        Image.fromarray(fit(arr, h, w)).save(cls / f"img{i}.jpg", quality=90)
    Image.fromarray(fit(photo("coffee"), 290, 310)).save(root / "class1" / "zz.png")
    return root


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [224, (160, 224)])
def test_center_crop_ring_matches_torchvision_in_order(val_folder, size):
    """Every sample once, in source order, labels kept, pixels within the stated tolerance."""
    src = en.ImageFolder(val_folder)
    spec = en.CenterCrop(size, resize=256)
    ring = en.EchoRing(src, 4, augment=spec, echo=1, shuffle=False, workers=2,
                       output=en.Output(normalize=True, layout="NCHW"))
    seen, images = [], []
    with ring:
        for batch in ring:
            assert batch.images.shape[1:] == (3, *spec.size)
            assert batch.images.dtype == np.float32
            seen.extend(batch.sample_ids.tolist())
            np.testing.assert_array_equal(batch.labels, src.labels[batch.sample_ids])
            assert batch.fresh.all() and not batch.flips.any()
            images.extend(np.array(batch.images))
    assert seen == list(range(len(src)))
    for i, got in enumerate(images):
        data = src.read(i)
        ref = normalize_nchw(torchvision_eval(data, spec.size, 256))
        levels = np.abs(got - ref) * STD[:, None, None] * 255.0
        h, w = en.image_size(data)
        box = en.center_crop_box(h, w, 256, spec.size)
        if en.pick_scale(box, spec.size) == 1:
            assert levels.max() <= 1.01, (src.describe(i), levels.max())
        else:
            assert levels.mean() <= 1.0, (src.describe(i), levels.mean())
    # The large photos really went through DCT scaling (the fast path is exercised).
    scales = [en.pick_scale(en.center_crop_box(*en.image_size(src.read(i)), 256, spec.size),
                            spec.size) for i in range(len(src))]
    assert max(scales) >= 2 and min(scales) == 1


@pytest.mark.timeout(120)
def test_evaluation_on_the_array_backend_matches_cpu(val_folder):
    """The GPU code path (array backend, here on NumPy) delivers the same normalised batches."""
    src = en.ImageFolder(val_folder)
    kw = dict(augment=en.CenterCrop(64), echo=1, shuffle=False, workers=1,
              output=en.Output(normalize=True, layout="NCHW", dtype="float16"))
    with en.EchoRing(src, 3, **kw) as cpu, en.EchoRing(src, 3, device=ArrayDevice(np),
                                                      **kw) as arr:
        for a, b in zip(cpu, arr):
            np.testing.assert_array_equal(a.sample_ids, b.sample_ids)
            np.testing.assert_array_equal(np.asarray(a.images), np.asarray(b.images))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_evaluation_sees_every_sample_exactly_once(val_folder, world):
    """Unpadded shards (the default without shuffling) partition the data; ranks differ by
    at most one sample and one batch."""
    src = en.ImageFolder(val_folder)
    ids, batches = [], []
    for rank in range(world):
        ring = en.EchoRing(src, 2, augment=en.CenterCrop(32), echo=1, shuffle=False, workers=1,
                           shard=en.Shard(rank, world))
        with ring:
            mine = [int(s) for b in ring for s in b.sample_ids]
        assert len(ring) == len(ring.loader) == -(-len(mine) // 2)
        assert mine == sorted(mine)  # source order within a rank
        ids.append(mine)
        batches.append(len(ring))
    assert sorted(sum(ids, [])) == list(range(len(src)))
    assert max(map(len, ids)) - min(map(len, ids)) <= 1
    assert max(batches) - min(batches) <= 1


@pytest.mark.timeout(120)
def test_padded_shards_are_equal_length_like_distributed_sampler(val_folder):
    """Shard(pad=True): DistributedSampler's padding, every rank the same number of samples."""
    src = en.ImageFolder(val_folder)  # 9 samples
    world, lengths, ids = 4, [], []
    for rank in range(world):
        loader = en.Loader(src, 2, augment=en.CenterCrop(16), shuffle=False, workers=1,
                           shard=en.Shard(rank, world, pad=True))
        with loader:
            mine = [int(s) for b in loader for s in b.sample_ids]
        lengths.append(len(mine))
        ids.extend(mine)
    assert set(lengths) == {3}
    assert set(ids) == set(range(len(src))) and len(ids) == 12  # 3 padded repeats


def test_shard_defaults_follow_shuffle():
    """Without pad=, training shards (shuffle=True) pad and evaluation shards do not."""
    assert en.Shard(0, 2).resolve(shuffle=True) == (0, 2, True)
    assert en.Shard(1, 2).resolve(shuffle=False) == (1, 2, False)
    assert en.Shard(1, 2, pad=True).resolve(shuffle=False) == (1, 2, True)


def test_torchrun_environment_sets_the_shard(monkeypatch, val_folder):
    """With no shard given, RANK/WORLD_SIZE from torchrun's environment decide it."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    ring = en.EchoRing(en.ImageFolder(val_folder), 2, augment=en.CenterCrop(16), echo=1,
                       shuffle=False, workers=1)
    plan = ring.loader.plan
    assert (plan.rank, plan.world_size, plan.pad) == (1, 3, False)
    assert list(plan.epoch_order(0)) == list(range(1, 9, 3))


@pytest.mark.timeout(120)
def test_evaluation_is_identical_across_epochs_and_worker_counts(val_folder):
    """Evaluation batches depend on nothing but the data: not the epoch, not the workers."""
    src = en.ImageFolder(val_folder)

    def run(workers, epochs):
        ring = en.EchoRing(src, 4, augment=en.CenterCrop(48), echo=1, shuffle=False,
                           workers=workers)
        out = []
        with ring:
            for epoch in range(epochs):
                ring.set_epoch(epoch)
                out.append(np.concatenate([np.array(b.images) for b in ring]))
        return out

    a, b = run(1, 2), run(2, 1)
    np.testing.assert_array_equal(a[0], a[1])
    np.testing.assert_array_equal(a[0], b[0])


def test_center_crop_spec_defaults_and_errors():
    """CenterCrop follows torchvision's 224/256 convention and names bad values."""
    assert en.CenterCrop(224).resize == 256
    assert en.CenterCrop((160, 224)).size == (160, 224)
    assert en.CenterCrop((160, 224)).resize == 256
    with pytest.raises(ValueError, match="CenterCrop: resize must be"):
        en.CenterCrop(224, resize=0)
    with pytest.raises(ValueError, match="CenterCrop: size must be positive"):
        en.CenterCrop((0, 224))
    with pytest.raises(TypeError, match="CenterCrop: size must be"):
        en.CenterCrop("224")


def test_center_crop_refuses_echo_before_augmentation(val_folder):
    """Echoing a deterministic crop before augmentation is refused with what to do instead."""
    src = en.ImageFolder(val_folder)
    with pytest.raises(ValueError, match="CenterCrop is deterministic.*echo=1"):
        en.EchoRing(src, 2, augment=en.CenterCrop(32), echo=2)
    with pytest.raises(ValueError, match="CenterCrop draws no flip"):
        en.EchoRing(src, 2, augment=en.CenterCrop(32),
                    echo=en.Echo(2, placement="after_augment", flip=True))
    with pytest.raises(ValueError, match=r"RandomResizedCrop draws no flip \(flip_p=0\)"):
        en.EchoRing(src, 2, augment=en.RandomResizedCrop(32, flip_p=0),
                    echo=en.Echo(2, placement="after_augment", flip=True))
    ring = en.EchoRing(src, 2, augment=en.CenterCrop(32),
                       echo=en.Echo(2, placement="after_augment"), workers=1)
    with ring:
        batches = list(ring)
    emitted = np.concatenate([b.sample_ids for b in batches])
    assert sorted(emitted.tolist()) == sorted(list(range(len(src))) * 2)


def test_png_in_the_folder_is_cropped_the_same_way(val_folder):
    """A non-JPEG member goes through Pillow and the same resampling: exact vs the reference
    within one level (decoded at full scale)."""
    path = os.path.join(val_folder, "class1", "zz.png")
    with open(path, "rb") as f:
        data = f.read()
    got = en.decode_center_crop(data, 224, 256)
    ref = torchvision_eval(data, (224, 224), 256)
    assert np.abs(got.astype(int) - ref).max() <= 1

"""The peer pipelines we measure against, on the same files.

torch DataLoader + torchvision-style transforms: torchvision's ``ImageFolder`` +
``RandomResizedCrop`` + ``RandomHorizontalFlip`` + ``PILToTensor`` are Pillow
calls; this module makes the same Pillow calls (torchvision itself does not
install beside the CPU torch wheel used here), so the comparison is
Pillow-per-sample in DataLoader workers against our fused kernel in ring
workers.

With ``rich=True`` the same dataset adds, after the crop and flip, the per-example
ops of ``ColorJitter(0.4, 0.4, 0.4, 0.1)`` and ``RandomErasing(p=0.5)`` as
torchvision runs them (:func:`color_jitter`, :func:`random_erasing`):
``ColorJitter.forward`` is a random order of the four adjustments with factors
drawn first, brightness, contrast and saturation are
``PIL.ImageEnhance.Brightness / Contrast / Color`` and hue is torchvision's
Pillow ``adjust_hue`` (HSV, ``int(hue * 255)`` added to H with uint8
wrap-around, back to RGB); then ``PILToTensor`` and ``RandomErasing`` on the
uint8 CHW tensor, torchvision's tensor path (ten tries for a box that fits,
filled with 0 on a copy).  These are torchvision's Pillow and tensor calls,
with every random draw taken from the sample's own ``random.Random``.

NVIDIA DALI's CPU pipeline (``pip install nvidia-dali-cuda120``; runs without a
GPU): ``fn.readers.file`` -> ``fn.decoders.image_random_crop`` -> ``fn.resize``
-> ``fn.flip``, every operator on the CPU, in DALI's thread pool
(:func:`dali_pipeline`, :class:`DaliLoader`).  DALI is imported only when such
a peer is built.
"""
from __future__ import annotations

import math
import os
import random

import numpy as np


def rrc_params(rng, height, width, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision ``RandomResizedCrop.get_params``: (top, left, h, w)."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def adjust_hue(im, hue):
    """torchvision's Pillow ``adjust_hue``: to HSV, ``int(hue * 255)`` added to H as uint8
    (wrapping around), back to RGB."""
    from PIL import Image

    if not -0.5 <= hue <= 0.5:
        raise ValueError(f"hue factor {hue} is not in [-0.5, 0.5]")
    mode = im.mode
    h, s, v = im.convert("HSV").split()
    np_h = np.array(h, dtype=np.uint8)
    np_h += np.uint8(int(hue * 255) % 256)          # uint8 addition wraps around
    return Image.merge("HSV", (Image.fromarray(np_h, "L"), s, v)).convert(mode)


def color_jitter(rng, im, brightness=(0.6, 1.4), contrast=(0.6, 1.4), saturation=(0.6, 1.4),
                 hue=(-0.1, 0.1)):
    """torchvision ``ColorJitter(0.4, 0.4, 0.4, 0.1).forward`` on a Pillow image: a random
    order of the four, the factors drawn (in the order b, c, s, h) before any is applied."""
    from PIL import ImageEnhance

    order = list(range(4))
    rng.shuffle(order)                              # torch.randperm(4)
    b, c, s, h = (rng.uniform(*r) for r in (brightness, contrast, saturation, hue))
    for k in order:
        if k == 0:
            im = ImageEnhance.Brightness(im).enhance(b)
        elif k == 1:
            im = ImageEnhance.Contrast(im).enhance(c)
        elif k == 2:
            im = ImageEnhance.Color(im).enhance(s)
        else:
            im = adjust_hue(im, h)
    return im


def random_erasing(rng, img, p=0.5, scale=(0.02, 0.33), ratio=(0.3, 3.3), value=0):
    """torchvision ``RandomErasing(p, scale, ratio, value).forward`` on a (C, H, W) tensor:
    with probability ``p``, up to ten tries for a box that fits, filled on a copy."""
    if rng.random() >= p:
        return img
    img_h, img_w = img.shape[-2], img.shape[-1]
    area = img_h * img_w
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        erase_area = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        h = int(round(math.sqrt(erase_area * aspect)))
        w = int(round(math.sqrt(erase_area / aspect)))
        if not (h < img_h and w < img_w):
            continue
        i, j = rng.randint(0, img_h - h), rng.randint(0, img_w - w)
        out = img.clone()                           # F.erase(inplace=False)
        out[..., i:i + h, j:j + w] = value
        return out
    return img.clone()                              # no fit: erase() copies the image onto itself


class PillowImageFolder:
    """torchvision-style dataset over an :class:`echo_native.ImageFolder` listing.

    ``rich=True`` adds ColorJitter(0.4, 0.4, 0.4, 0.1) before and RandomErasing(p=0.5)
    after ``PILToTensor`` (see the module docstring).  ``passes`` repeats the files as
    one longer dataset (index k is file k mod N, with its own draws), so one iterator
    streams several epochs without a DataLoader restart between them.
    """

    def __init__(self, folder, size=224, draft=False, seed=0, rich=False, passes=1):
        self.paths = [folder.path(i) for i in range(len(folder))]
        self.labels = np.asarray(folder.labels)
        self.size, self.draft, self.seed = int(size), draft, seed
        self.rich, self.passes = bool(rich), int(passes)

    def __len__(self):
        return len(self.paths) * self.passes

    def __getitem__(self, i):
        import torch
        from PIL import Image

        rng = random.Random(self.seed * 1_000_003 + i)
        f = i % len(self.paths)
        with Image.open(self.paths[f]) as im:
            top, left, h, w = rrc_params(rng, im.height, im.width)
            box = (left, top, left + w, top + h)
            if self.draft and im.format == "JPEG":
                full = im.size
                im.draft("RGB", (max(1, w * self.size // max(w, 1)), self.size))
                sx, sy = im.size[0] / full[0], im.size[1] / full[1]
                box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
            im = im.convert("RGB").resize((self.size, self.size), Image.BILINEAR, box=box)
        if rng.random() < 0.5:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        if self.rich:
            im = color_jitter(rng, im)
        # PILToTensor copies the pixels into a tensor: so do we.
        img = torch.from_numpy(np.array(im)).permute(2, 0, 1)
        if self.rich:
            img = random_erasing(rng, img)
        return img, int(self.labels[f])


def torch_loader(folder, batch_size, workers, size=224, seed=0, rich=False, passes=1,
                 drop_last=False):
    """A torch DataLoader over :class:`PillowImageFolder`, shuffled like a training run
    (``rich``: with ColorJitter + RandomErasing; ``passes``: the files that many times
    over in one epoch)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ds = PillowImageFolder(folder, size, seed=seed, rich=rich, passes=passes)
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=True, generator=g,
                                       num_workers=workers, persistent_workers=workers > 0,
                                       prefetch_factor=4 if workers > 0 else None,
                                       drop_last=drop_last)


# ---- NVIDIA DALI, CPU only ---------------------------------------------------------------
DALI_INSTALL = "pip install nvidia-dali-cuda120"
DALI_READER = "Reader"


def import_dali():
    """The ``nvidia.dali`` package (with ``fn`` and ``types`` loaded), or an ImportError
    that says how to install it.  The lab imports DALI only when a DALI peer is built."""
    try:
        import nvidia.dali
        import nvidia.dali.fn
        import nvidia.dali.types
    except ImportError as e:
        raise ImportError(f"the DALI peer needs NVIDIA DALI ({e}); install it with: "
                          f"{DALI_INSTALL} (its CPU pipeline runs without a GPU)") from None
    return nvidia.dali


def dali_pipeline(folder, batch_size, workers, size=224, seed=0, *, pad_last_batch=True,
                  with_paths=False, prefetch_queue_depth=2):
    """A built DALI pipeline over an ImageFolder root, every operator on the CPU.

    ``fn.readers.file(file_root=root, random_shuffle=True)`` (DALI's own listing:
    classes are the sorted sub-folders, labels their index, as ImageFolder's) ->
    ``fn.decoders.image_random_crop`` (RandomResizedCrop's area 0.08-1 and aspect
    3/4-4/3, 10 attempts; libjpeg-turbo decodes only the crop window) ->
    ``fn.resize`` to ``size`` x ``size`` (DALI's default: linear, antialiased) ->
    ``fn.flip`` on a fair coin.  Outputs: images (uint8 HWC), labels (int32, one
    per sample) and, with ``with_paths``, the encoded files (their
    ``source_info()`` names the file).

    ``workers`` is DALI's ``num_threads`` (the operators' thread pool; DALI adds its
    executor and reader threads).  ``device_id=None`` with only CPU operators makes a
    CPU-only pipeline: DALI never touches CUDA.  ``exec_dynamic=True`` (DALI's default
    executor since 1.44, spelled out): each output batch owns its memory, so
    :func:`dali_batch` can hand it out without a copy.  With ``pad_last_batch`` every epoch
    ends on a batch boundary (the last batch padded with repeats, which
    :class:`DaliLoader` cuts off); without it the reader streams across epochs, so
    every batch is full of distinct decodes.  ``folder`` is an
    :class:`echo_native.ImageFolder` (its ``root``; DALI must then list the same
    number of files, else ValueError) or a path.
    """
    dali = import_dali()
    fn, types = dali.fn, dali.types
    root = str(getattr(folder, "root", folder))
    pipe = dali.Pipeline(batch_size=int(batch_size), num_threads=int(workers), device_id=None,
                         seed=int(seed), prefetch_queue_depth=int(prefetch_queue_depth),
                         exec_dynamic=True)
    with pipe:
        jpegs, labels = fn.readers.file(file_root=root, random_shuffle=True, seed=int(seed),
                                        pad_last_batch=pad_last_batch, name=DALI_READER)
        images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB,
                                               random_area=(0.08, 1.0),
                                               random_aspect_ratio=(3 / 4, 4 / 3))
        images = fn.resize(images, resize_x=size, resize_y=size)
        images = fn.flip(images, horizontal=fn.random.coin_flip(probability=0.5))
        pipe.set_outputs(images, labels, *((jpegs,) if with_paths else ()))
    pipe.build()
    listed = pipe.epoch_size(DALI_READER)
    if hasattr(folder, "root") and listed != len(folder):
        raise ValueError(f"DALI's file reader lists {listed} files under {root} but the "
                         f"ImageFolder holds {len(folder)}: DALI reads only files directly "
                         f"inside each class folder, with the extensions of its file_filters")
    return pipe


def dali_batch(outputs, count=None, root=None):
    """One ``pipe.run()`` as NumPy: ``(images, labels)``, uint8 (b, H, W, 3) and int64 (b,),
    the first ``count`` samples; with a third output (``with_paths``), also the
    file paths (joined to ``root``).

    The images are a zero-copy view of DALI's batch when it is one contiguous
    tensor (the default executor hands each batch's memory over to its
    ``TensorList``, which the view keeps alive), else a copy.
    """
    images, labels = outputs[0], outputs[1]
    count = len(images) if count is None else count
    pixels = np.asarray(images.as_tensor()) if images.is_dense_tensor() else images.as_array()
    arrays = pixels[:count], labels.as_array().reshape(-1)[:count].astype(np.int64)
    if len(outputs) < 3:
        return arrays
    names = [outputs[2][i].source_info() for i in range(count)]
    if root is not None:
        names = [os.path.join(root, name) for name in names]
    return (*arrays, names)


class DaliLoader:
    """The DALI CPU pipeline as an iterable: each ``iter()`` is one epoch, every file once,
    in ``ceil(N / batch_size)`` NumPy batches ``(images, labels)`` (the last one
    short), like a DataLoader without ``drop_last``.  An epoch left unfinished is
    run out (and dropped) when the next ``iter()`` starts.  ``with_paths`` adds the
    file paths as a third element.  See :func:`dali_pipeline`."""

    def __init__(self, folder, batch_size, workers, size=224, seed=0, with_paths=False):
        self.root = str(getattr(folder, "root", folder))
        self.batch_size = int(batch_size)
        self.pipe = dali_pipeline(folder, batch_size, workers, size, seed, pad_last_batch=True,
                                  with_paths=with_paths)
        self.n = self.pipe.epoch_size(DALI_READER)
        self._left = 0          # samples of the current epoch not yet produced

    def __len__(self):
        return (self.n + self.batch_size - 1) // self.batch_size

    def __iter__(self):
        if self.pipe is None:
            raise RuntimeError("DaliLoader is closed")
        while self._left > 0:   # the rest of an abandoned epoch
            self._left -= min(self.batch_size, self._left)
            self.pipe.run()
        self._left = self.n
        while self._left > 0:
            count = min(self.batch_size, self._left)
            outputs = self.pipe.run()
            self._left -= count
            yield dali_batch(outputs, count, self.root)

    def close(self):
        """Shut the pipeline's threads down (dropping the last reference does)."""
        self.pipe = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def dali_loader(folder, batch_size, workers, size=224, seed=0, with_paths=False):
    """A :class:`DaliLoader`: DALI's CPU pipeline with ``workers`` threads."""
    return DaliLoader(folder, batch_size, workers, size, seed, with_paths)

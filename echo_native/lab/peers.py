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

SPDL 0.8 (``pip install spdl==0.8.0``; its ``spdl.io`` loads FFmpeg's shared
libraries, on Debian 12 ``apt-get install -y libavformat59 libavcodec59
libavfilter8 libavutil57 libswscale6 libavdevice59``): a thread-pool
``PipelineBuilder`` pipeline, ``.pipe(decode, concurrency=W)`` ->
``.aggregate(B)`` -> a collate stage, built with ``num_threads=W``.  Each decode
reads the file, demuxes it (FFmpeg parses the header: width and height), draws
the same RandomResizedCrop box and flip as the torch peer (:func:`rrc_params`
from the sample's own ``random.Random``) and decodes through a per-image FFmpeg
filter, ``crop`` -> ``scale`` (swscale bilinear, which widens its kernel when
shrinking, as Pillow's BILINEAR does) -> ``rgb24`` -> ``hflip``, to uint8 HWC
(:func:`spdl_pipeline`, :class:`SpdlLoader`).  FFmpeg's JPEG decoder decodes the
whole image: it has neither a region decode nor DCT scaling.

turboloader (``pip install turboloader``), a C++ loader: it reads a TAR of JPEGs,
not a folder, so :func:`pack_tar` writes the folder's files into one (once,
cached, outside any timing).  Its fused ``train_aug`` path is the peer:
libjpeg-turbo decodes the *whole* image at the largest DCT scale that keeps it at
least the output size, its own RandomResizedCrop (same area and aspect ranges,
its own RNG) is cut from that image and resized (``antialias=True``: a triangle
filter, torchvision's antialias; ``False``: plain bilinear), flipped, and written
as float32 in [0, 1].  So: float32 out (four times the bytes of uint8), a crop
below 224 px of the scaled image is upscaled from fewer source pixels, and its
threads are one process-wide pool sized to the machine's cores
(:func:`turboloader_threads`), not a setting (:class:`TurboLoader`).

Each import helper (:func:`import_dali`, :func:`import_spdl`,
:func:`import_turboloader`) raises an ImportError that names the install lines.
"""
from __future__ import annotations

import hashlib
import io
import math
import os
import random
import tarfile
import tempfile
import threading
from pathlib import Path

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


class _PeerLoader:
    """What the peers' loaders below share: ``with`` closing the peer's threads, and an
    epoch of ``ceil(n / batch_size)`` batches, the last one short (TurboLoader, which can
    drop it, asks its own loader)."""

    def __len__(self):
        return (self.n + self.batch_size - 1) // self.batch_size

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


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


class DaliLoader(_PeerLoader):
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


def dali_loader(folder, batch_size, workers, size=224, seed=0, with_paths=False):
    """A :class:`DaliLoader`: DALI's CPU pipeline with ``workers`` threads."""
    return DaliLoader(folder, batch_size, workers, size, seed, with_paths)


# ---- SPDL (thread pool over FFmpeg) -------------------------------------------------------
SPDL_APT = ("apt-get install -y libavformat59 libavcodec59 libavfilter8 libavutil57 "
            "libswscale6 libavdevice59")
SPDL_INSTALL = "pip install spdl==0.8.0"
SPDL_TIMEOUT_S = 120.0      # the longest wait for one batch (or for the pipeline to start)
_SPDL_CHECKED = False       # FFmpeg's libraries loaded and a JPEG decoded once


def import_spdl():
    """``(spdl.io, spdl.pipeline)``, or an ImportError that says how to install them.

    ``spdl.io`` loads FFmpeg's libraries only on first use, so a tiny JPEG is
    decoded here: a machine without them fails now, by name, not in a worker."""
    try:
        import spdl.io
        import spdl.pipeline
    except ImportError as e:
        raise ImportError(f"the SPDL peer needs SPDL ({e}); install it with: "
                          f"{SPDL_INSTALL}") from None
    global _SPDL_CHECKED
    if _SPDL_CHECKED:
        return spdl.io, spdl.pipeline
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 40, 10)).save(buf, format="JPEG")
    try:
        packets = spdl.io.demux_image(buf.getvalue())
        spdl.io.to_numpy(spdl.io.convert_frames(spdl.io.decode_packets(packets)))
    except RuntimeError as e:
        raise ImportError(f"the SPDL peer's spdl.io cannot load FFmpeg's shared libraries "
                          f"({str(e)[:200]}); on Debian 12 install them with: "
                          f"{SPDL_APT}") from None
    _SPDL_CHECKED = True
    return spdl.io, spdl.pipeline


def spdl_filter(box, flip, size):
    """The FFmpeg filter of one image: crop ``box`` (top, left, h, w) exactly (no rounding
    to the chroma grid), scale to ``size`` x ``size`` with swscale's bilinear, to RGB,
    then mirror when ``flip``."""
    top, left, h, w = box
    desc = (f"crop=w={w}:h={h}:x={left}:y={top}:exact=1,"
            f"scale=w={size}:h={size}:flags=bilinear,format=pix_fmts=rgb24")
    return desc + ",hflip" if flip else desc


def spdl_draw(seed, epoch, sample_id, height, width):
    """The crop box and flip of one sample in one epoch: :func:`rrc_params` and a fair coin
    from ``random.Random`` keyed on (seed, epoch, sample id)."""
    rng = random.Random((int(seed) * 1_000_003 + int(epoch)) * 1_000_003 + int(sample_id))
    box = rrc_params(rng, height, width)
    return box, rng.random() < 0.5


class _EpochOrder:
    """The pipeline's source: each ``iter()`` is the next epoch, ``(epoch, sample id)`` in
    an order shuffled by (seed, epoch).  SPDL iterates it on its own thread."""

    def __init__(self, n, seed):
        self.n, self.seed, self.epoch = int(n), int(seed), 0

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1
        order = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return ((epoch, int(i)) for i in order)


class SpdlDecode:
    """The pipeline's decode op: ``(epoch, sample id)`` -> ``(image, label, id)``, the
    image ``size`` x ``size`` x 3 uint8.  A file FFmpeg cannot read is counted in
    ``failures`` (its path and error kept in ``errors``, the first ten) and dropped
    (None: SPDL passes nothing on), as a loader that skips bad files does."""

    def __init__(self, folder, size, seed):
        self.io = import_spdl()[0]
        self.paths = [folder.path(i) for i in range(len(folder))]
        self.labels = np.asarray(folder.labels, dtype=np.int64)
        self.size, self.seed = int(size), int(seed)
        self.failures, self.errors = 0, []
        self._lock = threading.Lock()

    def __call__(self, item):
        epoch, i = item
        path = self.paths[i]
        try:
            with open(path, "rb") as f:
                data = f.read()
            packets = self.io.demux_image(data, name=str(path))
            if packets.width < 1 or packets.height < 1:
                raise ValueError(f"FFmpeg finds no image size in {path}")
            box, flip = spdl_draw(self.seed, epoch, i, packets.height, packets.width)
            frames = self.io.decode_packets(packets, filter_desc=spdl_filter(box, flip,
                                                                             self.size))
            image = self.io.to_numpy(self.io.convert_frames(frames))
        except (OSError, RuntimeError, ValueError) as e:
            with self._lock:
                self.failures += 1
                if len(self.errors) < 10:
                    self.errors.append(f"{path}: {e}")
            return None
        return image, self.labels[i], i


def spdl_collate(items):
    """A batch from the aggregated ``(image, label, id)`` items: images stacked into one
    (b, H, W, 3) uint8 array, labels and ids int64."""
    images, labels, ids = zip(*items)
    return (np.stack(images), np.asarray(labels, dtype=np.int64),
            np.asarray(ids, dtype=np.int64))


def spdl_pipeline(folder, batch_size, workers, size=224, seed=0, *, source=None, buffer=2,
                  collate=spdl_collate):
    """A built (not started) SPDL pipeline and its :class:`SpdlDecode` op.

    ``source`` yields ``(epoch, sample id)``; by default :class:`_EpochOrder`, re-iterated
    without end (``continuous``), each pass one epoch whose last batch is short (the
    aggregation flushes at the epoch's end).  ``workers`` is both the decode stage's
    concurrency and the size of the pipeline's thread pool (the ``collate`` stage runs
    in the same pool); SPDL adds its event-loop and source threads, which wait."""
    _, pipeline = import_spdl()
    decode = SpdlDecode(folder, size, seed)
    continuous = source is None
    if continuous:
        source = _EpochOrder(len(folder), seed)
    pipe = (pipeline.PipelineBuilder()
            .add_source(source, continuous=continuous)
            .pipe(decode, concurrency=int(workers), name="decode")
            .aggregate(int(batch_size))
            .pipe(collate, name="collate")
            .add_sink(int(buffer))
            .build(num_threads=int(workers)))
    return pipe, decode


class SpdlLoader(_PeerLoader):
    """The SPDL pipeline as an iterable: each ``iter()`` is one epoch, every file once, in
    ``ceil(N / batch_size)`` NumPy batches ``(images, labels)`` (the last one short);
    ``with_ids`` adds the sample ids as a third element.  The pipeline starts here
    (outside any timing) and keeps the next batches ready between epochs; an epoch left
    unfinished is run out when the next ``iter()`` starts.  ``failures`` counts the
    files it could not decode.  See :func:`spdl_pipeline`."""

    def __init__(self, folder, batch_size, workers, size=224, seed=0, with_ids=False,
                 timeout=SPDL_TIMEOUT_S):
        self.n, self.batch_size = len(folder), int(batch_size)
        self.with_ids, self.timeout = with_ids, float(timeout)
        self.pipe, self._decode = spdl_pipeline(folder, batch_size, workers, size, seed)
        self._rest = None       # the SPDL iterator of an epoch not run to its end
        self.pipe.start(timeout=self.timeout)

    @property
    def failures(self):
        return self._decode.failures

    @property
    def errors(self):
        return list(self._decode.errors)

    def __iter__(self):
        if self.pipe is None:
            raise RuntimeError("SpdlLoader is closed")
        if self._rest is not None:
            for _ in self._rest:
                pass
        self._rest = epoch = self.pipe.get_iterator(timeout=self.timeout)
        for images, labels, ids in epoch:
            yield (images, labels, ids) if self.with_ids else (images, labels)
        self._rest = None

    def close(self):
        """Stop the pipeline's threads (idempotent)."""
        pipe, self.pipe, self._rest = self.pipe, None, None
        if pipe is not None:
            pipe.stop(timeout=self.timeout)


def spdl_loader(folder, batch_size, workers, size=224, seed=0, with_ids=False):
    """A started :class:`SpdlLoader`: SPDL's thread pipeline with ``workers`` threads."""
    return SpdlLoader(folder, batch_size, workers, size, seed, with_ids)


# ---- turboloader (C++ over TAR archives) -----------------------------------------------------
TURBO_INSTALL = "pip install turboloader"
TAR_CACHE_KEEP = 4          # packed archives kept in the cache (least recently used go first)


def import_turboloader():
    """The ``turboloader`` package, or an ImportError that says how to install it."""
    try:
        import turboloader
    except ImportError as e:
        raise ImportError(f"the turboloader peer needs turboloader ({e}); install it with: "
                          f"{TURBO_INSTALL}") from None
    return turboloader


def turboloader_threads():
    """Threads in turboloader's decode pool: its one process-wide pool holds
    ``std::thread::hardware_concurrency() - 1`` threads (at least one) and the thread
    that asks for a batch works beside them, so the machine's online cores (at least
    two); no setting changes it."""
    return max(2, os.cpu_count() or 1)


def _tar_key(paths):
    """What a packed archive depends on: each file's resolved path, size and mtime."""
    h = hashlib.sha256()
    for p in paths:
        st = os.stat(p)
        h.update(f"{os.path.realpath(p)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:24]


def default_tar_cache():
    """``<echo_native cache>/turboloader``: where :func:`pack_tar` keeps its archives."""
    from echo_native.lab.corpus import default_cache_dir

    return default_cache_dir() / "turboloader"


def pack_tar(folder, cache_dir=None, keep=TAR_CACHE_KEEP):
    """The folder's files as one uncompressed ustar TAR for turboloader, member k being
    file k of the listing (named ``<k>.jpg``, 8 digits: turboloader indexes the members
    in archive order and only ``.jpg``/``.jpeg`` names).  Written once under
    ``cache_dir`` (default :func:`default_tar_cache`), named by the files' paths, sizes
    and mtimes, and reused while they stay the same; only the ``keep`` most recently
    used archives are kept.  turboloader decodes JPEG only, so another file is refused
    (ValueError naming it) rather than served as a black image."""
    paths = [folder.path(i) for i in range(len(folder))]
    cache = Path(cache_dir) if cache_dir is not None else default_tar_cache()
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"{_tar_key(paths)}.tar"
    if out.exists():
        os.utime(out)                       # most recently used
        return out
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=".packing-", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f, tarfile.open(fileobj=f, mode="w",
                                                    format=tarfile.USTAR_FORMAT) as tar:
            for k, path in enumerate(paths):
                with open(path, "rb") as src:
                    data = src.read()
                if not data.startswith(b"\xff\xd8\xff"):
                    raise ValueError(f"turboloader decodes only JPEG files; {path} is not "
                                     f"one (it would serve it as a black image)")
                info = tarfile.TarInfo(f"{k:08d}.jpg")
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                tar.addfile(info, io.BytesIO(data))
        os.replace(tmp, out)
    except BaseException:
        os.unlink(tmp)
        raise
    old = sorted((p for p in cache.glob("*.tar") if p != out), key=lambda p: p.stat().st_mtime)
    for p in old[:max(0, len(old) - (keep - 1))]:
        p.unlink(missing_ok=True)
    return out


class TurboLoader(_PeerLoader):
    """turboloader's fused loader over the folder packed by :func:`pack_tar`: each
    ``iter()`` is one epoch (its shuffle and crops keyed on the epoch), batches
    ``(images, labels)``, images (b, H, W, 3) float32 in [0, 1]; ``with_ids`` adds the
    sample ids (its archive indices, which are the folder's).  ``antialias`` is
    turboloader's switch between its triangle-filter resize and plain bilinear;
    ``prefetch_batches`` its own read-ahead (a background thread).  ``failures``
    counts the images it served black because it could not decode them."""

    def __init__(self, folder, batch_size, size=224, seed=0, antialias=True, with_ids=False,
                 prefetch_batches=4, drop_last=False, cache_dir=None):
        tl = import_turboloader()
        self.n, self.batch_size = len(folder), int(batch_size)
        self.tar = pack_tar(folder, cache_dir)
        self.labels = np.asarray(folder.labels, dtype=np.int64)
        self.with_ids, self.antialias = with_ids, bool(antialias)
        self.threads = turboloader_threads()
        self.loader = tl.DataLoader(str(self.tar), batch_size=self.batch_size, shuffle=True,
                                    seed=int(seed), image_size=(int(size), int(size)),
                                    output_format="numpy", train_aug=True,
                                    antialias=self.antialias,
                                    prefetch_batches=int(prefetch_batches),
                                    drop_last=drop_last)
        want = self.n // self.batch_size if drop_last else -(-self.n // self.batch_size)
        if len(self.loader) != want:
            raise ValueError(f"turboloader lists {len(self.loader)} batches in {self.tar}, "
                             f"not the {want} of the folder's {self.n} files")
        self.failures = 0
        self._epoch = 0

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        if self.loader is None:
            raise RuntimeError("TurboLoader is closed")
        self.loader.set_epoch(self._epoch)
        self._epoch += 1
        for images, meta in self.loader:
            ids = np.asarray(meta["indices"], dtype=np.int64)
            self.failures = max(self.failures, int(meta.get("decode_failures", 0)))
            labels = self.labels[ids]
            yield (images, labels, ids) if self.with_ids else (images, labels)

    def close(self):
        """Stop its read-ahead thread and release the archive (idempotent)."""
        loader, self.loader = self.loader, None
        if loader is not None:
            loader.close()


def turbo_loader(folder, batch_size, size=224, seed=0, antialias=True, with_ids=False,
                 cache_dir=None):
    """A :class:`TurboLoader` (the folder packed into a TAR first, once)."""
    return TurboLoader(folder, batch_size, size, seed, antialias, with_ids,
                       cache_dir=cache_dir)

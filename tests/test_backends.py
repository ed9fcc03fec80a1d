"""The device backends: the array-module backend (the code the CUDA backend runs on
CuPy) exercised on NumPy, the CPU backend it is compared with, the ``resolve``
factory, and the slot-return queue (``SlotReturns``) the GPU path hands ring slots
back through.  How EchoRing drives a backend (late copies, seeks, refused starts)
is in ``test_pipeline.py``; the CUDA kernels themselves in ``test_cuda_kernels.py``
and ``test_gpu.py``."""

import echo_helpers
import numpy as np
import pytest
from PIL import Image

import echo_native as en
from echo_native.backends import resolve
from echo_native.backends.array import ArrayDevice, SlotReturns, pillow_weights
from echo_native.backends.cpu import CpuDevice
from echo_native.echo.images import ImageStore


def _photo(name="astronaut", size=None):
    import skimage.data as sd
    img = getattr(sd, name)()
    if img.ndim == 2:
        img = np.stack([img] * 3, -1)
    return np.ascontiguousarray(img[: size[0], : size[1]] if size else img)


def _buffer_with(canvases, xp=np):
    entry = max(c.size for c in canvases)
    buf = ImageStore(len(canvases), entry, xp)
    for i, c in enumerate(canvases):
        buf.pixels[i, : c.size] = c.reshape(-1)
        buf.shape[i] = c.shape[:2]
    return buf


def _random_boxes(rng, shapes, n):
    boxes, flips = [], []
    for h, w in shapes[:n]:
        bh, bw = rng.uniform(8, h), rng.uniform(8, w)
        boxes.append((rng.uniform(0, h - bh), rng.uniform(0, w - bw), bh, bw))
        flips.append(bool(rng.integers(0, 2)))
    return np.array(boxes), np.array(flips)


def test_pillow_weights_rows_are_normalised_and_local():
    """Each output pixel's weights sum to 1 and stay inside the filter's support."""
    w = pillow_weights(10.5, 300.0, 512, 224)
    np.testing.assert_allclose(w.sum(1), 1.0, atol=1e-12)
    scale = (300.0 - 10.5) / 224
    for i in (0, 100, 223):
        nz = np.flatnonzero(w[i])
        center = 10.5 + (i + 0.5) * scale
        assert nz.min() >= center - scale - 1 and nz.max() <= center + scale + 1


def test_array_path_matches_native_resampler():
    """ArrayDevice.crop_resize (one float pass) agrees with the native two-pass resampler."""
    rng = np.random.default_rng(0)
    canvases = [_photo("astronaut"), _photo("coffee"), _photo("chelsea"), _photo("rocket")]
    buf = _buffer_with(canvases)
    boxes, flips = _random_boxes(rng, [c.shape[:2] for c in canvases], 4)
    entries = np.arange(4)
    a = np.empty((4, 96, 80, 3), np.uint8)
    b = np.empty_like(a)
    ArrayDevice(np).crop_resize(buf, entries, boxes, flips, a)
    cpu = CpuDevice()
    cpu.crop_resize(buf, entries, boxes, flips, b)
    cpu.synchronize()  # the host device re-augments in the background
    diff = np.abs(a.astype(int) - b)
    assert diff.max() <= 2 and diff.mean() < 0.3


def test_array_path_matches_pillow():
    """The generic resampler follows Pillow's BILINEAR with box (antialiased) within a level."""
    img = _photo("coffee")
    buf = _buffer_with([img])
    box = (20.25, 31.5, 250.0, 330.0)
    out = np.empty((1, 64, 100, 3), np.uint8)
    ArrayDevice(np).crop_resize(buf, np.array([0]), np.array([box]), np.array([True]), out)
    ref = np.asarray(Image.fromarray(img).resize(
        (100, 64), Image.BILINEAR, box=(box[1], box[0], box[1] + box[3], box[0] + box[2])))
    diff = np.abs(out[0].astype(int) - ref[:, ::-1])
    assert diff.max() <= 2 and diff.mean() < 0.3


def test_gather_and_flip_move_exact_bytes():
    """gather copies whole entries and flip mirrors exactly the masked images."""
    rng = np.random.default_rng(1)
    buf = ImageStore(6, 8 * 8 * 3)
    buf.pixels[...] = rng.integers(0, 256, buf.pixels.shape, dtype=np.uint8)
    dev = ArrayDevice(np)
    out = np.empty((3, 8, 8, 3), np.uint8)
    dev.gather(buf, np.array([4, 0, 4]), out)
    np.testing.assert_array_equal(out[0], buf.pixels[4].reshape(8, 8, 3))
    np.testing.assert_array_equal(out[1], buf.pixels[0].reshape(8, 8, 3))
    before = out.copy()
    dev.flip(out, np.array([False, True, False]))
    np.testing.assert_array_equal(out[1], before[1][:, ::-1])
    np.testing.assert_array_equal(out[[0, 2]], before[[0, 2]])


def test_cpu_gather_on_the_host_thread_matches_the_array_device():
    """CpuDevice.gather (a job on its host thread, the native copy with the GIL
    released) gives ArrayDevice's bytes, mirrored rows included, once synchronised;
    a bad entry fails the job with an error naming it (once: the clean-up after it
    does not raise it again), never a stray read."""
    rng = np.random.default_rng(2)
    buf = ImageStore(7, 9 * 5 * 3)
    buf.pixels[...] = rng.integers(0, 256, buf.pixels.shape, dtype=np.uint8)
    entries, mirror = np.array([6, 0, 3, 6]), np.array([True, False, True, False])
    want = np.empty((4, 9, 5, 3), np.uint8)
    ArrayDevice(np).gather(buf, entries, want, mirror)
    np.testing.assert_array_equal(want[0], buf.pixels[6].reshape(9, 5, 3)[:, ::-1])
    dev = CpuDevice()
    try:
        for m in (mirror, None):
            got = np.zeros_like(want)
            job = dev.gather(buf, entries, got, m)
            dev.synchronize(job)
            ref = want if m is not None else buf.pixels[entries].reshape(4, 9, 5, 3)
            np.testing.assert_array_equal(got, ref)
        job = dev.gather(buf, np.array([1, 7]), np.zeros((2, 9, 5, 3), np.uint8))
        with pytest.raises(IndexError, match="entry 7 is outside the 7 rows"):
            dev.synchronize(job)
    finally:
        dev.detach()


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_normalize_matches_formula(layout, dtype):
    """normalize computes (x/255 - mean)/std in the requested layout and dtype."""
    rng = np.random.default_rng(2)
    x = rng.integers(0, 256, (2, 5, 4, 3), dtype=np.uint8)
    mean, std = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)
    shape = x.shape if layout == "NHWC" else (2, 3, 5, 4)
    out = ArrayDevice(np).normalize(x, mean, std, layout, np.empty(shape, dtype))
    ref = (x / 255.0 - np.array(mean)) / np.array(std)
    if layout == "NCHW":
        ref = ref.transpose(0, 3, 1, 2)
    assert out.dtype == dtype
    np.testing.assert_allclose(out, ref, atol=1e-5 if dtype == np.float32 else 2e-3)


def _jpegs(n, seed=0):
    return echo_helpers.photo_jpegs(n, 280, 330, seed)


@pytest.mark.parametrize("placement", ["before_augment", "after_augment", "batch"])
def test_echoring_on_array_backend_matches_cpu_backend(placement):
    """EchoRing run through the generic (CuPy-shaped) backend gives the CPU backend's batches."""
    src = en.Samples(_jpegs(40), np.arange(40) % 3)
    kw = dict(batch_size=8, image_size=48, echo=2, placement=placement, workers=1, seed=5,
              worker_mode="thread")
    with en.EchoRing(src, device="cpu", **kw) as ring:
        ref = [b.copy() for b in ring]
    with en.EchoRing(src, device=ArrayDevice(np), **kw) as ring:
        got = [b.copy() for b in ring]
    assert len(ref) == len(got)
    for r, g in zip(ref, got):
        np.testing.assert_array_equal(r.sample_ids, g.sample_ids)
        np.testing.assert_array_equal(r.echo_index, g.echo_index)
        np.testing.assert_array_equal(r.flips, g.flips)
        diff = np.abs(np.asarray(r.images, int) - np.asarray(g.images))
        if placement == "before_augment":
            assert diff.max() <= 2 and diff.mean() < 0.3
        else:
            assert diff.max() == 0


def test_resolve_devices():
    """'cpu' and 'auto' (without CUDA) give the CPU backend; unknown names are refused."""
    assert resolve("cpu").name == "cpu"
    from echo_native.backends import cuda_available
    if not cuda_available():
        assert resolve("auto").name == "cpu"
        with pytest.raises(RuntimeError, match="cpu"):
            resolve("cuda")
    with pytest.raises(ValueError, match="device must be"):
        resolve("tpu")
    for bad in ("cuda:x", "cuda:-1", "cuda:"):
        with pytest.raises(ValueError, match="cuda:N"):
            resolve(bad)
    dev = ArrayDevice(np)
    assert resolve(dev) is dev


def test_slot_returns_wait_for_their_events():
    """A slot goes back once its event is done, or when more than in_flight wait (after
    waiting for the oldest); drain returns all of them."""
    released = []

    class Ev:
        def __init__(self):
            self.done, self.waited = False, False

        def synchronize(self):
            self.waited, self.done = True, True

    q = SlotReturns(in_flight=1)
    a, b, c = Ev(), Ev(), Ev()
    q.add(a, lambda: released.append("a"))
    assert released == [] and len(q) == 1
    q.add(b, lambda: released.append("b"))
    assert released == ["a"] and a.waited and not b.waited
    q.poll()
    assert released == ["a"]  # b's copy still runs, and one may be in flight
    b.done = True
    q.poll()
    assert released == ["a", "b"]
    q.add(c, lambda: released.append("c"))
    q.drain()
    assert released == ["a", "b", "c"] and c.waited and len(q) == 0

"""The array-module backend (the code the CUDA backend runs on CuPy), exercised on NumPy."""

import os

import echo_helpers
import numpy as np
import pytest
from PIL import Image

import echo_native as en
from echo_native.backends import resolve
from echo_native.backends.array import ArrayDevice, SlotReturns, pillow_weights
from echo_native.backends.cpu import CpuDevice
from echo_native.output import BFloat16Array, bfloat16_bits
from echo_native.echo import ExampleBuffer


def _photo(name="astronaut", size=None):
    import skimage.data as sd
    img = getattr(sd, name)()
    if img.ndim == 2:
        img = np.stack([img] * 3, -1)
    return np.ascontiguousarray(img[: size[0], : size[1]] if size else img)


def _buffer_with(canvases, xp=np):
    entry = max(c.size for c in canvases)
    buf = ExampleBuffer(len(canvases), entry, xp)
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
    CpuDevice().crop_resize(buf, entries, boxes, flips, b)
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
    buf = ExampleBuffer(6, 8 * 8 * 3)
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


# -- late copies: the slot/stream/event protocol, emulated on NumPy ----------------------------
class _Event:
    """Completes once the device has performed the first ``upto`` queued copies."""

    def __init__(self, device, upto):
        self.device, self.upto = device, upto

    @property
    def done(self):
        return self.device.performed >= self.upto

    def synchronize(self):
        self.device.flush(self.upto)


class LateCopyDevice(ArrayDevice):
    """The NumPy backend with host->device copies that happen late, as DMA on a
    stream does: a copy out of a ring slot reads the slot only when its event
    is waited for, or when later work on the "stream" needs it.  A pipeline
    that gave a slot back before its copy completed would deliver pixels the
    workers wrote for a later batch."""

    def __init__(self):
        super().__init__(np)
        self.pending, self.performed, self.queued = [], 0, 0
        self.returns = SlotReturns()
        self.released_early = 0
        self.rings = []  # (event, ring name) of attach / detach calls

    def _queue(self, copy):
        self.pending.append(copy)
        self.queued += 1

    def flush(self, upto=None):
        upto = self.queued if upto is None else upto
        while self.performed < upto:
            self.pending.pop(0)()
            self.performed += 1

    def attach(self, ring):
        self.rings.append(("attach", ring.name))

    def detach(self, ring=None):
        self.drain()
        self.rings.append(("detach", ring.name))

    def release_after_copies(self, release):
        event = _Event(self, self.queued)

        def checked():
            self.released_early += not event.done
            # As if a worker refilled the slot at once: whatever the pipeline still
            # reads from it after this point is wrong.
            _, ring, ticket = release.args
            slot = ring.slots[ticket % ring.layout.nslots]
            for field in (slot.pixels, slot.sample_ids, slot.labels, slot.boxes, slot.flip):
                field[...] = 0
            slot.status[...] = 1
            release()
        self.returns.add(event, checked)

    def drain(self):
        self.returns.drain()

    def to_device(self, host, out=None):
        out = np.empty_like(host) if out is None else out
        self._queue(lambda: out.__setitem__(Ellipsis, host))
        return out

    def store(self, buffer, entries, slot, count, fixed_shape):
        entries = np.array(entries)
        self._queue(lambda: ArrayDevice.store(self, buffer, entries, slot, count, fixed_shape))

    def _after_copies(name):
        def op(self, *args):
            self.flush()  # stream order: work queued after the copies sees them
            return getattr(ArrayDevice, name)(self, *args)
        return op

    copy = _after_copies("copy")
    gather = _after_copies("gather")
    flip = _after_copies("flip")
    crop_resize = _after_copies("crop_resize")
    normalize = _after_copies("normalize")

    def ready(self, batch):
        self.flush()
        self.returns.poll()
        return batch


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


@pytest.mark.parametrize("placement,echo", [("before_augment", 2), ("after_augment", 2),
                                            ("batch", 2), ("before_augment", 1)])
def test_late_copies_never_read_a_returned_slot(placement, echo):
    """With copies completing late and only two ring slots, every batch still equals the
    CPU backend's: no slot goes back to the workers before the copies out of it."""
    src = en.Samples(_jpegs(48), np.arange(48) % 3)
    kw = dict(batch_size=8, image_size=40, echo=echo, placement=placement, workers=2, seed=9,
              slots=2, worker_mode="thread")
    with en.EchoRing(src, device="cpu", **kw) as ring:
        ref = [b.copy() for b in ring]
    dev = LateCopyDevice()
    with en.EchoRing(src, device=dev, **kw) as ring:
        got = [b.copy() for b in ring]
    assert dev.released_early == 0 and dev.performed == dev.queued
    assert len(ref) == len(got)
    for r, g in zip(ref, got):
        np.testing.assert_array_equal(r.sample_ids, g.sample_ids)
        diff = np.abs(np.asarray(r.images, int) - g.images)
        assert diff.max() <= (2 if placement == "before_augment" and echo > 1 else 0)


def test_device_follows_the_ring_through_a_seek():
    """A jump to another epoch makes a new ring: the device lets go of the old one
    (after its copies) before it is removed and attaches to the new one."""
    src = en.Samples(_jpegs(24), np.arange(24) % 3)
    dev = LateCopyDevice()
    ring = en.EchoRing(src, batch_size=8, image_size=32, echo=2, workers=1, seed=1,
                       device=dev, worker_mode="thread")
    with ring:
        first = ring.loader.ring_name
        next(iter(ring))
        ring.set_epoch(3)
        second = ring.loader.ring_name
        assert sum(1 for _ in ring) == len(ring)
    assert first != second
    assert dev.rings == [("attach", first), ("detach", first), ("attach", second),
                         ("detach", second)]
    assert len(dev.returns) == 0


# -- bfloat16 ----------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_bfloat16_batches_are_float32_rounded_and_reach_torch_without_copy(layout):
    """dtype="bfloat16": the float32 batch rounded as torch rounds it, exported by
    DLPack as torch.bfloat16 over the same memory."""
    torch = pytest.importorskip("torch")
    src = en.Samples(_jpegs(24), np.arange(24) % 3)
    kw = dict(batch_size=8, image_size=32, echo=2, workers=1, seed=4, normalize=True,
              layout=layout, worker_mode="thread")
    with en.EchoRing(src, dtype="float32", **kw) as ring:
        ref = [np.array(b.images) for b in ring]
    with en.EchoRing(src, dtype="bfloat16", **kw) as ring:
        for r, b in zip(ref, ring, strict=True):
            assert isinstance(b.images, BFloat16Array) and b.images.shape == r.shape
            t = torch.from_dlpack(b.images)
            assert t.dtype == torch.bfloat16 and tuple(t.shape) == r.shape
            assert t.data_ptr() == b.images.bits.ctypes.data
            expect = torch.from_numpy(r).to(torch.bfloat16)
            assert torch.equal(t, expect)
            np.testing.assert_array_equal(b.images.to_float32(), expect.float().numpy())


def test_bfloat16_capsules_own_their_memory():
    """A consumer keeps the bits alive after the array is gone; a capsule nobody takes
    lets go of them; a wrong device or copy=True is honoured."""
    import gc
    import sys
    torch = pytest.importorskip("torch")
    bits = bfloat16_bits(np.linspace(-3, 3, 60, dtype=np.float32).reshape(3, 4, 5))
    base = sys.getrefcount(bits)
    a = BFloat16Array(bits)
    t = torch.from_dlpack(a)
    assert sys.getrefcount(bits) == base + 2  # the wrapper and the consumer's tensor
    del a
    gc.collect()
    np.testing.assert_allclose(t.float().numpy(), np.linspace(-3, 3, 60).reshape(3, 4, 5),
                               rtol=2**-8)
    del t
    gc.collect()
    assert sys.getrefcount(bits) == base
    a = BFloat16Array(bits)
    for _ in range(3):
        a.__dlpack__()  # dropped unconsumed
    gc.collect()
    assert sys.getrefcount(bits) == base + 1
    with pytest.raises(BufferError, match="lives on"):
        a.__dlpack__(dl_device=(2, 0))
    c = torch.from_dlpack(a.__dlpack__(copy=True))
    assert c.data_ptr() != bits.ctypes.data and torch.equal(c, torch.from_dlpack(a))
    with pytest.raises(TypeError, match="uint16"):
        BFloat16Array(np.zeros(3, np.float32))


def test_bfloat16_to_numpy_never_makes_an_object_array():
    """np.asarray with a dtype converts exactly; without one it is bfloat16 (ml_dtypes)
    or a clear TypeError, not an array of Python objects."""
    a = BFloat16Array(bfloat16_bits(np.array([1.5, -2.25, 3.0e-3], np.float32)))
    np.testing.assert_array_equal(np.asarray(a, np.float32), a.to_float32())
    try:
        import ml_dtypes
    except ImportError:
        with pytest.raises(TypeError, match="NumPy has no bfloat16"):
            np.asarray(a)
    else:
        assert np.asarray(a).dtype == ml_dtypes.bfloat16


def test_a_ring_dropped_without_close_still_detaches_the_device():
    """Garbage collection runs the same clean-up as close(): the device lets go of the
    ring's memory (a GPU backend unpins it) before the segment is removed."""
    import gc
    src = en.Samples(_jpegs(16), np.arange(16) % 3)
    dev = LateCopyDevice()
    ring = en.EchoRing(src, batch_size=8, image_size=32, echo=2, workers=1, seed=1,
                       device=dev, worker_mode="thread")
    next(iter(ring))
    name = ring.loader.ring_name
    del ring
    gc.collect()
    assert dev.rings == [("attach", name), ("detach", name)]
    assert len(dev.returns) == 0
    assert not any(name.lstrip("/") in f for f in os.listdir("/dev/shm"))


class OneRingDevice(LateCopyDevice):
    """Serves one ring at a time and refuses a second, as the CUDA backend does."""

    serving = None

    def attach(self, ring):
        if self.serving is not None:
            raise RuntimeError("already serves a running ring")
        self.serving = ring.name
        super().attach(ring)

    def detach(self, ring=None):
        if ring.name == self.serving:
            self.serving = None
            super().detach(ring)


def _segments():
    return {f for f in os.listdir("/dev/shm") if f.startswith("echo_native-")}


def test_a_refused_start_leaks_nothing_and_leaves_the_other_ring_alone():
    """A device that refuses a second ring stops that start: no workers, no segment, and
    the ring it does serve keeps running with its memory held."""
    src = en.Samples(_jpegs(24), np.arange(24) % 3)
    kw = dict(batch_size=8, image_size=32, echo=2, workers=1, seed=1)
    dev = OneRingDevice()
    before = _segments()
    with en.EchoRing(src, device=dev, **kw) as first:
        it = iter(first)
        next(it)
        second = en.EchoRing(src, device=dev, **kw)
        with pytest.raises(RuntimeError, match="already serves"):
            second.start()
        assert second.loader.ring is None and second.loader.worker_pids() == []
        assert _segments() - before == {first.loader.ring_name.lstrip("/")}
        assert dev.rings == [("attach", first.loader.ring_name)]
        assert sum(1 for _ in it) == len(first) - 1
    assert _segments() == before
    assert [r[0] for r in dev.rings] == ["attach", "detach"]


def test_echo_buffer_too_large_stops_the_workers_and_says_what_to_do():
    """An echo buffer that cannot be allocated: MemoryError with the size and a smaller
    setting, and the ring started for it is gone."""
    src = en.Samples(_jpegs(16), np.arange(16) % 3)
    before = _segments()
    ring = en.EchoRing(src, batch_size=8, image_size=224, echo=2, workers=1,
                       shuffle_buffer=2**40)
    with pytest.raises(MemoryError, match=r"needs .* GiB on cpu; try shuffle_buffer="):
        ring.start()
    assert ring.loader.ring is None and _segments() == before


def test_stats_name_the_backend():
    """stats() says which backend made the batches."""
    src = en.Samples(_jpegs(16), np.arange(16) % 3)
    for device, name in (("cpu", "cpu"), (ArrayDevice(np), "array")):
        with en.EchoRing(src, batch_size=8, image_size=32, echo=2, workers=1,
                         device=device, worker_mode="thread") as ring:
            sum(1 for _ in ring)
            assert ring.stats()["device"] == name

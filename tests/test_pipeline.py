"""EchoRing (``echo_native.pipeline``), the feeder that wires source, workers, ring,
echo stage and device together (CPU backend, and the device protocol emulated on
NumPy).

What is checked, against references computed here (never against numbers
copied from the implementation):

- len(ring) is what an epoch delivers;
- placement semantics: before-augmentation echoes are new crops of the source
  (checked against ``decode_crop`` / ``resize_crop``), after-augmentation echoes
  are byte copies (or exact flips), outputs survive the next batch;
- determinism over worker counts and worker modes; echo=1 is the bare Loader,
  without a copy; DLPack hand-off to NumPy and PyTorch without a copy;
  normalisation;
- argument errors, device selection, memory over epochs and shared-memory cleanup;
- the device protocol: no ring slot goes back before the copies out of it, the
  device follows the ring through a seek and a drop, a refused start leaks
  nothing, an echo buffer too large says what to do, stats name the backend.

The echo statistics (counts, buffer, batch echo, auto echo) are in ``test_echo.py``.
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

import echo_native as en
from echo_native.ring import Record
from echo_native.backends.array import ArrayDevice, SlotReturns

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import echo_helpers as eh  # noqa: E402
import ring_helpers as rh  # noqa: E402

EXAMPLE_PLACEMENTS = ("before_augment", "after_augment")
PLACEMENTS = EXAMPLE_PLACEMENTS + ("batch",)


def _cuda_usable():
    """CuPy imports and sees a CUDA device (then "auto" picks CUDA: not this file's job)."""
    try:
        import cupy
        return bool(cupy.is_available())
    except Exception:
        return False


# ---- corpora (real photographs, small so that a test takes well under a second) ----
@pytest.fixture(scope="module")
def small():
    """64 JPEGs of 48x64 with 5 labels."""
    blobs = eh.photo_jpegs(64, 48, 64, seed=1)
    return blobs, np.arange(64) % 5


_src, _ring, _flat = eh.samples_of, eh.small_ring, eh.flat


def _jpegs(n, seed=0):
    return eh.photo_jpegs(n, 280, 330, seed)


# ---- length ------------------------------------------------------------------------------
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("e", [1, 2.5])
def test_len_matches_delivery(small, placement, drop_last, e):
    """len(ring) is the number of batches an epoch delivers; drop_last=True: only full ones."""
    data = (small[0][:60], small[1][:60])
    with _ring(data, echo=e, placement=placement, drop_last=drop_last,
               image_size=16) as ring:
        for batches in eh.collect(ring, epochs=2, copy_images=False):
            sizes = [len(b["ids"]) for b in batches]
            assert len(sizes) == batches[0]["announced"]
            if drop_last:
                assert min(sizes) == 8, sizes
            else:
                assert sum(sizes) >= 60 and max(sizes) == 8 and min(sizes) >= 1


# ---- placement semantics ----------------------------------------------------------------
def _source_hw(blob):
    return en.image_size(blob)


def test_before_augment_echoes_are_new_crops_of_the_source(small):
    """before_augment: each emission is its own crop of the source, equal to decode_crop of its box.

    Full-resolution canvas (canvas_side = the shorter side): the tight reference resizes the
    full decode with the same resampler (mean <= 0.1, max <= 2: boxes are reported as
    float32); decode_crop may decode at DCT scale 1/2 for large boxes, hence mean <= 3.
    """
    blobs, _ = small
    size, seed = 24, 5
    with _ring(small, echo=3, placement="before_augment", image_size=size, seed=seed,
               canvas_side=48) as ring:
        batches = eh.collect(ring)[0]
    full = {}
    for b in batches:
        for img, sid, box, flip, j in zip(b["images"], b["ids"], b["boxes"], b["flips"],
                                          b["echo"]):
            sid = int(sid)
            H, W = _source_hw(blobs[sid])
            want_box, want_flip = en.random_resized_crop_params(seed, 0, sid, int(j), H, W)
            assert np.allclose(box, want_box, atol=1e-3) and bool(flip) == bool(want_flip)
            if sid not in full:
                full[sid] = en.decode(blobs[sid])
            tight = en.resize_crop(full[sid], tuple(map(float, box)), (size, size), bool(flip))
            d = np.abs(tight.astype(np.int16) - img)
            assert d.mean() <= 0.1 and d.max() <= 2, (sid, j, d.mean(), d.max())
            ref = en.decode_crop(blobs[sid], tuple(map(float, box)), (size, size), bool(flip))
            assert np.abs(ref.astype(np.int16) - img).mean() <= 3.0, (sid, j)
    for sid, em in eh.emissions(batches).items():
        boxes = [tuple(batches[j]["boxes"][r]) for j, r, _ in em]
        assert len(set(boxes)) == len(boxes), f"sample {sid}: repeated crop {boxes}"
        pixels = [batches[j]["images"][r].tobytes() for j, r, _ in em]
        assert len(set(pixels)) == len(pixels), f"sample {sid}: identical echoes"


def test_before_augment_default_canvas(small):
    """before_augment, default canvas: each emission is its box resized from the DCT-reduced canvas.

    Exact reference: decode_canvas + resize_crop of box / scale.  Against decode_crop of the
    full image only mean <= 6: small crops are upsampled from a canvas whose shorter side
    is just image_size, where decode_crop decodes them at full resolution.
    """
    blobs, _ = small
    size = 24
    with _ring(small, echo=2, placement="before_augment", image_size=size, seed=3) as ring:
        batches = eh.collect(ring)[0]
    diffs = []
    for b in batches:
        for img, sid, box, flip in zip(b["images"], b["ids"], b["boxes"], b["flips"]):
            canvas, d = en.decode_canvas(blobs[int(sid)], size)
            assert d > 1, "these images should get a reduced canvas"
            want = en.resize_crop(canvas, _canvas_box(box, (d, d), canvas.shape), (size, size),
                                  bool(flip))
            dd = np.abs(want.astype(np.int16) - img)
            assert dd.mean() <= 0.1 and dd.max() <= 2, (int(sid), dd.mean(), dd.max())
            ref = en.decode_crop(blobs[int(sid)], tuple(map(float, box)), (size, size),
                                 bool(flip))
            diffs.append(np.abs(ref.astype(np.int16) - img).mean())
    assert np.mean(diffs) <= 6.0, np.mean(diffs)


def _canvas_box(box, scale, shape):
    """A box in original coordinates mapped onto a canvas reduced by ``scale`` (y, x)."""
    ch, cw = shape[:2]
    top, left = float(box[0]) / scale[0], float(box[1]) / scale[1]
    return (top, left, min(float(box[2]) / scale[0], ch - top),
            min(float(box[3]) / scale[1], cw - left))


def test_before_augment_boxes_in_original_coordinates_for_budget_canvases(images):
    """Canvases shrunk to the pixel budget (3:1 images) report boxes in original coordinates.

    The reference rebuilds the budget canvas (decode_canvas + uniform shrink to
    canvas_max_pixels) and resizes the box from it (mean <= 0.1, max <= 2).
    """
    wide = images.fit(images.photo("rocket"), 64, 192)
    tall = images.fit(images.photo("astronaut"), 180, 60)
    blobs = [images.pil_jpeg(wide, 92), images.pil_jpeg(tall, 92)] * 4
    size, seed = 16, 2
    budget = 2 * size * size
    with _ring((blobs, np.zeros(8)), batch_size=4, echo=3, placement="before_augment",
               image_size=size, seed=seed) as ring:
        batches = eh.collect(ring)[0]
    own_closer = total = 0
    for b in batches:
        for img, sid, box, flip, j in zip(b["images"], b["ids"], b["boxes"], b["flips"],
                                          b["echo"]):
            H, W = _source_hw(blobs[int(sid)])
            top, left, h, w = map(float, box)
            assert 0 <= top and 0 <= left and top + h <= H + 1e-3 and left + w <= W + 1e-3
            want_box, _ = en.random_resized_crop_params(seed, 0, int(sid), int(j), H, W)
            assert np.allclose(box, want_box, atol=1e-3)
            canvas, d = en.decode_canvas(blobs[int(sid)], size)
            ch, cw = canvas.shape[:2]
            assert ch * cw > budget, "the test wants canvases over the budget"
            t = math.sqrt(budget / (ch * cw))
            sh, sw = max(1, int(ch * t)), max(1, int(cw * t))
            shrunk = en.resize_crop(canvas, (0, 0, ch, cw), (sh, sw))
            scale = (ch / sh * d, cw / sw * d)
            want = en.resize_crop(shrunk, _canvas_box(box, scale, shrunk.shape), (size, size),
                                  bool(flip))
            dd = np.abs(want.astype(np.int16) - img)
            assert dd.mean() <= 0.1 and dd.max() <= 2, (int(sid), dd.mean(), dd.max())
            # The box is the one that was cut: decode_crop of this box is closer than
            # decode_crop of the mirrored box position.
            own = en.decode_crop(blobs[int(sid)], (top, left, h, w), (size, size), bool(flip))
            other = en.decode_crop(blobs[int(sid)], (H - top - h, W - left - w, h, w),
                                   (size, size), bool(flip))
            total += 1
            own_closer += (np.abs(own.astype(np.int16) - img).mean()
                           < np.abs(other.astype(np.int16) - img).mean())
    assert own_closer >= 0.75 * total, (own_closer, total)


def test_after_augment_echoes_are_identical_copies(small):
    """after_augment: the fresh emission is decode_crop of its box, every echo a byte copy of it."""
    blobs, _ = small
    size = 24
    with _ring(small, echo=3, placement="after_augment", image_size=size, seed=4) as ring:
        batches = eh.collect(ring)[0]
    for sid, em in eh.emissions(batches).items():
        first = batches[em[0][0]]
        r0 = em[0][1]
        assert em[0][2] == 0 and first["fresh"][r0]
        img0 = first["images"][r0]
        ref = en.decode_crop(blobs[sid], tuple(map(float, first["boxes"][r0])), (size, size),
                             bool(first["flips"][r0]))
        assert np.abs(ref.astype(np.int16) - img0).max() <= 1
        for j, r, _ in em[1:]:
            assert np.array_equal(batches[j]["images"][r], img0), f"sample {sid}"
            assert np.array_equal(batches[j]["boxes"][r], first["boxes"][r0])
            assert batches[j]["flips"][r] == first["flips"][r0]


def test_after_augment_echo_flip(small):
    """after_augment + echo_flip: each echo is the fresh image or its mirror, as flips says."""
    with _ring(small, echo=4, placement="after_augment", image_size=24, seed=6,
               echo_flip=True) as ring:
        batches = eh.collect(ring)[0]
    same = mirrored = 0
    for sid, em in eh.emissions(batches).items():
        j0, r0, _ = em[0]
        img0, flip0 = batches[j0]["images"][r0], bool(batches[j0]["flips"][r0])
        for j, r, _ in em[1:]:
            img, flip = batches[j]["images"][r], bool(batches[j]["flips"][r])
            if flip == flip0:
                assert np.array_equal(img, img0), f"sample {sid}: same flip, other pixels"
                same += 1
            else:
                assert np.array_equal(img, img0[:, ::-1]), f"sample {sid}: not a mirror"
                mirrored += 1
    total = same + mirrored
    assert total == 64 * 3
    assert 0.25 <= mirrored / total <= 0.75, (same, mirrored)


def test_echo_outputs_survive_the_next_batch(small):
    """An echoing ring's batch stays intact while the next one is produced (two output buffers)."""
    for placement in PLACEMENTS:
        with _ring(small, echo=2, placement=placement, image_size=16) as ring:
            it = iter(ring)
            prev = next(it)
            keep = prev.images.copy()
            for cur in it:
                assert np.array_equal(prev.images, keep), placement
                assert not np.shares_memory(prev.images, cur.images)
                prev, keep = cur, cur.images.copy()



def _emitted(batch):
    return [(int(s), int(j), bool(f)) for s, j, f in zip(batch.sample_ids, batch.echo_index,
                                                         batch.fresh)]


def test_a_batch_prepared_ahead_is_neither_lost_nor_counted_as_sent(small):
    """before_augment on the CPU makes the next batch while the consumer holds this one.
    Leaving the loop keeps that batch: the next iteration delivers it first, and then
    every other emission once.  A state_dict taken meanwhile does not count its samples
    as sent: a resumed ring reads them fresh."""
    kw = dict(echo=2, placement="before_augment", image_size=16, seed=3)
    with _ring(small, **kw) as ring:
        assert ring.device.prepares_ahead
        whole = [e for b in ring for e in _emitted(b)]
    with _ring(small, **kw) as ring:
        it = iter(ring)
        got = _emitted(next(it)) + _emitted(next(it))
        state = ring.state_dict()
        it.close()  # what a break does
        got += [e for b in ring for e in _emitted(b)]
    assert got[:24] == whole[:24]  # the batch made ahead is the third batch
    assert sorted(got) == sorted(whole)
    first_two = [s for s, _, fresh in whole[:16] if fresh]
    with _ring(small, **kw) as ring:
        ring.load_state_dict(state)
        rest = [s for b in ring for s, _, fresh in _emitted(b) if fresh]
    assert sorted(first_two + rest) == list(range(len(small[0])))


def test_prepared_ahead_output_leaves_the_last_two_batches_alone(small):
    """Three host output buffers: while the consumer holds batches k and k+1, the batch
    made ahead (k+2) writes into neither (k stays valid until k+2 is delivered)."""
    with _ring(small, echo=3, placement="before_augment", image_size=16) as ring:
        it = iter(ring)
        prev = next(it)
        keep = prev.images.copy()
        for cur in it:
            ring.device.synchronize()  # the batch after cur is made by now
            assert np.array_equal(prev.images, keep)
            assert not np.shares_memory(prev.images, cur.images)
            prev, keep = cur, cur.images.copy()


# ---- determinism -----------------------------------------------------------------------
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_same_seed_same_batches_any_workers(small, placement):
    """Fixed e: same seed, same batches with 1/2 worker processes or threads; other seed differs."""
    def run(**kw):
        with _ring(small, echo=2.5, placement=placement, image_size=16, **kw) as ring:
            return [b for ep in eh.collect(ring, epochs=2) for b in ep]

    ref = run(workers=1, seed=3)
    for kw in ({"workers": 2}, {"workers": 2, "worker_mode": "thread"}):
        got = run(seed=3, **kw)
        assert len(got) == len(ref), kw
        for a, b in zip(ref, got):
            for k in ("ids", "echo", "fresh", "labels", "images", "boxes", "flips"):
                assert np.array_equal(a[k], b[k]), (kw, k)
    other = run(workers=2, seed=4)
    assert (len(other) != len(ref) or
            any(not np.array_equal(a["ids"], b["ids"]) for a, b in zip(ref, other)))


# ---- echo = 1 ---------------------------------------------------------------------------------
def test_echo_one_is_the_loader_without_a_copy(small):
    """echo=1 yields the bare Loader's batches; the images are the ring slot itself (no copy)."""
    src = _src(small)
    with en.Loader(src, 8, image_size=24, workers=2, seed=9) as loader:
        want = [b.copy() for _ in range(2) for b in loader]
    with en.EchoRing(src, batch_size=8, image_size=24, echo=1, workers=2, seed=9) as ring:
        got = []
        for _ in range(2):
            assert len(ring) == len(want) // 2
            for b in ring:
                slots = [s.pixels for s in ring.loader._ring.slots]
                hits = [i for i, s in enumerate(slots) if b.images.ctypes.data == s.ctypes.data]
                assert len(hits) == 1 and np.shares_memory(b.images, slots[hits[0]])
                assert b.fresh.all() and not b.echo_index.any()
                got.append(b.copy())
    assert len(got) == len(want)
    for a, b in zip(want, got):
        for k in ("sample_ids", "labels", "images", "boxes", "flips"):
            assert np.array_equal(getattr(a, k), getattr(b, k)), k
        assert a.epoch == b.epoch


# ---- interop -------------------------------------------------------------------------------------
@pytest.mark.parametrize("e", [1, 2])
def test_dlpack_shares_memory(small, e):
    """torch/numpy.from_dlpack of batch.images share its memory, for echo=1 and echo=2."""
    torch = pytest.importorskip("torch")
    with _ring(small, echo=e, placement="after_augment") as ring:
        for i, b in enumerate(ring):
            t = torch.from_dlpack(b.images)
            assert t.data_ptr() == b.images.ctypes.data
            assert tuple(t.shape) == b.images.shape and t.dtype == torch.uint8
            assert np.array_equal(t.numpy(), b.images)
            a = np.from_dlpack(b.images)
            assert a.ctypes.data == b.images.ctypes.data and np.shares_memory(a, b.images)
            lab = torch.from_dlpack(b.labels)
            assert lab.data_ptr() == b.labels.ctypes.data
            if i == 3:
                break


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("normalize", [True, ((0.5, 0.25, 0.75), (0.2, 0.3, 0.4))])
def test_normalize_matches_manual(small, layout, normalize):
    """normalize gives float32 (x / 255 - mean) / std in the asked layout; DLPack without copy."""
    torch = pytest.importorskip("torch")
    if normalize is True:
        mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    else:
        mean, std = normalize
    mean = np.asarray(mean, np.float64)
    std = np.asarray(std, np.float64)
    with _ring(small, echo=2, seed=12) as raw:
        want = [b["images"] for b in eh.collect(raw)[0]]
    with _ring(small, echo=2, seed=12, normalize=normalize, layout=layout) as ring:
        k = 0
        for b in ring:
            x = b.images
            assert x.dtype == np.float32
            ref = (want[k].astype(np.float64) / 255.0 - mean) / std
            if layout == "NCHW":
                ref = ref.transpose(0, 3, 1, 2)
            assert x.shape == ref.shape
            np.testing.assert_allclose(x, ref, atol=1e-5, rtol=1e-5)
            assert torch.from_dlpack(x).data_ptr() == x.ctypes.data
            k += 1
    assert k == len(want)


# ---- arguments -------------------------------------------------------------------------------
BAD_ARGS = [
    ({"echo": 0.5}, "echo"),
    ({"echo": 0}, "echo"),
    ({"echo": float("nan")}, "echo"),
    ({"echo": "fast"}, "echo"),
    ({"placement": "during_augment"}, "placement"),
    ({"batch_size": 65}, "batch_size"),
    ({"image_size": 0}, "image_size"),
    ({"image_size": -3}, "image_size"),
    ({"shuffle_buffer": 15}, "shuffle_buffer"),
    ({"normalize": "imagenet"}, "normalize"),
    ({"normalize": ((0.5, 0.5), (0.2, 0.2))}, "normalize"),
    ({"normalize": ((0.5,) * 3, (0.2, 0.0, 0.2))}, "normalize"),
    ({"layout": "HWC"}, "layout"),
    ({"echo": "auto", "max_echo": 0.5}, "max_echo"),
]


@pytest.mark.parametrize("kwargs,name", BAD_ARGS, ids=[f"{n}-{i}" for i, (_, n) in
                                                        enumerate(BAD_ARGS)])
def test_bad_arguments_raise_value_error(small, kwargs, name):
    """Wrong arguments raise ValueError at construction naming the argument, leaving no segment."""
    before = set(rh.segments(os.getpid()))
    kw = {"batch_size": 8, "image_size": 16, **kwargs}
    with pytest.raises(ValueError, match=name):
        en.EchoRing(_src(small), **kw)
    assert set(rh.segments(os.getpid())) == before


def test_cuda_without_cuda_is_a_one_line_runtime_error(small):
    """device='cuda' without CUDA: one-line RuntimeError saying how to install it or to use cpu."""
    if _cuda_usable():
        pytest.skip("CUDA is usable here; the CUDA backend has its own tests")
    with pytest.raises(RuntimeError) as info:
        en.EchoRing(_src(small), batch_size=8, image_size=16, device="cuda")
    msg = str(info.value)
    assert "\n" not in msg
    assert "pip install" in msg or "cpu" in msg, msg
    with pytest.raises(ValueError, match="device"):
        en.EchoRing(_src(small), batch_size=8, image_size=16, device="tpu")


def test_auto_device_falls_back_to_cpu(small):
    """device='auto' without CUDA runs on the CPU backend and delivers NumPy batches."""
    if _cuda_usable():
        pytest.skip("CUDA is usable here: device='auto' picks it")
    with _ring(small, echo=2, device="auto", image_size=16) as ring:
        assert ring.device.name == "cpu"
        b = next(iter(ring))
        assert isinstance(b.images, np.ndarray) and b.images.shape == (8, 16, 16, 3)


# ---- memory and cleanup -------------------------------------------------------------------------
def test_memory_flat_over_epochs_and_segment_removed(small):
    """Six epochs: consumer RSS flat (< 8 MiB) after epoch 2; the ring's memory is given
    back on close (no process holds its memfd, by descriptor or mapping)."""
    ring = _ring(small, echo=2, placement="before_augment", image_size=160, batch_size=16)
    with ring:
        name = ring.loader.ring_name
        assert name[1:] in rh.segments(os.getpid()) and name in rh.ring_memory(os.getpid())
        rss, delivered = [], []
        for _ in range(6):
            delivered.append(0)
            for b in ring:
                b.images.sum(dtype=np.int64)
                delivered[-1] += b.images.nbytes
            rss.append(eh.rss_bytes())
    assert name[1:] not in rh.segments(os.getpid()), "ring segment left behind"
    assert name not in rh.ring_memory(os.getpid()), "the ring's memory is still held"
    growth = rss[-1] - rss[1]
    assert growth < 8 * 2**20, f"RSS grew {growth / 2**20:.1f} MiB over epochs 3-6: {rss}"
    # The bound has power: each epoch pushed more pixels through than it allows.
    assert min(delivered[2:]) > 8 * 2**20, delivered


def test_segment_removed_when_the_consumer_raises(small):
    """An exception in the with-block stops the workers and removes the shared-memory segment."""
    with pytest.raises(KeyError):
        with _ring(small, echo=2, placement="before_augment") as ring:
            name = ring.loader.ring_name
            for i, _ in enumerate(ring):
                if i == 2:
                    raise KeyError("consumer failed")
    assert name[1:] not in rh.segments(os.getpid())
    assert name not in rh.ring_memory(os.getpid())
    assert ring.loader.worker_pids() == []


# ---- the device protocol: late copies, seeks, refused starts (emulated on NumPy) ----------
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
    assert name[1:] not in rh.segments(os.getpid())
    assert name not in rh.ring_memory(os.getpid())


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
    """This process's ring segments: memfd rings held open, named ones in /dev/shm."""
    return set(rh.segments(os.getpid()))


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
    """An echo buffer that cannot be allocated on its device: MemoryError with the size
    and a smaller setting, and the ring started for it is gone."""
    src = en.Samples(_jpegs(16), np.arange(16) % 3)
    before = _segments()
    # Its records (61 bytes an entry, host memory) fit; its pixels (on the device) do not.
    ring = en.EchoRing(src, batch_size=8, image_size=224, echo=2, workers=1,
                       shuffle_buffer=2**24, device=ArrayDevice(np))
    with pytest.raises(MemoryError, match=r"needs .* GiB on array, which could not be allocated; each of these halves it: shuffle_buffer="):
        ring.start()
    assert ring.loader.ring is None and _segments() == before


def test_a_host_echo_buffer_is_budgeted_with_the_ring():
    """On the CPU the echo buffer counts in the memory budget checked with the ring: too
    large, it is refused before any worker starts, naming it and shuffle_buffer."""
    src = en.Samples(_jpegs(16), np.arange(16) % 3)
    before = _segments()
    ring = en.EchoRing(src, batch_size=8, image_size=224, echo=2, workers=1,
                       shuffle_buffer=2**40)
    with pytest.raises(en.RingMemoryError, match=r"the echo buffer \(.* GiB, lower "
                                                 r"shuffle_buffer\)") as info:
        ring.start()
    per_entry = ring.loader.plan.transform.sample_bytes + Record().nbytes()  # pixels, record
    assert ("the echo buffer", 2**40 * per_entry, "shuffle_buffer") in info.value.parts
    assert ring.loader.ring is None and ring.loader.worker_pids() == [] and \
        _segments() == before


def test_stats_name_the_backend():
    """stats() says which backend made the batches."""
    src = en.Samples(_jpegs(16), np.arange(16) % 3)
    for device, name in (("cpu", "cpu"), (ArrayDevice(np), "array")):
        with en.EchoRing(src, batch_size=8, image_size=32, echo=2, workers=1,
                         device=device, worker_mode="thread") as ring:
            sum(1 for _ in ring)
            assert ring.stats()["device"] == name

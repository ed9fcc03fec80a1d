"""CUDA backend (echo_native/backends/cuda.py) end to end.

Where CuPy finds a GPU these run on it.  Without one (CI, a laptop) the same tests run
on the strict stand-in ``tests/fake_cupy.py`` (CuPy's API, NVRTC compiling the real
kernels, a checker of stream order): every test then also fails on an unordered access,
so the file is green before a GPU ever runs it.  Only the tests that hand batches to a
real torch or JAX on the GPU (``real_gpu``) are skipped there: the stand-in plays CuPy,
not them."""

import sys
import types

import echo_helpers
import numpy as np
import pytest

import echo_native as en
from echo_native.backends import cuda_available
from echo_native.output import DeviceArray

# Decided at import, before any test puts the stand-in into sys.modules.
REAL_GPU = cuda_available()

pytestmark = [pytest.mark.gpu]


def real_gpu(test):
    """A test that hands batches to a real torch or JAX on the GPU: skipped on the
    stand-in (a plain attribute: pyproject.toml's strict markers stay as they are)."""
    test.real_gpu = True
    return test


@pytest.fixture(autouse=True)
def gpu(request, monkeypatch):
    """None on a real GPU; else the stand-in, installed for this test and checked after
    it: no access to device memory unordered with another (a race on a GPU)."""
    if REAL_GPU:
        yield None
        return
    if getattr(request.function, "real_gpu", False):
        pytest.skip("torch/JAX on a real GPU: the stand-in plays CuPy alone")
    import fake_cupy
    stand_in = fake_cupy.install(monkeypatch)
    # A CPU torch may be installed: the backend must not take it for a CUDA consumer.
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(
        cuda=types.SimpleNamespace(is_initialized=lambda: False)))
    yield stand_in
    assert stand_in.violations == [], "\n".join(stand_in.violations)


def _jpegs(n, seed=0):
    return echo_helpers.photo_jpegs(n, 280, 330, seed)


@pytest.fixture(scope="module")
def source():
    return en.Samples(_jpegs(64), np.arange(64) % 5)


def _run(source, device, **kw):
    import cupy
    args = dict(batch_size=16, image_size=64, workers=2, seed=7)
    args.update(kw)
    args = {k: v for k, v in args.items() if v is not None}  # image_size=None: augment= has it
    out = []
    with en.EchoRing(source, device=device, **args) as ring:
        for b in ring:
            img = cupy.asnumpy(b.images) if device != "cpu" else np.array(b.images)
            out.append((img, b.sample_ids.copy(), b.echo_index.copy()))
    return out


def test_fresh_batches_round_trip_byte_exact(source):
    """echo=1 on CUDA delivers exactly the bytes the CPU ring produced."""
    cpu = _run(source, "cpu", echo=1)
    gpu = _run(source, "cuda", echo=1)
    for (a, ia, _), (b, ib, _) in zip(cpu, gpu, strict=True):
        np.testing.assert_array_equal(ia, ib)
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("placement", ["after_augment", "batch"])
def test_device_repeats_are_exact(source, placement):
    """after_augment and batch echoes on the GPU equal the CPU backend's bytes."""
    cpu = _run(source, "cpu", echo=2, placement=placement)
    gpu = _run(source, "cuda", echo=2, placement=placement)
    for (a, ia, ea), (b, ib, eb) in zip(cpu, gpu, strict=True):
        np.testing.assert_array_equal(ia, ib)
        np.testing.assert_array_equal(ea, eb)
        np.testing.assert_array_equal(a, b)


def test_gpu_per_example_ops_run_each_emissions_program(source):
    """augment=[crop, ops] before augmentation on the GPU: each emission is its crop
    with the program of its (seed, epoch, sample id, echo index), byte for byte
    the native executor's; after augmentation the workers ran them (CPU bytes)."""
    from echo_native import _kernel
    from echo_native.augment import Program

    crop = en.RandomResizedCrop(64)
    ops = [en.ColorJitter(0.4, 0.4, 0.4, 0.1), en.RandomGrayscale(0.2),
           en.TrivialAugmentWide(), en.RandomErasing(p=0.5)]
    def run(augment, **more):
        import cupy
        out = []
        with en.EchoRing(source, device="cuda", augment=augment, batch_size=16, workers=2,
                         seed=7, **more) as ring:
            for b in ring:
                out.append((cupy.asnumpy(b.images), b.sample_ids.copy(),
                            b.echo_index.copy(), b.epoch))
        return out

    rich = run([crop] + ops, echo=3, placement="before_augment")
    plain = run(crop, echo=3, placement="before_augment")
    for (a, ia, ea, epoch), (b, ib, eb, _) in zip(rich, plain, strict=True):
        np.testing.assert_array_equal(ia, ib)
        codes, args = Program(ops, (64, 64)).draw(7, epoch, ib, eb)
        np.testing.assert_array_equal(a, _kernel.apply_ops(b.copy(), codes, args))
    after = run([crop] + ops, echo=2, placement="after_augment")
    cpu = _run(source, "cpu", augment=[crop] + ops, image_size=None, echo=2,
               placement="after_augment")
    for (a, ia, *_), (b, ib, _) in zip(after, cpu, strict=True):
        np.testing.assert_array_equal(ia, ib)
        np.testing.assert_array_equal(a, b)


def test_gpu_reaugmentation_matches_cpu(source):
    """before_augment crops made by the CUDA kernel equal the native CPU path within 2 levels."""
    cpu = _run(source, "cpu", echo=3, placement="before_augment")
    gpu = _run(source, "cuda", echo=3, placement="before_augment")
    for (a, ia, ea), (b, ib, eb) in zip(cpu, gpu, strict=True):
        np.testing.assert_array_equal(ia, ib)
        np.testing.assert_array_equal(ea, eb)
        diff = np.abs(a.astype(int) - b)
        assert diff.max() <= 2 and diff.mean() < 0.3


_SPIN = r'''
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}'''


def _spin():
    import cupy
    return cupy.RawKernel(_SPIN, "spin")


@pytest.mark.parametrize("register", [True, False])
def test_slot_reuse_waits_for_copies_under_slow_consumer(source, register):
    """Two ring slots, copies from registered or staged memory, a consumer stream kept
    busy: every batch still arrives with the bytes the CPU ring produced."""
    import cupy
    from echo_native.backends.cuda import CudaDevice
    spin = _spin()
    kw = dict(batch_size=8, image_size=32, echo=1, workers=2, seed=7, slots=2)
    ref = _run(source, "cpu", **kw)
    dev = CudaDevice(0, register=register)
    sums = []
    with en.EchoRing(source, device=dev, **kw) as ring:
        if register and dev.registration != "registered":
            # A sandbox may refuse to page-lock shared memory: then this variant would
            # only repeat the staged one, and the report should say so.
            assert dev.registration == "pinned-staging" and dev.registration_error
            pytest.skip(f"cudaHostRegister of the ring refused: {dev.registration_error}")
        if not register:
            assert dev.registration == "pinned-staging"
        for b in ring:
            spin((1,), (1,), (np.int64(20_000_000),))  # ~10 ms on the consumer's stream
            sums.append(cupy.asarray(b.images).astype(cupy.int64).sum())
        sums = [int(s) for s in sums]
    assert sums == [int(a.astype(np.int64).sum()) for a, _, _ in ref]


@real_gpu
@pytest.mark.parametrize("placement", ["before_augment", "after_augment", "batch"])
def test_outputs_wait_for_a_slow_consumer_stream(source, placement):
    """A torch consumer on its own stream, slowed down, reads each batch after the
    pipeline has already produced the next one: it still reads the batch it was given
    (the pipeline waits for the consumer's stream before reusing an output buffer)."""
    torch = pytest.importorskip("torch")
    kw = dict(batch_size=8, image_size=48, echo=2, placement=placement, workers=2, seed=3)
    ref = _run(source, "cpu", **kw)
    spin = _spin()
    side = torch.cuda.Stream()
    kept, prev = [], None
    with en.EchoRing(source, device="cuda", **kw) as ring, torch.cuda.stream(side):
        import cupy
        with cupy.cuda.ExternalStream(side.cuda_stream):
            for b in ring:
                t = torch.from_dlpack(b.images)
                spin((1,), (1,), (np.int64(5_000_000),))  # the consumer is slow ...
                if prev is not None:
                    kept.append(prev.clone())  # ... and reads the previous batch late
                prev = t
            kept.append(prev.clone())
    side.synchronize()
    assert len(kept) == len(ref)
    for got, (want, _, _) in zip(kept, ref):
        diff = np.abs(got.cpu().numpy().astype(int) - want)
        assert diff.max() <= (2 if placement == "before_augment" else 0)


@real_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_consumer_never_sees_a_batch_before_it_is_complete(source, dtype):
    """The pipeline's stream is slowed down before every normalisation; a torch consumer
    on its own stream reads each batch at once (and, for bfloat16, a copy made on the
    current stream): it still reads the finished batch."""
    torch = pytest.importorskip("torch")
    from echo_native.backends.cuda import CudaDevice
    spin = _spin()

    class SlowDevice(CudaDevice):
        def normalize(self, images, mean, std, layout, out):
            with self.device, self.stream:
                spin((1,), (1,), (np.int64(10_000_000),))  # ~5 ms of our stream's time
            return super().normalize(images, mean, std, layout, out)

    kw = dict(batch_size=8, image_size=32, echo=2, placement="after_augment", workers=2,
              seed=6, normalize=True, dtype=dtype)
    with en.EchoRing(source, device="cpu", **kw) as ring:
        ref = [np.array(b.images, np.float32) for b in ring]
    side = torch.cuda.Stream()
    got, copies = [], []
    with en.EchoRing(source, device=SlowDevice(0), **kw) as ring, torch.cuda.stream(side):
        for b in ring:
            got.append(torch.from_dlpack(b.images).float())
            if dtype == "bfloat16":
                copies.append(b.images.copy().to_float32().get())
    side.synchronize()
    assert len(got) == len(ref)
    rtol = 1e-6 if dtype == "float32" else 2**-7
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g.cpu().numpy(), r, rtol=rtol, atol=1e-6)
    for c, r in zip(copies, ref):
        np.testing.assert_allclose(c, r, rtol=rtol, atol=1e-6)


def test_refused_registration_falls_back_to_staging(source, monkeypatch):
    """Where the system refuses to page-lock the ring, batches go through the pinned
    staging buffers, say why, and are still byte-exact."""
    import cupy
    from echo_native.backends.cuda import CudaDevice
    rt = cupy.cuda.runtime

    def refuse(*args):
        raise rt.CUDARuntimeError(801)  # cudaErrorNotSupported
    monkeypatch.setattr(rt, "hostRegister", refuse)
    kw = dict(batch_size=8, image_size=32, echo=2, placement="after_augment", workers=2,
              seed=8, slots=2)
    ref = _run(source, "cpu", **kw)
    dev = CudaDevice(0)
    got = _run(source, dev, **kw)
    assert dev.registration == "pinned-staging" and dev.registration_error
    for (a, ia, _), (b, ib, _) in zip(ref, got, strict=True):
        np.testing.assert_array_equal(ia, ib)
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_gpu_normalisation_matches_cpu(source, dtype, layout):
    """Normalisation fused on the GPU gives the CPU backend's values (one rounding
    there, two here: within one unit in the last place of the output type)."""
    import cupy
    kw = dict(batch_size=8, image_size=40, echo=2, placement="after_augment", workers=2,
              seed=5, normalize=True, layout=layout, dtype=dtype)

    def values(device):
        out = []
        with en.EchoRing(source, device=device, **kw) as ring:
            for b in ring:
                x = b.images.to_float32() if dtype == "bfloat16" else b.images
                out.append(np.array(cupy.asnumpy(x) if device != "cpu" else x, np.float32))
        return out

    rtol = {"float32": 1e-6, "float16": 2**-10, "bfloat16": 2**-7}[dtype]
    for a, b in zip(values("cpu"), values("cuda"), strict=True):
        np.testing.assert_allclose(b, a, rtol=rtol, atol=1e-6)


@real_gpu
def test_bfloat16_batches_reach_torch_and_jax_on_the_gpu(source):
    """bfloat16 batches leave by DLPack as bfloat16, on the GPU, without a copy."""
    torch = pytest.importorskip("torch")
    with en.EchoRing(source, batch_size=8, image_size=32, echo=2, workers=1, device="cuda",
                     normalize=True, dtype="bfloat16", layout="NCHW") as ring:
        b = next(iter(ring))
        t = torch.from_dlpack(b.images)
        assert t.dtype == torch.bfloat16 and t.is_cuda
        assert t.data_ptr() == b.images.bits.data.ptr
        np.testing.assert_array_equal(t.float().cpu().numpy(),
                                      b.images.to_float32().get())
        try:
            import jax
            import jax.numpy as jnp
        except ImportError:
            return
        j = jax.dlpack.from_dlpack(b.images)
        assert j.dtype == jnp.bfloat16 and j.shape == b.images.shape
        np.testing.assert_array_equal(np.asarray(j.astype(jnp.float32)),
                                      t.float().cpu().numpy())


def test_echo_buffer_out_of_memory_says_what_to_do(source):
    """An echo buffer larger than the GPU: MemoryError with the size and a smaller setting."""
    import cupy
    free = cupy.cuda.Device().mem_info[0]
    per = 2 * 224 * 224 * 3
    huge = int(free // per * 2) + 256
    ring = en.EchoRing(source, batch_size=16, image_size=224, echo=2, workers=1,
                       device="cuda", shuffle_buffer=huge)
    with pytest.raises(MemoryError, match=r"GiB on cuda, which could not be allocated; each of these halves it: "):
        ring.start()
    ring.close()


def test_cuda_device_numbers_are_checked():
    """cuda:N beyond the devices present is refused by name."""
    import cupy
    n = cupy.cuda.runtime.getDeviceCount()
    with pytest.raises(ValueError, match=f"sees {n} CUDA device"):
        en.EchoRing(en.Samples(_jpegs(4), np.arange(4)), batch_size=2, device=f"cuda:{n}")


@real_gpu
def test_dlpack_interop_without_copy(source):
    """torch and cupy take batches by DLPack without copying."""
    torch = pytest.importorskip("torch")
    import cupy
    with en.EchoRing(source, batch_size=8, image_size=32, echo=2, workers=1,
                     device="cuda") as ring:
        b = next(iter(ring))
        assert isinstance(b.images, DeviceArray)
        t = torch.from_dlpack(b.images)
        assert t.is_cuda and t.data_ptr() == b.images.array.data.ptr
        c = cupy.from_dlpack(b.images)
        assert c.data.ptr == b.images.array.data.ptr
        a = cupy.asarray(b.images)  # the array interface: no copy either
        assert a.data.ptr == b.images.array.data.ptr
        assert int(t.sum()) == int(a.astype(cupy.int64).sum())
        np.testing.assert_array_equal(b.images.get(), cupy.asnumpy(a))
        with pytest.raises(TypeError):
            np.asarray(b.images)
        try:
            import jax
        except ImportError:
            return
        j = jax.dlpack.from_dlpack(b.images)
        np.testing.assert_array_equal(np.asarray(j), cupy.asnumpy(b.images))


def test_no_device_memory_growth_over_epochs(source):
    """Device memory in use is the same after epoch 2 and after epoch 6."""
    import cupy
    pool = cupy.get_default_memory_pool()
    with en.EchoRing(source, batch_size=8, image_size=48, echo=2, workers=2,
                     device="cuda") as ring:
        used = []
        for epoch in range(6):
            for _ in ring:
                pass
            cupy.cuda.Device().synchronize()
            used.append(pool.used_bytes())
    assert used[-1] <= used[1] * 1.05 + 2**20


@pytest.mark.parametrize("placement", ["before_augment", "after_augment", "batch"])
def test_echoes_add_no_host_to_device_traffic(source, placement):
    """e=4 copies exactly the pixels e=2 copies: every fresh slot once, echoes none."""
    from echo_native.backends.cuda import CudaDevice
    copied = {}
    for e in (2, 4):
        dev = CudaDevice(0)
        with en.EchoRing(source, batch_size=8, image_size=40, echo=e, placement=placement,
                         workers=2, seed=2, device=dev) as ring:
            delivered = sum(len(b) for b in ring)
        copied[e] = dev.h2d_bytes
        assert delivered >= (e - 0.5) * len(source)
    assert copied[2] == copied[4] > 0


# -- issue 20: stream order on a real GPU ----------------------------------------------------
def _values(source, device, **kw):
    """Each batch's images as float32 NumPy arrays (bfloat16 through to_float32)."""
    import cupy
    out = []
    with en.EchoRing(source, device=device, **kw) as ring:
        for b in ring:
            x = b.images
            if device == "cpu":
                out.append(np.array(x, np.float32))
            else:
                x = x.to_float32() if hasattr(x, "to_float32") else cupy.asarray(x)
                out.append(cupy.asnumpy(x).astype(np.float32))
    return out


@real_gpu
@pytest.mark.parametrize("dtype", ["uint8", "float32", "bfloat16"])
@pytest.mark.parametrize("echo", [1, 2])
def test_a_late_reader_on_the_stream_a_batch_went_to_is_waited_for(source, dtype, echo):
    """(1) A torch consumer takes each batch under ``torch.cuda.stream(side)`` (so
    ``__dlpack__`` is handed ``side``), leaves that context, asks for the next batch
    and only then reads the previous one on ``side``, slowly.  The pipeline must not
    overwrite the buffer before: it learnt ``side`` from the export."""
    torch = pytest.importorskip("torch")
    import cupy
    norm = {} if dtype == "uint8" else dict(normalize=True, dtype=dtype, layout="NCHW")
    kw = dict(batch_size=8, image_size=48, echo=echo, placement="after_augment", workers=2,
              seed=3, **norm)
    ref = _values(source, "cpu", **kw)
    spin = _spin()
    side = torch.cuda.Stream()
    kept, prev = [], None
    with en.EchoRing(source, device="cuda", **kw) as ring:
        for b in ring:
            with torch.cuda.stream(side):
                t = torch.from_dlpack(b.images)
            if prev is not None:
                with torch.cuda.stream(side), cupy.cuda.ExternalStream(side.cuda_stream):
                    spin((1,), (1,), (np.int64(10_000_000),))  # the late reader is slow
                    kept.append(prev.float().clone())
            prev = t
        with torch.cuda.stream(side):
            kept.append(prev.float().clone())
    side.synchronize()
    assert len(kept) == len(ref)
    rtol = 2**-7 if dtype == "bfloat16" else 1e-6
    for got, want in zip(kept, ref):
        np.testing.assert_allclose(got.cpu().numpy(), want, rtol=rtol, atol=1e-6)


def test_crop_resize_launches_batches_beyond_65535():
    """(2) 65,537 crops in one launch (one more than gridDim.y holds): no launch failure,
    every image written, the last ones as the first."""
    import cupy
    from echo_native.backends.cuda import CudaDevice
    from echo_native.echo.images import ImageStore
    dev = CudaDevice(0)
    rng = np.random.default_rng(0)
    buf = ImageStore(3, 6 * 8 * 3, dev)
    buf.pixels[...] = cupy.asarray(rng.integers(0, 256, (3, 6 * 8 * 3), dtype=np.uint8))
    buf.shape[:] = (6, 8)
    cupy.cuda.Device().synchronize()
    n = 65_537
    entries = np.arange(n) % 3
    boxes = np.array([[0.0, 0.0, 6.0, 8.0], [1.0, 2.0, 4.0, 5.0], [0.5, 0.0, 5.5, 8.0]])[entries]
    flips = (np.arange(n) // 3) % 2 == 1
    out = dev.empty((n, 1, 2, 3), np.uint8)
    out[...] = 7
    # The fill ran on the current stream, the kernel writes on the backend's.
    cupy.cuda.Device().synchronize()
    dev.crop_resize(buf, entries, boxes, flips, out)
    dev.stream.synchronize()
    got = out.get()
    np.testing.assert_array_equal(got, np.tile(got[:6], (-(-n // 6), 1, 1, 1))[:n])
    assert (got[:6] != 7).any()


def test_gpu_kernels_equal_the_host_build_bit_for_bit(tmp_path):
    """(3) With --fmad=false the GPU's crop/resize and normalisation equal the host build
    of kernels.cu (-ffp-contract=off) bit for bit."""
    import shutil
    import subprocess
    import cupy
    import test_cuda_kernels as tk
    from echo_native.backends.cuda import CudaDevice
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a host C++ compiler")
    lib = str(tmp_path / "cuda_host.so")
    subprocess.run([cxx, "-std=c++14", "-O2", "-ffp-contract=off", "-shared", "-fPIC",
                    f"-I{tk.PACKAGE}", f"{tk.HERE}/cuda_host.cpp", "-o", lib], check=True)
    host = tk.HostKernels(lib)
    rng = np.random.default_rng(1)
    canvases = [tk._photo(n) for n in ("astronaut", "coffee", "chelsea", "rocket")]
    buf = tk._buffer(canvases)
    entries = np.array([0, 1, 2, 3] * 4)
    boxes = tk._boxes(rng, [buf.shape[e] for e in entries])
    flips = np.arange(len(entries)) % 2 == 1
    want = np.empty((len(entries), 96, 80, 3), np.uint8)
    host.crop_resize(buf, entries, boxes, flips, want)
    dev = CudaDevice(0)
    from echo_native.echo.images import ImageStore
    gbuf = ImageStore(buf.capacity, buf.pixels.shape[1], dev)
    gbuf.pixels[...] = cupy.asarray(buf.pixels)
    gbuf.shape[...] = buf.shape
    cupy.cuda.Device().synchronize()
    got = dev.empty(want.shape, np.uint8)
    dev.crop_resize(gbuf, entries, boxes, flips, got)
    dev.stream.synchronize()
    np.testing.assert_array_equal(got.get(), want)
    x = rng.integers(0, 256, (4, 9, 7, 3), dtype=np.uint8)
    for dtype in ("float32", "float16", "bfloat16"):
        for layout in ("NHWC", "NCHW"):
            shape = x.shape if layout == "NHWC" else (4, 3, 9, 7)
            storage = np.uint16 if dtype == "bfloat16" else dtype
            h = host.normalize(x, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), layout,
                               np.empty(shape, storage))
            g = dev.empty(shape, storage)
            gx = cupy.asarray(x)
            # The copy in ran on the current stream, the kernel reads on the backend's.
            cupy.cuda.Device().synchronize()
            dev.normalize(gx, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), layout, g)
            dev.stream.synchronize()
            np.testing.assert_array_equal(g.get().view(np.uint8), h.view(np.uint8))


@real_gpu
def test_a_second_ring_on_the_device_waits_for_the_last_step(source):
    """(4) The last step of one ring is still running (slow) when the ring closes and a
    second ring on the same device starts, in the memory CuPy's pool got back: the
    step still reads the batch it was given."""
    torch = pytest.importorskip("torch")
    from echo_native.backends.cuda import CudaDevice
    kw = dict(batch_size=8, image_size=48, workers=2, seed=3, worker_mode="thread")
    want = _values(source, "cpu", echo=1, **kw)[-1]
    dev = CudaDevice(0)
    spin = _spin()
    with en.EchoRing(source, device=dev, echo=1, **kw) as ring:
        for b in ring:
            pass
        spin((1,), (1,), (np.int64(2_000_000_000),))  # ~1 s: the last step is slow ...
        t = torch.from_dlpack(b.images)
        kept = t.clone()                              # ... and reads the last batch
        del t, b
    with en.EchoRing(source, device=dev, echo=2, placement="batch", **kw) as ring:
        for _ in ring:
            pass
    torch.cuda.synchronize()
    np.testing.assert_array_equal(kept.cpu().numpy().astype(np.float32), want)


def test_an_exception_between_store_and_release_closes_cleanly(source):
    """(5) A failure after a copy out of the ring was queued and before its slot went back:
    close() waits for the copy, unpins the ring, and the device serves a new ring."""
    from echo_native.backends.cuda import CudaDevice

    class Failing(CudaDevice):
        stores = 0

        def store(self, *args):
            super().store(*args)
            Failing.stores += 1
            if Failing.stores == 2:
                raise RuntimeError("between a store and its release")

    kw = dict(batch_size=8, image_size=32, echo=2, placement="after_augment", workers=2,
              seed=4)
    dev = Failing(0)
    with pytest.raises(RuntimeError, match="between a store"):
        _run(source, dev, **kw)
    assert dev._registered is None
    ref = _run(source, "cpu", **kw)
    for (a, ia, _), (b, ib, _) in zip(ref, _run(source, dev, **kw), strict=True):
        np.testing.assert_array_equal(ia, ib)
        np.testing.assert_array_equal(a, b)


@real_gpu
def test_second_gpu_with_device_zero_current(source):
    """(6) cuda:1 while device 0 is current: byte-exact batches, exported as device 1's,
    read by torch on device 1."""
    import cupy
    torch = pytest.importorskip("torch")
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    kw = dict(batch_size=8, image_size=32, echo=2, placement="after_augment", workers=2,
              seed=6)
    ref = _run(source, "cpu", **kw)
    got = []
    with en.EchoRing(source, device="cuda:1", **kw) as ring:
        assert cupy.cuda.Device().id == 0
        for b in ring:
            assert b.images.__dlpack_device__() == (2, 1)
            t = torch.from_dlpack(b.images)
            assert t.device.index == 1
            got.append(t.cpu().numpy())
    for (a, _, _), g in zip(ref, got, strict=True):
        np.testing.assert_array_equal(a, g)


def test_the_copy_of_the_next_batch_overlaps_the_current_step(source):
    """(7) echo=1 with a slow step the host does not wait for: the next batch is complete
    (its host-to-device copy done) while the step on the previous one still runs.
    With two output buffers it could only follow that step."""
    import cupy
    spin = _spin()
    kw = dict(batch_size=8, image_size=48, echo=1, workers=2, seed=3)
    overlapped = []
    with en.EchoRing(source, device="cuda", **kw) as ring:
        step_end = None
        for b in ring:
            if step_end is not None:
                b.images.event.synchronize()  # this batch is complete ...
                overlapped.append(not step_end.done)  # ... the previous step still runs
            spin((1,), (1,), (np.int64(200_000_000),))  # ~100 ms step on this batch
            step_end = cupy.cuda.get_current_stream().record()
        cupy.cuda.Device().synchronize()
    assert len(overlapped) >= 4
    assert all(overlapped[1:]), overlapped


@pytest.mark.parametrize("spec", [en.Mix(mixup_alpha=0.4), en.Mix(mixup_alpha=0, cutmix_alpha=1.0)])
def test_mix_on_the_gpu_matches_the_cpu(source, spec):
    """MixUp / CutMix on the GPU: the same draws as on the CPU, images within float
    rounding of the CPU's, soft targets on the device summing to 1."""
    import cupy
    out = en.Output(normalize=True, layout="NCHW")
    got = {}
    for device in ("cpu", "cuda"):
        rows = []
        with en.EchoRing(source, batch_size=16, image_size=64, workers=2, seed=7, echo=2,
                         placement="after_augment", output=out, mix=spec,
                         device=device) as ring:
            for b in ring:
                if device == "cuda":
                    assert isinstance(b.targets, DeviceArray)
                # np.array copies: asnumpy of the CPU ring's arrays would be views that
                # the next batch overwrites.
                rows.append((np.array(cupy.asnumpy(b.images)),
                             np.array(cupy.asnumpy(b.targets))))
        got[device] = rows
    for (a, ta), (b, tb) in zip(got["cpu"], got["cuda"], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
        np.testing.assert_allclose(ta, tb, atol=1e-6)
        np.testing.assert_allclose(tb.sum(1), 1.0, atol=1e-5)


@pytest.mark.parametrize("spec", [en.Mix(mixup_alpha=0.4), en.Mix(mixup_alpha=0, cutmix_alpha=1.0)])
def test_bfloat16_mix_on_the_gpu_is_its_float32_mix_rounded_once(source, spec):
    """bfloat16 output with a Mix on the GPU: the GPU's own float32 mixed batch rounded
    on the device (``to_bfloat16``) bit for bit as ``bfloat16_bits`` rounds it; the
    CPU's bits the same but where the two normalisations (fmaf on the GPU) differ in
    float32's last bit at a rounding tie, one bfloat16 step; the same targets."""
    import cupy
    from echo_native.output import BFloat16Array, bfloat16_bits

    def run(device, dtype):
        rows = []
        with en.EchoRing(source, batch_size=16, image_size=64, workers=2, seed=7, echo=2,
                         placement="after_augment", mix=spec, device=device,
                         output=en.Output(normalize=True, layout="NCHW", dtype=dtype)) as ring:
            for b in ring:
                x = b.images
                if dtype == "bfloat16":
                    assert isinstance(x, BFloat16Array)
                    x = x.bits
                # Copies: asnumpy of a CPU batch is a view the next batch overwrites.
                rows.append((np.array(cupy.asnumpy(x)), np.array(cupy.asnumpy(b.targets))))
        return rows

    gpu16, gpu32, cpu16 = run("cuda", "bfloat16"), run("cuda", "float32"), run("cpu", "bfloat16")
    for (g, tg), (f, tf), (c, tc) in zip(gpu16, gpu32, cpu16, strict=True):
        np.testing.assert_array_equal(g, bfloat16_bits(f))
        np.testing.assert_array_equal(tg, tf)
        np.testing.assert_allclose(tg, tc, atol=1e-6)
        assert (g == c).mean() > 0.99
        np.testing.assert_allclose(BFloat16Array(g).to_float32(), BFloat16Array(c).to_float32(),
                                   rtol=2**-7, atol=1e-5)


# -- issue 32: the first real run --------------------------------------------------------
def test_kernels_compile_with_the_installed_toolkit():
    """CuPy compiles kernels.cu with what is installed (the gpu extra's headers and
    NVRTC), with its own options added to the backend's (-ftz=true among them)."""
    import cupy
    from echo_native.backends import cuda
    dev = cuda.CudaDevice(0)
    assert all(getattr(dev, f"_{name}") is not None for name in cuda.KERNELS)
    assemble = getattr(cupy._core.core, "assemble_cupy_compiler_options", None)
    if assemble is not None:  # CuPy >= 14.2: the include options it compiles with
        assert set(cuda.NVRTC_OPTIONS) <= set(assemble(cuda.NVRTC_OPTIONS))


def test_on_batch_runs_after_the_batch_on_the_gpu(source):
    """``on_batch`` changes each normalised batch in place while the pipeline's stream is
    slowed before every normalisation: the op still sees the finished batch (it runs
    on that stream), and the consumer sees the op's result, the CPU backend's."""
    from echo_native.backends.cuda import CudaDevice
    spin = _spin()

    class SlowDevice(CudaDevice):
        def normalize(self, images, mean, std, layout, out):
            with self.device, self.stream:
                spin((1,), (1,), (np.int64(10_000_000),))  # ~5 ms of our stream's time
            return super().normalize(images, mean, std, layout, out)

    def op(images, xp, keys):
        images *= xp.float32(2.0)
        images[:, 0] += xp.asarray(keys[:, 3].astype(np.float32)).reshape(-1, 1, 1)

    kw = dict(batch_size=8, image_size=32, echo=2, placement="after_augment", workers=2,
              seed=6, normalize=True, layout="NCHW", on_batch=op)
    with en.EchoRing(source, device="cpu", **kw) as ring:
        ref = [np.array(b.images, np.float32) for b in ring]
    with en.EchoRing(source, device=SlowDevice(0), **kw) as ring:
        got = [b.images.get() for b in ring]
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-5)


def test_the_memfd_ring_is_page_locked():
    """cudaHostRegister accepts the ring's memfd mapping: fresh slots are copied by DMA
    from the ring itself, not staged."""
    from echo_native.backends.cuda import CudaDevice
    from echo_native.ring import Ring
    ring = Ring.create(2, 8, 32 * 32 * 3, backing="memfd")
    dev = CudaDevice(0)
    try:
        assert ring.backing == "memfd"
        dev.attach(ring)
        assert dev.registration == "registered", dev.registration_error
    finally:
        dev.detach(ring)
        ring.unlink()


@real_gpu
@pytest.mark.parametrize("dtype", ["uint8", "float32", "bfloat16"])
def test_torch_and_jax_take_batches_on_the_gpu(source, dtype):
    """torch and JAX (on the GPU) receive each batch by DLPack on the device, with the
    values the CPU backend delivers."""
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    try:
        gpu = jax.devices("gpu")
    except RuntimeError:
        gpu = []
    norm = {} if dtype == "uint8" else dict(normalize=True, dtype=dtype, layout="NCHW")
    kw = dict(batch_size=8, image_size=32, echo=2, placement="after_augment", workers=2,
              seed=4, **norm)
    ref = _values(source, "cpu", **kw)
    rtol = 2**-7 if dtype == "bfloat16" else 1e-6
    got_t, got_j = [], []
    with en.EchoRing(source, device="cuda", **kw) as ring:
        for b in ring:
            t = torch.from_dlpack(b.images)
            assert t.is_cuda
            got_t.append(t.float().cpu().numpy())
            if gpu:
                j = jax.dlpack.from_dlpack(b.images, copy=True)
                assert j.devices() <= set(gpu)
                got_j.append(np.asarray(j.astype("float32")))
    assert gpu, "JAX sees no GPU: its batches could not be checked"
    for t, j, r in zip(got_t, got_j, ref, strict=True):
        np.testing.assert_allclose(t, r, rtol=rtol, atol=1e-6)
        np.testing.assert_allclose(j, r, rtol=rtol, atol=1e-6)


def test_a_cupy_consumer_on_a_stream_it_drops_reads_every_batch(source):
    """A consumer takes each batch on a new CuPy stream (``cupy.from_dlpack`` under
    ``with s``), reads it late there after a slow step, and drops the stream: the
    pipeline holds the stream while it may read, and the reads see the batches."""
    import cupy
    spin = _spin()
    kw = dict(batch_size=8, image_size=48, echo=1, workers=2, seed=3)
    ref = _values(source, "cpu", **kw)
    got, held = [], None
    with en.EchoRing(source, device="cuda", **kw) as ring:
        for b in ring:
            s = cupy.cuda.Stream(non_blocking=True)
            with s:
                x = cupy.from_dlpack(b.images)
            if held is not None:
                px, ps = held
                with ps:  # a slow step, then the read: both queued, not waited for
                    spin((1,), (1,), (np.int64(10_000_000),))
                    got.append(px.astype(cupy.float32))
            held = (x, s)
            del s
        px, ps = held
        with ps:
            got.append(px.astype(cupy.float32))
    cupy.cuda.Device().synchronize()
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_array_equal(g.get(), r)

"""CUDA backend (echo_native/cuda.py).  These run only where CuPy finds a GPU; without
one they are skipped, and tests/test_device.py covers the same logic on NumPy."""

import echo_helpers
import numpy as np
import pytest

import echo_native as en
from echo_native.device import cuda_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")]


def _jpegs(n, seed=0):
    return echo_helpers.photo_jpegs(n, 280, 330, seed)


@pytest.fixture(scope="module")
def source():
    return en.Samples(_jpegs(64), np.arange(64) % 5)


def _run(source, device, **kw):
    import cupy
    args = dict(batch_size=16, image_size=64, workers=2, seed=7)
    args.update(kw)
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


def test_gpu_reaugmentation_matches_cpu(source):
    """before_augment crops made by the CUDA kernel equal the native CPU path within 2 levels."""
    cpu = _run(source, "cpu", echo=3, placement="before_augment")
    gpu = _run(source, "cuda", echo=3, placement="before_augment")
    for (a, ia, ea), (b, ib, eb) in zip(cpu, gpu, strict=True):
        np.testing.assert_array_equal(ia, ib)
        np.testing.assert_array_equal(ea, eb)
        diff = np.abs(a.astype(int) - b)
        assert diff.max() <= 2 and diff.mean() < 0.3


def test_slot_reuse_waits_for_copies_under_slow_consumer(source):
    """A consumer stream kept busy never sees a batch overwritten by slot reuse."""
    import cupy
    spin = cupy.RawKernel(r'''
    extern "C" __global__ void spin(long long cycles) {
        long long t0 = clock64();
        while (clock64() - t0 < cycles) {}
    }''', "spin")
    ref = _run(source, "cpu", echo=1, batch_size=8, image_size=32)
    sums = []
    with en.EchoRing(source, batch_size=8, image_size=32, echo=1, workers=2, seed=7,
                     device="cuda", slots=2) as ring:
        for b in ring:
            spin((1,), (1,), (np.int64(20_000_000),))  # ~10 ms on the consumer's stream
            sums.append(int(b.images.astype(cupy.int64).sum()))
    cupy.cuda.get_current_stream().synchronize()
    assert sums == [int(a.astype(np.int64).sum()) for a, _, _ in ref]


def test_dlpack_interop_without_copy(source):
    """torch and cupy take batches by DLPack without copying."""
    torch = pytest.importorskip("torch")
    import cupy
    with en.EchoRing(source, batch_size=8, image_size=32, echo=2, workers=1,
                     device="cuda") as ring:
        b = next(iter(ring))
        t = torch.from_dlpack(b.images)
        assert t.is_cuda and t.data_ptr() == b.images.data.ptr
        c = cupy.from_dlpack(b.images)
        assert c.data.ptr == b.images.data.ptr
        assert int(t.sum()) == int(b.images.astype(cupy.int64).sum())


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

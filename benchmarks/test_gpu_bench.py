"""GPU benchmarks (CUDA backend): copy bandwidth, re-augmentation rate, delivered rate.

    bash benchmarks/gpu_check.sh        # GPU tests + this file, JSON in $OUT or /tmp

Skipped without CuPy and a CUDA device.
"""
import io
import time

import numpy as np
import pytest
from PIL import Image

import echo_native as en
from echo_native.device import cuda_available

pytestmark = pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")


def _jpegs(n):
    import skimage.data as sd
    photos = [sd.astronaut(), sd.coffee(), sd.chelsea(), sd.rocket()]
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        p = photos[i % 4]
        y, x = rng.integers(0, 100, 2)
        b = io.BytesIO()
        Image.fromarray(p[y:y + 360, x:x + 400]).save(b, "JPEG", quality=90)
        out.append(b.getvalue())
    return out


def _bandwidth(host, dev, stream, reps=20):
    dev.set(host, stream=stream)
    stream.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        dev.set(host, stream=stream)
    stream.synchronize()
    return reps * host.nbytes / (time.perf_counter() - t) / 1e9


@pytest.mark.benchmark(group="gpu")
def test_h2d_bandwidth_registered_vs_pinned(benchmark):
    """Host->device GB/s from registered ring memory vs a pinned buffer (the peak)."""
    import cupy
    import cupyx
    from echo_native.ring import Ring
    nbytes = 256 * 224 * 224 * 3
    ring = Ring.create(2, 256, 224 * 224 * 3)
    try:
        stream = cupy.cuda.Stream(non_blocking=True)
        dev = cupy.empty(nbytes, cupy.uint8)
        pinned = cupyx.empty_pinned(nbytes, np.uint8)
        peak = _bandwidth(pinned, dev, stream)
        slot = ring.slots[0].pixels.reshape(-1)[:nbytes]
        rt = cupy.cuda.runtime
        base = np.frombuffer(ring.buf, np.uint8)
        rt.hostRegister(base.ctypes.data, base.nbytes, rt.hostRegisterPortable)
        try:
            registered = benchmark.pedantic(_bandwidth, args=(slot, dev, stream), rounds=3)
        finally:
            rt.hostUnregister(base.ctypes.data)
        pageable = _bandwidth(np.ones(nbytes, np.uint8), dev, stream)
    finally:
        ring.unlink()
    benchmark.extra_info.update(peak_pinned_GBps=peak, registered_GBps=registered,
                                pageable_GBps=pageable, ratio_to_peak=registered / peak)
    print(f"\nH2D: registered ring {registered:.1f} GB/s, pinned peak {peak:.1f} GB/s "
          f"({registered / peak:.0%}), pageable {pageable:.1f} GB/s")


@pytest.mark.benchmark(group="gpu")
def test_gpu_reaugmentation_rate(benchmark):
    """Images/s of the crop_resize kernel at 224x224 from 256-sample canvas batches."""
    import cupy
    from echo_native.cuda import CudaDevice
    from echo_native.echo import ExampleBuffer
    dev = CudaDevice(0)
    buf = ExampleBuffer(1024, 300 * 400 * 3, cupy)
    buf.pixels[...] = cupy.random.randint(0, 256, buf.pixels.shape, dtype=cupy.uint8)
    buf.shape[:] = (300, 400)
    rng = np.random.default_rng(0)
    B = 256
    out = cupy.empty((B, 224, 224, 3), cupy.uint8)
    entries = rng.choice(1024, B, replace=False)
    boxes = np.array([en.random_resized_crop_params(0, 0, int(i), 0, 300, 400)[0] for i in entries],
                     np.float64)
    flips = rng.integers(0, 2, B).astype(bool)

    def run():
        for _ in range(10):
            dev.crop_resize(buf, entries, boxes, flips, out)
        dev.stream.synchronize()

    run()
    benchmark.pedantic(run, rounds=5)
    rate = 10 * B / benchmark.stats.stats.min
    benchmark.extra_info["images_per_s"] = rate
    print(f"\nGPU re-augmentation: {rate:,.0f} img/s at 224x224 (target >= 50,000)")


@pytest.mark.parametrize("placement", ["before_augment", "after_augment", "batch"])
@pytest.mark.parametrize("echo", [1, 2, 4])
@pytest.mark.benchmark(group="gpu-delivered")
def test_delivered_rate(benchmark, placement, echo):
    """Delivered images/s with a consumer kernel of fixed duration (upstream-bound)."""
    import cupy
    if echo == 1 and placement != "after_augment":
        pytest.skip("echo=1 is the same pass-through for every placement")
    spin = cupy.RawKernel(r'''
    extern "C" __global__ void spin(long long cycles) {
        long long t0 = clock64();
        while (clock64() - t0 < cycles) {}
    }''', "spin")
    src = en.Samples(_jpegs(256), np.arange(256) % 10)

    def epoch():
        n = 0
        with en.EchoRing(src, batch_size=64, image_size=224, echo=echo, placement=placement,
                         workers=8, device="cuda") as ring:
            for b in ring:
                spin((1,), (1,), (np.int64(2_000_000),))  # ~1 ms "training step"
                n += len(b)
            cupy.cuda.get_current_stream().synchronize()
        return n

    n = benchmark.pedantic(epoch, rounds=2)
    benchmark.extra_info["images_per_s"] = n / benchmark.stats.stats.min

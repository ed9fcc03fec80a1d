"""Output types: bfloat16 batches (``BFloat16Array``: rounding as torch rounds,
DLPack export without a copy, capsule ownership, conversion to NumPy)."""

import echo_helpers
import numpy as np
import pytest

import echo_native as en
from echo_native.output import BFloat16Array, bfloat16_bits


def _jpegs(n, seed=0):
    return echo_helpers.photo_jpegs(n, 280, 330, seed)


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

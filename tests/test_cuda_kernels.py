"""The CUDA kernels (src/kernel/kernels.cu) checked without a GPU.

Two independent routes: NVRTC, the compiler CuPy uses at run time, must
accept the source for the GPUs we target; and the same source, built by the
host C++ compiler with tests/cuda_host.cpp, runs every thread of a launch on
the CPU, so its arithmetic is compared with the native resampler, the NumPy
backend, NumPy's float16 and torch's bfloat16 rounding.
"""
import ctypes
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

import echo_native as en
import fake_cupy
from echo_native import _kernel
from echo_native.backends import cuda
from echo_native.backends.array import ArrayDevice
from echo_native.backends.cpu import CpuDevice
from echo_native.output import bfloat16_bits, output_dtype
from echo_native.echo.images import ImageStore

HERE = os.path.dirname(__file__)
# kernels.cu and the op-code header it includes.
PACKAGE = os.path.join(os.path.dirname(HERE), "src", "kernel")
u8p = np.ctypeslib.ndpointer(np.uint8, flags="C")


# -- the kernels, run on the CPU ------------------------------------------------------------
class HostKernels:
    """kernels.cu compiled for the host; launches use the CUDA backend's own grids."""

    def __init__(self, path):
        lib = ctypes.CDLL(path)
        p, dim = ctypes.c_void_p, ctypes.c_ulonglong
        lib.host_crop_resize.argtypes = [dim] * 3 + [p, ctypes.c_int64, p, p, p, p,
                                                     ctypes.c_int, ctypes.c_int, p]
        lib.host_normalize.argtypes = [dim] * 3 + [p, ctypes.c_int64, ctypes.c_int,
                                                   ctypes.c_int, p, ctypes.c_int, p]
        lib.host_crop_resize.restype = lib.host_normalize.restype = ctypes.c_int
        for name in ("host_half_array", "host_bfloat16_array"):
            getattr(lib, name).argtypes = [p, p, ctypes.c_int64]
        i32, i64 = ctypes.c_int, ctypes.c_int64
        lib.host_ops_histogram.argtypes = [dim] * 3 + [p, i64, i32, p, i32, i32, p]
        lib.host_ops_tables.argtypes = [dim] * 3 + [p, p, i32, i32, i64, i32, p, p]
        lib.host_ops_apply.argtypes = [dim] * 3 + [p, p, i64, i32, i32, p, p, i32, i32, p]
        for name in ("host_ops_histogram", "host_ops_tables", "host_ops_apply"):
            getattr(lib, name).restype = ctypes.c_int
        self.lib = lib

    def crop_resize(self, buffer, entries, boxes, flips, out):
        n, oh, ow = len(entries), out.shape[1], out.shape[2]
        grid, (bx,) = cuda.crop_resize_launch(n, oh, ow)
        gx, gy = (tuple(grid) + (1,))[:2]
        entries = np.ascontiguousarray(entries, np.int64)
        shapes = np.ascontiguousarray(buffer.shape[entries], np.int32)
        boxes = np.ascontiguousarray(boxes, np.float64)
        flips = np.ascontiguousarray(flips, np.uint8)
        assert out.flags.c_contiguous and buffer.pixels.flags.c_contiguous
        rc = self.lib.host_crop_resize(gx, gy, bx, buffer.pixels.ctypes.data,
                                       buffer.pixels.shape[1], entries.ctypes.data,
                                       shapes.ctypes.data, boxes.ctypes.data, flips.ctypes.data,
                                       oh, ow, out.ctypes.data)
        assert rc == 0, f"launch refused: grid {grid}, block {bx} (beyond CUDA's limits)"

    def normalize(self, images, mean, std, layout, out):
        n, h, w, _ = images.shape
        (gx,), (bx,) = cuda.normalize_launch(n * h * w)
        coef = cuda.normalize_coefficients(mean, std)
        kind = cuda.NORMALIZE_KIND[output_dtype(out)]
        images = np.ascontiguousarray(images)
        rc = self.lib.host_normalize(gx, 1, bx, images.ctypes.data, n * h * w, h * w,
                                     int(layout == "NCHW"), coef.ctypes.data, kind,
                                     out.ctypes.data)
        assert rc == 0, f"launch refused: grid {gx}, block {bx} (beyond CUDA's limits)"
        return out

    def augment(self, images, codes, args):
        """CudaDevice.augment's launches, step by step over the whole batch (the CPU
        path runs image by image): the same plan, grids, buffers and final copy."""
        _kernel.check_ops(codes, args, images.shape)
        n, h, w, _ = images.shape
        steps = codes.shape[1]
        (gx,), (bx,) = cuda.ops_pixel_launch(n, h, w)
        (tx,), (tb,) = cuda.ops_table_launch(n)
        hist = np.empty((n, 3, 256), np.int32)
        luts = np.full((n, 3, 256), 0xA5, np.uint8)  # read only where written: else it shows
        src, dst = images, np.full_like(images, 0x5A)
        for k, count, tables in cuda.ops_steps(codes):
            if count:
                hist[...] = 0
                rc = self.lib.host_ops_histogram(gx, 1, bx, src.ctypes.data, n * h * w, h * w,
                                                 codes.ctypes.data, steps, k, hist.ctypes.data)
                assert rc == 0
            if tables:
                rc = self.lib.host_ops_tables(tx, 1, tb, codes.ctypes.data, args.ctypes.data,
                                              steps, k, n, h * w, hist.ctypes.data,
                                              luts.ctypes.data)
                assert rc == 0
            rc = self.lib.host_ops_apply(gx, 1, bx, src.ctypes.data, dst.ctypes.data, n * h * w,
                                         h, w, codes.ctypes.data, args.ctypes.data, steps, k,
                                         luts.ctypes.data)
            assert rc == 0
            src, dst = dst, src
        if src is not images:
            images[...] = src
        return images

    def convert(self, name, values):
        values = np.ascontiguousarray(values, np.float32)
        out = np.empty(values.shape, np.uint16)
        getattr(self.lib, f"host_{name}_array")(values.ctypes.data, out.ctypes.data, values.size)
        return out


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a host C++ compiler (g++)")
    lib = str(tmp_path_factory.mktemp("cuda_host") / "cuda_host.so")
    # -ffp-contract=off: no fused multiply-add beyond the fmaf the source asks for.
    subprocess.run([cxx, "-std=c++14", "-O2", "-ffp-contract=off", "-Wall", "-Werror",
                    "-shared", "-fPIC", f"-I{PACKAGE}", os.path.join(HERE, "cuda_host.cpp"),
                    "-o", lib], check=True, capture_output=True)
    return HostKernels(lib)


def _photo(name):
    import skimage.data as sd
    img = getattr(sd, name)()
    return np.ascontiguousarray(np.stack([img] * 3, -1) if img.ndim == 2 else img)


def _buffer(canvases, slots=None):
    """An echo buffer holding ``canvases`` in entries ``slots`` (in order by default)."""
    slots = list(range(len(canvases))) if slots is None else slots
    buf = ImageStore(max(slots) + 1, max(c.size for c in canvases))
    buf.pixels[...] = 77  # whatever lies past a canvas must never be read
    for s, c in zip(slots, canvases):
        buf.pixels[s, :c.size] = c.reshape(-1)
        buf.shape[s] = c.shape[:2]
    return buf


def _boxes(rng, shapes):
    """Random crops the way echoes draw them, plus the awkward ones: a sliver, a
    single pixel, the whole canvas, a box touching the far corner."""
    out = []
    for i, (h, w) in enumerate(shapes):
        kind = i % 5
        if kind == 0:
            bh, bw = rng.uniform(0.3, 1) * h, rng.uniform(0.3, 1) * w
            out.append((rng.uniform(0, h - bh), rng.uniform(0, w - bw), bh, bw))
        elif kind == 1:
            out.append((rng.uniform(0, h - 3), rng.uniform(0, w - 3), 2.5, rng.uniform(1, 3)))
        elif kind == 2:
            out.append((0.0, 0.0, float(h), float(w)))
        elif kind == 3:
            out.append((h - 40.25, w - 17.5, 40.25, 17.5))
        else:
            out.append((rng.integers(0, h - 1), rng.integers(0, w - 1), 1.0, 1.0))
    return np.array(out, np.float64)


@pytest.mark.parametrize("size", [(224, 224), (37, 61), (300, 160)])
def test_crop_resize_kernel_matches_native_resampler(host, size):
    """Shrinking, enlarging and mixed: the kernel stays within 2 levels of the
    Pillow-exact native path (it rounds once, Pillow twice) and agrees with the
    NumPy backend's one-pass float version more closely still."""
    rng = np.random.default_rng(sum(size))
    canvases = [_photo(n) for n in ("astronaut", "coffee", "chelsea", "rocket", "camera")]
    slots = [4, 0, 3, 1, 2]  # entry order differs from canvas order
    buf = _buffer(canvases, slots)
    entries = np.array(slots * 2)
    boxes = _boxes(rng, [buf.shape[e] for e in entries])
    flips = np.arange(len(entries)) % 3 == 1
    got = np.empty((len(entries),) + size + (3,), np.uint8)
    native = np.empty_like(got)
    generic = np.empty_like(got)
    host.crop_resize(buf, entries, boxes, flips, got)
    cpu = CpuDevice()
    cpu.crop_resize(buf, entries, boxes, flips, native)
    cpu.synchronize()  # the host device re-augments in the background
    ArrayDevice(np).crop_resize(buf, entries, boxes, flips, generic)
    d_native = np.abs(got.astype(int) - native)
    d_generic = np.abs(got.astype(int) - generic)
    assert d_native.max() <= 2 and d_native.mean() < 0.3
    assert d_generic.max() <= 1 and d_generic.mean() < 0.05


def test_crop_resize_kernel_flip_is_an_exact_mirror(host):
    """The flipped emission is exactly the mirror of the unflipped one."""
    buf = _buffer([_photo("coffee")])
    boxes = np.array([[13.7, 40.2, 250.3, 301.9]] * 2)
    out = np.empty((2, 96, 128, 3), np.uint8)
    host.crop_resize(buf, np.array([0, 0]), boxes, np.array([False, True]), out)
    np.testing.assert_array_equal(out[1], out[0][:, ::-1])


def test_crop_resize_kernel_takes_batches_beyond_65535(host):
    """A batch of 65,537 images (one more than gridDim.y holds) is launched within CUDA's
    limits and every image is written, the last ones included."""
    canvases = [_photo(n)[:6, :8] for n in ("astronaut", "coffee", "chelsea")]
    buf = _buffer(canvases)
    n = 65_537
    entries = np.arange(n) % 3
    boxes = np.array([[0.0, 0.0, 6.0, 8.0], [1.0, 2.0, 4.0, 5.0], [0.5, 0.0, 5.5, 8.0]])
    boxes = boxes[entries]
    flips = (np.arange(n) // 3) % 2 == 1
    out = np.full((n, 1, 2, 3), 7, np.uint8)
    host.crop_resize(buf, entries, boxes, flips, out)
    first = np.empty((6, 1, 2, 3), np.uint8)
    host.crop_resize(buf, entries[:6], boxes[:6], flips[:6], first)
    np.testing.assert_array_equal(out, np.tile(first, (-(-n // 6), 1, 1, 1))[:n])
    assert (first != 7).any()


def test_crop_resize_kernel_identity_box_is_exact(host):
    """A whole-canvas box at the canvas size gives back the canvas, byte for byte."""
    img = _photo("chelsea")
    h, w = img.shape[:2]
    out = np.empty((1, h, w, 3), np.uint8)
    host.crop_resize(_buffer([img]), np.array([0]), np.array([[0.0, 0.0, h, w]]),
                     np.array([False]), out)
    np.testing.assert_array_equal(out[0], img)


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_normalize_kernel_is_one_rounding_of_the_exact_value(host, layout, dtype):
    """x * scale + shift with a single rounding to float32, then to the output type with
    round-to-nearest-even: the same bits as NumPy's float16 and torch's bfloat16."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    x = rng.integers(0, 256, (3, 7, 5, 3), dtype=np.uint8)
    x[0, 0, 0] = (0, 128, 255)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    coef = cuda.normalize_coefficients(mean, std).astype(np.float64)
    exact = (x * coef[:3] + coef[3:]).astype(np.float32)  # float64 holds it exactly
    if layout == "NCHW":
        exact = exact.transpose(0, 3, 1, 2)
    shape = exact.shape
    out = np.empty(shape, np.uint16 if dtype == "bfloat16" else dtype)
    host.normalize(x, mean, std, layout, out)
    if dtype == "float32":
        np.testing.assert_array_equal(out, exact)
    elif dtype == "float16":
        np.testing.assert_array_equal(out.view(np.uint16), exact.astype(np.float16).view(np.uint16))
    else:
        ref = torch.from_numpy(np.ascontiguousarray(exact)).to(torch.bfloat16).view(torch.int16)
        np.testing.assert_array_equal(out.view(np.int16), ref.numpy())
    # The NumPy backend rounds twice (multiply, then add): within an ulp of float32.
    generic = ArrayDevice(np).normalize(x, mean, std, layout, np.empty(shape, np.float32))
    np.testing.assert_allclose(generic, exact, rtol=2e-7, atol=2e-7)


def _awkward_floats(n, seed):
    """Random bit patterns (every exponent, both signs, NaN and inf), plus the
    values at the edges of float16's and bfloat16's ranges and rounding ties."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0.0, -0.0, 1.0, 65504.0, 65519.99, 65520.0, 65536.0, 2.0**-14,
                      2.0**-24, 2.0**-25, 1.5 * 2.0**-25, 2.0**-26, 6.0e-8, np.inf, -np.inf,
                      1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8,
                      3.4e38, -2.75], np.float32)
    near = (edges.view(np.uint32)[:, None] + np.arange(-2, 3, dtype=np.int64)).ravel()
    return np.concatenate([bits.view(np.float32), edges,
                           (near % 2**32).astype(np.uint32).view(np.float32)])


def test_half_conversion_matches_numpy(host):
    """float32 -> float16 bits as NumPy's astype (round to nearest even), NaN stays NaN."""
    f = _awkward_floats(1_000_000, 0)
    got = host.convert("half", f)
    with np.errstate(over="ignore", invalid="ignore"):
        ref = f.astype(np.float16).view(np.uint16)
    nan = np.isnan(f)
    np.testing.assert_array_equal(got[~nan], ref[~nan])
    assert np.isnan(got[nan].view(np.float16)).all()


def test_bfloat16_conversion_matches_torch(host):
    """float32 -> bfloat16 bits as torch rounds them, in the kernel and in the NumPy
    backend; NaN stays NaN."""
    torch = pytest.importorskip("torch")
    f = _awkward_floats(1_000_000, 1)
    got = host.convert("bfloat16", f)
    ref = torch.from_numpy(f).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(f)
    np.testing.assert_array_equal(got[~nan], ref[~nan])
    np.testing.assert_array_equal(bfloat16_bits(f[~nan]), ref[~nan])
    assert np.isnan((got[nan].astype(np.uint32) << 16).view(np.float32)).all()


@pytest.mark.parametrize("h,w,n,steps", [(1, 1, 13, 2), (2, 5, 7, 3), (3, 3, 13, 1),
                                          (23, 37, 9, 4), (48, 40, 6, 5)])
def test_ops_kernels_are_the_cpu_paths_bytes(host, h, w, n, steps):
    """The augmentation programs launched as CudaDevice.augment launches them (per step,
    the whole batch, histogram atomics, one table thread per channel) give exactly the
    bytes of _kernel.apply_ops (the same source run image by image): every op, odd and
    even step counts, a step no row uses, images smaller than the sharpness window."""
    from test_ops_kernels import batch, random_programs
    rng = np.random.default_rng(h * w + steps)
    x = batch(h=h, w=w, noise=2, seed=steps)
    x = np.ascontiguousarray(np.resize(x, (n, h, w, 3)))
    codes, args = random_programs(rng, n, steps, h, w)
    if steps > 2:
        codes[:, 1] = 0  # no launch at all for this step
    ref = x.copy()
    _kernel.apply_ops(ref, codes, args)
    got = host.augment(x.copy(), codes, args)
    np.testing.assert_array_equal(got, ref)
    assert (got != x).any()


def test_ops_launches_follow_the_program():
    """Only the steps some row uses are launched; the histogram only where some row's op
    counts, the tables only where some row's op is a table."""
    from echo_native._kernel import Op as op
    codes = np.array([[op.NONE, op.HUE, op.CONTRAST, op.POSTERIZE],
                      [op.NONE, op.NONE, op.NONE, op.ERASE]], np.int32)
    assert list(cuda.ops_steps(codes)) == [(1, False, False), (2, True, True), (3, False, True)]
    assert cuda.ops_pixel_launch(128, 224, 224) == ((25088,), (256,))
    assert cuda.ops_table_launch(128) == ((2,), (256,))


# -- the kernels through NVRTC ---------------------------------------------------------------
def _nvrtc():
    """libnvrtc from the nvidia-cuda-nvrtc wheel (a test dependency on Linux) or the system."""
    lib = fake_cupy.nvrtc_library()
    if lib is None:
        pytest.skip("needs NVRTC: pip install nvidia-cuda-nvrtc-cu12 (in the test extra on Linux)")
    return lib


def test_nvrtc_found_beside_cuda13_wheels():
    """Where a CUDA build of torch brought NVIDIA's CUDA 13 wheels (nvidia/cu13/lib, whose
    builtins library is not on the loader's path) beside the test extra's CUDA 12 NVRTC,
    the NVRTC found is one that compiles: each candidate's builtins are loaded from its
    own folder, and a candidate that still cannot compile gives way to the next."""
    import glob

    nvidia = pytest.importorskip("nvidia", reason="no NVIDIA wheels in this environment")
    cu13 = [p for d in nvidia.__path__
            for p in glob.glob(os.path.join(d, "**", "libnvrtc.so.13*"), recursive=True)]
    if not cu13:
        pytest.skip("no CUDA 13 NVRTC wheel here (CI's CUDA venv has one)")
    lib = fake_cupy.nvrtc_library()
    assert lib is not None
    ptx, log = _compile(lib, 'extern "C" __global__ void k(float *x) { x[0] = 1.0f; }',
                        ["-arch=compute_90"])
    assert ptx and ".entry k(" in ptx, log


def _compile(lib, source, options):
    return fake_cupy.nvrtc_compile(lib, source, options)


def _options(arch="90", options=cuda.NVRTC_OPTIONS):
    """What CuPy compiles ``RawModule(options=options)`` with for compute capability
    ``arch`` (as PTX, to read it here): the backend's options and CuPy's own,
    ``-ftz=true`` among them."""
    return list(fake_cupy.cupy_options(options, arch, virtual=True))


@pytest.mark.parametrize("arch", ["75", "80", "90"])
def test_kernels_compile_with_nvrtc(arch):
    """The source CuPy compiles at run time builds, with the options CuPy compiles it
    with and without warnings, for Turing, Ampere and Hopper, and exports every
    kernel it declares under its C name (the augmentation programs' ones among them)."""
    lib = _nvrtc()
    ptx, log = _compile(lib, cuda.kernel_source(), _options(arch))
    assert ptx is not None, log
    assert "warning" not in log.lower(), log
    names = re.findall(r'extern "C" __global__ void (\w+)\(', cuda.kernel_source())
    assert set(cuda.KERNELS) <= set(names)
    for name in names:
        assert f".entry {name}(" in ptx


def _float_ops(ptx, entry, ops=("fma", "mad")):
    """The floating-point instructions ``ops`` in the PTX of kernel ``entry``."""
    body = ptx.split(f".entry {entry}(", 1)[1].split(".entry ", 1)[0]
    return re.findall(rf"\b(?:{'|'.join(ops)})(?:\.(?:rn|rz|rm|rp|approx|full))?(?:\.ftz)?"
                      rf"(?:\.sat)?\.f(?:32|64)\b", body)


def test_device_arithmetic_is_the_host_builds():
    """Under the options CuPy really compiles with (-ftz=true added to the backend's
    --fmad=false), NVRTC fuses no multiply and add of its own: crop_resize and the
    augmentation programs' kernels have no floating-point fma at all, normalize only
    the fmaf its source writes; no division, reciprocal or square root is
    approximate.  That is the host build's arithmetic (-ffp-contract=off, IEEE
    division); -ftz flushes subnormal float32 values, which pixels, weights and
    their products never are.  NVRTC's default would fuse in crop_resize and
    ops_apply."""
    lib = _nvrtc()
    options = _options("80")
    assert "-ftz=true" in options and "--fmad=false" in options
    ptx, log = _compile(lib, cuda.kernel_source(), options)
    assert ptx is not None, log
    assert _float_ops(ptx, "crop_resize") == []
    assert set(_float_ops(ptx, "normalize")) == {"fma.rn.ftz.f32"}
    # The programs write no fmaf (the host's portable build has no fma instruction):
    # none at all, in float or in ops_mean's double sums.
    for name in cuda.KERNELS:
        if name != "normalize":
            assert _float_ops(ptx, name) == [], name
        inexact = [op for op in _float_ops(ptx, name, ("div", "rcp", "sqrt"))
                   if ".approx" in op or ".full" in op]
        assert inexact == [], (name, inexact)
    default, log = _compile(lib, cuda.kernel_source(),
                            _options("80", [o for o in cuda.NVRTC_OPTIONS if "fmad" not in o]))
    assert _float_ops(default, "crop_resize"), "NVRTC's default no longer fuses: recheck"
    assert _float_ops(default, "ops_apply"), "NVRTC's default no longer fuses: recheck"


def test_the_nvrtc_options_are_cupys():
    """The options the tests compile with are those of the installed CuPy's compiler
    (cupy/cuda/compiler.py): it appends -ftz=true and --device-as-default-execution-space
    to every RawModule's."""
    import importlib.util
    spec = importlib.util.find_spec("cupy")
    if spec is None or spec.origin is None:
        pytest.skip("CuPy is not installed here: checked where it is (benchmarks/gpu_check.sh)")
    text = open(os.path.join(os.path.dirname(spec.origin), "cuda", "compiler.py")).read()
    for option in fake_cupy.CUPY_ADDED_OPTIONS + fake_cupy.CUPY_NVRTC_OPTIONS:
        assert f"options += ('{option}',)" in text, option


def test_nvrtc_reports_errors():
    """The compile check above can fail: a broken kernel is refused with its line."""
    lib = _nvrtc()
    ptx, log = _compile(lib, cuda.kernel_source() + "\nextern \"C\" __global__ void k() { x; }\n",
                        _options("80"))
    assert ptx is None and "identifier \"x\" is undefined" in log

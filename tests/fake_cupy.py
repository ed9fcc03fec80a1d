"""A strict stand-in for the part of CuPy the CUDA backend uses, with a checker of
stream order.

``install(monkeypatch)`` puts a fresh ``cupy`` and ``cupyx`` into ``sys.modules``
and returns the :class:`Gpu` behind them, so that the real
:class:`echo_native.backends.cuda.CudaDevice` runs through a real ``EchoRing``
on a machine without a GPU.  Memory is NumPy; what is checked is *order*, and
that every call is one real CuPy would accept:

- every stream keeps a vector clock: an operation on it ticks its own entry,
  ``eventRecord`` copies the clock into the event, ``streamWaitEvent`` merges
  the event's clock into the waiting stream.  Operation A happens before B
  exactly when B's clock has seen A's tick.
- every access to device memory (a copy in, a kernel, an indexed read or
  write, an in-place update: ``*=``, ``+=``, ``fill``, setitem, a consumer's
  read) is logged with its stream and clock.  Two accesses to overlapping
  memory on different streams, one of them a write, must be ordered the way
  the host issued them, by the streams or by a host wait for the first before
  the second was issued; where not, the checker appends a line to
  ``Gpu.violations`` (a data race on a real GPU).
- the GPU runs nothing until the host waits for it: an event is ``done`` only
  after a host wait covered it (``Event.synchronize``, ``Stream.synchronize``,
  ``get()``, a conversion to a Python scalar).  Every host wait is logged in
  ``Gpu.syncs``.  ``hostUnregister`` of memory that a copy not yet waited for
  reads from is a violation, and so is a write into a pinned buffer
  (``cupyx.empty_pinned``) while a copy out of it may still run, and an
  asynchronous copy from memory that is neither pinned nor registered.
- memory comes from a pool with one arena per (device, stream handle), as
  CuPy's: an array freed (garbage-collected) goes back to the arena of the
  handle it was allocated under, and the next allocation there may get the
  same memory.  A stream is destroyed when its last reference goes, and CUDA
  hands its handle to the next stream made: using a destroyed handle is
  ``cudaErrorInvalidResourceHandle`` (and a violation); a reused one names the
  new stream, and its arena holds the old stream's freed memory.
- the CUDA rules for several devices: an event is recorded on a stream of the
  device it was created on (else ``cudaErrorInvalidResourceHandle``), a kernel
  runs on a stream of the current device and on memory of that device.
- what CuPy refuses, refused: implicit conversion to NumPy
  (``np.asarray(x)``, a NumPy array in arithmetic with a device array:
  TypeError), ``set`` of another shape or dtype or into a non-contiguous
  array, ``ascontiguousarray`` of a host array, a grid or block that is not a
  tuple, and kernel arguments that do not match the parameter list of the
  compiled kernel (its ``extern "C" __global__`` signature: a device array of
  the pointee's type for a pointer, a NumPy scalar of the parameter's type
  for a value).
- ``RawModule`` compiles the source with NVRTC (the ``nvidia-cuda-nvrtc-cu12``
  wheel) with the options CuPy 14 adds (:func:`cupy_options`), and needs the
  CUDA headers as CuPy 14 does (``Gpu.cuda_headers = None`` hides them:
  "Failed to find CUDA headers").  Kernels run on the host: the same source
  built by the host C++ compiler through ``tests/cuda_host.cpp``, each launch
  walking its grid one thread at a time.

The consumer side is played by the tests: ``Gpu.stream(device)`` makes a
stream, ``Gpu.read(batch_images, stream)`` logs a read of a batch on it, as a
training step queued there would do.
"""
from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import glob
import hashlib
import itertools
import math
import operator
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import types
import weakref
from dataclasses import dataclass, field

import numpy as np

from echo_native import _dlpack

HERE = os.path.dirname(os.path.abspath(__file__))
#: CUDA's limits: gridDim.x, .y, .z and threads per block.
MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_BLOCK = 1024
#: cudaErrorInvalidValue, cudaErrorInvalidDevice, cudaErrorInvalidResourceHandle,
#: cudaErrorNotSupported.
INVALID_VALUE, INVALID_DEVICE, INVALID_HANDLE, NOT_SUPPORTED = 1, 101, 400, 801
#: What CuPy 14 adds to a RawModule's options (cupy/cuda/compiler.py):
#: ``_compile_with_cache_cuda`` appends ``-ftz=true``, ``_compile_using_nvrtc``
#: the architecture and ``--device-as-default-execution-space``; the C++ standard
#: is C++17 unless the options name one.  (Its include options, CCCL's and its
#: own headers, are left out: the kernels include no header.)
CUPY_ADDED_OPTIONS = ("-ftz=true",)
CUPY_NVRTC_OPTIONS = ("--device-as-default-execution-space",)
CUPY_DEFAULT_STD = "-std=c++17"
#: The architecture of the stand-in's devices (an H200's).
COMPUTE_CAPABILITY = "90"
#: CuPy's message when an array would be converted to NumPy implicitly.
IMPLICIT = ("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to "
            "construct a NumPy array explicitly.")


class CUDARuntimeError(RuntimeError):
    def __init__(self, status, what=""):
        self.status = status
        super().__init__(f"cudaError {status}{': ' + what if what else ''}")


class CompileException(Exception):
    """NVRTC refused the source (CuPy's cupy.cuda.compiler.CompileException)."""


# -- NVRTC, as CuPy runs it ---------------------------------------------------------------
def nvrtc_library():
    """libnvrtc from NVIDIA's wheels (cuda_nvrtc/lib for 12, cu13/lib for 13) or the
    system, the first that really compiles a kernel; None where none does.

    NVRTC loads ``libnvrtc-builtins`` by name at its first compile, and a wheel's
    ``lib`` folder is not on the loader's path: the builtins beside each candidate are
    loaded first (global symbols, so NVRTC's own ``dlopen`` finds them), and a
    candidate whose compile still fails (a CUDA 13 NVRTC beside a 12 one, a driver-less
    stub) gives way to the next."""
    candidates = []
    try:
        import nvidia  # namespace package of NVIDIA's wheels
        for d in nvidia.__path__:
            candidates += sorted(glob.glob(os.path.join(d, "**", "libnvrtc.so*"),
                                           recursive=True))
    except ImportError:
        pass
    found = ctypes.util.find_library("nvrtc")
    if found:
        candidates.append(found)
    for c in candidates:
        if "builtins" in c or ".alt." in c:
            continue
        folder = os.path.dirname(c)
        for builtins in sorted(glob.glob(os.path.join(folder, "libnvrtc-builtins.so*"))):
            if ".alt." in builtins:
                continue
            try:
                ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                pass
        try:
            lib = ctypes.CDLL(c)
        except OSError:
            continue
        try:
            ptx, _ = nvrtc_compile(lib, 'extern "C" __global__ void probe(int *x) { *x = 1; }',
                                   ["-arch=compute_75"], name="probe.cu")
        except (RuntimeError, OSError, AttributeError):
            continue
        if ptx:
            return lib
    return None


def nvrtc_compile(lib, source, options, name="kernels.cu"):
    """``(ptx or None, log)``: ``source`` compiled by NVRTC with ``options`` (PTX only
    for a virtual architecture, ``-arch=compute_XX``; an empty string for a real one)."""
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None,
                                None)
    if rc != 0:
        raise RuntimeError(f"nvrtcCreateProgram: {rc}")
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if rc != 0:
            return None, log.value.decode()
        if not any(o.startswith(("-arch=compute_", "--gpu-architecture=compute_"))
                   for o in options):
            return "", log.value.decode()
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, ptx)
        return ptx.value.decode(), log.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def cuda_header_dir():
    """Where CuPy 14 (through cuda-pathfinder) would find the CUDA runtime headers, or
    None: CUDA_PATH / CUDA_HOME, NVIDIA's wheels, /usr/local/cuda."""
    roots = [os.path.join(os.environ[v], "include") for v in ("CUDA_PATH", "CUDA_HOME")
             if os.environ.get(v)]
    for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                 *[p for p in sys.path if p.endswith("-packages")]}:
        roots += [os.path.join(site, "nvidia", "cu13", "include"),
                  os.path.join(site, "nvidia", "cuda_runtime", "include")]
    roots.append("/usr/local/cuda/include")
    for r in roots:
        if os.path.isfile(os.path.join(r, "cuda_runtime.h")):
            return r
    return None


def cupy_options(options, arch=COMPUTE_CAPABILITY, headers=None, virtual=False):
    """The NVRTC options CuPy 14 compiles a ``RawModule(options=options)`` with."""
    options = tuple(options)
    if not any(o.startswith(("-std=", "--std=")) for o in options):
        options += (CUPY_DEFAULT_STD,)
    if headers:
        options += (f"-I{headers}",)
    options += CUPY_ADDED_OPTIONS
    options += (f"-arch={'compute' if virtual else 'sm'}_{arch}",)
    return options + CUPY_NVRTC_OPTIONS


_COMPILED = {}   # (source, options) -> NVRTC log (compiled) or CompileException


def _nvrtc_build(lib, source, options):
    key = (source, options)
    if key not in _COMPILED:
        ptx, log = nvrtc_compile(lib, source, list(options))
        _COMPILED[key] = CompileException(log) if ptx is None else log
    result = _COMPILED[key]
    if isinstance(result, CompileException):
        raise result
    return result


# -- the kernels on the host ---------------------------------------------------------------
_HOST_DIR = None
_HOST_LIBS = {}  # source hash -> ctypes library


def host_library(source):
    """``source`` (kernels.cu's text) built for the host by ``tests/cuda_host.cpp``."""
    global _HOST_DIR
    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    if key in _HOST_LIBS:
        return _HOST_LIBS[key]
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("the stand-in GPU runs kernels through their host build: needs g++")
    if _HOST_DIR is None:
        _HOST_DIR = tempfile.mkdtemp(prefix="fake_cupy_")
        atexit.register(shutil.rmtree, _HOST_DIR, True)
    folder = os.path.join(_HOST_DIR, key)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "kernels.cu"), "w") as f:
        f.write(source)
    lib = os.path.join(folder, "cuda_host.so")
    # -ffp-contract=off: the arithmetic NVRTC does with --fmad=false.
    r = subprocess.run([cxx, "-std=c++14", "-O2", "-ffp-contract=off", "-shared", "-fPIC",
                        f"-I{folder}", os.path.join(HERE, "cuda_host.cpp"), "-o", lib],
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"host build of the kernels failed:\n{r.stderr}")
    _HOST_LIBS[key] = ctypes.CDLL(lib)
    return _HOST_LIBS[key]


@dataclass
class Param:
    name: str
    type: str          # the base type: "u8", "int", "i64", "float", "double", "void", ...
    pointer: bool
    const: bool


#: Value types a kernel parameter takes, and the NumPy type a launch must pass (or the
#: element type a pointer points to).
C_TYPES = {"u8": np.uint8, "unsigned char": np.uint8, "u16": np.uint16,
           "unsigned short": np.uint16, "u32": np.uint32, "unsigned int": np.uint32,
           "unsigned": np.uint32, "int": np.int32, "i64": np.int64, "long long": np.int64,
           "float": np.float32, "double": np.float64}
_CTYPES = {np.uint8: ctypes.c_uint8, np.uint16: ctypes.c_uint16, np.uint32: ctypes.c_uint32,
           np.int32: ctypes.c_int32, np.int64: ctypes.c_int64, np.float32: ctypes.c_float,
           np.float64: ctypes.c_double}


def kernel_signatures(source):
    """``{name: [Param, ...]}`` of every ``extern "C" __global__`` kernel of ``source``."""
    out = {}
    for name, params in re.findall(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)',
                                   source):
        plist = []
        for p in params.split(","):
            p = " ".join(p.replace("__restrict__", " ").split())
            if not p or p == "void":
                continue
            pointer = "*" in p
            words = p.replace("*", " ").split()
            const = "const" in words
            words = [w for w in words if w != "const"]
            plist.append(Param(words[-1], " ".join(words[:-1]), pointer, const))
        out[name] = plist
    return out


def byte_bounds(a):
    """[lo, hi) addresses of the bytes NumPy array ``a`` spans."""
    lo = hi = a.__array_interface__["data"][0]
    for n, s in zip(a.shape, a.strides):
        if n == 0:
            return lo, lo
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi + a.itemsize


class _State:
    """One CUDA stream: its device, handle and vector clock."""

    _keys = itertools.count(1)

    def __init__(self, device, ptr, name):
        self.key = next(self._keys)
        self.device, self.ptr, self.name = device, ptr, name
        self.vc = {}      # stream key -> the last of its operations this stream has seen
        self.ticks = 0
        self.alive = True

    def tick(self):
        self.ticks += 1
        self.vc[self.key] = self.ticks
        return self.ticks

    def __repr__(self):
        return self.name


@dataclass
class Access:
    stream: _State
    index: int
    vc: dict
    kind: str          # "r" or "w"
    lo: int
    hi: int
    what: str
    seq: int = 0       # issue order across all streams


@dataclass
class _Chunk:
    raw: np.ndarray
    device: int
    arena: tuple       # (device, stream handle), as CuPy's pool keys its free lists
    free: bool = False
    accesses: list = field(default_factory=list)

    @property
    def lo(self):
        return self.raw.__array_interface__["data"][0]

    @property
    def hi(self):
        return self.lo + self.raw.nbytes


class _Lease:
    """Owns one allocation while arrays use it; when the last one goes, the chunk
    goes back to its arena."""

    def __init__(self, chunk, nbytes):
        self.chunk = chunk
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                    "data": (chunk.lo, False), "version": 3}


class OutOfMemoryError(MemoryError):
    """``cupy.cuda.memory.OutOfMemoryError`` (a MemoryError, as CuPy's)."""


class Pool:
    """CuPy's memory pool in miniature: one arena per (device, stream handle), best fit.
    Each device holds ``capacity`` bytes (a number only: the memory itself is NumPy's,
    taken as used), so that running out is what CuPy says it is."""

    ROUND = 512

    def __init__(self, capacity=4 << 30):
        self.chunks = []
        self.capacity = capacity

    def used(self, device):
        return sum(c.raw.nbytes for c in self.chunks if c.device == device and not c.free)

    def held(self, device):
        """Bytes the pool holds on ``device``, free chunks included (CuPy's total_bytes)."""
        return sum(c.raw.nbytes for c in self.chunks if c.device == device)

    def malloc(self, nbytes, device, handle):
        size = max(self.ROUND, -(-int(nbytes) // self.ROUND) * self.ROUND)
        arena = (device, handle)
        fits = [c for c in self.chunks if c.free and c.arena == arena and c.raw.nbytes >= size]
        if fits:
            chunk = min(fits, key=lambda c: c.raw.nbytes)
            chunk.free = False
        else:
            if self.held(device) + size > self.capacity:
                raise OutOfMemoryError(f"Out of memory allocating {size:,} bytes (allocated "
                                       f"so far: {self.held(device):,} bytes).")
            chunk = _Chunk(np.zeros(size, np.uint8), device, arena)
            self.chunks.append(chunk)
        lease = _Lease(chunk, nbytes)
        weakref.finalize(lease, setattr, chunk, "free", True)
        return lease

    def find(self, lo, hi):
        for c in self.chunks:
            if c.lo <= lo and hi <= c.hi:
                return c
        return None


class Gpu:
    """The state behind one fake ``cupy``: devices, streams, events, memory, checks."""

    def __init__(self, devices=2):
        self.devices = devices
        self.current_device = 0
        self.null = {d: _State(d, 0, f"null@{d}") for d in range(devices)}
        self.states = {}           # handle -> _State of the live streams
        self.dead = []             # _States of destroyed streams (their work still runs)
        self.stack = {d: [] for d in range(devices)}  # current streams (with stream:)
        self.events = {}
        self.completed = {}        # stream key -> operations the host has waited for
        self.host_reads = []       # (stream, index, lo, hi): copies out of host memory
        self.registered = {}       # ptr -> nbytes of page-locked host memory
        self.pinned = {}           # id -> (lo, hi) of live cupyx.empty_pinned buffers
        self.log = []              # runtime calls, in order
        self.syncs = []            # host waits: (kind, what, stream)
        self.violations = []
        self.modules = []          # RawModules built (their .options and .nvrtc_options)
        self.launches = []         # (kernel, grid, block, device)
        self.pool = Pool()
        self.refuse_register = False
        #: The CUDA headers CuPy 14 compiles with (None: not installed).
        self.cuda_headers = cuda_header_dir() or "(stand-in headers)"
        self.nvrtc = nvrtc_library()
        self._handles = itertools.count(0x1000, 0x10)
        self._free_handles = []    # handles of destroyed streams, CUDA reuses them
        self._seq = itertools.count()
        self.cupy, self.cupyx = _modules(self)

    # -- streams, events, completion ------------------------------------------------------
    def resolve(self, handle):
        """The stream behind a handle: 0, 1 (legacy) and 2 (per-thread) are the
        default stream of the current device."""
        handle = int(handle)
        if handle in (0, 1, 2):
            return self.null[self.current_device]
        try:
            return self.states[handle]
        except KeyError:
            if any(s.ptr == handle for s in self.dead):
                self.violations.append(f"stream handle {handle:#x} used after the stream "
                                       f"was destroyed")
            raise CUDARuntimeError(INVALID_HANDLE, f"no stream {handle:#x}") from None

    def new_handle(self):
        if self._free_handles:
            self._free_handles.sort()
            return self._free_handles.pop(0)
        return next(self._handles)

    def destroy(self, state):
        """cudaStreamDestroy: the handle goes (CUDA reuses it); queued work still runs."""
        if self.states.get(state.ptr) is state:
            del self.states[state.ptr]
            state.alive = False
            self.dead.append(state)
            self._free_handles.append(state.ptr)

    def current_state(self, device=None):
        device = self.current_device if device is None else device
        stack = self.stack[device]
        return stack[-1].state if stack else self.null[device]

    def stream(self, device=None):
        """A new (non-blocking) stream on ``device`` (default: the current one), as a
        consumer makes one."""
        with self.cupy.cuda.Device(self.current_device if device is None else device):
            return self.cupy.cuda.Stream(non_blocking=True)

    def complete(self, vc):
        for k, v in vc.items():
            if self.completed.get(k, 0) < v:
                self.completed[k] = v

    def is_complete(self, vc):
        return all(self.completed.get(k, 0) >= v for k, v in vc.items())

    def host_wait(self, kind, what, state, vc=None):
        """The host waits for ``state``'s work so far (or the clock ``vc``)."""
        self.syncs.append((kind, what, state))
        self.complete(dict(state.vc) if vc is None else vc)

    def happens_before(self, a, b):
        """Access ``a`` is ordered before access ``b``."""
        return b.vc.get(a.stream.key, 0) >= a.index

    # -- memory ---------------------------------------------------------------------------
    def allocate(self, shape, dtype):
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        state = self.current_state()
        lease = self.pool.malloc(nbytes, self.current_device, state.ptr)
        flat = np.asarray(lease)
        return self.cupy.ndarray(_view=flat[:nbytes].view(dtype).reshape(shape))

    def fresh(self, values, what, device=None):
        """A new device array holding host ``values``, written on the current stream."""
        values = np.asarray(values)
        out = self.allocate(values.shape, values.dtype)
        self.access(out, "w", what)
        np.copyto(out._a, values)
        return out

    def access(self, array, kind, what, stream=None, check_device=True, region=None):
        """Log an access to device array ``array`` (or its ``region``, a NumPy view of its
        memory) on ``stream`` (a state; the current stream by default) and check it
        against earlier accesses to the same memory."""
        view = region if region is not None else getattr(array, "_a", array)
        lo, hi = byte_bounds(view)
        chunk = self.pool.find(lo, hi)
        if chunk is None or lo == hi:
            return None  # not pool memory (a temporary of a NumPy operation)
        state = self.current_state() if stream is None else stream
        if check_device and chunk.device != self.current_device:
            self.violations.append(f"{what}: memory of device {chunk.device} used with "
                                   f"device {self.current_device} current")
        index = state.tick()
        acc = Access(state, index, dict(state.vc), kind, lo, hi, what, next(self._seq))
        for prev in chunk.accesses:
            if prev.stream is state or (prev.kind == "r" and kind == "r"):
                continue
            if prev.hi <= lo or hi <= prev.lo:
                continue
            # Ordered by the streams, or by the host: work it has waited for is over
            # before anything it issues later.
            if not self.happens_before(prev, acc) and \
                    self.completed.get(prev.stream.key, 0) < prev.index:
                self.violations.append(
                    f"{what} ({kind}) on {state} is not ordered after {prev.what} "
                    f"({prev.kind}) on {prev.stream} of the same memory")
        chunk.accesses.append(acc)
        return acc

    def accesses(self, what=None, stream=None):
        """Every access logged, in issue order (optionally only ``what`` on ``stream``)."""
        out = [a for c in self.pool.chunks for a in c.accesses]
        out.sort(key=lambda a: a.seq)
        out = [a for a in out if (what is None or a.what == what) and
               (stream is None or a.stream is stream)]
        return out

    def read(self, images, stream, what="consumer read"):
        """A consumer's read of a batch's images on ``stream`` (a fake Stream), queued
        now: what a training step launched there would do."""
        array = getattr(images, "array", None)
        if array is None:
            array = getattr(images, "bits", images)
        return self.access(array, "r", what, stream.state, check_device=False)

    def copies_done(self, lo, hi):
        """Every copy out of host memory [lo, hi) has completed."""
        return all(self.completed.get(s.key, 0) >= i for s, i, a, b in self.host_reads
                   if a < hi and lo < b)

    def page_locked(self, lo, hi):
        """Host memory [lo, hi) is pinned or registered (a copy engine can read it)."""
        spans = list(self.pinned.values()) + [(p, p + n) for p, n in self.registered.items()]
        return any(a <= lo and hi <= b for a, b in spans)


def _modules(gpu):
    """A fresh ``cupy`` and ``cupyx`` bound to ``gpu``."""

    def operand(x, what):
        """A value for arithmetic with a device array: a device array's memory, or a
        Python / NumPy scalar; a NumPy array is refused, as CuPy refuses it."""
        if isinstance(x, ndarray):
            gpu.access(x, "r", what)
            return x._a
        if isinstance(x, (bool, int, float, complex, np.generic)):
            return x
        raise TypeError(f"Unsupported type {type(x)}")

    def host_key(key, what):
        """An index for NumPy, and whether it is advanced (a copy / a scatter)."""
        keys = key if isinstance(key, tuple) else (key,)
        advanced, out = False, []
        for k in keys:
            if isinstance(k, ndarray):
                gpu.access(k, "r", what)
                advanced = True
                out.append(k._a)
            elif isinstance(k, (np.ndarray, list)):
                advanced = True
                out.append(np.asarray(k))
            else:
                out.append(k)
        return tuple(out), advanced

    class ndarray:
        """A device array: NumPy memory from the pool, reached only through what CuPy
        offers; every access is logged."""

        __array_ufunc__ = None   # NumPy defers to our reflected operators
        __hash__ = None
        __module__ = "cupy"      # as CuPy's: what code that tells frameworks apart reads

        def __init__(self, shape=None, dtype=float, *, _view=None, _keep=None):
            if _view is None:
                _view = gpu.allocate(shape, dtype)._a
            self._a = _view
            self._keep = _keep   # what the memory belongs to (an imported array)

        # -- what an array is ------------------------------------------------------------
        shape = property(lambda self: self._a.shape)
        dtype = property(lambda self: self._a.dtype)
        ndim = property(lambda self: self._a.ndim)
        size = property(lambda self: self._a.size)
        nbytes = property(lambda self: self._a.nbytes)
        itemsize = property(lambda self: self._a.itemsize)
        strides = property(lambda self: self._a.strides)
        flags = property(lambda self: self._a.flags)

        @property
        def data(self):
            return types.SimpleNamespace(ptr=self._a.__array_interface__["data"][0])

        @property
        def device(self):
            chunk = gpu.pool.find(*byte_bounds(self._a))
            return gpu.cupy.cuda.Device(chunk.device if chunk else gpu.current_device)

        def __len__(self):
            if not self.ndim:
                raise TypeError("len() of unsized object")
            return self.shape[0]

        def __iter__(self):
            for i in range(len(self)):
                yield self[i]

        def __repr__(self):
            return f"<fake cupy.ndarray shape={self.shape} dtype={self.dtype}>"

        def __array__(self, dtype=None, copy=None):
            raise TypeError(IMPLICIT)

        # -- host waits -------------------------------------------------------------------
        def _scalar(self, convert, what):
            if self.size != 1:
                raise TypeError("only size-1 arrays can be converted to Python scalars")
            state = gpu.current_state()
            acc = gpu.access(self, "r", what, state)
            gpu.host_wait("scalar", what, state, acc.vc if acc else None)
            return convert(self._a.reshape(()).item())

        def __int__(self):
            return self._scalar(int, "int()")

        def __index__(self):
            if self.dtype.kind not in "iub":
                raise TypeError("only integer arrays can be an index")
            return self._scalar(int, "index")

        def __float__(self):
            return self._scalar(float, "float()")

        def __bool__(self):
            return self._scalar(bool, "bool()")

        def item(self):
            return self._scalar(lambda v: v, "item()")

        def tolist(self):
            return self.get().tolist()

        def get(self, stream=None, order="C", out=None, blocking=True):
            """Device -> host on ``stream`` (by default the current one of the array's
            device: CuPy's ``get`` selects it), waited for."""
            state = gpu.current_state(self.device.id) if stream is None else stream.state
            acc = gpu.access(self, "r", "get", state, check_device=False)
            gpu.host_wait("get", "get", state, acc.vc if acc else None)
            return np.array(self._a, copy=True)

        def set(self, arr, stream=None):
            """Host -> device on ``stream`` (the current one by default), with CuPy's
            checks; an asynchronous copy must read page-locked memory."""
            if not isinstance(arr, np.ndarray):
                raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
            if self.dtype != arr.dtype:
                raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
            if self.shape != arr.shape:
                raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: "
                                 f"{arr.shape}")
            if not self.flags.c_contiguous:
                raise RuntimeError("Cannot set to non-contiguous array")
            if not arr.flags.c_contiguous:
                arr = np.ascontiguousarray(arr)  # CuPy copies it first: pageable memory
            state = gpu.current_state() if stream is None else stream.state
            acc = gpu.access(self, "w", "set", state, check_device=False)
            lo, hi = byte_bounds(arr)
            if stream is not None and hi > lo and not gpu.page_locked(lo, hi):
                gpu.violations.append("an asynchronous copy from host memory that is neither "
                                      "pinned nor registered")
            if acc is not None:
                gpu.host_reads.append((state, acc.index, lo, hi))
            np.copyto(self._a, arr)

        # -- views and copies -------------------------------------------------------------
        def __getitem__(self, key):
            hk, advanced = host_key(key, "getitem")
            if advanced:  # a copy: the array is read
                gpu.access(self, "r", "getitem")
                return gpu.fresh(self._a[hk], "getitem")
            r = self._a[hk]
            if not isinstance(r, np.ndarray):  # CuPy gives a 0-d device array
                r = self._a[hk + (Ellipsis,)]
            return ndarray(_view=r, _keep=self._keep)

        def __setitem__(self, key, value):
            hk, advanced = host_key(key, "setitem")
            v = operand(value, "setitem") if not isinstance(value, np.ndarray) else value
            region = None if advanced else self._a[hk]
            if region is not None and not isinstance(region, np.ndarray):
                region = self._a[hk + (Ellipsis,)]
            gpu.access(self, "w", "setitem", region=region)
            self._a[hk] = v

        def fill(self, value):
            gpu.access(self, "w", "fill")
            self._a.fill(operand(value, "fill"))

        def copy(self, order="C"):
            gpu.access(self, "r", "copy")
            return gpu.fresh(self._a, "copy")

        def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
            if not copy and np.dtype(dtype) == self.dtype:
                return self
            gpu.access(self, "r", "astype")
            return gpu.fresh(self._a.astype(dtype), "astype")

        def view(self, dtype=None):
            return ndarray(_view=self._a.view(dtype), _keep=self._keep)

        def reshape(self, *shape, order="C"):
            r = self._a.reshape(*shape)
            if np.shares_memory(r, self._a):
                return ndarray(_view=r, _keep=self._keep)
            gpu.access(self, "r", "reshape")
            return gpu.fresh(r, "reshape")

        def ravel(self):
            return self.reshape(-1)

        def transpose(self, *axes):
            return ndarray(_view=self._a.transpose(*axes), _keep=self._keep)

        T = property(lambda self: self.transpose())

        # -- arithmetic (a new array, or in place: logged as a write) ----------------------
        def _binary(self, other, op, reflected=False):
            what = op.__name__
            o = operand(other, what)
            gpu.access(self, "r", what)
            res = op(o, self._a) if reflected else op(self._a, o)
            return gpu.fresh(res, what)

        def _inplace(self, other, op):
            what = f"{op.__name__}="
            o = operand(other, what)
            gpu.access(self, "w", what)
            self._a[...] = op(self._a, o).astype(self.dtype, copy=False)
            return self

        def _reduce(self, func, what, **kw):
            gpu.access(self, "r", what)
            return gpu.fresh(np.asarray(func(self._a, **kw)), what)

        def min(self, axis=None):
            return self._reduce(np.min, "min", axis=axis)

        def max(self, axis=None):
            return self._reduce(np.max, "max", axis=axis)

        def sum(self, axis=None, dtype=None):
            return self._reduce(np.sum, "sum", axis=axis, dtype=dtype)

        def mean(self, axis=None, dtype=None):
            return self._reduce(np.mean, "mean", axis=axis, dtype=dtype)

        def any(self, axis=None):
            return self._reduce(np.any, "any", axis=axis)

        def all(self, axis=None):
            return self._reduce(np.all, "all", axis=axis)

        def __neg__(self):
            gpu.access(self, "r", "neg")
            return gpu.fresh(-self._a, "neg")

        # -- leaving the stand-in ---------------------------------------------------------
        @property
        def __cuda_array_interface__(self):
            current = gpu.current_state()
            strides = None if self.flags.c_contiguous else self.strides
            return {"shape": self.shape, "typestr": self.dtype.str, "strides": strides,
                    "data": (self.data.ptr, False), "version": 3,
                    "stream": 1 if current.ptr == 0 else current.ptr}

        def __dlpack_device__(self):
            return (_dlpack.KDL_CUDA, self.device.id)

        def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
            # What CuPy does: the consumer's stream waits for an event recorded on the
            # current stream of the *current* device.
            if stream is None:
                stream = 1
            if stream != -1:
                current = gpu.current_state()
                if gpu.resolve(stream) is not current:
                    event = Event()
                    runtime.eventRecord(event.ptr, current.ptr)
                    runtime.streamWaitEvent(stream, event.ptr, 0)
            code = {"u": 1, "i": 0, "f": 2}[self.dtype.kind]
            return _dlpack.capsule(self, self.data.ptr, self.shape,
                                   [s // self.itemsize for s in self.strides],
                                   _dlpack.KDL_CUDA, self.device.id, code, 8 * self.itemsize)

    for name, op, rop in [("add", operator.add, True), ("sub", operator.sub, True),
                          ("mul", operator.mul, True), ("truediv", operator.truediv, True),
                          ("floordiv", operator.floordiv, True), ("and", operator.and_, True),
                          ("or", operator.or_, True), ("xor", operator.xor, True),
                          ("lshift", operator.lshift, True), ("rshift", operator.rshift, True),
                          ("lt", operator.lt, False), ("le", operator.le, False),
                          ("gt", operator.gt, False), ("ge", operator.ge, False),
                          ("eq", operator.eq, False), ("ne", operator.ne, False)]:
        setattr(ndarray, f"__{name}__", lambda self, o, op=op: self._binary(o, op))
        if rop:
            setattr(ndarray, f"__r{name}__",
                    lambda self, o, op=op: self._binary(o, op, reflected=True))
            setattr(ndarray, f"__i{name}__", lambda self, o, op=op: self._inplace(o, op))

    def as_device(a, what):
        if not isinstance(a, ndarray):
            raise TypeError(f"{what}: Argument 'a' has incorrect type (expected "
                            f"cupy.ndarray, got {type(a).__name__})")
        return a

    class Device:
        def __init__(self, device=None):
            self.id = gpu.current_device if device is None else int(device)
            if not 0 <= self.id < gpu.devices:
                raise CUDARuntimeError(INVALID_DEVICE, f"device {self.id}")
            self._outer = []

        compute_capability = property(lambda self: COMPUTE_CAPABILITY)

        @property
        def mem_info(self):
            """(free, total) bytes of the device."""
            return gpu.pool.capacity - gpu.pool.held(self.id), gpu.pool.capacity

        def __enter__(self):
            self._outer.append(gpu.current_device)
            gpu.current_device = self.id
            return self

        def __exit__(self, *exc):
            gpu.current_device = self._outer.pop()

        def use(self):
            gpu.current_device = self.id

        def synchronize(self):
            # Every stream of the device, destroyed ones too: their work still ran.
            states = [gpu.null[self.id]] + list(gpu.states.values()) + gpu.dead
            gpu.syncs.append(("device", "synchronize", self.id))
            for state in states:
                if state.device == self.id:
                    gpu.complete(state.vc)

        def __eq__(self, other):
            return isinstance(other, Device) and other.id == self.id

        def __hash__(self):
            return hash(self.id)

    class Stream:
        def __init__(self, null=False, non_blocking=False, ptds=False, *, _state=None,
                     _ptr=None):
            self._owned = False
            if _ptr is not None:         # the default stream, resolved per device
                self.ptr, self._state = _ptr, None
                return
            if _state is None:
                ptr = gpu.new_handle()
                _state = _State(gpu.current_device, ptr, f"stream {ptr:#x}@{gpu.current_device}")
                gpu.states[ptr] = _state
                self._owned = True
            self._state, self.ptr = _state, _state.ptr

        def __del__(self):
            if getattr(self, "_owned", False):
                gpu.destroy(self._state)

        @property
        def state(self):
            if self._state is None:
                return gpu.resolve(self.ptr)
            if not self._state.alive:
                gpu.violations.append(f"{self._state} used after it was destroyed")
                raise CUDARuntimeError(INVALID_HANDLE, f"destroyed {self._state}")
            return self._state

        @property
        def device_id(self):
            return self.state.device

        def __enter__(self):
            state = self.state
            if state.device != gpu.current_device:
                raise RuntimeError(f"stream of device {state.device} used with device "
                                   f"{gpu.current_device} current")
            gpu.stack[state.device].append(self)
            return self

        def __exit__(self, *exc):
            gpu.stack[self.state.device].pop()

        def wait_event(self, event):
            runtime.streamWaitEvent(self.ptr, event.ptr, 0)

        def record(self, event=None):
            event = Event() if event is None else event
            runtime.eventRecord(event.ptr, self.ptr)
            return event

        def synchronize(self):
            runtime.streamSynchronize(self.ptr)

        @property
        def done(self):
            return gpu.is_complete(self.state.vc)

        def __eq__(self, other):
            return isinstance(other, Stream) and other.state is self.state

        def __hash__(self):
            return hash(self.ptr)

        def __repr__(self):
            return f"<fake Stream {self.state}>"

    Stream.null = Stream(_ptr=0)

    def ExternalStream(ptr, device_id=-1):
        ptr = int(ptr)
        return Stream(_ptr=ptr) if ptr in (0, 1, 2) else Stream(_state=gpu.resolve(ptr))

    def get_current_stream(device_id=None):
        device = gpu.current_device if device_id is None or device_id < 0 else device_id
        stack = gpu.stack[device]
        return stack[-1] if stack else Stream.null

    class Event:
        def __init__(self, block=False, disable_timing=False, interprocess=False):
            self.ptr = next(gpu._handles)
            self.device = gpu.current_device
            self.vc = None             # not recorded yet: complete
            self.stream = None
            gpu.events[self.ptr] = self

        @property
        def done(self):
            return self.vc is None or gpu.is_complete(self.vc)

        def synchronize(self):
            if self.vc is not None:
                gpu.host_wait("event", "Event.synchronize", self.stream, self.vc)

        def record(self, stream=None):
            runtime.eventRecord(self.ptr, (stream or get_current_stream()).ptr)

    def hostRegister(ptr, size, flags):
        gpu.log.append(("hostRegister", ptr, size))
        if gpu.refuse_register:
            raise CUDARuntimeError(NOT_SUPPORTED, "hostRegister")
        gpu.registered[ptr] = size

    def hostUnregister(ptr):
        gpu.log.append(("hostUnregister", ptr))
        size = gpu.registered.pop(ptr)
        if not gpu.copies_done(ptr, ptr + size):
            gpu.violations.append("hostUnregister while a copy out of that memory may "
                                  "still run")

    def eventRecord(event_ptr, stream):
        event, state = gpu.events[event_ptr], gpu.resolve(stream)
        gpu.log.append(("eventRecord", event.device, state.device, state.name))
        if event.device != state.device:
            gpu.violations.append(f"event of device {event.device} recorded on {state}")
            raise CUDARuntimeError(INVALID_HANDLE, "eventRecord: event and stream on "
                                                   "different devices")
        event.vc, event.stream = dict(state.vc), state

    def streamWaitEvent(stream, event_ptr, flags=0):
        event, state = gpu.events[event_ptr], gpu.resolve(stream)
        gpu.log.append(("streamWaitEvent", state.name, event.device))
        if event.vc is not None:
            for k, v in event.vc.items():
                if state.vc.get(k, 0) < v:
                    state.vc[k] = v

    def streamSynchronize(stream):
        state = gpu.resolve(stream)
        gpu.host_wait("stream", "streamSynchronize", state)

    def deviceSynchronize():
        Device().synchronize()

    runtime = types.SimpleNamespace(
        CUDARuntimeError=CUDARuntimeError, hostRegister=hostRegister,
        hostUnregister=hostUnregister, eventRecord=eventRecord,
        streamWaitEvent=streamWaitEvent, streamSynchronize=streamSynchronize,
        deviceSynchronize=deviceSynchronize, getDeviceCount=lambda: gpu.devices,
        getDevice=lambda: gpu.current_device, streamLegacy=1, streamPerThread=2)

    # -- kernels: compiled by NVRTC, run by their host build --------------------------------
    class RawModule:
        def __init__(self, *, code=None, path=None, options=(), backend="nvrtc", **kw):
            if not isinstance(options, tuple):
                raise TypeError(f"Argument 'options' has incorrect type (expected tuple, got "
                                f"{type(options).__name__})")
            self.code, self.options = code, options
            self.nvrtc_options = None
            self._signatures = None
            gpu.modules.append(self)

        def _compile(self):
            # CuPy compiles at the first retrieval of a kernel, not at construction.
            if self._signatures is not None:
                return
            if gpu.cuda_headers is None:
                raise RuntimeError("Failed to find CUDA headers. Please install the CUDA "
                                   "Toolkit or set CUDA_PATH")
            if gpu.nvrtc is None:
                raise RuntimeError("CuPy failed to load libnvrtc.so.12: OSError: libnvrtc.so.12:"
                                   " cannot open shared object file: No such file or directory")
            headers = gpu.cuda_headers if os.path.isdir(gpu.cuda_headers) else None
            self.nvrtc_options = cupy_options(self.options, headers=headers)
            _nvrtc_build(gpu.nvrtc, self.code, self.nvrtc_options)
            self._signatures = kernel_signatures(self.code)
            self._host = host_library(self.code)

        def get_function(self, name):
            self._compile()
            if name not in self._signatures:
                raise RuntimeError(f"CUDA_ERROR_NOT_FOUND: named symbol not found ({name})")
            return _Function(self, name, self._signatures[name])

    def check_dims(what, dims):
        if not isinstance(dims, tuple):
            raise TypeError(f"Argument '{what}' has incorrect type (expected tuple, got "
                            f"{type(dims).__name__})")
        if not 1 <= len(dims) <= 3 or not all(isinstance(d, (int, np.integer)) for d in dims):
            raise TypeError(f"{what} must be a tuple of 1 to 3 integers, got {dims!r}")
        return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))

    class _Function:
        def __init__(self, module, name, params):
            self.module, self.name, self.params = module, name, params

        def _argument(self, i, p, a):
            where = f"kernel {self.name}, argument {i} ({p.name})"
            want = C_TYPES.get(p.type)
            if p.pointer:
                if not isinstance(a, ndarray):
                    raise TypeError(f"{where}: a device array, got {type(a).__name__}")
                if want is not None and a.dtype != want:
                    raise TypeError(f"{where}: {p.type}* takes {np.dtype(want)}, got {a.dtype}")
                if not a.flags.c_contiguous:
                    raise TypeError(f"{where}: a raw kernel ignores views: the array must "
                                    f"be C-contiguous")
                return ctypes.c_void_p(a.data.ptr)
            if want is None:
                raise TypeError(f"{where}: the stand-in has no type for {p.type!r}")
            if not isinstance(a, np.generic) or a.dtype != want:
                raise TypeError(f"{where}: {p.type} takes numpy.{np.dtype(want)}, got "
                                f"{type(a).__name__} {getattr(a, 'dtype', '')}".rstrip())
            return _CTYPES[want](a.item())

        def __call__(self, grid, block, args, shared_mem=0, stream=None):
            grid, block = check_dims("grid", grid), check_dims("block", block)
            if not isinstance(args, (tuple, list)):
                raise TypeError(f"kernel arguments must be a tuple, got {type(args).__name__}")
            if len(args) != len(self.params):
                raise TypeError(f"kernel {self.name} takes {len(self.params)} arguments "
                                f"({', '.join(p.name for p in self.params)}), got {len(args)}")
            host_args = [self._argument(i, p, a) for i, (p, a) in
                         enumerate(zip(self.params, args))]
            state = gpu.current_state() if stream is None else stream.state
            if state.device != gpu.current_device:
                gpu.violations.append(f"{self.name} launched on {state} with device "
                                      f"{gpu.current_device} current")
                raise CUDARuntimeError(INVALID_HANDLE, "launch on another device's stream")
            if any(not 1 <= g <= m for g, m in zip(grid, MAX_GRID)) or \
                    math.prod(block) > MAX_BLOCK or min(block) < 1:
                raise CUDARuntimeError(INVALID_VALUE, f"launch grid {grid} block {block}")
            if grid[2] != 1 or block[1:] != (1, 1):
                raise NotImplementedError("the host build walks gridDim.x, .y and blockDim.x")
            gpu.launches.append((self.name, grid[:len(grid)], block, gpu.current_device))
            for p, a in zip(self.params, args):
                if p.pointer:
                    gpu.access(a, "r" if p.const else "w", self.name, state)
            launch = getattr(self.module._host, f"host_{self.name}", None)
            if launch is None:
                raise NotImplementedError(f"no host launcher host_{self.name} in "
                                          f"tests/cuda_host.cpp")
            launch.restype = ctypes.c_int
            rc = launch(ctypes.c_ulonglong(grid[0]), ctypes.c_ulonglong(grid[1]),
                        ctypes.c_ulonglong(block[0]), *host_args)
            if rc != 0:
                raise CUDARuntimeError(INVALID_VALUE, f"launch grid {grid} block {block}")

    class RawKernel:
        """A test's own kernel (a ``clock64`` spin that slows a stream): compiled by NVRTC
        as CuPy compiles it, at the first launch.  The stand-in runs no time, so a launch
        is one operation on its stream that touches no memory; a kernel that takes a
        pointer is refused (its accesses could not be logged)."""

        def __init__(self, code, name, options=(), **kw):
            self.code, self.name, self.options = code, name, tuple(options)
            self._params = None

        def __call__(self, grid, block, args, shared_mem=0, stream=None):
            if self._params is None:
                if gpu.nvrtc is None:
                    raise RuntimeError("CuPy failed to load libnvrtc")
                headers = gpu.cuda_headers if os.path.isdir(gpu.cuda_headers or "") else None
                _nvrtc_build(gpu.nvrtc, self.code, cupy_options(self.options, headers=headers))
                signatures = kernel_signatures(self.code)
                if self.name not in signatures:
                    raise RuntimeError(f"CUDA_ERROR_NOT_FOUND: named symbol not found "
                                       f"({self.name})")
                self._params = signatures[self.name]
            if any(p.pointer for p in self._params):
                raise NotImplementedError("the stand-in runs a RawKernel only if it takes "
                                          "no pointer")
            check_dims("grid", grid), check_dims("block", block)
            if not isinstance(args, (tuple, list)) or len(args) != len(self._params):
                raise TypeError(f"kernel {self.name} takes {len(self._params)} arguments")
            fn = _Function(None, self.name, self._params)
            for i, (p, a) in enumerate(zip(self._params, args)):
                fn._argument(i, p, a)
            state = gpu.current_state() if stream is None else stream.state
            if state.device != gpu.current_device:
                gpu.violations.append(f"{self.name} launched on {state} with device "
                                      f"{gpu.current_device} current")
                raise CUDARuntimeError(INVALID_HANDLE, "launch on another device's stream")
            gpu.launches.append((self.name, grid, block, gpu.current_device))
            state.tick()

    # -- array functions -----------------------------------------------------------------
    def empty(shape, dtype=np.float64, order="C"):
        return gpu.allocate(shape, dtype)

    def zeros(shape, dtype=np.float64, order="C"):
        return gpu.fresh(np.zeros(shape, dtype), "zeros")

    def from_interface(obj, cai):
        """A view of device memory described by a __cuda_array_interface__ (CuPy waits
        for the stream it names: CUPY_CUDA_ARRAY_INTERFACE_SYNC=1, the default)."""
        if cai.get("stream") not in (None,):
            state = gpu.resolve(cai["stream"])
            gpu.host_wait("stream", "__cuda_array_interface__", state)
        ptr = cai["data"][0]
        return view_of(obj, ptr, cai["shape"], np.dtype(cai["typestr"]), cai.get("strides"))

    def view_of(obj, ptr, shape, dtype, strides=None):
        """A device array over memory at ``ptr`` that ``obj`` keeps alive."""
        chunk = gpu.pool.find(ptr, ptr + 1)
        if chunk is None:
            raise ValueError(f"{ptr:#x} is not device memory of the stand-in")
        view = np.ndarray(tuple(int(s) for s in shape), dtype, buffer=chunk.raw,
                          offset=ptr - chunk.lo,
                          strides=None if strides is None else tuple(int(s) for s in strides))
        return ndarray(_view=view, _keep=obj)

    def asarray(a, dtype=None, order=None, blocking=False):
        if isinstance(a, ndarray):
            return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
        if hasattr(a, "__cuda_array_interface__") and not isinstance(a, np.ndarray):
            view = from_interface(a, a.__cuda_array_interface__)
            return view if dtype is None else view.astype(dtype)
        # A host array: CuPy stages it through pinned memory and copies it on the
        # current stream.
        host_array = np.asarray(a, dtype=dtype)
        return gpu.fresh(host_array, "asarray")

    def array(a, dtype=None, copy=True, order="K", ndmin=0, blocking=False):
        out = asarray(a, dtype)
        return out.copy() if copy and out is a else out

    def arange(*args, **kw):
        return gpu.fresh(np.arange(*args, **kw), "arange")

    def full(shape, fill_value, dtype=None, order="C"):
        return gpu.fresh(np.full(shape, fill_value, dtype), "full")

    def ascontiguousarray(a, dtype=None):
        a = as_device(a, "ascontiguousarray")
        if a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
            return a
        gpu.access(a, "r", "ascontiguousarray")
        return gpu.fresh(np.ascontiguousarray(a._a, dtype), "ascontiguousarray")

    def take(a, indices, axis=None, out=None):
        a = as_device(a, "take")
        indices = as_device(indices, "take")
        gpu.access(a, "r", "take")
        gpu.access(indices, "r", "take")
        if out is None:
            return gpu.fresh(np.take(a._a, indices._a, axis=axis), "take")
        gpu.access(out, "w", "take")
        np.take(a._a, indices._a, axis=axis, out=out._a)
        return out

    def asnumpy(a, stream=None, order="C", out=None, blocking=True):
        if isinstance(a, ndarray):
            return a.get(stream=stream)
        if hasattr(a, "__cuda_array_interface__"):
            return asarray(a).get(stream=stream)
        return np.asarray(a)

    def from_dlpack(x):
        """CuPy's import: the producer orders the current stream (1 for the default)."""
        kind, device = x.__dlpack_device__()
        if kind != _dlpack.KDL_CUDA:
            raise TypeError("from_dlpack: not CUDA memory")
        with Device(device):
            current = get_current_stream().ptr
        capsule = x.__dlpack__(stream=current or 1)
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        t = get(capsule, b"dltensor")
        data = ctypes.c_void_p.from_address(t).value
        ndim = ctypes.c_int32.from_address(t + 16).value
        code, bits = ctypes.c_uint8.from_address(t + 20).value, \
            ctypes.c_uint8.from_address(t + 21).value
        shape_p, strides_p = ctypes.c_void_p.from_address(t + 24).value, \
            ctypes.c_void_p.from_address(t + 32).value
        shape = [ctypes.c_int64.from_address(shape_p + 8 * i).value for i in range(ndim)]
        strides = [ctypes.c_int64.from_address(strides_p + 8 * i).value for i in range(ndim)]
        dtype = np.dtype({0: "i", 1: "u", 2: "f"}.get(code, "V") + str(bits // 8))
        return view_of(capsule, data, shape, dtype, [s * dtype.itemsize for s in strides])

    class MemoryPool:
        """``cupy.get_default_memory_pool()``: the current device's bytes in use."""

        def used_bytes(self):
            return gpu.pool.used(gpu.current_device)

        def total_bytes(self):
            return gpu.pool.held(gpu.current_device)

    def assemble_cupy_compiler_options(options):
        headers = gpu.cuda_headers if os.path.isdir(gpu.cuda_headers or "") else None
        return cupy_options(options, headers=headers)

    cuda = types.SimpleNamespace(
        memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError),
        Device=Device, Stream=Stream, ExternalStream=ExternalStream, Event=Event,
        get_current_stream=get_current_stream, runtime=runtime,
        is_available=lambda: True)
    cupy = types.ModuleType("cupy")
    cupy.__dict__.update(
        ndarray=ndarray, cuda=cuda, RawModule=RawModule, RawKernel=RawKernel, empty=empty,
        zeros=zeros,
        asarray=asarray, array=array, ascontiguousarray=ascontiguousarray, take=take,
        asnumpy=asnumpy, arange=arange, full=full, from_dlpack=from_dlpack,
        is_available=lambda: True, get_default_memory_pool=MemoryPool,
        _core=types.SimpleNamespace(core=types.SimpleNamespace(
            assemble_cupy_compiler_options=assemble_cupy_compiler_options)),
        uint8=np.uint8, uint16=np.uint16, uint32=np.uint32,
        int32=np.int32, int64=np.int64, float16=np.float16, float32=np.float32,
        float64=np.float64, bool_=np.bool_, __version__="0+fake", _fake_gpu=gpu)

    class PinnedArray(np.ndarray):
        """Host memory from ``cupyx.empty_pinned``: a write into it while a copy out of
        it may still run is a violation."""

        def __setitem__(self, key, value):
            region = self.view(np.ndarray)[key]
            lo, hi = byte_bounds(region if isinstance(region, np.ndarray) else
                                 self.view(np.ndarray))
            if not gpu.copies_done(lo, hi):
                gpu.violations.append("a pinned staging buffer overwritten while a copy out "
                                      "of it may still run")
            np.ndarray.__setitem__(self.view(np.ndarray), key, value)

    def empty_pinned(shape, dtype=np.float64, order="C"):
        raw = np.empty(shape, dtype).view(PinnedArray)
        key = id(raw)
        gpu.pinned[key] = byte_bounds(raw.view(np.ndarray))
        weakref.finalize(raw, gpu.pinned.pop, key, None)
        return raw

    cupyx = types.ModuleType("cupyx")
    cupyx.empty_pinned = empty_pinned
    return cupy, cupyx


def install(monkeypatch, devices=2):
    """A fresh fake GPU with ``devices`` devices, as ``cupy``/``cupyx`` in sys.modules."""
    gpu = Gpu(devices)
    if gpu.nvrtc is None:
        import pytest
        pytest.skip("the stand-in GPU compiles with NVRTC: pip install nvidia-cuda-nvrtc-cu12 "
                    "(in the test extra on Linux x86-64)")
    monkeypatch.setitem(sys.modules, "cupy", gpu.cupy)
    monkeypatch.setitem(sys.modules, "cupyx", gpu.cupyx)
    return gpu

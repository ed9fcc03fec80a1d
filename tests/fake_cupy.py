"""A stand-in for the part of CuPy the CUDA backend uses, with a checker of stream order.

``install(monkeypatch)`` puts a fresh ``cupy`` and ``cupyx`` into ``sys.modules``
and returns the :class:`Gpu` behind them, so that the real
:class:`echo_native.backends.cuda.CudaDevice` runs through a real ``EchoRing``
on a machine without a GPU.  Memory is NumPy; what is checked is *order*:

- every stream keeps a vector clock: an operation on it ticks its own entry,
  ``eventRecord`` copies the clock into the event, ``streamWaitEvent`` merges
  the event's clock into the waiting stream.  Operation A happens before B
  exactly when B's clock has seen A's tick.
- every access to device memory (a copy in, a kernel, an indexed write, a
  consumer's read) is logged with its stream and clock.  Two accesses to
  overlapping memory on different streams, one of them a write, must be
  ordered the way the host issued them, by the streams or by a host wait
  for the first before the second was issued; where not, the checker
  appends a line to ``Gpu.violations`` (a data race on a real GPU).
- the GPU runs nothing until the host waits for it: an event is ``done``
  only after a host wait covered it (``Event.synchronize``,
  ``Stream.synchronize``, ``get()``).  ``hostUnregister`` of memory that a
  copy not yet waited for reads from is a violation.
- memory comes from a pool with one arena per (device, stream), as CuPy's:
  an array freed (garbage-collected) goes back to the arena of the stream it
  was allocated on, and the next allocation there may get the same memory.
- the CUDA rules for several devices: an event is recorded on a stream of
  the device it was created on (else ``cudaErrorInvalidResourceHandle``), a
  kernel runs on a stream of the current device and on memory of that device.
- kernels (``RawModule``) run NumPy versions of ``kernels.cu`` and refuse a
  launch beyond CUDA's grid limits, as the driver does.

The consumer side is played by the tests: ``Gpu.stream(device)`` makes a
stream, ``Gpu.read(batch_images, stream)`` logs a read of a batch on it, as a
training step queued there would do.
"""
from __future__ import annotations

import itertools
import math
import sys
import types
import weakref
from dataclasses import dataclass, field

import numpy as np

from echo_native import _dlpack, _kernel
from echo_native.backends.array import ArrayDevice
from echo_native.output import bfloat16_bits

#: CUDA's limits: gridDim.x, .y, .z and threads per block.
MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_BLOCK = 1024
#: cudaErrorInvalidValue, cudaErrorInvalidDevice, cudaErrorInvalidResourceHandle,
#: cudaErrorNotSupported.
INVALID_VALUE, INVALID_DEVICE, INVALID_HANDLE, NOT_SUPPORTED = 1, 101, 400, 801


class CUDARuntimeError(RuntimeError):
    def __init__(self, status, what=""):
        self.status = status
        super().__init__(f"cudaError {status}{': ' + what if what else ''}")


def byte_bounds(a):
    """[lo, hi) addresses of the bytes array ``a`` spans."""
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
    arena: int         # stream key
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


class Pool:
    """CuPy's memory pool in miniature: one arena per (device, stream), best fit."""

    ROUND = 512

    def __init__(self):
        self.chunks = []

    def malloc(self, nbytes, device, stream):
        size = max(self.ROUND, -(-int(nbytes) // self.ROUND) * self.ROUND)
        fits = [c for c in self.chunks if c.free and c.device == device and
                c.arena == stream.key and c.raw.nbytes >= size]
        if fits:
            chunk = min(fits, key=lambda c: c.raw.nbytes)
            chunk.free = False
        else:
            chunk = _Chunk(np.zeros(size, np.uint8), device, stream.key)
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
        self.states = {}           # handle -> _State of the streams created
        self.stack = {d: [] for d in range(devices)}  # current streams (with stream:)
        self.events = {}
        self.completed = {}        # stream key -> operations the host has waited for
        self.host_reads = []       # (stream, index, lo, hi): copies out of host memory
        self.registered = {}       # ptr -> nbytes of page-locked host memory
        self.log = []              # runtime calls, in order
        self.violations = []
        self.modules = []          # RawModules built (their .options)
        self.launches = []         # (kernel, grid, block, device)
        self.pool = Pool()
        self.refuse_register = False
        self._handles = itertools.count(0x1000, 0x10)
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
            raise CUDARuntimeError(INVALID_HANDLE, f"no stream {handle:#x}") from None

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

    def happens_before(self, a, b):
        """Access ``a`` is ordered before access ``b``."""
        return b.vc.get(a.stream.key, 0) >= a.index

    # -- memory ---------------------------------------------------------------------------
    def allocate(self, shape, dtype):
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        lease = self.pool.malloc(nbytes, self.current_device, self.current_state())
        flat = np.asarray(lease).view(self.cupy.ndarray)
        return flat[:nbytes].view(dtype).reshape(shape)

    def access(self, array, kind, what, stream=None, check_device=True):
        """Log an access to device array ``array`` on ``stream`` (a state; the current
        stream by default) and check it against earlier accesses to the same memory."""
        lo, hi = byte_bounds(array)
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


def _modules(gpu):
    """A fresh ``cupy`` and ``cupyx`` bound to ``gpu``."""

    def check_launch(grid, block):
        grid, block = tuple(int(g) for g in grid), tuple(int(b) for b in block)
        if any(not 1 <= g <= m for g, m in zip(grid, MAX_GRID)) or len(grid) > 3 or \
                math.prod(block) > MAX_BLOCK or min(block) < 1:
            raise CUDARuntimeError(INVALID_VALUE, f"launch grid {grid} block {block}")
        return grid, block

    class ndarray(np.ndarray):
        """A device array: NumPy memory from the pool; accesses are logged."""

        def __setitem__(self, key, value):
            if isinstance(value, ndarray):
                gpu.access(value, "r", "setitem")
            if isinstance(key, ndarray):
                gpu.access(key, "r", "setitem")
            gpu.access(self, "w", "setitem")
            np.ndarray.__setitem__(self.view(np.ndarray), key, np.asarray(value))

        def __getitem__(self, key):
            keys = key if isinstance(key, tuple) else (key,)
            if any(isinstance(k, np.ndarray) for k in keys):  # a copy: the array is read
                gpu.access(self, "r", "getitem")
            return np.ndarray.__getitem__(self, key)

        @property
        def data(self):
            return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])

        @property
        def device(self):
            chunk = gpu.pool.find(*byte_bounds(self))
            return types.SimpleNamespace(id=chunk.device if chunk else gpu.current_device)

        def copy(self, order="C"):
            out = gpu.allocate(self.shape, self.dtype)
            gpu.access(self, "r", "copy")
            gpu.access(out, "w", "copy")
            np.copyto(out.view(np.ndarray), self.view(np.ndarray))
            return out

        def set(self, arr, stream=None):
            """Host -> device on ``stream`` (the current one by default)."""
            state = gpu.current_state() if stream is None else stream.state
            acc = gpu.access(self, "w", "set", state, check_device=False)
            lo, hi = byte_bounds(np.asarray(arr))
            gpu.host_reads.append((state, acc.index, lo, hi))
            np.copyto(self.view(np.ndarray), arr)

        def get(self, stream=None, order="C", out=None, blocking=True):
            """Device -> host on ``stream``, waited for."""
            state = gpu.current_state() if stream is None else stream.state
            acc = gpu.access(self, "r", "get", state, check_device=False)
            if acc is not None:
                gpu.complete(acc.vc)
            return np.array(self.view(np.ndarray), copy=True)

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

    class Device:
        def __init__(self, device=None):
            self.id = gpu.current_device if device is None else int(device)
            if not 0 <= self.id < gpu.devices:
                raise CUDARuntimeError(INVALID_DEVICE, f"device {self.id}")
            self._outer = []

        def __enter__(self):
            self._outer.append(gpu.current_device)
            gpu.current_device = self.id
            return self

        def __exit__(self, *exc):
            gpu.current_device = self._outer.pop()

        def use(self):
            gpu.current_device = self.id

        def synchronize(self):
            for state in [gpu.null[self.id]] + list(gpu.states.values()):
                if state.device == self.id:
                    gpu.complete(state.vc)

        def __eq__(self, other):
            return isinstance(other, Device) and other.id == self.id

        def __hash__(self):
            return hash(self.id)

    class Stream:
        def __init__(self, null=False, non_blocking=False, ptds=False, *, _state=None,
                     _ptr=None):
            if _ptr is not None:         # the default stream, resolved per device
                self.ptr, self._state = _ptr, None
                return
            if _state is None:
                ptr = next(gpu._handles)
                _state = _State(gpu.current_device, ptr, f"stream {ptr:#x}@{gpu.current_device}")
                gpu.states[ptr] = _state
            self._state, self.ptr = _state, _state.ptr

        @property
        def state(self):
            return gpu.resolve(self.ptr) if self._state is None else self._state

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
                gpu.complete(self.vc)

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
        gpu.complete(gpu.resolve(stream).vc)

    def deviceSynchronize():
        Device().synchronize()

    runtime = types.SimpleNamespace(
        CUDARuntimeError=CUDARuntimeError, hostRegister=hostRegister,
        hostUnregister=hostUnregister, eventRecord=eventRecord,
        streamWaitEvent=streamWaitEvent, streamSynchronize=streamSynchronize,
        deviceSynchronize=deviceSynchronize, getDeviceCount=lambda: gpu.devices,
        streamLegacy=1, streamPerThread=2)

    # -- kernels: NumPy versions of kernels.cu ---------------------------------------------
    def host(a):
        return a.view(np.ndarray) if isinstance(a, ndarray) else np.asarray(a)

    def crop_resize(pixels, entry_bytes, entries, shapes, boxes, flips, oh, ow, out):
        entries = host(entries)
        buf = types.SimpleNamespace(pixels=host(pixels)[entries],
                                    shape=host(shapes).reshape(-1, 2))
        ArrayDevice(np).crop_resize(buf, np.arange(len(entries)), host(boxes).reshape(-1, 4),
                                    host(flips).astype(bool), host(out))

    def normalize(src, pixels, hw, nchw, coef, kind, out):
        x = host(src).reshape(-1, hw, 3).astype(np.float64)
        coef = host(coef).astype(np.float64)
        v = (x * coef[:3] + coef[3:]).astype(np.float32)  # one rounding, as fmaf
        if nchw:
            v = v.transpose(0, 2, 1)
        o = host(out).reshape(v.shape)
        o[...] = v if kind == 0 else v.astype(np.float16) if kind == 1 else bfloat16_bits(v)

    def to_bfloat16(src, count, out):
        host(out).reshape(-1)[:count] = bfloat16_bits(host(src).reshape(-1)[:count])

    # The ops kernels: the stand-in's ops_apply runs its whole step through the native
    # executor (the same kernel source built for the host); the statistics the real
    # ops_histogram and ops_tables pass to it are internal to that step.
    def ops_histogram(src, pixels, hw, codes, steps, k, hist):
        pass

    def ops_tables(codes, args, steps, k, n, hw, hist, luts):
        pass

    def ops_apply(src, dst, pixels, h, w, codes, args, steps, k, luts):
        k = int(k)
        c, a = host(codes), host(args)
        img = host(src).reshape(len(c), int(h), int(w), 3).copy()
        _kernel.apply_ops(img, np.ascontiguousarray(c[:, k:k + 1]),
                          np.ascontiguousarray(a[:, k:k + 1]))
        host(dst).reshape(img.shape)[...] = img

    KERNELS = {"crop_resize": (crop_resize, 8), "normalize": (normalize, 6),
               "to_bfloat16": (to_bfloat16, 2),
               "ops_histogram": (ops_histogram, 6), "ops_tables": (ops_tables, 7),
               "ops_apply": (ops_apply, 1)}

    class RawModule:
        def __init__(self, code=None, options=(), **kw):
            self.code, self.options = code, tuple(options)
            gpu.modules.append(self)

        def get_function(self, name):
            if f"void {name}(" not in self.code:
                raise KeyError(name)
            return _Function(name)

    class _Function:
        def __init__(self, name):
            self.name = name

        def __call__(self, grid, block, args, shared_mem=0, stream=None):
            state = gpu.current_state() if stream is None else stream.state
            if state.device != gpu.current_device:
                gpu.violations.append(f"{self.name} launched on {state} with device "
                                      f"{gpu.current_device} current")
                raise CUDARuntimeError(INVALID_HANDLE, "launch on another device's stream")
            grid, block = check_launch(grid, block)
            gpu.launches.append((self.name, grid, block, gpu.current_device))
            run, written = KERNELS[self.name]
            for i, a in enumerate(args):
                if isinstance(a, ndarray) and i != written:
                    gpu.access(a, "r", self.name, state)
            gpu.access(args[written], "w", self.name, state)
            run(*args)

    # -- array functions -----------------------------------------------------------------
    def empty(shape, dtype=np.float64, order="C"):
        return gpu.allocate(shape, dtype)

    def asarray(a, dtype=None, order=None):
        if isinstance(a, ndarray) and (dtype is None or np.dtype(dtype) == a.dtype):
            return a
        if hasattr(a, "__cuda_array_interface__") and not isinstance(a, np.ndarray):
            cai = a.__cuda_array_interface__
            found = [c for c in gpu.pool.chunks if c.lo <= cai["data"][0] < c.hi]
            raw = found[0].raw
            off = cai["data"][0] - found[0].lo
            n = math.prod(cai["shape"]) * np.dtype(cai["typestr"]).itemsize
            view = raw[off:off + n].view(ndarray).view(cai["typestr"]).reshape(cai["shape"])
            return view if dtype is None else view.astype(dtype)
        host_array = np.asarray(a, dtype=dtype)
        out = gpu.allocate(host_array.shape, host_array.dtype)
        gpu.access(out, "w", "asarray")
        np.copyto(out.view(np.ndarray), host_array)
        return out

    def arange(*args, **kw):  # Mix's soft targets
        return asarray(np.arange(*args, **kw))

    def full(shape, fill_value, dtype=None):
        return asarray(np.full(shape, fill_value, dtype))

    def ascontiguousarray(a, dtype=None):
        a = asarray(a, dtype)
        return a if a.flags.c_contiguous else a.copy()

    def take(a, indices, axis=None, out=None):
        gpu.access(a, "r", "take")
        if isinstance(indices, ndarray):
            gpu.access(indices, "r", "take")
        if out is None:
            out = gpu.allocate(np.take(host(a), host(indices), axis=axis).shape, a.dtype)
        gpu.access(out, "w", "take")
        np.take(host(a), host(indices), axis=axis, out=host(out))
        return out

    def asnumpy(a, stream=None, order="C", out=None, blocking=True):
        if isinstance(a, ndarray):
            return a.get(stream=stream)
        if hasattr(a, "__cuda_array_interface__"):
            return asarray(a).get(stream=stream)
        return np.asarray(a)

    cuda = types.SimpleNamespace(
        Device=Device, Stream=Stream, ExternalStream=ExternalStream, Event=Event,
        get_current_stream=get_current_stream, runtime=runtime,
        is_available=lambda: True)
    cupy = types.ModuleType("cupy")
    cupy.__dict__.update(
        ndarray=ndarray, cuda=cuda, RawModule=RawModule, empty=empty, asarray=asarray,
        array=asarray, ascontiguousarray=ascontiguousarray, take=take, asnumpy=asnumpy,
        arange=arange, full=full,
        is_available=lambda: True, uint8=np.uint8, uint16=np.uint16, int32=np.int32,
        int64=np.int64, float16=np.float16, float32=np.float32, float64=np.float64,
        __version__="0+fake", _fake_gpu=gpu)
    cupyx = types.ModuleType("cupyx")
    cupyx.empty_pinned = lambda shape, dtype=np.float64: np.empty(shape, dtype)
    return cupy, cupyx


def install(monkeypatch, devices=2):
    """A fresh fake GPU with ``devices`` devices, as ``cupy``/``cupyx`` in sys.modules."""
    gpu = Gpu(devices)
    monkeypatch.setitem(sys.modules, "cupy", gpu.cupy)
    monkeypatch.setitem(sys.modules, "cupyx", gpu.cupyx)
    return gpu

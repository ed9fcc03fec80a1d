"""The CUDA-only parts of the GPU backend, kept thin (CuPy).

Everything array-shaped is inherited from :class:`echo_native.backends.array.ArrayDevice`
running on CuPy.  What is here cannot be written against an array module:

- the ring's shared memory is page-locked for the GPU (``cudaHostRegister``),
  or, where registration is refused, each slot is staged through one of two
  pinned buffers;
- host-to-device copies run asynchronously on a dedicated stream; an event
  recorded after the copies out of a slot decides when the slot goes back to
  the workers (FFCV's slot/stream/event pattern), so the host never waits for
  a copy it has just queued;
- re-augmentation of canvases and normalisation are one raw kernel launch
  each per batch (bfloat16 output with a Mix: one more, rounding the batch
  mixed in float32), a per-image augmentation program three at most per step
  (``kernels.cu``);
- streams are ordered both ways: a consumer sees a batch only after our work
  on it (``ready`` for the current streams; every export of a batch,
  ``__dlpack__(stream=...)``, ``__cuda_array_interface__``, ``get``, ``copy``,
  for the stream it is taken on), and we overwrite an output buffer only after
  the consumer's work that may read it (``reuse``), and hand buffers back to
  CuPy's pool only after all of it (``release_buffers``);
- every call that records an event, waits or launches selects our device
  first (``with self.device``): CuPy would otherwise use the caller's current
  device, which on ``cuda:1`` is usually device 0.
"""
from __future__ import annotations

import collections
import sys
import weakref

import numpy as np

from echo_native import _kernel
from echo_native.backends.array import ArrayDevice, SlotReturns
from echo_native.backends.launch import (  # noqa: F401 - the launch shapes, named here too
    MAX_BLOCK_THREADS,
    MAX_GRID,
    THREADS,
    check_launch,
    crop_resize_launch,
    normalize_coefficients,
    normalize_launch,
    ops_pixel_launch,
    ops_steps,
    ops_table_launch,
    to_bfloat16_launch,
)
from echo_native.output import BFloat16Array, DeviceArray, output_dtype

#: cudaHostRegisterPortable: the pinning is seen by every CUDA context.
HOST_REGISTER_PORTABLE = 1
#: NVRTC options of the backend's kernels, the one place they are set (the NVRTC
#: test in tests/test_cuda_kernels.py compiles with them too).  ``--fmad=false``:
#: no multiply-add is fused beyond the ``fmaf`` the source writes, the arithmetic
#: of the host build the tests check (``-ffp-contract=off``).
NVRTC_OPTIONS = ("--std=c++11", "--fmad=false")
#: Rotating output buffers per kind on the GPU.  A delivered batch stays valid
#: until the batch after next, as on the CPU; the third buffer lets the copy
#: into batch n + 1 wait only for the steps up to n - 1, so that it overlaps
#: step n instead of following it (see ``CudaDevice.reuse``).
OUTPUT_BUFFERS = 3
#: A batch stays valid until this many later batches have been requested.
VALID_BATCHES = 2
#: The kernels of kernels.cu the backend launches.
KERNELS = ("crop_resize", "normalize", "to_bfloat16", "ops_histogram", "ops_tables",
           "ops_apply")
#: Stream handles that name no stream object: the legacy default stream (0, 1) and the
#: per-thread one (2), which CUDA never destroys.
DEFAULT_STREAMS = (0, 1, 2)
#: What a missing CUDA toolkit needs, for the one-line error of a CudaDevice.
TOOLKIT_HINT = ('install the CUDA headers and NVRTC that CuPy compiles with: pip install '
                '"echo_native[gpu]" (CUDA 12: cupy-cuda12x[ctk]) or "echo_native[gpu13]" '
                '(CUDA 13), or the nvidia-cuda-nvrtc-cu12 and nvidia-cuda-runtime-cu12 wheels, '
                'or set CUDA_PATH to a CUDA toolkit')


def kernel_source():
    """The CUDA C++ source of the backend's kernels: kernels.cu as the extension was
    built from it (src/kernel/kernels.cu, its op codes in place)."""
    return _kernel.cuda_source()


def compile_kernels(cupy, index):
    """``{name: kernel}`` of kernels.cu, compiled for the current device.

    CuPy compiles a module when the first kernel is taken from it, so this is
    where a machine with only the driver fails (CuPy >= 14 compiles with the
    CUDA headers and NVRTC): that is a one-line RuntimeError naming what to
    install.  NVRTC refusing the source itself is a bug of ours, and CuPy's own
    error (with the compiler's log) goes through unchanged."""
    module = cupy.RawModule(code=kernel_source(), options=NVRTC_OPTIONS)
    try:
        return {name: module.get_function(name) for name in KERNELS}
    except Exception as e:
        if type(e).__name__ == "CompileException":
            raise
        cause = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        raise RuntimeError(f"device='cuda:{index}': CuPy cannot compile echo_native's CUDA "
                           f"kernels ({type(e).__name__}: {cause}); {TOOLKIT_HINT}") from None


def _retire_stream(cupy, index, stream):
    """Wait for everything queued on a device's stream before it is destroyed.

    CuPy's pool keeps freed memory per stream handle, and CUDA hands a destroyed
    stream's handle to the next stream made: memory the pipeline freed on its
    stream (output and echo buffers, ordered there after the consumer's reads)
    would reach the next stream with that handle, a second ring's, with none of
    those waits.  Once the host has waited for the stream, nothing queued on it
    still uses that memory."""
    try:
        with cupy.cuda.Device(index):
            stream.synchronize()
    except Exception:  # noqa: BLE001, S110 - at interpreter exit CUDA may be gone already
        pass


#: Output kinds of the ``normalize`` kernel, by the name of the output dtype.
NORMALIZE_KIND = {"float32": 0, "float16": 1, "bfloat16": 2}
#: Batches during which a stream that took one (DLPack, the array interface) is
#: waited on: until the batch it took is no longer valid.
CONSUMER_BATCHES = VALID_BATCHES
#: In a list of events to wait for: the whole device (a host wait).
DEVICE = object()


class CudaDevice(ArrayDevice):
    """Echo buffer, copies and re-augmentation on one GPU.

    ``register=False`` skips page-locking the ring and stages every slot
    through a pinned buffer instead (what happens anyway where the system
    refuses to register shared memory); the benchmark measures both.
    """

    name = "cuda"
    output_buffers = OUTPUT_BUFFERS

    def __init__(self, index=0, register=True):
        import cupy

        super().__init__(cupy)
        self.cupy = cupy
        self.index = int(index)
        self.device = cupy.cuda.Device(self.index)
        with self.device:
            kernels = compile_kernels(cupy, self.index)
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self._crop_resize = kernels["crop_resize"]
        self._normalize = kernels["normalize"]
        self._to_bfloat16 = kernels["to_bfloat16"]
        self._ops_histogram = kernels["ops_histogram"]
        self._ops_tables = kernels["ops_tables"]
        self._ops_apply = kernels["ops_apply"]
        # The stream outlives the device object until the host has waited for it.
        weakref.finalize(self, _retire_stream, cupy, self.index, self.stream)
        self.register = bool(register)
        self.registration = "none"
        self.registration_error = None  # why the system refused to page-lock the ring
        self._ring = None          # the ring served (one at a time)
        self._registered = None    # pointer of the registered ring mapping
        self._staging = [None, None]  # pinned buffers when not registered ...
        self._staged = [None, None]   # ... and events: their last copy is done
        self._turn = 0
        self._returns = SlotReturns()  # slots whose copies may still be in flight
        # Streams a batch was exported to: handle -> [the stream object, held so that
        # CUDA cannot destroy it and reuse its handle while we still record on it (None
        # for the default streams); batches left].
        self._consumers = {}
        # Batches left during which a stream we could not hold (a bare handle) may read.
        self._unheld = 0
        self._delivered = collections.deque()  # buffers of the batches still valid
        self._free_after = {}      # buffer -> events after which no consumer reads it
        self._buffers = set()      # output buffers (reuse() sees each before it is written)
        # Per batch still valid: the arrays it hands out that are made anew each batch
        # (Mix targets, what on_batch returns), held until no consumer work may read them.
        self._kept = collections.deque()
        self.h2d_bytes = 0         # pixels copied host -> device (echoes add none)

    @property
    def device_id(self):
        return self.index

    def describe(self):
        how = {"registered": "ring memory page-locked",
               "pinned-staging": "staged through pinned buffers"}.get(self.registration,
                                                                       "not attached")
        why = f" ({self.registration_error})" if self.registration_error else ""
        return f"cuda:{self.index}, {how}{why}"

    # -- ring memory ---------------------------------------------------------------------------
    def attach(self, ring):
        """Page-lock the ring mapping so copies out of slots are true async DMA."""
        if self._ring is not None:
            raise RuntimeError("this CudaDevice already serves a running ring: give each "
                               "EchoRing its own device")
        self._ring = ring.name
        self.registration, self.registration_error = "none", None
        if not self.register:
            self.registration = "pinned-staging"
            return
        rt = self.cupy.cuda.runtime
        buf = np.frombuffer(ring.buf, np.uint8)
        try:
            with self.device:
                rt.hostRegister(buf.ctypes.data, buf.nbytes, HOST_REGISTER_PORTABLE)
            self._registered = buf.ctypes.data
            self.registration = "registered"
        except rt.CUDARuntimeError as e:
            # Some kernels and sandboxes refuse to pin shared memory: stage instead.
            self.registration = "pinned-staging"
            self.registration_error = str(e)

    def detach(self, ring=None):
        """Before the ring goes away: finish every copy out of it, then unpin it."""
        if ring is not None and ring.name != self._ring:
            return  # not ours (a start that this device refused)
        try:
            self.drain()
        finally:
            self._ring = None
            ptr, self._registered = self._registered, None
            if ptr is not None:
                with self.device:
                    try:
                        # Not every copy out of the ring has an event: an exception
                        # between a store and its release leaves one without.  Every
                        # copy is on our stream: wait for all of them.
                        self.stream.synchronize()
                    finally:
                        self.cupy.cuda.runtime.hostUnregister(ptr)

    def release_after_copies(self, release):
        if self._registered is None:
            release()  # staged: the slot was already copied, by the CPU
            return
        # The event follows every copy queued so far on our stream, so it
        # covers all copies out of this slot.
        self._returns.add(self._mark(), release)

    def drain(self):
        self._returns.drain()
        for event in self._staged:
            if event is not None:
                event.synchronize()
        self._staged = [None, None]

    def _host_source(self, host):
        """A host array the copy engine can read asynchronously: the ring itself
        when registered, else the next of two pinned buffers (the host waits only
        for the copy before last out of it)."""
        if self._registered is not None:
            return host
        import cupyx
        self._turn ^= 1
        turn = self._turn
        if self._staged[turn] is not None:
            self._staged[turn].synchronize()
        if self._staging[turn] is None or self._staging[turn].nbytes < host.nbytes:
            self._staging[turn] = cupyx.empty_pinned(host.nbytes, dtype=np.uint8)
        view = self._staging[turn][:host.nbytes].view(host.dtype).reshape(host.shape)
        view[...] = host
        return view

    def _copy_in(self, dst, host):
        """Queue host -> device on our stream (``host`` is ring memory)."""
        host = np.ascontiguousarray(host)
        self.h2d_bytes += host.nbytes
        with self.device:
            dst.set(self._host_source(host), stream=self.stream)
            if self._registered is None:
                self._staged[self._turn] = self._mark()

    # -- array operations on our stream ---------------------------------------------------
    def empty(self, shape, dtype):
        with self.device, self.stream:
            return self.cupy.empty(shape, dtype=dtype)

    def to_device(self, host, out=None):
        if out is None:
            out = self.empty(host.shape, host.dtype)
        self._copy_in(out, host)
        return out

    def store(self, buffer, entries, slot, count, fixed_shape):
        # Whole slot rows in one copy (canvases sit at the start of their row),
        # then one scatter into the echo buffer on the device.
        cp = self.cupy
        row = buffer.pixels.shape[1]
        with self.device, self.stream:
            staged = cp.empty((count, row), dtype=cp.uint8)
            self._copy_in(staged, slot.pixels[:count, :row])
            buffer.pixels[cp.asarray(np.asarray(entries, np.int64))] = staged

    def copy(self, src, out):
        with self.device, self.stream:
            return super().copy(src, out)

    def gather(self, buffer, entries, out, mirror=None):
        with self.device, self.stream:
            super().gather(buffer, entries, out, mirror)

    def flip(self, images, mask):
        with self.device, self.stream:
            super().flip(images, mask)

    def mix(self, images, lam, box, layout):
        with self.device, self.stream:
            return super().mix(images, lam, box, layout)

    def targets(self, labels, num_classes, lam, smoothing):
        with self.device, self.stream:
            return super().targets(labels, num_classes, lam, smoothing)

    def objects_to_device(self, objects):
        """A batch's detection objects (host arrays) as arrays of our device, whatever
        device is current, copied on our stream: ``ready``'s event covers them, and
        they are held as the other arrays made anew each batch are."""
        with self.device, self.stream:
            return objects.to(self.cupy)

    def normalize(self, images, mean, std, layout, out):
        cp = self.cupy
        n, h, w, _ = images.shape
        coef = normalize_coefficients(mean, std)
        with self.device, self.stream:
            src = cp.ascontiguousarray(images)
            grid, block = normalize_launch(n * h * w)
            self._normalize(grid, block, (src, np.int64(n * h * w), np.int32(h * w),
                                          np.int32(layout == "NCHW"), cp.asarray(coef),
                                          np.int32(NORMALIZE_KIND[output_dtype(out)]), out))
        return out

    def to_bfloat16(self, values, out):
        count = values.size
        with self.device, self.stream:
            grid, block = to_bfloat16_launch(count)
            self._to_bfloat16(grid, block, (self.cupy.ascontiguousarray(values),
                                            np.int64(count), out))
        return out

    def crop_resize(self, buffer, entries, boxes, flips, out):
        cp = self.cupy
        n = len(entries)
        oh, ow = out.shape[1:3]
        if n == 0:
            return
        shapes = np.ascontiguousarray(buffer.shape[entries], np.int32)
        with self.device, self.stream:
            grid, block = crop_resize_launch(n, oh, ow)
            self._crop_resize(grid, block, (
                buffer.pixels, np.int64(buffer.pixels.shape[1]),
                cp.asarray(np.asarray(entries, np.int64)), cp.asarray(shapes),
                cp.asarray(np.ascontiguousarray(boxes, np.float64)),
                cp.asarray(np.asarray(flips, np.uint8)), np.int32(oh), np.int32(ow), out))

    def augment(self, images, codes, args, after=None):
        """The per-image programs (host ``codes`` int32 (n, K), ``args`` float32
        (n, K, 8)) on ``images``, a C-contiguous (n, h, w, 3) uint8 array on our device,
        in place, on our stream (``after`` is already ordered before by the stream).

        The program is checked on the host as the CPU path checks it, then
        uploaded; each step k is ``ops_histogram`` (when some row's op counts),
        ``ops_tables`` (when some row's op is a table) and ``ops_apply``, from one
        buffer into the other; an odd number of steps ends with a copy back.
        Returns None: the work is ordered by the stream."""
        cp = self.cupy
        if images.dtype != np.uint8 or images.ndim != 4 or not images.flags.c_contiguous:
            raise ValueError(f"images must be a C-contiguous (n, h, w, 3) uint8 array, got "
                             f"{images.dtype} {images.shape}")
        _kernel.check_ops(codes, args, images.shape)
        plan = list(ops_steps(codes))
        if not plan:
            return None
        n, h, w, _ = images.shape
        steps = codes.shape[1]
        grid, block = ops_pixel_launch(n, h, w)
        table_grid, table_block = ops_table_launch(n)
        pixels, hw, steps = np.int64(n * h * w), np.int32(h * w), np.int32(steps)
        with self.device, self.stream:
            d_codes, d_args = cp.asarray(codes), cp.asarray(args)
            hist = cp.empty((n, 3, 256), dtype=cp.int32)
            luts = cp.empty((n, 3, 256), dtype=cp.uint8)
            src, dst = images, cp.empty(images.shape, dtype=cp.uint8)
            for k, count, tables in plan:
                k = np.int32(k)
                if count:
                    hist.fill(0)
                    self._ops_histogram(grid, block, (src, pixels, hw, d_codes, steps, k, hist))
                if tables:
                    self._ops_tables(table_grid, table_block, (d_codes, d_args, steps, k,
                                                               np.int64(n), hw, hist, luts))
                self._ops_apply(grid, block, (src, dst, pixels, np.int32(h), np.int32(w),
                                              d_codes, d_args, steps, k, luts))
                src, dst = dst, src
            if src is not images:
                images[...] = src
        return None

    # -- ordering against the consumer ----------------------------------------------------
    def _mark(self, stream=None):
        """An event after the work queued so far on ``stream`` (a handle; ours by default).

        Blocking-sync events: a host that waits for one sleeps instead of spinning.
        Created and recorded with our device current (an event must be recorded on a
        stream of its own device)."""
        with self.device:
            event = self.cupy.cuda.Event(block=True, disable_timing=True)
            self.cupy.cuda.runtime.eventRecord(
                event.ptr, self.stream.ptr if stream is None else stream)
        return event

    def _consumer_streams(self):
        """Streams a consumer may be using our batches on right now, handle -> the
        stream object we hold: CuPy's and torch's current streams on our device, and
        the streams batches were exported to."""
        streams = {handle: owner for handle, (owner, _) in self._consumers.items()}
        with self.device:
            current = self.cupy.cuda.get_current_stream()
        streams[current.ptr] = current
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            ts = torch.cuda.current_stream(self.index)
            streams[ts.cuda_stream] = ts
        streams.pop(self.stream.ptr, None)
        return streams

    def _consumer_marks(self):
        """Events after the work queued so far on every consumer stream; ``DEVICE`` when
        a stream we could not hold may read: only a wait for the whole device covers
        it."""
        marks = [self._mark(handle) for handle in self._consumer_streams()]
        return marks + [DEVICE] if self._unheld else marks

    def _wait_for(self, events):
        """Order our stream after ``events`` (``DEVICE``: the host waits for the device)."""
        with self.device:
            for event in events:
                if event is DEVICE:
                    self.device.synchronize()
                else:
                    self.stream.wait_event(event)

    def _hold(self, stream):
        """``(handle, stream object or None)`` of a consumer stream given as a handle
        (None: the legacy default stream) or an object.  A handle is held through the
        object it belongs to where we can find it: CuPy's or torch's current stream of
        our device, which those who export a batch hand us (cupy.from_dlpack,
        torch.from_dlpack)."""
        if stream is None:
            return 0, None
        if not isinstance(stream, (int, np.integer)):
            return int(stream.ptr), stream
        handle = int(stream)
        if handle in DEFAULT_STREAMS:
            return handle, None
        with self.device:
            current = self.cupy.cuda.get_current_stream()
        if current.ptr == handle:
            return handle, current
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            ts = torch.cuda.current_stream(self.index)
            if ts.cuda_stream == handle:
                return handle, ts
        return handle, None

    @staticmethod
    def _key(array):
        """Which output buffer ``array`` is (a view of): its device address."""
        return array.data.ptr

    def reuse(self, array):
        """Before our stream overwrites output buffer ``array``: wait for the consumer's
        work that may read the batch it held.

        A batch is valid until the batch after next is requested, so the events
        ``ready`` records on the consumer's streams at that request cover every
        read of it.  With three buffers they are at hand when its buffer comes
        round again, one batch later: the copy into the buffer waits for the
        consumer's steps up to the batch before last, not for the step it has
        just queued, and so overlaps it.  A buffer that still holds a valid
        batch (two buffers) waits for everything queued so far; one that was
        never delivered (the uint8 images of a normalised batch) for nothing."""
        key = self._key(array)
        self._buffers.add(key)
        if key in self._delivered:
            self._delivered.remove(key)
            self._free_after.pop(key, None)
            events = self._consumer_marks()
        else:
            events = self._free_after.pop(key, ())
        self._wait_for(events)
        return array

    def release_buffers(self):
        """Before the pipeline drops its output and echo buffers: their memory goes back
        to CuPy's pool for our stream, where the next allocation on it (a second ring
        on this device) may take it at once.  Order our stream after every consumer
        read of them first."""
        events = [e for marks in self._free_after.values() for e in marks]
        events += self._consumer_marks()
        self._wait_for(events)
        self._delivered.clear()
        self._free_after.clear()
        self._buffers.clear()
        self._kept.clear()  # ordered after the same reads: their memory may go back too

    def ready(self, batch):
        """Order the consumer's current stream after everything we queued, note which
        consumer work may read the batch before last, and give back the slots whose
        copies have finished.  uint8, float32 and float16 images, and Mix targets, leave
        as a :class:`DeviceArray` (CuPy's array, exported through us)."""
        images = batch.images
        with self.device:
            done = self._mark()
            self.cupy.cuda.get_current_stream().wait_event(done)
        # Everything queued before this request may read the batch before last;
        # nothing queued later may: these events free its buffer.
        marks = self._consumer_marks()
        raw = images.bits if isinstance(images, BFloat16Array) else images
        fresh = []
        if self._key(raw) in self._buffers:
            self._delivered.append(self._key(raw))
            while len(self._delivered) > VALID_BATCHES:
                self._free_after[self._delivered.popleft()] = marks
        else:
            fresh.append(raw)  # on_batch's own array
        targets = batch.targets
        if targets is not None and not isinstance(targets, DeviceArray):
            fresh.append(targets)
            batch.targets = DeviceArray(targets, self, done)
        objects = batch.objects
        if objects is not None:
            fresh += [a for a in objects.arrays() if isinstance(a, self.cupy.ndarray)]
        # An array made anew each batch goes back to CuPy's pool for our stream when its
        # last reference goes, and our next allocation may take it at once: dropped by
        # the consumer, it could be rewritten under a step still queued on it.  Held
        # here while the batch is valid; released once our stream is ordered after
        # every consumer read of it (the same events that free a buffer).
        self._kept.append(fresh)
        while len(self._kept) > VALID_BATCHES:
            if self._kept.popleft():
                self._wait_for(marks)
        # A stream that took a batch matters while that batch is valid; let go of it
        # then (its owner may destroy it).
        for handle in list(self._consumers):
            self._consumers[handle][1] -= 1
            if self._consumers[handle][1] <= 0:
                del self._consumers[handle]
        self._unheld = max(0, self._unheld - 1)
        if isinstance(images, BFloat16Array):
            images.event = done
        else:
            batch.images = DeviceArray(images, self, done)
        self._returns.poll()
        return batch

    def run_user_op(self, fn, images, keys):
        """``fn(images, cupy, keys)`` with our device current and our stream CuPy's
        current stream: the CuPy work it queues follows the batch's copy, kernels and
        Mix on our stream, and precedes the event :meth:`ready` records after them.
        (A framework with streams of its own, torch say, runs its work on its own
        current stream: that is not ordered.)"""
        with self.device, self.stream:
            return fn(images, self.xp, keys)

    def copy_out(self, array, after=None):
        """A copy made on the consumer's current stream (so that it may use it at once),
        after event ``after``; and the event after which the copy is complete.  That
        stream reads ``array``: it is remembered as a consumer stream."""
        with self.device:
            current = self.cupy.cuda.get_current_stream()
            self.order_consumer(current, after)
            copy = array.copy()
            return copy, self._mark(current.ptr)

    def to_host(self, array, after=None):
        """A NumPy copy of ``array``, made on the current stream after event ``after``."""
        with self.device:
            current = self.cupy.cuda.get_current_stream()
            if after is not None:
                current.wait_event(after)
            return array.get(stream=current)

    def array_interface(self, array, event, remember=True):
        """``__cuda_array_interface__`` of a batch: it names the current stream of our
        device, which is ordered after ``event`` (and remembered) first."""
        with self.device:
            self.order_consumer(self.cupy.cuda.get_current_stream(), event, remember)
            return array.__cuda_array_interface__

    def order_consumer(self, stream, event, remember=True):
        """An export to ``stream`` (a stream object, a handle, None: the legacy default
        stream, -1: the consumer orders itself): make it wait for ``event`` and, with
        ``remember``, make our stream wait for it before the buffer is reused.

        A remembered stream is held by reference, so that it is never destroyed (and
        its handle given to another stream) while we may still record on it.  A bare
        handle we cannot hold (a stream of JAX's, one made by hand) is used now, while
        its owner hands it to us, but never later: until the batch is no longer
        valid, reusing a buffer waits for the whole device instead."""
        if isinstance(stream, (int, np.integer)) and int(stream) == -1:
            return
        handle, owner = self._hold(stream)
        if event is not None:
            with self.device:
                self.cupy.cuda.runtime.streamWaitEvent(handle, event.ptr, 0)
        if not remember or handle == self.stream.ptr:
            return
        if owner is not None or handle in DEFAULT_STREAMS:
            self._consumers[handle] = [owner, CONSUMER_BATCHES]
        else:
            self._unheld = CONSUMER_BATCHES

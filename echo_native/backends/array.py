"""The array-module backend: every emission step written once against ``xp``.

A backend turns echo-buffer entries into an output batch: ``store`` (ring slot
-> buffer), ``gather`` (repeat prepared images), ``reaugment`` (re-augment
canvases: ``crop_resize`` then ``augment``, the per-image op programs), ``flip``,
``normalize`` and ``to_device`` (a fresh batch that is not echoed).  :class:`ArrayDevice` runs on NumPy or CuPy; the CPU backend swaps in
the native resampler, the CUDA backend adds what only CUDA has.  Which entries
are emitted is decided by :mod:`echo_native.echo`, the same for every backend.
"""
from __future__ import annotations

import collections

import numpy as np

from echo_native import _kernel
from echo_native.mix import soft_targets
from echo_native.output import bfloat16_bits

def pillow_weights(in0, in1, in_size, out_size):
    """Dense (out_size, in_size) float64 weights of Pillow's antialiased bilinear filter
    for the interval [in0, in1) resampled to out_size pixels."""
    scale = (in1 - in0) / out_size
    fs = max(scale, 1.0)
    w = np.zeros((out_size, in_size))
    for i in range(out_size):
        center = in0 + (i + 0.5) * scale
        lo = max(int(center - fs + 0.5), 0)
        hi = min(int(center + fs + 0.5), in_size)
        x = np.arange(lo, hi)
        k = np.clip(1.0 - np.abs((x - center + 0.5) / fs), 0.0, None)
        total = k.sum()
        if total > 0:
            w[i, lo:hi] = k / total
    return w


class ArrayDevice:
    """Every emission step over an array module ``xp`` (NumPy or CuPy)."""

    name = "array"

    def __init__(self, xp=np):
        self.xp = xp

    #: The backend's arrays are the host arrays themselves: a fresh batch can be
    #: handed out as the ring slot's view, without a copy.
    host_resident = False
    device_id = 0
    #: Rotating output buffers per kind (at least two: a delivered batch stays valid
    #: until the batch after next).  Copies on the host are synchronous: two suffice.
    output_buffers = 2
    #: Example echo may emit the next batch before the consumer has this one: the
    #: device then makes its pixels in the background (see ``synchronize``).
    prepares_ahead = False

    def describe(self):
        """One line for stats(): the backend and how fresh batches reach it."""
        return self.name

    # -- life cycle hooks (CUDA registers ring memory, orders streams) --------------
    def objects_to_device(self, objects):
        """A batch's objects as arrays of this device's module (a GPU device places them
        on its own device and stream, whichever device is current)."""
        return objects.to(self.xp)

    def attach(self, ring):
        """Called whenever the loader has created its ring (start, and after a seek)."""

    def detach(self, ring=None):
        """Called before ``ring`` goes away: nothing may still be reading it."""
        self.drain()

    def release_after_copies(self, release):
        """``release()`` gives a ring slot back to the workers; call it once every
        copy out of the slot has completed.  Copies here are synchronous: now."""
        release()

    def drain(self):
        """Return every slot still waiting for its copies."""

    def reuse(self, array):
        """Called before an output buffer is overwritten with a new batch."""
        return array

    def release_buffers(self):
        """Called before the pipeline drops its output and echo buffers (close): their
        memory must not be reused before the consumer's work on them."""

    def synchronize(self, job=None):
        """Block until ``job`` (what :meth:`crop_resize` returned), or every emission
        step queued so far, has written its output."""

    #: :meth:`job_seconds` times the device's work on each job (the CPU backend's
    #: host thread and pool); here the work is done inside the calls that queue it.
    times_jobs = False

    def job_seconds(self, job):
        """Seconds the device spent making ``job`` (after :meth:`synchronize`), for auto
        echo's capacity model; None where the work is not timed this way (here it is
        done inside the call that made the job, which the echo stage times itself)."""

    def use_threads(self, threads):
        """Make emissions on ``threads`` host threads (None: as many as the process may
        use).  Only a backend that makes them on host threads has anything to size."""

    def ready(self, batch):
        """Called on each batch before it reaches the consumer."""
        return batch

    def run_user_op(self, fn, images, keys):
        """``fn(images, xp, keys)``, the pipeline's ``on_batch``, where the batch's own
        work runs: after everything queued for the batch, before :meth:`ready`."""
        return fn(images, self.xp, keys)

    def order_consumer(self, stream, event, remember=True):
        """DLPack export on ``stream``: make it wait for the batch and, with ``remember``,
        wait for it before reusing the buffer (no-op on the host)."""

    def copy_out(self, array, after=None):
        """A copy of an output array (made after event ``after``), and the event after
        which the copy is complete."""
        return array.copy(), None

    # -- moving pixels -------------------------------------------------------------------
    def empty(self, shape, dtype):
        return self.xp.empty(shape, dtype=dtype)

    def to_device(self, host, out=None):
        """A copy of ``host`` (ring memory, about to be reused) on the device."""
        if out is None:
            return self.xp.array(host, copy=True)
        out[...] = self.xp.asarray(host)
        return out

    def store(self, buffer, entries, slot, count, fixed_shape):
        """Copy ``count`` samples of a slot into buffer entries."""
        xp = self.xp
        if fixed_shape:
            buffer.pixels[xp.asarray(entries)] = xp.asarray(slot.pixels[:count])
            return
        for i, e in enumerate(entries):
            n = int(slot.shapes[i][0]) * int(slot.shapes[i][1]) * 3
            buffer.pixels[int(e), :n] = xp.asarray(slot.pixels[i, :n])

    def copy(self, src, out):
        """Device to device: a repeated batch."""
        out[...] = src
        return out

    def gather(self, buffer, entries, out, mirror=None):
        """Stored examples ``entries`` into ``out``, those where ``mirror`` (a host bool
        array, or None) mirrored left to right.  Returns a job for :meth:`synchronize`
        (None: done already)."""
        xp = self.xp
        xp.take(buffer.pixels, xp.asarray(entries), axis=0, out=out.reshape(len(entries), -1))
        if mirror is not None:
            self.flip(out, mirror)

    def flip(self, images, mask):
        idx = np.flatnonzero(mask)
        if len(idx):
            idx = self.xp.asarray(idx)
            images[idx] = images[idx][:, :, ::-1]

    def crop_resize(self, buffer, entries, boxes, flips, out):
        """Re-augment: crop box i of canvas ``entries[i]``, resize into out[i], flip.
        Returns a job for :meth:`synchronize` (None: done already).

        One separable weighted sum in float, rounded once (the native CPU path
        rounds between its two passes, as Pillow does: they agree within 1-2
        levels)."""
        xp = self.xp
        oh, ow = out.shape[1:3]
        for i, e in enumerate(entries):
            h, w = (int(v) for v in buffer.shape[e])
            top, left, bh, bw = (float(v) for v in boxes[i])
            wy = pillow_weights(top, top + bh, h, oh)
            wx = pillow_weights(left, left + bw, w, ow)
            if flips[i]:
                wx = wx[::-1]
            canvas = buffer.pixels[int(e), :h * w * 3].reshape(h, w, 3).astype(xp.float32)
            rows = xp.asarray(wy, dtype=xp.float32)
            cols = xp.asarray(np.ascontiguousarray(wx), dtype=xp.float32)
            res = xp.einsum("oh,hwc->owc", rows, canvas)
            res = xp.einsum("pw,owc->opc", cols, res)
            out[i] = xp.clip(xp.floor(res + 0.5), 0, 255).astype(xp.uint8)

    def reaugment(self, buffer, entries, boxes, flips, out, codes=None, args=None):
        """Re-augment emitted canvases: :meth:`crop_resize` into ``out``, then, with
        ``codes`` and ``args``, :meth:`augment` runs each row's program on its crop.
        Returns the job for :meth:`synchronize` (None: done already)."""
        job = self.crop_resize(buffer, entries, boxes, flips, out)
        if codes is not None:
            job = self.augment(out, codes, args, after=job) or job
        return job

    def augment(self, images, codes, args, after=None):
        """Run a program per image on ``images`` (n, h, w, 3) uint8, in place: ``codes``
        int32 (n, K) and ``args`` float32 (n, K, 8), the ops of
        :data:`echo_native._kernel.Op`.  Returns a job for :meth:`synchronize`
        (None: done already).  ``after`` is the job the pixels come from (what
        :meth:`crop_resize` returned); work here is synchronous, so it is done.

        The native kernel (the CUDA kernels' source built for the host) on host
        memory; another array module's images go through a host copy."""
        if self.xp is np:
            _kernel.apply_ops(images, codes, args)
            return None
        _kernel.check_ops(codes, args, images.shape)
        host = np.ascontiguousarray(self.xp.asnumpy(images))
        _kernel.apply_ops(host, codes, args)
        images[...] = self.xp.asarray(host)
        return None

    def mix(self, images, lam, box, layout):
        """Mix row i with row B-1-i in place: ``lam * x + (1 - lam) * reversed`` (MixUp,
        ``box`` None) or the reversed batch's ``box`` = (top, bottom, left, right)
        pasted in (CutMix)."""
        xp = self.xp
        if box is None:
            if lam != 1.0:
                reverse = images[::-1] * xp.asarray(1.0 - lam, images.dtype)  # a copy
                images *= xp.asarray(lam, images.dtype)
                images += reverse
            return images
        top, bottom, left, right = box
        rows, cols = slice(top, bottom), slice(left, right)
        region = (slice(None), rows, cols) if layout == "NHWC" else \
            (slice(None), slice(None), rows, cols)
        images[region] = images[::-1][region].copy()
        return images

    def targets(self, labels, num_classes, lam, smoothing):
        """Soft targets on the device (see :func:`echo_native.mix.soft_targets`)."""
        return soft_targets(self.xp, labels, num_classes, lam, smoothing)

    def normalize(self, images, mean, std, layout, out):
        """(x / 255 - mean) / std into ``out``, NHWC or NCHW: float32, float16, or
        bfloat16 held as its bits in a uint16 array (see :func:`storage_dtype`)."""
        xp = self.xp
        bshape = (1, 1, 1, 3) if layout == "NHWC" else (1, 3, 1, 1)
        scale = xp.asarray(1.0 / (255.0 * np.asarray(std)), dtype=xp.float32).reshape(bshape)
        shift = xp.asarray(-np.asarray(mean) / np.asarray(std), dtype=xp.float32).reshape(bshape)
        src = images if layout == "NHWC" else images.transpose(0, 3, 1, 2)
        if out.dtype == xp.float32:
            xp.multiply(src, scale, out=out)
            out += shift
        elif out.dtype == xp.uint16:
            out[...] = bfloat16_bits(src * scale + shift)
        else:
            out[...] = src * scale + shift
        return out

    def to_bfloat16(self, values, out):
        """float32 ``values`` rounded to bfloat16 (to nearest even, as ``normalize``
        rounds) into ``out``, their bits in a uint16 array of the same shape."""
        out[...] = bfloat16_bits(values)
        return out


class SlotReturns:
    """Ring slots waiting for the copies out of them before going back to the workers.

    Each entry is (event, release): ``event`` (``.done``, ``.synchronize()``,
    as a CUDA event) completes after the slot's copies, ``release()`` hands
    the slot back.  Slots go back as soon as their events are seen done; at
    most ``in_flight`` wait, so the host only ever waits for an older copy,
    never for the one it has just queued.
    """

    def __init__(self, in_flight=1):
        self.in_flight = in_flight
        self._queue = collections.deque()

    def __len__(self):
        return len(self._queue)

    def add(self, event, release):
        self._queue.append((event, release))
        self.poll()

    def poll(self, keep=None):
        keep = self.in_flight if keep is None else keep
        queue = self._queue
        while queue and (len(queue) > keep or queue[0][0].done):
            event, release = queue.popleft()
            event.synchronize()
            release()

    def drain(self):
        self.poll(0)

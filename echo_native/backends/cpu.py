"""The CPU backend: echo buffer in host memory, re-augmentation by the native kernel."""
from __future__ import annotations

import concurrent.futures

import numpy as np

from echo_native import _kernel
from echo_native.backends.array import ArrayDevice

#: Seconds one batch's re-augmentation may take before ``synchronize`` gives up: a
#: batch is a bounded amount of arithmetic, so hitting this means a stuck host.
HOST_WAIT_S = 300.0


class CpuDevice(ArrayDevice):
    """Echo buffer in host memory; re-augmentation by the native resampler with the
    GIL released, numerically identical to the fused decode path.

    Re-augmenting a batch from stored canvases is about 0.15 ms of CPU per image,
    as much as a 20 ms training step for a batch of 128.  It runs on a host
    thread, one batch ahead, so it overlaps the consumer's step instead of adding
    to it; a third output buffer keeps the batch after next untouched meanwhile.
    """

    name = "cpu"
    host_resident = True
    output_buffers = 3
    prepares_ahead = True

    def __init__(self):
        super().__init__(np)
        self._dec = _kernel.Decoder()
        self._host = None     # one thread: batches are made in emission order
        self._last = None     # the last job queued

    def store(self, buffer, entries, slot, count, fixed_shape):
        if fixed_shape:
            buffer.pixels[entries] = slot.pixels[:count]
            return
        for i, e in enumerate(entries):
            n = int(slot.shapes[i][0]) * int(slot.shapes[i][1]) * 3
            buffer.pixels[e, :n] = slot.pixels[i, :n]

    def gather(self, buffer, entries, out, mirror=None):
        # On the host thread, like re-augmentation: a batch of 128 stored examples is
        # 19 MB to copy, a quarter of a 20 ms step if the consumer made it.
        self._last = self._executor().submit(
            _kernel.gather_rows, buffer.pixels, np.ascontiguousarray(entries, np.int64), out,
            None if mirror is None else np.ascontiguousarray(mirror, bool).view(np.uint8))
        return self._last

    def to_device(self, host, out=None):
        if out is None:
            return host
        out[...] = host
        return out

    def _executor(self):
        if self._host is None:
            self._host = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="echo_native-reaugment")
        return self._host

    def crop_resize(self, buffer, entries, boxes, flips, out):
        # One thread runs the jobs in order: waiting for a job waits for those before it.
        self._last = self._executor().submit(
            self._dec.resize_batch, buffer.pixels, np.ascontiguousarray(entries, np.int64),
            buffer.shape, np.ascontiguousarray(boxes, np.float64),
            np.ascontiguousarray(flips, bool).view(np.uint8), out)
        return self._last

    def augment(self, images, codes, args, after=None):
        """Queue the per-image programs after the batch's crop (the job ``after``; by
        default the last job queued), on the same thread, so they run on its pixels
        once it has written them.  The program is checked and copied now: a bad one
        raises here, and the caller may reuse its arrays.  Returns the job; if
        ``after`` failed, this job fails with its error rather than augmenting
        pixels that were never written."""
        if not (isinstance(images, np.ndarray) and images.dtype == np.uint8 and
                images.ndim == 4 and images.flags.c_contiguous and images.flags.writeable):
            raise ValueError(f"images must be a C-contiguous writable (n, h, w, 3) uint8 "
                             f"array, got {type(images).__name__} "
                             f"{getattr(images, 'dtype', '')} {getattr(images, 'shape', '')}")
        _kernel.check_ops(codes, args, images.shape)
        after = self._last if after is None else after
        self._last = self._executor().submit(self._augment, images, codes.copy(), args.copy(),
                                             after)
        return self._last

    @staticmethod
    def _augment(images, codes, args, after):
        if after is not None:
            after.result()  # queued before us on this one thread: finished; re-raise a failure
        _kernel.apply_ops(images, codes, args)

    def synchronize(self, job=None):
        job = self._last if job is None else job
        if job is None:
            return
        try:
            job.result(timeout=HOST_WAIT_S)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"re-augmenting a batch on the host took over {HOST_WAIT_S:.0f} s"
                               ) from None
        finally:
            # A failed job is reported once, to the caller that waits for it: clean-up
            # after the error (detach, release_buffers) must not raise it again.
            if job is self._last and job.done():
                self._last = None

    def detach(self, ring=None):
        self.synchronize()
        super().detach(ring)

    def release_buffers(self):
        try:
            self.synchronize()
        finally:  # a failed last job still ends the host thread
            if self._host is not None:
                self._host.shutdown(wait=True)
                self._host = None

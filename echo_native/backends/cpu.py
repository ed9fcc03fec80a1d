"""The CPU backend: echo buffer in host memory, re-augmentation by the native kernel on a
pool of native threads."""
from __future__ import annotations

import concurrent.futures
import os
import time

import numpy as np

from echo_native import _kernel
from echo_native.backends.array import ArrayDevice

#: Seconds one batch's re-augmentation may take before ``synchronize`` gives up: a
#: batch is a bounded amount of arithmetic, so hitting this means a stuck host.
HOST_WAIT_S = 300.0


def available_cores():
    """Cores this process may run on (its affinity mask; the CPU count where the platform
    has no affinity)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def check_threads(owner, threads):
    """``threads`` as a positive int, or None (size the pool from the cores)."""
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
        raise ValueError(f"{owner}: threads must be a positive integer or None (as many as "
                         f"the process may use), got {threads!r}")
    return int(threads)


def _timed(fn, *args):
    """Run ``fn(*args)``: the seconds it took are the job's result (auto echo's measure
    of the echo stage's own time per emission)."""
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


class CpuDevice(ArrayDevice):
    """Echo buffer in host memory; re-augmentation by the native resampler and the ops'
    kernels with the GIL released, numerically identical to the fused decode path.

    A batch is re-augmented by a pool of native threads (``_kernel.Reaugmenter``),
    its rows shared out among them: each row's crop, resize and op program is one
    task, and no row depends on another or on the thread that made it, so the
    pixels are the same for any thread count.  The pool has one thread per core the
    process may use (``os.sched_getaffinity``) unless ``threads`` says otherwise:
    where the echo stage is the bottleneck the workers sleep on a full ring and
    every core re-augments; where the upstream is, the pool sleeps between batches
    and the workers have the cores (docs/design.md, "Re-augmentation on every core").

    The batches are handed to the pool by one host thread, in emission order and
    one batch ahead, so they overlap the consumer's step instead of adding to it;
    a third output buffer keeps the batch after next untouched meanwhile.
    """

    name = "cpu"
    host_resident = True
    output_buffers = 3
    prepares_ahead = True
    times_jobs = True

    def __init__(self, threads=None):
        super().__init__(np)
        self._threads = check_threads("CpuDevice", threads)
        self._pool = None     # the Reaugmenter, made at first use
        self._host = None     # one thread: batches are made in emission order
        self._last = None     # the last job queued

    # -- the pool ------------------------------------------------------------------------
    @property
    def threads(self):
        """Threads re-augmenting a batch (the pool's size)."""
        return self._threads if self._threads is not None else available_cores()

    def use_threads(self, threads):
        threads = check_threads("threads", threads)
        if threads == self._threads:
            return
        self.synchronize()    # no batch of the old pool in flight
        self._threads, self._pool = threads, None

    def _reaugmenter(self):
        if self._pool is None or self._pool.threads != self.threads:
            self._pool = _kernel.Reaugmenter(self.threads)
        return self._pool

    def _executor(self):
        if self._host is None:
            self._host = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="echo_native-reaugment")
        return self._host

    def _queue(self, fn, *args):
        # One thread runs the jobs in order: waiting for a job waits for those before it.
        self._last = self._executor().submit(_timed, fn, *args)
        return self._last

    def job_seconds(self, job):
        if isinstance(job, concurrent.futures.Future) and job.done() and \
                job.exception() is None:
            return job.result()
        return None

    # -- emission steps -------------------------------------------------------------------
    def store(self, buffer, entries, slot, count, fixed_shape):
        entries = np.ascontiguousarray(entries, np.int64)
        if fixed_shape:
            buffer.pixels[entries] = slot.pixels[:count]
            return
        shapes = np.asarray(slot.shapes[:count], np.int64)
        _kernel.store_rows(buffer.pixels, entries, slot.pixels,
                           np.ascontiguousarray(shapes[:, 0] * shapes[:, 1] * 3))

    def gather(self, buffer, entries, out, mirror=None):
        # On the pool, like re-augmentation: a batch of 128 stored examples is 19 MB
        # to copy, a quarter of a 20 ms step if the consumer made it.
        pool = self._reaugmenter()
        return self._queue(
            pool.gather, buffer.pixels, np.ascontiguousarray(entries, np.int64), out,
            None if mirror is None else np.ascontiguousarray(mirror, bool).view(np.uint8))

    def to_device(self, host, out=None):
        if out is None:
            return host
        out[...] = host
        return out

    def reaugment(self, buffer, entries, boxes, flips, out, codes=None, args=None):
        """Crop, resize, flip and each row's program in one job on the pool.  The
        program is checked and copied now: a bad one raises here, and the caller may
        reuse its arrays."""
        if (codes is None) != (args is None):
            raise ValueError("codes and args come together (or neither)")
        if codes is not None:
            _kernel.check_ops(codes, args, out.shape)
            codes, args = codes.copy(), args.copy()
        return self._queue(
            self._reaugmenter().run, buffer.pixels, np.ascontiguousarray(entries, np.int64),
            buffer.shape, np.ascontiguousarray(boxes, np.float64),
            np.ascontiguousarray(flips, bool).view(np.uint8), out, codes, args)

    def crop_resize(self, buffer, entries, boxes, flips, out):
        return self.reaugment(buffer, entries, boxes, flips, out)

    def place(self, buffer, entries, boxes, rects, flips, fill, out, rows, codes=None,
              args=None):
        """After the jobs queued so far: rows ``rows`` of ``out`` become ``fill`` with
        box i of canvas ``entries[i]`` resized into output rectangle ``rects[i]`` =
        (y0, y1, x0, x1) (flipped where ``flips[i]``), then row i's program (a zoom-out
        windows past the image, whose outside is fill)."""
        if codes is not None:
            _kernel.check_ops(codes, args, (len(rows), *out.shape[1:]))
            codes, args = codes.copy(), args.copy()
        return self._queue(self._place, self._last, buffer, np.asarray(entries, np.int64),
                           np.asarray(boxes, np.float64), np.asarray(rects, np.int64),
                           np.asarray(flips, bool), np.asarray(fill, np.uint8), out,
                           np.asarray(rows, np.int64), codes, args)

    def _place(self, after, buffer, entries, boxes, rects, flips, fill, out, rows, codes,
               args):
        if after is not None:
            after.result()  # queued before us on this one thread: finished; re-raise a failure
        kernel = self._resizer()
        for i, (e, r) in enumerate(zip(entries, rows)):
            h, w = (int(v) for v in buffer.shape[e])
            canvas = buffer.pixels[e, :h * w * 3].reshape(h, w, 3)
            y0, y1, x0, x1 = (int(v) for v in rects[i])
            out[r] = fill
            if y1 <= y0 or x1 <= x0:  # the window misses the image: all fill
                continue
            kernel.resize(canvas, tuple(boxes[i]), (y1 - y0, x1 - x0), bool(flips[i]),
                          out[r, y0:y1, x0:x1])
            if codes is not None:
                _kernel.apply_ops(out[r:r + 1], codes[i:i + 1], args[i:i + 1])

    def _resizer(self):
        if getattr(self, "_kernel_decoder", None) is None:
            self._kernel_decoder = _kernel.Decoder()
        return self._kernel_decoder

    def augment(self, images, codes, args, after=None):
        """Queue the per-image programs after the batch's crop (the job ``after``; by
        default the last job queued), so they run on its pixels once it has written
        them.  The program is checked and copied now: a bad one raises here, and the
        caller may reuse its arrays.  Returns the job; if ``after`` failed, this job
        fails with its error rather than augmenting pixels that were never written."""
        if not (isinstance(images, np.ndarray) and images.dtype == np.uint8 and
                images.ndim == 4 and images.flags.c_contiguous and images.flags.writeable):
            raise ValueError(f"images must be a C-contiguous writable (n, h, w, 3) uint8 "
                             f"array, got {type(images).__name__} "
                             f"{getattr(images, 'dtype', '')} {getattr(images, 'shape', '')}")
        _kernel.check_ops(codes, args, images.shape)
        after = self._last if after is None else after
        return self._queue(self._augment, self._reaugmenter(), images, codes.copy(),
                           args.copy(), after)

    @staticmethod
    def _augment(pool, images, codes, args, after):
        if after is not None:
            after.result()  # queued before us on this one thread: finished; re-raise a failure
        pool.apply(images, codes, args)

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
        finally:  # a failed last job still ends the host thread and the pool
            if self._host is not None:
                self._host.shutdown(wait=True)
                self._host = None
            self._pool = None

"""How the GPU backend's kernels are launched: grid and block shapes within CUDA's
limits, which steps of an augmentation program run, and the normalisation's
coefficients.  Pure arithmetic on the host (no CuPy), so the CPU tests check it."""
from __future__ import annotations

import math

import numpy as np

from echo_native import _kernel

THREADS = 256
#: CUDA's launch limits: gridDim.x, .y, .z, and threads per block.
MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_BLOCK_THREADS = 1024


def check_launch(grid, block):
    """``(grid, block)``, or ValueError where CUDA would refuse the launch (an opaque
    "invalid argument" at run time): a grid dimension outside 1 .. its limit, or
    more than 1,024 threads per block."""
    grid, block = tuple(int(g) for g in grid), tuple(int(b) for b in block)
    if not 1 <= len(grid) <= 3 or not 1 <= len(block) <= 3:
        raise ValueError(f"a CUDA launch has 1 to 3 grid and block dimensions, got "
                         f"{grid}, {block}")
    for axis, (g, limit) in enumerate(zip(grid, MAX_GRID)):
        if not 1 <= g <= limit:
            raise ValueError(f"CUDA grid dimension {'xyz'[axis]} = {g:,} is outside 1 .. "
                             f"{limit:,} (grid {grid}, block {block})")
    if min(block) < 1 or math.prod(block) > MAX_BLOCK_THREADS:
        raise ValueError(f"a CUDA block has 1 .. {MAX_BLOCK_THREADS} threads, got {block}")
    return grid, block


def crop_resize_launch(n, out_h, out_w):
    """(grid, block) of ``crop_resize``: a thread per output pixel; each image has
    ``ceil(out_h * out_w / THREADS)`` consecutive blocks on the x dimension, which
    holds 2^31 - 1 of them (the y dimension would stop batches at 65,535 images)."""
    return check_launch(((out_h * out_w + THREADS - 1) // THREADS * n,), (THREADS,))


def normalize_launch(pixels):
    """(grid, block) of ``normalize``: a thread per pixel."""
    return check_launch(((pixels + THREADS - 1) // THREADS,), (THREADS,))


def to_bfloat16_launch(count):
    """(grid, block) of ``to_bfloat16``: a thread per value."""
    return check_launch(((count + THREADS - 1) // THREADS,), (THREADS,))


def ops_pixel_launch(n, h, w):
    """(grid, block) of ``ops_histogram`` and ``ops_apply``: a thread per pixel of the
    batch."""
    return check_launch(((n * h * w + THREADS - 1) // THREADS,), (THREADS,))


def ops_table_launch(n):
    """(grid, block) of ``ops_tables``: a thread per (image, channel)."""
    return check_launch(((3 * n + THREADS - 1) // THREADS,), (THREADS,))


def ops_steps(codes):
    """The launches of a program: (k, count, tables) for every step k that some row
    runs an op in; ``count``: some row's op reads its histogram (``ops_histogram``
    first), ``tables``: some row's op is a lookup table (``ops_tables``)."""
    for k in range(codes.shape[1]):
        column = set(np.unique(codes[:, k]).tolist())
        if column - {_kernel.Op.NONE}:
            yield k, bool(column & _kernel.OPS_COUNTING), bool(column & _kernel.OPS_TABLES)


def normalize_coefficients(mean, std):
    """float32 (scale[3], shift[3]) with x * scale + shift = (x / 255 - mean) / std."""
    std = np.asarray(std, np.float64)
    return np.concatenate([1.0 / (255.0 * std), -np.asarray(mean, np.float64) / std]).astype(
        np.float32)

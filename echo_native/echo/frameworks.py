"""One framework's arrays in an echo stage's shuffle buffer: NumPy or CuPy (an array
module), torch and JAX, each indexed with its own operations on the array's own device,
never through the host (:func:`ops_for` picks them for a batch's leaf)."""
from __future__ import annotations

import contextlib

import numpy as np


class _ArrayModuleOps:
    """NumPy's or CuPy's arrays (an array module ``xp``): fancy indexing on the array's own
    device (a CuPy array's device is made current for the index it needs there)."""

    def __init__(self, like, xp):
        self.xp = xp
        self._device = getattr(like, "device", None) if xp is not np else None

    def _on_device(self):
        return self._device if self._device is not None else contextlib.nullcontext()

    def empty(self, capacity, like):
        with self._on_device():
            return self.xp.empty((capacity,) + tuple(like.shape[1:]), like.dtype)

    def _index(self, entries):
        with self._on_device():
            return self.xp.asarray(np.asarray(entries, np.int64))

    def store(self, buf, entries, values):
        with self._on_device():   # the index and the copy on the buffer's device
            buf[self._index(entries)] = values
        return buf

    def gather(self, buf, entries):
        with self._on_device():
            return buf[self._index(entries)]

    def copy(self, x):
        return x.copy()

    def itemsize(self, x):
        return np.dtype(x.dtype).itemsize


class _TorchOps:
    """torch tensors, on their own device: ``index_copy_`` and ``index_select``."""

    def __init__(self, like):
        import torch

        self.torch = torch

    def empty(self, capacity, like):
        return self.torch.empty((capacity,) + tuple(like.shape[1:]), dtype=like.dtype,
                                device=like.device)

    def _index(self, entries, device):
        return self.torch.as_tensor(np.asarray(entries, np.int64), device=device)

    def store(self, buf, entries, values):
        # Detached: a batch that requires grad would pull the buffer (and every batch
        # gathered from it) into its autograd graph, a chain that grows with each store.
        buf.index_copy_(0, self._index(entries, buf.device), values.detach().to(buf.device))
        return buf

    def gather(self, buf, entries):
        return buf.index_select(0, self._index(entries, buf.device))

    def copy(self, x):
        return x.detach().clone()

    def itemsize(self, x):
        return x.element_size()


class _JaxOps:
    """JAX arrays: a jitted update that donates the buffer (XLA writes it in place,
    not a copy per store) and ``take``."""

    def __init__(self, like):
        import jax
        import jax.numpy as jnp

        self.jax, self.jnp = jax, jnp
        self._store = jax.jit(lambda buf, idx, values: buf.at[idx].set(values),
                              donate_argnums=0)

    def empty(self, capacity, like):
        zeros = self.jnp.zeros((capacity,) + tuple(like.shape[1:]), like.dtype)
        devices = like.devices() if hasattr(like, "devices") else None
        return self.jax.device_put(zeros, next(iter(devices))) if devices else zeros

    def _index(self, entries):
        return self.jnp.asarray(np.asarray(entries, np.int32))

    def store(self, buf, entries, values):
        return self._store(buf, self._index(entries), values)

    def gather(self, buf, entries):
        return self.jnp.take(buf, self._index(entries), axis=0)

    def copy(self, x):
        return self.jnp.array(x, copy=True)

    def itemsize(self, x):
        return np.dtype(x.dtype).itemsize


def ops_for(x):
    """The buffer operations of array ``x``'s framework."""
    module = type(x).__module__.split(".")[0]
    if isinstance(x, np.ndarray):
        return _ArrayModuleOps(x, np)
    if module == "cupy":
        import cupy

        return _ArrayModuleOps(x, cupy)
    if module == "torch":
        return _TorchOps(x)
    if module in ("jax", "jaxlib"):
        return _JaxOps(x)
    raise TypeError(f"EchoLoader: a batch leaf of type {type(x).__module__}."
                    f"{type(x).__name__} is not an array it can store (NumPy, torch, JAX or "
                    f"CuPy)")

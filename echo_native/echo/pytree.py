"""How an echo stage stores and emits a user's batches: nested containers of arrays.

:class:`~echo_native.EchoLoader` wraps any loader, so a batch is whatever it
yields: a NumPy array, a torch tensor (CPU or CUDA), a JAX or CuPy array, or a
nest of them in dicts, lists, tuples, namedtuples and dataclasses (a pytree).
Every array leaf holds one row per example (the batch dimension first); a list
of per-example values (strings, ids) follows its examples too.  The examples
stay where they are: each array leaf's shuffle-buffer entries are one array on
the leaf's own device, stored into and gathered from with that framework's own
indexing, never through the host.
"""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from echo_native.echo.buffer import buffer_bytes


# ---- the structure of a batch ----------------------------------------------------------
class Leaf:
    """Where a leaf sits in the structure; ``kind`` is "array", "list" or "const"."""

    __slots__ = ("path", "kind", "value")

    def __init__(self, path, kind, value=None):
        self.path, self.kind, self.value = path, kind, value


def _is_array(x):
    return hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "__getitem__") and \
        not isinstance(x, (str, bytes))


def _is_namedtuple(x):
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def flatten(batch, path="batch"):
    """``(leaves, treedef)``: the arrays and per-example lists of ``batch`` in a fixed
    order, and what :func:`unflatten` needs to rebuild its structure."""
    if _is_array(batch):
        return [batch], ("leaf", path)
    if isinstance(batch, dict):
        keys = list(batch)
        parts = [flatten(batch[k], f"{path}[{k!r}]") for k in keys]
        return [x for p in parts for x in p[0]], ("dict", type(batch), keys,
                                                   [p[1] for p in parts])
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        names = [f.name for f in dataclasses.fields(batch)]
        parts = [flatten(getattr(batch, n), f"{path}.{n}") for n in names]
        return [x for p in parts for x in p[0]], ("dataclass", type(batch), names,
                                                   [p[1] for p in parts])
    if isinstance(batch, (list, tuple)) and batch and \
            all(not _is_array(x) and not isinstance(x, (list, tuple, dict)) and
                not dataclasses.is_dataclass(x) for x in batch) and not _is_namedtuple(batch):
        return [list(batch)], ("list", path, type(batch))   # one value per example
    if isinstance(batch, (list, tuple)):
        parts = [flatten(x, f"{path}[{i}]") for i, x in enumerate(batch)]
        kind = "namedtuple" if _is_namedtuple(batch) else "seq"
        return [x for p in parts for x in p[0]], (kind, type(batch), None,
                                                   [p[1] for p in parts])
    return [batch], ("const", path)


def unflatten(treedef, leaves):
    """The structure of ``treedef`` with ``leaves`` in place (consumed in order)."""
    it = iter(leaves)

    def build(node):
        kind = node[0]
        if kind == "leaf" or kind == "const":
            return next(it)
        if kind == "list":
            return node[2](next(it))
        cls, names, children = node[1], node[2], node[3]
        values = [build(c) for c in children]
        if kind == "dict":
            return cls(zip(names, values)) if cls is not dict else dict(zip(names, values))
        if kind == "dataclass":
            return cls(**dict(zip(names, values)))
        if kind == "namedtuple":
            return cls(*values)
        return cls(values)

    return build(treedef)


def leaf_paths(treedef):
    """The paths of the leaves, in :func:`flatten`'s order (for messages)."""
    kind = treedef[0]
    if kind in ("leaf", "const", "list"):
        return [treedef[1]]
    return [p for child in treedef[3] for p in leaf_paths(child)]


def leaf_kinds(treedef):
    kind = treedef[0]
    if kind in ("leaf", "const", "list"):
        return ["array" if kind == "leaf" else kind]
    return [k for child in treedef[3] for k in leaf_kinds(child)]


# ---- one framework's arrays --------------------------------------------------------------
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
        buf[self._index(entries)] = values
        return buf

    def gather(self, buf, entries):
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
        buf.index_copy_(0, self._index(entries, buf.device), values.to(buf.device))
        return buf

    def gather(self, buf, entries):
        return buf.index_select(0, self._index(entries, buf.device))

    def copy(self, x):
        return x.clone()

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


# ---- the examples -------------------------------------------------------------------------
@dataclasses.dataclass
class Emitted:
    """An emitted batch of the user's kind, with what the stage books about it."""

    batch: object
    sample_ids: np.ndarray
    echo_index: np.ndarray
    fresh: np.ndarray
    epoch: int

    def __len__(self):
        return len(self.sample_ids)


class PytreeExamples:
    """Stores and emits the examples of a user's batches for :class:`EchoLoader`.

    Parameters
    ----------
    augment : callable(batch, keys) or None
        Before augmentation: run on every emitted batch, ``keys`` a host (B, 4)
        int64 array of (seed, epoch, example id, echo index) per row.
    seed : int
    max_bytes : int or None
        The most the shuffle buffer may hold (bytes), checked when it is first made.
    """

    def __init__(self, augment=None, seed=0, max_bytes=None):
        self.augment, self.seed, self.max_bytes = augment, seed, max_bytes
        self.capacity = 0
        self.treedef = None
        self.buffers = None    # per leaf: the array of entries, a list, or the constant
        self.ops = None
        self.nbytes = 0

    def allocate(self, capacity):
        self.capacity = int(capacity)

    def free(self):
        self.buffers = self.ops = self.treedef = None
        self.nbytes = 0

    def _structure(self, fresh):
        leaves, treedef = flatten(fresh.payload)
        n = fresh.count
        for leaf, kind, path in zip(leaves, leaf_kinds(treedef), leaf_paths(treedef)):
            rows = len(leaf) if kind == "list" else (leaf.shape[0] if kind == "array" and
                                                     leaf.ndim else None)
            if kind != "const" and rows != n:
                raise ValueError(f"EchoLoader: {path} has {rows} rows where the batch has "
                                 f"{n} examples: every array in a batch must hold one row per "
                                 f"example (the batch dimension first)")
        if self.treedef is None:
            self.treedef = treedef
        elif treedef != self.treedef:
            raise ValueError("EchoLoader: the batches change structure (their keys, fields or "
                             "nesting differ): batches of one loader must share one")
        return leaves

    def _ops(self, leaves):
        """Each leaf's framework operations (made once: JAX's compile a function)."""
        if self.ops is None:
            self.ops = [ops_for(x) if kind == "array" else None
                        for x, kind in zip(leaves, leaf_kinds(self.treedef))]
        return self.ops

    def _make_buffers(self, leaves):
        ops = self._ops(leaves)
        per_example = sum(int(np.prod(x.shape[1:], dtype=np.int64)) * o.itemsize(x)
                          for x, o in zip(leaves, ops) if o is not None)
        self.nbytes = per_example * self.capacity
        if self.max_bytes is not None and self.nbytes > self.max_bytes:
            raise MemoryError(
                f"EchoLoader: the shuffle buffer of {self.capacity} examples needs "
                f"{buffer_bytes(self.capacity, per_example)} ({per_example:,} bytes per "
                f"example), over max_buffer_bytes={self.max_bytes:,}: lower shuffle_buffer "
                f"(to at least 2 x the batch size) or raise max_buffer_bytes")
        self.buffers = []
        for x, o, kind in zip(leaves, ops, leaf_kinds(self.treedef)):
            if kind == "array":
                self.buffers.append(o.empty(self.capacity, x))
            elif kind == "list":
                self.buffers.append([None] * self.capacity)
            else:
                self.buffers.append(x)

    def store(self, entries, fresh):
        leaves = self._structure(fresh)
        if self.buffers is None:
            self._make_buffers(leaves)
        paths = leaf_paths(self.treedef)
        for i, (leaf, kind) in enumerate(zip(leaves, leaf_kinds(self.treedef))):
            buf = self.buffers[i]
            if kind == "array":
                if tuple(leaf.shape[1:]) != tuple(buf.shape[1:]) or \
                        str(leaf.dtype) != str(buf.dtype):
                    raise ValueError(
                        f"EchoLoader: {paths[i]} changed from {str(buf.dtype)} rows of shape "
                        f"{tuple(buf.shape[1:])} to {leaf.dtype} rows of shape "
                        f"{tuple(leaf.shape[1:])}: the shuffle buffer holds examples of one "
                        f"shape (pad variable-length fields to a fixed length)")
                self.buffers[i] = self.ops[i].store(buf, entries, leaf)
            elif kind == "list":
                for e, value in zip(np.asarray(entries).tolist(), leaf):
                    buf[e] = value
            elif not _same(leaf, buf):
                raise ValueError(f"EchoLoader: {paths[i]} is {leaf!r} in one batch and {buf!r} "
                                 f"in another: a value that is not per example must stay the "
                                 f"same")

    def _gather(self, entries):
        leaves = []
        for ops, buf, kind in zip(self.ops, self.buffers, leaf_kinds(self.treedef)):
            if kind == "array":
                leaves.append(ops.gather(buf, entries))
            elif kind == "list":
                leaves.append([buf[e] for e in np.asarray(entries).tolist()])
            else:
                leaves.append(buf)
        return unflatten(self.treedef, leaves)

    def _augmented(self, batch, sample_ids, echo_index, epoch):
        if self.augment is None:
            return batch
        keys = np.empty((len(sample_ids), 4), np.int64)
        keys[:, 0], keys[:, 1] = self.seed, epoch
        keys[:, 2], keys[:, 3] = sample_ids, echo_index
        out = self.augment(batch, keys)
        return batch if out is None else out

    def make(self, entries, sample_ids, echo_index, fresh, epochs, epoch):
        batch = self._gather(entries)
        batch = self._augmented(batch, sample_ids, echo_index, epoch)
        return None, Emitted(batch, sample_ids, echo_index, fresh, epoch)

    def pass_through(self, fresh):
        zeros = np.zeros(fresh.count, np.int64)
        batch = self._augmented(fresh.payload, fresh.sample_ids, zeros, fresh.epoch)
        return Emitted(batch, fresh.sample_ids, zeros, fresh.ok, fresh.epoch), False

    def keep(self, fresh):
        leaves = self._structure(fresh)
        kept = [o.copy(x) if o is not None else x for x, o in zip(leaves, self._ops(leaves))]
        return Emitted(kept, fresh.sample_ids.copy(), np.zeros(fresh.count, np.int64),
                       fresh.ok.copy(), fresh.epoch)

    def repeat(self, kept, echo, epoch):
        # A copy per emission: a consumer that changes its batch in place must not
        # change the repeats still to come.
        leaves = [o.copy(x) if o is not None else x for x, o in zip(kept.batch, self.ops)]
        echo_index = np.full(len(kept), echo, np.int64)
        batch = self._augmented(unflatten(self.treedef, leaves), kept.sample_ids, echo_index,
                                epoch)
        return Emitted(batch, kept.sample_ids, echo_index, kept.fresh & (echo == 0), epoch)


def _same(a, b):
    try:
        return bool(a == b)
    except Exception:
        return a is b


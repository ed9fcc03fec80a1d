"""How an echo stage stores and emits a user's batches: nested containers of arrays.

:class:`~echo_native.EchoLoader` wraps any loader, so a batch is whatever it
yields: a NumPy array, a torch tensor (CPU or CUDA), a JAX or CuPy array, a
``pyarrow.Table``, or a nest of them in dicts, lists, tuples, namedtuples and
dataclasses (a pytree).  The examples stay where they are: each array leaf's
shuffle-buffer entries are one array on the leaf's own device, stored into and
gathered from with that framework's own indexing, never through the host.

What is one example's: the rule
-------------------------------
A batch of n examples is read in two steps.

1. **n**, from the strongest evidence in the batch (:func:`batch_size`), looking
   through dicts, dataclasses and namedtuples (the containers whose entries have
   names, so each entry is a field of every example):

   a. a plain list or tuple whose items are all scalars, strings, bytes or None
      (an id or label column, a list of texts): its length;
   b. an array (or a ``pyarrow.Table``): its leading dimension (its row count);
   c. arrays that are items of a plain list or tuple and share one leading
      dimension (a ``DataLoader``'s collated ``[x, y]``): that dimension;
   d. the length of the first plain list or tuple.

2. With n known, every plain list or tuple of length n holds **one value per
   example**, whatever each value is (a list of token ids, a string, a ragged
   array, a dict of one image's boxes), unless every item is an array with n
   rows or a dict, dataclass or namedtuple of n examples (by the rule above):
   that is a collated structure (``[x, y]`` with n = 2).
   A list or tuple of another length is structure (its items are fields).  A
   per-example value is stored whole and follows its example: Hugging Face's
   ``{"ids": [[0, 1, 2], [100, 101, 102], ...]}`` is n rows of tokens, never 3
   columns.  After the first batch, a batch is read as the first one was (a
   short last batch of 2 is not taken for an ``[x, y]``).

Every array holds one row per example; a value that is neither an array nor
per-example (a constant string) must stay the same from batch to batch.  A
per-example list comes back as the same kind (a list stays a list, a tuple a
tuple), its values whole; a table comes back as a table of the same schema.
"""
from __future__ import annotations

import copy
import dataclasses

import numpy as np

from echo_native.echo.buffer import buffer_bytes
from echo_native.echo.frameworks import ops_for
from echo_native.memory import check_buffer


# ---- the structure of a batch ----------------------------------------------------------
def _is_array(x):
    return hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "__getitem__") and \
        not isinstance(x, (str, bytes))


def _is_table(x):
    return type(x).__module__.split(".")[0] == "pyarrow" and \
        type(x).__name__ in ("Table", "RecordBatch")


def _is_namedtuple(x):
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _is_dataclass(x):
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _is_seq(x):
    """A plain list or tuple (a namedtuple's entries have names: it is a record)."""
    return isinstance(x, (list, tuple)) and not _is_namedtuple(x)


def _is_record(x):
    return isinstance(x, dict) or _is_dataclass(x) or _is_namedtuple(x)


def _is_scalar(x):
    return x is None or isinstance(x, (str, bytes, bool, int, float, complex, np.generic))


def _rows(x):
    """The leading dimension of an array or a table (None for a 0-d array)."""
    if _is_table(x):
        return x.num_rows
    return int(x.shape[0]) if len(x.shape) else None


def _named(x):
    """``x`` and everything reached from it through names (dict keys, fields)."""
    out = [x]
    if isinstance(x, dict):
        values = x.values()
    elif _is_dataclass(x):
        values = [getattr(x, f.name) for f in dataclasses.fields(x)]
    elif _is_namedtuple(x):
        values = x
    else:
        return out
    for v in values:
        out.extend(_named(v))
    return out


def _too_deep(fn):
    """A batch nested past Python's recursion limit is refused by name, not with a raw
    RecursionError from somewhere inside the walk."""
    def walk(batch, *args, **kw):
        try:
            return fn(batch, *args, **kw)
        except RecursionError:
            raise ValueError(f"EchoLoader: the batch ({type(batch).__name__}) is nested "
                             f"deeper than Python's recursion limit: a batch is a shallow "
                             f"nest of dicts, lists and tuples of arrays") from None
    walk.__name__, walk.__doc__ = fn.__name__, fn.__doc__
    return walk


@_too_deep
def batch_size(batch):
    """The number of examples in ``batch``, from the strongest evidence it holds (the
    rule in this module's docstring); None when it holds no list, array or table."""
    named = _named(batch)
    for x in named:   # a column of scalars or strings: nothing else it can be
        if _is_seq(x) and x and all(_is_scalar(v) for v in x):
            return len(x)
    for x in named:
        if _is_table(x) or (_is_array(x) and len(x.shape)):
            return _rows(x)
    for x in named:   # a collated [x, y]: arrays as its items (or in their records)
        if _is_seq(x):
            dims = {_rows(a) for item in x for a in _named(item)
                    if _is_table(a) or (_is_array(a) and len(a.shape))}
            if len(dims) == 1:
                return dims.pop()
    for x in named:
        if _is_seq(x):
            return len(x)
    return None


def _collated(seq, n):
    """A list or tuple of n items that is structure, not one value per example: each item
    an array or a table of n rows, or a record of n examples (a collated ``[x, y]`` with
    n = 2).  A detection loader's tuple of per-image target dicts (each of its own
    number of boxes) is one value per example."""
    return all(((_is_array(v) and len(v.shape)) or _is_table(v)) and _rows(v) == n or
               _is_record(v) and batch_size(v) == n for v in seq)


@_too_deep
def flatten(batch, n=None, like=None, path="batch"):
    """``(leaves, treedef)``: the arrays, tables and per-example lists of ``batch`` (of
    ``n`` examples, :func:`batch_size` by default) in a fixed order, and what
    :func:`unflatten` needs to rebuild its structure.  ``like``, the treedef of an
    earlier batch, says which lists hold one value per example where the batch alone
    cannot (a short last batch)."""
    if n is None:
        n = batch_size(batch)
    return _flatten(batch, n, like, path)


def _flatten(batch, n, like, path):
    like_kind = like[0] if like is not None else None
    if like_kind == "list" and _is_array(batch) and len(batch.shape):
        # A ragged column whose rows happened to share a length this time came stacked.
        batch = like[2](batch[i] for i in range(batch.shape[0]))
    if _is_table(batch):
        return [batch], ("table", path, type(batch))
    if _is_array(batch):
        return [batch], ("leaf", path)
    if isinstance(batch, dict):
        keys = list(batch)
        subs = _children(like, "dict", keys)
        parts = [_flatten(batch[k], n, c, f"{path}[{k!r}]") for k, c in zip(keys, subs)]
        return [x for p in parts for x in p[0]], ("dict", type(batch), keys,
                                                   [p[1] for p in parts])
    if _is_dataclass(batch):
        names = [f.name for f in dataclasses.fields(batch)]
        subs = _children(like, "dataclass", names)
        parts = [_flatten(getattr(batch, k), n, c, f"{path}.{k}") for k, c in zip(names, subs)]
        return [x for p in parts for x in p[0]], ("dataclass", type(batch), names,
                                                   [p[1] for p in parts])
    if _is_seq(batch):
        if like_kind == "list":
            per_example = True
        elif like_kind == "seq":
            per_example = False
        else:
            per_example = len(batch) == n and not _collated(batch, n)
        if per_example:
            return [list(batch)], ("list", path, type(batch))
    if isinstance(batch, (list, tuple)):
        kind = "namedtuple" if _is_namedtuple(batch) else "seq"
        subs = _children(like, kind, len(batch))
        parts = [_flatten(x, n, c, f"{path}[{i}]") for i, (x, c) in enumerate(zip(batch, subs))]
        return [x for p in parts for x in p[0]], (kind, type(batch), None,
                                                   [p[1] for p in parts])
    return [batch], ("const", path)


def _children(like, kind, names):
    """The treedefs an earlier batch had at this node's children (None where it had
    another structure here: the comparison of the treedefs then names the change)."""
    size = names if isinstance(names, int) else len(names)
    if like is None or like[0] != kind or len(like[3]) != size or \
            (not isinstance(names, int) and like[2] != names):
        return [None] * size
    return like[3]


def unflatten(treedef, leaves):
    """The structure of ``treedef`` with ``leaves`` in place (consumed in order)."""
    it = iter(leaves)

    def build(node):
        kind = node[0]
        if kind in ("leaf", "const", "table"):
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
    if kind in ("leaf", "const", "list", "table"):
        return [treedef[1]]
    return [p for child in treedef[3] for p in leaf_paths(child)]


def leaf_kinds(treedef):
    kind = treedef[0]
    if kind in ("leaf", "const", "list", "table"):
        return ["array" if kind == "leaf" else kind]
    return [k for child in treedef[3] for k in leaf_kinds(child)]


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

    #: store() takes part of a fresh batch (its ``rows``): the wrapped loader's batches
    #: may be larger than the free entries.
    stores_rows = True

    def __init__(self, augment=None, seed=0, max_bytes=None):
        self.augment, self.seed, self.max_bytes = augment, seed, max_bytes
        self.capacity = 0
        self.treedef = None
        self.buffers = None    # per leaf: the array of entries, a list, or the constant
        self.ops = None
        self.nbytes = 0
        self._dtypes = None    # batch echo's: each array leaf's, from the first batch
        self.window = 0        # batch echo's window of batches, checked at the first

    def allocate(self, capacity):
        self.capacity = int(capacity)

    def free(self):
        self.buffers = self.ops = self.treedef = self._dtypes = None
        self.nbytes = 0

    def _structure(self, fresh):
        leaves, treedef = flatten(fresh.payload, fresh.count, like=self.treedef)
        n = fresh.count
        for leaf, kind, path in zip(leaves, leaf_kinds(treedef), leaf_paths(treedef)):
            rows = len(leaf) if kind == "list" else (_rows(leaf) if kind in ("array", "table")
                                                     else None)
            if kind == "array" and rows is None:
                raise ValueError(f"EchoLoader: {path} is a 0-d array (one value, not one row "
                                 f"per example): give it the batch dimension first, or make "
                                 f"it a Python scalar if it is the same for every batch")
            if kind != "const" and rows != n:
                raise ValueError(f"EchoLoader: {path} has {rows} rows where the batch has "
                                 f"{n} examples: every array in a batch must hold one row per "
                                 f"example (the batch dimension first)")
        if self.treedef is None:
            self.treedef = treedef
        elif treedef != self.treedef:
            raise ValueError(f"EchoLoader: the batches change structure "
                             f"({_difference(self.treedef, treedef)}): batches of one loader "
                             f"must share one")
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
        host = sum(int(np.prod(x.shape[1:], dtype=np.int64)) * o.itemsize(x)
                   for x, o in zip(leaves, ops) if o is not None and _on_host(x))
        check_buffer("EchoLoader", f"the shuffle buffer of {self.capacity} examples",
                     host * self.capacity, "shuffle_buffer (to at least 2 x the batch size)")
        self.buffers = []
        for x, o, kind in zip(leaves, ops, leaf_kinds(self.treedef)):
            if kind == "array":
                self.buffers.append(o.empty(self.capacity, x))
            elif kind in ("list", "table"):
                self.buffers.append([None] * self.capacity)
            else:
                self.buffers.append(x)

    def store(self, entries, fresh, rows=None):
        """Store fresh batch ``fresh`` into buffer ``entries`` (its ``rows`` only, when
        given: a batch larger than the free entries goes in part by part)."""
        leaves = self._structure(fresh)
        if self.buffers is None:
            self._make_buffers(leaves)
        paths = leaf_paths(self.treedef)
        for i, (leaf, kind) in enumerate(zip(leaves, leaf_kinds(self.treedef))):
            buf = self.buffers[i]
            if kind == "array":
                if isinstance(leaf, np.ndarray) and isinstance(buf, np.ndarray):
                    leaf, buf = _host_fit(leaf, buf)
                if tuple(leaf.shape[1:]) != tuple(buf.shape[1:]) or \
                        str(leaf.dtype) != str(buf.dtype):
                    raise ValueError(
                        f"EchoLoader: {paths[i]} changed from {str(buf.dtype)} rows of shape "
                        f"{tuple(buf.shape[1:])} to {leaf.dtype} rows of shape "
                        f"{tuple(leaf.shape[1:])}: the shuffle buffer holds examples of one "
                        f"shape (pad variable-length fields to a fixed length)")
                if rows is not None:
                    leaf = self.ops[i].gather(leaf, rows)
                self.buffers[i] = self.ops[i].store(buf, entries, leaf)
            elif kind == "list":
                values = leaf if rows is None else [leaf[r] for r in np.asarray(rows).tolist()]
                for e, value in zip(np.asarray(entries).tolist(), values):
                    buf[e] = value
            elif kind == "table":
                first = next((t for t in buf if t is not None), None)
                if first is not None and not first[0].schema.equals(leaf.schema):
                    raise ValueError(f"EchoLoader: {paths[i]} changed its schema from "
                                     f"{first[0].schema} to {leaf.schema}: the tables of one "
                                     f"loader must share one")
                # The rows stay in the batch's own table: an entry is (table, row).
                at = range(leaf.num_rows) if rows is None else np.asarray(rows).tolist()
                for row, e in zip(at, np.asarray(entries).tolist()):
                    buf[e] = (leaf, row)
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
                leaves.append([_own(buf[e]) for e in np.asarray(entries).tolist()])
            elif kind == "table":
                leaves.append(_take_rows([buf[e] for e in np.asarray(entries).tolist()]))
            else:
                leaves.append(buf)
        return unflatten(self.treedef, leaves)

    def _augmented(self, batch, sample_ids, echo_index, epoch):
        if self.augment is None:
            return batch
        keys = np.empty((len(sample_ids), 4), np.int64)
        # A seed >= 2**63 goes in as its 64 bits (keys[:, 0].view(np.uint64) gives it
        # back): int64 keys, for every framework, over the whole [0, 2**64) range.
        keys[:, 0], keys[:, 1] = _as_int64_bits(self.seed), epoch
        keys[:, 2], keys[:, 3] = sample_ids, echo_index
        out = self.augment(batch, keys)
        return batch if out is None else out

    def make(self, entries, sample_ids, echo_index, fresh, epochs, epoch):
        batch = self._gather(entries)
        batch = self._augmented(batch, sample_ids, echo_index, epoch)
        return None, Emitted(batch, sample_ids, echo_index, fresh, epoch)

    def check(self, fresh):
        """Refuse a batch that example echo would refuse (rows per example, structure)."""
        self._structure(fresh)

    def pass_through(self, fresh, keep=None):
        """A fresh batch as it comes, or only its rows ``keep`` (a mask)."""
        payload, ids, ok = fresh.payload, fresh.sample_ids, fresh.ok
        if keep is not None:
            rows = np.flatnonzero(keep)
            leaves = self._structure(fresh)
            ops = self._ops(leaves)
            picked = []
            for leaf, o, kind in zip(leaves, ops, leaf_kinds(self.treedef)):
                if kind == "array":
                    picked.append(o.gather(leaf, rows))
                elif kind == "list":
                    picked.append(type(leaf)(leaf[r] for r in rows.tolist()))
                elif kind == "table":
                    picked.append(_take_rows([(leaf, r) for r in rows.tolist()])
                                  if len(rows) else leaf.slice(0, 0))
                else:
                    picked.append(leaf)
            payload, ids, ok = unflatten(self.treedef, picked), ids[rows], ok[rows]
        zeros = np.zeros(len(ids), np.int64)
        batch = self._augmented(payload, ids, zeros, fresh.epoch)
        # "Copied": the upstream need not hold the batch (a wrapped loader's batch has no
        # memory to give back), so its epoch moves on once the batch is delivered.
        return Emitted(batch, ids, zeros, ok, fresh.epoch), True

    def keep(self, fresh):
        leaves = self._structure(fresh)
        if self._dtypes is None and self.window:
            self._check_window(leaves)
        # Whole batches are kept, so their shapes may vary (sequences padded per batch);
        # a dtype that changes is a loader's bug, refused as example echo refuses it.
        dtypes = [_dtype_kind(x) if kind == "array" else None
                  for x, kind in zip(leaves, leaf_kinds(self.treedef))]
        if self._dtypes is None:
            self._dtypes = dtypes
        for path, was, now in zip(leaf_paths(self.treedef), self._dtypes, dtypes):
            if was != now:
                raise ValueError(f"EchoLoader: {path} changed from {was} to {now}: the "
                                 f"batches of one loader must keep their dtypes")
        kept = [o.copy(x) if o is not None else x for x, o in zip(leaves, self._ops(leaves))]
        return Emitted(kept, fresh.sample_ids.copy(), np.zeros(fresh.count, np.int64),
                       fresh.ok.copy(), fresh.epoch)

    def _check_window(self, leaves):
        """Batch echo holds ``window`` copies of whole batches (and one emission more):
        checked at the first, against ``max_buffer_bytes`` and the memory available."""
        ops = self._ops(leaves)
        each = sum(_nbytes(x, o) for x, o in zip(leaves, ops) if o is not None)
        host = sum(_nbytes(x, o) for x, o in zip(leaves, ops) if o is not None and _on_host(x))
        n = self.window + 1
        self.nbytes = each * n
        if self.max_bytes is not None and self.nbytes > self.max_bytes:
            raise MemoryError(
                f"EchoLoader: batch echo's window of {self.window} batches (and the one being "
                f"emitted) needs {buffer_bytes(n, each)} ({each:,} bytes per batch), over "
                f"max_buffer_bytes={self.max_bytes:,}: lower shuffle_buffer (the window is "
                f"shuffle_buffer // batch size batches, at least 2) or the wrapped loader's "
                f"batch size, or raise max_buffer_bytes")
        check_buffer("EchoLoader", f"batch echo's window of {self.window} batches", host * n,
                     "shuffle_buffer or the wrapped loader's batch size")

    def repeat(self, kept, echo, epoch):
        # A copy per emission: a consumer that changes its batch in place must not
        # change the repeats still to come.
        leaves = [o.copy(x) if o is not None else [_own(v) for v in x] if kind == "list" else x
                  for x, o, kind in zip(kept.batch, self.ops, leaf_kinds(self.treedef))]
        echo_index = np.full(len(kept), echo, np.int64)
        batch = self._augmented(unflatten(self.treedef, leaves), kept.sample_ids, echo_index,
                                epoch)
        return Emitted(batch, kept.sample_ids, echo_index, kept.fresh & (echo == 0), epoch)


def _difference(old, new, path="batch"):
    """Where two treedefs part (for the message of a batch that changed structure)."""
    what = {"leaf": "an array", "list": "a list of one value per example",
            "const": "a constant", "table": "a table"}
    if old[0] != new[0]:
        return (f"{path} was {what.get(old[0], 'a ' + old[0])} and is "
                f"{what.get(new[0], 'a ' + new[0])} now")
    if old[0] in what:
        return f"{path} changed type"
    if old[1] is not new[1] or old[2] != new[2] or len(old[3]) != len(new[3]):
        return f"{path} changed its keys, fields or length"
    for i, (o, n) in enumerate(zip(old[3], new[3])):
        if o != n:
            if old[0] == "dict":
                sub = f"{path}[{old[2][i]!r}]"
            elif old[0] == "dataclass":
                sub = f"{path}.{old[2][i]}"
            else:
                sub = f"{path}[{i}]"
            return _difference(o, n, sub)
    return "the nesting differs"


def _host_fit(leaf, buf):
    """A host column whose dtype follows its contents (Hugging Face's numpy format), fitted
    to the buffer: longer strings widen the buffer; a ragged column (an object array of
    rows) may come stacked when a batch's rows happen to share one length."""
    if buf.dtype == object and buf.ndim == 1 and (leaf.dtype != object or leaf.ndim != 1) \
            and leaf.ndim >= 1:
        rows = np.empty(leaf.shape[0], object)
        for j in range(leaf.shape[0]):   # not rows[:] = ...: numpy would broadcast them
            rows[j] = leaf[j]
        return rows, buf
    if leaf.dtype.kind in "US" and buf.dtype.kind == leaf.dtype.kind and \
            leaf.shape[1:] == buf.shape[1:] and leaf.dtype != buf.dtype:
        if leaf.dtype.itemsize > buf.dtype.itemsize:
            return leaf, buf.astype(leaf.dtype)
        return leaf.astype(buf.dtype), buf
    return leaf, buf


def _on_host(x):
    """Whether array ``x`` lives in host memory (what the memory available bounds)."""
    if isinstance(x, np.ndarray):
        return True
    device = getattr(x, "device", None)
    kind = getattr(device, "type", None)          # torch
    if kind is not None:
        return kind == "cpu"
    if hasattr(x, "devices"):                     # JAX
        try:
            return all(d.platform == "cpu" for d in x.devices())
        except Exception:
            return False
    return False                                  # CuPy: device memory


def _nbytes(x, ops):
    return int(np.prod(x.shape, dtype=np.int64)) * ops.itemsize(x)


def _as_int64_bits(seed):
    """``seed`` in [0, 2**64) as the int64 of the same 64 bits."""
    seed = int(seed)
    return seed - 2**64 if seed >= 2**63 else seed


def _dtype_kind(x):
    """An array's dtype, as batch echo holds it to: a host string column's width follows
    its contents (Hugging Face's numpy format), so only its kind counts."""
    dt = x.dtype
    if isinstance(dt, np.dtype) and dt.kind in "US":
        return f"{dt.kind} strings"
    return str(dt)


def _own(value):
    """A per-example value for one emission: a consumer that changes it in place (appends
    a token) must not change the repeats still to come."""
    if _is_scalar(value) or isinstance(value, tuple) and all(_is_scalar(v) for v in value):
        return value
    if isinstance(value, list) and all(_is_scalar(v) for v in value):
        return list(value)
    if _is_array(value) and hasattr(value, "clone"):
        return value.clone()
    if _is_array(value) and hasattr(value, "copy"):
        return value.copy()
    return copy.deepcopy(value)


def _take_rows(refs):
    """The rows ``refs`` ((table, row) pairs) as one table of their schema, in order."""
    import pyarrow as pa

    tables, offsets, at = [], {}, 0
    for table, _ in refs:
        if id(table) not in offsets:
            offsets[id(table)] = at
            tables.append(table)
            at += table.num_rows
    if isinstance(tables[0], pa.RecordBatch):
        whole = pa.Table.from_batches(tables)
    else:
        whole = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    out = whole.take(pa.array([offsets[id(t)] + r for t, r in refs], pa.int64()))
    if isinstance(tables[0], pa.RecordBatch):
        return out.combine_chunks().to_batches()[0] if out.num_rows else \
            pa.RecordBatch.from_pylist([], schema=tables[0].schema)
    return out


def _same(a, b):
    try:
        return bool(a == b)
    except Exception:
        return a is b


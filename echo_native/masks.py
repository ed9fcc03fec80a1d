"""Instance masks: COCO polygons and RLE, checked, packed, rasterised in a window.

A source with masks (``CocoDetection(..., masks=True)``, or a ``targets(i)`` that
gives ``"masks"`` and a ``masks = True`` hook) gives each object a mask as COCO
writes one: polygons (parts of ``x0, y0, x1, y1, ...`` in source pixels, unioned)
or run-length encoding (``{"counts": [...], "size": [h, w]}``, the runs of 0s and
1s in column-major order, or ``counts`` as COCO's compressed string).  They are
held as :class:`Segments`, a few packed arrays: never a raster at full resolution.

A worker rasterises each object's mask once, at the size of the image it stores
(the output for a fresh example, the DCT-scaled canvas before augmentation), inside
the sample's window: output pixel ``(oy, ox)`` samples the source at ``(left + (ox
+ .5) * ww / W, top + (oy + .5) * wh / H)`` (``ox`` mirrored by a flip), the pixel
centre torchvision's nearest resize samples.  Polygons are filled at that size
(their vertices mapped; a pixel is in when its centre is), RLE is read at the
sampled source pixels.  Outside
the image (a zoom-out's padding) the mask is 0.  The record holds it bit-packed
(``np.packbits``, row-major: the ring's ``obj_masks``, :data:`MASKS` the field).

At the consumer (:class:`StoredMasks`) a stored mask in output space is the
emission's mask (mirrored where an echo after augmentation redraws the flip);
one on a canvas is resampled, nearest, through the emission's own window and flip,
as its pixels are.
"""
from __future__ import annotations

from itertools import chain

import numpy as np

from echo_native.protocol import ObjectField

__all__ = ["MASKS", "Segments", "as_segments", "rle_from_string", "rle_to_string", "rasterise",
           "pack_masks", "unpack_masks", "mask_bytes", "StoredMasks"]


def mask_bytes(sample_bytes):
    """Bytes of one object's bit-packed mask in a record of ``sample_bytes`` RGB pixels
    per sample: a bit per pixel of the largest image a sample stores."""
    return -(-int(sample_bytes) // 24)


def _ranges(starts, lengths):
    """The concatenated ``arange(s, s + n)`` of each start and length."""
    lengths = np.asarray(lengths, np.int64)
    total = int(lengths.sum())
    offsets = np.repeat(np.asarray(starts, np.int64) - (np.cumsum(lengths) - lengths), lengths)
    return offsets + np.arange(total, dtype=np.int64)


def _offsets(lengths):
    out = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


class Segments:
    """The masks of ``N`` objects, packed: object ``k``'s polygon parts are parts
    ``parts[k]:parts[k + 1]``, part ``j``'s coordinates ``coords[ends[j]:ends[j + 1]]``
    (x, y pairs, float32, source pixels); its RLE runs are ``counts[runs[k]:runs[k +
    1]]`` (uint32, column-major, from a run of 0s) on an image of ``rle_hw[k]``.  An
    object has polygons, RLE, or neither (an empty mask).  Made by :func:`as_segments`
    (checked); the arrays are read-only."""

    __slots__ = ("parts", "ends", "coords", "runs", "counts", "rle_hw")

    def __init__(self, parts, ends, coords, runs, counts, rle_hw):
        for name, value, dtype in (("parts", parts, np.int64), ("ends", ends, np.int64),
                                   ("coords", coords, np.float32), ("runs", runs, np.int64),
                                   ("counts", counts, np.uint32), ("rle_hw", rle_hw, np.int32)):
            a = np.ascontiguousarray(value, dtype)
            a.flags.writeable = False
            object.__setattr__(self, name, a)

    def __setattr__(self, name, value):
        raise AttributeError("Segments are read-only")

    def __reduce__(self):
        return Segments, tuple(getattr(self, n) for n in self.__slots__)

    def __len__(self):
        return len(self.parts) - 1

    def __eq__(self, other):
        if not isinstance(other, Segments):
            return NotImplemented
        return all(np.array_equal(getattr(self, n), getattr(other, n)) for n in self.__slots__)

    __hash__ = None

    def __repr__(self):
        return f"Segments({len(self)} objects)"

    @classmethod
    def empty(cls, n):
        """``n`` objects without a mask."""
        return cls(np.zeros(n + 1), np.zeros(1), (), np.zeros(n + 1), (), np.zeros((n, 2)))

    def take(self, index):
        """Objects ``index`` (indices, or a slice) as their own Segments."""
        idx = np.arange(len(self))[index] if isinstance(index, slice) else \
            np.asarray(index, np.int64).reshape(-1)
        nparts = self.parts[idx + 1] - self.parts[idx]
        part = _ranges(self.parts[idx], nparts)
        plen = self.ends[part + 1] - self.ends[part]
        coords = self.coords[_ranges(self.ends[part], plen)]
        nruns = self.runs[idx + 1] - self.runs[idx]
        counts = self.counts[_ranges(self.runs[idx], nruns)]
        return Segments(_offsets(nparts), _offsets(plen), coords, _offsets(nruns), counts,
                        self.rle_hw[idx])

    def polygons(self, k):
        """Object ``k``'s polygon parts, each (V, 2) float32 (none for RLE or empty)."""
        return [self.coords[self.ends[j]:self.ends[j + 1]].reshape(-1, 2)
                for j in range(int(self.parts[k]), int(self.parts[k + 1]))]

    def rle(self, k):
        """Object ``k``'s ``(counts, (h, w))``, or None where it has polygons or nothing."""
        s, e = int(self.runs[k]), int(self.runs[k + 1])
        if s == e:
            return None
        return self.counts[s:e], (int(self.rle_hw[k, 0]), int(self.rle_hw[k, 1]))

    def to_json(self):
        """Each object's mask in COCO's form (polygon lists, or ``{"counts", "size"}``)."""
        out = []
        for k in range(len(self)):
            rle = self.rle(k)
            out.append({"counts": rle[0].tolist(), "size": list(rle[1])} if rle is not None
                       else [p.ravel().tolist() for p in self.polygons(k)])
        return out


# ---- COCO's compressed RLE -------------------------------------------------------------------
def rle_from_string(text):
    """The run lengths of COCO's compressed RLE string (pycocotools' ``rleFrString``):
    each count a little-endian base-32 number in characters ``48 + 5 bits`` (0x20: more
    follow; the last one's 0x10: negative), from the third on a difference from the
    count two before.  Returns int64 counts; ValueError for text that is not one."""
    data = text.encode("ascii") if isinstance(text, str) else bytes(text)
    c = np.frombuffer(data, np.uint8).astype(np.int64) - 48
    if c.size == 0:
        return np.zeros(0, np.int64)
    if (c < 0).any() or (c > 63).any():
        raise ValueError("compressed RLE counts hold a character outside '0'..'o'")
    last = (c & 0x20) == 0
    if not last[-1]:
        raise ValueError("compressed RLE counts end inside a number")
    group = np.cumsum(last) - last            # the number each character belongs to
    starts = np.flatnonzero(np.r_[True, last[:-1]])
    k = np.arange(len(c)) - starts[group]     # the character's place in its number
    if k.max() > 12:
        raise ValueError("compressed RLE counts hold a number of more than 60 bits")
    x = np.zeros(len(starts), np.int64)
    np.add.at(x, group, (c & 0x1F) << (5 * k))
    ends = np.flatnonzero(last)
    negative = (c[ends] & 0x10) != 0
    x[negative] -= np.int64(1) << (5 * (k[ends[negative]] + 1))
    # From the third on, a count is the difference from the one two before it.
    out = x.copy()
    out[2::2] = np.cumsum(x[2::2])
    out[3::2] = x[1] + np.cumsum(x[3::2]) if len(x) > 3 else x[3::2]
    return out


def rle_to_string(counts):
    """COCO's compressed string of ``counts`` (pycocotools' ``rleToString``)."""
    counts = [int(v) for v in counts]
    out = bytearray()
    for i, v in enumerate(counts):
        x = v - counts[i - 2] if i > 2 else v
        while True:
            c = x & 0x1F
            x >>= 5
            more = not ((x == 0 and not c & 0x10) or (x == -1 and c & 0x10))
            out.append(48 + (c | (0x20 if more else 0)))
            if not more:
                break
    return out.decode("ascii")


# ---- checking ---------------------------------------------------------------------------------
def _numbers(part):
    """A polygon part's numbers as float64, or None when it is not a list of numbers."""
    if isinstance(part, np.ndarray):
        if part.ndim != 1 or part.dtype.kind not in "iuf":
            return None
        return part.astype(np.float64)
    if not isinstance(part, (list, tuple)) or \
            not set(map(type, part)) <= {int, float, np.float32, np.float64}:
        return None
    try:
        return np.asarray(part, np.float64)
    except OverflowError:
        return None


def _rle_counts(value, hw, where):
    """An RLE dict's counts (int64), checked against the image's ``hw`` (when known)."""
    hw = None if hw is None else tuple(int(v) for v in hw)
    size, counts = value.get("size"), value.get("counts")
    if not (isinstance(size, (list, tuple)) and len(size) == 2 and
            all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and 0 < v < 2**31
                for v in size)):
        raise ValueError(f"{where}: RLE size must be [height, width], got {str(size)[:40]}")
    h, w = int(size[0]), int(size[1])
    if hw is not None and (h, w) != tuple(hw):
        raise ValueError(f"{where}: RLE of a {h}x{w} image, the image is {hw[0]}x{hw[1]} "
                         f"(height x width)")
    if isinstance(counts, (str, bytes)):
        try:
            runs = rle_from_string(counts)
        except (ValueError, UnicodeError) as e:
            raise ValueError(f"{where}: bad compressed RLE counts ({e})") from None
    else:
        ok = isinstance(counts, (list, tuple, np.ndarray)) and all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in counts)
        runs = np.asarray(counts, np.int64) if ok and -2**63 <= min(counts, default=0) and \
            max(counts, default=0) < 2**63 else None
        if runs is None:
            raise ValueError(f"{where}: RLE counts must be integers or COCO's compressed "
                             f"string, got {str(counts)[:60]}")
    if (runs < 0).any() or (runs >= 2**32).any() or int(runs.sum()) != h * w:
        raise ValueError(f"{where}: RLE counts must be runs >= 0 covering the {h}x{w} image "
                         f"({h * w} pixels), they cover {int(runs.sum())}")
    return runs, (h, w)


def as_segments(value, n, image_hw=None, where="masks", names=None):
    """``value`` as the checked :class:`Segments` of ``n`` objects: a Segments, or a
    list with each object's mask (None or ``[]`` for none; a list of polygon parts,
    each an even number of x, y coordinates; an RLE dict).  ``image_hw`` (height,
    width), or (n, 2) one per object, when known, must be every RLE's size.  Parts of
    fewer than 3 points (no area) are dropped, as detectron2 drops them.  A ValueError
    names ``where`` and the object (``names(k)`` where given, e.g. ``annotation id 7``)."""
    per_object = image_hw is not None and np.ndim(image_hw) == 2

    def at(k):
        return f"{where}: {names(k) if names is not None else f'object {k}'}"

    def hw_of(k):
        return image_hw[k] if per_object else image_hw
    if isinstance(value, Segments):
        if len(value) != n:
            raise ValueError(f"{where}: {len(value)} masks for {n} objects")
        if image_hw is not None:
            want = np.broadcast_to(np.asarray(image_hw), value.rle_hw.shape)
            has = np.flatnonzero((value.runs[1:] > value.runs[:-1]) &
                                 (value.rle_hw != want).any(axis=1))
            if has.size:
                k = int(has[0])
                (h, w), (ih, iw) = value.rle_hw[k], want[k]
                raise ValueError(f"{at(k)}: RLE of a {h}x{w} image, the image is "
                                 f"{ih}x{iw} (height x width)")
        return value
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise ValueError(f"{where}: masks must be a list of one mask per object ({n}), got "
                         f"{type(value).__name__}" + (f" of {len(value)}" if isinstance(
                             value, (list, tuple)) else ""))
    parts, nparts, nruns, runs, rle_hw = [], np.zeros(n, np.int64), np.zeros(n, np.int64), \
        [], np.zeros((n, 2), np.int64)
    for k, v in enumerate(value):
        if v is None:
            continue
        if isinstance(v, dict):
            counts, rle_hw[k] = _rle_counts(v, hw_of(k), at(k))
            nruns[k] = len(counts)
            runs.append(counts)
        elif isinstance(v, (list, tuple)):
            before = len(parts)
            parts.extend(v)
            nparts[k] = len(parts) - before
        else:
            raise ValueError(f"{at(k)}: a mask is polygons (a list of coordinate lists) or "
                             f"an RLE dict, got {type(v).__name__}")
    # Every part's numbers at C speed (COCO has 1.2 million); the first bad one named.
    flat = None
    if parts and set(map(type, parts)) <= {list} and \
            set(map(type, chain.from_iterable(parts))) <= {int, float}:
        lengths = np.fromiter(map(len, parts), np.int64, len(parts))
        try:
            flat = np.fromiter(chain.from_iterable(parts), np.float64, int(lengths.sum()))
        except OverflowError:
            flat = None
    if flat is None:
        arrays = [_numbers(p) for p in parts]
        if any(a is None for a in arrays):
            j = next(j for j, a in enumerate(arrays) if a is None)
            k = int(np.searchsorted(np.cumsum(nparts), j, side="right"))
            raise ValueError(f"{at(k)}: a polygon must be a list of numbers (x0, y0, x1, y1, "
                             f"...), got {str(parts[j])[:60]}")
        lengths = np.asarray([len(a) for a in arrays], np.int64)
        flat = np.concatenate(arrays) if arrays else np.zeros(0)
    owner = np.repeat(np.arange(n), nparts)
    ends = _offsets(lengths)
    nonfinite = _offsets(~np.isfinite(flat))  # how many before each coordinate
    bad = (lengths % 2 == 1) | (nonfinite[ends[1:]] > nonfinite[ends[:-1]])
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{at(int(owner[j]))}: a polygon must be an even number of finite "
                         f"coordinates (x0, y0, x1, y1, ...), got {str(parts[j])[:60]}")
    with np.errstate(over="ignore"):
        f32 = flat.astype(np.float32)
    if not np.isfinite(f32).all():
        j = int(np.searchsorted(np.cumsum(lengths), np.flatnonzero(~np.isfinite(f32))[0],
                                side="right"))
        raise ValueError(f"{at(int(owner[j]))}: polygon coordinates {str(parts[j])[:60]} do "
                         f"not fit float32")
    keep = lengths >= 6
    if not keep.all():  # fewer than 3 points: no area
        f32 = f32[np.repeat(keep, lengths)]
        nparts = np.bincount(owner[keep], minlength=n)
        lengths = lengths[keep]
    return Segments(_offsets(nparts), _offsets(lengths), f32, _offsets(nruns),
                    np.concatenate(runs) if runs else (), rle_hw)


# ---- rasterising in the worker ----------------------------------------------------------------
def _sampling(window, flip, out_hw, scale):
    """The source coordinates each output row and column samples: (ys (H,), xs (W,)),
    and the source pixels per output pixel (sy, sx)."""
    top, left, wh, ww = (float(v) for v in window)
    h, w = (int(v) for v in out_hw)
    sy, sx = (wh / h, ww / w) if scale is None else (float(scale[0]), float(scale[1]))
    ox = np.arange(w, dtype=np.float64)
    if flip:
        ox = w - 1 - ox
    return top + (np.arange(h) + 0.5) * sy, left + (ox + 0.5) * sx, (sy, sx)


def _fill(parts, h, w):
    """The (h, w) pixels whose centre ``(x + .5, y + .5)`` is inside some part (each
    (V, 2) vertices in output pixels), even-odd within a part: each edge's crossing of
    each row's centre line toggles the pixels from the first centre right of it, and a
    cumulative sum along the row counts the toggles.  Exact point sampling, not Pillow's
    ``ImageDraw.polygon``, which truncates vertices to whole pixels (a pixel of bias on
    every edge at the output's resolution)."""
    out = np.zeros((h, w), bool)
    for uv in parts:
        x0, y0 = uv[:, 0], uv[:, 1]
        x1, y1 = np.roll(x0, -1), np.roll(y0, -1)
        r0 = np.clip(np.ceil(np.minimum(y0, y1) - 0.5), 0, h).astype(np.int64)
        r1 = np.clip(np.ceil(np.maximum(y0, y1) - 0.5), 0, h).astype(np.int64)
        n = np.maximum(r1 - r0, 0)  # rows whose centre line the edge crosses (half-open)
        e = np.repeat(np.arange(len(x0)), n)
        rows = _ranges(r0, n)
        x = x0[e] + (rows + 0.5 - y0[e]) * (x1[e] - x0[e]) / (y1[e] - y0[e])
        first = np.clip(np.floor(x + 0.5), 0, w).astype(np.int64)
        if not len(rows):
            continue
        # Only the part's box is counted: left of its first toggle and from its last on
        # a row has an even count (a closed part crosses each centre line evenly).
        r_lo, r_hi = int(rows.min()), int(rows.max()) + 1
        c_lo, c_hi = int(first.min()), int(first.max())
        span = c_hi - c_lo + 1
        toggles = np.bincount((rows - r_lo) * span + (first - c_lo),
                              minlength=(r_hi - r_lo) * span).reshape(r_hi - r_lo, span)
        out[r_lo:r_hi, c_lo:c_hi] |= (np.cumsum(toggles[:, :-1], axis=1) & 1).astype(bool)
    return out


def rasterise(segments, window, flip, out_hw, image_hw, scale=None):
    """Every object's mask, (N, H, W) bool, at ``out_hw`` = (H, W) over ``window``
    (top, left, height, width) of the ``image_hw`` source, mirrored when ``flip``;
    ``scale`` (source px per output px, y and x) in place of the window's own for a
    canvas.  A pixel is in a polygon mask when its centre's source point is inside a
    part (:func:`_fill`, the vertices mapped onto the output), in an RLE mask when the
    source pixel holding that point is; outside the image every mask is 0."""
    h, w = (int(v) for v in out_hw)
    ys, xs, (sy, sx) = _sampling(window, flip, out_hw, scale)
    top, left = float(window[0]), float(window[1])
    ih, iw = (int(v) for v in image_hw)
    rows, cols = (ys >= 0) & (ys < ih), (xs >= 0) & (xs < iw)
    out = np.zeros((len(segments), h, w), bool)
    for k in range(len(segments)):
        rle = segments.rle(k)
        if rle is not None:
            counts, (rh, rw) = rle
            ends = np.cumsum(counts, dtype=np.int64)
            py = np.clip(np.floor(ys).astype(np.int64), 0, rh - 1)
            px = np.clip(np.floor(xs).astype(np.int64), 0, rw - 1)
            # Column-major: pixel (y, x) is run position x * h + y; odd runs are 1s.
            run = np.searchsorted(ends, px[None, :] * rh + py[:, None], side="right")
            out[k] = (run & 1).astype(bool)
            continue
        parts = []
        for p in segments.polygons(k):
            u = (p[:, 0].astype(np.float64) - left) / sx
            parts.append(np.stack([w - u if flip else u,
                                   (p[:, 1].astype(np.float64) - top) / sy], axis=1))
        out[k] = _fill(parts, h, w)
    out &= rows[None, :, None] & cols[None, None, :]
    return out


def pack_masks(masks, nbytes):
    """(N, H, W) masks bit-packed, row-major, into (N, nbytes) uint8 (zero-padded)."""
    masks = np.asarray(masks, bool)
    n = len(masks)
    bits = np.packbits(masks.reshape(n, -1), axis=1)
    if bits.shape[1] > nbytes:
        raise ValueError(f"a {masks.shape[1]}x{masks.shape[2]} mask takes {bits.shape[1]} "
                         f"bytes, the record holds {nbytes}")
    out = np.zeros((n, int(nbytes)), np.uint8)
    out[:, :bits.shape[1]] = bits
    return out


def unpack_masks(packed, hw):
    """(k, nbytes) bit-packed masks as (k, H, W) uint8 0/1 of ``hw`` = (H, W)."""
    h, w = (int(v) for v in hw)
    packed = np.asarray(packed, np.uint8)
    bits = np.unpackbits(packed[:, :-(-h * w // 8)], axis=1, count=h * w)
    return bits.reshape(len(packed), h, w)


# ---- at the consumer ---------------------------------------------------------------------------
class StoredMasks:
    """The masks of some records as the ring or the echo buffer holds them: ``packed``
    (n, M, mask_bytes), each on its row's stored image of ``hw`` (n, 2); ``scale`` (n,
    2) source px per stored px and ``source_hw`` (n, 2), for canvases."""

    def __init__(self, packed, hw, scale, source_hw):
        self.packed, self.hw, self.scale, self.source_hw = packed, hw, scale, source_hw

    def emit(self, valid, cols, windows, flips, size, redrawn=None):
        """The masks of the kept objects, (B, m, H, W) uint8 at ``size``: entry ``(i, j)``
        where ``valid`` is object ``cols[i, j]`` of row ``i``.  ``redrawn`` (a
        :class:`~echo_native.transforms.Redrawn`, or None for the stored images as they
        are) says how the pixels came from the stored image: its ``canvas_boxes`` mean a
        canvas (resampled through each row's window and flip), else output space
        (mirrored where its ``mirror`` says)."""
        h, w = (int(v) for v in size)
        valid = np.asarray(valid, bool)
        out = np.zeros(valid.shape + (h, w), np.uint8)
        rows, slots = np.nonzero(valid)
        if not len(rows):
            return out
        objs = np.asarray(cols)[rows, slots]
        if redrawn is None or redrawn.canvas_boxes is None:
            masks = unpack_masks(self.packed[rows, objs], (h, w))
            mirror = None if redrawn is None else redrawn.mirror
            if mirror is not None:
                flip = np.asarray(mirror, bool)[rows]
                masks[flip] = masks[flip][:, :, ::-1]
            out[rows, slots] = masks
            return out
        for r in np.unique(rows):
            at = rows == r
            ch, cw = (int(v) for v in self.hw[r])
            canvas = unpack_masks(self.packed[r, objs[at]], (ch, cw))
            ys, xs, _ = _sampling(windows[r], bool(flips[r]), (h, w), None)
            sh, sw = (float(v) for v in self.source_hw[r])
            scy, scx = (float(v) for v in self.scale[r])
            cy, cx = np.floor(ys / scy).astype(np.int64), np.floor(xs / scx).astype(np.int64)
            ry = (ys >= 0) & (ys < sh) & (cy >= 0) & (cy < ch)
            rx = (xs >= 0) & (xs < sw) & (cx >= 0) & (cx < cw)
            m = canvas[:, np.clip(cy, 0, ch - 1)][:, :, np.clip(cx, 0, cw - 1)]
            out[r, slots[at]] = m * (ry[:, None] & rx[None, :])
        return out


class _MasksField(ObjectField):
    """Each object's mask: ``Targets.masks`` (:class:`Segments`), rasterised by the
    worker at the stored image's size inside the window just decoded, bit-packed in
    the record, and at each emission unpacked (:class:`StoredMasks`)."""

    name, size, column = "masks", "mask_bytes", "obj_masks"

    def carried(self, source, sample_bytes):
        return (mask_bytes(sample_bytes), None) if self.given(source) else (0, None)

    def check(self, value, n, image_hw, where):
        return as_segments(value, n, image_hw, where)

    def to_json(self, value):
        return value.to_json()

    def write(self, out, value, size, *, window, flip, shape, image_hw, scale):
        out[...] = 0  # an object without a mask: empty
        if value is not None:
            out[...] = pack_masks(rasterise(value, window, flip, shape, image_hw, scale), size)

    def stored(self, columns):
        return StoredMasks(columns.obj_masks, columns.shapes, columns.canvas_scale,
                           columns.source_hw)

    def emit(self, stored, valid, cols, windows, flips, size, redrawn, rule):
        return stored.emit(valid, cols, windows, flips, size, redrawn)

    def torchvision(self, value, tv):
        return value if tv is None else tv.Mask(value)


#: The masks field of a record (:class:`~echo_native.protocol.ObjectField`).
MASKS = _MasksField()

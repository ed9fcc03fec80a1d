"""A COCO-format detection data set as a source: :class:`CocoDetection`.

COCO's instances format is one JSON file (``images``, ``annotations``,
``categories``) beside a folder of images.  It is read with the standard
library's ``json`` (no pycocotools), checked whole at construction (a bad
annotation is found before any worker starts, named by the file and its id),
and kept as a few packed arrays: a source is pickled into every worker, and a
Python object per annotation would make that cost seconds for COCO's 860,000.
"""
from __future__ import annotations

import errno
import json
import os
from itertools import chain, repeat
from operator import itemgetter
from pathlib import Path

import numpy as np

from echo_native.errors import ReadLimitError
from echo_native.keypoints import Keypoints
from echo_native.masks import as_segments
from echo_native.memory import _gib, memory_available
from echo_native.files import (DEFAULT_MAX_FILE_BYTES, _check_max_file_bytes, _PackedPaths,
                               open_file, read_file, read_open)
from echo_native.targets import TOLERANCE_PX, _trusted

__all__ = ["DEFAULT_MAX_ANNOTATION_BYTES", "MAX_CATEGORY_ID", "CocoDetection"]

#: Largest annotation file read: COCO 2017's train instances are 448 MB; LVIS's about 1 GB.
DEFAULT_MAX_ANNOTATION_BYTES = 4 * 2**30

#: Fields of COCO and LVIS files this source never reads, dropped as each object is
#: parsed: the polygons alone are most of the file, and as Python lists of floats they
#: took about 5 times its size (a 200 MB file, 985 MiB at its peak).
_UNUSED = frozenset(("segmentation", "area", "keypoints", "num_keypoints", "license",
                     "coco_url", "flickr_url", "date_captured", "supercategory", "info",
                     "licenses", "neg_category_ids", "not_exhaustive_category_ids", "synset",
                     "synonyms", "def", "frequency", "image_count", "instance_count"))

#: Share of the memory available that an annotation file's parse may take.
_MEMORY_SHARE = 0.9

#: Memory the parse of a COCO-shaped file takes, over the file's size (its text, and the
#: objects kept: ids, boxes, names), measured at 2.4 on COCO-like instances files; what
#: is estimated before a file is parsed (with the objects its brackets count as a floor).
PARSE_FACTOR = 3.0


def _parse_bytes(data):
    """An estimate of the memory parsing ``data`` takes: ``PARSE_FACTOR`` times its size,
    or, for a file of small objects and lists (``[[],[],...]`` takes 19 times its size),
    its text plus a dict or list per bracket, whichever is more."""
    containers = 184 * data.count(b"{") + 56 * data.count(b"[")
    return max(int(PARSE_FACTOR * len(data)), len(data) + containers)


def _rss():
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class _Guard:
    """The parse's ``object_hook``: drops the fields never read (freed as the parse goes)
    and, every 8192 objects, checks the process's growth against the budget, so that a
    file the estimate misjudged stops with a ValueError rather than the OOM killer."""

    def __init__(self, budget, too_big, unused=_UNUSED):
        self.budget, self.too_big, self.size = budget, too_big, 0
        self.unused = unused
        self.start = _rss() if budget is not None else None
        self.calls = 0

    def __call__(self, d):
        for k in self.unused.intersection(d):
            del d[k]
        self.calls += 1
        if not self.calls & 0x1FFF and self.start is not None:
            now = _rss()
            if now is not None and now - self.start > self.budget:
                raise self.too_big(self.size, f"took {_gib(now - self.start)} before it was "
                                              f"stopped")
        return d


class _OverBudget(Exception):
    """A parse refused for its memory (before it, or stopped by :class:`_Guard`); carries
    the ValueError to raise, past the handler that calls a ValueError a bad file."""


#: Largest category id ``contiguous_labels=False`` takes as a label: the labels index
#: ``categories`` (and a model's ``num_classes`` outputs), so one id of 2**31 - 1 in a
#: file under 1 kB would be a 16 GiB table.  COCO's ids end at 90, LVIS's at 1203.
MAX_CATEGORY_ID = 2**20


def _fast_ints(values):
    """``values`` as int64 when every one is a JSON integer that fits, else None."""
    if not values:
        return np.zeros(0, np.int64)
    if set(map(type, values)) != {int}:
        return None
    try:
        return np.asarray(values, np.int64)
    except OverflowError:
        return None


def _is_int(v):
    """A JSON integer that fits int64 (``true`` is not one)."""
    return isinstance(v, int) and not isinstance(v, bool) and -2**63 <= v < 2**63


class CocoDetection:
    """Images and their boxes from a COCO instances file, ``annotation_json``, with the
    images under ``images_root`` (each image's ``file_name`` relative to it).

    Samples are the file's images, sorted by id (``image_ids``); ``labels`` are
    zeros (an image has no class of its own), ``read(i)`` is the image's bytes
    (refused over ``max_file_bytes``), ``describe(i)`` its path, and
    ``targets(i)`` its :class:`~echo_native.targets.Targets`: each annotation's
    ``bbox`` (x, y, width, height) as x1, y1, x2, y2 pixels, its label and
    ``iscrowd``, in the order of the file, with the image's ``(height, width)``
    from the file.

    Labels: category ids are mapped, in increasing order, to 1, 2, ... (0 is the
    background, as torchvision's detection models count it); ``category_to_label``
    and ``label_to_category`` hold the mapping, ``categories[label]`` the name
    (``"__background__"`` at 0), ``num_classes`` what a model's ``num_classes``
    takes.  ``contiguous_labels=False`` keeps the category ids themselves as
    labels (torchvision's COCO-pretrained detectors predict those: 91 classes with
    gaps, named ``"N/A"`` in ``categories``); ids from 1 to ``MAX_CATEGORY_ID``
    (2**20) only, as ``categories`` holds one entry per label up to the largest.

    ``keypoints=True`` reads pose targets too: each annotation's ``keypoints`` (x, y,
    visibility per point; none labelled where an annotation has none), named by the
    categories' ``keypoints`` list, whose ``left_``/``right_`` names pair the points a
    flip swaps (``self.keypoints``, a :class:`~echo_native.keypoints.Keypoints`).
    Batches then carry ``objects.keypoints`` (B, M, K, 3) in output pixels.

    ``masks=True`` reads instance masks too: each annotation's ``segmentation``
    (polygons, or RLE with ``counts`` a list or COCO's compressed string; an empty mask
    where it has none), kept packed (:class:`~echo_native.masks.Segments`), rasterised
    in the workers: batches carry ``objects.masks`` (B, M, H, W) uint8.

    ``keep_empty=False`` drops the images that have no annotation (torchvision's
    detection training reference drops them; it also drops images whose every
    box is at most 1 px wide or tall, and leaves crowd annotations out, which
    this source keeps, flagged by ``iscrowd``).

    Everything is checked at construction; a ValueError names the file and the
    annotation (or image) id: missing fields, values of the wrong type, non-finite
    numbers, a negative width or height, a box outside its image by more than
    1 px (boxes within 1 px, from COCO's rounding, are clipped to the image), an
    unknown image or category id, duplicate image or category ids, and a
    ``file_name`` that leaves ``images_root`` (absolute, or through ``..``).

    Memory: the file is parsed without the fields this source never reads
    (polygons, URLs, ...), dropped as they are parsed: about 2.4 times the file
    at the peak, not 5.  Before the parse, ``PARSE_FACTOR`` times the file (or,
    for a file of tiny objects, its brackets counted) is checked against the
    memory available (``MemAvailable``, the memory cgroup), and during it the
    process's growth: a file that does not fit is a ValueError naming it, the
    figures and ``max_annotation_bytes``, not the OOM killer.

    ``read(i)`` refuses (``ReadLimitError``, a sample failure) a file that a
    symbolic link inside ``images_root`` leads out of it (``out.jpg -> /etc/x``,
    ``up -> ..``), naming the file and where it leads; ``trust_links=True`` reads
    such links as given (a data set held as links into a cache).  A root that is
    itself a link is where the images are.
    """

    has_targets = True

    def __init__(self, images_root, annotation_json, *, keep_empty=True,
                 contiguous_labels=True, max_file_bytes=DEFAULT_MAX_FILE_BYTES,
                 max_annotation_bytes=DEFAULT_MAX_ANNOTATION_BYTES, trust_links=False,
                 keypoints=False, masks=False):
        self._pose, self.masks = bool(keypoints), bool(masks)
        self.keypoints = None   # the Keypoints spec, with keypoints=True
        self.max_file_bytes = _check_max_file_bytes("CocoDetection", max_file_bytes)
        limit = _check_max_file_bytes("CocoDetection", max_annotation_bytes)
        self.root = Path(images_root)
        self.trust_links = bool(trust_links)
        self.annotation_json = str(annotation_json)
        name = self.annotation_json
        name = name if name.isprintable() else repr(name)  # for messages: one line each
        if not self.root.is_dir():
            raise FileNotFoundError(f"CocoDetection: images_root {str(self.root)!r} is not a "
                                    f"directory")
        # Where the images really are (the root may itself be a link): what read() opens
        # must be under it, whatever links inside the root say.
        self._real_root = os.path.realpath(self.root)
        if not os.path.exists(self.annotation_json):
            raise FileNotFoundError(f"CocoDetection: annotation file "
                                    f"{self.annotation_json!r} does not exist")
        try:
            doc = self._load(name, limit)
        except OSError as e:
            raise ValueError(f"{name}: {e.strerror or e}") from None
        except RecursionError:
            raise ValueError(f"{name}: not a COCO annotation file (nested too deeply)") \
                from None
        except _OverBudget as e:
            raise e.args[0] from None
        except ValueError as e:
            raise ValueError(f"{name}: not a COCO annotation file ({str(e)[:200]})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("images"), list):
            raise ValueError(f"{name}: not a COCO annotation file (no 'images' list)")
        for key in ("annotations", "categories"):
            if not isinstance(doc.get(key, []), list):
                raise ValueError(f"{name}: {key!r} must be a list")
        ids, hw, files = self._images(doc["images"])
        cats = self._categories(doc.get("categories", []), contiguous_labels)
        anns = doc.get("annotations", [])
        img_of, boxes, labels, crowd = self._annotations(anns, ids, hw, cats)
        points = self._keypoints(anns, doc.get("categories", [])) if self._pose else None
        segments = None
        if self.masks:  # checked against each annotation's image (an RLE's size)
            segments = as_segments([a.get("segmentation") for a in anns], len(anns),
                                   hw[img_of], name, lambda k: f"annotation id {anns[k]['id']}")
        del doc, anns
        counts = np.bincount(img_of, minlength=len(ids))
        keep = np.ones(len(ids), bool) if keep_empty else counts > 0
        if not keep.any():
            raise ValueError(f"{name}: no images" + ("" if keep_empty else
                                                     " with annotations (keep_empty=False)"))
        order = np.argsort(img_of, kind="stable")  # by image, in the file's order within one
        self._boxes = np.ascontiguousarray(boxes[order])
        self._labels = labels[order]
        self._crowd = crowd[order]
        self._points = None if points is None else np.ascontiguousarray(points[order])
        self._masks = None if segments is None else segments.take(order)
        self._starts = np.zeros(int(keep.sum()) + 1, np.int64)
        np.cumsum(counts[keep], out=self._starts[1:])
        self.image_ids = ids[keep]
        self._hw = hw[keep]
        self._paths = _PackedPaths([f for f, k in zip(files, keep.tolist()) if k])
        self.labels = np.zeros(len(self.image_ids), np.int64)

    # ---- construction ---------------------------------------------------------------------
    def _load(self, name, limit):
        """The annotation file parsed, without the fields this source never reads, after
        its memory is checked against what is available (ValueError naming both)."""
        available, where = memory_available()
        budget = None if available is None else int(available * _MEMORY_SHARE)

        def too_big(size, how):
            return _OverBudget(ValueError(
                f"{name}: parsing its {_gib(size)} {how}, more than the {_gib(available)} "
                f"available ({where}); free memory or use a larger machine "
                f"(max_annotation_bytes={limit} bounds the file's size, not the memory its "
                f"parse takes)"))
        # counts from here: the bytes and the text too
        kept = {"keypoints"} if self._pose else set()
        kept |= {"segmentation"} if self.masks else set()
        guard = _Guard(budget, too_big, _UNUSED - kept)
        size = os.path.getsize(self.annotation_json)
        # Its bytes and their text, at least (a file over the limit is read_file's to name).
        if budget is not None and size <= limit and 2 * size > budget:
            raise too_big(size, f"would take at least {_gib(2 * size)}")
        data = read_file(self.annotation_json, limit)
        need = _parse_bytes(data)
        if budget is not None and need > budget:
            raise too_big(len(data), f"would take about {_gib(need)}")
        guard.size = len(data)
        text = data.decode(json.detect_encoding(data), "surrogatepass")
        del data  # the text is what the parse reads: the bytes need not stay beside it
        return json.loads(text, object_hook=guard)

    def _bad(self, what, ident, why):
        # Names and ids are data: one that holds a newline cannot break the message.
        name, text = self.annotation_json, str(ident)[:60]
        return ValueError(f"{name if name.isprintable() else repr(name)}: {what} "
                          f"{text if text.isprintable() else repr(text)}: {why}")

    def _objects(self, rows, what):
        """Refuse a row of ``rows`` that is not a JSON object, naming its position."""
        if set(map(type, rows)) - {dict}:
            k = next(k for k, r in enumerate(rows) if type(r) is not dict)
            raise self._bad(what, f"#{k}", f"expected an object, got {type(rows[k]).__name__}")

    def _column(self, rows, key, what):
        """Every row's ``key`` (rows are objects); a row without it is named."""
        try:
            return list(map(itemgetter(key), rows))
        except KeyError:
            k = next(k for k, r in enumerate(rows) if key not in r)
            raise self._bad(f"{what} id", rows[k].get("id", f"#{k} (no id)"),
                            f"no {key!r}") from None

    def _images(self, images):
        self._objects(images, "image")
        ids, files, ws, hs = (self._column(images, key, "image")
                              for key in ("id", "file_name", "width", "height"))
        idx = _fast_ints(ids)
        if idx is None:
            k = next(k for k, v in enumerate(ids) if not _is_int(v))
            raise self._bad("image", f"#{k}", f"id {str(ids[k])[:40]!r} is not an integer")
        h, w = _fast_ints(hs), _fast_ints(ws)
        if h is None or w is None or ((h <= 0) | (h >= 2**31) | (w <= 0) | (w >= 2**31)).any():
            k = next(k for k, (hk, wk) in enumerate(zip(hs, ws))
                     if not (_is_int(hk) and _is_int(wk) and 0 < hk < 2**31 and 0 < wk < 2**31))
            raise self._bad("image id", ids[k], f"width and height must be positive integers, "
                                                f"got {str(ws[k])[:20]} x {str(hs[k])[:20]}")
        # Only names that could leave the root, or be no path, are looked at one by one.
        if set(map(type, files)) != {str} or not all(files):
            odd = range(len(files))
        else:
            odd = [k for k, f in enumerate(files) if ".." in f or "\0" in f or f[0] in "/\\"]
            try:
                "\n".join(files).encode("utf-8", "surrogateescape")
            except UnicodeError:
                odd = range(len(files))
        for k in odd:
            self._file_name(files[k], ids[k])
        hw = np.stack([h, w], axis=1).astype(np.int32).reshape(-1, 2)
        order = np.argsort(idx, kind="stable")
        idx, hw = idx[order], hw[order]
        dup = np.flatnonzero(idx[1:] == idx[:-1])
        if dup.size:
            raise self._bad("image id", int(idx[dup[0]]), "listed twice in 'images'")
        return idx, hw, [files[j] for j in order.tolist()]

    def _file_name(self, f, ident):
        if not isinstance(f, str) or not f:
            raise self._bad("image id", ident, f"file_name must be a non-empty string, got "
                                               f"{str(f)[:40]!r}")
        parts = f.replace("\\", "/").split("/")
        if f.startswith(("/", "\\")) or os.path.isabs(f) or ".." in parts or "\0" in f:
            raise self._bad("image id", ident, f"file_name {f[:200]!r} leaves images_root "
                                               f"(absolute, through '..', or with a NUL)")
        try:
            os.fsencode(f)
        except UnicodeError:
            raise self._bad("image id", ident, f"file_name {f[:200]!r} is not a valid "
                                               f"path") from None
        return f

    def _categories(self, categories, contiguous):
        ids, names = [], []
        for k, c in enumerate(categories):
            if not isinstance(c, dict) or not _is_int(c.get("id")):
                raise self._bad("category", f"#{k}", "expected an object with an integer id")
            ids.append(c["id"])
            names.append(str(c.get("name", c["id"])))
        if len(set(ids)) != len(ids):
            seen = set()  # the first id seen twice, in one pass (list.count per id is quadratic)
            dup = next(i for i in ids if i in seen or seen.add(i))
            raise self._bad("category id", dup, "listed twice in 'categories'")
        ordered = sorted(zip(ids, names))
        if contiguous:
            self.category_to_label = {cid: j + 1 for j, (cid, _) in enumerate(ordered)}
        else:
            bad = [cid for cid, _ in ordered if not 1 <= cid]
            if bad:
                raise self._bad("category id", bad[0], "is not a label (with "
                                "contiguous_labels=False, category ids are the labels, "
                                "1 or more: 0 is the background)")
            if ordered and ordered[-1][0] > MAX_CATEGORY_ID:
                raise self._bad("category id", ordered[-1][0], f"is over {MAX_CATEGORY_ID:,}, "
                                f"the largest label contiguous_labels=False takes (the labels "
                                f"index a table of num_classes entries); leave "
                                f"contiguous_labels=True to number the categories 1, 2, ...")
            self.category_to_label = {cid: cid for cid, _ in ordered}
        self.label_to_category = {lab: cid for cid, lab in self.category_to_label.items()}
        self.num_classes = max(self.label_to_category, default=0) + 1
        self.categories = ["N/A"] * self.num_classes
        self.categories[0] = "__background__"
        for cid, n in ordered:
            self.categories[self.category_to_label[cid]] = n
        return np.asarray([cid for cid, _ in ordered], np.int64)

    def _annotations(self, anns, image_ids, hw, cat_ids):
        # Columns taken at C speed (a Python loop over COCO's 860,000 would cost seconds);
        # what fails a check is then found one by one, to name it.
        self._objects(anns, "annotation")
        aids, iids, bboxes, cids = (self._column(anns, key, "annotation")
                                    for key in ("id", "image_id", "bbox", "category_id"))
        crowd = list(map(dict.get, anns, repeat("iscrowd"), repeat(0)))
        img = self._ints(iids, aids, "image_id")
        cat = self._ints(cids, aids, "category_id")
        flags = self._ints(crowd, aids, "iscrowd", allow_bool=True)
        bad = np.flatnonzero((flags != 0) & (flags != 1))
        if bad.size:
            k = int(bad[0])
            raise self._bad("annotation id", aids[k], f"iscrowd is {crowd[k]!r}, not 0 or 1")
        box = self._bbox_array(bboxes, aids)
        # Which image, which category: unknown ids named.
        where = self._positions(image_ids, img, aids, "image_id", "images")
        cpos = self._positions(cat_ids, cat, aids, "category_id", "categories")
        lut = np.zeros(len(cat_ids), np.int64)
        for j, c in enumerate(cat_ids.tolist()):
            lut[j] = self.category_to_label[c]
        labels = lut[cpos].astype(np.int32)  # labels are below 2**31 (checked)
        xyxy = self._checked_boxes(box, hw[where], aids, img)
        return where.astype(np.int64), xyxy, labels, flags.astype(bool)

    def _keypoints(self, anns, categories):
        """Each annotation's keypoints (N, K, 3) float32, and ``self.keypoints`` from the
        categories' keypoint names (an annotation without keypoints has none labelled)."""
        lists = {tuple(c["keypoints"]) for c in categories
                 if isinstance(c, dict) and isinstance(c.get("keypoints"), list) and c["keypoints"]}
        if len(lists) != 1:
            raise self._bad("categories", "keypoints", "keypoints=True needs the categories' "
                            "keypoint names, one list shared by every category that has "
                            f"them; found {len(lists)}")
        names = next(iter(lists))
        try:
            self.keypoints = Keypoints(names)
        except ValueError as e:
            raise self._bad("categories", "keypoints", str(e)) from None
        k = len(names)
        values = [a.get("keypoints") for a in anns]
        have = [j for j, v in enumerate(values) if v is not None]
        out = np.zeros((len(anns), k, 3), np.float32)
        rows = None
        if set(map(type, (values[j] for j in have))) <= {list} and \
                set(len(values[j]) for j in have) <= {3 * k} and \
                set(map(type, chain.from_iterable(values[j] for j in have))) <= {int, float}:
            try:  # at C speed, as the boxes: COCO has 250,000 people
                rows = np.asarray([values[j] for j in have], np.float64).reshape(-1, k, 3)
            except (TypeError, ValueError):
                rows = None
        good = rows is not None and np.isfinite(rows).all() and \
            np.isin(rows[..., 2], (0, 1, 2)).all()
        if not good:  # name the first bad one
            for j in have:
                row = np.asarray(values[j], dtype=object).ravel()
                ok = len(row) == 3 * k and all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and np.isfinite(x)
                    for x in row) and all(x in (0, 1, 2) for x in row[2::3])
                if not ok:
                    raise self._bad("annotation id", anns[j].get("id"), f"keypoints must be "
                                    f"{3 * k} finite numbers, x, y and visibility 0, 1 or 2 "
                                    f"per point, got {str(values[j])[:80]}")
            rows = np.array([np.asarray(values[j], np.float64) for j in have]).reshape(-1, k, 3)
        out[have] = rows
        return out

    def _positions(self, known, ids, aids, field, table):
        """Where each of ``ids`` is in the sorted ``known`` ids; the first unknown one is
        named with its annotation id."""
        pos = np.searchsorted(known, ids)
        found = pos < len(known)
        found[found] = known[pos[found]] == ids[found]
        if not found.all():
            k = int(np.flatnonzero(~found)[0])
            raise self._bad("annotation id", aids[k], f"{field} {int(ids[k])} is not in "
                                                      f"'{table}'")
        return pos

    def _ints(self, values, aids, what, allow_bool=False):
        """``values`` (one per annotation) as int64; else the first that is not an
        integer is named (bools are not integers here, except as iscrowd flags)."""
        try:
            arr = np.asarray(values)
        except (ValueError, TypeError, OverflowError):
            arr = None
        if arr is not None and arr.ndim == 1:
            kind = arr.dtype.kind
            if not arr.size or kind == "i" and (allow_bool or bool not in set(map(type, values))) \
                    or kind == "b" and allow_bool:
                return arr.astype(np.int64)
        for k, v in enumerate(values):
            if not (_is_int(v) or allow_bool and isinstance(v, bool)):
                raise self._bad("annotation id", aids[k], f"{what} {repr(v)[:40]} is not "
                                                          f"an integer")
        raise self._bad("annotations", "", f"{what} values are not integers")

    def _bbox_array(self, bboxes, aids):
        if not bboxes:
            return np.zeros((0, 4))
        # Lists of 4 ints or floats only: numpy would take "1" or true for numbers.
        if set(map(type, bboxes)) == {list} and set(map(len, bboxes)) == {4} and \
                set(map(type, chain.from_iterable(bboxes))) <= {int, float}:
            try:
                flat = np.fromiter(chain.from_iterable(bboxes), np.float64, 4 * len(bboxes))
                return flat.reshape(-1, 4)
            except OverflowError:  # an integer past float64
                pass
        rows = []
        for k, b in enumerate(bboxes):  # name the first that is not 4 numbers
            try:
                if not (isinstance(b, list) and len(b) == 4 and all(
                        isinstance(v, (int, float)) and not isinstance(v, bool) for v in b)):
                    raise TypeError
                rows.append([float(v) for v in b])
            except (TypeError, OverflowError):
                raise self._bad("annotation id", aids[k], f"bbox {str(b)[:80]} is not "
                                                          f"[x, y, width, height] numbers") \
                    from None
        return np.asarray(rows, np.float64)

    def _checked_boxes(self, box, hw, aids, img):
        def fail(mask, why):
            k = int(np.flatnonzero(mask)[0])
            raise self._bad("annotation id", aids[k], f"(image id {int(img[k])}) bbox "
                                                      f"{box[k].tolist()} {why}")
        with np.errstate(invalid="ignore", over="ignore"):
            bad = ~np.isfinite(box).all(axis=1)
            if bad.any():
                fail(bad, "holds a non-finite number")
            bad = (box[:, 2] < 0) | (box[:, 3] < 0)
            if bad.any():
                fail(bad, "has a negative width or height")
            xyxy = box.copy()
            xyxy[:, 2:] += xyxy[:, :2]
            h, w = hw[:, 0].astype(np.float64), hw[:, 1].astype(np.float64)
            t = TOLERANCE_PX
            bad = (xyxy[:, 0] < -t) | (xyxy[:, 1] < -t) | (xyxy[:, 2] > w + t) | \
                (xyxy[:, 3] > h + t)
            if bad.any():
                k = int(np.flatnonzero(bad)[0])
                fail(bad, f"lies outside its {int(h[k])}x{int(w[k])} (height x width) image "
                          f"by more than {t:g} px")
            np.clip(xyxy[:, 0::2], 0, w[:, None], out=xyxy[:, 0::2])
            np.clip(xyxy[:, 1::2], 0, h[:, None], out=xyxy[:, 1::2])
        return xyxy.astype(np.float32)

    # ---- the source -------------------------------------------------------------------------
    def __len__(self):
        return len(self.image_ids)

    def path(self, i) -> str:
        return os.path.join(self.root, self._paths[i])

    def describe(self, i) -> str:
        return self.path(i)

    def read(self, i) -> bytes:
        path = self.path(i)
        if self.trust_links:
            return read_file(path, self.max_file_bytes)
        fd = open_file(path)
        try:
            self._check_inside(fd, i)
            return read_open(fd, self.max_file_bytes)
        finally:
            os.close(fd)

    def _check_inside(self, fd, i):
        """Refuse an opened file that is not under images_root: ``file_name`` was checked
        lexically at construction, but a link inside the root (``out.jpg -> /etc/x``,
        ``up -> ..``) leads anywhere.  What was opened is asked of /proc, so a link
        swapped after a check cannot slip through; realpath where there is no /proc."""
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            real = os.path.realpath(self.path(i))
        root = self._real_root
        if real.startswith(root.rstrip(os.sep) + os.sep):
            return
        name = self._paths[i]

        def shown(text):
            return text if text.isprintable() else repr(text)
        raise ReadLimitError(errno.EACCES, f"file_name {shown(name)} resolves to "
                                           f"{shown(real)}, outside images_root {shown(root)} "
                                           f"(through a symbolic link); pass CocoDetection(..., "
                                           f"trust_links=True) to read links out of the root")

    def targets(self, i):
        """Image ``i``'s boxes (x1, y1, x2, y2 pixels), labels and iscrowd flags."""
        s, e = int(self._starts[i]), int(self._starts[i + 1])
        h, w = self._hw[i]
        return _trusted(self._boxes[s:e], self._labels[s:e].astype(np.int64),
                        self._crowd[s:e], (int(h), int(w)),
                        {"keypoints": None if self._points is None else self._points[s:e],
                         "masks": None if self._masks is None else self._masks.take(slice(s, e))})

    @property
    def num_annotations(self) -> int:
        return int(self._starts[-1])

    def __repr__(self):
        return (f"CocoDetection({str(self.root)!r}, {self.annotation_json!r}, {len(self)} "
                f"images, {self.num_annotations} annotations, "
                f"{len(self.label_to_category)} categories)")

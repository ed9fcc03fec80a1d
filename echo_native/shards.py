"""Pack a source into WebDataset-style tar shards that :class:`TarShards` reads.

``write_shards(source, out_dir)`` (and ``echo-native make-shards SRC OUT``)
writes ``shard-000000.tar``, ``shard-000001.tar``, ... each holding, per
sample, ``<key>.<ext>`` (the image's bytes, untouched unless re-encoded) and
``<key>.cls`` (its integer label), and for a source that carries detection
targets (a :class:`~echo_native.CocoDetection`, ...) ``<key>.json`` (its
targets, :mod:`echo_native.targets`, between the two: the label is a sample's
last member, so a shard cut short never keeps a sample without its targets),
plus a ``<shard>.idx`` sidecar
(:mod:`echo_native.tarindex`) so that readers never scan the shard.  Keys are
the samples' indices in the source, zero-padded (``000042``), so sorted keys
are the source's order and a key says which input a sample came from.

Why it is built the way it is:

* Shards are written under a temporary name and renamed when complete (or,
  for object storage, uploaded when complete: an object appears whole or not
  at all), so an interrupted run never leaves a truncated shard under a final
  name.  Temporary files are made by ``mkstemp`` (a fresh random name opened
  with ``O_EXCL``) in the output folder, never under a name another user could
  guess and plant a link at, and the rename replaces whatever is at the final
  name instead of writing through it.  For a URL the temporaries live in a
  private local folder (``mkdtemp``, mode 0700) and each shard is uploaded to its
  final name once complete: object stores have no links, and fsspec offers no
  ``O_EXCL`` or ``O_NOFOLLOW`` for filesystems that do (sftp, smb), so nothing is
  ever written there under a temporary name.
* The shards are deterministic: the same input gives the same bytes (member
  times, owners and modes are fixed), so re-running is harmless and shards can
  be compared by checksum.
* Each input is decoded once with the pipeline's own decoder (``verify``), so
  an image that would fail in training is reported now, with its path, and
  left out (or, with ``strict``, stops the run) instead of failing every epoch.
"""
from __future__ import annotations

import io
import math
import os
import shutil
import sys
import tarfile
import tempfile
import warnings

import numpy as np

from echo_native import remote as _remote
from echo_native import tarindex
from echo_native.targets import as_targets, source_targets, targets_to_json

__all__ = ["write_shards", "ShardList", "ShardWriteError", "parse_size", "shard_files"]

#: Extensions kept as they are (content sniffed, not trusted from the name).
_MAGIC = ((b"\xff\xd8\xff", ".jpg"), (b"\x89PNG\r\n\x1a\n", ".png"), (b"BM", ".bmp"),
          (b"II*\x00", ".tiff"), (b"MM\x00*", ".tiff"))


class ShardWriteError(ValueError):
    """An input could not be packed and ``strict`` was asked for; names the input."""


class ShardList(list):
    """The shards written (paths or URLs, in order), plus what happened on the way:
    ``samples`` packed, ``failures`` as ``(input name, message)`` pairs, ``reencoded``,
    ``not_seekable`` and ``resumed``."""

    samples: int = 0
    reencoded: int = 0

    def __init__(self, paths=(), failures=None):
        super().__init__(paths)
        self.failures = list(failures or [])
        #: ``(input name, why)`` of the JPEGs ``seekable=True`` stored as they were.
        self.not_seekable = []
        #: Shards an interrupted run left complete, kept by ``resume=True``.
        self.resumed = len(self)


def parse_size(text) -> int:
    """``"256MB"`` -> 256_000_000, ``"1GiB"`` -> 2**30, ``"4096"`` -> 4096 (bytes)."""
    import re

    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(i?)(b?)\s*", str(text), re.IGNORECASE)
    if not m or (m.group(3) and not m.group(2)):
        raise ValueError(f"not a size: {text!r} (e.g. 256MB, 1GiB, 500000)")
    power = " kmgt".index(m.group(2).lower() or " ")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** power)


def shown(name) -> str:
    """A name as a report shows it: itself when printable, else its repr (a newline
    or undecodable byte in a file name cannot break or forge a report line)."""
    name = str(name)
    return name if name.isprintable() else repr(name)


def _image_ext(data, name):
    for magic, ext in _MAGIC:
        if data[:len(magic)] == magic:
            return ext
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return ".webp"
    if data[:2] in (b"P5", b"P6"):
        return ".pgm" if data[:2] == b"P5" else ".ppm"
    ext = os.path.splitext(str(name))[1].lower()
    return ".jpg" if ext in ("", ".jpeg") or ext not in tarindex.IMAGE_EXTS else ext


def _reencode(data, max_side, quality):
    """``data`` scaled so its longer side is ``max_side`` (aspect kept), as JPEG, and
    its new (height, width)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        # draft() lets libjpeg decode at 1/2, 1/4 or 1/8 scale when that is still larger
        # than the target: far less work for a big photograph, same result after resize.
        w, h = im.size
        scale = max_side / max(w, h)
        im.draft("RGB", (max(1, math.ceil(w * scale)), max(1, math.ceil(h * scale))))
        im = im.convert("L" if im.mode in ("L", "I;16", "I", "1") else "RGB")
        w, h = im.size
        scale = max_side / max(w, h)
        size = (max(1, round(w * scale)), max(1, round(h * scale)))
        im = im.resize(size, Image.Resampling.LANCZOS)
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=quality)
        return buf.getvalue(), (size[1], size[0])


def _member(name, size):
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, 0, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _tar_bytes(size):
    """A member's bytes in the tar: its header block and its data padded to blocks."""
    return 512 + -(-size // 512) * 512


def _closed_size(members_bytes):
    """The tar's size once closed: two zero blocks, then padding to tarfile.RECORDSIZE."""
    return -(-(members_bytes + 1024) // tarfile.RECORDSIZE) * tarfile.RECORDSIZE


class _Output:
    """Where finished shards go: a local folder (rename into place) or a URL (upload)."""

    def __init__(self, out, storage_options, remote, overwrite, resume=False):
        self.url = _remote.is_url(str(out))
        self.kept, self.next_key = [], 0
        if resume and (self.url or overwrite):
            raise ValueError("resume=True needs a local out_dir and overwrite=False")
        if resume:
            self._resume(out)
            return
        if self.url:
            self.base = str(out).rstrip("/")
            self.store = _remote.RemoteStore(storage_options, remote)
            fs, path = self.store.filesystem(self.base)
            existing = fs.glob(f"{path}/shard-*.tar") + fs.glob(f"{path}/shard-*.tar.idx")
            if existing and not overwrite:
                raise FileExistsError(f"{_remote.redact(self.base)} already holds shards "
                                      f"(pass overwrite=True / --overwrite to replace them)")
            for p in existing:
                fs.rm_file(p)
            self.tmpdir = tempfile.mkdtemp(prefix="echo_native-shards-")
        else:
            self.base = os.fspath(_remote.local_path(out))
            os.makedirs(self.base, exist_ok=True)
            self.tmpdir = self.base
            existing = [n for n in os.listdir(self.base)
                        if n.startswith("shard-") and n.endswith((".tar", ".tar.idx"))]
            if existing and not overwrite:
                raise FileExistsError(f"{self.base} already holds shards (pass overwrite=True "
                                      f"/ --overwrite to replace them)")
            for n in existing:
                os.unlink(os.path.join(self.base, n))

    def _resume(self, out):
        """Keep the complete shards of an interrupted run: shard-0..k-1 each with its
        index (a shard is renamed into place before its index is written, so a shard
        without one may be incomplete: it and any later one are removed), and go on at
        the key after the last sample they hold."""
        self.base = os.fspath(_remote.local_path(out))
        os.makedirs(self.base, exist_ok=True)
        self.tmpdir = self.base
        k = 0
        while (os.path.exists(os.path.join(self.base, _shard_name(k)))
               and os.path.exists(tarindex.sidecar(os.path.join(self.base, _shard_name(k))))):
            k += 1
        keep = {_shard_name(j) for j in range(k)}
        keep |= {tarindex.sidecar(name) for name in keep}
        for name in os.listdir(self.base):
            ours = name.startswith("shard-") and name.endswith((".tar", ".tar.idx"))
            tmp = name.startswith(".shard-") and name.endswith(".tmp")  # a killed run's
            if (ours and name not in keep) or tmp:
                os.unlink(os.path.join(self.base, name))
        self.kept = [os.path.join(self.base, _shard_name(j)) for j in range(k)]
        if k:
            with tarfile.open(self.kept[-1]) as t:
                keys = [m.name.split(".", 1)[0] for m in t.getmembers()]
            self.next_key = int(keys[-1]) + 1 if keys else 0

    def new_tmp(self, name):
        """A new temporary file for shard ``name``: (binary file object, path).  Made by
        mkstemp (a random name, O_EXCL: a link planted at a guessable name is never
        followed), hidden (a glob for shards never picks up one being written), with
        the mode a new file gets (0666 less the umask) as it is renamed into place."""
        fd, path = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=self.tmpdir)
        try:
            os.fchmod(fd, 0o666 & ~tarindex.umask())
            return os.fdopen(fd, "wb"), path
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise

    def final(self, name):
        return f"{self.base}/{name}" if self.url else os.path.join(self.base, name)

    def publish(self, tmp, name):
        """Put the finished shard ``tmp`` in place with its index; returns where."""
        index = tarindex.scan_file(tmp)
        dest = self.final(name)
        if self.url:
            self.store.put_file(tmp, dest)
            self.store.put_bytes(index.to_json(), tarindex.sidecar(dest))
            os.unlink(tmp)
        else:
            os.replace(tmp, dest)
            tarindex.write_atomic(tarindex.sidecar(dest), index.to_json())
        return dest

    def close(self):
        if self.url:
            shutil.rmtree(self.tmpdir, ignore_errors=True)


def _open_source(source, storage_options, remote, trust_list=False):
    from echo_native.source import FileList, ImageFolder

    if not isinstance(source, (str, os.PathLike)):
        return source
    loc = _remote.local_path(os.fspath(source)) if isinstance(source, str) else source
    if _remote.is_url(str(loc)):
        return FileList(str(loc), storage_options=storage_options, remote=remote,
                        trust_list=trust_list)
    if os.path.isdir(loc):
        return ImageFolder(loc)
    if os.path.isfile(loc):
        return FileList(loc)
    raise FileNotFoundError(f"{shown(loc)}: no such folder or list file")


def write_shards(source, out_dir, *, shard_size=256 * 10**6, max_count=None, max_side=None,
                 quality=90, verify=True, strict=False, overwrite=False, progress=None,
                 report=None, storage_options=None, remote=None,
                 trust_list=False, targets=None, seekable=False, restart=None, workers=1,
                 resume=False) -> ShardList:
    """Pack ``source`` into tar shards in ``out_dir``; returns the shards' paths (or URLs).

    Parameters
    ----------
    source : source, or str / os.PathLike
        Any source (``len``, ``labels``, ``read(i)``, ``describe(i)``); a folder is
        read as an :class:`~echo_native.ImageFolder`, a file (or a URL) as a
        :class:`~echo_native.FileList`.
    out_dir : str or os.PathLike
        A local folder (created) or an fsspec URL (``s3://bucket/train``).  One that
        already holds ``shard-*`` files is refused unless ``overwrite``.
    shard_size : int or str
        Largest shard in bytes (``"256MB"`` works too); a single larger sample
        gets a shard of its own.
    max_count : int, optional
        Most samples per shard.
    max_side : int, optional
        Re-encode images whose longer side is over this (aspect kept, Lanczos,
        JPEG at ``quality``); others keep their bytes exactly.
    verify : bool
        Decode each image with the pipeline's decoder first, so one that would
        fail in training is reported now (False: check the header only).
    strict : bool
        Raise :class:`ShardWriteError` at the first unreadable or corrupt input
        (default: report it, count it, leave it out).
    progress : bool, optional
        A tqdm progress bar on stderr; default: when stderr is a terminal.
    report : callable, optional
        ``report(name, message)`` for each input left out, as it happens
        (default: a RuntimeWarning); the same pairs end in the result's ``failures``.
    storage_options, remote
        For URLs (the source's or ``out_dir``), as in :class:`~echo_native.TarShards`.
    trust_list : bool
        For a list read from a URL: read its local paths and URLs of other schemes as
        given (see :class:`~echo_native.FileList`; refused by default).
    targets : bool, optional
        Write each sample's detection targets as ``<key>.json``
        (:class:`~echo_native.TarShards` reads them with ``targets=True``).  Default:
        when the source carries targets.  They are checked against the image's
        size (a sample whose targets are invalid or made for another size is left
        out like an unreadable image) and scaled with it when ``max_side``
        re-encodes it.
    seekable : bool
        Store each JPEG as a seekable one (:mod:`echo_native.seekable`): the same
        coefficients re-encoded losslessly with restart markers, the index of its
        restart segments beside the image data in the same member (APP9 segments after
        SOI, which every decoder skips).  :class:`~echo_native.TarShards` reads such
        shards with no other change, and crops decode only their own blocks.  An image
        that cannot be transcoded losslessly (CMYK, not a JPEG) is stored as it is and
        counted in the result's ``not_seekable``.
    restart : int, optional
        The restart interval in MCUs for ``seekable`` (default: segments 128 pixels
        wide, ``seekable.DEFAULT``; ``seekable.ROW``: one per MCU row).
    workers : int
        Threads preparing samples (read, verify, re-encode, transcode: the decoder and
        the transcoder release the GIL); shards are written in order whatever the count.
    resume : bool
        Keep the complete shards (those with their ``.idx``) an interrupted run left in
        a local ``out_dir`` and go on from the sample after the last one they hold; with
        the same arguments the result is the shards one uninterrupted run writes.
    """
    from echo_native.decode import decode, image_size

    shard_size = parse_size(shard_size)
    if shard_size <= 0:
        raise ValueError(f"shard_size must be positive, got {shard_size}")
    if max_count is not None and (not isinstance(max_count, int) or max_count < 1):
        raise ValueError(f"max_count must be a positive integer, got {max_count!r}")
    if max_side is not None and (not isinstance(max_side, int) or max_side < 1):
        raise ValueError(f"max_side must be a positive integer, got {max_side!r}")
    if not isinstance(quality, int) or not 1 <= quality <= 100:
        raise ValueError(f"quality must be an integer in 1..100, got {quality!r}")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    if seekable:
        from echo_native import seekable as _seekable
        _seekable.check_restart(restart)
    src = _open_source(source, storage_options, remote, trust_list)
    read_targets = source_targets(src)
    if targets is None:
        targets = read_targets is not None
    elif targets and read_targets is None:
        raise ValueError(f"write_shards(targets=True): the source {shown(src)[:120]} carries "
                         f"no targets (no targets(i), or has_targets is False)")
    n = len(src)
    width = max(6, len(str(max(n - 1, 0))))
    out = _Output(out_dir, storage_options, remote, overwrite, resume)
    result = ShardList(out.kept)
    first = out.next_key
    bar = _progress_bar(n - first, progress)
    tar = tmp = fobj = None
    count = size = 0

    def prepare(i):
        """(i, name, (data, ext, meta, reencoded, not seekable because), error): all of
        a sample's work but the writing, in any thread."""
        name = src.describe(i)
        try:
            return i, name, prepare_one(i, name), None
        except (Exception, MemoryError) as e:  # noqa: BLE001 - any bad input is reported
            return i, name, None, e

    def prepare_one(i, name):
        data = src.read(i)
        if verify:
            h, w = decode(data).shape[:2]
        else:
            h, w = image_size(data)
        ext = _image_ext(data, name)
        meta = as_targets(read_targets(i), shown(name), (h, w)) if targets else None
        if max_side is not None and max(h, w) > max_side:
            data, (h2, w2) = _reencode(data, max_side, quality)
            ext = ".jpg"
            if meta is not None:
                scale = np.asarray([w2 / w, h2 / h] * 2)
                meta = as_targets({"boxes": meta.boxes * scale, "labels": meta.labels,
                                   "iscrowd": meta.iscrowd}, shown(name), (h2, w2))
        if meta is not None:
            meta = targets_to_json(meta)
        why = None
        if seekable and ext == ".jpg":
            data, why = _seekable.make_seekable(data, restart)
        return data, ext, meta, max_side is not None and max(h, w) > max_side, why

    try:
        for i, name, done, e in _in_order(prepare, range(first, n), workers):
            if e is None:
                data, ext, meta, reencoded, why = done
                result.reencoded += reencoded
                if why is not None:
                    result.not_seekable.append((name, why))
            else:
                message = " ".join(str(e).split()) or type(e).__name__
                if strict:
                    raise ShardWriteError(f"{shown(name)}: {message}") from e
                result.failures.append((name, message))
                if report is not None:
                    report(name, message)
                else:
                    warnings.warn(f"skipped {shown(name)}: {message}", RuntimeWarning,
                                  stacklevel=2)
                if bar is not None:
                    bar.update(1)
                continue
            label = f"{int(src.labels[i])}".encode()
            need = _tar_bytes(len(data)) + _tar_bytes(len(label))
            if meta is not None:
                need += _tar_bytes(len(meta))
            if tar is not None and (_closed_size(size + need) > shard_size
                                    or (max_count is not None and count >= max_count)):
                tar.close()
                fobj.close()
                tar = fobj = None
                result.append(out.publish(tmp, _shard_name(len(result))))
            if tar is None:
                fobj, tmp = out.new_tmp(_shard_name(len(result)))
                tar = tarfile.open(fileobj=fobj, mode="w", format=tarfile.USTAR_FORMAT)
                count = size = 0
            key = f"{i:0{width}d}"
            tar.addfile(_member(key + ext, len(data)), io.BytesIO(data))
            if meta is not None:
                tar.addfile(_member(key + ".json", len(meta)), io.BytesIO(meta))
            tar.addfile(_member(key + ".cls", len(label)), io.BytesIO(label))
            count += 1
            size += need
            result.samples += 1
            if bar is not None:
                bar.update(1)
        if tar is not None:
            tar.close()
            fobj.close()
            tar = fobj = None
            result.append(out.publish(tmp, _shard_name(len(result))))
    except BaseException:
        # Interrupted or failed: the shard being written never reaches its final name.
        for f in (tar, fobj):
            if f is not None:
                try:
                    f.close()
                except Exception:  # noqa: BLE001
                    pass
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise
    finally:
        if bar is not None:
            bar.close()
        out.close()
    return result


def _shard_name(k):
    return f"shard-{k:06d}.tar"


def shard_files(folder) -> list:
    """The ``shard-*.tar`` files of a local folder, in order (empty when it has none): a
    folder of shards given where a source is expected is read as
    :class:`~echo_native.TarShards` (make-shards re-packs it, e.g. ``--seekable``)."""
    folder = os.fspath(folder)
    return sorted(os.path.join(folder, n) for n in os.listdir(folder)
                  if n.startswith("shard-") and n.endswith(".tar"))


def _in_order(fn, items, workers):
    """fn over items, results in order; with workers > 1 on that many threads, a few
    items ahead (bounded: a slow item never lets the others pile up in memory)."""
    if workers <= 1:
        for x in items:
            yield fn(x)
        return
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers, thread_name_prefix="make-shards") as pool:
        pending = deque()
        it = iter(items)
        try:
            for x in it:
                pending.append(pool.submit(fn, x))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()


def _progress_bar(total, progress):
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="img", desc="make-shards", file=sys.stderr)

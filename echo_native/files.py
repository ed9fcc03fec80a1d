"""Local files, read safely: what every built-in source that reads a folder uses.

- :func:`read_file` (:func:`open_file` + :func:`read_open`): the bytes of a regular
  file, bounded by ``max_file_bytes``; a FIFO, a device or a file that grows while
  read is a :class:`~echo_native.errors.ReadLimitError`, never a hang or a huge read;
- :class:`_PackedPaths`: millions of relative paths in one blob, cheap to pickle to
  the workers;
- :func:`_walk_once`: a folder's walk that enters each real directory once, however
  many links lead to it.
"""
from __future__ import annotations

import errno
import os
import stat

import numpy as np

from echo_native.errors import ReadLimitError

#: Largest file a built-in source reads (``max_file_bytes``): ImageNet's largest
#: training JPEG is about 15 MB; a bigger "image" is a mistake or an attack, and
#: reading it would take that much memory in a worker.
DEFAULT_MAX_FILE_BYTES = 64 * 2**20


def _check_max_file_bytes(owner, value):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{owner}: max_file_bytes must be a positive integer, got {value!r}")
    return int(value)


def read_file(path, max_file_bytes=DEFAULT_MAX_FILE_BYTES) -> bytes:
    """The bytes of a regular file of at most ``max_file_bytes``.

    Opened without blocking and checked before reading: a FIFO, a device or a
    socket named ``x.jpg`` would hang or stream forever, and a huge (or sparse)
    file would take its size in memory.  Raises :class:`ReadLimitError` (an
    ``OSError``) for those, ``OSError`` for the rest.
    """
    fd = open_file(path)
    try:
        return read_open(fd, max_file_bytes)
    finally:
        os.close(fd)


def open_file(path):
    """``path`` opened for :func:`read_open`: read-only, without blocking (a FIFO must not
    hang the open), not inherited by child processes."""
    return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)


def read_open(fd, max_file_bytes=DEFAULT_MAX_FILE_BYTES) -> bytes:
    """The bytes of the open file ``fd`` (from :func:`open_file`), refused as
    :func:`read_file` refuses; ``fd`` stays open."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ReadLimitError(errno.EINVAL, f"not a regular file ({_file_kind(st.st_mode)})")
    if st.st_size > max_file_bytes:
        raise ReadLimitError(errno.EFBIG, f"{st.st_size} bytes, over the limit "
                                          f"max_file_bytes={max_file_bytes}")
    # The file may grow between fstat and read: never take more than the limit.
    chunks, left = [], max_file_bytes + 1
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    if left <= 0:
        raise ReadLimitError(errno.EFBIG, f"grew past the limit "
                                          f"max_file_bytes={max_file_bytes} while read")
    return b"".join(chunks)


def _file_kind(mode):
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a plain file"


class _PackedPaths:
    """Many relative paths in one UTF-8 blob plus an offsets array."""

    def __init__(self, paths):
        encoded = [os.fsencode(p) for p in paths]
        self.offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=self.offsets[1:])
        self.blob = b"".join(encoded)

    def __len__(self):
        return len(self.offsets) - 1

    def __getitem__(self, i):
        return os.fsdecode(self.blob[self.offsets[i]:self.offsets[i + 1]])


def _dir_id(path):
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _walk_once(top, seen, skipped):
    """``os.walk(top, followlinks=True)`` that enters each real directory (device,
    inode) at most once: a second name for a folder already walked, or marked in
    ``seen`` (the root), is skipped and recorded in ``skipped``.  That covers a link
    back up the tree (``a/loop -> ..``, which would list files forever) and links
    that fan out to the same folder without a loop (two links per level, 17
    levels deep, list one file 131,072 times).  Sub-folders are visited in sorted
    order, so which name of a folder is kept does not depend on the file system's
    listing order.  Otherwise the same directories as ``os.walk``, so the listing
    matches torchvision's wherever no real folder is reached twice."""
    seen.add(_dir_id(top))
    for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
        dirnames.sort()
        keep = []
        for name in dirnames:
            child = os.path.join(dirpath, name)
            try:
                cid = _dir_id(child)
            except OSError:  # a dangling link, as os.walk would skip it
                continue
            if cid in seen:
                skipped.append(child)
                continue
            seen.add(cid)
            keep.append(name)
        dirnames[:] = keep
        yield dirpath, dirnames, filenames

"""Where each sample lives inside a tar shard: the index and its ``.idx`` sidecar.

An index lists, for every image member of a WebDataset-style shard, its key,
the byte offset and size of its data, and its label (the integer in
``<key>.cls``, or -1).  :class:`~echo_native.source.TarShards` reads members by
byte range from it, so a remote shard is never downloaded whole for training.

The sidecar ``<shard>.idx`` is JSON (small: about 40 bytes per sample)::

    {"format": "echo_native.tar-index", "version": 1, "shard_bytes": 268437504,
     "members": [["000000", 1536, 110412, 7], ["000001", 113152, 98211, 0], ...]}

``members`` are sorted by key; ``shard_bytes`` is the size of the shard the
index was made from, so an index left over from another shard of the same name
is noticed and not used.  ``echo-native make-shards`` writes one beside every
shard; without one, the shard's headers are scanned (data skipped) once.
"""
from __future__ import annotations

import json
import os
import tarfile

FORMAT = "echo_native.tar-index"
VERSION = 1

#: Member extensions taken as the sample's image (any case).  Decoding goes by
#: content, not by this name.
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".ppm", ".pgm", ".tif", ".tiff")

#: A label member larger than this is not a label (a 64-bit integer is at most 20 characters).
_MAX_CLS_BYTES = 256


class TarIndex:
    """The image members of one shard: parallel lists ``keys``, ``offsets``, ``sizes``,
    ``labels`` (sorted by key), and the shard's size in bytes."""

    def __init__(self, keys, offsets, sizes, labels, shard_bytes):
        self.keys, self.offsets, self.sizes, self.labels = keys, offsets, sizes, labels
        self.shard_bytes = int(shard_bytes)

    def __len__(self):
        return len(self.keys)

    def to_json(self) -> bytes:
        members = [[k, int(o), int(s), int(lab)]
                   for k, o, s, lab in zip(self.keys, self.offsets, self.sizes, self.labels)]
        # ensure_ascii: a member name that was not UTF-8 (kept as surrogate escapes)
        # round-trips as \\udcXX escapes.
        return json.dumps({"format": FORMAT, "version": VERSION,
                           "shard_bytes": self.shard_bytes, "members": members},
                          ensure_ascii=True, separators=(",", ":")).encode("ascii")

    @classmethod
    def from_json(cls, data, shard_bytes=None):
        """Parse a sidecar; ValueError when it is not one, or not for a shard of
        ``shard_bytes`` bytes."""
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"not an index ({e})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError("not an echo_native tar index")
        if doc.get("version") != VERSION:
            raise ValueError(f"index version {doc.get('version')!r}, this reader knows "
                             f"{VERSION}")
        size = doc.get("shard_bytes")
        if not isinstance(size, int) or size < 0:
            raise ValueError("index without a valid shard_bytes")
        if shard_bytes is not None and size != shard_bytes:
            raise ValueError(f"index made for a shard of {size} bytes, the shard has "
                             f"{shard_bytes}")
        keys, offsets, sizes, labels = [], [], [], []
        members = doc.get("members")
        if not isinstance(members, list):
            raise ValueError("index without members")
        for m in members:
            if (not isinstance(m, list) or len(m) != 4 or not isinstance(m[0], str)
                    or not all(isinstance(v, int) and not isinstance(v, bool) for v in m[1:])):
                raise ValueError(f"bad index entry {str(m)[:80]}")
            k, off, n, lab = m
            if off < 0 or n < 0 or off + n > size or not -2**63 <= lab < 2**63:
                raise ValueError(f"index entry {k!r} out of range")
            keys.append(k)
            offsets.append(off)
            sizes.append(n)
            labels.append(lab)
        if keys != sorted(keys):
            raise ValueError("index members not sorted by key")
        return cls(keys, offsets, sizes, labels, size)


def scan(fileobj, name, shard_bytes) -> TarIndex:
    """Index a tar read from ``fileobj`` by walking its member headers.

    Image data is skipped (seeked over); ``.cls`` members are read (a few
    bytes each).  ``name`` is used in error messages.  A sample key holding
    several image members keeps the last one; a sample without ``.cls`` gets
    label -1; a ``.cls`` that is not a 64-bit integer is a ValueError naming it.
    """
    images, classes = {}, {}
    try:
        with tarfile.open(fileobj=fileobj, mode="r:") as tar:
            for m in tar:
                if not m.isfile():
                    continue
                key, _, ext = m.name.rpartition(".")
                ext = "." + ext.lower()
                if ext in IMAGE_EXTS:
                    images[key] = (m.offset_data, m.size)
                elif ext == ".cls":
                    if m.size > _MAX_CLS_BYTES:
                        classes[key] = b"<%d bytes>" % m.size
                    else:
                        classes[key] = tar.extractfile(m).read()
    except tarfile.TarError as e:
        raise ValueError(f"tar shard {name!r} is not a readable tar file: {e}") from None
    keys = sorted(images)
    labels = []
    for key in keys:
        label = -1
        if key in classes:
            text = classes[key].strip()
            try:
                label = int(text)
                if not -2**63 <= label < 2**63:
                    raise ValueError
            except ValueError:
                raise ValueError(f"{name}: {key}.cls holds {text[:20]!r}, not a 64-bit "
                                 f"integer label") from None
        labels.append(label)
    return TarIndex(keys, [images[k][0] for k in keys], [images[k][1] for k in keys],
                    labels, shard_bytes)


def scan_file(path) -> TarIndex:
    """:func:`scan` of a local shard."""
    with open(path, "rb") as f:
        return scan(f, str(path), os.fstat(f.fileno()).st_size)


def sidecar(shard: str) -> str:
    """The sidecar's name for ``shard`` (a path or a URL without a query string)."""
    return f"{shard}.idx"


def write_atomic(path, data: bytes):
    """Write ``data`` to ``path`` through a temporary name: never a partial file."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise

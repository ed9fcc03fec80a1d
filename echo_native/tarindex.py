"""Where each sample lives inside a tar shard: the index and its ``.idx`` sidecar.

An index lists, for every image member of a WebDataset-style shard, its key,
the byte offset and size of its data, and its label (the integer in
``<key>.cls``, or -1).  :class:`~echo_native.tarshards.TarShards` reads members by
byte range from it, so a remote shard is never downloaded whole for training.

The sidecar ``<shard>.idx`` is JSON (small: about 40 bytes per sample)::

    {"format": "echo_native.tar-index", "version": 1, "shard_bytes": 268437504,
     "members": [["000000", 1536, 110412, 7], ["000001", 113152, 98211, 0], ...]}

A sample with a ``<key>.json`` member (its detection targets,
:mod:`echo_native.targets`) has two more numbers in its entry: that member's
offset and size (``["000000", 1536, 110412, 7, 112128, 96]``); an index of a
shard without such members is exactly as above.

``members`` are sorted by key; ``shard_bytes`` is the size of the shard the
index was made from, so an index left over from another shard of the same name
is noticed and not used.  ``echo-native make-shards`` writes one beside every
shard; without one, the shard's headers are scanned (data skipped) once.  An
index of a damaged shard also holds ``"damage": [offset, message]``.

A sidecar is data from wherever the shard came from, so it is checked against
its shard before it is used (:meth:`TarIndex.from_json`): it is read only up to
:func:`max_index_bytes` of the shard's size, parsed without recursion limits
being reachable as a crash, and every entry must describe a member that can be
in that shard (data inside it, after a header, on a 512-byte boundary, no two
overlapping, no more entries than the shard has room for).  A sidecar that
fails any of this is not used: the caller scans the shard instead and says why.

A shard that is cut short or damaged (a partial download or upload) keeps every
member that is complete before the damage; :attr:`TarIndex.damage` says where it
is and what was found there, for the caller to report once.
"""
from __future__ import annotations

import json
import os
import tarfile
import tempfile

from echo_native._checks import IMAGE_EXTENSIONS

FORMAT = "echo_native.tar-index"
VERSION = 1

#: Member extensions taken as the sample's image (any case).  Decoding goes by
#: content, not by this name.
IMAGE_EXTS = IMAGE_EXTENSIONS  # what a member may be to count as a sample's image

#: A label member larger than this is not a label (a 64-bit integer is at most 20 characters).
_MAX_CLS_BYTES = 256

_BLOCK = tarfile.BLOCKSIZE


def max_index_bytes(shard_bytes) -> int:
    """The largest sidecar read for a shard of ``shard_bytes`` bytes: 1 MiB plus a
    quarter of the shard.  An entry is about 40 bytes per image member (key,
    offset, size, label) and every member takes at least a 512-byte header and its
    data in the shard, so a real index is a small fraction of its shard; one
    larger than this is not read (the shard is scanned instead)."""
    return 2**20 + int(shard_bytes) // 4


def read_limited(path, limit) -> bytes:
    """A local file's bytes, ValueError when it holds more than ``limit`` (never
    more than ``limit`` + 1 bytes read)."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"index file over {limit:,} bytes, more than any index of this "
                         f"shard can be")
    return data


class TarIndex:
    """The image members of one shard: parallel lists ``keys``, ``offsets``, ``sizes``,
    ``labels`` (sorted by key), and the shard's size in bytes.  ``damage`` is None, or
    ``(offset, message)`` for a shard found cut short or damaged there (the index
    then holds the samples complete before it).  ``json_offsets`` / ``json_sizes``:
    where each sample's ``<key>.json`` member lies (-1 / 0 for a sample without one),
    or None when no sample of the shard has one."""

    def __init__(self, keys, offsets, sizes, labels, shard_bytes, damage=None,
                 json_offsets=None, json_sizes=None):
        self.keys, self.offsets, self.sizes, self.labels = keys, offsets, sizes, labels
        self.shard_bytes = int(shard_bytes)
        self.damage = damage
        if json_offsets is not None and all(o < 0 for o in json_offsets):
            json_offsets = json_sizes = None
        self.json_offsets, self.json_sizes = json_offsets, json_sizes

    def __len__(self):
        return len(self.keys)

    def to_json(self) -> bytes:
        members = [[k, int(o), int(s), int(lab)]
                   for k, o, s, lab in zip(self.keys, self.offsets, self.sizes, self.labels)]
        if self.json_offsets is not None:
            for m, jo, js in zip(members, self.json_offsets, self.json_sizes):
                if jo >= 0:
                    m += [int(jo), int(js)]
        # ensure_ascii: a member name that was not UTF-8 (kept as surrogate escapes)
        # round-trips as \\udcXX escapes.
        doc = {"format": FORMAT, "version": VERSION, "shard_bytes": self.shard_bytes,
               "members": members}
        if self.damage is not None:
            doc["damage"] = [int(self.damage[0]), str(self.damage[1])]
        return json.dumps(doc, ensure_ascii=True, separators=(",", ":")).encode("ascii")

    @classmethod
    def from_json(cls, data, shard_bytes=None):
        """Parse a sidecar; ValueError when it is not one, not for a shard of
        ``shard_bytes`` bytes, or describes members that shard cannot hold."""
        if shard_bytes is not None and len(data) > max_index_bytes(shard_bytes):
            raise ValueError(f"index of {len(data):,} bytes, more than any index of a shard "
                             f"of {shard_bytes:,} bytes can be")
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"not an index ({e})") from None
        except RecursionError:  # "[[[[...": nested past the parser's stack
            raise ValueError("not an index (nested too deeply)") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError("not an echo_native tar index")
        if doc.get("version") != VERSION:
            raise ValueError(f"index version {str(doc.get('version'))[:20]!r}, this reader "
                             f"knows {VERSION}")
        size = doc.get("shard_bytes")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError("index without a valid shard_bytes")
        if shard_bytes is not None and size != shard_bytes:
            raise ValueError(f"index made for a shard of {size} bytes, the shard has "
                             f"{shard_bytes}")
        members = doc.get("members")
        if not isinstance(members, list):
            raise ValueError("index without members")
        # Every member takes at least a header block in the shard.
        if len(members) > size // _BLOCK:
            raise ValueError(f"index lists {len(members):,} members, a shard of {size:,} "
                             f"bytes holds at most {size // _BLOCK:,}")
        keys, offsets, sizes, labels, json_offsets, json_sizes = [], [], [], [], [], []
        for m in members:
            if (not isinstance(m, list) or len(m) not in (4, 6) or not isinstance(m[0], str)
                    or not all(isinstance(v, int) and not isinstance(v, bool) for v in m[1:])):
                raise ValueError(f"bad index entry {str(m)[:80]}")
            k, off, n, lab = m[:4]
            jo, jn = m[4:] or (-1, 0)
            if not _in_shard(off, n, size) or not -2**63 <= lab < 2**63 \
                    or (jo >= 0 and not _in_shard(jo, jn, size)) or jo < -1:
                raise ValueError(f"index entry {k[:80]!r} out of range (offset {off}, size "
                                 f"{n}, shard of {size} bytes)")
            keys.append(k)
            offsets.append(off)
            sizes.append(n)
            labels.append(lab)
            json_offsets.append(jo)
            json_sizes.append(jn)
        if any(a >= b for a, b in zip(keys, keys[1:])):
            raise ValueError("index members not sorted by key, or a key listed twice")
        # No two members' data overlap, and a header fits between one and the next.
        spans = sorted(list(zip(offsets, sizes))
                       + [(o, n) for o, n in zip(json_offsets, json_sizes) if o >= 0])
        for (o1, n1), (o2, _) in zip(spans, spans[1:]):
            if o2 < o1 + -(-n1 // _BLOCK) * _BLOCK + _BLOCK:
                raise ValueError(f"index entries at offsets {o1} and {o2} overlap")
        damage = doc.get("damage")
        if damage is not None:
            if (not isinstance(damage, list) or len(damage) != 2
                    or not isinstance(damage[0], int) or not 0 <= damage[0] <= size
                    or not isinstance(damage[1], str)):
                raise ValueError("index with a malformed damage record")
            damage = (damage[0], damage[1][:300])
        return cls(keys, offsets, sizes, labels, size, damage, json_offsets, json_sizes)


def _in_shard(offset, size, shard_bytes):
    """Whether a member's data can lie there: after a header, on a block boundary,
    inside the shard."""
    return offset >= _BLOCK and not offset % _BLOCK and size >= 0 \
        and offset + size <= shard_bytes


def scan(fileobj, name, shard_bytes) -> TarIndex:
    """Index a tar read from ``fileobj`` (seekable) by walking its member headers.

    Image data is skipped (seeked over); ``.cls`` members are read (a few
    bytes each); a ``.json`` member's place is kept (its targets, read with the
    sample).  ``name`` is used in error messages.  A sample key holding
    several image members keeps the last one; a sample without ``.cls`` gets
    label -1; a ``.cls`` that is not a 64-bit integer is a ValueError naming it.

    A shard cut short or damaged (a header cut or invalid, data running past the
    end, no end-of-archive blocks) keeps the samples complete before the damage:
    the result's ``damage`` says where and what.  The sample being read when the
    damage came is left out even if its image is whole, as its label may be what
    was lost.  A file that is not a tar at all is a ValueError.
    """
    images, classes, jsons = {}, {}, {}
    damage, last = None, None
    try:
        tar = tarfile.open(fileobj=fileobj, mode="r:")
    except tarfile.TarError as e:
        raise ValueError(f"tar shard {name!r} is not a readable tar file: {e}") from None
    with tar:
        while True:
            try:
                m = tar.next()
            except tarfile.TarError as e:
                damage = (tar.offset, f"unreadable member header ({e})")
                break
            if m is None:
                damage = _end_damage(fileobj, tar.offset, shard_bytes)
                break
            key, _, ext = m.name.rpartition(".")
            last = key
            end = m.offset_data + (m.size if m.isreg() else 0)
            if end > shard_bytes:
                damage = (m.offset, f"member {m.name[:100]!r} runs to byte {end}, past the "
                                    f"end of the shard ({shard_bytes} bytes)")
                break
            if not m.isfile() or not key or key.endswith("/"):
                continue  # a folder, a link, or a name with no key before its extension
            ext = "." + ext.lower()
            if ext in IMAGE_EXTS:
                images[key] = (m.offset_data, m.size)
            elif ext == ".json":
                jsons[key] = (m.offset_data, m.size)
            elif ext == ".cls":
                if m.size > _MAX_CLS_BYTES:
                    classes[key] = b"<%d bytes>" % m.size
                else:
                    classes[key] = tar.extractfile(m).read()
    if damage is not None and last in images and last not in classes:
        del images[last]  # its label may be what was cut off
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
                    labels, shard_bytes, damage,
                    [jsons.get(k, (-1, 0))[0] for k in keys],
                    [jsons.get(k, (-1, 0))[1] for k in keys])


def _end_damage(fileobj, offset, shard_bytes):
    """Why tarfile stopped at ``offset``: None at the end-of-archive blocks, else
    ``(offset, what is there)``."""
    fileobj.seek(offset)
    block = fileobj.read(_BLOCK)
    if len(block) == _BLOCK and not block.strip(b"\0"):
        # The end of an archive is zeros to the end; a zeroed header with members after
        # it (a file written out of order, a hole in a copy) is damage, not the end.
        rest = fileobj.read(16 * _BLOCK)
        while rest:
            if rest.strip(b"\0"):
                return (offset, "a zero block where a member header belongs, with data "
                                "after it")
            rest = fileobj.read(16 * _BLOCK)
        return None
    if not block:
        return (offset, "the shard ends without its end-of-archive blocks (cut at a "
                        "member boundary?)")
    if len(block) < _BLOCK:
        return (offset, f"the shard ends inside a member header ({len(block)} of "
                        f"{_BLOCK} bytes, shard of {shard_bytes} bytes)")
    return (offset, "an invalid member header (bad checksum or not a tar header)")


def scan_file(path) -> TarIndex:
    """:func:`scan` of a local shard."""
    with open(path, "rb") as f:
        return scan(f, str(path), os.fstat(f.fileno()).st_size)


def sidecar(shard: str) -> str:
    """The sidecar's name for ``shard`` (a path or a URL without a query string)."""
    return f"{shard}.idx"


def write_atomic(path, data: bytes):
    """Write ``data`` to ``path`` through a temporary file: never a partial file.

    The temporary file is made by ``mkstemp`` in the same folder (a new name,
    ``O_EXCL``: a link planted there by another user is never followed), then
    renamed over ``path`` (which replaces a link at ``path`` rather than writing
    through it).  It gets the mode a new file would (0666 less the umask)."""
    path = os.fspath(path)
    folder, base = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=folder or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~umask())
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def umask() -> int:
    """This process's umask, read without changing it where /proc says it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)  # no /proc: the only way to read it is to set it
    os.umask(old)
    return old

"""Thin bindings over src/ring/en_ring.c: a shared-memory segment (a memfd, or
a POSIX shared-memory object) that exports the buffer protocol, the atomic
words of the slot protocol addressed by byte offset inside it, and the
segment layout as C defines it (en_ring.h), so
that echo_native.ring restates no offset of its own.  This module guarantees
that offsets are in bounds and aligned, and that waits release the GIL.
"""
import os

from libc.stdint cimport uint8_t, uint32_t, uint64_t, UINT32_MAX, UINT64_MAX
from libc.errno cimport errno
from posix.unistd cimport close as c_close

cdef extern from "en_ring.h" nogil:
    int en_memfd_create(const char *label, size_t size, int *fd, void **addr, char *err,
                        size_t errlen)
    int en_fd_attach(int fd, void **addr, size_t *size, char *err, size_t errlen)
    const char *EN_RING_MEMFD_PREFIX
    int en_shm_create(const char *name, size_t size, void **addr, char *err, size_t errlen)
    int en_shm_attach(const char *name, void **addr, size_t *size, char *err, size_t errlen)
    int en_shm_detach(void *addr, size_t size)
    int en_shm_unlink(const char *name)
    uint64_t en_ticket_take(uint64_t *counter)
    uint64_t en_load64(const uint64_t *word)
    void en_store64(uint64_t *word, uint64_t value)
    uint32_t en_seq_load(const uint32_t *word)
    void en_seq_publish(uint32_t *word, uint32_t value)
    void en_wake(uint32_t *word)
    int en_seq_wait(const uint32_t *word, uint32_t expect, const uint32_t *closed,
                    double timeout_s)
    int EN_WAIT_OK, EN_WAIT_TIMEOUT, EN_WAIT_CLOSED

    uint64_t EN_RING_MAGIC
    unsigned EN_RING_VERSION, EN_RING_PAGE, EN_RING_HEADER_BYTES, EN_RING_MAX_WORKERS
    unsigned EN_RING_REPORT_BYTES, EN_RING_FAILURE_ALIGN, EN_RING_FAILURE_CLIPPED
    unsigned EN_RING_FAILURE_DROPPED, EN_RING_MAX_OBJECTS, EN_RING_MAX_KEYPOINTS
    uint64_t EN_RING_CLAIM_PENDING, EN_RING_NO_SAMPLE
    int EN_RING_ERR_NONE, EN_RING_ERR_WORKER, EN_RING_ERR_DECODE
    int EN_RING_OK, EN_RING_REPLACED, EN_RING_SKIPPED, EN_RING_OBJ_CROWD, EN_RING_OBJ_DROPPED
    int EN_RING_REASON_NONE, EN_RING_REASON_DECODE, EN_RING_REASON_READ, EN_RING_REASON_LIMIT
    int EN_RING_CHECK_OK, EN_RING_NOT_A_RING, EN_RING_BAD_VERSION, EN_RING_BAD_GEOMETRY

    ctypedef struct en_ring_header:
        uint32_t version
    ctypedef struct en_ring_slot:
        pass
    ctypedef struct en_ring_failure:
        pass
    ctypedef struct en_ring_record:
        pass
    ctypedef struct en_ring_layout:
        uint32_t nslots
        uint32_t batch
        uint64_t sample_bytes
        en_ring_record record
        # the columns' offsets: read through en_ring_columns (EN_RING_COLUMNS)
        size_t pixels, slot_bytes, total_bytes
    ctypedef struct en_ring_column:
        const char *name
        const char *dtype
        uint32_t rows, width
        size_t layout_field
    const en_ring_column en_ring_columns[]
    ctypedef struct en_ring_row_kind:
        const char *name
        uint32_t parent
        const char *size
        uint32_t limit
        size_t record_field
    const en_ring_row_kind en_ring_row_kinds[]
    ctypedef struct en_ring_field:
        const char *name
        size_t offset, size, width
    const en_ring_field en_ring_header_fields[]
    const en_ring_field en_ring_slot_fields[]
    const en_ring_field en_ring_failure_fields[]

    int en_ring_compute_layout(uint32_t nslots, uint32_t batch, uint64_t sample_bytes,
                               const en_ring_record *record, en_ring_layout *out)
    int en_ring_init(void *mem, size_t size, const en_ring_layout *layout,
                     uint64_t first_ticket, uint32_t owner_pid)
    int en_ring_check(const void *mem, size_t size, en_ring_layout *out)
    uint64_t *en_ring_claim(en_ring_header *header, uint64_t worker)
    uint64_t *en_ring_reading(en_ring_header *header, uint64_t worker)
    uint32_t en_ring_seq_free(uint64_t ticket)
    uint32_t en_ring_seq_filled(uint64_t ticket)

#: Segment names that begin so are memfd rings ("/memfd:<label>", as /proc shows them).
MEMFD_PREFIX = EN_RING_MEMFD_PREFIX.decode()

WAIT_OK = EN_WAIT_OK
WAIT_TIMEOUT = EN_WAIT_TIMEOUT
WAIT_CLOSED = EN_WAIT_CLOSED

MAGIC = EN_RING_MAGIC
VERSION = EN_RING_VERSION
PAGE = EN_RING_PAGE
HEADER_BYTES = EN_RING_HEADER_BYTES
MAX_WORKERS = EN_RING_MAX_WORKERS
REPORT_BYTES = EN_RING_REPORT_BYTES
CLAIM_PENDING = EN_RING_CLAIM_PENDING
NO_SAMPLE = EN_RING_NO_SAMPLE
FAILURE_ALIGN = EN_RING_FAILURE_ALIGN
FAILURE_CLIPPED = EN_RING_FAILURE_CLIPPED
FAILURE_DROPPED = EN_RING_FAILURE_DROPPED
ERR_NONE, ERR_WORKER, ERR_DECODE = EN_RING_ERR_NONE, EN_RING_ERR_WORKER, EN_RING_ERR_DECODE
STATUS_OK, STATUS_REPLACED, STATUS_SKIPPED = EN_RING_OK, EN_RING_REPLACED, EN_RING_SKIPPED
OBJ_CROWD, OBJ_DROPPED = EN_RING_OBJ_CROWD, EN_RING_OBJ_DROPPED
MAX_OBJECTS = EN_RING_MAX_OBJECTS
MAX_KEYPOINTS = EN_RING_MAX_KEYPOINTS
REASON_NONE, REASON_DECODE = EN_RING_REASON_NONE, EN_RING_REASON_DECODE
REASON_READ, REASON_LIMIT = EN_RING_REASON_READ, EN_RING_REASON_LIMIT
HEADER_STRUCT_BYTES = sizeof(en_ring_header)
SLOT_HEADER_BYTES = sizeof(en_ring_slot)
FAILURE_HEADER_BYTES = sizeof(en_ring_failure)


cdef dict _fields(const en_ring_field *f):
    out = {}
    while f.name != NULL:
        out[f.name.decode()] = (f.offset, f.size, f.width)
        f += 1
    return out


#: name -> (offset, size, element width) of each field of en_ring_header,
#: en_ring_slot and en_ring_failure (padding left out).
HEADER_FIELDS = _fields(en_ring_header_fields)
SLOT_FIELDS = _fields(en_ring_slot_fields)
FAILURE_FIELDS = _fields(en_ring_failure_fields)


cdef tuple _row_kinds():
    cdef list out = []
    cdef size_t i = 0
    names = ["sample"]
    while en_ring_row_kinds[i].name != NULL:
        k = en_ring_row_kinds[i]
        name = k.name.decode().lower()
        out.append((name, names[k.parent], k.size.decode(), int(k.limit)))
        names.append(name)
        i += 1
    return tuple(out)


#: The row kinds of a sample's record beyond its one row per sample, as C defines them
#: (EN_RING_ROW_KINDS in en_ring.h): one ``(kind, parent, size, limit)`` per kind, in
#: order: a column of ``kind`` has ``size`` rows (a name: ``max_objects``, ...) per row
#: of its ``parent`` kind, ``size`` at most ``limit``.
ROW_KINDS = _row_kinds()
_ROW_NAMES = ("sample",) + tuple(k[0] for k in ROW_KINDS)


cdef tuple _columns():
    cdef list out = []
    cdef size_t i = 0
    while en_ring_columns[i].name != NULL:
        c = en_ring_columns[i]
        out.append((c.name.decode(), c.dtype.decode(), _ROW_NAMES[c.rows], int(c.width)))
        i += 1
    return tuple(out)


#: A sample's record in a slot, as C lays it out (EN_RING_COLUMNS in en_ring.h): one
#: ``(name, dtype, rows, width)`` per column, in slot order; ``rows`` is "sample" (one
#: row per sample of the batch) or a kind of :data:`ROW_KINDS` ("object": max_objects
#: rows per sample, ...), ``width`` the elements of a row.
COLUMNS = _columns()


cdef dict _record_dict(const en_ring_record *record):
    cdef const char *base = <const char *>record
    cdef dict out = {}
    cdef Py_ssize_t i
    for i in range(len(ROW_KINDS)):
        out[ROW_KINDS[i][2]] = (<const uint32_t *>(base + en_ring_row_kinds[i].record_field))[0]
    return out


cdef dict _layout_dict(const en_ring_layout *l):
    cdef dict d = {"nslots": l.nslots, "batch": l.batch, "sample_bytes": l.sample_bytes,
                   "record": _record_dict(&l.record), "pixels": l.pixels,
                   "slot_bytes": l.slot_bytes, "total_bytes": l.total_bytes}
    cdef size_t i = 0
    cdef const char *base = <const char *>l
    while en_ring_columns[i].name != NULL:
        d[en_ring_columns[i].name.decode()] = \
            (<const size_t *>(base + en_ring_columns[i].layout_field))[0]
        i += 1
    return d


cdef en_ring_layout _compute(object nslots, object batch, object sample_bytes,
                             dict sizes) except *:
    cdef en_ring_layout l
    cdef en_ring_record record
    cdef char *base = <char *>&record
    unknown = set(sizes) - {k[2] for k in ROW_KINDS}
    if unknown:
        raise TypeError(f"unknown record sizes {sorted(unknown)}: a record has "
                        f"{[k[2] for k in ROW_KINDS]}")
    nslots, batch, sample_bytes = int(nslots), int(batch), int(sample_bytes)
    values = {k[2]: int(sizes.get(k[2], 0)) for k in ROW_KINDS}
    # Values no C field can hold are as impossible as those C refuses.
    ok = (0 <= nslots <= UINT32_MAX and 0 <= batch <= UINT32_MAX
          and 0 <= sample_bytes <= UINT64_MAX
          and all(0 <= v <= UINT32_MAX for v in values.values()))
    if ok:
        for i in range(len(ROW_KINDS)):
            (<uint32_t *>(base + en_ring_row_kinds[i].record_field))[0] = \
                values[ROW_KINDS[i][2]]
        ok = en_ring_compute_layout(nslots, batch, sample_bytes, &record, &l) == 0
    if not ok:
        said = ", ".join(f"{k} {v}" for k, v in values.items())
        raise ValueError(f"impossible ring geometry: {nslots} slots of {batch} samples of "
                         f"{sample_bytes} bytes, record sizes {said}")
    return l


def seq_free(uint64_t ticket):
    """The sequence word that frees ticket's slot for it (wraps modulo 2**32)."""
    return en_ring_seq_free(ticket)


def seq_filled(uint64_t ticket):
    """The sequence word that publishes ticket in its slot."""
    return en_ring_seq_filled(ticket)


def layout(nslots, batch, sample_bytes, **sizes):
    """Offsets (from a slot's start) of the per-sample arrays, slot_bytes and
    total_bytes, as en_ring_compute_layout places them, for a record of ``sizes`` (those
    of :data:`ROW_KINDS`, 0 where not given); ValueError for a geometry it refuses."""
    cdef en_ring_layout l = _compute(nslots, batch, sample_bytes, sizes)
    return _layout_dict(&l)


def unlink(str name):
    """Remove a shared-memory object by name; a missing one is not an error."""
    if en_shm_unlink(name.encode()) != 0:
        e = errno
        raise OSError(e, f"cannot unlink shared memory {name}: {os.strerror(e)}")


cdef class Segment:
    """A mapped shared-memory segment: a memfd (:meth:`memfd`, :meth:`from_fd`) or a
    POSIX shared-memory object (``Segment(name, size, create=True)``, or
    ``Segment(name)`` to attach by name, a memfd ring's ``/memfd:<label>`` included).

    The mapping lives as long as this object and every buffer exported from it
    (NumPy views keep it alive), so a slot view can never outlive its memory.
    Only the creator lets go of the segment, explicitly, with :meth:`unlink`:
    it removes a shared-memory object's name, or closes the memfd's descriptor
    (its memory goes with the last mapping).  Errors are ``OSError`` with the
    C library's ``errno``.
    """
    cdef void *_addr
    cdef size_t _size
    cdef int _fd
    cdef readonly str name
    cdef readonly str backing
    cdef readonly bint owner
    cdef Py_ssize_t _shape[1]
    cdef Py_ssize_t _strides[1]

    def __cinit__(self, *args, **kwargs):
        self._addr = NULL
        self._fd = -1

    def __init__(self, str name, size_t size=0, bint create=False):
        cdef char err[512]
        cdef bytes bname = name.encode()
        cdef const char *cname = bname
        cdef int rc, e = 0
        err[0] = 0
        self.name = name
        self.owner = create
        self.backing = "memfd" if name.startswith(MEMFD_PREFIX) else "shm"
        if create:
            if self.backing == "memfd":
                raise ValueError(f"{MEMFD_PREFIX}... names are memfd rings: create one with "
                                 f"Segment.memfd(label, size)")
            if size == 0:
                raise ValueError("a new segment needs a size")
            with nogil:
                rc = en_shm_create(cname, size, &self._addr, err, sizeof(err))
                e = errno
            self._size = size
        else:
            with nogil:
                rc = en_shm_attach(cname, &self._addr, &self._size, err, sizeof(err))
                e = errno
        if rc != 0:
            self._addr = NULL
            raise OSError(e, err.decode("utf-8", "replace"))

    @staticmethod
    def memfd(str label, size_t size):
        """A new memfd ring segment of ``size`` bytes, every page allocated, named
        ``/memfd:<label>``; this object holds its descriptor (:attr:`fd`)."""
        cdef char err[512]
        cdef bytes blabel = label.encode()
        cdef const char *clabel = blabel
        cdef int rc, e = 0, fd = -1
        cdef void *addr = NULL
        err[0] = 0
        with nogil:
            rc = en_memfd_create(clabel, size, &fd, &addr, err, sizeof(err))
            e = errno
        if rc != 0:
            raise OSError(e, err.decode("utf-8", "replace"))
        cdef Segment seg = Segment.__new__(Segment)
        seg._addr, seg._size, seg._fd = addr, size, fd
        seg.name, seg.backing, seg.owner = MEMFD_PREFIX + label, "memfd", True
        return seg

    @staticmethod
    def from_fd(int fd, str name):
        """Map the memory file its creator passed as descriptor ``fd``, then close ``fd``
        (also on failure): the mapping alone keeps the memory."""
        cdef char err[512]
        cdef int rc, e = 0
        cdef void *addr = NULL
        cdef size_t size = 0
        err[0] = 0
        with nogil:
            rc = en_fd_attach(fd, &addr, &size, err, sizeof(err))
            e = errno
            c_close(fd)
        if rc != 0:
            raise OSError(e, f"{name}: {err.decode('utf-8', 'replace')}")
        cdef Segment seg = Segment.__new__(Segment)
        seg._addr, seg._size = addr, size
        seg.name, seg.owner = name, False
        seg.backing = "memfd" if name.startswith(MEMFD_PREFIX) else "shm"
        return seg

    def __dealloc__(self):
        if self._addr != NULL:
            en_shm_detach(self._addr, self._size)
            self._addr = NULL
        if self._fd >= 0:
            c_close(self._fd)
            self._fd = -1

    @property
    def fd(self):
        """The memfd's descriptor while its creator holds it, else -1."""
        return self._fd

    def close_fd(self):
        if self._fd >= 0:
            c_close(self._fd)
            self._fd = -1

    def unlink(self):
        """Let go of the segment: unlink a shared-memory object's name, close a memfd's
        descriptor.  Mappings (this one included) stay valid until dropped."""
        if self.backing == "memfd":
            self.close_fd()
        else:
            unlink(self.name)

    @property
    def size(self):
        return self._size

    def __getbuffer__(self, Py_buffer *view, int flags):
        self._shape[0] = self._size
        self._strides[0] = 1
        view.buf = self._addr
        view.obj = self
        view.len = self._size
        view.readonly = 0
        view.itemsize = 1
        view.format = "B"
        view.ndim = 1
        view.shape = self._shape
        view.strides = self._strides
        view.suboffsets = NULL
        view.internal = NULL

    def __releasebuffer__(self, Py_buffer *view):
        pass

    def ring_init(self, nslots, batch, sample_bytes, uint64_t first_ticket, uint32_t owner_pid,
                  **sizes):
        """Write a new ring's header into this (fresh) segment, for a record of ``sizes``
        (see :func:`layout`); returns the layout dict."""
        cdef en_ring_layout l = _compute(nslots, batch, sample_bytes, sizes)
        if en_ring_init(self._addr, self._size, &l, first_ticket, owner_pid) != 0:
            raise ValueError(f"a {self._size}-byte segment cannot hold a "
                             f"{l.total_bytes}-byte ring")
        return _layout_dict(&l)

    def ring_check(self):
        """The layout dict of the ring in this segment; ValueError saying why it is not one."""
        cdef en_ring_layout l
        cdef int rc = en_ring_check(self._addr, self._size, &l)
        if rc == EN_RING_NOT_A_RING:
            raise ValueError("no ring header (wrong magic or too small)")
        if rc == EN_RING_BAD_VERSION:
            raise ValueError(f"ring layout version "
                             f"{(<en_ring_header *>self._addr).version}, this build reads "
                             f"version {EN_RING_VERSION}")
        if rc != EN_RING_CHECK_OK:
            raise ValueError("its geometry is impossible or larger than the segment")
        return _layout_dict(&l)

    cdef uint64_t *_claim(self, worker) except NULL:
        worker = int(worker)
        if self._size < sizeof(en_ring_header):
            raise ValueError(f"the {self._size}-byte segment has no ring header")
        # Anything that is not a uint64 maps to an index C refuses too.
        cdef uint64_t w = worker if 0 <= worker <= UINT64_MAX else UINT64_MAX
        cdef uint64_t *word = en_ring_claim(<en_ring_header *>self._addr, w)
        if word == NULL:
            raise ValueError(f"worker index {worker} is out of range: a ring has claim words "
                             f"for {EN_RING_MAX_WORKERS} workers (0 to "
                             f"{EN_RING_MAX_WORKERS - 1})")
        return word

    def claim_load(self, worker):
        """The claim word of a worker (ValueError for an index the header has no word for)."""
        return en_load64(self._claim(worker))

    def claim_store(self, worker, uint64_t value):
        en_store64(self._claim(worker), value)

    def reading_load(self, worker):
        """(sample id + 1 or 0, since in CLOCK_MONOTONIC ms) of a worker's reading words."""
        self._claim(worker)  # the same index check
        cdef uint64_t *word = en_ring_reading(<en_ring_header *>self._addr, <uint64_t>worker)
        # The id is loaded first (acquire): the start time read after it is the one
        # stored with it, or a later sample's (an age too young, never a torn zero).
        cdef uint64_t sid = en_load64(word)
        return sid, en_load64(word + EN_RING_MAX_WORKERS)

    def reading_store(self, worker, uint64_t sample_plus_one, uint64_t since_ms):
        """Set a worker's reading words; an id of 0 ("none") leaves the start time as it
        is, so a reader between the stores never pairs a live id with a cleared time."""
        self._claim(worker)
        cdef uint64_t *word = en_ring_reading(<en_ring_header *>self._addr, <uint64_t>worker)
        if sample_plus_one:
            en_store64(word + EN_RING_MAX_WORKERS, since_ms)  # the time first, the id last
        en_store64(word, sample_plus_one)

    cdef inline void *_word(self, size_t offset, size_t width) except NULL:
        if offset % width or offset + width > self._size:
            raise ValueError(f"offset {offset} is not an aligned {width}-byte word of "
                             f"the {self._size}-byte segment")
        return <uint8_t *>self._addr + offset

    def ticket_take(self, size_t offset):
        """Atomically take the next ticket from the 64-bit counter at offset."""
        return en_ticket_take(<uint64_t *>self._word(offset, 8))

    def load64(self, size_t offset):
        return en_load64(<uint64_t *>self._word(offset, 8))

    def store64(self, size_t offset, uint64_t value):
        en_store64(<uint64_t *>self._word(offset, 8), value)

    def seq_load(self, size_t offset):
        return en_seq_load(<uint32_t *>self._word(offset, 4))

    def seq_publish(self, size_t offset, uint32_t value):
        en_seq_publish(<uint32_t *>self._word(offset, 4), value)

    def wake(self, size_t offset):
        en_wake(<uint32_t *>self._word(offset, 4))

    def seq_wait(self, size_t offset, uint32_t expect, size_t closed_offset, double timeout):
        """Sleep until the word at offset equals expect; WAIT_OK, WAIT_TIMEOUT or WAIT_CLOSED."""
        cdef const uint32_t *word = <uint32_t *>self._word(offset, 4)
        cdef const uint32_t *closed = <uint32_t *>self._word(closed_offset, 4)
        cdef int rc
        with nogil:
            rc = en_seq_wait(word, expect, closed, timeout)
        return rc

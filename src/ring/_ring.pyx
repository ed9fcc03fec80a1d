"""Thin bindings over src/ring/en_ring.c: a shared-memory segment that exports
the buffer protocol, and the atomic words of the slot protocol addressed by
byte offset inside it.  Layout (which offset means what) is the business of
echo_native.ring; this module only guarantees that offsets are in bounds and
aligned, and that waits release the GIL.
"""
from cpython.buffer cimport PyBUF_WRITABLE
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.string cimport memset

cdef extern from "en_ring.h" nogil:
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

WAIT_OK = EN_WAIT_OK
WAIT_TIMEOUT = EN_WAIT_TIMEOUT
WAIT_CLOSED = EN_WAIT_CLOSED


def unlink(str name):
    """Remove a segment by name; a missing one is not an error."""
    if en_shm_unlink(name.encode()) != 0:
        raise OSError(f"cannot unlink shared memory {name}")


cdef class Segment:
    """A mapped POSIX shared-memory segment.

    The mapping lives as long as this object and every buffer exported from it
    (NumPy views keep it alive), so a slot view can never outlive its memory.
    Only the creator removes the name, explicitly, with :meth:`unlink`.
    """
    cdef void *_addr
    cdef size_t _size
    cdef readonly str name
    cdef readonly bint owner
    cdef Py_ssize_t _shape[1]
    cdef Py_ssize_t _strides[1]

    def __cinit__(self, str name, size_t size=0, bint create=False):
        cdef char err[512]
        cdef bytes bname = name.encode()
        cdef const char *cname = bname
        cdef int rc
        err[0] = 0
        self.name = name
        self.owner = create
        if create:
            if size == 0:
                raise ValueError("a new segment needs a size")
            with nogil:
                rc = en_shm_create(cname, size, &self._addr, err, sizeof(err))
            self._size = size
        else:
            with nogil:
                rc = en_shm_attach(cname, &self._addr, &self._size, err, sizeof(err))
        if rc != 0:
            self._addr = NULL
            raise OSError(err.decode("utf-8", "replace"))

    def __dealloc__(self):
        if self._addr != NULL:
            en_shm_detach(self._addr, self._size)
            self._addr = NULL

    @property
    def size(self):
        return self._size

    def unlink(self):
        unlink(self.name)

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

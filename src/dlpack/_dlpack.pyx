"""DLPack export for arrays that NumPy and CuPy cannot describe themselves.

Normalised batches can be bfloat16, a type neither NumPy nor CuPy has: the
pipeline keeps its bits in a uint16 array and hands them out through a
capsule that carries DLPack's bfloat16 type code, so ``torch.from_dlpack``
and ``jax.dlpack.from_dlpack`` see bfloat16 without a copy.  The capsule
keeps the owning array alive until the consumer calls the deleter.
"""
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid, PyCapsule_New
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc

KDL_CPU = 1
KDL_CUDA = 2
KDL_BFLOAT = 4


cdef struct DLDevice:
    int32_t device_type
    int32_t device_id

cdef struct DLDataType:
    uint8_t code
    uint8_t bits
    uint16_t lanes

cdef struct DLTensor:
    void* data
    DLDevice device
    int32_t ndim
    DLDataType dtype
    int64_t* shape
    int64_t* strides
    uint64_t byte_offset

cdef struct DLManagedTensor:
    DLTensor dl_tensor
    void* manager_ctx
    void (*deleter)(DLManagedTensor*) noexcept


cdef void _delete(DLManagedTensor* t) noexcept with gil:
    # Called by the consumer when it lets go of the memory (any thread).
    Py_DECREF(<object>t.manager_ctx)
    free(t)


cdef void _unconsumed(object capsule) noexcept:
    # A capsule nobody took still owns its tensor; a consumer renames the
    # capsule to "used_dltensor" when it takes it over.
    if PyCapsule_IsValid(capsule, b"dltensor"):
        t = <DLManagedTensor*>PyCapsule_GetPointer(capsule, b"dltensor")
        t.deleter(t)


def capsule(owner, uintptr_t data, shape, strides, int device_type, int device_id,
            int code, int bits):
    """A "dltensor" capsule over ``data`` (kept alive through ``owner``).

    ``strides`` are in elements, as DLPack counts them.
    """
    cdef int ndim = len(shape)
    if len(strides) != ndim:
        raise ValueError(f"shape {tuple(shape)} and strides {tuple(strides)} differ in length")
    # One allocation: the managed tensor, then its shape and strides.
    cdef DLManagedTensor* t = <DLManagedTensor*>malloc(
        sizeof(DLManagedTensor) + 2 * ndim * sizeof(int64_t))
    if t == NULL:
        raise MemoryError("DLPack tensor header")
    cdef int64_t* dims = <int64_t*>(t + 1)
    cdef int i
    for i in range(ndim):
        dims[i] = shape[i]
        dims[ndim + i] = strides[i]
    t.dl_tensor.data = <void*>data
    t.dl_tensor.device.device_type = device_type
    t.dl_tensor.device.device_id = device_id
    t.dl_tensor.ndim = ndim
    t.dl_tensor.dtype.code = code
    t.dl_tensor.dtype.bits = bits
    t.dl_tensor.dtype.lanes = 1
    t.dl_tensor.shape = dims
    t.dl_tensor.strides = dims + ndim
    t.dl_tensor.byte_offset = 0
    Py_INCREF(owner)
    t.manager_ctx = <void*><PyObject*>owner
    t.deleter = _delete
    try:
        return PyCapsule_New(t, b"dltensor", _unconsumed)
    except BaseException:
        _delete(t)
        raise

KDL_CPU: int
KDL_CUDA: int
KDL_BFLOAT: int

def capsule(owner: object, data: int, shape: tuple[int, ...], strides: list[int],
            device_type: int, device_id: int, code: int, bits: int) -> object: ...

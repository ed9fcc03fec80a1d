"""Device backends: where the echo buffer lives and how emissions are made.

- :mod:`~echo_native.backends.array`: every emission step written once against an
  array module (NumPy or CuPy);
- :mod:`~echo_native.backends.cpu`: host memory, the native resampler;
- :mod:`~echo_native.backends.cuda`: one GPU through CuPy (registered ring memory,
  a copy stream, events, ``kernels.cu``), imported only when asked for.

:func:`resolve` is the factory; it sits above the backends so that none of them
knows the others.
"""
from __future__ import annotations

from echo_native.backends.array import ArrayDevice
from echo_native.backends.cpu import CpuDevice

def resolve(device):
    """A backend for ``device``: "cpu", "cuda", "cuda:N", "auto", or a backend object
    (an :class:`ArrayDevice`, e.g. ``ArrayDevice(numpy)`` to run the GPU code path
    on the CPU)."""
    if isinstance(device, ArrayDevice):
        return device
    if device in (None, "cpu"):
        return CpuDevice()
    if device == "auto":
        return CpuDevice() if not cuda_available() else _cuda_device("cuda")
    if isinstance(device, str) and (device == "cuda" or device.startswith("cuda:")):
        return _cuda_device(device)
    raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {device!r}")


def cuda_available():
    try:
        import cupy
    except ImportError:
        return False
    try:
        return bool(cupy.is_available())
    except Exception:
        return False


def _cuda_device(device):
    index = 0
    if ":" in device:
        try:
            index = int(device.split(":", 1)[1])
        except ValueError:
            index = -1
        if index < 0:
            raise ValueError(f"device must be 'cuda' or 'cuda:N' with N a device number, got "
                             f"{device!r}")
    try:
        import cupy
    except ImportError:
        raise RuntimeError(f"device={device!r} needs CuPy: pip install 'echo_native[gpu]' "
                           f"(CUDA 12) or 'echo_native[gpu13]' (CUDA 13), or use "
                           f"device='cpu'") from None
    if not cuda_available():
        raise RuntimeError(f"device={device!r} but CuPy finds no usable CUDA device "
                           f"(cupy.is_available() is False); use device='cpu' or 'auto'")
    count = cupy.cuda.runtime.getDeviceCount()
    if index >= count:
        raise ValueError(f"device={device!r} but CuPy sees {count} CUDA device(s): "
                         f"use cuda:0 .. cuda:{count - 1}")
    from echo_native.backends.cuda import CudaDevice
    return CudaDevice(index)

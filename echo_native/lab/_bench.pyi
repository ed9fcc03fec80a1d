"""Type stubs for the benchmark helper (src/bench/_bench.pyx)."""
import numpy as np
import numpy.typing as npt

def roi_decode(data: bytes | memoryview | npt.NDArray[np.uint8], top: int, left: int,
               height: int, width: int, denom: int) -> int: ...

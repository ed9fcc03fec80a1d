"""Type stubs for the benchmark helper (src/bench/_bench.pyx)."""
from typing import Literal

import numpy as np
import numpy.typing as npt

MODES: dict[str, int]

def roi_decode(data: bytes | memoryview | npt.NDArray[np.uint8], top: int, left: int,
               height: int, width: int, denom: int,
               mode: Literal["rgb", "ycc", "entropy", "finish", "store"] = ...) -> int: ...

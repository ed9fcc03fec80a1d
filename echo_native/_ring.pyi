"""Type stubs for the compiled ring core (src/ring/_ring.pyx)."""

from typing import Any

# Segment names that begin so are memfd rings ("/memfd:<label>").
MEMFD_PREFIX: str

WAIT_OK: int
WAIT_TIMEOUT: int
WAIT_CLOSED: int

MAGIC: int
VERSION: int
PAGE: int
HEADER_BYTES: int
MAX_WORKERS: int
REPORT_BYTES: int
CLAIM_PENDING: int
NO_SAMPLE: int
FAILURE_ALIGN: int
FAILURE_CLIPPED: int
FAILURE_DROPPED: int
# Per-object flag bits of a slot's obj_flags, and the most objects a sample may hold.
OBJ_CROWD: int
OBJ_DROPPED: int
MAX_OBJECTS: int
MAX_KEYPOINTS: int
ERR_NONE: int
ERR_WORKER: int
ERR_DECODE: int
STATUS_OK: int
STATUS_REPLACED: int
STATUS_SKIPPED: int
REASON_NONE: int
REASON_DECODE: int
REASON_READ: int
REASON_LIMIT: int
HEADER_STRUCT_BYTES: int
SLOT_HEADER_BYTES: int
FAILURE_HEADER_BYTES: int

# A sample's record in a slot: (name, dtype, rows: "sample" or a row kind, width) per column.
COLUMNS: tuple[tuple[str, str, str, int], ...]
# The record's row kinds: (kind, parent kind, size name, limit), in order.
ROW_KINDS: tuple[tuple[str, str, str, int], ...]
# name -> (offset, size, element width) of each field of the C struct
HEADER_FIELDS: dict[str, tuple[int, int, int]]
SLOT_FIELDS: dict[str, tuple[int, int, int]]
FAILURE_FIELDS: dict[str, tuple[int, int, int]]

def unlink(name: str) -> None: ...
def seq_free(ticket: int) -> int: ...
def seq_filled(ticket: int) -> int: ...
def layout(nslots: int, batch: int, sample_bytes: int, **sizes: int) -> dict[str, Any]: ...

class Segment:
    name: str
    backing: str  # "memfd" or "shm"
    owner: bool
    def __init__(self, name: str, size: int = ..., create: bool = ...) -> None: ...
    @staticmethod
    def memfd(label: str, size: int) -> Segment: ...
    @staticmethod
    def from_fd(fd: int, name: str) -> Segment: ...
    @property
    def size(self) -> int: ...
    @property
    def fd(self) -> int: ...
    def close_fd(self) -> None: ...
    def unlink(self) -> None: ...
    def __buffer__(self, flags: int) -> memoryview: ...
    def ring_init(self, nslots: int, batch: int, sample_bytes: int, first_ticket: int,
                  owner_pid: int, **sizes: int) -> dict[str, Any]: ...
    def ring_check(self) -> dict[str, Any]: ...
    def claim_load(self, worker: int) -> int: ...
    def claim_store(self, worker: int, value: int) -> None: ...
    def reading_load(self, worker: int) -> tuple[int, int]: ...
    def reading_store(self, worker: int, sample_plus_one: int, since_ms: int) -> None: ...
    def ticket_take(self, offset: int) -> int: ...
    def load64(self, offset: int) -> int: ...
    def store64(self, offset: int, value: int) -> None: ...
    def seq_load(self, offset: int) -> int: ...
    def seq_publish(self, offset: int, value: int) -> None: ...
    def wake(self, offset: int) -> None: ...
    def seq_wait(self, offset: int, expect: int, closed_offset: int, timeout: float) -> int: ...

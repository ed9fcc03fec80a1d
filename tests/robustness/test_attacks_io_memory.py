"""A pipeline in a memory cgroup: one budget for the ring, the workers, the consumer and
the echo buffer, checked before anything is allocated.

The reported attack: in a 320 MiB cgroup a 294 MiB ring passed the 298 MiB headroom
check and the process was OOM-killed inside start() (its workers and its own memory
were never counted); with echo=2 the echo buffer was never checked at all.  The cgroup
here is a fake tree (v1 and v2 file layouts) served to the ring module's file reader,
as tests/robustness/test_shm.py does: a real limit would need root and a cgroup the
test may create, and an OOM kill to show the failure.
"""
from __future__ import annotations

import os

import pytest

import ring_helpers as rh
from echo_native import memory as rg
from echo_native.memory import CONSUMER_BYTES, WORKER_BYTES, MemoryBudget, RingMemoryError
from echo_native.ring import Layout, Ring

MiB = 2**20
SAMPLE = 224 * 224 * 3


def fake_cgroup(monkeypatch, version, limit, usage):
    """This process in a memory cgroup of ``limit`` bytes, ``usage`` used (no page cache),
    on a machine with 64 GiB available."""
    if version == "v2":
        files = {"/proc/self/cgroup": "0::/job\n",
                 "/sys/fs/cgroup/job/memory.max": str(limit),
                 "/sys/fs/cgroup/job/memory.current": str(usage),
                 "/sys/fs/cgroup/job/memory.stat": "anon 1\ninactive_file 0\n"}
    else:
        files = {"/proc/self/cgroup": "4:memory:/job\n",
                 "/sys/fs/cgroup/memory/job/memory.limit_in_bytes": str(limit),
                 "/sys/fs/cgroup/memory/job/memory.usage_in_bytes": str(usage),
                 "/sys/fs/cgroup/memory/job/memory.stat": "total_inactive_file 0\n"}
    files["/proc/meminfo"] = f"MemTotal: {128 * 2**20} kB\nMemAvailable: {64 * 2**20} kB\n"
    monkeypatch.setattr(rg, "_read", lambda path: files.get(path))
    return limit - usage


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_a_ring_that_fits_alone_but_not_with_its_workers_is_refused(monkeypatch, version):
    """320 MiB cgroup, 298 MiB free, a 294 MiB ring and two worker processes: refused at
    start with the bytes needed (ring + workers + consumer), the bytes available, where
    that figure comes from and the settings to lower; nothing is allocated."""
    headroom = fake_cgroup(monkeypatch, version, 320 * MiB, 22 * MiB)
    held = rh.ring_memory(os.getpid())
    layout = Layout(4, 512, SAMPLE)
    assert 290 * MiB < layout.total_bytes < headroom          # what the old check let pass
    assert MemoryBudget().needed(layout.total_bytes) == layout.total_bytes
    budget = MemoryBudget.for_pipeline(workers=2)
    with pytest.raises(RingMemoryError) as ei:
        Ring.create(4, 512, SAMPLE, budget=budget)
    e = ei.value
    assert e.needed == layout.total_bytes + 2 * WORKER_BYTES + CONSUMER_BYTES
    assert e.available == headroom and "memory cgroup limit" in e.limit
    msg = str(e)
    assert f"the ring needs {layout.total_bytes:,} bytes" in msg
    assert "2 worker process(es)" in msg and "lower workers" in msg
    assert f"the pipeline needs {e.needed:,} bytes" in msg and f"{headroom:,} bytes" in msg
    assert "Lower batch_size, slots" in msg and ", or workers" in msg
    assert [p[0] for p in e.parts] == ["the ring", "2 worker process(es) at 64.0 MiB each",
                                       "the consumer's margin"]
    assert rh.ring_memory(os.getpid()) == held


def test_the_echo_buffer_is_counted(monkeypatch):
    """A ring and workers that fit, plus an echo buffer that does not: refused, naming the
    echo buffer and its setting; without it the same ring is made."""
    fake_cgroup(monkeypatch, "v2", 320 * MiB, 22 * MiB)
    held = rh.ring_memory(os.getpid())
    echo = ("the echo buffer", 150 * MiB, "shuffle_buffer")
    with pytest.raises(RingMemoryError) as ei:
        Ring.create(2, 8, SAMPLE, budget=MemoryBudget.for_pipeline(2, extra=[echo]))
    msg = str(ei.value)
    assert "the echo buffer (150.0 MiB, lower shuffle_buffer)" in msg
    assert msg.rstrip(".").endswith("or workers, shuffle_buffer")
    assert rh.ring_memory(os.getpid()) == held
    ring = Ring.create(2, 8, SAMPLE, budget=MemoryBudget.for_pipeline(2))
    try:
        assert ring.layout.total_bytes < 3 * MiB
    finally:
        ring.unlink()


def test_a_named_ring_must_also_fit_dev_shm(monkeypatch):
    """The fallback's ring is checked against /dev/shm's free space as before, and the
    whole budget against memory."""
    fake_cgroup(monkeypatch, "v2", 320 * MiB, 22 * MiB)
    monkeypatch.setattr(rg.os, "statvfs",
                        lambda path: os.statvfs_result((4096, 4096, 256, 256, 256, 0, 0, 0, 0,
                                                        255)))
    with pytest.raises(RingMemoryError, match="free space in /dev/shm") as ei:
        Ring.create(2, 8, SAMPLE, backing="shm", budget=MemoryBudget.for_pipeline(1))
    assert ei.value.available == 256 * 4096


def test_budget_arguments_are_checked():
    """Nonsense in a MemoryBudget is refused by name, not counted."""
    for bad in (dict(workers=-1), dict(worker_bytes=1.5), dict(consumer_bytes=True),
                dict(extra=[("x", -1, "y")]), dict(extra=[("x", 1)])):
        with pytest.raises(ValueError, match="MemoryBudget"):
            MemoryBudget(**bad)
    with pytest.raises(TypeError, match="budget must be a MemoryBudget"):
        Ring.create(2, 1, 8, budget=4096)

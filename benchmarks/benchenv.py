"""Settings the benchmarks read from the environment (see each file's docstring), and
the CPU accounting that tells a run disturbed by other work apart."""
import os
import socket
import time

import pytest


def env_int(name, default):
    """``int($name)``, or ``default`` when unset; a clear usage error when not a number."""
    value = os.environ.get(name, "")
    try:
        return int(value) if value else default
    except ValueError:
        raise pytest.UsageError(f"{name} must be an integer, got {value!r}") from None


# ---- CPU accounting (Linux /proc) ----------------------------------------------------------
def proc_table():
    """{pid: (ppid, utime + stime, cutime + cstime) in ticks} of every process we can read."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
                table[int(entry)] = (int(rest[1]), int(rest[11]) + int(rest[12]),
                                     int(rest[13]) + int(rest[14]))
            except (OSError, IndexError, ValueError):
                pass
    return table


def descendants(table):
    """This process and its descendants, by ``table``'s parent links."""
    out, todo = set(), [os.getpid()]
    children = {}
    for pid, row in table.items():
        children.setdefault(row[0], []).append(pid)
    while todo:
        pid = todo.pop()
        if pid not in out and pid in table:
            out.add(pid)
            todo.extend(children.get(pid, ()))
    return out


def workers_cpu_seconds():
    """CPU seconds of the live descendants of this process (the pipelines' workers)."""
    table = proc_table()
    return sum(table[p][1] for p in descendants(table) if p != os.getpid()) / \
        os.sysconf("SC_CLK_TCK")


def own_cpu_seconds():
    """CPU seconds of this process and every descendant, reaped ones included."""
    table = proc_table()
    return sum(table[p][1] + table[p][2] for p in descendants(table)) / os.sysconf("SC_CLK_TCK")


def busy_cpu_seconds():
    """CPU seconds the whole machine has spent busy since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)       # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def load_mark():
    """A starting point for :func:`load_since`."""
    return time.perf_counter(), busy_cpu_seconds(), own_cpu_seconds()


def load_since(mark):
    """Wall time since ``mark`` and the CPU other processes used meanwhile (a run
    disturbed by other work says so in its results)."""
    t0, busy0, own0 = mark
    wall = time.perf_counter() - t0
    other = max(0.0, (busy_cpu_seconds() - busy0) - (own_cpu_seconds() - own0))
    return {"wall_s": wall, "other_cpu_s": other,
            "other_cores_avg": other / wall if wall else 0.0,
            "cores": len(os.sched_getaffinity(0))}


class Repeat:
    """``times`` passes of a map-style dataset as one (a torch ``DataLoader`` takes any
    object with ``len`` and indexing), so one loader iterator streams many epochs
    without restarting its workers between them."""

    def __init__(self, ds, times):
        self.ds, self.times = ds, times

    def __len__(self):
        return len(self.ds) * self.times

    def __getitem__(self, index):
        return self.ds[index % len(self.ds)]


def wait_for_port(port, proc, what, timeout=60.0):
    """Wait until ``proc`` (a server just started) accepts connections on localhost
    ``port``; a RuntimeError naming ``what`` if it exits or does not within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"{what} did not start") from None
            time.sleep(0.2)

"""Soak and leak run: many epochs of an echoing EchoRing with workers SIGKILLed now and then.

    python benchmarks/soak.py --epochs 20 --kill-every 3 --json /tmp/soak.json   # ~20-40 s
    python benchmarks/soak.py --epochs 200 --kill-every 3 --json /tmp/soak200.json  # long target

An ``EchoRing`` (echo=2, placement="before_augment", 2 process workers) runs
over a small corpus of real-photo JPEGs (``echo_native.corpus.build_corpus``,
cached in ``--cache``).  Every ``--kill-every`` epochs one worker (alternately
0 and 1) is SIGKILLed mid-epoch while it holds an unfilled batch, so the
consumer must notice, replace it and have the batch redone.

Recorded after every epoch: consumer RSS, each worker's RSS (``VmRSS`` of
``/proc/<pid>/status``; the pids change after a kill), the consumer's open
fds, this process's ring segments (memfd rings held open, named ones in
``/dev/shm``), live child processes, fresh coverage (every sample delivered
fresh exactly once in the epoch) and wall time.  After ``close()`` it checks
that no segment, no process holding the ring's memory (descriptor or
mapping), no worker process and no extra fd remains (the forkserver and resource tracker of ``multiprocessing``
are long-lived by design and not counted).

Prints a table, writes JSON (``--json``) and exits 1 when coverage fails,
restarts differ from kills, or anything leaks; with ``--rss-bound-mib`` it
also fails when RSS after warm-up grows by more than the bound.

``tests/robustness/test_soak.py`` runs a short version of :func:`run_soak` in CI.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))
import ring_helpers as rh  # noqa: E402  (/proc helpers shared with the fault tests)

MIB = 1 << 20

#: WorkerPool treats more than ``max_restarts`` (8) deaths within a minute as a crash
#: loop; the soak kills far faster than any real failure would, so it raises the cap.
DEFAULT_MAX_RESTARTS = 8


# ---- /proc readings ------------------------------------------------------------------
def rss_of(pid):
    """VmRSS of ``pid`` in bytes (None when the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def infrastructure_pids():
    """Long-lived multiprocessing helpers (forkserver, resource tracker): not leaks."""
    pids = set()
    try:
        from multiprocessing import forkserver
        pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
        if pid:
            pids.add(pid)
    except Exception:
        pass
    try:
        from multiprocessing import resource_tracker
        pid = getattr(resource_tracker._resource_tracker, "_pid", None)
        if pid:
            pids.add(pid)
    except Exception:
        pass
    return pids


def leftover_children():
    """Live descendants other than multiprocessing's long-lived helpers (and their children)."""
    infra = infrastructure_pids()
    kids = rh.descendants()
    for p in list(infra):
        kids -= rh.descendants(p)
    return sorted(kids - infra)


# ---- the run ---------------------------------------------------------------------------------
def make_ring(root, batch_size, image_size, seed, slots=None):
    import echo_native as en

    return en.EchoRing(en.ImageFolder(root), batch_size=batch_size, image_size=image_size,
                       echo=2, placement="before_augment", workers=2, worker_mode="process",
                       seed=seed, timeout=30, slots=slots)


def kill_epochs(epochs, kill_every=None, kill_at=None):
    if kill_at is not None:
        return sorted({int(e) for e in kill_at if 0 <= int(e) < epochs})
    if not kill_every:
        return []
    return [e for e in range(kill_every, epochs, kill_every)]


def run_soak(root, epochs=20, kill_every=3, kill_at=None, batch_size=16, image_size=64,
             seed=0, slots=None, log=None):
    """Run the soak; returns a dict with per-epoch ``records`` and the ``after_close`` checks.

    ``kill_at`` (a list of epochs) overrides ``kill_every``.  A kill happens
    after the 2nd batch of its epoch.
    """
    import echo_native as en

    root = Path(root)
    n = len(en.ImageFolder(root))
    kills_planned = kill_epochs(epochs, kill_every, kill_at)

    # Warm-up cycle: starts multiprocessing's forkserver (long-lived by design) so the
    # fd / child baseline below already includes it.
    warm = make_ring(root, batch_size, image_size, seed, slots)
    with warm:
        next(iter(warm))
    del warm
    gc.collect()
    fds0, segs0, kids0 = open_fds(), set(rh.segments(os.getpid())), leftover_children()

    ring = make_ring(root, batch_size, image_size, seed, slots)
    records, seen_workers, killed = [], set(), []
    t_start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        ring.start()
        max_restarts = max(DEFAULT_MAX_RESTARTS, len(kills_planned) + 1)
        ring.loader._pool.max_restarts = max_restarts
        for epoch in range(epochs):
            t0 = time.perf_counter()
            fresh_ids, delivered = [], 0
            kill_now = epoch in kills_planned
            for j, b in enumerate(ring):
                fresh_ids.append(np.asarray(b.sample_ids)[np.asarray(b.fresh, bool)].copy())
                delivered += len(b)
                seen_workers.update(ring.loader.worker_pids())
                if kill_now and j == 1:
                    w = len(killed) % 2
                    rh.wait_until_holding(ring.loader, w)
                    pid = ring.loader.worker_pids()[w]
                    os.kill(pid, signal.SIGKILL)
                    killed.append({"epoch": epoch, "worker": w, "pid": pid})
                    kill_now = False
            wall = time.perf_counter() - t0
            if kill_now:
                raise RuntimeError(f"epoch {epoch} had fewer than 2 batches; no kill happened")
            ids = np.sort(np.concatenate(fresh_ids)) if fresh_ids else np.zeros(0, np.int64)
            coverage_ok = len(ids) == n and bool(np.array_equal(ids, np.arange(n)))
            pids = ring.loader.worker_pids()
            seen_workers.update(pids)
            st = ring.stats()
            rec = {
                "epoch": epoch,
                "wall_s": round(wall, 4),
                "consumer_rss": rss_of(os.getpid()),
                "worker_pids": pids,
                "worker_rss": [rss_of(p) for p in pids],
                "fds": open_fds(),
                "segments": len(rh.segments(os.getpid())),
                "children": len(rh.descendants()),
                "fresh": int(len(ids)),
                "fresh_unique": int(len(np.unique(ids))),
                "delivered": delivered,
                "coverage_ok": coverage_ok,
                "restarts": st["worker_restarts"],
                "killed": [k["pid"] for k in killed if k["epoch"] == epoch],
            }
            records.append(rec)
            if log:
                log(rec)
        final_stats = ring.stats()
        ring_name = ring.loader.ring_name
        ring.close()
    total = time.perf_counter() - t_start
    del ring
    gc.collect()
    # Workers are joined by close(); allow a moment for the kernel to reap /proc entries.
    deadline = time.monotonic() + 5
    while any(rh.alive(p) for p in seen_workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    died_warnings = sum("died" in str(w.message) for w in caught
                        if issubclass(w.category, RuntimeWarning))
    after = {
        "segments_left": sorted(set(rh.segments(os.getpid())) - segs0),
        # pids still holding the ring's memory (a descriptor or a mapping), and a named
        # segment still in /dev/shm (the fallback): either way memory not given back.
        "ring_memory_held": sorted(rh.ring_memory(os.getpid()).get(ring_name, [])),
        "ring_segment_exists": os.path.exists(os.path.join("/dev/shm", ring_name.lstrip("/"))),
        "workers_alive": sorted(p for p in seen_workers if rh.alive(p)),
        "children_left": sorted(set(leftover_children()) - set(kids0)),
        "fds_before": fds0,
        "fds_after": open_fds(),
    }
    return {
        "config": {"root": str(root), "images": n, "epochs": epochs, "kill_epochs": kills_planned,
                   "batch_size": batch_size, "image_size": image_size, "seed": seed,
                   "echo": 2, "placement": "before_augment", "workers": 2,
                   "max_restarts": max_restarts, "cpus": len(os.sched_getaffinity(0))},
        "records": records,
        "kills": killed,
        "died_warnings": died_warnings,
        "worker_restarts": final_stats["worker_restarts"],
        "failures": final_stats["failures"],
        "total_s": round(total, 3),
        "after_close": after,
    }


# ---- checks -----------------------------------------------------------------------------------
def growth(records, key, warmup=2):
    """Largest rise of ``key`` (bytes) over the epochs from ``warmup`` on, relative to
    its value at epoch ``warmup``."""
    vals = [r[key] for r in records[warmup:] if r[key] is not None]
    return (max(vals) - vals[0]) if vals else 0


def worker_growth(records, warmup=2):
    """Largest worker RSS after warm-up minus the largest worker RSS at epoch ``warmup``
    (a replaced worker starts lower and climbs back to the same plateau)."""
    base = [v for v in records[warmup]["worker_rss"] if v is not None] if len(records) > warmup \
        else []
    later = [v for r in records[warmup:] for v in r["worker_rss"] if v is not None]
    return (max(later) - max(base)) if base and later else 0


def problems(result, rss_bound=None, warmup=2):
    """Everything that should fail the run, as readable lines (empty when all is well)."""
    out = []
    for r in result["records"]:
        if not r["coverage_ok"]:
            out.append(f"epoch {r['epoch']}: fresh coverage {r['fresh']} ids "
                       f"({r['fresh_unique']} distinct) for {result['config']['images']} samples")
    kills = len(result["kills"])
    if result["worker_restarts"] != kills:
        out.append(f"worker_restarts {result['worker_restarts']} != kills {kills}")
    a = result["after_close"]
    if a["segments_left"] or a["ring_segment_exists"]:
        out.append(f"ring segments left after close: {a['segments_left']}")
    if a.get("ring_memory_held"):
        out.append(f"the ring's memory still held after close by pids {a['ring_memory_held']}")
    if a["workers_alive"]:
        out.append(f"worker processes alive after close: {a['workers_alive']}")
    if a["children_left"]:
        out.append(f"child processes left after close: {a['children_left']}")
    if a["fds_after"] > a["fds_before"]:
        out.append(f"open fds grew from {a['fds_before']} to {a['fds_after']}")
    if rss_bound is not None and len(result["records"]) > warmup:
        g = growth(result["records"], "consumer_rss", warmup)
        if g > rss_bound:
            out.append(f"consumer RSS grew {g / MIB:.1f} MiB after warm-up (bound "
                       f"{rss_bound / MIB:.0f} MiB)")
        g = worker_growth(result["records"], warmup)
        if g > rss_bound:
            out.append(f"worker RSS grew {g / MIB:.1f} MiB after warm-up (bound "
                       f"{rss_bound / MIB:.0f} MiB)")
    return out


# ---- report ----------------------------------------------------------------------------------
HEADER = (f"{'epoch':>5} {'wall s':>7} {'cons MiB':>9} {'worker MiB':>15} {'fds':>4} "
          f"{'shm':>4} {'kids':>4} {'fresh':>6} {'cover':>5} {'rst':>3}  kill")


def row(r):
    w = "/".join("-" if v is None else f"{v / MIB:.1f}" for v in r["worker_rss"])
    return (f"{r['epoch']:>5} {r['wall_s']:>7.3f} {r['consumer_rss'] / MIB:>9.1f} {w:>15} "
            f"{r['fds']:>4} {r['segments']:>4} {r['children']:>4} {r['fresh']:>6} "
            f"{'ok' if r['coverage_ok'] else 'FAIL':>5} {r['restarts']:>3}  "
            f"{','.join(str(p) for p in r['killed'])}")


def summary(result, warmup=2):
    recs, a = result["records"], result["after_close"]
    lines = [
        f"images {result['config']['images']}, epochs {len(recs)}, kills {len(result['kills'])} "
        f"(epochs {result['config']['kill_epochs']}), worker_restarts "
        f"{result['worker_restarts']}, 'died' warnings {result['died_warnings']}, "
        f"total {result['total_s']:.1f} s",
    ]
    if len(recs) > warmup:
        lines.append(f"after warm-up (epochs {warmup}..{len(recs) - 1}): consumer RSS growth "
                     f"{growth(recs, 'consumer_rss', warmup) / MIB:.2f} MiB, worker RSS growth "
                     f"{worker_growth(recs, warmup) / MIB:.2f} MiB")
    lines.append(f"after close: segments left {len(a['segments_left'])}, workers alive "
                 f"{len(a['workers_alive'])}, children left {len(a['children_left'])}, fds "
                 f"{a['fds_before']} -> {a['fds_after']}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--kill-every", type=int, default=3,
                   help="SIGKILL a worker in every K-th epoch (0: never)")
    p.add_argument("--images", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", default=None,
                   help="corpus cache folder (default: echo_native's cache dir)")
    p.add_argument("--json", default=None, help="write the full result here")
    p.add_argument("--rss-bound-mib", type=float, default=None,
                   help="also fail when consumer or worker RSS grows more than this after "
                        "warm-up (off by default: a report, not a noisy assertion)")
    args = p.parse_args(argv)

    from echo_native.lab.corpus import build_corpus, default_cache_dir

    cache = Path(args.cache) if args.cache else Path(default_cache_dir())
    root = build_corpus(cache / f"soak-{args.images}-s{args.seed}", n_images=args.images,
                        seed=args.seed, classes=10)
    print(HEADER, flush=True)
    result = run_soak(root, epochs=args.epochs, kill_every=args.kill_every,
                      batch_size=args.batch_size, image_size=args.image_size, seed=args.seed,
                      log=lambda r: print(row(r), flush=True))
    print(summary(result))
    bound = None if args.rss_bound_mib is None else args.rss_bound_mib * MIB
    bad = problems(result, bound)
    result["problems"] = bad
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    for line in bad:
        print("FAIL:", line)
    print("PASS" if not bad else f"FAILED ({len(bad)} problems)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

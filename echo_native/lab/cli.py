"""``echo-native-lab`` command line (also ``python -m echo_native.lab``): the lab's tools.

``echo-native-lab bench [DIR]`` measures the whole pipeline on a folder (default:
an ImageNet-like corpus cut from real photographs, built once and cached):
fresh and delivered images/s for each echo setting, consumer stall, ring
occupancy and failures, with the peers side by side, each when installed: the
torch DataLoader (torchvision-style Pillow transforms), NVIDIA DALI's CPU
pipeline (``pip install nvidia-dali-cuda120``; no GPU needed), SPDL's thread
pipeline over FFmpeg (``pip install spdl==0.8.0`` and FFmpeg's libraries) and
turboloader (``pip install turboloader``; the folder packed into a TAR once,
untimed; its antialias on and off), and every row's delivered images/s as a
multiple of each peer's; a second table gives each peer's rate over echo_native
at e=1 and what it does differently (a missing one says what to install).  Each
row is measured ``--repeats`` times, round-robin across the rows, each time on a
freshly built pipeline after one untimed warm-up epoch; the table gives medians
and min-max, the ratios are paired by run, a chart is drawn and a one-line
verdict ends it.

``echo-native-lab make-dataset fashion-mnist|imagenet-like OUT`` writes a JPEG
ImageFolder; ``echo-native-lab demo`` runs the echo training demo
(:mod:`echo_native.lab.demo`); ``echo-native-lab lm-demo`` the language-model echo
demo around ``EchoLoader`` (:mod:`echo_native.lab.lm_demo`).  Errors a user can hit print one line and exit 2.

The library's own command, ``echo-native profile``, is :mod:`echo_native.cli`;
this module borrows its small helpers (the lab imports the library, never the
reverse).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

from echo_native.cli import (UsageError, check_device, command_parser, echo_list,
                             loader_options, open_folder, run)

# Demo defaults: small enough to finish in a few minutes on 2 cores.
DEMO_TARGET = 0.72
DEMO_MAX_FRESH = 30000
DEMO_EVAL_EVERY = 1500
DEMO_LR = 2e-3


# -- bench ----------------------------------------------------------------------------
# peer -> (row's "pipeline", short label in the table and chart, name in the verdict)
PEERS = {"torch": ("torch DataLoader + torchvision-style Pillow", "torch", "torch DataLoader"),
         "dali": ("NVIDIA DALI CPU pipeline (image_random_crop + resize + flip)", "DALI",
                  "DALI CPU"),
         "spdl": ("SPDL thread pipeline (FFmpeg decode + crop/scale/flip filter)", "SPDL",
                  "SPDL"),
         "turboloader": ("turboloader train_aug (TAR, float32, antialias on)", "turbo",
                         "turboloader"),
         "turboloader_noaa": ("turboloader train_aug (TAR, float32, antialias off)",
                              "turbo no-AA", "turboloader (no antialias)")}
# --peers name -> its rows (turboloader is measured with its antialias on and off)
PEER_GROUPS = {"torch": ("torch",), "dali": ("dali",), "spdl": ("spdl",),
               "turboloader": ("turboloader", "turboloader_noaa")}
# What each peer does differently from echo_native's rows (uint8 HWC, the crop's rows
# and columns decoded at a DCT scale, Pillow-exact antialiased bilinear resize).
PEER_NOTES = {
    "torch": "worker processes; Pillow decodes the whole image, resize(box) bilinear "
             "antialiased, flip; uint8 CHW",
    "dali": "threads; libjpeg-turbo decodes the crop window (image_random_crop), resize "
            "linear antialiased, flip; uint8 HWC",
    "spdl": "threads (decode concurrency = pool size); FFmpeg decodes the whole image (no "
            "ROI, no DCT scaling), per-image filter crop -> swscale bilinear -> rgb24 -> "
            "hflip; uint8 HWC",
    "turboloader": "float32 HWC in [0, 1] (4x the bytes); its own RandomResizedCrop, cut "
                   "from the whole image decoded at the DCT scale that keeps it >= the "
                   "output (small crops upscaled); antialias on; reads a TAR packed once, "
                   "untimed",
    "turboloader_noaa": "as turboloader, with plain bilinear (antialias off: aliased when "
                        "shrinking)",
}


@dataclass(frozen=True, eq=False)
class _Pipeline:
    """One row of the bench: ``session()`` is a context manager that builds and starts the
    pipeline and yields ``epoch()``, which runs one epoch through it and returns its row."""
    label: str
    session: Callable
    peer: str | None = None


def _progress(total):
    """One bar over every (pipeline, repeat) run, on stderr, off when stderr is no TTY
    (a log file or CI would get a line per refresh)."""
    from tqdm import tqdm  # a dependency of the package

    return tqdm(total=total, unit="run", leave=False, file=sys.stderr,
                disable=not sys.stderr.isatty())


def _ring_epoch(ring, args, echo, placement):
    """One epoch of a started ring, timed; its counters are read before and after, as
    ``stats()`` counts from the ring's start (the warm-up epoch included)."""
    step = args.step_ms / 1000.0
    before = ring.stats()
    t0 = time.perf_counter()
    delivered = 0
    for batch in ring:
        delivered += len(batch)
        if step:
            time.sleep(step)  # stands in for the accelerator's step
    wall = time.perf_counter() - t0
    after = ring.stats()
    fresh = after["fresh"] - before["fresh"]
    return {
        "pipeline": "echo_native", "placement": placement, "echo": echo,
        "workers": ring.loader.workers, "wall_s": wall,
        "fresh_per_s": fresh / wall, "delivered_per_s": delivered / wall,
        "effective_echo": delivered / fresh if fresh else 0.0,
        "stall_s": after["stall_s"] - before["stall_s"],
        "ring_occupancy": after["ring_occupancy"],
        "failures": sum(after["failures"].values()) - sum(before["failures"].values()),
    }


@contextmanager
def _ring_session(folder, args, echo, placement):
    import echo_native as en

    ring = en.EchoRing(folder, batch_size=args.batch_size, image_size=args.image_size,
                       echo=echo, placement=placement, workers=args.workers, seed=args.seed,
                       device=args.device)
    with ring:
        yield lambda: _ring_epoch(ring, args, echo, placement)


def _peer_epoch(peer, loader, args, workers=None, note=None):
    """One epoch of a peer's loader (batches of ``(images, labels)``), timed; ``workers``
    when the peer runs another number of threads than ``--workers``, ``note`` what it
    does differently (default :data:`PEER_NOTES`); ``failures`` are the files the loader
    counts as not decoded (``loader.failures``, when it counts them)."""
    step = args.step_ms / 1000.0
    failed = getattr(loader, "failures", 0)
    t0 = time.perf_counter()
    n = stall = 0.0
    t_wait = time.perf_counter()
    for images, _ in loader:
        stall += time.perf_counter() - t_wait
        n += len(images)
        if step:
            time.sleep(step)
        t_wait = time.perf_counter()
    wall = time.perf_counter() - t0
    return {"pipeline": PEERS[peer][0], "placement": "-", "echo": 1,
            "workers": args.workers if workers is None else workers, "wall_s": wall,
            "fresh_per_s": n / wall, "delivered_per_s": n / wall, "effective_echo": 1.0,
            "stall_s": stall, "ring_occupancy": float("nan"),
            "failures": getattr(loader, "failures", 0) - failed,
            "note": PEER_NOTES[peer] if note is None else note}


@contextmanager
def _torch_session(folder, args):
    """A DataLoader with persistent workers: the warm-up epoch starts them, so the timed
    epoch, like the ring's, runs on workers already up."""
    from echo_native.lab.peers import torch_loader

    loader = torch_loader(folder, args.batch_size, args.workers, args.image_size, args.seed)
    yield lambda: _peer_epoch("torch", loader, args)


@contextmanager
def _dali_session(folder, args):
    """DALI's CPU pipeline, ``args.workers`` threads (built here, outside the clock, as the
    ring is)."""
    from echo_native.lab.peers import dali_loader

    with dali_loader(folder, args.batch_size, args.workers, args.image_size,
                     args.seed) as loader:
        yield lambda: _peer_epoch("dali", loader, args)


@contextmanager
def _spdl_session(folder, args):
    """SPDL's pipeline, ``args.workers`` threads, started here, outside the clock."""
    from echo_native.lab.peers import spdl_loader

    with spdl_loader(folder, args.batch_size, args.workers, args.image_size,
                     args.seed) as loader:
        yield lambda: _peer_epoch("spdl", loader, args)


@contextmanager
def _turbo_session(folder, args, antialias=True):
    """turboloader over the folder packed into a TAR (once, cached: the first session
    packs it, outside the clock).  Its pool has as many threads as the machine has
    cores whatever ``--workers`` says; the row says so when they differ."""
    from echo_native.lab.peers import turbo_loader

    peer = "turboloader" if antialias else "turboloader_noaa"
    with turbo_loader(folder, args.batch_size, args.image_size, args.seed,
                      antialias=antialias) as loader:
        note = PEER_NOTES[peer]
        if loader.threads != args.workers:
            note += (f"; {loader.threads} threads (its pool is sized to the machine's "
                     f"cores), not --workers {args.workers}")
        yield lambda: _peer_epoch(peer, loader, args, workers=loader.threads, note=note)


def _peers_missing():
    """Why each peer cannot run here ({} when all can): each is imported now, before the
    clock, so a missing one is reported before any run.  The message names what to
    install."""
    from echo_native.lab import peers as lab_peers

    missing = {}
    try:
        import torch  # noqa: F401
    except ImportError:
        missing["torch"] = "torch not installed (pip install torch)"
    for peer, check in (("dali", lab_peers.import_dali), ("spdl", lab_peers.import_spdl),
                        ("turboloader", lab_peers.import_turboloader)):
        try:
            check()
        except ImportError as e:
            for row in PEER_GROUPS[peer]:
                missing[row] = str(e)
    return missing


def _pipelines(folder, args, peers):
    """The rows in table order: the peers, echo_native at e=1, then each placement's echo
    factors."""
    sessions = {"torch": _torch_session, "dali": _dali_session, "spdl": _spdl_session,
                "turboloader": _turbo_session,
                "turboloader_noaa": partial(_turbo_session, antialias=False)}
    rows = [_Pipeline(PEERS[p][1], partial(sessions[p], folder, args), p) for p in peers]
    rows.append(_Pipeline("echo_native e=1",
                          partial(_ring_session, folder, args, 1, "after_augment")))
    rows += [_Pipeline(f"{placement} e={e}", partial(_ring_session, folder, args, e, placement))
             for placement in args.placements for e in args.echo if e != 1]
    return rows


def _measure_once(pipeline):
    """A fresh pipeline's second epoch: the first, untimed, pays for the workers' start
    (~0.3 s of a 1 s epoch on 2 cores), the first reads of each file and the first fill
    of the queues.  A fresh one per run, because a pipeline left open between runs keeps
    prefetching (the ring fills its slots, DALI its queue) and would start its next timed
    epoch ahead."""
    with pipeline.session() as epoch:
        epoch()
        return epoch()


def _measure(pipelines, repeats, missing):
    """Each pipeline's rows over ``repeats`` cycles, round-robin (every pipeline once per
    cycle), so that the machine's slow spells fall on all of them alike and each cycle's
    peer can be paired with that cycle's rows.  A peer that cannot be built (DALI listing
    other files than the ImageFolder) is dropped in the first cycle, its reason put in
    ``missing``."""
    runs = {p: [] for p in pipelines}
    bar = _progress(len(pipelines) * repeats)
    try:
        for cycle in range(repeats):
            for p in [p for p in pipelines if p in runs]:
                bar.set_description(f"{p.label} ({cycle + 1}/{repeats})")
                try:
                    row = _measure_once(p)
                except (ImportError, ValueError) as e:
                    if p.peer is None or cycle:
                        raise
                    del runs[p]
                    missing[p.peer] = str(e)
                    bar.total -= repeats
                    bar.refresh()
                    bar.write(_missing_line(p.peer, e), file=sys.stderr)
                    continue
                runs[p].append(row)
                bar.update()
    finally:
        bar.close()
    return runs


def _missing_line(peer, why):
    return f"no {PEERS[peer][1]} peer in this run: {why}"


def _spread(values):
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def _summarise(runs):
    """A pipeline's row from its runs: medians, min-max of the rates, the runs themselves
    (and a peer's note)."""
    row = {k: runs[0][k] for k in ("pipeline", "placement", "echo", "workers")}
    if "note" in runs[0]:
        row["note"] = runs[0]["note"]
    for key in ("fresh", "delivered"):
        row[f"{key}_per_s"], lo, hi = _spread([r[f"{key}_per_s"] for r in runs])
        row[f"{key}_range"] = [lo, hi]
    for key in ("wall_s", "effective_echo", "stall_s", "ring_occupancy"):
        row[key] = statistics.median(r[key] for r in runs)
    row["failures"] = sum(r["failures"] for r in runs)
    row["repeats"] = len(runs)
    row["runs"] = runs
    return row


def _add_ratios(rows):
    """Each row's delivered img/s over each peer's, paired by cycle (run i over the peer's
    run i, both measured within the same few seconds): ``x_<peer>`` the median ratio,
    ``x_<peer>_range`` its min-max, ``x_<peer>_runs`` every cycle's; None for a peer that
    did not run."""
    for peer, (name, _, _) in PEERS.items():
        base = next((r for r in rows if r["pipeline"] == name), None)
        for r in rows:
            if base is None:
                r[f"x_{peer}"] = r[f"x_{peer}_range"] = r[f"x_{peer}_runs"] = None
                continue
            per = [a["delivered_per_s"] / b["delivered_per_s"]
                   for a, b in zip(r["runs"], base["runs"], strict=True)]
            r[f"x_{peer}"], lo, hi = _spread(per)
            r[f"x_{peer}_range"], r[f"x_{peer}_runs"] = [lo, hi], per
    # and over echo_native at e=1, the other way round: a peer's share of it
    base = next(r for r in rows if r["pipeline"] == "echo_native" and r["echo"] == 1)
    for r in rows:
        per = [a["delivered_per_s"] / b["delivered_per_s"]
               for a, b in zip(r["runs"], base["runs"], strict=True)]
        r["x_e1"], lo, hi = _spread(per)
        r["x_e1_range"], r["x_e1_runs"] = [lo, hi], per


def _peers_ran(rows):
    return [peer for peer in PEERS if any(r.get(f"x_{peer}") is not None for r in rows)]


def _cell(value, spread, fmt):
    """``value (lo-hi)``; the value alone after a single run, whose range is itself."""
    if spread is None or spread[0] == spread[1]:
        return format(value, fmt)
    return f"{value:{fmt}} ({spread[0]:{fmt}}-{spread[1]:{fmt}})"


def _table(rows):
    ran = _peers_ran(rows)
    ratio_cols = [f"x {PEERS[peer][1]}" for peer in ran] or ["x peer"]
    head = ("pipeline", "placement", "echo", "fresh img/s", "delivered img/s", *ratio_cols,
            "stall s", "ring occ.", "failures")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ratios = " | ".join(_cell(r[f"x_{peer}"], r[f"x_{peer}_range"], ".2f")
                            for peer in ran) or "-"
        lines.append(f"| {r['pipeline']} | {r['placement']} | {r['echo']} | "
                     f"{_cell(r['fresh_per_s'], r['fresh_range'], ',.0f')} | "
                     f"{_cell(r['delivered_per_s'], r['delivered_range'], ',.0f')} | "
                     f"{ratios} | {r['stall_s']:.2f} | {r['ring_occupancy']:.2f} | "
                     f"{r['failures']} |")
    return "\n".join(lines)


def _peer_table(rows, missing, asked):
    """Each peer asked for: its delivered img/s and its rate over echo_native at e=1
    (median and min-max of the paired runs), its threads or workers, and what it does
    differently; a peer that did not run, why ("skipped: ..." with what to install)."""
    lines = ["| peer | workers | img/s | / echo_native e=1 | note |", "|---|---:|---:|---:|---|"]
    for peer in asked:
        name, _, plain = PEERS[peer]
        r = next((r for r in rows if r["pipeline"] == name), None)
        if r is None:
            why = missing.get(peer, "not run")
            lines.append(f"| {plain} | - | - | - | skipped: {why} |")
            continue
        share = _cell(r["x_e1"], r["x_e1_range"], ".2f")       # "m" or "m (lo-hi)"
        share = share.replace(" (", "x (", 1) if " (" in share else f"{share}x"
        lines.append(f"| {plain} | {r['workers']} | "
                     f"{_cell(r['delivered_per_s'], r['delivered_range'], ',.0f')} | "
                     f"{share} | {r.get('note', PEER_NOTES[peer])} |")
    return "\n".join(lines)


def _headline_echo(rows):
    """The echo row the verdict quotes: the fastest before_augment row (the library's
    default placement and the paper's best for accuracy), else the fastest echo row;
    None when only e=1 ran."""
    echoed = [r for r in rows if r["pipeline"] == "echo_native" and r["echo"] != 1]
    preferred = [r for r in echoed if r["placement"] == "before_augment"] or echoed
    return max(preferred, key=lambda r: r["delivered_per_s"], default=None)


def _times(x, spread):
    s = f"{x:.1f}x"
    if spread is not None and f"{spread[0]:.1f}" != f"{spread[1]:.1f}":
        s += f" ({spread[0]:.1f}-{spread[1]:.1f})"
    return s


def _verdict(rows, missing, no_peers):
    """One line: echo_native at e=1 against each peer that ran (median paired ratio), and
    what echoing adds on top."""
    base = next(r for r in rows if r["pipeline"] == "echo_native" and r["echo"] == 1)
    n = base["repeats"]
    runs = f"{n} paired run{'s' if n != 1 else ''}"
    ran = _peers_ran(rows)
    if ran:
        vs = ", ".join(f"{_times(base[f'x_{p}'], base[f'x_{p}_range'])} {PEERS[p][2]}"
                       for p in ran)
        line = f"echo_native: {vs} on this machine (median{' and min-max' if n > 1 else ''}" \
               f" of {runs})"
    else:
        why = "--no-peers" if no_peers else \
            " and ".join(PEERS[p][2] for p in missing) + " missing, see above"
        line = (f"echo_native: {base['delivered_per_s']:,.0f} img/s at e=1; no peer ran "
                f"({why}), so no ratio (median of {n} run{'s' if n != 1 else ''})")
    top = _headline_echo(rows)
    if top is not None:
        line += (f"; with echo={top['echo']} {top['placement']} it delivers "
                 f"{top['effective_echo']:.1f}x its fresh rate")
        if ran:
            line += f" ({top[f'x_{ran[0]}']:.1f}x {PEERS[ran[0]][2]})"
    return line


def _row_label(r):
    if r["pipeline"] == "echo_native":
        return "echo_native\ne=1" if r["echo"] == 1 else f"{r['placement']}\ne={r['echo']}"
    return next((plain.replace(" ", "\n") for name, _, plain in PEERS.values()
                 if name == r["pipeline"]), r["pipeline"])


def _chart(rows, path, title):
    """Grouped bars, delivered and fresh img/s per row (medians, min-max error bars);
    the delivered bars carry their multiple of the first peer that ran."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    import numpy as np

    x, w = np.arange(len(rows)), 0.4
    fig, ax = plt.subplots(figsize=(max(7.0, 1.15 * len(rows) + 1.5), 5))
    for offset, key, name in ((-w / 2, "delivered", "delivered"), (w / 2, "fresh", "fresh")):
        med = np.array([r[f"{key}_per_s"] for r in rows])
        lo, hi = np.array([r[f"{key}_range"] for r in rows]).T
        bars = ax.bar(x + offset, med, w, yerr=[med - lo, hi - med], capsize=3,
                      label=f"{name} img/s", error_kw={"elinewidth": 1})
        if key == "delivered":
            _annotate_ratios(ax, bars, hi, rows)
    ax.set_xticks(x, [_row_label(r) for r in rows], rotation=30, ha="right",
                  rotation_mode="anchor", fontsize=9)
    ax.set_ylabel("images / s (median; bars: min-max)")
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.12)
    ax.legend(loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _annotate_ratios(ax, bars, tops, rows):
    ran = _peers_ran(rows)
    if not ran:
        return
    peer = ran[0]
    for bar, top, r in zip(bars, tops, rows):
        ax.annotate(f"{r[f'x_{peer}']:.1f}x", (bar.get_x() + bar.get_width() / 2, top),
                    xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8)
    ax.text(0.99, 0.98, f"above the bars: delivered / {PEERS[peer][2]}, paired median",
            transform=ax.transAxes,
            ha="right", va="top", fontsize=8)


def _check_bench_args(args):
    """The arguments checked before the corpus is built or any pipeline starts."""
    if args.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {args.repeats}")
    from echo_native.echo import PLACEMENTS

    bad = [p for p in args.placements if p not in PLACEMENTS]
    if bad:
        raise UsageError(f"unknown placement {bad[0]!r}; choose from {', '.join(PLACEMENTS)}")
    if any(e != "auto" and e < 1 for e in args.echo):
        raise UsageError(f"echo factors must be >= 1 or 'auto', got {args.echo}")
    bad = [p for p in args.peers if p not in PEER_GROUPS]
    if bad:
        raise UsageError(f"unknown peer {bad[0]!r} in --peers; choose from "
                         f"{', '.join(PEER_GROUPS)}")


def cmd_bench(args):
    t_start = time.perf_counter()
    _check_bench_args(args)
    if args.dir:
        root = args.dir
    else:
        from echo_native.lab.corpus import default_corpus
        print(f"building/using the built-in corpus of {args.images} images ...", file=sys.stderr)
        try:
            root = default_corpus(n_images=args.images)
        except ImportError as e:
            raise UsageError(str(e)) from None
    folder = open_folder(root, args.batch_size)
    check_device(args.device)
    args.workers = args.workers or len(os.sched_getaffinity(0))
    asked = [] if args.no_peers else [row for p in PEER_GROUPS if p in args.peers
                                      for row in PEER_GROUPS[p]]
    missing = {p: why for p, why in ({} if args.no_peers else _peers_missing()).items()
               if p in asked}
    for peer, why in missing.items():
        print(_missing_line(peer, why), file=sys.stderr)
    peers = [p for p in asked if p not in missing]
    runs = _measure(_pipelines(folder, args, peers), args.repeats, missing)
    rows = [_summarise(r) for r in runs.values()]
    _add_ratios(rows)
    cores = len(os.sched_getaffinity(0))
    print(f"\n{len(folder)} images from {root}; batch {args.batch_size}, "
          f"{args.image_size}px, {args.workers} workers (DALI, SPDL: threads) on {cores} "
          f"cores, consumer step {args.step_ms} ms; median (min-max) of {args.repeats} runs "
          f"per row, interleaved, each after an untimed warm-up epoch; ratios paired by "
          f"run\n")
    print(_table(rows))
    if asked:
        print("\nThe peers against echo_native at e=1 (its rate over echo_native's, paired "
              "by run):\n")
        print(_peer_table(rows, missing, asked))
    with open(args.json, "w") as f:
        json.dump({"root": str(root), "images": len(folder), "repeats": args.repeats,
                   "args": vars(args) | {"func": None}, "rows": rows,
                   "peers_missing": missing}, f, indent=2, default=str)
    print(f"\nJSON: {args.json}")
    title = (f"echo_native bench: {len(folder)} images, {args.image_size}px, batch "
             f"{args.batch_size}, {args.workers} workers on {cores} cores\n"
             f"median of {args.repeats} interleaved run{'s' if args.repeats != 1 else ''}")
    if _chart(rows, args.chart, title):
        print(f"chart: {args.chart}")
    else:
        print("no chart: matplotlib is not installed (pip install matplotlib)")
    print(f"{sum(len(r) for r in runs.values())} timed epochs in "
          f"{time.perf_counter() - t_start:.0f} s\n")
    print(_verdict(rows, missing, args.no_peers))
    return 0


# -- make-dataset ---------------------------------------------------------------------
def cmd_make_dataset(args):
    t0 = time.perf_counter()
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UsageError(f"{args.out} exists and is not a folder")
    if args.kind == "fashion-mnist":
        from echo_native.lab.datasets import DatasetMissing, build_fashion_mnist

        for name in ("limit_train", "limit_test"):
            v = getattr(args, name)
            if v is not None and v < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        if not 1 <= args.quality <= 100:
            raise UsageError(f"--quality must be in 1..100, got {args.quality}")
        try:
            out = build_fashion_mnist(args.out, quality=args.quality,
                                      limit_train=args.limit_train, limit_test=args.limit_test)
        except DatasetMissing as e:
            raise UsageError(str(e)) from None
        man = json.loads((out / "echo_native_fashion_mnist.json").read_text())
        print(f"Fashion-MNIST: {man['train']} train + {man['test']} test JPEGs in "
              f"{out}/train and {out}/test ({time.perf_counter() - t0:.1f} s)")
    else:
        from echo_native.lab.corpus import build_corpus

        if args.images < 1:
            raise UsageError(f"--images must be >= 1, got {args.images}")
        try:
            out = build_corpus(args.out, n_images=args.images, seed=args.seed)
        except ImportError as e:
            raise UsageError(str(e)) from None
        print(f"ImageNet-like corpus: {args.images} JPEGs in {out} "
              f"({time.perf_counter() - t0:.1f} s)")
    return 0


# -- demo -----------------------------------------------------------------------------
def cmd_demo(args):
    from echo_native.lab.demo import AUGMENTS, DemoConfig, run_demo, run_sweep

    try:
        import torch
    except ImportError:
        raise UsageError("the demo trains a PyTorch model: pip install torch") from None
    if args.device != "cpu":
        if not (args.device == "cuda" or args.device.startswith("cuda:")):
            raise UsageError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
        if not torch.cuda.is_available():
            raise UsageError(f"--device {args.device}: torch sees no CUDA GPU "
                             f"(torch {torch.__version__})")
    if any(e != "auto" and e < 1 for e in args.echo):
        raise UsageError(f"--echo needs numbers >= 1 or 'auto', got {args.echo}")
    if args.sweep is not None and (not args.sweep or any(r <= 0 for r in args.sweep)):
        raise UsageError(f"--sweep needs positive ratios R, e.g. 2,4,6, got {args.sweep}")
    from echo_native.echo import PLACEMENTS

    bad = [p for p in args.placements if p not in PLACEMENTS]
    if bad:
        raise UsageError(f"unknown placement {bad[0]!r}; choose from {', '.join(PLACEMENTS)}")
    for name, lo in (("seeds", 1), ("max_fresh", 1), ("eval_every", 1), ("batch_size", 1),
                     ("image_size", 8), ("workers", 1)):
        if getattr(args, name) < lo:
            raise UsageError(f"--{name.replace('_', '-')} must be >= {lo}, got "
                             f"{getattr(args, name)}")
    if not 0 < args.target <= 1:
        raise UsageError(f"--target is a test accuracy in (0, 1], got {args.target}")
    if args.min_step_ms < 0:
        raise UsageError(f"--min-step-ms must be >= 0, got {args.min_step_ms}")
    if args.R <= 0:
        raise UsageError(f"--R must be positive, got {args.R}")
    if args.data:
        data = args.data
    else:
        from echo_native.lab.datasets import DatasetMissing, default_fashion_mnist

        print("building/using the Fashion-MNIST JPEG tree in the cache ...", file=sys.stderr)
        try:
            data = str(default_fashion_mnist())
        except DatasetMissing as e:
            raise UsageError(str(e)) from None
    if not os.path.isdir(data):
        raise UsageError(f"{data}: no such folder")
    for split in ("train", "test"):
        if not os.path.isdir(os.path.join(data, split)):
            raise UsageError(f"{data} has no {split}/ folder (make one with: echo-native-lab "
                             f"make-dataset fashion-mnist {data})")
    train = open_folder(os.path.join(data, "train"), args.batch_size)
    open_folder(os.path.join(data, "test"))
    if args.train_subset is not None and args.train_subset < args.batch_size:
        raise UsageError(f"--train-subset {args.train_subset} is smaller than --batch-size "
                         f"{args.batch_size}")
    bad = [a for a in args.augment if a not in AUGMENTS]
    if bad:
        raise UsageError(f"--augment: unknown {', '.join(bad)} (choose from "
                         f"{', '.join(AUGMENTS)})")
    cfg = DemoConfig(data=data, echo=tuple(args.echo), placements=tuple(args.placements),
                     augments=tuple(args.augment), max_echo=args.max_echo,
                     seeds=args.seeds, first_seed=args.first_seed, R=args.R,
                     target=args.target, max_fresh=args.max_fresh,
                     eval_every=args.eval_every, batch_size=args.batch_size,
                     image_size=args.image_size, workers=args.workers, lr=args.lr,
                     train_subset=args.train_subset, test_limit=args.test_limit,
                     threads=args.threads, device=args.device, out_json=args.json,
                     upstream_s=args.upstream_seconds, min_step_ms=args.min_step_ms,
                     out_chart=args.chart)
    log = (lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    n = min(len(train), args.train_subset or len(train))
    settings = (1 + sum(1 for e in args.echo if e != 1) * len(args.placements)) * \
        len(args.augment)
    print(f"echo training demo: {n} training JPEGs, {settings} settings x {args.seeds} seeds, "
          f"target {args.target:.0%} test accuracy, upstream throttled to R = "
          f"{', '.join(f'{r:g}' for r in args.sweep) if args.sweep else f'{args.R:g}'}",
          file=sys.stderr)
    if args.sweep is not None:
        return _print_sweep(args, run_sweep(cfg, args.sweep, log=log))
    report = run_demo(cfg, log=log)
    print(f"\nFashion-MNIST, small CNN (PyTorch, {args.device}), batch {args.batch_size}, "
          f"{args.image_size}px RandomResizedCrop(0.35-1) + flip"
          f"{' (rich: + ColorJitter 0.4 + RandomErasing 0.5)' if 'rich' in args.augment else ''}"
          f"; train step "
          f"{report['step_ms']:.1f} ms, upstream {report['upstream_img_per_s']:,.0f} img/s, "
          f"measured R = {report['measured_R']:.2f}; {report['train_images']} training / "
          f"{report['test_images']} test images; {args.seeds} seeds (mean ± std)\n")
    print(report["table"])
    print(f"\nJSON: {args.json}")
    if report["chart"]:
        print(f"chart: {report['chart']}")
    else:
        print("no chart: matplotlib is not installed (pip install matplotlib)")
    print(f"total {report['total_s']:.0f} s")
    return 0


def _print_sweep(args, report):
    print(f"\nFashion-MNIST, small CNN (PyTorch, {args.device}), batch {args.batch_size}, "
          f"placement {', '.join(args.placements)}, {args.seeds} seeds; upstream throttled "
          f"to R = {', '.join(f'{r:g}' for r in args.sweep)}\n")
    print(report["table"])
    for block in report["per_R"]:
        v = block["verdict"]
        if v["auto_vs_best"]:
            print(f"R = {block['R']:g}: auto {v['auto_wall']:.1f} s, best fixed e = "
                  f"{v['best_fixed_echo']} {v['best_fixed_wall']:.1f} s "
                  f"(auto / best = {v['auto_vs_best']:.2f})")
    print(f"\nJSON: {args.json}")
    print(f"chart: {report['chart']}" if report["chart"] else
          "no chart: matplotlib is not installed (pip install matplotlib)")
    print(f"total {report['total_s']:.0f} s")
    return 0


# -- lm-demo --------------------------------------------------------------------------
# --quick: seconds, not minutes (a smoke run: tiny model and corpus, one seed).
LM_QUICK = {"seeds": 1, "corpus_bytes": 200_000, "batch_size": 8, "seq_len": 16, "embed": 16,
            "hidden": 32, "max_fresh_tokens": 6_000, "eval_every": 1_000, "target": 4.0,
            "calibrate_s": 0.3, "eval_windows": 64}


def cmd_lm_demo(args):
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UsageError("the LM demo trains a PyTorch model: pip install torch") from None
    from echo_native.lab.lm_demo import LMConfig, run_lm_demo

    given = {k: getattr(args, k) for k in ("seeds", "corpus_bytes", "batch_size", "seq_len",
                                           "embed", "hidden", "max_fresh_tokens",
                                           "eval_every", "target", "eval_windows")}
    values = {**(LM_QUICK if args.quick else {}),
              **{k: v for k, v in given.items() if v is not None}}
    if any(e != "auto" and e < 1 for e in args.echo):
        raise UsageError(f"--echo needs numbers >= 1 or 'auto', got {args.echo}")
    bad = [p for p in args.placements if p not in ("batch", "after_augment")]
    if bad:
        raise UsageError(f"--placements: {bad[0]!r} is not batch or after_augment (the "
                         f"tokenizer's rows have no augmentation to echo before)")
    for name, lo in (("seeds", 1), ("corpus_bytes", 1), ("batch_size", 1), ("seq_len", 1),
                     ("embed", 1), ("hidden", 1), ("max_fresh_tokens", 1),
                     ("eval_every", 1), ("eval_windows", 1)):
        if name in values and values[name] < lo:
            raise UsageError(f"--{name.replace('_', '-')} must be >= {lo}, got {values[name]}")
    for name in ("R", "lr"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name} must be positive, got {getattr(args, name)}")
    if "target" in values and values["target"] <= 0:
        raise UsageError(f"--target is a held-out loss in nats per token (> 0), got "
                         f"{values['target']}")
    if args.workers < 0 or args.threads < 1 or (args.rounds is not None and args.rounds < 1):
        raise UsageError("--workers must be >= 0, --threads and --rounds >= 1")
    if args.max_echo < 1:
        raise UsageError(f"--max-echo must be >= 1, got {args.max_echo}")
    if args.stdlib is not None and not os.path.isdir(args.stdlib):
        raise UsageError(f"--stdlib {args.stdlib}: no such folder")
    cfg = LMConfig(echo=tuple(args.echo), placements=tuple(args.placements),
                   first_seed=args.first_seed, R=args.R, lr=args.lr, max_echo=args.max_echo,
                   workers=args.workers, threads=args.threads, rounds=args.rounds,
                   stdlib=args.stdlib, out_json=args.out, **values)
    log = (lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    print(f"LM echo demo: {len(_lm_settings(cfg))} settings x {cfg.seeds} seeds, target "
          f"held-out loss {cfg.target:g}, upstream calibrated to R = {cfg.R:g}",
          file=sys.stderr)
    try:
        report = run_lm_demo(cfg, log=log)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None
    c = report["corpus"]
    in_run = f", in the e=1 runs {report['in_run_R']:.2f}" if report["in_run_R"] else ""
    print(f"\nPython standard library sources ({c['files']} files read from {c['root']}, "
          f"{c['train_bytes']:,} bytes of training text, every 10th file held out: "
          f"{c['held_out_rows']} rows); byte-level vocabulary; GRU {cfg.hidden} "
          f"(PyTorch, CPU, {cfg.threads} thread), batch {cfg.batch_size} x {cfg.seq_len} "
          f"tokens; train step {report['step_ms']:.1f} ms, tokenizer {report['rounds']} "
          f"hash rounds per token, {report['upstream_ms']:.1f} ms per batch: measured "
          f"R = {report['measured_R']:.2f}{in_run}; {cfg.seeds} seeds, mean (min-max)\n")
    print(report["table"])
    if cfg.out_json:
        print(f"\nJSON: {cfg.out_json}")
    other = report["other_cores_avg"]
    print(f"total {report['total_s']:.0f} s" +
          (f"; other processes used {other:.2f} cores on average meanwhile"
           if other is not None else ""))
    return 0


def _lm_settings(cfg):
    from echo_native.lab.lm_demo import settings

    return settings(cfg)


# The options of every echo sweep (bench, demo, lm-demo): its two axes, and for the
# training demos the seeds each setting runs with.  Declared once, so that the three
# commands parse and explain them alike; each command gives its own defaults.
def _echo_options(p, echo=(1, 2, 4), placements=("before_augment", "after_augment", "batch"),
                  placements_help=None):
    p.add_argument("--echo", type=echo_list, default=list(echo),
                   help="comma-separated echo factors (numbers or 'auto')")
    p.add_argument("--placements", type=lambda s: s.split(","), default=list(placements),
                   help=placements_help)


def _seed_options(p, seeds, seeds_help=None):
    p.add_argument("--seeds", type=int, default=seeds, help=seeds_help)
    p.add_argument("--first-seed", type=int, default=0,
                   help="run seeds FIRST .. FIRST + SEEDS - 1 (to split a long sweep)")


def build_parser():
    p, sub = command_parser(
        "echo-native-lab", "echo_native lab: benchmarks, data sets and the echo training demo.",
        "Profiling your own data and step time: echo-native profile --help.")
    b = sub.add_parser("bench", help="measure the pipeline (and peers) on a folder")
    b.add_argument("dir", nargs="?", help="ImageFolder root (default: built-in corpus)")
    b.add_argument("--images", type=int, default=1000, help="size of the built-in corpus")
    loader_options(b)
    _echo_options(b)
    b.add_argument("--step-ms", type=float, default=0.0,
                   help="consumer step time per batch (models the accelerator)")
    b.add_argument("--repeats", type=int, default=3,
                   help="timed runs per row, interleaved across the rows; each row reports "
                        "the median and min-max (each run after an untimed warm-up epoch)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    b.add_argument("--peers", type=lambda s: [p.strip() for p in s.split(",") if p.strip()],
                   default=list(PEER_GROUPS),
                   help="comma-separated peers to measure beside echo_native, each when "
                        "installed: torch, dali, spdl, turboloader (default: all)")
    b.add_argument("--no-peers", action="store_true",
                   help="skip the peers (torch DataLoader, DALI, SPDL, turboloader)")
    b.add_argument("--json", default="echo_native_bench.json")
    b.add_argument("--chart", default="echo_native_bench.png")
    b.set_defaults(func=cmd_bench)

    m = sub.add_parser("make-dataset", help="write a JPEG ImageFolder: Fashion-MNIST (from "
                                            "Debian's dataset-fashion-mnist) or the "
                                            "ImageNet-like corpus")
    m.add_argument("kind", choices=["fashion-mnist", "imagenet-like"])
    m.add_argument("out", help="output folder")
    m.add_argument("--images", type=int, default=2000, help="imagenet-like: number of images")
    m.add_argument("--seed", type=int, default=0, help="imagenet-like: corpus seed")
    m.add_argument("--quality", type=int, default=90, help="fashion-mnist: JPEG quality")
    m.add_argument("--limit-train", type=int, default=None,
                   help="fashion-mnist: keep the first N training images")
    m.add_argument("--limit-test", type=int, default=None,
                   help="fashion-mnist: keep the first N test images")
    m.set_defaults(func=cmd_make_dataset)

    d = sub.add_parser("demo", help="echo training demo: Fashion-MNIST JPEGs through EchoRing, "
                                    "a small CNN, fresh examples and wall time to a target "
                                    "accuracy per echo setting")
    d.add_argument("--data", default=None,
                   help="folder with train/ and test/ ImageFolders (default: Fashion-MNIST "
                        "converted once into the cache)")
    _echo_options(d)
    d.add_argument("--augment", type=lambda s: s.split(","), default=["basic"],
                   help="basic (crop + flip), rich (+ ColorJitter and RandomErasing), or "
                        "both: basic,rich")
    _seed_options(d, 3)
    d.add_argument("--max-echo", type=float, default=8.0, help="echo='auto''s cap")
    d.add_argument("--R", type=float, default=4.0,
                   help="upstream time / training step time per batch (throttle)")
    d.add_argument("--sweep", type=lambda s: [float(v) for v in s.split(",")], default=None,
                   metavar="R1,R2,...",
                   help="run every setting at each of these R and compare echo='auto' with "
                        "the fixed factors (e.g. --sweep 2,4,6 --echo 1,2,3,4,6,auto "
                        "--placements before_augment)")
    d.add_argument("--target", type=float, default=DEMO_TARGET,
                   help="test accuracy to reach (full test set)")
    d.add_argument("--max-fresh", type=int, default=DEMO_MAX_FRESH,
                   help="budget of fresh examples per run")
    d.add_argument("--eval-every", type=int, default=DEMO_EVAL_EVERY,
                   help="evaluate every N fresh examples")
    d.add_argument("--batch-size", type=int, default=64)
    d.add_argument("--image-size", type=int, default=28, help="28 or 32")
    d.add_argument("--workers", type=int, default=2)
    d.add_argument("--lr", type=float, default=DEMO_LR)
    d.add_argument("--train-subset", type=int, default=None,
                   help="use N training images (default: all 60,000)")
    d.add_argument("--threads", type=int, default=1, help="torch threads")
    d.add_argument("--min-step-ms", type=float, default=0.0,
                   help="pad every training step to this many ms with a sleep (a slower "
                        "accelerator: lets the throttle reach a low R)")
    d.add_argument("--device", default="cpu", help="cpu or cuda[:N] (the model)")
    d.add_argument("--test-limit", type=int, default=None, help=argparse.SUPPRESS)
    d.add_argument("--upstream-seconds", type=float, default=2.0, help=argparse.SUPPRESS)
    d.add_argument("--quiet", action="store_true")
    d.add_argument("--json", default="echo_native_demo.json")
    d.add_argument("--chart", default="echo_native_demo.png")
    d.set_defaults(func=cmd_demo)

    lm = sub.add_parser("lm-demo", help="echo for a language model: EchoLoader around a slow "
                                        "tokenizer of the Python standard library's sources, "
                                        "a small GRU, fresh tokens and wall time to a target "
                                        "loss per echo setting")
    _echo_options(lm, (1, 2, 4, "auto"), ("batch", "after_augment"),
                  "batch, after_augment (example echo) or both")
    _seed_options(lm, None, "default 3")
    lm.add_argument("--R", type=float, default=3.0,
                    help="tokenizer time / training step time per batch (calibrated)")
    lm.add_argument("--target", type=float, default=None,
                    help="held-out loss to reach, nats per token (default 1.6)")
    lm.add_argument("--max-fresh-tokens", type=int, default=None,
                    help="budget of fresh tokens per run (default 600,000)")
    lm.add_argument("--eval-every", type=int, default=None,
                    help="evaluate every N fresh tokens (default: 8 batches)")
    lm.add_argument("--corpus-bytes", type=int, default=None,
                    help="training text read from the standard library (default 4,000,000)")
    lm.add_argument("--eval-windows", type=int, default=None,
                    help="held-out rows (default 512)")
    lm.add_argument("--batch-size", type=int, default=None, help="default 32")
    lm.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 32)")
    lm.add_argument("--embed", type=int, default=None, help="default 64")
    lm.add_argument("--hidden", type=int, default=None, help="GRU width (default 128)")
    lm.add_argument("--lr", type=float, default=3e-3)
    lm.add_argument("--max-echo", type=float, default=4.0, help="echo='auto''s cap")
    lm.add_argument("--workers", type=int, default=1,
                    help="tokenizer processes (0: in the training process)")
    lm.add_argument("--threads", type=int, default=1, help="torch threads")
    lm.add_argument("--rounds", type=int, default=None,
                    help="hash rounds per token (default: calibrated to --R)")
    lm.add_argument("--stdlib", default=None,
                    help="folder of .py sources (default: this Python's standard library)")
    lm.add_argument("--quick", action="store_true",
                    help="a smoke run in seconds: one seed, tiny model and corpus, loss 4.0")
    lm.add_argument("--quiet", action="store_true")
    lm.add_argument("--out", default=None, help="write the report as JSON here")
    lm.set_defaults(func=cmd_lm_demo)
    return p


def main(argv=None):
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())

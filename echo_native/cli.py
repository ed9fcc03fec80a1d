"""``echo-native`` command line (also ``python -m echo_native``).

``echo-native bench [DIR]`` measures the whole pipeline on a folder (default:
an ImageNet-like corpus cut from real photographs, built once and cached):
fresh and delivered images/s for each echo setting, consumer stall, ring
occupancy and failures, with the torch DataLoader peer side by side when
torch is installed.  Errors a user can hit print one line and exit non-zero.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


class UsageError(Exception):
    """A mistake in the command line or its inputs: reported in one line."""


def _progress(total, desc):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="img", leave=False, file=sys.stderr,
                disable=not sys.stderr.isatty())


def _run_ring(folder, args, echo, placement):
    import echo_native as en

    ring = en.EchoRing(folder, batch_size=args.batch_size, image_size=args.image_size,
                       echo=echo, placement=placement, workers=args.workers, seed=args.seed)
    step = args.step_ms / 1000.0
    bar = _progress(len(ring) * args.batch_size, f"{placement} e={echo}")
    with ring:
        t0 = time.perf_counter()
        delivered = 0
        for batch in ring:
            delivered += len(batch)
            if step:
                time.sleep(step)  # stands in for the accelerator's step
            if bar is not None:
                bar.update(len(batch))
        wall = time.perf_counter() - t0
        st = ring.stats()
    if bar is not None:
        bar.close()
    return {
        "pipeline": "echo_native", "placement": placement, "echo": echo,
        "workers": ring.loader.workers, "wall_s": wall,
        "fresh_per_s": st["fresh"] / wall, "delivered_per_s": delivered / wall,
        "effective_echo": st["effective_echo"], "stall_s": st["stall_s"],
        "ring_occupancy": st["ring_occupancy"], "failures": sum(st["failures"].values()),
    }


def _run_torch(folder, args):
    from echo_native.peers import torch_loader

    loader = torch_loader(folder, args.batch_size, args.workers, args.image_size, args.seed)
    step = args.step_ms / 1000.0
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
    return {"pipeline": "torch DataLoader + torchvision-style Pillow", "placement": "-",
            "echo": 1, "workers": args.workers, "wall_s": wall, "fresh_per_s": n / wall,
            "delivered_per_s": n / wall, "effective_echo": 1.0, "stall_s": stall,
            "ring_occupancy": float("nan"), "failures": 0}


def _table(rows, baseline):
    head = ("pipeline", "placement", "echo", "fresh img/s", "delivered img/s", "x torch",
            "stall s", "ring occ.", "failures")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ratio = f"{r['delivered_per_s'] / baseline:.2f}" if baseline else "-"
        lines.append(f"| {r['pipeline']} | {r['placement']} | {r['echo']} | "
                     f"{r['fresh_per_s']:,.0f} | {r['delivered_per_s']:,.0f} | {ratio} | "
                     f"{r['stall_s']:.2f} | {r['ring_occupancy']:.2f} | {r['failures']} |")
    return "\n".join(lines)


def _chart(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [f"{r['placement']}\ne={r['echo']}" if r["pipeline"] == "echo_native" else "torch"
              for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.9), 4))
    ax.bar(labels, [r["delivered_per_s"] for r in rows], label="delivered")
    ax.bar(labels, [r["fresh_per_s"] for r in rows], label="fresh")
    ax.set_ylabel("images / s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def cmd_bench(args):
    import echo_native as en

    if args.dir:
        if not os.path.isdir(args.dir):
            raise UsageError(f"{args.dir}: no such folder")
        root = args.dir
    else:
        from echo_native.corpus import default_corpus
        print(f"building/using the built-in corpus of {args.images} images ...", file=sys.stderr)
        root = default_corpus(n_images=args.images)
    try:
        folder = en.ImageFolder(root)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None
    if len(folder) < args.batch_size:
        raise UsageError(f"{root} has {len(folder)} images, fewer than --batch-size "
                         f"{args.batch_size}")
    from echo_native.echo import PLACEMENTS
    bad = [p for p in args.placements if p not in PLACEMENTS]
    if bad:
        raise UsageError(f"unknown placement {bad[0]!r}; choose from {', '.join(PLACEMENTS)}")
    if any(e != "auto" and e < 1 for e in args.echo):
        raise UsageError(f"echo factors must be >= 1 or 'auto', got {args.echo}")
    args.workers = args.workers or len(os.sched_getaffinity(0))
    rows = []
    if not args.no_peers:
        try:
            import torch  # noqa: F401
            rows.append(_run_torch(folder, args))
        except ImportError:
            print("torch not installed: no DataLoader peer in this run", file=sys.stderr)
    rows.append(_run_ring(folder, args, 1, "after_augment"))
    for placement in args.placements:
        for e in args.echo:
            if e != 1:
                rows.append(_run_ring(folder, args, e, placement))
    baseline = rows[0]["delivered_per_s"] if rows[0]["pipeline"] != "echo_native" else None
    print(f"\n{len(folder)} images from {root}; batch {args.batch_size}, "
          f"{args.image_size}px, {args.workers} workers, consumer step {args.step_ms} ms\n")
    print(_table(rows, baseline))
    with open(args.json, "w") as f:
        json.dump({"root": str(root), "images": len(folder), "args": vars(args) | {"func": None},
                   "rows": rows}, f, indent=2, default=str)
    print(f"\nJSON: {args.json}")
    if _chart(rows, args.chart):
        print(f"chart: {args.chart}")
    return 0


def _echo_list(text):
    try:
        values = [v if v == "auto" else float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of echo factors: {text!r}") from None
    return [int(v) if isinstance(v, float) and v.is_integer() else v for v in values]


def build_parser():
    p = argparse.ArgumentParser(prog="echo-native", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="measure the pipeline (and peers) on a folder")
    b.add_argument("dir", nargs="?", help="ImageFolder root (default: built-in corpus)")
    b.add_argument("--images", type=int, default=1000, help="size of the built-in corpus")
    b.add_argument("--batch-size", type=int, default=64)
    b.add_argument("--image-size", type=int, default=224)
    b.add_argument("--workers", type=int, default=0, help="default: available cores")
    b.add_argument("--echo", type=_echo_list, default=[1, 2, 4],
                   help="comma-separated echo factors (numbers or 'auto')")
    b.add_argument("--placements", type=lambda s: s.split(","),
                   default=["before_augment", "after_augment", "batch"])
    b.add_argument("--step-ms", type=float, default=0.0,
                   help="consumer step time per batch (models the accelerator)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--no-peers", action="store_true", help="skip the torch DataLoader peer")
    b.add_argument("--json", default="echo_native_bench.json")
    b.add_argument("--chart", default="echo_native_bench.png")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"echo-native: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("echo-native: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

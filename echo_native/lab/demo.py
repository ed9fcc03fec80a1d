"""The echo training demo: real training on Fashion-MNIST JPEGs read through ``EchoRing``.

A small CNN (PyTorch, CPU) is trained on the Fashion-MNIST training JPEGs, decoded
and augmented by ``EchoRing`` (RandomResizedCrop scale (0.35, 1) + horizontal flip),
with the upstream throttled so that it is ``R`` times slower per batch than the
training step (:class:`ThrottledSource` sleeps in ``read``; it lives here because
workers are separate processes that import their source's class).  For every echo
factor and placement, over several seeds, the demo measures the **fresh examples**
and the **wall time** (training only: evaluation pauses both the clock and the
upstream) needed to reach a fixed accuracy on the full 10,000-image test set.

Run it with ``echo-native-lab demo`` (see ``echo-native-lab demo --help``).
"""
from __future__ import annotations

import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from echo_native.profile import measure_upstream

__all__ = ["ThrottledSource", "DemoConfig", "run_demo", "run_sweep", "train_one",
           "measure_step", "markdown_table", "sweep_table", "summarize"]

MEAN, STD = 0.286, 0.353  # Fashion-MNIST pixel statistics in [0, 1]


class ThrottledSource:
    """A source wrapper whose ``read`` sleeps ``delay_s`` first (the slow upstream).

    ``indices`` restricts it to a subset; ``pause_path``: while that file exists,
    ``read`` waits (so evaluation can stop the upstream as well as the clock).
    """

    def __init__(self, inner, delay_s=0.0, indices=None, pause_path=None):
        self.inner = inner
        self.delay_s = float(delay_s)
        self.indices = None if indices is None else np.asarray(indices, dtype=np.int64)
        self.pause_path = pause_path
        base = np.asarray(inner.labels)
        self.labels = base if self.indices is None else base[self.indices]

    def __len__(self):
        return len(self.labels)

    def _map(self, i):
        return int(i) if self.indices is None else int(self.indices[i])

    def describe(self, i):
        return self.inner.describe(self._map(i))

    def read(self, i):
        if self.pause_path:
            while os.path.exists(self.pause_path):
                time.sleep(0.002)
        if self.delay_s > 0:
            time.sleep(self.delay_s)
        return self.inner.read(self._map(i))


def make_model(seed, image_size=28):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * (image_size // 4) ** 2, 64), nn.ReLU(), nn.Linear(64, 10))


def to_tensor(images):
    """(B, H, W, 3) uint8 (gray replicated) -> normalised (B, 1, H, W) float32 tensor."""
    import torch

    x = torch.from_numpy(np.ascontiguousarray(images[..., 0])).float()
    return ((x / 255.0 - MEAN) / STD).unsqueeze(1)


def load_test_set(folder, image_size, limit=None):
    """Decode the test JPEGs once (the whole image, resized only if needed)."""
    import echo_native as en

    n = len(folder) if limit is None else min(limit, len(folder))
    out = np.empty((n, image_size, image_size, 3), np.uint8)
    for i in range(n):
        data = folder.read(i)
        img = en.decode(data)
        if img.shape[:2] != (image_size, image_size):
            img = en.decode_crop(data, box=(0, 0, img.shape[0], img.shape[1]),
                                 size=(image_size, image_size))
        out[i] = img
    return to_tensor(out), np.asarray(folder.labels[:n])


def evaluate(model, x, y, batch=1000):
    import torch

    model.eval()
    correct = 0
    with torch.inference_mode():
        for s in range(0, len(x), batch):
            pred = model(x[s:s + batch]).argmax(1).cpu().numpy()
            correct += int((pred == y[s:s + batch]).sum())
    model.train()
    return correct / len(x)


def measure_step(batch_size, image_size, lr=2e-3, steps=30, warmup=10, device="cpu"):
    """Seconds per training step of the demo model on a synthetic batch."""
    import torch

    model = make_model(0, image_size).to(device)
    opt = torch.optim.Adam(model.parameters(), lr)
    x = torch.randn(batch_size, 1, image_size, image_size, device=device)
    y = torch.randint(0, 10, (batch_size,), device=device)
    for i in range(warmup + steps):
        if i == warmup:
            t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


@dataclass
class DemoConfig:
    data: str | None = None            # JPEG tree with train/ and test/ (default: cached build)
    echo: tuple = (1, 2, 4)
    placements: tuple = ("before_augment", "after_augment", "batch")
    augments: tuple = ("basic",)       # "basic": crop + flip; "rich": + jitter and erasing
    max_echo: float = 8.0              # echo="auto"'s cap (the sweep compares it with e = 6)
    seeds: int = 3
    first_seed: int = 0                # seeds first_seed .. first_seed + seeds - 1
    R: float = 4.0
    target: float = 0.80
    max_fresh: int = 40000
    eval_every: int = 2000
    batch_size: int = 64
    image_size: int = 28
    workers: int = 2
    lr: float = 2e-3
    train_subset: int | None = None
    test_limit: int | None = None      # tests only: the report says when the test set is cut
    step_s: float | None = None        # measured when None
    min_step_ms: float = 0.0           # pad each step to this with a sleep (an accelerator's
                                       # step: time that leaves the host CPU free)
    threads: int = 1
    upstream_s: float = 2.0            # measuring time of the throttled upstream
    device: str = "cpu"                # the model's device (the ring stays on the CPU)
    out_json: str = "echo_native_demo.json"
    out_chart: str = "echo_native_demo.png"
    quiet: bool = False
    extra: dict = field(default_factory=dict)


AUGMENTS = ("basic", "rich")


def augment_spec(name, image_size):
    """The demo's augmentations: "basic" is RandomResizedCrop (0.35-1) + flip; "rich"
    adds ColorJitter (brightness and contrast: the images are grey) and RandomErasing,
    drawn afresh for every emission before augmentation."""
    import echo_native as en

    crop = en.RandomResizedCrop(image_size, scale=(0.35, 1.0))
    if name == "basic":
        return crop
    if name == "rich":
        return [crop, en.ColorJitter(brightness=0.4, contrast=0.4),
                en.RandomErasing(p=0.5, scale=(0.02, 0.2))]
    raise ValueError(f"augment must be one of {', '.join(AUGMENTS)}, got {name!r}")


def train_one(train_src, test_x, test_y, cfg, echo, placement, seed, log=None,
              augment="basic"):
    """One training run; returns a dict with fresh/wall/steps to target (None if not reached)."""
    import torch

    import echo_native as en

    dev = cfg.device
    model = make_model(seed, cfg.image_size).to(dev)
    opt = torch.optim.Adam(model.parameters(), cfg.lr)
    pause = train_src.pause_path
    open(pause, "w").close()  # workers wait until the clock starts
    ring = en.EchoRing(train_src, batch_size=cfg.batch_size,
                       augment=augment_spec(augment, cfg.image_size),
                       echo=en.Echo(echo, placement=placement,
                                    **({"max_echo": cfg.max_echo} if echo == "auto" else {})),
                       workers=cfg.workers, seed=seed)
    fresh = steps = 0
    wall = 0.0
    next_eval = cfg.eval_every
    curve = []
    reached = None
    try:
        ring.start()
    finally:
        os.unlink(pause)
    # The clock runs from the first batch's arrival (worker start-up is not training
    # time) and stops, with the upstream, while the model is evaluated.
    t0 = None
    try:
        with ring:
            while reached is None and fresh < cfg.max_fresh:
                for batch in ring:
                    t_step = time.perf_counter()
                    if t0 is None:
                        t0 = t_step
                    x = to_tensor(batch.images).to(dev)
                    y = torch.from_numpy(np.asarray(batch.labels, dtype=np.int64)).to(dev)
                    fresh += int(np.count_nonzero(batch.fresh))
                    opt.zero_grad()
                    losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
                    losses.mean().backward()
                    opt.step()
                    ring.report(losses)  # echo="auto" learns from it; a fixed e ignores it
                    if cfg.min_step_ms:
                        _pad_step(t_step, cfg.min_step_ms)
                    steps += 1
                    if fresh >= next_eval or fresh >= cfg.max_fresh:
                        open(pause, "w").close()
                        wall += time.perf_counter() - t0
                        acc = evaluate(model, test_x, test_y)
                        curve.append((fresh, wall, steps, acc))
                        if log:
                            log(f"  e={echo} {placement} {augment} seed={seed}: {fresh} fresh, "
                                f"{wall:.1f} s, acc {acc:.4f}")
                        next_eval = (fresh // cfg.eval_every + 1) * cfg.eval_every
                        if acc >= cfg.target:
                            reached = (fresh, wall, steps, acc)
                            break
                        if fresh >= cfg.max_fresh:
                            break
                        os.unlink(pause)
                        t0 = time.perf_counter()
            st = ring.stats()
            if os.path.exists(pause):  # paused workers must see the stop request at once
                os.unlink(pause)
    finally:
        if os.path.exists(pause):
            os.unlink(pause)
    return {"echo": echo, "placement": placement if echo != 1 else "none", "seed": seed,
            "augment": augment,
            "reached": reached is not None,
            "fresh_to_target": reached[0] if reached else None,
            "wall_to_target_s": reached[1] if reached else None,
            "steps_to_target": reached[2] if reached else None,
            "final_acc": curve[-1][3] if curve else None,
            "fresh": fresh, "steps": steps, "wall_s": wall,
            "effective_echo": st["effective_echo"], "stall_s": st["stall_s"],
            "final_echo": st["echo_factor"], "echo_trace": st["echo_trace"],
            "echo_loss_ratio": st["echo_loss_ratio"],
            "curve": curve}


def _pad_step(started, min_ms):
    left = min_ms / 1000.0 - (time.perf_counter() - started)
    if left > 0:
        time.sleep(left)


def _mean_std(values):
    a = np.asarray(values, dtype=float)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def summarize(runs):
    """Per (echo, placement, augment): mean/std over seeds of fresh and wall to
    target; the ratios are against e = 1 with the same augmentation."""
    groups = {}
    for r in runs:
        groups.setdefault((r["echo"], r["placement"], r.get("augment", "basic")), []).append(r)
    rows = []
    for (e, p, aug), rs in groups.items():
        base = groups.get((1, "none", aug))
        base_fresh = base_wall = None
        if base and all(r["reached"] for r in base):
            base_fresh = _mean_std([r["fresh_to_target"] for r in base])[0]
            base_wall = _mean_std([r["wall_to_target_s"] for r in base])[0]
        ok = [r for r in rs if r["reached"]]
        row = {"echo": e, "placement": p, "augment": aug, "seeds": len(rs),
               "reached": len(ok)}
        if len(ok) == len(rs):
            row["fresh_mean"], row["fresh_std"] = _mean_std([r["fresh_to_target"] for r in ok])
            row["wall_mean"], row["wall_std"] = _mean_std([r["wall_to_target_s"] for r in ok])
            row["steps_mean"] = _mean_std([r["steps_to_target"] for r in ok])[0]
            row["fresh_reduction"] = base_fresh / row["fresh_mean"] if base_fresh else None
            row["wall_speedup"] = base_wall / row["wall_mean"] if base_wall else None
        rows.append(row)
    order = {"none": 0, "before_augment": 1, "after_augment": 2, "batch": 3}
    rows.sort(key=lambda r: (AUGMENTS.index(r["augment"]) if r["augment"] in AUGMENTS else 9,
                             order.get(r["placement"], 9), _echo_key(r["echo"])))
    return rows


def _echo_key(e):
    return math.inf if e == "auto" else float(e)


def markdown_table(rows, target):
    head = ("echo", "placement", "reached", f"fresh examples to {target:.0%}",
            "x fewer fresh", "wall s to target", "x faster", "steps")
    augs = len({r.get("augment", "basic") for r in rows}) > 1
    if augs:
        head = ("augment",) + head
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "fresh_mean" in r:
            fr = f"{r['fresh_mean']:,.0f} ± {r['fresh_std']:,.0f}"
            wa = f"{r['wall_mean']:.1f} ± {r['wall_std']:.1f}"
            red = f"{r['fresh_reduction']:.2f}" if r["fresh_reduction"] else "-"
            sp = f"{r['wall_speedup']:.2f}" if r["wall_speedup"] else "-"
            steps = f"{r['steps_mean']:,.0f}"
        else:
            fr = wa = "not reached"
            red = sp = steps = "-"
        lines.append(("| " + r["augment"] + " " if augs else "") +
                     f"| {r['echo']} | {r['placement']} | {r['reached']}/{r['seeds']} | {fr} | "
                     f"{red} | {wa} | {sp} | {steps} |")
    return "\n".join(lines)


def chart(rows, runs, path, target):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    done = [r for r in rows if "fresh_mean" in r]
    augs = len({r.get("augment", "basic") for r in done}) > 1
    names = {"none": "no echo", "before_augment": "before aug", "after_augment": "after aug",
             "batch": "batch"}
    labels = [f"e={r['echo']} {names.get(r['placement'], r['placement'])}"
              + (f", {r['augment']}" if augs else "") for r in done]
    colors = {"none": "grey", "before_augment": "tab:green", "after_augment": "tab:blue",
              "batch": "tab:orange"}
    c = [colors.get(r["placement"], "k") for r in done]
    x = np.arange(len(done))
    axes[0].bar(x, [r["fresh_mean"] for r in done], yerr=[r["fresh_std"] for r in done],
                color=c, capsize=3)
    axes[0].set_xticks(x)
    axes[0].set_xticklabels(labels, rotation=40, ha="right", fontsize=8)
    axes[0].set_ylabel(f"fresh examples to {target:.0%} test accuracy")
    axes[0].set_title("mean ± std over seeds (lower is better)", fontsize=9)
    for r in runs:
        if r["curve"]:
            f, _, _, a = zip(*r["curve"])
            axes[1].plot(f, a, color=colors.get(r["placement"], "k"),
                         alpha=0.6, lw=1, ls="-" if r["echo"] in (1, 4) else "--")
    axes[1].axhline(target, color="k", lw=0.8)
    axes[1].set_xlabel("fresh examples")
    axes[1].set_ylabel("test accuracy")
    axes[1].set_title("every run's test accuracy", fontsize=9)
    shown = list(dict.fromkeys(r["placement"] for r in runs))
    handles = [Line2D([], [], color=colors.get(p, "k"), label=names.get(p, p)) for p in shown]
    handles += [Line2D([], [], color="k", ls="-", label="e = 1 or 4"),
                Line2D([], [], color="k", ls="--", label="e = 2"),
                Line2D([], [], color="k", lw=0.8, label=f"target {target:.0%}")]
    axes[1].legend(handles=handles, fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def run_demo(cfg: DemoConfig, log=None):
    """Runs every setting; returns the report dict (also written to ``cfg.out_json``)."""
    import torch

    import echo_native as en

    log = log or (lambda s: None)
    torch.set_num_threads(cfg.threads)
    train = en.ImageFolder(os.path.join(cfg.data, "train"))
    test = en.ImageFolder(os.path.join(cfg.data, "test"))
    if cfg.train_subset and cfg.train_subset < len(train):
        idx = np.sort(np.random.default_rng(0).permutation(len(train))[:cfg.train_subset])
    else:
        idx = None
    n_train = len(train) if idx is None else len(idx)
    if n_train < cfg.batch_size:
        raise ValueError(f"{n_train} training images, fewer than the batch size "
                         f"{cfg.batch_size}")
    test_x, test_y = load_test_set(test, cfg.image_size, cfg.test_limit)
    test_x = test_x.to(cfg.device)
    step_s = cfg.step_s if cfg.step_s is not None else measure_step(
        cfg.batch_size, cfg.image_size, cfg.lr, device=cfg.device)
    step_s = max(step_s, cfg.min_step_ms / 1000.0)
    # t_up per batch = R * t_down: each of `workers` processes sleeps per sample.
    delay = cfg.R * step_s * cfg.workers / cfg.batch_size
    pause_dir = tempfile.mkdtemp(prefix="echo_native_demo_")
    src = ThrottledSource(train, delay, idx, os.path.join(pause_dir, "pause"))
    up = measure_upstream(src, cfg.batch_size, cfg.image_size, cfg.workers,
                              seconds=cfg.upstream_s)
    # Decode and bookkeeping add to the sleeps, and how much depends on the load:
    # move the sleep by what is missing until t_up is within 5% of R x step (3 tries).
    for _ in range(3):
        missing = cfg.R * step_s - cfg.batch_size / up
        if abs(missing) <= 0.05 * cfg.R * step_s:
            break
        sleep = max(0.0, delay * cfg.batch_size / cfg.workers + missing)
        src.delay_s = delay = sleep * cfg.workers / cfg.batch_size
        up = measure_upstream(src, cfg.batch_size, cfg.image_size, cfg.workers,
                              seconds=cfg.upstream_s)
    measured_R = (cfg.batch_size / up) / step_s
    log(f"train step {step_s * 1000:.1f} ms/batch of {cfg.batch_size}; throttled upstream "
        f"{up:,.0f} img/s -> measured R = {measured_R:.2f} (asked {cfg.R})")
    runs = []
    settings = [(1, "none")] + [(e, p) for e in cfg.echo if e != 1 for p in cfg.placements]
    settings = list(dict.fromkeys(settings))
    t_all = time.perf_counter()
    try:
        for seed in range(cfg.first_seed, cfg.first_seed + cfg.seeds):
            for aug, (e, p) in ((a, s) for a in cfg.augments for s in settings):
                runs.append(train_one(src, test_x, test_y, cfg, e,
                                      "after_augment" if e == 1 else p, seed, log, aug))
                r = runs[-1]
                log(f"e={e} {r['placement']} {aug} seed={seed}: "
                    + (f"{r['fresh_to_target']} fresh, {r['wall_to_target_s']:.1f} s"
                       if r["reached"] else f"not reached (final acc {r['final_acc']:.3f})"))
    finally:
        try:
            os.rmdir(pause_dir)
        except OSError:
            pass
    rows = summarize(runs)
    report = {
        "config": {k: v for k, v in vars(cfg).items() if k != "extra"},
        "train_images": n_train, "test_images": len(test_x),
        "step_ms": step_s * 1000, "upstream_img_per_s": up, "measured_R": measured_R,
        "total_s": time.perf_counter() - t_all, "rows": rows, "runs": runs,
    }
    report["table"] = markdown_table(rows, cfg.target)
    with open(cfg.out_json, "w") as f:
        json.dump(report, f, indent=2, default=str)
    report["chart"] = cfg.out_chart if chart(rows, runs, cfg.out_chart, cfg.target) else None
    return report


# -- the auto-echo sweep -------------------------------------------------------------------
def run_sweep(cfg: DemoConfig, Rs, log=None):
    """The demo at each upstream ratio in ``Rs`` (one placement, the echo factors of
    ``cfg.echo``, which may include "auto"); returns the sweep report (also written to
    ``cfg.out_json``) with, per R, the wall time to target of every setting and how
    auto compares with the best fixed e and with e = 1."""
    log = log or (lambda s: None)
    base_json, base_chart = cfg.out_json, cfg.out_chart
    stem = os.path.splitext(base_json)[0]
    per_R = []
    t_all = time.perf_counter()
    for R in Rs:
        log(f"== R = {R:g}")
        one = DemoConfig(**{**vars(cfg), "R": float(R), "out_json": f"{stem}-R{R:g}.json",
                            "out_chart": os.devnull})
        rep = run_demo(one, log=log)
        rows = rep["rows"]
        per_R.append({"R": float(R), "measured_R": rep["measured_R"], "step_ms": rep["step_ms"],
                      "rows": rows, "verdict": auto_verdict(rows)})
    report = {"config": {k: v for k, v in vars(cfg).items() if k != "extra"},
              "Rs": [float(r) for r in Rs], "per_R": per_R,
              "total_s": time.perf_counter() - t_all}
    report["table"] = sweep_table(per_R, cfg.target)
    with open(base_json, "w") as f:
        json.dump(report, f, indent=2, default=str)
    report["chart"] = base_chart if sweep_chart(per_R, base_chart, cfg.target) else None
    return report


def auto_verdict(rows):
    """Auto's mean wall time to target against the best fixed e and against e = 1."""
    wall = {r["echo"]: r.get("wall_mean") for r in rows}
    fixed = {e: w for e, w in wall.items() if e != "auto" and w is not None}
    verdict = {"auto_wall": wall.get("auto"), "best_fixed_echo": None, "best_fixed_wall": None,
               "auto_vs_best": None, "auto_vs_e1": None}
    if fixed:
        best = min(fixed, key=fixed.get)
        verdict.update(best_fixed_echo=best, best_fixed_wall=fixed[best])
        if verdict["auto_wall"]:
            verdict["auto_vs_best"] = verdict["auto_wall"] / fixed[best]
            if 1 in fixed:
                verdict["auto_vs_e1"] = verdict["auto_wall"] / fixed[1]
    return verdict


def sweep_table(per_R, target):
    """Markdown: one row per R, wall seconds to target (mean ± std) per e, auto last."""
    echoes = []
    for block in per_R:
        for r in block["rows"]:
            if r["echo"] not in echoes:
                echoes.append(r["echo"])
    echoes.sort(key=_echo_key)
    head = ["R (measured)"] + [f"e = {e}" for e in echoes] + ["auto / best fixed",
                                                             "auto / e = 1"]
    lines = [f"Wall seconds of training to {target:.0%} test accuracy (mean ± std over seeds)",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for block in per_R:
        by_e = {r["echo"]: r for r in block["rows"]}
        cells = [f"{block['R']:g} ({block['measured_R']:.2f})"]
        for e in echoes:
            r = by_e.get(e)
            if r is None:
                cells.append("-")
            elif "wall_mean" in r:
                cells.append(f"{r['wall_mean']:.1f} ± {r['wall_std']:.1f}")
            else:
                cells.append(f"not reached ({r['reached']}/{r['seeds']})")
        v = block["verdict"]
        cells.append(f"{v['auto_vs_best']:.2f} (best e = {v['best_fixed_echo']})"
                     if v["auto_vs_best"] else "-")
        cells.append(f"{v['auto_vs_e1']:.2f}" if v["auto_vs_e1"] else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_chart(per_R, path, target):
    """Wall time to target against fixed e, one line per R, auto marked on each."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, block in enumerate(per_R):
        c = colors[k % len(colors)]
        fixed = sorted((float(r["echo"]), r["wall_mean"], r["wall_std"]) for r in block["rows"]
                       if r["echo"] != "auto" and "wall_mean" in r)
        if fixed:
            e, w, s = zip(*fixed)
            ax.errorbar(e, w, yerr=s, color=c, marker="o", capsize=3,
                        label=f"fixed e, R = {block['R']:g}")
        auto = next((r for r in block["rows"] if r["echo"] == "auto" and "wall_mean" in r), None)
        if auto:
            ax.axhline(auto["wall_mean"], color=c, ls="--", lw=1)
            ax.plot([], [], color=c, ls="--", label=f'echo="auto", R = {block["R"]:g}')
    ax.set_xlabel("echo factor e")
    ax.set_ylabel(f"wall seconds of training to {target:.0%} accuracy")
    ax.set_title("lower is better; dashed: auto", fontsize=9)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True

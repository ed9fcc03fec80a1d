"""The language-model echo demo: a next-token model on the Python standard library's own
sources, read and tokenized by a slow pure-Python upstream, echoed by ``EchoLoader``.

The corpus is every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` (sorted by
path, without ``site-packages``, the test suites and caches; every tenth file held
out for evaluation), so it is on any machine with Python.  The upstream is a torch
``DataLoader`` whose worker process cuts the training text into windows in a seeded
order and tokenizes each byte in pure Python (a byte vocabulary: tab, newline,
printable ASCII, one id for anything else).  Each token also costs ``rounds`` rounds
of an FNV-1a hash whose value travels with its row as a checksum: real CPU work, not
a sleep, and ``rounds`` is calibrated at the start so that the upstream's time per
batch is ``R`` (3) times the model's training step.  That loader is wrapped in
``EchoLoader`` with each echo setting, and a small character GRU is trained on the
CPU until its loss on a fixed held-out set reaches a target.  Per setting and seed
the demo reports the **fresh tokens** (tokens the model saw for the first time) and
the **wall time** (training only: evaluation pauses the clock and the tokenizer) it
took.

Run it with ``echo-native-lab lm-demo`` (see ``echo-native-lab lm-demo --help``).
"""
from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import os
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

__all__ = [
    "VOCAB",
    "CharGRU",
    "Corpus",
    "LMConfig",
    "SlowTokens",
    "calibrate",
    "load_corpus",
    "markdown_table",
    "measure_step",
    "run_lm_demo",
    "summarize",
    "tokenize",
    "train_one",
]

# The byte vocabulary: 0 is never produced, 1 stands for any byte outside CHARS.
CHARS = bytes([9, 10]) + bytes(range(32, 127))
UNK = 1
VOCAB = 2 + len(CHARS)
_LUT = [UNK] * 256
for _i, _c in enumerate(CHARS):
    _LUT[_c] = _i + 2
_LUT_NP = np.asarray(_LUT, np.int64)
FNV_OFFSET, FNV_PRIME, MASK32 = 0x811C9DC5, 0x01000193, 0xFFFFFFFF
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
# A paused tokenizer (the model is being evaluated) that is not resumed in this long is
# an abandoned run: its worker gives up rather than wait for ever.
PAUSE_LIMIT_S = 600.0


@dataclass
class LMConfig:
    echo: tuple = (1, 2, 4, "auto")
    placements: tuple = ("batch", "after_augment")
    seeds: int = 3
    first_seed: int = 0
    R: float = 3.0
    target: float = 1.6                # held-out cross-entropy, nats per token
    max_fresh_tokens: int = 600_000    # budget of fresh tokens per run
    eval_every: int | None = None      # fresh tokens between evaluations (8 batches)
    corpus_bytes: int = 4_000_000      # training text read from the standard library
    eval_windows: int = 512
    batch_size: int = 32
    seq_len: int = 32                  # tokens predicted per row (rows hold seq_len + 1)
    embed: int = 64
    hidden: int = 128
    lr: float = 3e-3
    max_echo: float = 4.0              # echo="auto"'s cap
    workers: int = 1                   # tokenizer processes (0: in the training process)
    threads: int = 1                   # torch threads of the training process
    rounds: int | None = None          # hash rounds per token; calibrated when None
    step_s: float | None = None        # measured when None
    calibrate_s: float = 1.0           # seconds of upstream measured per calibration try
    stdlib: str | None = None          # the sources' folder (default: this Python's)
    out_json: str | None = None

    @property
    def row_tokens(self):
        return self.seq_len + 1

    @property
    def batch_tokens(self):
        return self.batch_size * self.row_tokens

    def every(self):
        return self.eval_every or 8 * self.batch_tokens


# -- the corpus ---------------------------------------------------------------------------
@dataclass
class Corpus:
    root: str
    train: bytes
    held: bytes
    files: int
    held_files: int


def source_files(root):
    """The ``.py`` files below ``root``, sorted by their path relative to it, without
    third-party packages, test suites and caches."""
    root = Path(root)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        out += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(limit_bytes, root=None):
    """The standard library's sources in path order until ``limit_bytes`` of training
    text (and at least one held-out file) are read; every tenth file (the 10th, 20th,
    ...) is the held-out text."""
    root = root or sysconfig.get_paths()["stdlib"]
    files = source_files(root)
    if not files:
        raise FileNotFoundError(f"no .py files under {root} (the standard library's folder)")
    train, held = [], []
    size = n_held = 0
    for k, path in enumerate(files):
        data = path.read_bytes()
        if k % 10 == 9:
            held.append(data)
            n_held += 1
        else:
            train.append(data)
            size += len(data)
        if size >= limit_bytes and n_held:
            break
    train_b = b"".join(train)[:limit_bytes]
    return Corpus(str(root), train_b, b"".join(held), k + 1, n_held)


# -- the slow tokenizer -------------------------------------------------------------------
def tokenize(raw, rounds):
    """Token ids of ``raw`` (bytes) and their checksum: per byte a table look-up, then
    ``rounds`` rounds of FNV-1a over its id, all in pure Python."""
    lut, h, ids = _LUT, FNV_OFFSET, []
    for b in raw:
        t = lut[b]
        ids.append(t)
        for _ in range(rounds):
            h = ((h ^ t) * FNV_PRIME) & MASK32
    return ids, h


def checksum(ids, rounds):
    """The checksum :func:`tokenize` gives the row ``ids`` (to check a row arrived whole)."""
    h = FNV_OFFSET
    for t in ids:
        for _ in range(rounds):
            h = ((h ^ int(t)) * FNV_PRIME) & MASK32
    return h


def fast_tokens(raw):
    """The same ids as :func:`tokenize`, at NumPy's speed (for the held-out set)."""
    return _LUT_NP[np.frombuffer(raw, np.uint8)]


class SlowTokens(IterableDataset):
    """Batches ``{"tokens": (B, seq_len + 1) int64, "check": (B,) int64}`` of windows of
    the training text in a seeded order (one per seed and epoch), each tokenized by
    :func:`tokenize`.  With several workers each makes every W-th batch (the loader
    interleaves them back into order).  ``go``: an event that, while clear, pauses
    tokenizing between rows; ``made``: a shared counter of the tokens produced."""

    def __init__(self, raw, seq_len, batch_size, seed, rounds, go=None, made=None):
        self.raw, self.row, self.batch_size = raw, seq_len + 1, batch_size
        self.seed, self.rounds, self.go, self.made = seed, rounds, go, made
        self.epoch = 0
        if self.windows < batch_size:
            raise ValueError(f"the training text ({len(raw):,} bytes) holds "
                             f"{self.windows} rows of {self.row} tokens, fewer than one "
                             f"batch ({batch_size})")

    @property
    def windows(self):
        return len(self.raw) // self.row

    @property
    def batches_per_epoch(self):
        return self.windows // self.batch_size

    def set_epoch(self, epoch):
        self.epoch = int(epoch)

    def __iter__(self):
        info = get_worker_info()
        me, every = (info.id, info.num_workers) if info is not None else (0, 1)
        order = np.random.default_rng((self.seed, self.epoch)).permutation(self.windows)
        B, L = self.batch_size, self.row
        for k in range(me, self.batches_per_epoch, every):
            rows, checks = [], []
            for w in order[k * B:(k + 1) * B]:
                self._wait()
                ids, h = tokenize(self.raw[w * L:(w + 1) * L], self.rounds)
                rows.append(ids)
                checks.append(h)
            if self.made is not None:
                with self.made.get_lock():
                    self.made.value += B * L
            yield {"tokens": torch.tensor(rows, dtype=torch.int64),
                   "check": torch.tensor(checks, dtype=torch.int64)}

    def _wait(self):
        if self.go is not None and not self.go.is_set() and not self.go.wait(PAUSE_LIMIT_S):
            raise TimeoutError(f"the tokenizer was paused for over {PAUSE_LIMIT_S:.0f} s")


def _context():
    # The pause event and the token counter reach the workers by inheritance.
    return multiprocessing.get_context("fork")


def make_loader(ds, workers):
    if workers == 0:
        return DataLoader(ds, batch_size=None)
    # One batch in flight per worker: while the model is evaluated the tokenizer pauses
    # and no finished batches pile up to give the clock a head start.
    return DataLoader(ds, batch_size=None, num_workers=workers, prefetch_factor=1,
                      multiprocessing_context=_context())


# -- the model ----------------------------------------------------------------------------
class CharGRU(nn.Module):
    """Embedding, one GRU layer, a linear read-out: next-token logits per position."""

    def __init__(self, vocab=VOCAB, embed=64, hidden=128):
        super().__init__()
        self.emb = nn.Embedding(vocab, embed)
        self.rnn = nn.GRU(embed, hidden, batch_first=True)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x):
        y, _ = self.rnn(self.emb(x))
        return self.out(y)


@contextlib.contextmanager
def torch_threads(n):
    """torch's intra-op threads set to ``n`` for a block (a step of this small model is
    slower on more threads than one core, and far slower on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_model(seed, cfg):
    torch.manual_seed(seed)
    return CharGRU(VOCAB, cfg.embed, cfg.hidden)


def lm_loss(model, tokens, reduction="mean"):
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1),
                                       reduction=reduction)


def evaluate(model, held, chunk=256):
    """Mean cross-entropy (nats per token) over the held-out rows."""
    model.eval()
    total = 0.0
    with torch.inference_mode():
        for s in range(0, len(held), chunk):
            part = held[s:s + chunk]
            total += float(lm_loss(model, part, "sum"))
    model.train()
    return total / (len(held) * (held.shape[1] - 1))


def held_out(corpus, cfg):
    """``eval_windows`` rows of the held-out text at fixed places (the same every run)."""
    toks = fast_tokens(corpus.held)
    L = cfg.row_tokens
    if len(toks) < L:
        raise ValueError(f"the held-out text ({len(toks)} tokens) is shorter than one row")
    starts = np.random.default_rng(12345).integers(0, len(toks) - L + 1, cfg.eval_windows)
    return torch.from_numpy(np.stack([toks[s:s + L] for s in starts]))


def measure_step(cfg, steps=20, warmup=5):
    """Seconds per training step of the model on a random batch."""
    with torch_threads(cfg.threads):
        return _measure_step(cfg, steps, warmup)


def _measure_step(cfg, steps, warmup):
    model = make_model(0, cfg)
    opt = torch.optim.Adam(model.parameters(), cfg.lr)
    x = torch.randint(2, VOCAB, (cfg.batch_size, cfg.row_tokens))
    for i in range(warmup + steps):
        if i == warmup:
            t0 = time.perf_counter()
        opt.zero_grad()
        lm_loss(model, x).backward()
        opt.step()
    return (time.perf_counter() - t0) / steps


# -- calibration --------------------------------------------------------------------------
def token_cost(raw, rounds, reps=3):
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        tokenize(raw, rounds)
        best = min(best, time.perf_counter() - t0)
    return best / len(raw)


def upstream_time(corpus, cfg, rounds, seconds):
    """Seconds per batch of the tokenizing loader alone (after its first batch)."""
    ds = SlowTokens(corpus.train, cfg.seq_len, cfg.batch_size, 999, rounds)
    it = iter(make_loader(ds, cfg.workers))
    try:
        next(it)
        t0, n = time.perf_counter(), 0
        for _ in it:
            n += 1
            if time.perf_counter() - t0 >= seconds and n >= 3:
                break
        return (time.perf_counter() - t0) / n
    finally:
        del it


def calibrate(corpus, cfg, step_s, log=None):
    """Hash rounds per token such that the loader's time per batch is R x ``step_s``:
    a first guess from the tokenizer's cost per token at two round counts, then up to
    three corrections from the whole loader's measured time.  Returns (rounds,
    seconds per batch)."""
    log = log or (lambda s: None)
    want = cfg.R * step_s * max(1, cfg.workers)        # per batch, in one worker
    sample = corpus.train[:64 * cfg.row_tokens]
    lo, hi = token_cost(sample, 1), token_cost(sample, 201)
    per_round = max((hi - lo) / 200, 1e-9)
    base = max(lo - per_round, 0.0)
    rounds = max(1, round((want / cfg.batch_tokens - base) / per_round))
    t_up = None
    for _ in range(3):
        t_up = upstream_time(corpus, cfg, rounds, cfg.calibrate_s)
        log(f"  calibration: {rounds} rounds per token -> {t_up * 1000:.1f} ms per batch "
            f"(want {cfg.R * step_s * 1000:.1f})")
        goal = cfg.R * step_s
        if abs(t_up - goal) <= 0.05 * goal:
            break
        rounds = max(1, round(rounds * goal / t_up))
    else:
        t_up = upstream_time(corpus, cfg, rounds, cfg.calibrate_s)
    return rounds, t_up


# -- one run ------------------------------------------------------------------------------
def echo_spec(echo, placement, cfg):
    import echo_native as en

    if echo == 1:
        return 1
    if echo == "auto":
        return en.Echo("auto", placement=placement, max_echo=cfg.max_echo)
    return en.Echo(float(echo), placement=placement)


def train_one(corpus, held, cfg, echo, placement, seed, rounds, log=None):
    """One training run until the held-out loss reaches ``cfg.target`` or the budget of
    fresh tokens is spent; returns a dict (``*_to_target`` are None when not reached)."""
    with torch_threads(cfg.threads):
        return _train_one(corpus, held, cfg, echo, placement, seed, rounds, log)


def _train_one(corpus, held, cfg, echo, placement, seed, rounds, log):
    import echo_native as en

    ctx = _context()
    go, made = ctx.Event(), ctx.Value("q", 0)
    ds = SlowTokens(corpus.train, cfg.seq_len, cfg.batch_size, seed, rounds, go, made)
    model = make_model(seed, cfg)
    opt = torch.optim.Adam(model.parameters(), cfg.lr)
    el = en.EchoLoader(make_loader(ds, cfg.workers), echo=echo_spec(echo, placement, cfg),
                       seed=seed, with_info=True)
    every, L = cfg.every(), cfg.row_tokens
    fresh = delivered = steps = 0
    wall, t0, next_eval, epoch = 0.0, None, every, 0
    curve, reached = [], None
    go.set()
    try:
        while reached is None and fresh < cfg.max_fresh_tokens:
            el.set_epoch(epoch)
            got = False
            # The clock runs from the first batch's arrival (worker start-up is not
            # training) and stops, with the tokenizer, while the model is evaluated.
            for batch, info in el:
                got = True
                now = time.perf_counter()
                t0 = now if t0 is None else t0
                fresh += int(np.count_nonzero(info["fresh"])) * L
                delivered += len(info["fresh"]) * L
                opt.zero_grad()
                lm_loss(model, batch["tokens"]).backward()
                opt.step()
                steps += 1
                if fresh >= next_eval or fresh >= cfg.max_fresh_tokens:
                    go.clear()
                    wall += time.perf_counter() - t0
                    loss = evaluate(model, held)
                    curve.append((fresh, round(wall, 4), steps, round(loss, 5)))
                    if log:
                        log(f"    e={echo} {placement} seed={seed}: {fresh:,} fresh tokens, "
                            f"{wall:.1f} s, held-out loss {loss:.3f}")
                    next_eval = (fresh // every + 1) * every
                    if loss <= cfg.target:
                        reached = curve[-1]
                    if reached or fresh >= cfg.max_fresh_tokens:
                        break
                    go.set()
                    t0 = time.perf_counter()
            if not got:
                raise RuntimeError("the tokenizing loader yielded no batch")
            epoch += 1
        st = el.stats()
    finally:
        go.set()   # a paused worker must see the loader's stop at once
        el.close()
    return {"echo": echo, "placement": placement if echo != 1 else "none", "seed": seed,
            "reached": reached is not None,
            "fresh_tokens_to_target": reached[0] if reached else None,
            "wall_to_target_s": reached[1] if reached else None,
            "steps_to_target": reached[2] if reached else None,
            "final_loss": curve[-1][3] if curve else None,
            "fresh_tokens": fresh, "delivered_tokens": delivered,
            "upstream_tokens": int(made.value), "steps": steps, "wall_s": wall,
            "epochs": epoch,   # epochs begun (the last one may have been cut short)
            "effective_echo": delivered / fresh if fresh else 0.0,
            "final_echo": st.get("echo_factor"), "estimated_R": st.get("estimated_R"),
            "curve": curve}


# -- the whole demo -----------------------------------------------------------------------
def settings(cfg):
    """(echo, placement) of every run: e = 1 once, each other e in each placement,
    "auto" with example placement (after augmentation)."""
    out = [(1, "none")]
    for e in cfg.echo:
        if e == "auto":
            out.append(("auto", "after_augment"))
        elif e != 1:
            out += [(e, p) for p in cfg.placements]
    return list(dict.fromkeys(out))


def run_lm_demo(cfg: LMConfig, log=None):
    """Every setting for every seed (settings interleaved within a seed); returns the
    report dict (also written to ``cfg.out_json`` when set)."""
    log = log or (lambda s: None)
    t_all, busy0 = time.perf_counter(), _busy_s()
    corpus = load_corpus(cfg.corpus_bytes, cfg.stdlib)
    held = held_out(corpus, cfg)
    step_s = cfg.step_s if cfg.step_s is not None else measure_step(cfg)
    if cfg.rounds is None:
        rounds, t_up = calibrate(corpus, cfg, step_s, log)
    else:
        rounds, t_up = cfg.rounds, upstream_time(corpus, cfg, cfg.rounds, cfg.calibrate_s)
    log(f"train step {step_s * 1000:.1f} ms; tokenizer {rounds} rounds per token, "
        f"{t_up * 1000:.1f} ms per batch -> measured R = {t_up / step_s:.2f} (asked {cfg.R:g})")
    runs = []
    for seed in range(cfg.first_seed, cfg.first_seed + cfg.seeds):
        for e, p in settings(cfg):
            r = train_one(corpus, held, cfg, e, p, seed, rounds, log)
            runs.append(r)
            log(f"e={e} {r['placement']} seed={seed}: " +
                (f"{r['fresh_tokens_to_target']:,} fresh tokens, {r['wall_to_target_s']:.1f} s"
                 if r["reached"] else f"not reached (final loss {r['final_loss']:.3f})"))
    rows = summarize(runs)
    e1 = [r["estimated_R"] for r in runs if r["echo"] == 1 and r["estimated_R"] is not None]
    wall, busy1 = time.perf_counter() - t_all, _busy_s()
    # Other processes' CPU during the run, in cores: wall times are only as good as this.
    other = (max(0.0, (busy1[0] - busy0[0]) - (busy1[1] - busy0[1])) / wall
             if busy0 and busy1 else None)
    report = {
        "config": {k: v for k, v in vars(cfg).items()},
        "corpus": {"root": corpus.root, "files": corpus.files, "held_out_files":
                   corpus.held_files, "train_bytes": len(corpus.train),
                   "held_out_rows": len(held)},
        "step_ms": step_s * 1000, "rounds": rounds, "upstream_ms": t_up * 1000,
        "measured_R": t_up / step_s,
        "in_run_R": float(np.median(e1)) if e1 else None,
        "total_s": wall, "other_cores_avg": other, "rows": rows, "runs": runs,
    }
    report["table"] = markdown_table(rows, cfg.target)
    if cfg.out_json:
        with open(cfg.out_json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return report


def _busy_s():
    """CPU seconds the machine has been busy (Linux /proc/stat), and this process's with
    its reaped children's (the loaders' workers, reaped at the end of each run)."""
    import resource

    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    own = sum(getattr(resource.getrusage(who), k) for who in
              (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) for k in ("ru_utime", "ru_stime"))
    return (sum(fields[:8]) - fields[3] - fields[4]) / tick, own


def _spread(values):
    a = np.asarray(values, float)
    return float(a.mean()), float(a.min()), float(a.max())


def summarize(runs):
    """Per (echo, placement): mean and min-max over seeds of fresh tokens and wall time to
    target (when every seed reached it), and their ratios to e = 1's means."""
    groups = {}
    for r in runs:
        groups.setdefault((r["echo"], r["placement"]), []).append(r)
    base = groups.get((1, "none"), [])
    base_ok = bool(base) and all(r["reached"] for r in base)
    rows = []
    for (e, p), rs in groups.items():
        ok = [r for r in rs if r["reached"]]
        row = {"echo": e, "placement": p, "seeds": len(rs), "reached": len(ok),
               "effective_echo": float(np.mean([r["effective_echo"] for r in rs]))}
        if e == "auto":
            row["final_echo"] = float(np.mean([r["final_echo"] or 0 for r in rs]))
        if ok and len(ok) == len(rs):
            row["fresh_mean"], row["fresh_min"], row["fresh_max"] = _spread(
                [r["fresh_tokens_to_target"] for r in ok])
            row["wall_mean"], row["wall_min"], row["wall_max"] = _spread(
                [r["wall_to_target_s"] for r in ok])
            row["steps_mean"] = float(np.mean([r["steps_to_target"] for r in ok]))
            if base_ok:
                row["fresh_reduction"] = _spread([r["fresh_tokens_to_target"]
                                                  for r in base])[0] / row["fresh_mean"]
                row["wall_speedup"] = _spread([r["wall_to_target_s"]
                                               for r in base])[0] / row["wall_mean"]
        rows.append(row)
    order = {"none": 0, "batch": 1, "after_augment": 2}
    rows.sort(key=lambda r: (r["echo"] == "auto", order.get(r["placement"], 9),
                             0 if r["echo"] == "auto" else float(r["echo"])))
    return rows


def markdown_table(rows, target):
    head = ("echo", "placement", "reached", f"fresh tokens to loss {target:g}",
            "x fewer fresh", "wall s to target", "x faster", "steps", "delivered / fresh")
    lines = ["| " + " | ".join(head) + " |", "|---|---|---|" + "---:|" * (len(head) - 3)]
    for r in rows:
        if "fresh_mean" in r:
            fr = f"{r['fresh_mean']:,.0f} ({r['fresh_min']:,.0f}-{r['fresh_max']:,.0f})"
            wa = f"{r['wall_mean']:.1f} ({r['wall_min']:.1f}-{r['wall_max']:.1f})"
            red = f"{r['fresh_reduction']:.2f}" if r.get("fresh_reduction") else "-"
            sp = f"{r['wall_speedup']:.2f}" if r.get("wall_speedup") else "-"
            steps = f"{r['steps_mean']:,.0f}"
        else:
            fr = wa = "not reached by every seed"
            red = sp = steps = "-"
        eff = f"{r['effective_echo']:.2f}"
        if r["echo"] == "auto":
            eff += f" (final e {r['final_echo']:.2f})"
        lines.append(f"| {r['echo']} | {r['placement']} | {r['reached']}/{r['seeds']} | {fr} | "
                     f"{red} | {wa} | {sp} | {steps} | {eff} |")
    return "\n".join(lines)

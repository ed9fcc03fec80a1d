"""EchoLoader around a torch DataLoader: what the wrapper costs, and what echo buys when the
loader is the bottleneck.  Peers side by side in one run, interleaved.

    python -m pytest benchmarks/bench_echo_loader.py --benchmark-only -s

overhead     a torch ``DataLoader`` (2 worker processes, shuffled, batch 64) over a
             map-style dataset of dicts (a 3x32x32 float32 array drawn from each
             item's own NumPy generator, a label, a name string), null consumer:
             the loader alone against the same loader wrapped in
             ``EchoLoader(echo=1)``.  Target: wrapped / alone >= 0.98.
loader-bound a ``DataLoader`` with 1 worker process over a map-style dataset whose
             items are windows of the Python standard library's sources tokenized by
             :func:`echo_native.lab.lm_demo.tokenize` (pure Python, real per-token
             work: its hash rounds are set at the start so that a batch takes R = 3
             times the consumer's step); the consumer trains the LM demo's GRU one
             step per batch (1 torch thread: real work on the other core, not a
             sleep).  The loader alone, wrapped with echo=1, and wrapped with
             ``Echo(2, placement="after_augment")`` and ``placement="batch"``.
             Target: echo=2 delivered / loader alone >= 1.9.

Each round runs one epoch of every peer, the order rotated from round to round (after
one untimed warm-up epoch of each), so a slow spell of a shared machine hits them all
alike; the workers are persistent, so no epoch pays for their start.  Rates are
delivered examples per second of an epoch; each row reports the median and min-max
over the rounds, and ratios are paired by round (median, min-max).  Results go to
``benchmarks/results/echo_loader.json``.

Environment: ECHO_NATIVE_EL_ROUNDS (timed epochs per peer, default 7),
ECHO_NATIVE_EL_N (overhead: items, default 16384), ECHO_NATIVE_EL_LM_N (loader-bound:
windows, default 2048), ECHO_NATIVE_EL_R (loader-bound: upstream / step, default 3).
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import pytest
from benchenv import env_int, load_mark, load_since

import echo_native as en

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset

from echo_native.lab import lm_demo

RESULTS = Path(__file__).resolve().parent / "results" / "echo_loader.json"
ROUNDS = env_int("ECHO_NATIVE_EL_ROUNDS", 7)
N = env_int("ECHO_NATIVE_EL_N", 16384)
LM_N = env_int("ECHO_NATIVE_EL_LM_N", 2048)
R_TARGET = float(env_int("ECHO_NATIVE_EL_R", 3))
BATCH, LM_BATCH, SEQ = 64, 32, 32

_results = {}


class Records(Dataset):
    """Map-style dicts: an array made by NumPy from the item's own generator, a label, a
    name (a string leaf EchoLoader carries along its rows)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        img = np.random.default_rng(i).standard_normal((3, 32, 32), dtype=np.float32)
        return {"x": torch.from_numpy(img), "y": i % 10, "name": f"record-{i}"}


class Windows(Dataset):
    """Map-style windows of source text, each tokenized in pure Python on read."""

    def __init__(self, raw, n, rounds):
        self.raw, self.n, self.rounds, self.row = raw, n, rounds, SEQ + 1
        assert len(raw) >= n * self.row, "the standard library's text is too short"

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids, h = lm_demo.tokenize(self.raw[i * self.row:(i + 1) * self.row], self.rounds)
        return {"tokens": torch.tensor(ids), "check": h, "id": i}


def _loader(ds, batch, workers, seed=0):
    return DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                      persistent_workers=True, generator=torch.Generator().manual_seed(seed))


def _rows(batch):
    return len(batch["y"] if "y" in batch else batch["id"])


def interleaved_rates(peers, rounds, consume=None, cpu=None):
    """{name: [delivered examples/s per round]}: one epoch of every peer per round, the
    order rotated each round, after one untimed epoch of each.  ``cpu``, a dict, gets
    each peer's CPU milliseconds per batch in this process (the workers are others):
    the wrapper's own cost, free of the wall clock's noise."""
    names = list(peers)
    cpu = {} if cpu is None else cpu

    def epoch(name, k):
        it = peers[name]
        if isinstance(it, en.EchoLoader):
            it.set_epoch(k)
        t0, c0, n, batches = time.perf_counter(), time.process_time(), 0, 0
        for b in it:
            if consume is not None:
                consume(b)
            n += _rows(b)
            batches += 1
        wall = time.perf_counter() - t0
        if k:
            cpu.setdefault(name, []).append(1000 * (time.process_time() - c0) / batches)
        return n / wall

    for name in names:
        epoch(name, 0)
    rates = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            rates[name].append(epoch(name, r + 1))
    return rates


def _summary(values):
    return {"median": float(np.median(values)), "min": float(min(values)),
            "max": float(max(values))}


def _report(title, rates, pairs, extra):
    ratios = {f"{a}/{b}": _summary([x / y for x, y in zip(rates[a], rates[b])])
              for a, b in pairs}
    out = {"rates": {k: _summary(v) for k, v in rates.items()}, "ratios": ratios,
           "rounds": len(next(iter(rates.values()))), **extra}
    print(f"\n{title}")
    for name, s in out["rates"].items():
        print(f"  {name:22s} {s['median']:9,.0f} examples/s (min-max {s['min']:,.0f}-"
              f"{s['max']:,.0f})")
    for name, s in ratios.items():
        print(f"  {name:34s} median {s['median']:.3f}  min-max {s['min']:.3f}-{s['max']:.3f}")
    if "load" in extra:
        print(f"  other processes used {extra['load']['other_cores_avg']:.2f} cores meanwhile")
    return out


@pytest.fixture(scope="module", autouse=True)
def results_file():
    yield
    if _results:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        doc = {"settings": {"rounds": ROUNDS, "cpus": len(os.sched_getaffinity(0)),
                            "machine": platform.machine(),
                            "python": platform.python_version(), "torch": torch.__version__,
                            "echo_native": en.__version__},
               "targets": {"overhead": "echo1/loader >= 0.98",
                           "loader_bound": "echo2/loader >= 1.9"},
               **_results}
        tmp = RESULTS.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=2))
        os.replace(tmp, RESULTS)


@pytest.mark.benchmark(group="echo-loader")
def test_overhead(benchmark):
    """A DataLoader with 2 workers alone and wrapped in EchoLoader(echo=1), null consumer."""
    alone = _loader(Records(N), BATCH, 2)
    wrapped = en.EchoLoader(_loader(Records(N), BATCH, 2), echo=1)
    mark, cpu = load_mark(), {}
    try:
        rates = interleaved_rates({"loader": alone, "echo1": wrapped}, ROUNDS, cpu=cpu)
    finally:
        wrapped.close()
    ms = {k: float(np.median(v)) for k, v in cpu.items()}
    # The wrapper's CPU per batch as a share of the loader's time per batch: what it
    # takes from the cores the workers need, without the wall clock's noise.
    share = (ms["echo1"] - ms["loader"]) / (1000 * BATCH / float(np.median(rates["loader"])))
    out = _report(f"overhead: {N} dict items, batch {BATCH}, 2 workers, null consumer",
                  rates, [("echo1", "loader")], {"items": N, "batch": BATCH, "workers": 2,
                                                 "main_cpu_ms_per_batch": ms,
                                                 "echo1_cpu_share": share,
                                                 "load": load_since(mark)})
    print(f"  main-process CPU per batch: loader {ms['loader']:.3f} ms, echo1 "
          f"{ms['echo1']:.3f} ms: {share:.1%} of the loader's time per batch")
    _results["overhead"] = out
    benchmark.extra_info.update(out)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


def _gru_step():
    cfg = lm_demo.LMConfig(batch_size=LM_BATCH, seq_len=SEQ)
    model = lm_demo.make_model(0, cfg)
    opt = torch.optim.Adam(model.parameters(), cfg.lr)

    def step(batch):
        opt.zero_grad()
        lm_demo.lm_loss(model, batch["tokens"]).backward()
        opt.step()
    return step


@pytest.mark.benchmark(group="echo-loader")
def test_loader_bound(benchmark):
    """A tokenizing DataLoader (1 worker) R = 3 times slower per batch than a GRU training
    step: alone, and wrapped with echo = 1 and 2 (example and batch placement)."""
    raw = lm_demo.load_corpus(LM_N * (SEQ + 1)).train
    with lm_demo.torch_threads(1):
        step = _gru_step()
        probe = {"tokens": torch.randint(2, lm_demo.VOCAB, (LM_BATCH, SEQ + 1))}
        for _ in range(5):
            step(probe)
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            step(probe)
            times.append(time.perf_counter() - t0)
        t_step = float(np.median(times))
        # Hash rounds per token for R x t_step per batch, from the tokenizer's cost here.
        sample = raw[:64 * (SEQ + 1)]
        per_tok = [lm_demo.token_cost(sample, r) for r in (1, 201)]
        per_round = (per_tok[1] - per_tok[0]) / 200
        want = R_TARGET * t_step / (LM_BATCH * (SEQ + 1))
        rounds = max(1, round((want - per_tok[0]) / per_round) + 1)
        loaders = [_loader(Windows(raw, LM_N, rounds), LM_BATCH, 1, seed=k) for k in range(4)]
        peers = {"loader": loaders[0],
                 "echo1": en.EchoLoader(loaders[1], echo=1),
                 "echo2_after_augment": en.EchoLoader(
                     loaders[2], echo=en.Echo(2.0, placement="after_augment")),
                 "echo2_batch": en.EchoLoader(loaders[3], echo=en.Echo(2.0, placement="batch"))}
        mark = load_mark()
        try:
            rates = interleaved_rates(peers, ROUNDS, consume=step)
            effective = {k: v.stats()["effective_echo"] for k, v in peers.items()
                         if isinstance(v, en.EchoLoader)}
        finally:
            for v in peers.values():
                if isinstance(v, en.EchoLoader):
                    v.close()
    alone = rates["loader"]
    measured_R = float(np.median([1.0 / (r / LM_BATCH) / t_step for r in alone]))
    out = _report(f"loader-bound: {LM_N} windows of {SEQ + 1} tokens, batch {LM_BATCH}, "
                  f"1 worker, GRU step {t_step * 1000:.1f} ms, {rounds} hash rounds per token, "
                  f"measured R = {measured_R:.2f}", rates,
                  [("echo1", "loader"), ("echo2_after_augment", "loader"),
                   ("echo2_batch", "loader")],
                  {"windows": LM_N, "batch": LM_BATCH, "workers": 1, "step_ms": t_step * 1000,
                   "rounds": rounds, "measured_R": measured_R, "effective_echo": effective,
                   "load": load_since(mark)})
    _results["loader_bound"] = out
    benchmark.extra_info.update(out)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)

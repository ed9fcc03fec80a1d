"""The language-model echo demo (``echo-native-lab lm-demo``) on tiny settings (seconds).

What is checked: the tokenizer's ids and checksums, the corpus's split and cap, that
the tokens the demo counts as fresh are exactly the tokens its upstream produced and
that it delivers e times as many, that rows arrive whole through ``EchoLoader``, that
a run is a pure function of its seed, the table's arithmetic, and the command line.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cli_helpers import cli_error

import echo_native as en
from echo_native.lab import lm_demo as lm
from echo_native.lab.cli import main

RUN_KEYS = {"echo", "placement", "seed", "reached", "fresh_tokens_to_target",
            "wall_to_target_s", "steps_to_target", "final_loss", "fresh_tokens",
            "delivered_tokens", "upstream_tokens", "steps", "wall_s", "epochs",
            "effective_echo", "final_echo", "estimated_R", "curve"}


def tiny(**kw):
    """A config whose runs take a fraction of a second: 8 x 9-token rows, a 16-wide GRU."""
    base = {"seeds": 1, "corpus_bytes": 9 * 8 * 12, "batch_size": 8, "seq_len": 8, "embed": 8,
            "hidden": 16, "eval_every": 9 * 8 * 3, "eval_windows": 16, "target": 0.0,
            "workers": 0, "rounds": 2}
    return lm.LMConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def corpus():
    return lm.load_corpus(9 * 8 * 12)


def test_the_slow_tokenizer_gives_the_fast_ids_and_a_checksum_of_them():
    """tokenize() is the byte table look-up (non-ASCII bytes are UNK) and its checksum
    is the one checksum() recomputes from the ids, different for other ids."""
    raw = "def f(x):\n\treturn x  # é\n".encode()
    ids, h = lm.tokenize(raw, 5)
    assert ids == lm.fast_tokens(raw).tolist()
    assert ids.count(lm.UNK) == 2 and min(ids) >= 1 and max(ids) < lm.VOCAB
    assert lm.checksum(ids, 5) == h
    assert lm.checksum(ids[:-1] + [ids[-1] + 1], 5) != h
    assert lm.tokenize(raw, 6)[1] != h


def test_the_corpus_is_sorted_capped_and_holds_out_every_tenth_file(tmp_path):
    """Files in path order, test suites and site-packages skipped, files 10, 20, ...
    held out, the training text cut at the cap, read on to one held-out file at least."""
    for k in range(25):
        (tmp_path / f"m{k:02d}.py").write_bytes(bytes([65 + k]) * 10)
    for skipped in ("test", "site-packages", "__pycache__"):
        (tmp_path / skipped).mkdir()
        (tmp_path / skipped / "x.py").write_bytes(b"!" * 10)
    (tmp_path / "notes.txt").write_bytes(b"?" * 10)
    c = lm.load_corpus(10_000, tmp_path)
    held = [k for k in range(25) if k % 10 == 9]
    assert c.files == 25 and c.held_files == 2
    assert c.held == b"".join(bytes([65 + k]) * 10 for k in held)
    assert c.train == b"".join(bytes([65 + k]) * 10 for k in range(25) if k not in held)
    capped = lm.load_corpus(35, tmp_path)
    assert capped.train == c.train[:35] and capped.files == 10 and capped.held_files == 1
    with pytest.raises(FileNotFoundError, match="no .py files"):
        lm.load_corpus(100, tmp_path / "test" / "none")


def test_the_standard_library_corpus_is_deterministic(corpus):
    """Two reads of the standard library give the same text; held-out text exists."""
    again = lm.load_corpus(9 * 8 * 12)
    assert again.train == corpus.train and again.held == corpus.held
    assert len(corpus.train) == 9 * 8 * 12 and corpus.held


@pytest.mark.parametrize("e,placement", [(1, "none"), (2, "after_augment"), (2, "batch"),
                                         (3, "after_augment")])
def test_fresh_tokens_are_what_the_upstream_made_and_delivered_is_e_times(corpus, e,
                                                                          placement):
    """With a budget of exactly one epoch the fresh tokens the demo counts equal the
    tokens its tokenizer made (nothing lost or counted twice), and the delivered
    tokens are e times that, short at most of the repeats still in the echo buffer."""
    cfg = tiny()
    ds = lm.SlowTokens(corpus.train, cfg.seq_len, cfg.batch_size, 0, cfg.rounds)
    epoch = ds.batches_per_epoch * cfg.batch_tokens
    cfg.max_fresh_tokens = epoch
    held = lm.held_out(corpus, cfg)
    r = lm.train_one(corpus, held, cfg, e, placement, 0, cfg.rounds)
    assert set(r) == RUN_KEYS
    assert r["fresh_tokens"] == r["upstream_tokens"] == epoch
    assert not r["reached"] and r["epochs"] == 1 and r["curve"][-1][0] == epoch
    buffered = 4 * cfg.batch_tokens * e
    assert e * epoch - buffered <= r["delivered_tokens"] <= e * epoch
    if e == 1:
        assert r["steps"] == ds.batches_per_epoch and r["effective_echo"] == 1.0


def test_a_run_spans_epochs_and_the_tokenizer_runs_in_a_worker(corpus):
    """A budget of two and a half epochs runs three epochs through a worker process; the
    tokenizer made every fresh token the model saw, and more only in batches the echo
    stage had not emitted yet."""
    cfg = tiny(workers=1)
    ds = lm.SlowTokens(corpus.train, cfg.seq_len, cfg.batch_size, 0, cfg.rounds)
    epoch = ds.batches_per_epoch * cfg.batch_tokens
    cfg.max_fresh_tokens = 2 * epoch + epoch // 2
    r = lm.train_one(corpus, lm.held_out(corpus, cfg), cfg, 2, "after_augment", 0, cfg.rounds)
    assert r["epochs"] == 3 and r["fresh_tokens"] >= cfg.max_fresh_tokens
    assert r["fresh_tokens"] <= r["upstream_tokens"] <= r["fresh_tokens"] + 5 * cfg.batch_tokens


def test_rows_arrive_whole_through_echo_loader(corpus):
    """Every row the EchoLoader hands over (fresh or a repeat, from a worker process)
    carries the checksum of its own tokens."""
    cfg = tiny()
    ds = lm.SlowTokens(corpus.train, cfg.seq_len, cfg.batch_size, 3, 4)
    el = en.EchoLoader(lm.make_loader(ds, 1), echo=en.Echo(2.0, placement="after_augment"),
                       seed=3, with_info=True)
    rows = repeats = 0
    try:
        for batch, info in el:
            for toks, check in zip(batch["tokens"].tolist(), batch["check"].tolist()):
                assert lm.checksum(toks, 4) == check
            rows += len(info["fresh"])
            repeats += int(np.count_nonzero(~np.asarray(info["fresh"])))
    finally:
        el.close()
    assert rows == 2 * ds.batches_per_epoch * cfg.batch_size and repeats == rows // 2


def test_a_run_is_a_pure_function_of_its_seed(corpus):
    """The same seed gives the same fresh tokens, steps and losses at every evaluation;
    another seed gives other losses."""
    cfg = tiny(max_fresh_tokens=9 * 8 * 9)
    held = lm.held_out(corpus, cfg)

    def curve(seed):
        r = lm.train_one(corpus, held, cfg, 2, "batch", seed, cfg.rounds)
        return [(f, s, loss) for f, _, s, loss in r["curve"]]

    a = curve(5)
    assert len(a) == 3 and a == curve(5)
    assert [x[2] for x in curve(6)] != [x[2] for x in a]


def test_the_target_stops_a_run_at_the_first_evaluation_below_it(corpus):
    """A run stops at the first held-out loss at or below the target and reports the
    fresh tokens, wall time and steps of that evaluation."""
    cfg = tiny(max_fresh_tokens=9 * 8 * 9)
    held = lm.held_out(corpus, cfg)
    losses = [c[3] for c in lm.train_one(corpus, held, cfg, 1, "none", 0, 2)["curve"]]
    cfg.target = losses[1] + 1e-5   # the curve's losses are rounded to 5 decimals
    r = lm.train_one(corpus, held, cfg, 1, "none", 0, 2)
    k = next(i for i, v in enumerate(losses) if v <= cfg.target)
    assert r["reached"] and len(r["curve"]) == k + 1
    assert (r["fresh_tokens_to_target"], r["wall_to_target_s"], r["steps_to_target"]) == \
        tuple(r["curve"][k][:3])


def _run(echo, placement, seed, fresh, wall, reached=True):
    return {"echo": echo, "placement": placement, "seed": seed, "reached": reached,
            "fresh_tokens_to_target": fresh if reached else None,
            "wall_to_target_s": wall if reached else None,
            "steps_to_target": fresh // 100 if reached else None,
            "effective_echo": 1.0 if echo == 1 else 2.0, "final_echo": 3.0}


def test_the_summary_gives_means_spreads_and_ratios_to_e1():
    """Means and min-max over seeds, ratios of e = 1's means to each row's, and a row
    some seed did not finish is marked, not averaged."""
    runs = [_run(1, "none", 0, 1000, 10.0), _run(1, "none", 1, 3000, 30.0),
            _run(2, "batch", 0, 500, 8.0), _run(2, "batch", 1, 1500, 12.0),
            _run("auto", "after_augment", 0, 800, 9.0),
            _run("auto", "after_augment", 1, 0, 0.0, reached=False)]
    rows = {(r["echo"], r["placement"]): r for r in lm.summarize(runs)}
    assert [k for k in rows] == [(1, "none"), (2, "batch"), ("auto", "after_augment")]
    two = rows[(2, "batch")]
    assert (two["fresh_mean"], two["fresh_min"], two["fresh_max"]) == (1000, 500, 1500)
    assert two["fresh_reduction"] == pytest.approx(2.0)
    assert two["wall_speedup"] == pytest.approx(2.0)
    auto = rows[("auto", "after_augment")]
    assert auto["reached"] == 1 and "fresh_mean" not in auto
    table = lm.markdown_table(lm.summarize(runs), 1.6)
    assert "| 2 | batch | 2/2 | 1,000 (500-1,500) | 2.00 | 10.0 (8.0-12.0) | 2.00 |" in table
    assert "| auto | after_augment | 1/2 | not reached by every seed |" in table


# ---- the command line -------------------------------------------------------------------
def test_the_command_runs_every_setting_and_writes_its_report(tmp_path, capsys):
    """`echo-native-lab lm-demo --quick`: a table row and JSON rows for e = 1 and for
    each other e in each placement, a run per setting and seed, every run reaching the
    quick target, and the measured R reported."""
    out = tmp_path / "lm.json"
    rc = main(["lm-demo", "--quick", "--quiet", "--rounds", "2", "--echo", "1,2,auto",
               "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    for line in ("| 1 | none | 1/1 |", "| 2 | batch | 1/1 |", "| 2 | after_augment | 1/1 |",
                 "| auto | after_augment | 1/1 |"):
        assert line in text
    assert "measured R = " in text
    rep = json.loads(out.read_text())
    assert {(r["echo"], r["placement"]) for r in rep["rows"]} == {
        (1, "none"), (2, "batch"), (2, "after_augment"), ("auto", "after_augment")}
    assert len(rep["runs"]) == 4 and all(r["reached"] for r in rep["runs"])
    assert rep["rounds"] == 2 and rep["measured_R"] > 0
    for r in rep["runs"]:
        assert r["fresh_tokens"] <= r["upstream_tokens"]
        assert r["delivered_tokens"] >= r["fresh_tokens"]


@pytest.mark.parametrize("argv,needle", [
    (["--placements", "before_augment"], "--placements"),
    (["--echo", "0.5"], "--echo"),
    (["--target", "0"], "--target"),
    (["--seeds", "0"], "--seeds"),
    (["--stdlib", "/nonexistent/folder"], "--stdlib"),
])
def test_bad_options_are_one_line_errors(argv, needle, capsys):
    """Each bad option is one error line naming it, before anything runs."""
    cli_error(main, "echo-native-lab", capsys, ["lm-demo", "--quick", *argv], needle)


def test_a_folder_without_sources_is_a_one_line_error(tmp_path, capsys):
    """--stdlib pointing at a folder with no .py file says so in one line."""
    cli_error(main, "echo-native-lab", capsys,
              ["lm-demo", "--quick", "--rounds", "1", "--stdlib", str(tmp_path)],
              "no .py files")

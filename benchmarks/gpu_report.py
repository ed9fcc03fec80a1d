"""gpu_check.json from what benchmarks/gpu_check.sh has done so far.

    python3 benchmarks/gpu_report.py OUT

gpu_check.sh runs this after every step, so the report on disk always holds every
step that ended: a device call killed at its limit leaves the figures measured
before.  Reads (environment): GPU_CHECK_STEPS (one line per step ended: name, exit
status, seconds, limit), GPU_CHECK_PLAN (the steps in order), GPU_CHECK_BUDGET,
GPU_CHECK_WORK (the benchmarks' JSON, bench_<step>.json), GPU_CHECK_FINAL (set for
the last report).  Writes OUT/gpu_check.json and OUT/gpu_bench.json (the benchmarks'
JSON merged).
"""
from __future__ import annotations

import glob
import json
import os
import re
import sys

# The checks issue 32 asks a GPU to make, by the test that makes each.
NAMED = {
    "kernels compile with the installed extra": "test_kernels_compile_with_the_installed_toolkit",
    "CuPy's NVRTC options are the tests'": "test_the_nvrtc_options_are_cupys",
    "bit-equality with the host build": "test_gpu_kernels_equal_the_host_build_bit_for_bit",
    "on_batch results": "test_on_batch_runs_after_the_batch_on_the_gpu",
    "torch and JAX by DLPack on the device": "test_torch_and_jax_take_batches_on_the_gpu",
    "memfd ring registered (cudaHostRegister)": "test_the_memfd_ring_is_page_locked",
}


def verdict(rc):
    if rc is None:
        return "NOT RUN"
    return {0: "PASS", 124: "TIMEOUT", 137: "TIMEOUT", 125: "NOT RUN (no time left)"}.get(
        rc, "FAIL")


def read_steps(path):
    steps = {}
    try:
        lines = open(path).read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split("\t")
        if len(parts) == 4:
            name, rc, seconds, limit = parts
            steps[name] = {"exit": int(rc), "seconds": int(seconds), "limit_s": int(limit)}
    return steps


def read_text(path):
    try:
        return open(path, errors="replace").read()
    except OSError:
        return ""


def figures_of(bench, printed):
    """The design card's figures: from the benchmarks' JSON, else (a step killed before
    pytest-benchmark wrote it) from the lines the benchmarks printed."""
    figures = {}
    for b in bench:
        info, name = b.get("extra_info", {}), b["name"]
        if name.startswith("test_h2d_bandwidth"):
            figures["h2d"] = {k: info.get(k) for k in ("peak_pinned_GBps", "registered_GBps",
                                                       "registered_to_peak", "staged_GBps",
                                                       "staged_to_peak")}
        elif name.startswith("test_gpu_reaugmentation_with_ops_rate"):
            figures["reaugment_224_with_ops_img_s"] = info.get("images_per_s")
        elif name.startswith("test_gpu_reaugmentation_rate"):
            figures["reaugment_224_img_s"] = info.get("images_per_s")
        elif name.startswith("test_delivered_rate["):
            figures.setdefault("delivered_img_s", {})[name[len("test_delivered_rate["):-1]] = {
                "img_s": info.get("images_per_s"), "vs_e1": info.get("vs_e1")}
    number = r"([\d,]+(?:\.\d+)?)"
    if "h2d" not in figures:
        m = re.search(rf"H2D: pinned peak {number} GB/s; registered ring {number} GB/s", printed)
        if m:
            peak, reg = (float(g.replace(",", "")) for g in m.groups())
            figures["h2d"] = {"peak_pinned_GBps": peak, "registered_GBps": reg,
                              "registered_to_peak": reg / peak if peak else None,
                              "from": "printed"}
    if "reaugment_224_img_s" not in figures:
        m = re.search(rf"GPU re-augmentation: {number} img/s", printed)
        if m:
            figures["reaugment_224_img_s"] = float(m.group(1).replace(",", ""))
    if "reaugment_224_with_ops_img_s" not in figures:
        m = re.search(rf"GPU re-augmentation with all ops: {number} img/s", printed)
        if m:
            figures["reaugment_224_with_ops_img_s"] = float(m.group(1).replace(",", ""))
    for placement, echo, rate in re.findall(rf"^(\w+) e=(\d+): {number} img/s delivered",
                                            printed, re.M):
        key = f"{placement}-{echo}"
        figures.setdefault("delivered_img_s", {}).setdefault(
            key, {"img_s": float(rate.replace(",", "")), "from": "printed"})
    return figures


def main(out):
    plan = os.environ.get("GPU_CHECK_PLAN", "").split()
    steps = read_steps(os.environ.get("GPU_CHECK_STEPS", ""))
    work = os.environ.get("GPU_CHECK_WORK", "")
    bench = []
    for path in sorted(glob.glob(os.path.join(work, "bench_*.json"))):
        try:
            bench += json.load(open(path))["benchmarks"]
        except (OSError, ValueError, KeyError):
            pass
    if bench:
        json.dump({"benchmarks": bench}, open(os.path.join(out, "gpu_bench.json"), "w"),
                  indent=1)
    tests = read_text(os.path.join(out, "gpu_tests.txt"))
    checks = {}
    for what, test in NAMED.items():
        got = set(re.findall(rf"^(PASSED|FAILED|ERROR|SKIPPED)\S* .*{test}\b", tests, re.M))
        checks[what] = ("FAIL" if got & {"FAILED", "ERROR"} else "PASS" if "PASSED" in got
                        else "SKIP" if got else "NOT RUN (or skipped)")
    toolkit = steps.get("toolkit")
    if toolkit is not None:
        # The extra's own venv is the check: the test of the same name uses whatever CuPy
        # the machine has.
        checks["kernels compile with the installed extra"] = verdict(toolkit["exit"])
    figures = figures_of(bench, read_text(os.path.join(out, "gpu_bench.txt")))
    targets = {  # what the design card asks of a GPU: (measured, at least)
        "H2D from the registered ring >= 80% of pinned peak":
            ((figures.get("h2d") or {}).get("registered_to_peak"), 0.8),
        "re-augmentation >= 50,000 img/s at 224": (figures.get("reaugment_224_img_s"), 50_000),
        "with every op >= 30,000 img/s at 224":
            (figures.get("reaugment_224_with_ops_img_s"), 30_000),
    }
    target_status = {what: "NOT MEASURED" if value is None else
                     "PASS" if value >= want else "FAIL"
                     for what, (value, want) in targets.items()}
    order = plan + [name for name in steps if name not in plan]
    step_list = [{"name": name, "status": verdict(steps.get(name, {}).get("exit")),
                  **steps.get(name, {})} for name in order]
    report = {
        "complete": bool(os.environ.get("GPU_CHECK_FINAL")),
        "budget_s": int(os.environ.get("GPU_CHECK_BUDGET", "0") or 0),
        "elapsed_s": sum(s.get("seconds", 0) for s in steps.values()),
        "steps": step_list,
        "sections": {s["name"]: s["status"] for s in step_list},
        "checks": checks, "targets": target_status, "figures": figures,
    }
    tmp = os.path.join(out, "gpu_check.json.tmp")
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2)
    os.replace(tmp, os.path.join(out, "gpu_check.json"))  # never half a report on disk
    if report["complete"]:
        for group in (report["sections"], checks, target_status):
            for what, v in group.items():
                print(f"{v:>24}  {what}")
        print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])

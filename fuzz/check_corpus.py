#!/usr/bin/env python3
"""Decode every file of a hostile corpus through every public entry point; report as JSON.

``python fuzz/check_corpus.py CORPUS_DIR [--json OUT]`` (run it in a child
process: a crash kills only the child and its exit status says so).  For each
file it records, per entry point, ``ok``/the exception type and message and the
wall time, the strict decode's difference from Pillow's decode (when Pillow
decodes the file), and the growth of the process's peak RSS.  The exit status is
0 when no call raised anything but DecodeError/ValueError/TypeError and every
file met its manifest expectation; the verdicts are in the JSON either way.
"""
from __future__ import annotations

import faulthandler
import json
import os
import resource
import sys
import time

import numpy as np

faulthandler.enable()

_HERE = os.path.dirname(os.path.abspath(__file__))
_TESTS = os.path.join(os.path.dirname(_HERE), "tests")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

import echo_native as en  # noqa: E402

ALLOWED = (en.DecodeError, ValueError, TypeError)
MAX_DIFF = 1          # strict decode vs Pillow, per channel
MAX_MEAN_DIFF = 0.5


def _rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def calls(data):
    return {
        "decode": lambda: en.decode(data),
        "decode_lenient": lambda: en.decode(data, strict=False),
        "image_size": lambda: en.image_size(data),
        "decode_crop": lambda: en.decode_crop(data, (3, 5, 40, 50), (16, 24), flip=True),
        "decode_crop_lenient": lambda: en.decode_crop(data, (0, 0, 9.5, 7.25), (5, 3),
                                                      strict=False),
        "decode_canvas": lambda: en.decode_canvas(data, 16),
        "decode_center_crop": lambda: en.decode_center_crop(data, 8),
        "decode_random_crop": lambda: en.decode_random_crop(data, (12, 12), 1, 2, 3),
    }


def pillow_reference(data):
    import jpegs as conftest
    try:
        return conftest.pil_decode(data)
    except Exception:
        return None


def check_file(name, data, expect):
    rec = {"expect": expect, "calls": {}, "problems": []}
    results = {}
    for cname, fn in calls(data).items():
        # CPU time of this thread (the decode runs in it): what a hostile file costs,
        # whatever else the machine is doing.
        t0 = time.thread_time()
        try:
            val = fn()
            outcome = "ok"
        except ALLOWED as e:
            val, outcome = None, f"{type(e).__name__}: {e}"[:200]
        except BaseException as e:   # anything else is a bug
            val, outcome = None, f"CRASH {type(e).__name__}: {e}"[:300]
            rec["problems"].append(f"{cname} raised {outcome}")
        dt = time.thread_time() - t0
        rec["calls"][cname] = [outcome, round(dt, 4)]
        results[cname] = val
    img = results["decode"]
    if img is not None:
        if not (img.ndim == 3 and img.shape[2] == 3 and img.dtype == np.uint8):
            rec["problems"].append(f"decode returned {img.dtype} {img.shape}")
        ref = pillow_reference(data)
        if ref is not None:
            if ref.shape != img.shape:
                rec["problems"].append(f"shape {img.shape} != Pillow {ref.shape}")
            else:
                d = np.abs(img.astype(np.int16) - ref.astype(np.int16))
                rec["pillow_diff"] = [int(d.max()), round(float(d.mean()), 4)]
                if d.max() > MAX_DIFF or d.mean() > MAX_MEAN_DIFF:
                    rec["problems"].append(f"differs from Pillow: max {d.max()} mean "
                                           f"{d.mean():.3f}")
        else:
            rec["pillow_diff"] = None
    for cname in ("decode_lenient", "decode_canvas"):
        v = results[cname]
        v = v[0] if isinstance(v, tuple) else v
        if v is not None and not (v.ndim == 3 and v.shape[2] == 3 and v.dtype == np.uint8):
            rec["problems"].append(f"{cname} returned {v.dtype} {v.shape}")
    if expect == "error" and img is not None:
        rec["problems"].append("expected DecodeError, strict decode returned an image")
    if expect == "image" and img is None:
        rec["problems"].append(f"expected an image, got {rec['calls']['decode'][0]}")
    return rec


def run(corpus_dir, only=None):
    with open(os.path.join(corpus_dir, "manifest.json")) as f:
        manifest = json.load(f)
    # Warm up (imports, first decoder, Pillow plugins) before taking the RSS baseline.
    import jpegs as conftest
    warm = conftest.pil_jpeg(conftest.fit(conftest.photo("chelsea"), 64, 96), 85)
    for fn in calls(warm).values():
        fn()
    pillow_reference(warm)
    base_rss = _rss_mb()
    report = {"files": {}, "rss_baseline_mb": round(base_rss, 1)}
    for name in sorted(manifest):
        if only and not any(s in name for s in only):
            continue
        with open(os.path.join(corpus_dir, name), "rb") as f:
            data = f.read()
        rec = check_file(name, data, manifest[name]["expect"])
        rec["rss_growth_mb"] = round(_rss_mb() - base_rss, 1)
        report["files"][name] = rec
    report["rss_growth_mb"] = round(_rss_mb() - base_rss, 1)
    return report


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("corpus")
    ap.add_argument("--json", help="write the full report here")
    ap.add_argument("--only", nargs="*", help="substrings of file names to check")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    report = run(a.corpus, a.only)
    report["wall_s"] = round(time.perf_counter() - t0, 2)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    bad = {n: r["problems"] for n, r in report["files"].items() if r["problems"]}
    slowest = max(((max(t for _, t in r["calls"].values()), n)
                   for n, r in report["files"].items()), default=(0, ""))
    print(f"{len(report['files'])} files in {report['wall_s']} s; slowest call {slowest[0]:.3f} s "
          f"({slowest[1]}); peak RSS growth {report['rss_growth_mb']} MiB; "
          f"{len(bad)} with problems")
    for n, p in sorted(bad.items())[:50]:
        print(f"  {n}: {'; '.join(p)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Summarise a kernel benchmark run as a Markdown table of images/s and ratios.

    python -m pytest benchmarks/bench_kernel.py --benchmark-json=/tmp/kernel.json -q
    python benchmarks/report.py /tmp/kernel.json

Throughput is images per pass divided by the time of a pass (every benchmark
makes the same passes over the same preloaded corpus).  Ratios are taken
between benchmarks of the same run; both the best round (least disturbed by
other load on a shared machine) and the median round are shown.
"""
from __future__ import annotations

import argparse
import json
import sys

# role -> (row label when the run has none, order)
ROLES = {
    "fused": "fused kernel (Decoder.decode_random_crop)",
    "fused_crop": "fused kernel, boxes given (Decoder.decode_crop)",
    "fused_api": "public en.decode_random_crop(out=...)",
    "ceiling": "libjpeg-turbo ROI decode only (C, same crops)",
    "pillow": "torchvision-style Pillow, no draft",
    "pillow_draft": "torchvision-style Pillow + draft",
    # what the two rows above are called when the installed PIL is Pillow-SIMD
    "pillow_simd": "torchvision-style Pillow-SIMD, no draft",
    "pillow_simd_draft": "torchvision-style Pillow-SIMD + draft",
}

# (numerator, denominator, label, target or None)
RATIOS = (
    ("fused", "ceiling", "fused / libjpeg-turbo ROI-decode ceiling", 0.85),
    ("fused", "pillow", "fused / Pillow without draft", 2.5),
    ("fused", "pillow_draft", "fused / Pillow with draft", None),
    ("fused", "pillow_simd", "fused / Pillow-SIMD without draft", None),
    ("fused", "pillow_simd_draft", "fused / Pillow-SIMD with draft", None),
    ("fused_crop", "ceiling", "decode_crop / ceiling", 0.85),
    ("fused_crop", "pillow", "decode_crop / Pillow without draft", 2.5),
)


def _role(bench):
    extra = bench.get("extra_info") or {}
    if extra.get("role"):
        return extra["role"]
    name = bench.get("name", "").split("[")[0]
    return name[len("test_"):] if name.startswith("test_") else name


def load(path):
    with open(path) as f:
        doc = json.load(f)
    rows = {}
    for b in doc.get("benchmarks", []):
        extra = b.get("extra_info") or {}
        if "interleaved" in extra:
            doc["interleaved"] = extra["interleaved"]
            continue
        images = extra.get("images")
        if not images:
            continue
        st = b["stats"]
        rows[_role(b)] = {
            "label": extra.get("label") or ROLES.get(_role(b), b["name"]),
            "images": images,
            "best": images / st["min"],
            "median": images / st["median"],
            "rounds": st["rounds"],
            "pil": extra.get("pil"),
            "corpus": extra.get("corpus"),
        }
    return doc, rows


def render(doc, rows):
    if not rows:
        return "No kernel benchmarks with an image count found in this file."
    order = [r for r in ROLES if r in rows] + [r for r in rows if r not in ROLES]
    any_row = next(iter(rows.values()))
    mi = doc.get("machine_info", {})
    cpu = (mi.get("cpu") or {}).get("brand_raw") or mi.get("processor") or "?"
    lines = [
        f"Kernel benchmark, one thread, {any_row['images']} images per pass, "
        f"{any_row['rounds']} timed passes each; output 224x224 RandomResizedCrop + flip.",
        f"CPU: {cpu}; Python {mi.get('python_version', '?')}; corpus: {any_row['corpus']}",
        "",
        "| pipeline | img/s (best pass) | img/s (median pass) |",
        "|---|---:|---:|",
    ]
    for r in order:
        row = rows[r]
        lines.append(f"| {row['label']} | {row['best']:,.0f} | {row['median']:,.0f} |")
    if not {"pillow_simd", "pillow_simd_draft"} & set(rows):
        pil = next((row["pil"] for row in rows.values() if row.get("pil")), None)
        lines.append("")
        lines.append(f"Pillow-SIMD: not installed{f' (PIL is {pil})' if pil else ''}; "
                     "no Pillow-SIMD row (README: Pillow-SIMD).")
    lines += ["", "| ratio | best | median | target | |", "|---|---:|---:|---:|---|"]
    for num, den, label, target in RATIOS:
        if num not in rows or den not in rows:
            continue
        best = rows[num]["best"] / rows[den]["best"]
        med = rows[num]["median"] / rows[den]["median"]
        if target is None:
            lines.append(f"| {label} | {best:.2f} | {med:.2f} | - | |")
        else:
            ok = "met" if min(best, med) >= target else (
                "met (best pass only)" if best >= target else "**missed**")
            lines.append(f"| {label} | {best:.2f} | {med:.2f} | >= {target:g} | {ok} |")
    return "\n".join(lines)


def render_interleaved(run):
    """The interleaved run: paired ratios (median, best, worst round) and the stages."""
    pil = f"; PIL is {run['pil']}" if run.get("pil") else ""
    lines = ["", f"Interleaved: {run['images']} images x {run['rounds']} rounds, every pipeline "
             f"once per round in rotated order; ratios paired within a round{pil}.", "",
             "| ratio | median | best | worst |", "|---|---:|---:|---:|"]
    for name, v in run["ratios"].items():
        lines.append(f"| {name} | {v['median']:.3f} | {v['best']:.3f} | {v['worst']:.3f} |")
    lines += ["", f"Fused kernel stages ({run['us_per_image']:.0f} us per image, one profiled "
              "pass): " + ", ".join(f"{k} {v:.1%}" for k, v in run["stages"].items())]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="file written by pytest --benchmark-json")
    args = ap.parse_args(argv)
    doc, rows = load(args.json)
    print(render(doc, rows))
    if "interleaved" in doc:
        print(render_interleaved(doc["interleaved"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

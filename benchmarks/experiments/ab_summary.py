"""Each layer's and row count's mean time per label of an A/B's few_rows_times.py log (JSON lines), against the label
named base if there is one, else tree: for knob_ab.sh and variant_ab.sh.

    python3 benchmarks/experiments/ab_summary.py times.jsonl
"""
import collections
import json
import sys

times = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    record = json.loads(line)
    for rows, t in record["times"].items():
        times[(record["layer"], rows)][record["label"]].append(t)
for (layer, rows), by_label in times.items():
    reference = "base" if "base" in by_label else "tree"
    base = sum(by_label[reference]) / len(by_label[reference])
    column = f"M{rows}" if rows.isdigit() else rows  # rows of x, or a dequantize variant
    print(f"{layer:22s} {column:11s} {reference} {base:6.1f} " + " ".join(
        f"{label} {sum(v) / len(v):6.1f} ({sum(v) / len(v) / base - 1:+.0%})"
        for label, v in by_label.items() if label != reference))

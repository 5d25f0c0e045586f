"""Appends a dequantize variants benchmark's nf4-ops times (bench_dequantize_variants.py's JSON) to a JSON-lines log
under a label, one line per layer {"label", "layer", "times": {variant name: us}}, the format ab_summary.py reads: so
variant_ab.sh (VARIANTS=1) can A/B a dequantize change over every variant (NF4 / FP4, each output dtype and
blocksize, plain and nested), not only the few that its timing script covers (NOTES dequantize row 11).

    python3 benchmarks/experiments/variants_jsonl.py dequantize_variants.json times.jsonl LABEL
"""
import collections
import json
import sys

if len(sys.argv) != 4:
    sys.exit(__doc__)
results = json.load(open(sys.argv[1]))
by_layer = collections.defaultdict(dict)
for variant in results["variants"]:
    for layer in variant["layers"]:
        by_layer[f"{layer['model']} {layer['layer']}"][variant["name"]] = layer["nf4ops_us"]
with open(sys.argv[2], "a") as log:
    for layer, times in by_layer.items():
        log.write(json.dumps({"label": sys.argv[3], "layer": layer, "times": times}) + "\n")

"""Where a one-row call's time goes at the kernel boundary (NOTES gemv row 76). Needs the timing build of
benchmarks/experiments/one_row_timeline.diff, whose one-row kernel stamps the GPU's global timer per CTA (entry,
after its wait) and per warp (after its first step, after its last flush, after the CTA's merge).

Each layer runs as the benchmark runs it: a CUDA graph of consecutive calls on rotated weight copies (programmatic
dependent launch as configured), timed with CUDA events; the stamps of the last replay are then read back and
summarised per call, relative to the call's first wait release:

    python benchmarks/experiments/one_row_timeline.py [--out FILE.json]
"""

import argparse
import json
import statistics

import torch

import nf4_ops  # noqa: F401  (loads the extension)

LAYERS = [("llama3.3-70b gate/up", 28672, 8192), ("llama3.3-70b q", 8192, 8192), ("qwen3-32b down", 5120, 25600),
          ("gemma-27b down", 5376, 21504)]
CALLS = 16  # per graph; the timing build keeps the stamps of the last 64 calls
WARPS = 16  # the one-row kernel's warps per CTA (NF4_OR_WARPS)
WORDS = 4 + 3 * WARPS
SLOTS, CTAS = 64, 256


def read_timeline():
    raw = torch.ops.nf4_timing.one_row_timeline()
    calls = int(raw[0])
    return calls, raw[1:].view(SLOTS, CTAS, WORDS)


def layer_timeline(name, rows, cols, sms):
    weight_bytes = rows * cols // 2 + rows * cols // 64 * 4
    copies = max(2, -(-3 * torch.cuda.get_device_properties(0).L2_cache_size // weight_bytes) + 1)
    packed = [torch.randint(0, 256, (rows * cols // 2,), dtype=torch.uint8, device="cuda") for _ in range(copies)]
    absmax = [torch.rand(rows * cols // 64, device="cuda") + 0.5 for _ in range(copies)]
    x = torch.randn(1, cols, dtype=torch.bfloat16, device="cuda")

    def call(i):
        return torch.ops.nf4.gemv(x, packed[i % copies], absmax[i % copies], 64, "nf4", [rows, cols])

    for i in range(3):
        call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            call(i)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS)
    graph.replay()
    torch.cuda.synchronize()
    total, slots = read_timeline()
    per_call = []
    for c in range(total - CALLS, total):
        record = slots[c % SLOTS, :sms]
        assert bool((record[:, 3] == c).all()), f"{name}: call {c}'s slots hold other calls"
        warps = record[:, 4:].view(sms, WARPS, 3)
        per_call.append({"entry": record[:, 0], "waited": record[:, 1], "sm": record[:, 2], "first": warps[..., 0],
                         "done": warps[..., 1], "merged": warps[..., 2]})
    summary = summarise(per_call)
    summary.update(layer=name, us_per_call_events=statistics.median(times), weight_MB=weight_bytes / 1e6)
    return summary


def summarise(per_call):
    stamps = torch.cat([torch.cat([p["waited"], p["first"].flatten(), p["done"].flatten()]) for p in per_call])
    diffs = stamps.sort().values.diff()
    resolution = int(diffs[diffs > 0].min())
    rows_out = []
    for c in range(1, CALLS - 1):  # calls with a graph neighbour on both sides
        p, nxt = per_call[c], per_call[c + 1]
        t0 = int(p["waited"].min())
        done = (p["done"].flatten() - t0).float() / 1000
        merged_by_sm = {int(s): int(m) for s, m in zip(p["sm"], p["merged"].max(dim=1).values)}
        relaunch = [int(e) - merged_by_sm[int(s)] for s, e in zip(nxt["sm"], nxt["entry"]) if int(s) in merged_by_sm]
        rows_out.append({
            "period": (int(nxt["waited"].min()) - t0) / 1000,
            "wait_spread": (int(p["waited"].max()) - t0) / 1000,
            "first_step_p50": float((p["first"] - t0).float().median()) / 1000,
            "done_p0": float(done.min()), "done_p50": float(done.median()),
            "done_p90": float(done.quantile(0.9)), "done_p100": float(done.max()),
            "merged_max": (int(p["merged"].max()) - t0) / 1000,
            "boundary": (int(nxt["waited"].min()) - int(p["merged"].max())) / 1000,
            "relaunch_p50": statistics.median(relaunch) / 1000, "relaunch_max": max(relaunch) / 1000,
            "next_entry_first": (int(nxt["entry"].min()) - t0) / 1000,
        })
    # Where the finish-time spread lies: between CTAs (SMs) or between the warps of a CTA, and whether the same SMs
    # and warp indices are late in every call (a structural cause) or not.
    cta_medians, within_spread, warp_means, start_corr = [], [], torch.zeros(WARPS), []
    for c in range(1, CALLS - 1):
        p = per_call[c]
        done = (p["done"] - int(p["waited"].min())).double() / 1000  # [CTA, warp] us
        order = p["sm"].argsort()
        done = done[order]
        cta_medians.append(done.median(dim=1).values)
        waited = (p["waited"][order] - int(p["waited"].min())).double() / 1000
        start_corr.append(float(torch.corrcoef(torch.stack([waited, cta_medians[-1]]))[0, 1]))
        within_spread.append(float((done.max(dim=1).values - done.min(dim=1).values).median()))
        warp_means += (done - done.mean(dim=1, keepdim=True)).mean(dim=0).float()
    cta_medians = torch.stack(cta_medians)  # [call, SM]
    spread_between = float((cta_medians.max(dim=1).values - cta_medians.min(dim=1).values).mean())
    call_to_call = float(torch.corrcoef(cta_medians)[:-1].diagonal(offset=1).mean())
    summary_extra = {"cta_median_spread": spread_between, "within_cta_spread_p50": statistics.mean(within_spread),
                     "sm_rank_corr_between_calls": call_to_call, "wait_vs_done_corr": statistics.mean(start_corr),
                     "warp_index_offset_us": [round(float(v), 2) for v in warp_means / (CALLS - 2)],
                     "sm_median_done_mean": [round(float(v), 2) for v in cta_medians.mean(dim=0)]}
    summary = {key: statistics.mean(r[key] for r in rows_out) for key in rows_out[0]}
    summary.update(summary_extra)
    summary.update(resolution_ns=resolution)
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = [layer_timeline(name, rows, cols, sms) for name, rows, cols in LAYERS]
    print(torch.cuda.get_device_name(0), f"{sms} SMs; us from the call's first wait release, means over calls "
          f"2-{CALLS - 1} of a graph of", CALLS)
    columns = ["us_per_call_events", "period", "wait_spread", "first_step_p50", "done_p0", "done_p50", "done_p90",
               "done_p100", "merged_max", "boundary", "next_entry_first", "relaunch_p50", "relaunch_max",
               "cta_median_spread", "within_cta_spread_p50", "sm_rank_corr_between_calls", "wait_vs_done_corr"]
    print("| layer | MB | " + " | ".join(columns) + " | timer ns |")
    print("|---" * (len(columns) + 3) + "|")
    for r in results:
        print(f"| {r['layer']} | {r['weight_MB']:.1f} | " + " | ".join(f"{r[c]:.2f}" for c in columns) +
              f" | {r['resolution_ns']} |")
    for r in results:
        print(r["layer"], "warp index offsets (us):", r["warp_index_offset_us"])
        sm = torch.tensor(r["sm_median_done_mean"])
        order = sm.argsort()
        print(r["layer"], f"per-SM median done (us), by SM id: min {float(sm.min()):.2f} p50 {float(sm.median()):.2f} "
              f"max {float(sm.max()):.2f}; slowest SMs {order[-8:].tolist()}; fastest {order[:8].tolist()}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

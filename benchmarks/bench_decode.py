"""End-to-end decode: one decode step of a Hugging Face Llama model of Llama-3.3-70B's layer shapes (hidden 8192,
intermediate 28672, 64 heads, 8 KV heads; random weights, a few decoder layers, a small vocabulary), per variant:

- `bf16`: the model unquantized (cuBLAS);
- `bitsandbytes`: every decoder linear layer a `bitsandbytes.nn.Linear4bit` (NF4, nested absmax, blocksize 64,
  bf16 compute), as `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True)` loads it;
- `nf4-ops`: the same 4-bit model after `nf4_ops.patch`.

Each step runs 1 token for each of `--batch` sequences against a static KV cache of `--context` positions (filled
by a prefill of `--prompt` tokens; the step's attention reads all of them, as with transformers' static cache), and
is captured in a CUDA graph and replayed, so that the host's Python overhead is out of the timing and the GPU's time
is what is measured. The ops other than the linear layers are eager PyTorch's kernels, or with `--compile` Inductor's:
the step is then `torch.compile(model, fullgraph=True)` (compiled per variant and batch, before the capture), as
transformers' compiled decode (`cache_implementation="static"`, `mode="reduce-overhead"`) runs it, its norms,
rotary embedding and residual adds fused into a few kernels. The three variants share the embedding, norms, attention and
the lm head; only the linear layers differ. Median of `--repeats` timed runs of `--replays` replays each,
CUDA events; the weights of a step (about 0.9-3.4 GB) do not fit in L2, so each replay reads them from memory.

    python benchmarks/bench_decode.py [--layers 2] [--batch 1 16] [--compile] [--out DIR]

Prints a table last (ms per step, the decoder linear layers' weight bytes, those bytes per step time, speedups)
and writes DIR/decode.json and DIR/decode.png. On a CPU (no CUDA graphs) it times the step's calls directly, with
`--layers 1` and a 1024-wide model by default: a smoke run of the same code, not a measurement of the project.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import bitsandbytes as bnb
import torch
import transformers

import nf4_ops

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import gpu_state  # noqa: E402

LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                 head_dim=128)  # fmt: skip
SMALL = dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2, head_dim=128)
VARIANTS = ("bf16", "bitsandbytes", "nf4-ops")


def quantize_linears(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """Replaces every nn.Linear of the decoder layers by a bitsandbytes Linear4bit holding the same weight in NF4,
    nested absmax, blocksize 64, bf16 compute (what transformers' bitsandbytes loading builds); the lm head stays
    bf16, as transformers keeps it."""
    for layer in model.model.layers:
        for parent in layer.modules():
            for name, child in list(parent.named_children()):
                if type(child) is not torch.nn.Linear:
                    continue
                quantized = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                              compute_dtype=torch.bfloat16, compress_statistics=True,
                                              quant_type="nf4", device="meta")  # fmt: skip
                quantized.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, blocksize=64,
                                                     compress_statistics=True, quant_type="nf4",
                                                     module=quantized).to(device)  # fmt: skip
                if child.bias is not None:
                    quantized.bias = torch.nn.Parameter(child.bias.data.clone(), requires_grad=False)
                setattr(parent, name, quantized)
    return model


def build_models(device: str, layers: int, attention: str):
    """(config, the bf16 model, its 4-bit copy): Llama-3.3-70B's layer shapes on a GPU, a 1024-wide Llama on a CPU;
    random weights (seed 0), a 4096-token vocabulary."""
    shape = LLAMA_70B if device == "cuda" else SMALL
    config = transformers.LlamaConfig(**shape, num_hidden_layers=layers, vocab_size=4096,
                                      max_position_embeddings=4096, attn_implementation=attention)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        dense = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    # train() on the 4-bit copy: bitsandbytes repacks weights into a CPU-only layout in eval mode on some CPUs
    # (tests/test_patch.py); the model has no dropout, so outputs are eval mode's.
    quantized = quantize_linears(copy.deepcopy(dense), device).train(device == "cpu")
    return config, dense, quantized


def linear_weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of the decoder layers' linear weights a step reads: bf16 weights, or packed NF4 plus its scales."""
    total = 0
    for module in model.model.layers.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            state = module.weight.quant_state
            total += module.weight.numel() * module.weight.element_size()
            total += state.absmax.numel() * state.absmax.element_size()
            if state.nested:
                total += state.state2.absmax.numel() * 4 + state.state2.code.numel() * 4
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total


def decode_steps(replays: int, repeats: int) -> int:
    """The calls decode_step_ms makes after the prefill, each of which takes a cache position: 3 warm-up calls and
    a replay besides the timed ones on a GPU (capture runs nothing), 1 + repeats on a CPU."""
    return 4 + replays * repeats


def prefilled_step_inputs(model, config, batch: int, prompt: int, context: int, device: str) -> dict:
    """Prefills a static cache of `context` positions with `prompt` random tokens per sequence (eager, as
    transformers' generate runs the prefill; call under torch.no_grad()) and returns the keyword arguments of the
    decode step after it (1 token per sequence)."""
    # transformers' static cache writes each call at its own running count of tokens (a device counter that every
    # call moves on, whatever cache_position says; its index_copy_ asserts past the end), so the cache must hold every
    # call made with these inputs (the callers check). The step's attention reads the whole static cache, filled or
    # not, so its time does not depend on how many of them came before.
    cache = transformers.StaticCache(config=config, max_cache_len=context)
    generator = torch.Generator().manual_seed(batch)
    prompt_ids = torch.randint(0, config.vocab_size, (batch, prompt), generator=generator).to(device)
    model(input_ids=prompt_ids, cache_position=torch.arange(prompt, device=device), past_key_values=cache,
          use_cache=True)  # fmt: skip
    ids = torch.randint(0, config.vocab_size, (batch, 1), generator=generator).to(device)
    position = torch.tensor([prompt], device=device)
    return dict(input_ids=ids, cache_position=position, position_ids=position.expand(batch, 1), past_key_values=cache,
                use_cache=True)  # fmt: skip


def decode_step_ms(model, config, batch: int, prompt: int, context: int, device: str, replays: int, repeats: int,
                   compiled: bool) -> float:  # fmt: skip
    """Median ms of one decode step (1 token per sequence) after a prefill of `prompt` tokens, against a static cache
    of `context` positions: CUDA-graph replays on a GPU, calls on a CPU; the step compiled with fullgraph when
    `compiled` (the prefill eager, as transformers' generate runs it)."""
    with torch.no_grad():
        kwargs = prefilled_step_inputs(model, config, batch, prompt, context, device)
        if compiled:
            torch._dynamo.reset()  # a fresh compile for each variant (patch swaps the layers' forward)
            torch._dynamo.utils.counters.clear()  # main reports this variant's compiled graphs
        forward = torch.compile(model, fullgraph=True) if compiled else model
        # after the warm-up, a compiled step that would compile again is an error, not a silent eager run or a
        # recompile inside the capture or the timing
        settled = (lambda: torch.compiler.set_stance("fail_on_recompile")) if compiled else contextlib.nullcontext

        def step():
            return forward(**kwargs).logits

        if device == "cpu":
            step()
            times = []
            with settled():
                for _ in range(repeats):
                    start = time.perf_counter()
                    step()
                    times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs asks
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with settled(), torch.cuda.graph(graph):
            step()
        graph.replay()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / replays)
        del graph
        return statistics.median(times)


def table(results: dict) -> str:
    ops = "torch.compile(fullgraph=True)" if results["compiled"] else "eager ops"
    lines = [f"decode step of {results['model']} on {results['device_name']}, {ops}", "",
             "| variant | batch | ms per step | linear weights MB | GB/s of those | vs bitsandbytes | vs bf16 |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for batch, rows in results["steps"].items():
        for variant in VARIANTS:
            ms = rows[variant]
            weight_bytes = results["linear_weight_bytes"][variant]
            if ms is None or rows["bitsandbytes"] is None or rows["bf16"] is None:
                lines.append(f"| {variant} | {batch} | {'failed' if ms is None else f'{ms:.3f}'} | "
                             f"{weight_bytes / 1e6:.0f} | | | |")  # fmt: skip
                continue
            lines.append(f"| {variant} | {batch} | {ms:.3f} | {weight_bytes / 1e6:.0f} | {weight_bytes / ms / 1e6:.0f} | "
                         f"{rows['bitsandbytes'] / ms:.2f}x | {rows['bf16'] / ms:.2f}x |")  # fmt: skip
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = list(results["steps"])
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(VARIANTS)
    for i, variant in enumerate(VARIANTS):
        ax.bar([b + (i - 1) * width for b in range(len(batches))],
               [results["steps"][b][variant] or 0.0 for b in batches], width, label=variant)  # fmt: skip
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("ms per decode step")
    ops = "compiled" if results["compiled"] else "eager ops"
    ax.set_title(f"{results['model']}, {ops}\n{results['device_name']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, help="decoder layers (default: 2 on a GPU, 1 on a CPU)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="sequences decoded together")
    parser.add_argument("--prompt", type=int, default=128, help="prefill tokens before the timed step")
    parser.add_argument("--replays", type=int, default=20, help="graph replays per timed run")
    parser.add_argument("--repeats", type=int, default=15, help="timed runs; the median is reported")
    parser.add_argument("--context", type=int, default=512, help="static KV cache positions (attention reads all)")
    parser.add_argument("--attention", default="sdpa", help="transformers' attn_implementation")
    parser.add_argument("--compile", action="store_true", help="the step compiled with torch.compile(fullgraph=True)")
    parser.add_argument("--out", type=Path, default=Path("decode-out"))
    args = parser.parse_args()
    if args.prompt + decode_steps(args.replays, args.repeats) > args.context:
        parser.error(f"--context {args.context} holds fewer positions than the prompt ({args.prompt}) and the "
                     f"{decode_steps(args.replays, args.repeats)} decode calls of --replays x --repeats need")  # fmt: skip
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layers = args.layers or (2 if device == "cuda" else 1)
    config, dense, quantized = build_models(device, layers, args.attention)
    name = (f"Llama-3.3-70B shapes, {layers} decoder layer{'s' * (layers > 1)}" if device == "cuda"
            else f"a 1024-wide Llama, {layers} decoder layer{'s' * (layers > 1)} (CPU smoke run)")  # fmt: skip
    results = {"model": name, "device_name": torch.cuda.get_device_name() if device == "cuda" else "CPU",
               "torch": torch.__version__, "bitsandbytes": bnb.__version__, "transformers": transformers.__version__,
               "layers": layers, "prompt": args.prompt, "context": args.context, "compiled": args.compile,
               "steps": {}}  # fmt: skip
    four_bit_bytes = linear_weight_bytes(quantized)  # the same weights for both 4-bit variants
    results["linear_weight_bytes"] = {"bf16": linear_weight_bytes(dense), "bitsandbytes": four_bit_bytes,
                                      "nf4-ops": four_bit_bytes}  # fmt: skip
    for batch in args.batch:
        step = {}
        for variant in VARIANTS:
            start = time.time()
            model = dense if variant == "bf16" else quantized
            if variant == "nf4-ops":
                nf4_ops.patch(model)
            try:
                step[variant] = decode_step_ms(model, config, batch, args.prompt, args.context, device, args.replays,
                                               args.repeats, args.compile)  # fmt: skip
                print(f"[decode] batch {batch} {variant}: {step[variant]:.3f} ms ({time.time() - start:.1f} s)",
                      flush=True)  # fmt: skip
                if args.compile:  # the graphs Dynamo compiled for the step (fullgraph: 1 when nothing recompiled)
                    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
                    results.setdefault("compiled_graphs", {})[f"batch {batch} {variant}"] = graphs
            except RuntimeError as error:  # e.g. a capture that a variant's forward breaks: reported, not hidden
                step[variant] = None
                results.setdefault("errors", {})[f"batch {batch} {variant}"] = str(error)[:500]
                print(f"[decode] batch {batch} {variant}: FAILED:\n{traceback.format_exc()[-3000:]}", flush=True)
            finally:
                if variant == "nf4-ops":
                    nf4_ops.unpatch(model)
        results["steps"][batch] = step
    if device == "cuda":
        results["gpu_state"] = gpu_state()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / "decode.png")
    print(table(results))
    if "errors" in results:  # reported above and in the JSON; the run failed
        sys.exit(f"decode: {len(results['errors'])} variant run(s) failed")


if __name__ == "__main__":
    main()

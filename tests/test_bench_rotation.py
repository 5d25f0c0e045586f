"""The kernel benchmark's rotation past L2 (benchmarks/bench_kernels.py: copies_for, graph_chains): every timed
call set of every paper layer rotates through at least ROTATE_BYTES, and the graphs that time them all hold the same
number of calls. Until session 58 the copies were capped at 16, and Qwen's k/v gemv rotated 47 MB, under an H100's
50 MB of L2."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_kernels as bk  # noqa: E402
from report import dequantize_bytes, gemv_bytes, same_size_read_bytes  # noqa: E402


def call_bytes_of_every_timed_set():
    """(what, bytes one call moves) for each set of copies bench_kernels times on the paper layers."""
    for layer in bk.PAPER_LAYERS:
        name = f"{layer.model} {layer.name}"
        for nested in (False, True):
            yield f"{name} dequantize nested={nested}", dequantize_bytes(layer.n, layer.k, bk.BLOCKSIZE, nested)
        for rows in sorted(set(bk.CROSSOVER_ROWS) | {1, 16}):
            yield f"{name} gemv {rows} rows", gemv_bytes(layer.n, layer.k, bk.BLOCKSIZE, rows)
        yield f"{name} cuBLAS bf16 weight", layer.n * layer.k * 2
        for key, nbytes in same_size_read_bytes(layer.k, gemv_bytes(layer.n, layer.k, bk.BLOCKSIZE, 1)).items():
            yield f"{name} {key}", nbytes


def bytes_between_reads_of_a_set(call_bytes: int, copies: int) -> int:
    """The fewest bytes the timed calls read between two reads of one input set, over the graphs' replays in turn."""
    calls = [i for chain in bk.graph_chains(copies, bk.min_graph_calls) for i in chain] * 2
    gaps = [calls.index(i, position + 1) - position - 1 for position, i in enumerate(calls[: len(calls) // 2])]
    return min(gaps) * call_bytes


@pytest.mark.parametrize("what, call_bytes", list(call_bytes_of_every_timed_set()))
def test_every_timed_set_rotates_past_l2(what, call_bytes):
    """Each set is read again only after at least ROTATE_BYTES / 2 (1.5x the largest L2) of the other sets: enough
    copies, and none read twice in a row. Before session 58 a copy count that was no divisor of the graph's 16 calls
    (3, 5, 7, 13-15) ended each replay on copy 0 and began the next on it again; 16 copies of Qwen's k/v gemv were 45
    MB apart."""
    assert bk.min_graph_calls == bk.DEFAULT_MIN_GRAPH_CALLS
    copies = bk.copies_for(call_bytes)
    assert copies * call_bytes >= bk.ROTATE_BYTES, f"{what}: {copies} copies of {call_bytes} bytes"
    assert bytes_between_reads_of_a_set(call_bytes, copies) >= bk.ROTATE_BYTES / 2, f"{what}: {copies} copies"
    assert copies < bk.MAX_COPIES  # the cap bounds a tiny shape's memory, not a paper layer's rotation


@pytest.mark.parametrize("sets", [1, 2, 5, 16, 17, 32, 64, 65])
@pytest.mark.parametrize("min_calls", [1, 16])
def test_graph_chains(sets, min_calls):
    chains = bk.graph_chains(sets, min_calls)
    called = [i for chain in chains for i in chain]
    assert set(called) == set(range(sets))  # every set is timed
    if min_calls == 1 or sets <= min_calls:  # one graph, cycling through the sets
        assert len(chains) == 1 and len(chains[0]) == max(sets, min_calls)
        assert chains[0] == [i % sets for i in range(len(chains[0]))]
    else:  # graphs of min_calls sets each, in turn, the first ones filling the last graph
        assert all(len(chain) == min_calls for chain in chains)
        assert len(chains) == -(-sets // min_calls)
        assert called[:sets] == list(range(sets))

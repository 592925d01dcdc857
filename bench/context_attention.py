"""Attention of prefill steps with chunks over cached context: the paged Triton kernel against
one varlen flash call over keys gathered from the pages (``triton_attention.CONTEXT_FLASH``).

One layer of the Llama-3-8B shape (32 query heads, 8 KV heads, head size 128, 16-token pages in
shuffled order) per case; each case is a step's prefill rows ``(chunk tokens, cached context)``.
For each path: its error against the fp32 torch reference, the GPU time of the layer's attention
(replayed from a CUDA graph, the step's plan already built) and its host time launched eagerly
(the piecewise prefill graphs run attention eagerly between segments), and the once-per-step
cost of building the plan. Where the engine runs it: every layer of a prefill step, 32 times.

    PYTHONPATH=src python3 bench/context_attention.py --out bench/results/context_attention_h200.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from speed_common import cuda_time, provenance, rel_err, sync

from coserve.layers.attention import AttentionMetadata, TorchAttention
from coserve.layers.triton_attention import AttentionTuning, TritonAttention

H, KVH, D, BS = 32, 8, 128, 16
REPS = 10
CASES: dict[str, list[tuple[int, int]]] = {
    "26_over_1720": [(26, 1720)],
    "141_over_245": [(141, 245)],
    "445_over_1600": [(445, 1600)],
    "512_over_3584": [(512, 3584)],
    "1024_over_3072": [(1024, 3072)],
    "2027_over_2048": [(2027, 2048)],
    "2048_over_6144": [(2048, 6144)],
    "1500_fresh+300_over_2000": [(1500, 0), (300, 2000)],
    "4x256_over_1024": [(256, 1024)] * 4,
}


def graph_time(fn: Any, iters: int = 20) -> float:
    """GPU seconds per call: REPS calls captured in one CUDA graph, its replay timed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    return cuda_time(graph.replay, iters=iters) / REPS


def host_time(fn: Any, n: int = 50) -> float:
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n
    sync()
    return host


def case(rows: list[tuple[int, int]], seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    need = sum(-(-(n + c) // BS) for n, c in rows)
    free = list(range(need + 8))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(n + c) // BS))] for n, c in rows]
    lens, ctxs = [n for n, _ in rows], [c for _, c in rows]
    t = sum(lens)
    cache = torch.randn(need + 8, 1, 2, BS, KVH, D, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(t, H, D, dtype=torch.bfloat16, device="cuda")
    k, v = torch.randn(t, KVH, D, dtype=torch.bfloat16, device="cuda"), torch.randn(t, KVH, D, dtype=torch.bfloat16,
                                                                                   device="cuda")
    scale = D**-0.5

    def meta() -> AttentionMetadata:
        return AttentionMetadata.build(lens, ctxs, tables, [True] * len(rows), len(rows), BS, device="cuda")

    ref = TorchAttention().forward(q.float(), k.float(), v.float(), cache[:, 0].float(), meta(), scale, None)
    out: dict[str, Any] = {"rows": rows, "pairs": sum(n * c + n * (n + 1) // 2 for n, c in rows)}
    for name, flash in (("paged_kernel", False), ("context_flash", True)):
        backend = TritonAttention(AttentionTuning(prefill_context_flash=flash))
        m = meta()
        got = backend.forward(q, k, v, cache[:, 0], m, scale, None)  # builds and keeps the step's plan
        sync()
        t0 = time.perf_counter()
        fresh = meta()
        backend.forward(q, k, v, cache[:, 0], fresh, scale, None)
        sync()
        first = time.perf_counter() - t0
        out[name] = {
            "rel_err": rel_err(got, ref),
            "gpu_s": graph_time(lambda backend=backend, m=m: backend.forward(q, k, v, cache[:, 0], m, scale, None)),
            "host_s": host_time(lambda backend=backend, m=m: backend.forward(q, k, v, cache[:, 0], m, scale, None)),
            "first_layer_wall_s": first,
        }
    out["gpu_speedup"] = out["paged_kernel"]["gpu_s"] / out["context_flash"]["gpu_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    figures = {}
    for i, (name, rows) in enumerate(CASES.items()):
        figures[name] = case(rows, i)
        f = figures[name]
        print(f"{name:>26}: paged {f['paged_kernel']['gpu_s'] * 1e6:8.1f} us (err {f['paged_kernel']['rel_err']:.1e}) "
              f"flash {f['context_flash']['gpu_s'] * 1e6:8.1f} us (err {f['context_flash']['rel_err']:.1e}) "
              f"x{f['gpu_speedup']:.2f}; host {f['paged_kernel']['host_s'] * 1e6:.0f} / "
              f"{f['context_flash']['host_s'] * 1e6:.0f} us", flush=True)
    result = {**provenance(), "config": {"heads": H, "kv_heads": KVH, "head_dim": D, "block_size": BS,
                                         "tuning": asdict(AttentionTuning())}, "figures": figures}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

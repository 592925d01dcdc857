"""The multi-LoRA kernels alone, at the Llama-3-8B linears: launch settings side by side.

For each step size ``--tokens`` (the tokens split evenly over 4 rank-16 adapters, one adapter per
contiguous row, as in a prefill step) and each fused linear of a decoder layer (q/k/v, o,
gate/up, down), the GPU time (CUDA events, median) of:

(GPU time: each timed in a CUDA graph of several launches, see :func:`gpu_time`)

- the base GEMM (``F.linear``), for scale;
- the shrink at each ``--shrink`` setting ``split:block_k:warps`` (``split`` 0: the engine's own
  choice, :meth:`LoRALaunch.for_order`);
- the expand, accumulating (``y += Δ``) and storing (``y = Δ``, the expand-first path), at each
  ``--waves`` setting (0: one column block per program, see
  :func:`coserve.layers.triton_lora.expand_blocks_per_program`);
- with ``--baseline FILE``, a copy of an older ``triton_lora.py``, its shrink and expand (the same
  inputs, its own launch settings): the before of a kernel change in the same run.

Each expand is checked against the fp32 torch reference (relative error), and set beside its
memory floor: the bytes of ``y`` it must move (read + write accumulating, write storing) at the
measured copy bandwidth.

    PYTHONPATH=src python3 bench/lora_kernels.py --out bench/results/lora_kernels_h200.json

``--smoke`` runs a tiny shape on the CPU under Triton's interpreter (a check of the script only:
its times mean nothing).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from speed_common import LLAMA3_8B, copy_bandwidth, cuda_time, provenance, rel_err, sync

from coserve.layers import triton_lora
from coserve.layers.lora import LoRABatch, lora_segments_ref
from coserve.layers.triton_attention import num_sms
from coserve.layers.triton_lora import LoRALaunch, block_m_for, routing_tensor, slice_stacks

logger = logging.getLogger("bench")
ADAPTERS, RANK = 4, 16


def linears(cfg: dict[str, Any]) -> dict[str, tuple[int, dict[str, int]]]:
    """``name: (in features, output slices)`` of one decoder layer's fused linears."""
    d, inter = cfg["hidden_size"], cfg["intermediate_size"]
    kv = d // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    return {"qkv": (d, {"q_proj": d, "k_proj": kv, "v_proj": kv}), "o": (d, {"o_proj": d}),
            "gate_up": (d, {"gate_proj": inter, "up_proj": inter}), "down": (inter, {"down_proj": d})}


REPS = 10
"""Launches per CUDA graph in :func:`gpu_time`."""


def gpu_time(fn: Callable[[], object], iters: int) -> float:
    """Seconds of GPU time per call of ``fn``: :data:`REPS` calls captured in one CUDA graph, its
    replay timed (median of ``iters``). Timed as launched from Python, a kernel of tens of
    microseconds measures its launch: the GPU waits for the host between two launches."""
    if not torch.cuda.is_available():
        return cuda_time(fn, iters=iters)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up (compilation) off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    return cuda_time(graph.replay, iters=iters) / REPS


def host_time(fn: Callable[[], object], n: int = 50) -> float:
    """Host seconds per call of ``fn`` launched ``n`` times back to back (the Python launch cost
    where the GPU keeps up, as in an eager step's small kernels)."""
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = time.perf_counter() - t0
    sync()
    return t / n


def load_baseline(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("baseline_triton_lora", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def case(tokens: int, d_in: int, out_slices: dict[str, int], dtype: torch.dtype, device: str,
         shrink_settings: list[tuple[int, int, int]], waves_settings: list[int], bandwidth: float,
         baseline: ModuleType | None, iters: int) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(tokens + d_in)
    k, d_out = len(out_slices), sum(out_slices.values())
    x = torch.randn(tokens, d_in, dtype=dtype, device=device, generator=gen)
    weight = torch.randn(d_out, d_in, dtype=dtype, device=device, generator=gen) / d_in**0.5
    a_all = torch.randn(ADAPTERS, k * RANK, d_in, dtype=dtype, device=device, generator=gen) / d_in**0.5
    b_all = torch.randn(ADAPTERS, d_out, RANK, dtype=dtype, device=device, generator=gen) * 0.01
    scales = torch.full((ADAPTERS,), 2.0, dtype=torch.float32, device=device)
    row_lens = [tokens // ADAPTERS] * (ADAPTERS - 1) + [tokens - tokens // ADAPTERS * (ADAPTERS - 1)]
    batch = LoRABatch.from_rows(row_lens, list(range(ADAPTERS)), device)
    block_m = block_m_for(tokens)
    routing, routed = routing_tensor(batch.seg_lens, batch.seg_slots, block_m, unrouted=True)  # the engine's
    store_order = routing.to(device)
    order = store_order[:routed]
    sms = num_sms(torch.device(device))
    sizes = list(out_slices.values())
    y0 = F.linear(x, weight)
    ref = y0.float().clone()  # NOTE: .float() of an fp32 y0 is y0 itself
    for name, off, a, b in slice_stacks(a_all.float(), b_all.float(), out_slices):
        lora_segments_ref(ref[:, off : off + out_slices[name]], x.float(), a, b, scales, batch)
    delta_ref = ref - y0.float()
    y_bytes = tokens * d_out * y0.element_size()
    rec: dict[str, Any] = {"tokens": tokens, "d_in": d_in, "out": sizes, "base_gemm_ms": 1e3 * gpu_time(
        lambda: F.linear(x, weight), iters), "floor_accumulate_ms": 1e3 * 2 * y_bytes / bandwidth,
        "floor_store_ms": 1e3 * y_bytes / bandwidth, "shrink": [], "expand": []}
    v_default = None
    for split, block_k, warps in shrink_settings:
        launch = LoRALaunch.for_order(order.shape[0], block_m, sms)
        if split:
            launch = LoRALaunch(launch.block_m, launch.num_tiles, split)

        def shrink(launch: LoRALaunch = launch, block_k: int = block_k, warps: int = warps) -> torch.Tensor:
            return triton_lora.lora_shrink_fused(x, a_all, RANK, batch.token_slots, order, launch,
                                                 block_k=block_k or None, num_warps=warps or None)

        v = shrink()
        ms = 1e3 * gpu_time(shrink, iters)
        rec["shrink"].append({"split": split, "split_used": v.shape[0], "block_k": block_k, "warps": warps, "ms": ms})
        if v_default is None:
            v_default = (v, launch)
    assert v_default is not None
    v, launch = v_default
    rec["host_launch_us"] = {
        "shrink": 1e6 * host_time(lambda: triton_lora.lora_shrink_fused(x, a_all, RANK, batch.token_slots, order,
                                                                         launch)),
        "expand": 1e6 * host_time(lambda: triton_lora.lora_expand_fused(y0.clone(), b_all, v, sizes, scales,
                                                                        batch.token_slots, order, launch)),
        "clone_only": 1e6 * host_time(lambda: y0.clone()),
        "gemm": 1e6 * host_time(lambda: F.linear(x, weight))}
    store_launch = LoRALaunch(launch.block_m, store_order.shape[0] // launch.block_m, launch.max_split_k)
    for waves in waves_settings:
        for accumulate in (True, False):
            y = y0.clone() if accumulate else torch.empty_like(y0)

            def expand(y: torch.Tensor = y, accumulate: bool = accumulate, waves: int = waves) -> None:
                triton_lora.lora_expand_fused(y, b_all, v, sizes, scales, batch.token_slots,
                                              order if accumulate else store_order,
                                              launch if accumulate else store_launch, accumulate=accumulate,
                                              waves=waves)

            expand()
            got = (y.float() - y0.float()) if accumulate else y.float()
            err = rel_err(got, delta_ref)
            ms = 1e3 * gpu_time(expand, iters)
            floor = rec["floor_accumulate_ms" if accumulate else "floor_store_ms"]
            rec["expand"].append({"waves": waves, "accumulate": accumulate, "ms": ms, "rel_err": err,
                                  "of_floor": ms / floor})
    if baseline is not None:
        old_launch = baseline.LoRALaunch.for_order(order.shape[0], block_m, sms)
        y = y0.clone()

        def old_pair() -> None:
            baseline.lora_shrink_expand_fused(y, x, a_all, b_all, sizes, scales, batch.token_slots, order, old_launch)

        def old_shrink() -> torch.Tensor:
            out: torch.Tensor = baseline.lora_shrink_fused(x, a_all, RANK, batch.token_slots, order, old_launch)
            return out

        old_v = old_shrink()
        y_old = y0.clone()

        def old_expand() -> None:
            baseline.lora_expand_fused(y_old, b_all, old_v, sizes, scales, batch.token_slots, order, old_launch)

        rec["baseline"] = {"shrink_ms": 1e3 * gpu_time(old_shrink, iters),
                           "expand_accumulate_ms": 1e3 * gpu_time(old_expand, iters),
                           "pair_ms": 1e3 * gpu_time(old_pair, iters), "split": old_launch.max_split_k}
    best_shrink = min(rec["shrink"], key=lambda r: r["ms"])
    best_acc = min((e for e in rec["expand"] if e["accumulate"]), key=lambda r: r["ms"])
    logger.info("T=%d %s: gemm %.3f ms; shrink best %.3f (split %d, bk %d, w %d); expand acc best %.3f "
                "(waves %d, %.2fx floor)%s", tokens, sizes, rec["base_gemm_ms"], best_shrink["ms"],
                best_shrink["split_used"], best_shrink["block_k"], best_shrink["warps"], best_acc["ms"],
                best_acc["waves"], best_acc["of_floor"],
                "" if baseline is None else (f"; baseline shrink {rec['baseline']['shrink_ms']:.3f} "
                                             f"expand {rec['baseline']['expand_accumulate_ms']:.3f}"))
    return rec


def parse_shrink(spec: str) -> list[tuple[int, int, int]]:
    out = []
    for item in spec.split(","):
        split, block_k, warps = (int(p) for p in item.split(":"))
        out.append((split, block_k, warps))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON result file")
    parser.add_argument("--tokens", default="16,64,512,2048,4096")
    parser.add_argument("--shrink", default="0:0:0,1:64:4,2:64:4,4:64:4,2:128:4,2:64:8,4:128:8",
                        help="shrink settings split:block_k:warps (0: the engine's choice of that value; the "
                             "first is the one the expands read)")
    parser.add_argument("--waves", default="0,1,2,4,8", help="expand settings (programs per SM aimed for)")
    parser.add_argument("--baseline", type=Path, help="an older triton_lora.py to time beside")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    cfg = {**LLAMA3_8B, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
           "num_key_value_heads": 2} if args.smoke else LLAMA3_8B
    baseline = load_baseline(args.baseline) if args.baseline else None
    bandwidth = copy_bandwidth() if device == "cuda" else 1e11
    result: dict[str, Any] = provenance()
    shrink_settings, waves_settings = parse_shrink(args.shrink), [int(w) for w in args.waves.split(",")]
    result["config"] = {"model": "tiny (smoke)" if args.smoke else "Llama-3-8B linears", "dtype": str(dtype),
                        "adapters": ADAPTERS, "rank": RANK, "tokens": args.tokens, "shrink": args.shrink,
                        "waves": args.waves, "iters": args.iters, "baseline": str(args.baseline or ""),
                        "time": f"CUDA graph of {REPS} launches, replay timed by CUDA events, median"
                        if device == "cuda" else "host clock (smoke)"}
    t0 = time.time()
    cases = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name, (d_in, out_slices) in linears(cfg).items():
            rec = case(tokens, d_in, out_slices, dtype, device, shrink_settings, waves_settings, bandwidth,
                       baseline, args.iters)
            cases.append({"linear": name} | rec)
    result["figures"] = {"copy_bandwidth_Bps": bandwidth, "cases": cases, "bench_wall_s": time.time() - t0}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

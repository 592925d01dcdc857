"""A loss chunk's stretches on the GPU, with the cross-entropy by the torch chain and by the fused
Triton kernel (``COSERVE_LOSS_FUSED_CE``), at the Llama-3 LM head's shape.

Runs :func:`coserve.trainer.backward._loss_into_workspace` (the LM head's GEMM in
``LOSS_GEMM_PIECES`` pieces, then the cross-entropy and its gradient) on random inputs, a CUDA
event at each pause boundary, and reports each stretch's median and max GPU ms over ``--reps``
chunks, the peak memory the chunk allocated, and how far the fused loss and gradient lie from
the chain's.

    python3 bench/loss_ce.py --out loss_ce.json        # on a GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

import coserve.trainer.backward as backward
from coserve.bench.provenance import provenance


def one_chunk(normed: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
              fused: bool) -> tuple[list[float], torch.Tensor, torch.Tensor]:
    """(each stretch's GPU ms, the loss, the gradient: a view of the workspace, overwritten by the
    next chunk) of one chunk."""
    backward.LOSS_FUSED_CE = fused
    events = [torch.cuda.Event(enable_timing=True)]
    events[0].record()

    def boundary() -> None:
        events.append(torch.cuda.Event(enable_timing=True))
        events[-1].record()

    rows = torch.arange(targets.shape[0], device=targets.device)
    loss, grad = backward._loss_into_workspace(normed, weight, targets, rows, boundary)
    boundary()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in zip(events, events[1:], strict=False)], loss, grad


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=512, help="targets in the chunk (LOSS_CHUNK)")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("loss_ce.py times GPU stretches: it needs a GPU")
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
    normed = torch.randn(args.rows, args.hidden, device=device, dtype=torch.bfloat16, generator=gen)
    targets = torch.randint(0, args.vocab, (args.rows,), device=device, generator=gen)

    figures: dict[str, Any] = {"gemm_pieces": backward.LOSS_GEMM_PIECES}
    results = {}
    for fused in (False, True):
        name = "fused" if fused else "chain"
        backward._LossWorkspace._key = backward._LossWorkspace._low = backward._LossWorkspace._f32 = None
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        for _ in range(3):  # (warm-up: the kernel's compile, cuBLAS's heuristics)
            one_chunk(normed, weight, targets, fused)
        # (only the last chunk's gradient kept: the peak is the chunk's own; before 2026-12-07 every
        # chunk's was cloned, 125 MiB each, in peak_alloc_mb)
        runs = [one_chunk(normed, weight, targets, fused) for _ in range(args.reps)]
        stretches = list(zip(*(r[0] for r in runs), strict=True))
        figures[name] = {
            "stretch_p50_ms": [statistics.median(s) for s in stretches],
            "stretch_max_ms": [max(s) for s in stretches],
            "chunk_p50_ms": statistics.median(sum(r[0]) for r in runs),
            "peak_alloc_mb": (torch.cuda.max_memory_allocated() - base) / 2**20,
        }
        results[name] = runs[-1][1], runs[-1][2].clone()
        print(name, json.dumps(figures[name]))
    (loss_c, grad_c), (loss_f, grad_f) = results["chain"], results["fused"]
    figures["loss_rel_diff"] = abs(float(loss_f) - float(loss_c)) / abs(float(loss_c))
    figures["grad_rel_diff"] = float((grad_f.double() - grad_c.double()).norm() / grad_c.double().norm())
    figures["grad_max_abs_diff"] = float((grad_f.float() - grad_c.float()).abs().max())
    figures["ce_speedup"] = figures["chain"]["stretch_p50_ms"][-1] / figures["fused"]["stretch_p50_ms"][-1]
    print(json.dumps({k: v for k, v in figures.items() if k not in ("chain", "fused")}))
    if args.out:
        Path(args.out).write_text(json.dumps({**provenance(), "config": vars(args), "figures": figures}, indent=1))


if __name__ == "__main__":
    main()

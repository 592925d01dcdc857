"""Tall-skinny bf16 matmuls of the LoRA path, counted for non-finite outputs from finite inputs.

Session 11: the split baseline's worker (20% MPS share, beside the engine's process) saw
``aten.mm`` on ``[(4109, 4096), (4096, 16)]`` return a non-finite value from finite inputs (the
LoRA backward's ``grad_y @ B``), which its training step at the same share alone never did. This
repeats such matmuls (``T x 4096 @ 4096 x 16`` and the shrink's ``T x 4096 @ (16 x 4096)^T``) with
fresh inputs and counts the outputs that hold a non-finite value, by setting:

    nvidia-cuda-mps-control -d
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20 python bench/skinny_mm_check.py --busy --out mm_20.json

``--busy`` starts a second process (an MPS client at the whole GPU) that runs large matmuls the
whole time, as the engine's process would beside the worker."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import torch

from coserve.bench.provenance import provenance


def _busy(stop: object) -> None:  # the other MPS client
    os.environ.pop("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", None)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    while not stop.is_set():  # type: ignore[attr-defined]
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()


def count(setting: str, iters: int, t: int) -> dict[str, object]:
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = setting != "no_reduced_reduction"
    dtype = torch.float32 if setting == "fp32" else torch.bfloat16
    bad = torch.zeros(4, dtype=torch.int64, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    start = time.perf_counter()
    for _ in range(iters):
        x = torch.randn(t, 4096, device="cuda", generator=g).to(dtype)
        b = (torch.randn(4096, 16, device="cuda", generator=g) * 0.02).to(dtype)  # B [out, r]
        a = (torch.randn(16, 4096, device="cuda", generator=g) * 0.02).to(dtype)  # A [r, in]
        outs = (x @ b, x @ a.t(), x @ b.t().contiguous().t(), (x.t().contiguous().t()) @ b)
        for i, y in enumerate(outs):
            bad[i] += (~y.isfinite()).any().long()
    torch.cuda.synchronize()
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    names = ("x@B", "x@A.T", "x@B(col-major)", "x(col-major)@B")
    return {"iters": iters, "tokens": t, "non_finite": dict(zip(names, bad.tolist(), strict=True)),
            "seconds": round(time.perf_counter() - start, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--tokens", type=int, default=4109)
    p.add_argument("--busy", action="store_true", help="a second MPS client runs large matmuls meanwhile")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    other = ctx.Process(target=_busy, args=(stop,), daemon=True) if args.busy else None
    if other is not None:
        other.start()
        time.sleep(5)
    try:
        figures = {s: count(s, args.iters, args.tokens) for s in ("default", "no_reduced_reduction", "fp32")}
    finally:
        stop.set()
        if other is not None:
            other.join(timeout=10)
    print(json.dumps(figures, indent=1))
    result = {**provenance(), "config": vars(args) | {
        "out": str(args.out), "mps_active_thread_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")},
        "figures": figures}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

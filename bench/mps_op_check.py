"""The split trainer's GPU ops one at a time, bf16 against an fp32 reference, at whatever MPS share
this process runs under: which op gives a non-finite or wrong result where the whole training
step does (``bench/split_step_check.py``: NaN gradients at a 20% share, finite on the whole GPU,
session 10).

    nvidia-cuda-mps-control -d
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20 python bench/mps_op_check.py --out ops_20.json

Ops at the Llama-3-8B shape on one flat batch of ``--rows`` rows (256..1024 tokens): the varlen
attention forward and backward by every implementation of ``coserve.layers.varlen_attention``
(against per-row fp32 SDPA), a bf16 linear forward and backward (q_proj's and down_proj's
shapes), and the logits + fp32 cross-entropy with its backward. ``--poison`` fills the caching
allocator's free memory with NaN before every op, so that an op which reads memory it never wrote
gives NaN whatever the timing."""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from coserve.bench.provenance import provenance
from coserve.layers import varlen_attention as va

H, KVH, D, HIDDEN, INTER, VOCAB = 32, 8, 128, 4096, 14336, 128256


def poison_free_memory(fraction: float = 0.8) -> None:
    """Allocate ``fraction`` of the free device memory as NaN-filled blocks and free them into
    torch's cache: later ``torch.empty`` calls get NaN bytes back."""
    free, _ = torch.cuda.mem_get_info()
    blocks = []
    chunk = 1 << 30
    total = int(free * fraction)
    while total > 0:
        n = min(chunk, total)
        try:
            blocks.append(torch.full((n // 2,), float("nan"), dtype=torch.bfloat16, device="cuda"))
        except torch.OutOfMemoryError:
            break
        total -= n
    torch.cuda.synchronize()
    del blocks


def rel(a: torch.Tensor, b: torch.Tensor) -> float | None:
    if not bool(a.isfinite().all()):
        return None
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def attention_case(impl: str, lens: list[int]) -> dict[str, object]:
    pick = va.VARLEN_IMPLS[impl]()
    if pick is None:
        return {"skipped": f"{impl} not available on this torch"}
    name, fn = pick
    t = sum(lens)
    g = torch.Generator(device="cuda").manual_seed(sum(lens))
    q32 = torch.randn(t, H, D, device="cuda", generator=g)
    k32 = torch.randn(t, KVH, D, device="cuda", generator=g)
    v32 = torch.randn(t, KVH, D, device="cuda", generator=g)
    go32 = torch.randn(t, H, D, device="cuda", generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    scale = D**-0.5
    q, k, v = (x.bfloat16().requires_grad_() for x in (q32, k32, v32))
    out = fn(q, k, v, cu, max(lens), scale)
    out.backward(go32.bfloat16())
    torch.cuda.synchronize()
    # fp32 reference, per row, K/V heads repeated
    qr, kr, vr = (x.clone().requires_grad_() for x in (q32, k32, v32))
    outs = []
    for s, n in zip(cu[:-1].tolist(), lens, strict=True):
        qi = qr[s : s + n].transpose(0, 1)
        ki = kr[s : s + n].repeat_interleave(H // KVH, dim=1).transpose(0, 1)
        vi = vr[s : s + n].repeat_interleave(H // KVH, dim=1).transpose(0, 1)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            outs.append(
                F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale).transpose(
                    0, 1
                )
            )
    ref = torch.cat(outs)
    ref.backward(go32)
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return {
        "impl": name,
        "out": rel(out.detach(), ref.detach()),
        "dq": rel(q.grad, qr.grad),  # type: ignore[arg-type]
        "dk": rel(k.grad, kr.grad),
        "dv": rel(v.grad, vr.grad),
    }  # type: ignore[arg-type]


def linear_case(t: int, n_in: int, n_out: int) -> dict[str, object]:
    g = torch.Generator(device="cuda").manual_seed(t + n_in + n_out)
    x32 = torch.randn(t, n_in, device="cuda", generator=g)
    w32 = torch.randn(n_out, n_in, device="cuda", generator=g) * n_in**-0.5
    go32 = torch.randn(t, n_out, device="cuda", generator=g)
    x = x32.bfloat16().requires_grad_()
    y = F.linear(x, w32.bfloat16())
    y.backward(go32.bfloat16())
    xr = x32.clone().requires_grad_()
    yr = F.linear(xr, w32)
    yr.backward(go32)
    assert x.grad is not None and xr.grad is not None
    return {
        "shape": [t, n_in, n_out],
        "out": rel(y.detach(), yr.detach()),
        "dx": rel(x.grad, xr.grad),
    }


def logits_ce_case(t: int) -> dict[str, object]:
    g = torch.Generator(device="cuda").manual_seed(t)
    h32 = torch.randn(t, HIDDEN, device="cuda", generator=g)
    e32 = torch.randn(VOCAB, HIDDEN, device="cuda", generator=g) * 0.02
    tgt = torch.randint(0, VOCAB, (t,), device="cuda", generator=g)
    h = h32.bfloat16().requires_grad_()
    loss = F.cross_entropy(F.linear(h, e32.bfloat16()).float(), tgt, reduction="sum")
    loss.backward()
    hr = h32.clone().requires_grad_()
    loss_r = F.cross_entropy(F.linear(hr, e32), tgt, reduction="sum")
    loss_r.backward()
    assert h.grad is not None and hr.grad is not None
    return {
        "tokens": t,
        "loss": rel(loss.detach().reshape(1), loss_r.detach().reshape(1)),
        "dh": rel(h.grad, hr.grad),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3, help="fresh batches per op")
    p.add_argument(
        "--poison", action="store_true", help="NaN-fill the allocator's free memory before each op"
    )
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    rng = random.Random(0)
    cases: list[tuple[str, Callable[[], dict[str, object]]]] = []
    for r in range(args.repeats):
        lens = [rng.randint(256, 1024) for _ in range(args.rows)]
        t = sum(lens)
        for impl in ("flash", "flash_fn", "torch"):
            cases.append((f"attention_{impl}_{r}", functools.partial(attention_case, impl, lens)))
        cases.append((f"linear_qproj_{r}", functools.partial(linear_case, t, HIDDEN, HIDDEN)))
        cases.append((f"linear_down_{r}", functools.partial(linear_case, t, INTER, HIDDEN)))
        cases.append((f"logits_ce_{r}", functools.partial(logits_ce_case, 3 * t // 4)))
    results: dict[str, object] = {}
    for name, case in cases:
        if args.poison:
            poison_free_memory()
        try:
            results[name] = case()
        except RuntimeError as e:
            results[name] = {"error": str(e)[:400]}
        if not args.poison:
            torch.cuda.empty_cache()
        print(name, json.dumps(results[name]), flush=True)
    result = {
        **provenance(),
        "config": vars(args)
        | {
            "out": str(args.out),
            "mps_active_thread_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
        },
        "figures": results,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

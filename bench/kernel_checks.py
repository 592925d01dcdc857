"""Kernel-level checks and timings at the Llama-3-8B shape (bf16), used by ``engine_speed.py``.

Checks: each Triton kernel against the fp32 torch reference on fresh random inputs.
Timings: decode attention against the copy ceiling, prefill attention against the matmul
ceiling and torch SDPA (flash), for a few tile settings; the best setting is returned.
"""

from __future__ import annotations

import logging
import random
from dataclasses import asdict, replace
from typing import Any

import torch
import torch.nn.functional as F
from speed_common import cuda_time, rel_err

from coserve.layers.attention import AttentionMetadata, TorchAttention
from coserve.layers.lora import LoRABatch, lora_segments_ref
from coserve.layers.triton_attention import AttentionTuning, TritonAttention
from coserve.layers.triton_lora import TritonLoRA

logger = logging.getLogger("bench")
H, KVH, D, BS = 32, 8, 128, 16


def _batch(
    rng: random.Random, q_lens: list[int], ctxs: list[int], writes: list[bool], npre: int, nblocks: int
) -> AttentionMetadata:
    free = list(range(nblocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + n) // BS))] if w else []
              for n, c, w in zip(q_lens, ctxs, writes, strict=True)]
    return AttentionMetadata.build(q_lens, ctxs, tables, writes, npre, BS, device="cuda")


def check_kernels(seed: int = 0) -> dict[str, float]:
    """Relative errors of the bf16 Triton kernels against fp32 torch (fresh inputs per case)."""
    rng = random.Random(seed)
    errs: dict[str, float] = {}
    cases = {
        # prefill chunk with a cached prefix, a fine-tuning row, a fresh prompt, 8 decode rows
        "attention_mixed": ([300, 257, 64] + [1] * 8, [700, 0, 0] + [rng.randint(1, 3000) for _ in range(8)],
                            [True, False, True] + [True] * 8, 3),
        "attention_decode_split": ([1, 1], [5000, 37], [True, True], 0),
    }
    for window in (None, 1024):
        for name, (q_lens, ctxs, writes, npre) in cases.items():
            meta = _batch(rng, q_lens, ctxs, writes, npre, 1200)
            t = sum(q_lens)
            q = torch.randn(t, H, D, dtype=torch.bfloat16, device="cuda")
            k = torch.randn(t, KVH, D, dtype=torch.bfloat16, device="cuda")
            v = torch.randn(t, KVH, D, dtype=torch.bfloat16, device="cuda")
            cache = torch.randn(1200, 1, 2, BS, KVH, D, dtype=torch.bfloat16, device="cuda")
            ref_cache = cache.float()
            ref = TorchAttention().forward(q.float(), k.float(), v.float(), ref_cache[:, 0], meta, D**-0.5, window)
            out = TritonAttention().forward(q, k, v, cache[:, 0], meta, D**-0.5, window)
            errs[f"{name}_window{window}"] = rel_err(out, ref)
            errs[f"{name}_window{window}_kv_written"] = rel_err(cache.float(), ref_cache)
    for t_rows, d_in, d_out in ((7, 4096, 14336), (300, 14336, 4096)):
        lens = [rng.randint(1, 2 * t_rows // 4 + 1) for _ in range(4)]
        batch = LoRABatch.from_rows(lens, [0, 3, -1, 1], "cuda")
        t = sum(lens)
        x = torch.randn(t, d_in, dtype=torch.bfloat16, device="cuda")
        a = torch.randn(4, 16, d_in, dtype=torch.bfloat16, device="cuda") / d_in**0.5
        b = torch.randn(4, d_out, 16, dtype=torch.bfloat16, device="cuda")
        scales = torch.rand(4, device="cuda") + 0.5
        y0 = torch.randn(t, d_out, dtype=torch.bfloat16, device="cuda")
        ref = y0.float()
        lora_segments_ref(ref, x.float(), a.float(), b.float(), scales, batch)
        y = y0.clone()
        TritonLoRA.from_batch(batch, scales).apply(0, "x", x, y, a, b)
        errs[f"lora_T{t}_{d_in}x{d_out}"] = rel_err(y.float() - y0.float(), ref - y0.float())
    return errs


def _decode_meta(b: int, ctx: int, nblocks: int) -> AttentionMetadata:
    tables = [torch.randint(0, nblocks, (ctx // BS + 1,)).tolist() for _ in range(b)]
    return AttentionMetadata.build([1] * b, [ctx] * b, tables, [True] * b, 0, BS, device="cuda")


def time_attention(copy_bw: float, mm_rate: float) -> tuple[AttentionTuning, dict[str, Any]]:
    """Time decode/prefill attention (one layer) for a few tunings; returns the best and figures."""
    nblocks = 40000  # 40000 blocks x 16 tokens x 8 heads x 128 x 2 (K,V) x 2 B = 2.6 GB: far past L2
    cache = torch.randn(nblocks, 1, 2, BS, KVH, D, dtype=torch.bfloat16, device="cuda")[:, 0]
    figures: dict[str, Any] = {"decode": [], "prefill": []}
    best = AttentionTuning()
    best_decode: tuple[float, AttentionTuning] | None = None
    decode_variants = [AttentionTuning(decode_block_n=n, decode_warps=w, decode_stages=s)
                       for n, w, s in ((64, 4, 2), (32, 4, 3), (128, 8, 2))]
    for b, ctx in ((1, 8192), (16, 8192), (64, 8192), (256, 2048)):
        meta = _decode_meta(b, ctx, nblocks)
        q = torch.randn(b, H, D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(b, KVH, D, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        kv_bytes = b * (ctx + 1) * KVH * D * 2 * 2
        for tune in decode_variants:
            be = TritonAttention(tune)
            t = cuda_time(lambda be=be, q=q, k=k, v=v, meta=meta: be.forward(q, k, v, cache, meta, D**-0.5, None))
            figures["decode"].append({"batch": b, "context": ctx, "tuning": asdict(tune), "seconds": t,
                                      "fraction_of_copy_bw": kv_bytes / t / copy_bw})
    for tune in decode_variants:
        total = sum(f["seconds"] for f in figures["decode"] if f["tuning"] == asdict(tune))
        if best_decode is None or total < best_decode[0]:
            best_decode = (total, tune)
    assert best_decode is not None
    best = replace(best, decode_block_n=best_decode[1].decode_block_n, decode_warps=best_decode[1].decode_warps,
                   decode_stages=best_decode[1].decode_stages)

    prefill_variants = [AttentionTuning(prefill_block_m=m, prefill_block_n=n, prefill_warps=w, prefill_stages=s,
                                        prefill_sdpa=False)
                        for m, n, w, s in ((64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3))]
    best_prefill: tuple[float, AttentionTuning] | None = None
    for t_len in (4096, 16384):
        meta = AttentionMetadata.build([t_len], [0], [list(range(t_len // BS))], [True], 1, BS, device="cuda")
        q = torch.randn(t_len, H, D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(t_len, KVH, D, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        flops = 2 * t_len * t_len * H * D  # causal: QKᵀ and PV over half the square
        for tune in prefill_variants:
            be = TritonAttention(tune)
            t = cuda_time(lambda be=be, q=q, k=k, v=v, meta=meta: be.forward(q, k, v, cache, meta, D**-0.5, None),
                          iters=5)
            figures["prefill"].append({"tokens": t_len, "tuning": asdict(tune), "seconds": t,
                                       "tflops": flops / t / 1e12, "fraction_of_matmul": flops / t / mm_rate})
            if t_len == 16384 and (best_prefill is None or t < best_prefill[0]):
                best_prefill = (t, tune)
        qs, ks, vs = (x.transpose(0, 1)[None] for x in (q, k.repeat_interleave(H // KVH, 1),
                                                         v.repeat_interleave(H // KVH, 1)))
        t = cuda_time(lambda qs=qs, ks=ks, vs=vs: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True),
                      iters=5)
        figures["prefill"].append({"tokens": t_len, "tuning": "torch_sdpa_flash_no_cache", "seconds": t,
                                   "tflops": flops / t / 1e12, "fraction_of_matmul": flops / t / mm_rate})
    assert best_prefill is not None
    p = best_prefill[1]
    best = replace(best, prefill_block_m=p.prefill_block_m, prefill_block_n=p.prefill_block_n,
                   prefill_warps=p.prefill_warps, prefill_stages=p.prefill_stages)
    figures["chosen"] = asdict(best)
    return best, figures

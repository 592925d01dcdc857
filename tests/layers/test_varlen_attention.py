"""The trainer's recompute attention in one varlen flash call (CUDA) against the per-row SDPA
calls it replaces: the same output and the same gradients for q, k and v."""

from __future__ import annotations

import random

import pytest
import torch

from coserve.layers import attention
from coserve.layers.attention import (
    AttentionMetadata,
    TorchAttention,
    _plain_rows,
    _varlen_attn,
    _varlen_fits,
)
from tests.conftest import rel_err

CUDA = torch.cuda.is_available()


def test_varlen_attention_is_called_causal() -> None:
    attn = _varlen_attn()
    if attn is None:
        pytest.skip("this torch has no usable torch.nn.attention.varlen")
    assert attn.keywords.get("window_size") == (-1, 0) or attn.keywords.get("is_causal") is True


def test_only_half_precision_cuda_rows_take_the_varlen_call() -> None:
    assert not _varlen_fits(torch.zeros(4, 2, 64, dtype=torch.bfloat16))  # CPU
    if CUDA:
        assert _varlen_fits(torch.zeros(4, 2, 128, dtype=torch.bfloat16, device="cuda"))
        assert not _varlen_fits(torch.zeros(4, 2, 128, dtype=torch.float32, device="cuda"))
        assert not _varlen_fits(torch.zeros(4, 2, 260, dtype=torch.float16, device="cuda"))


@pytest.mark.skipif(not CUDA, reason="varlen flash attention runs on CUDA")
@pytest.mark.parametrize("group", [1, 4])
def test_varlen_rows_equal_per_row_calls_forward_and_backward(group: int) -> None:
    if _varlen_attn() is None:
        pytest.skip("this torch has no usable torch.nn.attention.varlen")
    rng = random.Random(group)
    lens = [rng.randint(1, 300) for _ in range(6)] + [257, 257]  # ragged, one run of equal rows
    heads, dim = 8, 128
    t = sum(lens)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q0, k0, v0 = (torch.randn(t, h, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                  for h in (heads, heads // group, heads // group))
    grad_out = torch.randn(t, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    meta = AttentionMetadata.build(q_lens=lens, context_lens=[0] * len(lens), block_tables=[[] for _ in lens],
                                   writes_kv=[False] * len(lens), num_prefill_rows=len(lens), block_size=1,
                                   device="cuda")
    outs, grads = [], []
    for varlen in (False, True):
        q, k, v = (x.clone().requires_grad_(True) for x in (q0, k0, v0))
        if varlen:
            assert attention.VARLEN
            o = TorchAttention().forward(q, k, v, None, meta, dim**-0.5, None)
        else:
            o = _plain_rows(q, k, v, lens, dim**-0.5, group)
        o.backward(grad_out)
        outs.append(o.float())
        grads.append([x.grad.float() for x in (q, k, v)])  # type: ignore[union-attr]
    assert rel_err(outs[1], outs[0]) < 1e-2
    for got, ref in zip(grads[1], grads[0], strict=True):
        assert rel_err(got, ref) < 2e-2

"""Attention through torch SDPA never reaches the cuDNN backend (a plan build per new shape)."""

from __future__ import annotations

import pytest
import torch

import coserve.layers.sdpa as sdpa_module
from coserve.layers.attention import AttentionMetadata, TorchAttention
from coserve.layers.sdpa import sdpa

CUDA = torch.cuda.is_available()


def test_every_attention_call_runs_with_cudnn_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []
    real = sdpa_module.F.scaled_dot_product_attention

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sdpa_module.F, "scaled_dot_product_attention", spy)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    lens = [5, 3, 3]  # one row alone, then a run of two equal ones
    t = sum(lens)
    q, k, v = torch.randn(t, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    meta = AttentionMetadata.build(lens, [0] * 3, [[] for _ in lens], [False] * 3, 3, 16)
    TorchAttention().forward(q, k, v, None, meta, 0.3, None)
    assert seen == [False, False]
    assert torch.backends.cuda.cudnn_sdp_enabled() == before  # restored after each call


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_no_cudnn_kernel_on_cuda_forward_and_backward() -> None:
    from torch.profiler import ProfilerActivity, profile

    q = torch.randn(1, 8, 333, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 8, 333, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 8, 333, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = sdpa(q, k, v, is_causal=True)
        out.sum().backward()
        torch.cuda.synchronize()
    names = [e.key.lower() for e in prof.key_averages()]
    assert not [n for n in names if "cudnn" in n], names
    assert any("flash" in n or "efficient" in n or "fmha" in n for n in names), names
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)

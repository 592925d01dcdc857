"""SwiGLU activation on a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from coserve.layers import triton_fused


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` where ``d = x.shape[-1] // 2``.

    x: [T, 2·d] -> [T, d].
    """
    if torch.is_grad_enabled() and x.requires_grad:
        return _SiluAndMulFn.apply(x)  # type: ignore[no-any-return]
    d = x.shape[-1] // 2
    if triton_fused.use_fused_kernels(x) and x.stride(-1) == 1 and x.shape[-1] == 2 * d:
        x2 = x.reshape(-1, 2 * d)
        out = x2.new_empty(x2.shape[0], d)
        triton_fused.silu_and_mul(out, x2)
        return out.view(*x.shape[:-1], d)
    return F.silu(x[..., :d]) * x[..., d:]


class _SiluAndMulFn(torch.autograd.Function):
    """:func:`silu_and_mul` with a hand-written backward (one autograd node; the forward is the
    fused kernel where it applies). With ``g, u`` the halves and ``σ = sigmoid(g)``:
    ``dg = dy · u · σ · (1 + g · (1 − σ))``, ``du = dy · g · σ``, in fp32."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return silu_and_mul(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return silu_and_mul_backward(x, grad)


def silu_and_mul_backward(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``∂loss/∂x`` of :func:`silu_and_mul` given ``grad`` (see :class:`_SiluAndMulFn`)."""
    if (triton_fused.use_fused_kernels(x, grad) and x.dim() == 2 and grad.dim() == 2
            and x.stride(-1) == 1 and grad.stride(-1) == 1):
        out = torch.empty_like(x)
        triton_fused.silu_and_mul_backward(out, x, grad.to(x.dtype))
        return out
    d = x.shape[-1] // 2
    g, u = x[..., :d].float(), x[..., d:].float()
    sig = torch.sigmoid(g)
    dy = grad.float()
    dg = dy * u * sig * (1 + g * (1 - sig))
    du = dy * g * sig
    return torch.cat([dg, du], dim=-1).to(x.dtype)

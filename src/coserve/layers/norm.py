"""RMSNorm, computed in fp32 exactly as Hugging Face Llama does."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from coserve.layers import triton_fused


class AddNorm(NamedTuple):
    """A residual add and the norm of its result."""

    hidden: torch.Tensor  # the residual stream after the add
    normed: torch.Tensor  # norm(hidden)


class RMSNorm(nn.Module):
    """``y = weight * (x / sqrt(mean(x², -1) + eps))``; statistics in fp32, result in ``x.dtype``.

    x: [T, d] -> [T, d].
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return _RMSNormFn.apply(x, self)  # type: ignore[no-any-return]
        if triton_fused.use_fused_kernels(x, self.weight) and x.stride(-1) == 1:
            x2 = x.reshape(-1, x.shape[-1])
            out = x2.new_empty(x2.shape, dtype=torch.promote_types(self.weight.dtype, x.dtype))
            triton_fused.rms_norm(out, x2, self.weight, self.eps)
            return out.view(x.shape)
        return self._reference(x)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> AddNorm:
        """``hidden = residual + x`` (in their dtype), then ``normed = self(hidden)``, in one pass
        over the rows where the fused kernels apply.

        x, residual: [T, d] -> hidden [T, d], normed [T, d].
        """
        if (
            triton_fused.use_fused_kernels(x, residual, self.weight)
            and x.dtype == residual.dtype
            and x.shape == residual.shape
            and x.stride(-1) == 1
            and residual.stride(-1) == 1
        ):
            x2 = x.reshape(-1, x.shape[-1])
            r2 = residual.reshape(-1, x.shape[-1])
            hidden = x2.new_empty(x2.shape)
            out = x2.new_empty(x2.shape, dtype=torch.promote_types(self.weight.dtype, x.dtype))
            triton_fused.rms_norm(out, x2, self.weight, self.eps, r2, hidden)
            return AddNorm(hidden.view(x.shape), out.view(x.shape))
        hidden = residual + x
        return AddNorm(hidden, self(hidden))

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm with a hand-written backward (the weight is frozen): one autograd node instead
    of one per elementwise op, for the trainer's layer recompute. The forward is the module's
    own (the fused kernel where it applies).

    ``dx = rstd · (g − x̂ · mean(g · x̂))`` with ``g = (dy · weight)`` in fp32, ``x̂ = x · rstd``.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.norm = norm
        return norm(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return rms_norm_backward(x, ctx.norm, grad), None


def rms_norm_backward(x: torch.Tensor, norm: RMSNorm, grad: torch.Tensor) -> torch.Tensor:
    """``∂loss/∂x`` of ``norm(x)`` given ``grad = ∂loss/∂norm(x)`` (the weight is frozen):
    ``rstd · (g − x̂ · mean(g · x̂))`` with ``g = grad · weight`` in fp32, ``x̂ = x · rstd``."""
    if (triton_fused.use_fused_kernels(x, grad, norm.weight) and x.dim() == 2 and grad.shape == x.shape
            and x.stride(-1) == 1 and grad.stride(-1) == 1):
        out = torch.empty_like(x)
        triton_fused.rms_norm_backward(out, x, norm.weight, norm.eps, grad)
        return out
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)
    xhat = xf * rstd
    g = (grad * norm.weight).float()
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype)

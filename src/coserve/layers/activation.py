"""SwiGLU activation on a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from coserve.layers import triton_fused


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` where ``d = x.shape[-1] // 2``.

    x: [T, 2·d] -> [T, d].
    """
    d = x.shape[-1] // 2
    if triton_fused.use_fused_kernels(x) and x.stride(-1) == 1 and x.shape[-1] == 2 * d:
        x2 = x.reshape(-1, 2 * d)
        out = x2.new_empty(x2.shape[0], d)
        triton_fused.silu_and_mul(out, x2)
        return out.view(*x.shape[:-1], d)
    return F.silu(x[..., :d]) * x[..., d:]

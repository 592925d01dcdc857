"""SwiGLU activation on a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` where ``d = x.shape[-1] // 2``.

    x: [T, 2·d] -> [T, d].
    """
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]

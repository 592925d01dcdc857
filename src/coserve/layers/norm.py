"""RMSNorm, computed in fp32 exactly as Hugging Face Llama does."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``y = weight * (x / sqrt(mean(x², -1) + eps))``; statistics in fp32, result in ``x.dtype``.

    x: [T, d] -> [T, d].
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

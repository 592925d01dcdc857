"""Rotary position embedding (neox / Hugging Face "rotate_half" layout), with llama3 scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from coserve.layers import triton_fused
from coserve.models.config import RopeConfig


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies ``1 / theta^(2i/d)``, with llama3 band scaling when configured. [d/2] fp32."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "default":
        return inv_freq
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between smoothed.
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k in place of a copy.

    ``out = x·cos(p·f) + rotate_half(x)·sin(p·f)`` with ``f`` the inverse frequencies repeated
    twice along the head dimension, ``p`` the token position.
    q: [T, H, D], k: [T, KVH, D], positions: [T] int -> (q', k') same shapes and dtypes.
    """

    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, rope)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos_cache: torch.Tensor
        self.sin_cache: torch.Tensor
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if (
            triton_fused.use_fused_kernels(q, k)
            and q.dim() == k.dim() == 3
            and q.stride(-1) == k.stride(-1) == 1
        ):
            q_out = q.new_empty(q.shape)
            k_out = k.new_empty(k.shape)
            triton_fused.rotary(q_out, k_out, q, k, positions, self.cos_cache, self.sin_cache)
            return q_out, k_out
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        return _apply(q, cos, sin), _apply(k, cos, sin)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(dtype)

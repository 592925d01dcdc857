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
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            return _RotaryFn.apply(q, k, positions, self)  # type: ignore[no-any-return]
        return self.rotate(positions, q, k, self.sin_cache)

    def neg_sin_cache(self) -> torch.Tensor:
        """``−sin`` (made on first use): RoPE's backward is RoPE by the opposite angle."""
        cache = getattr(self, "_neg_sin", None)
        if cache is None or cache.device != self.sin_cache.device:
            cache = self._neg_sin = -self.sin_cache
        return cache

    def rotate(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, sin_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotation with ``sin_cache`` (``sin_cache`` or :meth:`neg_sin_cache`)."""
        if (
            triton_fused.use_fused_kernels(q, k)
            and q.dim() == k.dim() == 3
            and q.stride(-1) == k.stride(-1) == 1
        ):
            q_out = q.new_empty(q.shape)
            k_out = k.new_empty(k.shape)
            triton_fused.rotary(q_out, k_out, q, k, positions, self.cos_cache, sin_cache)
            return q_out, k_out
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = sin_cache[positions].unsqueeze(1)
        return _apply(q, cos, sin), _apply(k, cos, sin)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(dtype)


class _RotaryFn(torch.autograd.Function):
    """RoPE with a hand-written backward (one autograd node for q and k; the forward is the
    fused kernel where it applies). The rotation is orthogonal, its transpose is the rotation
    by ``−angle``: ``dx = dy·cos + rotate_half(dy)·(−sin)`` (cos/sin repeat over the halves)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(positions)
        ctx.rope = rope
        ctx.shapes = (q.shape, k.shape, q.dtype, k.dtype, q.device)
        return rope.rotate(positions, q, k, rope.sin_cache)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx, gq: torch.Tensor | None, gk: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        (positions,) = ctx.saved_tensors
        rope: RotaryEmbedding = ctx.rope
        q_shape, k_shape, q_dtype, k_dtype, device = ctx.shapes
        if gq is None:
            gq = torch.zeros(q_shape, dtype=q_dtype, device=device)
        if gk is None:
            gk = torch.zeros(k_shape, dtype=k_dtype, device=device)
        dq, dk = rope.rotate(positions, gq.contiguous(), gk.contiguous(), rope.neg_sin_cache())
        return dq, dk, None, None

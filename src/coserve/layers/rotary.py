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

    def split_qkv(
        self, positions: torch.Tensor, qkv: torch.Tensor, heads: tuple[int, int, int],
        tables: RopeTables | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q [T, H, D], k [T, KVH, D]`` (RoPE applied) and ``v [T, KVH, D]`` (a view) of the fused
        projection output ``qkv [T, (H + 2·KVH)·D]``; ``heads = (H, KVH, D)``.

        Without autograd: the views and :meth:`rotate` (the ops the engine always ran). With it:
        one autograd node
        (:class:`_QKVRotaryFn`) for the split, the three reshapes and the rotation, whose
        backward writes ``dq``/``dk`` (rotated back) and ``dv`` straight into one ``dqkv``
        instead of concatenating them. ``tables`` (:meth:`tables` of these positions) lets the
        torch rotation skip its per-call gathers.
        """
        if tables is not None and tables.positions is not positions:
            raise ValueError("rope tables of other positions")
        if torch.is_grad_enabled() and qkv.requires_grad:
            return _QKVRotaryFn.apply(qkv, positions, self, heads, tables)  # type: ignore[no-any-return]
        q, k, v = split_heads(qkv, heads)
        q, k = self.rotate(positions, q, k, self.sin_cache)
        return q, k, v

    def split_rotate(
        self, positions: torch.Tensor, qkv: torch.Tensor, heads: tuple[int, int, int], tables: RopeTables,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`split_qkv`'s ops with autograd (:class:`_QKVRotaryFn`'s forward), called without
        it: new ``q``, ``k`` rotated (by the kernel or with ``tables``), ``v`` a view of ``qkv``.
        The trainer's attention by hand (``coserve.trainer.backward``) calls it too."""
        q, k, v = split_heads(qkv, heads)
        q_out, k_out = q.new_empty(q.shape), k.new_empty(k.shape)
        self._rotate_into(positions, q, k, q_out, k_out, tables, backward=False)
        return q_out, k_out, v

    def split_rotate_backward(
        self, positions: torch.Tensor, gq: torch.Tensor | None, gk: torch.Tensor | None, gv: torch.Tensor | None,
        shape: torch.Size, dtype: torch.dtype, device: torch.device, heads: tuple[int, int, int],
        tables: RopeTables,
    ) -> torch.Tensor:
        """``dqkv`` (``shape``, ``dtype``, ``device``: the fused projection output's) of
        :meth:`split_rotate` given the gradients of its outputs (None: zeros): ``dq``/``dk`` rotated
        back straight into their columns, ``dv`` copied beside them."""
        dqkv = torch.empty(shape, dtype=dtype, device=device)
        dq, dk, dv = split_heads(dqkv, heads)
        if gq is None:
            gq = torch.zeros(dq.shape, dtype=dtype, device=device)
        if gk is None:
            gk = torch.zeros(dk.shape, dtype=dtype, device=device)
        self._rotate_into(positions, gq, gk, dq, dk, tables, backward=True)
        if gv is None:
            dv.zero_()
        else:
            dv.copy_(gv)
        return dqkv

    def tables(self, positions: torch.Tensor) -> RopeTables:
        """:class:`RopeTables` of ``positions``, made on first use."""
        return RopeTables(self, positions)

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

    def _rotate_into(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor,
        k_out: torch.Tensor, tables: RopeTables, backward: bool,
    ) -> None:
        """:meth:`rotate` by the angle (``backward``: by minus the angle) written into ``q_out``,
        ``k_out`` (views of a larger tensor allowed: unit last stride), the kernel's rotation
        where it applies, else the torch one with the gathered ``tables``."""
        if triton_fused.use_fused_kernels(q, k) and q.dim() == k.dim() == 3:
            q, k = _unit_last_stride(q), _unit_last_stride(k)
            sin_cache = self.neg_sin_cache() if backward else self.sin_cache
            triton_fused.rotary(q_out, k_out, q, k, positions, self.cos_cache, sin_cache)
            return
        cos, sin_f, sin_b = tables.reference()
        sin = sin_b if backward else sin_f
        _apply_rolled(q, cos, sin, q_out)
        _apply_rolled(k, cos, sin, k_out)


class RopeTables:
    """``cos``/``sin`` rows of one batch's positions for the torch rotation, gathered once for
    every layer: the trainer's recompute rotates 32 layers' q/k at the same positions, and each
    rotation otherwise gathers them anew (twice: forward and backward).

    ``reference() -> (cos, sin_f, sin_b)``, each ``[T, 1, D]`` fp32: ``cos`` as gathered; ``sin_f``
    the forward's ``sin`` with its first half negated, so that ``rotate_half(x)·sin`` is
    ``roll(x, D/2)·sin_f`` (the same products: ``(−a)·b = a·(−b)`` exactly); ``sin_b`` the same
    for the backward's ``−sin``. Made on first use (the fused kernel gathers on its own).
    """

    def __init__(self, rope: RotaryEmbedding, positions: torch.Tensor) -> None:
        self.positions = positions
        self._rope = rope
        self._reference: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def reference(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._reference is None:
            rope = self._rope
            cos = rope.cos_cache[self.positions].unsqueeze(1)
            sin = rope.sin_cache[self.positions].unsqueeze(1)
            half = sin.shape[-1] // 2
            sin_f = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
            self._reference = (cos, sin_f, -sin_f)
        return self._reference


def split_heads(qkv: torch.Tensor, heads: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views ``q [T, H, D], k [T, KVH, D], v [T, KVH, D]`` of ``qkv [T, (H + 2·KVH)·D]``."""
    num_heads, num_kv_heads, head_dim = heads
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split_with_sizes([q_size, kv_size, kv_size], dim=-1)
    return (q.reshape(-1, num_heads, head_dim), k.reshape(-1, num_kv_heads, head_dim),
            v.reshape(-1, num_kv_heads, head_dim))


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(dtype)


def _apply_rolled(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, out: torch.Tensor) -> None:
    """:func:`_apply` into ``out`` with ``sin_signed`` (:class:`RopeTables`): the same products
    and sums, so the same values bit for bit, in fewer ops (a ``roll`` for the slices, negation
    and ``cat``; the last add written into ``out`` where the dtypes let it)."""
    xf = x.float()
    rotated = xf.roll(xf.shape[-1] // 2, dims=-1)
    if out.dtype == torch.float32:
        torch.add(xf * cos, rotated * sin_signed, out=out)
    else:
        out.copy_(xf * cos + rotated * sin_signed)


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


class _QKVRotaryFn(torch.autograd.Function):
    """:meth:`RotaryEmbedding.split_qkv` with autograd: ``qkv -> (rope(q), rope(k), v)`` in one
    node instead of five (a split, three reshapes, :class:`_RotaryFn`), and a backward that
    rotates ``dq``/``dk`` back straight into their columns of ``dqkv`` and copies ``dv`` beside
    them: the split's backward would concatenate the three into a new tensor. ``v`` is returned
    as a view of ``qkv`` (nothing downstream writes to it)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
        heads: tuple[int, int, int], tables: RopeTables | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # (no tables given: this call's own, gathered on first use and kept for the backward)
        tables = tables if tables is not None else rope.tables(positions)
        q_out, k_out, v = rope.split_rotate(positions, qkv, heads, tables)
        ctx.save_for_backward(positions)
        ctx.rope, ctx.heads, ctx.tables = rope, heads, tables
        ctx.qkv_meta = (qkv.shape, qkv.dtype, qkv.device)
        return q_out, k_out, v

    @staticmethod
    def backward(  # type: ignore[override]
        ctx, gq: torch.Tensor | None, gk: torch.Tensor | None, gv: torch.Tensor | None
    ) -> tuple[torch.Tensor, None, None, None, None]:
        (positions,) = ctx.saved_tensors
        shape, dtype, device = ctx.qkv_meta
        dqkv = ctx.rope.split_rotate_backward(positions, gq, gk, gv, shape, dtype, device, ctx.heads, ctx.tables)
        return dqkv, None, None, None, None

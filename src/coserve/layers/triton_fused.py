"""Fused elementwise kernels for inference: residual add + RMSNorm, RoPE, SwiGLU.

Each replaces a chain of small torch kernels (RMSNorm alone is eight: cast, square, mean, add,
rsqrt, multiply, cast, scale) with one pass over its tensors, and keeps the reference's rounding
points: the residual sum is rounded to the input dtype before the fp32 statistics, the normalized
row is rounded to the input dtype before the weight multiplies it, ``silu(gate)`` is rounded
before it multiplies ``up``.

The torch code in ``norm.py``, ``rotary.py`` and ``activation.py`` stays the reference and the
only path that autograd sees: these kernels have no backward. :func:`use_fused_kernels` decides,
per call, between the two.

No argument is marked :func:`~coserve.layers.triton_attention.varying`: the integers are row
strides and sizes that the model's dimensions decide (a one-token step's q/k views have tighter
rows, divisible by 16 all the same) and a step's token count is only the grid, so which variants
a step compiles does not depend on its shape.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from coserve.layers.triton_attention import jit, triton_usable

if TYPE_CHECKING:
    import triton.language as tl

ENABLED = os.environ.get("COSERVE_FUSED_KERNELS", "1") != "0"
"""Use the fused kernels where they apply; ``COSERVE_FUSED_KERNELS=0`` keeps the torch references
everywhere (the before/after switch of the benchmarks)."""

ON_CPU = False
"""Also run them on CPU tensors when ``TRITON_INTERPRET=1`` (tests turn this on; the interpreter is
far slower than the torch references, so nothing else should)."""


def use_fused_kernels(*tensors: torch.Tensor) -> bool:
    """Whether an op over ``tensors`` (the first one's device decides) runs the fused kernels.

    Never when autograd may need the op's graph (grad mode on and any input requires grad: the
    trainer's layer recompute), never without Triton, and on CPU only with :data:`ON_CPU` set and
    Triton's interpreter on.
    """
    if not ENABLED:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    device = tensors[0].device
    if device.type == "cpu" and not ON_CPU:
        return False
    return triton_usable(device)


def _pow2_at_least(n: int, lo: int = 1) -> int:
    return max(lo, 1 << max(n - 1, 0).bit_length())


def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, r_out_ptr,
    s_x, s_r, s_out, s_r_out, d, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < d
    x = tl.load(x_ptr + t * s_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + t * s_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(r_out_ptr + t * s_r_out + offs, x, mask=mask)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / d + eps)
    y = (h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * s_out + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> None:
    """RMSNorm, after a residual add when ``residual`` is given:
    ``h = x + residual`` (rounded to ``x.dtype``; ``h = x`` without a residual),
    ``out = weight · (h / sqrt(mean(h², -1) + eps))`` with fp32 statistics, the normalized row
    rounded to ``x.dtype`` before the product, ``residual_out = h``.

    x, residual, residual_out: [T, d] of one dtype (row stride free, unit column stride);
    weight: [d]; out: [T, d] of ``promote(weight.dtype, x.dtype)``.
    """
    t_rows, d = x.shape
    assert x.stride(1) == 1 and out.stride(1) == 1 and weight.is_contiguous()
    has_residual = residual is not None
    if has_residual:
        assert residual is not None and residual_out is not None
        assert residual.dtype == x.dtype == residual_out.dtype
        assert residual.stride(1) == 1 and residual_out.stride(1) == 1
    if t_rows == 0:
        return
    block = _pow2_at_least(d, 16)
    r = residual if residual is not None else x
    r_out = residual_out if residual_out is not None else out
    jit(_rms_norm_kernel)[(t_rows,)](
        x, r, weight, out, r_out,
        x.stride(0), r.stride(0), out.stride(0), r_out.stride(0), d, eps,
        HAS_RESIDUAL=has_residual, BLOCK=block, num_warps=max(1, min(16, block // 512)),
    )


def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr,
    s_qt, s_qh, s_kt, s_kh, s_qot, s_qoh, s_kot, s_koh, s_cos,
    H: tl.constexpr, KVH: tl.constexpr, HALF: tl.constexpr,
    H_PAD: tl.constexpr, KVH_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    mask_d = offs_d < HALF
    # Block-shaped position load: the interpreter trips on scalar & block masks.
    pos = tl.load(pos_ptr + t + offs_d * 0).to(tl.int64)
    # The cache rows are [cos(p·f), cos(p·f)] (f repeated twice): the first half is the whole row.
    c = tl.load(cos_ptr + pos * s_cos + offs_d, mask=mask_d, other=0.0)[None, :]
    s = tl.load(sin_ptr + pos * s_cos + offs_d, mask=mask_d, other=0.0)[None, :]

    offs_h = tl.arange(0, H_PAD)
    mask = (offs_h[:, None] < H) & mask_d[None, :]
    src = q_ptr + t * s_qt + offs_h[:, None] * s_qh + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = q_out_ptr + t * s_qot + offs_h[:, None] * s_qoh + offs_d[None, :]
    tl.store(dst, (x1 * c - x2 * s).to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * c + x1 * s).to(q_out_ptr.dtype.element_ty), mask=mask)

    offs_kh = tl.arange(0, KVH_PAD)
    mask_k = (offs_kh[:, None] < KVH) & mask_d[None, :]
    src_k = k_ptr + t * s_kt + offs_kh[:, None] * s_kh + offs_d[None, :]
    y1 = tl.load(src_k, mask=mask_k, other=0.0).to(tl.float32)
    y2 = tl.load(src_k + HALF, mask=mask_k, other=0.0).to(tl.float32)
    dst_k = k_out_ptr + t * s_kot + offs_kh[:, None] * s_koh + offs_d[None, :]
    tl.store(dst_k, (y1 * c - y2 * s).to(k_out_ptr.dtype.element_ty), mask=mask_k)
    tl.store(dst_k + HALF, (y2 * c + y1 * s).to(k_out_ptr.dtype.element_ty), mask=mask_k)


def rotary(
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    """Neox-layout RoPE, in fp32: with ``x = [x1, x2]`` the two halves of one head,
    ``c, s = cos_cache[p, :D/2], sin_cache[p, :D/2]`` at the token's position ``p``,
    ``out = [x1·c − x2·s, x2·c + x1·s]`` rounded to the input dtype.

    q, q_out: [T, H, D]; k, k_out: [T, KVH, D] (token and head strides free, unit last stride;
    the outputs may be the inputs); positions: [T] int; cos_cache, sin_cache: [P, D] fp32, each
    row ``[cos(p·f), cos(p·f)]`` (resp. sin) with ``f`` the D/2 inverse frequencies.
    """
    t_rows, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    assert head_dim % 2 == 0 and k.shape == (t_rows, kv_heads, head_dim)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert all(x.stride(2) == 1 for x in (q, k, q_out, k_out))
    assert cos_cache.stride() == sin_cache.stride() and cos_cache.stride(1) == 1
    if t_rows == 0:
        return
    half = head_dim // 2
    jit(_rotary_kernel)[(t_rows,)](
        q, k, q_out, k_out, positions, cos_cache, sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_cache.stride(0),
        H=heads, KVH=kv_heads, HALF=half, H_PAD=_pow2_at_least(heads),
        KVH_PAD=_pow2_at_least(kv_heads), HALF_PAD=_pow2_at_least(half),
        num_warps=4,
    )


def _silu_and_mul_kernel(
    x_ptr, out_ptr, s_x, s_out, d,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(x_ptr + t * s_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * s_x + d + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * s_out + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    """SwiGLU: ``out = silu(x[:, :d]) · x[:, d:]`` with ``silu(g) = g / (1 + exp(−g))`` in fp32,
    rounded to the input dtype before the product.

    x: [T, 2·d] (row stride free, unit column stride); out: [T, d], same dtype.
    """
    t_rows, two_d = x.shape
    d = two_d // 2
    assert two_d == 2 * d and out.shape == (t_rows, d) and out.dtype == x.dtype
    assert x.stride(1) == 1 and out.stride(1) == 1
    if t_rows == 0 or d == 0:
        return
    block = min(1024, _pow2_at_least(d, 16))
    jit(_silu_and_mul_kernel)[(t_rows, -(-d // block))](
        x, out, x.stride(0), out.stride(0), d, BLOCK=block, num_warps=4,
    )


# ---------------------------------------------------------------- backwards (the trainer's)


def _silu_and_mul_backward_kernel(
    x_ptr, g_ptr, out_ptr, s_x, s_g, s_out, d,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(x_ptr + t * s_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * s_x + d + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(g_ptr + t * s_g + offs, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    d_gate = dy * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = dy * gate * sig
    tl.store(out_ptr + t * s_out + offs, d_gate.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + t * s_out + d + offs, d_up.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_backward(out: torch.Tensor, x: torch.Tensor, grad: torch.Tensor) -> None:
    """The gradient of :func:`silu_and_mul` with respect to its input, in fp32: with ``g, u`` the
    halves of ``x`` and ``σ = sigmoid(g)``, ``out = [dy·u·σ·(1 + g·(1 − σ)), dy·g·σ]``.

    x, out: [T, 2·d]; grad: [T, d] (row strides free, unit column strides), one dtype.
    """
    t_rows, two_d = x.shape
    d = two_d // 2
    assert out.shape == x.shape and grad.shape == (t_rows, d)
    assert x.stride(1) == 1 and out.stride(1) == 1 and grad.stride(1) == 1
    if t_rows == 0 or d == 0:
        return
    block = min(1024, _pow2_at_least(d, 16))
    jit(_silu_and_mul_backward_kernel)[(t_rows, -(-d // block))](
        x, grad, out, x.stride(0), grad.stride(0), out.stride(0), d, BLOCK=block, num_warps=4,
    )


def _rms_norm_backward_kernel(
    x_ptr, g_ptr, w_ptr, out_ptr, s_x, s_g, s_out, d, eps,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < d
    x = tl.load(x_ptr + t * s_x + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / d + eps)
    xhat = x * rstd
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + t * s_g + offs, mask=mask, other=0.0).to(tl.float32) * w
    dot = tl.sum(g * xhat, 0) / d
    tl.store(out_ptr + t * s_out + offs, (rstd * (g - xhat * dot)).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_backward(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                      grad: torch.Tensor) -> None:
    """The gradient of :func:`rms_norm` (no residual) with respect to ``x``, the weight frozen, in
    fp32: ``out = rstd · (g − x̂ · mean(g · x̂))`` with ``g = grad · weight``, ``x̂ = x · rstd``.

    x, grad, out: [T, d] (row strides free, unit column strides); weight: [d].
    """
    t_rows, d = x.shape
    assert grad.shape == x.shape and out.shape == x.shape and weight.is_contiguous()
    assert x.stride(1) == 1 and grad.stride(1) == 1 and out.stride(1) == 1
    if t_rows == 0:
        return
    block = _pow2_at_least(d, 16)
    jit(_rms_norm_backward_kernel)[(t_rows,)](
        x, grad, weight, out, x.stride(0), grad.stride(0), out.stride(0), d, eps,
        BLOCK=block, num_warps=max(1, min(16, block // 512)),
    )

"""Causal attention of rows with no cached prefix (the trainer's recompute) in one varlen flash
call on CUDA, with autograd.

``out[s[i]:s[i+1]] = softmax(q_i k_iᵀ · scale + causal) v_i`` for each row ``i`` of the flat batch,
``q_i = q[s[i]:s[i+1]]`` (``s = cu_seqlens``), query head ``h`` reading K/V head ``h // group``.
q: [T, H, D], k, v: [T, KVH, D] (unit last stride), cu_seqlens: [R+1] int32 on q's device -> [T, H, D].

One call instead of one SDPA call per row length: session 7 measured the per-row calls' CPU time
above the attention's GPU time, so the trainer's GPU ran dry there, waiting for its CPU. With
torch's varlen op the attention recompute stayed CPU-bound after session 8 (H200, the 8B shape,
~1,024-token tasks: 1.61 ms of CPU against 1.02 ms of GPU, p50), hence the trainer's own node.

Implementations, chosen by ``COSERVE_VARLEN_ATTN`` (read at import; see :data:`VARLEN_IMPLS`):

* ``flash`` (default since session 10): ``aten._flash_attention_forward`` called directly, its own
  derivative for the backward (a C++ autograd node that calls ``_flash_attention_backward``):
  one dispatch each way and no Python in the backward, K/V with their own head count (flash
  shares each K/V head with its query-head group). Where that derivative is missing (checked
  once on meta tensors, :func:`_native_backward`) it is ``flash_fn``; where aten's signatures
  are not the ones called (checked once, :func:`_flash_ops`), ``torch``.
* ``flash_fn``: :class:`FlashVarlenFn`, the same two aten ops in a Python autograd function (one
  Python node; ~8 µs more host time each way than ``flash`` on the dev VM, on meta tensors).
* ``torch`` (``1`` too): ``torch.nn.attention.varlen.varlen_attn`` (session 7's path): a Python
  ``custom_op`` on both passes (two Python dispatches and a ``zeros`` launch per forward, a Python
  dispatch and an ``empty`` per backward), K/V heads repeated where it takes no ``enable_gqa``.
* ``0``: neither; the rows take one SDPA call per row length (``attention._plain_rows``).

Session 10 on the H200 (8B shape, ``bench/profile_trainer_cpu.py``, one layer's recompute): all
three pass the GPU tests against fp32 SDPA with the same loss; host ms of the attention forward /
backward 1.25 / 0.24 (``flash``), 1.47 / 0.23 (``flash_fn``), 1.93 / 0.26 (``torch``), with GPU ms
0.28 / 0.33 for each (``bench/results/engine_h200/session10/trainer_attn_*``).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable
from typing import Any, cast

import torch

logger = logging.getLogger(__name__)

VarlenAttn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]
"""``(q, k, v, cu_seqlens, max_len, scale) -> out``, as in the module docstring (``max_len``:
the longest row)."""


# (name, type) of the positional arguments FlashVarlenFn passes, in order; None: any name (the
# RNG slots were philox_seed/philox_offset before torch 2.6 and rng_state/unused after).
_FWD_ARGS = (("query", "Tensor"), ("key", "Tensor"), ("value", "Tensor"), ("cum_seq_q", "Optional[Tensor]"),
             ("cum_seq_k", "Optional[Tensor]"), ("max_q", "int"), ("max_k", "int"), ("dropout_p", "float"),
             ("is_causal", "bool"), ("return_debug_mask", "bool"))
_BWD_ARGS = (("grad_out", "Tensor"), ("query", "Tensor"), ("key", "Tensor"), ("value", "Tensor"), ("out", "Tensor"),
             ("logsumexp", "Tensor"), ("cum_seq_q", "Tensor"), ("cum_seq_k", "Tensor"), ("max_q", "int"),
             ("max_k", "int"), ("dropout_p", "float"), ("is_causal", "bool"), (None, "Tensor"), (None, "Tensor"))


def _schema_fits(op: Any, positional: tuple[tuple[str | None, str], ...], num_returns: int) -> bool:
    """Whether ``op``'s schema takes exactly ``positional`` before its keyword-only arguments, a
    keyword-only ``scale`` and nothing else without a default, and returns ``num_returns`` tensors."""
    schema = op._schema
    args = [a for a in schema.arguments if not a.kwarg_only]
    kwargs = {a.name: a for a in schema.arguments if a.kwarg_only}
    if len(args) != len(positional) or "scale" not in kwargs:
        return False
    for arg, (name, type_name) in zip(args, positional, strict=True):
        if str(arg.type) != type_name or (name is not None and arg.name != name):
            return False
    if any(not a.has_default_value() for n, a in kwargs.items() if n != "scale"):
        return False
    returns = schema.returns
    return len(returns) == num_returns and all(str(r.type) == "Tensor" for r in returns)


@functools.cache
def _flash_ops() -> tuple[Any, Any] | None:
    """``(aten._flash_attention_forward.default, aten._flash_attention_backward.default)`` where
    their signatures are the ones :class:`FlashVarlenFn` calls (``_FWD_ARGS`` / ``_BWD_ARGS``, a
    keyword ``scale``; five outputs forward, three backward), else None."""
    try:
        fwd = torch.ops.aten._flash_attention_forward.default
        bwd = torch.ops.aten._flash_attention_backward.default
    except (AttributeError, RuntimeError):
        return None
    if not (_schema_fits(fwd, _FWD_ARGS, 5) and _schema_fits(bwd, _BWD_ARGS, 3)):
        logger.warning("aten._flash_attention_forward/_backward of torch %s take other arguments: "
                       "the trainer's varlen attention falls back to torch.nn.attention.varlen", torch.__version__)
        return None
    return fwd, bwd


@functools.cache
def _native_backward() -> bool:
    """Whether aten's flash forward differentiates itself (its derivative: the flash backward)
    for K/V with fewer heads than q: one tiny call on meta tensors, made once."""
    ops = _flash_ops()
    if ops is None:
        return False
    try:
        with torch.enable_grad():
            q, k, v = (torch.empty(4, h, 8, device="meta", dtype=torch.bfloat16, requires_grad=True) for h in (4, 2, 2))
            cu = torch.tensor([0, 4], dtype=torch.int32, device="meta")
            out = ops[0](q, k, v, cu, cu, 4, 4, 0.0, True, False, scale=1.0)[0]
            grads = torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
    except (RuntimeError, NotImplementedError):
        return False
    return all(g.shape == x.shape for g, x in zip(grads, (q, k, v), strict=True))


def _flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, scale: float
) -> torch.Tensor:
    """The module docstring's attention: aten's flash forward, differentiated by its own
    derivative (:func:`_native_backward`)."""
    ops = _flash_ops()
    assert ops is not None
    return cast(torch.Tensor, ops[0](q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True, False,
                                     scale=scale)[0])


class FlashVarlenFn(torch.autograd.Function):
    """The module docstring's attention through aten's flash ops: one node, one flash kernel each
    way (dropout 0, causal; no debug mask).

    Saves q, k, v, the output, its log-sum-exp ``[H, T]`` fp32 and the forward's two RNG outputs
    (unused without dropout; the backward takes them as SDPA's own derivative passes them). The
    backward's ``dk``/``dv`` come back with K/V's head count (flash sums the group's gradients).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
        scale: float,
    ) -> torch.Tensor:
        ops = _flash_ops()
        assert ops is not None
        out, lse, rng, unused, _ = ops[0](q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True, False,
                                          scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng, unused)
        ctx.max_len, ctx.scale = max_len, scale
        return cast(torch.Tensor, out)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, None]:
        ops = _flash_ops()
        assert ops is not None
        q, k, v, out, lse, cu_seqlens, rng, unused = ctx.saved_tensors
        n = ctx.max_len
        dq, dk, dv = ops[1](grad_out, q, k, v, out, lse, cu_seqlens, cu_seqlens, n, n, 0.0, True, rng, unused,
                            scale=ctx.scale)
        return dq, dk, dv, None, None, None


def _flash_fn_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, scale: float
) -> torch.Tensor:
    """:class:`FlashVarlenFn`; without autograd (no input requires grad) aten's forward alone."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out: torch.Tensor = FlashVarlenFn.apply(q, k, v, cu_seqlens, max_len, scale)
        return out
    with torch.no_grad():
        return _flash_attention(q, k, v, cu_seqlens, max_len, scale)


@functools.cache
def _torch_varlen_attn() -> functools.partial[torch.Tensor] | None:
    """torch's varlen flash attention (``torch.nn.attention.varlen.varlen_attn``, with autograd),
    called causal (with GQA where it takes ``enable_gqa``), or None where this torch lacks it or
    takes other arguments (its signature changed between releases)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kwargs: dict[str, Any]
    if "window_size" in params:
        kwargs = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        kwargs = {"is_causal": True}
    else:
        return None
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return functools.partial(cast(Callable[..., torch.Tensor], varlen_attn), **kwargs)


def _torch_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, scale: float
) -> torch.Tensor:
    """The module docstring's attention through :func:`_torch_varlen_attn` (K/V heads repeated
    for their query-head groups where it takes no ``enable_gqa``)."""
    attn = _torch_varlen_attn()
    assert attn is not None
    group = q.shape[1] // k.shape[1]
    if group > 1 and "enable_gqa" not in attn.keywords:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out: torch.Tensor = attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale)
    return out


def _pick_flash() -> tuple[str, VarlenAttn] | None:
    if _flash_ops() is not None and _native_backward():
        return "flash", _flash_attention
    return _pick_flash_fn()


def _pick_flash_fn() -> tuple[str, VarlenAttn] | None:
    if _flash_ops() is not None:
        return "flash_fn", _flash_fn_attention
    return _pick_torch()


def _pick_torch() -> tuple[str, VarlenAttn] | None:
    return ("torch", _torch_attention) if _torch_varlen_attn() is not None else None


VARLEN_IMPLS: dict[str, Callable[[], tuple[str, VarlenAttn] | None]] = {
    "flash": _pick_flash,
    "1": _pick_torch,
    "flash_fn": _pick_flash_fn,
    "torch": _pick_torch,
    "0": lambda: None,
}
"""``COSERVE_VARLEN_ATTN`` value -> the implementation it picks, as ``(name, function)``, or None
(per-row SDPA calls). ``flash`` falls back to ``flash_fn``, ``flash_fn`` to ``torch`` (see the
module docstring)."""

VARLEN_ATTN = os.environ.get("COSERVE_VARLEN_ATTN", "flash")
if VARLEN_ATTN not in VARLEN_IMPLS:
    raise ValueError(f"COSERVE_VARLEN_ATTN={VARLEN_ATTN!r}: expected one of {', '.join(VARLEN_IMPLS)}")


@functools.cache
def varlen_impl() -> tuple[str, VarlenAttn] | None:
    """The implementation :data:`VARLEN_ATTN` picks on this torch (decided once)."""
    return VARLEN_IMPLS[VARLEN_ATTN]()


def varlen_fits(q: torch.Tensor) -> bool:
    """Whether the varlen flash call takes ``q`` (CUDA, half precision, a head size flash has
    kernels for, an implementation available); fp32 models and odd head sizes keep the per-row
    SDPA calls."""
    return _flash_takes(q) and varlen_impl() is not None


def _flash_takes(q: torch.Tensor) -> bool:
    """CUDA, half precision and a head size flash has kernels for."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


def varlen_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """The module docstring's attention (where :func:`varlen_fits`) of rows of lengths ``lens``
    (``cu_seqlens`` their starts)."""
    impl = varlen_impl()
    assert impl is not None
    return impl[1](q, k, v, cu_seqlens, max(lens), scale)


def varlen_forward_fits(q: torch.Tensor) -> bool:
    """Whether :func:`varlen_forward` takes ``q`` (the engine's rows without a cached prefix):
    CUDA, half precision, a head size flash has kernels for, and aten's flash forward as called
    here or an implementation of :data:`VARLEN_ATTN`."""
    return _flash_takes(q) and (_flash_ops() is not None or varlen_impl() is not None)


def varlen_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, scale: float
) -> torch.Tensor:
    """The module docstring's attention without autograd (the engine's step, where
    :func:`varlen_forward_fits`): aten's flash forward, one dispatch, K/V heads as they are; else
    the implementation :data:`VARLEN_ATTN` picks."""
    if _flash_ops() is not None:
        return _flash_attention(q, k, v, cu_seqlens, max_len, scale)
    impl = varlen_impl()
    assert impl is not None
    return impl[1](q, k, v, cu_seqlens, max_len, scale)

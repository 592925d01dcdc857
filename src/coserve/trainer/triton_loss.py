"""The loss chunk's cross-entropy and its gradient in one Triton kernel.

:func:`cross_entropy_grad_` replaces the chain of torch passes of
:func:`coserve.trainer.backward._loss_into_workspace` (the logits cast to fp32, ``amax``,
``exp(x − m)``, the sum, the logits cast again, ``exp(x − lse)``, the one-hot subtraction, the
cast back: at the Llama-3 shape and 512 targets, some 3.8 GB of memory traffic over fp32
``[512, 128256]`` buffers) with two reads of the head-dtype logits and one write of the gradient
in their place (0.4 GB), and no fp32 buffer at all.

Each program owns one row. The first pass keeps a running maximum and a running sum of
``exp(x − max)`` per lane over the row's vocabulary blocks, folded into ``lse = M + log S`` at
the end; the second writes ``exp(x − lse) − [v = target]`` rounded to the logits' dtype over
the logits, and picks the target's logit for the row's loss ``lse − x[target]``. The rounding
points are the torch chain's (fp32 statistics from the rounded logits, the gradient rounded
once); what differs is the order of the fp32 sums and Triton's ``exp``, so the loss and the
gradient agree with the chain to fp32 rounding, not bit for bit (tests).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from coserve.layers.triton_attention import jit, triton_usable

if TYPE_CHECKING:
    import triton.language as tl

logger = logging.getLogger(__name__)

ON_CPU = False
"""Also run the kernel on CPU tensors when ``TRITON_INTERPRET=1`` (tests turn this on; the
interpreter is far slower than the torch chain, so nothing else should)."""

BLOCK = 2048
"""Vocabulary entries a program reads at a time (per pass: 63 blocks at a 128,256 vocabulary)."""


def _cross_entropy_grad_kernel(
    x_ptr, target_ptr, loss_ptr, s_x, vocab,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    row = x_ptr + r * s_x
    offs = tl.arange(0, BLOCK)
    # (block-shaped scalar loads and stores: scalar & block masks trip the interpreter)
    target = tl.load(target_ptr + r + offs * 0)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, vocab, BLOCK):
        mask = v0 + offs < vocab
        x = tl.load(row + v0 + offs, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # a lane that has seen only -inf (masked entries) keeps s = 0, without (-inf) - (-inf)
        shift = tl.where(m_new > float("-inf"), m_new, 0.0)
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = m_new
    big = tl.max(m, 0)
    total = tl.sum(s * tl.exp(m - big), 0)
    lse = big + tl.log(total)
    picked = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, vocab, BLOCK):
        cols = v0 + offs
        mask = cols < vocab
        x = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
        hit = cols == target
        picked += tl.where(hit & mask, x, 0.0)
        grad = tl.exp(x - lse) - tl.where(hit, 1.0, 0.0)
        tl.store(row + cols, grad.to(x_ptr.dtype.element_ty), mask=mask)
    loss = lse - tl.sum(picked, 0)
    tl.store(loss_ptr + r + offs * 0, loss + offs * 0.0, mask=offs == 0)


_failed: str | None = None
"""Why the kernel failed in this process (see :func:`give_up`), None while it has not."""


def usable(device: torch.device) -> bool:
    """Whether :func:`cross_entropy_grad_` may run on tensors of ``device``: on a GPU with
    Triton, on the CPU only with :data:`ON_CPU` set and Triton's interpreter on; never again in a
    process where it failed."""
    return _failed is None and (device.type == "cuda" or ON_CPU) and triton_usable(device)


def give_up(error: Exception) -> None:
    """The kernel raised (it could not be compiled or launched on this GPU): log it once and let
    :func:`usable` say no from now on, so that the loss takes the torch chain instead of the
    trainer failing task after task."""
    global _failed
    _failed = f"{type(error).__name__}: {error}"
    logger.warning("the fused cross-entropy kernel failed (%s); the loss uses the torch chain from now on "
                   "(COSERVE_LOSS_FUSED_CE=0 skips the kernel)", _failed)


def cross_entropy_grad_(logits: torch.Tensor, targets: torch.Tensor, row_loss: torch.Tensor) -> None:
    """In place over ``logits`` ``[n, V]`` (any float dtype, unit column stride): the gradient of
    ``Σ_r CE(logits[r], targets[r])``, ``softmax(logits[r]) − onehot(targets[r])`` in fp32,
    rounded to the logits' dtype; ``row_loss[r] = logsumexp(logits[r]) − logits[r, targets[r]]``
    (fp32). Every target must lie in ``[0, V)``.

    targets: [n] int64, contiguous; row_loss: [n] fp32, contiguous.
    """
    n, vocab = logits.shape
    assert logits.stride(1) == 1 and targets.is_contiguous() and row_loss.is_contiguous()
    assert targets.shape == (n,) and row_loss.shape == (n,) and row_loss.dtype == torch.float32
    if n == 0:
        return
    jit(_cross_entropy_grad_kernel)[(n,)](
        logits, targets, row_loss, logits.stride(0), vocab,
        BLOCK=BLOCK, num_warps=8,
    )

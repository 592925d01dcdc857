"""Layer-wise recompute backward of one backward task (DESIGN §8).

The engine ran the forward pass of the task's samples inside inference batches and saved, per
sample, the residual-stream input of every decoder layer and the final hidden state (before the
final norm) into an activation store ``store: [L + 1, capacity, d]`` (model dtype): sample ``i``
occupies tokens ``[offset_i, offset_i + n_i)`` of every plane; plane ``L`` is the final hidden
state. From those checkpoints the backward pass needs only one decoder layer's autograd graph at
a time.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F

from coserve.layers.activation import silu_and_mul_backward
from coserve.layers.attention import AttentionMetadata
from coserve.layers.norm import rms_norm_backward
from coserve.layers.rotary import RopeTables, RotaryEmbedding
from coserve.models.llama import DecoderLayer, ForwardContext, LlamaForCausalLM
from coserve.trainer import triton_loss
from coserve.trainer.lora_params import HandLinear, TrainableLoRA, TrainingLoRA

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
# Target tokens per LM-head chunk of the loss. A pause can come before a chunk's forward and
# before its backward; at the Llama-3 shape each is ~1.1 GFLOP per target token, so ~0.54 TFLOP
# for 512 targets, under 1 ms on an H200 alone. ``COSERVE_LOSS_CHUNK`` overrides it (for
# measurements).
LOSS_CHUNK = int(os.environ.get("COSERVE_LOSS_CHUNK", "512"))
# Tokens per piece of an untrained MLP's backward, which has a pause boundary after each of its
# three matmuls (gate/up recompute, ``down``'s input gradient, ``gate_up``'s input gradient): at
# the Llama-3 shape and 2,048 tokens they are ~0.5, 0.25 and 0.5 TFLOP, each under 1 ms on an H200
# alone. Smaller pieces bound the work between boundaries no further than the matmuls do and
# run the ``[T, 28672] x [28672, 4096]`` input-gradient GEMM on too few output tiles to fill the
# GPU (512 tokens: 64 tiles of 128 x 256 for 132 SMs). ``COSERVE_MLP_CHUNK`` overrides it (for
# measurements). Trained MLPs keep one piece (their LoRA context routes rows as a whole) and
# autograd.
MLP_CHUNK = int(os.environ.get("COSERVE_MLP_CHUNK", "2048"))

LOSS_SPLIT = os.environ.get("COSERVE_LOSS_SPLIT", "1") == "1"
"""Each loss chunk by hand in three stretches with a pause boundary between two: the final norm
and the LM-head GEMM; the cross-entropy and its gradient (``softmax − onehot``, in place on the
fp32 logits); the gradient's GEMM back through the LM head and the norm's backward. Autograd's
chunk has two stretches, each a GEMM with the elementwise passes beside it. Session 17's pause
delays had their tail at the loss boundary (p99 2.86 ms over 52 pauses, against 1.85 ms at the
layers). On since session 19 (H200, latency=50, two runs each): the loss boundary's pause p99
1.39 / 1.85 ms against 2.50 / 2.64 ms by autograd, FT tokens/s 3,546 / 3,519 against 3,643 /
3,364 (``bench/results/latency_h200/session19/``). ``COSERVE_LOSS_SPLIT=0``: autograd's chunk.
The same loss and gradients (tests)."""

LOSS_GEMM_PIECES = int(os.environ.get("COSERVE_LOSS_GEMM_PIECES", "2"))
"""With :data:`LOSS_SPLIT` and :data:`LOSS_WORKSPACE`: each of a loss chunk's two GEMMs in this many
pieces with a pause boundary between two, the LM head's over the vocabulary's columns and its
gradient's over the hidden columns (each output element the same dot product over the same
operands: the weight is read once over the pieces, the gradient once a piece). Session 40's pause
delays on the H100 had their tail at the loss boundaries (p99 1.8–2.8 ms over 31–89 pauses a
run, the layers' 1.0–1.3 ms), where a pause waits for the stretch it arrived in: a GEMM of 512
targets over a 128k vocabulary is ~0.54 TFLOP, and the loss's stretches ran a median 1.9 ms on the
GPU at a 50% MPS share (p99 3.6–3.8 ms; ``trainer_spans.by_start.loss`` of both default runs). Smaller loss chunks
(``COSERVE_LOSS_CHUNK=256``) would cut it too but read the 1 GB head twice as often (session 14:
11% fewer FT tokens/s). 2 by default since session 41: on one H100 host (latency=50, the
defaults otherwise; ``bench/results/latency_h100/session41/``), two runs with two pieces against
four with one: pause p99 1.49 / 1.64 ms against 2.15-2.80 ms, at the loss's boundaries a median
0.51 / 0.56 ms against 0.64-0.96 ms (p99 1.51 / 2.06 against 2.00-2.65 ms), FT tokens/s 3,323 /
3,320 against 3,130-3,354, every request within its SLO. ``COSERVE_LOSS_GEMM_PIECES=1``: one
piece each, the loss before session 41."""

ATTN_PIECES = os.environ.get("COSERVE_TRAINER_ATTN_PIECES", "1") == "1"
"""Recompute and differentiate each layer's attention half in three pieces (the q/k/v projection
with RoPE, the attention, ``o_proj`` with the residual), each on its own, with a pause boundary
between two: four more boundaries per layer. The attention half's stretches need more CPU than
GPU on the H200 (session 9: 1.6–1.9 ms against ~1.0 ms, p50), and a pause that finds the
trainer's GPU dry waits for the CPU to queue the rest of its stretch (p99 12.9 ms against 2.0 ms
where the GPU was behind); shorter stretches bound that wait. Each boundary costs the CPU an event
and a stream wait. On since session 12's latency runs (60 s of azure2023_conv, the trainer at a
50% share, one run each): pause delay p99 2.82 ms against 4.65 ms in one piece, FT tokens/s 2,499
against 2,018. ``COSERVE_TRAINER_ATTN_PIECES=0`` runs the half in one piece. The same gradients bit
for bit (tests)."""


ATTN_BY_HAND = os.environ.get("COSERVE_TRAINER_ATTN_BY_HAND", "1") == "1"
"""With :data:`ATTN_PIECES`, the attention half's token-wise pieces differentiated by hand, without
autograd (:func:`_attention_by_hand`): the input norm, the q/k/v projection with its LoRA and RoPE
recomputed under ``no_grad`` keeping what their backward reads (the normed input, the shrink
``x Aᵀ``, the cast A/B), ``o_proj`` with its LoRA and the residual likewise, and their backwards
(``o_proj``'s input gradient and LoRA gradients, RoPE's, the q/k/v LoRA's and input gradient, the
norm's) called directly, the LoRA gradients added into ``flat.grad`` where ``AccumulateGrad`` adds
them. Only the attention itself keeps autograd (one ``torch.autograd.grad`` from its output to
q/k/v). The same ops in the same order as the autograd Functions run (``_LoRAGroupLinearFn``,
``_QKVRotaryFn``, ``_RMSNormFn``), so the same loss and gradients bit for bit (tests); what goes is
the Functions' Python (about a third of the q/k/v recompute's and backward's host time on the
H200, ``bench/results/trainer_h200/README.md``), the autograd nodes and the engine's runs of
``o_proj``'s and q/k/v's backward (on CUDA on autograd's device thread, the calling thread
waiting). Layers with LoRA dropout, or a trained linear whose A/B are not one span of ``flat``,
keep autograd. Same boundaries and poll points. Dev VM (CPU, bf16, ten alternating runs each way,
``bench/results/trainer_cpu/session24/``): autograd nodes per layer 29.5 → 18.0, aten ops 227.0 →
216.25 (``detach`` views only: the kernels are the same), host ms of the four stretches it changes
1.357 → 1.180 (pair ratio 0.88; ``o_proj``'s backward 0.75); the CPU has no device thread to hand
off to, so the H200's figures are for its next device call (the README there has the commands).
``COSERVE_TRAINER_ATTN_BY_HAND=0``: autograd's pieces."""


@dataclass(frozen=True)
class TaskRow:
    """One FT sample of a task: its tokens sit at ``[offset, offset + len(labels))`` of the store.

    ``labels`` follow the Hugging Face convention: ``-100`` is masked and the shift happens in the
    loss (position ``t``'s logits are scored against ``labels[t + 1]``).
    """

    offset: int
    labels: tuple[int, ...]


class TaskLoss(NamedTuple):
    loss_sum: float  # sum of token cross-entropies over the task's target tokens
    num_targets: int


class _TaskBatch(NamedTuple):
    """The task's rows back to back, as one flat varlen batch."""

    tokens: torch.Tensor  # [T] int64: the store token of each batch token
    positions: torch.Tensor  # [T] int64: position within its row
    targets: torch.Tensor  # [T] int64: the label that position t predicts, -100 if none
    row_lens: list[int]
    picked: torch.Tensor  # [N] int64: the positions that have a target



LOSS_FUSED_CE = os.environ.get("COSERVE_LOSS_FUSED_CE", "1") == "1"
"""With :data:`LOSS_SPLIT` and :data:`LOSS_WORKSPACE`, on a GPU: a loss chunk's cross-entropy
stretch as one Triton kernel (:func:`coserve.trainer.triton_loss.cross_entropy_grad_`: two reads
of the head-dtype logits, the gradient written over them) instead of the torch chain's ~8 passes
over fp32 ``[LOSS_CHUNK, V]`` buffers (~3.8 GB of traffic at the Llama-3 shape and 512 targets;
~0.4 GB fused), and no fp32 buffer (250 MiB). Session 41's pause delays on the H100 still had
their tail at the loss's boundaries with two GEMM pieces. On by default since session 42 (one
H100 host, noisy by ``host_check``; ``bench/results/latency_h100/session42/``): the stretch alone
on the whole GPU 1.36 → 0.17 ms (``bench/loss_ce.py``: the chunk 2.35 → 0.92 ms, loss and
gradient within 3e-9 and 1.3e-7 of the chain's); in three co-serving runs each way (latency=50),
the first chunk's cross-entropy stretch a median 2.7 → 0.40 ms, FT tokens/s 3,070 / 3,145 / 3,162
against 2,994 / 3,020 / 3,065, the pause at the loss's boundaries a median 0.39-0.49 against
0.60-0.63 ms (p99s: 2.66-4.59 against 2.01-3.48 ms, the host's noise), the cold error p99 over
all steps 14.6 / 16.1 / 19.9% against 26.0 / 23.5 / 24.2%. The same loss and gradient to fp32
rounding, not bit for bit (tests). ``COSERVE_LOSS_FUSED_CE=0``: the torch chain (and the CPU,
without Triton's interpreter, always)."""

LOSS_WORKSPACE = os.environ.get("COSERVE_LOSS_WORKSPACE", "1") == "1"
""":func:`_split_loss_chunk` computes into two buffers kept across chunks and tasks (the LM head's
``[LOSS_CHUNK, V]`` logits in the weight's dtype and in fp32) instead of four ``[n, V]`` tensors
allocated per chunk (the logits twice, ``logsumexp``'s temporary, the gradient's cast): at the
Llama-3 shape and 512 targets, 0.8 GB of allocations a chunk. Session 21's trainer stalled in the
loss stretches for up to 0.36 s of host time, its stacks inside ops that allocate
(``bench/results/latency_h200/README.md``). The same loss and gradients bit for bit (tests).
``COSERVE_LOSS_WORKSPACE=0``: the per-chunk tensors."""


class _LossWorkspace:
    """:data:`LOSS_WORKSPACE`'s buffers, for one (device, dtype, vocabulary) at a time: grown to
    the largest chunk seen, never shrunk; the last set is kept (a trainer has one LM head)."""

    _key: tuple[torch.device, torch.dtype, int] | None = None
    _low: torch.Tensor | None = None  # [n, V] in the head's dtype: the logits, then the gradient
    _f32: torch.Tensor | None = None  # [n, V] fp32: the logits, then exp(x − max), then the softmax

    @classmethod
    def get(cls, n: int, vocab: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        low = cls.get_low(n, vocab, dtype, device)
        if cls._f32 is None or cls._f32.shape[0] < n:
            cls._f32 = None
            cls._f32 = torch.empty((cls._rows(n), vocab), dtype=torch.float32, device=device)
        return low, cls._f32[:n]

    @classmethod
    def get_low(cls, n: int, vocab: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The head-dtype buffer alone (:data:`LOSS_FUSED_CE` needs no fp32 one)."""
        key = (device, dtype, vocab)
        if cls._key != key or cls._low is None or cls._low.shape[0] < n:
            cls._low = cls._f32 = None  # (the old pair freed before the new is allocated)
            cls._low = torch.empty((cls._rows(n), vocab), dtype=dtype, device=device)
            cls._key = key
        return cls._low[:n]

    @staticmethod
    def _rows(n: int) -> int:
        return max(n, LOSS_CHUNK)


def _split_loss_chunk(model: LlamaForCausalLM, final: torch.Tensor, targets: torch.Tensor,
                      boundary: Callable[[], None]) -> torch.Tensor:
    """``Σ CE(lm_head(norm(final)), targets)`` (fp32, summed) with its gradient pulled back into
    ``final`` (which requires grad), in :data:`LOSS_SPLIT`'s three stretches, ``boundary()``
    between two. Returns the loss sum (a 0-d tensor on the device)."""
    normed = model.model.norm(final)
    weight = model.lm_head_weight
    with torch.no_grad():
        rows = torch.arange(targets.shape[0], device=targets.device)
        if LOSS_WORKSPACE:
            loss, grad_low = _loss_into_workspace(normed.detach(), weight, targets, rows, boundary)
        else:
            logits = model.compute_logits(normed.detach())  # [n, V] fp32
            boundary()
            lse = torch.logsumexp(logits, dim=1)
            loss = (lse - logits[rows, targets]).sum(dtype=torch.float64)
            grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place
            grad[rows, targets] -= 1.0
            grad_low = grad.to(weight.dtype)
            del logits, grad
        boundary()
        grad_normed = torch.empty((grad_low.shape[0], weight.shape[1]), dtype=weight.dtype, device=weight.device)
        for i, (h0, h1) in enumerate(gemm_pieces(weight.shape[1], LOSS_GEMM_PIECES if LOSS_WORKSPACE else 1)):
            if i:
                boundary()
            torch.mm(grad_low, weight[:, h0:h1], out=grad_normed[:, h0:h1])
        del grad_low
    normed.backward(grad_normed)
    return loss


GEMM_PIECE_ALIGN = 128
""":func:`gemm_pieces`' cuts fall on multiples of this (a GEMM output tile's width)."""


def gemm_pieces(n: int, pieces: int) -> list[tuple[int, int]]:
    """``[0, n)`` in at most ``pieces`` contiguous column ranges of near-equal width, every cut at
    a multiple of :data:`GEMM_PIECE_ALIGN`, so that no piece but the last leaves a tile part full."""
    align = GEMM_PIECE_ALIGN
    if pieces <= 1 or n <= align:
        return [(0, n)]
    width = -(-n // pieces)
    step = -(-width // align) * align
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def loss_stretch_roles(vocab: int, hidden: int, *, split: bool | None = None,
                       pieces: int | None = None) -> tuple[str, ...]:
    """What each stretch of one loss chunk computes, in the order they run (each begins at a pause
    boundary), for an LM head of ``[vocab, hidden]``: with :data:`LOSS_SPLIT` (``split``),
    ``logits`` a piece of the head's GEMM (:data:`LOSS_GEMM_PIECES` with the workspace, else one;
    ``pieces``), ``cross_entropy`` and ``gradient`` a piece of its gradient's GEMM (the last with
    the norm's backward); without, autograd's ``forward`` and ``backward``. ``split`` and
    ``pieces`` default to the switches as set (another run's, for a report). A task's loss
    boundaries count on from chunk to chunk, so its ``k``-th loss stretch is ``roles[k % len(roles)]``."""
    if not (LOSS_SPLIT if split is None else split):
        return ("forward", "backward")
    if pieces is None:
        pieces = LOSS_GEMM_PIECES if LOSS_WORKSPACE else 1
    return (("logits",) * len(gemm_pieces(vocab, pieces)) + ("cross_entropy",)
            + ("gradient",) * len(gemm_pieces(hidden, pieces)))


def _loss_into_workspace(normed: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor,
                         boundary: Callable[[], None]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_split_loss_chunk`'s first two stretches in :class:`_LossWorkspace`'s buffers:
    ``(loss sum, softmax − onehot in the head's dtype)``, the bits of the per-chunk path
    (``compute_logits``, ``torch.logsumexp``: ``m + log Σ exp(x − m)`` with infinite maxima taken
    as 0, then ``exp(x − lse)``), the logits cast to fp32 twice instead of kept; with
    :data:`LOSS_FUSED_CE` on a GPU, the second stretch is one kernel over the head-dtype logits
    (to fp32 rounding, not bit for bit)."""
    x: torch.Tensor | None
    if LOSS_FUSED_CE and triton_loss.usable(weight.device):
        low, x = _LossWorkspace.get_low(normed.shape[0], weight.shape[0], weight.dtype, weight.device), None
    else:
        low, x = _LossWorkspace.get(normed.shape[0], weight.shape[0], weight.dtype, weight.device)
    for i, (v0, v1) in enumerate(gemm_pieces(weight.shape[0], LOSS_GEMM_PIECES)):
        if i:
            boundary()
        # (compute_logits: the head's GEMM, then fp32; LOSS_GEMM_PIECES: a vocabulary range a piece)
        torch.mm(normed, weight[v0:v1].t(), out=low[:, v0:v1])
        if x is not None:
            x[:, v0:v1].copy_(low[:, v0:v1])
    boundary()
    if x is None:
        row_loss = torch.empty(low.shape[0], dtype=torch.float32, device=low.device)
        try:
            triton_loss.cross_entropy_grad_(low, targets.contiguous(), row_loss)
            return row_loss.sum(dtype=torch.float64), low
        except Exception as error:  # (raised before the launch: the logits in ``low`` are intact)
            triton_loss.give_up(error)
            x = _LossWorkspace.get(normed.shape[0], weight.shape[0], weight.dtype, weight.device)[1].copy_(low)
    picked = x[rows, targets]
    m = x.amax(dim=1, keepdim=True)
    m.masked_fill_(m.abs() == float("inf"), 0.0)
    lse = x.sub_(m).exp_().sum(dim=1).log_().add_(m.squeeze(1))
    loss = (lse - picked).sum(dtype=torch.float64)
    grad = x.copy_(low).sub_(lse[:, None]).exp_()  # softmax, in place
    grad[rows, targets] -= 1.0
    return loss, low.copy_(grad)

def task_backward(
    model: LlamaForCausalLM,
    lora: TrainableLoRA,
    store: torch.Tensor,
    rows: Sequence[TaskRow],
    *,
    dropout_key: int | None = None,
    at_layer_boundary: Callable[[int], None] | None = None,
    at_poll_point: Callable[[], None] | None = None,
    mlp_store: torch.Tensor | None = None,
    before_readback: Callable[[], None] | None = None,
) -> TaskLoss:
    """Accumulate ``∂loss/∂flat`` into ``lora.flat.grad`` from saved layer inputs.

    ``loss = Σ_rows Σ_t CE(logits[t], labels[t + 1])`` over targets ``labels[t + 1] != -100``,
    ``logits = lm_head(final_norm(h_L))`` (fp32 cross-entropy) from plane ``L``. Then for
    ``l = L-1 … 0``: ``h_{l+1} = layer_l(h_l)`` is recomputed from ``store[l]`` with autograd
    or by hand (:data:`ATTN_BY_HAND`, an untrained MLP) (each row causal within itself, positions
    from 0, no KV cache, LoRA from ``lora.context(dropout_key, row_lens)``) and
    ``∂loss/∂h_{l+1}`` is pulled back to
    ``∂loss/∂h_l`` and the layer's LoRA parameters, the attention half and the MLP half of the
    layer each on its own. ``at_layer_boundary(l)`` runs before the attention recompute, after
    it, within the MLP half (a trained MLP: after its recompute and after its backward; an
    untrained one: after each matmul of each :data:`MLP_CHUNK`-token piece), and before the attention backward
    (and with ``l = L`` before each chunk of the loss and before its backward). The loss is NOT normalized: the caller
    divides by the step's target count.

    ``at_poll_point()`` runs inside the stretches between two boundaries, where the host work is
    longest (each trained LoRA linear's forward after its base GEMM, its backward at its start and
    after the input gradient): a caller may pause there too, when the engine has asked for one
    (:meth:`coserve.trainer.worker._Worker._poll_point`). It changes nothing computed.
    ``before_readback()`` runs after the last layer's work is queued, before the loss is read back
    to the host (which waits for the GPU): a caller may wait there in its own way (and count it).

    With ``mlp_store`` ``[L, capacity, 2·intermediate]`` (the gate/up outputs the engine kept,
    same token offsets), a layer whose MLP the adapter does not train is differentiated through
    its MLP from those saved outputs, by hand, without recomputing the MLP's matmuls.

    store: ``[L + 1, capacity, d]`` (model dtype, read only); model: frozen, never modified.
    Returns the un-normalized loss sum and the number of target tokens; with no target token
    nothing is computed.
    """
    num_layers = len(model.model.layers)
    if store.dim() != 3 or store.shape[0] != num_layers + 1:
        raise ValueError(
            f"store must be [L + 1 = {num_layers + 1}, capacity, d], got {list(store.shape)}"
        )
    # (read only: a store that required grad would pull every gather into the graphs)
    store = store.detach()
    batch = _task_batch(rows, store.shape[1], store.device)
    picked = batch.picked
    num_targets = int(picked.numel())
    if num_targets == 0:
        return TaskLoss(0.0, 0)
    meta = AttentionMetadata.build(
        q_lens=batch.row_lens,
        context_lens=[0] * len(batch.row_lens),
        block_tables=[[] for _ in batch.row_lens],
        writes_kv=[False] * len(batch.row_lens),
        num_prefill_rows=len(batch.row_lens),
        block_size=1,
        device=store.device,
    )
    # NOTE: what depends only on the rows (attention layout, LoRA routing, RoPE's cos/sin rows) is
    # worked out here or on first use, once for the task, and shared by every layer's recompute.
    lora_ctx = lora.context(dropout_key, batch.row_lens, poll=at_poll_point)
    ctx = ForwardContext(attn=meta, kv_cache=None, lora=lora_ctx, rope=model.rotary.tables(batch.positions))

    def boundary(layer: int) -> None:
        if at_layer_boundary is not None:
            at_layer_boundary(layer)

    with torch.enable_grad():
        # Only the target positions reach the LM head, LOSS_CHUNK of them at a time: a pause
        # can come between chunks, and the logits never exceed [LOSS_CHUNK, V].
        final = store[num_layers].index_select(0, batch.tokens).requires_grad_(True)
        # NOTE: summed on the device and read once at the end: reading each chunk's loss would
        # make the CPU wait for the GPU before it queues the layers' work.
        loss_total = torch.zeros((), dtype=torch.float64, device=store.device)
        for chunk in picked.split(LOSS_CHUNK):
            # the loss over the vocabulary is a layer's worth of work too: a boundary before each
            # chunk's forward and one before its backward (LOSS_SPLIT: one more between them)
            boundary(num_layers)
            if LOSS_SPLIT:
                loss_total += _split_loss_chunk(model, final[chunk], batch.targets[chunk],
                                                lambda: boundary(num_layers))
                continue
            logits = model.compute_logits(model.model.norm(final[chunk]))
            loss = F.cross_entropy(logits.float(), batch.targets[chunk], reduction="sum")
            boundary(num_layers)
            loss.backward()
            loss_total += loss.detach()
            del logits, loss
        grad = final.grad
        del final

        # Each layer in two halves (attention, MLP), each recomputed and differentiated on its
        # own, so that a pause can come within a layer: before the attention recompute, the MLP
        # recompute, the MLP backward and the attention backward.
        for layer_idx in range(num_layers - 1, -1, -1):
            layer = cast(DecoderLayer, model.model.layers[layer_idx])
            assert grad is not None
            boundary(layer_idx)
            x = store[layer_idx].index_select(0, batch.tokens)
            pieces: _AttentionPieces | None = None
            hand: _HandPieces | None = None
            if ATTN_PIECES and ATTN_BY_HAND and _by_hand(layer, lora_ctx):
                hand = _attention_by_hand(layer, x, layer_idx > 0, batch.positions, model.rotary, ctx, lora_ctx,
                                          functools.partial(boundary, layer_idx))
                h = hand.h
            else:
                if layer_idx > 0:
                    x.requires_grad_(True)
                if ATTN_PIECES:
                    pieces = _attention_pieces(layer, x, batch.positions, model.rotary, ctx,
                                               functools.partial(boundary, layer_idx))
                    h = pieces.h
                else:
                    h = layer.attention_half(x, batch.positions, model.rotary, ctx)
            boundary(layer_idx)
            dh: torch.Tensor | None
            trains_mlp = any(lora.trains(layer_idx, t) for t in MLP_TARGETS)
            if not trains_mlp:
                # (the hand path's h has no graph: no detach)
                dh = _untrained_mlp_input_grad(layer, h.detach() if h.requires_grad else h, grad, mlp_store,
                                               layer_idx, batch.tokens, boundary)
            else:
                h_in = h.detach().requires_grad_(hand.needs_dh if hand is not None else h.requires_grad)
                y = layer.mlp_half(h_in, ctx)
                boundary(layer_idx)
                if y.requires_grad:
                    # Frees the half's graph before the next one is built.
                    torch.autograd.backward(y, grad)
                dh = h_in.grad
                del y, h_in
            boundary(layer_idx)
            if hand is not None:
                grad = _attention_by_hand_backward(hand, dh, lora_ctx, functools.partial(boundary, layer_idx))
            elif pieces is not None:
                _attention_pieces_backward(pieces, dh, functools.partial(boundary, layer_idx))
                grad = layer_input_grad(x, dh) if layer_idx > 0 else None
            else:
                if h.requires_grad:
                    torch.autograd.backward(h, dh)
                grad = x.grad if layer_idx > 0 else None
            del x, h, dh, pieces, hand
    if before_readback is not None:
        before_readback()
    return TaskLoss(float(loss_total), num_targets)


MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


class _AttentionPieces(NamedTuple):
    """A layer's attention half as three graphs (:data:`ATTN_PIECES`): the projection's outputs
    ``qkv`` (graph to ``x`` and the q/k/v LoRA), the attention's leaf inputs ``qkv_in`` and output
    ``o``, ``o_proj``'s leaf input ``o_in`` and the half's output ``h = x + o_proj(o_in)``."""

    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    qkv_in: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    o: torch.Tensor
    o_in: torch.Tensor
    h: torch.Tensor


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(t.requires_grad)


def _attention_pieces(layer: DecoderLayer, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                      ctx: ForwardContext, boundary: Callable[[], None]) -> _AttentionPieces:
    """``layer.attention_half(x, ...)`` in three pieces, ``boundary()`` between two."""
    attn = layer.self_attn
    q, k, v = attn.project(layer.input_layernorm(x), positions, rotary, ctx.lora, ctx.rope)
    boundary()
    qkv_in = (_leaf(q), _leaf(k), _leaf(v))
    o = attn.attend(*qkv_in, ctx)
    boundary()
    o_in = _leaf(o)
    # NOTE: the residual's gradient (``dh`` itself) is added to the layer input's by hand after the
    # q/k/v backward (:func:`layer_input_grad`): through autograd, ``x``'s AccumulateGrad would clone
    # ``dh`` (the caller still holds it) and add the q/k/v gradient to the copy; ``dx + dh`` is the
    # same sum bit for bit, with one kernel and one autograd node less per layer.
    return _AttentionPieces((q, k, v), qkv_in, o, o_in, x.detach() + attn.o_proj(o_in, ctx.lora))


def layer_input_grad(x: torch.Tensor, dh: torch.Tensor | None) -> torch.Tensor | None:
    """``∂loss/∂x`` of a layer run in :data:`ATTN_PIECES`: the q/k/v path's gradient (``x.grad``,
    accumulated by autograd) plus the residual's, ``dh`` (``None`` when ``x`` needs none)."""
    if not x.requires_grad:
        return None
    if x.grad is None:
        return dh
    return x.grad if dh is None else x.grad.add_(dh)


def _attention_pieces_backward(p: _AttentionPieces, dh: torch.Tensor | None, boundary: Callable[[], None]) -> None:
    """Pull ``dh`` back through the pieces, last first, ``boundary()`` between two: into ``x``'s
    gradient and the LoRA parameters', as one backward through the whole half does."""
    if p.h.requires_grad:
        torch.autograd.backward(p.h, dh)
    boundary()
    if p.o_in.grad is not None and p.o.requires_grad:
        torch.autograd.backward(p.o, p.o_in.grad)
    boundary()
    pulled = [(t, g.grad) for t, g in zip(p.qkv, p.qkv_in, strict=True) if g.grad is not None and t.requires_grad]
    if pulled:
        torch.autograd.backward([t for t, _ in pulled], [g for _, g in pulled])


class _HandPieces(NamedTuple):
    """A layer's attention half recomputed by :func:`_attention_by_hand` (:data:`ATTN_BY_HAND`):
    the layer and its input ``x`` (whose gradient is wanted when ``needs_dx``), the q/k/v
    projection's and ``o_proj``'s saved values, RoPE's positions and tables, the attention's
    inputs ``qkv`` (leaves that require grad when the q/k/v path needs a gradient) and output
    ``o`` (graph to them), and ``h = x + o_proj(o)``; ``needs_dh``: whether anything in the half
    needs ``∂loss/∂h`` (else its backward has nothing to do)."""

    layer: DecoderLayer
    x: torch.Tensor
    needs_dx: bool
    qkv_proj: HandLinear
    rope: tuple[RotaryEmbedding, torch.Tensor, RopeTables]
    qkv_meta: tuple[torch.Size, torch.dtype, torch.device]  # the fused projection output's
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    o: torch.Tensor
    o_proj: HandLinear
    h: torch.Tensor
    needs_dh: bool


def _by_hand(layer: DecoderLayer, lora_ctx: TrainingLoRA) -> bool:
    """Whether :func:`_attention_by_hand` covers this layer's attention half (see
    :data:`ATTN_BY_HAND`)."""
    attn = layer.self_attn
    return all(lin.has_lora and lora_ctx.by_hand(lin.layer, lin.out_slices) for lin in (attn.qkv_proj, attn.o_proj))


def _heads(layer: DecoderLayer) -> tuple[int, int, int]:
    attn = layer.self_attn
    return attn.num_heads, attn.num_kv_heads, attn.head_dim


def _attention_by_hand(layer: DecoderLayer, x: torch.Tensor, needs_dx: bool, positions: torch.Tensor,
                       rotary: RotaryEmbedding, ctx: ForwardContext, lora_ctx: TrainingLoRA,
                       boundary: Callable[[], None]) -> _HandPieces:
    """:func:`_attention_pieces` without autograd but for the attention, ``boundary()`` at the same
    places: the ops that ``input_layernorm``, ``qkv_proj``, ``split_qkv`` and ``o_proj`` run inside
    their autograd Functions, under ``no_grad``, keeping what their backwards read. ``x`` need
    not require grad (``needs_dx`` says whether its gradient is wanted)."""
    attn = layer.self_attn
    qkv_lin, o_lin = attn.qkv_proj, attn.o_proj
    tables = ctx.rope if ctx.rope is not None else rotary.tables(positions)
    with torch.no_grad():
        normed = layer.input_layernorm(x)
        qkv, qkv_saved = lora_ctx.linear_by_hand(qkv_lin.layer, qkv_lin.out_slices, normed, qkv_lin.weight,
                                                 qkv_lin.bias)
        q, k, v = rotary.split_rotate(positions, qkv, _heads(layer), tables)
    qkv_meta = (qkv.shape, qkv.dtype, qkv.device)
    del qkv
    if needs_dx or qkv_saved.group is not None:
        # (fresh tensors and a view of qkv, made without autograd: leaves of the attention's graph)
        for t in (q, k, v):
            t.requires_grad_(True)
    boundary()
    o = attn.attend(q, k, v, ctx)
    boundary()
    with torch.no_grad():
        y, o_saved = lora_ctx.linear_by_hand(o_lin.layer, o_lin.out_slices, o, o_lin.weight, o_lin.bias)
        h = x + y
    needs_dh = o.requires_grad or o_saved.group is not None
    return _HandPieces(layer, x, needs_dx, qkv_saved, (rotary, positions, tables), qkv_meta, (q, k, v), o, o_saved,
                       h, needs_dh)


def _attention_by_hand_backward(p: _HandPieces, dh: torch.Tensor | None, lora_ctx: TrainingLoRA,
                                boundary: Callable[[], None]) -> torch.Tensor | None:
    """Pull ``dh`` back through :func:`_attention_by_hand`'s pieces, ``boundary()`` between two,
    as :func:`_attention_pieces_backward` does: the LoRA gradients into ``flat.grad``. Returns
    ``∂loss/∂x`` (None unless ``p.needs_dx``): the q/k/v path's plus the residual's, ``dh``, as
    :func:`layer_input_grad` adds them."""
    with torch.no_grad():
        d_o = lora_ctx.linear_backward_by_hand(p.o_proj, dh, p.o.requires_grad) if dh is not None else None
    boundary()
    # (the attention's own backward, autograd's; the leaves' AccumulateGrad nodes are not run)
    d_qkv = torch.autograd.grad(p.o, p.qkv, d_o) if d_o is not None else None
    boundary()
    if d_qkv is None or dh is None:
        return dh if p.needs_dx else None
    rotary, positions, tables = p.rope
    with torch.no_grad():
        gq, gk, gv = d_qkv
        dqkv = rotary.split_rotate_backward(positions, gq, gk, gv, *p.qkv_meta, _heads(p.layer), tables)
        del d_qkv, gq, gk, gv
        d_normed = lora_ctx.linear_backward_by_hand(p.qkv_proj, dqkv, p.needs_dx)
        del dqkv
        if d_normed is None:
            return None
        return rms_norm_backward(p.x, p.layer.input_layernorm, d_normed).add_(dh)


def _untrained_mlp_input_grad(
    layer: DecoderLayer,
    h: torch.Tensor,
    grad: torch.Tensor,
    mlp_store: torch.Tensor | None,
    layer_idx: int,
    tokens: torch.Tensor,
    boundary: Callable[[int], None],
) -> torch.Tensor:
    """``∂loss/∂h`` through ``mlp_half(h) = h + mlp(norm(h))`` of a layer whose MLP the adapter
    does not train, by hand (no autograd), :data:`MLP_CHUNK` tokens at a time with
    ``boundary(layer_idx)`` after each of a piece's matmuls (but the last piece's last: the caller's
    boundary before the attention backward follows it, and two boundaries back to back were a
    stretch of no GPU work, a stream wait and two events more per layer). The gate/up output it needs comes from
    ``mlp_store`` when the engine kept it, else it is recomputed (one matmul; the MLP's linears
    run without LoRA: no trained slice is in them). The down projection's forward is never
    needed: the input gradient only reads its weight.
    """
    parts = []
    mlp = layer.mlp
    norm, down_w, gate_up_w = layer.post_attention_layernorm, mlp.down_proj.weight, mlp.gate_up_proj.weight
    # (one piece, the usual case: the tensors themselves, no slicing per use)
    pieces = ([(h, grad, tokens)] if h.shape[0] <= MLP_CHUNK else
              list(zip(h.split(MLP_CHUNK), grad.split(MLP_CHUNK), tokens.split(MLP_CHUNK), strict=True)))
    with torch.no_grad():
        for i, (h_p, grad_p, tokens_p) in enumerate(pieces):
            if mlp_store is not None:
                gate_up = mlp_store[layer_idx].index_select(0, tokens_p)
            else:
                gate_up = mlp.gate_up_proj(norm(h_p), None)
                boundary(layer_idx)
            # ∂loss/∂h through mlp(post_attention_layernorm(h)): down and gate_up transposed,
            # the SwiGLU and RMSNorm backwards; no other forward matmul is needed.
            d_gate_up = silu_and_mul_backward(gate_up, grad_p @ down_w)
            del gate_up
            boundary(layer_idx)
            d_normed = d_gate_up @ gate_up_w
            del d_gate_up
            parts.append(grad_p + rms_norm_backward(h_p, norm, d_normed))
            del d_normed
            if i + 1 < len(pieces):  # (after the last piece the caller's boundary follows at once)
                boundary(layer_idx)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _task_batch(rows: Sequence[TaskRow], capacity: int, device: torch.device) -> _TaskBatch:
    if not rows:
        raise ValueError("a backward task needs at least one row")
    index: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    targets: list[int] = []
    row_lens: list[int] = []
    for i, row in enumerate(rows):
        n = len(row.labels)
        if n == 0:
            raise ValueError(f"task row {i} is empty")
        if row.offset < 0 or row.offset + n > capacity:
            raise ValueError(
                f"task row {i} spans store tokens [{row.offset}, {row.offset + n}) outside "
                f"[0, {capacity})"
            )
        index.append(torch.arange(row.offset, row.offset + n))
        positions.append(torch.arange(n))
        targets.extend(row.labels[1:])
        targets.append(IGNORE_INDEX)
        row_lens.append(n)
    # NOTE: the target positions are found here, on the CPU: a nonzero() on the device would
    # make the CPU wait for the GPU before it queues any of the task's work.
    target_cpu = torch.tensor(targets, dtype=torch.int64)
    return _TaskBatch(
        tokens=torch.cat(index).to(device),
        positions=torch.cat(positions).to(device),
        targets=target_cpu.to(device),
        row_lens=row_lens,
        picked=(target_cpu != IGNORE_INDEX).nonzero().squeeze(1).to(device),
    )

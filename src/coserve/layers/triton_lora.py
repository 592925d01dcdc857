"""Multi-LoRA in Triton: gathered segmented matmul, shrink then expand.

The tokens that use an adapter are listed in ``order``: token indices grouped by adapter slot,
each group starting at a multiple of ``BLOCK_M`` and padded with -1, so every tile of
``BLOCK_M`` entries holds tokens of one slot only. Each program gathers its tile's rows of
``x``/``y`` by index and reads that slot's weights once:

- shrink, grid (tiles, SPLIT_K): ``v[k, t] = x[t, K_k] @ A[slot][:, K_k].T`` (fp32 partials over
  ``SPLIT_K`` slices of ``in``, so one tile can still spread over many multiprocessors);
- expand, grid (tiles, groups of column blocks): ``y[t] += (Σ_k v[k, t]) @ B[slot].T · scale[slot]``,
  or, not accumulating, ``y[t] = … (+ bias)``, with zeros (plus bias) in the tiles of tokens
  without an adapter (the expand-first path of large eager steps,
  :meth:`ExpandFirstTritonLoRA.whole_linear`). Each program sums its tile's partials once and
  walks a group of ``BLOCK_N``-column blocks (:func:`expand_blocks_per_program`).

A fused linear's output slices (q/k/v, gate/up) share ``x``, so they share both launches
(:func:`lora_shrink_expand_fused`): the shrink runs over the slices' stacked A rows
(``[S, k·r, in]``), and each column block of the expand belongs to one slice, whose rank
columns of ``v`` and rows of the stacked B (``[S, Σ out, r]``) it reads: two launches per linear.

One launch per linear (each program repeating its slice's shrink before expanding its columns)
was measured on the H200 in session 5 and lost: +105% / +92% on a decode step at batch 1 / 16
against +33% / +25% with the two launches (``bench/results/engine_h200/README.md``); it was removed.

The grid depends only on ``len(order)`` and the weight shapes, and the routing lives in device
tensors, so the same kernels serve eager prefill segments and CUDA-graph-captured decode steps
(the runner refills ``token_slots``/``order`` before each replay; see
:func:`graph_order_length`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Self

import torch
import torch.nn.functional as F

from coserve.host_copy import to_device
from coserve.layers.triton_attention import jit, num_sms, varying

if TYPE_CHECKING:
    import triton.language as tl

    from coserve.layers.lora import LoRABatch


# NOTE: ``n_order`` is a multiple of BLOCK_M (so divisible by 16) and so are ``s_vk`` (T·R_PAD)
# and ``k_per_split``: they never change the specialization; ``n_order`` is marked anyway, should
# a caller pass an order that is not padded to whole tiles. The strides stay specialized: the
# compiler needs their divisibility to vectorize the loads of ``v``.
@varying("n_order")
def _shrink_kernel(
    x_ptr, a_ptr, v_ptr, order_ptr, slot_ptr, n_order,
    s_xt, s_as, s_ar, s_vk, s_vt, d_in, k_per_split,
    RANK: tl.constexpr, R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    ks = tl.program_id(1)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = tl.load(order_ptr + offs_m, mask=offs_m < n_order, other=-1).to(tl.int64)
    slots = tl.load(slot_ptr + tl.maximum(tok, 0), mask=tok >= 0, other=-1)
    valid = (tok >= 0) & (slots >= 0)
    slot = tl.max(tl.where(valid, slots, -1), 0)
    if slot >= 0:
        offs_r = tl.arange(0, R_PAD)
        k_lo = ks * k_per_split
        acc = tl.zeros([BLOCK_M, R_PAD], tl.float32)
        for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < d_in
            x = tl.load(x_ptr + tok[:, None] * s_xt + offs_k[None, :], mask=valid[:, None] & mask_k[None, :],
                        other=0.0)
            a = tl.load(a_ptr + slot * s_as + offs_r[:, None] * s_ar + offs_k[None, :],
                        mask=(offs_r[:, None] < RANK) & mask_k[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(a))
        tl.store(v_ptr + ks * s_vk + tok[:, None] * s_vt + offs_r[None, :], acc, mask=valid[:, None])


# NOTE: ``blocks_per_program`` and ``split_k`` follow the step's size (a power of two, or 1, for
# some sizes but not others): specialized, they would compile new variants in the middle of serving.
@varying("n_order", "blocks_per_program", "split_k")
def _expand_kernel(
    y_ptr, b_ptr, v_ptr, order_ptr, slot_ptr, scale_ptr, bias_ptr, n_order, n_blocks, blocks_per_program, split_k,
    s_yt, s_bs, s_bo, s_vk, s_vt, blk1, blk2, blk3, col1, col2, col3, col4,
    RANK: tl.constexpr, K_RANK: tl.constexpr, R_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACCUMULATE: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_g = tl.program_id(1)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = tl.load(order_ptr + offs_m, mask=offs_m < n_order, other=-1).to(tl.int64)
    slots = tl.load(slot_ptr + tl.maximum(tok, 0), mask=tok >= 0, other=-1)
    valid = (tok >= 0) & (slots >= 0)
    slot = tl.max(tl.where(valid, slots, -1), 0)
    run = slot >= 0
    if not ACCUMULATE:
        # Storing, a tile of tokens without an adapter still writes their rows (zeros, plus bias):
        # the output was never initialized.
        run = tl.max(tok, 0) >= 0
    if run:
        # The tile's v, all K_RANK ranks of every slice, split-K partials summed: read once for
        # all of the program's column blocks.
        offs_r = tl.arange(0, R_PAD)
        v = tl.zeros([BLOCK_M, R_PAD], tl.float32)
        for k in range(split_k):
            v += tl.load(v_ptr + k * s_vk + tok[:, None] * s_vt + offs_r[None, :],
                         mask=valid[:, None] & (offs_r < K_RANK)[None, :], other=0.0)
        w_slot = tl.maximum(slot, 0)  # a tile without adapter (storing): any slot's B, times v = 0
        v = (v * tl.load(scale_ptr + w_slot)).to(b_ptr.dtype.element_ty)
        blk_first = pid_g * blocks_per_program
        for pid_n in range(blk_first, tl.minimum(blk_first + blocks_per_program, n_blocks)):
            # This column block's target i: target i owns the output columns [col_i, col_i+1)
            # (col_0 = 0), tiled by the column blocks [blk_i, blk_i+1) (blk_0 = 0), and the ranks
            # [i·RANK, (i+1)·RANK) of v; B's other rank columns load as zeros.
            i = (pid_n >= blk1).to(tl.int32) + (pid_n >= blk2).to(tl.int32) + (pid_n >= blk3).to(tl.int32)
            blk_lo = tl.where(i == 0, 0, tl.where(i == 1, blk1, tl.where(i == 2, blk2, blk3)))
            col_lo = tl.where(i == 0, 0, tl.where(i == 1, col1, tl.where(i == 2, col2, col3)))
            col_hi = tl.where(i == 0, col1, tl.where(i == 1, col2, tl.where(i == 2, col3, col4)))
            offs_n = col_lo + (pid_n - blk_lo) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < col_hi
            r_in = offs_r - i * RANK
            b = tl.load(b_ptr + w_slot * s_bs + offs_n[:, None] * s_bo + r_in[None, :],
                        mask=mask_n[:, None] & ((r_in >= 0) & (r_in < RANK))[None, :], other=0.0)
            d = tl.dot(v, tl.trans(b))
            ptrs = y_ptr + tok[:, None] * s_yt + offs_n[None, :]
            if ACCUMULATE:
                mask = valid[:, None] & mask_n[None, :]
                y = tl.load(ptrs, mask=mask, other=0.0)
                tl.store(ptrs, (y.to(tl.float32) + d).to(y_ptr.dtype.element_ty), mask=mask)
            else:
                d = tl.where(valid[:, None], d, 0.0)
                if HAS_BIAS:
                    d += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                tl.store(ptrs, d.to(y_ptr.dtype.element_ty), mask=(tok >= 0)[:, None] & mask_n[None, :])


MAX_FUSED_TARGETS = 4
"""Most output slices one expand launch serves (the kernel's column-block boundaries)."""

FUSED_SLICES = os.environ.get("COSERVE_FUSED_LORA", "1") != "0"
"""Serve a fused linear's slices in shared launches; ``COSERVE_FUSED_LORA=0`` launches per slice
(the before/after switch of the benchmarks)."""


def _pow2_at_least_16(n: int) -> int:
    return max(16, 1 << max(n - 1, 0).bit_length())


SPLIT_WAVES = int(os.environ.get("COSERVE_LORA_SPLIT_WAVES", "1"))
"""Split-K programs per SM that :meth:`LoRALaunch.for_order` aims for in large steps (0: split only
while the tiles leave SMs idle). 1 since session 8: a 4,096-token prefill's shrinks split 4 ways
instead of 2, 63 µs per layer's four instead of 88 on the H200 (``bench/lora_kernels.py``), now that
the expand sums the partials once per program (session 7's split-K loss was the expand's)."""

SMALL_STEP_TOKENS = 256
"""Steps of up to this many tokens get 16-row tiles, larger ones 64-row tiles."""

EXPAND_FIRST = os.environ.get("COSERVE_LORA_EXPAND_FIRST", "1") == "1"
"""Eager steps of more than :data:`SMALL_STEP_TOKENS` tokens run each fused linear LoRA first
(:meth:`ExpandFirstTritonLoRA.whole_linear`): the expand stores the delta, which the base GEMM reads
in its epilogue, instead of reading and rewriting the GEMM's output. On since session 8: with the
grouped expand, a 4,096-token prefill's expand takes 4.3 ms instead of 8.4 ms
(``bench/profile_lora.py``). ``COSERVE_LORA_EXPAND_FIRST=0`` turns it off."""


PREFILL_SHRINK_TILE = int(os.environ.get("COSERVE_LORA_SHRINK_TILE", "64"))
"""Rows per shrink program in steps of 64-row tiles (``COSERVE_LORA_SHRINK_TILE``: 16, 32 or 64, the
expand's tiles). A 4,096-token prefill has 68 tiles of 64 rows for 132 multiprocessors; tiles of
32 rows run 136 programs (any 32-row tile of an order padded to 64 holds one slot's tokens). On
the H200 that did not make the shrink faster (3.59 ms per 4k step against 3.5 ms, session 7's
``profile_lora``): it stays at 64."""


EXPAND_WAVES = int(os.environ.get("COSERVE_LORA_EXPAND_WAVES", "8"))
"""Expand programs per SM that :func:`expand_blocks_per_program` aims for: each program keeps its
tile's ``v`` and walks several column blocks, so a large step's expand is not ~3,000 programs
(4,096 tokens × 6,144 q/k/v columns in 64 × 128 tiles) that each reload ``v``, gather their rows
and store one tile. ``COSERVE_LORA_EXPAND_WAVES=0``: one column block per program (session 7's
launch geometry). On the H200 at 4,096 tokens (``bench/lora_kernels.py``, the storing expand of
expand-first), 8 per SM took 125 µs for a layer's four linears, 4 per SM 131 µs, one block per
program 192 µs."""


def block_m_for(num_tokens: int) -> int:
    """Tile height: small tiles for decode-sized batches, larger ones for prefill."""
    return 16 if num_tokens <= SMALL_STEP_TOKENS else 64


def shrink_block_m(block_m: int) -> int:
    """The shrink's tile height in a step of ``block_m``-row tiles (:data:`PREFILL_SHRINK_TILE` for
    64-row tiles; it divides ``block_m``, so every shrink tile lies inside one expand tile)."""
    if block_m == 64 and PREFILL_SHRINK_TILE in (16, 32, 64):
        return PREFILL_SHRINK_TILE
    return block_m


def graph_order_length(batch_size: int, num_slots: int) -> int:
    """Length of a static ``order`` that fits any routing of ``batch_size`` tokens over
    ``num_slots`` adapters: each slot's group wastes less than one tile."""
    block_m = block_m_for(batch_size)
    return (batch_size // block_m + num_slots) * block_m


def graph_store_length(batch_size: int, num_slots: int) -> int:
    """Length of a static storing-expand order (:meth:`TritonLoRA.graph_store`) that fits any
    routing of ``batch_size`` tokens: the slots' groups and the group of tokens without an
    adapter each waste less than one tile."""
    return graph_order_length(batch_size, max(num_slots, 1) + 1)


@dataclass(frozen=True)
class LoRALaunch:
    """Launch shape shared by every linear of one step: a function of ``len(order)`` only."""

    block_m: int
    num_tiles: int
    max_split_k: int  # a power of two

    @classmethod
    def for_order(cls, order_length: int, block_m: int, sms: int, waves: int | None = None) -> LoRALaunch:
        """Split K while the tiles alone would leave SMs idle (up to 8 ways). With ``waves``
        (default :data:`SPLIT_WAVES`), a step of 64-row tiles (a prefill; decode-sized steps keep
        the split above) whose tiles fill the SMs splits further, up to
        16 ways, until ``tiles · split`` reaches ``waves`` per SM: a 4,096-token prefill has
        68 tiles of 64 rows for 132 SMs, and each of its shrink programs walks the whole input
        dimension (224 steps of 64 for ``down_proj``) with nothing beside it."""
        tiles = max(1, -(-order_length // block_m))
        split = 1
        while split < 8 and tiles * split * 2 <= sms:
            split *= 2
        waves = SPLIT_WAVES if waves is None else waves
        while waves and block_m >= 64 and split < 16 and tiles * split < waves * sms:
            split *= 2
        return cls(block_m, tiles, split)


def expand_blocks_per_program(num_tiles: int, n_blocks: int, sms: int, waves: int | None = None) -> int:
    """Column blocks each expand program walks: as many as keep ``num_tiles · groups`` programs at
    ``waves`` per SM or more (default :data:`EXPAND_WAVES`; 0: one block each). Decode-sized steps
    have few tiles and keep one block per program; a 4,096-token prefill (68 tiles of 64 rows on
    132 SMs, ``waves`` 8) gets 16 groups of column blocks: 3 blocks per program for q/k/v's 48."""
    waves = EXPAND_WAVES if waves is None else waves
    if waves <= 0:
        return 1
    groups = max(1, min(n_blocks, -(-waves * sms // max(num_tiles, 1))))
    return -(-n_blocks // groups)


def lora_shrink_expand(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scales: torch.Tensor,
    token_slots: torch.Tensor,
    order: torch.Tensor,
    launch: LoRALaunch,
) -> None:
    """Gathered segmented multi-LoRA, in place: ``y[t] += x[t] @ a[s].T @ b[s].T · scales[s]``
    with ``s = token_slots[t]``, for every token ``t`` listed in ``order`` whose slot is not -1.

    y: [T, out] (row stride free, unit column stride: a column slice of a fused output works),
    x: [T, in], a: [S, r, in], b: [S, out, r] (slot and row strides free, unit last stride: views
    into a fused linear's stacks work), scales: [S] fp32, token_slots: [T] int64,
    order: [N] int32 token indices, one slot per tile of ``launch.block_m`` (see
    :func:`order_by_slot`), -1 padded.
    """
    lora_shrink_expand_fused(y, x, a, b, [b.shape[1]], scales, token_slots, order, launch)


def _check_slices(
    y: torch.Tensor, x: torch.Tensor, a_all: torch.Tensor, b_all: torch.Tensor, out_sizes: Sequence[int]
) -> None:
    k = len(out_sizes)
    rank = b_all.shape[2]
    d_out = sum(out_sizes)
    if not 1 <= k <= MAX_FUSED_TARGETS:
        raise ValueError(f"{k} output slices: one launch serves 1 to {MAX_FUSED_TARGETS}")
    assert a_all.shape[1] == k * rank and b_all.shape[1] == d_out and y.shape[1] == d_out, (
        f"stacks {list(a_all.shape)}, {list(b_all.shape)} and output {list(y.shape)} do not fit "
        f"slices {list(out_sizes)}"
    )
    assert x.stride(1) == 1 and y.stride(1) == 1 and a_all.stride(2) == 1 and b_all.stride(2) == 1


def _column_blocks(out_sizes: Sequence[int]) -> tuple[int, int, list[int]]:
    """``(BLOCK_N, number of column blocks, [blk1, blk2, blk3, col1, .., col4])``: the column-block
    and column boundaries of the slices (see :func:`_expand_kernel`); unused ones lie past every
    block."""
    k = len(out_sizes)
    block_n = 128 if min(out_sizes) >= 1024 else 64
    blks, cols = [0], [0]
    for n in out_sizes:
        blks.append(blks[-1] + -(-n // block_n))
        cols.append(cols[-1] + n)
    unused = 1 << 30
    blk = blks[1:k] + [unused] * (MAX_FUSED_TARGETS - k)
    col = cols[1:] + [unused] * (MAX_FUSED_TARGETS - k)
    return block_n, blks[-1], blk + col


def lora_shrink_expand_fused(
    y: torch.Tensor,
    x: torch.Tensor,
    a_all: torch.Tensor,
    b_all: torch.Tensor,
    out_sizes: Sequence[int],
    scales: torch.Tensor,
    token_slots: torch.Tensor,
    order: torch.Tensor,
    launch: LoRALaunch,
) -> None:
    """:func:`lora_shrink_expand` for the ``k = len(out_sizes)`` output slices of a fused linear,
    which share ``x``, in two launches: one shrink over all ``k·r`` rows of ``a_all``, one expand
    whose column blocks each belong to one slice.

    Slice ``i`` (columns ``[off_i, off_i + out_i)`` of ``y``, ``off_i = Σ_{j<i} out_j``) gets
    ``y[t, off_i:off_i+out_i] += x[t] @ A_i[s].T @ B_i[s].T · scales[s]`` with
    ``A_i = a_all[:, i·r:(i+1)·r]``, ``B_i = b_all[:, off_i:off_i+out_i]``.

    y: [T, Σ out] (unit column stride), x: [T, in], a_all: [S, k·r, in], b_all: [S, Σ out, r]
    (unit last strides), k <= :data:`MAX_FUSED_TARGETS`; the rest as :func:`lora_shrink_expand`.
    """
    _check_slices(y, x, a_all, b_all, out_sizes)
    if order.shape[0] == 0 or x.shape[0] == 0:
        return
    v = lora_shrink_fused(x, a_all, b_all.shape[2], token_slots, order, launch)
    lora_expand_fused(y, b_all, v, out_sizes, scales, token_slots, order, launch)


def lora_shrink_fused(
    x: torch.Tensor, a_all: torch.Tensor, rank: int, token_slots: torch.Tensor, order: torch.Tensor,
    launch: LoRALaunch, *, block_k: int | None = None, num_warps: int | None = None,
) -> torch.Tensor:
    """The shrink half of :func:`lora_shrink_expand_fused`: fp32 partials ``v [split_k, T, R_PAD]``
    with ``Σ_k v[k, t, :k·r] = x[t] @ a_all[slot(t)].T`` (rows of ``x`` without an adapter are
    left unwritten; the expand never reads them). It reads only ``x`` and the A stacks, so it can
    run beside the base linear that reads the same ``x`` (:meth:`ForkedTritonLoRA.whole_linear`).

    ``block_k`` / ``num_warps``: the kernel's K step and warps; by default 64 and 4, and 128 and 8
    for inputs of 8,192 features or more in steps of 64-row tiles (``down_proj`` at a prefill: on
    the H200 31 µs instead of 36 at 4,096 tokens, 21 instead of 30 at 2,048;
    ``bench/lora_kernels.py`` compares settings)."""
    t_rows, d_in = x.shape
    wide = launch.block_m >= 64 and x.shape[1] >= 8192
    block_k = block_k or (128 if wide else 64)
    num_warps = num_warps or (8 if wide else 4)
    k_rank = a_all.shape[1]
    assert k_rank % rank == 0
    r_pad = _pow2_at_least_16(k_rank)
    split_k = launch.max_split_k
    while split_k > 1 and d_in < split_k * 256:
        split_k //= 2
    k_per_split = -(-d_in // (split_k * block_k)) * block_k
    v = torch.empty(split_k, t_rows, r_pad, dtype=torch.float32, device=x.device)
    block_m = shrink_block_m(launch.block_m)
    jit(_shrink_kernel)[(launch.num_tiles * (launch.block_m // block_m), split_k)](
        x, a_all, v, order, token_slots, order.shape[0],
        x.stride(0), a_all.stride(0), a_all.stride(1), v.stride(0), v.stride(1), d_in, k_per_split,
        RANK=k_rank, R_PAD=r_pad, BLOCK_M=block_m, BLOCK_K=block_k, num_warps=num_warps,
    )
    return v


def lora_expand_fused(
    y: torch.Tensor, b_all: torch.Tensor, v: torch.Tensor, out_sizes: Sequence[int], scales: torch.Tensor,
    token_slots: torch.Tensor, order: torch.Tensor, launch: LoRALaunch, accumulate: bool = True,
    bias: torch.Tensor | None = None, *, waves: int | None = None, num_warps: int = 4,
) -> None:
    """The expand half of :func:`lora_shrink_expand_fused`: ``y[t, slice i] += (Σ_k v[k, t, i·r:(i+1)·r])
    @ B_i[slot(t)].T · scales[slot(t)]`` for the partials ``v`` of :func:`lora_shrink_fused`.

    Not ``accumulate``: ``y[t] = … + bias`` (``y`` is not read), for every token ``t`` listed in
    ``order``, whose tokens without an adapter (slot -1, in tiles of their own) get ``y[t] = bias``
    (zeros without ``bias [Σ out]``); ``launch.num_tiles`` must cover ``order``.

    ``waves`` (default :data:`EXPAND_WAVES`, see :func:`expand_blocks_per_program`) and
    ``num_warps``: the launch geometry (``bench/lora_kernels.py`` compares settings).
    """
    assert bias is None or (not accumulate and bias.shape == (y.shape[1],) and bias.stride(0) == 1), (
        "a bias only with a storing expand (whoever writes y first adds it), one per column"
    )
    assert accumulate or launch.num_tiles * launch.block_m >= order.shape[0]
    rank = b_all.shape[2]
    k_rank = rank * len(out_sizes)
    assert v.shape[2] >= k_rank
    block_n, n_blocks, bounds = _column_blocks(out_sizes)
    per_program = expand_blocks_per_program(launch.num_tiles, n_blocks, num_sms(y.device), waves)
    jit(_expand_kernel)[(launch.num_tiles, -(-n_blocks // per_program))](
        y, b_all, v, order, token_slots, scales, y if bias is None else bias, order.shape[0], n_blocks, per_program,
        v.shape[0], y.stride(0), b_all.stride(0), b_all.stride(1), v.stride(0), v.stride(1), *bounds,
        RANK=rank, K_RANK=k_rank, R_PAD=v.shape[2], BLOCK_M=launch.block_m,
        BLOCK_N=block_n, ACCUMULATE=accumulate, HAS_BIAS=bias is not None, num_warps=num_warps,
    )


def slice_stacks(
    a_all: torch.Tensor, b_all: torch.Tensor, out_slices: dict[str, int]
) -> Iterator[tuple[str, int, torch.Tensor, torch.Tensor]]:
    """``(target, column offset, A [S, r, in], B [S, out, r])`` of each output slice of fused
    stacks ``a_all [S, k·r, in]``, ``b_all [S, Σ out, r]`` (views)."""
    rank = b_all.shape[2]
    off = 0
    for i, (name, size) in enumerate(out_slices.items()):
        yield name, off, a_all[:, i * rank : (i + 1) * rank], b_all[:, off : off + size]
        off += size


Group = tuple[list[range], int]
"""One slot's tokens in a routing: their ranges (one per row, row order) and the -1 padding after."""


def slot_groups(row_lens: Sequence[int], row_slots: Sequence[int], block_m: int) -> tuple[list[Group], Group]:
    """``(routed, unrouted)``: the groups of the rows that use an adapter, by slot ascending, and
    the group of the rows without one (slot -1), each padded to a multiple of ``block_m``; what
    :func:`order_by_slot`, :func:`unrouted_order` and :func:`routing_tensor` lay out."""
    ranges: dict[int, list[range]] = {}
    start = 0
    for n, s in zip(row_lens, row_slots, strict=True):
        if n:
            ranges.setdefault(max(s, -1), []).append(range(start, start + n))
        start += n

    def group(slot: int) -> Group:
        rows = ranges.get(slot, [])
        return rows, -sum(map(len, rows)) % block_m

    return [group(s) for s in sorted(ranges) if s >= 0], group(-1)


def _as_list(groups: Sequence[Group]) -> list[int]:
    order: list[int] = []
    for rows, pad in groups:
        order.extend(itertools.chain.from_iterable(rows))
        order.extend([-1] * pad)
    return order


def order_by_slot(row_lens: Sequence[int], row_slots: Sequence[int], block_m: int) -> list[int]:
    """Token indices of the rows that use an adapter, grouped by slot (row order kept within),
    each group padded with -1 to a multiple of ``block_m``."""
    return _as_list(slot_groups(row_lens, row_slots, block_m)[0])


def unrouted_order(row_lens: Sequence[int], row_slots: Sequence[int], block_m: int) -> list[int]:
    """Token indices of the rows without an adapter (slot -1), -1 padded to a multiple of
    ``block_m``: appended to :func:`order_by_slot`'s, the tiles in which a storing expand
    (:func:`lora_expand_fused`, not ``accumulate``) writes zeros, so that every token is written."""
    return _as_list([slot_groups(row_lens, row_slots, block_m)[1]])


def routing_tensor(row_lens: Sequence[int], row_slots: Sequence[int], block_m: int,
                   unrouted: bool = False) -> tuple[torch.Tensor, int]:
    """``(order, n)``: :func:`order_by_slot` as a host int32 tensor of length ``n``, followed with
    ``unrouted`` by :func:`unrouted_order`, made from one ``arange`` per row instead of a Python
    list of every token (a 4,096-token step's list and its copy took 0.44–0.80 ms of host time on
    the H200's host, with the GPU idle)."""
    routed, rest = slot_groups(row_lens, row_slots, block_m)
    pieces: list[torch.Tensor] = []
    for rows, pad in routed + ([rest] if unrouted else []):
        pieces += [torch.arange(r.start, r.stop, dtype=torch.int32) for r in rows]
        if pad:
            pieces.append(torch.full((pad,), -1, dtype=torch.int32))
    n = sum(len(r) for rows, _ in routed for r in rows) + sum(pad for _, pad in routed)
    return (torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int32)), n


@dataclass(frozen=True)
class StoreRouting:
    """The routing of a storing expand (:meth:`ExpandFirstTritonLoRA.whole_linear`): the step's
    ``order`` followed by :func:`unrouted_order`, so its tiles cover every token once."""

    order: torch.Tensor  # [N'] int32
    launch: LoRALaunch  # the step's, with tiles enough for ``order``


@dataclass
class TritonLoRA:
    """LoRA context (:class:`coserve.layers.lora.LoRAContext`) running :func:`lora_shrink_expand`.

    Built once per step; ``token_slots`` and ``order`` may be static buffers of a CUDA graph.
    """

    token_slots: torch.Tensor  # [T] int64
    order: torch.Tensor  # [N] int32
    scales: torch.Tensor  # [S] fp32
    launch: LoRALaunch
    # The routing of an ExpandFirstTritonLoRA (from_batch: large steps with EXPAND_FIRST); None otherwise.
    store: StoreRouting | None = field(default=None, kw_only=True)

    @classmethod
    def for_graph(cls, token_slots: torch.Tensor, order: torch.Tensor, scales: torch.Tensor, batch_size: int,
                  num_slots: int, **extra: Any) -> Self:
        """The context of a CUDA graph of ``batch_size`` tokens over the static routing buffers
        ``token_slots`` and ``order`` (long enough for the largest graph; see
        :func:`graph_order_length`), which the runner refills before each replay."""
        length = graph_order_length(batch_size, max(num_slots, 1))
        launch = LoRALaunch.for_order(length, block_m_for(batch_size), num_sms(token_slots.device))
        return cls(token_slots[:batch_size], order[:length], scales, launch, **extra)

    @staticmethod
    def graph_store(store_order: torch.Tensor, batch_size: int, num_slots: int) -> StoreRouting:
        """The routing of a storing expand in a CUDA graph of ``batch_size`` tokens over the static
        buffer ``store_order`` (at least :func:`graph_store_length` long, refilled before each
        replay with :func:`routing_tensor` ``(..., unrouted=True)`` over every row of the
        graph, its padding rows too, so that every output row is written)."""
        length = graph_store_length(batch_size, num_slots)
        block_m = block_m_for(batch_size)
        launch = LoRALaunch.for_order(graph_order_length(batch_size, max(num_slots, 1)), block_m,
                                      num_sms(store_order.device))
        return StoreRouting(store_order[:length], replace(launch, num_tiles=length // block_m))

    @classmethod
    def from_batch(cls, batch: LoRABatch, scales: torch.Tensor) -> TritonLoRA:
        """The context of an eager step; with :data:`EXPAND_FIRST` and more than
        :data:`SMALL_STEP_TOKENS` tokens, an :class:`ExpandFirstTritonLoRA` with its routing."""
        tokens = batch.seg_starts[-1]
        block_m = block_m_for(tokens)
        device = batch.token_slots.device
        # (the unrouted tail too when the step may run expand-first: one copy for both)
        maybe_first = EXPAND_FIRST and tokens > SMALL_STEP_TOKENS
        host, routed = routing_tensor(batch.seg_lens, batch.seg_slots, block_m, unrouted=maybe_first)
        launch = LoRALaunch.for_order(routed, block_m, num_sms(device))
        first = maybe_first and routed > 0
        routing = to_device(host if first else host[:routed], device)
        if first:
            store = StoreRouting(routing, replace(launch, num_tiles=routing.shape[0] // block_m))
            return ExpandFirstTritonLoRA(token_slots=batch.token_slots, order=routing[:routed], scales=scales,
                                         launch=launch, store=store)
        return cls(token_slots=batch.token_slots, order=routing, scales=scales, launch=launch)

    def apply(
        self, layer: int, target: str, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor
    ) -> None:
        lora_shrink_expand(y, x, a, b, self.scales, self.token_slots, self.order, self.launch)

    def apply_fused(
        self,
        layer: int,
        x: torch.Tensor,
        y: torch.Tensor,
        a_all: torch.Tensor,
        b_all: torch.Tensor,
        out_slices: dict[str, int],
    ) -> None:
        """Every output slice of a fused linear in one shrink and one expand launch (see
        :meth:`coserve.layers.lora.FusedLoRAContext.apply_fused`)."""
        if FUSED_SLICES and len(out_slices) <= MAX_FUSED_TARGETS:
            lora_shrink_expand_fused(
                y, x, a_all, b_all, list(out_slices.values()), self.scales, self.token_slots, self.order,
                self.launch,
            )
            return
        for name, off, a, b in slice_stacks(a_all, b_all, out_slices):
            self.apply(layer, name, x, y[:, off : off + out_slices[name]], a, b)

    def linear_then_lora(
        self,
        layer: int,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        a_all: torch.Tensor,
        b_all: torch.Tensor,
        out_slices: dict[str, int],
    ) -> torch.Tensor:
        """``F.linear(x, weight, bias)``, then :meth:`apply_fused` on it: the usual order, which the
        subclasses' :meth:`whole_linear` fall back to where their own order does not apply."""
        y = F.linear(x, weight, bias)
        self.apply_fused(layer, x, y, a_all, b_all, out_slices)
        return y


@dataclass
class ExpandFirstTritonLoRA(TritonLoRA):
    """:class:`TritonLoRA` of a large eager step routed for :data:`EXPAND_FIRST` (built by
    :meth:`TritonLoRA.from_batch`): :class:`coserve.layers.lora.LoRALinear` calls
    :meth:`whole_linear` instead of its own GEMM and :meth:`apply_fused`."""

    def whole_linear(
        self,
        layer: int,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        a_all: torch.Tensor,
        b_all: torch.Tensor,
        out_slices: dict[str, int],
    ) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` plus :meth:`apply_fused`, the same result, LoRA first
        (with the step's routing, :attr:`store`): the shrink, then an expand that stores
        ``y[t] = Δ[t] + bias`` into a fresh output (``bias`` alone on the rows without adapter),
        then ``y.addmm_(x, weight.T)``, whose GEMM reads ``y`` in its epilogue. The usual order
        writes ``y`` in the GEMM and then reads and rewrites it in the expand; this one saves a
        whole read of ``y`` per linear (4,096 × 28,672 bf16, 235 MB, for gate/up at a 4,096-token
        prefill), the epilogue's read overlapping the GEMM's compute. Anything else (small steps,
        per-slice launches, no routing): the usual order.

        NOTE: the stored Δ is rounded to ``y``'s dtype before the GEMM adds to it, where the usual
        order rounds the base output before the expand adds Δ in fp32: the same error, not the
        same bits.
        """
        store = self.store
        if store is None or not FUSED_SLICES or len(out_slices) > MAX_FUSED_TARGETS:
            return self.linear_then_lora(layer, x, weight, bias, a_all, b_all, out_slices)
        sizes = list(out_slices.values())
        y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
        _check_slices(y, x, a_all, b_all, sizes)
        v = lora_shrink_fused(x, a_all, b_all.shape[2], self.token_slots, self.order, self.launch)
        lora_expand_fused(y, b_all, v, sizes, self.scales, self.token_slots, store.order, store.launch,
                          accumulate=False, bias=bias)
        return y.addmm_(x, weight.t())


@dataclass
class ForkedTritonLoRA(TritonLoRA):
    """:class:`TritonLoRA` for captured decode graphs whose fused linears run their LoRA shrink
    on ``side_stream``, beside the base GEMM (a fork and a join inside the graph): at decode a
    LoRA launch costs a few microseconds however little it computes, so this hides the shrink's
    half of them. :class:`coserve.layers.lora.LoRALinear` calls :meth:`whole_linear` instead of
    its own GEMM and :meth:`apply_fused`."""

    side_stream: torch.cuda.Stream

    def whole_linear(
        self,
        layer: int,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        a_all: torch.Tensor,
        b_all: torch.Tensor,
        out_slices: dict[str, int],
    ) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` plus :meth:`apply_fused`, the same result, with the
        shrink (which needs only ``x``) on :attr:`side_stream` while the GEMM runs on the current
        stream, and the expand after both.

        NOTE: ``v`` is allocated on the side stream and last used on the current one; the next
        fork makes the side stream wait for everything queued on the current one before it
        reuses any memory, so no ``record_stream`` is needed.
        """
        if not FUSED_SLICES or len(out_slices) > MAX_FUSED_TARGETS or self.order.shape[0] == 0:
            return self.linear_then_lora(layer, x, weight, bias, a_all, b_all, out_slices)  # no single shrink to fork
        main, side = torch.cuda.current_stream(x.device), self.side_stream
        side.wait_stream(main)
        with torch.cuda.stream(side):
            v = lora_shrink_fused(x, a_all, b_all.shape[2], self.token_slots, self.order, self.launch)
        y = F.linear(x, weight, bias)
        main.wait_stream(side)
        lora_expand_fused(y, b_all, v, list(out_slices.values()), self.scales, self.token_slots, self.order,
                          self.launch)
        return y

"""Triton attention backend: paged decode (split-K, CUDA-graph capturable) and varlen prefill.

Same contract as :class:`coserve.layers.attention.TorchAttention` (see that module's docstring
for the flat batch layout). Three kernels:

- ``store_kv``: ``kv[slot // bs, 0|1, slot % bs] = k|v`` for every token whose slot is not -1.
- ``prefill``: one program per (query tile of one prefill row, query head[, split]). Keys are
  the row's cached prefix (positions ``< ctx``, read through its block table) followed by the
  row's own new tokens (read from ``k``/``v``, causal). Unless ``COSERVE_PREFILL_SPLITS=0``, a
  step whose tiles over cached prefixes would leave most of the GPU idle (a short chunk over a
  long cached prefix: a chat's next turn, a prompt's last chunk; ``PREFILL_SPLIT_TILES``) cuts
  each cached prefix into splits as ``decode`` does, the row's own tokens in split 0, and
  ``merge`` combines them. Prefill rows with no cached prefix (fresh prompts,
  fine-tuning rows, which write no KV and attend causally within themselves) go to torch SDPA
  instead (FlashAttention-2 on the GPU: 2.5-3x this kernel on the H200, see
  ``bench/results/engine_speed_h200.json``), unless a sliding window cuts into the row. (Rows
  over cached context through one varlen flash call over keys gathered from the pages ran
  0.38-0.89x this kernel below 2k-token chunks on the H200, session 16 at 340326a,
  ``bench/results/engine_h200/session16/``: not kept.)
- ``decode``: one program per (decode row, KV head, split). The row's ``ctx`` cached keys are cut
  into ``num_splits`` equal ranges *inside the kernel*, so the grid depends on the batch size
  only and the launch can be captured in a CUDA graph; the row's own new key comes from
  ``k``/``v``. Split partials ``(o, lse)`` are merged by ``merge``.

Mistral's sliding window (query at position p sees keys ``p - window < j <= p``) is applied in
both kernels: key ranges start at the window's edge, masks cover the rest.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, cast

import torch

from coserve.host_copy import device_tensor
from coserve.layers.sdpa import sdpa
from coserve.layers.varlen_attention import varlen_forward, varlen_forward_fits

if TYPE_CHECKING:
    import triton.language as tl

    from coserve.layers.attention import AttentionMetadata, PlainRun

HAS_TRITON = importlib.util.find_spec("triton") is not None


_KernelFn = TypeVar("_KernelFn", bound=Callable[..., None])


def varying(*names: str) -> Callable[[_KernelFn], _KernelFn]:
    """Mark a kernel's arguments that change from step to step (token and row counts, block-table
    widths, pointers into a slice that starts at a row count) as ``do_not_specialize``.

    Triton compiles one variant per specialization of an integer argument (``== 1``, divisible by
    16) and of a pointer (16-byte aligned); an argument named here gets none, so its value never
    asks for a new compilation in the middle of serving. The kernel computes the same results:
    specialization only gives the compiler hints.
    """

    def mark(fn: _KernelFn) -> _KernelFn:
        unknown = set(names) - set(inspect.signature(fn).parameters)
        assert not unknown, f"{fn.__name__} has no argument {sorted(unknown)}"
        fn.__dict__["do_not_specialize"] = names
        return fn

    return mark


@functools.cache
def jit(fn: Callable[..., None]) -> Any:
    """``triton.jit(fn)``, done at the kernel's first launch, with the arguments that
    :func:`varying` names as ``do_not_specialize``.

    NOTE: Triton decides when it is imported whether its own library functions run in its
    interpreter (``TRITON_INTERPRET=1``), so it is imported here, never at module import; the
    kernels' ``tl`` global is bound here too.
    """
    import triton
    import triton.language

    fn.__globals__["tl"] = triton.language
    return triton.jit(fn, do_not_specialize=list(fn.__dict__.get("do_not_specialize", ())))


def triton_usable(device: torch.device) -> bool:
    """Whether Triton kernels can run on tensors of ``device`` (GPU, or CPU in interpret mode)."""
    if not HAS_TRITON:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def _store_kv_kernel(
    k_ptr, v_ptr, kv_ptr, slot_ptr,
    s_kt, s_vt, s_block, s_kv, s_tok, s_head,
    BLOCK_SIZE: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BLOCK_HD: tl.constexpr,
):
    t = tl.program_id(0)
    i = tl.arange(0, BLOCK_HD)
    slot = tl.load(slot_ptr + t + i * 0)  # broadcast as a block: scalar & block masks trip the interpreter
    head, d = i // D, i % D
    mask = (i < KVH * D) & (slot >= 0)
    safe = tl.maximum(slot, 0)
    dst = kv_ptr + (safe // BLOCK_SIZE) * s_block + (safe % BLOCK_SIZE) * s_tok + head * s_head + d
    k = tl.load(k_ptr + t * s_kt + i, mask=mask)
    v = tl.load(v_ptr + t * s_vt + i, mask=mask)
    tl.store(dst, k, mask=mask)
    tl.store(dst + s_kv, v, mask=mask)


# The tiles' pointers are three rows of one [3, num_tiles] tensor: the others' alignment
# follows the tile count. The block-table width follows the batch's longest row.
@varying("tile_row_ptr", "tile_m_ptr", "tile_p_ptr", "s_bt", "num_splits")
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, po_ptr, lse_ptr, kv_ptr, cu_ptr, ctx_ptr, bt_ptr, tile_row_ptr, tile_m_ptr,
    tile_p_ptr,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ot, s_oh,
    s_block, s_kv, s_tok, s_head, s_bt,
    scale, window, num_splits,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    kvh = h // GROUP
    row = tl.load(tile_row_ptr + tile)
    m0 = tl.load(tile_m_ptr + tile)
    q_start = tl.load(cu_ptr + row)
    n = tl.load(cu_ptr + row + 1) - q_start
    ctx = tl.load(ctx_ptr + row)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    mask_m = offs_m < n
    tok_m = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + tok_m[:, None] * s_qt + h * s_qh + offs_d[None, :], mask=mask_m[:, None], other=0.0)
    qpos = ctx + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)

    # Cached prefix: keys at positions [lo, ctx) through the block table; this split's share of
    # them (all of them with one split).
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx + m0 - window + 1, 0)
    per_split = tl.cdiv(ctx - lo, num_splits)
    lo = lo + sp * per_split
    hi = tl.minimum(lo + per_split, ctx)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        page = tl.load(bt_ptr + row * s_bt + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        base = page * s_block + (offs_n % BLOCK_SIZE) * s_tok + kvh * s_head
        k = tl.load(kv_ptr + base[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        v = tl.load(kv_ptr + s_kv + base[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        keep = mask_n[None, :]
        if HAS_WINDOW:
            keep = keep & (offs_n[None, :] > qpos[:, None] - window)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # The row's own tokens, causal: local key index j < min(n, m0 + BLOCK_M); split 0's alone.
    lo2 = 0
    if HAS_WINDOW:
        lo2 = tl.maximum(m0 - window + 1, 0)
    hi2 = tl.where(sp == 0, tl.minimum(n, m0 + BLOCK_M), lo2)
    for n0 in range(lo2, hi2, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi2
        tok_n = (q_start + offs_n).to(tl.int64)
        k = tl.load(k_ptr + tok_n[:, None] * s_kt + kvh * s_kh + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        v = tl.load(v_ptr + tok_n[:, None] * s_vt + kvh * s_vh + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        keep = mask_n[None, :] & (offs_n[None, :] <= offs_m[:, None])
        if HAS_WINDOW:
            keep = keep & (offs_n[None, :] > offs_m[:, None] - window)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if not SPLIT:
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_i[:, None]
        tl.store(o_ptr + tok_m[:, None] * s_ot + h * s_oh + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=mask_m[:, None])
    else:
        # Partials [P, H, num_splits, D] and lse [P, H, num_splits] over the kernel's P tokens
        # (-inf for an empty split), as the decode kernel's, merged per (token, head) by _merge_kernel.
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_safe))
        # (the workspace holds the kernel's tokens alone: the tile's row's first at row p0 of it)
        p0 = tl.load(tile_p_ptr + tile)
        prow = ((p0 + offs_m).to(tl.int64) * tl.num_programs(1) + h) * num_splits + sp
        tl.store(lse_ptr + prow, lse, mask=mask_m)
        # (an empty split, such as every split but the first of a row without cached context,
        # stores no partial: the merge reads none where the log-sum-exp is -inf)
        tl.store(po_ptr + prow[:, None] * D + offs_d[None, :], acc / l_safe[:, None],
                 mask=(mask_m & (l_i > 0.0))[:, None])


# The decode rows follow the prefill rows: their context lengths and block tables are slices
# that start at the number of prefill rows.
@varying("ctx_ptr", "bt_ptr", "s_bt", "num_splits")
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, po_ptr, lse_ptr, kv_ptr, ctx_ptr, bt_ptr,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ot, s_oh,
    s_block, s_kv, s_tok, s_head, s_bt,
    scale, window, num_splits,
    SPLIT: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(ctx - window + 1, 0)
    per_split = tl.cdiv(ctx - start, num_splits)
    lo = start + sp * per_split
    hi = tl.minimum(lo + per_split, ctx)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    mask_g = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + b * s_qt + heads[:, None] * s_qh + offs_d[None, :], mask=mask_g[:, None], other=0.0)

    # The row's own key (position ctx) seeds split 0; the other splits start empty.
    k_self = tl.load(k_ptr + b * s_kt + kvh * s_kh + offs_d).to(tl.float32)
    v_self = tl.load(v_ptr + b * s_vt + kvh * s_vh + offs_d).to(tl.float32)
    s_self = tl.sum(q.to(tl.float32) * k_self[None, :], 1) * scale
    first = sp == 0
    m_i = tl.where(first, s_self, float("-inf"))
    l_i = tl.where(first, 1.0, 0.0) + tl.zeros([BLOCK_G], tl.float32)
    acc = tl.where(first, 1.0, 0.0) * (tl.zeros([BLOCK_G, D], tl.float32) + v_self[None, :])

    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        page = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        base = page * s_block + (offs_n % BLOCK_SIZE) * s_tok + kvh * s_head
        k = tl.load(kv_ptr + base[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        v = tl.load(kv_ptr + s_kv + base[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if not SPLIT:
        out = acc / l_i[:, None]
        tl.store(o_ptr + b * s_ot + heads[:, None] * s_oh + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=mask_g[:, None])
    else:
        # Partials [B, H, num_splits, D] and lse [B, H, num_splits] (-inf for an empty split).
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_safe))
        row = (b * (GROUP * tl.num_programs(1)) + heads) * num_splits + sp
        tl.store(lse_ptr + row, lse, mask=mask_g)
        tl.store(po_ptr + row[:, None] * D + offs_d[None, :], acc / l_safe[:, None], mask=mask_g[:, None])


@varying("num_splits")
def _merge_kernel(
    po_ptr, lse_ptr, o_ptr, tok_ptr, s_ot, s_oh, H, num_splits,
    BLOCK_S: tl.constexpr, D: tl.constexpr, INDEXED: tl.constexpr,
):
    # One program per (workspace row, head): the partials of row b go to token b, or with INDEXED
    # to token tok_ptr[b] (a step whose prefill rows are not all the paged kernel's: the workspace
    # holds the kernel's tokens alone, and the merge leaves the others' output as it is).
    b = tl.program_id(0)
    t = b
    if INDEXED:
        t = tl.load(tok_ptr + b)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    mask_s = offs_s < num_splits
    row = (b * H + h) * num_splits
    lse = tl.load(lse_ptr + row + offs_s, mask=mask_s, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))
    # (a split of -inf weighs nothing and may have stored no partial)
    keep = mask_s & (lse > float("-inf"))
    o = tl.load(po_ptr + (row + offs_s)[:, None] * D + offs_d[None, :], mask=keep[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(o_ptr + t * s_ot + h * s_oh + offs_d, out.to(o_ptr.dtype.element_ty))


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (4 stands in for the CPU interpreter)."""
    if device.type != "cuda":
        return 4
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    """``out = softmax(q kᵀ · scale, causal) v`` for one row. q, out: [n, H, D]; k, v: [n, KVH, D]."""
    group = q.shape[1] // k.shape[1]
    # NOTE: KV heads are expanded because SDPA's flash kernel does not take GQA on every build.
    # NOTE: 4-D inputs: with 3-D ones SDPA silently takes its math path (an n x n score matrix).
    kx, vx = (t.repeat_interleave(group, 1).transpose(0, 1)[None] for t in (k, v))
    o = sdpa(q.transpose(0, 1)[None], kx, vx, is_causal=True, scale=scale)
    out.copy_(o[0].transpose(0, 1))


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``kv_layer[slot // bs, 0|1, slot % bs] = k|v`` for every token whose slot is not -1.

    k, v: [T, KVH, D] (heads and dim contiguous); kv_layer: [N, 2, bs, KVH, D] (any block stride);
    slot_mapping: [T] int64.
    """
    t, kvh, d = k.shape
    if t == 0:
        return
    s_block, s_kv, s_tok, s_head, s_d = kv_layer.stride()
    assert s_d == 1 and k.stride(2) == 1 and k.stride(1) == d and v.stride(1) == d
    jit(_store_kv_kernel)[(t,)](
        k, v, kv_layer, slot_mapping, k.stride(0), v.stride(0), s_block, s_kv, s_tok, s_head,
        BLOCK_SIZE=kv_layer.shape[2], KVH=kvh, D=d, BLOCK_HD=_pow2(kvh * d),
    )


MAX_DECODE_SPLITS = 64


def decode_splits(num_rows: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Splits per (row, KV head): enough programs to fill the GPU twice, none shorter than 64 keys."""
    want = -(-2 * num_sms // max(num_rows * num_kv_heads, 1))
    return max(1, min(want, MAX_DECODE_SPLITS, -(-max_context // 64)))


def prefill_splits(num_tiles: int, num_heads: int, max_context: int, num_sms: int, min_keys: int,
                   min_splits: int = 1) -> int:
    """Splits of each prefill tile's cached prefix: enough programs to fill the GPU twice, none
    with fewer than ``min_keys`` keys, and no split at all where fewer than ``min_splits`` would
    do (1: no split)."""
    want = -(-2 * num_sms // max(num_tiles * num_heads, 1))
    splits = max(1, min(want, MAX_DECODE_SPLITS, max_context // max(min_keys, 1)))
    return splits if splits >= min_splits else 1


PREFILL_SPLITS = os.environ.get("COSERVE_PREFILL_SPLITS", "1") == "1"
"""A step whose prefill rows all take the paged ``prefill`` kernel cuts their cached prefixes
into splits where its tiles would not fill the GPU (:func:`prefill_splits`; module docstring;
``0`` turns it off). A 26-token chunk over a 4,070-token cached prefix beside 13 decodes has one
tile per head, 32 programs on 132 SMs, each reading the whole prefix alone (in session 26's
latency run on the H200, ``bench/results/latency_h200/session26/coserve_latency_share50_d67b6ee``'s
step table, the 22 steps with one chunk of at most 64 tokens over 4,000 or more cached took a
median of 15.9 ms; decode-only steps of 10-20 decodes, 9.1 ms). On the H100 (``bench/prefill_context.py``,
one layer of the 8B shape beside 16 decodes, ``bench/results/engine_h100/session28/prefill_context_3cba91e.json``)
chunks of 8-128 tokens over 4,096 and 8,192 cached took 0.51-0.86x the unsplit kernel's time in
5-9 splits, but 1.17-1.27x over 1,024 cached (4 splits of 256 keys) and for 512-token chunks (2
splits): on by default since session 28 with the split at least :attr:`AttentionTuning.prefill_split_min_keys`
keys (640) and at least :attr:`AttentionTuning.prefill_split_min_splits` (4) of them, which
splits exactly the cases that ran faster there."""


PREFILL_SPLIT_TILES = os.environ.get("COSERVE_PREFILL_SPLIT_TILES", "context")
"""Which tiles :func:`prefill_splits` counts when it sizes a step's splits
(``COSERVE_PREFILL_SPLIT_TILES``). ``all`` (the rule of sessions 28-34): every tile of the paged
kernel, and no split in a step that also has rows through flash or SDPA. A short chunk over a long
prefix beside a fresh chunk then went unsplit (``[16 over 4,073] + [400 fresh]``: 1 + 7 tiles x 32
heads fill the GPU by count), and its 32 programs that read the prefix alone held the kernel while
the fresh tiles' finished early: in the six H100 latency runs of sessions 33-34
(``bench/prefill_compositions.py``, ``bench/results/latency_h100/session35/prefill_compositions.json``,
the device's predictions), prefill steps of a chunk of at most 64 tokens over cached context beside
fresh ones, at most 512 tokens in all, ran a median 1.08-1.11x their prediction, 25-70% of them
over 10% off (18-34 steps a run), against 0.98-1.01x for steps of fresh or of context chunks
alone; the prefill p99 without them was 0.3-1.1 points lower. Over 512 tokens (the fresh rows
through flash, the short chunk unsplit) 1.04-1.05x. ``context`` (the default since session 35):
only the tiles of rows with a cached prefix, which are the long ones; a fresh row's tile does
its work in split 0, its other splits store nothing, and the merge covers only the paged kernel's
tokens, so that a step with flash or SDPA rows splits too. On the H100 in session 35 (``bench/prefill_context.py --fresh``,
``bench/results/latency_h100/session35/prefill_fresh_73d0818.json``, one layer of the 8B shape) a
chunk of 8-64 tokens beside a fresh one ran 0.86-0.94x the old rule's time over 4,096 cached with
400 fresh tokens, 0.61-0.64x over 8,192, 0.52-0.70x beside 1,024 fresh tokens (through flash),
and the same over 2,048 (no split); in that session's latency runs the prefill p99 was 8.7 / 8.1%
against 9.9% with ``all`` on the same host."""
if PREFILL_SPLIT_TILES not in ("context", "all"):
    raise ValueError(f"COSERVE_PREFILL_SPLIT_TILES must be 'context' or 'all', got {PREFILL_SPLIT_TILES!r}")


VARLEN_PREFILL = os.environ.get("COSERVE_VARLEN_PREFILL", "1") == "1"
"""The engine's rows without a cached prefix (new prompts, fine-tuning rows) through one varlen
flash call per run of such rows (:meth:`coserve.layers.attention.AttentionMetadata.plain_prefill_runs`)
instead of one SDPA call per row (session 9: a fitted 5 ms per inference chunk and 10 ms per FT
row of eager step time on the H200, per-row host work). On by default since session 10: eager
4-row prefills with 4 adapters at 512/1,024/2,048 tokens took 29.2/30.2/54.2 ms against 40.9/41.9/57.8
without it (``bench/results/engine_h200/session10/engine_lora_mid_varlen_*``); ``0`` turns it off."""


PAGED_SMALL_PREFILL = int(os.environ.get("COSERVE_PAGED_SMALL_PREFILL", "512"))
"""A step whose prefill rows hold at most this many tokens in all runs every one of them through
the ``prefill`` kernel (one launch a layer), rows without cached context too (0: never). On the
H200 (8B shape, piecewise graphs, ``bench/eager_cpu.py``, ``bench/results/engine_h200/session16/``)
a 96-token fresh chunk beside 32 decodes took 16.5 ms of host time to queue against 7.7 ms for the
same chunk over cached context: the varlen flash call and its slices and copies cost ~0.27 ms of
host time a layer, and such a step is bound by its host. At these sizes the attention itself is
tens of microseconds a layer either way."""

@dataclass(frozen=True)
class AttentionTuning:
    """Tile shapes and launch settings (chosen on the H200 by ``bench/engine_speed.py``)."""

    prefill_block_m: int = 64
    prefill_block_n: int = 64
    prefill_warps: int = 4
    prefill_stages: int = 2
    decode_block_n: int = 64
    decode_warps: int = 4
    decode_stages: int = 2
    prefill_sdpa: bool = True  # rows without a cached prefix through torch SDPA (flash)
    # ... and, on CUDA, each run of consecutive such rows in one varlen flash call instead of one
    # SDPA call (and a K/V head repeat) per row and layer (COSERVE_VARLEN_PREFILL)
    prefill_varlen: bool = field(default_factory=lambda: VARLEN_PREFILL)
    # steps of at most this many prefill tokens: every prefill row through the paged kernel
    # (PAGED_SMALL_PREFILL; 0: never)
    prefill_paged_tokens: int = field(default_factory=lambda: PAGED_SMALL_PREFILL)
    # split a paged-only step's cached prefixes where its tiles leave the GPU idle (PREFILL_SPLITS),
    # each split at least this many keys, and only into this many splits or more
    prefill_splits: bool = field(default_factory=lambda: PREFILL_SPLITS)
    prefill_split_min_keys: int = 640
    prefill_split_min_splits: int = 4
    # which tiles the split count fills the GPU with (PREFILL_SPLIT_TILES): "context", those of
    # rows with a cached prefix; "all", every tile (and no split beside flash or SDPA rows)
    prefill_split_tiles: str = field(default_factory=lambda: PREFILL_SPLIT_TILES)

    def __post_init__(self) -> None:
        if self.prefill_split_tiles not in ("context", "all"):
            raise ValueError(f"AttentionTuning.prefill_split_tiles must be 'context' or 'all', "
                             f"got {self.prefill_split_tiles!r}")


class _PrefillPlan(NamedTuple):
    """One step's prefill rows by path (:meth:`TritonAttention._prefill_plan`): the varlen runs,
    the token spans ``[a, b)`` of rows through one SDPA call each, and the paged kernel's tiles
    (``[3, num_tiles]`` int32: row, first query of the tile, the row's first token's row in the
    split workspace, which holds the kernel's tokens in order; None: no such row), with the splits of
    each tile's cached prefix (:func:`prefill_splits`) and, where there are several, the fp32
    partials and log-sum-exps the kernel writes and ``merge`` reads, shared by the step's layers."""

    runs: list[PlainRun]
    sdpa_rows: list[tuple[int, int]]
    tiles: torch.Tensor | None
    splits: int = 1
    partial: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    merge_tokens: torch.Tensor | None = None  # (split, beside flash or SDPA rows: the tiles' tokens)


class TritonAttention:
    """Paged attention in Triton; decode launches are CUDA-graph capturable (see module doc)."""

    cuda_graph_capable = True

    def __init__(self, tuning: AttentionTuning | None = None, sms: int | None = None) -> None:
        if not HAS_TRITON:
            raise RuntimeError("attention backend 'triton' needs the triton package (pip install triton)")
        self.tuning = tuning or AttentionTuning()
        self.sms = sms  # overrides the device's multiprocessor count in decode_splits (tests)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor | None,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        *,
        out: torch.Tensor | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        if not triton_usable(q.device):
            raise RuntimeError(
                f"attention backend 'triton' cannot run on {q.device}: it needs a CUDA device "
                "(or TRITON_INTERPRET=1 on CPU); use attention_backend='torch'"
            )
        if kv_layer is None:
            # NOTE: no cache (trainer recompute): a dummy one-block cache keeps one code path;
            # such rows have ctx == 0 and slot -1, so it is never read or written.
            kv_layer = q.new_zeros(1, 2, 1, k.shape[1], k.shape[2])
        if not kv_stored:
            store_kv(k, v, kv_layer, meta.slot_mapping)
        out = torch.empty_like(q) if out is None else out
        window = sliding_window or 0
        if meta.num_prefill_rows:
            self._prefill(q, k, v, out, kv_layer, meta, scale, window)
        if meta.num_decode_rows:
            self._decode(q, k, v, out, kv_layer, meta, scale, window)
        return out

    def store(self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        store_kv(k, v, kv_layer, slot_mapping)

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float, window: int,
    ) -> None:
        tune = self.tuning
        plan = self._prefill_plan(q, meta, window)
        for run in plan.runs:
            a, b = run.start, run.end
            out[a:b] = varlen_forward(q[a:b], k[a:b], v[a:b], run.cu_seqlens, run.max_len, scale)
        for a, b in plan.sdpa_rows:
            _sdpa_causal(q[a:b], k[a:b], v[a:b], out[a:b], scale)
        if plan.tiles is None:
            return
        heads, d = q.shape[1], q.shape[2]
        group = heads // k.shape[1]
        s_block, s_kv, s_tok, s_head, _ = kv_layer.stride()
        num_tiles, splits = plan.tiles.shape[1], plan.splits
        # (unsplit, the kernel never reads its partials' pointers: out stands in)
        partial = plan.partial if plan.partial is not None else out
        lse = plan.lse if plan.lse is not None else out
        jit(_prefill_kernel)[(num_tiles, heads, splits)](
            q, k, v, out, partial, lse, kv_layer, meta.cu_seqlens_q, meta.context_lens, meta.block_tables,
            plan.tiles[0], plan.tiles[1], plan.tiles[2],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), s_block, s_kv, s_tok, s_head, meta.block_tables.stride(0),
            scale, window, splits,
            GROUP=group, D=d, BLOCK_SIZE=kv_layer.shape[2], BLOCK_M=tune.prefill_block_m,
            BLOCK_N=tune.prefill_block_n, HAS_WINDOW=window > 0, SPLIT=splits > 1, num_warps=tune.prefill_warps,
            num_stages=tune.prefill_stages,
        )
        if splits > 1:
            tokens = plan.merge_tokens
            jit(_merge_kernel)[(meta.num_prefill_tokens if tokens is None else tokens.numel(), heads)](  # (rows)
                partial, lse, out, lse if tokens is None else tokens, out.stride(0), out.stride(1), heads, splits,
                BLOCK_S=MAX_DECODE_SPLITS, D=d, INDEXED=tokens is not None,
            )

    def _prefill_plan(self, q: torch.Tensor, meta: AttentionMetadata, window: int) -> _PrefillPlan:
        """Which prefill rows go to the varlen flash runs, to one SDPA call each, or to the paged
        kernel, and the kernel's tiles on the device: worked out once per step (the first layer)
        and kept in ``meta.prefill_plans``.

        NOTE: the tiles were built and copied at every layer before. From pageable host memory torch
        waits for the stream after such a copy (``coserve.host_copy``), so each layer's attention
        made the host wait for the GPU to finish the graph piece before it, and left the GPU idle
        while the host launched the next. The suspected cause, not yet measured on the GPU, of
        what session 13's latency runs show: a step whose prefill has a row with cached context
        took a fitted 3.6-4.6 ms more than the prefill terms say (``prefill/graph`` steps, a refit
        with that indicator, ``bench/results/latency_h200/README.md``)."""
        tune = self.tuning
        key = (window, tune)  # (q's dtype, device and head size, all varlen_forward_fits reads, are the step's)
        plan = meta.prefill_plans.get(key)
        if plan is not None:
            return cast(_PrefillPlan, plan)
        # (a small step: one paged launch a layer costs less host time than the flash paths)
        paged = meta.num_prefill_tokens <= tune.prefill_paged_tokens
        use_runs = not paged and tune.prefill_sdpa and tune.prefill_varlen and varlen_forward_fits(q)
        runs = meta.plain_prefill_runs(window) if use_runs else []
        in_runs = {r for run in runs for r in range(run.first_row, run.end_row)}
        rows: list[int] = []
        starts: list[int] = []
        bases: list[int] = []  # (each tile's row's first token's row in the split workspace)
        sdpa_rows: list[tuple[int, int]] = []
        tiled: list[tuple[int, int]] = []  # (the tile rows' token spans [a, b), in token order)
        tiled_tokens = 0
        context_tiles = 0  # (tiles of rows that read a cached prefix)
        offset = 0
        for r in range(meta.num_prefill_rows):
            n = meta.q_lens[r]
            if r in in_runs:
                pass  # (a varlen run's)
            elif not paged and tune.prefill_sdpa and meta.is_plain_row(r, window):
                sdpa_rows.append((offset, offset + n))
            else:
                for m0 in range(0, n, tune.prefill_block_m):
                    rows.append(r)
                    starts.append(m0)
                    bases.append(tiled_tokens)
                tiled.append((offset, offset + n))
                tiled_tokens += n
                if meta.context_lens_list[r] > 0:
                    context_tiles += -(-n // tune.prefill_block_m)
            offset += n
        tiles = device_tensor([rows, starts, bases], torch.int32, q.device) if rows else None
        splits, partial, lse, merge_tokens = 1, None, None, None
        allowed = tune.prefill_split_tiles == "context" or not (runs or sdpa_rows)
        if rows and tune.prefill_splits and allowed:
            heads, d = q.shape[1], q.shape[2]
            max_ctx = max(meta.context_lens_list[:meta.num_prefill_rows], default=0)
            counted = context_tiles if tune.prefill_split_tiles == "context" else len(rows)
            splits = prefill_splits(counted, heads, max_ctx, self.sms or num_sms(q.device),
                                    tune.prefill_split_min_keys, tune.prefill_split_min_splits)
            if splits > 1:  # (each layer's kernel and merge run in stream order: one workspace)
                partial = torch.empty(tiled_tokens * heads * splits * d, dtype=torch.float32, device=q.device)
                lse = torch.empty(tiled_tokens * heads * splits, dtype=torch.float32, device=q.device)
                if tiled_tokens < meta.num_prefill_tokens:  # (the merge must leave the others' output)
                    merge_tokens = device_tensor([t for a, b in tiled for t in range(a, b)], torch.int32, q.device)
        plan = meta.prefill_plans[key] = _PrefillPlan(runs, sdpa_rows, tiles, splits, partial, lse, merge_tokens)
        return plan

    def _decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float, window: int,
    ) -> None:
        first_row, first_tok = meta.num_prefill_rows, meta.num_prefill_tokens
        nrows = meta.num_decode_rows
        qd, kd, vd, od = q[first_tok:], k[first_tok:], v[first_tok:], out[first_tok:]
        ctx = meta.context_lens[first_row:]
        tables = meta.block_tables[first_row:]
        heads, d = q.shape[1], q.shape[2]
        kvh = k.shape[1]
        group = heads // kvh
        max_ctx = max(meta.context_lens_list[first_row:], default=0)
        if window:
            max_ctx = min(max_ctx, window)
        splits = decode_splits(nrows, kvh, max_ctx, self.sms or num_sms(q.device))
        partial = torch.empty(nrows * heads * splits * d if splits > 1 else 1, dtype=torch.float32,
                              device=q.device)
        lse = torch.empty(nrows * heads * splits if splits > 1 else 1, dtype=torch.float32, device=q.device)
        s_block, s_kv, s_tok, s_head, _ = kv_layer.stride()
        jit(_decode_kernel)[(nrows, kvh, splits)](
            qd, kd, vd, od, partial, lse, kv_layer, ctx, tables,
            qd.stride(0), qd.stride(1), kd.stride(0), kd.stride(1), vd.stride(0), vd.stride(1),
            od.stride(0), od.stride(1), s_block, s_kv, s_tok, s_head, tables.stride(0),
            scale, window, splits,
            SPLIT=splits > 1, GROUP=group, BLOCK_G=max(16, _pow2(group)), D=d,
            BLOCK_SIZE=kv_layer.shape[2], BLOCK_N=self.tuning.decode_block_n, HAS_WINDOW=window > 0,
            num_warps=self.tuning.decode_warps, num_stages=self.tuning.decode_stages,
        )
        if splits > 1:
            jit(_merge_kernel)[(nrows, heads)](
                partial, lse, od, lse, od.stride(0), od.stride(1), heads, splits,
                # One block for any split count: one compiled merge instead of one per power of two.
                BLOCK_S=MAX_DECODE_SPLITS, D=d, INDEXED=False,
            )

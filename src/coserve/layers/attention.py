"""Paged attention over one flat varlen batch.

A batch is a list of rows; row ``r`` owns the query tokens ``[cu_seqlens_q[r], cu_seqlens_q[r+1])``
of the flat batch, and ``context_lens[r]`` earlier tokens of that row already sit in the paged
KV cache (blocks ``block_tables[r]``). Rows are ordered: prefill rows first (inference prefill
chunks, then fine-tuning rows), decode rows last. A token with ``slot_mapping == -1`` writes no
KV (fine-tuning rows: they attend causally within themselves and leave no trace in the cache).

The KV cache of the whole model is ONE tensor ``[num_blocks, num_layers, 2, block_size, KVH, D]``
so that a block is contiguous across all layers; each layer works on the view ``kv[:, layer]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from coserve.host_copy import device_tensor, padded_rows
from coserve.layers.sdpa import sdpa, sdpa_calls
from coserve.layers.triton_attention import TritonAttention
from coserve.layers.varlen_attention import varlen_fits, varlen_rows


class PlainRun(NamedTuple):
    """Prefill rows ``[first_row, end_row)``, tokens ``[start, end)``, none with cached context:
    ``cu_seqlens`` their starts relative to ``start`` (``[rows + 1]`` int32 on the device),
    ``max_len`` the longest."""

    first_row: int
    end_row: int
    start: int
    end: int
    cu_seqlens: torch.Tensor
    max_len: int


@dataclass
class AttentionMetadata:
    """Layout of one step's flat batch (see module docstring). Device tensors plus host copies."""

    cu_seqlens_q: torch.Tensor  # [R+1] int32
    context_lens: torch.Tensor  # [R] int32
    block_tables: torch.Tensor  # [R, max_blocks] int32, -1 padded
    slot_mapping: torch.Tensor  # [T] int64, -1 = no KV write
    num_prefill_rows: int
    num_prefill_tokens: int
    q_lens: list[int]
    context_lens_list: list[int]
    block_tables_list: list[list[int]]
    # Tokens that write KV, as indices into the batch (None: derive from slot_mapping). Built on
    # the host so that writing needs no device-to-host sync.
    write_index: torch.Tensor | None = None
    num_kv_writes: int | None = None
    # plain_prefill_runs' answers by sliding window (worked out once per step, read every layer)
    _runs: dict[int, list[PlainRun]] = field(default_factory=dict, repr=False, compare=False)
    # an attention backend's per-step plan of the prefill rows (its launch tiles on the device),
    # by the settings it depends on: worked out at the step's first layer, read at every other
    # (coserve.layers.triton_attention.TritonAttention._prefill_plan)
    prefill_plans: dict[tuple[Any, ...], Any] = field(default_factory=dict, repr=False, compare=False)

    def is_plain_row(self, r: int, window: int = 0) -> bool:
        """Whether prefill row ``r`` attends to its own tokens alone, causally: no cached
        context, and (with a sliding ``window``) no longer than the window."""
        return self.context_lens_list[r] == 0 and (not window or self.q_lens[r] <= window)

    def plain_prefill_runs(self, window: int = 0) -> list[PlainRun]:
        """The maximal runs of consecutive prefill rows with no cached context (and, with a
        sliding ``window``, no longer than it): new prompts and fine-tuning rows, each run
        causal attention within each of its rows over its own tokens alone, which one varlen
        call computes. Their row starts relative to the run go to the device once per step."""
        runs = self._runs.get(window)
        if runs is not None:
            return runs
        runs = []
        r, device = 0, self.cu_seqlens_q.device
        starts = [0]
        for n in self.q_lens:
            starts.append(starts[-1] + n)
        while r < self.num_prefill_rows:
            end = r
            while end < self.num_prefill_rows and self.is_plain_row(end, window):
                end += 1
            if end == r:
                r += 1
                continue
            cu = [s - starts[r] for s in starts[r : end + 1]]
            runs.append(PlainRun(r, end, starts[r], starts[end], device_tensor(cu, torch.int32, device),
                                 max(self.q_lens[r:end])))
            r = end
        self._runs[window] = runs
        return runs

    @property
    def num_rows(self) -> int:
        return len(self.q_lens)

    @property
    def num_decode_rows(self) -> int:
        return self.num_rows - self.num_prefill_rows

    @classmethod
    def build(
        cls,
        q_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        writes_kv: list[bool],
        num_prefill_rows: int,
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build from per-row host lists. ``writes_kv[r]`` False marks a fine-tuning row."""
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        slots: list[int] = []
        for n, ctx, table, writes in zip(q_lens, context_lens, block_tables, writes_kv, strict=True):
            if not writes:
                slots.extend([-1] * n)
                continue
            pos, end = ctx, ctx + n
            while pos < end:  # (a block's run of slots at a time)
                block, offset = divmod(pos, block_size)
                stop = min(end, pos - offset + block_size)
                first = table[block] * block_size + offset
                slots.extend(range(first, first + stop - pos))
                pos = stop
        width = max((len(t) for t in block_tables), default=0) or 1
        tables = padded_rows(block_tables, width, -1, torch.int32)
        slot_array = np.array(slots, dtype=np.int64)
        writers = np.flatnonzero(slot_array >= 0).astype(np.int64, copy=False)
        return cls(
            cu_seqlens_q=device_tensor(cu, torch.int32, device),
            context_lens=device_tensor(context_lens, torch.int32, device),
            block_tables=device_tensor(tables, torch.int32, device),
            slot_mapping=device_tensor(torch.from_numpy(slot_array), torch.int64, device),
            num_prefill_rows=num_prefill_rows,
            num_prefill_tokens=cu[num_prefill_rows],
            q_lens=list(q_lens),
            context_lens_list=list(context_lens),
            block_tables_list=[list(t) for t in block_tables],
            write_index=device_tensor(torch.from_numpy(writers), torch.int64, device),
            num_kv_writes=int(writers.size),
        )


class AttentionBackend(Protocol):
    """Computes attention for one layer and writes that layer's new KV entries.

    May change: ``kv_layer`` at the positions named by ``meta.slot_mapping`` (and nothing else).
    Must hold: the output of a row depends only on that row's tokens and its cached prefix.

    ``out``: where to write the output (``[T, H, D]``; None: a new tensor). ``kv_stored``: the
    caller has already written this layer's new KV with :meth:`store` (the piecewise prefill
    graphs do it inside a graph segment: one launch fewer per layer from Python).
    """

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        kv_layer: torch.Tensor | None,  # [N, 2, block_size, KVH, D] or None (no cache at all)
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        *,
        out: torch.Tensor | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [T, H, D]
        ...

    def store(self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """``kv_layer[slot // bs, 0|1, slot % bs] = k|v`` for every token whose slot is not -1
        (what :meth:`forward` writes unless ``kv_stored``)."""
        ...


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    write_index: torch.Tensor | None = None,
) -> None:
    """``kv_layer[slot // bs, 0|1, slot % bs] = k|v`` for every token whose slot is not -1.

    ``write_index``: those tokens' indices, when known (saves a device-to-host sync).
    """
    block_size = kv_layer.shape[2]
    keep = write_index if write_index is not None else (slot_mapping >= 0).nonzero().squeeze(1)
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    kv_layer[blocks, 0, offsets] = k[keep].to(kv_layer.dtype)
    kv_layer[blocks, 1, offsets] = v[keep].to(kv_layer.dtype)


class TorchAttention:
    """Reference backend in plain torch, any device: prefill rows one SDPA call each (runs of
    equal-length prefix-free rows batched), all decode rows in one padded call."""

    def store(self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        write_kv(k, v, kv_layer, slot_mapping)

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
        if not kv_stored and kv_layer is not None and meta.slot_mapping.numel() and meta.num_kv_writes != 0:
            write_kv(k, v, kv_layer, meta.slot_mapping, meta.write_index)
        result = self._attend(q, k, v, kv_layer, meta, scale, sliding_window)
        if out is None:
            return result
        out.copy_(result)
        return out

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor | None,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        lens, ctxs = meta.q_lens, meta.context_lens_list
        if kv_layer is None and not any(ctxs) and (sliding_window is None or max(lens) <= sliding_window):
            if len(lens) > 1 and varlen_fits(q):
                return varlen_rows(q, k, v, lens, meta.cu_seqlens_q, scale)
            return _plain_rows(q, k, v, lens, scale, group)
        out = torch.empty_like(q)
        start, r = 0, 0
        while r < len(lens):
            if r == meta.num_prefill_rows and kv_layer is not None:
                # Decode rows (one query each, their new KV already written): one padded call.
                out[start:] = _decode_rows(q[start:], kv_layer, meta, scale, sliding_window, group)
                break
            n, ctx = lens[r], ctxs[r]
            # A row with no cached prefix and no window is plain causal: no mask lets SDPA pick
            # its fused (flash) kernel, which also wants K/V heads repeated rather than enable_gqa.
            # Consecutive plain rows of one length go through one batched call.
            if ctx == 0 and (sliding_window is None or n <= sliding_window):
                end = r + 1
                while end < len(lens) and lens[end] == n and ctxs[end] == 0:
                    end += 1
                rows, span = end - r, (end - r) * n
                qq = q[start : start + span].view(rows, n, *q.shape[1:]).transpose(1, 2)
                kk = _repeat_heads(k[start : start + span], group).view(rows, n, *q.shape[1:]).transpose(1, 2)
                vv = _repeat_heads(v[start : start + span], group).view(rows, n, *q.shape[1:]).transpose(1, 2)
                o = sdpa(qq, kk, vv, is_causal=n > 1, scale=scale)
                out[start : start + span] = o.transpose(1, 2).reshape(span, *q.shape[1:])
                start, r = start + span, end
                continue
            k_row, v_row = k[start : start + n], v[start : start + n]
            if ctx:
                assert kv_layer is not None, "a row with cached context needs the KV cache"
                k_pre, v_pre = gather_prefix(kv_layer, meta.block_tables_list[r], ctx)
                k_row = torch.cat([k_pre.to(k.dtype), k_row])
                v_row = torch.cat([v_pre.to(v.dtype), v_row])
            o = sdpa(
                q[start : start + n].transpose(0, 1),
                _repeat_heads(k_row, group).transpose(0, 1),
                _repeat_heads(v_row, group).transpose(0, 1),
                attn_mask=causal_mask(n, ctx, sliding_window, q.device),
                scale=scale,
            )
            out[start : start + n] = o.transpose(0, 1)
            start, r = start + n, r + 1
        return out


def _plain_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float, group: int
) -> torch.Tensor:
    """Causal attention of rows with no cached prefix (the trainer's recompute): one SDPA call
    per run of equal-length rows, the runs cut with one ``split`` and joined with one ``cat``,
    so that autograd sees two nodes instead of a slice and a slice-assignment per row.

    q: [T, H, D], k, v: [T, KVH, D], ``lens``: row lengths summing to T -> [T, H, D].
    """
    runs: list[tuple[int, int]] = []  # (rows, length)
    for n in lens:
        if runs and runs[-1][1] == n:
            runs[-1] = (runs[-1][0] + 1, n)
        else:
            runs.append((1, n))
    sizes = [rows * n for rows, n in runs]
    heads, dim = q.shape[1:]
    # K/V heads repeated once for every run (one copy and, in the backward, one reduction each,
    # instead of one per run: the trainer's rows come in many lengths)
    k, v = _repeat_heads(k, group), _repeat_heads(v, group)
    outs = []
    # one backend context for all the runs (see sdpa_calls)
    with sdpa_calls() as attend:
        # (one run, rows of one length: no split, whose backward would copy each gradient whole)
        pieces = ([(runs[0], q, k, v)] if len(runs) == 1 else
                  zip(runs, q.split_with_sizes(sizes), k.split_with_sizes(sizes), v.split_with_sizes(sizes), strict=True))
        for (rows, n), qs, ks, vs in pieces:
            qq = qs.view(rows, n, heads, dim).transpose(1, 2)
            kk = ks.view(rows, n, heads, dim).transpose(1, 2)
            vv = vs.view(rows, n, heads, dim).transpose(1, 2)
            o = attend(qq, kk, vv, is_causal=n > 1, scale=scale)
            outs.append(o.transpose(1, 2).reshape(rows * n, heads, dim))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _decode_rows(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    group: int,
) -> torch.Tensor:
    """Attention of the decode rows, batched: row ``i`` (query at position ``c_i``) attends to
    its cached positions ``0..c_i`` (gathered through its block table, padding masked out).

    q: [R, H, D] (the decode rows' queries, in row order) -> [R, H, D].
    """
    r0 = meta.num_prefill_rows
    block_size = kv_layer.shape[2]
    ctx = meta.context_lens[r0:].to(torch.long)  # [R]: the new token's position
    length = max(meta.context_lens_list[r0:]) + 1
    pos = torch.arange(length, device=q.device)
    valid = pos[None, :] <= ctx[:, None]  # [R, L]
    if sliding_window is not None:
        valid &= pos[None, :] > ctx[:, None] - sliding_window
    tables = meta.block_tables[r0:].to(torch.long)
    blocks = tables[:, pos // block_size].clamp_min(0)  # [R, L]; -1 padding only where masked
    k = kv_layer[blocks, 0, pos % block_size].to(q.dtype)  # [R, L, KVH, D]
    v = kv_layer[blocks, 1, pos % block_size].to(q.dtype)
    rows, heads, dim = q.shape
    qq = q.view(rows, 1, heads, dim).transpose(1, 2)  # [R, H, 1, D]
    kk = k.repeat_interleave(group, dim=2).transpose(1, 2) if group > 1 else k.transpose(1, 2)
    vv = v.repeat_interleave(group, dim=2).transpose(1, 2) if group > 1 else v.transpose(1, 2)
    o = sdpa(qq, kk, vv, attn_mask=valid[:, None, None, :], scale=scale)
    return o.transpose(1, 2).reshape(rows, heads, dim)


def _repeat_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[T, KVH, D] -> [T, KVH·group, D]``: query head ``h`` reads KV head ``h // group``."""
    return x.repeat_interleave(group, dim=1) if group > 1 else x


def gather_prefix(kv_layer: torch.Tensor, table: list[int], ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``ctx`` cached K and V of a row: ([ctx, KVH, D], [ctx, KVH, D])."""
    block_size = kv_layer.shape[2]
    nblocks = -(-ctx // block_size)
    idx = torch.tensor(table[:nblocks], dtype=torch.long, device=kv_layer.device)
    blocks = kv_layer[idx]  # [nb, 2, bs, KVH, D]
    kvh, d = blocks.shape[-2:]
    k = blocks[:, 0].reshape(-1, kvh, d)[:ctx]
    v = blocks[:, 1].reshape(-1, kvh, d)[:ctx]
    return k, v


def causal_mask(n: int, ctx: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """Boolean [n, ctx + n]: query i (position ctx+i) sees key j iff j <= ctx+i (and within the window)."""
    qpos = torch.arange(ctx, ctx + n, device=device)[:, None]
    kpos = torch.arange(ctx + n, device=device)[None, :]
    mask = kpos <= qpos
    if sliding_window is not None:
        mask &= kpos > qpos - sliding_window
    return mask


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttention, "triton": TritonAttention}


def get_attention_backend(name: str) -> AttentionBackend:
    try:
        return ATTENTION_BACKENDS[name]()
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join(sorted(ATTENTION_BACKENDS))}"
        ) from None

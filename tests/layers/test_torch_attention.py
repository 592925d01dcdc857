"""The torch reference attention: batched plain rows equal the row-by-row masked computation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from coserve.layers.attention import AttentionMetadata, TorchAttention, causal_mask


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float) -> torch.Tensor:
    out, start = [], 0
    for n in lens:
        o = F.scaled_dot_product_attention(
            q[start : start + n].transpose(0, 1), k[start : start + n].transpose(0, 1),
            v[start : start + n].transpose(0, 1), attn_mask=causal_mask(n, 0, None, q.device),
            scale=scale, enable_gqa=True)
        out.append(o.transpose(0, 1))
        start += n
    return torch.cat(out)


def test_runs_of_equal_length_rows_match_row_by_row() -> None:
    torch.manual_seed(0)
    lens = [5, 5, 5, 3, 7, 7, 1, 1]
    t = sum(lens)
    q, k, v = torch.randn(t, 8, 16), torch.randn(t, 2, 16), torch.randn(t, 2, 16)
    meta = AttentionMetadata.build(lens, [0] * len(lens), [[] for _ in lens], [False] * len(lens), len(lens), 16)
    out = TorchAttention().forward(q, k, v, None, meta, 0.25, None)
    torch.testing.assert_close(out, reference(q, k, v, lens, 0.25), rtol=1e-5, atol=1e-6)


def test_batched_decode_rows_match_row_by_row() -> None:
    from coserve.layers.attention import write_kv

    torch.manual_seed(1)
    bs, blocks, kvh, h, d = 4, 32, 2, 8, 16
    kv = torch.randn(blocks, 2, bs, kvh, d)  # one layer's view
    ctxs = [0, 5, 11, 3]  # cached tokens before this step
    tables = [[3], [7, 1], [2, 9, 4, 12], [20]]
    meta = AttentionMetadata.build([1] * 4, ctxs, tables, [True] * 4, 0, bs)
    q, k, v = torch.randn(4, h, d), torch.randn(4, kvh, d), torch.randn(4, kvh, d)
    for window in (None, 4):
        cache = kv.clone()
        out = TorchAttention().forward(q, k, v, cache, meta, 0.3, window)
        expected = kv.clone()
        write_kv(k, v, expected, meta.slot_mapping)
        for r, (ctx, table) in enumerate(zip(ctxs, tables, strict=True)):
            keys = torch.cat([expected[b, 0] for b in table])[: ctx + 1]
            vals = torch.cat([expected[b, 1] for b in table])[: ctx + 1]
            mask = causal_mask(1, ctx, window, q.device)
            ref = F.scaled_dot_product_attention(q[r : r + 1].transpose(0, 1), keys.transpose(0, 1),
                                                 vals.transpose(0, 1), attn_mask=mask, scale=0.3,
                                                 enable_gqa=True).transpose(0, 1)
            torch.testing.assert_close(out[r : r + 1], ref, rtol=1e-5, atol=1e-6)


def test_metadata_build_gives_each_token_its_slot_and_pads_the_tables() -> None:
    """Slots a block's run at a time, the tables padded in numpy: the same as the per-token rule
    ``table[pos // bs] * bs + pos % bs`` over rows that start and end inside blocks."""
    import random

    from coserve.layers.attention import AttentionMetadata

    rng = random.Random(0)
    bs = 4
    rows = ((9, 3, True), (5, 0, False), (1, 7, True), (13, 8, True), (1, 0, True))  # (tokens, context, writes)
    lens, ctxs, writes = ([r[i] for r in rows] for i in range(3))
    tables = [rng.sample(range(100), -(-(ctx + n) // bs)) for n, ctx, _ in rows]
    meta = AttentionMetadata.build(lens, ctxs, tables, writes, num_prefill_rows=4, block_size=bs)
    expected = []
    for n, ctx, table, w in zip(lens, ctxs, tables, writes, strict=True):
        expected += [table[p // bs] * bs + p % bs if w else -1 for p in range(ctx, ctx + n)]
    assert meta.slot_mapping.tolist() == expected and meta.slot_mapping.dtype == torch.int64
    assert meta.write_index.tolist() == [i for i, s in enumerate(expected) if s >= 0]
    assert meta.num_kv_writes == sum(s >= 0 for s in expected)
    width = max(len(t) for t in tables)
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.shape == (len(tables), width)
    assert meta.block_tables.tolist() == [t + [-1] * (width - len(t)) for t in tables]
    assert meta.cu_seqlens_q.tolist() == [0, 9, 14, 15, 28, 29] and meta.num_prefill_tokens == 28

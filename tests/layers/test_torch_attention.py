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

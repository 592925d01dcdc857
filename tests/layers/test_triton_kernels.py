"""Triton kernels against the fp32 torch references, on fresh random inputs.

On a GPU they run compiled; without one they run in Triton's interpreter (``TRITON_INTERPRET=1``,
set here before the first launch; the kernels are jitted lazily). bf16 runs on the GPU only: the
interpreter's bf16 matrix product is wrong (it multiplies the raw bits).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import KERNEL_DTYPES, KERNEL_TOL, rel_err, triton_unavailable

CUDA = torch.cuda.is_available()
_SKIP = triton_unavailable()
if _SKIP is not None:
    pytest.skip(_SKIP, allow_module_level=True)

from coserve.layers import triton_attention  # noqa: E402
from coserve.layers.attention import AttentionMetadata, TorchAttention, write_kv  # noqa: E402
from coserve.layers.lora import LoRABatch, lora_segments_ref  # noqa: E402
from coserve.layers.triton_attention import AttentionTuning, TritonAttention, store_kv  # noqa: E402
from coserve.layers.triton_lora import (  # noqa: E402
    LoRALaunch,
    lora_shrink_expand,
    order_by_slot,
    routing_tensor,
    unrouted_order,
)

DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = KERNEL_DTYPES
TOL = KERNEL_TOL


def random_batch(
    rng: random.Random, num_blocks: int, block_size: int, decode_rows: int
) -> tuple[list[int], list[int], list[list[int]], list[bool], int]:
    """Prefill chunks with cached prefixes, fine-tuning rows, then decode rows; tables disjoint."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    q_lens, ctxs, tables, writes = [], [], [], []
    for kind in ["prefill"] * 3 + ["ft"] * 2 + ["decode"] * decode_rows:
        n = 1 if kind == "decode" else rng.randint(1, 40)
        ctx = 0 if kind == "ft" else rng.choice([0, rng.randint(1, 90)])
        nb = 0 if kind == "ft" else -(-(ctx + n) // block_size)
        tables.append([free.pop() for _ in range(nb)])
        q_lens.append(n)
        ctxs.append(ctx)
        writes.append(kind != "ft")
    return q_lens, ctxs, tables, writes, 5


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_exactly_the_slots(dtype: torch.dtype) -> None:
    t, kvh, d, bs = 37, 2, 32, 8
    k = torch.randn(t, kvh, d, dtype=dtype, device=DEVICE)
    v = torch.randn(t, kvh, d, dtype=dtype, device=DEVICE)
    cache = torch.randn(20, 3, 2, bs, kvh, d, dtype=dtype, device=DEVICE)
    slots = torch.randperm(20 * bs, device=DEVICE)[:t]
    slots[::4] = -1
    ref = cache.clone()
    write_kv(k, v, ref[:, 1], slots)
    store_kv(k, v, cache[:, 1], slots)
    assert torch.equal(cache, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("sms", [1, 64])  # 64 forces split-K decode with merged partials
@pytest.mark.parametrize("heads", [(4, 2, 16), (8, 2, 64)])
# fresh rows: Triton kernel, SDPA per row, varlen runs; "small": varlen runs, but the step is small
# enough that every prefill row takes the paged kernel (PAGED_SMALL_PREFILL)
@pytest.mark.parametrize("sdpa", [False, True, "varlen", "small"])
def test_attention_matches_reference(
    dtype: torch.dtype, window: int | None, sms: int, heads: tuple[int, int, int], sdpa: bool | str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h, kvh, d = heads
    bs, layers, nblocks = 4, 2, 160
    rng = random.Random(hash((str(dtype), window, sms, heads)))
    q_lens, ctxs, tables, writes, npre = random_batch(rng, nblocks, bs, decode_rows=4)
    meta = AttentionMetadata.build(q_lens, ctxs, tables, writes, npre, bs, device=DEVICE)
    t = sum(q_lens)
    q = torch.randn(t, h, d, dtype=dtype, device=DEVICE)
    qkv = torch.randn(t, 2, kvh, d, dtype=dtype, device=DEVICE)
    k, v = qkv[:, 0], qkv[:, 1]  # strided like the model's split of its fused projection
    cache = torch.randn(nblocks, layers, 2, bs, kvh, d, dtype=dtype, device=DEVICE)
    ref_cache = cache.to(torch.float32, copy=True)
    scale = d**-0.5

    ref = TorchAttention().forward(q.float(), k.float(), v.float(), ref_cache[:, 1], meta, scale, window)
    calls: list[int] = []
    if sdpa in ("varlen", "small") and not CUDA:  # the varlen flash calls, stood in for by SDPA per row
        monkeypatch.setattr(triton_attention, "varlen_forward_fits", lambda q: True)
        monkeypatch.setattr(triton_attention, "varlen_forward", counted_varlen_reference(calls))
    tuning = AttentionTuning(prefill_sdpa=bool(sdpa), prefill_varlen=sdpa in ("varlen", "small"),
                             prefill_paged_tokens=10**6 if sdpa == "small" else 0)
    out = TritonAttention(tuning, sms=sms).forward(q, k, v, cache[:, 1], meta, scale, window)
    if sdpa == "small":  # (no flash call may happen)
        assert calls == []
    if sdpa == "varlen" and not CUDA:  # one call per run of rows without cached context (the FT
        # rows at least), every such row in one
        runs = meta.plain_prefill_runs(window or 0)
        assert len(runs) == len(calls) and (calls or window)
        assert calls == [r.end_row - r.first_row for r in runs]
        assert sum(calls) == sum(1 for r in range(npre) if ctxs[r] == 0 and (not window or q_lens[r] <= window))

    assert rel_err(out, ref) < TOL[dtype]
    assert torch.equal(cache.float(), ref_cache)  # same KV written, nothing else touched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("heads", [(4, 2, 16), (8, 2, 64)])
# False, "small": every prefill row through the paged kernel; True: the rows without cached context
# through SDPA, the others split beside them (PREFILL_SPLIT_TILES "context": the merge takes the
# paged kernel's tokens only)
@pytest.mark.parametrize("sdpa", [False, "small", True])
def test_prefill_with_split_prefixes_matches_reference(
    dtype: torch.dtype, window: int | None, heads: tuple[int, int, int], sdpa: bool | str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """COSERVE_PREFILL_SPLITS: each tile's cached prefix cut into splits (8 keys at least here, so
    that the test's short prefixes split), the row's own tokens in split 0, merged per token."""
    h, kvh, d = heads
    bs, layers, nblocks = 4, 2, 160
    rng = random.Random(f"{dtype} {window} {heads} split")
    q_lens, ctxs, tables, writes, npre = random_batch(rng, nblocks, bs, decode_rows=3)
    while max(ctxs[:npre]) < 16:  # (a prefix long enough to split)
        q_lens, ctxs, tables, writes, npre = random_batch(rng, nblocks, bs, decode_rows=3)
    meta = AttentionMetadata.build(q_lens, ctxs, tables, writes, npre, bs, device=DEVICE)
    t = sum(q_lens)
    q = torch.randn(t, h, d, dtype=dtype, device=DEVICE)
    qkv = torch.randn(t, 2, kvh, d, dtype=dtype, device=DEVICE)
    k, v = qkv[:, 0], qkv[:, 1]
    cache = torch.randn(nblocks, layers, 2, bs, kvh, d, dtype=dtype, device=DEVICE)
    ref_cache = cache.to(torch.float32, copy=True)
    scale = d**-0.5
    ref = TorchAttention().forward(q.float(), k.float(), v.float(), ref_cache[:, 1], meta, scale, window)
    chosen: list[int] = []
    real = triton_attention.prefill_splits
    monkeypatch.setattr(triton_attention, "prefill_splits", lambda *a: chosen.append(real(*a)) or chosen[-1])
    tuning = AttentionTuning(prefill_sdpa=bool(sdpa), prefill_varlen=sdpa == "small",
                             prefill_paged_tokens=10**6 if sdpa == "small" else 0,
                             prefill_splits=True, prefill_split_min_keys=8, prefill_split_min_splits=2,
                             prefill_split_tiles="context")
    out = TritonAttention(tuning, sms=64).forward(q, k, v, cache[:, 1], meta, scale, window)
    assert chosen and chosen[0] > 1  # (the prefixes were split)
    if sdpa is True:
        assert any(ctxs[r] == 0 for r in range(npre)), "no SDPA row: nothing tested beside the split"
    assert rel_err(out, ref) < TOL[dtype]
    assert torch.equal(cache.float(), ref_cache)
    # another layer of the same step: the step's plan (splits, workspace) is reused, decided once
    ref0 = TorchAttention().forward(q.float(), k.float(), v.float(), ref_cache[:, 0], meta, scale, window)
    out0 = TritonAttention(tuning, sms=64).forward(q, k, v, cache[:, 0], meta, scale, window)
    assert len(chosen) == 1 and rel_err(out0, ref0) < TOL[dtype]


# (a short chunk first; a 70-token one after the fresh chunk: two tiles, whose second starts at
# query 64, and the kernel's tokens from 250 on, rows 0-69 of the split workspace)
LAYOUTS = {"short first": ([3, 250, 1, 1], [200, 0, 30, 45], 5), "long after": ([250, 70, 1, 1], [0, 200, 30, 45], 3)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("beside", ["paged", "sdpa"])
@pytest.mark.parametrize("rule", ["context", "all"])
def test_a_short_chunk_over_a_long_prefix_splits_beside_a_fresh_chunk(
    rule: str, beside: str, layout: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PREFILL_SPLIT_TILES: a chunk over 200 cached tokens beside a fresh 250-token chunk. Counting
    every tile (``all``), the fresh chunk's 4 tiles too fill the 10 SMs twice: one split, and the
    prefix's programs read it alone; counting the context tiles (``context``), their programs want
    5 splits (3 tokens, 1 tile) or 3 (70 tokens, 2 tiles), also where the fresh chunk goes through
    SDPA (``all`` never splits there). Either way the output is the reference's, the fresh
    chunk's included."""
    h, kvh, d, bs, nblocks = 4, 2, 16, 4, 200
    q_lens, ctxs, want_splits = LAYOUTS[layout]
    rng = random.Random(f"{rule} {beside} {layout}")
    free = list(range(nblocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + n) // bs))] for n, c in zip(q_lens, ctxs, strict=True)]
    meta = AttentionMetadata.build(q_lens, ctxs, tables, [True] * 4, 2, bs, device=DEVICE)
    t = sum(q_lens)
    q = torch.randn(t, h, d, device=DEVICE)
    k, v = torch.randn(t, kvh, d, device=DEVICE), torch.randn(t, kvh, d, device=DEVICE)
    cache = torch.randn(nblocks, 2, bs, kvh, d, device=DEVICE)
    ref = TorchAttention().forward(q, k, v, cache.clone(), meta, d**-0.5, None)
    chosen: list[int] = []
    real = triton_attention.prefill_splits
    monkeypatch.setattr(triton_attention, "prefill_splits", lambda *a: chosen.append(real(*a)) or chosen[-1])
    tuning = AttentionTuning(prefill_sdpa=beside == "sdpa", prefill_varlen=False,
                             prefill_paged_tokens=10**6 if beside == "paged" else 0, prefill_splits=True,
                             prefill_split_min_keys=8, prefill_split_min_splits=2, prefill_split_tiles=rule)
    out = TritonAttention(tuning, sms=10).forward(q, k, v, cache, meta, d**-0.5, None)
    assert rel_err(out, ref) < TOL[torch.float32]
    assert chosen == ([want_splits] if rule == "context" else [1] if beside == "paged" else [])
    (plan,) = meta.prefill_plans.values()
    # (beside SDPA the merge takes the paged kernel's tokens alone, and the workspace holds them alone)
    assert (plan.merge_tokens is not None) == (rule == "context" and beside == "sdpa")
    if plan.merge_tokens is not None:
        context_row = ctxs.index(200)
        first = sum(q_lens[:context_row])
        assert plan.merge_tokens.tolist() == list(range(first, first + q_lens[context_row]))
        assert plan.lse is not None and plan.lse.numel() == q_lens[context_row] * h * want_splits


def test_a_bad_split_rule_is_refused() -> None:
    with pytest.raises(ValueError, match="prefill_split_tiles"):
        AttentionTuning(prefill_split_tiles="longest")


def test_prefill_splits_fill_the_gpu_twice_and_keep_each_split_long() -> None:
    from coserve.layers.triton_attention import prefill_splits

    # a 26-token chunk over 4,070 cached tokens, 32 heads, 132 SMs: 1 tile x 32 heads
    assert prefill_splits(1, 32, 4070, 132, 256) == 9
    assert prefill_splits(1, 32, 1000, 132, 256) == 3  # (each split 256 keys at least)
    assert prefill_splits(8, 32, 4070, 132, 256) == 2
    assert prefill_splits(9, 32, 4070, 132, 256) == 1  # (the tiles fill the GPU twice already)
    assert prefill_splits(1, 32, 100, 132, 256) == 1


def test_the_default_split_rule_splits_where_the_h100_ran_faster() -> None:
    """bench/results/engine_h100/session28/prefill_context_3cba91e.json, one layer of the 8B shape
    (32 heads, 64-token tiles, 132 SMs): faster split for 8-128-token chunks over 4,096 and 8,192
    cached, slower over 1,024 cached and for 512-token chunks."""
    from coserve.layers.triton_attention import AttentionTuning, prefill_splits

    tune = AttentionTuning()
    assert tune.prefill_splits  # (on by default, COSERVE_PREFILL_SPLITS unset)

    def chosen(chunk: int, context: int) -> int:
        return prefill_splits(-(-chunk // tune.prefill_block_m), 32, context, 132, tune.prefill_split_min_keys,
                              tune.prefill_split_min_splits)

    for context in (4096, 8192):
        assert [chosen(c, context) for c in (8, 26, 64)] == [chosen(8, context)] * 3 and chosen(8, context) >= 5
        assert chosen(128, context) == 5
        assert chosen(512, context) == 1
    assert all(chosen(c, 1024) == 1 for c in (8, 26, 64, 128, 512))


def test_the_prefill_plan_is_worked_out_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer of a step attends with the same metadata: the prefill rows' paths and the
    paged kernel's tiles are worked out and copied to the device at the first layer only (a copy
    at every layer made the host wait for the GPU at every layer), and each layer's output is the
    one a fresh plan gives."""
    h, kvh, d, bs, nblocks = 4, 2, 16, 4, 160
    rng = random.Random(5)
    q_lens, ctxs, tables, writes, npre = random_batch(rng, nblocks, bs, decode_rows=2)
    assert any(ctxs[r] > 0 for r in range(npre)), "no prefill row with cached context: nothing tested"
    meta = AttentionMetadata.build(q_lens, ctxs, tables, writes, npre, bs, device=DEVICE)
    t = sum(q_lens)
    cache = torch.randn(nblocks, 2, 2, bs, kvh, d, device=DEVICE)
    copies: list[list[list[int]]] = []
    real = triton_attention.device_tensor

    def counted(values, dtype, device):  # type: ignore[no-untyped-def]
        copies.append(values)
        return real(values, dtype, device)

    monkeypatch.setattr(triton_attention, "device_tensor", counted)
    backend = TritonAttention(AttentionTuning(prefill_sdpa=True, prefill_varlen=False, prefill_paged_tokens=0),
                              sms=1)
    outs = []
    for layer in range(3):
        q, k, v = (torch.randn(t, n, d, device=DEVICE) for n in (h, kvh, kvh))
        outs.append(backend.forward(q, k, v, cache[:, layer % 2], meta, d**-0.5, None))
        fresh = AttentionMetadata.build(q_lens, ctxs, tables, writes, npre, bs, device=DEVICE)
        assert torch.equal(outs[-1], backend.forward(q, k, v, cache[:, layer % 2].clone(), fresh, d**-0.5, None))
    assert len(copies) == 1 + 3  # this step's plan once, and each fresh one
    rows, starts, bases = copies[0]
    assert rows == sorted(rows) and {ctxs[r] > 0 for r in rows} == {True}  # the rows with context alone
    # (each tile's row's first token's row in the split workspace: the kernel's tokens in order)
    assert bases == [sum(q_lens[x] for x in sorted(set(rows)) if x < r) for r in rows]
    backend.forward(q, k, v, cache[:, 0], meta, d**-0.5, 7)  # another window: a plan of its own
    assert len(copies) == 5


def counted_varlen_reference(calls: list[int]):  # type: ignore[no-untyped-def]
    """``varlen_forward`` by causal SDPA per row of ``cu_seqlens`` (fp32), recording the rows of
    each call."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
               scale: float) -> torch.Tensor:
        bounds = cu.tolist()
        assert bounds[0] == 0 and bounds[-1] == q.shape[0] and max_len == max(
            b - a for a, b in zip(bounds, bounds[1:], strict=False))
        calls.append(len(bounds) - 1)
        group = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        for a, b in zip(bounds, bounds[1:], strict=False):
            qq = q[a:b].float().transpose(0, 1)
            kk = k[a:b].float().repeat_interleave(group, 1).transpose(0, 1)
            vv = v[a:b].float().repeat_interleave(group, 1).transpose(0, 1)
            o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale)
            out[a:b] = o.transpose(0, 1).to(q.dtype)
        return out

    return attend


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [8, 16])
@pytest.mark.parametrize("padded", [False, True])
def test_lora_matches_reference(dtype: torch.dtype, rank: int, padded: bool) -> None:
    rng = random.Random(rank * 2 + padded)
    slots_n, d_in, d_out = 4, 96, 80
    row_lens = [rng.randint(1, 30) for _ in range(9)]
    row_slots = [rng.choice([-1, 0, 1, 3, 3]) for _ in row_lens]
    batch = LoRABatch.from_rows(row_lens, row_slots, DEVICE)
    t = sum(row_lens)
    x = torch.randn(t, d_in, dtype=dtype, device=DEVICE)
    a = torch.randn(slots_n, rank, d_in, dtype=dtype, device=DEVICE) / d_in**0.5
    b = torch.randn(slots_n, d_out, rank, dtype=dtype, device=DEVICE)
    scales = torch.rand(slots_n, device=DEVICE) + 0.5
    y0 = torch.randn(t, d_out + 24, dtype=dtype, device=DEVICE)
    ref = y0.to(torch.float32, copy=True)
    lora_segments_ref(ref[:, 8 : 8 + d_out], x.float(), a.float(), b.float(), scales, batch)

    order = order_by_slot(row_lens, row_slots, 16)
    length = len(order) + (48 if padded else 0)  # a CUDA graph's static order is -1 padded
    order_t = torch.full((length,), -1, dtype=torch.int32)
    order_t[: len(order)] = torch.tensor(order, dtype=torch.int32)
    y = y0.clone()
    launch = LoRALaunch.for_order(length, 16, sms=64 if padded else 1)  # with and without split-K
    lora_shrink_expand(y[:, 8 : 8 + d_out], x, a, b, scales, batch.token_slots, order_t.to(DEVICE), launch)

    cols = slice(8, 8 + d_out)
    assert rel_err(y[:, cols] - y0[:, cols], ref[:, cols] - y0[:, cols].float()) < TOL[dtype]
    assert torch.equal(y[:, :8], y0[:, :8]) and torch.equal(y[:, 8 + d_out :], y0[:, 8 + d_out :])
    untouched = batch.token_slots < 0
    assert torch.equal(y[untouched], y0[untouched])


def test_order_groups_tokens_by_slot_one_slot_per_tile() -> None:
    assert order_by_slot([2, 1, 3, 1], [1, -1, 0, 1], 4) == [3, 4, 5, -1, 0, 1, 6, -1]


def _reference_order(lens: list[int], slots: list[int], block_m: int, routed: bool) -> list[int]:
    """Token by token: those of each slot in turn (ascending; routed False: slot -1's), each
    group padded with -1."""
    token_slots = [s for n, s in zip(lens, slots, strict=True) for _ in range(n)]
    groups = sorted({s for s in token_slots if s >= 0}) if routed else [-1]
    out: list[int] = []
    for g in groups:
        tokens = [t for t, s in enumerate(token_slots) if max(s, -1) == g]
        out += tokens + [-1] * (-len(tokens) % block_m)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_routing_tensor_equals_the_lists(seed: int) -> None:
    """The tensor the eager steps build equals order_by_slot (+ unrouted_order), rows of length 0,
    steps without adapters and without unrouted rows included."""
    rng = random.Random(seed)
    rows = rng.randint(0, 9)
    lens = [rng.choice([0, 1, 3, 16, 40]) for _ in range(rows)]
    slots = [rng.choice([-1, 0, 1, 3]) for _ in range(rows)]
    for block_m in (4, 16):
        order = order_by_slot(lens, slots, block_m)
        assert order == _reference_order(lens, slots, block_m, routed=True)
        assert unrouted_order(lens, slots, block_m) == _reference_order(lens, slots, block_m, routed=False)
        got, routed = routing_tensor(lens, slots, block_m)
        assert got.dtype == torch.int32 and got.tolist() == order and routed == len(order)
        got, routed = routing_tensor(lens, slots, block_m, unrouted=True)
        assert got.tolist() == order + unrouted_order(lens, slots, block_m) and routed == len(order)


def test_split_k_for_large_steps_only_with_waves() -> None:
    # 68 tiles of 64 rows (a 4,096-token prefill over 4 adapters) on 132 SMs: no split without
    # waves; 2 ways with the default 1 wave (68 · 2 = 136 ≥ 132 programs)
    assert LoRALaunch.for_order(68 * 64, 64, sms=132, waves=0).max_split_k == 1
    assert LoRALaunch.for_order(68 * 64, 64, sms=132, waves=1).max_split_k == 2
    # 64 tiles (4 × 1,024 tokens): 4 ways (64 · 2 = 128 < 132)
    assert LoRALaunch.for_order(64 * 64, 64, sms=132, waves=1).max_split_k == 4
    # asked for 2 waves: 68 · 4 = 272 ≥ 264 programs
    assert LoRALaunch.for_order(68 * 64, 64, sms=132, waves=2).max_split_k == 4
    # few tiles split up to 8 as before; waves apply to 64-row tiles only, up to 16 ways
    assert LoRALaunch.for_order(16, 16, sms=132).max_split_k == 8
    assert LoRALaunch.for_order(16, 16, sms=132, waves=4).max_split_k == 8
    assert LoRALaunch.for_order(64, 64, sms=132, waves=4).max_split_k == 16


def test_lora_with_sixteen_way_split_matches_reference() -> None:
    """The largest split (16 partials summed by the expand) over a 4,096-wide input."""
    dtype = torch.float32
    rng = random.Random(7)
    slots_n, d_in, d_out, rank = 2, 4096, 64, 16
    row_lens, row_slots = [3, 5], [0, 1]
    batch = LoRABatch.from_rows(row_lens, row_slots, DEVICE)
    t = sum(row_lens)
    gen = torch.Generator().manual_seed(rng.randint(0, 1 << 30))
    x = torch.randn(t, d_in, generator=gen).to(DEVICE, dtype)
    a = (torch.randn(slots_n, rank, d_in, generator=gen) / d_in**0.5).to(DEVICE, dtype)
    b = torch.randn(slots_n, d_out, rank, generator=gen).to(DEVICE, dtype)
    scales = torch.ones(slots_n, device=DEVICE)
    ref = torch.zeros(t, d_out)
    lora_segments_ref(ref, x.float().cpu(), a.float().cpu(), b.float().cpu(), scales.cpu(),
                      LoRABatch.from_rows(row_lens, row_slots, torch.device("cpu")))
    order = torch.tensor(order_by_slot(row_lens, row_slots, 16), dtype=torch.int32, device=DEVICE)
    launch = LoRALaunch(16, 2, 16)  # what for_order gives 64-row tiles with waves (above), on 16-row tiles
    assert -(-len(order) // 16) == launch.num_tiles
    y = torch.zeros(t, d_out, dtype=dtype, device=DEVICE)
    lora_shrink_expand(y, x, a, b, scales, batch.token_slots, order, launch)
    assert rel_err(y.cpu(), ref) < TOL[dtype]


def test_plain_prefill_runs_are_the_maximal_runs_of_rows_without_context() -> None:
    # rows: chunk over a prefix, two fresh prompts, a chunk over a prefix, two FT rows, a decode
    q_lens, ctxs = [5, 3, 9, 4, 6, 2, 1], [7, 0, 0, 2, 0, 0, 11]
    meta = AttentionMetadata.build(q_lens, ctxs, [[0, 1, 2]] * 4 + [[], []] + [[3, 4, 5]],
                                   [True] * 4 + [False] * 2 + [True], 6, 4)
    runs = meta.plain_prefill_runs()
    assert [(r.first_row, r.end_row, r.start, r.end, r.max_len) for r in runs] == [(1, 3, 5, 17, 9), (4, 6, 21, 29, 6)]
    assert [r.cu_seqlens.tolist() for r in runs] == [[0, 3, 12], [0, 6, 8]]
    assert meta.plain_prefill_runs() is runs, "worked out once per step"
    windowed = meta.plain_prefill_runs(5)  # rows longer than a sliding window are not plain
    assert [(r.first_row, r.end_row) for r in windowed] == [(1, 2), (5, 6)]

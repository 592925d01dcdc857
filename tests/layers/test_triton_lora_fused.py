"""The fused multi-LoRA path: one shrink and one expand launch per :class:`LoRALinear`, for all of
its output slices, against the per-slice launches and the fp32 torch reference.

Runs compiled on a GPU, in Triton's interpreter without one (see ``test_triton_kernels.py``).
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import KERNEL_DTYPES, KERNEL_TOL, rel_err, triton_unavailable

CUDA = torch.cuda.is_available()
_SKIP = triton_unavailable()
if _SKIP is not None:
    pytest.skip(_SKIP, allow_module_level=True)

from coserve import LLM, LoRARequest  # noqa: E402
from coserve.layers import triton_lora  # noqa: E402
from coserve.layers.lora import (  # noqa: E402
    LoRABatch,
    LoRALinear,
    RowDropoutLoRA,
    StackedLoRA,
    lora_segments_ref,
)
from coserve.layers.triton_lora import TritonLoRA, _column_blocks, slice_stacks  # noqa: E402
from tests.conftest import greedy_with_logprobs, make_peft_adapter  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = KERNEL_DTYPES
TOL = KERNEL_TOL
SLOTS, MAX_RANK, D_IN = 4, 16, 96
ADAPTER_RANKS = {0: 8, 1: 16, 3: 8}  # slot 2 holds no adapter (all zero)


class PerTarget:
    """A context with ``apply`` only: LoRALinear's per-slice path (two launches per slice)."""

    def __init__(self, inner: TritonLoRA) -> None:
        self.inner = inner

    def apply(self, layer: int, target: str, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor,
              b: torch.Tensor) -> None:
        self.inner.apply(layer, target, x, y, a, b)


def make_linear(out_slices: dict[str, int], dtype: torch.dtype, seed: int, bias: bool = True,
                d_in: int = D_IN) -> LoRALinear:
    """A fused linear with adapters of mixed ranks written through its per-slice stack views."""
    gen = torch.Generator().manual_seed(seed)
    lin = LoRALinear(0, d_in, out_slices, bias=bias, num_slots=SLOTS, max_rank=MAX_RANK, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) / d_in**0.5)
        if lin.bias is not None:
            lin.bias.copy_(torch.randn(lin.bias.shape, generator=gen))
        for name in out_slices:
            a, b = lin.lora_stacks(name)
            for slot, r in ADAPTER_RANKS.items():
                a[slot, :r].copy_(torch.randn(r, d_in, generator=gen) / d_in**0.5)
                b[slot, :, :r].copy_(torch.randn(b.shape[1], r, generator=gen))
    return lin.to(DEVICE)


def fp32_reference(lin: LoRALinear, x: torch.Tensor, scales: torch.Tensor, batch: LoRABatch,
                   out_slices: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(base, base + LoRA)`` of ``lin`` on ``x`` in fp32 (``F.linear`` and ``lora_segments_ref``)."""
    ref = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
    base = ref.clone()
    for name, off, a, b in slice_stacks(lin.lora_a_all.float(), lin.lora_b_all.float(), out_slices):
        lora_segments_ref(ref[:, off : off + out_slices[name]], x.float(), a, b, scales, batch)
    return base, ref


def make_batch(seed: int) -> tuple[LoRABatch, list[int], list[int]]:
    rng = random.Random(seed)
    row_lens = [rng.randint(1, 20) for _ in range(7)] + [1] * 6  # prefill chunks, then decodes
    row_slots = [rng.choice([-1, 0, 1, 2, 3, 3]) for _ in row_lens]
    row_slots[:3] = [0, -1, 1]  # several adapters and rows without one, always
    return LoRABatch.from_rows(row_lens, row_slots, DEVICE), row_lens, row_slots


SLICES = [
    {"o_proj": 80},  # k = 1
    {"gate_proj": 112, "up_proj": 112},  # the tiny test models' MLP: not a multiple of 64
    {"q_proj": 64, "k_proj": 32, "v_proj": 32},  # the tiny test models' attention
    {"q_proj": 200, "k_proj": 72, "v_proj": 24},  # ragged everywhere
    {"q_proj": 1088, "k_proj": 1040, "v_proj": 1030},  # 128-wide column blocks
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_slices", SLICES, ids=lambda s: "-".join(map(str, s.values())))
@pytest.mark.parametrize("sms", [1, 64])  # 64: split-K partials
def test_fused_equals_per_target_and_reference(
    dtype: torch.dtype, out_slices: dict[str, int], sms: int, launches: Counter[str]
) -> None:
    lin = make_linear(out_slices, dtype, seed=len(out_slices))
    batch, _, _ = make_batch(seed=sum(out_slices.values()) + sms)
    t = batch.token_slots.shape[0]
    x = torch.randn(t, D_IN, dtype=dtype, device=DEVICE)
    scales = torch.rand(SLOTS, device=DEVICE) + 0.5

    ctx = TritonLoRA.from_batch(batch, scales)
    ctx.launch = triton_lora.LoRALaunch.for_order(ctx.order.shape[0], ctx.launch.block_m, sms)
    with torch.no_grad():
        fused = lin(x, ctx)
        assert launches == {"_shrink_kernel": 1, "_expand_kernel": 1}
        launches.clear()
        per_target = lin(x, PerTarget(ctx))
        assert launches == {"_shrink_kernel": len(out_slices), "_expand_kernel": len(out_slices)}
        base = F.linear(x, lin.weight, lin.bias)
        torch_ctx = lin(x, StackedLoRA(batch, scales))  # the engine's torch backend

    # fp32 reference: the base output plus each slice's segments
    ref = F.linear(x.float(), lin.weight.float(), lin.bias.float())  # type: ignore[union-attr]
    for name, off, a, b in slice_stacks(lin.lora_a_all.float(), lin.lora_b_all.float(), out_slices):
        lora_segments_ref(ref[:, off : off + out_slices[name]], x.float(), a, b, scales, batch)
    delta_ref = ref - base.float()
    assert rel_err(fused.float() - base.float(), delta_ref) < TOL[dtype]
    assert rel_err(per_target.float() - base.float(), delta_ref) < TOL[dtype]
    assert rel_err(fused.float() - base.float(), per_target.float() - base.float()) < TOL[dtype]
    assert rel_err(torch_ctx.float() - base.float(), delta_ref) < TOL[dtype]
    # Tokens without an adapter (slot -1) and those of the empty slot 2 keep the base output.
    untouched = (batch.token_slots < 0) | (batch.token_slots == 2)
    assert untouched.any()
    assert torch.equal(fused[untouched], base[untouched])


def test_fused_padded_graph_order(launches: Counter[str]) -> None:
    """A CUDA graph's static order (-1 padded past the routing, sized by graph_order_length)."""
    out_slices = {"q_proj": 64, "k_proj": 32, "v_proj": 32}
    lin = make_linear(out_slices, torch.float32, seed=5)
    row_slots = [1, 0, -1, 3, 1, 0, 3, 3]
    batch = LoRABatch.from_rows([1] * len(row_slots), row_slots, DEVICE)
    scales = torch.rand(SLOTS, device=DEVICE) + 0.5
    order = triton_lora.order_by_slot([1] * len(row_slots), row_slots, triton_lora.block_m_for(8))
    length = triton_lora.graph_order_length(8, SLOTS)
    order_t = torch.full((length,), -1, dtype=torch.int32)
    order_t[: len(order)] = torch.tensor(order, dtype=torch.int32)
    launch = triton_lora.LoRALaunch.for_order(length, triton_lora.block_m_for(8), 64)
    ctx = TritonLoRA(batch.token_slots, order_t.to(DEVICE), scales, launch)
    x = torch.randn(len(row_slots), D_IN, device=DEVICE)
    with torch.no_grad():
        got = lin(x, ctx)
        expected = lin(x, StackedLoRA(batch, scales))
    assert rel_err(got, expected) < TOL[torch.float32]
    assert sum(launches.values()) == 2


def test_stacks_are_views_of_the_fused_buffers() -> None:
    out_slices = {"q_proj": 64, "k_proj": 32, "v_proj": 48}
    lin = LoRALinear(3, 40, out_slices, bias=False, num_slots=2, max_rank=8, dtype=torch.float32)
    assert lin.lora_a_all.shape == (2, 3 * 8, 40) and lin.lora_b_all.shape == (2, 144, 8)
    for i, name in enumerate(out_slices):
        a, b = lin.lora_stacks(name)
        assert a.shape == (2, 8, 40) and b.shape == (2, out_slices[name], 8)
        a[1, 2].fill_(i + 1)
        b[0, :, 5].fill_(i + 1)
    assert (lin.lora_a_all[1, [2, 10, 18]] == torch.tensor([[1.0], [2.0], [3.0]])).all()
    assert lin.lora_a_all.count_nonzero() == 3 * 40
    assert (lin.lora_b_all[0, :, 5] == torch.tensor([1.0] * 64 + [2.0] * 32 + [3.0] * 48)).all()
    assert lin.lora_b_all.count_nonzero() == 144
    assert {k for k in lin.state_dict() if "lora" in k} == {"lora_a_all", "lora_b_all"}
    double = lin.to(torch.float64)  # the views follow the module's buffers
    assert double.lora_stacks("k_proj")[0].dtype == torch.float64
    assert double.lora_stacks("k_proj")[0].data_ptr() == double.lora_a_all[:, 8:].data_ptr()
    assert not LoRALinear(0, 8, {"o_proj": 8}, False, 0, 8, torch.float32).has_lora


def test_row_dropout_fused_equals_per_target() -> None:
    """RowDropoutLoRA around the Triton context: fused inner launches, same result."""
    out_slices = {"gate_proj": 112, "up_proj": 112}
    lin = make_linear(out_slices, torch.float32, seed=7)
    row_lens, row_slots = [5, 3, 1, 1], [0, -1, -1, 3]  # row 1 fine-tunes slot 1 with dropout
    batch = LoRABatch.from_rows(row_lens, row_slots, DEVICE)
    scales = torch.rand(SLOTS, device=DEVICE) + 0.5
    inner = TritonLoRA.from_batch(batch, scales)
    x = torch.randn(sum(row_lens), D_IN, device=DEVICE)

    def ctx(inner_ctx: Any) -> RowDropoutLoRA:
        return RowDropoutLoRA(inner=inner_ctx, slot=1, rows=[(5, 3, 11)], seed=3, p=0.25, scales=scales)

    with torch.no_grad():
        fused = lin(x, ctx(inner))
        per_target = lin(x, ctx(PerTarget(inner)))
        reference = lin(x, ctx(StackedLoRA(batch, scales)))
    assert rel_err(fused, per_target) < TOL[torch.float32]
    assert rel_err(fused, reference) < TOL[torch.float32]


def _generate(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None]) -> list[tuple[list[int], list[float]]]:
    return greedy_with_logprobs(llm, prompts, loras, 6)


def test_engine_two_launches_per_linear_and_same_tokens(
    hf_models: dict[str, Path], tmp_path: Path, launches: Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three adapters (ranks 8, 16, 4; different targets) and no adapter in one batch: the Triton
    engine's greedy tokens and log-probs equal the torch engine's, with exactly one shrink and one
    expand launch per LoRA linear that an adapter of the step targets (at most 8 per decoder layer;
    the per-slice path took 14)."""
    base = hf_models["llama"]
    adapters = [
        make_peft_adapter(base, tmp_path / "a1", ["q_proj", "v_proj", "down_proj"], rank=8, seed=1),
        make_peft_adapter(base, tmp_path / "a2", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                  "up_proj", "down_proj"], rank=16, seed=2),
        make_peft_adapter(base, tmp_path / "a3", ["k_proj", "gate_proj", "up_proj"], rank=4, seed=3),
    ]
    prompts = [[5, 17, 33, 2, 91, 14, 7], [100, 3, 44, 44, 12, 9, 150, 61], [42], [7, 8, 9]]
    loras = [LoRARequest(f"a{i + 1}", str(p)) for i, p in enumerate(adapters)]
    routing: list[LoRARequest | None] = [loras[0], None, loras[1], loras[2]]
    common: dict = dict(skip_tokenizer_init=True, max_loras=3, max_lora_rank=16, block_size=4,
                        max_model_len=64, num_kv_blocks=64, max_num_batched_tokens=16, enforce_eager=True)
    if CUDA:
        common["device"] = "cuda"
    expected = _generate(LLM(str(base), lora_backend="torch", **common), prompts, routing)
    assert not launches

    linear_calls = Counter[str]()
    forward = LoRALinear.forward

    def counting_forward(self: LoRALinear, x: torch.Tensor, lora: Any = None) -> torch.Tensor:
        if isinstance(lora, TritonLoRA) and lora.order.numel() > 0 and self.lora_live:
            linear_calls["with_lora"] += 1
        if isinstance(lora, TritonLoRA) and not self.lora_live:
            linear_calls["skipped"] += 1
        return forward(self, x, lora)

    monkeypatch.setattr(LoRALinear, "forward", counting_forward)
    llm = LLM(str(base), lora_backend="triton", **common)
    # On CUDA the engine warms up in its constructor (EngineConfig.runs_warmup), adapter steps
    # included: one shrink and one expand per linear there too; then both counters start over.
    warm = linear_calls["with_lora"]
    assert (warm > 0) == llm.engine.config.runs_warmup
    assert launches == ({"_shrink_kernel": warm, "_expand_kernel": warm} if warm else {})
    launches.clear()
    linear_calls.clear()
    got = _generate(llm, prompts, routing)
    assert linear_calls["with_lora"] > 0
    assert launches == {"_shrink_kernel": linear_calls["with_lora"], "_expand_kernel": linear_calls["with_lora"]}
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, expected, strict=True):
        assert tokens == ref_tokens
        assert lps == pytest.approx(ref_lps, abs=2e-2 if CUDA else 1e-4)


def test_fused_slices_can_be_switched_off(launches: Counter[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``COSERVE_FUSED_LORA=0`` (FUSED_SLICES): per-slice launches, the same output."""
    out_slices = {"q_proj": 64, "k_proj": 32, "v_proj": 32}
    lin = make_linear(out_slices, torch.float32, seed=9)
    batch, _, _ = make_batch(seed=9)
    x = torch.randn(batch.token_slots.shape[0], D_IN, device=DEVICE)
    ctx = TritonLoRA.from_batch(batch, torch.ones(SLOTS, device=DEVICE))
    with torch.no_grad():
        fused = lin(x, ctx)
        monkeypatch.setattr(triton_lora, "FUSED_SLICES", False)
        launches.clear()
        per_slice = lin(x, ctx)
    assert launches == {"_shrink_kernel": 3, "_expand_kernel": 3}
    torch.testing.assert_close(per_slice, fused, rtol=1e-5, atol=1e-5)


def _nan_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.empty`` of floats filled with NaN, so that an output row no kernel writes shows."""
    real = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.parametrize("expand_first", [False, True], ids=["old-order", "expand-first"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_slices", SLICES[:4], ids=lambda s: "-".join(map(str, s.values())))
def test_expand_first_equals_reference(
    dtype: torch.dtype, out_slices: dict[str, int], bias: bool, expand_first: bool, launches: Counter[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``COSERVE_LORA_EXPAND_FIRST`` (EXPAND_FIRST) in a step of more than SMALL_STEP_TOKENS tokens:
    the shrink, an expand that stores Δ (+ bias) into an uninitialized output, zeros (+ bias) on
    the rows without adapter, then the base GEMM onto it: the fp32 reference's result, still one
    shrink and one expand launch; off, the old order, bit for bit."""
    monkeypatch.setattr(triton_lora, "EXPAND_FIRST", expand_first)
    lin = make_linear(out_slices, dtype, seed=len(out_slices), bias=bias)
    rng = random.Random(len(out_slices))
    row_lens = [rng.randint(45, 70) for _ in range(6)] + [1] * 8
    row_slots = [0, -1, 1, 3, -1, 2] + [rng.choice([-1, 0, 1, 2, 3]) for _ in range(8)]
    row_slots[-2:] = [-1, 1]
    batch = LoRABatch.from_rows(row_lens, row_slots, DEVICE)
    t = sum(row_lens)
    assert t > triton_lora.SMALL_STEP_TOKENS
    x = torch.randn(t, D_IN, dtype=dtype, device=DEVICE)
    scales = torch.rand(SLOTS, device=DEVICE) + 0.5
    ctx = TritonLoRA.from_batch(batch, scales)
    assert (ctx.store is not None) == expand_first
    if expand_first:
        assert ctx.store is not None and torch.equal(ctx.store.order[: ctx.order.shape[0]], ctx.order)
        _nan_empty(monkeypatch)
    with torch.no_grad():
        got = lin(x, ctx)
        assert launches == {"_shrink_kernel": 1, "_expand_kernel": 1}
        old = F.linear(x, lin.weight, lin.bias)
        ctx.apply_fused(0, x, old, lin.lora_a_all, lin.lora_b_all, out_slices)
    base, ref = fp32_reference(lin, x, scales, batch, out_slices)
    assert rel_err(got.float() - base, ref - base) < TOL[dtype]
    assert rel_err(got.float(), ref) < TOL[dtype]
    # Rows without an adapter (slot -1) and of the empty slot 2: the base output.
    untouched = (batch.token_slots < 0) | (batch.token_slots == 2)
    assert untouched.any() and (batch.token_slots >= 0).any()
    assert rel_err(got[untouched].float(), base[untouched]) < TOL[dtype]
    if not expand_first:
        assert torch.equal(got, old)


def test_expand_first_only_in_large_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of up to SMALL_STEP_TOKENS tokens keep the old order even with the flag; the
    store routing covers every token once: the adapter tiles, then those without adapter."""
    monkeypatch.setattr(triton_lora, "EXPAND_FIRST", True)
    scales = torch.ones(SLOTS, device=DEVICE)
    small = LoRABatch.from_rows([200, 56], [0, -1], DEVICE)
    assert TritonLoRA.from_batch(small, scales).store is None
    large = LoRABatch.from_rows([200, 57, 3], [0, -1, 1], DEVICE)
    ctx = TritonLoRA.from_batch(large, scales)
    assert ctx.store is not None
    order = ctx.store.order.tolist()
    assert len(order) == ctx.store.launch.num_tiles * 64 == (4 + 1 + 1) * 64
    assert sorted(i for i in order if i >= 0) == list(range(260))
    assert order[ctx.order.shape[0] :] == list(range(200, 257)) + [-1] * 7
    assert triton_lora.unrouted_order([3, 2, 4], [-1, 0, -1], 4) == [0, 1, 2, 5, 6, 7, 8, -1]


@pytest.mark.parametrize("tile", [16, 32, 64])
def test_prefill_shrink_tiles_equal_reference(tile: int, launches: Counter[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of 64-row tiles runs its shrink in tiles of ``PREFILL_SHRINK_TILE`` rows
    (``COSERVE_LORA_SHRINK_TILE``), each inside one expand tile, so one slot's tokens: the
    reference's result whatever the tile, still one launch each."""
    monkeypatch.setattr(triton_lora, "PREFILL_SHRINK_TILE", tile)
    out_slices = SLICES[3]
    dtype = DTYPES[0]
    lin = make_linear(out_slices, dtype, seed=7)
    row_lens, row_slots = [70, 41, 66, 90, 33], [0, -1, 3, 1, 3]
    batch = LoRABatch.from_rows(row_lens, row_slots, DEVICE)
    t = sum(row_lens)
    assert t > triton_lora.SMALL_STEP_TOKENS and triton_lora.shrink_block_m(64) == tile
    x = torch.randn(t, D_IN, dtype=dtype, device=DEVICE)
    scales = torch.rand(SLOTS, device=DEVICE) + 0.5
    ctx = TritonLoRA.from_batch(batch, scales)
    assert ctx.launch.block_m == 64
    with torch.no_grad():
        got = lin(x, ctx)
    assert launches == {"_shrink_kernel": 1, "_expand_kernel": 1}
    base, ref = fp32_reference(lin, x, scales, batch, out_slices)
    assert rel_err(got.float() - base, ref - base) < TOL[dtype]


@pytest.mark.parametrize("waves", [0, 1, 2], ids=["block-per-program", "all-blocks", "groups"])
def test_split_partials_and_column_groups(waves: int, launches: Counter[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of 64-row tiles with its shrink split 8 ways (a 512-token step gets up to 8 on a large
    GPU): the expand sums the partials once per program, whether a program walks one column block,
    a group of them, or all (``COSERVE_LORA_EXPAND_WAVES``), the reference's result every way."""
    monkeypatch.setattr(triton_lora, "EXPAND_WAVES", waves)
    monkeypatch.setattr(triton_lora, "num_sms", lambda device: 4)  # the same launch geometry on any device
    out_slices = SLICES[2]
    dtype = DTYPES[0]
    d_in = 1024  # the shrink splits K only into slices of at least 256
    lin = make_linear(out_slices, dtype, seed=11, d_in=d_in)
    row_lens, row_slots = [150, 60, 90], [1, -1, 0]
    batch = LoRABatch.from_rows(row_lens, row_slots, DEVICE)
    x = torch.randn(sum(row_lens), d_in, dtype=dtype, device=DEVICE)
    scales = torch.rand(SLOTS, device=DEVICE) + 0.5
    ctx = TritonLoRA.from_batch(batch, scales)
    ctx.launch = triton_lora.LoRALaunch.for_order(ctx.order.shape[0], 64, sms=1000, waves=0)
    assert ctx.launch.block_m == 64 and ctx.launch.max_split_k == 8
    n_blocks = _column_blocks(list(out_slices.values()))[1]
    per_program = triton_lora.expand_blocks_per_program(ctx.launch.num_tiles, n_blocks, 4)
    assert per_program == {0: 1, 1: n_blocks}.get(waves, per_program)
    assert waves != 2 or 1 < per_program < n_blocks
    with torch.no_grad():
        got = lin(x, ctx)
    assert launches == {"_shrink_kernel": 1, "_expand_kernel": 1}
    base, ref = fp32_reference(lin, x, scales, batch, out_slices)
    assert rel_err(got.float() - base, ref - base) < TOL[dtype]


def test_engine_skips_the_linears_no_adapter_targets(hf_models: dict[str, Path], tmp_path: Path) -> None:
    """A step runs LoRA only on the linears that an adapter of its rows targets (q/v/down: not
    o_proj nor gate/up), with the tokens and log-probs of the engine that runs every linear's
    kernels; a step with another adapter too makes its targets' linears live again."""
    base = hf_models["llama"]
    a1 = make_peft_adapter(base, tmp_path / "a1", ["q_proj", "v_proj", "down_proj"], rank=8, seed=4)
    a3 = make_peft_adapter(base, tmp_path / "a3", ["k_proj", "gate_proj", "up_proj"], rank=4, seed=5)
    prompts = [[5, 17, 33, 2, 91, 14, 7], [100, 3, 44, 44, 12, 9, 150, 61]]
    common: dict = dict(skip_tokenizer_init=True, max_loras=2, max_lora_rank=16, block_size=4,
                        max_model_len=64, num_kv_blocks=64, max_num_batched_tokens=16, enforce_eager=True)
    if CUDA:
        common["device"] = "cuda"
    only_a1: list[LoRARequest | None] = [LoRARequest("a1", str(a1)), None]
    llm = LLM(str(base), lora_backend="triton", **common)
    runner = llm.engine.runner
    got = _generate(llm, prompts, only_a1)
    live = {tuple(lin.out_slices): lin.lora_live for lin in runner.model.lora_linears() if lin.layer == 0}
    assert live == {("q_proj", "k_proj", "v_proj"): True, ("o_proj",): False,
                    ("gate_proj", "up_proj"): False, ("down_proj",): True}

    every = LLM(str(base), lora_backend="triton", **common)
    every.engine.runner.slot_targets = None  # every linear's kernels, as before the skip
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, _generate(every, prompts, only_a1), strict=True):
        assert tokens == ref_tokens
        assert lps == pytest.approx(ref_lps, abs=2e-2 if CUDA else 1e-6)

    both: list[LoRARequest | None] = [LoRARequest("a1", str(a1)), LoRARequest("a3", str(a3))]
    _generate(llm, prompts, both)
    assert all(lin.lora_live for lin in runner.model.lora_linears() if lin.out_slices.keys() != {"o_proj"})
    assert not any(lin.lora_live for lin in runner.model.lora_linears() if "o_proj" in lin.out_slices)

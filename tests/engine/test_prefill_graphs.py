"""Piecewise graphs of eager steps: the segments through static buffers equal the eager forward.

Without a GPU the segments run eagerly through the same static buffers (``capture=False``); with
one they are captured and replayed.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from coserve import LLM, EngineConfig, LoRARequest
from coserve.engine.model_runner import BatchRow
from coserve.engine.prefill_graphs import PrefillGraphs
from coserve.layers.triton_lora import ExpandFirstTritonLoRA
from coserve.models.llama import ForwardContext
from tests.conftest import greedy_with_logprobs, make_peft_adapter, triton_unavailable

CUDA = torch.cuda.is_available()
COMMON: dict = dict(skip_tokenizer_init=True, block_size=4, max_model_len=64, num_kv_blocks=64,
                    max_num_batched_tokens=24, max_loras=1, max_lora_rank=8,
                    prefill_graphs=False)  # (the default on CUDA: each test builds them itself, its reference eager)
PROMPTS = [[5, 17, 33, 2, 91, 14, 7], [100, 3, 44, 44, 12, 9, 150, 61, 70, 8, 1, 2, 3, 4, 5, 6, 7, 9, 9, 9], [42]]


def test_buckets_are_checked() -> None:
    with pytest.raises(ValueError, match="prefill_graph_buckets"):
        EngineConfig(prefill_graph_buckets=(64, 32))


def test_segments_equal_the_eager_forward(hf_models: dict[str, Path]) -> None:
    llm = LLM(str(hf_models["llama"]), device="cuda" if CUDA else "cpu", **COMMON)
    runner = llm.engine.runner
    pieces = PrefillGraphs(runner.model, runner.kv_cache, runner.backend, (8, 16, 32), capture=CUDA)
    assert [pieces.bucket(n) for n in (1, 8, 9, 32, 33)] == [8, 8, 16, 32, None]
    assert pieces.accepts(32, lora_active=False)
    assert not pieces.accepts(33, lora_active=False) and not pieces.accepts(4, lora_active=True)
    rows = [BatchRow([7, 8, 9, 10, 11], 3, [0, 1], samples=True),  # a chunk after 3 cached tokens
            BatchRow([20, 21, 22, 23, 24, 25], 0, [2, 3], samples=True),
            BatchRow([30], 6, [4, 5], samples=True, is_prefill=False)]  # a decode row
    inputs = runner.prepare(rows)
    ctx = ForwardContext(attn=inputs.attn, kv_cache=runner.kv_cache, lora=None, backend=runner.backend)
    with torch.inference_mode():
        before = runner.kv_cache.clone()
        expected = runner.model(inputs.input_ids, inputs.positions, ctx).clone()
        kv = runner.kv_cache.clone()
        assert not torch.equal(kv, before)
        runner.kv_cache.copy_(before)  # the segments must write the step's KV themselves
        got = pieces.run(inputs.input_ids, inputs.positions, inputs.attn)
    assert got.shape == expected.shape == (12, runner.model.config.hidden_size)
    tol = 2e-2 if CUDA else 1e-5
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    torch.testing.assert_close(runner.kv_cache, kv, rtol=tol, atol=tol)


def generate(llm: LLM, loras: list[LoRARequest | None]) -> list[tuple[list[int], list[float]]]:
    return greedy_with_logprobs(llm, PROMPTS, loras, 6)


def test_engine_with_prefill_graphs_generates_the_same(hf_models: dict[str, Path], tmp_path: Path) -> None:
    """Greedy tokens and log-probs equal the eager engine's, without adapters (every step through
    the prefill graphs) and with one (its steps stay eager unless the LoRA backend is Triton)."""
    base = hf_models["llama"]
    adapter = make_peft_adapter(base, tmp_path / "a", ["q_proj", "down_proj"], rank=8, seed=1)
    device = {"device": "cuda"} if CUDA else {}
    for loras in ([None, None, None], [None, LoRARequest("a", str(adapter)), None]):
        expected = generate(LLM(str(base), **device, **COMMON), loras)
        llm = LLM(str(base), **device, **COMMON)
        runner = llm.engine.runner
        runner.prefill_graphs = runner.make_prefill_graphs(capture=CUDA)
        pieces = runner.prefill_graphs
        runs: list[int] = []

        def counted(*args: object, run=pieces.run, runs: list[int] = runs, **kwargs: object) -> torch.Tensor:  # type: ignore[no-untyped-def]
            runs.append(1)
            return run(*args, **kwargs)  # type: ignore[arg-type]

        pieces.run = counted  # type: ignore[method-assign]
        got = generate(llm, loras)
        # steps with adapter rows too where the multi-LoRA is Triton's (static routing buffers)
        assert bool(runs) == (loras[1] is None or pieces.lora_scales is not None)
        tol = 2e-2 if CUDA else 1e-4
        for (tokens, lps), (ref_tokens, ref_lps) in zip(got, expected, strict=True):
            assert tokens == ref_tokens
            assert lps == pytest.approx(ref_lps, abs=tol)


def test_prompt_logprobs_through_the_prefill_graphs_equal_the_eager_engines(hf_models: dict[str, Path]) -> None:
    """``SamplingParams.prompt_logprobs`` scored from the hidden states that the prefill graphs
    leave in their static buffer: the same entries as the eager engine's, chunked prefills too."""
    from coserve import SamplingParams

    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    device = {"device": "cuda"} if CUDA else {}
    base = str(hf_models["llama"])
    expected = LLM(base, **device, **COMMON).generate(PROMPTS, params)
    llm = LLM(base, **device, **COMMON)
    runner = llm.engine.runner
    runner.prefill_graphs = runner.make_prefill_graphs(capture=CUDA)
    modes: list[str] = []
    execute = runner.execute

    def counted(*args: object, **kwargs: object) -> object:
        out = execute(*args, **kwargs)  # type: ignore[arg-type]
        modes.append(runner.last_mode)
        return out

    runner.execute = counted  # type: ignore[method-assign]
    got = llm.generate(PROMPTS, params)
    assert "graph" in modes  # (the 20-token prompt runs in chunks of max_num_batched_tokens=24 or less)
    tol = 2e-2 if CUDA else 1e-4
    for out, ref in zip(got, expected, strict=True):
        assert out.prompt_logprobs is not None and ref.prompt_logprobs is not None
        assert len(out.prompt_logprobs) == len(ref.prompt_logprobs) and out.prompt_logprobs[0] is None
        for entry, want in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True):
            assert entry is not None and want is not None
            common = set(entry) & set(want)
            assert len(common) >= 2  # the prompt token and the top ones (ties may swap on the GPU)
            for tid in common:
                assert entry[tid] == pytest.approx(want[tid], abs=tol)


@pytest.mark.parametrize("expand_first", [False, True])
def test_segments_with_adapters_and_the_capture_hook_equal_the_eager_forward(hf_models: dict[str, Path],
                                                                              expand_first: bool) -> None:
    """Rows of two adapter slots and none, through the static multi-LoRA routing; the layer hook
    sees every layer's input h_i and h_L as in the eager forward. ``expand_first``: the graphs'
    LoRA stores its delta first through the static routing of every row, the bucket's padding
    rows too (COSERVE_LORA_GRAPH_EXPAND_FIRST, for buckets above 4 tokens here)."""
    reason = triton_unavailable()
    if reason is not None:
        pytest.skip(reason)
    llm = LLM(str(hf_models["llama"]), device="cuda" if CUDA else "cpu",
              **{**COMMON, "max_loras": 2, "lora_backend": "triton"})
    runner = llm.engine.runner
    torch.manual_seed(0)
    with torch.no_grad():
        for lin in runner.model.lora_linears():
            for name in lin.out_slices:
                a, b = lin.lora_stacks(name)
                a.normal_(0, lin.in_features**-0.5)
                b.normal_(0, 0.05)
        runner.lora_scales.fill_(2.0)
    pieces = runner.make_prefill_graphs(capture=CUDA)
    pieces.expand_first_above = 4 if expand_first else None
    pieces.graphs.clear()  # (graphs captured before the switch: none with LoRA yet)
    assert pieces.lora_scales is not None and pieces.accepts(8, lora_active=True)
    rows = [BatchRow([7, 8, 9, 10, 11], 3, [0, 1], lora_slot=1, samples=True),
            BatchRow([20, 21, 22, 23, 24, 25], 0, [2, 3], samples=True),
            BatchRow([30, 31, 32], 0, [], lora_slot=0, writes_kv=False),  # an FT-like row
            BatchRow([40], 6, [4, 5], lora_slot=0, samples=True, is_prefill=False)]
    inputs = runner.prepare(rows)
    assert inputs.lora.active
    seen: dict[str, list[torch.Tensor]] = {"eager": [], "graphs": []}
    lora = runner.lora_op(inputs.lora, runner.lora_scales)
    ctx = ForwardContext(attn=inputs.attn, kv_cache=runner.kv_cache, lora=lora, backend=runner.backend,
                         layer_hook=lambda i, h: seen["eager"].append(h.clone()))
    with torch.inference_mode():
        expected = runner.model(inputs.input_ids, inputs.positions, ctx).clone()
        got = pieces.run(inputs.input_ids, inputs.positions, inputs.attn, inputs.lora,
                         lambda i, h: seen["graphs"].append(h.clone())).clone()
    tol = 2e-2 if CUDA else 1e-4
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    assert len(seen["graphs"]) == len(seen["eager"]) == runner.model.config.num_layers + 1
    for mine, theirs in zip(seen["graphs"], seen["eager"], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=tol, atol=tol)
    b = pieces.bucket(inputs.input_ids.shape[0])
    assert b is not None and b > 4 and isinstance(pieces._lora(b, True), ExpandFirstTritonLoRA) == expand_first
    if expand_first:  # the storing expand's routing lists every row of the bucket once, padding too
        assert sorted(t for t in pieces.store_order.tolist() if t >= 0) == list(range(b))


def test_a_live_variant_replays_only_its_linears_lora(hf_models: dict[str, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps whose adapters target q/v only (a training adapter's declared targets) run through
    graphs of their own, without the other linears' LoRA, and compute what every linear's LoRA
    computes (the others' weights are zero for them); a step with another adapter falls back to
    the every-linear graphs."""
    from coserve.layers.triton_lora import TritonLoRA

    reason = triton_unavailable()
    if reason is not None:
        pytest.skip(reason)
    llm = LLM(str(hf_models["llama"]), device="cuda" if CUDA else "cpu",
              **{**COMMON, "max_loras": 2, "lora_backend": "triton"})
    engine, runner = llm.engine, llm.engine.runner
    torch.manual_seed(0)
    layers = runner.model.config.num_layers
    qv = frozenset((layer, t) for layer in range(layers) for t in ("q_proj", "v_proj"))
    with torch.no_grad():
        for lin in runner.model.lora_linears():
            for name in lin.out_slices:
                a, b = lin.lora_stacks(name)
                for slot in (0, 1):
                    if slot == 1 or (lin.layer, name) in qv:
                        a[slot].normal_(0, lin.in_features**-0.5)
                        b[slot].normal_(0, 0.05)
        runner.lora_scales.fill_(2.0)
    engine.lora_manager.declare(1, [(layer, t) for layer in range(layers)
                                    for t in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj")])
    runner.prefill_graphs = pieces = runner.make_prefill_graphs(capture=CUDA)
    engine.declare_training_adapter(0, qv)
    assert pieces.live_variants == {qv}
    applied: list[tuple[int, tuple[str, ...]]] = []
    real = TritonLoRA.apply_fused

    def counted(self, layer, x, y, a_all, b_all, out_slices):  # type: ignore[no-untyped-def]
        applied.append((layer, tuple(out_slices)))
        return real(self, layer, x, y, a_all, b_all, out_slices)

    monkeypatch.setattr(TritonLoRA, "apply_fused", counted)
    rows = [BatchRow([7, 8, 9, 10, 11], 3, [0, 1], samples=True),  # no adapter
            BatchRow([30, 31, 32], 0, [], lora_slot=0, writes_kv=False)]  # FT-like, q/v adapter
    for slots, variant in (((-1, 0), qv), ((1, 0), True)):
        step = [replace(r, lora_slot=s) for r, s in zip(rows, slots, strict=True)]
        inputs = runner.prepare(step)
        assert pieces.variant(True, runner._step_live(step)) == variant
        runner.set_live(None)
        lora = runner.lora_op(inputs.lora, runner.lora_scales)
        ctx = ForwardContext(attn=inputs.attn, kv_cache=runner.kv_cache, lora=lora, backend=runner.backend)
        with torch.inference_mode():
            expected = runner.model(inputs.input_ids, inputs.positions, ctx)
            expected = runner.model.compute_logits(expected[inputs.logits_indices]).clone()
        applied.clear()
        got = runner.execute(step)
        assert runner.last_mode == "graph"
        tol = 2e-2 if CUDA else 1e-4
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
        if not CUDA:  # the segments ran eagerly here: each LoRA they ran is seen
            targets = {t for _, names in applied for t in names}
            assert targets == ({"q_proj", "k_proj", "v_proj"} if variant == qv else
                               {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


def test_the_prefill_graphs_switch_off_and_back_on(hf_models: dict[str, Path]) -> None:
    """One engine, both paths (the benchmark's full and full-graphs configurations): off, a
    prefill step runs eagerly and FT rows get no graph tokens; back on, the same graphs."""
    from coserve.bench.configs import CONFIGS
    from coserve.bench.runners import use_prefill_graphs

    llm = LLM(str(hf_models["llama"]), device="cuda" if CUDA else "cpu", **{**COMMON, "lora_backend": "triton"})
    runner = llm.engine.runner
    assert not runner.use_prefill_graphs(True)  # nothing built (on the CPU, or with the flag off)
    runner.prefill_graphs = pieces = runner.make_prefill_graphs(capture=CUDA)
    rows = [BatchRow([7, 8, 9, 10, 11], 3, [0, 1], samples=True)]
    assert runner.planned_mode(rows) == "graph"
    assert not runner.use_prefill_graphs(False)
    assert runner.planned_mode(rows) == "eager" and runner.ft_graph_tokens == 0
    runner.execute(rows)
    assert runner.last_mode == "eager"
    assert runner.use_prefill_graphs(True) and runner.prefill_graphs is pieces

    class Ctx:  # what runners.use_prefill_graphs reads of a BenchContext
        engine = llm.engine
        prefill_graphs = False

    assert not use_prefill_graphs(Ctx, CONFIGS["full"])  # type: ignore[arg-type]
    assert use_prefill_graphs(Ctx, CONFIGS["full-graphs"])  # type: ignore[arg-type]
    Ctx.prefill_graphs = True
    assert not use_prefill_graphs(Ctx, CONFIGS["full-eager"])  # type: ignore[arg-type]
    assert use_prefill_graphs(Ctx, CONFIGS["inference"])  # type: ignore[arg-type]


def test_a_live_variant_that_finds_no_memory_falls_back_to_the_every_linear_graphs(
        hf_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    reason = triton_unavailable()
    if reason is not None:
        pytest.skip(reason)
    llm = LLM(str(hf_models["llama"]), device="cuda" if CUDA else "cpu",
              **{**COMMON, "max_loras": 1, "lora_backend": "triton"})
    pieces = llm.engine.runner.make_prefill_graphs(capture=CUDA)

    def no_memory() -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(pieces, "capture_all", no_memory)
    live = frozenset({(0, "q_proj")})
    pieces.add_live_variant(live)  # logged, not raised: serving goes on
    assert pieces.live_variants == set() and pieces.variant(True, live) is True

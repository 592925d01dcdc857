"""Decode graphs and the Triton paths through the whole engine.

Without a GPU the Triton kernels run in Triton's interpreter and the decode-graph path runs its
static buffers eagerly (``capture=False``); with one, graphs are captured and replayed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from coserve import LLM, EngineConfig, LoRARequest
from coserve.engine.model_runner import BatchRow
from tests.conftest import greedy_with_logprobs, make_peft_adapter, triton_unavailable

CUDA = torch.cuda.is_available()


def triton_or_skip() -> None:
    """Skip unless Triton kernels can run here (compiled on a GPU, interpreted on the CPU)."""
    reason = triton_unavailable()
    if reason is not None:
        pytest.skip(reason)


PROMPTS = [[5, 17, 33, 2, 91, 14, 7], [100, 3, 44, 44, 12, 9, 150, 61, 70, 8, 1, 2, 3, 4, 5, 6, 7], [42]]
NEW_TOKENS = 10  # 17 + 10 tokens: past the Mistral window (24)


def test_graph_batch_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
        EngineConfig(cuda_graph_batch_sizes=(4, 2))
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
        EngineConfig(cuda_graph_batch_sizes=(0, 2))


def test_graph_buckets_and_acceptance(hf_models: dict[str, Path]) -> None:
    llm = LLM(str(hf_models["llama"]), skip_tokenizer_init=True, block_size=4, max_model_len=64,
              cuda_graph_batch_sizes=(1, 2, 4, 8))
    runner = llm.engine.runner
    graphs = runner.decode_graphs(capture=False)
    assert [graphs.bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    decode = BatchRow([3], 5, [0, 1], samples=True, is_prefill=False)
    assert graphs.accepts([decode] * 8)
    assert not graphs.accepts([decode] * 9)
    assert not graphs.accepts([BatchRow([3, 4], 0, [0], samples=True), decode])  # prefill row
    assert not graphs.accepts([BatchRow([3], 0, [], writes_kv=False, is_prefill=False, samples=True)])
    assert not graphs.accepts([BatchRow([3], 64, list(range(17)), samples=True, is_prefill=False)])
    assert runner.planned_mode([decode]) == ("graph" if runner.graphs is not None else "eager")


def generate(llm: LLM, loras: list[LoRARequest | None]) -> list[tuple[list[int], list[float]]]:
    return greedy_with_logprobs(llm, PROMPTS, loras, NEW_TOKENS)


def _two_adapters(base: Path, tmp_path: Path) -> tuple[list[LoRARequest | None], dict[str, Any]]:
    """Two adapters on different targets and ranks plus a row without one, and the engine
    settings (small graphs, on the GPU where there is one) the graph tests run them with."""
    a1 = make_peft_adapter(base, tmp_path / "a1", ["q_proj", "v_proj", "down_proj"], rank=8, seed=1)
    a2 = make_peft_adapter(base, tmp_path / "a2", ["k_proj", "o_proj", "gate_proj", "up_proj"], rank=16, seed=2)
    common: dict[str, Any] = dict(skip_tokenizer_init=True, max_loras=2, max_lora_rank=16, block_size=4,
                                  max_model_len=64, num_kv_blocks=64, max_num_batched_tokens=16,
                                  cuda_graph_batch_sizes=(1, 2, 4), **({"device": "cuda"} if CUDA else {}))
    return [LoRARequest("a1", str(a1)), None, LoRARequest("a2", str(a2))], common


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_triton_engine_matches_torch_engine(arch: str, hf_models: dict[str, Path], tmp_path: Path) -> None:
    """Greedy tokens and log-probs of the Triton backends (eager, then through the decode-graph
    path) equal the torch reference engine's, with two adapters and no adapter in one batch."""
    triton_or_skip()
    base = hf_models[arch]
    loras, common = _two_adapters(base, tmp_path)
    expected = generate(LLM(str(base), **common), loras)

    llm = LLM(str(base), attention_backend="triton", lora_backend="triton", enforce_eager=True, **common)
    assert _close(generate(llm, loras), expected)

    # decode graphs, the prefill steps eager (no piecewise prefill graphs, the default on CUDA)
    llm = LLM(str(base), attention_backend="triton", lora_backend="triton", prefill_graphs=False, **common)
    runner = llm.engine.runner
    if runner.graphs is None:
        runner.graphs = runner.decode_graphs(capture=False)
    modes: list[str] = []
    execute = runner.execute

    def record(rows: list[BatchRow], hook: object = None, mlp_hook: object = None) -> torch.Tensor:
        logits = execute(rows, hook, mlp_hook)  # type: ignore[arg-type]
        modes.append(runner.last_mode)
        return logits

    runner.execute = record  # type: ignore[method-assign]
    got = generate(llm, loras)
    assert "graph" in modes and "eager" in modes
    assert _close(got, expected)


def _close(got: list[tuple[list[int], list[float]]], expected: list[tuple[list[int], list[float]]]) -> bool:
    tol = 2e-2 if CUDA else 1e-4  # the GPU runs fp32 products as tf32: 1.1e-2 seen on the H200
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, expected, strict=True):
        assert tokens == ref_tokens
        assert lps == pytest.approx(ref_lps, abs=tol)
    return True


@pytest.mark.skipif(not CUDA, reason="the fork is a second CUDA stream inside a captured graph")
@pytest.mark.parametrize("fork", [True, False])
def test_lora_graphs_with_and_without_fork_match_torch_engine(
    hf_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fork: bool
) -> None:
    """Decode graphs captured with each LoRA shrink on a side stream (``COSERVE_LORA_FORK``, the
    default) and without give the torch reference engine's tokens and log-probs, and their
    replays ran."""
    from coserve.engine import cuda_graph

    base = hf_models["llama"]
    loras, common = _two_adapters(base, tmp_path)
    expected = generate(LLM(str(base), **common), loras)
    monkeypatch.setattr(cuda_graph, "LORA_FORK", fork)
    llm = LLM(str(base), attention_backend="triton", lora_backend="triton", **common)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and (graphs._lora_stream is not None) == fork
    assert _close(generate(llm, loras), expected)
    assert any(key.with_lora for key in graphs.graphs)

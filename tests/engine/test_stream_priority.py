"""--stream-priority: the engine's own high-priority CUDA stream, and the trainer as a
below-normal MPS client. The stream parts run on a GPU only; on the CPU the setting is inert."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from coserve import LLM, SamplingParams
from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.server.cli import add_engine_args, engine_kwargs
from coserve.trainer.mps import MPS_PRIORITY_ENV, MPS_SHARE_ENV, mps_share

CUDA = torch.cuda.is_available()


def test_setting_and_flag() -> None:
    with pytest.raises(ValueError, match="stream_priority"):
        EngineConfig(stream_priority="urgent")
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args([]))["stream_priority"] == "default"
    assert engine_kwargs(p.parse_args(["--stream-priority", "high"]))["stream_priority"] == "high"


def test_inert_on_the_cpu(hf_models: dict[str, Path]) -> None:
    engine = LLMEngine(EngineConfig(model=str(hf_models["llama"]), device="cpu", skip_tokenizer_init=True,
                                    num_kv_blocks=32, block_size=4, stream_priority="high"))
    assert engine.stream is None
    with engine.on_stream():
        pass


def test_trainer_env_below_normal_within_the_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MPS_PRIORITY_ENV, raising=False)
    monkeypatch.setenv(MPS_SHARE_ENV, "70")
    with mps_share(None, below_normal=True):
        assert os.environ[MPS_PRIORITY_ENV] == "1" and os.environ[MPS_SHARE_ENV] == "70"
    assert MPS_PRIORITY_ENV not in os.environ and os.environ[MPS_SHARE_ENV] == "70"
    with mps_share(30):
        assert os.environ[MPS_SHARE_ENV] == "30" and MPS_PRIORITY_ENV not in os.environ
    assert os.environ[MPS_SHARE_ENV] == "70"


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_steps_run_on_the_high_priority_stream_with_the_same_tokens(
    hf_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [[5, 17, 33, 2, 91, 14, 7], [100, 3, 44, 44, 12, 9, 150, 61], [42]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    common: dict[str, Any] = dict(skip_tokenizer_init=True, block_size=4, num_kv_blocks=64)
    ref = [o.outputs[0].token_ids for o in LLM(str(hf_models["llama"]), **common).generate(prompts, params)]
    llm = LLM(str(hf_models["llama"]), stream_priority="high", **common)
    engine = llm.engine
    assert engine.stream is not None
    assert engine.stream.priority == torch.cuda.Stream.priority_range()[1]  # the highest (lowest number)
    seen: list[torch.cuda.Stream] = []
    execute = engine.runner.execute

    def spying(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.cuda.current_stream())
        return execute(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", spying)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == ref
    assert seen and all(s == engine.stream for s in seen)
    assert torch.cuda.current_stream() != engine.stream  # the caller's stream is left as it was


def test_on_stream_orders_the_streams_both_ways(hf_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """With fakes for the CUDA stream calls: inside the block the engine's stream is current, it
    first waits for the caller's stream, and the caller's waits for it on the way out — also
    when the block raises."""
    engine = LLMEngine(EngineConfig(model=str(hf_models["llama"]), device="cpu", skip_tokenizer_init=True,
                                    num_kv_blocks=32, block_size=4))
    calls: list[tuple[str, str]] = []

    class FakeStream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other: FakeStream) -> None:
            calls.append((self.name, other.name))

    outer, mine = FakeStream("caller"), FakeStream("engine")
    current = [outer]

    class Switch:
        def __init__(self, stream: FakeStream) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            current.append(self.stream)

        def __exit__(self, *exc: object) -> None:
            current.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", Switch)
    engine.stream = mine  # type: ignore[assignment]
    with engine.on_stream():
        assert current[-1] is mine and calls == [("engine", "caller")]
    assert current == [outer] and calls == [("engine", "caller"), ("caller", "engine")]
    calls.clear()
    with pytest.raises(RuntimeError), engine.on_stream():
        raise RuntimeError("step failed")
    assert current == [outer] and calls == [("engine", "caller"), ("caller", "engine")]

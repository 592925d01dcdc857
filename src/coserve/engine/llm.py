"""Offline batch generation, the way vLLM users know it."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import fields
from typing import Any

from tqdm import tqdm

from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.engine.outputs import RequestOutput
from coserve.engine.sampling_params import SamplingParams
from coserve.engine.sequence import LoRARequest

Prompt = str | Seq[int]


class LLM:
    """``LLM(model="tiny").generate(["Hello"], SamplingParams(max_tokens=8))``.

    Keyword arguments are :class:`EngineConfig` fields (``dtype``, ``max_loras``, ...).
    """

    def __init__(self, model: str = "tiny", **kwargs: Any) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._counter = 0

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order."""
        batch = _as_prompt_list(prompts)
        params = _broadcast(sampling_params or SamplingParams(), len(batch), "sampling_params")
        loras = _broadcast(lora_request, len(batch), "lora_request")
        ids = []
        try:
            for prompt, p, lora in zip(batch, params, loras, strict=True):
                rid = str(self._counter)
                self._counter += 1
                self.engine.add_request(rid, prompt, p, lora)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        while len(results) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [results[r] for r in ids]


def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # a single list of token ids
    return items


def _broadcast(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list | tuple):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n

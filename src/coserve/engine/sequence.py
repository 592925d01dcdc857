"""A request as the engine tracks it: tokens, progress, KV blocks, adapter, stop state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from coserve.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(frozen=True)
class LoRARequest:
    """An adapter to apply to a request: a name the engine caches it under and a PEFT directory."""

    name: str
    path: str


@dataclass(eq=False)
class Sequence:
    """One request. ``num_computed_tokens`` of ``all_token_ids`` have their KV in ``block_table``.

    Preemption (recompute) frees the blocks and sets ``num_computed_tokens`` to 0; the tokens
    generated so far stay and are prefilled again on resume.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    lora: LoRARequest | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    lora_slot: int = -1
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    output_text: str = ""
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # (SamplingParams.prompt_logprobs) of prompt tokens 1, 2, ... as the prefill reaches them
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    # Prefix caching (BlockManager): the digest of what besides its tokens decides its KV (None:
    # not cached, e.g. it asks for prompt logprobs, or its adapter trains), its full blocks'
    # digests so far, and how many of its blocks are registered
    cache_key: bytes | None = None
    block_digests: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

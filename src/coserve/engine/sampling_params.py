"""Per-request sampling settings, validated when built (the vLLM shape)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token and when to stop.

    ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``seed`` makes a sampled request reproducible on its own, whatever else is in the batch.
    ``logprobs = n`` returns, per generated token, its log-probability and the ``n`` most likely
    tokens' log-probabilities (from the model's raw distribution, before temperature/top-k/top-p).
    ``prompt_logprobs = n`` returns the same for every prompt token after the first (given the
    tokens before it), in :attr:`RequestOutput.prompt_logprobs`.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Accept lists/strings for the tuple fields, as users pass them.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63):
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


@dataclass(frozen=True)
class SampledToken:
    """One sampled token with its log-probability information (when asked for)."""

    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] = field(default_factory=dict)

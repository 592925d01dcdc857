"""Per-request sampling settings, validated when built (the vLLM shape)."""

from __future__ import annotations

import math
from collections.abc import Mapping
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

    Logit processing, as vLLM's (before temperature, also for greedy requests): ``logit_bias``
    ({token id: bias in [-100, 100]}) is added to the logits; ``presence_penalty`` and
    ``frequency_penalty`` (OpenAI's, in [-2, 2]) subtract ``presence · [count > 0] + frequency ·
    count`` for each token's count in the output so far; ``repetition_penalty`` (> 0, 1: none)
    divides the positive logits and multiplies the negative ones of every token in the prompt or
    the output. ``min_p`` (in [0, 1]) keeps, after top-k and top-p, the tokens at least ``min_p``
    times as likely as the most likely one.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    # (token id, bias) pairs, sorted; a dict is accepted
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        # Accept lists/strings for the tuple fields, as users pass them.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        try:
            pairs = tuple(sorted((t, float(b)) for t, b in bias))
        except (TypeError, ValueError) as e:
            raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from e
        object.__setattr__(self, "logit_bias", pairs)
        self._validate()
        # (read for every row of every step: worked out once)
        object.__setattr__(self, "_processes_logits", bool(pairs) or self.presence_penalty != 0.0
                           or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0)

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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and -2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not (isinstance(self.repetition_penalty, (int, float)) and 0.0 < self.repetition_penalty <= 100.0):
            raise ValueError(f"repetition_penalty must be in (0, 100] (1: none), got {self.repetition_penalty!r}")
        if not (isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for t, b in self.logit_bias:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"logit_bias: token ids must be non-negative integers, got {t!r}")
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias: biases must be in [-100, 100], got {b!r} for token {t}")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias: a token id given twice")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def processes_logits(self) -> bool:
        """Whether the logits change before temperature: a bias or a penalty asked for."""
        return self._processes_logits  # type: ignore[no-any-return,attr-defined]


@dataclass(frozen=True)
class SampledToken:
    """One sampled token with its log-probability information (when asked for)."""

    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] = field(default_factory=dict)

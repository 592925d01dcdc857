"""The OpenAI-compatible request and response bodies (pydantic), checked when parsed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from coserve.engine.sampling_params import SamplingParams

# ---------------------------------------------------------------------- request models


class _Request(BaseModel):
    # Clients send fields this server does not use (user, presence_penalty=0, ...): ignore them.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: StrictBool = False


def _is_none_or(*neutral: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or any(v == n and type(v) is type(n) for n in neutral)


MAX_CHOICES = 64
"""The most choices (prompts × ``n``) one request may ask for."""

NOT_SUPPORTED: dict[str, Callable[[Any], bool]] = {
    "best_of": _is_none_or(1),
    "echo": _is_none_or(False),
    "suffix": _is_none_or(""),
    "top_logprobs": _is_none_or(0),
    "tools": _is_none_or([]),
    "functions": _is_none_or([]),
    "tool_choice": _is_none_or("none", "auto"),
    "response_format": _is_none_or({"type": "text"}),
}
"""OpenAI request fields this server does not implement, each with the test of a value that asks
for nothing (what clients send by default: accepted and ignored). Any other value is a 400: a
client that asks for JSON output, penalties or tools must not get a plain completion silently."""


class _SamplingRequest(_Request):
    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    n: StrictInt | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions (benchmark clients send them): decode past the end-of-sequence token / at
    # least this many tokens
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # OpenAI's: {"token id": bias}; vLLM's extensions: repetition_penalty, min_p
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _not_supported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, neutral in NOT_SUPPORTED.items():
                if name in data and name not in cls.model_fields and not neutral(data[name]):
                    raise ValueError(f"{name} is not supported by this server (got {data[name]!r}); "
                                     "leave it out or send its default")
        return data

    def choices_per_prompt(self) -> int:
        """``n``, checked: raises ValueError (a 400)."""
        n = 1 if self.n is None else self.n
        if not 1 <= n <= MAX_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_CHOICES}], got {n}")
        return n

    def sampling_params(self, max_tokens: int | None, default_max_tokens: int,
                        logprobs: int | None = None) -> SamplingParams:
        """Raises ValueError (a 400) naming the bad field."""
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0, seed=self.seed, logprobs=logprobs,
            stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0, logit_bias=tuple(sorted(self._logit_bias().items())),
        )

    def _logit_bias(self) -> dict[int, float]:
        """``logit_bias`` by token id; raises ValueError (a 400) for a key that is not a token id in
        ASCII digits, or one that names the same token as another key ("5" and "05")."""
        bias: dict[int, float] = {}
        keys: dict[int, str] = {}
        for key, value in (self.logit_bias or {}).items():
            token = _token_id_key(key)
            if token in keys:
                raise ValueError(f"logit_bias: keys {keys[token]!r} and {key!r} name the same token id {token}")
            keys[token] = key
            bias[token] = value
        return bias


def _token_id_key(key: str) -> int:
    """The token id that a ``logit_bias`` key names."""
    # NOTE: str.isdigit() alone accepts other scripts' digits ("²", which int() refuses, and "٥",
    # which it reads as 5)
    if not (key.isascii() and key.isdigit()):
        raise ValueError(f"logit_bias: keys must be token ids (decimal strings of the digits 0-9), got {key!r}")
    digits = key.lstrip("0") or "0"
    if len(digits) > 19:  # (past any vocabulary, and int() refuses past 4300 digits)
        shown = key if len(key) <= 24 else key[:21] + "..."
        raise ValueError(f"logit_bias: key {shown!r} ({len(key)} digits) is too long to be a token id")
    return int(digits)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: StrictInt | None = None
    echo: StrictBool = False  # the prompt before the completion (and its tokens' logprobs, with logprobs)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_type(cls, v: Any) -> Any:
        def one(p: Any) -> bool:
            return isinstance(p, str) or (isinstance(p, list) and all(type(t) is int for t in p))

        several = isinstance(v, list) and bool(v) and (all(isinstance(p, str) for p in v)
                                                      or all(isinstance(p, list) for p in v))
        if not (one(v) or (several and all(one(p) for p in v))):
            raise ValueError("prompt must be a string, a list of token ids (integers), or a list of "
                             "strings or of token-id lists")
        if not v or (several and not all(v)):
            raise ValueError("the prompt is empty" if not v else
                             f"prompt {[bool(p) for p in v].index(False)} is empty")
        if several and len(v) > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} prompts in one request, got {len(v)}")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or each of a batch (a list of strings or of token-id lists)."""
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            return list(p)  # type: ignore[arg-type]
        return [p]  # type: ignore[list-item]

    def choices_per_prompt(self) -> int:
        n = super().choices_per_prompt()
        if n * len(self.prompts()) > MAX_CHOICES:
            raise ValueError(f"n × prompts must be at most {MAX_CHOICES}, got {n} × {len(self.prompts())}")
        return n


class ChatTextPart(_Request):
    type: Literal["text"]
    text: str


class ChatFunctionCall(_Request):
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


class ChatToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ChatFunctionCall


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ChatTextPart] | None = None
    tool_calls: list[ChatToolCall] | None = None  # (an assistant's earlier calls)
    tool_call_id: str | None = None  # (a tool's answer: to which call)
    name: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class ChatToolFunction(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: ChatToolFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the model may call, for its chat template (None: none, or ``tool_choice``
        ``none``); raises ValueError (a 400) for a choice that would need constrained decoding."""
        if self.tool_choice not in (None, "auto", "none"):
            raise ValueError(f"tool_choice {self.tool_choice!r} is not supported (it would need constrained "
                             "decoding): send 'auto' (the model decides) or 'none'")
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def logprobs_k(self) -> int | None:
        """The engine's ``logprobs`` (None: none asked); raises ValueError (a 400)."""
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs needs logprobs: true")
            return None
        k = self.top_logprobs or 0
        if not 0 <= k <= 20:
            raise ValueError(f"top_logprobs must be an integer in [0, 20], got {k}")
        return k


class TokenizeRequest(_Request):
    """vLLM's ``POST /tokenize``: a ``prompt``, or chat ``messages`` through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None  # (with messages: written by the template, as a chat would)
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = True

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(_Request):
    """vLLM's ``POST /detokenize``."""

    model: str | None = None
    tokens: list[StrictInt]


class LoadAdapterRequest(_Request):
    """``POST /v1/load_lora_adapter`` (vLLM's shape)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadAdapterRequest(_Request):
    """``POST /v1/unload_lora_adapter``."""

    lora_name: str = Field(min_length=1)


# ---------------------------------------------------------------------- response models


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut | None = None
    delta: ChatMessageOut | None = None
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------------- fine-tuning jobs


class Hyperparameters(BaseModel):
    """A fine-tuning job's ``hyperparameters`` (unknown ones refused)."""

    model_config = ConfigDict(extra="forbid")

    n_epochs: Literal["auto"] | int = "auto"  # (auto: the server's --epochs)
    learning_rate_multiplier: Literal["auto"] | float = "auto"  # times the server's --lr
    batch_size: Literal["auto"] | int = "auto"


class CreateJobRequest(BaseModel):
    """OpenAI's ``POST /v1/fine_tuning/jobs`` body (supervised fine-tuning of a LoRA adapter)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    training_file: str
    hyperparameters: Hyperparameters | None = None
    suffix: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    seed: int | None = None
    validation_file: str | None = None
    method: dict[str, Any] | None = None
    integrations: list[Any] | None = None
    metadata: dict[str, str] | None = None

    @field_validator("seed")
    @classmethod
    def _seed_fits_int64(cls, v: int | None) -> int | None:
        # (the trainer seeds torch generators with it, which take no more than 64 bits: a seed past
        # them would fail the job after its 200)
        if v is not None and not -(2**63) <= v < 2**63:
            raise ValueError(f"must be a 64-bit signed integer, got {v}")
        return v

    def resolved_hyperparameters(self) -> Hyperparameters:
        """``hyperparameters``, or ``method.supervised.hyperparameters`` (newer clients send those);
        raises ValueError (a 400) naming the part of ``method`` that is malformed."""
        nested = None if self.method is None else _supervised_hyperparameters(self.method)
        if nested is not None and self.hyperparameters is None:
            return nested
        return self.hyperparameters or Hyperparameters()


def _supervised_hyperparameters(method: dict[str, Any]) -> Hyperparameters | None:
    """``method.supervised.hyperparameters`` of a job request, checked (None where not given)."""
    kind = method.get("type", "supervised")
    if kind != "supervised":
        raise ValueError(f"method.type: coserve fine-tunes supervised only, got {kind!r}")
    supervised = method.get("supervised")
    if supervised is None:
        return None
    if not isinstance(supervised, dict):
        raise ValueError(f"method.supervised must be an object, got {_json_type(supervised)}")
    nested = supervised.get("hyperparameters")
    if nested is None:
        return None
    if not isinstance(nested, dict):
        raise ValueError(f"method.supervised.hyperparameters must be an object, got {_json_type(nested)}")
    try:
        return Hyperparameters.model_validate(nested)
    except ValidationError as e:  # (its own text spans lines and links to pydantic's docs)
        raise ValueError("; ".join(f"method.supervised.hyperparameters.{'.'.join(map(str, err['loc']))}: "
                                   f"{err['msg']}" for err in e.errors())) from None


def _json_type(value: Any) -> str:
    """The JSON name of ``value``'s type, for messages."""
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
             dict: "an object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


# ---------------------------------------------------------------------- metrics

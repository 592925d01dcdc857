"""Model configuration read from a Hugging Face ``config.json`` (transformers 4.x and 5.x forms)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings. ``kind`` is ``default`` or ``llama3`` (frequency-band scaling)."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder. Built from ``config.json`` by :meth:`from_hf`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    dtype: str = "float32"
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"config.json: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``(out_features, in_features)`` of each LoRA-targetable linear, by its HF name."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (self.q_size, h),
            "k_proj": (self.kv_size, h),
            "v_proj": (self.kv_size, h),
            "o_proj": (h, self.q_size),
            "gate_proj": (i, h),
            "up_proj": (i, h),
            "down_proj": (h, i),
        }

    def max_useful_lora_rank(self, targets: tuple[str, ...] | None = None) -> int:
        """The largest LoRA rank that one of ``targets`` (default: every targetable linear) can use.

        ``B @ A`` of a linear ``[out_features, in_features]`` has rank at most
        ``min(out_features, in_features)``: rank beyond that of every targeted linear adds no
        capacity, only memory (each adapter slot holds ``rank · (in + out)`` per linear and layer).
        """
        shapes = self.linear_shapes()
        return max(min(shapes[t]) for t in (targets if targets is not None else tuple(shapes)))

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        per_layer = sum(o * i for o, i in self.linear_shapes().values()) + 2 * self.hidden_size
        if self.attention_bias:
            per_layer += self.q_size + 2 * self.kv_size
        emb = self.vocab_size * self.hidden_size
        return self.num_layers * per_layer + emb * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Parse a Hugging Face config dict; raise ValueError naming the missing/bad field."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _ARCH_BY_MODEL_TYPE.get(cfg.get("model_type", ""), "")
        if not arch:
            raise ValueError("config.json: neither 'architectures' nor a known 'model_type' is given")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
            inter = int(cfg["intermediate_size"])
            vocab = int(cfg["vocab_size"])
        except KeyError as e:
            raise ValueError(f"config.json: missing required field {e.args[0]!r}") from None
        head_dim = cfg.get("head_dim") or hidden // heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        sliding = cfg.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
            sliding = None
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_parse_rope(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            initializer_range=float(cfg.get("initializer_range", 0.02)),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ValueError(f"model directory {path}: no config.json")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: invalid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{p}: expected a JSON object")
        return cls.from_hf(data)


_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def _parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (with rope_theta inside); 4.x writes rope_theta +
    # rope_scaling at the top level.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "llama3":
        return RopeConfig(
            theta=theta,
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=int(params.get("original_max_position_embeddings", 8192)),
        )
    raise ValueError(f"config.json: rope type {kind!r} is not supported (default, llama3)")

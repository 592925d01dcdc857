"""Model shapes to benchmark without a checkpoint: ``--model shape:NAME`` (random weights).

A shape becomes a model directory holding its ``config.json`` and the tiny preset's tokenizer
(the benchmarks feed token ids; fine-tuning needs a tokenizer only for its vocabulary bound).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from coserve.models.presets import preset_path

PREFIX = "shape:"

LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}

SHAPES: dict[str, dict[str, Any]] = {"llama3-8b": LLAMA3_8B}


def is_shape(model: str) -> bool:
    return model.startswith(PREFIX)


def materialize(model: str, directory: Path) -> Path:
    """Write the model directory of ``shape:NAME`` under ``directory``; returns its path."""
    name = model.removeprefix(PREFIX)
    config = SHAPES.get(name)
    if config is None:
        raise ValueError(
            f"--model {model!r}: unknown shape; choose from {', '.join(PREFIX + s for s in SHAPES)}"
        )
    path = directory / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(preset_path("tiny") / f, path / f)
    return path

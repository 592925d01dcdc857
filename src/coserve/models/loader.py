"""Building a model: Hugging Face directories (safetensors, sharded or not) or random weights."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from coserve.models.config import ModelConfig
from coserve.models.llama import MODEL_REGISTRY, LlamaForCausalLM
from coserve.models.presets import PRESETS, preset_path

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

# Hugging Face module name -> (our fused module, output slice name)
_FUSED = {
    "q_proj": ("qkv_proj", "q_proj"),
    "k_proj": ("qkv_proj", "k_proj"),
    "v_proj": ("qkv_proj", "v_proj"),
    "gate_proj": ("gate_up_proj", "gate_proj"),
    "up_proj": ("gate_up_proj", "up_proj"),
}
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a directory (a preset is a directory shipped in the package)."""

    path: Path
    is_preset: bool

    @classmethod
    def resolve(cls, model: str | Path) -> ModelSource:
        if str(model) in PRESETS:
            return cls(preset_path(str(model)), True)
        p = Path(model).expanduser()
        if not p.is_dir():
            raise ValueError(
                f"model {str(model)!r} is neither a directory nor a built-in preset "
                f"({', '.join(sorted(PRESETS))}); models are never downloaded"
            )
        return cls(p, False)


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return DTYPES.get(cfg.dtype, torch.float32)
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(DTYPES)}") from None


def load_model(
    model: str | Path,
    *,
    load_format: str = "auto",
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    num_lora_slots: int = 0,
    max_lora_rank: int = 16,
    seed: int = 0,
) -> LlamaForCausalLM:
    """Build the model of ``model`` (a directory or preset name) on ``device``.

    ``load_format``: ``auto`` reads safetensors (or ``pytorch_model*.bin``) weights when the
    directory has them and random weights otherwise (presets have none); ``dummy`` always uses
    random weights from the config (benchmarks at real shapes without a checkpoint).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; use one of {', '.join(LOAD_FORMATS)}")
    source = ModelSource.resolve(model)
    cfg = ModelConfig.from_dir(source.path)
    torch_dtype = resolve_dtype(dtype, cfg)
    cls = MODEL_REGISTRY[cfg.architecture]
    limit = cfg.max_useful_lora_rank()
    if num_lora_slots and max_lora_rank > limit:  # (before the slots are allocated at that rank)
        raise ValueError(
            f"max_lora_rank {max_lora_rank} (--max-lora-rank, or the --lora-rank that raised it) is above {limit}, "
            f"the largest LoRA rank any linear of this model can use (min(in_features, out_features)); a larger "
            f"rank would only make every adapter slot bigger: give a rank of at most {limit}"
        )
    with torch.device(device):
        net = cls(cfg, num_lora_slots=num_lora_slots, max_lora_rank=max_lora_rank, dtype=torch_dtype)
    files = _weight_files(source.path)
    if load_format == "dummy" or (load_format == "auto" and not files):
        if not source.is_preset and load_format == "auto":
            logger.warning("%s holds no weight files: using random weights", source.path)
        init_dummy_weights(net, seed)
    else:
        if not files:
            raise ValueError(f"model directory {source.path}: no *.safetensors or pytorch_model*.bin files")
        load_weights(net, _iter_tensors(files))
    net.eval()
    return net


def init_dummy_weights(net: LlamaForCausalLM, seed: int) -> None:
    """Random weights, N(0, initializer_range²) like Hugging Face's init; norms at one; LoRA stacks
    untouched."""
    gen = torch.Generator(device=net.lm_head_weight.device).manual_seed(seed)
    std = net.config.initializer_range
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32) * std)


def load_weights(net: LlamaForCausalLM, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy Hugging Face-named tensors into ``net`` (fusing q/k/v and gate/up); check completeness."""
    params = dict(net.named_parameters())
    filled: dict[str, int] = {}  # our param name -> number of rows written
    cfg = net.config
    for name, tensor in tensors:
        if "rotary_emb" in name:
            continue
        target, rows = _map_name(name, net)
        if target is None:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        p = params[target]
        dst = p if rows is None else p[rows[0] : rows[1]]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, the config implies {tuple(dst.shape)}"
            )
        with torch.no_grad():
            dst.copy_(tensor)
        filled[target] = filled.get(target, 0) + tensor.shape[0]
    missing = [n for n, p in params.items() if filled.get(n, 0) != p.shape[0]]
    if cfg.tie_word_embeddings:
        missing = [n for n in missing if n != "lm_head.weight"]
    if missing:
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")


def _map_name(name: str, net: LlamaForCausalLM) -> tuple[str | None, tuple[int, int] | None]:
    m = _LAYER_KEY.match(name)
    if m is None:
        if name in ("model.embed_tokens.weight", "model.norm.weight"):
            return name, None
        if name == "lm_head.weight" and not net.config.tie_word_embeddings:
            return name, None
        if re.match(r"^model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight$", name):
            return name, None
        return None, None
    layer, block, module, kind = m.groups()
    if int(layer) >= net.config.num_layers:
        return None, None
    if module in _FUSED:
        fused, part = _FUSED[module]
        lin = getattr(getattr(net.model.layers[int(layer)], block), fused)
        off, size = lin.offsets[part], lin.out_slices[part]
        return f"model.layers.{layer}.{block}.{fused}.{kind}", (off, off + size)
    if module in ("o_proj", "down_proj"):
        return name, None
    return None, None


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index} names shards that are missing: {', '.join(absent)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    return files or sorted(path.glob("pytorch_model*.bin"))


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        if f.suffix == ".safetensors":
            try:
                with safe_open(str(f), framework="pt") as sf:
                    for key in sf.keys():  # noqa: SIM118 - safe_open is not a dict
                        yield key, sf.get_tensor(key)
            except Exception as e:  # safetensors raises its own error types
                raise ValueError(f"cannot read {f}: {e}") from e
        else:
            state = torch.load(f, map_location="cpu", weights_only=True)
            yield from state.items()

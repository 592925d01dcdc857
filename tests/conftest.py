"""Builders for tiny Hugging Face checkpoints and PEFT adapters (no downloads: random weights)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

# NOTE: without a GPU the Triton kernels run in Triton's interpreter, checked against the torch
# references like on the device. Triton reads this once, when it is first imported (peft imports
# it during collection), so it is set here, before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ARCHS = ("llama", "mistral", "qwen2")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` in fp64 (a kernel against its reference); NaN fails."""
    assert not out.isnan().any(), "NaN in the output"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# The dtypes a Triton kernel is checked in, and the relative error each may show against its
# reference. On the GPU fp32 products run as tf32 (two chained in LoRA: 1.5e-3 seen on the
# H200); on the CPU the interpreter's bf16 products are wrong, so fp16 stands in for bf16.
KERNEL_DTYPES = [torch.float32, torch.bfloat16] if torch.cuda.is_available() else [torch.float32, torch.float16]
KERNEL_TOL = {torch.float32: 3e-3 if torch.cuda.is_available() else 1e-4, torch.float16: 3e-3,
              torch.bfloat16: 1.5e-2}


def greedy_with_logprobs(
    llm: Any, prompts: list[list[int]], loras: list[Any], max_tokens: int
) -> list[tuple[list[int], list[float]]]:
    """``(token ids, log-prob of each)`` of greedy generation (EOS ignored) for each prompt, with
    ``loras[i]`` (a ``LoRARequest`` or None) on prompt ``i``: what engine-path tests compare."""
    from coserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1, ignore_eos=True)
    result = []
    for o in llm.generate(prompts, params, lora_request=loras):
        got = o.outputs[0]
        assert got.logprobs is not None
        result.append((got.token_ids, [lp[t] for lp, t in zip(got.logprobs, got.token_ids, strict=True)]))
    return result


def triton_unavailable() -> str | None:
    """Why Triton kernels cannot run here (compiled on a GPU, in Triton's interpreter on the
    CPU), or None; without a GPU it makes sure the interpreter is on."""
    import importlib.metadata
    import importlib.util
    import sys

    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if torch.cuda.is_available():
        return None
    # Triton reads TRITON_INTERPRET when it is imported (coserve imports it at the first launch).
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        return "triton was imported before TRITON_INTERPRET=1 could be set"
    if tuple(int(p) for p in importlib.metadata.version("triton").split(".")[:2]) < (3, 7):
        return "Triton's interpreter before 3.7 breaks on numpy 2 scalars"
    os.environ["TRITON_INTERPRET"] = "1"
    return None


@pytest.fixture(autouse=True)
def _unfreeze_gc() -> Any:
    """Engines freeze what is alive at their start-up out of the garbage collector
    (coserve.gc_freeze); a test suite builds hundreds, so each test gives them back."""
    import gc

    yield
    gc.unfreeze()


def make_hf_model(path: Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random ``transformers`` causal LM of family ``arch`` under ``path``."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.15,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        common["rope_scaling"] = {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        }
        cfg = transformers.LlamaConfig(**{**common, **overrides})
        cls = transformers.LlamaForCausalLM
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**{**common, "sliding_window": 24, **overrides})
        cls = transformers.MistralForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**{**common, "tie_word_embeddings": True, **overrides})
        cls = transformers.Qwen2ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    if arch == "qwen2":  # random biases, so that a wrong bias path cannot pass
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_peft_adapter(
    base_dir: Path, path: Path, targets: list[str], rank: int = 8, alpha: float = 16.0, seed: int = 1
) -> Path:
    """Save a random (non-zero B) PEFT LoRA adapter for the model in ``base_dir``."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():  # make the adapter's effect large enough to change greedy tokens
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {arch: make_hf_model(root / arch, arch) for arch in ARCHS}

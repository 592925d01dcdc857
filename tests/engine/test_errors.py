"""Bad input gets a clear error and never breaks the engine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from coserve import LLM, EngineConfig, InvalidRequestError, LoRARequest, SamplingParams
from coserve.models.loader import load_model
from tests.conftest import make_hf_model, make_peft_adapter


@pytest.fixture(scope="module")
def llm(hf_models: dict[str, Path]) -> LLM:
    return LLM(str(hf_models["llama"]), skip_tokenizer_init=True, max_loras=2, max_lora_rank=8,
               max_model_len=64)


def still_serves(llm: LLM) -> None:
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize(
    "prompt, message",
    [
        (list(range(64)), "context is 64 tokens"),
        ([], "empty"),
        ([1, 2, 10_000], "outside the vocabulary"),
        ([1, -1], "outside the vocabulary"),
        ("text", "no tokenizer"),
    ],
)
def test_bad_prompts(llm: LLM, prompt: object, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate([prompt], SamplingParams(max_tokens=2))  # type: ignore[list-item]
    still_serves(llm)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("inf")}, "finite"),
        ({"temperature": float("nan")}, "finite"),
        ({"seed": 2**64}, "64-bit"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"logprobs": 100}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"min_tokens": 9, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_invalid_sampling_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unknown_adapter_path(llm: LLM, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does_not_exist"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2),
                     lora_request=LoRARequest("x", str(tmp_path / "does_not_exist")))
    still_serves(llm)


def test_adapter_rank_too_large(llm: LLM, hf_models: dict[str, Path], tmp_path: Path) -> None:
    path = make_peft_adapter(hf_models["llama"], tmp_path / "r16", ["q_proj"], rank=16)
    with pytest.raises(ValueError, match="rank"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2), lora_request=LoRARequest("r16", str(path)))
    still_serves(llm)


def test_adapter_for_another_base_model(llm: LLM, tmp_path: Path) -> None:
    other = make_hf_model(tmp_path / "other", "llama", hidden_size=32, intermediate_size=48)
    path = make_peft_adapter(other, tmp_path / "other_adapter", ["q_proj", "v_proj"], rank=4)
    with pytest.raises(ValueError, match="shape"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2), lora_request=LoRARequest("o", str(path)))
    still_serves(llm)


def test_adapter_with_unsupported_target(llm: LLM, hf_models: dict[str, Path], tmp_path: Path) -> None:
    path = make_peft_adapter(hf_models["llama"], tmp_path / "lmhead", ["q_proj", "lm_head"], rank=4)
    with pytest.raises(ValueError, match="lm_head"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2), lora_request=LoRARequest("h", str(path)))
    still_serves(llm)


def test_duplicate_request_id(llm: LLM) -> None:
    llm.engine.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="already in use"):
        llm.engine.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    llm.engine.abort_request("dup")
    assert not llm.engine.has_unfinished_requests()


def test_abort_frees_blocks(llm: LLM) -> None:
    engine = llm.engine
    free = engine.block_manager.num_free_blocks
    engine.add_request("long", list(range(1, 40)), SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    assert engine.block_manager.num_free_blocks < free
    out = engine.abort_request("long")
    assert out is not None and out.outputs[0].finish_reason == "abort"
    assert engine.block_manager.num_free_blocks == free


def test_malformed_model_directories(hf_models: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither a directory nor a built-in preset"):
        load_model(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        load_model(empty)
    bad_json = tmp_path / "bad_json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="invalid JSON"):
        load_model(bad_json)
    missing_field = tmp_path / "missing_field"
    shutil.copytree(hf_models["llama"], missing_field)
    cfg = json.loads((missing_field / "config.json").read_text())
    del cfg["hidden_size"]
    (missing_field / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hidden_size"):
        load_model(missing_field)
    wrong_shape = tmp_path / "wrong_shape"
    shutil.copytree(hf_models["llama"], wrong_shape)
    cfg = json.loads((wrong_shape / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (wrong_shape / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="shape"):
        load_model(wrong_shape)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(hf_models["llama"] / "config.json", no_weights)
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(no_weights, load_format="safetensors")
    unsupported = tmp_path / "unsupported"
    unsupported.mkdir()
    (unsupported / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_model(unsupported)


def test_sharded_checkpoint_loads(hf_models: dict[str, Path], tmp_path: Path) -> None:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_models["qwen2"])
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a = load_model(tmp_path / "sharded")
    b = load_model(hf_models["qwen2"])
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize(
    "kwargs, message",
    [({"block_size": 0}, "block_size"), ({"max_num_seqs": -1}, "max_num_seqs"),
     ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"), ({"device": "tpu"}, "device")],
)
def test_bad_engine_config(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_an_engine_rank_no_linear_can_use_is_refused_before_the_slots_are_allocated() -> None:
    """The tiny preset's largest min(in_features, out_features) is 128: rank 100,000 took 22 GB
    of adapter slots before this check."""
    assert load_model("tiny", num_lora_slots=1, max_lora_rank=128).max_lora_rank == 128
    with pytest.raises(ValueError, match=r"max_lora_rank 129 \(--max-lora-rank.*above 128.*at most 128"):
        load_model("tiny", num_lora_slots=1, max_lora_rank=129)
    assert load_model("tiny", num_lora_slots=0, max_lora_rank=129).num_lora_slots == 0  # (no slot to allocate)


@pytest.mark.parametrize("device", ["cuda", "cuda:7"])
def test_a_cuda_device_this_host_lacks_is_a_clear_error(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not torch's ``AssertionError: Torch not compiled with CUDA enabled`` from the first tensor
    moved there, nor an invalid device ordinal."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=f"--device {device}: .*; use --device cpu"):
        EngineConfig(device=device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"--device cuda:7: this host has 1 CUDA GPU \(cuda:0\)"):
        EngineConfig(device="cuda:7")
    assert EngineConfig(device="cuda:0").device == "cuda:0"
    with pytest.raises(ValueError, match="--device cuda:x: not a device"):
        EngineConfig(device="cuda:x")


def test_unknown_engine_argument() -> None:
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM("tiny", not_a_flag=1)

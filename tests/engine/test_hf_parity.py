"""Parity with Hugging Face transformers + peft: the strongest oracle no one here wrote."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coserve import LLM, LoRARequest, SamplingParams
from coserve.layers.attention import AttentionMetadata
from coserve.models.llama import ForwardContext
from coserve.models.loader import load_model
from tests.conftest import ARCHS, make_peft_adapter

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

PROMPTS = [
    [5, 17, 33, 2, 91, 14, 7],
    [100, 3, 44, 44, 12, 9, 150, 61, 70, 8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 30, 31, 32, 33, 34, 35, 36],
    [42],
    [7, 7, 7, 8, 9, 10, 120, 130, 140, 150, 1, 2, 3],
]
NEW_TOKENS = 12


def hf_model(model_dir: Path, adapter_dir: Path | None = None) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    return model.eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the log-probs of every step (first row = the prefill's last position)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
    return tokens, logprobs


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(arch: str, hf_models: dict[str, Path]) -> None:
    ours = load_model(hf_models[arch])
    ref = hf_model(hf_models[arch])
    prompt = torch.tensor(PROMPTS[1] + PROMPTS[3])  # 41 tokens: beyond the Mistral window
    meta = AttentionMetadata.build([len(prompt)], [0], [[]], [False], 1, 16)
    with torch.no_grad():
        hidden = ours(prompt, torch.arange(len(prompt)), ForwardContext(attn=meta))
        logits = ours.compute_logits(hidden)
        expected = ref(prompt[None]).logits[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["plain", "chunked", "preempt"])
def test_greedy_matches_transformers_with_mixed_adapters(
    arch: str, mode: str, hf_models: dict[str, Path], tmp_path: Path
) -> None:
    base = hf_models[arch]
    a1 = make_peft_adapter(base, tmp_path / "a1", ["q_proj", "v_proj"], rank=8, seed=1)
    a2 = make_peft_adapter(base, tmp_path / "a2", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                    "up_proj", "down_proj"], rank=16, alpha=8, seed=2)
    kwargs: dict = dict(skip_tokenizer_init=True, max_loras=2, max_lora_rank=16, block_size=4)
    if mode == "chunked":
        kwargs["max_num_batched_tokens"] = 5
    if mode == "preempt":
        kwargs["num_kv_blocks"] = 14  # 56 tokens for 4 prompts + 12 new tokens each: forces preemption
    llm = LLM(str(base), **kwargs)
    loras = [LoRARequest("a1", str(a1)), None, LoRARequest("a2", str(a2)), LoRARequest("a1", str(a1))]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=3, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, lora_request=loras)

    refs = {None: hf_model(base), "a1": hf_model(base, a1), "a2": hf_model(base, a2)}
    for prompt, lora, out in zip(PROMPTS, loras, outs, strict=True):
        tokens, logprobs = hf_greedy(refs[lora.name if lora else None], prompt)
        got = out.outputs[0]
        assert got.token_ids == tokens, f"{arch}/{mode} adapter={lora}"
        assert got.finish_reason == "length"
        assert got.logprobs is not None
        for step, lp in enumerate(got.logprobs):
            for tok, value in lp.items():
                assert value == pytest.approx(logprobs[step, tok].item(), abs=2e-4)
    if mode == "preempt":
        assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("mode", ["plain", "chunked", "preempt"])
def test_prompt_logprobs_match_transformers(mode: str, hf_models: dict[str, Path]) -> None:
    """``SamplingParams.prompt_logprobs``: every prompt token's log-probability given the ones
    before it (and the top 3) equal transformers' log-softmax of its logits, also when the prefill
    runs in chunks of 5 tokens or again after a preemption (no position scored twice)."""
    base = hf_models["llama"]
    kwargs: dict = dict(skip_tokenizer_init=True, block_size=4)
    if mode == "chunked":
        kwargs["max_num_batched_tokens"] = 5
    if mode == "preempt":
        kwargs["num_kv_blocks"] = 14
    llm = LLM(str(base), **kwargs)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate(PROMPTS, params)
    ref = hf_model(base)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        with torch.no_grad():
            logp = torch.log_softmax(ref(torch.tensor([prompt])).logits[0].float(), dim=-1)
        for j in range(1, len(prompt)):
            entry = out.prompt_logprobs[j]
            assert entry is not None
            want_top = logp[j - 1].topk(3).indices.tolist()
            assert set(want_top) <= set(entry) and len(entry) in (3, 4)
            for tid, lp in entry.items():
                assert lp == pytest.approx(float(logp[j - 1, tid]), abs=1e-4), (mode, j, tid)
            assert prompt[j] in entry
    if mode == "preempt":
        assert any(o.metrics.num_preemptions > 0 for o in outs), "no preemption: the case is not tested"
    plain = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))[0]
    assert plain.prompt_logprobs is None

"""Step inputs through pinned host memory (``COSERVE_PINNED_INPUTS``): the same tensors, and on
CUDA the same generation, as through plain copies."""

from __future__ import annotations

import pytest
import torch

from coserve import host_copy

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("pinned", [False, True])
def test_copies_equal_plain_ones_and_the_cpu_never_pins(pinned: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_copy, "PINNED_INPUTS", pinned)
    devices = ["cpu"] + (["cuda"] if CUDA else [])
    for device in devices:
        got = host_copy.device_tensor([[3, -1], [5, 7]], torch.int32, device)
        assert got.dtype == torch.int32 and got.device.type == device
        assert torch.equal(got.cpu(), torch.tensor([[3, -1], [5, 7]], dtype=torch.int32))
        moved = host_copy.to_device(torch.arange(5), device)
        assert moved.device.type == device and torch.equal(moved.cpu(), torch.arange(5))
    # on a CPU-only build pinning raises: the CPU path must not pin, whatever the switch says
    assert not host_copy.device_tensor([1], torch.int64, "cpu").is_pinned()


@pytest.mark.skipif(not CUDA, reason="pinned copies are a CUDA path")
def test_pinned_inputs_generate_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked prefills (steps that sample nothing, whose inputs the next step's copies no longer
    wait for) and decodes, eager and from graphs: greedy tokens equal with and without."""
    from coserve import LLM, SamplingParams

    prompts = [[(7 * i + j) % 900 + 10 for j in range(300 + 40 * i)] for i in range(4)]
    outs = []
    for pinned in (False, True):
        monkeypatch.setattr(host_copy, "PINNED_INPUTS", pinned)
        llm = LLM(model="tiny", device="cuda", skip_tokenizer_init=True, max_num_batched_tokens=128,
                  max_model_len=1024, warmup="off", num_kv_blocks=512)  # not sized by free memory: other
        # tests of the same process hold some
        got = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        outs.append([o.outputs[0].token_ids for o in got])
        del llm
    assert outs[0] == outs[1]

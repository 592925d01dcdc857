"""COSERVE_TRAINER_ATTN_BY_HAND: the attention half's token-wise pieces differentiated by hand.

The oracle is the same task through autograd's pieces (``ATTN_BY_HAND`` off): the hand path runs
the same ops in the same order, so the loss and every gradient bit must be the same, and so must
the boundaries and poll points, in fp32 and bf16, for rows of several lengths, with LoRA on some
or all of q/k/v/o (or none of them, a trained MLP's), with the layer input's gradient (layers
above 0) and without it (layer 0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

import coserve.trainer.backward as backward
from coserve.layers import rotary
from coserve.models.llama import LlamaForCausalLM
from coserve.models.loader import load_model
from coserve.models.peft_adapter import LORA_TARGETS
from coserve.trainer import lora_params
from coserve.trainer.backward import TaskRow, task_backward
from coserve.trainer.lora_params import TrainableLoRA, fp32_products
from tests.conftest import ARCHS
from tests.trainer.test_backward import ATTN, QV, assert_close_scaled, perturbed_adapter

MLP = ("gate_proj", "up_proj", "down_proj")
LENS = {"one row": (11,), "three lengths": (5, 13, 2), "same length": (8, 8, 8)}


@pytest.fixture(scope="module")
def models(hf_models: dict[str, Path]) -> dict[tuple[str, torch.dtype], LlamaForCausalLM]:
    return {
        (arch, dtype): load_model(hf_models[arch], num_lora_slots=1, max_lora_rank=16, dtype=dtype)
        for arch in ARCHS for dtype in (torch.float32, torch.bfloat16)
    }


def task(model: LlamaForCausalLM, lens: Sequence[int], seed: int) -> tuple[torch.Tensor, list[TaskRow], torch.Tensor]:
    """A random store (as the engine's capture would leave it), rows at scattered offsets with a
    masked prefix, and a kept gate/up store."""
    cfg = model.config
    dtype = model.lm_head_weight.dtype
    gen = torch.Generator().manual_seed(seed)
    capacity = sum(lens) + 3 * len(lens) + 2
    store = torch.randn((cfg.num_layers + 1, capacity, cfg.hidden_size), generator=gen).to(dtype)
    mlp_store = torch.randn((cfg.num_layers, capacity, 2 * cfg.intermediate_size), generator=gen).to(dtype)
    rows, off = [], 2
    for n in lens:
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
        rows.append(TaskRow(off, tuple([-100] * (n // 3) + ids[n // 3:])))
        off += n + 3
    return store, rows, mlp_store


def run(model: LlamaForCausalLM, lora: TrainableLoRA, store: torch.Tensor, rows: list[TaskRow],
        mlp_store: torch.Tensor | None, by_hand: bool, dropout_key: int | None = None,
        ) -> tuple[float, torch.Tensor, list[int | None], int]:
    """``(loss, ∂loss/∂flat from zero, the boundaries' layers with None for each poll point, the
    autograd Functions of the LoRA linears and of RoPE applied)``."""
    applied = [0]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backward, "ATTN_BY_HAND", by_hand)
        for owner in (lora_params._LoRAGroupLinearFn, rotary._QKVRotaryFn):
            original = owner.apply

            def counted(*a: object, _original: Callable[..., object] = original) -> object:
                applied[0] += 1
                return _original(*a)

            mp.setattr(owner, "apply", counted)
        lora.flat.grad = None
        events: list[int | None] = []
        out = task_backward(model, lora, store, rows, dropout_key=dropout_key, at_layer_boundary=events.append,
                            at_poll_point=lambda: events.append(None), mlp_store=mlp_store)
    assert lora.flat.grad is not None
    return out.loss_sum, lora.flat.grad.clone(), events, applied[0]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lens", list(LENS.values()), ids=list(LENS))
@pytest.mark.parametrize("targets", [ATTN, QV, ("o_proj",), ("k_proj",), ("q_proj", "k_proj", "v_proj")],
                         ids=["qkvo", "qv", "o", "k", "qkv"])
def test_the_hand_path_gives_the_autograd_paths_bits(
    models: dict[tuple[str, torch.dtype], LlamaForCausalLM], arch: str,
    dtype: torch.dtype, lens: tuple[int, ...], targets: tuple[str, ...],
) -> None:
    model = models[(arch, dtype)]
    lora = TrainableLoRA(perturbed_adapter(model, 8, targets, seed=3))
    store, rows, _ = task(model, lens, seed=len(lens) + len(targets))
    loss, grad, events, applied = run(model, lora, store, rows, None, False)
    hand_loss, hand_grad, hand_events, hand_applied = run(model, lora, store, rows, None, True)
    assert applied > 0 and hand_applied == 0  # (the hand path ran: no LoRA linear or RoPE node)
    assert hand_loss == loss
    assert torch.equal(hand_grad, grad)
    assert hand_events == events  # the same boundaries and poll points, in the same order
    # every layer's gradient is there (the comparison is not of zeros), layer 0's too
    assert all(bool(g.ne(0).any()) for g in grad.split(grad.numel() // model.config.num_layers))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("targets", [LORA_TARGETS, ("q_proj", "v_proj", "up_proj"), MLP], ids=["all", "qv+up", "mlp"])
@pytest.mark.parametrize("kept_mlp", [False, True], ids=["recomputed", "kept"])
def test_the_hand_path_beside_a_trained_or_kept_mlp(
    models: dict[tuple[str, torch.dtype], LlamaForCausalLM], dtype: torch.dtype, targets: tuple[str, ...], kept_mlp: bool,
) -> None:
    """A trained MLP keeps autograd; the attention half beside it is by hand (with no attention
    LoRA too: layer 0's then needs no gradient from it at all), the same bits."""
    model = models[("llama", dtype)]
    lora = TrainableLoRA(perturbed_adapter(model, 8, targets, seed=4))
    store, rows, mlp_store = task(model, LENS["three lengths"], seed=9)
    kept = mlp_store if kept_mlp else None
    loss, grad, events, _ = run(model, lora, store, rows, kept, False)
    hand_loss, hand_grad, hand_events, _ = run(model, lora, store, rows, kept, True)
    assert hand_loss == loss
    assert torch.equal(hand_grad, grad)
    assert hand_events == events
    assert bool(grad.ne(0).any())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_hand_path_on_the_device(hf_models: dict[str, Path], dtype: torch.dtype, device: str) -> None:
    """On CUDA the attention's backward (flash or memory-efficient SDPA) need not give the same bits
    twice, so the hand path is held to the autograd path's own spread between two runs, or to
    summation noise (fp32; bf16: its rounding) when that is nil. The loss, a forward, is the same
    bits either way."""
    model = load_model(hf_models["llama"], num_lora_slots=1, max_lora_rank=16, dtype=dtype, device=device)
    lora = TrainableLoRA(perturbed_adapter(model, 8, ATTN, seed=7), device=device)
    store, rows, _ = task(model, LENS["three lengths"], seed=12)
    store = store.to(device)
    (loss, grad, events, _), (_, again, _, _) = (run(model, lora, store, rows, None, False) for _ in range(2))
    hand_loss, hand_grad, hand_events, hand_applied = run(model, lora, store, rows, None, True)
    assert hand_applied == 0 and (hand_loss, hand_events) == (loss, events)
    assert bool(grad.ne(0).any())
    if float((hand_grad - grad).abs().max()) > 2 * float((again - grad).abs().max()):
        # (a bf16 attention backward's order noise flips bf16 roundings: a wrong gradient is O(1) off)
        assert_close_scaled(hand_grad, grad, rtol=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.fixture
def fp32_lora_products(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(lora_params, "LORA_FP32_MM", "1")
    fp32_products.cache_clear()
    yield
    monkeypatch.undo()
    fp32_products.cache_clear()


def test_the_hand_path_with_fp32_lora_products(
    models: dict[tuple[str, torch.dtype], LlamaForCausalLM], fp32_lora_products: None,
) -> None:
    """COSERVE_LORA_FP32_MM=1 (a bf16 model's rank-sized products in fp32): the same bits too."""
    model = models[("llama", torch.bfloat16)]
    lora = TrainableLoRA(perturbed_adapter(model, 8, ATTN, seed=5))
    store, rows, _ = task(model, LENS["three lengths"], seed=10)
    loss, grad, events, _ = run(model, lora, store, rows, None, False)
    hand_loss, hand_grad, hand_events, _ = run(model, lora, store, rows, None, True)
    assert fp32_products("cpu")
    assert (hand_loss, hand_events) == (loss, events)
    assert torch.equal(hand_grad, grad)


def test_dropout_keeps_autograd(models: dict[tuple[str, torch.dtype], LlamaForCausalLM]) -> None:
    """LoRA dropout is not done by hand: its layers take autograd's pieces with the switch on."""
    model = models[("llama", torch.float32)]
    lora = TrainableLoRA(perturbed_adapter(model, 8, ATTN, seed=6), dropout=0.2, seed=1)
    store, rows, _ = task(model, LENS["three lengths"], seed=11)
    loss, grad, events, _ = run(model, lora, store, rows, None, False, dropout_key=5)
    hand_loss, hand_grad, hand_events, _ = run(model, lora, store, rows, None, True, dropout_key=5)
    assert (hand_loss, hand_events) == (loss, events)
    assert torch.equal(hand_grad, grad)
    assert not backward._by_hand(model.model.layers[0], lora.context(5, [3]))  # type: ignore[arg-type]
    assert backward._by_hand(model.model.layers[0], lora.context(None, [3]))  # type: ignore[arg-type]

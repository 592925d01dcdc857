"""The LoRA path's rank-sized products in fp32 under a small MPS share (COSERVE_LORA_FP32_MM):
cuBLAS's bf16 [T, 4096] @ [4096, 16] returned non-finite values from finite inputs at 20–30%
shares on the H200 (session 11). The switch, the share rule, and that the fp32 products give the
step the bf16 products give, within bf16 rounding."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from coserve.core.finetune import FTSample
from coserve.models.loader import load_model
from coserve.models.peft_adapter import new_lora_adapter
from coserve.trainer import lora_params, mps
from coserve.trainer.lora_params import TrainableLoRA, fp32_products, lora_mm
from coserve.trainer.split import train_step


@pytest.fixture
def fresh_rule() -> Iterator[None]:
    fp32_products.cache_clear()
    yield
    fp32_products.cache_clear()


def test_share_of_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mps, "mps_active", lambda: True)
    for value, want in (("20", 20), ("30.0", 30), ("100", None), ("0", None), ("", None), ("x", None)):
        monkeypatch.setenv(mps.MPS_SHARE_ENV, value)
        assert mps.share_of_this_process() == want, value
    monkeypatch.delenv(mps.MPS_SHARE_ENV)
    assert mps.share_of_this_process() is None
    monkeypatch.setenv(mps.MPS_SHARE_ENV, "20")
    monkeypatch.setattr(mps, "mps_active", lambda: False)  # no daemon: the variable does nothing
    assert mps.share_of_this_process() is None


def test_auto_rule_is_cuda_under_a_share(monkeypatch: pytest.MonkeyPatch, fresh_rule: None) -> None:
    monkeypatch.setattr(lora_params, "share_of_this_process", lambda: 20)
    assert fp32_products("cuda") and not fp32_products("cpu")
    fp32_products.cache_clear()
    monkeypatch.setattr(lora_params, "share_of_this_process", lambda: 40)
    assert fp32_products("cuda")
    fp32_products.cache_clear()
    monkeypatch.setattr(lora_params, "share_of_this_process", lambda: 50)  # where the fault was not seen
    assert not fp32_products("cuda")
    fp32_products.cache_clear()
    monkeypatch.setattr(lora_params, "share_of_this_process", lambda: None)
    assert not fp32_products("cuda")
    fp32_products.cache_clear()
    monkeypatch.setattr(lora_params, "LORA_FP32_MM", "1")
    assert fp32_products("cpu")
    fp32_products.cache_clear()
    monkeypatch.setattr(lora_params, "LORA_FP32_MM", "0")
    monkeypatch.setattr(lora_params, "share_of_this_process", lambda: 20)
    assert not fp32_products("cuda")


class _MatmulDtypes(TorchDispatchMode):
    """The input dtypes of every mm/addmm dispatched, with the rank-sized dimension's size."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, torch.dtype, tuple[int, ...], tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm"):
            a, b = args[-2], args[-1]
            self.seen.append((name, a.dtype, tuple(a.shape), tuple(b.shape)))
        return func(*args, **(kwargs or {}))


def _step(model, adapter, batch) -> tuple[float, torch.Tensor, list]:  # type: ignore[no-untyped-def]
    lora = TrainableLoRA(adapter)
    seen = _MatmulDtypes()
    with seen:
        step = train_step(model, lora, batch)
    assert lora.flat.grad is not None
    return step.loss_sum, lora.flat.grad.clone(), seen.seen


def test_fp32_products_match_bf16_products(monkeypatch: pytest.MonkeyPatch, fresh_rule: None) -> None:
    model = load_model("tiny", dtype=torch.bfloat16, num_lora_slots=1, max_lora_rank=8)
    cfg = model.config
    adapter = new_lora_adapter(num_layers=cfg.num_layers, shapes=cfg.linear_shapes(), rank=5, alpha=10,
                               target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), seed=0)
    gen = torch.Generator().manual_seed(1)
    adapter = type(adapter)(**{**adapter.__dict__, "weights": {
        k: (a, torch.randn(b.shape, generator=gen) * 0.05) for k, (a, b) in adapter.weights.items()}})
    rng = random.Random(0)
    batch = []
    for i in range(3):
        ids = tuple(rng.randrange(10, 1000) for _ in range(rng.randint(8, 24)))
        batch.append(FTSample(i, ids, ids))
    monkeypatch.setattr(lora_params, "LORA_FP32_MM", "0")
    loss16, grad16, seen16 = _step(model, adapter, batch)
    fp32_products.cache_clear()
    monkeypatch.setattr(lora_params, "LORA_FP32_MM", "1")
    loss32, grad32, seen32 = _step(model, adapter, batch)
    rank = 5  # (no other matmul dimension of the tiny model or this batch is 5 or 15)
    ranked = [s for s in seen32 if rank in s[2] + s[3] or 3 * rank in s[2] + s[3]]
    assert ranked and all(dtype == torch.float32 for _, dtype, _, _ in ranked)
    assert all(dtype == torch.bfloat16 for _, dtype, _, _ in seen16)
    assert any(dtype == torch.bfloat16 for _, dtype, _, _ in seen32)  # the base GEMMs stay bf16
    assert loss32 == pytest.approx(loss16, rel=1e-2)
    assert ((grad32 - grad16).norm() / grad16.norm()).item() < 5e-2
    x = torch.randn(37, 64, dtype=torch.bfloat16)
    b = torch.randn(64, 8, dtype=torch.bfloat16)
    assert torch.equal(lora_mm(x, b), (x.float() @ b.float()).bfloat16())

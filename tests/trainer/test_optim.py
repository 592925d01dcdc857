"""AdamW on the flat master: schedules against transformers, steps against torch.optim.AdamW over
separate tensors (as a peft loop has them), skipping, and exact state export/import."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from coserve.core.config import OptimConfig
from coserve.models.peft_adapter import new_lora_adapter
from coserve.trainer.lora_params import TrainableLoRA
from coserve.trainer.optim import LoRAOptimizer, StepResult, lr_lambda

transformers = pytest.importorskip("transformers")

SHAPES = {"q_proj": (12, 10), "v_proj": (6, 10), "down_proj": (10, 20)}
HF_NAMES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def make_lora(seed: int = 0) -> TrainableLoRA:
    adapter = new_lora_adapter(
        num_layers=2, shapes=SHAPES, rank=4, alpha=8.0, target_modules=list(SHAPES), seed=seed
    )
    lora = TrainableLoRA(adapter)
    with torch.no_grad():  # B != 0, like an adapter that has been trained for a while
        lora.flat.add_(torch.randn(lora.numel, generator=torch.Generator().manual_seed(seed)) * 0.1)
    return lora


def fake_grad(flat: torch.Tensor, step: int, num_targets: int) -> torch.Tensor:
    """An un-normalized gradient that depends on the weights and the step (a quadratic pull plus
    step-dependent noise), summed over ``num_targets`` tokens."""
    noise = torch.randn(flat.shape, generator=torch.Generator().manual_seed(1000 + step))
    return (flat.detach() * 0.5 + noise) * num_targets


def run(opt: LoRAOptimizer, steps: range, num_targets: int = 7) -> list[StepResult]:
    out = []
    for step in steps:
        opt.lora.flat.grad = fake_grad(opt.lora.flat, step, num_targets)
        out.append(opt.step(num_targets, loss_sum=3.0 * num_targets))
    return out


@pytest.mark.parametrize("name", ["constant", "linear", "cosine"])
@pytest.mark.parametrize(("warmup", "total"), [(0, 10), (3, 10), (4, 4), (6, 3), (1, 1)])
def test_lr_lambda_equals_transformers_schedules(name: str, warmup: int, total: int) -> None:
    cfg = OptimConfig(lr=3e-4, lr_scheduler=name, warmup_steps=warmup, total_steps=total)
    ours = torch.optim.lr_scheduler.LambdaLR(
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.lr), lr_lambda(cfg)
    )
    hf_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.lr)
    hf = transformers.get_scheduler(
        HF_NAMES[name], hf_opt, num_warmup_steps=warmup, num_training_steps=total
    )
    for _ in range(total):  # (past the total, transformers' cosine rises again: the next test)
        assert ours.get_last_lr() == hf.get_last_lr()
        ours.optimizer.step()
        hf_opt.step()
        ours.step()
        hf.step()


@pytest.mark.parametrize("name", ["linear", "cosine"])
@pytest.mark.parametrize(("warmup", "total"), [(0, 10), (3, 10), (4, 4), (6, 3), (1, 1)])
def test_decaying_schedules_stay_at_zero_past_the_total(name: str, warmup: int, total: int) -> None:
    """A run can take more optimizer steps than its estimated total: the learning rate stays at 0
    there (transformers' cosine climbs back to the full rate at 2 · total - warmup, and restarts
    at 1 after a warmup that ends at or past the total)."""
    f = lr_lambda(OptimConfig(lr_scheduler=name, warmup_steps=warmup, total_steps=total))
    end = max(warmup, total)
    assert [f(s) for s in range(end, end + 2 * total + 5)] == [0.0] * (2 * total + 5)
    after_warmup = [f(s) for s in range(warmup, 3 * total + warmup)]
    assert after_warmup == sorted(after_warmup, reverse=True)


def test_lr_lambda_constant_without_warmup_and_decay_without_total() -> None:
    f = lr_lambda(OptimConfig())
    assert [f(s) for s in (0, 1, 10**6)] == [1.0, 1.0, 1.0]
    for name in ("linear", "cosine"):
        with pytest.raises(ValueError, match="total step"):
            lr_lambda(OptimConfig(lr_scheduler=name, warmup_steps=2))


@pytest.mark.parametrize("max_grad_norm", [0.0, 5.0, 1e3])
def test_step_equals_adamw_over_separate_tensors(max_grad_norm: float) -> None:
    cfg = OptimConfig(
        lr=1e-2,
        betas=(0.8, 0.95),
        eps=1e-7,
        weight_decay=0.1,
        lr_scheduler="cosine",
        warmup_steps=2,
        total_steps=6,
        max_grad_norm=max_grad_norm,
    )
    lora = make_lora()
    opt = LoRAOptimizer(lora, cfg)
    # The reference: one tensor per A and B, as peft's trainable parameters are.
    sizes = [
        t.numel()
        for layer in range(lora.num_layers)
        for target in lora.target_modules
        for t in (lora.a(layer, target), lora.b(layer, target))
    ]
    params = [p.clone().requires_grad_(True) for p in lora.flat.detach().split(sizes)]
    ref = torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    sched = transformers.get_scheduler("cosine", ref, num_warmup_steps=2, num_training_steps=6)
    clipped = 0
    for step in range(6):
        flat_ref = torch.cat([p.detach() for p in params])
        grad = fake_grad(flat_ref, step, 1)
        for p, g in zip(params, grad.split(sizes), strict=True):
            p.grad = g.clone()
        norm = float(torch.linalg.vector_norm(grad))
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        lr = sched.get_last_lr()[0]
        ref.step()
        sched.step()

        lora.flat.grad = fake_grad(lora.flat, step, 5)
        result = opt.step(5, loss_sum=2.0)
        assert not result.skipped and result.lr == lr
        assert result.grad_norm == pytest.approx(norm, rel=1e-5)
        clipped += max_grad_norm > 0 and norm > max_grad_norm
        torch.testing.assert_close(
            lora.flat.detach(), torch.cat([p.detach() for p in params]), rtol=1e-5, atol=1e-6
        )
        assert lora.flat.grad is not None and not lora.flat.grad.any()
    assert opt.step_count == 6
    assert clipped == (6 if max_grad_norm == 5.0 else 0)


@pytest.mark.parametrize("bad", ["loss", "grad", "no_targets"])
def test_non_finite_step_is_skipped_without_side_effects(bad: str) -> None:
    cfg = OptimConfig(lr=1e-2, lr_scheduler="linear", warmup_steps=1, total_steps=5)
    clean, faulty = LoRAOptimizer(make_lora(), cfg), LoRAOptimizer(make_lora(), cfg)
    run(clean, range(3))
    run(faulty, range(2))
    before, lr = faulty.lora.flat.detach().clone(), faulty.lr
    faulty.lora.flat.grad = fake_grad(faulty.lora.flat, 99, 7)
    if bad == "grad":
        faulty.lora.flat.grad[3] = float("inf")
    loss = float("nan") if bad == "loss" else 1.0
    result = faulty.step(0 if bad == "no_targets" else 7, loss)
    assert result.skipped and result.lr == lr
    assert torch.equal(faulty.lora.flat, before) and faulty.lr == lr and faulty.step_count == 2
    assert faulty.lora.flat.grad is not None and not faulty.lora.flat.grad.any()
    run(faulty, range(2, 3))
    assert torch.equal(faulty.lora.flat, clean.lora.flat)


@pytest.mark.parametrize("split", [0, 1, 3])
def test_export_import_continues_bit_identically(split: int) -> None:
    cfg = OptimConfig(
        lr=5e-3,
        weight_decay=0.05,
        lr_scheduler="cosine",
        warmup_steps=2,
        total_steps=8,
        max_grad_norm=20.0,
    )
    full = LoRAOptimizer(make_lora(), cfg)
    expected = run(full, range(8))

    first = LoRAOptimizer(make_lora(), cfg)
    got = run(first, range(split))
    state = torch.full((3, first.lora.numel), float("nan"))
    first.export_state(state)
    if split == 0:
        assert not state[1:].any()

    resumed = LoRAOptimizer(make_lora(seed=5), dataclasses.replace(cfg))
    resumed.import_state(state.clone(), first.step_count)
    assert resumed.step_count == split and resumed.lr == first.lr
    got += run(resumed, range(split, 8))
    assert got == expected
    assert torch.equal(resumed.lora.flat, full.lora.flat)
    a, b = torch.empty(3, full.lora.numel), torch.empty(3, full.lora.numel)
    full.export_state(a)
    resumed.export_state(b)
    assert torch.equal(a, b)


def test_state_buffers_are_shape_checked() -> None:
    opt = LoRAOptimizer(make_lora(), OptimConfig())
    with pytest.raises(ValueError, match=r"\[3, "):
        opt.export_state(torch.empty(2, opt.lora.numel))
    with pytest.raises(ValueError, match=r"\[3, "):
        opt.import_state(torch.empty(3, opt.lora.numel + 1), 0)

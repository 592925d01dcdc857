"""The split baseline's trainer: its full-autograd step equals the co-serving trainer's layer-wise
recompute backward on the same samples, and the process trains, counts and stops cleanly."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

from coserve.core.config import OptimConfig
from coserve.core.finetune import FTSample
from coserve.layers.attention import AttentionMetadata
from coserve.models.llama import ForwardContext
from coserve.models.loader import load_model
from coserve.models.peft_adapter import new_lora_adapter
from coserve.trainer.backward import TaskRow, task_backward
from coserve.trainer.lora_params import TrainableLoRA
from coserve.trainer.split import SplitTrainer, split_batches, train_step

TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")


def samples(n: int, lo: int, hi: int, vocab: int = 1024, seed: int = 0) -> list[FTSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = tuple(rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi)))
        labels = (-100,) * (len(ids) // 4) + ids[len(ids) // 4 :]
        out.append(FTSample(i, ids, labels))
    return out


def adapter_with_b(model, seed: int = 0):  # type: ignore[no-untyped-def]
    """A random adapter with B != 0, so that A gets a gradient too."""
    cfg = model.config
    adapter = new_lora_adapter(
        num_layers=cfg.num_layers,
        shapes=cfg.linear_shapes(),
        rank=4,
        alpha=8,
        target_modules=TARGETS,
        seed=seed,
    )
    gen = torch.Generator().manual_seed(seed + 1)
    weights = {
        k: (a, torch.randn(b.shape, generator=gen) * 0.05) for k, (a, b) in adapter.weights.items()
    }
    return replace(adapter, weights=weights)


def test_train_step_equals_layerwise_recompute_backward() -> None:
    model = load_model("tiny", num_lora_slots=1, max_lora_rank=8)
    batch = samples(3, 6, 20)
    lora = TrainableLoRA(adapter_with_b(model))
    full = train_step(model, lora, batch)
    assert lora.flat.grad is not None
    grad_full = lora.flat.grad.clone()
    lora.flat.grad.zero_()

    # The co-serving path: capture every layer input in a no-grad forward, then recompute.
    num_layers = model.config.num_layers
    lens = [s.num_tokens for s in batch]
    store = torch.zeros(num_layers + 1, sum(lens), model.config.hidden_size)
    meta = AttentionMetadata.build(
        q_lens=lens,
        context_lens=[0] * 3,
        block_tables=[[]] * 3,
        writes_kv=[False] * 3,
        num_prefill_rows=3,
        block_size=1,
    )
    ctx = ForwardContext(
        attn=meta, lora=lora.context(None, lens), layer_hook=lambda i, h: store[i].copy_(h)
    )
    with torch.no_grad():
        model(
            torch.tensor([t for s in batch for t in s.input_ids]),
            torch.cat([torch.arange(n) for n in lens]),
            ctx,
        )
    offsets = [sum(lens[:i]) for i in range(3)]
    recompute = task_backward(
        model, lora, store, [TaskRow(o, s.labels) for o, s in zip(offsets, batch, strict=True)]
    )

    assert full.num_targets == recompute.num_targets == sum(s.num_target_tokens for s in batch)
    assert full.loss_sum == pytest.approx(recompute.loss_sum, rel=1e-5)
    # (gradients up to ~8 here: float32 sums in another order differ by a few 1e-6 on some CPUs)
    torch.testing.assert_close(grad_full, lora.flat.grad, rtol=1e-4, atol=1e-5)
    assert grad_full.abs().sum() > 0


def test_split_batches_close_at_backward_tokens_and_cycle_epochs() -> None:
    pool = samples(5, 10, 10)
    it = split_batches(pool, 25, seed=3)
    batches = [next(it) for _ in range(4)]
    assert [sum(s.num_tokens for s in b) for b in batches] == [30, 30, 30, 30]
    first_epoch = [s.sample_id for b in batches for s in b][:5]
    assert sorted(first_epoch) == list(range(5))


def test_split_trainer_process_trains_counts_and_stops() -> None:
    model = load_model("tiny", num_lora_slots=1, max_lora_rank=8)
    cfg = model.config
    adapter = new_lora_adapter(
        num_layers=cfg.num_layers,
        shapes=cfg.linear_shapes(),
        rank=4,
        alpha=8,
        target_modules=TARGETS,
        seed=0,
    )
    trainer = SplitTrainer(
        model,
        adapter,
        samples(16, 8, 24),
        backward_tokens=48,
        optim=OptimConfig(lr=1e-2),
        num_threads=1,
        mps_percentage=50,
    )
    try:
        assert trainer.mps_share is None  # CPU: no MPS share applies
        assert trainer.wait_steps(3, timeout=60.0), "no optimizer step within 60 s"
        assert trainer.tokens_trained >= 3 * 48
        assert trainer.last_loss is not None and trainer.last_loss > 0
        trained = trainer.adapter()
        # B starts at zero: every completed step moves it.
        assert any(trained.weights[k][1].abs().sum() > 0 for k in trained.weights)
        assert all(
            torch.equal(adapter.weights[k][1], torch.zeros_like(adapter.weights[k][1]))
            for k in adapter.weights
        )
        before = trainer.tokens_trained
        assert trainer.wait_steps(trainer.steps_done + 1, timeout=30.0)
        assert trainer.tokens_trained > before
    finally:
        trainer.close()
    assert not trainer.alive() and trainer.exitcode == 0


class _StopAfter:
    """A stop flag that reads set from its ``n``-th look on (the worker looks once per step)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def is_set(self) -> bool:
        self.n -= 1
        return self.n < 0


def test_split_worker_accumulates_grad_accum_batches_per_optimizer_step() -> None:
    import queue

    from coserve.trainer.optim import LoRAOptimizer
    from coserve.trainer.split import SplitSpec, run_split_worker

    model = load_model("tiny", num_lora_slots=1, max_lora_rank=8)
    adapter = adapter_with_b(model)
    data = samples(12, 8, 24)
    optim = OptimConfig(lr=1e-2, accumulation_tasks=3)
    flat = TrainableLoRA(adapter).flat.detach().clone()
    spec = SplitSpec(model, adapter, tuple(data), 40, optim, 0.0, 0, 1, flat,
                     torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.float64),
                     _StopAfter(1), "cpu")
    run_split_worker(spec, queue.Queue())

    ref = TrainableLoRA(adapter)
    opt = LoRAOptimizer(ref, optim)
    batches = split_batches(data, 40, 0)
    loss, targets, tokens = 0.0, 0, 0
    for i in range(3):
        batch = next(batches)
        res = train_step(model, ref, batch, dropout_key=i)
        loss, targets = loss + res.loss_sum, targets + res.num_targets
        tokens += sum(s.num_tokens for s in batch)
    opt.step(targets, loss)
    assert spec.counters.tolist() == [tokens, 1]
    assert spec.loss[0].item() == pytest.approx(loss / targets)
    torch.testing.assert_close(spec.flat, ref.flat.detach(), rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen flash attention runs on CUDA")
@pytest.mark.parametrize("impl", ["flash", "flash_fn", "torch"])
def test_train_step_on_cuda_bf16_matches_fp32_reference(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The split baseline's full-autograd step in bf16 on the GPU (its rows through the varlen
    attention ``impl``) against the same step in fp32 (per-row SDPA): a finite loss near the
    reference's and a gradient along it (session 10's split run logged NaN losses and gradients
    at the ``flash`` default)."""
    from coserve.layers import varlen_attention

    monkeypatch.setattr(varlen_attention, "VARLEN_ATTN", impl)
    varlen_attention.varlen_impl.cache_clear()
    try:
        if varlen_attention.varlen_impl() is None or varlen_attention.varlen_impl()[0] != impl:
            pytest.skip(f"{impl}: not available on torch {torch.__version__}")
        batch = samples(6, 40, 300, seed=7)
        results = []
        for dtype in (torch.float32, torch.bfloat16):
            model = load_model("tiny", dtype=dtype, device="cuda", num_lora_slots=1, max_lora_rank=8)
            lora = TrainableLoRA(adapter_with_b(model), device="cuda")
            step = train_step(model, lora, batch)
            assert lora.flat.grad is not None
            results.append((step.loss_sum, lora.flat.grad.double().clone()))
        (ref_loss, ref_grad), (loss, grad) = results
        assert math.isfinite(loss) and bool(grad.isfinite().all()), f"{impl}: loss {loss}, gradient finite {bool(grad.isfinite().all())}"
        assert loss == pytest.approx(ref_loss, rel=2e-2)
        assert ((grad - ref_grad).norm() / ref_grad.norm()).item() < 5e-2
    finally:
        varlen_attention.varlen_impl.cache_clear()


def test_split_worker_stops_after_max_skipped_steps_with_a_clear_error() -> None:
    """A model whose loss is NaN: the worker skips ``max_skipped_steps`` optimizer steps, then
    fails saying why, instead of training nothing until the run's timeout (session 10)."""
    import queue

    from coserve.trainer.split import SplitSpec, run_split_worker

    model = load_model("tiny", num_lora_slots=1, max_lora_rank=8)
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    adapter = adapter_with_b(model)
    optim = OptimConfig(lr=1e-2, max_skipped_steps=3)
    flat = TrainableLoRA(adapter).flat.detach().clone()
    counters = torch.zeros(2, dtype=torch.int64)
    spec = SplitSpec(model, adapter, tuple(samples(12, 8, 24)), 40, optim, 0.0, 0, 1, flat,
                     counters, torch.zeros(1, dtype=torch.float64), _StopAfter(10), "cpu")
    errors: queue.Queue = queue.Queue()
    with pytest.raises(RuntimeError, match="3 optimizer steps in a row had a non-finite loss"):
        run_split_worker(spec, errors)
    assert "non-finite" in errors.get_nowait().error
    assert counters.tolist() == [0, 0]  # nothing counted as trained


def test_weight_faults_names_changed_and_non_finite_weights() -> None:
    from coserve.trainer.split import tensor_sums, weight_faults

    model = load_model("tiny", num_lora_slots=1, max_lora_rank=8)
    sums = tensor_sums(model)
    assert weight_faults(model, sums) == []
    layers = model.model.layers
    with torch.no_grad():  # the engine may write adapters into its slots meanwhile: not a fault
        layers[0].self_attn.qkv_proj.lora_a_all.add_(1.0)
    assert weight_faults(model, sums) == []
    with torch.no_grad():
        layers[0].mlp.down_proj.weight[0, 0] += 1.0
        layers[1].self_attn.qkv_proj.weight[3, 2] = float("nan")
    faults = weight_faults(model, sums)
    assert len(faults) == 2
    assert faults[0].startswith("model.layers.0.mlp.down_proj.weight sum")
    assert faults[1] == "model.layers.1.self_attn.qkv_proj.weight not finite"
    # without the producer's sums only the non-finite one is a fault
    assert weight_faults(model, None) == ["model.layers.1.self_attn.qkv_proj.weight not finite"]


def test_rerun_nonfinite_names_the_first_bad_layer_input_and_leaves_no_gradient() -> None:
    from coserve.trainer.split import rerun_nonfinite

    model = load_model("tiny", num_lora_slots=1, max_lora_rank=8)
    lora = TrainableLoRA(adapter_with_b(model))
    batch = samples(2, 6, 12)
    clean = rerun_nonfinite(model, lora, batch)
    assert "first non-finite layer input None, first non-finite op None" in clean
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.fill_(float("inf"))
    report = rerun_nonfinite(model, lora, batch)
    assert report.startswith("rerun loss nan") and "first non-finite layer input 2," in report
    # the inf weight times finite activations: a matmul of layer 1's MLP, its weight input non-finite
    assert "first non-finite op aten." in report and "an input already non-finite" in report
    assert lora.flat.grad is None or not bool(lora.flat.grad.any())


def test_split_worker_stop_names_weights_that_differ_from_the_engines(caplog: pytest.LogCaptureFixture) -> None:
    """A worker whose view of the weights went wrong (here: set to inf after the engine's sums)
    stops after max_skipped_steps with the faulty tensors in its error, and logs the rerun."""
    import queue

    from coserve.trainer.split import SplitSpec, run_split_worker, tensor_sums

    model = load_model("tiny", num_lora_slots=1, max_lora_rank=8)
    adapter = adapter_with_b(model)
    sums = tensor_sums(model)
    with torch.no_grad():
        model.model.layers[2].mlp.gate_up_proj.weight.fill_(float("inf"))
    optim = OptimConfig(lr=1e-2, accumulation_tasks=1, max_skipped_steps=2)
    flat = TrainableLoRA(adapter).flat.detach().clone()
    spec = SplitSpec(model, adapter, tuple(samples(6, 8, 16)), 20, optim, 0.0, 0, 1, flat,
                     torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.float64),
                     _StopAfter(10), "cpu", sums)
    errors: queue.Queue[object] = queue.Queue()
    with pytest.raises(RuntimeError, match="2 optimizer steps in a row") as err:
        run_split_worker(spec, errors)
    assert "model.layers.2.mlp.gate_up_proj.weight not finite" in str(err.value)
    assert "first non-finite layer input 3" in caplog.text and "weights as the engine's: NO (1)" in caplog.text
    assert not errors.empty()
    assert int(spec.counters[1]) == 0


def test_first_non_finite_op_skips_views_of_a_buffer_being_filled() -> None:
    """Autograd splits a fresh (garbage) buffer into views and fills them: the split is no
    culprit (it was named in a clean run when the garbage held a NaN); an op writing a non-finite
    value still is."""
    from coserve.trainer.split import FirstNonFiniteOp

    garbage = torch.full((4, 6), float("nan"))
    op = FirstNonFiniteOp()
    with op:
        left, right = garbage.split([2, 4], dim=1)
        left.copy_(torch.ones(4, 2))
        right.copy_(torch.zeros(4, 4))
        total = garbage.sum()
    assert op.report is None and bool(total.isfinite())
    with op:
        (garbage * float("inf")).sum()
    assert op.report is not None and op.report.startswith("aten.mul on [(4, 6)]")

"""The loss chunk's fused cross-entropy kernel (``trainer.triton_loss``) against an fp64 reference,
and the loss chunk and a task's backward with it (``COSERVE_LOSS_FUSED_CE``) against the torch
chain. Without a GPU the kernel runs in Triton's interpreter (which rounds fp32 to bf16 by
truncation: up to one bf16 ulp more error on the CPU)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import triton_unavailable

CUDA = torch.cuda.is_available()
_SKIP = triton_unavailable()
if _SKIP is not None:
    pytest.skip(_SKIP, allow_module_level=True)

import coserve.trainer.backward as backward  # noqa: E402
from coserve.models.loader import load_model  # noqa: E402
from coserve.trainer import triton_loss  # noqa: E402
from coserve.trainer.backward import task_backward  # noqa: E402
from coserve.trainer.lora_params import TrainableLoRA  # noqa: E402
from tests.trainer.test_backward import (  # noqa: E402
    QV,
    assert_close_scaled,
    capture_task,
    one_loss_chunk,
    perturbed_adapter,
    random_samples,
)

DEVICE = torch.device("cuda" if CUDA else "cpu")
# the gradient rounded once to the dtype (two ulps: the interpreter truncates), against fp64
GRAD_ULPS = {torch.float32: 2.0**-22, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


@pytest.fixture
def on_cpu() -> Iterator[None]:
    """Let the loss dispatch to the kernel (on CPU: in the interpreter)."""
    saved = triton_loss.ON_CPU
    triton_loss.ON_CPU = True
    yield
    triton_loss.ON_CPU = saved


def reference(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's ``logsumexp − logit[target]``, ``softmax − onehot``), in fp64."""
    x = logits.double()
    lse = torch.logsumexp(x, dim=1)
    rows = torch.arange(x.shape[0], device=x.device)
    grad = torch.softmax(x, dim=1)
    grad[rows, targets] -= 1.0
    return lse - x[rows, targets], grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 100), (5, 2048), (37, 5000), (3, 4097)])
def test_the_kernel_matches_fp64(dtype: torch.dtype, rows: int, vocab: int) -> None:
    """Vocabularies below one block, of exactly one, and over several with a part-full last block;
    the targets at both ends of the row among them; a row stride wider than the vocabulary."""
    gen = torch.Generator().manual_seed(rows * vocab)
    wide = (torch.randn(rows, vocab + 16, generator=gen) * 6).to(DEVICE, dtype)
    logits = wide[:, :vocab]
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[0] = vocab - 1
    if rows > 1:
        targets[1] = 0
    targets = targets.to(DEVICE)
    want_loss, want_grad = reference(logits, targets)
    p = torch.softmax(logits.double(), dim=1)
    tail = wide[:, vocab:].clone()
    row_loss = torch.full((rows,), float("nan"), device=DEVICE)
    triton_loss.cross_entropy_grad_(logits, targets, row_loss)
    torch.testing.assert_close(row_loss.double(), want_loss, rtol=1e-5, atol=1e-5)
    err = (logits.double() - want_grad).abs()
    # each element within two ulps of its own magnitude (rounded once, truncated in the
    # interpreter), plus fp32's error in exp(x − lse) (lse's rounding: ~|lse|·2⁻²⁴ relative) and
    # in p − 1 at the target (an ulp of 1), and the dtype's subnormal spacing
    onehot = torch.zeros_like(p)
    onehot[torch.arange(rows, device=DEVICE), targets] = 1.0
    info = torch.finfo(dtype)
    bound = 2 * GRAD_ULPS[dtype] * want_grad.abs() + 1e-5 * p + 2.0**-22 * onehot + 2 * info.tiny * info.eps
    assert (err <= bound).all(), (err - bound).max()
    assert torch.equal(wide[:, vocab:], tail), "wrote past the row's vocabulary"


def test_rows_of_one_large_logit_and_an_empty_chunk() -> None:
    """A row whose softmax is one-hot at its target (loss 0, gradient 0) and one where it is
    one-hot elsewhere (loss = the margin); no rows: nothing launched."""
    logits = torch.zeros(2, 3000, device=DEVICE)
    logits[0, 7] = 80.0
    logits[1, 2999] = 50.0
    targets = torch.tensor([7, 0], device=DEVICE)
    row_loss = torch.empty(2, device=DEVICE)
    triton_loss.cross_entropy_grad_(logits, targets, row_loss)
    torch.testing.assert_close(row_loss.cpu(), torch.tensor([0.0, 50.0]), atol=1e-4, rtol=1e-6)
    assert logits[0].abs().max() < 1e-6
    torch.testing.assert_close(logits[1, [0, 2999]].cpu(), torch.tensor([-1.0, 1.0]))
    triton_loss.cross_entropy_grad_(torch.empty(0, 5, device=DEVICE), torch.empty(0, dtype=torch.long, device=DEVICE),
                                    torch.empty(0, device=DEVICE))


def test_usable_on_the_cpu_only_when_asked() -> None:
    assert not triton_loss.usable(torch.device("cpu")) or triton_loss.ON_CPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_loss_chunk_fused_matches_the_torch_chain(hf_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                                    on_cpu: None, dtype: torch.dtype) -> None:
    """``_split_loss_chunk`` with LOSS_FUSED_CE: the loss and the gradient pulled back into the
    chunk's input as the torch chain gives them, to the dtype's rounding, through the same
    boundaries; no fp32 buffer allocated."""
    if not backward.LOSS_WORKSPACE:
        pytest.skip("the fused cross-entropy is the workspace loss's (the default)")
    model = load_model(hf_models["llama"], num_lora_slots=1, max_lora_rank=16, dtype=dtype, device=DEVICE)
    gen = torch.Generator().manual_seed(3)
    vocab, hidden = model.lm_head_weight.shape
    final = (torch.randn(9, hidden, generator=gen) * 4).to(DEVICE, dtype)
    targets = torch.randint(0, vocab, (9,), generator=gen).to(DEVICE)
    got = {}
    for fused in (False, True):
        monkeypatch.setattr(backward, "LOSS_FUSED_CE", fused)
        for name in ("_key", "_low", "_f32"):
            monkeypatch.setattr(backward._LossWorkspace, name, None)
        got[fused] = one_loss_chunk(model, final, targets)
    assert backward._LossWorkspace._f32 is None and backward._LossWorkspace._low is not None
    assert got[True][2] == got[False][2]
    torch.testing.assert_close(got[True][0], got[False][0], rtol=1e-5, atol=0)
    grad, want = got[True][1], got[False][1]
    assert grad is not None and want is not None
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert ((grad.double() - want.double()).norm() / want.double().norm()).item() < tol


def test_task_backward_fused_matches_the_torch_chain(hf_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                                     on_cpu: None) -> None:
    """A whole task's loss and LoRA gradient with LOSS_FUSED_CE as with the torch chain (fp32
    model), in several loss chunks."""
    model = load_model(hf_models["llama"], num_lora_slots=2, max_lora_rank=16, dtype=torch.float32)
    samples = random_samples(4, seed=11)
    lora = TrainableLoRA(perturbed_adapter(model, 8, QV, seed=12))
    store, rows = capture_task(model, lora, samples)
    monkeypatch.setattr(backward, "LOSS_CHUNK", 8)
    results = {}
    for fused in (False, True):
        monkeypatch.setattr(backward, "LOSS_FUSED_CE", fused)
        lora.flat.grad = None
        loss = task_backward(model, lora, store, rows)
        results[fused] = (loss, lora.flat.grad.clone())
    assert results[True][0].num_targets == results[False][0].num_targets
    assert results[True][0].loss_sum == pytest.approx(results[False][0].loss_sum, rel=1e-5)
    assert_close_scaled(results[True][1], results[False][1], rtol=1e-4)


def test_a_kernel_that_fails_leaves_the_torch_chain(hf_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                                    on_cpu: None, caplog: pytest.LogCaptureFixture) -> None:
    """A kernel that raises (it cannot compile on this GPU, say): the chunk's loss and gradient
    are the torch chain's bit for bit, one warning says so, and the kernel is not tried again."""
    model = load_model(hf_models["llama"], num_lora_slots=1, max_lora_rank=16, dtype=torch.float32, device=DEVICE)
    gen = torch.Generator().manual_seed(5)
    vocab, hidden = model.lm_head_weight.shape
    final = (torch.randn(6, hidden, generator=gen) * 4).to(DEVICE)
    targets = torch.randint(0, vocab, (6,), generator=gen).to(DEVICE)
    monkeypatch.setattr(triton_loss, "_failed", None)
    monkeypatch.setattr(backward, "LOSS_FUSED_CE", False)
    want = one_loss_chunk(model, final, targets)
    calls = []

    def broken(*args: object) -> None:
        calls.append(1)
        raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(backward, "LOSS_FUSED_CE", True)
    monkeypatch.setattr(triton_loss, "cross_entropy_grad_", broken)
    for _ in range(2):
        got = one_loss_chunk(model, final, targets)
        assert torch.equal(got[0], want[0]) and got[1] is not None and torch.equal(got[1], want[1])
        assert got[2] == want[2]
    assert len(calls) == 1 and not triton_loss.usable(DEVICE)
    assert [r.levelname for r in caplog.records if "no kernel for this GPU" in r.getMessage()] == ["WARNING"]

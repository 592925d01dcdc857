"""The hand-written backwards of the trainer's layer recompute (RMSNorm, RoPE, SwiGLU, the
LoRA linear) give the gradients that autograd gives through the reference ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from coserve.layers import triton_fused
from coserve.layers.activation import silu_and_mul
from coserve.layers.norm import RMSNorm
from coserve.layers.rotary import RotaryEmbedding, _apply
from coserve.models.config import RopeConfig
from coserve.models.peft_adapter import new_lora_adapter
from coserve.trainer.lora_params import TrainableLoRA

# The fused kernels run on the GPU where there is one; without one, on CPU tensors in Triton's
# interpreter (tests/conftest.py sets TRITON_INTERPRET=1 then, and ``ON_CPU`` lets the ops take
# them). With a GPU the interpreter is off, so CPU tensors would only ever see the torch path.
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def _grads(fn, *inputs: torch.Tensor) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    inputs = tuple(t.detach().clone().requires_grad_(True) for t in inputs)
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(7)
    torch.autograd.backward(outs, [torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device) for o in outs])
    return [t.grad for t in inputs]


def _close(got: list[torch.Tensor], ref: list[torch.Tensor], tol: float) -> None:
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == r.dtype
        torch.testing.assert_close(g, r, rtol=tol, atol=tol)


def test_rms_norm_backward_equals_autograd(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(triton_fused, "ENABLED", False)
    norm = RMSNorm(48, 1e-6)
    norm.weight.data.normal_(1.0, 0.3)
    x = torch.randn(9, 48) * 2
    _close(_grads(norm, x), _grads(norm._reference, x), 1e-5)
    # bf16 activations, fp32 statistics: within bf16 rounding of the reference
    xb = x.to(torch.bfloat16)
    normb = RMSNorm(48, 1e-6, torch.bfloat16)
    normb.weight.data.copy_(norm.weight.data)
    _close(_grads(normb, xb), _grads(normb._reference, xb), 2e-2)


def test_rotary_backward_equals_autograd(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(triton_fused, "ENABLED", False)
    rope = RotaryEmbedding(16, 128, RopeConfig())
    pos = torch.tensor([0, 5, 1, 2, 9, 3, 100])
    q, k = torch.randn(7, 4, 16), torch.randn(7, 2, 16)

    def ref(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope.cos_cache[pos].unsqueeze(1), rope.sin_cache[pos].unsqueeze(1)
        return _apply(q, cos, sin), _apply(k, cos, sin)

    _close(_grads(lambda q, k: rope(pos, q, k), q, k), _grads(ref, q, k), 1e-5)


def test_silu_and_mul_backward_equals_autograd(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(triton_fused, "ENABLED", False)
    x = torch.randn(5, 2 * 24) * 3

    def ref(x: torch.Tensor) -> torch.Tensor:
        return F.silu(x[:, :24]) * x[:, 24:]

    _close(_grads(silu_and_mul, x), _grads(ref, x), 1e-5)


def test_lora_linear_backward_equals_autograd() -> None:
    """The one-node linear (base + LoRA of the trained targets among q/k/v, k untrained) against
    the per-target formula through autograd: input and A/B gradients, in ``flat.grad``."""
    shapes = {"q_proj": (16, 16), "k_proj": (8, 16), "v_proj": (8, 16), "o_proj": (16, 16)}  # (out, in)
    adapter = new_lora_adapter(num_layers=2, shapes=shapes, rank=4, alpha=8,
                               target_modules=("q_proj", "v_proj"), seed=0)
    gen = torch.Generator().manual_seed(1)
    weights = {k: (a, torch.randn(b.shape, generator=gen) * 0.1) for k, (a, b) in adapter.weights.items()}
    adapter = type(adapter)(**{**adapter.__dict__, "weights": weights})
    out_slices = {"q_proj": 16, "k_proj": 8, "v_proj": 8}
    w, bias = torch.randn(32, 16), torch.randn(32)
    x = torch.randn(6, 16)
    dy = torch.randn(6, 32)

    got = TrainableLoRA(adapter)
    xg = x.clone().requires_grad_(True)
    y = got.context().linear(1, out_slices, xg, w, bias)
    y.backward(dy)

    ref = TrainableLoRA(adapter)
    xr = x.clone().requires_grad_(True)
    yr = F.linear(xr, w, bias)
    a_q, b_q, a_v, b_v = ref.a(1, "q_proj"), ref.b(1, "q_proj"), ref.a(1, "v_proj"), ref.b(1, "v_proj")
    s = ref.scaling
    yr = yr + torch.cat([(xr @ a_q.T) @ b_q.T * s, torch.zeros(6, 8), (xr @ a_v.T) @ b_v.T * s], dim=1)
    yr.backward(dy)

    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xg.grad, xr.grad, rtol=1e-5, atol=1e-6)
    assert got.flat.grad is not None and ref.flat.grad is not None
    torch.testing.assert_close(got.flat.grad, ref.flat.grad, rtol=1e-5, atol=1e-6)
    # layer 0 untouched, and a second backward accumulates in place
    assert not got.flat.grad[: got._layer_spans[1][0]].any()
    before = got.flat.grad.clone()
    got.context().linear(1, out_slices, x, w, bias).backward(dy)
    torch.testing.assert_close(got.flat.grad, 2 * before)


def test_fused_forwards_and_rope_kernel_backward_match_the_references(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """With the fused kernels on (on the GPU, or in Triton's interpreter without one), the ops'
    forwards run the kernels, RoPE's backward runs the kernel with −sin, and RMSNorm and SwiGLU
    run their backward kernels: same gradients as the torch path."""
    calls: list[str] = []
    for name in ("rms_norm", "rotary", "silu_and_mul", "rms_norm_backward", "silu_and_mul_backward"):
        kernel = getattr(triton_fused, name)
        monkeypatch.setattr(triton_fused, name, lambda *a, _n=name, _k=kernel, **kw: (calls.append(_n), _k(*a, **kw))[1])
    rope = RotaryEmbedding(16, 64, RopeConfig()).to(DEVICE)
    norm = RMSNorm(32, 1e-6)
    norm.weight.data.normal_(1.0, 0.3)
    norm = norm.to(DEVICE)
    pos = torch.tensor([3, 0, 7, 1, 2], device=DEVICE)
    q, k, x, gu = (t.to(DEVICE) for t in (torch.randn(5, 2, 16), torch.randn(5, 1, 16), torch.randn(5, 32),
                                          torch.randn(5, 48)))
    refs = []
    for enabled in (False, True):
        monkeypatch.setattr(triton_fused, "ENABLED", enabled)
        monkeypatch.setattr(triton_fused, "ON_CPU", enabled)
        refs.append((_grads(lambda q, k: rope(pos, q, k), q, k), _grads(norm, x), _grads(silu_and_mul, gu)))
    assert sorted(set(calls)) == ["rms_norm", "rms_norm_backward", "rotary", "silu_and_mul",
                                  "silu_and_mul_backward"]
    assert calls.count("rotary") == 2
    for got, ref in zip(refs[1], refs[0], strict=True):
        _close(got, ref, 1e-5)


def test_backward_kernels_in_bf16_and_strided(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The backward kernels (on the GPU where there is one) on bf16 rows with row strides wider than
    the rows, against the fp32 torch formulas."""
    from coserve.layers.activation import silu_and_mul_backward
    from coserve.layers.norm import rms_norm_backward

    monkeypatch.setattr(triton_fused, "ENABLED", True)
    monkeypatch.setattr(triton_fused, "ON_CPU", True)
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(7, 40 + 8, generator=gen) * 2).to(DEVICE, torch.bfloat16)[:, :40]
    g = torch.randn(7, 20 + 4, generator=gen).to(DEVICE, torch.bfloat16)[:, :20]
    got = silu_and_mul_backward(x, g)
    monkeypatch.setattr(triton_fused, "ENABLED", False)
    ref = silu_and_mul_backward(x.float(), g.float())
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)

    norm = RMSNorm(40, 1e-6, torch.bfloat16)
    norm.weight.data.normal_(1.0, 0.3, generator=gen)
    norm = norm.to(DEVICE)
    gn = torch.randn(7, 40 + 8, generator=gen).to(DEVICE, torch.bfloat16)[:, :40]
    ref_norm = RMSNorm(40, 1e-6).to(DEVICE)
    ref_norm.weight.data.copy_(norm.weight.data.float())
    ref_n = rms_norm_backward(x.float(), ref_norm, gn.float())
    monkeypatch.setattr(triton_fused, "ENABLED", True)
    got_n = rms_norm_backward(x, norm, gn)
    assert got_n.dtype == torch.bfloat16
    torch.testing.assert_close(got_n.float(), ref_n, rtol=2e-2, atol=2e-2)

"""The fused elementwise kernels (``layers.triton_fused``) against fp32 torch references, their
dispatch, and a tiny model run with and without them.

Without a GPU the kernels run in Triton's interpreter; ``triton_fused.ON_CPU`` lets the layers
dispatch to them there. NOTE: the interpreter converts fp32 to bf16 by truncation, not
round-to-nearest-even like the GPU, so on CPU the bf16 cases show up to one bf16 ulp more error
and the bf16 residual sum is not checked bit for bit.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import triton_unavailable

CUDA = torch.cuda.is_available()
_SKIP = triton_unavailable()
if _SKIP is not None:
    pytest.skip(_SKIP, allow_module_level=True)

from coserve import LLM, SamplingParams  # noqa: E402
from coserve.layers import triton_fused  # noqa: E402
from coserve.layers.activation import silu_and_mul  # noqa: E402
from coserve.layers.attention import AttentionMetadata  # noqa: E402
from coserve.layers.norm import RMSNorm  # noqa: E402
from coserve.layers.rotary import RotaryEmbedding  # noqa: E402
from coserve.models.config import RopeConfig  # noqa: E402
from coserve.models.llama import ForwardContext, LlamaForCausalLM  # noqa: E402
from coserve.models.loader import load_model  # noqa: E402
from tests.conftest import ARCHS  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# ‖out − ref‖ / ‖ref‖ bounds against a float64 reference on the same (rounded) inputs: a few
# roundings to the output dtype (the reference's own rounding points), plus one bf16 ulp of
# truncation in the interpreter.
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 8e-3 if CUDA else 1.5e-2}
ROWS = (1, 37, 70)  # one decode row; row counts that fill no power-of-two block


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in the output (an element left unwritten?)"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


@pytest.fixture
def fused() -> Iterator[None]:
    """Let the layers dispatch to the kernels (on CPU: in the interpreter)."""
    saved = triton_fused.ENABLED, triton_fused.ON_CPU
    triton_fused.ENABLED, triton_fused.ON_CPU = True, True
    yield
    triton_fused.ENABLED, triton_fused.ON_CPU = saved


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("d", [64, 96, 1000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, rows: int, d: int, with_residual: bool) -> None:
    eps = 1e-5
    # Row strides wider than d: the kernel must take them from the tensor, not assume d.
    x = (torch.randn(rows, d + 8, dtype=dtype, device=DEVICE) * 3)[:, :d]
    residual = torch.randn(rows, d, dtype=dtype, device=DEVICE) * 2
    weight = (1 + 0.2 * torch.randn(d, device=DEVICE)).to(dtype)
    out = poisoned((rows, d), dtype)
    hidden = poisoned((rows, d), dtype) if with_residual else None
    triton_fused.rms_norm(out, x, weight, eps, residual if with_residual else None, hidden)

    h = x
    if with_residual:
        assert hidden is not None
        h = residual + x
        if dtype != torch.bfloat16 or CUDA:
            assert torch.equal(hidden, h), "the residual stream must be the reference sum"
        else:
            assert rel_err(hidden, h) < TOL[dtype]
    hd = h.double()
    ref = weight.double() * hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + eps)
    assert out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.usefixtures("fused")
def test_rms_norm_module_dispatch_and_mixed_weight_dtype() -> None:
    """The module's fused path matches its torch path; an fp32 weight promotes like torch."""
    norm = RMSNorm(96, 1e-6, torch.float32).to(DEVICE)
    norm.weight.data.normal_(1.0, 0.2)
    x = torch.randn(2, 5, 96, dtype=torch.float16, device=DEVICE)
    r = torch.randn(2, 5, 96, dtype=torch.float16, device=DEVICE)
    with torch.no_grad():
        got = norm.add_and_norm(x, r)
        plain = norm(x)
    ref = norm._reference(r + x)
    assert got.normed.dtype == ref.dtype == torch.float32 and got.normed.shape == ref.shape
    assert torch.equal(got.hidden, r + x)
    assert rel_err(got.normed, ref) < TOL[torch.float16]
    assert rel_err(plain, norm._reference(x)) < TOL[torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (5, 3, 96), (8, 1, 64)])
@pytest.mark.parametrize("in_place", [False, True])
def test_rotary(dtype: torch.dtype, rows: int, heads: int, kv_heads: int, head_dim: int,
                in_place: bool) -> None:
    rope = RopeConfig(theta=500000.0, kind="llama3", factor=8.0, original_max_position=64)
    rotary = RotaryEmbedding(head_dim, 512, rope).to(DEVICE)
    # q and k as the attention layer makes them: strided views of one fused qkv projection.
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=DEVICE)
    q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    positions = torch.randint(0, 512, (rows,), device=DEVICE)
    q_in, k_in = q.double(), k.double()
    if in_place:
        q_out, k_out = q, k
    else:
        q_out, k_out = poisoned(tuple(q.shape), dtype), poisoned(tuple(k.shape), dtype)
    triton_fused.rotary(q_out, k_out, q, k, positions, rotary.cos_cache, rotary.sin_cache)

    cos = rotary.cos_cache[positions].double()[:, None]
    sin = rotary.sin_cache[positions].double()[:, None]
    half = head_dim // 2
    for out, x in ((q_out, q_in), (k_out, k_in)):
        ref = x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
        assert rel_err(out, ref) < TOL[dtype]
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before), "v must be untouched"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("d", [56, 96, 1500])
def test_silu_and_mul(dtype: torch.dtype, rows: int, d: int) -> None:
    x = (torch.randn(rows, 2 * d + 4, dtype=dtype, device=DEVICE) * 3)[:, : 2 * d]
    out = poisoned((rows, d), dtype)
    triton_fused.silu_and_mul(out, x)
    g, u = x[:, :d].double(), x[:, d:].double()
    assert rel_err(out, g / (1 + torch.exp(-g)) * u) < TOL[dtype]


@pytest.mark.usefixtures("fused")
def test_layers_dispatch_to_the_kernels_only_without_autograd(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = torch.randn(6, 2, 32, device=DEVICE)
    w = torch.randn(2, 32, device=DEVICE, requires_grad=True)
    with torch.no_grad():
        assert triton_fused.use_fused_kernels(x, w)
    assert triton_fused.use_fused_kernels(x)  # nothing to differentiate
    assert not triton_fused.use_fused_kernels(x, w)  # grad mode and an input that requires grad
    with torch.inference_mode():
        assert triton_fused.use_fused_kernels(x, w)
    monkeypatch.setattr(triton_fused, "ENABLED", False)
    assert not triton_fused.use_fused_kernels(x)
    monkeypatch.setattr(triton_fused, "ENABLED", True)
    if not CUDA:
        monkeypatch.setattr(triton_fused, "ON_CPU", False)
        assert not triton_fused.use_fused_kernels(x), "CPU takes the kernels only when told to"

    # Under autograd the forward still takes the kernels (the ops' hand-written backwards need
    # no graph of their insides), and RoPE's backward is the kernel again with -sin.
    calls: list[str] = []
    for name in ("rms_norm", "rotary", "silu_and_mul"):
        monkeypatch.setattr(triton_fused, name, lambda *a, _n=name: calls.append(_n))
    monkeypatch.setattr(triton_fused, "ON_CPU", True)
    norm = RMSNorm(32, 1e-6).to(DEVICE)
    rotary = RotaryEmbedding(16, 64, RopeConfig()).to(DEVICE)
    x = torch.randn(6, 32, device=DEVICE, requires_grad=True)
    hidden, normed = norm.add_and_norm(x, torch.randn(6, 32, device=DEVICE))
    q, k = rotary(torch.arange(6, device=DEVICE), normed.view(6, 2, 16), hidden.view(6, 2, 16))
    silu_and_mul(torch.cat([q, k], dim=-1).view(6, 64)).sum().backward()
    assert calls == ["rms_norm", "rotary", "silu_and_mul", "rotary"] and x.grad is not None
    calls.clear()
    with torch.no_grad():
        norm.add_and_norm(x, x)
        rotary(torch.arange(6, device=DEVICE), x.view(6, 2, 16), x.view(6, 2, 16))
        silu_and_mul(x)
    assert calls == ["rms_norm", "rotary", "silu_and_mul"]


def _count_launches(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count the launches of each fused kernel from now on (the kernels still run)."""
    counts = {"rms_norm": 0, "rotary": 0, "silu_and_mul": 0}
    for name in counts:
        launch = getattr(triton_fused, name)

        def counted(*args: object, _name: str = name, _launch: object = launch) -> None:
            counts[_name] += 1
            _launch(*args)  # type: ignore[operator]

        monkeypatch.setattr(triton_fused, name, counted)
    monkeypatch.setattr(triton_fused, "ENABLED", True)
    monkeypatch.setattr(triton_fused, "ON_CPU", True)
    return counts


def _forward(
    model: LlamaForCausalLM, prompt: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    seen: list[torch.Tensor] = []
    meta = AttentionMetadata.build([len(prompt)], [0], [[]], [False], 1, 16, device=DEVICE)
    ctx = ForwardContext(attn=meta, layer_hook=lambda i, h: seen.append(h.clone()))
    with torch.inference_mode():
        logits = model.compute_logits(model(prompt, torch.arange(len(prompt), device=DEVICE), ctx))
    return logits, seen


@pytest.mark.parametrize("arch", ARCHS)
def test_model_forward_and_layer_contract(
    arch: str, hf_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fused logits and the residual stream seen by the layer hook (every ``h_l``, not a partial
    sum) match the reference path; ``DecoderLayer.forward`` still returns ``h_{l+1}``."""
    model = load_model(hf_models[arch], device=str(DEVICE))
    prompt = torch.randint(0, model.config.vocab_size, (29,), device=DEVICE)
    monkeypatch.setattr(triton_fused, "ENABLED", False)  # the reference path, on a GPU too
    ref_logits, ref_seen = _forward(model, prompt)
    counts = _count_launches(monkeypatch)
    logits, seen = _forward(model, prompt)
    layers = model.config.num_layers
    # One norm per layer input (fused with the previous layer's MLP add), one after attention.
    assert counts == {"rms_norm": 2 * layers + 1, "rotary": layers, "silu_and_mul": layers}
    assert len(seen) == len(ref_seen) == model.config.num_layers + 1
    for h, ref in zip(seen, ref_seen, strict=True):
        assert rel_err(h, ref) < 1e-5
    assert rel_err(logits, ref_logits) < 1e-5
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))

    meta = AttentionMetadata.build([len(prompt)], [0], [[]], [False], 1, 16, device=DEVICE)
    positions = torch.arange(len(prompt), device=DEVICE)
    with torch.no_grad():
        out = model.model.layers[1](ref_seen[1], positions, model.rotary, ForwardContext(attn=meta))
    assert rel_err(out, ref_seen[2]) < 1e-5


def test_engine_greedy_tokens_and_logprobs_match(
    hf_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two engines, the second with the fused kernels (on a GPU also inside its CUDA graphs)."""
    prompts = [[5, 17, 33, 2, 91, 14, 7], [100, 3, 44, 44, 12, 9, 150, 61, 70, 8, 1], [42]]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)
    monkeypatch.setattr(triton_fused, "ENABLED", False)
    llm = LLM(str(hf_models["llama"]), skip_tokenizer_init=True, block_size=4, num_kv_blocks=64)
    ref = llm.generate(prompts, params)
    del llm
    counts = _count_launches(monkeypatch)
    llm = LLM(str(hf_models["llama"]), skip_tokenizer_init=True, block_size=4, num_kv_blocks=64)
    got = llm.generate(prompts, params)
    assert min(counts.values()) > 0
    # On the GPU the Triton attention kernels multiply fp32 operands as tf32: q/k one fp32 ulp
    # off the reference's (the fused kernels sum in another order) now and then fall on the other
    # side of a tf32 rounding, and that step's log-probs move by up to ~1e-4 (6.3e-5 seen on the
    # H200, one step of 24; 2e-6 at most with TRITON_F32_DEFAULT=ieee). The interpreter's dots are
    # fp32. Most log-probs still agree to 1e-5, so a systematic error cannot hide in the bound.
    tol = 3e-4 if CUDA else 1e-5
    diffs: list[float] = []
    for a, b in zip(got, ref, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs is not None and b.outputs[0].logprobs is not None
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert step_a.keys() == step_b.keys()
            for tok, value in step_a.items():
                assert value == pytest.approx(step_b[tok], abs=tol)
                diffs.append(abs(value - step_b[tok]))
    assert statistics.median(diffs) <= 1e-5

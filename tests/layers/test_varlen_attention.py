"""The trainer's recompute attention in one varlen flash call (CUDA) against per-row SDPA: the
same output and the same gradients for q, k and v, through each implementation
(``COSERVE_VARLEN_ATTN``: aten's flash op with its own derivative, the same two aten ops in the
trainer's autograd function, torch's varlen custom op)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from coserve.layers import varlen_attention
from coserve.layers.attention import AttentionMetadata, TorchAttention, _plain_rows
from coserve.layers.varlen_attention import (
    VARLEN_IMPLS,
    _flash_ops,
    _native_backward,
    _schema_fits,
    _torch_varlen_attn,
    varlen_fits,
    varlen_impl,
)
from tests.conftest import rel_err

CUDA = torch.cuda.is_available()


def test_torch_varlen_attention_is_called_causal() -> None:
    attn = _torch_varlen_attn()
    if attn is None:
        pytest.skip("this torch has no usable torch.nn.attention.varlen")
    assert attn.keywords.get("window_size") == (-1, 0) or attn.keywords.get("is_causal") is True


def test_only_half_precision_cuda_rows_take_the_varlen_call() -> None:
    assert not varlen_fits(torch.zeros(4, 2, 64, dtype=torch.bfloat16))  # CPU
    if CUDA and varlen_impl() is not None:
        assert varlen_fits(torch.zeros(4, 2, 128, dtype=torch.bfloat16, device="cuda"))
        assert not varlen_fits(torch.zeros(4, 2, 128, dtype=torch.float32, device="cuda"))
        assert not varlen_fits(torch.zeros(4, 2, 260, dtype=torch.float16, device="cuda"))


def test_flash_signature_check_takes_this_torch_and_refuses_other_signatures() -> None:
    # the op schemas exist in CPU builds too (without kernels): the check itself runs everywhere
    assert _flash_ops() is not None, f"torch {torch.__version__}: aten flash signatures changed"
    fwd = torch.ops.aten._flash_attention_forward.default
    assert _schema_fits(fwd, varlen_attention._FWD_ARGS, 5)

    class Op:
        def __init__(self, schema: str) -> None:
            self._schema = torch._C.parse_schema(schema)

    head = ("Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q, Tensor? cum_seq_k, SymInt max_q, "
            "SymInt max_k, float dropout_p, bool is_causal")
    outs = "(Tensor a, Tensor b, Tensor c, Tensor d, Tensor e)"
    # torch 2.1's form: accepted
    assert _schema_fits(Op(f"aten::f({head}, bool return_debug_mask, *, float? scale=None) -> {outs}"),
                        varlen_attention._FWD_ARGS, 5)
    # one more positional argument, a required keyword, no scale, a return fewer: refused
    bad = [f"aten::f({head}, bool return_debug_mask, bool extra, *, float? scale=None) -> {outs}",
           f"aten::f({head}, bool return_debug_mask, *, float? scale=None, int window) -> {outs}",
           f"aten::f({head}, bool return_debug_mask) -> {outs}",
           f"aten::f({head}, bool return_debug_mask, *, float? scale=None) -> (Tensor a, Tensor b, Tensor c, Tensor d)",
           f"aten::f({head}, float return_debug_mask, *, float? scale=None) -> {outs}"]
    for schema in bad:
        assert not _schema_fits(Op(schema), varlen_attention._FWD_ARGS, 5), schema


def test_flash_forward_differentiates_itself_on_this_torch() -> None:
    assert _native_backward(), f"torch {torch.__version__}: no derivative for aten._flash_attention_forward"
    assert VARLEN_IMPLS["flash"]() is not None


def test_switch_values() -> None:
    assert VARLEN_IMPLS["0"]() is None
    assert set(VARLEN_IMPLS) >= {"flash", "flash_fn", "torch", "0", "1"}
    env = {**os.environ, "COSERVE_VARLEN_ATTN": "bogus", "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-c", "import coserve.layers.varlen_attention"], env=env,
                         capture_output=True, text=True)
    assert run.returncode != 0 and "COSERVE_VARLEN_ATTN='bogus'" in run.stderr


def _rows(lens: list[int], heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int
          ) -> tuple[torch.Tensor, ...]:
    t = sum(lens)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(t, h, dim, device="cuda", dtype=dtype, generator=gen) for h in (heads, kv_heads, kv_heads))
    grad_out = torch.randn(t, heads, dim, device="cuda", dtype=dtype, generator=gen)
    return q, k, v, grad_out


def _forward_backward(fn, q0, k0, v0, grad_out):  # type: ignore[no-untyped-def]
    q, k, v = (x.clone().requires_grad_(True) for x in (q0, k0, v0))
    o = fn(q, k, v)
    o.backward(grad_out)
    return o.float(), [x.grad.float() for x in (q, k, v)]


IMPLS = ["flash", "flash_fn", "torch"]


@pytest.mark.skipif(not CUDA, reason="varlen flash attention runs on CUDA")
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 4])
def test_varlen_impl_equals_per_row_sdpa_forward_and_backward(impl: str, dtype: torch.dtype, group: int) -> None:
    picked = VARLEN_IMPLS[impl]()
    if picked is None or picked[0] != impl:
        pytest.skip(f"{impl}: not available on torch {torch.__version__}")
    attend = picked[1]
    rng = random.Random(group)
    lens = [1] + [rng.randint(2, 300) for _ in range(5)] + [257, 257, 1, 64]  # ragged, equal runs, one-token rows
    heads, dim, scale = 8, 128, 128**-0.5
    q0, k0, v0, grad_out = _rows(lens, heads, heads // group, dim, dtype, seed=group)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    out, grads = _forward_backward(lambda q, k, v: attend(q, k, v, cu, max(lens), scale), q0, k0, v0, grad_out)
    # the reference: one fp32 SDPA call per run of equal-length rows
    ref_out, ref_grads = _forward_backward(
        lambda q, k, v: _plain_rows(q.float(), k.float(), v.float(), lens, scale, group), q0, k0, v0, grad_out.float())
    assert rel_err(out, ref_out) < 1e-2
    for got, ref in zip(grads, ref_grads, strict=True):
        assert rel_err(got, ref) < 2e-2
    with torch.no_grad():  # the forward alone (no autograd node) gives the same output
        assert torch.equal(attend(q0, k0, v0, cu, max(lens), scale).float(), out)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not CUDA, reason="varlen flash attention runs on CUDA")
@pytest.mark.parametrize("impl", ["flash", "flash_fn"])
def test_flash_dispatches_one_op_each_way(impl: str) -> None:
    """The host cost the flash paths exist for: no ``zeros``/``empty`` or K/V head repeats beside
    the flash op, forward (GQA) and backward."""
    picked = VARLEN_IMPLS[impl]()
    if picked is None or picked[0] != impl:
        pytest.skip(f"{impl}: not available on torch {torch.__version__}")
    lens = [100, 37, 1]
    q0, k0, v0, grad_out = _rows(lens, 8, 2, 128, torch.bfloat16, seed=3)
    cu = torch.tensor([0, 100, 137, 138], dtype=torch.int32, device="cuda")
    q, k, v = (x.clone().requires_grad_(True) for x in (q0, k0, v0))
    with _Ops() as fwd:
        o = picked[1](q, k, v, cu, 100, 0.1)
    with _Ops() as bwd:
        o.backward(grad_out)
    # (autograd's own detach of saved and leaf tensors aside)
    assert fwd.ops["_flash_attention_forward"] == 1 and set(fwd.ops) <= {"_flash_attention_forward", "detach"}
    assert bwd.ops["_flash_attention_backward"] == 1 and set(bwd.ops) <= {"_flash_attention_backward", "detach"}


@pytest.mark.skipif(not CUDA, reason="varlen flash attention runs on CUDA")
@pytest.mark.parametrize("group", [1, 4])
def test_backend_rows_equal_per_row_calls_forward_and_backward(group: int) -> None:
    """Through :class:`TorchAttention` (the implementation ``COSERVE_VARLEN_ATTN`` picks)."""
    if varlen_impl() is None:
        pytest.skip("no varlen implementation on this torch (or COSERVE_VARLEN_ATTN=0)")
    rng = random.Random(group)
    lens = [rng.randint(1, 300) for _ in range(6)] + [257, 257]  # ragged, one run of equal rows
    heads, dim = 8, 128
    q0, k0, v0, grad_out = _rows(lens, heads, heads // group, dim, torch.bfloat16, seed=0)
    meta = AttentionMetadata.build(q_lens=lens, context_lens=[0] * len(lens), block_tables=[[] for _ in lens],
                                   writes_kv=[False] * len(lens), num_prefill_rows=len(lens), block_size=1,
                                   device="cuda")
    out, grads = _forward_backward(lambda q, k, v: TorchAttention().forward(q, k, v, None, meta, dim**-0.5, None),
                                   q0, k0, v0, grad_out)
    ref_out, ref_grads = _forward_backward(lambda q, k, v: _plain_rows(q, k, v, lens, dim**-0.5, group),
                                           q0, k0, v0, grad_out)
    assert rel_err(out, ref_out) < 1e-2
    for got, ref in zip(grads, ref_grads, strict=True):
        assert rel_err(got, ref) < 2e-2

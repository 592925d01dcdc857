"""The trainer recompute's fewer-op paths give the very values of the per-op paths they replace:
q/k/v split + RoPE in one node (with RoPE tables gathered once per task), the LoRA linear over
its own leaf of ``flat``, the row dropout masks drawn per row and tested once."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from coserve.layers import triton_fused
from coserve.layers.lora import dropout_mask, row_dropout_key
from coserve.layers.rotary import RotaryEmbedding, split_heads
from coserve.models.config import RopeConfig
from coserve.models.peft_adapter import new_lora_adapter
from coserve.trainer.lora_params import TrainableLoRA
from tests.conftest import triton_unavailable

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
HEADS = (4, 2, 16)  # H, KVH, D


def _old_split_qkv(rope: RotaryEmbedding, pos: torch.Tensor, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What ``Attention.project`` did before ``split_qkv``: split, reshapes, ``rope(pos, q, k)``."""
    h, kvh, d = HEADS
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k = rope(pos, q.reshape(-1, h, d), k.reshape(-1, kvh, d))
    return q, k, v.reshape(-1, kvh, d)


def _run(fn, qkv: torch.Tensor, grads: list[torch.Tensor | None]) -> tuple[list[torch.Tensor], torch.Tensor]:  # type: ignore[no-untyped-def]
    x = qkv.detach().clone().requires_grad_(True)
    outs = fn(x)
    used = [(o, g) for o, g in zip(outs, grads, strict=True) if g is not None]
    torch.autograd.backward([o for o, _ in used], [g for _, g in used])
    assert x.grad is not None
    return [o.detach() for o in outs], x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_tables", [False, True])
@pytest.mark.parametrize("unused", [None, 0, 1, 2])  # an output whose gradient never comes
def test_split_qkv_equals_split_reshape_rotary_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, with_tables: bool, unused: int | None
) -> None:
    monkeypatch.setattr(triton_fused, "ENABLED", False)
    rope = RotaryEmbedding(HEADS[2], 128, RopeConfig())
    gen = torch.Generator().manual_seed(0)
    pos = torch.tensor([0, 5, 1, 2, 9, 3, 100])
    width = (HEADS[0] + 2 * HEADS[1]) * HEADS[2]
    qkv = torch.randn(7, width, generator=gen).to(dtype)
    shapes = [(7, HEADS[0], HEADS[2]), (7, HEADS[1], HEADS[2]), (7, HEADS[1], HEADS[2])]
    grads: list[torch.Tensor | None] = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    if unused is not None:
        grads[unused] = None
    tables = rope.tables(pos) if with_tables else None
    got, dgot = _run(lambda x: rope.split_qkv(pos, x, HEADS, tables), qkv, grads)
    ref, dref = _run(lambda x: _old_split_qkv(rope, pos, x), qkv, grads)
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == r.dtype and torch.equal(g, r)
    assert dgot.dtype == dref.dtype and torch.equal(dgot, dref)
    # without autograd: the engine's ops
    with torch.no_grad():
        for g, r in zip(rope.split_qkv(pos, qkv, HEADS), _old_split_qkv(rope, pos, qkv), strict=True):
            assert torch.equal(g, r)
    with pytest.raises(ValueError, match="other positions"):
        rope.split_qkv(pos, qkv, HEADS, rope.tables(pos.clone()))


def test_split_qkv_kernel_path_writes_into_dqkv(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the fused kernels on (the GPU, or Triton's interpreter without one) the forward and the
    backward rotate with the kernel, the backward straight into dqkv's strided q/k columns."""
    if (why := triton_unavailable()) is not None:
        pytest.skip(why)
    calls: list[tuple[int, ...]] = []
    kernel = triton_fused.rotary

    def spy(q_out: torch.Tensor, k_out: torch.Tensor, *args: torch.Tensor) -> None:
        calls.append(q_out.stride())
        kernel(q_out, k_out, *args)

    monkeypatch.setattr(triton_fused, "rotary", spy)
    rope = RotaryEmbedding(HEADS[2], 64, RopeConfig()).to(DEVICE)
    gen = torch.Generator().manual_seed(1)
    pos = torch.tensor([3, 0, 7, 1, 2], device=DEVICE)
    width = (HEADS[0] + 2 * HEADS[1]) * HEADS[2]
    qkv = torch.randn(5, width, generator=gen).to(DEVICE)
    grads: list[torch.Tensor | None] = [
        torch.randn(s, generator=gen).to(DEVICE) for s in [(5, 4, 16), (5, 2, 16), (5, 2, 16)]
    ]
    monkeypatch.setattr(triton_fused, "ENABLED", False)
    ref, dref = _run(lambda x: rope.split_qkv(pos, x, HEADS, rope.tables(pos)), qkv, grads)
    monkeypatch.setattr(triton_fused, "ENABLED", True)
    monkeypatch.setattr(triton_fused, "ON_CPU", True)
    got, dgot = _run(lambda x: rope.split_qkv(pos, x, HEADS, rope.tables(pos)), qkv, grads)
    assert calls == [(HEADS[0] * 16, 16, 1), (width, 16, 1)]  # forward: a new q; backward: dqkv's columns
    for g, r in zip([*got, dgot], [*ref, dref], strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def _adapter(targets: tuple[str, ...]):  # type: ignore[no-untyped-def]
    shapes = {"q_proj": (16, 16), "k_proj": (8, 16), "v_proj": (8, 16), "o_proj": (16, 16)}  # (out, in)
    adapter = new_lora_adapter(num_layers=2, shapes=shapes, rank=4, alpha=6, target_modules=targets, seed=0)
    gen = torch.Generator().manual_seed(1)
    weights = {k: (a, torch.randn(b.shape, generator=gen) * 0.1) for k, (a, b) in adapter.weights.items()}
    return dataclasses.replace(adapter, weights=weights)


class _PerOpLoRALinearFn(torch.autograd.Function):
    """The trainer's LoRA linear as it was before its host-side cuts (slice assignments, one
    ``cat``/``split`` per target list, out-of-place scalings), fed by the per-layer cast and
    split of ``flat``: the reference the cut versions must equal bit for bit."""

    @staticmethod
    def forward(ctx, x, weight, bias, a_all, scaling, spans, *bs):  # type: ignore[no-untyped-def, override]
        y = F.linear(x, weight, bias)
        xa = x @ a_all.T
        for (off, size), part, b in zip(spans, xa.split(a_all.shape[0] // len(bs), dim=1), bs, strict=True):
            y[:, off : off + size] += (part @ b.T) * scaling
        ctx.save_for_backward(x, weight, a_all, xa, *bs)
        ctx.scaling, ctx.spans = scaling, spans
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[no-untyped-def, override]
        x, weight, a_all, xa, *bs = ctx.saved_tensors
        s = ctx.scaling
        dys = [dy[:, off : off + size] for off, size in ctx.spans]
        t = torch.cat([g @ b for g, b in zip(dys, bs, strict=True)], dim=1)
        dx = dy @ weight
        dx.addmm_(t, a_all, alpha=s)
        da = (t.T @ x) * s
        parts = xa.split(a_all.shape[0] // len(bs), dim=1)
        dbs = [(g.T @ part) * s for g, part in zip(dys, parts, strict=True)]
        return (dx, None, None, da, None, None, *dbs)


def _per_op_linear(lora: TrainableLoRA, layer: int, out_slices: dict[str, int], x: torch.Tensor,
                   w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    lora.bind_grads()
    ab = lora.unpack(lora.layer_weights(layer, x.dtype), layer)
    names = [n for n in out_slices if lora.trains(layer, n)]
    offs = dict(zip(out_slices, [sum(list(out_slices.values())[:i]) for i in range(len(out_slices))], strict=True))
    spans = tuple((offs[n], out_slices[n]) for n in names)
    a_all = torch.cat([ab[n][0] for n in names])
    out: torch.Tensor = _PerOpLoRALinearFn.apply(x, w, bias, a_all, lora.scaling, spans, *[ab[n][1] for n in names])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("targets", "out_slices"), [
    (("q_proj", "v_proj", "o_proj"), {"q_proj": 16, "k_proj": 8, "v_proj": 8}),  # k untrained
    (("q_proj", "k_proj", "v_proj", "o_proj"), {"q_proj": 16, "k_proj": 8, "v_proj": 8}),  # side by side
    (("k_proj", "v_proj", "o_proj"), {"q_proj": 16, "k_proj": 8, "v_proj": 8}),  # side by side, from column 16
    (("q_proj", "v_proj", "o_proj"), {"o_proj": 16}),  # one target, the whole output
])
@pytest.mark.parametrize("groups", [True, False])  # over the linear's own leaf, or the per-layer one
def test_lora_linear_equals_the_per_op_version_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, targets: tuple[str, ...], out_slices: dict[str, int],
    groups: bool,
) -> None:
    """The trainer's linear (its node over its LinearGroup leaf, cast and unpacked inside; or the
    per-layer fallback) against the per-op version: output, input gradient and ``flat.grad``,
    twice (the second backward accumulates in place)."""
    out = sum(out_slices.values())
    gen = torch.Generator().manual_seed(2)
    w, bias = torch.randn(out, 16, generator=gen).to(dtype), torch.randn(out, generator=gen).to(dtype)
    x, dy = torch.randn(6, 16, generator=gen).to(dtype), torch.randn(6, out, generator=gen).to(dtype)

    def run(lora: TrainableLoRA, linear) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
        xg = x.clone().requires_grad_(True)
        for _ in range(2):
            y = linear(lora, xg)
            y.backward(dy)
        assert xg.grad is not None
        return y.detach(), xg.grad

    if not groups:
        monkeypatch.setattr(TrainableLoRA, "linear_group", lambda self, layer, names: None)
    got = TrainableLoRA(_adapter(targets))
    y, dx = run(got, lambda lora, xg: lora.context().linear(1, out_slices, xg, w, bias))
    assert bool(got._groups) == groups
    ref = TrainableLoRA(_adapter(targets))
    y_ref, dx_ref = run(ref, lambda lora, xg: _per_op_linear(lora, 1, out_slices, xg, w, bias))
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    assert got.flat.grad is not None and ref.flat.grad is not None
    assert torch.equal(got.flat.grad, ref.flat.grad) and got.flat.grad[got._layer_spans[1][0]:].any()
    assert not got.flat.grad[: got._layer_spans[1][0]].any()


def test_linear_groups_follow_a_replaced_grad_and_refuse_split_spans() -> None:
    lora = TrainableLoRA(_adapter(("q_proj", "v_proj", "o_proj")))
    assert lora.linear_group(0, ("v_proj", "q_proj")) is None  # not in flat's order
    group = lora.linear_group(0, ("q_proj", "v_proj"))
    assert group is not None and (group.start, group.end) == (0, 4 * 16 + 16 * 4 + 4 * 16 + 8 * 4)
    x, w = torch.randn(3, 16), torch.randn(32, 16)
    lora.context().linear(0, {"q_proj": 16, "k_proj": 8, "v_proj": 8}, x, w, None).sum().backward()
    first = lora.flat.grad
    assert first is not None and first[: group.end].any()
    lora.flat.grad = None  # what an optimizer may do: a new gradient buffer
    lora.context().linear(0, {"q_proj": 16, "k_proj": 8, "v_proj": 8}, x, w, None).sum().backward()
    assert lora.flat.grad is not first and torch.equal(lora.flat.grad, first)


@pytest.mark.parametrize("lens", [(5,), (5, 1, 9)])
def test_trainer_dropout_masks_are_the_per_row_masks(lens: tuple[int, ...]) -> None:
    """The trainer draws each row's ``u`` and tests them all at once: the masks the engine draws
    row by row (``dropout_mask``), bit for bit."""
    lora = TrainableLoRA(_adapter(("q_proj", "v_proj")), dropout=0.3, seed=4)
    ctx = lora.context(dropout_key=11, row_lens=lens)
    x = torch.zeros(sum(lens), 16)
    got = ctx._mask(1, "v_proj", x)  # type: ignore[attr-defined]
    ref = torch.cat([dropout_mask(4, row_dropout_key(11, i), 1, "v_proj", (n, 16), 0.3, "cpu")
                     for i, n in enumerate(lens)])
    assert torch.equal(got, ref)


def test_split_heads_views() -> None:
    qkv = torch.arange(3 * 128, dtype=torch.float32).view(3, 128)
    q, k, v = split_heads(qkv, HEADS)
    assert q.shape == (3, 4, 16) and k.shape == v.shape == (3, 2, 16)
    assert all(t.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr() for t in (q, k, v))
    assert torch.equal(torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1), qkv)

"""The trainer's master adapter (``TrainableLoRA``) and the layer-wise recompute backward.

The oracle for ``task_backward`` is plain autograd through the whole model on the same rows.
The builders here (samples, engine-style capture) are shared with ``test_peft_parity``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from coserve.engine.lora_manager import LoRAManager
from coserve.layers.attention import AttentionMetadata
from coserve.layers.lora import LoRABatch, StackedLoRA, dropout_mask, row_dropout_key
from coserve.models.llama import ForwardContext, LlamaForCausalLM
from coserve.models.loader import load_model
from coserve.models.peft_adapter import LORA_TARGETS, LoraAdapter, new_lora_adapter
from coserve.trainer.backward import TaskRow, task_backward
from coserve.trainer.lora_params import TrainableLoRA
from tests.conftest import ARCHS

QV = ("q_proj", "v_proj")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


# --------------------------------------------------------------------------------------------
# Builders


@dataclass(frozen=True)
class Sample:
    ids: tuple[int, ...]
    labels: tuple[int, ...]  # -100 on the prompt

    @property
    def num_targets(self) -> int:
        return sum(1 for t in self.labels[1:] if t != -100)


def random_samples(
    n: int, seed: int, vocab: int = 160, min_len: int = 5, max_len: int = 40
) -> list[Sample]:
    """``n`` random sequences with a random masked prompt prefix (at least 2 targets each)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        ids = torch.randint(0, vocab, (length,), generator=gen).tolist()
        prompt = int(torch.randint(1, length - 1, (1,), generator=gen))
        out.append(Sample(tuple(ids), tuple([-100] * prompt + ids[prompt:])))
    return out


def perturbed_adapter(
    model: LlamaForCausalLM,
    rank: int,
    targets: Sequence[str],
    seed: int,
    alpha: float = 16.0,
    b_std: float = 0.05,
) -> LoraAdapter:
    """PEFT's initialisation (``B = 0``) with ``B`` then drawn ``N(0, b_std²)``, so the first
    optimizer steps are not trivial."""
    cfg = model.config
    fresh = new_lora_adapter(
        num_layers=cfg.num_layers,
        shapes=cfg.linear_shapes(),
        rank=rank,
        alpha=alpha,
        target_modules=targets,
        seed=seed,
    )
    gen = torch.Generator().manual_seed(seed + 1)
    weights = {
        key: (a, torch.randn(b.shape, generator=gen) * b_std)
        for key, (a, b) in sorted(fresh.weights.items())
    }
    return dataclasses.replace(fresh, weights=weights)


def flat_batch(lens: Sequence[int]) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions and attention metadata of rows that each start at 0 and write no KV."""
    r = len(lens)
    meta = AttentionMetadata.build(list(lens), [0] * r, [[] for _ in lens], [False] * r, r, 4)
    return torch.cat([torch.arange(n) for n in lens]), meta


@dataclass
class EngineCaptureLoRA:
    """What the engine's capture forward does: serving-slot LoRA for every row (``stacked``),
    with the trainer's dropout mask applied to the inputs of FT row ``i`` of the task
    (``ft_rows[i] = (batch start, length, index in the task)``)."""

    stacked: StackedLoRA
    ft_rows: list[tuple[int, int, int]]
    seed: int
    p: float
    key: int | None

    def apply(
        self,
        layer: int,
        target: str,
        x: torch.Tensor,
        y: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
    ) -> None:
        if self.key is not None and self.p > 0:
            x = x.clone()
            for start, n, row in self.ft_rows:
                mask = dropout_mask(
                    self.seed,
                    row_dropout_key(self.key, row),
                    layer,
                    target,
                    (n, x.shape[1]),
                    self.p,
                    x.device,
                )
                x[start : start + n] *= mask.to(x.dtype)
        self.stacked.apply(layer, target, x, y, a, b)


def engine_capture(
    model: LlamaForCausalLM,
    manager: LoRAManager,
    slot: int,
    samples: Sequence[Sample],
    offsets: Sequence[int],
    rows_in_task: Sequence[int],
    store: torch.Tensor,
    *,
    lora_seed: int = 0,
    dropout: float = 0.0,
    dropout_key: int | None = None,
    inference_prompt: Sequence[int] | None = None,
    mlp_store: torch.Tensor | None = None,
) -> None:
    """One engine step: an optional inference prefill row (no adapter), then the FT rows routed
    to ``slot``; a layer hook copies each FT row's layer inputs into ``store`` at its offset (and
    an MLP hook its gate/up outputs into ``mlp_store``)."""
    lens = [len(s.ids) for s in samples]
    ids = [torch.tensor(s.ids) for s in samples]
    slots = [slot] * len(samples)
    if inference_prompt is not None:
        lens, slots = [len(inference_prompt), *lens], [-1, *slots]
        ids = [torch.tensor(inference_prompt), *ids]
    positions, meta = flat_batch(lens)
    first = 1 if inference_prompt is not None else 0
    starts = [sum(lens[:i]) for i in range(first, len(lens))]
    stacked = StackedLoRA(LoRABatch.from_rows(lens, slots), manager.scales)
    ft_rows = [(s, len(x.ids), r) for s, x, r in zip(starts, samples, rows_in_task, strict=True)]
    lora_ctx = EngineCaptureLoRA(stacked, ft_rows, lora_seed, dropout, dropout_key)

    def hook(layer: int, hidden: torch.Tensor) -> None:
        for (start, n, _), off in zip(ft_rows, offsets, strict=True):
            store[layer, off : off + n] = hidden[start : start + n]

    def mlp_hook(layer: int, gate_up: torch.Tensor) -> None:
        assert mlp_store is not None
        for (start, n, _), off in zip(ft_rows, offsets, strict=True):
            mlp_store[layer, off : off + n] = gate_up[start : start + n]

    with torch.no_grad():
        model(torch.cat(ids), positions, ForwardContext(attn=meta, lora=lora_ctx, layer_hook=hook,
                                                        mlp_hook=mlp_hook if mlp_store is not None else None))


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    """Elementwise ``|a - e| <= rtol · (|e| + max|e|)``: fp32 summation-order noise is relative
    to the largest entries, not to each (possibly tiny) entry."""
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * float(expected.abs().max()))


def new_store(model: LlamaForCausalLM, capacity: int) -> torch.Tensor:
    cfg = model.config
    dtype = model.lm_head_weight.dtype
    return torch.full((cfg.num_layers + 1, capacity, cfg.hidden_size), float("nan"), dtype=dtype)


def full_autograd_loss(
    model: LlamaForCausalLM,
    lora: TrainableLoRA,
    samples: Sequence[Sample],
    dropout_key: int | None = None,
) -> torch.Tensor:
    """The oracle: one autograd graph through the whole model; summed token cross-entropy."""
    lens = [len(s.ids) for s in samples]
    positions, meta = flat_batch(lens)
    ids = torch.cat([torch.tensor(s.ids) for s in samples])
    ctx = ForwardContext(attn=meta, lora=lora.context(dropout_key, lens))
    logits = model.compute_logits(model(ids, positions, ctx))
    targets = torch.cat([torch.tensor([*s.labels[1:], -100]) for s in samples])
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")


# --------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def models(hf_models: dict[str, Path]) -> dict[str, LlamaForCausalLM]:
    return {
        arch: load_model(hf_models[arch], num_lora_slots=2, max_lora_rank=16, dtype=torch.float32)
        for arch in ARCHS
    }


def capture_task(
    model: LlamaForCausalLM,
    lora: TrainableLoRA,
    samples: Sequence[Sample],
    dropout_key: int | None = None,
    mlp_store: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[TaskRow]]:
    """Write the master into slot 1, capture ``samples`` over two engine steps at scattered
    offsets (in reverse order in the store), return the store and the task rows. With
    ``mlp_store`` (an empty list) the gate/up outputs are captured too, into a tensor appended
    to it."""
    manager = LoRAManager(model, max_loras=1, num_training_slots=1)
    slot = manager.training_slot(0)
    lora.write_serving(manager.stacks, slot, manager.scales)
    lens = [len(s.ids) for s in samples]
    offsets, pos = [0] * len(samples), 3
    for i in reversed(range(len(samples))):
        offsets[i], pos = pos, pos + lens[i] + 2
    store = new_store(model, pos)
    mlp = None
    if mlp_store is not None:
        cfg = model.config
        mlp = torch.zeros(cfg.num_layers, pos, 2 * cfg.intermediate_size, dtype=store.dtype)
        mlp_store.append(mlp)
    half = len(samples) // 2
    for part in (range(half), range(half, len(samples))):
        engine_capture(
            model,
            manager,
            slot,
            [samples[i] for i in part],
            [offsets[i] for i in part],
            list(part),
            store,
            lora_seed=lora.seed,
            dropout=lora.dropout,
            dropout_key=dropout_key,
            inference_prompt=[7, 8, 9, 10, 11],
            mlp_store=mlp,
        )
    return store, [TaskRow(off, s.labels) for off, s in zip(offsets, samples, strict=True)]


# --------------------------------------------------------------------------------------------
# TrainableLoRA


def test_flat_layout_views_and_round_trip(models: dict[str, LlamaForCausalLM]) -> None:
    model = models["llama"]
    adapter = perturbed_adapter(model, 8, ("q_proj", "v_proj", "down_proj"), seed=3)
    lora = TrainableLoRA(adapter)
    assert lora.flat.is_leaf and lora.flat.requires_grad and lora.flat.dtype == torch.float32
    expected = torch.cat(
        [
            t.flatten()
            for layer in range(2)
            for target in adapter.target_modules
            for t in adapter.weights[(layer, target)]
        ]
    )
    assert torch.equal(lora.flat.detach(), expected)
    assert lora.a(1, "down_proj").shape == (8, 112) and lora.b(1, "down_proj").shape == (64, 8)
    assert lora.a(1, "v_proj").data_ptr() != lora.b(1, "v_proj").data_ptr()
    with torch.no_grad():
        lora.b(1, "v_proj").fill_(2.5)
    assert torch.all(lora.to_adapter().weights[(1, "v_proj")][1] == 2.5)

    out = lora.to_adapter("base-x")
    assert out.base_model_name_or_path == "base-x" and out.scaling == adapter.scaling
    for key, (a, _) in out.weights.items():
        assert a.data_ptr() != lora.a(*key).data_ptr()  # a copy, not a view
    other = TrainableLoRA(perturbed_adapter(model, 8, ("q_proj", "v_proj", "down_proj"), seed=9))
    other.load_adapter(out)
    assert torch.equal(other.flat, lora.flat)
    # from another vector of the layout (a committed state's master row), this one's left as it was
    mine = lora.flat.detach().clone()
    state_row = torch.randn_like(mine)
    theirs = lora.to_adapter(flat=state_row)
    other.load_adapter(theirs)
    assert torch.equal(other.flat.detach(), state_row) and torch.equal(lora.flat.detach(), mine)
    assert all(a.data_ptr() != state_row.data_ptr() for a, _ in theirs.weights.values())  # copies
    with pytest.raises(ValueError, match="does not match"):
        other.load_adapter(perturbed_adapter(model, 4, ("q_proj", "v_proj", "down_proj"), seed=1))
    with pytest.raises(ValueError, match="scaling"):
        other.load_adapter(
            perturbed_adapter(model, 8, ("q_proj", "v_proj", "down_proj"), seed=1, alpha=3.0)
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_serving_in_place(models: dict[str, LlamaForCausalLM], dtype: torch.dtype) -> None:
    model = models["llama"]
    lora = TrainableLoRA(perturbed_adapter(model, 8, QV, seed=4))
    stacks = {
        (layer, t): (torch.randn(3, 16, i, dtype=dtype), torch.randn(3, o, 16, dtype=dtype))
        for layer in range(2)
        for t, (o, i) in model.config.linear_shapes().items()
    }
    before = {k: (a.clone(), b.clone()) for k, (a, b) in stacks.items()}
    ptrs = {k: (a.data_ptr(), b.data_ptr()) for k, (a, b) in stacks.items()}
    scales = torch.zeros(3)
    lora.write_serving(lambda layer, t: stacks[(layer, t)], 1, scales)
    assert scales.tolist() == [0.0, lora.scaling, 0.0]
    for (layer, t), (a, b) in stacks.items():
        assert (a.data_ptr(), b.data_ptr()) == ptrs[(layer, t)]
        assert torch.equal(a[0::2], before[(layer, t)][0][0::2])  # other slots untouched
        assert torch.equal(b[0::2], before[(layer, t)][1][0::2])
        if t in QV:
            assert torch.equal(a[1, :8], lora.a(layer, t).detach().to(dtype))
            assert torch.equal(b[1, :, :8], lora.b(layer, t).detach().to(dtype))
            assert not a[1, 8:].any() and not b[1, :, 8:].any()
        else:
            assert not a[1].any() and not b[1].any()


def test_dropout_mask_is_seeded_inverted_dropout() -> None:
    m = dropout_mask(1, 2, 0, "q_proj", (200, 64), 0.25, "cpu")
    assert m.shape == (200, 64) and m.dtype == torch.float32
    assert m.unique().tolist() == [0.0, pytest.approx(1 / 0.75)]
    assert abs(float((m == 0).float().mean()) - 0.25) < 0.02
    assert torch.equal(m, dropout_mask(1, 2, 0, "q_proj", (200, 64), 0.25, "cpu"))
    for args in [
        (2, 2, 0, "q_proj"),
        (1, 3, 0, "q_proj"),
        (1, 2, 1, "q_proj"),
        (1, 2, 0, "k_proj"),
    ]:
        assert not torch.equal(m, dropout_mask(*args, (200, 64), 0.25, "cpu"))
    assert torch.all(dropout_mask(1, 2, 0, "q_proj", (3, 4), 0.0, "cpu") == 1)
    assert row_dropout_key(5, 0) != row_dropout_key(5, 1) != row_dropout_key(6, 1)


# --------------------------------------------------------------------------------------------
# task_backward


def attention_pieces_boundaries() -> int:
    """The boundaries per layer that the attention half in three pieces (the default,
    COSERVE_TRAINER_ATTN_PIECES) adds: two in its recompute, two in its backward."""
    import coserve.trainer.backward as backward

    return 4 if backward.ATTN_PIECES else 0


def loss_chunk_boundaries(model: LlamaForCausalLM) -> int:
    """The boundaries of one loss chunk: before its forward and its backward, LOSS_SPLIT's one
    between them, and one between two GEMM pieces (LOSS_GEMM_PIECES) of the LM head's GEMM (over
    the vocabulary) and of its gradient's (over the hidden size)."""
    import coserve.trainer.backward as backward

    if not backward.LOSS_SPLIT:
        return 2
    pieces = 0
    if backward.LOSS_WORKSPACE:
        vocab, hidden = model.lm_head_weight.shape
        pieces = sum(len(backward.gemm_pieces(n, backward.LOSS_GEMM_PIECES)) - 1 for n in (vocab, hidden))
    return 3 + pieces


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("targets", "dropout"), [(QV, 0.0), (LORA_TARGETS, 0.0), (ATTN, 0.2)])
def test_task_backward_matches_full_autograd(
    models: dict[str, LlamaForCausalLM], arch: str, targets: tuple[str, ...], dropout: float
) -> None:
    model = models[arch]
    samples = random_samples(5, seed=11)
    key = 42 if dropout else None
    ref = TrainableLoRA(perturbed_adapter(model, 8, targets, seed=5), dropout=dropout, seed=7)
    loss = full_autograd_loss(model, ref, samples, dropout_key=key)
    loss.backward()

    lora = TrainableLoRA(perturbed_adapter(model, 8, targets, seed=5), dropout=dropout, seed=7)
    store, rows = capture_task(model, lora, samples, dropout_key=key)
    seen: list[int] = []
    out = task_backward(model, lora, store, rows, dropout_key=key, at_layer_boundary=seen.append)

    # the loss chunk's (loss_chunk_boundaries); per layer:
    # before and after the attention recompute, before the attention backward, and within the MLP
    # half two (trained: after its recompute and its backward) or two (untrained, one piece: after
    # the first two of its three matmuls; the one before the attention backward follows the
    # third), and the attention pieces'
    per_layer = 5 + attention_pieces_boundaries() - (targets == LORA_TARGETS)
    assert seen == [2] * loss_chunk_boundaries(model) + [1] * per_layer + [0] * per_layer
    assert out.num_targets == sum(s.num_targets for s in samples)
    assert out.loss_sum == pytest.approx(loss.item(), rel=1e-5)
    assert ref.flat.grad is not None and lora.flat.grad is not None
    assert_close_scaled(lora.flat.grad, ref.flat.grad, rtol=1e-5)
    assert all(p.grad is None and not p.requires_grad for p in model.parameters())


@pytest.mark.parametrize(("targets", "dropout"), [(ATTN, 0.0), (QV, 0.0), (ATTN, 0.2)])
def test_poll_points_come_inside_the_lora_linears_and_change_nothing(
    models: dict[str, LlamaForCausalLM], targets: tuple[str, ...], dropout: float
) -> None:
    """``at_poll_point`` runs inside the stretches of every layer that trains a linear (the
    trainer's pause points between boundaries), in the LoRA linears' forward and backward, and
    the loss and gradients are the same bit for bit as without it."""
    model = models["llama"]
    samples = random_samples(5, seed=12)
    key = 42 if dropout else None
    lora = TrainableLoRA(perturbed_adapter(model, 8, targets, seed=5), dropout=dropout, seed=7)
    store, rows = capture_task(model, lora, samples, dropout_key=key)
    plain = task_backward(model, lora, store, rows, dropout_key=key)
    expected = lora.flat.grad.clone()
    lora.flat.grad = None
    events: list[int | None] = []  # a boundary's layer, or None for a poll point
    polled = task_backward(model, lora, store, rows, dropout_key=key, at_layer_boundary=events.append,
                           at_poll_point=lambda: events.append(None))
    assert polled.loss_sum == plain.loss_sum
    assert torch.equal(lora.flat.grad, expected)
    layers = model.config.num_layers
    # the stretches of each layer (a boundary's layer, then the polls until the next boundary)
    polls_by_layer = dict.fromkeys(range(layers), 0)
    at: int | None = None
    for e in events:
        if e is None:
            assert at is not None and at < layers, "a poll before any boundary, or in the loss"
            polls_by_layer[at] += 1
        else:
            at = e
    # every trained linear polls once in its forward; without dropout twice more in its backward
    # (with dropout the delta is plain autograd: the forward's poll only)
    linears = 2 if targets == ATTN else 1  # (q/k/v in one linear, o_proj)
    per_linear = 1 if dropout else 3
    assert all(n == linears * per_linear for n in polls_by_layer.values()), polls_by_layer


@pytest.mark.parametrize("split", [False, True])
def test_loss_in_chunks_gives_the_same_loss_and_gradients(
    models: dict[str, LlamaForCausalLM], monkeypatch: pytest.MonkeyPatch, split: bool
) -> None:
    """The loss over the targets in chunks of LOSS_CHUNK, with a possible pause before each
    chunk's forward and before its backward (LOSS_SPLIT: by hand, one more pause between them)."""
    import coserve.trainer.backward as backward

    model = models["llama"]
    samples = random_samples(5, seed=3)
    lora = TrainableLoRA(perturbed_adapter(model, 8, QV, seed=5))
    store, rows = capture_task(model, lora, samples)
    whole = task_backward(model, lora, store, rows)
    expected = lora.flat.grad.clone()
    lora.flat.grad = None
    monkeypatch.setattr(backward, "LOSS_CHUNK", 4)
    monkeypatch.setattr(backward, "LOSS_SPLIT", split)
    seen: list[int] = []
    chunked = task_backward(model, lora, store, rows, at_layer_boundary=seen.append)
    assert seen.count(2) == loss_chunk_boundaries(model) * -(-whole.num_targets // 4) > 2
    assert chunked.num_targets == whole.num_targets
    assert chunked.loss_sum == pytest.approx(whole.loss_sum, rel=1e-6)
    assert_close_scaled(lora.flat.grad, expected, rtol=1e-5)


def one_loss_chunk(model: LlamaForCausalLM, final: torch.Tensor,
                   targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """``_split_loss_chunk`` on a fresh leaf copy of ``final``: (loss, the leaf's gradient, the
    boundaries it passed)."""
    import coserve.trainer.backward as backward

    leaf = final.clone().requires_grad_(True)
    seen: list[int] = []
    loss = backward._split_loss_chunk(model, leaf, targets, functools.partial(seen.append, 1))
    return loss, leaf.grad, len(seen)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_workspace_gives_the_same_bits(hf_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                                dtype: torch.dtype, device: str) -> None:
    """LOSS_WORKSPACE's buffers, kept across chunks of several sizes (one above LOSS_CHUNK: the
    buffers grow), give the per-chunk tensors' loss and gradient bit for bit, a boundary between
    the same stretches."""
    import coserve.trainer.backward as backward

    model = load_model(hf_models["llama"], num_lora_slots=1, max_lora_rank=16, dtype=dtype, device=device)
    monkeypatch.setattr(backward, "LOSS_CHUNK", 8)
    monkeypatch.setattr(backward, "LOSS_GEMM_PIECES", 1)  # (the pieces: test_a_loss_chunk_in_gemm_pieces...)
    monkeypatch.setattr(backward, "LOSS_FUSED_CE", False)  # (not bit for bit: tests/trainer/test_triton_loss.py)
    for name in ("_key", "_low", "_f32"):  # (a fresh workspace: earlier tests' is for their chunk)
        monkeypatch.setattr(backward._LossWorkspace, name, None)
    gen = torch.Generator().manual_seed(0)
    vocab = model.lm_head_weight.shape[0]
    for n in (7, 3, 9, 8):
        final = (torch.randn(n, model.lm_head_weight.shape[1], generator=gen) * 4).to(device, dtype)
        targets = torch.randint(0, vocab, (n,), generator=gen).to(device)
        got = {}
        for workspace in (False, True):
            monkeypatch.setattr(backward, "LOSS_WORKSPACE", workspace)
            got[workspace] = one_loss_chunk(model, final, targets)
        assert torch.equal(got[True][0], got[False][0]), n
        assert torch.equal(got[True][1], got[False][1]), n
        assert got[True][2] == got[False][2] == 2
    low, f32 = backward._LossWorkspace.get(9, vocab, dtype, model.lm_head_weight.device)
    assert low.dtype == dtype and f32.dtype == torch.float32 and backward._LossWorkspace._low.shape[0] == 9


@pytest.mark.parametrize("pieces", [2, 3])
def test_loss_gemms_in_pieces_give_the_same_loss_and_gradients(
    models: dict[str, LlamaForCausalLM], monkeypatch: pytest.MonkeyPatch, pieces: int
) -> None:
    """LOSS_GEMM_PIECES: each loss chunk's LM-head GEMM (over vocabulary ranges) and its gradient's
    GEMM (over hidden ranges) in pieces, a pause boundary between two; the same loss and LoRA
    gradient as one piece each, 2 * (pieces - 1) more boundaries a chunk."""
    import coserve.trainer.backward as backward

    if not (backward.LOSS_SPLIT and backward.LOSS_WORKSPACE):
        pytest.skip("the pieces are the split, workspace loss's (the defaults)")
    model = models["llama"]
    samples = random_samples(5, seed=4)
    lora = TrainableLoRA(perturbed_adapter(model, 8, QV, seed=5))
    store, rows = capture_task(model, lora, samples)
    monkeypatch.setattr(backward, "LOSS_CHUNK", 4)
    monkeypatch.setattr(backward, "GEMM_PIECE_ALIGN", 8)  # (the test model: vocabulary 160, hidden 64)
    monkeypatch.setattr(backward, "LOSS_GEMM_PIECES", 1)
    seen: list[int] = []
    whole = task_backward(model, lora, store, rows, at_layer_boundary=seen.append)
    expected, whole_boundaries = lora.flat.grad.clone(), seen.count(2)
    lora.flat.grad = None
    monkeypatch.setattr(backward, "LOSS_GEMM_PIECES", pieces)
    seen.clear()
    got = task_backward(model, lora, store, rows, at_layer_boundary=seen.append)
    chunks = -(-whole.num_targets // 4)
    assert whole_boundaries == 3 * chunks
    assert seen.count(2) == (3 + 2 * (pieces - 1)) * chunks
    assert got.loss_sum == pytest.approx(whole.loss_sum, rel=1e-6)
    assert_close_scaled(lora.flat.grad, expected, rtol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_loss_chunk_in_gemm_pieces_matches_one_piece(hf_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                                       dtype: torch.dtype, device: str) -> None:
    """One loss chunk by :func:`_split_loss_chunk` with its GEMMs in pieces (the output written
    into column slices of the workspace and of the gradient: on CUDA, cuBLAS with a leading
    dimension) against one piece each: the same loss and gradient to the dtype's rounding."""
    import coserve.trainer.backward as backward

    if not backward.LOSS_WORKSPACE:
        pytest.skip("the pieces are the workspace loss's (the default)")
    model = load_model(hf_models["llama"], num_lora_slots=1, max_lora_rank=16, dtype=dtype, device=device)
    monkeypatch.setattr(backward, "GEMM_PIECE_ALIGN", 8)
    gen = torch.Generator().manual_seed(1)
    vocab, hidden = model.lm_head_weight.shape
    final = (torch.randn(9, hidden, generator=gen) * 4).to(device, dtype)
    targets = torch.randint(0, vocab, (9,), generator=gen).to(device)
    got = {}
    for pieces in (1, 3):
        monkeypatch.setattr(backward, "LOSS_GEMM_PIECES", pieces)
        got[pieces] = one_loss_chunk(model, final, targets)
    assert got[1][2] == 2 and got[3][2] == 2 + 2 * 2
    torch.testing.assert_close(got[3][0], got[1][0], rtol=1e-3 if dtype == torch.bfloat16 else 1e-6, atol=0)
    torch.testing.assert_close(got[3][1], got[1][1])


@pytest.mark.parametrize(("split", "workspace", "pieces"), [(True, True, 1), (True, True, 2), (True, True, 3),
                                                            (True, False, 2), (False, True, 2)])
def test_loss_stretch_roles_name_every_stretch_of_a_chunk(
    models: dict[str, LlamaForCausalLM], monkeypatch: pytest.MonkeyPatch, split: bool, workspace: bool, pieces: int
) -> None:
    """``loss_stretch_roles`` has one role per boundary a loss chunk passes (what the latency
    bench groups the loss's stretches by), the GEMM pieces' in order around the cross-entropy."""
    import coserve.trainer.backward as backward

    model = models["llama"]
    monkeypatch.setattr(backward, "LOSS_SPLIT", split)
    monkeypatch.setattr(backward, "LOSS_WORKSPACE", workspace)
    monkeypatch.setattr(backward, "LOSS_GEMM_PIECES", pieces)
    monkeypatch.setattr(backward, "GEMM_PIECE_ALIGN", 8)  # (the test model: vocabulary 160, hidden 64)
    vocab, hidden = model.lm_head_weight.shape
    roles = backward.loss_stretch_roles(vocab, hidden)
    assert len(roles) == loss_chunk_boundaries(model)
    if not split:
        assert roles == ("forward", "backward")
    else:
        n = pieces if workspace else 1
        assert roles == ("logits",) * n + ("cross_entropy",) + ("gradient",) * n


def test_gemm_pieces_cover_the_columns_at_tile_multiples() -> None:
    from coserve.trainer.backward import gemm_pieces

    assert gemm_pieces(128256, 1) == [(0, 128256)]
    assert gemm_pieces(128256, 2) == [(0, 64128), (64128, 128256)]  # (64128 = 501 tiles of 128)
    assert gemm_pieces(4096, 3) == [(0, 1408), (1408, 2816), (2816, 4096)]
    assert gemm_pieces(100, 4) == [(0, 100)]  # (under one tile: whole)
    for n, k in ((1000, 4), (128256, 7), (4096, 5), (129, 2)):
        got = gemm_pieces(n, k)
        assert got[0][0] == 0 and got[-1][1] == n and len(got) <= k
        assert all(a1 == b0 and b0 % 128 == 0 for (_, a1), (b0, _) in zip(got, got[1:], strict=False))


@pytest.mark.parametrize("kept_mlp", [False, True])
def test_untrained_mlp_in_pieces_gives_the_same_gradients(
    models: dict[str, LlamaForCausalLM], monkeypatch: pytest.MonkeyPatch, kept_mlp: bool
) -> None:
    """An MLP the adapter does not train is pulled back MLP_CHUNK tokens at a time (recomputed,
    or from the kept gate/up outputs), with a possible pause after each of a piece's matmuls; a
    trained MLP stays whole. Same loss and gradient as one piece."""
    import coserve.trainer.backward as backward

    model = models["llama"]
    samples = random_samples(5, seed=4)
    for targets, pieced in ((QV, True), (LORA_TARGETS, False)):
        lora = TrainableLoRA(perturbed_adapter(model, 8, targets, seed=5))
        kept: list[torch.Tensor] | None = [] if kept_mlp else None
        store, rows = capture_task(model, lora, samples, mlp_store=kept)
        mlp = kept[0] if kept else None
        whole = task_backward(model, lora, store, rows, mlp_store=mlp)
        expected = lora.flat.grad.clone()
        lora.flat.grad = None
        monkeypatch.setattr(backward, "MLP_CHUNK", 4)
        seen: list[int] = []
        chunked = task_backward(model, lora, store, rows, at_layer_boundary=seen.append, mlp_store=mlp)
        monkeypatch.undo()
        tokens = sum(len(r.labels) for r in rows)
        # per layer: before and after the attention recompute, before the attention backward, and
        # per MLP piece one after each matmul: the gate/up recompute (unless kept), down's and
        # gate_up's input gradients, but the last piece's last (the one before the attention
        # backward follows it); a trained MLP: after its recompute and after its backward
        per_piece = 2 if kept_mlp else 3
        assert seen.count(0) == (2 + per_piece * -(-tokens // 4) if pieced else 4) + attention_pieces_boundaries()
        assert chunked.loss_sum == pytest.approx(whole.loss_sum, rel=1e-6)
        assert_close_scaled(lora.flat.grad, expected, rtol=1e-5)


def test_gradients_accumulate_over_tasks(models: dict[str, LlamaForCausalLM]) -> None:
    model = models["llama"]
    samples = random_samples(6, seed=12)
    lora = TrainableLoRA(perturbed_adapter(model, 8, ATTN, seed=6))
    store_a, rows_a = capture_task(model, lora, samples[:3])
    store_b, rows_b = capture_task(model, lora, samples[3:])
    la = task_backward(model, lora, store_a, rows_a)
    assert lora.flat.grad is not None
    grad_a = lora.flat.grad.clone()
    lb = task_backward(model, lora, store_b, rows_b)
    ref = TrainableLoRA(lora.to_adapter())
    ref_loss = full_autograd_loss(model, ref, samples)
    ref_loss.backward()
    assert la.loss_sum + lb.loss_sum == pytest.approx(ref_loss.item(), rel=1e-5)
    assert ref.flat.grad is not None
    assert_close_scaled(lora.flat.grad, ref.flat.grad, rtol=1e-5)
    assert not torch.equal(lora.flat.grad, grad_a)


def test_dropout_changes_loss_and_gradients(models: dict[str, LlamaForCausalLM]) -> None:
    model = models["llama"]
    samples = random_samples(4, seed=13)
    adapter = perturbed_adapter(model, 8, ATTN, seed=8, b_std=0.3)
    results = {}
    for name, p, key, seed in [
        ("off", 0.0, None, 0),
        ("p", 0.3, 1, 0),
        ("p_again", 0.3, 1, 0),
        ("other_key", 0.3, 2, 0),
        ("other_seed", 0.3, 1, 1),
        ("no_key", 0.3, None, 0),
    ]:
        lora = TrainableLoRA(adapter, dropout=p, seed=seed)
        store, rows = capture_task(model, lora, samples, dropout_key=key)
        out = task_backward(model, lora, store, rows, dropout_key=key)
        assert lora.flat.grad is not None
        results[name] = (out.loss_sum, lora.flat.grad.clone())
    assert results["p"][0] == results["p_again"][0]
    assert torch.equal(results["p"][1], results["p_again"][1])
    assert results["no_key"][0] == results["off"][0]
    for name in ("off", "other_key", "other_seed"):
        assert results[name][0] != results["p"][0]
        assert not torch.allclose(results[name][1], results["p"][1], rtol=1e-3)


def test_rows_without_targets_and_bad_rows(models: dict[str, LlamaForCausalLM]) -> None:
    model = models["llama"]
    lora = TrainableLoRA(perturbed_adapter(model, 8, QV, seed=1))
    store = new_store(model, 8)
    called: list[int] = []
    out = task_backward(
        model, lora, store, [TaskRow(0, (1, -100, -100))], at_layer_boundary=called.append
    )
    assert out == (0.0, 0) and called == [] and lora.flat.grad is None
    with pytest.raises(ValueError, match="outside"):
        task_backward(model, lora, store, [TaskRow(5, (1, 2, 3, 4))])
    with pytest.raises(ValueError, match="store must be"):
        task_backward(model, lora, store[:2], [TaskRow(0, (1, 2))])


def test_bf16_model_gives_close_fp32_gradients(hf_models: dict[str, Path]) -> None:
    samples = random_samples(3, seed=14)
    grads = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(hf_models["llama"], num_lora_slots=1, max_lora_rank=16, dtype=dtype)
        lora = TrainableLoRA(perturbed_adapter(model, 8, ATTN, seed=2))
        manager = LoRAManager(model, max_loras=0, num_training_slots=1)
        lora.write_serving(manager.stacks, 0, manager.scales)
        store = new_store(model, 200)
        offsets = [sum(len(s.ids) for s in samples[:i]) for i in range(len(samples))]
        engine_capture(model, manager, 0, samples, offsets, range(3), store)
        task_backward(
            model,
            lora,
            store,
            [TaskRow(o, s.labels) for o, s in zip(offsets, samples, strict=True)],
        )
        assert lora.flat.grad is not None and lora.flat.grad.dtype == torch.float32
        grads[dtype] = lora.flat.grad
    cos = F.cosine_similarity(grads[torch.float32], grads[torch.bfloat16], dim=0)
    assert float(cos) > 0.99


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("targets", [ATTN, LORA_TARGETS])
def test_saved_mlp_activations_give_the_same_gradients(
    models: dict[str, LlamaForCausalLM], arch: str, targets: tuple[str, ...]
) -> None:
    """With the engine's gate/up outputs kept, layers whose MLP is not trained are differentiated
    through the MLP by hand (no recompute); trained MLPs still recompute. Same loss and gradient
    as full autograd either way."""
    model = models[arch]
    samples = random_samples(5, seed=12)
    ref = TrainableLoRA(perturbed_adapter(model, 8, targets, seed=6))
    loss = full_autograd_loss(model, ref, samples)
    loss.backward()

    lora = TrainableLoRA(perturbed_adapter(model, 8, targets, seed=6))
    kept: list[torch.Tensor] = []
    store, rows = capture_task(model, lora, samples, mlp_store=kept)
    seen: list[int] = []
    out = task_backward(model, lora, store, rows, at_layer_boundary=seen.append, mlp_store=kept[0])
    # the loss (L = 2: loss_chunk_boundaries), then per layer 4 boundaries: without a trained MLP
    # one after the first of the hand-written MLP backward's two matmuls (no recompute; the boundary
    # before the attention backward follows the second) in place of the trained MLP's one between
    # its recompute and its backward
    per_layer = 4 + attention_pieces_boundaries()
    assert seen == [2] * loss_chunk_boundaries(model) + [1] * per_layer + [0] * per_layer
    assert out.loss_sum == pytest.approx(loss.item(), rel=1e-5)
    assert ref.flat.grad is not None and lora.flat.grad is not None
    assert_close_scaled(lora.flat.grad, ref.flat.grad, rtol=1e-5)


@pytest.mark.parametrize("targets", [QV, LORA_TARGETS])
def test_attention_half_in_pieces_gives_the_same_gradients_bit_for_bit(
    models: dict[str, LlamaForCausalLM], monkeypatch: pytest.MonkeyPatch, targets: Sequence[str]
) -> None:
    """COSERVE_TRAINER_ATTN_PIECES: the attention half recomputed and pulled back in three pieces,
    two more boundaries in its recompute and two in its backward, the same loss and gradients."""
    import coserve.trainer.backward as backward

    model = models["llama"]
    samples = random_samples(5, seed=6)
    lora = TrainableLoRA(perturbed_adapter(model, 8, targets, seed=7))
    store, rows = capture_task(model, lora, samples)
    monkeypatch.setattr(backward, "ATTN_PIECES", False)
    seen_whole: list[int] = []
    whole = task_backward(model, lora, store, rows, at_layer_boundary=seen_whole.append)
    expected = lora.flat.grad.clone()
    lora.flat.grad = None
    monkeypatch.setattr(backward, "ATTN_PIECES", True)
    seen: list[int] = []
    pieced = task_backward(model, lora, store, rows, at_layer_boundary=seen.append)
    assert pieced.loss_sum == whole.loss_sum and pieced.num_targets == whole.num_targets
    assert torch.equal(lora.flat.grad, expected)
    layers = model.config.num_layers
    assert all(seen.count(i) == seen_whole.count(i) + 4 for i in range(layers))
    assert seen.count(layers) == seen_whole.count(layers)  # the loss's are unchanged

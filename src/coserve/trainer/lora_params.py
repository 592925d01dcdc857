"""The trainer's fp32 master copy of the training adapter: one flat leaf vector with named views.

Keeping every ``A``/``B`` of the adapter in ONE tensor ``flat: [P]`` makes AdamW, gradient
clipping, state export/import and shared-memory snapshots single-tensor operations. Layout, in
order: for ``layer in range(L)``, for ``target in target_modules`` (canonical
:data:`~coserve.models.peft_adapter.LORA_TARGETS` order): ``A [r, in]`` then ``B [out, r]``, each
row-major.

LoRA dropout (PEFT semantics: ``y += B(A(drop(x))) · scaling``, an independent mask per
``(layer, target)``) uses masks that are a pure function of ``(seed, key, layer, target)`` and
the row's length, so the engine's capture forward and the trainer's recompute draw the very same
mask without ever exchanging it; see :func:`dropout_mask` and :func:`row_dropout_key`.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from coserve.layers.lora import dropout_uniform, keep_mask, row_dropout_key
from coserve.models.peft_adapter import LORA_TARGETS, LoraAdapter
from coserve.trainer.mps import share_of_this_process

logger = logging.getLogger(__name__)

LORA_FP32_MM = os.environ.get("COSERVE_LORA_FP32_MM", "auto")
"""``COSERVE_LORA_FP32_MM``: whether the LoRA products with a rank-sized dimension (``x Aᵀ``,
``dy B``, ``(x Aᵀ) Bᵀ`` and the gradients of A and B) run in fp32 for half-precision inputs.
``auto`` (default): on CUDA when this process is an MPS client at a share below
:data:`FP32_BELOW_SHARE`; ``1``: always; ``0``: never. On the H200 (``bench/skinny_mm_check.py``)
cuBLAS's bf16 ``[4109, 4096] @ [4096, 16]`` returned non-finite values from finite inputs in 323
of 400 calls at a 20% share (26 SMs) and 41 of 200 at 30% (session 11), 161 of 200 at 40% and
none at 50% or on the whole GPU (session 12), and none in fp32: the split baseline's NaN losses
and gradients at 20–30% (``bench/results/diagnostic/session11``)."""
FP32_BELOW_SHARE = 50
"""The ``auto`` rule's bound (percent): the fault was seen at 20, 30 and 40% and not at 50%. At 50%
the fp32 products cost the co-serving trainer ~1 ms of GPU and CPU time per layer's attention
backward (session 12's 60 s latency run: ``layer#5`` span 2.12 ms against 0.99–1.12 ms in
sessions 9–10, p50) and a third of its FT tokens/s (2,018 against 2,961–3,193), for nothing."""
if LORA_FP32_MM not in ("auto", "0", "1"):
    raise ValueError(f"COSERVE_LORA_FP32_MM={LORA_FP32_MM!r}: expected auto, 0 or 1")


@functools.cache
def fp32_products(device_type: str) -> bool:
    """Whether :func:`lora_mm` computes in fp32 on ``device_type`` in this process (see
    :data:`LORA_FP32_MM`; decided once)."""
    if LORA_FP32_MM != "auto":
        return LORA_FP32_MM == "1"
    share = share_of_this_process() if device_type == "cuda" else None
    if share is not None and share < FP32_BELOW_SHARE:
        logger.warning("LoRA products in fp32: this process runs at a %d%% MPS share, where cuBLAS's bf16 "
                       "rank-sized matmuls gave non-finite results (COSERVE_LORA_FP32_MM=0 turns this off)", share)
        return True
    return False


def _in_fp32(a: torch.Tensor) -> bool:
    """Whether a LoRA product with half-precision input ``a`` runs in fp32 (:func:`fp32_products`)."""
    return a.dtype != torch.float32 and fp32_products(a.device.type)


def lora_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for the LoRA path's products with a rank-sized dimension: in fp32 (rounded back to
    ``a``'s dtype) where :func:`_in_fp32`, else ``torch.mm``."""
    if _in_fp32(a):
        return torch.mm(a.float(), b.float()).to(a.dtype)
    return torch.mm(a, b)

StacksFn = Callable[[int, str], tuple[torch.Tensor, torch.Tensor]]
"""``(layer, target) -> (A_stack [S, r_max, in], B_stack [S, out, r_max])`` of the serving model."""


@dataclass(frozen=True)
class _Slice:
    """Where one ``(layer, target)`` pair lives in ``flat``."""

    a_off: int
    a_shape: tuple[int, int]  # [r, in]
    b_off: int
    b_shape: tuple[int, int]  # [out, r]


@dataclass(frozen=True)
class LinearGroup:
    """The trained targets of one linear of one layer: ``flat[start:end]`` holds their A/B back
    to back. ``leaf`` is a leaf view of that span (its ``.grad`` a view of ``flat.grad``), so
    the linear's autograd node takes ONE weight input, unpacks it without autograd and returns
    its gradient whole; ``layout[i] = (a_off, a_shape, b_off, b_shape)`` of target ``i``,
    offsets from ``start``."""

    start: int
    end: int
    leaf: torch.Tensor
    layout: tuple[tuple[int, tuple[int, int], int, tuple[int, int]], ...]


class TrainableLoRA:
    """The fp32 master weights of the training adapter (see the module docstring for the layout).

    ``flat: [P]`` fp32 leaf with ``requires_grad`` on ``device``, initialised from ``adapter``;
    :meth:`a` / :meth:`b` are views into it, so autograd through them accumulates into
    ``flat.grad``. ``dropout`` is PEFT's ``lora_dropout``; ``seed`` seeds its masks.
    """

    def __init__(
        self,
        adapter: LoraAdapter,
        *,
        dropout: float = 0.0,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {dropout}")
        self.rank = adapter.rank
        self.alpha = adapter.alpha
        self.use_rslora = adapter.use_rslora
        self.scaling = adapter.scaling
        self.target_modules = adapter.target_modules
        self.num_layers = adapter.num_layers
        self.dropout = dropout
        self.seed = seed
        self._slices: dict[tuple[int, str], _Slice] = {}
        off = 0
        for layer in range(self.num_layers):
            for target in self.target_modules:
                a, b = adapter.weights[(layer, target)]
                a_shape = (int(a.shape[0]), int(a.shape[1]))
                b_shape = (int(b.shape[0]), int(b.shape[1]))
                self._slices[(layer, target)] = _Slice(off, a_shape, off + a.numel(), b_shape)
                off += a.numel() + b.numel()
        self.flat = torch.zeros(off, dtype=torch.float32, device=device)
        self.load_adapter(adapter)
        self.flat.requires_grad_(True)
        # NOTE: autograd runs through leaves that are views of `flat`'s storage, whose `.grad`
        # is a view of `flat.grad`: every layer's gradient lands in place in the flat buffer.
        # Differentiating through slices of `flat` itself would make each slice's backward
        # allocate, zero and add a full-size [P] gradient (8 per layer for q/k/v/o). One leaf per
        # layer here (the dropout path's); the linears' own leaves in `linear_group`.
        self._layer_spans: list[tuple[int, int]] = []
        for layer in range(self.num_layers):
            pairs = [self._slices[(layer, t)] for t in self.target_modules if (layer, t) in self._slices]
            start = pairs[0].a_off if pairs else off
            end = pairs[-1].b_off + pairs[-1].b_shape[0] * pairs[-1].b_shape[1] if pairs else off
            self._layer_spans.append((start, end))
        storage = self.flat.detach()
        self._leaves = [storage[s:e].requires_grad_(True) for s, e in self._layer_spans]
        # The same per linear (its trained targets' span), made on first use: see `linear_group`.
        self._groups: dict[tuple[int, tuple[str, ...]], LinearGroup | None] = {}
        self._bound_grad: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return self.flat.numel()

    def trains(self, layer: int, target: str) -> bool:
        """Whether this adapter has weights for ``(layer, target)``."""
        return (layer, target) in self._slices

    def a(self, layer: int, target: str, flat: torch.Tensor | None = None) -> torch.Tensor:
        """View ``[r, in]`` of ``A`` of ``(layer, target)`` into ``flat`` (by default this
        adapter's own; else a ``[P]`` vector of its layout)."""
        s = self._slices[(layer, target)]
        flat = self.flat if flat is None else flat
        return flat[s.a_off : s.a_off + s.a_shape[0] * s.a_shape[1]].view(s.a_shape)

    def b(self, layer: int, target: str, flat: torch.Tensor | None = None) -> torch.Tensor:
        """View ``[out, r]`` of ``B`` of ``(layer, target)`` into ``flat`` (as :meth:`a`)."""
        s = self._slices[(layer, target)]
        flat = self.flat if flat is None else flat
        return flat[s.b_off : s.b_off + s.b_shape[0] * s.b_shape[1]].view(s.b_shape)

    def bind_grads(self) -> None:
        """Make ``flat.grad`` exist (zeros if None) and point each layer leaf's ``.grad`` into it,
        so that backward passes accumulate into ``flat.grad`` in place. Called by
        :meth:`context`; needed again only after something replaced ``flat.grad``."""
        grad = self.flat.grad
        if grad is None:
            grad = torch.zeros_like(self.flat)
            self.flat.grad = grad
        if grad is not self._bound_grad:
            for (s, e), leaf in zip(self._layer_spans, self._leaves, strict=True):
                leaf.grad = grad[s:e]
            for group in self._groups.values():
                if group is not None:
                    group.leaf.grad = grad[group.start : group.end]
            self._bound_grad = grad

    def layer_weights(self, layer: int, dtype: torch.dtype) -> torch.Tensor:
        """Layer ``layer``'s A/B values as one differentiable tensor in ``dtype`` (the layer's span
        of ``flat``; see :meth:`unpack`)."""
        return self._leaves[layer].to(dtype)

    def unpack(self, weights: torch.Tensor, layer: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``target -> (A [r, in], B [out, r])`` views of :meth:`layer_weights` (one split)."""
        pairs = [(t, self._slices[(layer, t)]) for t in self.target_modules if (layer, t) in self._slices]
        sizes = [n for _, s in pairs for n in (s.a_shape[0] * s.a_shape[1], s.b_shape[0] * s.b_shape[1])]
        parts = weights.split(sizes)
        return {
            t: (parts[2 * i].view(s.a_shape), parts[2 * i + 1].view(s.b_shape))
            for i, (t, s) in enumerate(pairs)
        }

    def linear_group(self, layer: int, names: tuple[str, ...]) -> LinearGroup | None:
        """The targets ``names`` of ``layer`` (one linear's trained slices, in its order) as a
        :class:`LinearGroup`: their own leaf over their span of ``flat``, or None when their
        A/B do not sit back to back there in that order (made once, then cached)."""
        key = (layer, names)
        if key not in self._groups:
            slices = [self._slices[(layer, n)] for n in names]
            start, off, layout = slices[0].a_off, slices[0].a_off, []
            for sl in slices:
                a_size, b_size = sl.a_shape[0] * sl.a_shape[1], sl.b_shape[0] * sl.b_shape[1]
                if sl.a_off != off or sl.b_off != off + a_size:
                    self._groups[key] = None
                    break
                layout.append((sl.a_off - start, sl.a_shape, sl.b_off - start, sl.b_shape))
                off += a_size + b_size
            else:
                leaf = self.flat.detach()[start:off].requires_grad_(True)
                if self._bound_grad is not None:
                    leaf.grad = self._bound_grad[start:off]
                self._groups[key] = LinearGroup(start, off, leaf, tuple(layout))
        return self._groups[key]

    def to_adapter(self, base_model_name_or_path: str | None = None,
                   flat: torch.Tensor | None = None) -> LoraAdapter:
        """An fp32 CPU copy of the current weights (for ``save_peft_adapter``), or of ``flat``'s
        (a ``[P]`` vector of this layout, a committed state's master row: read, never written,
        so any thread may make one while another trains or copies)."""
        with torch.no_grad():
            weights = {
                key: (self.a(*key, flat=flat).detach().cpu().clone(), self.b(*key, flat=flat).detach().cpu().clone())
                for key in self._slices
            }
        return LoraAdapter(
            rank=self.rank,
            alpha=self.alpha,
            target_modules=self.target_modules,
            use_rslora=self.use_rslora,
            base_model_name_or_path=base_model_name_or_path,
            num_layers=self.num_layers,
            weights=weights,
        )

    def load_adapter(self, adapter: LoraAdapter) -> None:
        """Overwrite the master weights with ``adapter``'s, in place.

        Raises ``ValueError`` if its rank, scaling, targets, layer count or any shape differs.
        """
        if (adapter.rank, adapter.target_modules, adapter.num_layers) != (
            self.rank,
            self.target_modules,
            self.num_layers,
        ):
            raise ValueError(
                f"adapter (rank {adapter.rank}, targets {adapter.target_modules}, "
                f"{adapter.num_layers} layers) does not match the training adapter (rank "
                f"{self.rank}, targets {self.target_modules}, {self.num_layers} layers)"
            )
        if adapter.scaling != self.scaling:
            raise ValueError(
                f"adapter scaling {adapter.scaling} differs from the training adapter's "
                f"{self.scaling} (alpha / rslora mismatch)"
            )
        with torch.no_grad():
            for key, s in self._slices.items():
                a, b = adapter.weights[key]
                if (tuple(a.shape), tuple(b.shape)) != (s.a_shape, s.b_shape):
                    raise ValueError(
                        f"layer {key[0]} {key[1]}: adapter A {list(a.shape)} / B {list(b.shape)}, "
                        f"expected {list(s.a_shape)} / {list(s.b_shape)}"
                    )
            for key in self._slices:
                a, b = adapter.weights[key]
                self.a(*key).copy_(a)
                self.b(*key).copy_(b)

    def write_serving(self, stacks: StacksFn, slot: int, scales: torch.Tensor) -> None:
        """Copy the master weights into serving slot ``slot``, in place (never reallocating):

        ``A_stack[slot] = [a; 0]``, ``B_stack[slot] = [b, 0]`` (cast to the stacks' dtype),
        ``scales[slot] = scaling``; every target in ``LORA_TARGETS`` that this adapter does not
        train gets zeros. ``stacks(layer, target)`` must return the stacks of every such pair;
        scales: ``[S]`` fp32.
        """
        with torch.no_grad():
            for layer in range(self.num_layers):
                for target in LORA_TARGETS:
                    a_stack, b_stack = stacks(layer, target)
                    a_stack[slot].zero_()
                    b_stack[slot].zero_()
                    if not self.trains(layer, target):
                        continue
                    if a_stack.shape[1] < self.rank:
                        raise ValueError(
                            f"serving stacks hold rank {a_stack.shape[1]} < training rank "
                            f"{self.rank}"
                        )
                    a_stack[slot, : self.rank].copy_(self.a(layer, target))
                    b_stack[slot, :, : self.rank].copy_(self.b(layer, target))
            scales[slot].fill_(self.scaling)  # (a kernel with the value: no host-to-device copy that waits)

    def context(
        self, dropout_key: int | None = None, row_lens: Sequence[int] | None = None,
        poll: Callable[[], None] | None = None,
    ) -> TrainingLoRA:
        """A :class:`LoRAContext` under which every token of the batch uses this adapter:

        ``y += (drop(x) @ a.T) @ b.T · scaling`` (``a``/``b`` cast to ``x.dtype``; autograd flows
        into ``flat``). The batch is the rows ``row_lens`` back to back (one row of all tokens
        when None); row ``i``'s mask is ``dropout_mask(seed, row_dropout_key(dropout_key, i),
        layer, target, (n_i, in), dropout)``. No dropout when ``dropout == 0`` or
        ``dropout_key`` is None. The stacks the linears pass in are ignored. ``poll()`` (when
        given) runs inside each trained linear: in its forward after the base GEMM, in its
        backward at its start and after the input gradient (the trainer's pause points within
        its longest host work, :func:`coserve.trainer.backward.task_backward`).
        """
        key = dropout_key if self.dropout > 0 else None
        self.bind_grads()
        return TrainingLoRA(self, key, None if row_lens is None else tuple(row_lens), poll or _no_poll)


def _no_poll() -> None:
    """:meth:`TrainableLoRA.context`'s ``poll`` when none is given."""


class _Route(NamedTuple):
    """How :meth:`TrainingLoRA.linear` serves one linear (see :meth:`TrainingLoRA._route`)."""

    names: list[str]
    spans: tuple[tuple[int, int], ...]
    group: LinearGroup | None


class HandLinear(NamedTuple):
    """What :meth:`TrainingLoRA.linear_backward_by_hand` needs of one linear run by
    :meth:`TrainingLoRA.linear_by_hand`: its input and base weight, its trained targets' group
    (None: none trained, the base linear alone) and column spans, and the group's values cast
    to the input's dtype (``w``), their A stacked (``a_all``) and the shrink ``x A_allᵀ``."""

    x: torch.Tensor
    weight: torch.Tensor
    group: LinearGroup | None
    spans: tuple[tuple[int, int], ...]
    w: torch.Tensor | None
    a_all: torch.Tensor | None
    xa: torch.Tensor | None


class TrainingLoRA:
    """:meth:`TrainableLoRA.context`'s LoRA context."""

    def __init__(self, lora: TrainableLoRA, key: int | None, row_lens: tuple[int, ...] | None,
                 poll: Callable[[], None]):
        self.lora = lora
        self.key = key
        self.row_lens = row_lens
        self.poll = poll
        self._cast: tuple[int, torch.dtype, dict[str, tuple[torch.Tensor, torch.Tensor]]] | None = None
        # (layer, first output slice) -> the trained targets among the linear's slices, their
        # column spans and their LinearGroup: the routing of a linear, worked out on its first call
        # of the task (keyed by the first slice: a layer's linears have distinct ones)
        self._routes: dict[tuple[int, str], _Route] = {}

    def _weights(self, layer: int, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The layer's A/B, cast and split once per layer (q/k/v/o share one cast node)."""
        if self._cast is None or self._cast[:2] != (layer, dtype):
            lora = self.lora
            self._cast = (layer, dtype, lora.unpack(lora.layer_weights(layer, dtype), layer))
        return self._cast[2]

    def apply(
        self,
        layer: int,
        target: str,
        x: torch.Tensor,
        y: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
    ) -> None:
        delta = self._delta(layer, {target: y.shape[1]}, x)
        if delta is not None:
            y.add_(delta)

    def linear(
        self,
        layer: int,
        out_slices: dict[str, int],
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """``x @ weight.T + bias`` plus the LoRA output of every trained target among
        ``out_slices`` (name -> output size, in order): one autograd node
        (:class:`_LoRAGroupLinearFn` over the linear's :class:`LinearGroup` leaf, else
        :class:`_LoRALinearFn`; the targets sharing one shrink matmul) without dropout; the base
        plus a per-target delta with it (each target masks its input differently)."""
        names, spans, group = self._route(layer, out_slices)
        if not names:
            return F.linear(x, weight, bias)
        if self.key is not None:
            y = F.linear(x, weight, bias)
            self.poll()
            delta = self._delta(layer, out_slices, x)
            return y if delta is None else y + delta
        out: torch.Tensor
        if group is not None:
            # NOTE: the linear's own fp32 leaf, cast and unpacked inside the node: the per-layer
            # cast, split, eight views and A concatenation cost eleven autograd nodes per layer
            # (bf16), more than the rest of the attention half's graph on CUDA.
            out = _LoRAGroupLinearFn.apply(x, weight, bias, group.leaf, self.lora.scaling, spans, group.layout,
                                           self.poll)
            return out
        ab = self._weights(layer, x.dtype)
        a_all = torch.cat([ab[n][0] for n in names]) if len(names) > 1 else ab[names[0]][0]
        out = _LoRALinearFn.apply(x, weight, bias, a_all, self.lora.scaling, spans, self.poll,
                                  *[ab[n][1] for n in names])
        return out

    def by_hand(self, layer: int, out_slices: dict[str, int]) -> bool:
        """Whether :meth:`linear_by_hand` serves this linear: without dropout, when its trained
        targets (if any) sit in one :class:`LinearGroup`, where :meth:`linear` makes one
        :class:`_LoRAGroupLinearFn` node (or none: the base linear)."""
        if self.key is not None:
            return False
        names, _, group = self._route(layer, out_slices)
        return not names or group is not None

    def linear_by_hand(
        self, layer: int, out_slices: dict[str, int], x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, HandLinear]:
        """:meth:`linear`'s output without autograd (call under ``torch.no_grad()``; needs
        :meth:`by_hand`), the same ops, and what :meth:`linear_backward_by_hand` needs."""
        names, spans, group = self._route(layer, out_slices)
        if group is None:
            return F.linear(x, weight, bias), HandLinear(x, weight, None, spans, None, None, None)
        y, w, a_all, xa = _group_linear(x, weight, bias, group.leaf, self.lora.scaling, spans, group.layout,
                                        self.poll)
        return y, HandLinear(x, weight, group, spans, w, a_all, xa)

    def linear_backward_by_hand(self, saved: HandLinear, dy: torch.Tensor, needs_dx: bool) -> torch.Tensor | None:
        """The backward of :meth:`linear_by_hand`'s output given its gradient ``dy`` (under
        ``torch.no_grad()``): the input gradient (None unless ``needs_dx``), and the LoRA
        targets' gradient added into ``flat.grad`` as autograd's ``AccumulateGrad`` adds it (in
        place into the group leaf's ``.grad``, a view of ``flat.grad``); the same ops as
        :class:`_LoRAGroupLinearFn`'s backward, the same polls (at its start and after the input
        gradient). The base linear alone: ``dy W`` (``mm``'s derivative)."""
        group = saved.group
        if group is None:
            return torch.mm(dy, saved.weight) if needs_dx else None
        assert saved.w is not None and saved.a_all is not None and saved.xa is not None
        self.poll()
        dx, dw = _group_linear_backward(dy, saved.x, saved.weight, saved.w, saved.a_all, saved.xa,
                                        self.lora.scaling, saved.spans, group.layout, self.poll, needs_dx)
        grad = group.leaf.grad
        if grad is None:  # (bind_grads binds it; as AccumulateGrad would, else)
            group.leaf.grad = dw
        else:
            grad.add_(dw)
        return dx

    def _route(self, layer: int, out_slices: dict[str, int]) -> _Route:
        """The trained targets among ``out_slices`` (in order), their ``(offset, size)`` column
        spans in the linear's output and their :class:`LinearGroup` (None if none or not one
        span); worked out once per linear and task."""
        key = (layer, next(iter(out_slices)))
        route = self._routes.get(key)
        if route is None:
            names = [n for n in out_slices if self.lora.trains(layer, n)]
            spans, off = [], 0
            for n, size in out_slices.items():
                if n in names:
                    spans.append((off, size))
                off += size
            group = self.lora.linear_group(layer, tuple(names)) if names else None
            route = self._routes[key] = _Route(names, tuple(spans), group)
        return route

    def _delta(self, layer: int, out_slices: dict[str, int], x: torch.Tensor) -> torch.Tensor | None:
        """The LoRA output ``(drop(x) @ A.T) @ B.T · scaling`` of the targets ``out_slices``
        (name -> size, in order) as one ``[T, Σ sizes]`` tensor (zeros for targets this adapter
        does not train), or None when it trains none of them."""
        lora = self.lora
        if not any(lora.trains(layer, n) for n in out_slices):
            return None
        ab = self._weights(layer, x.dtype)
        parts = []
        for n, size in out_slices.items():
            if not lora.trains(layer, n):
                parts.append(x.new_zeros(x.shape[0], size))
                continue
            xd = x * self._mask(layer, n, x).to(x.dtype) if self.key is not None else x
            parts.append(lora_mm(lora_mm(xd, ab[n][0].T), ab[n][1].T))
        delta = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
        return delta * lora.scaling

    def _mask(self, layer: int, target: str, x: torch.Tensor) -> torch.Tensor:
        assert self.key is not None
        lens = self.row_lens if self.row_lens is not None else (x.shape[0],)
        if sum(lens) != x.shape[0]:
            raise ValueError(f"row_lens sum to {sum(lens)} but the batch has {x.shape[0]} tokens")
        lora = self.lora
        # = cat(dropout_mask(...) of each row), the keep test and scaling done once for all rows
        u = [
            dropout_uniform(lora.seed, row_dropout_key(self.key, i), layer, target, (n, x.shape[1]), x.device)
            for i, n in enumerate(lens)
        ]
        return keep_mask(torch.cat(u) if len(u) != 1 else u[0], lora.dropout)


class _LoRALinearFn(torch.autograd.Function):
    """``y = x Wᵀ + b``, then ``y[:, span_i] += (x A_iᵀ) B_iᵀ · s`` for each trained target
    ``i``, with a hand-written backward: one autograd node per linear instead of about ten.
    The base weight and bias are frozen. With ``t = [dy_i B_i]_i`` (``[T, k·r]``):
    ``dx = dy W + s · t A``, ``dA = s · tᵀ x``, ``dB_i = s · dy_iᵀ (x A_iᵀ)``.

    x: [T, in]; weight: [out, in]; a_all: [k·r, in] (the targets' A stacked); bs: k × [out_i, r].
    (:class:`_LoRAGroupLinearFn` is the same with A/B taken from one tensor.)
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        a_all: torch.Tensor,
        scaling: float,
        spans: tuple[tuple[int, int], ...],
        poll: Callable[[], None],
        *bs: torch.Tensor,
    ) -> torch.Tensor:
        y, xa = _lora_linear(x, weight, bias, a_all, bs, scaling, spans, poll)
        ctx.save_for_backward(x, weight, a_all, xa, *bs)
        ctx.scaling = scaling
        ctx.spans = spans
        ctx.poll = poll
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        ctx.poll()
        x, weight, a_all, xa, *bs = ctx.saved_tensors
        s: float = ctx.scaling
        dx, t, dys = _lora_linear_dx(dy, weight, a_all, bs, s, ctx.spans, ctx.needs_input_grad[0])
        ctx.poll()
        da = lora_mm(t.t(), x).mul_(s)
        parts = xa.chunk(len(bs), dim=1) if len(bs) > 1 else (xa,)
        dbs = [lora_mm(g.t(), part).mul_(s) for g, part in zip(dys, parts, strict=True)]
        return (dx, None, None, da, None, None, None, *dbs)


class _LoRAGroupLinearFn(torch.autograd.Function):
    """:class:`_LoRALinearFn` with the targets' A/B in one fp32 tensor ``leaf`` (a
    :class:`LinearGroup`'s, ``layout`` as there): it is cast to ``x``'s dtype and unpacked
    inside the node, and its gradient comes back whole, one ``cat`` of the pieces in ``flat``'s
    order (what the split's backward did), one scaling for all of them, one cast to fp32.

    NOTE: every value is rounded where :class:`_LoRALinearFn` rounds it (the scaling applies to
    each product elementwise, wherever it happens), so the gradients are the same bit for bit.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        leaf: torch.Tensor,
        scaling: float,
        spans: tuple[tuple[int, int], ...],
        layout: tuple[tuple[int, tuple[int, int], int, tuple[int, int]], ...],
        poll: Callable[[], None],
    ) -> torch.Tensor:
        y, w, a_all, xa = _group_linear(x, weight, bias, leaf, scaling, spans, layout, poll)
        ctx.save_for_backward(x, weight, w, a_all, xa)
        ctx.scaling = scaling
        ctx.spans = spans
        ctx.layout = layout
        ctx.poll = poll
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        ctx.poll()
        x, weight, w, a_all, xa = ctx.saved_tensors
        dx, dw = _group_linear_backward(dy, x, weight, w, a_all, xa, ctx.scaling, ctx.spans, ctx.layout, ctx.poll,
                                        ctx.needs_input_grad[0])
        return (dx, None, None, dw, None, None, None, None)


def _group_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, leaf: torch.Tensor, scaling: float,
    spans: tuple[tuple[int, int], ...], layout: tuple[tuple[int, tuple[int, int], int, tuple[int, int]], ...],
    poll: Callable[[], None],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:class:`_LoRAGroupLinearFn`'s forward (without autograd): ``(y, w = leaf in x's dtype, A
    stacked, x A_allᵀ)``."""
    w = leaf.to(x.dtype)
    a_all, bs = _unpack_group(w, layout)
    y, xa = _lora_linear(x, weight, bias, a_all, bs, scaling, spans, poll)
    return y, w, a_all, xa


def _group_linear_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, w: torch.Tensor, a_all: torch.Tensor,
    xa: torch.Tensor, s: float, spans: tuple[tuple[int, int], ...],
    layout: tuple[tuple[int, tuple[int, int], int, tuple[int, int]], ...], poll: Callable[[], None],
    needs_dx: bool,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """:class:`_LoRAGroupLinearFn`'s backward after its first poll (without autograd): ``(dx or
    None, the group leaf's gradient, fp32)``; ``poll()`` after the input gradient."""
    _, bs = _unpack_group(w, layout, stack_a=False)
    dx, t, dys = _lora_linear_dx(dy, weight, a_all, bs, s, spans, needs_dx)
    poll()
    da = lora_mm(t.t(), x).view(-1)  # [k·r·in]: A_i's gradient is its i-th chunk
    das = da.chunk(len(bs)) if len(bs) > 1 else (da,)
    parts = xa.chunk(len(bs), dim=1) if len(bs) > 1 else (xa,)
    pieces = []
    for da_i, g, part in zip(das, dys, parts, strict=True):
        pieces += [da_i, lora_mm(g.t(), part).view(-1)]
    return dx, torch.cat(pieces).mul_(s).to(torch.float32)


def _unpack_group(
    w: torch.Tensor, layout: tuple[tuple[int, tuple[int, int], int, tuple[int, int]], ...], stack_a: bool = True
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(A stacked [k·r, in], [B_i [out_i, r]])`` of a :class:`LinearGroup`'s span ``w`` (1-D,
    contiguous; ``stack_a=False``: the A stack is not made, the first value is ``w``).

    NOTE: each piece is one ``as_strided`` view (a slice and a ``view`` would be two ops)."""
    base = w.storage_offset()
    bs = [w.as_strided(b_shape, (b_shape[1], 1), base + b_off) for _, _, b_off, b_shape in layout]
    if not stack_a:
        return w, bs
    a_s = [w.as_strided(a_shape, (a_shape[1], 1), base + a_off) for a_off, a_shape, _, _ in layout]
    return (torch.cat(a_s) if len(a_s) > 1 else a_s[0]), bs


def _lora_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a_all: torch.Tensor,
    bs: Sequence[torch.Tensor], scaling: float, spans: tuple[tuple[int, int], ...],
    poll: Callable[[], None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of :class:`_LoRALinearFn`: ``(y, x A_allᵀ)``.

    NOTE: every product is rounded where the plain formula rounds it (the matmul, then its
    scaling, then the add), so the values are those of the per-op version bit for bit; the host
    cost is cut elsewhere: targets whose columns sit side by side (q/k/v all trained) are scaled
    and added as one ``cat`` (three kernels instead of six, nine ops instead of fifteen), the
    others added in place into ``narrow`` views (a slice assignment is an extra slice and a
    self-``copy_``); no one-piece ``split`` for a single target (``o_proj``); scalings in place.
    """
    y = F.linear(x, weight, bias)
    poll()
    xa = lora_mm(x, a_all.t())
    if len(bs) == 1:
        (off, size), b = spans[0], bs[0]
        (y if size == y.shape[1] else y.narrow(1, off, size)).add_(lora_mm(xa, b.t()).mul_(scaling))
        return y, xa
    parts = xa.chunk(len(bs), dim=1)
    first, (last, last_size) = spans[0][0], spans[-1]
    if last + last_size - first == sum(size for _, size in spans):  # side by side
        delta = torch.cat([lora_mm(part, b.t()) for part, b in zip(parts, bs, strict=True)], dim=1)
        out = y if delta.shape[1] == y.shape[1] else y.narrow(1, first, delta.shape[1])
        out.add_(delta.mul_(scaling))
        return y, xa
    for (off, size), part, b in zip(spans, parts, bs, strict=True):
        y.narrow(1, off, size).add_(lora_mm(part, b.t()).mul_(scaling))
    return y, xa


def _lora_linear_dx(
    dy: torch.Tensor, weight: torch.Tensor, a_all: torch.Tensor, bs: Sequence[torch.Tensor], s: float,
    spans: tuple[tuple[int, int], ...], needs_dx: bool,
) -> tuple[torch.Tensor | None, torch.Tensor, list[torch.Tensor]]:
    """The backward's shared part: ``(dx or None, t = [dy_i B_i]_i, [dy_i])`` (no one-piece
    ``cat`` for a single target)."""
    dys = [dy if size == dy.shape[1] else dy.narrow(1, off, size) for off, size in spans]
    ts = [lora_mm(g, b) for g, b in zip(dys, bs, strict=True)]
    t = torch.cat(ts, dim=1) if len(ts) > 1 else ts[0]
    dx = torch.mm(dy, weight) if needs_dx else None
    if dx is not None and _in_fp32(t):
        dx.add_(torch.mm(t.float(), a_all.float()).mul_(s))  # (one rounding, as addmm_'s)
    elif dx is not None:
        dx.addmm_(t, a_all, alpha=s)
    return dx, t, dys

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from coserve.layers.lora import LoRAContext, dropout_mask, row_dropout_key
from coserve.models.peft_adapter import LORA_TARGETS, LoraAdapter

StacksFn = Callable[[int, str], tuple[torch.Tensor, torch.Tensor]]
"""``(layer, target) -> (A_stack [S, r_max, in], B_stack [S, out, r_max])`` of the serving model."""


@dataclass(frozen=True)
class _Slice:
    """Where one ``(layer, target)`` pair lives in ``flat``."""

    a_off: int
    a_shape: tuple[int, int]  # [r, in]
    b_off: int
    b_shape: tuple[int, int]  # [out, r]


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

    @property
    def numel(self) -> int:
        return self.flat.numel()

    def trains(self, layer: int, target: str) -> bool:
        """Whether this adapter has weights for ``(layer, target)``."""
        return (layer, target) in self._slices

    def a(self, layer: int, target: str) -> torch.Tensor:
        """View ``[r, in]`` of ``A`` of ``(layer, target)`` into ``flat``."""
        s = self._slices[(layer, target)]
        return self.flat[s.a_off : s.a_off + s.a_shape[0] * s.a_shape[1]].view(s.a_shape)

    def b(self, layer: int, target: str) -> torch.Tensor:
        """View ``[out, r]`` of ``B`` of ``(layer, target)`` into ``flat``."""
        s = self._slices[(layer, target)]
        return self.flat[s.b_off : s.b_off + s.b_shape[0] * s.b_shape[1]].view(s.b_shape)

    def to_adapter(self, base_model_name_or_path: str | None = None) -> LoraAdapter:
        """An fp32 CPU copy of the current weights (for ``save_peft_adapter``)."""
        with torch.no_grad():
            weights = {
                key: (self.a(*key).detach().cpu().clone(), self.b(*key).detach().cpu().clone())
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
            scales[slot] = self.scaling

    def context(
        self, dropout_key: int | None = None, row_lens: Sequence[int] | None = None
    ) -> LoRAContext:
        """A :class:`LoRAContext` under which every token of the batch uses this adapter:

        ``y += (drop(x) @ a.T) @ b.T · scaling`` (``a``/``b`` cast to ``x.dtype``; autograd flows
        into ``flat``). The batch is the rows ``row_lens`` back to back (one row of all tokens
        when None); row ``i``'s mask is ``dropout_mask(seed, row_dropout_key(dropout_key, i),
        layer, target, (n_i, in), dropout)``. No dropout when ``dropout == 0`` or
        ``dropout_key`` is None. The stacks the linears pass in are ignored.
        """
        key = dropout_key if self.dropout > 0 else None
        return _TrainingLoRA(self, key, None if row_lens is None else tuple(row_lens))


class _TrainingLoRA:
    """:meth:`TrainableLoRA.context`'s LoRA context."""

    def __init__(self, lora: TrainableLoRA, key: int | None, row_lens: tuple[int, ...] | None):
        self.lora = lora
        self.key = key
        self.row_lens = row_lens

    def apply(
        self,
        layer: int,
        target: str,
        x: torch.Tensor,
        y: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
    ) -> None:
        lora = self.lora
        if not lora.trains(layer, target):
            return
        if self.key is not None:
            x = x * self._mask(layer, target, x).to(x.dtype)
        la, lb = lora.a(layer, target).to(x.dtype), lora.b(layer, target).to(x.dtype)
        y.add_(((x @ la.T) @ lb.T) * lora.scaling)

    def _mask(self, layer: int, target: str, x: torch.Tensor) -> torch.Tensor:
        assert self.key is not None
        lens = self.row_lens if self.row_lens is not None else (x.shape[0],)
        if sum(lens) != x.shape[0]:
            raise ValueError(f"row_lens sum to {sum(lens)} but the batch has {x.shape[0]} tokens")
        lora = self.lora
        masks = [
            dropout_mask(
                lora.seed,
                row_dropout_key(self.key, i),
                layer,
                target,
                (n, x.shape[1]),
                lora.dropout,
                x.device,
            )
            for i, n in enumerate(lens)
        ]
        return torch.cat(masks) if len(masks) != 1 else masks[0]

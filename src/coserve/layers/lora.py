"""Multi-LoRA batching: linear layers whose rows may each use a different adapter.

Every LoRA-capable linear keeps, per output slice (``q_proj``, ``k_proj``, ... of a fused
projection), a stack of adapter weights indexed by adapter slot:
``A: [S, r_max, in]``, ``B: [S, out, r_max]``. An adapter of rank ``r < r_max`` occupies the
first ``r`` rows of A / columns of B, the rest stay zero. The stacks of a linear's ``k`` slices
are views into two buffers, ``A_all: [S, k·r_max, in]`` and ``B_all: [S, Σ out, r_max]``, so a
LoRA context can serve all slices at once (they share the input). Slots are allocated once;
loading an adapter or a training update writes into them in place (kernels and the trainer hold
their addresses).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from coserve.core.messages import row_dropout_key as row_dropout_key  # re-exported for the trainer
from coserve.host_copy import to_device
from coserve.layers.triton_lora import TritonLoRA, slice_stacks


@dataclass
class LoRABatch:
    """Adapter routing of one flat batch: tokens ``[seg_starts[i], seg_starts[i+1])`` use slot
    ``seg_slots[i]`` (-1: no adapter). Consecutive rows of the same slot share one segment."""

    seg_starts: list[int]
    seg_slots: list[int]
    token_slots: torch.Tensor  # [T] int64, for kernels

    @classmethod
    def from_rows(
        cls, row_lens: list[int], row_slots: list[int], device: torch.device | str = "cpu"
    ) -> LoRABatch:
        starts: list[int] = [0]
        slots: list[int] = []
        for n, s in zip(row_lens, row_slots, strict=True):
            if slots and slots[-1] == s:
                starts[-1] += n
            else:
                slots.append(s)
                starts.append(starts[-1] + n)
        # NOTE: one fill per segment, not torch.repeat_interleave, whose CPU kernel runs a parallel
        # loop with a grain of one repeat: waking the OpenMP threads took 0.65–7.6 ms per step on
        # the H200's host (bench/results/engine_h200/session9: profile_lora's gaps in runner.prepare)
        tokens = torch.cat([torch.full((b - a,), slot, dtype=torch.int64)
                            for slot, a, b in zip(slots, starts, starts[1:], strict=False)]
                           ) if slots else torch.empty(0, dtype=torch.int64)
        return cls(seg_starts=starts, seg_slots=slots, token_slots=to_device(tokens, device))

    @property
    def active(self) -> bool:
        return any(s >= 0 for s in self.seg_slots)

    @property
    def seg_lens(self) -> list[int]:
        return [e - s for s, e in zip(self.seg_starts, self.seg_starts[1:], strict=False)]


def lora_segments_ref(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    batch: LoRABatch,
) -> None:
    """Segmented gather-matmul, in place:
    ``y[s[i]:s[i+1]] += (x[s[i]:s[i+1]] @ a[idx[i]].T) @ b[idx[i]].T · scale[idx[i]]``.

    y: [T, out] (may be a column slice of a larger output), x: [T, in],
    a: [S, r, in], b: [S, out, r], scale: [S] fp32; idx = batch.seg_slots, -1 skipped.
    """
    for i, slot in enumerate(batch.seg_slots):
        if slot < 0:
            continue
        s, e = batch.seg_starts[i], batch.seg_starts[i + 1]
        delta = (x[s:e] @ a[slot].T) @ b[slot].T
        y[s:e] += delta * scale[slot].to(delta.dtype)


class LoRAContext(Protocol):
    """Decides how a LoRA linear adds its adapters' contribution for the current batch.

    May change: ``y`` (the slice of this linear's output for ``target``), in place.
    """

    def apply(
        self,
        layer: int,
        target: str,
        x: torch.Tensor,
        y: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
    ) -> None: ...


class FusedLoRAContext(LoRAContext, Protocol):
    """A LoRA context that can also serve every output slice of a fused linear in one go;
    :class:`LoRALinear` calls :meth:`apply_fused` instead of :meth:`apply` when the context has it.
    """

    def apply_fused(
        self,
        layer: int,
        x: torch.Tensor,
        y: torch.Tensor,
        a_all: torch.Tensor,
        b_all: torch.Tensor,
        out_slices: dict[str, int],
    ) -> None:
        """Like :meth:`apply` for each slice of ``out_slices`` (name -> out size, in order) at once.

        x: [T, in], y: [T, Σ out] (the linear's whole output, in place), a_all: [S, k·r, in]
        (slice ``i``'s A in rows ``[i·r, (i+1)·r)``), b_all: [S, Σ out, r] (slice ``i``'s B in
        rows ``[off_i, off_i + out_i)``, its columns of ``y``); see :func:`slice_stacks`.
        """
        ...


@dataclass
class StackedLoRA:
    """The engine's LoRA context: per-slot stacks routed by a :class:`LoRABatch`."""

    batch: LoRABatch
    scales: torch.Tensor  # [S] fp32

    def apply(
        self, layer: int, target: str, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor
    ) -> None:
        lora_segments_ref(y, x, a, b, self.scales, self.batch)


LoRAOp = Callable[[LoRABatch, torch.Tensor], LoRAContext]
"""Builds the LoRA context of one step from its routing and the per-slot scales ``[S]`` fp32."""

LORA_OPS: dict[str, LoRAOp] = {"torch": StackedLoRA, "triton": TritonLoRA.from_batch}


def get_lora_op(name: str) -> LoRAOp:
    try:
        return LORA_OPS[name]
    except KeyError:
        raise ValueError(f"unknown LoRA backend {name!r}; available: {', '.join(sorted(LORA_OPS))}") from None


class LoRALinear(nn.Module):
    """A (possibly fused) linear layer ``y = x Wᵀ + bias`` plus multi-LoRA on each output slice.

    ``out_slices`` names the fused outputs in order, e.g. ``{"q_proj": 4096, "k_proj": 1024, ...}``.
    x: [T, in] -> y: [T, sum(out_slices)].
    """

    lora_a_all: torch.Tensor  # [S, k·r_max, in] buffer (only when there are adapter slots)
    lora_b_all: torch.Tensor  # [S, Σ out, r_max] buffer

    def __init__(
        self,
        layer: int,
        in_features: int,
        out_slices: dict[str, int],
        bias: bool,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.in_features = in_features
        self.out_slices = dict(out_slices)
        out = sum(out_slices.values())
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out, dtype=dtype), requires_grad=False) if bias else None
        self.offsets: dict[str, int] = {}
        off = 0
        for name, size in out_slices.items():
            self.offsets[name] = off
            off += size
        self.max_rank = max_rank
        self._index = {name: i for i, name in enumerate(out_slices)}
        self.has_lora = num_slots > 0
        # Whether an adapter of the step's rows targets one of this linear's slices: an inference
        # step skips the LoRA kernels of the linears none targets (their slots' weights there are
        # zero). Set per step by ModelRunner from the adapters' declared targets; True when unknown.
        self.lora_live = True
        if self.has_lora:
            # Every slice's stacks in one buffer each (see the module docstring): A_all, B_all.
            k = len(out_slices)
            self.register_buffer("lora_a_all", torch.zeros(num_slots, k * max_rank, in_features, dtype=dtype))
            self.register_buffer("lora_b_all", torch.zeros(num_slots, out, max_rank, dtype=dtype))

    def lora_stacks(self, target: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(A [S, r, in], B [S, out, r])`` stacks of one output slice: views into
        ``lora_a_all``/``lora_b_all`` (write them in place)."""
        if not self.has_lora:
            raise AttributeError(f"layer {self.layer} {target}: this linear has no adapter slots")
        i, r, off = self._index[target], self.max_rank, self.offsets[target]
        return self.lora_a_all[:, i * r : (i + 1) * r], self.lora_b_all[:, off : off + self.out_slices[target]]

    def forward(self, x: torch.Tensor, lora: LoRAContext | None = None) -> torch.Tensor:
        fused = getattr(lora, "linear", None) if self.has_lora else None
        if fused is not None:
            # The trainer's recompute: base and LoRA in one autograd node (TrainableLoRA.context).
            out: torch.Tensor = fused(self.layer, self.out_slices, x, self.weight, self.bias)
            return out
        if not self.lora_live:
            return F.linear(x, self.weight, self.bias)
        whole = getattr(lora, "whole_linear", None) if self.has_lora else None
        if whole is not None:
            # A context that orders base GEMM and LoRA its own way: the shrink beside the GEMM in
            # captured decode graphs (ForkedTritonLoRA), the LoRA delta first in large eager steps
            # with COSERVE_LORA_EXPAND_FIRST (ExpandFirstTritonLoRA).
            out = whole(self.layer, x, self.weight, self.bias, self.lora_a_all, self.lora_b_all, self.out_slices)
            return out
        y = F.linear(x, self.weight, self.bias)
        if lora is not None and self.has_lora:
            apply_fused = getattr(lora, "apply_fused", None)
            if apply_fused is not None:
                apply_fused(self.layer, x, y, self.lora_a_all, self.lora_b_all, self.out_slices)
            else:
                for name, off, a, b in slice_stacks(self.lora_a_all, self.lora_b_all, self.out_slices):
                    lora.apply(self.layer, name, x, y[:, off : off + self.out_slices[name]], a, b)
        return y


def dropout_mask(
    seed: int,
    key: int,
    layer: int,
    target: str,
    shape: tuple[int, int],
    p: float,
    device: torch.device | str,
) -> torch.Tensor:
    """Inverted-dropout keep-mask ``m[t, j] = 1{u[t, j] >= p} / (1 - p)``, ``u ~ U[0, 1)``.

    ``u`` is drawn from a ``torch.Generator`` on ``device`` seeded with a hash of
    ``(seed, key, layer, target)``, so the mask depends on those and ``shape`` only (and on the
    device type: CPU and CUDA generators differ). Apply it as ``x * m.to(x.dtype)``.
    shape: ``(T, in)`` -> fp32 ``[T, in]`` on ``device``.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout p must be in [0, 1), got {p}")
    return keep_mask(dropout_uniform(seed, key, layer, target, shape, device), p)


def dropout_uniform(
    seed: int, key: int, layer: int, target: str, shape: tuple[int, int], device: torch.device | str
) -> torch.Tensor:
    """The ``u`` of :func:`dropout_mask`: fp32 ``[T, in]`` on ``device``."""
    gen = torch.Generator(device=device).manual_seed(_hash64("dropout", seed, key, layer, target))
    return torch.rand(shape, generator=gen, device=device, dtype=torch.float32)


def keep_mask(u: torch.Tensor, p: float) -> torch.Tensor:
    """:func:`dropout_mask`'s mask from its ``u`` (elementwise: the masks of several rows come
    from their ``u`` concatenated, in three ops instead of three per row)."""
    return (u >= p).to(torch.float32).mul_(1.0 / (1.0 - p))


def _hash64(*parts: object) -> int:
    # Python's hash() is salted per process; the engine and the trainer are different processes.
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return struct.unpack("<Q", digest)[0] >> 1  # manual_seed wants a non-negative int64


@dataclass
class RowDropoutLoRA:
    """The engine's LoRA context when fine-tuning rows use LoRA dropout.

    ``inner`` serves every other row (the dropout rows are routed to slot -1 in its batch; None
    when no other row has an adapter); fine-tuning row ``(start, n, key)`` gets
    ``y += (x·m) @ A[slot].T @ B[slot].T · scale[slot]`` with
    ``m = dropout_mask(seed, key, layer, target, (n, in), p)``: the masks the trainer's recompute
    applies to the same row.
    """

    inner: LoRAContext | None
    slot: int
    rows: list[tuple[int, int, int]]
    seed: int
    p: float
    scales: torch.Tensor

    def apply(
        self, layer: int, target: str, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor
    ) -> None:
        if self.inner is not None:
            self.inner.apply(layer, target, x, y, a, b)
        self._apply_rows(layer, target, x, y, a, b)

    def apply_fused(
        self,
        layer: int,
        x: torch.Tensor,
        y: torch.Tensor,
        a_all: torch.Tensor,
        b_all: torch.Tensor,
        out_slices: dict[str, int],
    ) -> None:
        """:meth:`apply` of every slice (the inner context's fused path where it has one)."""
        slices = list(slice_stacks(a_all, b_all, out_slices))
        inner_fused = getattr(self.inner, "apply_fused", None)
        if inner_fused is not None:
            inner_fused(layer, x, y, a_all, b_all, out_slices)
        elif self.inner is not None:
            for name, off, a, b in slices:
                self.inner.apply(layer, name, x, y[:, off : off + out_slices[name]], a, b)
        for name, off, a, b in slices:
            self._apply_rows(layer, name, x, y[:, off : off + out_slices[name]], a, b)

    def _apply_rows(
        self, layer: int, target: str, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor
    ) -> None:
        scale = self.scales[self.slot]
        for start, n, key in self.rows:
            m = dropout_mask(self.seed, key, layer, target, (n, x.shape[1]), self.p, x.device)
            xs = x[start : start + n] * m.to(x.dtype)
            delta = (xs @ a[self.slot].T) @ b[self.slot].T
            y[start : start + n] += delta * scale.to(delta.dtype)

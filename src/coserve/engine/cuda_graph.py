"""CUDA graphs for decode-only steps, one per batch-size bucket (and per "any adapter in use").

A decode step of ``n`` rows runs the graph of the smallest bucket ``b >= n``; rows ``n..b`` are
padding (no KV slot, no cached context, no adapter), so they read and write nothing that matters.
Everything that changes between steps is a static device buffer the graph reads:

    input_ids, positions [b] int64 · slot_mapping [b] int64 · context_lens [b] int32
    block_tables [b, W] int32 · token_slots [b] int64 (adapter slot of each row, -1 none)
    lora_order [graph_order_length(b, S)] int32 (rows with an adapter grouped by slot, one slot
    per tile, -1 padded; see layers.triton_lora)

``run`` fills pinned host staging buffers, copies them in (one stream, so the copies finish
before the replay starts), replays, and returns the first ``n`` rows of the static logits.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from coserve.layers.attention import AttentionBackend, AttentionMetadata
from coserve.layers.triton_lora import (
    ForkedTritonLoRA,
    TritonLoRA,
    block_m_for,
    graph_order_length,
    order_by_slot,
)
from coserve.models.llama import ForwardContext, LlamaForCausalLM

if TYPE_CHECKING:
    from coserve.engine.model_runner import BatchRow

logger = logging.getLogger(__name__)

LORA_FORK = os.environ.get("COSERVE_LORA_FORK", "1") == "1"
"""Captured decode steps with adapters run each LoRA shrink on a side stream, beside the base
GEMM (:meth:`coserve.layers.triton_lora.ForkedTritonLoRA.whole_linear`). On by default: on the H200 it
cut the LoRA overhead of decode steps at batch 1/16/64 from +29/24/16% to +13/14/8%
(``bench/results/engine_h200/session6/``); ``COSERVE_LORA_FORK=0`` turns it off."""


def capture_graphs(steps: Sequence[Callable[[], None]], device: torch.device, pool: Any,
                   warmups: int = 1) -> list[torch.cuda.CUDAGraph]:
    """Run ``steps`` in order ``warmups`` times on a side stream (Triton compiles its kernels and
    cuBLAS creates its handles there, outside any capture), then capture each step into its own
    graph in the memory pool ``pool``."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            for step in steps:
                step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graphs = []
    for step in steps:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            step()
        graphs.append(graph)
    return graphs


@dataclass(frozen=True)
class GraphKey:
    batch_size: int
    with_lora: bool


class DecodeGraphs:
    """Captured decode steps. ``capture=False`` runs the same static-buffer path eagerly (CPU tests).

    May change: the KV cache at the decode rows' new slots (as an eager step would) and its own
    static buffers. Must hold: ``run(rows)`` equals an eager step over the same rows.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        lora_scales: torch.Tensor,
        batch_sizes: Sequence[int],
        max_model_len: int,
        block_size: int,
        capture: bool = True,
    ) -> None:
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.lora_scales = lora_scales
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.capture = capture
        self.device = kv_cache.device
        self.width = -(-max_model_len // block_size)
        bmax = self.batch_sizes[-1]
        pin = self.device.type == "cuda"
        self.num_slots = model.num_lora_slots
        order_max = max(graph_order_length(b, self.num_slots) for b in self.batch_sizes)

        def dev(*shape: int, dtype: torch.dtype, fill: int) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, device=self.device)

        def host(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        # One device buffer per dtype so each step needs three host-to-device copies.
        self._d_rows = dev(4, bmax, dtype=torch.long, fill=0)
        self._d_ctx = dev(2, max(bmax, order_max), dtype=torch.int32, fill=0)
        self.input_ids, self.positions, self.slot_mapping, self.token_slots = self._d_rows.unbind(0)
        self.context_lens, self.lora_order = self._d_ctx[0, :bmax], self._d_ctx[1]
        self.block_tables = dev(bmax, self.width, dtype=torch.int32, fill=0)
        self.cu_seqlens = torch.arange(bmax + 1, dtype=torch.int32, device=self.device)
        self._h_rows = host(4, bmax, dtype=torch.long)
        self._h_ctx = host(2, self._d_ctx.shape[1], dtype=torch.int32)
        self._h_tables = host(bmax, self.width, dtype=torch.int32)
        self._reset_inputs()
        self._copied: torch.cuda.Event | None = None
        self.logits = torch.empty(bmax, model.config.vocab_size, dtype=torch.float32, device=self.device)
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self._lora_stream = torch.cuda.Stream(self.device) if capture and LORA_FORK else None
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def bucket(self, n: int) -> int | None:
        """The smallest captured batch size ``>= n`` (None when ``n`` exceeds the largest)."""
        return next((b for b in self.batch_sizes if b >= n), None)

    def accepts(self, rows: Sequence[BatchRow]) -> bool:
        """A step runs as a graph iff every row is a sampling, KV-writing decode row that fits."""
        if not rows or len(rows) > self.max_batch_size:
            return False
        return all(
            not r.is_prefill and r.writes_kv and r.samples and len(r.token_ids) == 1
            and r.context_len < self.max_model_len and len(r.block_table) <= self.width
            for r in rows
        )

    def _reset_inputs(self) -> None:
        """Every row padding: token 0 at position 0, no slot, no context, no adapter."""
        self._d_rows.copy_(torch.tensor([0, 0, -1, -1], device=self.device)[:, None].expand_as(self._d_rows))
        self._d_ctx.copy_(torch.tensor([0, -1], device=self.device)[:, None].expand_as(self._d_ctx))

    def _forward(self, key: GraphKey) -> None:
        b = key.batch_size
        meta = AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens[: b + 1],
            context_lens=self.context_lens[:b],
            block_tables=self.block_tables[:b],
            slot_mapping=self.slot_mapping[:b],
            num_prefill_rows=0,
            num_prefill_tokens=0,
            q_lens=[1] * b,
            # NOTE: backends size their launches from these host lists; the graph must cover any
            # context, so they say "the longest".
            context_lens_list=[self.max_model_len] * b,
            block_tables_list=[],
        )
        lora: TritonLoRA | None = None
        if key.with_lora and self._lora_stream is not None:
            lora = ForkedTritonLoRA.for_graph(self.token_slots, self.lora_order, self.lora_scales, b,
                                              self.num_slots, side_stream=self._lora_stream)
        elif key.with_lora:
            lora = TritonLoRA.for_graph(self.token_slots, self.lora_order, self.lora_scales, b, self.num_slots)
        ctx = ForwardContext(attn=meta, kv_cache=self.kv_cache, lora=lora, backend=self.backend)
        hidden = self.model(self.input_ids[:b], self.positions[:b], ctx)
        self.logits[:b].copy_(self.model.compute_logits(hidden))

    def _capture(self, key: GraphKey) -> torch.cuda.CUDAGraph:
        logger.info("capturing decode graph: batch %d, lora %s", key.batch_size, key.with_lora)
        self._reset_inputs()
        return capture_graphs([lambda: self._forward(key)], self.device, self._pool, warmups=2)[0]

    def capture_all(self, with_lora: bool) -> None:
        """Capture every bucket up front (the engine's warm-up); largest first so memory is reused."""
        for b in reversed(self.batch_sizes):
            key = GraphKey(b, with_lora)
            if key not in self.graphs:
                self.graphs[key] = self._capture(key)

    def run(self, rows: Sequence[BatchRow]) -> torch.Tensor:
        """Run one decode step; returns fp32 logits ``[len(rows), V]`` (a fresh tensor)."""
        n = len(rows)
        b = self.bucket(n)
        assert b is not None and self.accepts(rows)
        with_lora = self.model.num_lora_slots > 0 and any(r.lora_slot >= 0 for r in rows)
        self._stage(rows, b)
        key = GraphKey(b, with_lora)
        if not self.capture:
            self._forward(key)
        else:
            if key not in self.graphs:
                self.graphs[key] = self._capture(key)
                self._stage(rows, b)  # capture's warm-up overwrote the static inputs
            self.graphs[key].replay()
        return self.logits[:n].clone()

    def _stage(self, rows: Sequence[BatchRow], b: int) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have read the staging buffers
        n, bs = len(rows), self.block_size
        h_rows, h_ctx, tables = self._h_rows.numpy(), self._h_ctx.numpy(), self._h_tables.numpy()
        h_rows[:, n:b] = np.array([0, 0, -1, -1])[:, None]
        h_ctx[0, n:b] = 0
        for i, r in enumerate(rows):
            ctx = r.context_len
            h_rows[:, i] = (r.token_ids[0], ctx, r.block_table[ctx // bs] * bs + ctx % bs, r.lora_slot)
            h_ctx[0, i] = ctx
            tables[i, : len(r.block_table)] = r.block_table
        order = order_by_slot([1] * n, [r.lora_slot for r in rows], block_m_for(b))
        h_ctx[1, :] = -1
        h_ctx[1, : len(order)] = order
        cuda = self.device.type == "cuda"
        self._d_rows.copy_(self._h_rows, non_blocking=cuda)
        self._d_ctx.copy_(self._h_ctx, non_blocking=cuda)
        self.block_tables[:b].copy_(self._h_tables[:b], non_blocking=cuda)
        if cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()


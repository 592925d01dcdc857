"""Piecewise CUDA graphs for eager inference steps (on by default on CUDA: ``EngineConfig.prefill_graphs``).

An eager step of ``T`` tokens launches ~70 kernels per layer from Python; on the H200 its host
side took nearly as long as its GPU side (DEVELOPERS.md, "piecewise CUDA graphs"). Everything
between two attention calls is token-wise, so it can be captured once per token-count bucket
``B >= T`` and replayed: segment ``i`` is layer ``i−1``'s ``finish`` (``o_proj``, residual add
and norm, MLP), the next residual add and norm, and layer ``i``'s ``project`` (qkv, RoPE); only
the attention, whose launches depend on the step's rows, runs eagerly between segments. A step
costs ``L + 1`` replays and ``L`` attention calls. Each segment also writes its layer's new KV
(:meth:`AttentionBackend.store` over a static slot buffer, padding rows at slot -1), and the
attention writes its output into the static buffer the next segment reads: per layer, the
eager part launches only the attention kernels themselves.

Everything that flows between segments lives in static buffers (``[B_max, ...]``, each bucket
uses the first ``B`` rows): input ids and positions, the residual stream, q/k/v, the attention
output. Rows ``T..B`` are padding (token 0 at position 0): token-wise work on them is wasted but
harmless, and the attention only ever sees the first ``T`` rows. Steps with adapter rows (the
fine-tuning rows' training slot too) replay a second set of graphs whose multi-LoRA reads its
routing (token slots, slot-grouped order) from static buffers, as the decode graphs do; that set
runs every linear's LoRA. A set captured for one set of ``(layer, target)`` pairs
(:meth:`add_live_variant`: the training adapter's q/k/v/o) runs the LoRA of those linears
only, and replays the steps whose adapters target exactly those (a step of FT rows beside
inference rows without adapters): the MLP's LoRA kernels, which such a step's eager run skips
too, are not in its graphs. The fine-tuning capture hook runs between segments on the residual
buffer (eager). Steps with LoRA dropout rows, kept MLP activations or more than ``B_max`` tokens
stay eager (:meth:`accepts`).

``capture=False`` runs the same segments eagerly through the same buffers (the CPU tests).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence

import torch

from coserve.engine.cuda_graph import capture_graphs
from coserve.layers.attention import AttentionBackend, AttentionMetadata
from coserve.layers.lora import LoRABatch
from coserve.layers.triton_lora import (
    SMALL_STEP_TOKENS,
    ExpandFirstTritonLoRA,
    TritonLoRA,
    block_m_for,
    graph_order_length,
    graph_store_length,
    routing_tensor,
)
from coserve.models.llama import (
    DecoderLayer,
    ForwardContext,
    LayerHook,
    LlamaForCausalLM,
    add_and_norm,
)

logger = logging.getLogger(__name__)

GRAPH_EXPAND_FIRST = os.environ.get("COSERVE_LORA_GRAPH_EXPAND_FIRST", "0") == "1"
"""The prefill graphs of more than ``SMALL_STEP_TOKENS`` tokens run each fused linear LoRA first,
as large eager steps do (:class:`ExpandFirstTritonLoRA`: the delta stored through a static
routing of every row, then the base GEMM with beta = 1). Off until measured: session 9 measured
the graphs' LoRA at 2,048 tokens +9.7 ms against the eager step's +6.4 ms (expand-first)."""

Live = frozenset[tuple[int, str]] | None
"""``(layer, target)`` pairs whose LoRA a step needs (None: every linear's)."""
Variant = bool | frozenset[tuple[int, str]]
"""Which LoRA a set of graphs runs: False none, True every linear's, a set those linears'."""


class PrefillGraphs:
    """Segment graphs per bucket; :meth:`run` is one eager-equivalent forward to the final norm."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, backend: AttentionBackend,
                 buckets: Sequence[int], capture: bool = True, lora_scales: torch.Tensor | None = None,
                 set_live: Callable[[Live], None] | None = None) -> None:
        if not buckets or any(b <= 0 for b in buckets):
            raise ValueError(f"prefill graph buckets must be positive token counts, got {list(buckets)}")
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.buckets = tuple(sorted(set(buckets)))
        self.capture = capture
        self.layers = [layer for layer in model.model.layers if isinstance(layer, DecoderLayer)]
        cfg = model.config
        device, dtype, bmax = kv_cache.device, model.lm_head_weight.dtype, self.buckets[-1]

        def buf(*shape: int, kind: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=kind, device=device)

        self.input_ids = buf(bmax, kind=torch.long)
        self.positions = buf(bmax, kind=torch.long)
        self.residual = buf(bmax, cfg.hidden_size)  # the current layer's input h_i
        self.q = buf(bmax, cfg.num_heads, cfg.head_dim)
        self.k = buf(bmax, cfg.num_kv_heads, cfg.head_dim)
        self.v = buf(bmax, cfg.num_kv_heads, cfg.head_dim)
        self.o = buf(bmax, cfg.q_size)
        self.slots = torch.full((bmax,), -1, dtype=torch.long, device=device)  # the step's slot_mapping
        self.final = buf(bmax, cfg.hidden_size)  # h_L
        self.out = buf(bmax, cfg.hidden_size)  # final_norm(h_L)
        # Multi-LoRA routing (with lora_scales: steps with adapter rows run here too)
        self.lora_scales = lora_scales
        self.num_slots = model.num_lora_slots
        order_max = max(graph_order_length(b, max(self.num_slots, 1)) for b in self.buckets)
        self.token_slots = torch.full((bmax,), -1, dtype=torch.long, device=device)
        self.lora_order = torch.full((order_max,), -1, dtype=torch.int32, device=device)
        # buckets above this many tokens store their LoRA delta first (GRAPH_EXPAND_FIRST), through
        # this order of every row (None: none does)
        self.expand_first_above: int | None = SMALL_STEP_TOKENS if GRAPH_EXPAND_FIRST else None
        store_max = max(graph_store_length(b, self.num_slots) for b in self.buckets)
        self.store_order = torch.full((store_max,), -1, dtype=torch.int32, device=device)
        # (bucket, variant) -> its segments' graphs; variant False: no LoRA, True: every linear's
        # LoRA, a frozenset of (layer, target) pairs: those linears' LoRA only
        self.graphs: dict[tuple[int, Variant], list[torch.cuda.CUDAGraph]] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        # the live sets with graphs of their own, and how to switch the linears' LoRA on and off
        # (ModelRunner.set_live: None every linear, else the set's)
        self.live_variants: set[frozenset[tuple[int, str]]] = set()
        self._set_live = set_live

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def bucket(self, num_tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= num_tokens), None)

    def accepts(self, num_tokens: int, lora_active: bool) -> bool:
        """Whether a step of ``num_tokens`` runs here (the caller has checked that it has no LoRA
        dropout rows and no MLP hook); adapter rows only with ``lora_scales``."""
        return 0 < num_tokens <= self.max_tokens and (not lora_active or self.lora_scales is not None)

    def _expand_first(self, b: int) -> bool:
        return self.expand_first_above is not None and b > self.expand_first_above

    def _lora(self, b: int, with_lora: bool) -> TritonLoRA | None:
        if not with_lora:
            return None
        assert self.lora_scales is not None
        if self._expand_first(b):
            store = TritonLoRA.graph_store(self.store_order, b, self.num_slots)
            return ExpandFirstTritonLoRA.for_graph(self.token_slots, self.lora_order, self.lora_scales, b,
                                                   self.num_slots, store=store)
        return TritonLoRA.for_graph(self.token_slots, self.lora_order, self.lora_scales, b, self.num_slots)

    # ------------------------------------------------------------------ segments

    def _segment(self, i: int, b: int, lora: TritonLoRA | None) -> None:
        """Segment ``i`` of bucket ``b``: ``finish`` of layer ``i−1`` (none for ``i = 0``: the
        embeddings), the residual add and norm, then ``project`` of layer ``i`` (the final norm
        into :attr:`out` for ``i = L``)."""
        model, rotary = self.model, self.model.rotary
        if i == 0:
            hidden, delta = model.embed(self.input_ids[:b]), None
        else:
            hidden, delta = self.layers[i - 1].finish(self.o[:b], self.residual[:b], lora)
        if i == len(self.layers):
            hidden, normed = add_and_norm(model.model.norm, hidden, delta)
            self.final[:b].copy_(hidden)
            self.out[:b].copy_(normed)
            return
        layer = self.layers[i]
        hidden, normed = add_and_norm(layer.input_layernorm, hidden, delta)
        self.residual[:b].copy_(hidden)
        q, k, v = layer.self_attn.project(normed, self.positions[:b], rotary, lora)
        self.q[:b].copy_(q)
        self.k[:b].copy_(k)
        self.v[:b].copy_(v)
        self.backend.store(self.k[:b], self.v[:b], self.kv_cache[:, i], self.slots[:b])

    def variant(self, lora_active: bool, live: Live) -> Variant:
        """The graphs a step replays: none of LoRA, those of its adapters' live set ``live`` where
        :meth:`add_live_variant` made them, else every linear's."""
        if not lora_active:
            return False
        return live if live is not None and live in self.live_variants else True

    def _live_for(self, variant: Variant) -> None:
        """The linears' LoRA flags for running ``variant``'s segments (every linear for True)."""
        if self._set_live is not None and variant is not False:
            self._set_live(variant if isinstance(variant, frozenset) else None)

    @torch.no_grad()
    def _capture(self, b: int, variant: Variant) -> list[torch.cuda.CUDAGraph]:
        what = "all linears" if variant is True else "none" if variant is False else f"{len(variant)} linears"
        logger.info("capturing prefill graphs: %d tokens, lora %s, %d segments", b, what, len(self.layers) + 1)
        lora = self._lora(b, variant is not False)
        segments = [functools.partial(self._segment, i, b, lora) for i in range(len(self.layers) + 1)]
        self._live_for(variant)
        try:
            return capture_graphs(segments, self.kv_cache.device, self._pool)
        finally:
            self._live_for(True)

    def capture_all(self) -> None:
        """Capture every bucket up front (the engine's warm-up); largest first so memory is reused."""
        if not self.capture:
            return
        variants: list[Variant] = [False]
        if self.lora_scales is not None:
            variants += [True, *self.live_variants]
        for variant in variants:
            for b in reversed(self.buckets):
                if (b, variant) not in self.graphs:
                    self.graphs[b, variant] = self._capture(b, variant)

    def add_live_variant(self, live: frozenset[tuple[int, str]]) -> None:
        """Graphs for steps whose adapters target exactly ``live`` (captured now, every bucket:
        before serving, since a capture stalls every request); without LoRA graphs, nothing."""
        if self.lora_scales is None or live in self.live_variants:
            return
        self.live_variants.add(live)
        try:
            self.capture_all()
        except torch.cuda.OutOfMemoryError:
            # (memory is tighter now than at start-up: the KV cache, a trainer, its store) the
            # steps of these adapters replay the every-linear graphs instead
            for key in [k for k in self.graphs if k[1] == live]:
                del self.graphs[key]
            self.live_variants.discard(live)
            torch.cuda.empty_cache()
            logger.warning("no memory for the prefill graphs of %d LoRA linears: their steps replay the "
                           "graphs of every linear's LoRA", len(live))

    # ------------------------------------------------------------------ a step

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
            lora: LoRABatch | None = None, layer_hook: LayerHook | None = None, live: Live = None) -> torch.Tensor:
        """``final_norm(h_L)`` ``[T, d]`` of the step (a view of a static buffer: read it before
        the next step), equal to ``model(input_ids, positions, ctx)`` with the multi-LoRA of
        ``lora`` (None or inactive: none) and ``layer_hook(i, h_i)`` called for ``i = 0 … L``.
        ``live``: the ``(layer, target)`` pairs the step's adapters have (None: unknown, every
        linear); the LoRA of the other linears, zero for these adapters, may be left out."""
        t = input_ids.shape[0]
        b = self.bucket(t)
        assert b is not None, f"{t} tokens exceed the largest prefill graph ({self.max_tokens})"
        with_lora = lora is not None and lora.active
        variant = self.variant(with_lora, live)
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.input_ids[t:b].zero_()
        self.positions[t:b].zero_()
        self.slots[:t].copy_(attn.slot_mapping)
        self.slots[t:b].fill_(-1)
        if with_lora:
            assert lora is not None and self.lora_scales is not None
            self._stage_lora(lora, t, b)
        key = (b, variant)
        graphs = self.graphs.get(key) if self.capture else None
        if self.capture and graphs is None:  # NOTE: capture_all() at start-up avoids this stall
            graphs = self.graphs[key] = self._capture(b, variant)  # reads the staged buffers only
        step_lora = None
        if graphs is None:  # the segments run eagerly: the linears' flags choose their LoRA
            step_lora = self._lora(b, with_lora)
            self._live_for(variant)
        ctx = ForwardContext(attn=attn, kv_cache=self.kv_cache, lora=None, backend=self.backend)
        o = self.o[:t].view(self.q[:t].shape)  # (the attention's [T, H, D] output over the flat buffer)
        for i in range(len(self.layers) + 1):
            if graphs is not None:
                graphs[i].replay()
            else:
                self._segment(i, b, step_lora)
            if layer_hook is not None:
                layer_hook(i, self.residual[:t] if i < len(self.layers) else self.final[:t])
            if i < len(self.layers):
                self.layers[i].self_attn.attend(self.q[:t], self.k[:t], self.v[:t], ctx, out=o, kv_stored=True)
        return self.out[:t]

    def _stage_lora(self, lora: LoRABatch, t: int, b: int) -> None:
        """This step's adapter routing into the static buffers (padding rows: no adapter)."""
        self.token_slots[:t].copy_(lora.token_slots)
        self.token_slots[t:b].fill_(-1)
        first = self._expand_first(b)
        # (a storing expand writes every row of the bucket: the padding rows are one more segment
        # without an adapter)
        lens, slots = (lora.seg_lens + [b - t], lora.seg_slots + [-1]) if first and b > t else (
            lora.seg_lens, lora.seg_slots)
        order, n = routing_tensor(lens, slots, block_m_for(b), unrouted=first)
        host = torch.full((self.lora_order.shape[0],), -1, dtype=torch.int32)
        host[:n] = order[:n]
        self.lora_order.copy_(host)
        if first:
            store = torch.full((self.store_order.shape[0],), -1, dtype=torch.int32)
            store[: order.shape[0]] = order
            self.store_order.copy_(store)

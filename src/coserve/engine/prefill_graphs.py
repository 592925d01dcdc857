"""Piecewise CUDA graphs for eager inference steps (off by default: ``EngineConfig.prefill_graphs``).

An eager step of ``T`` tokens launches ~70 kernels per layer from Python; on the H200 its host
side took nearly as long as its GPU side (DEVELOPERS.md, "piecewise CUDA graphs"). Everything
between two attention calls is token-wise, so it can be captured once per token-count bucket
``B >= T`` and replayed: segment ``i`` is layer ``i−1``'s ``finish`` (``o_proj``, residual add
and norm, MLP), the next residual add and norm, and layer ``i``'s ``project`` (qkv, RoPE); only
the attention, whose launches depend on the step's rows, runs eagerly between segments. A step
costs ``L + 1`` replays and ``L`` attention calls.

Everything that flows between segments lives in static buffers (``[B_max, ...]``, each bucket
uses the first ``B`` rows): input ids and positions, the residual stream, q/k/v, the attention
output. Rows ``T..B`` are padding (token 0 at position 0): token-wise work on them is wasted but
harmless, and the attention only ever sees the first ``T`` rows. Steps with LoRA rows, hooks
(fine-tuning capture) or more than ``B_max`` tokens stay eager (see :meth:`accepts`).

``capture=False`` runs the same segments eagerly through the same buffers (the CPU tests).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from coserve.layers.attention import AttentionBackend, AttentionMetadata
from coserve.models.llama import DecoderLayer, ForwardContext, LlamaForCausalLM, add_and_norm

logger = logging.getLogger(__name__)

class PrefillGraphs:
    """Segment graphs per bucket; :meth:`run` is one eager-equivalent forward to the final norm."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, backend: AttentionBackend,
                 buckets: Sequence[int], capture: bool = True) -> None:
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
        self.out = buf(bmax, cfg.hidden_size)  # final_norm(h_L)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def bucket(self, num_tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= num_tokens), None)

    def accepts(self, num_tokens: int, lora_active: bool) -> bool:
        """Whether a step of ``num_tokens`` runs here (the caller has checked it has no hooks)."""
        return 0 < num_tokens <= self.max_tokens and not lora_active

    # ------------------------------------------------------------------ segments

    def _segment(self, i: int, b: int) -> None:
        """Segment ``i`` of bucket ``b``: ``finish`` of layer ``i−1`` (none for ``i = 0``: the
        embeddings), the residual add and norm, then ``project`` of layer ``i`` (the final norm
        into :attr:`out` for ``i = L``)."""
        model, rotary = self.model, self.model.rotary
        if i == 0:
            hidden, delta = model.embed(self.input_ids[:b]), None
        else:
            hidden, delta = self.layers[i - 1].finish(self.o[:b], self.residual[:b], None)
        if i == len(self.layers):
            self.out[:b].copy_(add_and_norm(model.model.norm, hidden, delta).normed)
            return
        layer = self.layers[i]
        hidden, normed = add_and_norm(layer.input_layernorm, hidden, delta)
        self.residual[:b].copy_(hidden)
        q, k, v = layer.self_attn.project(normed, self.positions[:b], rotary, None)
        self.q[:b].copy_(q)
        self.k[:b].copy_(k)
        self.v[:b].copy_(v)

    @torch.no_grad()
    def _capture(self, b: int) -> list[torch.cuda.CUDAGraph]:
        logger.info("capturing prefill graphs: %d tokens, %d segments", b, len(self.layers) + 1)
        device = self.kv_cache.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # compile Triton kernels, create cuBLAS handles, outside the capture
            for i in range(len(self.layers) + 1):
                self._segment(i, b)
        torch.cuda.current_stream(device).wait_stream(stream)
        graphs = []
        for i in range(len(self.layers) + 1):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._segment(i, b)
            graphs.append(graph)
        return graphs

    def capture_all(self) -> None:
        """Capture every bucket up front (the engine's warm-up); largest first so memory is reused."""
        if not self.capture:
            return
        for b in reversed(self.buckets):
            if b not in self.graphs:
                self.graphs[b] = self._capture(b)

    # ------------------------------------------------------------------ a step

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """``final_norm(h_L)`` ``[T, d]`` of the step (a view of a static buffer: read it before
        the next step), equal to ``model(input_ids, positions, ctx)`` without LoRA or hooks."""
        t = input_ids.shape[0]
        b = self.bucket(t)
        assert b is not None, f"{t} tokens exceed the largest prefill graph ({self.max_tokens})"
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.input_ids[t:b].zero_()
        self.positions[t:b].zero_()
        graphs = self.graphs.get(b) if self.capture else None
        if self.capture and graphs is None:  # NOTE: capture_all() at start-up avoids this stall
            graphs = self.graphs[b] = self._capture(b)
        ctx = ForwardContext(attn=attn, kv_cache=self.kv_cache, lora=None, backend=self.backend)
        for i in range(len(self.layers) + 1):
            if graphs is not None:
                graphs[i].replay()
            else:
                self._segment(i, b)
            if i < len(self.layers):
                self.o[:t].copy_(self.layers[i].self_attn.attend(self.q[:t], self.k[:t], self.v[:t], ctx))
        return self.out[:t]

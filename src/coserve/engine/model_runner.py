"""Runs one step: builds the flat varlen batch, runs the model, returns the sampling rows' logits.

Decode-only steps replay a CUDA graph when the device and the attention backend allow it
(:mod:`coserve.engine.cuda_graph`); every other step runs eagerly. ``last_mode`` says which.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from coserve.engine.config import EngineConfig
from coserve.engine.cuda_graph import DecodeGraphs
from coserve.engine.prefill_graphs import PrefillGraphs
from coserve.host_copy import device_tensor
from coserve.layers.attention import AttentionMetadata, get_attention_backend
from coserve.layers.lora import LoRABatch, LoRAContext, LoRALinear, RowDropoutLoRA, get_lora_op
from coserve.models.llama import ForwardContext, LayerHook, LlamaForCausalLM

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchRow:
    """One row of a step: ``token_ids`` at positions ``context_len ...`` of its sequence.

    ``writes_kv=False`` marks a fine-tuning row (no KV written, no cached prefix).
    ``samples`` asks for the logits of the row's last token. ``dropout_key`` (fine-tuning rows of
    an adapter trained with LoRA dropout): the key of the row's dropout masks. ``scored``: the log-
    probabilities of the tokens that the row's first ``len(targets)`` positions predict (its
    prompt's next tokens), with the ``k`` most likely: ``(targets, k)``, in
    :attr:`ModelRunner.last_scores`.
    """

    token_ids: list[int]
    context_len: int
    block_table: list[int]
    lora_slot: int = -1
    writes_kv: bool = True
    samples: bool = False
    is_prefill: bool = True
    dropout_key: int | None = None
    scored: tuple[list[int], int] | None = None


_NO_SCORES: Mapping[int, list[dict[int, float]]] = MappingProxyType({})

SCORE_CHUNK = 512
"""Positions per LM-head call when scoring a row's tokens: its fp32 logits stay under 512 × V."""


def score_tokens(model: LlamaForCausalLM, hidden: torch.Tensor, targets: list[int], k: int) -> list[dict[int, float]]:
    """Per position of ``hidden`` (the model's output, one row): the log-probability of the token
    it predicts (``targets``) and of the ``k`` most likely ones, as ``{token id: log-prob}``."""
    out: list[dict[int, float]] = []
    tgt = torch.tensor(targets, dtype=torch.long, device=hidden.device)
    for lo in range(0, len(targets), SCORE_CHUNK):
        logp = torch.log_softmax(model.compute_logits(hidden[lo:lo + SCORE_CHUNK]).float(), dim=-1)
        chosen = logp.gather(1, tgt[lo:lo + SCORE_CHUNK, None])[:, 0].tolist()
        tops = logp.topk(k, dim=-1) if k > 0 else None
        top_vals = tops.values.tolist() if tops is not None else [[]] * len(chosen)
        top_ids = tops.indices.tolist() if tops is not None else [[]] * len(chosen)
        for t, lp, ids, vals in zip(targets[lo:lo + SCORE_CHUNK], chosen, top_ids, top_vals, strict=True):
            out.append({**dict(zip(ids, vals, strict=True)), t: lp})
    return out


@dataclass(frozen=True)
class BatchInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    lora: LoRABatch
    logits_indices: torch.Tensor  # [n] flat index of each sampling row's last token


class ModelRunner:
    """Owns the model and the KV cache tensor ``[num_blocks, num_layers, 2, block_size, KVH, D]``."""

    def __init__(self, config: EngineConfig, model: LlamaForCausalLM, lora_scales: torch.Tensor) -> None:
        self.config = config
        self.model = model
        self.device = model.lm_head_weight.device
        self.dtype = model.lm_head_weight.dtype
        self.lora_scales = lora_scales
        self.backend = get_attention_backend(config.kernel_backend(config.attention_backend))
        self.lora_op = get_lora_op(config.kernel_backend(config.lora_backend))
        # (p, seed) of the LoRA dropout that rows with a dropout_key get (set by the host).
        self.ft_dropout: tuple[float, int] = (0.0, 0)
        # The (layer, target) pairs the adapters of some slots have, None if one is unknown (set by
        # the host: LoRAManager.live_targets); None here: every LoRA linear runs its kernels.
        self.slot_targets: Callable[[Iterable[int]], frozenset[tuple[int, str]] | None] | None = None
        self._lora_linears = model.lora_linears()
        self._live: frozenset[tuple[int, str]] | None = None  # what the linears' lora_live reflect
        # (NOTE: co-serving alternates graph decode steps, every linear live, and eager steps with
        # FT rows, the trained ones only: the flags of each target set are worked out once)
        self._live_cache: dict[frozenset[tuple[int, str]] | None, list[bool]] = {}
        self.num_blocks = self._num_kv_blocks()
        cfg = model.config
        self.kv_cache = torch.zeros(
            self.num_blocks, cfg.num_layers, 2, config.block_size, cfg.num_kv_heads, cfg.head_dim,
            dtype=self.dtype, device=self.device,
        )
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", self.num_blocks, config.block_size,
                    self.kv_cache.numel() * self.kv_cache.element_size() / 2**20)
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager and getattr(
            self.backend, "cuda_graph_capable", False
        ):
            self.graphs = self.decode_graphs(capture=True)
            # Warm-up: capture every bucket now; a capture in the middle of serving stalls all
            # requests for about a second.
            self.graphs.capture_all(with_lora=False)
            if config.max_loras > 0:
                self.graphs.capture_all(with_lora=True)
        self.prefill_graphs: PrefillGraphs | None = None
        if self.graphs is not None and config.prefill_graphs:
            self.prefill_graphs = self.make_prefill_graphs(capture=True)
            self.prefill_graphs.capture_all()
        self._built_pieces = self.prefill_graphs  # what use_prefill_graphs(True) brings back
        self.last_mode = "eager"
        self.last_scores: Mapping[int, list[dict[int, float]]] = _NO_SCORES  # (BatchRow.scored) of the last step

    def make_prefill_graphs(self, capture: bool) -> PrefillGraphs:
        """Piecewise graphs of eager inference steps over this runner's model and cache
        (``capture=False``: the same segments run eagerly, for CPU tests)."""
        buckets = [b for b in self.config.prefill_graph_buckets if b <= self.config.max_num_batched_tokens]
        triton_lora = self.config.kernel_backend(self.config.lora_backend) == "triton"
        return PrefillGraphs(self.model, self.kv_cache, self.backend,
                             buckets or [self.config.max_num_batched_tokens], capture=capture,
                             lora_scales=self.lora_scales if triton_lora and self.model.num_lora_slots else None,
                             set_live=self.set_live)

    def use_prefill_graphs(self, on: bool) -> bool:
        """Run steps with prefill or FT rows through the piecewise prefill graphs (``on``) or
        eagerly, where the graphs were built; returns whether they are in use now. (The
        benchmark's configurations compare both on one engine.)"""
        if self.prefill_graphs is not None:
            self._built_pieces = self.prefill_graphs
        self.prefill_graphs = self._built_pieces if on else None
        return self.prefill_graphs is not None

    def add_prefill_live_variant(self, slots: Iterable[int]) -> None:
        """Piecewise prefill graphs of their own for the steps whose adapters are those of
        ``slots`` (the training slot: its adapter's declared targets), captured now; nothing
        without prefill graphs or where the slots' targets are unknown."""
        if self.prefill_graphs is None or self.slot_targets is None:
            return
        live = self.slot_targets(slots)
        if live is not None:
            self.prefill_graphs.add_live_variant(live)

    def decode_graphs(self, capture: bool) -> DecodeGraphs:
        """The decode-graph runner over this runner's model and cache (``capture=False``: eager replay)."""
        sizes = [n for n in self.config.cuda_graph_batch_sizes if n <= self.config.max_num_seqs]
        return DecodeGraphs(
            self.model, self.kv_cache, self.backend, self.lora_scales,
            sizes or [self.config.max_num_seqs], self.max_model_len, self.config.block_size, capture=capture,
        )

    def planned_mode(self, rows: list[BatchRow]) -> str:
        """``graph`` when :meth:`execute` (without hooks) would replay CUDA graphs for ``rows``:
        the decode graphs, or the piecewise prefill graphs; else ``eager``."""
        if self.graphs is not None and self.graphs.accepts(rows):
            return "graph"
        return "graph" if self._pieces_accept(rows, sum(len(r.token_ids) for r in rows)) else "eager"

    @property
    def ft_graph_tokens(self) -> int:
        """The most tokens a step with fine-tuning rows (the training adapter's slot) may have
        and still replay the piecewise prefill graphs (0: none; see ``StepView.ft_graph_tokens``)."""
        pieces = self.prefill_graphs
        return pieces.max_tokens if pieces is not None and pieces.accepts(1, lora_active=True) else 0

    def _pieces_accept(self, rows: list[BatchRow], num_tokens: int, lora_active: bool | None = None) -> bool:
        """Whether a step of ``rows`` runs through the piecewise prefill graphs (given no MLP
        hook): one that carries prefill or FT rows (decode-only steps have graphs of their own),
        none with LoRA dropout, and a size and adapter use they take."""
        pieces = self.prefill_graphs
        if pieces is None or not any(r.is_prefill for r in rows) or any(r.dropout_key is not None for r in rows):
            return False
        if lora_active is None:
            lora_active = any(r.lora_slot >= 0 for r in rows)
        return pieces.accepts(num_tokens, lora_active=lora_active)

    @property
    def block_bytes(self) -> int:
        cfg = self.model.config
        return 2 * cfg.num_layers * self.config.block_size * cfg.kv_size * self.dtype.itemsize

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # NOTE: leave room for activations of the largest step; measured peak would be better.
            budget = free - (1 - self.config.gpu_memory_utilization) * total
        else:
            budget = self.config.cpu_kv_cache_gb * 2**30
        n = int(budget // self.block_bytes)
        if n < 2:
            raise ValueError(
                f"not enough memory for the KV cache: {budget / 2**20:.0f} MiB left, one block needs "
                f"{self.block_bytes / 2**20:.2f} MiB"
            )
        return n

    def prepare(self, rows: list[BatchRow]) -> BatchInputs:
        ids: list[int] = []
        pos: list[int] = []
        logits_idx: list[int] = []
        for row in rows:
            ids.extend(row.token_ids)
            pos.extend(range(row.context_len, row.context_len + len(row.token_ids)))
            if row.samples:
                logits_idx.append(len(ids) - 1)
        num_prefill = sum(1 for r in rows if r.is_prefill)
        attn = AttentionMetadata.build(
            q_lens=[len(r.token_ids) for r in rows],
            context_lens=[r.context_len for r in rows],
            block_tables=[r.block_table for r in rows],
            writes_kv=[r.writes_kv for r in rows],
            num_prefill_rows=num_prefill,
            block_size=self.config.block_size,
            device=self.device,
        )
        # Rows with dropout get their LoRA from RowDropoutLoRA instead (see execute).
        slots = [-1 if r.dropout_key is not None else r.lora_slot for r in rows]
        lora = LoRABatch.from_rows([len(r.token_ids) for r in rows], slots, self.device)
        return BatchInputs(
            input_ids=device_tensor(ids, torch.long, self.device),
            positions=device_tensor(pos, torch.long, self.device),
            attn=attn,
            lora=lora,
            logits_indices=device_tensor(logits_idx, torch.long, self.device),
        )

    def _mark_live_linears(self, rows: list[BatchRow] | None) -> None:
        """Skip, in this eager step, the LoRA kernels of the linears that no adapter of ``rows``
        targets (q/k/v/o adapters leave the MLP's three linears without any: fewer launches and
        no zero deltas computed). ``rows`` None: every linear live, as a graph must be captured
        (a graph captured later, on first use, bakes in the flags of that moment)."""
        live = None
        if rows is not None and self.slot_targets is not None:
            if not any(r.lora_slot >= 0 for r in rows):
                return  # no LoRA context this step: the flags are not read
            live = self._step_live(rows)
        self.set_live(live)

    def _step_live(self, rows: list[BatchRow]) -> frozenset[tuple[int, str]] | None:
        """The ``(layer, target)`` pairs of the adapters of ``rows`` (None: unknown or every one)."""
        slots = frozenset(r.lora_slot for r in rows if r.lora_slot >= 0)
        return self.slot_targets(slots) if slots and self.slot_targets is not None else None

    def set_live(self, live: frozenset[tuple[int, str]] | None) -> None:
        """Every LoRA linear's ``lora_live`` from ``live`` (None: all live)."""
        if live is not self._live and live != self._live:
            self._live = live
            flags = self._live_cache.get(live)
            if flags is None:
                if len(self._live_cache) >= 64:  # many adapters' combinations: keep it bounded
                    self._live_cache.clear()
                flags = self._live_cache[live] = _live_flags(self._lora_linears, live)
            for lin, flag in zip(self._lora_linears, flags, strict=True):
                lin.lora_live = flag

    @torch.inference_mode()
    def execute(self, rows: list[BatchRow], layer_hook: LayerHook | None = None,
                mlp_hook: LayerHook | None = None, *, eager: bool = False) -> torch.Tensor:
        """Run one step; returns fp32 logits ``[n_sampling_rows, V]`` in row order.

        Sets ``last_mode``: ``graph`` for a decode-only step replayed from a decode graph (no
        hook: a layer hook keeps a decode step off them) or a step that carries prefill or FT
        rows through the piecewise prefill graphs (a layer hook runs between their segments; an
        MLP hook or LoRA dropout rows keep a step off them), else ``eager``. ``eager``: run
        eagerly whatever the graphs take (calibration and warm-up of the eager path).
        """
        self.last_scores = _NO_SCORES
        if (not eager and layer_hook is None and mlp_hook is None and self.graphs is not None
                and self.graphs.accepts(rows)):
            self.last_mode = "graph"
            self._mark_live_linears(None)
            return self.graphs.run(rows)
        inputs = self.prepare(rows)
        if not eager and mlp_hook is None and self._pieces_accept(rows, inputs.input_ids.shape[0],
                                                                 inputs.lora.active):
            assert self.prefill_graphs is not None
            self.last_mode = "graph"
            self._mark_live_linears(None)
            hidden = self.prefill_graphs.run(inputs.input_ids, inputs.positions, inputs.attn, inputs.lora,
                                             layer_hook, live=self._step_live(rows))
            self._score(rows, hidden)
            return self.model.compute_logits(hidden[inputs.logits_indices])
        self.last_mode = "eager"
        dropped = [(start, len(r.token_ids), r.dropout_key, r.lora_slot)
                   for start, r in zip(_starts(rows), rows, strict=True) if r.dropout_key is not None]
        self._mark_live_linears(rows)
        lora: LoRAContext | None = self.lora_op(inputs.lora, self.lora_scales) if inputs.lora.active else None
        if dropped:
            p, seed = self.ft_dropout
            lora = RowDropoutLoRA(lora, dropped[0][3], [(s, n, k) for s, n, k, _ in dropped], seed, p,
                                  self.lora_scales)
        ctx = ForwardContext(
            attn=inputs.attn,
            kv_cache=self.kv_cache,
            lora=lora,
            backend=self.backend,
            layer_hook=layer_hook,
            mlp_hook=mlp_hook,
        )
        hidden = self.model(inputs.input_ids, inputs.positions, ctx)
        self._score(rows, hidden)
        return self.model.compute_logits(hidden[inputs.logits_indices])

    def _score(self, rows: list[BatchRow], hidden: torch.Tensor) -> None:
        """:attr:`last_scores`: ``{row index: score_tokens(...)}`` of the rows with ``scored``
        (nothing walked or built in a step without one: the usual step)."""
        if not any(r.scored for r in rows):
            return
        self.last_scores = {
            i: score_tokens(self.model, hidden[start:start + len(r.scored[0])], *r.scored)
            for i, (start, r) in enumerate(zip(_starts(rows), rows, strict=True)) if r.scored and r.scored[0]
        }


def _live_flags(linears: list[LoRALinear], live: frozenset[tuple[int, str]] | None) -> list[bool]:
    """Each linear's ``lora_live`` under the targets ``live`` (None: all)."""
    return [live is None or any((lin.layer, t) in live for t in lin.out_slices) for lin in linears]


def _starts(rows: list[BatchRow]) -> list[int]:
    out, t = [], 0
    for r in rows:
        out.append(t)
        t += len(r.token_ids)
    return out

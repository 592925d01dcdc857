"""Start-up warm-up: the eager steps' kernel variants compiled before the first request.

Triton compiles a kernel the first time it meets a new variant of it: new values of its constexpr
arguments (tile heights and split counts that the launchers pick from a step's shape) or a new
specialization of an ordinary one (an integer equal to 1 or divisible by 16, a pointer aligned to
16 bytes; the arguments that change from step to step are exempt, see
:func:`coserve.layers.triton_attention.varying`). One compilation takes up to a second, and in
the middle of serving it stalls every running request. Decode-only steps replay CUDA graphs
captured at start-up (:mod:`coserve.engine.cuda_graph`); :func:`warm_up` runs the shape classes
of the other steps once, through the real step path (:func:`run_synthetic_batch`):

- prefill-only chunks of 1, 16, 17, half the step's tokens and all of them;
- chunks over a paged prefix (the Triton prefill kernel), over a short and a long prefix;
- decode rows alone (run eagerly) and behind one chunk: 1, 16, 17 and as many as a step holds,
  over short and long contexts (the decode kernel with and without KV splits);
- with adapter slots, one chunk on an adapter of 1, 16, 17, every power of two and all of the
  step's tokens: the LoRA launch (tile height, split-K) is a step function of the adapter tokens
  whose steps are powers of two apart, so a doubling sweep meets every one of them; then a few
  adapter tokens in a step of large tiles, one row per slot (the longest routing a step can
  have), decode rows on an adapter;
- with a training slot, fine-tuning rows (no KV) alone and beside inference rows.

Leaves nothing behind but the order of the free KV blocks: the blocks are borrowed and given
back, no request is created, no random stream of the serving path is drawn (greedy sampling).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from coserve.core.latency import BatchSpec, Chunk
from coserve.engine.calibration import run_synthetic_batch
from coserve.layers.triton_lora import SMALL_STEP_TOKENS, block_m_for

if TYPE_CHECKING:
    from coserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmupLimits:
    """What one step of the engine can hold: tokens, rows, one row's context (positions), free
    KV blocks; the adapter slots and the training slot (None without one)."""

    max_tokens: int
    max_rows: int
    max_context: int
    kv_blocks: int
    block_size: int
    lora_slots: tuple[int, ...] = ()
    ft_slot: int | None = None

    @classmethod
    def of(cls, engine: LLMEngine) -> WarmupLimits:
        cfg = engine.config
        return cls(
            max_tokens=cfg.max_num_batched_tokens,
            max_rows=cfg.max_num_seqs,
            max_context=engine.max_model_len,
            kv_blocks=engine.block_manager.num_free_blocks,
            block_size=cfg.block_size,
            lora_slots=tuple(range(cfg.num_lora_slots)),
            ft_slot=engine.lora_manager.training_slot(0) if cfg.num_training_slots else None,
        )

    def blocks(self, spec: BatchSpec) -> int:
        """KV blocks :func:`run_synthetic_batch` borrows for ``spec``."""
        tokens = [c.context_len + c.num_tokens for c in spec.chunks] + [kv + 1 for kv in spec.decode_kv]
        return sum(-(-n // self.block_size) for n in tokens)

    def fits(self, spec: BatchSpec) -> bool:
        """Whether a real step could look like ``spec``."""
        return (
            spec.num_tokens <= self.max_tokens
            and len(spec.chunks) + len(spec.decode_kv) <= self.max_rows
            and all(c.context_len + c.num_tokens <= self.max_context for c in spec.chunks)
            and all(1 <= kv < self.max_context for kv in spec.decode_kv)
            and all(n <= self.max_context for n in spec.ft_lens)
            and self.blocks(spec) <= self.kv_blocks
        )


class WarmupBatch(NamedTuple):
    """A batch to run and the adapter slots of its first inference rows (chunks, then decodes)."""

    spec: BatchSpec
    lora_slots: tuple[int, ...] = ()


class WarmupReport(NamedTuple):
    batches: int
    seconds: float


def warmup_plan(lim: WarmupLimits) -> list[WarmupBatch]:
    """The batches of :func:`warm_up` (see the module docstring), each one a step that fits."""
    bs = lim.block_size
    t = min(lim.max_tokens, lim.max_context, lim.kv_blocks * bs)  # the longest chunk
    plan: list[WarmupBatch] = []

    def add(spec: BatchSpec, slots: Sequence[int] = ()) -> None:
        if spec.num_tokens and lim.fits(spec):
            plan.append(WarmupBatch(spec, tuple(slots)))

    def decodes(head: tuple[Chunk, ...], most: int) -> list[tuple[int, ...]]:
        """``decode_kv`` of 1, 16, 17 and ``most`` rows behind ``head``, each over a short
        (two blocks) and the longest context the free blocks leave every row."""
        free = lim.kv_blocks - lim.blocks(BatchSpec(head))
        out = []
        for b in _levels((1, 16, 17, most), most):
            long = min(lim.max_context - 1, free // b * bs - 1)
            out += [(kv,) * b for kv in _levels((bs + 1, long), long)]
        return out

    for n in _levels((1, 16, 17, t // 2, t), t):
        add(BatchSpec((Chunk(n),)))
    for n in _levels((1, 17, t // 2), t):
        for ctx in _levels((bs + 1, min(lim.max_context, lim.kv_blocks * bs) - n), lim.max_context):
            add(BatchSpec((Chunk(n, ctx),)))
    most = min(lim.max_rows, lim.max_tokens, lim.kv_blocks)
    for kv in decodes((), most):
        add(BatchSpec(decode_kv=kv))
    head = (Chunk(min(17, max(1, t // 2))),)
    for kv in decodes(head, min(lim.max_rows - 1, lim.max_tokens - head[0].num_tokens)):
        add(BatchSpec(head, kv))

    if lim.lora_slots:
        slot = lim.lora_slots[0]
        for n in _levels((1, 16, 17, *_powers_of_two(t), t), t):
            add(BatchSpec((Chunk(n),)), (slot,))
        if t > SMALL_STEP_TOKENS:  # a few adapter tokens in a step of large tiles
            for a in _powers_of_two(SMALL_STEP_TOKENS, start=block_m_for(t)):
                add(BatchSpec((Chunk(a), Chunk(t - a))), (slot,))
        k = len(lim.lora_slots)
        for n in _levels((min(t, SMALL_STEP_TOKENS), t), t):
            if k > 1 and n > k - 1:  # one-token rows on every other slot: each pads a whole tile
                add(BatchSpec((Chunk(n - k + 1),), (1,) * (k - 1)), lim.lora_slots)
        for b in _levels((1, 16, 17, most), most):
            add(BatchSpec(decode_kv=(1,) * b), (slot,) * b)

    if lim.ft_slot is not None:
        ft = min(lim.max_tokens, lim.max_context)
        add(BatchSpec(ft_lens=(ft,)))
        add(BatchSpec(ft_lens=tuple(n for n in _split(ft, 4) if n)))
        rows = min(16, lim.max_rows - 1, max(0, lim.max_tokens - head[0].num_tokens - 1))
        ft = min(lim.max_tokens - head[0].num_tokens - rows, lim.max_context)
        add(BatchSpec(head, (bs + 1,) * rows, (ft,)))
    return plan


def warm_up(engine: LLMEngine) -> WarmupReport:
    """Run :func:`warmup_plan` through ``engine`` (see the module docstring), then, with
    ``EngineConfig.warmup_gemms``, :func:`gemm_sweep`; logs the time."""
    lim = WarmupLimits.of(engine)
    plan = warmup_plan(lim)
    start = time.perf_counter()
    for batch in plan:
        run_synthetic_batch(engine, batch.spec, lora_slots=batch.lora_slots, ft_slot=lim.ft_slot)
    report = WarmupReport(len(plan), time.perf_counter() - start)
    logger.info("warm-up: %d batches in %.1f s", report.batches, report.seconds)
    if engine.config.warmup_gemms:
        began = time.perf_counter()
        calls = gemm_sweep(engine.model, engine.config.max_num_batched_tokens,
                           min(engine.config.max_num_seqs, engine.config.max_num_batched_tokens))
        logger.info("warm-up: %d GEMMs in %.1f s", calls, time.perf_counter() - began)
    return report


def gemm_sweep(model: torch.nn.Module, max_tokens: int, max_rows: int) -> int:
    """Each distinct base-weight GEMM of an eager step once at every row count it can have: the
    linears at 1 … ``max_tokens`` tokens, the LM head at 1 … ``max_rows`` sampled rows. An
    eager step's token count is arbitrary, and the matmul library picks and loads its kernels
    per shape: on the H200 steps of a token count not seen before ran ~1.4× slower per token
    (bench/results/diagnostic/README.md). Returns the number of GEMMs run."""
    from coserve.layers.lora import LoRALinear

    weights: dict[tuple[tuple[int, ...], bool], LoRALinear] = {}
    for module in model.modules():
        if isinstance(module, LoRALinear):
            weights.setdefault((tuple(module.weight.shape), module.bias is not None), module)
    calls = 0
    with torch.inference_mode():
        inputs: dict[int, torch.Tensor] = {}
        for linear in weights.values():
            w = linear.weight
            x = inputs.setdefault(w.shape[1], torch.zeros(max_tokens, w.shape[1], dtype=w.dtype, device=w.device))
            for n in range(1, max_tokens + 1):
                F.linear(x[:n], w, linear.bias)
            calls += max_tokens
        head = getattr(model, "lm_head_weight", None)
        if isinstance(head, torch.Tensor):
            x = torch.zeros(max_rows, head.shape[1], dtype=head.dtype, device=head.device)
            for n in range(1, max_rows + 1):
                x[:n] @ head.T
            calls += max_rows
    if torch.cuda.is_available() and any(w.weight.is_cuda for w in weights.values()):
        torch.cuda.synchronize()
    return calls


def _levels(values: Iterable[int], hi: int) -> list[int]:
    return sorted({v for v in values if 1 <= v <= hi})


def _powers_of_two(hi: int, start: int = 1) -> list[int]:
    out = []
    while start <= hi:
        out.append(start)
        start *= 2
    return out


def _split(total: int, parts: int) -> list[int]:
    q, r = divmod(total, parts)
    return [q + (1 if i < r else 0) for i in range(parts)]

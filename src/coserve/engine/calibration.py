"""Synthetic batches through the engine's real step path: the calibration hook (DESIGN §5, hook 5)
and the start-up warm-up (:mod:`coserve.engine.warmup`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from coserve.core.latency import BatchSpec
from coserve.engine.model_runner import BatchRow
from coserve.engine.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0)

if TYPE_CHECKING:
    from coserve.engine.llm_engine import LLMEngine


def run_synthetic_batch(
    engine: LLMEngine, spec: BatchSpec, *, lora_slots: Sequence[int] = (), ft_slot: int | None = None
) -> float:
    """Run one synthetic batch through the real step path (calibration, hook 5; the start-up
    warm-up); returns seconds.

    Borrows free KV blocks for the batch's cached context and gives them back; writes only into
    those blocks. Fine-tuning rows are captured into a scratch buffer like real ones.
    ``lora_slots``: the adapter slots of the first inference rows (chunks, then decodes; the
    other rows use none); ``ft_slot``: the fine-tuning rows' slot (default: the engine's
    training slot).
    """
    rng = torch.Generator().manual_seed(len(spec.chunks) * 7919 + len(spec.decode_kv))
    vocab = engine.model_config.vocab_size
    borrowed: list[int] = []
    slots = list(lora_slots) + [-1] * (len(spec.chunks) + len(spec.decode_kv) - len(lora_slots))
    chunk_slots, decode_slots = slots[: len(spec.chunks)], slots[len(spec.chunks) :]
    ft_slot = engine.training_slot if ft_slot is None else ft_slot

    def blocks_for(tokens: int) -> list[int]:
        got = engine.block_manager.take(engine.block_manager.blocks_for_tokens(tokens))
        borrowed.extend(got)
        return got

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=rng).tolist()

    try:
        rows = [BatchRow(ids(c.num_tokens), c.context_len, blocks_for(c.context_len + c.num_tokens), slot,
                         samples=True) for c, slot in zip(spec.chunks, chunk_slots, strict=True)]
        rows += [BatchRow(ids(n), 0, [], ft_slot, writes_kv=False) for n in spec.ft_lens]
        rows += [BatchRow(ids(1), kv, blocks_for(kv + 1), slot, samples=True, is_prefill=False)
                 for kv, slot in zip(spec.decode_kv, decode_slots, strict=True)]
        if not rows:
            return 0.0
        ft_start = sum(c.num_tokens for c in spec.chunks)
        ft_tokens = sum(spec.ft_lens)
        scratch = torch.empty(ft_tokens, engine.model_config.hidden_size, dtype=engine.runner.dtype,
                              device=engine.runner.device)

        def capture(layer: int, hidden: torch.Tensor) -> None:
            scratch.copy_(hidden[ft_start : ft_start + ft_tokens])

        mlp_hook = None
        co = engine.coserver
        if ft_tokens and co is not None and co.keeps_mlp:  # the real steps copy the MLP outputs too
            mlp_scratch = torch.empty(ft_tokens, 2 * engine.model_config.intermediate_size,
                                      dtype=engine.runner.dtype, device=engine.runner.device)

            def mlp_hook(layer: int, gate_up: torch.Tensor) -> None:
                mlp_scratch.copy_(gate_up[ft_start : ft_start + ft_tokens])

        # An `eager` spec runs eagerly (no decode graph, no piecewise prefill graphs); a `graph`
        # one takes whichever graphs a real step of its rows would (FT rows: with their capture
        # hook, between the segments of the prefill graphs).
        hook = capture if ft_tokens else None
        engine.sync()
        start = time.perf_counter()
        logits = engine.runner.execute(rows, hook, mlp_hook, eager=spec.mode == "eager")
        if logits.shape[0]:  # sample like a real step does (greedy; the sampler syncs)
            n = logits.shape[0]
            engine.sampler(logits, [_GREEDY] * n, [None] * n, [0] * n, engine.eos_token_ids)
        engine.sync()
        return time.perf_counter() - start
    finally:
        engine.block_manager.give_back(borrowed)


"""Synthetic batches through the engine's real step path: the calibration hook (DESIGN §5, hook 5)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from coserve.core.latency import BatchSpec
from coserve.engine.model_runner import BatchRow
from coserve.engine.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0)

if TYPE_CHECKING:
    from coserve.engine.llm_engine import LLMEngine


def run_synthetic_batch(engine: LLMEngine, spec: BatchSpec) -> float:
    """Run one synthetic batch through the real step path (calibration, hook 5); returns seconds.

    Borrows free KV blocks for the batch's cached context and gives them back; writes only into
    those blocks. Fine-tuning rows are captured into a scratch buffer like real ones.
    """
    rng = torch.Generator().manual_seed(len(spec.chunks) * 7919 + len(spec.decode_kv))
    vocab = engine.model_config.vocab_size
    borrowed: list[int] = []

    def blocks_for(tokens: int) -> list[int]:
        got = engine.block_manager.take(engine.block_manager.blocks_for_tokens(tokens))
        borrowed.extend(got)
        return got

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=rng).tolist()

    try:
        rows = [BatchRow(ids(c.num_tokens), c.context_len, blocks_for(c.context_len + c.num_tokens),
                         samples=True) for c in spec.chunks]
        rows += [BatchRow(ids(n), 0, [], engine.training_slot, writes_kv=False) for n in spec.ft_lens]
        rows += [BatchRow(ids(1), kv, blocks_for(kv + 1), samples=True, is_prefill=False)
                 for kv in spec.decode_kv]
        if not rows:
            return 0.0
        ft_start = sum(c.num_tokens for c in spec.chunks)
        ft_tokens = sum(spec.ft_lens)
        scratch = torch.empty(ft_tokens, engine.model_config.hidden_size, dtype=engine.runner.dtype,
                              device=engine.runner.device)

        def capture(layer: int, hidden: torch.Tensor) -> None:
            scratch.copy_(hidden[ft_start : ft_start + ft_tokens])

        # A layer hook makes the runner take its eager path, which an `eager` spec asks for.
        hook = capture if ft_tokens else (_no_hook if spec.mode == "eager" else None)
        engine.sync()
        start = time.perf_counter()
        logits = engine.runner.execute(rows, hook)
        if logits.shape[0]:  # sample like a real step does (greedy; the sampler syncs)
            n = logits.shape[0]
            engine.sampler(logits, [_GREEDY] * n, [None] * n, [0] * n, engine.eos_token_ids)
        engine.sync()
        return time.perf_counter() - start
    finally:
        engine.block_manager.give_back(borrowed)


def _no_hook(layer: int, hidden: torch.Tensor) -> None:
    return None

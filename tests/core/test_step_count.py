"""``count_optimizer_steps`` against the co-server's packing replayed on a real ``SamplePool``
(candidates, claims, retirement at each step's end), over many small random datasets and
settings; tests/server/test_finetune_cli.py checks it against whole runs."""

from __future__ import annotations

import random

from coserve.core.config import CoServeConfig
from coserve.core.finetune import FTSample
from coserve.core.sample_pool import SamplePool
from coserve.core.step_count import count_optimizer_steps


def replayed_steps(samples: list[FTSample], cfg: CoServeConfig, accumulation_tasks: int) -> int:
    """``CoServer``'s FT-only packing on the pool itself: each plan takes the candidates shortest
    first until the task holds ``backward_tokens``; a task is submitted once full or once the
    pool shows no candidate; a step ends after ``accumulation_tasks`` tasks or at that point, and
    retires its samples."""
    pool = SamplePool(samples, epochs=cfg.epochs, seed=cfg.seed, shuffle=cfg.shuffle, window=cfg.candidate_window)
    steps, task, tokens, step, tasks = 0, [], 0, [], 0
    while not pool.done:
        picked = []
        for s in sorted(pool.candidates(), key=lambda s: (s.num_tokens, s.sample_id)):
            if tokens >= cfg.backward_tokens:
                break
            picked.append(s.sample_id)
            tokens += s.num_tokens
        pool.claim(picked)
        task += picked
        drained = not pool.candidates()
        if task and (tokens >= cfg.backward_tokens or drained):
            step, task, tokens, tasks = step + task, [], 0, tasks + 1
            if tasks >= accumulation_tasks or drained:
                pool.retire(step)
                steps, step, tasks = steps + 1, [], 0
        else:
            assert picked, "a plan that neither picks nor closes a task"
    return steps


def test_the_count_is_the_packing_replayed_on_the_pool() -> None:
    rng = random.Random(0)
    for _ in range(300):
        lengths = [rng.randint(2, 64) for _ in range(rng.randint(1, 120))]
        samples = [FTSample(i, tuple(range(n)), tuple(range(n))) for i, n in enumerate(lengths)]
        cfg = CoServeConfig(backward_tokens=rng.randint(1, 300), max_seq_len=64, epochs=rng.randint(1, 4),
                            seed=rng.randint(0, 9), shuffle=rng.random() < 0.8,
                            candidate_window=rng.choice([1, 2, 3, 8, 64]))
        accumulation = rng.randint(1, 4)
        assert count_optimizer_steps(samples, cfg, accumulation) == replayed_steps(samples, cfg, accumulation), \
            (lengths, cfg, accumulation)


def test_no_samples_no_steps() -> None:
    assert count_optimizer_steps([], CoServeConfig(), 1) == 0

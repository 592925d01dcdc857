"""How many optimizer steps a fine-tuning run takes, found by packing its samples into backward
tasks the way :class:`~coserve.core.coserver.CoServer` does, without running the model.

The learning-rate schedule decays to 0 at ``total_steps``: a count too low trains the last
steps at a learning rate of 0 (a cosine schedule would rise again), one too high never decays.
A mean-length estimate was 32 for the 36 steps of the built-in ``tiny_facts`` over 4 epochs: a
task closes at the first sample that brings it to ``backward_tokens``, so it overshoots by part
of a sample, and each epoch ends with a short task of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from coserve.core.config import CoServeConfig
from coserve.core.finetune import FTSample
from coserve.core.sample_pool import SamplePool


def count_optimizer_steps(samples: Sequence[FTSample], cfg: CoServeConfig, accumulation_tasks: int) -> int:
    """The optimizer steps of a run of ``samples`` with ``cfg`` and ``accumulation_tasks`` tasks
    per step, as :class:`~coserve.core.coserver.CoServer` forms them in FT-only steps.

    The pool (:class:`SamplePool`) shows the first ``candidate_window`` samples of the current
    epoch not yet claimed, in its order; a task takes them shortest first (``(num_tokens,
    sample_id)``, as admission orders them) until it holds ``backward_tokens`` tokens, from the
    window refilled where one was not enough, or all that is left of the epoch (which then ends
    the task: the window never reaches into the next epoch before this one's samples are
    retired). A step ends after ``accumulation_tasks`` tasks or with its epoch. Exact for a run
    with no inference beside it (``coserve finetune``), whose FT-only steps admission fills up
    to the activation store's capacity (``backward_tokens + max_seq_len - 1``: never short of a
    full task); where requests share the steps, the latency budget may close a task sooner and
    interrupted steps put samples back, and a trainer that dies puts its step's samples back:
    then it is an estimate.

    NOTE: this mirrors ``CoServer._plan``, ``CoServer._submit`` and ``SamplePool.candidates``
    (tests/server/test_finetune_cli.py checks it against both); change them together.
    About 10 µs per task (a sort of the window)."""
    n = len(samples)
    if n == 0:
        return 0
    window_size, budget = cfg.candidate_window, cfg.backward_tokens
    lengths = [s.num_tokens for s in samples]
    # (admission's order as one integer per sample: the window sorts without a key function)
    by_size = sorted(range(n), key=lambda i: (lengths[i], samples[i].sample_id))
    rank = [0] * n
    for r, i in enumerate(by_size):
        rank[i] = r
    pool = SamplePool(samples, epochs=cfg.epochs, seed=cfg.seed, shuffle=cfg.shuffle, window=window_size)
    steps = 0
    for epoch in range(cfg.epochs):
        rest = iter(pool.order(epoch))
        window = list(islice(rest, window_size))
        tasks = 0  # (of the step being assembled)
        while window:
            tokens = 0
            while window and tokens < budget:
                picked = set()
                for r in sorted(rank[i] for i in window):
                    if tokens >= budget:
                        break
                    picked.add(by_size[r])
                    tokens += lengths[by_size[r]]
                window = [i for i in window if i not in picked]
                window.extend(islice(rest, window_size - len(window)))
            tasks += 1
            if tasks >= accumulation_tasks or not window:
                steps += 1
                tasks = 0
    return steps

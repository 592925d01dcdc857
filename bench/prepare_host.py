"""Host (CPU) time of building a step's inputs (``ModelRunner.prepare``), spaced as in serving.

A serving engine builds one step's inputs every few tens of milliseconds, and between two steps
the process's OpenMP threads fall asleep: a CPU op that runs a parallel loop (``torch``'s intra-op
parallelism) then pays their wake-up, which a tight timing loop never sees. So every call here is
timed after ``--gap-ms`` of sleep. Step kinds (tiny model: the inputs' sizes are those of real
steps, the model does not matter):

* ``prefill``: 4 chunks of 512 tokens over cached prefixes of 0–3,000 tokens, no adapter;
* ``mixed``: a 1,000-token chunk over 2,000 cached tokens, 3 FT rows of 256 tokens on an adapter
  slot (the training slot's routing) and 64 decode rows;
* ``routing``: the adapter routing alone of the ``mixed`` step (``LoRABatch.from_rows``), beside
  ``torch.repeat_interleave`` of the same segments (what ``from_rows`` used before session 9);
* ``refit``: one latency-model refit over a full window of 2,000 prefill steps, idle and busy (the
  engine thread runs one every ~100 steps of a set, inside ``LatencyModel.observe``).

    .venv/bin/python bench/prepare_host.py [--threads N] [--gap-ms 40] [--reps 40] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from coserve.bench.provenance import provenance
from coserve.core.latency import BatchSpec, Chunk, LatencyModel
from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.engine.model_runner import BatchRow
from coserve.layers.lora import LoRABatch


def step_rows(kind: str, block_size: int) -> list[BatchRow]:
    def table(tokens: int) -> list[int]:
        return list(range(tokens // block_size + 1))

    if kind == "prefill":
        return [BatchRow(list(range(512)), 1000 * i, table(1000 * i + 512), samples=True) for i in range(4)]
    rows = [BatchRow(list(range(1000)), 2000, table(3000), samples=True)]
    rows += [BatchRow(list(range(256)), 0, [], 0, writes_kv=False) for _ in range(3)]
    rows += [BatchRow([5], 1500 + i, table(1501 + i), samples=True, is_prefill=False) for i in range(64)]
    return rows


def spaced(fn: Callable[[], object], reps: int, gap_s: float) -> dict[str, float]:
    """ms per call of ``fn``, each after ``gap_s`` of sleep (after 3 untimed calls)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        time.sleep(gap_s)
        began = time.perf_counter()
        fn()
        times.append((time.perf_counter() - began) * 1e3)
    times.sort()
    return {"median_ms": statistics.median(times), "p90_ms": times[int(0.9 * (len(times) - 1))],
            "max_ms": times[-1]}


def refit_times(reps: int, gap_s: float) -> dict[str, dict[str, float]]:
    """ms of ``LatencyModel._solve`` over 2,000 synthetic prefill steps, idle and busy."""
    rng = random.Random(0)
    model = LatencyModel()
    specs = [BatchSpec((Chunk(rng.randint(16, 2048), rng.choice([0, 1000])),), (100,) * rng.randint(0, 16))
             for _ in range(2000)]
    idle = [(model.regressors(s.features()), 0.005 + 2e-5 * s.num_tokens * (1 + 0.1 * rng.random()))
            for s in specs]
    model.fit([s.record(t) for s, (_, t) in zip(specs[:100], idle[:100], strict=True)])
    busy = [(v, t * 1.3) for v, t in idle]
    return {
        "idle": spaced(lambda: model._solve("prefill/eager", False, idle, None), reps, gap_s),
        "busy": spaced(lambda: model._solve("prefill/eager", True, busy, None), reps, gap_s),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--gap-ms", type=float, default=40.0, help="sleep before each timed call")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", skip_tokenizer_init=True, max_num_batched_tokens=4096,
                                    max_model_len=8192, num_kv_blocks=4096, warmup="off"))
    runner, bs, gap = engine.runner, engine.config.block_size, args.gap_ms / 1e3
    figures: dict[str, Any] = {"threads": torch.get_num_threads()}
    for kind in ("prefill", "mixed"):
        rows = step_rows(kind, bs)
        figures[kind] = spaced(lambda rows=rows: runner.prepare(rows), args.reps, gap)
    rows = step_rows("mixed", bs)
    lens, slots = [len(r.token_ids) for r in rows], [r.lora_slot for r in rows]
    batch = LoRABatch.from_rows(lens, slots)
    seg_slots = torch.tensor(batch.seg_slots, dtype=torch.int64)
    seg_lens = torch.tensor(batch.seg_lens, dtype=torch.int64)
    figures["routing"] = {
        "from_rows": spaced(lambda: LoRABatch.from_rows(lens, slots), args.reps, gap),
        "repeat_interleave": spaced(lambda: torch.repeat_interleave(seg_slots, seg_lens), args.reps, gap),
        "segments": len(batch.seg_slots),
    }
    figures["refit"] = refit_times(args.reps, gap)
    record = {**provenance(), "config": {"gap_ms": args.gap_ms, "reps": args.reps, "threads": args.threads},
              "figures": figures}
    text = json.dumps(record, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()

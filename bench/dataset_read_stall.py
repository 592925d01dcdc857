"""How much a fine-tuning job's dataset read slows a serving engine's steps, by where it runs.

``coserve serve --finetune-jobs`` reads a new job's dataset (JSON parsing, the chat template,
tokenization: Python) in a worker thread of the server's process, beside the engine's thread
(``job_board``: ``asyncio.to_thread``); session 32's jobs run on the H100 saw the set-up's TTFT
p99 at 499 ms against 55 ms with no job, and a dataset read of 0.9-1.3 s there. This runs the
built-in tiny engine on the CPU, decoding a batch of requests step after step, and times its
steps while the same dataset is read

- ``none``: not at all (the baseline),
- ``thread``: in a thread of this process (the server's way), at the server's thread switch
  interval (``--switch-interval-ms``, the server's default) and at CPython's 5 ms,
- ``process``: by the server's :class:`~coserve.server.dataset_reader.DatasetReader` (its child
  started before the window, so its start-up is not counted; the samples rebuilt here counted),

and reports per case the steps' p50 / p99 / max and the read's wall time. On a machine with
fewer free cores than two, ``process`` shares a core with the engine: the dev VM has two.

    PYTHONPATH=src python bench/dataset_read_stall.py --rows 20000 --out bench/results/host_cpu/session33/dataset_read_stall.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coserve import EngineConfig, LLMEngine, SamplingParams
from coserve.bench.provenance import provenance
from coserve.core.finetune import load_dataset
from coserve.server.dataset_reader import DatasetReader
from coserve.server.serve_cli import SWITCH_INTERVAL_MS


def write_rows(path: Path, rows: int, seed: int = 0) -> Path:
    """Alpaca rows of a few hundred characters each (tokenized on read)."""
    rng = random.Random(seed)
    words = ["the", "candle", "is", "in", "north", "blanket", "red", "island", "west", "where", "color", "what"]
    with path.open("w") as f:
        for _ in range(rows):
            f.write(json.dumps({"instruction": " ".join(rng.choices(words, k=rng.randint(20, 60))),
                                "output": " ".join(rng.choices(words, k=rng.randint(40, 120)))}) + "\n")
    return path


def steps_while(engine: LLMEngine, work: Any, warm_s: float = 0.5) -> tuple[list[float], float]:
    """Step the engine (topping its batch up) from ``warm_s`` before ``work()`` starts until it
    ends; the step times during ``work`` and its wall time."""
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    n = 0

    def top_up() -> None:
        nonlocal n
        while engine.num_unfinished_requests < 8:
            engine.add_request(f"r{n}", list(range(5, 69)), params)
            n += 1

    done = threading.Event()
    began: list[float] = []

    def run() -> None:
        time.sleep(warm_s)
        began.append(time.perf_counter())
        work()
        began.append(time.perf_counter())
        done.set()

    t = threading.Thread(target=run)
    t.start()
    times: list[tuple[float, float]] = []
    while not done.is_set():
        top_up()
        s = time.perf_counter()
        engine.step()
        times.append((s, time.perf_counter() - s))
    t.join()
    start, end = began
    return [d for s, d in times if start <= s <= end], end - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    # (one intra-op thread: the engine's CPU ops then leave the second core to the child, as a GPU
    # engine's host leaves its other cores; with two, each op waits for a preempted thread)
    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(model="tiny"))
    work_dir = Path(tempfile.mkdtemp(prefix="dataset_stall_"))
    data = write_rows(work_dir / "rows.jsonl", args.rows)
    out: dict[str, Any] = {}
    tok = engine.tokenizer
    kwargs = dict(max_seq_len=512, train_on_prompt=False, vocab_size=tok.vocab_size)
    reader = DatasetReader(tok)  # (the server's: its child started, and warm, before any window)
    reader.read(write_rows(work_dir / "warm.jsonl", 10), **kwargs)
    cases = [("none", SWITCH_INTERVAL_MS, lambda: time.sleep(2.0)),
             ("thread", SWITCH_INTERVAL_MS, lambda: load_dataset(data, tok, **kwargs)),
             ("thread_5ms", 5.0, lambda: load_dataset(data, tok, **kwargs)),
             ("process", SWITCH_INTERVAL_MS, lambda: reader.read(data, **kwargs))]
    try:
        for name, switch_ms, work in cases:
            sys.setswitchinterval(switch_ms / 1e3)
            steps, wall = steps_while(engine, work)
            # (no step began during the read: the engine waited the whole of it)
            ms = np.asarray(steps or [wall]) * 1e3
            out[name] = {"switch_interval_ms": switch_ms, "steps": len(steps), "read_s": wall,
                         "step_p50_ms": float(np.median(ms)), "step_p99_ms": float(np.quantile(ms, 0.99)),
                         "step_max_ms": float(ms.max())}
            print(f"{name:10s} switch {switch_ms:g} ms: {len(steps)} steps in {wall:.2f} s, step p50 "
                  f"{np.median(ms):.2f} p99 {np.quantile(ms, 0.99):.2f} max {ms.max():.2f} ms", flush=True)
    finally:
        reader.close()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({**provenance(), "config": {"rows": args.rows}, "figures": out}, indent=1))


if __name__ == "__main__":
    main()

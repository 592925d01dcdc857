"""The engine's step time beside a CPU-bound thread of the same process, by the interpreter's
switch interval (``sys.setswitchinterval``, which ``coserve serve`` sets from ``--switch-interval-ms``).

``coserve serve`` runs the engine's step loop in a thread of the API server's process. While
another thread of that process runs Python (a fine-tuning job's dataset load at its create and its
resume, the event loop's HTTP and streaming work), the engine's thread waits for the GIL each time
it takes it back, up to the switch interval each time (CPython's default: 5 ms). This times the
engine's steps alone and beside a thread that loads a fine-tuning dataset over and over
(``coserve.server.finetune.read_dataset``, what a job's create and resume run), at each switch
interval given, on the same engine. Every torch call lets the GIL go and takes it back, so a step
of many small ops waits up to one switch interval per op while the other thread runs Python:

    python bench/gil_contention.py --model tiny --device cpu \\
        --out bench/results/host_cpu/session31/gil_contention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from coserve.bench.ftdata import parse_lengths, write_ft_dataset
from coserve.bench.provenance import provenance
from coserve.bench.shapes import is_shape
from coserve.core.config import CoServeConfig
from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.engine.sampling_params import SamplingParams
from coserve.server.finetune import read_dataset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--switch-ms", default="5,1,0.5,0.2,0.1", help="switch intervals to time, in ms (5: CPython's default)")
    p.add_argument("--running", type=int, default=8, help="requests kept decoding")
    p.add_argument("--prompt", type=int, default=64, help="each request's prompt tokens")
    p.add_argument("--steps", type=int, default=30, help="steps timed per setting, alone and beside the load")
    p.add_argument("--rows", type=int, default=100, help="the dataset's samples")
    p.add_argument("--lengths", default="spread:256-1024", help="its samples' lengths (coserve bench's form)")
    p.add_argument("--threads", type=int, default=1,
                   help="the engine's intra-op threads (torch.set_num_threads): 1, the engine's host work in one "
                        "thread as a GPU engine's is")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Decoder:
    """Keeps ``running`` requests decoding on ``engine`` and times its steps."""

    def __init__(self, engine: LLMEngine, running: int, prompt: int) -> None:
        self.engine, self.running, self.prompt = engine, running, prompt
        self.params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
        self.count = 0

    def top_up(self) -> None:
        while len(self.engine.scheduler.running) + len(self.engine.scheduler.waiting) < self.running:
            ids = [(self.count * 7 + j) % 500 + 3 for j in range(self.prompt)]
            self.engine.add_request(f"r{self.count}", ids, self.params)
            self.count += 1

    def timed_steps(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            self.top_up()
            t0 = time.perf_counter()
            self.engine.step()
            out.append(time.perf_counter() - t0)
        return out


def time_setting(decoder: Decoder, data: Path, steps: int) -> dict[str, Any]:
    """Steps alone, then beside a thread loading ``data`` until they are done."""
    alone = decoder.timed_steps(steps)
    stop, loads = threading.Event(), [0]

    def load() -> None:
        while not stop.is_set():
            read_dataset(decoder.engine, data, CoServeConfig())
            loads[0] += 1

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    t0 = time.perf_counter()
    beside = decoder.timed_steps(steps)
    elapsed = time.perf_counter() - t0
    stop.set()
    loader.join()

    def summary(v: list[float]) -> dict[str, float]:
        return {"p50_ms": 1e3 * statistics.median(v), "p90_ms": 1e3 * _quantile(v, 0.9),
                "p99_ms": 1e3 * _quantile(v, 0.99), "max_ms": 1e3 * max(v)}

    return {"alone": summary(alone), "beside_load": summary(beside),
            "loads_per_s": loads[0] / elapsed if elapsed > 0 else 0.0}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    switches = [float(v) for v in args.switch_ms.split(",")]
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device,
                                    load_format="dummy" if is_shape(args.model) else "auto"))
    decoder = Decoder(engine, args.running, args.prompt)
    decoder.timed_steps(50)  # (warm-up)
    default = sys.getswitchinterval()
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        vocab = min(engine.model_config.vocab_size, 1000)
        data = write_ft_dataset(Path(tmp) / "data.jsonl", args.rows, parse_lengths(args.lengths), vocab, 0)
        try:
            for ms in switches:
                sys.setswitchinterval(ms / 1e3)
                got = time_setting(decoder, data, args.steps)
                figures[f"switch_{ms:g}ms"] = got
                print(f"switch {ms:g} ms: step p50 / p99 alone {got['alone']['p50_ms']:.2f} / "
                      f"{got['alone']['p99_ms']:.2f} ms, beside the dataset load {got['beside_load']['p50_ms']:.2f} / "
                      f"{got['beside_load']['p99_ms']:.2f} ms ({got['loads_per_s']:.2f} loads/s)", flush=True)
        finally:
            sys.setswitchinterval(default)
    result = {**provenance(), "config": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "figures": figures}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"result: {args.out}")
    return result


if __name__ == "__main__":
    main()

"""Shared pieces of the speed benchmarks: model shapes, provenance, ceilings, timers."""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from coserve.bench.provenance import provenance as provenance  # re-exported for the scripts
from coserve.bench.shapes import SHAPES
from coserve.bench.workload import Scaling

# The shapes and the provenance record live in the package, shared with `coserve bench`.
LLAMA3_8B: dict[str, Any] = SHAPES["llama3-8b"]


def write_model_dir(path: Path, config: dict[str, Any]) -> Path:
    """A model directory holding only ``config.json`` (weights come from ``load_format="dummy"``)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


TINY: dict[str, Any] = {
    **LLAMA3_8B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 4096,
}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cuda_time(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn`` on the current stream, timed with CUDA events (host clock on CPU)."""
    if not torch.cuda.is_available():
        return wall_time(fn, iters, warmup)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def wall_time(fn: Callable[[], object], iters: int = 10, warmup: int = 3) -> float:
    """Median host seconds of ``fn`` including its device work (synchronized before and after)."""
    import time

    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(gib: float = 4.0) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    n = int(gib * 2**30) // 2
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), iters=20)
    return 2 * n * 2 / t


def matmul_rate(n: int = 8192) -> float:
    """Dense bf16 matrix product rate in FLOP/s on random data (rotating two input sets)."""
    mats = [(torch.randn(n, n, dtype=torch.bfloat16, device="cuda"),
             torch.randn(n, n, dtype=torch.bfloat16, device="cuda")) for _ in range(2)]
    out = torch.empty(n, n, dtype=torch.bfloat16, device="cuda")
    step = iter(range(10**9))

    def run() -> None:
        a, b = mats[next(step) % 2]
        torch.matmul(a, b, out=out)

    t = cuda_time(run, iters=20)
    return 2 * n**3 / t


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` in float64 (NaN counts as a failure: returns inf)."""
    if out.isnan().any():
        return float("inf")
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def add_trace_args(p: argparse.ArgumentParser, duration: float) -> None:
    """The trace-replay flags the scripts share: which trace, which window, how it is scaled."""
    p.add_argument("--trace", required=True)
    p.add_argument("--duration", type=float, default=duration)
    p.add_argument("--rate-scale", type=float, default=1.0)
    p.add_argument("--length-scale", type=float, default=1.0)
    p.add_argument("--max-prompt", type=int, default=4096)
    p.add_argument("--max-output", type=int, default=512)


def trace_scaling(args: argparse.Namespace) -> Scaling:
    return Scaling(rate=args.rate_scale, length=args.length_scale, max_prompt=args.max_prompt,
                   max_output=args.max_output)

"""Host cost of the trainer's boundary bookkeeping on CUDA, by part, with the gate open.

At every boundary of a backward task the trainer (``coserve.trainer.worker._Worker``) records a
timed event, queues the gate's wait (``cuStreamWaitValue32`` through ctypes), records a second
event and writes the progress word (``cuStreamWriteValue32``), plus a poll point's read of the
flag. A layer of the 8B shape has nine boundaries, and the latency runs show stretches whose host
time is 2–4× their GPU time (``bench/results/latency_h200/session20/``): this times each of those
calls alone, ``--iters`` times on an otherwise idle stream, as the median host µs per call, so
that the share of a stretch that is the boundary's own is known. ``events_new`` makes two events
per boundary (as before 8d783a6), ``events_pooled`` records two kept ones (as since then).

    python3 bench/gate_cost.py --out gate_cost.json       # on a GPU; under MPS as the trainer runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from coserve.bench.provenance import provenance
from coserve.trainer.stream_gate import CLOSED, CLOSURES, StreamGate, encode_progress, new_flag


def per_call_us(fn: Callable[[], object], iters: int, batches: int = 7) -> float:
    """Median over ``batches`` of the mean host µs of ``fn`` over ``iters`` calls."""
    means = []
    for _ in range(batches):
        began = time.perf_counter()
        for _ in range(iters):
            fn()
        means.append((time.perf_counter() - began) / iters * 1e6)
    return statistics.median(means)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gate_cost.py times CUDA driver calls: it needs a GPU")
    device = torch.device("cuda")
    flag = new_flag()
    gate = StreamGate.open(flag, device)
    if gate is None:
        raise SystemExit("no GPU-side gate on this machine (see the log)")
    stream = torch.cuda.current_stream()
    word = flag.numpy()
    pool = [torch.cuda.Event(enable_timing=True, blocking=True) for _ in range(2)]
    code = encode_progress(5, 3)

    def events_new() -> None:
        for _ in range(2):
            torch.cuda.Event(enable_timing=True, blocking=True).record(stream)

    def events_pooled() -> None:
        for e in pool:
            e.record(stream)

    def poll() -> bool:
        return bool(word[0] != CLOSED or word[CLOSURES] == -1)

    parts: dict[str, Callable[[], object]] = {
        "current_stream": torch.cuda.current_stream,
        "events_new": events_new,
        "events_pooled": events_pooled,
        "gate_wait": lambda: gate.wait(stream),
        "gate_mark": lambda: gate.mark(stream, code),
        "poll_read": poll,
        "monotonic_and_process_time": lambda: (time.monotonic(), time.process_time()),
        "empty_kernel_launch": lambda: torch.cuda._sleep(0),
    }
    figures: dict[str, float] = {}
    try:
        for name, fn in parts.items():
            fn()  # (first call apart: lazy set-up)
            torch.cuda.synchronize()
            figures[name] = per_call_us(fn, args.iters)
            torch.cuda.synchronize()
    finally:
        gate.close()
    figures["boundary_pooled"] = (figures["current_stream"] + figures["events_pooled"] + figures["gate_wait"]
                                  + figures["gate_mark"] + figures["monotonic_and_process_time"])
    for name, us in figures.items():
        print(f"{name:>28} {us:8.2f} us")
    if args.out:
        Path(args.out).write_text(json.dumps({**provenance(), "config": vars(args), "figures": {"us_per_call": figures}},
                                             indent=1))


if __name__ == "__main__":
    main()

"""How much of an eager step is CPU work, and how much does a busy CPU slow it?

Eager (prefill-carrying) steps of the Llama-3-8B shape through ``ModelRunner.execute``: the CPU
time until ``execute`` returns (``enqueue_s``: the host builds the batch and queues every kernel)
and the time until the device is done (``step_s``), per batch shape, under three conditions:
the machine idle; ``--hog`` processes spinning on the CPU (as a co-located job or the trainer's
host threads would); and the same with this process limited to one intra-op thread. Then one
step of each shape under ``torch.profiler``: the operators by self CPU time, to name what the
host spends its time on.

    PYTHONPATH=src python3 bench/eager_cpu.py --out bench/results/eager_cpu_h200.json
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from engine_speed import build_runner
from speed_common import LLAMA3_8B, TINY, provenance, write_model_dir

from coserve.engine.model_runner import BatchRow, ModelRunner

logger = logging.getLogger("bench")

# (name, rows, tokens per row, cached context per row, decode rows, each decode row's context): the
# replay's eager steps are chunks of ~2,000 tokens of one or a few prompts, often after a cached
# prefix of earlier chunks; its small ones (< 512 tokens) a short chunk beside tens of decodes.
SHAPES = (("1x2048_ctx0", 1, 2048, 0, 0, 0), ("1x2048_ctx2048", 1, 2048, 2048, 0, 0),
          ("4x512_ctx1024", 4, 512, 1024, 0, 0), ("1x512_ctx0", 1, 512, 0, 0, 0),
          ("1x96_ctx0+32d", 1, 96, 0, 32, 800), ("1x96_ctx1024+32d", 1, 96, 1024, 32, 800),
          ("1x448_ctx1024+32d", 1, 448, 1024, 32, 800))


def _spin(stop: Any) -> None:
    while not stop.is_set():
        sum(range(10_000))


def rows_for(runner: ModelRunner, rows: int, tokens: int, context: int, decodes: int, decode_context: int,
             rng: random.Random) -> list[BatchRow]:
    free = list(range(runner.num_blocks))
    rng.shuffle(free)
    vocab = runner.model.config.vocab_size
    prefill = [BatchRow([rng.randrange(vocab) for _ in range(tokens)], context,
                        [free.pop() for _ in range(-(-(context + tokens) // 16))], samples=True)
               for _ in range(rows)]
    return prefill + [BatchRow([rng.randrange(vocab)], decode_context,
                               [free.pop() for _ in range(-(-(decode_context + 1) // 16))], samples=True,
                               is_prefill=False)
                      for _ in range(decodes)]


def canary() -> float:
    """Seconds of a fixed piece of pure Python (about half a ms): the interpreter's speed on this
    CPU now, beside each step's host time."""
    began = time.perf_counter()
    sum(i * i for i in range(20_000))
    return time.perf_counter() - began


def time_steps(runner: ModelRunner, batch: list[BatchRow], iters: int) -> dict[str, Any]:
    """The batch's step ``iters`` times after two warm-up runs, the device idle at each start: the
    host's seconds queuing it (``enqueue``; its thread's CPU time in them, ``enqueue_cpu``: below
    the wall time, the thread waited or was descheduled) and until the device is done (``step``),
    median, max and spread (p10 / p90 / p99: whether the same step's host time varies, session 43's
    question: 20-50 ms for the same small eager step in the latency runs, on one CPU). Before each
    step, :func:`canary`: where the step's host time follows the canary's (``canary_corr``, the
    series in ``enqueue_ms`` and ``canary_ms``), the CPU ran slower, not the step's own work."""
    cuda = runner.device.type == "cuda"
    enq, total, cpu, canaries = [], [], [], []
    for i in range(iters + 2):
        if cuda:
            torch.cuda.synchronize()
        spent = canary()
        t0, c0 = time.perf_counter(), time.thread_time()
        runner.execute(batch)
        t1, c1 = time.perf_counter(), time.thread_time()
        if cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= 2:
            enq.append(t1 - t0)
            total.append(t2 - t0)
            cpu.append(c1 - c0)
            canaries.append(spent)
    out: dict[str, Any] = {"enqueue_s": statistics.median(enq), "step_s": statistics.median(total),
                           "enqueue_max_s": max(enq), "step_max_s": max(total), "enqueue_cpu_s": statistics.median(cpu)}
    for name, values in (("enqueue", enq), ("step", total), ("canary", canaries)):
        out.update({f"{name}_p{round(q * 100)}_s": float(np.quantile(values, q)) for q in (0.1, 0.9, 0.99)})
    out["canary_s"] = statistics.median(canaries)
    out["canary_corr"] = float(np.corrcoef(enq, canaries)[0, 1]) if len(enq) > 2 else None
    out["enqueue_ms"] = [round(x * 1e3, 3) for x in enq]
    out["canary_ms"] = [round(x * 1e3, 4) for x in canaries]
    return out


def profile_table(runner: ModelRunner, batch: list[BatchRow], rows: int = 30) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    runner.execute(batch)
    with profile(activities=activities) as prof:
        runner.execute(batch)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
    return str(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def python_profile(runner: ModelRunner, batch: list[BatchRow], rows: int = 30) -> str:
    """One step's host side under cProfile, by function's own time: the Python that the operator
    table cannot name (kernel launchers' argument binding, metadata, slicing)."""
    import cProfile
    import io
    import pstats

    runner.execute(batch)
    prof = cProfile.Profile()
    prof.enable()
    runner.execute(batch)
    prof.disable()
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(rows)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results/eager_cpu_h200.json"))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--hog", type=int, default=os.cpu_count() or 2, help="spinning processes")
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU (a check of the script)")
    parser.add_argument("--prefill-graphs", action="store_true",
                        help="steps through the piecewise CUDA graphs (engine/prefill_graphs.py)")
    parser.add_argument("--conditions", default="idle,hog,hog_one_thread,idle_one_thread",
                        help="which of idle, hog, hog_one_thread, idle_one_thread to measure")
    parser.add_argument("--shapes", default=None, help="names of SHAPES to run (comma-separated; default all)")
    parser.add_argument("--no-profile", action="store_true", help="skip the operator and cProfile tables")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    rng = random.Random(0)
    torch.manual_seed(0)
    model_cfg = TINY if args.smoke else LLAMA3_8B
    device = "cpu" if args.smoke else "cuda"
    picked = [s for s in SHAPES if args.shapes is None or s[0] in args.shapes.split(",")]
    if not picked:
        parser.error(f"--shapes: none of {args.shapes!r} is one of {', '.join(s[0] for s in SHAPES)}")
    shapes = [(n, r, t // 16 if args.smoke else t, c // 16 if args.smoke else c, d, dc // 16 if args.smoke else dc)
              for n, r, t, c, d, dc in picked]
    result: dict[str, Any] = provenance()
    result["config"] = {"model": "tiny (smoke)" if args.smoke else "Llama-3-8B shape, dummy weights",
                        "device": device, "iters": args.iters, "hog_processes": args.hog,
                        "shapes": [dict(zip(("name", "rows", "tokens", "context", "decodes", "decode_context"), s, strict=True))
                                   for s in shapes],
                        "intra_op_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                        "prefill_graphs": args.prefill_graphs}
    figures: dict[str, Any] = {"conditions": {}}
    result["figures"] = figures
    with tempfile.TemporaryDirectory() as tmp:
        runner = build_runner(write_model_dir(Path(tmp), model_cfg), 4.0, (1,), device)
    if args.prefill_graphs:
        runner.prefill_graphs = runner.make_prefill_graphs(capture=device == "cuda")
        runner.prefill_graphs.capture_all()
    batches = {name: rows_for(runner, r, t, c, d, dc, rng) for name, r, t, c, d, dc in shapes}

    def measure(condition: str) -> None:
        figures["conditions"][condition] = res = {name: time_steps(runner, b, args.iters) for name, b in batches.items()}
        logger.info("%s %s", condition, json.dumps({n: {k: round(v * 1e3, 2) if k.endswith("_s") else v
                                                        for k, v in d.items() if not k.endswith("_ms")}
                                                    for n, d in res.items()}))

    threads = torch.get_num_threads()
    conditions = args.conditions.split(",")
    if "idle" in conditions:
        measure("idle")
    if {"hog", "hog_one_thread"} & set(conditions):
        stop = mp.get_context("fork").Event()
        hogs = [mp.get_context("fork").Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.hog)]
        for p in hogs:
            p.start()
        time.sleep(1.0)
        try:
            if "hog" in conditions:
                measure("hog")
            if "hog_one_thread" in conditions:
                torch.set_num_threads(1)
                measure("hog_one_thread")
                torch.set_num_threads(threads)
        finally:
            stop.set()
            for p in hogs:
                p.join(timeout=10)
    if "idle_one_thread" in conditions:
        torch.set_num_threads(1)
        measure("idle_one_thread")
    torch.set_num_threads(threads)
    if not args.no_profile:
        figures["profile_self_cpu"] = {name: profile_table(runner, b) for name, b in batches.items()}
        for name, table in figures["profile_self_cpu"].items():
            logger.info("profile %s\n%s", name, table)
        figures["python_profile"] = {name: python_profile(runner, b) for name, b in batches.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

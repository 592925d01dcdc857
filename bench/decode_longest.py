"""Does a decode step's time follow its rows' total KV, or its longest row?

The latency model prices a decode step by its rows and the KV tokens they read in total
(``b'·B_d + e'·K + c'``), and the calibration times batches whose rows all have one KV length.
The paged decode kernel cuts every row's keys into the same number of splits (one per
(row, KV head, split) program, the split count set by the batch's rows so that the programs fill
the GPU twice), so a batch whose rows differ in length waits on its longest row's programs. This
times decode steps of the Llama-3-8B shape through the engine's decode CUDA graphs at the same rows
and the same total KV with three layouts of it: ``uniform`` (one length), ``spread`` (evenly from
a quarter to 1.75 times the mean, what ``COSERVE_CALIB_KV_SPREAD`` gives the calibration) and
``one_long`` (one row at ``--long`` times the mean, the rest sharing what is left). Each step is
timed by CUDA events around the graph replay, the median of ``--iters``.

    PYTHONPATH=src python3 bench/decode_longest.py --out bench/results/decode_longest.json
    PYTHONPATH=src python3 bench/decode_longest.py --smoke --out /tmp/decode_longest.json   # CPU check
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from engine_speed import build_runner
from speed_common import LLAMA3_8B, TINY, provenance, write_model_dir

from coserve.engine.model_runner import BatchRow, ModelRunner

logger = logging.getLogger("bench")

LAYOUTS = ("uniform", "spread", "one_long")


def layout(name: str, rows: int, mean: int, long: float, cap: int) -> list[int]:
    """``rows`` KV lengths of about ``rows × mean`` in total, laid out as ``name``."""
    if name == "uniform" or rows == 1:
        return [mean] * rows
    if name == "spread":
        return [min(cap, max(1, round(mean * (0.25 + 1.5 * i / (rows - 1))))) for i in range(rows)]
    first = min(cap, round(mean * long), rows * mean - (rows - 1))  # (the others at least 1 token each)
    rest = max(1, (rows * mean - first) // (rows - 1))
    return [first] + [rest] * (rows - 1)


def decode_rows(runner: ModelRunner, lens: list[int], rng: random.Random) -> list[BatchRow]:
    free = list(range(runner.num_blocks))
    rng.shuffle(free)
    vocab = runner.model.config.vocab_size
    return [BatchRow([rng.randrange(vocab)], n, [free.pop() for _ in range(-(-(n + 1) // 16))], samples=True,
                     is_prefill=False) for n in lens]


def time_step(runner: ModelRunner, rows: list[BatchRow], iters: int) -> float:
    """The median seconds of one decode step (CUDA events on the GPU, the wall clock on the CPU)."""
    cuda = runner.device.type == "cuda"
    times = []
    for i in range(iters + 3):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            runner.execute(rows)
            end.record()
            end.synchronize()
            took = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            runner.execute(rows)
            took = time.perf_counter() - t0
        if i >= 3:
            times.append(took)
    if runner.last_mode != "graph":
        raise RuntimeError(f"a decode step of {len(rows)} rows ran {runner.last_mode}, not from its graph")
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", default="4,8,16,24,32,48,64", help="decode rows per step (comma-separated)")
    p.add_argument("--means", default="256,1024,2048", help="mean KV tokens per row (comma-separated)")
    p.add_argument("--long", type=float, default=4.0, help="one_long: the long row's KV over the mean")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU (a check of the script)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    rng = random.Random(0)
    torch.manual_seed(0)
    device = "cpu" if args.smoke else "cuda"
    rows_list = [int(x) for x in args.rows.split(",")]
    means = [max(1, int(x) // (16 if args.smoke else 1)) for x in args.means.split(",")]
    sizes = (1, 2, 4, 8, 16, 24, 32, 48, 64)
    with tempfile.TemporaryDirectory() as tmp:
        runner = build_runner(write_model_dir(Path(tmp), TINY if args.smoke else LLAMA3_8B), 1.0 if args.smoke else 24.0,
                              tuple(sorted(set(sizes) | set(rows_list))), device)
    cap = runner.config.max_model_len - 2
    result: dict[str, Any] = provenance()
    result["config"] = {"model": "tiny (smoke)" if args.smoke else "Llama-3-8B shape, dummy weights",
                        "device": device, "rows": rows_list, "mean_kv": means, "long": args.long,
                        "iters": args.iters, "layouts": list(LAYOUTS)}
    cases = []
    for n in rows_list:
        for mean in means:
            case: dict[str, Any] = {"rows": n, "mean_kv": mean}
            for name in LAYOUTS:
                lens = layout(name, n, mean, args.long, cap)
                case[name] = {"kv_total": sum(lens), "kv_max": max(lens),
                              "step_s": time_step(runner, decode_rows(runner, lens, rng), args.iters)}
            base = case["uniform"]["step_s"]
            for name in LAYOUTS[1:]:
                case[name]["over_uniform"] = case[name]["step_s"] / base
            logger.info("rows %d mean %d: %s", n, mean, {k: round(case[k]["step_s"] * 1e3, 3) for k in LAYOUTS})
            cases.append(case)
    result["figures"] = {"cases": cases}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

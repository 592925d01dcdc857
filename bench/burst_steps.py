"""Median time of the full-size steps (more than ``--min-prefill`` prompt tokens) of each
configuration of an evaluation result in given time windows, and given requests' TTFT: how much a
configuration slowed the steps of a burst against the reference.

    python bench/burst_steps.py bench/results/eval_h200/session11/call2/azure2023_code/azure2023_code.json.xz \
        --window 25:30.4 --window 30.4:31.5 --request 340
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from coserve.bench.result_file import read_result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("result", type=Path)
    p.add_argument("--window", action="append", default=[], help="START:END seconds of the replay")
    p.add_argument("--min-prefill", type=int, default=2000)
    p.add_argument("--request", type=int, action="append", default=[], help="a request index")
    args = p.parse_args()
    figures = read_result(args.result)["figures"]
    for name, f in figures.items():
        steps = f.get("engine_steps")
        if not steps:
            continue
        col = steps["columns"].index
        for window in args.window:
            lo, hi = (float(x) for x in window.split(":"))
            big = [row[col("seconds")] for row in steps["rows"]
                   if lo <= row[col("t_s")] < hi and row[col("prefill_tokens")] > args.min_prefill]
            median = f"{1e3 * statistics.median(big):.1f} ms" if big else "-"
            print(f"{name:>12} {lo:g}-{hi:g} s: {len(big)} steps over {args.min_prefill} prompt tokens, median {median}")
        for i in args.request:
            print(f"{name:>12} request {i}: TTFT {f['per_request']['ttft_ms'][i]:.1f} ms")


if __name__ == "__main__":
    main()

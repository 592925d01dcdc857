"""Offline: a latency run's busy decode error over time, beside what ran on the GPU then.

For a ``bench/coserve_latency.py`` run that recorded a ``timeline`` (since session 33: the GPU's
SM clock and utilization every 0.25 s, each backward task's submission, result, tokens, samples
and longest sample), each window of ``--window`` seconds of the step table (its ``began_s``) with
its busy decode steps' relative error (median, p99, the 5th / 95th percentile of measured /
predicted: the device's own predictions), the mean SM clock and utilization, and the tasks
submitted in it (count, mean tokens, samples, longest sample, and the median and 90th percentile
of each one's longest host stretch, where the timeline has it: the trainer's host working while
its GPU stream runs dry). The session-33 cold runs' first
quarter ran noisier than a warm replay of the same arrivals whatever the model's state: this
lines that up with the clock and the trainer's first tasks.

    PYTHONPATH=src python bench/latency_timeline.py RUN.json.xz [RUN2 ...] --out OUT.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from coserve.bench.provenance import provenance
from coserve.bench.result_file import read_result


def windows(path: str, width_s: float) -> list[dict[str, Any]]:
    figures = read_result(path)["figures"]
    if "timeline" not in figures:
        raise SystemExit(f"{path}: no timeline (bench/coserve_latency.py since session 33 records one)")
    table = figures["steps"]
    col = {c: i for i, c in enumerate(table["columns"])}
    steps = [r for r in table["rows"] if r[col["key"]] == "decode/graph/busy" and r[col["measured_s"]] > 0
             and r[col["began_s"]] is not None]
    line = figures["timeline"]
    gpu = np.asarray([[t, np.nan if u is None else u, np.nan if c is None else c] for t, u, c in line["gpu"]],
                     dtype=np.float64).reshape(-1, 3)
    tcol = {c: i for i, c in enumerate(line["task_columns"])}
    tasks = line["tasks"]
    end = max([r[col["began_s"]] for r in steps] + [0.0])
    out = []
    for lo in np.arange(0.0, end + width_s, width_s):
        hi = lo + width_s
        part = [r for r in steps if lo <= r[col["began_s"]] < hi]
        if len(part) < 10:
            continue
        measured = np.asarray([r[col["measured_s"]] for r in part])
        predicted = np.asarray([r[col["predicted_s"]] for r in part])
        rel, ratio = np.abs(predicted - measured) / measured, measured / predicted
        g = gpu[(gpu[:, 0] >= lo) & (gpu[:, 0] < hi)] if len(gpu) else gpu
        sent = [t for t in tasks if lo <= t[tcol["submitted_s"]] < hi]

        def mean(values: Any) -> float | None:
            values = np.asarray(values, dtype=np.float64)
            values = values[np.isfinite(values)]
            return float(values.mean()) if len(values) else None

        spans = [t[tcol["longest_span_cpu_ms"]] for t in sent
                 if "longest_span_cpu_ms" in tcol and t[tcol["longest_span_cpu_ms"]] is not None]
        out.append({
            "from_s": float(lo), "steps": len(part), "median_rel": float(np.median(rel)),
            "p99_rel": float(np.quantile(rel, 0.99)), "ratio_p5": float(np.quantile(ratio, 0.05)),
            "ratio_p95": float(np.quantile(ratio, 0.95)),
            "sm_clock_mhz": mean(g[:, 2]) if len(g) else None, "utilization": mean(g[:, 1]) if len(g) else None,
            "tasks": len(sent), "task_tokens": mean([t[tcol["tokens"]] for t in sent]),
            "task_samples": mean([t[tcol["samples"]] for t in sent]),
            "task_longest_tokens": mean([t[tcol["longest_tokens"]] for t in sent]),
            "task_longest_span_cpu_ms_p50": float(np.median(spans)) if spans else None,
            "task_longest_span_cpu_ms_p90": float(np.quantile(spans, 0.9)) if spans else None,
        })
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+")
    p.add_argument("--window", type=float, default=10.0, help="seconds per window")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    report = {Path(r).name: windows(r, args.window) for r in args.runs}
    for name, rows in report.items():
        print(name)
        for w in rows:
            clock = f"{w['sm_clock_mhz']:.0f}" if w["sm_clock_mhz"] is not None else "-"
            util = f"{w['utilization']:.0f}" if w["utilization"] is not None else "-"
            tokens = f"{w['task_tokens']:.0f}" if w["task_tokens"] is not None else "-"
            span = (f"  longest host stretch p50/p90 {w['task_longest_span_cpu_ms_p50']:.1f}/"
                    f"{w['task_longest_span_cpu_ms_p90']:.1f} ms" if w["task_longest_span_cpu_ms_p50"] is not None
                    else "")
            print(f"  {w['from_s']:6.0f}s {w['steps']:4d} steps  p99 {w['p99_rel'] * 100:5.1f}%  "
                  f"ratio p5/p95 {w['ratio_p5']:.3f}/{w['ratio_p95']:.3f}  SM {clock} MHz  util {util}%  "
                  f"tasks {w['tasks']} of {tokens} tokens{span}")
    if args.out:
        Path(args.out).write_text(json.dumps({**provenance(), "config": {"runs": args.runs, "window_s": args.window},
                                              "figures": report}, indent=1))


if __name__ == "__main__":
    main()

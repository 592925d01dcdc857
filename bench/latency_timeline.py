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

``--stretches``: instead, the tasks by their longest host stretch (under 10, 10-30, 30-100 and
100 ms or more), each with the longest run of back-to-back prefill steps (the engine's gate closed
from one to the next) that overlapped the task, and the tasks by that run's length: whether the
long stretches are the trainer's host held while the engine runs prefill after prefill (session 37).
Each task of a stretch of 100 ms or more is listed too, with its CUDA allocations and sleeps behind
the closed gate where the timeline has them (since session 38), and how many tasks had any.
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
    gpu = np.asarray([[t, np.nan if u is None else u, np.nan if c is None else c] for t, u, c, *_ in line["gpu"]],
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


STRETCH_BINS_MS = (0.0, 10.0, 30.0, 100.0, float("inf"))
RUN_BINS_MS = (0.0, 100.0, 200.0, float("inf"))
LONG_STRETCH_MS = 100.0
"""``--stretches`` lists each task whose longest host stretch is this long, one by one."""
TASK_COUNTS = ("device_allocs", "closed_sleeps")
"""Per-task counts a timeline has since session 38, listed beside each long stretch: a CUDA
allocation can wait for a device the closed gate holds (the host spinning in it), and the sleeps
behind the closed gate are ``COSERVE_TRAINER_CLOSED_AHEAD``'s."""


def prefill_runs(path: str) -> list[tuple[float, float]]:
    """The run's spans ``(start, end)`` in seconds of back-to-back prefill steps (its step table's
    ``began_s`` and measured times), each one or more steps long."""
    return _prefill_runs(read_result(path)["figures"]["steps"])


def _prefill_runs(table: dict[str, Any]) -> list[tuple[float, float]]:
    """:func:`prefill_runs` of a run's step table."""
    col = {c: i for i, c in enumerate(table["columns"])}
    runs: list[tuple[float, float]] = []
    current: list[float] | None = None
    for r in table["rows"]:
        began = r[col["began_s"]]
        if began is None:
            continue
        if r[col["key"]].startswith("prefill/"):
            end = began + r[col["measured_s"]]
            current = [current[0], end] if current else [began, end]
        elif current:
            runs.append((current[0], current[1]))
            current = None
    if current:
        runs.append((current[0], current[1]))
    return runs


def stretches(path: str) -> dict[str, Any]:
    """``--stretches`` (module docstring) for one run."""
    figures = read_result(path)["figures"]
    line = figures.get("timeline")
    if line is None or "longest_span_cpu_ms" not in line["task_columns"]:
        raise SystemExit(f"{path}: no tasks' longest host stretch in its timeline (since session 35)")
    tcol = {c: i for i, c in enumerate(line["task_columns"])}
    runs = _prefill_runs(figures["steps"])
    rows, long = [], []
    for t in line["tasks"]:
        lo, hi, span = t[tcol["submitted_s"]], t[tcol["received_s"]], t[tcol["longest_span_cpu_ms"]]
        if span is None:
            continue
        overlap = [min(hi, b) - max(lo, a) for a, b in runs if b > lo and a < hi]
        rows.append((span, 1e3 * max(overlap, default=0.0)))
        if span >= LONG_STRETCH_MS:
            long.append({"stretch_ms": span, "prefill_run_ms": rows[-1][1],
                         **{c: t[tcol[c]] for c in TASK_COUNTS if c in tcol}})
    data = np.asarray(rows, dtype=np.float64).reshape(-1, 2)

    def binned(column: int, edges: tuple[float, ...], other: int) -> list[dict[str, Any]]:
        out = []
        for a, b in zip(edges[:-1], edges[1:], strict=True):
            part = data[(data[:, column] >= a) & (data[:, column] < b)]
            if len(part):
                out.append({"from_ms": a, "to_ms": None if b == float("inf") else b, "tasks": len(part),
                            "other_p50_ms": float(np.median(part[:, other])),
                            "other_p90_ms": float(np.quantile(part[:, other], 0.9)),
                            "other_min_ms": float(part[:, other].min()), "other_max_ms": float(part[:, other].max())})
        return out

    counts = {f"tasks_with_{c}": sum(1 for t in line["tasks"] if t[tcol[c]]) for c in TASK_COUNTS if c in tcol}
    return {"tasks": len(data), "prefill_runs": len(runs),
            "by_stretch": binned(0, STRETCH_BINS_MS, 1),  # other: the longest prefill run in the task
            "by_prefill_run": binned(1, RUN_BINS_MS, 0),  # other: the task's longest host stretch
            **counts, "long": sorted(long, key=lambda t: -t["stretch_ms"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+")
    p.add_argument("--window", type=float, default=10.0, help="seconds per window")
    p.add_argument("--stretches", action="store_true",
                   help="the tasks' longest host stretches against the prefill runs beside them")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.stretches:
        found = {Path(r).name: stretches(r) for r in args.runs}
        for name, f in found.items():
            print(f"{name}: {f['tasks']} tasks, {f['prefill_runs']} prefill runs")
            for b in f["by_stretch"]:
                print(f"  longest host stretch {b['from_ms']:.0f}-{b['to_ms'] or 'inf'} ms: {b['tasks']:4d} tasks, "
                      f"longest prefill run beside them p50 {b['other_p50_ms']:.0f} ms, min {b['other_min_ms']:.0f}")
            for c in TASK_COUNTS:
                if f"tasks_with_{c}" in f:
                    print(f"  tasks with {c}: {f[f'tasks_with_{c}']}")
            for t in f["long"]:
                extra = "".join(f", {c} {t[c]}" for c in TASK_COUNTS if c in t)
                print(f"  stretch {t['stretch_ms']:.0f} ms beside a prefill run of {t['prefill_run_ms']:.0f} ms{extra}")
            for b in f["by_prefill_run"]:
                print(f"  longest prefill run {b['from_ms']:.0f}-{b['to_ms'] or 'inf'} ms: {b['tasks']:4d} tasks, "
                      f"longest host stretch p50 {b['other_p50_ms']:.1f} ms, p90 {b['other_p90_ms']:.1f}, "
                      f"max {b['other_max_ms']:.1f}")
        if args.out:
            Path(args.out).write_text(json.dumps({**provenance(), "config": {"runs": args.runs, "stretches": True},
                                                  "figures": found}, indent=1))
        return
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

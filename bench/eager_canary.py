"""Offline: could an online reading of the host's speed predict a host-bound eager step's time?

Reads a ``bench/eager_cpu.py`` result with its per-step series (``enqueue_ms`` and the pure-Python
canary timed before each step, ``canary_ms``: session 44's ``eager_spread`` job on) and, per
condition and step shape, predicts the second half of the steps' host time from the first half
four ways: a constant (the first half's median: what a step model without a speed feature
does), the canary scaled (the first half's median ratio), a line in the canary (least squares on
the first half) and the step before (a level that follows at once). For each, the relative
error's median and p99 over the second half: against the latency model's goals (3% / 10%).

    PYTHONPATH=src python bench/eager_canary.py bench/results/latency_h100/session44/eager_spread_4531051.json \\
        --out eager_canary.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from coserve.bench.provenance import provenance


def errors(predicted: np.ndarray, measured: np.ndarray) -> dict[str, float]:
    rel = np.abs(predicted / measured - 1.0)
    return {"median_rel": float(np.median(rel)), "p99_rel": float(np.quantile(rel, 0.99))}


def predictions(enqueue_ms: list[float], canary_ms: list[float]) -> dict[str, dict[str, float]]:
    """The four predictions' errors over the series' second half, fitted on its first."""
    e, c = np.asarray(enqueue_ms, dtype=float), np.asarray(canary_ms, dtype=float)
    half = len(e) // 2
    fit_e, fit_c, test_e, test_c = e[:half], c[:half], e[half:], c[half:]
    slope, intercept = np.polyfit(fit_c, fit_e, 1)
    return {
        "constant": errors(np.full(len(test_e), np.median(fit_e)), test_e),
        "canary_scaled": errors(np.median(fit_e / fit_c) * test_c, test_e),
        "canary_line": errors(intercept + slope * test_c, test_e),
        "step_before": errors(e[half - 1:-1], test_e),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result", type=Path)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    conditions = json.loads(args.result.read_text())["figures"]["conditions"]
    figures: dict[str, Any] = {
        cond: {shape: predictions(f["enqueue_ms"], f["canary_ms"])
               for shape, f in shapes.items() if len(f.get("canary_ms") or ()) >= 4}
        for cond, shapes in conditions.items()}
    out = {**provenance(), "config": {"result": str(args.result)}, "figures": figures}
    text = json.dumps(out, indent=1) + "\n"
    if args.out is not None:
        args.out.write_text(text)
    for cond, shapes in figures.items():
        for shape, ways in shapes.items():
            print(f"{cond:5} {shape:18} " + "  ".join(f"{w} {v['median_rel']:.3f}/{v['p99_rel']:.3f}"
                                                      for w, v in ways.items()))


if __name__ == "__main__":
    main()

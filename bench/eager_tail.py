"""Offline: where an eager latency run's prefill error comes from (``coserve_latency.py
--no-prefill-graphs``, first_call.sh's ``latency_eager``).

For the run's eager prefill steps (``prefill/eager/*`` rows of its step table, as the device's
model predicted them): the relative error's median and p99, how many ran over 10% off; the same
for steps whose token count the process had not run before in the table (an eager step's GEMMs
at a new token count pick their cuBLAS kernel on the host: session 17) and for the rest; by
token count (``--levels``: the same predictions scaled by a level of the steps before, by rate);
and the host's share of the step (``enqueue_s`` / measured) for all of them and for
those over 10% off. ``small_steps``: the host time of the small ones (under 512 tokens, no FT rows;
the host's constant part of an eager step, its GPU work a few ms), spread and lag-1 autocorrelation
in time order (how far a recent step tells the next), with the trainer idle and within a task, and
the thread's CPU share of it where the table has ``enqueue_cpu_s``, and the garbage collector's
ms in the slower and the faster half where it has ``gc_s`` (both from session 43's commits on). With ``--forms``: the best a linear form does on the same steps, the
current regressors alone and with the step's chunk, cached-context chunk, decode and FT-row
counts and a small-step indicator beside them, fitted on the first half (held-out: the second)
and on all of it (in-sample): whether any form of these features could reach the goal.

    PYTHONPATH=src python bench/eager_tail.py RUN.json.xz --forms --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from coserve.bench.provenance import provenance
from coserve.bench.result_file import read_result
from coserve.core.nnls import fit_relative

SIZES = ((0, 64), (64, 256), (256, 512), (512, 1024), (1024, 1 << 20))


def summary(ratio: np.ndarray) -> dict[str, Any]:
    """``ratio``: measured / predicted; the error as the runs report it, ``|predicted - measured| / measured``."""
    err = np.abs(1.0 / ratio - 1.0)
    return {"n": len(ratio), "median_rel": float(np.median(err)), "p99_rel": float(np.quantile(err, 0.99)),
            "over_10pct": int((err > 0.1).sum()), "ratio_median": float(np.median(ratio))}


def host_spread(rows: list[list[Any]], col: dict[str, int],
                timeline: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The host's seconds queuing the small eager steps of ``rows`` (step-table rows): ms quantiles,
    p90 / p10, lag-1 autocorrelation of their log in time order, the medians with the trainer
    idle (``trainer_at`` null) and within a task, and the thread's CPU share (median) where told;
    where the steps have ``began_s``: when the slowest tenth began (s into the run), and with the
    run's ``timeline`` (its ``gpu`` table, session 43's commits on), the correlation of their ms
    with the host's CPU load then (``host_cpu_busy``, interpolated)."""
    def small(r: list[Any]) -> bool:
        return r[col["regressors"]][1] < 512 and r[col["regressors"]][2] == 0 and bool(r[col["enqueue_s"]])

    picked = [r for r in rows if small(r)]  # (a table before session 28's began_s: in its own order, the steps')
    if "began_s" in col:
        picked.sort(key=lambda r: r[col["began_s"]] or 0.0)
    if len(picked) < 3:
        return None
    ms = np.asarray([r[col["enqueue_s"]] for r in picked]) * 1e3
    idle = np.asarray([r[col["trainer_at"]] is None if "trainer_at" in col else True for r in picked])
    logs = np.log(ms)
    q = {f"p{p}": float(np.percentile(ms, p)) for p in (10, 50, 90, 99)}
    out: dict[str, Any] = {
        "n": len(picked), "enqueue_ms": q, "p90_over_p10": q["p90"] / q["p10"],
        "lag1_autocorrelation": float(np.corrcoef(logs[:-1], logs[1:])[0, 1]),
        "trainer_idle": {"n": int(idle.sum()), "median_ms": float(np.median(ms[idle])) if idle.any() else None},
        "in_task": {"n": int((~idle).sum()), "median_ms": float(np.median(ms[~idle])) if (~idle).any() else None},
    }
    if "enqueue_cpu_s" in col:
        cpu = [r[col["enqueue_cpu_s"]] for r in picked]
        share = [c * 1e3 / m for c, m in zip(cpu, ms, strict=True) if c is not None]
        out["cpu_share_median"] = float(np.median(share)) if share else None
    began = [r[col["began_s"]] for r in picked] if "began_s" in col else []
    if began and all(b is not None for b in began):
        at = np.asarray(began, dtype=float)
        out["slowest_tenth_began_s"] = sorted(round(float(b), 1) for b in at[ms >= np.percentile(ms, 90)])
        gpu_cols = (timeline or {}).get("gpu_columns", [])
        if "host_cpu_busy" in gpu_cols and (timeline or {}).get("gpu"):
            table = np.asarray(timeline["gpu"], dtype=float)  # type: ignore[index]
            busy = np.interp(at, table[:, gpu_cols.index("t_s")], table[:, gpu_cols.index("host_cpu_busy")])
            out["host_cpu_busy_corr"] = float(np.corrcoef(ms, busy)[0, 1])
    if "gc_s" in col:  # (the garbage collector's ms in the step, for the slower and the faster half)
        slow = ms >= np.median(ms)
        gc_ms = [(r[col["gc_s"]] * 1e3, bool(s)) for r, s in zip(picked, slow, strict=True) if r[col["gc_s"]] is not None]
        out["gc_ms_median"] = {half: float(np.median([g for g, s in gc_ms if s == is_slow]))
                               if any(s == is_slow for _, s in gc_ms) else None
                               for half, is_slow in (("slower_half", True), ("faster_half", False))}
    return out


LEVEL_RATES = (0.05, 0.1, 0.2, 0.3)


def level_replay(predicted: np.ndarray, measured: np.ndarray, rate: float) -> dict[str, Any]:
    """The run's eager prefill predictions, in time order, each scaled by a level: an exponentially
    weighted mean (``rate``) of ``log(measured / predicted)`` over the steps before it, as the
    decode sets carry (``coserve.core.latency``); the error as the runs report it. Offline and
    approximate: the online model refitted on the same steps without the level."""
    level, err = 0.0, []
    for p, m in zip(predicted, measured, strict=True):
        err.append(abs(p * math.exp(level) - m) / m)
        level = (1.0 - rate) * level + rate * math.log(m / p)
    e = np.asarray(err)
    return {"median_rel": float(np.median(e)), "p99_rel": float(np.quantile(e, 0.99))}


def forms(x0: np.ndarray, extra: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    out = {}
    half = len(y) // 2
    for name, x in (("current", x0), ("with_counts", np.column_stack([x0, extra]))):
        held = np.asarray(fit_relative(x[:half], y[:half], 1 / y[:half], None, 0.0))
        whole = np.asarray(fit_relative(x, y, 1 / y, None, 0.0))
        e_held = np.abs(x[half:] @ held - y[half:]) / y[half:]
        e_in = np.abs(x @ whole - y) / y
        out[name] = {"held_out_p99_rel": float(np.quantile(e_held, 0.99)), "in_sample_p99_rel": float(np.quantile(e_in, 0.99))}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run")
    p.add_argument("--forms", action="store_true")
    p.add_argument("--levels", action="store_true", help="the same predictions scaled by a level of recent steps")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    figures = read_result(args.run)["figures"]
    table = figures["steps"]
    col = {c: i for i, c in enumerate(table["columns"])}
    rows = [r for r in table["rows"] if r[col["key"]].startswith("prefill/eager") and r[col["measured_s"]] > 0]
    measured = np.asarray([r[col["measured_s"]] for r in rows])
    ratio = measured / np.asarray([r[col["predicted_s"]] for r in rows])
    tokens = np.asarray([r[col["regressors"]][1] for r in rows])
    seen: set[float] = set()
    new = []
    for t in tokens:
        new.append(t not in seen)
        seen.add(t)
    first = np.asarray(new)
    enqueue = np.asarray([r[col["enqueue_s"]] or 0.0 for r in rows]) / measured
    bad = np.abs(1.0 / ratio - 1.0) > 0.1
    report: dict[str, Any] = {
        "all": summary(ratio), "new_token_count": summary(ratio[first]), "seen_token_count": summary(ratio[~first]),
        "by_tokens": {f"{lo}-{hi}": summary(ratio[(tokens > lo) & (tokens <= hi)])
                      for lo, hi in SIZES if ((tokens > lo) & (tokens <= hi)).any()},
        "enqueue_share_median": float(np.median(enqueue)),
        "enqueue_share_median_over_10pct": float(np.median(enqueue[bad])) if bad.any() else None,
        "small_steps": host_spread(rows, col, figures.get("timeline")),
    }
    if args.levels:
        order = np.argsort([r[col["began_s"]] or 0.0 for r in rows], kind="stable") if "began_s" in col \
            else np.arange(len(rows))
        predicted = np.asarray([r[col["predicted_s"]] for r in rows])
        report["levels"] = {f"{rate:g}": level_replay(predicted[order], measured[order], rate) for rate in LEVEL_RATES}
    if args.forms:
        planned = np.asarray([r[col["planned_s"]] or 0.0 for r in rows])
        chunks = [r[col["chunks"]] for r in rows]
        extra = np.column_stack([
            [len(c) for c in chunks], [sum(1 for n, ctx in c if ctx > 0) for c in chunks],
            [r[col["decodes"]] for r in rows], [r[col["rows"]][1] for r in rows], (tokens <= 512).astype(float),
        ])
        x0 = np.asarray([r[col["regressors"]] for r in rows], dtype=np.float64)
        report["forms"] = forms(x0, extra, measured - planned)
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({**provenance(), "config": {"run": args.run, "forms": args.forms,
                                                                          "levels": args.levels},
                                              "figures": report}, indent=1))


if __name__ == "__main__":
    main()

"""How close any predictor built on a step's level and the trainer's position can get: the
noise floor of recorded step tables.

For each step table (``bench/coserve_latency.py``'s ``figures.steps``, ``coserve bench``'s
``figures.<config>.steps``) and each key with at least ``--min-steps`` steps, on the held-out
share (the steps after the first ``--train``, as ``bench/latency_fit.py`` splits them), the
relative error ``|predicted - measured| / measured`` of:

- ``recorded``: what the running model predicted;
- ``oracle_neighbours_K``: the recorded prediction scaled by the median measured / predicted
  ratio of the K steps before *and* the K steps after (of the same key): a level that knows the
  future, so no level of the past (an EWMA, a window, a shared level) can do better than it on a
  step's own spread;
- ``oracle_position``: scaled by the median ratio, over the held-out steps themselves, of the
  steps whose trainer stood at the same position (:func:`position`: ``start``, ``loss``, the
  backward's first and last layers, the rest of the layers, ``commit``, between tasks) — a busy
  term per position fitted on the very steps it is scored on;
- ``oracle_both``: the position's ratio, then the neighbours' (K = 5) of what is left;
- ``within_position``: per position group, the spread of the held-out ratios around their own
  median (p50 / p99 of ``|ratio / median - 1|``): what is left when both the linear form and the
  busy term are exact for the group;
- ``host_part`` (tables with the ``gpu_s`` column, since session 27): the host's part of each
  held-out step, ``measured - gpu_s``, around its median, over the step's time (p50 / p99 of
  ``|host - median host| / measured``), and ``gpu_share`` (median ``gpu_s / measured``): where
  the spread above is small here, it is the GPU's (the trainer's interference), not the host's;
  ``host_constant_p99``, the recorded error's p99 had the host's part been its median in every
  step, and ``gpu_alone_p99``, that of the GPU's part alone against the predictions scaled by
  their median ratio to it: where these are no lower than ``recorded``, the tail is the GPU's;
- ``by_gap`` (tables with the ``gap_s`` column, since session 28): the recorded errors of the
  held-out steps that came :data:`GAP_S` or more after the step before (``after_gap``: the GPU
  left to the trainer or idle, its clocks perhaps down) and of the rest (``back_to_back``), with
  the median of ``(measured - predicted) / measured`` (positive: slower than predicted); and,
  of the steps after a gap, the prompts alone (``prompt_alone``: no decodes, no FT rows,
  ``StepFeatures.lone``) and the FT-only steps apart: how many, their measured / predicted
  median and their median ``gpu_s``.

These oracles use what no server knows before a step (the steps after it, the held-out steps'
own medians); where even they stay above a goal, the goal is below the steps' own spread and
no form of the model on these features reaches it. Usage::

    PYTHONPATH=src python bench/latency_noise_floor.py bench/results/latency_h200/session2*/*.json.gz \\
        --out bench/results/latency_h200/noise_floor.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from coserve.bench.provenance import provenance
from coserve.bench.result_file import read_result
from coserve.bench.runners import STEP_TABLE_COLUMNS, row_lone
from coserve.core.latency import LONE_GAP_S

PREDICTED, MEASURED, ROWS, TRAINER_AT, GPU, GAP = (STEP_TABLE_COLUMNS.index(c) for c in (
    "predicted_s", "measured_s", "rows", "trainer_at", "gpu_s", "gap_s"))
GAP_S = LONE_GAP_S  # a step after this long a gap (gap_s) counts as after_gap
NEIGHBOURS = (2, 5, 10)


def step_tables(result: dict[str, Any]) -> dict[str, list[list[Any]]]:
    """``table name -> rows`` of every step table in a result file."""
    figures = result.get("figures", {})
    if isinstance(figures.get("steps"), dict):  # bench/coserve_latency.py
        return {"replay": figures["steps"]["rows"]}
    return {name: f["steps"]["rows"] for name, f in figures.items()
            if isinstance(f, dict) and isinstance(f.get("steps"), dict)}


def position(at: Sequence[int] | None, num_layers: int) -> str:
    """Where the trainer's GPU stood as a step began (``trainer_at``: the boundary ``[layer,
    ordinal]`` it passed last; the backward runs from the loss at ``num_layers`` down to layer 0)."""
    if at is None:
        return "between_tasks"
    layer = at[0]
    if layer == -2:
        return "start"
    if layer == -1:
        return "commit"
    if layer >= num_layers:
        return "loss"
    if layer == num_layers - 1:
        return "first_layer"
    if layer == 0:
        return "last_layer"
    return "layers"


def errors(predicted: np.ndarray, measured: np.ndarray) -> dict[str, float]:
    rel = np.abs(predicted - measured) / measured
    return {"median_rel": float(np.median(rel)), "p99_rel": float(np.percentile(rel, 99)), "n": int(rel.size)}


def neighbour_levels(log_ratio: np.ndarray, k: int) -> np.ndarray:
    """Each step's median log ratio over the ``k`` steps before and the ``k`` after (not its own)."""
    n = log_ratio.size
    return np.array([np.median(np.r_[log_ratio[max(0, i - k):i], log_ratio[i + 1:i + 1 + k]]) if n > 1 else 0.0
                     for i in range(n)])


def floor_of(rows: list[list[Any]], train: float) -> dict[str, Any]:
    """The module docstring's errors for one key's rows, in step order."""
    rows = [r for r in rows if r[PREDICTED] and r[PREDICTED] > 0 and r[MEASURED] > 0]
    predicted = np.array([r[PREDICTED] for r in rows], dtype=np.float64)
    measured = np.array([r[MEASURED] for r in rows], dtype=np.float64)
    log_ratio = np.log(measured / predicted)
    start = int(len(rows) * train)
    held = slice(start, None)
    has_at = len(rows[0]) > TRAINER_AT
    tops = [r[TRAINER_AT][0] for r in rows if has_at and r[TRAINER_AT] is not None]
    num_layers = max(tops, default=0)  # the loss boundary is the highest layer index a run shows
    groups = [position(r[TRAINER_AT], num_layers) if has_at else "unknown" for r in rows]
    held_groups = groups[held]
    out: dict[str, Any] = {"recorded": errors(predicted[held], measured[held])}
    for k in NEIGHBOURS:
        level = neighbour_levels(log_ratio, k)
        out[f"oracle_neighbours_{k}"] = errors((predicted * np.exp(level))[held], measured[held])
    by_group: dict[str, float] = {}
    for g in set(held_groups):
        by_group[g] = statistics.median(lr for lr, h in zip(log_ratio[held], held_groups, strict=True) if h == g)
    group_level = np.array([by_group.get(g, 0.0) for g in groups])
    out["oracle_position"] = errors((predicted * np.exp(group_level))[held], measured[held])
    rest = log_ratio - group_level
    both = group_level + neighbour_levels(rest, 5)
    out["oracle_both"] = errors((predicted * np.exp(both))[held], measured[held])
    within: dict[str, Any] = {}
    for g in sorted(by_group):
        spread = np.array([abs(np.expm1(lr - by_group[g]))
                           for lr, h in zip(log_ratio[held], held_groups, strict=True) if h == g])
        within[g] = {"n": int(spread.size), "ratio_median": float(np.exp(by_group[g])),
                     "spread_median": float(np.median(spread)), "spread_p99": float(np.percentile(spread, 99))}
    out["within_position"] = within
    gpu = [r[GPU] if len(r) > GPU else None for r in rows[start:]]
    gaps = [r[GAP] if len(r) > GAP else None for r in rows[start:]]
    if any(gap is not None for gap in gaps):
        after = np.array([gap is not None and gap >= GAP_S for gap in gaps])
        signed = (measured[held] - predicted[held]) / measured[held]
        out["by_gap"] = {name: {**errors(predicted[held][m], measured[held][m]),
                                "signed_median": float(np.median(signed[m]))}
                         for name, m in (("after_gap", after), ("back_to_back", ~after)) if m.any()}
        # the steps after a gap by kind: a prompt alone (StepFeatures.lone) or an FT-only step
        kinds = {"prompt_alone": [row_lone(r, without_gap=True) for r in rows[start:]],
                 "ft_only": [r[ROWS][0] == 0 and r[ROWS][1] > 0 for r in rows[start:]]}
        for kind, flags in kinds.items():
            m = after & np.array(flags)
            if m.any() and "after_gap" in out["by_gap"]:
                g = [x for x, k in zip(gpu, m, strict=True) if k and x is not None]
                out["by_gap"]["after_gap"][kind] = {
                    "n": int(m.sum()), "ratio_median": float(np.median(measured[held][m] / predicted[held][m])),
                    "gpu_s_median": float(np.median(g)) if g else None}
    if gpu and all(g is not None and 0 < g for g in gpu):
        g = np.array(gpu, dtype=np.float64)
        y = measured[held]
        host = y - g
        spread = np.abs(host - np.median(host)) / y
        p = predicted[held]
        out["host_part"] = {"spread_median": float(np.median(spread)), "spread_p99": float(np.percentile(spread, 99)),
                            "gpu_share": float(np.median(g / y)),
                            # the recorded predictions' error had the host's part been its median every step
                            "host_constant_p99": float(np.percentile(np.abs(p - (g + np.median(host))) / y, 99)),
                            # the GPU's part alone against the predictions scaled by their median ratio to it
                            "gpu_alone_p99": float(np.percentile(np.abs(p * np.median(g / p) - g) / g, 99))}
    return out


def analyse(path: str, train: float, min_steps: int) -> dict[str, Any]:
    result = read_result(path)
    report: dict[str, Any] = {}
    for name, rows in step_tables(result).items():
        by_key: dict[str, list[list[Any]]] = {}
        for r in rows:
            by_key.setdefault(r[0], []).append(r)
        for key, key_rows in sorted(by_key.items()):
            if len(key_rows) >= min_steps:
                report[f"{name}:{key}"] = floor_of(key_rows, train)
    return report


def summary(report: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per key over all tables: the range of each form's held-out p99."""
    by_key: dict[str, dict[str, list[float]]] = {}
    for table in report.values():
        for key, forms in table.items():
            key = key.split(":", 1)[1]
            for form, e in forms.items():
                if "p99_rel" in e:
                    by_key.setdefault(key, {}).setdefault(form, []).append(e["p99_rel"])
    return {key: {form: {"tables": len(v), "p99_min": min(v), "p99_max": max(v)} for form, v in forms.items()}
            for key, forms in sorted(by_key.items())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="result JSON files (or .json.gz, .json.xz) with step tables")
    p.add_argument("--train", type=float, default=0.5, help="share of each key's steps before the held-out ones")
    p.add_argument("--min-steps", type=int, default=100, help="keys with fewer steps are left out")
    p.add_argument("--out", default=None, help="write the result JSON here")
    args = p.parse_args(argv)
    if not 0 <= args.train < 1:
        p.error("--train must be in [0, 1)")
    report = {Path(path).name: analyse(path, args.train, args.min_steps) for path in args.results}
    report = {name: table for name, table in report.items() if table}
    if not report:
        print("no step table with enough steps in these files", file=sys.stderr)
        return 1
    figures = {"tables": report, "summary": summary(report)}
    for key, forms in figures["summary"].items():
        cells = "  ".join(f"{form} {f['p99_min'] * 100:.1f}-{f['p99_max'] * 100:.1f}%" for form, f in forms.items())
        print(f"{key} (held-out p99 over {next(iter(forms.values()))['tables']} tables): {cells}")
    if args.out:
        record = {**provenance(), "config": {"results": args.results, "train": args.train,
                                             "min_steps": args.min_steps}, "figures": figures}
        Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

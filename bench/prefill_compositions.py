"""Offline: a latency run's prefill steps by composition, measured against predicted.

For ``bench/coserve_latency.py`` runs, each prefill step (``prefill/*`` keys) put in one
composition by its inference chunks (``composition``): ``no chunk`` (FT rows alone), ``fresh``
(every chunk without cached context), ``context`` (every chunk over cached context), ``short
context + fresh, paged`` (a chunk of at most ``SHORT`` tokens over cached context beside fresh
ones, the step at most ``PAGED`` tokens: every row through the paged kernel,
``triton_attention.PAGED_SMALL_PREFILL``), ``short context + fresh, flash`` (the same over
``PAGED`` tokens: the fresh rows through flash) and ``context + fresh`` (the other mixes). Per
composition: steps, the median and 5th / 95th percentile of measured / predicted and the share over
10% off; per run: the prefill steps' p99 relative error, and without each composition. The
predictions are the device's own, or with ``--replay`` this commit's model replayed over the run
(``bench/latency_whole.py``'s replay from the run's calibration, the decode KV term at the run's
form, or ``rows_longest`` at ``--decode-kv-share`` where the table records the longest row).

Session 35 found with it the paged kernel's unsplit prefix beside a fresh chunk
(``triton_attention.PREFILL_SPLIT_TILES``).

    PYTHONPATH=src python bench/prefill_compositions.py RUN.json.xz [RUN2 ...] [--replay] --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from coserve.bench.provenance import provenance
from coserve.bench.result_file import read_result
from coserve.core.latency import MIX_PAGED_TOKENS, MIX_SHORT_TOKENS

# (the latency model's short-context mix, StepFeatures.short_context_mix, is the paged one here)
SHORT = MIX_SHORT_TOKENS
PAGED = MIX_PAGED_TOKENS
COMPOSITIONS = ("no chunk", "fresh", "context", "short context + fresh, paged", "short context + fresh, flash",
                "context + fresh")


def composition(chunks: Sequence[Sequence[int]]) -> str:
    """A prefill step's composition (module docstring) from its ``[tokens, context]`` chunks."""
    if not chunks:
        return "no chunk"
    context = [n for n, c in chunks if c > 0]
    fresh = [n for n, c in chunks if c == 0]
    if not context:
        return "fresh"
    if not fresh:
        return "context"
    if min(context) <= SHORT:
        paged = sum(n for n, _ in chunks) <= PAGED
        return f"short context + fresh, {'paged' if paged else 'flash'}"
    return "context + fresh"


def p99(rel: np.ndarray) -> float | None:
    return float(np.quantile(rel, 0.99)) if len(rel) else None


def summary(chunks: Sequence[Sequence[Sequence[int]]], measured: np.ndarray, predicted: np.ndarray) -> dict[str, Any]:
    """The figures of one run's prefill steps (module docstring)."""
    kinds = np.asarray([composition(c) for c in chunks], dtype=object)
    ratio = measured / predicted
    rel = np.abs(predicted - measured) / measured
    out: dict[str, Any] = {"steps": len(measured), "p99_rel": p99(rel), "compositions": {}}
    for kind in COMPOSITIONS:
        mask = kinds == kind
        if not mask.any():
            continue
        r = ratio[mask]
        out["compositions"][kind] = {
            "steps": int(mask.sum()), "ratio_median": float(np.median(r)),
            "ratio_p5": float(np.quantile(r, 0.05)), "ratio_p95": float(np.quantile(r, 0.95)),
            "over_10pct": float(np.mean(np.abs(r - 1.0) > 0.1)), "p99_rel_without": p99(rel[~mask]),
        }
    return out


def run_figures(path: str, replay: bool, share: float) -> dict[str, Any]:
    if replay:
        sys.path.insert(0, str(Path(__file__).parent))
        import latency_warm as lw  # (the scripts beside this one)
        import latency_whole as lwh

        table = lw.Table(path)
        form = (lwh.rows_longest(share)
                if all(len(s) > lwh.KV_MAX and s[lwh.KV_MAX] is not None for s in table.steps) else None)
        predicted = lw.replay(table.model(busy_with_idle=True), table.steps, 0.005, form)
        # (key, predicted, measured, chunks) of each measured step
        steps = [(s[0], float(p), s[2], s[7]) for s, p in zip(table.steps, predicted, strict=True)]
    else:
        recorded = read_result(path)["figures"]["steps"]
        col = {c: i for i, c in enumerate(recorded["columns"])}
        steps = [(r[col["key"]], r[col["predicted_s"]], r[col["measured_s"]], r[col["chunks"]])
                 for r in recorded["rows"] if r[col["measured_s"]] > 0]
    prefill = [s for s in steps if s[0].startswith("prefill/")]
    return summary([s[3] for s in prefill], np.asarray([s[2] for s in prefill], dtype=np.float64),
                   np.asarray([s[1] for s in prefill], dtype=np.float64))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+")
    p.add_argument("--replay", action="store_true", help="this commit's model replayed over each run")
    p.add_argument("--decode-kv-share", type=float, default=0.35,
                   help="with --replay, rows_longest's share for tables that record the longest row")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    report = {Path(r).name: run_figures(r, args.replay, args.decode_kv_share) for r in args.runs}
    for name, fig in report.items():
        print(f"{name}: {fig['steps']} prefill steps, p99 {fig['p99_rel'] * 100:.1f}%")
        for kind, c in fig["compositions"].items():
            print(f"  {kind:30s} {c['steps']:5d}  ratio {c['ratio_median']:.3f} ({c['ratio_p5']:.3f}-"
                  f"{c['ratio_p95']:.3f})  over 10% {c['over_10pct'] * 100:5.1f}%  p99 without "
                  f"{c['p99_rel_without'] * 100 if c['p99_rel_without'] is not None else float('nan'):.1f}%")
    if args.out:
        record = {**provenance(), "config": {"runs": args.runs, "replay": args.replay,
                                             "decode_kv_share": args.decode_kv_share, "short": SHORT,
                                             "paged": PAGED},
                  "figures": report}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

"""Offline: recorded latency runs replayed whole by the latency model under two settings, table by
table (an A/B of a model switch without the device).

Each step table (``bench/coserve_latency.py`` result files; the eager runs are left out, their
prefill sets being host-bound) is replayed by ``bench/latency_whole.py`` once per variant, each a
set of ``COSERVE_*`` variables in its environment, and this reports, per table and segment
(``cold``, ``warm`` where the run has one), the relative error's p99 over all steps and over the
busy decode steps under each variant, and over the tables how many the second variant made lower,
higher, or left within ``--tie`` points (and the mean change), also for each ``--group`` of tables
(a path substring: e.g. the tables that suggested the change against the rest).

    PYTHONPATH=src python bench/latency_ab.py --a COSERVE_SPOT_GRAIN=phase --b COSERVE_SPOT_GRAIN=boundary \\
        --group session41 bench/results/latency_h100/session3*/*.json.xz ... --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from coserve.bench.provenance import provenance

SEGMENTS = ("cold", "warm")
FIGURES = ("all", "decode/graph/busy")
WHOLE = Path(__file__).with_name("latency_whole.py")


def parse_variant(text: str) -> dict[str, str]:
    """``VAR=VALUE[,VAR=VALUE...]`` as a mapping; every name a ``COSERVE_`` variable."""
    out: dict[str, str] = {}
    for part in filter(None, text.split(",")):
        name, eq, value = part.partition("=")
        if not eq or not name.startswith("COSERVE_"):
            raise argparse.ArgumentTypeError(f"a variant is COSERVE_VAR=VALUE[,...], got {part!r}")
        out[name] = value
    return out


def replay(table: str, env: dict[str, str]) -> dict[str, Any]:
    """``latency_whole.py``'s figures of ``table`` replayed with ``env`` set: per segment and
    figure, the replay's p99 relative error (None where the run has no such steps)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "whole.json"
        subprocess.run([sys.executable, str(WHOLE), table, "--out", str(out)], check=True,
                       env={**os.environ, **env}, stdout=subprocess.DEVNULL)
        (figures,) = json.loads(out.read_text())["figures"].values()
    return {seg: {fig: (figures[seg][fig]["replay"]["p99_rel"] if fig in figures.get(seg, {}) else None)
                  for fig in FIGURES} for seg in SEGMENTS if seg in figures}


def tally(pairs: list[tuple[float, float]], tie: float) -> dict[str, Any]:
    """How many of ``(a, b)`` p99s (in percent) ``b`` made lower, higher, or kept within ``tie``."""
    deltas = [b - a for a, b in pairs]
    return {"tables": len(pairs), "lower": sum(d < -tie for d in deltas), "higher": sum(d > tie for d in deltas),
            "tied": sum(abs(d) <= tie for d in deltas),
            "mean_change_points": sum(deltas) / len(deltas) if deltas else None,
            "largest_rise_points": max(deltas) if deltas else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tables", nargs="+")
    p.add_argument("--a", type=parse_variant, required=True, help="the first variant's COSERVE_VAR=VALUE[,...]")
    p.add_argument("--b", type=parse_variant, required=True, help="the second variant's")
    p.add_argument("--group", action="append", default=[], help="a path substring: a tally of those tables too")
    p.add_argument("--tie", type=float, default=0.01, help="points of p99 within which a change counts as none")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    tables = [t for t in args.tables if "eager" not in Path(t).name]
    runs: dict[str, Any] = {}
    for i, table in enumerate(tables, 1):
        run = runs[table] = {"a": replay(table, args.a), "b": replay(table, args.b)}
        print(f"[{i}/{len(tables)}] {table}: cold p99 {run['a']['cold']['all'] * 100:.2f}% -> "
              f"{run['b']['cold']['all'] * 100:.2f}%", file=sys.stderr)

    def pairs(seg: str, fig: str, keep: Any = lambda table: True) -> list[tuple[float, float]]:
        return [(r["a"][seg][fig] * 100, r["b"][seg][fig] * 100) for t, r in runs.items()
                if keep(t) and seg in r["a"] and r["a"][seg][fig] is not None and r["b"][seg][fig] is not None]

    groups: dict[str, Any] = {g: (lambda table, g=g: g in table) for g in args.group}
    if args.group:
        groups["rest"] = lambda table: not any(g in table for g in args.group)
    summary = {f"{seg}/{fig}": {"all": tally(pairs(seg, fig), args.tie),
                                **{name: tally(pairs(seg, fig, keep), args.tie) for name, keep in groups.items()}}
               for seg in SEGMENTS for fig in FIGURES}
    report = {"summary": summary, "tables": runs}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({**provenance(), "config": {"a": args.a, "b": args.b, "tables": tables,
                                                                         "groups": args.group, "tie_points": args.tie},
                                              "figures": report}, indent=1))


if __name__ == "__main__":
    main()

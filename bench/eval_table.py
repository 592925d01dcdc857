"""Issue 6's table and goals from the `coserve bench` results of an evaluation folder.

For each workload folder (``WORKLOAD/WORKLOAD.json``, as `bench/eval_device.sh` leaves them):
absolute attainment and FT tokens/s of every configuration side by side, the relative
attainment, and the goals — ``full`` within 0.1 percentage points of the reference's
attainment, ``full`` ≥ 1.4× split and ≥ 2× naive in FT tokens/s, ≥ 5,000 FT tokens/s on
azure2023_code — each with its measured value.

    python bench/eval_table.py bench/results/eval_h200 [MORE_FOLDERS ...] [--config full-overlap]

With several folders, a workload is taken from the first folder that has it (a newer evaluation
first, an older one filling the workloads it did not rerun). A later folder's run of the same
workload at the same commit, arrivals, SLOs, model and FT setup (one evaluation split over
several device calls) adds the configurations the first lacks; its reference stays the first's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from coserve.bench.result_file import read_result

WORKLOADS = ("azure2023_code", "azure2023_conv", "burst-light", "burst-dense")
ORDER = ("inference", "inference-graphs", "full", "full-graphs", "full-eager", "full-overlap", "full-noint",
         "temporal", "naive", "split", "inference-last")


RESULT_SUFFIXES = (".json", ".json.gz", ".json.xz")
"""A workload's result as the device left it, or as committed: gzipped, or xz'd when large."""

SAME_RUN = ("workload", "slo", "model", "ft")
"""The config sections two results must share for their configurations to sit in one table."""


def _same_run(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.get("commit") == b.get("commit") and all(a["config"].get(k) == b["config"].get(k) for k in SAME_RUN)


def load(*folders: Path) -> dict[str, dict[str, Any]]:
    """``{workload: result}`` for the workload folders present (known ones first); a workload
    found in several folders is taken from the first, with the configurations that a later
    folder's run of the same commit and setup (:data:`SAME_RUN`) adds."""
    found: dict[str, list[Path]] = {}
    for folder in folders:
        for p in sorted(q for ext in RESULT_SUFFIXES for q in folder.glob(f"*/*{ext}")):
            if p.name in [f"{p.parent.name}{ext}" for ext in RESULT_SUFFIXES]:
                found.setdefault(p.parent.name, []).append(p)
    names = [w for w in WORKLOADS if w in found] + sorted(set(found) - set(WORKLOADS))
    out = {}
    for w in names:
        first, *later = (read_result(p) for p in found[w])
        for other in later:
            if _same_run(first, other):
                for name, fig in other["figures"].items():
                    first["figures"].setdefault(name, fig)
        out[w] = first
    return out


def _rate(result: dict[str, Any]) -> str:
    return f"×{result['config']['workload']['scaling']['rate']:.3g}"


def table(results: dict[str, dict[str, Any]]) -> str:
    configs = [c for c in ORDER if any(c in r["figures"] for r in results.values())]
    configs += sorted({c for r in results.values() for c in r["figures"]} - set(configs))
    head = "| configuration | " + " | ".join(f"{w} {_rate(r)}" for w, r in results.items()) + " |"
    lines = [head, "| --- |" + " --- |" * len(results)]
    for c in configs:
        cells = []
        for r in results.values():
            f = r["figures"].get(c)
            if f is None:
                cells.append("not run")
                continue
            cell = f"{f['attainment_abs'] * 100:.1f}%"
            if f.get("kind", "inference") != "inference" or f.get("ft_tokens_per_s"):
                cell += f" · {f.get('ft_tokens_per_s') or 0:,.0f}"  # a fine-tuning run that trained nothing: 0
            cells.append(cell)
        lines.append(f"| `{c}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _baseline(figures: dict[str, Any], base: str, attainment: float) -> tuple[str, bool] | None:
    """The run of baseline ``base`` a goal compares with: of ``base`` and its ``base-N`` runs (the
    baseline at its own setting) with FT throughput, the fastest whose attainment is no worse
    than ``attainment`` − 0.1 pp (the goals compare at equal or better attainment), with False;
    where none is, ``base`` itself (or the fastest variant) with True: a baseline that trains
    more by missing the SLO is named, not counted as a win for either side. None: none ran."""
    runs = [n for n, f in figures.items() if (n == base or n.startswith(f"{base}-")) and f.get("ft_tokens_per_s")]
    if not runs:
        return None
    fair = [n for n in runs if (figures[n]["attainment_abs"] - attainment) * 100 >= -0.1]
    if fair:
        return max(fair, key=lambda n: figures[n]["ft_tokens_per_s"]), False
    return (base if base in runs else max(runs, key=lambda n: figures[n]["ft_tokens_per_s"])), True


def goals(results: dict[str, dict[str, Any]], config: str = "full") -> dict[str, dict[str, Any]]:
    """Per workload: each goal's measured value and whether it is met (None: not measurable)."""
    out: dict[str, dict[str, Any]] = {}
    for w, r in results.items():
        f = r["figures"]
        mine, ref = f.get(config), f.get("inference")
        row: dict[str, Any] = {}
        if mine is not None and ref is not None:
            gap = (mine["attainment_abs"] - ref["attainment_abs"]) * 100
            row["attainment_minus_reference_pp"] = {"value": gap, "met": gap >= -0.1}
        for base, factor in (("split", 1.4), ("naive", 2.0)):
            chosen = None if mine is None else _baseline(f, base, mine["attainment_abs"])
            if chosen is not None:
                name, worse = chosen
                ratio = mine["ft_tokens_per_s"] / f[name]["ft_tokens_per_s"]
                row[f"ft_over_{base}"] = {"value": ratio, "met": ratio >= factor,
                                          "baseline": name, "baseline_attainment_worse": worse}
        if w == "azure2023_code" and mine is not None:
            row["ft_tokens_per_s"] = {"value": mine["ft_tokens_per_s"], "met": mine["ft_tokens_per_s"] >= 5000}
        out[w] = row
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", type=Path, nargs="+")
    p.add_argument("--config", default="full", help="the co-serving configuration the goals are about")
    args = p.parse_args()
    results = load(*args.folders)
    if not results:
        raise SystemExit(f"no WORKLOAD/WORKLOAD.json result under {' '.join(map(str, args.folders))}")
    print(table(results))
    print()
    print(json.dumps(goals(results, args.config), indent=1))


if __name__ == "__main__":
    main()

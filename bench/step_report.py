"""Where each configuration's step time went, from the ``engine_steps`` of `coserve bench` results.

Per configuration, in run order:

- eager inference steps: count, median and p90 seconds; the medians of the time split
  (``schedule_s``, ``forward_enqueue_s``, ``forward_cpu_s``, ``forward_gpu_s``) where the result
  has it; and the median µs per token of steps whose token count (prefill + decode) the
  benchmark had not run before against those it had (the warm-up's 1, 16, 17, 1,024 and 2,048 tokens count as run);
- CUDA-graph inference steps, mixed steps and FT-only steps: count and median seconds (FT-only:
  also median FT tokens);
- the backward tasks' breakdown, the CUDA allocator counters, the SM clock and the host's CPU load
  (mean / max share busy, with the replay's wall-clock start to line up runs), as recorded.

    python bench/step_report.py bench/results/eval_h200/azure2023_code/azure2023_code.json.xz [--out report.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from coserve.bench.result_file import read_result

WARMUP_TOKENS = (1, 16, 17, 1024, 2048)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _p90(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def report(result: dict[str, Any]) -> dict[str, Any]:
    """The per-configuration summary (see the module docstring)."""
    seen = set(WARMUP_TOKENS)
    out: dict[str, Any] = {}
    for name, fig in result.get("figures", {}).items():
        table = fig.get("engine_steps")
        if not table:
            continue
        cols = {c: i for i, c in enumerate(table["columns"])}

        def col(row: list[Any], key: str, cols: dict[str, int] = cols) -> Any:
            return row[cols[key]] if key in cols and cols[key] < len(row) else None

        rows = table["rows"]
        eager = [r for r in rows if col(r, "kind") == "inference" and col(r, "mode") == "eager"]
        new, old = [], []
        for r in eager:
            tokens = col(r, "prefill_tokens") + col(r, "decode_tokens")
            if tokens > 0:
                (old if tokens in seen else new).append(col(r, "seconds") / tokens * 1e6)
                seen.add(tokens)
        summary: dict[str, Any] = {
            "eager_inference": {
                "steps": len(eager),
                "median_s": _median([col(r, "seconds") for r in eager]),
                "p90_s": _p90([col(r, "seconds") for r in eager]),
                **{f"median_{k}": _median([col(r, k) for r in eager if col(r, k) is not None])
                   for k in ("schedule_s", "forward_enqueue_s", "forward_cpu_s", "forward_gpu_s")},
                "new_token_counts": {"steps": len(new), "median_us_per_token": _median(new)},
                "seen_token_counts": {"steps": len(old), "median_us_per_token": _median(old)},
            },
        }
        for label, pick in (("graph_inference", lambda r: col(r, "kind") == "inference" and col(r, "mode") == "graph"),
                            ("mixed", lambda r: col(r, "kind") == "mixed"),
                            ("ft_only", lambda r: col(r, "kind") == "ft-only")):
            chosen = [r for r in rows if pick(r)]
            entry: dict[str, Any] = {"steps": len(chosen), "median_s": _median([col(r, "seconds") for r in chosen])}
            if label == "ft_only" and "ft_tokens" in cols:
                entry["median_ft_tokens"] = _median([col(r, "ft_tokens") for r in chosen])
            summary[label] = entry
        for key in ("backward_tasks", "admission", "cuda_allocator", "gpu_clock_mhz", "attainment_abs",
                    "ft_tokens_per_s"):
            summary[key] = fig.get(key)
        timeline = fig.get("timeline") or {}
        busy = timeline.get("host_cpu_busy") or []
        summary["host_cpu_busy"] = ({"mean": sum(busy) / len(busy), "max": max(busy), "samples": len(busy)}
                                    if busy else None)
        summary["started_unix_s"] = timeline.get("started_unix_s")
        out[name] = summary
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="`coserve bench` result JSON files")
    p.add_argument("--out", default=None, help="also write the report here (JSON)")
    args = p.parse_args()
    full = {path: report(read_result(path)) for path in args.results}
    text = json.dumps(full, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()

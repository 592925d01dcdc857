"""PNG plots of a benchmark result (needs matplotlib: ``pip install 'coserve[bench]'``).

Drawn from the JSON result alone, so they can be redrawn later:
``python -m coserve.bench.plots RESULT.json [OUT_DIR]``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

MISSING = "matplotlib is not installed: plots skipped (pip install 'coserve[bench]' to draw them)"


class Plots(NamedTuple):
    paths: list[Path]
    skipped: str | None  # why nothing was drawn, or None


def write_plots(result: Mapping[str, Any], out_dir: Path, stem: str) -> Plots:
    """``STEM-latency.png`` (per-request TTFT and TPOT over arrival time, one row per
    configuration, SLO lines), ``STEM-throughput.png`` (inference and FT tokens/s stacked over
    time, one row per configuration) and ``STEM-attainment.png`` (rolling SLO attainment,
    absolute and relative, every configuration against the target line)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return Plots([], MISSING)
    figures = result["figures"]
    if not figures:
        return Plots([], "no configuration has run")
    paths = []
    for name, draw in (
        ("latency", _latency),
        ("throughput", _throughput),
        ("attainment", _attainment),
    ):
        fig = draw(plt, result)
        path = out_dir / f"{stem}-{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return Plots(paths, None)


def _title(result: Mapping[str, Any]) -> str:
    wl = result["config"]["workload"]
    return f"{wl['name']}: {wl['duration_s']:g} s window, rate ×{wl['scaling']['rate']:g}"


def _latency(plt: Any, result: Mapping[str, Any]) -> Any:
    figures = result["figures"]
    slo = result["config"]["slo"]
    ref = result.get("reference") or {}
    fig, axes = plt.subplots(
        len(figures), 2, figsize=(12, 2.2 * len(figures) + 0.8), squeeze=False, sharex=True
    )
    for row, (name, f) in zip(axes, figures.items(), strict=True):
        req = f["per_request"]
        for ax, metric, limit, rel in (
            (row[0], "ttft_ms", slo["ttft_ms"], ref.get("relative_ttft_slo_ms")),
            (row[1], "tpot_ms", slo["tpot_ms"], ref.get("relative_tpot_slo_ms")),
        ):
            pts = [
                (t, v)
                for t, v in zip(req["arrival_s"], req[metric], strict=True)
                if v is not None and v > 0
            ]
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=4, alpha=0.6)
                ax.set_yscale("log")
            ax.axhline(limit, color="red", linestyle="--", linewidth=1, label="SLO")
            if rel is not None:
                ax.axhline(rel, color="purple", linestyle=":", linewidth=1, label="relative SLO")
            ax.set_ylabel(f"{name}\n{metric.replace('_ms', '')} (ms)")
    axes[0][0].legend(loc="upper right", fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("arrival time (s)")
    fig.suptitle(f"Per-request latency — {_title(result)}")
    fig.tight_layout()
    return fig


def _throughput(plt: Any, result: Mapping[str, Any]) -> Any:
    figures = result["figures"]
    fig, axes = plt.subplots(
        len(figures),
        1,
        figsize=(10, 1.9 * len(figures) + 0.8),
        squeeze=False,
        sharex=True,
        sharey=True,
    )
    for (ax,), (name, f) in zip(axes, figures.items(), strict=True):
        tl = f["timeline"]
        if tl["t_s"]:
            ax.stackplot(
                tl["t_s"],
                tl["inference_tokens_per_s"],
                tl["ft_tokens_per_s"],
                labels=["inference output", "fine-tuning"],
                step="pre",
                alpha=0.8,
            )
        ax.set_ylabel(f"{name}\ntokens/s")
    axes[0][0].legend(loc="upper right", fontsize=7)
    axes[-1][0].set_xlabel("time (s)")
    fig.suptitle(f"Token throughput — {_title(result)}")
    fig.tight_layout()
    return fig


def _attainment(plt: Any, result: Mapping[str, Any]) -> Any:
    figures = result["figures"]
    target = result["config"]["slo"]["attainment_target"]
    window = result["config"]["rolling_window_s"]
    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for ax, kind in zip(axes, ("abs", "rel"), strict=True):
        for name, f in figures.items():
            tl = f["timeline"]
            values = tl[f"attainment_{kind}"]
            if values is None:
                continue
            pts = [(t, v * 100) for t, v in zip(tl["t_s"], values, strict=True) if v is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, linewidth=1.2)
        ax.axhline(
            target * 100,
            color="red",
            linestyle="--",
            linewidth=1,
            label=f"target {target * 100:g}%",
        )
        ax.set_ylabel(f"SLO attained, {'absolute' if kind == 'abs' else 'relative'} (%)")
        ax.set_ylim(bottom=max(0.0, ax.get_ylim()[0]), top=101)
    axes[0].legend(loc="lower left", fontsize=7, ncol=4)
    axes[-1].set_xlabel(f"time (s); requests that arrived in the {window:g} s before")
    fig.suptitle(f"Rolling SLO attainment — {_title(result)}")
    fig.tight_layout()
    return fig


def main(argv: list[str]) -> int:
    if not argv or len(argv) > 2:
        print("usage: python -m coserve.bench.plots RESULT.json [OUT_DIR]", file=sys.stderr)
        return 2
    path = Path(argv[0])
    result = json.loads(path.read_text())
    drawn = write_plots(result, Path(argv[1]) if len(argv) > 1 else path.parent, path.stem)
    if drawn.skipped:
        print(drawn.skipped, file=sys.stderr)
        return 1
    print("\n".join(str(p) for p in drawn.paths))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

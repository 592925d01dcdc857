"""A benchmark's files: the JSON result, the markdown table for the README, the plots."""

from __future__ import annotations

import json
import math
import os
import re
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from coserve.bench.plots import write_plots


def clean(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (strict JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    return value


def dumps(value: Any) -> str:
    """JSON with the structure indented and every list that holds no object on one line: a
    result's per-request, per-step and timeline arrays stay compact (a file about half the size
    of a fully indented one) while its sections and figures stay readable."""
    arrays: list[str] = []
    tag = uuid.uuid4().hex  # placeholders no result string can match

    def walk(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            if not any(isinstance(x, dict) for x in v):
                arrays.append(json.dumps(v, separators=(",", ":")))
                return f"{tag}:{len(arrays) - 1}"
            return [walk(x) for x in v]
        return v

    text = json.dumps(walk(value), indent=1)
    return re.sub(f'"{tag}:(\\d+)"', lambda m: arrays[int(m.group(1))], text)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.1f}%"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def _times(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}×"


def _model_error(f: Mapping[str, Any]) -> str:
    """The latency model's relative error over all of a configuration's steps, median / p99."""
    every = (f.get("latency_model_error") or {}).get("all")
    return "–" if not every else f"{every['median_rel'] * 100:.1f}% / {every['p99_rel'] * 100:.0f}%"


def _baseline_column(comp: Mapping[str, Any], base: str) -> tuple[str, Mapping[str, Any]]:
    """The run a table's "FT vs ``base``" column compares with: ``base`` itself, else its first
    run at its own setting (``split-30``, ``naive-512``), named in the column's header."""
    key = f"ft_over_{base}"
    if key not in comp:
        key = next((k for k in comp if k.startswith(f"{key}-")), key)
    return key.removeprefix("ft_over_"), comp.get(key, {})


def markdown_table(result: Mapping[str, Any]) -> str:
    """Rows = configurations (in run order); columns = SLO attainment (absolute, relative),
    TTFT / TPOT p99, FT tokens/s, FT throughput over the split and naive baselines and the latency
    model's error (median / p99 over all steps, each predicted before it ran); a caption states
    the workload, window, scaling, SLOs, model, device and commit."""
    cfg = result["config"]
    wl, slo = cfg["workload"], cfg["slo"]
    ref = result.get("reference") or {}
    scaling = wl["scaling"]
    rel = (
        f"relative: {slo['relative_factor']:g}× the inference-only mean TTFT / TPOT "
        f"({_ms(ref.get('relative_ttft_slo_ms'))} ms / {_ms(ref.get('relative_tpot_slo_ms'))} ms)"
    )
    comp = result.get("comparisons", {})
    split_label, over_split = _baseline_column(comp, "split")
    naive_label, over_naive = _baseline_column(comp, "naive")
    lines = [
        f"**{wl['name']}**, {wl['duration_s']:g} s window from {wl['window_start_s']:.1f} s "
        f"({wl['requests']} requests; rate ×{scaling['rate']:g}, length ×{scaling['length']:g}, "
        f"prompt ≤ {scaling['max_prompt']}, output ≤ {scaling['max_output']}); SLO: TTFT ≤ "
        f"{slo['ttft_ms']:g} ms, TPOT ≤ {slo['tpot_ms']:g} ms; {rel}. Model {cfg['model']['name']} "
        f"({cfg['model']['dtype']}), FT {cfg['ft']['lengths']}, "
        f"LoRA rank {cfg['ft']['lora_rank']}; "
        f"{result['device']['name']}, commit {str(result['commit'])[:10]}"
        f"{' (dirty)' if result['dirty'] is True else ''}.",
        "",
        "| configuration | SLO attainment (abs) | SLO attainment (rel) | TTFT p99 (ms) "
        f"| TPOT p99 (ms) | FT tokens/s | FT vs {split_label} | FT vs {naive_label} | latency model error |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, f in result["figures"].items():
        lat = f["latency"]
        cells = [
            name,
            _pct(f["attainment_abs"]),
            _pct(f["attainment_rel"]),
            _ms(lat.get("ttft_p99_ms")),
            _ms(lat.get("tpot_p99_ms")),
            f"{f['ft_tokens_per_s']:.0f}",
            _times(over_split.get(name)),
            _times(over_naive.get(name)),
            _model_error(f),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    missing = {**result.get("failed", {}), **result.get("skipped", {})}
    if missing:
        lines += [
            "",
            "Not in the table: " + "; ".join(f"{k} ({v})" for k, v in missing.items()) + ".",
        ]
    return "\n".join(lines) + "\n"


def prepare_out_dir(out_dir: Path, flag: str = "--out") -> None:
    """Create ``out_dir`` (and its parents) now and check that files can be written there: before
    a run of minutes whose results go there, not at its end. ValueError saying what is wrong."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ValueError(f"{flag} {out_dir}: a file, not a directory; give a directory for the results "
                         "(it is created if missing)") from None
    except OSError as e:
        raise ValueError(f"{flag} {out_dir}: cannot create the directory: {e.strerror or e}") from None
    probe = out_dir / f".coserve-write-check-{uuid.uuid4().hex[:8]}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{flag} {out_dir}: cannot write there: {e.strerror or e}") from None


def check_out_file(path: Path, flag: str = "--out") -> None:
    """Check, before a run, that its result file ``path`` can be written at its end: not a
    directory, and its nearest existing ancestor a writable directory (the missing ones are
    created when the file is written). ValueError saying what is wrong; nothing is created."""
    if path.is_dir():
        raise ValueError(f"{flag} {path}: a directory; give the result file's name, e.g. {path / 'result.json'}")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path}: the file is not writable")
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"{flag} {path}: {ancestor} is a file, not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: cannot create or write files in {ancestor} (permission denied)")


class Outputs(NamedTuple):
    json: Path
    markdown: Path
    plots: list[Path]
    plots_skipped: str | None


def write_outputs(
    result: dict[str, Any], out_dir: Path, stem: str, *, skip_plots: str | None = None
) -> Outputs:
    """Write ``STEM.json`` and ``STEM.md`` into ``out_dir``, and ``STEM-*.png`` unless
    ``skip_plots`` says why not.

    The result's ``outputs`` entry records the file names and why plots were skipped, if they were.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    written: list[Path] = []
    skipped = skip_plots
    if skip_plots is None:
        drawn = write_plots(clean(result), out_dir, stem)
        written, skipped = drawn.paths, drawn.skipped
    result["outputs"] = {
        "json": json_path.name,
        "markdown": md_path.name,
        "plots": [p.name for p in written],
        "plots_skipped": skipped,
    }
    cleaned = clean(result)
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(dumps(cleaned))
    tmp.replace(json_path)
    md_path.write_text(markdown_table(cleaned))
    return Outputs(json_path, md_path, written, skipped)

"""From one configuration's replay to its figures, and the comparisons between configurations."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from coserve.bench.configs import CONFIGS, REFERENCE, RunKind
from coserve.bench.metrics import (
    SLO,
    attainment,
    latency_summary,
    rolling_attainment,
    timeline_rates,
)
from coserve.bench.replay import STEP_COLUMNS
from coserve.bench.runners import RunOutcome
from coserve.core.latency import error_summary

# Configurations every other one's FT throughput is compared with, in the table and the JSON.
BASELINES = ("split", "naive", "temporal")


def latency_model_error(errors: Sequence[tuple[str, float, float]]) -> dict[str, Any] | None:
    """Relative error ``|predicted − measured| / measured`` per step kind (``form/mode/busy``)
    and over all steps: median, p99 and count; None with no step."""
    groups: dict[str, list[float]] = {}
    for key, predicted, measured in errors:
        if measured <= 0:
            continue
        rel = abs(predicted - measured) / measured
        groups.setdefault(key, []).append(rel)
        groups.setdefault("all", []).append(rel)
    if not groups:
        return None
    out = {}
    for key, errs in sorted(groups.items()):
        stats = error_summary(errs)
        out[key] = {"median_rel": stats.median_rel, "p99_rel": stats.p99_rel, "n": stats.n}
    return out


def summarize(
    outcome: RunOutcome, *, slo: SLO, relative: SLO | None, window_s: float
) -> dict[str, Any]:
    """The figures of one configuration (see the result schema in ``coserve.bench.harness``)."""
    replay = outcome.replay
    records = replay.records
    rates = timeline_rates(replay.timeline)
    util = [u for _, u in outcome.gpu_utilization]
    cfg = outcome.config
    duration = max(replay.duration_s, 1e-9)
    return {
        "kind": str(cfg.kind),
        "policy": cfg.policy,
        "interrupt_ft_only": cfg.interrupt_ft_only,
        "pause_prefill": cfg.pause_prefill,
        "hold_pause": cfg.hold_pause,
        "summary": cfg.summary,
        "requests": len(records),
        "finished": sum(r.finish_s is not None for r in records),
        "duration_s": replay.duration_s,
        "attainment_abs": attainment(records, slo.ttft_s, slo.tpot_s),
        "attainment_rel": attainment(records, relative.ttft_s, relative.tpot_s)
        if relative
        else None,
        "inference_tokens": replay.inference_tokens,
        "inference_tokens_per_s": replay.inference_tokens / duration,
        "ft_tokens": replay.ft_tokens,
        # over the window (the drain after it, lighter and of a length that differs by
        # configuration, not counted); before session 13, over the whole run: ``_run``
        "ft_tokens_per_s": (replay.ft_tokens_window / replay.window_s if replay.window_s > 0
                            else replay.ft_tokens / duration),
        "ft_tokens_per_s_run": replay.ft_tokens / duration,
        "optimizer_steps": outcome.optimizer_steps,
        "loss_first": outcome.loss_first,
        "loss_last": outcome.loss_last,
        "latency": latency_summary(records),
        "latency_model_error": latency_model_error(outcome.prediction_errors),
        "gpu_utilization": {"mean_percent": sum(util) / len(util), "samples": len(util)}
        if util
        else None,
        "gpu_clock_mhz": {
            "mean": sum(outcome.gpu_clock_mhz) / len(outcome.gpu_clock_mhz),
            "min": min(outcome.gpu_clock_mhz),
        }
        if outcome.gpu_clock_mhz
        else None,
        "cuda_allocator": outcome.cuda_allocator,
        "profile": outcome.profile,
        "step_seconds": dict(replay.step_seconds),
        "step_counts": dict(replay.step_counts),
        "engine_steps": {"columns": list(STEP_COLUMNS),
                         "rows": [[_sig6(v) for v in r] for r in replay.steps]},
        **outcome.extra,
        "timeline": {
            "t_s": rates.t,
            "inference_tokens_per_s": rates.inference_tokens_per_s,
            "ft_tokens_per_s": rates.ft_tokens_per_s,
            "attainment_abs": rolling_attainment(records, slo, rates.t, window_s),
            "attainment_rel": rolling_attainment(records, relative, rates.t, window_s)
            if relative
            else None,
            "gpu_utilization": [list(s) for s in outcome.gpu_utilization],
            # the SM clock read with each utilization sample (same order; empty where the device
            # does not report it): a step's time scales with it, which the latency model cannot see
            "gpu_clock_mhz": list(outcome.gpu_clock_mhz),
            # the share of the host's CPUs busy over each sample's second (same order; empty
            # where /proc/stat cannot be read): another process's load on the host shows here
            "host_cpu_busy": [round(b, 4) for b in outcome.host_cpu_busy],
            "started_unix_s": outcome.started_unix_s,
        },
        "per_request": {
            "arrival_s": [r.arrival_s for r in records],
            "ttft_ms": [None if r.ttft is None else r.ttft * 1e3 for r in records],
            "tpot_ms": [None if r.tpot is None else r.tpot * 1e3 for r in records],
            "output_tokens": [r.output_tokens for r in records],
        },
    }


def _sig6(v: Any) -> Any:
    """Floats to 6 significant digits (steps are timed to the microsecond at best); the rest as is."""
    return float(f"{v:.6g}") if isinstance(v, float) else v


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b > 0:
        return None
    return a / b


def comparisons(figures: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``ft_over_<baseline>``: each fine-tuning configuration's FT tokens/s over the baseline's
    (for the baselines of :data:`BASELINES` that ran); ``attainment_minus_reference_pp``: each
    configuration's attainment (abs and rel) minus the inference-only run's, in percentage
    points."""
    out: dict[str, Any] = {}
    bases = [*(b for b in BASELINES if b in figures),
             *(n for n in figures if n.startswith(("split-", "naive-")))]  # baselines at their own setting
    for base in bases:
        out[f"ft_over_{base}"] = {
            name: _ratio(f["ft_tokens_per_s"], figures[base]["ft_tokens_per_s"])
            for name, f in figures.items()
            if name != base and not _inference_only(name)
        }
    ref = figures.get(REFERENCE)
    if ref is not None:
        out["attainment_minus_reference_pp"] = {
            name: {
                kind: _pp(f[f"attainment_{kind}"], ref[f"attainment_{kind}"])
                for kind in ("abs", "rel")
            }
            for name, f in figures.items()
            if name != REFERENCE
        }
    return out


def _inference_only(name: str) -> bool:
    config = CONFIGS.get(name)
    return name == REFERENCE or (config is not None and config.kind is RunKind.INFERENCE)


def _pp(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or math.isnan(a) or math.isnan(b):
        return None
    return (a - b) * 100.0

"""Offline look at the latency model: how other model forms would have predicted recorded steps.

Reads the step tables that `coserve bench` (``figures.<config>.steps``) and
``bench/coserve_latency.py`` (``figures.steps``) write: per step its key (``form/mode/busy``),
the regressors of ``coserve.core.latency.TERMS[form]``, the online model's prediction and the
measured time. A prefill row recorded before the ``i_ctx`` term (the six regressors of
``LEGACY_PREFILL_TERMS``) gets it from its ``h_ctx`` (:func:`current_regressors`), so that every
form below is this commit's. Per key, in step order, fits on the first ``--train`` share and
reports the relative error on the rest for:

- ``online``: what the running model predicted (refitted online as it went), and
  ``online_ratio``: the held-out steps' measured / predicted (p1, p50, p99);
- ``linear``: the online model's linear form (``TERMS``) refitted by NNLS on relative error
  (prefill sets: with ``context_constant_s``, its fitted ``i_ctx``);
- ``floor``: ``max(floor, linear)`` — a CPU-bound floor (the ``--floor-quantile`` of the
  training steps' times) under a linear GPU term fitted on the training steps above 1.5 × floor:
  the form to expect when eager steps are bound by kernel launches until their work is large;
- ``rows`` (tables that record each step's prefill chunks and FT rows): the linear form plus one
  term per chunk and one per FT row — per-row launches and copies that the token sums miss;
- ``by_trainer_at`` (busy sets, tables with a ``trainer_at`` column): the online model's error
  and the measured / predicted ratio grouped by what the trainer's GPU was running when the step
  began (``loss``, ``commit``, ``layer#k`` — the k-th stretch of a layer — or ``between_tasks``):
  whether a busy step's slowdown follows the trainer's kernels;
- ``by_trainer_in_task`` (idle sets whose steps record where the trainer was): the same by
  whether the trainer was inside a task when the step began (``in_task``: its queued kernels up to
  its pause ran beside the step's start) or between tasks; over all the set's steps;
- ``bucket`` (decode steps in graph mode): the linear form with the decode rows replaced by the
  CUDA-graph bucket that ran them (``--graph-sizes``, the engine's default buckets): a replay
  computes the padded batch, not the rows it carries;
- ``by_context_timing`` (prefill sets): the online model's signed error and the measured median
  by whether a chunk had cached context and whether the step was timed by the GPU's events (the
  step table's ``event_timed``, since session 15) or on the host;
- ``by_size`` (prefill sets): the online model's error over all the set's steps, by the step's
  tokens (:data:`SIZE_BINS`) and whether it carried FT rows: where in the set the error is;
- ``no_context_constant`` (prefill sets with steps with and without a context chunk): the
  linear form without ``i_ctx``, the constant of a step whose prefill has a chunk with cached
  context (the online form until that term; sessions 13 and 14: ~4.2 ms through the prefill
  graphs, held-out p99 27.0% -> 18.4% and 31.0% -> 20.4% with it).

``replay`` (per table, beside the per-key forms): the steps fed in their order, each predicted
before it is observed, to a ``coserve.core.latency.LatencyModel`` started from the calibration
that the recorded predictions imply (:func:`recover`: each set's first 10 predictions came from it
before any refit, scaled by the decode sets' level, whose value before each step the level's rule
gives from the set's earlier predictions and times; a least-squares solve then recovers it, under
the recorded level that reproduces them best), with the engine's buckets (``--graph-sizes``,
``--prefill-buckets`` where the run used prefill graphs) and refits put off to the cap as
``CoServer`` puts them off (``--immediate-refits``: as soon as due). Per recorded key, on the
same held-out share as above: ``recorded`` (the server's predictions), and the model replayed as
:data:`REPLAY_FORMS` configure it — ``before`` (one busy set, no level, no ``i_ctx``),
``phases`` (busy sets per trainer phase), ``level`` (each set's level), ``context`` (the prefill
sets' ``i_ctx``), ``per_phase`` (all three: the model that recorded the tables of sessions
20–23), ``after`` (the model the server now runs: ``per_phase`` with the busy phases sharing
one level after a key's first 500 busy steps, ``coserve.core.latency.SHARE_AFTER_STEPS``, and,
since session 29, the lone prompts' level: ``coserve.bench.runners.row_lone`` reads each step's
``StepFeatures.lone`` from its row, in tables with ``gap_s``);
``matches_recorded`` per form: how closely it reproduces the recorded predictions (median and
p99 of ``|replayed − recorded| / recorded`` over the key's steps). On the eleven tables below,
``per_phase`` (``after`` until session 24) does to a median of 0.6–1.5e-6 (the table's six digits) and a p99 of at most 3.4e-3 on the busy
decode set (before :func:`recover` divided the level out: 0.6–3.5×). The trainer's phase comes
from each step's ``trainer_at`` through ``coserve.core.latency.trainer_phase``. A form without
``i_ctx`` is fed that regressor as 0: its coefficient stays at the calibration's, and a table
recorded before the term was calibrated without it (0), so the prefill sets predict as the
recorded model did.

``decode_forms`` (per table, decode sets): the decode sets replayed as ``replay``'s ``after`` (and
``per_phase``) and with their level or window changed (``latency_decode.DECODE_FORMS``, each from what is known
before the step), each form's held-out error, and ``decode_forms_summary``: per form, on how many
tables its held-out p99 is below ``after``'s, how many medians it raises over 3%, and whether it
``wins`` (a lower p99 on every table and no median raised over 3%). On the eleven tables,
``shared_level`` (one level over a key's busy phases) and ``shared_rate_0.3`` win; the model is
unchanged: over all steps, not the held-out half, the shared level's p99 is higher on 4 of the
11 (a phase not yet refitted, its busy term the running backward's, moves every phase's level;
``bench/results/latency_h200/README.md``, "Offline after session 23: decode forms";
``session23/latency_fit_decode.json.gz``, ``--out`` that file). Since session 24 the model is
``shared_fitted_0.3_after_500`` (``after``; the earlier one is ``per_phase``), which was no worse
than it on every table held-out, over all steps and over the first 500 (same README, "Offline in
session 24"; ``session24/latency_decode_schedule.json.gz``). ``--decode-forms-only``: per table
only ``decode_forms`` (seconds per table; the per-key forms, ``replay`` and ``prefill_forms`` are
left out); ``--decode-forms a,b``: only those forms beside ``after``.

``planned_forms`` (``--planned-forms-only``, per table and key, tables recorded before the
``planned_s`` column): ``after`` pricing the whole step (``whole``, the model until session 27)
and the step after its planning with the planning (``schedule_s``) as measured (``planned``,
the model since), held-out (``session27/latency_fit_planned.json``).

``phase_forms`` (``--phase-forms-only``, per table, decode sets): ``after`` replayed with the
trainer phases before session 27 (``legacy``) and with this commit's (``current``: ``ending``,
a step beside the backward's last layer, its own busy phase), held-out and in ``decode_forms``'
views (``session27/latency_fit_phases.json``). Each table is recovered with the phases of the
model that recorded it (``config.trainer_phases``, the legacy ones where a result has none).

``prefill_forms`` (per table, prefill sets of tables with the ``chunks`` … ``enqueue_s`` columns,
since session 20): the prefill set replayed online as ``replay``'s ``after`` (same calibration,
window, refit schedule and prior; ``after`` here equals ``replay``'s, so the forms compare on the
same footing), each form's held-out error, and ``prefill_forms_summary`` over the files: per
form, on how many tables its held-out p99 is below ``after``'s and its largest held-out median.
Forms (:data:`PREFILL_FORMS`), each known before the step runs:

- ``context_kv``: plus ``Σ_i ctx_i``, the cached tokens the chunks read (a chunk of a few tokens
  over a 4k context reads all of it; ``h_ctx = Σ n_i·ctx_i`` prices it at almost nothing and the
  ``i_ctx`` constant the same as over a 100-token context);
- ``context_tiles``: ``h_ctx`` replaced by ``Σ_i ⌈n_i / 128⌉·ctx_i`` (the context read once per
  query tile);
- ``small_set``: a separate set (own refits, same prior) for steps of at most 512 bucketed tokens;
- ``host_floor`` / ``host_floor_soft``: ``max(linear, H)`` / ``(linear⁸ + H⁸)^⅛``, the linear
  form refitted on the steps that were not host-bound (below), where ``H`` is
  a host form over (1, chunks, decodes, FT rows, ``[some ctx_j > 0]``, whether the step samples)
  refitted on the previous small steps' ``enqueue_s``, plus the median ``measured − enqueue_s``
  of the previous small steps that were host-bound (``enqueue_s`` over 0.7 of the step). Whether
  a step samples is read from ``event_timed`` (a step that samples nothing is timed by events):
  the scheduler knows it before the step;
- ``knee_256`` / ``knee_512`` / ``knee_1024`` (:data:`KNEES`): plus ``max(0, K − tokens)``, a
  second slope for the steps below ``K`` bucketed tokens (the weights are read whatever the
  batch, so a small step's time stops falling with its tokens).

- ``lone``: plus an indicator of a prompt alone (no decodes, no FT rows) after an idle host
  (``gap_s`` of :data:`LONE_GAP_S` or more; any such step of a table without ``gap_s``);
- ``lone_level``: ``after`` with those steps scaled by a level of their own, moved as the decode
  sets' level moves but at the model's ``LONE_LEVEL_RATE`` (:func:`_lone_level`);
  ``lone_level_slow``: the same at the decode sets' ``LEVEL_RATE`` (the model's until session 30);
- ``knee_256_lone`` / ``knee_512_lone`` / ``knee_1024_lone``: ``knee_K`` with ``lone_level``'s
  level (the lone prompts that a knee over- or under-prices then get their own level).
- ``over_256_lone`` / ``over_512_lone`` / ``over_1024_lone``: the same knee written as a second
  slope above ``K``, plus ``max(0, tokens − K)``: the same family of prices, but with every
  coefficient non-negative a longer step never predicts shorter (``knee_K``'s slope below ``K``,
  ``b − k``, may be negative), as admission's greedy fill assumes.

Session 29, on the four H100 tables of session 28 and the fourteen H200 tables of sessions 20–26
(``bench/results/latency_h100/session28/latency_fit_knee.json.gz``): ``knee_512`` lowers the
held-out p99 of the three H100 tables whose engine had the whole GPU (19.6 → 12.9, 19.4 → 11.6,
18.0 → 13.3%) and of 8 of the 14 H200 ones, but raises it on the other six (up to 12.1 → 32.5%)
and on the engine-split table; so the model keeps its linear form. The worst held-out steps of
session 29's H100 tables are the probes' 32-token prefills on an idle engine (8.3 ms of GPU time,
~0.79× predicted); ``lone`` leaves their prediction
where it was (held-out p99 within 1.1 points of ``after``'s on all 24 tables,
``bench/results/latency_h100/session29/latency_fit_session29_lone.json.gz``):
the 30-odd such steps at a table's end come too late and too few for the online refits
(``_online``, the model's schedule) to move a coefficient that starts at 0. ``lone_level`` does
move them: its held-out p99 is at or below ``after``'s on all 24 tables (the ten H100 ones
18.0–29.2 → 14.4–26.0%, the H200 ones by at most 1.3 points), medians within 0.06 points above
and up to 0.62 below (``session29/latency_fit_session29_lone.json.gz``). Chosen on these tables:
the next device runs are its first out-of-sample test. The model carries it since session 29
(``LatencyModel(lone_level=True)``, by default; ``replay``'s ``after``), which replayed gives the
same held-out p99 on the six session-29 tables (15.2, 17.8, 14.4, 14.4, 22.9, 26.0%); session 28's
tables have no ``gap_s`` and the H200 tables neither, so the model marks none of their steps lone.

On the eleven H200 tables of sessions 20, 21 (``share50``, ``release``) and 23, no form's
held-out p99 is below ``after``'s on every table (``context_tiles`` on 10, ``context_kv`` on 8,
the others on 4 or fewer), and none brings any table's to 10%
(``bench/results/latency_h200/session23/latency_fit_forms.json``, written when refits ran as
soon as due: ``--immediate-refits``; ``--out`` that file):

    python bench/latency_fit.py bench/results/latency_h200/session20/*.json.gz
        bench/results/latency_h200/session21/*share50*.json.gz
        bench/results/latency_h200/session21/*release*.json.gz
        bench/results/latency_h200/session23/*.json.gz

    python bench/latency_fit.py bench/results/.../burst-light.json [--config full] [--out fit.json]
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import math
import os
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from coserve.bench.provenance import provenance
from coserve.bench.result_file import read_result
from coserve.bench.runners import row_lone, row_mix
from coserve.core.latency import (
    B_TOKENS,
    DEFER_CAP,
    DEFER_FROM_ROWS,
    KNEE_TOKENS,
    LEGACY_PREFILL_TERMS,
    LEVEL_FORMS,
    LEVEL_RATE,
    LONE_LEVEL_RATE,
    PHASES_IN_USE,
    SHARE_AFTER_STEPS,
    TERMS,
    V2_PREFILL_TERMS,
    LatencyModel,
    error_summary,
    from_legacy_prefill,
    moved_level,
    over_knee,
    prior_weights,
    trainer_phase,
    trainer_spot,
)
from coserve.core.nnls import fit_relative
from coserve.trainer.stream_gate import boundary_kind


def _beside(name: str) -> Any:
    """The module ``name``.py beside this script (run as a script, or loaded from its path)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        assert spec is not None and spec.loader is not None
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


latency_decode = _beside("latency_decode")


def step_tables(result: dict[str, Any], config: str | None) -> dict[str, list[list[Any]]]:
    """``config -> rows`` of every step table in a result file."""
    figures = result.get("figures", {})
    if "steps" in figures:  # bench/coserve_latency.py
        return {"replay": figures["steps"]["rows"]}
    return {name: f["steps"]["rows"] for name, f in figures.items()
            if isinstance(f, dict) and f.get("steps") and (config is None or name == config)}


I_CTX = TERMS["prefill"].index("i_ctx")
PLANNED, planned = latency_decode.PLANNED, latency_decode.planned


def current_regressors(key: str, vec: list[float]) -> list[float]:
    """A recorded step's regressors in this commit's ``TERMS`` order: a prefill row recorded
    before ``i_ctx`` (``LEGACY_PREFILL_TERMS``) gets ``i_ctx = 1`` where its ``h_ctx`` (``Σ n_i·ctx_i``)
    is above 0 — every chunk has a token, so exactly the steps with a chunk over cached context;
    one recorded before ``k_over`` (``V2_PREFILL_TERMS``) gets its tokens over the knee
    (``LatencyModel.bucketed`` sets it again at the replaying model's knee)."""
    if key.startswith("prefill/") and len(vec) != len(TERMS["prefill"]):
        i_ctx = 1.0 if vec[LEGACY_PREFILL_TERMS.index("h_ctx")] > 0 else 0.0
        return list(from_legacy_prefill(vec, i_ctx, over_knee(vec[B_TOKENS], KNEE_TOKENS)))
    return vec


def _errors(pred: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    stats = error_summary(((pred - y).abs() / y).tolist())
    return {"median_rel": stats.median_rel, "p99_rel": stats.p99_rel, "n": stats.n}


GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
"""``EngineConfig.cuda_graph_batch_sizes``' default."""


def _bucket(rows: float, sizes: tuple[int, ...]) -> float:
    return float(next((b for b in sizes if b >= rows), rows))


def _by_trainer_at(steps: list[list[Any]], in_task_only: bool = False) -> dict[str, Any]:
    """Online error and measured / predicted ratio of busy steps by the trainer's position
    (``in_task_only``: ``in_task`` or ``between_tasks`` alone)."""
    top = max((s[4][0] for s in steps if s[4] is not None), default=0)
    groups: dict[str, list[tuple[float, float]]] = {}
    for predicted, measured, _, _, at, *_ in steps:
        if predicted <= 0:
            continue
        if at is None:
            kind = "between_tasks"
        else:
            kind = "in_task" if in_task_only else boundary_kind(at[0], at[1], top)
        groups.setdefault(kind, []).append((predicted, measured))
    out = {}
    for kind, pairs in sorted(groups.items()):
        ratios = torch.tensor([m / p for p, m in pairs], dtype=torch.float64)
        errors = error_summary([abs(p - m) / m for p, m in pairs])
        out[kind] = {"n": len(pairs), "ratio_median": float(ratios.median()),
                     "online_median_rel": errors.median_rel, "online_p99_rel": errors.p99_rel}
    return out


SIZE_BINS = (512, 1024, 1800)
"""Upper ends of ``by_size``'s token bins (then one bin for the rest)."""


def _by_size(steps: list[list[Any]]) -> dict[str, Any]:
    """Online error and median signed error of prefill-form steps by tokens and FT rows
    (regressors 1 and 2 of ``TERMS["prefill"]``: ``T_in + B_d`` and ``T_ft``)."""
    groups: dict[str, list[tuple[float, float]]] = {}
    for predicted, measured, vec, *_ in steps:
        tokens = vec[1]
        size = next((f"<{b}" for b in SIZE_BINS if tokens < b), f">={SIZE_BINS[-1]}")
        groups.setdefault(f"{'ft' if vec[2] > 0 else 'no_ft'}/{size}", []).append((predicted, measured))
    out = {}
    for name, pairs in sorted(groups.items()):
        errors = error_summary([abs(p - m) / m for p, m in pairs])
        signed = torch.tensor([(p - m) / m for p, m in pairs], dtype=torch.float64)
        out[name] = {"n": len(pairs), "online_median_rel": errors.median_rel, "online_p99_rel": errors.p99_rel,
                     "signed_median_rel": float(signed.median()),
                     "measured_p50_s": float(torch.tensor([m for _, m in pairs]).median())}
    return out


def _by_context_timing(steps: list[list[Any]]) -> dict[str, Any]:
    """Prefill-form steps by whether a chunk had cached context (``i_ctx``) and how the step was
    timed (``events``: the GPU's events, a step that sampled nothing; ``host``; ``unknown``: a
    table without the ``event_timed`` column): whether the context constant follows the timing
    path rather than the work."""
    groups: dict[str, list[tuple[float, float]]] = {}
    for predicted, measured, vec, _, _, timed in steps:
        how = "unknown" if timed is None else "events" if timed else "host"
        groups.setdefault(f"{'context' if vec[I_CTX] > 0 else 'no_context'}/{how}", []).append(
            (predicted, measured))
    out = {}
    for name, pairs in sorted(groups.items()):
        signed = torch.tensor([(p - m) / m for p, m in pairs], dtype=torch.float64)
        out[name] = {"n": len(pairs), "signed_median_rel": float(signed.median()),
                     "measured_p50_s": float(torch.tensor([m for _, m in pairs]).median())}
    return out


def evaluate(rows: list[list[Any]], train: float, floor_q: float,
             graph_sizes: tuple[int, ...] = GRAPH_SIZES) -> dict[str, Any]:
    """Held-out errors per key of the forms in the module docstring."""
    by_key: dict[str, list[list[Any]]] = {}
    for key, predicted, measured, vec, *extra in rows:
        if measured > 0:
            by_key.setdefault(key, []).append([predicted, measured, current_regressors(key, vec),
                                               extra[0] if extra else None,
                                               extra[1] if len(extra) > 1 else None,
                                               extra[2] if len(extra) > 2 else None])
    out: dict[str, Any] = {}
    for key, steps in sorted(by_key.items()):
        n_train = int(len(steps) * train)
        if n_train < 8 or len(steps) - n_train < 4:
            out[key] = {"skipped": f"{len(steps)} steps: too few to split"}
            continue
        x = torch.tensor([s[2] for s in steps], dtype=torch.float64)
        y = torch.tensor([s[1] for s in steps], dtype=torch.float64)
        online = torch.tensor([s[0] for s in steps], dtype=torch.float64)
        xt, yt, xh, yh = x[:n_train], y[:n_train], x[n_train:], y[n_train:]
        theta = torch.tensor(fit_relative(xt, yt, 1.0 / yt), dtype=torch.float64)
        floor = float(yt.quantile(floor_q))
        above = yt > 1.5 * floor
        if int(above.sum()) >= x.shape[1]:
            gpu = torch.tensor(fit_relative(xt[above], yt[above], 1.0 / yt[above]), dtype=torch.float64)
            floored = torch.maximum(xh @ gpu, torch.full_like(yh, floor))
        else:
            floored = torch.full_like(yh, floor)
        out[key] = {
            "train_steps": n_train, "held_out_steps": len(steps) - n_train,
            "online": _errors(online[n_train:], yh),
            "linear": _errors(xh @ theta, yh),
            "floor": {**_errors(floored, yh), "floor_s": floor},
            "measured_s": {"p10": float(y.quantile(0.1)), "p50": float(y.quantile(0.5)),
                           "p90": float(y.quantile(0.9))},
        }
        ratio = (yh / online[n_train:])[online[n_train:] > 0]
        if ratio.numel():
            # the held-out steps' measured / predicted: which way the online model misses
            out[key]["online_ratio"] = {q: float(ratio.quantile(v)) for q, v in
                                        (("p1", 0.01), ("p50", 0.5), ("p99", 0.99))}
        if key.startswith("decode/graph"):
            xb = x.clone()
            xb[:, 0] = torch.tensor([_bucket(float(v), graph_sizes) for v in x[:, 0]], dtype=torch.float64)
            theta_b = torch.tensor(fit_relative(xb[:n_train], yt, 1.0 / yt), dtype=torch.float64)
            out[key]["bucket"] = _errors(xb[n_train:] @ theta_b, yh)
        if key.startswith("prefill/"):
            out[key]["by_size"] = _by_size(steps)
            out[key]["by_context_timing"] = _by_context_timing(steps)
            out[key]["linear"]["context_constant_s"] = float(theta[I_CTX])
            ctx = x[:, I_CTX]
            if 0 < int(ctx[:n_train].sum()) < n_train:
                keep = [i for i in range(x.shape[1]) if i != I_CTX]
                xn = x[:, keep]
                theta_n = torch.tensor(fit_relative(xn[:n_train], yt, 1.0 / yt), dtype=torch.float64)
                out[key]["no_context_constant"] = {**_errors(xn[n_train:] @ theta_n, yh),
                                                   "steps_with_context": int(ctx.sum())}
        ats = [s[4] for s in steps]
        if key.endswith("/busy") and any(a is not None for a in ats):
            out[key]["by_trainer_at"] = _by_trainer_at(steps)
        elif key.endswith("/idle") and any(a is not None for a in ats):
            # a prefill step pauses the trainer, whose queued kernels may still run at its start
            out[key]["by_trainer_in_task"] = _by_trainer_at(steps, in_task_only=True)
        if all(s[3] is not None for s in steps):
            xr = torch.cat([x, torch.tensor([s[3] for s in steps], dtype=torch.float64)], 1)
            theta_r = torch.tensor(fit_relative(xr[:n_train], yt, 1.0 / yt), dtype=torch.float64)
            out[key]["rows"] = {**_errors(xr[n_train:] @ theta_r, yh),
                                "per_chunk_s": float(theta_r[-2]), "per_ft_row_s": float(theta_r[-1])}
    return out


PREFILL_BUCKETS = (128, 256, 512, 768, 1024, 1536, 2048)
"""``EngineConfig.prefill_graph_buckets``' default."""

REPLAY_FORMS: dict[str, dict[str, Any]] = {
    "before": {"phases": False, "level_rate": 0.0, "context": False, "share_after": None, "lone": False},
    "phases": {"phases": True, "level_rate": 0.0, "context": False, "share_after": None, "lone": False},
    "level": {"phases": False, "level_rate": LEVEL_RATE, "context": False, "share_after": None, "lone": False},
    "context": {"phases": False, "level_rate": 0.0, "context": True, "share_after": None, "lone": False},
    "per_phase": {"phases": True, "level_rate": LEVEL_RATE, "context": True, "share_after": None, "lone": False},
    "after": {"phases": True, "level_rate": LEVEL_RATE, "context": True, "share_after": SHARE_AFTER_STEPS,
              "lone": True},
}
CALIBRATED_STEPS = 10
"""A set's first refit comes after this many observations: its predictions until then are the
calibration's (scaled by the set's level, where it carries one)."""
EXTENDED_STEPS = 4 * CALIBRATED_STEPS
"""How far :func:`recover` looks past a set's first :data:`CALIBRATED_STEPS`: the server puts a
due refit off until the host idles, or to ``DEFER_CAP`` refit intervals (``defer_refits``), so
the predictions stay the calibration's for a while after the tenth; the steps up to the first
that the solve no longer reproduces (:data:`EXTENDED_RESIDUAL`: a refit moved it) join it."""
EXTENDED_RESIDUAL = 1e-5
"""A relative residual above the table's six significant digits (~1e-6) by a margin."""
RECORDED_MODELS: tuple[tuple[float, bool], ...] = ((0.0, False), (LEVEL_RATE, True), (LEVEL_RATE, False))
"""The ``(level_rate, level per trainer phase)`` that :func:`recover` tries for the recorded
server: no level (tables recorded before it), the level per busy set of each phase (since
374eab1), one level for a key's busy steps."""


class Recovery(NamedTuple):
    """The recorded server's calibration and level, as :func:`recover` finds them."""

    calibration: dict[str, list[float]]
    level_rate: float
    level_per_phase: bool
    residual: float
    """The largest relative residual of the solve over the steps it used (~1e-6: the table's
    six significant digits)."""


LEGACY_TRAINER_PHASES = ("active", "quiet", "starting")
"""``TRAINER_PHASES`` before session 27's ``ending``: the phases of the models that recorded the
tables until then (a result whose config does not list ``trainer_phases``)."""


def recorded_phases(result: dict[str, Any]) -> tuple[str, ...]:
    """The trainer phases of the model that recorded ``result``'s step tables."""
    return tuple(result.get("config", {}).get("trainer_phases") or LEGACY_TRAINER_PHASES)


LOSS_LAYER = 32
"""The loss boundary's layer (``num_layers``) in the recorded tables: every one is of the
``llama3-8b`` shape."""


def row_spot(row: list[Any]) -> str | None:
    """A busy step-table row's ``StepFeatures.spot`` (``coserve.core.latency.trainer_spot`` of
    its ``trainer_at`` in :data:`LOSS_LAYER` layers); None for an idle row or one without it."""
    if not row[0].endswith("/busy") or len(row) <= 5 or row[5] is None:
        return None
    return trainer_spot((int(row[5][0]), int(row[5][1])), LOSS_LAYER)


def replay_phases(steps: list[list[Any]], phases: tuple[str, ...] = PHASES_IN_USE) -> list[str]:
    """Each step's trainer phase (``coserve.core.latency.trainer_phase``) from its ``trainer_at``
    (``[key, predicted, measured, regressors, rows, trainer_at, ...]``) and the step before, as a
    model with only ``phases`` had it (a phase it did not have is ``active``: ``ending``, the
    backward's last layer, for the models before session 27; ``loss`` before session 33)."""
    out, previous = [], "starting"
    loss_layer = LOSS_LAYER if "loss" in phases else None
    for row in steps:
        key, at = row[0], row[5] if len(row) > 5 else None
        if key.endswith("/busy"):
            previous = trainer_phase(None if at is None else tuple(at), previous, loss_layer)
        else:  # the trainer paused, or no task in flight (then a later one starts from scratch)
            previous = "starting" if at is None else trainer_phase(tuple(at), previous, loss_layer)
        out.append(previous if previous in phases else "active")
    return out


def _least_norm(x: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The least-norm non-negative-clamped solution of ``x θ = p`` and its largest relative residual."""
    theta = torch.linalg.lstsq(x, p.unsqueeze(1), driver="gelsd").solution.squeeze(1).clamp(min=0)
    return theta, float(((x @ theta - p).abs() / p.clamp(min=1e-12)).max())


def _solve_calibration(rows: list[list[Any]], phases: list[str], model: LatencyModel, level_rate: float,
                       per_phase: bool) -> tuple[dict[str, list[float]], float]:
    """:func:`recover` for one recorded model: each key's first :data:`CALIBRATED_STEPS`
    predictions (and those after, up to its first refit: :data:`EXTENDED_STEPS`) divided by the
    level they carried, then solved for the coefficients."""
    first: dict[str, list[tuple[tuple[float, ...], float]]] = {}
    level: dict[tuple[str, str], float] = {}
    for row, phase in zip(rows, phases, strict=True):
        key, vec = row[0], row[3]
        # (the model's part of the step: what it predicted and what it learned from)
        predicted, measured = row[1] - planned(row), row[2] - planned(row)
        base, busy = key.rsplit("/", 1)
        seen = first.setdefault(key, [])
        if len(seen) >= EXTENDED_STEPS:
            continue
        linear = predicted
        if level_rate > 0 and base.startswith(LEVEL_FORMS):
            # the level's rule (LatencyModel.observe_regressors): its value before this step is
            # known from the recorded predictions and times of the set's earlier steps alone
            # (a key's first steps, before LatencyModel.ending_after: ``ending`` is ``active``)
            s = (base, (phase if per_phase and phase != "ending" else "active") if busy == "busy" else "idle")
            now = level.get(s, 0.0)
            linear = predicted * math.exp(-now)
            if linear > 0:
                level[s] = moved_level(now, math.log(measured / linear), level_rate)
        seen.append((model.bucketed(vec, base), linear))
    out: dict[str, list[float]] = {}
    residual = 0.0
    for key in sorted(first, key=lambda k: not k.endswith("/idle")):  # idle sets first
        base = key.rsplit("/", 1)[0]
        if base in out or not first[key]:
            continue
        x_all = torch.tensor([s[0] for s in first[key]], dtype=torch.float64)
        p_all = torch.tensor([s[1] for s in first[key]], dtype=torch.float64)
        theta, worst = _least_norm(x_all[:CALIBRATED_STEPS], p_all[:CALIBRATED_STEPS])
        if worst <= EXTENDED_RESIDUAL:
            # (the steps past the tenth, up to the first refit, where they excite a term more)
            for n in range(CALIBRATED_STEPS + 1, len(p_all) + 1):
                more, more_worst = _least_norm(x_all[:n], p_all[:n])
                if more_worst > EXTENDED_RESIDUAL:
                    break
                theta, worst = more, more_worst
        residual = max(residual, worst)
        legacy = base.startswith("prefill/") and len(theta) != len(TERMS["prefill"])
        out[base] = list(from_legacy_prefill(theta.tolist(), 0.0)) if legacy else theta.tolist()
    return out, residual


def recover(rows: list[list[Any]], model: LatencyModel, phases: list[str] | None = None,
            calibration: dict[str, list[float]] | None = None) -> Recovery:
    """``form/mode -> coefficients`` that reproduce each key's first :data:`CALIBRATED_STEPS`
    recorded predictions (idle ones, else busy ones made before any busy term existed: the idle
    set alone), under the :data:`RECORDED_MODELS` level that reproduces them best. A decode set's
    level had moved those predictions (session 23: solved without it, the calibration was off and
    the replay 0.6–3.5× the recorded busy predictions); the level's rule gives its value before
    each step from the set's earlier predictions and times, so each is divided by it first. A
    direction those steps leave unexcited gets 0 (the least-norm solution). Solved in the
    recorded regressors: a table recorded before ``i_ctx`` came from a model without it, whose
    prefill sets get ``i_ctx = 0`` (as ``LatencyModel.load_state_dict`` migrates them).

    ``calibration`` (:func:`recorded_calibration`: the coefficients the run recorded, since
    session 29) replaces the solved coefficients of the keys it has; the level is still the one
    that reproduces the first predictions best. The solve cannot separate terms that those steps
    move together: session 28's engine-split table began with ten decode steps of 5 decodes each,
    and its least-norm split (0.83 ms a decode, 0.10 ms constant, against the ~9 µs and ~6.7 ms
    recovered from its steps up to the first refit) made
    the replay of its busy decode set 0.84 (p99) away from the recorded predictions."""
    phases = replay_phases(rows) if phases is None else phases
    best: Recovery | None = None
    for rate, per_phase in RECORDED_MODELS:
        solved, residual = _solve_calibration(rows, phases, model, rate, per_phase)
        if best is None or residual < 0.5 * best.residual:  # (ties: the simpler model, first)
            best = Recovery({**solved, **(calibration or {})}, rate, per_phase, residual)
    assert best is not None
    return best


def recovered_calibration(rows: list[list[Any]], model: LatencyModel,
                          recorded: tuple[str, ...] = PHASES_IN_USE,
                          calibration: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """:func:`recover`'s calibration of a table recorded by a model with the ``recorded`` phases
    (and, where the run recorded it, the ``calibration`` it ran from)."""
    return recover(rows, model, replay_phases(rows, recorded), calibration).calibration


def recorded_calibration(result: dict[str, Any]) -> dict[str, list[float]] | None:
    """The calibrated coefficients that ``result``'s run recorded (``bench/coserve_latency.py``'s
    ``figures.calibration.coefficients``, since session 29), None before: a prefill set of
    ``V2_PREFILL_TERMS`` (before session 31) with ``k_over = 0`` (the prices it ran with); those
    of a key of another length are left out, to be recovered."""
    got = (result.get("figures", {}).get("calibration") or {}).get("coefficients")
    if not isinstance(got, dict):
        return None
    out = {}
    for k, v in got.items():
        form = k.split("/")[0]
        if form == "prefill" and len(v) == len(V2_PREFILL_TERMS):
            v = from_legacy_prefill(v, 0.0)
        if form in TERMS and len(v) == len(TERMS[form]):
            out[k] = [float(c) for c in v]
    return out or None


def _configure(model: LatencyModel, graph_sizes: tuple[int, ...], prefill_buckets: tuple[int, ...] | None,
               defer: bool) -> LatencyModel:
    """``model`` with the engine's buckets; ``defer``: refits put off as ``CoServer`` puts them
    off (``LatencyModel.defer_refits``), with no idle poll to run them, so at the cap."""
    model.graph_bucket = lambda n: int(_bucket(n, graph_sizes))
    if prefill_buckets is not None:
        model.prefill_bucket = lambda n: int(_bucket(n, prefill_buckets))
    model.defer_refits = defer
    model.defer_from_rows = DEFER_FROM_ROWS  # (this module's: a test sets it as a recorded server had it)
    return model


def _replay_model(graph_sizes: tuple[int, ...], prefill_buckets: tuple[int, ...] | None,
                  level_rate: float = LEVEL_RATE, defer: bool = True,
                  share_after: int | None = SHARE_AFTER_STEPS, lone: bool = True,
                  knee_tokens: int = KNEE_TOKENS) -> LatencyModel:
    return _configure(LatencyModel(level_rate=level_rate, share_after=share_after, lone_level=lone,
                                   knee_tokens=knee_tokens), graph_sizes, prefill_buckets, defer)


def replay(rows: list[list[Any]], train: float, graph_sizes: tuple[int, ...],
           prefill_buckets: tuple[int, ...] | None, defer: bool = True,
           recorded: tuple[str, ...] = PHASES_IN_USE, recorded_planned: bool = True,
           calibration: dict[str, list[float]] | None = None) -> dict[str, Any]:
    """Held-out error of the online model replayed step by step (module docstring, ``replay``),
    of a table recorded by a model with the trainer phases ``recorded`` (:func:`recorded_phases`).
    ``after`` runs this commit's phases, the other forms the phases before ``ending``.
    ``recorded_planned`` False: the rows' ``planned_s`` were not the recording model's (its
    predictions priced the whole step), so the recovery leaves them out."""
    steps = [r for r in rows if r[2] > 0]
    phases = replay_phases(steps)
    legacy = replay_phases(steps, LEGACY_TRAINER_PHASES)
    as_recorded = steps if recorded_planned else [r[:PLANNED] for r in steps]
    recovery = recover(as_recorded, _replay_model(graph_sizes, prefill_buckets), replay_phases(steps, recorded),
                       calibration)
    source = "recorded" if calibration else "recovered"
    calibration = recovery.calibration
    state = {**LatencyModel().state_dict(), "coefficients": calibration, "calibration": calibration}
    predictions: dict[str, list[float]] = {}
    for form, options in REPLAY_FORMS.items():
        model = _replay_model(graph_sizes, prefill_buckets, options["level_rate"], defer, options["share_after"],
                              options["lone"])
        model.load_state_dict(state)
        out = []
        for row, phase in zip(steps, phases if form == "after" else legacy, strict=True):
            key, measured, vec, pl = row[0], row[2], row[3], planned(row)
            base, busy = key.rsplit("/", 1)
            state_of = ("active" if not options["phases"] else phase) if busy == "busy" else "idle"
            v = current_regressors(base, vec)
            if not options["context"] and base.startswith("prefill/"):
                v = [*v[:I_CTX], 0.0, *v[I_CTX + 1:]]
            out.append(model.observe_regressors(base, model.bucketed(v, base), measured - pl, state_of,
                                                options["lone"] and row_lone(row),
                                                row_spot(row) if form == "after" else None,
                                                form == "after" and row_mix(row)) + pl)
        predictions[form] = out
    report: dict[str, Any] = {"calibration": calibration, "recovery": {
        "level_rate": recovery.level_rate, "level_per_phase": recovery.level_per_phase,
        "residual": recovery.residual, "refits": "deferred" if defer else "immediate",
        "calibration": source}}
    for key in sorted({s[0] for s in steps}):
        idx = [i for i, s in enumerate(steps) if s[0] == key]
        held = idx[int(len(idx) * train):]
        if len(held) < 4:
            continue
        y = torch.tensor([steps[i][2] for i in held], dtype=torch.float64)
        recorded = torch.tensor([steps[i][1] for i in held], dtype=torch.float64)
        entry: dict[str, Any] = {"held_out_steps": len(held), "recorded": _errors(recorded, y)}
        for form, pred in predictions.items():
            entry[form] = _errors(torch.tensor([pred[i] for i in held], dtype=torch.float64), y)
        rec_all = torch.tensor([steps[i][1] for i in idx], dtype=torch.float64)
        entry["matches_recorded"] = {}
        for form, pred in predictions.items():
            gap = (torch.tensor([pred[i] for i in idx], dtype=torch.float64) - rec_all).abs() / rec_all
            entry["matches_recorded"][form] = {"median_rel": float(gap.median()),
                                               "p99_rel": float(gap.quantile(0.99))}
        if key.endswith("/busy"):
            entry["by_phase"] = {}
            for name in sorted({phases[i] for i in held}):
                sub = [j for j, i in enumerate(held) if phases[i] == name]
                entry["by_phase"][name] = {
                    form: _errors(torch.tensor([predictions[form][held[j]] for j in sub], dtype=torch.float64),
                                  y[sub]) for form in ("recorded", *REPLAY_FORMS) if form != "recorded"}
                entry["by_phase"][name]["recorded"] = _errors(recorded[sub], y[sub])
        report[key] = entry
    return report


PREFILL_FORMS = ("context_kv", "context_tiles", "small_set", "host_floor", "host_floor_soft", "knee_256", "knee_512",
                 "knee_1024", "lone", "lone_level", "lone_level_slow", "knee_256_lone", "knee_512_lone",
                 "knee_1024_lone", "over_256_lone", "over_512_lone", "over_1024_lone")
KNEES = (256, 512, 1024)
"""``knee_K``: plus ``max(0, K − tokens)`` (bucketed tokens: prefill, FT and decode rows), a
second slope below ``K`` tokens, where a step's time stops falling with its tokens (the weights
are read whatever the batch)."""
TILE = 128
"""Query tokens per attention tile (``context_tiles``)."""
SMALL_TOKENS = 512
"""The most bucketed tokens of a step in ``small_set``'s small set and ``host_floor``'s fits."""
HOST_BOUND = 0.7
"""``host_floor``: a step whose ``enqueue_s`` is over this share of its time was host-bound."""


def _online(x: np.ndarray, y: np.ndarray, prior: list[float], model: LatencyModel,
            fitted: np.ndarray | None = None) -> np.ndarray:
    """Each step's prediction before it is observed by an idle set refitted as
    ``LatencyModel.observe_regressors`` refits one (``model``'s window, schedule, prior weight
    and ``defer_refits``, with no idle poll: at the cap; ``prior``: the calibration), in any
    regressors ``x: [steps, k]``; ``fitted``: the steps its refits use (all by default)."""
    coef, pred, unfitted = np.asarray(prior, np.float64), np.empty(len(y)), 0
    for i in range(len(y)):
        pred[i] = x[i] @ coef
        lo, unfitted = max(0, i + 1 - model.window), unfitted + 1
        cap = DEFER_CAP if model.defer_refits and i + 1 - lo >= DEFER_FROM_ROWS else 1
        if unfitted >= cap * min(model.refit_every, max(10, (i + 1 - lo) // 4)):
            keep = slice(None) if fitted is None else fitted[lo:i + 1]
            xs, ys = x[lo:i + 1][keep], y[lo:i + 1][keep]
            coef, unfitted = np.asarray(fit_relative(xs, ys, 1.0 / ys, prior, prior_weights(prior, model.prior_weight))), 0
    return pred


def _lone_level(pred: np.ndarray, y: np.ndarray, lone: np.ndarray, rate: float = LONE_LEVEL_RATE) -> np.ndarray:
    """``lone_level``: ``pred`` with the ``lone`` steps scaled by a level of their own, moved as
    the decode sets' level moves (``coserve.core.latency.moved_level``) but at ``rate`` (the
    model's :data:`LONE_LEVEL_RATE`; ``lone_level_slow``: the decode sets' :data:`LEVEL_RATE`, the
    model's until session 30), from what was measured before."""
    out, level = pred.copy(), 0.0
    for i in np.flatnonzero(lone):
        if pred[i] <= 0:
            continue
        out[i] = pred[i] * math.exp(level)
        level = moved_level(level, math.log(y[i] / pred[i]), rate)
    return out


def _host_floor(x: np.ndarray, z: np.ndarray, y: np.ndarray, enqueue: np.ndarray, small: np.ndarray,
                prior: list[float], model: LatencyModel, soft: bool) -> np.ndarray:
    """``_online``'s linear form, refitted on the steps that were not host-bound, under a host
    floor refitted on the previous small steps (module docstring, ``host_floor``)."""
    linear = _online(x, y, prior, model, fitted=~(small & (enqueue / y > HOST_BOUND)))
    host, offset, pred = None, 0.0, np.empty(len(y))
    for i in range(len(y)):
        h = float(z[i] @ host) + offset if host is not None and small[i] else 0.0
        pred[i] = (linear[i] ** 8 + h ** 8) ** 0.125 if soft else max(linear[i], h)
        seen = small[:i + 1] & (enqueue[:i + 1] > 0)
        if (i + 1) % 10 == 0 and int(seen.sum()) >= 2 * z.shape[1]:
            zs, es, ys = z[:i + 1][seen], enqueue[:i + 1][seen], y[:i + 1][seen]
            host = np.asarray(fit_relative(zs, es, 1.0 / es))
            bound = es / ys > HOST_BOUND
            offset = float(np.median((ys - es)[bound])) if int(bound.sum()) >= 5 else 0.0
    return pred


def prefill_forms(rows: list[list[Any]], train: float, graph_sizes: tuple[int, ...],
                  prefill_buckets: tuple[int, ...] | None, defer: bool = True,
                  recorded: tuple[str, ...] = PHASES_IN_USE,
                  calibration: dict[str, list[float]] | None = None,
                  knee_tokens: int = KNEE_TOKENS) -> dict[str, Any]:
    """Held-out error of the prefill sets replayed online in :data:`PREFILL_FORMS` (module
    docstring, ``prefill_forms``), ``after`` the model's form at a knee of ``knee_tokens`` (0:
    none, the form before session 31); ``{}`` for a table without the chunk columns."""
    model = _replay_model(graph_sizes, prefill_buckets, defer=defer, knee_tokens=knee_tokens)
    steps = [r for r in rows if r[2] > 0]
    calibration = recovered_calibration(steps, model, recorded, calibration)
    out: dict[str, Any] = {}
    for key in sorted({s[0] for s in steps if s[0].startswith("prefill/") and s[0].endswith("/idle")}):
        # [key, predicted, measured, regressors, rows, trainer_at, event_timed, chunks, decodes, _, enqueue_s]
        own = [s for s in steps if s[0] == key]
        if any(len(s) < 11 for s in own) or len(own) < 8:
            continue
        base = key.rsplit("/", 1)[0]
        x = np.asarray([model.bucketed(current_regressors(base, s[3]), base) for s in own], np.float64)
        pl = np.asarray([planned(s) for s in own], np.float64)
        y = np.asarray([s[2] for s in own], np.float64) - pl  # (the model's part; pl added back below)
        prior = list(calibration[base])
        ctx = np.asarray([sum(c[1] for c in s[7]) for s in own], np.float64)
        tiles = np.asarray([sum(-(-c[0] // TILE) * c[1] for c in s[7]) for s in own], np.float64)
        small = x[:, 1] <= SMALL_TOKENS
        h, c = TERMS["prefill"].index("h_ctx"), len(TERMS["prefill"]) - 1
        with_kv = np.concatenate([x[:, :c], ctx[:, None], x[:, c:]], 1)
        with_tiles = x.copy()
        with_tiles[:, h] = tiles
        z = np.asarray([[1.0, len(s[7]), s[8], s[4][1], v[I_CTX], 0.0 if s[6] else 1.0]
                        for s, v in zip(own, x, strict=True)], np.float64)
        enqueue = np.asarray([s[10] or 0.0 for s in own], np.float64)
        # (a prompt alone: no decodes, no FT rows; since session 28's gap_s, after an idle host)
        lone = np.asarray([float(row_lone(s, without_gap=True)) for s in own], np.float64)
        split = np.empty(len(y))
        for part in (small, ~small):
            split[part] = _online(x[part], y[part], prior, model)
        preds = {
            "after": _online(x, y, prior, model),
            "context_kv": _online(with_kv, y, [*prior[:c], 0.0, prior[c]], model),
            "context_tiles": _online(with_tiles, y, [*prior[:h], 0.0, *prior[h + 1:]], model),
            "small_set": split,
            "host_floor": _host_floor(x, z, y, enqueue, small, prior, model, soft=False),
            "host_floor_soft": _host_floor(x, z, y, enqueue, small, prior, model, soft=True),
            **{f"knee_{k}": _online(np.concatenate([x[:, :c], np.maximum(0.0, k - x[:, 1:2]), x[:, c:]], 1), y,
                                    [*prior[:c], 0.0, prior[c]], model) for k in KNEES},
            "lone": _online(np.concatenate([x[:, :c], lone[:, None], x[:, c:]], 1), y, [*prior[:c], 0.0, prior[c]],
                            model),
        }
        preds["lone_level"] = _lone_level(preds["after"], y, lone > 0)
        preds["lone_level_slow"] = _lone_level(preds["after"], y, lone > 0, LEVEL_RATE)
        for k in KNEES:  # (the knee with the lone prompts' level: the two together)
            preds[f"knee_{k}_lone"] = _lone_level(preds[f"knee_{k}"], y, lone > 0)
            over = _online(np.concatenate([x[:, :c], np.maximum(0.0, x[:, 1:2] - k), x[:, c:]], 1), y,
                           [*prior[:c], 0.0, prior[c]], model)
            preds[f"over_{k}_lone"] = _lone_level(over, y, lone > 0)
        held = int(len(y) * train)
        out[key] = {"held_out_steps": len(y) - held, **{
            form: _errors(torch.from_numpy((p + pl)[held:]), torch.from_numpy((y + pl)[held:]))
            for form, p in preds.items()}}
    return out


def decode_forms(rows: list[list[Any]], train: float, graph_sizes: tuple[int, ...],
                 prefill_buckets: tuple[int, ...] | None, defer: bool = True,
                 names: Collection[str] | None = None, recorded: tuple[str, ...] = PHASES_IN_USE,
                 calibration: dict[str, list[float]] | None = None) -> dict[str, Any]:
    """Held-out error of the decode sets replayed online in ``latency_decode.DECODE_FORMS``
    (module docstring, ``decode_forms``), from ``replay``'s calibration (of a table recorded with
    the phases ``recorded``); ``names``: only these forms (and ``after``). Every form runs this
    commit's trainer phases."""
    steps = [r for r in rows if r[2] > 0]
    phases = replay_phases(steps)
    calibration = recovered_calibration(steps, _replay_model(graph_sizes, prefill_buckets), recorded, calibration)
    state = {**LatencyModel().state_dict(), "coefficients": calibration, "calibration": calibration}
    return latency_decode.decode_forms(steps, phases, state, train,
                                       lambda m: _configure(m, graph_sizes, prefill_buckets, defer),
                                       current_regressors, names, LOSS_LAYER)


def phase_forms(rows: list[list[Any]], train: float, graph_sizes: tuple[int, ...],
                prefill_buckets: tuple[int, ...] | None, defer: bool = True,
                recorded: tuple[str, ...] = PHASES_IN_USE,
                calibration: dict[str, list[float]] | None = None) -> dict[str, Any]:
    """The decode sets' ``after`` (the model as it runs) replayed with the trainer phases before
    session 27 (``legacy``: a step beside the backward's last layer is ``active``) and with this
    commit's (``ending`` its own phase): held-out error and ``decode_forms``' views of each."""
    steps = [r for r in rows if r[2] > 0]
    calibration = recovered_calibration(steps, _replay_model(graph_sizes, prefill_buckets), recorded, calibration)
    state = {**LatencyModel().state_dict(), "coefficients": calibration, "calibration": calibration}
    out: dict[str, Any] = {}
    for name, phases in (("legacy", LEGACY_TRAINER_PHASES), ("current", PHASES_IN_USE)):
        got = latency_decode.decode_forms(steps, replay_phases(steps, phases), state, train,
                                          lambda m: _configure(m, graph_sizes, prefill_buckets, defer),
                                          current_regressors, ["after"], LOSS_LAYER)
        for key, entry in got.items():
            out.setdefault(key, {})[name] = {"held_out": entry["after"],
                                             **{view: e["after"] for view, e in entry["views"].items()}}
    return out


def planned_forms(rows: list[list[Any]], train: float, graph_sizes: tuple[int, ...],
                  prefill_buckets: tuple[int, ...] | None, defer: bool = True,
                  recorded: tuple[str, ...] = PHASES_IN_USE,
                  calibration: dict[str, list[float]] | None = None) -> dict[str, Any]:
    """``replay``'s ``after`` of a table recorded before the ``planned_s`` column, as recorded
    (``whole``: the model prices the whole step) and with each step's ``schedule_s`` as its
    ``planned_s`` (``planned``: the model prices the step after its planning, which is added as
    measured). ``schedule_s`` runs to the end of the step's planning, a little past admission's
    decision: an upper bound on what the server now knows when it decides. Per key, held-out,
    and ``schedule``: over all the key's steps, ``schedule_s``'s p50 / p99 / max and how many
    took over 1 ms, and the recorded predictions' residual ``measured − predicted`` against it
    (correlation, least-squares slope): how far the recorded error followed the planning."""
    steps = [r for r in rows if r[2] > 0 and len(r) > PLANNED - 1]
    if not steps:
        return {}
    with_planned = [[*r[:PLANNED], r[9] if r[9] is not None and r[9] < r[2] else 0.0] for r in steps]
    out: dict[str, Any] = {}
    for name, table in (("whole", [r[:PLANNED] for r in steps]), ("planned", with_planned)):
        got = replay(table, train, graph_sizes, prefill_buckets, defer=defer, recorded=recorded,
                     recorded_planned=name == "whole", calibration=calibration)
        for key, entry in got.items():
            if isinstance(entry, dict) and "after" in entry:
                out.setdefault(key, {"held_out_steps": entry["held_out_steps"]})[name] = entry["after"]
    for key, entry in out.items():
        own = [r for r in steps if r[0] == key and r[9] is not None]
        if len(own) < 2:
            continue
        sched = np.asarray([r[9] for r in own], np.float64)
        residual = np.asarray([r[2] - r[1] for r in own], np.float64)
        spread = float(np.var(sched))
        entry["schedule"] = {
            "p50_s": float(np.median(sched)), "p99_s": float(np.percentile(sched, 99)), "max_s": float(sched.max()),
            "over_1ms": int((sched > 1e-3).sum()), "steps": len(own),
            "residual_corr": float(np.corrcoef(sched, residual)[0, 1]) if spread > 0 else None,
            "residual_slope": float(np.cov(sched, residual, bias=True)[0, 1] / spread) if spread > 0 else None}
    return out


def forms_summary(report: dict[str, Any]) -> dict[str, Any]:
    """Per :data:`PREFILL_FORMS` form, over every table's prefill sets: on how many its held-out
    p99 is below ``after``'s, and its largest held-out median (``after``'s beside it)."""
    sets = [entry for table in report.values() for entry in table.get("prefill_forms", {}).values()]
    out: dict[str, Any] = {"sets": len(sets), "after_max_median_rel": max(
        (e["after"]["median_rel"] for e in sets), default=math.nan)}
    for form in PREFILL_FORMS:
        out[form] = {"lower_p99_sets": sum(e[form]["p99_rel"] < e["after"]["p99_rel"] for e in sets),
                     "max_median_rel": max((e[form]["median_rel"] for e in sets), default=math.nan)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="result JSON files with step tables")
    p.add_argument("--config", default=None, help="only this configuration of a bench result")
    p.add_argument("--train", type=float, default=0.5, help="share of each key's steps to fit on")
    p.add_argument("--floor-quantile", type=float, default=0.1)
    p.add_argument("--graph-sizes", default=",".join(map(str, GRAPH_SIZES)),
                   help="the engine's CUDA-graph batch sizes (for the bucket form)")
    p.add_argument("--prefill-buckets", default=",".join(map(str, PREFILL_BUCKETS)),
                   help="the engine's prefill graph buckets (replay, runs with prefill graphs)")
    p.add_argument("--immediate-refits", action="store_true",
                   help="replay with each set refitted as soon as due (a server without defer_refits, "
                        "before e025b43); by default put off to the cap, as CoServer runs them")
    p.add_argument("--decode-forms-only", action="store_true",
                   help="per table only decode_forms (no per-key forms, replay or prefill_forms)")
    p.add_argument("--decode-forms", default=None,
                   help="comma-separated latency_decode.DECODE_FORMS to replay (and after); all by default")
    p.add_argument("--planned-forms-only", action="store_true",
                   help="per table only planned_forms: after pricing the whole step, and the step after its "
                        "planning (schedule_s) with the planning as measured")
    p.add_argument("--prefill-forms-only", action="store_true",
                   help="only the prefill sets' forms (prefill_forms), no other view")
    p.add_argument("--replay-only", action="store_true",
                   help="only the replay (e.g. to compare the model under a COSERVE_ switch set and unset)")
    p.add_argument("--phase-forms-only", action="store_true",
                   help="per table only phase_forms: the decode sets' after with the trainer phases before "
                        "session 27 and with this commit's")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not 0 < args.train < 1 or not 0 <= args.floor_quantile <= 1:
        p.error("--train must be in (0, 1) and --floor-quantile in [0, 1]")
    report: dict[str, Any] = {}
    graph_sizes = tuple(int(v) for v in args.graph_sizes.split(","))
    buckets = tuple(int(v) for v in args.prefill_buckets.split(","))
    names = None if args.decode_forms is None else args.decode_forms.split(",")
    if names is not None and set(names) - set(latency_decode.DECODE_FORMS):
        p.error(f"--decode-forms: unknown {sorted(set(names) - set(latency_decode.DECODE_FORMS))}")
    for path in args.results:
        result = read_result(path)
        tables = step_tables(result, args.config)
        if not tables:
            p.error(f"{path}: no step table (a result of this commit's `coserve bench` or coserve_latency.py)")
        graphs = bool(result.get("config", {}).get("prefill_graphs"))
        recorded = recorded_phases(result)
        calibration = recorded_calibration(result)
        for name, rows in tables.items():
            pb = buckets if graphs else None
            entry: dict[str, Any] = {}
            only = "planned_forms" if args.planned_forms_only else "phase_forms" if args.phase_forms_only else None
            if only is not None:
                form = planned_forms if only == "planned_forms" else phase_forms
                entry[only] = form(rows, args.train, graph_sizes, pb, defer=not args.immediate_refits,
                                   recorded=recorded, calibration=calibration)
                report[f"{Path(path).name}:{name}"] = entry
                continue
            if args.replay_only:
                entry["replay"] = replay(rows, args.train, graph_sizes, pb, defer=not args.immediate_refits,
                                         recorded=recorded, calibration=calibration)
                report[f"{Path(path).name}:{name}"] = entry
                continue
            if args.prefill_forms_only:
                entry["prefill_forms"] = prefill_forms(rows, args.train, graph_sizes, pb,
                                                       defer=not args.immediate_refits, recorded=recorded,
                                                       calibration=calibration)
                report[f"{Path(path).name}:{name}"] = entry
                continue
            if not args.decode_forms_only:
                entry = evaluate(rows, args.train, args.floor_quantile, graph_sizes)
                entry["replay"] = replay(rows, args.train, graph_sizes, pb, defer=not args.immediate_refits,
                                         recorded=recorded, calibration=calibration)
                entry["prefill_forms"] = prefill_forms(rows, args.train, graph_sizes, pb,
                                                       defer=not args.immediate_refits, recorded=recorded,
                                                       calibration=calibration)
            entry["decode_forms"] = decode_forms(rows, args.train, graph_sizes, pb, defer=not args.immediate_refits,
                                                 names=names, recorded=recorded, calibration=calibration)
            report[f"{Path(path).name}:{name}"] = entry
    if any(e.get("prefill_forms") for e in report.values()):
        report["prefill_forms_summary"] = forms_summary(report)
    if any(e.get("decode_forms") for e in report.values()):
        report["decode_forms_summary"] = latency_decode.decode_summary(report)
    text = json.dumps(report, indent=1, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v)
    if args.out:
        # the analysis runs here on the CPU: its device is this machine's, its inputs the files
        record = {**provenance(), "config": {"results": args.results, "train": args.train,
                                             "floor_quantile": args.floor_quantile,
                                             "graph_sizes": args.graph_sizes,
                                             "prefill_buckets": args.prefill_buckets,
                                             "immediate_refits": args.immediate_refits,
                                             "decode_forms_only": args.decode_forms_only,
                                             "phase_forms_only": args.phase_forms_only,
                                             "planned_forms_only": args.planned_forms_only,
                                             "prefill_forms_only": args.prefill_forms_only,
                                             "replay_only": args.replay_only,
                                             "switches": {k: v for k, v in sorted(os.environ.items())
                                                          if k.startswith("COSERVE_")},
                                             "decode_forms": args.decode_forms},
                  "figures": report}
        body = json.dumps(record, indent=1, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v)
        if args.out.endswith(".gz"):
            with gzip.open(args.out, "wt") as f:
                f.write(body)
        else:
            Path(args.out).write_text(body)
    print(text)


if __name__ == "__main__":
    main()

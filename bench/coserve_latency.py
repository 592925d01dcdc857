"""SLO machinery on the GPU: latency-model error, trainer pause delay, FT-only interruption delay.

Replays a window of an arrival trace through the engine while it fine-tunes (policy ``full``),
with the trainer in its own process (under CUDA MPS when the daemon can be started), and
reports:
- the latency model's relative error on held-out steps (each step is predicted before the model
  observes it), per form (prefill / decode), mode (graph / eager) and trainer busy / idle;
- the delay from the start of a step that carries prefill (grant flag cleared) to the moment the
  trainer has stopped at a layer boundary and its queued GPU work has drained;
- the delay a request sees when it arrives during an FT-only step (it waits for the next layer
  boundary), next to the time of one decoder layer in such a step;
- after those, with fine-tuning turned off (policy ``off``) and the trainer's last task done, the
  trace's first ``--idle-replay-s`` seconds again: the latency model's error on steps with the
  trainer idle (``latency_model_error_trainer_idle``; the replay's own figure keeps the steps
  before it), the same model refitting online as a server that stops fine-tuning would;
- with ``--warm-replays N``, after those, the trace window N times more with fine-tuning back on:
  the latency model's error on steps that it predicts from what the runs before taught it
  (``latency_model_error_warm``), as a server restarted with ``--latency-state`` (whose state
  carries the online windows and levels) or one that has served for a while predicts them.

    PYTHONPATH=src python bench/coserve_latency.py --trace .traces/azure2023_conv.csv --duration 60 \\
        --out bench/results/coserve_latency.json
"""

from __future__ import annotations

import argparse
import bisect
import cProfile
import dataclasses
import io
import json
import logging
import math
import pstats
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from speed_common import LLAMA3_8B, TINY, add_trace_args, provenance, trace_scaling, write_model_dir

from coserve.bench.analysis import latency_model_error
from coserve.bench.metrics import attainment, latency_summary, percentile
from coserve.bench.replay import STEP_COLUMNS, InProcessDriver
from coserve.bench.runners import step_table, task_breakdown
from coserve.bench.utilization import UtilizationSampler
from coserve.bench.workload import Arrival, busiest_window, load_trace
from coserve.core.config import CoServeConfig, LoRAConfig, OptimConfig, SLOConfig
from coserve.core.coserver import CheckPoint
from coserve.core.latency import DECODE_KV, DECODE_KV_SHARE, LONE_GAP_S, PHASES_IN_USE, BatchSpec
from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.models.presets import preset_path
from coserve.server.finetune import FinetuneSession, FinetuneSpec
from coserve.trainer.backward import loss_stretch_roles
from coserve.trainer.mps import share_of_this_process, start_mps_daemon
from coserve.trainer.stream_gate import boundary_kind

SHAPES = {"llama3-8b": LLAMA3_8B, "tiny": TINY}


def ft_dataset(path: Path, n: int, lengths: tuple[int, int], vocab: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            ids = [rng.randrange(10, vocab) for _ in range(rng.randint(*lengths))]
            f.write(json.dumps({"input_ids": ids, "labels": [-100] * (len(ids) // 4) + ids[len(ids) // 4:]}) + "\n")
    return path


def probe_arrivals(n: int, seed: int = 0, gap_s: float = 0.5) -> list[Arrival]:
    """``n`` short requests (32-token prompt, 4 output tokens), one every ``gap_s`` ± 40%:
    each finishes long before the next arrives, so that the engine is back in FT-only steps."""
    rng = random.Random(seed)
    t, out = 0.5, []
    for _ in range(n):
        out.append(Arrival(t, 32, 4))
        t += gap_s * rng.uniform(0.6, 1.4)
    return out


def window_step_ratios(step_starts: Sequence[float], log: Sequence[Any]) -> list[float | None]:
    """For each pause window (its step's start, ``CoServer.pause_window_step_start``), the
    measured / predicted time of its step: the last of ``log`` (``CoServer.step_log``) begun by
    then; None where no step began by then or its times are unknown."""
    began = [(row.began_s, row) for row in log if row.began_s is not None]
    began.sort(key=lambda b: b[0])
    starts = [b for b, _ in began]
    out: list[float | None] = []
    for start in step_starts:
        i = bisect.bisect_right(starts, start) - 1
        row = began[i][1] if i >= 0 else None
        out.append(row.measured_s / row.predicted_s if row is not None and row.predicted_s > 0 and row.measured_s > 0
                   else None)
    return out


DRY_LAG_MS = 0.2
"""A paused boundary the GPU reached within this long of the CPU queuing it: the GPU had run dry."""
LONGEST_PAUSES = 12  # (pause_delays' longest: how many)


def pause_delays(windows: list[tuple[float, float]], observed: list[float],
                 layers: list[int] | None = None, num_layers: int | None = None,
                 lags_ms: list[float] | None = None,
                 window_at: list[tuple[int, int] | None] | None = None,
                 polled: list[bool] | None = None, idle_ms: list[float] | None = None,
                 step_starts: list[float] | None = None,
                 step_ratios: list[float | None] | None = None, origin: float | None = None) -> dict[str, Any]:
    """For each grant-cleared window, the delay to the first observed pause inside it; windows in
    which the trainer never paused (it reached no layer boundary before the step ended) are
    counted apart with their full length (with ``window_at``, by where the trainer was:
    ``not_paused_by_trainer_at_start``). With ``layers`` (the boundary of each observed pause,
    parallel to ``observed``) and ``num_layers``, the delays are also split by where the trainer
    was: ``loss`` (boundary ``num_layers``), ``commit`` (-1) or ``layer``. With ``lags_ms``
    (GPU-side gate: how far the GPU was behind the CPU at each pause) they are split into
    ``gpu_behind`` (the trainer's kernels ran up to the pause) and ``gpu_dry`` (lag under
    :data:`DRY_LAG_MS`: the GPU had run out of work first, so the delay was the trainer's CPU).
    With ``window_at`` (parallel to ``windows``: the boundary the trainer's GPU had passed last
    when the window began, None between tasks) they are split into ``in_task`` (the trainer's
    kernels could be running when the prefill started: the pause delay proper) and
    ``between_tasks`` (its GPU had finished its task; the next task queues no GPU work before its
    start boundary, so the time until that boundary is not a delay the prefill saw). With
    ``polled`` (parallel to ``observed``: the pause was taken at a poll point inside a stretch,
    ``TaskResult.pause_polled``) those pauses count as ``poll`` in ``by_boundary``. With ``idle_ms``
    (``TaskResult.pause_idle_ms``: how long before a pause the trainer's GPU had stopped running
    its kernels, waiting for its stretch's release) a pause's delay runs to that earlier time (not
    before the window's start). With ``step_starts`` (parallel to ``windows``: when the window's
    step was planned, after the window's start where ``SLOConfig.early_pause_s``'s timer paused the
    trainer before it) the delay runs from the step's start, and is 0 for a trainer that had stopped
    by then (``paused_before_step``). With ``step_ratios`` (parallel to ``windows``: the window's
    step's measured / predicted time, priced as beside no backward; None where unknown), their
    median and 90th percentile for the windows with a pause, and for those without one by where
    the trainer was (``step_ratio_by_window``): an unpaused window in a task whose step ran over
    its price as the paused ones did not had the trainer's kernels beside it; one at the same
    ratio found the trainer's GPU with nothing queued (its host behind: a readback, the optimizer).
    ``longest``: the :data:`LONGEST_PAUSES` longest delays, each with its window's start in seconds
    since ``origin`` (default: the first window's), the boundary (layer; ``poll`` where polled), the
    GPU's lag and where the trainer was as the window began: whether a run's few long pauses (its
    p99 is its ~5th longest of ~500) share a time, a boundary or a task."""
    n = len(observed)
    pairs = sorted(zip(observed, layers if layers is not None else [None] * n,
                       lags_ms if lags_ms is not None else [None] * n,
                       polled if polled is not None else [False] * n,
                       idle_ms if idle_ms is not None else [0.0] * n, strict=True))
    delays: list[float] = []
    missed: list[float] = []
    kinds: dict[str, list[float]] = {}
    by_lag: dict[str, list[float]] = {}
    by_at: dict[str, list[float]] = {}
    ats: list[tuple[int, int] | None | bool] = list(window_at) if window_at is not None else [False] * len(windows)
    steps = step_starts if step_starts is not None else [start for start, _ in windows]
    ratios = step_ratios if step_ratios is not None else [None] * len(windows)
    ratio_by: dict[str, list[float]] = {}
    before_step = 0
    missed_at = {"between_tasks": 0, "in_task": 0}
    where: list[dict[str, Any]] = []
    t0 = origin if origin is not None else (windows[0][0] if windows else 0.0)
    j = 0
    for (start, end), at, step_start, ratio in zip(windows, ats, steps, ratios, strict=True):
        while j < len(pairs) and pairs[j][0] < start:
            j += 1
        paused = j < len(pairs) and pairs[j][0] <= end
        if ratio is not None:
            ratio_by.setdefault("paused" if paused else "unpaused" if at is False
                                else f"unpaused_{'between_tasks' if at is None else 'in_task'}", []).append(ratio)
        if paused:
            delay, layer, lag, at_poll = pairs[j][0] - step_start, pairs[j][1], pairs[j][2], pairs[j][3]
            delay = max(0.0, delay - pairs[j][4] / 1e3)
            before_step += pairs[j][0] < step_start
            delays.append(delay)
            where.append({"t_s": round(start - t0, 4), "delay_ms": round(delay * 1e3, 3), "layer": layer,
                          "poll": bool(at_poll), "gpu_lag_ms": None if lag is None else round(lag, 3),
                          "trainer_at": None if at is None or at is False else list(at)})
            if layer is not None:
                kind = "poll" if at_poll else boundary_kind(layer, None, num_layers)
                kinds.setdefault(kind, []).append(delay)
            if lag is not None:
                by_lag.setdefault("gpu_dry" if lag < DRY_LAG_MS else "gpu_behind", []).append(delay)
            if at is not False:
                by_at.setdefault("between_tasks" if at is None else "in_task", []).append(delay)
        else:
            missed.append(end - start)
            if at is not False:
                missed_at["between_tasks" if at is None else "in_task"] += 1
    out: dict[str, Any] = {
        "windows": len(windows), "paused": len(delays), "not_paused_within_step": len(missed),
        "delay_p50_ms": percentile(delays, 50) * 1e3, "delay_p99_ms": percentile(delays, 99) * 1e3,
        "delay_max_ms": max(delays) * 1e3 if delays else None,
        "unpaused_window_p99_ms": percentile(missed, 99) * 1e3 if missed else None,
        "paused_before_step": before_step,
    }
    out["longest"] = sorted(where, key=lambda w: -w["delay_ms"])[:LONGEST_PAUSES]
    if window_at is not None:  # (an unpaused window in a task: its GPU passed no boundary all step)
        out["not_paused_by_trainer_at_start"] = missed_at
    if ratio_by:
        out["step_ratio_by_window"] = {k: {"steps": len(v), "median": percentile(v, 50), "p90": percentile(v, 90)}
                                       for k, v in sorted(ratio_by.items())}
    for name, groups in (("by_boundary", kinds), ("by_gpu_lag", by_lag), ("by_trainer_at_start", by_at)):
        if groups:
            out[name] = {k: {"paused": len(v), "delay_p50_ms": percentile(v, 50) * 1e3,
                             "delay_p99_ms": percentile(v, 99) * 1e3} for k, v in sorted(groups.items())}
    return out


WAITED_SHARE = 0.5
""":func:`span_summary`'s ``host_waited``: a stretch of at least :data:`WAITED_MIN_MS` host time
whose process CPU time was below this share of it."""
WAITED_MIN_MS = 0.5
LONGEST_SPANS = 12  # (span_summary's longest_cpu: how many)


def task_allocs_summary(rows: Sequence[tuple[int, int, int, int, int]]) -> dict[str, Any]:
    """The trainer's tasks (``CoServer.trainer_task_counts``: ``(watchdog_releases, watchdog_closed,
    device_allocs, device_frees, closed_sleeps)`` each, from ``TaskResult``): how many asked the
    driver for memory, and how the watchdog's releases (``COSERVE_TRAINER_RELEASE``: a stretch whose
    CPU stalled) fall between the tasks that did and those that did not, and between a gate the
    engine held closed (the GPU paused anyway) and an open one (the GPU idled for it); the sleeps
    behind a closed gate (``COSERVE_TRAINER_CLOSED_AHEAD``) summed, and the tasks with any."""
    allocating = [r for r in rows if r[2] > 0 or r[3] > 0]
    return {"tasks": len(rows), "with_device_allocs": len(allocating),
            "device_allocs": sum(r[2] for r in rows), "device_frees": sum(r[3] for r in rows),
            "watchdog_releases": sum(r[0] for r in rows), "watchdog_gate_closed": sum(r[1] for r in rows),
            "watchdog_in_allocating_tasks": sum(r[0] for r in allocating),
            "tasks_with_watchdog": sum(r[0] > 0 for r in rows),
            "closed_sleeps": sum(r[4] for r in rows), "tasks_with_closed_sleeps": sum(r[4] > 0 for r in rows)}


def span_summary(spans: list[tuple[int, int, float, float]], num_layers: int,
                 process_ms: list[float] | None = None, gc_ms: list[float] | None = None,
                 watchdog_releases: int | None = None, tasks: list[int] | None = None,
                 loss_roles: Sequence[str] | None = None, thread_ms: list[float] | None = None) -> dict[str, Any]:
    """The stretches between the trainer's boundaries (``TaskResult.spans``, GPU-side gate
    only), by where they start: ``start``, ``loss``, ``commit`` or ``layer#k`` (the k-th boundary
    of a layer: 0 the attention recompute, then the MLP's pieces, the last the attention
    backward): their GPU time (what a pause that comes during a stretch waits for) and their CPU
    time (``cpu_over_gpu``: the stretches whose queuing took longer than their GPU time, which left
    the GPU dry — their kernels trickle out as the CPU queues them; ``cpu_sum_ms``: the group's
    share of the trainer's host time). With ``process_ms``
    (``TaskResult.span_process_ms``, parallel to ``spans``; NaN where unknown): the CPU time the
    trainer's threads used in each (``proc_p50_ms`` / ``proc_p99_ms``) and ``host_waited``, the
    stretches whose host time was mostly not CPU work (:data:`WAITED_SHARE`): a lock, the GIL,
    the driver or the OS's scheduler, not Python and dispatch. With ``gc_ms``
    (``TaskResult.span_gc_ms``): ``gc_ms`` (the garbage collector's time summed over a group's
    stretches), ``gc_max_ms`` and ``gc_over_1ms`` (the stretches it held 1 ms or more).
    ``watchdog_releases``: the stretches ``COSERVE_TRAINER_RELEASE``'s watchdog released.
    ``loss_roles`` (:func:`coserve.trainer.backward.loss_stretch_roles`): ``loss_by_role``, the
    loss's stretches by what they compute (the LM head's GEMM pieces, the cross-entropy, the
    gradient's GEMM pieces), over every chunk. ``thread_ms`` (``TaskResult.span_thread_ms``): the
    queuing thread's own CPU time, in ``longest_cpu`` beside the process's (near the host time:
    that thread ran throughout; near the process's alone: another thread ran while it waited)."""
    if thread_ms is None or len(thread_ms) != len(spans):
        thread_ms = [math.nan] * len(spans)
    if process_ms is None or len(process_ms) != len(spans):
        process_ms = [math.nan] * len(spans)
    if gc_ms is None or len(gc_ms) != len(spans):
        gc_ms = [math.nan] * len(spans)
    groups: dict[str, list[tuple[float, float, float, float]]] = {}
    for (layer, ordinal, ms, cpu_ms), proc, gc in zip(spans, process_ms, gc_ms, strict=True):
        groups.setdefault(boundary_kind(layer, ordinal, num_layers), []).append((ms, cpu_ms, proc, gc))
    everything = [ms for _, _, ms, _ in spans]

    def gc_stats(values: list[float]) -> dict[str, Any]:
        return {"gc_ms": sum(values), "gc_max_ms": max(values), "gc_over_1ms": sum(v >= 1.0 for v in values)}

    def stats(rows: list[tuple[float, float, float, float]]) -> dict[str, Any]:
        gpu, cpu = [r[0] for r in rows], [r[1] for r in rows]
        out = {"n": len(rows), "p50_ms": percentile(gpu, 50), "p99_ms": percentile(gpu, 99), "max_ms": max(gpu),
               "cpu_p50_ms": percentile(cpu, 50), "cpu_p99_ms": percentile(cpu, 99), "cpu_max_ms": max(cpu),
               "cpu_sum_ms": sum(cpu), "cpu_over_gpu": sum(c > g for g, c, _, _ in rows)}
        known = [(c, p) for _, c, p, _ in rows if not math.isnan(p)]
        if known:
            procs = [p for _, p in known]
            out |= {"proc_p50_ms": percentile(procs, 50), "proc_p99_ms": percentile(procs, 99),
                    "host_waited": sum(c >= WAITED_MIN_MS and p < WAITED_SHARE * c for c, p in known)}
        collected = [g for *_, g in rows if not math.isnan(g)]
        if collected:
            out |= gc_stats(collected)
        return out

    out: dict[str, Any] = {
        "n": len(everything),
        "over_2ms": sum(ms > 2.0 for ms in everything),
        "cpu_over_gpu": sum(c > g for _, _, g, c in spans),
    }
    collected = [g for g in gc_ms if not math.isnan(g)]
    if collected:
        out |= gc_stats(collected)
    if watchdog_releases is not None:
        out["watchdog_releases"] = watchdog_releases
    # the stretches of the most host time, with what their host did (a full launch queue spins,
    # a collection holds the GIL, a sleep uses no CPU)
    # (``task``: the stretch's task as its row of the timeline's tasks, where ``tasks`` says)
    order = sorted(range(len(spans)), key=lambda i: -spans[i][3])[:LONGEST_SPANS]
    known_tasks = tasks is not None and len(tasks) == len(spans)
    out["longest_cpu"] = [{"at": boundary_kind(spans[i][0], spans[i][1], num_layers), "gpu_ms": spans[i][2],
                           "cpu_ms": spans[i][3], "proc_ms": process_ms[i], "thread_ms": thread_ms[i], "gc_ms": gc_ms[i],
                           **({"task": tasks[i]} if known_tasks and tasks is not None else {})} for i in order]
    out["by_start"] = {k: stats(v) for k, v in sorted(groups.items())}
    # the loss's stretches by their boundary's ordinal (counted from the task's first loss
    # boundary: with LOSS_GEMM_PIECES, which of a chunk's GEMM pieces, its cross-entropy or its
    # backward holds the tail)
    loss: dict[int, list[float]] = {}
    for layer, ordinal, ms, _ in spans:
        if layer == num_layers:
            loss.setdefault(ordinal, []).append(ms)
    if loss:
        out["loss_by_ordinal"] = {str(k): {"n": len(v), "p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99)}
                                  for k, v in sorted(loss.items())}
        if loss_roles:
            roles: dict[str, list[float]] = {}
            for k, v in sorted(loss.items()):
                roles.setdefault(loss_roles[k % len(loss_roles)], []).extend(v)
            out["loss_by_role"] = {r: {"n": len(v), "p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99)}
                                   for r, v in roles.items()}
    # the first layer after the loss by its stretches' ordinals beside the same stretches of the
    # other layers: sessions 44-45's longest pauses came with the trainer's GPU in that layer's
    # stretch 0, not behind its CPU (is that stretch's host time, or its GPU time, the long one?)
    first: dict[int, list[tuple[float, float]]] = {}
    rest: dict[int, list[tuple[float, float]]] = {}
    for layer, ordinal, ms, cpu_ms in spans:
        if 0 <= layer < num_layers:
            (first if layer == num_layers - 1 else rest).setdefault(ordinal, []).append((ms, cpu_ms))

    def by_ordinal(groups: dict[int, list[tuple[float, float]]]) -> dict[str, dict[str, Any]]:
        return {str(k): {"n": len(v), "p50_ms": percentile([g for g, _ in v], 50),
                         "p99_ms": percentile([g for g, _ in v], 99), "max_ms": max(g for g, _ in v),
                         "cpu_p50_ms": percentile([c for _, c in v], 50), "cpu_p99_ms": percentile([c for _, c in v], 99),
                         "cpu_max_ms": max(c for _, c in v)} for k, v in sorted(groups.items())}

    if first and num_layers > 1:
        out["first_layer_by_ordinal"] = by_ordinal(first)
        out["other_layers_by_ordinal"] = by_ordinal(rest)
    return out


def model_errors(log: Sequence[Any]) -> dict[str, Any]:
    """The latency model's relative error ``|predicted - measured| / measured`` per step key and
    over ``all`` of the :class:`~coserve.core.coserver.StepLogRow` rows in ``log`` (each step was
    predicted before the model observed it), as ``coserve bench`` reports it."""
    return latency_model_error([(key, predicted, measured) for key, _, predicted, measured, *_ in log]) or {}


def idle_replay(driver: InProcessDriver, session: FinetuneSession, arrivals: Sequence[Arrival],
                duration_s: float, settle_s: float = 60.0) -> Any:
    """The first ``duration_s`` seconds of ``arrivals`` with fine-tuning off: no FT rows are
    admitted (policy ``off``), the backward tasks in flight finish first (up to ``settle_s``), so
    that every step of the replay runs beside an idle trainer. Returns the driver's run."""
    co = session.coserver
    co.slo = dataclasses.replace(co.slo, policy="off")
    deadline = time.monotonic() + settle_s
    while co.backward_running and time.monotonic() < deadline:
        session.wait(0.05)
    if co.backward_running:
        logging.getLogger(__name__).warning("the trainer still runs a task after %.0f s: the idle replay's "
                                            "first steps run beside it", settle_s)
    window = [a for a in arrivals if a.time_s < duration_s]
    return driver.run(window, duration_s=duration_s, idle_wait=session.wait, drain_s=30.0)


def warm_replays(driver: InProcessDriver, session: FinetuneSession, slo: SLOConfig, arrivals: Sequence[Arrival],
                 duration_s: float, n: int) -> list[dict[str, Any]]:
    """``--warm-replays``: ``arrivals`` ``n`` times more with ``slo`` (fine-tuning back on after
    the idle replay), the latency model going on from where the runs before left it. Per replay:
    the model's error on its own steps (``first_step``: its first row of the step table), its
    SLO attainment and FT tokens/s."""
    co, out = session.coserver, []
    for _ in range(n):
        co.slo = slo
        first = len(co.step_log)
        run = driver.run(arrivals, duration_s=duration_s, ft_tokens=lambda: co.tokens_trained,
                         idle_wait=session.wait, drain_s=60.0)
        out.append({**model_errors(co.step_log[first:]), "first_step": first,
                    "attainment": attainment(run.records, slo.ttft_slo_s, slo.tpot_slo_s),
                    "requests": len(run.records), "duration_s": run.duration_s,
                    "ft_tokens_per_s": run.ft_tokens / run.duration_s})
    return out


def timeline(utilization: Sequence[tuple[float, float]], clocks_mhz: Sequence[float],
             task_timings: Sequence[tuple[float, ...]], task_shapes: Sequence[tuple[int, int, float, float, int, int]],
             origin: float, host: Sequence[Sequence[float | None]] = ()) -> dict[str, Any]:
    """What ran beside the steps, in seconds since ``origin`` (the step table's ``began_s``): the
    GPU's utilization and SM clock every 0.25 s (none where the device does not report them: the
    session-33 cold runs' first quarter ran noisier than the warm replay of the same arrivals,
    whatever the model's state, ``bench/latency_whole.py``) with, where ``host`` gives them
    (parallel lists: the share of the host's CPUs busy, the clock of the CPU the engine's thread
    was on and the CPUs' mean clock, in MHz; session 43's eager steps took 20-50 ms of host time
    for the same small batch, on one CPU), the host's; and each backward task's submission,
    result, trainer seconds and tokens (``task_timings``) with its samples, longest sample and
    longest stretch between two boundaries in host and GPU ms, CUDA allocations and sleeps behind
    the closed gate (``task_shapes``, parallel to it; admission fills tasks shortest-first, so a
    run's first tasks are not its later ones; a long stretch in a task that allocated may be the
    allocation waiting for a device that the gate holds)."""
    def at(values: Sequence[float | None], i: int, digits: int) -> float | None:
        v = values[i] if i < len(values) else None
        return None if v is None else round(v, digits)

    host = list(host) or [[], [], []]
    gpu = [[round(t, 3), u, at(clocks_mhz, i, 1), at(host[0], i, 4), at(host[1], i, 1), at(host[2], i, 1)]
           for i, (t, u) in enumerate(utilization)]

    def ms(v: float) -> float | None:
        return None if math.isnan(v) else round(v, 3)

    tasks = [[round(submitted - origin, 4), round(received - origin, 4), round(trainer_s, 4), tokens, samples, longest,
              ms(cpu), ms(gpu_ms), allocs, sleeps]
             for (submitted, received, trainer_s, tokens, *_), (samples, longest, cpu, gpu_ms, allocs, sleeps)
             in zip(task_timings, task_shapes, strict=True)]
    return {"gpu_columns": ["t_s", "utilization", "sm_clock_mhz", "host_cpu_busy", "engine_cpu_mhz", "cpu_mhz_mean"],
            "gpu": gpu,
            "task_columns": ["submitted_s", "received_s", "trainer_s", "tokens", "samples", "longest_tokens",
                             "longest_span_cpu_ms", "longest_span_gpu_ms", "device_allocs", "closed_sleeps"],
            "tasks": tasks}


def longest_steps(steps: list[tuple[Any, ...]], top: int) -> dict[str, list[dict[str, Any]]]:
    """The ``top`` longest replay steps of each kind, as dicts of :data:`STEP_COLUMNS`."""
    by_kind: dict[str, list[tuple[Any, ...]]] = {}
    for step in steps:
        by_kind.setdefault(str(step[STEP_COLUMNS.index("kind")]), []).append(step)
    col = STEP_COLUMNS.index("seconds")
    return {kind: [dict(zip(STEP_COLUMNS, s, strict=True)) for s in sorted(rows, key=lambda r: -r[col])[:top]]
            for kind, rows in by_kind.items()}


def ft_only_layer(steps: list[tuple[Any, ...]], num_layers: int) -> dict[str, Any]:
    """The completed (not interrupted) FT-only steps of a run (the probe run's, between its
    sparse requests: the trainer paused for each, as for every step with FT rows): how many, their
    median FT tokens and time, and that time over the layers — one layer of the FT-only steps that
    arrivals actually meet, beside the synthetic 1,024-token step's (``one_layer_ms``), which
    ranged 0.83–1.68 ms on one commit's runs (sessions 20–23)."""
    kind, col, tok = (STEP_COLUMNS.index(c) for c in ("kind", "seconds", "ft_tokens"))
    done = [s for s in steps if s[kind] == "ft-only"]
    if not done:
        return {"n": 0, "tokens_p50": None, "step_p50_ms": None, "one_layer_ms": None}
    step_ms = percentile([s[col] for s in done], 50) * 1e3
    return {"n": len(done), "tokens_p50": percentile([s[tok] for s in done], 50), "step_p50_ms": step_ms,
            "one_layer_ms": step_ms / num_layers}


def check_summary(checks: list[CheckPoint]) -> dict[str, Any]:
    """One interrupted FT-only step's interruption points (``CoServer.interrupted_checks``): how
    many, the first and last (ms since its plan began), the longest gap between two and where it
    ended, and in that gap: the CPU's wait for the GPU, the host thread's CPU time (the rest of
    the gap it was blocked or descheduled), the garbage collector's time and the CUDA allocations
    (where counted); the CPU's wait for the GPU in all."""
    if not checks:
        return {"points": 0}
    times = [c.at_s for c in checks]
    gaps = [(b - a, i + 1) for i, (a, b) in enumerate(zip(times, times[1:], strict=False))] or [(times[0], 0)]
    gap, at = max(gaps)
    end, start = checks[at], checks[at - 1] if at > 0 else None
    allocs = (end.device_allocs - start.device_allocs
              if start is not None and end.device_allocs is not None and start.device_allocs is not None else None)
    return {"points": len(checks), "first": checks[0].where, "first_ms": times[0] * 1e3, "last_ms": times[-1] * 1e3,
            "longest_gap_ms": gap * 1e3, "longest_gap_before": end.where,
            "gpu_wait_in_gap_ms": end.gpu_wait_s * 1e3,
            "cpu_in_gap_ms": (end.cpu_s - (start.cpu_s if start is not None else 0.0)) * 1e3,
            "gc_in_gap_ms": (end.gc_s - (start.gc_s if start is not None else 0.0)) * 1e3,
            "device_allocs_in_gap": allocs,
            "gpu_wait_ms": sum(c.gpu_wait_s for c in checks) * 1e3}


class Layer0Profile:
    """cProfile over the host's work between an FT-only step's "before layer 0" and "within
    layer 0" interruption points (``--profile-layer0``): sessions 16-17 saw 2-16 ms of host CPU
    time there, against ~0.3 ms for any later layer of the step."""

    def __init__(self, co: Any) -> None:
        self.profile = cProfile.Profile()
        self.steps = 0
        self._on = False
        inner = co._interruption_point

        def point(activation: torch.Tensor | None, where: str) -> None:
            if self._on:
                self.profile.disable()
                self._on = False
            inner(activation, where)  # (raises Interrupted: the profile is off already)
            if where == "before layer 0":
                self.steps += 1
                self._on = True
                self.profile.enable()

        co._interruption_point = point

    def report(self, top: int = 40) -> dict[str, Any]:
        if self._on:
            self.profile.disable()
            self._on = False
        text = {}
        for order in ("cumulative", "tottime"):
            out = io.StringIO()
            pstats.Stats(self.profile, stream=out).sort_stats(order).print_stats(top)
            text[order] = out.getvalue()
        return {"steps": self.steps, **text}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    add_trace_args(p, duration=60.0)
    p.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    p.add_argument("--tpot-slo-ms", type=float, default=100.0)
    p.add_argument("--backward-tokens", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--device", default="cuda")
    p.add_argument("--attention-backend", default="triton", choices=["torch", "triton"])
    p.add_argument("--no-mps", action="store_true")
    p.add_argument("--early-pause-ms", type=float, default=0.0,
                   help="SLOConfig.early_pause_s: pause the backward this long before a decode step's predicted "
                        "end when a request arrived during it (0: off)")
    p.add_argument("--hold-pause", action="store_true",
                   help="SLOConfig.hold_pause: the backward stays paused between steps while prompt tokens are queued")
    p.add_argument("--trainer-sm-share", type=int, default=None,
                   help="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of the trainer process")
    p.add_argument("--no-reference", action="store_true", help="skip the inference-only run")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads of the engine process (0: torch's default)")
    p.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="steps with prefill or FT rows through the piecewise CUDA graphs")
    p.add_argument("--probe-requests", type=int, default=40,
                   help="after the replay, this many single short requests, one every ~0.5 s, each arriving "
                        "while the engine runs FT-only steps: the interruption delay they see")
    p.add_argument("--ft-only-mid-layer-check", action="store_true",
                   help="SLOConfig.ft_only_mid_layer_check: FT-only steps eager, with a second check inside each layer")
    p.add_argument("--profile-layer0", action="store_true",
                   help="cProfile the host between each FT-only step's first two layer checks (Layer0Profile)")
    p.add_argument("--stream-priority", default="default", choices=["default", "high"],
                   help="the engine's steps on the GPU's highest-priority stream, the trainer a below-normal MPS "
                        "client (EngineConfig.stream_priority; not measured on the GPU before)")
    p.add_argument("--idle-replay-s", type=float, default=20.0,
                   help="after the probes, replay the trace's first this many seconds with fine-tuning off "
                        "(the trainer idle): the latency model's error without the trainer (0: skip)")
    p.add_argument("--warm-replays", type=int, default=0,
                   help="after the trainer-idle replay, replay the trace window this many times more with "
                        "fine-tuning back on and the latency model as the runs before left it (windows, "
                        "levels: what a server restarted with --latency-state goes on from): the error on "
                        "these steps, none of which the model had fitted (latency_model_error_warm)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    mps = False if args.no_mps or not args.device.startswith("cuda") else start_mps_daemon()
    config = SHAPES[args.shape]
    work = Path(tempfile.mkdtemp(prefix="slo_bench_"))
    model_dir = write_model_dir(work / "model", config)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(preset_path("tiny") / name, model_dir / name)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    engine = LLMEngine(EngineConfig(model=str(model_dir), load_format="dummy", dtype=dtype, device=args.device,
                                    num_training_slots=1, max_lora_rank=16, max_model_len=8192,
                                    max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=256,
                                    attention_backend=args.attention_backend, lora_backend=args.attention_backend,
                                    prefill_graphs=args.prefill_graphs, stream_priority=args.stream_priority))
    scaling = trace_scaling(args)
    every = load_trace(args.trace, scaling)
    start = busiest_window(every, args.duration)
    arrivals = load_trace(args.trace, scaling, start_s=start, duration_s=args.duration)
    slo = SLOConfig(ttft_slo_s=args.ttft_slo_ms / 1e3, tpot_slo_s=args.tpot_slo_ms / 1e3, hold_pause=args.hold_pause,
                    early_pause_s=args.early_pause_ms / 1e3,
                    ft_only_mid_layer_check=args.ft_only_mid_layer_check)
    vocab = min(1024, config["vocab_size"])
    spec = FinetuneSpec(
        data=ft_dataset(work / "ft.jsonl", 4000, (256, 1024), vocab), output=work / "out",
        lora=LoRAConfig(rank=16, alpha=32), optim=OptimConfig(lr=1e-4),
        coserve=CoServeConfig(backward_tokens=args.backward_tokens, max_seq_len=1024, epochs=100, seed=0),
        slo=slo, save_every=0, epoch_checkpoints=0, calibrate=False, trainer_sm_share=args.trainer_sm_share,
    )
    driver = InProcessDriver(engine, seed=0)
    driver.run(arrivals[:16], duration_s=5.0, drain_s=30.0)  # warm-up (kernels, allocator)
    reference = None if args.no_reference else driver.run(arrivals, duration_s=args.duration, drain_s=60.0)
    session = FinetuneSession(engine, spec)
    t = time.perf_counter()
    n_cal = engine.calibrate(repeats=2)
    calibration_s = time.perf_counter() - t
    co = session.coserver
    # (the calibrated coefficients, so that bench/latency_fit.py replays from them rather than
    # recovering them from the first predictions: a table whose first steps all carried the same
    # number of decodes leaves the per-decode and constant terms apart unidentified)
    calibrated = {k: [float(f"{c:.9g}") for c in v] for k, v in co.latency.state_dict()["calibration"].items()}
    num_layers = engine.model_config.num_layers
    # NOTE: the yardstick of the FT-only goal, a 1,024-token FT-only step, in the mode the serving
    # engine runs FT-only steps in (through the prefill graphs where it has them); until session 23
    # it ran eagerly (BatchSpec's default), a host-bound path whose time followed the host's speed
    # (26.6-53.6 ms over sessions 20-23) and that no FT-only step of the replay took
    mode = "graph" if engine.runner.ft_graph_tokens and not co.ft_rows_force_eager(ft_only=True) else "eager"
    ft_only_samples = [engine.run_batch(BatchSpec(ft_lens=(1024,), mode=mode)) for _ in range(3)]
    ft_only_step = min(ft_only_samples)
    ft_only_eager = min(engine.run_batch(BatchSpec(ft_lens=(1024,))) for _ in range(3))
    co.track = True
    # the GPU's utilization and SM clock through every replay, lined up with the steps and tasks
    sampler = UtilizationSampler(torch.device(args.device), every_s=0.25, watch_tid=threading.get_native_id())
    origin = time.monotonic()
    sampler.start()
    layer0 = Layer0Profile(co) if args.profile_layer0 else None
    result = driver.run(arrivals, duration_s=args.duration, ft_tokens=lambda: co.tokens_trained,
                        idle_wait=session.wait, drain_s=60.0)
    replay_tasks = task_breakdown(list(co.task_timings), result.duration_s)
    # Sparse arrivals after the replay: with no other request in the engine it runs FT-only
    # steps, so each of these arrives in one (a trace rarely leaves the engine that idle).
    probes = probe_arrivals(args.probe_requests, seed=1)
    probe_run = driver.run(probes, duration_s=probes[-1].time_s + 0.5 if probes else 0.0,
                           ft_tokens=lambda: co.tokens_trained, idle_wait=session.wait, drain_s=10.0)
    first_idle = len(co.step_log)
    idle_run = idle_replay(driver, session, arrivals, args.idle_replay_s) if args.idle_replay_s > 0 else None
    first_warm = len(co.step_log)
    warm = warm_replays(driver, session, slo, arrivals, args.duration, args.warm_replays)
    utilization = sampler.stop()
    session.close()

    errors = model_errors(co.step_log[:first_idle])
    ft_only = [d for kind, d in result.entry_delays if kind.startswith("ft-only")]
    ft_only_probe = [d for kind, d in probe_run.entry_delays if kind.startswith("ft-only")]
    figures = {
        "mps": mps,
        "calibration": {"batches": n_cal, "seconds": calibration_s, "coefficients": calibrated},
        "latency_model_error": errors,
        "trainer_pause": pause_delays(co.pause_windows, co.pause_observed, co.pause_observed_layers,
                                      num_layers, co.pause_observed_lags or None,
                                      co.pause_window_at if co.pause_observed_lags else None,
                                      co.pause_observed_polled or None, co.pause_observed_idle_ms or None,
                                      co.pause_window_step_start,
                                      window_step_ratios(co.pause_window_step_start, co.step_log), origin),
        "early_pause": {"lead_ms": args.early_pause_ms, "taken_over": co.early_pauses,
                        "lifted": co.early_pauses_lifted},
        "trainer_spans": (span_summary(co.trainer_spans, num_layers, co.trainer_span_process_ms,
                                       co.trainer_span_gc_ms, co.trainer_watchdog_releases, co.trainer_span_tasks,
                                       loss_stretch_roles(engine.model_config.vocab_size,
                                                          engine.model_config.hidden_size),
                                       co.trainer_span_thread_ms)
                          if co.trainer_spans else None),
        "trainer_tasks": task_allocs_summary(co.trainer_task_counts) if co.trainer_task_counts else None,
        "ft_only_interruption": {
            "requests": len(ft_only), "interrupted_steps": co.num_interrupted,
            "delay_p50_ms": percentile(ft_only, 50) * 1e3, "delay_p99_ms": percentile(ft_only, 99) * 1e3,
            "ft_only_step_1024_tokens_ms": ft_only_step * 1e3,
            "ft_only_step_1024_samples_ms": [t * 1e3 for t in ft_only_samples], "ft_only_step_mode": mode,
            "ft_only_step_1024_eager_ms": ft_only_eager * 1e3,
            "probe_ft_only_steps": ft_only_layer(probe_run.steps, num_layers),
            # where an arrival's wait to enter can come from: the replay's longest steps by kind
            # (STEP_COLUMNS) and its seconds per step kind and in idle waits
            "longest_steps": longest_steps(result.steps, 5),
            "step_seconds": result.step_seconds, "step_counts": result.step_counts,
            "one_layer_ms": ft_only_step / num_layers * 1e3,
            # each interrupted step (the replay's, then the probes'): its interruption points, the
            # longest gap between two of them and how much of it the CPU waited for the GPU
            "interrupted_checks": [check_summary(c) for c in co.interrupted_checks],
            # the sparse requests after the replay: how many arrived during an FT-only step
            "probe": {"requests": len(probes), "during_ft_only": len(ft_only_probe),
                      "delay_p50_ms": percentile(ft_only_probe, 50) * 1e3,
                      "delay_p99_ms": percentile(ft_only_probe, 99) * 1e3,
                      "delay_max_ms": max(ft_only_probe, default=float("nan")) * 1e3},
        },
        "layer0_profile": layer0.report() if layer0 is not None else None,
        "inference_only": None if reference is None else {
            "attainment": attainment(reference.records, slo.ttft_slo_s, slo.tpot_slo_s),
            **latency_summary(reference.records),
        },
        # steps with fine-tuning off: each key's error, the steps' kinds as the replay's
        "latency_model_error_trainer_idle": None if idle_run is None else {
            **model_errors(co.step_log[first_idle:first_warm]), "first_step": first_idle,
            "attainment": attainment(idle_run.records, slo.ttft_slo_s, slo.tpot_slo_s),
            "requests": len(idle_run.records), "duration_s": idle_run.duration_s},
        # each warm replay (--warm-replays): the latency model's error on its steps, predicted by
        # the model that the replays before had refitted (the step table goes on with them)
        "latency_model_error_warm": warm or None,
        "warm_first_step": first_warm if warm else None,
        "steps": step_table(co.step_log, origin),
        "timeline": timeline(utilization, sampler.clocks_mhz, co.task_timings, co.task_shapes, origin,
                             (sampler.host_cpu_busy, sampler.watched_cpu_mhz, sampler.cpu_mhz_mean)),
        "replay": {
            "requests": len(result.records),
            "attainment": attainment(result.records, slo.ttft_slo_s, slo.tpot_slo_s),
            **latency_summary(result.records),
            "ft_tokens_per_s": result.ft_tokens / result.duration_s,
            "optimizer_steps": co.steps_done,
            # where the trainer's time per task went during the replay (trainer CPU time among it)
            "backward_tasks": replay_tasks,
        },
    }
    out = {
        **provenance(),
        "config": {"shape": args.shape, "trace": Path(args.trace).name, "window_start_s": start,
                   "duration_s": args.duration, "scaling": vars(scaling), "slo": vars(slo),
                   "backward_tokens": args.backward_tokens, "max_num_batched_tokens": args.max_num_batched_tokens,
                   "trainer_sm_share": args.trainer_sm_share,
                   "engine_sm_share": share_of_this_process(),  # (None: the whole GPU)
                   "prefill_graphs": args.prefill_graphs, "threads": torch.get_num_threads(),
                   "warm_replays": args.warm_replays,
                   "trainer_phases": list(PHASES_IN_USE), "lone_gap_s": LONE_GAP_S, "decode_kv": DECODE_KV,
                   "decode_kv_share": DECODE_KV_SHARE,
                   "lora": {"rank": 16, "targets": list(LoRAConfig().target_modules)}},
        "figures": figures,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps(figures, indent=1, default=str))


if __name__ == "__main__":
    main()

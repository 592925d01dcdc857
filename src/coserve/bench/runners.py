"""One runner per kind of configuration: each replays the same arrivals on the same engine.

A runner leaves the engine as it found it: no request in flight, no co-server attached, no
trainer process running. Every trainer is warmed up (its process started and its first
optimizer step done) before the replay clock starts, so that no configuration is charged for
process start-up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch

from coserve.bench.configs import RunConfig, RunKind
from coserve.bench.metrics import SLO
from coserve.bench.replay import InProcessDriver, ReplayResult, Snapshot
from coserve.bench.utilization import UtilizationSampler
from coserve.bench.workload import Arrival
from coserve.core.config import CoServeConfig, LoRAConfig, OptimConfig, SLOConfig
from coserve.core.coserver import StepLogRow
from coserve.core.finetune import load_dataset
from coserve.core.latency import LONE_GAP_S, Chunk, StepFeatures
from coserve.engine.llm_engine import LLMEngine
from coserve.models.peft_adapter import new_lora_adapter
from coserve.server.finetune import FinetuneSession, FinetuneSpec
from coserve.trainer.split import SplitTrainer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingSetup:
    """What every fine-tuning configuration trains, and how."""

    data: Path
    max_seq_len: int
    backward_tokens: int
    lora: LoRAConfig
    optim: OptimConfig
    naive_tokens: int
    split_mps_percentage: int
    trainer_sm_share: int | None = None  # the co-serving trainer's MPS share of the SMs
    trainer_threads: int = 0
    warmup_timeout_s: float = 300.0
    save_mlp_activations: bool = False


@dataclass
class BenchContext:
    """The state the runs share: one engine, one driver, one set of arrivals, and the latency
    model's calibrated state (fitted by the first co-serving run, loaded by every later one)."""

    engine: LLMEngine
    driver: InProcessDriver
    arrivals: tuple[Arrival, ...]
    duration_s: float
    drain_s: float
    slo: SLOConfig
    training: TrainingSetup
    work: Path
    sampler: UtilizationSampler
    seed: int = 0
    latency_state: dict[str, Any] | None = None
    calibration: dict[str, Any] | None = None
    # (start s, end s) of replay time to run torch.profiler over in every configuration
    profile_window: tuple[float, float] | None = None
    # the configurations' prefill graphs where they do not say (--prefill-graphs)
    prefill_graphs: bool = False


def use_prefill_graphs(ctx: BenchContext, config: RunConfig) -> bool:
    """Switch the engine's piecewise prefill graphs as ``config`` asks (else as the engine was
    started); returns whether its steps will use them."""
    return ctx.engine.runner.use_prefill_graphs(config.uses_prefill_graphs(ctx.prefill_graphs))


@dataclass(frozen=True)
class RunOutcome:
    """What one configuration's replay produced. ``optimizer_steps`` counts the replay only (not
    the warm-up); ``loss_first`` / ``loss_last``: the mean loss of the first and last optimizer
    step of the replay (split: of the last step before the replay, sampled at its start, and of
    the last one); ``prediction_errors`` are ``(key, predicted s, measured s)`` per step, each
    predicted before the model observed it; ``extra``: figures of one kind only."""

    config: RunConfig
    replay: ReplayResult
    optimizer_steps: int = 0
    prediction_errors: tuple[tuple[str, float, float], ...] = ()
    gpu_utilization: tuple[tuple[float, float], ...] = ()
    gpu_clock_mhz: tuple[float, ...] = ()
    host_cpu_busy: tuple[float, ...] = ()  # with each utilization sample (UtilizationSampler)
    started_unix_s: float | None = None
    cuda_allocator: dict[str, float] | None = None
    profile: dict[str, str] | None = None
    loss_first: float | None = None
    loss_last: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


Runner = Callable[[BenchContext, RunConfig], RunOutcome]


class Replayed(NamedTuple):
    """A replay's result and what was sampled around it."""

    result: ReplayResult
    util: tuple[tuple[float, float], ...]
    clocks: tuple[float, ...]
    allocator: dict[str, float] | None
    profile: dict[str, str] | None = None
    host_cpu_busy: tuple[float, ...] = ()
    started_unix_s: float | None = None

    def measures(self) -> dict[str, Any]:
        """The :class:`RunOutcome` fields sampled around the replay."""
        return {"gpu_utilization": self.util, "gpu_clock_mhz": self.clocks, "host_cpu_busy": self.host_cpu_busy,
                "started_unix_s": self.started_unix_s, "cuda_allocator": self.allocator, "profile": self.profile}


class WindowProfiler:
    """torch.profiler over a window of replay time, driven by the replay's tick (every 0.1 s):
    it starts at the first tick at or after ``start`` and stops at the first at or after ``end``
    (or when the replay ends). ``tables``: the operators by self CPU time and, on CUDA, by self
    CUDA time — to compare the same window of two replays."""

    def __init__(self, window: tuple[float, float], cuda: bool, rows: int = 25) -> None:
        self.start_s, self.end_s = window
        self.cuda = cuda
        self.rows = rows
        self._prof: Any = None
        self.span: tuple[float, float] | None = None
        self.tables: dict[str, str] | None = None

    def tick(self, snapshot: Snapshot) -> None:
        if self._prof is None and self.tables is None and snapshot.t >= self.start_s:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            try:
                prof = profile(activities=activities)
                prof.__enter__()
            except Exception as e:  # no profiler, no tables: the replay goes on
                logger.warning("profile window: the profiler did not start (%s: %s)", type(e).__name__, e)
                self.tables = {}
                return
            self._prof = prof
            self.span = (snapshot.t, snapshot.t)
        elif self._prof is not None and snapshot.t >= self.end_s:
            self.stop(snapshot.t)

    def stop(self, t: float | None = None) -> None:
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        try:  # a profiler failure loses its tables, never the configuration's figures
            prof.__exit__(None, None, None)
            if self.span is not None and t is not None:
                self.span = (self.span[0], t)
            averages = prof.key_averages()
            tables = {"self_cpu": averages.table(sort_by="self_cpu_time_total", row_limit=self.rows)}
            if self.cuda:
                tables["self_cuda"] = averages.table(sort_by="self_device_time_total", row_limit=self.rows)
            self.tables = tables
        except Exception as e:
            logger.warning("profile window: no tables (%s: %s)", type(e).__name__, e)


# CUDA caching-allocator counters compared before and after a replay: cudaMalloc / cudaFree calls
# (segments) and allocations retried after freeing the cache; each of those synchronizes the
# device, in the middle of a step
ALLOCATOR_COUNTERS = {"device_allocs": "segment.all.allocated", "device_frees": "segment.all.freed",
                      "alloc_retries": "num_alloc_retries"}


def _allocator_counters(device: torch.device) -> dict[str, float] | None:
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return {name: float(stats.get(key, 0)) for name, key in ALLOCATOR_COUNTERS.items()} | {
        "reserved_gib": stats.get("reserved_bytes.all.current", 0) / 2**30
    }


def _replay(
    ctx: BenchContext,
    ft_tokens: Callable[[], int] | None = None,
    idle_wait: Callable[[float], None] | None = None,
) -> Replayed:
    device = ctx.engine.runner.device
    before = _allocator_counters(device)
    profiler = (WindowProfiler(ctx.profile_window, device.type == "cuda")
                if ctx.profile_window is not None else None)
    ctx.sampler.start()
    try:
        result = ctx.driver.run(
            ctx.arrivals,
            duration_s=ctx.duration_s,
            ft_tokens=ft_tokens,
            idle_wait=idle_wait,
            drain_s=ctx.drain_s,
            slo=SLO(ctx.slo.ttft_slo_s, ctx.slo.tpot_slo_s),
            tick=profiler.tick if profiler is not None else None,
            tick_every_s=0.1 if profiler is not None else 1.0,
        )
    finally:
        util = tuple(ctx.sampler.stop())
        if profiler is not None:
            profiler.stop()
    after = _allocator_counters(device)
    allocator = None
    if before is not None and after is not None:
        allocator = {k: after[k] - before[k] for k in ALLOCATOR_COUNTERS}
        allocator["reserved_gib_start"], allocator["reserved_gib_end"] = (
            before["reserved_gib"], after["reserved_gib"])
    profile = None
    if profiler is not None and profiler.tables is not None and profiler.span is not None:
        profile = {"window_s": f"{profiler.span[0]:.1f}-{profiler.span[1]:.1f}", **profiler.tables}
    return Replayed(result, util, tuple(ctx.sampler.clocks_mhz), allocator, profile,
                    tuple(ctx.sampler.host_cpu_busy), ctx.sampler.started_unix_s)


def run_inference(ctx: BenchContext, config: RunConfig) -> RunOutcome:
    """The engine alone."""
    graphs = use_prefill_graphs(ctx, config)
    r = _replay(ctx)
    return RunOutcome(config, r.result, **r.measures(), extra={"prefill_graphs": graphs})


def _session_spec(ctx: BenchContext, config: RunConfig) -> FinetuneSpec:
    t = ctx.training
    return FinetuneSpec(
        data=t.data,
        output=ctx.work / config.name,
        lora=t.lora,
        optim=t.optim,
        coserve=CoServeConfig(
            backward_tokens=t.backward_tokens, max_seq_len=t.max_seq_len, epochs=1000, seed=ctx.seed,
            save_mlp_activations=t.save_mlp_activations,
        ),
        slo=replace(
            ctx.slo,
            policy=config.policy,
            interrupt_ft_only=config.interrupt_ft_only,
            pause_prefill=config.pause_prefill,
            hold_pause=config.hold_pause,
            naive_tokens=config.naive_tokens or t.naive_tokens,
        ),
        trainer_threads=t.trainer_threads,
        trainer_sm_share=config.trainer_share or t.trainer_sm_share,
        calibrate=False,
        save_every=0, epoch_checkpoints=0,
    )


def _warm_up(ctx: BenchContext, session: FinetuneSession) -> None:
    """FT-only steps until the trainer completed its first optimizer step."""
    co = session.coserver
    deadline = time.monotonic() + ctx.training.warmup_timeout_s
    while co.steps_done == 0:
        if time.monotonic() > deadline:
            logger.warning(
                "trainer warm-up: no optimizer step within %.0fs", ctx.training.warmup_timeout_s
            )
            return
        ctx.engine.step()
        if ctx.engine.last_step_kind == "idle":
            session.wait(0.05)


def run_coserve(ctx: BenchContext, config: RunConfig) -> RunOutcome:
    """The engine with a co-server under ``config.policy``; the first such run calibrates the
    latency model, every run starts its replay from that calibrated state. Where the engine
    has prefill graphs, the session starts with them on (its training adapter's graphs are
    captured then, and the calibration fits both their set and the eager one), and the run
    then takes them as ``config`` asks."""
    ctx.engine.runner.use_prefill_graphs(True)
    session = FinetuneSession(ctx.engine, _session_spec(ctx, config))
    try:
        co = session.coserver
        if ctx.latency_state is None:
            start = time.perf_counter()
            batches = ctx.engine.calibrate()
            ctx.calibration = {"batches": batches, "seconds": time.perf_counter() - start}
            ctx.latency_state = co.latency.state_dict(online=False)
        graphs = use_prefill_graphs(ctx, config)
        _warm_up(ctx, session)
        co.latency.load_state_dict(ctx.latency_state)
        co.task_timings.clear()
        co.task_shapes.clear()  # (parallel to task_timings)
        co.step_log.clear()
        co.admission_counts.clear()
        co.track = True
        steps, interrupted, logged = co.steps_done, co.num_interrupted, len(session.history)
        r = _replay(ctx, ft_tokens=lambda: co.tokens_trained, idle_wait=session.wait)
        replay = r.result
        losses = [h.loss for h in session.history[logged:] if h.loss is not None]
        return RunOutcome(
            config,
            replay,
            optimizer_steps=co.steps_done - steps,
            prediction_errors=tuple((key, p, m) for key, _, p, m, *_ in co.step_log),
            **r.measures(),
            loss_first=losses[0] if losses else None,
            loss_last=losses[-1] if losses else None,
            extra={
                "prefill_graphs": graphs,
                "interrupted_steps": co.num_interrupted - interrupted,
                "trainer_restarts": co.num_restarts,
                "backward_tasks": task_breakdown(co.task_timings, replay.duration_s),
                "admission": {f"{kind}:{outcome}": n for (kind, outcome), n in sorted(co.admission_counts.items())},
                "steps": step_table(co.step_log),
            },
        )
    finally:
        session.close()


def task_breakdown(
    timings: Sequence[tuple[float, float, float, int, float, float, float]], duration_s: float
) -> dict[str, float] | None:
    """Where the backward tasks' time went: ``tasks``, mean ``tokens`` per task; means of
    ``trainer_s`` (the worker's own time per task, pauses included), of it ``paused_s`` (paused
    for inference) and ``gpu_wait_s`` (outside pauses, waiting for the GPU at layer boundaries),
    ``cpu_s`` (the CPU time its thread used) and ``turnaround_s`` (submitted to result taken in
    by the engine); ``trainer_busy_fraction`` (summed trainer time over the replay's duration)."""
    if not timings:
        return None
    n = len(timings)
    return {
        "tasks": float(n),
        "tokens": sum(t[3] for t in timings) / n,
        "trainer_s": sum(t[2] for t in timings) / n,
        "paused_s": sum(t[4] for t in timings) / n,
        "gpu_wait_s": sum(t[5] for t in timings) / n,
        "cpu_s": sum(t[6] for t in timings) / n,
        "turnaround_s": sum(t[1] - t[0] for t in timings) / n,
        "trainer_busy_fraction": sum(t[2] for t in timings) / max(duration_s, 1e-9),
    }


def step_table(log: Sequence[StepLogRow], origin: float | None = None) -> dict[str, Any]:
    """The replay's steps as rows of :data:`STEP_TABLE_COLUMNS` (:class:`StepLogRow`'s fields:
    regressors in ``coserve.core.latency.TERMS[form]`` order; rows: the step's prefill chunks and
    FT rows; trainer_at: the boundary ``[layer, ordinal]`` the trainer's GPU had passed last when
    the step began, null between tasks or without the GPU-side gate; event_timed: its time came
    from the GPU's events, for a step that samples nothing, not from the host,
    ``coserve.engine.step_clock``; chunks: each inference chunk's ``[tokens, cached context]``;
    schedule_s / enqueue_s: the host's seconds planning the step and queuing its device work;
    planned_s: its host seconds up to admission's decision, known then and part of predicted_s,
    the latency model pricing the rest; gpu_s: the device's seconds between two events around the
    step's forward, where the host timed it, ``coserve.engine.llm_engine.StepStats.forward_gpu_s``;
    gap_s: the host's seconds from the end of the step before to this one's start, how long the
    GPU was left to the trainer or idle before it; began_s: its start in seconds since ``origin``,
    a ``time.monotonic()``, null without one; decode_kv_max: its longest decode row's KV tokens;
    host_cpu: the CPU the engine's thread was on when the step was observed, its end but for a late-timed
    step, null where not told, since session 38; enqueue_cpu_s: that thread's CPU time during
    enqueue_s, since session 43: below it, the thread waited or was descheduled; gc_s: Python's
    garbage collector's seconds in the step, from its plan to its end, null for a late-timed one),
    6 significant digits: enough to refit the latency model offline, to try forms with other
    terms, to see whether a busy step's time follows what the trainer's kernels were doing, and
    whether a step was bound by its host."""

    def g(v: float | None) -> float | None:
        return None if v is None else float(f"{v:.6g}")

    return {
        "columns": list(STEP_TABLE_COLUMNS),
        "rows": [[r.key, g(r.predicted_s), g(r.measured_s), [g(v) for v in r.regressors], list(r.rows),
                  list(r.trainer_at) if r.trainer_at is not None else None, r.late,
                  [list(c) for c in r.chunks], r.decodes, g(r.schedule_s), g(r.enqueue_s), g(r.planned_s), g(r.gpu_s),
                  g(r.gap_s), None if origin is None or r.began_s is None else round(r.began_s - origin, 6),
                  r.decode_kv_max, r.host_cpu, g(r.enqueue_cpu_s), g(r.gc_s)]
                 for r in log],
    }


STEP_TABLE_COLUMNS = ("key", "predicted_s", "measured_s", "regressors", "rows", "trainer_at", "event_timed",
                      "chunks", "decodes", "schedule_s", "enqueue_s", "planned_s", "gpu_s", "gap_s", "began_s",
                      "decode_kv_max", "host_cpu", "enqueue_cpu_s", "gc_s")


def row_lone(row: Sequence[Any], without_gap: bool = False) -> bool:
    """A step-table row's ``StepFeatures.lone`` (a prompt with no decodes and no FT rows after
    ``LONE_GAP_S`` of idle host, by its ``gap_s``). A row without ``gap_s`` (tables before
    session 28) is lone for ``without_gap`` if the rest holds, else not (what the server knew)."""
    rows, decodes, gap = (STEP_TABLE_COLUMNS.index(c) for c in ("rows", "decodes", "gap_s"))
    idle = row[gap] if len(row) > gap else None
    if len(row) <= decodes or not row[0].startswith("prefill/") or (idle is None and not without_gap):
        return False
    prefills, ft_rows = row[rows]
    return StepFeatures(chunks=(Chunk(1),) * prefills, ft_lens=(1,) * ft_rows, num_decodes=row[decodes],
                        idle_before_s=LONE_GAP_S if idle is None else idle).lone


def row_mix(row: Sequence[Any]) -> bool:
    """A step-table row's ``StepFeatures.short_context_mix``, from its chunks and FT tokens (a row
    without chunks, of tables before session 23, is none)."""
    chunks = STEP_TABLE_COLUMNS.index("chunks")
    if len(row) <= chunks or not row[0].startswith("prefill/") or not row[chunks]:
        return False
    ft_tokens = int(row[STEP_TABLE_COLUMNS.index("regressors")][2])  # (g_ft's regressor: the FT tokens)
    return StepFeatures(chunks=tuple(Chunk(int(n), int(c)) for n, c in row[chunks]),
                        ft_lens=(ft_tokens,) if ft_tokens else ()).short_context_mix


def run_split(ctx: BenchContext, config: RunConfig) -> RunOutcome:
    """The engine alone beside a :class:`SplitTrainer` on the same samples and adapter setup."""
    engine = ctx.engine
    graphs = use_prefill_graphs(ctx, config)
    t = ctx.training
    assert engine.tokenizer is not None
    vocab = min(engine.tokenizer.vocab_size, engine.model_config.vocab_size)
    dataset = load_dataset(t.data, engine.tokenizer, max_seq_len=t.max_seq_len, vocab_size=vocab)
    model_cfg = engine.model_config
    adapter = new_lora_adapter(
        num_layers=model_cfg.num_layers,
        shapes=model_cfg.linear_shapes(),
        rank=t.lora.rank,
        alpha=t.lora.alpha,
        target_modules=t.lora.target_modules,
        use_rslora=t.lora.use_rslora,
        seed=ctx.seed,
    )
    trainer = SplitTrainer(
        engine.model,
        adapter,
        dataset.samples,
        backward_tokens=t.backward_tokens,
        optim=t.optim,
        dropout=t.lora.dropout,
        seed=ctx.seed,
        num_threads=t.trainer_threads,
        mps_percentage=config.split_share or t.split_mps_percentage,
    )
    try:
        if not trainer.wait_steps(1, t.warmup_timeout_s):
            logger.warning("split trainer: no optimizer step within %.0fs", t.warmup_timeout_s)
        steps, loss_first = trainer.steps_done, trainer.last_loss
        r = _replay(ctx, ft_tokens=lambda: trainer.tokens_trained)
        replay = r.result
        trainer.check()
        return RunOutcome(
            config,
            replay,
            optimizer_steps=trainer.steps_done - steps,
            **r.measures(),
            loss_first=loss_first,
            loss_last=trainer.last_loss,
            extra={"mps_share_percent": trainer.mps_share, "prefill_graphs": graphs},
        )
    finally:
        trainer.close()


RUNNERS: dict[RunKind, Runner] = {
    RunKind.INFERENCE: run_inference,
    RunKind.COSERVE: run_coserve,
    RunKind.SPLIT: run_split,
}

"""The object a host calls at each hook: fine-tuning samples in, backward tasks out."""

from __future__ import annotations

import bisect
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol

import torch

from coserve.core.activations import ActivationStore
from coserve.core.admission import AdmissionDecision, admit, latency_budget, should_interrupt
from coserve.core.config import CoServeConfig, OptimConfig, SkippedSteps, SLOConfig
from coserve.core.finetune import FTSample
from coserve.core.host import FTRow, Interrupted, StepRecord, StepView
from coserve.core.latency import (
    LOSS_PHASE,
    BatchSpec,
    LatencyModel,
    StepFeatures,
    calibrate,
    trainer_phase,
    trainer_spot,
)
from coserve.core.messages import BackwardTask, TaskResult, TaskSample, row_dropout_key
from coserve.core.sample_pool import SamplePool
from coserve.cpu_split import current_cpu
from coserve.gc_freeze import GCClock

logger = logging.getLogger(__name__)


class TrainerClient(Protocol):
    """The engine-side handle of the trainer worker process."""

    def submit(self, task: BackwardTask) -> None: ...

    def poll(self, timeout: float = 0.0) -> list[TaskResult]:
        """Results that arrived since the last call; waits up to ``timeout`` s for the first."""
        ...

    def alive(self) -> bool: ...

    def pause(self) -> None:
        """Clear the grant flag: the backward stops at its next layer boundary."""
        ...

    def resume(self) -> None:
        """Set the grant flag."""
        ...

    def restart(self) -> int:
        """Start a fresh worker from the last committed state; returns the committed step count."""
        ...

    @property
    def committed_steps(self) -> int:
        """Optimizer steps in the last committed state (readable after the worker died)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class OptimizerStepLog:
    """One line of ``train_log.jsonl``: enough to audit and replay the run."""

    step: int
    sample_ids: tuple[int, ...]
    tokens: int
    target_tokens: int
    loss: float | None
    lr: float | None
    grad_norm: float | None
    skipped: bool
    wall_time: float
    # False: the trainer committed the step, then died before its result came in. The step counts
    # (its samples are retired: the adapter holds them); its loss, lr and grad_norm are unknown: None.
    reported: bool = True


ERROR_BUCKETS: tuple[float, ...] = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
"""Upper bounds of :class:`PredictionErrors`' buckets (relative error; one more bucket above)."""


@dataclass
class PredictionErrors:
    """How far the latency model's predictions of one step kind were off: counts of
    ``|predicted − measured| / measured`` per :data:`ERROR_BUCKETS` bucket (the last: above all
    of them), their sum, and the steps counted (the server's ``/metrics`` histogram)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(ERROR_BUCKETS) + 1))
    total: float = 0.0

    def add(self, rel_error: float) -> None:
        self.counts[bisect.bisect_left(ERROR_BUCKETS, rel_error)] += 1
        self.total += rel_error

    @property
    def steps(self) -> int:
        return sum(self.counts)


class StepLogRow(NamedTuple):
    """One step of :attr:`CoServer.step_log`, predicted before the model observed it."""

    key: str  # the latency set's key with /busy or /idle
    regressors: tuple[float, ...]  # StepFeatures.vector()
    predicted_s: float
    measured_s: float
    rows: tuple[int, int]  # (prefill chunks, FT rows)
    # the boundary (layer, ordinal) the trainer's GPU had passed last when the step began
    # (TrainerProcess.progress; None between tasks or unknown)
    trainer_at: tuple[int, int] | None
    late: bool  # its time came late from the GPU's events (observe_late), not from the host
    chunks: tuple[tuple[int, int], ...]  # each inference chunk's (tokens, cached context)
    decodes: int
    schedule_s: float | None  # StepRecord.schedule_s / enqueue_s: the host's parts of the step
    enqueue_s: float | None
    # the host seconds from the step's start to admission's decision (StepView.planned_s): known
    # when the step is admitted, added to the model's price as measured (predicted_s includes it)
    planned_s: float = 0.0
    gpu_s: float | None = None  # StepRecord.gpu_s: the device's time of the step's forward
    # the host seconds from the end of the step before (its on_step_end) to this one's start
    # (StepView.step_began; None: the first step, or a host that does not say): how long the
    # engine had left the GPU to the trainer or idle before the step (recorded while tracking)
    gap_s: float | None = None
    # time.monotonic() at the step's start (StepView.step_began; None: a host that does not say):
    # to line the steps up with the trainer's tasks and the GPU's clock (bench/coserve_latency.py)
    began_s: float | None = None
    decode_kv_max: int = 0  # StepView.decode_kv_max: the longest decode row's KV tokens
    # the CPU the engine's thread was on when the step was observed: its end, later for a late-timed
    # step (cpu_split.current_cpu)
    host_cpu: int | None = None
    enqueue_cpu_s: float | None = None  # StepRecord.enqueue_cpu_s: the engine thread's CPU time in enqueue_s
    gc_s: float | None = None  # Python's garbage collector's seconds in the step (from its plan; not late ones)


class CheckPoint(NamedTuple):
    """One interruption point an interrupted FT-only step passed (:attr:`CoServer.interrupted_checks`)."""

    where: str  # "end of plan", "before layer i", "within layer i"
    at_s: float  # seconds since the step's plan began
    gpu_wait_s: float  # the CPU's wait there for the GPU to reach the point before
    cpu_s: float  # the host thread's CPU seconds since the plan began (wall minus this: blocked; a
    # CUDA wait that spins counts as CPU time)
    gc_s: float  # seconds in Python's garbage collector since the plan began
    device_allocs: int | None  # CUDA allocations (cudaMalloc, cuMemMap) so far; None off CUDA, at the end of
    # the plan and past the step's first six checks (memory_stats costs host time)


@dataclass
class _OpenStep:
    """An optimizer step being assembled: its tasks' samples and results so far."""

    index: int
    sample_ids: list[int] = field(default_factory=list)
    tokens: int = 0
    num_tasks: int = 0
    loss_sum: float = 0.0
    num_targets: int = 0


class CoServer:
    """Fine-tuning inside a host's steps (DESIGN §1, §5, §7, §8).

    Samples are added to steps shortest first while the host's token budget and the activation
    store allow and no backward task is running (so every sample of a task is forwarded with
    the adapter it is differentiated against). Captured samples form backward tasks of at least
    ``backward_tokens`` tokens; ``accumulation_tasks`` tasks make one optimizer step. When the
    trainer dies, the samples of the unfinished optimizer step go back to the pool and a fresh
    worker resumes from the last committed step.
    """

    def __init__(
        self,
        *,
        pool: SamplePool,
        samples: dict[int, FTSample],
        store: ActivationStore,
        trainer: TrainerClient,
        config: CoServeConfig,
        optim: OptimConfig,
        slo: SLOConfig | None = None,
        latency: LatencyModel | None = None,
        on_step_logged: Callable[[OptimizerStepLog], None] | None = None,
    ) -> None:
        self.pool = pool
        self.samples = samples
        self.store = store
        self.trainer = trainer
        self.config = config
        self.optim = optim
        self.slo = slo or SLOConfig()
        self.latency = latency or LatencyModel()
        # its refits wait for poll(), the host's idle moments (LatencyModel.defer_refits)
        self.latency.defer_refits = True
        self.last_decision: AdmissionDecision | None = None
        # LoRA dropout of the training adapter: the host applies it to FT rows (FTRow.dropout_key).
        self.lora_dropout = 0.0
        self.dropout_seed = 0
        self.on_step_logged = on_step_logged
        self._step_rows: list[TaskSample] = []  # rows of the step being run
        self._step_ft_start = 0
        self._task_rows: list[TaskSample] = []  # captured, not yet submitted
        # Tasks handed to the trainer, oldest first, with the store region each one holds. A
        # second task of the same optimizer step may be captured (in the other region) while
        # the trainer works on the first: the adapter cannot change before that step ends.
        self._in_flight: list[tuple[BackwardTask, int]] = []
        self._fill_region = 0
        self._open = _OpenStep(0)
        self._next_task_id = 0
        self.steps_done = 0  # optimizer steps done (logged), applied or skipped
        # of those, skipped for a non-finite loss or gradient: the trainer's committed state counts
        # only the applied ones (its optimizer's step count)
        self.steps_skipped = 0
        self.tokens_trained = 0
        self.num_restarts = 0
        # The trainer died this many times in a row without finishing a step; past
        # `max_restarts` fine-tuning stops (inference goes on) and `failure` says why.
        self.max_restarts = 3
        self._restarts_in_a_row = 0
        # optimizer steps skipped for a non-finite loss or gradient since the last applied one
        # (past optim.max_skipped_steps fine-tuning stops and `failure` says why)
        self._skipped = SkippedSteps()
        self.failure: str | None = None
        self.last_loss: float | None = None
        self.first_loss: float | None = None  # of this run's first optimizer step
        # Set by the host: True when an inference request is waiting to be scheduled.
        self.arrival_probe: Callable[[], bool] | None = None
        self.num_interrupted = 0
        # the last plan() would have started an FT-only step but inference work had arrived
        self.arrived_while_planning = False
        # the trainer's own time over every task so far: working on it, and paused for inference
        # steps (/metrics coserve_finetune_trainer_seconds{state})
        self.trainer_seconds: dict[str, float] = {"working": 0.0, "paused": 0.0}
        self._ft_only = False
        self._paused = False
        # SLOConfig.early_pause_s: the timer thread (made at the first plan that arms it) and when
        # it paused the backward for the step being run (None: it did not)
        self._early: EarlyPauseTimer | None = None
        self._early_at: float | None = None
        self.early_pauses = 0  # paused by the timer, taken over by the next plan
        self.early_pauses_lifted = 0  # paused by the timer, lifted: the next step needed none
        # SLOConfig.hold_pause: the pause of the last step carried over into this step's planning
        self._held = False
        # Measurements for benchmarks (bounded by the run): grant-flag clears and the worker's
        # observed pauses (time.monotonic, comparable across processes), latency predictions.
        self.track = False
        self.pause_windows: list[tuple[float, float]] = []
        # where the trainer's GPU was when each window began (as step_log's; GPU-side gate only)
        self.pause_window_at: list[tuple[int, int] | None] = []
        # when each window's step was planned (its start: after the window's own start where the
        # timer of SLOConfig.early_pause_s paused the backward earlier)
        self.pause_window_step_start: list[float] = []
        self._pause_step_start = 0.0
        self.pause_observed: list[float] = []
        self.pause_observed_layers: list[int] = []  # the boundary of each (TaskResult.pause_layers)
        self.trainer_spans: list[tuple[int, int, float, float]] = []  # TaskResult.spans of every task
        # TaskResult.span_process_ms, parallel to trainer_spans (NaN where a result had none)
        self.trainer_span_process_ms: list[float] = []
        self.trainer_span_gc_ms: list[float] = []  # TaskResult.span_gc_ms, parallel to trainer_spans (NaN: none)
        self.trainer_span_thread_ms: list[float] = []  # TaskResult.span_thread_ms, the same way
        # parallel to trainer_spans: each stretch's task, as its index in task_timings (-1: none there)
        self.trainer_span_tasks: list[int] = []
        self.trainer_watchdog_releases = 0  # TaskResult.watchdog_releases, summed
        # (watchdog_releases, watchdog_closed, device_allocs, device_frees, closed_sleeps) of each
        # task (TaskResult's; closed_sleeps: COSERVE_TRAINER_CLOSED_AHEAD)
        self.trainer_task_counts: list[tuple[int, int, int, int, int]] = []
        self.pause_observed_lags: list[float] = []  # TaskResult.pause_lags_ms (GPU-side gate only)
        self.pause_observed_polled: list[bool] = []  # TaskResult.pause_polled
        self.pause_observed_idle_ms: list[float] = []  # TaskResult.pause_idle_ms (0 where none)
        # planned steps by (step kind: "inference" | "ft-only", outcome: "added" (FT rows added),
        # "task_full" (the task being filled was full), "arrival" (an FT-only step not started:
        # inference work arrived while it was planned) or why admission added none
        # (admission.Reason)): why FT rows did or did not ride (/metrics, bench)
        self.admission_counts: dict[tuple[str, str], int] = {}
        # the latency model's relative error on every timed step, predicted before it was observed:
        # per step key (form/mode/busy|idle), counts per ERROR_BUCKETS bucket and their sum
        self.prediction_errors: dict[str, PredictionErrors] = {}
        # per step, predicted before the model observed it: its error, and the data to refit and
        # judge latency models offline
        self.step_log: list[StepLogRow] = []
        self._trainer_at: tuple[int, int] | None = None
        # untimed steps (StepRecord.timed False) until the host dates them: id(record) -> where
        # the trainer was when the step began
        self._untimed: dict[int, tuple[tuple[int, int] | None, str, float, float | None, str | None]] = {}
        self._last_step_end: float | None = None  # time.monotonic() at the last on_step_end (StepLogRow.gap_s)
        # the host time the step being planned had spent when admission decided (StepView.planned_s)
        self._planned_s = 0.0
        # the trainer's phase beside the step being planned (coserve.core.latency.TRAINER_PHASES),
        # from its GPU's progress word; "active" for a trainer without one
        self._trainer_phase = "active"
        # the model's layers: the store's planes less one (the last plane is the loss's input)
        self._num_layers = store.tensor.shape[0] - 1
        # the boundary of the backward's loss (layer num_layers), priced as its own phase
        # (coserve.core.latency.LOSS_PHASE)
        self._loss_layer = self._num_layers if LOSS_PHASE else None
        # where in its backward the trainer is beside that step (coserve.core.latency.trainer_spot; None
        # elsewhere or without a progress word)
        self._trainer_spot: str | None = None
        # per backward task: (submitted, result received: time.monotonic; trainer-side seconds;
        # tokens; of the trainer's seconds: paused, waiting on the GPU; its thread's CPU seconds)
        # — where a co-serving run's fine-tuning time goes
        self.task_timings: list[tuple[float, float, float, int, float, float, float]] = []
        # (track) parallel to task_timings: the task's samples, its longest sample's tokens, its
        # longest stretch between two boundaries in host ms and in GPU ms (NaN: no spans), its
        # CUDA allocations (TaskResult.device_allocs: one can wait for the device, and so behind
        # the closed gate) and its sleeps behind the closed gate (TaskResult.closed_sleeps) — what
        # the trainer ran beside the steps (bench/coserve_latency.py's timeline)
        self.task_shapes: list[tuple[int, int, float, float, int, int]] = []
        # (track) per task in flight: submitted (time.monotonic()), tokens, samples, longest sample
        self._submitted: dict[int, tuple[float, int, int, int]] = {}
        self._layer_events: list[torch.cuda.Event] = []
        # (track) per interrupted FT-only step: each interruption point it passed — where an
        # arrival's wait inside such a step goes
        self.interrupted_checks: list[list[CheckPoint]] = []
        self._checks: list[CheckPoint] = []
        self._plan_began = 0.0
        self._plan_cpu = 0.0
        self._plan_gc = 0.0
        self._gc_clock: GCClock | None = None

    # ------------------------------------------------------------------ hooks

    @property
    def backward_running(self) -> bool:
        return bool(self._in_flight)

    @property
    def steps_applied(self) -> int:
        """Optimizer steps applied: what the trainer's committed state counts
        (``TrainerClient.committed_steps``)."""
        return self.steps_done - self.steps_skipped

    @property
    def skipped_in_a_row(self) -> int:
        """Optimizer steps skipped for a non-finite loss or gradient since the last applied one."""
        return self._skipped.count

    @property
    def trainer_active(self) -> bool:
        """A backward runs and is not paused for the step being planned: the step runs beside
        it (what the latency model's busy mode prices and what a step record reports)."""
        return bool(self._in_flight) and not self._paused

    @property
    def done(self) -> bool:
        """Every epoch is trained, or fine-tuning gave up (:attr:`failure`)."""
        return (self.pool.done and not self._in_flight) or self.failure is not None

    def _admission_closed(self) -> bool:
        """No new FT rows: a task in flight ends the optimizer step (the adapter changes before
        anything captured now would be differentiated), or no store region is free."""
        if not self._in_flight:
            return False
        if any(task.ends_step for task, _ in self._in_flight):
            return True
        return self._free_region() is None

    def _free_region(self) -> int | None:
        held = {region for _, region in self._in_flight}
        if self._task_rows or self._step_rows:
            return self._fill_region
        return next((r for r in range(self.store.regions) if r not in held), None)

    def plan(self, view: StepView) -> list[FTRow]:
        """Choose the fine-tuning rows of the next step (hook 1)."""
        early_at = self._take_early_pause()
        rows = self._plan(view, early_at)
        if early_at is not None:
            if self._paused:
                self.early_pauses += 1
            else:  # (the step needs no pause after all: the timer's is lifted)
                self.trainer.resume()
                self.early_pauses_lifted += 1
        self._arm_early_pause(view, rows)
        return rows

    def _take_early_pause(self) -> float | None:
        """Stop the timer of the step that ended; when it (or an interruption) paused the backward
        (None: nothing did)."""
        with self._early.lock if self._early is not None else contextlib.nullcontext():
            if self._early is not None:
                self._early.deadline = None
            at, self._early_at = self._early_at, None
        return at

    def _pause_at_interruption(self) -> None:
        """SLOConfig.early_pause_s, for an FT-only step that an arrival interrupted: the next step
        carries that arrival's prefill, so the backward (which runs beside FT-only steps) is
        paused now rather than at that step's plan; the plan takes the pause over or lifts it,
        as the timer's. Session 29 (H100): with it and the timer the early pause changed neither
        the pause delay's p99 nor the prefill error (bench/results/latency_h100/README.md)."""
        if self.slo.early_pause_s <= 0 or not self._in_flight or self._paused or self.failure is not None:
            return
        with self._early.lock if self._early is not None else contextlib.nullcontext():
            self._pause_early()

    def _arm_early_pause(self, view: StepView, rows: list[FTRow]) -> None:
        """SLOConfig.early_pause_s: for a decode-only step beside the running backward, the timer
        at its predicted end less the lead."""
        lead = self.slo.early_pause_s
        if (lead <= 0 or rows or view.prefills or not view.num_decodes or not self._in_flight or self._paused
                or self.arrival_probe is None or self.failure is not None):
            return
        features = StepFeatures.from_view(view, busy=True, trainer_phase=self._trainer_phase,
                                          trainer_spot=self._trainer_spot)
        if self._early is None:
            self._early = EarlyPauseTimer(self._early_pause)
        self._early.arm(time.monotonic() + self.latency.predict(features) - lead)

    def _early_pause(self) -> None:
        """(the timer's thread, under its lock) Pause the backward if a request is waiting."""
        if self.arrival_probe is not None and self.arrival_probe():
            self._pause_early()

    def _pause_early(self) -> None:
        """(under the timer's lock, where there is a timer) The early pause, once per step."""
        if self._early_at is None:
            self.trainer.pause()
            self._early_at = time.monotonic()

    def _plan(self, view: StepView, early_at: float | None) -> list[FTRow]:
        if self.track:
            if self._gc_clock is None:
                self._gc_clock = GCClock()
            self._plan_began, self._plan_cpu = time.monotonic(), time.thread_time()
            self._plan_gc = self._gc_clock.total_s
        self.arrived_while_planning = False
        self._collect()
        progress = getattr(self.trainer, "progress", None)
        if progress is not None and getattr(self.trainer, "reports_progress", True):
            at = progress() if self._in_flight else None
            # (no task in flight: the next one starts from scratch)
            self._trainer_phase = (trainer_phase(at, self._trainer_phase, self._loss_layer) if self._in_flight
                                   else "starting")
        else:
            at, self._trainer_phase = None, "active"
        self._trainer_spot = trainer_spot(at, self._num_layers)
        if self.track:
            self._trainer_at = at
        # Admission decides from here: the step's host time so far (scheduling, taking in the
        # trainer's results: up to 2.9 ms against a median of 0.18 ms for idle decode steps in
        # session 26's evaluation, bench/results/latency_h200/session27/latency_fit_planned.json)
        # is known now and counts as measured; the latency model prices the rest of the step
        if view.step_began is not None:  # (a host that says: its clock is time.monotonic())
            view = replace(view, now=time.monotonic())
        self._planned_s = view.planned_s
        self._step_rows = []
        if self.failure is not None:
            if self._held:
                self._resume()
            return []
        if view.ft_graph_tokens and self.ft_rows_force_eager(ft_only=not view.has_inference):
            view = replace(view, ft_graph_tokens=0)  # (priced as the eager step it will be)
        held, self._held = self._held, False
        must_pause = bool(self._in_flight) and self._must_pause(view)
        if must_pause and not self._paused:
            self._pause(early_at)
        elif held and not must_pause:
            self._resume()  # (the held pause ends where this step needs none)
        ft_only = not view.has_inference
        if self._task_full():
            self._count(ft_only, "task_full")
            return []
        region = None if self._admission_closed() else self._free_region()
        decision = admit(
            view, self.pool.candidates(), model=self.latency, slo=self.slo,
            backward_running=region is None, capacity_tokens=self.store.free(region or 0),
            token_budget=max(view.token_budget, self.store.capacity) if ft_only else view.token_budget,
            trainer_busy=self.trainer_active, trainer_phase=self._trainer_phase, trainer_spot=self._trainer_spot,
        )
        self.last_decision = decision
        picked: list[FTSample] = []
        task_tokens = self._task_tokens()
        for sample in decision.samples:  # shortest first; a task closes once it is full
            if task_tokens >= self.config.backward_tokens:
                break
            picked.append(sample)
            task_tokens += sample.num_tokens
        self.arrived_while_planning = bool(picked and region is not None and ft_only and self._arrived_while_planning())
        if self.arrived_while_planning:
            self._count(ft_only, "arrival")
            return []
        self._count(ft_only, "added" if picked and region is not None
                    else "task_full" if decision.samples else str(decision.reason))
        if not picked or region is None:
            return []
        ft_lens = [s.num_tokens for s in picked]
        if self._in_flight and not self._paused and self._must_pause(view, ft_lens):
            # NOTE: a step that carries both inference and FT rows runs eager and has the
            # tightest budget of all; the backward beside it was the largest error of the
            # latency model (H200, bench/results/diagnostic/): "always" pauses it for this step.
            # Under "model" admission already priced these rows beside the running backward
            # (trainer_busy) against the same budget, so this pauses only a step whose latency
            # it did not check (the naive policy).
            self._pause(early_at)
        self.pool.claim([s.sample_id for s in picked])
        self._fill_region = region
        offset = self.store.reserve(sum(s.num_tokens for s in picked), region)
        self._step_ft_start = view.num_prefill_tokens
        self._ft_only = not view.has_inference
        for s in picked:
            self._step_rows.append(TaskSample(s.sample_id, offset, s.labels))
            offset += s.num_tokens
        first_row = len(self._task_rows)
        return [FTRow(s.sample_id, s.input_ids, self._dropout_key(first_row + j)) for j, s in enumerate(picked)]

    def _count(self, ft_only: bool, outcome: str) -> None:
        key = ("ft-only" if ft_only else "inference", outcome)
        self.admission_counts[key] = self.admission_counts.get(key, 0) + 1

    def _pause(self, early_at: float | None = None) -> None:
        """``early_at``: when the timer of SLOConfig.early_pause_s paused the backward already
        (the window begins there; the step's start is now)."""
        # NOTE: set again in on_step_end (held: in the next plan or poll), whatever happens in between
        self.trainer.pause()
        self._paused = True
        self._pause_step_start = time.monotonic()
        self._pause_start = early_at if early_at is not None else self._pause_step_start

    def _resume(self) -> None:
        self.trainer.resume()
        self._paused = False
        self._held = False
        if self.track:
            self.pause_windows.append((self._pause_start, time.monotonic()))
            self.pause_window_at.append(self._trainer_at)
            self.pause_window_step_start.append(self._pause_step_start)

    def _dropout_key(self, row: int) -> int | None:
        """Row ``row`` of the task being filled is trained as row ``row`` of task ``_next_task_id``;
        the trainer passes that task id as the dropout key (``row_dropout_key`` of the two)."""
        if self.lora_dropout <= 0:
            return None
        return row_dropout_key(self._next_task_id, row)

    def _must_pause(self, view: StepView, ft_lens: Sequence[int] = ()) -> bool:
        """Pause the backward for the step ``view`` with FT rows of ``ft_lens``? Never for an
        FT-only step. Under ``pause_prefill="always"``, always for a step that carries prefill or
        FT rows (DESIGN §7). Otherwise (a decode-only step, or any inference step under
        ``"model"``) when the latency model, in busy mode and times its safety factor, says that
        running beside the backward would break the step's latency budget. That is the test by
        which admission prices FT rows while the trainer is active (``trainer_busy``), so under
        ``"model"`` a step admitted beside the backward is not then paused."""
        if not view.has_inference:
            return False
        if self.slo.pause_prefill == "always" and (view.num_prefill_tokens > 0 or ft_lens):
            return True
        features = StepFeatures.from_view(view, ft_lens, busy=True, trainer_phase=self._trainer_phase,
                                          trainer_spot=self._trainer_spot)
        busy = self.latency.predict(features) * self.latency.safety(features)
        return busy > latency_budget(view, self.latency, self.slo)

    def on_layer(self, layer: int, hidden: torch.Tensor) -> None:
        """Copy the fine-tuning rows' residual stream into the store (hook 2)."""
        if not self._step_rows:
            return
        self._interruption_point(hidden, f"before layer {layer}")
        n = self._step_tokens()
        start = self._step_ft_start
        self.store.capture(layer, self._step_rows[0].offset, hidden[start : start + n])

    @property
    def keeps_mlp(self) -> bool:
        """Whether the store keeps the MLP activations too."""
        return self.store.mlp is not None

    @property
    def wants_mlp_hook(self) -> bool:
        """Whether the host should call :meth:`on_mlp` in this step: the store keeps the MLP
        activations, or the step is an FT-only one that an arrival may interrupt inside a layer
        (``SLOConfig.ft_only_mid_layer_check``: a second interruption point per layer)."""
        return self.keeps_mlp or (self._ft_only and self._mid_layer_checks())

    def on_mlp(self, layer: int, gate_up: torch.Tensor) -> None:
        """Inside layer ``layer``'s MLP, after its gate/up projection: an interruption point of
        an FT-only step, and the copy of the fine-tuning rows' gate/up output into the store."""
        if not self._step_rows:
            return
        self._interruption_point(gate_up, f"within layer {layer}")
        if not self.keeps_mlp:
            return
        start = self._step_ft_start
        self.store.capture_mlp(layer, self._step_rows[0].offset, gate_up[start : start + self._step_tokens()])

    def ft_rows_force_eager(self, *, ft_only: bool) -> bool:
        """Whether this co-server's FT rows keep a step off the host's graphs (hook contract:
        rows with a dropout key, and a step with an MLP hook, run eagerly): LoRA dropout, MLP
        activations kept, or an FT-only step with a check inside each layer (the MLP hook)."""
        return self.lora_dropout > 0 or self.keeps_mlp or (ft_only and self._mid_layer_checks())

    def _interruptible(self) -> bool:
        return self.arrival_probe is not None and should_interrupt(self.slo, ft_only_step=True, num_arrived=1)

    def _mid_layer_checks(self) -> bool:
        return self.slo.ft_only_mid_layer_check and self._interruptible()

    def _interruption_point(self, activation: torch.Tensor | None, where: str) -> None:
        """In an FT-only step: raise :class:`Interrupted` if inference work has arrived. At the
        end of its plan, then at each layer's start (and, with
        ``SLOConfig.ft_only_mid_layer_check``, after the MLP's gate/up projection: ~3/4 and ~1/4
        of the layer's work), with the GPU kept at most one point behind the CPU, so that at any
        moment at most about one layer of the step's work is queued ahead of the request."""
        if self._ft_only and self._interruptible() and self._arrived(activation, where):
            raise Interrupted(f"inference work arrived {where}")

    def _arrived(self, activation: torch.Tensor | None, where: str) -> bool:
        """One interruption point (recorded when tracking): has inference work arrived?"""
        began = time.monotonic() if self.track else 0.0
        if activation is not None and activation.is_cuda:
            self._bound_lookahead()
        if self.track:
            self._record_check(where, activation, began)
        assert self.arrival_probe is not None
        return self.arrival_probe()

    def _arrived_while_planning(self) -> bool:
        """The first interruption point of an FT-only step, at the end of its plan: inference
        work that arrived while it was planned keeps it from starting."""
        if not (self._interruptible() and self._arrived(None, "end of plan")):
            return False
        checks, self._checks = self._checks, []
        if self.track:
            self.interrupted_checks.append(checks)
        return True

    def _record_check(self, where: str, activation: torch.Tensor | None, began: float) -> None:
        now = time.monotonic()
        allocs = None
        # (the allocator's counters only where a step's first layers allocate: memory_stats costs)
        if activation is not None and activation.is_cuda and len(self._checks) < 6:
            allocs = int(torch.cuda.memory_stats(activation.device).get("num_device_alloc", -1))
        gc_s = self._gc_clock.total_s - self._plan_gc if self._gc_clock is not None else 0.0
        self._checks.append(CheckPoint(where, now - self._plan_began, now - began,
                                       time.thread_time() - self._plan_cpu, gc_s, allocs))

    def observe_late(self, record: StepRecord, duration_s: float) -> None:
        """The duration of a step whose record came untimed (``record.timed`` False): the latency
        model learns from it now, and the step table gets it."""
        at, phase, planned, gap, spot = self._untimed.pop(id(record), (None, "active", 0.0, None, None))
        self._observe(replace(record, duration_s=duration_s, timed=True), at, phase, planned, gap, late=True,
                      spot=spot)

    def drop_untimed(self) -> None:
        """The host will not date its untimed steps (it dropped them)."""
        self._untimed.clear()

    def _observe(self, record: StepRecord, trainer_at: tuple[int, int] | None, phase: str, planned_s: float,
                 gap_s: float | None = None, late: bool = False, spot: str | None = None,
                 gc_s: float | None = None) -> None:
        """The latency model learns the step's time after admission's decision (``planned_s``
        before it, as measured); the step table gets the whole step, predicted and measured.
        ``phase`` and ``spot``: the trainer's phase and spot as the step began; ``gc_s``: the
        garbage collector's seconds from its plan to its end (while tracking; None for a late one)."""
        if record.interrupted or not record.duration_s > 0:
            return  # (LatencyModel.observe's rule: nothing to learn)
        if not 0.0 <= planned_s < record.duration_s:
            planned_s = 0.0  # (a host clock that disagrees: the whole step is priced)
        # (once, for the model and the records; the idle host before it makes a prompt alone lone)
        features = StepFeatures.from_record(record, phase, idle_before_s=gap_s, trainer_spot=spot)
        predicted = self.latency.observe_features(features, record.duration_s - planned_s)
        key = features.key + ("/busy" if record.trainer_busy else "/idle")
        errors = self.prediction_errors.get(key)
        if errors is None:
            errors = self.prediction_errors[key] = PredictionErrors()
        errors.add(abs(predicted + planned_s - record.duration_s) / record.duration_s)
        if self.track:
            self.step_log.append(StepLogRow(
                key, features.vector(), predicted + planned_s, record.duration_s,
                (len(features.chunks), len(features.ft_lens)),
                trainer_at, late, tuple((c.num_tokens, c.context_len) for c in features.chunks),
                features.num_decodes, record.schedule_s, record.enqueue_s, planned_s, record.gpu_s, gap_s,
                record.view.step_began, record.view.decode_kv_max, current_cpu(), record.enqueue_cpu_s, gc_s))

    def _gap_before(self, record: StepRecord) -> float | None:
        """:attr:`StepLogRow.gap_s` of the step ending now (None where it cannot be told)."""
        began, last = record.view.step_began, self._last_step_end
        self._last_step_end = time.monotonic()
        gap = began - last if began is not None and last is not None else None
        return gap if gap is None or gap >= 0 else None  # (negative: a host clock that disagrees)

    def _bound_lookahead(self) -> None:
        """Keep the GPU at most one interruption point behind the CPU in an FT-only step, so that
        checking for arrivals there means something."""
        event = torch.cuda.Event()
        event.record()
        self._layer_events.append(event)
        if len(self._layer_events) > 1:
            self._layer_events.pop(0).synchronize()

    def on_step_end(self, record: StepRecord) -> None:
        """Retire the step's rows into the open task; submit it when full (hook 3)."""
        if self._paused:
            if (self.slo.hold_pause and not record.interrupted and record.view.waiting_prefill_tokens > 0
                    and self.failure is None):
                self._held = True  # the next step will carry prefill: its plan() decides
            else:
                self._resume()
        self._layer_events.clear()
        checks, self._checks = self._checks, []
        if record.interrupted and self.track:
            self.interrupted_checks.append(checks)
        gap = self._gap_before(record)  # (the step table's, and what makes a prompt lone)
        if not record.interrupted:
            if record.timed:
                gc_s = self._gc_clock.total_s - self._plan_gc if self.track and self._gc_clock is not None else None
                self._observe(record, self._trainer_at, self._trainer_phase, self._planned_s, gap,
                              spot=self._trainer_spot, gc_s=gc_s)
            else:
                self._untimed[id(record)] = (self._trainer_at, self._trainer_phase, self._planned_s, gap,
                                             self._trainer_spot)
        rows, self._step_rows = self._step_rows, []
        if not rows:
            return
        if record.interrupted:
            self.num_interrupted += 1
            self._pause_at_interruption()
            self.pool.release([r.sample_id for r in rows])
            self.store.unreserve_from(rows[0].offset)
            return
        self._task_rows.extend(rows)
        if self._task_full() or self._pool_drained():
            self._submit()

    # ------------------------------------------------------------------ tasks

    def _step_tokens(self) -> int:
        return sum(len(r.labels) for r in self._step_rows)

    def _task_tokens(self) -> int:
        return sum(len(r.labels) for r in self._task_rows)

    def _task_full(self) -> bool:
        return self._task_tokens() >= self.config.backward_tokens

    def _pool_drained(self) -> bool:
        """Every sample left is in the open task or the open step: nothing more will come."""
        return not self.pool.candidates()

    def _submit(self) -> None:
        if not self._task_rows or any(task.ends_step for task, _ in self._in_flight):
            return
        self._open.num_tasks += 1
        ends = self._open.num_tasks >= self.optim.accumulation_tasks or self._pool_drained()
        task = BackwardTask(self._next_task_id, self._open.index, tuple(self._task_rows), ends)
        self._next_task_id += 1
        self._open.sample_ids.extend(r.sample_id for r in self._task_rows)
        self._open.tokens += self._task_tokens()
        self._task_rows = []
        self._in_flight.append((task, self._fill_region))
        if self.track:
            lengths = [len(r.labels) for r in task.samples]
            self._submitted[task.task_id] = (time.monotonic(), sum(lengths), len(lengths), max(lengths))
        if self.store.tensor.is_cuda:
            # NOTE: the captures were queued on the engine's stream; the trainer (another
            # process, another stream) must see them complete.
            torch.cuda.current_stream(self.store.tensor.device).synchronize()
        self.trainer.submit(task)

    def poll(self, timeout: float = 0.0) -> None:
        """Take in trainer results (waiting up to ``timeout`` s); recover from a dead trainer. The
        host calls it between steps when it has no step to run: a held pause
        (``SLOConfig.hold_pause``) ends here, since no step follows at once, and so does the early
        pause (``SLOConfig.early_pause_s``) of the step that ran last."""
        if self._held:
            self._resume()
        if self._take_early_pause() is not None:
            self.trainer.resume()
            self.early_pauses_lifted += 1
        if timeout > 0:
            began = time.monotonic()
            self.latency.refit_due(began + timeout)
            timeout = max(0.0, timeout - (time.monotonic() - began))
        self._collect(timeout)

    def _collect(self, timeout: float = 0.0) -> None:
        for result in self.trainer.poll(timeout if self._in_flight else 0.0):
            self._on_result(result)
        if self._in_flight and not self.trainer.alive():
            self._recover()
        elif self._task_rows and not self._step_rows and (self._task_full() or self._pool_drained()):
            self._submit()

    def collect_committed(self, committed_steps: int, timeout: float) -> bool:
        """Take in trainer results until :attr:`steps_applied` reaches ``committed_steps`` (the
        optimizer steps the trainer has committed), waiting up to ``timeout`` s; whether it did.
        The host's thread, between two steps (as :meth:`poll`).

        The trainer commits a step's state before its result arrives here: a copy of the
        committed state taken in between counts one step that ``steps_done``, the train log and
        the pool's retired samples do not (a checkpoint, which a resume would start from). (A
        skipped step left pending is harmless: it changed no state and its samples go again.)"""
        deadline = time.monotonic() + timeout
        while self.steps_applied < committed_steps and self._in_flight:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._collect(min(left, 0.1))  # (in slices: a trainer that died is recovered in the next)
        return self.steps_applied == committed_steps

    def _on_result(self, result: TaskResult) -> None:
        if not self._in_flight or result.task_id != self._in_flight[0][0].task_id:
            logger.warning("ignoring a result for unknown task %d", result.task_id)
            return
        _, region = self._in_flight.pop(0)  # the trainer works through tasks in order
        self.store.reset(region)
        self.trainer_seconds["working"] += max(0.0, result.duration_s - result.paused_s)
        self.trainer_seconds["paused"] += result.paused_s
        if self.track:
            self.pause_observed.extend(result.pause_times)
            self.pause_observed_layers.extend(result.pause_layers)
            self.trainer_spans.extend(result.spans)
            n = len(result.spans)  # (a result without a per-stretch figure: NaN for each stretch)
            for figures, into in ((result.span_process_ms, self.trainer_span_process_ms),
                                  (result.span_gc_ms, self.trainer_span_gc_ms),
                                  (result.span_thread_ms, self.trainer_span_thread_ms)):
                into.extend(figures if len(figures) == n else (math.nan,) * n)
            self.trainer_watchdog_releases += result.watchdog_releases
            self.trainer_task_counts.append((result.watchdog_releases, result.watchdog_closed, result.device_allocs,
                                             result.device_frees, result.closed_sleeps))
            self.pause_observed_lags.extend(result.pause_lags_ms)
            self.pause_observed_polled.extend(result.pause_polled or (False,) * len(result.pause_times))
            self.pause_observed_idle_ms.extend(result.pause_idle_ms or (0.0,) * len(result.pause_times))
            sent = self._submitted.pop(result.task_id, None)
            self.trainer_span_tasks.extend((len(self.task_timings) if sent is not None else -1,) * len(result.spans))
            if sent is not None:
                self.task_timings.append((sent[0], time.monotonic(), result.duration_s, sent[1], result.paused_s,
                                          result.gpu_wait_s, result.cpu_s))
                self.task_shapes.append((sent[2], sent[3], max((cpu for *_, cpu in result.spans), default=math.nan),
                                         max((gpu for *_, gpu, _ in result.spans), default=math.nan),
                                         result.device_allocs, result.closed_sleeps))
        self._open.loss_sum += result.loss_sum
        self._open.num_targets += result.num_targets
        info = result.step_info
        if info is None:
            return
        opened = self._open
        loss = opened.loss_sum / opened.num_targets if opened.num_targets else None
        if info.skipped:
            logger.warning("optimizer step %d skipped: non-finite loss or gradient", opened.index)
        self._end_step(OptimizerStepLog(
            step=opened.index, sample_ids=tuple(opened.sample_ids), tokens=opened.tokens,
            target_tokens=opened.num_targets, loss=loss, lr=info.lr, grad_norm=info.grad_norm,
            skipped=info.skipped, wall_time=time.time(),
        ))

    def _end_step(self, entry: OptimizerStepLog) -> None:
        """The open optimizer step is done (the trainer committed it): retire its samples, count
        it and log it."""
        self.pool.retire(entry.sample_ids)
        self._restarts_in_a_row = 0
        self.steps_done += 1
        self.steps_skipped += entry.skipped
        self.tokens_trained += entry.tokens
        if entry.reported:  # (last_loss and first_loss: of the steps whose loss is known)
            self.last_loss = entry.loss
            if self.first_loss is None:
                self.first_loss = entry.loss
        stop = self._skipped.record(entry.skipped, self.optim.max_skipped_steps, entry.loss)
        if stop is not None and self.failure is None:
            self.failure = stop
            logger.error(stop)
        self._open = _OpenStep(entry.step + 1)
        if self.on_step_logged is not None:
            self.on_step_logged(entry)

    def _recover(self) -> None:
        """The worker died. The optimizer step it was on is lost, its samples go back, unless it
        had committed it: then the step counts and is logged, its result unknown. A fresh worker
        goes on from the last committed step."""
        self.num_restarts += 1
        lost = self._in_flight[0][0].task_id if self._in_flight else None
        self._in_flight = []
        for region in range(self.store.regions):
            self.store.reset(region)
        # Captured-but-unsubmitted rows were forwarded with the committed adapter: still valid,
        # but their activations sat in the store with the lost task's; recapture them.
        back = [r.sample_id for r in self._task_rows]
        self._task_rows = []
        opened = self._open
        if self.trainer.committed_steps > self.steps_applied:
            # NOTE: the worker committed the step (an applied one: skipped steps commit no new
            # count), then died before reporting it. Its samples are in the adapter: not again.
            logger.error("trainer process died after committing optimizer step %d, before reporting it "
                         "(task %s); the step counts, its loss unknown; restarting", opened.index, lost)
            self.pool.release(back)
            self._end_step(OptimizerStepLog(
                step=opened.index, sample_ids=tuple(opened.sample_ids), tokens=opened.tokens,
                target_tokens=sum(self.samples[i].num_target_tokens for i in opened.sample_ids), loss=None,
                lr=None, grad_norm=None, skipped=False, wall_time=time.time(), reported=False,
            ))
        else:
            self._restarts_in_a_row += 1
            logger.error("trainer process died during task %s; restarting (%d samples go back to the pool)",
                         lost, len(opened.sample_ids))
            self.pool.release(opened.sample_ids + back)
            self._open = _OpenStep(opened.index)
        if self._restarts_in_a_row > self.max_restarts:
            self.failure = (f"the trainer died {self._restarts_in_a_row} times in a row without finishing "
                            "an optimizer step; fine-tuning stopped (inference goes on, the last committed "
                            "adapter is kept)")
            logger.error(self.failure)
            return
        self.trainer.restart()

    def resume(self, steps_done: int, tokens_trained: int, steps_skipped: int = 0,
               skipped_in_a_row: int = 0) -> None:
        """Continue a run whose first ``steps_done`` optimizer steps are done (``steps_skipped`` of
        them skipped, the others applied; the last ``skipped_in_a_row`` of them skipped, which
        count towards ``max_skipped_steps`` as they did before)."""
        if self._in_flight or self._task_rows or self.steps_done:
            raise RuntimeError("resume() must come before the first step")
        if not 0 <= steps_skipped <= steps_done:
            raise ValueError(f"steps_skipped {steps_skipped} is not within the {steps_done} steps done")
        if not 0 <= skipped_in_a_row <= steps_skipped:
            raise ValueError(f"skipped_in_a_row {skipped_in_a_row} is not within the {steps_skipped} steps skipped")
        self._skipped.count = skipped_in_a_row
        self._open = _OpenStep(steps_done)
        self.steps_done = steps_done
        self.steps_skipped = steps_skipped
        self.tokens_trained = tokens_trained

    def calibrate(self, run_batch: Callable[[BatchSpec], float], *, max_tokens: int, max_decodes: int,
                  max_kv: int, max_context: int | None = None, modes: tuple[str, ...] = ("eager",),
                  ft_modes: tuple[str, ...] = ("eager",), repeats: int = 2) -> int:
        """Hook 5: time the calibration batches through the host's real path and fit the latency
        model; returns the number of batches timed. ``run_batch`` runs one batch and returns its
        duration in seconds; the fastest of ``repeats`` runs counts (the first warms up).
        ``modes``: the host's modes; ``ft_modes``: those in which it can run steps with FT rows
        (``graph`` is dropped where this co-server's FT rows keep steps eager)."""
        if self.ft_rows_force_eager(ft_only=False):
            ft_modes = tuple(m for m in ft_modes if m != "graph") or ("eager",)
        return calibrate(self.latency, run_batch, max_tokens=max_tokens, max_decodes=max_decodes, max_kv=max_kv,
                         max_context=max_context, modes=modes, ft_modes=ft_modes, repeats=repeats)

    def close(self) -> None:
        if self._gc_clock is not None:
            self._gc_clock.close()
        if self._early is not None:
            self._early.close()
        self.trainer.close()


class EarlyPauseTimer:
    """One thread that calls ``fire`` (under :attr:`lock`) once :attr:`deadline` (time.monotonic)
    has passed; :meth:`arm` sets the deadline, and setting it to None under the lock disarms it
    (SLOConfig.early_pause_s: one long-lived thread, not one timer per step)."""

    def __init__(self, fire: Callable[[], None]) -> None:
        self.lock = threading.Condition()
        self.deadline: float | None = None
        self._fire = fire
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="coserve-early-pause", daemon=True)
        self._thread.start()

    def arm(self, deadline: float) -> None:
        with self.lock:
            self.deadline = deadline
            self.lock.notify()

    def close(self) -> None:
        with self.lock:
            self._closed = True
            self.lock.notify()
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        with self.lock:
            while not self._closed:
                if self.deadline is None:
                    self.lock.wait()
                    continue
                left = self.deadline - time.monotonic()
                if left > 0:
                    self.lock.wait(left)
                    continue
                self.deadline = None
                try:
                    self._fire()
                except Exception:  # (a failing probe must not end the thread: the step's plan pauses anyway)
                    logger.exception("the early pause failed")

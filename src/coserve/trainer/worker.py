"""The trainer worker process: backward tasks in, optimizer steps applied in place, results out."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

import torch

from coserve.core.config import OptimConfig
from coserve.core.messages import BackwardTask, StepInfo, TaskResult, TrainerFailed
from coserve.cpu_split import fit_threads, pin_process
from coserve.gc_freeze import GCClock, freeze_startup_objects
from coserve.models.llama import LlamaForCausalLM
from coserve.models.peft_adapter import LoraAdapter
from coserve.parent_watch import exit_with_parent, leave_signals_to_parent
from coserve.trainer.backward import TaskLoss, TaskRow, task_backward
from coserve.trainer.lora_params import TrainableLoRA
from coserve.trainer.optim import LoRAOptimizer
from coserve.trainer.stream_gate import (
    CLOSED,
    CLOSURES,
    COMMIT,
    NOT_IN_TASK,
    POLLED,
    RELEASE,
    TASK_START,
    StreamGate,
    WaitMark,
    encode_progress,
    pauses_from_marks,
    read_idle_ms,
    read_marks,
    read_span_gc_ms,
    read_span_process_ms,
    read_span_thread_ms,
    read_spans,
)

logger = logging.getLogger(__name__)

POLL_POINTS = os.environ.get("COSERVE_TRAINER_POLL", "1") == "1"
"""Pause at the poll points inside the stretches too (:meth:`_Worker._poll_point`); ``0``: at
the boundaries only. Session 20 (H200, latency=50, two runs each on one host, alternating): pause
delay p99 2.59 / 1.45 ms with them against 3.25 / 3.62 ms without, FT tokens/s 3,125 / 3,337
against 3,432 / 3,149 (within the runs' spread): ``bench/results/latency_h200/session20/``."""

RELEASE_STRETCHES = os.environ.get("COSERVE_TRAINER_RELEASE", "0") == "1"
"""With the GPU-side gate, let the GPU start a stretch only once the CPU has queued all of it
(:meth:`_Worker._gated_boundary`): each boundary first waits on the flag page's ``RELEASE``
word, which the CPU advances on reaching the next boundary, and only then on the gate. A
host-bound stretch's kernels then no longer run as they are queued, so a gate that closes while
the CPU queues a stretch stops the GPU before any of it (today the GPU runs on until the next
poll point or boundary: the pause delay's ``gpu_dry`` tail, p99 4–6 ms in session 20), at the
cost of starting each stretch after its queuing. Off by default, measured in session 21
(``bench/results/latency_h200/README.md``, three runs each way): pause p99 1.63 / 1.54 / 2.11 ms against 3.04 / 2.44 / 2.49 ms without, at 12% fewer
FT tokens/s (2,828 against 3,201 on average) and a worse latency model (p99 19–21% against 16–17%)."""
CLOSED_AHEAD = int(os.environ.get("COSERVE_TRAINER_CLOSED_AHEAD", "0"))
"""``WorkerSpec.closed_boundaries_ahead``'s default (``COSERVE_TRAINER_CLOSED_AHEAD``; 0: off, the
trainer until session 37). While the engine runs prefill step after prefill step, the GPU-side gate
stays closed and the trainer's CPU queues on behind it up to ``gated_boundaries_ahead`` boundaries;
in the loss, whose boundaries carry many launches, it fills the launch queue first and spins in a
launch with a core busy (session 37, ``bench/latency_timeline.py --stretches``: every host stretch
of 100 ms or more in eight H100 latency runs, up to 309 ms with its process time equal to its wall
time, overlapped a run of back-to-back prefill steps of 136 ms or more). With N > 0 the CPU sleeps
on the grant once the GPU is N boundaries behind it and the grant is cleared: the GPU still holds
N boundaries of work for when the gate opens, and the CPU queues the rest after its wake-up. One
run on the device (session 38, no same-host baseline): one such stretch in 236 tasks (175 ms,
spinning in the loss) against 0.5-1.7% of the tasks of five earlier runs; off by default until a
same-host A/B (``bench/results/latency_h100/README.md``, "Session 38")."""
SYNC_DEBUG = os.environ.get("COSERVE_TRAINER_SYNC_DEBUG", "0") == "1"
"""On CUDA, have PyTorch flag each synchronizing operation of the trainer's tasks
(``torch.cuda.set_sync_debug_mode("warn")``, after the warm-up; :class:`_SyncSites` logs each call
site once with its stack, and the count per site when the worker stops). A diagnostic for the
host stretches that spin (session 38: one of 175 ms in the loss with its process time equal to its
wall time): a host wait on the device inside a stretch spins for as long as the engine holds the
gate closed. ``COSERVE_TRAINER_SYNC_DEBUG=1``; off by default."""
RELEASE_TIMEOUT_S = float(os.environ.get("COSERVE_TRAINER_RELEASE_TIMEOUT_MS", "50")) / 1e3
"""RELEASE_STRETCHES' safety net (``COSERVE_TRAINER_RELEASE_TIMEOUT_MS``, 50 by default): a
stretch whose release has waited this long is released by a watchdog thread
(:meth:`_Worker._watch_releases`, which looks four times per timeout). Work inside a stretch that
waits for the GPU (a device synchronization) would otherwise wait for a release that only the
same CPU, past that work, can write. Session 21's run with the switch on had 231 such releases
in 138 tasks, each leaving the GPU idle up to the timeout."""
STALL_FRAMES = 8  # (the innermost frames of a stalled stretch's stack the watchdog logs)
STALL_STACKS_LOGGED = 5  # (distinct stalled stacks logged per trainer)
SYNC_MESSAGE = "synchronizing"  # (in the warning PyTorch's sync debug mode gives: "called a synchronizing CUDA operation")


class _SyncSites:
    """:data:`SYNC_DEBUG`: counts the synchronizing operations PyTorch warns of, by the Python line
    that called them, logging each line's stack the first time; other warnings go on as before."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._show = warnings.showwarning

    def install(self) -> None:
        warnings.filterwarnings("always", message=f".*{SYNC_MESSAGE}")
        warnings.showwarning = self._note

    def _note(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
              file: Any = None, line: str | None = None) -> None:
        if SYNC_MESSAGE not in str(message):
            self._show(message, category, filename, lineno, file, line)
            return
        site = f"{filename}:{lineno}"
        self.counts[site] = self.counts.get(site, 0) + 1
        if self.counts[site] == 1:
            stack = "".join(traceback.format_stack(limit=STALL_FRAMES + 1)[:-1])
            logger.warning("trainer: a synchronizing CUDA operation at %s:\n%s", site, stack)

    def report(self) -> None:
        for site, count in sorted(self.counts.items(), key=lambda kv: -kv[1]):
            logger.warning("trainer: %d synchronizing CUDA operations at %s", count, site)


class _Pause(NamedTuple):
    """A pause of the trainer, as :class:`TaskResult` reports it: when (``time.monotonic()``), at
    which boundary, whether at a poll point, and how long (ms) the GPU had idled before it waiting
    for its stretch's release (RELEASE_STRETCHES; 0 otherwise)."""

    t: float
    layer: int
    polled: bool
    idle_ms: float = 0.0


@dataclass
class WorkerSpec:
    """Everything the worker needs. Tensors are shared with the engine (shared memory / CUDA IPC):
    ``model`` (base weights + the serving adapter stacks), ``store`` (captured activations),
    ``scales`` (per-slot LoRA scaling), ``banks`` ``[2, 3, P]`` (two copies of master weights +
    AdamW moments) and ``meta`` ``[3]`` int64: ``meta[0]`` the bank holding the last committed
    state (-1: none yet), ``meta[1 + b]`` the number of optimizer steps in bank ``b``."""

    model: LlamaForCausalLM
    store: torch.Tensor
    scales: torch.Tensor
    banks: torch.Tensor
    meta: torch.Tensor
    adapter: LoraAdapter
    slot: int
    dropout: float
    seed: int
    optim: OptimConfig
    grant: Any = None  # multiprocessing Event: set = the trainer may run, cleared = pause
    num_threads: int = 0
    # Without the GPU-side gate: the CPU waits at each boundary until the GPU has reached the
    # boundary before the previous one, so that a pause found by the CPU takes effect soon.
    max_layers_ahead: int = 1
    mlp_store: torch.Tensor | None = None  # the store's MLP planes, when it keeps them
    # The GPU-side gate's shared flag (coserve.trainer.stream_gate); the grant stays the CPU's.
    gate_flag: torch.Tensor | None = None
    # With the gate: how many boundaries the CPU may queue ahead of the GPU (a bound on memory
    # and on work queued behind a pause, not on the pause delay; COSERVE_TRAINER_AHEAD for A/B runs:
    # fewer keep a CPU that queues on while the gate is closed out of a full launch queue).
    gated_boundaries_ahead: int = field(default_factory=lambda: int(os.environ.get("COSERVE_TRAINER_AHEAD", "16")))
    # With the gate, while the engine holds it closed (the grant cleared): once the GPU is this many
    # boundaries behind the CPU, the CPU sleeps on the grant instead of queuing on (0: it queues on
    # up to gated_boundaries_ahead; COSERVE_TRAINER_CLOSED_AHEAD, CLOSED_AHEAD's docstring).
    closed_boundaries_ahead: int = field(default_factory=lambda: CLOSED_AHEAD)
    # Row lengths of one synthetic backward task the worker runs before its first real one
    # (_Worker.warm_up; empty: none): kernels compiled, library handles made, allocator grown.
    warmup_rows: tuple[int, ...] = ()
    # More synthetic tasks after that one (warmup_shapes; empty: none), each the row lengths of one.
    warmup_shapes: tuple[tuple[int, ...], ...] = ()
    # multiprocessing Event set once the worker is ready for tasks (after its warm-up)
    ready: Any = None
    # added to the process's CPU scheduling niceness at start (os.nice): a trainer computing on the
    # CPU shares the cores with the engine's steps, and yields them to it (the GPU's counterpart:
    # the trainer as a below-normal MPS client)
    niceness: int = 0
    # the CPUs the worker's threads run on (coserve.cpu_split, COSERVE_ENGINE_CPUS; empty: the
    # engine's, inherited)
    cpus: tuple[int, ...] = ()
    # float64 [3], shared: the wall-clock times (time.time) at which the worker's process began
    # to run its entry point (the interpreter up, its imports done, the spec's shared tensors
    # opened), had built its worker and had warmed up (0: not yet): TrainerProcess.start_stages
    stages: torch.Tensor | None = None


def warmup_rows(backward_tokens: int, max_seq_len: int) -> tuple[int, ...]:
    """Row lengths of a warm-up task as large as the largest real one: rows of ``max_seq_len``
    up to ``backward_tokens``, then one row of any length short of it (a real task closes on the
    sample that reaches ``backward_tokens``)."""
    full, rest = divmod(backward_tokens, max_seq_len)
    return (max_seq_len,) * full + ((rest,) if rest >= 2 else ()) + ((max(2, max_seq_len - 1),) if full else ())


WARMUP_SHAPES: Final = os.environ.get("COSERVE_TRAINER_WARMUP", "shapes") == "shapes"
"""Whether a trainer that warms up runs :func:`warmup_shapes`' tasks after :func:`warmup_rows`' one
(``COSERVE_TRAINER_WARMUP``: ``shapes``, the default; ``one``: that task alone, the trainer until
session 36). Much of a task's host work is done once per shape, the first time the shape comes:
the Triton kernels' variants for their integer arguments (divisible by 16 or not, 1) and the
libraries' GEMM and attention kernels, which CUDA loads when first launched
(``CUDA_MODULE_LOADING=LAZY``, PyTorch's default). A real task's shapes vary with its samples (the
layers' GEMMs by its tokens, the loss's last chunk by its target count, 1 to ``LOSS_CHUNK``), so
one warm-up task left most of them to the first minute of serving: on the H100 in session 35
(``timeline.tasks`` of ``bench/results/latency_h100/session35/``), the longest host stretch of a
task was a median 8.6 / 9.3 ms (90th percentile 44.9 / 58.2 ms) in the first 20 s against
1.6-2.2 ms (2.5-7.7 ms) in the warm replay (``bench/latency_timeline.py``,
``bench/results/latency_h100/session36/latency_timeline_73d0818.json``; of each run's twelve
longest, up to 113 and 314 ms, 6 and 6 in the loss: ``trainer_spans.longest_cpu``), and beside those stretches, with the trainer's
GPU stream run dry, busy decode steps ran faster than predicted. In isolation on the H100 in
session 36 (``bench/trainer_first_tasks.py``, 8 layers of the 8B shape, session 35's first 120 task
shapes; ``bench/results/latency_h100/session36/trainer_first_tasks_b4f5e69.log``), the first 40
tasks' longest host stretch was a median 6.0 ms (90th percentile 14.4 ms) after the one task,
3.9 ms (7.4 ms) after these, 5.4 ms (12.5 ms) with ``CUDA_MODULE_LOADING=EAGER``, 2.4-2.9 ms over
the next 80 in each; no Triton kernel compiled during a task; the warm-up took 0.5 s more. The
serving runs' much longer stretches (up to 0.3 s) did not show in isolation: they are the host
queueing behind the engine's back-to-back prefill steps (:data:`CLOSED_AHEAD`). Serving on one
(noisy) H100 host in session 37 (``bench/results/latency_h100/session37/latency_timeline_8b49351.json``),
the first 20 s' tasks' longest stretch had a 90th percentile of 35.8 / 13.8 / 35.1 ms in three runs
with these against 49.3 / 77.5 ms in two with the one task (medians 7.4-10.5 against 8.9-9.1 ms)."""
WARMUP_TARGETS: Final = (1, 2, 3, 4, 6, 8, 12, 15, 16, 17, 24, 31, 32, 33, 48, 64, 96, 128, 160, 192, 256, 320,
                         384, 448, 511)
""":func:`warmup_shapes`' one-row tasks: their target counts (a row of ``n + 1`` tokens), the loss's
chunk sizes up to ``LOSS_CHUNK`` (and the layers' small token counts) at the integers where
Triton's specializations change (1, multiples of 16) and geometrically between."""
WARMUP_LEVELS: Final = 5
""":func:`warmup_shapes`' multi-row tasks: how many token totals between half of
``backward_tokens`` and the largest task."""


def warmup_shapes(backward_tokens: int, max_seq_len: int) -> tuple[tuple[int, ...], ...]:
    """The row lengths of the warm-up tasks after :func:`warmup_rows`' (:data:`WARMUP_SHAPES`):
    one row of ``n + 1`` tokens for each ``n`` of :data:`WARMUP_TARGETS` that fits in
    ``max_seq_len``, then :data:`WARMUP_LEVELS` totals spread geometrically from half of
    ``backward_tokens`` toward the largest task (``backward_tokens + max_seq_len - 1``, :func:`warmup_rows`' own), each in rows
    of at most ``max_seq_len`` (at least two)."""
    tasks: list[tuple[int, ...]] = [(n + 1,) for n in WARMUP_TARGETS if n + 1 <= max_seq_len]
    lo, hi = max(4, backward_tokens // 2), backward_tokens + max_seq_len - 1
    totals = sorted({round(lo * (hi / lo) ** (i / WARMUP_LEVELS)) for i in range(WARMUP_LEVELS)}) \
        if hi > lo else [lo]
    for total in totals:
        parts = max(2, -(-total // max_seq_len))
        q, r = divmod(total, parts)
        rows = tuple(q + (1 if i < r else 0) for i in range(parts))
        if min(rows) >= 2:
            tasks.append(rows)
    return tuple(tasks)


def _stamp(spec: WorkerSpec, stage: int) -> None:
    if spec.stages is not None:
        spec.stages[stage] = time.time()


def run_worker(spec: WorkerSpec, tasks: Any, results: Any) -> None:
    """Process entry point: serve backward tasks until a ``None`` arrives (or the process that
    started it ends: :func:`exit_with_parent`)."""
    leave_signals_to_parent()  # (a Ctrl-C is the parent's to handle: it stops this process)
    _stamp(spec, 0)
    exit_with_parent()
    logging.basicConfig(level=os.environ.get("COSERVE_TRAINER_LOG", "WARNING"))
    if spec.cpus:
        pin_process(spec.cpus)  # (before torch starts its intra-op threads: they inherit the mask)
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    if spec.cpus:
        fit_threads(spec.cpus)
    if spec.niceness:
        try:
            os.nice(spec.niceness)
        except OSError as e:  # (an unprivileged process may always lower its priority; never fatal)
            logger.warning("trainer: could not lower its CPU priority: %s", e)
    task: BackwardTask | None = None
    try:
        worker = _Worker(spec)
        _stamp(spec, 1)
        warm = [rows for rows in (spec.warmup_rows, *spec.warmup_shapes) if rows]
        if warm:
            began = time.perf_counter()
            try:
                for rows in warm:
                    worker.warm_up(rows)
            except Exception:  # a warm-up is an optimization: the tasks run without it
                logger.exception("trainer warm-up failed; serving tasks without it")
                worker.forget_warm_up()
            logger.info("trainer warm-up: %d tasks in %.2f s", len(warm), time.perf_counter() - began)
        _stamp(spec, 2)
        if spec.ready is not None:
            spec.ready.set()
        freeze_startup_objects("trainer")
        sync_sites = None
        if SYNC_DEBUG and spec.store.device.type == "cuda":
            sync_sites = _SyncSites()
            sync_sites.install()
            torch.cuda.set_sync_debug_mode("warn")
        while True:
            task = tasks.get()
            if task is None:
                if sync_sites is not None:
                    sync_sites.report()
                return
            results.put(worker.run(task))
    except Exception:  # the engine restarts us from the last committed state
        results.put(TrainerFailed(task.task_id if task is not None else None, traceback.format_exc()))
        raise


class _AllocCounts(NamedTuple):
    """The CUDA caching allocator's counters of ``device`` so far (all 0 off CUDA): how often it
    freed its cache to retry an allocation, and how often it asked the driver for memory
    (``cudaMalloc``) and gave memory back (``cudaFree``)."""

    retries: int = 0
    device_allocs: int = 0
    device_frees: int = 0


def _alloc_counts(device: torch.device) -> _AllocCounts:
    if device.type != "cuda":
        return _AllocCounts()
    stats = torch.cuda.memory_stats(device)
    return _AllocCounts(int(stats.get("num_alloc_retries", 0)), int(stats.get("num_device_alloc", 0)),
                        int(stats.get("num_device_free", 0)))


class _Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        device = spec.store.device
        self.lora = TrainableLoRA(spec.adapter, dropout=spec.dropout, seed=spec.seed, device=device)
        self.optim = LoRAOptimizer(self.lora, spec.optim)
        self.loss_sum = 0.0
        self.num_targets = 0
        self._events: list[torch.cuda.Event] = []
        self._pauses: list[_Pause] = []
        self._polled_closure = -1  # the gate closure (flag[CLOSURES]) a poll point queued a wait for last
        self._paused_s = 0.0
        self._gpu_wait_s = 0.0
        self._gate: StreamGate | None = None
        self._allocs = _alloc_counts(device)
        if spec.gate_flag is not None and device.type == "cuda":
            self._gate = StreamGate.open(spec.gate_flag, device)
        # (the gate's word read through numpy at the poll points: a fraction of a tensor index's cost)
        self._gate_word = spec.gate_flag.numpy() if spec.gate_flag is not None else None
        self._anchor: tuple[torch.cuda.Event, float] | None = None
        self._marks: list[WaitMark] = []
        # the timed events of earlier tasks' marks, read and free for reuse (:meth:`_timed_event`)
        self._free_events: list[torch.cuda.Event] = []
        self._readback: torch.cuda.Event | None = None  # (:meth:`_before_readback`'s, made once)
        # RELEASE_STRETCHES: the number of the stretch that began at the last boundary (the GPU may
        # run stretch n once the page's RELEASE word is at n)
        self._stretch = 0
        self._released = 0  # the last value written into RELEASE (only ever raised)
        self._released_at = time.monotonic()
        self._release_lock = threading.Lock()
        self.watchdog_releases = 0  # stretches the watchdog released (a stretch's work waited on the GPU)
        self.closed_sleeps = 0  # sleeps on the grant behind a closed gate (closed_boundaries_ahead)
        # of them, those made while the engine held the gate closed (the GPU paused anyway: a CPU that
        # queued ahead into a full launch queue, say); the others left the GPU idle
        self.watchdog_closed = 0
        self._watchdog_reported = (0, 0)  # (of both, those a TaskResult has carried)
        # (the distinct places they were found at, with the gate closed or open: logged once each)
        self._watchdog_stacks: dict[bool, set[str]] = {True: set(), False: set()}
        self._main_thread = threading.get_ident()  # (the thread that queues the stretches)
        self._gc = GCClock()  # (each stretch's garbage collector time: TaskResult.span_gc_ms)
        self.stop_watchdog = threading.Event()  # (the worker's process ends with it; tests set it)
        if RELEASE_STRETCHES and self._gate is not None:
            threading.Thread(target=self._watch_releases, name="trainer-release-watchdog", daemon=True).start()
        self._last_layer: int | None = None  # the boundary passed last (on the CPU): the poll points'
        bank = int(spec.meta[0])
        if bank >= 0:
            self.optim.import_state(spec.banks[bank], int(spec.meta[1 + bank]))

    def warm_up(self, lengths: Sequence[int]) -> None:
        """One synthetic backward task, rows of ``lengths`` over the start of the store (whatever
        it holds), its gradient zeroed after, no optimizer step: the first real task then finds
        the trainer's Triton kernels compiled (on a fresh machine up to a second each), the cuBLAS
        and flash handles made and the caching allocator grown, instead of paying for them while
        the engine serves. It pauses for the engine's prefill steps at its boundaries as a real
        task does (a restarted trainer warms up while the engine serves); its pause and span
        records are dropped."""
        began = time.perf_counter()
        store = self.spec.store
        vocab = self.spec.model.config.vocab_size
        rows: list[TaskRow] = []
        offset = 0
        for n in lengths:
            n = min(n, store.shape[1] - offset)
            if n < 2:
                break
            rows.append(TaskRow(offset, tuple((offset + i) % vocab for i in range(n))))
            offset += n
        if not rows:
            return
        self._backward(rows, dropout_key=None)
        self._mark_task_end()
        self._read_gate_pauses()
        self.forget_warm_up()
        if store.is_cuda:
            torch.cuda.synchronize(store.device)
        logger.debug("trainer warm-up: a task of %d tokens in %.2f s", offset, time.perf_counter() - began)

    def forget_warm_up(self) -> None:
        """Drop what a warm-up task (finished or not) left: its gradient, boundary events, gate
        marks and pause records."""
        if self.lora.flat.grad is not None:
            self.lora.flat.grad.zero_()
        self._events.clear()
        self._marks = []
        self._release_all()
        self._pauses, self._paused_s, self._gpu_wait_s = [], 0.0, 0.0
        # (the first task's counts are its own)
        self._allocs = _alloc_counts(self.spec.store.device)
        self._watchdog_reported = (self.watchdog_releases, self.watchdog_closed)

    def run(self, task: BackwardTask) -> TaskResult:
        start = time.perf_counter()
        cpu_start = time.thread_time()
        sleeps_before = self.closed_sleeps
        rows = [TaskRow(s.offset, s.labels) for s in task.samples]
        loss = self._backward(rows, dropout_key=task.task_id)
        self.loss_sum += loss.loss_sum
        self.num_targets += loss.num_targets
        info = None
        if task.ends_step:
            # the optimizer step (which reads the gradient norm back) and the commit yield to a
            # prefill too
            self._boundary_then_sleep(COMMIT)
            res = self.optim.step(self.num_targets, self.loss_sum)
            self.loss_sum, self.num_targets = 0.0, 0
            self._commit()
            info = StepInfo(task.step, res.lr, res.grad_norm, res.skipped)
        self._mark_task_end()
        allocs, before = _alloc_counts(self.spec.store.device), self._allocs
        self._allocs = allocs
        if allocs.retries > before.retries:
            # NOTE: a retry frees the allocator's cached blocks, and freeing device memory waits
            # for the whole device: for the engine's queued steps, and for a gate that holds this
            # stream paused until the engine's prefill ends. The trainer's CPU stalls there.
            logger.warning("trainer: the CUDA caching allocator ran out of cached memory %d time(s) in task %d "
                           "and freed its cache (each time the device synchronizes); give the trainer more "
                           "memory or shorter tasks", allocs.retries - before.retries, task.task_id)
        spans, lags, span_process, span_gc, span_thread = self._read_gate_pauses()
        (reported, reported_closed), self._watchdog_reported = (self._watchdog_reported,
                                                                (self.watchdog_releases, self.watchdog_closed))
        pauses, self._pauses = self._pauses, []
        paused, self._paused_s = self._paused_s, 0.0
        gpu_wait, self._gpu_wait_s = self._gpu_wait_s, 0.0
        return TaskResult(task.task_id, loss.loss_sum, loss.num_targets, time.perf_counter() - start, info,
                          tuple(p.t for p in pauses), paused, gpu_wait, time.thread_time() - cpu_start,
                          tuple(p.layer for p in pauses), tuple(spans), tuple(lags),
                          tuple(p.polled for p in pauses), tuple(span_process), tuple(p.idle_ms for p in pauses),
                          tuple(span_gc), self.watchdog_releases - reported, self.watchdog_closed - reported_closed,
                          allocs.device_allocs - before.device_allocs, allocs.device_frees - before.device_frees,
                          self.closed_sleeps - sleeps_before, span_thread_ms=tuple(span_thread))

    def _backward(self, rows: list[TaskRow], dropout_key: int | None) -> TaskLoss:
        """One task's backward pass, from its start boundary on (a real task or the warm-up)."""
        if self._gate is not None:
            self._set_anchor()
        # NOTE: a task that starts while the engine runs a prefill queues no GPU work until the
        # pause ends, so a prefill that finds the trainer between tasks is never slowed by it.
        self._boundary_then_sleep(TASK_START)
        loss = task_backward(self.spec.model, self.lora, self.spec.store, rows, dropout_key=dropout_key,
                             at_layer_boundary=self._layer_boundary, at_poll_point=self._poll_point if POLL_POINTS else None,
                             mlp_store=self.spec.mlp_store, before_readback=self._before_readback)
        self._events.clear()
        return loss

    def _before_readback(self) -> None:
        """Before the task's loss is read back (``task_backward``'s ``before_readback``), with the
        GPU-side gate: wait for the GPU to finish the task's queued work on a blocking-sync event
        (the readback's own synchronization may spin on a core beside the engine's host thread),
        and count it as a wait on the GPU (:meth:`_note_wait`): the stretch from the task's last
        wait to the commit's is then its queuing alone. That wait is long when a poll point queued
        a wait in the task's last stretch and the engine holds the gate closed: it lasts until the
        engine's prefill ends. (Session 20's stretches that started at a poll point had a CPU p99
        of 16 / 83 ms against a p50 of 1.2–1.4 ms; the last stretch of a task that ends a step is
        one of them when a poll point came in its layer 0.) No grant wait here: without a wait
        in the last stretch the GPU finishes it, and the commit's boundary, queued next, is where
        the pause is seen."""
        if self._gate is None:
            return
        if RELEASE_STRETCHES:
            self._release(self._stretch)  # (the task's last stretch, queued whole now)
        began = time.perf_counter()
        if self._readback is None:
            self._readback = torch.cuda.Event(blocking=True)
        self._readback.record(torch.cuda.current_stream())
        self._readback.synchronize()
        waited = time.perf_counter() - began
        self._gpu_wait_s += waited
        self._note_wait(waited)

    def _mark_task_end(self) -> None:
        """The gate's progress word: between tasks, once the GPU gets here."""
        if self._gate is not None:
            try:
                self._gate.mark(torch.cuda.current_stream(), NOT_IN_TASK)
            except RuntimeError as exc:
                self._drop_gate(exc)

    def _layer_boundary(self, layer: int, polled: bool = False) -> None:
        """Pause here while the engine runs a prefill; keep GPU work queued ahead of the CPU to
        at most ``max_layers_ahead`` layers, so that a pause takes effect within about a layer.
        With the GPU-side gate, the pause is the GPU's (:meth:`_gated_boundary`). ``polled``: at
        a poll point inside the stretch of boundary ``layer`` (:meth:`_poll_point`)."""
        if not polled:
            self._last_layer = layer
        if self._gate is not None:
            try:
                self._gated_boundary(layer, polled)
                return
            except RuntimeError as exc:
                self._drop_gate(exc)
        if self.spec.store.is_cuda:
            event = torch.cuda.Event()
            event.record()
            self._events.append(event)
            if len(self._events) > self.spec.max_layers_ahead:
                began = time.perf_counter()
                self._events.pop(0).synchronize()
                self._gpu_wait_s += time.perf_counter() - began
        grant = self.spec.grant
        if grant is not None and not grant.is_set():
            began = time.perf_counter()
            if self.spec.store.is_cuda:
                torch.cuda.current_stream().synchronize()
            self._pauses.append(_Pause(time.monotonic(), layer, polled))
            grant.wait()
            self._paused_s += time.perf_counter() - began

    def _poll_point(self) -> None:
        """A point inside a stretch (``task_backward``'s ``at_poll_point``): when the engine has
        closed the gate, a pause here rather than at the next boundary.

        The host work of some stretches takes longer than their GPU work (the q/k/v projection's
        recompute and backward, ``o_proj``'s backward: ``bench/results/latency_h200/session19/``),
        so the GPU runs each kernel as soon as it is queued, and a pause found at the stretch's
        end waits for the rest of its queuing: the pause delay's ``gpu_dry`` tail. With the gate,
        a closed gate queues a wait here (labelled :data:`POLLED`); without it, a cleared grant
        pauses the CPU here as at a boundary. An open gate costs one read of a shared word."""
        layer = self._last_layer
        if layer is None:
            return
        word = self._gate_word
        if self._gate is not None and word is not None:
            if word[0] != CLOSED or word[CLOSURES] == self._polled_closure:
                return  # (open, or this closure's wait is queued already)
            self._polled_closure = int(word[CLOSURES])
        elif self.spec.grant is None or self.spec.grant.is_set():
            return
        self._layer_boundary(layer, polled=True)

    def _boundary_then_sleep(self, layer: int) -> None:
        """A boundary that CPU work waiting on the GPU follows (the task's set-up, the optimizer
        step's norm): with the GPU-side gate closed, sleep on the grant rather than in a CUDA
        synchronization (which may spin) until the engine reopens it."""
        self._layer_boundary(layer)
        grant = self.spec.grant
        if self._gate is not None and grant is not None and not grant.is_set():
            began = time.perf_counter()
            grant.wait()
            self._note_wait(time.perf_counter() - began)

    def _gated_boundary(self, layer: int, polled: bool = False) -> None:
        """Enqueue the gate's wait between two timed events; keep the CPU at most
        ``gated_boundaries_ahead`` boundaries ahead of the GPU. ``polled``: a wait at a poll point
        (:data:`POLLED`, not counted among the layer's boundaries, no progress word written).

        The CPU waits without spinning: while the engine holds the gate closed it sleeps on the
        grant (the GPU is stopped anyway), and the events are blocking-sync ones — a thread
        spinning in ``cudaEventSynchronize`` through every pause took a core beside the engine's
        host thread (session 6: the trainer's CPU time per task rose from 0.22 s to 0.27–0.76 s
        with the gate)."""
        assert self._gate is not None
        before, after = self._timed_event(), self._timed_event()
        stream = torch.cuda.current_stream()
        if polled:
            ordinal = POLLED
        else:
            last = next((m for m in reversed(self._marks) if m.ordinal != POLLED), None)
            ordinal = last.ordinal + 1 if last is not None and last.layer == layer else 0
        recorded_s, process_s, thread_s = time.monotonic(), time.process_time(), time.thread_time()
        gc_s = self._gc.total_s
        idle = None
        # (not at the task's start or the commit: their stretches read back from the GPU, which an
        # unreleased wait ahead of them would hold until their own next boundary, never reached)
        release = RELEASE_STRETCHES and not polled and layer >= 0
        if release:
            # the stretch before this boundary is queued whole: the GPU may run it; the one that
            # begins here waits (before the gate: a gate closed meanwhile stops it whole)
            self._release(self._stretch)
            self._stretch += 1
            idle = self._timed_event()
            idle.record(stream)
            self._gate.wait_released(stream, self._stretch)
        began = time.perf_counter()
        before.record(stream)
        self._gate.wait(stream)
        after.record(stream)
        gap_ms = (time.perf_counter() - began) * 1e3
        if not polled:
            self._gate.mark(stream, encode_progress(layer, min(ordinal, POLLED - 1)))
        self._marks.append(WaitMark(before, after, layer, ordinal, gap_ms, recorded_s, process_s=process_s,
                                    idle=idle, gc_s=gc_s, thread_s=thread_s))
        if not polled:
            self._sleep_behind_closed_gate()
        ahead = self.spec.gated_boundaries_ahead
        if RELEASE_STRETCHES:
            # (a run-ahead wait on the mark just queued would wait for a release that only comes
            # later; a poll point's mark lies in a stretch not released yet: no wait there)
            ahead = max(ahead, 1)
            if polled:
                return
            if not release:
                self._release(self._stretch)  # (the start's and the commit's boundaries: all of it)
        if len(self._marks) > ahead:
            began = time.perf_counter()
            with self._cpu_waiting():
                grant = self.spec.grant
                if grant is not None:
                    grant.wait()
                self._marks[-1 - ahead].after.synchronize()
            waited = time.perf_counter() - began
            self._gpu_wait_s += waited
            self._note_wait(waited)

    def _sleep_behind_closed_gate(self) -> None:
        """``closed_boundaries_ahead`` (:data:`CLOSED_AHEAD`): with the grant cleared and the GPU
        that many boundaries behind the CPU (the mark that far back not passed yet), sleep on the
        grant; counted as a wait, not as the next stretch's host time."""
        behind, grant = self.spec.closed_boundaries_ahead, self.spec.grant
        if behind <= 0 or grant is None or grant.is_set() or len(self._marks) <= behind:
            return
        if self._marks[-1 - behind].after.query():
            return
        began = time.perf_counter()
        with self._cpu_waiting():
            grant.wait()
        self.closed_sleeps += 1
        self._note_wait(time.perf_counter() - began)

    @contextlib.contextmanager
    def _cpu_waiting(self) -> Iterator[None]:
        """The CPU waits here (on the grant or the GPU), not stalled: RELEASE_STRETCHES' watchdog
        clock stops meanwhile."""
        if RELEASE_STRETCHES:
            self._released_at = float("inf")
        try:
            yield
        finally:
            if RELEASE_STRETCHES:
                self._released_at = time.monotonic()

    def _release(self, stretch: int) -> None:
        """RELEASE_STRETCHES: let the GPU run every stretch up to ``stretch`` (a store into the
        flag page's ``RELEASE`` word, as a wrapping 32-bit counter; never lowered)."""
        word = self._gate_word
        with self._release_lock:
            if word is None or stretch <= self._released:
                return
            word[RELEASE] = (stretch + 2**31) % 2**32 - 2**31
            self._released, self._released_at = stretch, time.monotonic()

    def _watch_releases(self) -> None:
        """The watchdog thread of :data:`RELEASE_TIMEOUT_S`: a stretch left unreleased that long is
        released (counted in ``watchdog_releases``, logged once)."""
        while not self.stop_watchdog.wait(RELEASE_TIMEOUT_S / 4):
            pending = self._stretch
            if pending > self._released and time.monotonic() - self._released_at > RELEASE_TIMEOUT_S:
                word = self._gate_word
                closed = word is not None and int(word[0]) == CLOSED
                self._release(pending)
                self.watchdog_releases += 1
                self.watchdog_closed += closed
                self._log_stalled_stack(closed)

    def _log_stalled_stack(self, closed: bool) -> None:
        """Where the stretch-queuing thread is, now that the watchdog released its stretch: the
        Python frames under which its CPU waited (a synchronization inside a stretch, or a long
        host stall), logged once per distinct place and state of the gate (``closed``)."""
        frame = sys._current_frames().get(self._main_thread)
        if frame is None:
            return
        stack = traceback.extract_stack(frame)[-STALL_FRAMES:]
        where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(stack))
        seen = self._watchdog_stacks[closed]
        if where in seen or len(seen) >= STALL_STACKS_LOGGED:
            return
        seen.add(where)
        logger.warning("trainer: a stretch waited %.0f ms for its release and the watchdog released it "
                       "(release %d, the gate %s); its CPU was at %s", RELEASE_TIMEOUT_S * 1e3,
                       self.watchdog_releases, "closed" if closed else "open", where)

    def _release_all(self) -> None:
        """RELEASE_STRETCHES: release every stretch queued so far, and number the next ones past
        them (after a failure that left waits on the stream that no boundary will release)."""
        if RELEASE_STRETCHES:
            self._stretch += 1 << 20
            self._release(self._stretch)

    def _timed_event(self) -> torch.cuda.Event:
        """A timed, blocking-sync CUDA event for a mark: one an earlier task's marks used and
        :meth:`_read_gate_pauses` read, else a new one. (Two per boundary, ~600 in a task of the 8B
        shape: made, recorded for the first time and destroyed anew, each cost the host a driver
        call more.)"""
        if self._free_events:
            return self._free_events.pop()
        return torch.cuda.Event(enable_timing=True, blocking=True)

    def _note_wait(self, seconds: float) -> None:
        """The CPU slept or waited on the GPU after queuing the last mark (not part of the next
        stretch's CPU time)."""
        if self._marks:
            last = self._marks[-1]
            self._marks[-1] = last._replace(waited_ms=last.waited_ms + seconds * 1e3)

    def _set_anchor(self) -> None:
        """A timed event on the idle stream, and the monotonic time it completed at."""
        anchor = torch.cuda.Event(enable_timing=True)
        torch.cuda.current_stream().synchronize()
        anchor.record()
        anchor.synchronize()
        self._anchor = (anchor, time.monotonic())

    def _drop_gate(self, exc: RuntimeError) -> None:
        """A driver error at the gate: pause on the CPU from here on."""
        logger.warning("the trainer's GPU-side pause failed (%s): pausing on the CPU from now on", exc)
        self._release_all()
        self._gate = None

    def _read_gate_pauses(self) -> tuple[list[tuple[int, int, float, float]], list[float], list[float], list[float],
                                         list[float]]:
        """Add the pauses the gate's waits made in this task, from their events (after the last
        completed), as ``(monotonic time, layer)`` like the CPU path's; returns the task's
        :attr:`TaskResult.spans`, its pauses' ``pause_lags_ms``, the spans' process CPU ms, their
        garbage collector ms and their queuing thread's CPU ms."""
        marks, self._marks = self._marks, []
        if not marks or self._anchor is None:
            return [], [], [], [], []
        marks[-1].after.synchronize()
        anchor, anchor_s = self._anchor
        pauses, paused_s = pauses_from_marks(anchor_s, *read_marks(anchor, marks), idle_ms=read_idle_ms(marks))
        self._pauses.extend(_Pause(p.t, p.layer, marks[p.mark].ordinal == POLLED, p.idle_ms) for p in pauses)
        self._paused_s += paused_s
        # NOTE: the CPU's waits for marks held by a closed gate were pauses, not GPU work.
        self._gpu_wait_s = max(0.0, self._gpu_wait_s - paused_s)
        spans = read_spans(marks)
        # (every mark's events have completed and been read: free for the next task's marks)
        self._free_events.extend(e for m in marks for e in (m.before, m.after, m.idle) if e is not None)
        return (spans, [p.lag_ms for p in pauses], read_span_process_ms(marks), read_span_gc_ms(marks),
                read_span_thread_ms(marks))

    def _commit(self) -> None:
        """Save the new state into the other bank, flip the bank index, then update serving."""
        spec = self.spec
        bank = 1 - int(spec.meta[0]) if int(spec.meta[0]) >= 0 else 0
        self.optim.export_state(spec.banks[bank])
        spec.meta[1 + bank] = self.optim.step_count
        if spec.banks.is_cuda:
            torch.cuda.synchronize(spec.banks.device)
        spec.meta[0] = bank  # NOTE: the commit point: one 8-byte write
        self.lora.write_serving(spec.model.lora_stacks, spec.slot, spec.scales)
        if spec.banks.is_cuda:
            # NOTE: the engine reopens admission when it reads our result; the new serving
            # weights must be in memory by then, not just queued on our stream.
            torch.cuda.synchronize(spec.banks.device)

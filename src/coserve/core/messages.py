"""Typed messages between the engine and the trainer worker (pickled through multiprocessing queues)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TaskSample:
    """One captured sample of a backward task: its tokens sit at ``[offset, offset + len(labels))``
    of every plane of the activation store."""

    sample_id: int
    offset: int
    labels: tuple[int, ...]


@dataclass(frozen=True)
class BackwardTask:
    """A batch of captured samples to differentiate. ``step`` is the optimizer step it belongs
    to; the step is applied after the task with ``ends_step``."""

    task_id: int
    step: int
    samples: tuple[TaskSample, ...]
    ends_step: bool


@dataclass(frozen=True)
class StepInfo:
    """An optimizer step that the trainer applied (or skipped: non-finite loss/gradient)."""

    step: int
    lr: float
    grad_norm: float
    skipped: bool


@dataclass(frozen=True)
class TaskResult:
    task_id: int
    loss_sum: float
    num_targets: int
    duration_s: float
    step_info: StepInfo | None = None
    pause_times: tuple[float, ...] = ()  # time.monotonic() when the worker found the grant cleared and its GPU queue drained
    paused_s: float = 0.0  # of duration_s, the time spent draining and waiting for the grant
    # of duration_s, outside pauses: the CPU waiting for the GPU at layer boundaries (the rest,
    # duration_s − paused_s − gpu_wait_s, is the CPU issuing work: a CPU-bound backward has
    # little of this, a GPU-bound or GPU-shared one much)
    gpu_wait_s: float = 0.0
    # CPU time the worker's thread used for the task (time.thread_time): near duration_s − paused_s
    # for a CPU-bound backward (spin-waits on the GPU count too), far below it for one that
    # waits on a lock, the scheduler or I/O
    cpu_s: float = 0.0
    # the boundary of each pause in pause_times: a layer index, L (the layer count) for the
    # loss, -1 for the optimizer step's commit, -2 for the task's start
    pause_layers: tuple[int, ...] = ()
    # with the GPU-side gate: each stretch from passing a boundary to reaching the next, as
    # (boundary layer, its ordinal among the boundaries of that layer, GPU ms, CPU ms) — the GPU
    # time a pause that comes during it waits for (GPU idle time waiting for the CPU included),
    # and the CPU's time queuing it (its sleeps and waits on the GPU excluded)
    spans: tuple[tuple[int, int, float, float], ...] = ()
    # with the GPU-side gate, for each pause in pause_times: how far (ms) the GPU was behind the
    # CPU at that boundary; near 0, the GPU had run dry before the CPU reached it, so the time to
    # the pause was the trainer's CPU (task set-up, optimizer step), not kernels beside the engine's
    pause_lags_ms: tuple[float, ...] = ()
    # for each pause in pause_times: whether it was taken at a poll point inside a stretch
    # (coserve.trainer.worker._Worker._poll_point) rather than at a boundary
    pause_polled: tuple[bool, ...] = ()
    # for each of spans: the CPU time (ms) all the worker's threads used in it (time.process_time);
    # far below the span's CPU ms (wall time), the host waited rather than worked there
    span_process_ms: tuple[float, ...] = ()
    # for each pause in pause_times: how long (ms) before it the GPU had stopped running the
    # trainer's kernels, waiting for its stretch's release (COSERVE_TRAINER_RELEASE; 0 otherwise)
    pause_idle_ms: tuple[float, ...] = ()
    # for each of spans: the time (ms) Python's garbage collector ran in it
    span_gc_ms: tuple[float, ...] = ()
    # COSERVE_TRAINER_RELEASE: the stretches of this task the watchdog released (their CPU had not
    # reached the next boundary RELEASE_TIMEOUT_S after the last release)
    watchdog_releases: int = 0
    watchdog_closed: int = 0  # of watchdog_releases, those made while the engine held the gate closed
    # the trainer's CUDA caching allocator in this task: its cudaMalloc and cudaFree calls (a driver
    # allocation can wait for the device, and so for a stream the gate or a release wait holds)
    device_allocs: int = 0
    device_frees: int = 0
    # COSERVE_TRAINER_CLOSED_AHEAD: the times this task's CPU slept on the grant behind a closed gate
    closed_sleeps: int = 0
    # for each of spans: the CPU time (ms) of the thread that queued it (time.thread_time); beside
    # span_process_ms, whether that thread or another one of the worker was busy
    span_thread_ms: tuple[float, ...] = ()


@dataclass(frozen=True)
class TrainerFailed:
    """The worker caught an exception it cannot recover from; it exits after sending this."""

    task_id: int | None
    error: str


def row_dropout_key(task_id: int, row: int) -> int:
    """The LoRA-dropout key of row ``row`` (its index in the backward task) of task ``task_id``.

    The engine's capture forward and the trainer's recompute both draw the row's masks with this
    key (``coserve.layers.lora.dropout_mask``), so that they apply the very same dropout.
    """
    return (task_id << 20) | row

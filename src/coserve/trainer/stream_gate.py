"""A pause the trainer's GPU stream takes by itself.

At each boundary of a backward task the trainer enqueues, on its CUDA stream, a wait on a 32-bit
flag in host memory that the engine process writes (``cuStreamWaitValue32`` on pinned, mapped
memory): ``1`` open, ``0`` closed. The engine closes the gate before a step that carries prefill
tokens and opens it after. The GPU then stops the trainer's work at the first boundary it reaches
while the gate is closed, whatever the trainer's CPU is doing: no host round trip (finding the
flag cleared, draining the stream) stands between the engine's clear and the trainer's pause, and
the CPU may queue work ahead of the GPU without delaying a pause.

The flag lives in a shared CPU tensor both processes map (:func:`new_flag`); the engine writes it
with an ordinary store (:func:`set_open`); the trainer registers its pages with the driver
(:meth:`StreamGate.open`). When this path is unavailable (no CUDA driver, a CPU store, a driver
error) the trainer falls back to pausing on its CPU at the same boundaries.

Timing: the trainer records a timed CUDA event just before and just after each wait. A wait that
held the stream is a pause that began when the GPU reached ``before``: ``after − before`` exceeds
the CPU's own gap between recording the two (on an idle GPU each event completes as soon as it is
recorded, so that gap alone shows between them) by :data:`BLOCKED_MS`.
:func:`pauses_from_marks` turns the events into ``time.monotonic()`` times through an anchor event
recorded on an idle stream at the start of the task.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)

OPEN, CLOSED = 1, 0
# flag[PROGRESS]: written by the trainer's GPU stream as it passes each boundary (the boundary's
# encode_progress code), and NOT_IN_TASK when it has finished a task's work: the engine can read,
# at no cost, what the trainer's kernels are doing beside its step
PROGRESS = 1
NOT_IN_TASK = 0
# flag[CLOSURES]: how many times the engine has closed the gate (set_open), so that the trainer
# queues one wait at a poll point per closure, not one in every stretch it queues while closed
CLOSURES = 2
# flag[RELEASE]: the last stretch the trainer's CPU has queued whole, written by that CPU and waited
# on by the trainer's own GPU stream (COSERVE_TRAINER_RELEASE, coserve.trainer.worker): the GPU
# starts a stretch only once all of its kernels are queued. The engine never touches it.
RELEASE = 3
# The boundaries' layer labels besides a layer's index (its own boundaries) and L (the loss's):
COMMIT = -1  # before the optimizer step's commit
TASK_START = -2  # at a task's start, before any of its GPU work
# The ordinal of a wait the trainer queued between two boundaries because it found the gate
# closed there (a poll point, coserve.trainer.worker._Worker._poll_point): not counted among the
# layer's boundaries, and not written into the progress word
POLLED = 255
FLAG_BYTES = 4096  # one page: cuMemHostRegister pins whole pages
CU_MEMHOSTREGISTER_PORTABLE = 0x01
CU_MEMHOSTREGISTER_DEVICEMAP = 0x02
CU_STREAM_WAIT_VALUE_GEQ = 0x0  # (int32_t)(*addr - value) >= 0: a counter at or past value, wrapping safely
CU_STREAM_WAIT_VALUE_EQ = 0x1
# A wait whose events are this much further apart on the GPU than their recording on the CPU held
# the stream (an open gate passes in a few µs; the engine pauses for whole prefill steps).
BLOCKED_MS = 0.1


def new_flag() -> torch.Tensor:
    """A page of shared memory for the gate, open: pass it to the trainer process."""
    flag = torch.zeros(FLAG_BYTES // 4, dtype=torch.int32).share_memory_()
    flag[0] = OPEN
    flag[PROGRESS] = NOT_IN_TASK
    flag[CLOSURES] = 0
    flag[RELEASE] = 0
    return flag


def encode_progress(layer: int, ordinal: int) -> int:
    """The 32-bit code of boundary ``(layer, ordinal)`` (layer ≥ :data:`TASK_START`,
    0 ≤ ordinal < 256), never :data:`NOT_IN_TASK`."""
    if layer < TASK_START or not 0 <= ordinal < 256:
        raise ValueError(f"boundary ({layer}, {ordinal}) out of range")
    return (layer + 3) << 8 | ordinal


def boundary_kind(layer: int, ordinal: int | None, num_layers: int) -> str:
    """A boundary's name in reports: ``start``, ``commit``, ``loss``, or ``layer#k`` (the k-th
    boundary of a layer: 0 its attention recompute, the last its attention backward; ``layer``
    when ``ordinal`` is None; ``poll`` for a :data:`POLLED` wait)."""
    if ordinal == POLLED:
        return "poll"
    if layer == TASK_START:
        return "start"
    if layer == COMMIT:
        return "commit"
    if layer == num_layers:
        return "loss"
    return "layer" if ordinal is None else f"layer#{ordinal}"


def read_progress(flag: torch.Tensor) -> tuple[int, int] | None:
    """The boundary ``(layer, ordinal)`` the trainer's GPU passed last, None between tasks."""
    code = int(flag[PROGRESS])
    return None if code == NOT_IN_TASK else ((code >> 8) - 3, code & 0xFF)


def set_open(flag: torch.Tensor, is_open: bool) -> None:
    """The engine side: open or close the gate (a plain store into the shared page; a closing
    counts in ``flag[CLOSURES]``, written first). Once a step: through numpy, 1.5 µs a call on the
    dev VM against 3.3 µs for the tensor store alone."""
    words = flag.numpy()
    if not is_open and words[0] != CLOSED:
        words[CLOSURES] += 1
    words[0] = OPEN if is_open else CLOSED


def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p,
                                                 ctypes.c_uint]
    lib.cuStreamWaitValue32_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    lib.cuStreamWriteValue32_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    for name in ("cuMemHostRegister_v2", "cuMemHostUnregister", "cuMemHostGetDevicePointer_v2",
                 "cuStreamWaitValue32_v2", "cuStreamWriteValue32_v2"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


class StreamGate:
    """The trainer side of the gate: :meth:`wait` enqueues "wait until open" on a stream."""

    def __init__(self, lib: ctypes.CDLL, flag: torch.Tensor, device_ptr: int) -> None:
        self._lib = lib
        self._flag = flag  # keeps the shared page mapped
        self._device_ptr = device_ptr

    @classmethod
    def open(cls, flag: torch.Tensor, device: torch.device) -> StreamGate | None:
        """Register ``flag``'s page with the CUDA driver for ``device``'s context; ``None`` (and a
        logged warning) when that is not possible: the caller pauses on its CPU instead."""
        if device.type != "cuda":
            return None
        try:
            if device.index is not None:
                torch.cuda.set_device(device)
            torch.zeros(1, device=device)  # the runtime makes its primary context current
            lib = _driver()
            ptr = flag.data_ptr()
            err = lib.cuMemHostRegister_v2(ptr, flag.numel() * flag.element_size(),
                                           CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP)
            if err != 0:
                raise RuntimeError(f"cuMemHostRegister failed (CUresult {err})")
            dptr = ctypes.c_uint64()
            err = lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ptr, 0)
            if err != 0:
                lib.cuMemHostUnregister(ptr)
                raise RuntimeError(f"cuMemHostGetDevicePointer failed (CUresult {err})")
        except (OSError, AttributeError, RuntimeError) as exc:
            logger.warning("the trainer pauses on its CPU at layer boundaries (no GPU-side gate: %s)", exc)
            return None
        return cls(lib, flag, int(dptr.value))

    def wait(self, stream: torch.cuda.Stream) -> None:
        """Work queued on ``stream`` after this runs only once the gate is open."""
        err = self._lib.cuStreamWaitValue32_v2(ctypes.c_void_p(stream.cuda_stream), self._device_ptr, OPEN,
                                               CU_STREAM_WAIT_VALUE_EQ)
        if err != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed (CUresult {err})")

    def wait_released(self, stream: torch.cuda.Stream, value: int) -> None:
        """Work queued on ``stream`` after this runs only once the page's ``RELEASE`` word has
        reached ``value`` (32-bit, compared as a wrapping counter)."""
        err = self._lib.cuStreamWaitValue32_v2(ctypes.c_void_p(stream.cuda_stream), self._device_ptr + 4 * RELEASE,
                                               value & 0xFFFFFFFF, CU_STREAM_WAIT_VALUE_GEQ)
        if err != 0:
            raise RuntimeError(f"cuStreamWaitValue32 (release) failed (CUresult {err})")

    def mark(self, stream: torch.cuda.Stream, code: int) -> None:
        """When ``stream`` gets here, it writes ``code`` into the flag page's progress word."""
        err = self._lib.cuStreamWriteValue32_v2(ctypes.c_void_p(stream.cuda_stream), self._device_ptr + 4 * PROGRESS,
                                                code, 0)
        if err != 0:
            raise RuntimeError(f"cuStreamWriteValue32 failed (CUresult {err})")

    def close(self) -> None:
        self._lib.cuMemHostUnregister(self._flag.data_ptr())


class WaitMark(NamedTuple):
    """The timed events around one gate wait, the boundary it was at, the CPU time between
    recording the two events and the monotonic time the first was recorded at."""

    before: torch.cuda.Event
    after: torch.cuda.Event
    layer: int
    ordinal: int  # among the boundaries of ``layer`` in the task (0: the first)
    record_gap_ms: float
    recorded_s: float
    waited_ms: float = 0.0  # the CPU's sleep or wait on the GPU after queuing this wait
    # time.process_time() beside recorded_s: the CPU time of all the process's threads (the
    # autograd engine runs a backward on its device thread while the calling thread waits)
    process_s: float = 0.0
    # COSERVE_TRAINER_RELEASE: a timed event before the wait for this stretch's release, where the
    # GPU stops running the trainer's kernels until its CPU has queued the whole stretch
    idle: torch.cuda.Event | None = None
    # seconds the process had spent in Python's garbage collector by recorded_s (the worker's
    # GCClock): a stretch's share of it is host time no kernel launch could use
    gc_s: float = 0.0
    # time.thread_time() beside recorded_s: the CPU time of the thread that queues the stretches
    # (beside process_s: whether that thread or another one of the process was busy)
    thread_s: float = 0.0


class GatePause(NamedTuple):
    """A pause at a gate: when the GPU reached it (``time.monotonic()``), the boundary, and how
    far the GPU was behind the CPU there (``lag_ms``: the GPU reached the wait that long after
    the CPU queued it; near 0, the GPU had run out of work before the CPU got to the boundary,
    so the time up to the pause was the trainer's CPU, not its kernels)."""

    t: float
    layer: int
    lag_ms: float
    mark: int  # the wait's position among the task's waits (its WaitMark)
    # how long before ``t`` the GPU had stopped at the wait for this stretch's release (ms, 0
    # without COSERVE_TRAINER_RELEASE): it ran none of the trainer's kernels from ``t - idle_ms`` on
    idle_ms: float = 0.0


def pauses_from_marks(anchor_s: float, anchor_to_before_ms: Sequence[float], held_ms: Sequence[float],
                      layers: Sequence[int], recorded_s: Sequence[float],
                      blocked_ms: float = BLOCKED_MS, idle_ms: Sequence[float] | None = None,
                      ) -> tuple[list[GatePause], float]:
    """The pauses a task's gate waits made and the seconds they held the stream. ``anchor_s`` is
    the monotonic time of the anchor event; for each wait, ``anchor_to_before_ms`` is the GPU time
    from the anchor to the event before it, ``held_ms`` the GPU time between its two events less
    the CPU time between recording them, ``recorded_s`` the monotonic time the CPU recorded the
    event before it, ``idle_ms`` (:func:`read_idle_ms`) the GPU time it had waited for the
    stretch's release before reaching the wait."""
    idle = list(idle_ms) if idle_ms is not None else [0.0] * len(held_ms)
    pauses = []
    paused_s = 0.0
    for i, (offset, held, layer, recorded, idle_i) in enumerate(zip(anchor_to_before_ms, held_ms, layers, recorded_s,
                                                                    idle, strict=True)):
        if held >= blocked_ms:
            t = anchor_s + offset / 1e3
            pauses.append(GatePause(t, layer, (t - recorded) * 1e3, i, idle_i))
            paused_s += held / 1e3
    return pauses, paused_s


def read_marks(anchor: torch.cuda.Event, marks: Sequence[WaitMark]
               ) -> tuple[list[float], list[float], list[int], list[float]]:
    """The GPU timings of ``marks`` for :func:`pauses_from_marks` (every event must have
    completed)."""
    offsets = [anchor.elapsed_time(m.before) for m in marks]
    held = [m.before.elapsed_time(m.after) - m.record_gap_ms for m in marks]
    return offsets, held, [m.layer for m in marks], [m.recorded_s for m in marks]


def read_idle_ms(marks: Sequence[WaitMark]) -> list[float]:
    """For each mark, the GPU ms from its ``idle`` event to its ``before`` one: the wait for its
    stretch's release (0 without one; every event must have completed)."""
    return [m.idle.elapsed_time(m.before) if m.idle is not None else 0.0 for m in marks]


def read_spans(marks: Sequence[WaitMark]) -> list[tuple[int, int, float, float]]:
    """``(layer, ordinal, gpu ms, cpu ms)`` of each stretch between two waits, labelled by the
    boundary it starts at: the GPU time from the first wait's end to the second's start (its
    release wait's, where there is one), and the
    CPU time between queuing the two, less the CPU's sleeps and waits on the GPU in between (every
    event must have completed). A stretch whose CPU time exceeds its GPU time left the GPU dry."""
    return [(a.layer, a.ordinal, a.after.elapsed_time(b.idle if b.idle is not None else b.before),
             (b.recorded_s - a.recorded_s) * 1e3 - a.waited_ms)
            for a, b in zip(marks[:-1], marks[1:], strict=True)]


def _span_clock_ms(marks: Sequence[WaitMark], clock: str) -> list[float]:
    """Each stretch's share (ms) of one of the marks' clocks (``process_s``, ``thread_s``, ``gc_s``):
    its end mark's reading less its start mark's, in :func:`read_spans`' order."""
    return [(getattr(b, clock) - getattr(a, clock)) * 1e3 for a, b in zip(marks[:-1], marks[1:], strict=True)]


def read_span_process_ms(marks: Sequence[WaitMark]) -> list[float]:
    """The CPU time all the process's threads used in each stretch of :func:`read_spans` (ms, the
    same order). Beside a stretch's host time (wall time), it tells host work from a host that
    waited: on a lock, the GIL, the driver or the OS's scheduler (a sleep or wait on the GPU
    after a boundary uses next to no CPU time, as it is left out of the host time too)."""
    return _span_clock_ms(marks, "process_s")


def read_span_thread_ms(marks: Sequence[WaitMark]) -> list[float]:
    """The CPU time the queuing thread used in each stretch of :func:`read_spans` (ms, the same
    order): near the stretch's host time, that thread ran throughout (Python, dispatch, or a spin
    in a driver call); near its process time but far below its host time, another thread of the
    process (the autograd engine's, a queue's feeder) ran while it waited."""
    return _span_clock_ms(marks, "thread_s")


def read_span_gc_ms(marks: Sequence[WaitMark]) -> list[float]:
    """The time (ms) Python's garbage collector ran in each stretch of :func:`read_spans` (the
    same order): a collection stops the host thread that queues the stretch, and the GPU with it
    once it has run what was queued."""
    return _span_clock_ms(marks, "gc_s")

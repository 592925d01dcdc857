"""The progress lines ``coserve serve`` prints while it runs (``--log-stats-interval``).

Every interval in which something happened, one line: requests answered, running and waiting,
generated tokens/s, the prompt tokens found in the prefix cache, and, while co-serving, the share that met the SLOs and how far fine-tuning
is (optimizer steps, samples of all epochs, loss, FT tokens/s, time left at the interval's
rate). When fine-tuning ends (its epochs done, or given up), one line at once with the adapter's
path: the server keeps serving.

A thread reads what is already published: the engine loop's :class:`EngineStats` snapshot and
the API's request counters. Nothing runs on the engine's per-step path.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from coserve.server.engine_thread import EngineStats

logger = logging.getLogger(__name__)


class RequestCounts(NamedTuple):
    """The API's request counters since start (:meth:`ServerMetrics.counts`)."""

    served: int  # requests answered to their end
    generated_tokens: int
    slo_met: int  # of the served ones, while co-serving (0 otherwise)
    slo_missed: int


class Snapshot(NamedTuple):
    """What one progress line compares: the counters and the engine's stats at one time."""

    time: float  # time.monotonic()
    requests: RequestCounts
    stats: EngineStats


def _counted(n: int, noun: str) -> str:
    """``1 step``, ``2 steps``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def progress_line(prev: Snapshot, cur: Snapshot) -> str | None:
    """The line for the interval from ``prev`` to ``cur``; None when nothing happened in it (no
    request answered, running or waiting, and no optimizer step of a fine-tuning still on)."""
    dt = max(cur.time - prev.time, 1e-9)
    s, p = cur.stats, prev.stats
    if p.ft_job != s.ft_job:  # (a new job's figures start at zero)
        p = EngineStats(coserving=True, ft_job=s.ft_job)
    served = cur.requests.served - prev.requests.served
    finetuning = s.coserving and s.ft_outcome is None
    if not (served or s.num_running or s.num_waiting or (finetuning and s.ft_optimizer_steps > p.ft_optimizer_steps)):
        return None
    parts = []
    if served or s.num_running or s.num_waiting:  # (an interval of fine-tuning alone: its part alone)
        generated = cur.requests.generated_tokens - prev.requests.generated_tokens
        parts.append(f"{_counted(served, 'request')} answered in the last {_duration(dt)} ({s.num_running} running, "
                     f"{s.num_waiting} waiting), {generated / dt:.1f} generated tokens/s")
        if s.prefix_cache is not None and p.prefix_cache is not None and s.prefix_cache[0] > p.prefix_cache[0]:
            asked, found = s.prefix_cache[0] - p.prefix_cache[0], s.prefix_cache[1] - p.prefix_cache[1]
            parts.append(f"prefix cache {100 * found / asked:.0f}% of prompt tokens")
        met = cur.requests.slo_met - prev.requests.slo_met
        missed = cur.requests.slo_missed - prev.requests.slo_missed
        if met + missed:
            total_met, total = cur.requests.slo_met, cur.requests.slo_met + cur.requests.slo_missed
            parts.append(f"SLOs met by {100 * met / (met + missed):.1f}% ({100 * total_met / total:.1f}% of {total} "
                         f"so far)")
    if finetuning:
        parts.append(_finetune_part(p, s, dt))
    return "coserve: " + "; ".join(parts)


def _loss(s: EngineStats) -> str:
    """``, loss FIRST -> LAST`` of the run's optimizer steps (what of it is finite), or ''."""
    losses = [f"{x:.3f}" for x in (s.ft_first_loss, s.ft_loss) if x is not None and math.isfinite(x)]
    return f", loss {' -> '.join(losses)}" if losses else ""


def _finetune_part(p: EngineStats, s: EngineStats, dt: float) -> str:
    part = f"fine-tuning: {_counted(s.ft_optimizer_steps, 'optimizer step')} in all"
    if s.ft_samples_total:
        done = s.ft_samples_retired / s.ft_samples_total
        part += f", {s.ft_samples_retired}/{s.ft_samples_total} samples ({100 * done:.0f}%)"
        rate = (s.ft_samples_retired - p.ft_samples_retired) / dt
        if rate > 0 and s.ft_samples_retired < s.ft_samples_total:
            part += f", ~{_duration((s.ft_samples_total - s.ft_samples_retired) / rate)} left at this rate"
    trained = s.ft_tokens_trained - p.ft_tokens_trained
    if trained >= 0:
        part += f"{_loss(s)}, {trained / dt:.0f} FT tokens/s in the last {_duration(dt)}"
    else:  # (a resume went back to its checkpoint, behind what the pause had counted: no rate to give)
        part += f"{_loss(s)}, resumed from its checkpoint in the last {_duration(dt)}"
    if s.ft_trainer_restarts:
        part += f", {_counted(s.ft_trainer_restarts, 'trainer restart')}"
    return part


ENDINGS = {"succeeded": "finished", "cancelled": "stopped early, the last committed step exported",
           "failed": "gave up (see the log), the last committed step exported",
           "paused": "paused at a checkpoint (a resume goes on from there)"}


def finished_line(s: EngineStats, serving: bool = True) -> str:
    """The line printed when fine-tuning ends (``s.ft_outcome`` set); ``serving``: the server
    goes on (False: it is shutting down)."""
    adapter = s.adapter_path if s.adapter_path is not None else "not exported (see the log)"
    return (f"coserve: fine-tuning {ENDINGS.get(s.ft_outcome or '', s.ft_outcome)}: "
            f"{_counted(s.ft_optimizer_steps, 'optimizer step')}, {s.ft_tokens_trained} tokens{_loss(s)}; "
            f"adapter: {adapter}" + ("; serving goes on" if serving else ""))


def _end_of(s: EngineStats) -> tuple[str | None, str, int]:
    return (s.ft_job, s.ft_outcome or "", s.ft_optimizer_steps)


class ProgressReporter:
    """Prints :func:`progress_line` every ``interval_s`` (0: never) and :func:`finished_line`
    within ``tick_s`` of fine-tuning's end, from a daemon thread (:meth:`start`, :meth:`stop`).

    ``read`` takes a :class:`Snapshot`; ``write`` prints a line. :meth:`check` is one tick.
    """

    def __init__(self, read: Callable[[], Snapshot], interval_s: float = 10.0,
                 write: Callable[[str], None] = lambda line: print(line, flush=True), tick_s: float = 1.0,
                 ends: Callable[[], Sequence[EngineStats]] = tuple) -> None:
        if interval_s < 0:
            raise ValueError(f"--log-stats-interval must be >= 0 seconds, got {interval_s:g}")
        self.read, self.interval_s, self.write, self.tick_s = read, interval_s, write, tick_s
        # every fine-tuning end so far, in order (EngineThread.ends): an end the engine's figures
        # have moved past by the next tick (a pause and its resume within it) is said as well
        self.ends = ends
        self._ends_seen = len(ends())
        self._last = read()
        # the ends said, each once: (job, outcome, optimizer steps), so that a paused job's later end is said too
        self._ended: set[tuple[str | None, str, int]] = set()
        if self._last.stats.ft_outcome is not None:
            self._ended.add(_end_of(self._last.stats))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> None:
        cur = self.read()
        ends = self.ends()
        for end in ends[self._ends_seen:]:
            self._say_end(end)
        self._ends_seen = len(ends)
        self._say_end(cur.stats)
        if self.interval_s and cur.time - self._last.time >= self.interval_s:
            line = progress_line(self._last, cur)
            if line is not None:
                self.write(line)
            self._last = cur

    def start(self) -> ProgressReporter:
        self._thread = threading.Thread(target=self._run, name="coserve-progress", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def close(self, stats: EngineStats) -> None:
        """At the server's shutdown (after :meth:`stop` and the engine's): fine-tuning's end, unless
        it was said while serving."""
        self._say_end(stats, serving=False)

    def _say_end(self, s: EngineStats, serving: bool = True) -> None:
        if s.coserving and s.ft_outcome is not None and _end_of(s) not in self._ended:
            self._ended.add(_end_of(s))
            self.write(finished_line(s, serving))

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.check()
            except Exception:  # a progress line is never worth the server: say it, go on
                logger.exception("the progress line failed")


def snapshot_reader(stats: Callable[[], EngineStats], counts: Callable[[], RequestCounts],
                    clock: Callable[[], float] = time.monotonic) -> Callable[[], Snapshot]:
    """A ``read`` for :class:`ProgressReporter` from the engine thread's and the API's counters."""
    return lambda: Snapshot(clock(), counts(), stats())

"""When each step's GPU work really ended, for steps the host did not wait for.

A step that samples a token waits for its GPU work (the tokens come back to the host), so the
host's clock at its end is the step's end. A step that samples nothing (a prompt's middle chunk,
an FT-only step) returns as soon as its kernels are queued: its wall time is its host time, and
the next step that waits absorbs its GPU time as well. On the H200 that put 18 ms on a
2,048-token prefill and 94 ms on the step after it (session 7), which the latency model took as
data.

:class:`StepClock` keeps the unwaited steps until a step that waits ends, then dates their ends
backwards from that moment with CUDA events recorded after each step's kernels: the end of step
``i`` is ``end(i + 1) − gpu time(event i → event i + 1)``. A step's duration is then counted from
when the GPU could start on it — its own start, or the end of the step before it if that was
later — to its end, the time the latency model prices for a step on an idle GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class TimedEvent(Protocol):
    """What a ``torch.cuda.Event(enable_timing=True)`` offers here."""

    def elapsed_time(self, end_event: Any) -> float: ...  # milliseconds

    def synchronize(self) -> None: ...


@dataclass
class _Pending:
    key: Any
    start_s: float
    event: TimedEvent


class StepClock:
    """Durations of steps in host time (``time.perf_counter``), in the order the steps ran."""

    def __init__(self) -> None:
        self._pending: list[_Pending] = []
        self._last_end_s: float | None = None  # the end of the last step whose end is known

    @property
    def pending(self) -> int:
        return len(self._pending)

    def step(self, key: Any, start_s: float, end_s: float, waited: bool,
             event: TimedEvent | None = None) -> list[tuple[Any, float]]:
        """A step that began at ``start_s`` and returned at ``end_s``. ``waited``: the host waited
        for its GPU work before returning (its end is ``end_s``); otherwise ``event`` was recorded
        after its kernels. Returns ``(key, duration s)`` of every step whose end is now known, in
        order: none while only unwaited steps came, all of them once one waits.

        A step without an event (the CPU, or a host that times nothing) counts as waited.
        """
        if not waited and event is not None:
            self._pending.append(_Pending(key, start_s, event))
            return []
        if event is not None and self._pending:
            # NOTE: recorded after the step's last kernels, it may not have been reached yet even
            # though the host waited for them; elapsed_time needs it reached
            event.synchronize()
        ends = [end_s]
        for later, earlier in zip([event, *[p.event for p in reversed(self._pending)]],
                                  reversed(self._pending), strict=False):
            # NOTE: an unwaited step followed by one without an event cannot be dated: the
            # waiting step's end stands in for it (an upper bound).
            gap_ms = earlier.event.elapsed_time(later) if later is not None else 0.0
            ends.append(ends[-1] - gap_ms / 1e3)
        ends.reverse()  # ends[i]: pending[i]'s end, the last one this step's
        out = []
        previous = self._last_end_s
        for p, end in zip([*self._pending, _Pending(key, start_s, event)], ends, strict=True):  # type: ignore[arg-type]
            began = p.start_s if previous is None else max(p.start_s, previous)
            out.append((p.key, max(end - began, 0.0)))
            previous = end
        self._pending.clear()
        self._last_end_s = end_s
        return out

    def drop(self) -> None:
        """Forget the unwaited steps (an engine reset, an interrupted step)."""
        self._pending.clear()

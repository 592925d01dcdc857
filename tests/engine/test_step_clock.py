"""StepClock: the ends of steps the host did not wait for, dated back from the next step that
waited through their events' GPU times."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from coserve.engine.step_clock import StepClock


@dataclass
class FakeEvent:
    gpu_ms: float  # when the GPU passed it

    def elapsed_time(self, end_event: FakeEvent) -> float:
        return end_event.gpu_ms - self.gpu_ms


def test_waited_steps_are_timed_at_once() -> None:
    clock = StepClock()
    assert clock.step("a", 0.0, 0.010, waited=True, event=FakeEvent(10.0)) == [("a", pytest.approx(0.010))]
    # the next one starts after the first ended: its own time
    assert clock.step("b", 0.012, 0.020, waited=True, event=FakeEvent(20.0)) == [("b", pytest.approx(0.008))]


def test_unwaited_steps_are_dated_back_from_the_next_wait() -> None:
    # The host queues step a (0 → 5 ms of host time) and returns; its kernels run until 40 ms.
    # Step b starts at 6 ms, is queued behind a's kernels, and waits: it returns at 90 ms, and the
    # GPU passed b's event 50 ms after a's. So a ended at 40 ms and b ran from 40 ms to 90 ms.
    clock = StepClock()
    assert clock.step("a", 0.0, 0.005, waited=False, event=FakeEvent(100.0)) == []
    assert clock.pending == 1
    got = clock.step("b", 0.006, 0.090, waited=True, event=FakeEvent(150.0))
    assert [k for k, _ in got] == ["a", "b"]
    assert got[0][1] == pytest.approx(0.040) and got[1][1] == pytest.approx(0.050)
    assert clock.pending == 0


def test_a_chain_of_unwaited_steps_and_a_gpu_that_had_gone_idle() -> None:
    clock = StepClock()
    clock.step("a", 0.0, 0.002, waited=False, event=FakeEvent(1000.0))  # ends at 30 ms (below)
    clock.step("b", 0.003, 0.005, waited=False, event=FakeEvent(1020.0))  # 20 ms after a: 50 ms
    # c starts at 60 ms, after b's kernels were done: its duration counts from its own start
    got = dict(clock.step("c", 0.060, 0.100, waited=True, event=FakeEvent(1070.0)))
    assert got["a"] == pytest.approx(0.030)
    assert got["b"] == pytest.approx(0.020)
    assert got["c"] == pytest.approx(0.040)


def test_no_event_means_waited_and_drop_forgets() -> None:
    clock = StepClock()
    assert clock.step("cpu", 0.0, 0.003, waited=False) == [("cpu", pytest.approx(0.003))]
    clock.step("a", 0.004, 0.005, waited=False, event=FakeEvent(0.0))
    clock.drop()
    assert clock.pending == 0
    assert clock.step("b", 0.006, 0.010, waited=True, event=FakeEvent(5.0)) == [("b", pytest.approx(0.004))]

"""StepClock: the ends of steps the host did not wait for, dated back from the next step that
waited through their events' GPU times."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from coserve.engine.step_clock import StepClock


@dataclass
class FakeEvent:
    gpu_ms: float  # when the GPU passed it

    reached: bool = False

    def elapsed_time(self, end_event: FakeEvent) -> float:
        assert self.reached and end_event.reached, "elapsed_time of an event the GPU has not reached"
        return end_event.gpu_ms - self.gpu_ms

    def synchronize(self) -> None:
        self.reached = True


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
    assert clock.step("a", 0.0, 0.005, waited=False, event=FakeEvent(100.0, reached=True)) == []
    assert clock.pending == 1
    got = clock.step("b", 0.006, 0.090, waited=True, event=FakeEvent(150.0))
    assert [k for k, _ in got] == ["a", "b"]
    assert got[0][1] == pytest.approx(0.040) and got[1][1] == pytest.approx(0.050)
    assert clock.pending == 0


def test_a_chain_of_unwaited_steps_and_a_gpu_that_had_gone_idle() -> None:
    clock = StepClock()
    clock.step("a", 0.0, 0.002, waited=False, event=FakeEvent(1000.0, reached=True))  # ends at 30 ms (below)
    clock.step("b", 0.003, 0.005, waited=False, event=FakeEvent(1020.0, reached=True))  # 20 ms after a: 50 ms
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


class FakeCudaEvent:
    """``torch.cuda.Event`` for :func:`test_engine_dates_its_unwaited_steps`: ``record`` stamps
    the fake GPU clock."""

    gpu_ms = 0.0  # where the next recorded event lands
    done_ms = 0.0  # how far the GPU is known to have got (a synchronize)

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at = 0.0

    def record(self) -> None:
        self.at = FakeCudaEvent.gpu_ms

    def synchronize(self) -> None:
        FakeCudaEvent.done_ms = max(FakeCudaEvent.done_ms, self.at)

    def elapsed_time(self, end_event: FakeCudaEvent) -> float:
        assert end_event.at <= FakeCudaEvent.done_ms, "elapsed_time of an event the GPU has not reached"
        return end_event.at - self.at


class RecordingCoServer:
    def __init__(self) -> None:
        self.ended: list[tuple[bool, float]] = []  # (timed, duration) of each on_step_end
        self.late: list[float] = []

    def on_step_end(self, record: object) -> None:
        self.ended.append((record.timed, record.duration_s))  # type: ignore[attr-defined]

    def observe_late(self, record: object, duration_s: float) -> None:
        assert not record.timed  # type: ignore[attr-defined]
        self.late.append(duration_s)


def test_engine_dates_its_unwaited_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's side on CUDA: a step that sampled nothing goes to the co-server untimed and
    gets its duration when a step that waits ends; after MAX_UNTIMED_STEPS of them the engine
    waits for one itself."""
    from types import SimpleNamespace

    import torch

    from coserve.core.host import StepView
    from coserve.engine import llm_engine
    from coserve.engine.llm_engine import LLMEngine, StepStats

    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)
    monkeypatch.setattr(FakeCudaEvent, "done_ms", 0.0)
    co = RecordingCoServer()
    engine = SimpleNamespace(runner=SimpleNamespace(device=SimpleNamespace(type="cuda")), step_clock=StepClock(),
                             coserver=co)
    view = StepView(now=0.0)

    def step(start: float, host_s: float, gpu_end_ms: float, waited: bool) -> None:
        FakeCudaEvent.gpu_ms = gpu_end_ms  # the event lands after the step's kernels
        LLMEngine._report_step(engine, view, StepStats(host_s, 0, 0, 0), start, [], (), False, waited)  # type: ignore[arg-type]

    step(0.0, 0.005, 40.0, waited=False)  # kernels end at GPU 40 ms, the host returned at 5 ms
    assert co.ended == [(False, pytest.approx(0.005))] and co.late == []
    step(0.006, 0.084, 90.0, waited=True)  # returns at 90 ms: its kernels ended then
    assert co.late == [pytest.approx(0.040)]
    assert co.ended[-1] == (True, pytest.approx(0.050))
    monkeypatch.setattr(llm_engine, "MAX_UNTIMED_STEPS", 2)
    for i in range(3):
        step(0.1 + i, 0.001, 200.0 + i, waited=False)
    assert [timed for timed, _ in co.ended[-3:]] == [False, False, True], "the third one is waited for"
    assert len(co.late) == 3

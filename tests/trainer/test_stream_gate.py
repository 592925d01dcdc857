"""The GPU-side pause gate: the flag, the pause bookkeeping, and on CUDA the stream wait itself
and a worker whose GPU stream stops at a layer boundary while the engine holds the gate closed."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from coserve.core.config import OptimConfig
from coserve.core.messages import BackwardTask, TaskResult, TaskSample
from coserve.models.loader import load_model
from coserve.models.peft_adapter import new_lora_adapter
from coserve.trainer.stream_gate import (
    CLOSED,
    CLOSURES,
    COMMIT,
    OPEN,
    POLLED,
    TASK_START,
    StreamGate,
    boundary_kind,
    encode_progress,
    new_flag,
    pauses_from_marks,
    read_progress,
    set_open,
)
from coserve.trainer.worker import WorkerSpec, _Worker

CUDA = torch.cuda.is_available()


def test_closures_are_counted_once_each() -> None:
    flag = new_flag()
    assert int(flag[CLOSURES]) == 0
    set_open(flag, False)
    set_open(flag, False)  # (already closed: the same closure)
    set_open(flag, True)
    set_open(flag, False)
    assert int(flag[CLOSURES]) == 2 and int(flag[0]) == CLOSED


def test_flag_is_shared_and_opens_and_closes() -> None:
    flag = new_flag()
    assert flag.is_shared() and int(flag[0]) == OPEN
    set_open(flag, False)
    assert int(flag[0]) == CLOSED
    set_open(flag, True)
    assert int(flag[0]) == OPEN


def test_progress_codes_round_trip() -> None:
    flag = new_flag()
    assert read_progress(flag) is None  # between tasks
    for layer, ordinal in ((TASK_START, 0), (COMMIT, 0), (0, 0), (31, 5), (32, 1), (4000, 255)):
        flag[1] = encode_progress(layer, ordinal)
        assert read_progress(flag) == (layer, ordinal)
    with pytest.raises(ValueError):
        encode_progress(TASK_START - 1, 0)
    with pytest.raises(ValueError):
        encode_progress(0, 256)


def test_boundary_names() -> None:
    names = [boundary_kind(layer, ordinal, 32) for layer, ordinal in ((TASK_START, 0), (COMMIT, 0), (32, 1), (5, 2))]
    assert names == ["start", "commit", "loss", "layer#2"]
    assert boundary_kind(5, None, 32) == "layer"
    assert boundary_kind(5, POLLED, 32) == boundary_kind(32, POLLED, 32) == "poll"


def test_pauses_are_the_waits_that_held_the_stream() -> None:
    # three waits: passed at once, held 5 ms, held below the threshold
    # the held one's event was recorded by the CPU 1.5 ms before the GPU reached it
    pauses, paused_s = pauses_from_marks(100.0, [1.0, 4.0, 30.0], [0.003, 5.0, 0.01], [2, 1, 0],
                                         [99.0, 100.0025, 100.02], blocked_ms=0.02)
    assert len(pauses) == 1
    assert pauses[0].t == pytest.approx(100.004) and pauses[0].layer == 1
    assert pauses[0].lag_ms == pytest.approx(1.5) and pauses[0].mark == 1  # (the second wait's)
    assert paused_s == pytest.approx(0.005)
    with pytest.raises(ValueError):
        pauses_from_marks(0.0, [1.0], [1.0, 2.0], [0], [0.0])


def test_a_pause_after_a_release_wait_carries_how_long_the_gpu_idled_before_it() -> None:
    # two waits held 5 ms each; the GPU had waited 2 ms for the second one's stretch release
    pauses, _ = pauses_from_marks(100.0, [1.0, 9.0], [5.0, 5.0], [2, 1], [99.0, 100.006], blocked_ms=0.02,
                                  idle_ms=[0.0, 2.0])
    assert [p.idle_ms for p in pauses] == [0.0, 2.0] and pauses[1].t == pytest.approx(100.009)
    # without release waits: none
    assert pauses_from_marks(100.0, [1.0], [5.0], [2], [99.0])[0][0].idle_ms == 0.0


def test_no_gate_without_cuda() -> None:
    assert StreamGate.open(new_flag(), torch.device("cpu")) is None


@pytest.mark.skipif(not CUDA, reason="a CUDA stream waits on the flag")
def test_gate_holds_a_stream_until_opened() -> None:
    flag = new_flag()
    gate = StreamGate.open(flag, torch.device("cuda"))
    assert gate is not None
    try:
        x = torch.zeros(4, device="cuda")
        torch.cuda.synchronize()
        set_open(flag, False)
        stream = torch.cuda.current_stream()
        gate.wait(stream)
        x.fill_(1.0)
        done = torch.cuda.Event()
        done.record()
        time.sleep(0.2)
        assert not done.query(), "work behind a closed gate ran"
        set_open(flag, True)
        done.synchronize()
        assert float(x.sum()) == 4.0
        # the stream writes its progress word when it gets there
        gate.mark(stream, encode_progress(3, 2))
        stream.synchronize()
        assert read_progress(flag) == (3, 2)
    finally:
        set_open(flag, True)
        gate.close()


def _worker_spec(device: str) -> tuple[WorkerSpec, BackwardTask, int]:
    model = load_model("tiny", num_lora_slots=1, max_lora_rank=8, device=device)
    cfg = model.config
    adapter = new_lora_adapter(num_layers=cfg.num_layers, shapes=cfg.linear_shapes(), rank=4, alpha=8,
                               target_modules=("q_proj", "v_proj"), seed=0)
    store = torch.randn(cfg.num_layers + 1, 32, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    numel = sum(a.numel() + b.numel() for a, b in adapter.weights.values())
    spec = WorkerSpec(model, store.to(device), torch.zeros(1, device=device), torch.zeros(2, 3, numel, device=device),
                      torch.tensor([-1, 0, 0]), adapter, 0, 0.0, 0, OptimConfig(lr=1e-3))
    task = BackwardTask(0, 0, (TaskSample(0, 0, tuple(range(10, 30))),), ends_step=True)
    return spec, task, cfg.num_layers


@pytest.mark.skipif(not CUDA, reason="the gate is a CUDA stream wait")
def test_gated_worker_pauses_on_its_gpu_stream_and_computes_the_same_loss() -> None:
    spec, task, num_layers = _worker_spec("cuda")
    expected = _Worker(spec).run(task)  # no gate: the CPU path (no grant either)

    spec.gate_flag = new_flag()
    worker = _Worker(spec)
    assert worker._gate is not None
    set_open(spec.gate_flag, False)
    result: list[TaskResult] = []
    thread = threading.Thread(target=lambda: result.append(worker.run(task)))
    thread.start()
    time.sleep(0.5)
    assert not result, "the task finished behind a closed gate"
    opened = time.monotonic()
    set_open(spec.gate_flag, True)
    thread.join(timeout=60)
    # NOTE: the flag's page unregistered: a later flag allocated at the same address could not be
    # registered again (CUresult 712, session 19)
    worker._gate.close()
    assert result
    got = result[0]
    assert got.loss_sum == pytest.approx(expected.loss_sum, rel=1e-4)
    # the GPU stopped at the first boundary (the task's start, before any of its work) until the
    # gate opened
    assert got.pause_layers == (TASK_START,) and got.pause_polled == (False,)
    assert got.pause_times[0] < opened
    assert got.paused_s >= 0.3
    # the GPU stretches between boundaries: the set-up's from the start, then the loss's, each
    # at or after the previous
    assert len(got.pause_lags_ms) == 1
    torch.cuda.synchronize()
    assert read_progress(spec.gate_flag) is None  # the GPU wrote "between tasks" at the end
    assert got.spans and got.spans[0][:2] == (TASK_START, 0) and got.spans[1][:2] == (num_layers, 0)
    assert all(ms >= 0.0 and cpu_ms > -0.1 for _, _, ms, cpu_ms in got.spans)
    assert len(got.span_process_ms) == len(got.spans) and all(ms >= 0.0 for ms in got.span_process_ms)
    # the queuing thread's own CPU time: part of the process's (both read at each boundary)
    assert len(got.span_thread_ms) == len(got.spans)
    assert all(0.0 <= t <= p + 0.1 for t, p in zip(got.span_thread_ms, got.span_process_ms, strict=True))


@pytest.mark.skipif(not CUDA, reason="the gate is a CUDA stream wait")
def test_gated_worker_queues_a_wait_at_a_poll_point_when_the_gate_closes_mid_stretch() -> None:
    """The gate closes while the worker's CPU is between two boundaries: the worker queues a
    wait at its next poll point (ordinal POLLED, no progress word), its GPU stream stops there
    until the gate opens, and the loss is the same."""
    spec, task, num_layers = _worker_spec("cuda")
    expected = _Worker(spec).run(task)
    spec.gate_flag = new_flag()
    worker = _Worker(spec)
    assert worker._gate is not None
    poll = worker._poll_point
    closed: list[float] = []

    def polling() -> None:
        if not closed:  # the engine closes the gate now, and opens it 0.3 s later
            set_open(spec.gate_flag, False)
            closed.append(time.monotonic())
            threading.Timer(0.3, set_open, (spec.gate_flag, True)).start()
        poll()

    worker._poll_point = polling  # type: ignore[method-assign]
    try:
        got = worker.run(task)
    finally:
        worker._gate.close()
    assert got.loss_sum == pytest.approx(expected.loss_sum, rel=1e-4)
    assert got.pause_layers == (num_layers - 1,) and got.pause_polled == (True,) and got.paused_s >= 0.2
    assert got.pause_times[0] - closed[0] < 0.05
    polled = [s for s in got.spans if s[1] == POLLED]
    assert len(polled) == 1 and polled[0][0] == num_layers - 1


class _FakeEvent:
    """A CUDA event and stream stand-in (the CPU build of torch has neither)."""

    def __init__(self, **kwargs: object) -> None:
        pass

    def record(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: object) -> float:
        return 0.0


def _fake_cuda_events(monkeypatch: pytest.MonkeyPatch, event: type[_FakeEvent] = _FakeEvent) -> None:
    monkeypatch.setattr(torch.cuda, "Event", event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: _FakeEvent())


class _FakeGate:
    """A gate stand-in that queues nothing (the worker's bookkeeping around it runs as on CUDA)."""

    def wait(self, stream: object) -> None:
        pass

    def mark(self, stream: object, code: int) -> None:
        pass


def _gated_cpu_worker(spec: WorkerSpec, monkeypatch: pytest.MonkeyPatch,
                      event: type[_FakeEvent] = _FakeEvent) -> _Worker:
    """A worker on the CPU that takes the GPU-side gate's path, with stand-ins for the gate and
    the CUDA events."""
    _fake_cuda_events(monkeypatch, event)
    worker = _Worker(spec)
    worker._gate = _FakeGate()  # type: ignore[assignment]
    return worker


def test_a_failing_gate_falls_back_to_the_cpu_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver error at a gate wait does not fail the task: the worker pauses on its CPU from
    then on, and the loss is the same."""
    spec, task, _ = _worker_spec("cpu")
    expected = _Worker(spec).run(task)

    class FailingGate:
        calls = 0

        def wait(self, stream: object) -> None:
            FailingGate.calls += 1
            raise RuntimeError("cuStreamWaitValue32 failed (CUresult 1)")

    _fake_cuda_events(monkeypatch)
    worker = _Worker(spec)
    worker._gate = FailingGate()  # type: ignore[assignment]
    got = worker.run(task)
    assert FailingGate.calls == 1 and worker._gate is None
    assert got.loss_sum == pytest.approx(expected.loss_sum, rel=1e-6)


def test_a_poll_point_queues_one_wait_per_gate_closure(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the gate, a poll point that finds it closed queues a wait (POLLED); the poll points
    after it queue none until the engine closes the gate again, and an open gate queues none."""
    spec, task, _ = _worker_spec("cpu")
    expected = _Worker(spec).run(task)

    flag = new_flag()
    spec.gate_flag = flag
    worker = _gated_cpu_worker(spec, monkeypatch)
    polls = 0
    poll, gated = worker._poll_point, worker._gated_boundary
    queued: list[bool] = []

    def polling() -> None:
        nonlocal polls
        polls += 1
        if polls in (1, 4):
            set_open(flag, False)  # the engine closes the gate (a prefill step starts)
        elif polls == 3:
            set_open(flag, True)
        poll()

    def boundary(layer: int, polled: bool = False) -> None:
        queued.append(polled)
        gated(layer, polled)

    worker._poll_point = polling  # type: ignore[method-assign]
    worker._gated_boundary = boundary  # type: ignore[method-assign]
    got = worker.run(task)
    assert polls > 5
    assert queued.count(True) == 2  # one for each of the two closures
    # each stretch between two waits with the CPU time the process used in it
    assert got.spans and len(got.span_process_ms) == len(got.spans)
    assert all(ms >= 0.0 for ms in got.span_process_ms) and sum(got.span_process_ms) > 0.0
    assert got.loss_sum == pytest.approx(expected.loss_sum, rel=1e-6)


def test_the_loss_readback_waits_for_the_gpu_outside_the_last_stretch(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the gate, the worker waits for its GPU before reading the loss back, on a blocking
    event, and counts that as a wait on the GPU: the stretch that ends at the commit's wait is its
    queuing alone."""
    spec, task, _ = _worker_spec("cpu")
    waits: list[str] = []

    class ReadbackEvent(_FakeEvent):
        def __init__(self, **kwargs: object) -> None:
            self.timed = bool(kwargs.get("enable_timing"))

        def synchronize(self) -> None:
            if not self.timed:  # the readback's (the gate's events are timed ones)
                waits.append("readback")
                time.sleep(0.05)

    worker = _gated_cpu_worker(spec, monkeypatch, ReadbackEvent)
    gated = worker._gated_boundary

    def boundary(layer: int, polled: bool = False) -> None:
        waits.append(f"boundary {layer}")
        gated(layer, polled)

    worker._gated_boundary = boundary  # type: ignore[method-assign]
    got = worker.run(task)
    # after the last layer's boundaries, before the commit's
    assert waits.count("readback") == 1
    assert waits.index("readback") == len(waits) - 2 and waits[-1] == f"boundary {COMMIT}"
    assert got.spans[-1][0] == 0 and got.spans[-1][3] < 40.0  # (the 50 ms wait left out)
    assert got.gpu_wait_s >= 0.05


def test_the_marks_reuse_the_events_of_earlier_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The timed events of a task's marks are made once: the next task's marks record the ones
    the last task's read, and the loss is the same."""
    spec, task, _ = _worker_spec("cpu")
    expected = _Worker(spec).run(task)
    made: list[object] = []

    class CountedEvent(_FakeEvent):
        def __init__(self, **kwargs: object) -> None:
            if kwargs.get("enable_timing") and kwargs.get("blocking"):
                made.append(self)

    worker = _gated_cpu_worker(spec, monkeypatch, CountedEvent)
    first = worker.run(task)
    after_first = len(made)
    second = worker.run(task)
    assert after_first == 2 * (len(first.spans) + 1)  # two per mark, one mark more than stretches
    assert len(made) == after_first and len(second.spans) == len(first.spans)
    assert first.loss_sum == pytest.approx(expected.loss_sum, rel=1e-6)


def test_with_release_each_stretch_waits_until_the_cpu_queued_it_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """COSERVE_TRAINER_RELEASE: each boundary releases the stretch before it and queues a wait for
    its own (before the gate's), the task's last stretch is released before the loss is read back,
    and the loss is the same."""
    from coserve.trainer import worker as worker_module
    from coserve.trainer.stream_gate import RELEASE

    spec, task, _ = _worker_spec("cpu")
    expected = _Worker(spec).run(task)
    monkeypatch.setattr(worker_module, "RELEASE_STRETCHES", True)
    flag = new_flag()
    spec.gate_flag = flag
    calls: list[tuple[str, int, int]] = []  # (call, its value, the RELEASE word then)

    class ReleaseGate(_FakeGate):
        def wait(self, stream: object) -> None:
            calls.append(("gate", 0, int(flag[RELEASE])))

        def wait_released(self, stream: object, value: int) -> None:
            calls.append(("release", value, int(flag[RELEASE])))

    class ReadbackEvent(_FakeEvent):
        def __init__(self, **kwargs: object) -> None:
            self.timed = bool(kwargs.get("enable_timing"))

        def synchronize(self) -> None:
            if not self.timed:
                calls.append(("readback", 0, int(flag[RELEASE])))

    worker = _gated_cpu_worker(spec, monkeypatch, ReadbackEvent)
    worker._gate = ReleaseGate()  # type: ignore[assignment]
    gated = worker._gated_boundary

    def boundary(layer: int, polled: bool = False) -> None:
        calls.append(("boundary", layer, int(flag[RELEASE])))
        gated(layer, polled)

    worker._gated_boundary = boundary  # type: ignore[method-assign]
    got = worker.run(task)
    # no release wait at the task's start or the commit (their stretches read back from the GPU)
    waited_at = [calls[i - 1][1] for i, c in enumerate(calls) if c[0] == "release"]
    assert waited_at and all(layer >= 0 for layer in waited_at)
    assert {c[1] for c in calls if c[0] == "boundary"} >= {TASK_START, COMMIT}
    releases = [c for c in calls if c[0] == "release"]
    assert releases and [v for _, v, _ in releases] == list(range(1, len(releases) + 1))
    # at each boundary: the stretch before it released, its own not yet
    assert all(word == value - 1 for _, value, word in releases)
    # each release wait comes right before a gate wait (the gate is checked once the stretch may run)
    for i, c in enumerate(calls):
        if c[0] == "release":
            assert calls[i + 1][0] == "gate"
    # before the readback the task's last stretch is released: the word is at the stretch begun
    # at the last boundary before it (the commit's boundary comes after)
    (at,) = [i for i, c in enumerate(calls) if c[0] == "readback"]
    last_before = [c for c in calls[:at] if c[0] == "release"][-1]
    assert calls[at][2] == last_before[1]
    assert got.pause_idle_ms == () and got.loss_sum == pytest.approx(expected.loss_sum, rel=1e-6)
    # a gate that fails releases whatever is still waiting
    worker._drop_gate(RuntimeError("cuStreamWaitValue32 failed"))
    assert int(flag[RELEASE]) > releases[-1][1] + 1000


@pytest.mark.skipif(not CUDA, reason="the release wait is a CUDA stream wait")
def test_gated_worker_with_release_waits_finishes_with_the_same_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    """COSERVE_TRAINER_RELEASE on the GPU: every stretch waits on the RELEASE word its CPU
    advances; the task ends (no wait left unreleased) with the loss of the plain path, and the
    pauses and spans read back."""
    from coserve.trainer import worker as worker_module

    spec, task, _ = _worker_spec("cuda")
    expected = _Worker(spec).run(task)
    monkeypatch.setattr(worker_module, "RELEASE_STRETCHES", True)
    spec.gate_flag = new_flag()
    worker = _Worker(spec)
    assert worker._gate is not None
    result: list[TaskResult] = []
    thread = threading.Thread(target=lambda: result.append(worker.run(task)), daemon=True)
    thread.start()
    thread.join(timeout=60)
    stuck = thread.is_alive()
    if stuck:  # (let the stream go before the page is unregistered)
        worker._release_all()
        thread.join(timeout=30)
    worker._gate.close()
    worker.stop_watchdog.set()
    assert not stuck and result, "the task did not finish: a release wait was left unreleased"
    got = result[0]
    assert got.loss_sum == pytest.approx(expected.loss_sum, rel=1e-4)
    assert got.spans and all(ms >= 0.0 for _, _, ms, _ in got.spans)
    assert len(got.pause_idle_ms) == len(got.pause_times)
    assert worker.watchdog_releases == 0  # no stretch's work waited on the GPU


def test_the_release_watchdog_frees_a_stretch_left_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stretch unreleased for RELEASE_TIMEOUT_S while the CPU queues (work in it waited on the
    GPU) is released by the watchdog; one whose CPU sleeps on the engine's pause is not."""
    from coserve.trainer import worker as worker_module
    from coserve.trainer.stream_gate import RELEASE

    monkeypatch.setattr(worker_module, "RELEASE_STRETCHES", True)
    monkeypatch.setattr(worker_module, "RELEASE_TIMEOUT_S", 0.02)
    spec, _, _ = _worker_spec("cpu")
    spec.gate_flag = flag = new_flag()
    worker = _gated_cpu_worker(spec, monkeypatch)
    worker._stretch, worker._released, worker._released_at = 5, 4, float("inf")  # the CPU waits
    threading.Thread(target=worker._watch_releases, daemon=True).start()
    time.sleep(0.1)
    assert int(flag[RELEASE]) == 0 and worker.watchdog_releases == 0
    worker._released_at = time.monotonic()  # the CPU queues again, and stalls
    deadline = time.monotonic() + 2.0
    while int(flag[RELEASE]) != 5 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert int(flag[RELEASE]) == 5 and worker.watchdog_releases == 1
    worker._release(3)  # (never lowered)
    assert int(flag[RELEASE]) == 5
    worker.stop_watchdog.set()


def test_each_stretch_carries_the_garbage_collectors_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A collection inside a stretch shows in that stretch's TaskResult.span_gc_ms, and only there."""
    import gc

    spec, task, _ = _worker_spec("cpu")
    worker = _gated_cpu_worker(spec, monkeypatch)
    boundary = worker._layer_boundary
    collected: list[int] = []

    def collecting(layer: int, polled: bool = False) -> None:
        if layer == 0 and not polled and not collected:
            collected.append(gc.collect())  # (before the boundary's mark: in the stretch that ends there)
        boundary(layer, polled)

    monkeypatch.setattr(worker, "_layer_boundary", collecting)
    got = worker.run(task)
    assert collected and len(got.span_gc_ms) == len(got.spans)
    held = [i for i, ms in enumerate(got.span_gc_ms) if ms > 0.0]
    assert held, got.span_gc_ms
    # the collection ran in the stretch before layer 0's first boundary: the one that began at
    # layer 1's last
    assert got.spans[held[-1] + 1][:2] == (0, 0)
    assert all(ms >= 0.0 for ms in got.span_gc_ms)


def test_the_release_watchdog_logs_where_the_stalled_cpu_is(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """The watchdog names the frames the stretch-queuing thread is stalled in (once per place),
    and the task's result counts the releases."""
    from coserve.trainer import worker as worker_module
    from coserve.trainer.stream_gate import RELEASE

    monkeypatch.setattr(worker_module, "RELEASE_STRETCHES", True)
    monkeypatch.setattr(worker_module, "RELEASE_TIMEOUT_S", 0.02)
    spec, task, _ = _worker_spec("cpu")
    spec.gate_flag = flag = new_flag()
    worker = _gated_cpu_worker(spec, monkeypatch)
    stalled = threading.Event()

    def _a_sync_inside_a_stretch() -> None:
        stalled.wait(timeout=5.0)

    queuing = threading.Thread(target=_a_sync_inside_a_stretch, daemon=True)
    queuing.start()
    worker._main_thread = queuing.ident
    worker._stretch, worker._released, worker._released_at = 2, 1, time.monotonic()
    with caplog.at_level("WARNING", logger="coserve.trainer.worker"):
        threading.Thread(target=worker._watch_releases, daemon=True).start()
        deadline = time.monotonic() + 2.0
        while int(flag[RELEASE]) != 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        worker._stretch, worker._released_at = 3, time.monotonic()  # the same place again
        while int(flag[RELEASE]) != 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        flag[0] = CLOSED  # the same place, the engine holding the gate closed
        worker._stretch, worker._released_at = 4, time.monotonic()
        while int(flag[RELEASE]) != 4 and time.monotonic() < deadline:
            time.sleep(0.005)
        worker.stop_watchdog.set()
        stalled.set()
    assert worker.watchdog_releases == 3 and worker.watchdog_closed == 1
    logged = [r.getMessage() for r in caplog.records if "watchdog released it" in r.getMessage()]
    assert len(logged) == 2 and all("_a_sync_inside_a_stretch" in m for m in logged)
    assert "the gate open" in logged[0] and "the gate closed" in logged[1]
    # the next task's result carries the releases, the one after it none
    flag[0] = OPEN
    monkeypatch.setattr(worker_module, "RELEASE_STRETCHES", False)  # (the fake gate has no release wait)
    got = worker.run(task)
    assert (got.watchdog_releases, got.watchdog_closed) == (3, 1)
    got = worker.run(task)
    assert (got.watchdog_releases, got.watchdog_closed) == (0, 0)


def test_each_task_reports_its_own_driver_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    """TaskResult.device_allocs / device_frees are the allocator's cudaMalloc / cudaFree calls in
    that task alone (the warm-up's are not the first task's)."""
    from coserve.trainer import worker as worker_module

    counts = iter([(0, 5, 0), (0, 9, 0), (0, 12, 1), (0, 12, 1), (0, 12, 1)])
    monkeypatch.setattr(worker_module, "_alloc_counts",
                        lambda device: worker_module._AllocCounts(*next(counts)))
    spec, task, _ = _worker_spec("cpu")
    worker = _Worker(spec)  # (5 so far)
    worker.forget_warm_up()  # (a warm-up's 4 more: 9)
    first, second = worker.run(task), worker.run(task)
    assert (first.device_allocs, first.device_frees) == (3, 1)
    assert (second.device_allocs, second.device_frees) == (0, 0)


def test_how_far_the_trainer_queues_ahead_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COSERVE_TRAINER_AHEAD", raising=False)
    assert _worker_spec("cpu")[0].gated_boundaries_ahead == 16
    monkeypatch.setenv("COSERVE_TRAINER_AHEAD", "3")
    assert _worker_spec("cpu")[0].gated_boundaries_ahead == 3


@pytest.mark.parametrize("closed_ahead", [0, 2])
def test_behind_a_closed_gate_the_cpu_sleeps_once_the_gpu_is_that_far_behind(
        monkeypatch: pytest.MonkeyPatch, closed_ahead: int) -> None:
    """``closed_boundaries_ahead`` N: once the engine clears the grant (its prefill steps hold the
    gate closed), the CPU queues boundaries until the GPU is N behind (the mark N back recorded
    while closed, not passed), then sleeps on the grant until the engine sets it: a wait, not host
    time. At 0 (the default) it queues on (here up to the commit, whose readback sleeps). The task's
    loss is the same either way."""
    spec, task, _ = _worker_spec("cpu")
    expected = _Worker(spec).run(task)
    grant = threading.Event()
    grant.set()
    queued_closed = 0  # boundaries queued since the grant was cleared
    at_sleep: list[int] = []

    class Grant:
        def is_set(self) -> bool:
            return grant.is_set()

        def wait(self) -> None:
            at_sleep.append(queued_closed)
            threading.Timer(0.1, grant.set).start()
            grant.wait()

    class QueryEvent(_FakeEvent):
        """Passed on the GPU unless recorded while the gate was closed and still closed."""

        def __init__(self, **kwargs: object) -> None:
            self.closed = False

        def record(self, stream: object = None) -> None:
            self.closed = not grant.is_set()

        def query(self) -> bool:
            return grant.is_set() or not self.closed

    spec.gate_flag = new_flag()
    spec.grant = Grant()
    spec.closed_boundaries_ahead = closed_ahead
    worker = _gated_cpu_worker(spec, monkeypatch, QueryEvent)
    gated, boundaries = worker._gated_boundary, 0

    def boundary(layer: int, polled: bool = False) -> None:
        nonlocal boundaries, queued_closed
        boundaries += 1
        if boundaries == 4:
            grant.clear()  # the engine's prefill steps begin
        if not grant.is_set():
            queued_closed += 1
        gated(layer, polled)

    worker._gated_boundary = boundary  # type: ignore[method-assign]
    began = time.monotonic()
    got = worker.run(task)
    assert time.monotonic() - began >= 0.1 and at_sleep, "the CPU never slept on the grant"
    if closed_ahead:
        assert worker.closed_sleeps == got.closed_sleeps == 1 and at_sleep[0] == closed_ahead + 1
    else:
        assert worker.closed_sleeps == got.closed_sleeps == 0 and at_sleep[0] > 3
    assert max(s[3] for s in got.spans) < 90.0  # (the 100 ms sleep is a wait, in no stretch)
    assert got.loss_sum == pytest.approx(expected.loss_sum, rel=1e-6)


@pytest.mark.parametrize(("value", "expected"), [(None, "0"), ("2", "2")])
def test_how_far_the_cpu_queues_behind_a_closed_gate_comes_from_the_environment(value: str | None,
                                                                               expected: str) -> None:
    """COSERVE_TRAINER_CLOSED_AHEAD sets WorkerSpec.closed_boundaries_ahead's default (0: off)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "COSERVE_TRAINER_CLOSED_AHEAD"}
    if value is not None:
        env["COSERVE_TRAINER_CLOSED_AHEAD"] = value
    code = ("from coserve.trainer.worker import CLOSED_AHEAD, WorkerSpec; "
            "print(CLOSED_AHEAD, WorkerSpec.__dataclass_fields__['closed_boundaries_ahead'].default_factory())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [expected, expected]


def test_a_stretchs_process_gc_and_thread_times_come_from_its_two_marks() -> None:
    """``read_span_*_ms`` (no CUDA needed: the marks' clocks alone): each stretch's time is its
    end mark's clock less its start mark's."""
    from coserve.trainer.stream_gate import (
        WaitMark,
        read_span_gc_ms,
        read_span_process_ms,
        read_span_thread_ms,
    )

    def mark(process_s: float, gc_s: float, thread_s: float) -> WaitMark:
        return WaitMark(None, None, 0, 0, 0.0, 0.0, process_s=process_s, gc_s=gc_s,  # type: ignore[arg-type]
                        thread_s=thread_s)

    marks = [mark(1.0, 0.0, 0.5), mark(1.004, 0.001, 0.501), mark(1.2, 0.001, 0.502)]
    assert read_span_process_ms(marks) == pytest.approx([4.0, 196.0])
    assert read_span_gc_ms(marks) == pytest.approx([1.0, 0.0])
    # (the second stretch: 196 ms of the process's CPU, 1 ms of the queuing thread's: another thread ran)
    assert read_span_thread_ms(marks) == pytest.approx([1.0, 1.0])
    assert read_span_thread_ms(marks[:1]) == []

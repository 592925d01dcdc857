"""When the co-server pauses the backward: prefill steps always, decode steps when the latency
model says the step would break its budget beside the backward."""

from __future__ import annotations

import pytest
import torch

from coserve.core.activations import ActivationStore
from coserve.core.config import CoServeConfig, OptimConfig, SLOConfig
from coserve.core.coserver import CoServer
from coserve.core.finetune import FTSample
from coserve.core.host import PrefillView, StepRecord, StepView
from coserve.core.latency import LatencyModel
from coserve.core.messages import BackwardTask, TaskResult, TaskSample
from coserve.core.sample_pool import SamplePool


class FakeTrainer:
    def __init__(self) -> None:
        self.paused = False
        self.pauses = 0

    def submit(self, task: BackwardTask) -> None: ...

    def poll(self, timeout: float = 0.0) -> list[TaskResult]:
        return []

    def alive(self) -> bool:
        return True

    def pause(self) -> None:
        self.paused = True
        self.pauses += 1

    def resume(self) -> None:
        self.paused = False

    def restart(self) -> int:
        return 0

    def close(self) -> None: ...


def model(decode_c: float, busy: tuple[float, float]) -> LatencyModel:
    m = LatencyModel()
    m.load_state_dict({
        "version": 1,
        "coefficients": {"prefill/eager": [0, 1e-4, 0, 0, 0, 0.01], "prefill/graph": [0, 1e-4, 0, 0, 0, 0.01],
                         "decode/eager": [0, 0, decode_c], "decode/graph": [0, 0, decode_c]},
        "busy": {"decode/graph": list(busy), "decode/eager": list(busy)},
    })
    return m


def coserver(latency: LatencyModel) -> tuple[CoServer, FakeTrainer]:
    samples = [FTSample(i, tuple(range(8)), tuple(range(8))) for i in range(4)]
    trainer = FakeTrainer()
    co = CoServer(pool=SamplePool(samples), samples={s.sample_id: s for s in samples},
                  store=ActivationStore(2, 64, 8, torch.float32, "cpu"), trainer=trainer,
                  config=CoServeConfig(backward_tokens=16, max_seq_len=16), optim=OptimConfig(),
                  slo=SLOConfig(ttft_slo_s=1.0, tpot_slo_s=0.1, margin=0.1), latency=latency)
    co._in_flight = [(BackwardTask(0, 0, (TaskSample(0, 0, tuple(range(8))),), True), 0)]  # a backward runs
    return co, trainer


DECODE = StepView(now=1.0, num_decodes=8, decode_kv_tokens=800, mode="graph", token_budget=100)
PREFILL = StepView(now=1.0, prefills=(PrefillView(64, 0, 0.9),), token_budget=100)


@pytest.mark.parametrize(
    "view, decode_c, busy, paused",
    [
        (PREFILL, 0.01, (0.0, 0.0), True),  # prefill: always
        (DECODE, 0.01, (0.0, 0.0), False),  # 10 ms beside the backward: within 90 ms
        (DECODE, 0.05, (1.0, 0.0), True),  # 100 ms beside the backward: over 90 ms
        (DECODE, 0.05, (0.5, 0.0), False),  # 75 ms: within
    ],
)
def test_pause_decision(view: StepView, decode_c: float, busy: tuple[float, float], paused: bool) -> None:
    co, trainer = coserver(model(decode_c, busy))
    co.plan(view)
    assert trainer.paused is paused
    co.on_step_end(StepRecord(view=view, ft_tokens=0, duration_s=0.01, trainer_busy=True))
    assert trainer.paused is False, "the grant is set again after the step"


class QueueTrainer(FakeTrainer):
    """Takes tasks and reports them done only when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.submitted: list[BackwardTask] = []
        self.results: list[TaskResult] = []

    def submit(self, task: BackwardTask) -> None:
        self.submitted.append(task)

    def poll(self, timeout: float = 0.0) -> list[TaskResult]:
        out, self.results = self.results, []
        return out

    def finish(self, task: BackwardTask) -> None:
        from coserve.core.messages import StepInfo

        info = StepInfo(task.step, 1e-3, 0.0, False) if task.ends_step else None
        self.results.append(TaskResult(task.task_id, 1.0, 4, 0.01, info))


IDLE = StepView(now=1.0, token_budget=64)


def pipelined(accumulation: int) -> tuple[CoServer, QueueTrainer]:
    samples = [FTSample(i, tuple(range(8)), tuple(range(8))) for i in range(12)]
    trainer = QueueTrainer()
    co = CoServer(pool=SamplePool(samples, shuffle=False), samples={s.sample_id: s for s in samples},
                  store=ActivationStore(2, 16, 8, torch.float32, "cpu", regions=2), trainer=trainer,
                  config=CoServeConfig(backward_tokens=16, max_seq_len=8),
                  optim=OptimConfig(accumulation_tasks=accumulation), latency=model(0.01, (0.0, 0.0)))
    return co, trainer


def run_step(co: CoServer) -> int:
    rows = co.plan(IDLE)
    co.on_step_end(StepRecord(view=IDLE, ft_tokens=sum(len(r.token_ids) for r in rows), duration_s=0.01))
    return len(rows)


def test_next_task_of_a_step_is_captured_during_the_backward() -> None:
    co, trainer = pipelined(accumulation=2)
    assert run_step(co) == 2 and len(trainer.submitted) == 1  # task 0 (does not end step 0)
    assert not trainer.submitted[0].ends_step
    assert run_step(co) == 2, "admission stays open: the adapter cannot change before task 1"
    assert len(trainer.submitted) == 2 and trainer.submitted[1].ends_step
    first, second = trainer.submitted
    assert {s.offset // 16 for s in first.samples} != {s.offset // 16 for s in second.samples}, "own regions"
    assert run_step(co) == 0, "task 1 ends the step: closed until it is done"
    trainer.finish(first)
    assert run_step(co) == 0, "still closed: the step's last task runs"
    trainer.finish(second)
    assert run_step(co) == 2 and co.steps_done == 1


def test_one_task_per_step_closes_admission_during_the_backward() -> None:
    co, trainer = pipelined(accumulation=1)
    assert run_step(co) == 2 and len(trainer.submitted) == 1
    assert run_step(co) == 0
    trainer.finish(trainer.submitted[0])
    assert run_step(co) == 2


class DyingTrainer(QueueTrainer):
    """A trainer process that dies on every task."""

    def __init__(self) -> None:
        super().__init__()
        self.restarts = 0

    def alive(self) -> bool:
        return not self.submitted

    def restart(self) -> int:
        self.restarts += 1
        self.submitted = []
        return 0


def test_a_trainer_that_keeps_dying_stops_fine_tuning_not_serving() -> None:
    co, _ = pipelined(accumulation=1)
    trainer = DyingTrainer()
    co.trainer = trainer
    for _ in range(20):
        run_step(co)
        if co.failure is not None:
            break
    assert co.failure is not None and "fine-tuning stopped" in co.failure
    assert trainer.restarts == co.max_restarts
    assert co.done and co.plan(IDLE) == [], "no more fine-tuning rows; inference steps go on"
    assert co.pool.num_in_flight == 0, "nothing is left claimed"


def test_backward_pauses_for_a_step_with_inference_and_ft_rows() -> None:
    """Pipelined capture (the step's first task in flight): FT rows in a decode step pause the
    backward for that step; FT rows in an FT-only step do not."""
    co, trainer = pipelined(accumulation=2)
    assert run_step(co) == 2 and len(trainer.submitted) == 1 and not trainer.paused
    rows = co.plan(DECODE)
    assert rows and trainer.paused, "inference + FT rows beside a running backward"
    co.on_step_end(StepRecord(view=DECODE, ft_tokens=sum(len(r.token_ids) for r in rows), duration_s=0.01))
    assert not trainer.paused and trainer.pauses == 1
    co, trainer = pipelined(accumulation=4)
    assert run_step(co) == 2 and run_step(co) == 2 and len(trainer.submitted) == 2
    assert trainer.pauses == 0, "FT-only steps never pause the backward"

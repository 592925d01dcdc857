"""When the co-server pauses the backward: under ``pause_prefill="always"`` prefill and mixed
steps always, decode steps when the latency model says the step would break its budget beside the
backward; under ``"model"`` every inference step on that prediction alone."""

from __future__ import annotations

import gc
import os
import time
from dataclasses import replace

import pytest
import torch

from coserve.core.activations import ActivationStore
from coserve.core.config import CoServeConfig, OptimConfig, SLOConfig
from coserve.core.coserver import CoServer
from coserve.core.finetune import FTSample
from coserve.core.host import PrefillView, StepRecord, StepView
from coserve.core.latency import LatencyModel, StepFeatures
from coserve.core.messages import BackwardTask, TaskResult, TaskSample
from coserve.core.sample_pool import SamplePool


class FakeTrainer:
    def __init__(self) -> None:
        self.paused = False
        self.pauses = 0
        self.committed_steps = 0

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
        return self.committed_steps

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


def coserver(latency: LatencyModel, pause_prefill: str = "always", hold_pause: bool = False,
             num_layers: int = 2) -> tuple[CoServer, FakeTrainer]:
    samples = [FTSample(i, tuple(range(8)), tuple(range(8))) for i in range(4)]
    trainer = FakeTrainer()
    co = CoServer(pool=SamplePool(samples), samples={s.sample_id: s for s in samples},
                  store=ActivationStore(num_layers, 64, 8, torch.float32, "cpu"), trainer=trainer,
                  config=CoServeConfig(backward_tokens=16, max_seq_len=16), optim=OptimConfig(),
                  slo=SLOConfig(ttft_slo_s=1.0, tpot_slo_s=0.1, margin=0.1, pause_prefill=pause_prefill,
                                hold_pause=hold_pause),
                  latency=latency)
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


def test_pause_windows_record_where_the_trainer_was() -> None:
    co, trainer = coserver(model(0.01, (0.0, 0.0)))
    co.track = True
    at = [(3, 1), None]
    trainer.progress = lambda: at[0]  # type: ignore[attr-defined]
    for where in ((3, 1), None):
        at[0] = where
        co.plan(PREFILL)
        co.on_step_end(StepRecord(view=PREFILL, ft_tokens=0, duration_s=0.01, trainer_busy=True))
    assert len(co.pause_windows) == 2 and co.pause_window_at == [(3, 1), None]


def test_an_untimed_step_is_learned_from_when_the_host_dates_it() -> None:
    """A step the host did not wait for (``timed`` False) teaches the latency model nothing at its
    end; its real duration, handed over later, goes into the model and the step table (with
    where the trainer was when it began)."""
    co, trainer = coserver(model(0.01, (0.0, 0.0)))
    co.track = True
    trainer.progress = lambda: (2, 1)  # type: ignore[attr-defined]
    co.plan(PREFILL)
    untimed = StepRecord(view=PREFILL, ft_tokens=0, duration_s=0.004, trainer_busy=True, timed=False)
    co.on_step_end(untimed)
    assert co.step_log == [] and not trainer.paused
    co.observe_late(untimed, 0.050)
    assert len(co.step_log) == 1
    row = co.step_log[0]
    assert row.key == "prefill/eager/busy" and row.measured_s == pytest.approx(0.050) and row.trainer_at == (2, 1)
    assert row.late  # (the step table's event_timed: dated from the GPU's events, not the host)
    assert row.chunks == tuple((c.num_tokens, c.context_len) for c in PREFILL.prefills)
    assert row.decodes == PREFILL.num_decodes and row.schedule_s is None and row.enqueue_s is None
    co.drop_untimed()
    co.plan(PREFILL)
    co.on_step_end(StepRecord(view=PREFILL, ft_tokens=0, duration_s=0.02, trainer_busy=True, schedule_s=0.001,
                              enqueue_s=0.012, gpu_s=0.018, enqueue_cpu_s=0.011))
    assert len(co.step_log) == 2 and co.step_log[1].late is False
    assert (co.step_log[1].schedule_s, co.step_log[1].enqueue_s, co.step_log[1].gpu_s) == (0.001, 0.012, 0.018)
    assert co.step_log[1].enqueue_cpu_s == 0.011 and row.enqueue_cpu_s is None
    # the garbage collector's time in the step: from its plan to its end (none for the late one)
    assert row.gc_s is None and co.step_log[1].gc_s is not None and co.step_log[1].gc_s >= 0.0
    co.plan(PREFILL)
    gc.collect()  # (a collection within the step)
    co.on_step_end(StepRecord(view=PREFILL, ft_tokens=0, duration_s=0.02, trainer_busy=True))
    assert co.step_log[2].gc_s is not None and co.step_log[2].gc_s > 0.0
    assert row.gpu_s is None
    # the CPU the engine's thread ended each step on (the step table's host_cpu)
    if hasattr(os, "sched_getaffinity"):
        assert co.step_log[1].host_cpu in os.sched_getaffinity(0)


def priced(prefill_busy: tuple[float, float], prefill_safety: float = 1.0, decode_c: float = 0.01,
           busy: tuple[float, float] = (0.0, 0.0)) -> LatencyModel:
    """:func:`model`, with busy prefill-form steps slowed by ``prefill_busy`` = (ρ, δ) and a safety
    factor of ``prefill_safety``: one busy PREFILL step ran that many times its prediction."""
    state = model(decode_c, busy).state_dict()
    state["busy"]["prefill/eager"] = list(prefill_busy)
    m = LatencyModel(safety_min_steps=1)
    m.load_state_dict(state)
    if prefill_safety != 1.0:
        predicted = m.predict(StepFeatures.from_view(PREFILL, busy=True))
        m.observe(StepRecord(view=PREFILL, ft_tokens=0, duration_s=prefill_safety * predicted, trainer_busy=True))
    return m


# PREFILL: 64 tokens, 16.4 ms idle; TTFT slack 1.0 - 0.1 s waited, budget 0.9 · 0.9 = 810 ms.
# DECODE: 8 decodes, decode_c idle; budget 0.9 · TPOT 100 ms = 90 ms.
@pytest.mark.parametrize(
    "policy, view, latency, paused",
    [
        ("always", PREFILL, priced((0.0, 0.0)), True),  # prefill: always
        ("always", PREFILL, priced((1.0, 0.2), 2.0), True),  # fits its budget (below): paused anyway
        ("model", PREFILL, priced((0.0, 0.0)), False),  # 16.4 ms beside the backward: within
        ("model", PREFILL, priced((0.0, 1.0)), True),  # 1016 ms: over 810 ms
        ("model", PREFILL, priced((1.0, 0.2), 2.0), False),  # (32.8 + 200) ms × 2 = 466 ms: within
        ("model", PREFILL, priced((1.0, 0.4), 1.0), False),  # 433 ms: within
        ("model", PREFILL, priced((1.0, 0.4), 2.0), True),  # 433 ms × 2 = 866 ms: the safety factor
        ("always", DECODE, priced((0.0, 0.0), decode_c=0.01), False),  # decode steps: as today
        ("always", DECODE, priced((0.0, 0.0), decode_c=0.05, busy=(1.0, 0.0)), True),
        ("model", DECODE, priced((0.0, 0.0), decode_c=0.01), False),
        ("model", DECODE, priced((0.0, 0.0), decode_c=0.05, busy=(1.0, 0.0)), True),
        ("model", DECODE, priced((0.0, 1.0), decode_c=0.05, busy=(0.5, 0.0)), False),  # decode form
        ("model", StepView(now=1.0), priced((0.0, 1.0)), False),  # no inference: never
    ],
)
def test_pause_decision_by_policy(policy: str, view: StepView, latency: LatencyModel, paused: bool) -> None:
    co, trainer = coserver(latency, pause_prefill=policy)
    assert co._must_pause(view) is paused
    co.plan(view)
    assert trainer.paused is paused and co.trainer_active is not paused


def test_pause_policy_is_checked() -> None:
    assert SLOConfig().pause_prefill == "always"
    with pytest.raises(ValueError, match="--pause-prefill must be one of always, model, got 'sometimes'"):
        SLOConfig(pause_prefill="sometimes")


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

    def finish(self, task: BackwardTask, skipped: bool = False) -> None:
        from coserve.core.messages import StepInfo

        info = StepInfo(task.step, 1e-3, float("nan") if skipped else 0.0, skipped) if task.ends_step else None
        # (as the worker's bank: a skipped step commits no new count)
        self.committed_steps += task.ends_step and not skipped
        self.results.append(TaskResult(task.task_id, float("nan") if skipped else 1.0, 4, 0.01, info))


IDLE = StepView(now=1.0, token_budget=64)


def pipelined(accumulation: int, slo: SLOConfig | None = None,
              latency: LatencyModel | None = None) -> tuple[CoServer, QueueTrainer]:
    samples = [FTSample(i, tuple(range(8)), tuple(range(8))) for i in range(12)]
    trainer = QueueTrainer()
    co = CoServer(pool=SamplePool(samples, shuffle=False), samples={s.sample_id: s for s in samples},
                  store=ActivationStore(2, 16, 8, torch.float32, "cpu", regions=2), trainer=trainer,
                  config=CoServeConfig(backward_tokens=16, max_seq_len=8),
                  optim=OptimConfig(accumulation_tasks=accumulation), slo=slo,
                  latency=latency or model(0.01, (0.0, 0.0)))
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


def test_a_committed_steps_result_is_taken_in_and_logged_before_its_state_is_copied() -> None:
    """(FinetuneSession.save_checkpoint) The trainer commits a step before its result comes in;
    collect_committed takes the result in (logging the step) until steps_done counts the commit,
    and says so; a result that does not come leaves the count, and says that too."""
    co, trainer = pipelined(accumulation=2)
    logged: list[int] = []
    co.on_step_logged = lambda entry: logged.append(entry.step)
    assert run_step(co) == 2 and run_step(co) == 2  # tasks 0 and 1 of step 0
    first, second = trainer.submitted
    assert co.collect_committed(0, timeout=5.0) and logged == [], "nothing committed: nothing to wait for"
    trainer.finish(first)
    assert not co.collect_committed(1, timeout=0.05), "step 0's result has not come in"
    assert co.steps_done == 0 and logged == [] and co.backward_running
    trainer.finish(second)
    assert co.collect_committed(1, timeout=5.0)
    assert co.steps_done == 1 and logged == [0] and not co.backward_running


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


class CommitThenDie(QueueTrainer):
    """A trainer process that, told to, commits a task's optimizer step and dies before its result
    is sent."""

    def __init__(self) -> None:
        super().__init__()
        self.dead = False
        self.restarts = 0

    def commit_and_die(self, task: BackwardTask) -> None:
        assert task.ends_step
        self.committed_steps += 1
        self.dead = True

    def alive(self) -> bool:
        return not self.dead

    def restart(self) -> int:
        self.restarts += 1
        self.dead = False
        return self.committed_steps


@pytest.mark.parametrize("first_skipped", [False, True])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_step_the_trainer_committed_before_it_died_is_logged_once_and_not_trained_again(
        accumulation: int, first_skipped: bool) -> None:
    """The worker commits an optimizer step (flips its bank) and dies before its result comes in:
    the step counts, is logged once with its result unknown, and its samples are retired, not
    trained again on top of the adapter that holds them. (After a skipped step too: the commit
    counts applied steps only.)"""
    co, _ = pipelined(accumulation=accumulation)
    trainer = CommitThenDie()
    co.trainer = trainer
    co.max_restarts = 0  # (a death after a commit is not one "without finishing an optimizer step")
    logged = []
    co.on_step_logged = logged.append
    while len(trainer.submitted) < accumulation:  # optimizer step 0: finished and reported
        assert run_step(co) == 2
    for task in trainer.submitted:
        trainer.finish(task, skipped=first_skipped)
    while len(trainer.submitted) < 2 * accumulation:  # step 1: committed, the worker dies
        assert run_step(co) == 2
    for task in trainer.submitted[accumulation:-1]:
        trainer.finish(task)
    trainer.commit_and_die(trainer.submitted[-1])
    step1 = {s.sample_id for task in trainer.submitted[accumulation:] for s in task.samples}
    finished = {task.task_id for task in trainer.submitted}
    assert run_step(co) == 2, "recovered: the next step's rows"
    assert trainer.restarts == 1 and co.num_restarts == 1 and co.failure is None
    assert [e.step for e in logged] == [0, 1] and co.steps_done == 2
    assert co.steps_applied == trainer.committed_steps == 2 - first_skipped
    lost = logged[1]
    assert set(lost.sample_ids) == step1 and not lost.reported and not lost.skipped
    assert (lost.loss, lost.lr, lost.grad_norm) == (None, None, None)
    assert lost.tokens == 8 * len(step1) and lost.target_tokens == 7 * len(step1)
    assert co.last_loss is logged[0].loss, "the last loss known"
    assert co.tokens_trained == sum(e.tokens for e in logged) == co.pool.progress.tokens_retired
    assert co.pool.progress.samples_retired == 4 * accumulation
    for _ in range(50):  # the rest of the run
        if co.done:
            break
        for task in trainer.submitted:
            if task.task_id not in finished:
                trainer.finish(task)
                finished.add(task.task_id)
        run_step(co)
    trained = sorted(i for e in logged for i in e.sample_ids)
    assert trained == list(range(12)), "every sample trained once"
    assert [e.step for e in logged] == list(range(co.steps_done))


def test_the_commit_of_a_step_after_a_skipped_one_is_taken_in_before_a_checkpoint() -> None:
    """The trainer's committed state counts applied optimizer steps (a skipped step changes
    nothing, its count neither): collect_committed compares it with steps_applied, so a step
    committed after a skipped one is taken in before its state is copied, not taken for done."""
    co, trainer = pipelined(accumulation=1)
    logged: list[int] = []
    co.on_step_logged = lambda entry: logged.append(entry.step)
    assert run_step(co) == 2
    trainer.finish(trainer.submitted[0], skipped=True)
    assert run_step(co) == 2 and logged == [0]  # step 0 taken in; step 1's task submitted
    assert (co.steps_done, co.steps_applied, trainer.committed_steps) == (1, 0, 0)
    assert co.collect_committed(trainer.committed_steps, timeout=5.0), "nothing to wait for"
    trainer.finish(trainer.submitted[1])  # step 1 applied and committed, its result not taken in
    assert trainer.committed_steps == 1 and co.steps_done == 1
    assert co.collect_committed(trainer.committed_steps, timeout=5.0)
    assert logged == [0, 1] and (co.steps_done, co.steps_applied, co.steps_skipped) == (2, 1, 1)


def test_non_finite_steps_in_a_row_stop_fine_tuning_not_serving() -> None:
    co, trainer = pipelined(accumulation=1)
    co.optim = replace(co.optim, max_skipped_steps=3)
    assert run_step(co) == 2
    # each result taken by the next step's plan, which admits the next task's rows; an applied
    # step between skipped ones resets the count
    for skipped in (True, True, False, True, True):
        trainer.finish(trainer.submitted[-1], skipped=skipped)
        assert run_step(co) == 2 and co.failure is None
    assert co.skipped_in_a_row == 2
    trainer.finish(trainer.submitted[-1], skipped=True)
    assert run_step(co) == 0
    assert co.skipped_in_a_row == 3 and "3 optimizer steps in a row had a non-finite loss" in co.failure
    assert co.done and co.plan(IDLE) == [], "no more fine-tuning rows; inference steps go on"


def test_a_resumed_run_keeps_counting_the_steps_it_skipped_in_a_row() -> None:
    """A run stopped while it skipped steps gets no fresh ``max_skipped_steps`` from a resume."""
    co, trainer = pipelined(accumulation=1)
    co.optim = replace(co.optim, max_skipped_steps=3)
    with pytest.raises(ValueError, match="skipped_in_a_row 3 is not within the 2 steps skipped"):
        co.resume(5, 100, steps_skipped=2, skipped_in_a_row=3)
    co.resume(5, 100, steps_skipped=2, skipped_in_a_row=2)
    assert co.skipped_in_a_row == 2 and co.steps_applied == 3
    assert run_step(co) == 2
    trainer.finish(trainer.submitted[-1], skipped=True)
    assert run_step(co) == 0
    assert "3 optimizer steps in a row had a non-finite loss" in co.failure


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


# A prefill chunk beside decodes: busy, the step with two FT rows of 8 predicts
# (1 + 1)·(1e-4·(16 + 8 + 8 + 8) + 10 ms) + 20 ms = 48 ms, within 0.9 · TPOT 100 ms.
MIXED = StepView(now=1.0, prefills=(PrefillView(16, 0, 0.95),), num_decodes=8, decode_kv_tokens=800,
                 token_budget=64)


@pytest.mark.parametrize(
    "policy, view, priced_busy, paused",
    [
        ("always", DECODE, True, True),  # priced beside the backward, then paused for the FT rows
        ("always", MIXED, False, True),  # paused for the prefill before admission: priced idle
        ("model", DECODE, True, False),
        ("model", MIXED, True, False),
    ],
)
def test_a_mixed_step_admitted_beside_the_backward_is_not_paused_under_model(
        policy: str, view: StepView, priced_busy: bool, paused: bool) -> None:
    """Pipelined capture (the step's first task in flight): admission prices the FT rows of an
    inference step beside the backward unless it was paused for the step already; "always" then
    pauses it for the FT rows anyway, "model" lets the step it admitted run beside it."""
    co, trainer = pipelined(2, SLOConfig(pause_prefill=policy), priced((1.0, 0.02), decode_c=0.01))
    assert run_step(co) == 2 and len(trainer.submitted) == 1
    rows = co.plan(view)
    assert [len(r.token_ids) for r in rows] == [8, 8]
    step = StepFeatures.from_view(view, (8, 8), busy=priced_busy)
    assert co.last_decision is not None and co.last_decision.predicted_s == co.latency.predict(step)
    assert co.latency.predict(replace(step, busy=True)) > co.latency.predict(replace(step, busy=False))
    assert trainer.paused is paused and trainer.pauses == int(paused)
    co.on_step_end(StepRecord(view=view, ft_tokens=sum(len(r.token_ids) for r in rows), duration_s=0.01,
                              trainer_busy=co.trainer_active))
    assert not trainer.paused


def test_model_pauses_a_mixed_step_whose_rows_admission_did_not_price() -> None:
    """The naive policy admits FT rows without the latency model: under "model" the step is paused
    when, busy, it would break its budget (full admission, pricing them busy, admits none)."""
    slow = priced((0.0, 1.0), decode_c=0.01)  # every busy prefill-form step: over 1 s
    co, trainer = pipelined(2, SLOConfig(policy="naive", pause_prefill="model"), slow)
    assert run_step(co) == 2 and len(trainer.submitted) == 1
    assert co.plan(DECODE) and trainer.paused, "naive rows would break the budget beside the backward"
    co, trainer = pipelined(2, SLOConfig(policy="full", pause_prefill="model"), slow)
    assert run_step(co) == 2
    assert co.plan(DECODE) == [] and not trainer.paused
    assert co.last_decision is not None and co.last_decision.reason == "latency_budget"


def decode_steps_beside(co: CoServer, trainer: FakeTrainer, at: tuple[int, int], duration_s: float) -> None:
    """Twelve busy decode steps of ``duration_s`` with the trainer's GPU past boundary ``at``."""
    trainer.progress = lambda: at  # type: ignore[attr-defined]
    for _ in range(12):
        co.plan(DECODE)
        co.on_step_end(StepRecord(view=DECODE, ft_tokens=0, duration_s=duration_s, mode="graph", trainer_busy=True))


def test_decode_steps_beside_a_commit_are_learned_and_priced_as_the_quiet_phase() -> None:
    """The trainer's progress word at plan time picks the busy set: steps beside its commit
    (faster on the H200) refit the ``quiet`` term and leave the running backward's alone."""
    co, trainer = coserver(model(0.01, (1.0, 0.0)))
    decode_steps_beside(co, trainer, (-1, 0), 0.011)
    quiet = StepFeatures.from_view(DECODE, busy=True, trainer_phase="quiet")
    assert co.latency.predict(quiet) == pytest.approx(0.011, rel=0.05)
    assert co.latency.busy_term("decode/graph") == (1.0, 0.0)
    assert co.latency.predict(StepFeatures.from_view(DECODE, busy=True)) == pytest.approx(0.02)


@pytest.mark.parametrize("ending_after", [0, 500])
def test_decode_steps_beside_the_backwards_last_layer_are_the_ending_phase_once_the_key_is_old(
        ending_after: int) -> None:
    """Beside layer 0 (the backward's last) a step is ``ending``: its own busy set once the decode
    key has ``ending_after`` busy steps (here from the first), the running backward's before."""
    latency = model(0.01, (1.0, 0.0))
    latency.ending_after = ending_after
    co, trainer = coserver(latency)
    decode_steps_beside(co, trainer, (0, 3), 0.013)
    ending = StepFeatures.from_view(DECODE, busy=True, trainer_phase="ending")
    active = StepFeatures.from_view(DECODE, busy=True)
    assert co.latency.predict(ending) == pytest.approx(0.013, rel=0.05)
    if ending_after:  # (as active: the running backward's term learned it)
        assert co.latency.predict(active) == co.latency.predict(ending)
    else:
        assert co.latency.busy_term("decode/graph") == (1.0, 0.0)
        assert co.latency.predict(active) == pytest.approx(0.02)


def test_decode_steps_beside_the_backwards_loss_are_the_loss_phase() -> None:
    """At the boundary of layer ``num_layers`` (the store's last plane) the backward runs its loss
    over the vocabulary: a step beside it learns and is priced by the ``loss`` set, and the
    running backward's term is left alone."""
    latency = model(0.01, (1.0, 0.0))
    latency.ending_after = 0
    co, trainer = coserver(latency)
    num_layers = co.store.tensor.shape[0] - 1
    decode_steps_beside(co, trainer, (num_layers, 1), 0.025)
    loss = StepFeatures.from_view(DECODE, busy=True, trainer_phase="loss")
    assert co.latency.predict(loss) == pytest.approx(0.025, rel=0.05)
    assert co.latency.busy_term("decode/graph") == (1.0, 0.0)
    trainer.progress = lambda: (num_layers - 1, 1)  # type: ignore[attr-defined]
    co.plan(DECODE)
    assert co._trainer_phase == "active"


def test_decode_steps_beside_the_losss_first_boundaries_learn_their_spots_level() -> None:
    """The progress word's boundary gives the step its trainer spot too: steps beside the loss's
    first boundary teach its level (``loss@0``, by SPOT_GRAIN ``phase`` ``loss_first``; on top of
    the loss set), and a step planned beside a middle layer carries no spot."""
    from coserve.core.latency import SPOT_GRAIN

    latency = model(0.01, (1.0, 0.0))
    latency.ending_after = 0
    co, trainer = coserver(latency, num_layers=4)
    num_layers = co.store.tensor.shape[0] - 1
    decode_steps_beside(co, trainer, (num_layers, 0), 0.025)
    spot = "loss@0" if SPOT_GRAIN == "boundary" else "loss_first"
    assert co._trainer_spot == spot
    assert ("decode/graph", f"spot:{spot}") in co.latency._level
    loss = StepFeatures.from_view(DECODE, busy=True, trainer_phase="loss", trainer_spot=spot)
    assert co.latency.predict(loss) == pytest.approx(0.025, rel=0.05)
    trainer.progress = lambda: (num_layers // 2, 3)  # type: ignore[attr-defined]
    co.plan(DECODE)
    assert co._trainer_spot is None


def test_the_model_prices_the_step_after_admissions_decision_and_adds_the_host_time_before_it() -> None:
    """A step's host time up to admission's decision (here 20 ms of it, as after taking in a
    trainer's results) is known when the step is admitted: it is part of the step's predicted
    time as measured, and the latency model learns only the rest."""
    co, _ = coserver(model(0.01, (0.0, 0.0)))
    co.track = True
    for _ in range(12):
        view = replace(DECODE, now=time.monotonic(), step_began=time.monotonic() - 0.02)
        co.plan(view)
        co.on_step_end(StepRecord(view=view, ft_tokens=0, duration_s=0.02 + 0.013, mode="graph"))
        assert 0.02 <= co.step_log[-1].planned_s < 0.03
    last = co.step_log[-1]
    # (the model's part refitted to the 13 ms after the decision; the rest as measured)
    assert co.latency.predict(StepFeatures.from_view(DECODE)) == pytest.approx(0.013, rel=0.1)
    assert last.predicted_s == pytest.approx(last.planned_s + co.latency.predict(StepFeatures.from_view(DECODE)),
                                             rel=0.1)
    assert last.measured_s == pytest.approx(0.033)
    # a host that does not say when the step began: the whole step is the model's
    co.plan(DECODE)
    co.on_step_end(StepRecord(view=DECODE, ft_tokens=0, duration_s=0.013, mode="graph"))
    assert co.step_log[-1].planned_s == 0.0


def test_every_timed_step_counts_its_prediction_error_by_step_kind() -> None:
    """/metrics' histogram: each observed step's |predicted - measured| / measured in its bucket,
    tracking or not; an interrupted step counts nothing."""
    from coserve.core.coserver import ERROR_BUCKETS, PredictionErrors

    co, _ = coserver(model(0.01, (0.0, 0.0)))
    co.plan(DECODE)
    co.on_step_end(StepRecord(view=DECODE, ft_tokens=0, duration_s=0.008, mode="graph"))  # predicted 0.01
    co.plan(DECODE)
    co.on_step_end(StepRecord(view=DECODE, ft_tokens=0, duration_s=0.01, mode="graph", interrupted=True))
    errors = co.prediction_errors["decode/graph/idle"]
    assert errors.steps == 1 and errors.total == pytest.approx(0.25)
    assert errors.counts[ERROR_BUCKETS.index(0.5)] == 1  # (0.25: the bucket (0.2, 0.5])
    wide = PredictionErrors()
    for e in (0.0, 0.015, 3.0):
        wide.add(e)
    assert wide.counts[0] == 1 and wide.counts[1] == 1 and wide.counts[-1] == 1 and wide.steps == 3


QUEUED = replace(PREFILL, num_waiting=3, oldest_waiting_arrival=0.95, waiting_prefill_tokens=600)


def _end(co: CoServer, view: StepView, interrupted: bool = False) -> None:
    co.on_step_end(StepRecord(view=view, ft_tokens=0, duration_s=0.01, trainer_busy=False, interrupted=interrupted))


@pytest.mark.parametrize("hold", [False, True])
def test_hold_pause_keeps_the_backward_paused_through_a_burst_of_prefill_steps(hold: bool) -> None:
    """With prompt tokens queued behind a paused step, hold_pause leaves the grant cleared into the
    next step's planning: one pause for the whole burst, resumed by the first step that needs none."""
    co, trainer = coserver(model(0.01, (0.0, 0.0)), hold_pause=hold)
    co.track = True
    co.plan(QUEUED)
    _end(co, QUEUED)
    assert trainer.paused is hold  # without hold_pause the grant is set after every step
    co.plan(QUEUED)
    _end(co, QUEUED)
    co.plan(PREFILL)  # the burst's last prefill step: nothing queued behind it
    assert trainer.paused
    _end(co, PREFILL)
    assert not trainer.paused
    assert trainer.pauses == (1 if hold else 3)
    assert len(co.pause_windows) == (1 if hold else 3)


def test_a_held_pause_ends_at_a_step_that_needs_none_or_when_the_host_goes_idle() -> None:
    co, trainer = coserver(model(0.01, (0.0, 0.0)), hold_pause=True)
    co.plan(QUEUED)
    _end(co, QUEUED)
    assert trainer.paused
    co.plan(DECODE)  # a decode step that fits beside the backward: resumed before it runs
    assert not trainer.paused and co.trainer_active
    _end(co, DECODE)
    co.plan(QUEUED)
    _end(co, QUEUED)
    assert trainer.paused
    co.poll()  # the host has no step to run: it waits on the trainer, which must not stay paused
    assert not trainer.paused
    co.plan(QUEUED)
    _end(co, QUEUED, interrupted=True)  # (an interrupted step: resumed at its end, as before)
    assert not trainer.paused


def test_latency_refits_wait_for_the_hosts_idle_poll() -> None:
    """A refit falling due on a step's observe is put off (no milliseconds of NNLS on the step
    path); the host's idle ``poll`` runs it within the time it offers (every window deferred here:
    by default a window under ``DEFER_FROM_ROWS`` rows refits at once)."""
    co, _ = coserver(model(0.01, (0.0, 0.0)))
    assert co.latency.defer_refits
    co.latency.defer_from_rows = 0
    before = co.latency.coefficients("decode/graph")
    for i in range(10):
        rows = 1 + i
        co.latency.observe_regressors("decode/graph", (float(rows), 100.0 * rows, 1.0), 0.003 + 1e-4 * rows)
    assert co.latency.coefficients("decode/graph") == before
    co.poll(0.0)  # a poll that offers no time: still put off
    assert co.latency.coefficients("decode/graph") == before
    co.poll(0.05)
    assert co.latency.coefficients("decode/graph") != before and co.latency.refit_due() == 0


def test_early_pause_stops_the_backward_before_the_step_that_carries_an_arrival() -> None:
    # SLOConfig.early_pause_s: a decode step beside the backward arms a timer at its predicted end
    # (10 ms here) less the lead (8 ms); a request arrives during it: the timer pauses the backward
    # and the next plan (a prefill step) takes the pause over, its window from the timer's pause
    co, trainer = coserver(model(0.01, (0.0, 0.0)))
    co.slo = replace(co.slo, early_pause_s=0.008)
    co.track = True
    arrived = [False]
    co.arrival_probe = lambda: arrived[0]
    try:
        assert co.plan(DECODE) == [] and not trainer.paused
        arrived[0] = True
        deadline = time.monotonic() + 2.0
        while not trainer.paused and time.monotonic() < deadline:
            time.sleep(0.001)
        assert trainer.paused, "the timer paused the backward before the next plan"
        co.on_step_end(StepRecord(view=DECODE, ft_tokens=0, duration_s=0.01, trainer_busy=True))
        assert trainer.paused, "the decode step's end does not lift it"
        co.plan(PREFILL)
        assert trainer.paused and trainer.pauses == 2 and co.early_pauses == 1
        co.on_step_end(StepRecord(view=PREFILL, ft_tokens=0, duration_s=0.01, trainer_busy=True))
        assert not trainer.paused
        (start, _), step_start = co.pause_windows[0], co.pause_window_step_start[0]
        assert start < step_start, "the window began at the timer's pause, before the step's plan"

        # no arrival during the step: the timer does nothing
        arrived[0] = False
        co.plan(DECODE)
        time.sleep(0.05)
        assert not trainer.paused
        # an arrival that the next step does not take (a decode step again): the pause is lifted
        arrived[0] = True
        co.on_step_end(StepRecord(view=DECODE, ft_tokens=0, duration_s=0.01, trainer_busy=True))
        co.plan(DECODE)
        deadline = time.monotonic() + 2.0
        while not trainer.paused and time.monotonic() < deadline:
            time.sleep(0.001)
        assert trainer.paused
        co.on_step_end(StepRecord(view=DECODE, ft_tokens=0, duration_s=0.01, trainer_busy=True))
        arrived[0] = False
        co.plan(DECODE)
        assert not trainer.paused and co.early_pauses_lifted == 1
        # and the host's idle poll lifts one too
        arrived[0] = True
        deadline = time.monotonic() + 2.0
        while not trainer.paused and time.monotonic() < deadline:
            time.sleep(0.001)
        co.on_step_end(StepRecord(view=DECODE, ft_tokens=0, duration_s=0.01, trainer_busy=True))
        co.poll()
        assert not trainer.paused and co.early_pauses_lifted == 2
    finally:
        co.close()


def test_early_pause_is_off_by_default_and_checked() -> None:
    co, trainer = coserver(model(0.01, (0.0, 0.0)))
    co.arrival_probe = lambda: True
    co.plan(DECODE)
    time.sleep(0.03)
    assert not trainer.paused and co._early is None
    with pytest.raises(ValueError, match="--early-pause-ms"):
        SLOConfig(early_pause_s=-0.001)


@pytest.mark.parametrize("lead_s", [0.0, 0.003])
def test_an_interrupted_ft_only_step_pauses_the_backward_before_the_arrivals_step(lead_s: float) -> None:
    """The backward runs beside FT-only steps; one interrupted by an arrival is followed by that
    arrival's prefill step. With the early pause on (SLOConfig.early_pause_s), the interruption
    pauses the backward at once and that step's plan takes the pause over (its window from the
    interruption); a host that goes idle instead lifts it. Off, the plan pauses it, as before."""
    co, trainer = pipelined(accumulation=2, slo=SLOConfig(early_pause_s=lead_s))
    co.track = True
    assert run_step(co) == 2 and len(trainer.submitted) == 1  # a backward in flight
    rows = co.plan(IDLE)  # an FT-only step beside it
    assert rows and not trainer.paused
    co.on_step_end(StepRecord(view=IDLE, ft_tokens=0, duration_s=0.005, interrupted=True))
    assert trainer.paused is (lead_s > 0)
    assert co.num_interrupted == 1 and set(co.pool.in_flight_ids) == {0, 1}, "the step's samples are back in the pool"
    co.plan(PREFILL)
    assert trainer.paused and trainer.pauses == (2 if lead_s > 0 else 1)
    assert co.early_pauses == (1 if lead_s > 0 else 0)
    co.on_step_end(StepRecord(view=PREFILL, ft_tokens=0, duration_s=0.01, trainer_busy=False))
    assert not trainer.paused
    (start, _), step_start = co.pause_windows[0], co.pause_window_step_start[0]
    assert (start < step_start) is (lead_s > 0)
    # an interruption after which the host goes idle (the arrival left): the idle poll lifts it
    co, trainer = pipelined(accumulation=2, slo=SLOConfig(early_pause_s=lead_s))
    assert run_step(co) == 2 and co.plan(IDLE)
    co.on_step_end(StepRecord(view=IDLE, ft_tokens=0, duration_s=0.005, interrupted=True))
    assert trainer.paused is (lead_s > 0)
    co.poll()
    assert not trainer.paused and co.early_pauses_lifted == (1 if lead_s > 0 else 0)


def test_the_step_table_gives_the_gap_before_each_step() -> None:
    """``gap_s``: from the end of the step before (its on_step_end) to this step's start, how long
    the engine left the GPU before it; None for the first step and for a host that does not say."""
    co, _ = coserver(model(0.01, (0.0, 0.0)))
    co.track = True
    gaps = []
    for pause_s in (0.0, 0.03, 0.0):
        time.sleep(pause_s)
        view = replace(DECODE, now=time.monotonic(), step_began=time.monotonic())
        co.plan(view)
        co.on_step_end(StepRecord(view=view, ft_tokens=0, duration_s=0.01, mode="graph"))
        gaps.append(co.step_log[-1].gap_s)
    assert gaps[0] is None
    assert gaps[1] is not None and 0.03 <= gaps[1] < 0.2
    assert gaps[2] is not None and 0.0 <= gaps[2] < 0.02
    co.plan(DECODE)  # (no step_began)
    co.on_step_end(StepRecord(view=DECODE, ft_tokens=0, duration_s=0.01, mode="graph"))
    assert co.step_log[-1].gap_s is None


@pytest.mark.parametrize("idle_s", [0.0, 0.03])
def test_a_prompt_alone_after_an_idle_host_is_learnt_as_lone(idle_s: float) -> None:
    """The gap before a step (the step table's gap_s, kept whether or not the table is) makes a
    prompt with no decodes and no FT rows lone (StepFeatures.lone): the latency model learns its
    own level for such steps, and not from the same prompt back to back."""
    from coserve.core.latency import LONE, LONE_GAP_S

    co, _ = coserver(model(0.01, (0.0, 0.0)))
    first = replace(DECODE, now=time.monotonic(), step_began=time.monotonic())
    co.plan(first)
    co.on_step_end(StepRecord(view=first, ft_tokens=0, duration_s=0.01, mode="graph"))
    time.sleep(idle_s)
    view = replace(PREFILL, now=time.monotonic(), step_began=time.monotonic())
    co.plan(view)
    co.on_step_end(StepRecord(view=view, ft_tokens=0, duration_s=0.03))
    key = StepFeatures.from_view(view).key
    assert ((key, LONE) in co.latency._level) is (idle_s >= LONE_GAP_S)


def test_a_tracking_coserver_records_each_tasks_shape_and_longest_stretch() -> None:
    """(bench/coserve_latency.py's timeline) each task submitted while tracking: when, its samples,
    its longest sample's tokens; and with its result, its longest stretch between two boundaries
    in host and GPU ms, beside its timings; nothing while not tracking."""
    co, trainer = pipelined(accumulation=2)
    assert run_step(co) == 2 and len(trainer.submitted) == 1 and co.task_shapes == []
    co.track = True
    assert run_step(co) == 2 and len(trainer.submitted) == 2
    trainer.finish(trainer.submitted[0])  # (submitted before tracking: no timings)
    task = trainer.submitted[1]
    trainer.results.append(TaskResult(task.task_id, 1.0, 16, 0.01, None,
                                      spans=((2, 0, 0.8, 3.5), (1, 1, 1.9, 0.4), (1, 0, 0.2, 0.1)), closed_sleeps=2,
                                      device_allocs=3))
    co.poll()
    # each task's sleeps behind a closed gate (COSERVE_TRAINER_CLOSED_AHEAD), beside its other counts
    assert co.trainer_task_counts[-1][4] == 2 and co.trainer_task_counts[-1][2] == 3
    (samples, longest, cpu_ms, gpu_ms, allocs, sleeps), = co.task_shapes
    assert (allocs, sleeps) == (3, 2)  # (a long stretch in a task that allocated: the allocation's)
    assert samples == len(trainer.submitted[1].samples) == 2 and longest == 8
    assert co.task_timings[0][0] <= time.monotonic()
    assert (cpu_ms, gpu_ms) == (3.5, 1.9) and len(co.task_timings) == 1
    # each stretch names its task's row in task_timings (-1: a task without timings)
    assert len(co.trainer_span_tasks) == len(co.trainer_spans) and co.trainer_span_tasks[-3:] == [0, 0, 0]
    assert all(t == -1 for t in co.trainer_span_tasks[:-3])

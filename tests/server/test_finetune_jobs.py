"""The co-serving run as an OpenAI fine-tuning job: the ``openai`` client lists it, retrieves it,
reads its events and cancels it while the server keeps serving; the job and event objects alone."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from pathlib import Path

import openai
import pytest

from coserve.core.config import CoServeConfig, LoRAConfig, OptimConfig
from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.server.engine_thread import EngineStats, EngineThread
from coserve.server.finetune import FinetuneSession, FinetuneSpec
from coserve.server.finetune_jobs import FinetuneJob, job_events, job_object, total_steps
from tests.server.test_api import DATA, MODEL, http, serve


def tiny_session(tmp_path: Path, epochs: int) -> tuple[LLMEngine, FinetuneSession]:
    """A fine-tuning run of the tiny model on the built-in facts, not yet served."""
    engine = LLMEngine(EngineConfig(model=MODEL, device="cpu", num_training_slots=1, max_lora_rank=8))
    spec = FinetuneSpec(data=DATA, output=tmp_path / "out", lora=LoRAConfig(rank=8, alpha=16), optim=OptimConfig(lr=1e-3),
                        coserve=CoServeConfig(backward_tokens=32, max_seq_len=64, epochs=epochs), trainer_threads=1,
                        save_every=0)
    return engine, FinetuneSession(engine, spec)


def train_until(engine: LLMEngine, session: FinetuneSession, steps_done: int, timeout_s: float = 60.0) -> None:
    """Step the engine (waiting for the trainer when it has nothing to do) until the run has logged
    ``steps_done`` optimizer steps."""
    deadline = time.monotonic() + timeout_s
    while session.coserver.steps_done < steps_done:
        if not engine.step():
            session.wait(0.05)
        assert time.monotonic() < deadline, f"{session.coserver.steps_done} of {steps_done} steps in {timeout_s:g} s"


def first_commit_unread(engine: LLMEngine, session: FinetuneSession, timeout_s: float = 60.0) -> None:
    """Step the engine until the run's first task (which ends optimizer step 0) is in flight, then
    wait, without letting the co-server poll, until the trainer has committed it: its result not
    yet taken in (the race a checkpoint or a pause must survive)."""
    deadline = time.monotonic() + timeout_s
    while not session.coserver.backward_running:
        engine.step()
        assert time.monotonic() < deadline
    while session.trainer.committed_steps < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def checkpointed_run(tmp_path: Path, steps_done: int) -> tuple[LLMEngine, FinetuneSession, Path]:
    """A tiny run trained to ``steps_done`` steps, checkpointed and closed: (engine, its closed
    session, the checkpoint's folder)."""
    engine, session = tiny_session(tmp_path, epochs=500)
    try:
        train_until(engine, session, steps_done)
        path = session.save_checkpoint()
        session.flush_checkpoints()
    finally:
        session.close()
    return engine, session, path


def held(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> tuple[threading.Event, threading.Event]:
    """``owner.name`` made to wait, once called, until the second event is set (the first says
    it was called): a write held on the disk."""
    call = getattr(owner, name)
    writing, release = threading.Event(), threading.Event()

    def slow(*args: object, **kwargs: object) -> object:
        writing.set()
        release.wait(30)
        return call(*args, **kwargs)

    monkeypatch.setattr(owner, name, slow)
    return writing, release


def test_the_coserving_run_is_a_job_the_openai_client_watches_and_cancels(tmp_path: Path) -> None:
    engine, session = tiny_session(tmp_path, epochs=500)
    engine.lora_manager.bind_training_slot("live")
    with serve(engine, session, adapters={"live": "(training)"}, finetune_name="live") as s:
        (job,) = s.client.fine_tuning.jobs.list().data
        assert (job.object, job.status, job.model, job.fine_tuned_model) == ("fine_tuning.job", "running", MODEL, "live")
        assert job.training_file == str(DATA) and job.hyperparameters.n_epochs == 500 and job.finished_at is None
        deadline = time.monotonic() + 60
        while s.engine_thread.stats.ft_optimizer_steps < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        job = s.client.fine_tuning.jobs.retrieve(job.id)
        assert job.status == "running" and job.trained_tokens is not None and job.trained_tokens > 0
        assert job.estimated_finish is not None and job.estimated_finish >= job.created_at

        # events: newest first, one per optimizer step in OpenAI's words, pages through `after`
        first_page = s.client.fine_tuning.jobs.list_events(job.id, limit=2)
        assert len(first_page.data) == 2 and first_page.has_more
        newest = first_page.data[0]
        assert newest.type == "metrics" and newest.message.startswith("Step ") and "training loss=" in newest.message
        assert newest.data is not None and newest.data["step"] > first_page.data[1].data["step"]  # type: ignore[index]
        rest = s.client.fine_tuning.jobs.list_events(job.id, after=first_page.data[1].id, limit=1000)
        assert not rest.has_more and rest.data[-1].message.startswith(f"Fine-tuning {MODEL} on ")

        cancelled = s.client.fine_tuning.jobs.cancel(job.id)
        assert cancelled.status == "cancelled" and cancelled.finished_at is not None
        assert cancelled.result_files == [str(tmp_path / "out" / "adapter")]
        assert (tmp_path / "out" / "adapter" / "adapter_config.json").is_file()
        assert s.engine_thread.session is None and engine.coserver is None, "fine-tuning stopped"
        steps = s.engine_thread.stats.ft_optimizer_steps
        # serving goes on, the trained adapter too, and fine-tuning does not
        for model in (MODEL, "live"):
            r = s.client.completions.create(model=model, prompt="Where is the candle?", max_tokens=3)
            assert r.usage is not None and r.usage.completion_tokens >= 1
        assert s.engine_thread.stats.ft_optimizer_steps == steps
        end = s.client.fine_tuning.jobs.list_events(job.id, limit=1).data[0]
        assert end.message.startswith("The job was cancelled") and str(tmp_path / "out" / "adapter") in end.message
        assert s.client.fine_tuning.jobs.cancel(job.id).status == "cancelled"  # (again: as it ended)

        with pytest.raises(openai.NotFoundError, match="no fine-tuning job 'ftjob-nope'"):
            s.client.fine_tuning.jobs.retrieve("ftjob-nope")
        with pytest.raises(openai.BadRequestError, match="jobs cannot be created through the API"):
            s.client.fine_tuning.jobs.create(model=MODEL, training_file="file-abc")
        status, _ = http(s.url + f"/v1/fine_tuning/jobs/{job.id}/events?after=nope")
        assert status == 400


def test_a_server_that_does_not_fine_tune_lists_no_job() -> None:
    with serve(LLMEngine(EngineConfig(model=MODEL, device="cpu"))) as s:
        assert s.client.fine_tuning.jobs.list().data == []
        with pytest.raises(openai.NotFoundError):
            s.client.fine_tuning.jobs.list_events("ftjob-x")


JOB = FinetuneJob("ftjob-1", 1_000, MODEL, "data.jsonl", Path("unused"), 2, 1e-3, 40, 0, None)


def test_job_object_status_error_and_estimated_finish() -> None:
    running = EngineStats(coserving=True, ft_samples_retired=25, ft_samples_total=100, ft_tokens_trained=900,
                          ft_optimizer_steps=5, ft_loss=float("nan"))
    obj = job_object(JOB, running, now=1_100.0)
    assert obj["status"] == "running" and obj["estimated_finish"] == 1_400  # 25 samples a 100 s: 75 more in 300 s
    assert obj["trained_tokens"] == 900 and obj["error"] is None and obj["coserve"]["loss"] is None
    failed = replace(running, ft_outcome="failed", ft_failure="the trainer died 3 times in a row",
                     ft_finished_at=1_200.5, adapter_path=Path("/out/adapter"))
    obj = job_object(JOB, failed, now=1_300.0)
    assert (obj["status"], obj["finished_at"], obj["estimated_finish"]) == ("failed", 1_200, None)
    assert obj["error"]["message"] == "the trainer died 3 times in a row" and obj["result_files"] == ["/out/adapter"]


def test_job_events_from_the_train_log(tmp_path: Path) -> None:
    log = tmp_path / "train_log.jsonl"
    rows = [{"step": 0, "loss": 2.5, "wall_time": 1_001.0, "tokens": 64, "lr": 1e-3, "skipped": False},
            {"step": 1, "loss": None, "wall_time": 1_002.0, "tokens": 64, "lr": 1e-3, "skipped": True},
            {"step": 2, "loss": 1.25, "wall_time": 1_003.0, "tokens": 64, "lr": 1e-3, "skipped": False},
            # (OptimizerStepLog.reported False: committed, then the trainer died before reporting it)
            {"step": 3, "loss": None, "wall_time": 1_004.0, "tokens": 64, "lr": None, "grad_norm": None,
             "skipped": False, "reported": False}]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')  # a line being written
    job = replace(JOB, train_log=log)
    events = job_events(job, EngineStats(coserving=True))
    json.dumps(events, allow_nan=False)  # (as the API sends them)
    assert [e["message"] for e in events] == [
        "Step 4/40: trained; its loss is unknown (the trainer died before reporting it)",
        "Step 3/40: training loss=1.2500",
        "Step 2/40: skipped (non-finite loss or gradient)",
        "Step 1/40: training loss=2.5000",
        f"Fine-tuning {MODEL} on data.jsonl started",
    ]
    assert events[0]["level"] == "warn" and events[0]["type"] == "message"
    assert events[1]["type"] == "metrics" and events[1]["data"]["train_loss"] == 1.25 and events[2]["level"] == "warn"
    # its set-up, once done (JobBoard writes setup.json), after its start
    (tmp_path / "setup.json").write_text(json.dumps({"began_at": 980.25, "done_at": 999.5, "samples": 98,
                                                     "skipped": 2, "resumed": False}))
    set_up = job_events(job, EngineStats(coserving=True))
    assert set_up[-2]["message"] == "Set up in 19.2 s: 98 training samples (2 malformed rows skipped); training starts"
    assert set_up[-2]["created_at"] == 999 and set_up[-2]["data"]["setup_seconds"] == pytest.approx(19.25)
    assert len(set_up) == len(events) + 1
    (tmp_path / "setup.json").write_text(json.dumps({"began_at": 5.0, "done_at": 9.0, "samples": 98, "skipped": 0,
                                                     "resumed": True}))
    assert job_events(job, EngineStats(coserving=True))[-2]["message"] == \
        "Set up again from its checkpoint in 4.0 s: 98 training samples; training starts"
    (tmp_path / "setup.json").write_text(json.dumps({"began_at": 1_002.0, "done_at": 1_002.5, "samples": 98,
                                                     "skipped": 0, "resumed": True}))  # (after step 2: resumed)
    assert [e["id"].rpartition("-")[2] for e in job_events(job, EngineStats(coserving=True))] == \
        ["4", "3", "setup", "2", "1", "start"]
    (tmp_path / "setup.json").write_text('{"began_at": 5.0')  # (unreadable: no event, nothing fails)
    assert len(job_events(job, EngineStats(coserving=True))) == len(events)
    (tmp_path / "setup.json").unlink()
    ended = job_events(job, EngineStats(coserving=True, ft_outcome="succeeded", ft_finished_at=1_010.0,
                                        adapter_path=Path("/out/adapter")))
    assert ended[0]["message"] == "The job has successfully completed to /out/adapter"
    assert ended[0]["created_at"] == 1_010 and len(ended) == len(events) + 1


def test_total_steps_the_estimate_then_the_progress_then_the_count() -> None:
    """The LR schedule's estimate (JOB: 40) is what ``Step k/n`` shows only until samples are
    trained; a run whose tasks pack fewer samples takes more steps than estimated."""
    assert total_steps(JOB, EngineStats(coserving=True)) == 40
    running = EngineStats(coserving=True, ft_optimizer_steps=30, ft_samples_retired=50, ft_samples_total=100)
    assert total_steps(JOB, running) == 60
    assert job_object(JOB, running, now=2_000.0)["coserve"]["total_steps"] == 60
    assert total_steps(JOB, replace(running, ft_outcome="succeeded", ft_optimizer_steps=61)) == 61
    assert total_steps(JOB, replace(running, ft_outcome="cancelled")) == 60


def test_the_trainer_exits_off_the_engine_thread_while_serving_goes_on(tmp_path: Path) -> None:
    """A cancelled job's trainer finishes its task before it exits (a task's time, longer on a
    busy CPU); the engine answers meanwhile, and the server's shutdown waits for it."""
    engine, session = tiny_session(tmp_path, epochs=500)
    exiting, release = threading.Event(), threading.Event()
    stop = session.coserver.close

    def slow_exit() -> None:  # a trainer still in its task
        exiting.set()
        release.wait(30)
        stop()

    session.coserver.close = slow_exit  # type: ignore[method-assign]
    with serve(engine, session) as s:
        (job,) = s.client.fine_tuning.jobs.list().data
        assert s.client.fine_tuning.jobs.cancel(job.id).status == "cancelled"
        assert exiting.wait(30) and not release.is_set()
        r = s.client.completions.create(model=MODEL, prompt="Where is the candle?", max_tokens=3)
        assert r.usage is not None and r.usage.completion_tokens >= 1, "answered while the trainer exits"
        assert s.engine_thread.session is None and engine.coserver is None
        release.set()
    assert session.coserver.trainer.pid is None, "the shutdown waited for the trainer to exit"


def test_checkpoints_are_written_off_the_engine_thread_and_a_failed_one_keeps_the_last(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint is hundreds of MB at the 8B shape: the engine's thread copies the state and a
    writer thread writes it, so that steps do not wait for the disk."""
    import torch

    import coserve.server.finetune as finetune

    _, session = tiny_session(tmp_path, epochs=1)
    try:
        save = torch.save
        writing, release = held(monkeypatch, torch, "save")
        path = session.save_checkpoint()
        assert writing.wait(30) and not (path / "trainer_state.pt").exists(), "returned before the write"
        release.set()
        session.flush_checkpoints()
        assert (path / "trainer_state.pt").is_file() and (path / "adapter" / "adapter_config.json").is_file()
        monkeypatch.setattr(torch, "save", save)

        def broken(*args: object, **kwargs: object) -> None:
            raise OSError("disk full")

        monkeypatch.setattr(finetune, "save_peft_adapter", broken)
        before = (path / "trainer_state.pt").read_bytes()
        session.save_checkpoint()
        session.flush_checkpoints()  # (logged, not raised)
        assert (path / "trainer_state.pt").read_bytes() == before, "the last good checkpoint is kept"
    finally:
        session.close()


def test_a_jobs_adapter_is_written_off_the_engine_thread_and_served_meanwhile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The export's write takes tens to hundreds of ms at the 8B shape: the engine serves the
    adapter from memory at once and answers meanwhile; the cancel route returns once the files
    are there."""
    import coserve.server.finetune as finetune

    engine, session = tiny_session(tmp_path, epochs=500)
    engine.lora_manager.bind_training_slot("live")
    writing, release = held(monkeypatch, finetune, "save_peft_adapter")
    with serve(engine, session, adapters={"live": "(training)"}, finetune_name="live") as s:
        (job,) = s.client.fine_tuning.jobs.list().data
        cancelled: list[str] = []
        cancel = threading.Thread(target=lambda: cancelled.append(s.client.fine_tuning.jobs.cancel(job.id).status))
        cancel.start()
        assert writing.wait(30)
        deadline = time.monotonic() + 30  # (published between two steps, once the export is asked for)
        while s.client.fine_tuning.jobs.retrieve(job.id).status != "cancelled":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for model in (MODEL, "live"):  # (the trained adapter, from memory, its file not yet written)
            r = s.client.completions.create(model=model, prompt="Where is the candle?", max_tokens=3)
            assert r.usage is not None and r.usage.completion_tokens >= 1
        assert not (tmp_path / "out" / "adapter").exists() and cancel.is_alive(), "the route waits for the files"
        release.set()
        cancel.join(30)
        assert cancelled == ["cancelled"] and (tmp_path / "out" / "adapter" / "adapter_config.json").is_file()


def test_a_checkpoint_taken_after_a_commit_but_before_its_result_holds_the_logged_steps(tmp_path: Path) -> None:
    """The trainer commits an optimizer step's state before the engine takes in its result (and
    logs the step): a checkpoint taken in between (a pause, between two engine steps) must still
    count exactly the steps in the train log, so that the run resumed from it logs every step
    once and trains none twice. The race forced: the test waits for the commit without letting
    the co-server poll, then saves."""
    import torch

    engine, session = tiny_session(tmp_path, epochs=500)
    try:
        coserver = session.coserver
        first_commit_unread(engine, session)
        assert coserver.steps_done == 0 and session.history == []
        path = session.save_checkpoint()
        session.flush_checkpoints()
        saved = torch.load(path / "trainer_state.pt", weights_only=True)
        assert saved["steps"] == coserver.steps_done == len(session.history) == 1, "the step is logged first"
        logged = session.history[0]
        state, steps = session.trainer.committed_state()
        assert steps == 1 and torch.equal(saved["state"], state)
        assert saved["pool"] == session.pool.state_dict(), "the step's samples are retired in it"
    finally:
        session.close()

    spec = replace(session.spec, resume=True)
    resumed = FinetuneSession(engine, spec)
    try:
        assert resumed.coserver.steps_done == 1
        assert resumed.pool.progress.samples_retired == len(logged.sample_ids), "no sample trained twice"
        train_until(engine, resumed, 3)
    finally:
        resumed.close()
    steps_logged = [json.loads(line)["step"] for line in (spec.output / "train_log.jsonl").read_text().splitlines()]
    assert steps_logged == list(range(len(steps_logged))) and len(steps_logged) >= 3, "every step logged once"


def test_a_checkpoint_taken_while_the_last_task_of_a_step_commits_holds_the_logged_steps(tmp_path: Path) -> None:
    """A task already in flight may commit its optimizer step at any moment, also between the
    check that every committed step is logged and the copy of the committed state (session 30: a
    job paused on the H100 wrote a checkpoint one step ahead of its log, and its resume refused
    it: "steps_skipped -1"). Forced here: the copy waits for the commit that the check did not
    see. The checkpoint must still count exactly the logged steps, and resume."""
    import torch

    engine, session = tiny_session(tmp_path, epochs=500)
    try:
        coserver, trainer = session.coserver, session.trainer
        deadline = time.monotonic() + 60
        while not coserver.backward_running:  # (its first task ends optimizer step 0)
            engine.step()
            assert time.monotonic() < deadline
        copy_state = trainer.committed_state

        def late_copy(out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
            while trainer.committed_steps < 1:  # (the commit lands after the check, before the copy)
                assert time.monotonic() < deadline
                time.sleep(0.01)
            return copy_state(out)

        trainer.committed_state = late_copy  # type: ignore[method-assign]
        path = session.save_checkpoint()
        session.flush_checkpoints()
        del trainer.committed_state
        saved = torch.load(path / "trainer_state.pt", weights_only=True)
        assert saved["steps"] == saved["steps_done"] == coserver.steps_done == len(session.history) == 1
        assert saved["pool"] == session.pool.state_dict(), "the step's samples are retired in it"
        logged = session.history[0]
    finally:
        session.close()

    resumed = FinetuneSession(engine, replace(session.spec, resume=True))
    try:
        assert resumed.coserver.steps_done == 1
        assert resumed.pool.progress.samples_retired == len(logged.sample_ids), "no sample trained twice"
    finally:
        resumed.close()


def test_a_checkpoint_ahead_of_its_log_still_resumes(tmp_path: Path) -> None:
    """A checkpoint written before that race was closed may hold one applied step more than its log
    and pool (session 30's paused job: "steps_skipped -1", the job failed at its resume). It
    resumes, with a warning, from the trainer's count: that step's samples train again."""
    import torch

    engine, session, path = checkpointed_run(tmp_path, 2)
    saved = torch.load(path / "trainer_state.pt", weights_only=True)
    applied = saved["steps"]
    log = session.spec.output / "train_log.jsonl"
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines()[:applied - 1]))
    torch.save({**saved, "steps_done": applied - 1}, path / "trainer_state.pt")  # (the log one step behind)

    resumed = FinetuneSession(engine, replace(session.spec, resume=True))
    try:
        coserver = resumed.coserver
        assert (coserver.steps_done, coserver.steps_applied, coserver.steps_skipped) == (applied, applied, 0)
        assert resumed.trainer.committed_steps == applied
        train_until(engine, resumed, applied + 2)
        resumed.save_checkpoint()
        resumed.flush_checkpoints()
    finally:
        resumed.close()
    saved = torch.load(path / "trainer_state.pt", weights_only=True)
    assert saved["steps_done"] == saved["steps"] == coserver.steps_done >= applied + 2, "checkpoints go on"


def test_a_run_resumed_after_a_skipped_step_goes_on_from_the_logged_steps(tmp_path: Path) -> None:
    """A skipped optimizer step (non-finite loss or gradient) is logged and counted, but leaves the
    trainer's committed count, which counts applied steps, where it was: a checkpoint keeps both
    counts and the resume goes on from the logged one, the trainer from the applied one. (The
    tiny run skips none: the skipped last step is written into its checkpoint and log by hand.)"""
    import torch

    engine, session, path = checkpointed_run(tmp_path, 2)
    saved = torch.load(path / "trainer_state.pt", weights_only=True)
    applied = saved["steps"]
    assert saved["steps_done"] == applied == len(session.history)
    log = session.spec.output / "train_log.jsonl"
    lines = log.read_text().splitlines()[:applied]
    skipped = {**json.loads(lines[-1]), "step": applied, "loss": None, "skipped": True}
    log.write_text("".join(line + "\n" for line in [*lines, json.dumps(skipped)]))
    torch.save({**saved, "steps_done": applied + 1}, path / "trainer_state.pt")

    resumed = FinetuneSession(engine, replace(session.spec, resume=True))
    try:
        coserver = resumed.coserver
        assert (coserver.steps_done, coserver.steps_applied) == (applied + 1, applied)
        assert coserver.skipped_in_a_row == 1, "the skipped step still counts towards max_skipped_steps"
        assert resumed.trainer.committed_steps == applied
        train_until(engine, resumed, applied + 3)
        resumed.save_checkpoint()
        resumed.flush_checkpoints()
    finally:
        resumed.close()
    saved = torch.load(path / "trainer_state.pt", weights_only=True)
    assert saved["steps_done"] == saved["steps"] + 1 == coserver.steps_done, "the checkpoint after it is written"
    steps_logged = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps_logged == list(range(coserver.steps_done)), "the skipped step's line kept, every step logged once"


@pytest.mark.parametrize("stopped", ["paused", None])
def test_a_job_paused_or_cancelled_as_its_last_step_commits_has_succeeded(tmp_path: Path, stopped: str | None) -> None:
    """A pause or a cancel that comes between the commit of the job's last optimizer step and its
    result: the step is taken in before the outcome is decided, so the job has completed
    (``succeeded``: nothing left to resume), not ``paused`` or ``cancelled``. The race forced as
    above: the test waits for the commit without letting the co-server poll, then stops the job as
    ``EngineThread.cancel_finetuning`` does on the loop thread."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(DATA.read_text().splitlines(keepends=True)[:4]))
    engine = LLMEngine(EngineConfig(model=MODEL, device="cpu", num_training_slots=1, max_lora_rank=8))
    spec = FinetuneSpec(data=data, output=tmp_path / "out", lora=LoRAConfig(rank=8, alpha=16), optim=OptimConfig(lr=1e-3),
                        coserve=CoServeConfig(backward_tokens=32, max_seq_len=64, epochs=1), trainer_threads=1)
    session = FinetuneSession(engine, spec)
    et = EngineThread(engine, session)  # (not started: the test is its loop thread)
    try:
        coserver = session.coserver
        deadline = time.monotonic() + 60
        def last_task_runs() -> bool:
            return coserver.backward_running and not session.pool.candidates()

        while not last_task_runs():  # (checked after each call that may submit it: the next would poll)
            if not engine.step() and not last_task_runs():
                session.wait(0.05)
            assert time.monotonic() < deadline
        while session.trainer.committed_steps <= coserver.steps_done:  # committed, its result not taken in
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not session.done
        et._finish_session(session, stopped)
    finally:
        et.wait_trainers_exited(30)
    final = et.ended[session.job_id]
    assert final.ft_outcome == "succeeded" and final.adapter_path is not None
    assert final.ft_optimizer_steps == len(session.history) == session.trainer.committed_steps
    assert final.ft_samples_retired == final.ft_samples_total == 4
    assert job_object(JOB, final)["status"] == "succeeded"


def test_a_pause_checkpoints_and_exports_one_copy_of_the_trainers_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pause's checkpoint and its exported adapter come from ONE copy of the trainer's state (a
    copy is hundreds of MB at the 8B shape, on the engine's thread: session 44's H100 pause made
    two, stalled serving 0.37 s and put two requests over their SLO), so both hold the step the
    pause counts, the one a resume goes on from."""
    import torch
    from safetensors.torch import load_file

    engine, session = tiny_session(tmp_path, epochs=500)
    et = EngineThread(engine, session)  # (not started: the test is its loop thread)
    try:
        train_until(engine, session, 2)
        copies: list[int] = []
        copy_state = session.trainer.committed_state

        def counted(out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
            state, steps = copy_state(out)
            copies.append(steps)
            return state, steps

        monkeypatch.setattr(session.trainer, "committed_state", counted)
        et._finish_session(session, "paused")
        assert len(copies) == 1, f"the state copied {len(copies)} times"
    finally:
        et.wait_trainers_exited(30)
    final = et.ended[session.job_id]
    assert final.ft_outcome == "paused"
    out = tmp_path / "out"
    saved = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=True)
    assert saved["steps_done"] == final.ft_optimizer_steps == len(session.history) >= 2
    exported = load_file(out / "adapter" / "adapter_model.safetensors")
    checkpointed = load_file(out / "checkpoint" / "adapter" / "adapter_model.safetensors")
    assert exported.keys() == checkpointed.keys() and all(torch.equal(exported[k], checkpointed[k]) for k in exported)


def test_a_checkpoint_holds_the_state_copied_when_it_was_asked_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The state is copied into a buffer the session keeps (a fresh copy's time is mostly page
    faults); a checkpoint still being written when the next copy is taken keeps its own state: the
    next copy goes elsewhere."""
    import torch

    engine, session = tiny_session(tmp_path, epochs=500)
    try:
        written: list[tuple[int, torch.Tensor]] = []
        save = torch.save

        def recorded(obj: object, *args: object, **kwargs: object) -> None:
            if isinstance(obj, dict) and "state" in obj:
                written.append((obj["steps"], obj["state"].clone()))
            save(obj, *args, **kwargs)

        monkeypatch.setattr(torch, "save", recorded)
        writing, release = held(monkeypatch, torch, "save")
        train_until(engine, session, 1)
        session.save_checkpoint()
        assert writing.wait(30)
        first = session.trainer.committed_state()
        train_until(engine, session, session.coserver.steps_done + 1)
        second = session.trainer.committed_state()
        assert second[1] == first[1] + 1 and not torch.equal(first[0], second[0])
        session.save_checkpoint()  # (the first one's write still held)
        release.set()
        session.flush_checkpoints()
        assert [steps for steps, _ in written] == [first[1], second[1]]
        assert torch.equal(written[0][1], first[0]) and torch.equal(written[1][1], second[0])
        session.save_checkpoint()  # (both written: the buffer is free again)
        session.flush_checkpoints()
        assert torch.equal(written[2][1], second[0])
    finally:
        session.close()


def test_a_resumed_runs_trainer_starts_once_from_the_checkpoints_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resume puts the checkpoint's state in the trainer's bank before its process starts: one
    start (a start and a restart cost a resume ~6 s on session 44's H100), the adapter served and
    trained from the checkpoint's. A checkpoint of other LoRA settings is refused with a message
    that says so, before any process starts."""
    import torch

    from coserve.trainer.process import TrainerProcess

    engine, first, path = checkpointed_run(tmp_path, 2)
    saved = torch.load(path / "trainer_state.pt", weights_only=True)
    starts: list[int] = []
    start = TrainerProcess._start

    def counted(self: TrainerProcess) -> None:
        starts.append(int(self.meta[1 + int(self.meta[0])]) if int(self.meta[0]) >= 0 else 0)
        start(self)

    monkeypatch.setattr(TrainerProcess, "_start", counted)
    resumed = FinetuneSession(engine, replace(first.spec, resume=True))
    try:
        assert starts == [saved["steps"]], "one start, from the checkpoint's steps"
        state, steps = resumed.trainer.committed_state()
        assert steps == saved["steps"] and torch.equal(state, saved["state"])
        train_until(engine, resumed, resumed.coserver.steps_done + 1)
    finally:
        resumed.close()
    other = replace(first.spec, resume=True, lora=LoRAConfig(rank=4, alpha=8))
    with pytest.raises(ValueError, match=r"other settings: --lora-rank 4 \(the checkpoint's: 8\); --lora-alpha 8"):
        FinetuneSession(engine, other)
    assert len(starts) == 1, "no trainer started for the refused resume"


def test_a_checkpoint_asked_for_while_the_state_is_being_copied_copies_elsewhere(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint (a pause's, a job's end) copies the trainer's state into the session's buffer
    and takes in the results of the steps it holds; a result taken in is logged, and its log line
    may ask for a periodic checkpoint (``save_every``) inside that copy's loop: that one's copy
    must go elsewhere, not over the state the first is still reading. The race forced as above:
    the checkpoint comes between a step's commit and its result."""
    import torch

    engine = LLMEngine(EngineConfig(model=MODEL, device="cpu", num_training_slots=1, max_lora_rank=8))
    spec = FinetuneSpec(data=DATA, output=tmp_path / "out", lora=LoRAConfig(rank=8, alpha=16), optim=OptimConfig(lr=1e-3),
                        coserve=CoServeConfig(backward_tokens=32, max_seq_len=64, epochs=500), trainer_threads=1,
                        save_every=1)
    session = FinetuneSession(engine, spec)
    try:
        first_commit_unread(engine, session)
        into: list[bool] = []
        copy_state = session.trainer.committed_state

        def recorded(out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
            into.append(out is session._state_buffer)
            return copy_state(out)

        monkeypatch.setattr(session.trainer, "committed_state", recorded)
        path = session.save_checkpoint()  # (its loop logs step 0, whose line asks for one more)
        session.flush_checkpoints()
        assert into == [True, False], "the nested checkpoint's copy went elsewhere"
        saved = torch.load(path / "trainer_state.pt", weights_only=True)
        state, _ = copy_state()
        assert saved["steps"] == saved["steps_done"] == len(session.history) == 1 and torch.equal(saved["state"], state)
    finally:
        session.close()

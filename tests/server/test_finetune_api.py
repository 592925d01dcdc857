"""Fine-tuning jobs created through the API (``coserve serve --finetune-jobs DIR``), end to end:
the ``openai`` client uploads a dataset, creates a job, watches it succeed and chats with its
adapter, while the server keeps answering; then a second job, and one that fails."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import pytest

from coserve.core.config import CoServeConfig, LoRAConfig, OptimConfig
from coserve.core.finetune import load_dataset
from coserve.core.latency import LatencyModel
from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.server.dataset_reader import DatasetReader
from coserve.server.finetune import FinetuneSpec
from coserve.server.job_board import JobsConfig, prepare_graphs, prepare_latency
from tests.server.test_api import DATA, MODEL, Served, http, serve

ROWS = DATA.read_text().splitlines()[:8]
TEMPLATE = FinetuneSpec(data=Path(""), output=Path(""), lora=LoRAConfig(rank=8, alpha=16), optim=OptimConfig(lr=1e-3),
                        coserve=CoServeConfig(backward_tokens=32, max_seq_len=64), trainer_threads=1, save_every=0)


DATA_BYTES = ("\n".join(ROWS) + "\n").encode()


def jobs_engine() -> LLMEngine:
    """An engine that fine-tunes (a training slot) and serves adapters of the template's rank."""
    return LLMEngine(EngineConfig(model=MODEL, device="cpu", num_training_slots=1, max_lora_rank=8))


def wait_for(s: Served, job_id: str, statuses: tuple[str, ...], timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while (status := s.client.fine_tuning.jobs.retrieve(job_id).status) not in statuses:
        assert time.monotonic() < deadline, f"job {job_id} still {status}"
        time.sleep(0.1)
    return status


def ask(s: Served, model: str) -> str:
    r = s.client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Where is the candle?"}],
                                         max_tokens=4, temperature=0)
    return r.choices[0].message.content or ""


def test_clients_upload_data_create_jobs_and_chat_with_their_adapters(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import coserve.server.finetune as finetune

    def slow_load(*args: object, **kwargs: object) -> object:  # a set-up that takes a while, as a big one does
        time.sleep(1.0)
        return load_dataset(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(finetune, "load_dataset", slow_load)
    read = DatasetReader.read

    def slow_read(self: DatasetReader, *args: Any, **kwargs: Any) -> object:  # (the same, in the reader's child)
        time.sleep(1.0)
        return read(self, *args, **kwargs)

    monkeypatch.setattr(DatasetReader, "read", slow_read)
    engine = jobs_engine()
    with serve(engine, jobs=JobsConfig(tmp_path, TEMPLATE)) as s:
        jobs = s.client.fine_tuning.jobs
        # the Files API: malformed rows counted, a file with no usable row refused with the first reasons
        data = "\n".join([*ROWS, '{"instruction": "no output"}', "not json"]) + "\n"
        f = s.client.files.create(file=("facts.jsonl", data.encode()), purpose="fine-tune")
        assert (f.object, f.purpose, f.filename, f.status) == ("file", "fine-tune", "facts.jsonl", "processed")
        extra = f.coserve  # type: ignore[attr-defined]
        assert (extra["rows"], extra["samples"], extra["malformed_rows"]) == (10, 8, 2)
        assert extra["first_malformed"]["line"] == 9
        with pytest.raises(openai.BadRequestError, match=r"bad.jsonl: no usable rows \(2 rows read\); line 1: "):
            s.client.files.create(file=("bad.jsonl", b'{"output": "x"}\n[1, 2]\n'), purpose="fine-tune")
        with pytest.raises(openai.BadRequestError, match="purpose"):
            s.client.files.create(file=("facts.jsonl", data.encode()), purpose="assistants")
        assert [x.id for x in s.client.files.list().data] == [f.id]
        assert s.client.files.retrieve(f.id).bytes == len(data.encode())

        # bad requests: each a 4xx that says what is wrong
        with pytest.raises(openai.BadRequestError, match="its base model 'tiny'"):
            jobs.create(model="gpt-4o-mini", training_file=f.id)
        with pytest.raises(openai.NotFoundError, match="no file 'file-nope'"):
            jobs.create(model=MODEL, training_file="file-nope")
        with pytest.raises(openai.BadRequestError, match="batch_size: coserve batches by tokens"):
            jobs.create(model=MODEL, training_file=f.id, hyperparameters={"batch_size": 4})
        with pytest.raises(openai.BadRequestError, match="n_epochs"):
            jobs.create(model=MODEL, training_file=f.id, hyperparameters={"n_epochs": "many"})
        status, body = http(s.url + "/v1/fine_tuning/jobs", raw=b'{"model": "tiny", "training_file": ')
        assert status == 400 and "JSON" in body["error"]["message"]
        assert jobs.list().data == []

        # a job: set up off the engine's loop (requests answered meanwhile), then trained
        job = jobs.create(model=MODEL, training_file=f.id, suffix="facts", seed=3,
                          hyperparameters={"n_epochs": 3, "learning_rate_multiplier": 2})
        assert job.status in ("validating_files", "running") and job.fine_tuned_model is None
        assert job.hyperparameters.n_epochs == 3 and job.seed == 3
        answered_while_set_up = 0
        while jobs.retrieve(job.id).status == "validating_files":
            t = time.monotonic()
            assert ask(s, MODEL)
            assert time.monotonic() - t < 2.0
            answered_while_set_up += 1
        assert answered_while_set_up >= 1
        assert ask(s, MODEL), "answered while it trains"
        assert wait_for(s, job.id, ("succeeded", "failed", "cancelled")) == "succeeded"
        job = jobs.retrieve(job.id)
        assert job.fine_tuned_model == f"ft:{MODEL}:coserve:facts:{job.id}"
        assert job.trained_tokens is not None and job.trained_tokens > 0 and job.finished_at is not None
        assert job.result_files == [str(tmp_path / "jobs" / job.id / "adapter")]
        assert job.hyperparameters.learning_rate_multiplier == 2
        events = jobs.list_events(job.id, limit=1000).data
        assert events[0].message.startswith("The job has successfully completed")
        assert any(e.type == "metrics" and e.message.startswith("Step 1/") for e in events)
        # what its set-up took (the slow reader's second at least), after its start event
        set_up = [e for e in events if e.message.startswith("Set up in ")]
        assert len(set_up) == 1 and "8 training samples" in set_up[0].message
        assert set_up[0].data["setup_seconds"] >= 1.0  # type: ignore[index]
        assert (tmp_path / "latency_state.json").is_file(), "the next job starts from this job's latency model"
        assert job.fine_tuned_model in [m.id for m in s.client.models.list().data]
        answer = ask(s, job.fine_tuned_model)
        assert answer

        # a second job: its figures start at zero, the first's are kept and its adapter still served
        second = jobs.create(model=MODEL, training_file=f.id, hyperparameters={"n_epochs": 1})
        assert second.trained_tokens in (None, 0) and second.id != job.id
        assert wait_for(s, second.id, ("succeeded", "failed", "cancelled")) == "succeeded"
        listed = jobs.list().data
        assert [j.id for j in listed] == [second.id, job.id]
        assert listed[1].trained_tokens == job.trained_tokens
        assert 0 < (listed[0].trained_tokens or 0) < (job.trained_tokens or 0)
        assert listed[0].fine_tuned_model == f"ft:{MODEL}:coserve:{second.id}"
        assert ask(s, job.fine_tuned_model) == answer

        # a job that fails (its data gone before it is read) leaves serving and the adapters intact
        (tmp_path / "files" / f.coserve["stored_as"]).unlink()  # type: ignore[attr-defined]
        failing = jobs.create(model=MODEL, training_file=f.id)
        assert wait_for(s, failing.id, ("succeeded", "failed", "cancelled")) == "failed"
        failed = jobs.retrieve(failing.id)
        assert failed.error is not None and "setting up the job" in failed.error.message
        assert failed.fine_tuned_model is None
        with pytest.raises(openai.NotFoundError, match=r"has ended \(failed\) and no adapter of it is loaded"):
            s.client.models.delete(f"ft:{MODEL}:coserve:{failing.id}")  # (never served, so never deleted)
        assert ask(s, job.fine_tuned_model) == answer and ask(s, MODEL)


def test_without_finetune_jobs_the_routes_name_the_flag() -> None:
    with serve(LLMEngine(EngineConfig(model=MODEL, device="cpu"))) as s:
        with pytest.raises(openai.NotFoundError, match="--finetune-jobs DIR"):
            s.client.files.create(file=("facts.jsonl", b"{}"), purpose="fine-tune")
        with pytest.raises(openai.NotFoundError, match="--finetune-jobs DIR"):
            s.client.files.list()
        with pytest.raises(openai.BadRequestError, match="--finetune-jobs DIR"):
            s.client.fine_tuning.jobs.create(model=MODEL, training_file="file-abc")


def test_jobs_start_from_a_latency_model_calibrated_at_start_up(tmp_path: Path) -> None:
    # (before the server serves: a job created later must not stall requests with the sweep)
    engine = jobs_engine()
    config = JobsConfig(tmp_path / "jobs", TEMPLATE)
    said = prepare_latency(config, engine, None, calibrate=True)
    assert said.startswith("latency model calibrated for the jobs on") and config.latency_path.is_file()
    state = json.loads(config.latency_path.read_text())
    assert state != LatencyModel().state_dict(), "the sweep moved the coefficients"
    LatencyModel().load_state_dict(state)  # what a job's FinetuneSpec.latency_state loads
    # a later start finds it; --latency-state wins; --no-calibrate leaves the defaults
    assert prepare_latency(config, engine, None, calibrate=True) == f"jobs start from {config.latency_path}"
    given = JobsConfig(tmp_path / "given", replace(TEMPLATE, latency_state=config.latency_path))
    assert prepare_latency(given, engine, None, calibrate=True).startswith("jobs start from --latency-state")
    bare = JobsConfig(tmp_path / "bare", TEMPLATE)
    assert "default latency coefficients" in prepare_latency(bare, engine, None, calibrate=False)
    assert not given.latency_path.exists() and not bare.latency_path.exists()
    # a DIR/latency_state.json measured on another setup (another model since the last start) is
    # moved aside and the sweep runs again; a --latency-state of another setup stops the start
    state["engine"] = {**state["engine"], "model": "/elsewhere/another-model"}
    config.latency_path.write_text(json.dumps(state))
    said = prepare_latency(config, engine, None, calibrate=True)
    assert said.startswith("latency model calibrated") and "measured on another setup: model" in said
    assert json.loads(config.latency_path.read_text())["engine"]["model"] != "/elsewhere/another-model"
    aside, = config.root.glob("latency_state.replaced-*.json")
    assert json.loads(aside.read_text()) == state
    stale = JobsConfig(tmp_path / "stale", replace(TEMPLATE, latency_state=aside))
    with pytest.raises(ValueError, match="--latency-state: latency state .* measured on another setup: model"):
        prepare_latency(stale, engine, None, calibrate=True)


def test_the_prefill_graphs_of_a_jobs_adapter_are_captured_at_start_up(tmp_path: Path) -> None:
    """``prepare_graphs`` declares the linears every job's adapter trains on the training slot
    before the server serves, so its prefill graphs are captured then, not at a job's attach on the
    engine's thread (on the CPU there are none: a stand-in records what would be captured)."""
    from coserve.models.peft_adapter import new_lora_adapter, save_peft_adapter

    engine = jobs_engine()
    captured: list[frozenset[tuple[int, str]]] = []
    engine.runner.prefill_graphs = SimpleNamespace(add_live_variant=captured.append)
    slot = engine.lora_manager.training_slot(0)
    cfg = engine.model_config
    job = new_lora_adapter(num_layers=cfg.num_layers, shapes=cfg.linear_shapes(), rank=8, alpha=16,
                           target_modules=TEMPLATE.lora.target_modules)  # (what a job's session trains)
    targets = prepare_graphs(JobsConfig(tmp_path / "jobs", TEMPLATE), engine)
    assert frozenset(targets) == frozenset(job.weights) and captured == [frozenset(job.weights)]
    assert engine.lora_manager.live_targets([slot]) == frozenset(job.weights)
    # a template that starts every job from an adapter of other linears declares those
    save_peft_adapter(new_lora_adapter(num_layers=cfg.num_layers, shapes=cfg.linear_shapes(), rank=4, alpha=8,
                                       target_modules=["q_proj"]), tmp_path / "init")
    other = prepare_graphs(JobsConfig(tmp_path / "jobs", replace(TEMPLATE, init_adapter=tmp_path / "init")), engine)
    assert frozenset(other) == {(layer, "q_proj") for layer in range(cfg.num_layers)} == captured[-1]


def test_a_restarted_server_lists_its_jobs_and_serves_their_adapters(tmp_path: Path) -> None:
    config = JobsConfig(tmp_path, TEMPLATE)
    data = DATA_BYTES

    with serve(jobs_engine(), jobs=config) as s:
        f = s.client.files.create(file=("facts.jsonl", data), purpose="fine-tune")
        job = s.client.fine_tuning.jobs.create(model=MODEL, training_file=f.id, suffix="kept",
                                               hyperparameters={"n_epochs": 1})
        assert wait_for(s, job.id, ("succeeded", "failed", "cancelled")) == "succeeded"
        done = s.client.fine_tuning.jobs.retrieve(job.id)
        answer = ask(s, done.fine_tuned_model or "")
    # a job that was running when its server stopped (no outcome.json): failed, not served
    crashed = "ftjob-crashed000000000000000000"
    fields = json.loads((tmp_path / "jobs" / job.id / "job.json").read_text())
    fields.update(id=crashed, created_at=fields["created_at"] + 1, fine_tuned_model=f"ft:{MODEL}:coserve:{crashed}",
                  train_log=str(tmp_path / "jobs" / crashed / "train_log.jsonl"))
    (tmp_path / "jobs" / crashed).mkdir()
    (tmp_path / "jobs" / crashed / "job.json").write_text(json.dumps(fields))

    with serve(jobs_engine(), jobs=config) as s:
        listed = s.client.fine_tuning.jobs.list().data
        assert [j.id for j in listed] == [crashed, job.id]
        again = listed[1]
        assert (again.status, again.fine_tuned_model, again.trained_tokens) == (
            "succeeded", done.fine_tuned_model, done.trained_tokens)
        assert again.result_files == done.result_files and again.finished_at == done.finished_at
        assert ask(s, done.fine_tuned_model or "") == answer, "served again under its name"
        assert done.fine_tuned_model in [m.id for m in s.client.models.list().data]
        lost = listed[0]
        assert lost.status == "failed" and lost.fine_tuned_model is None
        assert lost.error is not None and "the server stopped while this job ran" in lost.error.message
        assert [x.id for x in s.client.files.list().data] == [f.id]
        assert s.client.fine_tuning.jobs.list_events(job.id, limit=1).data[0].message.startswith(
            "The job has successfully completed")


def test_a_validation_file_is_scored_with_the_base_model_and_the_trained_adapter(tmp_path: Path) -> None:
    """OpenAI's ``validation_file``: its loss and token accuracy with the trained adapter (the
    ``full_valid_*`` metrics event), and, as ``coserve finetune --eval-data`` reports it, before
    training; scored through the serving engine and kept for a restarted server."""
    from coserve.server.finetune import evaluate

    engine = jobs_engine()
    assert engine.tokenizer is not None
    reference = evaluate(LLMEngine(EngineConfig(model=MODEL, device="cpu")),
                         load_dataset(DATA, engine.tokenizer, max_seq_len=64).samples[:8])
    data = DATA_BYTES
    with serve(engine, jobs=JobsConfig(tmp_path, TEMPLATE)) as s:
        train = s.client.files.create(file=("facts.jsonl", data), purpose="fine-tune")
        valid = s.client.files.create(file=("held.jsonl", data), purpose="fine-tune")
        with pytest.raises(openai.NotFoundError, match="no file 'file-nope'"):
            s.client.fine_tuning.jobs.create(model=MODEL, training_file=train.id, validation_file="file-nope")
        job = s.client.fine_tuning.jobs.create(model=MODEL, training_file=train.id, validation_file=valid.id,
                                               metadata={"team": "facts"},
                                               hyperparameters={"n_epochs": 4, "learning_rate_multiplier": 3})
        assert job.validation_file == valid.id and job.metadata == {"team": "facts"}
        assert wait_for(s, job.id, ("succeeded", "failed", "cancelled")) == "succeeded"
        deadline = time.monotonic() + 60
        while (v := s.client.fine_tuning.jobs.retrieve(job.id).coserve["validation"])["status"] == "running":  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, v
            time.sleep(0.1)
        assert v["status"] == "succeeded", v
        assert v["samples"] == 8 and v["tokens"] == reference.tokens
        assert v["loss_before"] == pytest.approx(reference.loss, rel=1e-4), "the base model's loss, as evaluate's"
        assert v["accuracy_before"] == pytest.approx(reference.accuracy)
        assert v["loss"] < v["loss_before"] - 0.5, "it learned the rows it is scored on"
        newest = s.client.fine_tuning.jobs.list_events(job.id, limit=1).data[0]
        assert newest.type == "metrics" and newest.message.startswith(f"Validation on {reference.tokens} tokens: loss=")
        assert newest.data["full_valid_loss"] == v["loss"]  # type: ignore[index]
        assert newest.data["full_valid_mean_token_accuracy"] == v["accuracy"]  # type: ignore[index]
        assert ask(s, MODEL), "serving went on"
    with serve(jobs_engine(),
               jobs=JobsConfig(tmp_path, TEMPLATE)) as s:
        again = s.client.fine_tuning.jobs.retrieve(job.id)
        assert again.coserve["validation"] == v and again.metadata == {"team": "facts"}  # type: ignore[attr-defined]


def test_clients_read_and_delete_their_files_and_delete_fine_tuned_models(tmp_path: Path) -> None:
    data = DATA_BYTES
    config = JobsConfig(tmp_path, TEMPLATE)

    with serve(jobs_engine(), jobs=config) as s:
        f = s.client.files.create(file=("facts.jsonl", data), purpose="fine-tune")
        assert s.client.files.content(f.id).read() == data
        job = s.client.fine_tuning.jobs.create(model=MODEL, training_file=f.id, hyperparameters={"n_epochs": 500})
        wait_for(s, job.id, ("running",))
        with pytest.raises(openai.ConflictError, match=f"in use by fine-tuning job '{job.id}'"):
            s.client.files.delete(f.id)
        name = f"ft:{MODEL}:coserve:{job.id}"
        with pytest.raises(openai.ConflictError, match=f"not served yet: fine-tuning job '{job.id}' is running"):
            s.client.models.delete(name)  # (not served until it ends, and not deleted)
        assert s.client.fine_tuning.jobs.cancel(job.id).status == "cancelled"
        assert name in [m.id for m in s.client.models.list().data]
        assert ask(s, name)
        with pytest.raises(openai.BadRequestError, match="the base model: it cannot be deleted"):
            s.client.models.delete(MODEL)
        assert s.client.models.delete(name).deleted
        assert name not in [m.id for m in s.client.models.list().data]
        with pytest.raises(openai.NotFoundError):
            ask(s, name)
        with pytest.raises(openai.NotFoundError, match="deleted already"):
            s.client.models.delete(name)
        assert (tmp_path / "jobs" / job.id / "adapter" / "adapter_config.json").is_file(), "its files are kept"
        assert s.client.files.delete(f.id).deleted
        assert s.client.files.list().data == []
        with pytest.raises(openai.NotFoundError, match=f"no file '{f.id}'"):
            s.client.files.content(f.id)
        assert ask(s, MODEL)
    with serve(jobs_engine(), jobs=config) as s:
        assert [j.id for j in s.client.fine_tuning.jobs.list().data] == [job.id]
        assert name not in [m.id for m in s.client.models.list().data], "a deleted model stays deleted"
        assert s.client.files.list().data == []


def test_a_job_that_a_crash_stopped_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """Nothing lost on a crash: a restarted server on the same DIR sets the job up again from its
    last checkpoint, with the settings it was created with, and trains it to the end."""
    config = JobsConfig(tmp_path, replace(TEMPLATE, save_every=3))
    data = DATA_BYTES

    run = tmp_path / "jobs"
    with serve(jobs_engine(), jobs=config) as s:
        f = s.client.files.create(file=("facts.jsonl", data), purpose="fine-tune")
        job = s.client.fine_tuning.jobs.create(model=MODEL, training_file=f.id, seed=5,
                                               hyperparameters={"n_epochs": 6, "learning_rate_multiplier": 2})
        deadline = time.monotonic() + 60
        while not (run / job.id / "checkpoint" / "trainer_state.pt").is_file():
            assert time.monotonic() < deadline, "no checkpoint"
            time.sleep(0.1)
    # the crash: the server died before it could say how the job ended, two steps after its checkpoint
    (run / job.id / "outcome.json").unlink()
    log = run / job.id / "train_log.jsonl"
    steps_before = len(log.read_text().splitlines())
    assert steps_before >= 3
    with log.open("a") as f:
        for k in range(2):
            f.write(json.dumps({"step": steps_before + k, "loss": 99.0, "wall_time": 0.0, "tokens": 1}) + "\n")

    with serve(jobs_engine(), jobs=config) as s:
        assert wait_for(s, job.id, ("succeeded", "failed", "cancelled"), timeout=120) == "succeeded"
        done = s.client.fine_tuning.jobs.retrieve(job.id)
        assert done.hyperparameters.n_epochs == 6 and done.hyperparameters.learning_rate_multiplier == 2
        assert done.coserve["samples_trained"] == done.coserve["samples_total"] == 6 * 8  # type: ignore[attr-defined]
        assert done.fine_tuned_model is not None and ask(s, done.fine_tuned_model)
    steps = [json.loads(line)["step"] for line in (run / job.id / "train_log.jsonl").read_text().splitlines()]
    assert steps == list(range(len(steps))) and len(steps) > steps_before, "one log, no step twice or missing"
    assert all(json.loads(line)["loss"] != 99.0 for line in log.read_text().splitlines()), \
        "the steps after the checkpoint were trained again, not kept"
    spec = json.loads((run / job.id / "spec.json").read_text())
    assert spec["coserve"]["epochs"] == 6 and spec["coserve"]["seed"] == 5 and spec["optim"]["lr"] == 2e-3


def test_an_interrupted_job_without_a_checkpoint_is_failed_once_and_for_all(tmp_path: Path) -> None:
    config = JobsConfig(tmp_path, TEMPLATE)  # (save_every 0: no checkpoint)
    job_id = "ftjob-lost00000000000000000000"
    run = tmp_path / "jobs" / job_id
    run.mkdir(parents=True)
    (run / "job.json").write_text(json.dumps({
        "id": job_id, "created_at": 1, "model": MODEL, "training_file": "file-x", "train_log": str(run / "train_log.jsonl"),
        "n_epochs": 1, "learning_rate": 1e-3, "total_steps": 4, "seed": 0, "fine_tuned_model": f"ft:{MODEL}:coserve:{job_id}",
        "live": False}))
    with serve(jobs_engine(),
               jobs=config) as s:
        lost = s.client.fine_tuning.jobs.retrieve(job_id)
        assert lost.status == "failed" and lost.error is not None
        assert "the server stopped while this job ran" in lost.error.message
    assert json.loads((run / "outcome.json").read_text())["ft_outcome"] == "failed"


def steps_reach(s: Served, job_id: str, n: int) -> None:
    deadline = time.monotonic() + 60
    while (s.client.fine_tuning.jobs.retrieve(job_id).coserve["optimizer_steps"] or 0) < n:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_job_is_paused_at_a_checkpoint_resumed_from_it_and_cancelled_while_paused(tmp_path: Path) -> None:
    config = JobsConfig(tmp_path, TEMPLATE)  # (save_every 0: the pause writes its own checkpoint)
    data = DATA_BYTES
    engine = jobs_engine()

    with serve(engine, jobs=config) as s:
        jobs = s.client.fine_tuning.jobs
        f = s.client.files.create(file=("facts.jsonl", data), purpose="fine-tune")
        job = jobs.create(model=MODEL, training_file=f.id, hyperparameters={"n_epochs": 500})
        wait_for(s, job.id, ("running",))
        steps_reach(s, job.id, 2)
        paused = jobs.pause(job.id)
        assert paused.status == "paused" and paused.finished_at is None and paused.fine_tuned_model is None
        assert s.engine_thread.session is None and (tmp_path / "jobs" / job.id / "checkpoint").is_dir()
        first = paused.coserve["optimizer_steps"]  # type: ignore[attr-defined]
        assert jobs.list_events(job.id, limit=1).data[0].message.startswith("The job was paused")
        with pytest.raises(openai.ConflictError, match="not running"):
            jobs.pause(job.id)
        assert ask(s, MODEL), "serving goes on"

        resumed = jobs.resume(job.id)
        assert resumed.status in ("validating_files", "running")
        with pytest.raises(openai.ConflictError, match="not paused"):
            jobs.resume(job.id)
        wait_for(s, job.id, ("running",))
        steps_reach(s, job.id, first + 2)
        assert jobs.pause(job.id).status == "paused"
        cancelled = jobs.cancel(job.id)
        assert cancelled.status == "cancelled" and cancelled.finished_at is not None
        assert cancelled.fine_tuned_model is not None and ask(s, cancelled.fine_tuned_model), "served once cancelled"
    steps = [json.loads(line)["step"] for line in (tmp_path / "jobs" / job.id / "train_log.jsonl").read_text().splitlines()]
    assert steps == list(range(len(steps))) and len(steps) >= first + 2, "one log across the pause"


def test_a_servers_job_trainers_start_from_spare_interpreters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """With spares (COSERVE_TRAINER_SPARE=1 here; on CUDA by default) the server starts one at
    start-up and the first job's trainer is that process; its start keeps the next, and the
    resume's trainer is that one; the job trains on across the pause."""
    from coserve.trainer import spare

    monkeypatch.setenv(spare.SPARE_ENV, "1")
    caplog.set_level(logging.INFO, logger="coserve.server.finetune")
    spare.HELD.discard()
    engine = jobs_engine()
    try:
        with serve(engine, jobs=JobsConfig(tmp_path, TEMPLATE)) as s:
            at_start = spare.HELD._spare
            assert at_start is not None, "no spare at the server's start-up"
            jobs = s.client.fine_tuning.jobs
            f = s.client.files.create(file=("facts.jsonl", DATA_BYTES), purpose="fine-tune")
            job = jobs.create(model=MODEL, training_file=f.id, hyperparameters={"n_epochs": 500})
            wait_for(s, job.id, ("running",))
            session = s.engine_thread.session
            assert session is not None and session.trainer.pid == at_start.proc.pid and session.trainer.from_spare
            kept = spare.HELD._spare
            assert kept is not None and kept is not at_start and kept.proc.is_alive()
            steps_reach(s, job.id, 2)
            first = jobs.pause(job.id).coserve["optimizer_steps"]  # type: ignore[attr-defined]
            jobs.resume(job.id)
            wait_for(s, job.id, ("running",))
            session = s.engine_thread.session
            assert session is not None and session.trainer.pid == kept.proc.pid
            steps_reach(s, job.id, first + 2)
            assert jobs.cancel(job.id).status == "cancelled"
    finally:
        spare.HELD.discard()
    # (the set-up lines say so: bench/jobs_during_replay.py reads them)
    assert caplog.text.count("trainer started in") == 2 and caplog.text.count("(from a spare interpreter)") == 2


def test_a_pause_asked_while_the_job_is_set_up_waits_for_it_then_pauses(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    read = DatasetReader.read

    def slow_read(self: DatasetReader, *args: Any, **kwargs: Any) -> object:  # a set-up that takes a while
        time.sleep(1.5)
        return read(self, *args, **kwargs)

    monkeypatch.setattr(DatasetReader, "read", slow_read)
    with serve(jobs_engine(), jobs=JobsConfig(tmp_path, TEMPLATE)) as s:
        jobs = s.client.fine_tuning.jobs
        f = s.client.files.create(file=("facts.jsonl", DATA_BYTES), purpose="fine-tune")
        job = jobs.create(model=MODEL, training_file=f.id, hyperparameters={"n_epochs": 500})
        assert jobs.retrieve(job.id).status == "validating_files"
        paused = jobs.pause(job.id)  # (the call waits for the set-up: not a 409)
        assert paused.status == "paused" and s.engine_thread.session is None
        assert (tmp_path / "jobs" / job.id / "checkpoint" / "trainer_state.pt").is_file()
        assert ask(s, MODEL), "serving goes on"
        assert jobs.resume(job.id).status in ("validating_files", "running")
        assert wait_for(s, job.id, ("running",)) == "running"
        assert any(e.message.startswith("Set up again from its checkpoint") for e in jobs.list_events(job.id).data)
        assert jobs.cancel(job.id).status == "cancelled"

        # a job whose set-up fails: the pause that waited for it is a 409 that says so
        gone = s.client.files.create(file=("gone.jsonl", DATA_BYTES), purpose="fine-tune")
        failing = jobs.create(model=MODEL, training_file=gone.id)
        (tmp_path / "files" / gone.coserve["stored_as"]).unlink()  # type: ignore[attr-defined]
        with pytest.raises(openai.ConflictError, match=r"not running \(failed\)"):
            jobs.pause(failing.id)
        assert jobs.retrieve(failing.id).status == "failed" and ask(s, MODEL)


def test_an_upload_larger_than_the_limit_is_a_413_and_leaves_nothing(tmp_path: Path) -> None:
    data = DATA_BYTES
    config = JobsConfig(tmp_path, TEMPLATE, max_upload_bytes=len(data))
    with serve(jobs_engine(),
               jobs=config) as s:
        with pytest.raises(openai.APIStatusError, match="larger than this server takes") as raised:
            s.client.files.create(file=("big.jsonl", data + b"\n"), purpose="fine-tune")
        assert raised.value.status_code == 413
        assert s.client.files.list().data == [] and list((tmp_path / "files").iterdir()) == []
        f = s.client.files.create(file=("facts.jsonl", data), purpose="fine-tune")
        assert f.bytes == len(data) and s.client.files.content(f.id).read() == data


@pytest.fixture(scope="module")
def jobs_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A server that takes uploads and jobs, for checks that train nothing."""
    with serve(jobs_engine(), jobs=JobsConfig(tmp_path_factory.mktemp("jobs"), TEMPLATE)) as s:
        yield s


def test_rows_that_json_cannot_read_are_skipped_and_counted(jobs_served: Served) -> None:
    """A line nested past the parser's recursion limit and a row with an integer past CPython's
    digit limit are malformed rows like any other, not a 500 or a refused file."""
    data = "\n".join([*ROWS, "[" * 200_000, '{"input_ids": [' + "1" * 5000 + "]}"]) + "\n"
    f = jobs_served.client.files.create(file=("deep.jsonl", data.encode()), purpose="fine-tune")
    extra = f.coserve  # type: ignore[attr-defined]
    assert (extra["rows"], extra["samples"], extra["malformed_rows"]) == (10, 8, 2)
    assert extra["first_malformed"] == {"line": 9, "reason": "invalid JSON: nested too deeply to parse"}


@pytest.mark.parametrize(("change", "status", "needle"), [
    ({"method": {"type": "supervised", "supervised": "x"}}, 400, "method.supervised must be an object, got a string"),
    ({"method": {"type": "supervised", "supervised": {"hyperparameters": "x"}}}, 400,
     "method.supervised.hyperparameters must be an object, got a string"),
    ({"method": {"supervised": {"hyperparameters": {"n_epochs": "many"}}}}, 400,
     "method.supervised.hyperparameters.n_epochs"),
    ({"method": {"supervised": {"hyperparameters": {"epochs": 2}}}}, 400,
     "method.supervised.hyperparameters.epochs: Extra inputs are not permitted"),
    ({"seed": 99999999999999999999999}, 400, "seed: must be a 64-bit signed integer"),
    ({"seed": -(2**63) - 1}, 400, "seed: must be a 64-bit signed integer"),
    ({"validation_file": ""}, 404, "no file ''"),
])
def test_a_job_request_that_would_fail_later_is_refused_at_once(jobs_served: Served, change: dict[str, Any],
                                                                status: int, needle: str) -> None:
    """Each a 4xx with a one-line message when the job is created, not a 500 nor a job that fails
    after its 200."""
    f = jobs_served.client.files.create(file=("facts.jsonl", DATA_BYTES), purpose="fine-tune")
    got, body = http(jobs_served.url + "/v1/fine_tuning/jobs", {"model": MODEL, "training_file": f.id, **change})
    message = body["error"]["message"]
    assert got == status and needle in message and "\n" not in message and "pydantic" not in message, body
    assert jobs_served.client.fine_tuning.jobs.list().data == []


def test_a_paused_jobs_files_are_kept_and_a_resume_that_fails_ends_its_validation(tmp_path: Path) -> None:
    config = JobsConfig(tmp_path, TEMPLATE)
    data = DATA_BYTES
    with serve(jobs_engine(),
               jobs=config) as s:
        jobs = s.client.fine_tuning.jobs
        f = s.client.files.create(file=("facts.jsonl", data), purpose="fine-tune")
        job = jobs.create(model=MODEL, training_file=f.id, validation_file=f.id, hyperparameters={"n_epochs": 500})
        wait_for(s, job.id, ("running",))
        assert jobs.pause(job.id).status == "paused"
        with pytest.raises(openai.ConflictError, match=f"in use by fine-tuning job '{job.id}'"):
            s.client.files.delete(f.id)  # (a resume reads it again)
        (tmp_path / "files" / f.coserve["stored_as"]).unlink()  # type: ignore[attr-defined]
        jobs.resume(job.id)
        assert wait_for(s, job.id, ("succeeded", "failed", "cancelled")) == "failed"
        deadline = time.monotonic() + 30
        while (v := jobs.retrieve(job.id).coserve["validation"])["status"] == "running":  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, v
            time.sleep(0.05)
        assert v["status"] == "failed" and "exported no adapter" in v["error"]
        assert ask(s, MODEL)


def test_jobs_created_while_one_runs_are_queued_and_start_in_turn(tmp_path: Path) -> None:
    """One job runs at a time: the others wait, oldest first, as OpenAI's ``queued``; a queued job
    can be cancelled (never run) and its files are kept; a paused job resumed while another runs
    waits its turn too."""
    data = DATA_BYTES
    with serve(jobs_engine(),
               jobs=JobsConfig(tmp_path, TEMPLATE)) as s:
        jobs = s.client.fine_tuning.jobs
        f = s.client.files.create(file=("facts.jsonl", data), purpose="fine-tune")
        v = s.client.files.create(file=("valid.jsonl", data), purpose="fine-tune")
        first = jobs.create(model=MODEL, training_file=f.id, hyperparameters={"n_epochs": 500})
        second = jobs.create(model=MODEL, training_file=f.id, validation_file=v.id, hyperparameters={"n_epochs": 1})
        third = jobs.create(model=MODEL, training_file=f.id, hyperparameters={"n_epochs": 1})
        assert first.status in ("validating_files", "running")
        assert (second.status, third.status) == ("queued", "queued")
        assert (tmp_path / "jobs" / second.id / "queued.json").is_file()
        _, metrics = http(s.url + "/metrics")
        assert 'coserve_finetune_jobs{status="queued"} 2.0' in metrics
        assert [e.message for e in jobs.list_events(second.id).data] == [
            f"Fine-tuning {MODEL} on {f.id} is queued: it starts once the jobs before it have ended"]
        with pytest.raises(openai.ConflictError, match="queued: it has not started"):
            jobs.pause(second.id)
        with pytest.raises(openai.ConflictError, match=f"in use by fine-tuning job '{second.id}'"):
            s.client.files.delete(v.id)  # (the queued job reads it when it starts)

        cancelled = jobs.cancel(third.id)  # off the queue: never run, nothing served
        assert cancelled.status == "cancelled" and cancelled.fine_tuned_model is None
        assert not (tmp_path / "jobs" / third.id / "queued.json").exists()
        wait_for(s, first.id, ("running",))
        assert jobs.retrieve(second.id).status == "queued", "it waits while the first runs"
        assert jobs.pause(first.id).status == "paused"  # a pause frees the server: the next one starts
        wait_for(s, second.id, ("validating_files", "running", "succeeded"))
        resumed = jobs.resume(first.id)  # ... and the paused one waits for it
        assert resumed.status == "queued"
        with pytest.raises(openai.ConflictError, match="not paused \\(queued to resume\\)"):
            jobs.resume(first.id)
        assert wait_for(s, second.id, ("succeeded", "failed", "cancelled")) == "succeeded"
        assert wait_for(s, first.id, ("running", "succeeded", "failed", "cancelled")) == "running"
        deadline = time.monotonic() + 30
        while (scores := jobs.retrieve(second.id).coserve["validation"])["status"] == "running":  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, scores
            time.sleep(0.05)
        assert scores["status"] == "succeeded"
        assert jobs.cancel(first.id).status == "cancelled"
        assert jobs.retrieve(third.id).trained_tokens in (None, 0)
        assert [j.status for j in jobs.list().data] == ["cancelled", "succeeded", "cancelled"]
        assert ask(s, MODEL)
        assert not (tmp_path / "jobs" / third.id / "train_log.jsonl").exists(), "the cancelled queued job never ran"


def test_a_stopped_server_resumes_its_running_job_then_starts_the_queued_ones(tmp_path: Path) -> None:
    """A server's stop (Ctrl-C, SIGTERM) pauses the job it runs at a checkpoint, not cancels it:
    the next start resumes it from there, ahead of the jobs still queued, which start in turn."""
    config = JobsConfig(tmp_path, TEMPLATE)  # (save_every 0: the stop writes the checkpoint)
    data = DATA_BYTES

    with serve(jobs_engine(), jobs=config) as s:
        f = s.client.files.create(file=("facts.jsonl", data), purpose="fine-tune")
        first = s.client.fine_tuning.jobs.create(model=MODEL, training_file=f.id, hyperparameters={"n_epochs": 500})
        queued = s.client.fine_tuning.jobs.create(model=MODEL, training_file=f.id, hyperparameters={"n_epochs": 1})
        wait_for(s, first.id, ("running",))
        steps_reach(s, first.id, 2)
        assert s.client.fine_tuning.jobs.retrieve(queued.id).status == "queued"
    # the server stopped: its running job paused at a checkpoint, queued to resume first; the
    # queued one did not start then
    run = tmp_path / "jobs" / first.id
    outcome = json.loads((run / "outcome.json").read_text())
    assert outcome["ft_outcome"] == "paused" and (run / "checkpoint" / "trainer_state.pt").is_file()
    assert json.loads((run / "queued.json").read_text()) == {"queued_at": 0.0, "resume": True}
    stopped_at = outcome["ft_optimizer_steps"]
    assert stopped_at >= 2
    assert not (tmp_path / "jobs" / queued.id / "train_log.jsonl").exists()
    assert (tmp_path / "jobs" / queued.id / "queued.json").is_file()
    with serve(jobs_engine(), jobs=config) as s:
        jobs = s.client.fine_tuning.jobs
        wait_for(s, first.id, ("running",))
        assert jobs.retrieve(queued.id).status == "queued", "behind the resumed job"
        steps_reach(s, first.id, stopped_at + 1)
        assert jobs.cancel(first.id).status == "cancelled"
        # ... then the queued one, which trains to its end
        assert wait_for(s, queued.id, ("succeeded", "failed", "cancelled")) == "succeeded"
        done = jobs.retrieve(queued.id)
        assert done.fine_tuned_model is not None and ask(s, done.fine_tuned_model)
    steps = [json.loads(line)["step"] for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert steps == list(range(len(steps))) and len(steps) > stopped_at, "one log across the stop"
    assert not (tmp_path / "jobs" / queued.id / "queued.json").exists()
    assert not (run / "queued.json").exists()


def test_an_engine_failure_pauses_the_running_job_to_resume_at_the_next_start(tmp_path: Path) -> None:
    """The engine's loop failing (a bug) ends serving; the job it ran is paused at a checkpoint,
    not cancelled, is not set up again on the dead engine, and resumes at the next start."""
    config = JobsConfig(tmp_path, TEMPLATE)
    with serve(jobs_engine(), jobs=config) as s:
        f = s.client.files.create(file=("facts.jsonl", DATA_BYTES), purpose="fine-tune")
        job = s.client.fine_tuning.jobs.create(model=MODEL, training_file=f.id, hyperparameters={"n_epochs": 500})
        wait_for(s, job.id, ("running",))
        steps_reach(s, job.id, 2)

        def fail() -> None:
            raise RuntimeError("a bug in the engine")

        s.engine_thread.engine.step = fail  # type: ignore[method-assign]
        deadline = time.monotonic() + 30
        while s.engine_thread.session is not None or not (tmp_path / "jobs" / job.id / "outcome.json").is_file():
            assert time.monotonic() < deadline, "the engine's failure did not end the session"
            time.sleep(0.05)
        assert http(s.url + "/health")[0] == 503
        time.sleep(0.5)  # (long enough for the board to have set the job up again, were it to)
        assert s.client.fine_tuning.jobs.retrieve(job.id).status == "queued", "to resume, not set up again"
    run = tmp_path / "jobs" / job.id
    assert json.loads((run / "outcome.json").read_text())["ft_outcome"] == "paused"
    assert json.loads((run / "queued.json").read_text())["resume"] is True
    with serve(jobs_engine(), jobs=config) as s:
        wait_for(s, job.id, ("running",))
        assert s.client.fine_tuning.jobs.cancel(job.id).status == "cancelled"


def test_a_jobs_epoch_checkpoints_are_listed_and_served_once_it_has_ended(tmp_path: Path) -> None:
    config = JobsConfig(tmp_path, replace(TEMPLATE, epoch_checkpoints=2))
    data = DATA_BYTES

    with serve(jobs_engine(), jobs=config) as s:
        jobs = s.client.fine_tuning.jobs
        f = s.client.files.create(file=("facts.jsonl", data), purpose="fine-tune")
        job = jobs.create(model=MODEL, training_file=f.id, validation_file=f.id, suffix="ck",
                          hyperparameters={"n_epochs": 3})
        assert wait_for(s, job.id, ("succeeded", "failed", "cancelled")) == "succeeded"
        deadline = time.monotonic() + 60  # (the checkpoints are scored after the adapter)
        while (job := jobs.retrieve(job.id)).coserve["validation"]["status"] == "running":  # type: ignore[attr-defined]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        listed = jobs.checkpoints.list(job.id).data
        assert len(listed) == 2 and listed[0].step_number > listed[1].step_number
        # each checkpoint scored on the validation file: the last epoch's is the adapter's own
        assert listed[0].metrics.full_valid_loss == job.coserve["validation"]["loss"]  # type: ignore[attr-defined]
        assert listed[1].metrics.full_valid_loss is not None
        assert listed[1].metrics.full_valid_loss != listed[0].metrics.full_valid_loss
        assert listed[1].metrics.full_valid_mean_token_accuracy is not None
        names = [c.fine_tuned_model_checkpoint for c in listed]
        assert names == [f"{job.fine_tuned_model}:ckpt-step-{c.step_number}" for c in listed]
        assert all(c.fine_tuning_job_id == job.id and c.metrics.train_loss is not None for c in listed)
        assert [c.id for c in jobs.checkpoints.list(job.id, after=listed[0].id).data] == [listed[1].id]
        deadline = time.monotonic() + 30  # (served once their files are written, read off the engine's thread)
        while not set(names) <= {m.id for m in s.client.models.list().data}:
            assert time.monotonic() < deadline, "checkpoints not served"
            time.sleep(0.05)
        assert ask(s, names[0]) == ask(s, job.fine_tuned_model or ""), "the last epoch's end is the final adapter"
        assert ask(s, names[1])
        # a job on a fine-tuned model (OpenAI's continued fine-tuning) starts from its adapter: here
        # an epoch checkpoint's: its first loss is under the base's and under that step's own (taken before its update)
        more = jobs.create(model=names[1], training_file=f.id, hyperparameters={"n_epochs": 1})
        assert more.model == names[1] and more.fine_tuned_model is None
        assert wait_for(s, more.id, ("succeeded", "failed", "cancelled")) == "succeeded"
        first = jobs.retrieve(job.id).coserve["first_loss"]  # type: ignore[attr-defined]
        assert jobs.retrieve(more.id).coserve["first_loss"] < min(first - 1.0, listed[1].metrics.train_loss or 0)  # type: ignore[attr-defined]
        assert json.loads((tmp_path / "jobs" / more.id / "spec.json").read_text())["init_adapter"] == listed[1].coserve[
            "path"]  # type: ignore[attr-defined]
        with pytest.raises(openai.BadRequestError, match="or a fine-tuned model of one of its jobs"):
            jobs.create(model=f"{job.fine_tuned_model}:ckpt-step-999", training_file=f.id)
        assert s.client.models.delete(names[1]).deleted
        assert names[1] not in {m.id for m in s.client.models.list().data}
    with serve(jobs_engine(), jobs=config) as s:  # a restart serves the checkpoints again, not the deleted one
        served = {m.id for m in s.client.models.list().data}
        assert names[0] in served and names[1] not in served and job.fine_tuned_model in served
        assert ask(s, names[0])


def test_a_job_created_while_the_start_up_run_trains_waits_for_it(tmp_path: Path) -> None:
    """``--finetune-data`` beside ``--finetune-jobs``: a client's job is queued behind the run the
    server started with, and starts once that one ends (here: cancelled); both adapters served."""
    from tests.server.test_finetune_jobs import tiny_session

    engine, session = tiny_session(tmp_path, epochs=500)
    engine.lora_manager.bind_training_slot("live")
    with serve(engine, session, adapters={"live": "(training)"}, finetune_name="live",
               jobs=JobsConfig(tmp_path / "jobs", TEMPLATE)) as s:
        jobs = s.client.fine_tuning.jobs
        (startup,) = jobs.list().data
        f = s.client.files.create(file=("facts.jsonl", DATA_BYTES), purpose="fine-tune")
        job = jobs.create(model=MODEL, training_file=f.id, hyperparameters={"n_epochs": 1})
        assert job.status == "queued" and jobs.retrieve(startup.id).status == "running"
        assert jobs.cancel(startup.id).status == "cancelled"
        assert wait_for(s, job.id, ("succeeded", "failed", "cancelled")) == "succeeded"
        job = jobs.retrieve(job.id)
        assert job.fine_tuned_model is not None and ask(s, job.fine_tuned_model) and ask(s, "live")


def held_latency_write(monkeypatch: pytest.MonkeyPatch, fail: bool) -> tuple[Any, Any, Any]:
    """The job board's writes of ``latency_state.json``, once the first event is set, held until
    the third is (the second says one began), then done, or failed as on a full disk."""
    import threading

    import coserve.server.job_board as job_board

    armed, writing, release = threading.Event(), threading.Event(), threading.Event()
    write = job_board.write_json

    def held(path: Path, value: object) -> None:
        if armed.is_set() and path.name == "latency_state.json":
            writing.set()
            release.wait(30)
            if fail:
                raise OSError(28, "No space left on device")
        write(path, value)

    monkeypatch.setattr(job_board, "write_json", held)
    return armed, writing, release


def one_job_run(s: Served) -> tuple[Any, Any]:
    """The built-in facts uploaded and one job of one epoch trained on them to its end: (the jobs
    API, the file)."""
    jobs = s.client.fine_tuning.jobs
    f = s.client.files.create(file=("facts.jsonl", DATA_BYTES), purpose="fine-tune")
    first = jobs.create(model=MODEL, training_file=f.id, hyperparameters={"n_epochs": 1})
    assert wait_for(s, first.id, ("succeeded", "failed", "cancelled")) == "succeeded"
    return jobs, f


def test_a_jobs_latency_model_is_saved_off_the_engine_thread_and_the_next_job_waits_for_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job's end saves the refitted latency model for the next job (its JSON tens of ms with
    full windows): by the board's writer thread, so the job ends and the engine serves while the
    write is held; the next job's set-up waits for it, and starts from it."""
    armed, writing, release = held_latency_write(monkeypatch, fail=False)
    with serve(jobs_engine(), jobs=JobsConfig(tmp_path, TEMPLATE)) as s:
        armed.set()
        jobs, f = one_job_run(s)
        assert writing.wait(30) and not (tmp_path / "latency_state.json").exists()
        assert ask(s, MODEL), "served while the write is held"
        second = jobs.create(model=MODEL, training_file=f.id, hyperparameters={"n_epochs": 1})
        time.sleep(0.5)
        assert jobs.retrieve(second.id).status == "validating_files", "its set-up waits for the write"
        release.set()
        assert wait_for(s, second.id, ("succeeded", "failed", "cancelled")) == "succeeded"
        state = json.loads((tmp_path / "latency_state.json").read_text())
        LatencyModel().load_state_dict(state)


def test_a_latency_model_that_could_not_be_saved_leaves_the_next_job_on_the_defaults(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The save of a job's latency model fails (a full disk) while the next job is created: logged;
    the next job starts anyway, from the defaults, rather than failing on the file not there."""
    armed, writing, release = held_latency_write(monkeypatch, fail=True)
    with serve(jobs_engine(), jobs=JobsConfig(tmp_path, TEMPLATE)) as s:
        armed.set()
        jobs, f = one_job_run(s)
        assert writing.wait(30)
        second = jobs.create(model=MODEL, training_file=f.id, hyperparameters={"n_epochs": 1})  # (the write pending)
        release.set()
        assert wait_for(s, second.id, ("succeeded", "failed", "cancelled")) == "succeeded"
        assert not (tmp_path / "latency_state.json").exists()

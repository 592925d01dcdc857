"""The server's fine-tuning jobs: the one it was started with (``--finetune-data``) and those
clients create through ``POST /v1/fine_tuning/jobs`` (``--finetune-jobs DIR``). One runs at a
time; a job created (or resumed) while another runs is ``queued`` and starts, oldest first, once
the ones before it have ended or paused (a queue a restart keeps: ``DIR/jobs/<id>/queued.json``).

A created job is set up off the event loop and off the engine's loop (dataset, activation
store, trainer process: seconds, in a worker thread), then attached between two steps
(:meth:`EngineThread.start_session`). It does not calibrate the latency model: it starts from
``--latency-state``, else from ``DIR/latency_state.json`` (calibrated at the server's start,
:func:`prepare_latency`, and saved again by each job's end), else (``--no-calibrate``) from the
default coefficients, which learn online. When a job ends its adapter is exported to
``DIR/jobs/<id>/adapter`` and (succeeded or cancelled) served as its ``fine_tuned_model``.

A job that was running when the server stopped (a crash: no ``outcome.json``) resumes from its
last checkpoint (``--save-every`` steps) once a server on the same ``DIR`` starts again, with the
settings it was created with (``DIR/jobs/<id>/spec.json``); without a checkpoint it is failed.

A job's ``validation_file`` is scored twice through the serving engine, as requests beside the
clients' (a few at a time): with the base model while the job trains, and with the exported adapter once it
has ended (OpenAI's ``full_valid_loss`` and ``full_valid_mean_token_accuracy``), kept in
``DIR/jobs/<id>/validation.json``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from fastapi import HTTPException

from coserve.core.finetune import FTSample
from coserve.core.latency import LatencyModel
from coserve.engine.llm_engine import LLMEngine
from coserve.engine.sequence import LoRARequest
from coserve.models.peft_adapter import LoraAdapter, load_peft_adapter
from coserve.server.dataset_reader import DatasetReader
from coserve.server.engine_thread import EngineStats, EngineThread
from coserve.server.files import DEFAULT_MAX_UPLOAD, FileStore
from coserve.server.finetune import (
    EvalResult,
    FinetuneSession,
    FinetuneSpec,
    epoch_checkpoints,
    evaluate_served,
    latency_state,
    load_latency_state,
    read_dataset,
    write_json,
)
from coserve.server.finetune_jobs import SERVED_OUTCOMES, SETUP, FinetuneJob
from coserve.server.protocol import CreateJobRequest

logger = logging.getLogger(__name__)

NO_JOBS = ("this server runs only the fine-tuning job it was started with (if any); jobs cannot be created "
           "through the API unless the server is started with --finetune-jobs DIR")


@dataclass(frozen=True)
class JobsConfig:
    """``--finetune-jobs DIR``: uploads in ``root/files``, each job's run in ``root/jobs/<id>``;
    ``template``: the server's fine-tuning flags, which every job starts from."""

    root: Path
    template: FinetuneSpec
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD

    @property
    def latency_path(self) -> Path:
        return self.root / "latency_state.json"


def prepare_graphs(config: JobsConfig, engine: LLMEngine) -> tuple[tuple[int, str], ...]:
    """Declare, before the engine serves, the linears that every job's adapter trains (the
    template's: its ``--init-adapter``'s, else ``--target-modules`` on every layer) on the training
    slot, so that the piecewise prefill graphs its steps run through are captured now: a job's
    attach, on the engine's thread while it serves, then finds them (session 32, the H100: that
    capture took 0.58 s at a job's set-up, whose requests saw a TTFT p99 of 499 ms against 55 ms
    with no job). A job whose adapter has other linears captures its own at attach. Returns the
    declared ``(layer, target)`` pairs."""
    template = config.template
    if template.init_adapter is not None:
        targets = tuple(load_peft_adapter(template.init_adapter).weights)
    else:
        targets = tuple((layer, target) for layer in range(engine.model_config.num_layers)
                        for target in template.lora.target_modules)
    engine.declare_training_adapter(engine.lora_manager.training_slot(0), targets)
    return targets


def prepare_latency(config: JobsConfig, engine: LLMEngine, startup: FinetuneSession | None, calibrate: bool) -> str:
    """Give the jobs of ``config`` a calibrated latency model at start-up, before the engine
    serves (the sweep runs on the engine: seconds, which a job created while serving must not
    cost): none where ``--latency-state`` names one (``ValueError`` where it was measured on
    another setup: :func:`~coserve.server.finetune.load_latency_state`) or ``DIR/latency_state.json``
    exists for this setup (one for another, a model or GPU since the last start, is moved aside to
    ``latency_state.replaced-TIME.json``); the start-up job's calibration where it ran one; else,
    with ``calibrate``, the sweep, saved to ``DIR/latency_state.json``. Returns what was done, for
    the start-up message."""
    target = config.latency_path
    if config.template.latency_state is not None:
        try:  # (a state for another setup stops the start, not a job)
            load_latency_state(config.template.latency_state, engine, LatencyModel())
        except ValueError as e:
            raise ValueError(f"--latency-state: {e}") from e
        return f"jobs start from --latency-state {config.template.latency_state}"
    note = ""
    if target.is_file():
        try:
            load_latency_state(target, engine, LatencyModel())
            return f"jobs start from {target}"
        except ValueError as e:
            # (another model or GPU since the last start: kept aside, not overwritten)
            aside = target.with_name(f"latency_state.replaced-{time.strftime('%Y%m%d-%H%M%S')}.json")
            target.replace(aside)
            note = f" ({e}: moved to {aside.name})"
    if startup is not None and (startup.spec.calibrate or startup.spec.latency_state is not None):
        write_json(target, latency_state(engine, startup.coserver.latency))
        return f"jobs start from the start-up run's latency model, saved to {target}{note}"
    if not calibrate:
        return f"jobs start from the default latency coefficients (--no-calibrate), which learn online{note}"
    t = time.perf_counter()
    model = LatencyModel()
    lora, co = config.template.lora, config.template.coserve
    n = engine.calibrate(model=model, ft_eager=lora.dropout > 0 or co.save_mlp_activations)
    write_json(target, latency_state(engine, model))
    return (f"latency model calibrated for the jobs on {n} batches in {time.perf_counter() - t:.1f}s, saved to "
            f"{target}{note}")


SPEC = "spec.json"  # (in a job's directory: the settings it was created with, to resume it)
QUEUED = "queued.json"  # (in a job's directory: it waits for the jobs before it; {"queued_at", "resume"})
DELETED = "model_deleted.json"  # (in a job's directory: its fine-tuned model was deleted; in an epoch
# checkpoint's: its model was)

OUTCOME_FIELDS = ("ft_outcome", "ft_finished_at", "ft_failure", "ft_tokens_trained", "ft_optimizer_steps", "ft_loss",
                  "ft_first_loss", "ft_samples_retired", "ft_samples_total")
"""The :class:`EngineStats` fields an ended job keeps across a restart (``outcome.json``), with its
adapter's path."""


def _read_outcome(path: Path, job_id: str) -> EngineStats:
    """How job ``job_id`` ended (``outcome.json``); none there: it was running when the server
    stopped (failed, its last checkpoint on disk)."""
    try:
        fields = json.loads(path.read_text())
        adapter = fields.pop("adapter_path", None)
        known = {k: fields[k] for k in OUTCOME_FIELDS if k in fields}
        return EngineStats(coserving=True, ft_job=job_id, adapter_path=Path(adapter) if adapter else None, **known)
    except (OSError, ValueError, TypeError):
        return EngineStats(coserving=True, ft_job=job_id, ft_outcome="failed",
                           ft_failure=f"the server stopped while this job ran (its last checkpoint, if any, is in "
                                      f"{path.parent / 'checkpoint'})")


def _read_validation(path: Path) -> dict[str, object]:
    """A job's validation scores (``validation.json``); still running there: the server stopped."""
    try:
        v = dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        v = {"status": "running"}
    if v.get("status") == "running":
        v.update(status="failed", error="the server stopped before the validation was done")
    return v


def _read_queued(path: Path) -> tuple[float, bool] | None:
    """When a job was queued and whether to resume it (``queued.json``; None: not queued)."""
    try:
        fields = json.loads(path.read_text())
        return float(fields["queued_at"]), bool(fields["resume"])
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _number(x: float) -> float | None:
    """``x`` for JSON (NaN, a set with no target token, as null)."""
    return x if math.isfinite(x) else None


def _settle(future: asyncio.Future[EngineStats], final: EngineStats) -> None:
    if not future.done():
        future.set_result(final)


class JobBoard:
    """Every job of this server's life, newest first, and the one that runs (at most one).

    Lives on the event loop, except :meth:`session_ended`, the engine thread's hook (loop thread).
    """

    def __init__(self, engine_thread: EngineThread, model: str, files: FileStore | None,
                 config: JobsConfig | None, serve_adapter: Callable[[str, str, LoraAdapter | None], None],
                 startup_name: str | None = None, reader: DatasetReader | None = None) -> None:
        self.et = engine_thread
        self.reader = reader  # (reads the jobs' datasets in a child process; None: in a worker thread)
        self.model = model
        self.files = files
        self.config = config
        # (loop thread) serve the adapter at a path (or this copy of it) under a model name
        self.serve_adapter = serve_adapter
        self.jobs: dict[str, FinetuneJob] = {}  # oldest first
        self.setting_up: dict[str, asyncio.Task[None]] = {}
        self.cancel_asked: set[str] = set()
        # each job's validation file's scores so far (JobsConfig jobs with a validation_file)
        self.validation: dict[str, dict[str, object]] = {}
        self._ended: dict[str, asyncio.Future[EngineStats]] = {}  # (set when a validated job has ended)
        self._background: set[asyncio.Task[None]] = set()  # (validations, checkpoint serving: held until done)
        self.deleted: set[str] = set()  # the jobs whose fine-tuned model a client deleted (not served)
        # jobs an earlier server was running when it stopped, with a checkpoint: resumed at start-up
        self.interrupted: list[FinetuneJob] = []
        # how a job ended that never ran (its set-up failed), or one of an earlier server's life
        self.past: dict[str, EngineStats] = {}
        # the jobs waiting for the one that runs, oldest first: job id -> resumed (a paused job)
        self.queue: dict[str, bool] = {}
        self.closing = False  # (the server is stopping: no queued job starts)
        # DIR/latency_state.json's last write, by a thread of its own (_served: its JSON takes tens
        # of ms for full windows, which the engine's thread need not spend)
        self._state_writer: ThreadPoolExecutor | None = None
        self._state_write: Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        if config is not None:
            self._restore(config.root / "jobs")
        startup = FinetuneJob.of(engine_thread, model, startup_name)
        if startup is not None:
            self.jobs[startup.id] = startup
        engine_thread.on_session_end = self.session_ended
        engine_thread.pause_at_stop = self._resumable

    def _restore(self, jobs_dir: Path) -> None:
        """The jobs an earlier server of this DIR ran (``ID/job.json``, ``ID/outcome.json``), oldest
        first, each adapter that was served served again under its name; a job without an outcome
        was running when that server stopped: failed, its last checkpoint on disk. (Called before
        uvicorn serves: no request reads the adapters meanwhile.)"""
        found = []
        for path in jobs_dir.glob("*/job.json"):
            try:
                fields = json.loads(path.read_text())
                found.append(FinetuneJob(**{**fields, "train_log": Path(fields["train_log"])}))
            except (OSError, ValueError, TypeError, KeyError) as e:
                logger.warning("%s: not a fine-tuning job, skipped: %s", path, e)
        queued: list[tuple[float, str, bool]] = []
        for job in sorted(found, key=lambda j: j.created_at):
            run = job.train_log.parent
            waiting = _read_queued(run / QUEUED)
            if waiting is not None and (run / SPEC).is_file() and (waiting[1] or not (run / "outcome.json").is_file()):
                self.jobs[job.id] = job
                queued.append((waiting[0], job.id, waiting[1]))
                if waiting[1]:  # (a paused job queued to resume: paused until it starts)
                    self.past[job.id] = _read_outcome(run / "outcome.json", job.id)
                if job.validation_file is not None and (run / "validation.json").is_file():
                    self.validation[job.id] = _read_validation(run / "validation.json")
                continue
            if not (run / "outcome.json").is_file() and (run / "checkpoint" / "trainer_state.pt").is_file() \
                    and (run / SPEC).is_file():
                self.jobs[job.id] = job
                self.interrupted.append(job)
                continue
            stats = _read_outcome(run / "outcome.json", job.id)
            self.jobs[job.id], self.past[job.id] = job, stats
            if stats.ft_outcome == "failed" and not (run / "outcome.json").is_file():
                self._save_outcome(job.id, stats)  # (so that a later start does not look at it again)
            if job.validation_file is not None:
                self.validation[job.id] = _read_validation(job.train_log.parent / "validation.json")
            if (job.train_log.parent / DELETED).is_file():
                self.deleted.add(job.id)
            elif stats.ft_outcome in SERVED_OUTCOMES and stats.adapter_path is not None and job.fine_tuned_model:
                try:
                    self.serve_adapter(job.fine_tuned_model, str(stats.adapter_path), None)
                except Exception as e:  # (its adapter deleted meanwhile, say: the server starts anyway)
                    logger.warning("job %s: its adapter %s cannot be served: %s", job.id, stats.adapter_path, e)
                    self.past[job.id] = replace(stats, ft_outcome="failed",
                                                ft_failure=f"its adapter cannot be served any more: {e}")
            if stats.ft_outcome in SERVED_OUTCOMES:
                for name, where in self.checkpoint_models(job):
                    try:
                        self.serve_adapter(name, where, None)
                    except Exception as e:
                        logger.warning("job %s: its checkpoint %s cannot be served: %s", job.id, where, e)
        self.queue = {job_id: resume for _, job_id, resume in sorted(queued)}
        if found:
            logger.info("%d fine-tuning jobs of an earlier run of %s restored (%d queued)", len(found), jobs_dir,
                        len(self.queue))

    # ------------------------------------------------------------------ reading

    def newest_first(self) -> list[FinetuneJob]:
        return list(self.jobs.values())[::-1]

    def find(self, job_id: str) -> FinetuneJob:
        job = self.jobs.get(job_id)
        if job is None:
            known = ", ".join(repr(j) for j in list(self.jobs)[::-1][:5])
            raise HTTPException(404, f"no fine-tuning job {job_id!r} on this server"
                                     + (f"; its jobs: {known}" if known else ""))
        return job

    def checkpoints(self, job: FinetuneJob) -> list[dict[str, object]]:
        """``job``'s epoch checkpoints on disk, newest first (:func:`epoch_checkpoints`), each with
        the model name it is served under once the job has ended (None: the job has no name)."""
        return [{**ck, "model": f"{job.fine_tuned_model}:ckpt-step-{ck['step_number']}" if job.fine_tuned_model
                 else None} for ck in epoch_checkpoints(job.train_log.parent)]

    def checkpoint_models(self, job: FinetuneJob) -> list[tuple[str, str]]:
        """(model name, path) of ``job``'s epoch checkpoints to serve: those with a name and not
        deleted."""
        return [(str(ck["model"]), str(ck["path"])) for ck in self.checkpoints(job)
                if ck["model"] is not None and not (Path(str(ck["path"])) / DELETED).is_file()]

    def checkpoint_of_model(self, name: str) -> str | None:
        """The directory of the epoch checkpoint served as ``name``, if it is one."""
        base, sep, _ = name.rpartition(":ckpt-step-")
        job = self.job_of_model(base) if sep else None
        if job is None:
            return None
        return next((path for model, path in self.checkpoint_models(job) if model == name), None)

    def checkpoint_deleted(self, path: str) -> None:
        """The epoch checkpoint at ``path`` is no longer served, nor after a restart."""
        write_json(Path(path) / DELETED, {"deleted_at": time.time()})

    async def serve_checkpoints(self, job: FinetuneJob) -> None:
        """(the event loop) Serve ``job``'s epoch checkpoints once their files are written: each
        read off the engine's thread, then registered between two steps."""
        try:
            await asyncio.to_thread(self.et.wait_exported)
            for name, path in self.checkpoint_models(job):
                adapter = await asyncio.to_thread(self.et.engine.lora_manager.load, path)

                def register(_: LLMEngine, name: str = name, path: str = path, adapter: LoraAdapter = adapter) -> None:
                    self.serve_adapter(name, path, adapter)

                await self.et.call(register)
                logger.info("fine-tuning job %s: serving its checkpoint %r from %s", job.id, name, path)
        except Exception:
            logger.exception("serving the epoch checkpoints of job %s failed", job.id)

    def _serve_checkpoints_later(self, job: FinetuneJob) -> None:
        """(any thread) :meth:`serve_checkpoints` on the event loop."""
        def start() -> None:
            task = asyncio.get_running_loop().create_task(self.serve_checkpoints(job))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(start)
            except RuntimeError:  # (the event loop has closed: served at the next start)
                pass

    def job_of_model(self, name: str) -> FinetuneJob | None:
        """The job whose fine-tuned model ``name`` is (served or not), if any."""
        return next((j for j in self.jobs.values() if j.fine_tuned_model == name), None)

    def file_user(self, file_id: str) -> str | None:
        """The job being set up, trained, queued or paused (it reads the file again to resume) on
        file ``file_id`` (its training or validation file)."""
        running = self.running()
        for job in self.jobs.values():
            if file_id in (job.training_file, job.validation_file) and (
                    job is running or job.id in self.queue or self.stats(job).ft_outcome == "paused"):
                return job.id
        return None

    def model_deleted(self, job: FinetuneJob) -> None:
        """``job``'s fine-tuned model is no longer served (a client deleted it), nor after a
        restart; its adapter stays on disk."""
        self.deleted.add(job.id)
        if self.config is not None:
            write_json(job.train_log.parent / DELETED, {"deleted_at": time.time()})

    def stats(self, job: FinetuneJob) -> EngineStats:
        """The figures of ``job``: its last ones once it has ended, the engine thread's while it
        runs, none while it is being set up."""
        ended = self.et.ended.get(job.id) or self.past.get(job.id)
        if ended is not None:
            return ended
        if job.id in self.setting_up:  # (the engine's figures may still be of its run before a pause)
            return EngineStats(coserving=True, ft_job=job.id)
        s = self.et.stats
        if s.ft_job == job.id:  # (one that has ended is in `ended` before its figures are published)
            return s
        return EngineStats(coserving=True, ft_job=job.id)

    def status(self, job: FinetuneJob) -> str | None:
        """``queued`` while it waits for the jobs before it, ``validating_files`` while set up (None:
        the figures' status)."""
        if job.id in self.queue:
            return "queued"
        return "validating_files" if job.id in self.setting_up else None

    def running(self) -> FinetuneJob | None:
        """The job being set up or trained, if any."""
        for job_id in self.setting_up:
            return self.jobs[job_id]
        session = self.et.session
        return self.jobs.get(session.job_id) if session is not None else None

    # ------------------------------------------------------------------ creating and cancelling

    def create(self, req: CreateJobRequest) -> FinetuneJob:
        """Check ``req``, register the job and start its set-up (400/404/409 saying what is wrong)."""
        if self.config is None or self.files is None:
            raise HTTPException(400, NO_JOBS)
        init_adapter = None if req.model == self.model else self._adapter_of(req.model)
        if req.integrations:
            raise HTTPException(400, "integrations: not supported")
        hp = req.resolved_hyperparameters()
        if hp.batch_size != "auto":
            raise HTTPException(400, "hyperparameters.batch_size: coserve batches by tokens, not samples (the "
                                     "server's --backward-tokens per backward task, --grad-accum tasks per "
                                     "optimizer step): send 'auto'")
        if hp.n_epochs != "auto" and not 1 <= hp.n_epochs <= 1000:
            raise HTTPException(400, f"hyperparameters.n_epochs must be in [1, 1000], got {hp.n_epochs}")
        if hp.learning_rate_multiplier != "auto" and not 0 < hp.learning_rate_multiplier <= 100:
            raise HTTPException(400, "hyperparameters.learning_rate_multiplier must be in (0, 100], got "
                                     f"{hp.learning_rate_multiplier}")
        data = self.files.path(self.files.get(req.training_file)["id"])
        if req.validation_file is not None:
            self.files.get(req.validation_file)  # (404 where there is none, "" included)
        job_id = f"ftjob-{uuid.uuid4().hex[:24]}"
        t = self.config.template
        mult = 1.0 if hp.learning_rate_multiplier == "auto" else float(hp.learning_rate_multiplier)
        epochs = t.coserve.epochs if hp.n_epochs == "auto" else int(hp.n_epochs)
        seed = t.coserve.seed if req.seed is None else req.seed
        output = self.config.root / "jobs" / job_id
        spec = replace(t, data=data, output=output, optim=replace(t.optim, lr=t.optim.lr * mult),
                       coserve=replace(t.coserve, epochs=epochs, seed=seed), calibrate=False,
                       latency_state=self._latency_state(), resume=False,
                       init_adapter=init_adapter or t.init_adapter)
        name = f"ft:{self.model}:coserve:{req.suffix + ':' if req.suffix else ''}{job_id}"
        job = FinetuneJob(job_id, int(time.time()), req.model, req.training_file, output / "train_log.jsonl",
                          epochs, spec.optim.lr, 0, seed, name, learning_rate_multiplier=mult, suffix=req.suffix,
                          live=False, validation_file=req.validation_file, metadata=req.metadata)
        self.jobs[job_id] = job
        self._save_job(job)
        write_json(output / SPEC, spec.to_json())
        ahead = self.running()
        self._enqueue(job, resume=False)
        logger.info("fine-tuning job %s created: %s, %d epochs, lr %g%s", job_id, data, epochs, spec.optim.lr,
                    f"; queued behind {ahead.id}" if ahead is not None else "")
        self._start_next()
        return job

    # ------------------------------------------------------------------ the queue

    def _enqueue(self, job: FinetuneJob, resume: bool, queued_at: float | None = None) -> None:
        """``job`` waits for the jobs before it (kept across a restart, where the jobs queued
        start in the order of their ``queued_at``: now unless given)."""
        self.queue[job.id] = resume
        if self.config is not None:
            write_json(job.train_log.parent / QUEUED,
                       {"queued_at": time.time() if queued_at is None else queued_at, "resume": resume})

    def _resumable(self, session: FinetuneSession) -> bool:
        """Whether ``session`` runs a job that can be paused and resumed (one created through the
        API, with a jobs directory)."""
        job = self.jobs.get(session.job_id)
        return self.config is not None and job is not None and not job.live

    def _dequeue(self, job: FinetuneJob) -> bool:
        """Take ``job`` off the queue; whether it was queued to resume."""
        resume = self.queue.pop(job.id)
        (job.train_log.parent / QUEUED).unlink(missing_ok=True)
        return resume

    def _start_next(self) -> None:
        """(the event loop) Set the oldest queued job up, where none runs; one that cannot start
        is failed, saying why, and the next one tried."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        while self.queue and not self.closing and not self.et.stopping and self.running() is None:
            job = self.jobs[next(iter(self.queue))]
            resume = self._dequeue(job)
            try:
                if resume:
                    self._resume(job)
                    logger.info("fine-tuning job %s resumed", job.id)
                else:
                    self._launch(job, self._created_spec(job))
            except ValueError as e:
                logger.warning("fine-tuning job %s cannot start: %s", job.id, e)
                if resume:
                    self.past[job.id] = replace(self.stats(job), ft_outcome="failed", ft_finished_at=time.time(),
                                                ft_failure=f"it could not be resumed: {e}")
                    self._save_outcome(job.id, self.past[job.id])
                    self._settle_validation(job, self.past[job.id])
                else:
                    self._never_ran(job, "failed", str(e))

    def _created_spec(self, job: FinetuneJob) -> FinetuneSpec:
        """The settings ``job`` was created with (ValueError where they cannot be read)."""
        path = job.train_log.parent / SPEC
        try:
            spec = FinetuneSpec.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"its settings ({path}) cannot be read: {e}") from e
        return replace(spec, latency_state=self._latency_state() or spec.latency_state)

    def _validation_path(self, job: FinetuneJob) -> Path | None:
        """``job``'s validation file on disk, if it has one (ValueError where it is gone)."""
        if job.validation_file is None:
            return None
        if self.files is None or job.validation_file not in self.files.files:
            raise ValueError(f"its validation file {job.validation_file!r} is gone")
        return self.files.path(job.validation_file)

    def _launch(self, job: FinetuneJob, spec: FinetuneSpec) -> None:
        self.setting_up[job.id] = asyncio.get_running_loop().create_task(
            self._start(job, spec, self._validation_path(job)))

    def _adapter_of(self, model: str) -> Path:
        """The adapter a job on ``model``, a fine-tuned model of this server (a job's or one of its
        epoch checkpoints), continues from (a 400 naming what can be fine-tuned otherwise)."""
        job = self.job_of_model(model)
        if job is not None and job.id not in self.deleted:
            s = self.stats(job)
            if s.ft_outcome in SERVED_OUTCOMES and s.adapter_path is not None:
                return s.adapter_path
        owner = self.job_of_model(model.rpartition(":ckpt-step-")[0])
        checkpoint = self.checkpoint_of_model(model)
        if checkpoint is not None and owner is not None and self.stats(owner).ft_outcome in SERVED_OUTCOMES:
            return Path(checkpoint)
        raise HTTPException(400, f"model: this server fine-tunes its base model {self.model!r} or a fine-tuned "
                                 f"model of one of its jobs that has ended (see GET /v1/models), not {model!r}")

    def _latency_state(self) -> Path | None:
        """The latency model a job starts from: ``--latency-state``, else ``DIR/latency_state.json``
        (calibrated at start-up, refitted by each job's end), else none (the defaults)."""
        if self.config is None:
            return None
        if self.config.template.latency_state is not None:
            return self.config.template.latency_state
        return self.config.latency_path if self.config.latency_path.is_file() else None

    def flush_latency_state(self) -> None:
        """Wait until ``DIR/latency_state.json`` is written (a job's set-up reads it; any thread)."""
        if self._state_write is not None:
            self._state_write.result()

    def _write_latency_state(self, state: dict[str, object]) -> None:
        """``state`` (a copy, taken between two engine steps) into ``DIR/latency_state.json`` by the
        board's writer thread, after the writes asked for before; a failed write is logged."""
        assert self.config is not None
        path = self.config.latency_path

        def write() -> None:
            try:
                write_json(path, state)
            except OSError as e:
                logger.warning("could not save the latency model to %s: %s", path, e)

        if self._state_writer is None:
            self._state_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="coserve-latency-state")
        self._state_write = self._state_writer.submit(write)

    def resume_interrupted(self) -> None:
        """(the event loop, at start-up) Set up again, from its last checkpoint, the job an earlier
        server was running when it stopped (the newest, should there be more than one: the others
        are failed, as one job runs at a time); the jobs it had queued wait for it."""
        self._loop = asyncio.get_running_loop()
        if self.interrupted:
            *older, job = self.interrupted
            self.interrupted = []
            for other in older:
                self._never_ran(other, "failed", "the server stopped while this job ran and a later job was resumed")
            try:
                self._resume(job)
                logger.info("fine-tuning job %s was running when the server stopped: resumed from its checkpoint",
                            job.id)
            except ValueError as e:
                self._never_ran(job, "failed", f"the server stopped while this job ran; {e}")
        self._start_next()  # (the jobs queued when it stopped, once that one is done)

    def _resume(self, job: FinetuneJob) -> None:
        """Set ``job`` up again from its checkpoint with the settings it was created with
        (ValueError saying why it cannot be)."""
        run = job.train_log.parent
        spec = self._created_spec(job)
        if not (run / "checkpoint" / "trainer_state.pt").is_file():
            raise ValueError(f"it has no checkpoint to resume from ({run / 'checkpoint'})")
        spec = replace(spec, resume=True, calibrate=False)
        valid = None
        # (a validation waiting for this job's end, since before its pause, goes on waiting)
        if job.validation_file is not None and job.id not in self._ended and self.files is not None \
                and job.validation_file in self.files.files:
            valid = self.files.path(job.validation_file)
        self.past.pop(job.id, None)
        self.et.ended.pop(job.id, None)
        (run / "outcome.json").unlink(missing_ok=True)
        self.setting_up[job.id] = asyncio.get_running_loop().create_task(self._start(job, spec, valid))

    async def pause(self, job: FinetuneJob) -> None:
        """Stop ``job`` at a checkpoint (``paused``: not served, resumed by :meth:`resume`; one
        whose last step completes meanwhile has ``succeeded``). One being set up is paused once its
        set-up is done (the call waits for it, as a cancel does), at its first step's checkpoint
        or a later one; one whose set-up fails is not running (409)."""
        if self.config is None or job.live:
            raise HTTPException(400, "only jobs created through the API (--finetune-jobs DIR) can be paused")
        task = self.setting_up.get(job.id)
        if task is not None:
            await asyncio.shield(task)
        session = self.et.session
        if session is None or session.job_id != job.id:
            state = "queued: it has not started (cancel it to take it off the queue)" if job.id in self.queue else \
                f"not running ({self.stats(job).ft_outcome or 'not started'})"
            raise HTTPException(409, f"fine-tuning job {job.id!r} is {state}")
        await self.et.cancel_finetuning(job.id, pause=True)
        await asyncio.to_thread(self.et.wait_exported)  # (its checkpoint written)

    def resume(self, job: FinetuneJob) -> None:
        """Go on with a ``paused`` job from its checkpoint: at once where no job runs or waits
        (409 where it cannot be resumed), else queued behind them."""
        outcome = "queued to resume" if job.id in self.queue else self.stats(job).ft_outcome
        if outcome != "paused":
            raise HTTPException(409, f"fine-tuning job {job.id!r} is not paused ({outcome or 'running'})")
        ahead = self.running()
        if ahead is not None or self.queue:
            self._enqueue(job, resume=True)
            logger.info("fine-tuning job %s queued to resume behind %s", job.id,
                        ahead.id if ahead is not None else next(iter(self.queue)))
            return
        try:
            self._resume(job)
        except ValueError as e:
            raise HTTPException(409, f"fine-tuning job {job.id!r} cannot be resumed: {e}") from e
        logger.info("fine-tuning job %s resumed", job.id)

    async def _start(self, job: FinetuneJob, spec: FinetuneSpec, valid: Path | None) -> None:
        session: FinetuneSession | None = None
        began = time.time()
        try:
            samples = None
            if valid is not None:
                samples = (await asyncio.to_thread(read_dataset, self.et.engine, valid, spec.coserve,
                                                   self.reader)).samples
            await asyncio.to_thread(self.et.wait_trainers_exited)
            await asyncio.to_thread(self.flush_latency_state)
            if self.config is not None and spec.latency_state in (None, self.config.latency_path):
                # (the board's model, read once the last job's is written: it may have been written
                # since the job was created, or, its write failed, not at all)
                spec = replace(spec, latency_state=self._latency_state())
            # (keep_spare: the next job's, or a resume's, trainer starts from a spare interpreter)
            session = await asyncio.to_thread(FinetuneSession, self.et.engine, spec, job_id=job.id, attach=False,
                                              reader=self.reader, keep_spare=True)
            self.jobs[job.id] = replace(job, total_steps=session.optim.total_steps, learning_rate=session.optim.lr)
            self._save_job(self.jobs[job.id])
            if job.id in self.cancel_asked:
                await asyncio.to_thread(session.close)
                self._never_ran(job, "cancelled")
                return
            try:  # (the job's events say what its set-up took; not worth failing the job over)
                write_json(job.train_log.parent / SETUP, {
                    "began_at": began, "done_at": time.time(), "samples": len(session.dataset.samples),
                    "skipped": session.dataset.stats.num_skipped, "resumed": spec.resume})
            except OSError as e:
                logger.warning("fine-tuning job %s: its set-up's record not written: %s", job.id, e)
            if samples is not None:
                self._ended[job.id] = asyncio.get_running_loop().create_future()
            await self.et.start_session(session)
            if samples is not None:
                task = asyncio.get_running_loop().create_task(self._validate(job, samples))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        except Exception as e:
            logger.exception("fine-tuning job %s could not start", job.id)
            if session is not None:
                await asyncio.to_thread(session.close)
            self._never_ran(job, "failed", f"setting up the job: {e}")
            self._settle_validation(job, self.past[job.id])
        finally:
            del self.setting_up[job.id]
            self._start_next()  # (where this one did not start: the next)

    async def _validate(self, job: FinetuneJob, samples: Sequence[FTSample]) -> None:
        """Score ``job``'s validation set with the base model while it trains, then, once it has
        ended, with its exported adapter; a failure is noted in the scores, nothing else stops."""
        v: dict[str, object] = {"status": "running", "samples": len(samples)}
        self.validation[job.id] = v
        self._save_validation(job)
        submit = self.et.submit
        try:
            before = await evaluate_served(submit, samples, prefix=f"{job.id}-valid-base-")
            v.update(loss_before=_number(before.loss), accuracy_before=_number(before.accuracy), tokens=before.tokens)
            self._save_validation(job)
            final = await self._ended[job.id]
            await asyncio.to_thread(self.et.wait_exported)  # (its adapter's files written)
            if final.adapter_path is None:
                raise RuntimeError("the job exported no adapter")
            name = job.fine_tuned_model if final.ft_outcome in SERVED_OUTCOMES else None
            lora = LoRARequest(name or f"{job.id}-validation", str(final.adapter_path))
            try:
                after: EvalResult = await evaluate_served(submit, samples, lora, prefix=f"{job.id}-valid-")
            finally:
                if name is None:  # (registered for the scoring only: not served)
                    await self.et.call(lambda engine: engine.remove_lora(lora.name))
            v.update(loss=_number(after.loss), accuracy=_number(after.accuracy), tokens=after.tokens)
            self._save_validation(job)
            logger.info("fine-tuning job %s: validation loss %.4f (before training %.4f) on %d tokens", job.id,
                        after.loss, before.loss, after.tokens)
            await self._score_checkpoints(job, samples, final, after)
            v["status"] = "succeeded"
        except Exception as e:
            logger.warning("fine-tuning job %s: validation failed: %s", job.id, e)
            v.update(status="failed", error=str(e) or type(e).__name__)
        finally:
            v["finished_at"] = time.time()
            self._ended.pop(job.id, None)
            self._save_validation(job)

    async def _score_checkpoints(self, job: FinetuneJob, samples: Sequence[FTSample], final: EngineStats,
                                 last: EvalResult) -> None:
        """Score each of ``job``'s epoch checkpoints on its validation set too, into its
        ``checkpoint.json`` (``valid_loss``, ``valid_accuracy``: OpenAI's checkpoint metrics), so that
        a client can pick the epoch that generalizes best; the final step's is ``last``, the
        adapter's own. A checkpoint that cannot be scored is logged and left unscored."""
        for ck in await asyncio.to_thread(self.checkpoints, job):
            step, path = int(str(ck["step_number"])), str(ck["path"])
            try:
                if step == final.ft_optimizer_steps:
                    score = last
                else:
                    lora = LoRARequest(f"{job.id}-valid-ckpt-{step}", path)

                    def unload(engine: LLMEngine, name: str = lora.name) -> None:
                        engine.remove_lora(name)

                    try:
                        score = await evaluate_served(self.et.submit, samples, lora, prefix=f"{job.id}-valid-{step}-")
                    finally:
                        await self.et.call(unload)
                meta = Path(path) / "checkpoint.json"
                fields = json.loads(meta.read_text())
                fields.update(valid_loss=_number(score.loss), valid_accuracy=_number(score.accuracy))
                write_json(meta, fields)
            except Exception as e:
                logger.warning("fine-tuning job %s: scoring its checkpoint %s failed: %s", job.id, path, e)

    def _settle_validation(self, job: FinetuneJob, final: EngineStats) -> None:
        """A validation waiting for ``job``'s end is told it has ended (``final``)."""
        ended = self._ended.pop(job.id, None)
        if ended is not None:
            _settle(ended, final)

    def _save_validation(self, job: FinetuneJob) -> None:
        if self.config is not None and job.id in self.validation:
            write_json(job.train_log.parent / "validation.json", self.validation[job.id])

    def _never_ran(self, job: FinetuneJob, outcome: str, failure: str | None = None) -> None:
        self.past[job.id] = EngineStats(coserving=True, ft_job=job.id, ft_outcome=outcome,
                                        ft_failure=failure, ft_finished_at=time.time())
        self._save_outcome(job.id, self.past[job.id])

    def _save_job(self, job: FinetuneJob) -> None:
        """``DIR/jobs/ID/job.json``: what a restarted server lists the job with."""
        if self.config is None:
            return
        fields = {**asdict(job), "train_log": str(job.train_log)}
        write_json(job.train_log.parent / "job.json", fields)

    def _save_outcome(self, job_id: str, s: EngineStats) -> None:
        """``DIR/jobs/ID/outcome.json``: how the job ended, for a restarted server."""
        job = self.jobs.get(job_id)
        if self.config is None or job is None or job.live:
            return
        write_json(job.train_log.parent / "outcome.json",
                    {k: getattr(s, k) for k in OUTCOME_FIELDS} | {"adapter_path": s.adapter_path and str(s.adapter_path)})

    async def cancel(self, job: FinetuneJob) -> None:
        """Stop ``job`` (one being set up once its set-up is done; a paused one where it paused,
        its adapter served from then on; a queued one taken off the queue, never run, or, queued to
        resume, as a paused one); one that has ended stays as it ended."""
        if job.id in self.queue and not self._dequeue(job):
            self._never_ran(job, "cancelled")
            self._settle_validation(job, self.past[job.id])
            return
        task = self.setting_up.get(job.id)
        if task is not None:
            self.cancel_asked.add(job.id)
            await asyncio.shield(task)
        paused = self.stats(job)
        if paused.ft_outcome == "paused":
            final = replace(paused, ft_outcome="cancelled", ft_finished_at=time.time())
            if final.adapter_path is not None and job.fine_tuned_model and job.id not in self.deleted:
                await self.et.call(lambda _: self.serve_adapter(job.fine_tuned_model or "", str(final.adapter_path), None))
            await self.serve_checkpoints(job)
            self.et.ended.pop(job.id, None)
            self.past[job.id] = final
            self._save_outcome(job.id, final)
            self._settle_validation(job, final)
            return
        await self.et.cancel_finetuning(job.id)
        await asyncio.to_thread(self.et.wait_exported)  # (its files written, off the engine's thread)

    # ------------------------------------------------------------------ the engine thread's hook

    def session_ended(self, session: FinetuneSession, final: EngineStats, adapter: LoraAdapter | None = None
                      ) -> EngineStats:
        """(loop thread, between two steps) A session has ended and exported its adapter: serve it
        under the job's name, keep the latency model for the next job and how it ended for a
        restarted server; returns the job's figures."""
        final = self._served(session, final, adapter)
        self._save_outcome(session.job_id, final)
        job = self.jobs.get(session.job_id)
        if job is not None and final.ft_outcome == "paused" and self.et.stopping and self._resumable(session):
            # paused by the server's stop (or the engine's failure), not by a client: resumed at the
            # next start, ahead of the jobs queued behind it
            self._enqueue(job, resume=True, queued_at=0.0)
            logger.info("fine-tuning job %s paused at a checkpoint as the server stops: it resumes at the next "
                        "start", job.id)
        ended = self._ended.get(session.job_id)
        if ended is not None and final.ft_outcome != "paused":  # (a paused job's validation waits for its end)
            ended.get_loop().call_soon_threadsafe(_settle, ended, final)
        if self._loop is not None and self.queue:
            try:
                self._loop.call_soon_threadsafe(self._start_next)
            except RuntimeError:  # (the event loop has closed: the server is stopping)
                pass
        return final

    def _served(self, session: FinetuneSession, final: EngineStats, adapter: LoraAdapter | None) -> EngineStats:
        job = self.jobs.get(session.job_id)
        if self.config is not None:
            self._write_latency_state(latency_state(session.engine, session.coserver.latency))
        path = final.adapter_path
        if job is None or job.fine_tuned_model is None or path is None:
            return final
        if job.live:
            # NOTE: the training slot serves the name until here; the next job will write that slot,
            # so the name moves to the exported adapter (only where a next job can come)
            if self.config is not None:
                self.et.engine.lora_manager.unbind_training_slot(job.fine_tuned_model)
                self.serve_adapter(job.fine_tuned_model, str(path), adapter)
            if final.ft_outcome in SERVED_OUTCOMES:
                self._serve_checkpoints_later(job)
            return final
        if final.ft_outcome not in SERVED_OUTCOMES:
            return final
        try:
            self.serve_adapter(job.fine_tuned_model, str(path), adapter)
        except Exception as e:
            logger.exception("serving the adapter of job %s failed", job.id)
            return replace(final, ft_outcome="failed", ft_failure=f"the trained adapter could not be served: {e}")
        logger.info("fine-tuning job %s %s: serving %r from %s", job.id, final.ft_outcome, job.fine_tuned_model, path)
        self._serve_checkpoints_later(job)
        return final

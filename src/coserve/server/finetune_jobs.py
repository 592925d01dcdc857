"""Co-serving runs as OpenAI fine-tuning jobs: ``/v1/fine_tuning/jobs`` (create, list, retrieve,
events, cancel; pause and resume for the jobs clients create, which queue behind the one that runs), so that the ``openai`` client and
scripts written for it can start, watch and stop the fine-tuning ``coserve serve`` runs: the one it was started with (``--finetune-data``)
and, with ``--finetune-jobs DIR``, those clients create (:mod:`coserve.server.job_board`).

A job's figures come from the engine loop's published :class:`EngineStats` (an ended job's are
kept); its events are the run's ``train_log.jsonl`` (one line per optimizer step, on disk: they
outlive the session), newest first as OpenAI lists them.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, HTTPException, Query

from coserve.server.engine_thread import EngineStats, EngineThread
from coserve.server.protocol import CreateJobRequest

if TYPE_CHECKING:
    from coserve.server.job_board import JobBoard

OBJECT = "fine_tuning.job"
# outcomes whose exported adapter is served under the job's fine_tuned_model name
SERVED_OUTCOMES = ("succeeded", "cancelled")


@dataclass(frozen=True)
class FinetuneJob:
    """What a job says that does not change while it runs (read from the session at start-up,
    or from the create request)."""

    id: str
    created_at: int
    model: str
    training_file: str
    train_log: Path
    n_epochs: int
    learning_rate: float
    total_steps: int
    seed: int
    fine_tuned_model: str | None  # the name the trained adapter is served under (--finetune-name)
    learning_rate_multiplier: float | None = None
    suffix: str | None = None
    # the adapter is served under fine_tuned_model while it trains (--finetune-name); else only
    # once the job has succeeded or was cancelled (as OpenAI's: null until then)
    live: bool = True
    validation_file: str | None = None  # a file id: its loss before training and with the adapter
    metadata: dict[str, str] | None = None  # the client's, returned as given

    @classmethod
    def of(cls, engine_thread: EngineThread, model: str, fine_tuned_model: str | None) -> FinetuneJob | None:
        session = engine_thread.session
        if session is None:
            return None
        spec = session.spec
        return cls(session.job_id, int(time.time()), model, str(spec.data),
                   spec.output / "train_log.jsonl", spec.coserve.epochs, session.optim.lr, session.optim.total_steps,
                   spec.coserve.seed, fine_tuned_model)


def job_object(job: FinetuneJob, s: EngineStats, now: float | None = None, status: str | None = None,
               validation: dict[str, Any] | None = None) -> dict[str, Any]:
    """The OpenAI ``fine_tuning.job`` of ``job`` at ``s`` (coserve's own figures under ``coserve``);
    ``status`` overrides the one of ``s`` (``validating_files`` while the job is set up);
    ``validation``: its validation file's scores so far (``JobBoard.validation``)."""
    now = time.time() if now is None else now
    status = status or s.ft_outcome or "running"
    served = job.live or (s.ft_outcome in SERVED_OUTCOMES and s.adapter_path is not None)
    estimated_finish = None
    if status == "running" and 0 < s.ft_samples_retired < s.ft_samples_total:
        rate = s.ft_samples_retired / max(now - job.created_at, 1e-9)
        estimated_finish = int(now + (s.ft_samples_total - s.ft_samples_retired) / rate)
    error = None
    if status == "failed":
        error = {"code": "trainer_failed", "message": s.ft_failure or "fine-tuning gave up", "param": None}
    return {
        "object": OBJECT, "id": job.id, "created_at": job.created_at, "model": job.model,
        "organization_id": "coserve", "status": status, "error": error,
        "fine_tuned_model": job.fine_tuned_model if served else None,
        "finished_at": int(s.ft_finished_at) if s.ft_finished_at is not None and status != "paused" else None,
        "estimated_finish": estimated_finish,
        "hyperparameters": {"n_epochs": job.n_epochs, "batch_size": "auto",
                            "learning_rate_multiplier": job.learning_rate_multiplier},
        "user_provided_suffix": job.suffix,
        "method": {"type": "supervised"},
        "result_files": [str(s.adapter_path)] if s.adapter_path is not None else [],
        "seed": job.seed, "trained_tokens": s.ft_tokens_trained, "training_file": job.training_file,
        "validation_file": job.validation_file, "metadata": job.metadata,
        "coserve": {
            "learning_rate": job.learning_rate, "optimizer_steps": s.ft_optimizer_steps,
            "total_steps": total_steps(job, s), "samples_trained": s.ft_samples_retired,
            "samples_total": s.ft_samples_total, "loss": _finite(s.ft_loss), "first_loss": _finite(s.ft_first_loss),
            "trainer_restarts": s.ft_trainer_restarts, "validation": validation,
        },
    }


def total_steps(job: FinetuneJob, s: EngineStats) -> int:
    """The job's optimizer steps in all: the count, once its epochs are done; before, the steps so
    far scaled by the share of samples trained (the LR schedule's estimate until one is)."""
    if s.ft_outcome == "succeeded":
        return s.ft_optimizer_steps
    if s.ft_samples_retired > 0:
        return max(s.ft_optimizer_steps, round(s.ft_optimizer_steps * s.ft_samples_total / s.ft_samples_retired))
    return job.total_steps


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


SETUP = "setup.json"
"""In a job's directory: its last set-up (``JobBoard._start``): ``began_at`` / ``done_at`` (Unix
seconds), ``samples`` and ``skipped`` (its training file's usable and malformed rows), ``resumed``
(set up again from its checkpoint); a set-up can take tens of seconds on a GPU (session 43: ~19 s
for an 8B model's trainer and its warm-up), so the job's events say what it took."""


def setup_event(job: FinetuneJob) -> dict[str, Any] | None:
    """The event of the job's last set-up (:data:`SETUP`), or None before it is done."""
    try:
        s = json.loads((job.train_log.parent / SETUP).read_text())
        took, done, samples, skipped = float(s["done_at"]) - float(s["began_at"]), float(s["done_at"]), \
            int(s["samples"]), int(s["skipped"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    what = "Set up again from its checkpoint" if s.get("resumed") else "Set up"
    rows = f"{samples} training samples" + (f" ({skipped} malformed rows skipped)" if skipped else "")
    return event(f"{job.id}-setup", done, f"{what} in {took:.1f} s: {rows}; training starts", data={
        "setup_seconds": took, "samples": samples, "malformed_rows": skipped})


def event(eid: str, created: float, message: str, level: str = "info", kind: str = "message",
          data: dict[str, Any] | None = None) -> dict[str, Any]:
    """One ``fine_tuning.job.event``."""
    return {"object": "fine_tuning.job.event", "id": eid, "created_at": int(created), "level": level,
            "message": message, "type": kind, "data": data}


def job_events(job: FinetuneJob, s: EngineStats, validation: dict[str, Any] | None = None,
               status: str | None = None) -> list[dict[str, Any]]:
    """The job's events, newest first: its validation file's scores with the trained adapter
    (once done: a ``metrics`` event with OpenAI's ``full_valid_loss`` and
    ``full_valid_mean_token_accuracy``), its end (once it has ended), one ``metrics`` event per
    optimizer step of ``train_log.jsonl`` (OpenAI's ``Step k/n: training loss=x``, ``n`` from
    :func:`total_steps`; a warning for a step skipped or one whose loss never came), its last
    set-up (:func:`setup_event`), its start (``status`` ``queued``: that it waits)."""
    total = total_steps(job, s)
    if status == "queued":
        return [event(f"{job.id}-queued", job.created_at, f"Fine-tuning {job.model} on {job.training_file} is "
                      "queued: it starts once the jobs before it have ended")]
    events = [event(f"{job.id}-start", job.created_at, f"Fine-tuning {job.model} on {job.training_file} started")]
    try:
        lines = job.train_log.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            entry = json.loads(line)
            step, created, loss = int(entry["step"]) + 1, float(entry["wall_time"]), entry.get("loss")
        except (ValueError, KeyError, TypeError):
            continue  # (a line being written)
        if entry.get("skipped"):
            events.append(event(f"{job.id}-step-{step}", created, f"Step {step}/{total}: skipped "
                                f"(non-finite loss or gradient)", level="warn"))
            continue
        if entry.get("reported") is False:  # (OptimizerStepLog.reported: no loss to chart)
            events.append(event(f"{job.id}-step-{step}", created, f"Step {step}/{total}: trained; its loss is "
                                "unknown (the trainer died before reporting it)", level="warn"))
            continue
        shown = f"{loss:.4f}" if isinstance(loss, (int, float)) else "n/a"
        events.append(event(f"{job.id}-step-{step}", created, f"Step {step}/{total}: training loss={shown}",
                            kind="metrics", data={"step": step, "total_steps": total, "train_loss": loss,
                                                  "tokens": entry.get("tokens"), "learning_rate": entry.get("lr")}))
    setup = setup_event(job)
    if setup is not None:  # (in time order among the steps: a resumed job's comes after its first steps)
        at = 1 + sum(1 for e in events[1:] if e["created_at"] <= setup["created_at"])
        events.insert(at, setup)
    if s.ft_outcome is not None:
        end = {"succeeded": ("The job has successfully completed", "info"),
               "cancelled": ("The job was cancelled; the last committed step was exported", "info"),
               "paused": ("The job was paused at a checkpoint (resume it to go on from there); its last committed "
                          "step was exported", "info"),
               "failed": (f"The job failed: {s.ft_failure}; the last committed step was exported", "error")}
        message, level = end.get(s.ft_outcome, (f"The job ended: {s.ft_outcome}", "info"))
        if s.adapter_path is not None:
            message += f" to {s.adapter_path}"
        events.append(event(f"{job.id}-end", s.ft_finished_at or time.time(), message, level))
    if validation is not None and validation.get("status") in ("succeeded", "failed"):
        events.append(validation_event(job, s, validation))
    return events[::-1]


def validation_event(job: FinetuneJob, s: EngineStats, v: dict[str, Any]) -> dict[str, Any]:
    """The event of a validation that has ended (``JobBoard.validation``'s fields)."""
    eid, created = f"{job.id}-validation", v.get("finished_at") or time.time()
    if v["status"] == "failed":
        return event(eid, created, f"Validation on {job.validation_file} failed: {v.get('error')}", level="warn")
    before = v.get("loss_before")
    was = f" (before training: loss={before:.4f})" if isinstance(before, float) else ""
    return event(eid, created, f"Validation on {v['tokens']} tokens: loss={v['loss']:.4f}, "
                 f"token accuracy={v['accuracy']:.4f}{was}", kind="metrics",
                 data={"step": s.ft_optimizer_steps, "full_valid_loss": v["loss"],
                       "full_valid_mean_token_accuracy": v["accuracy"], "valid_loss_before": before,
                       "valid_mean_token_accuracy_before": v.get("accuracy_before")})


def checkpoint_object(job: FinetuneJob, ck: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI ``fine_tuning.job.checkpoint`` of one of ``job``'s epoch checkpoints
    (``JobBoard.checkpoints``' fields)."""
    step = int(ck["step_number"])
    return {
        "object": "fine_tuning.job.checkpoint", "id": f"ftckpt-{job.id.removeprefix('ftjob-')}-{step}",
        "created_at": int(ck.get("created_at") or 0), "fine_tuned_model_checkpoint": ck["model"],
        "fine_tuning_job_id": job.id, "step_number": step,
        "metrics": {"step": step, "train_loss": _finite(ck.get("train_loss")),
                    # (the job's validation file, scored with this checkpoint once the job has ended)
                    "full_valid_loss": _finite(ck.get("valid_loss")),
                    "full_valid_mean_token_accuracy": _finite(ck.get("valid_accuracy"))},
        "coserve": {"epoch": ck.get("epoch"), "path": ck["path"], "tokens_trained": ck.get("tokens_trained")},
    }


def add_finetune_job_routes(app: FastAPI, board: JobBoard) -> None:
    """``/v1/fine_tuning/jobs`` over ``board`` (a server that does not fine-tune lists none)."""
    def obj(job: FinetuneJob) -> dict[str, Any]:
        return job_object(job, board.stats(job), status=board.status(job), validation=board.validation.get(job.id))

    @app.get("/v1/fine_tuning/jobs")
    async def list_jobs(after: str | None = None, limit: int = Query(20, ge=1, le=1000)) -> dict[str, Any]:
        jobs = board.newest_first()
        if after is not None:
            ids = [j.id for j in jobs]
            if after not in ids:
                raise HTTPException(400, f"after: no fine-tuning job {after!r} on this server")
            jobs = jobs[ids.index(after) + 1:]
        return {"object": "list", "data": [obj(j) for j in jobs[:limit]], "has_more": len(jobs) > limit}

    async def create_job(req: CreateJobRequest) -> dict[str, Any]:
        return obj(board.create(req))

    app.post("/v1/fine_tuning/jobs")(create_job)

    @app.get("/v1/fine_tuning/jobs/{job_id}")
    async def retrieve_job(job_id: str) -> dict[str, Any]:
        return obj(board.find(job_id))

    @app.get("/v1/fine_tuning/jobs/{job_id}/events")
    async def list_events(job_id: str, after: str | None = None,
                          limit: int = Query(20, ge=1, le=1000)) -> dict[str, Any]:
        job = board.find(job_id)
        # (the train log grows by a line a step: read off the event loop)
        events = await asyncio.to_thread(job_events, job, board.stats(job), board.validation.get(job_id),
                                         board.status(job))
        if after is not None:
            ids = [e["id"] for e in events]
            if after not in ids:
                raise HTTPException(400, f"after: no event {after!r} in job {job_id!r}")
            events = events[ids.index(after) + 1:]
        return {"object": "list", "data": events[:limit], "has_more": len(events) > limit}

    @app.get("/v1/fine_tuning/jobs/{job_id}/checkpoints")
    async def list_checkpoints(job_id: str, after: str | None = None,
                               limit: int = Query(10, ge=1, le=1000)) -> dict[str, Any]:
        """OpenAI's checkpoints: the adapters of the job's last epochs' ends (``--epoch-checkpoints``),
        newest first, each served under its ``fine_tuned_model_checkpoint`` once the job has ended."""
        job = board.find(job_id)
        found = [checkpoint_object(job, ck) for ck in await asyncio.to_thread(board.checkpoints, job)]
        if after is not None:
            ids = [c["id"] for c in found]
            if after not in ids:
                raise HTTPException(400, f"after: no checkpoint {after!r} in job {job_id!r}")
            found = found[ids.index(after) + 1:]
        return {"object": "list", "data": found[:limit], "has_more": len(found) > limit,
                "first_id": found[0]["id"] if found else None, "last_id": found[:limit][-1]["id"] if found else None}

    @app.post("/v1/fine_tuning/jobs/{job_id}/pause")
    async def pause_job(job_id: str) -> dict[str, Any]:
        job = board.find(job_id)
        await board.pause(job)
        return obj(board.jobs[job_id])

    @app.post("/v1/fine_tuning/jobs/{job_id}/resume")
    async def resume_job(job_id: str) -> dict[str, Any]:
        job = board.find(job_id)
        board.resume(job)
        return obj(board.jobs[job_id])

    @app.post("/v1/fine_tuning/jobs/{job_id}/cancel")
    async def cancel_job(job_id: str) -> dict[str, Any]:
        job = board.find(job_id)
        await board.cancel(job)
        # (one that has ended already comes back as it ended, as OpenAI's does)
        return obj(board.jobs[job_id])

"""A fine-tuning run attached to an engine: dataset, trainer process, logs, exported adapter."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import shutil
import signal
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from coserve.core.activations import ActivationStore
from coserve.core.config import CoServeConfig, LoRAConfig, OptimConfig, SLOConfig
from coserve.core.coserver import CoServer, OptimizerStepLog
from coserve.core.finetune import IGNORE_INDEX, FTDataset, FTSample, load_dataset
from coserve.core.latency import LatencyModel
from coserve.core.sample_pool import SamplePool
from coserve.core.step_count import count_optimizer_steps
from coserve.engine.llm_engine import LLMEngine
from coserve.engine.sampling_params import SamplingParams
from coserve.engine.sequence import LoRARequest
from coserve.models.peft_adapter import (
    LoraAdapter,
    check_adapter_fits,
    load_peft_adapter,
    new_lora_adapter,
    save_peft_adapter,
)
from coserve.server.dataset_reader import DatasetReader
from coserve.server.interrupts import stop_requests
from coserve.server.run_identity import identity_differences, run_identity
from coserve.server.train_log import entry_line, read_train_log
from coserve.trainer.process import TrainerProcess
from coserve.trainer.worker import WARMUP_SHAPES, warmup_rows, warmup_shapes

logger = logging.getLogger(__name__)

CHECKPOINT_ASIDE = ".checkpoint.old"  # (in OUTPUT: the checkpoint being replaced, until the new one is in place)
CHECKPOINT_TMP = ".checkpoint.tmp"  # (in OUTPUT: a checkpoint being written)

COMMIT_RESULT_TIMEOUT_S = 10.0
"""How long a checkpoint or an export waits for the result of an optimizer step the trainer has
committed (milliseconds after the commit, unless the trainer hangs there)."""


@dataclass(frozen=True)
class FinetuneSpec:
    """What to train on and where the results go.

    ``output/adapter`` receives the PEFT adapter, ``output/train_log.jsonl`` one line per
    optimizer step, ``output/run_config.json`` every setting of the run, ``output/checkpoints``
    the adapters of the last ``epoch_checkpoints`` epochs (:func:`epoch_checkpoints`).
    """

    data: Path
    output: Path
    lora: LoRAConfig = LoRAConfig()
    optim: OptimConfig = OptimConfig()
    coserve: CoServeConfig = CoServeConfig()
    slo: SLOConfig = SLOConfig()
    init_adapter: Path | None = None
    trainer_threads: int = 0
    calibrate: bool = False
    # A latency-model state (JSON, OUTPUT/latency_state.json of an earlier run of the same model
    # and engine settings): loaded instead of calibrating. A calibration writes its own there.
    latency_state: Path | None = None
    save_every: int = 100
    # the adapters of the last N epochs' ends, OUTPUT/checkpoints/step-K (0: none), as OpenAI's
    # fine-tuning checkpoints: one to fall back to where the last epochs overfit
    epoch_checkpoints: int = 3
    resume: bool = False
    trainer_sm_share: int | None = None
    # One synthetic backward task in the trainer process before its first real one (auto: on CUDA)
    trainer_warmup: str = "auto"

    def __post_init__(self) -> None:
        if self.save_every < 0:
            raise ValueError(f"--save-every must be >= 0 (0: no periodic checkpoint), got {self.save_every}")
        if self.trainer_threads < 0:
            raise ValueError(f"--trainer-threads must be >= 0 (0: torch's default), got {self.trainer_threads}")
        if self.epoch_checkpoints < 0:
            raise ValueError(f"--epoch-checkpoints must be >= 0, got {self.epoch_checkpoints}")
        if self.trainer_sm_share is not None and not 0 < self.trainer_sm_share <= 100:
            raise ValueError(f"--trainer-sm-share must be in (0, 100], got {self.trainer_sm_share}")

    _PATHS = ("data", "output", "init_adapter", "latency_state")
    _CONFIGS = {"lora": LoRAConfig, "optim": OptimConfig, "coserve": CoServeConfig, "slo": SLOConfig}

    def to_json(self) -> dict[str, Any]:
        """Every field, as JSON (:meth:`from_json` reads it back): a job's settings on disk."""
        out = asdict(self)
        for name in self._PATHS:
            out[name] = None if out[name] is None else str(out[name])
        return out

    @classmethod
    def from_json(cls, fields: dict[str, Any]) -> FinetuneSpec:
        """The spec :meth:`to_json` wrote (ValueError, KeyError or TypeError where it is not one)."""
        kwargs = dict(fields)
        for name in cls._PATHS:
            kwargs[name] = None if kwargs.get(name) is None else Path(kwargs[name])
        for name, config in cls._CONFIGS.items():
            kwargs[name] = config(**kwargs[name])
        return cls(**kwargs)


def read_dataset(engine: LLMEngine, path: Path, cfg: CoServeConfig, reader: DatasetReader | None = None) -> FTDataset:
    """``path`` as a run of ``cfg`` trains on it: the engine's tokenizer, ``--max-seq-len``,
    ``--train-on-prompt``, token ids below the smaller of the tokenizer's and the model's
    vocabulary (malformed rows skipped and counted); read by ``reader`` (a child process, off
    this one's GIL: a serving engine's) where given, else here."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise ValueError("fine-tuning needs the model's tokenizer (skip_tokenizer_init is set)")
    vocab_size = min(tokenizer.vocab_size, engine.model_config.vocab_size)
    if reader is not None:
        return reader.read(path, max_seq_len=cfg.max_seq_len, train_on_prompt=cfg.train_on_prompt,
                           vocab_size=vocab_size)
    return load_dataset(path, tokenizer, max_seq_len=cfg.max_seq_len, train_on_prompt=cfg.train_on_prompt,
                        vocab_size=vocab_size)


class FinetuneSession:
    """Builds and owns everything a fine-tuning run needs beside the engine."""

    def _trainer_warms_up(self) -> bool:
        mode = self.spec.trainer_warmup
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"trainer_warmup must be auto, on or off, got {mode!r}")
        return mode == "on" or (mode == "auto" and self.engine.runner.device.type == "cuda")

    def __init__(self, engine: LLMEngine, spec: FinetuneSpec, *, job_id: str | None = None,
                 attach: bool = True, reader: DatasetReader | None = None, keep_spare: bool = False) -> None:
        """Read the dataset, allocate the activation store and start the trainer (seconds: the
        heavy part, which touches no engine state a step reads, so that a serving engine's
        ``EngineThread`` can run it in a worker thread); then, with ``attach``, :meth:`attach`.
        ``job_id`` names the run as a fine-tuning job (default: a new ``ftjob-...``); ``reader``
        reads its dataset in a child process (:func:`read_dataset`); ``keep_spare``: a spare trainer
        interpreter is started after the trainer's (:mod:`coserve.trainer.spare`), for a restart or
        the next session's start (a server's jobs)."""
        if engine.tokenizer is None:
            raise ValueError("fine-tuning needs the model's tokenizer (skip_tokenizer_init is set)")
        if engine.config.num_training_slots < 1:
            raise ValueError("the engine has no training adapter slot: start it with num_training_slots >= 1")
        if spec.lora.rank > engine.config.max_lora_rank:
            raise ValueError(f"--lora-rank {spec.lora.rank} exceeds the engine's max_lora_rank "
                             f"{engine.config.max_lora_rank}")
        self.engine = engine
        self.spec = spec
        self.job_id = job_id or f"ftjob-{uuid.uuid4().hex[:24]}"
        try:  # (before anything starts: the trainer process would outlive a late failure)
            spec.output.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--output {spec.output}: cannot create it: {e.strerror or e}") from e
        cfg = spec.coserve
        if cfg.max_seq_len > engine.max_model_len:
            raise ValueError(f"--max-seq-len {cfg.max_seq_len} exceeds the model's context {engine.max_model_len}")
        began = time.perf_counter()
        self.dataset = read_dataset(engine, spec.data, cfg, reader)
        read_s = time.perf_counter() - began
        stats = self.dataset.stats
        if stats.num_skipped:
            logger.warning("%s: %d malformed rows skipped (first: line %d: %s)", spec.data, stats.num_skipped,
                           self.dataset.skipped[0].line, self.dataset.skipped[0].reason)
        self._run = run_identity(
            model=_model_name(engine), data=spec.data, samples=self.dataset.samples, num_tokens=stats.num_tokens,
            init_adapter=spec.init_adapter, lora=asdict(spec.lora), optim=asdict(spec.optim),
            coserve=asdict(spec.coserve))
        self._log_path = spec.output / "train_log.jsonl"
        checkpoint = self._read_checkpoint() if spec.resume else None
        logged = read_train_log(self._log_path) if checkpoint is not None else []  # (before the trainer starts)
        latency = LatencyModel()
        if spec.latency_state is not None:  # checked before the trainer process starts
            try:
                load_latency_state(spec.latency_state, engine, latency)
            except ValueError as e:
                raise ValueError(f"--latency-state: {e}") from e
        optim = spec.optim
        if checkpoint is not None:
            optim = replace(optim, total_steps=self._resumed_total_steps(checkpoint))
        elif optim.total_steps == 0:
            optim = replace(optim, total_steps=self.estimate_steps())
        self.optim = optim
        self.pool = SamplePool(self.dataset.samples, epochs=cfg.epochs, seed=cfg.seed, shuffle=cfg.shuffle,
                               window=cfg.candidate_window)
        adapter = self._initial_adapter()
        self._adapter_targets = tuple(adapter.weights)
        model = engine.model
        # Two regions let the next task of an optimizer step be captured during the backward of
        # the previous one (same adapter weights); with one task per step there is nothing to overlap.
        self.store = ActivationStore(model.config.num_layers, cfg.store_capacity, model.config.hidden_size,
                                     engine.runner.dtype, engine.runner.device,
                                     regions=2 if optim.accumulation_tasks > 1 else 1,
                                     mlp_width=2 * model.config.intermediate_size if cfg.save_mlp_activations else 0)
        warms_up = self._trainer_warms_up()
        trainer_began = time.perf_counter()
        self.trainer = TrainerProcess(
            model, self.store.tensor, engine.lora_manager.scales, adapter,
            slot=engine.lora_manager.training_slot(0), optim=optim, dropout=spec.lora.dropout, seed=cfg.seed,
            num_threads=spec.trainer_threads, sm_share=spec.trainer_sm_share, mlp_store=self.store.mlp,
            below_normal=engine.stream is not None,
            warmup_rows=warmup_rows(cfg.backward_tokens, cfg.max_seq_len) if warms_up else (),
            warmup_shapes=warmup_shapes(cfg.backward_tokens, cfg.max_seq_len) if warms_up and WARMUP_SHAPES else (),
            state=None if checkpoint is None else (checkpoint["state"], int(checkpoint["steps"])),
            keep_spare=keep_spare,
        )
        # (the stages the trainer's start has passed: all of them where its warm-up was waited for)
        stages = ", ".join(f"{name.replace('_', '-')} {s:.1f} s" for name, s in self.trainer.start_stages().items())
        if self.trainer.from_spare:
            stages = f"from a spare interpreter: {stages}" if stages else "from a spare interpreter"
        logger.info("%s set up in %.1f s: dataset %s read in %.1f s (%d samples), trainer started in %.1f s%s%s",
                    self.job_id, time.perf_counter() - began, spec.data, read_s, len(self.dataset.samples),
                    time.perf_counter() - trainer_began, " with its warm-up" if warms_up else "",
                    f" ({stages})" if stages else "")
        self.coserver = CoServer(
            pool=self.pool, samples={s.sample_id: s for s in self.dataset.samples}, store=self.store,
            trainer=self.trainer, config=cfg, optim=optim, slo=spec.slo, latency=latency,
            on_step_logged=self._log_step,
        )
        self.history: list[OptimizerStepLog] = []
        self._epochs_saved = 0  # (the epochs whose end has an epoch checkpoint, or had one)
        if checkpoint is not None:
            self._resume(checkpoint, logged)
        else:
            self._log_path.write_text("")
            # (an earlier run's, in this OUTPUT: a later --resume goes on from this run's checkpoint or none)
            _remove_epoch_checkpoints(spec.output, after_step=0)
            self._remove_checkpoint()
        self.coserver.lora_dropout = spec.lora.dropout
        self.coserver.dropout_seed = cfg.seed
        self._write_run_config()
        self._writer: ThreadPoolExecutor | None = None  # (save_checkpoint's, made on first use)
        self._writes: deque[Future[None]] = deque()
        # what the trainer's state is copied into (_logged_state), faulted in here, off the
        # engine's thread, and the write that reads it (a checkpoint's) until it is done
        self._state_buffer = self.trainer.state_buffer()
        self._state_read: Future[None] | None = None
        self._state_copying = False
        self.started = time.monotonic()
        if attach:
            self.attach()

    def attach(self) -> None:
        """Co-serve: the engine mutations of the run, for the engine's own thread (between two
        steps, once it serves): the training slot's targets declared, the co-server attached,
        and, with ``spec.calibrate`` (and no ``latency_state``), the calibration sweep."""
        engine, spec = self.engine, self.spec
        # the trainer writes the adapter's targets into its slot, and nothing else
        engine.declare_training_adapter(engine.lora_manager.training_slot(0), self._adapter_targets)
        engine.attach(self.coserver, 0)
        if spec.latency_state is not None:
            logger.info("latency model loaded from %s", spec.latency_state)
        elif spec.calibrate:
            t = time.perf_counter()
            n = engine.calibrate()
            logger.info("latency model calibrated on %d batches in %.1fs", n, time.perf_counter() - t)
            write_json(spec.output / "latency_state.json", latency_state(engine, self.coserver.latency))
        self.started = time.monotonic()

    def dataset_line(self) -> str:
        """``dataset PATH: N samples, T tokens (K malformed rows skipped, M truncated)``."""
        stats = self.dataset.stats
        return (f"dataset {self.spec.data}: {stats.num_samples} samples, {stats.num_tokens} tokens "
                f"({stats.num_skipped} malformed rows skipped, {stats.num_truncated} truncated)")

    def estimate_steps(self) -> int:
        """Optimizer steps the run will take (for the LR schedule): its samples packed into tasks
        and steps as the co-server packs them (:func:`count_optimizer_steps`: exact for a run with
        no requests beside it, an estimate where requests share its steps)."""
        return max(1, count_optimizer_steps(self.dataset.samples, self.spec.coserve,
                                            self.spec.optim.accumulation_tasks))

    def _initial_adapter(self) -> LoraAdapter:
        model_cfg = self.engine.model_config
        shapes = model_cfg.linear_shapes()
        if self.spec.init_adapter is not None:
            adapter = load_peft_adapter(self.spec.init_adapter)
            check_adapter_fits(adapter, num_layers=model_cfg.num_layers, shapes=shapes,
                               max_rank=self.engine.config.max_lora_rank, path=self.spec.init_adapter)
            return adapter
        lora = self.spec.lora
        return new_lora_adapter(num_layers=model_cfg.num_layers, shapes=shapes, rank=lora.rank, alpha=lora.alpha,
                                target_modules=lora.target_modules, use_rslora=lora.use_rslora,
                                seed=self.spec.coserve.seed, base_model_name_or_path=str(self.engine.config.model))

    def _write_run_config(self) -> None:
        cfg = {
            "data": str(self.spec.data), "model": self.engine.config.model,
            "lora": asdict(self.spec.lora), "optim": asdict(self.optim), "coserve": asdict(self.spec.coserve),
            "slo": asdict(self.spec.slo),
            "init_adapter": str(self.spec.init_adapter) if self.spec.init_adapter else None,
            "dataset": asdict(self.dataset.stats),
            "skipped_rows": [{"line": r.line, "reason": r.reason} for r in self.dataset.skipped],
        }
        (self.spec.output / "run_config.json").write_text(json.dumps(cfg, indent=2, default=str))

    def _log_step(self, entry: OptimizerStepLog) -> None:
        self.history.append(entry)
        with self._log_path.open("a") as f:
            f.write(entry_line(asdict(entry)))
        if self.spec.save_every and self.coserver.steps_done % self.spec.save_every == 0:
            self.save_checkpoint()
        if self.spec.epoch_checkpoints and self.pool.epoch > self._epochs_saved:
            self._epochs_saved = self.pool.epoch
            self.save_epoch_checkpoint(entry)

    def save_epoch_checkpoint(self, entry: OptimizerStepLog) -> None:
        """Keep the adapter of optimizer step ``entry``, the first after an epoch's samples were all
        trained, in ``OUTPUT/checkpoints/step-K`` (a PEFT directory with ``checkpoint.json``: step,
        epoch, loss); the trainer's state is copied here (the step just logged: the next one's tasks
        wait for its result, so none has committed since), its adapter made and written by the
        writer thread, which then removes the oldest beyond ``epoch_checkpoints``."""
        out = self._free_state_buffer()
        state, _ = self.trainer.committed_state(out)
        meta = {"step_number": entry.step + 1, "epoch": self._epochs_saved, "created_at": entry.wall_time,
                "train_loss": entry.loss, "tokens_trained": self.coserver.tokens_trained}
        self._write_state(state, self._write_epoch_checkpoint_of, state, meta)

    def _write_epoch_checkpoint_of(self, state: torch.Tensor, meta: dict[str, Any]) -> None:
        adapter = self.trainer.committed_adapter(base_model_name_or_path=str(self.engine.config.model), state=state)
        _write_epoch_checkpoint(adapter, meta, self.spec.output, self.spec.epoch_checkpoints)

    def _free_state_buffer(self) -> torch.Tensor | None:
        """The session's buffer where a copy of the trainer's state may go into it (None: copy
        elsewhere): no write reads it and no :meth:`_logged_state` is copying into it (one that
        takes in a step's result may log it, and the log may ask for a checkpoint)."""
        busy = self._state_copying or (self._state_read is not None and not self._state_read.done())
        return None if busy else self._state_buffer

    @property
    def checkpoint_dir(self) -> Path:
        return self.spec.output / "checkpoint"

    def save_checkpoint(self) -> Path:
        """Write the committed adapter, optimizer state and data cursor, atomically, in the
        background: the state is copied here (at an optimizer-step boundary, when the trainer's
        committed state and the pool's retired samples describe the same step: tens of ms at the
        8B shape), the files written by one writer thread (hundreds of MB: not on the engine's
        thread, whose steps would wait). :meth:`flush_checkpoints` (and :meth:`close`) waits for
        them. A failed write is logged; the last good checkpoint stays.

        The checkpoint counts exactly the steps in the train log: a step the trainer has committed
        but whose result the co-server has not taken in is taken in (and logged) first; else a
        resume would skip its log line and train its samples again (:meth:`_logged_state`)."""
        self._checkpoint(self._logged_state())
        return self.checkpoint_dir

    def _checkpoint(self, logged: tuple[torch.Tensor, int] | None, adapter: LoraAdapter | None = None) -> None:
        """Have the writer thread write the checkpoint of ``logged`` (:meth:`_logged_state`), whose
        adapter is ``adapter`` (None: the writer makes it from the state, off the engine's thread:
        25 ms at the 8B shape); an error logged where the state did not come in."""
        if logged is None:
            logger.error("optimizer step %d is committed but its result did not come in %.0fs: no checkpoint "
                         "written (the last one is kept)", self.trainer.committed_steps, COMMIT_RESULT_TIMEOUT_S)
            return
        state, steps = logged
        # (steps: applied, the optimizer's count; steps_done: logged, skipped ones too)
        saved = {"state": state, "steps": steps, "steps_done": self.coserver.steps_done,
                 "pool": copy.deepcopy(self.pool.state_dict()), "tokens_trained": self.coserver.tokens_trained,
                 "optim": asdict(self.optim), "run": self._run}
        self._write_state(state, self._write_checkpoint, adapter, saved)

    def _logged_state(self) -> tuple[torch.Tensor, int] | None:
        """A copy of the trainer's committed state whose steps the co-server has all taken in (and
        logged), or None if a committed step's result did not come in in time. The state is
        copied first and the results taken in up to its count after: a task already in flight
        (the last of an optimizer step, submitted before this thread asked) may commit at any
        moment, also between a check of the committed count and the copy (session 30, a job
        paused on the H100: a checkpoint one step ahead of its log, which its resume refused).
        A commit that lands while the results come in is copied again; the engine's thread, which
        submits the tasks, is this one, so the tasks in flight run out."""
        deadline = time.monotonic() + COMMIT_RESULT_TIMEOUT_S
        out = self._free_state_buffer()
        if out is not None:
            self._state_copying = True
        try:
            while True:
                state, steps = self.trainer.committed_state(out)
                if self.coserver.collect_committed(steps, max(0.0, deadline - time.monotonic())):
                    return state, steps
                if self.coserver.steps_applied < steps or time.monotonic() >= deadline:
                    return None
        finally:
            if out is not None:
                self._state_copying = False

    def _adapter_of(self, logged: tuple[torch.Tensor, int] | None) -> LoraAdapter:
        """The adapter of ``logged`` (:meth:`_logged_state`; the last committed one where None: a
        result did not come in)."""
        return self.trainer.committed_adapter(base_model_name_or_path=str(self.engine.config.model),
                                              state=None if logged is None else logged[0])

    def take_in_committed_step(self) -> bool:
        """Take in the result of the optimizer step the trainer has committed and the co-server
        not yet logged, if any; whether the committed state now counts the logged steps. (On the
        engine's thread, between two steps: no later step commits before this thread submits its
        last task, so the state copied next is that of the logged steps.)"""
        return self.coserver.collect_committed(self.trainer.committed_steps, COMMIT_RESULT_TIMEOUT_S)

    def _write_state(self, state: torch.Tensor, write: Callable[..., None], *args: Any) -> None:
        """:meth:`_in_background` for a write that reads ``state``, a copy of the trainer's: where
        that is the session's buffer, no copy goes into it again until the write is done."""
        future = self._in_background(write, *args)
        if state is self._state_buffer:
            self._state_read = future

    def _in_background(self, write: Callable[..., None], *args: Any) -> Future[None]:
        """``write(*args)`` on the writer thread, after the writes asked for before."""
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="coserve-checkpoint")
        future = self._writer.submit(write, *args)
        self._writes.append(future)
        return future

    def _write_checkpoint(self, adapter: LoraAdapter | None, saved: dict[str, Any]) -> None:
        try:
            if adapter is None:
                adapter = self.trainer.committed_adapter(base_model_name_or_path=str(self.engine.config.model),
                                                         state=saved["state"])
            tmp = self.spec.output / CHECKPOINT_TMP
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            save_peft_adapter(adapter, tmp / "adapter")
            torch.save(saved, tmp / "trainer_state.pt")
            final = self.checkpoint_dir
            old = self.spec.output / CHECKPOINT_ASIDE
            if final.exists():
                final.rename(old)
            tmp.rename(final)
            if old.exists():
                shutil.rmtree(old)
        except Exception:
            logger.exception("writing the checkpoint of optimizer step %d to %s failed; the last one is kept",
                             saved["steps"], self.checkpoint_dir)
            raise

    def flush_checkpoints(self) -> None:
        """Wait until the checkpoints and exports asked for are written (or have failed, as
        logged); any thread may call it."""
        for write in list(self._writes):
            with contextlib.suppress(Exception):
                write.result()
        with contextlib.suppress(IndexError):
            while self._writes[0].done():
                self._writes.popleft()

    def _remove_checkpoint(self) -> None:
        """Remove the checkpoint in OUTPUT (an earlier run's: a fresh run starts), with the copies
        a write leaves while it replaces one."""
        if self.checkpoint_dir.exists():
            logger.warning("%s holds the checkpoint of an earlier run: removed, as this run starts afresh "
                           "(--resume goes on from a checkpoint instead)", self.spec.output)
        for name in (self.checkpoint_dir.name, CHECKPOINT_ASIDE, CHECKPOINT_TMP):
            shutil.rmtree(self.spec.output / name, ignore_errors=True)

    def _read_checkpoint(self) -> dict[str, Any]:
        """The checkpoint to resume from (ValueError where there is none, or it is another run's:
        :mod:`coserve.server.run_identity`)."""
        path = self.checkpoint_dir / "trainer_state.pt"
        aside = self.spec.output / CHECKPOINT_ASIDE / "trainer_state.pt"
        if not path.is_file() and aside.is_file():
            path = aside  # (a crash between a checkpoint's two renames: the one before it)
        if not path.is_file():
            raise ValueError(f"--resume: no checkpoint at {self.checkpoint_dir / 'trainer_state.pt'}")
        ck = dict(torch.load(path, weights_only=True))
        saved = ck.get("run")
        if saved is None:  # (written before checkpoints recorded their run: not checked)
            logger.info("the checkpoint in %s does not record its run's settings: they are not checked",
                        self.checkpoint_dir)
            return ck
        differ = identity_differences(dict(saved), self._run)
        if differ:
            raise ValueError(f"--resume: the checkpoint in {self.checkpoint_dir} is of a run with other settings: "
                             f"{'; '.join(differ)}. Resume with the checkpoint's settings, or start a new run "
                             "(without --resume, or into another --output)")
        return ck

    def _resumed_total_steps(self, ck: dict[str, Any]) -> int:
        """The optimizer steps of the resumed run's learning-rate schedule: the checkpoint's run's,
        unless ``--epochs`` changed; then those of the new count (ValueError where the run has
        passed into an epoch beyond it)."""
        saved = int(ck["optim"]["total_steps"])
        pool = ck["pool"]
        was, now = int(pool["epochs"]), self.spec.coserve.epochs
        if now == was:
            return saved
        begun = -(-int(pool["cursor"]) // max(1, int(pool["num_samples"])))
        if now < begun:
            raise ValueError(f"--epochs {now}: the checkpoint in {self.checkpoint_dir} has trained into epoch "
                             f"{begun} of {was} already; resume with --epochs {begun} or more")
        total = self.spec.optim.total_steps or self.estimate_steps()
        logger.info("--epochs %d (the checkpoint's run: %d): the learning-rate schedule now spans %d optimizer "
                    "steps (it spanned %d)", now, was, total, saved)
        return total

    def _resume(self, ck: dict[str, Any], logged: list[dict[str, Any]]) -> None:
        """Go on from checkpoint ``ck``, the steps of the train log (``logged``) after it dropped."""
        steps = int(ck["steps"])  # (the trainer started from its state)
        self.pool.load_state_dict(ck["pool"])
        # (steps_done: the log's steps, skipped ones too; not in a checkpoint written before it was)
        done = int(ck.get("steps_done", steps))
        if done < steps:
            # (a checkpoint copied as a task in flight committed, before bc711ca: its state one
            # step ahead of its log and pool; the step's log line is lost, its samples train again)
            logger.warning("the checkpoint in %s holds %d applied optimizer steps but logs %d: going on from "
                           "step %d; the samples of the %d step(s) not logged are trained again",
                           self.checkpoint_dir, steps, done, steps, steps - done)
            done = steps
        entries = [e for e in logged if e["step"] < done]
        self._log_path.write_text("".join(entry_line(e) for e in entries))
        # (a run that was skipping steps when it stopped does not get a fresh max_skipped_steps)
        in_a_row = next((i for i, e in enumerate(reversed(entries)) if not e.get("skipped")), len(entries))
        self.coserver.resume(done, int(ck["tokens_trained"]), steps_skipped=done - steps,
                             skipped_in_a_row=min(in_a_row, done - steps))
        # (the run's first loss is its first step's, before the resume: what "loss a -> b" reports)
        self.coserver.first_loss = next((e["loss"] for e in entries if e.get("loss") is not None), None)
        # (the steps after the checkpoint are trained again: so are their epochs' ends)
        self._epochs_saved = self.pool.epoch
        _remove_epoch_checkpoints(self.spec.output, after_step=done)
        logger.info("resumed from %s at optimizer step %d", self.checkpoint_dir, done)

    @property
    def done(self) -> bool:
        return self.coserver.done

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` s for the trainer (when the engine has nothing else to do)."""
        self.coserver.poll(timeout)

    def export_in_background(self, checkpoint: bool = False) -> tuple[Path, LoraAdapter]:
        """:meth:`export` with the files written by the writer thread (a write of tens to hundreds
        of ms at the 8B shape, ``bench/adapter_export_cost.py``, that the engine's thread need not
        wait for): the committed adapter is copied here and returned, to be served from memory;
        :meth:`flush_checkpoints` (and :meth:`close`) waits for the files. ``checkpoint``: write
        one as well (a pause's; one is written anyway with ``save_every``)."""
        path = self.spec.output / "adapter"
        adapter = self._final_adapter(checkpoint)
        self._in_background(_write_adapter, adapter, path)
        return path, adapter

    def export(self, checkpoint: bool = False) -> Path:
        """Write the adapter of the logged steps to ``OUTPUT/adapter``; ``checkpoint``: their
        checkpoint as well (one is written anyway with ``save_every``), by the writer thread
        (:meth:`flush_checkpoints`, :meth:`close`)."""
        path = self.spec.output / "adapter"
        save_peft_adapter(self._final_adapter(checkpoint), path)
        return path

    def _final_adapter(self, checkpoint: bool) -> LoraAdapter:
        """The adapter of the logged steps, and where asked for (or with ``save_every``) their
        checkpoint, from ONE copy of the trainer's state: a copy costs the engine's thread tens of
        ms at the 8B shape (session 44's pause, with two: 0.37 s, and two requests over their
        SLO), and the two then hold the same step even where a task in flight commits between."""
        logged = self._logged_state()
        adapter = self._adapter_of(logged)
        if checkpoint or self.spec.save_every:
            self._checkpoint(logged, adapter)
        return adapter

    def detach(self) -> None:
        """Take the run off the engine (the engine's thread, between two steps): its steps carry
        no more FT rows and its training slot is free. The trainer process is left running."""
        if self.engine.coserver is self.coserver:
            self.engine.detach()

    def close(self) -> None:
        """:meth:`detach`, then stop the trainer process (it finishes its task first: up to a
        task's time, which need not be spent on the engine's thread) and wait for the
        checkpoints being written."""
        self.detach()
        try:
            self.coserver.close()
        finally:
            self.save_latency_state()
            self.flush_checkpoints()
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None

    def save_latency_state(self) -> None:
        """OUTPUT/latency_state.json: the latency model as the run leaves it, refitted, with its
        online part (windows, levels), so that ``--latency-state`` that file goes on from here
        rather than from the calibration. A failed write is logged, not raised."""
        path = self.spec.output / "latency_state.json"
        try:
            write_json(path, latency_state(self.engine, self.coserver.latency))
        except OSError as e:
            logger.warning("could not save the latency model to %s: %s", path, e)

    @property
    def tokens_per_second(self) -> float:
        return self.coserver.tokens_trained / max(1e-9, time.monotonic() - self.started)


def _model_name(engine: LLMEngine) -> str:
    """The engine's model: a preset's name, or a directory's resolved path."""
    model = str(engine.config.model)
    return str(Path(model).resolve()) if Path(model).exists() else model


def engine_fingerprint(engine: LLMEngine) -> dict[str, Any]:
    """What a latency model's coefficients hold only for: the model, its dtype, the device, whether
    prefill-carrying steps run through piecewise graphs, and the step's token budget. Saved in
    each latency state (:func:`latency_state`); a state for another is refused (:func:`load_latency_state`)."""
    device = engine.runner.device
    return {"model": _model_name(engine), "dtype": str(engine.runner.dtype).removeprefix("torch."),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            "prefill_graphs": engine.runner.prefill_graphs is not None,
            "max_num_batched_tokens": engine.config.max_num_batched_tokens}


def latency_state(engine: LLMEngine, model: LatencyModel) -> dict[str, Any]:
    """``model``'s :meth:`~coserve.core.latency.LatencyModel.state_dict` (its online part too) with
    ``"engine"``: the :func:`engine_fingerprint` it was measured on."""
    return {**model.state_dict(), "engine": engine_fingerprint(engine)}


def load_latency_state(path: Path, engine: LLMEngine, model: LatencyModel) -> None:
    """Load the latency state at ``path`` into ``model``. ``ValueError`` (naming ``path``) where it is
    unreadable or malformed, or was measured on another setup than ``engine``'s (its ``"engine"``
    differs from :func:`engine_fingerprint`: another model, dtype, GPU or step budget prices steps
    otherwise, and admission would trust those prices); a state without one (saved before session
    32) loads as it is."""
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict):
            raise ValueError("not a JSON object")
        saved, here = state.get("engine"), engine_fingerprint(engine)
        if saved is not None and saved != here:
            differ = ", ".join(f"{k} {saved.get(k)!r} (here {v!r})" for k, v in here.items() if saved.get(k) != v)
            raise ValueError(f"measured on another setup: {differ or repr(saved)}; calibrate again instead")
        model.load_state_dict(state)
    except (OSError, ValueError) as e:
        raise ValueError(f"latency state {path}: {e}") from e


def write_json(path: Path, value: object) -> None:
    """``value`` into ``path`` whole or not at all (a crash mid-write leaves the old file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


class FinetuneInterrupted(Exception):
    """:func:`run_to_completion` stopped by ``signum`` (SIGINT, SIGTERM) after ``steps_done``
    optimizer steps: their adapter exported to ``adapter``, their checkpoint written, the trainer
    stopped."""

    def __init__(self, signum: signal.Signals, adapter: Path, steps_done: int) -> None:
        super().__init__(f"stopped by {signum.name} after optimizer step {steps_done}")
        self.signum, self.adapter, self.steps_done = signum, adapter, steps_done


def run_to_completion(engine: LLMEngine, session: FinetuneSession, progress: bool = True) -> Path:
    """Drive FT-only steps until every epoch is trained; returns the exported adapter path.

    In the main thread, SIGINT (Ctrl-C) or SIGTERM stops the run at the next step boundary: the
    adapter of the logged steps exported and their checkpoint written, whatever ``save_every``
    (``--resume`` goes on from there), then :class:`FinetuneInterrupted` raised
    (:func:`coserve.server.interrupts.stop_requests`; a second signal raises at once)."""
    from tqdm import tqdm

    total = session.pool.progress.samples_total
    bar = tqdm(total=total, unit="sample", disable=not progress, desc="finetune")
    with stop_requests() as asked:
        try:
            while not session.done and not asked:
                if not engine.step() and not engine.has_unfinished_requests():
                    session.wait(0.05)
                done = session.pool.progress.samples_retired
                if done != bar.n:
                    bar.update(done - bar.n)
                    loss = session.coserver.last_loss
                    bar.set_postfix(loss=f"{loss:.4f}" if loss is not None else "-",
                                    tok_s=f"{session.tokens_per_second:.0f}", step=session.coserver.steps_done)
            bar.close()
            path = session.export(checkpoint=bool(asked))
            if asked:
                raise FinetuneInterrupted(asked[0], path, session.coserver.steps_done)
            return path
        finally:
            session.close()


CHECKPOINTS = "checkpoints"  # (in OUTPUT: the epoch checkpoints, step-K each)


def epoch_checkpoints(output: Path) -> list[dict[str, Any]]:
    """The epoch checkpoints written in ``output`` (each ``checkpoint.json``'s fields and its
    ``path``), newest first."""
    found = []
    for meta in (output / CHECKPOINTS).glob("step-*/checkpoint.json"):
        try:
            fields = dict(json.loads(meta.read_text()))
            found.append({**fields, "step_number": int(fields["step_number"]), "path": str(meta.parent)})
        except (OSError, ValueError, TypeError, KeyError):
            continue  # (being replaced, or not one)
    return sorted(found, key=lambda c: c["step_number"], reverse=True)


def _write_epoch_checkpoint(adapter: LoraAdapter, meta: dict[str, Any], output: Path, keep: int) -> None:
    root = output / CHECKPOINTS
    final = root / f"step-{meta['step_number']}"
    tmp = root / f".step-{meta['step_number']}.tmp"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        save_peft_adapter(adapter, tmp)
        (tmp / "checkpoint.json").write_text(json.dumps(meta))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in epoch_checkpoints(output)[keep:]:
            shutil.rmtree(old["path"], ignore_errors=True)
    except Exception:
        logger.exception("writing the epoch checkpoint of optimizer step %d to %s failed", meta["step_number"], final)
        raise


def _remove_epoch_checkpoints(output: Path, after_step: int) -> None:
    """Remove the epoch checkpoints of steps after ``after_step`` (a run that starts again there)."""
    for ck in epoch_checkpoints(output):
        if ck["step_number"] > after_step:
            shutil.rmtree(ck["path"], ignore_errors=True)


def _write_adapter(adapter: LoraAdapter, path: Path) -> None:
    try:
        save_peft_adapter(adapter, path)
    except Exception:
        logger.exception("writing the fine-tuned adapter to %s failed (it is served from memory)", path)
        raise


@dataclass(frozen=True)
class EvalResult:
    """Mean cross-entropy over an eval set's target tokens (``labels != -100`` after the first
    position, the loss the trainer minimizes), the share of those tokens the model ranks first
    (its argmax, as OpenAI's ``mean_token_accuracy``), and how many tokens and samples it covers."""

    loss: float
    tokens: int
    samples: int
    accuracy: float = float("nan")


# (one prefill per sample; ``1``: the top token beside the target's, for the accuracy)
EVAL_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)


def _scored(samples: Sequence[FTSample]) -> dict[str, FTSample]:
    """The samples with a target token, by request id."""
    return {f"eval-{s.sample_id}": s for s in samples if any(label != IGNORE_INDEX for label in s.labels[1:])}


class _Tally:
    """The running sums of :class:`EvalResult`."""

    def __init__(self) -> None:
        self.nll, self.tokens, self.correct = 0.0, 0, 0

    def add(self, s: FTSample, prompt_logprobs: Sequence[dict[int, float] | None] | None) -> None:
        """Score sample ``s`` from its request's ``prompt_logprobs`` (:data:`EVAL_PARAMS`)."""
        assert prompt_logprobs is not None
        for tid, label, entry in zip(s.input_ids[1:], s.labels[1:], prompt_logprobs[1:], strict=True):
            if label == IGNORE_INDEX:
                continue
            if label != tid:
                raise ValueError(f"eval sample {s.sample_id}: a label ({label}) that is not its token ({tid})")
            assert entry is not None
            self.nll -= entry[tid]
            self.tokens += 1
            self.correct += entry[tid] >= max(entry.values())

    def result(self, samples: int) -> EvalResult:
        if not self.tokens:
            return EvalResult(float("nan"), 0, samples)
        return EvalResult(self.nll / self.tokens, self.tokens, samples, self.correct / self.tokens)


def evaluate(engine: LLMEngine, samples: Sequence[FTSample], lora: LoRARequest | None = None) -> EvalResult:
    """The eval loss of ``engine``'s model with ``lora`` (None: the base model) on ``samples``:
    each sample's tokens scored in one prefill (``prompt_logprobs``), nothing trained. Runs the
    engine until they are done: call it while no fine-tuning is attached."""
    if engine.coserver is not None:
        raise RuntimeError("evaluate() needs an engine without a fine-tuning session attached")
    todo = _scored(samples)
    for rid, sample in todo.items():
        engine.add_request(rid, list(sample.input_ids), EVAL_PARAMS, lora)
    tally = _Tally()
    while todo:
        for out in engine.step():
            s = todo.pop(out.request_id, None) if out.finished else None
            if s is not None:
                tally.add(s, out.prompt_logprobs)
    return tally.result(len(samples))


async def evaluate_served(submit: Callable[..., Any], samples: Sequence[FTSample], lora: LoRARequest | None = None,
                          *, in_flight: int = 4, prefix: str = "") -> EvalResult:
    """:func:`evaluate` through a serving engine, beside its clients' requests:
    ``submit(tokens, params, lora, request_id)`` queues one (``EngineThread.submit``: its handle),
    at most ``in_flight`` at a time, so that a large set never queues ahead of the clients'
    requests all at once. Raises what a request raised (the engine gone, the adapter refused);
    after a failure no more are queued."""
    import asyncio

    todo = _scored(samples)
    tally = _Tally()
    gate = asyncio.Semaphore(in_flight)
    failed: list[BaseException] = []

    async def one(rid: str, s: FTSample) -> None:
        async with gate:
            if failed:
                return
            handle = submit(list(s.input_ids), EVAL_PARAMS, lora, prefix + rid)
            try:
                out = await handle.get()
                while not out.finished:
                    out = await handle.get()
                tally.add(s, out.prompt_logprobs)
            except BaseException as e:
                failed.append(e)
                raise

    await asyncio.gather(*(one(rid, s) for rid, s in todo.items()))
    return tally.result(len(samples))

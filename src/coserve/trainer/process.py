"""The engine-side handle of the trainer worker: start, feed, watch, restart, export."""

from __future__ import annotations

import logging
import os
import queue
import time
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from coserve.core.config import OptimConfig
from coserve.core.messages import BackwardTask, TaskResult, TrainerFailed
from coserve.cpu_split import split_for_trainer
from coserve.models.llama import LlamaForCausalLM
from coserve.models.peft_adapter import LoraAdapter, save_peft_adapter
from coserve.parent_watch import end_at_exit, signals_held
from coserve.trainer import spare
from coserve.trainer.lora_params import TrainableLoRA
from coserve.trainer.mps import mps_active, mps_share
from coserve.trainer.stream_gate import new_flag, read_progress, set_open
from coserve.trainer.worker import WorkerSpec, run_worker

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0
"""How long a new TrainerProcess waits for its worker's warm-up before going on."""
CPU_TRAINER_NICENESS = 10
"""How much lower the CPU scheduling priority of a trainer on the CPU is (``WorkerSpec.niceness``):
where the two share the cores, a step of the engine takes a core from a backward task, not the
other way round."""


class TrainerProcess:
    """Runs :func:`run_worker` in a spawned process that shares the model, the serving adapter
    slot, the activation store and the optimizer-state banks with this process (no copies).

    Implements ``coserve.core.coserver.TrainerClient``.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        store: torch.Tensor,
        scales: torch.Tensor,
        adapter: LoraAdapter,
        *,
        slot: int,
        optim: OptimConfig,
        dropout: float = 0.0,
        seed: int = 0,
        num_threads: int = 0,
        sm_share: int | None = None,
        mlp_store: torch.Tensor | None = None,
        below_normal: bool = False,
        warmup_rows: Sequence[int] = (),
        warmup_shapes: Sequence[Sequence[int]] = (),
        state: tuple[torch.Tensor, int] | None = None,
        keep_spare: bool = False,
    ) -> None:
        """``state``: a :meth:`committed_state` (a checkpoint's) the worker starts from, with its
        count of optimizer steps (nothing where 0), instead of ``adapter`` and fresh moments.

        Where :func:`coserve.trainer.spare.wanted`, a start takes the process's spare interpreter
        if one is held (its imports done: seconds less); ``keep_spare``: after each start, another
        spare is started for the next (a restart, or the server's next job)."""
        if sm_share is not None and not 0 < sm_share <= 100:
            raise ValueError(f"--trainer-sm-share must be in (0, 100], got {sm_share}")
        device = store.device
        # (the layout of the adapter's flat vector; its own flat is the initial adapter, never written)
        self._layout = TrainableLoRA(adapter, dropout=dropout, seed=seed, device="cpu")
        numel = self._layout.flat.numel()
        self.banks = torch.zeros(2, 3, numel, dtype=torch.float32, device=device)
        self.meta = torch.tensor([-1, 0, 0], dtype=torch.int64)
        if device.type == "cpu":
            self.banks.share_memory_()
        self.meta.share_memory_()
        if state is not None and state[1] and state[0].shape != self.banks.shape[1:]:
            raise ValueError(f"the checkpoint's trainer state holds {state[0].shape[-1]} values per row, this "
                             f"adapter {numel}: resume with the LoRA settings it was trained with (rank, targets)")
        if state is not None and state[1]:  # (a checkpoint before the first commit: no state)
            # (in the bank before the worker starts, which imports it: one start, not a start and a
            # restart, which cost a resume ~6 s on session 44's H100)
            self.banks[0].copy_(state[0])
            self.meta[1] = state[1]
            self.meta[0] = 0
        self.model = model
        self.scales = scales
        # Under MPS: the share of SMs the trainer's kernels may occupy (None: no limit).
        self.sm_share = sm_share
        # Under MPS: start as a below-normal-priority client (beside an engine on a high-priority
        # stream, EngineConfig.stream_priority).
        self.below_normal = below_normal
        self._ctx = mp.get_context("spawn")
        self._spares = spare.wanted(device)
        self._keep_spare = keep_spare and self._spares
        # On CUDA the worker's GPU stream pauses itself on this flag (stream_gate); the grant
        # is what its CPU waits on when that is not possible (or with COSERVE_GPU_GATE=0).
        use_gate = device.type == "cuda" and os.environ.get("COSERVE_GPU_GATE", "1") == "1"
        self.gate_flag = new_flag() if use_gate else None
        # (with a warm-up: set by the worker once it is done, so that the engine's calibration,
        # which follows, times its batches with the GPU to itself)
        self._wants_ready = bool(warmup_rows or warmup_shapes)
        self._ready: Any = None
        self.spec = WorkerSpec(model, store, scales, self.banks, self.meta, adapter, slot, dropout, seed,
                               optim, num_threads=num_threads, mlp_store=mlp_store,
                               gate_flag=self.gate_flag, warmup_rows=tuple(warmup_rows),
                               warmup_shapes=tuple(tuple(rows) for rows in warmup_shapes),
                               niceness=CPU_TRAINER_NICENESS if device.type == "cpu" else 0,
                               cpus=split_for_trainer(), stages=torch.zeros(3, dtype=torch.float64).share_memory_())
        self._started_at = 0.0
        self._proc: BaseProcess | None = None
        if device.type == "cuda" and not mps_active():
            logger.warning("CUDA MPS daemon not running: the trainer's kernels time-slice with the engine's "
                           "(start it with `nvidia-cuda-mps-control -d` before the engine starts)")
        self._write_serving()
        self._start()
        self._wait_ready()

    # ------------------------------------------------------------------ TrainerClient

    def submit(self, task: BackwardTask) -> None:
        self._tasks.put(task)

    def poll(self, timeout: float = 0.0) -> list[TaskResult]:
        out: list[TaskResult] = []
        block = timeout > 0
        while True:
            try:
                msg = self._results.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return out
            block = False
            if isinstance(msg, TrainerFailed):
                logger.error("trainer failed on task %s:\n%s", msg.task_id, msg.error)
                continue
            out.append(msg)

    def pause(self) -> None:
        """Close the gate and clear the grant flag: the worker stops at its next layer boundary
        (on its GPU stream, or on its CPU without the gate)."""
        if self.gate_flag is not None:
            set_open(self.gate_flag, False)
        self.grant.clear()

    def resume(self) -> None:
        if self.gate_flag is not None:
            set_open(self.gate_flag, True)
        self.grant.set()

    @property
    def reports_progress(self) -> bool:
        """Whether :meth:`progress` reads the worker's GPU (the GPU-side gate is in use)."""
        return self.gate_flag is not None

    def progress(self) -> tuple[int, int] | None:
        """The boundary ``(layer, ordinal)`` the worker's GPU stream passed last (so: what its
        kernels run now), None between tasks or without the GPU-side gate."""
        return read_progress(self.gate_flag) if self.gate_flag is not None else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def restart(self) -> int:
        self._check_spare_start()
        self._stop(kill=True)
        self._write_serving()
        # A restarted worker warms up while the engine serves, beside steps priced as if no task
        # ran: its one task as before, not the shapes' (warmup_shapes: some thirty more).
        self.spec.warmup_shapes = ()
        self._start()
        return self.committed_steps

    def close(self) -> None:
        self._stop(kill=False)

    # ------------------------------------------------------------------ state

    @property
    def committed_steps(self) -> int:
        bank = int(self.meta[0])
        return int(self.meta[1 + bank]) if bank >= 0 else 0

    def committed_adapter(self, base_model_name_or_path: str | None = None,
                          state: torch.Tensor | None = None) -> LoraAdapter:
        """The adapter after the last committed optimizer step (the initial one before any), or
        that of ``state``, a :meth:`committed_state` copy (its master row; the initial adapter
        where it is empty, a copy taken before any commit), read in place: any thread may ask."""
        if state is not None:
            return self._layout.to_adapter(base_model_name_or_path, flat=state[0] if state.numel() else None)
        bank = int(self.meta[0])
        if bank >= 0:
            return self._layout.to_adapter(base_model_name_or_path, flat=self.banks[bank, 0].cpu())
        return self._layout.to_adapter(base_model_name_or_path)

    def export(self, path: str | Path, base_model_name_or_path: str | None = None) -> None:
        """Write the committed adapter as a PEFT directory (atomically)."""
        save_peft_adapter(self.committed_adapter(base_model_name_or_path), path)

    def committed_state(self, out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """``([3, P] master + AdamW moments on CPU, optimizer steps)`` of the last commit, copied
        once: into ``out`` where given (a CPU tensor of that shape whose pages are in place: a
        fresh copy of hundreds of MB at the 8B shape spends most of its time faulting them in),
        else into a new tensor."""
        bank = int(self.meta[0])
        if bank < 0:
            return torch.empty(0), 0
        steps = int(self.meta[1 + bank])
        if out is None:
            return self.banks[bank].to("cpu", copy=True), steps
        return out.copy_(self.banks[bank]), steps

    def state_buffer(self) -> torch.Tensor:
        """A CPU tensor the shape of :meth:`committed_state`'s, its pages faulted in (zeros);
        pinned where the banks are on a GPU (a copy into it 3.0 ms at the 8B shape on session 44's
        H100, 11.8 ms into pageable memory: ``bench/state_copy_cost.py``)."""
        if self.banks.is_cuda:
            try:
                return torch.zeros(self.banks.shape[1:], dtype=self.banks.dtype, pin_memory=True)
            except RuntimeError as e:  # (a host that cannot pin this much: the slower copy, not a failure)
                logger.warning("no pinned memory for the trainer's state copies (%s): pageable memory instead", e)
        return torch.zeros(self.banks.shape[1:], dtype=self.banks.dtype)

    # ------------------------------------------------------------------ process

    def _write_serving(self) -> None:
        """Make the serving slot equal the committed master (or the initial adapter)."""
        layout = TrainableLoRA(self.committed_adapter(), device=self.banks.device)
        layout.write_serving(self.model.lora_stacks, self.spec.slot, self.scales)

    def _wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait for the first worker's warm-up (not a restarted one's: the engine serves then)."""
        if self._ready is None:
            return
        deadline = time.monotonic() + (READY_TIMEOUT_S if timeout_s is None else timeout_s)
        while not self._ready.wait(0.5):
            if not self.alive():
                logger.warning("the trainer process ended during its start-up")
                self._check_spare_start()
                return
            if time.monotonic() > deadline:
                logger.warning("the trainer's warm-up is still running; going on without waiting for it")
                return

    @property
    def from_spare(self) -> bool:
        """Whether the worker's process was a spare interpreter (:mod:`coserve.trainer.spare`)."""
        return self._from_spare

    def _check_spare_start(self) -> None:
        """A worker from a spare that ended before its entry point ran (the hand-over failed: the
        spec's tensors, the CUDA context) turns spares off, so that the restart spawns afresh."""
        if self._from_spare and not self.alive() and self.spec.stages is not None and float(self.spec.stages[0]) <= 0:
            spare.HELD.disable(f"a trainer started from one (pid {self.pid}) ended before its worker ran")

    def start_stages(self) -> dict[str, float]:
        """Seconds of the last start's stages so far: ``process`` (until the worker's entry point
        ran: a new interpreter, its imports, the shared model's tensors opened), ``build`` (its
        worker built) and ``warm_up``; a stage not reached is left out."""
        out: dict[str, float] = {}
        stages = self.spec.stages
        if stages is None:
            return out
        before = self._started_at
        for name, at in zip(("process", "build", "warm_up"), stages.tolist(), strict=True):
            if at <= 0:
                break
            out[name] = max(0.0, at - before)
            before = at
        return out

    def _start(self) -> None:
        if self.spec.stages is not None:
            self.spec.stages.zero_()
        self._started_at = time.time()
        held = spare.HELD.take() if self._spares else None
        with mps_share(self.sm_share, self.below_normal):
            if held is not None:
                try:
                    held.hand_over(self.spec, wait_ready=self._wants_ready)
                except Exception:  # (a spec that does not pickle fails the spawn below as well, and says so)
                    logger.exception("could not hand the trainer to the spare interpreter: a fresh one starts")
                    held.close()
                    held = None
            self._from_spare = held is not None
            if held is not None:
                self._proc, self._tasks, self._results, self.grant = held.proc, held.tasks, held.results, held.grant
                self._ready = held.ready if self._wants_ready else None
            else:
                self.grant = self._ctx.Event()
                self.grant.set()
                self._ready = self._ctx.Event() if self._wants_ready else None
                self.spec.grant, self.spec.ready = self.grant, self._ready
                self._tasks = self._ctx.Queue()
                self._results = self._ctx.Queue()
                self._proc = self._ctx.Process(
                    target=run_worker, args=(self.spec, self._tasks, self._results), daemon=True,
                    name="coserve-trainer",
                )
                with signals_held():
                    self._proc.start()
                end_at_exit(self._proc)
        if self._keep_spare:
            spare.HELD.prepare(self._ctx)

    def _stop(self, kill: bool) -> None:
        proc = self._proc
        if proc is None:
            return
        self.resume()  # a worker stopped at a boundary must get to the end of its task
        if proc.is_alive() and not kill:
            self._tasks.put(None)
            proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
        self._proc = None
        for q in (self._tasks, self._results):
            q.close()
            q.cancel_join_thread()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

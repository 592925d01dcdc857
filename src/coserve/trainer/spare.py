"""A spare trainer interpreter: a process started ahead of need that has imported what a trainer
worker runs and waits to be handed its :class:`~coserve.trainer.worker.WorkerSpec`.

A trainer's start on session 45's H100 host took 17.6–21.1 s: ``process`` 5.6–5.7 s (a new
interpreter; ``import torch`` alone 3.9–4.3 s there), ``build`` 4.2–6.2 s (mostly what the first
``torch.optim.AdamW`` imports: :func:`coserve.trainer.optim.import_ahead`) and ``warm-up`` 7.0–9.1 s
(``bench/results/latency_h100/session45/``). A spare has done the imports already, so a start that
takes one (a job's, a resume's, a restart after a failure) pays for the model's CUDA handles and
the warm-up alone: at the 8B shape on an H100, process + build 7.2–9.3 s spawned against
0.27–0.35 s from a spare (``bench/spare_start.py``, ``session45/spare_start_7895f01*.json``).

Nothing CUDA happens in a spare before the hand-over: the environment the trainer's CUDA context
reads (its MPS share and priority, :func:`coserve.trainer.mps.mps_share`) is applied first, then the
spec (whose tensors open the context) is read. A spare is used only where its imports read the same
environment a fresh interpreter would now (:data:`IMPORT_ENV_PREFIXES`); else it is closed and the
trainer spawned as before. It ends with the process that started it (daemonic, and it watches its
parent's sentinel: :func:`coserve.parent_watch.exit_with_parent`).

``COSERVE_TRAINER_SPARE``: ``auto`` (default: on where the trainer runs on a GPU, whose start is the
slow one), ``1`` (also on the CPU), ``0`` (never)."""

from __future__ import annotations

import copy
import logging
import os
import pickle
import threading
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from coserve.parent_watch import (
    end_at_exit,
    exit_with_parent,
    leave_signals_to_parent,
    signals_held,
)
from coserve.trainer.mps import MPS_PRIORITY_ENV, MPS_SHARE_ENV

logger = logging.getLogger(__name__)

SPARE_ENV = "COSERVE_TRAINER_SPARE"
IMPORT_ENV_PREFIXES = ("COSERVE_", "CUDA_", "PYTORCH_", "TORCH", "TRITON_", "OMP_", "MKL_", "NVIDIA_", "LD_",
                       "PYTHON")
"""The environment variables a spare's imports may have read (coserve's switches are read at import,
torch's and Triton's at import or first use): they must be the same at the hand-over as when the
spare started, or it is not used."""
HANDOVER_ENV = (MPS_SHARE_ENV, MPS_PRIORITY_ENV)
"""Set (or unset) in the spare at the hand-over, before its CUDA context exists: what
:func:`~coserve.trainer.mps.mps_share` sets around a trainer's start."""
IMPORT_TIMEOUT_S = 300.0
"""How long the parent's watch waits for a spare's imports before it says they have not finished."""


def wanted(device: torch.device) -> bool:
    """Whether trainers on ``device`` start from spares (``COSERVE_TRAINER_SPARE``)."""
    mode = os.environ.get(SPARE_ENV, "auto")
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"{SPARE_ENV}={mode!r}: expected auto, 0 or 1")
    return mode == "1" or (mode == "auto" and device.type == "cuda")


def _import_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k.startswith(IMPORT_ENV_PREFIXES) and k not in HANDOVER_ENV and k != SPARE_ENV}


class Spare:
    """One spare interpreter and what a trainer process talks to it through (created with it: a
    multiprocessing queue or event passes to a process only as it starts)."""

    def __init__(self, ctx: Any) -> None:
        self.tasks = ctx.Queue()
        self.results = ctx.Queue()
        self.grant = ctx.Event()
        self.grant.set()
        self.ready = ctx.Event()
        # (when its imports were done, time.time(), 0 before; a shared word, not an event: a
        # multiprocessing event's set() waits for every waiter to wake, and a parent killed while it
        # waited never does)
        self.imported = ctx.RawValue("d", 0.0)
        self._setup = ctx.Queue()
        self._env = _import_env()
        self._handed_over = False
        self.proc = ctx.Process(target=spare_main, args=(self._setup, self.tasks, self.results, self.grant,
                                                         self.ready, self.imported),
                                daemon=True, name="coserve-trainer-spare")
        began = time.time()
        with signals_held():
            self.proc.start()
        end_at_exit(self.proc)
        logger.info("started a spare trainer interpreter (pid %s)", self.proc.pid)
        threading.Thread(target=self._report, args=(began,), name="coserve-spare-watch", daemon=True).start()

    def _report(self, began: float) -> None:
        """Log when its imports are done (what they took on this host, its interpreter's start
        included), or that it ended first."""
        while self.imported.value <= 0:
            if not self.proc.is_alive() or time.time() - began > IMPORT_TIMEOUT_S:
                if not self._handed_over:
                    logger.warning("the spare trainer interpreter (pid %s) did not finish its imports: %s",
                                   self.proc.pid, "it ended" if not self.proc.is_alive() else "still importing")
                return
            time.sleep(0.2)
        logger.info("spare trainer interpreter ready: its imports took %.1f s", self.imported.value - began)

    def usable(self) -> bool:
        """Alive, and started in the import environment of now."""
        return self.proc.is_alive() and self._env == _import_env()

    def hand_over(self, spec: Any, *, wait_ready: bool) -> None:
        """Make the spare the worker of ``spec`` (its ``grant`` and ``ready`` replaced by the
        spare's: ``ready`` only where ``wait_ready``). Pickled here, so that a spec that cannot be
        sent fails in the caller, not in a queue's feeder thread."""
        sent = copy.copy(spec)
        sent.grant = sent.ready = None
        payload = bytes(ForkingPickler.dumps(sent))
        self._setup.put(({k: os.environ.get(k) for k in HANDOVER_ENV}, wait_ready))
        self._setup.put(payload)
        self._setup.close()  # (its feeder thread sends both and ends; nothing more goes this way)
        self._handed_over = True

    def close(self) -> None:
        """End a spare not handed over (one handed over is its trainer's to stop)."""
        if self._handed_over:
            return
        if self.proc.is_alive():  # (killed: it holds nothing, and it may still be importing, deaf to a message)
            self.proc.kill()
            self.proc.join(timeout=5)
        for q in (self._setup, self.tasks, self.results):
            q.close()
            q.cancel_join_thread()


def spare_main(setup: Any, tasks: Any, results: Any, grant: Any, ready: Any, imported: Any = None) -> None:
    """A spare's entry point: the imports, then a spec to run."""
    leave_signals_to_parent()  # (started with them held: a Ctrl-C is the parent's to handle)
    exit_with_parent()  # (also while it imports and waits: a killed server leaves no spare behind)
    from coserve.trainer.optim import import_ahead
    from coserve.trainer.worker import run_worker

    import_ahead()
    if imported is not None:
        imported.value = time.time()
    env, wait_ready = setup.get()
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    spec = pickle.loads(setup.get())  # (the model's CUDA tensors open the context: after the env)
    spec.grant = grant
    spec.ready = ready if wait_ready else None
    run_worker(spec, tasks, results)


class _Held:
    """The process's spare (one at most), refilled in the background."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spare: Spare | None = None
        self.disabled: str | None = None  # (why spares are off for the rest of this process: :meth:`disable`)

    def disable(self, reason: str) -> None:
        """No more spares in this process (a trainer started from one died before its worker ran:
        the next starts spawn as before, whatever went wrong in the hand-over)."""
        if self.disabled is None:
            logger.warning("spare trainer interpreters off for this process: %s", reason)
            self.disabled = reason
        self.discard()

    def take(self) -> Spare | None:
        """The held spare where it is usable (it is no longer held), else None (an unusable one
        is closed)."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is None:
            return None
        if self.disabled is None:
            if spare.usable():
                return spare
            logger.info("the spare trainer interpreter is not used (%s): a fresh one starts",
                        "it ended" if not spare.proc.is_alive() else "the environment changed since it started")
        spare.close()
        return None

    def prepare(self, ctx: Any) -> None:
        """Start a spare unless one is held (the caller's thread pays only for the spawn)."""
        with self._lock:
            if self._spare is None and self.disabled is None:
                self._spare = Spare(ctx)

    def discard(self) -> None:
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            spare.close()


HELD = _Held()
"""This process's spare."""


def prepare_for(device: torch.device) -> None:
    """Start this process's spare now where trainers on ``device`` want one (a server that takes
    fine-tuning jobs, at start-up: its first job's trainer finds the imports done)."""
    if wanted(device):
        HELD.prepare(torch.multiprocessing.get_context("spawn"))

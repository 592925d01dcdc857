"""The split baseline's trainer: its own fine-tuning loop beside inference, all the time.

Unlike the co-serving trainer (which differentiates activations the engine captured inside its
batches), this process runs the whole training step itself: a forward pass of its own samples
through the engine's base weights (mapped, not copied: shared memory on CPU, CUDA IPC on GPU)
with autograd on the LoRA parameters, the backward pass, AdamW. The engine serves inference
with no co-serving meanwhile; the two share the GPU only through the driver's scheduling or,
with CUDA MPS, through a fixed share of the SMs (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``).
"""

from __future__ import annotations

import logging
import os
import queue
import random
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from coserve.core.config import OptimConfig, SkippedSteps
from coserve.core.finetune import FTSample
from coserve.core.messages import TrainerFailed
from coserve.gc_freeze import freeze_startup_objects
from coserve.layers.attention import AttentionMetadata
from coserve.models.llama import ForwardContext, LlamaForCausalLM
from coserve.models.peft_adapter import LoraAdapter
from coserve.trainer.backward import IGNORE_INDEX, TaskLoss
from coserve.trainer.lora_params import TrainableLoRA
from coserve.trainer.mps import mps_active, mps_share
from coserve.trainer.optim import LoRAOptimizer

logger = logging.getLogger(__name__)


def tensor_sums(model: torch.nn.Module) -> dict[str, float]:
    """``name -> fp64 sum`` of every parameter and buffer of ``model`` (NaN where any element is
    not finite) but the adapter-slot stacks (``lora_a_all``/``lora_b_all``, which the engine may
    rewrite while it serves and the split worker never reads): what the split worker compares its
    mapped view of the engine's weights with."""
    with torch.no_grad():
        tensors = {name: t for name, t in (*model.named_parameters(), *model.named_buffers())
                   if not name.endswith(("lora_a_all", "lora_b_all"))}
        sums = torch.stack([t.detach().double().sum() for t in tensors.values()])  # (one sync)
        return dict(zip(tensors, sums.cpu().tolist(), strict=True))


def weight_faults(model: torch.nn.Module, expected: dict[str, float] | None) -> list[str]:
    """Parameters and buffers of ``model`` whose sum is not finite or differs from ``expected``
    (the producer's :func:`tensor_sums`; relative 1e-6): an empty list when the mapped weights are
    the engine's."""
    faults = []
    for name, total in tensor_sums(model).items():
        want = None if expected is None else expected.get(name)
        if total != total or abs(total) == float("inf"):
            faults.append(f"{name} not finite")
        elif want is not None and abs(total - want) > 1e-6 * max(1.0, abs(want)):
            faults.append(f"{name} sum {total:.6g}, the engine's {want:.6g}")
    return faults


class FirstNonFiniteOp(TorchDispatchMode):
    """Under this mode :attr:`report` names the first aten op whose floating-point output held a
    non-finite value, with its input shapes; where an input was already non-finite, the op that
    made that input (an ``empty`` one: a kernel outside aten wrote it, or left part unwritten).
    Allocation ops (``empty*``, whose output is uninitialized by design) are never the culprit,
    nor are view ops (they write nothing; autograd splits a fresh ``empty`` buffer into the views
    it then fills, so their input may hold garbage): a view's producer is its base's."""

    _ALLOCATORS = frozenset({"empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided"})
    _VIEWS = frozenset({"split", "split_with_sizes", "chunk", "unbind", "narrow", "slice", "select", "view",
                        "_unsafe_view", "as_strided", "t", "transpose", "permute", "unsqueeze", "squeeze",
                        "expand", "alias", "detach", "diagonal", "unfold"})

    def __init__(self) -> None:
        super().__init__()
        self.report: str | None = None
        self._made_by: dict[int, str] = {}

    @staticmethod
    def _floats(tree: Any) -> list[torch.Tensor]:
        return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if self.report is not None:
            return out
        name = str(func.overloadpacket.__name__)
        outs = self._floats(out)
        if name in self._VIEWS:
            ins = self._floats((args, kwargs))
            base = self._made_by.get(ins[0].data_ptr(), name) if ins else name
            for t in outs:
                self._made_by[t.data_ptr()] = base
            return out
        if name not in self._ALLOCATORS and any(not bool(t.isfinite().all()) for t in outs):
            ins = self._floats((args, kwargs))
            bad = [t for t in ins if not bool(t.isfinite().all())]
            self.report = f"aten.{name} on {[tuple(t.shape) for t in ins]}" + (
                f" (an input already non-finite, made by aten.{self._made_by.get(bad[0].data_ptr(), '?')})"
                if bad else " (inputs finite)")
        for t in outs:
            self._made_by[t.data_ptr()] = name
        return out


def rerun_nonfinite(model: LlamaForCausalLM, lora: TrainableLoRA, batch: Sequence[FTSample]) -> str:
    """Run ``batch``'s step again (its gradient discarded) and say where it went non-finite: the
    loss of the rerun, the first layer whose input held a non-finite value (the number of layers:
    the final norm's input; None: every layer input finite) and the first op
    (:class:`FirstNonFiniteOp`)."""
    first: list[int] = []

    def check(i: int, hidden: torch.Tensor) -> None:
        if not first and not bool(hidden.isfinite().all()):
            first.append(i)

    op = FirstNonFiniteOp()
    try:
        with op:
            loss = train_step(model, lora, batch, layer_hook=check).loss_sum
    finally:
        if lora.flat.grad is not None:
            lora.flat.grad.zero_()
    lens = [s.num_tokens for s in batch]
    return (f"rerun loss {loss}, first non-finite layer input {first[0] if first else None}, first non-finite "
            f"op {op.report}; rows {len(lens)}, {sum(lens)} tokens, longest {max(lens, default=0)}")


def split_batches(
    samples: Sequence[FTSample], backward_tokens: int, seed: int
) -> Iterator[list[FTSample]]:
    """Endless optimizer-step batches: epoch after epoch, the samples in an order shuffled by
    ``(seed, epoch)``; a batch closes at the first sample that brings it to ``backward_tokens``
    tokens (the rule of the co-serving trainer's backward tasks), so one batch holds at most
    ``backward_tokens - 1 + longest sample`` tokens."""
    if not samples:
        raise ValueError("the split trainer needs at least one sample")
    epoch = 0
    batch: list[FTSample] = []
    tokens = 0
    while True:
        order = list(range(len(samples)))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        for i in order:
            batch.append(samples[i])
            tokens += samples[i].num_tokens
            if tokens >= backward_tokens:
                yield batch
                batch, tokens = [], 0
        epoch += 1


def train_step(
    model: LlamaForCausalLM,
    lora: TrainableLoRA,
    batch: Sequence[FTSample],
    *,
    dropout_key: int | None = None,
    layer_hook: Callable[[int, torch.Tensor], None] | None = None,
) -> TaskLoss:
    """Accumulate ``∂loss/∂flat`` into ``lora.flat.grad`` by a full autograd forward and backward.

    The samples run back to back as one flat batch, each causal within itself from position 0
    with no KV cache, every token on ``lora`` (``lora.context(dropout_key, row_lens)``).
    ``loss = Σ_rows Σ_t CE(logits[t], labels[t + 1])`` over targets ``!= -100``, fp32
    cross-entropy, NOT normalized: the quantity that
    :func:`~coserve.trainer.backward.task_backward` computes from captured activations. The
    model is frozen and never modified. ``layer_hook(i, hidden)``: the model's
    :attr:`ForwardContext.layer_hook` (layer ``i``'s input; ``i == num_layers``: the final norm's).
    """
    device = lora.flat.device
    row_lens = [s.num_tokens for s in batch]
    ids = torch.tensor([t for s in batch for t in s.input_ids], dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(n) for n in row_lens]).to(device)
    targets = torch.tensor(
        [t for s in batch for t in (*s.labels[1:], IGNORE_INDEX)], dtype=torch.int64, device=device
    )
    picked = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    if picked.numel() == 0:
        return TaskLoss(0.0, 0)
    meta = AttentionMetadata.build(
        q_lens=row_lens,
        context_lens=[0] * len(batch),
        block_tables=[[] for _ in batch],
        writes_kv=[False] * len(batch),
        num_prefill_rows=len(batch),
        block_size=1,
        device=device,
    )
    ctx = ForwardContext(
        attn=meta, kv_cache=None, lora=lora.context(dropout_key, row_lens), layer_hook=layer_hook
    )
    with torch.enable_grad():
        hidden = model(ids, positions, ctx)
        logits = model.compute_logits(hidden[picked])
        loss = F.cross_entropy(logits.float(), targets[picked], reduction="sum")
        loss.backward()
    return TaskLoss(float(loss.detach()), int(picked.numel()))


@dataclass
class SplitSpec:
    """What the split worker process receives. ``flat`` ``[P]`` fp32 (the master weights after the
    last optimizer step), ``counters`` ``[2]`` int64 (tokens of completed optimizer steps, optimizer
    steps) and ``loss`` ``[1]`` float64 (mean loss of the last step) are shared with the parent;
    ``stop`` (an Event) ends the loop at the next step boundary."""

    model: LlamaForCausalLM
    adapter: LoraAdapter
    samples: tuple[FTSample, ...]
    backward_tokens: int
    optim: OptimConfig
    dropout: float
    seed: int
    num_threads: int
    flat: torch.Tensor
    counters: torch.Tensor
    loss: torch.Tensor
    stop: Any
    device: str
    # the engine's tensor_sums(model) when the worker started: checked once a step goes non-finite
    weight_sums: dict[str, float] | None = None


def run_split_worker(spec: SplitSpec, errors: Any) -> None:
    """Process entry point: train until ``spec.stop`` is set."""
    logging.basicConfig(level=os.environ.get("COSERVE_TRAINER_LOG", "WARNING"))
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    try:
        lora = TrainableLoRA(spec.adapter, dropout=spec.dropout, seed=spec.seed, device=spec.device)
        optim = LoRAOptimizer(lora, spec.optim)
        batches = split_batches(spec.samples, spec.backward_tokens, spec.seed)
        freeze_startup_objects("split trainer")
        task, skipped, faults = 0, SkippedSteps(), []
        while not spec.stop.is_set():
            # one optimizer step: `accumulation_tasks` batches, like the co-serving trainer's tasks
            loss_sum, targets, tokens = 0.0, 0, 0
            for _ in range(spec.optim.accumulation_tasks):
                batch = next(batches)
                result = train_step(spec.model, lora, batch, dropout_key=task)
                task += 1
                loss_sum += result.loss_sum
                targets += result.num_targets
                tokens += sum(s.num_tokens for s in batch)
            info = optim.step(targets, loss_sum)
            if info.skipped and skipped.count == 0:
                # the first non-finite step of a streak: is the mapped view of the weights intact?
                faults = weight_faults(spec.model, spec.weight_sums)
                logger.warning(
                    "split trainer: non-finite step (loss %s over %d targets); weights as the "
                    "engine's: %s; %s",
                    loss_sum,
                    targets,
                    "yes" if not faults else f"NO ({len(faults)}): " + "; ".join(faults[:8]),
                    rerun_nonfinite(spec.model, lora, batch),
                )
            stop = skipped.record(
                info.skipped, spec.optim.max_skipped_steps, loss_sum / max(1, targets)
            )
            if stop is not None:
                if faults:  # (as checked at the streak's first step)
                    stop += f". The worker's view of the engine's weights differs: {'; '.join(faults[:8])}"
                raise RuntimeError(stop)
            if info.skipped:
                continue
            with torch.no_grad():
                spec.flat.copy_(lora.flat)
            if spec.flat.is_cuda:
                torch.cuda.synchronize(spec.flat.device)
            spec.loss[0] = loss_sum / max(1, targets)
            spec.counters[0] += tokens
            spec.counters[1] += 1
    except Exception:
        errors.put(TrainerFailed(None, traceback.format_exc()))
        raise


class SplitTrainer:
    """Starts :func:`run_split_worker` in a spawned process over the engine's ``model``.

    ``mps_percentage``: on CUDA with an MPS daemon running, the worker's share of the SMs
    (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``); ignored otherwise (see :attr:`mps_share`).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        adapter: LoraAdapter,
        samples: Sequence[FTSample],
        *,
        backward_tokens: int,
        optim: OptimConfig,
        dropout: float = 0.0,
        seed: int = 0,
        num_threads: int = 0,
        mps_percentage: int | None = None,
    ) -> None:
        if backward_tokens <= 0:
            raise ValueError(f"backward_tokens must be positive, got {backward_tokens}")
        if mps_percentage is not None and not 0 < mps_percentage <= 100:
            raise ValueError(f"--split-mps-percentage must be in (0, 100], got {mps_percentage}")
        device = model.lm_head_weight.device
        self._initial = TrainableLoRA(adapter, device="cpu")
        self.flat = self._initial.flat.detach().clone().to(device)
        self.counters = torch.zeros(2, dtype=torch.int64)
        self.loss = torch.full((1,), float("nan"), dtype=torch.float64)
        for t in (self.counters, self.loss) + ((self.flat,) if device.type == "cpu" else ()):
            t.share_memory_()
        self.mps_share = mps_percentage if device.type == "cuda" and mps_active() else None
        ctx = mp.get_context("spawn")
        self._stop = ctx.Event()
        self._errors = ctx.Queue()
        spec = SplitSpec(
            model,
            adapter,
            tuple(samples),
            backward_tokens,
            optim,
            dropout,
            seed,
            num_threads,
            self.flat,
            self.counters,
            self.loss,
            self._stop,
            str(device),
            tensor_sums(model),
        )
        self.exitcode: int | None = None
        self._proc: BaseProcess | None = ctx.Process(
            target=run_split_worker,
            args=(spec, self._errors),
            daemon=True,
            name="coserve-split-trainer",
        )
        with mps_share(self.mps_share):
            self._proc.start()

    @property
    def tokens_trained(self) -> int:
        """Tokens of the samples of completed optimizer steps."""
        return int(self.counters[0])

    @property
    def steps_done(self) -> int:
        return int(self.counters[1])

    @property
    def last_loss(self) -> float | None:
        loss = float(self.loss[0])
        return None if loss != loss else loss

    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def check(self) -> None:
        """Raise ``RuntimeError`` with the worker's traceback if it failed."""
        try:
            failed = self._errors.get_nowait()
        except queue.Empty:
            return
        raise RuntimeError(f"split trainer failed:\n{failed.error}")

    def wait_steps(self, steps: int, timeout: float) -> bool:
        """Block until ``steps`` optimizer steps are done (True) or ``timeout`` s pass (False);
        raises if the worker failed or exited."""
        deadline = time.monotonic() + timeout
        while self.steps_done < steps:
            self.check()
            if not self.alive():
                raise RuntimeError("split trainer exited before its first optimizer steps")
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def adapter(self, base_model_name_or_path: str | None = None) -> LoraAdapter:
        """The adapter after the last completed optimizer step (the initial one before any)."""
        with torch.no_grad():
            self._initial.flat.copy_(self.flat.cpu())
        return self._initial.to_adapter(base_model_name_or_path)

    def close(self, timeout: float = 30.0) -> None:
        """Stop at the next step boundary (kill after ``timeout`` s); sets :attr:`exitcode` and
        logs the worker's failure, if any."""
        proc = self._proc
        if proc is None:
            return
        self._stop.set()
        proc.join(timeout=timeout)
        if proc.is_alive():
            logger.warning("split trainer did not stop within %.0fs: killing it", timeout)
            proc.kill()
            proc.join(timeout=10)
        self._proc = None
        self.exitcode = proc.exitcode
        try:
            self.check()
        except RuntimeError as e:
            logger.error("%s", e)
        self._errors.close()
        self._errors.cancel_join_thread()

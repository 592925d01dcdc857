"""AdamW on the flat fp32 master of the training adapter, with Hugging Face LR schedules.

One optimizer step consumes the gradient that one or more backward tasks accumulated into
``lora.flat.grad`` (un-normalized token-sum losses): it divides by the step's target-token
count, clips, and applies ``torch.optim.AdamW`` with a ``LambdaLR`` schedule, exactly as a
``transformers`` + ``peft`` loop that averages the loss over the step's target tokens would.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch

from coserve.core.config import OptimConfig
from coserve.trainer.lora_params import TrainableLoRA

logger = logging.getLogger(__name__)


def _constant(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return float(step) / float(max(1.0, warmup))
    return 1.0


def _linear(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return float(step) / float(max(1, warmup))
    return max(0.0, float(total - step) / float(max(1, total - warmup)))


def _cosine(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return float(step) / float(max(1, warmup))
    # NOTE: progress stops at 1 (transformers' formula does not): past total_steps its cosine
    # rises again, back to the full learning rate at 2 · total - warmup (and a warmup that ends
    # at or past total restarts it at 1). A run can step past its total, which is estimated from
    # the mean sample length.
    progress = 1.0 if step >= total else float(step - warmup) / float(total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


# The formulas of transformers' get_{constant,linear,cosine}_schedule_with_warmup (cosine with
# num_cycles = 0.5, held at 0 past the total), written out so that the trainer does not import
# transformers.
_SCHEDULES: dict[str, Callable[..., float]] = {
    "constant": _constant,
    "linear": _linear,
    "cosine": _cosine,
}


def lr_lambda(cfg: OptimConfig) -> Callable[[int], float]:
    """The multiplier of ``cfg.lr`` at optimizer step ``step`` (0-based, as ``LambdaLR`` counts).

    ``constant``: ``step / warmup`` during warmup, then 1. ``linear``: warmup, then
    ``(total - step) / (total - warmup)`` down to 0. ``cosine``: warmup, then
    ``½(1 + cos(π · (step - warmup) / (total - warmup)))`` down to 0. Both decaying schedules
    stay at 0 past ``total`` (transformers' cosine rises again there). A decaying schedule needs
    ``cfg.total_steps > 0``.
    """
    if cfg.lr_scheduler != "constant" and cfg.total_steps <= 0:
        raise ValueError(
            f"--lr-scheduler {cfg.lr_scheduler} decays to 0 at the total step count, which is "
            f"{cfg.total_steps}; give a positive number of training steps or use 'constant'"
        )
    return partial(_SCHEDULES[cfg.lr_scheduler], warmup=cfg.warmup_steps, total=cfg.total_steps)


def import_ahead() -> None:
    """Import what a first ``torch.optim.AdamW`` with a ``LambdaLR`` imports (``torch._dynamo``,
    ``sympy`` and some 900 modules more: 0.82 s on the dev VM,
    ``bench/results/host_cpu/session45/build_imports.txt``; about four times that on session 45's
    H100 host, where a trainer's ``build`` stage took 4.2–6.2 s): by building a throwaway pair on a
    CPU tensor, which initializes no CUDA. A spare trainer interpreter runs it ahead of need
    (:mod:`coserve.trainer.spare`)."""
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1e-3)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)


class StepResult(NamedTuple):
    lr: float  # learning rate of this step (the schedule's value before it advances)
    grad_norm: float  # L2 norm of the normalized gradient before clipping
    skipped: bool  # non-finite loss or gradient: no update, schedule not advanced


class LoRAOptimizer:
    """``torch.optim.AdamW`` over ``[lora.flat]`` with a ``LambdaLR`` schedule.

    Owns ``lora.flat.grad`` between steps: :meth:`step` consumes and zeroes it.
    """

    def __init__(self, lora: TrainableLoRA, cfg: OptimConfig) -> None:
        self.lora = lora
        self.cfg = cfg
        self._lambda = lr_lambda(cfg)
        self._opt = torch.optim.AdamW(
            [lora.flat],
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
        )
        self._sched = torch.optim.lr_scheduler.LambdaLR(self._opt, self._lambda)
        self._steps = 0

    @property
    def step_count(self) -> int:
        """Optimizer steps applied (skipped steps do not count)."""
        return self._steps

    @property
    def lr(self) -> float:
        """The learning rate the next step will use."""
        return float(self._opt.param_groups[0]["lr"])

    def step(self, num_targets: int, loss_sum: float) -> StepResult:
        """One optimizer step on the accumulated gradient ``g`` of ``loss_sum``:

        ``g /= num_targets``; if ``loss_sum`` or ``g`` is non-finite (or there is no target), zero
        ``g`` and skip; else clip ``g`` to ``max_grad_norm`` (when > 0), AdamW, advance the
        schedule, zero ``g``. ``grad_norm`` is the pre-clip norm either way.
        """
        flat = self.lora.flat
        lr = self.lr
        if flat.grad is None:
            flat.grad = torch.zeros_like(flat)
        grad = flat.grad
        if num_targets <= 0:
            grad.zero_()
            logger.warning("optimizer step %d skipped: no target tokens", self._steps)
            return StepResult(lr, 0.0, True)
        grad.div_(num_targets)
        with torch.no_grad():
            if self.cfg.max_grad_norm > 0:
                norm_t = torch.nn.utils.clip_grad_norm_([flat], self.cfg.max_grad_norm)
            else:
                norm_t = torch.linalg.vector_norm(grad)
        norm = float(norm_t)
        if not (math.isfinite(loss_sum) and math.isfinite(norm)):
            grad.zero_()
            logger.warning(
                "optimizer step %d skipped: non-finite loss %s / grad norm %s",
                self._steps,
                loss_sum,
                norm,
            )
            return StepResult(lr, norm, True)
        self._opt.step()
        self._sched.step()
        grad.zero_()
        self._steps += 1
        return StepResult(lr, norm, False)

    def export_state(self, out: torch.Tensor) -> None:
        """``out[0] = master``, ``out[1] = exp_avg``, ``out[2] = exp_avg_sq``, in place.

        out: ``[3, P]`` fp32 (zeros for the moments before the first step). With
        :attr:`step_count` this is the whole optimizer state.
        """
        flat = self.lora.flat
        if tuple(out.shape) != (3, flat.numel()):
            raise ValueError(f"state buffer must be [3, {flat.numel()}], got {list(out.shape)}")
        state = self._opt.state.get(flat, {})
        with torch.no_grad():
            out[0].copy_(flat)
            for i, name in ((1, "exp_avg"), (2, "exp_avg_sq")):
                if name in state:
                    out[i].copy_(state[name])
                else:
                    out[i].zero_()

    def import_state(self, state: torch.Tensor, step_count: int) -> None:
        """Restore master weights, AdamW moments, step and schedule position from
        :meth:`export_state`'s ``[3, P]`` and :attr:`step_count`, so that training continues
        bit-identically."""
        flat = self.lora.flat
        if tuple(state.shape) != (3, flat.numel()):
            raise ValueError(f"state must be [3, {flat.numel()}], got {list(state.shape)}")
        if step_count < 0:
            raise ValueError(f"step_count must be >= 0, got {step_count}")
        with torch.no_grad():
            flat.copy_(state[0])
        self._opt.state.pop(flat, None)
        if step_count > 0:
            # What AdamW's lazy init creates (non-capturable: the step lives on the CPU).
            self._opt.state[flat] = {
                "step": torch.tensor(float(step_count), dtype=torch.float32),
                "exp_avg": state[1].to(flat.device, torch.float32, copy=True),
                "exp_avg_sq": state[2].to(flat.device, torch.float32, copy=True),
            }
        # A scheduler built at last_epoch = k - 1 takes its initial step to k: lr = lr0 · λ(k).
        self._sched = torch.optim.lr_scheduler.LambdaLR(
            self._opt, self._lambda, last_epoch=step_count - 1
        )
        if flat.grad is not None:
            flat.grad.zero_()
        self._steps = step_count

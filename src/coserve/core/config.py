"""Co-serving configuration: frozen dataclasses, checked when built."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

LR_SCHEDULERS = ("constant", "linear", "cosine")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRAConfig:
    """The training adapter's shape (PEFT semantics: ``scaling = alpha / rank``)."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    use_rslora: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if self.rank <= 0:
            raise ValueError(f"--lora-rank must be positive, got {self.rank}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"--lora-alpha must be a positive finite number, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:  # (False for nan)
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.dropout}")
        bad = [t for t in self.target_modules if t not in LORA_TARGETS]
        if bad or not self.target_modules:
            raise ValueError(
                f"--target-modules: {', '.join(bad) or 'none given'}; choose from {', '.join(LORA_TARGETS)}"
            )
        # Keep the canonical order so that flat parameter layouts are reproducible.
        object.__setattr__(self, "target_modules", tuple(t for t in LORA_TARGETS if t in self.target_modules))

    def check_rank(self, linear_shapes: Mapping[str, tuple[int, int]]) -> None:
        """Refuse a rank that none of the targeted linears can use: ``linear_shapes`` is the model's
        ``{name: (out_features, in_features)}`` (:meth:`ModelConfig.linear_shapes`). ``B @ A`` of a
        linear has rank at most ``min(out_features, in_features)``; above that of every target, the
        rank only takes memory (the engine's adapter slots are allocated at it)."""
        useful = {t: min(linear_shapes[t]) for t in self.target_modules}
        limit = max(useful.values())
        if self.rank > limit:
            each = ", ".join(f"{t} {r}" for t, r in useful.items())
            raise ValueError(
                f"--lora-rank {self.rank} is above {limit}, the largest rank the targeted layers of this model "
                f"can use (min(in_features, out_features): {each}); give --lora-rank {limit} or less"
            )


@dataclass(frozen=True)
class OptimConfig:
    """AdamW on fp32 master weights, with a Hugging Face-style learning-rate schedule.

    ``lr_scheduler``: ``constant`` (linear warmup, then flat), ``linear`` (warmup, then linear decay
    to 0 at ``total_steps``), ``cosine`` (warmup, then half-cosine to 0 at ``total_steps``).
    ``max_grad_norm == 0`` disables clipping. ``accumulation_tasks`` backward tasks make one
    optimizer step. After ``max_skipped_steps`` optimizer steps in a row skipped for a non-finite
    loss or gradient fine-tuning stops with an error saying so (0: never stops); inference goes
    on and the last committed adapter is kept.
    """

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 0
    max_grad_norm: float = 1.0
    accumulation_tasks: int = 1
    max_skipped_steps: int = 8

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        # NOTE: inf and nan pass a plain "> 0" or "< 0" test; they make every adapter weight non-finite
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr must be a positive finite number, got {self.lr}")
        if not (math.isfinite(self.eps) and self.eps >= 0):
            raise ValueError(f"the optimizer's eps must be a finite number >= 0, got {self.eps}")
        if self.lr_scheduler not in LR_SCHEDULERS:
            raise ValueError(f"--lr-scheduler must be one of {', '.join(LR_SCHEDULERS)}, got {self.lr_scheduler!r}")
        if self.warmup_steps < 0 or self.total_steps < 0:
            raise ValueError("--warmup-steps and total steps must be >= 0")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay}")
        if not (math.isfinite(self.max_grad_norm) and self.max_grad_norm >= 0):
            raise ValueError(f"--max-grad-norm must be a finite number >= 0 (0 = off), got {self.max_grad_norm}")
        if self.accumulation_tasks <= 0:
            raise ValueError(f"--grad-accum must be positive, got {self.accumulation_tasks}")
        if self.max_skipped_steps < 0:
            raise ValueError(f"--max-skipped-steps must be >= 0 (0 = never stop), got {self.max_skipped_steps}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be in [0, 1), got {self.betas}")


@dataclass(frozen=True)
class CoServeConfig:
    """How fine-tuning shares the engine.

    ``backward_tokens``: a backward task is handed to the trainer once it holds at least this many
    captured tokens. ``max_seq_len``: longest fine-tuning sample (longer ones are truncated).
    ``save_mlp_activations``: also keep each layer's gate/up projection output of the captured
    tokens, so that the trainer skips recomputing the MLP of layers whose MLP it does not train
    (``4 · intermediate_size`` bytes per token and layer in bf16).
    """

    backward_tokens: int = 256
    max_seq_len: int = 512
    epochs: int = 1
    seed: int = 0
    shuffle: bool = True
    train_on_prompt: bool = False
    candidate_window: int = 64
    save_mlp_activations: bool = False

    def __post_init__(self) -> None:
        if self.backward_tokens <= 0:
            raise ValueError(f"--backward-tokens must be positive, got {self.backward_tokens}")
        if self.max_seq_len < 2:
            raise ValueError(f"--max-seq-len must be >= 2, got {self.max_seq_len}")
        if self.epochs <= 0:
            raise ValueError(f"--epochs must be positive, got {self.epochs}")

    @property
    def store_capacity(self) -> int:
        """Tokens of activations to hold: a task closes once it reaches ``backward_tokens``, so
        it never exceeds ``backward_tokens - 1 + max_seq_len``."""
        return self.backward_tokens + self.max_seq_len - 1


FT_POLICIES = ("off", "temporal", "full", "naive")
PAUSE_POLICIES = ("always", "model")


@dataclass(frozen=True)
class SLOConfig:
    """Inference latency targets and how fine-tuning may use the slack they leave (DESIGN §7).

    ``margin``: fraction of each slack kept as safety (admission prices against
    ``(1 - margin) * slack``). ``policy``: ``off`` (no fine-tuning), ``temporal`` (only FT-only
    steps, never mixed into an inference step), ``full`` (FT-only steps and mixed steps),
    ``naive`` (a baseline: up to ``naive_tokens`` FT tokens in every step, shortest first, with
    no latency model). ``interrupt_ft_only``: an arriving request interrupts a running FT-only
    step at the next layer boundary. ``pause_prefill``: when a running backward is paused for an
    inference step: ``always`` for every step that carries prefill or FT rows (DESIGN §7), and for
    a decode-only step when the latency model predicts that running beside the backward would
    break the step's latency budget; ``model`` for any inference step only on that prediction
    (busy mode, times the model's safety factor), so that the backward keeps running beside the
    prefill and mixed steps that fit their budget. ``hold_pause``: a backward paused for a step
    whose requests left prompt tokens queued stays paused into the next step's planning, which
    resumes it only if that step needs no pause: through a burst of prefill steps the backward
    gets no gap between them in which to launch a layer beside the next one.
    ``early_pause_s`` (opt-in, 0: off): while a decode-only step runs beside the backward, a timer
    set to the step's predicted end less this lead pauses the backward if a request has arrived
    meanwhile (the next step will carry its prefill), so that the trainer has stopped by the time
    that step starts instead of only after its plan asks it to; the next plan takes the pause
    over, or lifts it where that step needs none. An FT-only step that an arrival interrupts
    (the backward runs beside FT-only steps) pauses it the same way, at the interruption.
    ``ft_only_mid_layer_check``: a second interruption point inside each layer of an FT-only step
    (after the MLP's gate/up projection), which keeps FT-only steps eager. Off by default: an
    eager FT-only step's first layer spent 2-16 ms of host time (its GEMMs' first calls at the
    step's new token count, session 17's profile), while through the piecewise prefill graphs
    (bucketed token counts) the step's one check per layer boundary comes about one layer apart.
    """

    ttft_slo_s: float = 1.0
    tpot_slo_s: float = 0.1
    margin: float = 0.1
    policy: str = "full"
    interrupt_ft_only: bool = True
    naive_tokens: int = 256
    pause_prefill: str = "always"
    hold_pause: bool = False
    ft_only_mid_layer_check: bool = False
    early_pause_s: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.early_pause_s) and self.early_pause_s >= 0):
            raise ValueError(f"--early-pause-ms must be a finite number >= 0, got {self.early_pause_s * 1e3:g}")
        if not (math.isfinite(self.ttft_slo_s) and self.ttft_slo_s > 0):
            raise ValueError(f"--ttft-slo-ms must be a positive finite number, got {self.ttft_slo_s * 1e3:g}")
        if not (math.isfinite(self.tpot_slo_s) and self.tpot_slo_s > 0):
            raise ValueError(f"--tpot-slo-ms must be a positive finite number, got {self.tpot_slo_s * 1e3:g}")
        if not 0.0 <= self.margin < 1.0:  # (False for nan)
            raise ValueError(f"--slo-margin must be in [0, 1), got {self.margin}")
        if self.policy not in FT_POLICIES:
            raise ValueError(
                f"--ft-policy must be one of {', '.join(FT_POLICIES)}, got {self.policy!r}"
            )
        if self.naive_tokens <= 0:
            raise ValueError(f"--naive-tokens must be positive, got {self.naive_tokens}")
        if self.pause_prefill not in PAUSE_POLICIES:
            raise ValueError(
                f"--pause-prefill must be one of {', '.join(PAUSE_POLICIES)}, got {self.pause_prefill!r}"
            )



@dataclass
class SkippedSteps:
    """Optimizer steps skipped in a row for a non-finite loss or gradient (:attr:`count`), and
    the error that stops fine-tuning once they reach :attr:`OptimConfig.max_skipped_steps`: one
    rule for the co-server, which reads its trainer's step reports, and the split baseline's
    worker, which steps its own optimizer."""

    count: int = 0

    def record(self, skipped: bool, limit: int, loss: float | None) -> str | None:
        """Count one optimizer step; the error once ``limit`` (> 0) steps in a row were skipped."""
        self.count = self.count + 1 if skipped else 0
        if not (limit and self.count >= limit):
            return None
        return (f"{self.count} optimizer steps in a row had a non-finite loss or gradient (last loss {loss}); "
                "fine-tuning stopped (inference goes on, the last committed adapter is kept). A learning "
                "rate too high for the data, or a numerical fault in the trainer: see the log's warnings")

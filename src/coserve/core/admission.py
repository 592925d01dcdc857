"""The per-step fine-tuning admission decision (DESIGN §7).

Before each step the host proposes its inference batch (a :class:`StepView`). Admission prices
that step with the :class:`LatencyModel` and adds FT samples, shortest first, while the predicted
step stays within the latency budget ``Δ`` that the tightest inference deadline leaves:

* TTFT slack of a request = ``TTFT_SLO − waited − T_after``, where ``T_after`` is the predicted
  prefill work that must still follow this step before its first token (its own remaining
  chunks and those ahead of it, FCFS). The requests are those of this step's prefill chunks and,
  conservatively, the head of the queue with the whole queue's prompts ahead of it.
* TPOT slack = ``TPOT_SLO`` when the step carries decode rows: each of them waits for the whole
  step for its next token; ``∞`` otherwise.
* ``Δ = (1 − margin)·min(TTFT slack, TPOT slack)``; the step's own predicted time is what ``Δ``
  bounds, so it is not subtracted from the slacks.

Predicted times only grow with every added FT token (all coefficients are ≥ 0), so the first
sample that does not fit ends the fill: longer ones would not fit either.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum
from typing import NamedTuple

from coserve.core.config import SLOConfig
from coserve.core.finetune import FTSample
from coserve.core.host import StepView
from coserve.core.latency import Chunk, LatencyModel, StepFeatures


class Reason(StrEnum):
    """Why admission stopped adding samples (a metrics label)."""

    POLICY_OFF = "policy_off"
    BACKWARD_RUNNING = "backward_running"
    NO_CAPACITY = "no_capacity"
    EMPTY_POOL = "empty_pool"
    TEMPORAL = "temporal_inference_step"
    OVER_BUDGET = "inference_over_budget"
    LATENCY = "latency_budget"
    CAPACITY = "capacity"
    TOKEN_BUDGET = "token_budget"
    POOL_EXHAUSTED = "pool_exhausted"
    NAIVE_LIMIT = "naive_tokens"


class AdmissionDecision(NamedTuple):
    """The samples to add (shortest first), ``Δ`` (``inf``: no deadline), the predicted time
    of the step as it will run (0 for no step at all) and why the fill stopped."""

    samples: list[FTSample]
    budget_s: float
    predicted_s: float
    reason: str


class Slack(NamedTuple):
    """Unscaled slacks of one step, in seconds (``inf``: nothing to protect)."""

    ttft_s: float
    tpot_s: float


def prefill_time(tokens: int, view: StepView, model: LatencyModel) -> float:
    """Predicted time of prefilling ``tokens`` prompt tokens after this step.

    The host's per-step token cap (``prefill + decodes + token_budget`` of ``view``) less the
    decode rows goes to one chunk per step; every step also carries this step's decodes.
    """
    if tokens <= 0:
        return 0.0
    cap = view.num_prefill_tokens + view.num_decodes + view.token_budget
    per_step = max(1, cap - view.num_decodes)
    full, rest = divmod(tokens, per_step)

    def step(n: int) -> float:
        chunk = (Chunk(n),)
        return model.predict(
            StepFeatures(chunk, (), view.num_decodes, view.decode_kv_tokens, view.mode,
                         kv_max=view.decode_kv_max)
        )

    return full * step(per_step) + (step(rest) if rest else 0.0)


def slack(view: StepView, model: LatencyModel, slo: SLOConfig) -> Slack:
    """TTFT and TPOT slack of ``view`` (see the module docstring)."""
    remaining = view.prefill_remaining or (0,) * len(view.prefills)
    if len(remaining) != len(view.prefills):
        raise ValueError(
            f"StepView.prefill_remaining has {len(remaining)} entries for "
            f"{len(view.prefills)} prefill chunks"
        )
    ttft = math.inf
    ahead = 0
    for chunk, rest in zip(view.prefills, remaining, strict=True):
        ahead += rest
        after = prefill_time(ahead, view, model) if rest > 0 else 0.0
        ttft = min(ttft, slo.ttft_slo_s - (view.now - chunk.arrival_time) - after)
    if view.num_waiting > 0 and view.oldest_waiting_arrival is not None:
        after = prefill_time(ahead + view.waiting_prefill_tokens, view, model)
        ttft = min(ttft, slo.ttft_slo_s - (view.now - view.oldest_waiting_arrival) - after)
    # (the step's own host time so far is part of every decode's time per token)
    tpot = slo.tpot_slo_s - view.planned_s if view.num_decodes > 0 else math.inf
    return Slack(ttft, tpot)


def latency_budget(view: StepView, model: LatencyModel, slo: SLOConfig) -> float:
    """``Δ = (1 − margin)·min(TTFT slack, TPOT slack)``; a negative slack is kept as is."""
    s = min(slack(view, model, slo))
    return (1.0 - slo.margin) * s if s > 0 else s


def admit(
    view: StepView,
    candidates: Sequence[FTSample],
    *,
    model: LatencyModel,
    slo: SLOConfig,
    backward_running: bool,
    capacity_tokens: int,
    token_budget: int,
    trainer_busy: bool | None = None,
    trainer_phase: str = "active",
    trainer_spot: str | None = None,
) -> AdmissionDecision:
    """Choose the FT samples of the next step (DESIGN §7).

    ``capacity_tokens``: activation-store tokens free beyond the inference reserve;
    ``token_budget``: tokens the host still accepts in this step. Pure: claims nothing.
    With no inference work at all (``Δ = ∞``) it fills an FT-only step up to capacity and token
    budget: that step has no deadline, an arrival interrupts it (:func:`should_interrupt`).
    A queue the host left unscheduled still bounds such a step through its TTFT slack.
    """
    # ``backward_running`` closes admission; ``trainer_busy`` (default: the same) prices the step
    # as running beside a backward, which a pipelined trainer may be while admission is open.
    # ``trainer_phase``: what that backward runs (coserve.core.latency.TRAINER_PHASES);
    # ``trainer_spot``: where in it (coserve.core.latency.trainer_spot, None elsewhere).
    base = StepFeatures.from_view(view, busy=backward_running if trainer_busy is None else trainer_busy,
                                  trainer_phase=trainer_phase, trainer_spot=trainer_spot)
    base_s = model.predict(base) if view.has_inference else 0.0
    budget = latency_budget(view, model, slo)

    def no_ft(reason: Reason) -> AdmissionDecision:
        return AdmissionDecision([], budget, base_s, reason)

    if slo.policy == "off":
        return no_ft(Reason.POLICY_OFF)
    if backward_running:
        return no_ft(Reason.BACKWARD_RUNNING)
    if capacity_tokens <= 0:
        return no_ft(Reason.NO_CAPACITY)
    if not candidates:
        return no_ft(Reason.EMPTY_POOL)
    if slo.policy == "naive":
        return naive_fill(base, base_s, candidates, model=model, budget=budget,
                          limit=slo.naive_tokens, capacity_tokens=capacity_tokens,
                          token_budget=token_budget)
    if view.has_inference and slo.policy == "temporal":
        return no_ft(Reason.TEMPORAL)
    if base_s > budget:
        return no_ft(Reason.OVER_BUDGET)

    return _fill(base, base_s, candidates, model=model, budget=budget, capacity_tokens=capacity_tokens,
                 token_budget=token_budget)


def should_interrupt(slo: SLOConfig, *, ft_only_step: bool, num_arrived: int) -> bool:
    """Whether ``num_arrived`` new requests abandon the running step at its next layer boundary.

    Only FT-only steps are interruptible, and only while fine-tuning is on and
    ``interrupt_ft_only`` is set; otherwise the arrivals wait for the step to end.
    """
    return ft_only_step and num_arrived > 0 and slo.interrupt_ft_only and slo.policy != "off"


def naive_fill(
    base: StepFeatures,
    base_s: float,
    candidates: Sequence[FTSample],
    *,
    model: LatencyModel,
    budget: float,
    limit: int,
    capacity_tokens: int,
    token_budget: int,
) -> AdmissionDecision:
    """The ``naive`` policy: add samples shortest first while their total stays within
    ``limit`` FT tokens, the activation capacity and the step's token budget, whatever the
    latency budget (the decode-fusion style of earlier co-serving systems: no latency model).

    ``base`` / ``base_s``: the step's inference batch and its predicted time; ``budget`` and the
    predicted times are reported, never used. A shortest sample longer than ``limit`` admits
    nothing.
    """
    return _fill(base, base_s, candidates, model=model, budget=budget, capacity_tokens=capacity_tokens,
                 token_budget=token_budget, limit=limit, check_latency=False)


def _fill(
    base: StepFeatures,
    base_s: float,
    candidates: Sequence[FTSample],
    *,
    model: LatencyModel,
    budget: float,
    capacity_tokens: int,
    token_budget: int,
    limit: int | None = None,
    check_latency: bool = True,
) -> AdmissionDecision:
    """Shortest first while capacity, the token budget, ``limit`` FT tokens (if given) and, with
    ``check_latency``, the predicted step time times the model's :meth:`~LatencyModel.safety`
    within ``budget`` all hold. Every coefficient is
    non-negative, so a longer step only predicts longer: the first sample that does not fit
    ends the fill."""
    picked: list[FTSample] = []
    used = 0
    features, predicted = base, base_s
    reason = Reason.POOL_EXHAUSTED
    for sample in sorted(candidates, key=lambda s: (s.num_tokens, s.sample_id)):
        n = sample.num_tokens
        if used + n > capacity_tokens:
            reason = Reason.CAPACITY
            break
        if used + n > token_budget:
            reason = Reason.TOKEN_BUDGET
            break
        if limit is not None and used + n > limit:
            reason = Reason.NAIVE_LIMIT
            break
        if check_latency:
            trial = features.with_ft((n,))
            trial_s = model.predict(trial)
            if trial_s * model.safety(trial) > budget:
                reason = Reason.LATENCY
                break
            features, predicted = trial, trial_s
        picked.append(sample)
        used += n
    if picked and not check_latency:
        predicted = model.predict(base.with_ft([s.num_tokens for s in picked]))
    return AdmissionDecision(picked, budget, predicted, reason)

"""Admission, table-driven, against budgets computed by hand.

The hand model: every token (prefill, FT or decode row) costs 1 ms; a step costs 10 ms more in
eager mode and 5 ms more in graph mode; no quadratic, KV, context or FT-capture cost. A busy
trainer slows a graph decode step by 50 % + 2 ms. SLOs: TTFT 1 s, TPOT 0.1 s, margin 10 %.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from coserve.core.admission import (
    Reason,
    admit,
    latency_budget,
    prefill_time,
    should_interrupt,
    slack,
)
from coserve.core.config import SLOConfig
from coserve.core.finetune import FTSample
from coserve.core.host import PrefillView, StepView
from coserve.core.latency import LatencyModel, StepFeatures

NOW = 10.0
SLO = SLOConfig(ttft_slo_s=1.0, tpot_slo_s=0.1, margin=0.1)
INF = math.inf


def hand_model() -> LatencyModel:
    model = LatencyModel()
    model.load_state_dict({
        "version": 1,
        "coefficients": {
            "prefill/eager": [0, 1e-3, 0, 0, 0, 0.010], "prefill/graph": [0, 1e-3, 0, 0, 0, 0.005],
            "decode/eager": [1e-3, 0, 0.010], "decode/graph": [1e-3, 0, 0.005],
        },
        "busy": {"decode/graph": [0.5, 0.002]},
    })
    return model


def samples(*lengths: int) -> list[FTSample]:
    return [FTSample(i, tuple(range(n)), tuple(range(n))) for i, n in enumerate(lengths)]


def prefill(n: int, waited: float) -> PrefillView:
    return PrefillView(n, 0, NOW - waited)


# One prefill chunk of 100 tokens that has waited 0.5 s: Δ = 0.9·(1 − 0.5) = 0.45.
TTFT_VIEW = StepView(now=NOW, prefills=(prefill(100, 0.5),), token_budget=1000)
# Ten graph decodes: Δ = 0.9·0.1 = 0.09; with n FT tokens the eager step is 1e-3·(n + 10) + 0.01.
TPOT_VIEW = StepView(now=NOW, num_decodes=10, decode_kv_tokens=1000, mode="graph",
                     token_budget=1000)
IDLE_VIEW = StepView(now=NOW, token_budget=1000)

CASES: list[tuple[str, StepView, tuple[int, ...], dict[str, Any], int, float, float, Reason]] = [
    # name, view, candidate lengths, admit overrides, #picked, Δ, predicted, reason
    ("ttft_bound", TTFT_VIEW, (100,) * 4, {}, 3, 0.45, 0.11 + 0.3, Reason.LATENCY),
    ("tpot_bound", TPOT_VIEW, (30,) * 3, {}, 2, 0.09, 0.08, Reason.LATENCY),
    ("capacity_bound", TPOT_VIEW, (30,) * 3, {"capacity_tokens": 50}, 1, 0.09, 0.05,
     Reason.CAPACITY),
    ("token_budget_bound", TPOT_VIEW, (30,) * 3, {"token_budget": 40}, 1, 0.09, 0.05,
     Reason.TOKEN_BUDGET),
    ("backward_running", TPOT_VIEW, (30,), {"backward_running": True}, 0, 0.09,
     0.015 * 1.5 + 0.002, Reason.BACKWARD_RUNNING),
    ("empty_pool", TPOT_VIEW, (), {}, 0, 0.09, 0.015, Reason.EMPTY_POOL),
    ("no_capacity", TPOT_VIEW, (30,), {"capacity_tokens": 0}, 0, 0.09, 0.015, Reason.NO_CAPACITY),
    ("policy_off", TPOT_VIEW, (30,), {"slo": replace(SLO, policy="off")}, 0, 0.09, 0.015,
     Reason.POLICY_OFF),
    ("policy_off_idle", IDLE_VIEW, (30,), {"slo": replace(SLO, policy="off")}, 0, INF, 0.0,
     Reason.POLICY_OFF),
    ("temporal_inference_step", TPOT_VIEW, (30,), {"slo": replace(SLO, policy="temporal")}, 0,
     0.09, 0.015, Reason.TEMPORAL),
    # FT-only steps: no deadline; sorted 50, 80, 100 fit 250 tokens of capacity, 200 does not.
    ("temporal_ft_only", IDLE_VIEW, (100, 50, 80, 200),
     {"slo": replace(SLO, policy="temporal"), "capacity_tokens": 250}, 3, INF, 0.24,
     Reason.CAPACITY),
    ("ft_only_pool_exhausted", IDLE_VIEW, (50, 80), {}, 2, INF, 0.14, Reason.POOL_EXHAUSTED),
    ("ft_only_token_budget", IDLE_VIEW, (80, 50), {"token_budget": 100}, 1, INF, 0.06,
     Reason.TOKEN_BUDGET),
    # 500 tokens waited 0.6 s: Δ = 0.36 < the inference-only step's 0.51.
    ("inference_over_budget", replace(TTFT_VIEW, prefills=(prefill(500, 0.6),)), (10,), {}, 0,
     0.36, 0.51, Reason.OVER_BUDGET),
    # Already late by 0.2 s: the negative slack is not scaled by the margin.
    ("deadline_missed", replace(TTFT_VIEW, prefills=(prefill(100, 1.2),)), (10,), {}, 0, -0.2,
     0.11, Reason.OVER_BUDGET),
    # The graph decode step (0.085) fits 0.09, but any FT row makes it eager: 0.081 + 0.01.
    ("eager_switch", replace(TPOT_VIEW, num_decodes=80), (1,), {}, 0, 0.09, 0.085,
     Reason.LATENCY),
    # Chunked prefill: B (waited 0.1) still needs 600 tokens after this step, in steps of
    # 500 - 0 decodes: 0.51 + 0.11. Slack A = 0.5, slack B = 1 − 0.1 − 0.62 = 0.28 binds:
    # Δ = 0.252; the step is 0.21 + 1e-3 per FT token.
    ("chunk_remaining_binds", StepView(now=NOW, prefills=(prefill(100, 0.5), prefill(100, 0.1)),
                                       prefill_remaining=(0, 600), token_budget=300),
     (20,) * 3, {}, 2, 0.252, 0.25, Reason.LATENCY),
    # Queue: head waited 0.3 s, 400 prompt tokens to go (one step of 0.41 after this one):
    # slack 0.29, Δ = 0.261; the step is 0.11 + 1e-3 per FT token.
    ("queue_binds", StepView(now=NOW, prefills=(prefill(100, 0.1),), token_budget=400,
                             num_waiting=3, oldest_waiting_arrival=NOW - 0.3,
                             waiting_prefill_tokens=400),
     (50,) * 4, {}, 3, 0.261, 0.26, Reason.LATENCY),
    # FT-only step beside a queue the host left unscheduled: slack 1 − 0.2 − 0.11, Δ = 0.621.
    ("ft_only_with_queue", StepView(now=NOW, token_budget=500, num_waiting=1,
                                    oldest_waiting_arrival=NOW - 0.2, waiting_prefill_tokens=100),
     (300,) * 3, {}, 2, 0.621, 0.61, Reason.LATENCY),
]


@pytest.mark.parametrize(
    ("view", "lengths", "overrides", "num_picked", "budget", "predicted", "reason"),
    [c[1:] for c in CASES], ids=[c[0] for c in CASES],
)
def test_admit(view: StepView, lengths: tuple[int, ...], overrides: dict[str, Any],
               num_picked: int, budget: float, predicted: float, reason: Reason) -> None:
    kwargs: dict[str, Any] = dict(model=hand_model(), slo=SLO, backward_running=False,
                                  capacity_tokens=10_000, token_budget=10_000)
    kwargs.update(overrides)
    candidates = samples(*lengths)
    decision = admit(view, candidates, **kwargs)
    expected = sorted(candidates, key=lambda s: (s.num_tokens, s.sample_id))[:num_picked]
    assert decision.samples == expected
    assert decision.budget_s == pytest.approx(budget)
    assert decision.predicted_s == pytest.approx(predicted)
    assert decision.reason == reason
    assert isinstance(decision.reason, str)


def test_slack_and_prefill_time_by_hand() -> None:
    model = hand_model()
    view = StepView(now=NOW, prefills=(prefill(100, 0.5),), num_decodes=10,
                    decode_kv_tokens=100, token_budget=390)
    # Cap 100 + 10 + 390 = 500, 490 prompt tokens per step beside 10 decodes:
    # 1000 tokens = 2 full steps (1e-3·500 + 0.01) + 20 tokens (1e-3·30 + 0.01).
    assert prefill_time(1000, view, model) == pytest.approx(2 * 0.51 + 0.04)
    assert prefill_time(0, view, model) == 0.0
    assert slack(view, model, SLO) == pytest.approx((0.5, 0.1))
    assert latency_budget(view, model, SLO) == pytest.approx(0.09)
    assert slack(IDLE_VIEW, model, SLO) == (INF, INF)
    # 4 ms of the step spent before the decision (scheduling, taking in the trainer's results):
    # the decodes' time per token has 4 ms less left; the prompt's TTFT slack counted it already
    planned = replace(view, step_began=NOW - 0.004)
    assert planned.planned_s == pytest.approx(0.004)
    assert slack(planned, model, SLO) == pytest.approx((0.5, 0.096))
    assert slack(replace(IDLE_VIEW, step_began=NOW - 0.004), model, SLO) == (INF, INF)


def test_queued_prompts_are_priced_with_the_steps_longest_decode_row() -> None:
    """Under ``decode_kv="rows_longest"`` the queue's steps carry this step's decodes as the
    model prices a step: their KV term is the rows times the longest row (10 × 50, not 100)."""
    model = LatencyModel(decode_kv="rows_longest", decode_kv_share=1.0)
    model.load_state_dict({**hand_model().state_dict(), "decode_kv": "rows_longest", "decode_kv_share": 1.0})
    coef = list(model.coefficients("prefill/eager"))
    coef[3] = 1e-6  # e_kv: 1 µs a KV token
    model.load_state_dict({**model.state_dict(), "coefficients": {**model.state_dict()["coefficients"],
                                                                  "prefill/eager": coef}})
    view = StepView(now=NOW, prefills=(prefill(100, 0.5),), num_decodes=10, decode_kv_tokens=100,
                    decode_kv_max=50, token_budget=390)
    assert prefill_time(490, view, model) == pytest.approx(0.51 + 500e-6)
    assert prefill_time(490, replace(view, decode_kv_max=0), model) == pytest.approx(0.51 + 100e-6)
    with pytest.raises(ValueError, match="prefill_remaining"):
        slack(replace(view, prefill_remaining=(1, 2)), model, SLO)


@pytest.mark.parametrize(
    ("policy", "interrupt", "ft_only", "arrived", "expected"),
    [
        ("full", True, True, 1, True),
        ("temporal", True, True, 2, True),
        ("full", True, True, 0, False),
        ("full", True, False, 1, False),
        ("full", False, True, 1, False),
        ("off", True, True, 1, False),
    ],
)
def test_should_interrupt(policy: str, interrupt: bool, ft_only: bool, arrived: int,
                          expected: bool) -> None:
    slo = SLOConfig(policy=policy, interrupt_ft_only=interrupt)
    assert should_interrupt(slo, ft_only_step=ft_only, num_arrived=arrived) is expected


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"ttft_slo_s": 0.0}, "--ttft-slo"),
        ({"tpot_slo_s": -1.0}, "--tpot-slo"),
        ({"ttft_slo_s": math.inf}, "--ttft-slo-ms must be a positive finite number"),
        ({"tpot_slo_s": math.inf}, "--tpot-slo-ms must be a positive finite number"),
        ({"early_pause_s": math.inf}, "--early-pause-ms must be a finite number"),
        ({"margin": 1.0}, "--slo-margin"),
        ({"policy": "sometimes"}, "--ft-policy"),
    ],
)
def test_slo_config_validation(kwargs: dict[str, Any], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        SLOConfig(**kwargs)


def test_admission_prices_steps_with_the_models_safety_factor() -> None:
    """TPOT_VIEW's second 30-token sample fits Δ = 0.09 by the bare prediction (0.08), not once
    the eager set's recent overrun of 1.2× is applied (0.096); the reported prediction stays
    the bare one."""

    class Overrunning(LatencyModel):
        def safety(self, features: StepFeatures) -> float:
            return 1.2 if features.exec_mode == "eager" else 1.0

    model = hand_model()
    model.__class__ = Overrunning
    candidates = samples(30, 30, 30)
    decision = admit(TPOT_VIEW, candidates, model=model, slo=SLO, backward_running=False,
                     capacity_tokens=10_000, token_budget=10_000)
    assert decision.samples == candidates[:1]
    assert decision.predicted_s == pytest.approx(0.05)
    assert decision.reason == Reason.LATENCY

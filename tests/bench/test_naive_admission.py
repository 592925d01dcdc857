"""The naive co-serving policy's admission, table-driven: a fixed FT token allowance per step,
shortest first, with no latency budget (hand model: 1 ms a token, +10 ms eager, +5 ms graph)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from coserve.core.admission import Reason, admit, should_interrupt
from coserve.core.config import SLOConfig
from coserve.core.finetune import FTSample
from coserve.core.host import PrefillView, StepView
from coserve.core.latency import LatencyModel

NOW = 10.0
NAIVE = SLOConfig(ttft_slo_s=1.0, tpot_slo_s=0.1, margin=0.1, policy="naive", naive_tokens=256)


def hand_model() -> LatencyModel:
    model = LatencyModel()
    model.load_state_dict(
        {
            "version": 1,
            "coefficients": {
                "prefill/eager": [0, 1e-3, 0, 0, 0, 0.010],
                "prefill/graph": [0, 1e-3, 0, 0, 0, 0.005],
                "decode/eager": [1e-3, 0, 0.010],
                "decode/graph": [1e-3, 0, 0.005],
            },
        }
    )
    return model


def samples(*lengths: int) -> list[FTSample]:
    return [FTSample(i, tuple(range(n)), tuple(range(n))) for i, n in enumerate(lengths)]


# Ten graph decodes: Δ = 0.09 s; with n FT tokens the (eager) step takes 1e-3·(n + 10) + 0.01 s.
DECODE = StepView(now=NOW, num_decodes=10, decode_kv_tokens=1000, mode="graph", token_budget=1000)
IDLE = StepView(now=NOW, token_budget=1000)
# A prefill already 1.2 s late: Δ < 0, full admits nothing here, naive still fills.
LATE = StepView(now=NOW, prefills=(PrefillView(100, 0, NOW - 1.2),), token_budget=1000)

CASES: list[
    tuple[str, StepView, tuple[int, ...], dict[str, Any], tuple[int, ...], float, Reason]
] = [
    # name, view, candidate lengths, admit overrides, picked lengths, predicted s, reason
    (
        "fills_to_the_allowance",
        DECODE,
        (100, 50, 200, 30),
        {},
        (30, 50, 100),
        0.2,
        Reason.NAIVE_LIMIT,
    ),
    # 180 FT tokens price at 0.2 s, far over Δ = 0.09: naive does not look.
    (
        "ignores_the_latency_budget",
        DECODE,
        (60, 60, 60),
        {},
        (60, 60, 60),
        0.2,
        Reason.POOL_EXHAUSTED,
    ),
    ("late_prefill_still_filled", LATE, (100, 100, 100), {}, (100, 100), 0.31, Reason.NAIVE_LIMIT),
    ("exact_allowance", IDLE, (128, 128, 1), {}, (1, 128), 0.139, Reason.NAIVE_LIMIT),
    ("ft_only_step", IDLE, (200, 56), {}, (56, 200), 0.266, Reason.POOL_EXHAUSTED),
    (
        "token_budget_first",
        DECODE,
        (30, 50, 100),
        {"token_budget": 60},
        (30,),
        0.05,
        Reason.TOKEN_BUDGET,
    ),
    (
        "capacity_first",
        DECODE,
        (30, 50, 100),
        {"capacity_tokens": 40},
        (30,),
        0.05,
        Reason.CAPACITY,
    ),
    ("sample_over_allowance", DECODE, (300, 400), {}, (), 0.015, Reason.NAIVE_LIMIT),
    (
        "backward_running",
        DECODE,
        (30,),
        {"backward_running": True},
        (),
        0.015,
        Reason.BACKWARD_RUNNING,
    ),
    ("empty_pool", DECODE, (), {}, (), 0.015, Reason.EMPTY_POOL),
    ("no_capacity", DECODE, (30,), {"capacity_tokens": 0}, (), 0.015, Reason.NO_CAPACITY),
    (
        "smaller_allowance",
        DECODE,
        (30, 50, 100),
        {"slo": SLOConfig(policy="naive", naive_tokens=64)},
        (30,),
        0.05,
        Reason.NAIVE_LIMIT,
    ),
]


@pytest.mark.parametrize(
    ("view", "lengths", "overrides", "picked", "predicted", "reason"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_naive_admit(
    view: StepView,
    lengths: tuple[int, ...],
    overrides: dict[str, Any],
    picked: tuple[int, ...],
    predicted: float,
    reason: Reason,
) -> None:
    kwargs: dict[str, Any] = dict(
        model=hand_model(),
        slo=NAIVE,
        backward_running=False,
        capacity_tokens=10_000,
        token_budget=10_000,
    )
    kwargs.update(overrides)
    decision = admit(view, samples(*lengths), **kwargs)
    assert tuple(s.num_tokens for s in decision.samples) == picked
    assert sum(picked) <= kwargs["slo"].naive_tokens
    assert decision.predicted_s == pytest.approx(predicted)
    assert decision.reason == reason


def test_full_admits_nothing_where_naive_fills() -> None:
    """The contrast the baseline exists for: same step, same pool."""
    kwargs: dict[str, Any] = dict(
        model=hand_model(), backward_running=False, capacity_tokens=10_000, token_budget=10_000
    )
    full = admit(LATE, samples(100, 100), slo=SLOConfig(policy="full"), **kwargs)
    naive = admit(LATE, samples(100, 100), slo=NAIVE, **kwargs)
    assert full.samples == [] and full.reason == Reason.OVER_BUDGET
    assert len(naive.samples) == 2 and naive.budget_s == full.budget_s < 0
    assert math.isinf(admit(IDLE, samples(10), slo=NAIVE, **kwargs).budget_s)


def test_naive_config() -> None:
    assert SLOConfig().naive_tokens == 256
    with pytest.raises(ValueError, match="--naive-tokens"):
        SLOConfig(policy="naive", naive_tokens=0)
    # Interruption follows the flag, as for the other policies (the harness turns it off).
    assert should_interrupt(SLOConfig(policy="naive"), ft_only_step=True, num_arrived=1)
    assert not should_interrupt(
        SLOConfig(policy="naive", interrupt_ft_only=False), ft_only_step=True, num_arrived=1
    )

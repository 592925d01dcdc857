"""Relative SLO attainment, rolling attainment and timeline rates against hand-computed cases.

Times are binary fractions so that every threshold below is exact."""

from __future__ import annotations

import pytest

from coserve.bench.analysis import comparisons
from coserve.bench.metrics import (
    SLO,
    RequestRecord,
    attainment,
    relative_slo,
    rolling_attainment,
    timeline_rates,
)


def rec(arrival: float, first: float | None, finish: float | None, out: int) -> RequestRecord:
    return RequestRecord(arrival, first, finish, 10, out)


# TTFT 0.125 / 0.375 / 0.25 (mean 0.25); TPOT 0.125 / 0.25 (mean 0.1875): the one-token answer
# has no TPOT and the unfinished request no TTFT, so neither enters its mean.
REFERENCE = [
    rec(0.0, 0.125, 0.625, 5),
    rec(1.0, 1.375, 1.875, 3),
    rec(2.0, 2.25, 2.25, 1),
    rec(3.0, None, None, 0),
]


def test_relative_slo_is_three_times_the_reference_means() -> None:
    assert relative_slo(REFERENCE) == SLO(0.75, 0.5625)
    assert relative_slo(REFERENCE, factor=2.0) == SLO(0.5, 0.375)


def test_relative_attainment_by_hand() -> None:
    rel = relative_slo(REFERENCE)
    run = [
        rec(0.0, 0.75, 1.875, 3),  # TTFT 0.75, TPOT 0.5625: both exactly at the limit -> attains
        rec(0.0, 0.8125, 0.9375, 2),  # TTFT over
        rec(0.0, 0.125, 0.75, 2),  # TPOT 0.625 over
        rec(0.0, 0.5, None, 0),  # unfinished: a miss
        rec(0.0, 0.5, 0.5, 1),  # one token: TPOT 0 -> attains
    ]
    assert attainment(run, *rel) == pytest.approx(2 / 5)
    # Against absolute SLOs of 1 s / 0.6 s: only the TPOT of 0.625 and the unfinished one miss.
    assert attainment(run, 1.0, 0.6) == pytest.approx(3 / 5)


def test_relative_slo_needs_a_finished_multi_token_request() -> None:
    with pytest.raises(ValueError, match="reference"):
        relative_slo([rec(0.0, 0.1, 0.1, 1), rec(1.0, None, None, 0)])


def test_rolling_attainment_by_arrival_window() -> None:
    records = [rec(0.5, 0.625, 0.75, 2), rec(1.5, 2.5, 2.75, 2), rec(2.5, 2.625, 2.75, 2)]
    slo = SLO(0.5, 0.5)  # the request that arrived at 1.5 s waited 1 s: a miss
    assert rolling_attainment(records, slo, [1.0, 2.0, 3.0, 5.0], window_s=2.0) == [
        1.0,
        0.5,
        0.5,
        None,
    ]


def test_timeline_rates_from_cumulative_ticks() -> None:
    rates = timeline_rates([(1.0, 10, 0), (2.0, 30, 100), (2.0, 30, 100), (2.5, 40, 150)])
    assert rates.t == [1.0, 2.0, 2.5]
    assert rates.inference_tokens_per_s == [10.0, 20.0, 20.0]
    assert rates.ft_tokens_per_s == [0.0, 100.0, 100.0]


def test_comparisons_ratios_and_percentage_points() -> None:
    figures = {
        "inference": {"ft_tokens_per_s": 0.0, "attainment_abs": 1.0, "attainment_rel": 0.99},
        "full": {"ft_tokens_per_s": 3000.0, "attainment_abs": 0.995, "attainment_rel": 0.99},
        "naive": {"ft_tokens_per_s": 1000.0, "attainment_abs": 0.9, "attainment_rel": None},
        "split": {"ft_tokens_per_s": 2000.0, "attainment_abs": 1.0, "attainment_rel": 0.98},
        "inference-last": {"ft_tokens_per_s": 0.0, "attainment_abs": 1.0, "attainment_rel": 1.0},
    }
    comp = comparisons(figures)
    assert comp["ft_over_split"] == {"full": 1.5, "naive": 0.5}
    assert comp["ft_over_naive"] == {"full": 3.0, "split": 2.0}
    assert "ft_over_temporal" not in comp
    pp = comp["attainment_minus_reference_pp"]
    assert pp["full"]["abs"] == pytest.approx(-0.5) and pp["full"]["rel"] == pytest.approx(0.0)
    assert pp["naive"]["rel"] is None

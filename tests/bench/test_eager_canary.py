"""bench/eager_canary.py: predictions of a host-bound step's time from a speed reading."""

from __future__ import annotations

import pytest

from tests.bench.scripts import load_script

eager_canary = load_script("eager_canary")


def test_a_host_time_that_follows_the_canary_is_predicted_by_it() -> None:
    """Host time exactly 20 x the canary's, the canary slowing in the second half: the constant
    misses by the slowdown, the scaled canary and its line not at all, the step before once."""
    canary = [1.0, 1.0, 1.1, 0.9] + [1.5, 1.5, 1.5, 1.5]
    enqueue = [20 * c for c in canary]
    got = eager_canary.predictions(enqueue, canary)
    assert got["canary_scaled"]["p99_rel"] == pytest.approx(0.0, abs=1e-12)
    assert got["canary_line"]["p99_rel"] == pytest.approx(0.0, abs=1e-9)
    assert got["constant"]["median_rel"] == pytest.approx(1 - 20 / 30)
    # (the step before: 18 against 30 for the first of the second half, exact after)
    assert got["step_before"]["median_rel"] == pytest.approx(0.0) and got["step_before"]["p99_rel"] > 0.3

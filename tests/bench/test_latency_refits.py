"""bench/latency_refits.py: one set's coefficients at each refit of a replayed step table."""

from __future__ import annotations

from tests.bench.scripts import load_script
from tests.bench.test_latency_fit import _prefill_table

latency_refits = load_script("latency_refits")


def test_each_refit_and_the_steps_far_off_are_listed() -> None:
    """Prefill steps whose time doubles from the 300th on: the first entry is the calibration (at
    step 1), each later one follows a refit that changed the set (the one after the change prices
    slower), and the steps predicted more than 15% off come after the change (but for a few at the start), slower."""
    count = iter(range(10**6))

    def time_of(n: int, ctx: int, d: int) -> tuple[float, float]:
        slow = 2.0 if next(count) >= 300 else 1.0
        return slow * (3e-5 * (n + d) + 2e-9 * n * ctx + 5e-3), 1e-3

    got = latency_refits.trace(_prefill_table(3, time_of), None, "prefill/eager", 0.15)
    refits = got["refits"]
    assert got["steps"] == 600 and refits[0]["after_step"] == 1 and len(refits) >= 3
    assert [r["after_step"] for r in refits] == sorted(r["after_step"] for r in refits)
    assert set(refits[0]["coefficients"]) >= {"b_tokens", "k_over", "c"}
    late = [r for r in refits if r["after_step"] > 320]
    # (the refit at the cap, step 440, fits a window a third of which ran twice as slow)
    first = refits[0]["predicted_ms"]["400 tokens + 5 decodes"]
    assert late and late[-1]["predicted_ms"]["400 tokens + 5 decodes"] > 1.05 * first
    after = [w for w in got["off"] if w["step"] > 300]
    assert len(after) >= 0.9 * len(got["off"]) and all(w["measured_ms"] > w["predicted_ms"] for w in after)

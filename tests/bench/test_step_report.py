"""bench/step_report.py on a hand-made result: splits, new vs seen token counts, step kinds."""

from __future__ import annotations

import pytest

from tests.bench.scripts import load_script

step_report = load_script("step_report")

COLUMNS = ["t_s", "kind", "mode", "prefill_tokens", "decode_tokens", "seconds", "schedule_s",
           "forward_enqueue_s", "forward_gpu_s", "prefill_context_tokens", "ft_tokens", "forward_cpu_s"]


def test_report_splits_steps_and_compares_new_with_seen_token_counts() -> None:
    first = [[0.1, "inference", "eager", 100, 0, 0.02, 0.001, 0.004, 0.015, 0, 0, 0.001],   # new count: 200 µs/token
             [0.2, "inference", "eager", 100, 0, 0.01, 0.001, 0.004, 0.005, 0, 0, 0.003],   # seen now: 100 µs/token
             [0.3, "inference", "eager", 2047, 1, 0.1, 0.002, 0.02, 0.09, 0, 0, 0.002],     # 2048: warm-up's
             [0.4, "inference", "graph", 0, 8, 0.005, 0.0005, 0.0002, 0.004, 0, 0],
             [0.5, "ft-only", "eager", 0, 0, 0.2, 0.001, 0.05, 0.19, 0, 4096],
             [0.6, "mixed", "eager", 50, 2, 0.06, 0.001, 0.01, 0.05, 0, 512]]
    later = [[0.1, "inference", "eager", 100, 0, 0.008, None, None, None, 0, 0]]     # seen in the first run
    result = {"figures": {"inference": {"engine_steps": {"columns": COLUMNS, "rows": first}, "attainment_abs": 0.9},
                          "inference-last": {"engine_steps": {"columns": COLUMNS[:6], "rows": [r[:6] for r in later]}},
                          "broken": {"engine_steps": None}}}
    got = step_report.report(result)
    assert list(got) == ["inference", "inference-last"]
    eager = got["inference"]["eager_inference"]
    assert eager["steps"] == 3 and eager["median_s"] == pytest.approx(0.02)
    assert eager["median_forward_gpu_s"] == pytest.approx(0.015)
    assert eager["median_forward_cpu_s"] == pytest.approx(0.002)
    assert eager["new_token_counts"] == {"steps": 1, "median_us_per_token": pytest.approx(200.0)}
    assert eager["seen_token_counts"]["steps"] == 2
    assert got["inference"]["graph_inference"]["steps"] == 1
    assert got["inference"]["ft_only"] == {"steps": 1, "median_s": pytest.approx(0.2), "median_ft_tokens": 4096}
    assert got["inference"]["mixed"]["median_s"] == pytest.approx(0.06)
    assert got["inference"]["attainment_abs"] == 0.9
    last = got["inference-last"]["eager_inference"]  # an older result: no time split, no ft_tokens column
    assert last["median_forward_gpu_s"] is None and last["seen_token_counts"]["steps"] == 1
    assert "median_ft_tokens" not in got["inference-last"]["ft_only"]

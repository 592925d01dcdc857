"""bench/latency_timeline.py: busy decode error by window beside the GPU clock and the tasks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from coserve.bench.runners import STEP_TABLE_COLUMNS
from tests.bench.scripts import load_script

latency_timeline = load_script("latency_timeline")


def step(began: float, ratio: float) -> list[Any]:
    r: list[Any] = [None] * len(STEP_TABLE_COLUMNS)
    col = STEP_TABLE_COLUMNS.index
    r[col("key")], r[col("predicted_s")], r[col("measured_s")], r[col("began_s")] = \
        "decode/graph/busy", 0.01, 0.01 * ratio, began
    return r


def test_windows_line_the_error_up_with_the_clock_and_the_tasks(tmp_path: Path) -> None:
    # 0-10 s: every step 20% over at 1,200 MHz, two tasks of 1,000 tokens; 10-20 s: exact at 1,980
    rows = [step(i * 0.1, 1.2) for i in range(100)] + [step(10 + i * 0.1, 1.0) for i in range(100)]
    rows.append(["prefill/graph/idle", *rows[0][1:]])  # (not a busy decode step: not counted)
    gpu = [[t * 0.25, 90.0, 1200.0 if t * 0.25 < 10 else 1980.0] for t in range(80)]
    tasks = [[1.0, 3.0, 2.0, 1000, 4, 400, 1.0, 2.0], [5.0, 7.0, 2.0, 1000, 2, 700, 1.0, 2.0],
             [12.0, 15.0, 3.0, 4000, 8, 900, 1.0, 2.0]]
    figures = {"steps": {"columns": list(STEP_TABLE_COLUMNS), "rows": rows},
               "timeline": {"gpu_columns": ["t_s", "utilization", "sm_clock_mhz"], "gpu": gpu,
                            "task_columns": ["submitted_s", "received_s", "trainer_s", "tokens", "samples",
                                             "longest_tokens", "longest_span_cpu_ms", "longest_span_gpu_ms"],
                            "tasks": tasks}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"figures": figures}))
    first, second = latency_timeline.windows(str(path), 10.0)
    assert first["steps"] == second["steps"] == 100
    assert first["p99_rel"] == pytest.approx(0.2 / 1.2) and second["p99_rel"] == pytest.approx(0.0)
    assert first["sm_clock_mhz"] == 1200.0 and second["sm_clock_mhz"] == 1980.0
    assert first["tasks"] == 2 and first["task_tokens"] == 1000.0 and first["task_longest_tokens"] == 550.0
    assert second["tasks"] == 1 and second["task_samples"] == 8.0
    del figures["timeline"]
    path.write_text(json.dumps({"figures": figures}))
    with pytest.raises(SystemExit, match="no timeline"):
        latency_timeline.windows(str(path), 10.0)


def test_stretches_line_the_long_host_stretches_up_with_the_prefill_runs(tmp_path: Path) -> None:
    """A task beside five prefill steps in a row (0.3 s) has its 300 ms stretch put beside that run;
    one beside decode steps and a lone prefill, its 2 ms beside a 50 ms run."""
    col = STEP_TABLE_COLUMNS.index

    def timed(key: str, began: float, seconds: float) -> list[Any]:
        r = step(began, 1.0)
        r[col("key")], r[col("measured_s")] = key, seconds
        return r

    rows = [timed("decode/graph/busy", 0.01 * i, 0.01) for i in range(10)]
    rows += [timed("prefill/graph/idle", 0.1 + 0.06 * i, 0.06) for i in range(5)]  # 0.10-0.40 s
    rows += [timed("decode/graph/busy", 0.4 + 0.01 * i, 0.01) for i in range(60)]  # 0.40-1.00 s
    rows += [timed("prefill/graph/idle", 1.0, 0.05)] + [timed("decode/graph/busy", 1.05 + 0.01 * i, 0.01)
                                                       for i in range(20)]
    tasks = [[0.05, 0.6, 0.5, 1500, 3, 800, 300.0, 1.0], [0.9, 1.2, 0.3, 1200, 2, 600, 2.0, 1.0]]
    figures = {"steps": {"columns": list(STEP_TABLE_COLUMNS), "rows": rows},
               "timeline": {"gpu_columns": ["t_s", "utilization", "sm_clock_mhz"], "gpu": [],
                            "task_columns": ["submitted_s", "received_s", "trainer_s", "tokens", "samples",
                                             "longest_tokens", "longest_span_cpu_ms", "longest_span_gpu_ms"],
                            "tasks": tasks}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"figures": figures}))
    assert latency_timeline.prefill_runs(str(path)) == [pytest.approx((0.1, 0.4)), pytest.approx((1.0, 1.05))]
    got = latency_timeline.stretches(str(path))
    assert got["tasks"] == 2 and got["prefill_runs"] == 2
    short, long = got["by_stretch"]
    assert short["to_ms"] == 10.0 and short["tasks"] == 1 and short["other_p50_ms"] == pytest.approx(50.0)
    assert long["from_ms"] == 100.0 and long["to_ms"] is None and long["other_p50_ms"] == pytest.approx(300.0)
    assert [b["tasks"] for b in got["by_prefill_run"]] == [1, 1]
    assert got["by_prefill_run"][1]["from_ms"] == 200.0 and got["by_prefill_run"][1]["other_max_ms"] == 300.0
    # a timeline without the per-task counts (before session 38): the long stretch without them
    assert got["long"] == [{"stretch_ms": 300.0, "prefill_run_ms": pytest.approx(300.0)}]
    assert "tasks_with_device_allocs" not in got
    # with them: the long stretch's task allocated once and slept twice behind the closed gate
    figures["timeline"]["task_columns"] += ["device_allocs", "closed_sleeps"]
    figures["timeline"]["tasks"] = [t + c for t, c in zip(tasks, [[1, 2], [0, 0]], strict=True)]
    path.write_text(json.dumps({"figures": figures}))
    got = latency_timeline.stretches(str(path))
    assert got["long"] == [{"stretch_ms": 300.0, "prefill_run_ms": pytest.approx(300.0), "device_allocs": 1,
                            "closed_sleeps": 2}]
    assert got["tasks_with_device_allocs"] == got["tasks_with_closed_sleeps"] == 1
    figures["timeline"]["task_columns"] = figures["timeline"]["task_columns"][:6]
    path.write_text(json.dumps({"figures": figures}))
    with pytest.raises(SystemExit, match="longest host stretch"):
        latency_timeline.stretches(str(path))

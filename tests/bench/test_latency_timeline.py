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

"""bench/eager_tail.py's spread of the small eager steps' host time."""

from __future__ import annotations

import math

import numpy as np
import pytest

from coserve.bench.runners import STEP_TABLE_COLUMNS
from tests.bench.scripts import load_script

eager_tail = load_script("eager_tail")
COL = {c: i for i, c in enumerate(STEP_TABLE_COLUMNS)}


def row(tokens: int, ft: int, enqueue_ms: float, began: float, trainer_at: list[int] | None,
        cpu_ms: float | None = None, gc_ms: float | None = None) -> list[object]:
    r: list[object] = [None] * len(STEP_TABLE_COLUMNS)
    r[COL["key"]], r[COL["measured_s"]], r[COL["predicted_s"]] = "prefill/eager/idle", 0.03, 0.03
    r[COL["regressors"]] = [0.0, float(tokens), float(ft), 0.0, 0.0, 0.0, 0.0, 1.0]
    r[COL["enqueue_s"]], r[COL["began_s"]], r[COL["trainer_at"]] = enqueue_ms / 1e3, began, trainer_at
    r[COL["enqueue_cpu_s"]] = None if cpu_ms is None else cpu_ms / 1e3
    r[COL["gc_s"]] = None if gc_ms is None else gc_ms / 1e3
    return r


def test_the_small_steps_host_time_in_time_order() -> None:
    rows = [row(40, 0, 20.0, 3.0, None, 19.0, 0.1), row(400, 0, 40.0, 1.0, [5, 0], 36.0, 5.0),  # (out of time order)
            row(90, 0, 30.0, 2.0, [3, 1], gc_ms=3.0), row(40, 0, 20.0, 4.0, None, 20.0, 0.3),
            row(2000, 0, 50.0, 5.0, None), row(40, 900, 60.0, 6.0, None)]  # (not small: tokens, FT rows)
    got = eager_tail.host_spread(rows, COL)
    assert got["n"] == 4
    assert got["enqueue_ms"]["p50"] == pytest.approx(25.0) and got["enqueue_ms"]["p10"] == pytest.approx(20.0)
    ordered = [math.log(v) for v in (40.0, 30.0, 20.0, 20.0)]  # (by began_s)
    a, b = ordered[:-1], ordered[1:]
    ma, mb = sum(a) / 3, sum(b) / 3
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True))
    r = cov / math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))
    assert got["lag1_autocorrelation"] == pytest.approx(r)
    assert got["trainer_idle"] == {"n": 2, "median_ms": 20.0} and got["in_task"] == {"n": 2, "median_ms": 35.0}
    assert got["cpu_share_median"] == pytest.approx(0.95)  # (19/20, 36/40, 20/20; the one untold left out)
    assert got["gc_ms_median"] == {"slower_half": pytest.approx(4.0), "faster_half": pytest.approx(0.2)}
    assert eager_tail.host_spread(rows[4:], COL) is None
    assert got["slowest_tenth_began_s"] == [1.0] and "host_cpu_busy_corr" not in got


def test_the_small_steps_host_time_beside_the_hosts_cpu_load() -> None:
    """With the run's timeline: the correlation of the small steps' ms with the host's CPU load
    where each began (interpolated between the timeline's samples)."""
    rows = [row(40, 0, ms, began, None) for ms, began in ((20.0, 1.0), (30.0, 2.0), (25.0, 3.0), (40.0, 4.0))]
    timeline = {"gpu_columns": ["t_s", "utilization", "host_cpu_busy"],
                "gpu": [[0.5, 90.0, 0.1], [2.5, 90.0, 0.3], [4.5, 90.0, 0.5]]}
    got = eager_tail.host_spread(rows, COL, timeline)
    busy = [0.15, 0.25, 0.35, 0.45]
    assert got["host_cpu_busy_corr"] == pytest.approx(float(np.corrcoef([20.0, 30.0, 25.0, 40.0], busy)[0, 1]))
    assert got["slowest_tenth_began_s"] == [4.0]


def test_a_table_without_start_times_keeps_its_order() -> None:
    """A table from before session 28 has no ``began_s``: its rows' own order (the steps')."""
    col = {k: v for k, v in COL.items() if k not in ("began_s", "enqueue_cpu_s", "gc_s")}
    rows = [row(40, 0, 20.0, 3.0, None), row(40, 0, 40.0, 1.0, None), row(40, 0, 30.0, 2.0, None)]
    got = eager_tail.host_spread(rows, col)
    logs = [math.log(v) for v in (20.0, 40.0, 30.0)]
    a, b = logs[:-1], logs[1:]
    assert got["lag1_autocorrelation"] == pytest.approx(-1.0 if (a[1] - a[0]) * (b[1] - b[0]) < 0 else 1.0)
    assert "cpu_share_median" not in got and "gc_ms_median" not in got



def test_a_level_scales_each_prediction_by_the_steps_before() -> None:
    predicted = np.asarray([10.0, 10.0, 10.0])
    measured = np.asarray([20.0, 20.0, 20.0])
    got = eager_tail.level_replay(predicted, measured, 0.5)
    # levels: 0, then 0.5·log 2, then 0.75·log 2: errors 0.5, 1 - 2**-0.5, 1 - 2**-0.25
    errors = sorted([0.5, 1 - 2**-0.5, 1 - 2**-0.25])
    assert got["median_rel"] == pytest.approx(errors[1])
    assert got["p99_rel"] == pytest.approx(float(np.quantile(errors, 0.99)))

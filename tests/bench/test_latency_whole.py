"""bench/latency_whole.py's segments of a warm latency run, and bench/decode_slopes.py's fit."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from coserve.bench.runners import STEP_TABLE_COLUMNS
from tests.bench.scripts import load_script

latency_whole = load_script("latency_whole")
decode_slopes = load_script("decode_slopes")


def row(key: str, measured: float, regressors: list[float], gpu: float | None = None) -> list[Any]:
    r: list[Any] = [None] * len(STEP_TABLE_COLUMNS)
    col = STEP_TABLE_COLUMNS.index
    r[col("key")], r[col("predicted_s")], r[col("measured_s")], r[col("regressors")] = key, measured, measured, regressors
    r[col("planned_s")], r[col("gpu_s")] = 0.0, gpu
    return r


def write(path: Path, rows: list[list[Any]], idle_first: int | None, warm_first: int | None) -> str:
    figures: dict[str, Any] = {"steps": {"columns": list(STEP_TABLE_COLUMNS), "rows": rows},
                               "warm_first_step": warm_first,
                               "calibration": {"coefficients": {"decode/graph": [5e-6, 4.5e-8, 6.7e-3]}}}
    if idle_first is not None:
        figures["latency_model_error_trainer_idle"] = {"first_step": idle_first}
    path.write_text(json.dumps({"figures": figures}))
    return str(path)


def test_segments_count_the_measured_steps_only(tmp_path: Path) -> None:
    """Rows with no measured time are not replayed: a segment's first step is the first measured
    row at or after its recorded start."""
    rows = [row("decode/graph/busy", 0.01 if i % 5 else 0.0, [1.0, 100.0, 1.0]) for i in range(100)]
    path = write(tmp_path / "run.json", rows, idle_first=40, warm_first=70)
    kept = sum(1 for r in rows if r[2] > 0)  # 80: every fifth row unmeasured
    seg = latency_whole.segments(path, kept)
    assert seg["cold"] == (0, 32) and seg["idle"] == (32, 56) and seg["warm"] == (56, 80)
    assert seg["cold_first_half"] == (0, 16) and seg["cold_second_half"] == (16, 32)
    alone = latency_whole.segments(write(tmp_path / "cold.json", rows, None, None), kept)
    assert alone["cold"] == (0, 80) and "idle" not in alone and "warm" not in alone


def test_decode_slopes_recover_the_per_row_and_per_kv_costs_of_gpu_and_host(tmp_path: Path) -> None:
    rng = random.Random(3)
    rows = [row("prefill/graph/idle", 0.05, [0.0] * 8, 0.04)]
    for _ in range(300):
        n, kv = rng.randint(1, 32), rng.randint(100, 60_000)
        gpu = 6.4e-3 + 65e-6 * n + 58e-9 * kv
        rows.append(row("decode/graph/idle", gpu + 0.2e-3 + 15e-6 * n, [float(n), float(kv), 1.0], gpu))
    got = decode_slopes.slopes(write(tmp_path / "run.json", rows, idle_first=0, warm_first=None))
    assert got["steps"] == 300
    assert got["gpu"]["per_row_s"] == pytest.approx(65e-6, rel=1e-6)
    assert got["gpu"]["per_kv_token_s"] == pytest.approx(58e-9, rel=1e-6)
    assert got["host"]["per_row_s"] == pytest.approx(15e-6, rel=1e-6)
    assert got["after_decision"]["constant_s"] == pytest.approx(6.6e-3, rel=1e-6)
    assert got["calibration"]["per_row_s"] == 5e-6


def test_decode_slopes_score_the_longest_row_forms_where_the_table_records_it(tmp_path: Path) -> None:
    """A GPU time that follows the longest row's keys per program (its KV over the kernel's split
    count) is fitted exactly by that form, not by rows and total KV."""
    rng = random.Random(5)
    col = STEP_TABLE_COLUMNS.index("decode_kv_max")
    rows = []
    for _ in range(400):
        n, longest = rng.choice([8, 16, 24, 32]), rng.randint(500, 6000)
        kv = int(n * longest * rng.uniform(0.3, 0.8))
        per_program = longest / decode_slopes.decode_splits(n, 8, 1 << 20, 132)
        gpu = 8e-3 + 20e-6 * n + 10e-9 * kv + 400e-9 * per_program
        r = row("decode/graph/idle", gpu + 1e-4, [float(n), float(kv), 1.0], gpu)
        r[col] = longest
        rows.append(r)
    forms = decode_slopes.slopes(write(tmp_path / "run.json", rows, idle_first=0, warm_first=None))["forms_gpu"]
    assert forms["rows_kv_longest_split"]["p99_rel"] < 1e-9
    assert forms["rows_kv"]["p99_rel"] > 0.01
    for r in rows:
        r[col] = None  # a table recorded before the column: no forms
    assert "forms_gpu" not in decode_slopes.slopes(write(tmp_path / "old.json", rows, 0, None))


def test_decode_kv_forms_read_the_longest_row() -> None:
    r: list[Any] = [None] * len(STEP_TABLE_COLUMNS)
    r[latency_whole.KV_MAX], r[STEP_TABLE_COLUMNS.index("decodes")] = 1000, 3
    assert STEP_TABLE_COLUMNS[latency_whole.KV_MAX] == "decode_kv_max"
    assert STEP_TABLE_COLUMNS[latency_whole.lw.DECODES] == "decodes"
    rows_longest, split_longest = latency_whole.rows_longest(1.0), latency_whole._split_longest
    assert rows_longest(r, "decode/graph", [24.0, 9000.0, 1.0]) == 24_000.0  # the bucket's rows
    # a prefill step: its own decode rows (3), its e_kv slot
    assert rows_longest(r, "prefill/graph", [0.0, 0.0, 0.0, 2500.0, 0.0, 0.0, 0.0, 1.0]) == 3000.0
    assert latency_whole.rows_longest(0.5)(r, "decode/graph", [24.0, 9000.0, 1.0]) == 9000.0 + 0.5 * 15_000.0
    # one row: 33 splits of its keys, 33 programs' worth: its KV; 32 rows: two splits
    assert split_longest(r, "decode/graph", [1.0, 1000.0, 1.0]) == pytest.approx(1000.0)
    assert split_longest(r, "decode/graph", [32.0, 9000.0, 1.0]) == pytest.approx(16_500.0)
    # eager: split by the step's own longest row (1,000 keys: at most 16 splits of 64)
    assert split_longest(r, "decode/eager", [1.0, 1000.0, 1.0]) == pytest.approx(1000 * 33 / 16)


def test_a_replay_in_the_longest_row_form_follows_steps_that_wait_on_their_longest_row() -> None:
    """Idle decode steps whose time is rows × longest row: replayed by one model with the recorded
    total as their KV term, their error stays; with ``rows_longest``, the refits find it."""
    from coserve.core.latency import LatencyModel

    rng = random.Random(8)
    col = STEP_TABLE_COLUMNS.index
    steps = []
    for _ in range(600):
        rows = rng.choice([8, 16, 24, 32])
        lens = [rng.randint(10, 4000) for _ in range(rows)]
        r = row("decode/graph/idle", 4e-3 + 2e-5 * rows + 4e-8 * rows * max(lens), [float(rows), float(sum(lens)), 1.0])
        r[col("decodes")], r[col("decode_kv_max")] = rows, max(lens)
        steps.append(r)

    def late_error(form: Any) -> float:
        model = LatencyModel(level_rate=0.0)  # (no level: the form alone)
        model.load_state_dict({**model.state_dict(online=False),
                               "coefficients": {"decode/graph": [2e-5, 4e-8, 4e-3]}})
        predicted = latency_whole.lw.replay(model, steps, None, form)
        measured = [s[2] for s in steps]
        return max(abs(p - m) / m for p, m in zip(predicted[300:], measured[300:], strict=True))

    assert late_error(latency_whole.rows_longest(1.0)) < 1e-3 < 0.05 < late_error(None)


def decode_steps(rng: random.Random, n: int) -> list[tuple[list[float], float]]:
    """``n`` decode steps' regressors (rows, KV tokens, 1) and their idle time on the
    calibration's coefficients (``write``'s)."""
    coef = [5e-6, 4.5e-8, 6.7e-3]
    out = []
    for _ in range(n):
        b, kv = rng.randint(1, 32), rng.randint(100, 4000)
        regressors = [float(b), float(b * kv), 1.0]
        out.append((regressors, sum(c * v for c, v in zip(coef, regressors, strict=True))))
    return out


def test_busy_from_starts_the_busy_sets_from_another_runs_terms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """``--busy-from``: a run whose busy decode steps run 1.3x their idle time plus 1 ms, replayed
    with the busy terms another such run's replay ended with, misses its first busy steps by less
    than from its calibration alone (no busy term there: the first ones priced as idle)."""
    import sys

    rows = []
    for i, (regressors, idle) in enumerate(decode_steps(random.Random(0), 400)):
        busy = i >= 100
        r = row("decode/graph/busy" if busy else "decode/graph/idle", 1.3 * idle + 1e-3 if busy else idle, regressors)
        r[STEP_TABLE_COLUMNS.index("trainer_at")] = [10, 0] if busy else None
        rows.append(r)
    run = write(tmp_path / "run.json", rows, None, None)
    donor = write(tmp_path / "donor.json", rows, None, None)
    figures = {}
    for name, extra in (("plain", []), ("busy_from", ["--busy-from", donor])):
        out = tmp_path / f"{name}.json"
        monkeypatch.setattr(sys, "argv", ["latency_whole.py", run, "--out", str(out), *extra])
        latency_whole.main()
        record = json.loads(out.read_text())
        assert record["config"]["busy_from"] == (donor if extra else None)
        figures[name] = record["figures"]["run.json"]["cold_first_half"]["decode/graph/busy"]["replay"]
    capsys.readouterr()
    assert figures["busy_from"]["p99_rel"] < 0.5 * figures["plain"]["p99_rel"]


def test_host_stall_ms_reports_each_segment_without_the_host_stalled_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Idle decode steps on their linear form, but every 50th enqueued in 7 ms and 1.8x as long,
    every 50th other one with 3 ms more after its GPU work (a host that took the CPU away): over
    all steps their error is the p99; without the steps whose host time ran more than 2 ms over the
    median, what is left is the model's own (the steps right after a stall, whose level it moved);
    they are counted as left out. Prefill steps, whose enqueue is longer, are not left out for it."""
    import sys

    rows = []
    for i, (regressors, idle) in enumerate(decode_steps(random.Random(1), 600)):
        stalled, late = i % 50 == 25, i % 50 == 40
        gpu = idle * (1.8 if stalled else 1.0)
        r = row("decode/graph/idle", gpu + (3e-3 if late else 0.0), regressors, gpu)
        r[STEP_TABLE_COLUMNS.index("enqueue_s")] = 7e-3 if stalled else 0.4e-3
        rows.append(r)
        if i % 20 == 0:
            p = row("prefill/graph/idle", 0.05, [0.0] * 8, 0.045)
            p[STEP_TABLE_COLUMNS.index("enqueue_s")] = 8e-3
            rows.append(p)
    assert STEP_TABLE_COLUMNS[latency_whole.ENQUEUE_S] == "enqueue_s" and STEP_TABLE_COLUMNS[latency_whole.GPU_S] == "gpu_s"
    run = write(tmp_path / "run.json", rows, None, None)
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["latency_whole.py", run, "--host-stall-ms", "2", "--out", str(out)])
    latency_whole.main()
    assert "host-stalled steps" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["config"]["host_stall_ms"] == 2.0
    cold = record["figures"]["run.json"]["cold"]
    assert cold["without_host_stalls"]["left_out"] == 24
    assert cold["decode/graph/idle"]["replay"]["p99_rel"] > 0.3
    assert cold["without_host_stalls"]["decode/graph/idle"]["replay"]["p99_rel"] < 0.3 * cold["decode/graph/idle"]["replay"]["p99_rel"]
    assert cold["without_host_stalls"]["decode/graph/idle"]["replay"]["n"] == 600 - 24
    assert cold["without_host_stalls"]["prefill/graph/idle"]["replay"]["n"] == 30

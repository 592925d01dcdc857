"""bench/trainer_first_tasks.py: a recorded run's task shapes, and the CPU smoke run by warm-up."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.bench.scripts import load_script

first_tasks = load_script("trainer_first_tasks")


def test_row_lengths_keep_the_tasks_tokens_samples_and_longest() -> None:
    assert first_tasks.row_lengths(1061, 4, 269) == [269, 264, 264, 264]
    assert first_tasks.row_lengths(1000, 3, 600) == [600, 200, 200]
    assert first_tasks.row_lengths(300, 1, 300) == [300]
    assert first_tasks.row_lengths(10, 3, 9) == [9, 2, 2]  # (each row at least 2 tokens)


def test_task_shapes_come_from_a_runs_timeline(tmp_path: Path) -> None:
    run = tmp_path / "run.json"
    cols = [*first_tasks.TASK_COLUMNS, "longest_span_cpu_ms", "longest_span_gpu_ms"]
    run.write_text(json.dumps({"figures": {"timeline": {"task_columns": cols, "tasks": [
        [0.1, 0.6, 0.5, 1061, 4, 269, 42.9, 17.1], [0.7, 1.1, 0.3, 1198, 4, 312, 14.8, 14.7]]}}}))
    assert first_tasks.task_shapes(str(run), 5) == [(1061, 4, 269), (1198, 4, 312)]
    run.write_text(json.dumps({"figures": {"timeline": {"task_columns": ["tokens"], "tasks": []}}}))
    with pytest.raises(SystemExit, match="task_columns"):
        first_tasks.task_shapes(str(run), 5)


def test_cpu_smoke_run_reports_each_variant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["trainer_first_tasks.py", "--model", "tiny", "--tasks", "3", "--first", "2",
                                      "--backward-tokens", "48", "--max-seq-len", "32",
                                      "--variants", "one shapes:COSERVE_TRAINER_LOG=WARNING", "--out", str(out)])
    first_tasks.main()
    f = json.loads(out.read_text())["figures"]
    one, shapes = f["one"], f["shapes:COSERVE_TRAINER_LOG=WARNING"]
    assert len(one["warmup_tasks"]) == 1 and len(shapes["warmup_tasks"]) > 1
    for record in (one, shapes):
        assert [t["tokens"] for t in record["tasks"]] == [40, 48, 56]
        assert record["summary"]["first"]["tasks"] == 2 and record["summary"]["rest"]["tasks"] == 1

"""bench/prefill_compositions.py: prefill steps grouped by composition, measured against predicted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from coserve.bench.runners import STEP_TABLE_COLUMNS
from tests.bench.scripts import load_script

prefill_compositions = load_script("prefill_compositions")


@pytest.mark.parametrize(("chunks", "kind"), [
    ([], "no chunk"),
    ([[400, 0], [100, 0]], "fresh"),
    ([[2048, 2048]], "context"),
    ([[16, 4073], [400, 0]], "short context + fresh, paged"),
    ([[16, 4073], [1024, 0]], "short context + fresh, flash"),
    ([[200, 4000], [100, 0]], "context + fresh"),
])
def test_a_step_has_one_composition(chunks: list[list[int]], kind: str) -> None:
    assert prefill_compositions.composition(chunks) == kind


def row(key: str, predicted: float, ratio: float, chunks: list[list[int]]) -> list[Any]:
    r: list[Any] = [None] * len(STEP_TABLE_COLUMNS)
    col = STEP_TABLE_COLUMNS.index
    r[col("key")], r[col("predicted_s")], r[col("measured_s")], r[col("chunks")] = key, predicted, predicted * ratio, chunks
    return r


def test_a_run_reports_each_composition_and_the_p99_without_it(tmp_path: Path) -> None:
    # 200 fresh steps 1% over, 20 short-context-beside-fresh steps 12% over (the tail), decode steps
    # (not counted) 50% over
    rows = [row("prefill/graph/idle", 0.02, 1.01, [[400, 0]]) for _ in range(200)]
    rows += [row("prefill/graph/idle", 0.02, 1.12, [[16, 4073], [400, 0]]) for _ in range(20)]
    rows += [row("decode/graph/busy", 0.01, 1.5, []) for _ in range(50)]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"figures": {"steps": {"columns": list(STEP_TABLE_COLUMNS), "rows": rows}}}))
    fig = prefill_compositions.run_figures(str(path), replay=False, share=0.35)
    assert fig["steps"] == 220
    assert fig["p99_rel"] == pytest.approx(0.12 / 1.12)
    short = fig["compositions"]["short context + fresh, paged"]
    assert short["steps"] == 20 and short["ratio_median"] == pytest.approx(1.12) and short["over_10pct"] == 1.0
    assert short["p99_rel_without"] == pytest.approx(0.01 / 1.01)
    fresh = fig["compositions"]["fresh"]
    assert fresh["steps"] == 200 and fresh["over_10pct"] == 0.0 and fresh["p99_rel_without"] == pytest.approx(0.12 / 1.12)
    assert set(fig["compositions"]) == {"fresh", "short context + fresh, paged"}

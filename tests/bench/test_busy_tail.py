"""bench/busy_tail.py: the busy decode steps the model missed, by where the trainer was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.scripts import load_script

busy_tail = load_script("busy_tail")
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
COLUMNS = ["key", "predicted_s", "measured_s", "trainer_at"]
ROLES = ("logits", "logits", "cross_entropy", "gradient", "gradient")  # (two GEMM pieces)


def result(rows: list[list]) -> dict:
    return {"config": {"shape": "llama3-8b"}, "figures": {"steps": {"columns": COLUMNS, "rows": rows}}}


def test_misses_counted_by_place_and_loss_role() -> None:
    rows = [
        ["decode/graph/busy", 0.010, 0.012, [32, 7]],   # loss ordinal 7: the second chunk's cross-entropy, missed
        ["decode/graph/busy", 0.010, 0.0101, [32, 12]],  # the third chunk's, within 10%
        ["decode/graph/busy", 0.010, 0.008, [32, 3]],   # a gradient piece, over-predicted by 25%
        ["decode/graph/busy", 0.010, 0.010, [5, 2]],    # a layer
        ["decode/graph/busy", 0.010, 0.020, None],      # no position
        ["decode/graph/idle", 0.010, 0.050, None],      # (not a busy decode step)
        ["prefill/graph/idle", 0.010, 0.050, [5, 0]],
    ]
    got = busy_tail.busy_tail(result(rows), 0.10, 32, ROLES)
    assert got == {
        "all": {"steps": 5, "over": 3, "under_predicted": 2},
        "layer": {"steps": 1, "over": 0, "under_predicted": 0},
        "loss:cross_entropy": {"steps": 2, "over": 1, "under_predicted": 1},
        "loss:gradient": {"steps": 1, "over": 1, "under_predicted": 0},
        "none": {"steps": 1, "over": 1, "under_predicted": 1},
    }


def test_a_recorded_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Session 42's default run ``_b``: the counts its write-up quotes."""
    run = RESULTS / "latency_h100" / "session42" / "coserve_latency_fc92394_b.json.xz"
    out = tmp_path / "tail.json"
    busy_tail.main([str(run), "--gemm-pieces", "2", "--out", str(out)])
    got = json.loads(out.read_text())["figures"][run.name]
    assert got["all"] == {"steps": 2452, "over": 101, "under_predicted": 44}
    assert got["loss:cross_entropy"]["over"] == 6 and got["layer"]["over"] == 71
    assert "loss:cross_entropy" in capsys.readouterr().out


def test_an_unknown_shape_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"config": {"shape": "tiny"}, "figures": {"steps": {"columns": COLUMNS, "rows": []}}}))
    with pytest.raises(SystemExit, match="tiny"):
        busy_tail.main([str(path)])

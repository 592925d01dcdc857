"""bench/latency_ab.py: recorded tables replayed whole under two model settings."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from tests.bench.scripts import load_script

latency_ab = load_script("latency_ab")
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def test_a_variant_is_coserve_variables_only() -> None:
    assert latency_ab.parse_variant("COSERVE_SPOT_GRAIN=phase,COSERVE_LOSS_GEMM_PIECES=1") == {
        "COSERVE_SPOT_GRAIN": "phase", "COSERVE_LOSS_GEMM_PIECES": "1"}
    for bad in ("PATH=/tmp", "COSERVE_SPOT_GRAIN"):
        with pytest.raises(argparse.ArgumentTypeError, match="COSERVE_VAR=VALUE"):
            latency_ab.parse_variant(bad)


def test_tally_counts_the_tables_each_way() -> None:
    got = latency_ab.tally([(10.0, 9.5), (9.0, 9.005), (11.0, 11.4)], tie=0.01)
    assert (got["tables"], got["lower"], got["higher"], got["tied"]) == (3, 1, 1, 1)
    assert got["mean_change_points"] == pytest.approx((-0.5 + 0.005 + 0.4) / 3)
    assert got["largest_rise_points"] == pytest.approx(0.4)
    assert latency_ab.tally([], 0.01)["mean_change_points"] is None


def test_one_table_replayed_both_ways_as_the_committed_comparison_has_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Session 40's first default run, by spot grain: the same p99s as session 41's spot_grain.json
    (the replay is deterministic), eager runs left out, the provenance written."""
    table = RESULTS / "latency_h100" / "session40" / "coserve_latency_b696bbf_a.json.xz"
    eager = RESULTS / "latency_h100" / "session40" / "coserve_latency_eager_b696bbf.json.xz"
    out = tmp_path / "ab.json"
    monkeypatch.setattr(sys, "argv", ["latency_ab.py", str(table), str(eager), "--a", "COSERVE_SPOT_GRAIN=phase",
                                      "--b", "COSERVE_SPOT_GRAIN=boundary", "--group", "session40", "--out", str(out)])
    latency_ab.main()
    capsys.readouterr()
    got = json.loads(out.read_text())
    committed = json.loads((RESULTS / "latency_h100" / "session41" / "spot_grain.json").read_text())
    (run,) = got["figures"]["tables"].values()
    (was,) = [v for k, v in committed["figures"]["tables"].items() if k.endswith(table.name)]
    assert run == was
    assert got["config"]["tables"] == [str(table)] and "commit" in got
    assert got["figures"]["summary"]["cold/all"]["session40"]["tables"] == 1

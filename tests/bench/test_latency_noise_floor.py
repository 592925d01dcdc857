"""bench/latency_noise_floor.py: the oracles find a position's slowdown and a drifting level, and
leave exactly the steps' own spread."""

from __future__ import annotations

import gzip
import json
import math
import random
from pathlib import Path

import pytest

from tests.bench.scripts import load_script

noise_floor = load_script("latency_noise_floor")

NUM_LAYERS = 32


def _rows(spread: float, n: int = 2000) -> list[list[object]]:
    """Busy decode steps predicted at 10 ms: 30% slower while the trainer is at its loss, a level
    that drifts slowly by ±10%, and a uniform ±``spread`` of each step's own."""
    rng = random.Random(0)
    rows: list[list[object]] = []
    for i in range(n):
        at = [NUM_LAYERS, 0] if i % 10 == 0 else [rng.randrange(1, NUM_LAYERS - 1), rng.randrange(9)]
        slow = 1.3 if at[0] == NUM_LAYERS else 1.0
        level = 1.0 + 0.1 * math.sin(i / 150)
        measured = 0.01 * slow * level * (1 + rng.uniform(-spread, spread))
        rows.append(["decode/graph/busy", 0.01, measured, [4.0, 4000.0, 1.0], [1, 0], at])
    return rows


def test_the_oracles_remove_the_position_and_the_level_and_leave_the_spread() -> None:
    floor = noise_floor.floor_of(_rows(spread=0.05), 0.5)
    assert floor["recorded"]["p99_rel"] > 0.25  # the loss steps' 30%
    assert floor["oracle_position"]["p99_rel"] < 0.2  # the level's drift is left
    # both: the drift gone too; what is left is the ±5% of each step (no less) and the error of
    # a median of ten neighbours
    assert 0.04 < floor["oracle_both"]["p99_rel"] < 0.08 < floor["oracle_position"]["p99_rel"]
    within = floor["within_position"]
    assert abs(within["loss"]["ratio_median"] - 1.3) < 0.05
    assert set(within) == {"loss", "layers"}
    quiet = noise_floor.floor_of(_rows(spread=0.01), 0.5)
    assert quiet["oracle_both"]["p99_rel"] < 0.02


def test_the_host_part_is_told_from_the_gpus_where_the_table_times_the_gpu() -> None:
    """Steps whose spread is all the GPU's (a constant 1 ms of host time): the host part's spread
    is 0 and the GPU's share of the step is the rest; a table without gpu_s has no host part."""
    rows = _rows(spread=0.05)
    timed = [[*r, None, None, None, None, None, 0.0, r[2] - 0.001] for r in rows]  # type: ignore[operator]
    floor = noise_floor.floor_of(timed, 0.5)
    assert floor["host_part"]["spread_p99"] < 1e-9
    assert 0.85 < floor["host_part"]["gpu_share"] < 0.95  # (1 ms of ~10-13 ms)
    # a constant host part changes nothing; the GPU's part alone spreads more (1 ms less of each step)
    assert abs(floor["host_part"]["host_constant_p99"] - floor["recorded"]["p99_rel"]) < 1e-9
    assert floor["host_part"]["gpu_alone_p99"] > floor["recorded"]["p99_rel"]
    assert "host_part" not in noise_floor.floor_of(rows, 0.5)


def test_positions_follow_the_trainers_boundaries() -> None:
    assert noise_floor.position(None, NUM_LAYERS) == "between_tasks"
    assert noise_floor.position([-2, 0], NUM_LAYERS) == "start"
    assert noise_floor.position([-1, 0], NUM_LAYERS) == "commit"
    assert noise_floor.position([NUM_LAYERS, 3], NUM_LAYERS) == "loss"
    assert noise_floor.position([NUM_LAYERS - 1, 3], NUM_LAYERS) == "first_layer"
    assert noise_floor.position([0, 8], NUM_LAYERS) == "last_layer"
    assert noise_floor.position([7, 2], NUM_LAYERS) == "layers"


def test_main_reads_a_latency_result_and_writes_its_figures(tmp_path: Path) -> None:
    path = tmp_path / "latency.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"figures": {"steps": {"columns": [], "rows": _rows(spread=0.05)[:400]}}}, f)
    out = tmp_path / "floor.json"
    assert noise_floor.main([str(path), "--out", str(out)]) == 0
    figures = json.loads(out.read_text())["figures"]
    assert figures["summary"]["decode/graph/busy"]["oracle_both"]["tables"] == 1
    assert noise_floor.main([str(path), "--min-steps", "1000"]) == 1  # too few steps: said, not a crash


def test_steps_after_a_gap_are_told_from_back_to_back_ones() -> None:
    """A table with gap_s: the held-out steps that came 5 ms or more after the step before (here
    every fourth, 20% of its time slower than predicted) against the rest (as predicted)."""
    rows: list[list[object]] = []
    for i in range(400):
        slow = i % 4 == 0
        measured = 0.0125 if slow else 0.01
        rows.append(["decode/graph/busy", 0.01, measured, [4.0, 4000.0, 1.0], [1, 0], [3, 1],
                     False, [], 4, None, None, 0.0, None, 0.02 if slow else 0.001])
    floor = noise_floor.floor_of(rows, 0.5)
    gap = floor["by_gap"]
    assert gap["after_gap"]["signed_median"] == pytest.approx(0.2)
    assert gap["back_to_back"]["signed_median"] == pytest.approx(0.0) and gap["back_to_back"]["p99_rel"] < 1e-9
    assert gap["after_gap"]["n"] + gap["back_to_back"]["n"] == floor["recorded"]["n"] == 200
    assert "by_gap" not in noise_floor.floor_of([r[:13] for r in rows], 0.5)


def test_the_steps_after_a_gap_are_split_into_prompts_alone_and_ft_only_steps() -> None:
    """Of the held-out prefill steps after a gap, the prompts alone (no decodes, no FT rows; 1.25x
    their prediction, 9 ms on the GPU) and the FT-only steps (0.95x) are counted apart."""
    rows: list[list[object]] = []
    for i in range(400):
        after, alone = i % 4 == 0, i % 8 == 0
        chunks, ft, decodes = (1, 0, 0) if alone else (0, 2, 0) if after else (1, 0, 8)
        ratio = 1.25 if alone else 0.95 if after else 1.0
        rows.append(["prefill/graph/idle", 0.02, 0.02 * ratio, [0.0] * 7, [chunks, ft], None, False, [], decodes,
                     None, None, 0.0, 0.009 if alone else 0.018, 0.05 if after else 0.001])
    after_gap = noise_floor.floor_of(rows, 0.5)["by_gap"]["after_gap"]
    assert after_gap["prompt_alone"] == {"n": 25, "ratio_median": pytest.approx(1.25), "gpu_s_median": 0.009}
    assert after_gap["ft_only"] == {"n": 25, "ratio_median": pytest.approx(0.95), "gpu_s_median": 0.018}
    assert after_gap["n"] == 50

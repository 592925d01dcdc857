"""bench/latency_state_cost.py: a latency model with every graph-mode window full."""

from __future__ import annotations

from tests.bench.scripts import load_script

latency_state_cost = load_script("latency_state_cost")


def test_every_graph_mode_window_is_full_and_survives_its_state() -> None:
    model = latency_state_cost.full_model(5)
    windows = model.state_dict()["online"]["windows"]
    assert len(windows) == 12 and all(len(rows) == 5 for rows in windows.values())
    assert {name.split("|")[0] for name in windows} == {"prefill/graph", "decode/graph"}

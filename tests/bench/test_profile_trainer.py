"""bench/profile_trainer_cpu.py: the backward split into the stretches the trainer's spans name."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import coserve.trainer.backward as trainer_backward
from tests.bench.scripts import load_script

ROOT = Path(__file__).parents[2]
profile = load_script("profile_trainer_cpu")


@pytest.mark.parametrize("by_hand", [False, True])
@pytest.mark.parametrize("mlp_store", [False, True])
def test_each_layer_splits_into_the_trainers_stretches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       mlp_store: bool, by_hand: bool) -> None:
    monkeypatch.setattr(trainer_backward, "ATTN_BY_HAND", by_hand)
    out = tmp_path / "profile.json"
    argv = ["profile_trainer_cpu.py", "--layers", "2", "--reps", "2", "--warmup", "0", "--rows", "3",
            "--json", str(out)] + (["--mlp-store"] if mlp_store else [])
    monkeypatch.setattr(sys, "argv", argv)
    profile.main()
    f = json.loads(out.read_text())["figures"]
    expected = profile.STRETCHES_UNTRAINED_MLP
    if mlp_store:  # no gate/up recompute
        expected = tuple(n for n in expected if n != "gate/up recompute")
    for layer in (0, 1):
        got = [(p["part"], p["name"]) for p in f["parts"] if p["layer"] == layer]
        assert got == [(f"#{k}", name) for k, name in enumerate(expected)]
    # the loss's stretches come first, apart from the layers'
    loss = [p for p in f["parts"] if p["layer"] == 2]
    assert loss and all(p["name"] == "loss" for p in loss)
    assert all(p["host_ms"] > 0 for p in f["parts"])
    # autograd runs in the backward stretches only: o_proj's, the attention's and q/k/v's; with
    # the attention half's pieces by hand (COSERVE_TRAINER_ATTN_BY_HAND) the attention's alone
    backward = {p["part"] for p in f["parts"] if p["layer"] == 1 and p["autograd_nodes"] > 0}
    by_hand = (2,) if trainer_backward.ATTN_BY_HAND else (3, 2, 1)
    assert backward == {f"#{len(expected) - k}" for k in by_hand}
    assert f["mean_aten_ops"][f"#{len(expected) - 1}"] > 0


@pytest.mark.parametrize("by_hand", [False, True])
def test_the_trace_splits_one_layers_host_time_by_stretch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          by_hand: bool) -> None:
    monkeypatch.setattr(trainer_backward, "ATTN_BY_HAND", by_hand)
    out, chrome = tmp_path / "profile.json", tmp_path / "trace.json"
    monkeypatch.setattr(sys, "argv", ["profile_trainer_cpu.py", "--layers", "3", "--reps", "1", "--warmup", "0",
                                      "--rows", "3", "--trace", "--chrome-trace", str(chrome), "--json", str(out)])
    profile.main()
    traced = json.loads(out.read_text())["figures"]["trace"]
    assert list(traced) == [f"#{k}" for k in range(len(profile.STRETCHES_UNTRAINED_MLP))]
    for t in traced.values():
        assert 0 <= t["self_us"] <= t["range_us"] and t["top_ops_self_us"]
    # each stretch's own ops: the base GEMMs in the recomputes and backwards, the LoRA nodes' Python
    # (none with the attention half's pieces by hand)
    assert "aten::mm" in traced["#0"]["top_ops_self_us"] and "aten::mm" in traced["#8"]["top_ops_self_us"]
    nodes = not trainer_backward.ATTN_BY_HAND
    assert ("_LoRAGroupLinearFn" in traced["#0"]["top_ops_self_us"]) == nodes
    assert any("LoRAGroupLinearFnBackward" in name for name in traced["#8"]["top_ops_self_us"]) == nodes
    assert chrome.stat().st_size > 0



def test_the_gate_cost_bench_says_it_needs_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the bench runs (bench/first_call.sh trainer_stretches)")
    gate_cost = load_script("gate_cost")
    monkeypatch.setattr(sys, "argv", ["gate_cost.py"])
    with pytest.raises(SystemExit, match="needs a GPU"):
        gate_cost.main()
    assert gate_cost.per_call_us(lambda: None, 10, batches=3) >= 0.0

"""bench/profile_trainer_cpu.py: the backward split into the stretches the trainer's spans name."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
spec = importlib.util.spec_from_file_location("profile_trainer_cpu", ROOT / "bench" / "profile_trainer_cpu.py")
assert spec is not None and spec.loader is not None
profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile)


@pytest.mark.parametrize("mlp_store", [False, True])
def test_each_layer_splits_into_the_trainers_stretches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       mlp_store: bool) -> None:
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
    # autograd runs in the backward stretches only: o_proj's, the attention's and q/k/v's
    backward = {p["part"] for p in f["parts"] if p["layer"] == 1 and p["autograd_nodes"] > 0}
    assert backward == {f"#{len(expected) - k}" for k in (3, 2, 1)}
    assert f["mean_aten_ops"][f"#{len(expected) - 1}"] > 0

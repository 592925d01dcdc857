"""Epoch checkpoints (``--epoch-checkpoints``): the adapters of a run's last epochs' ends, kept
beside its final adapter, listed as OpenAI's fine-tuning checkpoints and served under their own
model names once a job has ended."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from coserve.models.peft_adapter import load_peft_adapter
from coserve.server.finetune import epoch_checkpoints

DATA = Path(__file__).resolve().parents[2] / "src" / "coserve" / "data" / "tiny_facts.jsonl"


def test_finetune_keeps_the_last_epochs_adapters(tmp_path: Path) -> None:
    from coserve.server.cli import main

    data = tmp_path / "facts.jsonl"
    data.write_text("\n".join(DATA.read_text().splitlines()[:8]) + "\n")
    out = tmp_path / "run"
    # an earlier run's checkpoints in the same OUTPUT go: a new run's are its own
    (out / "checkpoints" / "step-99").mkdir(parents=True)
    (out / "checkpoints" / "step-99" / "checkpoint.json").write_text(json.dumps({"step_number": 99}))
    assert main(["finetune", "--model", "tiny", "--device", "cpu", "--data", str(data), "--output", str(out),
                 "--epochs", "4", "--lr", "1e-3", "--backward-tokens", "64", "--trainer-threads", "1",
                 "--save-every", "0", "--epoch-checkpoints", "2"]) == 0
    kept = epoch_checkpoints(out)
    assert [c["epoch"] for c in kept] == [4, 3], "the last two epochs, newest first"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == sorted(f"step-{c['step_number']}" for c in kept)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert kept[0]["step_number"] == len(log), "the last epoch ends at the last step"
    for c in kept:
        entry = log[c["step_number"] - 1]
        assert c["train_loss"] == entry["loss"]
        # the epoch's samples were all trained by that step, and not before it
        trained = sum(len(e["sample_ids"]) for e in log[:c["step_number"]])
        assert trained >= 8 * c["epoch"] > trained - len(entry["sample_ids"])
    final, last, before = (load_peft_adapter(p) for p in (out / "adapter", kept[0]["path"], kept[1]["path"]))
    for key, (a, b) in final.weights.items():
        assert torch.equal(a, last.weights[key][0]) and torch.equal(b, last.weights[key][1])
    assert any(not torch.equal(b, before.weights[key][1]) for key, (_, b) in final.weights.items())

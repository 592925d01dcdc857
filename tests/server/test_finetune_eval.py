"""``coserve finetune --eval-data``: the held-out loss before and after training, through the
engine's prompt log-probabilities (``coserve.server.finetune.evaluate``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from coserve import EngineConfig, LLMEngine
from coserve.core.finetune import IGNORE_INDEX, load_dataset
from coserve.server.finetune import evaluate

DATA = Path(__file__).resolve().parents[2] / "src" / "coserve" / "data" / "tiny_facts.jsonl"


def test_evaluate_is_the_training_loss_of_the_model() -> None:
    """The mean cross-entropy over target tokens, as the trainer's loss counts it, from a plain
    forward of the same model."""
    engine = LLMEngine(EngineConfig(model="tiny", device="cpu"))
    assert engine.tokenizer is not None
    samples = load_dataset(DATA, engine.tokenizer, max_seq_len=64).samples[:6]
    got = evaluate(engine, samples)
    model = engine.model
    from coserve.layers.attention import AttentionMetadata
    from coserve.models.llama import ForwardContext

    total, count, correct = 0.0, 0, 0
    for s in samples:
        ids = torch.tensor(s.input_ids)
        meta = AttentionMetadata.build([len(ids)], [0], [[]], [False], 1, 16)
        with torch.no_grad():
            logits = model.compute_logits(model(ids, torch.arange(len(ids)), ForwardContext(attn=meta))).float()
        labels = torch.tensor(s.labels[1:])
        total += float(F.cross_entropy(logits[:-1], labels, ignore_index=IGNORE_INDEX, reduction="sum"))
        count += int((labels != IGNORE_INDEX).sum())
        correct += int(((logits[:-1].argmax(-1) == labels) & (labels != IGNORE_INDEX)).sum())
    assert got.tokens == count and got.samples == 6
    assert got.loss == pytest.approx(total / count, rel=1e-4)
    assert got.accuracy == correct / count, "the share of target tokens the model ranks first"
    assert not engine.has_unfinished_requests()


def test_finetune_reports_the_eval_loss_before_and_after(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from coserve.server.cli import main

    out = tmp_path / "run"
    assert main(["finetune", "--model", "tiny", "--device", "cpu", "--data", str(DATA), "--output", str(out),
                 "--eval-data", str(DATA), "--epochs", "3", "--lr", "1e-3", "--backward-tokens", "256",
                 "--trainer-threads", "1", "--save-every", "0"]) == 0
    report = json.loads((out / "eval.json").read_text())
    assert report["tokens"] > 0 and report["optimizer_steps"] > 0
    assert report["loss_after"] < report["loss_before"] - 1.0, report  # it learned the facts it was shown
    printed = capsys.readouterr().out
    assert "eval loss" in printed
    assert f"dataset {DATA}: 64 samples, 2243 tokens (0 malformed rows skipped, 0 truncated)" in printed


def test_an_output_that_cannot_be_made_stops_the_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from coserve.server.cli import main

    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "run"
    assert main(["finetune", "--model", "tiny", "--device", "cpu", "--data", str(DATA), "--output", str(out)]) == 2
    assert f"--output {out}: cannot create it" in capsys.readouterr().err

"""Workload resolution (traces by path or name, synthetic bursts), configuration and FT-length
parsing."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from coserve.bench.configs import CONFIGS, parse_configs
from coserve.bench.ftdata import parse_lengths, write_ft_dataset
from coserve.bench.workload import BURSTS, Scaling, find_trace, load_workload


def write_trace(path: Path) -> Path:
    rows = ["arrival_s,prompt_tokens,output_tokens"]
    rows += [f"{t},{100 + t},{10}" for t in range(0, 100, 10)]  # one request every 10 s
    rows += [f"{50 + i / 10},{200},{20}" for i in range(8)]  # a burst of 8 at 50 s
    path.write_text("\n".join(rows) + "\n")
    return path


def test_trace_window_holds_the_largest_burst(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.csv")
    w = load_workload(str(path), 20.0, Scaling(length=0.5))
    assert (w.name, w.source, w.window_start_s) == ("t", str(path), 40.0)
    times = [a.time_s for a in w.arrivals]
    assert times[0] == 0.0 and max(times) < 20.0 and len(times) == 10  # 40, 50 and the burst of 8
    assert sorted({a.prompt_tokens for a in w.arrivals}) == [70, 75, 100]  # (140, 150, 200) × 0.5


def test_trace_by_name_in_search_dirs(tmp_path: Path) -> None:
    write_trace(tmp_path / "mine.csv")
    assert find_trace("mine", (tmp_path / "nowhere", tmp_path)) == tmp_path / "mine.csv"
    with pytest.raises(FileNotFoundError, match="burst-light"):
        find_trace("absent", (tmp_path,))


@pytest.mark.parametrize("name", sorted(BURSTS))
def test_synthetic_window_is_seeded_and_holds_a_burst(name: str) -> None:
    pattern = BURSTS[name]
    a = load_workload(name, 20.0, Scaling(rate=0.5), seed=3)
    b = load_workload(name, 20.0, Scaling(rate=0.5), seed=3)
    assert a == b and a.source == "synthetic"
    per_second: dict[int, int] = {}
    for x in a.arrivals:
        per_second[int(x.time_s)] = per_second.get(int(x.time_s), 0) + 1
    assert max(per_second.values()) > 3 * pattern.base_rate * 0.5  # the burst is in the window
    assert load_workload(name, 20.0, Scaling(rate=0.5), seed=4) != a


def test_parse_configs_puts_the_reference_first() -> None:
    assert [c.name for c in parse_configs("split,full,split")] == ["inference", "split", "full"]
    assert [c.name for c in parse_configs(",".join(CONFIGS))] == list(CONFIGS)
    assert CONFIGS["full-noint"].policy == "full" and not CONFIGS["full-noint"].interrupt_ft_only
    with pytest.raises(ValueError, match="--configs: unknown fast"):
        parse_configs("full,fast")


def test_full_overlap_carries_its_pause_policy_into_the_coserver_slo(tmp_path: Path) -> None:
    """full-overlap is full with the backward paused by the latency model alone; the runner's
    FinetuneSpec (what the co-server is built from) carries that, the other configurations keep
    the default."""
    from types import SimpleNamespace
    from typing import cast

    from coserve.bench.runners import BenchContext, TrainingSetup, _session_spec
    from coserve.core.config import LoRAConfig, OptimConfig, SLOConfig

    training = TrainingSetup(data=tmp_path / "ft.jsonl", max_seq_len=64, backward_tokens=64,
                             lora=LoRAConfig(), optim=OptimConfig(), naive_tokens=256,
                             split_mps_percentage=50)
    ctx = cast(BenchContext, SimpleNamespace(training=training, work=tmp_path, seed=0,
                                             slo=SLOConfig(ttft_slo_s=0.5, tpot_slo_s=0.05)))
    overlap, full = CONFIGS["full-overlap"], CONFIGS["full"]
    assert (overlap.kind, overlap.policy, overlap.interrupt_ft_only) == (full.kind, full.policy, True)
    slo = _session_spec(ctx, overlap).slo
    assert (slo.policy, slo.pause_prefill, slo.ttft_slo_s, slo.tpot_slo_s) == ("full", "model", 0.5, 0.05)
    for name in ("temporal", "full", "full-noint", "naive"):
        assert _session_spec(ctx, CONFIGS[name]).slo.pause_prefill == "always", name
    assert _session_spec(ctx, full).trainer_sm_share is None
    ctx.training = replace(training, trainer_sm_share=70)
    assert all(_session_spec(ctx, CONFIGS[name]).trainer_sm_share == 70 for name in ("full", "full-overlap"))
    # a configuration's own share (NAME@N) takes the place of --trainer-sm-share
    (at_50,) = [c for c in parse_configs("full@50") if c.name == "full@50"]
    assert _session_spec(ctx, at_50).trainer_sm_share == 50 and _session_spec(ctx, at_50).slo.policy == "full"


def test_ft_lengths_and_dataset(tmp_path: Path) -> None:
    fixed, spread = parse_lengths("fixed:512"), parse_lengths("spread:256-1024")
    assert (fixed.lo, fixed.hi, spread.lo, spread.hi) == (512, 512, 256, 1024)
    for bad in ("fixed", "uniform:3-4", "spread:9", "spread:10-5", "fixed:x"):
        with pytest.raises(ValueError, match="--ft-lengths"):
            parse_lengths(bad)
    path = write_ft_dataset(tmp_path / "ft.jsonl", 50, parse_lengths("spread:8-16"), vocab_size=100)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 50 and all(8 <= len(r["input_ids"]) <= 16 for r in rows)
    assert all(10 <= t < 100 for r in rows for t in r["input_ids"])
    r = random.choice(rows)
    masked = len(r["input_ids"]) // 4
    assert r["labels"] == [-100] * masked + r["input_ids"][masked:]


def test_model_shape_directory(tmp_path: Path) -> None:
    from coserve.bench.shapes import is_shape, materialize
    from coserve.models.config import ModelConfig
    from coserve.models.tokenizer import Tokenizer

    assert is_shape("shape:llama3-8b") and not is_shape("tiny")
    path = materialize("shape:llama3-8b", tmp_path)
    cfg = ModelConfig.from_dir(path)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads) == (32, 4096, 8)
    assert Tokenizer.from_dir(path).vocab_size == 1024
    with pytest.raises(ValueError, match="shape:llama3-8b"):
        materialize("shape:gpt5", tmp_path)


def test_prompts_are_clipped_to_fit_the_models_context() -> None:
    """A trace's long prompts would stop a small model's run at the first request over its context."""
    scaling = Scaling(max_prompt=4096, max_output=100)
    said: list[str] = []
    fitted = scaling.fit(2048, said.append)
    assert (fitted.max_prompt, fitted.max_output) == (1948, 100)
    assert said == ["prompts clipped to 1948 tokens (--max-prompt 4096): the model's context is 2048 tokens "
                    "and outputs go up to 100"]
    assert fitted.apply(load_workload("burst-light", 10, Scaling()).arrivals[0]).prompt_tokens <= 1948
    assert scaling.fit(8192, said.append) is scaling and len(said) == 1  # they fit: unchanged, nothing said
    with pytest.raises(ValueError, match="--max-output 100 leaves no room"):
        scaling.fit(100, said.append)

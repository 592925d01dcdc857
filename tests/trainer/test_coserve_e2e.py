"""Fine-tuning inside the engine, end to end: FT rows share steps with inference requests, the
trainer runs in its own process, and the adapter equals what a plain transformers + peft loop
produces from the same samples in the same optimizer steps (read back from train_log.jsonl)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from coserve import EngineConfig, LLMEngine, SamplingParams
from coserve.core.config import CoServeConfig, LoRAConfig, OptimConfig
from coserve.models.peft_adapter import load_peft_adapter, new_lora_adapter, save_peft_adapter
from coserve.models.presets import preset_path
from coserve.server.finetune import FinetuneSession, FinetuneSpec
from tests.conftest import make_hf_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# NOTE: atol 1e-5 on weights of scale ~5e-2: AdamW divides by sqrt(v), so an entry whose gradient
# is near zero turns fp32 summation-order noise (different kernels, same math) into ~1e-6 moves.
ATOL = 1e-5
SCHEDULER_NAMES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_hf_model(tmp_path_factory.mktemp("e2e") / "llama", "llama", vocab_size=1024)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(preset_path("tiny") / name, path / name)
    return path


def write_dataset(path: Path, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        length = rng.randint(6, 30)
        ids = [rng.randrange(6, 1024) for _ in range(length)]
        prompt = rng.randint(1, length - 2)
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def init_adapter(model_dir: Path, out: Path, lora: LoRAConfig) -> Path:
    """A random initial adapter with B != 0, so that every step moves every parameter."""
    cfg = json.loads((model_dir / "config.json").read_text())
    shapes = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64),
              "gate_proj": (112, 64), "up_proj": (112, 64), "down_proj": (64, 112)}
    adapter = new_lora_adapter(num_layers=cfg["num_hidden_layers"], shapes=shapes, rank=lora.rank,
                               alpha=lora.alpha, target_modules=lora.target_modules, seed=3)
    gen = torch.Generator().manual_seed(4)
    weights = {k: (a, torch.randn(b.shape, generator=gen) * 0.05) for k, (a, b) in adapter.weights.items()}
    save_peft_adapter(replace(adapter, weights=weights), out)
    return out


def peft_reference(model_dir: Path, init_dir: Path, rows: list[dict], log: list[dict],
                   optim: OptimConfig) -> tuple[dict, list[float]]:
    """The plain transformers + peft loop, fed the logged optimizer steps."""
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, init_dir, is_trainable=True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, eps=optim.eps,
                            weight_decay=optim.weight_decay)
    sched = transformers.get_scheduler(SCHEDULER_NAMES[optim.lr_scheduler], opt,
                                       num_warmup_steps=optim.warmup_steps,
                                       num_training_steps=optim.total_steps)
    losses = []
    for entry in log:
        targets = [torch.tensor(rows[i]["labels"][1:]) for i in entry["sample_ids"]]
        total = sum(int((t != -100).sum()) for t in targets)
        step_loss = 0.0
        for i, target in zip(entry["sample_ids"], targets, strict=True):
            logits = model(input_ids=torch.tensor([rows[i]["input_ids"]])).logits[0, :-1]
            keep = target != -100
            loss = F.cross_entropy(logits[keep], target[keep], reduction="sum")
            (loss / total).backward()
            step_loss += loss.item()
        if optim.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, optim.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(step_loss / total)
    out = init_dir.parent / "peft_out"
    model.save_pretrained(out)
    return load_peft_adapter(out).weights, losses


def drive(engine: LLMEngine, session: FinetuneSession, prompts: list[list[int]], kill_after_task: bool = False
          ) -> tuple[dict[str, list[int]], int]:
    """Feed inference requests while fine-tuning runs; returns outputs and the count of mixed steps."""
    mixed = 0
    original = session.coserver.on_step_end

    def count(record):  # type: ignore[no-untyped-def]
        nonlocal mixed
        mixed += int(record.ft_tokens > 0 and record.view.has_inference)
        original(record)

    session.coserver.on_step_end = count  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    killed = not kill_after_task
    steps = 0
    while not session.done or engine.has_unfinished_requests() or pending:
        if pending and steps % 3 == 0:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, params)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        if not killed and session.coserver.backward_running:
            os.kill(session.trainer.pid, signal.SIGKILL)  # type: ignore[arg-type]
            killed = True
        if not session.done and not engine.has_unfinished_requests():
            session.wait(0.05)
        steps += 1
        assert steps < 5000
    return outputs, mixed


def coserve_run(engine: LLMEngine, tmp_path: Path, lora: LoRAConfig, optim: OptimConfig, init: Path,
                backward_tokens: int, *, epochs: int, num_prompts: int
                ) -> tuple[FinetuneSession, list[list[int]], dict[str, list[int]], int, Path]:
    """Fine-tune on ``tmp_path/data.jsonl`` while ``num_prompts`` requests are served; returns the
    (closed) session, the prompts, their outputs, the count of mixed steps and the adapter."""
    spec = FinetuneSpec(data=tmp_path / "data.jsonl", output=tmp_path / "out", lora=lora, optim=optim,
                        coserve=CoServeConfig(backward_tokens=backward_tokens, max_seq_len=64, epochs=epochs, seed=5),
                        init_adapter=init, trainer_threads=1)
    session = FinetuneSession(engine, spec)
    prompts = [[random.Random(i).randrange(6, 1024) for _ in range(5 + i)] for i in range(num_prompts)]
    outputs, mixed = drive(engine, session, prompts)
    adapter_dir = session.export()
    session.close()
    return session, prompts, outputs, mixed, adapter_dir


def assert_trained_like_peft(model_dir: Path, init: Path, rows: list[dict], out: Path, adapter_dir: Path,
                             optim: OptimConfig) -> list[dict]:
    """The run's optimizer steps (``train_log.jsonl``), replayed by a plain transformers + peft
    loop, give its per-step losses and its adapter; returns the log."""
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    expected, ref_losses = peft_reference(model_dir, init, rows, log, optim)
    assert [e["loss"] for e in log] == pytest.approx(ref_losses, rel=1e-5)
    got = load_peft_adapter(adapter_dir).weights
    assert got.keys() == expected.keys()
    for key, (a, b) in expected.items():
        torch.testing.assert_close(got[key][0], a, rtol=1e-4, atol=ATOL, msg=lambda m, k=key: f"A {k}: {m}")
        torch.testing.assert_close(got[key][1], b, rtol=1e-4, atol=ATOL, msg=lambda m, k=key: f"B {k}: {m}")
    return log


@pytest.mark.parametrize(
    "lora, optim, backward_tokens",
    [
        (LoRAConfig(rank=8, alpha=16, target_modules=("q_proj", "v_proj")),
         OptimConfig(lr=1e-2, max_grad_norm=0.0), 48),
        (LoRAConfig(rank=16, alpha=8, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj")),
         OptimConfig(lr=5e-3, weight_decay=0.1, lr_scheduler="cosine", warmup_steps=2, max_grad_norm=0.5,
                     accumulation_tasks=2), 40),
    ],
    ids=["r8-qv", "r16-all-accum-cosine-clip"],
)
def test_coserved_adapter_equals_peft_loop(model_dir: Path, tmp_path: Path, lora: LoRAConfig,
                                           optim: OptimConfig, backward_tokens: int) -> None:
    rows = write_dataset(tmp_path / "data.jsonl", 14, seed=lora.rank)
    init = init_adapter(model_dir, tmp_path / "init", lora)
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_training_slots=1, max_lora_rank=16,
                                    max_num_batched_tokens=96))
    session, prompts, outputs, mixed, adapter_dir = coserve_run(engine, tmp_path, lora, optim, init, backward_tokens,
                                                                epochs=2, num_prompts=8)
    assert mixed > 0, "no step carried inference and fine-tuning rows together"

    log = assert_trained_like_peft(model_dir, init, rows, tmp_path / "out", adapter_dir, session.optim)
    trained = sorted(i for e in log for i in e["sample_ids"])
    assert trained == sorted(list(range(len(rows))) * 2), "every sample once per epoch"

    # Inference rows are unaffected by the fine-tuning rows that shared their steps.
    plain = LLMEngine(EngineConfig(model=str(model_dir), max_num_batched_tokens=96))
    for i, p in enumerate(prompts):
        plain.add_request(f"r{i}", p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    reference: dict[str, list[int]] = {}
    while plain.has_unfinished_requests():
        for out in plain.step():
            if out.finished:
                reference[out.request_id] = out.outputs[0].token_ids
    assert outputs == reference


def test_trainer_killed_mid_task_recovers(model_dir: Path, tmp_path: Path) -> None:
    lora = LoRAConfig(rank=8, alpha=16, target_modules=("q_proj", "v_proj"))
    optim = OptimConfig(lr=1e-2, max_grad_norm=0.0)
    rows = write_dataset(tmp_path / "data.jsonl", 12, seed=7)
    init = init_adapter(model_dir, tmp_path / "init", lora)
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_training_slots=1, max_lora_rank=16,
                                    max_num_batched_tokens=96))
    spec = FinetuneSpec(data=tmp_path / "data.jsonl", output=tmp_path / "out", lora=lora, optim=optim,
                        coserve=CoServeConfig(backward_tokens=48, max_seq_len=64, epochs=1, seed=5),
                        init_adapter=init, trainer_threads=1)
    session = FinetuneSession(engine, spec)
    prompts = [[3 + i, 7, 9, 11] for i in range(10)]
    outputs, _ = drive(engine, session, prompts, kill_after_task=True)
    adapter_dir = session.export()
    session.close()
    assert session.coserver.num_restarts == 1
    assert len(outputs) == len(prompts), "inference kept serving while the trainer was down"
    log = [json.loads(line) for line in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    assert sorted(i for e in log for i in e["sample_ids"]) == list(range(len(rows)))
    expected, _ = peft_reference(model_dir, init, rows, log, session.optim)
    got = load_peft_adapter(adapter_dir).weights
    for key, (a, b) in expected.items():
        torch.testing.assert_close(got[key][0], a, rtol=1e-4, atol=ATOL)
        torch.testing.assert_close(got[key][1], b, rtol=1e-4, atol=ATOL)


def test_coserving_through_prefill_graphs_equals_the_peft_loop(model_dir: Path, tmp_path: Path) -> None:
    """The same parity with the engine's steps through the piecewise prefill graphs (their
    static-buffer path, run eagerly here): FT rows on the training slot, their capture between
    segments, inference rows beside them."""
    from tests.conftest import triton_unavailable

    reason = triton_unavailable()
    if reason is not None:
        pytest.skip(reason)
    lora = LoRAConfig(rank=8, alpha=16, target_modules=("q_proj", "v_proj"))
    optim = OptimConfig(lr=1e-2, max_grad_norm=0.0)
    rows = write_dataset(tmp_path / "data.jsonl", 8, seed=3)
    init = init_adapter(model_dir, tmp_path / "init", lora)
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_training_slots=1, max_lora_rank=16,
                                    max_num_batched_tokens=96, lora_backend="triton"))
    runner = engine.runner
    runner.prefill_graphs = pieces = runner.make_prefill_graphs(capture=False)
    assert pieces.lora_scales is not None
    hooked: list[bool] = []

    def counted(*args, run=pieces.run, **kwargs):  # type: ignore[no-untyped-def]
        hooked.append(len(args) > 4 and args[4] is not None)
        return run(*args, **kwargs)

    pieces.run = counted  # type: ignore[method-assign]
    session, _, _, mixed, adapter_dir = coserve_run(engine, tmp_path, lora, optim, init, 48, epochs=1, num_prompts=4)
    assert mixed > 0 and any(hooked), "no fine-tuning step went through the prefill graphs"
    assert_trained_like_peft(model_dir, init, rows, tmp_path / "out", adapter_dir, session.optim)


def test_resume_from_checkpoint_continues_the_run(model_dir: Path, tmp_path: Path) -> None:
    lora = LoRAConfig(rank=8, alpha=16, target_modules=("q_proj", "v_proj"))
    optim = OptimConfig(lr=1e-2, max_grad_norm=0.0, lr_scheduler="linear", total_steps=12)
    rows = write_dataset(tmp_path / "data.jsonl", 12, seed=9)
    init = init_adapter(model_dir, tmp_path / "init", lora)

    def session(resume: bool) -> tuple[LLMEngine, FinetuneSession]:
        engine = LLMEngine(EngineConfig(model=str(model_dir), num_training_slots=1, max_lora_rank=16))
        spec = FinetuneSpec(data=tmp_path / "data.jsonl", output=tmp_path / "out", lora=lora, optim=optim,
                            coserve=CoServeConfig(backward_tokens=40, max_seq_len=64, epochs=2, seed=5),
                            init_adapter=init, trainer_threads=1, save_every=1, resume=resume)
        return engine, FinetuneSession(engine, spec)

    engine, first = session(resume=False)
    while first.coserver.steps_done < 3:
        engine.step()
        first.wait(0.05)
    first.close()  # the run stops here; its checkpoint holds step 3 (or a later one)
    engine, second = session(resume=True)
    assert second.coserver.steps_done >= 3
    # the server's stats start from the resumed counts (its first progress interval's rates too)
    from coserve.server.engine_thread import EngineThread
    stats = EngineThread(engine, second).stats
    assert (stats.ft_optimizer_steps, stats.ft_tokens_trained) == (second.coserver.steps_done,
                                                                   second.coserver.tokens_trained)
    assert stats.ft_samples_retired == second.pool.progress.samples_retired > 0
    assert stats.ft_first_loss == first.history[0].loss is not None, "the run's first loss, from before the resume"
    while not second.done:
        if not engine.step():
            second.wait(0.05)
    adapter_dir = second.export()
    second.close()
    log = [json.loads(line) for line in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log] == list(range(len(log)))
    assert sorted(i for e in log for i in e["sample_ids"]) == sorted(list(range(len(rows))) * 2)
    expected, _ = peft_reference(model_dir, init, rows, log, second.optim)
    got = load_peft_adapter(adapter_dir).weights
    for key, (a, b) in expected.items():
        torch.testing.assert_close(got[key][0], a, rtol=1e-4, atol=ATOL)
        torch.testing.assert_close(got[key][1], b, rtol=1e-4, atol=ATOL)


def test_lora_dropout_uses_the_same_masks_in_capture_and_recompute(model_dir: Path, tmp_path: Path) -> None:
    """One co-served optimizer step with dropout equals full autograd through the model with the
    trainer's masks: the engine's capture forward applied exactly those masks."""
    from coserve.layers.attention import AttentionMetadata
    from coserve.models.llama import ForwardContext
    from coserve.trainer.lora_params import TrainableLoRA
    from coserve.trainer.optim import LoRAOptimizer

    lora = LoRAConfig(rank=8, alpha=16, dropout=0.3, target_modules=("q_proj", "v_proj", "o_proj"))
    optim = OptimConfig(lr=1e-2, max_grad_norm=0.0)
    rows = write_dataset(tmp_path / "data.jsonl", 4, seed=11)
    init = init_adapter(model_dir, tmp_path / "init", lora)
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_training_slots=1, max_lora_rank=16))
    spec = FinetuneSpec(data=tmp_path / "data.jsonl", output=tmp_path / "out", lora=lora, optim=optim,
                        coserve=CoServeConfig(backward_tokens=1000, max_seq_len=64, epochs=1, seed=5),
                        init_adapter=init, trainer_threads=1)
    session = FinetuneSession(engine, spec)
    while not session.done:
        if not engine.step():
            session.wait(0.05)
    got = session.trainer.committed_adapter()
    session.close()
    log = [json.loads(line) for line in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 1

    ref = TrainableLoRA(load_peft_adapter(init), dropout=lora.dropout, seed=5)
    model = engine.model
    order = log[0]["sample_ids"]
    ids = [rows[i]["input_ids"] for i in order]
    lens = [len(x) for x in ids]
    meta = AttentionMetadata.build(lens, [0] * len(lens), [[] for _ in lens], [False] * len(lens), len(lens), 16)
    positions = torch.cat([torch.arange(n) for n in lens])
    hidden = model(torch.tensor([t for x in ids for t in x]), positions,
                   ForwardContext(attn=meta, lora=ref.context(0, lens)))
    logits = model.compute_logits(hidden)
    total, loss = 0, torch.zeros(())
    start = 0
    for i, n in zip(order, lens, strict=True):
        target = torch.tensor(rows[i]["labels"][1:])
        keep = target != -100
        loss = loss + F.cross_entropy(logits[start : start + n - 1][keep], target[keep], reduction="sum")
        total += int(keep.sum())
        start += n
    loss.backward()
    LoRAOptimizer(ref, session.optim).step(total, float(loss.detach()))
    assert log[0]["loss"] == pytest.approx(float(loss.detach()) / total, rel=1e-5)
    expected = ref.to_adapter().weights
    for key, (a, b) in expected.items():
        torch.testing.assert_close(got.weights[key][0], a, rtol=1e-4, atol=ATOL)
        torch.testing.assert_close(got.weights[key][1], b, rtol=1e-4, atol=ATOL)

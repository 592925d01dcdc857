"""``coserve demo``: a bursty inference workload served while the same engine fine-tunes.

Runs the workload twice on the same arrivals — inference only, then co-serving — and prints
live progress and a side-by-side summary. Defaults: the built-in tiny model on CPU and the
built-in ``tiny_facts`` dataset, so it runs on a fresh machine with no downloads.
"""

from __future__ import annotations

import argparse
import logging
import math
import tempfile
import time
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch

from coserve.bench.metrics import attainment, latency_summary
from coserve.bench.replay import InProcessDriver, ReplayResult, Snapshot
from coserve.bench.workload import BurstPattern, Scaling, synthetic
from coserve.core.config import CoServeConfig, LoRAConfig, OptimConfig
from coserve.core.finetune import iter_rows
from coserve.data import builtin_dataset, resolve_dataset
from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.engine.sampling_params import SamplingParams
from coserve.engine.sequence import LoRARequest
from coserve.server.cli import add_slo_args, slo_config
from coserve.server.finetune import FinetuneSession, FinetuneSpec, read_dataset

logger = logging.getLogger(__name__)

# Scaled so that the tiny model on two CPU cores is busy in bursts and idle in between.
DEMO_PATTERN = BurstPattern(base_rate=1.5, peak_rate=12.0, peak_s=2.0, period_s=10.0, prompt_mean=48,
                            output_mean=16)


@dataclass(frozen=True)
class DemoResult:
    name: str
    replay: ReplayResult
    attainment: float
    ft_tokens_per_s: float
    loss_first: float | None = None
    loss_last: float | None = None


def add_demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per run")
    add_slo_args(p, ttft_ms=250.0, tpot_ms=25.0)
    p.add_argument("--data", default=None, help="fine-tuning data (default: the built-in tiny_facts)")
    p.add_argument("--output", default=None, help="where the adapter and train_log.jsonl go (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--idle-train-s", type=float, default=20.0,
                   help="after the co-serving run, keep fine-tuning on the idle engine for at most this long "
                        "while the loss is above --target-loss (0: not at all)")
    p.add_argument("--target-loss", type=float, default=0.1,
                   help="the idle phase stops once the mean loss of the last three optimizer steps is at most this")


def _printer(name: str, ttft_slo: float, tpot_slo: float, ft_loss: callable | None = None):  # type: ignore[valid-type]
    def tick(s: Snapshot) -> None:
        summ = latency_summary(s.finished)
        att = attainment(s.finished, ttft_slo, tpot_slo) if s.finished else float("nan")
        line = (f"[{name:>9}] t={s.t:5.1f}s arrived={s.arrived:4d} served={len(s.finished):4d} "
                f"TTFT p50={summ['ttft_p50_ms']:6.0f}ms p99={summ['ttft_p99_ms']:6.0f}ms "
                f"TPOT p50={summ['tpot_p50_ms']:5.1f}ms p99={summ['tpot_p99_ms']:5.1f}ms SLO={att * 100:5.1f}% "
                f"FT {s.ft_tokens / max(s.t, 1e-9):6.0f} tok/s")
        if ft_loss is not None:
            loss = ft_loss()
            line += f" loss={loss:.3f}" if loss is not None else " loss=-"
        print(line, flush=True)

    return tick


def check_demo_args(args: argparse.Namespace) -> None:
    """The demo's own numeric flags (the SLO flags are checked by :func:`slo_config`)."""
    if not (math.isfinite(args.duration) and args.duration > 0):
        raise ValueError(f"--duration must be a positive finite number of seconds, got {args.duration:g}")
    if not (math.isfinite(args.idle_train_s) and args.idle_train_s >= 0):
        raise ValueError(f"--idle-train-s must be a finite number of seconds >= 0 (0: no idle phase), "
                         f"got {args.idle_train_s:g}")
    if not math.isfinite(args.target_loss):
        raise ValueError(f"--target-loss must be a finite number, got {args.target_loss:g}")


def run_demo(args: argparse.Namespace) -> int:
    # Every flag, the dataset and the output directory are checked before the inference-only run:
    # a bad one failed only after it, or at the very end.
    check_demo_args(args)
    slo = slo_config(args)
    data = resolve_dataset(args.data) if args.data else builtin_dataset()
    out = Path(args.output) if args.output else Path(tempfile.mkdtemp(prefix="coserve-demo-"))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--output {out}: cannot create it: {e.strerror or e}") from e
    torch.set_num_threads(1)  # the trainer process gets the other core
    ttft, tpot = args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3
    arrivals = synthetic(DEMO_PATTERN, args.duration, Scaling(max_prompt=256, max_output=64), seed=args.seed)
    print(f"workload: {len(arrivals)} requests over {args.duration:g}s (bursts of {DEMO_PATTERN.peak_rate:.0f} req/s "
          f"for {DEMO_PATTERN.peak_s:.0f}s every {DEMO_PATTERN.period_s:.0f}s); SLO: TTFT <= {args.ttft_slo_ms:.0f}ms, "
          f"TPOT <= {args.tpot_slo_ms:.0f}ms", flush=True)
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, num_training_slots=1, max_lora_rank=16,
                                    max_num_batched_tokens=512, seed=args.seed))
    spec = FinetuneSpec(
        data=data, output=out,
        lora=LoRAConfig(rank=16, alpha=32, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj")),
        optim=OptimConfig(lr=2e-3, max_grad_norm=1.0),
        coserve=CoServeConfig(backward_tokens=128, max_seq_len=64, epochs=1000, seed=args.seed),
        slo=slo,
        trainer_threads=1, calibrate=True, epoch_checkpoints=0,  # (its epochs: until it stops)
    )
    # NOTE: read twice, here and by the session after the inference-only run (which must not have
    # the trainer beside it); the demo's data is small
    read_dataset(engine, spec.data, spec.coserve)
    questions = _questions(spec.data)
    driver = InProcessDriver(engine, seed=args.seed)
    driver.run(arrivals[:8], duration_s=1.0, drain_s=5.0)  # warm-up

    base = driver.run(arrivals, duration_s=args.duration, tick=_printer("inference", ttft, tpot), tick_every_s=2.0)
    results = [DemoResult("inference", base, attainment(base.records, ttft, tpot), 0.0)]

    session = FinetuneSession(engine, spec)
    print(f"latency model calibrated; fine-tuning policy {args.ft_policy!r} on {spec.data.name}", flush=True)
    try:
        co = driver.run(arrivals, duration_s=args.duration, ft_tokens=lambda: session.coserver.tokens_trained,
                        idle_wait=session.wait,
                        tick=_printer("co-serve", ttft, tpot, lambda: session.coserver.last_loss), tick_every_s=2.0)
        losses = [h.loss for h in session.history if h.loss is not None]
        idle = _train_while_idle(engine, session, args.idle_train_s, args.target_loss)
        adapter = session.export()
    finally:
        session.close()
    results.append(DemoResult("co-serve", co, attainment(co.records, ttft, tpot), co.ft_tokens / co.duration_s,
                              losses[0] if losses else None, losses[-1] if losses else None))
    print()
    print(f"{'run':<10} {'requests':>8} {'SLO attained':>12} {'TTFT p99':>9} {'TPOT p99':>9} {'FT tok/s':>9} "
          f"{'loss start -> end':>18}")
    for r in results:
        s = latency_summary(r.replay.records)
        loss = f"{r.loss_first:.3f} -> {r.loss_last:.3f}" if r.loss_first is not None else "-"
        print(f"{r.name:<10} {len(r.replay.records):>8d} {r.attainment * 100:>11.1f}% {s['ttft_p99_ms']:>7.0f}ms "
              f"{s['tpot_p99_ms']:>7.1f}ms {r.ft_tokens_per_s:>9.0f} {loss:>18}")
    if idle is not None:
        seconds, tokens, loss_end = idle
        end = f"{losses[-1] if losses else float('nan'):.3f} -> {loss_end:.3f}" if loss_end is not None else "-"
        print(f"{'then idle':<10} {'-':>8} {'-':>12} {'-':>9} {'-':>9} {tokens / max(seconds, 1e-9):>9.0f} {end:>18}"
              f"  ({seconds:.1f} s)")
    print(f"\nfine-tuned adapter: {adapter}  (train log: {out / 'train_log.jsonl'})")
    try:
        _show_learning(engine, questions, adapter)
    except ValueError as e:  # (an illustration only: it never turns the run's result into an error)
        print(f"(the questions are not shown: {e})")
    return 0


def _train_while_idle(engine: LLMEngine, session: FinetuneSession, seconds: float,
                      target: float) -> tuple[float, int, float | None] | None:
    """With no requests left, the engine keeps fine-tuning in FT-only steps (what it does between
    bursts): for at most ``seconds``, while the mean loss of the last three optimizer steps is above
    ``target``. Returns (seconds spent, tokens trained, last loss), or None where it did not run."""

    def recent() -> float | None:
        losses = [h.loss for h in session.history[-3:] if h.loss is not None]
        return sum(losses) / len(losses) if len(losses) == 3 else None

    loss = recent()
    if seconds <= 0 or (loss is not None and loss <= target):
        return None
    print(f"the server is idle: fine-tuning goes on until the loss is <= {target} (at most {seconds:.0f} s)",
          flush=True)
    t0, tokens0, next_tick = time.monotonic(), session.coserver.tokens_trained, 2.0
    while (now := time.monotonic() - t0) < seconds and not session.done:
        if not engine.step() and not engine.has_unfinished_requests():
            session.wait(0.005)
        if now >= next_tick:
            last = session.coserver.last_loss
            shown = f"{last:.3f}" if last is not None else "-"
            print(f"[{'idle':>9}] t={now:5.1f}s FT {(session.coserver.tokens_trained - tokens0) / now:6.0f} tok/s "
                  f"loss={shown}", flush=True)
            next_tick += 2.0
        loss = recent()
        if loss is not None and loss <= target:
            break
    return time.monotonic() - t0, session.coserver.tokens_trained - tokens0, session.coserver.last_loss


def _questions(data: Path) -> list[tuple[str, str]]:
    """``(instruction, output)`` of the dataset's first three rows where they are all Alpaca rows
    (none otherwise), parsed as the dataset loader parses them: a ``.json`` array pretty-printed
    over many lines and a ``.jsonl`` file that starts with a UTF-8 BOM are read as training read
    them (this re-read its first three lines itself and failed on both, after the whole run)."""
    pairs = []
    for row in islice(iter_rows(data), 3):
        question, answer = (row.get("instruction"), row.get("output")) if isinstance(row, dict) else (None, None)
        if not (isinstance(question, str) and isinstance(answer, str)):
            return []
        pairs.append((question, answer))
    return pairs


def _show_learning(engine: LLMEngine, questions: list[tuple[str, str]], adapter: Path) -> None:
    """Answer the dataset's first questions (:func:`_questions`) with the base model and with the
    adapter just trained."""
    tok = engine.tokenizer
    assert tok is not None
    if not questions:
        return
    params = SamplingParams(max_tokens=16, temperature=0.0)
    print("\nquestion -> base model | with the fine-tuned adapter (expected)")
    for i, (question, expected) in enumerate(questions):
        prompt = tok.apply_chat_template([{"role": "user", "content": question}],
                                         add_generation_prompt=True, tokenize=True)
        answers = []
        for j, lora in enumerate((None, LoRARequest("demo", str(adapter)))):
            rid = f"show{i}-{j}"
            engine.add_request(rid, prompt, params, lora)
            while True:
                outs = [o for o in engine.step() if o.request_id == rid and o.finished]
                if outs:
                    answers.append(outs[0].outputs[0].text.strip())
                    break
        print(f"  {question} -> {answers[0]!r} | {answers[1]!r} ({expected!r})")

"""coserve: an LLM inference server that fine-tunes LoRA adapters in the GPU time and memory that
inference leaves idle, within the requests' latency SLOs.

    coserve demo                                      # co-serving on the built-in tiny model (CPU, ~1 min)
    coserve serve --model DIR --finetune-data FILE --output DIR   # serve, fine-tuning as it serves
    coserve COMMAND --help                            # each command's flags
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coserve.core.config import SLOConfig
    from coserve.server.finetune import FinetuneSpec

Command = Callable[[argparse.Namespace], int]
COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Command]] = {}
HELP: dict[str, str] = {}  # each command's line in ``coserve --help``


def command(name: str, add_args: Callable[[argparse.ArgumentParser], None],
            help: str = "") -> Callable[[Command], Command]:
    def register(fn: Command) -> Command:
        COMMANDS[name] = (add_args, fn)
        HELP[name] = help
        return fn

    return register


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="model directory or built-in preset (default: tiny)")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "pt", "dummy"])
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="the share of the GPU's memory the engine takes, weights and KV cache (CUDA; the "
                        "rest is left to the trainer process's activations and optimizer state)")
    p.add_argument("--warmup", default="auto", choices=["auto", "on", "off"],
                   help="run every eager step shape once at start-up so no kernel compiles while "
                        "serving (auto: on CUDA only)")
    p.add_argument("--warmup-gemms", action="store_true",
                   help="with the warm-up, also run each base-weight GEMM at every token count an "
                        "eager step can have (the matmul library picks kernels per shape)")
    p.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="replay everything but the attention of steps that carry prefill or fine-tuning "
                        "rows from CUDA graphs captured per token-count bucket (CUDA only; "
                        "--no-prefill-graphs runs those steps eagerly)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                   help="reuse the KV of prompt prefixes (whole blocks, same adapter) computed for earlier "
                        "requests: a chat's next turn, a shared system prompt (default: on for serve)")
    p.add_argument("--stream-priority", default="default", choices=["default", "high"],
                   help="high: run the engine on the GPU's highest-priority stream and start the "
                        "trainer as a below-normal MPS client, so that inference is served first "
                        "where both run at once (CUDA only)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    return dict(
        load_format=args.load_format, dtype=args.dtype, device=args.device, seed=args.seed,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank, warmup=args.warmup, stream_priority=args.stream_priority,
        warmup_gemms=args.warmup_gemms, prefill_graphs=args.prefill_graphs,
        gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=args.enable_prefix_caching,
    )


def add_slo_args(p: argparse.ArgumentParser | argparse._ArgumentGroup, *, ttft_ms: float = 1000.0,
                 tpot_ms: float = 100.0) -> None:
    """The latency SLOs that admission keeps while fine-tuning, and the co-serving policy."""
    from coserve.core.config import PAUSE_POLICIES

    p.add_argument("--ttft-slo-ms", type=float, default=ttft_ms, help=f"time-to-first-token SLO (default {ttft_ms:g})")
    p.add_argument("--tpot-slo-ms", type=float, default=tpot_ms,
                   help=f"time-per-output-token SLO (default {tpot_ms:g})")
    p.add_argument("--slo-margin", type=float, default=0.1, help="fraction of the latency budget kept free")
    p.add_argument("--ft-policy", default="full", choices=["off", "temporal", "full"],
                   help="off: inference only; temporal: FT only in idle steps; full: FT also inside batches")
    p.add_argument("--no-interrupt", action="store_true", help="never interrupt an FT-only step")
    p.add_argument("--pause-prefill", default="always", choices=PAUSE_POLICIES,
                   help="when the running backward is paused for an inference step. always: every step "
                        "with prefill or FT rows, and a decode step that the latency model says would break "
                        "its budget beside the backward; model: any step only when the latency model says so")
    p.add_argument("--hold-pause", action="store_true",
                   help="keep the backward paused between steps while prompt tokens are queued (a burst of "
                        "prefill steps runs without the backward resuming in between)")
    p.add_argument("--ft-only-mid-layer-check", action="store_true",
                   help="a second interruption point inside each layer of an FT-only step (keeps those steps "
                        "eager, off the prefill graphs)")
    p.add_argument("--early-pause-ms", type=float, default=0.0, metavar="MS",
                   help="(experimental, 0: off) pause the backward this long before a decode step's predicted "
                        "end when a request has arrived during it, so that the trainer has stopped when the "
                        "step that carries the new prompt starts (and at once when a request interrupts an "
                        "FT-only step)")


def slo_config(args: argparse.Namespace) -> SLOConfig:
    """The :class:`SLOConfig` of :func:`add_slo_args`' flags (it checks them)."""
    from coserve.core.config import SLOConfig

    return SLOConfig(ttft_slo_s=args.ttft_slo_ms / 1e3, tpot_slo_s=args.tpot_slo_ms / 1e3, margin=args.slo_margin,
                     policy=args.ft_policy, interrupt_ft_only=not args.no_interrupt,
                     pause_prefill=args.pause_prefill, hold_pause=args.hold_pause,
                     ft_only_mid_layer_check=args.ft_only_mid_layer_check, early_pause_s=args.early_pause_ms / 1e3)


def _generate_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--lora", default=None, help="NAME=PEFT_DIR: apply this adapter to every prompt")


@command("generate", _generate_args, "generate text for prompts, optionally with LoRA adapters")
def generate(args: argparse.Namespace) -> int:
    from coserve import LLM, LoRARequest, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    lora = None
    if args.lora:
        name, sep, path = args.lora.partition("=")
        if not sep:
            raise ValueError("--lora takes NAME=PEFT_DIR")
        lora = LoRARequest(name, path)
    llm = LLM(args.model, **engine_kwargs(args))
    prompts = args.prompt
    if args.chat:
        assert llm.tokenizer is not None
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                     tokenize=True) for p in prompts]
    for prompt, out in zip(args.prompt, llm.generate(prompts, params, lora_request=lora), strict=True):
        c = out.outputs[0]
        print(f"--- {prompt!r} -> {len(c.token_ids)} tokens, finish={c.finish_reason}")
        print(c.text)
    return 0


def add_finetune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="JSON/JSONL dataset: Alpaca, chat (messages) or pre-tokenized rows; "
                        "or tiny_facts, the built-in one (short facts the tiny model learns in a minute)")
    p.add_argument("--output", required=True, help="output directory (adapter/, train_log.jsonl, run_config.json)")
    p.add_argument("--init-adapter", default=None, help="continue from this PEFT adapter directory")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--target-modules", default="q_proj,k_proj,v_proj,o_proj",
                   help="comma-separated: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lr-scheduler", default="constant", choices=["constant", "linear", "cosine"])
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="0 turns clipping off")
    p.add_argument("--grad-accum", type=int, default=1, help="backward tasks per optimizer step")
    p.add_argument("--max-skipped-steps", type=int, default=8,
                   help="stop fine-tuning after this many optimizer steps in a row with a non-finite "
                        "loss or gradient (inference goes on; 0: never stop)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--backward-tokens", type=int, default=256)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--train-on-prompt", action="store_true")
    p.add_argument("--save-mlp-activations", action="store_true",
                   help="keep the MLP's gate/up outputs of captured tokens so that the trainer does not "
                        "recompute the MLP (more activation memory, less backward work)")
    p.add_argument("--trainer-threads", type=int, default=0, help="torch threads of the trainer process (0: default)")
    p.add_argument("--save-every", type=int, default=100,
                   help="write OUTPUT/checkpoint every N optimizer steps and at the end (0: only when "
                        "stopped by Ctrl-C or SIGTERM)")
    p.add_argument("--epoch-checkpoints", type=int, default=3,
                   help="keep the adapters of the last N epochs' ends in OUTPUT/checkpoints/step-K (0: none)")
    p.add_argument("--resume", action="store_true", help="continue the run whose checkpoint is in OUTPUT")


def finetune_spec(args: argparse.Namespace) -> FinetuneSpec:
    from pathlib import Path

    from coserve.core.config import CoServeConfig, LoRAConfig, OptimConfig
    from coserve.data import resolve_dataset
    from coserve.models.config import ModelConfig
    from coserve.models.loader import ModelSource
    from coserve.server.finetune import FinetuneSpec

    lora = LoRAConfig(rank=args.lora_rank, alpha=args.lora_alpha, dropout=args.lora_dropout,
                      target_modules=tuple(t.strip() for t in args.target_modules.split(",") if t.strip()))
    # (here, before the engine is built: it allocates every adapter slot at this rank)
    lora.check_rank(ModelConfig.from_dir(ModelSource.resolve(args.model).path).linear_shapes())
    return FinetuneSpec(
        data=resolve_dataset(args.data),
        output=Path(args.output),
        lora=lora,
        optim=OptimConfig(lr=args.lr, lr_scheduler=args.lr_scheduler, warmup_steps=args.warmup_steps,
                          weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
                          accumulation_tasks=args.grad_accum, max_skipped_steps=args.max_skipped_steps),
        coserve=CoServeConfig(backward_tokens=args.backward_tokens, max_seq_len=args.max_seq_len,
                              epochs=args.epochs, seed=args.seed, train_on_prompt=args.train_on_prompt,
                              save_mlp_activations=args.save_mlp_activations),
        init_adapter=Path(args.init_adapter) if args.init_adapter else None,
        trainer_threads=args.trainer_threads,
        save_every=args.save_every,
        epoch_checkpoints=args.epoch_checkpoints,
        resume=args.resume,
    )


def _finetune_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    add_finetune_args(p)
    p.add_argument("--eval-data", default=None,
                   help="a held-out dataset (same formats as --data): its loss before training and with the "
                        "trained adapter, printed and written to OUTPUT/eval.json")


def _loss(loss: float | None) -> str:
    return "n/a" if loss is None else f"{loss:.4f}"


@command("finetune", _finetune_args, "fine-tune a LoRA adapter alone (no serving): PEFT adapter, train log, "
         "checkpoints")
def finetune(args: argparse.Namespace) -> int:
    """Fine-tune alone, through the engine's FT-only steps."""
    from coserve.engine.config import EngineConfig
    from coserve.engine.llm_engine import LLMEngine
    from coserve.server.finetune import FinetuneInterrupted, FinetuneSession, run_to_completion

    spec = finetune_spec(args)
    kwargs = engine_kwargs(args)
    kwargs["max_lora_rank"] = max(int(kwargs["max_lora_rank"]), spec.lora.rank)  # type: ignore[call-overload]
    engine = LLMEngine(EngineConfig(model=args.model, num_training_slots=1, **kwargs))  # type: ignore[arg-type]
    held_out, before = None, None
    if args.eval_data is not None:
        from coserve.data import resolve_dataset
        from coserve.engine.sequence import LoRARequest
        from coserve.server.finetune import evaluate, read_dataset

        if engine.tokenizer is None:
            raise ValueError("--eval-data needs the model's tokenizer")
        if engine.config.max_loras == 0:
            raise ValueError("--eval-data needs --max-loras >= 1 (the trained adapter is evaluated from its files)")
        held_out = read_dataset(engine, resolve_dataset(args.eval_data), spec.coserve)
        start = LoRARequest("eval-initial", str(spec.init_adapter)) if spec.init_adapter else None
        before = evaluate(engine, held_out.samples, start)
        print(f"eval {args.eval_data}: {before.samples} samples, {before.tokens} target tokens; "
              f"loss before training {before.loss:.4f}")
    session = FinetuneSession(engine, spec)
    print(session.dataset_line())
    try:
        path = run_to_completion(engine, session)
    except FinetuneInterrupted as stop:
        print(f"coserve finetune: stopped by {stop.signum.name} after optimizer step {stop.steps_done} of "
              f"{session.optim.total_steps}: its adapter is in {stop.adapter}, its checkpoint in "
              f"{session.checkpoint_dir} (the same command with --resume goes on from there)", file=sys.stderr)
        return 128 + stop.signum
    if session.coserver.failure is not None:
        print(f"coserve finetune: error: {session.coserver.failure}; adapter of the last committed step: {path}",
              file=sys.stderr)
        return 1
    hist = session.history
    first = next((h.loss for h in hist if h.loss is not None), None)
    last = next((h.loss for h in reversed(hist) if h.loss is not None), None)
    before_resume = session.coserver.steps_done - len(hist)  # (the checkpoint's steps, after --resume)
    resumed = f" after resuming at step {before_resume} ({session.coserver.steps_done} in all)" if before_resume else ""
    print(f"trained {len(hist)} optimizer steps{resumed}, {session.coserver.tokens_trained} tokens "
          f"({session.tokens_per_second:.0f} tokens/s); loss {_loss(first)} -> {_loss(last)}")
    if held_out is not None and before is not None:
        import json

        after = evaluate(engine, held_out.samples, LoRARequest("eval-trained", str(path)))
        (spec.output / "eval.json").write_text(json.dumps(
            {"data": str(args.eval_data), "samples": after.samples, "tokens": after.tokens,
             "loss_before": before.loss, "loss_after": after.loss, "optimizer_steps": len(hist)}, indent=1) + "\n")
        print(f"eval loss {before.loss:.4f} -> {after.loss:.4f} ({spec.output / 'eval.json'})")
    print(f"adapter: {path}\nlog: {spec.output / 'train_log.jsonl'}")
    return 0


def _demo_args(p: argparse.ArgumentParser) -> None:
    from coserve.server.demo import add_demo_args

    add_demo_args(p)


@command("demo", _demo_args, "the main job on the built-in tiny model: a bursty workload served with and "
         "without fine-tuning, side by side")
def demo(args: argparse.Namespace) -> int:
    """Serve a bursty workload and fine-tune in the same engine; compare with inference alone."""
    from coserve.server.demo import run_demo

    return run_demo(args)


import coserve.server.bench_http_cli  # noqa: E402, F401  (registers the bench-http command)
import coserve.server.serve_cli  # noqa: E402, F401  (registers the serve command)
from coserve.server import bench_cli  # noqa: E402, F401  (registers the bench command)
from coserve.server.interrupts import signal_of, terminate_raises  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="coserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default) or ERROR")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add_args, _) in COMMANDS.items():
        add_args(sub.add_parser(name, help=HELP[name], description=HELP[name]))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        with terminate_raises():
            return COMMANDS[args.command][1](args)
    except (ValueError, OSError) as e:  # (OSError: a file or directory that cannot be read or written)
        print(f"coserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # (Ctrl-C, or SIGTERM: Terminated; the finally blocks have run)
        sig = signal_of(stop)
        print(f"coserve {args.command}: stopped by {sig.name}", file=sys.stderr)
        return 128 + sig


if __name__ == "__main__":
    sys.exit(main())

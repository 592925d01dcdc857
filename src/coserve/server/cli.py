"""The ``coserve`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

Command = Callable[[argparse.Namespace], int]
COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Command]] = {}


def command(name: str, add_args: Callable[[argparse.ArgumentParser], None]) -> Callable[[Command], Command]:
    def register(fn: Command) -> Command:
        COMMANDS[name] = (add_args, fn)
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


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    return dict(
        load_format=args.load_format, dtype=args.dtype, device=args.device, seed=args.seed,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
    )


def _generate_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--lora", default=None, help="NAME=PEFT_DIR: apply this adapter to every prompt")


@command("generate", _generate_args)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="coserve", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_args, _) in COMMANDS.items():
        add_args(sub.add_parser(name))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[args.command][1](args)
    except (ValueError, FileNotFoundError) as e:
        print(f"coserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

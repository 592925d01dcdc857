"""Fine-tuning throughput: coserve's FT-only path against a plain transformers + peft loop.

coserve: FT-only engine steps capture activations, the trainer process recomputes each layer
and backpropagates (forward 2·P + recompute 2·P + input-gradient backward 2·P FLOPs per token).
peft: the same LoRA (rank, targets) on the same shape, with and without gradient checkpointing
(with it, the peft loop recomputes as much as coserve does). Same sequence lengths, same
tokens per optimizer step, same GPU, one process, one after the other.

    PYTHONPATH=src python bench/ft_throughput.py --shape llama3-8b --out bench/results/ft_throughput.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from speed_common import LLAMA3_8B, TINY, matmul_rate, provenance, sync, write_model_dir

from coserve.core.config import CoServeConfig, LoRAConfig, OptimConfig
from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.models.config import ModelConfig
from coserve.models.presets import preset_path
from coserve.server.finetune import FinetuneSession, FinetuneSpec

SHAPES = {"llama3-8b": LLAMA3_8B, "tiny": TINY}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def dataset(path: Path, n: int, length: int, vocab: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            ids = [rng.randrange(10, vocab) for _ in range(length)]
            f.write(json.dumps({"input_ids": ids}) + "\n")
    return path


def coserve_run(model_dir: Path, length: int, step_tokens: int, steps: int, warmup: int, device: str,
                dtype: str, work: Path, vocab: int, accumulation: int = 1,
                save_mlp: bool = False) -> dict[str, Any]:
    """Tokens/s of FT-only steps over ``steps`` optimizer steps after ``warmup``."""
    per_step = max(1, step_tokens // length)
    n = per_step * (steps + warmup + 1)
    data = dataset(work / f"data_{length}.jsonl", n, length, vocab=min(1024, vocab))
    engine = LLMEngine(EngineConfig(model=str(model_dir), load_format="dummy", dtype=dtype, device=device,
                                    num_training_slots=1, max_lora_rank=16, num_kv_blocks=64,
                                    max_num_batched_tokens=step_tokens, max_model_len=max(length + 1, 2048)))
    spec = FinetuneSpec(
        data=data, output=work / f"out_{length}", lora=LoRAConfig(rank=16, alpha=32, target_modules=TARGETS),
        optim=OptimConfig(lr=1e-4, max_grad_norm=1.0, accumulation_tasks=accumulation),
        coserve=CoServeConfig(backward_tokens=max(length, step_tokens // accumulation), max_seq_len=length,
                              epochs=1, seed=0, shuffle=False, save_mlp_activations=save_mlp),
        save_every=0, epoch_checkpoints=0,
    )
    session = FinetuneSession(engine, spec)
    co = session.coserver
    try:
        t0 = tok0 = None
        deadline = time.monotonic() + 600
        while co.steps_done < warmup + steps and time.monotonic() < deadline:
            if co.steps_done >= warmup and t0 is None:
                sync()
                t0, tok0 = time.perf_counter(), co.tokens_trained
            if not engine.step():
                session.wait(0.001)
        sync()
        elapsed = time.perf_counter() - (t0 or time.perf_counter())
        tokens = co.tokens_trained - (tok0 or 0)
    finally:
        session.close()
        del session, engine
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed if elapsed else 0.0}


def peft_run(config: dict[str, Any], length: int, step_tokens: int, steps: int, warmup: int, device: str,
             dtype: torch.dtype, checkpointing: bool) -> dict[str, Any]:
    import peft
    import transformers

    cfg = transformers.LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures",)})
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).to(dtype)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=list(TARGETS)))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    batch = max(1, step_tokens // length)
    ids = torch.randint(10, min(1024, config["vocab_size"]), (batch, length), device=device)

    def step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    elapsed = time.perf_counter() - t0
    tokens = steps * batch * length
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--lengths", default="256,512,1024")
    p.add_argument("--step-tokens", type=int, default=4096)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--skip-peft", action="store_true")
    p.add_argument("--accumulation-tasks", default="1",
                   help="comma list: backward tasks per optimizer step (same tokens per step); >1 overlaps "
                        "the capture of a task with the backward of the previous one")
    p.add_argument("--save-mlp-activations", default="off", choices=["off", "on", "both"],
                   help="keep the MLP's gate/up outputs (no MLP recompute in the trainer); both: A/B")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    config = SHAPES[args.shape]
    dtype_name = "bfloat16" if args.device.startswith("cuda") else "float32"
    dtype = torch.bfloat16 if dtype_name == "bfloat16" else torch.float32
    work = Path(tempfile.mkdtemp(prefix="ft_bench_"))
    model_dir = write_model_dir(work / "model", config)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(preset_path("tiny") / name, model_dir / name)
    model_cfg = ModelConfig.from_hf(config)
    params = model_cfg.num_params()
    flops_per_token = 6 * params
    mlp_params = model_cfg.num_layers * 3 * model_cfg.hidden_size * model_cfg.intermediate_size
    assert not set(TARGETS) & {"gate_proj", "up_proj", "down_proj"}, "the FLOP counts below assume untrained MLPs"
    peak = matmul_rate() if args.device.startswith("cuda") else float("nan")
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        row: dict[str, Any] = {"seq_len": length}
        keeps = {"off": (False,), "on": (True,), "both": (False, True)}[args.save_mlp_activations]
        for acc in (int(x) for x in args.accumulation_tasks.split(",")):
            for keep in keeps:
                key = ("coserve" if acc == 1 else f"coserve_accum{acc}") + ("_mlp" if keep else "")
                row[key] = coserve_run(model_dir, length, args.step_tokens, args.steps, args.warmup,
                                       args.device, dtype_name, work, config["vocab_size"], acc, keep)
        if not args.skip_peft:
            for gc_on in (True, False):
                key = "peft_gc" if gc_on else "peft_no_gc"
                try:
                    row[key] = peft_run(config, length, args.step_tokens, args.steps, args.warmup, args.device,
                                        dtype, gc_on)
                except torch.OutOfMemoryError as e:
                    row[key] = {"error": f"out of memory: {e}"}
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        for k, v in row.items():
            if k.startswith("coserve") and isinstance(v, dict):
                # the FLOPs this variant really runs: an untrained MLP's down projection is never
                # recomputed (its input gradient reads only the weight; since session 5), and the
                # kept-MLP variants skip the gate/up recompute too
                skipped = 2 * mlp_params if k.endswith("_mlp") else 2 * mlp_params // 3
                v["flops_per_token"] = flops_per_token - skipped
                v["fraction_of_matmul_rate"] = (v["tokens_per_s"] * v["flops_per_token"] / peak
                                                if peak == peak else None)
        co = max(v["tokens_per_s"] for k, v in row.items() if k.startswith("coserve") and isinstance(v, dict))
        # NOTE: at the nominal 6·P FLOP per token, whichever variant was fastest
        row["coserve_tflops"] = co * flops_per_token / 1e12
        row["coserve_fraction_of_matmul_rate"] = co * flops_per_token / peak if peak == peak else None
        if "peft_gc" in row and "tokens_per_s" in row["peft_gc"]:
            row["coserve_over_peft_gc"] = co / row["peft_gc"]["tokens_per_s"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {
        **provenance(),
        "config": {"shape": args.shape, "params": params, "dtype": dtype_name, "lora_rank": 16,
                   "targets": TARGETS, "step_tokens": args.step_tokens, "steps": args.steps,
                   "warmup": args.warmup, "flops_per_token": flops_per_token,
                   "save_mlp_activations": args.save_mlp_activations,
                   "flop_count": "6*P per token nominal (forward, recompute, input-gradient backward); "
                                 "per variant, less the MLP recompute it skips"},
        "figures": {"matmul_rate_tflops": peak / 1e12 if peak == peak else None, "rows": rows},
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["figures"], indent=1))


if __name__ == "__main__":
    main()

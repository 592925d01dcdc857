"""A trainer's start spawned afresh against one from a spare interpreter (``coserve.trainer.spare``),
at a model shape on ``--device``: each start's stages (``TrainerProcess.start_stages``: process,
build, warm-up of one small task) and wall seconds, alternating fresh and spare ``--rounds`` times
(the first fresh start also compiles the warm-up's kernels), each trainer then running one backward
task and optimizer step (the adapters they commit are compared: the same spec, the same task), then
a large task twice (``big_task_s``: GPU-bound at the 8B shape, so a spare that missed its MPS share,
handed over before its CUDA context exists, would run it faster than a fresh process).

    nvidia-cuda-mps-control -d; PYTHONPATH=src python bench/spare_start.py --out spare_start.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from coserve.bench.provenance import provenance
from coserve.bench.shapes import is_shape, materialize
from coserve.core.config import OptimConfig
from coserve.core.messages import BackwardTask, TaskSample
from coserve.models.loader import load_model
from coserve.models.peft_adapter import new_lora_adapter
from coserve.trainer import spare
from coserve.trainer.mps import mps_active
from coserve.trainer.process import TrainerProcess

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
BIG_ROWS, BIG_ROW = 4, 512  # (the large task: its rows and their tokens)
STORE_SCALE = 8.0  # (the saved layer inputs' standard deviation)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--model", default="shape:llama3-8b" if cuda else "tiny")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--spare-wait", type=float, default=0.0,
                   help="seconds to wait after a spare is started before the fresh start that precedes its use")
    p.add_argument("--sm-share", type=int, default=50, help="the trainer's MPS share where MPS runs")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    device = torch.device(args.device)
    prov = provenance()  # (before the switch below, which is this script's own)
    os.environ[spare.SPARE_ENV] = "1"  # (prepared by hand below; never at a fresh start: none is held then)
    with tempfile.TemporaryDirectory() as tmp:
        path = materialize(args.model, Path(tmp)) if is_shape(args.model) else args.model
        began = time.perf_counter()
        model = load_model(path, load_format="dummy", device=device, num_lora_slots=1, max_lora_rank=16)
    load_s = time.perf_counter() - began
    cfg = model.config
    adapter = new_lora_adapter(num_layers=cfg.num_layers, shapes=cfg.linear_shapes(), rank=16, alpha=32,
                               target_modules=TARGETS, seed=0)
    gen = torch.Generator(device="cpu").manual_seed(0)
    # (at a residual stream's scale: the gradient through the random layers' norms grows ~5,000x
    # every two layers from inputs at 0.1, which overflowed over 32 layers on session 45's H100 and
    # skipped every step; from 8, ~1.4x: bench/results/latency_h100/README.md, "Session 45")
    store = (torch.randn(cfg.num_layers + 1, BIG_ROWS * BIG_ROW, cfg.hidden_size, generator=gen) * STORE_SCALE).to(
        device, next(model.parameters()).dtype)
    scales = torch.zeros(1, device=device)
    task = BackwardTask(0, 0, (TaskSample(0, 0, tuple(int(t) for t in torch.randint(0, cfg.vocab_size, (256,),
                                                                                     generator=gen))),),
                        ends_step=True)
    # (GPU-bound at the 8B shape: its time says whether the trainer ran at its MPS share, a spare's
    # as a fresh process's; no optimizer step, so the adapters compared are the small task's)
    big = BackwardTask(1, 1, tuple(TaskSample(i, i * BIG_ROW, tuple(
        int(t) for t in torch.randint(0, cfg.vocab_size, (BIG_ROW,), generator=gen))) for i in range(BIG_ROWS)),
        ends_step=False)
    share = args.sm_share if device.type == "cuda" and mps_active() else None
    starts: list[dict[str, object]] = []
    adapters = []
    for rnd in range(args.rounds):
        spare.prepare_for(device)  # (imports while the fresh start runs)
        if args.spare_wait:
            time.sleep(args.spare_wait)
        for kind in ("fresh", "spare"):
            held = spare.HELD._spare
            if kind == "fresh":
                spare.HELD._spare = None  # (set aside: this start spawns)
            began = time.perf_counter()
            trainer = TrainerProcess(model, store, scales, adapter, slot=0, optim=OptimConfig(lr=1e-3),
                                     sm_share=share, warmup_rows=(16,))
            start_s = time.perf_counter() - began
            if kind == "fresh":
                spare.HELD._spare = held
            from_spare = held is not None and kind == "spare" and trainer.pid == held.proc.pid
            try:
                trainer.submit(task)
                results = trainer.poll(timeout=300.0)
                ok = len(results) == 1 and results[0].step_info is not None
                adapters.append(trainer.committed_adapter())
                loss = results[0].loss_sum if results else None
                skipped = bool(results and results[0].step_info is not None and results[0].step_info.skipped)
                big_s = []
                for _ in range(2):  # (the first may find shapes the warm-up did not: the second's time)
                    trainer.submit(big)
                    done = trainer.poll(timeout=300.0)
                    big_s.append(round(done[0].duration_s, 4) if done else None)
            finally:
                trainer.close()
            row = {"round": rnd, "kind": kind, "from_spare": from_spare, "start_s": round(start_s, 3),
                   "stages_s": {k: round(v, 3) for k, v in trainer.start_stages().items()}, "task_ok": ok,
                   "loss_sum": loss, "skipped": skipped, "big_task_s": big_s}
            print(json.dumps(row), flush=True)
            starts.append(row)
    spare.HELD.discard()
    first = adapters[0].weights
    max_diff = max(float((w[i].float() - first[k][i].float()).abs().max())
                   for a in adapters[1:] for k, w in a.weights.items() for i in (0, 1))
    by_kind = {kind: [s for s in starts if s["kind"] == kind and s["round"] > 0] or
               [s for s in starts if s["kind"] == kind] for kind in ("fresh", "spare")}
    figures = {
        "model_load_s": round(load_s, 1),
        "starts": starts,
        "adapters_max_abs_diff": max_diff,
        "start_s_after_first_round": {k: [s["start_s"] for s in v] for k, v in by_kind.items()},
    }
    result = {**prov, "config": {"model": args.model, "device": str(device), "rounds": args.rounds, "sm_share": share,
                         "warmup_rows": [16], "task_tokens": 256, "store_scale": STORE_SCALE, "big_task_rows": [BIG_ROW] * BIG_ROWS, "rank": 16,
                         "targets": list(TARGETS)},
              "figures": figures}
    args.out.write_text(json.dumps(result, indent=1))
    skipped = sum(s["skipped"] for s in starts)
    figures["steps_skipped"] = skipped
    print(json.dumps(figures["start_s_after_first_round"]), "adapters max abs diff", max_diff,
          f"({skipped} of {len(starts)} steps skipped: those compare initial adapters)" if skipped else "")


if __name__ == "__main__":
    main()

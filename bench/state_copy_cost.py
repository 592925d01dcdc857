"""What a copy of the trainer's committed state costs the engine's thread (a checkpoint, a pause,
a job's end: ``FinetuneSession._logged_state``), at the Llama-3-8B LoRA shape (rank 16 on
q/k/v/o, 32 layers: the ``[3, P]`` fp32 master weights and AdamW moments, 164 MB).

Per way of copying, the median and max of ``--reps`` copies of one bank of a ``[2, 3, P]`` tensor
on ``--device`` (as ``TrainerProcess.banks``) into the engine's memory: into a new tensor and then
cloned (``.cpu().clone()``, before session 44), into a new tensor once (``.to("cpu", copy=True)``),
into a buffer kept from copy to copy (``committed_state(out=)``, session 44), into a pinned one
kept alike; then the adapter made from a copy (``committed_adapter(state=)``); then a pause's
whole copying work as before session 44 (two copies, each with its adapter) and after (one).

    PYTHONPATH=src python bench/state_copy_cost.py --device cuda --out state_copy_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from coserve.bench.provenance import provenance
from coserve.models.peft_adapter import new_lora_adapter
from coserve.trainer.lora_params import TrainableLoRA

SHAPES = {"q_proj": (4096, 4096), "k_proj": (4096, 1024), "v_proj": (4096, 1024), "o_proj": (4096, 4096)}


def timed(fn: Callable[[], object], reps: int, sync: Callable[[], None]) -> dict[str, float]:
    fn()  # (a first call: allocator and driver set-up)
    times = []
    for _ in range(reps):
        sync()
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return {"median_ms": round(statistics.median(times) * 1e3, 2), "max_ms": round(max(times) * 1e3, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    device = torch.device(args.device)
    adapter = new_lora_adapter(num_layers=args.layers, shapes=SHAPES, rank=16, alpha=32,
                               target_modules=tuple(SHAPES), seed=1)
    layout = TrainableLoRA(adapter, device="cpu")
    numel = layout.flat.numel()
    banks = torch.randn(2, 3, numel, device=device)
    buffer = torch.zeros(3, numel)
    pinned = torch.zeros(3, numel, pin_memory=True) if device.type == "cuda" else None

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def adapter_of(state: torch.Tensor) -> object:
        with torch.no_grad():
            layout.flat.copy_(state[0])
        return layout.to_adapter()

    ways: dict[str, Callable[[], object]] = {
        "new_then_clone": lambda: banks[1].cpu().clone(),
        "new_once": lambda: banks[1].to("cpu", copy=True),
        "kept_buffer": lambda: buffer.copy_(banks[1]),
        "adapter_of_copy": lambda: adapter_of(buffer),
        "pause_before": lambda: [adapter_of(banks[1].cpu().clone()) for _ in range(2)],
        "pause_after": lambda: adapter_of(buffer.copy_(banks[1])),
    }
    if pinned is not None:
        ways["kept_pinned_buffer"] = lambda: pinned.copy_(banks[1])
    figures = {name: timed(fn, args.reps, sync) for name, fn in ways.items()}
    figures["state_mb"] = round(banks[1].numel() * 4 / 2**20, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**provenance(), "config": {"shapes": SHAPES, "rank": 16, "layers": args.layers,
                                                                 "reps": args.reps, "device": str(device)},
                                    "figures": figures}, indent=1) + "\n")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

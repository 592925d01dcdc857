"""What a fine-tuning job's end costs the engine's thread on this machine: writing its adapter
(``save_peft_adapter``, as ``FinetuneSession.export`` does there) and reading it back (as serving
it does), at the Llama-3-8B LoRA shape (rank 16 on q/k/v/o, 32 layers). Writes a JSON result.

    PYTHONPATH=src python bench/adapter_export_cost.py --out bench/results/host_cpu/session24/adapter_export_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from coserve.bench.provenance import provenance
from coserve.models.peft_adapter import load_peft_adapter, new_lora_adapter, save_peft_adapter

SHAPES = {"q_proj": (4096, 4096), "k_proj": (4096, 1024), "v_proj": (4096, 1024), "o_proj": (4096, 4096)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    adapter = new_lora_adapter(num_layers=32, shapes=SHAPES, rank=16, alpha=32, target_modules=tuple(SHAPES), seed=1)
    params = sum(a.numel() + b.numel() for a, b in adapter.weights.values())
    write, read = [], []
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "adapter"
        for _ in range(args.reps):
            t = time.perf_counter()
            save_peft_adapter(adapter, path)
            write.append(time.perf_counter() - t)
            t = time.perf_counter()
            load_peft_adapter(path)
            read.append(time.perf_counter() - t)
    figures = {"params": params, "bytes_fp32": 4 * params,
               "write_ms": [round(x * 1e3, 1) for x in write], "write_ms_median": round(statistics.median(write) * 1e3, 1),
               "read_ms": [round(x * 1e3, 1) for x in read], "read_ms_median": round(statistics.median(read) * 1e3, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**provenance(), "config": {"shapes": SHAPES, "rank": 16, "layers": 32,
                                                                 "reps": args.reps}, "figures": figures}, indent=1) + "\n")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

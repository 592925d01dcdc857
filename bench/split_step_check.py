"""The split baseline's full-autograd training step at the 8B shape (fewer layers), on the GPU, in
bf16 against fp32: loss and gradient finite and near the reference, by ``COSERVE_VARLEN_ATTN``
(set it in the environment; the fp32 model's rows take per-row SDPA whatever it is).

    COSERVE_VARLEN_ATTN=flash python bench/split_step_check.py --layers 2 --out check.json

Written after session 10's ``split-20`` run on azure2023_code logged NaN losses and gradients at
the ``flash`` default (the engine and the co-serving trainer had none)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import tempfile
from pathlib import Path

import torch
from mps_op_check import poison_free_memory

from coserve.bench.provenance import provenance
from coserve.bench.shapes import LLAMA3_8B
from coserve.core.finetune import FTSample
from coserve.layers.varlen_attention import VARLEN_ATTN, varlen_impl
from coserve.models.loader import load_model
from coserve.models.peft_adapter import new_lora_adapter
from coserve.trainer.lora_params import TrainableLoRA
from coserve.trainer.split import train_step


class _FirstBadLayer:
    """A ``train_step`` layer hook: ``layer`` is the first decoder layer whose input held a
    non-finite value in the forward (the number of layers: the final norm's input), or None."""

    def __init__(self) -> None:
        self.layer: int | None = None

    def __call__(self, i: int, hidden: torch.Tensor) -> None:
        if self.layer is None and not bool(hidden.isfinite().all()):
            self.layer = i


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rows", type=int, default=6)
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=3, help="bf16 steps on the same batch")
    p.add_argument(
        "--anomaly",
        action="store_true",
        help="bf16 steps under torch.autograd.detect_anomaly: the first backward op with a "
        "NaN output is named in the result (slow)",
    )
    p.add_argument(
        "--poison",
        action="store_true",
        help="NaN-fill the allocator's free memory before every bf16 step (bench/mps_op_check.py): a "
        "read of memory never written then gives NaN whatever the timing",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    rng = random.Random(0)
    batch = []
    for i in range(args.rows):
        ids = tuple(
            rng.randrange(10, 128000) for _ in range(rng.randint(args.min_len, args.max_len))
        )
        batch.append(FTSample(i, ids, (-100,) * (len(ids) // 4) + ids[len(ids) // 4 :]))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m"
        path.mkdir()
        (path / "config.json").write_text(
            json.dumps({**LLAMA3_8B, "num_hidden_layers": args.layers})
        )
        runs = {}
        for dtype in (torch.float32, torch.bfloat16):
            model = load_model(
                path, dtype=dtype, device=args.device, num_lora_slots=1, max_lora_rank=16
            )
            cfg = model.config
            adapter = new_lora_adapter(
                num_layers=cfg.num_layers,
                shapes=cfg.linear_shapes(),
                rank=16,
                alpha=32,
                target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
                seed=0,
            )
            steps = []
            for r in range(args.repeats if dtype == torch.bfloat16 else 1):
                lora = TrainableLoRA(adapter, dropout=args.dropout, device=args.device)
                if args.poison and dtype == torch.bfloat16:
                    poison_free_memory()
                first_bad = _FirstBadLayer()
                anomaly = None
                try:
                    with (
                        torch.autograd.detect_anomaly(check_nan=True)
                        if args.anomaly and dtype != torch.float32
                        else contextlib.nullcontext()
                    ):
                        step = train_step(
                            model,
                            lora,
                            batch,
                            dropout_key=r if args.dropout else None,
                            layer_hook=first_bad,
                        )
                    loss = step.loss_sum
                except RuntimeError as e:  # (detect_anomaly: the op whose backward gave NaN)
                    anomaly, loss = str(e)[:600], float("nan")
                grad = (
                    lora.flat.grad.double()
                    if lora.flat.grad is not None
                    else torch.full((1,), float("nan"))
                )
                steps.append(
                    (loss, grad.clone(), bool(grad.isfinite().all()), first_bad.layer, anomaly)
                )
            runs[str(dtype)] = steps
            del model
            torch.cuda.empty_cache()
    ((ref_loss, ref_grad, _, _, _),) = runs["torch.float32"]
    out = []
    for loss, grad, finite, bad_layer, anomaly in runs["torch.bfloat16"]:
        err = ((grad - ref_grad).norm() / ref_grad.norm()).item() if finite else None
        out.append(
            {
                "loss": loss,
                "loss_rel": abs(loss - ref_loss) / abs(ref_loss) if math.isfinite(loss) else None,
                "grad_finite": finite,
                "grad_rel": err,
                "first_nonfinite_layer_input": bad_layer,
                "anomaly": anomaly,
            }
        )
    impl = varlen_impl()
    result = {
        **provenance(),
        "config": vars(args)
        | {
            "out": str(args.out),
            "varlen_attn": VARLEN_ATTN,
            "impl": impl[0] if impl else None,
            # the MPS share this process ran at (None: the whole GPU, or no MPS daemon)
            "mps_active_thread_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
        },
        "figures": {"ref_loss": ref_loss, "ref_grad_norm": ref_grad.norm().item(), "bf16": out},
    }
    print(json.dumps(result["figures"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

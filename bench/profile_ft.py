"""Where the time of one fine-tuning task goes: engine capture forward vs trainer backward, in one
process (no IPC), wall clock vs CUDA kernel time.

    PYTHONPATH=src python bench/profile_ft.py --shape llama3-8b --rows 8 --row-len 512
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from speed_common import LLAMA3_8B, TINY, provenance, write_model_dir

from coserve.core.activations import ActivationStore
from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.engine.model_runner import BatchRow
from coserve.models.peft_adapter import new_lora_adapter
from coserve.trainer.backward import TaskRow, task_backward
from coserve.trainer.lora_params import TrainableLoRA

SHAPES = {"llama3-8b": LLAMA3_8B, "tiny": TINY}


def timed(fn, device: str, reps: int = 3, profile_it: bool = True) -> tuple[float, str]:  # type: ignore[no-untyped-def]
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / reps
    table = ""
    if device == "cuda" and profile_it:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14)
    return wall, table


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--row-len", type=int, default=512)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--boundary-sync", action="store_true",
                   help="bound the backward's queued GPU work to one layer boundary ahead, as the trainer "
                        "worker does (an event per boundary, the CPU waits on the one before)")
    p.add_argument("--no-profile", action="store_true", help="skip the torch.profiler tables")
    p.add_argument("--out", default=None, help="write the figures with provenance as JSON here")
    args = p.parse_args()
    import tempfile
    from pathlib import Path

    cfg = SHAPES[args.shape]
    model_dir = write_model_dir(Path(tempfile.mkdtemp()) / "m", cfg)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    engine = LLMEngine(EngineConfig(model=str(model_dir), load_format="dummy", dtype=dtype, device=args.device,
                                    num_training_slots=1, max_lora_rank=16, num_kv_blocks=64,
                                    max_num_batched_tokens=args.rows * args.row_len, skip_tokenizer_init=True))
    mc = engine.model_config
    n = args.rows * args.row_len
    store = ActivationStore(mc.num_layers, n, mc.hidden_size, engine.runner.dtype, engine.runner.device)
    adapter = new_lora_adapter(num_layers=mc.num_layers, shapes=mc.linear_shapes(), rank=16, alpha=32,
                               target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), seed=0)
    lora = TrainableLoRA(adapter, device=engine.runner.device)
    slot = engine.lora_manager.training_slot(0)
    lora.write_serving(engine.model.lora_stacks, slot, engine.lora_manager.scales)
    ids = torch.randint(10, min(1000, mc.vocab_size), (args.rows, args.row_len)).tolist()
    rows = [BatchRow(r, 0, [], slot, writes_kv=False) for r in ids]

    def capture(layer: int, hidden: torch.Tensor) -> None:
        store.capture(layer, 0, hidden[:n])

    fwd_wall, fwd_table = timed(lambda: engine.runner.execute(rows, capture), args.device,
                                profile_it=not args.no_profile)
    task = [TaskRow(i * args.row_len, tuple(r)) for i, r in enumerate(ids)]

    events: list[torch.cuda.Event] = []

    def boundary(layer: int) -> None:
        event = torch.cuda.Event()
        event.record()
        events.append(event)
        if len(events) > 1:
            events.pop(0).synchronize()

    hook = boundary if args.boundary_sync and args.device == "cuda" else None
    dispatch: list[float] = []
    cpu: list[float] = []

    def backward() -> None:
        t, c = time.perf_counter(), time.thread_time()
        task_backward(engine.model, lora, store.tensor, task, at_layer_boundary=hook)
        dispatch.append(time.perf_counter() - t)  # until the CPU has queued (or waited for) it all
        cpu.append(time.thread_time() - c)  # this thread's CPU time (a spinning sync counts too)
        events.clear()
        lora.flat.grad = None

    bwd_wall, bwd_table = timed(backward, args.device, profile_it=not args.no_profile)
    flops = 2 * mc.num_params() * n
    out = {"tokens": n, "forward_s": fwd_wall, "backward_s": bwd_wall,
           "forward_tflops": flops / fwd_wall / 1e12, "backward_tflops": 2 * flops / bwd_wall / 1e12,
           "tokens_per_s_serial": n / (fwd_wall + bwd_wall),
           "backward_dispatch_s": min(dispatch), "backward_cpu_s": min(cpu), "boundary_sync": hook is not None}
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({**provenance(), "config": vars(args), "figures": out}, indent=1))
    print("FORWARD\n", fwd_table)
    print("BACKWARD\n", bwd_table)


if __name__ == "__main__":
    main()

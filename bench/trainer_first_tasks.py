"""Device: the trainer's host stretches over its first backward tasks, by warm-up (session 36).

A cold ``latency_warm`` run's busy decode steps miss their prediction most in the first minute,
and the trainer's tasks there carry long host stretches that the later ones do not (session 35,
``bench/latency_timeline.py``, ``bench/results/latency_h100/session36/latency_timeline_73d0818.json``:
a median of 8.6 / 9.3 ms and a 90th percentile of 44.9 / 58.2 ms over the tasks of the first 20 s,
1.6-2.2 ms and 2.5-7.7 ms in the warm replays). While the trainer's host works its GPU stream runs dry, and the decode
steps beside it run faster than their busy prediction. Suspects: work done the first time a
shape is seen (Triton's specializations of a kernel's integer arguments, libraries' kernels
loaded lazily by CUDA, ``CUDA_MODULE_LOADING=LAZY``, the default), which a warm-up task of one
shape does not cover.

This runs a :class:`coserve.trainer.worker._Worker` (the GPU-side gate open, as the server's) on
the task shapes of a recorded run (``--tasks-from``: its timeline's tokens, samples and longest
sample, in order) after each variant's warm-up, one fresh process per variant
(``--variants``: ``WARMUP[:VAR=VALUE,...]``, the warm-up ``none``, ``one`` (the task of
``warmup_rows``, the server's until session 36) or ``shapes`` (``warmup_shapes`` after it), with
those environment variables set; each with its own empty ``TRITON_CACHE_DIR`` unless
``--shared-triton-cache``). Per task: the longest host stretch (the worker's spans' CPU ms, and
where), the Triton kernels compiled during it, its wall time; per variant: the warm-up's time
and the GPU memory in use after it, and those figures over the first tasks and the rest.

    python3 bench/trainer_first_tasks.py --tasks-from RUN.json.xz --out OUT.json \\
        [--layers 8] [--tasks 120] [--variants "one shapes one:CUDA_MODULE_LOADING=EAGER"]

``--model tiny`` runs it on the CPU (the tests' smoke run; no Triton there).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from coserve.bench.provenance import provenance
from coserve.bench.result_file import read_result

TASK_COLUMNS = ("submitted_s", "received_s", "trainer_s", "tokens", "samples", "longest_tokens")
"""The first columns of a latency run's ``timeline.task_columns`` (``coserve_latency.py``)."""
WARMUPS = ("none", "one", "shapes")


def task_shapes(path: str, count: int) -> list[tuple[int, int, int]]:
    """``(tokens, samples, longest)`` of the first ``count`` trainer tasks of a latency run."""
    timeline = read_result(path)["figures"]["timeline"]
    cols = timeline["task_columns"]
    if tuple(cols[:len(TASK_COLUMNS)]) != TASK_COLUMNS:
        raise SystemExit(f"{path}: timeline.task_columns {cols} do not start with {TASK_COLUMNS}")
    return [(int(r[3]), int(r[4]), int(r[5])) for r in timeline["tasks"][:count]]


def row_lengths(tokens: int, samples: int, longest: int) -> list[int]:
    """A task's sample lengths: one of ``longest``, the rest of ``tokens`` split evenly over the
    others (each at least 2 tokens and at most ``longest``)."""
    if samples <= 1:
        return [max(2, tokens)]
    rest, others = max(0, tokens - longest), samples - 1
    q, r = divmod(rest, others)
    return [longest] + [min(longest, max(2, q + (1 if i < r else 0))) for i in range(others)]


def _triton_kernels() -> dict[str, Any]:
    """The Triton kernels of coserve's layers, by name (empty where Triton is missing)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return {}
    import coserve.layers.triton_attention as attention
    import coserve.layers.triton_fused as fused
    import coserve.layers.triton_lora as lora
    return {f"{m.__name__.rsplit('.', 1)[-1]}.{name}": v for m in (attention, fused, lora)
            for name, v in vars(m).items() if isinstance(v, JITFunction)}


def _compiled(kernels: dict[str, Any]) -> dict[str, int]:
    """How many compiled variants each kernel holds (its per-device caches; -1 where this Triton
    keeps them otherwise)."""
    out = {}
    for name, fn in kernels.items():
        try:
            out[name] = sum(len(c[0]) for c in fn.device_caches.values())
        except (AttributeError, TypeError, IndexError):
            out[name] = -1
    return out


def child(args: argparse.Namespace) -> None:
    import torch

    from coserve.bench.shapes import materialize
    from coserve.core.config import LoRAConfig, OptimConfig
    from coserve.core.messages import BackwardTask, TaskSample
    from coserve.models.loader import load_model
    from coserve.models.peft_adapter import new_lora_adapter
    from coserve.trainer.stream_gate import new_flag, set_open
    from coserve.trainer.worker import WorkerSpec, _Worker, warmup_rows, warmup_shapes

    warmup = args.child
    shapes = json.loads(Path(args.shapes_json).read_text())
    cuda = args.model != "tiny"
    device = "cuda" if cuda else "cpu"
    if cuda:
        directory = materialize(args.model, Path(tempfile.mkdtemp()))
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, "num_hidden_layers": args.layers}))
        model = load_model(directory, load_format="dummy", dtype="bfloat16", device=device, num_lora_slots=1,
                           max_lora_rank=16)
    else:
        model = load_model("tiny", num_lora_slots=1, max_lora_rank=16, device=device)
    cfg = model.config
    adapter = new_lora_adapter(num_layers=cfg.num_layers, shapes=cfg.linear_shapes(), rank=16, alpha=32,
                               target_modules=tuple(LoRAConfig().target_modules), seed=0)
    capacity = max([t for t, _, _ in shapes] + [args.backward_tokens + args.max_seq_len])
    gen = torch.Generator().manual_seed(0)
    store = (torch.randn(cfg.num_layers + 1, capacity, cfg.hidden_size, generator=gen) * 0.5).to(device, next(model.parameters()).dtype)
    numel = sum(a.numel() + b.numel() for a, b in adapter.weights.values())
    spec = WorkerSpec(model, store, torch.ones(1, device=device), torch.zeros(2, 3, numel, device=device),
                      torch.tensor([-1, 0, 0]), adapter, 0, 0.0, 0, OptimConfig(lr=1e-4))
    if cuda:
        spec.gate_flag = new_flag()
        set_open(spec.gate_flag, True)
    worker = _Worker(spec)
    kernels = _triton_kernels()
    warm: list[tuple[int, ...]] = []
    if warmup != "none":
        warm.append(warmup_rows(args.backward_tokens, args.max_seq_len))
    if warmup == "shapes":
        warm += warmup_shapes(args.backward_tokens, args.max_seq_len)
    if cuda:
        torch.cuda.synchronize()
    began = time.perf_counter()
    before = _compiled(kernels)
    for lengths in warm:
        worker.warm_up(lengths)
    if cuda:
        torch.cuda.synchronize()
    warm_s = time.perf_counter() - began
    after = _compiled(kernels)
    vocab = cfg.vocab_size
    tasks = []
    for i, (tokens, samples, longest) in enumerate(shapes):
        offset, rows = 0, []
        for n in row_lengths(tokens, samples, longest):
            # (a quarter of each sample unlabelled, as a prompt is)
            labels = tuple([-100] * (n // 4) + [(offset + j * 7919) % vocab for j in range(n // 4, n)])
            rows.append(TaskSample(i * 64 + len(rows), offset, labels))
            offset += n
        compiled = _compiled(kernels)
        t = time.perf_counter()
        result = worker.run(BackwardTask(i, i, tuple(rows), ends_step=True))
        wall = time.perf_counter() - t
        now = _compiled(kernels)
        new = sorted(k for k in now if now[k] > compiled.get(k, 0))
        longest_span = max(result.spans, key=lambda s: s[3], default=None)
        tasks.append({"tokens": offset, "samples": len(rows), "wall_ms": wall * 1e3,
                      "longest_cpu_ms": longest_span[3] if longest_span else None,
                      "longest_at": list(longest_span[:2]) if longest_span else None,
                      "cpu_ms_sum": sum(s[3] for s in result.spans), "triton_compiled": new})
    memory = torch.cuda.memory_allocated() if cuda else 0
    # (the device's memory in use, every process's and the modules' code with it: what CUDA's
    # eager module loading adds shows here, not in the allocator's count)
    device_used = (lambda free, total: total - free)(*torch.cuda.mem_get_info()) if cuda else 0
    Path(args.child_out).write_text(json.dumps({
        "warmup": warmup, "warmup_tasks": [list(w) for w in warm], "warmup_s": warm_s,
        "warmup_compiled": sorted(k for k in after if after[k] > before.get(k, 0)),
        "memory_allocated_gb": memory / 2**30, "device_memory_used_gb": device_used / 2**30,
        "module_loading": os.environ.get("CUDA_MODULE_LOADING"), "tasks": tasks,
    }))


def summary(tasks: list[dict[str, Any]], first: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, part in (("first", tasks[:first]), ("rest", tasks[first:])):
        if not part:
            continue
        out[name] = {"tasks": len(part), "wall_ms_p50": float(np.median([t["wall_ms"] for t in part])),
                     "triton_compiles": sum(len(t["triton_compiled"]) for t in part)}
        # (the longest host stretch: from the worker's spans, kept with the GPU-side gate alone)
        spans = np.asarray([t["longest_cpu_ms"] for t in part if t["longest_cpu_ms"] is not None])
        if len(spans):
            out[name].update({"longest_cpu_ms_p50": float(np.median(spans)),
                              "longest_cpu_ms_p90": float(np.quantile(spans, 0.9)),
                              "longest_cpu_ms_max": float(spans.max()), "tasks_over_20ms": int((spans > 20).sum())})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks-from", required=False, help="a latency run's result file (its timeline's tasks)")
    p.add_argument("--tasks", type=int, default=120)
    p.add_argument("--first", type=int, default=40, help="the summary's first tasks")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--model", default="shape:llama3-8b", help="shape:NAME on CUDA, or tiny (CPU)")
    p.add_argument("--backward-tokens", type=int, default=1024)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--variants", default="one shapes",
                   help="space-separated WARMUP[:VAR=VALUE,...]; WARMUP among " + ", ".join(WARMUPS))
    p.add_argument("--shared-triton-cache", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--shapes-json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    if args.tasks_from:
        shapes = task_shapes(args.tasks_from, args.tasks)
    else:  # (the CPU smoke run: a few small tasks)
        shapes = [(40 + 8 * i, 2, 24 + 4 * i) for i in range(args.tasks)]
    work = Path(tempfile.mkdtemp())
    (work / "shapes.json").write_text(json.dumps(shapes))
    results: dict[str, Any] = {}
    for variant in args.variants.split():
        warmup, _, settings = variant.partition(":")
        if warmup not in WARMUPS:
            p.error(f"--variants {variant!r}: the warm-up must be one of {', '.join(WARMUPS)}")
        env = {**os.environ}
        if not args.shared_triton_cache:
            env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton_")
        for setting in filter(None, settings.split(",")):
            name, _, value = setting.partition("=")
            env[name] = value
        out = work / f"{len(results)}.json"
        cmd = [sys.executable, __file__, "--child", warmup, "--shapes-json", str(work / "shapes.json"),
               "--child-out", str(out), "--layers", str(args.layers), "--model", args.model,
               "--backward-tokens", str(args.backward_tokens), "--max-seq-len", str(args.max_seq_len)]
        began = time.perf_counter()
        done = subprocess.run(cmd, env=env, check=False)
        if done.returncode != 0 or not out.is_file():
            results[variant] = {"failed": done.returncode}
            print(f"{variant}: failed (rc {done.returncode})", flush=True)
            continue
        record = json.loads(out.read_text())
        record["summary"] = summary(record["tasks"], args.first)
        record["process_s"] = time.perf_counter() - began
        results[variant] = record
        s = record["summary"]
        print(f"{variant}: warm-up {record['warmup_s']:.2f} s, {record['memory_allocated_gb']:.1f} GB allocated, "
              f"{record['device_memory_used_gb']:.1f} GB of the device in use; "
              + "; ".join(f"{k} {v['tasks']} tasks: wall p50 {v['wall_ms_p50']:.1f} ms, "
                          + (f"longest host stretch p50 {v['longest_cpu_ms_p50']:.1f} ms, p90 "
                             f"{v['longest_cpu_ms_p90']:.1f}, max {v['longest_cpu_ms_max']:.1f}, "
                             f"{v['tasks_over_20ms']} over 20 ms, " if "longest_cpu_ms_p50" in v else "")
                          + f"{v['triton_compiles']} Triton compiles" for k, v in s.items()), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            **provenance(), "config": {"tasks_from": args.tasks_from, "tasks": args.tasks, "first": args.first,
                                       "layers": args.layers, "model": args.model,
                                       "backward_tokens": args.backward_tokens, "max_seq_len": args.max_seq_len,
                                       "variants": args.variants, "shared_triton_cache": args.shared_triton_cache},
            "figures": results}, indent=1))


if __name__ == "__main__":
    main()

"""Where the LoRA overhead of a prefill step goes: one ``--tokens``-token step of ``--rows`` rows
without adapters and with 4 different rank-16 adapters (the runner and rows of
``bench/engine_speed.py``), each profiled for ``--iters`` steps after ``--warmup``, then the GPU
time summed by kernel name.

The difference between the two is split into the LoRA kernels' own time (names containing
``_shrink_kernel`` / ``_expand_kernel``) and everything else (the base GEMMs that change shape or
epilogue with ``COSERVE_LORA_EXPAND_FIRST``, allocations, copies), with the kernels whose time
changed most. Run it once per flag setting to compare them:

    PYTHONPATH=src python3 bench/profile_lora.py --out bench/results/profile_lora_h200.json
    COSERVE_LORA_EXPAND_FIRST=1 PYTHONPATH=src python3 bench/profile_lora.py --out ...

On the CPU (``--smoke``: the tiny model, Triton's interpreter) there are no GPU kernels: the
figures are the ops' self CPU time instead, a check of the script only.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from engine_speed import NUM_ADAPTERS, RANK, build_runner, prefill_rows, with_adapters
from speed_common import LLAMA3_8B, TINY, provenance, sync, write_model_dir
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from coserve.engine.model_runner import BatchRow, ModelRunner
from coserve.layers import triton_lora

logger = logging.getLogger("bench")
LORA_KERNELS = ("_shrink_kernel", "_expand_kernel")


class KernelTime(NamedTuple):
    """Summed over the profiled steps: how many launches (ops on the CPU) of ``name``, their time."""

    name: str
    launches: int
    total_ms: float


def idle_gaps(spans: list[tuple[float, float, str]], iters: int, top: int) -> dict[str, Any]:
    """Where the GPU sat idle between activities (``(start µs, end µs, name)``, one stream's worth):
    the span from the first start to the last end and the idle time in it, per step, and the
    ``top`` pairs (activity before, activity after) by summed idle time before the second — a
    step whose wall time exceeds its kernels' sum waited there for the host."""
    spans = sorted(spans)
    idle_us = 0.0
    by_pair: dict[tuple[str, str], list[float]] = {}
    end, before = spans[0][1] if spans else 0.0, spans[0][2] if spans else ""
    for start, stop, name in spans[1:]:
        if start > end:
            gap = start - end
            idle_us += gap
            by_pair.setdefault((before[:60], name[:60]), []).append(gap)
        if stop > end:
            end, before = stop, name
    span_us = (end - spans[0][0]) if spans else 0.0
    ranked = sorted(by_pair.items(), key=lambda kv: -sum(kv[1]))
    return {"span_ms_per_step": span_us / 1e3 / iters, "idle_ms_per_step": idle_us / 1e3 / iters,
            "top_idle": [{"before": a, "after": b, "gaps": len(g), "idle_ms_per_step": sum(g) / 1e3 / iters,
                          "max_ms": max(g) / 1e3} for (a, b), g in ranked[:top]]}


def host_in_gaps(gpu: list[tuple[float, float, str]], host: list[tuple[float, float, str]],
                 top: int) -> list[dict[str, Any]]:
    """The ``top`` longest GPU idle gaps and what the host ran meanwhile: per gap, its length, the
    GPU activities on either side, and the host ops (``(start µs, end µs, name)``, every profiled
    CPU op and ``record_function`` range) by the time they overlap it, longest first."""
    gpu = sorted(gpu)
    found: list[tuple[float, float, str, str]] = []
    end, before = (gpu[0][1], gpu[0][2]) if gpu else (0.0, "")
    for start, stop, name in gpu[1:]:
        if start > end:
            found.append((end, start, before, name))
        if stop > end:
            end, before = stop, name
    out = []
    for lo, hi, before, after in sorted(found, key=lambda g: g[0] - g[1])[:top]:
        overlap: dict[str, float] = {}
        for h_lo, h_hi, name in host:
            us = min(hi, h_hi) - max(lo, h_lo)
            if us > 0:
                overlap[name] = overlap.get(name, 0.0) + us
        ranked = sorted(overlap.items(), key=lambda kv: -kv[1])[:12]
        out.append({"gap_ms": (hi - lo) / 1e3, "before": before[:60], "after": after[:60],
                    "host_ms": [{"op": n[:80], "ms": us / 1e3} for n, us in ranked]})
    return out


LABEL = "runner."
PHASES = ("prepare", "lora_op")
"""The runner's methods :func:`label_phases` names in the profile, beside its ``execute``."""


def label_phases(runner: ModelRunner) -> None:
    """Wrap the runner's step phases in ``record_function`` ranges (``runner.<phase>``), so the
    host side of the idle gaps names them (this script only; the runner itself adds none)."""
    for phase in ("execute", *PHASES):
        real = getattr(runner, phase)

        def labeled(*args: Any, _real: Any = real, _name: str = f"{LABEL}{phase}", **kwargs: Any) -> Any:
            with record_function(_name):
                return _real(*args, **kwargs)

        setattr(runner, phase, labeled)


def profile_steps(runner: ModelRunner, batch: list[BatchRow], iters: int, warmup: int,
                  gaps: dict[str, Any] | None = None) -> dict[str, KernelTime]:
    """``runner.execute(batch)`` ``warmup`` times, then ``iters`` times under the profiler: the GPU
    activities' time by name on CUDA; on the CPU, the ops' self CPU time by name. On CUDA,
    ``gaps`` (when given) receives :func:`idle_gaps` over every profiled step."""
    for _ in range(warmup):
        runner.execute(batch)
    sync()
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(iters):
            runner.execute(batch)
        sync()
    counts: dict[str, int] = {}
    us: dict[str, float] = {}
    if cuda:
        spans, host = [], []
        for evt in prof.events():
            span = (float(evt.time_range.start), float(evt.time_range.end), evt.name)
            if evt.name.startswith(LABEL):
                # NOTE: a record_function range also appears on the GPU's timeline, as an annotation
                # over the kernels it launched: not an activity, it would hide the gaps inside it.
                if evt.device_type != DeviceType.CUDA:
                    host.append(span)
            elif evt.device_type == DeviceType.CUDA:
                counts[evt.name] = counts.get(evt.name, 0) + 1
                us[evt.name] = us.get(evt.name, 0.0) + evt.time_range.elapsed_us()
                spans.append(span)
            else:
                host.append(span)
        if gaps is not None:
            # NOTE: the idle time includes the gaps between the profiled steps (the host's own
            # work between two runner.execute calls), as the wall time of a step does.
            gaps.update(idle_gaps(spans, iters, 12))
            gaps["longest"] = host_in_gaps(spans, host, 6)
    else:
        for avg in prof.key_averages():
            counts[avg.key], us[avg.key] = avg.count, avg.self_cpu_time_total
    return {name: KernelTime(name, counts[name], us[name] / 1e3) for name in counts}


def is_lora(name: str) -> bool:
    return any(k in name for k in LORA_KERNELS)


def case_figures(times: dict[str, KernelTime], iters: int, top: int) -> dict[str, Any]:
    """One case's total time per step and its ``top`` kernels by summed time."""
    ranked = sorted(times.values(), key=lambda k: -k.total_ms)
    return {"ms_per_step": sum(k.total_ms for k in ranked) / iters,
            "lora_kernels_ms_per_step": sum(k.total_ms for k in ranked if is_lora(k.name)) / iters,
            "top_kernels": [{"name": k.name, "count": k.launches, "total_ms": k.total_ms,
                             "ms_per_step": k.total_ms / iters} for k in ranked[:top]]}


def difference(base: dict[str, KernelTime], lora: dict[str, KernelTime], iters: int, top: int) -> dict[str, Any]:
    """``lora − base`` per step: in total, in the LoRA kernels (by kernel), in everything else, and
    the ``top`` other kernels whose time changed most (either way)."""

    def ms(times: dict[str, KernelTime], name: str) -> float:
        return times[name].total_ms / iters if name in times else 0.0

    names = set(base) | set(lora)
    total = sum(ms(lora, n) - ms(base, n) for n in names)
    by_lora_kernel = {k: sum(ms(lora, n) - ms(base, n) for n in names if k in n) for k in LORA_KERNELS}
    others = sorted((n for n in names if not is_lora(n)), key=lambda n: -abs(ms(lora, n) - ms(base, n)))
    return {"ms_per_step": total, "lora_kernels_ms_per_step": sum(by_lora_kernel.values()),
            "by_lora_kernel_ms_per_step": by_lora_kernel,
            "other_ms_per_step": total - sum(by_lora_kernel.values()),
            "top_other_changes": [{"name": n, "base_ms_per_step": ms(base, n), "lora_ms_per_step": ms(lora, n),
                                   "diff_ms_per_step": ms(lora, n) - ms(base, n)} for n in others[:top]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON result file")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--iters", type=int, default=3, help="profiled steps per case")
    parser.add_argument("--warmup", type=int, default=2, help="steps per case before the profiled ones")
    parser.add_argument("--top", type=int, default=15, help="kernels listed per case and among the changes")
    parser.add_argument("--pool-gib", type=float, default=4.0)
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU (Triton interpreter)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.manual_seed(0)
    model_cfg = TINY if args.smoke else LLAMA3_8B
    device = "cpu" if args.smoke else "cuda"
    result: dict[str, Any] = provenance()
    result["config"] = {
        "model": "tiny (smoke)" if args.smoke else "Llama-3-8B shape, dummy weights", "model_config": model_cfg,
        "dtype": "float32" if args.smoke else "bfloat16", "tokens": args.tokens, "rows": args.rows,
        "iters": args.iters, "warmup": args.warmup, "adapters": NUM_ADAPTERS, "rank": RANK,
        "time": "GPU activities (kernels, copies, sets)" if device == "cuda" else "ops' self CPU time",
        "expand_first": triton_lora.EXPAND_FIRST, "split_waves": triton_lora.SPLIT_WAVES,
        "fused_slices": triton_lora.FUSED_SLICES,
    }
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        runner = build_runner(write_model_dir(Path(tmp), model_cfg), args.pool_gib, (1,), device)
    label_phases(runner)
    base = prefill_rows(runner, args.tokens, args.rows, False, random.Random(0))
    gaps: dict[str, dict[str, Any]] = {"base": {}, "lora": {}}
    times = {"base": profile_steps(runner, base, args.iters, args.warmup, gaps["base"]),
             "lora": profile_steps(runner, with_adapters(base), args.iters, args.warmup, gaps["lora"])}
    figures: dict[str, Any] = {name: case_figures(t, args.iters, args.top) | {"gpu_idle": gaps[name]}
                               for name, t in times.items()}
    figures["lora_minus_base"] = difference(times["base"], times["lora"], args.iters, args.top)
    figures["bench_wall_s"] = time.time() - t0
    result["figures"] = figures
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    d = figures["lora_minus_base"]
    logger.info("per step: base %.3f ms, lora %.3f ms; lora - base %+.3f ms = LoRA kernels %+.3f (%s) "
                "+ other %+.3f", figures["base"]["ms_per_step"], figures["lora"]["ms_per_step"],
                d["ms_per_step"], d["lora_kernels_ms_per_step"],
                ", ".join(f"{k} {v:+.3f}" for k, v in d["by_lora_kernel_ms_per_step"].items()), d["other_ms_per_step"])
    for c in d["top_other_changes"][:5]:
        logger.info("  %+.3f ms  %s", c["diff_ms_per_step"], c["name"][:100])
    for name in ("base", "lora"):
        idle = figures[name]["gpu_idle"]
        if idle:
            logger.info("%s: GPU span %.3f ms per step, idle %.3f ms; most idle before: %s", name,
                        idle["span_ms_per_step"], idle["idle_ms_per_step"],
                        "; ".join(f"{g['after'][:40]} after {g['before'][:40]} {g['idle_ms_per_step']:.3f} ms"
                                  for g in idle["top_idle"][:4]))
            for g in idle["longest"][:3]:
                logger.info("  gap %.3f ms (%s -> %s), host: %s", g["gap_ms"], g["before"][:30], g["after"][:30],
                            "; ".join(f"{h['op'][:50]} {h['ms']:.3f}" for h in g["host_ms"][:6]))


if __name__ == "__main__":
    main()

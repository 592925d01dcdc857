"""``coserve bench``: every configuration of the evaluation on the same arrivals (issue 6).

    coserve bench --workload azure2023_code --duration 60 --rate-scale 1 \\
        --configs inference,temporal,full,naive,split --model shape:llama3-8b --device cuda \\
        --ttft-slo-ms 1000 --tpot-slo-ms 100 --out bench/results/eval

writes ``OUT/WORKLOAD.json`` (the result), ``OUT/WORKLOAD.md`` (the README table) and
``OUT/WORKLOAD-{latency,throughput,attainment}.png`` (with matplotlib).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from coserve.server.cli import add_engine_args, command, engine_kwargs

if TYPE_CHECKING:
    from coserve.bench.harness import BenchSpec


def add_bench_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.set_defaults(max_model_len=8192)
    w = p.add_argument_group("workload")
    w.add_argument(
        "--workload",
        required=True,
        help="a trace CSV (arrival_s,prompt_tokens,output_tokens), a trace name looked up in "
        "../shared/data/traces/ and .traces/ (azure2023_code, azure2023_conv, "
        "mooncake_synthetic), or a synthetic pattern: burst-light, burst-dense",
    )
    w.add_argument(
        "--duration",
        type=float,
        default=60.0,
        help="seconds of arrivals: the window holding the workload's largest burst",
    )
    w.add_argument("--rate-scale", type=float, default=1.0, help="arrival rate multiplier")
    w.add_argument("--auto-rate", action="store_true",
                   help="first find, with inference-only runs on the busiest --probe-seconds, the highest "
                        "rate at which inference alone meets the SLO for --attainment-target of the "
                        "requests: from --rate-scale, down or up by --probe-factor, then bisected until "
                        "within --probe-resolution (at most --max-probes runs)")
    w.add_argument("--probe-seconds", type=float, default=20.0)
    w.add_argument("--max-probes", type=int, default=6)
    w.add_argument("--probe-resolution", type=float, default=1.2,
                   help="stop bisecting once the failed rate is within this factor of the met one")
    w.add_argument("--latency-state", default=None,
                   help="JSON latency-model state of an earlier run (same model and engine settings): "
                        "skip the calibration")
    w.add_argument("--probe-factor", type=float, default=0.6)
    w.add_argument(
        "--length-scale", type=float, default=1.0, help="prompt and output length multiplier"
    )
    w.add_argument(
        "--max-prompt", type=int, default=4096, help="prompt lengths are clipped to this"
    )
    w.add_argument("--max-output", type=int, default=512, help="output lengths are clipped to this")
    r = p.add_argument_group("configurations and SLOs")
    r.add_argument(
        "--configs",
        default="inference,temporal,full,full-noint,naive,split",
        help="comma-separated: inference, temporal, full, full-noint, full-overlap, naive, split, "
        "inference-last (inference always runs first: it is the reference; full-overlap is full "
        "with the backward paused only where the latency model says a step would break its "
        "budget; inference-last repeats inference at the end, to show whether the order of the "
        "runs biased it); split-N and naive-N run a baseline at its own setting, NAME@N a "
        "co-serving configuration with its trainer at an N%% MPS share (e.g. full@50)",
    )
    r.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    r.add_argument("--tpot-slo-ms", type=float, default=100.0)
    r.add_argument(
        "--slo-margin", type=float, default=0.1, help="fraction of the latency budget kept free"
    )
    r.add_argument(
        "--relative-factor",
        type=float,
        default=3.0,
        help="relative SLO: TTFT and TPOT within this many times the inference-only means",
    )
    r.add_argument(
        "--attainment-target", type=float, default=0.99, help="the target line of the plots"
    )
    r.add_argument(
        "--rolling-window", type=float, default=10.0, help="seconds of the rolling attainment"
    )
    f = p.add_argument_group("fine-tuning")
    f.add_argument(
        "--ft-lengths", default="spread:256-1024", help="fixed:N or spread:LO-HI (uniform)"
    )
    f.add_argument(
        "--ft-samples", type=int, default=2000, help="synthetic samples (cycled in epochs)"
    )
    f.add_argument(
        "--backward-tokens",
        type=int,
        default=4096,
        help="tokens per backward task (at least); on the H200 the trainer's backward was bound by "
        "its CPU dispatch below ~4k tokens per task (bench/results/diagnostic/)",
    )
    f.add_argument(
        "--grad-accum",
        type=int,
        default=2,
        help="backward tasks per optimizer step (the split baseline accumulates as many batches); "
        "tasks of one step are captured while the trainer runs the previous one",
    )
    f.add_argument(
        "--save-mlp-activations",
        action="store_true",
        help="co-serving trainers differentiate the MLP from kept gate/up outputs (no MLP recompute)",
    )
    f.add_argument("--lora-rank", type=int, default=16)
    f.add_argument("--lora-alpha", type=float, default=32.0)
    f.add_argument("--target-modules", default="q_proj,k_proj,v_proj,o_proj")
    f.add_argument("--lr", type=float, default=1e-4)
    f.add_argument(
        "--naive-tokens",
        type=int,
        default=None,
        help="FT tokens the naive baseline adds to every step (default: max(256, longest sample))",
    )
    f.add_argument(
        "--split-mps-percentage",
        type=int,
        default=50,
        help="the split trainer's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (GPU with MPS only)",
    )
    f.add_argument("--no-mps", action="store_true", help="do not start the CUDA MPS daemon")
    f.add_argument(
        "--trainer-sm-share",
        type=int,
        default=None,
        help="the co-serving trainer's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, 1-100 (GPU with MPS only; "
        "default: no limit). A share keeps decode steps beside the backward steadier, at some FT "
        "throughput",
    )
    f.add_argument(
        "--trainer-threads",
        type=int,
        default=0,
        help="torch threads of trainer processes (0: default)",
    )
    o = p.add_argument_group("run")
    o.add_argument(
        "--threads", type=int, default=0, help="torch threads of the engine process (0: default)"
    )
    o.add_argument("--warmup-requests", type=int, default=16)
    o.add_argument(
        "--profile-window", default=None, metavar="START:END",
        help="run torch.profiler over this window of replay time (seconds) in every configuration "
        "and keep its operator tables in the result (figures.CONFIG.profile)",
    )
    o.add_argument(
        "--burn-in", type=float, default=0.0, metavar="SECONDS",
        help="before the reference, replay the workload's first SECONDS once, untimed (the first "
        "replay after start-up has run slower than later ones on the GPU; "
        "the inference-last configuration shows whether it still does)",
    )
    o.add_argument(
        "--drain", type=float, default=None, metavar="SECONDS",
        help="seconds to let requests finish after the window (default: as long as a request that "
        "meets the absolute SLO can take, TTFT + (max output - 1) × TPOT limit + 1 s; the drain "
        "ends early once every request still running has missed the SLO for certain)"
    )
    o.add_argument(
        "--time-budget",
        type=float,
        default=0.0,
        help="seconds for the whole benchmark (0: none): a configuration that would not finish "
        "in what is left, judged by the last run of its kind, is skipped and named as such",
    )
    o.add_argument("--no-plots", action="store_true")
    o.add_argument(
        "--out", required=True, help="directory for WORKLOAD.json, WORKLOAD.md and the plots"
    )


def _window(text: str | None) -> tuple[float, float] | None:
    if text is None:
        return None
    try:
        start, end = (float(v) for v in text.split(":"))
    except ValueError:
        raise ValueError(f"--profile-window must be START:END in seconds, got {text!r}") from None
    return start, end


def bench_spec(args: argparse.Namespace) -> BenchSpec:
    """The :class:`~coserve.bench.harness.BenchSpec` of the parsed flags."""
    from coserve.bench.configs import parse_configs
    from coserve.bench.ftdata import parse_lengths
    from coserve.bench.harness import BenchSpec, FTSetup
    from coserve.bench.workload import Scaling
    from coserve.core.config import LoRAConfig, OptimConfig, SLOConfig
    from coserve.engine.config import EngineConfig

    if args.naive_tokens is not None and args.naive_tokens <= 0:
        raise ValueError(f"--naive-tokens must be positive, got {args.naive_tokens}")
    if args.enable_prefix_caching:
        raise ValueError("--enable-prefix-caching: the configurations replay the same prompts on one engine, so "
                         "each would find the last one's prefixes cached; the evaluation runs without it")
    return BenchSpec(
        workload=args.workload,
        duration_s=args.duration,
        scaling=Scaling(
            rate=args.rate_scale,
            length=args.length_scale,
            max_prompt=args.max_prompt,
            max_output=args.max_output,
        ),
        configs=parse_configs(args.configs),
        slo=SLOConfig(
            ttft_slo_s=args.ttft_slo_ms / 1e3,
            tpot_slo_s=args.tpot_slo_ms / 1e3,
            margin=args.slo_margin,
        ),
        engine=EngineConfig(
            model=args.model,
            **engine_kwargs(args),  # type: ignore[arg-type]
        ),
        ft=FTSetup(
            lengths=parse_lengths(args.ft_lengths),
            num_samples=args.ft_samples,
            backward_tokens=args.backward_tokens,
            lora=LoRAConfig(
                rank=args.lora_rank,
                alpha=args.lora_alpha,
                target_modules=tuple(
                    t.strip() for t in args.target_modules.split(",") if t.strip()
                ),
            ),
            optim=OptimConfig(lr=args.lr, accumulation_tasks=args.grad_accum),
            naive_tokens=args.naive_tokens,
            split_mps_percentage=args.split_mps_percentage,
            trainer_sm_share=args.trainer_sm_share,
            trainer_threads=args.trainer_threads,
            save_mlp_activations=args.save_mlp_activations,
        ),
        out=Path(args.out),
        seed=args.seed,
        relative_factor=args.relative_factor,
        rolling_window_s=args.rolling_window,
        attainment_target=args.attainment_target,
        warmup_requests=args.warmup_requests,
        burn_in_s=args.burn_in,
        profile_window=_window(args.profile_window),
        drain_s=args.drain,
        mps=not args.no_mps,
        engine_threads=args.threads,
        plots=not args.no_plots,
        time_budget_s=args.time_budget,
        auto_rate=args.auto_rate,
        latency_state=Path(args.latency_state) if args.latency_state else None,
        probe_s=args.probe_seconds,
        probe_factor=args.probe_factor,
        max_probes=args.max_probes,
        probe_resolution=args.probe_resolution,
    )


@command("bench", add_bench_args, "the evaluation: replay a trace or burst pattern through inference-only, co-serving "
         "and baseline configurations on the same arrivals; JSON, table and plots")
def bench(args: argparse.Namespace) -> int:
    """Replay one workload under every configuration; write the JSON result, table and plots."""
    from coserve.bench.harness import run_bench

    spec = bench_spec(args)
    _, outputs = run_bench(spec, progress=lambda line: print(line, flush=True))
    print()
    print(outputs.markdown.read_text())
    print(f"result: {outputs.json}\ntable:  {outputs.markdown}")
    if outputs.plots:
        print("plots:  " + ", ".join(str(p) for p in outputs.plots))
    elif outputs.plots_skipped:
        print(f"plots:  {outputs.plots_skipped}")
    return 0


if __name__ == "__main__":
    from coserve.server.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))

"""``coserve bench-http``: a workload replayed open-loop against a running OpenAI-compatible server.

    coserve serve --model tiny --port 8000 &
    coserve bench-http --url http://127.0.0.1:8000 --model tiny --workload burst-light \\
        --duration 20 --rate-scale 0.05 --max-prompt 512 --max-output 64 --out result.json

Any server that takes streamed ``/v1/completions`` with token-id prompts and ``ignore_eos``
(``coserve serve``, vLLM) can be measured: SLO attainment (absolute), TTFT / TPOT percentiles,
output tokens/s, and the errors of the requests that did not finish. The result JSON carries the
provenance (commit, command) and the workload as ``coserve bench``'s does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path

from coserve.server.cli import command


def add_bench_http_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the model name requests ask for")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), metavar="KEY",
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY, else none)")
    p.add_argument("--vocab-size", type=int, default=1000,
                   help="prompts are random token ids below this (every model has 1,000 tokens)")
    p.add_argument("--workload", required=True,
                   help="a trace CSV or name (azure2023_code, azure2023_conv, ...) or burst-light / burst-dense")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (the busiest window)")
    p.add_argument("--rate-scale", type=float, default=1.0)
    p.add_argument("--length-scale", type=float, default=1.0)
    p.add_argument("--max-prompt", type=int, default=4096)
    p.add_argument("--max-output", type=int, default=512)
    p.add_argument("--seed", type=int, default=0,
                   help="the prompts' random ids (a server with prefix caching, coserve serve's default, finds "
                        "a replay's prompts cached when the same seed is replayed again: change it, or start "
                        "the server with --no-enable-prefix-caching)")
    p.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    p.add_argument("--tpot-slo-ms", type=float, default=100.0)
    p.add_argument("--drain", type=float, default=30.0, help="seconds to wait for requests in flight at the end")
    p.add_argument("--out", type=Path, default=None,
                   help="write the result JSON here (missing directories are created; checked before the replay)")


@command("bench-http", add_bench_http_args, "replay a trace or burst pattern against any OpenAI-compatible "
         "server (coserve serve, vLLM): SLO attainment and latencies")
def bench_http(args: argparse.Namespace) -> int:
    """Replay the workload against the server; print and write attainment and latencies. Exit
    status 1 when no request finished, 130 at Ctrl-C (the requests sent until then are written)."""
    try:
        return _bench_http(args)
    except KeyboardInterrupt:  # (outside the replay, which stops by itself at Ctrl-C)
        print("coserve bench-http: interrupted", file=sys.stderr)
        return 130


def _bench_http(args: argparse.Namespace) -> int:
    from coserve.bench.http_driver import HttpDriver
    from coserve.bench.metrics import attainment, latency_summary
    from coserve.bench.provenance import provenance
    from coserve.bench.report import check_out_file
    from coserve.bench.workload import Scaling, load_workload

    scaling = Scaling(rate=args.rate_scale, length=args.length_scale, max_prompt=args.max_prompt,
                      max_output=args.max_output)
    if not (math.isfinite(args.drain) and args.drain >= 0):
        raise ValueError(f"--drain must be a finite number of seconds >= 0, got {args.drain:g}")
    if args.out is not None:
        check_out_file(args.out)
    driver = HttpDriver(args.url, args.model, seed=args.seed, vocab_size=args.vocab_size, api_key=args.api_key)
    context = driver.check()  # (an unreachable server or an unknown model: an error now, not N failed requests)
    if context is not None:
        scaling = scaling.fit(context, lambda line: print(f"coserve bench-http: {line}", flush=True))
    workload = load_workload(args.workload, args.duration, scaling, seed=args.seed)
    if not workload.arrivals:
        raise ValueError(f"--workload {args.workload}: no request arrives in the {args.duration:g} s window; "
                         "raise --rate-scale or --duration")
    print(f"coserve bench-http: {len(workload.arrivals)} requests of {workload.name} over {args.duration:g} s "
          f"to {args.url} ({args.model})", flush=True)
    replay = driver.run(workload.arrivals, duration_s=args.duration, drain_s=args.drain)
    records = replay.result.records
    if replay.interrupted:
        cut = sum(1 for message in replay.errors.values() if message.startswith("interrupted"))
        print(f"coserve bench-http: interrupted after {replay.result.duration_s:.1f} s; the result covers the "
              f"{len(records)} of {len(workload.arrivals)} requests sent until then ({cut} cut off in flight, "
              "counted as unfinished)", file=sys.stderr, flush=True)
    slo = (args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3)
    summary = latency_summary(records)
    figures = {
        "attainment_abs": attainment(records, *slo),
        "output_tokens_per_s": replay.result.inference_tokens / max(replay.result.duration_s, 1e-9),
        **summary,
        "errors": len(replay.errors),
        "first_errors": dict(list(sorted(replay.errors.items()))[:10]),
    }
    result = {
        **provenance(),
        "config": {"url": args.url, "model": args.model, "vocab_size": args.vocab_size,
                   "workload": {"name": workload.name, "source": workload.source,
                                "window_start_s": workload.window_start_s, "duration_s": args.duration,
                                "requests": len(workload.arrivals), "seed": args.seed,
                                "scaling": asdict(scaling)},
                   "slo": {"ttft_ms": args.ttft_slo_ms, "tpot_ms": args.tpot_slo_ms}},
        "interrupted": replay.interrupted,
        "figures": figures,
        "per_request": [[r.arrival_s, r.first_token_s, r.finish_s, r.prompt_tokens, r.output_tokens]
                        for r in records],
    }

    def ms(key: str) -> str:
        v = summary[key]
        return "-" if math.isnan(v) else f"{v:,.0f}"

    if not records:
        print("no request was sent")
    else:
        print(f"finished {int(summary['finished'])}/{len(records)}, SLO attainment "
              f"{figures['attainment_abs']:.1%} (TTFT <= {args.ttft_slo_ms:g} ms, TPOT <= {args.tpot_slo_ms:g} ms); "
              f"TTFT p50/p99 {ms('ttft_p50_ms')}/{ms('ttft_p99_ms')} ms, TPOT p50/p99 "
              f"{ms('tpot_p50_ms')}/{ms('tpot_p99_ms')} ms; {figures['output_tokens_per_s']:,.0f} output tokens/s")
    if replay.errors:
        i, message = next(iter(sorted(replay.errors.items())))
        print(f"{len(replay.errors)} requests did not finish; the first, request {i}: {message}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"result: {args.out}")
    if replay.interrupted:
        return 130
    if records and not summary["finished"]:
        print(f"coserve bench-http: error: none of the {len(records)} requests finished (the errors above)",
              file=sys.stderr)
        return 1
    return 0

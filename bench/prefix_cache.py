"""What automatic prefix caching saves: requests that share a system prompt, each with its own
question, sent one after another (TTFT: the time to the first token of a request alone), with
the cache and without it, on the same engine settings. Each setting runs in a process of its own:
in one process the first engine's GPU memory was not all given back before the second's KV cache
was sized (session 30, the H100: "-18031 MiB left").

    python bench/prefix_cache.py --out bench/results/host_cpu/session25/prefix_cache.json
    python bench/prefix_cache.py --model shape:llama3-8b --device cuda --shared 2048 --own 128 --out ...

Writes per setting the TTFT p50/p90 of the requests after the first and the cache's counters
(prompt tokens asked for, found cached).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from coserve.bench.provenance import provenance
from coserve.bench.shapes import is_shape, materialize
from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.engine.sampling_params import SamplingParams


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--shared", type=int, default=512, help="tokens of the system prompt every request starts with")
    p.add_argument("--own", type=int, default=32, help="tokens of each request's own question")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=1000)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                   help="each engine's share of the GPU's memory (two are made, one after the other)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--only", choices=SETTINGS, default=None,
                   help="run this setting alone and write its figures to --out (what each child process does)")
    return p.parse_args()


SETTINGS = ("uncached", "cached")


def run(args: argparse.Namespace, model: str, caching: bool, prompts: list[list[int]],
        warm: list[list[int]]) -> dict[str, Any]:
    engine = LLMEngine(EngineConfig(model=model, device=args.device, load_format="dummy" if is_shape(args.model)
                                    else "auto", enable_prefix_caching=caching,
                                    gpu_memory_utilization=args.gpu_memory_utilization,
                                    max_model_len=max(len(p) for p in prompts) + args.max_tokens + 16))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(warm):  # (a process's first steps are slower; then nothing cached is kept)
        engine.add_request(f"warm{i}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
    engine.block_manager.reset_prefix_cache()
    engine.block_manager.queried_tokens = engine.block_manager.hit_tokens = 0
    ttft = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
        start, first = time.perf_counter(), None
        while engine.has_unfinished_requests():
            outputs = engine.step()
            if first is None and any(o.outputs[0].token_ids for o in outputs):
                first = time.perf_counter() - start
        ttft.append(first or 0.0)
    later = sorted(ttft[1:]) or [0.0]  # (the first request has nothing cached either way)
    bm = engine.block_manager
    return {"ttft_p50_ms": statistics.median(later) * 1e3, "ttft_p90_ms": later[int(0.9 * (len(later) - 1))] * 1e3,
            "ttft_first_ms": ttft[0] * 1e3, "queried_tokens": bm.queried_tokens, "hit_tokens": bm.hit_tokens,
            "ttft_ms": [t * 1e3 for t in ttft]}


def main() -> int:
    args = parse_args()
    if args.only is not None:
        return run_one(args)
    figures = {}
    with tempfile.TemporaryDirectory(prefix="coserve-prefix-cache-") as tmp:
        for name in SETTINGS:
            part = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, __file__, *sys.argv[1:], "--only", name, "--out", str(part)]
            subprocess.run(cmd, check=True)
            figures[name] = json.loads(part.read_text())
    off, on = figures["uncached"], figures["cached"]
    figures["ttft_p50_ratio"] = off["ttft_p50_ms"] / max(on["ttft_p50_ms"], 1e-9)
    result = {**provenance(), "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "figures": figures}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name in SETTINGS:
        f = figures[name]
        print(f"{name:>8}: TTFT p50 {f['ttft_p50_ms']:.1f} ms, p90 {f['ttft_p90_ms']:.1f} ms (first request "
              f"{f['ttft_first_ms']:.1f} ms); prompt tokens found cached {f['hit_tokens']:,} of {f['queried_tokens']:,}")
    print(f"TTFT p50 without / with the cache: {figures['ttft_p50_ratio']:.2f}x; result: {args.out}")
    return 0


def run_one(args: argparse.Namespace) -> int:
    """One setting (``--only``) in this process: its figures, as JSON, to ``--out``."""
    rng = random.Random(args.seed)
    shared = [rng.randrange(10, args.vocab_size) for _ in range(args.shared)]
    prompts = [shared + [rng.randrange(10, args.vocab_size) for _ in range(args.own)] for _ in range(args.requests)]
    warm = [[rng.randrange(10, args.vocab_size) for _ in range(args.shared + args.own)] for _ in range(2)]
    model = args.model
    if is_shape(model):
        model = str(materialize(model, Path(tempfile.mkdtemp(prefix="coserve-shape-"))))
    args.out.write_text(json.dumps(run(args, model, args.only == "cached", prompts, warm)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

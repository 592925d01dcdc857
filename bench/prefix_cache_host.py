"""The host time prefix caching adds to the engine's thread (no model: the block manager alone).

    python bench/prefix_cache_host.py --out bench/results/host_cpu/session25/prefix_cache_host.json

Per decode step, :meth:`BlockManager.register` runs for every scheduled sequence (a digest only
when a block fills up); per admission, :meth:`BlockManager.match` digests the prompt's whole blocks
once (kept on the sequence) and looks them up. Timed as serving runs them, with caching on and off:
``register`` over ``--running`` decoding sequences (contexts of 0.5-1.5 x ``--context`` tokens,
so that their blocks fill at different steps, as in serving) for ``--steps`` steps, and ``match`` + ``reuse``
of new ``--prompt``-token sequences that share a prefix with a finished one.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from coserve.bench.provenance import provenance
from coserve.engine.block_manager import BlockManager, cache_key
from coserve.engine.sampling_params import SamplingParams
from coserve.engine.sequence import Sequence


def computed(bm: BlockManager, rid: str, tokens: list[int]) -> Sequence:
    """A sequence of ``tokens`` with all of them computed and registered (caching: ``bm``'s)."""
    s = Sequence(rid, tokens, SamplingParams(), cache_key=cache_key() if bm.enable_prefix_caching else None)
    bm.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.register(s)
    return s


def decode_steps(caching: bool, args: argparse.Namespace) -> list[float]:
    """Seconds of the register calls of each decode step over ``--running`` sequences."""
    rng = random.Random(0)
    bm = BlockManager(args.blocks, args.block_size, caching)
    seqs = []
    for i in range(args.running):
        context = rng.randrange(args.context // 2, args.context * 3 // 2)  # (blocks fill at different steps)
        seqs.append(computed(bm, f"r{i}", [rng.randrange(10, 32000) for _ in range(context)]))
    times = []
    for _ in range(args.steps):
        for s in seqs:  # (the scheduler's allocation for the next token, outside the timing)
            s.output_token_ids.append(rng.randrange(10, 32000))
            bm.allocate(s, 1)
        t = time.perf_counter()
        for s in seqs:
            s.num_computed_tokens += 1
            bm.register(s)
        times.append(time.perf_counter() - t)
    return times


def admissions(caching: bool, args: argparse.Namespace) -> list[float]:
    """Seconds of match + reuse + allocate for each new sequence sharing a finished one's prompt
    but its last 16 tokens."""
    rng = random.Random(1)
    bm = BlockManager(args.blocks, args.block_size, caching)
    shared = [rng.randrange(10, 32000) for _ in range(args.prompt - 16)]
    bm.free(computed(bm, "first", shared + [1] * 16))
    times = []
    for i in range(args.admissions):
        s = Sequence(f"a{i}", shared + [rng.randrange(10, 32000) for _ in range(16)], SamplingParams(),
                     cache_key=cache_key() if caching else None)
        t = time.perf_counter()
        cached = bm.match(s)
        n = s.num_tokens - len(cached) * bm.block_size
        assert bm.can_admit(s, cached, n)
        bm.reuse(s, cached)
        bm.allocate(s, n)
        times.append(time.perf_counter() - t)
        bm.free(s)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=40000)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--admissions", type=int, default=200)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    figures = {}
    for caching in (False, True):
        step, admit = decode_steps(caching, args), admissions(caching, args)
        figures["on" if caching else "off"] = {
            "decode_step_register_us": {"p50": statistics.median(step) * 1e6,
                                        "p99": sorted(step)[int(0.99 * (len(step) - 1))] * 1e6},
            "admission_us": {"p50": statistics.median(admit) * 1e6,
                             "p99": sorted(admit)[int(0.99 * (len(admit) - 1))] * 1e6},
        }
    result = {**provenance(), "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "figures": figures}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name, f in figures.items():
        print(f"caching {name}: register per decode step of {args.running} sequences p50 "
              f"{f['decode_step_register_us']['p50']:.0f} us (p99 {f['decode_step_register_us']['p99']:.0f}); "
              f"admission of a {args.prompt}-token prompt p50 {f['admission_us']['p50']:.0f} us "
              f"(p99 {f['admission_us']['p99']:.0f})")
    print(f"result: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A short prefill chunk over a long cached prefix: the paged ``prefill`` kernel with and without
its prefix cut into splits (``AttentionTuning.prefill_splits``, ``COSERVE_PREFILL_SPLITS``).

One layer of the Llama-3-8B shape (32 query heads, 8 KV heads, head size 128, bf16, 16-token
blocks, the KV pool far past L2) and one step of the kind that a chat's next turn over a cached
conversation, or a prompt's last chunk, makes: a chunk of ``--chunks`` tokens over ``--contexts``
cached ones beside ``--decodes`` decode rows of 2,048 tokens (the decode kernel's time is the same
either way and counted in both). Per case: the GPU time of one call (``--calls`` back to back
between two events, so that the host's launches are not timed), both ways, their ratio, the
splits chosen, and the split output's relative error against the unsplit one.

``--fresh N,...``: each case also beside a fresh chunk of N tokens (no cached context; N = 0: none),
the step paged-only up to ``PAGED_SMALL_PREFILL`` tokens, else the fresh chunk through flash; such
a case is timed a third way, with the splits sized by every tile (``COSERVE_PREFILL_SPLIT_TILES=all``,
the rule before session 35, which does not split beside a flash row) against the context tiles
(``context``, the default).

    PYTHONPATH=src python bench/prefill_context.py --out bench/results/engine_h200/prefill_context.json
    PYTHONPATH=src python bench/prefill_context.py --smoke --out /tmp/prefill_context.json   # CPU, interpreter
    PYTHONPATH=src python bench/prefill_context.py --chunks 8,16,64 --contexts 2048,4096,8192 --fresh 400,1024 \
        --out bench/results/engine_h100/prefill_fresh.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("bench")


def gpu_seconds(fn: Any, calls: int) -> float:
    """Seconds per call of ``fn`` queued ``calls`` times between two events (host clock on CPU)."""
    import time

    fn()
    if not torch.cuda.is_available():
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t) / calls
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def case(chunk: int, context: int, decodes: int, *, heads: tuple[int, int, int], block: int, nblocks: int,
         cache: torch.Tensor, device: torch.device, calls: int, rng: random.Random,
         min_keys: int | None, min_splits: int | None, fresh: int = 0) -> dict[str, Any]:
    from coserve.layers.attention import AttentionMetadata
    from coserve.layers.triton_attention import AttentionTuning, TritonAttention

    h, kvh, d = heads
    decode_ctx = min(2048, context)
    lead = [fresh] if fresh else []  # (a fresh prompt's chunk beside: no cached context)
    q_lens = [chunk, *lead] + [1] * decodes
    ctxs = [context, *[0] * len(lead)] + [decode_ctx] * decodes
    tables = [[rng.randrange(nblocks) for _ in range(-(-(c + n) // block))] for c, n in zip(ctxs, q_lens, strict=True)]
    meta = AttentionMetadata.build(q_lens, ctxs, tables, [True] * len(q_lens), 1 + len(lead), block, device=device)
    t = sum(q_lens)
    dtype = cache.dtype
    q = torch.randn(t, h, d, dtype=dtype, device=device)
    k = torch.randn(t, kvh, d, dtype=dtype, device=device)
    v = torch.randn(t, kvh, d, dtype=dtype, device=device)
    # every prefill row through the paged kernel where the step is small (PAGED_SMALL_PREFILL), else
    # the fresh chunk through flash; the splits sized by the context tiles (PREFILL_SPLIT_TILES)
    small = chunk + fresh <= AttentionTuning().prefill_paged_tokens
    base = AttentionTuning(prefill_paged_tokens=10**6 if small else 0, prefill_split_tiles="context")
    if min_keys is not None:
        base = replace(base, prefill_split_min_keys=min_keys)
    if min_splits is not None:
        base = replace(base, prefill_split_min_splits=min_splits)
    plain, split = TritonAttention(replace(base, prefill_splits=False)), TritonAttention(
        replace(base, prefill_splits=True))
    split_all = TritonAttention(replace(base, prefill_splits=True, prefill_split_tiles="all"))
    scale = d**-0.5

    def run(backend: TritonAttention) -> torch.Tensor:
        # (kv_stored: the same cache read every call; the chunk's own K/V come from k and v)
        return backend.forward(q, k, v, cache, meta, scale, None, kv_stored=True)

    ref, out = run(plain).float(), run(split).float()
    err = float((out - ref).norm() / ref.norm())
    # (the splits the step's plan chose: its paged tiles' prefixes, sized by the context tiles)
    splits = meta.prefill_plans[(0, split.tuning)].splits
    plain_s, split_s = gpu_seconds(lambda: run(plain), calls), gpu_seconds(lambda: run(split), calls)
    row = {"chunk": chunk, "context": context, "fresh": fresh, "paged_only": small, "decodes": decodes,
           "splits": splits, "plain_us": plain_s * 1e6, "split_us": split_s * 1e6,
           "split_over_plain": split_s / plain_s, "rel_err": err}
    if fresh:  # (the rule before session 35: every tile counted, no split beside flash)
        all_s = gpu_seconds(lambda: run(split_all), calls)
        row |= {"split_all_splits": meta.prefill_plans[(0, split_all.tuning)].splits,
                "split_all_us": all_s * 1e6, "split_over_split_all": split_s / all_s,
                "split_all_rel_err": float((run(split_all).float() - ref).norm() / ref.norm())}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", default="8,26,64,128,512")
    p.add_argument("--contexts", default="1024,4096,8192")
    p.add_argument("--decodes", type=int, default=16)
    p.add_argument("--fresh", default="0",
                   help="fresh chunks (no cached context) beside, one case each (0: none); e.g. 400,1024: "
                        "the paged-only step and the step with a flash row")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--min-keys", type=int, default=None,
                   help="AttentionTuning.prefill_split_min_keys (default: the tuning's; session 28's run: 256)")
    p.add_argument("--min-splits", type=int, default=None,
                   help="AttentionTuning.prefill_split_min_splits (default: the tuning's; session 28's run: 1)")
    p.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU through Triton's interpreter")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from speed_common import provenance  # (after TRITON_INTERPRET: it imports torch and coserve)

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    heads, block = ((4, 2, 16), 4) if args.smoke else ((32, 8, 128), 16)
    chunks = [int(c) for c in args.chunks.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.smoke:
        chunks, contexts, args.decodes, args.calls = [3, 20], [40, 200], 2, 2
        args.min_keys = 8 if args.min_keys is None else args.min_keys
        args.min_splits = 2 if args.min_splits is None else args.min_splits
    # a KV pool far past L2 (2.6 GB at the 8B shape), one layer
    nblocks = 400 if args.smoke else 40000
    dtype = torch.float32 if args.smoke else torch.bfloat16
    cache = torch.randn(nblocks, 1, 2, block, heads[1], heads[2], dtype=dtype, device=device)[:, 0]
    rng = random.Random(0)
    fresh = [int(f) for f in args.fresh.split(",")]
    if args.smoke and any(fresh):
        fresh = [0, 30]
    rows = []
    for context in contexts:
        for chunk in chunks:
            for lead in fresh:
                row = case(chunk, context, args.decodes, heads=heads, block=block, nblocks=nblocks, cache=cache,
                           device=device, calls=args.calls, rng=rng, min_keys=args.min_keys,
                           min_splits=args.min_splits, fresh=lead)
                logger.info("chunk %d over %d beside %d fresh: %d splits, %.1f -> %.1f us (x%.2f), rel err %.1e%s",
                            chunk, context, lead, row["splits"], row["plain_us"], row["split_us"],
                            row["split_over_plain"], row["rel_err"],
                            f"; every tile counted {row['split_all_us']:.1f} us" if lead else "")
                rows.append(row)
    record = {**provenance(), "config": {"heads": heads, "block_size": block, "decodes": args.decodes,
                                         "fresh": fresh,
                                         "min_keys": args.min_keys, "min_splits": args.min_splits,
                                         "calls": args.calls, "smoke": args.smoke, "dtype": str(dtype)},
              "figures": {"cases": rows}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

"""Engine speed on one GPU at the Llama-3-8B shape (bf16, dummy weights), next to the hardware.

1. decode step time at batch x context, next to the HBM floor (weight bytes + KV bytes read over
   the measured copy bandwidth), as CUDA-graph replay and, for some points, eager;
2. prefill throughput from 512 to 16k tokens, next to the FLOP floor at the measured matmul rate;
3. LoRA overhead: 4 different rank-16 adapters in the batch vs none; for prefill, base and adapter
   steps alternate (:func:`bench_prefill_ab`), so that clock drift does not bias the ratio.

The step time is ``ModelRunner.execute`` wall time (host preparation + device work + logits),
which is what the engine pays per step (scheduling and sampling excluded). KV blocks are random
draws from a pool of ``--pool-gib`` (rows may share blocks: 256 x 8192 tokens exceed the GPU).

    PYTHONPATH=src python3 bench/engine_speed.py --out bench/results/engine_speed_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from kernel_checks import check_kernels, time_attention
from speed_common import (
    LLAMA3_8B,
    TINY,
    copy_bandwidth,
    cuda_time,
    matmul_rate,
    provenance,
    sync,
    wall_time,
    write_model_dir,
)

from coserve.engine.config import EngineConfig
from coserve.engine.cuda_graph import GraphKey
from coserve.engine.model_runner import BatchRow, ModelRunner
from coserve.models.loader import load_model

logger = logging.getLogger("bench")
NUM_ADAPTERS, RANK = 4, 16


def build_runner(model_dir: Path, pool_gib: float, batch_sizes: tuple[int, ...], device: str) -> ModelRunner:
    dtype = "bfloat16" if device == "cuda" else "float32"
    model = load_model(model_dir, load_format="dummy", dtype=dtype, device=device,
                       num_lora_slots=NUM_ADAPTERS, max_lora_rank=RANK)
    with torch.no_grad():
        for lin in model.lora_linears():
            for name in lin.out_slices:
                a, b = lin.lora_stacks(name)
                a.normal_(0, lin.in_features**-0.5)
                b.normal_(0, 0.01)
    cfg = model.config
    block_bytes = 2 * cfg.num_layers * 16 * cfg.kv_size * model.lm_head_weight.element_size()
    config = EngineConfig(
        model=str(model_dir), dtype=dtype, device=device,
        attention_backend="triton" if device == "cuda" else "torch", lora_backend="triton" if device == "cuda" else "torch",
        num_kv_blocks=int(pool_gib * 2**30 // block_bytes), max_model_len=16384 + 64,
        max_num_seqs=max(batch_sizes), max_loras=NUM_ADAPTERS, max_lora_rank=RANK,
        cuda_graph_batch_sizes=batch_sizes, max_num_batched_tokens=16384,
        prefill_graphs=False,  # (the callers build the piecewise graphs themselves where asked)
    )
    scales = torch.full((NUM_ADAPTERS,), 2.0, dtype=torch.float32, device=device)
    runner = ModelRunner(config, model, scales)
    if runner.graphs is None:  # CPU smoke run: the graph path's static buffers, run eagerly
        runner.graphs = runner.decode_graphs(capture=False)
    flat = runner.kv_cache.view(-1)
    for i in range(0, flat.numel(), 2**30):  # never time on zeros
        flat[i : i + 2**30].normal_()
    return runner


def weight_bytes(runner: ModelRunner) -> int:
    """Bytes of the weights one decode step reads (every linear, norms, LM head; no embedding table)."""
    model = runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()


def kv_bytes(runner: ModelRunner, batch: int, context: int) -> int:
    """K and V bytes a decode step reads: every cached token and the new one, every layer."""
    cfg = runner.model.config
    return batch * (context + 1) * cfg.num_layers * 2 * cfg.kv_size * runner.kv_cache.element_size()


def decode_rows(runner: ModelRunner, batch: int, context: int, adapters: bool, rng: random.Random) -> list[BatchRow]:
    nb = context // 16 + 1
    return [BatchRow([rng.randrange(runner.model.config.vocab_size)], context, rng.choices(range(runner.num_blocks), k=nb),
                     lora_slot=i % NUM_ADAPTERS if adapters else -1, samples=True, is_prefill=False)
            for i in range(batch)]


def bench_decode(runner: ModelRunner, batches: list[int], contexts: list[int], copy_bw: float,
                 rng: random.Random, adapters: bool = False, eager_at: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    out = []
    wbytes = weight_bytes(runner)
    assert runner.graphs is not None
    for context in contexts:
        for batch in batches:
            rows = decode_rows(runner, batch, context, adapters, rng)
            iters = 10 if batch * context >= 2**19 else 30
            step = wall_time(lambda rows=rows: runner.execute(rows), iters=iters)
            assert runner.last_mode == "graph"
            bucket = runner.graphs.bucket(batch)
            graph = runner.graphs.graphs.get(GraphKey(bucket or 0, adapters))
            replay = cuda_time(graph.replay, iters=iters) if graph is not None else float("nan")
            floor = (wbytes + kv_bytes(runner, batch, context)) / copy_bw
            rec: dict[str, Any] = {
                "batch": batch, "context": context, "adapters": NUM_ADAPTERS if adapters else 0,
                "step_s": step, "replay_s": replay, "hbm_floor_s": floor,
                "step_over_floor": step / floor, "replay_over_floor": replay / floor,
            }
            if context in eager_at:
                graphs, runner.graphs = runner.graphs, None
                rec["eager_step_s"] = wall_time(lambda rows=rows: runner.execute(rows), iters=iters)
                runner.graphs = graphs
            logger.info("decode %s", json.dumps({k: round(v, 5) if isinstance(v, float) else v
                                                 for k, v in rec.items()}))
            out.append(rec)
    return out


def prefill_flops(cfg: dict[str, Any], tokens: int, rows: int) -> float:
    """Linear layers (2 FLOP per weight per token), causal attention per row, LM head per row."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    per_token = 2 * layers * (h * (h + 2 * kv) + h * h + 3 * h * inter)
    per_row = tokens // rows
    attn = rows * 2 * per_row * per_row * h * layers
    return per_token * tokens + attn + rows * 2 * h * cfg["vocab_size"]


def prefill_rows(runner: ModelRunner, tokens: int, rows: int, adapters: bool, rng: random.Random) -> list[BatchRow]:
    n = tokens // rows
    free = list(range(runner.num_blocks))
    return [BatchRow([rng.randrange(runner.model.config.vocab_size) for _ in range(n)], 0,
                     [free.pop() for _ in range(-(-n // 16))],
                     lora_slot=i % NUM_ADAPTERS if adapters else -1, samples=True)
            for i in range(rows)]


def with_adapters(rows: list[BatchRow]) -> list[BatchRow]:
    """The same rows, row ``i`` on adapter slot ``i % NUM_ADAPTERS``."""
    return [dataclasses.replace(r, lora_slot=i % NUM_ADAPTERS) for i, r in enumerate(rows)]


def bench_prefill(runner: ModelRunner, cfg: dict[str, Any], lengths: list[int], mm_rate: float,
                  rng: random.Random, rows: int = 1, adapters: bool = False) -> list[dict[str, Any]]:
    out = []
    for tokens in lengths:
        batch = prefill_rows(runner, tokens, rows, adapters, rng)
        t = wall_time(lambda batch=batch: runner.execute(batch), iters=3 if tokens >= 8192 else 5, warmup=2)
        flops = prefill_flops(cfg, tokens, rows)
        rec = {"tokens": tokens, "rows": rows, "adapters": NUM_ADAPTERS if adapters else 0, "step_s": t,
               "tokens_per_s": tokens / t, "tflops": flops / t / 1e12, "flop_floor_s": flops / mm_rate,
               "fraction_of_matmul_rate": flops / t / mm_rate}
        logger.info("prefill %s", json.dumps({k: round(v, 5) if isinstance(v, float) else v
                                              for k, v in rec.items()}))
        out.append(rec)
    return out


PIECE_RUNS = [0]
"""Steps that ran through the prefill graphs (``--prefill-graphs``), counted for the A/B records."""


def ab_rounds(tokens: int) -> int:
    """Base/LoRA rounds of :func:`bench_prefill_ab` at a step of ``tokens`` tokens."""
    return 4 if tokens >= 8192 else 7


def bench_prefill_ab(runner: ModelRunner, cfg: dict[str, Any], lengths: list[int], mm_rate: float,
                     rng: random.Random, rows: int = 4, warmup: int = 2) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """LoRA prefill overhead, interleaved: at each length, ``warmup`` steps of each batch, then
    :func:`ab_rounds` rounds of one base step and one step of the same rows with the adapters
    (ABAB…), each step timed alone (synchronized before and after). Timing all base steps and then
    all adapter steps let a clock drift between the two blocks pass for overhead (+10.8% to +16.5%
    on the H200 across runs of one build).

    Returns ``(records, rounds)``: :func:`bench_prefill`'s records from the medians (every base
    length, then every adapter length), and per length the per-round times and ratios, the
    overhead ``median(lora) / median(base) - 1`` and the ratios' median, min and max.
    """

    def once(batch: list[BatchRow]) -> float:
        sync()
        t0 = time.perf_counter()
        runner.execute(batch)
        sync()
        return time.perf_counter() - t0

    records: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    rounds = []
    for tokens in lengths:
        base = prefill_rows(runner, tokens, rows, False, rng)
        lora = with_adapters(base)
        for _ in range(warmup):
            once(base)
            once(lora)
        times: dict[bool, list[float]] = {False: [], True: []}
        modes: dict[bool, str] = {}
        for _ in range(ab_rounds(tokens)):
            for adapters, batch in ((False, base), (True, lora)):
                replays = PIECE_RUNS[0]
                times[adapters].append(once(batch))
                modes[adapters] = "prefill graphs" if PIECE_RUNS[0] > replays else "eager"
        flops = prefill_flops(cfg, tokens, rows)
        for adapters, ts in times.items():
            t = statistics.median(ts)
            records[adapters].append({
                "tokens": tokens, "rows": rows, "adapters": NUM_ADAPTERS if adapters else 0, "step_s": t,
                "tokens_per_s": tokens / t, "tflops": flops / t / 1e12, "flop_floor_s": flops / mm_rate,
                "fraction_of_matmul_rate": flops / t / mm_rate})
        ratios = [b / a for a, b in zip(times[False], times[True], strict=True)]
        rec: dict[str, Any] = {
            "tokens": tokens, "rows": rows, "base_s": times[False], "lora_s": times[True], "ratio": ratios,
            "modes": {"base": modes[False], "lora": modes[True]},  # how each kind of step ran
            "overhead": statistics.median(times[True]) / statistics.median(times[False]) - 1,
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
        logger.info("lora prefill A/B T=%d: overhead %+.4f, round ratios %s", tokens, rec["overhead"],
                    [round(r, 4) for r in ratios])
        rounds.append(rec)
    return records[False] + records[True], rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON result file")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--contexts", default="512,2048,8192")
    parser.add_argument("--prefill", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--lora-prefill", default="4096,16384",
                        help="prefill lengths of the LoRA section (4 rows each; the issue's goal is at >= 4k; "
                             "co-serving's mixed steps are 512-2048)")
    parser.add_argument("--pool-gib", type=float, default=48.0)
    parser.add_argument("--sections", default="check,kernels,decode,prefill,lora")
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU (Triton interpreter)")
    parser.add_argument("--prefill-graphs", action="store_true",
                        help="eager steps of up to 2,048 tokens through the piecewise CUDA graphs "
                             "(engine/prefill_graphs.py; the LoRA section's mid sizes then replay their kernels)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    sections = set(args.sections.split(","))
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    lengths = [int(x) for x in args.prefill.split(",")]
    rng = random.Random(0)
    torch.manual_seed(0)
    model_cfg = TINY if args.smoke else LLAMA3_8B
    device = "cpu" if args.smoke else "cuda"
    result: dict[str, Any] = provenance()
    result["config"] = {"model": "tiny (smoke)" if args.smoke else "Llama-3-8B shape, dummy weights",
                        "model_config": model_cfg, "dtype": "float32" if args.smoke else "bfloat16",
                        "block_size": 16, "kv_pool_gib": args.pool_gib, "batches": batches, "contexts": contexts,
                        "prefill_lengths": lengths, "adapters": NUM_ADAPTERS, "rank": RANK,
                        "attention_backend": "triton", "lora_backend": "triton",
                        "prefill_graphs": args.prefill_graphs}
    figures: dict[str, Any] = {}
    result["figures"] = figures
    t0 = time.time()

    def save() -> None:
        figures["bench_wall_s"] = time.time() - t0
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))

    if args.smoke:
        sections -= {"check", "kernels"}
        bw, mm = 1e10, 1e11
    else:
        bw, mm = copy_bandwidth(), matmul_rate()
    figures["copy_bandwidth_Bps"], figures["matmul_flops"] = bw, mm
    logger.info("ceilings: copy %.2f TB/s, bf16 matmul %.0f TFLOP/s", bw / 1e12, mm / 1e12)
    if "check" in sections:
        figures["checks_rel_err"] = check_kernels()
        logger.info("checks %s", figures["checks_rel_err"])
        save()
    tuning = None
    if "kernels" in sections:
        tuning, figures["attention_kernels"] = time_attention(bw, mm)
        logger.info("chosen tuning %s", figures["attention_kernels"]["chosen"])
        save()
    with tempfile.TemporaryDirectory() as tmp:
        runner = build_runner(write_model_dir(Path(tmp), model_cfg), args.pool_gib, tuple(batches), device)
    if tuning is not None:
        runner.backend.tuning = tuning  # type: ignore[attr-defined]
    if args.prefill_graphs:
        pieces = runner.prefill_graphs = runner.make_prefill_graphs(capture=device == "cuda")
        pieces.capture_all()
        real_run = pieces.run

        def counted_run(*a: Any, **k: Any) -> Any:
            PIECE_RUNS[0] += 1
            return real_run(*a, **k)

        pieces.run = counted_run  # type: ignore[method-assign]
    figures["weight_bytes"] = weight_bytes(runner)
    if "decode" in sections:
        figures["decode"] = bench_decode(runner, batches, contexts, bw, rng, eager_at=(2048,))
        save()
    if "prefill" in sections:
        figures["prefill"] = bench_prefill(runner, model_cfg, lengths, mm, rng)
        save()
    if "lora" in sections:
        figures["lora_decode"] = bench_decode(runner, batches, [2048], bw, rng, adapters=True)
        lora_lengths = [int(n) for n in args.lora_prefill.split(",") if n and int(n) <= max(lengths)]
        figures["lora_prefill"], figures["lora_prefill_ab"] = bench_prefill_ab(runner, model_cfg, lora_lengths,
                                                                               mm, rng, rows=4)
        base = {r["batch"]: r["step_s"] for r in figures["decode"] if r["context"] == 2048}
        figures["lora_overhead"] = {
            "decode": {str(r["batch"]): r["step_s"] / base[r["batch"]] - 1
                       for r in figures["lora_decode"] if r["batch"] in base},
            "prefill": {str(r["tokens"]): r["overhead"] for r in figures["lora_prefill_ab"]},
        }
        logger.info("lora overhead %s", figures["lora_overhead"])
    save()
    summarize(figures)


def summarize(figures: dict[str, Any]) -> None:
    lines = ["", "decode (step / HBM floor; replay / floor):"]
    for r in figures.get("decode", []):
        eager = f" eager {r['eager_step_s'] * 1e3:.2f} ms" if "eager_step_s" in r else ""
        lines.append(f"  B={r['batch']:>3} ctx={r['context']:>5}: step {r['step_s'] * 1e3:7.2f} ms "
                     f"replay {r['replay_s'] * 1e3:7.2f} floor {r['hbm_floor_s'] * 1e3:6.2f} "
                     f"-> {r['step_over_floor']:.2f}x / {r['replay_over_floor']:.2f}x{eager}")
    lines.append("prefill (fraction of matmul rate):")
    for r in figures.get("prefill", []):
        lines.append(f"  T={r['tokens']:>5}: {r['step_s'] * 1e3:7.1f} ms {r['tokens_per_s']:8.0f} tok/s "
                     f"{r['tflops']:5.0f} TFLOP/s -> {r['fraction_of_matmul_rate']:.2f}")
    if "lora_overhead" in figures:
        lines.append(f"lora overhead: {json.dumps({k: {b: round(v, 3) for b, v in d.items()} for k, d in figures['lora_overhead'].items()})}")
    for r in figures.get("lora_prefill_ab", []):
        lines.append(f"  prefill T={r['tokens']:>5}, {len(r['ratio'])} A/B rounds: overhead {r['overhead']:+.3f}, "
                     f"round ratios median {r['ratio_median']:.3f} (min {r['ratio_min']:.3f}, max {r['ratio_max']:.3f})")
    logger.info("\n".join(lines))


if __name__ == "__main__":
    main()

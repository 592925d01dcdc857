"""One trace replayed open-loop through coserve and through Hugging Face ``transformers`` (the peer).

Same GPU, same run, same arrivals, same model shape (random weights). The peer serves the way a
``model.generate`` user does: whenever it is free it takes every request that has arrived (up to
``--peer-batch``), left-pads them into one batch and generates until the longest is done; a
request's first token is the batch's first decode step, its last token the step at which it
reached its output length. Reports output tokens/s and TTFT/TPOT percentiles for both.

    PYTHONPATH=src python bench/trace_vs_hf.py --trace .traces/azure2023_conv.csv --duration 300 \\
        --out bench/results/trace_vs_hf_h200.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from speed_common import LLAMA3_8B, TINY, add_trace_args, provenance, trace_scaling, write_model_dir
from torch.nn.attention import sdpa_kernel

from coserve.bench.metrics import RequestRecord, latency_summary, percentile
from coserve.bench.replay import InProcessDriver
from coserve.bench.workload import Arrival, load_workload
from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.layers.sdpa import BACKENDS

SHAPES = {"llama3-8b": LLAMA3_8B, "tiny": TINY}


def prompt_ids(i: int, n: int, vocab: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed * 1_000_003 + i)
    return [rng.randrange(10, vocab) for _ in range(n)]


def run_coserve(model_dir: Path, arrivals: list[Arrival], duration: float, device: str,
                drain_s: float = 120.0) -> dict[str, Any]:
    dtype = "bfloat16" if device == "cuda" else "float32"
    engine = LLMEngine(EngineConfig(model=str(model_dir), load_format="dummy", dtype=dtype, device=device,
                                    max_model_len=8192, max_num_batched_tokens=2048, max_loras=0,
                                    skip_tokenizer_init=True))
    driver = InProcessDriver(engine, seed=0)
    driver.run(arrivals[:8], duration_s=2.0, drain_s=30.0)  # warm-up
    result = driver.run(arrivals, duration_s=duration, drain_s=drain_s)
    out = _summary(result.records, result.duration_s)
    del engine, driver
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def run_hf(config: dict[str, Any], arrivals: list[Arrival], duration: float, device: str,
           peer_batch: int, drain_s: float = 120.0) -> dict[str, Any]:
    import transformers

    cfg = transformers.LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    cfg._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    vocab = config["vocab_size"]
    todo = [a for a in arrivals if a.time_s < duration]
    records: list[RequestRecord] = []

    class StepClock(transformers.StoppingCriteria):
        """Records when each decode step's tokens existed; stops the batch at the deadline (the
        window plus the drain), so that one long batch cannot run the replay past it."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            if input_ids.is_cuda:
                torch.cuda.synchronize()
            self.times.append(time.monotonic() - t0)
            stop = self.times[-1] >= duration + drain_s
            return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

    with torch.no_grad():  # warm-up
        model.generate(torch.randint(10, vocab, (1, 16), device=device), max_new_tokens=2, do_sample=False,
                       pad_token_id=0)
    t0 = time.monotonic()
    nxt = 0
    while nxt < len(todo) and time.monotonic() - t0 < duration + drain_s:
        now = time.monotonic() - t0
        if todo[nxt].time_s > now:
            time.sleep(min(0.005, todo[nxt].time_s - now))
            continue
        batch = []
        while nxt < len(todo) and todo[nxt].time_s <= now and len(batch) < peer_batch:
            batch.append((nxt, todo[nxt]))
            nxt += 1
        prompts = [prompt_ids(i, a.prompt_tokens, vocab) for i, a in batch]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        clock = StepClock()
        new = max(a.output_tokens for _, a in batch)
        # NOTE: the peer's attention keeps off cuDNN too: every batch has a new padded width, and
        # cuDNN would build a plan for each (coserve.layers.sdpa); the comparison stays fair.
        with torch.no_grad(), sdpa_kernel(BACKENDS):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0, stopping_criteria=[clock])
        for _, a in batch:  # clock.times[k] = when token k+1 of every row existed
            if len(clock.times) < a.output_tokens:  # cut off at the deadline: unfinished
                records.append(RequestRecord(a.time_s, clock.times[0], None, a.prompt_tokens, 0))
                continue
            first = clock.times[0]
            last = clock.times[a.output_tokens - 1]
            records.append(RequestRecord(a.time_s, first, last, a.prompt_tokens, a.output_tokens))
    for a in todo[nxt:]:
        records.append(RequestRecord(a.time_s, None, None, a.prompt_tokens, 0))
    elapsed = time.monotonic() - t0
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return _summary(records, elapsed)


def _summary(records: list[RequestRecord], elapsed: float) -> dict[str, Any]:
    done = [r for r in records if r.finish_s is not None]
    tokens = sum(r.output_tokens for r in done)
    end = max((r.finish_s for r in done if r.finish_s is not None), default=elapsed)
    # A request that never got its first token has no TTFT; counted with the time it waited until
    # the replay ended, the p99 below is a lower bound that a side which left requests unserved
    # cannot escape by leaving them out.
    waited = [r.ttft if r.ttft is not None else elapsed - r.arrival_s for r in records]
    return {"requests": len(records), "finished": len(done), "output_tokens": tokens,
            "output_tokens_per_s": tokens / end if end else 0.0, **latency_summary(records),
            "ttft_p99_with_unserved_ms": percentile(waited, 99) * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    add_trace_args(p, duration=300.0)
    p.add_argument("--peer-batch", type=int, default=64)
    p.add_argument("--drain", type=float, default=120.0,
                   help="seconds after the window for either side to finish; requests left are unfinished")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--only", choices=["both", "coserve", "transformers"], default="both",
                   help="run one side (two 5-minute replays do not fit one 10-minute device call: run "
                        "the sides at once on two GPUs of one machine, as bench/first_call.sh does, and "
                        "read the two files together)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    config = SHAPES[args.shape]
    scaling = trace_scaling(args)
    workload = load_workload(args.trace, args.duration, scaling)
    arrivals = list(workload.arrivals)
    model_dir = write_model_dir(Path(tempfile.mkdtemp(prefix="trace_vs_hf_")) / "model", config)
    figures: dict[str, Any] = {}
    if args.only in ("both", "coserve"):
        figures["coserve"] = run_coserve(model_dir, arrivals, args.duration, args.device, args.drain)
        print(json.dumps({"coserve": figures["coserve"]}), flush=True)
    if args.only in ("both", "transformers"):
        figures["transformers"] = run_hf(config, arrivals, args.duration, args.device, args.peer_batch,
                                         args.drain)
        print(json.dumps({"transformers": figures["transformers"]}), flush=True)
    if args.only == "both":
        ours, peer = figures["coserve"], figures["transformers"]
        figures["throughput_ratio"] = (ours["output_tokens_per_s"] / peer["output_tokens_per_s"]
                                       if peer["output_tokens_per_s"] else None)
        figures["ttft_p99_ratio"] = ours["ttft_p99_ms"] / peer["ttft_p99_ms"] if peer["ttft_p99_ms"] else None
    result = {**provenance(), "config": {"shape": args.shape, "trace": Path(args.trace).name,
                                          "window_start_s": workload.window_start_s, "duration_s": args.duration,
                                          "scaling": vars(scaling), "peer_batch": args.peer_batch,
                                          "drain_s": args.drain},
              "figures": figures}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(figures, indent=1, default=str))


if __name__ == "__main__":
    main()

"""The start-up warm-up: which batches it runs, what it leaves behind, which kernel variants it
compiles (every one a random step can ask for)."""

from __future__ import annotations

import argparse
import inspect
import math
import os
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from coserve import LLM, EngineConfig, LLMEngine, SamplingParams
from coserve.core.latency import BatchSpec, Chunk
from coserve.engine import warmup
from coserve.engine.calibration import run_synthetic_batch
from coserve.engine.warmup import WarmupLimits, warmup_plan
from coserve.layers import triton_attention, triton_fused, triton_lora
from coserve.layers.triton_attention import decode_splits
from coserve.layers.triton_lora import LoRALaunch, block_m_for, order_by_slot
from coserve.server.cli import add_engine_args, engine_kwargs

CUDA = torch.cuda.is_available()


def test_warmup_setting() -> None:
    with pytest.raises(ValueError, match="warmup"):
        EngineConfig(warmup="yes")
    assert not EngineConfig(device="cpu").runs_warmup  # nothing to compile on the CPU
    assert EngineConfig(device="cpu", warmup="on").runs_warmup
    assert not EngineConfig(warmup="off").runs_warmup
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args([]))["warmup"] == "auto"
    assert engine_kwargs(p.parse_args(["--warmup", "off"]))["warmup"] == "off"


SMALL = dict(model="tiny", max_loras=2, num_training_slots=1, max_lora_rank=8, max_num_batched_tokens=64,
             max_num_seqs=24, max_model_len=256, num_kv_blocks=96, device="cpu")


def test_warmup_runs_every_shape_class_and_leaves_no_state(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[tuple[BatchSpec, tuple[int, ...]]] = []

    def record(engine: LLMEngine, spec: BatchSpec, **kwargs: Any) -> float:
        ran.append((spec, tuple(kwargs["lora_slots"])))
        assert kwargs["ft_slot"] == engine.lora_manager.training_slot(0)
        return run_synthetic_batch(engine, spec, **kwargs)

    monkeypatch.setattr(warmup, "run_synthetic_batch", record)
    warm = LLM(warmup="on", **SMALL)  # type: ignore[arg-type]
    engine = warm.engine
    assert [s for s, _ in ran] == [b.spec for b in warmup_plan(WarmupLimits.of(engine))]

    prefill_only = {c.num_tokens for s, slots in ran if not s.decode_kv and not s.ft_lens and not slots
                    for c in s.chunks if c.context_len == 0}
    assert {1, 16, 17, 32, 64} <= prefill_only
    prefix = {c.context_len for s, _ in ran for c in s.chunks if c.context_len}
    assert min(prefix) <= 17 and max(prefix) >= 200  # short and long cached prefixes
    decode_only = {len(s.decode_kv) for s, slots in ran if not s.chunks and not s.ft_lens and not slots}
    assert decode_only == {1, 16, 17, 24}
    mixed = {len(s.decode_kv) for s, _ in ran if s.chunks and s.decode_kv and not s.ft_lens}
    assert {1, 16, 17, 23} <= mixed
    contexts = {kv for s, _ in ran for kv in s.decode_kv}
    assert min(contexts) <= 17 and max(contexts) == 255
    with_adapter = [s.num_tokens for s, slots in ran if slots]
    assert {1, 2, 4, 8, 16, 17, 32, 64} <= set(with_adapter)
    assert any(len(set(slots)) == engine.config.num_lora_slots for _, slots in ran)  # every slot at once
    assert any(s.ft_lens and not s.chunks for s, _ in ran) and any(s.ft_lens and s.chunks for s, _ in ran)

    # Nothing left behind: no request, every KV block free, no adapter slot held.
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.waiting and not engine.scheduler.running
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert sorted(engine.block_manager._free) == list(range(engine.block_manager.num_blocks))
    assert engine.last_step is None and engine.training_slot == -1

    cold = LLM(warmup="off", **SMALL)  # type: ignore[arg-type]
    prompts = [[5, 17, 33, 2, 91], list(range(40, 110)), [7] * 30]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)  # the global generator

    def tokens(llm: LLM) -> list[list[int]]:
        outs = llm.generate(prompts, greedy) + llm.generate(prompts[:1], sampled)
        return [o.outputs[0].token_ids for o in outs]

    assert tokens(warm) == tokens(cold)


# ---------------------------------------------------------------- kernel variants


def variant_key(fn: Callable[..., None], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What Triton compiles one variant per: the constexpr values and, for every other argument
    not marked ``do_not_specialize``, its specialization (integer == 1 / divisible by 16,
    pointer aligned to 16 bytes)."""
    exempt = set(fn.__dict__.get("do_not_specialize", ()))
    spec: list[tuple[Any, ...]] = []
    for name, value in zip(inspect.signature(fn).parameters, args, strict=False):
        if isinstance(value, torch.Tensor):
            spec.append((name, str(value.dtype), name in exempt or value.data_ptr() % 16 == 0))
        elif isinstance(value, int):
            width = "i32" if -(2**31) <= value < 2**31 else "i64"
            spec.append((name, width) if name in exempt else (name, width, value == 1, value % 16 == 0))
        else:
            spec.append((name, type(value).__name__))
    return (fn.__name__, tuple(spec), tuple(sorted(kwargs.items())))


class DryKernels:
    """Stands in for ``jit``: records each launch's variant key and launches nothing (the outputs
    are garbage, the shapes are not)."""

    def __init__(self) -> None:
        self.keys: set[tuple[Any, ...]] = set()

    def __call__(self, fn: Callable[..., None]) -> Any:
        keys = self.keys

        class Launcher:
            def __getitem__(self, grid: object) -> Callable[..., None]:
                return lambda *args, **kwargs: keys.add(variant_key(fn, args, kwargs))

        return Launcher()


def random_step(rng: random.Random, lim: WarmupLimits, inference_slots: int) -> tuple[BatchSpec, tuple[int, ...]]:
    """A step a scheduler and a co-server could build within ``lim``, with the adapter slots of
    its inference rows."""
    while True:
        decodes = rng.choice([0, 0, 1, rng.randint(1, lim.max_rows)])
        chunks = rng.choice([0, 1, 1, 2, 3])
        ft = rng.choice([0, 0, 1, 2]) if lim.ft_slot is not None else 0
        budget = lim.max_tokens - decodes
        if chunks + ft > budget or chunks + decodes > lim.max_rows or chunks + decodes + ft == 0:
            continue
        total = min(budget, max(chunks + ft, round(2 ** rng.uniform(0, math.log2(budget)))))
        cuts = sorted(rng.sample(range(1, total), chunks + ft - 1)) if chunks + ft > 1 else []
        lens = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)] if chunks + ft else []
        kv_room = max(1, lim.kv_blocks * lim.block_size // max(1, chunks + decodes) - lim.block_size)
        spec = BatchSpec(
            tuple(Chunk(n, rng.choice([0, 0, rng.randint(1, kv_room)])) for n in lens[:chunks]),
            tuple(rng.randint(1, min(lim.max_context - 1, kv_room)) for _ in range(decodes)),
            tuple(lens[chunks:]),
        )
        if not lim.fits(spec):
            continue
        rows = chunks + decodes
        mode = rng.choice(["none", "one", "mixed"])
        pick = {"none": lambda: -1, "one": lambda: 0,
                "mixed": lambda: rng.choice([-1, *range(inference_slots)])}[mode]
        return spec, tuple(pick() for _ in range(rows))


@pytest.mark.skipif(not triton_attention.HAS_TRITON, reason="triton is not installed")
def test_warmup_compiles_every_variant_random_steps_need(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the Triton backends (kernels recorded, not run): every kernel variant of a few
    hundred random steps, past the large-tile LoRA threshold, is one the warm-up made."""
    if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton cannot run on the CPU without TRITON_INTERPRET=1")
    dry = DryKernels()
    for module in (triton_attention, triton_lora, triton_fused):
        monkeypatch.setattr(module, "jit", dry)
    monkeypatch.setattr(triton_fused, "ON_CPU", True)
    llm = LLM(model="tiny", device="cuda" if CUDA else "cpu", enforce_eager=True, warmup="off",
              attention_backend="triton", lora_backend="triton", skip_tokenizer_init=True,
              max_loras=3, num_training_slots=1, max_lora_rank=8, max_num_batched_tokens=320,
              max_num_seqs=40, max_model_len=512, num_kv_blocks=160, block_size=8)
    engine = llm.engine
    engine.warm_up()
    warm = set(dry.keys)
    assert {k[0] for k in warm} >= {"_store_kv_kernel", "_prefill_kernel", "_decode_kernel", "_merge_kernel",
                                   "_shrink_kernel", "_expand_kernel", "_rms_norm_kernel", "_rotary_kernel",
                                   "_silu_and_mul_kernel"}
    lim = WarmupLimits.of(engine)
    rng = random.Random(0)
    for _ in range(150):
        spec, slots = random_step(rng, lim, engine.config.max_loras)
        run_synthetic_batch(engine, spec, lora_slots=slots, ft_slot=lim.ft_slot)
    assert dry.keys - warm == set()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


LIMITS = [
    WarmupLimits(2048, 256, 8192, 30000, 16, (0, 1, 2, 3, 4), 4),
    WarmupLimits(512, 64, 2048, 2000, 16, (0, 1), None),
    WarmupLimits(300, 32, 4096, 500, 32, (0,), 0),
]


@pytest.mark.parametrize("waves", [0, 2, 4])
@pytest.mark.parametrize("lim", LIMITS)
def test_plan_covers_launcher_choices_on_any_gpu(lim: WarmupLimits, waves: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """For GPUs of 4 to 132 multiprocessors and GQA groups of 1 to 8 KV heads: every LoRA launch
    (tile height, split-K) and decode launch (split or not) of random steps is one the plan makes
    — also with the LoRA split-K of large steps on (``COSERVE_LORA_SPLIT_WAVES``)."""
    from coserve.layers import triton_lora

    monkeypatch.setattr(triton_lora, "SPLIT_WAVES", waves)

    def launches(spec: BatchSpec, slots: tuple[int, ...], sms: int, kvh: int) -> set[tuple[Any, ...]]:
        inference = list(slots) + [-1] * (len(spec.chunks) + len(spec.decode_kv) - len(slots))
        lens = [c.num_tokens for c in spec.chunks] + list(spec.ft_lens) + [1] * len(spec.decode_kv)
        row_slots = (inference[: len(spec.chunks)] + [lim.ft_slot if lim.ft_slot is not None else -1] * len(spec.ft_lens)
                     + inference[len(spec.chunks):])
        out: set[tuple[Any, ...]] = set()
        if any(s >= 0 for s in row_slots):
            block_m = block_m_for(sum(lens))
            launch = LoRALaunch.for_order(len(order_by_slot(lens, row_slots, block_m)), block_m, sms)
            out.add(("lora", launch.block_m, launch.max_split_k))
        if spec.decode_kv:
            out.add(("decode", decode_splits(len(spec.decode_kv), kvh, max(spec.decode_kv), sms) > 1))
        if any(c.context_len for c in spec.chunks):
            out.add(("prefill-kernel",))
        return out

    plan = warmup_plan(lim)
    assert all(lim.fits(b.spec) for b in plan)
    rng = random.Random(1)
    steps = [random_step(rng, lim, max(1, len(lim.lora_slots) - (lim.ft_slot is not None))) for _ in range(600)]
    # The extremes a random draw rarely hits: one row per slot, each padding a whole tile.
    k = len(lim.lora_slots)
    for n in (min(lim.max_tokens, 256), lim.max_tokens):
        steps.append((BatchSpec((Chunk(n - k + 1),), (1,) * (k - 1)), lim.lora_slots))
    for sms in (4, 16, 108, 132):
        for kvh in (1, 2, 8):
            covered = set().union(*(launches(b.spec, b.lora_slots, sms, kvh) for b in plan))
            needed = set().union(*(launches(s, slots, sms, kvh) for s, slots in steps))
            assert needed <= covered, (sms, kvh, needed - covered)


def test_gemm_sweep_runs_every_token_count_of_each_weight_shape(
    hf_models: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from collections import Counter

    import torch.nn.functional as F

    from coserve.engine import warmup

    common: dict[str, Any] = dict(model=str(hf_models["llama"]), device="cpu", skip_tokenizer_init=True,
                                  num_kv_blocks=64, block_size=4, max_num_batched_tokens=24)
    engine = LLMEngine(EngineConfig(**common))
    seen: Counter[tuple[int, int, int]] = Counter()
    linear = F.linear

    def counting(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        seen[(x.shape[0], w.shape[0], w.shape[1])] += 1
        return linear(x, w, b)

    monkeypatch.setattr(F, "linear", counting)
    assert warmup.gemm_sweep(engine.model, 24, 5) == 4 * 24 + 5  # q/k/v, o, gate/up, down
    monkeypatch.setattr(F, "linear", linear)
    shapes = {tuple(m.weight.shape) for m in engine.model.modules() if hasattr(m, "lora_a_all")}
    assert len(shapes) == 4 and {(o, i) for _, o, i in seen} == shapes
    assert {n for n, _, _ in seen} == set(range(1, 25)) and set(seen.values()) == {1}

    swept: list[tuple[int, int]] = []
    monkeypatch.setattr(warmup, "gemm_sweep", lambda model, t, r: swept.append((t, r)) or 0)
    LLMEngine(EngineConfig(**common, warmup="on"))
    assert swept == []
    LLMEngine(EngineConfig(**common, warmup="on", warmup_gemms=True))
    assert swept == [(24, 24)]  # max_num_seqs (256) is capped by the step's tokens

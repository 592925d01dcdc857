"""Automatic prefix caching: the block manager's bookkeeping (table-driven, no model), and the
engine's outputs with the cache against the same engine without it (on the GPU where there is
one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coserve import LLM, LoRARequest, SamplingParams
from coserve.engine.block_manager import BlockManager, cache_key
from coserve.engine.sampling_params import SamplingParams as Params
from coserve.engine.sequence import Sequence
from tests.conftest import greedy_with_logprobs, make_peft_adapter

CUDA = torch.cuda.is_available()
BASE = cache_key()


def seq(tokens: list[int], key: bytes | None = BASE, rid: str = "r") -> Sequence:
    return Sequence(rid, list(tokens), Params(), cache_key=key)


def run(bm: BlockManager, s: Sequence) -> None:
    """Admit ``s`` as the scheduler does and compute all its tokens."""
    cached = bm.match(s)
    n = s.num_tokens - len(cached) * bm.block_size
    assert bm.can_admit(s, cached, n)
    bm.reuse(s, cached)
    bm.allocate(s, n)
    s.num_computed_tokens += n
    bm.register(s)


def check_invariant(bm: BlockManager, held: list[Sequence]) -> None:
    """Every block free, cached-free or held (refs = the tables holding it), never two of these."""
    refs = [0] * bm.num_blocks
    for s in held:
        for b in s.block_table:
            refs[b] += 1
    free, cached = list(bm._free), list(bm._cached)
    assert len(set(free)) == len(free) and not set(free) & set(cached)
    for b in range(bm.num_blocks):
        assert bm._refs[b] == refs[b], b
        assert (b in free or b in cached) == (refs[b] == 0), b
    assert set(cached) <= set(bm._digest_of)


def test_a_later_sequence_reuses_the_full_blocks_of_an_earlier_ones_prefix() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a = seq(list(range(10)))  # blocks [0-3] [4-7] full, [8-9] partial
    run(bm, a)
    assert bm.num_cached_blocks == 2
    b = seq([*range(9), 99, 98, 97], rid="b")  # the same first 9 tokens: 2 whole blocks
    assert bm.match(b) == a.block_table[:2]
    run(bm, b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert (bm.queried_tokens, bm.hit_tokens) == (10 + 12, 8)
    check_invariant(bm, [a, b])
    bm.free(a)  # the shared blocks stay with b; a's own partial block is plain free
    check_invariant(bm, [b])
    bm.free(b)  # now cached-free: counted free, kept for the next sequence
    check_invariant(bm, [])
    assert bm.num_free_blocks == 16 and len(bm._cached) == 3  # (b's third block, full, registered too)
    c = seq([*range(9), 99, 98, 97, 5], rid="c")
    assert len(bm.match(c)) == 3


@pytest.mark.parametrize(("tokens", "key", "hit_blocks"), [
    (list(range(8)), BASE, 1),             # block-aligned and all cached: the last block runs again to sample
    (list(range(4)), BASE, 0),             # one block: nothing before the token that samples
    (list(range(12)), BASE, 2),            # 2 cached + the last block
    (list(range(8)), cache_key("other", "/x"), 0),  # another adapter: its KV differs
    ([0, 1, 2, 3, 9, 9, 9, 9, 9], BASE, 1),  # a different second block: the chain stops
    (list(range(8)), None, 0),             # not cacheable (prompt logprobs, a training adapter)
])
def test_what_a_sequence_finds(tokens: list[int], key: bytes | None, hit_blocks: int) -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    first = seq(list(range(12)))
    run(bm, first)
    assert len(bm.match(seq(tokens, key))) == hit_blocks


def test_cached_free_blocks_are_taken_least_recently_used_first() -> None:
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    old, new = seq([1] * 5, rid="old"), seq([2] * 5, rid="new")
    for s in (old, new):
        run(bm, s)
        bm.free(s)  # each leaves one registered block and one plain free one
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    taker = seq([3] * 12, rid="t")  # 3 blocks: the 2 plain free ones, then the oldest cached
    run(bm, taker)
    assert bm.match(seq([1] * 5)) == [] and len(bm.match(seq([2] * 5))) == 1
    check_invariant(bm, [taker])
    assert bm.num_cached_blocks == 4  # (taker's 3 full blocks, new's)
    assert len(bm.take(1)) == 1  # (nothing plain free is left: the least recently used cached block)
    assert bm.num_cached_blocks == 3 and bm.match(seq([2] * 5)) == [], "a block lent out is forgotten"


def test_forget_and_reset_drop_prefixes_but_not_held_blocks() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    adapter = cache_key("mine", "/adapters/mine")
    base, tuned = seq(list(range(9))), seq(list(range(9)), adapter, rid="t")
    run(bm, base)
    run(bm, tuned)
    bm.free(base)
    assert bm.forget(adapter) == 2 and bm.match(seq(list(range(9)), adapter)) == []
    assert len(bm.match(seq(list(range(9))))) == 2, "the base model's prefix stays"
    check_invariant(bm, [tuned])
    assert bm.reset_prefix_cache() == 2 and bm.match(seq(list(range(9)))) == []
    check_invariant(bm, [tuned])
    bm.free(tuned)
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 0


def test_without_prefix_caching_nothing_is_found_or_registered() -> None:
    bm = BlockManager(16, 4)
    a = seq(list(range(9)))
    run(bm, a)
    assert bm.num_cached_blocks == 0 and bm.match(seq(list(range(9)))) == []
    assert (bm.queried_tokens, bm.hit_tokens) == (0, 0)


# ---------------------------------------------------------------------- through the engine

COMMON: dict = dict(skip_tokenizer_init=True, block_size=4, max_model_len=96, num_kv_blocks=48,
                    max_num_batched_tokens=32, max_loras=2, max_lora_rank=8, prefill_graphs=False)
SHARED = [7, 3, 19, 44, 5, 61, 2, 90, 13, 13, 8, 71, 30, 4, 55, 9, 17, 26]  # 18 tokens: 4 whole blocks


def llm(path: Path, caching: bool, graphs: bool = False) -> LLM:
    return LLM(str(path), device="cuda" if CUDA else "cpu", enable_prefix_caching=caching,
               **{**COMMON, "prefill_graphs": graphs})


@pytest.mark.parametrize("graphs", [False, True] if CUDA else [False])  # (the piecewise graphs: CUDA only)
def test_the_engine_answers_the_same_with_the_cache_and_prefills_less(hf_models: dict[str, Path],
                                                                      tmp_path: Path, graphs: bool) -> None:
    adapter = tmp_path / "adapter"
    make_peft_adapter(hf_models["llama"], adapter, ["q_proj", "v_proj"], seed=3)
    lora = LoRARequest("a", str(adapter))
    # turn 1, then turns that extend it (a chat's next turn), a different suffix, the adapter
    later = [SHARED + [11, 12, 13], SHARED + [11, 12, 13, 14, 15, 16, 17, 18, 19], SHARED[:9] + [1, 2, 3], SHARED]
    loras = [None, None, None, lora]
    results = {}
    for caching in (False, True):
        engine = llm(hf_models["llama"], caching, graphs)
        first = greedy_with_logprobs(engine, [SHARED], [None], 5)
        rest = greedy_with_logprobs(engine, later, loras, 5)  # (admitted together: they find turn 1's blocks)
        again = greedy_with_logprobs(engine, [later[1]], [None], 5)
        results[caching] = (first, rest, again, engine.engine.block_manager)
    off, on = results[False], results[True]
    tol = 2e-2 if CUDA else 1e-4
    for got, want in zip(on[:3], off[:3], strict=True):
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
            assert tokens == want_tokens
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), rtol=tol, atol=tol)
    bm = on[3]
    # turn 1's 4 whole blocks for the two extensions, 2 for the other suffix, none for the adapter;
    # then the longest prompt again: all its whole blocks but the last token's
    assert bm.hit_tokens == 16 + 16 + 8 + 0 + (27 - 1) // 4 * 4
    assert off[3].hit_tokens == 0 and off[3].num_cached_blocks == 0


def test_prompt_logprobs_and_a_removed_adapter_find_no_cached_prefix(hf_models: dict[str, Path],
                                                                    tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    make_peft_adapter(hf_models["llama"], adapter, ["q_proj", "v_proj"], seed=4)
    engine = llm(hf_models["llama"], True)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    engine.generate([SHARED], params)
    scored = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    (out,) = engine.generate([SHARED], scored)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(SHARED)
    bm = engine.engine.block_manager
    assert bm.hit_tokens == 0, "every prompt position must run for its logprob"
    lora = LoRARequest("a", str(adapter))
    engine.generate([SHARED], params, lora_request=lora)
    engine.generate([SHARED], params, lora_request=lora)
    assert bm.hit_tokens == 16, "the adapter's own prefix is found"
    hits = bm.hit_tokens
    engine.engine.remove_lora("a")
    engine.generate([SHARED], params, lora_request=lora)  # (loaded again: its prefixes were forgotten)
    assert bm.hit_tokens == hits


def test_token_slice_across_the_prompt_and_the_outputs() -> None:
    """(What the digests of blocks that span both read: without joining the two lists.)"""
    s = seq(list(range(10)))
    s.output_token_ids = list(range(100, 107))
    every = s.prompt_token_ids + s.output_token_ids
    assert all(s.token_slice(a, b) == every[a:b] for a in range(len(every) + 1) for b in range(a, len(every) + 1))

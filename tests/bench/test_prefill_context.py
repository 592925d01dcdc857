"""bench/prefill_context.py: both ways run the same step, the split one's output agrees."""

from __future__ import annotations

import random

import pytest
import torch

from tests.bench.scripts import load_script
from tests.conftest import triton_unavailable

prefill_context = load_script("prefill_context")


@pytest.mark.skipif(triton_unavailable() is not None, reason=str(triton_unavailable()))
def test_a_case_times_both_ways_and_the_split_output_agrees() -> None:
    cache = torch.randn(200, 2, 4, 2, 16)
    row = prefill_context.case(5, 60, 2, heads=(4, 2, 16), block=4, nblocks=200, cache=cache,
                               device=torch.device("cpu"), calls=1, rng=random.Random(0), min_keys=8,
                               min_splits=2)
    assert row["splits"] > 1
    assert row["rel_err"] < 1e-5
    assert row["plain_us"] > 0 and row["split_us"] > 0


@pytest.mark.skipif(triton_unavailable() is not None, reason=str(triton_unavailable()))
@pytest.mark.parametrize("fresh", [30, 600])  # a paged-only step; one whose fresh chunk takes SDPA/flash
def test_a_case_beside_a_fresh_chunk_times_both_split_rules(fresh: int) -> None:
    cache = torch.randn(400, 2, 4, 2, 16)
    row = prefill_context.case(5, 60, 2, heads=(4, 2, 16), block=4, nblocks=400, cache=cache,
                               device=torch.device("cpu"), calls=1, rng=random.Random(0), min_keys=8,
                               min_splits=2, fresh=fresh)
    assert row["paged_only"] == (fresh + 5 <= 512)
    assert row["splits"] > 1 and row["rel_err"] < 1e-5 and row["split_all_rel_err"] < 1e-5
    assert row["split_all_us"] > 0
    if not row["paged_only"]:
        assert row["split_all_splits"] == 1  # (the rule before: no split beside a flash row)

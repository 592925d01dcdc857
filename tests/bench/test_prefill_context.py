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

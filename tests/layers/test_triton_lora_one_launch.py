"""The one-launch multi-LoRA kernel (shrink and expand in one program) against the two launches
and a plain torch reference, and its dispatch (``COSERVE_LORA_ONE_LAUNCH``, 16-row tiles only).

Runs compiled on a GPU, in Triton's interpreter without one (see ``test_triton_kernels.py``: the
interpreter's bf16 matrix product is wrong, so fp16 stands in for bf16 there).
"""

from __future__ import annotations

import os
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from tests.conftest import KERNEL_DTYPES, KERNEL_TOL, rel_err, triton_unavailable

CUDA = torch.cuda.is_available()
_SKIP = triton_unavailable()
if _SKIP is not None:
    pytest.skip(_SKIP, allow_module_level=True)

from coserve.layers import triton_lora  # noqa: E402
from coserve.layers.triton_lora import (  # noqa: E402
    LoRALaunch,
    graph_order_length,
    lora_shrink_expand,
    lora_shrink_expand_fused,
    lora_shrink_expand_one_launch,
    order_by_slot,
)

DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = KERNEL_DTYPES
TOL = KERNEL_TOL
SLOTS, D_IN = 4, 96  # 96: two BLOCK_K chunks, the second one masked


class Case:
    """A step of decode rows and two short chunks over mixed slots (-1 included), with fused
    stacks of ``out_sizes`` slices and an output that is a column slice of a wider tensor."""

    def __init__(self, out_sizes: Sequence[int], rank: int, dtype: torch.dtype, seed: int) -> None:
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        self.row_lens = [3, 2] + [1] * 10
        # Slot 2 stays unused, so that a graph's static order has a whole tile of padding.
        self.row_slots = [0, -1, 1, -1, 3] + [rng.choice([-1, 0, 1, 3]) for _ in range(7)]
        t = sum(self.row_lens)
        self.out_sizes, self.rank = list(out_sizes), rank
        d_out = sum(out_sizes)
        self.token_slots = torch.tensor(
            [s for n, s in zip(self.row_lens, self.row_slots, strict=True) for _ in range(n)], device=DEVICE
        )
        self.x = torch.randn(t, D_IN, generator=gen).to(DEVICE, dtype)
        self.a_all = (torch.randn(SLOTS, len(out_sizes) * rank, D_IN, generator=gen) / D_IN**0.5).to(DEVICE, dtype)
        self.b_all = torch.randn(SLOTS, d_out, rank, generator=gen).to(DEVICE, dtype)
        self.scales = (torch.rand(SLOTS, generator=gen) + 0.5).to(DEVICE)
        self.y0 = torch.randn(t, d_out + 8, generator=gen).to(DEVICE, dtype)

    def order(self, block_m: int, graph_padded: bool) -> tuple[torch.Tensor, LoRALaunch]:
        """``order_by_slot``'s order, or one -1 padded to a CUDA graph's static length."""
        order = order_by_slot(self.row_lens, self.row_slots, block_m)
        length = len(order)
        if graph_padded:
            length = graph_order_length(sum(self.row_lens), SLOTS)
            assert length > len(order) and block_m == 16
        order_t = torch.full((length,), -1, dtype=torch.int32)
        order_t[: len(order)] = torch.tensor(order, dtype=torch.int32)
        return order_t.to(DEVICE), LoRALaunch.for_order(length, block_m, sms=64)

    def run(self, fn: Any, order: torch.Tensor, launch: LoRALaunch) -> torch.Tensor:
        y = self.y0.clone()
        fn(y[:, 4 : 4 + sum(self.out_sizes)], self.x, self.a_all, self.b_all, self.out_sizes, self.scales,
           self.token_slots, order, launch)
        return y

    def reference(self) -> torch.Tensor:
        """fp32, token by token."""
        y = self.y0.to(torch.float32, copy=True)
        x, a_all, b_all = self.x.float(), self.a_all.float(), self.b_all.float()
        r = self.rank
        for t, s in enumerate(self.token_slots.tolist()):
            if s < 0:
                continue
            off = 4
            for i, n in enumerate(self.out_sizes):
                v = x[t] @ a_all[s, i * r : (i + 1) * r].T
                y[t, off : off + n] += v @ b_all[s, off - 4 : off - 4 + n].T * self.scales[s]
                off += n
        return y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [8, 16])
@pytest.mark.parametrize("out_sizes", [[80], [112, 48], [64, 16, 16]], ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("graph_padded", [False, True])
def test_one_launch_equals_two_launches_and_reference(
    dtype: torch.dtype, rank: int, out_sizes: list[int], graph_padded: bool, launches: Counter[str]
) -> None:
    case = Case(out_sizes, rank, dtype, seed=rank + len(out_sizes) + 10 * graph_padded)
    order, launch = case.order(16, graph_padded)
    one = case.run(lora_shrink_expand_one_launch, order, launch)
    assert launches == {"_shrink_expand_kernel": 1}
    two = case.run(lora_shrink_expand_fused, order, launch)  # ONE_LAUNCH is off by default
    ref = case.reference()

    y0 = case.y0.float()
    assert rel_err(one.float() - y0, ref - y0) < TOL[dtype]
    assert rel_err(two.float() - y0, ref - y0) < TOL[dtype]
    assert rel_err(one.float() - y0, two.float() - y0) < TOL[dtype]
    # Columns outside the output view and tokens without an adapter are untouched.
    cols = slice(4, 4 + sum(out_sizes))
    assert torch.equal(one[:, : cols.start], case.y0[:, : cols.start])
    assert torch.equal(one[:, cols.stop :], case.y0[:, cols.stop :])
    untouched = case.token_slots < 0
    assert untouched.any() and torch.equal(one[untouched], case.y0[untouched])


def test_switch_is_off_unless_set() -> None:
    assert triton_lora.ONE_LAUNCH == (os.environ.get("COSERVE_LORA_ONE_LAUNCH") == "1")


@pytest.mark.parametrize("switch", [False, True])
def test_dispatch_small_steps_only(switch: bool, launches: Counter[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """With the switch on, 16-row tiles take the one launch and 64-row tiles the two; with it
    off, two launches always. The results agree either way."""
    monkeypatch.setattr(triton_lora, "ONE_LAUNCH", switch)
    case = Case([64, 16, 16], 16, torch.float32, seed=3)
    ref = case.reference()
    for block_m in (16, 64):
        order, launch = case.order(block_m, graph_padded=False)
        assert launch.block_m == block_m
        launches.clear()
        got = case.run(lora_shrink_expand_fused, order, launch)
        one = switch and block_m == 16
        assert launches == ({"_shrink_expand_kernel": 1} if one else {"_shrink_kernel": 1, "_expand_kernel": 1})
        assert rel_err(got - case.y0, ref - case.y0) < TOL[torch.float32]
    # lora_shrink_expand (one slice) goes through the same dispatch.
    single = Case([80], 8, torch.float32, seed=4)
    order, launch = single.order(16, graph_padded=False)
    launches.clear()
    y = single.y0.clone()
    lora_shrink_expand(y[:, 4:84], single.x, single.a_all, single.b_all, single.scales, single.token_slots,
                       order, launch)
    assert launches == ({"_shrink_expand_kernel": 1} if switch else {"_shrink_kernel": 1, "_expand_kernel": 1})
    assert rel_err(y - single.y0, single.reference() - single.y0) < TOL[torch.float32]

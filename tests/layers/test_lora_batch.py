"""LoRABatch: a flat batch's adapter routing, built on the host."""

from __future__ import annotations

import torch

from coserve.layers.lora import LoRABatch


def test_rows_of_one_slot_share_a_segment_and_every_token_gets_its_rows_slot() -> None:
    lens, slots = [3, 2, 1, 4, 1, 1], [-1, 0, 0, 2, -1, -1]
    batch = LoRABatch.from_rows(lens, slots)
    assert batch.seg_starts == [0, 3, 6, 10, 12] and batch.seg_slots == [-1, 0, 2, -1]
    assert batch.seg_lens == [3, 3, 4, 2] and batch.active
    expected = [s for n, s in zip(lens, slots, strict=True) for _ in range(n)]
    assert batch.token_slots.dtype == torch.int64 and batch.token_slots.tolist() == expected


def test_no_rows_and_no_adapter() -> None:
    empty = LoRABatch.from_rows([], [])
    assert empty.seg_starts == [0] and empty.token_slots.shape == (0,) and not empty.active
    plain = LoRABatch.from_rows([5, 2], [-1, -1])
    assert plain.seg_slots == [-1] and plain.token_slots.tolist() == [-1] * 7 and not plain.active

"""bench/decode_longest.py's KV layouts: the same rows and about the same total, longest row apart."""

from __future__ import annotations

import pytest

from tests.bench.scripts import load_script

decode_longest = load_script("decode_longest")


@pytest.mark.parametrize("rows", [2, 8, 24, 64])
def test_layouts_share_rows_and_total_and_differ_in_the_longest_row(rows: int) -> None:
    mean = 1024
    uniform, spread, one_long = (decode_longest.layout(name, rows, mean, 4.0, 100_000)
                                 for name in decode_longest.LAYOUTS)
    assert len(uniform) == len(spread) == len(one_long) == rows
    assert uniform == [mean] * rows
    for lens in (spread, one_long):
        assert sum(lens) == pytest.approx(rows * mean, rel=0.01)
    assert max(spread) == round(1.75 * mean) and min(spread) == mean // 4
    assert max(one_long) == min(4 * mean, rows * mean - rows + 1)  # (two rows: the rest keep one token)
    assert decode_longest.layout("one_long", 1, mean, 4.0, 100_000) == [mean]  # one row: one length


def test_layouts_keep_every_row_within_the_cap() -> None:
    assert max(decode_longest.layout("one_long", 8, 1024, 4.0, 3000)) == 3000
    assert max(decode_longest.layout("spread", 8, 1024, 4.0, 1500)) == 1500

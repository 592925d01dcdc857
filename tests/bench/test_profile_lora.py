"""bench/profile_lora.py's idle-gap summary: where the GPU waited between activities."""

from __future__ import annotations

import pytest

from tests.bench.scripts import load_script

profile_lora = load_script("profile_lora")


def test_idle_time_is_the_span_less_the_union_of_activities() -> None:
    # a 0-10, b 12-20 with c 15-18 inside it (another stream), d 25-30: idle 2 µs before b, 5 before d
    spans = [(25.0, 30.0, "d"), (0.0, 10.0, "a"), (12.0, 20.0, "b"), (15.0, 18.0, "c")]
    got = profile_lora.idle_gaps(spans, iters=1, top=5)
    assert got["span_ms_per_step"] == pytest.approx(0.030)
    assert got["idle_ms_per_step"] == pytest.approx(0.007)
    first = got["top_idle"][0]
    assert (first["before"], first["after"], first["gaps"]) == ("b", "d", 1)
    assert first["idle_ms_per_step"] == pytest.approx(0.005)
    assert profile_lora.idle_gaps(spans, iters=2, top=5)["idle_ms_per_step"] == pytest.approx(0.0035)


def test_host_ops_overlapping_the_longest_gaps() -> None:
    # GPU gaps: 10-12 (2 µs) and 20-25 (5 µs); host ops overlap them by parts
    gpu = [(25.0, 30.0, "d"), (0.0, 10.0, "a"), (12.0, 20.0, "b"), (15.0, 18.0, "c")]
    host = [(19.0, 24.0, "prepare"), (21.0, 23.0, "copy"), (8.0, 11.0, "launch"), (26.0, 27.0, "later")]
    got = profile_lora.host_in_gaps(gpu, host, top=5)
    assert [g["gap_ms"] for g in got] == pytest.approx([0.005, 0.002])
    assert (got[0]["before"], got[0]["after"]) == ("b", "d")
    assert [(h["op"], h["ms"]) for h in got[0]["host_ms"]] == [("prepare", pytest.approx(0.004)),
                                                               ("copy", pytest.approx(0.002))]
    assert [(h["op"], h["ms"]) for h in got[1]["host_ms"]] == [("launch", pytest.approx(0.001))]
    assert profile_lora.host_in_gaps(gpu, host, top=1) == got[:1]

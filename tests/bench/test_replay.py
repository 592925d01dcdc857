"""The in-process open-loop replay (coserve.bench.replay.InProcessDriver)."""

from __future__ import annotations

import time

from coserve import EngineConfig, LLMEngine
from coserve.bench.replay import InProcessDriver, Snapshot
from coserve.bench.workload import Arrival


def test_a_stall_past_the_window_does_not_drop_the_arrivals_still_due() -> None:
    """A loop turn that runs past the window's end (here the first tick stalls 0.6 s, as a
    profiler's first start did) still adds every arrival that came due meanwhile, at its true
    arrival time: they are served, and their TTFT counts the wait."""
    engine = LLMEngine(EngineConfig(model="tiny", device="cpu"))
    arrivals = [Arrival(0.05 * i, 4, 3) for i in range(6)]
    stalled = []

    def tick(s: Snapshot) -> None:
        if not stalled:
            stalled.append(s.t)
            time.sleep(0.6)

    result = InProcessDriver(engine).run(arrivals, duration_s=0.5, tick=tick, tick_every_s=0.01)
    assert [r.arrival_s for r in result.records] == sorted(a.time_s for a in arrivals if a.time_s < 0.5)
    assert all(r.finish_s is not None and r.output_tokens == 3 for r in result.records)
    assert max(r.ttft or 0.0 for r in result.records) > 0.3  # they waited out the stall

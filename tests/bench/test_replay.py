"""The in-process open-loop replay (coserve.bench.replay.InProcessDriver)."""

from __future__ import annotations

import time

from coserve import EngineConfig, LLMEngine
from coserve.bench.metrics import SLO
from coserve.bench.replay import InProcessDriver, Snapshot, certain_miss
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


def test_certain_miss() -> None:
    """A running request has missed for certain once its first token is (or would be) late, or
    once even an instant finish would leave its mean time per output token over the limit."""
    slo = SLO(1.0, 0.1)
    assert not certain_miss(0.9, 0.0, None, 10, slo) and certain_miss(1.1, 0.0, None, 10, slo)
    assert certain_miss(1.2, 0.0, 1.05, 10, slo)  # the first token came after 1.05 s
    assert not certain_miss(1.5, 0.0, 0.5, 11, slo)  # 1.0 s for 10 tokens still to come: 0.1 s each
    assert certain_miss(1.6, 0.0, 0.5, 11, slo)
    assert not certain_miss(9.0, 0.0, 0.5, 1, slo)  # one token: no TPOT to miss


class _FT:
    """A trainer stand-in whose token count grows with the replay clock."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self) -> int:
        return int((time.monotonic() - self.t0) * 1000)


def test_the_drain_lets_requests_that_can_still_meet_the_slo_finish_and_counts_ft_over_the_window() -> None:
    """With ``slo`` the drain runs as long as a request still running can meet it (the long
    request finishes, 2 s past the window), and ends as soon as none can (a TPOT limit no step
    can meet: it stops at once, far before ``drain_s``). FT tokens/s count the window alone."""
    engine = LLMEngine(EngineConfig(model="tiny", device="cpu"))
    driver = InProcessDriver(engine)
    arrivals = [Arrival(0.0, 4, 3), Arrival(0.05, 4, 400)]
    ft = _FT()
    met = driver.run(arrivals, duration_s=0.2, drain_s=120.0, slo=SLO(5.0, 1.0), ft_tokens=ft)
    assert all(r.finish_s is not None for r in met.records)
    assert met.records[1].output_tokens == 400 and met.duration_s > 0.2
    assert met.window_s == 0.2
    assert met.ft_tokens_window <= met.ft_tokens and met.ft_tokens_window < (0.2 + 0.5) * 1000
    began = time.monotonic()
    missed = driver.run(arrivals, duration_s=0.2, drain_s=120.0, slo=SLO(5.0, 1e-6))
    assert time.monotonic() - began < 10.0
    assert missed.records[1].finish_s is None  # cut off: it had missed already
    assert not engine.has_unfinished_requests()

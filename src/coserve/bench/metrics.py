"""Per-request latency records and SLO attainment."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class RequestRecord:
    """What happened to one request (times in seconds on the replay clock)."""

    arrival_s: float
    first_token_s: float | None
    finish_s: float | None
    prompt_tokens: int
    output_tokens: int

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (0 for one-token outputs)."""
        if self.finish_s is None or self.first_token_s is None:
            return None
        if self.output_tokens <= 1:
            return 0.0
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def attained(r: RequestRecord, ttft_slo: float, tpot_slo: float) -> bool:
    """A request meets its SLO when it finished with TTFT and TPOT within the limits."""
    return r.ttft is not None and r.tpot is not None and r.ttft <= ttft_slo and r.tpot <= tpot_slo


def attainment(records: Sequence[RequestRecord], ttft_slo: float, tpot_slo: float) -> float:
    """Fraction of requests that met both SLOs (unfinished requests count as misses)."""
    if not records:
        return math.nan
    return sum(attained(r, ttft_slo, tpot_slo) for r in records) / len(records)


def latency_summary(records: Sequence[RequestRecord]) -> dict[str, float]:
    ttft = [r.ttft for r in records if r.ttft is not None]
    tpot = [r.tpot for r in records if r.tpot is not None]
    out: dict[str, float] = {"requests": float(len(records)), "finished": float(len(tpot))}
    for name, xs in (("ttft", ttft), ("tpot", tpot)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}_ms"] = percentile(xs, q) * 1e3
        out[f"{name}_mean_ms"] = (sum(xs) / len(xs) * 1e3) if xs else math.nan
    return out


class SLO(NamedTuple):
    """A pair of per-request limits in seconds: ``ttft_s`` on TTFT, ``tpot_s`` on TPOT."""

    ttft_s: float
    tpot_s: float


def relative_slo(reference: Sequence[RequestRecord], factor: float = 3.0) -> SLO:
    """``factor ×`` the reference run's mean TTFT and mean TPOT (the relative SLO of the
    memory-sharing paper): the TTFT mean is over requests that got a first token, the TPOT mean
    over finished requests with at least two output tokens (a one-token answer has no TPOT).
    Raises ``ValueError`` when the reference has no such request."""
    ttft = [r.ttft for r in reference if r.ttft is not None]
    tpot = [r.tpot for r in reference if r.tpot is not None and r.output_tokens > 1]
    if not ttft or not tpot:
        raise ValueError("the reference run finished no request with two or more output tokens: "
                         "no relative SLO (lengthen --duration or lower the load)")
    return SLO(factor * sum(ttft) / len(ttft), factor * sum(tpot) / len(tpot))


def rolling_attainment(records: Sequence[RequestRecord], slo: SLO, times: Sequence[float],
                       window_s: float) -> list[float | None]:
    """For each ``t`` of ``times``: the attainment of the requests that arrived in
    ``(t − window_s, t]`` (``None`` when none arrived)."""
    out: list[float | None] = []
    for t in times:
        inside = [r for r in records if t - window_s < r.arrival_s <= t]
        out.append(attainment(inside, slo.ttft_s, slo.tpot_s) if inside else None)
    return out


class Rates(NamedTuple):
    """Per-interval rates from a cumulative timeline: ``t[i]`` the end of interval ``i``."""

    t: list[float]
    inference_tokens_per_s: list[float]
    ft_tokens_per_s: list[float]


def timeline_rates(timeline: Sequence[tuple[float, int, int]]) -> Rates:
    """``(t, cumulative inference tokens, cumulative FT tokens)`` ticks (from 0 at ``t = 0``)
    -> tokens per second over each interval between ticks."""
    ts: list[float] = []
    inf: list[float] = []
    ft: list[float] = []
    prev = (0.0, 0, 0)
    for tick in timeline:
        dt = tick[0] - prev[0]
        if dt > 0:
            ts.append(tick[0])
            inf.append((tick[1] - prev[1]) / dt)
            ft.append((tick[2] - prev[2]) / dt)
        prev = tick
    return Rates(ts, inf, ft)

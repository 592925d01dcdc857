"""Open-loop replay of a workload against an engine running in this thread.

Requests enter at their workload times on a monotonic clock; a step that runs long does not
shift later arrivals (they are added late but keep their true arrival time, so TTFT counts the
wait). The driver is the only part that knows the engine is in-process: an HTTP driver can
replace it and produce the same :class:`RequestRecord` list.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from coserve.bench.metrics import SLO, RequestRecord
from coserve.bench.workload import Arrival
from coserve.engine.llm_engine import LLMEngine
from coserve.engine.sampling_params import SamplingParams


@dataclass
class Snapshot:
    """Progress of a replay, handed to the tick callback."""

    t: float
    arrived: int
    finished: list[RequestRecord]
    inference_tokens: int
    ft_tokens: int


@dataclass
class ReplayResult:
    records: list[RequestRecord]
    duration_s: float
    inference_tokens: int
    ft_tokens: int
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t, inference tok, FT tok) once a second
    # (kind of the step that was running when the request arrived, seconds it waited to enter the engine)
    entry_delays: list[tuple[str, float]] = field(default_factory=list)
    # seconds spent in engine steps of each kind (idle, inference, mixed, ft-only, ...) and in
    # idle waits: where the replay's wall time went
    step_seconds: dict[str, float] = field(default_factory=dict)
    step_counts: dict[str, int] = field(default_factory=dict)
    # every step that ran work, as STEP_COLUMNS, so that runs can be compared step for step
    # (same batch, same time?) whatever their configuration, and a slow step split into its parts
    # (coserve.engine.llm_engine.StepStats; None where unknown)
    steps: list[tuple[Any, ...]] = field(default_factory=list)
    # FT tokens trained by the window's end (the drain after it not counted), and the window
    ft_tokens_window: int = 0
    window_s: float = 0.0


def certain_miss(now: float, arrival_s: float, first_token_s: float | None, output_tokens: int, slo: SLO) -> bool:
    """Whether a request still running at ``now`` has missed ``slo`` whatever happens next: its
    first token came (or, still to come, would come) too late, or even if every token still to
    come arrived at once its mean time per output token would be over the limit."""
    if first_token_s is None:
        return now - arrival_s > slo.ttft_s
    if first_token_s - arrival_s > slo.ttft_s:
        return True
    return output_tokens > 1 and (now - first_token_s) / (output_tokens - 1) > slo.tpot_s


STEP_COLUMNS = ("t_s", "kind", "mode", "prefill_tokens", "decode_tokens", "seconds", "schedule_s",
                "forward_enqueue_s", "forward_gpu_s", "prefill_context_tokens", "ft_tokens", "forward_cpu_s")


class InProcessDriver:
    """Feeds ``arrivals`` to ``engine`` at their times and steps it."""

    def __init__(self, engine: LLMEngine, seed: int = 0, low_token: int = 10) -> None:
        self.engine = engine
        engine.time_forward_on_gpu = True  # each recorded step splits its time (STEP_COLUMNS)
        self.seed = seed
        self.low_token = low_token

    def prompt(self, i: int, n: int) -> list[int]:
        rng = random.Random(self.seed * 1_000_003 + i)
        vocab = self.engine.model_config.vocab_size
        return [rng.randrange(self.low_token, vocab) for _ in range(n)]

    def run(
        self,
        arrivals: Sequence[Arrival],
        *,
        duration_s: float,
        ft_tokens: Callable[[], int] | None = None,
        idle_wait: Callable[[float], None] | None = None,
        tick: Callable[[Snapshot], None] | None = None,
        tick_every_s: float = 1.0,
        drain_s: float = 30.0,
        slo: SLO | None = None,
    ) -> ReplayResult:
        """Replay arrivals in ``[0, duration_s)``; then let admitted requests finish (at most
        ``drain_s``; with ``slo``, only while one of those still running can meet it: see
        :func:`certain_miss`). ``ft_tokens()`` reports fine-tuning tokens trained so far;
        ``idle_wait(s)`` is called instead of sleeping when the engine has nothing to do."""
        engine = self.engine
        todo = [a for a in arrivals if a.time_s < duration_s]
        t0 = time.monotonic()
        clock = lambda: time.monotonic() - t0  # noqa: E731
        nxt = 0
        engine.external_arrivals = lambda: nxt < len(todo) and clock() >= todo[nxt].time_s
        starts: dict[str, tuple[float, Arrival]] = {}
        first: dict[str, float] = {}
        done: list[RequestRecord] = []
        finished: set[str] = set()
        inf_tokens = 0
        ft0 = ft_tokens() if ft_tokens else 0
        timeline: list[tuple[float, int, int]] = []
        entry_delays: list[tuple[str, float]] = []
        step_seconds: dict[str, float] = {}
        step_counts: dict[str, int] = {}
        steps: list[tuple[Any, ...]] = []
        next_tick = tick_every_s
        next_sample = 1.0  # the timeline: once a second, whatever the tick
        ft_window: int | None = None
        next_decide = duration_s
        try:
            while True:
                now = clock()
                if ft_window is None and now >= duration_s:
                    ft_window = (ft_tokens() - ft0) if ft_tokens else 0
                # NOTE: not done while an arrival is due but not added: a loop turn that ran past the
                # window's end (a stall) would otherwise drop every request still to come
                if now >= duration_s + drain_s or (now >= duration_s and nxt >= len(todo)
                                                   and not engine.has_unfinished_requests()):
                    break
                if slo is not None and nxt >= len(todo) and now >= next_decide:
                    next_decide = now + 0.1  # (the drain's end decided ten times a second)
                    if all(certain_miss(now, arr, first.get(rid), a.output_tokens, slo)
                           for rid, (arr, a) in starts.items() if rid not in finished):
                        break
                while nxt < len(todo) and todo[nxt].time_s <= now:
                    a = todo[nxt]
                    rid = f"req{nxt}"
                    engine.add_request(rid, self.prompt(nxt, a.prompt_tokens),
                                       SamplingParams(max_tokens=a.output_tokens, temperature=0.0, ignore_eos=True),
                                       arrival_time=t0 + a.time_s)
                    starts[rid] = (a.time_s, a)
                    entry_delays.append((engine.last_step_kind, now - a.time_s))
                    nxt += 1
                began = time.perf_counter()
                outs = engine.step()
                kind = engine.last_step_kind
                spent = time.perf_counter() - began
                step_seconds[kind] = step_seconds.get(kind, 0.0) + spent
                step_counts[kind] = step_counts.get(kind, 0) + 1
                stats = engine.last_step
                if kind in ("inference", "mixed", "ft-only", "ft-only-interrupted") and stats is not None:
                    steps.append((now, kind, stats.mode, stats.num_prefill_tokens,
                                  stats.num_decode_tokens, spent, stats.schedule_s,
                                  stats.forward_enqueue_s, stats.forward_gpu_s,
                                  stats.prefill_context_tokens, stats.ft_tokens, stats.forward_cpu_s))
                for out in outs:
                    rid = out.request_id
                    inf_tokens += 1
                    if rid not in first and out.metrics.first_token_time is not None:
                        first[rid] = out.metrics.first_token_time - t0
                    if out.finished:
                        finished.add(rid)
                        arr, a = starts[rid]
                        fin = (out.metrics.finish_time or time.monotonic()) - t0
                        done.append(RequestRecord(arr, first.get(rid), fin, a.prompt_tokens,
                                                  len(out.outputs[0].token_ids)))
                if not outs and not engine.has_unfinished_requests():
                    gap = (todo[nxt].time_s - clock()) if nxt < len(todo) else duration_s - clock()
                    if gap > 0:
                        began = time.perf_counter()
                        if idle_wait is not None:
                            idle_wait(min(gap, 0.005))
                        else:
                            time.sleep(min(gap, 0.005))
                        step_seconds["wait"] = step_seconds.get("wait", 0.0) + time.perf_counter() - began
                now = clock()
                if now >= next_sample or now >= next_tick:
                    ft = (ft_tokens() - ft0) if ft_tokens else 0
                    if now >= next_sample:
                        timeline.append((now, inf_tokens, ft))
                        next_sample += 1.0
                    if now >= next_tick:
                        if tick is not None:
                            tick(Snapshot(now, nxt, done, inf_tokens, ft))
                        next_tick += tick_every_s
        finally:
            engine.external_arrivals = None
            # NOTE: also when a step raised: the engine must not keep this replay's requests.
            for rid in starts:
                if rid not in finished:
                    engine.abort_request(rid)
        # Requests admitted but unfinished at the end count as misses.
        records = list(done)
        for rid, (arr, a) in starts.items():
            if rid not in finished:
                records.append(RequestRecord(arr, first.get(rid), None, a.prompt_tokens, 0))
        ft_total = (ft_tokens() - ft0) if ft_tokens else 0
        return ReplayResult(sorted(records, key=lambda r: r.arrival_s), clock(), inf_tokens,
                            ft_total, timeline, entry_delays, step_seconds, step_counts, steps,
                            ft_total if ft_window is None else ft_window, duration_s)

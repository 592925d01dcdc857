"""Inference workloads: real arrival traces (CSV) and synthetic bursty patterns, scaled explicitly."""

from __future__ import annotations

import csv
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class Arrival:
    """One request of a workload: when it arrives (s from the start) and its lengths."""

    time_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Scaling:
    """How a workload was adapted to the machine: reported with every result.

    ``rate``: arrival times are divided by it (2.0 = twice as many requests per second);
    ``length``: prompt and output lengths are multiplied by it; lengths are then clipped to
    ``[1, max_prompt]`` / ``[1, max_output]``.
    """

    rate: float = 1.0
    length: float = 1.0
    max_prompt: int = 4096
    max_output: int = 512

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.length <= 0:
            raise ValueError(f"rate and length scales must be positive, got {self.rate}, {self.length}")

    def fit(self, context: int, say: Callable[[str], None]) -> Scaling:
        """This scaling with prompts clipped so that a request, prompt and output, fits a model
        context of ``context`` tokens (a trace's longest prompts exceed a small model's), said
        through ``say``; itself when they fit. Raises ValueError when ``max_output`` alone leaves
        no room for a prompt."""
        room = context - self.max_output
        if room < 1:
            raise ValueError(f"--max-output {self.max_output} leaves no room for a prompt in the model's context "
                             f"({context} tokens)")
        if self.max_prompt <= room:
            return self
        say(f"prompts clipped to {room} tokens (--max-prompt {self.max_prompt}): the model's context is "
            f"{context} tokens and outputs go up to {self.max_output}")
        return replace(self, max_prompt=room)

    def apply(self, a: Arrival) -> Arrival:
        return Arrival(
            a.time_s / self.rate,
            max(1, min(self.max_prompt, round(a.prompt_tokens * self.length))),
            max(1, min(self.max_output, round(a.output_tokens * self.length))),
        )


def load_trace(path: str | Path, scaling: Scaling = Scaling(), *, start_s: float = 0.0,
               duration_s: float | None = None) -> list[Arrival]:
    """Read a CSV with ``arrival_s,prompt_tokens,output_tokens``; keep ``[start, start + duration)``
    of the scaled timeline, re-based to 0."""
    rows = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"arrival_s", "prompt_tokens", "output_tokens"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(sorted(missing))}")
        for line, row in enumerate(reader, start=2):
            try:
                a = Arrival(float(row["arrival_s"]), int(row["prompt_tokens"]), int(row["output_tokens"]))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}:{line}: {e}") from None
            rows.append(scaling.apply(a))
    rows.sort(key=lambda a: a.time_s)
    end = float("inf") if duration_s is None else start_s + duration_s
    return [Arrival(a.time_s - start_s, a.prompt_tokens, a.output_tokens) for a in rows if start_s <= a.time_s < end]


def busiest_window(arrivals: list[Arrival], duration_s: float) -> float:
    """Start time of the ``duration_s`` window holding the largest one-second burst."""
    if not arrivals:
        return 0.0
    counts: dict[int, int] = {}
    for a in arrivals:
        counts[int(a.time_s)] = counts.get(int(a.time_s), 0) + 1
    peak = max(counts, key=lambda s: (counts[s], -s))
    last = arrivals[-1].time_s
    return max(0.0, min(peak - duration_s / 2, last - duration_s))


@dataclass(frozen=True)
class BurstPattern:
    """Poisson arrivals at ``base_rate`` with ``peak_rate`` bursts of ``peak_s`` every ``period_s``."""

    base_rate: float
    peak_rate: float
    peak_s: float
    period_s: float
    prompt_mean: int = 512
    output_mean: int = 64


BURSTS: dict[str, BurstPattern] = {
    "burst-light": BurstPattern(base_rate=2.0, peak_rate=80.0, peak_s=2.0, period_s=30.0),
    "burst-dense": BurstPattern(base_rate=4.0, peak_rate=120.0, peak_s=4.0, period_s=30.0),
}


def synthetic(pattern: BurstPattern, duration_s: float, scaling: Scaling = Scaling(), seed: int = 0
              ) -> list[Arrival]:
    """Arrivals of a burst pattern (first burst at ``period_s / 2``); lengths exponential around the means."""
    rng = random.Random(seed)
    out = []
    t = 0.0
    while True:
        in_burst = (t % pattern.period_s) >= pattern.period_s / 2 and (
            (t % pattern.period_s) < pattern.period_s / 2 + pattern.peak_s)
        rate = pattern.peak_rate if in_burst else pattern.base_rate
        t += rng.expovariate(rate)
        if t >= duration_s * scaling.rate:
            break
        a = Arrival(t, max(1, int(rng.expovariate(1 / pattern.prompt_mean))),
                    max(1, int(rng.expovariate(1 / pattern.output_mean))))
        out.append(scaling.apply(a))
    return out


# Where a trace named without a path is looked for: beside the checkout, then inside it.
TRACE_DIRS: tuple[Path, ...] = (Path("../shared/data/traces"), Path(".traces"))


@dataclass(frozen=True)
class Workload:
    """The arrivals one benchmark replays: ``duration_s`` seconds starting at ``window_start_s``
    of the scaled source timeline, re-based to 0. ``source`` is the CSV path or ``synthetic``."""

    name: str
    source: str
    arrivals: tuple[Arrival, ...]
    window_start_s: float
    duration_s: float
    scaling: Scaling
    seed: int


def find_trace(name: str, search: tuple[Path, ...] = TRACE_DIRS) -> Path:
    """``name`` as a path if it exists, else ``DIR/name`` or ``DIR/name.csv`` in ``search``."""
    path = Path(name)
    if path.is_file():
        return path
    for d in search:
        for candidate in (d / name, d / f"{name}.csv"):
            if candidate.is_file():
                return candidate
    dirs = ", ".join(str(d) for d in search)
    raise FileNotFoundError(f"--workload {name!r}: no such file, no trace of that name in {dirs}, "
                            f"and not one of the synthetic patterns {', '.join(BURSTS)}")


def window(arrivals: list[Arrival], start_s: float, duration_s: float) -> tuple[Arrival, ...]:
    """The arrivals in ``[start_s, start_s + duration_s)``, re-based to 0."""
    return tuple(Arrival(a.time_s - start_s, a.prompt_tokens, a.output_tokens) for a in arrivals
                 if start_s <= a.time_s < start_s + duration_s)


def load_workload(name: str, duration_s: float, scaling: Scaling = Scaling(), seed: int = 0,
                  search: tuple[Path, ...] = TRACE_DIRS) -> Workload:
    """A synthetic pattern of :data:`BURSTS` or a trace CSV (see :func:`find_trace`), cut to the
    ``duration_s`` window holding its largest one-second burst (:func:`busiest_window`).

    A synthetic pattern is generated over ``duration_s`` plus one scaled period, so that the
    window can hold a whole burst wherever it falls; ``seed`` fixes its arrivals.
    """
    if duration_s <= 0:
        raise ValueError(f"--duration must be positive, got {duration_s}")
    pattern = BURSTS.get(name)
    if pattern is not None:
        every = synthetic(pattern, duration_s + pattern.period_s / scaling.rate, scaling, seed=seed)
        source = "synthetic"
    else:
        path = find_trace(name, search)
        every = load_trace(path, scaling)
        source = str(path)
        name = path.stem
    start = busiest_window(every, duration_s)
    arrivals = window(every, start, duration_s)
    return Workload(name, source, arrivals, start, duration_s, scaling, seed)

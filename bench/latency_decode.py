"""Decode-set level forms replayed online (``bench/latency_fit.py``'s ``decode_forms``).

A decode set's prediction is its linear form (refitted over a window, with the busy term of the
trainer's phase) times ``exp(level)``; :data:`DECODE_FORMS` vary the level and the window, each
from what is known before the step: the steps already measured, the trainer's phase and position
as the step begins. The linear part is the server's own (``LatencyModel`` with no level, refits
as the server runs them); each form's level is kept beside it and restarts, as the model's does,
from the median log ratio of the set's latest :data:`LEVEL_RECENTER_STEPS` steps to the new
linear form after each refit. ``after`` is the model as it runs (its predictions equal ``replay``'s ``after``).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from coserve.core.latency import (
    LEVEL_CLIP,
    LEVEL_FORMS,
    LEVEL_RATE,
    LEVEL_RECENTER_STEPS,
    LatencyModel,
    busy_key,
)
from coserve.trainer.stream_gate import boundary_kind


class Ewma:
    """The model's level: an exponentially weighted mean of the log ratios (``rate``), each
    step's move clipped at ``LEVEL_CLIP · rate``; ``reset_at_task``: busy levels back to 0 when a
    backward task starts."""

    def __init__(self, rate: float = LEVEL_RATE, reset_at_task: bool = False) -> None:
        self.rate, self.reset_at_task = rate, reset_at_task
        self.level: dict[Any, float] = {}

    def value(self, k: Any) -> float:
        return self.level.get(k, 0.0)

    def observe(self, k: Any, log_ratio: float) -> None:
        now = self.level.get(k, 0.0)
        self.level[k] = now + self.rate * min(max(log_ratio - now, -LEVEL_CLIP), LEVEL_CLIP)

    def recenter(self, k: Any, log_ratios: list[float]) -> None:
        if log_ratios:
            self.level[k] = float(statistics.median(log_ratios))

    def task_start(self) -> None:
        if self.reset_at_task:
            self.level = {k: v for k, v in self.level.items() if k[1] == "idle"}


class Recent:
    """The ``q`` quantile of the last ``k`` log ratios (``q = 0.5``: their median)."""

    def __init__(self, k: int, q: float = 0.5) -> None:
        self.k, self.q = k, q
        self.ratios: dict[Any, deque[float]] = {}

    def value(self, k: Any) -> float:
        got = self.ratios.get(k)
        if not got:
            return 0.0
        return float(torch.tensor(list(got), dtype=torch.float64).quantile(self.q))

    def observe(self, k: Any, log_ratio: float) -> None:
        self.ratios.setdefault(k, deque(maxlen=self.k)).append(log_ratio)

    def recenter(self, k: Any, log_ratios: list[float]) -> None:
        self.ratios[k] = deque(log_ratios[-self.k:], maxlen=self.k)

    def task_start(self) -> None:
        pass


def per_phase(base: str, state: str, at: Any, layers: int) -> tuple[str, ...]:
    """The model's sets: one level per key and idle or trainer phase."""
    return (base, state)


def shared(base: str, state: str, at: Any, layers: int) -> tuple[str, ...]:
    """One level for a key's busy steps, whatever the phase."""
    return (base, "idle" if state == "idle" else "busy")


def by_position(base: str, state: str, at: Any, layers: int) -> tuple[str, ...]:
    """One level per phase and trainer position (``boundary_kind`` of ``trainer_at``; ``layers``:
    the model's, the loss boundary's number)."""
    if state == "idle" or at is None:
        return (base, state)
    return (base, state, boundary_kind(int(at[0]), int(at[1]), layers))


@dataclass(frozen=True)
class DecodeForm:
    level: Callable[[], Ewma | Recent]
    keys: Callable[[str, str, Any, int], tuple[str, ...]] = per_phase
    window: int = 2000
    fitted_only: bool = False
    """Share ``keys``' level only among the busy phases whose set has its own fitted ``(ρ, δ)``
    (as the step begins); a phase still priced by a stand-in term keeps its own level."""


DECODE_FORMS: dict[str, DecodeForm] = {
    "after": DecodeForm(Ewma),
    "rate_0.1": DecodeForm(lambda: Ewma(0.1)),
    "rate_0.35": DecodeForm(lambda: Ewma(0.35)),
    "rate_0.5": DecodeForm(lambda: Ewma(0.5)),
    "shared_level": DecodeForm(Ewma, shared),
    "level_by_position": DecodeForm(Ewma, by_position),
    "reset_at_task": DecodeForm(lambda: Ewma(reset_at_task=True)),
    "window_500": DecodeForm(Ewma, window=500),
    "window_200": DecodeForm(Ewma, window=200),
    "median_5": DecodeForm(lambda: Recent(5)),
    "median_9": DecodeForm(lambda: Recent(9)),
    "quantile_40": DecodeForm(lambda: Recent(20, 0.4)),
    "quantile_60": DecodeForm(lambda: Recent(20, 0.6)),
    "shared_rate_0.3": DecodeForm(lambda: Ewma(0.3), shared),
    "shared_fitted": DecodeForm(Ewma, shared, fitted_only=True),
    "shared_fitted_rate_0.3": DecodeForm(lambda: Ewma(0.3), shared, fitted_only=True),
}
"""Level forms (module docstring). ``after``: the model as it runs (one level per busy set of
each trainer phase, rate 0.2), against which the others are judged. Each of the next changes one
thing of it: ``rate_*`` the level's rate; ``shared_level`` one level over a key's busy phases
(each phase keeps its own ``(ρ, δ)``); ``level_by_position`` one level per phase and trainer
position (``layer#k``, ``loss``, ``commit``, ``start``); ``reset_at_task`` busy levels back to 0
as each backward task starts (the phase turns ``starting``); ``window_*`` a shorter refit window;
``median_k`` the median of the last k log ratios instead of a mean; ``quantile_q`` the q-th
percentile of the last 20 (a quantile, not a central value). ``shared_rate_0.3``:
``shared_level`` at rate 0.3. ``shared_fitted``: ``shared_level`` among the busy phases with their
own fitted ``(ρ, δ)`` only (a phase still on the ``active`` or another stand-in term keeps its own
level until its first refit); ``shared_fitted_rate_0.3``: that at rate 0.3."""
BASELINE = "after"
FIRST_STEPS = 500
"""``decode_forms``' ``views``: besides the held-out half, each form's error over all the set's
steps and over its first this many (start-up, before the phases' busy sets have refitted)."""


class _Trace(LatencyModel):
    """The server's linear form and busy terms without a level, noting the sets that each
    observation refitted (their levels restart)."""

    def __init__(self, window: int) -> None:
        super().__init__(level_rate=0.0, window=window)
        self.refitted: list[tuple[str, str]] = []

    # NOTE: LatencyModel calls it for each set whose prediction a refit changed
    def _after_refit(self, s: tuple[str, str]) -> None:
        self.refitted.append(s)
        super()._after_refit(s)

    def has_own_busy(self, key: str, phase: str) -> bool:
        """Whether ``key``'s busy set beside ``phase`` has its own fitted ``(ρ, δ)``."""
        return busy_key(key, phase) in self._busy


def _errors(pred: list[float], y: list[float]) -> dict[str, float]:
    e = sorted(abs(p - m) / m for p, m in zip(pred, y, strict=True))
    t = torch.tensor(e, dtype=torch.float64)
    return {"median_rel": float(t.quantile(0.5)), "p99_rel": float(t.quantile(0.99)), "n": len(e)}


def decode_forms(steps: list[list[Any]], phases: list[str], state: Mapping[str, Any], train: float,
                 configure: Callable[[LatencyModel], None],
                 regressors: Callable[[str, list[float]], list[float]]) -> dict[str, Any]:
    """Held-out error of each decode key's steps under :data:`DECODE_FORMS` (module docstring).

    ``steps``: the table's timed rows in order; ``phases``: each one's trainer phase; ``state``:
    the recovered calibration as a ``LatencyModel`` state; ``configure``: sets a model's buckets
    and refit deferral as the server's; ``regressors(base, vec)``: a row's regressors in this
    commit's terms."""
    decode = [i for i, s in enumerate(steps) if s[0].startswith(LEVEL_FORMS)]
    if not decode:
        return {}
    preds: dict[str, dict[int, float]] = {name: {} for name in DECODE_FORMS}
    # (the model's layer count, known before the run: the loss boundary is the highest)
    layers = max((int(s[5][0]) for s in steps if len(s) > 5 and s[5] is not None), default=0)
    for window in sorted({f.window for f in DECODE_FORMS.values()}):
        forms = {name: f for name, f in DECODE_FORMS.items() if f.window == window}
        trace = _Trace(window)
        configure(trace)
        trace.load_state_dict(state)
        levels = {name: f.level() for name, f in forms.items()}
        history: dict[str, dict[Any, list[tuple[str, str, tuple[float, ...], float]]]] = {n: {} for n in forms}
        members: dict[str, dict[tuple[str, str], set[Any]]] = {n: {} for n in forms}
        previous = "starting"
        for i, (row, phase) in enumerate(zip(steps, phases, strict=True)):
            key, measured, at = row[0], row[2], row[5] if len(row) > 5 else None
            base, busy = key.rsplit("/", 1)
            s = (base, phase if busy == "busy" else "idle")
            v = trace.bucketed(regressors(base, row[3]), base)
            if phase == "starting" and previous != "starting":
                for level in levels.values():
                    level.task_start()
            previous = phase
            if base.startswith(LEVEL_FORMS):
                linear = trace.predict_regressors(base, v, s[1])
                for name, form in forms.items():
                    k = form.keys(base, s[1], at, layers)
                    if form.fitted_only and s[1] != "idle" and not trace.has_own_busy(base, s[1]):
                        k = (base, s[1])
                    preds[name][i] = linear * math.exp(levels[name].value(k))
                    if linear > 0:
                        levels[name].observe(k, math.log(measured / linear))
                    history[name].setdefault(k, []).append((base, s[1], v, measured))
                    members[name].setdefault(s, set()).add(k)
            trace.refitted.clear()
            trace.observe_regressors(base, v, measured, s[1])
            for t in trace.refitted:
                for name in forms:
                    for k in members[name].get(t, ()):
                        ratios = []
                        for b, st, x, y in history[name][k][-LEVEL_RECENTER_STEPS:]:
                            lin = trace.predict_regressors(b, x, st)
                            if lin > 0:
                                ratios.append(math.log(y / lin))
                        levels[name].recenter(k, ratios)
    out: dict[str, Any] = {}
    for key in sorted({steps[i][0] for i in decode}):
        idx = [i for i in decode if steps[i][0] == key]
        held = idx[int(len(idx) * train):]
        if len(held) < 4:
            continue
        y_held = [steps[i][2] for i in held]
        out[key] = {"held_out_steps": len(held),
                    **{name: _errors([p[i] for i in held], y_held) for name, p in preds.items()},
                    "views": {view: {name: _errors([p[i] for i in part], [steps[i][2] for i in part])
                                     for name, p in preds.items()}
                              for view, part in (("all_steps", idx), (f"first_{FIRST_STEPS}", idx[:FIRST_STEPS]))}}
    return out


def decode_summary(report: Mapping[str, Any]) -> dict[str, Any]:
    """Per :data:`DECODE_FORMS` form, over every table's decode sets: on how many its held-out
    p99 is below :data:`BASELINE`'s, its largest held-out median (the baseline's beside it), and
    whether it ``wins``: a lower p99 on every set and no median raised over 3%."""
    sets = [entry for table in report.values() if isinstance(table, Mapping)
            for entry in table.get("decode_forms", {}).values()]
    out: dict[str, Any] = {"sets": len(sets), "baseline": BASELINE, "baseline_max_median_rel": max(
        (e[BASELINE]["median_rel"] for e in sets), default=math.nan)}
    for form in DECODE_FORMS:
        if form == BASELINE:
            continue
        lower = sum(e[form]["p99_rel"] < e[BASELINE]["p99_rel"] for e in sets)
        raised = sum(e[form]["median_rel"] > max(0.03, e[BASELINE]["median_rel"]) for e in sets)
        out[form] = {"lower_p99_sets": lower, "medians_raised_over_3pct": raised,
                     "max_median_rel": max((e[form]["median_rel"] for e in sets), default=math.nan),
                     "wins": bool(sets) and lower == len(sets) and raised == 0}
    return out

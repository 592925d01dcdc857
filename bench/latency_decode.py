"""Decode-set level forms replayed online (``bench/latency_fit.py``'s ``decode_forms``).

A decode set's prediction is its linear form (refitted over a window, with the busy term of the
trainer's phase) times ``exp(level)``; :data:`DECODE_FORMS` vary the level and the window, each
from what is known before the step: the steps already measured, the trainer's phase and position
as the step begins. The linear part is the server's own (``LatencyModel`` with no level, refits
as the server runs them); each form's level is kept beside it and restarts, as the model's does,
from the median log ratio of the set's latest :data:`LEVEL_RECENTER_STEPS` steps to the new
linear form after each refit. ``after`` is the model as it runs (its predictions equal ``replay``'s ``after``).
Every form carries the model's spot levels on top of its own (``latency.SPOT_LEVELS``), learnt
against its own predictions.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from coserve.bench.runners import STEP_TABLE_COLUMNS
from coserve.core.latency import (
    LEVEL_FORMS,
    LEVEL_RATE,
    LEVEL_RECENTER_STEPS,
    SHARE_AFTER_STEPS,
    SHARED_LEVEL_RATE,
    SPOT_LEVEL_RATE,
    SPOT_LEVELS,
    LatencyModel,
    busy_key,
    moved_level,
    trainer_spot,
)
from coserve.trainer.stream_gate import boundary_kind

PLANNED = STEP_TABLE_COLUMNS.index("planned_s")
"""The step table's ``planned_s`` column (since session 27): the step's host seconds up to
admission's decision, part of ``predicted_s`` as measured; the model prices the rest."""


def planned(row: list[Any]) -> float:
    """A recorded step's ``planned_s`` (0 for a table recorded before the column: its model
    priced the whole step)."""
    return float(row[PLANNED] or 0.0) if len(row) > PLANNED else 0.0


class Ewma:
    """The model's level: an exponentially weighted mean of the log ratios (``rate``), each
    step's move clipped at ``LEVEL_CLIP · rate``; ``reset_at_task``: busy levels back to 0 when a
    backward task starts."""

    def __init__(self, rate: float = LEVEL_RATE, reset_at_task: bool = False) -> None:
        self.rate, self.reset_at_task = rate, reset_at_task
        self.level: dict[Any, float] = {}

    def value(self, k: Any) -> float:
        return self.level.get(k, 0.0)

    def rate_for(self, k: Any) -> float:
        """The rate at which ``k``'s level moves at its next step."""
        return self.rate

    def observe(self, k: Any, log_ratio: float) -> None:
        now = self.level.get(k, 0.0)
        self.level[k] = moved_level(now, log_ratio, self.rate_for(k))

    def recenter(self, k: Any, log_ratios: list[float]) -> None:
        if log_ratios:
            self.level[k] = float(statistics.median(log_ratios))

    def join(self, k: Any, own: Any) -> None:
        """A phase whose level was ``own`` moves to ``k``: ``k`` starts from ``own``'s if it has
        no level yet (the first phase to join a shared level brings its own)."""
        if k not in self.level and own in self.level:
            self.level[k] = self.level[own]

    def task_start(self) -> None:
        if self.reset_at_task:
            self.level = {k: v for k, v in self.level.items() if k[1] == "idle"}


class Scheduled(Ewma):
    """:class:`Ewma` whose rate depends on the level: ``young_rate`` for a level's first
    ``young_steps`` observed steps (start-up, while its set's busy terms are still stand-ins or
    freshly fitted: a fast level there learns their error), ``rate`` after (a fast level follows
    the drift); ``shared_rate`` (if set): the rate of a level shared among a key's busy phases
    (keys ``(base, "busy")``) once it is past its young steps, a phase's own level keeping ``rate``.
    A refit's restart of the level does not reset its count."""

    def __init__(self, young_steps: int, young_rate: float = LEVEL_RATE, rate: float = 0.3,
                 shared_rate: float | None = None) -> None:
        super().__init__(rate)
        self.young_steps, self.young_rate, self.shared_rate = young_steps, young_rate, shared_rate
        self.seen: dict[Any, int] = {}

    def rate_for(self, k: Any) -> float:
        if self.seen.get(k, 0) < self.young_steps:
            return self.young_rate
        if self.shared_rate is not None and k[-1] == "busy":
            return self.shared_rate
        return self.rate

    def observe(self, k: Any, log_ratio: float) -> None:
        super().observe(k, log_ratio)
        self.seen[k] = self.seen.get(k, 0) + 1


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

    def join(self, k: Any, own: Any) -> None:
        if k not in self.ratios and own in self.ratios:
            self.ratios[k] = deque(self.ratios[own], maxlen=self.k)

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
    share_after: int = 0
    """Busy phases keep their own levels (``after``'s) until the key has this many busy steps
    measured, then share ``keys``' level (as ``fitted_only`` allows), the first to join bringing
    its own level (:meth:`Ewma.join`); 0: from the start, levels not carried over."""


DECODE_FORMS: dict[str, DecodeForm] = {
    "after": DecodeForm(lambda: Scheduled(0, rate=LEVEL_RATE, shared_rate=SHARED_LEVEL_RATE), shared,
                        fitted_only=True, share_after=SHARE_AFTER_STEPS),
    "per_phase": DecodeForm(Ewma),
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
    "young_250": DecodeForm(lambda: Scheduled(250)),
    "young_500": DecodeForm(lambda: Scheduled(500)),
    "shared_fitted_young_250": DecodeForm(lambda: Scheduled(250), shared, fitted_only=True),
    "shared_fitted_young_500": DecodeForm(lambda: Scheduled(500), shared, fitted_only=True),
    "shared_fitted_shared_0.3": DecodeForm(lambda: Scheduled(0, rate=LEVEL_RATE, shared_rate=0.3), shared,
                                           fitted_only=True),
    "shared_fitted_young_250_shared_0.3": DecodeForm(lambda: Scheduled(250, rate=LEVEL_RATE, shared_rate=0.3),
                                                     shared, fitted_only=True),
    **{f"shared_fitted_0.3_after_{n}": DecodeForm(lambda: Scheduled(0, rate=LEVEL_RATE, shared_rate=0.3), shared,
                                                  fitted_only=True, share_after=n) for n in (250, 500, 1000)},
}
"""Level forms (module docstring). ``after``: the model as it runs, against which the others are
judged: since session 24 ``shared_fitted_0.3_after_500`` (below); ``per_phase``: the model
before it, which recorded the H200 tables of sessions 20–23 (one level per busy set of each
trainer phase, rate 0.2; ``after`` until session 24). Each of the next changes one thing of
``per_phase``: ``rate_*`` the level's rate; ``shared_level`` one level over a key's busy phases
(each phase keeps its own ``(ρ, δ)``); ``level_by_position`` one level per phase and trainer
position (``layer#k``, ``loss``, ``commit``, ``start``); ``reset_at_task`` busy levels back to 0
as each backward task starts (the phase turns ``starting``); ``window_*`` a shorter refit window;
``median_k`` the median of the last k log ratios instead of a mean; ``quantile_q`` the q-th
percentile of the last 20 (a quantile, not a central value). ``shared_rate_0.3``:
``shared_level`` at rate 0.3. ``shared_fitted``: ``shared_level`` among the busy phases with their
own fitted ``(ρ, δ)`` only (a phase still on the ``active`` or another stand-in term keeps its own
level until its first refit); ``shared_fitted_rate_0.3``: that at rate 0.3. ``young_n``
(:class:`Scheduled`): rate 0.2 for each level's first n steps, 0.3 after (rate 0.3's start-up
loss without giving up its later gain); ``shared_fitted_young_n``: that on ``shared_fitted``'s
levels (the shared level counts its steps from its first fitted phase);
``shared_fitted_shared_0.3``: ``shared_fitted`` with the shared level at 0.3 and a phase's own
level at 0.2; ``shared_fitted_young_250_shared_0.3``: that with the shared level at 0.2 for its
first 250 steps. ``shared_fitted_0.3_after_n``: ``per_phase`` for the key's first n busy steps,
then ``shared_fitted_shared_0.3`` (each phase's own level at 0.2 until it joins the shared one at
0.3; sharing at 0.2 is what raises ``shared_fitted``'s first-500 medians)."""
BASELINE = "after"
FIRST_STEPS = 500
"""``decode_forms``' ``views``: besides the held-out half, each form's error over all the set's
steps, over its first this many (start-up, before the phases' busy sets have refitted) and over
the next this many (where a form that changes at ``share_after = FIRST_STEPS`` changes)."""


class _Trace(LatencyModel):
    """The server's linear form and busy terms without a level, noting the sets that each
    observation refitted (their levels restart)."""

    def __init__(self, window: int) -> None:
        super().__init__(level_rate=0.0, window=window, share_after=None)
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
                 regressors: Callable[[str, list[float]], list[float]],
                 names: Collection[str] | None = None, num_layers: int | None = None) -> dict[str, Any]:
    """Held-out error of each decode key's steps under :data:`DECODE_FORMS` (module docstring).

    ``steps``: the table's timed rows in order; ``phases``: each one's trainer phase; ``state``:
    the recovered calibration as a ``LatencyModel`` state; ``configure``: sets a model's buckets
    and refit deferral as the server's; ``regressors(base, vec)``: a row's regressors in this
    commit's terms; ``names``: only these forms (and :data:`BASELINE`), all when ``None``;
    ``num_layers``: the model's layers, where its trainer spots lie (``latency.trainer_spot``; by
    default the highest boundary layer in ``steps``)."""
    decode = [i for i, s in enumerate(steps) if s[0].startswith(LEVEL_FORMS)]
    if not decode:
        return {}
    chosen = {name: f for name, f in DECODE_FORMS.items() if names is None or name in names or name == BASELINE}
    preds: dict[str, dict[int, float]] = {name: {} for name in chosen}
    # (the model's layer count, known before the run: the loss boundary is the highest)
    layers = max((int(s[5][0]) for s in steps if len(s) > 5 and s[5] is not None), default=0)
    spot_layers = layers if num_layers is None else num_layers
    for window in sorted({f.window for f in chosen.values()}):
        forms = {name: f for name, f in chosen.items() if f.window == window}
        trace = _Trace(window)
        configure(trace)
        trace.load_state_dict(state)
        levels = {name: f.level() for name, f in forms.items()}
        history: dict[str, dict[Any, list[tuple[str, str, tuple[float, ...], float]]]] = {n: {} for n in forms}
        members: dict[str, dict[tuple[str, str], set[Any]]] = {n: {} for n in forms}
        busy_steps: dict[str, int] = {}  # per key, its busy steps measured so far
        # per form, the spot levels (LatencyModel's, on top of the form's own prediction)
        spots: dict[str, dict[tuple[str, str], float]] = {n: {} for n in forms}
        previous = "starting"
        for i, (row, phase) in enumerate(zip(steps, phases, strict=True)):
            # (the model's part of the step: after admission's decision, planned_s before it)
            pl = planned(row)
            key, measured, at = row[0], row[2] - pl, row[5] if len(row) > 5 else None
            base, busy = key.rsplit("/", 1)
            s = (base, trace.phase_of(base, phase) if busy == "busy" else "idle")
            v = trace.bucketed(regressors(base, row[3]), base)
            if phase == "starting" and previous != "starting":
                for level in levels.values():
                    level.task_start()
            previous = phase
            if base.startswith(LEVEL_FORMS):
                linear = trace.predict_regressors(base, v, s[1])
                for name, form in forms.items():
                    k = form.keys(base, s[1], at, layers)
                    if s[1] != "idle" and (form.fitted_only and not trace.has_own_busy(base, s[1])
                                           or busy_steps.get(base, 0) < form.share_after):
                        k = (base, s[1])
                    elif form.share_after:
                        levels[name].join(k, (base, s[1]))
                    predicted = linear * math.exp(levels[name].value(k))
                    spot = trainer_spot((int(at[0]), int(at[1])), spot_layers) if at is not None else None
                    if SPOT_LEVELS and busy == "busy" and spot is not None and predicted > 0:
                        at_spot = (base, spot)
                        level = spots[name].get(at_spot, 0.0)
                        spots[name][at_spot] = moved_level(level, math.log(measured / predicted), SPOT_LEVEL_RATE)
                        predicted *= math.exp(level)
                    preds[name][i] = predicted + pl
                    if linear > 0:
                        levels[name].observe(k, math.log(measured / linear))
                    history[name].setdefault(k, []).append((base, s[1], v, measured))
                    members[name].setdefault(s, set()).add(k)
                if s[1] != "idle":
                    busy_steps[base] = busy_steps.get(base, 0) + 1
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
                              for view, part in (("all_steps", idx), (f"first_{FIRST_STEPS}", idx[:FIRST_STEPS]),
                                                 (f"steps_{FIRST_STEPS}_{2 * FIRST_STEPS}",
                                                  idx[FIRST_STEPS:2 * FIRST_STEPS])) if part}}
    return out


def decode_summary(report: Mapping[str, Any]) -> dict[str, Any]:
    """Per :data:`DECODE_FORMS` form, over every table's decode sets: on how many its held-out
    p99 is below :data:`BASELINE`'s, its largest held-out median (the baseline's beside it),
    whether it ``wins``: a lower p99 on every set and no median raised over 3%, and ``worse``: per
    view (``held_out`` and ``views``), on how many sets its median and its p99 are above the
    baseline's (a form replaces the model only if it is no worse in every view). Forms that some
    set did not run are left out."""
    sets = [entry for table in report.values() if isinstance(table, Mapping)
            for entry in table.get("decode_forms", {}).values()]
    out: dict[str, Any] = {"sets": len(sets), "baseline": BASELINE, "baseline_max_median_rel": max(
        (e[BASELINE]["median_rel"] for e in sets), default=math.nan)}
    views = [v for v in (sets[0].get("views", {}) if sets else {}) if all(v in e.get("views", {}) for e in sets)]
    parts = {"held_out": sets, **{v: [e["views"][v] for e in sets] for v in views}}
    for form in DECODE_FORMS:
        if form == BASELINE or any(form not in e for e in sets):
            continue
        lower = sum(e[form]["p99_rel"] < e[BASELINE]["p99_rel"] for e in sets)
        raised = sum(e[form]["median_rel"] > max(0.03, e[BASELINE]["median_rel"]) for e in sets)
        worse = {view: {stat: sum(e[form][stat] > e[BASELINE][stat] for e in part) for stat in ("median_rel", "p99_rel")}
                 for view, part in parts.items()}
        out[form] = {"lower_p99_sets": lower, "medians_raised_over_3pct": raised,
                     "max_median_rel": max((e[form]["median_rel"] for e in sets), default=math.nan),
                     "wins": bool(sets) and lower == len(sets) and raised == 0, "worse": worse}
    return out

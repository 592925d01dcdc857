"""Host time of ``LatencyModel.observe`` on the engine's step path, with refits on the step path
and with them put off (``defer_refits``, as ``CoServer`` sets it; here no idle poll ever comes,
so only the refits at ``DEFER_CAP`` run inline, and those of a window shorter than
``DEFER_FROM_ROWS`` rows, the default, or 0: none): 3,000 synthetic prefill and decode steps of
random shapes, idle and busy; then idle decode steps whose refits (on the step path, a window
under ``DEFER_FROM_ROWS``) refit four 2,000-row busy sets with them or put those off.

    PYTHONPATH=src python3 bench/refit_cost.py --out bench/results/host_cpu/refit_cost.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
from speed_common import provenance

from coserve.core.latency import DEFER_FROM_ROWS, LatencyModel


def observe_times(defer: bool, steps: int, seed: int, defer_from_rows: int = DEFER_FROM_ROWS) -> np.ndarray:
    model = LatencyModel()
    model.defer_refits = defer
    model.defer_from_rows = defer_from_rows
    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        if rng.random() < 0.5:
            key, v = "decode/graph", (float(rng.randint(1, 64)), float(rng.randint(100, 40000)), 1.0)
        else:
            n, c = rng.randint(16, 2048), rng.choice([0, rng.randint(1, 2048)])
            key, v = "prefill/graph", model.bucketed((float(n * n), float(n), 0.0, float(rng.randint(0, 30000)),
                                                      float(n * c), 1.0 if c else 0.0, 0.0, 1.0), "prefill/graph")
        measured = 0.005 + 1e-5 * v[1] + sum(v) * 1e-9 * rng.uniform(0.9, 1.1)
        t0 = time.perf_counter()
        model.observe_regressors(key, v, measured, rng.choice(["idle", "active"]))
        out.append(time.perf_counter() - t0)
    return np.asarray(out) * 1e3


def idle_refit_times(busy_deferred: bool, steps: int, seed: int) -> np.ndarray:
    """Observes of idle decode steps whose set refits (a window under ``DEFER_FROM_ROWS``: on the
    step path) while four busy phases hold 2,000 rows each: their refits against the new idle form
    (``busy_with_idle``) on the step path too, or put off to the idle poll (``busy_deferred``)."""
    model = LatencyModel()
    model.defer_refits = True
    model.defer_from_rows = DEFER_FROM_ROWS if busy_deferred else 2**62
    rng = random.Random(seed)
    for phase in ("active", "quiet", "starting", "ending"):
        for _ in range(model.window):
            r = rng.randint(1, 64)
            model.observe_regressors("decode/graph", (float(r), 500.0 * r, 1.0), 0.005 + 1e-4 * r, phase)
    model.refit_due()
    out = []
    for _ in range(steps):
        r = rng.randint(1, 64)
        t0 = time.perf_counter()
        model.observe_regressors("decode/graph", (float(r), 500.0 * r, 1.0), 0.004 + 1e-4 * r, "idle")
        out.append(time.perf_counter() - t0)
    return np.asarray(out) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=3000)
    args = p.parse_args()
    figures: dict[str, Any] = {}
    settings = (("refit_on_step_path", False, 0), ("refits_deferred", True, 0),
                (f"refits_deferred_from_{DEFER_FROM_ROWS}_rows", True, DEFER_FROM_ROWS))
    for name, defer, from_rows in settings:
        t = observe_times(defer, args.steps, seed=0, defer_from_rows=from_rows)
        figures[name] = {"observe_ms_p50": float(np.median(t)), "observe_ms_p99": float(np.quantile(t, 0.99)),
                         "observe_ms_max": float(t.max()), "observes_over_1ms": int((t > 1).sum())}
        print(name, json.dumps(figures[name]), flush=True)
    for name, deferred in (("idle_refits_busy_sets_on_step_path", False), ("idle_refits_busy_sets_deferred", True)):
        t = idle_refit_times(deferred, 400, seed=0)
        figures[name] = {"observe_ms_p50": float(np.median(t)), "observe_ms_p99": float(np.quantile(t, 0.99)),
                         "observe_ms_max": float(t.max()), "observes_over_1ms": int((t > 1).sum())}
        print(name, json.dumps(figures[name]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**provenance(), "config": {"steps": args.steps, "seed": 0,
                                                               "defer_from_rows": DEFER_FROM_ROWS},
                                    "figures": figures}, indent=1))


if __name__ == "__main__":
    main()

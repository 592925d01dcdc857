"""What saving the latency model costs at a job's end: ``LatencyModel.state_dict()`` (the copy the
engine's thread takes, between two steps) and its JSON (``write_json``'s ``json.dumps``, by the
job board's writer thread since session 44), for a model whose graph-mode windows are full: every
set of ``prefill/graph`` and ``decode/graph`` (idle and the five trainer phases) holding
``--window`` measured steps, as after a long-running server's jobs. Random valid rows.

    PYTHONPATH=src python bench/latency_state_cost.py --out latency_state_cost.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from coserve.bench.provenance import provenance
from coserve.core.latency import TERMS, TRAINER_PHASES, LatencyModel


def full_model(window: int, seed: int = 0) -> LatencyModel:
    """A model whose graph-mode windows hold ``window`` rows each (loaded through its state)."""
    rng = random.Random(seed)
    model = LatencyModel(window=window)
    state = model.state_dict()
    windows = {}
    for form in ("prefill", "decode"):
        width = len(TERMS[form])
        for phase in ("idle", *TRAINER_PHASES):
            windows[f"{form}/graph|{phase}"] = [[rng.uniform(0, 4096) for _ in range(width)] + [rng.uniform(1e-3, 0.1)]
                                                for _ in range(window)]
    state["online"] = {**state["online"], "windows": windows}
    model.load_state_dict(state)
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--window", type=int, default=2000, help="rows per set (LatencyModel's default window)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    model = full_model(args.window)
    copy_s, dumps_s, size = [], [], 0
    for _ in range(args.reps):
        t = time.perf_counter()
        state = model.state_dict()
        copy_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        size = len(json.dumps(state))
        dumps_s.append(time.perf_counter() - t)
    figures = {"sets": len(model.state_dict()["online"]["windows"]), "rows": sum(
                   len(w) for w in model.state_dict()["online"]["windows"].values()),
               "json_mb": round(size / 2**20, 2),
               "state_dict_ms_median": round(statistics.median(copy_s) * 1e3, 1),
               "json_dumps_ms_median": round(statistics.median(dumps_s) * 1e3, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**provenance(), "config": {"window": args.window, "reps": args.reps},
                                    "figures": figures}, indent=1) + "\n")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

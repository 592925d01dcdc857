"""One set's coefficients at each of its refits, replayed from a latency run's step table.

``bench/latency_fit.py``'s replay (this commit's model, from the run's recorded calibration, refits
deferred to their cap as ``CoServer`` runs them with no idle host) step by step; after each refit of
``--key``'s idle set it gives the set's coefficients and its predictions for a few reference steps,
and each step of that key predicted more than ``--off`` away from what it measured:

    python bench/latency_refits.py bench/results/latency_h100/session31/coserve_latency_share50_6ba5a32.json.xz \\
        [--key prefill/graph] [--out RESULT.json]

Session 31's use: the first refit of a prefill set, on 40 steps, moved ``e_kv`` to 0.4x its
calibration in one run, and prompts beside 31-47 decodes ran 1.2-1.4x their prediction until the
next refit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from coserve.bench.provenance import provenance
from coserve.bench.result_file import read_result
from coserve.bench.runners import row_lone, row_mix
from coserve.core.latency import TERMS, Chunk, LatencyModel, StepFeatures

sys.path.insert(0, str(Path(__file__).parent))
import latency_fit  # noqa: E402  (the script beside this one)

REFERENCES = {
    "181 tokens + 39 decodes": StepFeatures((Chunk(181),), num_decodes=39, kv_tokens=39 * 900, mode="graph"),
    "400 tokens + 5 decodes": StepFeatures((Chunk(400),), num_decodes=5, kv_tokens=5 * 900, mode="graph"),
    "1,500 tokens + 20 decodes": StepFeatures((Chunk(1500),), num_decodes=20, kv_tokens=20 * 900, mode="graph"),
    "32 tokens alone": StepFeatures((Chunk(32),), mode="graph"),
}
"""Steps priced after each refit (a decode row's context: 900 tokens)."""


def trace(rows: list[list[Any]], calibration: dict[str, list[float]] | None, key: str,
          off: float) -> dict[str, Any]:
    steps = [r for r in rows if r[2] > 0]
    recovery = latency_fit.recover(steps, latency_fit._replay_model(latency_fit.GRAPH_SIZES, latency_fit.PREFILL_BUCKETS),
                                   latency_fit.replay_phases(steps), calibration)
    model = latency_fit._replay_model(latency_fit.GRAPH_SIZES, latency_fit.PREFILL_BUCKETS)
    model.load_state_dict({**LatencyModel().state_dict(), "coefficients": recovery.calibration,
                           "calibration": recovery.calibration})
    refits: list[dict[str, Any]] = []
    worst: list[dict[str, Any]] = []
    last, k = None, 0
    for row, phase in zip(steps, latency_fit.replay_phases(steps), strict=True):
        full, measured, pl = row[0], row[2], latency_fit.planned(row)
        base, busy = full.rsplit("/", 1)
        v = latency_fit.current_regressors(base, row[3])
        predicted = model.observe_regressors(base, model.bucketed(v, base), measured - pl,
                                             phase if busy == "busy" else "idle", row_lone(row), None,
                                             row_mix(row)) + pl
        if full != f"{key}/idle":
            continue
        k += 1
        coef = model.coefficients(key)
        if coef != last:
            refits.append({"after_step": k, "coefficients": dict(zip(TERMS[key.split("/")[0]], coef, strict=True)),
                           "predicted_ms": {n: 1e3 * model.predict(f) for n, f in REFERENCES.items()}})
            last = coef
        if abs(predicted - measured) > off * measured:
            worst.append({"step": k, "predicted_ms": 1e3 * predicted, "measured_ms": 1e3 * measured,
                          "chunks": row[7] if len(row) > 7 else None, "decodes": row[8] if len(row) > 8 else None})
    return {"steps": k, "refits": refits, "off": worst}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("result", type=Path, help="a bench/coserve_latency.py result (.json, .json.gz or .json.xz)")
    p.add_argument("--key", default="prefill/graph", help="the idle set to follow (form/mode)")
    p.add_argument("--off", type=float, default=0.15, help="list the steps predicted further than this share away")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    result = read_result(args.result)
    got = trace(latency_fit.step_tables(result, None)["replay"], latency_fit.recorded_calibration(result), args.key,
                args.off)
    for r in got["refits"]:
        print(f"after {args.key} step {r['after_step']}: " + ", ".join(f"{n} {ms:.2f} ms" for n, ms in
                                                                    r["predicted_ms"].items())
              + "; " + " ".join(f"{n} {c:.3g}" for n, c in r["coefficients"].items()))
    for w in got["off"]:
        print(f"  step {w['step']}: predicted {w['predicted_ms']:.2f} ms, measured {w['measured_ms']:.2f} ms "
              f"({w['measured_ms'] / w['predicted_ms']:.2f}x), chunks {w['chunks']}, decodes {w['decodes']}")
    out = {**provenance(), "config": {"result": str(args.result), "key": args.key, "off": args.off},
           "figures": got}
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        print(f"result: {args.out}")
    return out


if __name__ == "__main__":
    main()

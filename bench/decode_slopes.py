"""Offline: what a latency run's idle decode steps cost per row and per KV token, on the host's
clock and on the GPU's, against the calibration's terms.

For the decode/graph steps of a ``bench/coserve_latency.py`` run with the trainer idle (its
trainer-idle replay, ``latency_model_error_trainer_idle``), a least-squares fit of ``rows``,
``KV tokens`` and a constant to the step's time after admission's decision (what the model
learns), to its forward's GPU time (``gpu_s``) and to their difference (host time), beside the
run's calibrated decode/graph terms. Rows and KV tokens grow together in serving (their
correlation is printed): the split between the two is looser than the sum.

Where the table records each step's longest decode row (``decode_kv_max``, since session 33), also
the relative error of two forms fitted to the GPU time, held out (fitted on the even steps, scored
on the odd ones): the model's (rows, KV tokens, constant) and the same with ``rows × longest row``
added. The decode kernel cuts each row's keys into the same number of splits (a number the
batch's rows set), so a step's attention lasts about as long as its longest row's share, while
the calibration's batches give every row one length.

    PYTHONPATH=src python bench/decode_slopes.py RUN.json.xz [RUN2 ...] --out OUT.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from coserve.bench.provenance import provenance
from coserve.bench.result_file import read_result
from coserve.layers.triton_attention import decode_splits


def slopes(path: str) -> dict[str, Any]:
    figures = read_result(path)["figures"]
    table = figures["steps"]
    col = {c: i for i, c in enumerate(table["columns"])}
    lo = figures["latency_model_error_trainer_idle"]["first_step"]
    hi = figures.get("warm_first_step") or len(table["rows"])
    rows = [r for r in table["rows"][lo:hi]
            if r[col["key"]] == "decode/graph/idle" and r[col["measured_s"]] > 0 and r[col["gpu_s"]] is not None]
    x = np.asarray([[r[col["regressors"]][0], r[col["regressors"]][1], 1.0] for r in rows])
    measured = np.asarray([r[col["measured_s"]] - (r[col["planned_s"]] or 0.0) for r in rows])
    gpu = np.asarray([r[col["gpu_s"]] for r in rows])
    out: dict[str, Any] = {"steps": len(rows), "rows_kv_correlation": float(np.corrcoef(x[:, 0], x[:, 1])[0, 1])}
    for name, y in (("after_decision", measured), ("gpu", gpu), ("host", measured - gpu)):
        c = np.linalg.lstsq(x, y, rcond=None)[0]
        out[name] = {"per_row_s": float(c[0]), "per_kv_token_s": float(c[1]), "constant_s": float(c[2])}
    if "decode_kv_max" in col and all(r[col["decode_kv_max"]] is not None for r in rows):
        longest = np.asarray([float(r[col["decode_kv_max"]] or 0) for r in rows])
        out["forms_gpu"] = held_out_forms(x, longest, gpu)
    calibrated = figures["calibration"]["coefficients"]["decode/graph"]
    out["calibration"] = {"per_row_s": calibrated[0], "per_kv_token_s": calibrated[1], "constant_s": calibrated[2]}
    return out


def held_out_forms(x: np.ndarray, longest: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    """Median and p99 relative error of (rows, KV, 1), (rows, KV, rows × longest, 1) and (rows, KV,
    longest / its split count, 1) fitted by
    least squares on relative error to the even steps, scored on the odd ones."""
    # the longest row's keys per program: its KV over the split count the graph of that many rows
    # was captured with (decode_splits at the 8B shape's 8 KV heads and an H100's or H200's 132 SMs)
    per_program = np.asarray([m / decode_splits(int(b), 8, 1 << 20, 132) for b, m in zip(x[:, 0], longest, strict=True)])
    forms = {"rows_kv": x, "rows_kv_longest": np.column_stack([x[:, :2], x[:, 0] * longest, x[:, 2]]),
             "rows_kv_longest_split": np.column_stack([x[:, :2], per_program, x[:, 2]])}
    out: dict[str, Any] = {}
    for name, a in forms.items():
        fit, held = slice(0, None, 2), slice(1, None, 2)
        c = np.linalg.lstsq(a[fit] / y[fit, None], np.ones(len(y[fit])), rcond=None)[0]
        rel = np.abs(a[held] @ c - y[held]) / y[held]
        out[name] = {"coefficients": [float(v) for v in c], "median_rel": float(np.median(rel)),
                     "p99_rel": float(np.percentile(rel, 99))}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    report = {Path(r).name: slopes(r) for r in args.runs}
    for name, s in report.items():
        print(f"{name}: {s['steps']} steps, rows-KV correlation {s['rows_kv_correlation']:.2f}")
        for part in ("after_decision", "gpu", "host", "calibration"):
            v = s[part]
            print(f"  {part:15s} per row {v['per_row_s'] * 1e6:6.1f} us  per KV token {v['per_kv_token_s'] * 1e9:6.2f} ns"
                  f"  constant {v['constant_s'] * 1e3:.2f} ms")
        for form, v in s.get("forms_gpu", {}).items():
            print(f"  GPU time, {form:16s} held out: median {v['median_rel']:.1%} p99 {v['p99_rel']:.1%}")
    if args.out:
        Path(args.out).write_text(json.dumps({**provenance(), "config": {"runs": args.runs}, "figures": report},
                                             indent=1))


if __name__ == "__main__":
    main()

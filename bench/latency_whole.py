"""Offline: a ``bench/coserve_latency.py`` run replayed whole by one latency model, by segment.

A run with ``--warm-replays`` (``first_call.sh``'s ``latency_warm``) has three segments in one
step table, all priced by one model as it went: the busy replay from the calibration (``cold``),
the replay with the trainer idle (``idle``) and the busy replay again (``warm``). This replays the
table from its calibration step by step (``latency_fit.py``'s ``after`` model, this commit's
switches: set ``COSERVE_*`` in the environment for an A/B), with the host's idle poll
(``CoServer.poll``, which refits the sets put off) before each step whose recorded ``gap_s`` is
at least ``--poll-gap`` (the host polls only when the engine has no request at all: 5 ms, the
replay's idle wait, reproduces the device's polls), and reports per segment and key the
relative error's median and p99, beside what the device's model predicted (``recorded``), with
``cold`` also by halves; and the busy decode steps' measured / predicted by where the trainer was
(``busy_decode_by_spot``: its ``latency.SPOTS`` spot, else its phase).

    PYTHONPATH=src python bench/latency_whole.py RUN.json.xz [RUN2 ...] --out OUT.json

``--calibration-add KEY:TERM:SECONDS`` (repeatable): that much added to a term of the recorded
calibration before the replay (e.g. ``decode/graph:b_decodes:6e-5``: a per-row host cost the
calibration sweep, which times the forward and the sampler but not the step's output work, did
not see). Each run's figures carry the coefficients its model ended with (``end_coefficients``:
what the online refits made of the calibration).

``--decode-kv FORM`` (a table that records ``decode_kv_max``): steps' decode KV regressor
replaced, ``total`` by the recorded total, ``rows_longest`` by the model's form of that name
(``latency.longest_kv``: the total plus ``--decode-kv-share`` of the rows' excess at the longest
row's length; the run's own form and share where it records them), ``split_longest`` by the longest row's keys
per program of the decode kernel at the 8B shape (its KV over the kernel's split count for the
graph of that many rows, times 33: the total for one length over one or two rows, where the count
is 33 / rows; below it for more rows, the count rounding up). The calibration's ``e_kv`` is kept.

``--ending-after N``: the model's ``ending_after`` (``COSERVE_PHASE_AFTER_STEPS`` by default; 500
until session 35; ``none``: never), the busy steps before a decode key prices its ``ending`` and
``loss`` phases apart.

``--warm-from OTHER``: each run replayed by the model that replayed OTHER whole first (its whole
state, windows and levels: a server restarted with ``--latency-state``), to tell the model's
first minutes from the system's: per segment, also each quarter's busy decode p99 and the 5th /
95th percentile of measured / predicted (the steps' spread under the model).

``--busy-from OTHER``: each run replayed from its own calibration but with the decode busy terms
(``(ρ, δ)`` of every trainer phase) that the model replaying OTHER whole ended with, as calibration
and prior: what a busy calibration sweep at start-up could give at best (the same host's terms,
from minutes of serving), to tell a cold start's busy terms from its levels and its system.

``--host-stall-ms MS``: each segment also without the steps whose host time ran more than MS over
its key's median (``without_host_stalls``: the same figures and how many steps were left out; a
step's host time is its enqueue, the step table's ``enqueue_s``, plus its measured time past its
GPU time, ``measured_s - gpu_s``, where the table has that), to tell a host that took the engine's
CPU away (session 37's H100 host: idle decode steps' host time after their GPU work a p99 of
3.6-4.6 ms against 1.0 ms on session 36's, their enqueue 2.2-2.8 ms against 0.7 ms, with or
without the trainer) from the model's error. A diagnostic: the goal is stated over all steps.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from coserve.bench.provenance import provenance
from coserve.bench.result_file import read_result
from coserve.core.latency import (
    DECODE_KV_SHARE,
    PHASE_AFTER_STEPS,
    TERMS,
    LatencyModel,
    error_summary,
    longest_kv,
)
from coserve.layers.triton_attention import decode_splits

sys.path.insert(0, str(Path(__file__).parent))
import latency_fit as lf  # noqa: E402  (the scripts beside this one)
import latency_warm as lw  # noqa: E402


def segments(path: str, kept: int) -> dict[str, tuple[int, int]]:
    """``name -> (first, end)`` of the run's segments, in rows of its measured steps (``kept``)."""
    figures = read_result(path)["figures"]
    rows = figures["steps"]["rows"]
    index = [i for i, r in enumerate(rows) if r[2] > 0]

    def at(row: int | None) -> int | None:
        return None if row is None else next((j for j, i in enumerate(index) if i >= row), kept)

    idle = at((figures.get("latency_model_error_trainer_idle") or {}).get("first_step"))
    warm = at(figures.get("warm_first_step"))
    cold_end = idle if idle is not None else warm if warm is not None else kept
    out = {"cold": (0, cold_end), "cold_first_half": (0, cold_end // 2), "cold_second_half": (cold_end // 2, cold_end)}
    if idle is not None:
        out["idle"] = (idle, warm if warm is not None else kept)
    if warm is not None:
        out["warm"] = (warm, kept)
    return out


KV_MAX = 15  # the step table's decode_kv_max column (coserve.bench.runners.STEP_TABLE_COLUMNS)
ENQUEUE_S, GPU_S = 10, 12  # ... and its enqueue_s and gpu_s columns


def _decode_rows(row: list[Any], key: str, regressors: list[float]) -> int:
    """A step's decode rows as its attention runs them: a decode step's bucket (its graph), a
    prefill step's own rows (eager attention)."""
    return int(regressors[0]) if key.startswith("decode/") else int(row[lw.DECODES])


def rows_longest(share: float) -> Callable[[list[Any], str, list[float]], float]:
    """``COSERVE_DECODE_KV=rows_longest`` at ``share`` (``latency.longest_kv``) from a table row."""
    def form(row: list[Any], key: str, regressors: list[float]) -> float:
        kv = regressors[TERMS[key.split("/")[0]].index("e_kv")]
        return longest_kv(_decode_rows(row, key, regressors), kv, float(row[KV_MAX]), share)
    return form


def _split_longest(row: list[Any], key: str, regressors: list[float]) -> float:
    rows, longest = _decode_rows(row, key, regressors), int(row[KV_MAX])
    # (a graph was captured at the longest context; eager attention splits by the step's own)
    context = 1 << 20 if key == "decode/graph" else longest
    return longest * 33 / decode_splits(rows, 8, context, 132) if rows else 0.0


DECODE_KV_FORMS = ("total", "rows_longest", "split_longest")


def decode_kv_form(path: str, table: lw.Table,
                   args: argparse.Namespace) -> Callable[[list[Any], str, list[float]], float] | None:
    """The decode KV regressor a run is replayed in (``--decode-kv``, else the run's own form and
    share; None: the recorded total)."""
    config = read_result(path).get("config", {})
    form = args.decode_kv or config.get("decode_kv", "total")
    share = args.decode_kv_share if args.decode_kv_share is not None else config.get("decode_kv_share",
                                                                                     DECODE_KV_SHARE)
    decode_kv = {"total": None, "rows_longest": rows_longest(share), "split_longest": _split_longest}[form]
    if decode_kv is not None and not all(len(s) > KV_MAX and s[KV_MAX] is not None for s in table.steps):
        raise SystemExit(f"{path}: --decode-kv needs the step table's decode_kv_max column (coserve_latency.py since session 33)")
    return decode_kv


def replayed_whole(path: str, args: argparse.Namespace, ending_after: int | None,
                   poll: float | None) -> LatencyModel:
    """The model that replayed ``path``'s table whole from its calibration, in its decode KV form
    (``--warm-from``'s and ``--busy-from``'s; before session 36 they replayed the recorded total)."""
    table = lw.Table(path)
    model = table.model(busy_with_idle=True)
    model.ending_after = ending_after
    lw.replay(model, table.steps, poll, decode_kv_form(path, table, args))
    return model


def host_stalled(steps: list[list[Any]], over_s: float) -> np.ndarray:
    """``--host-stall-ms``: which steps' host time ran more than ``over_s`` over their key's median
    (module docstring; a step without ``enqueue_s``: never)."""
    host = np.full(len(steps), np.nan)
    for i, s in enumerate(steps):
        if s[ENQUEUE_S] is not None:
            host[i] = s[ENQUEUE_S] + (s[2] - s[GPU_S] if s[GPU_S] is not None else 0.0)
    out = np.zeros(len(steps), dtype=bool)
    for key in {s[0] for s in steps}:
        idx = np.asarray([i for i, s in enumerate(steps) if s[0] == key and np.isfinite(host[i])], dtype=np.int64)
        if len(idx):
            out[idx] = host[idx] - np.median(host[idx]) > over_s
    return out


def segment_errors(steps: list[list[Any]], lo: int, hi: int, measured: np.ndarray,
                   sources: dict[str, np.ndarray], leave_out: np.ndarray) -> dict[str, Any]:
    """Steps ``[lo, hi)`` but those ``leave_out`` marks: per key (and ``all``, keys of 20 steps
    or more) each source's predictions' relative error."""
    part: dict[str, Any] = {}
    for key in ["all", *sorted({s[0] for s in steps[lo:hi]})]:
        idx = [i for i in range(lo, hi) if (key == "all" or steps[i][0] == key) and not leave_out[i]]
        if len(idx) < 20:
            continue
        part[key] = {src: error_summary((np.abs(pred[idx] - measured[idx]) / measured[idx]).tolist())._asdict()
                     for src, pred in sources.items()}
    return part


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="bench/coserve_latency.py result files")
    p.add_argument("--poll-gap", type=float, default=0.005,
                   help="poll before a step after this much idle host time, s (a negative value: never)")
    p.add_argument("--warm-from", default=None, help="a result file replayed first by the same model")
    p.add_argument("--busy-from", default=None,
                   help="a result file whose whole replay's decode busy terms the runs start from")
    p.add_argument("--calibration-add", action="append", default=[], metavar="KEY:TERM:SECONDS",
                   help="add to a term of the recorded calibration before the replay")
    p.add_argument("--decode-kv", choices=DECODE_KV_FORMS, default=None,
                   help="steps' decode KV regressor (from the longest row: tables with decode_kv_max; "
                        "default: the run's own, COSERVE_DECODE_KV, total for a run that does not say)")
    p.add_argument("--decode-kv-share", type=float, default=None,
                   help="rows_longest's share (default: the run's own, else COSERVE_DECODE_KV_SHARE)")
    p.add_argument("--ending-after", default=None,
                   help="LatencyModel.ending_after: busy steps before a decode key's ending and loss phases "
                        "are sets of their own (an integer, or none: never; default COSERVE_PHASE_AFTER_STEPS)")
    p.add_argument("--host-stall-ms", type=float, default=None,
                   help="also report each segment without the steps whose host enqueue took longer")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    poll = None if args.poll_gap < 0 else args.poll_gap
    ending_after = (PHASE_AFTER_STEPS if args.ending_after is None
                    else None if args.ending_after == "none" else int(args.ending_after))
    report = {}
    adds = []
    for spec in args.calibration_add:
        key, term, value = spec.split(":")
        form = key.split("/")[0]
        if form not in TERMS or term not in TERMS[form]:
            p.error(f"--calibration-add {spec}: no term {term!r} in {key!r}")
        adds.append((key, TERMS[form].index(term), float(value)))
    # (the donor's terms once: its replay is the same for every run)
    busy_terms = None if not args.busy_from else {
        k: v for k, v in replayed_whole(args.busy_from, args, ending_after, poll).state_dict(online=False)["busy"].items()
        if k.startswith("decode/")}
    for path in args.runs:
        table = lw.Table(path)
        for key, i, value in adds:
            table.calibration = {**table.calibration,
                                 key: [c + value if j == i else c for j, c in enumerate(table.calibration[key])]}
        if args.warm_from:
            model = replayed_whole(args.warm_from, args, ending_after, poll)
        else:
            model = table.model(busy_with_idle=True)
            model.ending_after = ending_after
        if busy_terms is not None:
            state = model.state_dict(online=False)
            model.load_state_dict({**state, "busy": {**state["busy"], **busy_terms},
                                   "calibration_busy": {**state["calibration_busy"], **busy_terms}})
        predicted = lw.replay(model, table.steps, poll, decode_kv_form(path, table, args))
        phases = lf.replay_phases(table.steps)
        measured = np.asarray([s[2] for s in table.steps])
        recorded = np.asarray([s[1] for s in table.steps])
        entry: dict[str, Any] = {"end_coefficients": model.state_dict(online=False)["coefficients"],
                                 "end_busy": model.state_dict(online=False)["busy"],
                                 "calibration": {k: list(v) for k, v in table.calibration.items()}}
        stalled = np.zeros(len(table.steps), dtype=bool)
        if args.host_stall_ms is not None:
            stalled = host_stalled(table.steps, args.host_stall_ms / 1e3)
        sources = {"replay": predicted, "recorded": recorded}
        for name, (lo, hi) in segments(path, len(table.steps)).items():
            part = segment_errors(table.steps, lo, hi, measured, sources, np.zeros(len(table.steps), dtype=bool))
            if args.host_stall_ms is not None:
                part["without_host_stalls"] = {"left_out": int(stalled[lo:hi].sum()),
                                               **segment_errors(table.steps, lo, hi, measured, sources, stalled)}
            busy = [i for i in range(lo, hi) if table.steps[i][0] == "decode/graph/busy"]
            # the busy decode steps by where the trainer was (latency.SPOTS; else its phase)
            by_spot: dict[str, list[float]] = {}
            for i in busy:
                by_spot.setdefault(lf.row_spot(table.steps[i]) or phases[i], []).append(measured[i] / predicted[i])
            part["busy_decode_by_spot"] = {
                name: {"n": len(r), "ratio_median": float(np.median(r)),
                       "over_10pct": float(np.mean(np.abs(np.asarray(r) - 1.0) > 0.1))}
                for name, r in sorted(by_spot.items())}
            if len(busy) >= 80:
                ratio = measured[busy] / predicted[busy]
                part["busy_decode_quarters"] = [
                    {"p99_rel": float(np.quantile(np.abs(q - 1.0), 0.99)),
                     "ratio_p5": float(np.quantile(q, 0.05)), "ratio_p95": float(np.quantile(q, 0.95)), "n": len(q)}
                    for q in np.array_split(ratio, 4)]
            entry[name] = part
        report[table.name] = entry
        print(table.name)
        for name, part in entry.items():
            if name in ("end_coefficients", "end_busy", "calibration"):
                continue
            print(f"  {name:17s} " + "  ".join(
                f"{k} {v['replay']['p99_rel'] * 100:.1f}% (recorded {v['recorded']['p99_rel'] * 100:.1f})"
                for k, v in part.items() if k == "all" or "/graph/" in k and "replay" in v)
                + ("  quarters " + " ".join(f"{q['p99_rel'] * 100:.1f}" for q in part["busy_decode_quarters"])
                   if "busy_decode_quarters" in part else ""))
            if "without_host_stalls" in part:
                rest = part["without_host_stalls"]
                print(f"  {'':17s} without {rest['left_out']} host-stalled steps: " + "  ".join(
                    f"{k} {v['replay']['p99_rel'] * 100:.1f}% (recorded {v['recorded']['p99_rel'] * 100:.1f})"
                    for k, v in rest.items() if k == "all" or "/graph/" in k and isinstance(v, dict)))
    if args.out:
        record = {**provenance(), "config": {"runs": args.runs, "poll_gap_s": poll, "warm_from": args.warm_from,
                                             "busy_from": args.busy_from,
                                             "calibration_add": args.calibration_add, "decode_kv": args.decode_kv,
                                             "decode_kv_share": args.decode_kv_share,
                                             "ending_after": ending_after, "host_stall_ms": args.host_stall_ms},
                  "figures": report}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

"""Offline: the latency model warm-started from another run, against the same run from its calibration.

A server restarted with ``--latency-state`` (or the next fine-tuning job of ``--finetune-jobs``)
starts from the state the run before saved; since session 32 that state carries the online part
(windows, levels: ``LatencyModel.state_dict``), so the restarted model goes on as the one that
kept running. This replays recorded step tables (``bench/coserve_latency.py``'s) to see what that
is worth: for each pair ``A B``, table B replayed

- ``cold``: from B's own calibration (what the run did; ``bench/latency_fit.py``'s ``replay``,
  model ``after``);
- ``warm``: by the model that replayed all of table A first (from A's calibration), as a server
  that had served A's run and restarted with its state would;
- ``warm_stale_busy``: ``warm`` with ``LatencyModel(busy_with_idle=False)``, the model before
  session 32, whose busy sets kept a slowdown fitted against the idle form before an idle refit.

Per key of B: the relative error's median and p99 over all its steps and over each half. Refits
are put off to the cap as ``CoServer`` puts them off (no idle poll), as ``latency_fit.py``'s
replay does.

    PYTHONPATH=src python bench/latency_warm.py A.json.gz B.json.gz [C.json.gz D.json.gz ...] \\
        --out bench/results/latency_h100/session32/latency_warm.json
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
from coserve.bench.runners import row_lone, row_mix
from coserve.core.latency import LatencyModel, error_summary, with_decode_kv

sys.path.insert(0, str(Path(__file__).parent))
import latency_fit as lf  # noqa: E402  (the script beside this one)


class Table:
    """One recorded run: its steps (those with a measured time), calibration and buckets."""

    def __init__(self, path: str) -> None:
        result = read_result(path)
        tables = lf.step_tables(result, None)
        if len(tables) != 1:
            raise SystemExit(f"{path}: expected one step table (bench/coserve_latency.py), found {len(tables)}")
        self.name = Path(path).name
        self.steps = [r for r in next(iter(tables.values())) if r[2] > 0]
        self.buckets = lf.PREFILL_BUCKETS if result.get("config", {}).get("prefill_graphs") else None
        recorded = lf.replay_phases(self.steps, lf.recorded_phases(result))
        self.calibration = lf.recover(self.steps, lf._replay_model(lf.GRAPH_SIZES, self.buckets), recorded,
                                      lf.recorded_calibration(result)).calibration

    def model(self, busy_with_idle: bool) -> LatencyModel:
        """``latency_fit.py``'s ``after`` model from this table's calibration."""
        model = lf._replay_model(lf.GRAPH_SIZES, self.buckets)
        model.busy_with_idle = busy_with_idle
        model.load_state_dict({**LatencyModel().state_dict(online=False), "coefficients": self.calibration,
                               "calibration": self.calibration})
        return model


GAP_S = 13  # the step table's gap_s column (coserve.bench.runners.STEP_TABLE_COLUMNS)
DECODES = 8  # its decodes column


def replay(model: LatencyModel, steps: list[list[Any]], poll_gap_s: float | None = None,
           decode_kv: Callable[[list[Any], str, list[float]], float] | None = None) -> np.ndarray:
    """Each step's prediction by ``model`` before it observes the step (``latency_fit.replay``'s
    loop); with ``poll_gap_s``, the host's idle poll (``CoServer.poll``: the refits put off run)
    before each step whose recorded ``gap_s`` is at least that (None: never, this script's
    replay). ``decode_kv``: a step's decode KV regressor (``e_kv``'s) from its table row, key
    and bucketed regressors, in place of the recorded total, for steps with decode rows (an
    offline form)."""
    out = []
    for row, phase in zip(steps, lf.replay_phases(steps), strict=True):
        gap = row[GAP_S] if len(row) > GAP_S else None
        if poll_gap_s is not None and gap is not None and gap >= poll_gap_s:
            model.refit_due()
        key, measured, vec, planned = row[0], row[2], row[3], lf.planned(row)
        base, busy = key.rsplit("/", 1)
        regressors = model.bucketed(lf.current_regressors(base, vec), base)
        if decode_kv is not None and row[DECODES]:
            regressors = with_decode_kv(base, regressors, decode_kv(row, base, list(regressors)))
        state = phase if busy == "busy" else "idle"
        out.append(model.observe_regressors(base, regressors, measured - planned, state, row_lone(row),
                                            lf.row_spot(row), row_mix(row)) + planned)
    return np.asarray(out)


def errors(steps: list[list[Any]], predicted: np.ndarray) -> dict[str, Any]:
    """Per key: the error over all its steps and over each half (``n`` steps)."""
    measured = np.asarray([s[2] for s in steps])
    rel = np.abs(predicted - measured) / measured
    out = {}
    for key in sorted({s[0] for s in steps}):
        e = rel[[i for i, s in enumerate(steps) if s[0] == key]]
        if len(e) < 20:
            continue
        half = len(e) // 2
        out[key] = {name: error_summary(part.tolist())._asdict()
                    for name, part in (("all", e), ("first_half", e[:half]), ("second_half", e[half:]))}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pairs", nargs="+", help="result files A B [A B ...]: B replayed after A")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if len(args.pairs) % 2:
        p.error("give the result files in pairs: A B (table B warm-started from a replay of A)")
    report = {}
    for a_path, b_path in zip(args.pairs[::2], args.pairs[1::2], strict=True):
        a, b = Table(a_path), Table(b_path)
        entry = {"cold": errors(b.steps, replay(b.model(True), b.steps))}
        for form, with_idle in (("warm", True), ("warm_stale_busy", False)):
            model = a.model(with_idle)
            replay(model, a.steps)
            entry[form] = errors(b.steps, replay(model, b.steps))
        report[f"{b.name} after {a.name}"] = entry
        for form, got in entry.items():
            print(f"{b.name} after {a.name} {form:16s} " + "  ".join(
                f"{k} p99 {v['all']['p99_rel'] * 100:.1f}% (halves {v['first_half']['p99_rel'] * 100:.1f} / "
                f"{v['second_half']['p99_rel'] * 100:.1f})" for k, v in got.items() if "/graph/" in k))
    if args.out:
        record = {**provenance(), "config": {"pairs": args.pairs}, "figures": report}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

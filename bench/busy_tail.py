"""Where the trainer was beside the busy decode steps the latency model missed, run by run.

Reads the step tables of ``bench/coserve_latency.py`` results (``figures.steps``) and counts the
``decode/graph/busy`` steps, and those whose relative error ``|predicted − measured| / measured``
is over ``--over``, by the trainer's position as the step began (``trainer_at``): ``none`` (no
position recorded), the task's ``start`` or ``commit``, ``layer``, or, beside the loss, the role
of its stretch (``loss:logits``, ``loss:cross_entropy``, ``loss:gradient``: the loss boundary's
ordinal through :func:`coserve.trainer.backward.loss_stretch_roles` for the run's loss switches,
``--gemm-pieces``; ``--split-loss 0`` for runs before the split loss). Session 42 asked it of its
A/B of the fused cross-entropy: whether the fewer misses with it were beside the cross-entropy.

    python bench/busy_tail.py bench/results/latency_h100/session42/coserve_latency_*.json.xz --out tail.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import coserve.trainer.backward as backward
from coserve.bench.provenance import provenance
from coserve.bench.result_file import read_result
from coserve.bench.shapes import SHAPES
from coserve.trainer.stream_gate import boundary_kind

BUSY_DECODE = "decode/graph/busy"


def place(at: list[int] | None, num_layers: int, roles: tuple[str, ...]) -> str:
    """The trainer position ``at`` (``[layer, ordinal]`` or None) as a group name."""
    if not at:
        return "none"
    layer, ordinal = at
    kind = boundary_kind(layer, ordinal, num_layers)
    if kind == "loss":
        return f"loss:{roles[ordinal % len(roles)]}"
    return "layer" if kind.startswith("layer") else kind


def busy_tail(result: dict[str, Any], over: float, num_layers: int, roles: tuple[str, ...]) -> dict[str, Any]:
    """``{group: {"steps", "over", "under_predicted"}}`` of one result's busy decode steps, with
    ``"all"`` over every group."""
    steps = result["figures"]["steps"]
    ix = {c: i for i, c in enumerate(steps["columns"])}
    counts: dict[str, Counter[str]] = {}
    for row in steps["rows"]:
        if row[ix["key"]] != BUSY_DECODE:
            continue
        predicted, measured = row[ix["predicted_s"]], row[ix["measured_s"]]
        group = place(row[ix["trainer_at"]], num_layers, roles)
        missed = measured > 0 and abs(predicted - measured) / measured > over
        for name in (group, "all"):
            c = counts.setdefault(name, Counter())
            c["steps"] += 1
            c["over"] += missed
            c["under_predicted"] += missed and measured > predicted
    return {k: dict(v) for k, v in sorted(counts.items())}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+")
    p.add_argument("--over", type=float, default=0.10, help="relative error that counts as a miss")
    p.add_argument("--gemm-pieces", type=int, default=backward.LOSS_GEMM_PIECES)
    p.add_argument("--split-loss", type=int, choices=(0, 1), default=int(backward.LOSS_SPLIT))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    out: dict[str, Any] = {}
    for path in args.results:
        result = read_result(path)
        shape = SHAPES.get(result.get("config", {}).get("shape", ""))
        if shape is None:
            sys.exit(f"{path}: its shape {result.get('config', {}).get('shape')!r} is not one of {sorted(SHAPES)}")
        roles = backward.loss_stretch_roles(shape["vocab_size"], shape["hidden_size"], split=bool(args.split_loss),
                                            pieces=args.gemm_pieces)
        out[Path(path).name] = got = busy_tail(result, args.over, shape["num_hidden_layers"], roles)
        print(Path(path).name)
        for group, c in got.items():
            print(f"  {group:>20} {c['over']:>5} of {c['steps']:>5} over {args.over:.0%}"
                  f" ({c['under_predicted']} under-predicted)")
    if args.out:
        Path(args.out).write_text(json.dumps({**provenance(), "config": vars(args), "figures": out}, indent=1))


if __name__ == "__main__":
    main()

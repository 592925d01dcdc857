"""What `bench/first_call.sh` measured, in one page: the figures the issues' goals name.

Reads the folder the call's archive unpacks to (``first/``) and prints, for each file it finds:
the GPU tests' status, FT-only throughput against the peft loops (issue 4), the LoRA overhead
without and with the shrink forked onto a side stream and of every other LoRA job, with the LoRA
profiles (issue 3), the decode and prefill grid against the hardware
floors (issue 3), the trace replay against transformers (issue 3), the SLO machinery
(issue 5, with each latency run's ``host_check``: whether its host was quiet enough for its p99s
to be the model's), and eager steps' host and device time without and with the prefill graphs.
Missing files are named, not fatal.

    tar -xzf first.tar.gz -C /tmp && python bench/first_call_report.py /tmp/first [--out report.json]
    python bench/first_call_report.py --host-check RUN.json.xz [RUN2 ...] [--out host_check.json]
    python bench/first_call_report.py --table REPORT.json [REPORT2.json ...]   # the latency runs side by side
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from coserve.bench.provenance import provenance
from coserve.bench.result_file import read_result


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return read_result(path)
    except (OSError, ValueError):
        return None


def gpu_tests(verify: Path) -> dict[str, Any] | None:
    text = (verify / "verify.txt").read_text() if (verify / "verify.txt").exists() else None
    if text is None:
        return None
    rc = re.search(r"gpu tests rc=(\d+)", text)
    log = (verify / "gpu_tests.txt").read_text() if (verify / "gpu_tests.txt").exists() else ""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    # pytest's closing line ("1 failed, 302 passed, 2 skipped in 60.1s"), else its progress lines
    # (result letters followed by their "[ 42%]": an assertion's "E   ..." line is not one)
    summary = re.search(r"^=*\s*(\d+ (?:passed|failed|errors?|skipped)[^\n]*) in [\d.]+s", log, re.MULTILINE)
    if summary:
        for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", summary.group(1)):
            counts["errors" if word.startswith("error") else word] = int(n)
    else:
        progress = "".join(line.split("[")[0].strip() for line in log.splitlines()
                           if re.fullmatch(r"[.sFEx]+\s*\[\s*\d+%\]", line.strip()))
        counts = {"passed": progress.count("."), "failed": progress.count("F"), "errors": progress.count("E"),
                  "skipped": progress.count("s")}
    return {"rc": int(rc.group(1)) if rc else None, **counts}


def ft_throughput(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for row in result["figures"]["rows"]:
        coserve = row.get("coserve", {}).get("tokens_per_s")
        peft_gc = row.get("peft_gc", {}).get("tokens_per_s")
        rows.append({"seq_len": row["seq_len"], "coserve": coserve, "peft_gc": peft_gc,
                     "peft_no_gc": row.get("peft_no_gc", {}).get("tokens_per_s"),
                     "coserve_over_peft_gc": coserve / peft_gc if coserve and peft_gc else None,
                     "fraction_of_matmul_rate": row.get("coserve", {}).get("fraction_of_matmul_rate")})
    return rows


def engine_grid(result: dict[str, Any]) -> dict[str, Any]:
    f = result["figures"]
    return {
        "decode_replay_over_floor": {f"b{r['batch']}_ctx{r['context']}": r["replay_over_floor"]
                                     for r in f.get("decode", [])},
        "prefill_fraction_of_matmul_rate": {str(r["tokens"]): r["fraction_of_matmul_rate"]
                                            for r in f.get("prefill", [])},
        "lora_overhead": f.get("lora_overhead"),
    }


def trace_vs_hf(ours: dict[str, Any] | None, peer: dict[str, Any] | None) -> dict[str, Any] | None:
    if ours is None or peer is None:
        return None
    a, b = ours["figures"]["coserve"], peer["figures"]["transformers"]
    keys = ("output_tokens_per_s", "ttft_p99_ms", "tpot_p99_ms", "finished", "requests")
    return {"coserve": {k: a.get(k) for k in keys}, "transformers": {k: b.get(k) for k in keys},
            "throughput_ratio": a["output_tokens_per_s"] / b["output_tokens_per_s"]
            if b.get("output_tokens_per_s") else None,
            "ttft_p99_lower": a["ttft_p99_ms"] < b["ttft_p99_ms"]}


def slo_machinery(result: dict[str, Any]) -> dict[str, Any]:
    f = result["figures"]
    steps = before_warm(f.get("steps"), f.get("warm_first_step"))
    return {"latency_model_error": f["latency_model_error"],
            "latency_model_error_trainer_idle": f.get("latency_model_error_trainer_idle"),
            "trainer_pause": f["trainer_pause"],
            "trainer_spans": f.get("trainer_spans"), "ft_only_interruption": f["ft_only_interruption"],
            "latency_model_error_warm": f.get("latency_model_error_warm"),
            "replay": f["replay"], "prefill_error_by_size": prefill_error_by_size(steps),
            "noise_floor": noise_floor(steps), "host_check": host_check(f.get("steps"))}


QUIET_HOST_AFTER_GPU_P99_MS = 2.0
"""``host_check``'s bound: an idle decode step's host time after its GPU work, 99th percentile,
above which a host is called noisy. The H100 hosts of sessions 33-36 (trainer-idle decode p99
5.3-7.0%) had 0.6-1.2 ms in their eight ``latency_warm`` runs; session 37's (20.8-25.2%) 3.6-4.6 ms
(``bench/results/latency_h100/README.md``, "Session 37")."""


def host_check(steps: dict[str, Any] | None) -> dict[str, Any] | None:
    """Whether the run's host was quiet, from its idle decode steps (the trainer-idle replay's, a
    run's only steps that neither the trainer nor a prefill slows): the 50th / 99th percentile of
    their host enqueue and of their time past their GPU work, in ms, and ``noisy`` where the
    latter's 99th percentile is above :data:`QUIET_HOST_AFTER_GPU_P99_MS`: such a host's p99
    errors are its own, not the model's (session 37); with ``host_cpu``, :func:`host_cpus`. None
    without such steps or ``gpu_s``."""
    if not steps or "gpu_s" not in steps["columns"]:
        return None
    col = {c: i for i, c in enumerate(steps["columns"])}
    rows = [r for r in steps["rows"] if r[0] == "decode/graph/idle" and r[col["measured_s"]] > 0
            and r[col["gpu_s"]] is not None and r[col["enqueue_s"]] is not None]
    if len(rows) < 100:
        return None
    after = np.asarray([r[col["measured_s"]] - r[col["gpu_s"]] for r in rows]) * 1e3
    enqueue = np.asarray([r[col["enqueue_s"]] for r in rows]) * 1e3
    p99 = float(np.quantile(after, 0.99))
    out = {"steps": len(rows), "after_gpu_p50_ms": float(np.median(after)), "after_gpu_p99_ms": p99,
           "enqueue_p50_ms": float(np.median(enqueue)), "enqueue_p99_ms": float(np.quantile(enqueue, 0.99)),
           "noisy": p99 > QUIET_HOST_AFTER_GPU_P99_MS}
    if "host_cpu" in col:
        out.update(host_cpus(steps["rows"], col["host_cpu"]))
    return out


def host_cpus(rows: list[list[Any]], column: int) -> dict[str, Any]:
    """Over all steps of a table with ``host_cpu`` (since session 38): how many CPUs the engine's
    thread ended its steps on, and the share of steps that ended on another CPU than the one
    before: whether the thread moved between CPUs, which a host that runs the same step slower in
    stretches could be."""
    cpus = [r[column] for r in rows if len(r) > column and r[column] is not None]
    moved = sum(1 for a, b in zip(cpus, cpus[1:], strict=False) if a != b)
    return {"host_cpus": len(set(cpus)), "host_cpu_changes": moved / (len(cpus) - 1) if len(cpus) > 1 else None}


def before_warm(steps: dict[str, Any] | None, first_warm: int | None) -> dict[str, Any] | None:
    """The step table without the warm replays' rows (``--warm-replays``), so that each key's
    halves are the first run's, as in a table without them."""
    if not steps or first_warm is None:
        return steps
    return {**steps, "rows": steps["rows"][:first_warm]}


def noise_floor(steps: dict[str, Any] | None) -> dict[str, Any] | None:
    """Per step key with enough steps, the held-out p99 of the recorded predictions and of
    ``bench/latency_noise_floor.py``'s oracles, and the spread inside each trainer position:
    whether a p99 above the goal is the model's or the steps' own; ``host_part`` and ``by_gap``
    where the table has ``gpu_s`` and ``gap_s``."""
    if not steps:
        return None
    by_key: dict[str, list[list[Any]]] = {}
    for row in steps["rows"]:
        by_key.setdefault(row[0], []).append(row)
    out = {}
    for key, rows in sorted(by_key.items()):
        if len(rows) >= 100:
            floor = _NOISE_FLOOR.floor_of(rows, 0.5)
            out[key] = {**{form: e["p99_rel"] for form, e in floor.items() if "p99_rel" in e},
                        "spread_p99_by_position": {g: w["spread_p99"] for g, w in floor["within_position"].items()},
                        "host_part": floor.get("host_part"), "by_gap": floor.get("by_gap")}
    return out


def prefill_error_by_size(steps: dict[str, Any] | None) -> dict[str, Any] | None:
    """The online latency model's error of each prefill set (eager, graph) by step size and FT
    rows (``bench/latency_fit.py``'s ``by_size``): where each set's error is."""
    if not steps:
        return None
    by_key: dict[str, list[list[Any]]] = {}
    for key, predicted, measured, vec, *_ in steps["rows"]:
        if key.startswith("prefill/") and measured > 0:
            by_key.setdefault(key, []).append([predicted, measured, vec])
    return {key: _LATENCY_FIT._by_size(rows) for key, rows in sorted(by_key.items())}


def _load_module(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_LATENCY_FIT = _load_module("latency_fit")
_NOISE_FLOOR = _load_module("latency_noise_floor")


def lora_variant(result: dict[str, Any]) -> dict[str, Any]:
    """One LoRA job's overhead and, where the prefill was interleaved, its per-round ratios."""
    f = result["figures"]
    return {"lora_overhead": f.get("lora_overhead"),
            "prefill_round_ratios": {str(r["tokens"]): {k: r[k] for k in ("ratio_median", "ratio_min", "ratio_max",
                                                                           "modes") if k in r}
                                     for r in f.get("lora_prefill_ab", [])}}


def lora_kernels(result: dict[str, Any]) -> dict[str, Any]:
    """bench/lora_kernels.py: per step size, µs of GPU time for one decoder layer's four linears
    summed: the base GEMMs, each shrink setting (``split:block_k:warps`` as asked, 0 = the
    engine's), each expand setting (``waves``, accumulating or storing), and the baseline's."""
    out: dict[str, Any] = {}
    for case in result["figures"]["cases"]:
        t = out.setdefault(str(case["tokens"]), {"gemm": 0.0, "shrink": {}, "expand": {}, "baseline": {}})
        t["gemm"] += case["base_gemm_ms"] * 1e3
        for sh in case["shrink"]:
            key = f"{sh['split']}:{sh['block_k']}:{sh['warps']}"
            t["shrink"][key] = t["shrink"].get(key, 0.0) + sh["ms"] * 1e3
        for ex in case["expand"]:
            key = f"waves{ex['waves']}/{'accumulate' if ex['accumulate'] else 'store'}"
            t["expand"][key] = t["expand"].get(key, 0.0) + ex["ms"] * 1e3
        for key in ("shrink_ms", "expand_accumulate_ms"):
            if key in case.get("baseline", {}):
                t["baseline"][key[:-3]] = t["baseline"].get(key[:-3], 0.0) + case["baseline"][key] * 1e3
    return out


def lora_profile(result: dict[str, Any]) -> dict[str, Any]:
    """bench/profile_lora.py: per step, base and LoRA GPU time, the LoRA kernels', the GPU's idle."""
    f = result["figures"]
    return {"base_ms": f["base"]["ms_per_step"], "lora_ms": f["lora"]["ms_per_step"],
            "lora_kernels_ms": f["lora_minus_base"]["by_lora_kernel_ms_per_step"],
            "idle_ms": {c: (f[c].get("gpu_idle") or {}).get("idle_ms_per_step") for c in ("base", "lora")},
            "expand_first": result.get("config", {}).get("expand_first")}


def eager_steps(off: dict[str, Any] | None, on: dict[str, Any] | None) -> dict[str, Any] | None:
    if off is None or on is None:
        return None
    a, b = off["figures"]["conditions"]["idle"], on["figures"]["conditions"]["idle"]
    return {shape: {"eager_step_ms": a[shape]["step_s"] * 1e3, "graphs_step_ms": b[shape]["step_s"] * 1e3,
                    "eager_enqueue_ms": a[shape]["enqueue_s"] * 1e3, "graphs_enqueue_ms": b[shape]["enqueue_s"] * 1e3}
            for shape in a if shape in b}


def trainer_attention(result: dict[str, Any]) -> dict[str, Any]:
    """bench/profile_trainer_cpu.py (the trainer_attn job): which attention ran, host and GPU ms
    per layer part, aten ops, and the loss (implementations must agree on it)."""
    f = result["figures"]
    return {"attention": f.get("attention"), "host_ms": f["mean_host_ms"], "gpu_ms": f.get("mean_gpu_ms"),
            "aten_ops": f["mean_aten_ops"], "loss_sum": f["loss_sum"], "hold_too_short": f.get("hold_too_short")}


def report(folder: Path) -> dict[str, Any]:
    verify = folder / "verify"
    out: dict[str, Any] = {"missing": []}

    def need(path: Path) -> dict[str, Any] | None:
        got = _load(path)
        if got is None:
            out["missing"].append(str(path.relative_to(folder)))
        return got

    out["gpu_tests"] = gpu_tests(verify)
    ft = need(verify / "ft_throughput.json")
    out["ft_throughput"] = ft_throughput(ft) if ft else None
    grid = need(folder / "engine_speed.json")
    out["engine_speed"] = engine_grid(grid) if grid else None
    lora = need(verify / "engine_lora.json")
    out["lora_overhead"] = lora["figures"].get("lora_overhead") if lora else None
    nofork = need(folder / "engine_lora_nofork.json")
    out["lora_overhead_nofork"] = nofork["figures"].get("lora_overhead") if nofork else None
    out["trace_vs_hf"] = trace_vs_hf(need(folder / "trace_vs_hf_coserve.json"),
                                     need(folder / "trace_vs_hf_transformers.json"))
    # the other LoRA jobs (lora_split=N, lora_expand_first, lora_tile=N, lora_mid...), when run
    out["lora_variants"] = {p.stem: lora_variant(r) for p in sorted(folder.glob("engine_lora_*.json"))
                            if p.stem != "engine_lora_nofork" and (r := _load(p)) is not None}
    out["lora_profile"] = {p.stem: lora_profile(r) for p in sorted(folder.glob("profile_lora_*.json"))
                           if (r := _load(p)) is not None}
    kernels = _load(folder / "lora_kernels.json")
    out["lora_kernels_us_per_layer"] = lora_kernels(kernels) if kernels else None
    slo = need(verify / "coserve_latency.json")
    out["slo_machinery"] = slo_machinery(slo) if slo else None
    # latency=N jobs (another SM share)
    out["slo_machinery_other"] = {p.stem: slo_machinery(r) for p in sorted(folder.glob("coserve_latency_*.json"))
                                  if (r := _load(p)) is not None}
    # trainer_attn: the trainer's attention by COSERVE_VARLEN_ATTN value
    out["trainer_attention"] = {p.stem.removeprefix("trainer_attn_"): trainer_attention(r)
                                for p in sorted(folder.glob("trainer_attn_*.json")) if (r := _load(p)) is not None}
    # split_check: the split baseline's step by attention implementation and MPS share
    out["split_check"] = {p.stem.removeprefix("split_check_"): split_check(r)
                          for p in sorted(folder.glob("split_check_*.json")) if (r := _load(p)) is not None}
    # skinny_mm: the LoRA path's bf16 tall-skinny matmuls under an MPS share (bench/skinny_mm_check.py)
    out["skinny_mm"] = {p.stem.removeprefix("skinny_mm_"): skinny_mm(r)
                        for p in sorted(folder.glob("skinny_mm_*.json")) if (r := _load(p)) is not None}
    out["eager_steps"] = eager_steps(need(folder / "eager_cpu_off.json"), need(folder / "eager_cpu_on.json"))
    # trainer_stretches: the trainer's stretches at the 8B shape by host clock, and a boundary's calls
    out["trainer_stretches"] = {p.stem.removeprefix("trainer_stretches_"): trainer_stretches(r)
                                for p in sorted(folder.glob("trainer_stretches_*.json")) if (r := _load(p)) is not None}
    gate = _load(folder / "trainer_gate_cost.json")
    out["trainer_gate_cost_us"] = gate["figures"]["us_per_call"] if gate else None
    ce = _load(folder / "loss_ce.json")
    out["loss_ce"] = loss_ce(ce) if ce else None
    spread = _load(folder / "eager_spread.json")
    out["eager_spread"] = eager_spread(spread) if spread else None
    return out


def eager_spread(r: dict[str, Any]) -> dict[str, Any]:
    """bench/eager_cpu.py (the eager_spread job): per condition and step shape, the host's ms
    queuing the step, p10 / median / p90 / p99, and the thread's CPU ms (median): how much a lone
    engine's host time for one step varies."""
    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1e3, 2)

    return {cond: {shape: {"enqueue_ms": [ms(f.get("enqueue_p10_s")), ms(f["enqueue_s"]), ms(f.get("enqueue_p90_s")),
                                          ms(f.get("enqueue_p99_s"))],
                           "enqueue_cpu_ms": ms(f.get("enqueue_cpu_s")), "step_ms": ms(f["step_s"]),
                           "canary_ms": [ms(f.get("canary_p10_s")), ms(f.get("canary_s")), ms(f.get("canary_p90_s"))],
                           "canary_corr": f.get("canary_corr")}
                   for shape, f in shapes.items()}
            for cond, shapes in r["figures"]["conditions"].items()}


def loss_ce(r: dict[str, Any]) -> dict[str, Any]:
    """bench/loss_ce.py (the loss_ce job): a loss chunk's cross-entropy stretch (its last) and the
    whole chunk, median GPU ms, by the torch chain and fused, and how far the fused loss and
    gradient lie from the chain's."""
    f = r["figures"]
    return {"cross_entropy_ms": {k: f[k]["stretch_p50_ms"][-1] for k in ("chain", "fused")},
            "chunk_ms": {k: f[k]["chunk_p50_ms"] for k in ("chain", "fused")},
            "ce_speedup": f["ce_speedup"], "loss_rel_diff": f["loss_rel_diff"], "grad_rel_diff": f["grad_rel_diff"]}


def trainer_stretches(r: dict[str, Any], top: int = 5) -> dict[str, Any]:
    """bench/profile_trainer_cpu.py (the trainer_stretches job): per stretch of a layer, its name,
    the mean host and GPU ms over the layers, and with ``--trace`` the ``top`` ops by self host
    µs of the traced layer's stretch and the range's own (outside any op)."""
    f = r["figures"]
    names = f.get("stretch_names", {})
    gpu = f.get("mean_gpu_ms") or {}
    traced = f.get("trace") or {}
    out: dict[str, Any] = {"clock": r["config"].get("clock"), "stretches": {}}
    for part, host in f["mean_host_ms"].items():
        entry: dict[str, Any] = {"name": names.get(part, ""), "host_ms": host, "gpu_ms": gpu.get(part),
                                 "aten_ops": f["mean_aten_ops"].get(part)}
        if part in traced:
            t = traced[part]
            entry["trace_self_us"] = t["self_us"]
            entry["trace_top_ops_us"] = dict(list(t["top_ops_self_us"].items())[:top])
        out["stretches"][part] = entry
    return out


def skinny_mm(r: dict[str, Any]) -> dict[str, Any]:
    """bench/skinny_mm_check.py: per setting, the calls of each product whose output held a
    non-finite value, out of ``calls``, at the share the check ran at."""
    figures = r["figures"]
    return {"share": r["config"].get("mps_active_thread_percentage"), "sms": r["device"].get("sms"),
            "calls": next(iter(figures.values()))["iters"] if figures else 0,
            "non_finite": {setting: f["non_finite"] for setting, f in figures.items()}}


def split_check(r: dict[str, Any]) -> dict[str, Any]:
    """bench/split_step_check.py: whether each bf16 step's loss and gradient were finite, the
    gradient's error against fp32, and where a NaN first showed (forward layer, backward op)."""
    steps = r["figures"]["bf16"]
    return {
        "impl": r["config"].get("impl"),
        "finite": all(s["grad_finite"] and s["loss_rel"] is not None for s in steps),
        "grad_rel": [s["grad_rel"] for s in steps],
        "first_nonfinite_layer_input": [s.get("first_nonfinite_layer_input", s.get("first_nonfinite_layer_output")) for s in steps],
        "anomaly": next((s["anomaly"] for s in steps if s.get("anomaly")), None),
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _errors(e: dict[str, Any] | list[dict[str, Any]] | None, key: str) -> str:
    if isinstance(e, list):  # (latency_model_error_warm: one entry a warm replay)
        return "; ".join(_errors(one, key) for one in e) or "-"
    v = (e or {}).get(key)
    return "-" if not isinstance(v, dict) else f"{_pct(v.get('median_rel'))} / {_pct(v.get('p99_rel'))}"


def _loss_stretches(spans: dict[str, Any]) -> str:
    """The loss's stretches' GPU p99 over all of them, and the ordinal with the highest p99 among
    those of 20 stretches or more (``trainer_spans.loss_by_ordinal``, since session 41)."""
    by = {k: v for k, v in spans["loss_by_ordinal"].items() if v["n"] >= 20}
    whole = _ms(spans["by_start"]["loss"]["p99_ms"])
    if not by:
        return f"{whole} / -"
    worst = max(by, key=lambda k: by[k]["p99_ms"])
    return f"{whole} / {_ms(by[worst]['p99_ms'])} ({worst})"


LOSS_ROLES = ("logits", "cross_entropy", "gradient")
"""The loss stretches' roles the table shows (``trainer_spans.loss_by_role``, since session 42)."""


def _loss_roles(spans: dict[str, Any]) -> str:
    """Each loss stretch role's GPU p50 / p99 (``trainer_spans.loss_by_role``), in
    :data:`LOSS_ROLES`' order, ``-`` where a run has none."""
    by = spans.get("loss_by_role") or {}
    if not by:
        return "-"
    return " ; ".join(f"{_ms(by[r]['p50_ms'])} / {_ms(by[r]['p99_ms'])}" if r in by else "-" for r in LOSS_ROLES)


def slo_table(reports: dict[str, dict[str, Any]]) -> str:
    """The issue-5 figures of every latency run in ``reports`` (name -> a report as :func:`report`
    writes it), one column a run, as a Markdown table: the goal's figures (the model's cold and
    trainer-idle error, the pause delay, an arriving request's delay in an FT-only step), then
    attainment, FT tokens/s and ``host_check``, so that a session's A/B reads at a glance."""
    runs: dict[str, dict[str, Any]] = {}
    for name, rep in reports.items():
        if rep.get("slo_machinery"):
            runs[f"{name}: (default)"] = rep["slo_machinery"]
        for stem, run in (rep.get("slo_machinery_other") or {}).items():
            runs[f"{name}: {stem.removeprefix('coserve_latency_')}"] = run
    if len(reports) == 1:
        runs = {k.split(": ", 1)[1]: v for k, v in runs.items()}
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, get: Any) -> None:
        cells = []
        for run in runs.values():
            try:
                cells.append(get(run))
            except (KeyError, TypeError):
                cells.append("-")
        rows.append((label, cells))

    cold = "latency_model_error"
    idle = "latency_model_error_trainer_idle"
    row("cold, all steps: median / p99 (3% / 10%)", lambda r: _errors(r[cold], "all"))
    row("cold, busy decode", lambda r: _errors(r[cold], "decode/graph/busy"))
    row("cold, prefill (graph)", lambda r: _errors(r[cold], "prefill/graph/idle"))
    row("cold, prefill (eager)", lambda r: _errors(r[cold], "prefill/eager/idle"))
    row("trainer idle, all steps", lambda r: _errors(r[idle], "all"))
    row("trainer idle, decode", lambda r: _errors(r[idle], "decode/graph/idle"))
    row("trainer idle, prefill (graph)", lambda r: _errors(r[idle], "prefill/graph/idle"))
    row("trainer idle, prefill (eager)", lambda r: _errors(r[idle], "prefill/eager/idle"))
    row("warm, all steps", lambda r: _errors(r.get("latency_model_error_warm"), "all"))
    row("pause p50 / p99 / max, ms (p99 2 ms)", lambda r: " / ".join(
        _ms(r["trainer_pause"].get(k)) for k in ("delay_p50_ms", "delay_p99_ms", "delay_max_ms")))
    row("pause at the loss's / the layers' boundaries, p50 / p99 ms", lambda r: " ; ".join(
        f"{_ms(r['trainer_pause']['by_boundary'][k]['delay_p50_ms'])} / {_ms(r['trainer_pause']['by_boundary'][k]['delay_p99_ms'])}"
        for k in ("loss", "layer")))
    row("loss stretches' GPU p99, ms: all / longest ordinal (its ordinal)", lambda r: _loss_stretches(r["trainer_spans"]))
    row("loss stretches' GPU p50 / p99, ms: logits ; cross-entropy ; gradient",
        lambda r: _loss_roles(r["trainer_spans"]))
    row("stretch 0 of the first layer after the loss / of the others: GPU p99, CPU p99 / max ms",
        lambda r: " ; ".join(
            f"{_ms(g['0']['p99_ms'])}, {_ms(g['0']['cpu_p99_ms'])} / {_ms(g['0']['cpu_max_ms'])}"
            for g in (r["trainer_spans"]["first_layer_by_ordinal"], r["trainer_spans"]["other_layers_by_ordinal"])))
    row("pause window's step, measured / predicted median: paused / unpaused in a task", lambda r: " / ".join(
        f"{r['trainer_pause']['step_ratio_by_window'][k]['median']:.3f}" if k in r["trainer_pause"]["step_ratio_by_window"]
        else "-" for k in ("paused", "unpaused_in_task")))
    row("pause windows / not paused within the step (of them in a task)", lambda r: (
        f"{r['trainer_pause']['windows']} / {r['trainer_pause']['not_paused_within_step']}"
        + (f" ({r['trainer_pause']['not_paused_by_trainer_at_start']['in_task']})"
           if "not_paused_by_trainer_at_start" in r["trainer_pause"] else "")))
    row("FT-only arrivals: probes in one / p99 ms / one layer + 1 ms", lambda r: (
        f"{r['ft_only_interruption']['probe']['during_ft_only']} of {r['ft_only_interruption']['probe']['requests']}"
        f" / {_ms(r['ft_only_interruption']['probe'].get('delay_p99_ms'))}"
        f" / {_ms(r['ft_only_interruption']['one_layer_ms'] + 1.0)}"))
    row("attainment (requests)", lambda r: f"{_pct(r['replay']['attainment'])} ({r['replay']['requests']:.0f})")
    row("FT tokens/s", lambda r: f"{r['replay']['ft_tokens_per_s']:,.0f}")
    row("host: idle decode past GPU p99, ms (quiet < 2)", lambda r: (
        f"{_ms(r['host_check']['after_gpu_p99_ms'])}{' (noisy)' if r['host_check']['noisy'] else ''}"))
    row("host: enqueue p99, ms", lambda r: _ms(r["host_check"]["enqueue_p99_ms"]))
    lines = ["| figure | " + " | ".join(f"`{n}`" for n in runs) + " |",
             "| --- |" + " --- |" * len(runs)]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path, nargs="?", help="the unpacked first/ folder")
    p.add_argument("--host-check", type=Path, nargs="+", default=None, metavar="RUN",
                   help="instead, the host_check of these bench/coserve_latency.py result files")
    p.add_argument("--table", type=Path, nargs="+", default=None, metavar="REPORT",
                   help="instead, the latency runs of these reports (--out files) side by side, as Markdown")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.table:
        print(slo_table({f"{path.parent.name}/{path.stem}": json.loads(path.read_text()) for path in args.table}))
        return
    if args.host_check:
        got = {"host_check": {path.name: host_check(read_result(path)["figures"].get("steps"))
                              for path in args.host_check}}
    elif args.folder is None:
        p.error("give the unpacked first/ folder, or --host-check RUN...")
    else:
        got = report(args.folder)
    print(json.dumps(got, indent=1))
    if args.out is not None:  # (the reading's own commit and command; each run's are in its file)
        args.out.write_text(json.dumps({**provenance(), **got}, indent=1))


if __name__ == "__main__":
    main()

"""``coserve bench`` end to end on CPU: the tiny model, a few seconds of a scaled-down synthetic
burst, every configuration on the same arrivals, the JSON result, the table and the plots."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from coserve.bench.configs import CONFIGS, RunKind
from coserve.bench.harness import BenchSpec, bracket_rate, run_bench
from coserve.bench.plots import MISSING, write_plots
from coserve.bench.report import markdown_table
from coserve.bench.runners import RUNNERS
from coserve.core.admission import Reason
from coserve.server.cli import main

ARGS = [
    "bench",
    "--workload",
    "burst-light",
    "--duration",
    "2",
    "--rate-scale",
    "0.05",
    "--length-scale",
    "0.1",
    "--configs",
    ",".join([*CONFIGS, "naive-32", "split-30"]),
    "--model",
    "tiny",
    "--device",
    "cpu",
    "--max-num-batched-tokens",
    "128",
    "--ttft-slo-ms",
    "500",
    "--tpot-slo-ms",
    "50",
    "--ft-lengths",
    "spread:16-48",
    "--ft-samples",
    "48",
    "--backward-tokens",
    "64",
    "--grad-accum",
    "2",
    "--threads",
    "1",
    "--trainer-threads",
    "1",
    "--warmup-requests",
    "2",
    "--burn-in",
    "1",
    "--drain",
    "10",
]


def _no_nan(token: str) -> float:
    raise AssertionError(f"non-finite number {token} in the JSON result")


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("bench")
    assert main([*ARGS, "--out", str(out)]) == 0
    return out, json.loads((out / "burst-light.json").read_text(), parse_constant=_no_nan)


def test_every_configuration_runs_on_the_same_arrivals(
    bench_run: tuple[Path, dict[str, Any]],
) -> None:
    _, result = bench_run
    figures = result["figures"]
    assert list(figures) == [*CONFIGS, "naive-32", "split-30"]  # the reference first, then as asked
    requests = result["config"]["workload"]["requests"]
    assert requests > 0
    for name, f in figures.items():
        assert f["requests"] == requests, name
        assert 0.0 <= f["attainment_abs"] <= 1.0 and 0.0 <= f["attainment_rel"] <= 1.0, name
        assert len(f["per_request"]["arrival_s"]) == requests
        assert f["latency"]["ttft_p99_ms"] >= f["latency"]["ttft_p50_ms"] > 0
        tl = f["timeline"]
        assert len(tl["t_s"]) == len(tl["ft_tokens_per_s"]) == len(tl["attainment_abs"]) >= 1
        assert f["gpu_utilization"] is None and f["gpu_clock_mhz"] is None  # CPU
        assert tl["gpu_utilization"] == [] and tl["gpu_clock_mhz"] == []  # no samples either
        assert f["cuda_allocator"] is None
        assert f["profile"] is None
        steps = f["engine_steps"]
        assert steps["columns"][1:3] == ["kind", "mode"] and steps["rows"], name
        assert all(r[1] in ("inference", "mixed", "ft-only", "ft-only-interrupted") and r[3] + r[4] + r[10] > 0 and r[5] > 0
                   for r in steps["rows"])
        assert all((r[10] > 0) == (r[1] != "inference") for r in steps["rows"]), name
        # the parts of a step: scheduling and the forward's enqueue within it; no GPU time on CPU
        assert all(0 <= r[6] and 0 < r[7] and r[6] + r[7] <= r[5] and r[8] is None for r in steps["rows"])
        assert all(r[9] == 0 for r in steps["rows"] if r[3] == 0)  # no chunk, no chunk context
        assert {r[1] for r in steps["rows"]} >= {"inference"}, name
    for name in ("inference", "inference-last"):
        assert figures[name]["ft_tokens"] == 0 and figures[name]["latency_model_error"] is None
    assert list(figures)[-3] == "inference-last"
    # the baselines at their own setting: recorded, and the naive one held to its 32 FT tokens
    assert result["config"]["configs"]["naive-32"]["naive_tokens"] == 32
    assert result["config"]["configs"]["split-30"]["split_mps_percentage"] == 30
    assert figures["naive-32"]["ft_tokens"] > 0 and figures["split-30"]["ft_tokens"] > 0
    naive_rows = figures["naive-32"]["steps"]["rows"]
    assert any(r[3][2] > 0 for r in naive_rows) and all(r[3][2] <= 32 for r in naive_rows if r[0].startswith("prefill"))
    for name in ("temporal", "full", "full-noint", "full-overlap", "naive", "split"):
        assert figures[name]["ft_tokens"] > 0 and figures[name]["optimizer_steps"] > 0, name
        window = result["config"]["workload"]["duration_s"]
        assert figures[name]["ft_tokens_per_s_run"] == pytest.approx(
            figures[name]["ft_tokens"] / figures[name]["duration_s"])
        assert 0 < figures[name]["ft_tokens_per_s"] * window <= figures[name]["ft_tokens"]  # (the window alone)
    for name in ("temporal", "full", "full-noint", "full-overlap", "naive"):
        assert figures[name]["latency_model_error"]["all"]["n"] > 0, name
        tasks = figures[name]["backward_tasks"]
        # two tasks per optimizer step, each of at least --backward-tokens tokens
        assert tasks["tasks"] >= 2 * figures[name]["optimizer_steps"] - 1 and tasks["tokens"] >= 64, name
        assert tasks["turnaround_s"] >= tasks["trainer_s"] > 0, name
        assert 0 <= tasks["paused_s"] <= tasks["trainer_s"], name
        assert tasks["gpu_wait_s"] == 0.0, name  # CPU: no GPU to wait for
        assert 0 < tasks["cpu_s"] <= tasks["trainer_s"] * 1.05 + 0.01, name
        rows = figures[name]["steps"]["rows"]
        assert len(rows) == figures[name]["latency_model_error"]["all"]["n"], name
        assert all(r[0].split("/")[0] in ("prefill", "decode") and r[2] > 0 and r[3] for r in rows)
        # prefill chunks and FT rows: FT-only steps have FT rows and no chunk
        assert all(len(r[4]) == 2 and min(r[4]) >= 0 for r in rows)
        assert any(r[4][1] > 0 for r in rows), name
        # where the trainer's GPU was: only the GPU-side gate reports it
        assert figures[name]["steps"]["columns"][5] == "trainer_at" and all(r[5] is None for r in rows)
        # each chunk's (tokens, context), the decode rows, and the engine's host parts of the step
        cols = figures[name]["steps"]["columns"]
        chunks, decodes, sched, enq = (cols.index(c) for c in ("chunks", "decodes", "schedule_s", "enqueue_s"))
        assert all(len(r[chunks]) == r[4][0] and all(n > 0 and c >= 0 for n, c in r[chunks]) for r in rows)
        assert all(r[decodes] >= 0 for r in rows) and any(r[decodes] > 0 for r in rows), name
        # (a prefill-form step's token regressor counts its chunks, FT rows and decode rows)
        assert all(r[3][1] >= sum(n for n, _ in r[chunks]) + r[decodes] for r in rows if r[0].startswith("prefill"))
        assert all(0 <= r[sched] and 0 < r[enq] and r[sched] + r[enq] <= r[2] * 1.05 + 1e-3 for r in rows
                   if not r[6]), name
        # why each planned step did or did not take FT rows: every step that ran FT rows was
        # "added"; the reasons are admission's own labels
        admission = figures[name]["admission"]
        kinds = {k.split(":")[0] for k in admission}
        assert kinds <= {"inference", "ft-only"} and all(n > 0 for n in admission.values()), name
        added = admission.get("inference:added", 0) + admission.get("ft-only:added", 0)
        assert added >= sum(1 for r in figures[name]["steps"]["rows"] if r[4][1] > 0), name
        labels = {str(r) for r in Reason} | {"added", "task_full", "arrival"}
        assert {k.split(":")[1] for k in admission} <= labels, name
    assert result["config"]["ft"]["grad_accum"] == 2 and result["config"]["burn_in_s"] == 1.0
    for name, f in figures.items():
        spent = f["step_seconds"]
        assert 0 < sum(spent.values()) <= f["duration_s"] + 1e-6, name
        assert set(f["step_counts"]) <= set(spent), name
    # the prefill-graph configurations: asked for, but there are no CUDA graphs on the CPU
    configs = result["config"]["configs"]
    assert configs["full-graphs"]["prefill_graphs"] is True and configs["full-eager"]["prefill_graphs"] is False
    assert configs["full"]["prefill_graphs"] is True  # as the engine was started (the default)
    assert all(f["prefill_graphs"] is False for f in figures.values())
    assert "ft-only" in figures["temporal"]["step_counts"]
    assert "ft-only" not in figures["inference"]["step_counts"]
    assert figures["split"]["latency_model_error"] is None


def test_result_records_provenance_reference_and_comparisons(
    bench_run: tuple[Path, dict[str, Any]],
) -> None:
    _, result = bench_run
    assert {"commit", "dirty", "device", "versions", "command"} <= set(result)
    cfg = result["config"]
    assert cfg["workload"]["scaling"] == {
        "rate": 0.05,
        "length": 0.1,
        "max_prompt": 1536,  # --max-prompt 4096 clipped to the tiny model's 2,048-token context less 512
        "max_output": 512,
    }
    assert (cfg["slo"]["ttft_ms"], cfg["slo"]["tpot_ms"], cfg["slo"]["relative_factor"]) == (
        500,
        50,
        3,
    )
    assert cfg["ft"]["naive_tokens"] == 256 and cfg["ft"]["lengths"] == "spread:16-48"
    assert {n: c["pause_prefill"] for n, c in cfg["configs"].items() if c["kind"] == "coserve"} == {
        "temporal": "always", "full": "always", "full-noint": "always", "full-overlap": "model",
        "full-graphs": "always", "full-eager": "always", "naive": "always", "naive-32": "always",
        "full-hold": "always",
    }
    assert result["figures"]["full-overlap"]["pause_prefill"] == "model"
    assert [n for n, c in cfg["configs"].items() if c.get("hold_pause")] == ["full-hold"]
    assert result["figures"]["full-hold"]["hold_pause"] and not result["figures"]["full"]["hold_pause"]
    ref = result["reference"]
    assert ref["relative_ttft_slo_ms"] == pytest.approx(3 * ref["mean_ttft_ms"])
    assert result["calibration"]["batches"] > 0
    comp = result["comparisons"]
    assert comp["ft_over_split"]["full"] == pytest.approx(
        result["figures"]["full"]["ft_tokens_per_s"] / result["figures"]["split"]["ft_tokens_per_s"]
    )
    assert set(comp["attainment_minus_reference_pp"]) == {*CONFIGS, "naive-32", "split-30"} - {"inference"}
    assert comp["ft_over_split-30"]["full"] == pytest.approx(
        result["figures"]["full"]["ft_tokens_per_s"] / result["figures"]["split-30"]["ft_tokens_per_s"])


def test_markdown_table_and_plots(bench_run: tuple[Path, dict[str, Any]]) -> None:
    out, result = bench_run
    table = (out / "burst-light.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r.split("|")[1].strip() for r in rows[1:]] == [*CONFIGS, "naive-32", "split-30"]
    assert "FT vs split" in rows[0] and "TTFT ≤ 500 ms" in table
    # the latency model's error over all steps: none for inference alone, median / p99 for `full`
    assert rows[0].rstrip(" |").endswith("latency model error")
    by_name = {r.split("|")[1].strip(): r.split("|")[-2].strip() for r in rows[1:]}
    every = result["figures"]["full"]["latency_model_error"]["all"]
    assert by_name["inference"] == "–"
    assert by_name["full"] == f"{every['median_rel'] * 100:.1f}% / {every['p99_rel'] * 100:.0f}%"
    pngs = sorted(p.name for p in out.glob("*.png"))
    if importlib.util.find_spec("matplotlib") is None:
        assert pngs == [] and result["outputs"]["plots_skipped"] == MISSING
    else:
        assert pngs == [f"burst-light-{k}.png" for k in ("attainment", "latency", "throughput")]
        assert result["outputs"]["plots"] and result["outputs"]["plots_skipped"] is None


def test_the_table_compares_with_a_baseline_run_at_its_own_setting(bench_run: tuple[Path, dict[str, Any]]) -> None:
    # an evaluation with `split-30` and no `split` (session 23's): the split column is split-30's
    _, result = bench_run
    figures = {n: f for n, f in result["figures"].items() if n != "split"}
    comp = {k: v for k, v in result["comparisons"].items() if k != "ft_over_split"}
    table = markdown_table({**result, "figures": figures, "comparisons": comp})
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    head = [c.strip() for c in rows[0].split("|")]
    assert "FT vs split-30" in head and "FT vs naive" in head
    full = next(r for r in rows if r.split("|")[1].strip() == "full")
    cell = [c.strip() for c in full.split("|")][head.index("FT vs split-30")]
    assert cell == f"{comp['ft_over_split-30']['full']:.2f}×"


def test_plots_skipped_with_a_message_without_matplotlib(
    bench_run: tuple[Path, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, result = bench_run
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    drawn = write_plots(result, tmp_path, "x")
    assert drawn.paths == [] and drawn.skipped == MISSING and "coserve[bench]" in MISSING
    assert list(tmp_path.iterdir()) == []


def _spec(out: Path, configs: str, **overrides: Any) -> BenchSpec:
    from coserve.server.bench_cli import add_bench_args, bench_spec

    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    args = parser.parse_args(
        [*ARGS[1:], "--duration", "1", "--configs", configs, "--out", str(out)]
    )
    return replace(bench_spec(args), plots=False, **overrides)


def test_an_out_that_cannot_be_a_directory_stops_the_benchmark_before_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--out a file ran the whole benchmark, then failed with a FileExistsError traceback where the
    result was written, and the results were lost."""
    import coserve.bench.harness as harness

    def started(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the benchmark started before --out was checked")

    monkeypatch.setattr(harness, "_setup", started)
    (tmp_path / "afile").write_text("")
    for out, message in [(tmp_path / "afile", "a file, not a directory"),
                         (tmp_path / "afile" / "sub", "cannot create the directory")]:
        assert main([*ARGS, "--out", str(out)]) == 2
        assert f"coserve bench: error: --out {out}: {message}" in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == ""


def test_a_failing_configuration_is_recorded_and_the_others_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(ctx: Any, config: Any) -> Any:
        raise RuntimeError("trainer out of memory")

    monkeypatch.setitem(RUNNERS, RunKind.SPLIT, broken)
    result, outputs = run_bench(_spec(tmp_path, "split,inference"))
    assert list(result["figures"]) == ["inference"]
    assert result["failed"] == {"split": "RuntimeError: trainer out of memory"}
    assert "split (RuntimeError: trainer out of memory)" in outputs.markdown.read_text()


def test_time_budget_skips_what_would_not_finish_but_never_the_reference(tmp_path: Path) -> None:
    result, _ = run_bench(_spec(tmp_path, "full", time_budget_s=0.01))
    assert list(result["figures"]) == ["inference"]
    assert result["skipped"]["full"].startswith("time budget")
    assert result["calibration"] is None


def test_auto_rate_runs_the_probes_and_takes_the_highest_rate_that_met(tmp_path: Path) -> None:
    """Whatever this machine's speed makes of each probe (bracket_rate's search itself is tested
    below on fixed answers): the probes start at --rate-scale, stop within --max-probes, and the
    run uses the highest probed rate that met the target, else the lowest probed."""
    args = list(ARGS)
    args[args.index("--configs") + 1] = "inference"
    args[args.index("--rate-scale") + 1] = "4"  # likely too many requests for a 1-layer-per-ms CPU
    args[args.index("--ttft-slo-ms") + 1] = "60"
    args += ["--auto-rate", "--probe-seconds", "1", "--probe-factor", "0.25", "--attainment-target", "0.9",
             "--max-probes", "4", "--out", str(tmp_path)]
    assert main(args) == 0
    result = json.loads((tmp_path / "burst-light.json").read_text(), parse_constant=_no_nan)
    probes = result["config"]["rate_probes"]
    rates = [p["rate"] for p in probes]
    assert rates[0] == 4 and 1 <= len(probes) <= 4
    met = [p["rate"] for p in probes if p["attainment"] >= 0.9]
    chosen = result["config"]["workload"]["scaling"]["rate"]
    assert chosen == (max(met) if met else min(rates))
    if not met:
        assert rates == sorted(rates, reverse=True)  # down all the way


@pytest.mark.parametrize(
    ("start", "threshold", "expected_probes", "expected"),
    [
        # met at once: step up until a rate fails, then bisect to within 1.2×
        (1.0, 3.0, [1.0, 2.0, 4.0, 2.828, 3.364], 2.828),
        # failed at once: step down until a rate meets, then bisect
        (8.0, 3.0, [8.0, 4.0, 2.0, 2.828, 3.364], 2.828),
        # never met within the probes
        (8.0, 0.1, [8.0, 4.0, 2.0], None),
        # always met: up until the probes run out
        (1.0, 100.0, [1.0, 2.0, 4.0], 4.0),
    ],
)
def test_bracket_rate_finds_the_highest_rate_that_meets(
    start: float, threshold: float, expected_probes: list[float], expected: float | None
) -> None:
    probed: list[float] = []

    def meets(rate: float) -> bool:
        probed.append(rate)
        return rate <= threshold

    got = bracket_rate(start, 0.5, len(expected_probes), 1.2, meets)
    assert probed == pytest.approx(expected_probes, rel=1e-3)
    assert (got is None and expected is None) or got == pytest.approx(expected, rel=1e-3)


def test_bracket_rate_stops_at_the_resolution() -> None:
    probed: list[float] = []

    def meets(rate: float) -> bool:
        probed.append(rate)
        return rate < 1.3

    assert bracket_rate(1.0, 0.5, 10, 1.5, meets) == 1.0
    assert probed == pytest.approx([1.0, 2.0, 1.414], rel=1e-3)  # 1.414 / 1.0 <= 1.5: done


def test_a_saved_latency_state_replaces_the_calibration(
    bench_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    out, _ = bench_run
    state = out / "burst-light-latency-state.json"
    assert state.is_file(), "every run saves its calibrated latency model"
    args = list(ARGS)
    args[args.index("--configs") + 1] = "inference,full"
    assert main([*args, "--latency-state", str(state), "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "burst-light.json").read_text(), parse_constant=_no_nan)
    assert result["calibration"]["loaded_from"] == str(state)
    assert "full" in result["figures"]


def test_profile_window_keeps_the_operator_tables(tmp_path: Path) -> None:
    result, _ = run_bench(_spec(tmp_path, "inference", profile_window=(0.0, 0.5)))
    profile = result["figures"]["inference"]["profile"]
    assert "Self CPU" in profile["self_cpu"] and "self_cuda" not in profile  # CPU: no CUDA table
    assert profile["window_s"].startswith("0.")


def test_negative_burn_in_and_bad_profile_windows_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--burn-in"):
        _spec(tmp_path, "inference", burn_in_s=-1.0)
    with pytest.raises(ValueError, match="--profile-window"):
        _spec(tmp_path, "inference", profile_window=(5.0, 2.0))
    from coserve.server.bench_cli import _window

    assert _window("2:7.5") == (2.0, 7.5) and _window(None) is None
    with pytest.raises(ValueError, match="START:END"):
        _window("2-7")


def test_baselines_at_their_own_setting_by_name() -> None:
    from coserve.bench.configs import parse_configs

    configs = parse_configs("full,split-25,naive-2048,split")
    assert [c.name for c in configs] == ["inference", "full", "split-25", "naive-2048", "split"]
    assert configs[2].split_share == 25 and configs[2].kind == "split" and configs[4].split_share is None
    assert configs[3].naive_tokens == 2048 and configs[3].policy == "naive" and not configs[3].interrupt_ft_only
    for bad in ("split-0", "split-101", "naive-x", "full-3"):
        with pytest.raises(ValueError, match="split-N"):
            parse_configs(bad)


def test_coserving_configurations_with_their_trainer_at_a_share_by_name() -> None:
    from coserve.bench.configs import parse_configs

    configs = parse_configs("full,full@50,naive-2048@30,full-overlap@100")
    assert [c.name for c in configs] == ["inference", "full", "full@50", "naive-2048@30", "full-overlap@100"]
    assert configs[1].trainer_share is None and configs[2].trainer_share == 50 and configs[2].policy == "full"
    assert configs[3].naive_tokens == 2048 and configs[3].trainer_share == 30 and configs[3].policy == "naive"
    assert configs[4].pause_prefill == "model" and "100% MPS share" in configs[4].summary
    # only co-serving configurations, one share each, 1-100
    for bad in ("split@50", "inference@50", "full@0", "full@101", "full@x", "full@50@20", "nothing@50"):
        with pytest.raises(ValueError, match="NAME@N"):
            parse_configs(bad)


def test_the_default_drain_is_as_long_as_a_request_that_meets_the_slo_can_take(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "inference")  # TTFT <= 500 ms, TPOT <= 50 ms
    spec = replace(spec, scaling=replace(spec.scaling, max_output=8))
    assert replace(spec, drain_s=None).drain_limit_s == pytest.approx(0.5 + 7 * 0.05 + 1.0)
    assert replace(spec, drain_s=3.0).drain_limit_s == 3.0


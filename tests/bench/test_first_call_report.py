"""bench/first_call_report.py on a folder laid out like first_call.sh's, from committed results."""

from __future__ import annotations

import gzip
import json
import lzma
import shutil
import sys
from pathlib import Path

import pytest

from tests.bench.scripts import load_script

ROOT = Path(__file__).parents[2]
first_call_report = load_script("first_call_report")
RESULTS = ROOT / "bench" / "results"


def copy_unzipped(src: Path, dst: Path) -> None:
    """A committed result kept gzipped or xz'd (``src`` names it without ``.gz``/``.xz``) into the
    plain file the call wrote."""
    gz, xz = src.with_name(src.name + ".gz"), src.with_name(src.name + ".xz")
    dst.write_bytes(gzip.decompress(gz.read_bytes()) if gz.exists() else lzma.decompress(xz.read_bytes()))


def test_report_reads_every_part_and_names_what_is_missing(tmp_path: Path) -> None:
    verify = tmp_path / "verify"
    verify.mkdir()
    for name in ("verify.txt", "gpu_tests.txt", "ft_throughput.json", "engine_lora.json"):
        shutil.copy(RESULTS / "verify_h200" / name, verify / name)
    copy_unzipped(RESULTS / "coserve_latency_h200.json", verify / "coserve_latency.json")
    shutil.copy(RESULTS / "engine_speed_h200.json", tmp_path / "engine_speed.json")
    for side in ("off", "on"):
        shutil.copy(RESULTS / "diagnostic" / "cudnn-profile" / "eager_cpu.json", tmp_path / f"eager_cpu_{side}.json")
    for side in ("coserve", "transformers"):
        shutil.copy(RESULTS / "engine_h200" / f"trace_vs_hf_{side}.json", tmp_path / f"trace_vs_hf_{side}.json")

    got = first_call_report.report(tmp_path)
    assert got["missing"] == ["engine_lora_nofork.json"]
    assert got["gpu_tests"] == {"rc": 0, "passed": 287, "failed": 0, "errors": 0, "skipped": 0}
    (row,) = got["ft_throughput"]
    assert row["seq_len"] == 512 and row["coserve_over_peft_gc"] == pytest.approx(10994.8 / 9230.24, rel=1e-4)
    assert got["engine_speed"]["decode_replay_over_floor"]["b1_ctx512"] == pytest.approx(1.864, rel=1e-3)
    assert got["lora_overhead"]["decode"]["1"] == pytest.approx(0.303, rel=1e-2)
    assert got["lora_overhead_nofork"] is None
    assert got["trace_vs_hf"]["throughput_ratio"] == pytest.approx(3203.08 / 59.064, rel=1e-4)
    assert got["trace_vs_hf"]["ttft_p99_lower"]
    assert got["slo_machinery"]["trainer_pause"]["delay_p99_ms"] == pytest.approx(12.63, rel=1e-3)
    shape = got["eager_steps"]["1x2048_ctx0"]
    assert shape["eager_step_ms"] == shape["graphs_step_ms"] == pytest.approx(50.67, rel=1e-3)


def test_the_loss_ce_job(tmp_path: Path) -> None:
    """Session 42's loss_ce.json: the cross-entropy stretch and the chunk by the chain and fused."""
    assert first_call_report.report(tmp_path)["loss_ce"] is None
    shutil.copy(RESULTS / "latency_h100" / "session42" / "loss_ce_fc92394.json", tmp_path / "loss_ce.json")
    got = first_call_report.report(tmp_path)["loss_ce"]
    assert got["cross_entropy_ms"]["chain"] == pytest.approx(1.3616, rel=1e-3)
    assert got["cross_entropy_ms"]["fused"] == pytest.approx(0.1694, rel=1e-3)
    assert got["chunk_ms"]["fused"] == pytest.approx(0.9199, rel=1e-3)
    assert got["ce_speedup"] == pytest.approx(8.04, rel=1e-3) and got["grad_rel_diff"] < 1e-6


def test_the_eager_spread_job(tmp_path: Path) -> None:
    """bench/eager_cpu.py's spread of one step's host time; a file from before its quantiles
    (session 6's) gives its medians alone."""
    assert first_call_report.report(tmp_path)["eager_spread"] is None
    step = {"enqueue_s": 0.021, "step_s": 0.0225, "enqueue_max_s": 0.05, "step_max_s": 0.051, "enqueue_cpu_s": 0.0209,
            "enqueue_p10_s": 0.0201, "enqueue_p90_s": 0.03, "enqueue_p99_s": 0.0456789}
    canary = {"canary_p10_s": 0.0009, "canary_s": 0.00104, "canary_p90_s": 0.00169, "canary_corr": 0.79}
    (tmp_path / "eager_spread.json").write_text(json.dumps({"figures": {"conditions": {
        "idle": {"1x96_ctx0+32d": step}, "hog": {"1x96_ctx0+32d": {**step, "enqueue_s": 0.04, **canary}}}}}))
    got = first_call_report.report(tmp_path)["eager_spread"]
    assert got["idle"]["1x96_ctx0+32d"] == {"enqueue_ms": [20.1, 21.0, 30.0, 45.68], "enqueue_cpu_ms": 20.9,
                                            "step_ms": 22.5, "canary_ms": [None, None, None], "canary_corr": None}
    hog = got["hog"]["1x96_ctx0+32d"]  # (with session 44's canary: a fixed piece of Python before each step)
    assert hog["enqueue_ms"][1] == 40.0 and hog["canary_ms"] == [0.9, 1.04, 1.69] and hog["canary_corr"] == 0.79
    old = json.loads((RESULTS / "engine_h200" / "session6" / "eager_cpu_off.json").read_text())
    shape = first_call_report.eager_spread(old)["idle"]["1x2048_ctx0"]
    assert shape["enqueue_ms"][0] is None and shape["enqueue_ms"][1] == pytest.approx(24.06, abs=0.01)


def test_gpu_test_counts_ignore_assertion_lines(tmp_path: Path) -> None:
    """A failed run's log holds "E   ..." lines of the assertion: they are no test results."""
    shutil.copy(RESULTS / "verify_h200" / "session6" / "gpu_tests_11fd828.txt", tmp_path / "gpu_tests.txt")
    (tmp_path / "verify.txt").write_text("gpu tests rc=1 after 60 s\n")
    got = first_call_report.gpu_tests(tmp_path)
    assert got == {"rc": 1, "passed": 302, "failed": 1, "errors": 0, "skipped": 0}
    (tmp_path / "gpu_tests.txt").write_text("1 failed, 302 passed, 2 skipped in 60.12s\n")
    assert first_call_report.gpu_tests(tmp_path) == {"rc": 1, "passed": 302, "failed": 1, "errors": 0, "skipped": 2}


def test_report_reads_the_lora_jobs_profiles_and_other_latency_runs(tmp_path: Path) -> None:
    """Session 7's files laid out as its calls left them: LoRA variants, profiles, latency=100."""
    verify = tmp_path / "verify"
    verify.mkdir()
    s7 = RESULTS / "engine_h200" / "session7"
    shutil.copy(s7 / "engine_lora_ab_1accf8d.json", verify / "engine_lora.json")
    shutil.copy(s7 / "engine_lora_ab_expand_first_1accf8d.json", tmp_path / "engine_lora_expand_first.json")
    shutil.copy(s7 / "profile_lora_off_1accf8d.json", tmp_path / "profile_lora_off.json")
    latency = RESULTS / "latency_h200" / "session7"
    copy_unzipped(latency / "coserve_latency_share50_8ca1c10.json", verify / "coserve_latency.json")
    copy_unzipped(latency / "coserve_latency_share100_2522fa0.json", tmp_path / "coserve_latency_share100.json")

    got = first_call_report.report(tmp_path)
    assert got["lora_overhead"]["prefill"]["4096"] == pytest.approx(0.120, abs=1e-3)
    variant = got["lora_variants"]["engine_lora_expand_first"]
    assert variant["prefill_round_ratios"]["4096"]["ratio_median"] == pytest.approx(1.153, abs=1e-3)
    profile = got["lora_profile"]["profile_lora_off"]
    assert profile["lora_kernels_ms"]["_expand_kernel"] == pytest.approx(7.33, abs=0.01)
    assert profile["idle_ms"]["lora"] == pytest.approx(9.44, abs=0.01) and profile["expand_first"] is False
    assert got["slo_machinery"]["trainer_spans"]["cpu_over_gpu"] > 0
    by_size = got["slo_machinery"]["prefill_error_by_size"]["prefill/eager/idle"]
    assert set(by_size) <= {f"{ft}/{size}" for ft in ("ft", "no_ft") for size in ("<512", "<1024", "<1800", ">=1800")}
    assert sum(b["n"] for b in by_size.values()) > 0
    floor = got["slo_machinery"]["noise_floor"]["decode/graph/busy"]
    assert floor["oracle_both"] < floor["recorded"] and floor["spread_p99_by_position"]
    other = got["slo_machinery_other"]["coserve_latency_share100"]
    assert other["trainer_pause"]["delay_p99_ms"] == pytest.approx(7.64, abs=0.01)
    assert got["lora_kernels_us_per_layer"] is None  # no lora_kernels job in that call


def test_report_sums_the_lora_kernels_per_layer(tmp_path: Path) -> None:
    """Session 8's kernel file: the four linears of a layer summed per setting (its README's table)."""
    (tmp_path / "verify").mkdir()
    shutil.copy(RESULTS / "engine_h200" / "session8" / "lora_kernels_6d3ed83.json", tmp_path / "lora_kernels.json")
    got = first_call_report.report(tmp_path)["lora_kernels_us_per_layer"]["4096"]
    assert got["gemm"] == pytest.approx(2591.2, abs=0.1)
    assert got["shrink"]["4:64:4"] == pytest.approx(62.9, abs=0.1)
    assert got["expand"]["waves8/store"] == pytest.approx(124.9, abs=0.1)
    assert got["expand"]["waves0/store"] == pytest.approx(191.4, abs=0.1)
    assert got["baseline"]["expand_accumulate"] == pytest.approx(215.9, abs=0.1)


def test_report_reads_the_trainer_attention_jobs(tmp_path: Path) -> None:
    """trainer_attn_IMPL.json per COSERVE_VARLEN_ATTN value (session 8's CPU profile as a stand-in)."""
    src = RESULTS / "trainer_cpu" / "session8" / "after_82e7c14_run1.json"
    for impl in ("torch", "flash"):
        shutil.copy(src, tmp_path / f"trainer_attn_{impl}.json")
    got = first_call_report.report(tmp_path)["trainer_attention"]
    assert set(got) == {"torch", "flash"}
    assert got["flash"]["host_ms"]["attn_fwd"] == pytest.approx(0.4788, abs=1e-4)
    assert got["torch"]["loss_sum"] == got["flash"]["loss_sum"] and got["torch"]["gpu_ms"] is None


def test_report_reads_the_split_check_jobs(tmp_path: Path) -> None:
    """split_check_IMPL_SHARE.json: session 10's 32-layer checks, one with NaN gradients."""
    src = RESULTS / "diagnostic" / "session10"
    shutil.copy(src / "split_step_flash_l32.json", tmp_path / "split_check_flash_100.json")
    shutil.copy(src / "split_step_flash_l32_mps20.json", tmp_path / "split_check_flash_20.json")
    got = first_call_report.report(tmp_path)["split_check"]
    assert got["flash_100"]["finite"] and got["flash_100"]["grad_rel"][0] == pytest.approx(0.1173, abs=1e-4)
    assert not got["flash_20"]["finite"] and got["flash_20"]["grad_rel"] == [None, None]
    assert got["flash_20"]["anomaly"] is None  # (run without --anomaly)


def test_report_reads_the_skinny_mm_check(tmp_path: Path) -> None:
    """skinny_mm_SHARE.json: session 11's check at a 20% share (cuBLAS's bf16 fault) and at 100%."""
    src = RESULTS / "diagnostic" / "session11"
    shutil.copy(src / "mm_20.json", tmp_path / "skinny_mm_20.json")
    shutil.copy(src / "mm_100.json", tmp_path / "skinny_mm_100.json")
    got = first_call_report.report(tmp_path)["skinny_mm"]
    assert got["20"]["share"] == "20" and got["20"]["sms"] == 26 and got["20"]["calls"] == 400
    assert got["20"]["non_finite"]["default"]["x@B"] == 323 and got["20"]["non_finite"]["fp32"]["x@B"] == 0
    assert all(n == 0 for f in got["100"]["non_finite"].values() for n in f.values())


def test_report_reads_the_trainer_stretches_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """trainer_stretches_CLOCK.json from bench/profile_trainer_cpu.py (run here on the CPU, with
    --trace) and trainer_gate_cost.json (bench/gate_cost.py's layout: it needs a GPU)."""
    profile = load_script("profile_trainer_cpu")
    monkeypatch.setattr(sys, "argv", ["profile_trainer_cpu.py", "--layers", "2", "--reps", "1", "--warmup", "0",
                                      "--rows", "3", "--clock", "wall", "--trace",
                                      "--json", str(tmp_path / "trainer_stretches_wall.json")])
    profile.main()
    gate = {"figures": {"us_per_call": {"gate_wait": 2.5, "events_pooled": 1.5}}}
    (tmp_path / "trainer_gate_cost.json").write_text(json.dumps(gate))
    got = first_call_report.report(tmp_path)
    wall = got["trainer_stretches"]["wall"]
    assert wall["clock"] == "wall"
    assert [e["name"] for e in wall["stretches"].values()] == list(profile.STRETCHES_UNTRAINED_MLP)
    last = wall["stretches"]["#8"]
    assert last["host_ms"] > 0 and last["gpu_ms"] is None and len(last["trace_top_ops_us"]) <= 5
    assert got["trainer_gate_cost_us"] == {"gate_wait": 2.5, "events_pooled": 1.5}



def test_report_tells_the_gpus_part_of_a_latency_run_that_timed_it(tmp_path: Path) -> None:
    """Session 28's H100 run (its step table has gpu_s, not yet gap_s): the busy decode steps'
    host part, with the recorded p99 had the host's part been constant and the GPU's part alone."""
    (tmp_path / "verify").mkdir()
    copy_unzipped(RESULTS / "latency_h100" / "session28" / "coserve_latency_share30_3cba91e.json",
                  tmp_path / "coserve_latency_share30.json")
    floor = first_call_report.report(tmp_path)["slo_machinery_other"]["coserve_latency_share30"]["noise_floor"]
    busy = floor["decode/graph/busy"]
    assert busy["recorded"] == pytest.approx(0.0945, abs=1e-3)  # (latency_h100/README.md's table)
    assert busy["host_part"]["host_constant_p99"] == pytest.approx(0.139, abs=1e-3)
    assert busy["host_part"]["gpu_alone_p99"] == pytest.approx(0.124, abs=1e-3)
    assert busy["by_gap"] is None


def test_report_tells_a_noisy_host_from_a_quiet_one(tmp_path: Path) -> None:
    """Session 36's run (a quiet H100 host) and session 37's third (a noisy one): their idle decode
    steps' host time after their GPU work, 1.0 ms against 3.6 ms at the 99th percentile."""
    (tmp_path / "verify").mkdir()
    copy_unzipped(RESULTS / "latency_h100" / "session36" / "coserve_latency_warm_b4f5e69_r2.json",
                  tmp_path / "coserve_latency_quiet.json")
    copy_unzipped(RESULTS / "latency_h100" / "session37" / "coserve_latency_8b49351_c.json",
                  tmp_path / "verify" / "coserve_latency.json")
    got = first_call_report.report(tmp_path)
    noisy, quiet = got["slo_machinery"]["host_check"], got["slo_machinery_other"]["coserve_latency_quiet"]["host_check"]
    assert noisy["noisy"] and noisy["after_gpu_p99_ms"] == pytest.approx(3.56, abs=0.01)
    assert not quiet["noisy"] and quiet["after_gpu_p99_ms"] == pytest.approx(1.04, abs=0.01)
    assert quiet["steps"] == 1718 and quiet["enqueue_p99_ms"] < noisy["enqueue_p99_ms"]
    assert first_call_report.host_check(None) is None
    assert "host_cpus" not in quiet  # (tables before session 38: no host_cpu column)


def test_host_cpus_counts_the_engines_cpus_and_its_moves() -> None:
    rows = [["decode/graph/idle", 0], ["decode/graph/idle", 0], ["decode/graph/busy", 3], ["prefill", 3],
            ["decode/graph/idle", None], ["decode/graph/idle", 0]]
    # (the step without a CPU is skipped: 0 0 3 3 0, two moves in four)
    assert first_call_report.host_cpus(rows, 1) == {"host_cpus": 2, "host_cpu_changes": 0.5}
    assert first_call_report.host_cpus([["k", 5]], 1) == {"host_cpus": 1, "host_cpu_changes": None}


def test_host_check_of_result_files_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``--host-check RUN...``: each committed run's host_check, without a first/ folder."""
    run = RESULTS / "latency_h100" / "session37" / "coserve_latency_8b49351_c.json.xz"
    out = tmp_path / "host_check.json"
    monkeypatch.setattr(sys, "argv", ["first_call_report.py", "--host-check", str(run), "--out", str(out)])
    first_call_report.main()
    capsys.readouterr()
    got = json.loads(out.read_text())
    assert got["host_check"][run.name]["noisy"] and "commit" in got and "--host-check" in got["command"]


def test_table_sets_the_latency_runs_of_reports_side_by_side() -> None:
    """Session 38's committed report and session 36's (a warm run, no host_cpu): one column a
    run, the figures as the reports hold them, '-' where a run has none."""
    s38 = json.loads((RESULTS / "latency_h100" / "session38" / "first_call_report_call1.json").read_text())
    s36 = json.loads((RESULTS / "latency_h100" / "session36" / "first_call_report_call2_r2.json").read_text())
    table = first_call_report.slo_table({"s38": s38, "s36": s36})
    lines = table.splitlines()
    assert lines[0] == "| figure | `s38: env_COSERVE_TRAINER_CLOSED_AHEAD_2` | `s36: warm` |"
    cells = {line.split(" | ")[0].removeprefix("| "): line.split(" | ")[1:] for line in lines[2:]}
    assert cells["cold, all steps: median / p99 (3% / 10%)"] == ["1.6% / 10.8%", "1.5% / 9.5% |"]
    assert cells["pause p50 / p99 / max, ms (p99 2 ms)"][0] == "0.30 / 1.59 / 4.62"
    assert cells["FT-only arrivals: probes in one / p99 ms / one layer + 1 ms"][0] == "9 of 40 / 1.55 / 1.87"
    assert cells["attainment (requests)"] == ["100.0% (522)", "100.0% (522) |"]
    assert cells["FT tokens/s"][0] == "3,252"
    assert cells["pause windows / not paused within the step (of them in a task)"][0] == "562 / 46"
    assert cells["warm, all steps"] == ["-", "1.3% / 7.4% |"]
    assert cells["cold, prefill (eager)"] == ["-", "- |"]
    # one report: the columns are its runs alone
    assert first_call_report.slo_table({"s38": s38}).splitlines()[0] == "| figure | `env_COSERVE_TRAINER_CLOSED_AHEAD_2` |"


def test_table_shows_the_pause_by_boundary_the_loss_stretches_and_the_window_steps() -> None:
    """Session 41's report (its default run and a GEMM-pieces run): the pause delay at the loss's
    and at the layers' boundaries; the fields it predates ('-'), then a run that has them."""
    s41 = json.loads((RESULTS / "latency_h100" / "session41" / "first_call_report_call4.json").read_text())
    lines = first_call_report.slo_table({"s41": s41}).splitlines()
    cells = {line.split(" | ")[0].removeprefix("| "): line.split(" | ")[1:] for line in lines[2:]}
    assert cells["pause at the loss's / the layers' boundaries, p50 / p99 ms"] == [
        "0.71 / 2.18 ; 0.25 / 2.98", "0.56 / 2.06 ; 0.24 / 1.10 |"]
    assert cells["loss stretches' GPU p99, ms: all / longest ordinal (its ordinal)"] == ["-", "- |"]
    run = s41["slo_machinery"]
    run["trainer_spans"]["loss_by_ordinal"] = {"0": {"n": 40, "p50_ms": 1.0, "p99_ms": 2.5},
                                               "2": {"n": 40, "p50_ms": 1.2, "p99_ms": 3.1},
                                               "9": {"n": 3, "p50_ms": 4.0, "p99_ms": 9.0}}  # (too few)
    run["trainer_pause"]["step_ratio_by_window"] = {"paused": {"steps": 500, "median": 1.004, "p90": 1.05},
                                                    "unpaused_in_task": {"steps": 30, "median": 0.998, "p90": 1.1}}
    lines = first_call_report.slo_table({"s41": {"slo_machinery": run}}).splitlines()
    cells = {line.split(" | ")[0].removeprefix("| "): line.split(" | ")[1:] for line in lines[2:]}
    assert cells["loss stretches' GPU p99, ms: all / longest ordinal (its ordinal)"] == ["3.58 / 3.10 (2) |"]
    assert cells["pause window's step, measured / predicted median: paused / unpaused in a task"] == ["1.004 / 0.998 |"]
    assert cells["loss stretches' GPU p50 / p99, ms: logits ; cross-entropy ; gradient"] == ["- |"]
    run["trainer_spans"]["loss_by_role"] = {"logits": {"n": 80, "p50_ms": 1.0, "p99_ms": 2.0},
                                            "gradient": {"n": 80, "p50_ms": 0.5, "p99_ms": 4.5}}
    lines = first_call_report.slo_table({"s41": {"slo_machinery": run}}).splitlines()
    cells = {line.split(" | ")[0].removeprefix("| "): line.split(" | ")[1:] for line in lines[2:]}
    assert cells["loss stretches' GPU p50 / p99, ms: logits ; cross-entropy ; gradient"] == [
        "1.00 / 2.00 ; - ; 0.50 / 4.50 |"]

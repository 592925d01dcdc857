"""bench/eval_table.py on the committed evaluations (bench/results/eval_h200: session 5's reruns, and
session 4's four workloads in its session4/ folder)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.scripts import load_script

ROOT = Path(__file__).parents[2]
eval_table = load_script("eval_table")


def test_table_and_goals_from_the_committed_evaluation() -> None:
    results = eval_table.load(ROOT / "bench" / "results" / "eval_h200" / "session4")
    assert list(results) == ["azure2023_code", "azure2023_conv", "burst-light", "burst-dense"]
    lines = eval_table.table(results).splitlines()
    assert lines[0] == "| configuration | azure2023_code ×0.15 | azure2023_conv ×0.5 | burst-light ×0.3 | burst-dense ×0.3 |"
    assert "| `full` | 100.0% · 4,216 | 100.0% · 2,458 | 100.0% · 7,103 | 100.0% · 4,753 |" in lines
    assert "| `full-noint` | not run | not run | 100.0% · 8,160 | not run |" in lines
    assert lines.index("| `inference` | 100.0% | 100.0% | 100.0% | 100.0% |") == 2
    goals = eval_table.goals(results)
    code = goals["azure2023_code"]
    assert code["attainment_minus_reference_pp"] == {"value": 0.0, "met": True}
    assert code["ft_over_split"]["value"] == pytest.approx(4216 / 8009, rel=1e-3) and not code["ft_over_split"]["met"]
    assert code["ft_over_split"]["baseline_attainment_worse"]  # split 97.3% against full's 100%
    assert code["ft_tokens_per_s"]["met"] is False
    assert "ft_tokens_per_s" not in goals["burst-light"]
    assert eval_table.goals(results, "full-overlap") == {w: {} for w in results}  # not run yet


def test_newer_folder_first_older_fills_the_rest(tmp_path: Path) -> None:
    top = ROOT / "bench" / "results" / "eval_h200"
    results = eval_table.load(top, top / "session4")
    assert list(results) == ["azure2023_code", "azure2023_conv", "burst-light", "burst-dense"]
    assert results["azure2023_code"]["commit"].startswith("7ba9ce6")  # session 5's rerun
    assert results["azure2023_conv"]["commit"].startswith("da18e05")  # session 6's
    head = eval_table.table(results).splitlines()[0]
    assert head == "| configuration | azure2023_code ×0.25 | azure2023_conv ×1.39 | burst-light ×0.833 | burst-dense ×0.5 |"
    # a newer folder with one workload: the older one fills in the other three
    (tmp_path / "azure2023_code").symlink_to(top / "azure2023_code", target_is_directory=True)
    mixed = eval_table.load(tmp_path, top / "session4")
    assert mixed["azure2023_code"]["commit"].startswith("7ba9ce6")
    assert mixed["azure2023_conv"]["commit"].startswith("a7716e0")  # session 4's
    overlap = eval_table.goals(results, "full-overlap")["azure2023_code"]
    assert overlap["ft_tokens_per_s"]["met"] and overlap["ft_tokens_per_s"]["value"] == pytest.approx(5474, abs=1)
    assert overlap["ft_over_split"]["baseline_attainment_worse"]  # split 44.0%
    assert not overlap["ft_over_naive"]["baseline_attainment_worse"]


def test_ratio_goals_compare_with_the_fastest_baseline_run_that_meets_the_attainment() -> None:
    def run(att: float, ft: float | None = None) -> dict:
        return {"attainment_abs": att, **({"ft_tokens_per_s": ft} if ft is not None else {})}

    figures = {"inference": run(1.0), "full": run(1.0, 5000.0), "split": run(0.44, 7500.0),
               "split-25": run(0.9995, 4000.0), "split-10": run(1.0, 2000.0), "naive": run(1.0, 3000.0),
               "naive-2048": run(1.0, 3600.0), "naive-4096": run(0.95, 6000.0)}
    goals = eval_table.goals({"azure2023_code": {"figures": figures}})["azure2023_code"]
    split, naive = goals["ft_over_split"], goals["ft_over_naive"]
    assert split["baseline"] == "split-25" and not split["baseline_attainment_worse"]
    assert split["value"] == pytest.approx(5000 / 4000) and not split["met"]
    assert naive["baseline"] == "naive-2048" and naive["value"] == pytest.approx(5000 / 3600)
    # no run meets it: the baseline as asked, named as worse
    del figures["split-25"], figures["split-10"]
    split = eval_table.goals({"azure2023_code": {"figures": figures}})["azure2023_code"]["ft_over_split"]
    assert split["baseline"] == "split" and split["baseline_attainment_worse"]


def test_one_evaluation_over_two_calls_is_one_table() -> None:
    """Session 12's burst-dense ran in two calls at one commit (same arrivals): the second call's
    configurations join the first's, whose reference stays; a run of another commit does not."""
    s12 = ROOT / "bench" / "results" / "eval_h200" / "session12"
    merged = eval_table.load(s12 / "call3", s12 / "call4")["burst-dense"]
    assert set(merged["figures"]) == {"inference", "full", "full-hold", "split-20", "split-30", "temporal",
                                      "full-graphs"}
    first = eval_table.load(s12 / "call3")["burst-dense"]
    assert merged["figures"]["inference"] == first["figures"]["inference"]
    split = eval_table.goals({"burst-dense": merged})["burst-dense"]["ft_over_split"]
    assert split["baseline"] == "split-30" and not split["baseline_attainment_worse"]
    assert split["value"] == pytest.approx(7392 / 4904, rel=1e-3) and split["met"]
    older = eval_table.load(s12 / "call3", ROOT / "bench" / "results" / "eval_h200" / "session11" / "call3")
    assert "naive" not in older["burst-dense"]["figures"]  # session 11's, another commit


def test_a_fine_tuning_run_that_trained_nothing_shows_0() -> None:
    # session 23's azure2023_conv: `temporal` found no step without inference work in its window
    results = eval_table.load(ROOT / "bench" / "results" / "eval_h200" / "session23")
    assert list(results) == ["azure2023_conv", "burst-light", "burst-dense"]
    lines = eval_table.table(results).splitlines()
    assert "| `temporal` | 100.0% · 0 | 100.0% · 7,104 | 100.0% · 6,357 |" in lines
    assert "| `inference` | 100.0% | 100.0% | 100.0% |" in lines
    conv = eval_table.goals(results)["azure2023_conv"]["ft_over_split"]
    assert conv["baseline"] == "split-30" and conv["baseline_attainment_worse"]  # 94.2% against 100.0%

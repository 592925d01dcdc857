"""bench/latency_fit.py: the held-out comparison picks the form that generated the steps."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from coserve.core.latency import KNEE_TOKENS
from tests.bench.scripts import load_script

latency_fit = load_script("latency_fit")


@pytest.fixture
def deferred_as_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replays with every refit deferred (``DEFER_FROM_ROWS`` 0), as the servers that recorded the
    tables until session 32 ran: a replay then reproduces such a table's predictions."""
    monkeypatch.setattr(latency_fit, "DEFER_FROM_ROWS", 0)


def _rows(floor: float) -> list[list[object]]:
    rng = random.Random(0)
    rows: list[list[object]] = []
    for _ in range(400):
        b, kv = rng.randint(1, 256), rng.randint(100, 200_000)
        t = max(floor, 2e-5 * b + 3e-8 * kv + 1e-3) * rng.uniform(0.98, 1.02)
        rows.append(["decode/eager/idle", 0.01, t, [float(b), float(kv), 1.0]])
    return rows


def test_floor_form_wins_on_launch_bound_steps_and_linear_on_linear_ones() -> None:
    bound = latency_fit.evaluate(_rows(floor=4e-3), 0.5, 0.1)["decode/eager/idle"]
    assert bound["floor"]["p99_rel"] < 0.05 < bound["linear"]["p99_rel"]
    assert bound["floor"]["median_rel"] < bound["linear"]["median_rel"]
    assert bound["online"]["median_rel"] > 0.5  # the constant 10 ms "prediction" of the rows
    linear = latency_fit.evaluate(_rows(floor=0.0), 0.5, 0.1)["decode/eager/idle"]
    assert linear["linear"]["median_rel"] < 0.05
    assert latency_fit.evaluate(_rows(0.0)[:10], 0.5, 0.1)["decode/eager/idle"]["skipped"]


def test_rows_form_finds_a_per_row_cost_the_token_sums_miss() -> None:
    """Prefill steps that pay 2 ms per chunk and 3 ms per FT row on top of a linear token cost:
    the rows form recovers both and predicts the held-out steps; the linear form cannot."""
    rng = random.Random(1)
    rows: list[list[object]] = []
    for _ in range(400):
        chunks, ft = rng.randint(1, 6), rng.randint(0, 4)
        tokens = rng.randint(64, 2048)
        t = (1e-5 * tokens + 2e-3 * chunks + 3e-3 * ft + 5e-3) * rng.uniform(0.99, 1.01)
        rows.append(["prefill/eager/idle", 0.01, t, [0.0, float(tokens), 0.0, 0.0, 0.0, 1.0], [chunks, ft]])
    got = latency_fit.evaluate(rows, 0.5, 0.1)["prefill/eager/idle"]
    assert got["rows"]["median_rel"] < 0.02 < got["linear"]["median_rel"]
    assert abs(got["rows"]["per_chunk_s"] - 2e-3) < 2e-4 and abs(got["rows"]["per_ft_row_s"] - 3e-3) < 3e-4
    old = latency_fit.evaluate([r[:4] for r in rows], 0.5, 0.1)["prefill/eager/idle"]
    assert "rows" not in old  # tables written before the rows column


def test_bucket_form_prices_the_padded_graph_batch() -> None:
    """Graph decode steps whose time follows the bucket they replay (rows padded up to 1, 2, 4,
    8, 16, 24, 32, ...): the bucket form predicts them, the linear form in the rows cannot."""
    rng = random.Random(2)
    rows: list[list[object]] = []
    for _ in range(400):
        b, kv = rng.randint(1, 40), rng.randint(100, 100_000)
        padded = latency_fit._bucket(float(b), latency_fit.GRAPH_SIZES)
        t = (1e-4 * padded + 3e-8 * kv + 5e-3) * rng.uniform(0.995, 1.005)
        rows.append(["decode/graph/idle", 0.01, t, [float(b), float(kv), 1.0]])
    got = latency_fit.evaluate(rows, 0.5, 0.1)["decode/graph/idle"]
    assert got["bucket"]["p99_rel"] < 0.02 < got["linear"]["p99_rel"]
    eager = latency_fit.evaluate(_rows(0.0), 0.5, 0.1)["decode/eager/idle"]
    assert "bucket" not in eager  # eager steps run the rows they carry


def test_busy_steps_grouped_by_what_the_trainer_ran() -> None:
    """Busy decode steps that ran 30% slow beside the trainer's MLP stretch (ordinal 1) and on
    time beside its attention (ordinal 0): the grouping shows it."""
    rng = random.Random(3)
    rows: list[list[object]] = []
    for i in range(200):
        at = [rng.randint(0, 31), i % 2]
        t = 0.01 * (1.3 if at[1] == 1 else 1.0)
        rows.append(["decode/graph/busy", 0.01, t, [8.0, 1000.0, 1.0], [0, 0], at])
    rows.append(["decode/graph/busy", 0.01, 0.011, [8.0, 1000.0, 1.0], [0, 0], None])
    evaluated = latency_fit.evaluate(rows, 0.5, 0.1)["decode/graph/busy"]
    got = evaluated["by_trainer_at"]
    assert got["layer#1"]["ratio_median"] == pytest.approx(1.3) and got["layer#0"]["ratio_median"] == pytest.approx(1.0)
    assert got["between_tasks"]["n"] == 1
    # held out: half the steps at 1.0, half at 1.3 (one at 1.1)
    ratio = evaluated["online_ratio"]
    assert ratio["p1"] == pytest.approx(1.0) and ratio["p99"] == pytest.approx(1.3)


def test_idle_steps_grouped_by_whether_the_trainer_was_in_a_task() -> None:
    """Prefill steps that began while the trainer was in a task ran 20% slow (its kernels before
    the pause), the others on time: the idle set's grouping shows it."""
    rows: list[list[object]] = []
    for i in range(100):
        at = [i % 32, 3] if i % 2 else None
        rows.append(["prefill/graph/idle", 0.02, 0.024 if at else 0.02, [1e6, 1000.0, 0.0, 0.0, 0.0, 0.0, 1.0],
                     [1, 0], at, False])
    got = latency_fit.evaluate(rows, 0.5, 0.1)["prefill/graph/idle"]
    assert "by_trainer_at" not in got
    groups = got["by_trainer_in_task"]
    assert set(groups) == {"in_task", "between_tasks"} and groups["in_task"]["n"] == 50
    assert groups["in_task"]["ratio_median"] == pytest.approx(1.2)
    assert groups["between_tasks"]["ratio_median"] == pytest.approx(1.0)


def test_prefill_steps_grouped_by_context_and_timing_path() -> None:
    """Prefill rows of the seven-column table: host-timed steps with a context chunk run 4 ms
    over a prediction that the other three groups meet; the grouping finds them, and a
    seven-column busy table still groups by the trainer's position."""
    rows: list[list[object]] = []
    for i in range(120):
        ctx, events = i % 2 == 1, i % 3 == 0
        vec = [1e6, 1000.0, 0.0, 0.0, 5e5 if ctx else 0.0, 1.0 if ctx else 0.0, 1.0]
        rows.append(["prefill/graph/idle", 0.02, 0.024 if ctx and not events else 0.02, vec, [1, 0],
                     None, events])
        rows.append(["decode/graph/busy", 0.01, 0.013 if i % 2 else 0.01, [8.0, 1000.0, 1.0], [0, 0],
                     [i % 32, i % 2], events])
    got = latency_fit.evaluate(rows, 0.5, 0.1)
    groups = got["prefill/graph/idle"]["by_context_timing"]
    assert groups["context/host"]["measured_p50_s"] == pytest.approx(0.024)
    assert groups["context/host"]["signed_median_rel"] == pytest.approx(-1 / 6)
    for name in ("context/events", "no_context/host", "no_context/events"):
        assert groups[name]["signed_median_rel"] == pytest.approx(0.0)
    assert sum(g["n"] for g in groups.values()) == 120
    by_at = got["decode/graph/busy"]["by_trainer_at"]
    assert by_at["layer#1"]["ratio_median"] == pytest.approx(1.3)


def test_replay_recovers_the_calibration_and_the_trainer_phases_win() -> None:
    """A table written as the server writes it: each step predicted by a model started from a
    known calibration (one busy set, no level) before it observed the step. The replay recovers
    that calibration, reproduces the recorded predictions (``before``), and with busy sets per
    trainer phase (decode steps beside a commit run faster) predicts the held-out steps better."""
    from coserve.core.latency import Chunk, LatencyModel, StepFeatures

    calibration = {"decode/graph": [1e-5, 3e-8, 5e-3], "prefill/eager": [1e-9, 3e-5, 5e-6, 3e-8, 2e-9, 1e-3, 6e-3]}
    server = LatencyModel(level_rate=0.0)
    server.load_state_dict({"version": 2, "coefficients": calibration, "calibration": calibration})
    server.graph_bucket = lambda n: int(latency_fit._bucket(n, latency_fit.GRAPH_SIZES))
    rng = random.Random(4)
    rows: list[list[object]] = []
    layer = 31
    for i in range(1500):
        if i % 12 == 0:
            n = rng.randint(16, 2048)
            vec = list(StepFeatures((Chunk(n),)).vector())  # (n², n, 0, 0, 0, 0, tokens over the knee, 1)
            t = (3e-5 * n + 7e-3) * rng.uniform(0.99, 1.01)
            predicted = server.observe_regressors("prefill/eager", server.bucketed(vec, "prefill/eager"), t)
            rows.append(["prefill/eager/idle", predicted, t, vec,
                         [1, 0], [layer, 0]])
            continue
        layer = layer - 1 if layer > -1 else 31
        b, kv = rng.randint(1, 64), rng.randint(100, 60_000)
        vec = [float(b), float(kv), 1.0]
        slow = 0.15 if layer == -1 else 0.6  # beside the commit (layer -1) or the layers
        t = ((1e-5 * latency_fit._bucket(b, latency_fit.GRAPH_SIZES) + 3e-8 * kv + 5e-3) * (1 + slow)
             * rng.uniform(0.99, 1.01))
        predicted = server.observe_regressors("decode/graph", server.bucketed(vec, "decode/graph"), t, "active")
        rows.append(["decode/graph/busy", predicted, t, vec, [0, 0], [layer, 0]])
    # (a server that refits as soon as due: the commit's set, one step in 33, has its own term
    # after 10 of its steps rather than 40)
    report = latency_fit.replay(rows, 0.5, latency_fit.GRAPH_SIZES, None, defer=False)
    assert report["calibration"]["decode/graph"] == pytest.approx(calibration["decode/graph"], rel=1e-3)
    # the prefill steps excite the square, the tokens and the constant; the rest stays 0
    recovered = report["calibration"]["prefill/eager"]
    assert [recovered[i] for i in (0, 1, 7)] == pytest.approx([calibration["prefill/eager"][i] for i in (0, 1, 6)],
                                                             rel=1e-3)
    # (k_over: the server's calibration had none, and its first refit learnt next to none)
    assert [recovered[i] for i in (2, 3, 4, 5)] == pytest.approx([0.0] * 4, abs=1e-12) and recovered[6] < 1e-7
    assert report["recovery"]["level_rate"] == 0.0
    decode = report["decode/graph/busy"]
    assert decode["matches_recorded"]["before"]["median_rel"] < 1e-6
    assert decode["before"]["p99_rel"] == pytest.approx(decode["recorded"]["p99_rel"], rel=1e-6)
    assert decode["after"]["p99_rel"] < 0.03 < decode["before"]["p99_rel"]
    assert decode["by_phase"]["quiet"]["after"]["median_rel"] < 0.02


@pytest.mark.usefixtures("deferred_as_recorded")
def test_a_table_recorded_before_i_ctx_is_replayed_with_the_context_constant() -> None:
    """Prefill steps through the graphs that pay 4.2 ms when a chunk has cached context, recorded
    (six regressors) by a server whose form had no such term: the replay derives i_ctx from h_ctx,
    ``before`` reproduces the recorded predictions, ``after`` learns the constant and predicts the
    held-out steps; the offline forms read the old table in this commit's terms."""
    from coserve.core.latency import LatencyModel, from_legacy_prefill

    old = [0.0, 3e-5, 0.0, 0.0, 2e-9, 5e-3]  # LEGACY_PREFILL_TERMS order
    server = LatencyModel()
    server.load_state_dict({"version": 1, "coefficients": {"prefill/graph": old}, "calibration": {"prefill/graph": old}})
    server.defer_refits, server.defer_from_rows = True, 0  # (as the servers until session 32)
    rng = random.Random(5)
    rows: list[list[object]] = []
    for _ in range(600):
        n = rng.randint(16, 2048)
        ctx = rng.choice([0, rng.randint(1, 4096)])
        vec = [float(n * n), float(n), 0.0, 0.0, float(n * ctx), 1.0]
        t = (3e-5 * n + 2e-9 * n * ctx + 4e-3 + (4.2e-3 if ctx else 0.0)) * rng.uniform(0.99, 1.01)
        # the old server: its form had no i_ctx (a 0 regressor is a form without the term)
        predicted = server.observe_regressors("prefill/graph", from_legacy_prefill(vec, 0.0), t)
        rows.append(["prefill/graph/idle", predicted, t, vec, [1, 0], None])
    first = rows[0][3]
    assert latency_fit.current_regressors("prefill/graph", first) == list(from_legacy_prefill(  # type: ignore[arg-type]
        first, 1.0 if first[4] > 0 else 0.0, max(0.0, first[1] - KNEE_TOKENS)))  # type: ignore[index, operator]
    report = latency_fit.replay(rows, 0.5, latency_fit.GRAPH_SIZES, None)
    assert len(report["calibration"]["prefill/graph"]) == 8 and report["calibration"]["prefill/graph"][5:7] == [0, 0]
    got = report["prefill/graph/idle"]
    assert got["matches_recorded"]["before"]["median_rel"] < 1e-6
    assert got["before"]["p99_rel"] == pytest.approx(got["recorded"]["p99_rel"], rel=1e-6)
    assert got["after"]["p99_rel"] < 0.03 < 0.1 < got["before"]["p99_rel"]
    assert got["context"] == got["after"]  # (no busy steps, no level on prefill sets)
    fit = latency_fit.evaluate(rows, 0.5, 0.1)["prefill/graph/idle"]
    assert fit["linear"]["context_constant_s"] == pytest.approx(4.2e-3, rel=0.05)
    assert fit["linear"]["p99_rel"] < 0.03 < fit["no_context_constant"]["p99_rel"]
    assert fit["rows"]["p99_rel"] < 0.03  # (the rows form, in this commit's terms too)


def _prefill_table(seed: int, time_of: Any, alone: float = 0.0) -> list[list[object]]:
    """Prefill steps in the eleven-column table, each predicted by a server before it observed
    the step; ``time_of(n, ctx, decodes) -> (seconds, enqueue_s)``; ``alone``: the share of steps
    with no decodes (otherwise 0-30 decodes, uniformly)."""
    from coserve.core.latency import Chunk, LatencyModel, StepFeatures

    calibration = {"prefill/eager": [0.0, 3e-5, 0.0, 0.0, 2e-9, 1e-3, 5e-3]}
    server = LatencyModel()
    server.load_state_dict({"version": 2, "coefficients": calibration, "calibration": calibration})
    rng = random.Random(seed)
    rows: list[list[object]] = []
    for _ in range(600):
        n, ctx, decodes = rng.randint(8, 1024), rng.choice([0, rng.randint(1, 4096)]), rng.randint(0, 30)
        if alone and rng.random() < alone:
            decodes = 0
        vec = list(StepFeatures((Chunk(n, ctx),), num_decodes=decodes, kv_tokens=decodes * 500).vector())
        t, enqueue = time_of(n, ctx, decodes)
        t *= rng.uniform(0.99, 1.01)
        predicted = server.observe_regressors("prefill/eager", vec, t)
        rows.append(["prefill/eager/idle", predicted, t, vec, [1, 0], None, False, [[n, ctx]], decodes, 5e-4,
                     enqueue])
    return rows


def test_prefill_forms_find_a_context_read_cost_per_chunk() -> None:
    """Steps that read each chunk's whole cached context (1 µs per context token, whatever the
    chunk's length): the context_kv form predicts the held-out steps, the model's form cannot;
    its ``after`` is the replay's."""
    rows = _prefill_table(6, lambda n, ctx, d: (3e-5 * (n + d) + 2e-9 * n * ctx + 1e-6 * ctx + 5e-3, 2e-3))
    got = latency_fit.prefill_forms(rows, 0.5, latency_fit.GRAPH_SIZES, None)["prefill/eager/idle"]
    assert got["context_kv"]["p99_rel"] < 0.03 < got["after"]["p99_rel"]
    assert got["after"] == latency_fit.replay(rows, 0.5, latency_fit.GRAPH_SIZES, None)["prefill/eager/idle"]["after"]
    summary = latency_fit.forms_summary({"t": {"prefill_forms": {"prefill/eager/idle": got}}})
    assert summary["sets"] == 1 and summary["context_kv"]["lower_p99_sets"] == 1
    assert latency_fit.prefill_forms([r[:7] for r in rows], 0.5, latency_fit.GRAPH_SIZES, None) == {}


def test_host_floor_prices_host_bound_small_steps() -> None:
    """Small steps whose host takes 9 ms + 0.2 ms per decode to queue them, ending 1 ms after
    their queuing where that is later than their GPU work: the host floor predicts them, the
    linear form cannot."""
    def time_of(n: int, ctx: int, d: int) -> tuple[float, float]:
        host = 9e-3 + 2e-4 * d
        return max(3e-5 * (n + d) + 2e-9 * n * ctx + 1e-3 * (ctx > 0) + 2e-3, host + 1e-3), host

    got = latency_fit.prefill_forms(_prefill_table(7, time_of), 0.5, latency_fit.GRAPH_SIZES, None)
    assert got["prefill/eager/idle"]["host_floor"]["p99_rel"] < 0.05 < got["prefill/eager/idle"]["after"]["p99_rel"]


def test_knee_form_prices_small_steps_that_read_the_weights_whatever_their_tokens() -> None:
    """Steps whose token-wise time has a second, flatter slope below 512 tokens (a weight read that
    sets their floor): ``knee_512`` predicts them, the linear form without the model's knee
    (``knee_tokens=0``) cannot (the model's own knee, calibrated: tests/core/test_latency.py)."""
    def time_of(n: int, ctx: int, d: int) -> tuple[float, float]:
        tokens = n + d
        return 5e-3 + 3e-5 * tokens + 2e-5 * max(0, 512 - tokens) + 2e-9 * n * ctx, 1e-3

    rows = _prefill_table(9, time_of)
    linear = latency_fit.prefill_forms(rows, 0.5, latency_fit.GRAPH_SIZES, None, knee_tokens=0)["prefill/eager/idle"]
    assert linear["knee_512"]["p99_rel"] < 0.05 < linear["after"]["p99_rel"]
    assert linear["knee_1024"]["p99_rel"] > linear["knee_512"]["p99_rel"]


def _gapped_prefill_table(seed: int, after_gap_at: Any, slower: Any, gap_s: float) -> tuple[list[list[object]], list[bool]]:
    """:func:`_prefill_table`'s steps, a fifth without decodes, with the ``gap_s`` column:
    ``after_gap_at(i, k)`` says whether step ``i`` (the ``k``-th without decodes) follows an idle
    host of ``gap_s`` (else 1e-4), ``slower(t, after_gap)`` its time from the linear one ``t``."""
    alone = iter(range(10**6))
    after_gap: list[bool] = []

    def time_of(n: int, ctx: int, d: int) -> tuple[float, float]:
        after_gap.append(d == 0 and after_gap_at(len(after_gap), next(alone)))
        return slower(3e-5 * (n + d) + 2e-9 * n * ctx + 5e-3, after_gap[-1]), 1e-3

    rows = _prefill_table(seed, time_of, alone=0.2)
    for r, gap in zip(rows, after_gap, strict=True):
        r.extend([None, None, gap_s if gap else 1e-4])
    return rows, after_gap


def test_lone_form_prices_a_prompt_alone_after_an_idle_host() -> None:
    """Steps with no decodes and no FT rows that follow an idle host (``gap_s`` ≥ 5 ms) take 3 ms
    more; the same steps back to back do not: spread through the table, ``lone`` learns them, the
    linear form cannot, and a ``lone`` that ignored the gap would price the back-to-back ones too."""
    rows, after_gap = _gapped_prefill_table(10, lambda i, k: k % 3 != 0, lambda t, a: t + 3e-3 * a, 0.02)
    assert sum(after_gap) > 50 and any(r[8] == 0 and not g for r, g in zip(rows, after_gap, strict=True))
    got = latency_fit.prefill_forms(rows, 0.5, latency_fit.GRAPH_SIZES, None)["prefill/eager/idle"]
    assert got["lone"]["p99_rel"] < 0.05 < got["after"]["p99_rel"]


def test_lone_level_scales_the_lone_prompts_by_their_own_level() -> None:
    """Prompts alone after an idle host take 1.3x what the linear form gives, and come last and
    few (as the probes at a latency run's end): the ``lone`` term, learned by the online refits
    from 0, does not catch them; a level of their own (``lone_level``) does, and leaves the other
    steps' predictions as they were."""
    rows, after_gap = _gapped_prefill_table(11, lambda i, k: i > 450, lambda t, a: t * (1.3 if a else 1.0), 0.05)
    assert 20 < sum(after_gap) < 60
    got = latency_fit.prefill_forms(rows, 0.5, latency_fit.GRAPH_SIZES, None)["prefill/eager/idle"]
    # (the level starts at 0: its first few steps keep most of the miss, which the p99 counts)
    assert got["lone_level"]["p99_rel"] < 0.6 * got["after"]["p99_rel"] and got["after"]["p99_rel"] > 0.2
    assert got["lone"]["p99_rel"] > 0.9 * got["after"]["p99_rel"]
    assert got["lone_level"]["median_rel"] <= got["after"]["median_rel"] + 1e-12


def _busy_decode_table(server: Any, seed: int, legacy: bool = False) -> list[list[object]]:
    """Busy graph decode steps that ``server`` predicted before observing each, their time
    drifting ±12% every 40 steps (one backward task to the next), 35% slower beside the layers
    than beside the commit (layer -1), 15% slower beside a task's start (-2), 20% slower beside
    the backward's last layer (0). ``server`` reads the trainer's phase as this commit's model
    does (``trainer_phase``, and its spot: ``trainer_spot`` of the 8B shape's layers), or as the
    models before session 27's ``ending`` phase (``legacy``, no spot)."""
    from coserve.core.latency import trainer_phase, trainer_spot

    rng = random.Random(seed)
    previous = "starting"
    rows: list[list[object]] = []
    layer, drift = 31, 1.0
    for i in range(1600):
        if i % 40 == 0:
            drift = rng.choice((0.88, 1.0, 1.12))
        layer = layer - 1 if layer > -2 else 31
        b, kv = rng.randint(1, 64), rng.randint(100, 60_000)
        vec = [float(b), float(kv), 1.0]
        slow = {-1: 0.0, -2: 0.15, 0: 0.2}.get(layer, 0.35)
        t = ((1e-5 * latency_fit._bucket(b, latency_fit.GRAPH_SIZES) + 3e-8 * kv + 5e-3) * (1 + slow) * drift
             * rng.uniform(0.99, 1.01))
        at = [layer, 0]
        previous = phase = trainer_phase((layer, 0), previous)
        if legacy and phase == "ending":
            phase = "active"
        spot = None if legacy else trainer_spot((layer, 0), latency_fit.LOSS_LAYER)
        predicted = server.observe_regressors("decode/graph", server.bucketed(vec, "decode/graph"), t, phase,
                                              False, spot)
        rows.append(["decode/graph/busy", predicted, t, vec, [0, 0], at])
    return rows


def test_replay_recovers_the_calibration_under_a_moving_level() -> None:
    """A table written as the server writes it (a level per busy set of each trainer phase,
    refits put off to the cap): its first predictions already carry the level, which the recovery
    divides out by the level's rule. The replay then reproduces the recorded predictions
    (``after``), and ``decode_forms``' ``after`` is the replay's."""
    from coserve.core.latency import LEVEL_RATE, LatencyModel

    calibration = {"decode/graph": [1e-5, 3e-8, 5e-3]}
    server = LatencyModel()
    server.load_state_dict({"version": 2, "coefficients": calibration, "calibration": calibration})
    server.graph_bucket = lambda n: int(latency_fit._bucket(n, latency_fit.GRAPH_SIZES))
    server.defer_refits = True
    rows = _busy_decode_table(server, 8)
    first = [r for r in rows[:10]]
    assert any(abs(math.log(r[1] / (r[3][0] * 1e-5 + r[3][1] * 3e-8 + 5e-3))) > 0.05  # type: ignore[index, operator]
               for r in first[1:] if r[3][0] in latency_fit.GRAPH_SIZES)  # the level moved them
    report = latency_fit.replay(rows, 0.5, latency_fit.GRAPH_SIZES, None)
    assert report["calibration"]["decode/graph"] == pytest.approx(calibration["decode/graph"], rel=1e-6)
    assert report["recovery"]["level_rate"] == LEVEL_RATE and report["recovery"]["level_per_phase"]
    decode = report["decode/graph/busy"]
    assert decode["matches_recorded"]["after"]["p99_rel"] < 1e-9
    assert decode["after"] == pytest.approx(decode["recorded"], rel=1e-9)
    assert decode["matches_recorded"]["before"]["median_rel"] > 0.01  # (no level: another model)
    forms = latency_fit.decode_forms(rows, 0.5, latency_fit.GRAPH_SIZES, None)["decode/graph/busy"]
    assert forms["after"] == pytest.approx(decode["after"], rel=1e-9)
    assert forms["shared_level"] != forms["after"]
    first = latency_fit.latency_decode.FIRST_STEPS
    assert set(forms["views"]) == {"all_steps", f"first_{first}", f"steps_{first}_{2 * first}"}
    assert forms["views"]["all_steps"]["after"]["n"] == sum(r[0] == "decode/graph/busy" for r in rows)
    # (the commit and task-start phases keep their own levels until their busy sets first refit)
    assert forms["views"]["first_500"]["shared_fitted"] not in (
        forms["views"]["first_500"]["shared_level"], forms["views"]["first_500"]["after"])
    # (the model since session 24: per-phase levels for the first 500 busy steps, then shared)
    assert forms["views"]["first_500"]["after"] == forms["views"]["first_500"]["per_phase"]
    assert forms["shared_fitted_0.3_after_500"] == forms["after"] != forms["per_phase"]
    # (over the held-out half both share one level at 0.3 by then, whose memory is far shorter
    # than 800 steps: they part over the first 500, where the model keeps a level per phase)
    assert forms["views"]["first_500"]["after"] != forms["views"]["first_500"]["shared_fitted_rate_0.3"]
    assert decode["matches_recorded"]["per_phase"]["p99_rel"] > 1e-6
    summary = latency_fit.latency_decode.decode_summary({"t": {"decode_forms": {"decode/graph/busy": forms}}})
    assert summary["sets"] == 1 and summary["baseline"] == "after"
    assert set(summary["shared_fitted"]["worse"]) == {"held_out", *forms["views"]}
    only = latency_fit.decode_forms(rows, 0.5, latency_fit.GRAPH_SIZES, None, names=["young_250"])["decode/graph/busy"]
    assert only["young_250"] == forms["young_250"] and set(only["views"]["all_steps"]) == {"after", "young_250"}
    assert set(summary) - {"sets", "baseline", "baseline_max_median_rel"} == set(
        latency_fit.latency_decode.DECODE_FORMS) - {"after"}


def test_a_table_recorded_before_the_ending_phase_is_recovered_with_its_own_phases() -> None:
    """A table whose server had no ``ending`` phase (its layer-0 steps priced as ``active``):
    recovered with the phases its result lists (none: the legacy ones), the calibration comes
    back and ``per_phase`` (the legacy phases) reproduces its predictions; ``after`` runs the
    ``ending`` phase, a different model."""
    from coserve.core.latency import LatencyModel

    calibration = {"decode/graph": [1e-5, 3e-8, 5e-3]}
    server = LatencyModel(share_after=None)  # per_phase: the model of sessions 20-23
    server.load_state_dict({"version": 2, "coefficients": calibration, "calibration": calibration})
    server.graph_bucket = lambda n: int(latency_fit._bucket(n, latency_fit.GRAPH_SIZES))
    server.defer_refits = True
    rows = _busy_decode_table(server, 8, legacy=True)
    recorded = latency_fit.recorded_phases({"config": {}})
    assert recorded == latency_fit.LEGACY_TRAINER_PHASES
    assert latency_fit.recorded_phases({"config": {"trainer_phases": ["active", "ending"]}}) == ("active", "ending")
    report = latency_fit.replay(rows, 0.5, latency_fit.GRAPH_SIZES, None, recorded=recorded)
    assert report["calibration"]["decode/graph"] == pytest.approx(calibration["decode/graph"], rel=1e-6)
    decode = report["decode/graph/busy"]
    assert decode["matches_recorded"]["per_phase"]["p99_rel"] < 1e-9
    assert decode["matches_recorded"]["after"]["median_rel"] > 0 and "ending" in decode["by_phase"]


def test_a_table_with_the_steps_planned_time_is_replayed_on_the_models_part() -> None:
    """Since session 27 a step's host time up to admission's decision (``planned_s``) is part of
    its prediction as measured and the model learns the rest: the replay does the same, so it
    reproduces the recorded predictions, and pricing the whole step instead misses the host's
    stalls."""
    from coserve.core.latency import LatencyModel

    calibration = {"decode/graph": [1e-5, 3e-8, 5e-3]}
    server = LatencyModel()
    server.load_state_dict({"version": 2, "coefficients": calibration, "calibration": calibration})
    server.graph_bucket = lambda n: int(latency_fit._bucket(n, latency_fit.GRAPH_SIZES))
    server.defer_refits = True
    rng = random.Random(3)
    rows: list[list[object]] = []
    for i in range(800):
        b, kv = rng.randint(1, 64), rng.randint(100, 60_000)
        vec = [float(b), float(kv), 1.0]
        forward = (1e-5 * latency_fit._bucket(b, latency_fit.GRAPH_SIZES) + 3e-8 * kv + 5e-3) * rng.uniform(0.99, 1.01)
        planned = 3e-3 if i % 10 == 0 else 2e-4  # (every tenth step took in a trainer's results)
        predicted = server.observe_regressors("decode/graph", server.bucketed(vec, "decode/graph"), forward)
        rows.append(["decode/graph/idle", predicted + planned, planned + forward, vec, [0, 0], None, False, [], b,
                     planned, 1e-4, planned])
    report = latency_fit.replay(rows, 0.5, latency_fit.GRAPH_SIZES, None)
    decode = report["decode/graph/idle"]
    assert report["calibration"]["decode/graph"] == pytest.approx(calibration["decode/graph"], rel=1e-6)
    assert decode["matches_recorded"]["after"]["p99_rel"] < 1e-9
    assert decode["after"]["p99_rel"] < 0.02
    whole = latency_fit.replay([r[:11] for r in rows], 0.5, latency_fit.GRAPH_SIZES, None)["decode/graph/idle"]
    assert whole["after"]["p99_rel"] > 0.1  # (the stalled steps, priced as the others)
    forms = latency_fit.decode_forms(rows, 0.5, latency_fit.GRAPH_SIZES, None, names=["after"])["decode/graph/idle"]
    assert forms["after"] == pytest.approx(decode["after"], rel=1e-9)


def _same_batch_first(same: int) -> tuple[dict[str, list[float]], list[list[object]]]:
    """An idle graph decode table whose first ``same`` steps all carry 5 decodes, as the server
    records it (refits put off to the cap: the first at the 40th step)."""
    from coserve.core.latency import LatencyModel

    calibration = {"decode/graph": [1e-5, 3e-8, 5e-3]}
    server = LatencyModel()
    server.load_state_dict({"version": 2, "coefficients": calibration, "calibration": calibration})
    server.graph_bucket = lambda n: int(latency_fit._bucket(n, latency_fit.GRAPH_SIZES))
    server.defer_refits, server.defer_from_rows = True, 0  # (as the servers until session 32)
    rng = random.Random(5)
    rows: list[list[object]] = []
    for i in range(600):
        b, kv = (5, 6_000 + 5 * i) if i < same else (rng.randint(1, 64), rng.randint(100, 60_000))
        vec = [float(b), float(kv), 1.0]
        t = (1e-5 * latency_fit._bucket(b, latency_fit.GRAPH_SIZES) + 3e-8 * kv + 5e-3) * rng.uniform(0.97, 1.03)
        predicted = server.observe_regressors("decode/graph", server.bucketed(vec, "decode/graph"), t)
        rows.append(["decode/graph/idle", predicted, t, vec, [0, 0], None])
    return calibration, rows


@pytest.mark.usefixtures("deferred_as_recorded")
def test_the_recovery_reads_past_the_tenth_step_up_to_the_first_refit() -> None:
    """Session 28's engine-split table began with ten decode steps of 5 decodes each: from those
    alone the per-decode term and the constant cannot be told apart (the least-norm split was
    ~100× off, and the replay missed the recorded busy predictions by 0.84 at p99). The server
    puts refits off, so the steps after the tenth still carry the calibration's predictions up to
    the first refit: read too, they separate the terms, and the replay reproduces the table."""
    calibration, rows = _same_batch_first(10)
    report = latency_fit.replay(rows, 0.5, latency_fit.GRAPH_SIZES, None)
    assert report["recovery"]["calibration"] == "recovered"
    assert report["calibration"]["decode/graph"] == pytest.approx(calibration["decode/graph"], rel=1e-5)
    assert report["decode/graph/idle"]["matches_recorded"]["after"]["p99_rel"] < 1e-9


@pytest.mark.usefixtures("deferred_as_recorded")
def test_a_recorded_calibration_replays_a_table_whose_calibrated_steps_leave_terms_apart_unidentified() -> None:
    """Where every step before the first refit carried the same batch size, only the calibration
    the run recorded (``figures.calibration.coefficients``, since session 29) reproduces the table;
    the recovery's least-norm split does not."""
    calibration, rows = _same_batch_first(60)
    result = {"figures": {"calibration": {"batches": 9, "seconds": 1.0, "coefficients": {
        **calibration, "prefill/graph": [1.0, 2.0]}}}}  # (a key of another commit's length: left out)
    recorded = latency_fit.recorded_calibration(result)
    assert recorded == calibration
    assert latency_fit.recorded_calibration({"figures": {"calibration": {"batches": 9}}}) is None
    recovered = latency_fit.replay(rows, 0.5, latency_fit.GRAPH_SIZES, None)
    assert recovered["recovery"]["calibration"] == "recovered"
    assert recovered["calibration"]["decode/graph"] != pytest.approx(calibration["decode/graph"], rel=0.1)
    assert recovered["decode/graph/idle"]["matches_recorded"]["after"]["p99_rel"] > 0.05
    report = latency_fit.replay(rows, 0.5, latency_fit.GRAPH_SIZES, None, calibration=recorded)
    assert report["recovery"]["calibration"] == "recorded"
    assert report["decode/graph/idle"]["matches_recorded"]["after"]["p99_rel"] < 1e-9
    forms = latency_fit.decode_forms(rows, 0.5, latency_fit.GRAPH_SIZES, None, names=["after"], calibration=recorded)
    assert forms["decode/graph/idle"]["after"] == pytest.approx(report["decode/graph/idle"]["after"], rel=1e-9)


def test_scheduled_level_moves_slowly_while_young_and_its_shared_level_at_its_own_rate() -> None:
    """``Scheduled``: ``young_rate`` for a level's first ``young_steps`` steps, then ``rate``
    (``shared_rate`` for a key's shared busy level); a restart does not make it young again; a
    phase joining a shared level with none yet brings its own."""
    from coserve.core.latency import LEVEL_CLIP

    decode = latency_fit.latency_decode
    level = decode.Scheduled(2, young_rate=0.2, rate=0.3)
    k = ("decode/graph", "active")
    level.observe(k, 0.1)
    assert level.value(k) == pytest.approx(0.02)
    level.observe(k, 0.1)
    assert level.value(k) == pytest.approx(0.02 + 0.2 * 0.08)
    level.recenter(k, [0.0, 0.1, 0.2])
    assert level.value(k) == pytest.approx(0.1) and level.rate_for(k) == 0.3
    level.observe(k, 0.1 + 2 * LEVEL_CLIP)  # (clipped)
    assert level.value(k) == pytest.approx(0.1 + 0.3 * LEVEL_CLIP)
    shared = decode.Scheduled(0, rate=0.2, shared_rate=0.3)
    assert shared.rate_for(k) == 0.2 and shared.rate_for(("decode/graph", "busy")) == 0.3
    shared.observe(k, 0.1)
    shared.join(("decode/graph", "busy"), k)
    assert shared.value(("decode/graph", "busy")) == pytest.approx(0.02)
    shared.observe(("decode/graph", "busy"), 0.12)
    shared.join(("decode/graph", "busy"), ("decode/graph", "quiet"))  # (has one: kept)
    assert shared.value(("decode/graph", "busy")) == pytest.approx(0.02 + 0.3 * 0.1)


def test_the_replay_prices_lone_prompts_as_the_model_does() -> None:
    """A table recorded by a model with the lone prompts' level (session 29): ``after`` replays it
    to its recorded predictions, reading each step's lone-ness from its row (no decodes, no FT
    rows, ``gap_s`` of LONE_GAP_S or more); ``per_phase``, the model without that level, does not."""
    from coserve.core.latency import LONE_GAP_S, Chunk, LatencyModel, StepFeatures

    calibration = {"prefill/eager": [0.0, 3e-5, 0.0, 0.0, 0.0, 0.0, 0.0, 5e-3]}
    server = LatencyModel()
    server.load_state_dict({"version": 3, "knee_tokens": KNEE_TOKENS, "coefficients": calibration,
                            "calibration": calibration})
    server.defer_refits = True  # (as CoServer runs it, with no idle poll: refits at the cap)
    rng = random.Random(12)
    rows: list[list[object]] = []
    for _ in range(600):
        alone = rng.random() < 0.1
        n, decodes = (32, 0) if alone else (rng.randint(8, 1024), rng.randint(1, 30))
        gap = rng.choice([1e-4, 0.05]) if alone else 1e-4
        f = StepFeatures((Chunk(n),), num_decodes=decodes, kv_tokens=decodes * 500, idle_before_s=gap)
        t = (3e-5 * (n + decodes) + 5e-3) * (1.3 if f.lone else 1.0) * rng.uniform(0.99, 1.01)
        predicted = server.observe_features(f, t)
        rows.append(["prefill/eager/idle", predicted, t, list(f.vector()), [1, 0], None, False, [[n, 0]], decodes,
                     1e-4, 1e-3, 0.0, None, gap])
    assert sum(latency_fit.row_lone(r) for r in rows) > 10 and LONE_GAP_S < 0.05
    got = latency_fit.replay(rows, 0.5, latency_fit.GRAPH_SIZES, None, calibration=calibration)["prefill/eager/idle"]
    assert got["matches_recorded"]["after"]["p99_rel"] < 1e-9
    assert got["matches_recorded"]["per_phase"]["p99_rel"] > 0.05
    assert got["after"]["p99_rel"] < got["per_phase"]["p99_rel"]

"""bench/coserve_latency.py's pause-delay summary: first pause in each grant-cleared window, split
by the boundary the trainer paused at."""

from __future__ import annotations

import pytest

from tests.bench.scripts import load_script

coserve_latency = load_script("coserve_latency")


def test_first_pause_per_window_and_split_by_boundary() -> None:
    windows = [(1.0, 1.1), (2.0, 2.1), (3.0, 3.1), (4.0, 4.1)]
    # window 1: paused at a layer after 2 ms (a later pause in it is ignored); window 2: at the
    # loss after 8 ms; window 3: never (the pause at 3.2 is after it); window 4: at the commit
    observed = [1.05, 1.002, 2.008, 3.2, 4.004]
    layers = [3, 5, 32, 7, -1]
    got = coserve_latency.pause_delays(windows, observed, layers, num_layers=32)
    assert (got["windows"], got["paused"], got["not_paused_within_step"]) == (4, 3, 1)
    assert got["delay_max_ms"] == pytest.approx(8.0)
    assert got["unpaused_window_p99_ms"] == pytest.approx(100.0)
    by = got["by_boundary"]
    assert set(by) == {"layer", "loss", "commit"}
    assert by["layer"]["delay_p50_ms"] == pytest.approx(2.0)
    assert by["loss"]["delay_p99_ms"] == pytest.approx(8.0)
    assert by["commit"]["paused"] == 1 and by["commit"]["delay_p50_ms"] == pytest.approx(4.0)
    assert "by_boundary" not in coserve_latency.pause_delays(windows, observed)


def test_spans_grouped_by_where_they_start() -> None:
    # (layer, ordinal among that layer's boundaries, ms): two loss chunks, layer 1's attention
    # recompute and attention backward, layer 0's attention recompute, the commit
    # (and the CPU ms each took to queue: layer 1's attention recompute and the commit left the
    # GPU dry)
    spans = [(2, 0, 1.0, 0.2), (2, 1, 3.0, 0.4), (1, 0, 0.5, 4.0), (1, 3, 2.5, 0.3), (0, 0, 0.7, 0.1),
             (-1, 0, 0.1, 2.0)]
    got = coserve_latency.span_summary(spans, num_layers=2)
    assert got["n"] == 6 and got["over_2ms"] == 2 and got["cpu_over_gpu"] == 2
    by = got["by_start"]
    assert set(by) == {"loss", "layer#0", "layer#3", "commit"}
    assert by["loss"]["n"] == 2 and by["loss"]["max_ms"] == pytest.approx(3.0)
    assert by["layer#0"]["n"] == 2 and by["layer#0"]["max_ms"] == pytest.approx(0.7)
    assert by["layer#0"]["cpu_over_gpu"] == 1 and by["commit"]["cpu_p50_ms"] == pytest.approx(2.0)
    assert "proc_p50_ms" not in by["loss"]  # (no process CPU times given)
    assert got["loss_by_ordinal"] == {"0": {"n": 1, "p50_ms": 1.0, "p99_ms": 1.0},
                                      "1": {"n": 1, "p50_ms": 3.0, "p99_ms": 3.0}}
    assert "loss_by_ordinal" not in coserve_latency.span_summary(spans[2:], num_layers=2)
    assert "loss_by_role" not in got  # (no roles given)


def test_the_first_layer_after_the_loss_beside_the_others_by_ordinal() -> None:
    """``first_layer_by_ordinal``: the last layer's stretches (the first after the loss), GPU and
    CPU ms by ordinal; ``other_layers_by_ordinal``: the same ordinals of the layers below it; the
    loss's, the start's and the commit's stretches in neither."""
    spans = [(3, 0, 1.0, 0.1), (2, 0, 0.5, 9.0), (2, 0, 0.7, 7.0), (2, 1, 0.2, 0.3), (1, 0, 0.4, 0.5),
             (0, 0, 0.6, 0.7), (0, 1, 0.3, 0.2), (-1, 0, 5.0, 5.0)]
    got = coserve_latency.span_summary(spans, num_layers=3)
    first, rest = got["first_layer_by_ordinal"], got["other_layers_by_ordinal"]
    assert set(first) == {"0", "1"} and set(rest) == {"0", "1"}
    assert first["0"]["n"] == 2 and first["0"]["cpu_max_ms"] == pytest.approx(9.0)
    assert first["0"]["max_ms"] == pytest.approx(0.7) and first["1"]["cpu_p50_ms"] == pytest.approx(0.3)
    assert rest["0"]["n"] == 2 and rest["0"]["max_ms"] == pytest.approx(0.6) and rest["0"]["cpu_max_ms"] == pytest.approx(0.7)
    assert rest["1"] == {"n": 1, "p50_ms": 0.3, "p99_ms": 0.3, "max_ms": 0.3, "cpu_p50_ms": 0.2, "cpu_p99_ms": 0.2,
                         "cpu_max_ms": 0.2}
    assert "first_layer_by_ordinal" not in coserve_latency.span_summary(spans[-1:], num_layers=3)


def test_loss_stretches_by_role_over_chunks() -> None:
    """Two tasks of two loss chunks each, three stretches a chunk (a one-piece split loss): the
    ordinals count on over a task's chunks, the roles repeat every chunk."""
    roles = ("logits", "cross_entropy", "gradient")
    spans = [(2, k, ms, 0.1) for k, ms in enumerate([1.0, 3.0, 0.5, 1.2, 2.8, 0.6])] * 2
    spans.append((1, 0, 9.0, 0.1))  # (a layer's: not the loss's)
    got = coserve_latency.span_summary(spans, num_layers=2, loss_roles=roles)["loss_by_role"]
    assert set(got) == set(roles) and all(v["n"] == 4 for v in got.values())
    assert got["cross_entropy"]["p50_ms"] == pytest.approx(2.9)
    assert got["logits"]["p99_ms"] == pytest.approx(1.2, abs=1e-3)
    assert got["gradient"]["p50_ms"] == pytest.approx(0.55)


def test_a_pause_dates_from_where_the_gpu_stopped_for_its_release() -> None:
    # window 1: the gate wait reached 3 ms in, the GPU idle (waiting for its stretch's release)
    # for the 2 ms before it; window 2: reached 1 ms in after 4 ms of idling (it had stopped
    # before the window began)
    windows = [(1.0, 1.1), (2.0, 2.1)]
    got = coserve_latency.pause_delays(windows, [1.003, 2.001], idle_ms=[2.0, 4.0])
    assert got["delay_p50_ms"] == pytest.approx(0.5) and got["delay_max_ms"] == pytest.approx(1.0)
    # without it, the delays run to the gate waits
    assert coserve_latency.pause_delays(windows, [1.003, 2.001])["delay_max_ms"] == pytest.approx(3.0)


def test_spans_tell_host_work_from_a_host_that_waited() -> None:
    # layer 1's attention recompute: 4 ms of host time, 3.8 of them CPU work; layer 0's: 3 ms of
    # host time with 0.4 ms of CPU work (the host waited); the commit: its process time unknown
    spans = [(1, 0, 0.5, 4.0), (0, 0, 0.7, 3.0), (0, 1, 0.2, 0.3), (-1, 0, 0.1, 2.0)]
    got = coserve_latency.span_summary(spans, num_layers=2, process_ms=[3.8, 0.4, 0.1, float("nan")])
    by = got["by_start"]
    assert by["layer#0"]["host_waited"] == 1 and by["layer#0"]["proc_p99_ms"] == pytest.approx(3.8, rel=0.02)
    assert by["layer#0"]["cpu_sum_ms"] == pytest.approx(7.0) and by["layer#0"]["cpu_max_ms"] == pytest.approx(4.0)
    assert by["layer#1"]["host_waited"] == 0  # (0.3 ms of host time: too short to say)
    assert "proc_p50_ms" not in by["commit"]
    # a list that does not match the spans is ignored
    assert "host_waited" not in coserve_latency.span_summary(spans, 2, process_ms=[1.0])["by_start"]["layer#0"]


def test_spans_carry_the_garbage_collectors_time_and_the_watchdogs_releases() -> None:
    spans = [(1, 0, 0.5, 4.0), (0, 0, 0.7, 3.0), (0, 1, 0.2, 0.3), (-1, 0, 0.1, 2.0)]
    got = coserve_latency.span_summary(spans, num_layers=2, gc_ms=[0.0, 2.5, 0.25, float("nan")], watchdog_releases=3)
    assert got["gc_ms"] == pytest.approx(2.75) and got["gc_max_ms"] == pytest.approx(2.5) and got["gc_over_1ms"] == 1
    assert got["watchdog_releases"] == 3
    assert [(d["at"], d["cpu_ms"], d["gc_ms"]) for d in got["longest_cpu"][:2]] == [("layer#0", 4.0, 0.0),
                                                                                 ("layer#0", 3.0, 2.5)]
    by = got["by_start"]
    assert by["layer#0"]["gc_over_1ms"] == 1 and by["layer#0"]["gc_ms"] == pytest.approx(2.5)  # (both layers)
    assert by["layer#1"]["gc_ms"] == pytest.approx(0.25) and by["layer#1"]["gc_over_1ms"] == 0
    assert "gc_ms" not in by["commit"]
    # without them: neither key (the older results' layout)
    plain = coserve_latency.span_summary(spans, num_layers=2)
    assert "gc_ms" not in plain and "watchdog_releases" not in plain
    assert all("task" not in d for d in plain["longest_cpu"])


def test_the_longest_stretches_name_their_task() -> None:
    """Each of the longest stretches carries its task (its row of the timeline's tasks) where the
    host gave one per stretch; a list that does not match the spans is left out."""
    spans = [(1, 0, 0.5, 4.0), (0, 0, 0.7, 3.0), (0, 1, 0.2, 0.3), (-1, 0, 0.1, 9.0)]
    got = coserve_latency.span_summary(spans, num_layers=2, tasks=[0, 0, 1, 1])
    assert [(d["at"], d["task"]) for d in got["longest_cpu"][:3]] == [("commit", 1), ("layer#0", 0), ("layer#0", 0)]
    assert all("task" not in d for d in coserve_latency.span_summary(spans, 2, tasks=[0])["longest_cpu"])
    # with the queuing thread's CPU time beside the process's (a list that does not match: NaN)
    threaded = coserve_latency.span_summary(spans, 2, process_ms=[4.0, 3.0, 0.3, 9.0], thread_ms=[0.5, 2.9, 0.3, 8.9])
    assert [(d["proc_ms"], d["thread_ms"]) for d in threaded["longest_cpu"][:2]] == [(9.0, 8.9), (4.0, 0.5)]
    assert all(d["thread_ms"] != d["thread_ms"] for d in coserve_latency.span_summary(spans, 2, thread_ms=[1.0])["longest_cpu"])


def test_delays_split_by_whether_the_gpu_had_run_dry() -> None:
    windows = [(1.0, 1.1), (2.0, 2.1)]
    # window 1: paused after 2 ms with the GPU 1.5 ms behind the CPU; window 2: after 9 ms at a
    # boundary the GPU reached as soon as the CPU queued it (its kernels had finished before)
    got = coserve_latency.pause_delays(windows, [1.002, 2.009], [3, -1], num_layers=32, lags_ms=[1.5, 0.05])
    by = got["by_gpu_lag"]
    assert by["gpu_behind"]["delay_p99_ms"] == pytest.approx(2.0)
    assert by["gpu_dry"]["paused"] == 1 and by["gpu_dry"]["delay_p50_ms"] == pytest.approx(9.0)
    assert "by_gpu_lag" not in coserve_latency.pause_delays(windows, [1.002, 2.009])


def test_pauses_at_poll_points_are_counted_apart() -> None:
    windows = [(1.0, 1.1), (2.0, 2.1), (3.0, 3.1)]
    # windows 1 and 3 paused at layer boundaries, window 2 at a poll point inside layer 5's stretch
    got = coserve_latency.pause_delays(windows, [1.002, 2.0004, 3.003], [3, 5, 32], num_layers=32,
                                       polled=[False, True, False])
    by = got["by_boundary"]
    assert by["poll"]["paused"] == 1 and by["poll"]["delay_p50_ms"] == pytest.approx(0.4)
    assert by["layer"]["paused"] == 1 and by["loss"]["paused"] == 1
    assert "poll" not in coserve_latency.pause_delays(windows, [1.002, 2.0004, 3.003], [3, 5, 32],
                                                      num_layers=32)["by_boundary"]


def test_delays_split_by_where_the_trainer_was_when_the_window_began() -> None:
    windows = [(1.0, 1.1), (2.0, 2.1), (3.0, 3.1)]
    # window 1 found the trainer's GPU in layer 3 and it paused 1.5 ms later; window 2 found it
    # between tasks and its next task reached its start boundary 20 ms later; window 3 found it
    # in the loss and it never paused within the step
    got = coserve_latency.pause_delays(windows, [1.0015, 2.02], [3, -2], num_layers=32, lags_ms=[1.0, 0.01],
                                       window_at=[(3, 1), None, (32, 0)])
    by = got["by_trainer_at_start"]
    assert by["in_task"]["paused"] == 1 and by["in_task"]["delay_p99_ms"] == pytest.approx(1.5)
    assert by["between_tasks"]["paused"] == 1 and by["between_tasks"]["delay_p50_ms"] == pytest.approx(20.0)
    assert got["by_boundary"]["start"]["paused"] == 1
    assert got["not_paused_within_step"] == 1
    assert got["not_paused_by_trainer_at_start"] == {"between_tasks": 0, "in_task": 1}
    plain = coserve_latency.pause_delays(windows, [1.0015, 2.02])
    assert "by_trainer_at_start" not in plain and "not_paused_by_trainer_at_start" not in plain


def test_step_ratios_split_by_whether_the_window_paused_and_where_the_trainer_was() -> None:
    windows = [(1.0, 1.1), (2.0, 2.1), (3.0, 3.1), (4.0, 4.1), (5.0, 5.1)]
    # windows 1 and 2 paused; 3 never did with the trainer in a task (its step ran 1.4x: the
    # trainer's kernels beside it), 4 never did between tasks, 5's step is unknown
    got = coserve_latency.pause_delays(windows, [1.001, 2.001], [3, 5], num_layers=32, lags_ms=[1.0, 1.0],
                                       window_at=[(3, 1), (5, 0), (32, 2), None, (7, 0)],
                                       step_ratios=[1.0, 1.02, 1.4, 0.99, None])
    by = got["step_ratio_by_window"]
    assert set(by) == {"paused", "unpaused_in_task", "unpaused_between_tasks"}
    assert by["paused"]["steps"] == 2 and by["paused"]["median"] == pytest.approx(1.01)
    assert by["unpaused_in_task"] == {"steps": 1, "median": 1.4, "p90": 1.4}
    assert by["unpaused_between_tasks"]["median"] == 0.99
    assert got["not_paused_by_trainer_at_start"] == {"between_tasks": 1, "in_task": 2}
    assert "step_ratio_by_window" not in coserve_latency.pause_delays(windows, [1.001, 2.001])


def test_each_window_takes_the_ratio_of_the_last_step_begun_by_its_step_start() -> None:
    from coserve.core.coserver import StepLogRow

    def row(began: float | None, predicted: float, measured: float) -> StepLogRow:
        return StepLogRow("prefill/graph/idle", (), predicted, measured, (1, 0), None, False, (), 0, None, None,
                          began_s=began)

    log = [row(2.0, 0.01, 0.02), row(1.0, 0.01, 0.01), row(None, 0.01, 0.05), row(3.0, 0.0, 0.01)]
    assert coserve_latency.window_step_ratios([0.5, 1.0005, 2.0004, 3.1], log) == [None, 1.0, 2.0, None]


def test_layer0_profile_covers_only_the_first_layer_of_each_step() -> None:
    calls: list[str] = []

    class Co:
        def _interruption_point(self, activation: object, where: str) -> None:
            calls.append(where)
            if where == "before layer 2":
                raise RuntimeError("interrupted")

    def layer_zero_work() -> int:
        return sum(range(1000))

    co = Co()
    profile = coserve_latency.Layer0Profile(co)
    for _ in range(2):
        co._interruption_point(None, "end of plan")
        co._interruption_point(None, "before layer 0")
        layer_zero_work()
        co._interruption_point(None, "before layer 1")
        with pytest.raises(RuntimeError):
            co._interruption_point(None, "before layer 2")
    report = profile.report()
    assert report["steps"] == 2 and calls.count("before layer 0") == 2
    assert "layer_zero_work" in report["cumulative"] and "layer_zero_work" in report["tottime"]
    assert not profile._on  # off again after each step's second check, and after an interruption


def test_task_allocs_tell_the_watchdogs_releases_in_tasks_that_asked_the_driver_for_memory() -> None:
    rows = [(0, 0, 0, 0, 0), (2, 1, 3, 0, 0), (1, 1, 0, 0, 0), (0, 0, 1, 1, 0)]
    got = coserve_latency.task_allocs_summary(rows)
    assert got == {"tasks": 4, "with_device_allocs": 2, "device_allocs": 4, "device_frees": 1,
                   "watchdog_releases": 3, "watchdog_gate_closed": 2, "watchdog_in_allocating_tasks": 2,
                   "tasks_with_watchdog": 2, "closed_sleeps": 0, "tasks_with_closed_sleeps": 0}
    # with each task's sleeps behind a closed gate (COSERVE_TRAINER_CLOSED_AHEAD)
    slept = coserve_latency.task_allocs_summary([(*r[:4], n) for r, n in zip(rows, [0, 3, 1, 0], strict=True)])
    assert slept["closed_sleeps"] == 4 and slept["tasks_with_closed_sleeps"] == 2


def test_one_layer_of_the_completed_ft_only_steps() -> None:
    cols = coserve_latency.STEP_COLUMNS

    def step(kind: str, seconds: float, ft_tokens: int) -> tuple[object, ...]:
        row = dict.fromkeys(cols, 0)
        row.update(kind=kind, seconds=seconds, ft_tokens=ft_tokens)
        return tuple(row[c] for c in cols)

    # three completed FT-only steps (median 0.036 s, 1,327 tokens); an interrupted one and an
    # inference step do not count
    steps = [step("ft-only", 0.040, 1500), step("ft-only-interrupted", 0.004, 1061), step("ft-only", 0.036, 1327),
             step("inference", 0.100, 0), step("ft-only", 0.030, 1100)]
    got = coserve_latency.ft_only_layer(steps, num_layers=32)
    assert got["n"] == 3 and got["tokens_p50"] == 1327
    assert got["step_p50_ms"] == pytest.approx(36.0) and got["one_layer_ms"] == pytest.approx(36.0 / 32)
    assert coserve_latency.ft_only_layer([steps[1]], num_layers=32)["one_layer_ms"] is None


def test_delays_run_from_the_step_start_after_an_early_pause() -> None:
    # two windows that the early-pause timer opened 5 ms before their steps' plans: the trainer
    # stopped 2 ms into the first window (before its step: 0) and 1 ms after the second's step began
    windows = [(1.0, 1.1), (2.0, 2.1)]
    got = coserve_latency.pause_delays(windows, [1.002, 2.006], step_starts=[1.005, 2.005])
    assert got["paused"] == 2 and got["paused_before_step"] == 1
    assert got["delay_max_ms"] == pytest.approx(1.0)
    assert coserve_latency.pause_delays(windows, [1.002, 2.006])["delay_max_ms"] == pytest.approx(6.0)


def test_the_longest_pauses_say_when_and_where() -> None:
    windows = [(10.0, 10.1), (11.0, 11.1), (12.0, 12.1)]
    got = coserve_latency.pause_delays(windows, [10.004, 11.001, 12.003], [3, 32, 5], num_layers=32,
                                       lags_ms=[1.5, 0.05, 0.9], window_at=[(3, 0), None, (5, 0)],
                                       polled=[False, False, True], origin=9.0)
    assert got["longest"] == [
        {"t_s": 1.0, "delay_ms": 4.0, "layer": 3, "poll": False, "gpu_lag_ms": 1.5, "trainer_at": [3, 0]},
        {"t_s": 3.0, "delay_ms": 3.0, "layer": 5, "poll": True, "gpu_lag_ms": 0.9, "trainer_at": [5, 0]},
        {"t_s": 2.0, "delay_ms": 1.0, "layer": 32, "poll": False, "gpu_lag_ms": 0.05, "trainer_at": None}]
    plain = coserve_latency.pause_delays(windows, [10.004, 11.001])  # (no origin: from the first window)
    assert [(w["t_s"], w["layer"], w["trainer_at"]) for w in plain["longest"]] == [(0.0, None, None), (1.0, None, None)]

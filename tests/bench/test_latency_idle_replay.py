"""bench/coserve_latency.py's replay with fine-tuning off: the trainer's tasks finish first, then
the trace's first seconds run with no FT rows admitted, and its steps' errors are their own."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from coserve.bench.workload import Arrival
from coserve.core.config import SLOConfig
from tests.bench.scripts import load_script

coserve_latency = load_script("coserve_latency")


class _Session:
    """A FinetuneSession whose co-server runs a backward task until ``wait`` was called thrice."""

    def __init__(self) -> None:
        self.waits = 0
        self.coserver = SimpleNamespace(slo=SLOConfig(ttft_slo_s=0.5, policy="full"), backward_running=True)

    def wait(self, timeout: float) -> None:
        self.waits += 1
        self.coserver.backward_running = self.waits < 3


class _Driver:
    def __init__(self, session: _Session) -> None:
        self.session, self.calls = session, []

    def run(self, arrivals: list[Arrival], **kwargs: Any) -> str:
        # by the time the replay starts, fine-tuning is off and the trainer idle
        assert self.session.coserver.slo.policy == "off" and not self.session.coserver.backward_running
        self.calls.append((arrivals, kwargs))
        return "run"


def test_the_idle_replay_waits_out_the_trainer_and_replays_the_first_seconds_with_ft_off() -> None:
    session = _Session()
    driver = _Driver(session)
    arrivals = [Arrival(t, 16, 4) for t in (0.0, 1.0, 4.9, 5.0, 9.0)]
    assert coserve_latency.idle_replay(driver, session, arrivals, 5.0) == "run"
    assert session.waits == 3
    (window, kwargs), = driver.calls
    assert [a.time_s for a in window] == [0.0, 1.0, 4.9]
    assert kwargs["duration_s"] == 5.0 and kwargs["idle_wait"] == session.wait
    assert session.coserver.slo.ttft_slo_s == 0.5  # only the policy changed


def test_model_errors_per_key_and_over_all() -> None:
    log = [("decode/graph/idle", (), 0.011, 0.010), ("decode/graph/idle", (), 0.010, 0.010),
           ("prefill/graph/idle", (), 0.030, 0.040)]
    errors = coserve_latency.model_errors(log)
    assert errors["decode/graph/idle"]["n"] == 2
    assert abs(errors["prefill/graph/idle"]["median_rel"] - 0.25) < 1e-9
    assert errors["all"]["n"] == 3


class _WarmDriver:
    """Each run logs three steps of the co-server, 20% over their prediction, 4 requests met."""

    def __init__(self, co: SimpleNamespace) -> None:
        self.co, self.policies = co, []

    def run(self, arrivals: list[Arrival], **kwargs: Any) -> SimpleNamespace:
        self.policies.append(self.co.slo.policy)
        start = kwargs["ft_tokens"]()
        self.co.step_log += [("decode/graph/busy", (), 0.010, 0.0125)] * 3
        self.co.tokens_trained += 500
        return SimpleNamespace(records=[], duration_s=2.0, ft_tokens=kwargs["ft_tokens"]() - start)


def test_warm_replays_turn_fine_tuning_back_on_and_score_their_own_steps() -> None:
    slo = SLOConfig(ttft_slo_s=0.5, policy="full")
    co = SimpleNamespace(slo=SLOConfig(ttft_slo_s=0.5, policy="off"), tokens_trained=0,
                         step_log=[("decode/graph/idle", (), 0.010, 0.010)] * 5)
    session = SimpleNamespace(coserver=co, wait=lambda timeout: None)
    driver = _WarmDriver(co)
    got = coserve_latency.warm_replays(driver, session, slo, [Arrival(0.0, 16, 4)], 2.0, 2)
    assert driver.policies == ["full", "full"]
    assert [w["first_step"] for w in got] == [5, 8]
    for w in got:
        assert w["decode/graph/busy"]["n"] == 3 and abs(w["all"]["median_rel"] - 0.2) < 1e-9
        assert "decode/graph/idle" not in w and w["ft_tokens_per_s"] == 250.0


def test_the_timeline_lines_tasks_and_gpu_samples_up_with_the_steps() -> None:
    """Times are seconds since the step table's origin; each task gets its shape (a task without
    spans: no stretch), and a GPU sample without a clock reading keeps its place."""
    origin = 100.0
    timings = [(101.0, 101.5, 0.4, 1200, 0.1, 0.0, 0.2), (102.0, 102.6, 0.5, 1300, 0.0, 0.0, 0.3)]
    shapes = [(5, 600, 12.5, 0.9, 1, 0), (3, 700, float("nan"), float("nan"), 0, 4)]  # (the second: no spans)
    got = coserve_latency.timeline([(0.0, 90.0), (0.25, 95.0)], [1980.0], timings, shapes, origin)
    assert got["gpu"] == [[0.0, 90.0, 1980.0, None, None, None], [0.25, 95.0, None, None, None, None]]
    host = ([0.31234567], [3400.04, None], [2900.0, 2950.06])  # (busy share, the engine's CPU's MHz, the mean)
    got_host = coserve_latency.timeline([(0.0, 90.0), (0.25, 95.0)], [1980.0], timings, shapes, origin, host)
    assert got_host["gpu"] == [[0.0, 90.0, 1980.0, 0.3123, 3400.0, 2900.0], [0.25, 95.0, None, None, None, 2950.1]]
    assert got_host["gpu_columns"][3:] == ["host_cpu_busy", "engine_cpu_mhz", "cpu_mhz_mean"]
    assert got["tasks"] == [[1.0, 1.5, 0.4, 1200, 5, 600, 12.5, 0.9, 1, 0], [2.0, 2.6, 0.5, 1300, 3, 700, None, None, 0, 4]]
    assert got["task_columns"][4:] == ["samples", "longest_tokens", "longest_span_cpu_ms", "longest_span_gpu_ms",
                                       "device_allocs", "closed_sleeps"]


def test_the_step_table_dates_each_step_from_the_origin() -> None:
    from coserve.bench.runners import STEP_TABLE_COLUMNS, step_table
    from coserve.core.coserver import StepLogRow

    row = StepLogRow("decode/graph/busy", (3.0, 900.0, 1.0), 0.01, 0.011, (0, 0), (5, 1), False, (), 3,
                     None, None, 0.0, None, 0.002, 50.25, 400)
    table = step_table([row, row._replace(began_s=None)], origin=50.0)
    began, longest = STEP_TABLE_COLUMNS.index("began_s"), STEP_TABLE_COLUMNS.index("decode_kv_max")
    assert table["columns"] == list(STEP_TABLE_COLUMNS) and len(table["rows"][0]) == len(STEP_TABLE_COLUMNS)
    assert [r[began] for r in table["rows"]] == [0.25, None] and table["rows"][0][longest] == 400
    assert step_table([row])["rows"][0][began] is None  # (no origin: not dated)

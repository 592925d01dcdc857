"""bench/jobs_during_replay.py: which phase of the job each request of the replay falls in."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.scripts import BENCH, load_script

jobs_during_replay = load_script("jobs_during_replay")
phases = jobs_during_replay.phases


def test_a_pause_of_a_running_job_starts_its_phase_at_the_call() -> None:
    timeline = [(10.0, "validating_files", 0), (12.0, "running", 0), (20.4, "paused", 5), (25.3, "running", 5)]
    calls = {"create": [10.0, 10.01], "pause": [20.0, 20.3], "resume": [25.0, 25.2], "cancel": [40.0, 40.5]}
    assert phases(timeline, calls) == [(0.0, "before"), (10.0, "set-up"), (12.0, "training"), (20.0, "paused"),
                                       (25.3, "training"), (40.0, "after")]


def test_a_pause_asked_during_the_set_up_starts_its_phase_once_the_call_returns() -> None:
    # (the server waits for the set-up before it pauses: the set-up's phase lasts until the call's end)
    timeline = [(10.0, "validating_files", 0), (29.5, "paused", 0)]
    calls = {"create": [10.0, 10.01], "pause": [20.0, 29.4]}
    assert phases(timeline, calls) == [(0.0, "before"), (10.0, "set-up"), (29.4, "paused")]


def test_a_pause_that_failed_leaves_the_polled_phases() -> None:
    # (session 43's H100 run: the pause was a 409 and the job trained on; no ``paused`` phase)
    timeline = [(10.0, "validating_files", 0), (29.0, "running", 0), (59.0, "cancelled", 110)]
    calls = {"create": [10.0, 10.01], "cancel": [58.0, 58.4]}
    assert phases(timeline, calls) == [(0.0, "before"), (10.0, "set-up"), (29.0, "training"), (58.0, "after")]


def test_the_server_side_of_a_job_from_its_log() -> None:
    """Session 44's H100 replay (4531051): two set-ups, the second a resume that went on from its
    checkpoint 6.1 s after its set-up line; the pause call (at 17:05:16.731 by the job's creation,
    the replay's clock against the log's) to the engine's "fine-tuning paused" line: 85 ms. A
    set-up line that names its trainer's start stages (b5fc054 on) gives them."""
    import datetime

    log = (BENCH / "results/latency_h100/session44/jobs_replay_4531051.serve.log").read_text()

    def wall(stamp: str) -> float:
        return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()

    got = jobs_during_replay.server_side(log, {"pause": wall("2026-12-07 17:05:16,731")})
    assert got["pause_to_paused_ms"] == pytest.approx(85.0, abs=0.5)
    first, second = got["set_ups"]
    assert (first["set_up_s"], first["trainer_s"], first["stages_s"]) == (20.7, 19.5, {})
    assert "then_resumed_s" not in first and second["then_resumed_s"] == pytest.approx(6.145, abs=1e-3)
    line = ("2026-12-08 10:00:00,000 INFO coserve.server.finetune: ftjob-1 set up in 15.2 s: dataset d read in "
            "1.0 s (2000 samples), trainer started in 14.0 s with its warm-up (process 6.1 s, build 1.2 s, "
            "warm-up 6.6 s)\n")
    (entry,) = jobs_during_replay.server_side(line, {})["set_ups"]
    assert entry["stages_s"] == {"process": 6.1, "build": 1.2, "warm-up": 6.6} and not entry["from_spare"]
    assert jobs_during_replay.server_side(line, {})["pause_to_paused_ms"] is None
    spared = line.replace("(process", "(from a spare interpreter: process")
    (entry,) = jobs_during_replay.server_side(spared, {})["set_ups"]
    assert entry["stages_s"] == {"process": 6.1, "build": 1.2, "warm-up": 6.6} and entry["from_spare"]
    ready = ("2026-12-08 09:59:50,000 INFO coserve.trainer.spare: spare trainer interpreter ready: its imports "
             "took 8.4 s\n")
    assert jobs_during_replay.server_side(ready + spared, {})["spare_imports_s"] == [8.4]
    assert got["spare_imports_s"] == []


def test_the_replays_wait_for_the_servers_spare_to_import(tmp_path: Path) -> None:
    """``Server.settle``: None where the serve log says no spare started; once it says one did,
    the wait lasts until its "ready" (or "did not finish") line, or the timeout."""
    server = object.__new__(jobs_during_replay.Server)
    server.log_path = tmp_path / "serve.log"
    server.log_path.write_text("INFO: serving\n")
    assert server.settle() is None
    server.log_path.write_text("INFO coserve.trainer.spare: started a spare trainer interpreter (pid 7)\n")
    assert 0.3 <= server.settle(timeout=0.3) < 5.0  # (never ready: the timeout)
    with server.log_path.open("a") as f:
        f.write("INFO coserve.trainer.spare: spare trainer interpreter ready: its imports took 8.4 s\n")
    assert server.settle(timeout=30.0) < 1.0


def test_a_saved_results_server_side_on_the_logs_clock() -> None:
    """A result saved before ``calls_wall`` (4531051's): its calls put on the log's clock where the
    log says the job was created (the create call's end: the pause's engine part at its most),
    then read as :func:`server_side` reads a live run's."""
    d = BENCH / "results/latency_h100/session44"
    got = jobs_during_replay.server_side_of(d / "jobs_replay_4531051.json.xz", d / "jobs_replay_4531051.serve.log")
    side = got["figures"]
    assert side["pause_to_paused_ms"] == pytest.approx(89.8, abs=0.5)
    assert [round(e["set_up_s"], 1) for e in side["set_ups"]] == [20.7, 19.5]
    assert side["set_ups"][1]["then_resumed_s"] == pytest.approx(6.145, abs=1e-3)
    assert jobs_during_replay.calls_wall_of({"calls": {}}, "") == {}

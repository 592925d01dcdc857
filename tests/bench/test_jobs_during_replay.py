"""bench/jobs_during_replay.py: which phase of the job each request of the replay falls in."""

from __future__ import annotations

from tests.bench.scripts import load_script

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

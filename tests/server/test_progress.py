"""The progress lines of ``coserve serve``: what each says, when it is printed, and its counters."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from coserve.server.engine_thread import EngineStats
from coserve.server.progress import (
    ProgressReporter,
    RequestCounts,
    Snapshot,
    finished_line,
    progress_line,
)

IDLE = EngineStats()
FT = EngineStats(coserving=True, ft_samples_total=200)


def snap(t: float, stats: EngineStats = IDLE, served: int = 0, generated: int = 0, met: int = 0,
         missed: int = 0) -> Snapshot:
    return Snapshot(t, RequestCounts(served, generated, met, missed), stats)


def test_an_interval_in_which_nothing_happened_prints_nothing() -> None:
    assert progress_line(snap(0.0), snap(10.0)) is None
    assert progress_line(snap(0.0, FT), snap(10.0, FT)) is None  # co-serving, but no step and no request


def test_requests_answered_running_waiting_and_generated_rate() -> None:
    line = progress_line(snap(0.0, served=3, generated=40), snap(10.0, replace(IDLE, num_running=2, num_waiting=1),
                                                                 served=8, generated=240))
    assert line == ("coserve: 5 requests answered in the last 10 s (2 running, 1 waiting), 20.0 generated tokens/s")
    # requests still running count as activity even when none finished in the interval
    assert progress_line(snap(0.0), snap(10.0, replace(IDLE, num_running=1))) is not None


def test_the_prefix_caches_share_of_the_intervals_prompt_tokens() -> None:
    before, after = replace(IDLE, prefix_cache=(1000, 200)), replace(IDLE, prefix_cache=(1400, 500))
    line = progress_line(snap(0.0, before, served=1), snap(10.0, after, served=3))
    assert line is not None and line.endswith("; prefix cache 75% of prompt tokens")
    assert "prefix cache" not in (progress_line(snap(0.0, after), snap(10.0, after, served=1)) or "")  # none asked


def test_slo_share_of_the_interval_and_of_the_run() -> None:
    line = progress_line(snap(0.0, FT, served=10, met=10), snap(10.0, FT, served=14, met=13, missed=1))
    assert line is not None and "SLOs met by 75.0% (92.9% of 14 so far)" in line


def test_finetuning_progress_loss_rate_and_time_left() -> None:
    before = replace(FT, ft_optimizer_steps=4, ft_samples_retired=20, ft_tokens_trained=1_000, ft_first_loss=7.5,
                     ft_loss=5.0)
    after = replace(before, ft_optimizer_steps=9, ft_samples_retired=60, ft_tokens_trained=21_000, ft_loss=2.25)
    line = progress_line(snap(0.0, before), snap(10.0, after))
    assert line == ("coserve: fine-tuning: 9 optimizer steps in all, 60/200 samples (30%), ~35 s left at this rate, "
                    "loss 7.500 -> 2.250, 2000 FT tokens/s in the last 10 s")
    # with requests too, both parts
    both = progress_line(snap(0.0, before, served=1, generated=5), snap(10.0, after, served=3, generated=25))
    assert both is not None and both.startswith("coserve: 2 requests answered in the last 10 s (0 running, 0 waiting), "
                                                "2.0 generated tokens/s; fine-tuning: 9 optimizer steps in all")
    # a non-finite loss is left out, and a trainer that restarted is said
    odd = replace(after, ft_loss=float("nan"), ft_trainer_restarts=2)
    line = progress_line(snap(0.0, before), snap(10.0, odd))
    assert line is not None and "loss 7.500," in line and "nan" not in line and "2 trainer restarts" in line


def test_a_resume_behind_the_paused_count_gives_no_negative_rate() -> None:
    """A job paused after 46 steps and resumed from its checkpoint at 45 (session 31, the H100:
    "-61 FT tokens/s"): the interval's counters went back, so the line says it resumed instead of
    a rate, and gives no time left."""
    paused = replace(FT, ft_optimizer_steps=46, ft_samples_retired=46, ft_tokens_trained=20_440, ft_first_loss=12.51)
    resumed = replace(paused, ft_optimizer_steps=45, ft_samples_retired=45, ft_tokens_trained=19_830)
    line = progress_line(snap(0.0, paused), snap(10.0, resumed, served=17))
    assert line is not None and line.endswith("fine-tuning: 45 optimizer steps in all, 45/200 samples (22%), "
                                              "loss 12.510, resumed from its checkpoint in the last 10 s")
    assert "-" not in line.split("fine-tuning")[1] and "left" not in line


def test_no_finetuning_part_once_it_has_ended() -> None:
    ended = replace(FT, ft_optimizer_steps=9, adapter_path=Path("/out/adapter"), ft_outcome="succeeded")
    assert progress_line(snap(0.0, replace(FT, ft_optimizer_steps=7)), snap(10.0, ended)) is None
    line = progress_line(snap(0.0, ended), snap(10.0, ended, served=1))
    assert line is not None and "fine-tuning" not in line


def test_finished_and_failed_lines() -> None:
    done = replace(FT, ft_optimizer_steps=12, ft_tokens_trained=3_000, ft_first_loss=7.0, ft_loss=0.5,
                   adapter_path=Path("/out/adapter"), ft_outcome="succeeded")
    assert finished_line(done) == ("coserve: fine-tuning finished: 12 optimizer steps, 3000 tokens, loss 7.000 -> "
                                   "0.500; adapter: /out/adapter; serving goes on")
    assert finished_line(replace(done, ft_failure="the trainer died", ft_outcome="failed")).startswith(
        "coserve: fine-tuning gave up")
    cancelled = finished_line(replace(done, ft_outcome="cancelled", adapter_path=None))
    assert cancelled.startswith("coserve: fine-tuning stopped early") and "adapter: not exported" in cancelled


class Clock:
    def __init__(self) -> None:
        self.t = 0.0
        self.stats = FT
        self.served = 0

    def read(self) -> Snapshot:
        return snap(self.t, self.stats, served=self.served)


def test_the_reporter_prints_each_interval_and_the_end_once() -> None:
    clock, lines = Clock(), []
    reporter = ProgressReporter(clock.read, interval_s=10.0, write=lines.append)
    clock.t, clock.served = 5.0, 1
    reporter.check()
    assert lines == [], "before the interval is over"
    clock.t = 10.0
    reporter.check()
    assert len(lines) == 1 and lines[0].startswith("coserve: 1 request answered in the last 10 s")
    clock.t, clock.stats = 11.0, replace(FT, ft_optimizer_steps=3, adapter_path=Path("/out/adapter"), ft_outcome="succeeded")
    reporter.check()
    reporter.check()
    assert lines[1:] == [finished_line(clock.stats)], "the end, at once and once"
    clock.t = 30.0
    reporter.check()
    assert len(lines) == 2, "nothing happened since"


def test_a_paused_job_says_its_pause_and_later_its_end() -> None:
    clock, lines = Clock(), []
    reporter = ProgressReporter(clock.read, interval_s=0.0, write=lines.append)
    paused = replace(FT, ft_job="ftjob-1", ft_optimizer_steps=3, adapter_path=Path("/a"), ft_outcome="paused")
    clock.stats = paused
    reporter.check()
    reporter.check()
    assert len(lines) == 1 and "fine-tuning paused at a checkpoint" in lines[0]
    clock.stats = replace(paused, ft_optimizer_steps=9, ft_outcome="succeeded")
    reporter.check()
    assert len(lines) == 2 and "fine-tuning finished: 9 optimizer steps" in lines[1]


def test_an_end_the_figures_moved_past_within_a_tick_is_said_from_the_engines_ends() -> None:
    """A pause and its resume between two ticks: the figures show the resumed run, the pause is
    in the engine thread's ends."""
    clock, lines, ends = Clock(), [], []
    reporter = ProgressReporter(clock.read, interval_s=0.0, write=lines.append, ends=lambda: ends)
    paused = replace(FT, ft_job="ftjob-1", ft_optimizer_steps=3, adapter_path=Path("/a"), ft_outcome="paused")
    ends.append(paused)
    clock.stats = replace(FT, ft_job="ftjob-1", ft_optimizer_steps=4)  # (running again)
    reporter.check()
    reporter.check()
    assert lines == [finished_line(paused)]
    done = replace(paused, ft_optimizer_steps=9, ft_outcome="succeeded")
    ends.append(done)
    clock.stats = done
    reporter.check()
    assert lines == [finished_line(paused), finished_line(done)], "each end once"


def test_interval_zero_prints_only_the_end_and_a_negative_one_is_refused() -> None:
    clock, lines = Clock(), []
    reporter = ProgressReporter(clock.read, interval_s=0.0, write=lines.append)
    clock.t, clock.served = 100.0, 5
    reporter.check()
    assert lines == []
    clock.stats = replace(FT, adapter_path=Path("/out/adapter"), ft_outcome="succeeded")
    reporter.check()
    assert len(lines) == 1 and "finished" in lines[0]
    with pytest.raises(ValueError, match="--log-stats-interval"):
        ProgressReporter(clock.read, interval_s=-1.0)


def run_until_the_end_is_said(read: Callable[[], Snapshot], clock: Clock, lines: list[str]) -> None:
    """A reporter thread on ``read``; fine-tuning ends; stopped once a line is written (5 s at most)."""
    reporter = ProgressReporter(read, interval_s=10.0, write=lines.append, tick_s=0.01).start()
    clock.stats = replace(FT, adapter_path=Path("/out/adapter"), ft_outcome="succeeded")
    deadline = time.monotonic() + 5.0
    while not lines and time.monotonic() < deadline:
        time.sleep(0.01)
    reporter.stop()


def test_the_reporter_thread_writes_and_stops() -> None:
    clock, lines = Clock(), []
    run_until_the_end_is_said(clock.read, clock, lines)
    assert lines == [finished_line(clock.stats)]


def test_a_failing_read_is_logged_and_the_reporter_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    clock, lines, calls = Clock(), [], [0]

    def read() -> Snapshot:
        calls[0] += 1
        if calls[0] == 2:  # (the first read is the reporter's start)
            raise RuntimeError("a registry hiccup")
        return clock.read()

    run_until_the_end_is_said(read, clock, lines)
    assert lines == [finished_line(clock.stats)] and "the progress line failed" in caplog.text


def test_the_shutdown_says_an_end_the_reporter_has_not_said_and_no_more() -> None:
    clock, lines = Clock(), []
    reporter = ProgressReporter(clock.read, interval_s=10.0, write=lines.append)
    stopped = replace(FT, ft_optimizer_steps=4, adapter_path=Path("/out/adapter"), ft_outcome="cancelled")
    reporter.close(stopped)  # Ctrl-C while it trained: the end comes at the shutdown
    assert lines == [finished_line(stopped, serving=False)] and not lines[0].endswith("serving goes on")
    reporter.close(stopped)
    assert len(lines) == 1, "said once"
    early: list[str] = []
    said = ProgressReporter(clock.read, interval_s=10.0, write=early.append)
    clock.stats = replace(FT, adapter_path=Path("/out/adapter"), ft_outcome="succeeded")
    said.check()  # (fine-tuning ended while serving: said then, not again at the shutdown)
    said.close(clock.stats)
    assert early == [finished_line(clock.stats)]

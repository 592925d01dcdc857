"""The GPU sampler, with fake probes (no GPU here)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from coserve.bench import utilization
from coserve.bench.utilization import UtilizationSampler


def test_sampler_reads_utilization_and_clock_until_the_clock_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clocks = iter([1980.0, 1755.0])

    def clock(device: torch.device) -> float:
        try:
            return next(clocks)
        except StopIteration:
            raise RuntimeError("no clock") from None

    monkeypatch.setattr(utilization, "PROBES", (lambda device: 40.0,))
    monkeypatch.setattr(utilization, "_clock_probe", clock)
    sampler = UtilizationSampler(torch.device("cuda"), every_s=0.01)
    assert sampler.available
    sampler.start()
    time.sleep(0.2)
    samples = sampler.stop()
    assert len(samples) >= 3 and all(u == 40.0 for _, u in samples)
    assert [t for t, _ in samples] == sorted(t for t, _ in samples)
    assert sampler.clocks_mhz == [1980.0, 1755.0]  # sampling goes on without the clock
    sampler.start()
    assert sampler.clocks_mhz == []
    sampler.stop()


def test_sampler_without_a_probe_samples_nothing() -> None:
    sampler = UtilizationSampler(torch.device("cpu"), every_s=0.01)
    assert not sampler.available
    sampler.start()
    assert sampler.stop() == [] and sampler.clocks_mhz == []


def test_allocator_counters_read_the_cuda_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    from coserve.bench import runners

    stats = {"segment.all.allocated": 7, "segment.all.freed": 2, "num_alloc_retries": 1,
             "reserved_bytes.all.current": 3 * 2**30}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: stats)
    assert runners._allocator_counters(torch.device("cuda")) == {
        "device_allocs": 7.0, "device_frees": 2.0, "alloc_retries": 1.0, "reserved_gib": 3.0}
    assert runners._allocator_counters(torch.device("cpu")) is None


def test_host_cpu_busy_from_proc_stat(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3 4\n")
    before = utilization.host_cpu_times(stat)
    assert before == (1000, 850)
    stat.write_text("cpu  400 0 150 1200 50 0 0 0 0 0\n")
    after = utilization.host_cpu_times(stat)
    assert after == (1800, 1250)
    assert utilization.busy_fraction(before, after) == pytest.approx(0.5)  # 400 of 800 busy
    assert utilization.busy_fraction(after, after) is None
    assert utilization.host_cpu_times(tmp_path / "missing") is None


def test_sampler_records_host_load_and_start_time(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = iter([(1000, 900), (1100, 950), (1200, 1000), (1300, 1050)])
    monkeypatch.setattr(utilization, "PROBES", (lambda device: 10.0,))
    monkeypatch.setattr(utilization, "host_cpu_times", lambda: next(ticks, (1300, 1050)))
    monkeypatch.setattr(utilization, "_clock_probe", lambda device: 1980.0)
    sampler = UtilizationSampler(torch.device("cuda"), every_s=0.01)
    before = time.time()
    sampler.start()
    time.sleep(0.3)
    sampler.stop()
    assert sampler.started_unix_s is not None and before <= sampler.started_unix_s <= time.time()
    # three deltas of half-busy ticks, then none (no time passed on the fake host: no sample)
    assert sampler.host_cpu_busy == [0.5, 0.5, 0.5]


def test_cpu_clocks_and_a_threads_cpu_from_proc(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: X\ncpu MHz\t\t: 3400.125\n\n"
                       "processor\t: 1\ncpu MHz\t\t: 1200.000\n\nprocessor\t: 2\n")
    assert utilization.cpu_mhz(cpuinfo) == {0: 3400.125, 1: 1200.0}
    assert utilization.cpu_mhz(tmp_path / "none") is None
    cpuinfo.write_text("processor\t: 0\nBogoMIPS\t: 50.00\n")  # (an architecture without the line)
    assert utilization.cpu_mhz(cpuinfo) is None
    task = tmp_path / "4242"
    task.mkdir()
    # (a command name with spaces and a parenthesis; the CPU is field 39 of the line)
    fields = ["S"] + [str(i) for i in range(4, 39)] + ["7"] + ["0"] * 13
    (task / "stat").write_text("4242 (py thr (x)) " + " ".join(fields) + "\n")
    assert utilization.thread_cpu(4242, tmp_path) == 7
    assert utilization.thread_cpu(1, tmp_path) is None


def test_sampler_reads_the_watched_threads_cpu_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    monkeypatch.setattr(utilization, "PROBES", (lambda device: 40.0,))
    monkeypatch.setattr(utilization, "cpu_mhz", lambda: {0: 3000.0, 1: 1000.0})
    monkeypatch.setattr(utilization, "thread_cpu", lambda tid: 1)
    sampler = UtilizationSampler(torch.device("cuda"), every_s=0.01, watch_tid=threading.get_native_id())
    sampler.start()
    time.sleep(0.1)
    samples = sampler.stop()
    assert len(samples) >= 2 and len(sampler.watched_cpu_mhz) == len(samples)
    assert set(sampler.watched_cpu_mhz) == {1000.0} and set(sampler.cpu_mhz_mean) == {2000.0}

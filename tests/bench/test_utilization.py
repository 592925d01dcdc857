"""The GPU sampler, with fake probes (no GPU here)."""

from __future__ import annotations

import time

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

"""GPU utilization (and the SM clock, and how busy the host's CPUs are) sampled once a second in
a background thread while a replay runs."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

Probe = Callable[[torch.device], float]


def _torch_probe(device: torch.device) -> float:
    # NOTE: needs pynvml (nvidia-ml-py); torch raises when it is missing.
    return float(torch.cuda.utilization(device))


def _clock_probe(device: torch.device) -> float:
    # the SM clock in MHz: an idle GPU clocks down, which slows the steps after an idle gap
    return float(torch.cuda.clock_rate(device))


def host_cpu_times(stat: Path = Path("/proc/stat")) -> tuple[int, int] | None:
    """``(total, idle)`` jiffies of all the host's CPUs since boot (idle counts iowait), or None
    where ``/proc/stat`` cannot be read (not Linux)."""
    try:
        fields = stat.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:]]
    # user nice system idle iowait irq softirq steal (guest time is already in user / nice)
    return sum(ticks[:8]), ticks[3] + (ticks[4] if len(ticks) > 4 else 0)


def cpu_mhz(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[int, float] | None:
    """Each CPU's current clock in MHz as ``/proc/cpuinfo`` gives it (``processor`` -> ``cpu MHz``),
    or None where it cannot be read or gives none (not Linux, or an architecture without it; a
    virtual machine may give a fixed figure)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    out: dict[int, float] = {}
    cpu: int | None = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        try:
            if key == "processor":
                cpu = int(value)
            elif key == "cpu MHz" and cpu is not None:
                out[cpu] = float(value)
        except ValueError:
            continue
    return out or None


def thread_cpu(tid: int, proc: Path = Path("/proc/self/task")) -> int | None:
    """The CPU that thread ``tid`` (a native id: ``threading.get_native_id()``) last ran on, or
    None where ``/proc`` cannot tell (field 39 of ``/proc/self/task/TID/stat``)."""
    try:
        stat = (proc / str(tid) / "stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # (after the command name, which may hold spaces)
    try:
        return int(fields[36])  # (field 39 of the whole line: the 37th after the name)
    except (IndexError, ValueError):
        return None


def busy_fraction(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """The share of the host's CPU time that was not idle between two :func:`host_cpu_times`."""
    total, idle = after[0] - before[0], after[1] - before[1]
    return None if total <= 0 else 1.0 - idle / total


# Tried in order; the first that answers on the device is used for the whole run.
PROBES: tuple[Probe, ...] = (_torch_probe,)


def find_probe(device: torch.device) -> Probe | None:
    """A probe that reads ``device``'s utilization, or None (CPU, or no probe answers)."""
    if device.type != "cuda":
        return None
    for probe in PROBES:
        try:
            probe(device)
        except Exception as e:  # any failure means: this probe is unavailable here
            logger.info("GPU utilization probe %s unavailable: %s", probe.__name__, e)
            continue
        return probe
    logger.warning(
        "no GPU utilization probe works here (torch.cuda.utilization needs nvidia-ml-py): "
        "utilization is reported as null"
    )
    return None


class UtilizationSampler:
    """``start()``, then ``stop() -> [(t, percent), …]`` with ``t`` in seconds since ``start``;
    ``clocks_mhz`` then holds the SM clock read with each sample (where the device reports it),
    ``host_cpu_busy`` the share of all the host's CPUs busy since the previous sample (where
    ``/proc/stat`` can be read: a replay on another GPU of the same host shows up there) and
    ``started_unix_s`` the wall-clock time of ``start`` (to line up runs of two processes).

    Samples every ``every_s`` seconds; with no probe it samples nothing and ``stop`` returns ``[]``.
    """

    def __init__(self, device: torch.device, every_s: float = 1.0, watch_tid: int | None = None) -> None:
        self.probe = find_probe(device)
        self.device = device
        self.every_s = every_s
        self._samples: list[tuple[float, float]] = []
        self.clocks_mhz: list[float] = []
        self.host_cpu_busy: list[float] = []
        # with ``watch_tid`` (a thread's native id): with each sample, the clock in MHz of the CPU
        # that thread last ran on, and the mean over the host's CPUs (None where unknown)
        self.watch_tid = watch_tid
        self.watched_cpu_mhz: list[float | None] = []
        self.cpu_mhz_mean: list[float | None] = []
        self.started_unix_s: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self.probe is not None

    def start(self) -> None:
        self._samples = []
        self.clocks_mhz = []
        self.host_cpu_busy = []
        self.watched_cpu_mhz = []
        self.cpu_mhz_mean = []
        self.started_unix_s = time.time()
        self._stop.clear()
        if self.probe is None:
            return
        self._thread = threading.Thread(
            target=self._run,
            args=(self.probe, time.monotonic()),
            name="gpu-utilization",
            daemon=True,
        )
        self._thread.start()

    def _run(self, probe: Probe, t0: float) -> None:
        clock: Probe | None = _clock_probe
        host = host_cpu_times()
        while not self._stop.wait(self.every_s):
            try:
                self._samples.append((time.monotonic() - t0, probe(self.device)))
            except Exception as e:  # a failing probe ends sampling, never the benchmark
                logger.warning("GPU utilization sampling stopped: %s", e)
                return
            if clock is not None:
                try:
                    self.clocks_mhz.append(clock(self.device))
                except Exception as e:
                    logger.info("SM clock unavailable: %s", e)
                    clock = None
            if host is not None:
                now = host_cpu_times()
                busy = busy_fraction(host, now) if now is not None else None
                if busy is not None:
                    self.host_cpu_busy.append(busy)
                host = now
            if self.watch_tid is not None:
                self._sample_cpu_clock(self.watch_tid)

    def _sample_cpu_clock(self, tid: int) -> None:
        clocks = cpu_mhz()
        cpu = thread_cpu(tid)
        self.watched_cpu_mhz.append(clocks.get(cpu) if clocks is not None and cpu is not None else None)
        self.cpu_mhz_mean.append(sum(clocks.values()) / len(clocks) if clocks else None)

    def stop(self) -> list[tuple[float, float]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        return list(self._samples)

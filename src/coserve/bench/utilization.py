"""GPU utilization (and the SM clock) sampled once a second in a background thread while a
replay runs."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

Probe = Callable[[torch.device], float]


def _torch_probe(device: torch.device) -> float:
    # NOTE: needs pynvml (nvidia-ml-py); torch raises when it is missing.
    return float(torch.cuda.utilization(device))


def _clock_probe(device: torch.device) -> float:
    # the SM clock in MHz: an idle GPU clocks down, which slows the steps after an idle gap
    return float(torch.cuda.clock_rate(device))


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
    ``clocks_mhz`` then holds the SM clock read with each sample (where the device reports it).

    Samples every ``every_s`` seconds; with no probe it samples nothing and ``stop`` returns ``[]``.
    """

    def __init__(self, device: torch.device, every_s: float = 1.0) -> None:
        self.probe = find_probe(device)
        self.device = device
        self.every_s = every_s
        self._samples: list[tuple[float, float]] = []
        self.clocks_mhz: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self.probe is not None

    def start(self) -> None:
        self._samples = []
        self.clocks_mhz = []
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

    def stop(self) -> list[tuple[float, float]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        return list(self._samples)

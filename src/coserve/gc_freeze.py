"""Keep Python's cyclic garbage collector off the serving path's critical steps.

A full (oldest-generation) collection walks every tracked object of the process: after torch,
transformers and a loaded engine that is a quarter of a million objects and ~70 ms (CPU,
measured: bench/results/diagnostic/README.md). The collector starts one whenever enough container objects were
allocated, so an eager engine step, which allocates many, now and then took 70 ms longer, or
140 ms: on the H200 the slow first replay of a benchmark was exactly that (steps of 55, 125,
200 ms at the same batch; bench/results/diagnostic/README.md). Objects that live as long as the
process are moved out of the collector's reach once start-up is over (``gc.freeze``), as
long-running Python servers do; a later full collection then walks only what serving created.
"""

from __future__ import annotations

import atexit
import gc
import logging
import time

logger = logging.getLogger(__name__)
_unfreeze_at_exit = False


def freeze_startup_objects(what: str) -> None:
    """Collect once, then freeze every object alive now (they are never collected again, but
    are still freed when their reference count drops to zero). ``what`` names the caller in
    the log. Idempotent: a later call freezes what was allocated since."""
    global _unfreeze_at_exit
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    if not _unfreeze_at_exit:
        # at exit, frozen objects are finalized like any other (extension modules report the
        # objects they still own otherwise)
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True
    logger.info("%s: %d objects frozen out of the garbage collector (%.0f ms)",
                what, gc.get_freeze_count(), (time.perf_counter() - start) * 1e3)


class GCClock:
    """Seconds spent in Python's garbage collector (``gc.callbacks``), for the interruption
    points' record and the trainer's stretches: a collection is one reason a host stalls."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._began = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.total_s += time.perf_counter() - self._began

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

"""The engine's and the trainer's processes on CPUs of their own (``COSERVE_ENGINE_CPUS``).

On a GPU host the engine's step time is partly its host's: each step's enqueue, and the time
after its GPU work. The trainer's host thread spins in kernel launches beside it (on a full launch
queue, behind a closed gate), and the two processes' intra-op thread pools share the cores. With
``COSERVE_ENGINE_CPUS=N`` the engine keeps the lowest-numbered N CPUs of its affinity mask, taken
as whole cores (a core's hyperthread siblings go with it, from ``/sys``: Linux often numbers a
core's second thread far from its first, and a trainer thread there would share the engine's core),
and the trainer gets the rest, so that neither's threads run on the other's cores; each process
keeps no more intra-op threads than its CPUs. Off by default (0); an A/B switch for
noisy hosts (DEVELOPERS.md, "Device runs waiting").
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Final

import torch

logger = logging.getLogger(__name__)

ENGINE_CPUS_ENV: Final = "COSERVE_ENGINE_CPUS"


def engine_cpus_from_env() -> int:
    """``COSERVE_ENGINE_CPUS`` as a count (0: no split); a value that is not a count is an error
    that names the variable."""
    raw = os.environ.get(ENGINE_CPUS_ENV, "0").strip() or "0"
    try:
        count = int(raw)
    except ValueError:
        raise ValueError(f"{ENGINE_CPUS_ENV} must be a whole number of CPUs, got {raw!r}") from None
    if count < 0:
        raise ValueError(f"{ENGINE_CPUS_ENV} must be 0 (no split) or more, got {count}")
    return count


_sched_getcpu: Callable[[], int] | None = None


def current_cpu() -> int | None:
    """The CPU this thread runs on now (glibc's ``sched_getcpu``, a vDSO read), None where it
    cannot be told. The latency run's step table keeps the engine's at each step's end
    (``host_cpu``): whether a host that runs a step's enqueue slower in stretches moved the
    engine's thread between CPUs."""
    global _sched_getcpu
    if _sched_getcpu is None:
        try:
            _sched_getcpu = ctypes.CDLL(None, use_errno=True).sched_getcpu
        except (OSError, AttributeError):
            _sched_getcpu = lambda: -1  # noqa: E731 (none on this platform: asked once)
    cpu = _sched_getcpu()
    return cpu if cpu >= 0 else None


def core_siblings(cpu: int) -> frozenset[int]:
    """The CPUs that share ``cpu``'s core (itself included), from ``/sys``; just ``cpu`` where the
    topology cannot be read."""
    path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
    try:
        with open(path) as f:
            return frozenset(parse_cpu_list(f.read())) | {cpu}
    except (OSError, ValueError):
        return frozenset({cpu})


def parse_cpu_list(text: str) -> list[int]:
    """A Linux CPU list (``"0-3,8,10-11"``) as CPU numbers."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def split_cpus(allowed: Iterable[int], engine: int,
               siblings: Callable[[int], frozenset[int]] = lambda cpu: frozenset({cpu}),
               ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The engine's CPUs and the trainer's, or None where there is nothing to split (``engine`` 0,
    or no CPU left for the trainer). The engine takes whole cores, the lowest-numbered CPU's first,
    each with its allowed ``siblings``, until it holds ``engine`` CPUs or more; the trainer the rest."""
    mask = set(allowed)
    cpus = sorted(mask)
    if engine <= 0:
        return None
    ours: set[int] = set()
    for cpu in cpus:
        if len(ours) >= engine:
            break
        if cpu not in ours:
            ours |= siblings(cpu) & mask
    theirs = [c for c in cpus if c not in ours]
    if not theirs:
        return None
    return tuple(sorted(ours)), tuple(theirs)


def pin_process(cpus: Sequence[int]) -> int:
    """Every thread of this process (and so the threads it starts later) onto ``cpus``; returns
    how many threads were moved. Linux only (``/proc/self/task``); a thread that ended meanwhile
    is skipped."""
    mask = set(cpus)
    moved = 0
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]  # (no /proc: the calling thread alone)
    for tid in tids:
        try:
            os.sched_setaffinity(tid, mask)
        except ProcessLookupError:
            continue
        moved += 1
    return moved


_split_made: dict[int, tuple[tuple[int, ...], tuple[int, ...]] | None] = {}
"""The split made in this process, by engine count: made once, from the CPUs allowed before it
(a trainer restarted later gets the same CPUs, not a split of the engine's share)."""


def split_for_trainer() -> tuple[int, ...]:
    """Where ``COSERVE_ENGINE_CPUS`` asks for a split and there are CPUs to split: this (the
    engine's) process pinned to its share, and the trainer's share returned for the worker to pin
    itself to (``WorkerSpec.cpus``; a spawned process would inherit the engine's); else ``()`` and
    nothing changed."""
    engine = engine_cpus_from_env()
    if not engine:
        return ()
    if not hasattr(os, "sched_getaffinity"):
        logger.warning("%s=%d: this platform has no CPU affinity; not split", ENGINE_CPUS_ENV, engine)
        return ()
    if engine not in _split_made:
        allowed = os.sched_getaffinity(0)
        _split_made[engine] = split_cpus(allowed, engine, core_siblings)
        if _split_made[engine] is None:
            logger.warning("%s=%d: of the %d CPUs allowed, none would be left for the trainer once the engine "
                           "has its whole cores; not split", ENGINE_CPUS_ENV, engine, len(allowed))
    split = _split_made[engine]
    if split is None:
        return ()
    ours, theirs = split
    moved = pin_process(ours)
    fit_threads(ours)
    logger.info("engine: %d threads on CPUs %s, the trainer on %s", moved, list(ours), list(theirs))
    return theirs


def fit_threads(cpus: Sequence[int]) -> None:
    """No more intra-op threads than ``cpus`` (torch counts the host's cores at start: on fewer,
    its threads would take turns on them)."""
    if torch.get_num_threads() > len(cpus):
        torch.set_num_threads(len(cpus))

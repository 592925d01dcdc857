"""CUDA MPS: lets the trainer's kernels run beside the engine's instead of time-slicing with them.

Both processes must be MPS clients, i.e. the control daemon must be running before either
initializes CUDA. :func:`start_mps_daemon` starts it (call it before anything touches CUDA);
:func:`mps_active` tells whether a daemon answers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

MPS_SHARE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MPS_PRIORITY_ENV = "CUDA_MPS_CLIENT_PRIORITY"


def _pipe_dir() -> Path:
    return Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))


def mps_active() -> bool:
    """True when an MPS control daemon is running (its control pipe exists)."""
    return (_pipe_dir() / "control").exists()


def share_of_this_process() -> int | None:
    """The SM share (percent) this process runs at as an MPS client: its
    ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` where a daemon is running and the value is below 100,
    else None (the whole GPU)."""
    value = os.environ.get(MPS_SHARE_ENV, "").strip()
    try:
        percent = int(float(value))
    except ValueError:
        return None
    return percent if 0 < percent < 100 and mps_active() else None


def start_mps_daemon() -> bool:
    """Start ``nvidia-cuda-mps-control -d`` if it is not running; True if MPS is active after.

    NOTE: must run before this process initializes CUDA, or this process is not an MPS client.
    """
    if mps_active():
        return True
    exe = shutil.which("nvidia-cuda-mps-control")
    if exe is None:
        logger.warning("CUDA MPS is not available (no nvidia-cuda-mps-control): the trainer's kernels "
                       "will time-slice with the engine's")
        return False
    result = subprocess.run([exe, "-d"], capture_output=True, text=True, check=False)
    if result.returncode != 0 or not mps_active():
        logger.warning("could not start the CUDA MPS daemon (%s): the trainer's kernels will time-slice "
                       "with the engine's", (result.stderr or result.stdout).strip() or result.returncode)
        return False
    logger.info("started the CUDA MPS control daemon")
    return True


@contextlib.contextmanager
def mps_share(percent: int | None, below_normal: bool = False) -> Iterator[None]:
    """Within the block, a process spawned gets at most ``percent`` of the SMs under MPS (the
    child reads ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` when it initializes CUDA); ``None``: no limit.
    ``below_normal``: it also starts as a below-normal-priority MPS client
    (``CUDA_MPS_CLIENT_PRIORITY=1``, a hint to the scheduler that newer drivers honour)."""
    env = {}
    if percent is not None:
        env[MPS_SHARE_ENV] = str(percent)
    if below_normal:
        env[MPS_PRIORITY_ENV] = "1"
    old = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value

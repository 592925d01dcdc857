"""Where a benchmark figure comes from: commit, device, versions, the exact command line.

The same fields as ``bench/speed_common.py``'s ``provenance()`` (DEVELOPERS.md, "Benchmark
results"), for results written by the installed package.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from typing import Any

import torch


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _device() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"name": "cpu", "cpus": os.cpu_count()}
    props = torch.cuda.get_device_properties(0)
    smi = subprocess.run(
        [
            "nvidia-smi",
            "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem",
            "--format=csv,noheader",
        ],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {
        "name": props.name,
        "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "cuda": torch.version.cuda,
        "driver_maxclocks": smi,
    }


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    """``commit`` (``git``, or ``COSERVE_COMMIT`` / ``COSERVE_DIRTY`` where the tree has no
    ``.git``), ``dirty``, ``device``, ``versions`` and ``command`` (``argv``, default
    ``sys.argv``, behind the interpreter, after the switches set in the environment, :data:`SWITCH_PREFIXES`:
    the A/B runs differ only there)."""
    # NOTE: the variables win over git: a copied tree (the device machine) may carry a .git whose
    # status differs from the checkout it was copied from.
    commit = os.environ.get("COSERVE_COMMIT") or _git("rev-parse", "HEAD") or "unknown"
    status = _git("status", "--porcelain")
    dirty: bool | str
    if "COSERVE_DIRTY" in os.environ:
        dirty = os.environ["COSERVE_DIRTY"] == "1"
    else:
        dirty = bool(status) if status is not None else "unknown"
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "commit": commit,
        "dirty": dirty,
        "device": _device(),
        "versions": {
            "torch": torch.__version__,
            "triton": triton_version,
            "python": sys.version.split()[0],
        },
        "command": " ".join(
            [*_switches(), *(shlex.quote(a) for a in [sys.executable, *_redacted(sys.argv if argv is None else argv)])]
        ),
    }


SECRET_FLAGS = ("--api-key",)
SECRET_VARIABLES = ("COSERVE_API_KEY",)
"""What a result file's command never shows (an API key is written as ``***``)."""


def _redacted(argv: list[str]) -> list[str]:
    out, hide = [], False
    for a in argv:
        flag, eq, _ = a.partition("=")
        if hide:
            out.append("***")
        elif eq and flag in SECRET_FLAGS:
            out.append(f"{flag}=***")
        else:
            out.append(a)
        hide = a in SECRET_FLAGS
    return out


SWITCH_PREFIXES = ("COSERVE_", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_CLIENT_PRIORITY")
"""The variables a result's command names: coserve's switches, and this process's own MPS share and
priority (an engine run as a limited MPS client times differently; the trainer's share is a flag)."""


def _switches() -> list[str]:
    """``NAME=value`` of every variable of :data:`SWITCH_PREFIXES` set, except the provenance's own."""
    return [f"{k}={'***' if k in SECRET_VARIABLES else shlex.quote(v)}" for k, v in sorted(os.environ.items())
            if k.startswith(SWITCH_PREFIXES) and k not in ("COSERVE_COMMIT", "COSERVE_DIRTY")]

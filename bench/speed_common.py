"""Shared pieces of the speed benchmarks: model shapes, provenance, ceilings, timers."""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}


def write_model_dir(path: Path, config: dict[str, Any]) -> Path:
    """A model directory holding only ``config.json`` (weights come from ``load_format="dummy"``)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def provenance() -> dict[str, Any]:
    """Commit (``git``, or ``COSERVE_COMMIT``/``COSERVE_DIRTY`` where the tree has no ``.git``),
    device, versions and the exact command line."""
    commit = _git("rev-parse", "HEAD") or os.environ.get("COSERVE_COMMIT", "unknown")
    status = _git("status", "--porcelain")
    dirty = bool(status) if status is not None else os.environ.get("COSERVE_DIRTY", "unknown") == "1"
    device: dict[str, Any] = {"name": "cpu"}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem", "--format=csv,noheader"],
            capture_output=True, text=True, check=False,
        ).stdout.strip()
        device = {
            "name": props.name, "sms": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1), "cuda": torch.version.cuda,
            "driver_maxclocks": smi,
        }
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "commit": commit, "dirty": dirty, "device": device,
        "versions": {"torch": torch.__version__, "triton": triton_version, "python": sys.version.split()[0]},
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
    }


TINY: dict[str, Any] = {
    **LLAMA3_8B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 4096,
}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cuda_time(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn`` on the current stream, timed with CUDA events (host clock on CPU)."""
    if not torch.cuda.is_available():
        return wall_time(fn, iters, warmup)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def wall_time(fn: Callable[[], object], iters: int = 10, warmup: int = 3) -> float:
    """Median host seconds of ``fn`` including its device work (synchronized before and after)."""
    import time

    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(gib: float = 4.0) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    n = int(gib * 2**30) // 2
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), iters=20)
    return 2 * n * 2 / t


def matmul_rate(n: int = 8192) -> float:
    """Dense bf16 matrix product rate in FLOP/s on random data (rotating two input sets)."""
    mats = [(torch.randn(n, n, dtype=torch.bfloat16, device="cuda"),
             torch.randn(n, n, dtype=torch.bfloat16, device="cuda")) for _ in range(2)]
    out = torch.empty(n, n, dtype=torch.bfloat16, device="cuda")
    step = iter(range(10**9))

    def run() -> None:
        a, b = mats[next(step) % 2]
        torch.matmul(a, b, out=out)

    t = cuda_time(run, iters=20)
    return 2 * n**3 / t


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` in float64 (NaN counts as a failure: returns inf)."""
    if out.isnan().any():
        return float("inf")
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()

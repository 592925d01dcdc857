"""A step's small host-built inputs (token ids, positions, block tables, LoRA routing) on their
way to the device.

``torch.tensor(values, device="cuda")`` copies from pageable host memory, and torch waits for the
stream after such a copy: the host cannot build step N+1's inputs until the GPU has finished every
kernel queued before, step N's included when N sampled nothing (a prompt's middle chunk, an
FT-only step), so the GPU idles while the host prepares each step. Through pinned memory the copy
is queued like a kernel and the host goes on (the caching host allocator keeps the pinned buffer
until the copy is done).

``COSERVE_PINNED_INPUTS=1`` turns the pinned path on (off until measured on the GPU); elsewhere,
and on the CPU, these are plain ``torch.tensor`` / ``Tensor.to`` calls.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

PINNED_INPUTS = os.environ.get("COSERVE_PINNED_INPUTS", "0") == "1"


def _pinned(device: torch.device) -> bool:
    return PINNED_INPUTS and device.type == "cuda"


def device_tensor(values: Sequence[Any], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)``, not waiting for the stream on CUDA
    with :data:`PINNED_INPUTS`."""
    dev = torch.device(device)
    if _pinned(dev):
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(dev, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=dev)


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor.to(device)`` for a host tensor, not waiting for the stream on CUDA with
    :data:`PINNED_INPUTS`."""
    dev = torch.device(device)
    if _pinned(dev) and tensor.device.type == "cpu":
        return tensor.pin_memory().to(dev, non_blocking=True)
    return tensor.to(dev)

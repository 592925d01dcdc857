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

import numpy as np
import torch

PINNED_INPUTS = os.environ.get("COSERVE_PINNED_INPUTS", "0") == "1"


def _pinned(device: torch.device) -> bool:
    return PINNED_INPUTS and device.type == "cuda"


# torch dtypes whose host tensors are built through numpy (host_tensor)
_NUMPY_INTS = {torch.int32: np.int32, torch.int64: np.int64}


def host_tensor(values: Sequence[Any], dtype: torch.dtype) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on the host. Integer lists (flat, or nested and
    rectangular) go through ``numpy.array``, whose loop over a Python list is ~3.5× faster than
    torch's (1,832 ints: 28 against 99 µs on the dev VM): a step's token ids, positions and slots
    are thousands of them."""
    np_dtype = _NUMPY_INTS.get(dtype)
    if np_dtype is None:
        return torch.tensor(values, dtype=dtype)
    return torch.from_numpy(np.array(values, dtype=np_dtype))


def padded_rows(rows: Sequence[Sequence[int]], width: int, fill: int, dtype: torch.dtype) -> torch.Tensor:
    """``[len(rows), width]`` host tensor of ``rows``, each padded with ``fill`` (an integer
    ``dtype``): filled row by row in numpy instead of padding every list and converting the
    nest (a step's block tables: 68 rows of ~100 blocks, 877 against 126 µs on the dev VM)."""
    out = np.full((len(rows), width), fill, dtype=_NUMPY_INTS[dtype])
    for r, row in enumerate(rows):
        out[r, : len(row)] = row
    return torch.from_numpy(out)


def device_tensor(values: Sequence[Any] | torch.Tensor, dtype: torch.dtype,
                  device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` (``values``: a list, or a host tensor
    of ``dtype``), not waiting for the stream on CUDA with :data:`PINNED_INPUTS`."""
    dev = torch.device(device)
    host = values if isinstance(values, torch.Tensor) else host_tensor(values, dtype)
    if _pinned(dev):
        return host.pin_memory().to(dev, non_blocking=True)
    return host.to(dev)


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor.to(device)`` for a host tensor, not waiting for the stream on CUDA with
    :data:`PINNED_INPUTS`."""
    dev = torch.device(device)
    if _pinned(dev) and tensor.device.type == "cpu":
        return tensor.pin_memory().to(dev, non_blocking=True)
    return tensor.to(dev)

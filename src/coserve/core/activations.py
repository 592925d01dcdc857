"""Where captured fine-tuning activations wait for the backward pass.

A preallocated buffer ``[num_layers + 1, capacity, d]`` (model dtype): plane ``l`` holds the
residual-stream input of decoder layer ``l`` for every captured token, plane ``num_layers`` the
final hidden state before the last norm. Tokens are reserved contiguously per step; the whole
buffer is released when the backward task that uses it is done (admission is closed meanwhile,
so at most one task's activations live here). The buffer is shared with the trainer process
(shared memory on CPU, CUDA IPC on GPU) and never reallocated.
"""

from __future__ import annotations

import torch


class ActivationStore:
    def __init__(self, num_layers: int, capacity: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        if capacity <= 0:
            raise ValueError(f"activation store capacity must be positive, got {capacity}")
        self.tensor = torch.zeros(num_layers + 1, capacity, hidden_size, dtype=dtype, device=device)
        if self.tensor.device.type == "cpu":
            self.tensor.share_memory_()
        self.capacity = capacity
        self.used = 0

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def reserve(self, n: int) -> int:
        """Reserve ``n`` contiguous tokens; returns their offset."""
        if n > self.free:
            raise RuntimeError(f"activation store: {n} tokens asked, {self.free} free")
        offset = self.used
        self.used += n
        return offset

    def unreserve_from(self, offset: int) -> None:
        """Drop the reservations from ``offset`` on (an interrupted step's tokens)."""
        self.used = min(self.used, offset)

    def reset(self) -> None:
        self.used = 0

    def capture(self, layer: int, offset: int, hidden: torch.Tensor) -> None:
        """``plane[layer][offset : offset + len(hidden)] = hidden``."""
        self.tensor[layer, offset : offset + hidden.shape[0]].copy_(hidden)

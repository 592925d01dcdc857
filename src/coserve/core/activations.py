"""Where captured fine-tuning activations wait for the backward pass.

A preallocated buffer ``[num_layers + 1, regions · capacity, d]`` (model dtype): plane ``l``
holds the residual-stream input of decoder layer ``l`` for every captured token, plane
``num_layers`` the final hidden state before the last norm. Each backward task owns one region
of ``capacity`` tokens from its first capture until its backward is done; with two regions the
next task of the same optimizer step can be captured while the trainer differentiates the
previous one. Tokens are reserved contiguously inside a region. The buffer is shared with the
trainer process (shared memory on CPU, CUDA IPC on GPU) and never reallocated.

With ``mlp_width`` (``2 · intermediate_size``) a second buffer ``mlp [num_layers, regions ·
capacity, mlp_width]`` keeps every layer's gate/up projection output of the same tokens: the
trainer then differentiates the MLP from it instead of recomputing the two largest matmuls of
each layer (at ``2 · mlp_width`` bytes per token and layer).
"""

from __future__ import annotations

import torch


class ActivationStore:
    def __init__(self, num_layers: int, capacity: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device | str, regions: int = 1, mlp_width: int = 0) -> None:
        if capacity <= 0 or regions <= 0:
            raise ValueError(f"activation store: capacity and regions must be positive, got {capacity}, {regions}")
        tokens = regions * capacity
        need = tokens * ((num_layers + 1) * hidden_size + num_layers * mlp_width) * dtype.itemsize
        if torch.device(device).type == "cuda":
            free, _ = torch.cuda.mem_get_info(torch.device(device))
            if need > free:
                raise RuntimeError(
                    f"activation store: {need / 2**30:.1f} GiB needed for {tokens} tokens"
                    f"{' with MLP activations' if mlp_width else ''}, {free / 2**30:.1f} GiB free on {device}: "
                    "lower --gpu-memory-utilization or --backward-tokens"
                    f"{', or drop --save-mlp-activations' if mlp_width else ''}"
                )
        self.tensor = torch.zeros(num_layers + 1, regions * capacity, hidden_size, dtype=dtype, device=device)
        self.mlp: torch.Tensor | None = None
        if mlp_width > 0:
            self.mlp = torch.zeros(num_layers, regions * capacity, mlp_width, dtype=dtype, device=device)
        for t in (self.tensor, self.mlp):
            if t is not None and t.device.type == "cpu":
                t.share_memory_()
        self.capacity = capacity
        self.regions = regions
        self._used = [0] * regions

    def used(self, region: int = 0) -> int:
        return self._used[region]

    def free(self, region: int = 0) -> int:
        return self.capacity - self._used[region]

    def reserve(self, n: int, region: int = 0) -> int:
        """Reserve ``n`` contiguous tokens in ``region``; returns their offset in the buffer."""
        if n > self.free(region):
            raise RuntimeError(f"activation store region {region}: {n} tokens asked, {self.free(region)} free")
        offset = region * self.capacity + self._used[region]
        self._used[region] += n
        return offset

    def unreserve_from(self, offset: int) -> None:
        """Drop the reservations from buffer ``offset`` on, inside its region (an interrupted step)."""
        region = offset // self.capacity
        self._used[region] = min(self._used[region], offset - region * self.capacity)

    def reset(self, region: int = 0) -> None:
        self._used[region] = 0

    def capture(self, layer: int, offset: int, hidden: torch.Tensor) -> None:
        """``plane[layer][offset : offset + len(hidden)] = hidden``."""
        self.tensor[layer, offset : offset + hidden.shape[0]].copy_(hidden)

    def capture_mlp(self, layer: int, offset: int, gate_up: torch.Tensor) -> None:
        """``mlp[layer][offset : offset + len(gate_up)] = gate_up`` (a store with MLP planes)."""
        assert self.mlp is not None, "this activation store keeps no MLP activations"
        self.mlp[layer, offset : offset + gate_up.shape[0]].copy_(gate_up)

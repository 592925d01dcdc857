"""The engine's configuration: one frozen dataclass, checked when built."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EngineConfig:
    """Settings of the built-in engine. A bad value fails here with a message naming the field."""

    model: str = "tiny"
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.85
    cpu_kv_cache_gb: float = 0.25
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    max_loras: int = 4
    max_lora_rank: int = 16
    num_training_slots: int = 0
    attention_backend: str = "auto"
    skip_tokenizer_init: bool = False
    lora_backend: str = "auto"
    enforce_eager: bool = False
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
    # Run every eager step's shape class once at start-up so that no Triton kernel compiles while
    # serving (engine/warmup.py): "auto" on CUDA only (the CPU has nothing to compile), "on", "off".
    warmup: str = "auto"
    # "high": the engine's GPU work runs on the device's highest-priority stream, so that the
    # GPU's block scheduler serves inference before the co-located trainer's work (which keeps
    # the default, lowest priority; under MPS the trainer also starts as a below-normal client).
    # "default": the default stream. No effect off CUDA.
    stream_priority: str = "default"
    # With the warm-up: also run each base-weight GEMM at every token count an eager step can
    # have (engine/warmup.py gemm_sweep; ~2 s for the 8B shape at 2,048 tokens, by FLOPs).
    warmup_gemms: bool = False
    # Piecewise CUDA graphs for the steps that carry prefill or fine-tuning rows
    # (engine/prefill_graphs.py): everything between two attention calls replayed per token-count
    # bucket, the attention eager. CUDA only (with the decode graphs; nothing on the CPU or with
    # enforce_eager); buckets above max_num_batched_tokens are dropped. On since session 12: on the
    # H200 they trained 8,919 FT tokens/s on burst-dense against 7,392 eager at the same attainment,
    # 6,546 against 6,095 on azure2023_code (session 10), and the latency model's prefill error is
    # 4.2% median through them against 8-11% eager (DEVELOPERS.md).
    prefill_graphs: bool = True
    # Automatic prefix caching (engine/block_manager.py): a request whose first tokens (whole
    # blocks, same adapter) were computed before reuses their KV and prefills only the rest.
    enable_prefix_caching: bool = False
    prefill_graph_buckets: tuple[int, ...] = (128, 256, 512, 768, 1024, 1536, 2048)

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_lora_rank")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_loras < 0 or self.num_training_slots < 0:
            raise ValueError("max_loras and num_training_slots must be >= 0")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.device.startswith("cuda"):
            _check_cuda_device(self.device)
        if self.warmup not in ("auto", "on", "off"):
            raise ValueError(f"warmup must be auto, on or off, got {self.warmup!r}")
        if self.stream_priority not in ("default", "high"):
            raise ValueError(f"stream_priority must be default or high, got {self.stream_priority!r}")
        for name in ("cuda_graph_batch_sizes", "prefill_graph_buckets"):
            sizes = getattr(self, name)
            if not all(isinstance(n, int) and n > 0 for n in sizes) or list(sizes) != sorted(set(sizes)):
                raise ValueError(f"{name} must be increasing positive integers, got {sizes!r}")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def runs_warmup(self) -> bool:
        """Whether the engine warms up at start-up (``auto``: on CUDA)."""
        return self.warmup == "on" or (self.warmup == "auto" and self.torch_device.type == "cuda")

    def kernel_backend(self, name: str) -> str:
        """Resolve ``auto`` for an attention/LoRA backend: Triton on CUDA when it imports, else
        the torch reference."""
        if name != "auto":
            return name
        if self.torch_device.type != "cuda":
            return "torch"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch"
        return "triton"

    @property
    def num_lora_slots(self) -> int:
        """Inference adapter slots followed by training slots."""
        return self.max_loras + self.num_training_slots


def _check_cuda_device(device: str) -> None:
    """Refuse a CUDA device this host cannot give (torch fails there later with an
    ``AssertionError: Torch not compiled with CUDA enabled`` or an invalid-ordinal error)."""
    try:
        index = torch.device(device).index
    except RuntimeError:
        raise ValueError(f"--device {device}: not a device; use auto, cpu, cuda or cuda:N") from None
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ValueError(f"--device {device}: {why}; use --device cpu (or auto, which picks the CPU here)")
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise ValueError(f"--device {device}: this host has {count} CUDA GPU{'s' if count != 1 else ''} "
                         f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''}); give one of those")

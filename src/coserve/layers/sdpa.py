"""torch's ``scaled_dot_product_attention``, kept off its cuDNN backend.

On Hopper, torch prefers cuDNN's attention for bf16. cuDNN builds an execution plan for every new
shape and caches it by shape, and the build costs milliseconds of host time (tens of them for the
backward). Prefill chunks and fine-tuning rows come in every length, so almost every call built a
plan: on the H200 at the Llama-3-8B shape, cuDNN attention took 70% of the engine's host time in
the first replay of azure2023_code (eager steps of 2,048 tokens needed 90–150 ms of host time
against ~20 ms with the plans cached; bench/results/diagnostic/README.md, session 4), and a
replay of the same arrivals ran faster only because their lengths were cached by then. Flash and
memory-efficient attention have no per-shape plan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, **kwargs)`` with the cuDNN backend disabled."""
    with sdpa_kernel(BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


@contextmanager
def sdpa_calls() -> Iterator[Callable[..., torch.Tensor]]:
    """``F.scaled_dot_product_attention`` under :func:`sdpa`'s backend choice, for a loop of
    calls in one context: ``with sdpa_calls() as attend: ... attend(q, k, v, **kwargs)``.

    NOTE: entering ``sdpa_kernel`` costs ~9 µs of host time (measured on CPU), which
    :func:`sdpa` pays per call: the trainer's recompute makes one call per row length and layer.
    """
    with sdpa_kernel(BACKENDS):
        yield F.scaled_dot_product_attention

"""Fixtures of the layer tests."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from coserve.layers import triton_lora


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Counts the LoRA kernels' launches by kernel name."""
    counts: Counter[str] = Counter()
    real = triton_lora.jit

    class Counting:
        def __init__(self, fn: Any) -> None:
            self.name, self.kernel = fn.__name__, real(fn)

        def __getitem__(self, grid: Any) -> Any:
            launcher = self.kernel[grid]

            def launch(*args: Any, **kwargs: Any) -> Any:
                counts[self.name] += 1
                return launcher(*args, **kwargs)

            return launch

    monkeypatch.setattr(triton_lora, "jit", Counting)
    yield counts

"""Synthetic fine-tuning data for the benchmarks: pre-tokenized samples of a chosen length law."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LengthLaw:
    """Sample lengths in tokens, uniform on ``[lo, hi]`` (``lo == hi``: fixed); ``spec`` is the
    ``--ft-lengths`` text it came from."""

    lo: int
    hi: int
    spec: str

    def __post_init__(self) -> None:
        if not 2 <= self.lo <= self.hi:
            raise ValueError(f"--ft-lengths {self.spec!r}: lengths must satisfy 2 <= lo <= hi")

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)


def _fixed(arg: str) -> tuple[int, int]:
    return int(arg), int(arg)


def _spread(arg: str) -> tuple[int, int]:
    lo, sep, hi = arg.partition("-")
    if not sep:
        raise ValueError("spread takes LO-HI")
    return int(lo), int(hi)


LENGTH_LAWS: dict[str, Callable[[str], tuple[int, int]]] = {"fixed": _fixed, "spread": _spread}


def parse_lengths(spec: str) -> LengthLaw:
    """``fixed:N`` or ``spread:LO-HI`` (uniform). Raises ``ValueError`` naming the flag."""
    kind, _, arg = spec.partition(":")
    law = LENGTH_LAWS.get(kind)
    if law is None:
        raise ValueError(
            f"--ft-lengths {spec!r}: use {' or '.join(f'{k}:…' for k in LENGTH_LAWS)} "
            "(fixed:512, spread:256-1024)"
        )
    try:
        lo, hi = law(arg)
    except ValueError as e:
        raise ValueError(f"--ft-lengths {spec!r}: {e}") from None
    return LengthLaw(lo, hi, spec)


def write_ft_dataset(
    path: Path,
    num_samples: int,
    lengths: LengthLaw,
    vocab_size: int,
    seed: int = 0,
    prompt_fraction: float = 0.25,
) -> Path:
    """Write ``num_samples`` pre-tokenized rows (``input_ids`` uniform in ``[10, vocab_size)``,
    ``labels`` masked with ``-100`` on the first ``prompt_fraction`` of each row) as JSONL."""
    if num_samples <= 0:
        raise ValueError(f"--ft-samples must be positive, got {num_samples}")
    if vocab_size <= 10:
        raise ValueError(f"vocabulary of {vocab_size} tokens is too small for synthetic samples")
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for _ in range(num_samples):
            ids = [rng.randrange(10, vocab_size) for _ in range(lengths.draw(rng))]
            masked = int(len(ids) * prompt_fraction)
            f.write(json.dumps({"input_ids": ids, "labels": [-100] * masked + ids[masked:]}) + "\n")
    return path

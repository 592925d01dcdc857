"""Reading a result file under ``bench/results/``: plain JSON, or compressed (``*.json.gz``, or
``*.json.xz`` for the largest: xz -9e keeps them ~30% smaller than gzip -9) for the large ones no
test needs to diff, so that the tree stays small enough to travel to the device (DEVELOPERS.md,
"Device runs waiting")."""

from __future__ import annotations

import gzip
import json
import lzma
import os
from pathlib import Path
from typing import Any


def read_result(path: str | os.PathLike[str]) -> Any:
    """The JSON of ``path``, through gzip when its name ends in ``.gz``, through lzma in ``.xz``."""
    p = Path(path)
    raw = p.read_bytes()
    if p.suffix == ".gz":
        raw = gzip.decompress(raw)
    elif p.suffix == ".xz":
        raw = lzma.decompress(raw)
    return json.loads(raw)

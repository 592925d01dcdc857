"""Reading a result file under ``bench/results/``: plain JSON, or gzipped (``*.json.gz``) for the
large ones no test needs to diff, so that the tree stays small enough to travel to the device
(DEVELOPERS.md, "Device runs waiting")."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any


def read_result(path: str | os.PathLike[str]) -> Any:
    """The JSON of ``path``, through gzip when its name ends in ``.gz``."""
    p = Path(path)
    raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
    return json.loads(raw)

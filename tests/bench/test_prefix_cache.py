"""bench/prefix_cache.py: each setting in a process of its own, and the cache found."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.bench.scripts import BENCH


def test_both_settings_run_in_processes_of_their_own_and_the_cache_is_hit(tmp_path: Path) -> None:
    """Session 30: in one process the first engine's GPU memory was not all given back before the
    second engine sized its KV cache. Each setting now runs in a child process; the parent
    gathers their figures. The cached setting finds the shared prompt (all but the first
    request's blocks of it), the uncached one finds nothing."""
    out = tmp_path / "prefix_cache.json"
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent / "src")}
    subprocess.run([sys.executable, str(BENCH / "prefix_cache.py"), "--shared", "64", "--own", "8",
                    "--requests", "3", "--out", str(out)], check=True, env=env, capture_output=True, timeout=600)
    figures = json.loads(out.read_text())["figures"]
    assert figures["uncached"]["hit_tokens"] == figures["uncached"]["queried_tokens"] == 0
    assert 0 < figures["cached"]["hit_tokens"] < figures["cached"]["queried_tokens"]
    assert len(figures["cached"]["ttft_ms"]) == len(figures["uncached"]["ttft_ms"]) == 3

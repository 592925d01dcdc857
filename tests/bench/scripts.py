"""The benchmark scripts under ``bench/`` (not a package) as modules, for their tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).parents[2] / "bench"


def load_script(name: str) -> ModuleType:
    """``bench/{name}.py`` loaded as module ``name`` (the folder on ``sys.path`` first: some
    scripts import their neighbours, ``speed_common`` and the like)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

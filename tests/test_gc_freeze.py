"""Start-up objects are frozen out of the garbage collector, and a full collection gets cheap."""

from __future__ import annotations

import gc
import time
from pathlib import Path

from coserve.gc_freeze import freeze_startup_objects


class _Node:
    def __init__(self) -> None:
        self.peer: _Node | None = None


def _full_collection_s() -> float:
    start = time.perf_counter()
    gc.collect()
    return time.perf_counter() - start


def test_freeze_moves_live_objects_out_and_collects_cycles_first() -> None:
    gc.unfreeze()
    alive = [[i] for i in range(200_000)]  # tracked containers: a full collection walks them
    garbage = _Node()
    garbage.peer = _Node()
    garbage.peer.peer = garbage  # a cycle only the collector can free
    del garbage
    before = _full_collection_s()
    freeze_startup_objects("test")
    assert gc.get_freeze_count() >= len(alive)
    assert not any(o is alive for o in gc.get_objects())
    assert not any(isinstance(o, _Node) for o in gc.get_objects())  # collected, not frozen
    assert _full_collection_s() < before / 2
    gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_engine_freezes_at_start_up(tmp_path: Path) -> None:
    from coserve.engine.config import EngineConfig
    from coserve.engine.llm_engine import LLMEngine
    from tests.conftest import make_hf_model

    gc.unfreeze()
    model = make_hf_model(tmp_path / "m")
    engine = LLMEngine(EngineConfig(model=str(model), skip_tokenizer_init=True, num_kv_blocks=16,
                                    block_size=4))
    assert gc.get_freeze_count() > 0
    assert gc.is_tracked(engine) and not any(o is engine for o in gc.get_objects())

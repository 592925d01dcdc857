"""Co-serving hooks inside the engine: FT-only steps, their interruption, FT rows beside requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from coserve import EngineConfig, LLMEngine, SamplingParams
from coserve.core.config import CoServeConfig, LoRAConfig, OptimConfig, SLOConfig
from coserve.server.finetune import FinetuneSession, FinetuneSpec

DATA = Path(__file__).resolve().parents[2] / "src" / "coserve" / "data" / "tiny_facts.jsonl"


@pytest.fixture
def session(tmp_path: Path):  # type: ignore[no-untyped-def]
    engine = LLMEngine(EngineConfig(model="tiny", num_training_slots=1, max_lora_rank=8))
    spec = FinetuneSpec(data=DATA, output=tmp_path / "out", lora=LoRAConfig(rank=8, alpha=16),
                        optim=OptimConfig(lr=1e-3), coserve=CoServeConfig(backward_tokens=64, max_seq_len=64),
                        trainer_threads=1)
    s = FinetuneSession(engine, spec)
    yield engine, s
    s.close()


def test_ft_only_step_is_interrupted_by_an_arrival(session) -> None:  # type: ignore[no-untyped-def]
    engine, s = session
    calls = 0

    def arrival_at_layer_two() -> bool:
        nonlocal calls
        calls += 1
        return calls > 2

    engine.external_arrivals = arrival_at_layer_two
    assert engine.step() == []
    assert s.coserver.num_interrupted == 1
    assert s.pool.num_in_flight == 0, "the interrupted step's samples went back to the pool"
    assert s.store.used() == 0
    engine.external_arrivals = None
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    out = engine.step()
    assert [o.request_id for o in out] == ["r"], "the request ran in the very next step"


def test_uninterrupted_ft_only_step_captures_samples(session) -> None:  # type: ignore[no-untyped-def]
    engine, s = session
    assert engine.step() == []
    assert s.coserver.num_interrupted == 0
    assert s.pool.num_in_flight > 0
    assert s.coserver.backward_running or s.store.used() > 0


def test_interruption_can_be_switched_off(session) -> None:  # type: ignore[no-untyped-def]
    engine, s = session
    s.coserver.slo = SLOConfig(interrupt_ft_only=False)
    engine.external_arrivals = lambda: True
    engine.step()
    assert s.coserver.num_interrupted == 0 and s.pool.num_in_flight > 0


def test_calibration_runs_through_the_engine_and_fits_the_model(session) -> None:  # type: ignore[no-untyped-def]
    from coserve.core.latency import BatchSpec, Chunk, StepFeatures

    engine, s = session
    free = engine.block_manager.num_free_blocks
    n = engine.calibrate(repeats=1)
    assert n > 50
    assert engine.block_manager.num_free_blocks == free, "calibration gave back every borrowed block"
    spec = BatchSpec((Chunk(64),), decode_kv=(32,) * 4)
    measured = min(engine.run_batch(spec) for _ in range(5))
    predicted = s.coserver.latency.predict(StepFeatures.from_view(spec.record(measured).view))
    assert predicted == pytest.approx(measured, rel=1.0), "calibrated prediction within 2x on CPU"

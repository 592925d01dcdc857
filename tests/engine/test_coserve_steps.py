"""Co-serving hooks inside the engine: FT-only steps, their interruption, FT rows beside requests."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from coserve import EngineConfig, LLMEngine, SamplingParams
from coserve.core.config import CoServeConfig, LoRAConfig, OptimConfig, SLOConfig
from coserve.core.latency import TERMS, calibration_plan
from coserve.server.finetune import FinetuneSession, FinetuneSpec

DATA = Path(__file__).resolve().parents[2] / "src" / "coserve" / "data" / "tiny_facts.jsonl"


def tiny_session(engine: LLMEngine, tmp_path: Path) -> FinetuneSession:
    """Fine-tuning on the built-in facts, 64-token tasks, on ``engine``."""
    spec = FinetuneSpec(data=DATA, output=tmp_path / "out", lora=LoRAConfig(rank=8, alpha=16),
                        optim=OptimConfig(lr=1e-3), coserve=CoServeConfig(backward_tokens=64, max_seq_len=64),
                        trainer_threads=1)
    return FinetuneSession(engine, spec)


@pytest.fixture
def session(tmp_path: Path):  # type: ignore[no-untyped-def]
    engine = LLMEngine(EngineConfig(model="tiny", num_training_slots=1, max_lora_rank=8))
    s = tiny_session(engine, tmp_path)
    yield engine, s
    s.close()


class ArrivalAfter:
    """An arrival probe that finds a request from its ``checks + 1``-th call on (None: never);
    ``calls`` counts them."""

    def __init__(self, checks: int | None) -> None:
        self.checks, self.calls = checks, 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.checks is not None and self.calls > self.checks


def test_ft_only_step_is_interrupted_by_an_arrival(session) -> None:  # type: ignore[no-untyped-def]
    engine, s = session
    engine.external_arrivals = ArrivalAfter(3)  # (at layer two)
    s.coserver.track = True
    began = time.perf_counter()
    assert engine.step() == []
    took = time.perf_counter() - began
    assert s.coserver.num_interrupted == 1
    # the points it passed, in order, timed from its plan (no GPU to wait for here)
    checks = s.coserver.interrupted_checks[-1]
    assert [c.where for c in checks] == ["end of plan", "before layer 0", "before layer 1", "before layer 2"]
    times = [c.at_s for c in checks]
    assert 0 < times[0] <= times[1] <= times[2] <= times[3] <= took and all(c.gpu_wait_s < 0.05 for c in checks)
    # the host thread's CPU time and the collector's, counted from the plan (no allocator counts off CUDA)
    cpu = [c.cpu_s for c in checks]
    assert 0 <= cpu[0] <= cpu[1] <= cpu[2] <= cpu[3] <= took + 0.01
    assert all(0 <= c.gc_s <= c.at_s and c.device_allocs is None for c in checks)
    # the interrupted step reports its time split: planning, then the forward up to the interruption
    stats = engine.last_step
    assert stats is not None and stats.ft_tokens > 0 and stats.num_prefill_tokens == 0
    assert stats.schedule_s is not None and stats.forward_enqueue_s is not None
    assert 0 < stats.schedule_s + stats.forward_enqueue_s <= stats.duration_s <= took
    assert s.pool.num_in_flight == 0, "the interrupted step's samples went back to the pool"
    assert s.store.used() == 0
    engine.external_arrivals = None
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    out = engine.step()
    assert [o.request_id for o in out] == ["r"], "the request ran in the very next step"
    # its row in the step table: the host's seconds queuing the forward, and its thread's CPU time in them
    row = s.coserver.step_log[-1]
    assert row.enqueue_s is not None and row.enqueue_cpu_s is not None
    assert 0 < row.enqueue_cpu_s <= row.enqueue_s + 0.005


def probes_of_a_whole_ft_only_step(engine: LLMEngine) -> int:
    """How many times an FT-only step that no arrival interrupts checks for one."""
    probe = engine.external_arrivals = ArrivalAfter(None)
    assert engine.step() == [] and engine.last_step_kind == "ft-only"
    return probe.calls


def test_ft_only_step_checks_for_arrivals_once_per_layer_by_default(session) -> None:  # type: ignore[no-untyped-def]
    engine, s = session
    assert not s.coserver.wants_mlp_hook and not s.coserver.ft_rows_force_eager(ft_only=True)
    # at the end of the plan, at each layer's input and at the final hidden state (L + 1)
    assert probes_of_a_whole_ft_only_step(engine) == engine.model_config.num_layers + 2


def test_ft_only_step_checks_for_arrivals_twice_per_layer(session) -> None:  # type: ignore[no-untyped-def]
    """With ``ft_only_mid_layer_check`` each layer of an FT-only step has two interruption points:
    its start, and after its MLP's gate/up projection; an arrival seen at the second stops the
    step within the first layer."""
    engine, s = session
    s.coserver.slo = SLOConfig(ft_only_mid_layer_check=True)
    assert s.coserver.ft_rows_force_eager(ft_only=True) and not s.coserver.ft_rows_force_eager(ft_only=False)
    probe = engine.external_arrivals = ArrivalAfter(2)
    engine.step()
    # (the first probe at the end of the plan, the second at layer 0's start)
    assert engine.last_step_kind == "ft-only-interrupted" and probe.calls == 3
    # at the end of the plan, at each layer's input and at the final hidden state (L + 1), and
    # within each layer's MLP (L)
    assert probes_of_a_whole_ft_only_step(engine) == 2 * engine.model_config.num_layers + 2


def test_arrival_while_planning_keeps_ft_only_step_from_starting(session) -> None:  # type: ignore[no-untyped-def]
    """Inference work that arrives while an FT-only step is planned: the step does not start,
    nothing of it is claimed, and the request runs in the next step."""
    engine, s = session
    s.coserver.track = True
    engine.external_arrivals = lambda: True
    assert engine.step() == []
    assert engine.last_step_kind == "ft-only-not-started"
    assert s.coserver.admission_counts.get(("ft-only", "arrival")) == 1
    assert [c.where for c in s.coserver.interrupted_checks[-1]] == ["end of plan"]
    assert s.pool.num_in_flight == 0 and s.store.used() == 0 and s.coserver.num_interrupted == 0
    engine.external_arrivals = None
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    assert [o.request_id for o in engine.step()] == ["r"]


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


def test_a_decode_steps_view_names_its_longest_row_and_a_spread_calibration_runs(
        session, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The co-server sees each step's longest decode row (StepView.decode_kv_max, for the step
    table); a calibration with COSERVE_CALIB_KV_SPREAD's decode batches runs and gives back
    every borrowed block."""
    import coserve.core.latency as latency

    engine, s = session
    views = []
    plan = s.coserver.plan
    monkeypatch.setattr(s.coserver, "plan", lambda view: views.append(view) or plan(view))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("short", list(range(5, 12)), params)
    engine.add_request("long", list(range(5, 40)), params)
    while engine.has_unfinished_requests():
        engine.step()
    decoding = [v for v in views if v.num_decodes == 2]
    assert decoding and all(v.decode_kv_tokens / 2 < v.decode_kv_max < v.decode_kv_tokens for v in decoding)
    assert decoding[0].decode_kv_max == 35 + 1  # (the long prompt and its first output token)
    monkeypatch.setattr(latency, "CALIB_KV_SPREAD", True)
    free = engine.block_manager.num_free_blocks
    assert engine.calibrate(repeats=1) > 50
    assert engine.block_manager.num_free_blocks == free


def test_saved_mlp_activations_train_the_same_adapter(tmp_path: Path) -> None:
    """FT-only steps with the gate/up outputs kept: the store's MLP planes hold what the layer
    computes from the captured inputs, and the trainer (MLP differentiated from them) commits the
    same adapter as the recomputing one."""
    import torch

    adapters = []
    for keep in (False, True):
        engine = LLMEngine(EngineConfig(model="tiny", num_training_slots=1, max_lora_rank=8))
        spec = FinetuneSpec(data=DATA, output=tmp_path / f"out{keep}", lora=LoRAConfig(rank=8, alpha=16),
                            optim=OptimConfig(lr=1e-2),
                            coserve=CoServeConfig(backward_tokens=64, max_seq_len=64, save_mlp_activations=keep),
                            trainer_threads=1)
        s = FinetuneSession(engine, spec)
        try:
            assert (s.store.mlp is not None) is keep
            engine.step()  # one FT-only step captures a task
            if keep:
                assert s.store.mlp is not None
                n = s.store.used()
                layer = engine.model.model.layers[1]
                x = s.store.tensor[1, :n]
                rows = s.coserver._in_flight[0][0].samples if s.coserver._in_flight else ()
                # recompute layer 1's gate/up for the first captured row from its captured input
                first = rows[0] if rows else None
                assert first is not None
                m = len(first.labels)
                from coserve.layers.attention import AttentionMetadata
                from coserve.models.llama import ForwardContext
                meta = AttentionMetadata.build(q_lens=[m], context_lens=[0], block_tables=[[]], writes_kv=[False],
                                               num_prefill_rows=1, block_size=1, device="cpu")
                with torch.no_grad():
                    xr = x[first.offset : first.offset + m]
                    h = xr + layer.self_attn(layer.input_layernorm(xr), torch.arange(m), engine.model.rotary,
                                             ForwardContext(attn=meta))
                    gu = layer.mlp.gate_up_proj(layer.post_attention_layernorm(h))
                torch.testing.assert_close(s.store.mlp[1, first.offset : first.offset + m], gu, rtol=1e-5, atol=1e-5)
            while s.coserver.steps_done < 3:
                if not engine.step():
                    s.wait(0.05)
            adapters.append(s.trainer.committed_adapter())
        finally:
            s.close()
    for key, (a, b) in adapters[0].weights.items():
        torch.testing.assert_close(adapters[1].weights[key][0], a, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(adapters[1].weights[key][1], b, rtol=1e-4, atol=1e-6)


def test_ft_rows_run_lora_only_on_the_trained_linears(session) -> None:  # type: ignore[no-untyped-def]
    """The training slot is declared with the adapter's targets (q/k/v/o by default), so a step
    with FT rows skips the MLP linears' LoRA kernels."""
    engine, s = session
    slot = engine.lora_manager.training_slot(0)
    layers = engine.model_config.num_layers
    assert engine.lora_manager.live_targets([slot]) == {
        (layer, t) for layer in range(layers) for t in ("q_proj", "k_proj", "v_proj", "o_proj")}
    engine.step()
    assert engine.last_step_kind.startswith("ft-only")
    live = {tuple(lin.out_slices): lin.lora_live for lin in engine.model.lora_linears() if lin.layer == 0}
    assert live == {("q_proj", "k_proj", "v_proj"): True, ("o_proj",): True,
                    ("gate_proj", "up_proj"): False, ("down_proj",): False}
    assert engine.lora_manager.live_targets([slot, 0]) is None  # slot 0 holds nothing declared


@pytest.fixture
def graph_session(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A session whose engine runs steps with prefill or FT rows through the piecewise prefill
    graphs (their static-buffer path, run eagerly on the CPU; the Triton multi-LoRA in the
    interpreter), as a CUDA engine with --prefill-graphs does."""
    from tests.conftest import triton_unavailable

    reason = triton_unavailable()
    if reason is not None:
        pytest.skip(reason)
    engine = LLMEngine(EngineConfig(model="tiny", num_training_slots=1, max_lora_rank=8, lora_backend="triton",
                                    max_num_batched_tokens=128, warmup="off"))
    engine.runner.prefill_graphs = engine.runner.make_prefill_graphs(capture=False)
    s = tiny_session(engine, tmp_path)
    yield engine, s
    s.close()


def test_steps_with_ft_rows_run_and_are_priced_through_the_prefill_graphs(graph_session) -> None:  # type: ignore[no-untyped-def]
    """A mixed step (a request's prompt and FT rows) replays the prefill graphs, reports ``graph``
    and is priced by the prefill/graph set; so does an FT-only step, unless its checks inside
    each layer (``ft_only_mid_layer_check``: an MLP hook) keep it eager, and the co-server then
    prices it so."""
    from coserve.core.latency import StepFeatures

    engine, s = graph_session
    co = s.coserver
    co.track = True
    assert engine.runner.ft_graph_tokens == 128
    assert not co.ft_rows_force_eager(ft_only=True) and not co.ft_rows_force_eager(ft_only=False)
    engine.add_request("r", list(range(1, 20)), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    assert engine.last_step_kind == "mixed" and engine.last_step is not None
    assert engine.last_step.mode == "graph"
    assert co.step_log[-1][0] == "prefill/graph/idle"
    while engine.has_unfinished_requests():
        engine.step()
    # nothing to serve: an FT-only step (once the trainer has taken the task in flight, if any),
    # through the graphs; with a check inside each layer, through the eager path
    for mid_layer, mode in ((False, "graph"), (True, "eager")):
        co.slo = SLOConfig(ft_only_mid_layer_check=mid_layer)
        assert co.ft_rows_force_eager(ft_only=True) == mid_layer
        deadline = time.monotonic() + 60
        engine.step()
        while engine.last_step_kind != "ft-only" and time.monotonic() < deadline:
            co.poll(0.05)
            engine.step()
        assert engine.last_step_kind == "ft-only" and engine.last_step.mode == mode
        assert co.step_log[-1][0].startswith(f"prefill/{mode}/")
    # the host offers its graphs to FT rows of any step; the co-server withdraws them where its
    # rows keep the step eager (ft_rows_force_eager, above) before admission prices the rows
    view = engine._view(engine.scheduler.schedule(), [])
    assert view.ft_graph_tokens == 128
    assert StepFeatures.from_view(view, (8,)).key == "prefill/graph"


def test_an_ft_only_step_through_the_prefill_graphs_is_interrupted_between_segments(graph_session) -> None:  # type: ignore[no-untyped-def]
    engine, s = graph_session
    co = s.coserver
    co.track = True
    probe = engine.external_arrivals = ArrivalAfter(2)  # (at layer one)
    deadline = time.monotonic() + 60
    engine.step()
    while engine.last_step_kind not in ("ft-only", "ft-only-interrupted") and time.monotonic() < deadline:
        probe.calls = 0
        co.poll(0.05)
        engine.step()
    assert engine.last_step_kind == "ft-only-interrupted" and co.num_interrupted == 1
    assert [c.where for c in co.interrupted_checks[-1]] == ["end of plan", "before layer 0", "before layer 1"]
    assert s.pool.num_in_flight == 0 and s.store.used() == 0, "the interrupted step's samples went back"
    engine.external_arrivals = None
    engine.add_request("r", list(range(1, 20)), SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    assert engine.last_step_kind in ("inference", "mixed") and engine.last_step.mode == "graph"
    while engine.has_unfinished_requests():
        engine.step()


def test_calibration_fits_the_prefill_graph_set_with_ft_rows(graph_session) -> None:  # type: ignore[no-untyped-def]
    engine, s = graph_session
    calls: list[tuple[bool, bool]] = []  # (through the graphs, a prefill row over cached context)
    run = engine.runner.execute

    def execute(rows, *args, eager: bool = False, **kwargs):  # type: ignore[no-untyped-def]
        out = run(rows, *args, eager=eager, **kwargs)
        calls.append((engine.runner.last_mode == "graph", any(r.is_prefill and r.context_len > 0 for r in rows)))
        return out

    engine.runner.execute = execute  # type: ignore[method-assign]
    engine.calibrate(repeats=1)
    latency = s.coserver.latency
    assert "prefill/graph" in latency._coef and "prefill/eager" in latency._coef
    graph = [g for g, _ in calls]
    assert any(graph) and not all(graph), "calibration ran both the graphs and the eager path"
    assert len(latency.coefficients("prefill/graph")) == len(TERMS["prefill"])
    # The batches that identify i_ctx (a chunk over cached context): this rig has no decode graphs,
    # so the engine calibrates its inference batches eagerly only; on a host with them, the graph
    # mode's run through the prefill graphs, as here.
    assert (False, True) in calls
    calls.clear()
    cfg = engine.config
    plan = calibration_plan(cfg.max_num_batched_tokens, 8, 4096, modes=("graph",), ft_modes=(),
                            max_context=engine.max_model_len - 1)
    context = [spec for spec in plan if any(c.context_len for c in spec.chunks)]
    assert len({spec.num_tokens for spec in context}) >= 3
    free = engine.block_manager.num_free_blocks
    for spec in context:
        assert engine.run_batch(spec) > 0
    assert calls == [(True, True)] * len(context)
    assert engine.block_manager.num_free_blocks == free


def test_a_name_bound_to_the_training_slot_serves_what_is_written_there(tmp_path: Path) -> None:
    """``LoRAManager.bind_training_slot``: requests under that name run with the adapter in the
    training slot (no file read), the tokens an adapter loaded from disk gives; and they see a new
    write into the slot at once, as they see the trainer's commits."""
    from dataclasses import replace

    import torch

    from coserve import LoRARequest
    from coserve.models.peft_adapter import new_lora_adapter, save_peft_adapter

    engine = LLMEngine(EngineConfig(model="tiny", num_training_slots=1, max_lora_rank=8))
    cfg = engine.model_config
    adapter = new_lora_adapter(num_layers=cfg.num_layers, shapes=cfg.linear_shapes(), rank=8, alpha=16.0,
                               target_modules=("q_proj", "v_proj", "o_proj"), seed=1)
    gen = torch.Generator().manual_seed(2)
    adapter = replace(adapter, weights={k: (a, torch.randn(b.shape, generator=gen)) for k, (a, b) in adapter.weights.items()})
    save_peft_adapter(adapter, tmp_path / "disk")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run(rid: str, lora: LoRARequest | None) -> list[int]:
        engine.add_request(rid, [1, 2, 3, 4], params, lora)
        while True:
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    return list(out.outputs[0].token_ids)

    base = run("base", None)
    from_disk = run("disk", LoRARequest("disk", str(tmp_path / "disk")))
    assert from_disk != base
    manager = engine.lora_manager
    manager.bind_training_slot("live")
    slot = manager.training_slot()
    manager.write(slot, adapter)
    assert run("live1", LoRARequest("live", "(not read)")) == from_disk
    manager.write(slot, replace(adapter, weights={k: (a, b * 0) for k, (a, b) in adapter.weights.items()}))
    assert run("live2", LoRARequest("live", "(not read)")) == base  # B = 0: the base model
    with pytest.raises(ValueError, match="already in use"):
        manager.bind_training_slot("disk")

"""The trainer worker as a process: grant flag (pause at layer boundaries), results, export."""

from __future__ import annotations

import os
import threading
import time

import torch

from coserve.core.config import OptimConfig
from coserve.core.messages import BackwardTask, TaskResult, TaskSample
from coserve.models.loader import load_model
from coserve.models.peft_adapter import new_lora_adapter
from coserve.trainer.process import CPU_TRAINER_NICENESS, TrainerProcess
from coserve.trainer.stream_gate import TASK_START
from coserve.trainer.worker import WorkerSpec, _Worker


def _setup(num_layers: int = 2):  # type: ignore[no-untyped-def]
    model = load_model("tiny", num_lora_slots=1, max_lora_rank=8)
    cfg = model.config
    adapter = new_lora_adapter(num_layers=cfg.num_layers, shapes=cfg.linear_shapes(), rank=4, alpha=8,
                               target_modules=("q_proj", "v_proj"), seed=0)
    store = torch.randn(cfg.num_layers + 1, 32, cfg.hidden_size)
    scales = torch.zeros(1)
    task = BackwardTask(0, 0, (TaskSample(0, 0, tuple(range(10, 30))),), ends_step=True)
    return model, adapter, store, scales, task


def test_paused_worker_stops_at_a_layer_boundary_until_granted() -> None:
    model, adapter, store, scales, task = _setup()
    grant = threading.Event()  # cleared: paused
    spec = WorkerSpec(model, store, scales, torch.zeros(2, 3, 1), torch.tensor([-1, 0, 0]), adapter, 0, 0.0, 0,
                      OptimConfig(lr=1e-3), grant=grant)
    spec.banks = torch.zeros(2, 3, sum(a.numel() + b.numel() for a, b in adapter.weights.values()))
    worker = _Worker(spec)
    ran: list[int] = []
    for i, layer in enumerate(model.model.layers):
        # the recompute starts with a layer's input norm (by hand or by autograd: the norm's autograd
        # Function calls the module again inside: one entry a layer)
        layer.input_layernorm.register_forward_pre_hook(lambda *_, _i=i: None if ran[-1:] == [_i] else ran.append(_i))
    # the loss starts with the final norm on every loss path (the split chunk's workspace never calls
    # compute_logits); the norm's autograd Function calls the module again inside: one entry a chunk
    model.model.norm.register_forward_pre_hook(lambda *_: None if ran[-1:] == [-1] else ran.append(-1))
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(worker.run(task)))
    thread.start()
    time.sleep(0.5)
    assert ran == [] and not result, "the worker computed the loss or a layer while paused"
    grant.set()
    thread.join(timeout=30)
    assert ran == [-1, *range(model.config.num_layers - 1, -1, -1)] and result
    # it paused once, at the first boundary: the task's start, before any of its work
    assert result[0].pause_layers == (TASK_START,)  # type: ignore[attr-defined]
    assert result[0].pause_polled == (False,)  # type: ignore[attr-defined]
    assert len(result[0].pause_times) == 1  # type: ignore[attr-defined]


def test_trainer_process_pause_resume_and_commit() -> None:
    model, adapter, store, scales, task = _setup()
    trainer = TrainerProcess(model, store, scales, adapter, slot=0, optim=OptimConfig(lr=1e-3), num_threads=1)
    try:
        b_before = model.lora_stacks(0, "q_proj")[1][0, :, :4].clone()  # B starts at 0; A gets no gradient yet
        trainer.pause()
        trainer.submit(task)
        assert trainer.poll(timeout=2.0) == []  # paused at its first layer boundary
        trainer.resume()
        results = trainer.poll(timeout=60.0)
        assert len(results) == 1 and results[0].step_info is not None
        assert trainer.committed_steps == 1
        b_after = model.lora_stacks(0, "q_proj")[1][0, :, :4]
        assert not torch.equal(b_before, b_after), "the serving slot was updated in place"
        committed = trainer.committed_adapter()
        torch.testing.assert_close(committed.weights[(0, "q_proj")][1], b_after)
        # a CPU trainer yields the cores to the engine: a lower scheduling priority than ours
        assert trainer._proc is not None and trainer._proc.pid is not None
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, trainer._proc.pid) == min(ours + CPU_TRAINER_NICENESS, 19)
    finally:
        trainer.close()
    assert not trainer.alive()


def test_warm_up_task_leaves_no_trace_in_training() -> None:
    """A worker that runs the warm-up task first trains exactly as one that does not: same loss,
    same gradient norm, same adapter after the optimizer step; the warm-up's gradient is gone."""
    from coserve.trainer.worker import warmup_rows

    assert warmup_rows(1024, 512) == (512, 512, 511) and warmup_rows(100, 512) == (100,)
    model, adapter, store, scales, task = _setup()
    outcomes = []
    for rows in ((), warmup_rows(48, 20)):
        spec = WorkerSpec(model, store, scales, torch.zeros(2, 3, 1), torch.tensor([-1, 0, 0]), adapter, 0, 0.0, 0,
                          OptimConfig(lr=1e-3), warmup_rows=rows)
        spec.banks = torch.zeros(2, 3, sum(a.numel() + b.numel() for a, b in adapter.weights.values()))
        worker = _Worker(spec)
        flat = worker.lora.flat.detach().clone()
        if rows:
            worker.warm_up(rows)
            assert worker.lora.flat.grad is not None and not worker.lora.flat.grad.any()
            assert torch.equal(worker.lora.flat, flat), "the warm-up changed the adapter"
        result = worker.run(task)
        outcomes.append((result.loss_sum, result.step_info, worker.lora.flat.detach().clone()))
    (loss0, info0, flat0), (loss1, info1, flat1) = outcomes
    assert loss0 == loss1 and info0 is not None and info1 is not None and info0.grad_norm == info1.grad_norm
    assert torch.equal(flat0, flat1)


def _run_worker_on(spec: WorkerSpec, task: BackwardTask) -> TaskResult:
    """``run_worker``'s loop in this process (its warm-up first) over ``task`` alone: its result."""
    import queue

    from coserve.trainer import worker as worker_module

    tasks: queue.Queue = queue.Queue()
    results: queue.Queue = queue.Queue()
    tasks.put(task)
    tasks.put(None)
    worker_module.run_worker(spec, tasks, results)
    return results.get_nowait()


def _grad_norm_unwarmed(spec: WorkerSpec, task: BackwardTask) -> float:
    """The gradient norm of ``task``'s step on a fresh worker of ``spec``'s model that never warmed up."""
    clean = _Worker(WorkerSpec(spec.model, spec.store, spec.scales, spec.banks.clone().zero_(),
                               torch.tensor([-1, 0, 0]), spec.adapter, 0, 0.0, 0, OptimConfig(lr=1e-3)))
    info = clean.run(task).step_info
    assert info is not None
    return info.grad_norm


def test_warmup_shapes_cover_the_loss_chunks_and_the_task_sizes() -> None:
    """The warm-up's later tasks: one-row tasks whose target counts (a row's tokens less one) are
    WARMUP_TARGETS that fit, then multi-row tasks from half of backward_tokens toward the largest
    task, every row within max_seq_len and at least 2 tokens."""
    from coserve.trainer.worker import WARMUP_LEVELS, WARMUP_TARGETS, warmup_rows, warmup_shapes

    tasks = warmup_shapes(1024, 1024)
    singles = [rows[0] - 1 for rows in tasks if len(rows) == 1]
    assert singles == list(WARMUP_TARGETS)
    multi = [rows for rows in tasks if len(rows) > 1]
    totals = [sum(rows) for rows in multi]
    assert len(multi) == WARMUP_LEVELS and totals == sorted(totals)
    assert totals[0] == 512 and totals[-1] < sum(warmup_rows(1024, 1024)) == 2047
    assert all(2 <= n <= 1024 for rows in tasks for n in rows)
    # a short max_seq_len: the targets that fit, and rows cut to it
    short = warmup_shapes(48, 20)
    assert [r[0] - 1 for r in short if len(r) == 1] == [n for n in WARMUP_TARGETS if n + 1 <= 20]
    assert all(2 <= n <= 20 for rows in short for n in rows)


def test_run_worker_runs_every_warm_up_task_before_the_first_real_one(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """run_worker warms up with warmup_rows' task, then warmup_shapes' tasks, in order, then serves
    (and trains as a worker that never warmed up)."""

    from coserve.trainer import worker as worker_module

    model, adapter, store, scales, task = _setup()
    spec = WorkerSpec(model, store, scales, torch.zeros(2, 3, 1), torch.tensor([-1, 0, 0]), adapter, 0, 0.0, 0,
                      OptimConfig(lr=1e-3), warmup_rows=(20, 9), warmup_shapes=((2,), (5, 4)))
    spec.banks = torch.zeros(2, 3, sum(a.numel() + b.numel() for a, b in adapter.weights.values()))
    seen: list[list[int]] = []
    real = worker_module.task_backward

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append([len(r.labels) for r in args[3]])
        return real(*args, **kwargs)

    monkeypatch.setattr(worker_module, "task_backward", recording)
    result = _run_worker_on(spec, task)
    assert seen == [[20, 9], [2], [5, 4], [len(task.samples[0].labels)]]
    assert result.step_info is not None and result.step_info.grad_norm == _grad_norm_unwarmed(spec, task)


def test_warm_up_task_waits_while_the_engine_pauses_the_trainer() -> None:
    model, adapter, store, scales, _ = _setup()
    grant = threading.Event()  # cleared: the engine runs a prefill
    spec = WorkerSpec(model, store, scales, torch.zeros(2, 3, 1), torch.tensor([-1, 0, 0]), adapter, 0, 0.0, 0,
                      OptimConfig(lr=1e-3), grant=grant, warmup_rows=(20, 9))
    spec.banks = torch.zeros(2, 3, sum(a.numel() + b.numel() for a, b in adapter.weights.values()))
    worker = _Worker(spec)
    done = threading.Event()
    thread = threading.Thread(target=lambda: (worker.warm_up(spec.warmup_rows), done.set()))
    thread.start()
    assert not done.wait(0.5), "the warm-up ran while the trainer was paused"
    grant.set()
    thread.join(timeout=30)
    assert done.is_set() and worker._pauses == [] and worker._paused_s == 0.0  # its pauses not reported


def test_a_failing_warm_up_leaves_the_trainer_serving(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The warm-up is an optimization: if it raises, the worker logs it, forgets its partial
    gradient and serves its tasks (run in-process here, through run_worker's loop)."""

    from coserve.trainer import worker as worker_module

    model, adapter, store, scales, task = _setup()
    spec = WorkerSpec(model, store, scales, torch.zeros(2, 3, 1), torch.tensor([-1, 0, 0]), adapter, 0, 0.0, 0,
                      OptimConfig(lr=1e-3), warmup_rows=(20, 9))
    spec.banks = torch.zeros(2, 3, sum(a.numel() + b.numel() for a, b in adapter.weights.values()))
    real = worker_module.task_backward
    calls = 0

    def fails_first(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 1:
            args[1].bind_grads()
            args[1].flat.grad.fill_(1.0)  # a partial gradient the failure leaves behind
            raise RuntimeError("warm-up failed (test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(worker_module, "task_backward", fails_first)
    result = _run_worker_on(spec, task)
    assert calls == 2 and result.task_id == task.task_id and result.step_info is not None
    # the same step as a worker that never warmed up
    assert result.step_info.grad_norm == _grad_norm_unwarmed(spec, task)


def test_a_new_trainer_process_is_warm_before_it_returns() -> None:
    """With a warm-up, the constructor waits until the worker is done with it (the engine's
    calibration comes next and must have the device to itself), then trains as usual."""
    model, adapter, store, scales, task = _setup()
    trainer = TrainerProcess(model, store, scales, adapter, slot=0, optim=OptimConfig(lr=1e-3), num_threads=1,
                             warmup_rows=(20, 9), warmup_shapes=((2,), (5, 4)))
    try:
        assert trainer._ready is not None and trainer._ready.is_set()
        assert trainer.spec.warmup_shapes == ((2,), (5, 4))
        trainer.submit(task)
        results = trainer.poll(timeout=60.0)
        assert len(results) == 1 and results[0].step_info is not None
        # a restarted worker warms up beside serving: its one task, not the shapes'
        trainer.restart()
        assert trainer.spec.warmup_rows == (20, 9) and trainer.spec.warmup_shapes == ()
    finally:
        trainer.close()


def test_a_pause_asked_for_inside_a_stretch_is_taken_at_the_next_poll_point() -> None:
    """The engine clears the grant while the worker is between two boundaries: the worker pauses
    at the next poll point inside the LoRA linears, before it reaches the next boundary."""
    model, adapter, store, scales, task = _setup()
    grant = threading.Event()
    grant.set()
    spec = WorkerSpec(model, store, scales, torch.zeros(2, 3, 1), torch.tensor([-1, 0, 0]), adapter, 0, 0.0, 0,
                      OptimConfig(lr=1e-3), grant=grant)
    spec.banks = torch.zeros(2, 3, sum(a.numel() + b.numel() for a, b in adapter.weights.values()))
    worker = _Worker(spec)
    in_poll = False
    cleared_at: list[float] = []
    first_paused_boundary: list[bool] = []  # whether the first boundary to find the grant cleared was a poll's
    poll, boundary = worker._poll_point, worker._layer_boundary

    def polling() -> None:
        nonlocal in_poll
        if not cleared_at:  # the first poll point: the engine asks for a pause now
            grant.clear()
            cleared_at.append(time.monotonic())
            threading.Timer(0.3, grant.set).start()
        in_poll = True
        try:
            poll()
        finally:
            in_poll = False

    def at_boundary(layer: int, polled: bool = False) -> None:
        if not grant.is_set() and not first_paused_boundary:
            first_paused_boundary.append(in_poll)
        boundary(layer, polled)

    worker._poll_point = polling  # type: ignore[method-assign]
    worker._layer_boundary = at_boundary  # type: ignore[method-assign]
    result = worker.run(task)
    assert first_paused_boundary == [True], "the pause waited for the next boundary"
    assert len(result.pause_times) == 1 and result.pause_times[0] - cleared_at[0] < 0.05
    assert result.pause_layers == (model.config.num_layers - 1,)  # the first layer's recompute
    assert result.pause_polled == (True,)
    assert result.paused_s >= 0.25


def test_sync_sites_count_each_synchronizing_call_site_and_pass_other_warnings_on(caplog) -> None:  # type: ignore[no-untyped-def]
    """COSERVE_TRAINER_SYNC_DEBUG: PyTorch's sync debug warnings counted by the calling line, each
    line's stack logged once; any other warning shown as before."""
    import logging
    import warnings

    from coserve.trainer.worker import _SyncSites

    shown: list[str] = []
    with warnings.catch_warnings():
        warnings.showwarning = lambda message, *_, **__: shown.append(str(message))
        sites = _SyncSites()
        sites.install()
        with caplog.at_level(logging.WARNING, logger="coserve.trainer.worker"):
            for _ in range(3):
                warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)  # one line
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)  # another
            warnings.warn("something else", UserWarning, stacklevel=1)
            sites.report()
    assert sorted(sites.counts.values()) == [1, 3] and shown == ["something else"]
    first_seen = [r for r in caplog.records if "a synchronizing CUDA operation at" in r.getMessage()]
    assert len(first_seen) == 2 and "test_sync_sites_count" in first_seen[0].getMessage()  # (with its stack)
    assert any("3 synchronizing CUDA operations at" in r.getMessage() for r in caplog.records)


def test_a_trainers_start_says_what_its_stages_took() -> None:
    """TrainerProcess.start_stages: the seconds until the worker's entry point ran, until it had
    built its worker and until it had warmed up (what a job's set-up line names: 14-20 s of
    trainer start on session 44's H100, of which nothing said where), each once reached, and
    again from zero on a restart."""
    model, adapter, store, scales, _ = _setup()
    began = time.time()
    trainer = TrainerProcess(model, store, scales, adapter, slot=0, optim=OptimConfig(lr=1e-3), num_threads=1,
                             warmup_rows=(12,))
    try:
        stages = trainer.start_stages()  # (the construction waited for the warm-up: every stage)
        assert list(stages) == ["process", "build", "warm_up"] and all(s >= 0 for s in stages.values())
        assert stages["process"] > 0 and sum(stages.values()) <= time.time() - began
        trainer.restart()
        deadline = time.monotonic() + 60
        while "build" not in trainer.start_stages():  # (a restart does not wait)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert list(trainer.start_stages())[:2] == ["process", "build"]
    finally:
        trainer.close()


def test_a_trainer_ends_with_the_server_that_started_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A server killed outright (no exit handlers: those end daemonic children) leaves no trainer
    behind, waiting for ever on its task queue: it sees its parent gone and exits."""
    from tests.parent_gone import assert_child_ends_with_parent

    assert_child_ends_with_parent(tmp_path, """
        import torch
        from coserve.core.config import OptimConfig
        from coserve.models.loader import load_model
        from coserve.models.peft_adapter import new_lora_adapter
        from coserve.trainer.process import TrainerProcess
        model = load_model("tiny", num_lora_slots=1, max_lora_rank=8)
        cfg = model.config
        adapter = new_lora_adapter(num_layers=cfg.num_layers, shapes=cfg.linear_shapes(), rank=4, alpha=8,
                                   target_modules=("q_proj",), seed=0)
        store = torch.zeros(cfg.num_layers + 1, 8, cfg.hidden_size)
        trainer = TrainerProcess(model, store, torch.zeros(1), adapter, slot=0, optim=OptimConfig(lr=1e-3),
                                 num_threads=1, warmup_rows=(4,))  # (returns once its worker runs)
        print(trainer.pid, flush=True)
        os._exit(0)
    """)

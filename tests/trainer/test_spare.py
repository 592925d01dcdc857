"""The spare trainer interpreter (coserve.trainer.spare): a trainer started from one trains as a
freshly spawned one, takes the environment of its start, and a spare is used only where its
imports read the environment of now; an unused spare ends with its parent."""

from __future__ import annotations

import logging
import os
import queue
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from coserve.core.config import OptimConfig
from coserve.core.messages import BackwardTask, TaskSample
from coserve.models.loader import load_model
from coserve.models.peft_adapter import new_lora_adapter
from coserve.trainer import spare
from coserve.trainer.mps import MPS_SHARE_ENV, mps_share
from coserve.trainer.process import TrainerProcess


@pytest.fixture(autouse=True)
def _no_spare_left() -> Iterator[None]:
    spare.HELD.discard()
    yield
    spare.HELD.discard()
    spare.HELD.disabled = None


def _setup():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = load_model("tiny", num_lora_slots=1, max_lora_rank=8)
    cfg = model.config
    adapter = new_lora_adapter(num_layers=cfg.num_layers, shapes=cfg.linear_shapes(), rank=4, alpha=8,
                               target_modules=("q_proj", "v_proj"), seed=0)
    store = torch.randn(cfg.num_layers + 1, 32, cfg.hidden_size)
    task = BackwardTask(0, 0, (TaskSample(0, 0, tuple(range(10, 30))),), ends_step=True)
    return model, adapter, store, task


def _train_one(trainer: TrainerProcess, task: BackwardTask) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    trainer.submit(task)
    results = trainer.poll(timeout=60.0)
    assert len(results) == 1 and results[0].step_info is not None
    return trainer.committed_adapter().weights


def _held() -> spare.Spare:
    held = spare.HELD._spare
    assert held is not None, "no spare was started"
    return held


def test_wanted_reads_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(spare.SPARE_ENV, raising=False)
    assert spare.wanted(torch.device("cuda")) and not spare.wanted(torch.device("cpu"))
    monkeypatch.setenv(spare.SPARE_ENV, "1")
    assert spare.wanted(torch.device("cpu"))
    monkeypatch.setenv(spare.SPARE_ENV, "0")
    assert not spare.wanted(torch.device("cuda"))
    monkeypatch.setenv(spare.SPARE_ENV, "yes")
    with pytest.raises(ValueError, match="COSERVE_TRAINER_SPARE='yes'"):
        spare.wanted(torch.device("cpu"))


def test_a_trainer_from_a_spare_trains_as_a_fresh_one_and_keeps_a_spare(monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """The spare's process becomes the trainer (its pid), trains to the same adapter as a trainer
    spawned afresh, pauses and resumes on its grant, waits for its warm-up; with keep_spare,
    another spare is held after each start, and a restart takes it. The log says when a spare
    started and what its imports took."""
    caplog.set_level(logging.INFO, logger=spare.__name__)
    model, adapter, store, task = _setup()
    fresh = TrainerProcess(model, store, torch.zeros(1), adapter, slot=0, optim=OptimConfig(lr=1e-3), num_threads=1)
    try:
        expected = _train_one(fresh, task)
    finally:
        fresh.close()

    monkeypatch.setenv(spare.SPARE_ENV, "1")
    model, adapter, store, task = _setup()
    spare.prepare_for(torch.device("cpu"))
    first = _held()
    trainer = TrainerProcess(model, store, torch.zeros(1), adapter, slot=0, optim=OptimConfig(lr=1e-3),
                             num_threads=1, warmup_rows=(12,), keep_spare=True)
    try:
        assert trainer.pid == first.proc.pid, "the held spare was not used"
        assert f"started a spare trainer interpreter (pid {first.proc.pid})" in caplog.text
        deadline = time.monotonic() + 10
        while "spare trainer interpreter ready: its imports took" not in caplog.text:  # (its watch: within 1 s)
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert trainer._ready is first.ready and trainer._ready.is_set()  # (its warm-up waited for)
        assert list(trainer.start_stages()) == ["process", "build", "warm_up"]
        second = _held()
        assert second is not first and second.proc.is_alive()
        trainer.pause()
        trainer.submit(task)
        assert trainer.poll(timeout=2.0) == []  # paused at its first boundary, on the spare's grant
        trainer.resume()
        results = trainer.poll(timeout=60.0)
        assert len(results) == 1 and results[0].step_info is not None
        got = trainer.committed_adapter().weights
        assert got.keys() == expected.keys()
        for key, (a, b) in expected.items():
            assert torch.equal(got[key][0], a) and torch.equal(got[key][1], b), key
        trainer.restart()
        assert trainer.pid == second.proc.pid and not first.proc.is_alive()
        assert trainer.committed_steps == 1
        trainer.submit(task)
        assert len(trainer.poll(timeout=60.0)) == 1
        assert trainer.committed_steps == 2
    finally:
        trainer.close()
    assert not trainer.alive()


def test_a_spare_of_another_import_environment_is_not_used(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A coserve switch set after the spare started (read at import by the spare, not by a fresh
    interpreter): the spare is closed and the trainer spawned afresh; an MPS share set around the
    start is no such change (it is handed over)."""
    caplog.set_level(logging.INFO, logger=spare.__name__)
    monkeypatch.setenv(spare.SPARE_ENV, "1")
    model, adapter, store, task = _setup()
    spare.prepare_for(torch.device("cpu"))
    held = _held()
    with mps_share(50):
        assert held.usable()
    monkeypatch.setenv("COSERVE_LOSS_CHUNK", "64")
    assert not held.usable()
    trainer = TrainerProcess(model, store, torch.zeros(1), adapter, slot=0, optim=OptimConfig(lr=1e-3), num_threads=1)
    try:
        assert trainer.pid != held.proc.pid
        held.proc.join(timeout=10)
        assert not held.proc.is_alive()
        assert "the environment changed since it started" in caplog.text
        assert spare.HELD._spare is None  # (keep_spare off: none started after)
        assert len(trainer.poll(timeout=0.0)) == 0
        trainer.submit(task)
        assert len(trainer.poll(timeout=60.0)) == 1
    finally:
        trainer.close()


def _probe_at_load() -> SimpleNamespace:
    return SimpleNamespace(share_at_load=os.environ.get(MPS_SHARE_ENV), grant=None, ready=None)


class _Probe:
    """Unpickles into a namespace that says the MPS share its unpickling saw (where the spec's CUDA
    tensors open the trainer's context)."""

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (_probe_at_load, ())


def test_the_spare_sets_the_handed_over_environment_before_it_reads_the_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    from coserve.trainer import worker

    monkeypatch.delenv(MPS_SHARE_ENV, raising=False)
    ran: list[SimpleNamespace] = []
    monkeypatch.setattr(worker, "run_worker", lambda spec, tasks, results: ran.append(spec))
    setup: queue.Queue[object] = queue.Queue()
    grant, ready = object(), object()
    setup.close = lambda: None  # type: ignore[attr-defined]  # (a queue.Queue has none)
    held = SimpleNamespace(_setup=setup, _handed_over=False)
    with mps_share(30):
        spare.Spare.hand_over(held, _Probe(), wait_ready=False)  # type: ignore[arg-type]
    assert os.environ.get(MPS_SHARE_ENV) is None
    spare.spare_main(setup, None, None, grant, ready)
    assert len(ran) == 1 and ran[0].share_at_load == "30"
    assert ran[0].grant is grant and ran[0].ready is None  # (wait_ready=False)
    assert os.environ.pop(MPS_SHARE_ENV) == "30"


def test_an_unused_spare_ends_with_the_process_that_started_it(tmp_path: Path) -> None:
    """A server killed without its exit handlers (the spare is daemonic: those would end it) leaves
    no spare behind."""
    from tests.parent_gone import assert_child_ends_with_parent

    assert_child_ends_with_parent(tmp_path, """
        import torch
        from coserve.trainer import spare
        spare.prepare_for(torch.device("cpu"))
        print(spare.HELD._spare.proc.pid, flush=True)
        os._exit(0)
    """, env={spare.SPARE_ENV: "1"}, timeout_s=90)



@pytest.mark.parametrize("warm", [True, False])
def test_a_trainer_whose_spare_died_in_the_hand_over_turns_spares_off(monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture,
                                                                      warm: bool) -> None:
    """A spare that ends before its worker runs (here killed as the spec is handed over; on a GPU,
    say, a CUDA context that cannot be made) turns spares off for the process: found by the
    start-up's wait for the warm-up, or else by the restart the dead trainer gets; that restart
    spawns afresh and trains, and no spare is started again."""
    monkeypatch.setenv(spare.SPARE_ENV, "1")
    model, adapter, store, task = _setup()
    hand_over = spare.Spare.hand_over

    def dying(self: spare.Spare, spec: object, *, wait_ready: bool) -> None:
        hand_over(self, spec, wait_ready=wait_ready)
        self.proc.kill()

    monkeypatch.setattr(spare.Spare, "hand_over", dying)
    spare.prepare_for(torch.device("cpu"))
    held = _held()
    trainer = TrainerProcess(model, store, torch.zeros(1), adapter, slot=0, optim=OptimConfig(lr=1e-3),
                             num_threads=1, warmup_rows=(12,) if warm else (), keep_spare=True)
    try:
        assert trainer.pid == held.proc.pid
        held.proc.join(timeout=10)
        if not warm:
            assert spare.HELD.disabled is None and spare.HELD._spare is not None
            trainer.restart()
        assert spare.HELD.disabled is not None and "ended before its worker ran" in caplog.text
        assert spare.HELD._spare is None  # (the one keep_spare started is gone too)
        spare.prepare_for(torch.device("cpu"))
        assert spare.HELD._spare is None
        if warm:
            trainer.restart()
        assert trainer.pid != held.proc.pid
        trainer.submit(task)
        assert len(trainer.poll(timeout=60.0)) == 1
    finally:
        trainer.close()

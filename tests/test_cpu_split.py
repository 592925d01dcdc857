"""The engine's and the trainer's processes on CPUs of their own (COSERVE_ENGINE_CPUS)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from coserve.cpu_split import (
    ENGINE_CPUS_ENV,
    core_siblings,
    engine_cpus_from_env,
    parse_cpu_list,
    split_cpus,
)


@pytest.mark.parametrize(
    ("allowed", "engine", "expected"),
    [
        ({0, 1, 2, 3}, 1, ((0,), (1, 2, 3))),
        ({0, 1, 2, 3}, 3, ((0, 1, 2), (3,))),
        ({5, 2, 9, 7}, 2, ((2, 5), (7, 9))),  # the lowest-numbered, whatever the order given
        ({0, 1, 2, 3}, 0, None),  # no split asked for
        ({0, 1, 2, 3}, 4, None),  # the trainer would get none
        ({0, 1, 2, 3}, 9, None),
        ({3}, 1, None),
    ],
)
def test_split_cpus(allowed: set[int], engine: int, expected: object) -> None:
    assert split_cpus(allowed, engine) == expected


def test_split_cpus_keeps_a_cores_hyperthreads_together() -> None:
    """Eight cores of two threads numbered 0-7 and 8-15 (cpu k beside cpu k + 8): the engine's
    cores come with their second threads, none of which the trainer gets."""
    def siblings(cpu: int) -> frozenset[int]:
        return frozenset({cpu % 8, cpu % 8 + 8})

    assert split_cpus(range(16), 4, siblings) == ((0, 1, 8, 9), (2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15))
    # whole cores: at least the CPUs asked for
    assert split_cpus(range(16), 3, siblings) == split_cpus(range(16), 4, siblings)
    assert split_cpus(range(16), 5, siblings) == ((0, 1, 2, 8, 9, 10), (3, 4, 5, 6, 7, 11, 12, 13, 14, 15))
    # a sibling outside the allowed mask is not taken; whole cores for the engine leave none: no split
    assert split_cpus({0, 1, 9}, 2, siblings) is None
    assert split_cpus({0, 2, 8}, 1, siblings) == ((0, 8), (2,))


@pytest.mark.parametrize(("text", "cpus"), [("0", [0]), ("0-3", [0, 1, 2, 3]), ("0,8", [0, 8]),
                                            ("0-1,8-9\n", [0, 1, 8, 9])])
def test_parse_cpu_list(text: str, cpus: list[int]) -> None:
    assert parse_cpu_list(text) == cpus


def test_core_siblings_of_this_machine_hold_the_cpu_itself() -> None:
    cpu = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    assert cpu in core_siblings(cpu)
    assert core_siblings(10**6) == frozenset({10**6})  # (no such CPU: itself alone)


@pytest.mark.parametrize(("raw", "count"), [(None, 0), ("", 0), ("0", 0), (" 4 ", 4)])
def test_engine_cpus_from_env(monkeypatch: pytest.MonkeyPatch, raw: str | None, count: int) -> None:
    if raw is None:
        monkeypatch.delenv(ENGINE_CPUS_ENV, raising=False)
    else:
        monkeypatch.setenv(ENGINE_CPUS_ENV, raw)
    assert engine_cpus_from_env() == count


@pytest.mark.parametrize("raw", ["two", "1.5", "-1"])
def test_engine_cpus_from_env_names_the_variable_on_bad_values(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(ENGINE_CPUS_ENV, raw)
    with pytest.raises(ValueError, match=ENGINE_CPUS_ENV):
        engine_cpus_from_env()


# In a process of its own: the split pins the process that makes it.
_TRAINER_ON_ITS_OWN_CPUS = textwrap.dedent(
    """
    import os, torch
    from coserve.core.config import OptimConfig
    from coserve.core.messages import BackwardTask, TaskSample
    from coserve.models.loader import load_model
    from coserve.models.peft_adapter import new_lora_adapter
    from coserve.trainer.process import TrainerProcess

    def threads_cpus(pid):
        return {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")}

    allowed = sorted(os.sched_getaffinity(0))
    torch.set_num_threads(2)
    torch.ones(64, 64) @ torch.ones(64, 64)  # the engine's intra-op threads exist before the split
    model = load_model("tiny", num_lora_slots=1, max_lora_rank=8)
    cfg = model.config
    adapter = new_lora_adapter(num_layers=cfg.num_layers, shapes=cfg.linear_shapes(), rank=4, alpha=8,
                               target_modules=("q_proj", "v_proj"), seed=0)
    store = torch.randn(cfg.num_layers + 1, 32, cfg.hidden_size)
    trainer = TrainerProcess(model, store, torch.zeros(1), adapter, slot=0, optim=OptimConfig(lr=1e-3),
                             num_threads=2)
    try:
        for attempt in range(2):  # the first worker, then a restarted one: the same CPUs
            trainer.submit(BackwardTask(attempt, 0, (TaskSample(0, 0, tuple(range(10, 30))),), ends_step=True))
            assert len(trainer.poll(timeout=60.0)) == 1
            assert threads_cpus(os.getpid()) == {frozenset(allowed[:1])}, threads_cpus(os.getpid())
            assert threads_cpus(trainer._proc.pid) == {frozenset(allowed[1:])}, threads_cpus(trainer._proc.pid)
            assert torch.get_num_threads() == 1  # no more intra-op threads than its CPUs
            trainer.restart()
    finally:
        trainer.close()
    print("split ok")
    """
)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two CPUs")
def test_engine_and_trainer_run_on_cpus_of_their_own() -> None:
    env = {**os.environ, ENGINE_CPUS_ENV: "1"}
    out = subprocess.run([sys.executable, "-c", _TRAINER_ON_ITS_OWN_CPUS], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "split ok" in out.stdout, out.stderr[-3000:]

"""A result's command names the COSERVE_* switches it ran with: A/B runs differ only there."""

from __future__ import annotations

import pytest

from coserve.bench.provenance import provenance


def test_command_starts_with_the_switches_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COSERVE_LORA_EXPAND_FIRST", "1")
    monkeypatch.setenv("COSERVE_COMMIT", "abc123")  # provenance's own: in "commit", not the command
    got = provenance(["bench/engine_speed.py", "--sections", "lora"])
    assert got["command"].startswith("COSERVE_LORA_EXPAND_FIRST=1 ")
    assert got["command"].endswith("bench/engine_speed.py --sections lora")
    assert "COSERVE_COMMIT" not in got["command"] and got["commit"] == "abc123"


def test_command_names_this_process_mps_share(monkeypatch: pytest.MonkeyPatch) -> None:
    # an engine run as a limited MPS client (first_call.sh's latency_env=CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50)
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/tmp/mps")  # where the daemon is: not a switch
    got = provenance(["bench/coserve_latency.py"])["command"]
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 " in got and "CUDA_MPS_PIPE_DIRECTORY" not in got

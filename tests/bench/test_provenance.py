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

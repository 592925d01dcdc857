"""bench/first_call.sh's choice of lanes by the GPU that came (H100_LANES), with a stand-in
``nvidia-smi`` and job names it does not know (each logged as such, nothing run)."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "first_call.sh"


def lanes_run(tmp_path: Path, gpu: str, h100_lanes: str | None, *lanes: str) -> list[str]:
    """The status lines of a first_call.sh run on a GPU named ``gpu``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '{gpu}'\n")
    smi.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "H100_LANES"}
    env |= {"PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "OUT": str(out)}
    if h100_lanes is not None:
        env["H100_LANES"] = h100_lanes
    # (run from an empty folder: no .whl to install, no job finds its files)
    subprocess.run(["bash", str(SCRIPT), *lanes], cwd=tmp_path, env=env, check=True, capture_output=True, timeout=60)
    with tarfile.open(out / "first.tar.gz") as tar:
        status = tar.extractfile("first/status.txt")
        assert status is not None
        return status.read().decode().splitlines()


def test_an_h100_runs_the_h100_lanes(tmp_path: Path) -> None:
    got = lanes_run(tmp_path, "NVIDIA H100 80GB HBM3", "jobA jobB|jobC", "planned")
    assert got[:2] == ["gpu: NVIDIA H100 80GB HBM3", "no H200: the lanes of H100_LANES"]
    assert sorted(got[2:]) == ["unknown job jobA", "unknown job jobB", "unknown job jobC"]


@pytest.mark.parametrize("h100_lanes", [None, "jobA"])
def test_an_h200_or_no_h100_lanes_runs_the_lanes_given(tmp_path: Path, h100_lanes: str | None) -> None:
    gpu = "NVIDIA H200" if h100_lanes else "NVIDIA H100 80GB HBM3"
    got = lanes_run(tmp_path, gpu, h100_lanes, "planned other")
    assert got == [f"gpu: {gpu}", "unknown job planned", "unknown job other"]

"""Tests' helper: a child process outlives no process that started it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path


def assert_child_ends_with_parent(tmp_path: Path, body: str, env: dict[str, str] | None = None,
                                  timeout_s: float = 30.0) -> None:
    """Run ``body`` (a main-module script, indented as one block under ``if __name__ ==
    "__main__":``, that prints a child's pid and ends by ``os._exit``: no exit handlers, as a
    server killed outright) in a fresh interpreter, then wait until that child is gone."""
    script = tmp_path / "parent.py"
    script.write_text('import os\nif __name__ == "__main__":\n' + textwrap.indent(textwrap.dedent(body), "    "))
    full = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=full, timeout=120)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        assert time.monotonic() < deadline, f"pid {pid} outlived the process that started it"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False

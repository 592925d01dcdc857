"""``OUTPUT/train_log.jsonl``: one JSON object per optimizer step (the fields of
:class:`~coserve.core.coserver.OptimizerStepLog`), written as each step is logged and read back by a resume.

The lines are strict JSON (RFC 8259), which other tools read without Python's extensions: a
non-finite float (the ``grad_norm`` of a step skipped for a non-finite gradient, its loss) is
written as ``null``, like a value that never came (``reported`` false).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def entry_line(fields: dict[str, Any]) -> str:
    """A step's fields (``asdict`` of an :class:`~coserve.core.coserver.OptimizerStepLog`, or a
    line read back) as one line of the train log, with its newline; NaN and infinities as null
    (a log written before they were: its lines rewritten by a resume)."""
    finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in fields.items()}
    return json.dumps(finite, allow_nan=False) + "\n"


def read_train_log(path: Path) -> list[dict[str, Any]]:
    """The steps logged in ``path`` (none where there is no file), in order. A last line that is
    not a step (cut short: the machine stopped as it was written) is dropped with a warning; a
    line before it that is not one is a ``ValueError`` naming the file and the line."""
    if not path.is_file():
        return []
    numbered = [(i, line) for i, line in enumerate(path.read_text().splitlines(), start=1) if line.strip()]
    entries = []
    for k, (number, line) in enumerate(numbered):
        try:
            entry = json.loads(line)
            if not isinstance(entry, dict) or not isinstance(entry.get("step"), int):
                raise ValueError("not an object with an integer 'step'")
        except ValueError as e:
            if k == len(numbered) - 1:
                logger.warning("%s: line %d is not a whole step (%s): dropped, as a write cut short", path, number, e)
                break
            raise ValueError(f"{path}: line {number} is not a logged step ({e}); the train log is damaged "
                             "before its last line: repair that line, or start a new run without --resume") from e
        entries.append(entry)
    return entries

"""Datasets shipped in the package, so that the demo and a first ``coserve serve`` or
``coserve finetune`` need no files: ``--finetune-data tiny_facts`` (or ``--data tiny_facts``)
names the built-in one wherever no file of that name exists."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

BUILTIN_DATASETS = {"tiny_facts": "tiny_facts.jsonl"}
"""Built-in dataset name -> its file in this package. ``tiny_facts``: short question-answer
pairs that the built-in ``tiny`` model visibly learns in a minute on a CPU."""


def builtin_dataset(name: str = "tiny_facts") -> Path:
    """The packaged file of the built-in dataset ``name``.

    Raises:
        KeyError: no built-in dataset has that name.
    """
    return Path(str(resources.files(__name__) / BUILTIN_DATASETS[name]))


def resolve_dataset(arg: str | Path) -> Path:
    """The dataset a ``--data``/``--finetune-data`` argument names: the path itself where it
    exists or is no built-in name, else the built-in dataset of that name."""
    path = Path(arg)
    if not path.exists() and str(arg) in BUILTIN_DATASETS:
        return builtin_dataset(str(arg))
    return path

"""What makes a fine-tuning run the run it is, recorded in its checkpoint, so that ``--resume``
goes on only from a checkpoint that a run of the same settings wrote.

A checkpoint holds a run's optimizer steps so far, the samples they trained and where its
learning-rate schedule stands. A resume with another dataset, adapter shape or optimizer would
carry that state into a run it does not belong to (a fresh run into the same ``--output`` used to
leave the previous run's checkpoint there, and a later ``--resume`` went on from it silently).
:func:`run_identity` is what a checkpoint records; :func:`identity_differences` says, flag by flag,
where a resume's settings are not the checkpoint's.

What a resume may change: ``--epochs`` (to train longer, or stop sooner where the run has not
passed that epoch yet; the schedule is stretched to the new count of steps), and everything that
does not change what is trained: threads, checkpoint cadence, latency SLOs, device settings.
"""

from __future__ import annotations

import json
import zlib
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coserve.core.finetune import FTSample

FLAGS = {
    "model": "--model",
    "data": "--data",
    "init_adapter": "--init-adapter",
    "lora.rank": "--lora-rank",
    "lora.alpha": "--lora-alpha",
    "lora.dropout": "--lora-dropout",
    "lora.target_modules": "--target-modules",
    "lora.use_rslora": "use_rslora",
    "optim.lr": "--lr",
    "optim.betas": "betas",
    "optim.eps": "eps",
    "optim.weight_decay": "--weight-decay",
    "optim.lr_scheduler": "--lr-scheduler",
    "optim.warmup_steps": "--warmup-steps",
    "optim.max_grad_norm": "--max-grad-norm",
    "optim.accumulation_tasks": "--grad-accum",
    "coserve.backward_tokens": "--backward-tokens",
    "coserve.max_seq_len": "--max-seq-len",
    "coserve.seed": "--seed",
    "coserve.shuffle": "shuffle",
    "coserve.train_on_prompt": "--train-on-prompt",
    "coserve.candidate_window": "candidate_window",
}
"""The settings a resume must share with its checkpoint, each with the flag that sets it (a
setting without a flag by its field name)."""


def data_digest(samples: Sequence[FTSample]) -> str:
    """A CRC-32 of the samples' token ids and labels, in order (hex): the dataset as trained, so
    that an edited file, another tokenizer, ``--max-seq-len`` or ``--train-on-prompt`` show."""
    crc = 0
    for s in samples:
        crc = zlib.crc32(array("q", s.input_ids).tobytes(), crc)
        crc = zlib.crc32(array("q", s.labels).tobytes(), crc)
    return f"{crc:08x}"


def run_identity(*, model: str, data: Path, samples: Sequence[FTSample], num_tokens: int,
                 init_adapter: Path | None, lora: dict[str, Any], optim: dict[str, Any],
                 coserve: dict[str, Any]) -> dict[str, Any]:
    """The settings of :data:`FLAGS`, as JSON values (``lora``, ``optim`` and ``coserve``: the
    configs' fields, ``dataclasses.asdict``); the dataset as its sample count, token count and
    :func:`data_digest`, with its path beside them (shown, not compared: a file may move)."""
    sections = {"lora": lora, "optim": optim, "coserve": coserve}
    out: dict[str, Any] = {
        "model": model,
        "data": {"samples": len(samples), "tokens": num_tokens, "digest": data_digest(samples)},
        "data_path": str(data),
        "init_adapter": None if init_adapter is None else str(init_adapter),
    }
    for key in FLAGS:
        section, _, name = key.partition(".")
        if name:
            out[key] = sections[section][name]
    return json.loads(json.dumps(out))  # (tuples as lists: what a checkpoint reads back)


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    if isinstance(value, dict):
        return f"{value['samples']} samples, {value['tokens']} tokens, digest {value['digest']}"
    return "none" if value is None else str(value)


def identity_differences(saved: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """Where ``here`` (this run's :func:`run_identity`) differs from ``saved`` (a checkpoint's),
    one ``FLAG VALUE (the checkpoint's: VALUE)`` each; empty where they agree. A setting that
    ``saved`` lacks (a checkpoint of an older version) is not compared."""
    differ = []
    for key, flag in FLAGS.items():
        if key not in saved or saved[key] == here.get(key):
            continue
        mine, theirs = _shown(here.get(key)), _shown(saved[key])
        if key == "data":
            mine = f"{here.get('data_path')}: {mine}"
            theirs = f"{saved.get('data_path')}: {theirs}"
        differ.append(f"{flag} {mine} (the checkpoint's: {theirs})")
    return differ

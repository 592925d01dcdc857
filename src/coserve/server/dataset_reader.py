"""A fine-tuning job's dataset read in a child process, off the serving process's GIL.

Reading a dataset is Python from end to end (JSON rows, chat templates, tokenization, labels).
In a thread of the server's process it takes the GIL from the engine's thread for as long as it
runs: on the 2-core dev VM, 3,000 rows read in a thread beside the tiny engine made its steps
~12x slower for the read's 1.2 s at the server's 0.1 ms switch interval (step p50 39.9 against
3.4 ms), and stopped them for the whole read (0.83 s) at CPython's 5 ms; read by this reader,
the steps kept their median (3.7 ms; p99 19.8 against 14.7 ms, the longest 55 ms while the
samples were rebuilt here; ``bench/dataset_read_stall.py``,
``bench/results/host_cpu/session33/dataset_read_stall.json``).
:class:`DatasetReader` keeps one spawned child with the engine's tokenizer (pickled once, at
start-up), reads there as :func:`coserve.server.finetune.read_dataset` does, and sends the samples
back as two flat integer arrays, rebuilt here one sample at a time (a pickle of the tuples
themselves would hold the GIL through one long load of all of them).
Where the child cannot start or dies, it reads in this process instead and says so.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import numpy as np

from coserve.core.finetune import FTDataset, FTSample, load_dataset
from coserve.parent_watch import exit_with_parent, leave_signals_to_parent, signals_held

logger = logging.getLogger(__name__)

_TOKENIZER: Any = None  # (the child's: set by its initializer)


def _set_tokenizer(tokenizer: Any) -> None:
    global _TOKENIZER
    _TOKENIZER = tokenizer
    leave_signals_to_parent()  # (started with them held: the server's Ctrl-C is the server's to handle)
    exit_with_parent()  # (a server killed outright leaves no reader behind)


def _read_packed(path: str, max_seq_len: int, train_on_prompt: bool, vocab_size: int) -> tuple[Any, ...]:
    """(the child) The dataset, its samples packed: ids, token ids and labels (int32, end to end),
    each sample's length; the skipped rows and the stats as they are."""
    ds = load_dataset(path, _TOKENIZER, max_seq_len=max_seq_len, train_on_prompt=train_on_prompt,
                      vocab_size=vocab_size)
    lengths = np.fromiter((len(s.input_ids) for s in ds.samples), dtype=np.int64, count=len(ds.samples))
    total = int(lengths.sum())
    ids = np.fromiter((t for s in ds.samples for t in s.input_ids), dtype=np.int32, count=total)
    labels = np.fromiter((t for s in ds.samples for t in s.labels), dtype=np.int32, count=total)
    sample_ids = np.fromiter((s.sample_id for s in ds.samples), dtype=np.int64, count=len(ds.samples))
    return sample_ids, lengths, ids, labels, ds.skipped, ds.stats


def _unpacked(path: Path, packed: tuple[Any, ...]) -> FTDataset:
    sample_ids, lengths, ids, labels, skipped, stats = packed
    ends = np.cumsum(lengths).tolist()
    samples = []
    start = 0
    for sid, end in zip(sample_ids.tolist(), ends, strict=True):
        # (one short call per sample: the engine's thread takes the GIL back between two)
        samples.append(FTSample(sid, tuple(ids[start:end].tolist()), tuple(labels[start:end].tolist())))
        start = end
    return FTDataset(path, tuple(samples), skipped, stats)


class DatasetReader:
    """``read(path, max_seq_len=, train_on_prompt=, vocab_size=)``: :func:`load_dataset` with
    ``tokenizer``, in a child process (module docstring). ``close()`` ends the child."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._pool: ProcessPoolExecutor | None = None
        try:
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_set_tokenizer, initargs=(tokenizer,))
            # (the child starts now, at the server's start-up, not at the first upload: the
            # tokenizer is pickled for it here; its imports run in the child, not waited for)
            with signals_held():  # (the child is spawned by this thread, in the submit)
                self._pool.submit(int)
        except (OSError, ValueError, BrokenProcessPool, pickle.PicklingError) as e:
            logger.warning("datasets will be read in the server's process (no child: %s)", e)
            self.close()

    def read(self, path: str | Path, *, max_seq_len: int, train_on_prompt: bool, vocab_size: int) -> FTDataset:
        """The dataset at ``path``; raises as :func:`load_dataset` does (``DatasetError``,
        ``ValueError``)."""
        if self._pool is not None:
            # (what the child raises, load_dataset's errors among it, comes back as raised there;
            # only a child that cannot start or run turns the reading back to this process)
            try:
                packed = self._pool.submit(_read_packed, str(path), max_seq_len, train_on_prompt, vocab_size).result()
            except (BrokenProcessPool, OSError, pickle.PicklingError) as e:
                logger.warning("the dataset reader's child failed (%s): datasets are read in the server's "
                               "process from now on", e)
                self.close()
            else:
                return _unpacked(Path(path), packed)
        return load_dataset(path, self.tokenizer, max_seq_len=max_seq_len, train_on_prompt=train_on_prompt,
                            vocab_size=vocab_size)

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

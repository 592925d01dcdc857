"""A job's dataset read in a child process: the same dataset as read here, the same errors, and a
reader whose child cannot run reads here instead."""

from __future__ import annotations

import json
import logging
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import pytest

from coserve import EngineConfig, LLMEngine
from coserve.core.finetune import DatasetError, load_dataset
from coserve.server.dataset_reader import DatasetReader

ROWS = [
    {"instruction": "Where is the candle?", "output": "The candle is in the north."},
    "not json",
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]},
    {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
    {"instruction": "no output"},
]


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return LLMEngine(EngineConfig(model="tiny")).tokenizer


def write(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_the_child_reads_what_this_process_reads(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    data = write(tmp_path / "rows.jsonl", ROWS * 30)
    reader = DatasetReader(tokenizer)
    try:
        for kwargs in (dict(max_seq_len=64, train_on_prompt=False, vocab_size=1024),
                       dict(max_seq_len=8, train_on_prompt=True, vocab_size=1024)):
            got = reader.read(data, **kwargs)
            assert got == load_dataset(data, tokenizer, **kwargs)
            assert len(got.samples) == 90 and len(got.skipped) == 60
        with pytest.raises(DatasetError, match="no usable"):
            reader.read(write(tmp_path / "bad.jsonl", ["not json"]), max_seq_len=64, train_on_prompt=False,
                        vocab_size=1024)
        with pytest.raises(DatasetError, match="cannot read dataset: no such file"):
            reader.read(tmp_path / "gone.jsonl", max_seq_len=64, train_on_prompt=False, vocab_size=1024)
    finally:
        reader.close()


def test_a_reader_whose_child_fails_reads_here_and_says_so(tokenizer, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                           caplog: pytest.LogCaptureFixture) -> None:
    data = write(tmp_path / "rows.jsonl", ROWS)
    reader = DatasetReader(tokenizer)
    assert reader._pool is not None

    def broken(*args: object, **kwargs: object) -> None:
        raise BrokenProcessPool("a child died")

    reader._pool.shutdown()
    reader._pool.submit = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="coserve.server.dataset_reader"):
        got = reader.read(data, max_seq_len=64, train_on_prompt=False, vocab_size=1024)
    assert got == load_dataset(data, tokenizer, max_seq_len=64, vocab_size=1024)
    assert "read in the server's process" in caplog.text and reader._pool is None
    reader.close()


def test_the_reader_ends_with_the_server_that_started_it(tmp_path: Path) -> None:
    """A server killed outright (no exit handlers) leaves no dataset reader behind."""
    from tests.parent_gone import assert_child_ends_with_parent

    assert_child_ends_with_parent(tmp_path, """
        from coserve import EngineConfig, LLMEngine
        from coserve.server.dataset_reader import DatasetReader
        reader = DatasetReader(LLMEngine(EngineConfig(model="tiny", device="cpu")).tokenizer)
        reader._pool.submit(int).result()  # (its child has run its initializer)
        print(*reader._pool._processes, flush=True)
        os._exit(0)
    """)

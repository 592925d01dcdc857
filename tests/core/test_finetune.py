from __future__ import annotations

import json
import logging
import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from coserve.core.finetune import (
    IGNORE_INDEX,
    DatasetError,
    FTDataset,
    FTSample,
    SkippedRow,
    TokenizerLike,
    load_dataset,
)
from coserve.core.sample_pool import SamplePool, _epoch_seed

M = IGNORE_INDEX
BOS = 1
EOS = 2


class CharTokenizer:
    """One token per ASCII character; a tiny Python chat template.

    A message renders as ``<r>content|`` (``r`` = first letter of the role); the generation
    prompt is ``<a>``. BOS/EOS are control characters 1 and 2, which never occur in test text.
    """

    vocab_size = 128

    def __init__(self, *, chat_template: str | None = "char-chat", eos: int | None = EOS) -> None:
        self.chat_template = chat_template
        self.eos_token_id = eos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [ord(c) for c in text]
        assert all(2 < i < self.vocab_size for i in ids), text
        return [BOS, *ids] if add_special_tokens else ids

    def render_message(self, m: dict[str, str], *, last: bool) -> str:
        return f"<{m['role'][0]}>{m['content']}|"

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = False,
        tokenize: bool = False,
    ) -> str | list[int]:
        text = "".join(
            self.render_message(m, last=i == len(messages) - 1) for i, m in enumerate(messages)
        )
        if add_generation_prompt:
            text += "<a>"
        return self.encode(text, add_special_tokens=False) if tokenize else text


class HidingTokenizer(CharTokenizer):
    """Hides earlier assistant turns, like templates that strip old reasoning."""

    def render_message(self, m: dict[str, str], *, last: bool) -> str:
        if m["role"] == "assistant" and not last:
            return "<a>...|"
        return super().render_message(m, last=last)


class CountingTokenizer(CharTokenizer):
    """Renders a header that depends on the conversation length: prefixes never line up."""

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = False,
        tokenize: bool = False,
    ) -> str | list[int]:
        text = super().apply_chat_template(messages, add_generation_prompt, tokenize=False)
        assert isinstance(text, str)
        return f"#{len(messages)}{text}"


class MergingTokenizer(CharTokenizer):
    """Encodes ``>>`` as one token (127), so a boundary can merge across two renderings."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out: list[int] = []
        for i in super().encode(text, add_special_tokens):
            if i == ord(">") and out and out[-1] == ord(">"):
                out[-1] = 127
            else:
                out.append(i)
        return out


class NoSystemTokenizer(CharTokenizer):
    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = False,
        tokenize: bool = False,
    ) -> str | list[int]:
        if any(m["role"] == "system" for m in messages):
            raise ValueError("System role not supported")
        return super().apply_chat_template(messages, add_generation_prompt, tokenize)


def enc(text: str) -> list[int]:
    return [ord(c) for c in text]


def expect(*parts: tuple[str | list[int], bool]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(input_ids, labels) for segments given as (text or ids, trained?)."""
    ids: list[int] = []
    labels: list[int] = []
    for part, trained in parts:
        seg = enc(part) if isinstance(part, str) else part
        ids += seg
        labels += seg if trained else [M] * len(seg)
    return tuple(ids), tuple(labels)


def write_jsonl(path: Path, rows: Sequence[object]) -> Path:
    path.write_text("".join(rows_lines(rows)))
    return path


def rows_lines(rows: Sequence[object]) -> list[str]:
    return [(r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows]


def load_rows(
    tmp_path: Path,
    rows: Sequence[object],
    tok: TokenizerLike | None = None,
    *,
    max_seq_len: int = 1024,
    train_on_prompt: bool = False,
) -> FTDataset:
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    return load_dataset(
        path,
        tok if tok is not None else CharTokenizer(),
        max_seq_len=max_seq_len,
        train_on_prompt=train_on_prompt,
    )


def one_sample(ds: FTDataset) -> tuple[tuple[int, ...], tuple[int, ...]]:
    assert len(ds.samples) == 1, ds.skipped
    return ds.samples[0].input_ids, ds.samples[0].labels


# ---------------------------------------------------------------------------------------------
# Row shapes and label masking
# ---------------------------------------------------------------------------------------------

ASSISTANT = {"role": "assistant", "content": "a"}
CHAT = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "q1"},
    {"role": "assistant", "content": "a1"},
    {"role": "user", "content": "q2"},
    {"role": "assistant", "content": "a2"},
]

SHAPE_CASES: list[tuple[str, dict[str, Any], TokenizerLike, bool, tuple[Any, ...]]] = [
    (
        "alpaca-template",
        {"instruction": "hi", "output": "yo"},
        CharTokenizer(),
        False,
        expect(("<u>hi|<a>", False), ("yo", True), ([EOS], True)),
    ),
    (
        "alpaca-template-input",
        {"instruction": "hi", "input": "x", "output": "yo"},
        CharTokenizer(),
        False,
        expect(("<u>hi\n\nx|<a>", False), ("yo", True), ([EOS], True)),
    ),
    (
        "alpaca-template-null-input",
        {"instruction": "hi", "input": None, "output": "yo"},
        CharTokenizer(),
        False,
        expect(("<u>hi|<a>", False), ("yo", True), ([EOS], True)),
    ),
    (
        "alpaca-plain",
        {"instruction": "hi", "input": "", "output": "yo"},
        CharTokenizer(chat_template=None),
        False,
        expect(
            ([BOS], False),
            ("### Instruction:\nhi\n\n### Response:\n", False),
            ("yo", True),
            ([EOS], True),
        ),
    ),
    (
        "alpaca-plain-input",
        {"instruction": "hi", "input": "x", "output": "yo"},
        CharTokenizer(chat_template=None),
        False,
        expect(
            ([BOS], False),
            ("### Instruction:\nhi\n\n### Input:\nx\n\n### Response:\n", False),
            ("yo", True),
            ([EOS], True),
        ),
    ),
    (
        "alpaca-no-eos",
        {"instruction": "hi", "output": "yo"},
        CharTokenizer(eos=None),
        False,
        expect(("<u>hi|<a>", False), ("yo", True)),
    ),
    (
        "alpaca-train-on-prompt",
        {"instruction": "hi", "output": "yo"},
        CharTokenizer(),
        True,
        expect(("<u>hi|<a>", True), ("yo", True), ([EOS], True)),
    ),
    (
        "chat",
        {"messages": CHAT},
        CharTokenizer(),
        False,
        expect(("<s>S|<u>q1|<a>", False), ("a1|", True), ("<u>q2|<a>", False), ("a2|", True)),
    ),
    (
        "chat-weight-0-is-context",  # OpenAI's weight: 0 on an assistant message
        {"messages": [*CHAT[:2], {**CHAT[2], "weight": 0}, *CHAT[3:4], {**CHAT[4], "weight": 1}]},
        CharTokenizer(),
        False,
        expect(("<s>S|<u>q1|<a>a1|<u>q2|<a>", False), ("a2|", True)),
    ),
    (
        "chat-last-weight-0-dropped",  # nothing after the last trained message is kept
        {"messages": [*CHAT[:4], {**CHAT[4], "weight": 0}]},
        CharTokenizer(),
        False,
        expect(("<s>S|<u>q1|<a>", False), ("a1|", True)),
    ),
    (
        "chat-text-parts-joined",  # OpenAI's content as a list of text parts
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}, {"type": "text", "text": "1"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "a1"}]}]},
        CharTokenizer(),
        False,
        expect(("<u>q1|<a>", False), ("a1|", True)),
    ),
    (
        "chat-trailing-user-dropped",
        {"messages": [*CHAT, {"role": "user", "content": "more"}]},
        CharTokenizer(),
        False,
        expect(("<s>S|<u>q1|<a>", False), ("a1|", True), ("<u>q2|<a>", False), ("a2|", True)),
    ),
    (
        "chat-opening-assistant-is-context",
        {
            "messages": [
                ASSISTANT,
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "b"},
            ]
        },
        CharTokenizer(),
        False,
        expect(("<a>a|<u>q|<a>", False), ("b|", True)),
    ),
    (
        "chat-train-on-prompt",
        {"messages": CHAT},
        CharTokenizer(),
        True,
        expect(("<s>S|<u>q1|<a>a1|<u>q2|<a>a2|", True)),
    ),
    (
        "chat-fallback-last-assistant-only",
        {"messages": CHAT},
        HidingTokenizer(),
        False,
        expect(("<s>S|<u>q1|<a>...|<u>q2|<a>", False), ("a2|", True)),
    ),
    (
        "chat-fallback-merged-boundary",
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ">x"}]},
        MergingTokenizer(),
        False,
        # "<a>" + ">x" encodes "<a" then the merged ">>": training starts at the merged token.
        expect(("<u>q|<a", False), ([127], True), ("x|", True)),
    ),
    (
        "pretokenized",
        {"input_ids": [5, 6, 7]},
        CharTokenizer(),
        False,
        ((5, 6, 7), (5, 6, 7)),
    ),
    (
        "pretokenized-labels",
        {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
        CharTokenizer(),
        False,
        ((5, 6, 7, 8), (M, M, 7, 8)),
    ),
    (
        "pretokenized-labels-kept-with-train-on-prompt",
        {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
        CharTokenizer(),
        True,
        ((5, 6, 7, 8), (M, M, 7, 8)),
    ),
    (
        "pretokenized-wins-over-text-columns",
        {"instruction": "hi", "output": "yo", "input_ids": [5, 6]},
        CharTokenizer(),
        False,
        ((5, 6), (5, 6)),
    ),
]


@pytest.mark.parametrize(
    ("row", "tok", "train_on_prompt", "expected"),
    [case[1:] for case in SHAPE_CASES],
    ids=[case[0] for case in SHAPE_CASES],
)
def test_row_shapes_and_labels(
    tmp_path: Path,
    row: dict[str, Any],
    tok: TokenizerLike,
    train_on_prompt: bool,
    expected: tuple[tuple[int, ...], tuple[int, ...]],
) -> None:
    ds = load_rows(tmp_path, [row], tok, train_on_prompt=train_on_prompt)
    assert one_sample(ds) == expected
    assert ds.skipped == ()


def test_shape_and_fallback_stats(tmp_path: Path) -> None:
    rows = [
        {"instruction": "hi", "output": "yo"},
        {"messages": CHAT},
        {"input_ids": [5, 6, 7]},
        {"input_ids": [5, 6, 7]},
    ]
    stats = load_rows(tmp_path, rows, HidingTokenizer()).stats
    assert (stats.num_alpaca, stats.num_chat, stats.num_pretokenized) == (1, 1, 2)
    assert stats.num_chat_fallbacks == 1
    assert stats.num_rows == stats.num_samples == 4
    stats = load_rows(tmp_path, rows, CharTokenizer()).stats
    assert stats.num_chat_fallbacks == 0


def test_sample_targets_follow_the_label_shift() -> None:
    s = FTSample(0, (5, 6, 7, 8), (5, M, 7, 8))
    assert (s.num_tokens, s.num_target_tokens) == (4, 2)  # labels[0] is never a target
    with pytest.raises(ValueError, match="labels length"):
        FTSample(0, (5, 6), (5,))


def test_sample_ids_count_usable_rows_only(tmp_path: Path) -> None:
    rows = [{"input_ids": [5, 6]}, "not json", {"input_ids": [7, 8]}, {"input_ids": [9, 10]}]
    ds = load_rows(tmp_path, rows)
    assert [(s.sample_id, s.input_ids) for s in ds.samples] == [
        (0, (5, 6)),
        (1, (7, 8)),
        (2, (9, 10)),
    ]
    assert len(ds) == 3


# ---------------------------------------------------------------------------------------------
# Chat masking against a real (jinja2) chat template
# ---------------------------------------------------------------------------------------------

HF_WORDS = [
    "[UNK]",  # 0
    "<s>",  # 1
    "<|im_start|>",  # 2
    "<|im_end|>",  # 3
    "system",  # 4
    "user",  # 5
    "assistant",  # 6
    "hello",  # 7
    "hi",  # 8
    "there",  # 9
    "how",  # 10
    "are",  # 11
    "you",  # 12
    "fine",  # 13
    "thanks",  # 14
    "be",  # 15
    "brief",  # 16
]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def hf_tokenizer() -> TokenizerLike:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    wl = Tokenizer(models.WordLevel({w: i for i, w in enumerate(HF_WORDS)}, unk_token="[UNK]"))
    wl.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=wl,
        unk_token="[UNK]",
        bos_token="<s>",
        eos_token="<|im_end|>",
        extra_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHATML
    return cast(TokenizerLike, tok)


def test_chat_masking_with_jinja_template(tmp_path: Path, hf_tokenizer: TokenizerLike) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "how are you"},
        {"role": "assistant", "content": "fine thanks"},
    ]
    ds = load_rows(tmp_path, [{"messages": messages}], hf_tokenizer)
    ids, labels = one_sample(ds)
    assert ids == (
        *(2, 4, 15, 16, 3),  # <|im_start|>system be brief<|im_end|>
        *(2, 5, 8, 3),  # <|im_start|>user hi<|im_end|>
        *(2, 6, 7, 9, 3),  # <|im_start|>assistant hello there<|im_end|>
        *(2, 5, 10, 11, 12, 3),  # <|im_start|>user how are you<|im_end|>
        *(2, 6, 13, 14, 3),  # <|im_start|>assistant fine thanks<|im_end|>
    )
    # The generation prompt "<|im_start|>assistant" stays masked; content and <|im_end|> train.
    assert labels == (*[M] * 11, 7, 9, 3, *[M] * 8, 13, 14, 3)
    assert ds.stats.num_chat_fallbacks == 0
    assert ds.samples[0].num_target_tokens == 6


def test_alpaca_with_jinja_template(tmp_path: Path, hf_tokenizer: TokenizerLike) -> None:
    ds = load_rows(tmp_path, [{"instruction": "hi", "output": "hello there"}], hf_tokenizer)
    assert one_sample(ds) == ((2, 5, 8, 3, 2, 6, 7, 9, 3), (M, M, M, M, M, M, 7, 9, 3))


# ---------------------------------------------------------------------------------------------
# Truncation
# ---------------------------------------------------------------------------------------------


def test_truncation_counts_kept_and_dropped(tmp_path: Path) -> None:
    rows = [
        {"input_ids": [5, 6, 7, 8, 9, 10]},  # truncated, kept
        {"input_ids": [5, 6, 7, 8], "labels": [M, M, M, M]},  # no targets at all
        {"input_ids": [5, 6, 7, 8, 9, 10], "labels": [M, M, M, M, 9, 10]},  # dropped by the cut
        {"input_ids": [5, 6, 7]},  # fits exactly
        {"instruction": "hello", "output": "yo"},  # prompt alone exceeds the limit
    ]
    ds = load_rows(tmp_path, rows, max_seq_len=3)
    assert [s.input_ids for s in ds.samples] == [(5, 6, 7), (5, 6, 7)]
    assert [s.labels for s in ds.samples] == [(5, 6, 7), (5, 6, 7)]
    assert ds.num_truncated == ds.stats.num_truncated == 1
    assert ds.stats.num_dropped_after_truncation == 2
    assert [(s.line, s.reason) for s in ds.skipped] == [
        (2, "no target tokens"),
        (3, "no target tokens left after truncation to 3 tokens"),
        (5, "no target tokens left after truncation to 3 tokens"),
    ]
    assert ds.stats.max_sample_tokens == 3


def test_truncation_keeps_partial_response(tmp_path: Path) -> None:
    ds = load_rows(tmp_path, [{"instruction": "hi", "output": "yo"}], max_seq_len=10)
    assert one_sample(ds) == expect(("<u>hi|<a>", False), ("y", True))
    assert ds.num_truncated == 1


def test_max_seq_len_must_allow_a_target(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        load_rows(tmp_path, [{"input_ids": [5, 6]}], max_seq_len=1)


# ---------------------------------------------------------------------------------------------
# Malformed rows
# ---------------------------------------------------------------------------------------------

GOOD = {"input_ids": [5, 6]}
MALFORMED: list[tuple[object, str]] = [
    ("{not json", "invalid JSON"),
    ("[" * 200_000, "invalid JSON: nested too deeply to parse"),  # (a RecursionError in json.loads)
    ('{"input_ids": [' + "1" * 5000 + "]}", "invalid JSON: Exceeds the limit (4300 digits)"),  # (a ValueError)
    ([1, 2], "row is not a JSON object (got list)"),
    ("null", "row is not a JSON object (got null)"),
    ({"foo": 1}, "unrecognized row"),
    ({"instruction": 5, "output": "x"}, "field 'instruction' must be a string (got int)"),
    ({"output": "x"}, "missing field 'instruction'"),
    ({"instruction": "x"}, "missing field 'output'"),
    ({"instruction": "x", "output": ""}, "empty 'output'"),
    ({"instruction": "x", "output": "  \n"}, "empty 'output'"),
    ({"instruction": " ", "output": "y"}, "empty 'instruction'"),
    ({"instruction": "x", "input": 3, "output": "y"}, "field 'input' must be a string"),
    ({"messages": "hi"}, "field 'messages' must be a list (got str)"),
    ({"messages": []}, "empty 'messages'"),
    ({"messages": ["x"]}, "messages[0] is not an object (got str)"),
    ({"messages": [{"role": "function", "content": "x"}, ASSISTANT]}, "messages[0] has invalid role"),
    ({"messages": [{"content": "x"}, ASSISTANT]}, "messages[0] has invalid role None"),
    ({"messages": [{"role": "user", "content": 1}, ASSISTANT]}, "messages[0].content must be"),
    ({"messages": [{"role": "user", "content": "q"}]}, "no assistant message"),
    ({"messages": [{"role": "user", "content": "q"}, {**ASSISTANT, "weight": 2}]}, "messages[1].weight must be 0 or 1"),
    ({"messages": [{"role": "user", "content": "q", "weight": 1}, ASSISTANT]}, "on a user message"),
    ({"messages": [{"role": "user", "content": "q"}, {**ASSISTANT, "weight": 0}]}, "every assistant message has weight 0"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, ASSISTANT]},
     "messages[0].content[0] is not a text part (got 'image_url')"),
    ({"messages": [ASSISTANT, {"role": "user", "content": "q"}]}, "no assistant message after"),
    (
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
        "messages[1] (assistant) has empty content",
    ),
    ({"input_ids": "abc"}, "field 'input_ids' must be a list of integers"),
    ({"input_ids": [5, True]}, "field 'input_ids' must be a list of integers"),
    ({"input_ids": [5.0, 6]}, "field 'input_ids' must be a list of integers"),
    ({"input_ids": []}, "empty 'input_ids'"),
    ({"input_ids": [5, 128]}, "input_ids[1]=128 out of range [0, 128)"),
    ({"input_ids": [-1, 5]}, "input_ids[0]=-1 out of range [0, 128)"),
    ({"input_ids": [5, 2**70]}, f"input_ids[1]={2**70} out of range [0, 128)"),  # (past int64)
    ({"input_ids": [5, 6], "labels": [True, 6]}, "field 'labels' must be a list of integers"),
    ({"input_ids": [5, 6], "labels": [5]}, "labels length 1 != input_ids length 2"),
    ({"input_ids": [5, 6], "labels": "x"}, "field 'labels' must be a list of integers"),
    ({"input_ids": [5, 6], "labels": [5, 300]}, "labels[1]=300 out of range"),
    ({"input_ids": [5, 6], "labels": [5, -5]}, "labels[1]=-5 out of range"),
    ({"input_ids": [5, 6], "labels": [5, M]}, "no target tokens"),
    ({"input_ids": [5]}, "no target tokens"),
]


def test_the_fast_token_check_agrees_with_the_per_item_one() -> None:
    """``_tokens_in_range`` says yes only where the per-item checks would pass; an int subclass
    other than bool is left to them (they accept it, as before the fast check)."""
    import enum
    import random

    from coserve.core.finetune import IGNORE_INDEX, _tokens_in_range, is_int

    class Tok(enum.IntEnum):
        FIVE = 5

    def per_item(values: list, also: int | None) -> bool:
        return all(is_int(t) and (0 <= t < 128 or t == also) for t in values)

    rng = random.Random(0)
    pool = [0, 5, 127, 128, -1, IGNORE_INDEX, True, 2.0, 2**70, -(2**70), None]
    for _ in range(2000):
        values = [rng.choice(pool) for _ in range(rng.randint(0, 4))]
        for also in (None, IGNORE_INDEX):
            if _tokens_in_range(values, 128, also):
                assert per_item(values, also), values
            elif values and per_item(values, also):
                raise AssertionError(f"{values} passes the per-item checks but not the fast one")
    assert not _tokens_in_range([Tok.FIVE], 128) and per_item([Tok.FIVE], None)


def test_malformed_rows_are_skipped_with_line_numbers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A blank line after the first row checks that line numbers are physical lines.
    rows: list[object] = [GOOD, ""] + [r for r, _ in MALFORMED] + [GOOD]
    with caplog.at_level(logging.WARNING, logger="coserve.core.finetune"):
        ds = load_rows(tmp_path, rows)
    assert [s.input_ids for s in ds.samples] == [(5, 6), (5, 6)]
    assert [s.line for s in ds.skipped] == list(range(3, 3 + len(MALFORMED)))
    for skipped, (_, reason) in zip(ds.skipped, MALFORMED, strict=True):
        assert reason in skipped.reason, (skipped, reason)
    assert ds.stats.num_rows == len(MALFORMED) + 2
    assert ds.stats.num_skipped == len(MALFORMED)
    assert f"skipped {len(MALFORMED)} of {len(MALFORMED) + 2} rows" in caplog.text
    assert "line 3: invalid JSON" in caplog.text


TOKENIZER_ROW_CASES: list[tuple[str, TokenizerLike, dict[str, Any], str]] = [
    ("no-template", CharTokenizer(chat_template=None), {"messages": CHAT}, "needs a chat template"),
    (
        "template-raises",
        NoSystemTokenizer(),
        {"messages": CHAT},
        "chat template failed: ValueError: System role not supported",
    ),
    ("inconsistent-template", CountingTokenizer(), {"messages": CHAT}, "inconsistently"),
]


@pytest.mark.parametrize(
    ("tok", "row", "reason"),
    [case[1:] for case in TOKENIZER_ROW_CASES],
    ids=[case[0] for case in TOKENIZER_ROW_CASES],
)
def test_tokenizer_dependent_row_errors(
    tmp_path: Path, tok: TokenizerLike, row: dict[str, Any], reason: str
) -> None:
    ds = load_rows(tmp_path, [GOOD, row], tok)
    assert len(ds.samples) == 1
    assert len(ds.skipped) == 1 and ds.skipped[0].line == 2
    assert reason in ds.skipped[0].reason


def test_invalid_utf8_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"input_ids": [5, 6]}\n{"instruction": "\xff", "output": "y"}\n')
    ds = load_dataset(path, CharTokenizer(), max_seq_len=16)
    assert len(ds.samples) == 1
    assert ds.skipped[0].line == 2 and "not valid UTF-8" in ds.skipped[0].reason


# ---------------------------------------------------------------------------------------------
# File formats and file-level errors
# ---------------------------------------------------------------------------------------------

MIXED_ROWS: list[object] = [
    {"instruction": "hi", "output": "yo"},
    {"foo": 1},
    {"messages": CHAT},
    {"input_ids": [5, 6, 7], "labels": [M, 6, 7]},
    [1],
]


def test_json_array_and_jsonl_agree(tmp_path: Path) -> None:
    tok = CharTokenizer()
    jsonl = load_dataset(write_jsonl(tmp_path / "d.jsonl", MIXED_ROWS), tok, max_seq_len=64)
    array_path = tmp_path / "d.json"
    array_path.write_text(json.dumps(MIXED_ROWS, indent=2))
    arr = load_dataset(array_path, tok, max_seq_len=64)
    assert arr.samples == jsonl.samples
    assert len(arr.samples) == 3
    # JSONL reports physical lines; the array reports 1-based indices (the same here).
    assert [s.line for s in arr.skipped] == [s.line for s in jsonl.skipped] == [2, 5]
    assert arr.path == array_path


def test_json_array_index_is_not_a_line_number(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text('[\n  {"input_ids": [5, 6]},\n\n\n  {"input_ids": []}\n]')
    ds = load_dataset(path, CharTokenizer(), max_seq_len=8)
    assert ds.skipped == (SkippedRow(2, "empty 'input_ids'"),)


def test_utf8_bom_is_accepted(tmp_path: Path) -> None:
    for name in ("d.json", "d.jsonl"):
        path = tmp_path / name
        text = json.dumps([GOOD]) if name.endswith(".json") else json.dumps(GOOD)
        path.write_bytes(b"\xef\xbb\xbf" + text.encode())
        assert len(load_dataset(path, CharTokenizer(), max_seq_len=8).samples) == 1


def _many_bad_rows() -> list[object]:
    return [{"input_ids": []}] * 7


FILE_ERROR_CASES: list[tuple[str, str, bytes | None, str]] = [
    ("missing", "absent.jsonl", None, "cannot read dataset: no such file"),
    ("missing-without-extension", "tiny_fact", None, "cannot read dataset: no such file"),
    ("bad-extension", "d.csv", b"a,b\n", "unsupported dataset extension '.csv'"),
    ("invalid-json", "d.json", b'[{"input_ids": [5, 6]},', "not valid JSON"),
    ("too-deep", "d.json", b"[" * 200_000, "not valid JSON: nested too deeply to parse"),
    ("too-many-digits", "d.json", b'[{"input_ids": [' + b"1" * 5000 + b"]}]", "not valid JSON: Exceeds the limit"),
    ("not-an-array", "d.json", b'{"input_ids": [5, 6]}', "expected a JSON array of objects"),
    ("empty-jsonl", "d.jsonl", b"", "no usable rows (0 rows read)"),
    ("blank-jsonl", "d.jsonl", b"\n  \n", "no usable rows (0 rows read)"),
    ("empty-array", "d.json", b"[]", "no usable rows (0 rows read)"),
    (
        "only-bad-rows",
        "d.jsonl",
        "".join(rows_lines(_many_bad_rows())).encode(),
        "no usable rows (7 rows read); line 1: empty 'input_ids'; line 2: empty 'input_ids'",
    ),
]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [case[1:] for case in FILE_ERROR_CASES],
    ids=[case[0] for case in FILE_ERROR_CASES],
)
def test_file_level_errors(tmp_path: Path, name: str, content: bytes | None, message: str) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DatasetError) as info:
        load_dataset(path, CharTokenizer(), max_seq_len=8)
    assert str(path) in str(info.value)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_unusable_file_error_lists_first_reasons_only(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", _many_bad_rows())
    with pytest.raises(DatasetError, match=r"line 5: .*; \.\.\. and 2 more$") as info:
        load_dataset(path, CharTokenizer(), max_seq_len=8)
    assert "line 6" not in str(info.value)


@pytest.mark.parametrize("name", ["dir.jsonl", "data"])
def test_directory_is_unreadable(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.mkdir()
    with pytest.raises(DatasetError, match="cannot read dataset: it is a directory"):
        load_dataset(path, CharTokenizer(), max_seq_len=8)


# ---------------------------------------------------------------------------------------------
# SamplePool
# ---------------------------------------------------------------------------------------------


def make_samples(n: int, seed: int = 0) -> list[FTSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(2, 12)
        ids = tuple(range(length))
        out.append(FTSample(i, ids, ids))
    return out


def ids_of(samples: Sequence[FTSample]) -> list[int]:
    return [s.sample_id for s in samples]


def drain_in_order(pool: SamplePool) -> list[int]:
    """Claims and retires the first candidate until done: the pool's stream order."""
    order = []
    while not pool.done:
        first = pool.candidates()[0].sample_id
        pool.claim([first])
        pool.retire([first])
        order.append(first)
    return order


def reference_order(n: int, seed: int, epoch: int) -> list[int]:
    gen = torch.Generator().manual_seed(_epoch_seed(seed, epoch))
    return cast(list[int], torch.randperm(n, generator=gen).tolist())


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_pool_order_per_seed_and_epoch(seed: int) -> None:
    n, epochs = 10, 3
    order = drain_in_order(SamplePool(make_samples(n), epochs=epochs, seed=seed, window=1))
    assert order == [i for e in range(epochs) for i in reference_order(n, seed, e)]
    epoch_orders = [order[e * n : (e + 1) * n] for e in range(epochs)]
    assert all(sorted(o) == list(range(n)) for o in epoch_orders)
    assert epoch_orders[0] != epoch_orders[1]  # a fresh permutation per epoch


def test_pool_order_is_deterministic_and_seed_dependent() -> None:
    def first_epoch(seed: int) -> list[int]:
        return ids_of(SamplePool(make_samples(20), seed=seed, window=20).candidates())

    assert first_epoch(3) == first_epoch(3)
    assert first_epoch(3) != first_epoch(4)


def test_pool_without_shuffle_is_file_order() -> None:
    pool = SamplePool(make_samples(5), epochs=2, shuffle=False, window=1)
    assert drain_in_order(pool) == [0, 1, 2, 3, 4] * 2


def test_candidates_window_and_purity() -> None:
    pool = SamplePool(make_samples(10), shuffle=False, window=4)
    assert ids_of(pool.candidates()) == [0, 1, 2, 3]
    assert ids_of(pool.candidates()) == [0, 1, 2, 3]  # looking does not consume
    pool.claim([1, 3])
    assert ids_of(pool.candidates()) == [0, 2, 4, 5]
    assert pool.num_in_flight == 2
    assert pool.in_flight_ids == (1, 3)


def test_release_puts_samples_first_again() -> None:
    pool = SamplePool(make_samples(10), shuffle=False, window=4)
    pool.claim([0, 1])
    pool.claim([2, 3])
    assert ids_of(pool.candidates()) == [4, 5, 6, 7]
    pool.release([3, 1])
    assert ids_of(pool.candidates()) == [1, 3, 4, 5]
    pool.claim([5])
    pool.release([5])
    assert ids_of(pool.candidates()) == [1, 3, 4, 5]


def test_claim_release_retire_errors_are_atomic() -> None:
    pool = SamplePool(make_samples(10), shuffle=False, window=3)
    with pytest.raises(ValueError, match="not a candidate"):
        pool.claim([0, 5])
    with pytest.raises(ValueError, match="unknown sample_id 99"):
        pool.claim([99])
    with pytest.raises(ValueError, match="repeated"):
        pool.claim([0, 0])
    assert pool.num_in_flight == 0
    pool.claim([0, 1])
    with pytest.raises(ValueError, match="not a candidate"):
        pool.claim([0])  # already in flight
    with pytest.raises(ValueError, match="sample_id 2 is not in flight"):
        pool.retire([0, 2])
    with pytest.raises(ValueError, match="not in flight"):
        pool.release([2])
    assert pool.in_flight_ids == (0, 1)
    assert pool.progress.samples_retired == 0


def test_window_stops_at_the_end_of_the_oldest_unfinished_epoch() -> None:
    pool = SamplePool(make_samples(3), epochs=3, shuffle=False, window=5)
    assert ids_of(pool.candidates()) == [0, 1, 2]  # each sample at most once
    pool.claim([0])
    assert ids_of(pool.candidates()) == [1, 2]
    pool.retire([0])
    assert ids_of(pool.candidates()) == [1, 2]  # epoch 1 waits until epoch 0 is finished
    pool.claim([1, 2])
    assert pool.candidates() == []
    pool.retire([1])
    assert pool.candidates() == []  # 2 (epoch 0) still in flight
    pool.retire([2])
    assert pool.epoch == 1
    assert ids_of(pool.candidates()) == [0, 1, 2]


def test_shortest_first_admission_does_not_starve_long_samples() -> None:
    samples = [FTSample(i, tuple(range(2 + 10 * i)), tuple(range(2 + 10 * i))) for i in range(6)]
    pool = SamplePool(samples, epochs=4, shuffle=True, seed=3, window=64)
    trained: list[int] = []
    while not pool.done:
        pick = min(pool.candidates(), key=lambda s: s.num_tokens)  # always the shortest
        pool.claim([pick.sample_id])
        pool.retire([pick.sample_id])
        trained.append(pick.sample_id)
    assert sorted(trained) == sorted(list(range(6)) * 4)
    for e in range(4):
        assert sorted(trained[6 * e : 6 * e + 6]) == list(range(6)), "each epoch trains every sample once"


def test_done_after_all_epochs_and_progress() -> None:
    samples = make_samples(4)
    pool = SamplePool(samples, epochs=2, seed=7, window=8)
    assert pool.progress == (0, 8, 0, 0)
    assert pool.epoch == 0 and not pool.done
    for _ in range(2):
        cands = ids_of(pool.candidates())
        assert sorted(cands) == [0, 1, 2, 3]
        pool.claim(cands)
        assert pool.candidates() == []
        pool.retire(cands)
    assert pool.done and pool.epoch == 2
    assert pool.candidates() == []
    tokens = sum(s.num_tokens for s in samples) * 2
    targets = sum(s.num_target_tokens for s in samples) * 2
    assert pool.progress == (8, 8, tokens, targets)


def test_empty_pool_is_done() -> None:
    pool = SamplePool([], epochs=2)
    assert pool.done and pool.candidates() == [] and pool.progress.samples_total == 0
    SamplePool([]).load_state_dict(json.loads(json.dumps(pool.state_dict())))


def test_pool_argument_validation() -> None:
    with pytest.raises(ValueError, match="epochs"):
        SamplePool(make_samples(2), epochs=0)
    with pytest.raises(ValueError, match="window"):
        SamplePool(make_samples(2), window=0)
    with pytest.raises(ValueError, match="duplicate sample_id"):
        SamplePool([*make_samples(2), make_samples(1)[0]])


def random_step(pool: SamplePool, rng: random.Random, retired: Counter[int]) -> tuple[int, ...]:
    """One engine-like step: look, claim some shortest-first, finish/abort some in flight."""
    cands = pool.candidates()
    ids = [s.sample_id for s in cands]
    assert len(ids) == len(set(ids)) <= pool.window
    assert not set(ids) & set(pool.in_flight_ids)
    k = rng.randint(0, min(3, len(cands)))
    pool.claim([s.sample_id for s in sorted(cands, key=lambda s: s.num_tokens)[:k]])
    for sid in pool.in_flight_ids:
        r = rng.random()
        if r < 0.5:
            pool.retire([sid])
            retired[sid] += 1
        elif r < 0.7:
            pool.release([sid])
    return tuple(ids)


def run_until_done(pool: SamplePool, rng: random.Random, retired: Counter[int]) -> list[Any]:
    trace: list[Any] = []
    for _ in range(10_000):
        if pool.done:
            return trace
        trace.append((random_step(pool, rng, retired), pool.progress, pool.epoch))
    raise AssertionError("pool did not finish")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("window", [1, 4, 16])
def test_random_schedule_retires_every_occurrence_once(seed: int, window: int) -> None:
    n, epochs = 7, 3
    pool = SamplePool(make_samples(n, seed), epochs=epochs, seed=seed, window=window)
    retired: Counter[int] = Counter()
    run_until_done(pool, random.Random(seed), retired)
    assert retired == {i: epochs for i in range(n)}
    assert pool.num_in_flight == 0 and pool.candidates() == []


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("save_after", [0, 5, 17])
def test_state_dict_round_trip_resumes_identical_stream(seed: int, save_after: int) -> None:
    n, epochs, window = 9, 3, 4
    samples = make_samples(n, seed)
    pool = SamplePool(samples, epochs=epochs, seed=seed, window=window)
    rng = random.Random(seed)
    retired: Counter[int] = Counter()
    for _ in range(save_after):
        random_step(pool, rng, retired)
    state = json.loads(json.dumps(pool.state_dict()))  # must survive JSON
    assert state["samples_retired"] == sum(retired.values())

    # In-flight samples at save time come back as candidates in the resumed pool.
    pool.release(pool.in_flight_ids)
    resumed = SamplePool(samples, epochs=epochs, seed=seed, window=window)
    resumed.load_state_dict(state)
    assert resumed.progress == pool.progress
    assert resumed.epoch == pool.epoch

    retired_a, retired_b = Counter(retired), Counter(retired)
    trace_a = run_until_done(pool, random.Random(1000 + seed), retired_a)
    trace_b = run_until_done(resumed, random.Random(1000 + seed), retired_b)
    assert trace_a == trace_b
    assert retired_b == {i: epochs for i in range(n)}


def test_state_dict_with_work_in_flight_counts_it_unretired() -> None:
    pool = SamplePool(make_samples(6), epochs=2, shuffle=False, window=3)
    pool.claim([0, 1, 2])
    pool.retire([1])
    state = pool.state_dict()
    resumed = SamplePool(make_samples(6), epochs=2, shuffle=False, window=3)
    resumed.load_state_dict(state)
    assert resumed.num_in_flight == 0
    assert resumed.progress.samples_retired == 1
    assert ids_of(resumed.candidates()) == [0, 2, 3]


def test_resume_may_extend_epochs_and_change_window() -> None:
    pool = SamplePool(make_samples(5), epochs=1, seed=3, window=2)
    drain_in_order(pool)
    resumed = SamplePool(make_samples(5), epochs=2, seed=3, window=5)
    resumed.load_state_dict(pool.state_dict())
    assert resumed.epoch == 1 and not resumed.done
    assert ids_of(resumed.candidates()) == reference_order(5, 3, 1)


def _tampered(state: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**state, **changes}


def test_load_state_dict_rejects_mismatches() -> None:
    samples = make_samples(6)
    pool = SamplePool(samples, epochs=2, seed=5, window=3)
    pool.claim(ids_of(pool.candidates())[:2])
    pool.retire(list(pool.in_flight_ids)[:1])
    state = pool.state_dict()

    mismatches: list[tuple[SamplePool, dict[str, Any], str]] = [
        (SamplePool(make_samples(7), epochs=2, seed=5), state, "num_samples"),
        (SamplePool(samples, epochs=2, seed=6), state, "seed"),
        (SamplePool(samples, epochs=2, seed=5, shuffle=False), state, "shuffle"),
        (SamplePool(samples, seed=5), _tampered(state, cursor=99), "cursor"),
        (SamplePool(samples, seed=5), _tampered(state, version=99), "version"),
        (SamplePool(samples, seed=5), _tampered(state, order_fingerprint=1), "order"),
        (SamplePool(samples, seed=5), _tampered(state, unretired=[0, 0]), "unretired"),
        (SamplePool(samples, seed=5), _tampered(state, samples_retired=5), "counters"),
        (SamplePool(samples, seed=5), {k: v for k, v in state.items() if k != "cursor"}, "cursor"),
    ]
    for target, bad, match in mismatches:
        before = target.progress
        with pytest.raises(ValueError, match=match):
            target.load_state_dict(bad)
        assert target.progress == before


def test_pool_calls_stay_cheap_on_a_large_dataset() -> None:
    samples = [FTSample(i, (1, 2), (1, 2)) for i in range(200_000)]
    pool = SamplePool(samples, epochs=2, seed=1, window=64)
    for _ in range(2_000):
        cands = pool.candidates()
        pool.claim([cands[-1].sample_id, cands[0].sample_id])
        pool.retire([cands[0].sample_id])
        pool.release([cands[-1].sample_id])
    assert pool.progress.samples_retired == 2_000


# ---------------------------------------------------------------------------------------------
# Function calling rows (OpenAI's fine-tuning format: tools, assistant tool_calls, tool answers)
# ---------------------------------------------------------------------------------------------

TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function'] | tojson }}</tool_call>"
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_ROW: dict[str, Any] = {
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny in Paris."},
    ],
}


def tiny_tokenizer(template: str) -> TokenizerLike:
    from coserve.models.presets import preset_path
    from coserve.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(preset_path("tiny"))
    tok.chat_template = template
    return cast(TokenizerLike, tok)


def test_function_calling_rows_train_on_the_calls_and_the_answer(tmp_path: Path) -> None:
    tok = tiny_tokenizer(TOOL_TEMPLATE)
    ids, labels = one_sample(load_rows(tmp_path, [TOOL_ROW], tok))
    text = tok.decode(list(ids))
    assert text.startswith('<|im_start|>system\nTools: [{"type": "function"')
    trained = tok.decode([t for t, label in zip(ids, labels, strict=True) if label != M])
    # the call (its arguments written as an object) and the final answer are targets; the tools,
    # the question and the tool's answer are context
    assert trained == ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>\n'
                       "It is sunny in Paris.<|im_end|>\n")


@pytest.mark.parametrize(("change", "reason"), [
    ({"messages": [TOOL_ROW["messages"][0], {"role": "assistant", "tool_calls": [{"function": {"name": "f",
                                                                                               "arguments": "{x"}}]}]},
     "messages[1].tool_calls[0].function.arguments is not JSON"),
    ({"messages": [TOOL_ROW["messages"][0], {"role": "assistant", "tool_calls": [{"function": {
        "name": "f", "arguments": "[" * 200_000}}]}]}, "function.arguments is not JSON: nested too deeply to parse"),
    ({"messages": [TOOL_ROW["messages"][0], {"role": "assistant", "tool_calls": [{"function": {}}]}]},
     "messages[1].tool_calls[0] has no function name"),
    ({"tools": "get_weather"}, "field 'tools' must be a list of objects"),
])
def test_malformed_function_calling_rows_are_skipped(tmp_path: Path, change: dict[str, Any], reason: str) -> None:
    ds = load_rows(tmp_path, [TOOL_ROW, {**TOOL_ROW, **change}], tiny_tokenizer(TOOL_TEMPLATE))
    assert len(ds.samples) == 1 and ds.skipped[0].line == 2 and reason in ds.skipped[0].reason, ds.skipped


def test_a_template_that_drops_calls_or_tools_refuses_the_row(tmp_path: Path) -> None:
    plain = tiny_tokenizer(CHATML)  # (writes only each message's content)
    no_calls = {**TOOL_ROW, "messages": [TOOL_ROW["messages"][0], TOOL_ROW["messages"][3]]}
    ds = load_rows(tmp_path, [TOOL_ROW, no_calls, {"messages": no_calls["messages"]}], plain)
    assert len(ds.samples) == 1, "the row without tools trains"
    assert "does not write the assistant's tool_calls" in ds.skipped[0].reason
    assert "does not write the row's tools" in ds.skipped[1].reason


def test_a_template_that_writes_the_tools_but_not_the_calls_refuses_calls(tmp_path: Path) -> None:
    tools_only = ("{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
                  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    ds = load_rows(tmp_path, [TOOL_ROW, {"messages": [{"role": "user", "content": "q"}, {"role": "assistant",
                                                                                       "content": "a"}]}],
                   tiny_tokenizer(tools_only))
    assert len(ds.samples) == 1 and "does not write the assistant's tool_calls" in ds.skipped[0].reason

"""Fine-tuning data: :func:`load_dataset` turns a ``.json`` / ``.jsonl`` file of Alpaca, chat or
pre-tokenized rows into immutable :class:`FTSample` objects (token ids plus Hugging Face style
labels). Malformed rows are skipped and reported, never fatal; only a file with no usable row is
an error. The order in which samples are trained is :class:`coserve.core.sample_pool.SamplePool`'s.

Label convention (same as ``transformers``): ``labels`` has the length of ``input_ids``, masked
positions hold :data:`IGNORE_INDEX` and the shift happens in the loss, i.e. position ``t``'s logits
are scored against ``labels[t + 1]``. ``labels[0]`` therefore never contributes a target.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NamedTuple, Protocol

import numpy as np

logger = logging.getLogger(__name__)

IGNORE_INDEX: Final = -100
"""Label value of positions that do not contribute to the loss."""

_MAX_REASONS_IN_MESSAGE: Final = 5
_CHAT_ROLES: Final = frozenset({"system", "user", "assistant", "tool"})


class TokenizerLike(Protocol):
    """What the loader needs from a tokenizer (``coserve.models.tokenizer.Tokenizer`` fits).

    Attributes are declared as read-only properties so that both plain attributes and
    properties satisfy the protocol. ``apply_chat_template`` is only ever called with
    ``tokenize=False`` and must then return the rendered text.
    """

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def chat_template(self) -> str | None: ...

    def encode(self, text: str, /, *, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        /,
        *,
        add_generation_prompt: bool = False,
        tokenize: bool = False,
    ) -> str | list[int]: ...


class DatasetError(ValueError):
    """The dataset file as a whole is unusable (missing, unreadable, bad format, no usable row)."""


class SkippedRow(NamedTuple):
    """A row that was not turned into a sample.

    ``line`` is the 1-based line number for ``.jsonl`` and the 1-based array index for ``.json``.
    """

    line: int
    reason: str


@dataclass(frozen=True)
class FTSample:
    """One training sequence.

    ``sample_id`` is the 0-based index among the dataset's usable samples (stable for a given
    file and loader settings). ``labels`` follows the ``transformers`` convention described in the
    module docstring and always has the length of ``input_ids``.
    """

    sample_id: int
    input_ids: tuple[int, ...]
    labels: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.labels) != len(self.input_ids):
            raise ValueError(
                f"sample {self.sample_id}: labels length {len(self.labels)} != "
                f"input_ids length {len(self.input_ids)}"
            )

    @property
    def num_tokens(self) -> int:
        """Sequence length (tokens fed to the model)."""
        return len(self.input_ids)

    @property
    def num_target_tokens(self) -> int:
        """Tokens the loss is computed on: unmasked labels after the shift (``labels[1:]``)."""
        return sum(1 for label in self.labels[1:] if label != IGNORE_INDEX)


@dataclass(frozen=True)
class DatasetStats:
    """Summary of one :func:`load_dataset` call.

    ``num_rows`` counts rows read (blank ``.jsonl`` lines excluded); every row ends up either as
    a sample or in ``skipped``. ``num_truncated`` counts *kept* samples that were cut to
    ``max_seq_len``; rows that had no target token left after the cut are skipped and counted in
    ``num_dropped_after_truncation`` instead. ``num_chat_fallbacks`` counts kept chat samples whose
    template did not render prefix-consistently, so only the last assistant message is trained on.
    """

    num_rows: int
    num_samples: int
    num_skipped: int
    num_truncated: int
    num_dropped_after_truncation: int
    num_chat_fallbacks: int
    num_alpaca: int
    num_chat: int
    num_pretokenized: int
    num_tokens: int
    num_target_tokens: int
    max_sample_tokens: int


@dataclass(frozen=True)
class FTDataset:
    """The result of :func:`load_dataset`: usable samples in file order plus what was dropped."""

    path: Path
    samples: tuple[FTSample, ...]
    skipped: tuple[SkippedRow, ...]
    stats: DatasetStats

    @property
    def num_truncated(self) -> int:
        """Kept samples that were truncated to ``max_seq_len``."""
        return self.stats.num_truncated

    def __len__(self) -> int:
        return len(self.samples)


# --------------------------------------------------------------------------------------------
# Dataset loading
# --------------------------------------------------------------------------------------------


class _RowError(Exception):
    """A per-row problem; the row is skipped with ``reason``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Encoded(NamedTuple):
    input_ids: list[int]
    labels: list[int]
    shape: str
    chat_fallback: bool


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def is_int(value: object) -> bool:
    # bool is an int subclass, but `true` in a token list is a data error.
    return isinstance(value, int) and not isinstance(value, bool)


def _tokens_in_range(values: list[Any], vocab_size: int, also: int | None = None) -> bool:
    """Whether every item of ``values`` is a plain ``int`` in ``[0, vocab_size)`` (or equal to
    ``also``), checked without a Python call per item (the types through ``map``, the range in
    numpy): a pre-tokenized row of a thousand tokens in microseconds instead of a millisecond.
    False says only that the per-item checks must run (they name the first bad item, and accept
    int subclasses other than bool, which this does not)."""
    if not set(map(type, values)) <= {int}:
        return False
    try:
        arr = np.fromiter(values, dtype=np.int64, count=len(values))
    except OverflowError:
        return False
    ok = (arr >= 0) & (arr < vocab_size)
    if also is not None:
        ok |= arr == also
    return bool(ok.all())


def _is_token_prefix(prefix: list[int], full: list[int]) -> bool:
    return len(prefix) <= len(full) and full[: len(prefix)] == prefix


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]] | None:
    """An assistant message's OpenAI ``tool_calls``, their arguments as objects (as chat templates
    write them); None where it has none."""
    if calls is None or calls == []:
        return None
    if not isinstance(calls, list):
        raise _RowError(f"messages[{i}].tool_calls must be a list (got {_type_name(calls)})")
    out = []
    for k, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _RowError(f"messages[{i}].tool_calls[{k}] has no function name")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError) as e:
                raise _RowError(f"messages[{i}].tool_calls[{k}].function.arguments is not JSON: "
                                f"{_json_error(e)}") from e
        out.append({**c, "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _text_content(content: Any, i: int) -> str:
    """A message's content: a string, or OpenAI's list of parts whose ``text`` parts are joined
    (a part of another type, an image say, cannot be trained on: the row is refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else _type_name(part)
                raise _RowError(f"messages[{i}].content[{k}] is not a text part (got {kind!r}): only text "
                                "is trained on")
            texts.append(part["text"])
        return "".join(texts)
    raise _RowError(f"messages[{i}].content must be a string or a list of text parts (got {_type_name(content)})")


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class _RowEncoder:
    """Turns one parsed JSON row into token ids and labels (or raises :class:`_RowError`)."""

    def __init__(self, tokenizer: TokenizerLike, *, train_on_prompt: bool, vocab_size: int | None = None
                 ) -> None:
        self._tok = tokenizer
        self._train_on_prompt = train_on_prompt
        self._vocab_size = int(tokenizer.vocab_size) if vocab_size is None else vocab_size
        self._has_template = bool(tokenizer.chat_template)

    def encode_row(self, row: object) -> _Encoded:
        if not isinstance(row, dict):
            raise _RowError(f"row is not a JSON object (got {_type_name(row)})")
        # Precedence matters for rows produced by `datasets.map`, which keep the text columns
        # next to the token columns; the token columns are then authoritative.
        if "input_ids" in row:
            return self._pretokenized(row)
        if "messages" in row:
            return self._chat(row)
        if "instruction" in row or "output" in row:
            return self._alpaca(row)
        raise _RowError(
            "unrecognized row: expected 'instruction'/'output' (Alpaca), 'messages' (chat) or "
            "'input_ids' (pre-tokenized)"
        )

    # -- shapes ------------------------------------------------------------------------------

    def _alpaca(self, row: dict[str, Any]) -> _Encoded:
        instruction = _required_str(row, "instruction")
        output = _required_str(row, "output")
        inp = row.get("input")
        if inp is None:
            inp = ""
        elif not isinstance(inp, str):
            raise _RowError(f"field 'input' must be a string (got {_type_name(inp)})")
        if not instruction.strip():
            raise _RowError("empty 'instruction'")
        if not output.strip():
            raise _RowError("empty 'output'")
        has_input = bool(inp.strip())

        if self._has_template:
            content = instruction + ("\n\n" + inp if has_input else "")
            text = self._render([{"role": "user", "content": content}], add_generation_prompt=True)
            prompt_ids = self._tok.encode(text, add_special_tokens=False)
        else:
            if has_input:
                text = f"### Instruction:\n{instruction}\n\n### Input:\n{inp}\n\n### Response:\n"
            else:
                text = f"### Instruction:\n{instruction}\n\n### Response:\n"
            # No template renders the BOS text, so let the tokenizer add its special tokens.
            prompt_ids = self._tok.encode(text, add_special_tokens=True)

        response_ids = self._tok.encode(output, add_special_tokens=False)
        eos = self._tok.eos_token_id
        if eos is not None:
            response_ids = [*response_ids, eos]
        prompt_labels = (
            list(prompt_ids) if self._train_on_prompt else [IGNORE_INDEX] * len(prompt_ids)
        )
        return _Encoded(
            input_ids=[*prompt_ids, *response_ids],
            labels=[*prompt_labels, *response_ids],
            shape="alpaca",
            chat_fallback=False,
        )

    def _chat(self, row: dict[str, Any]) -> _Encoded:
        raw = row["messages"]
        if not isinstance(raw, list):
            raise _RowError(f"field 'messages' must be a list (got {_type_name(raw)})")
        if not raw:
            raise _RowError("empty 'messages'")
        tools = row.get("tools")  # (OpenAI's function-calling rows: the tools the template writes)
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise _RowError(f"field 'tools' must be a list of objects (got {_type_name(tools)})")
        messages: list[dict[str, Any]] = []
        untrained: set[int] = set()  # assistant messages with OpenAI's "weight": 0 (context only)
        for i, m in enumerate(raw):
            if not isinstance(m, dict):
                raise _RowError(f"messages[{i}] is not an object (got {_type_name(m)})")
            role = m.get("role")
            if not isinstance(role, str) or role not in _CHAT_ROLES:
                raise _RowError(
                    f"messages[{i}] has invalid role {role!r} (expected system, user, assistant or tool)"
                )
            calls = _tool_calls(m.get("tool_calls"), i) if role == "assistant" else None
            content = "" if calls and m.get("content") is None else _text_content(m.get("content"), i)
            if role == "assistant" and not content.strip() and not calls:
                raise _RowError(f"messages[{i}] (assistant) has empty content")
            weight = m.get("weight", 1)
            if "weight" in m and (role != "assistant" or weight not in (0, 1) or isinstance(weight, bool)):
                raise _RowError(f"messages[{i}].weight must be 0 or 1 on an assistant message (got {weight!r} "
                                f"on a {role} message)")
            if weight == 0:
                untrained.add(i)
            message: dict[str, Any] = {"role": role, "content": content}
            if calls:
                message["tool_calls"] = calls
            if role == "tool" and isinstance(m.get("tool_call_id"), str):
                message["tool_call_id"] = m["tool_call_id"]
            messages.append(message)
        assistant_idx = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not assistant_idx:
            raise _RowError("no assistant message")
        assistant_idx = [i for i in assistant_idx if i not in untrained]
        if not assistant_idx:
            raise _RowError("every assistant message has weight 0: nothing to train on")
        # An opening assistant message has an empty prompt, which templates (and coserve's
        # Tokenizer) cannot render; it stays in the input as context.
        assistant_idx = [i for i in assistant_idx if i > 0]
        if not assistant_idx:
            raise _RowError("no assistant message after the first message")
        if not self._has_template:
            raise _RowError("chat row needs a chat template, but the tokenizer has none")
        # Turns after the last assistant message carry no target; they would only cost compute.
        last = assistant_idx[-1]
        messages = messages[: last + 1]

        full_text = self._render(messages, add_generation_prompt=False, tools=tools)
        # (a template that drops the calls or the tools would train the model to answer without them)
        if any("tool_calls" in m for m in messages) and self._drops_calls(messages, tools, full_text):
            raise _RowError("the chat template does not write the assistant's tool_calls: this model's template "
                            "cannot train on function calling")
        if tools and full_text == self._render(messages, add_generation_prompt=False):
            raise _RowError("the chat template does not write the row's tools: this model's template cannot "
                            "train on function calling")
        full = self._tok.encode(full_text, add_special_tokens=False)
        if self._train_on_prompt:
            return _Encoded(full, list(full), "chat", chat_fallback=False)

        spans = self._assistant_spans(messages, assistant_idx, full, tools)
        fallback = spans is None
        if spans is None:
            before_text = self._render(messages[:last], add_generation_prompt=True, tools=tools)
            if not full_text.startswith(before_text):
                raise _RowError(
                    "chat template renders the conversation inconsistently: the prompt before "
                    "the last assistant message is not a prefix of the full conversation"
                )
            # The texts agree, so the token mismatch comes from tokens merged across the
            # boundary; starting at the first differing token trains on that merged token too.
            start = _common_prefix_len(
                self._tok.encode(before_text, add_special_tokens=False), full
            )
            spans = [(start, len(full))]

        labels = [IGNORE_INDEX] * len(full)
        for start, end in spans:
            labels[start:end] = full[start:end]
        return _Encoded(full, labels, "chat", chat_fallback=fallback)

    def _drops_calls(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, full_text: str) -> bool:
        """Does the template render ``messages`` the same without their tool calls?"""
        try:
            bare = self._render([{k: v for k, v in m.items() if k != "tool_calls"} for m in messages],
                                add_generation_prompt=False, tools=tools)
        except _RowError:  # (a template that insists on them: it writes them)
            return False
        return bare == full_text

    def _assistant_spans(
        self, messages: list[dict[str, Any]], assistant_idx: list[int], full: list[int],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[tuple[int, int]] | None:
        """Token spans ``[start, end)`` of ``full`` added by each assistant message.

        None when some prefix rendering is not a token prefix of the next one / of ``full``.
        """
        spans: list[tuple[int, int]] = []
        for i in assistant_idx:
            before = self._encode_rendered(messages[:i], add_generation_prompt=True, tools=tools)
            after = (
                full
                if i == assistant_idx[-1]
                else self._encode_rendered(messages[: i + 1], add_generation_prompt=False, tools=tools)
            )
            if not (_is_token_prefix(before, after) and _is_token_prefix(after, full)):
                return None
            spans.append((len(before), len(after)))
        return spans

    def _pretokenized(self, row: dict[str, Any]) -> _Encoded:
        ids = row["input_ids"]
        self._check_tokens("input_ids", ids)
        if not ids:
            raise _RowError("empty 'input_ids'")
        labels = row.get("labels")
        if labels is None:
            return _Encoded(list(ids), list(ids), "pretokenized", chat_fallback=False)
        self._check_tokens("labels", labels, also=IGNORE_INDEX, length=len(ids))
        # Explicit labels are authoritative: train_on_prompt only steers masks the loader makes.
        return _Encoded(list(ids), list(labels), "pretokenized", chat_fallback=False)

    def _check_tokens(self, field: str, values: Any, *, also: int | None = None, length: int | None = None) -> None:
        """That ``values`` is a list of token ids (or ``also``), of ``length`` items where given:
        a :class:`_RowError` naming the first fault otherwise (the type, then the length, then the
        first id out of range). :func:`_tokens_in_range` first; the per-item checks only where it
        says no."""
        fast = isinstance(values, list) and _tokens_in_range(values, self._vocab_size, also)
        if not fast and (not isinstance(values, list) or not all(is_int(t) for t in values)):
            raise _RowError(f"field '{field}' must be a list of integers")
        if length is not None and len(values) != length:
            raise _RowError(f"{field} length {len(values)} != input_ids length {length}")
        if fast:
            return
        for i, t in enumerate(values):
            if t != also and not 0 <= t < self._vocab_size:
                alt = "" if also is None else f" and not {also}"
                raise _RowError(f"{field}[{i}]={t} out of range [0, {self._vocab_size}){alt}")

    # -- helpers -----------------------------------------------------------------------------

    def _render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None) -> str:
        # (tools only where the row has some: a template, or a tokenizer, may not take them)
        extra = {} if tools is None else {"tools": tools}
        try:
            text = self._tok.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
            )
        # Templates reject conversations they do not support (raise_exception): a row problem.
        except Exception as e:
            raise _RowError(f"chat template failed: {type(e).__name__}: {e}") from e
        if not isinstance(text, str):
            raise _RowError(
                f"apply_chat_template(tokenize=False) returned {_type_name(text)}, expected str"
            )
        return text

    def _encode_rendered(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        text = self._render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        return self._tok.encode(text, add_special_tokens=False)


def _required_str(row: dict[str, Any], key: str) -> str:
    if key not in row:
        raise _RowError(f"missing field '{key}'")
    value = row[key]
    if not isinstance(value, str):
        raise _RowError(f"field '{key}' must be a string (got {_type_name(value)})")
    return value


def _iter_jsonl(path: Path) -> Iterator[tuple[int, object]]:
    """Yields ``(line_number, parsed_row)``; unparsable lines yield a :class:`_RowError`."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                yield lineno, _RowError(f"line is not valid UTF-8: {e}")
                continue
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except (ValueError, RecursionError) as e:
                yield lineno, _RowError(f"invalid JSON: {_json_error(e)}")


def _json_error(e: ValueError | RecursionError) -> str:
    """Why ``json.loads`` refused a text: a syntax error, a number past CPython's digit limit
    (a ValueError that is no JSONDecodeError), or nesting deeper than its recursion limit."""
    if isinstance(e, RecursionError):
        return "nested too deeply to parse"
    return str(e)


def _read_json_array(path: Path) -> list[object]:
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not valid UTF-8: {e}") from e
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise DatasetError(f"{path}: not valid JSON: {_json_error(e)}") from e
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON array of objects, got {_type_name(data)}")
    return data


def iter_rows(path: str | os.PathLike[str]) -> Iterator[object]:
    """The rows of a ``.jsonl`` or ``.json`` dataset as :func:`load_dataset` parses them (a UTF-8
    BOM dropped, a pretty-printed array taken whole), less the lines that do not parse; raises
    :class:`DatasetError` for a file that cannot be read or is not a JSON array."""
    p = Path(path)
    try:
        if p.suffix.lower() == ".jsonl":
            yield from (row for _, row in _iter_jsonl(p) if not isinstance(row, _RowError))
        else:
            yield from _read_json_array(p)
    except OSError as e:
        raise DatasetError(f"{p}: cannot read dataset: {e}") from e


def _format_reasons(skipped: Sequence[SkippedRow]) -> str:
    shown = "; ".join(f"line {s.line}: {s.reason}" for s in skipped[:_MAX_REASONS_IN_MESSAGE])
    more = len(skipped) - _MAX_REASONS_IN_MESSAGE
    return shown + (f"; ... and {more} more" if more > 0 else "")


def load_dataset(
    path: str | os.PathLike[str],
    tokenizer: TokenizerLike,
    *,
    max_seq_len: int,
    train_on_prompt: bool = False,
    vocab_size: int | None = None,
) -> FTDataset:
    """Loads a fine-tuning dataset from a ``.json`` array or ``.jsonl`` file.

    ``vocab_size`` (default: the tokenizer's) bounds pre-tokenized ids: pass the smaller of the
    tokenizer's and the model's, so that no id the model cannot embed gets through.

    The row shape is detected per row, in this order of precedence:

    * pre-tokenized: ``input_ids`` (ints in ``[0, tokenizer.vocab_size)``), optional ``labels``
      (same length, ``-100`` or in range). Without ``labels`` every token is a target. Given
      labels are used as-is, also when ``train_on_prompt`` is set.
    * chat: ``messages`` (``role`` in system/user/assistant, string ``content``, at least one
      non-empty assistant message that is not the first message; an opening assistant message
      is context only). Rendered with the tokenizer's chat template; the loss covers
      the tokens each assistant message adds to the rendering (incremental rendering). If the
      template's prefix renderings are not token prefixes of the full rendering, only the last
      assistant message is trained on (counted in ``stats.num_chat_fallbacks``). Messages after
      the last assistant message are dropped.
    * Alpaca: ``instruction``, optional ``input``, ``output``. The prompt is the chat template
      applied to one user message (``instruction`` + ``"\\n\\n" + input``) with a generation
      prompt, or the classic ``### Instruction/Input/Response`` text when the tokenizer has no
      template. Response = ``encode(output)`` + ``eos_token_id``.

    Prompt tokens are masked (``-100``) unless ``train_on_prompt``. Samples longer than
    ``max_seq_len`` keep their first ``max_seq_len`` tokens. Rows that are malformed or have no
    target token (after the label shift and truncation) are skipped and listed in
    ``FTDataset.skipped``; a warning summarises them.

    Raises:
        ValueError: ``max_seq_len < 2`` (one token cannot have a target).
        DatasetError: the file is missing or unreadable, has an unsupported extension, is not a
            JSON array (``.json``), or yields no usable sample.
    """
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
    p = Path(path)
    suffix = p.suffix.lower()
    if not p.exists():  # (first: a mistyped name's fault is not its extension)
        raise DatasetError(f"{p}: cannot read dataset: no such file")
    if p.is_dir():
        raise DatasetError(f"{p}: cannot read dataset: it is a directory (give a .json or .jsonl file)")
    if suffix not in (".json", ".jsonl"):
        raise DatasetError(f"{p}: unsupported dataset extension {p.suffix!r} (use .json or .jsonl)")

    encoder = _RowEncoder(tokenizer, train_on_prompt=train_on_prompt, vocab_size=vocab_size)
    samples: list[FTSample] = []
    skipped: list[SkippedRow] = []
    shape_counts = {"alpaca": 0, "chat": 0, "pretokenized": 0}
    num_rows = num_truncated = num_dropped = num_fallbacks = 0

    def add_row(line: int, row: object) -> None:
        nonlocal num_rows, num_truncated, num_dropped, num_fallbacks
        num_rows += 1
        try:
            if isinstance(row, _RowError):
                raise row
            enc = encoder.encode_row(row)
            if not any(label != IGNORE_INDEX for label in enc.labels[1:]):
                raise _RowError("no target tokens")
            truncated = len(enc.input_ids) > max_seq_len
            ids, labels = enc.input_ids[:max_seq_len], enc.labels[:max_seq_len]
            if truncated and not any(label != IGNORE_INDEX for label in labels[1:]):
                num_dropped += 1
                raise _RowError(f"no target tokens left after truncation to {max_seq_len} tokens")
        except _RowError as e:
            skipped.append(SkippedRow(line, e.reason))
            return
        num_truncated += truncated
        num_fallbacks += enc.chat_fallback
        shape_counts[enc.shape] += 1
        samples.append(FTSample(len(samples), tuple(ids), tuple(labels)))

    try:
        if suffix == ".jsonl":
            for line, row in _iter_jsonl(p):
                add_row(line, row)
        else:
            for index, row in enumerate(_read_json_array(p), start=1):
                add_row(index, row)
    except OSError as e:
        raise DatasetError(f"{p}: cannot read dataset: {e}") from e

    if not samples:
        detail = f"; {_format_reasons(skipped)}" if skipped else ""
        raise DatasetError(f"{p}: no usable rows ({num_rows} rows read){detail}")
    if skipped:
        logger.warning(
            "%s: skipped %d of %d rows; %s", p, len(skipped), num_rows, _format_reasons(skipped)
        )
    if num_truncated:
        logger.info("%s: truncated %d samples to %d tokens", p, num_truncated, max_seq_len)

    stats = DatasetStats(
        num_rows=num_rows,
        num_samples=len(samples),
        num_skipped=len(skipped),
        num_truncated=num_truncated,
        num_dropped_after_truncation=num_dropped,
        num_chat_fallbacks=num_fallbacks,
        num_alpaca=shape_counts["alpaca"],
        num_chat=shape_counts["chat"],
        num_pretokenized=shape_counts["pretokenized"],
        num_tokens=sum(s.num_tokens for s in samples),
        num_target_tokens=sum(s.num_target_tokens for s in samples),
        max_sample_tokens=max(s.num_tokens for s in samples),
    )
    logger.info(
        "%s: loaded %d samples (%d tokens, %d target tokens)",
        p,
        stats.num_samples,
        stats.num_tokens,
        stats.num_target_tokens,
    )
    return FTDataset(path=p, samples=tuple(samples), skipped=tuple(skipped), stats=stats)


# --------------------------------------------------------------------------------------------
# Sample pool
# --------------------------------------------------------------------------------------------

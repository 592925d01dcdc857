"""Tokenizer of a model directory: the ``tokenizers`` library, chat templates, streaming decoding.

:class:`Tokenizer` reads a Hugging Face tokenizer directory and gives the same ``encode``,
``decode`` and ``apply_chat_template`` results as ``transformers.AutoTokenizer`` does for it,
without importing transformers: ``tokenizer.json`` is run by the ``tokenizers`` library, and the
special-token handling of ``tokenizer_config.json`` (and the legacy ``special_tokens_map.json``)
follows transformers 5. Directories without ``tokenizer.json`` (a SentencePiece ``tokenizer.model``
only, say) are loaded through transformers when it is installed, behind the same interface.

:class:`IncrementalDetokenizer` turns the ids a request generates, one at a time, into text deltas
for streaming.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, overload

import jinja2
from tokenizers import AddedToken
from tokenizers import Tokenizer as _RustTokenizer

from coserve.models.chat_template import compile_chat_template, plain

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# Only named in error messages: what transformers can build a tokenizer from without tokenizer.json.
_SLOW_TOKENIZER_FILES = ("tokenizer.model", "vocab.json + merges.txt", "vocab.txt")

# transformers' named special tokens, in its order (the order of the chat template variables).
_NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
# Names the template renderer sets itself; a caller's template kwargs may not override them.
_RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})

# Prompt tokens decoded before the first generated one, so that its text is what it is in context
# (vLLM uses the same number).
_DETOKENIZER_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"
# transformers saves int(1e30) as model_max_length when there is no limit.
_UNLIMITED_LENGTH = 1 << 62


class _Backend(Protocol):
    """What :class:`Tokenizer` needs from the library that actually runs the tokenizer."""

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...

    def id_to_token(self, token_id: int) -> str | None: ...

    def vocab_size(self) -> int: ...

    def special_added_ids(self) -> set[int]: ...


class _TokenizersBackend:
    """A ``tokenizers.Tokenizer`` set up the way transformers' ``TokenizersBackend`` sets it up."""

    def __init__(self, tok: _RustTokenizer, clean_up_tokenization_spaces: bool) -> None:
        self._tok = tok
        # transformers skips this cleanup for BPE models: it would delete real spaces.
        self._clean_up = clean_up_tokenization_spaces and type(tok.model).__name__ != "BPE"

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        text: str = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up else text

    def token_to_id(self, token: str) -> int | None:
        result: int | None = self._tok.token_to_id(token)
        return result

    def id_to_token(self, token_id: int) -> str | None:
        result: str | None = self._tok.id_to_token(token_id)
        return result

    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def special_added_ids(self) -> set[int]:
        return {int(i) for i, t in self._tok.get_added_tokens_decoder().items() if t.special}


class _TransformersBackend:
    """A transformers tokenizer (the fallback for directories without ``tokenizer.json``)."""

    def __init__(self, hf: Any) -> None:
        self._hf = hf
        self._vocab: dict[str, int] = dict(hf.get_vocab())

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return str(self._hf.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        return self._vocab.get(token)

    def id_to_token(self, token_id: int) -> str | None:
        if not 0 <= token_id < len(self._hf):
            return None
        token = self._hf.convert_ids_to_tokens(token_id)
        return None if token is None else str(token)

    def vocab_size(self) -> int:
        return len(self._hf)

    def special_added_ids(self) -> set[int]:
        added = {int(i) for i, t in self._hf.added_tokens_decoder.items() if t.special}
        return added | {int(i) for i in self._hf.all_special_ids}


class Tokenizer:
    """A model's tokenizer: text <-> ids, chat templates and the ids that matter to generation.

    Build it with :meth:`from_dir`. Attributes:

    - ``vocab_size``: number of ids the tokenizer can produce, added tokens included (the model's
      embedding table may be larger).
    - ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``: the tokenizer's named special tokens;
      where the tokenizer names none, ``generation_config.json``'s value (for eos: its first one).
    - ``eos_token_ids``: every id that ends generation: ``eos_token_id`` plus all of
      ``generation_config.json``'s ``eos_token_id`` (an int or a list).
    - ``all_special_ids``: the named special tokens (bos, eos, unk, sep, pad, cls, mask and model
      specific ones), the extra special tokens, and every added token flagged special, i.e. every
      id that ``decode(..., skip_special_tokens=True)`` drops. (transformers' ``all_special_ids``
      has only the named and extra ones.)
    - ``chat_template``: the default chat template, or None.
    - ``model_max_length``: ``tokenizer_config.json``'s ``model_max_length``; None where it is
      missing or transformers' "no limit" value.
    - ``path``: the directory it was read from.

    Its methods never change it, so one instance can serve many threads.
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        path: Path,
        special_tokens: Mapping[str, str],
        extra_special_tokens: Sequence[str],
        chat_templates: Mapping[str, str],
        generation_config: Mapping[str, Any],
        model_max_length: int | None,
    ) -> None:
        """Use :meth:`from_dir`; this takes an already set-up backend and the parsed settings."""
        self._backend = backend
        self.path = path
        # Named special tokens as template variables, in transformers' order.
        self._special_tokens_map: dict[str, str] = dict(special_tokens)
        self._chat_templates: dict[str, str] = dict(chat_templates)
        self.chat_template: str | None = self._chat_templates.get("default")
        self.model_max_length = model_max_length
        self.vocab_size: int = backend.vocab_size()

        gen_file = path / GENERATION_CONFIG_FILE
        gen_bos = _optional_id(generation_config.get("bos_token_id"), "bos_token_id", gen_file)
        gen_pad = _optional_id(generation_config.get("pad_token_id"), "pad_token_id", gen_file)
        gen_eos = _id_list(generation_config.get("eos_token_id"), "eos_token_id", gen_file)

        bos = self._named_id("bos_token")
        eos = self._named_id("eos_token")
        pad = self._named_id("pad_token")
        self.bos_token_id: int | None = bos if bos is not None else gen_bos
        self.eos_token_id: int | None = (
            eos if eos is not None else (gen_eos[0] if gen_eos else None)
        )
        self.pad_token_id: int | None = pad if pad is not None else gen_pad
        eos_ids = set(gen_eos)
        if self.eos_token_id is not None:
            eos_ids.add(self.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)

        special = backend.special_added_ids()
        for token in [*self._special_tokens_map.values(), *extra_special_tokens]:
            token_id = backend.token_to_id(token)
            if token_id is not None:
                special.add(token_id)
        self.all_special_ids: frozenset[int] = frozenset(special)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size}, "
            f"bos={self.bos_token_id}, eos={sorted(self.eos_token_ids)}, pad={self.pad_token_id})"
        )

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of a Hugging Face model directory.

        Reads ``tokenizer.json`` (run by the ``tokenizers`` library), ``tokenizer_config.json``
        (special tokens, added tokens, chat template, ``split_special_tokens``,
        ``clean_up_tokenization_spaces``, ``model_max_length``), ``special_tokens_map.json`` where
        transformers would, ``chat_template.jinja`` and ``additional_chat_templates/*.jinja``
        (these take priority over the config's template), and ``generation_config.json``.

        As in transformers 5, the post-processor of ``tokenizer.json`` decides which special tokens
        ``encode(..., add_special_tokens=True)`` adds; ``add_bos_token``/``add_eos_token`` in the
        config only matter for the transformers fallback. Without ``tokenizer.json`` the directory
        is loaded with ``transformers.AutoTokenizer`` (local files only) if transformers is
        installed. Raises ValueError naming the directory and what is missing when nothing usable
        is there, or naming the file that cannot be parsed.

        Parity is with transformers' generic ``TokenizersBackend``; a model-specific
        ``tokenizer_class`` that rebuilds the pipeline from the vocabulary could differ from it.
        """
        directory = Path(path).expanduser()
        if not directory.is_dir():
            raise ValueError(
                f"tokenizer directory {str(directory)!r} does not exist or is not a directory"
            )
        config = _read_json(directory / TOKENIZER_CONFIG_FILE)
        generation_config = _read_json(directory / GENERATION_CONFIG_FILE)
        tokenizer_file = directory / TOKENIZER_FILE
        if tokenizer_file.is_file():
            return cls._from_tokenizer_json(directory, tokenizer_file, config, generation_config)
        return cls._from_transformers(directory, generation_config)

    @classmethod
    def _from_tokenizer_json(
        cls,
        directory: Path,
        tokenizer_file: Path,
        config: dict[str, Any],
        generation_config: dict[str, Any],
    ) -> Tokenizer:
        try:
            rust = _RustTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust side raises a bare Exception for malformed files
            raise ValueError(f"cannot parse {tokenizer_file}: {e}") from e
        # Padding or truncation saved in tokenizer.json would silently change encode(); transformers
        # turns both off unless a call asks for them.
        rust.no_padding()
        rust.no_truncation()
        rust.encode_special_tokens = bool(config.get("split_special_tokens", False))

        settings = dict(config)
        if "added_tokens_decoder" not in settings:
            # Legacy directories: transformers lets special_tokens_map.json override the config.
            settings.update(_read_json(directory / SPECIAL_TOKENS_MAP_FILE))
        if "additional_special_tokens" in settings and not settings.get("extra_special_tokens"):
            settings["extra_special_tokens"] = settings.pop("additional_special_tokens")

        added_decoder: dict[int, AddedToken] = {}
        for index, entry in (settings.get("added_tokens_decoder") or {}).items():
            added_decoder[int(index)] = _added_token(entry, directory / TOKENIZER_CONFIG_FILE)
        by_content = {t.content: t for t in added_decoder.values()}

        named: dict[str, AddedToken] = {}
        extras: list[AddedToken] = []
        for key in _NAMED_SPECIAL_TOKENS:
            if settings.get(key) is not None:
                named[key] = _special_token(settings[key], by_content)
        extra_setting = settings.get("extra_special_tokens")
        if isinstance(extra_setting, Mapping):
            for key, value in extra_setting.items():
                named[str(key)] = _special_token(value, by_content)
        elif isinstance(extra_setting, Sequence) and not isinstance(extra_setting, str):
            extras = [_special_token(value, by_content) for value in extra_setting]
        # transformers 5 treats other `*_token` string settings (image_token, ...) as named ones.
        for key, value in settings.items():
            if key in named or key in _NAMED_SPECIAL_TOKENS or not key.endswith("_token"):
                continue
            if isinstance(value, str) or (isinstance(value, Mapping) and "__type" in value):
                named[key] = _special_token(value, by_content)

        # The same additions, in the same order, as transformers' TokenizersBackend.__init__, so
        # that any token the config names but tokenizer.json lacks gets the same id.
        to_add = [added_decoder[i] for i in sorted(added_decoder)]
        known = {t.content for t in rust.get_added_tokens_decoder().values()}
        known.update(t.content for t in to_add)
        for token in [*named.values(), *extras]:
            if token.content not in known and all(token.content != t.content for t in to_add):
                to_add.append(token)
        if to_add:
            rust.add_tokens(to_add)

        backend = _TokenizersBackend(rust, bool(config.get("clean_up_tokenization_spaces", False)))
        return cls(
            backend,
            path=directory,
            special_tokens={key: token.content for key, token in named.items()},
            extra_special_tokens=[t.content for t in extras],
            chat_templates=_chat_templates(directory, config),
            generation_config=generation_config,
            model_max_length=_max_length(config.get("model_max_length")),
        )

    @classmethod
    def _from_transformers(cls, directory: Path, generation_config: dict[str, Any]) -> Tokenizer:
        missing = f"{TOKENIZER_FILE} is missing"
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ValueError(
                f"no usable tokenizer in {str(directory)!r}: {missing}, and transformers, "
                f"needed to read other tokenizer files ({', '.join(_SLOW_TOKENIZER_FILES)}), "
                "is not installed"
            ) from None
        try:
            hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except Exception as e:  # transformers raises many kinds here; all mean "not loadable"
            raise ValueError(
                f"no usable tokenizer in {str(directory)!r}: {missing}, and transformers could not "
                f"load the directory either (it needs one of {', '.join(_SLOW_TOKENIZER_FILES)}): "
                f"{type(e).__name__}: {_first_line(e)}"
            ) from e
        logger.info(
            "%s: no %s, loaded %s through transformers",
            directory,
            TOKENIZER_FILE,
            type(hf).__name__,
        )
        template = hf.chat_template
        if isinstance(template, str):
            templates = {"default": template}
        elif isinstance(template, Mapping):
            templates = {str(k): str(v) for k, v in template.items()}
        else:
            templates = {}
        return cls(
            _TransformersBackend(hf),
            path=directory,
            special_tokens={str(k): str(v) for k, v in hf.special_tokens_map.items()},
            extra_special_tokens=[str(t) for t in getattr(hf, "extra_special_tokens", None) or []],
            chat_templates=templates,
            generation_config=generation_config,
            model_max_length=_max_length(getattr(hf, "model_max_length", None)),
        )

    # ------------------------------------------------------------------ ids <-> text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. With ``add_special_tokens`` the tokenizer's post-processor adds
        its special tokens (bos for Llama-style tokenizers); special tokens written in ``text``
        are always recognised as such."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        try:
            return self._backend.encode(text, add_special_tokens)
        except TypeError:  # (the tokenizers' only word for text with a lone surrogate)
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"the text is not valid Unicode: {e.object[e.start:e.end]!r} at index "
                                 f"{e.start} is a lone surrogate") from None
            raise

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; ids the tokenizer does not know are left out. Bytes that do not
        form valid UTF-8 come out as U+FFFD."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of the vocabulary entry ``token`` (an added token or a model token), or None."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id`` (raw, e.g. byte-level ``Ġthe``), or None."""
        return self._backend.id_to_token(int(token_id))

    def _named_id(self, key: str) -> int | None:
        token = self._special_tokens_map.get(key)
        return None if token is None else self._backend.token_to_id(token)

    # ------------------------------------------------------------------ chat

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = ...,
        tokenize: Literal[False] = ...,
        *,
        tools: Sequence[Mapping[str, Any]] | None = ...,
        chat_template_kwargs: Mapping[str, Any] | None = ...,
    ) -> str: ...

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = ...,
        *,
        tokenize: Literal[True],
        tools: Sequence[Mapping[str, Any]] | None = ...,
        chat_template_kwargs: Mapping[str, Any] | None = ...,
    ) -> list[int]: ...

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        tokenize: Literal[True],
        *,
        tools: Sequence[Mapping[str, Any]] | None = ...,
        chat_template_kwargs: Mapping[str, Any] | None = ...,
    ) -> list[int]: ...

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = ...,
        tokenize: bool = ...,
        *,
        tools: Sequence[Mapping[str, Any]] | None = ...,
        chat_template_kwargs: Mapping[str, Any] | None = ...,
    ) -> str | list[int]: ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str | list[int]:
        """Render ``messages`` with the chat template, as transformers' ``apply_chat_template``.

        The template runs in jinja2's immutable sandbox with transformers' settings and helpers
        (``trim_blocks``, ``lstrip_blocks``, loop controls, ``raise_exception``, ``tojson``,
        ``strftime_now``, ``{% generation %}``); it sees ``messages`` (keys whose value is None
        removed), ``tools``, ``documents`` (None), ``add_generation_prompt``, the named special
        tokens (``bos_token``, ``eos_token``, ...) and ``chat_template_kwargs``. With ``tokenize``
        the rendered text is encoded with ``add_special_tokens=False`` (the template writes the
        special tokens) and the ids are returned. ``tools`` (JSON schemas) select the directory's
        ``tool_use`` template where it has one, as in transformers.

        Raises ValueError when the tokenizer has no chat template, when ``messages`` is empty, when
        the template fails (e.g. its ``raise_exception`` rejects the conversation), or when the
        messages, tools or ``chat_template_kwargs`` nest too deeply to walk (a RecursionError).
        """
        if self.chat_template is None:
            raise ValueError(
                f"the tokenizer in {str(self.path)!r} has no chat template "
                f"({TOKENIZER_CONFIG_FILE} has no 'chat_template' and there is no "
                f"{CHAT_TEMPLATE_FILE}); "
                "send a raw prompt instead"
            )
        if not messages:
            raise ValueError("cannot apply the chat template to an empty list of messages")
        extra = dict(chat_template_kwargs or {})
        if reserved := _RESERVED_TEMPLATE_VARS.intersection(extra):
            raise ValueError(f"chat_template_kwargs may not set {sorted(reserved)}")
        for message in messages:
            if not isinstance(message, Mapping):
                raise ValueError(f"chat messages must be mappings, got {type(message).__name__}")
        source = self.chat_template
        if tools is not None and "tool_use" in self._chat_templates:
            source = self._chat_templates["tool_use"]  # transformers' choice when tools are given
        template = compile_chat_template(source)
        try:
            conversation = [{str(k): plain(v) for k, v in m.items() if v is not None} for m in messages]
            variables: dict[str, Any] = {**self._special_tokens_map, **plain(extra)}
            text = template.render(
                messages=conversation,
                tools=plain(list(tools)) if tools is not None else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e
        except RecursionError as e:
            # (plain() and the template's tojson recurse once per level of nesting)
            raise ValueError(
                "the chat is nested too deeply to render: a message, a tool call's arguments or a "
                "tool's parameters hold JSON nested deeper than the chat template can walk"
            ) from e
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas without O(n^2) decoding
    (prefix_offset/read_offset scheme as in TGI/vLLM; never emits a partial UTF-8 char "\\ufffd").

    Each :meth:`add` decodes only a short window: the ids since the last emission (``read_offset``)
    plus the ids of the emission before (from ``prefix_offset``), whose text is subtracted. The
    window starts with the last few prompt ids so the first token decodes as it does in context.
    While the window's text ends in U+FFFD (a character whose bytes are split across tokens, or
    still unfinished) nothing is emitted; the text follows once the character completes.

    Contract: the deltas of :meth:`add`, followed by :meth:`flush` at the end, joined, equal
    ``decode(context + generated)`` minus ``decode(context)``, where ``context`` is the last five
    prompt ids (none if their text ends in an unfinished character). For byte-level BPE tokenizers
    (Llama 3, Qwen, GPT-2 and the ``tiny`` preset) that is exactly ``decode(generated ids)``;
    decoders that drop a leading space (SentencePiece) keep the first token's space here, as vLLM
    does. Not thread-safe: one instance per request.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        start = max(0, len(prompt_ids) - _DETOKENIZER_CONTEXT_TOKENS)
        context = [int(i) for i in prompt_ids[start:]]
        context_text = self._decode(context) if context else ""
        if context_text.endswith(_REPLACEMENT_CHAR):
            # Generated bytes could complete that character and change text already subtracted.
            context, context_text = [], ""
        self._ids: list[int] = context
        self._num_context = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = context_text
        self._chunks: list[str] = []

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Take the next generated id; return the text it completes (often "", never a partial
        character)."""
        self._ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """Return the text still held back at the end of generation: bytes of an unfinished
        character, as U+FFFD, the way :meth:`Tokenizer.decode` shows them."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(self._prefix_text):
            return ""
        if not final and new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        self._chunks.append(delta)
        return delta

    @property
    def text(self) -> str:
        """All text emitted so far (the deltas joined)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def token_ids(self) -> list[int]:
        """The generated ids taken so far (a copy)."""
        return self._ids[self._num_context :]


# ---------------------------------------------------------------------- helpers


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, {} if there is no such file; ValueError naming a bad file."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def _added_token(entry: Any, source: Path) -> AddedToken:
    """An AddedToken from a config entry (a dict of AddedToken fields, or a bare string)."""
    if isinstance(entry, str):
        return AddedToken(entry, special=True, normalized=False)
    if isinstance(entry, Mapping) and isinstance(entry.get("content"), str):
        return AddedToken(**{k: entry[k] for k in _ADDED_TOKEN_FIELDS if k in entry})
    raise ValueError(f"{source}: bad added token entry {entry!r}")


def _special_token(value: Any, by_content: Mapping[str, AddedToken]) -> AddedToken:
    """A special token setting as an AddedToken flagged special, as transformers builds it."""
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        token = by_content.get(value["content"]) or AddedToken(
            **{k: value[k] for k in _ADDED_TOKEN_FIELDS if k in value and k != "special"},
            special=True,
        )
    elif isinstance(value, str):
        token = by_content.get(value) or AddedToken(value, special=True, normalized=False)
    else:
        raise ValueError(f"special token settings must be strings or token dicts, got {value!r}")
    if not token.special:
        token = AddedToken(
            token.content,
            single_word=token.single_word,
            lstrip=token.lstrip,
            rstrip=token.rstrip,
            normalized=token.normalized,
            special=True,
        )
    return token


def _chat_templates(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Named chat templates ("default" is the one used), with transformers' file priority."""
    templates: dict[str, str] = {}
    template_file = directory / CHAT_TEMPLATE_FILE
    if template_file.is_file():
        templates["default"] = template_file.read_text(encoding="utf-8")
    extra_dir = directory / CHAT_TEMPLATE_DIR
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        return templates
    setting = config.get("chat_template")
    if isinstance(setting, str):
        return {"default": setting}
    if isinstance(setting, list):
        # The multi-template form: [{"name": ..., "template": ...}, ...].
        return {str(t["name"]): str(t["template"]) for t in setting}
    return {}


def _max_length(value: Any) -> int | None:
    """A ``model_max_length`` setting, None where it is missing or transformers' "unlimited"."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < _UNLIMITED_LENGTH:
        return value
    return None


def _optional_id(value: Any, name: str, source: Path) -> int | None:
    if value is None:
        return None
    if isinstance(value, list):
        value = value[0] if value else None
        if value is None:
            return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{source}: {name} must be a non-negative integer, got {value!r}")
    return value


def _id_list(value: Any, name: str, source: Path) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(
                f"{source}: {name} must be an integer or a list of integers, got {value!r}"
            )
    return list(values)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (for WordPiece-style vocabularies)."""
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )

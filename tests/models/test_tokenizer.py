"""Tokenizer parity with transformers, the tiny preset, chat templates, streaming decoding."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from coserve.models.presets import PRESETS, preset_path
from coserve.models.tokenizer import IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")

TINY_SPECIALS = {
    "<|begin_of_text|>": 0,
    "<|end_of_text|>": 1,
    "<|start_header_id|>": 2,
    "<|end_header_id|>": 3,
    "<|eot_id|>": 4,
    "<|pad|>": 5,
}

TEXTS = [
    "Hello world!",
    "héllo wörld 日本語 🙂",
    "The quick brown fox jumps over the lazy dog. It's 42°C; don't panic.",
    "  leading spaces\n\nnew lines\ttabs  ",
    "<|eot_id|> special tokens <|start_header_id|>user<|end_header_id|> in text",
    "",
    "emoji 👩‍👩‍👧 and ZWJ, Ελληνικά, русский, العربية",
]

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are terse.  "},
        {"role": "user", "content": "héllo wörld 日本語 🙂"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Again, <please>."},
    ],
]


def hf_chat(
    hf: Any, messages: list[dict[str, Any]], add_generation_prompt: bool, tokenize: bool
) -> Any:
    return hf.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize, return_dict=False
    )


def assert_parity(
    ours: Tokenizer, hf: Any, texts: list[str], chats: list[list[dict[str, Any]]]
) -> None:
    """encode / decode / apply_chat_template give what transformers gives."""
    assert ours.vocab_size == len(hf)
    for text in texts:
        for add_special in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special)
            assert ids == hf.encode(text, add_special_tokens=add_special), (text, add_special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                    ids, skip_special_tokens=skip
                ), (text, add_special, skip)
    for messages in chats:
        for gen_prompt in (True, False):
            rendered = ours.apply_chat_template(messages, add_generation_prompt=gen_prompt)
            assert rendered == hf_chat(hf, messages, gen_prompt, tokenize=False)
            chat_ids = ours.apply_chat_template(
                messages, add_generation_prompt=gen_prompt, tokenize=True
            )
            assert chat_ids == hf_chat(hf, messages, gen_prompt, tokenize=True)


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return Tokenizer.from_dir(preset_path("tiny"))


@pytest.fixture(scope="module")
def tiny_hf() -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(preset_path("tiny")))


# ---------------------------------------------------------------------- the tiny preset


def test_preset_registry() -> None:
    assert set(PRESETS) >= {"tiny"}
    path = preset_path("tiny")
    for name in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (path / name).is_file(), name
    assert not list(path.glob("*.safetensors")) and not list(path.glob("*.bin"))
    assert (path / "tokenizer.json").stat().st_size < 200_000


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match=r"unknown preset 'nope'.*tiny"):
        preset_path("nope")


def test_text_with_a_lone_surrogate_is_a_value_error(tiny: Tokenizer) -> None:
    """JSON can carry "\\udcff"; the Rust tokenizer raises a bare TypeError for it."""
    with pytest.raises(ValueError, match=r"'\\udcff' at index 2 is a lone surrogate"):
        tiny.encode("a \udcff b")
    assert tiny.encode("a \u00ff b")  # a real character is fine


def test_preset_tokenizer(tiny: Tokenizer) -> None:
    assert tiny.vocab_size == 1024
    for token, token_id in TINY_SPECIALS.items():
        assert tiny.token_to_id(token) == token_id
        assert tiny.id_to_token(token_id) == token
    assert tiny.bos_token_id == 0
    assert tiny.eos_token_id == 4
    assert tiny.eos_token_ids == frozenset({1, 4})
    assert tiny.pad_token_id == 5
    assert tiny.all_special_ids == frozenset(TINY_SPECIALS.values())
    assert tiny.model_max_length == 2048
    assert tiny.encode("hi")[0] == 0
    assert 0 not in tiny.encode("hi", add_special_tokens=False)
    # byte-level: any text round-trips
    text = "héllo wörld 日本語 🙂 \x00\x7f"
    assert tiny.decode(tiny.encode(text)) == text


def test_preset_configs(tiny: Tokenizer) -> None:
    path = preset_path("tiny")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["vocab_size"] == tiny.vocab_size
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 0, "eos_token_id": [1, 4]}
    hf_cfg = transformers.AutoConfig.from_pretrained(str(path))
    assert hf_cfg.model_type == "llama"
    assert hf_cfg.vocab_size == tiny.vocab_size
    assert (hf_cfg.hidden_size, hf_cfg.num_hidden_layers, hf_cfg.head_dim) == (128, 4, 32)
    assert (hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads) == (4, 2)
    assert hf_cfg.tie_word_embeddings is True


def test_preset_parity(tiny: Tokenizer, tiny_hf: Any) -> None:
    assert_parity(tiny, tiny_hf, TEXTS, CONVERSATIONS)


def test_preset_chat_template_is_llama3(tiny: Tokenizer) -> None:
    text = tiny.apply_chat_template(
        [{"role": "user", "content": " hi "}], add_generation_prompt=True
    )
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = tiny.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    assert isinstance(ids, list)
    assert ids.count(0) == 1 and ids[0] == 0  # the template's bos only, not a second one
    assert ids[-1] == 4


# ---------------------------------------------------------------------- other directories


def _word_level_tokenizer() -> RustTokenizer:
    words = [
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "<s>",
        "</s>",
        "hello",
        "world",
        "the",
        "cat",
        "sat",
        ".",
        ",",
        "!",
        "?",
        "'",
        "s",
        "do",
        "on",
        "mat",
        "user",
        "assistant",
        ":",
        "again",
        "<",
        ">",
    ]
    tok = RustTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 1), ("[SEP]", 2)],
    )
    return tok


GENERIC_TEMPLATE = (
    "{%- set ns = namespace(count=0) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'tool' -%}{{ raise_exception('no tools here') }}{%- endif -%}"
    "{%- set ns.count = ns.count + 1 -%}"
    "{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}assistant:{% endif -%}"
)


@pytest.fixture(scope="module")
def word_level_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A WordLevel tokenizer saved by transformers: chat_template.jinja, a pad token and an extra
    special token that tokenizer.json lacks, and space clean-up on decode."""
    path = tmp_path_factory.mktemp("wordlevel")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_word_level_tokenizer(),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="<pad>",
        additional_special_tokens=["<tool>"],
        chat_template=GENERIC_TEMPLATE,
        clean_up_tokenization_spaces=True,
    )
    hf.save_pretrained(str(path))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    return path


def test_generic_dir_parity(word_level_dir: Path) -> None:
    ours = Tokenizer.from_dir(word_level_dir)
    hf = transformers.AutoTokenizer.from_pretrained(str(word_level_dir))
    texts = ["Hello, world! The cat sat on the mat.", "the cat's <tool> unknown words ?", "ÉCOLE"]
    chats = [[{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world !"}]]
    assert_parity(ours, hf, texts, chats)
    assert ours.eos_token_id == ours.token_to_id("</s>")
    assert ours.eos_token_ids == {ours.token_to_id("</s>"), 2}
    assert ours.pad_token_id == ours.token_to_id("<pad>") == 25
    assert ours.all_special_ids >= set(hf.all_special_ids)
    assert ours.model_max_length is None


def test_template_features_match_transformers(word_level_dir: Path) -> None:
    template = (
        "{% for m in messages %}{% if loop.index0 > 5 %}{% break %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}\n"
        "{% endfor %}{{ dict(a=1) | tojson }}{{ bos_token }}{{ add_generation_prompt }}"
    )
    ours = Tokenizer.from_dir(word_level_dir)
    hf = transformers.AutoTokenizer.from_pretrained(str(word_level_dir))
    ours.chat_template = template
    hf.chat_template = template
    messages = [{"role": "user", "content": "<b>&'\"日本</b>", "name": None}] * 3
    assert ours.apply_chat_template(messages) == hf_chat(hf, messages, False, tokenize=False)


def test_legacy_special_tokens_map(tmp_path: Path) -> None:
    """Without added_tokens_decoder in the config, special_tokens_map.json overrides it."""
    RustTokenizer.from_file(str(preset_path("tiny") / "tokenizer.json")).save(
        str(tmp_path / "tokenizer.json")
    )
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|end_of_text|>",
                "chat_template": [
                    {
                        "name": "default",
                        "template": "{{ bos_token }}{% for m in messages %}{{ m.content }}"
                        "{{ eos_token }}{% endfor %}",
                    },
                    {"name": "tool_use", "template": "unused"},
                ],
                "model_max_length": 1000000000000000019884624838656,
            }
        )
    )
    (tmp_path / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "eos_token": {
                    "content": "<|eot_id|>",
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "single_word": False,
                },
                "additional_special_tokens": ["<|tool|>"],
            }
        )
    )
    ours = Tokenizer.from_dir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert_parity(
        ours, hf, ["hello <|tool|> wörld", "<|eot_id|>"], [[{"role": "user", "content": "x"}]]
    )
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    messages = [{"role": "user", "content": "x"}]
    assert ours.apply_chat_template(messages, tools=tools) == "unused"
    assert hf.apply_chat_template(messages, tools=tools, tokenize=False) == "unused"
    assert ours.eos_token_id == 4
    assert ours.token_to_id("<|tool|>") == 1024
    assert 1024 in ours.all_special_ids
    assert ours.model_max_length is None


def test_transformers_fallback_without_tokenizer_json(tmp_path: Path) -> None:
    RustTokenizer.from_file(str(preset_path("tiny") / "tokenizer.json")).model.save(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "GPT2Tokenizer",
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>",
                "chat_template": "{% for m in messages %}{{ m.content }}{{ eos_token }}"
                "{% endfor %}",
            }
        )
    )
    ours = Tokenizer.from_dir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert_parity(ours, hf, TEXTS[:3], [[{"role": "user", "content": "hi"}]])
    assert ours.eos_token_id == 4


# ---------------------------------------------------------------------- errors


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "absent")


def test_directory_without_tokenizer_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(
        ValueError, match=r"no usable tokenizer in .*tokenizer\.json is missing"
    ) as info:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_bad_json_files(tmp_path: Path) -> None:
    RustTokenizer.from_file(str(preset_path("tiny") / "tokenizer.json")).save(
        str(tmp_path / "tokenizer.json")
    )
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match="eos_token_id"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_no_chat_template(tmp_path: Path) -> None:
    RustTokenizer.from_file(str(preset_path("tiny") / "tokenizer.json")).save(
        str(tmp_path / "tokenizer.json")
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_template is None
    assert tok.eos_token_id == 7 and tok.eos_token_ids == {7}
    assert tok.bos_token_id is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_errors(tiny: Tokenizer, word_level_dir: Path) -> None:
    with pytest.raises(ValueError, match="empty"):
        tiny.apply_chat_template([])
    with pytest.raises(ValueError, match="no tools here"):
        Tokenizer.from_dir(word_level_dir).apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="may not set"):
        tiny.apply_chat_template(
            [{"role": "user", "content": "x"}], chat_template_kwargs={"messages": []}
        )


# ---------------------------------------------------------------------- streaming


def _stream(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    assert detok.token_ids == ids
    return deltas, detok.text


def test_incremental_detokenizer_streams_valid_text(tiny: Tokenizer) -> None:
    text = "héllo wörld 日本語 🙂 done"
    ids = tiny.encode(text, add_special_tokens=False)
    # the tiny vocabulary splits the multi-byte characters into byte tokens
    assert any("\ufffd" in tiny.decode([i]) for i in ids)
    prompt = tiny.apply_chat_template([{"role": "user", "content": "hi"}], True, tokenize=True)
    assert isinstance(prompt, list)
    deltas, streamed = _stream(tiny, prompt, ids + [4], skip=True)
    assert streamed == text
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[-1] == ""  # nothing held back
    _, with_specials = _stream(tiny, prompt, ids + [4], skip=False)
    assert with_specials == text + "<|eot_id|>"


def test_incremental_detokenizer_matches_decode_on_random_ids(tiny: Tokenizer) -> None:
    rng = random.Random(1234)
    byte_ids = [i for i in range(tiny.vocab_size) if "\ufffd" in tiny.decode([i])]
    text_ids = tiny.encode("héllo wörld 日本語 🙂", add_special_tokens=False)
    pools = [range(tiny.vocab_size), byte_ids, text_ids, list(TINY_SPECIALS.values())]
    for _ in range(400):
        ids = [rng.choice(rng.choice(pools)) for _ in range(rng.randrange(1, 40))]
        prompt = [rng.choice(rng.choice(pools)) for _ in range(rng.randrange(0, 9))]
        for skip in (True, False):
            deltas, streamed = _stream(tiny, prompt, ids, skip)
            assert streamed == tiny.decode(ids, skip_special_tokens=skip), (prompt, ids, skip)
            assert not any(d.endswith("\ufffd") for d in deltas[:-1])  # add() never splits a char


def test_incremental_detokenizer_is_linear(tiny: Tokenizer) -> None:
    rng = random.Random(0)
    detok = IncrementalDetokenizer(tiny, [], skip_special_tokens=True)
    ids = [rng.randrange(tiny.vocab_size) for _ in range(5000)]
    for i in ids:
        detok.add(i)
        # the decoded window stays short: it restarts at each emission
        assert len(detok._ids) - detok._prefix_offset < 64
    assert detok.text + detok.flush() == tiny.decode(ids)

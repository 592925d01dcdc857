"""Build the ``tiny`` preset shipped in ``src/coserve/models/presets/tiny``.

The preset is a Llama-3-shaped model directory without weights: a byte-level BPE tokenizer
(1024 tokens in all, six of them special), its ``tokenizer_config.json`` with a Llama-3-style chat
template, a ``generation_config.json`` and a small Llama ``config.json`` whose ``vocab_size`` is the
tokenizer's. The engine gives the model random weights from a seed.

The tokenizer is trained on a corpus made offline from the docstrings of the running Python's
standard library (parsed with ``ast``, never imported) plus the instruction sentences below. The
output is deterministic for a given Python version and ``tokenizers`` version: inputs are sorted
and every setting is fixed. It logs the corpus' SHA-256 so two builds can be compared.

Run from the repository root::

    PYTHONPATH=src .venv/bin/python tools/build_tiny_preset.py [--out DIR]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import logging
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

logger = logging.getLogger("build_tiny_preset")

DEFAULT_OUT = (
    Path(__file__).resolve().parent.parent / "src" / "coserve" / "models" / "presets" / "tiny"
)

VOCAB_SIZE = 1024
BOS = "<|begin_of_text|>"
EOS_TEXT = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
PAD = "<|pad|>"
# The trainer gives these ids 0..5 in this order.
SPECIAL_TOKENS = [BOS, EOS_TEXT, START_HEADER, END_HEADER, EOT, PAD]

# Llama 3's pre-tokenizer split pattern.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Llama 3 Instruct's template.
CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}"
    "{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

# A small instruction dataset, so that chat-like text tokenizes into sensible pieces.
INSTRUCTIONS: list[tuple[str, str]] = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Translate 'good morning' into Spanish.", "Good morning in Spanish is 'buenos días'."),
    (
        "Write a haiku about the sea.",
        "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time.",
    ),
    (
        "Give me three tips for better sleep.",
        "Keep a regular schedule, avoid screens before bed, and keep your room cool and dark.",
    ),
    (
        "Explain what a neural network is in one sentence.",
        "A neural network is a function made of layers of weighted sums and nonlinearities, "
        "trained from examples to map inputs to outputs.",
    ),
    (
        "Summarize the plot of Romeo and Juliet.",
        "Two young lovers from feuding families marry in secret, and a chain of misunderstandings "
        "ends in both of their deaths.",
    ),
    (
        "How do I reverse a list in Python?",
        "Use my_list.reverse() in place, or my_list[::-1] for a copy.",
    ),
    ("What is 12 times 7?", "12 times 7 is 84."),
    (
        "Name the planets of the solar system.",
        "Mercury, Venus, Earth, Mars, Jupiter, Saturn, Uranus and Neptune.",
    ),
    ("Suggest a name for a friendly robot.", "How about Pixel, Sprocket or Juniper?"),
    (
        "Why is the sky blue?",
        "Sunlight is scattered by the molecules of the air, and blue light is scattered "
        "more than red.",
    ),
    (
        "Write a short thank-you note to a colleague.",
        "Thank you for your help with the report this week. I could not "
        "have finished it without you!",
    ),
    ("What does HTTP stand for?", "HTTP stands for Hypertext Transfer Protocol."),
    ("Convert 100 degrees Fahrenheit to Celsius.", "100 °F is about 37.8 °C."),
    ("List three primary colors.", "Red, yellow and blue."),
    ("Tell me a fun fact about octopuses.", "An octopus has three hearts and blue blood."),
    (
        "How can I make my code easier to read?",
        "Use clear names, keep functions short, write tests, and explain why rather than what.",
    ),
    (
        "What is the boiling point of water at sea level?",
        "Water boils at 100 degrees Celsius at sea level.",
    ),
    ("Describe a cat in five words.", "Curious, graceful, independent, soft, playful."),
    (
        "Is a tomato a fruit or a vegetable?",
        "Botanically a tomato is a fruit, but in cooking it is used as a vegetable.",
    ),
    ("Give an example of a prime number greater than 50.", "53 is a prime number."),
    (
        "What is the difference between weather and climate?",
        "Weather is what happens in the atmosphere on a given day; climate is the "
        "average over many years.",
    ),
    (
        "Write a sentence using the word 'serendipity'.",
        "Finding my favorite book at a garage sale was pure serendipity.",
    ),
    (
        "Recommend a good habit for learning a language.",
        "Practice a little every day, and speak out loud, even if you make mistakes.",
    ),
    (
        "What year did the first person walk on the Moon?",
        "Neil Armstrong walked on the Moon in 1969.",
    ),
    (
        "Explain recursion to a child.",
        "Recursion is when something is described using a smaller copy of itself, like a set "
        "of nesting dolls.",
    ),
    ("Please answer with yes or no: is ice cold?", "Yes."),
    ("Count from one to five.", "One, two, three, four, five."),
    ("Hello! Who are you?", "Hello! I am a small assistant model. How can I help you today?"),
    (
        "Can you help me plan a picnic?",
        "Of course! Pick a shady spot, pack sandwiches, fruit, water and a blanket, and check "
        "the weather first.",
    ),
]


def _docstrings(source: str) -> Iterator[str]:
    """Module, class and function docstrings of ``source``, in source order."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    nodes: list[ast.AST] = [tree]
    nodes.extend(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
    )
    for node in nodes:
        assert isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        doc = ast.get_docstring(node, clean=True)
        if doc:
            yield doc


# Packages left out: tests, GUI code and vendored data are not English prose.
_SKIP_DIRS = {
    "test",
    "tests",
    "idlelib",
    "tkinter",
    "turtledemo",
    "lib2to3",
    "ensurepip",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "pydoc_data",
    "lib-dynload",
    "venv",
    "distutils",
}


def build_corpus() -> list[str]:
    """The training texts: stdlib docstrings (files sorted by path) then the instruction pairs."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in stdlib.rglob("*.py")
        if not _SKIP_DIRS.intersection(p.relative_to(stdlib).parts[:-1])
        and not p.name.startswith("_sysconfigdata")
    )
    texts: list[str] = []
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.extend(_docstrings(source))
    for question, answer in INSTRUCTIONS:
        texts.append(question)
        texts.append(answer)
    return texts


def build_tokenizer(texts: list[str]) -> Tokenizer:
    """Train the byte-level BPE tokenizer on ``texts``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS}:0 $A:0",
                pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
                special_tokens=[(BOS, bos_id)],
            ),
        ]
    )
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != VOCAB_SIZE:
        raise RuntimeError(f"trained vocabulary has {size} tokens, expected {VOCAB_SIZE}")
    return tok


def tokenizer_config(tok: Tokenizer) -> dict[str, Any]:
    added = {
        str(i): {
            "content": t.content,
            "lstrip": t.lstrip,
            "normalized": t.normalized,
            "rstrip": t.rstrip,
            "single_word": t.single_word,
            "special": t.special,
        }
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }
    return {
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOT,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 2048,
        "pad_token": PAD,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def model_config(tok: Tokenizer) -> dict[str, Any]:
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 344,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": ids[BOS],
        "eos_token_id": [ids[EOS_TEXT], ids[EOT]],
        "torch_dtype": "float32",
    }


def generation_config(tok: Tokenizer) -> dict[str, Any]:
    return {
        "bos_token_id": tok.token_to_id(BOS),
        "eos_token_id": [tok.token_to_id(EOS_TEXT), tok.token_to_id(EOT)],
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build(out: Path) -> None:
    """Write the four preset files into ``out`` (created if needed)."""
    texts = build_corpus()
    digest = hashlib.sha256("\x00".join(texts).encode("utf-8")).hexdigest()
    logger.info(
        "corpus: %d texts, %d chars, sha256 %s (Python %s)",
        len(texts),
        sum(map(len, texts)),
        digest,
        sys.version.split()[0],
    )
    tok = build_tokenizer(texts)
    out.mkdir(parents=True, exist_ok=True)
    # Compact JSON: the tokenizer file ships in the package.
    (out / "tokenizer.json").write_text(tok.to_str(pretty=False) + "\n", encoding="utf-8")
    _write_json(out / "tokenizer_config.json", tokenizer_config(tok))
    _write_json(out / "generation_config.json", generation_config(tok))
    _write_json(out / "config.json", model_config(tok))
    logger.info(
        "wrote %s: vocab %d, special ids %s",
        out,
        tok.get_vocab_size(),
        {t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build(args.out)


if __name__ == "__main__":
    main()

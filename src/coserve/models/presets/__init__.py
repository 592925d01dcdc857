"""Model directories shipped inside the package, so a model can be served without any download.

A preset is a Hugging Face-style directory (``config.json``, ``tokenizer.json``,
``tokenizer_config.json``, ``generation_config.json``) without weight files: the engine makes
random weights from ``config.json`` with a seed. ``tools/build_tiny_preset.py`` builds ``tiny``.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent

PRESETS: dict[str, Path] = {
    # Llama-3-shaped: byte-level BPE with 1024 tokens, 4 layers, hidden size 128.
    "tiny": _HERE / "tiny",
}


def preset_path(name: str) -> Path:
    """The directory of the built-in preset ``name``; ValueError listing the known ones if none."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"unknown preset {name!r}; known presets: {known}") from None

"""Result files are read the same whether kept as JSON, gzipped or xz'd."""

from __future__ import annotations

import gzip
import json
import lzma
from pathlib import Path

from coserve.bench.result_file import read_result


def test_plain_and_gzipped_results_read_alike(tmp_path: Path) -> None:
    result = {"commit": "abc", "figures": {"x": [1, 2.5, None]}}
    plain, packed = tmp_path / "r.json", tmp_path / "r.json.gz"
    plain.write_text(json.dumps(result))
    packed.write_bytes(gzip.compress(json.dumps(result).encode()))
    assert read_result(plain) == read_result(str(packed)) == result


def test_xz_results_read_like_plain_and_gzipped(tmp_path: Path) -> None:
    """The largest committed results are kept as ``.json.xz`` (xz -9e, ~30% below gzip -9)."""
    result = {"commit": "abc", "figures": {"x": [1, 2.5, None]}}
    text = json.dumps(result).encode()
    plain, gz, xz = tmp_path / "r.json", tmp_path / "r.json.gz", tmp_path / "r.json.xz"
    plain.write_bytes(text)
    gz.write_bytes(gzip.compress(text))
    xz.write_bytes(lzma.compress(text, preset=9 | lzma.PRESET_EXTREME))
    assert read_result(xz) == read_result(str(xz)) == read_result(plain) == read_result(gz) == result

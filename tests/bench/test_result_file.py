"""Result files are read the same whether kept as JSON or gzipped."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from coserve.bench.result_file import read_result


def test_plain_and_gzipped_results_read_alike(tmp_path: Path) -> None:
    result = {"commit": "abc", "figures": {"x": [1, 2.5, None]}}
    plain, packed = tmp_path / "r.json", tmp_path / "r.json.gz"
    plain.write_text(json.dumps(result))
    packed.write_bytes(gzip.compress(json.dumps(result).encode()))
    assert read_result(plain) == read_result(str(packed)) == result

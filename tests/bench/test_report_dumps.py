"""Result files: sections indented, arrays on one line, the same data back."""

from __future__ import annotations

import json

from coserve.bench.report import dumps


def test_dumps_keeps_the_data_and_puts_each_array_on_one_line() -> None:
    value = {
        "config": {"name": "x", "slo": {"ttft_ms": 1000.0}},
        "figures": {"full": {"per_request": {"ttft_ms": [1.5, None, 3.0]},
                             "steps": {"rows": [["prefill/eager/idle", 0.1, [1.0, 2.0], [1, 0]]]}}},
        "list_of_objects": [{"a": [1, 2]}, {"b": []}],
        "tricky": "\x00array0\x00",  # looks like a placeholder before escaping; must survive
    }
    text = dumps(value)
    assert json.loads(text) == value
    assert '"ttft_ms": [1.5,null,3.0]' in text
    assert '"rows": [["prefill/eager/idle",0.1,[1.0,2.0],[1,0]]]' in text
    assert '\n  "slo": {\n' in text  # objects stay indented

"""Tool calls in chat completions: the model's text split into its content and the calls it makes.

A model trained for tool use writes its calls in a format of its family, which the server is told
with ``coserve serve --tool-call-parser NAME``:

- ``hermes`` (Hermes, Qwen 2/2.5 and others): each call a JSON object
  ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; the text
  outside them is the content.
- ``llama3_json`` (Llama 3.1-3.3 with JSON tool calling): the whole answer one JSON object
  ``{"name": ..., "parameters": {...}}`` (or several separated by ``;``), optionally after
  ``<|python_tag|>``; any other answer is content.

A call whose JSON does not parse (an answer cut by ``max_tokens``, say, or one nested deeper than
Python's parser recurses) is left in the content: a client then sees what the model wrote rather
than a call that was never whole.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple


class ToolCall(NamedTuple):
    name: str
    arguments: str  # a JSON object, as OpenAI sends it

    def as_openai(self) -> dict[str, Any]:
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class Parsed(NamedTuple):
    content: str | None
    calls: list[ToolCall]


def _call(obj: Any, args_key: str) -> ToolCall | None:
    """``obj`` as a call (None where it is not one: no string name, or arguments not an object)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # (a model that writes the arguments as a JSON string)
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> Parsed:
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for m in _HERMES.finditer(text):
        try:
            call = _call(json.loads(m.group(1)), "arguments")
        except (ValueError, RecursionError):
            call = None
        if call is None:
            continue  # (not a call: it stays in the content)
        calls.append(call)
        kept.append(text[last:m.start()])
        last = m.end()
    kept.append(text[last:])
    content = "".join(kept).strip()
    return Parsed(content or None, calls) if calls else Parsed(text, [])


def parse_llama3_json(text: str) -> Parsed:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return Parsed(text, [])
    calls = []
    for part in body.split(";"):
        try:
            call = _call(json.loads(part), "parameters")
        except (ValueError, RecursionError):
            return Parsed(text, [])
        if call is None:
            return Parsed(text, [])
        calls.append(call)
    return Parsed(None, calls)


PARSERS: dict[str, Callable[[str], Parsed]] = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates read them: a call's ``arguments`` as an object (the
    templates write it with ``tojson``), not the JSON string OpenAI sends."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": _as_object(
                c["function"]["arguments"])}} for c in calls]}
        out.append(m)
    return out


def _as_object(arguments: str) -> Any:
    """``arguments`` parsed, or the string itself where it is not JSON (or nests too deeply for
    the parser: the template then writes the string as sent)."""
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments

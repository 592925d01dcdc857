"""Tool calls in chat completions: the parsers alone (table-driven), and the route end to end with a
chat template that writes the tools and earlier calls into the prompt."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.engine.outputs import CompletionOutput, RequestOutput
from coserve.server.api import _chat_choice
from coserve.server.tool_calls import ToolCall, parse_hermes, parse_llama3_json, template_messages
from tests.server.test_api import MODEL, http, serve

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize(("text", "content", "calls"), [
    (f"<tool_call>{WEATHER}</tool_call>", None, [ToolCall("get_weather", '{"city": "Paris"}')]),
    (f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{{\"name\": \"now\", \"arguments\": {{}}}}"
     "</tool_call>", "Let me check.", [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("now", "{}")]),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [ToolCall("f", '{"x": 1}')]),
    ("It is sunny.", "It is sunny.", []),
    ("<tool_call>{\"name\": \"get_weather\", \"argum", "<tool_call>{\"name\": \"get_weather\", \"argum", []),  # cut off
    ("<tool_call>[1, 2]</tool_call>", "<tool_call>[1, 2]</tool_call>", []),  # not a call: content
])
def test_hermes(text: str, content: str | None, calls: list[ToolCall]) -> None:
    assert parse_hermes(text) == (content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [ToolCall("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"k": "v"}}', None,
     [ToolCall("a", "{}"), ToolCall("b", '{"k": "v"}')]),
    ("The weather is fine.", "The weather is fine.", []),
    ('{"name": "get_weather", "parameters": {"city": ', '{"name": "get_weather", "parameters": {"city": ', []),
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
])
def test_llama3_json(text: str, content: str | None, calls: list[ToolCall]) -> None:
    assert parse_llama3_json(text) == (content, calls)


def test_a_choice_with_calls_says_so_and_one_without_stays_as_written() -> None:
    def out(text: str, reason: str) -> RequestOutput:
        return RequestOutput("r", None, [1], [CompletionOutput(0, text, [2, 3], finish_reason=reason)], True)

    called = _chat_choice(0, out(f"<tool_call>{WEATHER}</tool_call>", "stop"), None, parse_hermes)
    assert called.finish_reason == "tool_calls" and called.message is not None and called.message.content is None
    (call,) = called.message.tool_calls or []
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    plain = _chat_choice(1, out("no call", "length"), None, parse_hermes)
    assert plain.finish_reason == "length" and plain.message is not None and plain.message.content == "no call"
    assert plain.message.tool_calls is None


def test_template_messages_give_the_template_the_arguments_as_an_object() -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]
    assert template_messages([{"role": "assistant", "content": None, "tool_calls": calls}])[0]["tool_calls"][0][
        "function"]["arguments"] == {"x": 1}


def test_json_too_deep_to_parse_is_no_call_and_no_object() -> None:
    deep = "[" * 100_000 + "]" * 100_000  # (json.loads raises RecursionError, not ValueError)
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}]
    assert template_messages([{"role": "assistant", "content": None, "tool_calls": calls}])[0]["tool_calls"][0][
        "function"]["arguments"] == deep, "kept as the string sent"
    text = f'<tool_call>{{"name": "f", "arguments": {deep}}}</tool_call>'
    assert parse_hermes(text) == (text, [])
    assert parse_llama3_json(f'{{"name": "f", "parameters": {deep}}}') == (f'{{"name": "f", "parameters": {deep}}}', [])


# a template in the Hermes style: the tools in a system turn, earlier calls and tool answers in theirs
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function'] | tojson }}</tool_call>"
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS: list[Any] = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                       "parameters": {"type": "object", "properties": {
                                                           "city": {"type": "string"}}}}}]
MESSAGES: list[Any] = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def test_chat_with_tools_renders_them_and_the_earlier_calls_into_the_prompt() -> None:
    engine = LLMEngine(EngineConfig(model=MODEL, device="cpu"))
    assert engine.tokenizer is not None
    engine.tokenizer.chat_template = TEMPLATE
    prompt = engine.tokenizer.apply_chat_template(template_messages(MESSAGES), add_generation_prompt=True,
                                                  tools=TOOLS)
    assert 'Tools: [{"type": "function"' in prompt and '<tool_call>{"name": "get_weather", "arguments": {"city": ' \
        '"Paris"}}</tool_call>' in prompt and "<|im_start|>tool\nsunny" in prompt
    want = len(engine.tokenizer.encode(prompt, add_special_tokens=False))
    without_tools = len(engine.tokenizer.apply_chat_template(template_messages(MESSAGES), add_generation_prompt=True,
                                                             tokenize=True))
    with serve(engine, tool_parser="hermes") as s:
        r = s.client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=4, temperature=0)
        assert r.usage is not None and r.usage.prompt_tokens == want > without_tools
        status, counted = http(s.url + "/tokenize", {"messages": MESSAGES, "tools": TOOLS})
        assert status == 200 and counted["count"] == want, "/tokenize counts the prompt a chat with tools runs"
        # (the tiny random model writes no call: its text comes back as content)
        assert r.choices[0].message.content is not None and r.choices[0].message.tool_calls is None
        none = s.client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                                max_tokens=2)
        assert none.usage is not None and none.usage.prompt_tokens == without_tools, "none: the tools are not offered"
        chunks = list(s.client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=4,
                                                       temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
        assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
        with pytest.raises(openai.BadRequestError, match="tool_choice 'required' is not supported"):
            s.client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required")
    with serve(LLMEngine(EngineConfig(model=MODEL, device="cpu"))) as s:
        with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):
            s.client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS)
        assert s.client.chat.completions.create(model=MODEL, messages=MESSAGES[:1], tools=TOOLS, tool_choice="none",
                                                max_tokens=2).choices[0].message.content is not None


def test_json_nested_too_deeply_to_render_is_a_400() -> None:
    """A tool's parameters or a call's arguments nested deeper than the template can walk (600
    levels: parsed, but too deep for the recursion limit once rendered) are the client's mistake."""
    engine = LLMEngine(EngineConfig(model=MODEL, device="cpu"))
    assert engine.tokenizer is not None
    engine.tokenizer.chat_template = TEMPLATE
    parameters: dict[str, Any] = {}
    for _ in range(600):
        parameters = {"a": parameters}
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 600 + "]" * 600}}]
    deep_call = [MESSAGES[0], {"role": "assistant", "content": None, "tool_calls": calls}]
    with serve(engine, tool_parser="hermes") as s:
        for body in ({"messages": MESSAGES[:1], "tools": tools}, {"messages": deep_call}):
            for route in ("/v1/chat/completions", "/tokenize"):
                status, reply = http(s.url + route, {"model": MODEL, "max_tokens": 2, **body})
                assert status == 400 and "nested too deeply" in reply["error"]["message"], (route, status, reply)
        assert s.client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=2).choices


def test_streamed_calls_come_as_one_delta_with_their_index() -> None:
    import asyncio

    from coserve.server.api import _whole_chunks
    from coserve.server.protocol import ChatCompletionResponse

    def out(text: str) -> RequestOutput:
        return RequestOutput("r", None, [1], [CompletionOutput(0, text, [2], finish_reason="stop")], True)

    whole = ChatCompletionResponse(id="x", object="chat.completion.chunk", created=0, model=MODEL,
                                   choices=[_chat_choice(0, out(f"<tool_call>{WEATHER}</tool_call>"), None, parse_hermes)])

    async def collect() -> list[str]:
        return [e async for e in _whole_chunks(whole, None)]

    events = [json.loads(e.removeprefix("data: ")) for e in asyncio.run(collect()) if "[DONE]" not in e]
    (call,) = events[0]["choices"][0]["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"]["name"] == "get_weather"
    assert events[1]["choices"][0]["finish_reason"] == "tool_calls"

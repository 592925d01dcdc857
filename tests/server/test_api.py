"""The HTTP API end to end: the tiny engine on CPU, uvicorn on a free port, the ``openai`` client."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
import uvicorn

from coserve import LLM, LoRARequest, SamplingParams
from coserve.core.config import CoServeConfig, LoRAConfig, OptimConfig
from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.engine.outputs import RequestOutput
from coserve.models.peft_adapter import new_lora_adapter, save_peft_adapter
from coserve.server.api import create_app
from coserve.server.engine_thread import EngineThread
from coserve.server.finetune import FinetuneSession, FinetuneSpec
from coserve.server.job_board import JobsConfig

DATA = Path(__file__).resolve().parents[2] / "src" / "coserve" / "data" / "tiny_facts.jsonl"
MODEL = "tiny"


@dataclass
class Served:
    engine_thread: EngineThread
    url: str
    client: openai.OpenAI
    batch_sizes: list[int]


@contextmanager
def serve(engine: LLMEngine, session: FinetuneSession | None = None,
          adapters: dict[str, str] | None = None, runtime_lora: bool = False,
          finetune_name: str | None = None, jobs: JobsConfig | None = None,
          api_key: str | None = None, tool_parser: str | None = None) -> Iterator[Served]:
    """Run the app under uvicorn in a background thread on a pre-bound free port."""
    batch_sizes: list[int] = []
    step = engine.step

    def recording_step() -> list[RequestOutput]:
        outputs = step()
        batch_sizes.append(len(outputs))
        return outputs

    engine.step = recording_step  # type: ignore[method-assign]
    engine_thread = EngineThread(engine, session, slo=jobs.template.slo if jobs is not None else None).start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    for name, path in (adapters or {}).items():
        engine.lora_manager.register(name, path)
    app = create_app(engine_thread, MODEL, adapters, runtime_lora, finetune_name, jobs, api_key, tool_parser)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "uvicorn did not start"
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key or "unused", max_retries=0, timeout=30)
    try:
        yield Served(engine_thread, url, client, batch_sizes)
    finally:
        server.should_exit = True
        thread.join(10)
        engine_thread.shutdown()
        sock.close()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve(LLMEngine(EngineConfig(model=MODEL, device="cpu"))) as s:
        yield s


def http(url: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    """(status, decoded JSON or text) for a GET (no body) or a POST."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def test_completion_whole_and_streamed(served: Served) -> None:
    tok = served.engine_thread.engine.tokenizer
    assert tok is not None
    prompt = "The capital of France is"
    r = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "length" and c.text
    assert r.usage is not None
    assert r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens == len(tok.encode(prompt))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    chunks = list(served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                                   stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    assert chunks[-1].choices[0].finish_reason == "length"
    ids = served.client.completions.create(model=MODEL, prompt=tok.encode(prompt), max_tokens=6, temperature=0)
    assert ids.choices[0].text == c.text, "token ids and text give the same prompt"


def test_completion_logprobs_and_stop(served: Served) -> None:
    r = served.client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=4, temperature=0,
                                         logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == 4 and all(x is not None and x <= 0 for x in lp.token_logprobs)
    full = served.client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=12,
                                            temperature=0).choices[0].text
    stop = full[5:8]
    for stream in (False, True):
        if stream:
            text = "".join(ch.choices[0].text for ch in served.client.completions.create(
                model=MODEL, prompt="Hello, my name is", max_tokens=12, temperature=0, stop=[stop], stream=True))
        else:
            text = served.client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=12,
                                                    temperature=0, stop=stop).choices[0].text
        assert text == full[:full.index(stop)]


def test_a_stream_sends_a_chunk_per_token_even_while_its_text_is_held_back(served: Served) -> None:
    """A stop string longer than the text holds every character back until the end; the stream
    still sends a chunk as each token comes (its text empty), with that token's logprobs, so a
    client times the tokens (TTFT, TPOT), not the end. Its logprobs' offsets are those of the
    whole response (before this, the 8B shape's streams on the GPU came in one chunk: its
    tokenizer reads most generated ids as empty text)."""
    stop = "~" * 200
    kw: Any = dict(model=MODEL, prompt="Hello, my name is", max_tokens=6, temperature=0, stop=[stop], logprobs=1)
    whole = served.client.completions.create(**kw).choices[0]
    chunks = [ch for ch in served.client.completions.create(**kw, stream=True) if ch.choices]
    assert len(chunks) == 6, "one chunk per generated token"
    assert all(ch.choices[0].text == "" for ch in chunks[:-1]) and chunks[-1].choices[0].text == whole.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert whole.logprobs is not None
    tokens, offsets = [], []
    for ch in chunks:
        lp = ch.choices[0].logprobs
        assert lp is not None and lp.tokens is not None and lp.text_offset is not None
        tokens += lp.tokens
        offsets += lp.text_offset
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset


def test_chat_whole_and_streamed(served: Served) -> None:
    messages: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    r = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content and c.finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 5 and r.usage.prompt_tokens > 5
    assert "delta" not in (r.model_extra or {}) and "delta" not in r.choices[0].model_dump()  # (a chunk's field)
    chunks = list(served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == c.message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


def test_concurrent_requests_are_batched(served: Served) -> None:
    served.batch_sizes.clear()
    prompts = [f"Request number {i} says" for i in range(8)]

    def one(p: str) -> tuple[str, int]:
        r = served.client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0.8, seed=1)
        assert r.usage is not None
        return r.choices[0].finish_reason, r.usage.completion_tokens

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, prompts))
    assert all(reason in ("length", "stop") for reason, _ in results)
    assert any(n == 24 for _, n in results)
    assert max(served.batch_sizes) > 1, "concurrent requests shared engine steps"


BAD_REQUESTS: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": ""}, "empty"),
    ("/v1/completions", {"prompt": []}, "empty"),
    ("/v1/completions", {"prompt": [5] * 4096}, "context"),
    ("/v1/completions", {"prompt": [10**9]}, "vocabulary"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": ["a", 5]}, "prompt must be"),
    ("/v1/completions", {"prompt": [["a"]]}, "prompt must be"),
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt 1 is empty"),
    ("/v1/completions", {"prompt": ["a", [1]]}, "prompt must be"),
    ("/v1/completions", {"prompt": [[1], [10**9]]}, "prompt 1: prompt token id"),
    ("/v1/completions", {"prompt": ["a"] * 65}, "at most 64 prompts"),
    ("/v1/completions", {"prompt": ["a"] * 8, "n": 9}, "n × prompts"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n must be in [1, 64]"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "ignore_eos": "yes"}, "ignore_eos"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 65}, "n must be in"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs needs logprobs"),
    ("/v1/completions", {"prompt": "hi", "top_logprobs": 2}, "top_logprobs is not supported"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
     "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": -3},
     "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": float("inf")}, "temperature must be a finite number"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, "seed must be a 64-bit"),
    ("/v1/completions", {"prompt": "a \udcff b"}, "lone surrogate"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "lone surrogate"),
    # fields this server does not implement, with a value that asks for something
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of is not supported"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2]"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty must be in (0, 100]"),
    ("/v1/completions", {"prompt": "hi", "min_p": 1.5}, "min_p must be in [0, 1]"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "keys must be token ids"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"²": 1}}, "keys must be token ids (decimal strings of the "
     "digits 0-9), got '²'"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"٥": 1}}, "got '٥'"),  # (int() reads it as 5)
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1, "05": 2}}, "keys '5' and '05' name the same token id 5"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1" * 5000: 1}}, "(5000 digits) is too long to be a token id"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "biases must be in [-100, 100]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"99999": 1}},
     "token id 99999 is outside the vocabulary"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, "response_format is not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]},
     "this server reads no tool calls; start it with --tool-call-parser"),
    ("/v1/completions", {"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools is not supported"),
]


@pytest.mark.parametrize(("path", "body", "needle"), BAD_REQUESTS)
def test_bad_input_is_a_400_that_says_why(served: Served, path: str, body: dict[str, Any], needle: str) -> None:
    status, reply = http(served.url + path, {"model": MODEL, **body})
    assert status == 400, reply
    assert reply["error"]["type"] == "invalid_request_error"
    assert needle in reply["error"]["message"], reply


def test_n_choices_and_batched_prompts(served: Served) -> None:
    """``n`` choices of a prompt (choice j sampled with seed + j) and a list of prompts (one
    choice each, prompt-major): the choices a request per choice gives, whole and streamed;
    usage counts each prompt once."""
    c = served.client
    one = {"max_tokens": 6, "temperature": 1.0}
    many = c.completions.create(model=MODEL, prompt="tell me", n=3, seed=7, **one)
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    singles = [c.completions.create(model=MODEL, prompt="tell me", seed=7 + j, **one) for j in range(3)]
    alone = [r.choices[0].text for r in singles]
    assert [ch.text for ch in many.choices] == alone
    assert len(set(alone)) > 1, "the seeds gave one sample: the test would not see choices mixed up"
    assert many.usage is not None and all(r.usage is not None for r in singles)
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens  # type: ignore[union-attr]  # the prompt once
    assert many.usage.completion_tokens == sum(r.usage.completion_tokens for r in singles)  # type: ignore[union-attr]
    # a batch of prompts, greedy: each choice is its prompt's own completion
    prompts = ["the sky", "a dog", [1, 2, 3]]
    greedy = {"max_tokens": 5, "temperature": 0.0}
    batch = c.completions.create(model=MODEL, prompt=prompts[:2], **greedy)
    assert [ch.text for ch in batch.choices] == [c.completions.create(model=MODEL, prompt=p, **greedy).choices[0].text
                                                 for p in prompts[:2]]
    status, ids = http(served.url + "/v1/completions", {"model": MODEL, "prompt": [[1, 2, 3], [4, 5]], **greedy})
    assert status == 200 and len(ids["choices"]) == 2
    # streamed: the chunks of each index join to that choice's text
    texts: dict[int, str] = {}
    usage = None
    for chunk in c.completions.create(model=MODEL, prompt="tell me", n=3, seed=7, stream=True,
                                      stream_options={"include_usage": True}, **one):
        usage = chunk.usage or usage
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert [texts[i] for i in range(3)] == alone
    assert usage is not None and usage.completion_tokens == many.usage.completion_tokens
    # chat: n choices too
    msgs = [{"role": "user", "content": "hello"}]
    chat = c.chat.completions.create(model=MODEL, messages=msgs, n=2, seed=3, max_tokens=4)  # type: ignore[arg-type]
    solo = [c.chat.completions.create(model=MODEL, messages=msgs, seed=3 + j, max_tokens=4)  # type: ignore[arg-type]
            .choices[0].message.content for j in range(2)]
    assert [ch.index for ch in chat.choices] == [0, 1] and [ch.message.content for ch in chat.choices] == solo
    streamed: dict[int, str] = {}
    for chunk in c.chat.completions.create(model=MODEL, messages=msgs, n=2, seed=3, max_tokens=4,  # type: ignore[arg-type]
                                           stream=True):
        for ch in chunk.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + (ch.delta.content or "")
    assert [streamed[i] for i in range(2)] == solo


def test_chat_logprobs_are_the_completions_ones(served: Served) -> None:
    """Chat ``logprobs`` / ``top_logprobs`` in OpenAI's chat shape: for the chat template's token
    ids, the values the completions route gives, whole and streamed."""
    msgs = [{"role": "user", "content": "hello there"}]
    tok = served.engine_thread.engine.tokenizer
    assert tok is not None
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ref = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0.0, logprobs=3)
    ref_lp = ref.choices[0].logprobs
    assert ref_lp is not None and ref_lp.token_logprobs and ref_lp.top_logprobs
    chat = served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0.0,  # type: ignore[arg-type]
                                                 logprobs=True, top_logprobs=3)
    lp = chat.choices[0].logprobs
    assert lp is not None and lp.content is not None
    assert [t.logprob for t in lp.content] == pytest.approx(ref_lp.token_logprobs)
    assert [t.token for t in lp.content] == ref_lp.tokens
    for t, top in zip(lp.content, ref_lp.top_logprobs, strict=True):
        assert len(t.top_logprobs) == 3 and {x.token for x in t.top_logprobs} <= set(top)
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
        assert bytes(t.bytes).decode("utf-8") == t.token
    streamed = []
    for chunk in served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5,  # type: ignore[arg-type]
                                                       temperature=0.0, logprobs=True, top_logprobs=3, stream=True):
        for ch in chunk.choices:
            streamed += ch.logprobs.content if ch.logprobs is not None and ch.logprobs.content else []
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in lp.content])
    plain = served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)  # type: ignore[arg-type]
    assert plain.choices[0].logprobs is None


def test_echo_gives_the_prompt_and_its_logprobs(served: Served) -> None:
    """``echo``: the prompt's text before the completion, and with ``logprobs`` its tokens' ones
    first (None for the first token), the offline API's ``prompt_logprobs``; whole and streamed."""
    c = served.client
    greedy = {"max_tokens": 3, "temperature": 0.0}
    plain = c.completions.create(model=MODEL, prompt="the sky is", **greedy)
    echoed = c.completions.create(model=MODEL, prompt="the sky is", echo=True, **greedy)
    assert echoed.choices[0].text == "the sky is" + plain.choices[0].text
    ids = [5, 17, 33, 91, 14]
    with_lps = c.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=2, **greedy)
    lp = with_lps.choices[0].logprobs
    alone = c.completions.create(model=MODEL, prompt=ids, logprobs=2, **greedy).choices[0].logprobs
    assert lp is not None and alone is not None and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    assert len(lp.tokens) == len(ids) + len(alone.tokens)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    offline = LLM(MODEL).generate([ids], SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2))[0]
    assert offline.prompt_logprobs is not None
    want = [None] + [e[t] for e, t in zip(offline.prompt_logprobs[1:], ids[1:], strict=True)]  # type: ignore[index]
    assert lp.token_logprobs[:len(ids)] == pytest.approx(want)
    assert lp.token_logprobs[len(ids):] == pytest.approx(alone.token_logprobs)
    text = with_lps.choices[0].text
    assert [text[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens, strict=True)] == lp.tokens
    streamed = "".join(ch.text for chunk in c.completions.create(model=MODEL, prompt="the sky is", echo=True,
                                                                  stream=True, **greedy) for ch in chunk.choices)
    assert streamed == echoed.choices[0].text
    # max_tokens 0: the prompt scored, nothing generated (a likelihood evaluation's request)
    scored = c.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=2, max_tokens=0)
    s_lp = scored.choices[0].logprobs
    assert s_lp is not None and s_lp.token_logprobs is not None
    assert s_lp.token_logprobs == pytest.approx(want) and scored.choices[0].finish_reason == "length"
    assert scored.usage is not None and scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids)
    chunks = list(c.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=2, max_tokens=0, stream=True))
    assert [ch.choices[0].finish_reason for ch in chunks] == ["length"]
    status, reply = http(served.url + "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0})
    assert status == 400 and "max_tokens" in reply["error"]["message"]  # (without echo: nothing to return)


def test_logit_bias_and_penalties_through_the_openai_client(served: Served) -> None:
    """OpenAI's ``logit_bias``, ``presence_penalty`` and ``frequency_penalty`` and vLLM's
    ``repetition_penalty`` and ``min_p`` reach the sampler: a +100 bias forces its token, and a
    strong frequency penalty keeps greedy decoding from repeating a token."""
    c = served.client
    forced = c.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0,
                                  logit_bias={"65": 100}, logprobs=0)
    assert forced.choices[0].logprobs is not None
    assert forced.choices[0].logprobs.tokens == [served.engine_thread.engine.tokenizer.decode([65])] * 4  # type: ignore[union-attr]
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                     temperature=0, logit_bias={"65": 100})
    assert chat.choices[0].message.content == served.engine_thread.engine.tokenizer.decode([65] * 3)  # type: ignore[union-attr]
    plain = c.completions.create(model=MODEL, prompt=[9, 10, 11], max_tokens=24, temperature=0,
                                 extra_body={"ignore_eos": True}, logprobs=0)
    tokens = plain.choices[0].logprobs.tokens  # type: ignore[union-attr]
    assert tokens is not None and len(set(tokens)) < len(tokens), "greedy decoding repeats itself here"
    penalized = c.completions.create(model=MODEL, prompt=[9, 10, 11], max_tokens=24, temperature=0,
                                     frequency_penalty=2, presence_penalty=2, extra_body={"ignore_eos": True})
    assert penalized.choices[0].text != plain.choices[0].text
    for body in ({"repetition_penalty": 1.3}, {"min_p": 0.2, "temperature": 1.0, "seed": 1}):
        r = c.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body=body)
        assert r.usage is not None and r.usage.completion_tokens == 4


def test_unsupported_fields_at_their_defaults_are_accepted(served: Served) -> None:
    """What clients send when the user asked for nothing: served, not refused."""
    neutral = {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "best_of": 1, "echo": False,
               "user": "someone"}
    status, reply = http(served.url + "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, **neutral})
    assert status == 200, reply
    status, reply = http(served.url + "/v1/chat/completions",
                         {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                          "response_format": {"type": "text"}, "tools": [], "tool_choice": "none"})
    assert status == 200, reply


def test_errors_through_the_client_and_server_keeps_serving(served: Served) -> None:
    with pytest.raises(openai.BadRequestError, match="n must be in"):
        served.client.completions.create(model=MODEL, prompt="hi", n=0)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                              temperature=-1, stream=True)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        served.client.completions.create(model="gpt-9", prompt="hi")
    status, reply = http(served.url + "/v1/completions", raw=b"{not json")
    assert status == 400 and "the request body is not valid JSON" in reply["error"]["message"]
    assert "at character 1" in reply["error"]["message"]
    status, reply = http(served.url + "/v1/nothing-here")
    assert status == 404 and "error" in reply
    r = served.client.completions.create(model=MODEL, prompt="still alive?", max_tokens=3)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_models_health_and_metrics(served: Served) -> None:
    assert [m.id for m in served.client.models.list()] == [MODEL]
    assert http(served.url + "/health") == (200, {"status": "ok"})
    from coserve import __version__
    assert http(served.url + "/version") == (200, {"version": __version__})
    served.client.completions.create(model=MODEL, prompt="count me", max_tokens=3)
    http(served.url + "/v1/completions", {"prompt": "hi", "n": 0})
    status, text = http(served.url + "/metrics")
    assert status == 200
    for name in ('coserve_requests_total{endpoint="/v1/completions"}', "coserve_request_errors_total",
                 "coserve_time_to_first_token_seconds_count", "coserve_time_per_output_token_seconds_count",
                 "coserve_num_requests_running", "coserve_num_requests_waiting"):
        assert name in text, name
    assert "coserve_finetune" not in text and "coserve_slo_requests" not in text


def test_an_unhandled_error_is_counted_as_a_500(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    def errors(text: str) -> float:
        found = re.search(r'coserve_request_errors_total\{endpoint="/tokenize",status="500"\} (\S+)', text)
        return float(found.group(1)) if found else 0.0

    before = errors(http(served.url + "/metrics")[1])
    tokenizer = served.engine_thread.engine.tokenizer

    def broken(*args: Any, **kwargs: Any) -> list[int]:
        raise RuntimeError("a bug in the tokenizer")

    monkeypatch.setattr(tokenizer, "encode", broken)
    assert http(served.url + "/tokenize", {"prompt": "hi"})[0] == 500
    monkeypatch.undo()
    assert errors(http(served.url + "/metrics")[1]) == before + 1


def test_a_stream_whose_client_leaves_is_aborted(served: Served) -> None:
    """The client reads the first chunk of a long stream and hangs up: the engine stops the
    request (it would otherwise decode up to 1,500 tokens for nobody) and the running gauge says
    so while the engine sits idle."""
    host, port = served.url.removeprefix("http://").split(":")
    conn = HTTPConnection(host, int(port), timeout=30)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1500, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    reply = conn.getresponse()
    assert reply.status == 200 and reply.fp.readline()  # the first chunk's size line
    conn.close()
    steps = len(served.batch_sizes)
    deadline = time.monotonic() + 20
    running = None
    while time.monotonic() < deadline:
        _, text = http(served.url + "/metrics")
        running = next(float(line.split()[1]) for line in text.splitlines()
                       if line.startswith("coserve_num_requests_running"))
        if running == 0.0:
            break
        time.sleep(0.1)
    assert running == 0.0, "the request still runs after its client left"
    assert len(served.batch_sizes) - steps < 1000, "it decoded to the end"


def random_adapter(engine: LLMEngine, path: Path, seed: int) -> Path:
    """A PEFT adapter for ``engine``'s model with random A and B (it changes the output)."""
    cfg = engine.model_config
    adapter = new_lora_adapter(num_layers=cfg.num_layers, shapes=cfg.linear_shapes(), rank=8, alpha=16.0,
                               target_modules=("q_proj", "v_proj", "down_proj"), seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    save_peft_adapter(replace(adapter, weights={k: (a, torch.randn(b.shape, generator=gen))
                                                for k, (a, b) in adapter.weights.items()}), path)
    return path


def test_adapters_are_served_under_their_own_model_names(tmp_path: Path) -> None:
    """``--lora-modules``: a request naming an adapter runs with it, and gets the tokens the offline
    API gives with that adapter; the base model's requests beside it stay the base model's."""
    engine = LLMEngine(EngineConfig(model=MODEL, device="cpu"))
    random_adapter(engine, tmp_path / "mine", seed=1)
    prompt = "the adapter says"
    params = SamplingParams(max_tokens=8, temperature=0.0)
    offline = LLM(MODEL)
    want_base = offline.generate([prompt], params)[0].outputs[0].token_ids
    want_mine = offline.generate([prompt], params, lora_request=LoRARequest("mine", str(tmp_path / "mine")))[0]
    assert want_mine.outputs[0].token_ids != want_base, "the adapter changes nothing: a test that cannot fail"
    with serve(engine, adapters={"mine": str(tmp_path / "mine")}) as s:
        cards = {m.id: m for m in s.client.models.list()}
        assert list(cards) == [MODEL, "mine"] and cards["mine"].parent == MODEL  # type: ignore[attr-defined]
        assert s.client.models.retrieve("mine") == cards["mine"]
        with pytest.raises(openai.NotFoundError, match="no model 'other' is served"):
            s.client.models.retrieve("other")
        kw: dict[str, Any] = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0}
        with ThreadPoolExecutor(2) as pool:  # side by side, in the same steps
            base, mine = pool.map(lambda m: s.client.completions.create(model=m, **kw), [MODEL, "mine"])
        assert mine.model == "mine" and base.model == MODEL
        assert mine.choices[0].text == want_mine.outputs[0].text
        assert base.choices[0].text == offline.generate([prompt], params)[0].outputs[0].text
        chat = s.client.chat.completions.create(model="mine", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4)
        assert chat.model == "mine"
        with pytest.raises(openai.NotFoundError, match="'tiny', 'mine'"):
            s.client.completions.create(model="theirs", prompt="hi")


def test_a_whole_completion_whose_client_leaves_is_aborted(served: Served) -> None:
    """Not streamed: the client sends a long request and hangs up without waiting; the engine
    stops it (the handler watches for the client's disconnect) instead of decoding 1,500 tokens."""
    steps = len(served.batch_sizes)
    sock = socket.create_connection(served.url.removeprefix("http://").split(":"), timeout=10)  # type: ignore[arg-type]
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1500, "ignore_eos": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 10
    while len(served.batch_sizes) - steps < 3 and time.monotonic() < deadline:  # it is being decoded
        time.sleep(0.01)
    sock.close()
    deadline = time.monotonic() + 20
    while served.engine_thread.stats.num_running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert served.engine_thread.stats.num_running == 0, "the request still runs after its client left"
    assert len(served.batch_sizes) - steps < 1000, "it decoded to the end"


def test_adapters_loaded_and_unloaded_at_run_time(tmp_path: Path, served: Served) -> None:
    """``--allow-runtime-lora``: an adapter loaded while serving is served by name at once, with the
    tokens it gives from start-up; one in use cannot be unloaded; an unloaded one is gone, and its
    name can be loaded again from another directory. Without the flag the routes are refused."""
    status, reply = http(served.url + "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
    assert status == 404 and "--allow-runtime-lora" in reply["error"]["message"]
    engine = LLMEngine(EngineConfig(model=MODEL, device="cpu"))
    first, second = random_adapter(engine, tmp_path / "a", seed=1), random_adapter(engine, tmp_path / "b", seed=2)
    kw: dict[str, Any] = {"prompt": "the adapter says", "max_tokens": 6, "temperature": 0.0}
    offline = LLM(MODEL)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    want = {p.name: offline.generate([kw["prompt"]], params, lora_request=LoRARequest(p.name, str(p)))[0]
            .outputs[0].text for p in (first, second)}
    assert want["a"] != want["b"]
    with serve(engine, runtime_lora=True) as s:
        load = s.url + "/v1/load_lora_adapter"
        assert http(load, {"lora_name": "mine", "lora_path": str(first)}) == (200, {"status": "loaded", "lora_name": "mine"})
        assert http(load, {"lora_name": "mine", "lora_path": str(first)})[1]["status"] == "already loaded"
        status, reply = http(load, {"lora_name": "mine", "lora_path": str(second)})
        assert status == 409 and "unload it first" in reply["error"]["message"]
        status, reply = http(load, {"lora_name": "bad", "lora_path": str(tmp_path / "none")})
        assert status == 400 and "does not exist" in reply["error"]["message"]
        assert http(load, {"lora_name": MODEL, "lora_path": str(first)})[0] == 400
        assert [m.id for m in s.client.models.list()] == [MODEL, "mine"]
        assert s.client.completions.create(model="mine", **kw).choices[0].text == want["a"]
        # in use: a long request on it holds it
        conn = HTTPConnection(*s.url.removeprefix("http://").split(":"), timeout=30)  # type: ignore[arg-type]
        conn.request("POST", "/v1/completions", body=json.dumps({"model": "mine", "prompt": "x", "max_tokens": 1500,
                                                                   "ignore_eos": True, "stream": True}),
                     headers={"Content-Type": "application/json"})
        assert conn.getresponse().fp.readline()
        status, reply = http(s.url + "/v1/unload_lora_adapter", {"lora_name": "mine"})
        assert status == 409 and "in use" in reply["error"]["message"]
        conn.close()
        deadline = time.monotonic() + 20
        while True:
            status, reply = http(s.url + "/v1/unload_lora_adapter", {"lora_name": "mine"})
            if status != 409 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert (status, reply) == (200, {"status": "unloaded", "lora_name": "mine"})
        assert http(s.url + "/v1/unload_lora_adapter", {"lora_name": "mine"})[0] == 404
        with pytest.raises(openai.NotFoundError):
            s.client.completions.create(model="mine", **kw)
        assert http(load, {"lora_name": "mine", "lora_path": str(second)})[0] == 200
        assert s.client.completions.create(model="mine", **kw).choices[0].text == want["b"]


def test_coserving_trains_while_serving(tmp_path: Path) -> None:
    engine = LLMEngine(EngineConfig(model=MODEL, device="cpu", num_training_slots=1, max_lora_rank=8))
    spec = FinetuneSpec(data=DATA, output=tmp_path / "out", lora=LoRAConfig(rank=8, alpha=16),
                        optim=OptimConfig(lr=1e-3), coserve=CoServeConfig(backward_tokens=32, max_seq_len=64),
                        trainer_threads=1, save_every=0)
    session = FinetuneSession(engine, spec)
    engine.lora_manager.bind_training_slot("live")  # --finetune-name live
    with serve(engine, session, adapters={"live": "(training)"}) as s:
        deadline = time.monotonic() + 40
        served_requests = 0
        while s.engine_thread.stats.ft_optimizer_steps < 1 and time.monotonic() < deadline:
            r = s.client.completions.create(model=MODEL, prompt="What is the capital?", max_tokens=4)
            assert r.usage is not None and r.usage.completion_tokens >= 1
            served_requests += 1
        assert s.engine_thread.stats.ft_optimizer_steps >= 1, "no optimizer step while serving"
        assert served_requests >= 1
        # the adapter being trained, served under its own name beside the training
        live = s.client.completions.create(model="live", prompt="What is the capital?", max_tokens=4)
        assert live.model == "live" and live.usage is not None and live.usage.completion_tokens >= 1
        assert "live" in [m.id for m in s.client.models.list()]
        _, text = http(s.url + "/metrics")
        assert "coserve_finetune_optimizer_steps_total" in text
        for name in ("coserve_finetune_loss", "coserve_finetune_failed 0.0", "coserve_finetune_trainer_restarts_total",
                     "coserve_slo_requests_total"):
            assert name in text, name
        assert "coserve_finetune_tokens_trained_total" in text
        # what the progress lines read: requests answered, the samples of all epochs, the first loss
        answered = re.search(r"coserve_requests_served_total ([0-9.]+)", text)
        assert answered is not None and float(answered.group(1)) == served_requests + 1  # (+ the "live" one)
        stats = s.engine_thread.stats
        assert stats.ft_samples_total == 64 and 0 < stats.ft_samples_retired <= 64  # tiny_facts: 64 rows, one epoch
        assert stats.ft_first_loss is not None and stats.ft_loss is not None
        # why steps did or did not carry FT rows: at least some had rows added
        assert 'coserve_finetune_admission_steps_total{outcome="added",step=' in text
        # the trainer worked on tasks (and its paused time is reported too)
        working = re.search(r'coserve_finetune_trainer_seconds_total\{state="working"\} ([0-9.e+-]+)', text)
        assert working is not None and float(working.group(1)) > 0.0
        assert 'coserve_finetune_trainer_seconds_total{state="paused"}' in text
        # the latency model's error on the steps it priced, per step kind: a histogram whose +Inf
        # bucket counts them all
        steps = re.findall(r'coserve_latency_model_relative_error_count\{step="([a-z/]+)"\} ([0-9.e+]+)', text)
        assert steps and sum(float(n) for _, n in steps) > 0
        assert all(k.split("/")[0] in ("prefill", "decode") and k.split("/")[2] in ("busy", "idle") for k, _ in steps)
        assert 'coserve_latency_model_relative_error_bucket{le="0.1",step=' in text
    assert (tmp_path / "out" / "adapter" / "adapter_config.json").is_file(), "exported at shutdown"
    assert s.engine_thread.stats.adapter_path is not None
    assert engine.coserver is None, "the session was closed"


def test_submit_after_shutdown_fails_cleanly() -> None:
    from coserve.engine.sampling_params import SamplingParams
    from coserve.server.engine_thread import EngineDeadError

    et = EngineThread(LLMEngine(EngineConfig(model=MODEL, device="cpu"))).start()

    async def scenario() -> None:
        outs = [o async for o in et.submit([1, 2, 3], SamplingParams(max_tokens=2))]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 2
        with pytest.raises(ValueError, match="vocabulary"):
            await et.submit([10**9], SamplingParams(max_tokens=2)).get()
        et.shutdown()
        with pytest.raises(EngineDeadError):
            await et.submit([1, 2, 3], SamplingParams(max_tokens=2)).get()

    asyncio.run(scenario())


def test_with_an_api_key_the_v1_routes_need_it() -> None:
    with serve(LLMEngine(EngineConfig(model=MODEL, device="cpu")), api_key="s3cret") as s:
        r = s.client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert r.usage is not None and r.usage.completion_tokens == 2
        for key in ("wrong", "s3cre"):
            other = openai.OpenAI(base_url=f"{s.url}/v1", api_key=key, max_retries=0, timeout=30)
            with pytest.raises(openai.AuthenticationError, match="a valid API key is needed"):
                other.models.list()
        status, reply = http(s.url + "/v1/chat/completions", {"model": MODEL, "messages": []})
        assert status == 401 and reply["error"]["type"] == "authentication_error"
        assert http(s.url + "/health")[0] == 200 and http(s.url + "/metrics")[0] == 200
        assert http(s.url + "/tokenize", {"prompt": "hi"})[0] == 401


def test_tokenize_and_detokenize_as_vllm_gives_them(served: Served) -> None:
    engine = served.engine_thread.engine
    assert engine.tokenizer is not None
    status, reply = http(served.url + "/tokenize", {"model": MODEL, "prompt": "Where is the candle?"})
    assert status == 200 and reply["tokens"] == engine.tokenizer.encode("Where is the candle?")
    assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] == engine.max_model_len
    messages = [{"role": "user", "content": "Where is the candle?"}]
    status, chat = http(served.url + "/tokenize", {"messages": messages})
    r = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert status == 200 and r.usage is not None and chat["count"] == r.usage.prompt_tokens, "what chat runs"
    status, text = http(served.url + "/detokenize", {"tokens": reply["tokens"]})
    assert status == 200 and text["prompt"] == engine.tokenizer.decode(reply["tokens"], skip_special_tokens=False)
    for path, body, needle in (("/tokenize", {}, "either prompt or messages"),
                               ("/tokenize", {"prompt": "x", "messages": messages}, "either prompt or messages"),
                               ("/tokenize", {"prompt": "x", "model": "nope"}, "does not exist"),
                               ("/detokenize", {"tokens": [10**9]}, "outside the vocabulary"),
                               ("/detokenize", {"tokens": ["a"]}, "tokens")):
        status, reply = http(served.url + path, body)
        assert status in (400, 404) and needle in reply["error"]["message"], (path, reply)


def test_a_repeated_prompt_prefix_is_served_from_the_cache_and_counted() -> None:
    """``coserve serve``'s default: a second request that starts with the first's prompt reuses its
    KV (the same answer) and /metrics counts the tokens found."""
    system = "You are a helpful assistant who answers in one short sentence about the weather. "
    with serve(LLMEngine(EngineConfig(model=MODEL, device="cpu", enable_prefix_caching=True))) as s:
        kw: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "temperature": 0.0}
        first = s.client.completions.create(prompt=system + "Is it raining?", **kw).choices[0].text
        second = s.client.completions.create(prompt=system + "Is it raining?", **kw).choices[0].text
        s.client.completions.create(prompt=system + "Is it sunny?", **kw)
        _, text = http(s.url + "/metrics")
    assert second == first
    values = dict(line.split() for line in text.splitlines() if line.startswith("coserve_prefix_cache_"))
    queried, hits = float(values["coserve_prefix_cache_queries_total"]), float(values["coserve_prefix_cache_hits_total"])
    assert 0 < hits < queried, text

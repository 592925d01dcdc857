"""Bad input never crashes the server: seeded random malformed bodies on every POST route (valid
ones with one to three fields replaced by odd values of every JSON type) each get an answer below
500, and the server stays healthy."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.server.job_board import JobsConfig
from tests.server.test_api import MODEL, http, serve
from tests.server.test_finetune_api import TEMPLATE

ODD: list[Any] = [None, True, False, 0, -1, 1, 2**40, -(2**40), 1.5, 1e308, -1e308, "", "x", MODEL, " ", "\x00", "é",
                  [], [1], [-1], ["a"], [[1]], {}, {"a": 1}, [{"role": "user", "content": "hi"}], [{"role": "user"}],
                  [{"role": "bogus", "content": "x"}], [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
                  [1, 2, 3], [999999], list(range(50)), {"type": "json_object"}, [{"type": "function"}], 100, 10**6]
ROUTES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "/v1/completions": ({"model": MODEL, "prompt": "hi", "max_tokens": 2}, [
        "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "logprobs", "echo", "stop", "seed",
        "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "stream_options",
        "ignore_eos", "best_of", "suffix", "user", "prompt_logprobs", "min_tokens"]),
    "/v1/chat/completions": ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, [
        "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "logprobs",
        "top_logprobs", "stop", "seed", "logit_bias", "tools", "response_format", "stream_options", "tool_choice",
        "user", "add_generation_prompt", "continue_final_message"]),
    "/tokenize": ({"prompt": "hi"}, ["model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"]),
    "/detokenize": ({"tokens": [1, 2]}, ["model", "tokens"]),
    "/v1/fine_tuning/jobs": ({"model": MODEL, "training_file": "file-x"}, [
        "model", "training_file", "hyperparameters", "suffix", "seed", "validation_file", "method", "integrations",
        "metadata"]),
    "/v1/load_lora_adapter": ({"lora_name": "a", "lora_path": "/nonexistent"}, ["lora_name", "lora_path"]),
    "/v1/unload_lora_adapter": ({"lora_name": "a"}, ["lora_name"]),
}


def test_random_malformed_requests_get_an_answer_below_500(tmp_path: Path) -> None:
    rng = random.Random(0)
    engine = LLMEngine(EngineConfig(model=MODEL, device="cpu", num_training_slots=1, max_lora_rank=8,
                                    enable_prefix_caching=True))
    failures = []
    with serve(engine, jobs=JobsConfig(tmp_path, TEMPLATE), runtime_lora=True) as s:
        for _ in range(300):
            route = rng.choice(list(ROUTES))
            valid, fields = ROUTES[route]
            body = dict(valid)
            for _ in range(rng.randint(1, 3)):
                body[rng.choice(fields)] = rng.choice(ODD)
            status, answer = http(s.url + route, body)
            if status >= 500:
                failures.append((route, body, status, str(answer)[:200]))
        for path in ("/v1/fine_tuning/jobs/%00", "/v1/fine_tuning/jobs/x/events?limit=0", "/v1/fine_tuning/jobs?limit=-1",
                     "/v1/files/..%2F..%2Fetc", "/v1/models/%2e%2e", "/v1/fine_tuning/jobs/x/checkpoints?after=z"):
            status, answer = http(s.url + path)
            if status >= 500:
                failures.append((path, None, status, str(answer)[:200]))
        assert http(s.url + "/health") == (200, {"status": "ok"})
    assert not failures, failures[:5]

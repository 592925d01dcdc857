"""Open-loop replay of a workload against an OpenAI-compatible server over HTTP.

The HTTP counterpart of :class:`coserve.bench.replay.InProcessDriver`: each arrival is sent at its
workload time on a monotonic clock (a slow server delays no later arrival: they go out on time, on
connections of their own) as a streamed ``/v1/completions`` request of its prompt length, in
random token ids, decoding exactly its output length (``ignore_eos``, which coserve and vLLM take),
and comes back as the same :class:`RequestRecord` (first streamed token, last token, counts). A
request the server refuses or drops has no first token: it counts as a miss, and its error is kept.

It measures any server that speaks the protocol (``coserve serve``, vLLM, ...) with the traces and
SLOs of the evaluation (``coserve bench-http``).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from coserve.bench.metrics import RequestRecord
from coserve.bench.replay import ReplayResult
from coserve.bench.workload import Arrival


@dataclass
class HttpReplay:
    """A replay's result, with the errors of the requests that did not finish (by arrival index).
    ``interrupted``: Ctrl-C stopped it; the result holds the requests sent until then."""

    result: ReplayResult
    errors: dict[int, str] = field(default_factory=dict)
    interrupted: bool = False


class HttpDriver:
    """Sends ``arrivals`` to the server at ``base_url`` (``http://host:port``) as model ``model``.

    Prompts are random token ids in ``[low_token, vocab_size)`` (seeded per request index, as the
    in-process driver's): every model has ``vocab_size=1000`` tokens, pass the model's own for
    realistic ids."""

    def __init__(self, base_url: str, model: str, *, seed: int = 0, vocab_size: int = 1000, low_token: int = 10,
                 timeout_s: float = 600.0, temperature: float = 0.0, api_key: str | None = None) -> None:
        if vocab_size <= low_token:
            raise ValueError(f"vocab_size must exceed low_token ({low_token}), got {vocab_size}")
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"--url {base_url}: give the scheme, e.g. http://{base_url}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.seed = seed
        self.vocab_size = vocab_size
        self.low_token = low_token
        self.timeout_s = timeout_s
        self.temperature = temperature
        # (sent as OpenAI clients send it: a server started with an API key needs it)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # (time.monotonic() at the running replay's time 0: what other threads date events by)
        self.t0: float | None = None

    def prompt(self, i: int, n: int) -> list[int]:
        rng = random.Random(self.seed * 1_000_003 + i)
        return [rng.randrange(self.low_token, self.vocab_size) for _ in range(max(1, n))]

    def body(self, i: int, a: Arrival) -> dict[str, Any]:
        return {"model": self.model, "prompt": self.prompt(i, a.prompt_tokens), "max_tokens": max(1, a.output_tokens),
                "temperature": self.temperature, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}

    def check(self) -> int | None:
        """Ask the server's ``/v1/models`` before a replay whose every request would fail: a
        ValueError that says why where the server cannot be reached, refuses the API key or does
        not serve the model. Returns the model's context in tokens where the server gives it
        (``max_model_len``: coserve, vLLM), else None; a server without ``/v1/models`` (404) or
        with a list of another form is taken on trust."""
        import httpx

        try:
            reply = httpx.get(f"{self.base_url}/v1/models", timeout=30.0, headers=self.headers)
        except httpx.HTTPError as e:
            raise ValueError(f"--url {self.base_url}: cannot reach the server ({type(e).__name__}: {e}); "
                             "is it running, and are the host and port right?") from None
        if reply.status_code in (401, 403):
            raise ValueError(f"--url {self.base_url}: the server refused the API key (HTTP {reply.status_code} on "
                             "/v1/models): give its key with --api-key or $OPENAI_API_KEY")
        if reply.status_code == 404:
            return None
        if reply.status_code != 200:
            raise ValueError(f"--url {self.base_url}: GET /v1/models answered HTTP {reply.status_code}: "
                             f"{reply.text[:300]!r}")
        try:
            cards = [c for c in reply.json()["data"] if isinstance(c, dict)]
        except (ValueError, KeyError, TypeError):
            return None
        served = {str(c.get("id")): c for c in cards}
        if self.model not in served:
            raise ValueError(f"--model {self.model}: the server at {self.base_url} does not serve it; it serves "
                             f"{', '.join(sorted(served)) or 'no model'}")
        context = served[self.model].get("max_model_len")
        return int(context) if isinstance(context, int) else None

    def context(self) -> int | None:
        """The model's context in tokens as ``/v1/models`` gives it; None where the server does
        not say, cannot be reached or does not serve the model (:meth:`check` says why)."""
        try:
            return self.check()
        except ValueError:
            return None

    def run(self, arrivals: Sequence[Arrival], *, duration_s: float, drain_s: float = 30.0) -> HttpReplay:
        """Replay the arrivals in ``[0, duration_s)``, then wait for the ones in flight (at most
        ``drain_s``; those still running then count as unfinished)."""
        return asyncio.run(self._run([a for a in arrivals if a.time_s < duration_s], duration_s, drain_s))

    async def _run(self, todo: list[Arrival], duration_s: float, drain_s: float) -> HttpReplay:
        import httpx  # (the server extra: only this driver needs it)

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(self.timeout_s, connect=30.0)
        records: list[RequestRecord | None] = [None] * len(todo)
        errors: dict[int, str] = {}
        async with httpx.AsyncClient(base_url=self.base_url, limits=limits, timeout=timeout,
                                     headers=self.headers) as client:
            t0 = self.t0 = time.monotonic()

            async def one(i: int, a: Arrival) -> None:
                await asyncio.sleep(max(0.0, a.time_s - (time.monotonic() - t0)))
                first = last = None
                tokens = chunks = 0
                completed = False
                try:
                    async with client.stream("POST", "/v1/completions", json=self.body(i, a)) as reply:
                        if reply.status_code != 200:
                            errors[i] = f"HTTP {reply.status_code}: {(await reply.aread())[:300]!r}"
                            return
                        async for line in reply.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            event = json.loads(line[6:])
                            now = time.monotonic() - t0
                            if event.get("choices"):
                                chunks += 1
                                first = now if first is None else first
                                last = now
                            if event.get("usage"):
                                tokens = int(event["usage"]["completion_tokens"])
                    completed = True
                except (httpx.HTTPError, ValueError) as e:
                    errors[i] = f"{type(e).__name__}: {e}"
                finally:  # (also when the drain's end cancels it: then it did not finish)
                    finished = completed and first is not None
                    records[i] = RequestRecord(a.time_s, first if finished else None, last if finished else None,
                                               a.prompt_tokens, (tokens or chunks) if finished else 0)

            tasks = [asyncio.create_task(one(i, a)) for i, a in enumerate(todo)]
            interrupted = False
            try:
                await asyncio.sleep(max(0.0, duration_s - (time.monotonic() - t0)))
                if tasks:
                    await asyncio.wait(tasks, timeout=drain_s)
            except asyncio.CancelledError:  # Ctrl-C: asyncio.run cancels this task
                interrupted = True
                current = asyncio.current_task()
                if current is not None:
                    current.uncancel()
            elapsed = time.monotonic() - t0
            for t in tasks:
                t.cancel()
            # NOTE: every task is awaited here, while the client is open: a task left to the loop's
            # shutdown failed on the closed client and printed "Task exception was never retrieved"
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, Exception):
                errors.setdefault(i, f"{type(outcome).__name__}: {outcome}")
        out = [r if r is not None else RequestRecord(a.time_s, None, None, a.prompt_tokens, 0)
               for r, a in zip(records, todo, strict=True)]
        unfinished = "interrupted (Ctrl-C) before it finished" if interrupted else \
            f"not finished within the {drain_s:g} s drain"
        for i, r in enumerate(out):
            if r.finish_s is None:
                errors.setdefault(i, unfinished)
        if interrupted:  # (the requests not sent yet are left out, not counted as misses)
            sent = [i for i, a in enumerate(todo) if a.time_s <= elapsed]
            out = [out[i] for i in sent]
            errors = {j: errors[i] for j, i in enumerate(sent) if i in errors}
        return HttpReplay(ReplayResult(out, elapsed, sum(r.output_tokens for r in out), 0), errors, interrupted)

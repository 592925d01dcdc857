"""The OpenAI-compatible HTTP API in front of an :class:`EngineThread`.

``create_app`` serves ``POST /v1/completions`` and ``POST /v1/chat/completions`` (whole
responses, or ``stream: true`` as server-sent events ending with ``data: [DONE]``),
``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus). Tokenization and
chat templates run here, on the server's event loop, never on the engine thread. A user
mistake is a 400 with an OpenAI error body that says what is wrong, never a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from coserve import __version__
from coserve.core.coserver import ERROR_BUCKETS
from coserve.core.finetune import FTDataset
from coserve.engine.outputs import RequestOutput
from coserve.engine.sampling_params import SamplingParams
from coserve.engine.sequence import LoRARequest
from coserve.models.peft_adapter import LoraAdapter
from coserve.server.dataset_reader import DatasetReader
from coserve.server.engine_thread import EngineDeadError, EngineThread, RequestHandle
from coserve.server.files import FileStore, add_file_routes
from coserve.server.finetune import read_dataset
from coserve.server.finetune_jobs import FinetuneJob, add_finetune_job_routes
from coserve.server.job_board import JobBoard, JobsConfig
from coserve.server.progress import RequestCounts
from coserve.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    LoadAdapterRequest,
    TokenizeRequest,
    UnloadAdapterRequest,
    Usage,
)
from coserve.server.tool_calls import PARSERS, Parsed, template_messages
from coserve.trainer.spare import prepare_for as prepare_spare

logger = logging.getLogger(__name__)


class _EngineCollector(Collector):
    """Reads the engine thread's published snapshot at scrape time."""

    def __init__(self, engine_thread: EngineThread) -> None:
        self.engine_thread = engine_thread

    def collect(self) -> Iterable[Metric]:
        s = self.engine_thread.stats
        yield GaugeMetricFamily("coserve_num_requests_running", "Requests being decoded.", s.num_running)
        yield GaugeMetricFamily("coserve_num_requests_waiting", "Requests waiting to start.", s.num_waiting)
        if s.prefix_cache is not None:
            queried, hits = s.prefix_cache
            yield CounterMetricFamily("coserve_prefix_cache_queries", "Prompt tokens of admitted requests that "
                                      "could be cached.", queried)
            yield CounterMetricFamily("coserve_prefix_cache_hits", "Of those, tokens whose KV was found cached.", hits)
        if s.coserving:
            yield CounterMetricFamily("coserve_finetune_tokens_trained", "Fine-tuning tokens trained.",
                                      s.ft_tokens_trained)
            yield CounterMetricFamily("coserve_finetune_optimizer_steps", "Fine-tuning optimizer steps.",
                                      s.ft_optimizer_steps)
            yield CounterMetricFamily("coserve_finetune_trainer_restarts", "Trainer processes restarted after "
                                      "dying.", s.ft_trainer_restarts)
            yield GaugeMetricFamily("coserve_finetune_failed", "1 when fine-tuning gave up (serving goes on).",
                                    float(s.ft_failed))
            if s.ft_loss is not None:
                yield GaugeMetricFamily("coserve_finetune_loss", "Loss of the last optimizer step.", s.ft_loss)
            admission = CounterMetricFamily(
                "coserve_finetune_admission_steps", "Steps planned while fine-tuning, by step kind (inference, "
                "ft-only) and outcome: FT rows added, the task full, or why admission added none.",
                labels=["step", "outcome"])
            for (kind, outcome), n in sorted(s.ft_admission.items()):
                admission.add_metric([kind, outcome], n)
            yield admission
            trainer = CounterMetricFamily(
                "coserve_finetune_trainer_seconds", "The trainer's time on backward tasks: working, or paused "
                "while the engine ran steps that carry prefill.", labels=["state"])
            for state, seconds in sorted(s.ft_trainer_seconds.items()):
                trainer.add_metric([state], seconds)
            yield trainer
            errors = HistogramMetricFamily(
                "coserve_latency_model_relative_error", "How far the latency model that admission trusts was off: "
                "|predicted - measured| / measured of each step, predicted before it ran, by step kind "
                "(prefill or decode / graph or eager / busy beside the trainer or idle).", labels=["step"])
            for key, (counts, total) in sorted(s.ft_latency_errors.items()):
                cumulative = list(itertools.accumulate(counts))
                buckets = [*((str(le), n) for le, n in zip(ERROR_BUCKETS, cumulative, strict=False)),
                           ("+Inf", cumulative[-1])]
                errors.add_metric([key], buckets, total)
            yield errors


class _JobsCollector(Collector):
    """The fine-tuning jobs by status, at scrape time (on the event loop, as the board is)."""

    def __init__(self, board: JobBoard) -> None:
        self.board = board

    def collect(self) -> Iterable[Metric]:
        counts: dict[str, int] = {}
        for job in self.board.jobs.values():
            status = self.board.status(job) or self.board.stats(job).ft_outcome or "running"
            counts[status] = counts.get(status, 0) + 1
        jobs = GaugeMetricFamily("coserve_finetune_jobs", "Fine-tuning jobs of this server by status (queued, "
                                 "validating_files, running, paused, succeeded, failed, cancelled).", labels=["status"])
        for status, n in sorted(counts.items()):
            jobs.add_metric([status], n)
        yield jobs


class ServerMetrics:
    """One registry per app, so that several apps (tests) can live in one process."""

    def __init__(self, engine_thread: EngineThread) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("coserve_requests", "HTTP API requests.", ["endpoint"], registry=r)
        self.errors = Counter("coserve_request_errors", "HTTP API requests answered with an error.",
                              ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("coserve_prompt_tokens", "Prompt tokens of served requests.", registry=r)
        self.generation_tokens = Counter("coserve_generation_tokens", "Generated tokens.", registry=r)
        self.served = Counter("coserve_requests_served", "Requests answered to their end.", registry=r)
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
        self.ttft = Histogram("coserve_time_to_first_token_seconds", "Time to first token.", buckets=buckets,
                              registry=r)
        self.tpot = Histogram("coserve_time_per_output_token_seconds", "Time per output token after the first.",
                              buckets=buckets, registry=r)
        # While co-serving: finished requests by whether they met the SLOs fine-tuning must keep.
        self.slo = engine_thread.slo
        self.slo_requests = None if self.slo is None else Counter(
            "coserve_slo_requests", "Finished requests by whether their TTFT and TPOT met the co-serving SLOs.",
            ["result"], registry=r)
        r.register(_EngineCollector(engine_thread))

    def observe(self, out: RequestOutput) -> None:
        m, n = out.metrics, len(out.outputs[0].token_ids)
        if m.finish_time is not None:  # (None: aborted before its end)
            self.served.inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(n)
        if m.first_token_time is None:
            return
        ttft = m.first_token_time - m.arrival_time
        self.ttft.observe(ttft)
        tpot = (m.finish_time - m.first_token_time) / (n - 1) if m.finish_time is not None and n > 1 else None
        if tpot is not None:
            self.tpot.observe(tpot)
        if self.slo_requests is not None and self.slo is not None and m.finish_time is not None:
            met = ttft <= self.slo.ttft_slo_s and (tpot is None or tpot <= self.slo.tpot_slo_s)
            self.slo_requests.labels(result="met" if met else "missed").inc()

    def counts(self) -> RequestCounts:
        """The request counters since start, for the progress lines."""
        def value(name: str, **labels: str) -> int:
            return int(self.registry.get_sample_value(name, labels) or 0)

        return RequestCounts(value("coserve_requests_served_total"), value("coserve_generation_tokens_total"),
                             value("coserve_slo_requests_total", result="met"),
                             value("coserve_slo_requests_total", result="missed"))


# ---------------------------------------------------------------------- the app


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                        status_code=status)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":  # (loc: ("body", the character where decoding failed))
            where = err.get("loc", ())[-1:]
            reason = (err.get("ctx") or {}).get("error", "")
            parts.append(f"the request body is not valid JSON ({reason}{', ' if reason else ''}"
                         f"at character {where[0] if where else '?'})")
            continue
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request"


def _joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs, text_offset=a.text_offset + b.text_offset)


def _usage(outs: list[RequestOutput], n: int = 1, generated: bool = True) -> Usage:
    """The usage of a request's choices (``n`` per prompt, prompt-major): each prompt counted once;
    ``generated`` False: a scoring request's, whose one token is not returned."""
    p = sum(len(o.prompt_token_ids) for o in outs[::n])
    c = sum(len(o.outputs[0].token_ids) for o in outs) if generated else 0
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


def _sse(obj: BaseModel | str) -> str:
    return f"data: {obj if isinstance(obj, str) else obj.model_dump_json(exclude_none=True)}\n\n"


class ClientGone(Exception):
    """The client of a whole (not streamed) completion hung up before it was done."""


async def _disconnected(raw: Request) -> None:
    """Returns when the client of ``raw`` (whose body has been read) disconnects."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


class _Api:
    """The route handlers' shared state."""

    def __init__(self, engine_thread: EngineThread, model_name: str, adapters: dict[str, str] | None = None,
                 runtime_lora: bool = False, tool_parser: str | None = None) -> None:
        if tool_parser is not None and tool_parser not in PARSERS:
            raise ValueError(f"--tool-call-parser: choose from {', '.join(PARSERS)}, not {tool_parser!r}")
        self.tool_parser = tool_parser
        self.et = engine_thread
        self.model_name = model_name
        self.adapters = {name: LoRARequest(name, path) for name, path in (adapters or {}).items()}
        self.runtime_lora = runtime_lora
        self.metrics = ServerMetrics(engine_thread)
        self.tokenizer = engine_thread.engine.tokenizer
        self.max_model_len = engine_thread.engine.max_model_len

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter that ``model`` names (None: the base model, also when no model is given)."""
        if model is None or model == self.model_name:
            return None
        lora = self.adapters.get(model)
        if lora is None:
            served = ", ".join(repr(n) for n in (self.model_name, *self.adapters))
            raise HTTPException(404, f"the model {model!r} does not exist; this server serves {served}")
        return lora

    async def start(self, prompt: str | list[int], params: SamplingParams,
                    lora: LoRARequest | None = None) -> tuple[RequestHandle, RequestOutput]:
        """Submit and wait for the first output, so that a refused request is a 400, not a stream."""
        handle = self.et.submit(prompt, params, lora)
        try:
            return handle, await handle.get()
        except BaseException:
            if not handle.finished:
                self.et.abort(handle.request_id)
            raise

    async def finish_all(self, started: list[tuple[RequestHandle, RequestOutput]],
                         raw: Request | None) -> list[RequestOutput]:
        """:meth:`finish` of every choice; if the client hangs up first (``raw``'s next message is
        its disconnect: the body has been read), every choice is aborted and this raises
        :class:`ClientGone`, so that nobody's tokens are decoded for no one."""
        done = asyncio.ensure_future(asyncio.gather(*(self.finish(h, f) for h, f in started)))
        if raw is None:
            return await done
        gone = asyncio.ensure_future(_disconnected(raw))
        try:
            await asyncio.wait((done, gone), return_when=asyncio.FIRST_COMPLETED)
            if not done.done() and gone.exception() is not None:  # (no watch: just wait)
                return await done
        finally:
            gone.cancel()
            if not done.done():
                done.cancel()  # (each finish's own finally aborts its request)
                with contextlib.suppress(asyncio.CancelledError):
                    await done
        if done.cancelled():
            raise ClientGone("the client disconnected before the completion was done")
        return done.result()

    async def finish(self, handle: RequestHandle, out: RequestOutput) -> RequestOutput:
        try:
            while not out.finished:
                out = await handle.get()
        finally:
            if not handle.finished:
                self.et.abort(handle.request_id)
        self.metrics.observe(out)
        return out

    async def deltas(self, handle: RequestHandle, out: RequestOutput,
                     holdback: int) -> AsyncIterator[tuple[str, RequestOutput, int]]:
        """(new text, output, tokens before it) per engine output that brought new tokens or new
        text. ``holdback`` characters stay unsent until the end, because a stop string may still
        cut them off. A token whose text is empty or held back still makes a chunk (with empty
        text), as it does in vLLM: a stream's chunks follow the tokens as they come, so a
        client's TTFT and TPOT are the engine's (session 30, the 8B shape on the H100: its
        tokenizer, the tiny one, reads most generated ids as "", and 132 of 210 streams came in
        one chunk at their end)."""
        sent = sent_tokens = 0
        try:
            while True:
                text = out.outputs[0].text
                upto = len(text) if out.finished else max(sent, len(text) - holdback)
                if upto > sent or out.finished or len(out.outputs[0].token_ids) > sent_tokens:
                    yield text[sent:upto], out, sent_tokens
                    sent, sent_tokens = upto, len(out.outputs[0].token_ids)
                if out.finished:
                    break
                out = await handle.get()
        finally:
            if not handle.finished:
                self.et.abort(handle.request_id)
        self.metrics.observe(out)

    def logprobs(self, out: RequestOutput, start: int = 0, offset: int = 0) -> CompletionLogprobs | None:
        c = out.outputs[0]
        if c.logprobs is None:
            return None
        return self._logprobs(c.token_ids[start:], c.logprobs[start:], offset)

    def _logprobs(self, ids: Sequence[int], entries: Sequence[dict[int, float] | None],
                  offset: int) -> CompletionLogprobs | None:
        """The completions route's ``logprobs`` of tokens ``ids`` (an entry None: a token nothing
        predicts, the prompt's first), their text starting at character ``offset``."""
        if self.tokenizer is None:
            return None
        tok = self.tokenizer
        tokens, lps, tops, offsets = [], [], [], []
        for tid, entry in zip(ids, entries, strict=False):
            s = tok.decode([tid], skip_special_tokens=False)
            offsets.append(offset)
            offset += len(s)
            tokens.append(s)
            lps.append(None if entry is None else entry.get(tid))
            tops.append(None if entry is None else
                        {tok.decode([t], skip_special_tokens=False): lp for t, lp in entry.items()})
        return CompletionLogprobs(tokens=tokens, token_logprobs=lps, top_logprobs=tops, text_offset=offsets)

    def echoed(self, prompt: str | list[int], out: RequestOutput) -> tuple[str, CompletionLogprobs | None]:
        """``echo``: the prompt's text (as sent, or its ids decoded) and its tokens' logprobs
        (None unless the request asked for logprobs)."""
        text = prompt if isinstance(prompt, str) else (
            self.tokenizer.decode(prompt, skip_special_tokens=False) if self.tokenizer is not None else "")
        lps = out.prompt_logprobs
        return text, (self._logprobs(out.prompt_token_ids, lps, 0) if lps is not None else None)

    async def start_all(self, prompts: list[list[int]], params: SamplingParams, n: int,
                        lora: LoRARequest | None) -> list[tuple[RequestHandle, RequestOutput]]:
        """:meth:`start` for ``n`` choices of each prompt, all submitted at once (choice ``i·n + j``
        is prompt ``i``'s ``j``-th; with a seed, choice ``j`` samples with ``seed + j``). A refused
        one aborts the others and raises, naming its prompt when there are several."""
        jobs = [(i, p, params if n == 1 or params.seed is None else replace(params, seed=(params.seed + j) % 2**63))
                for i, p in enumerate(prompts) for j in range(n)]
        if len(jobs) == 1:
            return [await self.start(prompts[0], params, lora)]
        handles = [self.et.submit(p, prm, lora) for _, p, prm in jobs]
        try:
            firsts = await asyncio.gather(*(h.get() for h in handles), return_exceptions=True)
        except BaseException:
            self._abort(handles)
            raise
        for (i, *_), first in zip(jobs, firsts, strict=True):
            if isinstance(first, BaseException):
                self._abort(handles)
                if isinstance(first, ValueError) and len(prompts) > 1:
                    raise ValueError(f"prompt {i}: {first}") from first
                raise first
        return list(zip(handles, cast(list[RequestOutput], firsts), strict=True))

    def _abort(self, handles: list[RequestHandle]) -> None:
        for h in handles:
            if not h.finished:
                self.et.abort(h.request_id)

    async def merged_deltas(self, started: list[tuple[RequestHandle, RequestOutput]],
                            holdback: int) -> AsyncIterator[tuple[int, str, RequestOutput, int]]:
        """:meth:`deltas` of every choice as they come, each with its choice index. Leaving early
        (the client hung up) cancels every choice's reader, which aborts its request."""
        if len(started) == 1:
            async for delta, out, start in self.deltas(*started[0], holdback):
                yield 0, delta, out, start
            return
        queue: asyncio.Queue[tuple[int, str, RequestOutput, int] | BaseException | None] = asyncio.Queue()

        async def pump(i: int, handle: RequestHandle, first: RequestOutput) -> None:
            try:
                async for delta, out, start in self.deltas(handle, first, holdback):
                    queue.put_nowait((i, delta, out, start))
            except Exception as e:  # (a cancellation is this generator's own doing)
                queue.put_nowait(e)
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(i, h, f)) for i, (h, f) in enumerate(started)]
        try:
            left = len(tasks)
            while left:
                item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    def chat_logprobs(self, out: RequestOutput, k: int | None, start: int = 0) -> ChatLogprobs | None:
        """OpenAI's chat ``logprobs`` of ``out``'s tokens from ``start`` on: each token's, with the
        ``k`` most likely ones (None: none were asked for). ``bytes`` is the UTF-8 of the token's
        text (a token holding part of a character reads as U+FFFD, as in its text)."""
        c = out.outputs[0]
        if k is None or c.logprobs is None or self.tokenizer is None:
            return None
        tok = self.tokenizer

        def top(tid: int, lp: float) -> ChatTopLogprob:
            text = tok.decode([tid], skip_special_tokens=False)
            return ChatTopLogprob(token=text, logprob=lp, bytes=list(text.encode("utf-8")))

        content = []
        for tid, entry in zip(c.token_ids[start:], c.logprobs[start:], strict=False):
            best = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]
            t = top(tid, entry.get(tid, float("nan")))
            content.append(ChatTokenLogprob(**t.model_dump(), top_logprobs=[top(i, lp) for i, lp in best]))
        return ChatLogprobs(content=content)

    # ------------------------------------------------------------------ adapters at run time

    def _check_runtime_lora(self) -> None:
        if not self.runtime_lora:
            raise HTTPException(404, "loading adapters at run time is off: start the server with "
                                     "--allow-runtime-lora (it reads any path the server can)")

    async def load_adapter(self, req: LoadAdapterRequest) -> Response:
        """Read and check the adapter off the event loop, then register it between two steps;
        from then on requests may name it."""
        self._check_runtime_lora()
        name, path = req.lora_name, req.lora_path
        if name == self.model_name:
            raise ValueError(f"{name!r} is the base model's name; give the adapter another")
        known = self.adapters.get(name)
        if known is not None:
            if known.path == path:
                return JSONResponse({"status": "already loaded", "lora_name": name})
            raise HTTPException(409, f"adapter {name!r} is loaded from {known.path}; unload it first")
        manager = self.et.engine.lora_manager
        adapter = await asyncio.to_thread(manager.load, path)
        await self.et.call(lambda engine: engine.lora_manager.register(name, path, adapter))
        self.adapters[name] = LoRARequest(name, path)
        logger.info("loaded adapter %r from %s", name, path)
        return JSONResponse({"status": "loaded", "lora_name": name})

    async def unload_adapter(self, req: UnloadAdapterRequest) -> Response:
        """Forget an adapter no request uses any more (409 while one does)."""
        self._check_runtime_lora()
        name = req.lora_name
        lora = self.adapters.pop(name, None)  # (no new request can name it from here on)
        if lora is None:
            raise HTTPException(404, f"no adapter {name!r} is loaded")
        try:
            await self.et.call(lambda engine: engine.remove_lora(name))
        except ValueError as e:
            self.adapters[name] = lora
            raise HTTPException(409, str(e)) from e
        logger.info("unloaded adapter %r", name)
        return JSONResponse({"status": "unloaded", "lora_name": name})

    # ------------------------------------------------------------------ routes

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        lora = self.check_model(req.model)
        n = req.choices_per_prompt()
        # echo with max_tokens 0: the prompt scored, nothing generated (one token is, then dropped)
        score_only = req.echo and req.max_tokens == 0
        params = req.sampling_params(1 if score_only else req.max_tokens, 16, req.logprobs)
        if req.echo and req.logprobs is not None:
            params = replace(params, prompt_logprobs=req.logprobs)
        prompts = req.prompts()
        if any(isinstance(p, str) for p in prompts) and self.tokenizer is None:
            raise ValueError("this server has no tokenizer: send the prompt as token ids")
        ids = [self.tokenizer.encode(p) if isinstance(p, str) and self.tokenizer is not None else cast(list[int], p)
               for p in prompts]
        started = await self.start_all(ids, params, n, lora)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        model = lora.name if lora is not None else self.model_name

        def response(choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
            return CompletionResponse(id=rid, created=created, model=model, choices=choices, usage=usage)

        def echo(i: int, out: RequestOutput) -> tuple[str, CompletionLogprobs | None]:
            return self.echoed(prompts[i // n], out) if req.echo else ("", None)

        if not req.stream:
            outs = await self.finish_all(started, raw)
            choices = []
            for i, o in enumerate(outs):
                head, head_lps = echo(i, o)
                if score_only:
                    choices.append(CompletionChoice(index=i, text=head, logprobs=head_lps, finish_reason="length"))
                    continue
                lps = self.logprobs(o, 0, len(head))
                if head_lps is not None and lps is not None:
                    lps = _joined(head_lps, lps)
                choices.append(CompletionChoice(index=i, text=head + o.outputs[0].text, logprobs=lps,
                                                finish_reason=o.outputs[0].finish_reason))
            return JSONResponse(response(choices, _usage(outs, n, generated=not score_only)).model_dump())
        include_usage = req.stream_options is not None and req.stream_options.include_usage

        async def events() -> AsyncIterator[str]:
            offsets = [0] * len(started)
            if req.echo:  # the prompts first, one chunk per choice
                for i, (_, first) in enumerate(started):
                    head, head_lps = echo(i, first)
                    offsets[i] = len(head)
                    yield _sse(response([CompletionChoice(index=i, text=head, logprobs=head_lps,
                                                          finish_reason="length" if score_only else None)]))
            if score_only:
                outs = await self.finish_all(started, None)
                if include_usage:
                    yield _sse(response([], _usage(outs, n, generated=False)))
                yield _sse("[DONE]")
                return
            last: dict[int, RequestOutput] = {}
            async for i, delta, out, start in self.merged_deltas(started, max(map(len, params.stop), default=0)):
                # (offsets: where the next token's text starts; text held back is not yet sent
                # but its tokens' logprobs are)
                lps = self.logprobs(out, start, offsets[i])
                choice = CompletionChoice(index=i, text=delta, logprobs=lps, finish_reason=out.outputs[0].finish_reason)
                if lps is not None and lps.tokens:
                    offsets[i] = lps.text_offset[-1] + len(lps.tokens[-1])
                last[i] = out
                yield _sse(response([choice]))
            if include_usage:
                yield _sse(response([], _usage([last[i] for i in sorted(last)], n)))
            yield _sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        lora = self.check_model(req.model)
        n = req.choices_per_prompt()
        k = req.logprobs_k()
        if self.tokenizer is None:
            raise ValueError("this server has no tokenizer: chat completions need one")
        tools = req.template_tools()
        if tools is not None and self.tool_parser is None:
            raise ValueError("tools: this server reads no tool calls; start it with --tool-call-parser (hermes, "
                             "llama3_json: the format the model writes its calls in)")
        parse = PARSERS[self.tool_parser] if tools is not None and self.tool_parser is not None else None
        ids = self.tokenizer.apply_chat_template(template_messages([m.as_template_dict() for m in req.messages]),
                                                 add_generation_prompt=True, tokenize=True, tools=tools)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = req.sampling_params(max_tokens, max(1, self.max_model_len - len(ids)), k)
        started = await self.start_all([ids], params, n, lora)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        model = lora.name if lora is not None else self.model_name
        if not req.stream or parse is not None:
            outs = await self.finish_all(started, raw)
            choices = [_chat_choice(i, o, self.chat_logprobs(o, k), parse) for i, o in enumerate(outs)]
            if req.stream:  # (with tools: each choice whole, once done, as chunks)
                return StreamingResponse(_whole_chunks(ChatCompletionResponse(
                    id=rid, object="chat.completion.chunk", created=created, model=model, choices=choices),
                    _usage(outs, n) if req.stream_options is not None and req.stream_options.include_usage
                    else None), media_type="text/event-stream")
            return JSONResponse(ChatCompletionResponse(id=rid, created=created, model=model,
                                                       choices=choices, usage=_usage(outs, n)).model_dump(
                exclude={"choices": {"__all__": {"delta"}}}))  # (a chunk's field: not in a whole response)
        include_usage = req.stream_options is not None and req.stream_options.include_usage

        def chunk(choices: list[ChatChoice], usage: Usage | None = None) -> ChatCompletionResponse:
            return ChatCompletionResponse(id=rid, object="chat.completion.chunk", created=created,
                                          model=model, choices=choices, usage=usage)

        async def events() -> AsyncIterator[str]:
            for i in range(len(started)):
                yield _sse(chunk([ChatChoice(index=i, delta=ChatMessageOut(role="assistant", content=""))]))
            last: dict[int, RequestOutput] = {}
            async for i, delta, out, start in self.merged_deltas(started, max(map(len, params.stop), default=0)):
                last[i] = out
                yield _sse(chunk([ChatChoice(index=i, delta=ChatMessageOut(content=delta),
                                             logprobs=self.chat_logprobs(out, k, start),
                                             finish_reason=out.outputs[0].finish_reason)]))
            if include_usage:
                yield _sse(chunk([], _usage([last[i] for i in sorted(last)], n)))
            yield _sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")


def _chat_choice(i: int, out: RequestOutput, logprobs: ChatLogprobs | None,
                 parse: Callable[[str], Parsed] | None) -> ChatChoice:
    """Choice ``i`` of a chat completion; with ``parse`` (tools offered), its tool calls apart from
    its content (``finish_reason`` ``tool_calls`` where it made some)."""
    text, reason = out.outputs[0].text, out.outputs[0].finish_reason
    if parse is not None:
        parsed = parse(text)
        if parsed.calls:
            message = ChatMessageOut(role="assistant", content=parsed.content,
                                     tool_calls=[c.as_openai() for c in parsed.calls])
            return ChatChoice(index=i, message=message, logprobs=logprobs, finish_reason="tool_calls")
    return ChatChoice(index=i, message=ChatMessageOut(role="assistant", content=text), logprobs=logprobs,
                      finish_reason=reason)


async def _whole_chunks(whole: ChatCompletionResponse, usage: Usage | None) -> AsyncIterator[str]:
    """A streamed chat completion whose choices are already whole (tools offered: a call can be
    told from content only once the answer is done): per choice its role, its content and its
    calls in one delta, then its end."""
    for c in whole.choices:
        assert c.message is not None
        calls = None if c.message.tool_calls is None else [{**call, "index": j}
                                                            for j, call in enumerate(c.message.tool_calls)]
        delta = ChatMessageOut(role="assistant", content=c.message.content, tool_calls=calls)
        yield _sse(whole.model_copy(update={"choices": [ChatChoice(index=c.index, delta=delta, logprobs=c.logprobs)]}))
        yield _sse(whole.model_copy(update={"choices": [ChatChoice(index=c.index, delta=ChatMessageOut(),
                                                                   finish_reason=c.finish_reason)]}))
    if usage is not None:
        yield _sse(whole.model_copy(update={"choices": [], "usage": usage}))
    yield _sse("[DONE]")


def _dataset_loader(engine_thread: EngineThread, jobs: JobsConfig,
                    reader: DatasetReader | None = None) -> Callable[[Path], FTDataset]:
    """A file read as a job trained on it will read it (:func:`read_dataset`, by ``reader``)."""
    if engine_thread.engine.tokenizer is None:
        raise ValueError("--finetune-jobs needs the model's tokenizer")
    return lambda path: read_dataset(engine_thread.engine, path, jobs.template.coserve, reader)


def _not_served(model: str, job: FinetuneJob | None, board: JobBoard) -> HTTPException:
    """The answer to deleting ``model``, which no served adapter is: a 409 where it is the model of
    a job that has not ended (served once it ends), else a 404 that says why there is none."""
    if job is None:
        return HTTPException(404, f"no model {model!r} is served")
    if job.id in board.deleted:
        return HTTPException(404, f"no model {model!r} is served (deleted already)")
    status = board.status(job) or board.stats(job).ft_outcome or "running"
    if status in ("queued", "validating_files", "running", "paused"):
        return HTTPException(409, f"model {model!r} is not served yet: fine-tuning job {job.id!r} is {status}, "
                                  "and its model is served once the job ends (cancel the job to end it now)")
    return HTTPException(404, f"no model {model!r} is served: fine-tuning job {job.id!r} has ended ({status}) "
                              "and no adapter of it is loaded")


OPEN_ROUTES = frozenset({"/health", "/metrics"})
"""The routes that an API key does not guard."""


def create_app(engine_thread: EngineThread, model_name: str, adapters: dict[str, str] | None = None,
               runtime_lora: bool = False, finetune_name: str | None = None,
               jobs: JobsConfig | None = None, api_key: str | None = None,
               tool_parser: str | None = None) -> FastAPI:
    """The API app for ``engine_thread`` (started by the caller), serving ``model_name`` and each of
    ``adapters`` (model name -> PEFT directory) on it; with ``runtime_lora`` adapters can be
    loaded and unloaded while it serves (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``).
    A co-serving engine thread's run is the fine-tuning job of ``/v1/fine_tuning/jobs``, its adapter
    served as ``finetune_name`` (when given); with ``jobs`` clients upload data (``/v1/files``) and
    create jobs, each one's adapter served, once trained, under its ``fine_tuned_model`` name.
    With ``api_key``, every route needs ``Authorization: Bearer <api_key>`` (a 401 otherwise)
    but :data:`OPEN_ROUTES`, for probes and scrapers. With ``tool_parser`` (a name of
    :data:`~coserve.server.tool_calls.PARSERS`) chat requests may offer ``tools``, and the calls the
    model writes come back as ``tool_calls``."""
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        board.resume_interrupted()  # (a job that a crash stopped goes on from its checkpoint)
        yield
        board.closing = True  # (the jobs still queued start at the next start, not now)
        if reader is not None:
            reader.close()

    app = FastAPI(title="coserve", docs_url=None, redoc_url=None, lifespan=lifespan)
    api = _Api(engine_thread, model_name, adapters, runtime_lora, tool_parser)
    app.state.api = api
    endpoints = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/v1/load_lora_adapter",
                 "/v1/unload_lora_adapter", "/v1/fine_tuning/jobs", "/v1/files", "/tokenize", "/detokenize"}

    expected = f"Bearer {api_key}".encode() if api_key else None

    @app.middleware("http")
    async def count(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        endpoint = request.url.path if request.url.path in endpoints else "other"
        if endpoint.startswith("/v1/") or endpoint in ("/tokenize", "/detokenize"):
            api.metrics.requests.labels(endpoint).inc()
        if (expected is not None and request.url.path not in OPEN_ROUTES
                and not hmac.compare_digest(request.headers.get("authorization", "").encode(), expected)):
            response: Response = _error(401, "a valid API key is needed: send 'Authorization: Bearer <key>' "
                                             "(the server's --api-key)", "authentication_error")
        else:
            try:
                response = await call_next(request)
            except Exception:  # (unhandled: Starlette's outer middleware answers it with a 500)
                api.metrics.errors.labels(endpoint, "500").inc()
                raise
        if response.status_code >= 400:
            api.metrics.errors.labels(endpoint, str(response.status_code)).inc()
        return response

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, _validation_message(exc))

    @app.exception_handler(ValueError)
    async def refused(request: Request, exc: ValueError) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # (nobody reads it; nginx's "client closed request")

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return _error(503, str(exc), "service_unavailable")

    app.post("/v1/completions", response_model=None)(api.completions)
    app.post("/v1/chat/completions", response_model=None)(api.chat)
    app.post("/v1/load_lora_adapter", response_model=None)(api.load_adapter)
    app.post("/v1/unload_lora_adapter", response_model=None)(api.unload_adapter)

    # (the jobs' datasets read in a child process: in a thread of this one they hold the GIL from
    # the engine's thread for the whole read, bench/dataset_read_stall.py)
    reader = None if jobs is None or engine_thread.engine.tokenizer is None else DatasetReader(
        engine_thread.engine.tokenizer)
    files = None if jobs is None else FileStore(jobs.root / "files", _dataset_loader(engine_thread, jobs, reader),
                                                jobs.max_upload_bytes)

    def serve_adapter(name: str, path: str, adapter: LoraAdapter | None = None) -> None:
        """(the loop thread) Serve the adapter at ``path`` as ``name``: ``adapter``, where given
        (its files may still be being written), else read and checked now."""
        engine_thread.engine.lora_manager.register(name, path, adapter)
        # NOTE: a new dict, not a change to the one the event loop may be iterating (/v1/models)
        api.adapters = {**api.adapters, name: LoRARequest(name, path)}

    board = JobBoard(engine_thread, model_name, files, jobs, serve_adapter, finetune_name, reader)
    if jobs is not None:  # (the first job's trainer then starts with its imports done: coserve.trainer.spare)
        prepare_spare(engine_thread.engine.runner.device)
    app.state.jobs = board
    if jobs is not None or board.jobs:
        api.metrics.registry.register(_JobsCollector(board))
    add_file_routes(app, files, board.file_user)
    add_finetune_job_routes(app, board)

    def model_cards() -> list[dict[str, Any]]:
        # (max_model_len as vLLM gives it: a client can fit its prompts, as coserve bench-http does)
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "coserve", "root": model_name,
                "parent": None, "max_model_len": engine_thread.engine.max_model_len}
        return [card] + [{**card, "id": name, "root": lora.path, "parent": model_name}
                         for name, lora in api.adapters.items()]

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": model_cards()}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> dict[str, Any]:
        card = next((c for c in model_cards() if c["id"] == model), None)
        if card is None:
            raise HTTPException(404, f"no model {model!r} is served; see GET /v1/models")
        return card

    @app.delete("/v1/models/{model:path}")
    async def delete_model(model: str) -> dict[str, Any]:
        """OpenAI's model deletion: a fine-tuning job's model (or, with --allow-runtime-lora, any
        adapter) is no longer served; its files stay on disk. 409 while a request uses it."""
        if model == model_name:
            raise HTTPException(400, f"{model!r} is the base model: it cannot be deleted")
        job = board.job_of_model(model)
        checkpoint = board.checkpoint_of_model(model) if job is None else None
        lora = api.adapters.get(model)
        if lora is None:
            raise _not_served(model, job, board)
        if job is None and checkpoint is None:
            api._check_runtime_lora()
        running = board.running()
        if job is not None and running is not None and running.id == job.id:
            raise HTTPException(409, f"model {model!r} is being trained by job {job.id!r}: cancel the job first")
        api.adapters = {k: v for k, v in api.adapters.items() if k != model}
        try:
            await engine_thread.call(lambda engine: engine.remove_lora(model))
        except ValueError as e:
            api.adapters = {**api.adapters, model: lora}
            raise HTTPException(409, str(e)) from e
        except KeyError:
            pass  # (never loaded into the engine)
        if job is not None:
            board.model_deleted(job)
        if checkpoint is not None:
            board.checkpoint_deleted(checkpoint)
        logger.info("model %r deleted (its adapter stays at %s)", model, lora.path)
        return {"id": model, "object": "model", "deleted": True}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        """vLLM's: the token ids the server would run for a prompt or a chat (its template), their
        count and the model's context."""
        api.check_model(req.model)
        tok = api.tokenizer
        if tok is None:
            raise ValueError("this server has no tokenizer: it takes token ids only")
        if req.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            ids = list(tok.apply_chat_template(template_messages([m.as_template_dict() for m in req.messages]),
                                               add_generation_prompt=req.add_generation_prompt, tokenize=True,
                                               tools=tools))
        else:
            ids = list(tok.encode(req.prompt or "", add_special_tokens=req.add_special_tokens))
        return {"tokens": ids, "count": len(ids), "max_model_len": engine_thread.engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's: the text of token ids (ids outside the vocabulary are a 400)."""
        api.check_model(req.model)
        tok = api.tokenizer
        if tok is None:
            raise ValueError("this server has no tokenizer")
        vocab = engine_thread.engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/health")
    async def health() -> Response:
        if not engine_thread.alive:
            return _error(503, "the engine loop is not running", "service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        """vLLM's: the server's version."""
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(api.metrics.registry), media_type="text/plain; version=0.0.4")

    return app


"""The engine loop: requests in, one batched forward pass per step, tokens out."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import Any

import torch

from coserve.core.coserver import CoServer
from coserve.core.host import FTRow, Interrupted, PrefillView, StepRecord, StepView
from coserve.core.latency import BatchSpec, LatencyModel, calibrate
from coserve.engine.block_manager import BASE_CACHE_KEY, BlockManager, cache_key
from coserve.engine.calibration import run_synthetic_batch
from coserve.engine.config import EngineConfig
from coserve.engine.lora_manager import LoRAManager
from coserve.engine.model_runner import BatchRow, ModelRunner
from coserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from coserve.engine.sampling_params import SampledToken, SamplingParams
from coserve.engine.scheduler import Scheduler, SchedulerOutput
from coserve.engine.sequence import LoRARequest, Sequence
from coserve.engine.step_clock import StepClock
from coserve.engine.warmup import WarmupReport, warm_up
from coserve.gc_freeze import freeze_startup_objects
from coserve.layers.sampler import Sampler
from coserve.models.loader import ModelSource, load_model
from coserve.models.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)

MAX_UNTIMED_STEPS = 64
"""Steps the engine leaves undated (:class:`StepClock`) before it waits for one."""


class InvalidRequestError(ValueError):
    """A request the engine refuses; the message says what is wrong. The engine keeps running."""


@dataclass(frozen=True)
class StepStats:
    """What one step did and how long it took (for metrics and the latency model)."""

    duration_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preempted: int
    mode: str = "eager"
    # cached tokens the prefill chunks attend to beyond themselves (their context lengths summed)
    prefill_context_tokens: int = 0
    ft_tokens: int = 0  # fine-tuning tokens in the step
    # where the time went: scheduling and planning until the forward was called, the forward's
    # enqueue on the CPU, and (CUDA) the forward on the GPU between events recorded around it
    # (it includes the GPU's idle gaps while the CPU still launches; only with
    # LLMEngine.time_forward_on_gpu); None where unknown
    schedule_s: float | None = None
    forward_enqueue_s: float | None = None
    forward_gpu_s: float | None = None
    # the CPU time this thread used during the enqueue: well below forward_enqueue_s, the thread
    # waited (for the GIL, a core, or a blocking CUDA call) rather than worked
    forward_cpu_s: float | None = None


class LLMEngine:
    """``add_request`` / ``abort_request`` / ``step``: the built-in host's core.

    Not thread-safe: one thread drives it.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        source = ModelSource.resolve(config.model)
        torch.manual_seed(config.seed)
        self.model = load_model(
            source.path if not source.is_preset else config.model,
            load_format=config.load_format,
            dtype=config.dtype,
            device=config.torch_device,
            num_lora_slots=config.num_lora_slots,
            max_lora_rank=config.max_lora_rank,
            seed=config.seed,
        )
        self.model_config = self.model.config
        self.tokenizer: Tokenizer | None = None if config.skip_tokenizer_init else Tokenizer.from_dir(source.path)
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        self.lora_manager = LoRAManager(self.model, config.max_loras, config.num_training_slots)
        self.runner = ModelRunner(config, self.model, self.lora_manager.scales)
        self.runner.slot_targets = self.lora_manager.live_targets
        # the stream every step, warm-up and calibration batch runs on (EngineConfig.stream_priority)
        self.stream: torch.cuda.Stream | None = None
        if self.runner.device.type == "cuda" and config.stream_priority == "high":
            # NOTE: out-of-range priorities clamp to the highest the device has
            self.stream = torch.cuda.Stream(self.runner.device, priority=-(1 << 10))
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            acquire_adapter=self._acquire_adapter,
            release_adapter=self._release_adapter,
        )
        self.sampler = Sampler(seed=config.seed)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self._requests: dict[str, Sequence] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self.last_step: StepStats | None = None
        self.coserver: CoServer | None = None
        self.training_slot = -1
        # A driver that holds requests outside the engine (a replay clock, an HTTP inbox) tells
        # here whether one is due.
        self.external_arrivals: Callable[[], bool] | None = None
        self.last_step_kind = "idle"  # idle | inference | mixed | ft-only | ft-only-interrupted | ft-only-not-started
        # Time each step's forward on the GPU with CUDA events (StepStats.forward_gpu_s): off
        # unless a benchmark asks, so that serving steps create no events.
        self.time_forward_on_gpu = False
        # With a co-server on CUDA: the real durations of the steps that sample nothing (the host
        # does not wait for them), for the latency model
        self.step_clock = StepClock()
        if config.runs_warmup:
            self.warm_up()
        freeze_startup_objects("engine")

    def attach(self, coserver: CoServer, training_slot: int = 0) -> None:
        """Co-serve: let ``coserver`` add fine-tuning rows (on a training adapter slot) to steps."""
        self.coserver = coserver
        self.training_slot = self.lora_manager.training_slot(training_slot)
        coserver.arrival_probe = self.arrival_pending
        self.runner.ft_dropout = (coserver.lora_dropout, coserver.dropout_seed)
        graphs = self.runner.graphs
        if graphs is not None:  # a decode step's graph replay computes its whole bucket
            coserver.latency.graph_bucket = lambda n: graphs.bucket(n) or n
        # and a piecewise prefill step's token-wise work its own (whichever graphs are in use)
        coserver.latency.prefill_bucket = self._prefill_bucket

    def _prefill_bucket(self, tokens: int) -> int:
        """The tokens a piecewise prefill step of ``tokens`` computes (the graphs in use now:
        ModelRunner.use_prefill_graphs may switch them)."""
        pieces = self.runner.prefill_graphs
        return (pieces.bucket(tokens) if pieces is not None else None) or tokens

    def declare_training_adapter(self, slot: int, targets: Iterable[tuple[int, str]]) -> None:
        """The ``(layer, target)`` pairs of the adapter a trainer writes into training slot
        ``slot`` (:meth:`LoRAManager.declare`): steps with its rows run the LoRA of those linears
        only, eager or through piecewise prefill graphs of their own (captured now, before
        serving)."""
        self.lora_manager.declare(slot, targets)
        with self.on_stream():
            self.runner.add_prefill_live_variant([slot])

    def detach(self) -> None:
        """Stop co-serving: later steps carry inference rows only."""
        self.coserver = None
        self.training_slot = -1

    def remove_lora(self, name: str) -> None:
        """Unload the adapter registered as ``name``; ValueError while a request uses it (waiting
        or running: it would find the adapter gone), KeyError if there is none."""
        users = [s.request_id for s in (*self.scheduler.waiting, *self.scheduler.running)
                 if s.lora is not None and s.lora.name == name]
        if users:
            raise ValueError(f"adapter {name!r} is in use by {len(users)} unfinished request(s)")
        path = self.lora_manager.path_of(name)
        self.lora_manager.unregister(name)
        # (the name may come back with other weights: its cached prefixes must not be found then)
        self.block_manager.forget(cache_key(name, path))

    def arrival_pending(self) -> bool:
        """Is inference work waiting? (An FT-only step gives way to it at the next layer.)"""
        return bool(self.scheduler.waiting) or (self.external_arrivals is not None and self.external_arrivals())

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Raises :class:`InvalidRequestError` (or AdapterError) on bad input."""
        params = params or SamplingParams()
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text: str | None = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer: pass token ids, not text")
            text = prompt
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
                raise InvalidRequestError("prompt token ids must be integers")
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"prompt token id {bad[0]} is outside the vocabulary [0, {self.model_config.vocab_size})"
                )
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        biased = [t for t, _ in params.logit_bias if t >= self.model_config.vocab_size]
        if biased:
            raise InvalidRequestError(
                f"logit_bias: token id {biased[0]} is outside the vocabulary [0, {self.model_config.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; the model's context is {self.max_model_len} tokens "
                "and at least one must be left for the output"
            )
        if self.block_manager.blocks_for_tokens(len(ids) + 1) > self.block_manager.num_blocks:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens, more than the whole KV cache holds "
                f"({self.block_manager.num_blocks * self.config.block_size} tokens)"
            )
        if lora_request is not None:
            self.lora_manager.register(lora_request.name, lora_request.path)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling_params=params,
            prompt=text,
            lora=lora_request,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            generator=generator,
            cache_key=self._cache_key(params, lora_request),
        )
        self._requests[request_id] = seq
        if self.tokenizer is not None:
            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        self.scheduler.add(seq)

    def _cache_key(self, params: SamplingParams, lora: LoRARequest | None) -> bytes | None:
        """What a request's cached prefix is registered and found under (None: it is not cached):
        its adapter; not where it asks for its prompt's logprobs (every prompt position must run)
        or where its adapter is the one being trained (its weights change every optimizer step)."""
        if not self.block_manager.enable_prefix_caching or params.prompt_logprobs is not None:
            return None
        if lora is None:
            return BASE_CACHE_KEY
        if self.lora_manager.is_training(lora.name):
            return None
        return cache_key(lora.name, self.lora_manager.path_of(lora.name))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; returns its final output (None if unknown)."""
        seq = self._requests.get(request_id)
        if seq is None:
            return None
        self.scheduler.finish(seq)
        seq.finish_reason = "abort"
        seq.finish_time = time.monotonic()
        return self._finalize(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ the step

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        """Where the engine's GPU work goes: its own high-priority stream, or the current one.
        The two streams are ordered both ways around the block (GPU-side waits, no host sync):
        work queued before it (an adapter loaded into its slot) comes first, work queued after it
        comes after."""
        if self.stream is None:
            yield
            return
        outer = torch.cuda.current_stream(self.runner.device)
        self.stream.wait_stream(outer)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            outer.wait_stream(self.stream)

    def step(self) -> list[RequestOutput]:
        """Schedule and run one forward pass; returns the outputs of requests that got a token."""
        with self.on_stream():
            return self._step()

    def _step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        step_began = time.monotonic()  # (StepView's clock)
        sched = self.scheduler.schedule()
        rows = self.build_rows(sched)
        ft_rows: list[FTRow] = []
        view = None
        busy = False
        if self.coserver is not None:
            view = self._view(sched, rows, step_began)
            ft_rows = self.coserver.plan(view)
            busy = self.coserver.trainer_active  # after plan's pause decisions
        if sched.is_empty and not ft_rows:
            # (an FT-only step that an arrival kept from starting still cost its planning)
            arrived = self.coserver is not None and self.coserver.arrived_while_planning
            self.last_step_kind = "ft-only-not-started" if arrived else "idle"
            return []
        self.last_step_kind = ("ft-only" if sched.is_empty else "mixed") if ft_rows else "inference"
        if ft_rows:
            rows = self.with_ft_rows(rows, len(sched.prefills), ft_rows)
        co = self.coserver if ft_rows else None
        hook = co.on_layer if co is not None else None
        # NOTE: an MLP hook keeps the step eager (no prefill graphs): with
        # SLOConfig.ft_only_mid_layer_check an FT-only step trades that for a second
        # interruption point per layer (off by default: session 17 measured the eager step's
        # first layer at 2-16 ms of host time, its GEMMs at a new token count)
        mlp_hook = co.on_mlp if co is not None and co.wants_mlp_hook else None
        began = time.perf_counter()
        cpu_began = time.thread_time()
        events = None
        if self.time_forward_on_gpu and self.runner.device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        try:
            logits = self.runner.execute(rows, hook, mlp_hook)
            if events is not None:
                events[1].record()
            enqueued = time.perf_counter()
            cpu_used = time.thread_time() - cpu_began
        except Interrupted:
            assert self.coserver is not None and view is not None and sched.is_empty
            self.last_step_kind = "ft-only-interrupted"
            # (its time split too: planning before the forward is not interruptible)
            now = time.perf_counter()
            self.last_step = StepStats(
                duration_s=now - start, num_prefill_tokens=0, num_decode_tokens=0,
                num_preempted=len(sched.preempted), mode=self.runner.last_mode,
                ft_tokens=sum(len(r.token_ids) for r in ft_rows), schedule_s=began - start,
                forward_enqueue_s=now - began, forward_cpu_s=time.thread_time() - cpu_began)
            self.step_clock.drop()  # NOTE: an interrupted step's kernels cannot date the ones before
            self.coserver.drop_untimed()
            self.coserver.on_step_end(StepRecord(view=view, ft_tokens=0, duration_s=now - start,
                                                 interrupted=True, trainer_busy=busy))
            return []
        outputs = self.finish_step(sched, logits)
        ft_lens = tuple(len(r.token_ids) for r in ft_rows)
        stats = self.last_step = StepStats(
            duration_s=time.perf_counter() - start,
            num_prefill_tokens=sum(c.num_tokens for c in sched.prefills),
            num_decode_tokens=len(sched.decodes),
            num_preempted=len(sched.preempted),
            mode=self.runner.last_mode,
            prefill_context_tokens=sum(c.context_len for c in sched.prefills),
            ft_tokens=sum(ft_lens),
            schedule_s=began - start,
            forward_enqueue_s=enqueued - began,
            forward_cpu_s=cpu_used,
            # sampling synchronized; a step without sampled rows may still run: no sync for it
            forward_gpu_s=events[0].elapsed_time(events[1]) / 1e3
            if events is not None and events[1].query()
            else None,
        )
        if self.coserver is not None and view is not None:
            self._report_step(view, stats, start, ft_rows, ft_lens, busy,
                              waited=any(c.samples for c in sched.chunks))
        return outputs

    def _report_step(self, view: StepView, stats: StepStats, start: float, ft_rows: list[FTRow],
                     ft_lens: tuple[int, ...], busy: bool, waited: bool) -> None:
        """Hand the co-server the step's record; on CUDA a step that sampled nothing (the host did
        not wait for its kernels) goes untimed and gets its duration once a later step waits
        (:class:`coserve.engine.step_clock.StepClock`)."""
        assert self.coserver is not None
        end = start + stats.duration_s
        event = None
        # NOTE: an event only where the clock needs one: to date this step later, or the untimed
        # ones before it from this one; a decode step after decode steps records none
        if self.runner.device.type == "cuda" and (not waited or self.step_clock.pending):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            if not waited and self.step_clock.pending >= MAX_UNTIMED_STEPS:
                # a long run of FT-only steps: wait for this one rather than keep every event
                event.synchronize()
                waited, end = True, time.perf_counter()
        record = StepRecord(
            view=view, ft_tokens=stats.ft_tokens, duration_s=stats.duration_s, mode=stats.mode,
            ft_rows=tuple(r.sample_id for r in ft_rows), ft_lens=ft_lens, trainer_busy=busy,
            timed=waited or event is None, schedule_s=stats.schedule_s, enqueue_s=stats.forward_enqueue_s,
            gpu_s=stats.forward_gpu_s, enqueue_cpu_s=stats.forward_cpu_s,
        )
        dated = self.step_clock.step(record, start, end, waited, event)
        if not record.timed:
            self.coserver.on_step_end(record)
            return
        for earlier, duration in dated[:-1]:
            self.coserver.observe_late(earlier, duration)
        self.coserver.on_step_end(replace(record, duration_s=dated[-1][1]))

    def _view(self, sched: SchedulerOutput, rows: list[BatchRow], began: float | None = None) -> StepView:
        waiting = self.scheduler.waiting
        kv = [c.context_len + 1 for c in sched.decodes]
        return StepView(
            now=time.monotonic(),
            step_began=began,
            prefills=tuple(PrefillView(c.num_tokens, c.context_len, c.seq.arrival_time) for c in sched.prefills),
            num_decodes=len(sched.decodes),
            decode_kv_tokens=sum(kv),
            decode_kv_max=max(kv, default=0),
            mode=self.runner.planned_mode(rows) if rows else "eager",
            ft_graph_tokens=self.runner.ft_graph_tokens,
            token_budget=self.config.max_num_batched_tokens - sched.num_tokens,
            num_waiting=len(waiting),
            oldest_waiting_arrival=waiting[0].arrival_time if waiting else None,
            waiting_prefill_tokens=sum(s.num_uncomputed_tokens for s in waiting),
            prefill_remaining=tuple(c.seq.num_uncomputed_tokens - c.num_tokens for c in sched.prefills),
        )

    def run_batch(self, spec: BatchSpec) -> float:
        """Run one synthetic batch through the real step path; returns seconds (hook 5)."""
        with self.on_stream():
            return run_synthetic_batch(self, spec)

    def warm_up(self) -> WarmupReport:
        """Run every eager step's shape class once, so that no kernel compiles while serving."""
        with self.on_stream():
            return warm_up(self)

    def calibrate(self, repeats: int = 2, model: LatencyModel | None = None, ft_eager: bool = False) -> int:
        """Fit the co-server's latency model on this engine's real step path (after warm-up); or,
        with ``model``, that model without a co-server (a server that will start fine-tuning jobs
        later: ``ft_eager`` where their FT rows will keep steps eager, see
        :meth:`CoServer.ft_rows_force_eager`)."""
        cfg = self.config
        kwargs: dict[str, Any] = dict(
            max_tokens=cfg.max_num_batched_tokens, max_decodes=min(cfg.max_num_seqs, 64),
            max_kv=self.block_manager.num_free_blocks * cfg.block_size // 2, max_context=self.max_model_len - 1,
            repeats=repeats, modes=("graph", "eager") if self.runner.graphs is not None else ("eager",),
            ft_modes=("graph", "eager") if self.runner.ft_graph_tokens and not ft_eager else ("eager",))
        if model is not None:
            return calibrate(model, self.run_batch, **kwargs)
        if self.coserver is None:
            raise RuntimeError("calibrate() needs an attached co-server, or a model")
        return self.coserver.calibrate(self.run_batch, **kwargs)

    def sync(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)

    def build_rows(self, sched: SchedulerOutput) -> list[BatchRow]:
        """The inference rows of a step: prefill chunks, then decodes."""
        rows = []
        for chunk in sched.prefills:
            seq = chunk.seq
            ctx = chunk.context_len
            rows.append(BatchRow(seq.token_slice(ctx, ctx + chunk.num_tokens), ctx, seq.block_table,
                                 seq.lora_slot, samples=chunk.samples, scored=_prompt_targets(seq, ctx, chunk.num_tokens)))
        for chunk in sched.decodes:
            seq = chunk.seq
            ctx = chunk.context_len
            rows.append(BatchRow([seq.token_at(ctx)], ctx, seq.block_table, seq.lora_slot,
                                 samples=True, is_prefill=False))
        return rows

    def with_ft_rows(self, rows: list[BatchRow], num_prefill: int, ft_rows: list[FTRow]) -> list[BatchRow]:
        """Insert fine-tuning rows where the attention layout wants them: after the prefills."""
        ft = [BatchRow(list(r.token_ids), 0, [], self.training_slot, writes_kv=False, dropout_key=r.dropout_key)
              for r in ft_rows]
        return rows[:num_prefill] + ft + rows[num_prefill:]

    def finish_step(self, sched: SchedulerOutput, logits: torch.Tensor) -> list[RequestOutput]:
        """Sample, advance the scheduled sequences, and build the outputs of this step."""
        for i, scores in self.runner.last_scores.items():  # (prefill rows come first, in sched order)
            seq = sched.prefills[i].seq
            first = sched.prefills[i].context_len + 1  # the prompt token its first position predicts
            have = len(seq.prompt_logprobs) + 1  # (after a preemption the prefill runs again: keep the first)
            seq.prompt_logprobs.extend(scores[have - first:] if have >= first else [])
        chunks = sched.chunks
        sampling = [c.seq for c in chunks if c.samples]
        tokens = self.sampler(
            logits,
            [s.sampling_params for s in sampling],
            [s.generator for s in sampling],
            [s.num_output_tokens for s in sampling],
            self.eos_token_ids,
            lambda i: (sampling[i].prompt_token_ids, sampling[i].output_token_ids),
        ) if sampling else []
        for c in chunks:
            c.seq.num_computed_tokens += c.num_tokens
        if self.block_manager.enable_prefix_caching:  # (their full blocks' KV: reusable by later requests)
            for c in chunks:
                self.block_manager.register(c.seq)
        now = time.monotonic()
        outputs = []
        for seq, tok in zip(sampling, tokens, strict=True):
            self._append_token(seq, tok, now)
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                seq.finish_time = now
                outputs.append(self._finalize(seq))
            else:
                outputs.append(self._output(seq))
        return outputs

    def _append_token(self, seq: Sequence, tok: SampledToken, now: float) -> None:
        params = seq.sampling_params
        seq.output_token_ids.append(tok.token_id)
        if seq.first_token_time is None:
            seq.first_token_time = now
        if params.logprobs is not None and tok.logprob is not None:
            seq.logprobs.append({tok.token_id: tok.logprob, **tok.top_logprobs})
            seq.cumulative_logprob += tok.logprob
        detok = self._detok.get(seq.request_id)
        if detok is not None:
            seq.output_text += detok.add(tok.token_id)
        n_out = seq.num_output_tokens
        if n_out >= params.min_tokens:
            if not params.ignore_eos and tok.token_id in self.eos_token_ids:
                seq.finish_reason = "stop"
                return
            if tok.token_id in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", tok.token_id
                return
            if params.stop and self._check_stop_strings(seq):
                return
        if n_out >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def _check_stop_strings(self, seq: Sequence) -> bool:
        params = seq.sampling_params
        text = seq.output_text
        for stop in params.stop:
            idx = text.find(stop)
            if idx >= 0:
                end = idx + len(stop) if params.include_stop_str_in_output else idx
                seq.output_text = text[:end]
                seq.finish_reason, seq.stop_reason = "stop", stop
                return True
        return False

    def _acquire_adapter(self, seq: Sequence) -> bool:
        if seq.lora is None:
            seq.lora_slot = -1
            return True
        slot = self.lora_manager.acquire(seq.lora.name)
        if slot is None:
            return False
        seq.lora_slot = slot
        return True

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0:
            self.lora_manager.release(seq.lora_slot)
            seq.lora_slot = -1

    def _output(self, seq: Sequence) -> RequestOutput:
        params = seq.sampling_params
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            prompt_logprobs=[None, *seq.prompt_logprobs] if params.prompt_logprobs is not None else None,
            outputs=[
                CompletionOutput(
                    index=0,
                    text=seq.output_text,
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob if params.logprobs is not None else None,
                    logprobs=list(seq.logprobs) if params.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            ],
            finished=seq.finish_reason is not None,
            metrics=RequestMetrics(seq.arrival_time, seq.first_token_time, seq.finish_time, seq.num_preemptions),
        )

    def _finalize(self, seq: Sequence) -> RequestOutput:
        self._requests.pop(seq.request_id, None)
        detok = self._detok.pop(seq.request_id, None)
        if detok is not None and not isinstance(seq.stop_reason, str):
            seq.output_text += detok.flush()  # a trailing incomplete UTF-8 character, if any
        return self._output(seq)


def _prompt_targets(seq: Sequence, ctx: int, n: int) -> tuple[list[int], int] | None:
    """``BatchRow.scored`` of the chunk of ``seq`` at ``[ctx, ctx + n)``: the prompt tokens its
    positions predict (``ctx + 1 ...``, within the prompt), when the request asked for them."""
    k = seq.sampling_params.prompt_logprobs
    if k is None:
        return None
    prompt = seq.prompt_token_ids
    return list(prompt[ctx + 1:min(ctx + n + 1, len(prompt))]), k

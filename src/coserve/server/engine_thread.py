"""The engine's step loop in one background thread, fed by an inbox, read by asyncio consumers.

The API server (asyncio, HTTP, tokenizer, chat templates) runs beside this thread: it only
puts typed submissions into the inbox and reads outputs from per-request queues, so the step
loop never waits on HTTP or tokenizer work. ``LLMEngine`` is not thread-safe; only the loop
thread touches it after :meth:`EngineThread.start`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from coserve.engine.llm_engine import LLMEngine
from coserve.engine.outputs import RequestOutput
from coserve.engine.sampling_params import SamplingParams
from coserve.engine.sequence import LoRARequest

if TYPE_CHECKING:
    from coserve.core.config import SLOConfig
    from coserve.core.coserver import CoServer
    from coserve.models.peft_adapter import LoraAdapter
    from coserve.server.finetune import FinetuneSession

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop is not running (shut down, or failed); the request was not served."""


class RequestHandle:
    """The consumer's side of one request: an ``asyncio.Queue`` filled from the engine thread.

    Items are cumulative :class:`RequestOutput` snapshots; the last one has ``finished`` set.
    A request the engine refused, or one the loop failed, gets a single exception instead.
    Only the event loop that called :meth:`EngineThread.submit` may read the handle.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def deliver(self, item: RequestOutput | BaseException) -> None:
        """Called from the engine thread: hand ``item`` to the consumer's event loop."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            pass

    async def get(self) -> RequestOutput:
        """The next output; raises the request's error (ValueError for a refused request)."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            yield await self.get()


@dataclass(frozen=True)
class _Submission:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    lora: LoRARequest | None
    arrival_time: float
    handle: RequestHandle


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the loop publishes after each iteration (safe to read from any thread)."""

    num_running: int = 0
    num_waiting: int = 0
    # prompt tokens of admitted requests asked for and found in the prefix cache (None: it is off)
    prefix_cache: tuple[int, int] | None = None
    coserving: bool = False
    ft_job: str | None = None  # the fine-tuning job the ft_ figures are of (FinetuneSession.job_id)
    ft_tokens_trained: int = 0
    ft_optimizer_steps: int = 0
    ft_loss: float | None = None  # of the last optimizer step
    ft_first_loss: float | None = None  # of the run's first optimizer step
    ft_samples_retired: int = 0  # samples of all epochs trained (SamplePool.progress)
    ft_samples_total: int = 0
    ft_trainer_restarts: int = 0
    # planned steps by (step kind, outcome): whether FT rows were added to a step, or why not
    # (a copy of CoServer.admission_counts)
    ft_admission: Mapping[tuple[str, str], int] = field(default_factory=dict)
    # the trainer's seconds working on tasks and paused for inference (CoServer.trainer_seconds)
    ft_trainer_seconds: Mapping[str, float] = field(default_factory=dict)
    # the latency model's relative error per step key: (counts per ERROR_BUCKETS bucket, their sum)
    # (CoServer.prediction_errors)
    ft_latency_errors: Mapping[str, tuple[tuple[int, ...], float]] = field(default_factory=dict)
    adapter_path: Path | None = None
    # how fine-tuning ended (None while it runs): "succeeded" (its epochs done), "failed" (given up,
    # ft_failure says why: the last good step exported), "cancelled" (stopped early: the API's
    # cancel, or the server's shutdown) or "paused" (stopped at a checkpoint, to be resumed); and
    # when (time.time())
    ft_outcome: str | None = None
    ft_finished_at: float | None = None
    ft_failure: str | None = None  # why fine-tuning gave up (the trainer kept dying, ...): serving goes on

    @property
    def ft_failed(self) -> bool:
        return self.ft_failure is not None


def _session_stats(session: FinetuneSession) -> dict[str, Any]:
    return {"ft_job": session.job_id, **_finetune_stats(session.coserver)}


def _finetune_stats(coserver: CoServer) -> dict[str, Any]:
    """The :class:`EngineStats` fields read from the co-server (copies: safe to publish)."""
    pool = coserver.pool.progress
    return {
        "ft_tokens_trained": coserver.tokens_trained, "ft_optimizer_steps": coserver.steps_done,
        "ft_samples_retired": pool.samples_retired, "ft_samples_total": pool.samples_total,
        "ft_loss": coserver.last_loss, "ft_first_loss": coserver.first_loss, "ft_trainer_restarts": coserver.num_restarts,
        "ft_failure": coserver.failure,
        "ft_admission": dict(coserver.admission_counts),
        "ft_trainer_seconds": dict(coserver.trainer_seconds),
        "ft_latency_errors": {key: (tuple(e.counts), e.total) for key, e in coserver.prediction_errors.items()},
    }


_T = TypeVar("_T")


def _settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], result: Any,
            error: BaseException | None) -> None:
    """From the loop thread: complete ``future`` on its event loop (unless it was cancelled)."""
    def done() -> None:
        if not future.done():
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

    try:
        loop.call_soon_threadsafe(done)
    except RuntimeError:  # its loop is closed: nobody waits for it
        pass


def _close_session(session: FinetuneSession) -> None:
    try:
        session.close()
    except Exception:
        logger.exception("stopping the trainer of fine-tuning job %s failed", session.job_id)


class EngineThread:
    """Owns an :class:`LLMEngine` (and, one at a time, :class:`FinetuneSession` s) and steps it.

    Contract: :meth:`submit` and :meth:`abort` may be called from any thread; everything else
    that touches the engine happens on the loop thread. Errors raised by ``add_request``
    (``InvalidRequestError``, ``AdapterError``: both ``ValueError``) go to that request's
    handle and the loop keeps running. With a session, FT-only steps fill idle time; an HTTP
    arrival interrupts one at the next layer (``engine.external_arrivals``); when the session
    is done its adapter is exported, the session closed, and serving continues; then
    :meth:`start_session` may attach the next one.
    """

    def __init__(
        self,
        engine: LLMEngine,
        session: FinetuneSession | None = None,
        idle_wait_s: float = 0.02,
        slo: SLOConfig | None = None,
    ) -> None:
        self.engine = engine
        self.session = session
        self.idle_wait_s = idle_wait_s
        # (a resumed session's counts from the start: rates over the first interval start there)
        self.stats = EngineStats(coserving=session is not None,
                                 **(_session_stats(session) if session is not None else {}))
        # the SLOs that co-serving keeps (None: inference only), for the server's metrics
        self.slo = session.spec.slo if session is not None else slo
        # each ended session's last figures, by job id (written by the loop thread only), and every
        # end in order (a job paused and resumed ends more than once; append only)
        self.ended: dict[str, EngineStats] = {}
        self.ends: list[EngineStats] = []
        # called on the loop thread when a session has ended and exported its adapter, before
        # its figures are published (the server serves the adapter from then on)
        # (it returns the figures to publish: the job's outcome may change there)
        # (with the exported adapter, in memory: its files may still be being written)
        self.on_session_end: Callable[[FinetuneSession, EngineStats, LoraAdapter | None], EngineStats] | None = None
        # whether a session still running when the loop stops (the server's shutdown, or the loop's
        # failure) is paused at its last committed step, its checkpoint written, rather than
        # cancelled (None: cancelled; the job board pauses its API jobs, to resume at the next start)
        self.pause_at_stop: Callable[[FinetuneSession], bool] | None = None
        # called on the loop thread once the loop has failed and closed (the server stops then)
        self.on_failure: Callable[[BaseException], None] | None = None
        self._inbox: deque[_Submission] = deque()
        self._aborts: deque[str] = deque()
        self._calls: deque[tuple[Callable[[LLMEngine], Any], asyncio.AbstractEventLoop, asyncio.Future[Any]]] = deque()
        self._cond = threading.Condition()
        self._handles: dict[str, RequestHandle] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        self._exiting: list[tuple[threading.Thread, FinetuneSession]] = []  # ended sessions, their trainers stopping
        engine.external_arrivals = lambda: bool(self._inbox)

    # ------------------------------------------------------------------ any thread

    def start(self) -> EngineThread:
        if self._thread is not None:
            raise RuntimeError("the engine thread is already started")
        self._thread = threading.Thread(target=self._run, name="coserve-engine", daemon=True)
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def stopping(self) -> bool:
        """Whether the loop is stopping or has stopped (shut down, or failed)."""
        return self._stopping

    def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        lora: LoRARequest | None = None,
        request_id: str | None = None,
    ) -> RequestHandle:
        """Queue a request; must be called from the event loop that will read the handle."""
        rid = request_id or f"req-{next(self._ids)}"
        handle = RequestHandle(rid, asyncio.get_running_loop())
        sub = _Submission(rid, prompt if isinstance(prompt, str) else list(prompt), params, lora,
                          time.monotonic(), handle)
        with self._cond:
            if self._thread is None or self._closed:
                handle.deliver(EngineDeadError("the engine is not running"))
                return handle
            self._inbox.append(sub)
            self._cond.notify()
        return handle

    async def call(self, fn: Callable[[LLMEngine], _T]) -> _T:
        """``fn(engine)`` run on the loop thread between two steps (what must not race a step:
        loading or unloading an adapter); its result or its exception."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()
        with self._cond:
            if self._thread is None or self._closed:
                raise EngineDeadError("the engine is not running")
            self._calls.append((fn, loop, future))
            self._cond.notify()
        return await future

    def abort(self, request_id: str) -> None:
        """Stop a request (its client went away); unknown or finished ids are ignored."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    async def start_session(self, session: FinetuneSession) -> None:
        """Co-serve ``session`` (built off the loop with ``attach=False``): its engine mutations
        (:meth:`FinetuneSession.attach`) run on the loop thread between two steps, and the
        published fine-tuning figures restart at the session's. RuntimeError while another runs."""
        def start(engine: LLMEngine) -> None:
            if self.session is not None:
                raise RuntimeError(f"fine-tuning job {self.session.job_id} is running")
            session.attach()
            self.session = session
            sched = engine.scheduler
            self.stats = EngineStats(num_running=len(sched.running), num_waiting=len(sched.waiting),
                                     coserving=True, **_session_stats(session))
            self.slo = session.spec.slo

        await self.call(start)

    async def cancel_finetuning(self, job_id: str | None = None, pause: bool = False) -> bool:
        """Stop fine-tuning between two steps: the last committed optimizer step is exported, the
        session closed, and serving goes on; with ``pause``, its checkpoint written too and its
        outcome ``paused`` (it can be resumed from there). A job whose last step was committed
        meanwhile has completed: ``succeeded``. False when no fine-tuning is running (or not
        ``job_id``'s, when given)."""
        def cancel(_: LLMEngine) -> bool:
            if self.session is None or job_id not in (None, self.session.job_id):
                return False
            self._finish_session(self.session, "paused" if pause else None)
            return True

        return await self.call(cancel)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop: pending requests fail with :class:`EngineDeadError`; a co-serving
        session exports its adapter and is closed. Idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the engine thread did not stop within %.0fs", timeout)
        self.wait_trainers_exited(timeout)

    def wait_trainers_exited(self, timeout: float | None = None) -> None:
        """Block until the trainers of ended sessions have exited (a new session's set-up waits
        for them, so that two trainers never hold the device's memory at once)."""
        for t, _ in list(self._exiting):
            t.join(timeout)
            if t.is_alive():
                logger.warning("a fine-tuning trainer did not exit within %.0fs", timeout)

    def wait_exported(self) -> None:
        """Block until the files of ended sessions (adapter, checkpoint) are written; their
        trainers may still be exiting."""
        for _, session in list(self._exiting):
            session.flush_checkpoints()

    # ------------------------------------------------------------------ the loop thread

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain()
                self._iterate()
                self._publish()
        except BaseException as e:  # a bug in the engine: fail every request rather than hang them
            logger.exception("the engine loop failed")
            self.failure = e
            self._stopping = True
        finally:
            self._close()
        if self.failure is not None and self.on_failure is not None:
            try:
                self.on_failure(self.failure)
            except Exception:
                logger.exception("after the engine loop failed")

    def _drain(self) -> None:
        with self._cond:
            subs = list(self._inbox)
            self._inbox.clear()
            aborts = list(self._aborts)
            self._aborts.clear()
            calls = list(self._calls)
            self._calls.clear()
        for sub in subs:
            try:
                self.engine.add_request(sub.request_id, sub.prompt, sub.params, sub.lora, sub.arrival_time)
            except ValueError as e:
                sub.handle.deliver(e)
                continue
            self._handles[sub.request_id] = sub.handle
        for rid in aborts:
            handle = self._handles.pop(rid, None)
            out = self.engine.abort_request(rid)
            if handle is not None and out is not None:
                handle.deliver(out)
        for fn, loop, future in calls:  # (after the submissions: a call sees every request sent before it)
            try:
                _settle(loop, future, fn(self.engine), None)
            except Exception as e:
                _settle(loop, future, None, e)

    def _has_work(self) -> bool:
        """Anything for the loop to take (call with ``_cond`` held)."""
        return bool(self._inbox or self._aborts or self._calls or self._stopping)

    def _iterate(self) -> None:
        engine, session = self.engine, self.session
        if session is not None and session.done:
            self._finish_session(session)
            session = None
        if not engine.has_unfinished_requests() and session is None:
            self._publish()  # (what the last abort or finish left: the wait below may be long)
            with self._cond:
                while not self._has_work():
                    self._cond.wait()
            return
        outputs = engine.step()
        for out in outputs:
            handle = self._handles.get(out.request_id)
            if handle is None:
                continue
            if out.finished:
                del self._handles[out.request_id]
            handle.deliver(out)
        if session is None or engine.has_unfinished_requests() or self._inbox:
            return
        # Only fine-tuning is running: wait for the trainer rather than spin, briefly, since
        # an HTTP arrival cannot wake this wait.
        t = time.monotonic()
        session.wait(self.idle_wait_s)
        if engine.last_step_kind == "idle" and time.monotonic() - t < self.idle_wait_s / 2:
            with self._cond:
                if not self._has_work():
                    self._cond.wait(self.idle_wait_s)

    def _finish_session(self, session: FinetuneSession, stopped: str | None = None) -> None:
        """Export the session's adapter and close it (its epochs done, given up, or stopped early:
        ``cancelled``, or ``stopped`` where given); ``paused``: with a checkpoint of the same step."""
        coserver = session.coserver
        # NOTE: before the outcome: the step the trainer has committed may be the job's last (a
        # job paused or cancelled as it completed has completed, with nothing left to resume).
        try:
            session.take_in_committed_step()
        except Exception:
            logger.exception("taking in the result of the last committed optimizer step failed")
        outcome = "failed" if coserver.failure is not None else "succeeded" if session.done else stopped or "cancelled"
        if coserver.failure is not None:
            logger.error("fine-tuning failed: %s; exporting the last committed step", coserver.failure)
        adapter: LoraAdapter | None = None
        path: Path | None = None
        try:
            # (the files written in the background: the engine's steps do not wait for the disk)
            path, adapter = session.export_in_background(checkpoint=stopped == "paused")
            logger.info("fine-tuning %s: %d optimizer steps, %d tokens; adapter: %s", outcome, coserver.steps_done,
                        coserver.tokens_trained, path)
        except Exception:
            logger.exception("exporting the fine-tuned adapter failed")
            path, adapter = None, None
        finally:
            # NOTE: the trainer finishes its task before it exits (a backward task's time, longer on
            # a busy CPU): off the loop thread, so that serving does not stall meanwhile
            session.detach()
            self.session = None
            self._exiting = [(t, s) for t, s in self._exiting if t.is_alive()]
            exiting = threading.Thread(target=_close_session, args=(session,), name="coserve-trainer-exit", daemon=True)
            exiting.start()
            self._exiting.append((exiting, session))
        final = replace(self.stats, coserving=True, adapter_path=path, ft_outcome=outcome,
                        ft_finished_at=time.time(), **_session_stats(session))
        if self.on_session_end is not None:
            try:
                final = self.on_session_end(session, final, adapter)
            except Exception:
                logger.exception("after fine-tuning job %s ended", session.job_id)
        self.ended[session.job_id] = final
        self.ends.append(final)
        self.stats = final

    def _publish(self) -> None:
        sched, blocks = self.engine.scheduler, self.engine.block_manager
        old = self.stats
        coserver = self.session.coserver if self.session is not None else None
        cache = (blocks.queried_tokens, blocks.hit_tokens) if blocks.enable_prefix_caching else None
        if coserver is None:
            self.stats = replace(old, num_running=len(sched.running), num_waiting=len(sched.waiting),
                                 prefix_cache=cache)
            return
        self.stats = replace(old, num_running=len(sched.running), num_waiting=len(sched.waiting),
                             prefix_cache=cache, **_finetune_stats(coserver))

    def _close(self) -> None:
        dead = EngineDeadError("the engine shut down before the request finished")
        with self._cond:
            self._closed = True
            pending = [s.handle for s in self._inbox]
            self._inbox.clear()
            calls = list(self._calls)
            self._calls.clear()
        for _, loop, future in calls:
            _settle(loop, future, None, dead)
        for rid, handle in list(self._handles.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("aborting %s at shutdown failed", rid)
            pending.append(handle)
        self._handles.clear()
        for handle in pending:
            handle.deliver(dead)
        if self.session is not None:
            pause = self.pause_at_stop is not None and self.pause_at_stop(self.session)
            self._finish_session(self.session, "paused" if pause else None)
        self._publish()

"""Continuous batching with chunked prefill, FCFS admission, preemption by recompute and
reuse of cached prefixes."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from coserve.engine.block_manager import BlockManager
from coserve.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_tokens`` tokens of ``seq`` starting at ``seq.num_computed_tokens`` run this step."""

    seq: Sequence
    num_tokens: int

    @property
    def context_len(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the sequence's known tokens, so a token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """One step's batch: prefill chunks first, then decodes (one token each)."""

    prefills: list[ScheduledChunk] = field(default_factory=list)
    decodes: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.prefills + self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefills) + len(self.decodes)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    """Decides, each step, which tokens of which sequences run.

    Order: decodes of running sequences, then unfinished prefills of running sequences, then
    waiting sequences in arrival order (FCFS: a waiting sequence that does not fit blocks the
    ones behind it). A step never carries more than ``max_num_batched_tokens`` tokens nor more
    than ``max_num_seqs`` running sequences. When a running sequence needs a block and none is
    free, the most recently admitted running sequence is preempted (its blocks freed, its
    progress recomputed later) and goes back to the front of the queue.

    ``acquire_adapter(seq) -> bool`` is asked before a sequence is admitted (it binds the
    sequence's adapter to a slot, or says that no slot is free now); ``release_adapter(seq)`` is
    called when a sequence leaves the running set.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        acquire_adapter: Callable[[Sequence], bool] | None = None,
        release_adapter: Callable[[Sequence], None] | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._acquire = acquire_adapter or (lambda seq: True)
        self._release = release_adapter or (lambda seq: None)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefilling = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decodes + prefilling:
            is_decode = seq.num_uncomputed_tokens == 1
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._reserve(seq, n, out):
                continue
            chunk = ScheduledChunk(seq, n)
            (out.decodes if is_decode else out.prefills).append(chunk)
            budget -= n
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Allocate blocks for ``seq``, preempting the latest-admitted others if needed."""
        while not self.block_manager.can_allocate(seq, n):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        self.block_manager.allocate(seq, n)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        # A chunk already scheduled for the victim this step must not run.
        out.prefills = [c for c in out.prefills if c.seq is not seq]
        out.decodes = [c for c in out.decodes if c.seq is not seq]

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = bm.match(seq)  # (a prefix whose KV is cached: its prefill starts after it)
            n = min(seq.num_uncomputed_tokens - len(cached) * bm.block_size, budget)
            if not bm.can_admit(seq, cached, n):
                break
            if not self._acquire(seq):
                break
            self.waiting.popleft()
            bm.reuse(seq, cached)
            bm.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.prefills.append(ScheduledChunk(seq, n))
            budget -= n

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free what it holds."""
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

"""Scheduler and block manager: budgets, FCFS, preemption, no leaked blocks."""

from __future__ import annotations

import random

import pytest

from coserve.engine.block_manager import BlockManager
from coserve.engine.sampling_params import SamplingParams
from coserve.engine.scheduler import Scheduler, SchedulerOutput
from coserve.engine.sequence import Sequence, SequenceStatus


def seq(rid: str, prompt_len: int, max_tokens: int = 4) -> Sequence:
    return Sequence(rid, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens))


def run_step(s: Scheduler, out: SchedulerOutput) -> list[Sequence]:
    """Pretend the model ran: advance progress, add a token to sampling rows, finish at max_tokens."""
    finished = []
    for c in out.chunks:
        samples = c.samples
        c.seq.num_computed_tokens += c.num_tokens
        if samples:
            c.seq.output_token_ids.append(0)
            if c.seq.num_output_tokens >= c.seq.sampling_params.max_tokens:
                s.finish(c.seq)
                finished.append(c.seq)
    return finished


def all_blocks(s: Scheduler) -> list[int]:
    seqs = list(s.running) + list(s.waiting)
    return [b for q in seqs for b in q.block_table] + list(s.block_manager._free)


def test_token_budget_never_exceeded_and_chunked_prefill() -> None:
    bm = BlockManager(64, 4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10)
    for i, n in enumerate([23, 5, 9]):
        s.add(seq(str(i), n))
    first = s.schedule()
    assert first.num_tokens == 10
    assert [c.num_tokens for c in first.prefills] == [10]  # FCFS: the head of the queue first
    assert not first.prefills[0].samples
    steps = 0
    while s.has_work:
        out = s.schedule()
        assert out.num_tokens <= 10
        run_step(s, out)
        steps += 1
        assert steps < 100
    assert sorted(bm._free) == list(range(64))


def test_decodes_are_scheduled_before_new_prefills() -> None:
    s = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    s.add(seq("a", 3, max_tokens=10))
    run_step(s, s.schedule())  # a's prefill, samples its first token
    s.add(seq("b", 30))
    out = s.schedule()
    assert [c.seq.request_id for c in out.decodes] == ["a"]
    assert out.prefills[0].seq.request_id == "b" and out.prefills[0].num_tokens == 7


def test_fcfs_head_of_line_blocks_smaller_requests() -> None:
    s = Scheduler(BlockManager(4, 4), max_num_seqs=8, max_num_batched_tokens=64)
    s.add(seq("a", 12))
    s.add(seq("b", 8))  # does not fit next to a
    s.add(seq("c", 1))  # would fit, but must not overtake b
    out = s.schedule()
    assert [c.seq.request_id for c in out.prefills] == ["a"]


def test_max_num_seqs_limits_running_set() -> None:
    s = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(4):
        s.add(seq(str(i), 3))
    out = s.schedule()
    assert len(out.prefills) == 2 and len(s.running) == 2


def test_preemption_by_recompute_frees_and_requeues_latest() -> None:
    bm = BlockManager(3, 4)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq("a", 4, max_tokens=6), seq("b", 4, max_tokens=6)
    s.add(a)
    s.add(b)
    run_step(s, s.schedule())  # both prefilled: 1 block each, 1 free
    out = s.schedule()  # a's decode takes the last block; b's needs one: b (latest) is preempted
    assert [c.seq for c in out.decodes] == [a]
    assert out.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert s.waiting[0] is b
    assert all(c.seq is not b for c in out.chunks)
    while s.has_work:
        run_step(s, s.schedule())
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6
    assert sorted(bm._free) == [0, 1, 2]


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_keeps_block_invariants(seed: int) -> None:
    rng = random.Random(seed)
    bm = BlockManager(24, 4)
    s = Scheduler(bm, max_num_seqs=5, max_num_batched_tokens=rng.choice([6, 16, 64]))
    live: list[Sequence] = []
    for step in range(300):
        if rng.random() < 0.3:
            q = seq(f"r{step}", rng.randint(1, 40), max_tokens=rng.randint(1, 20))
            s.add(q)
            live.append(q)
        if live and rng.random() < 0.05:  # abort a random live request
            victim = rng.choice(live)
            s.finish(victim)
            live.remove(victim)
        out = s.schedule()
        assert out.num_tokens <= s.max_num_batched_tokens
        assert len(s.running) <= s.max_num_seqs
        for q in run_step(s, out):
            live.remove(q)
        blocks = all_blocks(s)
        assert sorted(blocks) == list(range(24)), "a block leaked or is owned twice"
    while s.has_work:
        for q in run_step(s, s.schedule()):
            live.remove(q)
    assert not live and bm.num_free_blocks == 24

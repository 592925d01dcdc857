"""The sample pool that fine-tuning admission draws from: epochs, order, claims, resume.

:class:`SamplePool` hands samples out over several epochs in a deterministic, resumable order.
The engine looks at a bounded lookahead window (:meth:`SamplePool.candidates`), claims the
samples it puts in a batch, and later retires them (optimizer step done) or releases them (step
interrupted, they come back).
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import sys
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Final, NamedTuple

import torch

from coserve.core.finetune import FTSample, is_int

logger = logging.getLogger(__name__)


class PoolProgress(NamedTuple):
    """Retired work of a :class:`SamplePool`; ``samples_total`` is ``epochs * len(samples)``."""

    samples_retired: int
    samples_total: int
    tokens_retired: int
    target_tokens_retired: int


_STATE_VERSION: Final = 1
_PERM_CACHE_EPOCHS: Final = 3


def _epoch_seed(seed: int, epoch: int) -> int:
    # A hash rather than arithmetic so that (seed, epoch) pairs never collide.
    digest = hashlib.blake2b(f"coserve-pool/{seed}/{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class SamplePool:
    """The samples that fine-tuning admission draws from, over ``epochs`` epochs.

    The pool walks a *stream* of ``epochs * len(samples)`` positions: epoch ``e`` visits the
    samples in the order of ``torch.randperm`` drawn from a ``torch.Generator`` seeded from
    ``(seed, e)`` (the identity order if ``shuffle`` is false). Every position is eventually
    claimed and retired exactly once.

    Life cycle of a sample occurrence: candidate -> :meth:`claim` -> in flight -> :meth:`retire`
    (done) or :meth:`release` (back to candidate). Unclaimed occurrences are always ordered by
    stream position, so a released sample is ahead of every sample that entered the stream after
    it. :meth:`candidates` shows the first ``window`` unclaimed occurrences, skipping a sample
    whose earlier occurrence is in flight or already shown. The window never reaches past the
    oldest unfinished epoch, so shortest-first admission cannot starve long samples. Hence the public API can name samples by
    ``sample_id``: a sample is never in flight twice and never a candidate twice.

    Cost per call is O(window + in-flight samples); the permutation of an epoch is drawn once when
    the stream first reaches it (O(len(samples)), amortised O(1) per sample).
    """

    def __init__(
        self,
        samples: Sequence[FTSample],
        *,
        epochs: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        window: int = 64,
    ) -> None:
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._samples = tuple(samples)
        self._index_of: dict[int, int] = {}
        for i, s in enumerate(self._samples):
            if s.sample_id in self._index_of:
                raise ValueError(f"duplicate sample_id {s.sample_id}")
            self._index_of[s.sample_id] = i
        self._n = len(self._samples)
        self._epochs = epochs
        self._seed = seed
        self._shuffle = shuffle
        self._window = window
        self._orders: OrderedDict[int, list[int]] = OrderedDict()
        self._fingerprint: int | None = None
        self._reset_progress()

    def _reset_progress(self) -> None:
        # Stream positions < _cursor are retired, in flight, or pending (unclaimed).
        self._cursor = 0
        # Pending occurrences by sample index (sorted positions; one sample can have several
        # when the stream moved into later epochs past it), plus the sorted (first position,
        # sample index) heads that give the candidate order.
        self._copies: dict[int, list[int]] = {}
        self._heads: list[tuple[int, int]] = []
        self._in_flight: dict[int, int] = {}  # sample index -> stream position
        self._retired = 0
        self._tokens_retired = 0
        self._targets_retired = 0

    # -- public API --------------------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        return self._n

    @property
    def epochs(self) -> int:
        return self._epochs

    @property
    def window(self) -> int:
        return self._window

    @property
    def epoch(self) -> int:
        """0-based epoch of the oldest occurrence not yet retired; ``epochs`` once :attr:`done`."""
        if self._n == 0:
            return self._epochs
        oldest = self._cursor
        if self._heads:
            oldest = min(oldest, self._heads[0][0])
        if self._in_flight:
            oldest = min(oldest, min(self._in_flight.values()))
        return oldest // self._n

    @property
    def done(self) -> bool:
        """True once every occurrence of every epoch has been retired."""
        return self._retired == self._total

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def in_flight_ids(self) -> tuple[int, ...]:
        """sample_ids currently claimed and neither retired nor released, in claim order."""
        return tuple(self._samples[i].sample_id for i in self._in_flight)

    @property
    def progress(self) -> PoolProgress:
        return PoolProgress(
            samples_retired=self._retired,
            samples_total=self._total,
            tokens_retired=self._tokens_retired,
            target_tokens_retired=self._targets_retired,
        )

    def order(self, epoch: int) -> list[int]:
        """The indices into ``samples`` in the order epoch ``epoch`` visits them (a copy)."""
        if not 0 <= epoch < self._epochs:
            raise ValueError(f"epoch {epoch} outside [0, {self._epochs})")
        return list(self._order(epoch))

    def candidates(self) -> list[FTSample]:
        """Up to ``window`` next unclaimed samples in stream order (distinct, none in flight).

        Pure: calling it does not change the pool. Admission orders them itself.
        """
        return [self._samples[idx] for _, idx in self._scan()]

    def claim(self, sample_ids: Sequence[int]) -> None:
        """Marks candidates as in flight. All-or-nothing.

        Raises:
            ValueError: an id is repeated, unknown, or not among the current :meth:`candidates`.
        """
        indices = self._resolve(sample_ids)
        visible = {idx: pos for pos, idx in self._scan()}
        for sid, idx in zip(sample_ids, indices, strict=True):
            if idx not in visible:
                raise ValueError(f"sample_id {sid} is not a candidate")
        claimed_fresh: set[int] = set()
        for idx in indices:
            pos = visible[idx]
            if pos < self._cursor:
                self._pending_pop_head(idx)
            else:
                claimed_fresh.add(pos)
            self._in_flight[idx] = pos
        if claimed_fresh:
            # Positions the claim jumped over stay unclaimed; all lie inside the scanned range.
            new_cursor = max(claimed_fresh) + 1
            for pos in range(self._cursor, new_cursor):
                if pos not in claimed_fresh:
                    self._pending_add(pos, self._index_at(pos))
            self._cursor = new_cursor

    def release(self, sample_ids: Sequence[int]) -> None:
        """Returns in-flight samples to the candidates at their stream position. All-or-nothing.

        Raises:
            ValueError: an id is repeated, unknown, or not in flight.
        """
        for idx in self._resolve_in_flight(sample_ids):
            self._pending_add(self._in_flight.pop(idx), idx)

    def retire(self, sample_ids: Sequence[int]) -> None:
        """Marks in-flight samples as done (their optimizer step finished). All-or-nothing.

        Raises:
            ValueError: an id is repeated, unknown, or not in flight.
        """
        for idx in self._resolve_in_flight(sample_ids):
            del self._in_flight[idx]
            s = self._samples[idx]
            self._retired += 1
            self._tokens_retired += s.num_tokens
            self._targets_retired += s.num_target_tokens

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable progress. In-flight samples are saved as not retired.

        Loading it into a fresh pool over the same samples and seed gives the state this pool
        would have after releasing everything in flight, hence the same future candidates.
        """
        unretired = [p for copies in self._copies.values() for p in copies]
        unretired.extend(self._in_flight.values())
        return {
            "version": _STATE_VERSION,
            "num_samples": self._n,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "epochs": self._epochs,
            "order_fingerprint": self._order_fingerprint(),
            "cursor": self._cursor,
            "unretired": sorted(unretired),
            "samples_retired": self._retired,
            "tokens_retired": self._tokens_retired,
            "target_tokens_retired": self._targets_retired,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` output; nothing is in flight afterwards.

        ``window`` may differ from the saved pool's; ``epochs`` may differ as long as the saved
        progress fits (e.g. to extend training).

        Raises:
            ValueError: malformed state, or a mismatch in sample count, seed, shuffle or the
                permutation itself (e.g. a torch version that draws different permutations).
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported SamplePool state (expected version {_STATE_VERSION})")
        for key, expected in (
            ("num_samples", self._n),
            ("seed", self._seed),
            ("shuffle", self._shuffle),
        ):
            if state.get(key) != expected:
                raise ValueError(
                    f"SamplePool state mismatch: {key}={state.get(key)!r}, pool has {expected!r}"
                )
        if state.get("order_fingerprint") != self._order_fingerprint():
            raise ValueError("SamplePool state mismatch: sample order differs from the saved one")
        try:
            cursor = state["cursor"]
            unretired = state["unretired"]
            counters = [
                state[k] for k in ("samples_retired", "tokens_retired", "target_tokens_retired")
            ]
        except KeyError as e:
            raise ValueError(f"SamplePool state lacks {e}") from None
        if not is_int(cursor) or not 0 <= cursor <= self._total:
            raise ValueError(f"SamplePool state: cursor {cursor!r} outside [0, {self._total}]")
        if (
            not isinstance(unretired, list)
            or not all(is_int(p) and 0 <= p < cursor for p in unretired)
            or len(set(unretired)) != len(unretired)
        ):
            raise ValueError("SamplePool state: 'unretired' must be distinct positions < cursor")
        if not all(is_int(c) and c >= 0 for c in counters) or counters[0] != cursor - len(
            unretired
        ):
            raise ValueError("SamplePool state: inconsistent retired counters")

        self._reset_progress()
        for pos in sorted(unretired):
            self._pending_add(pos, self._index_at(pos))
        self._cursor = cursor
        self._retired, self._tokens_retired, self._targets_retired = counters

    # -- internals ---------------------------------------------------------------------------

    @property
    def _total(self) -> int:
        return self._epochs * self._n

    def _order(self, epoch: int) -> list[int]:
        order = self._orders.get(epoch)
        if order is None:
            if self._shuffle:
                gen = torch.Generator().manual_seed(_epoch_seed(self._seed, epoch))
                order = torch.randperm(self._n, generator=gen).tolist()
            else:
                order = list(range(self._n))
            self._orders[epoch] = order
            if len(self._orders) > _PERM_CACHE_EPOCHS:
                self._orders.popitem(last=False)
        else:
            self._orders.move_to_end(epoch)
        return order

    def _index_at(self, pos: int) -> int:
        epoch, offset = divmod(pos, self._n)
        return self._order(epoch)[offset]

    def _order_fingerprint(self) -> int:
        if self._fingerprint is None:
            buf = array("q", self._order(0) if self._n else [])
            if sys.byteorder != "little":
                buf.byteswap()
            self._fingerprint = zlib.crc32(buf.tobytes())
        return self._fingerprint

    def _scan(self) -> list[tuple[int, int]]:
        """The current candidates as ``(stream position, sample index)``, in stream order."""
        limit = min(self._window, self._n - len(self._in_flight))
        out: list[tuple[int, int]] = []
        if limit <= 0:
            return out
        # NOTE: the window stops at the end of the oldest unfinished epoch. Admission takes the
        # shortest candidates first; a window reaching into the next epoch would offer the short
        # samples again and again and starve the long ones.
        end = min(self._total, (self.epoch + 1) * self._n)
        for pos, idx in self._heads:
            if pos >= end:
                break
            if idx not in self._in_flight:
                out.append((pos, idx))
                if len(out) == limit:
                    return out
        # Every pending sample not in flight is in `out` now, so `seen` covers all duplicates.
        # The loop ends within about two epochs' worth of skips: a full epoch visits every
        # sample, after which out + in-flight covers all of them and `limit` is reached.
        seen = {idx for _, idx in out}
        pos = self._cursor
        while pos < end and len(out) < limit:
            idx = self._index_at(pos)
            if idx not in self._in_flight and idx not in seen:
                out.append((pos, idx))
                seen.add(idx)
            pos += 1
        return out

    def _pending_add(self, pos: int, idx: int) -> None:
        copies = self._copies.get(idx)
        if copies is None:
            self._copies[idx] = [pos]
            bisect.insort(self._heads, (pos, idx))
            return
        old_head = copies[0]
        bisect.insort(copies, pos)
        if pos < old_head:
            self._remove_head(old_head, idx)
            bisect.insort(self._heads, (pos, idx))

    def _pending_pop_head(self, idx: int) -> None:
        copies = self._copies[idx]
        head = copies.pop(0)
        self._remove_head(head, idx)
        if copies:
            bisect.insort(self._heads, (copies[0], idx))
        else:
            del self._copies[idx]

    def _remove_head(self, pos: int, idx: int) -> None:
        i = bisect.bisect_left(self._heads, (pos, idx))
        assert self._heads[i] == (pos, idx), "pending heads out of sync"
        del self._heads[i]

    def _resolve(self, sample_ids: Sequence[int]) -> list[int]:
        if len(set(sample_ids)) != len(sample_ids):
            raise ValueError(f"repeated sample_id in {list(sample_ids)}")
        indices = []
        for sid in sample_ids:
            idx = self._index_of.get(sid)
            if idx is None:
                raise ValueError(f"unknown sample_id {sid}")
            indices.append(idx)
        return indices

    def _resolve_in_flight(self, sample_ids: Sequence[int]) -> list[int]:
        indices = self._resolve(sample_ids)
        for sid, idx in zip(sample_ids, indices, strict=True):
            if idx not in self._in_flight:
                raise ValueError(f"sample_id {sid} is not in flight")
        return indices

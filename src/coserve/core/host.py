"""The contract between coserve and the inference engine it runs inside (the host).

A host calls a :class:`CoServer` at five points (DESIGN §5); everything else — request
handling, batching, KV management, sampling, CUDA graphs — stays the host's own.

1. ``plan(view) -> list[FTRow]`` right before the host dispatches a step. The host adds the
   returned rows to the step as prefill-only rows on the training adapter slot that write no KV
   cache, compute no logits and emit no token, placed after its own prefill rows and before its
   decode rows, in the order returned. ``plan`` may claim samples and reserve activation space;
   it must not touch the host's state.
2. ``on_layer(layer, hidden)`` inside the forward pass, at the residual-stream input of every
   decoder layer and once after the last one (``layer == num_layers``, before the final norm).
   ``hidden`` is the whole batch ``[T, d]``; the fine-tuning rows are the ``ft_tokens`` tokens
   starting at ``ft_start`` (both given by the host in :meth:`CoServer.begin_step`). It may read
   ``hidden``; it must not change it. It may raise :class:`Interrupted` in an FT-only step.
3. ``on_step_end(record)`` after the step's outputs are known: measured time, batch features,
   mode. Retires the step's fine-tuning rows and hands full backward tasks to the trainer.
4. ``on_blocks_needed(n) -> blocks`` when the host's block manager runs out of KV blocks
   (not yet: activations live in a buffer of their own until the shared KV/activation pool of
   DESIGN §9 exists).
5. ``calibrate(run_batch)`` after the host's warm-up, before serving (the built-in host:
   ``LLMEngine.calibrate``).

What a host lends: the training adapter's weight tensors (a reserved slot of its multi-LoRA
batching, updated in place only), the base weights, and (later) its KV pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class Interrupted(Exception):
    """Raised from ``on_layer`` to abandon an FT-only step because inference work arrived."""


@dataclass(frozen=True)
class PrefillView:
    """One inference prefill chunk of the proposed step."""

    num_tokens: int
    context_len: int
    arrival_time: float


@dataclass(frozen=True)
class StepView:
    """The inference batch a host is about to run, as coserve needs to see it.

    ``token_budget`` is how many more tokens (of any row kind) the host accepts in this step.
    ``num_waiting`` / ``oldest_waiting_arrival`` describe requests queued behind the step;
    ``waiting_prefill_tokens`` is how many prompt tokens those requests still need prefilled.
    ``prefill_remaining[i]`` is how many prompt tokens the request of ``prefills[i]`` still needs
    after this step (chunked prefill); empty means every chunk finishes its prompt, so its first
    token comes at the end of this step. Admission uses both to price the work ahead of a first
    token (DESIGN §7).

    ``mode`` is how the host will run the inference batch as it is (``graph`` or ``eager``);
    ``ft_graph_tokens`` the most tokens (inference and FT rows together) a step with FT rows may
    carry and still run in ``graph`` mode, provided none of its FT rows has a ``dropout_key`` and
    the step needs no MLP hook (0: FT rows make the step ``eager``).

    ``now`` is when the view was taken and ``step_began`` when the host began the step, before
    scheduling it (None: the host does not say). A host that gives ``step_began`` reads both on
    ``time.monotonic()``; the latency model then prices the step from the point where admission
    decides (the co-server moves ``now`` there): the host time the step spent before it is known,
    counts against the step's TPOT slack (:func:`coserve.core.admission.slack`) and is added to
    the prediction as measured.
    """

    now: float
    prefills: tuple[PrefillView, ...] = ()
    num_decodes: int = 0
    decode_kv_tokens: int = 0
    mode: str = "eager"
    token_budget: int = 0
    num_waiting: int = 0
    oldest_waiting_arrival: float | None = None
    waiting_prefill_tokens: int = 0
    prefill_remaining: tuple[int, ...] = ()
    ft_graph_tokens: int = 0
    step_began: float | None = None
    # the longest decode row's KV tokens (0: none, or a host that does not say): a decode batch's
    # attention waits in part on its longest row (coserve.core.latency.DECODE_KV)
    decode_kv_max: int = 0

    @property
    def planned_s(self) -> float:
        """Host seconds from the step's start to ``now`` (0 where the host does not say)."""
        return max(0.0, self.now - self.step_began) if self.step_began is not None else 0.0

    @property
    def has_inference(self) -> bool:
        return bool(self.prefills) or self.num_decodes > 0

    @property
    def num_prefill_tokens(self) -> int:
        return sum(p.num_tokens for p in self.prefills)


@dataclass(frozen=True)
class FTRow:
    """A fine-tuning sample placed in a step.

    ``dropout_key`` (set when the training adapter uses LoRA dropout): the host must draw the
    row's dropout masks with this key (``coserve.layers.lora.RowDropoutLoRA``), because the
    trainer recomputes the row with the same masks.
    """

    sample_id: int
    token_ids: tuple[int, ...]
    dropout_key: int | None = None


@dataclass(frozen=True)
class StepRecord:
    """What a step was and how long it took (latency-model training data).

    ``ft_lens`` holds the token count of each FT row in ``ft_rows`` order (it sums to
    ``ft_tokens``); ``trainer_busy`` says a backward task ran beside the step. ``timed`` False:
    the host returned before the step's GPU work ended, so ``duration_s`` is only its host time;
    the host hands the real duration to :meth:`coserve.core.coserver.CoServer.observe_late` once
    it knows it (:mod:`coserve.engine.step_clock`). ``schedule_s`` / ``enqueue_s``: host seconds
    spent planning the step and then queuing its device work, and ``gpu_s`` the device's seconds
    between two events around the step's forward (its kernels and any wait for the host to queue
    them; None where the host does not say or did not time it), ``enqueue_cpu_s`` the host
    thread's CPU time while it queued them (below ``enqueue_s``: the thread waited or was
    descheduled); they go to the step table only, to tell a host-bound step from a device-bound
    one, and the device's spread from the host's.
    """

    view: StepView
    ft_tokens: int
    duration_s: float
    mode: str = "eager"
    interrupted: bool = False
    ft_rows: tuple[int, ...] = field(default_factory=tuple)
    ft_lens: tuple[int, ...] = ()
    trainer_busy: bool = False
    timed: bool = True
    schedule_s: float | None = None
    enqueue_s: float | None = None
    gpu_s: float | None = None
    enqueue_cpu_s: float | None = None

"""Step latency model (DESIGN §6): features, coefficient sets per form and mode, NNLS fit.

A step is priced by one of two linear forms over its batch composition:

* prefill-carrying (any prefill chunk or FT row):
  ``T = a·Σ_i (n_i + B_d)² + b·(T_in + B_d) + g·T_ft + e·K + h·Σ_i n_i·ctx_i + i·[some ctx_j > 0]
  + k·max(0, T_in + B_d − K_knee) + c``
* decode-only: ``T = b'·B_d + e'·K + c'``

``n_i`` are the prefill rows' lengths (inference chunks and FT rows), ``T_in = Σ n_i``, ``B_d``
the decode rows, ``T_ft`` the FT tokens (extra cost of capturing their activations), ``K`` the
KV tokens read by decode rows and ``ctx_i`` the cached context a chunk attends to (0 for FT rows).
``k`` is a second slope for the tokens above a knee of ``K_knee`` (:data:`KNEE_TOKENS`, 512): a
step below it reads the weights whatever its batch, so its time falls more slowly with its tokens
than one slope from 32 to 2,048 tokens gives; written as the slope added above the knee, every
coefficient stays non-negative and a longer step never predicts shorter (admission's greedy fill
relies on it). Offline, replayed on the 28 recorded tables of sessions 20–30 with the lone
prompts' level (``bench/latency_fit.py``'s ``over_512_lone`` against ``lone_level``,
``bench/results/latency_h100/session31/latency_fit_over.json``), the prefill sets' held-out p99
was lower on 24 tables (by up to 10.4 points; on the twelve whole-GPU H100 graph tables 9.5–13.3%
against 13.4–22.9%) and higher on four (by 2.1–3.4 points: three H200 tables and the engine-split
H100 one).
``i`` is a constant for a step with at least one chunk over cached context, whatever its size:
on the H200, through the piecewise prefill graphs, such a step took ~4.2 ms more than the rest of
the form predicts. In two runs, that one term took the refitted form's held-out p99 from 27.0%
to 18.4% and from 31.0% to 20.4%, and this model's, replayed online, from 26.8% to 12.7% and
from 29.4% to 18.2% (``bench/latency_fit.py``: ``no_context_constant`` against ``linear``,
``replay``; ``bench/results/latency_h200/session13/``, ``session14/``).

Each form has one coefficient set per mode (``graph``: a decode step replayed from a CUDA graph,
or a prefill-carrying step through the host's piecewise graphs; ``eager``). A step with FT rows
is ``graph`` only where the host says that one of its size still runs through its graphs
(:attr:`StepFeatures.ft_graph_tokens`). A backward task running beside the step (``busy``) slows it by a fitted
``T_busy = (1 + ρ)·T + δ`` per form, mode and :data:`TRAINER_PHASES` phase (what the trainer's GPU
runs as the step begins), so the idle coefficients stay those of a quiet GPU.
All coefficients are fitted by non-negative least squares on relative error.

On top of the linear form, each decode set carries a level: an exponentially weighted mean of
``log(measured / linear prediction)`` over its recent steps, by which its predictions are scaled.
Decode steps beside the backward drift by 10–15% for tens of steps at a time (from one backward
task to the next), which a refit over a 2,000-step window cannot follow; prefill sets mix step
sizes whose errors differ, and a shared level made their held-out error worse
(``bench/latency_fit.py``, ``replay``; ``bench/results/latency_h200/session11/``). A decode key's
busy sets start with a level each (per trainer phase, rate :data:`LEVEL_RATE`); once the key has
:data:`SHARE_AFTER_STEPS` busy steps, each phase whose busy set has its own fitted ``(ρ, δ)``
moves to one level shared by the key's busy phases, at :data:`SHARED_LEVEL_RATE`: the drift is the
backward's, whatever the phase, so every busy step teaches it (offline on eleven H200 tables, the
held-out p99 fell on all eleven, from 15.0–20.2% to 13.2–18.7%, and neither all steps nor the
first 500 got worse; ``bench/latency_decode.py``, ``bench/results/latency_h200/README.md``,
session 24). Sharing earlier, or at the slower rate, raised start-up error. A busy decode step
whose trainer is at one of a few :data:`SPOTS` of its backward (the loss's boundaries, the first
layer after it, layer 1) carries a level of that spot on top (:data:`SPOT_LEVELS`), and a prefill
step of a short chunk over cached context beside fresh rows one of its own (:data:`MIX_LEVEL`).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, NamedTuple

import numpy as np
import torch

from coserve.core.host import PrefillView, StepRecord, StepView
from coserve.core.nnls import fit_relative

logger = logging.getLogger(__name__)

MODES: Final = ("graph", "eager")
TERMS: Final[dict[str, tuple[str, ...]]] = {
    "prefill": ("a_sq", "b_tokens", "g_ft", "e_kv", "h_ctx", "i_ctx", "k_over", "c"),
    "decode": ("b_decodes", "e_kv", "c"),
}
LEGACY_PREFILL_TERMS: Final = ("a_sq", "b_tokens", "g_ft", "e_kv", "h_ctx", "c")
"""``TERMS["prefill"]`` before ``i_ctx``: of a version-1 :meth:`LatencyModel.state_dict` and of
the step tables recorded until then (see :func:`from_legacy_prefill`)."""
V2_PREFILL_TERMS: Final = ("a_sq", "b_tokens", "g_ft", "e_kv", "h_ctx", "i_ctx", "c")
"""``TERMS["prefill"]`` before ``k_over``: of a version-2 state and of the step tables recorded
until session 31."""
B_TOKENS: Final = TERMS["prefill"].index("b_tokens")
K_OVER: Final = TERMS["prefill"].index("k_over")
_E_KV: Final = {form: terms.index("e_kv") for form, terms in TERMS.items()}  # (per form: with_decode_kv)
KNEE_TOKENS: Final = int(os.environ.get("COSERVE_KNEE_TOKENS", "512"))
"""``LatencyModel``'s default ``knee_tokens``, ``K_knee`` of the prefill form (module docstring):
the bucketed tokens (``T_in + B_d``) above which a step pays the slope ``k_over`` too
(``COSERVE_KNEE_TOKENS``; 0: no knee, the model before session 31, for a same-host baseline).
On the H100 in session 31, two runs with it against two without on one host
(``bench/results/latency_h100/README.md``, "Session 31"): the prefill set's p99 over each table's
second half 9.7 / 10.9% against 13.1 / 14.8%, the idle replay's prefill 9.5 / 11.1% against
13.1 / 13.9%; over all steps 17.8 / 13.0% against 12.4 / 13.9% (the first run's tail: mid-size
prompts beside 31-47 decodes at 1.2-1.3x, in its first half)."""
KEYS: Final = tuple(f"{form}/{mode}" for form in TERMS for mode in MODES)
DEFER_CAP: Final = 4
"""With :attr:`LatencyModel.defer_refits`, a set refits on the step path anyway once this many
refit intervals have passed without the host asking for its due refits."""
DEFER_FROM_ROWS: Final = int(os.environ.get("COSERVE_DEFER_FROM_ROWS", "500"))
"""``LatencyModel``'s default ``defer_from_rows``: with :attr:`LatencyModel.defer_refits`, a set
whose window holds fewer rows than this refits on the step path as soon as due
(``COSERVE_DEFER_FROM_ROWS``; 0: every refit deferred, the model until session 32). While a window
grows, ``DEFER_CAP`` times its growing refit interval is never reached by the steps since the
last refit: with no idle host (a busy run) a set refitted at its 40th step and next at its 440th
(session 31, the H100: prompts beside many decodes at 1.2-1.4x their prediction in between,
``bench/latency_refits.py``). Such a refit, on at most this many rows, adds its host time to the
step path (``bench/refit_cost.py``, ``bench/results/host_cpu/session32/refit_cost.json``, the
2-core dev VM: an observe's p99 0.05 ms with every refit deferred, 0.27 ms from 500 rows, at most
1.09 ms, 0.49 ms with every refit on the step path, at most 11.5 ms). Offline at 500 against 0, replayed on the
33 tables of sessions 20-31 (``bench/latency_fit.py --replay-only``,
``bench/results/latency_h100/session31/latency_replay_defer{0,500}_{all,held}.json.gz``): over all
steps the prefill sets' p99 lower on 26 of 33 (median -1.0 points), busy decode's on 29 (median
-0.7); over each table's second half higher on 21 and 18 (medians +0.4 and +0.1, at most +1.3).
On the H100 in session 32 (one host, ``bench/results/latency_h100/README.md``), two runs at 500
against four at 0: p99 over all steps 12.7 / 12.7% against 13.7-15.1%, the prefill set's 10.3 /
11.0% against 13.1-13.8%, busy decode's 13.3 / 13.0% against 13.7-15.2%; pause p99 1.86 / 1.96 ms
against 1.63-1.91 ms; every request met its SLO."""
TRAINER_PHASES: Final = ("active", "quiet", "starting", "ending", "loss")
"""What a busy step runs beside: ``active`` the backward's layers; ``quiet`` its
optimizer commit or nothing (the task's GPU work is done, its result not yet read); ``starting``
a task that the worker is starting (its set-up and first kernels); ``ending`` the backward's last
layer (layer 0), after which the task's GPU work stops within the step. On the H200, against
``active``, decode steps beside ``quiet`` ran ~0.8× and beside ``starting`` ~1.1×
(``bench/results/latency_h200/session11/``), and beside layer 0 0.89–0.96× their prediction
(session 27). ``ending`` is its
own phase only for a decode key past :data:`PHASE_AFTER_STEPS` busy steps
(:attr:`LatencyModel.ending_after`; before, and for prefill keys, it is ``active``): offline on
the fourteen recorded tables of sessions 20–26, the busy decode set's held-out p99 fell on all
fourteen (by 0.1–2.6 points), its p99 over all steps on 10 of the 11 default-mode tables (the
eleventh +0.02), the first 500 steps unchanged by construction; from the first step, a new
phase set's level starting at 0 raised one table's first-500 p99 from 14.2% to 23.0%
(``bench/latency_fit.py --phase-forms-only``, ``bench/results/latency_h200/README.md``).
``loss`` the loss over the vocabulary, before the layers (boundary ``num_layers``: the LM head's
GEMMs over up to :data:`coserve.trainer.backward.LOSS_CHUNK` targets), gated as ``ending`` is; with
``LOSS_PHASE`` off, ``active``."""
LOSS_PHASE: Final = os.environ.get("COSERVE_LOSS_PHASE", "1") == "1"
"""Whether a host prices steps beside the backward's loss as phase ``loss`` (``COSERVE_LOSS_PHASE``;
``0``: as ``active``, the model before session 33; :func:`trainer_phase`'s ``loss_layer``). On
the H100 in sessions 31-33, the busy decode steps beside it ran a median 1.02-1.04x their
prediction in each of twelve runs, with 5-14% of them over 10% off (1% elsewhere), and 1.06-1.10x
(30-53% over 10%) right after a prefill step, when the paused loss resumes with the decode step.
Offline, replaying twelve of those runs whole (each with its trainer-idle and warm replays, polls
where the engine was empty; ``bench/results/latency_h100/README.md``, "Session 33"), the busy
decode p99 over each cold run's second half fell on 11 of 12 (by up to 1.8 points; one +0.1), over
the six warm replays from 9.5-10.7% to 9.0-9.6%; over each first half -0.5 to +0.7 points (a new
phase set learns from few steps there)."""
PHASES_IN_USE: Final = TRAINER_PHASES if LOSS_PHASE else tuple(p for p in TRAINER_PHASES if p != "loss")
"""The :data:`TRAINER_PHASES` a host of this build gives its steps (what a step table records)."""
# NOTE: the stream gate's boundary labels (coserve.trainer.stream_gate COMMIT / TASK_START; core
# does not import the trainer, tests/core/test_latency.py checks they agree)
_COMMIT: Final = -1
_TASK_START: Final = -2
# NOTE: placeholders until calibration, deliberately slow (a few times an 8B model on one H200)
# so that an uncalibrated server admits little fine-tuning rather than breaking SLOs.
DEFAULT_COEFFICIENTS: Final[dict[str, tuple[float, ...]]] = {
    "prefill": (3e-9, 1e-4, 1e-6, 1e-7, 3e-9, 0.01, 0.0, 0.02),
    "decode": (2e-4, 1e-7, 0.02),
}
_STATE_VERSION: Final = 3  # 2: i_ctx among the prefill terms; 3: k_over and knee_tokens (1, 2 migrated on load)
_ANY_SIZE: Final = 2**62  # ft_graph_tokens of a step known to have run in graph mode


def trainer_phase(at: tuple[int, int] | None, previous: str, loss_layer: int | None = None) -> str:
    """The :data:`TRAINER_PHASES` phase of a task in flight whose GPU passed boundary ``at`` last
    (``None``: not in a task), given the phase read for the step before (``"starting"`` when no
    task was in flight then): ``None`` after a commit or a running task is the finished task
    (``quiet``); before any of its boundaries, the task just handed over (``starting``); a
    boundary of layer 0, the backward's last layer, ``ending``; of ``loss_layer`` (the model's
    ``num_layers``, where the host prices the loss apart: :data:`LOSS_PHASE`), ``loss``."""
    if at is None:
        return "starting" if previous == "starting" else "quiet"
    if at[0] == _COMMIT:
        return "quiet"
    if at[0] == _TASK_START:
        return "starting"
    if loss_layer is not None and at[0] == loss_layer:
        return "loss"
    return "ending" if at[0] == 0 else "active"


SPOTS: Final = ("loss_first", "loss_mid", "loss_late", "after_loss", "before_last")
"""Where in its backward a busy step's trainer is, as far as the step's time tells it apart from
the rest of its phase (:func:`trainer_spot`): the loss's boundaries by ordinal (the first two, the
first chunk's logits and softmax, whose stretch a step after a pause often begins with; up to the
fifth; the later ones, the loss's end), the first layer after the loss, and the layer before the
last (layer 1: a step begun there runs into layer 0 and the task's end). Each carries a level of
its own on a busy decode set (:data:`SPOT_LEVELS`)."""


SPOT_GRAINS: Final = ("boundary", "phase")
SPOT_GRAIN: Final = os.environ.get("COSERVE_SPOT_GRAIN", "boundary")
"""How finely :func:`trainer_spot` tells the loss and the first layer after it apart (each spot a
level of its own, :data:`SPOT_LEVELS`): ``boundary`` (default), a spot per boundary of each,
``loss@K`` and ``after_loss@K`` with K the boundary's ordinal in its layer, whatever boundaries
the backward has there (:data:`coserve.trainer.backward.LOSS_GEMM_PIECES` adds some to the loss);
``phase`` (``COSERVE_SPOT_GRAIN=phase``, the model of sessions 36-41): the three loss spots of
:data:`SPOTS` by ordinal, counted for a loss chunk of three boundaries, and one for the layer.
The steps beside the first layer after the loss differ by boundary: on the H100 in session 41
those beside its last boundary ran a median 1.06 times their prediction (7 of 25 over 10% off),
beside its boundaries 0, 2 and 4 0.94-0.96 (``bench/results/latency_h100/session41/``), where
one level for the layer misses both ways. Offline, each step table of the 31 busy H100 runs of
sessions 33-41 replayed whole by both grains (``bench/latency_ab.py``,
``bench/results/latency_h100/session41/spot_grain.json``): the cold p99 over all steps lower on
18 tables, higher on 7 (by at most 0.53 points), within 0.01 on 6 (mean -0.14 points); on the 24
of sessions 33-40, which did not suggest it, lower on 11 and higher on 7 (mean -0.06); on the
two with ``COSERVE_LOSS_GEMM_PIECES=2`` (session 41; the default since), whose loss ordinals the
phase grain counts for one piece, 10.97 -> 9.97% and 10.27 -> 9.94%. The eleven warm replays
were neither better nor worse (all steps lower on 4, higher on 4, mean +0.06 points)."""
BOUNDARY_SPOTS: Final = ("loss", "after_loss")
"""The names of :data:`SPOT_GRAIN` ``boundary``'s spots (each followed by ``@`` and an ordinal)."""
if SPOT_GRAIN not in SPOT_GRAINS:
    raise ValueError(f"COSERVE_SPOT_GRAIN must be one of {', '.join(SPOT_GRAINS)}, got {SPOT_GRAIN!r}")


def is_spot(name: str) -> bool:
    """Whether ``name`` is a spot :func:`trainer_spot` gives, of either grain."""
    if name in SPOTS:
        return True
    prefix, at, ordinal = name.partition("@")
    return bool(at) and prefix in BOUNDARY_SPOTS and ordinal.isdigit()


def trainer_spot(at: tuple[int, int] | None, num_layers: int | None, grain: str = SPOT_GRAIN) -> str | None:
    """The :data:`SPOTS` spot of a trainer whose GPU passed boundary ``at`` last in a model of
    ``num_layers`` layers (the loss's boundaries are layer ``num_layers``'s, ordinals counted
    from the task's first): None elsewhere, between tasks, or with fewer than three layers.
    ``grain``: :data:`SPOT_GRAIN`."""
    if at is None or num_layers is None or num_layers < 3:
        return None
    layer, ordinal = at
    if grain == "boundary" and layer in (num_layers, num_layers - 1):
        return f"{'loss' if layer == num_layers else 'after_loss'}@{ordinal}"
    if layer == num_layers:
        return "loss_first" if ordinal <= 1 else "loss_mid" if ordinal <= 4 else "loss_late"
    if layer == num_layers - 1:
        return "after_loss"
    if layer == 1:
        return "before_last"
    return None


class Chunk(NamedTuple):
    """A prefill chunk: ``num_tokens`` new tokens attending to ``context_len`` cached ones."""

    num_tokens: int
    context_len: int = 0


@dataclass(frozen=True)
class StepFeatures:
    """One step's composition, as the latency model prices it.

    ``chunks``: inference prefill chunks; ``ft_lens``: FT row lengths; ``kv_tokens``: KV tokens
    read by the ``num_decodes`` decode rows; ``mode``: the host's mode for the inference part;
    ``busy``: a backward task runs beside it; ``ft_graph_tokens``: the most tokens a step with FT
    rows may have and still run in ``graph`` mode (0: FT rows make it ``eager``; see
    :attr:`exec_mode`); ``trainer_phase``: what the backward runs as the step begins
    (:data:`TRAINER_PHASES`; read only when ``busy``); ``idle_before_s``: how long the host left
    the engine idle before the step (None: not known), which makes a prompt alone :attr:`lone`;
    ``kv_max``: the longest decode row's KV tokens (0: not known).
    """

    chunks: tuple[Chunk, ...] = ()
    ft_lens: tuple[int, ...] = ()
    num_decodes: int = 0
    kv_tokens: int = 0
    mode: str = "eager"
    busy: bool = False
    ft_graph_tokens: int = 0
    trainer_phase: str = "active"
    idle_before_s: float | None = None
    kv_max: int = 0
    trainer_spot: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"step mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.trainer_phase not in TRAINER_PHASES:
            raise ValueError(f"trainer phase must be one of {', '.join(TRAINER_PHASES)}, "
                             f"got {self.trainer_phase!r}")
        if self.trainer_spot is not None and not is_spot(self.trainer_spot):
            raise ValueError(f"trainer spot must be one of {', '.join(SPOTS)}, loss@K or after_loss@K (K an ordinal) "
                             f"or None, got {self.trainer_spot!r}")

    @classmethod
    def from_view(
        cls, view: StepView, ft_lens: Sequence[int] = (), *, busy: bool = False,
        trainer_phase: str = "active", idle_before_s: float | None = None, trainer_spot: str | None = None,
    ) -> StepFeatures:
        chunks = tuple(Chunk(p.num_tokens, p.context_len) for p in view.prefills)
        return cls(chunks, tuple(ft_lens), view.num_decodes, view.decode_kv_tokens, view.mode, busy,
                   view.ft_graph_tokens, trainer_phase, idle_before_s, view.decode_kv_max, trainer_spot)

    @classmethod
    def from_record(cls, record: StepRecord, trainer_phase: str = "active",
                    idle_before_s: float | None = None, trainer_spot: str | None = None) -> StepFeatures:
        """The step as it ran: ``record.mode`` is its mode, FT rows or not. A host that leaves
        ``ft_lens`` empty is taken to have run one FT row of all tokens."""
        lens = record.ft_lens or ((record.ft_tokens,) if record.ft_tokens > 0 else ())
        return cls.of_mode(cls.from_view(record.view, lens, busy=record.trainer_busy, trainer_phase=trainer_phase,
                                         idle_before_s=idle_before_s, trainer_spot=trainer_spot), record.mode)

    @staticmethod
    def of_mode(features: StepFeatures, mode: str) -> StepFeatures:
        """``features`` run in ``mode``, with or without FT rows (a recorded or synthetic step,
        whose mode is known rather than planned)."""
        return replace(features, mode=mode, ft_graph_tokens=_ANY_SIZE if mode == "graph" else 0)

    def with_ft(self, lens: Sequence[int]) -> StepFeatures:
        """The same step with FT rows of ``lens`` appended."""
        return replace(self, ft_lens=self.ft_lens + tuple(lens))

    @property
    def form(self) -> str:
        return "prefill" if self.chunks or self.ft_lens else "decode"

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks) + sum(self.ft_lens) + self.num_decodes

    @property
    def exec_mode(self) -> str:
        """How the host runs the step: the inference part's mode; with FT rows ``graph`` only
        while the step's tokens fit :attr:`ft_graph_tokens`."""
        if not self.ft_lens:
            return self.mode
        return "graph" if self.num_tokens <= self.ft_graph_tokens else "eager"

    @property
    def key(self) -> str:
        return f"{self.form}/{self.exec_mode}"

    @property
    def lone(self) -> bool:
        """A prompt alone after an idle host: prefill chunks, no decodes, no FT rows, at least
        :data:`LONE_GAP_S` of idle host before it. Priced with a level of its own
        (:class:`LatencyModel`)."""
        return (bool(self.chunks) and not self.ft_lens and self.num_decodes == 0
                and self.idle_before_s is not None and self.idle_before_s >= LONE_GAP_S)

    @property
    def short_context_mix(self) -> bool:
        """A chunk of at most :data:`MIX_SHORT_TOKENS` over cached context beside fresh chunks,
        the step's prefill tokens at most :data:`MIX_PAGED_TOKENS`. Priced with a level of its
        own (:data:`MIX_LEVEL`)."""
        if not any(c.context_len == 0 for c in self.chunks):
            return False
        if not any(c.context_len > 0 and c.num_tokens <= MIX_SHORT_TOKENS for c in self.chunks):
            return False
        return sum(c.num_tokens for c in self.chunks) + sum(self.ft_lens) <= MIX_PAGED_TOKENS

    @property
    def state(self) -> str:
        """``idle``, or the trainer's phase beside a busy step: with :attr:`key`, the step's set."""
        return self.trainer_phase if self.busy else "idle"

    @property
    def spot(self) -> str | None:
        """The trainer's :data:`SPOTS` spot beside a busy step (None idle or elsewhere)."""
        return self.trainer_spot if self.busy else None

    def vector(self, knee_tokens: int = KNEE_TOKENS) -> tuple[float, ...]:
        """The regressors of :data:`TERMS` ``[form]``, in that order (``k_over`` above a knee of
        ``knee_tokens``; 0: none)."""
        bd = self.num_decodes
        if self.form == "decode":
            return (float(bd), float(self.kv_tokens), 1.0)
        lens = [c.num_tokens for c in self.chunks] + list(self.ft_lens)
        return (
            float(sum((n + bd) ** 2 for n in lens)),
            float(sum(lens) + bd),
            float(sum(self.ft_lens)),
            float(self.kv_tokens),
            float(sum(c.num_tokens * c.context_len for c in self.chunks)),
            1.0 if any(c.context_len > 0 for c in self.chunks) else 0.0,
            over_knee(sum(lens) + bd, knee_tokens),
            1.0,
        )


def longest_kv(rows: float, kv_tokens: float, kv_max: float, share: float) -> float:
    """A step's decode KV term under ``rows_longest`` (:data:`DECODE_KV`): its total ``kv_tokens``
    plus ``share`` of what ``rows`` rows (a decode step's bucket) at the longest row's ``kv_max``
    would read beyond it; a step whose longest row is not known (``kv_max`` 0: a host or a record
    without it) its total, as if its rows had one length."""
    if kv_max <= 0:
        return float(kv_tokens)
    return float(kv_tokens) + share * max(0.0, float(rows) * float(kv_max) - float(kv_tokens))


def with_decode_kv(key: str, regressors: Sequence[float], kv: float) -> tuple[float, ...]:
    """A ``key`` step's ``regressors`` with its decode rows' KV term (``e_kv``'s) set to ``kv``."""
    i = _E_KV[key.split("/")[0]]
    return (*regressors[:i], float(kv), *regressors[i + 1:])


def over_knee(tokens: float, knee_tokens: int) -> float:
    """``k_over``'s regressor: the tokens above the knee (0 without one)."""
    return float(max(0.0, tokens - knee_tokens)) if knee_tokens > 0 else 0.0


def from_legacy_prefill(values: Sequence[float], i_ctx: float, k_over: float = 0.0) -> tuple[float, ...]:
    """``values`` in :data:`LEGACY_PREFILL_TERMS` or :data:`V2_PREFILL_TERMS` order (by their
    length; coefficients or regressors) in ``TERMS["prefill"]`` order, with ``i_ctx`` and
    ``k_over`` for the terms they lack. For a coefficient, 0 (the old form's predictions
    unchanged); for a recorded step's regressors, ``i_ctx`` 1 where its ``h_ctx`` is above 0
    (every chunk has at least one token, so ``Σ n_i·ctx_i > 0`` exactly when a chunk has context)
    and ``k_over`` :func:`over_knee` of its tokens."""
    names = {len(LEGACY_PREFILL_TERMS): LEGACY_PREFILL_TERMS, len(V2_PREFILL_TERMS): V2_PREFILL_TERMS}.get(len(values))
    if names is None:
        raise ValueError(f"legacy prefill values must be {len(LEGACY_PREFILL_TERMS)} or {len(V2_PREFILL_TERMS)}, "
                         f"got {len(values)}")
    old = dict(zip(names, values, strict=True))
    added = {"i_ctx": i_ctx, "k_over": k_over}
    return tuple(float(old[name]) if name in old else float(added[name]) for name in TERMS["prefill"])


@dataclass(frozen=True)
class BatchSpec:
    """A synthetic batch a host runs at calibration: ``decode_kv[j]`` is decode row j's KV."""

    chunks: tuple[Chunk, ...] = ()
    decode_kv: tuple[int, ...] = ()
    ft_lens: tuple[int, ...] = ()
    mode: str = "eager"

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks) + sum(self.ft_lens) + len(self.decode_kv)

    def features(self, *, busy: bool = False) -> StepFeatures:
        return StepFeatures.of_mode(
            StepFeatures(self.chunks, self.ft_lens, len(self.decode_kv), sum(self.decode_kv), busy=busy,
                         kv_max=max(self.decode_kv, default=0)),
            self.mode,
        )

    def record(self, duration_s: float, *, busy: bool = False, now: float = 0.0) -> StepRecord:
        """The :class:`StepRecord` of running this batch in ``duration_s`` seconds."""
        view = StepView(
            now=now,
            prefills=tuple(PrefillView(c.num_tokens, c.context_len, now) for c in self.chunks),
            num_decodes=len(self.decode_kv),
            decode_kv_tokens=sum(self.decode_kv),
            decode_kv_max=max(self.decode_kv, default=0),
            mode=self.mode,
        )
        return StepRecord(
            view=view, ft_tokens=sum(self.ft_lens), duration_s=duration_s,
            mode=self.features().exec_mode, ft_lens=self.ft_lens, trainer_busy=busy,
        )


def _levels(lo: int, hi: int, k: int) -> list[int]:
    """Up to ``k`` distinct integers spread geometrically over ``[lo, hi]`` (ends included)."""
    if hi < lo or k < 1:
        return []
    if k == 1 or hi == lo:
        return [hi]
    return sorted({round(lo * (hi / lo) ** (i / (k - 1))) for i in range(k)})


CALIB_KV_SPREAD: Final = os.environ.get("COSERVE_CALIB_KV_SPREAD", "0") == "1"
"""Whether the calibration's decode × KV grid gives a batch's rows different KV lengths (spread
evenly from a quarter to 1.75 times its mean, the same total) instead of one length for all
(``COSERVE_CALIB_KV_SPREAD``; off: every calibration until session 33). Serving's decode rows have
different lengths; a decode step's attention may follow its longest row. On the H100 in session
33, serving refitted ``b_decodes`` to ~58-60 µs a row against the sweep's 6-8 µs, and the GPU time
of the trainer-idle replays' decode steps grew 58-68 µs a row and 57-66 ns a KV token against the
sweep's 5-9 µs and 45-46 ns (``bench/decode_slopes.py``,
``bench/results/latency_h100/session33/decode_slopes.json``). Off until a device run says whether it
closes that gap."""


DECODE_KV_FORMS: Final = ("total", "rows_longest")
DECODE_KV: Final = os.environ.get("COSERVE_DECODE_KV", "rows_longest")
"""``LatencyModel``'s default ``decode_kv``: what a step's decode KV term (``e_kv``'s) multiplies
(``COSERVE_DECODE_KV``). ``total``: the KV tokens its decode rows read (``K``, the model until
session 34); ``rows_longest``: ``K`` plus :data:`DECODE_KV_SHARE` of what the rows would read
beyond it were every row as long as the longest (:func:`longest_kv`; a decode step's rows are
its graph's bucket). The paged decode kernel cuts each row's keys into one split count for the
batch, so a step of mixed lengths waits in part on its longest row; the calibration's batches
give every row one length, where the two forms agree (but for a graph's padding rows). On the
H100 in session 34 (``bench/decode_longest.py``, ``bench/results/latency_h100/session34/``),
decode graph steps at the same rows and total KV ran up to 1.53x longer with one row at four
times the mean (2.9 ms more at 32 rows of 2,048 mean: ~15 ns for each token the rows would read
beyond ``K`` at the longest row's length, against ~45 ns a ``K`` token); replayed whole offline
(``bench/latency_whole.py --decode-kv rows_longest``) on that session's two runs, at a share of
0.35 against the total, the busy decode p99 fell from 11.7 / 12.0% to 10.5 / 11.1% cold, 8.2 to
6.9% warm, idle decode from 6.3 / 7.0% to 4.8 / 4.9%, and no segment's p99 rose; at a share of 1
(every row priced at the longest) cold busy decode rose to 15.9%, as online (14.2% against
11.7% on the same host)."""
if DECODE_KV not in DECODE_KV_FORMS:
    raise ValueError(f"COSERVE_DECODE_KV must be one of {', '.join(DECODE_KV_FORMS)}, got {DECODE_KV!r}")
DECODE_KV_SHARE: Final = float(os.environ.get("COSERVE_DECODE_KV_SHARE", "0.35"))
"""``LatencyModel``'s default ``decode_kv_share``: the share of the longest row's excess that
``rows_longest`` adds to ``K`` (``COSERVE_DECODE_KV_SHARE``; 1: every row priced at the longest,
what the torch attention backend computes, its rows padded to the longest). 0.35: session 34's
H100 ratio of the two slopes above (~15 / ~45 ns), not fitted to the replays; offline 0.2 and 0.5
did about as well (``session34/latency_whole_rows_longest_0{2,5}.json``)."""


def decode_kvs(per_row: int, rows: int, cap: int, spread: bool | None = None) -> tuple[int, ...]:
    """A calibration decode batch's KV lengths: ``rows`` of ``per_row`` each, or with ``spread``
    (default :data:`CALIB_KV_SPREAD`) spread evenly from a quarter to 1.75 times ``per_row``
    (the same total where no row reaches ``cap``), each in ``[1, cap]``."""
    spread = CALIB_KV_SPREAD if spread is None else spread
    if not spread or rows < 2:
        return (per_row,) * rows
    return tuple(min(cap, max(1, round(per_row * (0.25 + 1.5 * i / (rows - 1))))) for i in range(rows))


def _split(total: int, parts: int) -> tuple[Chunk, ...]:
    q, r = divmod(total, parts)
    return tuple(Chunk(q + (1 if i < r else 0)) for i in range(parts))


def calibration_plan(
    max_tokens: int, max_decodes: int, max_kv: int, *, modes: Sequence[str] = MODES,
    max_context: int | None = None, ft_modes: Sequence[str] = ("eager",),
) -> list[BatchSpec]:
    """The synthetic batches that make every coefficient identifiable (DESIGN §6).

    ``max_tokens``: tokens per step; ``max_decodes``: decode rows per step; ``max_kv``: KV tokens
    a batch may read in total. Per mode: a sweep of one chunk's length (a, b, c); fixed lengths
    split over more chunks (a vs b); at three lengths, one chunk over cached contexts from 1 token
    up and two chunks of which one has context, each beside the same batch without context (h, and
    i: the constant of a step with a context chunk); a decode batch × KV grid
    (b', e', c'); prefill chunks with decodes (B_d inside the square, e). Per mode of
    ``ft_modes`` (the modes in which the host runs steps with FT rows): FT rows added to fixed
    batches, alone and beside inference (g). ``max_context`` caps one row's cached context plus
    its new tokens (the model's context length).
    """
    if (max_tokens < 1 or max_decodes < 0 or max_kv < 0 or not set(modes) <= set(MODES)
            or not set(ft_modes) <= set(MODES)):
        raise ValueError(f"calibration_plan needs max_tokens >= 1, max_decodes >= 0, "
                         f"max_kv >= 0 and modes and ft_modes among {MODES}")
    t, d, kv = max_tokens, max_decodes, max_kv
    row_cap = max_context if max_context is not None else t + kv + 1
    specs: list[BatchSpec] = []
    for mode in modes:
        specs += [BatchSpec((Chunk(n),), mode=mode) for n in _levels(1, t, 12)]
        for total in sorted({n for n in (t, t // 4) if n >= 2}):
            specs += [BatchSpec(_split(total, p), mode=mode) for p in _levels(2, min(total, 64), 5)]
        for n in sorted({max(1, t // 32), max(1, t // 8), max(1, t // 2)}):
            contexts = _levels(1, max(1, min(kv, row_cap - n)), 4)
            specs += [BatchSpec((Chunk(n, c),), mode=mode) for c in (0, *contexts)]
            if n >= 2:  # a context chunk beside one without, and the pair without context
                head, tail = _split(n, 2)
                specs += [BatchSpec((head, tail), mode=mode),
                          BatchSpec((Chunk(head.num_tokens, contexts[-1]), tail), mode=mode)]
        for b in _levels(1, d, 5):
            for per_row in _levels(1, max(1, min(kv // b, row_cap - 1)), 5):
                specs.append(BatchSpec(decode_kv=decode_kvs(per_row, b, row_cap - 1), mode=mode))
        for n in sorted({max(1, t // 4), max(1, t // 2)}):
            for b in _levels(1, min(d, t - n), 4):
                for per_row in sorted({1, max(1, min(kv // b, row_cap - 1))}):
                    specs.append(BatchSpec((Chunk(n),), (per_row,) * b, mode=mode))
    quarter = max(1, t // 4)
    bases = [BatchSpec(), BatchSpec((Chunk(quarter),))]
    b = min(d, t - quarter, max(1, t // 8))
    if b > 0:
        bases.append(BatchSpec((Chunk(quarter),), (max(1, min(kv // (2 * b), row_cap - 1)),) * b))
    for mode in ft_modes:
        for base in bases:
            for total in _levels(1, t - base.num_tokens, 5):
                specs.append(replace(base, ft_lens=(total,), mode=mode))
                if total >= 4:
                    rows = tuple(c.num_tokens for c in _split(total, 4))
                    specs.append(replace(base, ft_lens=rows, mode=mode))
    return specs


def calibrate(
    model: LatencyModel, run_batch: Callable[[BatchSpec], float], *, max_tokens: int, max_decodes: int,
    max_kv: int, max_context: int | None = None, modes: Sequence[str] = ("eager",),
    ft_modes: Sequence[str] = ("eager",), repeats: int = 2,
) -> int:
    """Hook 5: time :func:`calibration_plan`'s batches through the host's real path and fit
    ``model``; returns the number of batches timed. ``run_batch`` runs one batch and returns its
    duration in seconds; the fastest of ``repeats`` runs counts (the first warms up)."""
    records = []
    for spec in calibration_plan(max_tokens, max_decodes, max_kv, modes=modes, max_context=max_context,
                                 ft_modes=ft_modes):
        duration = min(run_batch(spec) for _ in range(repeats))
        records.append(spec.record(duration))
    model.fit(records)
    return len(records)


class ErrorStats(NamedTuple):
    """Relative error ``|T̂ − T| / T`` over ``n`` steps (quantiles interpolate linearly)."""

    median_rel: float
    p99_rel: float
    n: int


def error_summary(rel_errors: Sequence[float]) -> ErrorStats:
    """Median and p99 of relative errors; ``nan`` for none."""
    if not rel_errors:
        return ErrorStats(math.nan, math.nan, 0)
    e = torch.tensor(rel_errors, dtype=torch.float64)
    return ErrorStats(float(e.quantile(0.5)), float(e.quantile(0.99)), len(rel_errors))


SAFETY_EVERY = 10
"""A set's safety factor is recomputed every this many of its steps (and at its first)."""

LEVEL_RATE = 0.2
"""How far a set's level moves toward each observed step's log ratio (``LatencyModel``)."""
LEVEL_CLIP = 0.5
"""The most one step's log ratio may differ from the level when the level moves."""
LEVEL_RECENTER_STEPS = 20
"""After a refit, a set's level restarts from its latest this many steps."""
SHARED_LEVEL_RATE = 0.3
"""The rate of a decode key's shared busy level (:data:`SHARE_AFTER_STEPS`)."""
SHARE_AFTER_STEPS = 500
"""A decode key's busy phases share one level once the key has this many busy steps measured
(a phase whose busy set still has no fitted ``(ρ, δ)`` of its own keeps its own level)."""
PHASE_AFTER_STEPS: Final = int(os.environ.get("COSERVE_PHASE_AFTER_STEPS", "100"))
"""``LatencyModel``'s default ``ending_after``: a decode key's ``ending`` and ``loss`` phases are
sets of their own once the key has this many busy steps, ``active`` before
(``COSERVE_PHASE_AFTER_STEPS``; sessions 27-34: :data:`SHARE_AFTER_STEPS`, 500). In a cold run's
first ~30 s (500 busy steps) the steps beside the backward's last layer, faster than their
``active`` price, and beside its loss were over-represented among the busy decode set's worst
steps (session 34's H100 run). Replayed whole offline (``bench/latency_whole.py --ending-after``) on
the eight H100 runs of sessions 33-34 at the longest-row share 0.35, 100 against 500: each cold
replay's p99 over all steps lower on 7 of 8 (mean 11.68 -> 11.35%; the eighth +0.03), busy decode
lower on 7 of 8; the gain is the first halves' (mean 13.4 -> 12.8%), the second halves' -0.2 to
+0.3 points, the warm replays' the same (mean 9.25 -> 9.26%;
``bench/results/latency_h100/session35/latency_whole_s3{3,4}_ending_after_{0,100,500}.json``); 0
(a phase from the first step) was worse than 500 on 4 of 8, by up to 0.6 points. Online with the
longest-row share (session 35, H100, ``session35/latency_whole_73d0818{,_total_500}.json``) the
first replays ran 11.3 / 10.1% over all steps, where the model before both would have been at
12.6 / 11.3%."""
SHARED: Final = "busy"
"""The state under which a key's shared busy level is kept (not a trainer phase)."""
LEVEL_FORMS: Final = ("decode/",)
"""The sets (by key prefix) that carry a level."""


def moved_level(level: float, log_ratio: float, rate: float) -> float:
    """A level after one step whose measured / linear log ratio is ``log_ratio``: moved ``rate`` of
    the way toward it, the move clipped at :data:`LEVEL_CLIP` so that one stalled step (a compile,
    an allocator retry) moves the level by at most ``LEVEL_CLIP · rate``."""
    return level + rate * min(max(log_ratio - level, -LEVEL_CLIP), LEVEL_CLIP)


LONE: Final = "lone"
"""The level of a prefill key's lone prompts (:attr:`StepFeatures.lone`), kept beside its sets'."""
LONE_LEVEL: Final = os.environ.get("COSERVE_LONE_LEVEL", "1") == "1"
"""``LatencyModel``'s default ``lone_level`` (``COSERVE_LONE_LEVEL``, on by default; ``0``: the model
before session 29, for a same-host baseline, e.g. ``first_call.sh``'s
``latency_env=COSERVE_LONE_LEVEL=0``)."""
LONE_LEVEL_RATE: Final = float(os.environ.get("COSERVE_LONE_LEVEL_RATE", "0.5"))
"""How far the lone prompts' level moves toward each one's log ratio (``LatencyModel``'s
``lone_level_rate``; ``COSERVE_LONE_LEVEL_RATE``). Faster than a set's :data:`LEVEL_RATE`: these
prompts come few at a time after idle gaps, and a refit of their set between them moves their
linear form. On the H100 in session 30 at 0.2 (the decode levels' rate), ten probes went by before
their level learnt their 1.3x, and a refit later left it 0.81x (``bench/results/latency_h100/README.md``,
"Session 30"). Offline on the 28 tables of sessions 20-30 (``bench/latency_fit.py``'s
``lone_level`` against ``lone_level_slow``, ``session30/latency_fit_lone_rate.json``), 0.5 against
0.2: the prefill held-out p99 of 11 of the 14 H100 tables 0.3-4.2 points lower, two unchanged, one
0.6 higher; of the 14 H200 tables 12 unchanged, two 0.3 and 0.5 higher. Chosen on these tables."""
LONE_RECENTER: Final = os.environ.get("COSERVE_LONE_RECENTER", "1") == "1"
"""``LatencyModel``'s default ``lone_recenter``: after a refit of an idle prefill set, its lone
prompts' level restarts from the median log ratio of its latest :data:`LONE_RECENTER_STEPS` lone
prompts to the new linear form, as a decode set's level restarts from its latest steps
(``COSERVE_LONE_RECENTER``; ``0``: the level goes on against the new form). A refit between two
lone prompts moves their linear form, which the level had been learnt against (session 30,
the H100: the next four ran 0.81-0.94x before the level caught up). Offline, replayed on the ten
tables with ``gap_s`` (``bench/latency_fit.py --replay-only`` unset and set,
``bench/results/latency_h100/session30/latency_replay_recenter{0,1}.json.gz``): the prefill
held-out p99 lower on 8 (22.9 -> 16.0% on one), none higher."""
BUSY_WITH_IDLE: Final = os.environ.get("COSERVE_BUSY_WITH_IDLE", "1") == "1"
"""``LatencyModel``'s default ``busy_with_idle``: a refit of a key's idle set refits the key's busy
sets as well (``COSERVE_BUSY_WITH_IDLE``; ``0``: the model before session 32, where a busy set's
``(ρ, δ)`` stayed as fitted against the old idle form until its own next refit). A busy phase with
few steps (``ending``, ``quiet``, ``starting``: a tenth of a busy run's decode steps between them)
refits once per 400 of its own steps with refits deferred (``DEFER_CAP`` times ``refit_every``),
so after an idle refit it kept a slowdown fitted against another ``T``. Replayed offline, each of
six H100 tables of sessions 29-31 predicted by the model that had replayed the other run of its
pair first (a warm start, ``bench/latency_warm.py``,
``bench/results/latency_h100/session32/latency_warm.json``): the busy decode set's p99 13.0-17.4%
without this, 10.1-11.7% with it (with every refit deferred, ``DEFER_FROM_ROWS`` 0, 19.4-23.6%
against 10.1-11.4%, ``latency_warm_defer0.json``). The tables' own runs, from
their calibration, have no idle refit between busy steps: unchanged on all 33 tables of sessions
20-31. With refits deferred, a busy set of ``defer_from_rows`` rows or more is put off to the
host's idle poll rather than refitted on the idle refit's step path (``bench/refit_cost.py``,
``bench/results/host_cpu/session32/refit_cost_busy_with_idle.json``, the dev VM: with four 2,000-row
busy sets an idle step's observe took at most 3.9 ms, against 1.2 ms put off); the offline replay
never polls, so there they wait for their own cap, its worst case: warm busy decode 10.8-13.6%
against 12.0-13.3% cold (``latency_warm_busy_deferred.json``; the figures above were refitted
inline). Not yet run on the device."""
BUSY_BASE: Final = os.environ.get("COSERVE_BUSY_BASE", "1") == "1"
"""``LatencyModel``'s default ``busy_base``: a busy set's ``(ρ, δ)`` prices ``T`` by the idle
coefficients it was fitted against (kept with it), not by the idle set's newest ones
(``COSERVE_BUSY_BASE``; ``0``: the model before session 33). An idle refit refits its key's busy
sets (:data:`BUSY_WITH_IDLE`), but with refits deferred the large ones wait for the host's idle
poll, which a busy engine rarely gives (it polls only with no request at all), while the small
ones refit at once: the key's busy phases then priced a step against two different ``T`` under
one shared level. On the H100 in session 33, after the trainer-idle replay's idle refits, the
first ~450 busy decode steps of the warm replays ran ``quiet`` 1.08-1.12x, ``starting``
1.05-1.08x and ``ending`` 1.13-1.16x their prediction (``active`` 0.99x) until the ``active`` set's
refit came at its cap (``bench/results/latency_h100/README.md``, "Session 33")."""
PRIOR_WEIGHT: Final = float(os.environ.get("COSERVE_PRIOR_WEIGHT", "0.3"))
"""``LatencyModel``'s default ``prior_weight`` (``COSERVE_PRIOR_WEIGHT``): how hard a refit pulls a
set's terms toward their calibration, in rows' worth of evidence (``coserve.core.nnls.fit_relative``
scales each term to its largest weighted value, so 1 is about one step that the term dominates),
on every term that the calibration found above 0 (:func:`prior_weights`). 1e-3 on every term
until session 31: a set's first refit, on its first ~40 steps, then moved a term those steps
barely excite as far as it fitted them (session 31, the H100: ``e_kv`` of the prefill set to 0.4x
its calibration in one run, 1.9x in another; in the first, steps with many decodes then ran
1.2-1.4x their prediction until the next refit, 400 steps later). Offline, replayed on the 33
tables of sessions 20-31 (``bench/latency_fit.py --replay-only`` with ``COSERVE_PRIOR_WEIGHT=0.001``
and unset, ``bench/results/latency_h100/session31/latency_replay_prior{0.001,0.3}_{all,held}.json.gz``):
0.3 against 1e-3, the prefill sets' p99 over all steps (``--train 0.001``) lower on 25 tables,
higher on 8 (by at most 2.4 points; median -1.6); over each table's second half lower on 21,
higher on 8 (by at most 0.7); decode sets within 0.3. That first refit still moves such a term
(the table above: ``e_kv`` to 0.7x, against 0.4x at 1e-3): the prior weighs as 0.3 of a step
against the window's 40."""
SPOT_LEVELS: Final = os.environ.get("COSERVE_SPOT_LEVELS", "1") == "1"
"""``LatencyModel``'s default ``spot_levels``: a busy decode step whose trainer is at one of the
:data:`SPOTS` is priced with a level of that spot on top of its set's prediction, learnt from
those steps alone at :data:`SPOT_LEVEL_RATE` (as a lone prompt's level is; ``COSERVE_SPOT_LEVELS``;
``0``: none, the model before session 36). The busy decode steps' misses gather at a few places of
the backward that the phases lump together: replayed without spot levels, on the seven H100
``latency_warm`` runs of sessions 33-35 (``busy_decode_by_spot`` of
``bench/results/latency_h100/session36/latency_whole_spot_levels_0.json``), the steps beside the
loss's first two boundaries (the first chunk's logits, where a step after a prefill's pause mostly
finds it) ran a median 1.05-1.10 times their prediction, 19-50% of them over 10% off, beside its
middle ones 1.01-1.06, its late ones 0.98-1.02, beside layer 1 0.97-0.98, and beside the first
layer after the loss 0.98-1.01 with 5-16% over 10% off in the cold replays (the trainer's host
stalled there in the first minute), while the steps beside the other layers kept to a median
0.997-1.001 with at most 1% over 10% off.
Offline, replayed whole on the seven H100 ``latency_warm`` runs of sessions 33-35, each in its own
decode KV form (``bench/latency_whole.py`` with and without it,
``bench/results/latency_h100/session36/latency_whole_spot_levels_{0,1}.json``), the p99 over all
steps of the cold replays fell on five (by 0.1-1.1 points: 11.3 -> 10.2% and 10.1 -> 9.3% on
session 35's pair), held on one and rose by 0.05 on one; over their first halves it fell on all
seven (by up to 2.0 points), over the warm replays on six (by up to 0.9), the trainer-idle replays
unchanged; the cold second halves rose on four (by 0.04-0.5 points)."""
SPOT_LEVEL_RATE: Final = float(os.environ.get("COSERVE_SPOT_LEVEL_RATE", "0.3"))
"""How far a spot's level (:data:`SPOT_LEVELS`) moves toward each of its steps' log ratio to the
set's prediction (``COSERVE_SPOT_LEVEL_RATE``; the shared busy level's rate). Offline on the same
seven runs, 0.5 against 0.3: the cold replays' p99 up to 0.5 points higher (lower on two, by at most
0.07), the warm ones' within 0.1 (``session36/latency_whole_spot_level_rate_05.json``)."""
SPOT_PREFIX: Final = "spot:"
"""A spot level's state in the model's levels (``(key, "spot:loss_first")``)."""
MIX: Final = "mix"
"""The level of a prefill key's short-context mixes (:attr:`StepFeatures.short_context_mix`)."""
MIX_SHORT_TOKENS: Final = 64
"""A chunk of at most this many tokens over cached context makes a step a short-context mix."""
MIX_PAGED_TOKENS: Final = 512
"""... whose prefill tokens (chunks and FT rows) are at most this many: the step size up to which the
Triton backend runs every prefill row through its paged kernel
(``coserve.layers.triton_attention.PAGED_SMALL_PREFILL``'s default; core does not import the layers,
tests/core/test_latency.py checks they agree)."""
MIX_LEVEL: Final = os.environ.get("COSERVE_MIX_LEVEL", "1") == "1"
"""``LatencyModel``'s default ``mix_level``: a prefill step of a short chunk over cached context
beside fresh rows, small enough that every row runs through the paged kernel
(:attr:`StepFeatures.short_context_mix`), is priced with a level of its own on top of its set's
prediction, learnt from those steps alone at :data:`MIX_LEVEL_RATE` (``COSERVE_MIX_LEVEL``; ``0``:
none, the model before session 37). The short chunk's programs walk its whole cached prefix while
the fresh rows' finish early, which no term of the linear form prices: on the H100 such steps ran
a median 1.08-1.11x their prediction in the six latency runs of sessions 33-34 and 1.075x in
session 36's (``bench/prefill_compositions.py``), 19-70% of them over 10% off, against 0.99-1.01x
for fresh, context-only and longer mixed steps, even after the kernel's splits were sized by the
context tiles in session 35 (``coserve.layers.triton_attention.PREFILL_SPLIT_TILES``). Replayed
whole with and without it on the eight H100 ``latency_warm`` runs of sessions 33-36
(``bench/latency_whole.py``, ``bench/results/latency_h100/session37/latency_whole_mix_level_{0,1}.json``):
of 105 p99 figures by segment and key none higher and 47 lower (the prefill sets' by up to 3.6
points; the trainer-idle replays' prefill 9.2 -> 8.1% on session 36's run), the mixes' median
measured / predicted 1.074-1.114 -> 1.000-1.022."""
MIX_LEVEL_RATE: Final = float(os.environ.get("COSERVE_MIX_LEVEL_RATE", "0.3"))
"""How far the short-context mixes' level (:data:`MIX_LEVEL`) moves toward each one's log ratio to
the set's prediction (``COSERVE_MIX_LEVEL_RATE``)."""
LONE_RECENTER_STEPS: Final = 5
"""How many of the latest lone prompts of a key the level restarts from after a refit."""
LONE_GAP_S: Final = 5e-3
"""The idle host time before a step (:attr:`StepFeatures.idle_before_s`) from which a prompt with
no decodes and no FT rows is :attr:`StepFeatures.lone`. On the H100 in session 29 such prompts (a
sparse arrival at an idle engine, 32 tokens) took 8.3 ms of GPU time, 1.25-1.30x what the prefill
sets' linear form gave them, and carried those sets' p99 (``bench/results/latency_h100/README.md``);
the steps back to back kept to 13-15%."""


class LatencyModel:
    """Predicts step time in seconds from :class:`StepFeatures`; never fails.

    :meth:`fit` is the calibration: it sets the coefficients and keeps them as the prior of
    online refits. :meth:`observe` keeps the last ``window`` measured steps per set (form, mode,
    and idle or the trainer's phase) and refits that set every ``refit_every`` of them, weakly
    pulled toward the calibration (``prior_weight``) so that the directions a window barely
    excites (steady-state decoding) keep their calibrated values. A set with no fit yet falls back
    to: for ``graph``, the same form's ``eager`` set (slower, so a safe stand-in); else
    :data:`DEFAULT_COEFFICIENTS`. A decode set's level (module docstring) moves by
    ``level_rate`` of each observed step's log ratio (0: no level); a key's shared busy level by
    ``shared_level_rate``, its busy phases joining it after ``share_after`` busy steps (None:
    each phase keeps its own level, the model before session 24). A step beside the backward's
    last layer (phase ``ending``) is priced as its own phase once its decode key has
    ``ending_after`` busy steps, as ``active`` before (None: always, the model before session
    27; :meth:`phase_of`). An idle prefill set's lone prompts (:attr:`StepFeatures.lone`) carry
    a level of their own, moved as a decode set's but at ``lone_level_rate`` (``lone_level``;
    False: the model before session 29). A prefill step's tokens above ``knee_tokens`` pay the
    slope ``k_over`` too (0: no knee, the model before session 31; module docstring). A refit of
    an idle set refits its key's busy sets too (``busy_with_idle``; False: the model before
    session 32), and a busy set prices ``T`` by the idle coefficients it was fitted against until
    its own refit (``busy_base``; False: the model before session 33). A step's decode KV term
    is its rows' KV tokens, with ``decode_kv`` ``rows_longest`` plus ``decode_kv_share`` of their
    excess at the longest row's length (:data:`DECODE_KV`; ``total``: the model before session 34).
    A busy decode step beside one of the backward's :data:`SPOTS` carries that spot's level
    (``spot_levels``, at ``spot_level_rate``), a short-context mix
    (:attr:`StepFeatures.short_context_mix`) the mixes' level (``mix_level``, at ``mix_level_rate``).

    :meth:`safety` is how far the set's recent steps ran over their predictions (the
    ``safety_quantile`` of measured / predicted over the last ``safety_window`` steps, each
    predicted before it was observed, at least 1; after a refit of the set, or of the idle set
    that its busy prediction builds on, rescored against the new prediction): admission multiplies
    a step's prediction by it, so that a set the linear form fits badly admits less instead of
    missing its SLO.
    """

    def __init__(
        self,
        *,
        window: int = 2000,
        refit_every: int = 100,
        prior_weight: float = PRIOR_WEIGHT,
        defaults: Mapping[str, Sequence[float]] = DEFAULT_COEFFICIENTS,
        safety_quantile: float = 0.9,
        safety_window: int = 200,
        safety_min_steps: int = 20,
        level_rate: float = LEVEL_RATE,
        shared_level_rate: float = SHARED_LEVEL_RATE,
        share_after: int | None = SHARE_AFTER_STEPS,
        ending_after: int | None = PHASE_AFTER_STEPS,
        lone_level: bool = LONE_LEVEL,
        lone_level_rate: float = LONE_LEVEL_RATE,
        lone_recenter: bool = LONE_RECENTER,
        knee_tokens: int = KNEE_TOKENS,
        busy_with_idle: bool = BUSY_WITH_IDLE,
        busy_base: bool = BUSY_BASE,
        decode_kv: str = DECODE_KV,
        decode_kv_share: float = DECODE_KV_SHARE,
        spot_levels: bool = SPOT_LEVELS,
        spot_level_rate: float = SPOT_LEVEL_RATE,
        mix_level: bool = MIX_LEVEL,
        mix_level_rate: float = MIX_LEVEL_RATE,
    ) -> None:
        if window < 1 or refit_every < 1 or prior_weight < 0:
            raise ValueError("LatencyModel needs window >= 1, refit_every >= 1, prior_weight >= 0")
        if not 0.0 <= safety_quantile <= 1.0 or safety_window < 1 or safety_min_steps < 1:
            raise ValueError(
                "LatencyModel needs 0 <= safety_quantile <= 1, safety_window >= 1, "
                "safety_min_steps >= 1"
            )
        if not 0.0 <= level_rate < 1.0 or not 0.0 <= shared_level_rate < 1.0 or not 0.0 < lone_level_rate <= 1.0:
            raise ValueError("LatencyModel needs 0 <= level_rate < 1, 0 <= shared_level_rate < 1 and "
                             "0 < lone_level_rate <= 1")
        if share_after is not None and share_after < 0:
            raise ValueError("LatencyModel needs share_after >= 0 (or None)")
        if ending_after is not None and ending_after < 0:
            raise ValueError("LatencyModel needs ending_after >= 0 (or None)")
        if knee_tokens < 0:
            raise ValueError(f"LatencyModel needs knee_tokens >= 0 (0: no knee), got {knee_tokens}")
        if decode_kv not in DECODE_KV_FORMS:
            raise ValueError(f"LatencyModel needs decode_kv among {', '.join(DECODE_KV_FORMS)}, got {decode_kv!r}")
        if not 0.0 <= decode_kv_share <= 1.0:
            raise ValueError(f"LatencyModel needs 0 <= decode_kv_share <= 1, got {decode_kv_share}")
        if not 0.0 < spot_level_rate <= 1.0:
            raise ValueError(f"LatencyModel needs 0 < spot_level_rate <= 1, got {spot_level_rate}")
        if not 0.0 < mix_level_rate <= 1.0:
            raise ValueError(f"LatencyModel needs 0 < mix_level_rate <= 1, got {mix_level_rate}")
        self.window = window
        self.refit_every = refit_every
        self.prior_weight = prior_weight
        self.level_rate = level_rate
        self.shared_level_rate = shared_level_rate
        self.share_after = share_after
        self.ending_after = ending_after
        self.lone_level = lone_level
        self.lone_level_rate = lone_level_rate
        self.lone_recenter = lone_recenter
        self.knee_tokens = knee_tokens
        self.busy_with_idle = busy_with_idle
        self.busy_base = busy_base
        self.decode_kv = decode_kv
        self.decode_kv_share = decode_kv_share
        self.spot_levels = spot_levels
        self.spot_level_rate = spot_level_rate
        self.mix_level = mix_level
        self.mix_level_rate = mix_level_rate
        # per prefill key, its latest lone prompts (regressors, time): the lone level's restart
        self._lone_recent: dict[str, deque[tuple[tuple[float, ...], float]]] = {}
        self._defaults = {form: _checked(form, defaults[form]) for form in TERMS}
        self._coef: dict[str, tuple[float, ...]] = {}
        self._busy: dict[str, tuple[float, ...]] = {}  # by busy_key(key, phase)
        # by busy_key(key, phase): the idle coefficients that busy term was fitted against
        self._busy_base: dict[str, tuple[float, ...]] = {}
        self._calib: dict[str, tuple[float, ...]] = {}
        self._calib_busy: dict[str, tuple[float, ...]] = {}
        self._windows: dict[tuple[str, str], deque[tuple[tuple[float, ...], float]]] = {}
        self._unfitted: dict[tuple[str, str], int] = {}
        self._level: dict[tuple[str, str], float] = {}  # log of the set's recent measured / linear
        self._busy_steps: dict[str, int] = {}  # per decode key, its busy steps observed
        self._joined: set[tuple[str, str]] = set()  # busy sets that have priced a step by the shared level
        # per decode key, the shared level's latest steps (state, regressors, time): its restart
        self._shared_recent: dict[str, deque[tuple[str, tuple[float, ...], float]]] = {}
        self.safety_quantile = safety_quantile
        self.safety_min_steps = safety_min_steps
        self._ratios: dict[tuple[str, str], deque[float]] = {}
        self._safety: dict[tuple[str, str], float] = {}  # per set, updated as steps come in
        self._ratio_count: dict[tuple[str, str], int] = {}
        self._safety_window = safety_window
        # Refits due but put off until the host has nothing to run (refit_due): a refit costs
        # milliseconds of host time (up to 22 ms on the 2-core dev VM, bench/refit_cost.py),
        # which a step's observe on the engine's step path would add to whatever comes next (an
        # arriving request's entry, the next step). A set put off for DEFER_CAP times its refit
        # interval refits at once.
        self.defer_refits = False
        self.defer_from_rows = DEFER_FROM_ROWS  # (a shorter window refits on the step path anyway)
        self._due: dict[tuple[str, str], None] = {}  # (ordered: the oldest due first)
        # Set by a host that replays decode steps as CUDA graphs padded to a bucket: rows -> the
        # rows the replay computes (decode/graph steps are priced by those).
        self.graph_bucket: Callable[[int], int] | None = None
        # Set by a host that runs prefill-carrying steps through piecewise CUDA graphs padded to a
        # token bucket: tokens -> the tokens the replays compute (prefill/graph steps' token term).
        self.prefill_bucket: Callable[[int], int] | None = None

    # -- prediction

    def regressors(self, features: StepFeatures, key: str | None = None) -> tuple[float, ...]:
        """``features.vector()``, with a graph decode step's rows replaced by the bucket its
        replay computes (:attr:`graph_bucket`): a padded replay costs what its bucket costs
        (and a piecewise prefill step's tokens by :attr:`prefill_bucket`).
        Offline, on recorded H200 steps, that cut the idle decode error's median from 4.0% to
        1.8% and from 10.3% to 1.6% in two runs (``bench/latency_fit.py``, ``bucket`` form).
        ``key``: ``features.key`` where the caller has it already. With :attr:`decode_kv`
        ``rows_longest``, a step's decode KV term adds :attr:`decode_kv_share` of its rows' excess
        at the longest row's length (:func:`longest_kv`)."""
        key = key or features.key
        v = self.bucketed(features.vector(), key)
        if self.decode_kv == "rows_longest" and features.num_decodes:
            # (a prefill step's decode rows: their attention runs eagerly, over their own rows)
            rows = v[0] if key.startswith("decode/") else features.num_decodes
            v = with_decode_kv(key, v, longest_kv(rows, features.kv_tokens, features.kv_max, self.decode_kv_share))
        return v

    def bucketed(self, vector: Sequence[float], key: str) -> tuple[float, ...]:
        """A ``key`` step's :meth:`StepFeatures.vector` as :meth:`regressors` prices it (the
        decode rows are its first regressor, a prefill step's tokens its second; ``k_over`` the
        bucketed tokens over this model's :attr:`knee_tokens`). A prefill vector of an earlier
        version's length (a recorded table's, :func:`from_legacy_prefill`) has no ``k_over``."""
        v = tuple(vector)
        if self.graph_bucket is not None and v[0] > 0 and key == "decode/graph":
            v = (float(self.graph_bucket(int(v[0]))), *v[1:])
        elif key.startswith("prefill/"):
            if self.prefill_bucket is not None and key == "prefill/graph":
                # the token-wise work (everything but the attention) runs over the whole bucket
                v = (v[0], float(self.prefill_bucket(int(v[B_TOKENS]))), *v[2:])
            if len(v) == len(TERMS["prefill"]):
                v = (*v[:K_OVER], over_knee(v[B_TOKENS], self.knee_tokens), *v[K_OVER + 1:])
        return v

    def coefficients(self, key: str) -> tuple[float, ...]:
        """The idle coefficient set in use for ``key`` (``"prefill/eager"`` …), in TERMS order."""
        form, mode = key.split("/")
        coef = self._coef.get(key)
        if coef is None and mode == "graph":
            coef = self._coef.get(f"{form}/eager")
        return coef if coef is not None else self._defaults[form]

    def busy_term(self, key: str, phase: str = "active") -> tuple[float, ...]:
        """``(ρ, δ)`` of ``T_busy = (1 + ρ)·T + δ`` for ``key`` beside a trainer in ``phase``:
        its own; for a phase other than ``active`` with no data yet, the ``active`` term; that is
        ``key``'s own, else the same form's other mode's, else the largest slowdown of any set
        with busy data (a step kind that has never run beside the backward — prefill steps are
        paused under the default policy — is priced like the worst that has), else ``(0, 0)``
        before any busy data."""
        slot = self._busy_slot(key, phase)
        return (0.0, 0.0) if slot is None else self._busy[slot]

    def _busy_slot(self, key: str, phase: str) -> str | None:
        """Whose busy term prices a ``key`` step beside ``phase`` (:meth:`busy_term`)."""
        if phase != "active" and busy_key(key, phase) in self._busy:
            return busy_key(key, phase)
        form, mode = key.split("/")
        other = f"{form}/{'eager' if mode == 'graph' else 'graph'}"
        for slot in (key, other):
            if slot in self._busy:
                return slot
        if not self._busy:
            return None
        return max(self._busy, key=lambda s: self._busy[s][0])

    def base_coefficients(self, key: str, state: str = "idle") -> tuple[float, ...]:
        """The idle coefficients that give ``T`` of a ``key`` step in ``state``: those in use
        (:meth:`coefficients`), but for a busy step whose busy term is ``key``'s own, those
        that term was fitted against (``busy_base``, :data:`BUSY_BASE`)."""
        return self._priced(key, state)[0]

    def _priced(self, key: str, state: str) -> tuple[tuple[float, ...], tuple[float, ...] | None]:
        """A ``key`` step in ``state``: its :meth:`base_coefficients` and, busy, its
        :meth:`busy_term` (None idle), the busy slot looked up once (admission prices every
        candidate of every step through here)."""
        if state == "idle":
            return self.coefficients(key), None
        slot = self._busy_slot(key, state)
        if slot is None:
            return self.coefficients(key), (0.0, 0.0)
        if self.busy_base and slot_key(slot) == key and slot in self._busy_base:
            return self._busy_base[slot], self._busy[slot]
        return self.coefficients(key), self._busy[slot]

    def predict(self, features: StepFeatures) -> float:
        """Predicted step time in seconds."""
        key = features.key
        return self.predict_regressors(key, self.regressors(features, key), features.state, features.lone,
                                       features.spot, features.short_context_mix)

    def predict_regressors(self, key: str, regressors: Sequence[float], state: str = "idle",
                           lone: bool = False, spot: str | None = None, mix: bool = False) -> float:
        """:meth:`predict` of a ``key`` step of :meth:`regressors` ``regressors`` in ``state``
        (:attr:`StepFeatures.state`); ``lone``: :attr:`StepFeatures.lone`; ``spot``:
        :attr:`StepFeatures.spot`; ``mix``: :attr:`StepFeatures.short_context_mix`."""
        state = self.phase_of(key, state)
        level = self._level.get(self._level_key(key, state), 0.0)
        if lone and self._lone_priced(key, state):
            level += self._level.get((key, LONE), 0.0)
        if spot is not None and self._spot_priced(key, state):
            level += self._level.get((key, SPOT_PREFIX + spot), 0.0)
        if mix and self._mix_priced(key):
            level += self._level.get((key, MIX), 0.0)
        return self._linear(key, regressors, state) * math.exp(level)

    def _mix_priced(self, key: str) -> bool:
        """Whether a short-context mix of ``key`` carries the mixes' level (:data:`MIX_LEVEL`):
        a prefill step, idle or busy, where the model keeps levels."""
        return self.mix_level and self.level_rate > 0 and key.startswith("prefill/")

    def _spot_priced(self, key: str, state: str) -> bool:
        """Whether a ``key`` step in ``state`` beside a trainer at a spot carries the spot's level
        (:data:`SPOT_LEVELS`): a busy decode step, where the model keeps levels."""
        return self.spot_levels and self.level_rate > 0 and state != "idle" and key.startswith(LEVEL_FORMS)

    def _lone_priced(self, key: str, state: str) -> bool:
        """Whether a lone prompt of ``key`` in ``state`` carries the lone level: an idle prefill
        step, where the model keeps levels (``lone_level``, ``level_rate`` above 0)."""
        return self.lone_level and self.level_rate > 0 and state == "idle" and key.startswith("prefill/")

    def phase_of(self, key: str, state: str) -> str:
        """The set a ``key`` step in ``state`` is priced and observed in: ``ending`` and ``loss``
        are ``active`` until ``key`` has :attr:`ending_after` busy steps (TRAINER_PHASES)."""
        if state in ("ending", "loss") and (self.ending_after is None or self._busy_steps.get(key, 0) < self.ending_after):
            return "active"
        return state

    def _level_key(self, key: str, state: str) -> tuple[str, str]:
        """Whose level scales a ``key`` step in ``state``: ``(key, SHARED)`` for a busy phase
        that has joined the key's shared level (module docstring), else the set's own."""
        if (state == "idle" or self.share_after is None or self._busy_steps.get(key, 0) < self.share_after
                or busy_key(key, state) not in self._busy or not key.startswith(LEVEL_FORMS)):
            return (key, state)
        return (key, SHARED)

    def _linear(self, key: str, regressors: Sequence[float], state: str) -> float:
        base, busy = self._priced(key, state)
        t = sum(c * v for c, v in zip(base, regressors, strict=True))
        if busy is not None:
            rho, delta = busy
            t = t * (1.0 + rho) + delta
        return t

    def safety(self, features: StepFeatures) -> float:
        """The factor (≥ 1) by which recent steps of ``features``' set ran over their predictions:
        1 until the set has ``safety_min_steps`` observations. A lookup: admission asks it for
        every candidate sample of every step."""
        key = features.key
        return self._safety.get((key, self.phase_of(key, features.state)), 1.0)

    # -- fitting

    def fit(self, records: Sequence[StepRecord]) -> None:
        """Calibrate from measured steps: every set with data is refitted and becomes the prior."""
        groups: dict[tuple[str, str], list[tuple[tuple[float, ...], float]]] = {}
        for row, key, state in _rows(records, self.regressors):
            groups.setdefault((key, self.phase_of(key, state)), []).append(row)
        for (key, state), rows in sorted(groups.items(), key=lambda kv: kv[0][1] != "idle"):
            self._solve(key, state, rows, prior=None)
            slot = _slot(key, state)
            target, calib = (self._coef, self._calib) if state == "idle" else (self._busy, self._calib_busy)
            if slot in target:
                calib[slot] = target[slot]
        logger.info("latency model calibrated from %d steps: %s", len(records), self._coef)

    def observe(self, record: StepRecord, trainer_phase: str = "active",
                trainer_spot: str | None = None) -> float | None:
        """Add one measured step (beside a trainer in ``trainer_phase``, at ``trainer_spot``, when
        ``record.trainer_busy``); refit its set after 10 observations, then after a quarter of its
        window, at most every ``refit_every`` observations. Returns the step's prediction made
        before it was observed (None for an interrupted or untimed step, which is not used)."""
        if record.interrupted or not record.duration_s > 0:
            return None
        return self.observe_features(StepFeatures.from_record(record, trainer_phase, trainer_spot=trainer_spot),
                                     record.duration_s)

    def observe_features(self, features: StepFeatures, duration_s: float) -> float:
        """:meth:`observe` of a step of ``features`` that took ``duration_s`` (> 0) seconds (a
        host that has built the step's features already)."""
        key = features.key
        return self.observe_regressors(key, self.regressors(features, key), duration_s, features.state,
                                       features.lone, features.spot, features.short_context_mix)

    def observe_regressors(
        self, key: str, regressors: Sequence[float], duration_s: float, state: str = "idle",
        lone: bool = False, spot: str | None = None, mix: bool = False,
    ) -> float:
        """:meth:`observe` of a ``key`` step of :meth:`regressors` ``regressors`` in ``state``
        that took ``duration_s`` (> 0) seconds (an offline replay of recorded steps calls it);
        ``lone``: :attr:`StepFeatures.lone`, whose level moves as a decode set's does; ``spot``:
        :attr:`StepFeatures.spot`, whose level moves at :attr:`spot_level_rate`; ``mix``:
        :attr:`StepFeatures.short_context_mix`, whose level moves at :attr:`mix_level_rate`."""
        state = self.phase_of(key, state)
        s = (key, state)
        v = tuple(float(x) for x in regressors)
        linear = self._linear(key, v, state)
        at = self._level_key(key, state)
        if at != s:
            if at not in self._level and s in self._level:
                self._level[at] = self._level[s]  # (the first phase to join brings its level)
            self._joined.add(s)
            self._shared_recent.setdefault(key, deque(maxlen=LEVEL_RECENTER_STEPS)).append((state, v, duration_s))
        level = self._level.get(at, 0.0)
        predicted = linear * math.exp(level)
        if lone and predicted > 0 and self._lone_priced(key, state):
            # the lone prompts' level: the set's linear form (fitted on every step, these too)
            # times a factor learnt from these steps alone (bench/latency_fit.py's lone_level)
            base, lone_level = predicted, self._level.get((key, LONE), 0.0)
            predicted = base * math.exp(lone_level)
            self._level[(key, LONE)] = moved_level(lone_level, math.log(duration_s / base), self.lone_level_rate)
            self._lone_recent.setdefault(key, deque(maxlen=LONE_RECENTER_STEPS)).append((v, duration_s))
        if spot is not None and predicted > 0 and self._spot_priced(key, state):
            # the spot's level: on top of the set's prediction, learnt from the spot's steps alone
            at_spot = (key, SPOT_PREFIX + spot)
            base, spot_level = predicted, self._level.get(at_spot, 0.0)
            predicted = base * math.exp(spot_level)
            self._level[at_spot] = moved_level(spot_level, math.log(duration_s / base), self.spot_level_rate)
        if mix and predicted > 0 and self._mix_priced(key):
            # the short-context mixes' level: on top of the set's prediction, from these steps alone
            base, mix_level = predicted, self._level.get((key, MIX), 0.0)
            predicted = base * math.exp(mix_level)
            self._level[(key, MIX)] = moved_level(mix_level, math.log(duration_s / base), self.mix_level_rate)
        if predicted > 0:
            ratios = self._ratios.setdefault(s, deque(maxlen=self._safety_window))
            ratios.append(duration_s / predicted)
            # NOTE: the quantile every SAFETY_EVERY steps of a set, not every step: this runs on
            # the engine's per-step path
            n = self._ratio_count.get(s, 0) + 1
            self._ratio_count[s] = n
            if len(ratios) >= self.safety_min_steps and (
                    len(ratios) == self.safety_min_steps or n % SAFETY_EVERY == 0):
                self._set_safety(s, np.fromiter(ratios, np.float64, len(ratios)))
        if linear > 0 and self.level_rate > 0 and key.startswith(LEVEL_FORMS):
            rate = self.level_rate if at == s else self.shared_level_rate
            self._level[at] = moved_level(level, math.log(duration_s / linear), rate)
        if state != "idle" and key.startswith(LEVEL_FORMS):
            self._busy_steps[key] = self._busy_steps.get(key, 0) + 1
        win = self._windows.setdefault(s, deque(maxlen=self.window))
        win.append((v, duration_s))
        n = self._unfitted.get(s, 0) + 1
        self._unfitted[s] = n
        # Refit early while a set has few observations (a rare step kind would otherwise keep its
        # calibration bias for hundreds of steps), then every `refit_every`.
        every = min(self.refit_every, max(10, len(win) // 4))
        if n >= every:
            if self.defer_refits and n < DEFER_CAP * every and len(win) >= self.defer_from_rows:
                self._due[s] = None
            else:
                self._refit(s)
        return predicted

    def refit_due(self, deadline: float | None = None) -> int:
        """Refit the sets whose refits :attr:`defer_refits` put off, oldest first, until
        ``time.monotonic()`` passes ``deadline`` (None: all of them). Returns how many."""
        done = 0
        while self._due and (deadline is None or time.monotonic() < deadline):
            s = next(iter(self._due))
            self._refit(s)
            done += 1
        return done

    def _refit(self, s: tuple[str, str]) -> None:
        key, state = s
        self._solve_set(s)
        if state != "idle":
            self._after_refit(s)
            return
        # an idle refit moves the busy sets' predictions too (T_busy = (1 + ρ)·T + δ): their
        # (ρ, δ) were fitted against the old T, so they are refitted against the new one
        # (BUSY_WITH_IDLE) as their own refits run: now if short, else put off to the host's idle
        # poll with refits deferred (this may run on the step path); then every set of the key
        # gets its level and safety again, against the new T
        sets = [k for k in self._windows if k[0] == key]
        if self.busy_with_idle:
            for t in sets:
                if t[1] == "idle":
                    continue
                if self.defer_refits and len(self._windows[t]) >= self.defer_from_rows:
                    self._due[t] = None
                else:
                    self._solve_set(t)
        for t in sets:
            self._after_refit(t)

    def _solve_set(self, s: tuple[str, str]) -> None:
        """Refit set ``s`` on its window, pulled toward its calibration (a busy phase with none:
        the key's ``active`` one); its refit is no longer due."""
        key, state = s
        self._unfitted[s] = 0
        self._due.pop(s, None)
        slot = _slot(key, state)
        prior = (self._calib if state == "idle" else self._calib_busy).get(slot)
        if prior is None and state not in ("idle", "active"):
            prior = self._calib_busy.get(key)
        self._solve(key, state, list(self._windows[s]), prior=prior)

    def _restart_level(self, at: tuple[str, str], measured_predicted: Sequence[tuple[float, float]]) -> None:
        """Set the level ``at`` to the median log ratio of these (measured, prediction without
        it) pairs (those predicted above 0; none: the level stays)."""
        logs = [math.log(y / p) for y, p in measured_predicted if p > 0]
        if logs:
            self._level[at] = float(np.median(logs))

    def _after_refit(self, s: tuple[str, str]) -> None:
        """Set ``s``'s level and safety factor again against its new prediction, from one pass
        over its latest steps.

        The level restarts from the median log ratio of the last :data:`LEVEL_RECENTER_STEPS` to
        the new linear form: a level learned against the old coefficients (or against the stand-in
        set of a phase seen for the first time) would otherwise count twice. The safety factor
        comes from the last ``safety_window`` steps' ratios to the new prediction: the ratios of
        steps predicted before it belong to coefficients no longer in use (a busy set first priced
        by a stand-in, ~3× too fast, kept a ×3 factor until ``safety_window`` newer steps rolled
        them out: under a policy that pauses the backward for most decode steps, for the whole
        run). Rescored ratios are in-sample; the steps that follow append out-of-sample ones."""
        key, state = s
        rows = list(self._windows[s])[-max(self._safety_window, LEVEL_RECENTER_STEPS):]
        x = np.asarray([r[0] for r in rows], dtype=np.float64)
        y = np.asarray([r[1] for r in rows], dtype=np.float64)
        base, busy = self._priced(key, state)
        linear = x @ np.asarray(base, dtype=np.float64)  # (_linear, vectorized)
        if busy is not None:
            rho, delta = busy
            linear = linear * (1.0 + rho) + delta
        if self.level_rate > 0 and key.startswith(LEVEL_FORMS):
            ly, lp = y[-LEVEL_RECENTER_STEPS:], linear[-LEVEL_RECENTER_STEPS:]
            if (lp > 0).any():
                self._level[s] = float(np.median(np.log(ly[lp > 0] / lp[lp > 0])))
            if s in self._joined:
                # the shared level restarts as well, from its own latest steps (of any phase)
                self._restart_level((key, SHARED), [(y_, self._linear(key, x_, st))
                                                    for st, x_, y_ in self._shared_recent[key]])
        if self.lone_recenter and key in self._lone_recent and self._lone_priced(key, state):
            # so does the lone prompts' level, from its latest lone prompts (their prediction
            # without it: the set's new form and level)
            self._restart_level((key, LONE), [(y_, self.predict_regressors(key, x_, state))
                                              for x_, y_ in self._lone_recent[key]])
        pred = linear[-self._safety_window:] * math.exp(self._level.get(self._level_key(key, state), 0.0))
        ratios = y[-self._safety_window:][pred > 0] / pred[pred > 0]
        self._ratios[s] = deque(ratios.tolist(), maxlen=self._safety_window)
        if len(ratios) >= self.safety_min_steps:
            self._set_safety(s, ratios)

    def _set_safety(self, s: tuple[str, str], ratios: np.ndarray) -> None:
        # (numpy: torch's CPU kernels here would wake the process's sleeping OpenMP threads)
        self._safety[s] = max(1.0, float(np.quantile(ratios, self.safety_quantile)))

    def _solve(
        self, key: str, state: str, rows: list[tuple[tuple[float, ...], float]],
        prior: tuple[float, ...] | None,
    ) -> None:
        # NOTE: numpy, on the engine's step path (see coserve.core.nnls)
        x = np.asarray([r[0] for r in rows], dtype=np.float64)
        y = np.asarray([r[1] for r in rows], dtype=np.float64)
        weight = 1.0 / np.maximum(y, 1e-9)
        idle = self.coefficients(key)
        if state != "idle":
            # Regress the slowdown on the idle prediction: y − T = ρ·T + δ.
            base = x @ np.asarray(idle, dtype=np.float64)
            x, y = np.stack([base, np.ones_like(base)], 1), y - base
        if prior is None and x.shape[0] < x.shape[1]:
            return
        coef = fit_relative(x, y, weight, prior, prior_weights(prior, self.prior_weight))
        if all(math.isfinite(c) for c in coef):
            slot = _slot(key, state)
            if state == "idle":
                self._coef[slot] = coef
            else:
                self._busy[slot], self._busy_base[slot] = coef, idle
        else:
            logger.warning("latency refit of %s (%s) not finite; kept the old set", key, state)

    # -- reporting and persistence

    def error_stats(self, records: Sequence[StepRecord]) -> dict[str, ErrorStats]:
        """Relative error per ``"{form}/{mode}/{idle|busy}"`` and over ``"all"`` steps."""
        errors: dict[str, list[float]] = {"all": []}
        for record in records:
            if record.interrupted or record.duration_s <= 0:
                continue
            f = StepFeatures.from_record(record)
            rel = abs(self.predict(f) - record.duration_s) / record.duration_s
            errors.setdefault(f"{f.key}/{'busy' if f.busy else 'idle'}", []).append(rel)
            errors["all"].append(rel)
        return {k: error_summary(v) for k, v in errors.items()}

    def state_dict(self, online: bool = True) -> dict[str, Any]:
        """JSON-serializable coefficients (fitted and calibration) and the knee they were fitted
        with; ``online``: also what the online refits go on from (``"online"``: each set's window
        of measured steps, its steps since its last refit, the levels and their restart steps,
        the busy steps per key, the safety ratios and the refits put off), so that a model restored from it predicts
        and refits as this one would have (a server restarted with ``--latency-state``, the next
        fine-tuning job). Without it, a restored model starts its windows empty: its first refits
        come on a few dozen steps, whose error the continued model does not have (offline,
        ``bench/latency_warm.py``)."""
        state: dict[str, Any] = {
            "version": _STATE_VERSION,
            "knee_tokens": self.knee_tokens,
            "decode_kv": self.decode_kv,
            "decode_kv_share": self.decode_kv_share,
            "coefficients": {k: list(v) for k, v in self._coef.items()},
            "busy": {k: list(v) for k, v in self._busy.items()},
            "calibration": {k: list(v) for k, v in self._calib.items()},
            "calibration_busy": {k: list(v) for k, v in self._calib_busy.items()},
            "busy_base": {k: list(v) for k, v in self._busy_base.items()},
        }
        if online:
            state["online"] = {
                "windows": {_set_name(s): [[*v, y] for v, y in w] for s, w in self._windows.items()},
                "unfitted": {_set_name(s): n for s, n in self._unfitted.items()},
                "levels": {_set_name(s): v for s, v in self._level.items()},
                "busy_steps": dict(self._busy_steps),
                "joined": sorted(_set_name(s) for s in self._joined),
                "shared_recent": {k: [[st, list(v), y] for st, v, y in d] for k, d in self._shared_recent.items()},
                "lone_recent": {k: [[list(v), y] for v, y in d] for k, d in self._lone_recent.items()},
                "ratios": {_set_name(s): list(r) for s, r in self._ratios.items()},
                "ratio_count": {_set_name(s): n for s, n in self._ratio_count.items()},
                # (the factors as last updated: every SAFETY_EVERY steps, not from the ratios now)
                "safety": {_set_name(s): f for s, f in self._safety.items()},
                "due": [_set_name(s) for s in self._due],
            }
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output. Raises ``ValueError`` on a malformed state.

        A version-1 or -2 state (prefill sets without ``i_ctx``, or without ``k_over``) is
        migrated: its prefill sets get the missing terms at 0, so that they predict what they did;
        the online refits learn them from the steps that excite them (recalibrating learns them at
        once), at this model's knee. A version-3 state's ``knee_tokens`` (what its ``k_over`` was
        fitted with) replaces this model's, with a warning where they differ, and so do its
        ``decode_kv`` and ``decode_kv_share`` (a state without them: ``total``)."""
        if state.get("version") in (1, 2):
            state = {**_migrated(state), "knee_tokens": self.knee_tokens}
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported LatencyModel state version {state.get('version')!r} "
                             f"(expected {_STATE_VERSION}, or 1 or 2 to migrate)")
        knee = state.get("knee_tokens")
        if not isinstance(knee, int) or isinstance(knee, bool) or knee < 0:
            raise ValueError(f"LatencyModel state: knee_tokens must be an integer >= 0, got {knee!r}")
        tables = []
        for name in ("coefficients", "busy", "calibration", "calibration_busy"):
            table = state.get(name, {})
            allowed = set(BUSY_KEYS) if "busy" in name else set(KEYS)
            if not isinstance(table, Mapping) or not set(table) <= allowed:
                raise ValueError(f"LatencyModel state: bad {name!r} table")
            kind = "busy" if "busy" in name else None
            tables.append({k: _checked(kind or k.split("/")[0], v) for k, v in table.items()})
        self._coef, self._busy, self._calib, self._calib_busy = tables
        base = state.get("busy_base", {})
        if not isinstance(base, Mapping) or not set(base) <= set(BUSY_KEYS):
            raise ValueError("LatencyModel state: bad 'busy_base' table")
        # (a state without it, of an earlier version: its busy terms were fitted against the idle
        # sets it holds, as far as it says)
        self._busy_base = {k: _checked(k.split("/")[0], base[k]) if k in base else self.coefficients(slot_key(k))
                           for k in self._busy}
        decode_kv = state.get("decode_kv", "total")  # (a state before session 34: the total)
        share = state.get("decode_kv_share", self.decode_kv_share)
        if decode_kv not in DECODE_KV_FORMS:
            raise ValueError(f"LatencyModel state: decode_kv must be one of {', '.join(DECODE_KV_FORMS)}, "
                             f"got {decode_kv!r}")
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0.0 <= share <= 1.0:
            raise ValueError(f"LatencyModel state: decode_kv_share must be a number in [0, 1], got {share!r}")
        if knee != self.knee_tokens:
            logger.warning("latency model state fitted with a knee at %d tokens, not %d: it keeps its own",
                           knee, self.knee_tokens)
            self.knee_tokens = knee
        if decode_kv != self.decode_kv or (decode_kv == "rows_longest" and share != self.decode_kv_share):
            logger.warning("latency model state fitted with decode KV term %r (share %s), not %r (%s): "
                           "it keeps its own", decode_kv, share, self.decode_kv, self.decode_kv_share)
        self.decode_kv, self.decode_kv_share = decode_kv, float(share)
        online = self._parsed_online(state.get("online"))
        self._windows.clear()
        self._unfitted.clear()
        self._level.clear()
        self._busy_steps.clear()
        self._joined.clear()
        self._shared_recent.clear()
        self._lone_recent.clear()
        self._ratios.clear()
        self._safety.clear()
        self._ratio_count.clear()
        self._due.clear()
        if online is None:
            return
        for s, rows in online["windows"].items():
            self._windows[s] = deque(rows, maxlen=self.window)
        self._unfitted.update(online["unfitted"])
        self._level.update(online["levels"])
        self._busy_steps.update(online["busy_steps"])
        self._joined.update(online["joined"])
        for k, shared in online["shared_recent"].items():
            self._shared_recent[k] = deque(shared, maxlen=LEVEL_RECENTER_STEPS)
        for k, lone in online["lone_recent"].items():
            self._lone_recent[k] = deque(lone, maxlen=LONE_RECENTER_STEPS)
        for s, ratios in online["ratios"].items():
            self._ratios[s] = deque(ratios, maxlen=self._safety_window)
            if len(ratios) >= self.safety_min_steps:
                self._set_safety(s, np.asarray(self._ratios[s], dtype=np.float64))
        self._ratio_count.update(online["ratio_count"])
        self._safety.update(online["safety"])  # (a state before session 35: from the ratios, above)
        # (refits put off when it was saved: the host's next idle poll runs them, as it would have)
        self._due.update(dict.fromkeys(s for s in online["due"] if s in self._windows))

    def _parsed_online(self, online: Any) -> dict[str, Any] | None:
        """:meth:`state_dict`'s ``"online"`` part, checked (``ValueError`` naming what is wrong;
        None: a state without one)."""
        if online is None:
            return None
        if not isinstance(online, Mapping):
            raise ValueError("LatencyModel state: 'online' must be an object")

        def table(name: str) -> Mapping[str, Any]:
            got = online.get(name, {})
            if not isinstance(got, Mapping):
                raise ValueError(f"LatencyModel state: online {name!r} must be an object")
            return got

        def row(key: str, values: Any) -> tuple[tuple[float, ...], float]:
            size = len(TERMS[key.split("/")[0]])
            if not isinstance(values, Sequence) or len(values) != size + 1:
                raise ValueError(f"LatencyModel state: a window row of {key} must be {size + 1} numbers")
            *v, y = (float(x) for x in values)
            if not all(math.isfinite(x) and x >= 0 for x in v) or not (math.isfinite(y) and y > 0):
                raise ValueError(f"LatencyModel state: bad window row of {key}: {values!r}")
            return tuple(v), y

        def count(name: str, value: Any) -> int:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"LatencyModel state: online {name!r} counts must be integers >= 0")
            return value

        def key_of(k: Any) -> str:
            if k not in KEYS:
                raise ValueError(f"LatencyModel state: unknown key {k!r} in 'online'")
            return str(k)

        sets = ("idle", *TRAINER_PHASES)
        try:
            windows = {_parsed_set(n, sets): [row(n.split("|")[0], r) for r in rows]
                       for n, rows in table("windows").items()}
            levels = {_parsed_level(n, (*sets, SHARED, LONE, MIX)): float(v) for n, v in table("levels").items()}
            if not all(math.isfinite(v) for v in levels.values()):
                raise ValueError("LatencyModel state: online levels must be finite")
            shared = {key_of(k): [(_parsed_set(f"{k}|{st}", TRAINER_PHASES)[1], *row(k, [*v, y])) for st, v, y in d]
                      for k, d in table("shared_recent").items()}
            lone = {key_of(k): [row(k, [*v, y]) for v, y in d] for k, d in table("lone_recent").items()}
            ratios = {_parsed_set(n, sets): [float(x) for x in r] for n, r in table("ratios").items()}
            safety = {_parsed_set(n, sets): f for n, f in table("safety").items()}
            if not all(isinstance(f, int | float) and not isinstance(f, bool) and math.isfinite(f) and f >= 1.0
                       for f in safety.values()):
                raise ValueError("LatencyModel state: online safety factors must be finite and at least 1")
            joined, due = online.get("joined", []), online.get("due", [])
            if not isinstance(joined, list) or not isinstance(due, list):
                raise ValueError("LatencyModel state: online 'joined' and 'due' must be lists")
            return {
                "windows": windows,
                "unfitted": {_parsed_set(n, sets): count("unfitted", c) for n, c in table("unfitted").items()},
                "levels": levels,
                "busy_steps": {key_of(k): count("busy_steps", c) for k, c in table("busy_steps").items()},
                "joined": {_parsed_set(n, sets) for n in joined},
                "shared_recent": shared,
                "lone_recent": lone,
                "ratios": ratios,
                "ratio_count": {_parsed_set(n, sets): count("ratio_count", c)
                                for n, c in table("ratio_count").items()},
                "safety": safety,
                "due": [_parsed_set(n, sets) for n in due],
            }
        except (TypeError, ValueError) as e:
            raise ValueError(f"LatencyModel state: bad 'online' part: {e}") from e


def prior_weights(prior: Sequence[float] | None, weight: float) -> list[float] | float:
    """A refit's prior weight per term: ``weight`` where the calibration ``prior`` is above 0; 0
    where it is 0 (a term that the calibration found no use for, or that a migrated state or an
    offline form added: free to move, as every term was before :data:`PRIOR_WEIGHT`)."""
    return weight if prior is None else [weight if c > 0 else 0.0 for c in prior]


def _set_name(s: tuple[str, str]) -> str:
    """A set's name in :meth:`LatencyModel.state_dict`: ``"{key}|{state}"``."""
    return f"{s[0]}|{s[1]}"


def _parsed_set(name: Any, states: Sequence[str]) -> tuple[str, str]:
    """:func:`_set_name`'s inverse, for a key of :data:`KEYS` and a state among ``states``."""
    key, sep, state = str(name).partition("|")
    if not sep or key not in KEYS or state not in states:
        raise ValueError(f"unknown set {name!r}")
    return key, state


def _parsed_level(name: Any, states: Sequence[str]) -> tuple[str, str]:
    """:func:`_parsed_set` of a level's name: a state among ``states`` or a spot's
    (:data:`SPOT_PREFIX` and a name :func:`is_spot` takes, of either :data:`SPOT_GRAIN`)."""
    key, sep, state = str(name).partition("|")
    if sep and key in KEYS and state.startswith(SPOT_PREFIX) and is_spot(state[len(SPOT_PREFIX):]):
        return key, state
    return _parsed_set(name, states)


def _slot(key: str, state: str) -> str:
    """Where a set's coefficients live: ``key`` in the idle tables for ``idle``, else its
    :func:`busy_key` in the busy ones."""
    return key if state == "idle" else busy_key(key, state)


def busy_key(key: str, phase: str) -> str:
    """The name of ``key``'s busy term beside a trainer in ``phase``: ``key`` itself for
    ``active`` (the one term of earlier states), ``"{key}/{phase}"`` otherwise."""
    return key if phase == "active" else f"{key}/{phase}"


BUSY_KEYS: Final = tuple(busy_key(k, p) for k in KEYS for p in TRAINER_PHASES)


def slot_key(slot: str) -> str:
    """The step key of a :func:`busy_key` (or of an idle slot, the key itself)."""
    return "/".join(slot.split("/")[:2])


def _migrated(state: Mapping[str, Any]) -> dict[str, Any]:
    """A version-1 or -2 state as version 3: :func:`from_legacy_prefill` with ``i_ctx = 0`` and
    ``k_over = 0`` for every idle prefill set (busy terms are ``(ρ, δ)`` in every version); no
    ``knee_tokens``: at ``k_over = 0`` any knee prices the same."""
    version = state.get("version")
    out = {**state, "version": _STATE_VERSION}
    for name in ("coefficients", "calibration"):
        table = state.get(name, {})
        if not isinstance(table, Mapping):
            continue  # (load_state_dict rejects it)
        try:
            out[name] = {k: from_legacy_prefill(v, 0.0) if str(k).startswith("prefill/") else v
                         for k, v in table.items()}
        except (TypeError, ValueError) as e:
            raise ValueError(f"LatencyModel state (version {version}): bad {name!r} table: {e}") from e
    logger.info("latency model state of version %s migrated: prefill sets get %s = 0", version,
                "i_ctx and k_over" if version == 1 else "k_over")
    return out


def _checked(form: str, values: Sequence[float]) -> tuple[float, ...]:
    size = 2 if form == "busy" else len(TERMS[form])
    coef = tuple(float(v) for v in values)
    if len(coef) != size or not all(math.isfinite(c) and c >= 0 for c in coef):
        raise ValueError(f"{form} coefficients must be {size} finite values >= 0, got {values!r}")
    return coef


def _rows(
    records: Sequence[StepRecord], regressors: Callable[[StepFeatures], tuple[float, ...]],
) -> list[tuple[tuple[tuple[float, ...], float], str, str]]:
    """``((regressors, seconds), key, state)`` per usable record (interrupted steps are not;
    calibration steps beside a trainer count as ``active``)."""
    out = []
    for record in records:
        if record.interrupted or not record.duration_s > 0:
            continue
        f = StepFeatures.from_record(record)
        out.append(((regressors(f), record.duration_s), f.key, f.state))
    return out

"""The configurations a benchmark compares on the same arrivals, by name."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum


class RunKind(StrEnum):
    """How a configuration runs (the harness has one runner per kind)."""

    INFERENCE = "inference"  # the engine alone
    COSERVE = "coserve"  # the engine with a co-server attached (an admission policy)
    SPLIT = "split"  # the engine alone, beside a trainer process with its own training loop


@dataclass(frozen=True)
class RunConfig:
    """One configuration: its kind and, for co-serving, the admission policy, whether an
    arrival interrupts a running FT-only step and when a running backward is paused
    (``SLOConfig.pause_prefill``)."""

    name: str
    kind: RunKind
    summary: str
    policy: str = "off"
    interrupt_ft_only: bool = True
    pause_prefill: str = "always"
    hold_pause: bool = False  # SLOConfig.hold_pause
    # steps with prefill or FT rows through the piecewise CUDA graphs (None: as the engine was
    # started, --prefill-graphs); either way on the same engine, so on the same arrivals
    prefill_graphs: bool | None = None
    # a baseline's own setting (None: --split-mps-percentage, --naive-tokens): ``split-N`` and
    # ``naive-N`` run the baseline at N, so that one of them can meet the SLO the goals compare at
    split_share: int | None = None
    naive_tokens: int | None = None
    # a co-serving configuration's trainer at its own MPS share of the SMs (``NAME@N``; None:
    # --trainer-sm-share), so that a share and none run on the same arrivals in one benchmark
    trainer_share: int | None = None

    def uses_prefill_graphs(self, engine_default: bool) -> bool:
        """Whether this configuration asks for the prefill graphs, given the engine's setting."""
        return engine_default if self.prefill_graphs is None else self.prefill_graphs


CONFIGS: dict[str, RunConfig] = {
    c.name: c
    for c in (
        RunConfig(
            "inference", RunKind.INFERENCE, "inference only: the reference of the relative SLO"
        ),
        RunConfig(
            "temporal",
            RunKind.COSERVE,
            "coserve, FT only in steps with no inference (interruptible)",
            policy="temporal",
        ),
        RunConfig(
            "full",
            RunKind.COSERVE,
            "coserve, FT inside inference batches within the latency budget, "
            "and FT-only steps (interruptible)",
            policy="full",
        ),
        RunConfig(
            "full-noint",
            RunKind.COSERVE,
            "coserve full, FT-only steps never interrupted",
            policy="full",
            interrupt_ft_only=False,
        ),
        RunConfig(
            "full-overlap",
            RunKind.COSERVE,
            "coserve full, the backward paused only for steps the latency model says it would "
            "slow past their budget (not for every prefill or mixed step)",
            policy="full",
            pause_prefill="model",
        ),
        RunConfig(
            "full-hold",
            RunKind.COSERVE,
            "coserve full, the backward kept paused between steps while prompt tokens are queued",
            policy="full",
            hold_pause=True,
        ),
        RunConfig(
            "full-graphs",
            RunKind.COSERVE,
            "coserve full, steps with prefill or FT rows through the piecewise CUDA graphs",
            policy="full",
            prefill_graphs=True,
        ),
        RunConfig(
            "full-eager",
            RunKind.COSERVE,
            "coserve full, steps with prefill or FT rows eager (no piecewise CUDA graphs)",
            policy="full",
            prefill_graphs=False,
        ),
        RunConfig(
            "naive",
            RunKind.COSERVE,
            "up to --naive-tokens FT tokens in every step, shortest first, "
            "no latency model, no interruption",
            policy="naive",
            interrupt_ft_only=False,
        ),
        RunConfig(
            "split",
            RunKind.SPLIT,
            "a separate trainer process with its own training loop, running "
            "all the time beside inference (fixed MPS share on GPU)",
        ),
        RunConfig(
            "inference-graphs",
            RunKind.INFERENCE,
            "inference only, steps with prefill through the piecewise CUDA graphs",
            prefill_graphs=True,
        ),
        RunConfig(
            "inference-last",
            RunKind.INFERENCE,
            "inference only again, run last: shows whether the order of the runs biased the reference",
        ),
    )
}
REFERENCE = "inference"


def config_named(name: str) -> RunConfig | None:
    """:data:`CONFIGS` ``[name]``, or a baseline at its own setting: ``split-N`` (the split
    trainer at an N% MPS share, 1–100) and ``naive-N`` (N FT tokens a step, N ≥ 1), or a
    co-serving configuration with its trainer at an N% MPS share, ``NAME@N`` (``full@50``,
    ``naive-2048@50``; 1–100); else None."""
    if name in CONFIGS:
        return CONFIGS[name]
    if "@" in name:
        base_name, _, share = name.rpartition("@")
        base_config = config_named(base_name)
        if (base_config is None or base_config.kind != RunKind.COSERVE or base_config.trainer_share is not None
                or not share.isdigit() or not 1 <= int(share) <= 100):
            return None
        return replace(base_config, name=name, trainer_share=int(share),
                       summary=f"{base_config.summary}; the trainer at a {int(share)}% MPS share")
    base, _, value = name.rpartition("-")
    if base not in ("split", "naive") or not value.isdigit() or int(value) < 1:
        return None
    n = int(value)
    if base == "split":
        if n > 100:
            return None
        return replace(CONFIGS["split"], name=name, split_share=n,
                       summary=f"the split baseline with the trainer at a {n}% MPS share")
    return replace(CONFIGS["naive"], name=name, naive_tokens=n,
                   summary=f"the naive baseline, up to {n} FT tokens in every step")


def parse_configs(text: str) -> tuple[RunConfig, ...]:
    """Comma-separated names (:func:`config_named`), in the order given, duplicates dropped, with
    the reference (``inference``) first whether listed or not. Raises ``ValueError`` naming the
    flag."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if config_named(n) is None]
    if unknown:
        raise ValueError(
            f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(CONFIGS)}, "
            "split-N (N% MPS share) or naive-N (N FT tokens a step), each co-serving one also "
            "as NAME@N (its trainer at an N% MPS share, 1-100)"
        )
    ordered = dict.fromkeys([REFERENCE, *names])
    return tuple(c for n in ordered if (c := config_named(n)) is not None)

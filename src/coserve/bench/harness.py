"""The evaluation harness (issue 6): every configuration on the same arrivals, one engine.

One process loads the model once, cuts the workload to the window holding its largest burst,
warms the engine up, then runs the configurations one after the other on the same arrivals:
inference only first (the reference of the relative SLO), then each co-serving policy and the
split baseline. The first co-serving run calibrates the latency model; every co-serving run
starts from that calibrated state. After every configuration the JSON result and the markdown
table are rewritten, so a run stopped early keeps what it finished; the plots come at the end.
A configuration that fails is recorded and the others still run; with a time budget, one that
would not finish in time is skipped (both are named in the result and the table).

Result schema (``STEM.json``; times in ms unless named ``_s``, attainment as a fraction):

* ``commit``, ``dirty``, ``device``, ``versions``, ``command``: provenance;
* ``config``: ``workload`` (name, source, window_start_s, duration_s, requests, seed, scaling),
  ``slo`` (ttft_ms, tpot_ms, margin, relative_factor, attainment_target), ``model``, ``engine``,
  ``ft`` (lengths, samples, backward_tokens, LoRA, lr, naive_tokens, split_mps_percentage,
  trainer_sm_share),
  ``configs`` (name → kind, policy, interrupt_ft_only, pause_prefill, summary),
  ``rolling_window_s``, ``mps``;
* ``reference``: the inference-only mean TTFT / TPOT and the relative SLOs derived from them;
* ``calibration``: batches timed and seconds taken (null when no co-serving configuration ran);
* ``figures``: configuration → ``attainment_abs``, ``attainment_rel``, ``ft_tokens_per_s``,
  ``ft_tokens``, ``optimizer_steps``, ``inference_tokens_per_s``, ``latency`` (TTFT / TPOT
  p50 / p90 / p99 / mean), ``latency_model_error`` (per step kind and ``all``: median_rel,
  p99_rel, n; null without a co-server), ``gpu_utilization`` (mean_percent, samples; null when
  it cannot be read), ``gpu_clock_mhz`` (the SM clock's mean and min; null likewise),
  ``cuda_allocator`` (the replay's cudaMalloc / cudaFree calls and allocation retries, reserved
  GiB at its start and end; null off CUDA), ``profile`` (with ``--profile-window``:
  torch.profiler's operator tables over that window, by self CPU and self CUDA time),
  ``engine_steps`` (every inference, mixed or FT-only step, interrupted FT-only ones too: t_s, kind,
  mode, prefill and decode tokens, seconds, and of them schedule_s, forward_enqueue_s,
  forward_gpu_s; prefill_context_tokens, ft_tokens; forward_cpu_s), ``loss_first`` / ``loss_last``,
  ``timeline`` (per second: t_s, inference and FT tokens/s, rolling attainment abs / rel, GPU
  utilization samples with the SM clock and the share of the host's CPUs busy, and the
  replay's wall-clock start ``started_unix_s``), ``per_request`` (arrival_s, ttft_ms, tpot_ms, output_tokens; null for a
  request that did not get there);
* ``comparisons``: ``ft_over_split`` / ``ft_over_naive`` / ``ft_over_temporal`` (configuration →
  ratio of FT tokens/s), ``attainment_minus_reference_pp`` (configuration → abs / rel);
* ``failed`` / ``skipped``: configuration → why it has no figures (an exception; not enough of
  ``--time-budget`` left for a run as long as the last one of its kind);
* ``outputs``: the file names written beside it and why plots were skipped, if they were.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from coserve.bench import shapes
from coserve.bench.analysis import comparisons, summarize
from coserve.bench.configs import REFERENCE, RunConfig, RunKind
from coserve.bench.ftdata import LengthLaw, write_ft_dataset
from coserve.bench.metrics import SLO, relative_slo
from coserve.bench.provenance import provenance
from coserve.bench.replay import InProcessDriver
from coserve.bench.report import Outputs, prepare_out_dir, write_outputs
from coserve.bench.runners import RUNNERS, BenchContext, TrainingSetup
from coserve.bench.utilization import UtilizationSampler
from coserve.bench.workload import Arrival, Scaling, Workload, load_workload
from coserve.core.config import LoRAConfig, OptimConfig, SLOConfig
from coserve.core.latency import LONE_GAP_S, PHASES_IN_USE
from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.gc_freeze import freeze_startup_objects
from coserve.trainer.mps import start_mps_daemon

logger = logging.getLogger(__name__)

IN_PROGRESS = "drawn when every configuration has run"


@dataclass(frozen=True)
class FTSetup:
    """The fine-tuning every co-serving and split configuration does.

    ``naive_tokens``: the naive baseline's FT tokens per step; None means
    ``max(SLOConfig().naive_tokens, longest sample)`` so that it can admit every sample.
    """

    lengths: LengthLaw
    num_samples: int = 2000
    backward_tokens: int = 1024
    lora: LoRAConfig = LoRAConfig()
    optim: OptimConfig = OptimConfig()
    naive_tokens: int | None = None
    split_mps_percentage: int = 50
    # the co-serving trainer's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (None: no limit)
    trainer_sm_share: int | None = None
    trainer_threads: int = 0
    save_mlp_activations: bool = False

    @property
    def naive_limit(self) -> int:
        return self.naive_tokens or max(SLOConfig().naive_tokens, self.lengths.hi)


@dataclass(frozen=True)
class BenchSpec:
    """One benchmark run. ``slo`` gives the absolute SLOs and the margin (its policy fields are
    set per configuration); ``engine.model`` may be ``shape:NAME`` (:mod:`coserve.bench.shapes`)."""

    workload: str
    duration_s: float
    scaling: Scaling
    configs: tuple[RunConfig, ...]
    slo: SLOConfig
    engine: EngineConfig
    ft: FTSetup
    out: Path
    seed: int = 0
    relative_factor: float = 3.0
    rolling_window_s: float = 10.0
    attainment_target: float = 0.99
    warmup_requests: int = 16
    # Replay the workload's first `burn_in_s` seconds once, untimed, before the reference: on the
    # H200 the first replay after start-up ran slower than later ones (diagnostic README).
    burn_in_s: float = 0.0
    # torch.profiler over this window of replay time (start s, end s) in every configuration
    profile_window: tuple[float, float] | None = None
    # after the window, requests in flight get up to this long to finish; None: long enough for
    # any request that meets the absolute SLO (TTFT + max_output × TPOT limit, ``drain_limit_s``),
    # so that one still running at the end has missed it; the drain ends early once every
    # request still running has missed for certain (``InProcessDriver.run``'s ``slo``)
    drain_s: float | None = None
    trainer_warmup_timeout_s: float = 300.0
    mps: bool = True
    engine_threads: int = 0
    plots: bool = True
    time_budget_s: float = 0.0
    # Probe the rate first: inference-only runs of `probe_s` on the workload's busiest window
    # find the highest rate at which inference alone meets the absolute SLO for
    # `attainment_target` of the requests (see `bracket_rate`: from `scaling.rate`, down or up by
    # `probe_factor`, then bisected until the bracket is within `probe_resolution`; at most
    # `max_probes` runs).
    auto_rate: bool = False
    # A latency-model state (JSON) from an earlier run of the same model shape and engine
    # settings: loaded instead of calibrating again. Every run writes its own next to the result.
    latency_state: Path | None = None
    probe_s: float = 20.0
    probe_factor: float = 0.6
    max_probes: int = 6
    probe_resolution: float = 1.2

    @property
    def slo_limits(self) -> SLO:
        """The absolute per-request limits in seconds."""
        return SLO(self.slo.ttft_slo_s, self.slo.tpot_slo_s)

    @property
    def drain_limit_s(self) -> float:
        """``drain_s``, or (None) the time a request that meets the absolute SLO may take after
        the window at most: its TTFT limit plus ``max_output - 1`` tokens at the TPOT limit, and
        a second of slack."""
        if self.drain_s is not None:
            return self.drain_s
        return self.slo.ttft_slo_s + (self.scaling.max_output - 1) * self.slo.tpot_slo_s + 1.0

    def __post_init__(self) -> None:
        if not self.configs or self.configs[0].name != REFERENCE:
            raise ValueError(
                f"--configs: the first configuration must be {REFERENCE!r} (the reference)"
            )
        if self.relative_factor <= 0 or self.rolling_window_s <= 0:
            raise ValueError("--relative-factor and --rolling-window must be positive")
        if not 0 < self.attainment_target <= 1:
            raise ValueError(f"--attainment-target must be in (0, 1], got {self.attainment_target}")
        if (self.warmup_requests < 0 or (self.drain_s is not None and self.drain_s < 0) or self.time_budget_s < 0
                or self.burn_in_s < 0):
            raise ValueError("--warmup-requests, --burn-in, --drain and --time-budget must be >= 0")
        if self.profile_window is not None and not 0 <= self.profile_window[0] < self.profile_window[1]:
            raise ValueError(f"--profile-window must be START:END with 0 <= START < END, got {self.profile_window}")
        if (self.probe_s <= 0 or not 0 < self.probe_factor < 1 or self.max_probes < 1
                or not self.probe_resolution > 1):
            raise ValueError("--probe-seconds > 0, 0 < --probe-factor < 1, --max-probes >= 1 and "
                             "--probe-resolution > 1 needed")


def _engine_config(spec: BenchSpec, work: Path) -> EngineConfig:
    cfg = replace(
        spec.engine,
        num_training_slots=max(1, spec.engine.num_training_slots),
        max_lora_rank=max(spec.engine.max_lora_rank, spec.ft.lora.rank),
        # (built if any configuration asks for them; each run switches them, runners.use_prefill_graphs)
        prefill_graphs=any(c.uses_prefill_graphs(spec.engine.prefill_graphs) for c in spec.configs),
    )
    if shapes.is_shape(cfg.model):
        fmt = "dummy" if cfg.load_format == "auto" else cfg.load_format
        cfg = replace(
            cfg, model=str(shapes.materialize(cfg.model, work / "model")), load_format=fmt
        )
    return cfg


def _uses_cuda(cfg: EngineConfig) -> bool:
    return cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())


def _warm_up(
    driver: InProcessDriver, arrivals: tuple[Arrival, ...], n: int, drain_s: float
) -> None:
    """Serve the first ``n`` requests at once (kernels, allocator, graphs) before any timed run."""
    if n:
        batch = [Arrival(0.0, a.prompt_tokens, a.output_tokens) for a in arrivals[:n]]
        driver.run(batch, duration_s=1.0, drain_s=max(drain_s, 60.0))


def _config_section(
    spec: BenchSpec, engine: LLMEngine, workload: Workload, mps: bool
) -> dict[str, Any]:
    ft = spec.ft
    return {
        "workload": {
            "name": workload.name,
            "source": workload.source,
            "window_start_s": workload.window_start_s,
            "duration_s": workload.duration_s,
            "requests": len(workload.arrivals),
            "seed": spec.seed,
            "scaling": asdict(spec.scaling),
        },
        "slo": {
            "ttft_ms": spec.slo.ttft_slo_s * 1e3,
            "tpot_ms": spec.slo.tpot_slo_s * 1e3,
            "margin": spec.slo.margin,
            "relative_factor": spec.relative_factor,
            "attainment_target": spec.attainment_target,
        },
        "model": {
            "name": spec.engine.model,
            "dtype": str(engine.runner.dtype).removeprefix("torch."),
            "layers": engine.model_config.num_layers,
            "hidden_size": engine.model_config.hidden_size,
            "load_format": engine.config.load_format,
            "context": engine.max_model_len,
        },
        "engine": {
            k: v
            for k, v in asdict(engine.config).items()
            if k not in ("model", "cuda_graph_batch_sizes")
        },
        "ft": {
            "lengths": ft.lengths.spec,
            "samples": ft.num_samples,
            "backward_tokens": ft.backward_tokens,
            "lora_rank": ft.lora.rank,
            "lora_alpha": ft.lora.alpha,
            "targets": list(ft.lora.target_modules),
            "lr": ft.optim.lr,
            "grad_accum": ft.optim.accumulation_tasks,
            "save_mlp_activations": ft.save_mlp_activations,
            "naive_tokens": ft.naive_limit,
            "split_mps_percentage": ft.split_mps_percentage,
            "trainer_sm_share": ft.trainer_sm_share,
        },
        # the latency model's busy phases: an offline replay of the step tables reads them
        # (bench/latency_fit.py's recorded_phases)
        "trainer_phases": list(PHASES_IN_USE),
        "lone_gap_s": LONE_GAP_S,
        "configs": {
            c.name: {
                "kind": str(c.kind),
                "policy": c.policy,
                "interrupt_ft_only": c.interrupt_ft_only,
                "pause_prefill": c.pause_prefill,
                "hold_pause": c.hold_pause,
                "prefill_graphs": c.uses_prefill_graphs(spec.engine.prefill_graphs),
                **({"split_mps_percentage": c.split_share or ft.split_mps_percentage}
                   if c.kind == RunKind.SPLIT else {}),
                **({"naive_tokens": c.naive_tokens or ft.naive_limit} if c.policy == "naive" else {}),
                **({"trainer_sm_share": c.trainer_share or ft.trainer_sm_share}
                   if c.kind == RunKind.COSERVE else {}),
                "summary": c.summary,
            }
            for c in spec.configs
        },
        "rolling_window_s": spec.rolling_window_s,
        "warmup_requests": spec.warmup_requests,
        "burn_in_s": spec.burn_in_s,
        "drain_s": spec.drain_limit_s,
        "mps": mps,
    }


def _setup(
    spec: BenchSpec, work: Path, say: Callable[[str], None]
) -> tuple[BenchSpec, BenchContext, Workload]:
    """Build the engine, cut the workload to fit its context, warm the engine up, write the FT
    data into ``work``; the spec with the workload's scaling as run."""
    engine_cfg = _engine_config(spec, work)
    workload = load_workload(spec.workload, spec.duration_s, spec.scaling, spec.seed)  # (a bad one fails first)
    t0 = time.perf_counter()
    engine = LLMEngine(engine_cfg)
    fitted = spec.scaling.fit(engine.max_model_len, say)
    if fitted is not spec.scaling:
        spec = replace(spec, scaling=fitted)
        workload = load_workload(spec.workload, spec.duration_s, spec.scaling, spec.seed)
    if not workload.arrivals:
        raise ValueError(
            f"--workload {spec.workload}: no arrival in the {spec.duration_s:g} s window"
        )
    say(
        f"workload {workload.name}: {len(workload.arrivals)} requests in {spec.duration_s:g} s "
        f"from {workload.window_start_s:.1f} s of {workload.source}"
    )
    ft = spec.ft
    if ft.lengths.hi > engine.max_model_len:
        raise ValueError(
            f"--ft-lengths {ft.lengths.spec}: longer than the model's context "
            f"({engine.max_model_len} tokens)"
        )
    assert engine.tokenizer is not None
    vocab = min(engine.tokenizer.vocab_size, engine.model_config.vocab_size)
    data = write_ft_dataset(work / "ft.jsonl", ft.num_samples, ft.lengths, vocab, spec.seed)
    driver = InProcessDriver(engine, seed=spec.seed)
    _warm_up(driver, workload.arrivals, spec.warmup_requests, spec.drain_limit_s)
    if spec.burn_in_s > 0:
        burn = tuple(a for a in workload.arrivals if a.time_s < spec.burn_in_s)
        say(f"burn-in: the first {spec.burn_in_s:.0f} s of the workload ({len(burn)} requests), untimed")
        driver.run(burn, duration_s=spec.burn_in_s, drain_s=spec.drain_limit_s, slo=spec.slo_limits)
    say(
        f"engine ready in {time.perf_counter() - t0:.1f} s "
        f"({engine_cfg.model}, {engine.runner.device})"
    )
    training = TrainingSetup(
        data=data,
        max_seq_len=ft.lengths.hi,
        backward_tokens=ft.backward_tokens,
        lora=ft.lora,
        optim=ft.optim,
        naive_tokens=ft.naive_limit,
        split_mps_percentage=ft.split_mps_percentage,
        trainer_sm_share=ft.trainer_sm_share,
        trainer_threads=ft.trainer_threads,
        warmup_timeout_s=spec.trainer_warmup_timeout_s,
        save_mlp_activations=ft.save_mlp_activations,
    )
    ctx = BenchContext(
        engine=engine,
        driver=driver,
        arrivals=workload.arrivals,
        duration_s=spec.duration_s,
        drain_s=spec.drain_limit_s,
        slo=spec.slo,
        training=training,
        work=work,
        sampler=UtilizationSampler(engine.runner.device),
        seed=spec.seed,
        profile_window=spec.profile_window,
        prefill_graphs=spec.engine.prefill_graphs,
    )
    return spec, ctx, workload


def bracket_rate(
    start: float, factor: float, max_probes: int, resolution: float, meets: Callable[[float], bool]
) -> float | None:
    """The highest rate found at which ``meets(rate)``: probe ``start``; while nothing has met,
    step down (× ``factor``), while everything has, step up (÷ ``factor``); once a met rate ``lo``
    and a higher failed one ``hi`` bracket the answer, probe their geometric mean until
    ``hi / lo <= resolution``. At most ``max_probes`` calls; None if no probed rate met."""
    met: list[float] = []
    failed: list[float] = []
    rate = start
    for _ in range(max_probes):
        (met if meets(rate) else failed).append(rate)
        lo = max(met, default=None)
        if lo is None:
            rate = min(failed) * factor
            continue
        hi = min((r for r in failed if r > lo), default=None)
        if hi is None:
            rate = lo / factor
        elif hi / lo <= resolution:
            break
        else:
            rate = math.sqrt(lo * hi)
    return max(met, default=None)


def _probe_rate(
    spec: BenchSpec, ctx: BenchContext, say: Callable[[str], None]
) -> tuple[BenchSpec, Workload, list[dict[str, float]]]:
    """The highest probed rate at which inference alone meets the absolute SLO for
    ``attainment_target`` of the requests on the busiest ``probe_s`` window
    (:func:`bracket_rate`); returns the spec and the workload at that rate, and every probe
    (rate, attainment, requests)."""
    from coserve.bench.metrics import attainment

    probes: list[dict[str, float]] = []

    def meets(rate: float) -> bool:
        scaling = replace(spec.scaling, rate=rate)
        window = load_workload(spec.workload, spec.probe_s, scaling, spec.seed)
        run = ctx.driver.run(window.arrivals, duration_s=spec.probe_s, drain_s=spec.drain_limit_s,
                             slo=spec.slo_limits)
        got = attainment(run.records, spec.slo.ttft_slo_s, spec.slo.tpot_slo_s)
        probes.append({"rate": rate, "attainment": got, "requests": float(len(run.records))})
        say(f"rate probe ×{rate:.3g}: inference-only attainment {_pct(got)} on {len(run.records)} requests")
        return got >= spec.attainment_target

    rate = bracket_rate(spec.scaling.rate, spec.probe_factor, spec.max_probes, spec.probe_resolution, meets)
    if rate is None:
        rate = min(p["rate"] for p in probes)
        say(f"rate probe: no probed rate met {_pct(spec.attainment_target)}; using ×{rate:.3g}")
    else:
        say(f"rate probe: using ×{rate:.3g}, the highest probed rate that met {_pct(spec.attainment_target)}")
    spec = replace(spec, scaling=replace(spec.scaling, rate=rate))
    return spec, load_workload(spec.workload, spec.duration_s, spec.scaling, spec.seed), probes


def run_bench(
    spec: BenchSpec, *, argv: list[str] | None = None, progress: Callable[[str], None] | None = None
) -> tuple[dict[str, Any], Outputs]:
    """Run every configuration of ``spec``; write and return the result (see the module docstring).

    ``argv``: the command line to record (default ``sys.argv``); ``progress``: called with one
    line per stage (the CLI prints them).
    """
    say = progress or logger.info
    prepare_out_dir(spec.out)  # (before the engine and the runs: a bad --out failed only at their end)
    began = time.monotonic()
    mps = start_mps_daemon() if spec.mps and _uses_cuda(spec.engine) else False
    if spec.engine_threads:
        torch.set_num_threads(spec.engine_threads)
    work = Path(tempfile.mkdtemp(prefix="coserve-bench-"))
    try:
        spec, ctx, workload = _setup(spec, work, say)
        freeze_startup_objects("benchmark")
        if spec.latency_state is not None:
            ctx.latency_state = json.loads(spec.latency_state.read_text())
            ctx.calibration = {"loaded_from": str(spec.latency_state), "seconds": 0.0}
        probes: list[dict[str, float]] = []
        if spec.auto_rate:
            spec, workload, probes = _probe_rate(spec, ctx, say)
            ctx.arrivals = workload.arrivals
        result: dict[str, Any] = {
            **provenance(argv),
            "config": {**_config_section(spec, ctx.engine, workload, mps), "rate_probes": probes},
            "reference": None,
            "calibration": None,
            "figures": {},
            "comparisons": {},
            "failed": {},
            "skipped": {},
        }
        absolute = spec.slo_limits
        relative: SLO | None = None
        stem = workload.name
        write_outputs(result, spec.out, stem, skip_plots=IN_PROGRESS)
        took: dict[RunKind, float] = {}
        for config in spec.configs:
            left = spec.time_budget_s - (time.monotonic() - began)
            need = took.get(config.kind, max(took.values(), default=spec.duration_s))
            if spec.time_budget_s and need > left and config.name != REFERENCE:
                result["skipped"][config.name] = (
                    f"time budget: ~{need:.0f} s needed, {left:.0f} s left"
                )
                say(f"{config.name:>10}: skipped ({result['skipped'][config.name]})")
                continue
            start = time.monotonic()
            calibrated = ctx.calibration
            try:
                outcome = RUNNERS[config.kind](ctx, config)
            except Exception as e:  # one configuration's failure must not lose the others'
                if config.name == REFERENCE:
                    raise
                logger.exception("configuration %s failed", config.name)
                result["failed"][config.name] = f"{type(e).__name__}: {e}"
                write_outputs(result, spec.out, stem, skip_plots=IN_PROGRESS)
                continue
            if calibrated is None and ctx.calibration is not None:
                start += ctx.calibration["seconds"]  # once per benchmark: not part of a run's cost
            took[config.kind] = time.monotonic() - start
            if config.name == REFERENCE:
                relative = _reference(result, outcome.replay.records, spec.relative_factor)
            result["calibration"] = ctx.calibration
            figures = summarize(
                outcome, slo=absolute, relative=relative, window_s=spec.rolling_window_s
            )
            result["figures"][config.name] = figures
            result["comparisons"] = comparisons(result["figures"])
            write_outputs(result, spec.out, stem, skip_plots=IN_PROGRESS)
            say(
                f"{config.name:>10}: attainment abs {_pct(figures['attainment_abs'])} "
                f"rel {_pct(figures['attainment_rel'])}, "
                f"FT {figures['ft_tokens_per_s']:8.0f} tokens/s ({took[config.kind]:.0f} s)"
            )
            # what this run left (its records, the result so far) stays out of the next run's
            # garbage collections (coserve.gc_freeze)
            freeze_startup_objects("benchmark")
            if ctx.engine.runner.device.type == "cuda":
                torch.cuda.empty_cache()
        if ctx.latency_state is not None:
            (spec.out / f"{stem}-latency-state.json").write_text(json.dumps(ctx.latency_state))
        skip = None if spec.plots else "turned off (--no-plots)"
        return result, write_outputs(result, spec.out, stem, skip_plots=skip)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _pct(x: float | None) -> str:
    return "  n/a" if x is None or math.isnan(x) else f"{x * 100:5.1f}%"


def _reference(result: dict[str, Any], records: Any, factor: float) -> SLO | None:
    """Record the relative SLOs derived from the inference-only run (None, logged, if it
    finished no request to derive them from)."""
    try:
        rel = relative_slo(records, factor)
    except ValueError as e:
        logger.warning("%s", e)
        return None
    result["reference"] = {
        "mean_ttft_ms": rel.ttft_s / factor * 1e3,
        "mean_tpot_ms": rel.tpot_s / factor * 1e3,
        "relative_ttft_slo_ms": rel.ttft_s * 1e3,
        "relative_tpot_slo_ms": rel.tpot_s * 1e3,
    }
    return rel

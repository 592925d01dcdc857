"""``coserve serve``: the OpenAI-compatible HTTP server, optionally fine-tuning while it serves.

    coserve serve --model tiny --host 127.0.0.1 --port 8000
    coserve serve --model tiny --lora-modules support=adapters/support sql=adapters/sql
    coserve serve --model tiny --finetune-data data.jsonl --output out/ --backward-tokens 128
    coserve serve --model tiny --finetune-jobs jobs/ --epochs 3    # clients create jobs (/v1/files, /v1/fine_tuning/jobs)

``--lora-modules NAME=PEFT_DIR`` serves each adapter under its own model name (the vLLM flag): a
request whose ``model`` is NAME runs with it; every adapter is read and checked at start-up. With
``--allow-runtime-lora`` clients can load and unload adapters while it serves (vLLM's routes).

With ``--finetune-data`` the engine co-serves: fine-tuning rows fill the batches' spare room
and idle time; when the dataset's epochs are done (or at Ctrl-C) the adapter is exported to
``OUTPUT/adapter`` and the server keeps serving (or stops). With ``--finetune-jobs DIR`` clients
upload datasets and create fine-tuning jobs through the OpenAI API, one at a time, each trained
with the fine-tuning flags' settings (the request's epochs, learning-rate multiplier and seed
aside) and served, once trained, under its ``fine_tuned_model`` name.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from coserve.server.cli import (
    add_engine_args,
    add_finetune_args,
    add_slo_args,
    command,
    engine_kwargs,
    finetune_spec,
    slo_config,
)

if TYPE_CHECKING:
    from coserve.server.finetune import FinetuneSpec
    from coserve.server.job_board import JobsConfig

logger = logging.getLogger(__name__)

SWITCH_INTERVAL_MS = 0.1
"""``--switch-interval-ms``' default. The engine's step loop runs in a thread of this process; each
torch call lets the GIL go and takes it back, and while another thread runs Python (a fine-tuning
job's dataset load at its create and resume, the event loop's HTTP and stream work) each taking
back may wait one switch interval. On the H100 in session 31 (``bench/results/verify_h100/
session31/README.md``) the requests that arrived while a job was created and set up had a TTFT p99
of 616 ms against 48 ms with no job. On the dev VM (``bench/gil_contention.py``, tiny model, one
intra-op thread, ``bench/results/host_cpu/session31/gil_contention.json``) a decode step of 8
requests took 4.8-5.1 ms (p50) alone; beside a thread loading a dataset, p50 / p99 13 ms / 4.3 s at
CPython's 5 ms, 2.1 / 2.7 s at 1 ms, 1.6 / 2.0 s at 0.5 ms, 110 / 195 ms at 0.2 ms and 56 / 116 ms
at 0.1 ms, the load 18% slower there (26.9 against 32.7 loads/s)."""


class _OptionalFinetuneFlags:
    """Forwards ``add_argument`` to an argument group: the fine-tuning flags become optional and
    ``--data`` is spelled ``--finetune-data`` (its presence is what turns co-serving on)."""

    def __init__(self, group: argparse._ArgumentGroup) -> None:
        self.group = group

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action:
        if names == ("--data",):
            names, kwargs["dest"] = ("--finetune-data",), "data"
            kwargs["help"] = "fine-tune on this dataset while serving (" + kwargs.get("help", "") + ")"
        kwargs["required"] = False
        return self.group.add_argument(*names, **kwargs)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.set_defaults(enable_prefix_caching=True)  # (as vLLM's: a server's chats and system prompts repeat)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PEFT_DIR",
                   help="serve these PEFT adapters, each under its model name NAME (at most --max-loras "
                        "of them in one batch; more are swapped in least-recently-used first)")
    p.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                   help="every SECONDS in which something happened, print a line: requests answered, running "
                        "and waiting, generated tokens/s and, while co-serving, the share that met the SLOs "
                        "and fine-tuning's progress (steps, samples, loss, FT tokens/s, time left); 0: none. "
                        "The end of fine-tuning is printed at once either way")
    p.add_argument("--api-key", default=os.environ.get("COSERVE_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route (401 otherwise) but /health and "
                        "/metrics; default: $COSERVE_API_KEY, else none")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="let chat requests offer tools: the format the model writes its calls in (hermes: "
                        "<tool_call>{json}</tool_call>, Qwen and Hermes models; llama3_json: a JSON object, Llama "
                        "3.1+); its calls come back as tool_calls (default: none, tools are a 400)")
    p.add_argument("--switch-interval-ms", type=float, default=SWITCH_INTERVAL_MS, metavar="MS",
                   help="the interpreter's thread switch interval (sys.setswitchinterval): how long the engine's "
                        "thread may wait for the GIL, each time it takes it back, while another thread of the "
                        "server runs Python (HTTP, streams, a fine-tuning job's dataset load); Python's default is 5 "
                        "(default: %(default)s)")
    p.add_argument("--allow-runtime-lora", action="store_true",
                   help="let clients load and unload adapters while the server runs (POST "
                        "/v1/load_lora_adapter {lora_name, lora_path}, /v1/unload_lora_adapter {lora_name}); "
                        "it reads any path the server can, so only where clients are trusted")
    group = p.add_argument_group("co-serving (fine-tuning while serving)")
    add_finetune_args(cast(argparse.ArgumentParser, _OptionalFinetuneFlags(group)))
    add_slo_args(group)
    group.add_argument("--trainer-sm-share", type=int, default=None,
                       help="the trainer's share of the GPU's SMs under CUDA MPS, 1-100 (default: no limit): "
                            "a share keeps decode steps beside the backward steadier, at some FT throughput (H100, session 28: "
                            "latency-model p99 15%% at 50, 11%% at 30, with 40%% fewer FT tokens/s at 30)")
    group.add_argument("--finetune-jobs", type=Path, default=None, metavar="DIR",
                       help="let clients create fine-tuning jobs through the OpenAI API (POST /v1/files, then "
                            "/v1/fine_tuning/jobs), one running at a time and the others queued, beside --finetune-data's or alone: uploads go "
                            "to DIR/files, each job's adapter, checkpoint and train log to DIR/jobs/ID, and its "
                            "adapter is served as its fine_tuned_model once trained. Jobs train with these "
                            "flags' settings (the request's n_epochs, learning_rate_multiplier x --lr and seed "
                            "aside; --lora-rank is the largest rank, the engine reserves it). Jobs never run the "
                            "latency model's calibration sweep while the server serves: it runs once at start-up "
                            "into DIR/latency_state.json (not where --latency-state names a model, that file "
                            "exists, or --no-calibrate: then the default coefficients, which learn online), and "
                            "each job's end saves its refitted model there for the next")
    group.add_argument("--max-upload-mb", type=float, default=1024.0, metavar="MB",
                       help="with --finetune-jobs: the largest file a client may upload (413 above it)")
    group.add_argument("--finetune-name", default=None, metavar="NAME",
                       help="also serve the adapter being fine-tuned, under this model name: requests "
                            "naming it run with the trainer's latest optimizer step (and, once training "
                            "is done, with the final adapter)")
    group.add_argument("--latency-state", type=Path, default=None,
                       help="load the latency model from this JSON (OUTPUT/latency_state.json of an earlier "
                            "run of the same model and engine settings: the model as that run left it, "
                            "refitted, its windows and levels included, so it goes on from there) instead "
                            "of calibrating")
    group.add_argument("--no-calibrate", action="store_true",
                       help="skip the latency model's calibration sweep at start-up (seconds of timed "
                            "batches; a calibration is saved to OUTPUT/latency_state.json, and the refitted "
                            "model there again when the run ends): admission then starts from default "
                            "coefficients and learns online")


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, less the signal it raises again once it has shut down gracefully
        (uvicorn >= 0.29): raised inside the event loop, that signal made Ctrl-C print a
        ``KeyboardInterrupt`` and a cancelled lifespan's traceback after a clean stop."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                try:
                    yield
                finally:
                    captured = getattr(self, "_captured_signals", None)
                    if isinstance(captured, list):
                        captured.clear()

    return Server


def _stop_after_failure(server: Any) -> None:
    """(the engine's thread, its loop failed) Stop the server: it can serve no request any more,
    and a process that ends (exit status 1) is one that a supervisor restarts, where one that
    answers 503 for ever is not. A running API job has been paused at a checkpoint and resumes at
    the next start."""
    logger.error("the engine has stopped (see the error above): the server shuts down")
    server.should_exit = True


def lora_modules(specs: list[str], base_name: str) -> dict[str, str]:
    """``{name: path}`` of ``--lora-modules NAME=PEFT_DIR ...``; raises ValueError naming a bad one."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PEFT_DIR, got {spec!r}")
        if name == base_name:
            raise ValueError(f"--lora-modules: {name!r} is the base model's name; give the adapter another")
        if name in out:
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        out[name] = path
    return out


def serve_spec(args: argparse.Namespace) -> FinetuneSpec | None:
    """The co-serving run ``args`` ask for (None: inference only). Co-serving calibrates the
    latency model at start-up unless ``--no-calibrate``: admission prices every step with it."""
    if args.data is None:
        if args.finetune_name is not None:
            raise ValueError("--finetune-name needs --finetune-data")
        return None
    if args.output is None:
        raise ValueError("--output is required with --finetune-data")
    return replace(finetune_spec(args), slo=slo_config(args), calibrate=not args.no_calibrate,
                   latency_state=args.latency_state, trainer_sm_share=args.trainer_sm_share)


def jobs_config(args: argparse.Namespace) -> JobsConfig | None:
    """``--finetune-jobs DIR``: the settings every job starts from (None: clients create none)."""
    from coserve.server.job_board import JobsConfig

    if args.finetune_jobs is None:
        return None
    flags = argparse.Namespace(**{**vars(args), "data": args.data or "", "output": args.output or ""})
    template = replace(finetune_spec(flags), slo=slo_config(args), calibrate=False, latency_state=args.latency_state,
                       trainer_sm_share=args.trainer_sm_share, resume=False)
    try:
        (args.finetune_jobs / "jobs").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--finetune-jobs {args.finetune_jobs}: cannot create it: {e.strerror or e}") from e
    if not args.max_upload_mb > 0:
        raise ValueError(f"--max-upload-mb must be positive, got {args.max_upload_mb:g}")
    return JobsConfig(args.finetune_jobs, template, max_upload_bytes=int(args.max_upload_mb * 2**20))


def switch_interval_s(args: argparse.Namespace) -> float:
    """``--switch-interval-ms`` in seconds, checked."""
    ms = float(args.switch_interval_ms)
    if not 0 < ms <= 1000:
        raise ValueError(f"--switch-interval-ms must be above 0 and at most 1000, got {ms:g}")
    return ms / 1e3


@command("serve", add_serve_args, "the OpenAI-compatible HTTP server; with --finetune-data it fine-tunes "
         "while it serves, within the latency SLOs")
def serve(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C; then close the trainer and export the adapter (when co-serving)."""
    import uvicorn

    from coserve.engine.config import EngineConfig
    from coserve.engine.llm_engine import LLMEngine
    from coserve.gc_freeze import freeze_startup_objects
    from coserve.server.api import create_app
    from coserve.server.engine_thread import EngineThread
    from coserve.server.finetune import FinetuneSession
    from coserve.server.job_board import prepare_graphs, prepare_latency
    from coserve.server.progress import ProgressReporter, snapshot_reader

    if args.log_stats_interval < 0:  # (before the model loads)
        raise ValueError(f"--log-stats-interval must be >= 0 seconds, got {args.log_stats_interval:g}")
    switch_s = switch_interval_s(args)
    spec = serve_spec(args)
    jobs = jobs_config(args)
    name = args.served_model_name or args.model
    adapters = lora_modules(args.lora_modules, name)
    live = args.finetune_name if spec is not None else None
    if live is not None and live in (name, *adapters):
        raise ValueError(f"--finetune-name {live!r} is already the name of the base model or of an adapter")
    kwargs = engine_kwargs(args)
    for s in (spec, jobs.template if jobs is not None else None):
        if s is not None:
            kwargs["max_lora_rank"] = max(int(kwargs["max_lora_rank"]), s.lora.rank)  # type: ignore[call-overload]
    print(f"coserve: loading {args.model!r}", flush=True)
    trains = spec is not None or jobs is not None
    engine = LLMEngine(EngineConfig(model=args.model, num_training_slots=1 if trains else 0,
                                    **kwargs))  # type: ignore[arg-type]
    for adapter, path in adapters.items():  # read and checked now: a bad one stops the start, not a request
        engine.lora_manager.register(adapter, path)
    if spec is not None and live is not None:
        engine.lora_manager.bind_training_slot(live)
        adapters[live] = f"{spec.output / 'adapter'} (training)"
    session = None
    if spec is not None:
        if spec.calibrate and spec.latency_state is None:
            print("coserve: reading the dataset, starting the trainer and calibrating the latency model on this "
                  "machine (--latency-state OUTPUT/latency_state.json skips the calibration next time)", flush=True)
        session = FinetuneSession(engine, spec)
        print(f"coserve: {session.dataset_line()}", flush=True)
    if jobs is not None:
        if jobs.template.latency_state is None and not jobs.latency_path.is_file() and not args.no_calibrate \
                and session is None:
            print("coserve: calibrating the latency model for fine-tuning jobs on this machine (saved to "
                  f"{jobs.latency_path}: later starts skip it)", flush=True)
        print(f"coserve: {prepare_latency(jobs, engine, session, calibrate=not args.no_calibrate)}", flush=True)
        if session is None:  # (a start-up run's attach declared the training slot's linears already)
            prepare_graphs(jobs, engine)
    sys.setswitchinterval(switch_s)
    engine_thread = EngineThread(engine, session, slo=jobs.template.slo if jobs is not None else None).start()
    app = create_app(engine_thread, name, adapters, runtime_lora=args.allow_runtime_lora, finetune_name=live,
                     jobs=jobs, api_key=args.api_key or None, tool_parser=args.tool_call_parser)
    freeze_startup_objects("server")
    server = _server_class()(uvicorn.Config(app, host=args.host, port=args.port,
                                            log_level=str(args.log_level).lower(), access_log=False))
    engine_thread.on_failure = lambda _: _stop_after_failure(server)
    url = f"http://{args.host}:{args.port}/v1"
    logger.info("serving %r at %s", name, url)
    coserve_note = "" if spec is None else (
        f", fine-tuning on {args.data} (policy {spec.slo.policy}, TTFT <= {spec.slo.ttft_slo_s * 1e3:g} ms, "
        f"TPOT <= {spec.slo.tpot_slo_s * 1e3:g} ms)")
    if jobs is not None:
        coserve_note += f"; fine-tuning jobs through the API in {jobs.root}"
    adapters_note = f" and adapters {', '.join(map(repr, adapters))}" if adapters else ""
    if args.api_key:
        coserve_note += "; clients need the API key"
    print(f"coserve: serving {name!r}{adapters_note} at {url}{coserve_note}", flush=True)
    reporter = ProgressReporter(snapshot_reader(lambda: engine_thread.stats, app.state.api.metrics.counts),
                                args.log_stats_interval, ends=lambda: engine_thread.ends).start()
    try:
        server.run()  # returns after uvicorn's own graceful shutdown on SIGINT/SIGTERM
    finally:
        reporter.stop()  # (before the shutdown's export: reporter.close says it)
        engine_thread.shutdown()
    reporter.close(engine_thread.stats)  # (fine-tuning stopped by the shutdown: said now)
    return 0 if engine_thread.failure is None else 1

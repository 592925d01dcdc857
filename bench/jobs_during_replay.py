"""A fine-tuning job created through the API while ``coserve serve`` answers a replayed workload:
what its create, set-up, training, pause, resume and end cost the clients' requests.

    python bench/jobs_during_replay.py --out RESULT.json [--workload burst-light --duration 40 ...] \\
        [--job-at 5 --pause-at 20 --resume-at 25] -- SERVE_FLAGS...

It starts ``coserve serve --finetune-jobs DIR SERVE_FLAGS`` on a free port and replays the workload
twice over HTTP on the same arrivals (``coserve bench-http``'s driver): first with no job (the
reference), then with a job created at ``--job-at`` s (its dataset uploaded, also as its
validation file), paused at ``--pause-at`` and resumed at ``--resume-at`` (each optional), and
cancelled at the replay's end if it still runs. Each request of the second replay falls in the
job's phase at its arrival (``before``, ``set-up``, ``training``, ``paused``, ``after``), dated
by polling the job every 0.1 s and by the routes' calls; per phase the result gives the same
requests' SLO attainment and TTFT/TPOT in both replays, and the routes' call times.

Offline, what a saved result's serve log says (set-ups, a resume's gap, the pause's engine part),
the replay's clock anchored at the job's creation:

    python bench/jobs_during_replay.py --server-side RESULT.json[.xz] RESULT.serve.log OUT.json

On the dev VM (tiny model, CPU):

    python bench/jobs_during_replay.py --out bench/results/demo_cpu/session25/jobs_during_replay.json \\
        -- --model tiny --device cpu --lr 1e-3 --ttft-slo-ms 250 --tpot-slo-ms 25
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from coserve.bench.ftdata import parse_lengths, write_ft_dataset
from coserve.bench.http_driver import HttpDriver, HttpReplay
from coserve.bench.metrics import RequestRecord, attainment, latency_summary
from coserve.bench.provenance import provenance
from coserve.bench.workload import Scaling, load_workload

TINY_FACTS = Path(__file__).resolve().parents[1] / "src" / "coserve" / "data" / "tiny_facts.jsonl"
TERMINAL = ("succeeded", "failed", "cancelled")
PHASE_OF_STATUS = {"queued": "set-up", "validating_files": "set-up", "running": "training", "paused": "paused"}


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    serve_flags: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, serve_flags = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--workload", default="burst-light")
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--rate-scale", type=float, default=0.05)
    p.add_argument("--length-scale", type=float, default=1.0)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--max-output", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=1000, help="the prompts' and the synthetic dataset's ids")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-slo-ms", type=float, default=250.0, help="the attainment's (pass the server's too)")
    p.add_argument("--tpot-slo-ms", type=float, default=25.0)
    p.add_argument("--drain", type=float, default=30.0)
    p.add_argument("--data", type=Path, default=TINY_FACTS, help="the job's dataset (default: the tiny facts)")
    p.add_argument("--synthetic", default=None, metavar="N:LENGTHS",
                   help="instead of --data, N synthetic pre-tokenized samples (LENGTHS: fixed:N or spread:LO-HI, as coserve bench's "
                        "--ft-lengths: 256, spread:128-1024, ...)")
    p.add_argument("--n-epochs", type=int, default=30)
    p.add_argument("--job-at", type=float, default=5.0)
    p.add_argument("--pause-at", type=float, default=None)
    p.add_argument("--resume-at", type=float, default=None)
    p.add_argument("--no-validation", action="store_true", help="create the job without a validation file")
    p.add_argument("--validation-rows", type=int, default=0,
                   help="the validation file: the dataset's first N rows, uploaded apart (0: the dataset itself)")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds for the server to come up")
    return p.parse_args(argv), serve_flags


SPARE_SETTLE_S = 120.0
"""The most :meth:`Server.settle` waits for the server's spare interpreter's imports."""


class Server:
    """``coserve serve`` in a child process on a free port, its output in ``log``."""

    def __init__(self, flags: list[str], jobs_dir: Path, log: Path, timeout: float) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-c", "import sys; from coserve.server.cli import main; sys.exit(main(sys.argv[1:]))",
               "--log-level", "INFO", "serve", "--port", str(self.port), "--finetune-jobs", str(jobs_dir),
               # (the two replays send the same prompts: the second would find the first's prefixes)
               "--no-enable-prefix-caching", *flags]
        self.command = cmd[3:]
        self.log_path = log
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"coserve serve exited with {self.proc.returncode}: see {log}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"coserve serve did not answer /health within {timeout:g} s: see {log}")
            time.sleep(0.5)

    def settle(self, timeout: float = SPARE_SETTLE_S) -> float | None:
        """Wait until the server's spare trainer interpreter (``coserve.trainer.spare``, where its
        log says it started one) has done its imports, so that they do not run beside the reference
        replay (~8 s of a core on session 45's H100 host): the seconds waited, None where it started
        none."""
        began = time.monotonic()
        while True:
            text = self.log_path.read_text(errors="replace")
            if "started a spare trainer interpreter" not in text:
                return None
            if any(line in text for line in ("spare trainer interpreter ready", "did not finish its imports")) \
                    or time.monotonic() - began > timeout:
                return time.monotonic() - began
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class JobScript:
    """Creates, pauses and resumes the job at replay times, and polls its status (a thread)."""

    def __init__(self, url: str, driver: HttpDriver, data: Path, args: argparse.Namespace, model: str) -> None:
        self.client = httpx.Client(base_url=url, timeout=120)
        self.driver, self.data, self.args, self.model = driver, data, args, model
        self.job_id: str | None = None
        self.calls: dict[str, list[float]] = {}  # name -> [start, end] on the replay clock (the calls that answered 200)
        self.calls_wall: dict[str, float] = {}  # name -> its start, wall clock (time.time: the serve log's clock)
        self.failed_calls: dict[str, dict[str, Any]] = {}  # name -> its times, HTTP status and message
        self.timeline: list[tuple[float, str, int]] = []  # (time, status, optimizer steps)
        self.stop = threading.Event()
        self.failure: str | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> float:
        t0 = self.driver.t0
        return math.nan if t0 is None else time.monotonic() - t0

    def _call(self, name: str, method: str, path: str, **kw: Any) -> dict[str, Any]:
        start = self.now()
        self.calls_wall[name] = time.time()
        reply = self.client.request(method, path, **kw)
        if reply.status_code != 200:
            self.failed_calls[name] = {"at": [start, self.now()], "status": reply.status_code, "text": reply.text[:300]}
            raise RuntimeError(f"{name}: HTTP {reply.status_code}: {reply.text[:300]}")
        self.calls[name] = [start, self.now()]
        return dict(reply.json())

    def _wait_until(self, t: float) -> bool:
        while not self.stop.is_set():
            now = self.now()
            if now >= t:
                return True
            self._poll()
            self.stop.wait(min(0.1, t - now) if not math.isnan(now) else 0.05)
        return False

    def _poll(self) -> None:
        if self.job_id is None:
            return
        job = self.client.get(f"/v1/fine_tuning/jobs/{self.job_id}").json()
        status, steps = job["status"], int(job["coserve"]["optimizer_steps"] or 0)
        if not self.timeline or self.timeline[-1][1] != status:
            self.timeline.append((self.now(), status, steps))

    def _run(self) -> None:
        a = self.args
        try:
            if not self._wait_until(a.job_at):
                return
            with self.data.open("rb") as f:
                upload = self._call("upload", "POST", "/v1/files", files={"file": (self.data.name, f)},
                                    data={"purpose": "fine-tune"})
            body = {"model": self.model, "training_file": upload["id"], "hyperparameters": {"n_epochs": a.n_epochs}}
            if not a.no_validation:
                body["validation_file"] = upload["id"]
                if a.validation_rows:
                    rows = "".join(self.data.read_text().splitlines(keepends=True)[:a.validation_rows])
                    body["validation_file"] = self._call("upload_validation", "POST", "/v1/files", files={
                        "file": ("validation.jsonl", rows.encode())}, data={"purpose": "fine-tune"})["id"]
            self.job_id = self._call("create", "POST", "/v1/fine_tuning/jobs", json=body)["id"]
            self.timeline.append((self.calls["create"][0], "validating_files", 0))
            for name, at in (("pause", a.pause_at), ("resume", a.resume_at)):
                if at is None or not self._wait_until(at):
                    continue
                if self.timeline[-1][1] in TERMINAL:
                    break
                try:
                    self._call(name, "POST", f"/v1/fine_tuning/jobs/{self.job_id}/{name}")
                except RuntimeError as e:  # (the job goes on as it was: polled on, so its phases stay true)
                    self.failure = self.failure or f"{type(e).__name__}: {e}"
                self._poll()
            while not self.stop.is_set():
                self._poll()
                self.stop.wait(0.1)
        except Exception as e:  # (the replay goes on; the result says why the script stopped)
            self.failure = self.failure or f"{type(e).__name__}: {e}"

    def finish(self) -> dict[str, Any] | None:
        """Stop the thread; cancel the job if it still runs (timed); the job's last object."""
        self.stop.set()
        self.thread.join(30)
        if self.job_id is None:
            return None
        self._poll()
        if self.timeline[-1][1] not in TERMINAL:
            self._call("cancel", "POST", f"/v1/fine_tuning/jobs/{self.job_id}/cancel")
            self._poll()
        deadline = time.monotonic() + 120  # (its validation scores the exported adapter after its end)
        while True:
            job = dict(self.client.get(f"/v1/fine_tuning/jobs/{self.job_id}").json())
            v = (job.get("coserve") or {}).get("validation")
            if v is None or v.get("status") != "running" or time.monotonic() > deadline:
                return job
            time.sleep(0.2)


def phases(timeline: list[tuple[float, str, int]], calls: dict[str, list[float]]) -> list[tuple[float, str]]:
    """(start, phase) change points: ``before`` until the create call, then the polled statuses'
    phases; a pause's phase starts at its call (``calls`` holds the calls that succeeded) where
    the job was running by then, else where it was first polled running during the call (a pause
    asked during the set-up waits for it), else at the call's end; the end's phase at the cancel
    call or the first terminal status."""
    points = [(0.0, "before")]
    marks = [(t, "after" if status in TERMINAL else PHASE_OF_STATUS.get(status, status)) for t, status, _ in timeline]
    if "pause" in calls:
        start, end = calls["pause"]
        running = [t for t, status, _ in timeline if status == "running" and t <= end]
        marks.append((max(start, running[0]) if running else end, "paused"))
    if "cancel" in calls:
        marks.append((calls["cancel"][0], "after"))
    for t, phase in sorted(marks):
        if phase != points[-1][1] and not (points[-1][1] == "after"):
            points.append((t, phase))
    return points


LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
SET_UP = re.compile(r"set up in ([\d.]+) s: .* trainer started in ([\d.]+) s(?: with its warm-up)?(?: \((.*)\))?$")
STAGE = re.compile(r"([a-z-]+) ([\d.]+) s")
SPARE_READY = re.compile(r"spare trainer interpreter ready: its imports took ([\d.]+) s")


def server_side(log_text: str, calls_wall: dict[str, float]) -> dict[str, Any]:
    """What the server's log says of the job (its INFO lines, stamped by its clock, this host's):
    ``set_ups``, each job set-up's seconds, its trainer's start and the start's stages where named
    (``FinetuneSession``'s line), whether that start took a spare interpreter (``from_spare``)
    and, for a resume, the seconds until it had gone on from its checkpoint ("resumed from"); ``pause_to_paused_ms``, from the pause call's start to the
    engine's "fine-tuning paused" line: the most the pause can have held the engine's thread (the
    call's own time includes the wait for the files); ``spare_imports_s``, what each spare trainer
    interpreter's imports took (its "ready" line)."""
    events: list[tuple[float, str]] = []
    for line in log_text.splitlines():
        m = LOG_TIME.match(line)
        if m is not None:
            at = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            events.append((at, line[m.end():]))
    set_ups: list[dict[str, Any]] = []
    spare_imports = [float(m.group(1)) for _, text in events if (m := SPARE_READY.search(text)) is not None]
    for i, (at, text) in enumerate(events):
        m = SET_UP.search(text)
        if m is None:
            continue
        entry: dict[str, Any] = {"at_wall": at, "set_up_s": float(m.group(1)), "trainer_s": float(m.group(2)),
                                 "stages_s": {k: float(v) for k, v in STAGE.findall(m.group(3) or "")},
                                 "from_spare": (m.group(3) or "").startswith("from a spare interpreter")}
        resumed = next((t for t, later in events[i + 1:] if "resumed from" in later), None)
        nxt = next((t for t, later in events[i + 1:] if SET_UP.search(later)), math.inf)
        if resumed is not None and resumed < nxt:
            entry["then_resumed_s"] = resumed - at
        set_ups.append(entry)
    out: dict[str, Any] = {"set_ups": set_ups, "pause_to_paused_ms": None, "spare_imports_s": spare_imports}
    if "pause" in calls_wall:
        paused = next((t for t, text in events if "fine-tuning paused" in text and t >= calls_wall["pause"] - 1.0),
                      None)
        if paused is not None:
            out["pause_to_paused_ms"] = max(0.0, paused - calls_wall["pause"]) * 1e3
    return out


def calls_wall_of(result: dict[str, Any], log_text: str) -> dict[str, float]:
    """A saved result's route calls on the serve log's clock: the replay's clock anchored where
    the log says the job was created (the create call's end), for results from before
    ``calls_wall`` was kept."""
    created = next((line for line in log_text.splitlines() if "fine-tuning job " in line and " created: " in line
                    and LOG_TIME.match(line)), None)
    if created is None or "create" not in result["calls"]:
        return {}
    stamp = LOG_TIME.match(created)
    assert stamp is not None
    offset = datetime.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() \
        - result["calls"]["create"][1]
    return {name: start + offset for name, (start, _) in result["calls"].items()}


def server_side_of(result_path: Path, log_path: Path) -> dict[str, Any]:
    """:func:`server_side` of a saved result (``.json`` or ``.json.xz``) and its serve log."""
    import lzma

    raw = lzma.open(result_path).read() if result_path.suffix == ".xz" else result_path.read_bytes()
    result = json.loads(raw)
    text = log_path.read_text(errors="replace")
    return {**provenance(), "config": {"result": str(result_path), "serve_log": str(log_path)},
            "figures": server_side(text, calls_wall_of(result, text))}


def summarize(ref: list[RequestRecord], job: list[RequestRecord], slo: tuple[float, float]) -> dict[str, Any]:
    def side(records: list[RequestRecord]) -> dict[str, float]:
        s = latency_summary(records)
        return {"attainment": attainment(records, *slo), **{k: s[k] for k in (
            "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")}}

    return {"requests": len(job), "reference": side(ref), "with_job": side(job)}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--server-side"]:  # offline: --server-side RESULT SERVE_LOG OUT
        result, log, out = (Path(a) for a in argv[1:4])
        out.write_text(json.dumps(server_side_of(result, log), indent=1) + "\n")
        print(out.read_text())
        return 0
    args, serve_flags = parse_args(argv)
    def flag(name: str) -> str | None:
        return serve_flags[serve_flags.index(name) + 1] if name in serve_flags else None

    model = flag("--served-model-name") or flag("--model") or "tiny"
    work = Path(tempfile.mkdtemp(prefix="coserve-jobs-replay-"))
    data = args.data
    if args.synthetic:
        n, lengths = args.synthetic.split(":", 1)
        data = write_ft_dataset(work / "synthetic.jsonl", int(n), parse_lengths(lengths), args.vocab_size, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = args.out.with_suffix(".serve.log")
    server = Server(serve_flags, work / "jobs", log, args.start_timeout)
    try:
        driver = HttpDriver(server.url, model, seed=args.seed, vocab_size=args.vocab_size)
        scaling = Scaling(rate=args.rate_scale, length=args.length_scale, max_prompt=args.max_prompt,
                          max_output=args.max_output)
        context = driver.context()
        if context is not None:
            scaling = scaling.fit(context, print)
        workload = load_workload(args.workload, args.duration, scaling, seed=args.seed)
        settled = server.settle()
        if settled is not None:
            print(f"the server's spare trainer interpreter imported for {settled:.1f} s more before the replays",
                  flush=True)
        print(f"{len(workload.arrivals)} requests of {workload.name} over {args.duration:g} s, twice: "
              f"no job, then a job at {args.job_at:g} s", flush=True)
        reference: HttpReplay = driver.run(workload.arrivals, duration_s=args.duration, drain_s=args.drain)
        script = JobScript(server.url, driver, data, args, model)
        driver.t0 = None
        script.thread.start()
        with_job: HttpReplay = driver.run(workload.arrivals, duration_s=args.duration, drain_s=args.drain)
        job = script.finish()
    finally:
        server.stop()
    slo = (args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3)
    ref, rec = reference.result.records, with_job.result.records
    points = phases(script.timeline, script.calls)
    starts = [t for t, _ in points]
    by_phase: dict[str, list[int]] = {}
    for i, r in enumerate(rec):
        by_phase.setdefault(points[bisect.bisect_right(starts, r.arrival_s) - 1][1], []).append(i)
    figures: dict[str, Any] = {
        "overall": summarize(ref, rec, slo),
        "phases": {name: summarize([ref[i] for i in idx], [rec[i] for i in idx], slo) for name, idx in by_phase.items()},
        "calls_ms": {name: (end - start) * 1e3 for name, (start, end) in script.calls.items()},
        "errors": {"reference": len(reference.errors), "with_job": len(with_job.errors),
                   "first": dict(list(sorted(with_job.errors.items()))[:5])},
        "script_failure": script.failure,
        "server_side": server_side(log.read_text(errors="replace") if log.is_file() else "", script.calls_wall),
        "spare_settle_s": settled,
        "failed_calls": script.failed_calls,
        "job": None if job is None else {k: job.get(k) for k in (
            "id", "status", "trained_tokens", "fine_tuned_model", "error", "coserve")},
    }
    result = {
        **provenance(),
        "config": {"serve": server.command, "workload": {"name": workload.name, "duration_s": args.duration,
                                                         "requests": len(workload.arrivals), "seed": args.seed,
                                                         "scaling": asdict(scaling)},
                   "slo": {"ttft_ms": args.ttft_slo_ms, "tpot_ms": args.tpot_slo_ms},
                   "job": {"data": str(args.synthetic or args.data), "n_epochs": args.n_epochs, "at_s": args.job_at,
                           "pause_at_s": args.pause_at, "resume_at_s": args.resume_at,
                           "validation": not args.no_validation, "validation_rows": args.validation_rows}},
        "figures": figures,
        "phases": points,
        "timeline": script.timeline,
        "calls": script.calls,
        "per_request": {"reference": [[r.arrival_s, r.first_token_s, r.finish_s, r.prompt_tokens, r.output_tokens]
                                      for r in ref],
                        "with_job": [[r.arrival_s, r.first_token_s, r.finish_s, r.prompt_tokens, r.output_tokens]
                                     for r in rec]},
        "serve_log": log.name,
    }
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")

    def pct(x: float) -> str:
        return "-" if math.isnan(x) else f"{x:.1%}"

    print(f"{'phase':<10} {'requests':>8} {'attained (ref -> job)':>22} {'TTFT p99 ms':>16} {'TPOT p99 ms':>16}")
    for name, f in [("overall", figures["overall"]), *figures["phases"].items()]:
        r, j = f["reference"], f["with_job"]
        print(f"{name:<10} {f['requests']:>8} {pct(r['attainment']):>10} -> {pct(j['attainment']):>8} "
              f"{r['ttft_p99_ms']:>7.0f} -> {j['ttft_p99_ms']:<6.0f} {r['tpot_p99_ms']:>7.1f} -> {j['tpot_p99_ms']:<6.1f}")
    print("calls (ms):", {k: round(v) for k, v in figures["calls_ms"].items()})
    side = figures["server_side"]
    if side["pause_to_paused_ms"] is not None:
        print(f"pause call to the engine's 'fine-tuning paused': {side['pause_to_paused_ms']:.0f} ms")
    for entry in side["set_ups"]:
        print(f"set-up {entry['set_up_s']:.1f} s, trainer {entry['trainer_s']:.1f} s"
              f"{' from a spare' if entry.get('from_spare') else ''} {entry['stages_s']}"
              + (f", resumed {entry['then_resumed_s']:.1f} s later" if "then_resumed_s" in entry else ""))
    if job is not None:
        print(f"job {job['id']}: {job['status']}, {job['trained_tokens']} tokens, "
              f"{job['coserve']['optimizer_steps']} steps, validation {job['coserve'].get('validation')}")
    if script.failure:
        print(f"the job script stopped: {script.failure}")
    print(f"result: {args.out}")
    return 0 if script.failure is None else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))

"""``coserve serve``'s co-serving flags: the SLOs, the policy and the start-up calibration."""

from __future__ import annotations

import argparse
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coserve.server.cli import slo_config
from coserve.server.demo import add_demo_args
from coserve.server.serve_cli import add_serve_args, serve_spec
from tests.server.test_api import http


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(list(argv))


def test_inference_only_without_finetune_data() -> None:
    assert serve_spec(parse("--model", "tiny")) is None


def test_coserving_takes_the_slo_flags_and_calibrates(tmp_path: Path) -> None:
    args = parse("--finetune-data", "d.jsonl", "--output", str(tmp_path), "--ttft-slo-ms", "500",
                 "--tpot-slo-ms", "40", "--slo-margin", "0.2", "--ft-policy", "temporal", "--no-interrupt",
                 "--pause-prefill", "model", "--backward-tokens", "64", "--trainer-sm-share", "60")
    spec = serve_spec(args)
    assert spec is not None and spec.calibrate and spec.trainer_sm_share == 60
    assert spec.data == Path("d.jsonl") and spec.coserve.backward_tokens == 64
    slo = spec.slo
    assert (slo.ttft_slo_s, slo.tpot_slo_s, slo.margin) == pytest.approx((0.5, 0.04, 0.2))
    assert (slo.policy, slo.interrupt_ft_only, slo.pause_prefill) == ("temporal", False, "model")
    defaults = serve_spec(parse("--finetune-data", "d.jsonl", "--output", str(tmp_path), "--no-calibrate"))
    assert defaults is not None and not defaults.calibrate and defaults.trainer_sm_share is None
    assert defaults.latency_state is None
    loaded = serve_spec(parse("--finetune-data", "d.jsonl", "--output", str(tmp_path), "--latency-state", "s.json"))
    assert loaded is not None and loaded.latency_state == Path("s.json")
    assert (defaults.slo.ttft_slo_s, defaults.slo.tpot_slo_s, defaults.slo.policy) == (1.0, 0.1, "full")


def test_the_builtin_dataset_is_named_where_no_file_has_its_name(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from coserve.data import builtin_dataset

    monkeypatch.chdir(tmp_path)
    spec = serve_spec(parse("--finetune-data", "tiny_facts", "--output", str(tmp_path / "out")))
    assert spec is not None and spec.data == builtin_dataset() and spec.data.is_file()
    assert spec.data.read_text().count("\n") >= 10
    # a file of that name is the user's, not the built-in one
    (tmp_path / "tiny_facts").write_text("[]")
    spec = serve_spec(parse("--finetune-data", "tiny_facts", "--output", str(tmp_path / "out")))
    assert spec is not None and spec.data == Path("tiny_facts")
    # any other missing name stays the path it was (the loader's error names it)
    spec = serve_spec(parse("--finetune-data", "tiny_fact", "--output", str(tmp_path / "out")))
    assert spec is not None and spec.data == Path("tiny_fact")


def test_bad_coserving_flags_are_errors_that_say_why(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--output is required"):
        serve_spec(parse("--finetune-data", "d.jsonl"))
    with pytest.raises(ValueError, match="tpot"):
        serve_spec(parse("--finetune-data", "d.jsonl", "--output", str(tmp_path), "--tpot-slo-ms", "-5"))
    with pytest.raises(ValueError, match="--trainer-sm-share"):
        serve_spec(parse("--finetune-data", "d.jsonl", "--output", str(tmp_path), "--trainer-sm-share", "0"))


def test_the_demo_keeps_its_own_slos() -> None:
    p = argparse.ArgumentParser()
    add_demo_args(p)
    slo = slo_config(p.parse_args([]))
    assert (slo.ttft_slo_s, slo.tpot_slo_s, slo.policy, slo.pause_prefill) == pytest.approx((0.25, 0.025, "full", "always"))


def test_ft_only_steps_check_inside_layers_only_when_asked() -> None:
    p = argparse.ArgumentParser()
    add_demo_args(p)
    assert not slo_config(p.parse_args([])).ft_only_mid_layer_check
    assert slo_config(p.parse_args(["--ft-only-mid-layer-check"])).ft_only_mid_layer_check


def test_a_calibration_is_saved_and_a_saved_state_replaces_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from coserve import EngineConfig, LLMEngine
    from coserve.core.config import CoServeConfig, LoRAConfig
    from coserve.data import builtin_dataset
    from coserve.server.finetune import FinetuneSession, FinetuneSpec, engine_fingerprint

    def session(out: Path, **kw: object) -> FinetuneSession:
        engine = LLMEngine(EngineConfig(model="tiny", device="cpu", num_training_slots=1, max_lora_rank=8,
                                        max_num_batched_tokens=128))
        spec = FinetuneSpec(data=builtin_dataset(), output=out, lora=LoRAConfig(rank=8, alpha=16),
                            coserve=CoServeConfig(backward_tokens=32, max_seq_len=64), trainer_threads=1,
                            save_every=0, **kw)  # type: ignore[arg-type]
        return FinetuneSession(engine, spec)

    first = session(tmp_path / "a", calibrate=True)
    saved = tmp_path / "a" / "latency_state.json"
    calibrated = json.loads(saved.read_text())
    assert calibrated["coefficients"] and not calibrated["online"]["windows"]
    # the run serves and its model refits online: at close the file holds the model as the run
    # left it, windows and levels included, and a run that loads it goes on from there
    latency = first.coserver.latency
    for i in range(30):
        rows = 1 + i % 8
        latency.observe_regressors("decode/eager", (float(rows), 100.0 * rows, 1.0), 0.01 + 1e-3 * rows)
    state = json.loads(json.dumps(latency.state_dict()))
    assert state["online"]["windows"]["decode/eager|idle"] and state["coefficients"] != calibrated["coefficients"]
    first.close()
    written = json.loads(saved.read_text())
    assert written.pop("engine") == engine_fingerprint(first.engine) and written == state

    def no_calibration(self: object, *args: object, **kwargs: object) -> int:
        raise AssertionError("calibrated although a state was given")

    monkeypatch.setattr(LLMEngine, "calibrate", no_calibration)
    second = session(tmp_path / "b", calibrate=True, latency_state=saved)
    assert json.loads(json.dumps(second.coserver.latency.state_dict())) == state
    second.close()
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="--latency-state"):
        session(tmp_path / "c", latency_state=tmp_path / "bad.json")
    # a state measured on another setup is refused, naming what differs; one saved before the
    # fingerprint (no "engine") loads as it is
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**state, "engine": {**engine_fingerprint(second.engine), "dtype": "bfloat16"}}))
    with pytest.raises(ValueError, match=r"--latency-state: latency state .*other.json: measured on another "
                                         r"setup: dtype 'bfloat16' \(here 'float32'\)"):
        session(tmp_path / "d", latency_state=other)
    older = tmp_path / "older.json"
    older.write_text(json.dumps(state))
    third = session(tmp_path / "e", latency_state=older)
    assert json.loads(json.dumps(third.coserver.latency.state_dict())) == state
    third.close()


def test_slo_counter_sorts_finished_requests_by_the_coserving_slos() -> None:
    from types import SimpleNamespace
    from typing import cast

    from prometheus_client import generate_latest

    from coserve.core.config import SLOConfig
    from coserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from coserve.server.api import ServerMetrics
    from coserve.server.engine_thread import EngineStats, EngineThread
    from coserve.server.progress import RequestCounts

    def finished(ttft: float, total: float, tokens: int) -> RequestOutput:
        return RequestOutput("r", None, [1, 2], [CompletionOutput(0, "", list(range(tokens)), finish_reason="length")],
                             True, RequestMetrics(10.0, 10.0 + ttft, 10.0 + total))

    thread = cast(EngineThread, SimpleNamespace(stats=EngineStats(coserving=True),
                                                slo=SLOConfig(ttft_slo_s=0.5, tpot_slo_s=0.05)))
    metrics = ServerMetrics(thread)
    metrics.observe(finished(0.2, 0.2 + 9 * 0.04, 10))  # met
    metrics.observe(finished(0.7, 0.7 + 9 * 0.01, 10))  # TTFT over
    metrics.observe(finished(0.1, 0.1 + 9 * 0.06, 10))  # TPOT over
    metrics.observe(finished(0.3, 0.3, 1))  # one token: no TPOT, met
    unfinished = finished(0.1, 0.1, 3)
    unfinished.metrics.finish_time = None  # aborted before its end: not counted
    metrics.observe(unfinished)
    text = generate_latest(metrics.registry).decode()
    assert 'coserve_slo_requests_total{result="met"} 2.0' in text
    assert 'coserve_slo_requests_total{result="missed"} 2.0' in text
    # the progress lines' counters: the four that ended, every generated token
    assert metrics.counts() == RequestCounts(served=4, generated_tokens=34, slo_met=2, slo_missed=2)


def test_lora_modules_flag() -> None:
    from coserve.server.serve_cli import lora_modules

    args = parse("--model", "tiny", "--lora-modules", "a=/x/a", "b = /x/b")
    assert lora_modules(args.lora_modules, "tiny") == {"a": "/x/a", "b": "/x/b"}
    assert lora_modules(parse("--model", "tiny").lora_modules, "tiny") == {}
    for bad, message in ((["a"], "NAME=PEFT_DIR"), (["=p"], "NAME=PEFT_DIR"), (["a="], "NAME=PEFT_DIR"),
                         (["tiny=/p"], "base model's name"), (["a=/p", "a=/q"], "given twice")):
        with pytest.raises(ValueError, match=message):
            lora_modules(bad, "tiny")


def test_serve_refuses_to_start_with_a_bad_adapter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An adapter is read and checked at start-up: a missing one stops the start with its path."""
    from coserve.server.cli import main

    assert main(["serve", "--model", "tiny", "--device", "cpu", "--port", "0",
                 "--lora-modules", f"gone={tmp_path / 'nothing'}"]) == 2
    assert str(tmp_path / "nothing") in capsys.readouterr().err


def test_a_lora_rank_the_model_cannot_use_stops_the_start_before_the_engine(tmp_path: Path) -> None:
    """The engine allocates every adapter slot at the largest rank asked for: --lora-rank 100000
    got ``coserve finetune`` OOM-killed. Above min(in_features, out_features) of every targeted
    linear (128 for the tiny model's attention) it is refused with the flag's limit."""
    out = str(tmp_path / "out")
    assert serve_spec(parse("--finetune-data", "d.jsonl", "--output", out, "--lora-rank", "128")) is not None
    with pytest.raises(ValueError, match="--lora-rank 129 is above 128"):
        serve_spec(parse("--finetune-data", "d.jsonl", "--output", out, "--lora-rank", "129"))
    with pytest.raises(ValueError, match="--lora-rank 100000 is above 64"):
        serve_spec(parse("--finetune-data", "d.jsonl", "--output", out, "--lora-rank", "100000",
                         "--target-modules", "k_proj"))


def test_a_max_lora_rank_the_model_cannot_use_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    from coserve.server.cli import main

    assert main(["generate", "--model", "tiny", "--device", "cpu", "--prompt", "hi", "--max-tokens", "1",
                 "--max-lora-rank", "129"]) == 2
    err = capsys.readouterr().err
    assert "coserve generate: error: max_lora_rank 129 (--max-lora-rank" in err and "at most 128" in err


def test_a_path_error_is_a_one_line_error_of_the_command(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Only ValueError and FileNotFoundError were caught: a PermissionError or IsADirectoryError
    from a path the user gave was a traceback."""
    from coserve.server import cli

    def denied(args: argparse.Namespace) -> int:
        raise PermissionError(13, "Permission denied", "/root/out")

    monkeypatch.setitem(cli.COMMANDS, "generate", (cli.COMMANDS["generate"][0], denied))
    assert cli.main(["generate", "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == "coserve generate: error: [Errno 13] Permission denied: '/root/out'\n"


def test_finetune_name_needs_finetune_data() -> None:
    with pytest.raises(ValueError, match="--finetune-name needs --finetune-data"):
        serve_spec(parse("--model", "tiny", "--finetune-name", "live"))


def test_the_demo_serves_both_runs_trains_an_adapter_and_shows_it(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The README's main command, shortened: both replays print live lines and a summary, the
    adapter is written, the idle phase runs (its loss target cannot be met in 2 s from random
    weights) and stops at its time limit. Its data: the built-in facts as a pretty-printed JSON
    array that starts with a UTF-8 BOM (the loader reads it; the questions shown at the end were
    re-read line by line, and the demo failed there, after the whole run)."""
    import json

    from coserve.data import builtin_dataset
    from coserve.server.demo import run_demo

    rows = [json.loads(line) for line in builtin_dataset().read_text().splitlines() if line.strip()]
    data = tmp_path / "pretty.json"
    data.write_text("\ufeff" + json.dumps(rows, indent=2), encoding="utf-8")
    p = argparse.ArgumentParser()
    add_demo_args(p)
    args = p.parse_args(["--duration", "3", "--output", str(tmp_path / "out"), "--idle-train-s", "2",
                         "--target-loss", "0.0001", "--data", str(data)])
    assert run_demo(args) == 0
    out = capsys.readouterr().out
    assert "[inference] t=" in out and "[ co-serve] t=" in out and "loss=" in out
    summary = {line.split()[0]: line.split() for line in out.splitlines()
               if line.startswith(("inference ", "co-serve ", "then idle "))}
    assert set(summary) == {"inference", "co-serve", "then"}
    assert int(summary["co-serve"][1]) == int(summary["inference"][1]) > 0  # the same arrivals
    assert float(summary["co-serve"][5]) > 0  # fine-tuning tokens/s while serving
    idle = summary["then"]
    assert float(idle[6]) > 0 and float(idle[-2].strip("(")) == pytest.approx(2.0, abs=1.0)
    assert (tmp_path / "out" / "adapter" / "adapter_config.json").exists()
    assert (tmp_path / "out" / "train_log.jsonl").exists()
    assert "question -> base model | with the fine-tuned adapter" in out
    assert f"  {rows[0]['instruction']} -> " in out and f"({rows[2]['output']!r})" in out


def test_the_demo_questions_are_read_as_the_loader_reads_the_dataset(tmp_path: Path) -> None:
    import json

    from coserve.server.demo import _questions

    rows = [{"instruction": f"q{i}?", "output": f"a{i}."} for i in range(4)]
    bom = tmp_path / "bom.jsonl"
    bom.write_text("\ufeff" + "\n\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    pretty = tmp_path / "pretty.json"
    pretty.write_text(json.dumps(rows, indent=2))
    expected = [("q0?", "a0."), ("q1?", "a1."), ("q2?", "a2.")]
    assert _questions(bom) == _questions(pretty) == expected
    chat = tmp_path / "chat.jsonl"  # (shown only where the first three rows are all Alpaca rows)
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
                                                                                 "content": "hello"}]}) + "\n"
                    + json.dumps(rows[0]) + "\n")
    assert _questions(chat) == []


@pytest.mark.parametrize(("argv", "message"), [
    (["--duration", "0"], "--duration must be a positive finite number"),
    (["--duration", "-5"], "--duration must be a positive finite number"),
    (["--duration", "inf"], "--duration must be a positive finite number"),
    (["--idle-train-s", "-1"], "--idle-train-s must be a finite number"),
    (["--target-loss", "nan"], "--target-loss must be a finite number"),
    (["--ttft-slo-ms", "0"], "--ttft-slo-ms must be a positive finite number"),
    (["--data", "{tmp}/missing.jsonl"], "missing.jsonl: cannot read dataset: no such file"),
    (["--data", "{tmp}/object.json"], "expected a JSON array"),
    (["--output", "{tmp}/afile"], "--output {tmp}/afile: cannot create it"),
])
def test_the_demo_checks_its_flags_data_and_output_before_it_serves(
        argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--duration 0 or below served "0 requests" and printed a nan% table; a bad --data or
    --output failed only after the 20 s inference-only run."""
    from coserve.bench.replay import InProcessDriver
    from coserve.server import demo

    def served(*args: object, **kwargs: object) -> None:
        raise AssertionError("the demo started serving before its flags were checked")

    monkeypatch.setattr(InProcessDriver, "run", served)
    if not argv[0].startswith(("--data", "--output")):  # (those are read once the engine is built)
        monkeypatch.setattr(demo, "synthetic", served)  # (--duration inf generated arrivals for ever)
    (tmp_path / "object.json").write_text('{"instruction": "q", "output": "a"}')
    (tmp_path / "afile").write_text("")
    p = argparse.ArgumentParser()
    add_demo_args(p)
    args = p.parse_args([a.replace("{tmp}", str(tmp_path)) for a in argv])
    with pytest.raises(ValueError, match=re.escape(message.replace("{tmp}", str(tmp_path)))):
        demo.run_demo(args)


def test_a_negative_stats_interval_stops_the_start(capsys: pytest.CaptureFixture[str]) -> None:
    from coserve.server.cli import main

    assert parse("--model", "tiny").log_stats_interval == 10.0
    assert main(["serve", "--model", "tiny", "--device", "cpu", "--port", "0", "--log-stats-interval", "-1"]) == 2
    assert "--log-stats-interval must be >= 0" in capsys.readouterr().err


def test_the_top_level_help_names_every_command_with_what_it_does(capsys: pytest.CaptureFixture[str]) -> None:
    from coserve.server.cli import COMMANDS, HELP, main

    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert set(COMMANDS) == {"generate", "finetune", "demo", "bench-http", "serve", "bench"}
    for name in COMMANDS:
        assert HELP[name] and f"{name} {' '.join(HELP[name].split()[:3])}" in text, name


def test_finetune_jobs_take_the_finetuning_flags_and_never_calibrate(tmp_path: Path) -> None:
    from coserve.server.serve_cli import jobs_config

    assert jobs_config(parse("--model", "tiny")) is None
    jobs = jobs_config(parse("--finetune-jobs", str(tmp_path / "j"), "--lora-rank", "4", "--epochs", "2",
                             "--lr", "1e-3", "--latency-state", "s.json", "--tpot-slo-ms", "40"))
    assert jobs is not None and (tmp_path / "j" / "jobs").is_dir()
    t = jobs.template
    assert (t.lora.rank, t.coserve.epochs, t.optim.lr, t.calibrate, t.latency_state) == (4, 2, 1e-3, False, Path("s.json"))
    assert t.slo.tpot_slo_s == pytest.approx(0.04) and jobs.latency_path == tmp_path / "j" / "latency_state.json"
    assert jobs.max_upload_bytes == 1 << 30
    small = jobs_config(parse("--finetune-jobs", str(tmp_path / "j"), "--max-upload-mb", "0.5"))
    assert small is not None and small.max_upload_bytes == 1 << 19
    with pytest.raises(ValueError, match="--max-upload-mb must be positive"):
        jobs_config(parse("--finetune-jobs", str(tmp_path / "j"), "--max-upload-mb", "0"))
    # beside --finetune-data's run, which calibrates as before
    args = parse("--finetune-jobs", str(tmp_path / "j"), "--finetune-data", "d.jsonl", "--output", str(tmp_path / "o"))
    spec = serve_spec(args)
    assert spec is not None and spec.calibrate and jobs_config(args) is not None


def start_server(program: str = "import sys; from coserve.server.cli import main; sys.exit(main())"
                 ) -> tuple[subprocess.Popen[str], list[str], int]:
    """``coserve serve --model tiny`` run by ``program`` on a free port, read until it says it
    serves: (the process, its lines so far, the port)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, "-c", program, "serve", "--model", "tiny", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # until it serves
        lines.append(line)
        if "serving 'tiny' at" in line:
            break
    else:
        pytest.fail("the server did not start: " + "".join(lines))
    return proc, lines, port


def test_ctrl_c_stops_the_server_cleanly() -> None:
    # uvicorn raises the signal again after its graceful shutdown: a KeyboardInterrupt traceback
    # (and a cancelled lifespan's) and exit status 130 after a clean stop, until serve_cli's Server
    proc, lines, _ = start_server()
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, "".join(lines) + out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out


def test_a_failed_engine_stops_the_server_with_status_1(tmp_path: Path) -> None:
    """A server whose engine loop has failed serves nothing any more: it shuts down (status 1, for
    a supervisor to restart it) rather than answer 503 for ever."""
    trigger = tmp_path / "fail"
    # (the engine's steps fail once ``trigger`` exists: a bug that a request runs into)
    program = ("import sys, pathlib\n"
               "from coserve.engine.llm_engine import LLMEngine\n"
               "step = LLMEngine.step\n"
               f"trigger = pathlib.Path({str(trigger)!r})\n"
               "def step_or_fail(self):\n"
               "    if trigger.exists():\n"
               "        raise RuntimeError('a bug in the engine')\n"
               "    return step(self)\n"
               "LLMEngine.step = step_or_fail\n"
               "from coserve.server.cli import main\n"
               "sys.exit(main())\n")
    proc, lines, port = start_server(program)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:  # (the line comes as uvicorn starts, before it listens)
            try:
                if http(url + "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server does not answer"
            time.sleep(0.1)
        assert http(url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200
        trigger.touch()
        status, reply = http(url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 503 and "shut down" in reply["error"]["message"]
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 1, "".join(lines) + out
        assert "a bug in the engine" in out and "the server shuts down" in out, out
    finally:  # (a failed check leaves no server behind)
        if proc.poll() is None:
            proc.kill()


def test_the_switch_interval_is_checked_and_small_by_default() -> None:
    """The engine's thread shares the GIL with the server's other threads: the interval each of its
    takings back may wait is ``--switch-interval-ms``, 0.1 ms unless set (CPython's own: 5)."""
    from coserve.server.serve_cli import SWITCH_INTERVAL_MS, switch_interval_s

    assert switch_interval_s(parse("--model", "tiny")) == pytest.approx(SWITCH_INTERVAL_MS / 1e3) == pytest.approx(1e-4)
    assert switch_interval_s(parse("--model", "tiny", "--switch-interval-ms", "5")) == pytest.approx(5e-3)
    for bad in ("0", "-1", "2000"):
        with pytest.raises(ValueError, match="--switch-interval-ms"):
            switch_interval_s(parse("--model", "tiny", "--switch-interval-ms", bad))

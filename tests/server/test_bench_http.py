"""``coserve bench-http`` and its driver against ``coserve serve`` on the tiny model (in-process
uvicorn, as in test_api.py): requests go out at their arrival times and come back as records of
their real lengths; refused and unfinished requests count as misses, with their errors."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coserve.bench.http_driver import HttpDriver
from coserve.bench.metrics import attainment
from coserve.bench.workload import Arrival
from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from tests.server.test_api import MODEL, Served, serve


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve(LLMEngine(EngineConfig(model=MODEL, device="cpu"))) as s:
        yield s


def test_driver_replays_arrivals_and_records_real_lengths(served: Served) -> None:
    arrivals = [Arrival(0.1 * i, 5 + 7 * i, 3 + i) for i in range(8)] + [Arrival(0.85, 5000, 4)]
    replay = HttpDriver(served.url, MODEL, vocab_size=1024).run(arrivals, duration_s=1.0, drain_s=20.0)
    records = replay.result.records
    assert [r.arrival_s for r in records] == [a.time_s for a in arrivals]
    for r, a in zip(records[:8], arrivals[:8], strict=True):
        assert r.first_token_s is not None and r.finish_s is not None
        assert a.time_s <= r.first_token_s <= r.finish_s
        assert r.output_tokens == a.output_tokens  # ignore_eos: exactly as asked
    assert records[8].first_token_s is None and records[8].output_tokens == 0
    assert list(replay.errors) == [8] and replay.errors[8].startswith("HTTP 400") and "context" in replay.errors[8]
    assert attainment(records, 10.0, 10.0) == pytest.approx(8 / 9)
    assert replay.result.inference_tokens == sum(a.output_tokens for a in arrivals[:8])
    # arrivals at or past the window are not sent
    late = HttpDriver(served.url, MODEL, vocab_size=1024).run([Arrival(0.0, 4, 2), Arrival(0.5, 4, 2)],
                                                              duration_s=0.3)
    assert len(late.result.records) == 1


def test_a_request_still_running_at_the_drain_is_a_miss(served: Served) -> None:
    replay = HttpDriver(served.url, MODEL, vocab_size=1024).run([Arrival(0.0, 4, 1500)], duration_s=0.1,
                                                                drain_s=0.5)
    (record,) = replay.result.records
    assert record.finish_s is None and record.output_tokens == 0
    assert "not finished within the 0.5 s drain" in replay.errors[0]


def test_bench_http_command_writes_its_result(served: Served, tmp_path: Path) -> None:
    from coserve.server.cli import main

    out = tmp_path / "r.json"
    assert main(["bench-http", "--url", served.url, "--model", MODEL, "--vocab-size", "1024", "--workload",
                 "burst-light", "--duration", "2", "--rate-scale", "0.05", "--max-prompt", "64", "--max-output",
                 "8", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    figures = result["figures"]
    assert figures["requests"] == len(result["per_request"]) > 0 and figures["errors"] == 0
    assert figures["attainment_abs"] == 1.0 and figures["output_tokens_per_s"] > 0
    assert result["config"]["workload"]["name"] == "burst-light" and "commit" in result


def test_prompts_are_fitted_to_the_context_the_server_gives(served: Served, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from coserve.server.cli import main

    assert HttpDriver(served.url, MODEL).context() == 2048  # /v1/models' max_model_len (the tiny model's)
    assert HttpDriver(served.url, "not-served").context() is None
    out = tmp_path / "r.json"
    assert main(["bench-http", "--url", served.url, "--model", MODEL, "--vocab-size", "1024", "--workload",
                 "burst-light", "--duration", "1", "--rate-scale", "0.05", "--max-prompt", "4096", "--max-output",
                 "2040", "--length-scale", "0.01", "--out", str(out)]) == 0
    assert "prompts clipped to 8 tokens (--max-prompt 4096)" in capsys.readouterr().out
    assert json.loads(out.read_text())["config"]["workload"]["scaling"]["max_prompt"] == 8


def test_a_server_with_an_api_key_is_benchmarked_with_it_and_the_key_is_not_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from coserve.server.cli import main

    monkeypatch.setenv("COSERVE_API_KEY", "env-secret")
    with serve(LLMEngine(EngineConfig(model=MODEL, device="cpu")), api_key="s3cret") as s:
        out = tmp_path / "r.json"
        argv = ["bench-http", "--url", s.url, "--model", MODEL, "--vocab-size", "1024", "--workload", "burst-light",
                "--duration", "1", "--rate-scale", "0.05", "--max-prompt", "32", "--max-output", "4", "--out", str(out)]
        assert main([*argv, "--api-key", "s3cret"]) == 0
        result = json.loads(out.read_text())
        assert result["figures"]["errors"] == 0 and result["figures"]["requests"] > 0
        assert "s3cret" not in out.read_text() and "env-secret" not in out.read_text()
        assert "COSERVE_API_KEY=***" in result["command"]
        out.unlink()
        # a key the server refuses: an error before the replay, whose every request would fail
        assert main([*argv, "--api-key=wrong"]) == 2
        err = capsys.readouterr().err
        assert "the server refused the API key (HTTP 401 on /v1/models): give its key with --api-key" in err
        assert "wrong" not in err and not out.exists()


SHORT = ["--vocab-size", "1024", "--workload", "burst-light", "--duration", "1", "--rate-scale", "0.05",
         "--max-prompt", "32", "--max-output", "4"]


def test_a_server_that_cannot_be_benchmarked_is_an_error_before_the_replay(
        served: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each of these exited 0 after replaying the workload, every request failing."""
    from coserve.server.cli import main

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    closed = sock.getsockname()[1]
    sock.close()
    host_port = served.url.removeprefix("http://")
    out = tmp_path / "r.json"
    for url, model, message in [
        (f"http://127.0.0.1:{closed}", MODEL, f"--url http://127.0.0.1:{closed}: cannot reach the server"),
        (host_port, MODEL, f"--url {host_port}: give the scheme, e.g. http://{host_port}"),
        (served.url, "nope", f"--model nope: the server at {served.url} does not serve it; it serves {MODEL}"),
    ]:
        assert main(["bench-http", "--url", url, "--model", model, *SHORT, "--out", str(out)]) == 2, message
        captured = capsys.readouterr()
        assert f"coserve bench-http: error: {message}" in captured.err and "requests of" not in captured.out
        assert not out.exists()


def test_an_unwritable_out_is_an_error_before_the_replay(served: Served, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A directory or a path under a file failed only when the result was written (a traceback)."""
    from coserve.server.cli import main

    (tmp_path / "afile").write_text("")
    for out, message in [(tmp_path, "a directory; give the result file's name"),
                         (tmp_path / "afile" / "r.json", f"{tmp_path / 'afile'} is a file, not a directory")]:
        assert main(["bench-http", "--url", served.url, "--model", MODEL, *SHORT, "--out", str(out)]) == 2
        captured = capsys.readouterr()
        assert f"--out {out}: {message}" in captured.err and "requests of" not in captured.out
    # missing directories are created when the result is written, as bench's --out directory is
    out = tmp_path / "new" / "dir" / "r.json"
    assert main(["bench-http", "--url", served.url, "--model", MODEL, *SHORT, "--out", str(out)]) == 0
    assert json.loads(out.read_text())["figures"]["errors"] == 0


def test_no_request_finished_is_exit_status_1(served: Served, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from coserve.server.cli import main

    out = tmp_path / "r.json"  # (token ids up to a million: the server refuses every prompt)
    assert main(["bench-http", "--url", served.url, "--model", MODEL, *SHORT, "--vocab-size", "1000000",
                 "--out", str(out)]) == 1
    assert "error: none of the" in capsys.readouterr().err
    figures = json.loads(out.read_text())["figures"]
    assert figures["errors"] == figures["requests"] > 0


def test_ctrl_c_stops_the_replay_and_writes_what_was_sent(served: Served, tmp_path: Path) -> None:
    """Ctrl-C printed a KeyboardInterrupt traceback and "Task exception was never retrieved" for
    the requests in flight, and wrote nothing. Three long requests are in flight at the signal,
    two more would arrive at 30 s."""
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,8,1500\n0.05,8,1500\n0.1,8,1500\n"
                     "30,8,4\n30.5,8,4\n")
    out = tmp_path / "r.json"
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from coserve.server.cli import main; sys.exit(main())",
                             "bench-http", "--url", served.url, "--model", MODEL, "--vocab-size", "1024",
                             "--workload", str(trace), "--duration", "40", "--max-prompt", "64", "--max-output",
                             "1500", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "5 requests of trace" in line, line
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stdout + stderr
    assert "Traceback" not in stderr and "never retrieved" not in stderr, stderr
    assert "interrupted after" in stderr and "3 of 5 requests sent until then (3 cut off in flight" in stderr
    result = json.loads(out.read_text())
    assert result["interrupted"] and result["figures"]["requests"] == 3
    assert set(result["figures"]["first_errors"].values()) == {"interrupted (Ctrl-C) before it finished"}


def test_a_result_files_command_hides_api_keys() -> None:
    from coserve.bench.provenance import provenance

    command = provenance(["coserve", "bench-http", "--api-key", "k1", "--url", "u", "--api-key=k2"])["command"]
    assert command.endswith("coserve bench-http --api-key '***' --url u '--api-key=***'")

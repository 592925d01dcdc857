"""``coserve finetune`` end to end on the tiny model: what a resume goes on from (only this run's
checkpoint, with this run's settings, past a train log cut short), how Ctrl-C and SIGTERM stop a
run (its adapter exported, a checkpoint to resume from, no traceback), the learning-rate
schedule's step count, the train log as strict JSON, and the flags checked at start-up."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coserve.models.peft_adapter import load_peft_adapter
from coserve.server.cli import main

DATA = Path(__file__).resolve().parents[2] / "src" / "coserve" / "data" / "tiny_facts.jsonl"
# (the built-in facts at 64 backward tokens: 32 optimizer steps an epoch)
FLAGS = ["--model", "tiny", "--device", "cpu", "--data", str(DATA), "--trainer-threads", "1",
         "--backward-tokens", "64", "--epoch-checkpoints", "0"]


def finetune(out: Path, *flags: str) -> int:
    return main(["finetune", *FLAGS, "--output", str(out), *flags])


def train_log(out: Path) -> list[dict]:
    """The run's train log, each line parsed as strict JSON (no NaN, no Infinity)."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in the train log: not JSON")

    return [json.loads(line, parse_constant=refuse) for line in (out / "train_log.jsonl").read_text().splitlines()]


def run_config(out: Path) -> dict:
    return json.loads((out / "run_config.json").read_text())


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run of one epoch (32 steps), its checkpoint at its end: copy it before changing it."""
    out = tmp_path_factory.mktemp("one_epoch") / "run"
    assert finetune(out, "--epochs", "1") == 0
    assert (out / "checkpoint" / "trainer_state.pt").is_file()
    return out


def copied(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def test_a_fresh_run_removes_the_checkpoint_an_earlier_run_left(one_epoch: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A resume after a fresh run into the same OUTPUT went on from the earlier run's checkpoint,
    its log the later run's: the fresh run removes it (and the copy a checkpoint's write leaves)."""
    out = copied(one_epoch, tmp_path)
    (out / ".checkpoint.old").mkdir()
    assert finetune(out, "--epochs", "1", "--lr", "1e-3", "--save-every", "0") == 0
    assert not (out / "checkpoint").exists() and not (out / ".checkpoint.old").exists()
    capsys.readouterr()
    assert finetune(out, "--epochs", "1", "--lr", "1e-3", "--resume") == 2
    assert "--resume: no checkpoint at" in capsys.readouterr().err


def test_a_resume_with_other_settings_is_refused_naming_them(one_epoch: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = copied(one_epoch, tmp_path)
    before = (out / "train_log.jsonl").read_text()
    assert finetune(out, "--epochs", "1", "--lr", "1e-3", "--seed", "3", "--resume") == 2
    err = capsys.readouterr().err
    assert "is of a run with other settings" in err and "--lr 0.001 (the checkpoint's: 0.0001)" in err
    assert "--seed 3 (the checkpoint's: 0)" in err and "--epochs" not in err
    edited = tmp_path / "facts.jsonl"  # (one answer changed: the same count of samples)
    edited.write_text(DATA.read_text().replace("The candle is in the north.", "The candle is in the south."))
    assert main(["finetune", *FLAGS, "--output", str(out), "--epochs", "1", "--resume", "--data", str(edited)]) == 2
    err = capsys.readouterr().err
    assert f"--data {edited}: 64 samples" in err and f"(the checkpoint's: {DATA}: 64 samples" in err
    assert (out / "train_log.jsonl").read_text() == before, "a refused resume changes nothing"


def test_a_resume_may_train_more_epochs_on_a_schedule_that_spans_them(one_epoch: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = copied(one_epoch, tmp_path)
    assert run_config(out)["optim"]["total_steps"] == 32
    assert finetune(out, "--epochs", "2", "--lr-scheduler", "linear", "--resume") == 2, "the schedule is the run's"
    capsys.readouterr()
    assert finetune(out, "--epochs", "2", "--resume") == 0
    # (the summary counts from the checkpoint: the steps of this run and of the whole one)
    assert "trained 32 optimizer steps after resuming at step 32 (64 in all)" in capsys.readouterr().out
    log = train_log(out)
    assert [e["step"] for e in log] == list(range(64))
    assert run_config(out)["optim"]["total_steps"] == 64, "the schedule's length follows the epochs"


def test_a_train_log_cut_short_at_its_end_resumes_and_one_damaged_before_it_is_named(
        one_epoch: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    out = copied(one_epoch, tmp_path)
    path = out / "train_log.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:5]) + "{oops\n" + "".join(lines[5:]))
    assert finetune(out, "--epochs", "2", "--resume") == 2
    assert f"{path}: line 6 is not a logged step" in capsys.readouterr().err
    path.write_text("".join(lines) + lines[-1][:29])  # (the machine stopped as a line was written)
    with caplog.at_level(logging.WARNING, logger="coserve.server.train_log"):
        assert finetune(out, "--epochs", "2", "--resume") == 0
    assert f"{path}: line 33 is not a whole step" in caplog.text
    assert [e["step"] for e in train_log(out)] == list(range(64))


def test_the_schedule_spans_the_steps_the_run_takes(tmp_path: Path) -> None:
    """The step count of the learning-rate schedule (a linear one decays to 0 there) is the count
    the run takes: on the built-in facts (32 estimated against 36 taken, before), and on samples
    of mixed lengths in steps of two tasks each."""
    out = tmp_path / "facts"
    assert main(["finetune", "--model", "tiny", "--device", "cpu", "--data", str(DATA), "--output", str(out),
                 "--trainer-threads", "1", "--epochs", "4", "--lr-scheduler", "linear", "--save-every", "0",
                 "--epoch-checkpoints", "0"]) == 0
    log = train_log(out)
    assert len(log) == run_config(out)["optim"]["total_steps"] == 36
    assert all(e["lr"] > 0 for e in log), "no step trained at a learning rate of 0"
    rng = random.Random(5)
    data = tmp_path / "mixed.jsonl"
    rows = []
    for _ in range(50):
        ids = [rng.randrange(6, 1000) for _ in range(rng.choice([rng.randint(4, 12), rng.randint(40, 120)]))]
        rows.append({"input_ids": ids, "labels": [-100] * 2 + ids[2:]})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "mixed"
    assert main(["finetune", "--model", "tiny", "--device", "cpu", "--data", str(data), "--output", str(out),
                 "--trainer-threads", "1", "--epochs", "3", "--backward-tokens", "100", "--grad-accum", "2",
                 "--max-seq-len", "128", "--save-every", "0", "--epoch-checkpoints", "0"]) == 0
    assert len(train_log(out)) == run_config(out)["optim"]["total_steps"]


def test_the_train_log_is_strict_json_where_steps_are_skipped(tmp_path: Path) -> None:
    """A step skipped for a non-finite gradient was logged with ``"grad_norm": NaN``: null now."""
    out = tmp_path / "run"
    assert finetune(out, "--epochs", "1", "--lr", "1e30", "--max-grad-norm", "0", "--max-skipped-steps", "3",
                    "--save-every", "0") == 1
    skipped = [e for e in train_log(out) if e["skipped"]]
    assert len(skipped) == 3 and all(e["grad_norm"] is None and e["loss"] is None for e in skipped)


@pytest.mark.parametrize(("flag", "value"), [("--save-every", "-1"), ("--trainer-threads", "-1")])
def test_negative_counts_are_refused_naming_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     flag: str, value: str) -> None:
    assert main(["finetune", "--model", "tiny", "--device", "cpu", "--data", str(DATA), "--output",
                 str(tmp_path / "run"), flag, value]) == 2
    assert f"coserve finetune: error: {flag} must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_exports_checkpoints_and_exits_cleanly(tmp_path: Path, sig: signal.Signals) -> None:
    """Ctrl-C reaches every process of the terminal's group (a supervisor's SIGTERM often does):
    the run stops at a step boundary with its adapter exported and a checkpoint that ``--resume``
    goes on from, one line, status 128 + the signal; no KeyboardInterrupt traceback from the
    trainer or the engine's step."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from coserve.server.cli import main; sys.exit(main())", "finetune",
         *FLAGS, "--output", str(out), "--epochs", "200", "--save-every", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "train_log.jsonl").is_file() or not (out / "train_log.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, "no step logged"
            time.sleep(0.05)
        os.killpg(proc.pid, sig)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + sig, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    steps = len(train_log(out))
    assert f"coserve finetune: stopped by {sig.name} after optimizer step {steps} of 6400" in output
    load_peft_adapter(out / "adapter")
    assert finetune(out, "--epochs", "2", "--resume") == 0
    assert [e["step"] for e in train_log(out)] == list(range(64)) and steps < 64

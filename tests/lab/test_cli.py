"""`gpubalance lab run` and `gpubalance lab demo` on input that is wrong or will go wrong: one
clear line and exit code 2 before anything runs, warnings on stderr, no traceback."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpubalance.cli import main

SCENARIO = """\
name: cli
description: "one card, a trickle of chat, a slower disk at 100 s"
duration_seconds: 120
hardware:
  gpus:
    - card: RTX 4090
models:
  small:
    params_billions: 3.21
workers:
  - gpu: 0
    model: small
traffic:
  - name: chat
    class: interactive
    arrivals: {kind: poisson, rate: 1}
    prompt_tokens: {kind: fixed, value: 100}
    output_tokens: {kind: fixed, value: 10}
events:
  - at: 100
    disk: {disk_mb_per_second: 100}
"""


@pytest.fixture
def scenario_file(tmp_path: Path) -> Path:
    path = tmp_path / "cli.yaml"
    path.write_text(SCENARIO)
    return path


def test_run_warns_on_stderr_and_still_runs(
    scenario_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code = main(["lab", "run", str(scenario_file), "--duration", "60", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 0
    assert err.splitlines() == [
        f"gpubalance lab: warning: {scenario_file}:20: events.0.at: at 100 s, not earlier than "
        "the run's end (60 s): the disk event falls after the run's arrivals, frames and truth"
    ]
    assert (out / "truth.csv").exists()


@pytest.mark.parametrize(("flags", "recorded"), [((), True), (("--no-snapshots",), False)])
def test_run_records_the_exporters_snapshots_unless_told_not_to(
    flags: tuple[str, ...], recorded: bool, scenario_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert (
        main(["lab", "run", str(scenario_file), "--duration", "30", *flags, "--out", str(out)]) == 0
    )
    assert (out / "frames.csv").is_file()
    snapshots = out / "snapshots.jsonl"
    assert snapshots.is_file() is recorded
    if recorded:
        lines = snapshots.read_text().splitlines()
        assert len(lines) == 30  # one per sample of 1 s
        assert json.loads(lines[0])["schema"] == "gpubalance.snapshot/v1"


@pytest.mark.parametrize("duration", ["-5", "0", "nan", "inf"])
def test_run_rejects_a_duration_that_is_not_a_positive_number(
    duration: str, scenario_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as caught:
        main(["lab", "run", str(scenario_file), "--duration", duration, "--out", str(out)])
    assert caught.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == (
        "gpubalance lab run: error: argument --duration: expected a number of seconds above 0, "
        f"got {duration!r}"
    )
    assert not out.exists()


def test_run_rejects_a_negative_seed(
    scenario_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["lab", "run", str(scenario_file), "--seed", "-1", "--out", str(tmp_path / "o")])
    assert caught.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "gpubalance lab run: error: argument --seed: expected an integer of 0 or more, got '-1'"
    )


@pytest.mark.parametrize("under", ["file/out", "file/deeper/out", "file"])
def test_run_rejects_an_out_directory_a_regular_file_blocks(
    under: str, scenario_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("not a directory\n")
    out = tmp_path / under
    code = main(["lab", "run", str(scenario_file), "--out", str(out)])
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"gpubalance lab: --out {out}: {tmp_path / 'file'} is not a directory"
    ]


@pytest.mark.live  # the demo runs the live lab
def test_demo_keeps_the_run_directory_it_names_and_says_how_to_remove_it(
    fakenvml_dir: Path, tmp_path: Path
) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpubalance",
            "lab",
            "demo",
            "--duration",
            "3",
            "--build-dir",
            str(fakenvml_dir),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    named = re.search(r"lab files: (\S+)", result.stdout)
    assert named, result.stdout
    run_dir = Path(named.group(1))
    try:
        assert run_dir.is_dir()
        assert (run_dir / "run.log").exists()  # the log of `gpubalance run`, the demo's stack
        assert f"remove them with: rm -r {run_dir}" in result.stdout.splitlines()[-1]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)

"""`gpubalance lab run` on input that will go wrong: warnings on stderr."""

from __future__ import annotations

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

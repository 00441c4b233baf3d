"""`make demo` in a pipe: 4 GPUs (3x RTX 4090 + RTX 3090) with values that move."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest


@pytest.mark.live
def test_demo_shows_four_gpus_with_moving_values(fakenvml_dir, tmp_path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpubalance",
            "lab",
            "demo",
            "--duration",
            "5",
            "--build-dir",
            str(fakenvml_dir),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    kept = re.search(r"remove them with: rm -r (\S+)", result.stdout)
    if kept:
        shutil.rmtree(kept.group(1), ignore_errors=True)  # the demo keeps what it names
    assert result.returncode == 0, result.stderr
    assert kept, "the demo names the run directory it keeps"
    rows = re.findall(
        r"│ (\d)\s+│ (RTX \d{4})\s+│[^│]*│[^│]*│[^│]*│[^│]*│ (\d+)/\d+ W", result.stdout
    )
    frames = [rows[i : i + 4] for i in range(0, len(rows), 4)]
    assert len(frames) >= 3, result.stdout
    assert [(gpu, model) for gpu, model, _ in frames[0]] == [
        ("0", "RTX 4090"),
        ("1", "RTX 4090"),
        ("2", "RTX 4090"),
        ("3", "RTX 3090"),
    ]
    powers = {tuple(power for _, _, power in frame) for frame in frames}
    assert len(powers) > 1, "values must move between refreshes"

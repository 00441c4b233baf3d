"""bench/real_gpu.py, the survey a GPU host runs, works on any conforming NVML library."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gpubalance.lab.fakenvml import write_state

ROOT = Path(__file__).resolve().parents[2]


def test_survey_runs_on_the_fake_driver(fakenvml_env, tmp_path: Path) -> None:
    state = tmp_path / "state"
    write_state(state, {"device_count": 2, "gpu1.err.nvmlDeviceGetFanSpeed": "NOT_SUPPORTED"})
    out = tmp_path / "real-gpu.md"
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "real_gpu.py"), "--out", str(out)],
        env=fakenvml_env(state),
        check=True,
        capture_output=True,
        timeout=120,
    )
    text = out.read_text()
    assert "## GPU 0: NVIDIA GeForce RTX 4090" in text and "## GPU 1:" in text
    assert "| `nvmlDeviceGetFanSpeed` | **Not Supported** (3) |  |" in text
    assert 'capability="fan_speed"} 0' in text
    assert "DCGM_FI_DEV_GPU_TEMP" in text

"""The exposition against its contracts: golden files checked by promtool, and dcgm-exporter's
default counters (tests/data/dcgm-default-counters.csv)."""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness import Metrics

from gpubalance.lab.fakenvml import write_state

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
FIXTURE_PROC = ROOT / "tests" / "fixtures" / "proc"
UPDATE = os.environ.get("GPUBALANCE_UPDATE_GOLDEN") == "1"
MIB = 1024 * 1024

# Values that change from run to run: compared as 0.
VOLATILE = re.compile(
    r"^(gpubalance_exporter_(?:sample_duration_seconds|collector_duration_seconds|"
    r"last_sample_timestamp_seconds|collector_last_success_timestamp_seconds)"
    r"(?:\{[^}]*\})?) .*$",
    re.MULTILINE,
)

# dcgm-exporter default counters that no NVML call serves, and why.
NEVER_SERVED = {
    "DCGM_FI_DEV_VGPU_LICENSE_STATUS": "vGPU licensing exists only on vGPU hosts",
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": "DCP profiling: datacenter GPUs and Blackwell GeForce only",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": "DCP profiling: datacenter GPUs and Blackwell GeForce only",
    "DCGM_FI_PROF_DRAM_ACTIVE": "DCP profiling: datacenter GPUs and Blackwell GeForce only",
}
# Served from NVML where the GPU supports the query; GeForce RTX cards answer NOT_SUPPORTED,
# and like dcgm-exporter we then drop the series.
WHERE_SUPPORTED = {
    "DCGM_FI_DEV_MEMORY_TEMP",
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE",
}


def golden_state(datacenter: bool = False) -> dict[str, object]:
    state: dict[str, object] = {"device_count": 2, "driver_version": "550.54.14"}
    for i, pid in enumerate((4242, 4343)):  # processes of the fixture procfs tree
        p = f"gpu{i}."
        state.update(
            {
                p + "uuid": f"GPU-0000000{i}-1111-2222-3333-44444444444{i}",
                p + "utilization.gpu": 60 + i,
                p + "memory.used": (8000 + i) * MIB,
                p + "temp.gpu": 70 + i,
                p + "power.usage": 300_000 + i,
                p + "throttle_reasons": 0x4,
                p + "procs": [(pid, 4096 * MIB)],
                p + "procs_util": [(pid, 55, 20, 0, 0)],
            }
        )
        if datacenter:
            state.update(
                {
                    p + "field.82": 80 + i,
                    p + "field.138": 1000 + i,
                    p + "field.139": 2000 + i,
                    p + "remapped_rows": "3:1:0:0",
                }
            )
    return state


def run_once(fakenvml_env, tmp_path: Path, names: str, state: dict[str, object]) -> str:
    state_path = tmp_path / f"{names}.state"
    write_state(state_path, state)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpubalance",
            "exporter",
            "--once",
            "--names",
            names,
            "--procfs",
            str(FIXTURE_PROC),
            "--hostname",
            "golden",
            "--log-level",
            "error",
        ],
        env=fakenvml_env(state_path),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout


@pytest.mark.parametrize("names", ["native", "dcgm"])
def test_golden_exposition(fakenvml_env, tmp_path: Path, names: str) -> None:
    text = VOLATILE.sub(r"\1 0", run_once(fakenvml_env, tmp_path, names, golden_state()))
    golden = GOLDEN / f"exporter-{names}.prom"
    if UPDATE:
        golden.write_text(text)
    assert text == golden.read_text(), (
        f"exposition changed; review and rerun with GPUBALANCE_UPDATE_GOLDEN=1 ({golden})"
    )


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool: apt-get install prometheus")
def test_promtool_accepts_native_golden() -> None:
    result = subprocess.run(
        ["promtool", "check", "metrics"],
        input=(GOLDEN / "exporter-native.prom").read_text(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool: apt-get install prometheus")
def test_promtool_on_dcgm_golden_only_objects_to_dcgm_names() -> None:
    """dcgm-exporter's names break Prometheus naming on purpose (camelCase labels, counters
    without _total); promtool parses the text and lints only those."""
    result = subprocess.run(
        ["promtool", "check", "metrics"],
        input=(GOLDEN / "exporter-dcgm.prom").read_text(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    allowed = re.compile(
        r"^(DCGM_FI_\w+ (label names should be written in 'snake_case' not 'camelCase'|"
        r'counter metrics should have "_total" suffix|'
        r"metric name should not include type 'counter')|)$"
    )
    complaints = (result.stdout + result.stderr).splitlines()
    assert result.returncode in (0, 3), complaints  # 3: lint problems, not parse errors
    assert all(allowed.match(line) for line in complaints), complaints


def dcgm_default_counters() -> list[tuple[str, str]]:
    rows = []
    with (ROOT / "tests" / "data" / "dcgm-default-counters.csv").open() as f:
        for row in csv.reader(f):
            if row and not row[0].lstrip().startswith("#"):
                rows.append((row[0].strip(), row[1].strip()))
    return rows


@pytest.mark.parametrize("datacenter", [False, True], ids=["geforce", "datacenter"])
def test_dcgm_profile_covers_the_default_counters(fakenvml_env, tmp_path, datacenter) -> None:
    metrics = Metrics.parse(run_once(fakenvml_env, tmp_path, "dcgm", golden_state(datacenter)))
    counters = dcgm_default_counters()
    assert len(counters) == 26
    for field, kind in counters:
        if kind == "label":
            for (name, labels), _ in metrics.samples.items():
                if name.startswith("DCGM_"):
                    assert dict(labels)[field] == "550.54.14", name
            continue
        if field in NEVER_SERVED or (field in WHERE_SUPPORTED and not datacenter):
            assert not metrics.has(field), f"{field} served without a source"
            continue
        assert metrics.types.get(field) == kind, f"{field}: expected a {kind}"
        for gpu in ("0", "1"):
            assert metrics.has(field, gpu=gpu), f"{field} missing for GPU {gpu}"
    if datacenter:
        assert metrics.value("DCGM_FI_DEV_MEMORY_TEMP", gpu="1") == 81
        assert metrics.value("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", gpu="0") == 3000 * 1024
        assert metrics.value("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", gpu="0") == 3
        assert metrics.value("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", gpu="0") == 1
        assert metrics.value("DCGM_FI_DEV_ROW_REMAP_FAILURE", gpu="0") == 0


def test_snapshot_schema_file_is_current() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gpubalance", "exporter", "--print-schema"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    path = ROOT / "docs" / "snapshot.schema.json"
    if UPDATE:
        path.write_text(result.stdout)
    assert result.stdout == path.read_text(), "rerun with GPUBALANCE_UPDATE_GOLDEN=1 and review"

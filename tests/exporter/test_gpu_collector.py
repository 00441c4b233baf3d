"""The GPU collector in process, on the fake driver: probe once, degrade per capability."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubalance.exporter.collectors.base import SampleParts
from gpubalance.exporter.collectors.gpu import GpuCollector
from gpubalance.exporter.nvml import NvmlSession, Support
from gpubalance.lab.fakenvml import TEST_HOOKS

ROOT = Path(__file__).resolve().parents[2]


def calls(lib: ctypes.CDLL, name: str) -> int:
    lib.fakeNvmlCallCount.restype = ctypes.c_ulonglong
    return int(lib.fakeNvmlCallCount(name.encode()))


@pytest.fixture
def collector(nvml) -> Iterator[GpuCollector]:
    """A GPU collector on the fake driver, closed (its NVML init released) whatever happens."""
    made = GpuCollector(NvmlSession())
    yield made
    made.close()


def sample(collector: GpuCollector) -> SampleParts:
    parts = SampleParts(timestamp_seconds=0.0)
    collector.update(parts)
    return parts


def test_not_supported_is_probed_once_per_gpu(nvml, collector) -> None:
    nvml.write(
        {
            "device_count": 8,
            "gpu*.err.nvmlDeviceGetFanSpeed": "NOT_SUPPORTED",
            "gpu3.err.nvmlDeviceGetPowerUsage": "NOT_SUPPORTED",
        }
    )
    nvml.lib.fakeNvmlResetCallCounts()
    for _ in range(5):
        parts = sample(collector)
    assert calls(nvml.lib, "nvmlDeviceGetFanSpeed") == 8  # once per GPU, never again
    assert calls(nvml.lib, "nvmlDeviceGetPowerUsage") == 8 * 5 - 4
    assert calls(nvml.lib, "nvmlDeviceGetTemperatureV") == 8 * 5
    gpus = parts.gpus
    assert all(g.fan_speed_ratio is None and g.supported["fan_speed"] is False for g in gpus)
    assert gpus[3].power_watts is None and gpus[2].power_watts is not None


def test_reinit_probes_again(nvml, collector) -> None:
    nvml.write({"device_count": 2, "gpu*.err.nvmlDeviceGetFanSpeed": "NOT_SUPPORTED"})
    session = collector.session
    sample(collector)
    assert session.devices[0].capabilities["fan_speed"] is Support.UNSUPPORTED
    nvml.write({"device_count": 2})
    session.shutdown()  # as after the driver went away and came back
    parts = sample(collector)
    assert parts.gpus[0].fan_speed_ratio == pytest.approx(0.3)


def test_transient_error_is_counted_and_retried(nvml, collector) -> None:
    nvml.write({"device_count": 2, "gpu1.err.nvmlDeviceGetPowerUsage": "UNKNOWN"})
    parts = sample(collector)
    assert parts.gpus[1].power_watts is None
    nvml.write({"device_count": 2})
    parts = sample(collector)
    assert parts.gpus[1].power_watts == pytest.approx(30.0)
    assert parts.nvml is not None
    assert parts.nvml.errors_total["nvmlDeviceGetPowerUsage"] == {"UNKNOWN": 1}


def test_xid_events_count_once_each(nvml, collector) -> None:
    nvml.write({"device_count": 2})
    assert sample(collector).gpus[0].xid_errors_total == {}
    nvml.write({"device_count": 2, "gpu0.xid": "79,13,79"})
    gpus = sample(collector).gpus
    assert gpus[0].xid_errors_total == {79: 2, 13: 1}
    assert gpus[0].last_xid == 79
    assert gpus[1].xid_errors_total == {}
    assert sample(collector).gpus[0].xid_errors_total == {79: 2, 13: 1}  # not delivered twice


def test_utilization_samples_are_time_weighted(nvml, collector) -> None:
    nvml.write({"device_count": 1, "gpu0.utilization.gpu": 40, "gpu0.sample_period_us": 1000})
    time.sleep(0.005)  # a few sample periods after the change, so the newest carry it
    first = sample(collector).gpus[0]
    # Grid points before the state change carry the old value (the fixture's 0 %).
    values = [v for _, v in first.utilization_samples]
    assert values[-1] == pytest.approx(0.4)
    assert set(values) <= {0.0, 0.4} and values == sorted(values)
    later = sample(collector).gpus[0]
    # only samples newer than the last one seen come back
    assert not later.utilization_samples or (
        later.utilization_samples[0][0] > first.utilization_samples[-1][0]
    )


def test_processes_without_utilization_samples_read_zero(nvml, collector) -> None:
    nvml.write(
        {
            "device_count": 1,
            "gpu0.procs": "100:1048576,200:2097152",
            "gpu0.procs_util": "100:40:10:0:0",
        }
    )
    processes = {p.pid: p for p in sample(collector).gpus[0].processes}
    assert processes[100].sm_utilization_ratio == pytest.approx(0.4)
    assert processes[200].sm_utilization_ratio == 0.0  # NOT_FOUND for it means no samples
    assert processes[200].gpu_memory_used_bytes == 2097152


@pytest.mark.timing
def test_stuck_gpu_is_stale_and_gets_no_second_worker(nvml) -> None:
    collector = GpuCollector(NvmlSession(), deadline_seconds=0.05)
    try:
        nvml.write({"device_count": 4})
        sample(collector)  # enumerated and probed while every GPU is fast
        # stuck far longer than the six samples below take (0.3 s unloaded), however busy the
        # machine, so GPU 1 is still inside its one read at the last of them
        nvml.write({"device_count": 4, "gpu1.delay_us": 3_000_000})
        nvml.lib.fakeNvmlResetCallCounts()
        for _ in range(6):
            gpus = sample(collector).gpus
        workers = [t for t in threading.enumerate() if t.name.startswith("gpubalance-gpu")]
        assert len(workers) == 4  # one per GPU, however many samples GPU 1 stays stuck
        # 3 fast GPUs x 6 samples, and GPU 1 still inside the one read it was given
        assert calls(nvml.lib, "nvmlDeviceGetPowerUsage") <= 3 * 6 + 1
        assert gpus[1].stale and gpus[1].stale_call.startswith("nvmlDevice")
        assert gpus[1].temperature_celsius is None and not gpus[1].lost
        assert all(not g.stale and g.temperature_celsius == 35 for g in gpus if g.index != 1)

        nvml.write({"device_count": 4})
        for _ in range(100):  # the stuck call returns within its delay; bounded either way
            gpus = sample(collector).gpus
            if not gpus[1].stale:
                break
            time.sleep(0.05)
        assert not gpus[1].stale and gpus[1].temperature_celsius == 35
    finally:
        collector.close()


def test_gpu_lost_before_its_uuid_was_known_recovers_under_its_uuid(nvml) -> None:
    collector = GpuCollector(NvmlSession(lost_recheck_seconds=0.0))
    try:
        nvml.write({"device_count": 3, "gpu1.lost": 1})
        gpus = sample(collector).gpus
        assert [(g.uuid, g.lost) for g in gpus][1] == ("GPU-unknown-1", True)
        nvml.write({"device_count": 3})
        gpus = sample(collector).gpus
        assert len(gpus) == 3  # no lost placeholder left behind
        assert not gpus[1].lost and gpus[1].uuid.startswith("GPU-") and gpus[1].power_watts
    finally:
        collector.close()


def test_exporter_uses_nothing_but_nvml_symbols(fakenvml_env, tmp_path: Path) -> None:
    """A proxy in front of pynvml's library records every symbol the exporter resolves: only
    NVML entry points, none of the fake's hooks, so any conforming libnvidia-ml.so.1 serves."""
    from gpubalance.lab.fakenvml import write_state

    state = tmp_path / "state"
    write_state(state, {"device_count": 2, "gpu0.procs": "1:1048576"})
    script = textwrap.dedent(
        """
        import ctypes, json, sys
        import pynvml
        resolved = set()
        class Proxy:
            def __init__(self, lib): self._lib = lib
            def __getattr__(self, name):
                resolved.add(name)
                return getattr(self._lib, name)
        pynvml.nvmlLib = Proxy(ctypes.CDLL("libnvidia-ml.so.1"))
        from gpubalance.cli import main
        rc = main(["exporter", "--once", "--log-level", "error"])
        print(json.dumps(sorted(resolved)), file=sys.stderr)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=fakenvml_env(state),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    resolved = set(json.loads(result.stderr.strip().splitlines()[-1]))
    assert resolved and all(name.startswith("nvml") for name in resolved), resolved
    assert not resolved & set(TEST_HOOKS)
    expected = ROOT / "tests" / "data" / "exporter-nvml-symbols.txt"
    if os.environ.get("GPUBALANCE_UPDATE_GOLDEN") == "1":
        expected.write_text("\n".join(sorted(resolved)) + "\n")
    assert sorted(resolved) == expected.read_text().split(), (
        "the exporter's NVML symbol set changed (a pynvml upgrade switching to a new _vN?); "
        f"review and update {expected}"
    )

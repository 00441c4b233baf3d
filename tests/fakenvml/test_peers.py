"""Fidelity: unmodified peer tools (nvitop, gpustat) read the fake correctly."""

from __future__ import annotations

import pytest

from gpubalance.lab.fakenvml import write_state

GiB = 1 << 30
MiB = 1 << 20

NVITOP = """
import json, logging
logging.basicConfig(level=logging.DEBUG)  # nvitop reports missing symbols at debug level
from nvitop import Device
out = []
for d in Device.all():
    procs = d.processes()
    out.append({
        "name": d.name(), "uuid": d.uuid(), "bus_id": d.bus_id(),
        "temperature": d.temperature(), "power_usage": d.power_usage(),
        "power_limit": d.power_limit(), "memory_total": d.memory_total(),
        "memory_used": d.memory_used(), "gpu_utilization": d.gpu_utilization(),
        "fan_speed": d.fan_speed(),
        "processes": {str(pid): p.gpu_memory() for pid, p in procs.items()},
    })
print(json.dumps({"devices": out}))
"""

GPUSTAT = """
import json, gpustat
print(json.dumps(gpustat.new_query().jsonify(), default=str))
"""


@pytest.fixture
def peer_state(tmp_path, sleepers) -> tuple[object, dict[int, dict[int, int]]]:
    """An 8-GPU state whose processes are real PIDs: {gpu: {pid: bytes}}."""
    procs = {
        0: {sleepers[0]: 1 * GiB, sleepers[1]: 512 * MiB},
        3: {sleepers[2]: 2 * GiB},
    }
    graphics = {5: {sleepers[3]: 256 * MiB}}
    state: dict[str, object] = {
        "device_count": 8,
        "gpu6.err.nvmlDeviceGetFanSpeed": "NOT_SUPPORTED",
    }
    for i in range(8):
        state |= {
            f"gpu{i}.name": f"NVIDIA GeForce RTX 4090 #{i}",
            f"gpu{i}.temp.gpu": 40 + i,
            f"gpu{i}.power.usage": 100_000 + 10_000 * i,
            f"gpu{i}.power.limit": 450_000 - 10_000 * i,
            f"gpu{i}.memory.used": (i + 1) * GiB,
            f"gpu{i}.utilization.gpu": 10 * i,
            f"gpu{i}.procs": list(procs.get(i, {}).items()),
            f"gpu{i}.graphics_procs": list(graphics.get(i, {}).items()),
        }
    path = tmp_path / "state"
    write_state(path, state)
    return path, {i: procs.get(i, {}) | graphics.get(i, {}) for i in range(8)}


def test_nvitop_device_api(peer_state, run_python, fakenvml_env):
    path, expected_procs = peer_state
    out = run_python(NVITOP, fakenvml_env(path))
    devices = out["devices"]
    assert len(devices) == 8
    for i, d in enumerate(devices):
        assert d["name"] == f"NVIDIA GeForce RTX 4090 #{i}"
        assert d["bus_id"] == f"00000000:{i + 1:02X}:00.0"
        assert d["temperature"] == 40 + i
        assert d["power_usage"] == 100_000 + 10_000 * i
        assert d["power_limit"] == 450_000 - 10_000 * i  # management limit follows power.limit
        assert d["memory_total"] == 24564 * MiB
        assert d["memory_used"] == (i + 1) * GiB
        assert d["gpu_utilization"] == 10 * i
        assert d["fan_speed"] == ("N/A" if i == 6 else 30)
        # exact PIDs and sizes: a struct-layout mismatch garbles the second entry
        assert {int(pid): mem for pid, mem in d["processes"].items()} == expected_procs[i]
    assert "Failed to find symbol" not in out["_stderr"]
    assert "FunctionNotFound" not in out["_stderr"]


def test_gpustat(peer_state, run_python, fakenvml_env):
    path, expected_procs = peer_state
    out = run_python(GPUSTAT, fakenvml_env(path))
    assert out["driver_version"] == "595.71.05"
    gpus = out["gpus"]
    assert [g["index"] for g in gpus] == list(range(8))
    for i, g in enumerate(gpus):
        assert g["name"] == f"NVIDIA GeForce RTX 4090 #{i}"
        assert g["temperature.gpu"] == 40 + i
        assert g["memory.used"] == (i + 1) * 1024  # MiB, from memory v2
        assert g["memory.total"] == 24564
        assert g["power.draw"] == 100 + 10 * i
        assert g["enforced.power.limit"] == 450 - 10 * i
        procs = {p["pid"]: (p["command"], p["gpu_memory_usage"]) for p in g["processes"]}
        assert procs == {pid: ("sleep", mem // MiB) for pid, mem in expected_procs[i].items()}
    assert gpus[6]["fan.speed"] is None

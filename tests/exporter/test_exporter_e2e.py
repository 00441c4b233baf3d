"""End to end: state file -> fake driver -> pynvml -> exporter process -> /metrics text."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from itertools import pairwise
from pathlib import Path

import jsonschema
from harness import Metrics
from pytest import approx

from gpubalance.lab.fakenvml import THROTTLE_REASONS, build_library, write_state

MIB = 1024 * 1024
ROOT = Path(__file__).resolve().parents[2]


def full_state(gpus: int = 8, pids: tuple[int, ...] = ()) -> dict[str, object]:
    """Distinct, non-default values for every key the exporter reads, on every GPU."""
    state: dict[str, object] = {"device_count": gpus, "driver_version": "550.54.14"}
    for i in range(gpus):
        p = f"gpu{i}."
        state.update(
            {
                p + "name": "NVIDIA GeForce RTX 3090" if i == 7 else "NVIDIA GeForce RTX 4090",
                p + "uuid": f"GPU-{i:08d}-aaaa-bbbb-cccc-{i:012d}",
                p + "pci.bus_id": f"00000000:{0x10 + i:02X}:00.0",
                p + "utilization.gpu": 10 + i * 11,
                p + "utilization.memory": 5 + i,
                p + "utilization.encoder": 2 + i,
                p + "utilization.decoder": 3 + i,
                p + "memory.total": 24564 * MIB,
                p + "memory.used": (1000 + 1000 * i) * MIB,
                p + "memory.reserved": (300 + i) * MIB,
                p + "temp.gpu": 40 + i * 5,
                p + "power.usage": 100_000 + i * 31_000,
                p + "power.limit": 400_000 + i * 1000,
                p + "energy": 5_000_000 + i * 123_456,
                p + "clock.sm": 2000 + i * 10,
                p + "clock.graphics": 2005 + i * 10,
                p + "clock.mem": 10_000 + i,
                p + "clock.max.sm": 3100 + i,
                p + "clock.max.mem": 10_501 + i,
                p + "throttle_reasons": [0, 0x4, 0x20, 0x1, 0x8, 0x40, 0x80, 0x4 | 0x20][i],
                p + "pcie.tx": 1000 + i * 100,
                p + "pcie.rx": 20_000 + i * 100,
                p + "pcie.replay_counter": 7 * i,
                p + "fan.speed": 30 + i * 7,
            }
        )
        if pids:
            pid = pids[i % len(pids)]
            state[p + "procs"] = [(pid, (512 + i) * MIB)]
            state[p + "procs_util"] = [(pid, 20 + i, 10 + i, 0, 0)]
    state["gpu3.field.82"] = 71  # memory temperature, where a card reports it
    return state


def test_every_state_value_appears_in_both_profiles(start_exporter) -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        state = full_state(pids=(sleeper.pid,))
        exporter = start_exporter(state)
        native = exporter.metrics("native")
        dcgm = exporter.metrics("dcgm")
    finally:
        sleeper.kill()
        sleeper.wait()

    for i in range(8):
        p = f"gpu{i}."
        uuid = state[p + "uuid"]
        ids = {"gpu": str(i), "uuid": uuid}
        info = native.find("gpubalance_gpu_info", **ids)[0][0]
        assert info["name"] == state[p + "name"]
        assert info["pci_bus_id"] == state[p + "pci.bus_id"]
        assert info["driver_version"] == "550.54.14"
        used, reserved, total = (
            state[p + k] for k in ("memory.used", "memory.reserved", "memory.total")
        )
        expected_native = {
            "gpubalance_gpu_utilization_ratio": state[p + "utilization.gpu"] / 100,
            "gpubalance_gpu_memory_utilization_ratio": state[p + "utilization.memory"] / 100,
            "gpubalance_gpu_encoder_utilization_ratio": state[p + "utilization.encoder"] / 100,
            "gpubalance_gpu_decoder_utilization_ratio": state[p + "utilization.decoder"] / 100,
            "gpubalance_gpu_memory_total_bytes": total,
            "gpubalance_gpu_memory_used_bytes": used,
            "gpubalance_gpu_memory_reserved_bytes": reserved,
            "gpubalance_gpu_memory_free_bytes": total - used - reserved,
            "gpubalance_gpu_temperature_celsius": state[p + "temp.gpu"],
            "gpubalance_gpu_power_watts": state[p + "power.usage"] / 1000,
            "gpubalance_gpu_power_limit_watts": state[p + "power.limit"] / 1000,
            "gpubalance_gpu_energy_joules_total": state[p + "energy"] / 1000,
            "gpubalance_gpu_pcie_transmit_bytes_per_second": state[p + "pcie.tx"] * 1024,
            "gpubalance_gpu_pcie_receive_bytes_per_second": state[p + "pcie.rx"] * 1024,
            "gpubalance_gpu_pcie_replays_total": state[p + "pcie.replay_counter"],
            "gpubalance_gpu_fan_speed_ratio": state[p + "fan.speed"] / 100,
            "gpubalance_gpu_lost": 0,
        }
        for name, value in expected_native.items():
            assert native.value(name, **ids) == approx(value), name
        for clock, key in (
            ("sm", "clock.sm"),
            ("memory", "clock.mem"),
            ("graphics", "clock.graphics"),
        ):
            assert native.value("gpubalance_gpu_clock_hertz", clock=clock, **ids) == (
                state[p + key] * 1e6
            )
        for clock, key in (("sm", "clock.max.sm"), ("memory", "clock.max.mem")):
            assert native.value("gpubalance_gpu_max_clock_hertz", clock=clock, **ids) == (
                state[p + key] * 1e6
            )
        mask = state[p + "throttle_reasons"]
        for reason, bit in THROTTLE_REASONS.items():
            assert native.value("gpubalance_gpu_throttle_reason", reason=reason, **ids) == (
                1 if mask & bit else 0
            ), reason
        pid = str(sleeper.pid)
        assert native.value("gpubalance_gpu_process_memory_used_bytes", pid=pid, **ids) == (
            (512 + i) * MIB
        )
        assert native.value("gpubalance_gpu_process_sm_utilization_ratio", pid=pid, **ids) == (
            approx((20 + i) / 100)
        )
        assert native.value(
            "gpubalance_gpu_process_memory_utilization_ratio", pid=pid, **ids
        ) == approx((10 + i) / 100)

        labels = {"gpu": str(i), "UUID": uuid}
        series = dcgm.find("DCGM_FI_DEV_GPU_TEMP", **labels)
        assert series and series[0][0] == {
            "gpu": str(i),
            "UUID": uuid,
            "pci_bus_id": state[p + "pci.bus_id"],
            "device": f"nvidia{i}",
            "modelName": state[p + "name"],
            "Hostname": series[0][0]["Hostname"],
            "DCGM_FI_DRIVER_VERSION": "550.54.14",
        }
        expected_dcgm = {
            "DCGM_FI_DEV_GPU_UTIL": state[p + "utilization.gpu"],
            "DCGM_FI_DEV_MEM_COPY_UTIL": state[p + "utilization.memory"],
            "DCGM_FI_DEV_ENC_UTIL": state[p + "utilization.encoder"],
            "DCGM_FI_DEV_DEC_UTIL": state[p + "utilization.decoder"],
            "DCGM_FI_DEV_FB_USED": used // MIB,
            "DCGM_FI_DEV_FB_RESERVED": reserved // MIB,
            "DCGM_FI_DEV_FB_FREE": (total - used - reserved) // MIB,
            "DCGM_FI_DEV_FB_TOTAL": total // MIB,
            "DCGM_FI_DEV_GPU_TEMP": state[p + "temp.gpu"],
            "DCGM_FI_DEV_POWER_USAGE": state[p + "power.usage"] / 1000,
            "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": state[p + "power.limit"] / 1000,
            "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": state[p + "energy"],
            "DCGM_FI_DEV_SM_CLOCK": state[p + "clock.sm"],
            "DCGM_FI_DEV_MEM_CLOCK": state[p + "clock.mem"],
            "DCGM_FI_DEV_MAX_SM_CLOCK": state[p + "clock.max.sm"],
            "DCGM_FI_DEV_MAX_MEM_CLOCK": state[p + "clock.max.mem"],
            "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": state[p + "pcie.replay_counter"],
            "DCGM_FI_PROF_PCIE_TX_BYTES": state[p + "pcie.tx"] * 1024,
            "DCGM_FI_PROF_PCIE_RX_BYTES": state[p + "pcie.rx"] * 1024,
            "DCGM_FI_DEV_FAN_SPEED": state[p + "fan.speed"],
            "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": mask,
            "DCGM_FI_DEV_XID_ERRORS": 0,
        }
        for name, value in expected_dcgm.items():
            assert dcgm.value(name, **labels) == approx(value), name
    assert native.value("gpubalance_gpu_memory_temperature_celsius", gpu="3") == 71
    assert dcgm.value("DCGM_FI_DEV_MEMORY_TEMP", gpu="3") == 71
    assert not dcgm.has("DCGM_FI_DEV_MEMORY_TEMP", gpu="2")  # unsupported: dropped, not NaN
    assert (
        native.value(
            "gpubalance_gpu_capability_supported", gpu="2", capability="memory_temperature"
        )
        == 0
    )
    assert native.value("gpubalance_nvml_up") == 1
    assert native.value("gpubalance_exporter_collector_success", collector="gpu") == 1


def test_concurrent_scrapers_add_no_nvml_calls(start_exporter, tmp_path: Path) -> None:
    counts = {}
    for scrapers in (0, 8):
        counts_path = tmp_path / f"counts-{scrapers}.txt"
        exporter = start_exporter(
            full_state(),
            *("--interval", "3600", "--window", "3600", "--trend-window", "3600"),
            env={"FAKE_NVML_COUNTS": str(counts_path)},
        )
        bodies: list[bytes] = []
        errors: list[BaseException] = []

        def scrape(exporter=exporter, bodies=bodies, errors=errors) -> None:
            try:
                for _ in range(25):
                    status, body = exporter.get("/metrics")
                    assert status == 200
                    bodies.append(body)
                    assert exporter.get("/api/v1/snapshot")[0] == 200
            except BaseException as exc:  # collected for the assertion below
                errors.append(exc)

        threads = [threading.Thread(target=scrape) for _ in range(scrapers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors
        assert len(set(bodies)) <= 1  # one sample, one rendering, whoever asks
        assert exporter.stop() == 0
        counts[scrapers] = counts_path.read_text()
    assert len(bodies) == 200
    assert counts[0] == counts[8], "scrapes must not reach NVML"
    assert "nvmlDeviceGetPowerUsage" in counts[0]


def test_lost_gpu_is_flagged_and_the_others_keep_updating(start_exporter) -> None:
    state = full_state(gpus=4)
    exporter = start_exporter(state)
    state["gpu2.lost"] = 1
    state["gpu0.temp.gpu"] = 91
    exporter.write(state)
    metrics = exporter.wait_for(
        lambda m: (
            m.value("gpubalance_gpu_lost", gpu="2") == 1
            and m.value("gpubalance_gpu_temperature_celsius", gpu="0") == 91
        )
    )
    assert not metrics.has("gpubalance_gpu_temperature_celsius", gpu="2")
    assert metrics.value("gpubalance_gpu_temperature_celsius", gpu="1") == 45
    # Later changes on the surviving GPUs still arrive; the exporter stays up.
    state["gpu1.temp.gpu"] = 77
    exporter.write(state)
    exporter.wait_for(lambda m: m.value("gpubalance_gpu_temperature_celsius", gpu="1") == 77)
    assert exporter.metrics("dcgm").has("DCGM_FI_DEV_GPU_TEMP", gpu="3")
    assert not exporter.metrics("dcgm").has("DCGM_FI_DEV_GPU_TEMP", gpu="2")
    assert exporter.process.poll() is None
    # Hot removal: the count drops, GPU 3 disappears and is flagged lost too.
    state["device_count"] = 3
    exporter.write(state)
    exporter.wait_for(lambda m: m.value("gpubalance_gpu_lost", gpu="3") == 1)


def test_nvml_init_failure_keeps_host_metrics_and_recovers(start_exporter, tmp_path) -> None:
    config = tmp_path / "gpubalance.yaml"
    config.write_text("exporter:\n  nvml_retry_max: 0.5\n")
    state = full_state(gpus=2)
    state["err.nvmlInitWithFlags"] = "DRIVER_NOT_LOADED"
    exporter = start_exporter(state, "--config", str(config))
    metrics = exporter.wait_for(lambda m: m.value("gpubalance_nvml_init_failures_total") >= 2)
    assert metrics.value("gpubalance_nvml_up") == 0
    assert metrics.value("gpubalance_exporter_collector_success", collector="gpu") == 0
    assert metrics.value("gpubalance_exporter_collector_success", collector="host") == 1
    assert metrics.has("gpubalance_host_cpu_seconds_total")
    assert not metrics.has("gpubalance_gpu_info")
    last_success = "gpubalance_exporter_collector_last_success_timestamp_seconds"
    assert not metrics.has(last_success, collector="gpu")  # never succeeded yet
    assert metrics.value(last_success, collector="host") > 0
    status, body = exporter.get("/healthz")
    health = json.loads(body)
    assert status == 200 and health["status"] == "degraded" and health["nvml_up"] is False
    assert "DRIVER_NOT_LOADED" in health["nvml_error"]
    assert health["problems"] == [f"NVML down: {health['nvml_error']}"]
    del state["err.nvmlInitWithFlags"]
    exporter.write(state)
    metrics = exporter.wait_for(lambda m: m.value("gpubalance_nvml_up") == 1)
    exporter.wait_for(lambda m: m.has("gpubalance_gpu_temperature_celsius", gpu="1"))


def test_missing_state_file_is_a_driver_not_loaded(start_exporter) -> None:
    exporter = start_exporter(None)  # no state file: like a host without the kernel module
    metrics = exporter.metrics()
    assert metrics.value("gpubalance_nvml_up") == 0
    assert "DRIVER_NOT_LOADED" in exporter.snapshot()["sample"]["nvml"]["error"]


def test_driver_lost_mid_run_is_reinitialised(start_exporter, tmp_path) -> None:
    config = tmp_path / "gpubalance.yaml"
    config.write_text("exporter:\n  nvml_retry_max: 0.5\n")
    state = full_state(gpus=2)
    exporter = start_exporter(state, "--config", str(config))
    state["err.nvmlDeviceGetCount_v2"] = "UNINITIALIZED"
    exporter.write(state)
    exporter.wait_for(lambda m: m.value("gpubalance_nvml_up") == 0)
    del state["err.nvmlDeviceGetCount_v2"]
    state["gpu0.temp.gpu"] = 66
    exporter.write(state)
    exporter.wait_for(
        lambda m: (
            m.value("gpubalance_nvml_up") == 1
            and m.value("gpubalance_gpu_temperature_celsius", gpu="0") == 66
        )
    )


def test_port_in_use_is_one_line_and_exit_2(fakenvml_env, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpubalance",
                "exporter",
                "--listen",
                f"127.0.0.1:{port}",
                "--otlp-listen",  # never OTLP's fixed 4318: tests run side by side
                "127.0.0.1:0",
                "--log-level",
                "error",
            ],
            env=fakenvml_env(tmp_path / "none"),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"gpubalance exporter: cannot listen on 127.0.0.1:{port}: address already in use"
    ]


def test_older_driver_degrades_only_what_it_lacks(start_exporter, tmp_path: Path) -> None:
    hidden = [
        "nvmlDeviceGetSamples",
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetTemperatureV",
        "nvmlDeviceGetMemoryInfo_v2",
        "nvmlDeviceGetCurrentClocksEventReasons",
    ]
    older = build_library(tmp_path / "older", hidden_symbols=hidden).parent
    state = full_state(gpus=2)
    exporter = start_exporter(state, env={"LD_LIBRARY_PATH": str(older)})
    m = exporter.metrics()
    ids = {"gpu": "1"}
    for capability in (
        "utilization_samples",
        "compute_processes",
        "temperature",
        "memory",
        "throttle_reasons",
    ):
        assert m.value("gpubalance_gpu_capability_supported", capability=capability, **ids) == 0
    for capability in (
        "temperature_v1",
        "memory_v1",
        "throttle_reasons_v1",
        "utilization",
        "power",
    ):
        assert m.value("gpubalance_gpu_capability_supported", capability=capability, **ids) == 1
    assert m.value("gpubalance_gpu_temperature_celsius", **ids) == 45
    assert m.value("gpubalance_gpu_utilization_ratio", **ids) == approx(0.21)
    # v1 memory counts the reserved memory as used and cannot tell it apart.
    assert m.value("gpubalance_gpu_memory_used_bytes", **ids) == (2000 + 301) * MIB
    assert not m.has("gpubalance_gpu_memory_reserved_bytes", **ids)
    assert m.value("gpubalance_gpu_throttle_reason", reason="sw_power_cap", **ids) == 1
    assert "nvmlDeviceGetSamples is missing" in exporter.log()


def test_nvml_library_flag_needs_no_loader_path(start_exporter, fakenvml_dir: Path) -> None:
    exporter = start_exporter(
        full_state(gpus=1),
        "--nvml-library",
        str(fakenvml_dir / "libnvidia-ml.so.1"),
        env={"LD_LIBRARY_PATH": ""},
    )
    assert exporter.metrics().value("gpubalance_gpu_temperature_celsius", gpu="0") == 40


def test_http_endpoints(start_exporter) -> None:
    exporter = start_exporter(full_state(gpus=2))
    status, body = exporter.get("/metrics", {"Accept-Encoding": "gzip"})
    assert status == 200 and b"gpubalance_gpu_info" in body
    assert exporter.get("/metrics?names=bogus")[0] == 400
    assert exporter.get("/api/v1/snapshot?history=x")[0] == 400
    assert exporter.get("/api/v1/snapshot?history=100000")[0] == 400
    both = exporter.metrics("both")
    assert both.has("DCGM_FI_DEV_GPU_TEMP") and both.has("gpubalance_gpu_temperature_celsius")
    assert b"/metrics" in exporter.get("/")[1]
    health = json.loads(exporter.get("/healthz")[1])
    assert health["status"] == "ok" and health["collectors"] == {
        "gpu": True,
        "host": True,
        "processes": True,
        "serving": True,
    }


def test_snapshot_follows_the_documented_schema(start_exporter) -> None:
    schema = json.loads((ROOT / "docs" / "snapshot.schema.json").read_text())
    exporter = start_exporter(full_state(gpus=2), "--interval", "0.1")
    exporter.wait_for(lambda m: m.value("gpubalance_exporter_samples_total") >= 5)
    _status, body = exporter.get("/api/v1/snapshot?history=3")
    snapshot = json.loads(body)
    jsonschema.validate(snapshot, schema)
    assert len(snapshot["history"]) == 3
    assert snapshot["schema"] == "gpubalance.snapshot/v1"
    gpu = snapshot["sample"]["gpus"][1]
    assert gpu["temperature_celsius"] == 45
    assert snapshot["window"]["gpus"][1]["utilization_ratio"] == approx(0.21)


def _threads(exporter) -> int:
    return len(os.listdir(f"/proc/{exporter.process.pid}/task"))


def test_slow_gpu_is_stale_and_the_others_keep_their_cadence(start_exporter) -> None:
    state = full_state(gpus=4)
    exporter = start_exporter(state, "--interval", "1", "--window", "3", "--trend-window", "10")
    uuid = state["gpu2.uuid"]
    # A card falling off the bus: every NVML call on it takes 1.5 s, a whole read ~40 s.
    state["gpu2.delay_us"] = 1_500_000
    exporter.write(state)
    metrics = exporter.wait_for(lambda m: m.value("gpubalance_gpu_sample_stale", gpu="2") == 1)
    [(labels, value)] = metrics.find("gpubalance_gpu_sample_stale", gpu="2")
    assert value == 1 and labels["call"].startswith("nvmlDevice"), labels
    assert not metrics.has("gpubalance_gpu_temperature_celsius", gpu="2")
    assert metrics.value("gpubalance_gpu_lost", gpu="2") == 0
    threads = _threads(exporter)
    first = metrics.value("gpubalance_exporter_samples_total")

    # The others keep their 1 s cadence and their changes arrive while GPU 2 is stuck.
    state["gpu0.temp.gpu"] = 88
    exporter.write(state)
    metrics = exporter.wait_for(
        lambda m: (
            m.value("gpubalance_gpu_temperature_celsius", gpu="0") == 88
            and m.value("gpubalance_exporter_samples_total") >= first + 4
        ),
        timeout=8,
    )
    snapshot = json.loads(exporter.get("/api/v1/snapshot?history=3")[1])
    samples = [*snapshot["history"], snapshot["sample"]]
    stamps = [s["timestamp_seconds"] for s in samples]
    assert all(0.5 < b - a < 1.5 for a, b in pairwise(stamps)), stamps
    for s in samples:
        gpus = s["gpus"]
        assert gpus[2]["stale"] and gpus[2]["temperature_celsius"] is None
        assert gpus[2]["stale_call"].startswith("nvmlDevice")
        assert all(not g["stale"] and g["temperature_celsius"] for g in gpus if g["index"] != 2)
    assert metrics.value("gpubalance_exporter_sample_overruns_total") == 0
    assert metrics.value("gpubalance_gpu_sample_stale", gpu="0") == 0
    assert _threads(exporter) == threads, "a stuck GPU must not cost a thread per sample"
    health = json.loads(exporter.get("/healthz")[1])
    assert health["status"] == "degraded" and health["gpus_stale"] == [2]
    assert f"GPU 2 ({uuid}) stale: stuck in nvmlDevice" in health["problems"][0]
    log = exporter.log()
    assert f"GPU 2 ({uuid}): no NVML reading within the 0.50 s deadline, stuck in nvmlDevice" in log

    # The card answers in time again: its readings come back and the log says so.
    del state["gpu2.delay_us"]
    exporter.write(state)
    metrics = exporter.wait_for(
        lambda m: (
            m.value("gpubalance_gpu_sample_stale", gpu="2") == 0
            and m.has("gpubalance_gpu_temperature_celsius", gpu="2")
        )
    )
    assert f"GPU 2 ({uuid}) recovered: NVML answered within the deadline" in exporter.log()
    assert json.loads(exporter.get("/healthz")[1])["status"] == "ok"


def test_nvml_down_keeps_the_known_gpus_as_lost_and_stale(start_exporter, tmp_path) -> None:
    config = tmp_path / "gpubalance.yaml"
    config.write_text("exporter:\n  nvml_retry_max: 0.5\n")
    state = full_state(gpus=2)
    exporter = start_exporter(state, "--config", str(config))
    state["err.nvmlDeviceGetCount_v2"] = "UNINITIALIZED"
    exporter.write(state)
    metrics = exporter.wait_for(lambda m: m.value("gpubalance_nvml_up") == 0)
    for gpu in ("0", "1"):
        assert metrics.value("gpubalance_gpu_lost", gpu=gpu) == 1
        assert metrics.value("gpubalance_gpu_sample_stale", gpu=gpu, call="nvmlInit") == 1
        assert metrics.has("gpubalance_gpu_info", gpu=gpu, uuid=state[f"gpu{gpu}.uuid"])
        assert not metrics.has("gpubalance_gpu_temperature_celsius", gpu=gpu)
    status, body = exporter.get("/healthz")
    health = json.loads(body)
    assert status == 200 and health["status"] == "degraded"
    assert health["problems"][0].startswith("NVML down: ")
    assert health["gpus_lost"] == [0, 1]
    del state["err.nvmlDeviceGetCount_v2"]
    exporter.write(state)
    exporter.wait_for(
        lambda m: (
            m.value("gpubalance_gpu_lost", gpu="1") == 0
            and m.value("gpubalance_gpu_sample_stale", gpu="1") == 0
            and m.has("gpubalance_gpu_temperature_celsius", gpu="1")
        )
    )
    assert f"GPU 1 ({state['gpu1.uuid']}) recovered" in exporter.log()


def test_lost_gpu_recheck_is_configured_and_recovery_logged(start_exporter, tmp_path) -> None:
    config = tmp_path / "gpubalance.yaml"
    config.write_text("exporter:\n  nvml_lost_recheck: 0.5\n")
    state = full_state(gpus=3)
    exporter = start_exporter(state, "--config", str(config))
    uuid = state["gpu1.uuid"]
    state["gpu1.lost"] = 1
    exporter.write(state)
    exporter.wait_for(lambda m: m.value("gpubalance_gpu_lost", gpu="1") == 1)
    status, body = exporter.get("/healthz")
    health = json.loads(body)
    assert status == 200 and health["status"] == "degraded"
    assert health["problems"] == [f"GPU 1 ({uuid}) lost"] and health["gpus_lost"] == [1]
    del state["gpu1.lost"]
    exporter.write(state)
    exporter.wait_for(
        lambda m: (
            m.value("gpubalance_gpu_lost", gpu="1") == 0
            and m.value("gpubalance_gpu_temperature_celsius", gpu="1") == 45
        )
    )
    assert f"GPU 1 ({uuid}) recovered: NVML answers for it again" in exporter.log()
    health = json.loads(exporter.get("/healthz")[1])
    assert health["status"] == "ok" and health["problems"] == []


def _exporter_once(env: dict[str, str], *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpubalance", "exporter", "--once", "--log-level", "error", *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _libc_path() -> str:
    """The C library this Python runs on, by absolute path: a real library, but not NVML."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith("libc.so"):
                return path
    raise AssertionError("no libc.so in /proc/self/maps")


def test_bad_paths_are_refused_at_start(fakenvml_env, tmp_path: Path) -> None:
    state = tmp_path / "state"
    write_state(state, full_state(gpus=1))
    env = fakenvml_env(state)
    missing = str(tmp_path / "nonexistent")
    libc = _libc_path()
    for flags, message in (
        (("--procfs", missing), f"--procfs {missing} does not exist"),
        (("--procfs", str(state)), f"--procfs {state} is not a directory"),
        (("--nvml-library", missing), f"--nvml-library: {missing} does not exist"),
        (("--nvml-library", libc), f"--nvml-library: {libc} is not an NVML library"),
    ):
        result = _exporter_once(env, *flags)
        assert result.returncode == 2, (flags, result.stderr)
        assert result.stderr.startswith(f"gpubalance exporter: {message}"), result.stderr
        assert result.stdout == ""
    # The procfs check belongs to the collectors that read it.
    result = _exporter_once(
        env, "--procfs", missing, "--no-collector.host", "--no-collector.processes"
    )
    assert result.returncode == 0, result.stderr


def test_once_fails_when_nvml_does_not_come_up(fakenvml_env, tmp_path: Path) -> None:
    result = _exporter_once(fakenvml_env(tmp_path / "none"))  # no driver
    assert result.returncode == 1
    assert "NVML did not come up: DRIVER_NOT_LOADED" in result.stderr
    metrics = Metrics.parse(result.stdout)  # the host part is still printed
    assert metrics.value("gpubalance_nvml_up") == 0
    assert metrics.has("gpubalance_host_cpu_seconds_total")
    result = _exporter_once(fakenvml_env(tmp_path / "none"), "--no-collector.gpu")
    assert result.returncode == 0, result.stderr

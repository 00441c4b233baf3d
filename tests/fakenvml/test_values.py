"""Every state value comes back through the real pynvml wrappers, on 8 GPUs."""

from __future__ import annotations

import ctypes
import os

import pynvml as N
import pytest

from gpubalance.lab.fakenvml import THROTTLE_REASONS

GiB = 1 << 30
MiB = 1 << 20


def full_state() -> dict[str, object]:
    state: dict[str, object] = {
        "device_count": 8,
        "driver_version": "550.54.14",
        "nvml_version": "12.550.54.14",
        "cuda_driver_version": 12040,
    }
    for i in range(8):
        g = f"gpu{i}."
        state |= {
            g + "name": f"NVIDIA RTX 6000 Ada Generation #{i}",
            g + "uuid": f"GPU-{i:08x}-1111-2222-3333-444444444444",
            g + "serial": f"13240230{i:05d}",
            g + "pci.bus_id": f"00000000:{0x18 + 0x10 * i:02X}:00.0",
            g + "pci.device_id": 0x26B110DE,
            g + "pci.subsystem_id": 0x16A110DE + i,
            g + "minor_number": 10 + i,
            g + "brand": 13,
            g + "architecture": 8,
            g + "cuda_cc": "8.9",
            g + "vbios_version": f"95.02.5E.00.0{i}",
            g + "utilization.gpu": 10 * i,
            g + "utilization.memory": 5 * i,
            g + "utilization.encoder": i,
            g + "utilization.decoder": 2 * i,
            g + "memory.total": 48 * GiB,
            g + "memory.used": i * GiB,
            g + "memory.reserved": 512 * MiB,
            g + "bar1.total": 64 * GiB,
            g + "bar1.used": (i + 1) * MiB,
            g + "temp.gpu": 40 + i,
            g + "temp.threshold.slowdown": 90 + i,
            g + "temp.threshold.shutdown": 95 + i,
            g + "power.usage": 100_000 + 1000 * i,
            g + "power.limit": 300_000 - 1000 * i,
            g + "power.management_limit": 290_000 + i,
            g + "power.default_limit": 300_000,
            g + "power.min_limit": 100_000 + i,
            g + "power.max_limit": 300_000 + i,
            g + "energy": 10**12 + i,
            g + "clock.graphics": 2000 + i,
            g + "clock.sm": 2010 + i,
            g + "clock.mem": 9000 + i,
            g + "clock.video": 1500 + i,
            g + "clock.max.graphics": 3000 + i,
            g + "clock.max.sm": 3010 + i,
            g + "clock.max.mem": 10_000 + i,
            g + "clock.max.video": 2500 + i,
            g + "throttle_reasons": THROTTLE_REASONS["sw_power_cap"] | (i << 5),
            g + "pcie.tx": 1000 * i,
            g + "pcie.rx": 2000 * i,
            g + "pcie.replay_counter": i,
            g + "pcie.link_gen": 4,
            g + "pcie.link_width": 8 if i % 2 else 16,
            g + "pcie.max_link_gen": 4,
            g + "pcie.max_link_width": 16,
            g + "fan.speed": 30 + i,
            g + "fan.count": 2,
            g + "pstate": i % 3,
            g + "persistence_mode": True,
            g + "display_active": i == 0,
            g + "display_mode": i % 2,
            g + "compute_mode": 3 if i == 7 else 0,
            g + "procs": [(1000 + i, (i + 1) * MiB), (2000 + i, 256 * MiB)],
            g + "graphics_procs": [(3000 + i, 64 * MiB)],
            g + "procs_util": [(1000 + i, 50 + i, 20, 1, 2), (2000 + i, 5, 1)],
        }
    return state


def handles() -> list[object]:
    return [N.nvmlDeviceGetHandleByIndex(i) for i in range(N.nvmlDeviceGetCount())]


def test_system_values(nvml):
    nvml.write(full_state())
    assert N.nvmlSystemGetDriverVersion() == "550.54.14"
    assert N.nvmlSystemGetNVMLVersion() == "12.550.54.14"
    assert N.nvmlSystemGetCudaDriverVersion() == 12040
    assert N.nvmlSystemGetCudaDriverVersion_v2() == 12040
    assert N.nvmlDeviceGetCount() == 8
    assert "python" in N.nvmlSystemGetProcessName(os.getpid())


def test_identity_values(nvml):
    nvml.write(full_state())
    for i, h in enumerate(handles()):
        assert N.nvmlDeviceGetIndex(h) == i
        assert N.nvmlDeviceGetName(h) == f"NVIDIA RTX 6000 Ada Generation #{i}"
        uuid = f"GPU-{i:08x}-1111-2222-3333-444444444444"
        assert N.nvmlDeviceGetUUID(h) == uuid
        assert N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByUUID(uuid)) == i
        assert N.nvmlDeviceGetSerial(h) == f"13240230{i:05d}"
        assert N.nvmlDeviceGetMinorNumber(h) == 10 + i
        assert N.nvmlDeviceGetBrand(h) == N.NVML_BRAND_NVIDIA_RTX
        assert N.nvmlDeviceGetArchitecture(h) == N.NVML_DEVICE_ARCH_ADA
        assert N.nvmlDeviceGetCudaComputeCapability(h) == (8, 9)
        assert N.nvmlDeviceGetVbiosVersion(h) == f"95.02.5E.00.0{i}"
        pci = N.nvmlDeviceGetPciInfo(h)
        bus = 0x18 + 0x10 * i
        assert pci.busId == f"00000000:{bus:02X}:00.0"
        assert pci.busIdLegacy == f"0000:{bus:02X}:00.0"
        assert (pci.domain, pci.bus, pci.device) == (0, bus, 0)
        assert (pci.pciDeviceId, pci.pciSubSystemId) == (0x26B110DE, 0x16A110DE + i)
        by_bus = N.nvmlDeviceGetHandleByPciBusId(f"0000:{bus:02x}:00.0")
        assert N.nvmlDeviceGetIndex(by_bus) == i


def test_utilization_memory_thermal_power(nvml):
    nvml.write(full_state())
    for i, h in enumerate(handles()):
        util = N.nvmlDeviceGetUtilizationRates(h)
        assert (util.gpu, util.memory) == (10 * i, 5 * i)
        assert N.nvmlDeviceGetEncoderUtilization(h) == [i, 166667]
        assert N.nvmlDeviceGetDecoderUtilization(h) == [2 * i, 166667]

        v1 = N.nvmlDeviceGetMemoryInfo(h)
        v2 = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
        used, reserved, total = i * GiB, 512 * MiB, 48 * GiB
        assert (v2.total, v2.used, v2.reserved, v2.free) == (
            total,
            used,
            reserved,
            total - used - reserved,
        )
        # v1 "used" includes what the driver reserves
        assert (v1.total, v1.used, v1.free) == (total, used + reserved, total - used - reserved)
        assert v1.total == v1.used + v1.free
        bar1 = N.nvmlDeviceGetBAR1MemoryInfo(h)
        assert (bar1.bar1Total, bar1.bar1Used, bar1.bar1Free) == (
            64 * GiB,
            (i + 1) * MiB,
            64 * GiB - (i + 1) * MiB,
        )

        assert N.nvmlDeviceGetTemperature(h, N.NVML_TEMPERATURE_GPU) == 40 + i
        assert N.nvmlDeviceGetTemperatureV(h, N.NVML_TEMPERATURE_GPU) == 40 + i
        slowdown = N.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
        assert N.nvmlDeviceGetTemperatureThreshold(h, slowdown) == 90 + i
        shutdown = N.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN
        assert N.nvmlDeviceGetTemperatureThreshold(h, shutdown) == 95 + i
        with pytest.raises(N.NVMLError_NotSupported):
            N.nvmlDeviceGetTemperatureThreshold(h, N.NVML_TEMPERATURE_THRESHOLD_MEM_MAX)

        assert N.nvmlDeviceGetPowerUsage(h) == 100_000 + 1000 * i
        assert N.nvmlDeviceGetEnforcedPowerLimit(h) == 300_000 - 1000 * i
        assert N.nvmlDeviceGetPowerManagementLimit(h) == 290_000 + i
        assert N.nvmlDeviceGetPowerManagementDefaultLimit(h) == 300_000
        constraints = N.nvmlDeviceGetPowerManagementLimitConstraints(h)
        assert constraints == [100_000 + i, 300_000 + i]
        assert N.nvmlDeviceGetTotalEnergyConsumption(h) == 10**12 + i


def test_clocks_pcie_fans_modes(nvml):
    nvml.write(full_state())
    for i, h in enumerate(handles()):
        clocks = [N.NVML_CLOCK_GRAPHICS, N.NVML_CLOCK_SM, N.NVML_CLOCK_MEM, N.NVML_CLOCK_VIDEO]
        assert [N.nvmlDeviceGetClockInfo(h, c) for c in clocks] == [
            2000 + i,
            2010 + i,
            9000 + i,
            1500 + i,
        ]
        assert [N.nvmlDeviceGetMaxClockInfo(h, c) for c in clocks] == [
            3000 + i,
            3010 + i,
            10_000 + i,
            2500 + i,
        ]
        reasons = 0x4 | (i << 5)
        assert N.nvmlDeviceGetCurrentClocksThrottleReasons(h) == reasons
        assert N.nvmlDeviceGetCurrentClocksEventReasons(h) == reasons

        assert N.nvmlDeviceGetPcieThroughput(h, N.NVML_PCIE_UTIL_TX_BYTES) == 1000 * i
        assert N.nvmlDeviceGetPcieThroughput(h, N.NVML_PCIE_UTIL_RX_BYTES) == 2000 * i
        assert N.nvmlDeviceGetPcieReplayCounter(h) == i
        assert N.nvmlDeviceGetCurrPcieLinkGeneration(h) == 4
        assert N.nvmlDeviceGetCurrPcieLinkWidth(h) == (8 if i % 2 else 16)
        assert N.nvmlDeviceGetMaxPcieLinkGeneration(h) == 4
        assert N.nvmlDeviceGetMaxPcieLinkWidth(h) == 16

        assert N.nvmlDeviceGetFanSpeed(h) == 30 + i
        assert N.nvmlDeviceGetNumFans(h) == 2
        assert N.nvmlDeviceGetFanSpeed_v2(h, 1) == 30 + i
        with pytest.raises(N.NVMLError_InvalidArgument):
            N.nvmlDeviceGetFanSpeed_v2(h, 2)

        assert N.nvmlDeviceGetPerformanceState(h) == i % 3
        assert N.nvmlDeviceGetPersistenceMode(h) == N.NVML_FEATURE_ENABLED
        assert N.nvmlDeviceGetDisplayActive(h) == int(i == 0)
        assert N.nvmlDeviceGetDisplayMode(h) == i % 2
        assert N.nvmlDeviceGetComputeMode(h) == (3 if i == 7 else 0)


def test_process_lists(nvml):
    nvml.write(full_state())
    for i, h in enumerate(handles()):
        compute = N.nvmlDeviceGetComputeRunningProcesses(h)
        assert [(p.pid, p.usedGpuMemory) for p in compute] == [
            (1000 + i, (i + 1) * MiB),
            (2000 + i, 256 * MiB),
        ]
        assert {(p.gpuInstanceId, p.computeInstanceId) for p in compute} == {
            (0xFFFFFFFF, 0xFFFFFFFF)
        }
        graphics = N.nvmlDeviceGetGraphicsRunningProcesses(h)
        assert [(p.pid, p.usedGpuMemory) for p in graphics] == [(3000 + i, 64 * MiB)]
        assert N.nvmlDeviceGetMPSComputeRunningProcesses(h) == []
        # the older entry points share the data; v1 has the 16-byte struct
        assert [p.pid for p in N.nvmlDeviceGetComputeRunningProcesses_v2(h)] == [1000 + i, 2000 + i]

        detail = N.nvmlDeviceGetRunningProcessDetailList(
            h, N.nvmlProcessDetailList_v1, N.NVML_PROCESS_MODE_COMPUTE
        )
        assert [(p.pid, p.usedGpuMemory) for p in detail] == [
            (1000 + i, (i + 1) * MiB),
            (2000 + i, 256 * MiB),
        ]
        graphics_detail = N.nvmlDeviceGetRunningProcessDetailList(
            h, N.nvmlProcessDetailList_v1, N.NVML_PROCESS_MODE_GRAPHICS
        )
        assert [p.pid for p in graphics_detail] == [3000 + i]

        samples = N.nvmlDeviceGetProcessUtilization(h, 0)
        assert [(s.pid, s.smUtil, s.memUtil, s.encUtil, s.decUtil) for s in samples] == [
            (1000 + i, 50 + i, 20, 1, 2),
            (2000 + i, 5, 1, 0, 0),
        ]
        assert len({s.timeStamp for s in samples}) == 1


def test_v1_process_struct_and_size_protocol(nvml):
    nvml.write({"device_count": 1, "gpu0.procs": [(11, 5 * MiB), 12]})
    h = N.nvmlDeviceGetHandleByIndex(0)
    count = ctypes.c_uint(0)
    assert nvml.lib.nvmlDeviceGetComputeRunningProcesses(h, ctypes.byref(count), None) == (
        N.NVML_ERROR_INSUFFICIENT_SIZE
    )
    assert count.value == 2
    count.value = 1
    buf = (ctypes.c_uint64 * 4)()  # two 16-byte entries: pid, padding, used
    assert nvml.lib.nvmlDeviceGetComputeRunningProcesses(h, ctypes.byref(count), buf) == (
        N.NVML_ERROR_INSUFFICIENT_SIZE
    )
    count.value = 2
    assert nvml.lib.nvmlDeviceGetComputeRunningProcesses(h, ctypes.byref(count), buf) == 0
    assert [buf[0] & 0xFFFFFFFF, buf[1], buf[2] & 0xFFFFFFFF, buf[3]] == [
        11,
        5 * MiB,
        12,
        0xFFFFFFFFFFFFFFFF,  # a bare pid means "not available"
    ]
    # pynvml turns "not available" into None
    assert [p.usedGpuMemory for p in N.nvmlDeviceGetComputeRunningProcesses(h)] == [5 * MiB, None]


def test_defaults_of_a_device_count_only_state(nvml):
    hs = handles()
    assert len(hs) == 8
    assert {N.nvmlDeviceGetName(h) for h in hs} == {"NVIDIA GeForce RTX 4090"}
    uuids = [N.nvmlDeviceGetUUID(h) for h in hs]
    assert len(set(uuids)) == 8
    assert all(u.startswith("GPU-") and len(u) == 40 for u in uuids)
    bus_ids = [N.nvmlDeviceGetPciInfo(h).busId for h in hs]
    assert len(set(bus_ids)) == 8
    assert bus_ids[0] == "00000000:01:00.0"
    assert N.nvmlDeviceGetComputeRunningProcesses(hs[0]) == []
    with pytest.raises(N.NVMLError_NotFound):
        N.nvmlDeviceGetProcessUtilization(hs[0], 0)
    # GeForce answers
    with pytest.raises(N.NVMLError_NotSupported):
        N.nvmlDeviceGetTotalEccErrors(hs[0], 0, 0)
    with pytest.raises(N.NVMLError_NotSupported):
        N.nvmlDeviceGetRemappedRows(hs[0])
    with pytest.raises(N.NVMLError_NotSupported):
        N.nvmlDeviceGetDriverModel(hs[0])
    with pytest.raises(N.NVMLError_NotSupported):
        N.nvmlDeviceGetMigMode(hs[0])
    with pytest.raises(N.NVMLError_NotSupported):
        N.nvmlDeviceGetConfComputeMemSizeInfo(hs[0])
    assert N.nvmlDeviceIsMigDeviceHandle(hs[0]).value == 0
    # power.management_limit follows power.limit unless set
    nvml.write({"device_count": 1, "gpu0.power.limit": 250_000})
    assert N.nvmlDeviceGetPowerManagementLimit(hs[0]) == 250_000


def test_gpu_star_defaults_and_per_gpu_overrides(nvml):
    # file order does not matter: gpuN beats gpu* wherever it stands
    nvml.write({"gpu3.temp.gpu": 83, "gpu*.temp.gpu": 50, "device_count": 4})
    assert [N.nvmlDeviceGetTemperature(h, 0) for h in handles()] == [50, 50, 50, 83]


def test_ecc_and_remapped_rows(nvml):
    nvml.write(
        {
            "device_count": 2,
            "gpu1.ecc.supported": 1,
            "gpu1.ecc.corrected.volatile": 3,
            "gpu1.ecc.corrected.aggregate": 30,
            "gpu1.ecc.uncorrected.volatile": 1,
            "gpu1.ecc.uncorrected.aggregate": 10,
            "gpu1.remapped_rows": (4, 1, 1, 0),
        }
    )
    h = N.nvmlDeviceGetHandleByIndex(1)
    corrected, uncorrected = (
        N.NVML_MEMORY_ERROR_TYPE_CORRECTED,
        N.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
    )
    volatile, aggregate = N.NVML_VOLATILE_ECC, N.NVML_AGGREGATE_ECC
    assert N.nvmlDeviceGetTotalEccErrors(h, corrected, volatile) == 3
    assert N.nvmlDeviceGetTotalEccErrors(h, corrected, aggregate) == 30
    assert N.nvmlDeviceGetTotalEccErrors(h, uncorrected, volatile) == 1
    assert N.nvmlDeviceGetTotalEccErrors(h, uncorrected, aggregate) == 10
    assert N.nvmlDeviceGetRemappedRows(h) == (4, 1, 1, 0)
    with pytest.raises(N.NVMLError_NotSupported):
        N.nvmlDeviceGetRemappedRows(N.nvmlDeviceGetHandleByIndex(0))


def test_field_values_with_per_entry_errors(nvml):
    nvml.write(
        {
            "device_count": 2,
            "gpu0.field.91": 4,
            "gpu0.field.200.1": 3.5,
            "gpu0.field.201": -7,
            "gpu0.field.202": "NO_PERMISSION",
        }
    )
    h = N.nvmlDeviceGetHandleByIndex(0)
    values = N.nvmlDeviceGetFieldValues(h, [91, (200, 1), (200, 2), 201, 202, 999])
    got = [(v.fieldId, v.scopeId, v.nvmlReturn, v.valueType) for v in values]
    assert got == [
        (91, 0, 0, N.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG),
        (200, 1, 0, N.NVML_VALUE_TYPE_DOUBLE),
        (200, 2, N.NVML_ERROR_NOT_SUPPORTED, 0),  # only scope 1 is set
        (201, 0, 0, N.NVML_VALUE_TYPE_SIGNED_LONG_LONG),
        (202, 0, N.NVML_ERROR_NO_PERMISSION, 0),
        (999, 0, N.NVML_ERROR_NOT_SUPPORTED, 0),
    ]
    assert values[0].value.ullVal == 4
    assert values[1].value.dVal == 3.5
    assert values[3].value.sllVal == -7
    assert all(v.timestamp > 0 for v in values)
    other = N.nvmlDeviceGetFieldValues(N.nvmlDeviceGetHandleByIndex(1), [91])
    assert other[0].nvmlReturn == N.NVML_ERROR_NOT_SUPPORTED


def test_values_follow_the_file_without_reinit(nvml):
    h = N.nvmlDeviceGetHandleByIndex(2)
    for temp in (41, 77, 42, 90, 43):
        nvml.write({"device_count": 8, "gpu2.temp.gpu": temp, "gpu2.procs": [(temp, temp * MiB)]})
        assert N.nvmlDeviceGetTemperature(h, 0) == temp
        assert [p.pid for p in N.nvmlDeviceGetComputeRunningProcesses(h)] == [temp]


def test_vanished_state_file_keeps_the_last_state(nvml):
    nvml.write({"device_count": 3, "gpu0.temp.gpu": 66})
    assert N.nvmlDeviceGetCount() == 3
    nvml.state_path.unlink()
    assert N.nvmlDeviceGetCount() == 3
    assert N.nvmlDeviceGetTemperature(N.nvmlDeviceGetHandleByIndex(0), 0) == 66


def test_call_count_hooks(nvml):
    count = nvml.lib.fakeNvmlCallCount
    count.restype = ctypes.c_ulonglong
    count.argtypes = [ctypes.c_char_p]
    nvml.lib.fakeNvmlResetCallCounts()
    h = N.nvmlDeviceGetHandleByIndex(0)
    N.nvmlDeviceGetPowerUsage(h)
    N.nvmlDeviceGetPowerUsage(h)
    nvml.write({"device_count": 1, "gpu0.procs": [(5, 1)]})
    N.nvmlDeviceGetComputeRunningProcesses(h)
    assert count(b"nvmlDeviceGetPowerUsage") == 2
    assert count(b"nvmlDeviceGetComputeRunningProcesses_v3") == 2  # size probe, then fill
    assert count(b"nvmlDeviceGetHandleByIndex_v2") == 1
    assert count(None) == 5
    assert count(b"noSuchFunction") == 0

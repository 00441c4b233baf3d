"""Faults are data: injected errors, lost and removed GPUs, init failures, delays."""

from __future__ import annotations

import ctypes
import threading
import time
from pathlib import Path

import pynvml as N
import pytest


def test_not_supported_on_one_gpu_while_others_work(nvml):
    nvml.write({"device_count": 8, "gpu2.err.nvmlDeviceGetFanSpeed": "NOT_SUPPORTED"})
    for i in range(8):
        h = N.nvmlDeviceGetHandleByIndex(i)
        if i == 2:
            with pytest.raises(N.NVMLError_NotSupported) as err:
                N.nvmlDeviceGetFanSpeed(h)
            assert err.value.value == 3
            assert str(err.value) == "Not Supported"
            assert N.nvmlDeviceGetPowerUsage(h) == 30_000  # only that function fails
        else:
            assert N.nvmlDeviceGetFanSpeed(h) == 30


def test_global_injection_hits_every_gpu(nvml):
    nvml.write({"device_count": 4, "err.nvmlDeviceGetPowerUsage": 999})
    for i in range(4):
        with pytest.raises(N.NVMLError_Unknown):
            N.nvmlDeviceGetPowerUsage(N.nvmlDeviceGetHandleByIndex(i))
    nvml.write({"device_count": 4, "err.nvmlSystemGetDriverVersion": "NVML_ERROR_NO_PERMISSION"})
    with pytest.raises(N.NVMLError_NoPermission):
        N.nvmlSystemGetDriverVersion()


def test_gpu_lost_from_old_handle_and_from_get_handle(nvml):
    h = N.nvmlDeviceGetHandleByIndex(3)
    nvml.write({"device_count": 8, "gpu3.lost": 1})
    with pytest.raises(N.NVMLError_GpuIsLost):
        N.nvmlDeviceGetPowerUsage(h)
    with pytest.raises(N.NVMLError_GpuIsLost):
        N.nvmlDeviceGetHandleByIndex(3)
    assert N.nvmlDeviceGetCount() == 8  # a lost GPU is still counted
    assert N.nvmlDeviceGetPowerUsage(N.nvmlDeviceGetHandleByIndex(4)) == 30_000
    nvml.write({"device_count": 8})
    assert N.nvmlDeviceGetPowerUsage(h) == 30_000  # the handle works again


def test_hot_removal_via_device_count(nvml):
    h7 = N.nvmlDeviceGetHandleByIndex(7)
    nvml.write({"device_count": 4})
    assert N.nvmlDeviceGetCount() == 4
    with pytest.raises(N.NVMLError_GpuIsLost):
        N.nvmlDeviceGetTemperature(h7, 0)
    with pytest.raises(N.NVMLError_InvalidArgument):
        N.nvmlDeviceGetHandleByIndex(7)


def test_invalid_arguments(nvml):
    with pytest.raises(N.NVMLError_InvalidArgument):
        N.nvmlDeviceGetHandleByIndex(8)
    foreign = ctypes.cast(ctypes.create_string_buffer(64), N.c_nvmlDevice_t)
    with pytest.raises(N.NVMLError_InvalidArgument):
        N.nvmlDeviceGetPowerUsage(foreign)
    with pytest.raises(N.NVMLError_NotFound):
        N.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
    h = N.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(N.NVMLError_InvalidArgument):
        N.nvmlDeviceGetClockInfo(h, 7)


def test_short_string_buffer_is_insufficient_size(nvml):
    h = N.nvmlDeviceGetHandleByIndex(0)
    buf = ctypes.create_string_buffer(96)
    assert nvml.lib.nvmlDeviceGetName(h, buf, ctypes.c_uint(8)) == N.NVML_ERROR_INSUFFICIENT_SIZE
    name = "NVIDIA GeForce RTX 4090"
    assert nvml.lib.nvmlDeviceGetName(h, buf, ctypes.c_uint(len(name))) == 7  # no room for NUL
    assert nvml.lib.nvmlDeviceGetName(h, buf, ctypes.c_uint(len(name) + 1)) == 0
    assert buf.value == name.encode()


def test_versioned_structs_check_their_version(nvml):
    h = N.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(N.NVMLError_ArgumentVersionMismatch):
        N.nvmlDeviceGetMemoryInfo(h, version=0x01000028)
    temp = N.c_nvmlTemperature_v1_t()
    temp.version = 0x0100000B
    assert nvml.lib.nvmlDeviceGetTemperatureV(h, ctypes.byref(temp)) == 25
    with pytest.raises(N.NVMLError_ArgumentVersionMismatch):
        N.nvmlDeviceGetRunningProcessDetailList(h, 0x01000020, 0)


def test_uninitialized_after_shutdown(nvml):
    h = N.nvmlDeviceGetHandleByIndex(0)
    N.nvmlShutdown()
    with pytest.raises(N.NVMLError_Uninitialized):
        N.nvmlDeviceGetCount()
    with pytest.raises(N.NVMLError_Uninitialized):
        N.nvmlDeviceGetPowerUsage(h)
    with pytest.raises(N.NVMLError_Uninitialized):
        N.nvmlShutdown()


def test_init_and_shutdown_are_reference_counted(nvml):
    N.nvmlInit()
    N.nvmlShutdown()
    assert N.nvmlDeviceGetCount() == 8  # one reference left, the fixture's


def test_init_failure_injection(nvml, monkeypatch):
    N.nvmlShutdown()
    nvml.write({"device_count": 8, "err.nvmlInitWithFlags": "LIB_RM_VERSION_MISMATCH"})
    with pytest.raises(N.NVMLError_LibRmVersionMismatch):
        N.nvmlInit()
    with pytest.raises(N.NVMLError_Uninitialized):
        N.nvmlDeviceGetCount()
    nvml.write({"device_count": 8})
    N.nvmlInit()
    assert N.nvmlDeviceGetCount() == 8


def test_missing_or_unreadable_state_is_driver_not_loaded(nvml, monkeypatch, tmp_path):
    N.nvmlShutdown()
    monkeypatch.setenv("FAKE_NVML_STATE", str(tmp_path / "missing"))
    with pytest.raises(N.NVMLError_DriverNotLoaded):
        N.nvmlInit()
    monkeypatch.setenv("FAKE_NVML_STATE", str(tmp_path))  # a directory cannot be read
    with pytest.raises(N.NVMLError_DriverNotLoaded):
        N.nvmlInit()
    monkeypatch.delenv("FAKE_NVML_STATE")
    with pytest.raises(N.NVMLError_DriverNotLoaded):
        N.nvmlInit()
    monkeypatch.setenv("FAKE_NVML_STATE", str(nvml.state_path))
    N.nvmlInit()


@pytest.mark.timing
def test_delay_on_one_gpu_leaves_the_others_fast(nvml):
    # long enough that this thread, however starved, makes its calls within it
    nvml.write({"device_count": 2, "gpu1.delay_us": 2_000_000})
    slow_handle, fast_handle = N.nvmlDeviceGetHandleByIndex(1), N.nvmlDeviceGetHandleByIndex(0)
    slow_took: list[float] = []

    def slow_call() -> None:
        start = time.monotonic()
        N.nvmlDeviceGetPowerUsage(slow_handle)
        slow_took.append(time.monotonic() - start)

    thread = threading.Thread(target=slow_call)
    thread.start()
    deadline = time.monotonic() + 10
    while not in_nanosleep(thread):  # the slow call has reached its delay
        assert thread.is_alive() and time.monotonic() < deadline, "the slow call never slept"
        time.sleep(0.001)
    for _ in range(100):
        N.nvmlDeviceGetPowerUsage(fast_handle)
    assert in_nanosleep(thread), "the fast calls waited for the slow GPU"
    thread.join()
    assert slow_took[0] >= 2.0


def in_nanosleep(thread: threading.Thread) -> bool:
    """The kernel has the thread waiting in nanosleep(2) (its wait channel)."""
    return "nanosleep" in Path(f"/proc/self/task/{thread.native_id}/wchan").read_text()


def test_unknown_key_warns_once(nvml, capfd):
    state = {"device_count": 2, "gpu0.temp.gpuu": 1, "gpu*.powr.usage": 2, "bogus_global": 3}
    for temp in (40, 41, 42):
        nvml.write({**state, "gpu1.temp.gpu": temp})
        assert N.nvmlDeviceGetTemperature(N.nvmlDeviceGetHandleByIndex(1), 0) == temp
    err = capfd.readouterr().err
    for key in ("gpu0.temp.gpuu", "gpu*.powr.usage", "bogus_global"):
        assert err.count(f"fake-nvml: unknown state key '{key}'") == 1, err


def test_bad_value_warns_and_keeps_the_default(nvml, capfd):
    nvml.write({"device_count": 1, "gpu0.temp.gpu": "hot", "gpu0.fan.speed": 55})
    h = N.nvmlDeviceGetHandleByIndex(0)
    assert N.nvmlDeviceGetTemperature(h, 0) == 35
    assert N.nvmlDeviceGetFanSpeed(h) == 55
    assert "fake-nvml: bad value for state key 'gpu0.temp.gpu': 'hot'" in capfd.readouterr().err


def test_out_of_range_values_are_refused(nvml, capfd):
    nvml.write({"device_count": 65, "gpu0.sample_period_us": 0, "gpu0.procs": "1:2,x:3"})
    assert N.nvmlDeviceGetCount() == 1  # the default
    h = N.nvmlDeviceGetHandleByIndex(0)
    assert N.nvmlDeviceGetComputeRunningProcesses(h) == []
    _, samples = N.nvmlDeviceGetSamples(h, N.NVML_GPU_UTILIZATION_SAMPLES, 0)
    assert samples
    err = capfd.readouterr().err
    for key in ("device_count", "gpu0.sample_period_us", "gpu0.procs"):
        assert f"bad value for state key '{key}'" in err


def test_malformed_line_warns_and_the_rest_loads(nvml, capfd):
    nvml.state_path.write_text("device_count = 2\nno equals sign here\ngpu1.temp.gpu = 61\n")
    assert N.nvmlDeviceGetTemperature(N.nvmlDeviceGetHandleByIndex(1), 0) == 61
    assert "fake-nvml: malformed state line 'no equals sign here'" in capfd.readouterr().err

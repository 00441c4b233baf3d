"""Behaviour that needs a process of its own: older-driver builds, exit hooks, fork."""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
import time

import pynvml as N
import pytest

from gpubalance.lab.fakenvml import build_library, render_state, write_state

# What an R470-era driver lacks from the fake's set: _v3 process lists,
# memory v2, TemperatureV and everything newer. Hiding the whole generation
# keeps the set coherent, so peer tools fall back instead of misreading.
OLDER_DRIVER_HIDDEN = (
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetGraphicsRunningProcesses_v3",
    "nvmlDeviceGetMPSComputeRunningProcesses_v3",
    "nvmlDeviceGetRunningProcessDetailList",
    "nvmlDeviceGetConfComputeMemSizeInfo",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetTemperatureV",
    "nvmlDeviceGetDriverModel_v2",
    "nvmlDeviceGetCurrentClocksEventReasons",
)

OLDER_DRIVER_PROBE = """
import json, pynvml as N
from nvitop import Device
N.nvmlInit()
h = N.nvmlDeviceGetHandleByIndex(0)
out = {"v1_used": N.nvmlDeviceGetMemoryInfo(h).used}
try:
    N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
except N.NVMLError_FunctionNotFound:
    out["v2"] = "FunctionNotFound"
try:
    N.nvmlDeviceGetComputeRunningProcesses(h)
except N.NVMLLibraryMismatchError:
    out["procs"] = "NVMLLibraryMismatchError"
out["procs_v2"] = [p.pid for p in N.nvmlDeviceGetComputeRunningProcesses_v2(h)]
N.nvmlShutdown()
out["nvitop_pids"] = sorted(Device(0).processes())
out["nvitop_temperature"] = Device(0).temperature()
print(json.dumps(out))
"""


def test_older_driver_variant(tmp_path_factory, tmp_path, run_python, sleepers, fakenvml_env):
    older = build_library(
        tmp_path_factory.mktemp("older-driver"), hidden_symbols=OLDER_DRIVER_HIDDEN, optimize=False
    )
    state = tmp_path / "state"
    write_state(
        state,
        {
            "device_count": 2,
            "gpu0.memory.used": 1 << 30,
            "gpu0.memory.reserved": 1 << 28,
            "gpu0.temp.gpu": 71,
            "gpu0.procs": [(sleepers[0], 1 << 28), (sleepers[1], 1 << 28)],
        },
    )
    env = fakenvml_env(state) | {"LD_LIBRARY_PATH": str(older.parent)}
    out = run_python(OLDER_DRIVER_PROBE, env)
    assert out["v1_used"] == (1 << 30) + (1 << 28)
    assert out["v2"] == "FunctionNotFound"
    assert out["procs"] == "NVMLLibraryMismatchError"  # not an NVMLError
    assert out["procs_v2"] == sleepers[:2]
    # nvitop falls back to TemperatureV's predecessor and to the _v2 list
    assert out["nvitop_temperature"] == 71
    assert out["nvitop_pids"] == sorted(sleepers[:2])


def test_call_counts_are_written_at_exit(tmp_path, run_python, fakenvml_env):
    state, counts = tmp_path / "state", tmp_path / "counts"
    write_state(state, {"device_count": 2})
    code = (
        "import json, pynvml as N\n"
        "N.nvmlInit()\n"
        "for i in range(2): N.nvmlDeviceGetPowerUsage(N.nvmlDeviceGetHandleByIndex(i))\n"
        "N.nvmlShutdown()\n"
        "print(json.dumps([]))\n"
    )
    run_python(code, fakenvml_env(state) | {"FAKE_NVML_COUNTS": str(counts)})
    lines = dict(line.split() for line in counts.read_text().splitlines())
    assert lines == {
        "nvmlInitWithFlags": "1",
        "nvmlShutdown": "1",
        "nvmlDeviceGetHandleByIndex_v2": "2",
        "nvmlDeviceGetPowerUsage": "2",
    }


@pytest.mark.timing
def test_fork_while_other_threads_are_inside_calls(nvml):
    # Reparsing a large state holds the lock for about a millisecond; a
    # rewriter keeps forcing reparses while callers hammer the library and the
    # main thread forks. Without the atfork handler some children inherit a
    # held lock and hang (about half the forks here when it was left out).
    big = {"device_count": 64} | {f"gpu{i}.field.{f}": f for i in range(64) for f in range(40)}
    # two sizes, so every replacement differs in stat identity; prerendered,
    # so that writing costs less than parsing
    texts = [render_state({**big, "gpu0.temp.gpu": t}).encode() for t in (30, 100)]
    nvml.write(big)
    lib, path = nvml.lib, nvml.state_path
    handle = N.nvmlDeviceGetHandleByIndex(0)
    stop = threading.Event()

    def rewrite() -> None:
        for n in itertools.count():
            if stop.is_set():
                return
            tmp = path.with_name(f"{path.name}.{n % 2}")
            tmp.write_bytes(texts[n % 2])
            os.replace(tmp, path)

    def call() -> None:
        value = ctypes.c_uint()
        while not stop.is_set():
            lib.nvmlDeviceGetPowerUsage(handle, ctypes.byref(value))

    threads = [threading.Thread(target=rewrite)] + [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        hung = 0
        for _ in range(20):
            time.sleep(0.002)
            pid = os.fork()
            if pid == 0:
                count = ctypes.c_uint()
                os._exit(lib.nvmlDeviceGetCount_v2(ctypes.byref(count)))
            deadline = time.monotonic() + 10  # a child that hangs never exits
            while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
                time.sleep(0.001)
            if done[0] == 0:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                hung += 1
            else:
                assert os.waitstatus_to_exitcode(done[1]) == 0
        assert hung == 0
    finally:
        stop.set()
        for t in threads:
            t.join()

"""Compile the fake NVML driver (`fakenvml.c`, shipped next to this module) with gcc."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

LIBRARY_NAME = "libnvidia-ml.so.1"

# The NVML entry points the library exports, in the order of fakenvml.c's
# FAKE_NVML_FUNCTIONS list; tests compare this tuple with the built library's
# dynamic symbol table, so the set cannot drift silently. The set is one
# driver generation's: hiding or adding a symbol changes how clients read
# structs (nvitop picks its process struct from which symbols exist).
EXPORTED_SYMBOLS: tuple[str, ...] = (
    "nvmlInit",
    "nvmlInit_v2",
    "nvmlInitWithFlags",
    "nvmlShutdown",
    "nvmlErrorString",
    "nvmlSystemGetDriverVersion",
    "nvmlSystemGetNVMLVersion",
    "nvmlSystemGetCudaDriverVersion",
    "nvmlSystemGetCudaDriverVersion_v2",
    "nvmlSystemGetProcessName",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetCount_v2",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetHandleByUUID",
    "nvmlDeviceGetHandleByPciBusId",
    "nvmlDeviceGetHandleByPciBusId_v2",
    "nvmlDeviceGetIndex",
    "nvmlDeviceGetMinorNumber",
    "nvmlDeviceGetName",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetSerial",
    "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetBrand",
    "nvmlDeviceGetArchitecture",
    "nvmlDeviceGetCudaComputeCapability",
    "nvmlDeviceGetVbiosVersion",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetEncoderUtilization",
    "nvmlDeviceGetDecoderUtilization",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetBAR1MemoryInfo",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetTemperatureV",
    "nvmlDeviceGetTemperatureThreshold",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetPowerManagementLimit",
    "nvmlDeviceGetPowerManagementDefaultLimit",
    "nvmlDeviceGetPowerManagementLimitConstraints",
    "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetMaxClockInfo",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetPcieThroughput",
    "nvmlDeviceGetPcieReplayCounter",
    "nvmlDeviceGetCurrPcieLinkGeneration",
    "nvmlDeviceGetCurrPcieLinkWidth",
    "nvmlDeviceGetMaxPcieLinkGeneration",
    "nvmlDeviceGetMaxPcieLinkWidth",
    "nvmlDeviceGetFanSpeed",
    "nvmlDeviceGetFanSpeed_v2",
    "nvmlDeviceGetNumFans",
    "nvmlDeviceGetPerformanceState",
    "nvmlDeviceGetPersistenceMode",
    "nvmlDeviceGetDisplayActive",
    "nvmlDeviceGetDisplayMode",
    "nvmlDeviceGetComputeMode",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetGraphicsRunningProcesses",
    "nvmlDeviceGetGraphicsRunningProcesses_v2",
    "nvmlDeviceGetGraphicsRunningProcesses_v3",
    "nvmlDeviceGetMPSComputeRunningProcesses",
    "nvmlDeviceGetMPSComputeRunningProcesses_v2",
    "nvmlDeviceGetMPSComputeRunningProcesses_v3",
    "nvmlDeviceGetRunningProcessDetailList",
    "nvmlDeviceGetProcessUtilization",
    "nvmlDeviceGetSamples",
    "nvmlDeviceGetFieldValues",
    "nvmlDeviceGetDriverModel",
    "nvmlDeviceGetDriverModel_v2",
    "nvmlDeviceIsMigDeviceHandle",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetConfComputeMemSizeInfo",
    "nvmlEventSetCreate",
    "nvmlDeviceRegisterEvents",
    "nvmlDeviceGetSupportedEventTypes",
    "nvmlEventSetWait",
    "nvmlEventSetWait_v2",
    "nvmlEventSetFree",
)

# Exported too, but not NVML: per-function call counters for tests.
TEST_HOOKS: tuple[str, ...] = ("fakeNvmlCallCount", "fakeNvmlResetCallCounts")

COMPILE_FLAGS: tuple[str, ...] = (
    "-Wall",
    "-Wextra",
    "-Werror",
    "-shared",
    "-fPIC",
    "-pthread",
    f"-Wl,-soname,{LIBRARY_NAME}",
)


class BuildError(RuntimeError):
    """The fake NVML library could not be compiled."""


def build_library(
    out_dir: str | Path,
    *,
    hidden_symbols: Iterable[str] = (),
    optimize: bool = True,
) -> Path:
    """Compile the fake driver into `out_dir/libnvidia-ml.so.1` and return its path.

    `hidden_symbols` are left out of the dynamic symbol table, as on an older
    driver. A build whose source, flags and hidden set match the last one in
    `out_dir` is reused. The library appears atomically, so concurrent builds
    and a process loading it meanwhile never see a partial file.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hidden = sorted(set(hidden_symbols))
    unknown = set(hidden) - set(EXPORTED_SYMBOLS) - set(TEST_HOOKS)
    if unknown:
        # a typo would otherwise build the full driver without a word
        raise ValueError(f"not exported by the fake NVML library: {sorted(unknown)}")
    flags = ["-O2" if optimize else "-O0", *COMPILE_FLAGS]
    source = resources.files(__package__).joinpath("fakenvml.c")
    stamp = _stamp(source.read_bytes(), flags, hidden)

    target = out / LIBRARY_NAME
    stamp_path = out / f"{LIBRARY_NAME}.stamp"
    with open(out / f".{LIBRARY_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # library and stamp must stay a pair
        if target.exists() and _read(stamp_path) == stamp:
            return target
        gcc = shutil.which("gcc")
        if gcc is None:
            raise BuildError(
                "gcc not found: the fake NVML library is compiled at test time; "
                "install it with `sudo apt-get install gcc`"
            )
        with tempfile.TemporaryDirectory(dir=out, prefix=".build-") as tmp:
            cmd = [gcc, *flags]
            if hidden:
                script = Path(tmp) / "hidden.map"
                script.write_text("{\n  local:\n" + "".join(f"    {s};\n" for s in hidden) + "};\n")
                cmd.append(f"-Wl,--version-script={script}")
            built = Path(tmp) / LIBRARY_NAME
            with resources.as_file(source) as src:
                cmd += ["-o", str(built), str(src)]
                proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise BuildError(
                    f"gcc failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr}"
                )
            os.replace(built, target)
            (Path(tmp) / "stamp").write_text(stamp)
            os.replace(Path(tmp) / "stamp", stamp_path)
    return target


def _stamp(source: bytes, flags: list[str], hidden: list[str]) -> str:
    digest = hashlib.sha256(source)
    digest.update("\0".join(flags).encode())
    digest.update(b"\0hidden\0" + "\0".join(hidden).encode())
    return digest.hexdigest()


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None

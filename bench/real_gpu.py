"""Record what a real NVML driver answers, call by call, and what the exporter serves on it.

Run on a host with an NVIDIA GPU and driver (no fake library on LD_LIBRARY_PATH):

    python bench/real_gpu.py --out docs/real-gpu.md

For every GPU it calls each NVML query the exporter uses, through pynvml, and writes the value
or the NVML error and the median cost of the call; then it starts the exporter on the same
driver, scrapes /metrics under both naming profiles and records the capability table. The same
script runs against the lab's fake driver in the tests, so it works the day a GPU is at hand.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pynvml

ROOT = Path(__file__).resolve().parents[1]


def queries(handle: Any) -> list[tuple[str, Callable[[], Any]]]:
    n = pynvml
    return [
        ("nvmlDeviceGetName", lambda: n.nvmlDeviceGetName(handle)),
        ("nvmlDeviceGetUUID", lambda: n.nvmlDeviceGetUUID(handle)),
        ("nvmlDeviceGetPciInfo", lambda: n.nvmlDeviceGetPciInfo(handle).busId),
        (
            "nvmlDeviceGetUtilizationRates",
            lambda: (lambda u: f"gpu={u.gpu}% memory={u.memory}%")(
                n.nvmlDeviceGetUtilizationRates(handle)
            ),
        ),
        (
            "nvmlDeviceGetSamples(GPU_UTILIZATION)",
            lambda: (lambda r: f"{len(r[1])} samples, value type {r[0]}")(
                n.nvmlDeviceGetSamples(handle, n.NVML_GPU_UTILIZATION_SAMPLES, 0)
            ),
        ),
        ("nvmlDeviceGetEncoderUtilization", lambda: n.nvmlDeviceGetEncoderUtilization(handle)),
        ("nvmlDeviceGetDecoderUtilization", lambda: n.nvmlDeviceGetDecoderUtilization(handle)),
        (
            "nvmlDeviceGetMemoryInfo(v2)",
            lambda: (
                lambda m: f"total={m.total} used={m.used} free={m.free} reserved={m.reserved}"
            )(n.nvmlDeviceGetMemoryInfo(handle, version=n.nvmlMemory_v2)),
        ),
        (
            "nvmlDeviceGetMemoryInfo(v1)",
            lambda: (lambda m: f"total={m.total} used={m.used} free={m.free}")(
                n.nvmlDeviceGetMemoryInfo(handle)
            ),
        ),
        (
            "nvmlDeviceGetTemperatureV",
            lambda: n.nvmlDeviceGetTemperatureV(handle, n.NVML_TEMPERATURE_GPU),
        ),
        (
            "nvmlDeviceGetTemperature",
            lambda: n.nvmlDeviceGetTemperature(handle, n.NVML_TEMPERATURE_GPU),
        ),
        ("nvmlDeviceGetPowerUsage", lambda: n.nvmlDeviceGetPowerUsage(handle)),
        ("nvmlDeviceGetEnforcedPowerLimit", lambda: n.nvmlDeviceGetEnforcedPowerLimit(handle)),
        (
            "nvmlDeviceGetTotalEnergyConsumption",
            lambda: n.nvmlDeviceGetTotalEnergyConsumption(handle),
        ),
        ("nvmlDeviceGetClockInfo(SM)", lambda: n.nvmlDeviceGetClockInfo(handle, n.NVML_CLOCK_SM)),
        ("nvmlDeviceGetClockInfo(MEM)", lambda: n.nvmlDeviceGetClockInfo(handle, n.NVML_CLOCK_MEM)),
        (
            "nvmlDeviceGetMaxClockInfo(SM)",
            lambda: n.nvmlDeviceGetMaxClockInfo(handle, n.NVML_CLOCK_SM),
        ),
        (
            "nvmlDeviceGetCurrentClocksEventReasons",
            lambda: hex(n.nvmlDeviceGetCurrentClocksEventReasons(handle)),
        ),
        (
            "nvmlDeviceGetPcieThroughput(TX)",
            lambda: n.nvmlDeviceGetPcieThroughput(handle, n.NVML_PCIE_UTIL_TX_BYTES),
        ),
        ("nvmlDeviceGetPcieReplayCounter", lambda: n.nvmlDeviceGetPcieReplayCounter(handle)),
        ("nvmlDeviceGetFanSpeed", lambda: n.nvmlDeviceGetFanSpeed(handle)),
        (
            "nvmlDeviceGetFieldValues(MEMORY_TEMP)",
            lambda: (lambda v: f"nvmlReturn={v.nvmlReturn} value={v.value.ullVal}")(
                n.nvmlDeviceGetFieldValues(handle, [n.NVML_FI_DEV_MEMORY_TEMP])[0]
            ),
        ),
        ("nvmlDeviceGetRemappedRows", lambda: n.nvmlDeviceGetRemappedRows(handle)),
        (
            "nvmlDeviceGetComputeRunningProcesses",
            lambda: [
                (p.pid, p.usedGpuMemory) for p in n.nvmlDeviceGetComputeRunningProcesses(handle)
            ],
        ),
        (
            "nvmlDeviceGetProcessUtilization",
            lambda: len(n.nvmlDeviceGetProcessUtilization(handle, 0)),
        ),
        (
            "nvmlDeviceGetSupportedEventTypes",
            lambda: hex(n.nvmlDeviceGetSupportedEventTypes(handle)),
        ),
    ]


def answer(fn: Callable[[], Any]) -> tuple[str, float | None]:
    """The value (or NVML error) and the median microseconds of 50 calls."""
    try:
        value = fn()
    except pynvml.NVMLError as exc:
        return f"**{exc}** ({exc.value})", None
    except Exception as exc:
        return f"**{type(exc).__name__}: {exc}**", None
    costs = []
    for _ in range(50):
        t0 = time.perf_counter_ns()
        fn()
        costs.append(time.perf_counter_ns() - t0)
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    text = str(value).replace("|", "\\|").replace("\n", " ")
    return text[:120], statistics.median(costs) / 1000


def scrape_exporter() -> dict[str, str]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpubalance",
            "exporter",
            "--listen",
            "127.0.0.1:0",
            "--otlp-listen",
            "127.0.0.1:0",
            "--log-level",
            "info",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = None
        assert process.stderr is not None
        for line in process.stderr:
            if "listening on " in line:
                url = line.rsplit("listening on ", 1)[1].strip()
                break
        if url is None:
            raise RuntimeError("the exporter did not start")
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(url + "/healthz", timeout=5).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        time.sleep(2.5)  # a few samples, so window figures exist
        return {
            names: urllib.request.urlopen(f"{url}/metrics?names={names}", timeout=10)
            .read()
            .decode()
            for names in ("native", "dcgm")
        }
    finally:
        process.terminate()
        process.wait(timeout=15)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "real-gpu.md")
    args = parser.parse_args()
    pynvml.nvmlInit()
    lines = [
        "# What a real NVML driver answered",
        "",
        f"Recorded by `bench/real_gpu.py` on {time.strftime('%Y-%m-%d', time.gmtime())}: "
        f"{platform.node()}, driver {pynvml.nvmlSystemGetDriverVersion()}, NVML "
        f"{pynvml.nvmlSystemGetNVMLVersion()}, CUDA driver "
        f"{pynvml.nvmlSystemGetCudaDriverVersion()}, nvidia-ml-py {version('nvidia-ml-py')}. "
        "Cost: median of 50 calls, wall time through pynvml.",
        "",
    ]
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(handle)
        lines += [
            f"## GPU {index}: {name}",
            "",
            "| call | answer | µs per call |",
            "|---|---|---:|",
        ]
        for call, fn in queries(handle):
            text, cost = answer(fn)
            lines.append(f"| `{call}` | {text} | {'' if cost is None else f'{cost:.1f}'} |")
        lines.append("")
    pynvml.nvmlShutdown()
    scraped = scrape_exporter()
    supported = [
        line
        for line in scraped["native"].splitlines()
        if line.startswith("gpubalance_gpu_capability_supported")
    ]
    lines += [
        "## The exporter on this driver",
        "",
        "Capabilities as probed:",
        "",
        "```",
        *supported,
        "```",
        "",
        f"`/metrics`: {len(scraped['native'].splitlines())} lines (native), "
        f"{len(scraped['dcgm'].splitlines())} lines (dcgm). DCGM series served:",
        "",
        "```",
        *sorted(
            {
                line.split("{")[0]
                for line in scraped["dcgm"].splitlines()
                if line.startswith("DCGM_")
            }
        ),
        "```",
        "",
    ]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

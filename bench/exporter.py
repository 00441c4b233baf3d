"""Exporter benchmark: CPU time per 8-GPU sample (6 processes per GPU) and /metrics render time,
side by side with nvitop-exporter on the same fake NVML driver, in one run.

Each exporter runs in its own worker process (nvitop-exporter in its own virtualenv, as its
users would install it), both on one fake driver and one state file with 48 real processes.
The workers are driven in alternating batches so that machine noise hits both alike; every
figure is a median. Results: bench/RESULTS.md (table) and bench/exporter.png (plot).

    python bench/exporter.py [--rounds 30] [--batch 10]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
NVITOP_VENV = BENCH / ".venv-nvitop"
NVITOP_PACKAGES = ("nvitop-exporter==1.7.2", "nvitop==1.7.2", "nvidia-ml-py==13.615.71")
GPUS, PROCESSES_PER_GPU = 8, 6
MIB = 1024 * 1024

sys.path.insert(0, str(BENCH))
from results import progress, write_section  # noqa: E402

# -- the workers: each reads commands on stdin and answers one JSON line per command --------

OURS = r"""
import dataclasses, json, sys, time
from gpubalance.exporter.collectors.base import SampleParts
from gpubalance.exporter.cli import build_collectors
from gpubalance.exporter.config import ExporterConfig
from gpubalance.exporter.exposition.profiles import render
from gpubalance.exporter.sampler import Sampler
from gpubalance.exporter.window import compute_window

config = ExporterConfig(interval=1.0, window=30.0, trend_window=300.0)
collectors = {c.name: c for c in build_collectors(config)}
sampler = Sampler(config, list(collectors.values()), "bench")

def timed(fn):
    t0 = time.process_time_ns(); fn(); return time.process_time_ns() - t0

def gpu_sample():
    parts = SampleParts(timestamp_seconds=time.time())
    collectors["gpu"].update(parts)
    collectors["processes"].update(parts)
    counts = (len(parts.gpus), len(parts.processes))
    assert counts == (8, 48), counts

def host_sample():
    collectors["host"].update(SampleParts(timestamp_seconds=time.time()))

for _ in range(config.history_length):  # fill the history as a running exporter has it
    view = sampler.sample_once()
# the samples were taken back to back: space them one interval apart, as a running exporter's
# are, so that the window step computes the memory trend over its full 300 s
last = view.sample.timestamp_seconds
n = len(sampler.history)
spaced = [
    dataclasses.replace(s, timestamp_seconds=last - (n - 1 - i))
    for i, s in enumerate(sampler.history)
]
sampler.history.clear()
sampler.history.extend(spaced)
trend = compute_window(sampler.history, 30.0, 300.0).gpus[0]
assert trend.memory_used_slope_bytes_per_second is not None, "the trend must be computed"
ops = {
    "sample": gpu_sample,
    "host": host_sample,
    "window": lambda: compute_window(sampler.history, 30.0, 300.0),
    "render": lambda: render(view, "native"),
}
print(json.dumps({"ready": True, "metrics_bytes": len(render(view, "native"))}), flush=True)
for line in sys.stdin:
    op, n = line.split()
    print(json.dumps([timed(ops[op]) for _ in range(int(n))]), flush=True)
"""

THEIRS = r"""
import json, sys, time
from nvitop import Device
from nvitop_exporter.exporter import PrometheusExporter
from prometheus_client import CollectorRegistry, generate_latest

devices = Device.all()
registry = CollectorRegistry()
exporter = PrometheusExporter(devices, hostname="bench", registry=registry)

def timed(fn):
    t0 = time.process_time_ns(); fn(); return time.process_time_ns() - t0

def cycle():
    for device in devices:
        exporter.update_device(device)

cycle(); exporter.update_host()
ops = {"sample": cycle, "host": exporter.update_host, "render": lambda: generate_latest(registry)}
pids = {s.labels["pid"] for s in registry.collect() for s in s.samples
        if s.name == "process_gpu_memory_MiB"}
assert len(devices) == 8 and len(pids) == 48, (len(devices), len(pids))
print(json.dumps({"ready": True, "metrics_bytes": len(generate_latest(registry))}), flush=True)
for line in sys.stdin:
    op, n = line.split()
    print(json.dumps([timed(ops[op]) for _ in range(int(n))]), flush=True)
"""


def bench_state(pids: list[int]) -> dict[str, object]:
    state: dict[str, object] = {"device_count": GPUS, "driver_version": "550.54.14"}
    for i in range(GPUS):
        mine = pids[i * PROCESSES_PER_GPU : (i + 1) * PROCESSES_PER_GPU]
        p = f"gpu{i}."
        state.update(
            {
                p + "utilization.gpu": 50 + i * 5,
                p + "memory.used": (4000 + 500 * i) * MIB,
                p + "temp.gpu": 60 + i,
                p + "power.usage": 250_000 + i * 1000,
                p + "procs": [(pid, 1024 * MIB) for pid in mine],
                p + "procs_util": [(pid, 10, 5, 0, 0) for pid in mine],
            }
        )
    return state


def ensure_nvitop_venv() -> Path:
    python = NVITOP_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(NVITOP_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *NVITOP_PACKAGES], check=True)
    return python


class Worker:
    def __init__(self, name: str, python: Path, code: str, env: dict[str, str]) -> None:
        self.name = name
        self.process = subprocess.Popen(
            [str(python), "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            cwd=ROOT,
        )
        self.info = self._read()

    def _read(self) -> Any:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} worker died (exit {self.process.wait()})")
        return json.loads(line)

    def run(self, op: str, n: int) -> list[int]:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{op} {n}\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.process.stdin:
            self.process.stdin.close()
        self.process.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=10)
    args = parser.parse_args()

    from gpubalance.lab.fakenvml import build_library, write_state

    library_dir = build_library(ROOT / "build" / "fakenvml").parent
    nvitop_python = ensure_nvitop_venv()
    out = BENCH / "out"
    out.mkdir(exist_ok=True)
    sleepers = [subprocess.Popen(["sleep", "3600"]) for _ in range(GPUS * PROCESSES_PER_GPU)]
    state_path = out / "exporter-bench.state"
    write_state(state_path, bench_state([s.pid for s in sleepers]))
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(library_dir),
        "FAKE_NVML_STATE": str(state_path),
        # both read the same file; re-stat it at most every 100 ms (nvml-abi.md §9.2)
        "FAKE_NVML_RELOAD": "100000",
    }
    workers = {}
    try:
        workers["gpubalance"] = Worker("gpubalance", Path(sys.executable), OURS, env)
        workers["nvitop-exporter"] = Worker("nvitop-exporter", nvitop_python, THEIRS, env)
        for worker in workers.values():
            worker.run("sample", 20)  # warm-up
        times: dict[tuple[str, str], list[int]] = {}
        ops = ("sample", "host", "render")
        with progress("exporter bench", args.rounds) as advance:
            for r in range(args.rounds):
                order = list(workers.items()) if r % 2 == 0 else list(workers.items())[::-1]
                for op in ops:
                    for name, worker in order:
                        times.setdefault((name, op), []).extend(worker.run(op, args.batch))
                times.setdefault(("gpubalance", "window"), []).extend(
                    workers["gpubalance"].run("window", args.batch)
                )
                advance()
        sizes = {name: w.info["metrics_bytes"] for name, w in workers.items()}
    finally:
        for worker in workers.values():
            worker.close()
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
    report(times, sizes, args)
    return 0


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.3f}"


def report(times: dict[tuple[str, str], list[int]], sizes: dict[str, int], args: Any) -> None:
    med = {key: statistics.median(values) for key, values in times.items()}
    n = len(times[("gpubalance", "sample")])
    rows = [
        (
            "CPU per 8-GPU sample, 48 processes (gpubalance: gpu + processes collectors; "
            "nvitop-exporter: `update_device` on every GPU)",
            "sample",
        ),
        (
            "CPU per host sample (gpubalance: host collector; nvitop-exporter: `update_host`)",
            "host",
        ),
        (
            "`/metrics` render, one view (gpubalance: native profile, uncached; nvitop-exporter: "
            "`generate_latest`)",
            "render",
        ),
    ]
    lines = [
        f"Run {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC on "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}; {args.rounds} alternating rounds of "
        f"{args.batch} (n = {n} per figure); CPU time of the worker process, all its threads "
        "(`time.process_time_ns`: gpubalance reads each GPU in a thread of its own); fake "
        "driver with `FAKE_NVML_RELOAD=100000`; medians in ms.",
        "",
        "| measurement | gpubalance | nvitop-exporter 1.7.2 | ratio |",
        "|---|---:|---:|---:|",
    ]
    for label, op in rows:
        ours, theirs = med[("gpubalance", op)], med[("nvitop-exporter", op)]
        lines.append(f"| {label} | {_ms(ours)} | {_ms(theirs)} | {ours / theirs:.2f} |")
    lines.append(
        f"| window figures after each sample (gpubalance only) | "
        f"{_ms(med[('gpubalance', 'window')])} | – | – |"
    )
    lines += [
        "",
        f"`/metrics` size: gpubalance {sizes['gpubalance']} bytes (native), nvitop-exporter "
        f"{sizes['nvitop-exporter']} bytes. Goal (issue: foundation): CPU per 8-GPU sample at "
        f"most 1/5 of nvitop-exporter's cycle; measured ratio "
        f"{med[('gpubalance', 'sample')] / med[('nvitop-exporter', 'sample')]:.2f}.",
        "",
        "![per-sample CPU time](exporter.png)",
    ]
    write_section("exporter", "Exporter: CPU per sample and render time", "\n".join(lines))
    plot(times)
    print("\n".join(lines))


def plot(times: dict[tuple[str, str], list[int]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    for ax, op, title in zip(
        axes,
        ("sample", "host", "render"),
        ("8-GPU sample (48 processes)", "host sample", "/metrics render"),
        strict=True,
    ):
        data = [[v / 1e6 for v in times[(name, op)]] for name in ("gpubalance", "nvitop-exporter")]
        ax.boxplot(data, tick_labels=["gpubalance", "nvitop-exporter"], showfliers=False)
        ax.set_title(title)
        ax.set_ylabel("CPU ms")
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(BENCH / "exporter.png", dpi=100)


if __name__ == "__main__":
    sys.exit(main())

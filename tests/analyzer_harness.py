"""What the analyzer's tests build their frames from: one GPU over one window, healthy; every
generated family as one fleet; and a frozen copy of a step, to hold its faster rewrite to."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from gpubalance.analyzer.frames import GpuFrame, frames_from_samples
from gpubalance.lab import generate, traffic
from gpubalance.lab.fast import ORIGIN_SECONDS, simulate
from gpubalance.telemetry import Sample

WINDOW = 30.0
RTX_4090 = "NVIDIA GeForce RTX 4090"


def healthy_frame(gpu: int, window: int, **figures: object) -> GpuFrame:
    """One GPU over one 30-s window of a healthy server: half busy, batches of 4, no queue,
    5 completions/s; ``figures`` replace what the test is about."""
    base: dict[str, object] = {
        "host": "h",
        "gpu": gpu,
        "uuid": f"GPU-{gpu}",
        "card": RTX_4090,
        "t_start": window * WINDOW,
        "t_end": (window + 1) * WINDOW,
        "sample_count": 30,
        "expected_sample_count": 30,
        "lost": False,
        "utilization_mean_ratio": 0.5,
        "utilization_p95_ratio": 0.6,
        "memory_used_bytes": 8 * 2**30,
        "memory_total_bytes": 24 * 2**30,
        "memory_used_slope_bytes_per_second": 0.0,
        "sm_clock_ratio": 1.0,
        "throttled_ratio": 0.0,
        "throttle_reasons": frozenset(),
        "power_ratio": 0.5,
        "temperature_celsius": 50.0,
        "serving_queues": 1,
        "queue_depth_mean": 0.0,
        "queue_depth_max": 1.0,
        "queue_depth_slope_per_second": 0.0,
        "running_mean": 4.0,
        "batch_delay_seconds": 0.01,
        "request_duration_seconds": 1.0,
        "batch_size_mean": 4.0,
        "completions_per_second": 5.0,
        "allocation_failures": 0.0,
        "service_classes": ("interactive",),
        "queue_names": ("llama",),
        "feeder_processes": 1,
        "feeder_cpu_cores_max": 0.2,
        "feeder_read_bytes_per_second": 0.0,
        "host_cpu_busy_ratio": 0.2,
        "host_cpu_pressure_ratio": 0.0,
        "host_io_pressure_ratio": 0.0,
        "host_iowait_ratio": 0.0,
    }
    base.update(figures)
    return GpuFrame(**base)  # type: ignore[arg-type]


def frozen(name: str) -> ModuleType:
    """tests/analyzer/NAME.py, the frozen copy of a step as it was before a rewrite."""
    path = Path(__file__).parent / "analyzer" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def generated_run(document: dict[str, object], duration_seconds: float) -> list[GpuFrame]:
    """A generated variant at the fast speed, as the analyzer's frames."""
    plan = generate.plan_of(document)
    scenario = plan.scenario
    requests = traffic.generate(scenario.traffic, duration_seconds, scenario.seed)
    samples: list[Sample] = []
    simulate(plan, requests, scenario.seed, duration_seconds, samples.append)
    return list(
        frames_from_samples(
            samples,
            window_seconds=scenario.truth_window_seconds,
            interval_seconds=scenario.interval_seconds,
            origin=ORIGIN_SECONDS,
        )
    )


def generated_fleet(duration_seconds: float) -> list[GpuFrame]:
    """Every family's first variant as a host of its own, its GPUs' UUIDs its own."""
    frames: list[GpuFrame] = []
    for index, variant in enumerate(generate.variants("all", 1, 0, duration_seconds)):
        host = f"host-{index:02d}"
        frames += [
            dataclasses.replace(f, host=host, uuid=f"{f.uuid}-{host}")
            for f in generated_run(variant.document, duration_seconds)
        ]
    return frames

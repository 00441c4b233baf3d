"""What the analyzer's tests build their frames from: one GPU over one window, healthy."""

from __future__ import annotations

from gpubalance.analyzer.frames import GpuFrame

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

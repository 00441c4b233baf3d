"""Window figures on hand-made samples: means, rates, trends, resets."""

from __future__ import annotations

import pytest

from gpubalance.exporter.exposition.text import Exposition, format_value
from gpubalance.exporter.window import compute_window
from gpubalance.telemetry import (
    CpuTimes,
    DiskCounters,
    GpuSample,
    HostSample,
    NetworkCounters,
    NvmlStatus,
    ProcessHostStats,
    Sample,
)

GIB = 1024**3


def host(
    t: float,
    *,
    busy: float,
    iowait: float,
    disk_ios: int,
    disk_ms: float,
    net_bytes: int,
    out: int,
    retrans: int,
) -> HostSample:
    # one CPU whose clock advances with t
    cpu = CpuTimes(0, busy, 0, 0, t - busy - iowait, iowait, 0, 0, 0)
    return HostSample(
        cpus=(cpu,),
        pressure=None,
        memory_total_bytes=None,
        memory_available_bytes=None,
        disks=(
            DiskCounters("sda", disk_ios, 0, disk_ios * 4096, 0, disk_ms / 1000, 0, disk_ms / 2000),
        ),
        networks=(NetworkCounters("eth0", net_bytes, 0, 0, 0, 0, 0, 0, 0),),
        tcp_out_segments_total=out,
        tcp_retransmitted_segments_total=retrans,
    )


def make(
    t: float,
    used_gib: float,
    util: float,
    *,
    samples=(),
    reasons=frozenset(),
    cpu_seconds: float = 0.0,
    create: float = 1.0,
    hostpart: HostSample | None = None,
) -> Sample:
    gpu = GpuSample(
        index=0,
        uuid="GPU-a",
        utilization_ratio=util,
        utilization_samples=tuple(samples),
        memory_used_bytes=int(used_gib * GIB),
        memory_free_bytes=int((24 - used_gib) * GIB),
        throttle_reasons=reasons,
    )
    proc = ProcessHostStats(7, "w", cpu_seconds, 1, 0, 0, 1, create)
    return Sample(
        timestamp_seconds=t,
        duration_seconds=0.0,
        hostname="h",
        nvml=NvmlStatus(up=True),
        gpus=(gpu,),
        host=hostpart,
        processes={7: proc},
    )


def test_memory_trend_and_time_to_full() -> None:
    history = [make(float(t), 10 + 0.5 * t, 0.5) for t in range(10)]  # +0.5 GiB/s
    window = compute_window(history, seconds=5, trend_seconds=100)
    gpu = window.gpus[0]
    assert gpu.memory_used_slope_bytes_per_second == pytest.approx(0.5 * GIB)
    # 24 - 14.5 GiB free at 0.5 GiB/s
    assert gpu.memory_time_to_full_seconds == pytest.approx(19.0)


def test_shrinking_memory_has_no_time_to_full() -> None:
    history = [make(float(t), 10 - 0.1 * t, 0.5) for t in range(10)]
    gpu = compute_window(history, 5, 100).gpus[0]
    assert gpu.memory_used_slope_bytes_per_second < 0
    assert gpu.memory_time_to_full_seconds is None


def test_utilization_prefers_nvml_samples_within_the_window() -> None:
    history = [
        make(0.0, 1, 0.9, samples=[(-5.0, 1.0)]),  # outside the 2 s window
        make(1.0, 1, 0.9, samples=[(0.5, 0.2), (0.9, 0.4)]),
        make(2.0, 1, 0.9, samples=[(1.5, 0.6)]),
    ]
    gpu = compute_window(history, seconds=2, trend_seconds=10).gpus[0]
    assert gpu.utilization_source == "samples"
    assert gpu.utilization_ratio == pytest.approx(0.4)
    assert gpu.utilization_sample_count == 3


def test_utilization_falls_back_to_rates_and_throttled_ratio() -> None:
    history = [
        make(0.0, 1, 0.2, reasons=frozenset({"gpu_idle"})),
        make(1.0, 1, 0.4, reasons=frozenset({"sw_power_cap"})),
        make(2.0, 1, 0.6, reasons=frozenset()),
        make(3.0, 1, 1.0, reasons=frozenset({"hw_thermal_slowdown", "gpu_idle"})),
    ]
    gpu = compute_window(history, seconds=10, trend_seconds=10).gpus[0]
    assert gpu.utilization_source == "rates"
    assert gpu.utilization_ratio == pytest.approx(0.55)
    assert gpu.throttled_ratio == pytest.approx(0.5)


def test_host_rates_await_and_retransmits() -> None:
    first = host(
        100.0, busy=10, iowait=5, disk_ios=100, disk_ms=1000, net_bytes=0, out=1000, retrans=10
    )
    last = host(
        110.0, busy=15, iowait=7, disk_ios=300, disk_ms=3000, net_bytes=5_000, out=2000, retrans=60
    )
    window = compute_window(
        [make(0.0, 1, 0, hostpart=first), make(10.0, 1, 0, hostpart=last)],
        seconds=10,
        trend_seconds=10,
    )
    assert window.host is not None
    assert window.host.cpu_busy_ratio == (pytest.approx(0.5),)
    assert window.host.cpu_iowait_ratio == pytest.approx(0.2)
    disk = window.host.disks[0]
    assert disk.await_seconds == pytest.approx(2.0 / 200)
    assert disk.busy_ratio == pytest.approx(0.1)
    assert disk.read_bytes_per_second == pytest.approx(200 * 4096 / 10)
    assert window.host.networks[0].receive_bytes_per_second == pytest.approx(500)
    assert window.host.tcp_retransmit_ratio == pytest.approx(0.05)


def test_process_cpu_usage_ignores_a_reused_pid() -> None:
    history = [
        make(0.0, 1, 0, cpu_seconds=100.0, create=1.0),  # an earlier process with the same pid
        make(1.0, 1, 0, cpu_seconds=1.0, create=2.0),
        make(3.0, 1, 0, cpu_seconds=2.5, create=2.0),
    ]
    window = compute_window(history, seconds=10, trend_seconds=10)
    assert window.processes[7].cpu_usage_ratio == pytest.approx(0.75)


def test_first_sample_has_no_rates() -> None:
    window = compute_window([make(0.0, 1, 0.5)], 10, 10)
    assert window.host is None and window.processes == {}
    assert window.gpus[0].utilization_ratio == pytest.approx(0.5)


def test_text_format_escaping_and_values() -> None:
    out = Exposition()
    out.add("m", "gauge", "help with \\ and\nnewline", 1.5, {"l": 'a"b\\c\nd'})
    out.add("m", "gauge", "", None, {"l": "absent"})
    out.add("empty", "gauge", "no samples: no family", None)
    assert out.render().decode() == (
        '# HELP m help with \\\\ and\\nnewline\n# TYPE m gauge\nm{l="a\\"b\\\\c\\nd"} 1.5\n'
    )
    assert [format_value(v) for v in (3.0, 0.25, float("inf"), float("nan"), 1e20)] == [
        "3",
        "0.25",
        "+Inf",
        "NaN",
        "1e+20",
    ]

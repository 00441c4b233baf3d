"""Window figures on hand-made samples: means, rates, trends, resets."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from gpubalance.exporter.exposition.text import Exposition, format_value
from gpubalance.exporter.window import TrendRule, compute_window
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
MIB = 1024**2
SLOPE, TO_FULL = "memory_used_slope_bytes_per_second", "memory_time_to_full_seconds"


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
    window = compute_window(history, seconds=5, trend_seconds=10)
    gpu = window.gpus[0]
    assert gpu.memory_used_slope_bytes_per_second == pytest.approx(0.5 * GIB)
    # 24 - 14.5 GiB free at 0.5 GiB/s
    assert gpu.memory_time_to_full_seconds == pytest.approx(19.0)


def test_shrinking_memory_has_no_time_to_full() -> None:
    history = [make(float(t), 10 - 0.1 * t, 0.5) for t in range(10)]
    gpu = compute_window(history, 5, 10).gpus[0]
    assert gpu.memory_used_slope_bytes_per_second < 0
    assert gpu.memory_time_to_full_seconds is None


def memory_series(used_gib: Sequence[float], start: float = 1000.0) -> list[Sample]:
    return [make(start + t, used, 0.5) for t, used in enumerate(used_gib)]


@pytest.mark.parametrize("ramp_seconds", [0, 5])
def test_a_model_load_gives_no_time_to_full_wherever_it_falls(ramp_seconds: int) -> None:
    """A 10 GiB load (at once, or over 5 s) onto a flat card, seen at every position as it
    passes through a 300 s trend window, with a little allocator noise."""
    rng = np.random.default_rng(7)
    loaded = np.clip((np.arange(700) - 350) / max(ramp_seconds, 1), 0, 1)
    used = 4 + 10 * loaded + rng.normal(0, 0.01, 700)
    history = memory_series(used)
    trends = 0
    for end in range(300, 700, 3):  # from before the load until it is the oldest reading
        window = compute_window(history[end - 300 : end + 1], 30, 300)
        gpu = window.gpus[0]
        assert gpu.memory_time_to_full_seconds is None, (end, gpu)
        trends += gpu.memory_used_slope_bytes_per_second is not None
    assert trends == len(range(300, 700, 3))  # the trend ran: it was there to be fooled


def test_a_single_spike_moves_neither_slope_nor_time_to_full() -> None:
    used = [8.0] * 100
    used[60] = 20.0  # one odd reading
    gpu = compute_window(memory_series(used), 30, 100).gpus[0]
    assert gpu.memory_used_slope_bytes_per_second == 0
    assert gpu.memory_time_to_full_seconds is None


def test_a_steady_leak_gives_its_slope_and_time_to_full() -> None:
    """0.5 MiB/s taken in 20 MiB allocator segments, with noise from other allocations:
    slope and time to full within 5 % of the truth."""
    rng = np.random.default_rng(3)
    rate = 0.5 * MIB
    taken = np.floor(np.arange(300) * rate / (20 * MIB)) * 20 * MIB
    used = (6 * GIB + taken + rng.normal(0, 2 * MIB, 300)) / GIB
    gpu = compute_window(memory_series(used), 30, 300).gpus[0]
    assert gpu.memory_used_slope_bytes_per_second == pytest.approx(rate, rel=0.05)
    free = (24 - used[-1]) * GIB
    assert gpu.memory_time_to_full_seconds == pytest.approx(free / rate, rel=0.05)


@pytest.mark.parametrize(
    ("points", "span_seconds"),
    [(9, 299.0), (60, 149.0)],  # too few readings; too short a span (under half of 300 s)
)
def test_too_little_history_gives_no_trend(points: int, span_seconds: float) -> None:
    step = span_seconds / (points - 1)
    history = [make(1000 + i * step, 4 + 0.01 * i, 0.5) for i in range(points)]
    gpu = compute_window(history, 30, 300).gpus[0]
    assert gpu.memory_used_slope_bytes_per_second is None
    assert gpu.memory_time_to_full_seconds is None


def test_a_wall_clock_stepped_back_gives_no_trend() -> None:
    history = [make(1000.0 + t, 4 + 0.1 * t, 0.5) for t in range(200)]
    history += [make(900.0 + t, 24, 0.5) for t in range(10)]  # NTP stepped the clock back
    gpu = compute_window(history, 30, 300).gpus[0]
    assert gpu.memory_used_slope_bytes_per_second is None
    assert gpu.memory_time_to_full_seconds is None


def test_the_trend_rule_sets_minimum_points_and_span() -> None:
    history = [make(1000.0 + t, 4 + 0.1 * t, 0.5) for t in range(6)]  # 6 readings over 5 s
    assert compute_window(history, 5, 300).gpus[0].memory_used_slope_bytes_per_second is None
    rule = TrendRule(min_points=5, min_span_ratio=0.01)
    gpu = compute_window(history, 5, 300, rule).gpus[0]
    assert gpu.memory_used_slope_bytes_per_second == pytest.approx(0.1 * GIB)


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


def test_exporter_pages_on_a_leak_not_on_a_model_load(start_exporter) -> None:
    """Through the fake driver and the exporter process (0.2 s samples, 5 s trend window):
    GPU 0 loads a 10 GiB model once, GPU 1 stays flat, GPU 2 leaks 8 MiB per state write.
    While the load passes through the whole trend window, neither GPU 0 nor GPU 1 gets a time
    to full; GPU 2 does."""

    def state(gpu0_gib: float, leaked: int) -> dict[str, object]:
        used = (gpu0_gib * GIB, 5 * GIB, 3 * GIB + leaked * 8 * MIB)
        values: dict[str, object] = {"device_count": 3}
        for i, value in enumerate(used):
            values[f"gpu{i}.memory.total"] = 24 * GIB
            values[f"gpu{i}.memory.used"] = int(value)
        return values

    exporter = start_exporter(state(2, 0))
    leaked = 0
    deadline = time.monotonic() + 60

    def next_snapshot(gpu0_gib: float) -> dict[str, Any]:
        nonlocal leaked
        assert time.monotonic() < deadline, exporter.log()
        leaked += 1
        exporter.write(state(gpu0_gib, leaked))
        time.sleep(0.1)
        return exporter.snapshot()

    # until the trend has its span: the slope is known, flat on GPU 0
    while (snapshot := next_snapshot(2))["window"]["gpus"][0][SLOPE] is None:
        pass
    assert snapshot["window"]["gpus"][0][SLOPE] == 0
    loaded_at = None
    leak_paged = False
    while True:
        snapshot = next_snapshot(12)
        sample, gpus = snapshot["sample"], snapshot["window"]["gpus"]
        if loaded_at is None and sample["gpus"][0]["memory_used_bytes"] == 12 * GIB:
            loaded_at = sample["timestamp_seconds"]
        assert gpus[0][SLOPE] is not None and gpus[0][TO_FULL] is None, gpus[0]
        assert gpus[1][SLOPE] == 0 and gpus[1][TO_FULL] is None, gpus[1]
        leak_paged |= gpus[2][SLOPE] > 0 and gpus[2][TO_FULL] is not None
        if loaded_at is not None and sample["timestamp_seconds"] > loaded_at + 5.5:
            break  # the load is older than the trend window
    assert leak_paged, gpus[2]

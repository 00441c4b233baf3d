"""GPU detail: one GPU's work, memory, health and the processes on it with their host CPU."""

from __future__ import annotations

from typing import Any

from gpubalance.dashboards.common import (
    finish,
    label_variable,
    listing,
    new_dashboard,
    query,
    series,
    states,
)

UID = "gpubalance-gpu"
GPU = 'instance=~"$host", gpu=~"$gpu"'
LEGEND = "{{instance}} GPU {{gpu}}"
THROTTLE_MAPPING = {"0": ("inactive", "transparent"), "1": ("active", "orange")}
# the process's name on a GPU-side series, by its host-side twin (same instance and pid)
WITH_NAME = "* on (instance, pid) group_left (process) (0 * gpubalance_process_threads + 1)"
# a process's GPUs, valued 1, to join host-side process series onto (group_right keeps the
# GPU's labels; a process on two GPUs is listed under each)
ON_GPU = f"0 * max by (instance, pid, gpu) (gpubalance_gpu_process_memory_used_bytes{{{GPU}}}) + 1"


def build() -> dict[str, Any]:
    board = (
        new_dashboard(
            UID,
            "gpubalance / GPU detail",
            "One GPU: utilization, memory and its trend, temperature, power, clocks and "
            "throttle reasons, PCIe, XID errors, and the processes on it with their host CPU.",
        )
        .with_variable(label_variable("host", "Host", "gpubalance_gpu_info", "instance"))
        .with_variable(
            label_variable(
                "gpu", "GPU", 'gpubalance_gpu_info{instance=~"$host"}', "gpu", numeric=True
            )
        )
        .with_panel(
            series(
                "Utilization",
                "GPU: fraction of time a kernel ran (window mean of NVML's samples). Memory: "
                "fraction of time device memory was read or written.",
                [
                    query(f"gpubalance_gpu_utilization_ratio{{{GPU}}}", LEGEND + " GPU"),
                    query(f"gpubalance_gpu_memory_utilization_ratio{{{GPU}}}", LEGEND + " memory"),
                ],
                "percentunit",
                maximum=1,
            )
        )
        .with_panel(
            series(
                "Memory used",
                "Used by contexts, reserved by the driver, and the total.",
                [
                    query(f"gpubalance_gpu_memory_used_bytes{{{GPU}}}", LEGEND + " used"),
                    query(f"gpubalance_gpu_memory_reserved_bytes{{{GPU}}}", LEGEND + " reserved"),
                    query(f"gpubalance_gpu_memory_total_bytes{{{GPU}}}", LEGEND + " total"),
                ],
                "bytes",
            )
        )
        .with_panel(
            series(
                "Memory trend",
                "Theil–Sen slope of memory used over the trend window (absent until the "
                "window holds enough readings); a step, such as a model load, is not a trend.",
                [query(f"gpubalance_gpu_memory_used_slope_bytes_per_second{{{GPU}}}", LEGEND)],
                "Bps",
                minimum=None,
            )
        )
        .with_panel(
            series(
                "Time to full",
                "Seconds until memory is full at the current trend: present only while memory "
                "truly grows (the slope's 95 % interval above zero, a line fitting better than "
                "a step).",
                [query(f"gpubalance_gpu_memory_time_to_full_seconds{{{GPU}}}", LEGEND)],
                "s",
            )
        )
        .with_panel(
            series(
                "Temperature",
                "GPU core temperature. (Memory temperature, "
                "gpubalance_gpu_memory_temperature_celsius, comes only from cards whose NVML "
                "reports it, HBM datacenter cards, never GeForce: not drawn here.)",
                [query(f"gpubalance_gpu_temperature_celsius{{{GPU}}}", LEGEND)],
                "celsius",
                minimum=None,
            )
        )
        .with_panel(
            series(
                "Power",
                "Power draw against the enforced limit.",
                [
                    query(f"gpubalance_gpu_power_watts{{{GPU}}}", LEGEND + " draw"),
                    query(f"gpubalance_gpu_power_limit_watts{{{GPU}}}", LEGEND + " limit"),
                ],
                "watt",
            )
        )
        .with_panel(
            series(
                "Clocks",
                "Current SM, memory and graphics clocks; a current clock well below its "
                "maximum under load means throttling.",
                [
                    query(f"gpubalance_gpu_clock_hertz{{{GPU}}}", LEGEND + " {{clock}}"),
                    query(f"gpubalance_gpu_max_clock_hertz{{{GPU}}}", LEGEND + " {{clock}} max"),
                ],
                "hertz",
            )
        )
        .with_panel(
            series(
                "Throttled share",
                "Fraction of the window's samples with a power or thermal slowdown active.",
                [query(f"gpubalance_gpu_throttled_ratio{{{GPU}}}", LEGEND)],
                "percentunit",
                maximum=1,
            )
        )
        .with_panel(
            states(
                "Throttle reasons",
                "Each clock-event (throttle) reason while it is active. gpu_idle and "
                "applications_clocks_setting are normal; the slowdowns are not.",
                [query(f"gpubalance_gpu_throttle_reason{{{GPU}}}", LEGEND + " {{reason}}")],
                THROTTLE_MAPPING,
            )
        )
        .with_panel(
            series(
                "PCIe throughput",
                "Bytes per second over the PCIe bus (NVML's 20 ms sample).",
                [
                    query(
                        f"gpubalance_gpu_pcie_transmit_bytes_per_second{{{GPU}}}", LEGEND + " tx"
                    ),
                    query(f"gpubalance_gpu_pcie_receive_bytes_per_second{{{GPU}}}", LEGEND + " rx"),
                ],
                "Bps",
            )
        )
        .with_panel(
            series(
                "PCIe replays",
                "Link retries per second: a rising rate points at a bad riser or slot.",
                [
                    query(
                        f"rate(gpubalance_gpu_pcie_replays_total{{{GPU}}}[$__rate_interval])",
                        LEGEND,
                    )
                ],
                "ops",
            )
        )
        .with_panel(
            series(
                "XID errors",
                "XID errors seen by the exporter (NVML events), by XID: a counter, so the "
                "increase is right (dcgm-exporter's XID series is the last value only).",
                [
                    query(
                        f"sum by (instance, gpu, xid) (gpubalance_gpu_xid_errors_total{{{GPU}}})",
                        LEGEND + " XID {{xid}}",
                    )
                ],
                "short",
            )
        )
        .with_panel(
            listing(
                "Processes on the GPU",
                "Each process holding a context: its GPU memory, SM share, and host CPU "
                "(cores, window mean). A feeding process pinned near one core starves its GPU.",
                [
                    (
                        f"max by (instance, gpu, pid) ({name}{{{GPU}}}) {WITH_NAME}",
                        column,
                        unit,
                    )
                    for name, column, unit in (
                        ("gpubalance_gpu_process_memory_used_bytes", "GPU memory", "bytes"),
                        ("gpubalance_gpu_process_sm_utilization_ratio", "SM share", "percentunit"),
                    )
                ]
                + [
                    (
                        "gpubalance_process_cpu_usage_ratio * on (instance, pid) "
                        f"group_right (process) ({ON_GPU})",
                        "Host CPU (cores)",
                        "short",
                    )
                ],
            )
        )
        .with_panel(
            series(
                "Host CPU of the GPU's processes",
                "Host CPU cores each process on the GPU uses: the host side of the GPU's work.",
                [
                    query(
                        "rate(gpubalance_process_cpu_seconds_total[$__rate_interval]) "
                        f"* on (instance, pid) group_right (process) ({ON_GPU})",
                        LEGEND + " {{process}} ({{pid}})",
                    )
                ],
                "short",
            )
        )
    )
    return finish(board)

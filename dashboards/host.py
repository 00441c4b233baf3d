"""Host bottlenecks: the CPU, storage and network a GPU server's cards share."""

from __future__ import annotations

from typing import Any

from gpubalance.dashboards.common import finish, label_variable, new_dashboard, query, series

UID = "gpubalance-host"
HOST = 'instance=~"$host"'


def _rate(name: str, extra: str = "") -> str:
    return f"rate({name}{{{HOST}{extra}}}[$__rate_interval])"


def build() -> dict[str, Any]:
    board = (
        new_dashboard(
            UID,
            "gpubalance / Host bottlenecks",
            "CPU per core, pressure stall information, iowait, disks and network of the GPU "
            "hosts: what starves a GPU from the host side.",
        )
        .with_variable(label_variable("host", "Host", "gpubalance_host_load1", "instance"))
        .with_panel(
            series(
                "CPU busy per core",
                "Fraction of the window each core was busy: one core pinned near 100 % while "
                "the others idle is a single-threaded feeder.",
                [query(f"gpubalance_host_cpu_busy_ratio{{{HOST}}}", "{{instance}} cpu {{cpu}}")],
                "percentunit",
                maximum=1,
            )
        )
        .with_panel(
            series(
                "CPU time by mode",
                "Cores spent in each mode, summed over the host's cores.",
                [
                    query(
                        "sum by (instance, mode) ("
                        + _rate("gpubalance_host_cpu_seconds_total", ', mode!="idle"')
                        + ")",
                        "{{instance}} {{mode}}",
                    )
                ],
                "short",
            )
        )
        .with_panel(
            series(
                "Pressure stall (PSI)",
                "Share of the last 10 s in which some (or all) tasks waited on CPU, memory or I/O.",
                [
                    query(
                        f"gpubalance_host_pressure_ratio{{{HOST}}}",
                        "{{instance}} {{resource}} {{kind}}",
                    )
                ],
                "percentunit",
                maximum=1,
            )
        )
        .with_panel(
            series(
                "iowait",
                "Fraction of CPU time spent waiting for I/O.",
                [query(f"gpubalance_host_cpu_iowait_ratio{{{HOST}}}", "{{instance}}")],
                "percentunit",
                maximum=1,
            )
        )
        .with_panel(
            series(
                "Disk wait",
                "Mean time per completed I/O (storage wait) over the window.",
                [
                    query(
                        f"gpubalance_host_disk_await_seconds{{{HOST}}}",
                        "{{instance}} {{device}} await",
                    ),
                ],
                "s",
            )
        )
        .with_panel(
            series(
                "Disk busy",
                "Share of the window the device had I/O in flight.",
                [
                    query(
                        f"gpubalance_host_disk_busy_ratio{{{HOST}}}",
                        "{{instance}} {{device}}",
                    )
                ],
                "percentunit",
                maximum=1,
            )
        )
        .with_panel(
            series(
                "Disk throughput",
                "Bytes read and written per second.",
                [
                    query(
                        _rate("gpubalance_host_disk_read_bytes_total"),
                        "{{instance}} {{device}} read",
                    ),
                    query(
                        _rate("gpubalance_host_disk_written_bytes_total"),
                        "{{instance}} {{device}} written",
                    ),
                ],
                "Bps",
            )
        )
        .with_panel(
            series(
                "Network throughput",
                "Bytes received and sent per second.",
                [
                    query(
                        _rate("gpubalance_host_network_receive_bytes_total"),
                        "{{instance}} {{device}} rx",
                    ),
                    query(
                        _rate("gpubalance_host_network_transmit_bytes_total"),
                        "{{instance}} {{device}} tx",
                    ),
                ],
                "Bps",
            )
        )
        .with_panel(
            series(
                "Network errors and drops",
                "Receive and send errors and dropped packets per second.",
                [
                    query(
                        f"{_rate('gpubalance_host_network_receive_errors_total')} "
                        f"+ {_rate('gpubalance_host_network_transmit_errors_total')}",
                        "{{instance}} {{device}} errors",
                    ),
                    query(
                        f"{_rate('gpubalance_host_network_receive_drops_total')} "
                        f"+ {_rate('gpubalance_host_network_transmit_drops_total')}",
                        "{{instance}} {{device}} drops",
                    ),
                ],
                "pps",
            )
        )
        .with_panel(
            series(
                "TCP retransmits",
                "TCP segments retransmitted per segment sent.",
                [query(f"gpubalance_host_tcp_retransmit_ratio{{{HOST}}}", "{{instance}}")],
                "percentunit",
            )
        )
        .with_panel(
            series(
                "Load",
                "1-minute load average.",
                [query(f"gpubalance_host_load1{{{HOST}}}", "{{instance}} load1")],
                "short",
            )
        )
        .with_panel(
            series(
                "Host memory available",
                "Host memory available against the total.",
                [
                    query(
                        f"gpubalance_host_memory_available_bytes{{{HOST}}}",
                        "{{instance}} available",
                    ),
                    query(f"gpubalance_host_memory_total_bytes{{{HOST}}}", "{{instance}} total"),
                ],
                "bytes",
            )
        )
    )
    return finish(board)

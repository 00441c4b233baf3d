"""The native profile: Prometheus naming (prefix ``gpubalance_``, base units, ``_total``)."""

from __future__ import annotations

import math

from gpubalance import __version__
from gpubalance.exporter.collectors.gpu import THROTTLE_REASONS
from gpubalance.exporter.exposition.text import Exposition
from gpubalance.exporter.view import View
from gpubalance.telemetry import GpuSample, GpuWindow, HostSample, HostWindow

G, C = "gauge", "counter"
# the modes of a CPU's time in /proc/stat, as the mode label names them (CpuTimes' fields
# are these names with "_seconds")
CPU_MODES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")

# Every value below is the latest background sample (taken every --interval), or a figure over
# the window of samples before it: the exporter does not read NVML at scrape time.
_LATEST = " (as of the last background sample)"


def add_native(out: Exposition, view: View) -> None:
    window_by_uuid = {w.uuid: w for w in view.window.gpus}
    driver = view.sample.nvml.driver_version or ""
    for gpu in view.sample.gpus:
        _add_gpu(out, gpu, window_by_uuid.get(gpu.uuid), driver)
    _add_processes(out, view)
    if view.sample.host is not None:
        _add_host(out, view.sample.host, view.window.host)


def _add_gpu(out: Exposition, gpu: GpuSample, win: GpuWindow | None, driver: str) -> None:
    ids = {"gpu": str(gpu.index), "uuid": gpu.uuid}
    out.add(
        "gpubalance_gpu_info",
        G,
        "GPU identity; always 1.",
        1,
        {
            **ids,
            "name": gpu.name or "",
            "pci_bus_id": gpu.pci_bus_id or "",
            "driver_version": driver,
        },
    )
    out.add("gpubalance_gpu_lost", G, "1 when NVML reports the GPU lost or gone.", gpu.lost, ids)
    out.add(
        "gpubalance_gpu_sample_stale",
        G,
        "1 when the GPU gave no reading within the sample deadline (call: the NVML function "
        "it is stuck in) or NVML is down (call: nvmlInit); its readings are then absent.",
        gpu.stale,
        {**ids, "call": gpu.stale_call or ""} if gpu.stale else ids,
    )
    for capability, supported in sorted(gpu.supported.items()):
        out.add(
            "gpubalance_gpu_capability_supported",
            G,
            "1 when the NVML query behind a capability answers on this GPU (probed once).",
            supported,
            {**ids, "capability": capability},
        )
    if gpu.lost or gpu.stale:
        return
    if win is not None:
        out.add(
            "gpubalance_gpu_utilization_ratio",
            G,
            "Fraction of time a kernel ran, averaged over the window (NVML samples).",
            win.utilization_ratio,
            ids,
        )
        out.add(
            "gpubalance_gpu_memory_used_slope_bytes_per_second",
            G,
            "Trend of GPU memory used: Theil-Sen slope over the trend window; absent until known.",
            win.memory_used_slope_bytes_per_second,
            ids,
        )
        out.add(
            "gpubalance_gpu_memory_time_to_full_seconds",
            G,
            "Seconds until GPU memory is full at the current trend; absent unless it truly grows.",
            win.memory_time_to_full_seconds,
            ids,
        )
        out.add(
            "gpubalance_gpu_throttled_ratio",
            G,
            "Fraction of samples in the window with a power or thermal slowdown active.",
            win.throttled_ratio,
            ids,
        )
    for name, help_text, value in (
        (
            "memory_utilization_ratio",
            "Fraction of time device memory was read or written",
            gpu.memory_utilization_ratio,
        ),
        ("encoder_utilization_ratio", "Encoder utilization", gpu.encoder_utilization_ratio),
        ("decoder_utilization_ratio", "Decoder utilization", gpu.decoder_utilization_ratio),
        ("memory_total_bytes", "GPU memory in total", gpu.memory_total_bytes),
        (
            "memory_used_bytes",
            "GPU memory used by contexts (reserved excluded)",
            gpu.memory_used_bytes,
        ),
        ("memory_free_bytes", "GPU memory free", gpu.memory_free_bytes),
        ("memory_reserved_bytes", "GPU memory reserved by the driver", gpu.memory_reserved_bytes),
        ("temperature_celsius", "GPU core temperature", gpu.temperature_celsius),
        ("memory_temperature_celsius", "GPU memory temperature", gpu.memory_temperature_celsius),
        ("power_watts", "Power draw", gpu.power_watts),
        ("power_limit_watts", "Enforced power limit", gpu.power_limit_watts),
        (
            "pcie_transmit_bytes_per_second",
            "PCIe transmit throughput (NVML, 20 ms sample)",
            gpu.pcie_tx_bytes_per_second,
        ),
        (
            "pcie_receive_bytes_per_second",
            "PCIe receive throughput (NVML, 20 ms sample)",
            gpu.pcie_rx_bytes_per_second,
        ),
        ("fan_speed_ratio", "Fan speed as a fraction of its maximum", gpu.fan_speed_ratio),
        ("last_xid", "Number of the last XID error seen since the exporter started", gpu.last_xid),
        ("remapped_rows_failure", "1 when row remapping failed", gpu.remapped_rows_failure),
    ):
        out.add(f"gpubalance_gpu_{name}", G, help_text + _LATEST + ".", value, ids)
    for clock, value, maximum in (
        ("sm", gpu.sm_clock_hertz, gpu.max_sm_clock_hertz),
        ("memory", gpu.memory_clock_hertz, gpu.max_memory_clock_hertz),
        ("graphics", gpu.graphics_clock_hertz, None),
    ):
        labels = {**ids, "clock": clock}
        out.add("gpubalance_gpu_clock_hertz", G, "Current clock" + _LATEST + ".", value, labels)
        out.add("gpubalance_gpu_max_clock_hertz", G, "Maximum clock of the GPU.", maximum, labels)
    if gpu.throttle_reasons is not None:
        for reason in THROTTLE_REASONS:
            out.add(
                "gpubalance_gpu_throttle_reason",
                G,
                "1 while a clock-event (throttle) reason is active" + _LATEST + ".",
                reason in gpu.throttle_reasons,
                {**ids, "reason": reason},
            )
    for name, help_text, value in (
        ("energy_joules_total", "Energy consumed since the driver loaded", gpu.energy_joules_total),
        ("pcie_replays_total", "PCIe replays (link retries)", gpu.pcie_replays_total),
        ("nvlink_bytes_total", "NVLink data bytes sent and received", gpu.nvlink_bytes_total),
    ):
        out.add(f"gpubalance_gpu_{name}", C, help_text + ".", value, ids)
    for kind, value in (
        ("correctable", gpu.remapped_rows_correctable_total),
        ("uncorrectable", gpu.remapped_rows_uncorrectable_total),
    ):
        out.add(
            "gpubalance_gpu_remapped_rows_total",
            C,
            "Memory rows remapped.",
            value,
            {**ids, "kind": kind},
        )
    if gpu.xid_errors_total is not None:
        out.add(
            "gpubalance_gpu_xid_errors_total", C, "XID errors since the exporter started.", None
        )
        for xid, count in sorted(gpu.xid_errors_total.items()):
            out.add("gpubalance_gpu_xid_errors_total", C, "", count, {**ids, "xid": str(xid)})


def _add_processes(out: Exposition, view: View) -> None:
    sample = view.sample
    for gpu in sample.gpus:
        for proc in gpu.processes:
            labels = {"gpu": str(gpu.index), "uuid": gpu.uuid, "pid": str(proc.pid)}
            out.add(
                "gpubalance_gpu_process_memory_used_bytes",
                G,
                "GPU memory held by a process on this GPU" + _LATEST + ".",
                proc.gpu_memory_used_bytes,
                labels,
            )
            out.add(
                "gpubalance_gpu_process_sm_utilization_ratio",
                G,
                "Share of the GPU's SM time used by the process (0 when NVML has no samples).",
                proc.sm_utilization_ratio,
                labels,
            )
            out.add(
                "gpubalance_gpu_process_memory_utilization_ratio",
                G,
                "Share of the GPU's memory bandwidth time used by the process.",
                proc.memory_utilization_ratio,
                labels,
            )
    # Host side of the processes that hold a GPU: one series per process (join on pid).
    for pid, stats in sorted(sample.processes.items()):
        labels = {"pid": str(pid), "process": stats.name}
        win = view.window.processes.get(pid)
        out.add(
            "gpubalance_process_cpu_seconds_total",
            C,
            "Host CPU time (user + system) of a process that holds a GPU context.",
            stats.cpu_seconds_total,
            labels,
        )
        out.add(
            "gpubalance_process_cpu_usage_ratio",
            G,
            "Host CPU cores used by the process, averaged over the window.",
            win.cpu_usage_ratio if win is not None else None,
            labels,
        )
        out.add(
            "gpubalance_process_resident_memory_bytes",
            G,
            "Resident host memory.",
            stats.resident_memory_bytes,
            labels,
        )
        out.add(
            "gpubalance_process_read_bytes_total",
            C,
            "Bytes read from storage.",
            stats.read_bytes_total,
            labels,
        )
        out.add(
            "gpubalance_process_written_bytes_total",
            C,
            "Bytes written to storage.",
            stats.written_bytes_total,
            labels,
        )
        out.add("gpubalance_process_threads", G, "Threads of the process.", stats.threads, labels)


def _add_host(out: Exposition, host: HostSample, win: HostWindow | None) -> None:
    for cpu in host.cpus:
        for mode in CPU_MODES:
            out.add(
                "gpubalance_host_cpu_seconds_total",
                C,
                "Seconds each CPU spent in each mode.",
                getattr(cpu, f"{mode}_seconds"),
                {"cpu": str(cpu.cpu), "mode": mode},
            )
    # the host's whole CPU time in 8 series, not 8 per CPU: a fleet's analyzer then reads 32
    # times fewer series (32-CPU hosts) than when Prometheus sums the per-CPU ones per query
    for mode in CPU_MODES if host.cpus else ():
        out.add(
            "gpubalance_host_cpu_mode_seconds_total",
            C,
            "Seconds the host's CPUs together spent in each mode (the sum over cpu of "
            "gpubalance_host_cpu_seconds_total; it drops when a CPU goes offline).",
            math.fsum(getattr(cpu, f"{mode}_seconds") for cpu in host.cpus),
            {"mode": mode},
        )
    if win is not None:
        for cpu, ratio in enumerate(win.cpu_busy_ratio):
            out.add(
                "gpubalance_host_cpu_busy_ratio",
                G,
                "Fraction of the window each CPU was busy (not idle, not iowait).",
                ratio,
                {"cpu": str(cpu)},
            )
        out.add(
            "gpubalance_host_cpu_iowait_ratio",
            G,
            "Fraction of CPU time spent waiting for I/O over the window.",
            win.cpu_iowait_ratio,
        )
        out.add(
            "gpubalance_host_tcp_retransmit_ratio",
            G,
            "TCP segments retransmitted per segment sent over the window.",
            win.tcp_retransmit_ratio,
        )
        for disk in win.disks:
            labels = {"device": disk.device}
            out.add(
                "gpubalance_host_disk_await_seconds",
                G,
                "Mean time per completed I/O over the window (storage wait).",
                disk.await_seconds,
                labels,
            )
            out.add(
                "gpubalance_host_disk_busy_ratio",
                G,
                "Fraction of the window the device had I/O in flight.",
                disk.busy_ratio,
                labels,
            )
    for stall in host.pressure or ():
        for kind, avg10, total in (
            ("some", stall.some_avg10_ratio, stall.some_total_seconds),
            ("full", stall.full_avg10_ratio, stall.full_total_seconds),
        ):
            labels = {"resource": stall.resource, "kind": kind}
            out.add(
                "gpubalance_host_pressure_waiting_seconds_total",
                C,
                "Pressure stall time (PSI): tasks waiting on the resource.",
                total,
                labels,
            )
            out.add(
                "gpubalance_host_pressure_ratio",
                G,
                "PSI share of the last 10 s in which tasks waited on the resource.",
                avg10,
                labels,
            )
    out.add(
        "gpubalance_host_memory_total_bytes", G, "Host memory in total.", host.memory_total_bytes
    )
    out.add(
        "gpubalance_host_memory_available_bytes",
        G,
        "Host memory available.",
        host.memory_available_bytes,
    )
    out.add("gpubalance_host_load1", G, "1-minute load average.", host.load1)
    for disk in host.disks:
        labels = {"device": disk.device}
        for name, help_text, value in (
            ("reads_total", "Reads completed", disk.reads_total),
            ("writes_total", "Writes completed", disk.writes_total),
            ("read_bytes_total", "Bytes read", disk.read_bytes_total),
            ("written_bytes_total", "Bytes written", disk.written_bytes_total),
            ("read_time_seconds_total", "Seconds spent reading", disk.read_time_seconds_total),
            ("write_time_seconds_total", "Seconds spent writing", disk.write_time_seconds_total),
            ("io_time_seconds_total", "Seconds with I/O in flight", disk.io_time_seconds_total),
        ):
            out.add(f"gpubalance_host_disk_{name}", C, help_text + ".", value, labels)
    for net in host.networks:
        labels = {"device": net.device}
        for name, help_text, value in (
            ("receive_bytes_total", "Bytes received", net.receive_bytes_total),
            ("transmit_bytes_total", "Bytes sent", net.transmit_bytes_total),
            ("receive_packets_total", "Packets received", net.receive_packets_total),
            ("transmit_packets_total", "Packets sent", net.transmit_packets_total),
            ("receive_errors_total", "Receive errors", net.receive_errors_total),
            ("transmit_errors_total", "Transmit errors", net.transmit_errors_total),
            ("receive_drops_total", "Received packets dropped", net.receive_drops_total),
            ("transmit_drops_total", "Packets dropped on send", net.transmit_drops_total),
        ):
            out.add(f"gpubalance_host_network_{name}", C, help_text + ".", value, labels)
    out.add(
        "gpubalance_host_tcp_out_segments_total",
        C,
        "TCP segments sent.",
        host.tcp_out_segments_total,
    )
    out.add(
        "gpubalance_host_tcp_retransmitted_segments_total",
        C,
        "TCP segments retransmitted.",
        host.tcp_retransmitted_segments_total,
    )


def add_serving(out: Exposition, view: View) -> None:
    """Serving queues per GPU, worker and class: in every profile (DCGM has no such names)."""
    for s in view.sample.serving:
        labels = {
            "gpu": "" if s.gpu_index is None else str(s.gpu_index),
            "uuid": s.gpu_uuid or "",
            "worker": s.worker,
            "queue": s.queue,
            "class": s.service_class or "",
            "source": s.source,
        }
        if s.tenant is not None:
            labels["tenant"] = s.tenant
        out.add(
            "gpubalance_queue_depth",
            G,
            "Requests waiting for a batch" + _LATEST + ".",
            s.queue_depth,
            labels,
        )
        out.add(
            "gpubalance_batch_running_requests",
            G,
            "Requests in the batch on the GPU" + _LATEST + ".",
            s.running,
            labels,
        )
        for name, help_text, total, count in (
            (
                "gpubalance_batch_assembly_delay_seconds",
                "Time from enqueue to the start of the request's batch (sum and count).",
                s.batch_assembly_delay_seconds_sum,
                s.batch_assembly_delay_seconds_count,
            ),
            (
                "gpubalance_batch_size",
                "Requests per batch (sum and count of batches).",
                s.batch_size_sum,
                s.batch_size_count,
            ),
            (
                "gpubalance_request_duration_seconds",
                "Time from arrival to answer (sum and count).",
                s.request_duration_seconds_sum,
                s.request_duration_seconds_count,
            ),
        ):
            # a summary without quantiles: rate(_sum) / rate(_count) is the mean
            out.add(name, "summary", help_text, total, labels, f"{name}_sum")
            out.add(name, "summary", help_text, count, labels, f"{name}_count")
        out.add(
            "gpubalance_memory_allocation_failures_total",
            C,
            "Requests that failed to get GPU memory (OOM, preemptions, BACKEND failures).",
            s.allocation_failures_total,
            labels,
        )
        out.add(
            "gpubalance_prompt_tokens_total",
            C,
            "Prompt tokens of the requests the queue's server prefilled.",
            s.prompt_tokens_total,
            labels,
        )
        out.add(
            "gpubalance_generation_tokens_total",
            C,
            "Tokens the queue's server generated.",
            s.generation_tokens_total,
            labels,
        )
        out.add(
            "gpubalance_kv_cache_usage_ratio",
            G,
            "Share of the KV cache in use" + _LATEST + ".",
            s.kv_cache_usage_ratio,
            labels,
        )
        out.add(
            "gpubalance_batch_size_limit",
            G,
            "The most requests the server puts in one batch, as configured.",
            s.max_batch_size,
            labels,
        )
    for status in view.sample.serving_sources:
        labels = {"source": status.source, "endpoint": status.endpoint}
        out.add(
            "gpubalance_serving_source_up",
            G,
            "1 when the last scrape (or push) of the serving source succeeded.",
            status.up,
            labels,
        )
        out.add(
            "gpubalance_serving_source_stale",
            G,
            "1 when nothing fresh came from the source within stale_after: its figures are "
            "not served.",
            status.stale,
            labels,
        )
        out.add(
            "gpubalance_serving_source_last_success_timestamp_seconds",
            G,
            "Unix time of the source's last successful scrape or push.",
            status.last_success_timestamp_seconds,
            labels,
        )
        out.add(
            "gpubalance_serving_source_scrape_duration_seconds",
            G,
            "Wall time of the last scrape of the source.",
            status.scrape_duration_seconds,
            labels,
        )
        out.add(
            "gpubalance_serving_source_errors_total",
            C,
            "Scrapes of the source that failed, pushes refused and pushed points rejected, "
            "by reason.",
            None,
        )
        for reason, count in sorted(status.errors_total.items()):
            out.add(
                "gpubalance_serving_source_errors_total", C, "", count, {**labels, "reason": reason}
            )
        out.add(
            "gpubalance_serving_source_requests_total",
            C,
            "Scrapes of the source by outcome (ok or the error's reason); pushes by outcome "
            "(accepted, partial or the refusal's reason).",
            None,
        )
        for outcome, count in sorted(status.requests_total.items()):
            out.add(
                "gpubalance_serving_source_requests_total",
                C,
                "",
                count,
                {**labels, "outcome": outcome},
            )
        out.add(
            "gpubalance_serving_source_points_total",
            C,
            "Pushed data points accepted, rejected (partial success) or ignored (not metrics "
            "gpubalance reads).",
            None,
        )
        for outcome, count in sorted(status.points_total.items()):
            out.add(
                "gpubalance_serving_source_points_total",
                C,
                "",
                count,
                {**labels, "outcome": outcome},
            )


def add_self(out: Exposition, view: View) -> None:
    """The exporter's own health: present in every profile."""
    sample = view.sample
    out.add(
        "gpubalance_exporter_build_info",
        G,
        "Version of the exporter; always 1.",
        1,
        {"version": __version__},
    )
    out.add("gpubalance_exporter_samples_total", C, "Background samples taken.", view.samples_total)
    out.add(
        "gpubalance_exporter_sample_overruns_total",
        C,
        "Samples that took longer than the sampling interval.",
        view.overruns_total,
    )
    out.add(
        "gpubalance_exporter_last_sample_timestamp_seconds",
        G,
        "Unix time of the last sample.",
        sample.timestamp_seconds,
    )
    out.add(
        "gpubalance_exporter_sample_duration_seconds",
        G,
        "Wall time the last sample took.",
        sample.duration_seconds,
    )
    out.add(
        "gpubalance_exporter_sample_interval_seconds",
        G,
        "Configured seconds between samples.",
        view.interval_seconds,
    )
    out.add(
        "gpubalance_exporter_window_seconds",
        G,
        "Configured window of the averaged figures.",
        view.window_seconds,
    )
    for result in sample.collectors:
        labels = {"collector": result.name}
        out.add(
            "gpubalance_exporter_collector_success",
            G,
            "1 when the collector succeeded in the last sample.",
            result.success,
            labels,
        )
        out.add(
            "gpubalance_exporter_collector_duration_seconds",
            G,
            "Wall time of the collector in the last sample.",
            result.duration_seconds,
            labels,
        )
        out.add(
            "gpubalance_exporter_collector_last_success_timestamp_seconds",
            G,
            "Unix time of the collector's last successful sample.",
            result.last_success_timestamp_seconds,
            labels,
        )
    nvml = sample.nvml
    out.add("gpubalance_nvml_up", G, "1 when NVML is initialised and answering.", nvml.up)
    out.add(
        "gpubalance_nvml_init_failures_total",
        C,
        "Failed NVML initialisations.",
        nvml.init_failures_total,
    )
    out.add("gpubalance_nvml_errors_total", C, "NVML calls that failed, by call and error.", None)
    for call, errors in sorted(nvml.errors_total.items()):
        for error, count in sorted(errors.items()):
            out.add("gpubalance_nvml_errors_total", C, "", count, {"call": call, "error": error})

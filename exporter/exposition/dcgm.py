"""The DCGM profile: dcgm-exporter's names, types, units and labels, so its dashboards work.

Covers every counter of dcgm-exporter's default-counters.csv that NVML can serve on a GeForce
RTX card, plus a few real DCGM fields that dcgm-exporter exposes when enabled in its CSV (fan,
enforced power limit, total memory, max clocks, clock-event reasons). Not served, because no
NVML call gives them on GeForce: the DCP profiling fields (``DCGM_FI_PROF_GR_ENGINE_ACTIVE``,
``_PIPE_TENSOR_ACTIVE``, ``_DRAM_ACTIVE``; datacenter cards and Blackwell GeForce only) and
``DCGM_FI_DEV_VGPU_LICENSE_STATUS`` (vGPU only). NVLink and row-remapping fields appear only
where the GPU supports them, as in dcgm-exporter, which drops unsupported values.
"""

from __future__ import annotations

from gpubalance.exporter.collectors.gpu import THROTTLE_REASONS
from gpubalance.exporter.exposition.text import Exposition
from gpubalance.exporter.view import View
from gpubalance.telemetry import GpuSample

G, C = "gauge", "counter"
MIB = 1024 * 1024


def _mib(value: int | None) -> float | None:
    return None if value is None else value // MIB


def _percent(ratio: float | None) -> float | None:
    return None if ratio is None else round(ratio * 100)


def _mhz(hertz: float | None) -> float | None:
    return None if hertz is None else round(hertz / 1e6)


def _reasons_mask(gpu: GpuSample) -> int | None:
    if gpu.throttle_reasons is None:
        return None
    return sum(THROTTLE_REASONS[r] for r in gpu.throttle_reasons)


def add_dcgm(out: Exposition, view: View) -> None:
    sample = view.sample
    driver = sample.nvml.driver_version or ""
    for gpu in sample.gpus:
        if gpu.lost:
            continue  # dcgm-exporter drops the series of a GPU it cannot read
        labels = {
            "gpu": str(gpu.index),
            "UUID": gpu.uuid,
            "pci_bus_id": gpu.pci_bus_id or "",
            "device": f"nvidia{gpu.index}",
            "modelName": gpu.name or "",
            "Hostname": sample.hostname,
            "DCGM_FI_DRIVER_VERSION": driver,
        }
        for name, kind, help_text, value in (
            ("DCGM_FI_DEV_SM_CLOCK", G, "SM clock frequency (in MHz).", _mhz(gpu.sm_clock_hertz)),
            (
                "DCGM_FI_DEV_MEM_CLOCK",
                G,
                "Memory clock frequency (in MHz).",
                _mhz(gpu.memory_clock_hertz),
            ),
            (
                "DCGM_FI_DEV_MEMORY_TEMP",
                G,
                "Memory temperature (in C).",
                gpu.memory_temperature_celsius,
            ),
            ("DCGM_FI_DEV_GPU_TEMP", G, "GPU temperature (in C).", gpu.temperature_celsius),
            ("DCGM_FI_DEV_POWER_USAGE", G, "Power draw (in W).", gpu.power_watts),
            (
                "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
                C,
                "Total energy consumption since boot (in mJ).",
                None if gpu.energy_joules_total is None else round(gpu.energy_joules_total * 1000),
            ),
            (
                "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
                C,
                "Total number of PCIe retries.",
                gpu.pcie_replays_total,
            ),
            ("DCGM_FI_DEV_GPU_UTIL", G, "GPU utilization (in %).", _percent(gpu.utilization_ratio)),
            (
                "DCGM_FI_DEV_MEM_COPY_UTIL",
                G,
                "Memory utilization (in %).",
                _percent(gpu.memory_utilization_ratio),
            ),
            (
                "DCGM_FI_DEV_ENC_UTIL",
                G,
                "Encoder utilization (in %).",
                _percent(gpu.encoder_utilization_ratio),
            ),
            (
                "DCGM_FI_DEV_DEC_UTIL",
                G,
                "Decoder utilization (in %).",
                _percent(gpu.decoder_utilization_ratio),
            ),
            (
                "DCGM_FI_DEV_XID_ERRORS",
                G,
                "Value of the last XID error encountered.",
                None if gpu.xid_errors_total is None else (gpu.last_xid or 0),
            ),
            (
                "DCGM_FI_DEV_FB_FREE",
                G,
                "Framebuffer memory free (in MiB).",
                _mib(gpu.memory_free_bytes),
            ),
            (
                "DCGM_FI_DEV_FB_USED",
                G,
                "Framebuffer memory used (in MiB).",
                _mib(gpu.memory_used_bytes),
            ),
            (
                "DCGM_FI_DEV_FB_RESERVED",
                G,
                "Framebuffer memory reserved (in MiB).",
                _mib(gpu.memory_reserved_bytes),
            ),
            (
                "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
                C,
                "Total number of NVLink bandwidth counters for all lanes.",
                gpu.nvlink_bytes_total,
            ),
            (
                "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
                C,
                "Number of remapped rows for uncorrectable errors",
                gpu.remapped_rows_uncorrectable_total,
            ),
            (
                "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
                C,
                "Number of remapped rows for correctable errors",
                gpu.remapped_rows_correctable_total,
            ),
            (
                "DCGM_FI_DEV_ROW_REMAP_FAILURE",
                G,
                "Whether remapping of rows has failed",
                gpu.remapped_rows_failure,
            ),
            # DCP field served from NVML: nvmlDeviceGetPcieThroughput (20 ms sample, KB/s).
            (
                "DCGM_FI_PROF_PCIE_TX_BYTES",
                G,
                "The rate of data transmitted over the PCIe bus in bytes per second (from NVML).",
                gpu.pcie_tx_bytes_per_second,
            ),
            (
                "DCGM_FI_PROF_PCIE_RX_BYTES",
                G,
                "The rate of data received over the PCIe bus in bytes per second (from NVML).",
                gpu.pcie_rx_bytes_per_second,
            ),
            # Real DCGM fields outside the default CSV.
            (
                "DCGM_FI_DEV_FB_TOTAL",
                G,
                "Framebuffer memory in total (in MiB).",
                _mib(gpu.memory_total_bytes),
            ),
            ("DCGM_FI_DEV_FAN_SPEED", G, "Fan speed (in %).", _percent(gpu.fan_speed_ratio)),
            (
                "DCGM_FI_DEV_ENFORCED_POWER_LIMIT",
                G,
                "Enforced power limit (in W).",
                gpu.power_limit_watts,
            ),
            (
                "DCGM_FI_DEV_MAX_SM_CLOCK",
                G,
                "Maximum SM clock frequency (in MHz).",
                _mhz(gpu.max_sm_clock_hertz),
            ),
            (
                "DCGM_FI_DEV_MAX_MEM_CLOCK",
                G,
                "Maximum memory clock frequency (in MHz).",
                _mhz(gpu.max_memory_clock_hertz),
            ),
            (
                "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
                G,
                "Current clock event (throttle) reasons, NVML bit mask.",
                _reasons_mask(gpu),
            ),
        ):
            out.add(name, kind, help_text, value, labels)

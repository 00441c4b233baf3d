"""A GPU dashboard written against dcgm-exporter's DCGM_FI_* names, as its users have them.

On the exporter's ``--names dcgm`` profile every panel has data except those of the fields a
GeForce card cannot serve (``UNSUPPORTED_ON_GEFORCE``); they stay on the dashboard because the
same board serves datacenter cards under dcgm-exporter.
"""

from __future__ import annotations

from typing import Any

from gpubalance.dashboards.common import finish, label_variable, new_dashboard, query, series

UID = "gpubalance-dcgm"
GPU = 'instance=~"$instance", gpu=~"$gpu"'
LEGEND = "{{Hostname}} GPU {{gpu}}"
# field -> why a GeForce card (RTX 30/40 series) has no value for it
UNSUPPORTED_ON_GEFORCE: dict[str, str] = {
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": "a DCP profiling field: GeForce cards before the 50 series "
    "have no profiling counters (a hardware limit, NVIDIA/dcgm-exporter#294)",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": "a DCP profiling field (tensor-core activity): no "
    "profiling counters on GeForce before the 50 series",
    "DCGM_FI_PROF_DRAM_ACTIVE": "a DCP profiling field (memory bandwidth): no profiling "
    "counters on GeForce before the 50 series",
    "DCGM_FI_DEV_MEMORY_TEMP": "NVML reports memory temperature (NVML_FI_DEV_MEMORY_TEMP) on "
    "HBM datacenter cards only; a GeForce card's GDDR answers NOT_SUPPORTED (nvidia-smi: N/A)",
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": "GeForce RTX 40-series cards have no NVLink (NVML "
    "answers NOT_SUPPORTED)",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": "row remapping is a feature of datacenter cards' "
    "memory; GeForce answers NOT_SUPPORTED",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": "row remapping: datacenter cards only",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": "row remapping: datacenter cards only",
}


def _field(name: str, scale: str = "") -> str:
    return f"{name}{{{GPU}}}{scale}"


def build() -> dict[str, Any]:
    board = (
        new_dashboard(
            UID,
            "gpubalance / GPUs (DCGM names)",
            "dcgm-exporter's GPU panels on DCGM_FI_* names: works on dcgm-exporter and on the "
            "gpubalance exporter's --names dcgm profile (GeForce cards leave the profiling, "
            "memory temperature, NVLink and row-remapping panels empty).",
        )
        .with_variable(label_variable("instance", "Instance", "DCGM_FI_DEV_GPU_TEMP", "instance"))
        .with_variable(
            label_variable(
                "gpu", "GPU", 'DCGM_FI_DEV_GPU_TEMP{instance=~"$instance"}', "gpu", numeric=True
            )
        )
        .with_panel(
            series(
                "GPU utilization",
                "DCGM_FI_DEV_GPU_UTIL: percent of time a kernel ran.",
                [query(_field("DCGM_FI_DEV_GPU_UTIL"), LEGEND)],
                "percent",
                maximum=100,
            )
        )
        .with_panel(
            series(
                "Memory copy, encoder and decoder utilization",
                "DCGM_FI_DEV_MEM_COPY_UTIL, _ENC_UTIL and _DEC_UTIL.",
                [
                    query(_field("DCGM_FI_DEV_MEM_COPY_UTIL"), LEGEND + " memory"),
                    query(_field("DCGM_FI_DEV_ENC_UTIL"), LEGEND + " encoder"),
                    query(_field("DCGM_FI_DEV_DEC_UTIL"), LEGEND + " decoder"),
                ],
                "percent",
                maximum=100,
            )
        )
        .with_panel(
            series(
                "Framebuffer memory",
                "DCGM_FI_DEV_FB_USED, _FB_FREE and _FB_RESERVED (MiB in DCGM, shown as bytes).",
                [
                    query(_field("DCGM_FI_DEV_FB_USED", " * 1048576"), LEGEND + " used"),
                    query(_field("DCGM_FI_DEV_FB_FREE", " * 1048576"), LEGEND + " free"),
                    query(_field("DCGM_FI_DEV_FB_RESERVED", " * 1048576"), LEGEND + " reserved"),
                ],
                "bytes",
            )
        )
        .with_panel(
            series(
                "Temperature",
                "DCGM_FI_DEV_GPU_TEMP and DCGM_FI_DEV_MEMORY_TEMP.",
                [
                    query(_field("DCGM_FI_DEV_GPU_TEMP"), LEGEND + " core"),
                    query(_field("DCGM_FI_DEV_MEMORY_TEMP"), LEGEND + " memory"),
                ],
                "celsius",
                minimum=None,
            )
        )
        .with_panel(
            series(
                "Power",
                "DCGM_FI_DEV_POWER_USAGE against DCGM_FI_DEV_ENFORCED_POWER_LIMIT.",
                [
                    query(_field("DCGM_FI_DEV_POWER_USAGE"), LEGEND + " draw"),
                    query(_field("DCGM_FI_DEV_ENFORCED_POWER_LIMIT"), LEGEND + " limit"),
                ],
                "watt",
            )
        )
        .with_panel(
            series(
                "Energy",
                "Power from DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION (mJ): its rate in watts.",
                [
                    query(
                        f"rate({_field('DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION')}"
                        "[$__rate_interval]) / 1000",
                        LEGEND,
                    )
                ],
                "watt",
            )
        )
        .with_panel(
            series(
                "Clocks",
                "DCGM_FI_DEV_SM_CLOCK and _MEM_CLOCK against their maximum (MHz).",
                [
                    query(_field("DCGM_FI_DEV_SM_CLOCK", " * 1000000"), LEGEND + " SM"),
                    query(_field("DCGM_FI_DEV_MAX_SM_CLOCK", " * 1000000"), LEGEND + " SM max"),
                    query(_field("DCGM_FI_DEV_MEM_CLOCK", " * 1000000"), LEGEND + " memory"),
                    query(
                        _field("DCGM_FI_DEV_MAX_MEM_CLOCK", " * 1000000"), LEGEND + " memory max"
                    ),
                ],
                "hertz",
            )
        )
        .with_panel(
            series(
                "Clock event reasons",
                "DCGM_FI_DEV_CLOCKS_EVENT_REASONS, NVML's bit mask: 0x1 idle, 0x4 software "
                "power cap, 0x8 hardware slowdown, 0x20 software thermal, 0x40 hardware "
                "thermal, 0x80 power brake.",
                [query(_field("DCGM_FI_DEV_CLOCKS_EVENT_REASONS"), LEGEND)],
                "short",
            )
        )
        .with_panel(
            series(
                "Fan speed",
                "DCGM_FI_DEV_FAN_SPEED.",
                [query(_field("DCGM_FI_DEV_FAN_SPEED"), LEGEND)],
                "percent",
                maximum=100,
            )
        )
        .with_panel(
            series(
                "PCIe throughput",
                "DCGM_FI_PROF_PCIE_TX_BYTES and _RX_BYTES (bytes per second).",
                [
                    query(_field("DCGM_FI_PROF_PCIE_TX_BYTES"), LEGEND + " tx"),
                    query(_field("DCGM_FI_PROF_PCIE_RX_BYTES"), LEGEND + " rx"),
                ],
                "Bps",
            )
        )
        .with_panel(
            series(
                "PCIe replays",
                "DCGM_FI_DEV_PCIE_REPLAY_COUNTER: link retries per second.",
                [
                    query(
                        f"rate({_field('DCGM_FI_DEV_PCIE_REPLAY_COUNTER')}[$__rate_interval])",
                        LEGEND,
                    )
                ],
                "ops",
            )
        )
        .with_panel(
            series(
                "Last XID",
                "DCGM_FI_DEV_XID_ERRORS is the last XID seen (a gauge, not a count: increase() "
                "on it is wrong; count XIDs with gpubalance_gpu_xid_errors_total).",
                [query(_field("DCGM_FI_DEV_XID_ERRORS"), LEGEND)],
                "short",
            )
        )
        .with_panel(
            series(
                "Graphics engine and tensor-core activity",
                "DCP profiling fields (datacenter cards and GeForce 50 series only).",
                [
                    query(_field("DCGM_FI_PROF_GR_ENGINE_ACTIVE"), LEGEND + " graphics engine"),
                    query(_field("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"), LEGEND + " tensor"),
                    query(_field("DCGM_FI_PROF_DRAM_ACTIVE"), LEGEND + " DRAM"),
                ],
                "percentunit",
                maximum=1,
            )
        )
        .with_panel(
            series(
                "NVLink bandwidth",
                "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL per second (cards with NVLink).",
                [
                    query(
                        f"rate({_field('DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL')}[$__rate_interval])",
                        LEGEND,
                    )
                ],
                "Bps",
            )
        )
        .with_panel(
            series(
                "Remapped rows",
                "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS, _UNCORRECTABLE_REMAPPED_ROWS and "
                "_ROW_REMAP_FAILURE (datacenter cards).",
                [
                    query(_field("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"), LEGEND + " correctable"),
                    query(
                        _field("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"), LEGEND + " uncorrectable"
                    ),
                    query(_field("DCGM_FI_DEV_ROW_REMAP_FAILURE"), LEGEND + " failure"),
                ],
                "short",
            )
        )
    )
    return finish(board)

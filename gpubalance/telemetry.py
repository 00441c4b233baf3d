"""Plain types of the data path: NVML / procfs / serving -> sample -> window.

Every crossing carries one of these frozen dataclasses. Units are in the field names; a value
the hardware or the kernel cannot give is ``None``, never 0 or NaN.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

# Clock-event (throttle) reasons that mean "slowed down against its will"; idle and clock
# settings are not. The exporter's window and the analyzer's frames count the same ones.
SLOWDOWN_REASONS = frozenset(
    {
        "sw_power_cap",
        "hw_slowdown",
        "sw_thermal_slowdown",
        "hw_thermal_slowdown",
        "hw_power_brake_slowdown",
        "board_limit",
        "reliability",
    }
)


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """One process holding a context on a GPU, as NVML lists it."""

    pid: int
    gpu_memory_used_bytes: int | None
    # From nvmlDeviceGetProcessUtilization; 0 when NVML has no samples for it (NOT_FOUND).
    sm_utilization_ratio: float | None = None
    memory_utilization_ratio: float | None = None


@dataclass(frozen=True, slots=True)
class GpuSample:
    """What NVML answered for one GPU at one sampling instant."""

    index: int
    uuid: str
    name: str | None = None
    pci_bus_id: str | None = None
    lost: bool = False
    # No fresh reading: the GPU's NVML reads missed the per-sample deadline (``nvml_deadline``)
    # or NVML itself is down. Every measurement below is then None, not the last good value,
    # so nothing that skips this flag can take a stuck GPU for a live one; an idle GPU reads
    # 0, a stale one None. ``stale_call`` is the pynvml function the reading is waiting in.
    stale: bool = False
    stale_call: str | None = None
    # Instant reading of nvmlDeviceGetUtilizationRates.
    utilization_ratio: float | None = None
    # NVML utilization samples (timestamp in seconds, ratio) newer than the previous sample;
    # the window averages these when the driver supports nvmlDeviceGetSamples.
    utilization_samples: tuple[tuple[float, float], ...] = ()
    memory_utilization_ratio: float | None = None
    encoder_utilization_ratio: float | None = None
    decoder_utilization_ratio: float | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    temperature_celsius: float | None = None
    memory_temperature_celsius: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    energy_joules_total: float | None = None
    sm_clock_hertz: float | None = None
    memory_clock_hertz: float | None = None
    graphics_clock_hertz: float | None = None
    max_sm_clock_hertz: float | None = None
    max_memory_clock_hertz: float | None = None
    # Active clock-event (throttle) reasons by name; None when the query is unsupported.
    throttle_reasons: frozenset[str] | None = None
    pcie_tx_bytes_per_second: float | None = None
    pcie_rx_bytes_per_second: float | None = None
    pcie_replays_total: int | None = None
    fan_speed_ratio: float | None = None
    nvlink_bytes_total: int | None = None
    remapped_rows_correctable_total: int | None = None
    remapped_rows_uncorrectable_total: int | None = None
    remapped_rows_failure: bool | None = None
    # XID errors seen since the exporter started, by XID number; None when events are unsupported.
    xid_errors_total: Mapping[int, int] | None = None
    last_xid: int | None = None
    processes: tuple[GpuProcess, ...] = ()
    # capability name -> supported, as probed once per GPU (see exporter/nvml.py)
    supported: Mapping[str, bool] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """Seconds one logical CPU spent in each mode since boot (/proc/stat)."""

    cpu: int
    user_seconds: float
    nice_seconds: float
    system_seconds: float
    idle_seconds: float
    iowait_seconds: float
    irq_seconds: float
    softirq_seconds: float
    steal_seconds: float

    @property
    def total_seconds(self) -> float:
        return (
            self.user_seconds
            + self.nice_seconds
            + self.system_seconds
            + self.idle_seconds
            + self.iowait_seconds
            + self.irq_seconds
            + self.softirq_seconds
            + self.steal_seconds
        )

    @property
    def busy_seconds(self) -> float:
        return self.total_seconds - self.idle_seconds - self.iowait_seconds


@dataclass(frozen=True, slots=True)
class PressureStall:
    """One line pair of /proc/pressure/<resource> (PSI)."""

    resource: str  # cpu | io | memory
    some_avg10_ratio: float
    some_total_seconds: float
    full_avg10_ratio: float | None  # the kernel has no "full" line for cpu before 5.13
    full_total_seconds: float | None


@dataclass(frozen=True, slots=True)
class DiskCounters:
    """Cumulative counters of one block device (/proc/diskstats)."""

    device: str
    reads_total: int
    writes_total: int
    read_bytes_total: int
    written_bytes_total: int
    read_time_seconds_total: float
    write_time_seconds_total: float
    io_time_seconds_total: float  # time the device had I/O in flight ("busy")


@dataclass(frozen=True, slots=True)
class NetworkCounters:
    """Cumulative counters of one network interface (/proc/net/dev)."""

    device: str
    receive_bytes_total: int
    transmit_bytes_total: int
    receive_packets_total: int
    transmit_packets_total: int
    receive_errors_total: int
    transmit_errors_total: int
    receive_drops_total: int
    transmit_drops_total: int


@dataclass(frozen=True, slots=True)
class HostSample:
    """The host at one sampling instant, read from one procfs root."""

    cpus: tuple[CpuTimes, ...]
    pressure: tuple[PressureStall, ...] | None  # None when the kernel has no PSI
    memory_total_bytes: int | None
    memory_available_bytes: int | None
    disks: tuple[DiskCounters, ...]
    networks: tuple[NetworkCounters, ...]
    tcp_out_segments_total: int | None
    tcp_retransmitted_segments_total: int | None
    load1: float | None = None


@dataclass(frozen=True, slots=True)
class ProcessHostStats:
    """Host-side figures of one process that holds a GPU context."""

    pid: int
    name: str
    cpu_seconds_total: float  # user + system
    resident_memory_bytes: int
    read_bytes_total: int | None  # None without permission to read /proc/<pid>/io
    written_bytes_total: int | None
    threads: int
    create_time_seconds: float  # with pid, identifies the process across samples


@dataclass(frozen=True, slots=True, kw_only=True)
class ServingMeasures:
    """What a serving queue reports, as a source states it and as the exporter serves it."""

    queue_depth: float | None = None  # requests waiting for a batch
    running: float | None = None  # requests in the batch on the GPU
    batch_assembly_delay_seconds_sum: float | None = None  # per request: enqueue -> batch start
    batch_assembly_delay_seconds_count: float | None = None
    batch_size_sum: float | None = None
    batch_size_count: float | None = None
    request_duration_seconds_sum: float | None = None
    request_duration_seconds_count: float | None = None
    allocation_failures_total: float | None = None
    kv_cache_usage_ratio: float | None = None
    # tokens of the requests' prompts it has prefilled, and tokens it has generated (counters):
    # how prefill-heavy its work is, which decides how much a larger batch costs
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    # the most requests the server puts in one batch, as configured (vLLM --max-num-seqs, TGI
    # --max-batch-size, Triton's max_batch_size, SGLang --max-running-requests)
    max_batch_size: float | None = None

    def measures(self) -> dict[str, float | None]:
        """The measures alone, to carry them onto another serving type."""
        return {f.name: getattr(self, f.name) for f in fields(ServingMeasures)}


@dataclass(frozen=True, slots=True, kw_only=True)
class ServingSample(ServingMeasures):
    """One serving queue in front of a GPU (a worker), as its server reports it.

    Distributions are kept as cumulative sums and counts (as Prometheus histograms and Triton's
    microsecond counters do), so a window turns them into means without losing anything.
    """

    source: str  # triton | vllm | tgi | sglang | otlp | lab
    worker: str
    gpu_index: int | None = None
    gpu_uuid: str | None = None
    service_class: str | None = None
    up: bool = True
    tenant: str | None = None
    queue: str = ""  # the queue within its worker (a model, an engine, a TP rank)


@dataclass(frozen=True, slots=True)
class ServingSourceStatus:
    """How one serving endpoint's scrapes (or the OTLP receiver) are doing."""

    source: str
    endpoint: str
    up: bool
    stale: bool  # nothing fresh within stale_after: its figures are not served
    last_success_timestamp_seconds: float | None = None
    scrape_duration_seconds: float | None = None
    error: str | None = None
    errors_total: Mapping[str, int] = field(default_factory=dict)  # reason -> count
    # scrapes by outcome ("ok" or the error's reason); pushes by outcome (accepted, partial, or
    # the refusal's reason)
    requests_total: Mapping[str, int] = field(default_factory=dict)
    # pushes only: data points accepted, rejected (partial success) and ignored (not for us)
    points_total: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CollectorResult:
    """How one collector fared in one sample (node_exporter's scrape_collector_* series)."""

    name: str
    success: bool
    duration_seconds: float
    error: str | None = None
    # Unix time of the collector's last successful sample (this one, when it succeeded).
    last_success_timestamp_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class NvmlStatus:
    """Whether NVML answers, what it is, and how its calls have failed so far."""

    up: bool
    driver_version: str | None = None
    nvml_version: str | None = None
    cuda_driver_version: int | None = None
    error: str | None = None
    # pynvml function -> NVML error name -> count since the exporter started
    errors_total: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    init_failures_total: int = 0


@dataclass(frozen=True, slots=True)
class Sample:
    """Everything the exporter read at one instant."""

    timestamp_seconds: float
    duration_seconds: float
    hostname: str
    nvml: NvmlStatus
    gpus: tuple[GpuSample, ...] = ()
    host: HostSample | None = None
    processes: Mapping[int, ProcessHostStats] = field(default_factory=dict)
    serving: tuple[ServingSample, ...] = ()
    serving_sources: tuple[ServingSourceStatus, ...] = ()
    collectors: tuple[CollectorResult, ...] = ()


@dataclass(frozen=True, slots=True)
class GpuWindow:
    """Figures of one GPU derived from the samples of a window."""

    index: int
    uuid: str
    # Mean of NVML's utilization samples in the window (or of the instant readings, when the
    # driver has no samples); ``utilization_source`` says which.
    utilization_ratio: float | None
    utilization_source: str | None  # "samples" | "rates"
    utilization_sample_count: int
    # Theil-Sen slope of memory used over the trend window (None until the window holds enough
    # readings); time to full at that slope, None unless the growth is significant (a step, such
    # as a model load, is not).
    memory_used_slope_bytes_per_second: float | None
    memory_time_to_full_seconds: float | None
    # Fraction of samples in which a slowdown reason (power, thermal, ...) was active.
    throttled_ratio: float | None


@dataclass(frozen=True, slots=True)
class DiskWindow:
    device: str
    read_bytes_per_second: float
    written_bytes_per_second: float
    await_seconds: float | None  # mean time per completed I/O; None when no I/O completed
    busy_ratio: float


@dataclass(frozen=True, slots=True)
class NetworkWindow:
    device: str
    receive_bytes_per_second: float
    transmit_bytes_per_second: float
    errors_per_second: float
    drops_per_second: float


@dataclass(frozen=True, slots=True)
class HostWindow:
    cpu_busy_ratio: tuple[float, ...]  # per logical CPU, index = cpu number
    cpu_iowait_ratio: float
    disks: tuple[DiskWindow, ...]
    networks: tuple[NetworkWindow, ...]
    tcp_retransmit_ratio: float | None  # retransmitted / sent segments; None when none sent


@dataclass(frozen=True, slots=True)
class ProcessWindow:
    pid: int
    cpu_usage_ratio: float  # cores: 1.0 is one core busy for the whole window
    read_bytes_per_second: float | None
    written_bytes_per_second: float | None


@dataclass(frozen=True, slots=True)
class ServingWindow:
    worker: str
    source: str
    gpu_index: int | None
    gpu_uuid: str | None
    service_class: str | None
    queue: str
    tenant: str | None
    queue_depth_mean: float | None  # over the samples of the window
    batch_assembly_delay_seconds: float | None  # mean per batch over the window
    batch_size_mean: float | None
    request_duration_seconds: float | None  # mean per request over the window
    requests_per_second: float | None
    allocation_failures_per_second: float | None
    prompt_tokens_per_second: float | None = None
    generation_tokens_per_second: float | None = None


@dataclass(frozen=True, slots=True)
class Window:
    """Derived figures over the last ``seconds`` of samples (counters as rates, trends)."""

    start_seconds: float
    end_seconds: float
    gpus: tuple[GpuWindow, ...] = ()
    host: HostWindow | None = None
    processes: Mapping[int, ProcessWindow] = field(default_factory=dict)
    serving: tuple[ServingWindow, ...] = ()

    @property
    def seconds(self) -> float:
        return self.end_seconds - self.start_seconds

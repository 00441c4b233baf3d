"""From the model's figures to telemetry: one sample (exporter types) and frame rows per period.

Both speeds count the same things per worker (busy time, queue, batches, CPU, disk); this module
turns a period's counts into what NVML, /proc and a serving stack would report (GpuSample,
HostSample, ServingSample) and into the rows of frames.csv.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from gpubalance.lab.model.gpu import GpuPhysics, Reading
from gpubalance.lab.scenario import Plan, PlannedGpu, PlannedWorker
from gpubalance.telemetry import (
    CpuTimes,
    DiskCounters,
    GpuProcess,
    GpuSample,
    HostSample,
    NvmlStatus,
    PressureStall,
    ProcessHostStats,
    Sample,
    ServingSample,
)

MIB = 1024 * 1024
RESERVED_BYTES = 333 * MIB  # what the driver keeps on every card (nvidia-smi "reserved")
BASE_CPU_LOAD = 0.02  # share of each core busy with the rest of the host
WORKER_RSS_BYTES = 3 * 1024 * MIB
HOST_MEMORY_BYTES = 256 * 1024 * MIB
HOST_AVAILABLE_BYTES = 200 * 1024 * MIB
DRIVER_VERSION = "595.71.05"


@dataclass(frozen=True, slots=True)
class ClassFigures:
    """One service class's share of a worker's counts (cumulative, queue depth now)."""

    service_class: str
    queue_depth: int
    requests_done: int
    request_duration_sum: float
    batch_delay_sum: float
    batch_delay_count: int


@dataclass(frozen=True, slots=True)
class WorkerFigures:
    """A worker's counts at one instant (cumulative unless said otherwise)."""

    name: str
    pid: int
    up: bool
    busy_seconds: float
    queue_depth: int  # now
    running: int  # now
    in_flight: int  # now
    kv_used_bytes: int  # now, held by requests
    cpu_seconds: float
    read_bytes: float
    batches: int
    batch_size_sum: float
    batch_delay_sum: float  # per request: enqueue to the start of its batch
    requests_done: int
    request_duration_sum: float
    allocation_failures: int
    prompt_tokens: int = 0  # of the requests answered
    generation_tokens: int = 0
    cpu_wait_seconds: float = 0.0
    disk_wait_seconds: float = 0.0
    disk_busy_seconds: float = 0.0
    create_time_seconds: float = 0.0
    kv_reserved_bytes: int = 0  # now, taken from the device by the caching allocator
    disk_reads: int = 0
    batch_delay_count: int = 0  # requests that started a batch
    queue_area: float = 0.0  # integral of the queue length over time (request-seconds)
    # a process at all: a worker a move stopped, or one still loading its model, has no
    # serving endpoint to read
    present: bool = True
    # per service class, where the worker counts them apart (the fast speed): one serving
    # queue series per class, as a server with per-class queues (priorities) reports them
    classes: tuple[ClassFigures, ...] = ()


def memory_used_bytes(worker: PlannedWorker, figures: WorkerFigures) -> int:
    if not figures.up:
        return 0
    return worker.model.weights_bytes + worker.model.overhead_mib * MIB + figures.kv_reserved_bytes


class Telemetry:
    """Keeps what deltas need between periods, and each GPU's sensors."""

    def __init__(self, plan: Plan, source: str, origin_seconds: float) -> None:
        self.plan = plan
        self.source = source
        self.origin = origin_seconds
        self.physics = {g.index: GpuPhysics(g.card, g.power_limit_watts) for g in plan.gpus}
        self.readings: dict[int, Reading] = {}
        cores = plan.scenario.hardware.host.cores
        self.core_busy = [0.0] * cores
        self.core_iowait = [0.0] * cores
        self.core_of: dict[str, list[int]] = {}
        offset = 0
        for w in plan.workers:
            threads = w.preprocess.threads
            self.core_of[w.name] = [(offset + k) % cores for k in range(threads)]
            offset += threads
        self._last: dict[str, WorkerFigures] = {}
        self._last_waits = (0.0, 0.0)
        self._last_disk_busy = 0.0

    def replace(self, plan: Plan, worker: str) -> None:
        """A move started a new process as ``worker``: its counts start again from 0."""
        self.plan = plan
        self._last.pop(worker, None)

    def sample(
        self,
        end: float,
        period: float,
        figures: Mapping[str, WorkerFigures],
        busy_by_gpu: Mapping[int, float],
        clock: Mapping[int, tuple[float, str | None]],
        lost: set[int],
    ) -> tuple[Sample, list[dict[str, object]]]:
        """One sample at ``end`` (seconds since the start) covering the last ``period``."""
        gpus, frames, processes, serving = [], [], {}, []
        for gpu in self.plan.gpus:
            mine = [w for w in self.plan.workers if w.gpu == gpu.index]
            ratio, reason = clock.get(gpu.index, (1.0, None))
            busy = 0.0 if gpu.index in lost else min(1.0, busy_by_gpu.get(gpu.index, 0.0) / period)
            reading = self.physics[gpu.index].step(period, busy, ratio, reason)
            self.readings[gpu.index] = reading
            gpus.append(self._gpu_sample(gpu, mine, figures, reading, gpu.index in lost))
            frames.append(self._frame(end, period, gpu, mine, figures, reading, gpu.index in lost))
            for w in mine:
                f = figures[w.name]
                if not f.present:
                    continue
                if f.up:
                    processes[f.pid] = ProcessHostStats(
                        pid=f.pid,
                        name=f"lab-{w.name}",
                        cpu_seconds_total=round(f.cpu_seconds + BASE_CPU_LOAD * end, 6),
                        resident_memory_bytes=WORKER_RSS_BYTES,
                        read_bytes_total=int(f.read_bytes),
                        written_bytes_total=0,
                        threads=w.preprocess.threads + 4,
                        create_time_seconds=f.create_time_seconds or self.origin,
                    )
                serving.extend(self._serving(w, gpu, f))
        host = self._host(end, period, figures)
        for w in self.plan.workers:
            self._last[w.name] = figures[w.name]
        sample = Sample(
            timestamp_seconds=self.origin + end,
            duration_seconds=0.0,
            hostname=self.plan.scenario.name,
            nvml=NvmlStatus(up=True, driver_version=DRIVER_VERSION),
            gpus=tuple(gpus),
            host=host,
            processes=processes,
            serving=tuple(serving),
        )
        return sample, frames

    def _gpu_sample(
        self,
        gpu: PlannedGpu,
        mine: list[PlannedWorker],
        figures: Mapping[str, WorkerFigures],
        reading: Reading,
        lost: bool,
    ) -> GpuSample:
        if lost:
            return GpuSample(
                index=gpu.index,
                uuid=gpu.uuid,
                name=gpu.card.model,
                pci_bus_id=gpu.pci_bus_id,
                lost=True,
            )
        used = sum(memory_used_bytes(w, figures[w.name]) for w in mine)
        total = gpu.card.memory_total_bytes
        live = [w for w in mine if figures[w.name].up]
        return GpuSample(
            index=gpu.index,
            uuid=gpu.uuid,
            name=gpu.card.model,
            pci_bus_id=gpu.pci_bus_id,
            utilization_ratio=round(reading.utilization_ratio, 6),
            memory_total_bytes=total,
            memory_used_bytes=used,
            memory_reserved_bytes=RESERVED_BYTES,
            memory_free_bytes=max(0, total - used - RESERVED_BYTES),
            temperature_celsius=round(reading.temperature_celsius, 3),
            power_watts=round(reading.power_watts, 3),
            power_limit_watts=gpu.power_limit_watts,
            energy_joules_total=round(reading.energy_joules_total, 3),
            sm_clock_hertz=round(reading.sm_clock_mhz) * 1e6,
            memory_clock_hertz=round(reading.memory_clock_mhz) * 1e6,
            max_sm_clock_hertz=gpu.card.max_sm_clock_mhz * 1e6,
            throttle_reasons=reading.throttle_reasons,
            fan_speed_ratio=round(reading.fan_speed_ratio, 4),
            processes=tuple(
                GpuProcess(
                    pid=figures[w.name].pid,
                    gpu_memory_used_bytes=memory_used_bytes(w, figures[w.name]),
                    sm_utilization_ratio=round(reading.utilization_ratio / len(live), 6),
                )
                for w in live
            ),
        )

    def _serving(self, w: PlannedWorker, gpu: PlannedGpu, f: WorkerFigures) -> list[ServingSample]:
        whole = ServingSample(
            source=self.source,
            worker=w.name,
            queue=w.model_name,
            gpu_index=gpu.index,
            gpu_uuid=gpu.uuid,
            up=f.up,
            queue_depth=float(f.queue_depth),
            running=float(f.running),
            batch_assembly_delay_seconds_sum=round(f.batch_delay_sum, 6),
            batch_assembly_delay_seconds_count=float(f.batch_delay_count),
            batch_size_sum=f.batch_size_sum,
            batch_size_count=float(f.batches),
            request_duration_seconds_sum=round(f.request_duration_sum, 6),
            request_duration_seconds_count=float(f.requests_done),
            allocation_failures_total=float(f.allocation_failures),
            kv_cache_usage_ratio=round(f.kv_used_bytes / w.kv_cache_bytes, 6)
            if w.kv_cache_bytes
            else None,
            max_batch_size=float(w.max_batch_size),
            prompt_tokens_total=float(f.prompt_tokens),
            generation_tokens_total=float(f.generation_tokens),
        )
        if not f.classes:
            return [whole]
        # one series per class; what belongs to the worker's batches as a whole (batch sizes,
        # the running batch, allocations, KV, tokens) goes with the first, so sums over series
        # hold
        out = []
        for i, c in enumerate(f.classes):
            shared = whole if i == 0 else None
            out.append(
                dataclasses.replace(
                    whole,
                    service_class=c.service_class,
                    queue_depth=float(c.queue_depth),
                    running=whole.running if shared else None,
                    batch_assembly_delay_seconds_sum=round(c.batch_delay_sum, 6),
                    batch_assembly_delay_seconds_count=float(c.batch_delay_count),
                    batch_size_sum=whole.batch_size_sum if shared else None,
                    batch_size_count=whole.batch_size_count if shared else None,
                    request_duration_seconds_sum=round(c.request_duration_sum, 6),
                    request_duration_seconds_count=float(c.requests_done),
                    allocation_failures_total=whole.allocation_failures_total if shared else None,
                    kv_cache_usage_ratio=whole.kv_cache_usage_ratio if shared else None,
                    prompt_tokens_total=whole.prompt_tokens_total if shared else None,
                    generation_tokens_total=whole.generation_tokens_total if shared else None,
                )
            )
        return out

    def _frame(
        self,
        end: float,
        period: float,
        gpu: PlannedGpu,
        mine: list[PlannedWorker],
        figures: Mapping[str, WorkerFigures],
        reading: Reading,
        lost: bool,
    ) -> dict[str, object]:
        now = [figures[w.name] for w in mine]
        before = [self._last.get(w.name) for w in mine]

        def delta(attr: str) -> float:
            return sum(
                getattr(n, attr) - (getattr(b, attr) if b else 0.0)
                for n, b in zip(now, before, strict=True)
            )

        batches = delta("batches")
        cpu = [
            (n.cpu_seconds - (b.cpu_seconds if b else 0.0)) / period
            for n, b in zip(now, before, strict=True)
        ]
        return {
            "t": end,
            "gpu": gpu.index,
            "uuid": gpu.uuid,
            "card": gpu.card.model,
            "lost": int(lost),
            "utilization": reading.utilization_ratio,
            "memory_used_bytes": 0
            if lost
            else sum(memory_used_bytes(w, figures[w.name]) for w in mine),
            "memory_total_bytes": gpu.card.memory_total_bytes,
            "power_watts": reading.power_watts,
            "temperature_celsius": reading.temperature_celsius,
            "sm_clock_mhz": reading.sm_clock_mhz,
            "throttle_reasons": "|".join(sorted(reading.throttle_reasons)),
            "queue_depth": sum(n.queue_depth for n in now),
            # the time-average over the period, exact where queue_depth is a point sample
            "queue_depth_mean": delta("queue_area") / period,
            "in_flight": sum(n.in_flight for n in now),
            "running": sum(n.running for n in now),
            "batches": batches,
            "batch_size_mean": delta("batch_size_sum") / batches if batches else 0.0,
            "batch_delay_seconds": delta("batch_delay_sum") / delta("batch_delay_count")
            if delta("batch_delay_count")
            else 0.0,
            "requests_completed": delta("requests_done"),
            "prompt_tokens": delta("prompt_tokens"),
            "generation_tokens": delta("generation_tokens"),
            "allocation_failures_total": sum(n.allocation_failures for n in now),
            "worker_cpu_cores": max(cpu, default=0.0),
            # the fullest KV cache of the GPU's workers, as the serving samples report it
            "kv_cache_usage_ratio": max(
                (
                    round(figures[w.name].kv_used_bytes / w.kv_cache_bytes, 6)
                    for w in mine
                    if w.kv_cache_bytes
                ),
                default="",
            ),
            # the largest batch limit of the GPU's workers, as the exporter's config states it
            "max_batch_size": max((w.max_batch_size for w in mine), default=""),
        }

    def _host(self, end: float, period: float, figures: Mapping[str, WorkerFigures]) -> HostSample:
        cores = len(self.core_busy)
        for w in self.plan.workers:
            f = figures[w.name]
            last = self._last.get(w.name)
            delta = f.cpu_seconds - (last.cpu_seconds if last else 0.0)
            assigned = self.core_of[w.name]
            for core in assigned:
                self.core_busy[core] += max(0.0, delta) / len(assigned)
        disk_busy = sum(f.disk_busy_seconds for f in figures.values())
        self.core_iowait[0] += max(0.0, disk_busy - self._last_disk_busy)
        self._last_disk_busy = disk_busy
        cpus = []
        for c in range(cores):
            busy = min(self.core_busy[c] + BASE_CPU_LOAD * end, end)
            iowait = min(self.core_iowait[c], end - busy)
            cpus.append(
                CpuTimes(
                    c,
                    round(busy, 6),
                    0.0,
                    0.0,
                    round(end - busy - iowait, 6),
                    round(iowait, 6),
                    0.0,
                    0.0,
                    0.0,
                )
            )
        cpu_wait = sum(f.cpu_wait_seconds for f in figures.values())
        io_wait = sum(f.disk_wait_seconds for f in figures.values())
        # PSI "some": the share of the period in which a task waited; the kernel averages it
        # over 10 s, the lab over one sample period.
        cpu_some = round(min(1.0, (cpu_wait - self._last_waits[0]) / period), 6)
        io_some = round(min(1.0, (io_wait - self._last_waits[1]) / period), 6)
        self._last_waits = (cpu_wait, io_wait)
        reads = sum(f.read_bytes for f in figures.values())
        return HostSample(
            cpus=tuple(cpus),
            pressure=(
                PressureStall("cpu", cpu_some, round(cpu_wait, 6), None, None),
                PressureStall("io", io_some, round(io_wait, 6), io_some, round(io_wait, 6)),
                PressureStall("memory", 0.0, 0.0, 0.0, 0.0),
            ),
            memory_total_bytes=HOST_MEMORY_BYTES,
            memory_available_bytes=HOST_AVAILABLE_BYTES,
            disks=(
                DiskCounters(
                    "nvme0n1",
                    sum(f.disk_reads for f in figures.values()),
                    0,
                    int(reads),
                    0,
                    round(disk_busy + io_wait, 6),
                    0.0,
                    round(disk_busy, 6),
                ),
            ),
            networks=(),
            tcp_out_segments_total=None,
            tcp_retransmitted_segments_total=None,
            load1=None,
        )

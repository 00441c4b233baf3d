"""The fast speed: the lab's server as a discrete-event simulation (SimPy), hours in seconds.

One model with the live speed: the same request stream, routers, dynamic batcher (max batch
size, max queue delay), service times (lab/model/service.py), KV allocator with fragmentation,
host CPU cores and disk shared by the workers' preprocessing and data loading, throttle events,
lost GPUs and crashed workers. Every `interval_seconds` it takes a telemetry sample in the
exporter's types (gpubalance/telemetry.py), so what it emits reads like /api/v1/snapshot.
Deterministic for a seed: no wall clock, no unordered iteration.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import simpy

from gpubalance.lab.model.gpu import GpuPhysics, Reading
from gpubalance.lab.model.memory import Allocation, AllocationFailed, KvRegion
from gpubalance.lab.model.service import ServiceModel
from gpubalance.lab.routing import Router
from gpubalance.lab.scenario import Event, Plan, PlannedGpu, PlannedWorker
from gpubalance.lab.workload import Request, RequestRecord
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

# Unix time of the simulated t = 0: fixed, so that outputs are byte-identical for a seed.
ORIGIN_SECONDS = 1_700_000_000.0
MIB = 1024 * 1024
RESERVED_BYTES = 333 * MIB  # what the driver keeps on every card (nvidia-smi "reserved")
BASE_CPU_LOAD = 0.02  # share of each core busy with the rest of the host
WORKER_PID_BASE = 30000
WORKER_RSS_BYTES = 3 * 1024 * MIB


@dataclass
class GpuState:
    plan: PlannedGpu
    engine: simpy.Resource
    physics: GpuPhysics
    clock_ratio: float = 1.0
    reason: str | None = None
    lost: bool = False
    # busy intervals not yet fully accounted in a telemetry sample
    busy: deque[tuple[float, float]] = field(default_factory=deque)
    last_reading: Reading | None = None


@dataclass
class WorkerState:
    plan: PlannedWorker
    gpu: GpuState
    service: ServiceModel
    threads: simpy.Resource
    kv: KvRegion
    cpu_ms: float
    cpu_ms_per_1k: float
    name: str = ""
    queue: deque[tuple[Request, float]] = field(default_factory=deque)
    wake: simpy.Event | None = None
    in_flight: int = 0
    running: int = 0
    up: bool = True
    generation: int = 0  # bumped by a crash: completions scheduled before it are void
    # requests a crash would fail, by id: in preprocessing, and in the running batch until each
    # one's completion (a batch outlives its shorter requests, which are answered already)
    preparing: dict[int, Request] = field(default_factory=dict)
    current: dict[int, Request] = field(default_factory=dict)
    # cumulative figures, as a serving process would count them
    cpu_seconds: float = 0.0
    read_bytes: float = 0.0
    batches: int = 0
    batch_size_sum: float = 0.0
    batch_delay_sum: float = 0.0
    requests_done: int = 0
    request_duration_sum: float = 0.0
    allocation_failures: int = 0

    def __post_init__(self) -> None:
        self.name = self.plan.name


@dataclass
class RunResult:
    records: list[RequestRecord]
    samples: list[Sample]
    frames: list[dict[str, object]]


class FastRun:
    def __init__(
        self,
        plan: Plan,
        requests: Sequence[Request],
        seed: int,
        duration_seconds: float,
        on_sample: Callable[[Sample], None] | None = None,
    ) -> None:
        self.plan = plan
        self.scenario = plan.scenario
        self.requests = requests
        self.duration = duration_seconds
        self.on_sample = on_sample
        self.env = simpy.Environment()
        env = self.env
        host = self.scenario.hardware.host
        self.cores = simpy.Resource(env, capacity=host.cores)
        self.disk = simpy.Resource(env, capacity=1)
        self.disk_mb_per_second = host.disk_mb_per_second
        self.router = Router(self.scenario.router.policy, self.scenario.router.weights, seed)
        self.gpus = [
            GpuState(g, simpy.Resource(env, capacity=1), GpuPhysics(g.card, g.power_limit_watts))
            for g in plan.gpus
        ]
        self.workers = [
            WorkerState(
                plan=w,
                gpu=self.gpus[w.gpu],
                service=ServiceModel(plan.gpus[w.gpu].card, w.model.params_billions),
                threads=simpy.Resource(env, capacity=w.preprocess.threads),
                kv=KvRegion(w.kv_cache_bytes),
                cpu_ms=w.preprocess.cpu_ms,
                cpu_ms_per_1k=w.preprocess.cpu_ms_per_1k_prompt_tokens,
            )
            for w in plan.workers
        ]
        self.by_name = {w.name: w for w in self.workers}
        self.pools: dict[str, list[WorkerState]] = {}
        for w in self.workers:
            self.pools.setdefault(w.plan.pool, []).append(w)
        self.central: dict[str, deque[Request]] = {p: deque() for p in self.pools}
        self.records: list[RequestRecord] = []
        self.samples: list[Sample] = []
        self.frames: list[dict[str, object]] = []
        # host accounting
        self.core_of: dict[str, list[int]] = {}
        offset = 0
        for w in self.workers:
            self.core_of[w.name] = [
                (offset + k) % host.cores for k in range(w.plan.preprocess.threads)
            ]
            offset += w.plan.preprocess.threads
        self.cpu_wait_seconds = 0.0
        self.disk_wait_seconds = 0.0
        self.disk_busy_seconds = 0.0
        self.disk_reads = 0
        self._core_busy = [0.0] * host.cores
        self._core_iowait = [0.0] * host.cores
        self._last_cpu = {w.name: 0.0 for w in self.workers}
        self._last_disk_busy = 0.0
        self._tick_stats: dict[str, list[float]] = {}
        self._frame_cpu: dict[str, float] = {}
        self._last_waits = (0.0, 0.0)

    # -- running ----------------------------------------------------------------------------

    def run(self) -> RunResult:
        env = self.env
        env.process(self._arrivals())
        for w in self.workers:
            env.process(self._batcher(w))
        for event in sorted(self.scenario.events, key=lambda e: e.at):
            env.process(self._event(event))
        env.process(self._telemetry())
        env.run(until=self.duration)
        # drain: requests that arrived keep going until answered; telemetry has stopped
        env.run()
        for pool, queue in self.central.items():
            while queue:
                self._reject(queue.popleft(), self.scenario.router.queue_timeout_seconds, pool)
        self.records.sort(key=lambda r: r.id)
        return RunResult(self.records, self.samples, self.frames)

    def _arrivals(self) -> Iterator[simpy.Event]:
        env = self.env
        for request in self.requests:
            if request.arrival_seconds >= self.duration:
                break
            delay = request.arrival_seconds - env.now
            if delay > 0:
                yield env.timeout(delay)
            self._route(request)

    def _route(self, request: Request) -> None:
        pool_name = self.plan.pool_of(request.service_class)
        if self.scenario.router.policy == "pooled":
            self.central[pool_name].append(request)
            self._dispatch_pool(pool_name)
            return
        pool = self.pools[pool_name]
        up = [w for w in pool if w.up and self.router.weight(w.name) > 0]
        if not up:
            self._reject(request, 0.0, pool_name)  # no server available: HAProxy answers 503
            return
        worker = self.router.pick(pool, up, request.session)
        self._admit(request, worker)  # type: ignore[arg-type]

    def _dispatch_pool(self, pool_name: str) -> None:
        queue = self.central[pool_name]
        timeout = self.scenario.router.queue_timeout_seconds
        now = self.env.now
        while queue:
            head = queue[0]
            if now - head.arrival_seconds > timeout:
                queue.popleft()
                self._reject(head, timeout, pool_name)
                continue
            free = [
                w
                for w in self.pools[pool_name]
                if w.up and w.in_flight < w.plan.max_batch_size and self.router.weight(w.name) > 0
            ]
            if not free:
                return
            worker = min(free, key=lambda w: (w.in_flight, w.plan.index))
            self._admit(queue.popleft(), worker)

    def _reject(self, request: Request, after: float, pool: str) -> None:
        self.records.append(
            RequestRecord(
                id=request.id,
                arrival_seconds=request.arrival_seconds,
                start_seconds=None,
                end_seconds=request.arrival_seconds + after if after else self.env.now,
                gpu=None,
                worker=None,
                service_class=request.service_class,
                tenant=request.tenant,
                outcome="rejected",
            )
        )

    def _admit(self, request: Request, worker: WorkerState) -> None:
        worker.in_flight += 1
        cpu = (worker.cpu_ms + worker.cpu_ms_per_1k * request.prompt_tokens / 1000) / 1000
        if cpu > 0 or worker.plan.io_mb_per_request > 0:
            worker.preparing[request.id] = request
            self.env.process(self._prepare(request, worker, cpu, worker.generation))
        else:
            self._enqueue(request, worker)

    def _prepare(
        self, request: Request, worker: WorkerState, cpu: float, generation: int
    ) -> Iterator[simpy.Event]:
        env = self.env
        if cpu > 0:
            with worker.threads.request() as thread:
                yield thread
                asked = env.now
                with self.cores.request() as core:
                    yield core
                    self.cpu_wait_seconds += env.now - asked
                    yield env.timeout(cpu)
                    worker.cpu_seconds += cpu
        io_mb = worker.plan.io_mb_per_request
        if io_mb > 0:
            asked = env.now
            with self.disk.request() as disk:
                yield disk
                self.disk_wait_seconds += env.now - asked
                seconds = io_mb / self.disk_mb_per_second
                yield env.timeout(seconds)
                self.disk_busy_seconds += seconds
                self.disk_reads += 1
                worker.read_bytes += io_mb * MIB
        if worker.generation != generation or not worker.up:
            return  # the worker crashed meanwhile; the crash failed this request already
        del worker.preparing[request.id]
        self._enqueue(request, worker)

    def _enqueue(self, request: Request, worker: WorkerState) -> None:
        worker.queue.append((request, self.env.now))
        if worker.wake is not None and not worker.wake.triggered:
            worker.wake.succeed()

    def _batcher(self, worker: WorkerState) -> Iterator[simpy.Event]:
        env = self.env
        limit = worker.plan.max_batch_size
        max_delay = worker.plan.max_queue_delay_seconds
        while True:
            if not worker.queue or not worker.up:
                worker.wake = env.event()
                yield worker.wake
                continue
            while len(worker.queue) < limit and max_delay > 0:
                wait = worker.queue[0][1] + max_delay - env.now
                if wait <= 1e-12:
                    break
                worker.wake = env.event()
                yield env.any_of([env.timeout(wait), worker.wake])
                if not worker.queue or not worker.up:
                    break
            if not worker.queue or not worker.up:
                continue
            gpu = worker.gpu
            with gpu.engine.request() as engine:
                yield engine
                if not worker.up or gpu.lost or not worker.queue:
                    continue
                yield from self._run_batch(worker, limit)

    def _run_batch(self, worker: WorkerState, limit: int) -> Iterator[simpy.Event]:
        env = self.env
        now = env.now
        taken = [worker.queue.popleft() for _ in range(min(limit, len(worker.queue)))]
        model = worker.plan.model
        admitted: list[tuple[Request, float, Allocation]] = []
        for request, enqueued in taken:
            need = (request.prompt_tokens + request.output_tokens) * model.kv_bytes_per_token
            try:
                admitted.append((request, enqueued, worker.kv.allocate(need)))
            except AllocationFailed:
                worker.allocation_failures += 1
                worker.in_flight -= 1
                self.records.append(self._record(request, None, now, worker, "oom"))
                self._freed(worker)
        if not admitted:
            return
        prompts = [r.prompt_tokens for r, _, _ in admitted]
        outputs = [r.output_tokens for r, _, _ in admitted]
        busy, finishes = worker.service.batch_timeline(prompts, outputs, worker.gpu.clock_ratio)
        worker.batches += 1
        worker.batch_size_sum += len(admitted)
        worker.batch_delay_sum += now - admitted[0][1]
        worker.running = len(admitted)
        worker.gpu.busy.append((now, now + busy))
        generation = worker.generation
        worker.current = {r.id: r for r, _, _ in admitted}
        for (request, _, _), finish in zip(admitted, finishes, strict=True):
            done = env.timeout(finish)
            done.callbacks.append(
                lambda _, r=request, g=generation: self._complete(worker, r, now, g)
            )
        yield env.timeout(busy)
        if worker.generation == generation:
            for _, _, allocation in admitted:
                worker.kv.free(allocation)
            worker.running = 0

    def _record(
        self,
        request: Request,
        start: float | None,
        end: float,
        worker: WorkerState,
        outcome: str,
        batch: int | None = None,
    ) -> RequestRecord:
        return RequestRecord(
            id=request.id,
            arrival_seconds=request.arrival_seconds,
            start_seconds=start,
            end_seconds=end,
            gpu=worker.plan.gpu,
            worker=worker.name,
            service_class=request.service_class,
            tenant=request.tenant,
            outcome=outcome,
            batch_size=batch,
        )

    def _complete(
        self, worker: WorkerState, request: Request, start: float, generation: int
    ) -> None:
        if worker.generation != generation:
            return
        now = self.env.now
        del worker.current[request.id]
        worker.in_flight -= 1
        worker.requests_done += 1
        worker.request_duration_sum += now - request.arrival_seconds
        self.records.append(self._record(request, start, now, worker, "ok", worker.running))
        self._freed(worker)

    def _freed(self, worker: WorkerState) -> None:
        if self.scenario.router.policy == "pooled":
            self._dispatch_pool(worker.plan.pool)

    def _fail_worker(self, worker: WorkerState) -> None:
        """Everything the worker holds fails now: a crash or its GPU falling off the bus."""
        now = self.env.now
        worker.generation += 1
        failed = [
            *worker.preparing.values(),
            *(r for r, _ in worker.queue),
            *worker.current.values(),
        ]
        for request in failed:
            self.records.append(self._record(request, None, now, worker, "failed"))
        worker.in_flight = 0
        worker.queue.clear()
        worker.preparing = {}
        worker.current = {}
        worker.running = 0
        worker.kv = KvRegion(worker.plan.kv_cache_bytes)
        worker.up = False
        if worker.wake is not None and not worker.wake.triggered:
            worker.wake.succeed()

    # -- scenario events ------------------------------------------------------------------------

    def _event(self, event: Event) -> Iterator[simpy.Event]:
        yield self.env.timeout(event.at)
        action = event.action
        if action == "throttle":
            assert event.throttle is not None
            gpu = self.gpus[event.throttle.gpu]
            gpu.clock_ratio, gpu.reason = event.throttle.clock_ratio, event.throttle.reason
        elif action == "preprocess":
            assert event.preprocess is not None
            worker = self.by_name[event.preprocess.worker]
            if event.preprocess.cpu_ms is not None:
                worker.cpu_ms = event.preprocess.cpu_ms
            if event.preprocess.cpu_ms_per_1k_prompt_tokens is not None:
                worker.cpu_ms_per_1k = event.preprocess.cpu_ms_per_1k_prompt_tokens
        elif action == "gpu_lost":
            assert event.gpu_lost is not None
            gpu = self.gpus[event.gpu_lost.gpu]
            gpu.lost = True
            for worker in self.workers:
                if worker.gpu is gpu:
                    self._fail_worker(worker)
        elif action == "worker_crash":
            assert event.worker_crash is not None
            worker = self.by_name[event.worker_crash.worker]
            self._fail_worker(worker)
            if event.worker_crash.restart_after_seconds is not None:
                self.env.process(self._restart(worker, event.worker_crash.restart_after_seconds))
        elif action == "disk":
            assert event.disk is not None
            self.disk_mb_per_second = event.disk.disk_mb_per_second
        elif action == "router":
            assert event.router is not None
            self.router.weights.update(event.router.weights)

    def _restart(self, worker: WorkerState, after: float) -> Iterator[simpy.Event]:
        yield self.env.timeout(after)
        if not worker.gpu.lost:
            worker.up = True
            self._freed(worker)  # pooled: the central queue has work for it now

    # -- telemetry ------------------------------------------------------------------------------

    def _telemetry(self) -> Iterator[simpy.Event]:
        interval = self.scenario.interval_seconds
        ticks = math.floor(self.duration / interval + 1e-9)
        for k in range(1, ticks + 1):
            yield self.env.timeout(k * interval - self.env.now)
            self._sample(self.env.now - interval, self.env.now)

    def _busy_between(self, gpu: GpuState, start: float, end: float) -> float:
        total = 0.0
        while gpu.busy and gpu.busy[0][1] <= start:
            gpu.busy.popleft()
        for a, b in gpu.busy:
            if a >= end:
                break
            total += max(0.0, min(b, end) - max(a, start))
        return total

    def _sample(self, start: float, end: float) -> None:
        dt = end - start
        host = self._host_sample(dt)
        gpus: list[GpuSample] = []
        processes: dict[int, ProcessHostStats] = {}
        serving: list[ServingSample] = []
        for gpu in self.gpus:
            mine = [w for w in self.workers if w.gpu is gpu]
            busy = 0.0 if gpu.lost else self._busy_between(gpu, start, end) / dt
            reading = gpu.physics.step(dt, busy, gpu.clock_ratio, gpu.reason)
            gpu.last_reading = reading
            gpus.append(self._gpu_sample(gpu, mine, reading))
            for w in mine:
                pid = WORKER_PID_BASE + w.plan.index
                if w.up:
                    processes[pid] = ProcessHostStats(
                        pid=pid,
                        name=f"lab-worker-{w.name}",
                        cpu_seconds_total=w.cpu_seconds + BASE_CPU_LOAD * end,
                        resident_memory_bytes=WORKER_RSS_BYTES,
                        read_bytes_total=int(w.read_bytes),
                        written_bytes_total=0,
                        threads=w.plan.preprocess.threads + 4,
                        create_time_seconds=ORIGIN_SECONDS,
                    )
                serving.append(self._serving_sample(w))
            self.frames.append(self._frame(end, gpu, mine, reading))
        sample = Sample(
            timestamp_seconds=ORIGIN_SECONDS + end,
            duration_seconds=0.0,
            hostname=self.scenario.name,
            nvml=NvmlStatus(up=True, driver_version="595.71.05"),
            gpus=tuple(gpus),
            host=host,
            processes=processes,
            serving=tuple(serving),
        )
        self.samples.append(sample)
        if self.on_sample is not None:
            self.on_sample(sample)

    def _gpu_sample(self, gpu: GpuState, mine: list[WorkerState], reading: Reading) -> GpuSample:
        plan = gpu.plan
        if gpu.lost:
            return GpuSample(
                index=plan.index,
                uuid=plan.uuid,
                name=plan.card.model,
                pci_bus_id=plan.pci_bus_id,
                lost=True,
            )
        used = sum(
            w.plan.model.weights_bytes + w.plan.model.overhead_mib * MIB + w.kv.used_bytes
            for w in mine
            if w.up
        )
        total = plan.card.memory_total_bytes
        return GpuSample(
            index=plan.index,
            uuid=plan.uuid,
            name=plan.card.model,
            pci_bus_id=plan.pci_bus_id,
            utilization_ratio=round(reading.utilization_ratio, 6),
            memory_total_bytes=total,
            memory_used_bytes=used,
            memory_reserved_bytes=RESERVED_BYTES,
            memory_free_bytes=max(0, total - used - RESERVED_BYTES),
            temperature_celsius=round(reading.temperature_celsius, 3),
            power_watts=round(reading.power_watts, 3),
            power_limit_watts=plan.power_limit_watts,
            energy_joules_total=round(reading.energy_joules_total, 3),
            sm_clock_hertz=round(reading.sm_clock_mhz) * 1e6,
            memory_clock_hertz=round(reading.memory_clock_mhz) * 1e6,
            max_sm_clock_hertz=plan.card.max_sm_clock_mhz * 1e6,
            throttle_reasons=reading.throttle_reasons,
            fan_speed_ratio=round(reading.fan_speed_ratio, 4),
            processes=tuple(
                GpuProcess(
                    pid=WORKER_PID_BASE + w.plan.index,
                    gpu_memory_used_bytes=w.plan.model.weights_bytes + w.kv.used_bytes,
                    sm_utilization_ratio=round(reading.utilization_ratio / len(mine), 6),
                )
                for w in mine
                if w.up
            ),
        )

    def _serving_sample(self, w: WorkerState) -> ServingSample:
        return ServingSample(
            source="lab",
            worker=w.name,
            gpu_index=w.plan.gpu,
            gpu_uuid=w.gpu.plan.uuid,
            service_class=None,
            up=w.up,
            queue_depth=float(len(w.queue)),
            running=float(w.running),
            batch_assembly_delay_seconds_sum=round(w.batch_delay_sum, 6),
            batch_assembly_delay_seconds_count=float(w.batches),
            batch_size_sum=w.batch_size_sum,
            batch_size_count=float(w.batches),
            request_duration_seconds_sum=round(w.request_duration_sum, 6),
            request_duration_seconds_count=float(w.requests_done),
            allocation_failures_total=float(w.allocation_failures),
            kv_cache_usage_ratio=round(w.kv.used_bytes / w.plan.kv_cache_bytes, 6)
            if w.plan.kv_cache_bytes
            else None,
        )

    def _frame(
        self, end: float, gpu: GpuState, mine: list[WorkerState], reading: Reading
    ) -> dict[str, object]:
        stats = self._tick_stats
        batches = sum(w.batches for w in mine)
        size_sum = sum(w.batch_size_sum for w in mine)
        delay_sum = sum(w.batch_delay_sum for w in mine)
        done = sum(w.requests_done for w in mine)
        key = f"gpu{gpu.plan.index}"
        last = stats.get(key, [0.0, 0.0, 0.0, 0.0])
        stats[key] = [batches, size_sum, delay_sum, done]
        d_batches = batches - last[0]
        cpu = [
            (w.cpu_seconds - self._frame_cpu.get(w.name, 0.0)) / self.scenario.interval_seconds
            for w in mine
        ]
        for w in mine:
            self._frame_cpu[w.name] = w.cpu_seconds
        return {
            "t": end,
            "gpu": gpu.plan.index,
            "uuid": gpu.plan.uuid,
            "card": gpu.plan.card.model,
            "lost": int(gpu.lost),
            "utilization": reading.utilization_ratio,
            "memory_used_bytes": 0
            if gpu.lost
            else sum(
                w.plan.model.weights_bytes + w.plan.model.overhead_mib * MIB + w.kv.used_bytes
                for w in mine
                if w.up
            ),
            "memory_total_bytes": gpu.plan.card.memory_total_bytes,
            "power_watts": reading.power_watts,
            "temperature_celsius": reading.temperature_celsius,
            "sm_clock_mhz": reading.sm_clock_mhz,
            "throttle_reasons": "|".join(sorted(reading.throttle_reasons)),
            "queue_depth": sum(len(w.queue) for w in mine),
            "in_flight": sum(w.in_flight for w in mine),
            "running": sum(w.running for w in mine),
            "batches": d_batches,
            "batch_size_mean": (size_sum - last[1]) / d_batches if d_batches else 0.0,
            "batch_delay_seconds": (delay_sum - last[2]) / d_batches if d_batches else 0.0,
            "requests_completed": done - last[3],
            "allocation_failures_total": sum(w.allocation_failures for w in mine),
            "worker_cpu_cores": max(cpu, default=0.0),
        }

    def _host_sample(self, dt: float) -> HostSample:
        cores = len(self._core_busy)
        for w in self.workers:
            delta = w.cpu_seconds - self._last_cpu[w.name]
            self._last_cpu[w.name] = w.cpu_seconds
            assigned = self.core_of[w.name]
            for core in assigned:
                self._core_busy[core] += delta / len(assigned)
        disk_delta = self.disk_busy_seconds - self._last_disk_busy
        self._last_disk_busy = self.disk_busy_seconds
        self._core_iowait[0] += disk_delta
        now = self.env.now
        cpus = []
        for c in range(cores):
            busy = min(self._core_busy[c] + BASE_CPU_LOAD * now, now)
            iowait = min(self._core_iowait[c], now - busy)
            cpus.append(
                CpuTimes(
                    c,
                    round(busy, 6),
                    0.0,
                    0.0,
                    round(now - busy - iowait, 6),
                    round(iowait, 6),
                    0.0,
                    0.0,
                    0.0,
                )
            )
        # PSI "some": the share of the period in which a task waited; the kernel averages it
        # over 10 s, the lab over one sample period.
        cpu_wait, io_wait = self._last_waits
        self._last_waits = (self.cpu_wait_seconds, self.disk_wait_seconds)
        cpu_some = round(min(1.0, (self.cpu_wait_seconds - cpu_wait) / dt), 6)
        io_some = round(min(1.0, (self.disk_wait_seconds - io_wait) / dt), 6)
        return HostSample(
            cpus=tuple(cpus),
            pressure=(
                PressureStall("cpu", cpu_some, round(self.cpu_wait_seconds, 6), None, None),
                PressureStall(
                    "io",
                    io_some,
                    round(self.disk_wait_seconds, 6),
                    io_some,
                    round(self.disk_wait_seconds, 6),
                ),
            ),
            memory_total_bytes=256 * 1024 * MIB,
            memory_available_bytes=200 * 1024 * MIB,
            disks=(
                DiskCounters(
                    "nvme0n1",
                    self.disk_reads,
                    0,
                    int(sum(w.read_bytes for w in self.workers)),
                    0,
                    round(self.disk_busy_seconds + self.disk_wait_seconds, 6),
                    0.0,
                    round(self.disk_busy_seconds, 6),
                ),
            ),
            networks=(),
            tcp_out_segments_total=None,
            tcp_retransmitted_segments_total=None,
        )


def simulate(
    plan: Plan,
    requests: Sequence[Request],
    seed: int,
    duration_seconds: float,
    on_sample: Callable[[Sample], None] | None = None,
) -> RunResult:
    return FastRun(plan, requests, seed, duration_seconds, on_sample).run()

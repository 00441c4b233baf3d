"""The fast speed: the lab's server as a discrete-event simulation (SimPy), hours in seconds.

One model with the live speed: the same request stream, routers, dynamic batcher (max batch
size, max queue delay), service times (lab/model/service.py), KV allocator with fragmentation,
host CPU cores and disk shared by the workers' preprocessing and data loading, throttle events,
lost GPUs and crashed workers, and worker moves: a GPU's worker stopped in one pool (no new
requests, those in flight finish) and another pool's started on it, which serves nothing while
its model loads (`load_seconds`) and until its server is added to the pool. Every
`interval_seconds` it takes a telemetry sample in the exporter's types
(gpubalance/telemetry.py), so what it emits reads like /api/v1/snapshot.
Deterministic for a seed: no wall clock, no unordered iteration.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import simpy

from gpubalance.controller.plan import batch_backend
from gpubalance.lab.figures import ClassFigures, Telemetry, WorkerFigures
from gpubalance.lab.model.memory import Allocation, AllocationFailed, KvRegion
from gpubalance.lab.model.service import ServiceModel
from gpubalance.lab.routing import Router
from gpubalance.lab.scenario import BATCH_CLASS, Event, Plan, PlannedGpu, PlannedWorker
from gpubalance.lab.workload import Request, RequestRecord
from gpubalance.telemetry import Sample

# Unix time of the simulated t = 0: fixed, so that outputs are byte-identical for a seed.
ORIGIN_SECONDS = 1_700_000_000.0
MIB = 1024 * 1024
WORKER_PID_BASE = 30000  # simulated processes have no real PID: these stand in
# a started worker's CUDA context, engine start-up and warm-up, on top of reading its weights
START_UP_SECONDS = 5.0
# a worker's process: serving (or ready to, once its server is in the pool), finishing its
# requests in flight before it exits, gone, or loading its model
Process = Literal["running", "stopping", "stopped", "loading"]


@dataclass
class GpuState:
    plan: PlannedGpu
    engine: simpy.Resource
    clock_ratio: float = 1.0
    reason: str | None = None
    lost: bool = False
    # busy intervals not yet fully accounted in a telemetry sample
    busy: deque[tuple[float, float]] = field(default_factory=deque)


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
    process: Process = "running"
    started_seconds: float = 0.0  # when its process started (simulated)
    pid: int = 0
    # requests a crash would fail, by id: in preprocessing, and in the running batch until each
    # one's completion (a batch outlives its shorter requests, which are answered already)
    preparing: dict[int, Request] = field(default_factory=dict)
    current: dict[int, Request] = field(default_factory=dict)
    # cumulative figures, as a serving process would count them
    cpu_seconds: float = 0.0
    read_bytes: float = 0.0
    batches: int = 0
    batch_size_sum: float = 0.0
    batch_delay_sum: float = 0.0  # per request: enqueue to the start of its batch
    batch_delay_count: int = 0
    requests_done: int = 0
    request_duration_sum: float = 0.0
    allocation_failures: int = 0
    prompt_tokens: int = 0  # of the requests answered
    generation_tokens: int = 0
    cpu_wait_seconds: float = 0.0  # waiting for a host core
    disk_wait_seconds: float = 0.0
    disk_busy_seconds: float = 0.0
    disk_reads: int = 0
    queue_area: float = 0.0  # integral of the queue length over time
    queue_since: float = 0.0
    # per service class of the worker's pool: [queued now, done, duration sum, delay sum,
    # delay count], what a server with per-class queues reports of each
    by_class: dict[str, list[float]] = field(default_factory=dict)

    def account_queue(self, now: float) -> None:
        """Add the queue's length times the time since its last change (before a change)."""
        self.queue_area += len(self.queue) * (now - self.queue_since)
        self.queue_since = now

    @property
    def accepting(self) -> bool:
        """Takes new requests: up, and not stopping."""
        return self.up and self.process == "running"

    def __post_init__(self) -> None:
        self.name = self.plan.name
        self.pid = self.pid or WORKER_PID_BASE + self.plan.index


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
        self.gpus = [GpuState(g, simpy.Resource(env, capacity=1)) for g in plan.gpus]
        self.workers = [self._worker_state(w) for w in plan.workers]
        self.by_name = {w.name: w for w in self.workers}
        # what a worker started for a pool runs like: the pool's first planned worker
        self.templates: dict[str, PlannedWorker] = {}
        for w in plan.workers:
            self.templates.setdefault(w.pool, w)
        self.pids = WORKER_PID_BASE + len(plan.workers)  # the last PID given out
        # the pools' servers, in order: whom the router may send a pool's requests
        self.pools: dict[str, list[WorkerState]] = {}
        for w in self.workers:
            self.pools.setdefault(w.plan.pool, []).append(w)
        self.central: dict[str, deque[Request]] = {p: deque() for p in self.pools}
        # the pool with a batch backend, as HAProxy's `be_<pool>_batch`: each of its workers'
        # admin state there (in maint until a split readies it; absent: maint), and the
        # requests that came through it
        self.split_pool = plan.splittable
        self.batch_states: dict[str, str] = {}
        self.via_batch: set[int] = set()
        self.batch_done: dict[str, int] = {}  # per worker, of the requests it answered
        self.records: list[RequestRecord] = []
        # when each request reached its worker, and that worker's batch queue, by id: where it
        # waited, for the benchmark's idle-while-queued
        self.admitted_at: dict[int, float] = {}
        self.queued_at: dict[int, float] = {}
        self.samples: list[Sample] = []
        self.frames: list[dict[str, object]] = []
        # when each GPU's server of a pool joined or left a route's service (its pool's: in
        # the pool's server list and not in maint; its pool's batch backend's, named
        # batch_backend(pool): not in maint there): the routes a GPU could serve at each
        # moment, for the benchmark's idle-while-queued. A removed or moving GPU serves none,
        # nor one whose worker is down (crashed, its GPU lost).
        self.service_changes: list[tuple[float, int, str, bool]] = [
            (0.0, w.plan.gpu, w.plan.pool, True) for w in self.workers
        ]
        # per worker, for the benchmark's idle-while-queued: when each request held one of its
        # preprocessing threads, and when one waited for a host core or the disk
        self.thread_holds: dict[str, list[tuple[float, float]]] = {}
        self.host_waits: dict[str, list[tuple[float, float]]] = {}
        self.telemetry = Telemetry(plan, "lab", ORIGIN_SECONDS)

    def _worker_state(self, w: PlannedWorker) -> WorkerState:
        classes = sorted({t.service_class for t in self.scenario.traffic})
        state = WorkerState(
            plan=w,
            gpu=self.gpus[w.gpu],
            service=ServiceModel(
                self.plan.gpus[w.gpu].card, w.model.params_billions, w.model.bytes_per_param
            ),
            threads=simpy.Resource(self.env, capacity=w.preprocess.threads),
            kv=KvRegion(w.kv_cache_bytes),
            cpu_ms=w.preprocess.cpu_ms,
            cpu_ms_per_1k=w.preprocess.cpu_ms_per_1k_prompt_tokens,
        )
        state.by_class = {c: [0, 0, 0.0, 0.0, 0] for c in classes if self.plan.pool_of(c) == w.pool}
        return state

    # -- running ----------------------------------------------------------------------------

    def run(self) -> RunResult:
        self.start()
        return self.finish()

    def start(self) -> None:
        """Set the server going; :meth:`advance` then runs it on, :meth:`finish` to the end."""
        env = self.env
        env.process(self._arrivals())
        for w in self.workers:
            env.process(self._batcher(w))
        for event in sorted(self.scenario.events, key=lambda e: e.at):
            env.process(self._event(event))
        env.process(self._telemetry())

    def advance(self, until_seconds: float) -> None:
        """Run to ``until_seconds`` (at most the duration); what happens at that very instant
        waits for the next call (SimPy stops before the events due then)."""
        until = min(until_seconds, self.duration)
        if until > self.env.now:
            self.env.run(until=until)

    def finish(self) -> RunResult:
        env = self.env
        self.advance(self.duration)
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
            limit = self.scenario.router.max_queue
            if limit is not None:
                # as HAProxy's `queue ge N` rule sees it: expired requests gone, free slots filled
                self._dispatch_pool(pool_name)
                if len(self.central[pool_name]) >= limit:
                    self._reject(request, 0.0, pool_name)  # answered 429 at once
                    return
            self.central[pool_name].append(request)
            self._dispatch_pool(pool_name)
            return
        pool = self.pools[pool_name]
        if request.service_class == BATCH_CLASS and pool_name == self.split_pool:
            # the frontend's `nbsrv(be_<pool>_batch) gt 0`: the batch backend while it has one
            split = [w for w in pool if w.accepting and self.takes_batch(w.name)]
            if split:
                self.via_batch.add(request.id)
                self._admit(request, self.router.pick(split, split, request.session))  # type: ignore[arg-type]
                return
        up = [w for w in pool if w.accepting and self.router.takes(w.name)]
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
                if w.accepting and w.in_flight < w.plan.max_batch_size and self.router.takes(w.name)
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
        self.admitted_at[request.id] = self.env.now
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
                    worker.cpu_wait_seconds += env.now - asked
                    self._waited(worker, asked)
                    yield env.timeout(cpu)
                    worker.cpu_seconds += cpu
                self.thread_holds.setdefault(worker.name, []).append((asked, env.now))
        io_mb = worker.plan.io_mb_per_request
        if io_mb > 0:
            asked = env.now
            with self.disk.request() as disk:
                yield disk
                worker.disk_wait_seconds += env.now - asked
                self._waited(worker, asked)
                seconds = io_mb / self.disk_mb_per_second
                yield env.timeout(seconds)
                worker.disk_busy_seconds += seconds
                worker.disk_reads += 1
                worker.read_bytes += io_mb * MIB
        if worker.generation != generation or not worker.up:
            return  # the worker crashed meanwhile; the crash failed this request already
        del worker.preparing[request.id]
        self._enqueue(request, worker)

    def _waited(self, worker: WorkerState, since: float) -> None:
        if self.env.now > since:
            self.host_waits.setdefault(worker.name, []).append((since, self.env.now))

    def _enqueue(self, request: Request, worker: WorkerState) -> None:
        self.queued_at[request.id] = self.env.now
        worker.account_queue(self.env.now)
        worker.queue.append((request, self.env.now))
        if request.service_class in worker.by_class:
            worker.by_class[request.service_class][0] += 1
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
        worker.account_queue(now)
        taken = [worker.queue.popleft() for _ in range(min(limit, len(worker.queue)))]
        for request, _ in taken:
            if (counts := worker.by_class.get(request.service_class)) is not None:
                counts[0] -= 1
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
        worker.batch_delay_sum += sum(now - enqueued for _, enqueued, _ in admitted)
        worker.batch_delay_count += len(admitted)
        for request, enqueued, _ in admitted:
            if (counts := worker.by_class.get(request.service_class)) is not None:
                counts[3] += now - enqueued
                counts[4] += 1
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
        if request.id in self.via_batch:
            self.batch_done[worker.name] = self.batch_done.get(worker.name, 0) + 1
        worker.request_duration_sum += now - request.arrival_seconds
        worker.prompt_tokens += request.prompt_tokens
        worker.generation_tokens += request.output_tokens
        if (counts := worker.by_class.get(request.service_class)) is not None:
            counts[1] += 1
            counts[2] += now - request.arrival_seconds
        self.records.append(self._record(request, start, now, worker, "ok", worker.running))
        self._freed(worker)

    def _freed(self, worker: WorkerState) -> None:
        if worker.process == "stopping" and worker.in_flight == 0:
            self._exited(worker)
        elif self.scenario.router.policy == "pooled":
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
        worker.account_queue(now)
        worker.queue.clear()
        for counts in worker.by_class.values():
            counts[0] = 0
        worker.preparing = {}
        worker.current = {}
        worker.running = 0
        worker.kv = KvRegion(worker.plan.kv_cache_bytes)
        self._set_up(worker, False)
        if worker.wake is not None and not worker.wake.triggered:
            worker.wake.succeed()

    # -- worker moves -----------------------------------------------------------------------------

    def load_seconds(self, worker: PlannedWorker) -> float:
        """How long a started worker serves nothing: its weights read from the host's disk,
        then the engine's start-up."""
        return worker.model.weights_bytes / (self.disk_mb_per_second * MIB) + START_UP_SECONDS

    def worker_on(self, gpu: int) -> WorkerState:
        """The GPU's worker process (stopped, if a move stopped it and started none yet)."""
        found = [w for w in self.workers if w.plan.gpu == gpu]
        if len(found) != 1:
            raise ValueError(f"GPU {gpu} has {len(found)} workers; moves need one per GPU")
        return found[0]

    def routes(self, worker: WorkerState) -> frozenset[str]:
        """Whose requests the worker's server may be sent: its pool's (one of the pool's
        servers, not in maint), and those of its pool's batch backend, named
        ``batch_backend(pool)`` (not in maint there). None while out of its pool, or down
        (crashed, exited, loading: HAProxy's health check has its server down)."""
        pool = worker.plan.pool
        if worker not in self.pools[pool] or not worker.up:
            return frozenset()
        shared = self.router.states.get(worker.name) != "maint"
        split = self.batch_states.get(worker.name, "maint") != "maint"
        return frozenset([pool] * shared + [batch_backend(pool)] * split)

    def route_of(self, request_id: int, service_class: str) -> str:
        """The route a request came by: its class's pool, or that pool's batch backend."""
        pool = self.plan.pool_of(service_class)
        return batch_backend(pool) if request_id in self.via_batch else pool

    def takes_batch(self, name: str) -> bool:
        """Whether the batch backend sends the worker new requests: ready there, weighted."""
        return self.batch_states.get(name, "maint") == "ready" and self.router.weight(name) > 0

    def set_batch_state(self, name: str, state: str) -> None:
        """The worker's admin state in its pool's batch backend: "ready", "drain" or "maint"."""
        worker = self.by_name[name]
        if worker.plan.pool != self.split_pool:
            raise ValueError(f"worker {name} is not of the pool with a batch backend")
        was = self.routes(worker)
        self.batch_states[name] = state
        self._note_service(worker, was)

    def held_via_batch(self, worker: WorkerState) -> int:
        """Of the requests the worker holds, those the batch backend sent it."""
        held = [*worker.preparing, *(r.id for r, _ in worker.queue), *worker.current]
        return sum(1 for i in held if i in self.via_batch)

    def _set_up(self, worker: WorkerState, up: bool) -> None:
        """The worker's process came up (serving) or went down (crashed, lost with its GPU,
        exited, loading): down, HAProxy's health check takes its server out of service."""
        was = self.routes(worker)
        worker.up = up
        self._note_service(worker, was)

    def _note_service(self, worker: WorkerState, was: frozenset[str]) -> None:
        now = self.routes(worker)
        for route in sorted(now ^ was):
            self.service_changes.append((self.env.now, worker.plan.gpu, route, route in now))

    def set_server_state(self, name: str, state: str | None) -> None:
        """The server's admin state: "drain" or "maint"; None: ready."""
        worker = self.by_name[name]
        was = self.routes(worker)
        if state is None:
            self.router.states.pop(name, None)
        else:
            self.router.states[name] = state
        self._note_service(worker, was)

    def service_intervals(self) -> dict[int, dict[str, list[tuple[float, float]]]]:
        """Each GPU's stretches of [0, duration] in service, per route (:meth:`routes`): while
        one of its workers or more serves the route."""
        out: dict[int, dict[str, list[tuple[float, float]]]] = {}
        since: dict[tuple[int, str], float] = {}
        serving_now: Counter[tuple[int, str]] = Counter()
        for at, gpu, pool, serving in sorted(self.service_changes, key=lambda c: c[0]):
            stretches = out.setdefault(gpu, {}).setdefault(pool, [])
            serving_now[gpu, pool] += 1 if serving else -1
            if serving_now[gpu, pool] > 0:
                since.setdefault((gpu, pool), at)
            elif (start := since.pop((gpu, pool), None)) is not None and at > start:
                stretches.append((start, at))
        for (gpu, pool), start in since.items():
            if start < self.duration:
                out[gpu][pool].append((start, self.duration))
        return out

    def remove_server(self, name: str) -> None:
        """The worker's server leaves its pool: the router sends it nothing more."""
        worker = self.by_name[name]
        was = self.routes(worker)
        pool = self.pools[worker.plan.pool]
        if worker in pool:
            pool.remove(worker)
        self._note_service(worker, was)

    def add_server(self, name: str) -> None:
        """The worker's server joins its pool (the router's admin state and weight apply)."""
        worker = self.by_name[name]
        was = self.routes(worker)
        pool = self.pools[worker.plan.pool]
        if worker not in pool:
            pool.append(worker)
            pool.sort(key=lambda w: w.plan.gpu)
        self._note_service(worker, was)
        self._freed(worker)  # pooled: the central queue has work for it now

    def stop_worker(self, name: str) -> None:
        """SIGTERM: the worker takes no new requests, finishes those in flight, then exits
        (its server stays in the pool, down, until it is removed)."""
        worker = self.by_name[name]
        if worker.process in ("stopped", "stopping"):
            return
        if worker.process == "loading" or worker.in_flight == 0:
            self._exited(worker)
        else:
            worker.process = "stopping"

    def kill_worker(self, name: str) -> None:
        """SIGKILL: what the worker holds fails now."""
        worker = self.by_name[name]
        if worker.process != "stopped":
            self._fail_worker(worker)
            self._exited(worker)

    def _exited(self, worker: WorkerState) -> None:
        worker.process = "stopped"
        self._set_up(worker, False)

    def start_worker(self, gpu: int, pool: str) -> WorkerState:
        """Start the worker of ``pool`` on ``gpu``, whose own has exited: it loads its model
        for `load_seconds`, then is ready; it serves once its server is added (`add_server`)."""
        if pool not in self.templates:
            raise ValueError(f"pool {pool!r} is not among the scenario's {sorted(self.templates)}")
        old = self.worker_on(gpu)
        if old.process != "stopped":
            raise ValueError(f"GPU {gpu}'s worker {old.name} is {old.process}, not stopped")
        planned = placed(self.plan, self.templates[pool], gpu, old.name, old.plan.index)
        worker = self._worker_state(planned)
        self.pids += 1
        worker.pid = self.pids
        worker.process, worker.up = "loading", False
        worker.started_seconds = self.env.now
        at = self.workers.index(old)
        self.workers[at] = worker
        self.by_name[worker.name] = worker
        self.plan = replace(self.plan, workers=tuple(w.plan for w in self.workers))
        self.telemetry.replace(self.plan, worker.name)
        self.env.process(self._batcher(worker))
        self.env.process(self._load(worker))
        return worker

    def _load(self, worker: WorkerState) -> Iterator[simpy.Event]:
        yield self.env.timeout(self.load_seconds(worker.plan))
        if worker.process == "loading" and not worker.gpu.lost:
            worker.process = "running"
            self._set_up(worker, True)
            self._freed(worker)

    # -- scenario events ------------------------------------------------------------------------

    def _event(self, event: Event) -> Iterator[simpy.Event]:
        yield self.env.timeout(event.at)
        action = event.action
        if action == "throttle":
            assert event.throttle is not None
            gpu = self.gpus[event.throttle.gpu]
            gpu.clock_ratio = event.throttle.clock_ratio
            # back to full clock ends the throttle: no reason stays behind
            gpu.reason = event.throttle.reason if gpu.clock_ratio < 1 else None
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
            self._set_up(worker, True)
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
        figures = {w.name: self._figures(w) for w in self.workers}
        busy = {
            g.plan.index: 0.0 if g.lost else self._busy_between(g, start, end) for g in self.gpus
        }
        clock = {g.plan.index: (g.clock_ratio, g.reason) for g in self.gpus}
        lost = {g.plan.index for g in self.gpus if g.lost}
        sample, frames = self.telemetry.sample(end, dt, figures, busy, clock, lost)
        self.frames.extend(frames)
        self.samples.append(sample)
        if self.on_sample is not None:
            self.on_sample(sample)

    def _queue_area(self, w: WorkerState) -> float:
        w.account_queue(self.env.now)
        return w.queue_area

    def _figures(self, w: WorkerState) -> WorkerFigures:
        return WorkerFigures(
            name=w.name,
            pid=w.pid,
            up=w.up,
            present=w.process != "stopped" and w.process != "loading",
            busy_seconds=0.0,  # the GPU's busy time is counted per GPU here
            queue_depth=len(w.queue),
            queue_area=self._queue_area(w),
            running=w.running,
            in_flight=w.in_flight,
            kv_used_bytes=w.kv.used_bytes,
            kv_reserved_bytes=w.kv.reserved_bytes,
            cpu_seconds=w.cpu_seconds,
            read_bytes=w.read_bytes,
            batches=w.batches,
            batch_size_sum=w.batch_size_sum,
            batch_delay_sum=w.batch_delay_sum,
            batch_delay_count=w.batch_delay_count,
            requests_done=w.requests_done,
            request_duration_sum=w.request_duration_sum,
            allocation_failures=w.allocation_failures,
            prompt_tokens=w.prompt_tokens,
            generation_tokens=w.generation_tokens,
            cpu_wait_seconds=w.cpu_wait_seconds,
            disk_wait_seconds=w.disk_wait_seconds,
            disk_busy_seconds=w.disk_busy_seconds,
            disk_reads=w.disk_reads,
            create_time_seconds=ORIGIN_SECONDS + w.started_seconds,
            classes=tuple(
                ClassFigures(c, int(n[0]), int(n[1]), n[2], n[3], int(n[4]))
                for c, n in w.by_class.items()
            ),
        )


def placed(plan: Plan, template: PlannedWorker, gpu: int, name: str, index: int) -> PlannedWorker:
    """A worker like ``template`` (its pool's model, batching, preprocessing) alone on ``gpu``:
    the template's KV cache on the same card, else what the model's weights leave of it."""
    card = plan.gpus[gpu].card
    kv = template.kv_cache_bytes
    if card != plan.gpus[template.gpu].card:
        model = template.model
        kv = card.memory_total_bytes - model.weights_bytes - model.overhead_mib * MIB
    return replace(template, name=name, index=index, gpu=gpu, kv_cache_bytes=kv)


def simulate(
    plan: Plan,
    requests: Sequence[Request],
    seed: int,
    duration_seconds: float,
    on_sample: Callable[[Sample], None] | None = None,
) -> RunResult:
    return FastRun(plan, requests, seed, duration_seconds, on_sample).run()

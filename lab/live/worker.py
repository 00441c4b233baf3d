"""A live-speed worker: one real process per simulated serving worker, an HTTP server that
batches requests and holds its simulated GPU for as long as the lab's service model says.

Same model as the fast speed (lab/model): preprocessing on the host's shared cores (at most
``threads`` at a time for this worker), data loading from the shared disk, a dynamic batcher
(max batch size, max queue delay), a KV region with fragmentation, static batching whose
requests finish after their own last token. Host cores, the disk and each GPU are shared
between worker processes through multiprocessing primitives the orchestrator hands over.

Endpoints: ``POST /infer`` (the load generator's contract, see lab/live/loadgen.py),
``GET /metrics`` (the serving stack's own metrics, in vLLM's or Triton's exposition format),
``GET /state`` (cumulative figures for the orchestrator), ``POST /control`` (scenario events),
``GET /healthz`` (HAProxy's health check).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import signal
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from aiohttp import web

from gpubalance.instrument import ServingMetrics
from gpubalance.lab.catalogue import CARDS
from gpubalance.lab.live.formats import render_metrics
from gpubalance.lab.live.locks import FileLock, FileSemaphore
from gpubalance.lab.model.memory import AllocationFailed, KvRegion
from gpubalance.lab.model.service import ServiceModel

# Buckets of the queue-time and latency histograms the worker serves (seconds).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class WorkerConfig:
    name: str
    index: int
    gpu: int
    gpu_uuid: str
    card: str
    model_name: str
    params_billions: float
    bytes_per_param: float
    kv_bytes_per_token: int
    kv_cache_bytes: int
    weights_bytes: int
    max_batch_size: int
    max_queue_delay_seconds: float
    cpu_ms: float
    cpu_ms_per_1k: float
    threads: int
    io_mb_per_request: float
    port: int
    metrics_format: str = "vllm"  # vllm | triton | tgi | otlp (pushes to otlp_endpoint)
    otlp_endpoint: str | None = None
    host: str = "127.0.0.1"


@dataclass
class Shared:
    """What the workers share: host cores, the disk and its bandwidth, one lock per GPU.

    The locks are file locks (lab/live/locks.py), so a crashed worker frees what it held.
    """

    cores: FileSemaphore
    disk: FileLock
    disk_mb_per_second: Any  # multiprocessing Value("d"), set by the orchestrator's events
    engines: list[FileLock]


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1


class Worker:
    def __init__(self, config: WorkerConfig, shared: Shared) -> None:
        self.config = config
        self.shared = shared
        self.service = ServiceModel(
            CARDS[config.card], config.params_billions, config.bytes_per_param
        )
        self.kv = KvRegion(config.kv_cache_bytes)
        self.cpu_ms, self.cpu_ms_per_1k = config.cpu_ms, config.cpu_ms_per_1k
        self.clock_ratio = 1.0
        self.up = True
        self.down_reason = ""
        # (prompt tokens, output tokens, enqueued at (time.time), future of the reply)
        self.queue: deque[tuple[int, int, float, asyncio.Future[Any]]] = deque()
        self.current: list[asyncio.Future[Any]] = []  # replies of the batch on the GPU
        self.otlp: ServingMetrics | None = None  # when the worker pushes OTLP
        # integral of the queue length over time: the exact mean queue over any period
        self.queue_area = 0.0
        self._queue_since = time.monotonic()
        self.wake = asyncio.Event()
        self.threads = asyncio.Semaphore(config.threads)
        self.disk_turn = asyncio.Lock()  # one of ours at a time waits for the shared disk
        # blocking waits on the cross-process primitives run here, off the event loop
        self.executor = ThreadPoolExecutor(max_workers=config.threads + 2)
        self.in_flight = 0
        self.running = 0
        self.batch_started: float | None = None
        # cumulative figures
        self.busy_seconds = 0.0
        self.cpu_seconds = 0.0
        self.read_bytes = 0.0
        self.batches = 0
        self.batch_size_sum = 0.0
        self.batch_delay_sum = 0.0  # per request: enqueue to the start of its batch
        self.batch_delay_count = 0
        self.requests_done = 0
        self.request_duration_sum = 0.0
        self.allocation_failures = 0
        self.prompt_tokens = 0  # of the requests answered
        self.generation_tokens = 0
        self.rejected = 0
        self.cpu_wait_seconds = 0.0  # waiting for a host core (PSI cpu "some")
        self.disk_wait_seconds = 0.0  # waiting for the disk (PSI io)
        self.disk_busy_seconds = 0.0
        self.disk_reads = 0
        self.queue_time = Histogram(LATENCY_BUCKETS)  # at batch start, as vLLM counts it
        self.queue_done_seconds = 0.0  # of completed requests, as Triton counts it
        self.latency = Histogram(LATENCY_BUCKETS)

    # -- HTTP ---------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/infer", self.infer)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/state", self.state)
        app.router.add_post("/control", self.control)
        app.router.add_get("/healthz", self.healthz)
        return app

    async def infer(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            rid = int(body["id"])
            prompt, output = int(body["prompt_tokens"]), int(body["output_tokens"])
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": f"bad request: {exc}"}, status=400)
        if not self.up:
            self.rejected += 1
            return web.json_response({"id": rid, "reason": self.down_reason}, status=503)
        arrived = time.time()
        self.in_flight += 1
        try:
            await self._prepare(prompt)
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._account_queue()
            self.queue.append((prompt, output, time.time(), future))
            self.wake.set()
            if self.otlp is not None:
                self.otlp.set_queue_depth(len(self.queue))
            result = await future
        finally:
            self.in_flight -= 1
        if result.get("reason"):
            return web.json_response({"id": rid, **result}, status=503)
        self.requests_done += 1
        # Triton counts a request's queue time when the request completes
        self.queue_done_seconds += result["started_at"] - result["enqueued_at"]
        self.request_duration_sum += result["finished_at"] - arrived
        self.latency.observe(result["finished_at"] - arrived)
        self.prompt_tokens += prompt
        self.generation_tokens += output
        if self.otlp is not None:
            self.otlp.request_finished(
                result["finished_at"] - arrived, prompt_tokens=prompt, generated_tokens=output
            )
        return web.json_response(
            {"id": rid, "gpu": self.config.gpu, "worker": self.config.name, **result}
        )

    async def _prepare(self, prompt_tokens: int) -> None:
        loop = asyncio.get_running_loop()
        cpu = (self.cpu_ms + self.cpu_ms_per_1k * prompt_tokens / 1000) / 1000
        if cpu > 0:
            async with self.threads:
                asked = time.monotonic()
                core = await loop.run_in_executor(self.executor, self.shared.cores.acquire)
                self.cpu_wait_seconds += time.monotonic() - asked
                try:
                    await asyncio.sleep(cpu)
                    self.cpu_seconds += cpu
                finally:
                    self.shared.cores.release(core)
        io_mb = self.config.io_mb_per_request
        if io_mb > 0:
            asked = time.monotonic()
            async with self.disk_turn:
                disk = await loop.run_in_executor(self.executor, self.shared.disk.acquire)
                self.disk_wait_seconds += time.monotonic() - asked
                try:
                    seconds = io_mb / self.shared.disk_mb_per_second.value
                    await asyncio.sleep(seconds)
                    self.disk_busy_seconds += seconds
                    self.disk_reads += 1
                    self.read_bytes += io_mb * 1024 * 1024
                finally:
                    self.shared.disk.release(disk)

    async def metrics(self, request: web.Request) -> web.Response:
        text = render_metrics(self.config.metrics_format, self)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    def _account_queue(self) -> None:
        """Add the queue's length times the time since its last change (call before a change)."""
        now = time.monotonic()
        self.queue_area += len(self.queue) * (now - self._queue_since)
        self._queue_since = now

    def figures(self) -> dict[str, Any]:
        self._account_queue()
        busy = self.busy_seconds
        if self.batch_started is not None:
            busy += time.monotonic() - self.batch_started
        return {
            "name": self.config.name,
            "pid": os.getpid(),
            "up": self.up,
            "busy_seconds": busy,
            "queue_depth": len(self.queue),
            "queue_area": self.queue_area,
            "running": self.running,
            "in_flight": self.in_flight,
            "kv_used_bytes": self.kv.used_bytes,
            "kv_reserved_bytes": self.kv.reserved_bytes,
            "cpu_seconds": self.cpu_seconds,
            "read_bytes": self.read_bytes,
            "batches": self.batches,
            "batch_size_sum": self.batch_size_sum,
            "batch_delay_sum": self.batch_delay_sum,
            "batch_delay_count": self.batch_delay_count,
            "requests_done": self.requests_done,
            "request_duration_sum": self.request_duration_sum,
            "allocation_failures": self.allocation_failures,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "clock_ratio": self.clock_ratio,
            "cpu_wait_seconds": self.cpu_wait_seconds,
            "disk_wait_seconds": self.disk_wait_seconds,
            "disk_busy_seconds": self.disk_busy_seconds,
            "disk_reads": self.disk_reads,
        }

    async def state(self, request: web.Request) -> web.Response:
        return web.json_response(self.figures())

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(
            text="ok\n" if self.up else f"{self.down_reason}\n",
            status=200 if self.up else 503,
            # whose answer it is: a port another lab's worker took answers 200 too
            headers={WORKER_PID_HEADER: str(os.getpid())},
        )

    async def control(self, request: web.Request) -> web.Response:
        body = await request.json()
        if "clock_ratio" in body:
            self.clock_ratio = float(body["clock_ratio"])
        if body.get("cpu_ms") is not None:
            self.cpu_ms = float(body["cpu_ms"])
        if body.get("cpu_ms_per_1k") is not None:
            self.cpu_ms_per_1k = float(body["cpu_ms_per_1k"])
        if body.get("fail"):
            self._fail(str(body["fail"]))
        return web.json_response(self.figures())

    def _fail(self, reason: str) -> None:
        """The GPU is gone: everything queued or running is answered 503, nothing new taken."""
        self.up, self.down_reason = False, reason
        while self.queue:
            self._account_queue()
            *_, future = self.queue.popleft()
            if not future.done():
                future.set_result({"reason": reason})
        for future in self.current:
            if not future.done():
                future.set_result({"reason": reason})
        self.wake.set()

    # -- the batcher --------------------------------------------------------------------------

    async def batcher(self) -> None:
        loop = asyncio.get_running_loop()
        limit = self.config.max_batch_size
        max_delay = self.config.max_queue_delay_seconds
        engine = self.shared.engines[self.config.gpu]
        while True:
            if not self.queue or not self.up:
                self.wake.clear()
                await self.wake.wait()
                continue
            while len(self.queue) < limit and max_delay > 0 and self.up:
                wait = self.queue[0][2] + max_delay - time.time()
                if wait <= 0:
                    break
                self.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), wait)
            if not self.queue or not self.up:
                continue
            held = await loop.run_in_executor(self.executor, engine.acquire)
            try:
                await self._run_batch(limit)
            finally:
                engine.release(held)

    async def _run_batch(self, limit: int) -> None:
        if not self.up or not self.queue:
            return
        loop = asyncio.get_running_loop()
        started = time.time()
        self._account_queue()
        taken = [self.queue.popleft() for _ in range(min(limit, len(self.queue)))]
        admitted = []
        for prompt, output, enqueued, future in taken:
            need = (prompt + output) * self.config.kv_bytes_per_token
            try:
                admitted.append((prompt, output, enqueued, future, self.kv.allocate(need)))
            except AllocationFailed:
                self.allocation_failures += 1
                future.set_result({"reason": "oom"})
                if self.otlp is not None:
                    self.otlp.allocation_failed()
        if not admitted:
            return
        busy, finishes = self.service.batch_timeline(
            [a[0] for a in admitted], [a[1] for a in admitted], self.clock_ratio
        )
        self.batches += 1
        self.batch_size_sum += len(admitted)
        self.batch_delay_sum += sum(started - a[2] for a in admitted)
        self.batch_delay_count += len(admitted)
        self.running = len(admitted)
        self.current = [a[3] for a in admitted]
        self.batch_started = time.monotonic()
        if self.otlp is not None:
            self.otlp.set_queue_depth(len(self.queue))
            self.otlp.batch_started([started - a[2] for a in admitted])
        for (_, _, enqueued, future, _), finish in zip(admitted, finishes, strict=True):
            self.queue_time.observe(started - enqueued)
            loop.call_later(
                finish,
                _complete,
                future,
                {
                    "enqueued_at": enqueued,
                    "started_at": started,
                    "batch_size": len(admitted),
                },
            )
        await asyncio.sleep(busy)
        self.busy_seconds += time.monotonic() - self.batch_started
        self.batch_started = None
        self.running = 0
        self.current = []
        for *_, allocation in admitted:
            self.kv.free(allocation)


def _complete(future: asyncio.Future[Any], result: dict[str, Any]) -> None:
    if not future.done():
        future.set_result({**result, "finished_at": time.time()})


async def _serve(config: WorkerConfig, shared: Shared) -> None:
    worker = Worker(config, shared)
    if config.metrics_format == "otlp" and config.otlp_endpoint:
        worker.otlp = ServingMetrics(
            config.otlp_endpoint,
            worker=config.name,
            gpu_uuid=config.gpu_uuid,
            gpu_index=config.gpu,
            export_interval_seconds=0.5,
            max_batch_size=config.max_batch_size,
        )
    runner = web.AppRunner(worker.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port, backlog=2048).start()
    batcher = asyncio.create_task(worker.batcher())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    batcher.cancel()
    await runner.cleanup()
    if worker.otlp is not None:
        worker.otlp.shutdown()


# the header of /healthz that names the worker process answering
WORKER_PID_HEADER = "X-Lab-Worker-Pid"
# the exit code of a worker whose port another process took before it could bind it (the
# lab picks a free port, then the worker starts and binds it): the lab picks another
PORT_TAKEN_EXIT = 98


def main(config_json: str, shared: Shared) -> None:
    """Process entry point (multiprocessing, spawn)."""
    config = WorkerConfig(**json.loads(config_json))
    # the name shows in ps, /proc/<pid>/comm and the exporter's process attribution
    with contextlib.suppress(OSError), open(f"/proc/{os.getpid()}/comm", "w") as comm:
        comm.write(f"lab-{config.name}"[:15])
    try:
        asyncio.run(_serve(config, shared))
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        print(f"lab worker {config.name}: port {config.port} is taken", file=sys.stderr)
        sys.exit(PORT_TAKEN_EXIT)


def config_json(config: WorkerConfig) -> str:
    return json.dumps(asdict(config))

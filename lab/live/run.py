"""The live speed: the lab's server in real time, as real processes a real exporter can read.

One process per worker (lab/live/worker.py: HTTP, batching, a GPU held for the service model's
time), a real HAProxy in front (lab/live/haproxy.py), the request stream sent as real HTTP on
schedule (lab/live/loadgen.py). The orchestrator polls the workers, turns their counts into
sensor readings (lab/figures.py) and writes them where an exporter reads a server: the fake NVML
driver's state file (the workers' real PIDs listed under their GPU) and a procfs tree
(lab/live/procfs.py), so host-bound behaviour does not depend on this machine's real CPU load.
Scenario events are applied on time: throttles and preprocessing changes through the workers'
control endpoint, a lost GPU in the driver state, a crashed worker killed (and restarted),
weights through HAProxy's runtime API.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from gpubalance.controller.plan import batch_backend
from gpubalance.lab.catalogue import CARDS
from gpubalance.lab.fakenvml import THROTTLE_REASONS, build_library, write_state
from gpubalance.lab.figures import (
    DRIVER_VERSION,
    RESERVED_BYTES,
    Telemetry,
    WorkerFigures,
    memory_used_bytes,
)
from gpubalance.lab.live import haproxy
from gpubalance.lab.live.loadgen import send_all
from gpubalance.lab.live.locks import FileLock, FileSemaphore
from gpubalance.lab.live.ports import PortTakenError, free_port
from gpubalance.lab.live.procfs import write_procfs
from gpubalance.lab.live.worker import (
    PORT_TAKEN_EXIT,
    WORKER_PID_HEADER,
    Shared,
    WorkerConfig,
    config_json,
)
from gpubalance.lab.live.worker import main as worker_main
from gpubalance.lab.routing import sticky_target
from gpubalance.lab.scenario import BATCH_CLASS, Event, Plan, PlannedWorker
from gpubalance.lab.workload import Request, RequestRecord
from gpubalance.telemetry import Sample

log = logging.getLogger(__name__)

SCRAPED_FORMATS = ("vllm", "triton", "tgi")  # the workers' /metrics formats the exporter scrapes
STATE_PERIOD_SECONDS = 0.25  # how often the driver state and procfs tree are rewritten
BUILD_DIR = Path("build") / "fakenvml"
# one start-up probe of a worker's /healthz
READY_PROBE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
# HAProxy weights are integers 0..256: the lab's float weights are scaled to this maximum
MAX_WEIGHT = 100


# what the exporter logs once it listens on its scrape port, then on its OTLP port
_LISTENING = ("listening on http://", "OTLP receiver at http://")


def _run_dir() -> Path:
    # tmpfs keeps the 4-per-second rewrites of the state file and procfs tree cheap
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="gpubalance-lab-", dir=base))


@dataclass
class Exporter:
    """An exporter process reading the live lab, for the demo and the tests."""

    process: subprocess.Popen[bytes]
    url: str
    log_path: Path


@dataclass
class LiveLab:
    plan: Plan
    requests: Sequence[Request]
    duration_seconds: float
    on_sample: Callable[[Sample], None] | None = None
    start_exporter: bool = False
    exporter_args: Sequence[str] = ()
    run_dir: Path = field(default_factory=_run_dir)
    build_dir: Path = BUILD_DIR
    # how the workers report their queues, in turn: /metrics in vLLM's or Triton's format, or
    # OTLP pushes to the exporter (only when the lab runs one)
    metrics_formats: Sequence[str] | None = None
    on_ready: Callable[[LiveLab], None] | None = None
    keep_files: bool = False  # leave run_dir (state, procfs tree, logs) behind for a look

    def __post_init__(self) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        host = self.plan.scenario.hardware.host
        locks = self.run_dir / "locks"
        self.shared = Shared(
            cores=FileSemaphore(locks / "cores", host.cores),
            disk=FileLock(locks / "disk"),
            disk_mb_per_second=self.ctx.Value("d", host.disk_mb_per_second),
            engines=[FileLock(locks / f"gpu{g.index}") for g in self.plan.gpus],
        )
        self.exporter_port = free_port()
        self.otlp_port = free_port()  # the exporter's OTLP listener, apart from its scrape port
        if self.metrics_formats is None:
            self.metrics_formats = (
                ("vllm", "triton", "otlp") if self.start_exporter else ("vllm", "triton")
            )
        self.configs = {w.name: self._config(w) for w in self.plan.workers}
        self.processes: dict[str, Any] = {}
        self.created: dict[str, float] = {}
        self.state_path = self.run_dir / "nvml.state"
        self.procfs = self.run_dir / "proc"
        self.clock = {g.index: (1.0, None) for g in self.plan.gpus}
        self.lost: set[int] = set()
        self.down: set[str] = set()
        self.telemetry = Telemetry(self.plan, "lab", time.time())
        self.frames: list[dict[str, object]] = []
        self.boot_time = math.floor(time.time()) - 86400
        self.exporter: Exporter | None = None
        self.frontend_port = free_port()
        self._carry: dict[str, WorkerFigures] = {}  # counts of crashed workers
        self._figures: dict[str, WorkerFigures] = {}
        self.last_sample: Sample | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @contextlib.contextmanager
    def _balancer(self) -> Iterator[haproxy.HaproxyProcess]:
        """HAProxy on the lab's frontend port (another, if a process took that one before
        HAProxy bound it), stopped on leaving."""
        balancer = haproxy.start_on_free_ports(self._haproxy_config())
        self.frontend_port = balancer.config.frontends[0].port
        try:
            yield balancer
        finally:
            balancer.stop()

    def _config(self, w: PlannedWorker) -> WorkerConfig:
        gpu = self.plan.gpus[w.gpu]
        return WorkerConfig(
            name=w.name,
            index=w.index,
            gpu=w.gpu,
            gpu_uuid=gpu.uuid,
            card=next(k for k, v in CARDS.items() if v is gpu.card),
            model_name=w.model_name,
            params_billions=w.model.params_billions,
            bytes_per_param=w.model.bytes_per_param,
            kv_bytes_per_token=w.model.kv_bytes_per_token,
            kv_cache_bytes=w.kv_cache_bytes,
            weights_bytes=w.model.weights_bytes,
            max_batch_size=w.max_batch_size,
            max_queue_delay_seconds=w.max_queue_delay_seconds,
            cpu_ms=w.preprocess.cpu_ms,
            cpu_ms_per_1k=w.preprocess.cpu_ms_per_1k_prompt_tokens,
            threads=w.preprocess.threads,
            io_mb_per_request=w.io_mb_per_request,
            port=free_port(),
            metrics_format=self.metrics_formats[w.index % len(self.metrics_formats)],
            otlp_endpoint=f"http://127.0.0.1:{self.otlp_port}/v1/metrics",
        )

    # -- processes ------------------------------------------------------------------------------

    def _spawn(self, name: str) -> None:
        process = self.ctx.Process(
            target=worker_main,
            args=(config_json(self.configs[name]), self.shared),
            name=f"lab-{name}",
            daemon=True,
        )
        process.start()
        self.processes[name] = process
        self.created[name] = time.time()

    async def _wait_ready(self, session: aiohttp.ClientSession, names: Sequence[str]) -> None:
        deadline = time.monotonic() + 60
        for name in names:
            url = f"http://127.0.0.1:{self.configs[name].port}/healthz"
            while True:
                # a port held by something else may take the connection and never answer
                # ... or answer for another process: another lab's worker that took the port
                mine = str(self.processes[name].pid)
                with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                    async with session.get(url, timeout=READY_PROBE_TIMEOUT) as resp:
                        if resp.status == 200 and resp.headers.get(WORKER_PID_HEADER) == mine:
                            break
                if not self.processes[name].is_alive():
                    code = self.processes[name].exitcode
                    if code == PORT_TAKEN_EXIT:
                        raise PortTakenError(f"worker {name}: port {self.configs[name].port}")
                    raise RuntimeError(f"worker {name} exited during start-up (exit code {code})")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"worker {name} did not answer within 60 s")
                await asyncio.sleep(0.05)

    async def _start_up(
        self, session: aiohttp.ClientSession, library_dir: Path, tries: int = 3
    ) -> None:
        """Wait for the spawned workers; one whose port another process took between its
        choice and the worker's bind (an outgoing connection's, on a busy host) gets another
        port and starts again: HAProxy is configured only once they all answer, and an
        exporter already running starts again with the new endpoints to scrape (only for a
        worker it scrapes: one that pushes OTLP pushes to the same exporter from any port, and
        a restart would cost its first pushes, which back off while the exporter is away)."""
        moved = False
        for name in self.configs:
            for attempt in range(1, tries + 1):
                try:
                    await self._wait_ready(session, [name])
                    break
                except PortTakenError as exc:
                    if attempt == tries:
                        raise RuntimeError(f"{exc} was taken {tries} times in a row") from None
                    log.info("%s was taken; starting it on another port", exc)
                    self.configs[name] = replace(self.configs[name], port=free_port())
                    self._spawn(name)
                    moved = moved or self.configs[name].metrics_format in SCRAPED_FORMATS
        if moved and self.exporter is not None:
            self.exporter.process.terminate()
            self.exporter.process.wait(timeout=10)
            # on the same ports: the workers running now push OTLP to the one they were given
            self.exporter = await self._exporter_listening(library_dir, tries=1)

    def _haproxy_config(self) -> haproxy.HaproxyConfig:
        router = self.plan.scenario.router
        policy = {"weighted_round_robin": "round_robin"}.get(router.policy, router.policy)
        backends = []
        for pool in sorted({w.pool for w in self.plan.workers}):
            servers = tuple(
                haproxy.Server(
                    name=w.name,
                    host="127.0.0.1",
                    port=self.configs[w.name].port,
                    weight=self._weight(router.weights.get(w.name, 1.0)),
                    maxconn=w.max_batch_size if policy == "pooled" else None,
                )
                for w in self.plan.workers_in(pool)
            )
            backends.append(
                haproxy.Backend(
                    name=haproxy.pool_backend(pool),
                    servers=servers,
                    policy=policy,
                    queue_timeout_seconds=router.queue_timeout_seconds,
                    health_check_path="/healthz",
                    max_queue=router.max_queue,
                )
            )
        routes = {cls: haproxy.pool_backend(pool) for cls, pool in router.pools.items()}
        fallback = haproxy.pool_backend("default")
        default = fallback if any(b.name == fallback for b in backends) else backends[0].name
        split: dict[str, str] = {}
        if (pool := self.plan.splittable) is not None:
            # the pool's batch backend: its servers in maint until a controller's split
            # readies the batch side's, and the batch class goes there while one is up
            shared = next(b for b in backends if b.name == haproxy.pool_backend(pool))
            servers = tuple(replace(s, disabled=True) for s in shared.servers)
            backends.append(replace(shared, name=batch_backend(shared.name), servers=servers))
            split = {BATCH_CLASS: batch_backend(shared.name)}
        return haproxy.HaproxyConfig(
            frontends=(
                haproxy.Frontend(
                    name="fe_lab",
                    port=self.frontend_port,
                    default_backend=default,
                    routes=routes,
                    routes_while_up=split,
                ),
            ),
            backends=tuple(backends),
            run_dir=self.run_dir,
        )

    def _exporter_config(self) -> Path:
        """The exporter's serving endpoints: the workers that serve their own /metrics, each
        mapped to its GPU (the lab's procfs has no sockets to find them by)."""
        endpoints = [
            {
                "url": f"http://127.0.0.1:{c.port}/metrics",
                "format": c.metrics_format,
                "worker": c.name,
                "gpu": c.gpu,
                "max_batch_size": c.max_batch_size,
            }
            for c in self.configs.values()
            if c.metrics_format in SCRAPED_FORMATS
        ]
        path = self.run_dir / "exporter.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "exporter": {
                        "serving": {
                            "scrape_interval": 0.5,
                            "timeout": 1.0,
                            "stale_after": 5.0,
                            "endpoints": endpoints,
                        }
                    }
                },
                sort_keys=False,
            )
        )
        return path

    async def _exporter_listening(self, library_dir: Path, tries: int = 3) -> Exporter:
        """The exporter, once it says it listens on both its ports. One that cannot (another
        process took a port between the lab's choice and its bind: an outgoing connection's,
        or another test's server on a busy host, seen once in a test-repeat at load 15) starts
        again on other ports, and the workers, not yet spawned, push OTLP to the new one. One
        that exits for another reason, or starts slowly, is left to the run as before."""
        for attempt in range(1, tries + 1):
            exporter = self._start_exporter(library_dir)
            ports = (self.exporter_port, self.otlp_port)
            deadline = time.monotonic() + 60
            while exporter.process.poll() is None and time.monotonic() < deadline:
                said = exporter.log_path.read_text(errors="replace")
                if all(
                    re.search(rf"{what}127\.0\.0\.1:{port}(?!\d)", said)
                    for what, port in zip(_LISTENING, ports, strict=True)
                ):
                    return exporter
                await asyncio.sleep(0.05)
            said = exporter.log_path.read_text(errors="replace")
            if exporter.process.poll() is None or "cannot listen" not in said or attempt == tries:
                return exporter
            log.info("%s; starting the exporter on other ports", said.strip().splitlines()[-1])
            self.exporter_port, self.otlp_port = free_port(), free_port()
            otlp = f"http://127.0.0.1:{self.otlp_port}/v1/metrics"
            self.configs = {n: replace(c, otlp_endpoint=otlp) for n, c in self.configs.items()}
        raise AssertionError("unreachable: the last try returns")

    def _start_exporter(self, library_dir: Path) -> Exporter:
        port = self.exporter_port
        log_path = self.run_dir / "exporter.log"
        self.procfs.mkdir(exist_ok=True)  # --procfs must exist at start; its files follow
        env = {
            **os.environ,
            "LD_LIBRARY_PATH": str(library_dir),
            "FAKE_NVML_STATE": str(self.state_path),
        }
        with log_path.open("wb") as out:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gpubalance",
                    "exporter",
                    "--listen",
                    f"127.0.0.1:{port}",
                    "--otlp-listen",
                    f"127.0.0.1:{self.otlp_port}",
                    "--procfs",
                    str(self.procfs),
                    "--hostname",
                    self.plan.scenario.name,
                    "--config",
                    str(self._exporter_config()),
                    *self.exporter_args,
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        return Exporter(process, f"http://127.0.0.1:{port}", log_path)

    # -- the state the exporter reads -----------------------------------------------------------

    async def _poll(self, session: aiohttp.ClientSession) -> dict[str, WorkerFigures]:
        async def one(name: str) -> WorkerFigures:
            previous = self._figures.get(name)
            if name not in self.down:
                with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                    url = f"http://127.0.0.1:{self.configs[name].port}/state"
                    async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                        return self._figures_from(name, await resp.json())
            # down (crashed, or not answering): its counters hold, nothing runs
            if previous is None:
                previous = _not_started(name)
            return replace(
                previous,
                up=False,
                queue_depth=0,
                running=0,
                in_flight=0,
                kv_used_bytes=0,
                kv_reserved_bytes=0,
            )

        results = await asyncio.gather(*(one(w.name) for w in self.plan.workers))
        self._figures = {f.name: f for f in results}
        return self._figures

    def _figures_from(self, name: str, data: dict[str, Any]) -> WorkerFigures:
        # A restarted worker counts from zero; what its GPU and queue did before the crash
        # carries over (process figures, CPU time and bytes read, start again: a new process).
        base = self._carry.get(name)

        def total(key: str, attr: str) -> float:
            return data[key] + (getattr(base, attr) if base is not None else 0.0)

        return WorkerFigures(
            name=name,
            pid=int(data["pid"]),
            up=bool(data["up"]),
            busy_seconds=total("busy_seconds", "busy_seconds"),
            queue_depth=data["queue_depth"],
            queue_area=total("queue_area", "queue_area"),
            running=data["running"],
            in_flight=data["in_flight"],
            kv_used_bytes=data["kv_used_bytes"],
            # what the worker's allocator holds is what its GPU shows as used (a new process
            # after a crash reserves afresh: nothing carries over)
            kv_reserved_bytes=data["kv_reserved_bytes"],
            cpu_seconds=data["cpu_seconds"],
            read_bytes=data["read_bytes"],
            batches=int(total("batches", "batches")),
            batch_size_sum=total("batch_size_sum", "batch_size_sum"),
            batch_delay_sum=total("batch_delay_sum", "batch_delay_sum"),
            batch_delay_count=int(total("batch_delay_count", "batch_delay_count")),
            requests_done=int(total("requests_done", "requests_done")),
            request_duration_sum=total("request_duration_sum", "request_duration_sum"),
            allocation_failures=int(total("allocation_failures", "allocation_failures")),
            prompt_tokens=int(total("prompt_tokens", "prompt_tokens")),
            generation_tokens=int(total("generation_tokens", "generation_tokens")),
            cpu_wait_seconds=total("cpu_wait_seconds", "cpu_wait_seconds"),
            disk_wait_seconds=total("disk_wait_seconds", "disk_wait_seconds"),
            disk_busy_seconds=total("disk_busy_seconds", "disk_busy_seconds"),
            disk_reads=int(total("disk_reads", "disk_reads")),
            create_time_seconds=self.created[name],
        )

    def _write_state(self, figures: dict[str, WorkerFigures]) -> None:
        state: dict[str, object] = {
            "device_count": len(self.plan.gpus),
            "driver_version": DRIVER_VERSION,
        }
        for gpu in self.plan.gpus:
            p = f"gpu{gpu.index}."
            card = gpu.card
            state.update(
                {
                    p + "name": card.model,
                    p + "uuid": gpu.uuid,
                    p + "pci.bus_id": gpu.pci_bus_id,
                    p + "pci.device_id": f"0x{card.pci_device_id:04X}10DE",
                    p + "cuda_cc": card.cuda_cc,
                    p + "memory.total": card.memory_total_bytes,
                    p + "memory.reserved": RESERVED_BYTES,
                    p + "power.limit": int(gpu.power_limit_watts * 1000),
                    p + "power.default_limit": int(card.power_limit_watts * 1000),
                    p + "clock.max.sm": card.max_sm_clock_mhz,
                    p + "clock.max.graphics": card.max_sm_clock_mhz,
                    p + "clock.max.mem": card.memory_clock_mhz,
                }
            )
            if gpu.index in self.lost:
                state[p + "lost"] = 1
                continue
            reading = self.telemetry.readings.get(gpu.index)
            mine = [w for w in self.plan.workers if w.gpu == gpu.index]
            live = [w for w in mine if figures[w.name].up and figures[w.name].pid]
            util = reading.utilization_ratio if reading else 0.0
            mask = sum(THROTTLE_REASONS[r] for r in reading.throttle_reasons) if reading else 1
            state.update(
                {
                    p + "utilization.gpu": round(100 * util),
                    p + "utilization.memory": round(60 * util),
                    p + "memory.used": sum(memory_used_bytes(w, figures[w.name]) for w in live),
                    p + "temp.gpu": round(reading.temperature_celsius) if reading else 35,
                    p + "power.usage": int(reading.power_watts * 1000) if reading else 25000,
                    p + "energy": int(reading.energy_joules_total * 1000) if reading else 0,
                    p + "clock.sm": round(reading.sm_clock_mhz) if reading else 210,
                    p + "clock.graphics": round(reading.sm_clock_mhz) if reading else 210,
                    p + "clock.mem": round(reading.memory_clock_mhz) if reading else 405,
                    p + "throttle_reasons": mask,
                    p + "fan.speed": round(100 * reading.fan_speed_ratio) if reading else 30,
                    p + "pcie.tx": round(4000 * util),
                    p + "pcie.rx": round(20000 * util),
                    p + "procs": [
                        (figures[w.name].pid, memory_used_bytes(w, figures[w.name])) for w in live
                    ],
                    p + "procs_util": [
                        (
                            figures[w.name].pid,
                            round(100 * util / len(live)),
                            round(60 * util / len(live)),
                            0,
                            0,
                        )
                        for w in live
                    ],
                }
            )
        write_state(self.state_path, state)

    # -- events ---------------------------------------------------------------------------------

    async def _apply(
        self, event: Event, session: aiohttp.ClientSession, api: haproxy.RuntimeApi
    ) -> None:
        async def control(name: str, body: dict[str, Any]) -> None:
            if name in self.down:
                return
            url = f"http://127.0.0.1:{self.configs[name].port}/control"
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with session.post(url, json=body) as resp:
                    await resp.read()

        if event.throttle is not None:
            gpu = event.throttle.gpu
            ratio = event.throttle.clock_ratio
            self.clock[gpu] = (ratio, event.throttle.reason if ratio < 1 else None)
            for w in self.plan.workers:
                if w.gpu == gpu:
                    await control(w.name, {"clock_ratio": event.throttle.clock_ratio})
        elif event.preprocess is not None:
            await control(
                event.preprocess.worker,
                {
                    "cpu_ms": event.preprocess.cpu_ms,
                    "cpu_ms_per_1k": event.preprocess.cpu_ms_per_1k_prompt_tokens,
                },
            )
        elif event.gpu_lost is not None:
            self.lost.add(event.gpu_lost.gpu)
            for w in self.plan.workers:
                if w.gpu == event.gpu_lost.gpu:
                    await control(w.name, {"fail": "gpu_lost"})
        elif event.worker_crash is not None:
            name = event.worker_crash.worker
            self._crash(name)
            if event.worker_crash.restart_after_seconds is not None:
                await asyncio.sleep(event.worker_crash.restart_after_seconds)
                if self.plan.workers[self._index(name)].gpu not in self.lost:
                    self._spawn(name)
                    await self._wait_ready(session, [name])
                    self.down.discard(name)
        elif event.disk is not None:
            self.shared.disk_mb_per_second.value = event.disk.disk_mb_per_second
        elif event.router is not None:
            for name, weight in event.router.weights.items():
                w = self.plan.workers[self._index(name)]
                await asyncio.to_thread(
                    api.set_weight, haproxy.pool_backend(w.pool), name, self._weight(weight)
                )

    def _weight(self, weight: float) -> int:
        """HAProxy weight for a lab weight: as the fast speed, only weighted round robin uses
        the values; under every policy 0 takes a worker out of new work."""
        router = self.plan.scenario.router
        if weight <= 0:
            return 0
        if router.policy != "weighted_round_robin":
            return MAX_WEIGHT
        top = max([*router.weights.values(), 1.0])
        return max(1, round(weight / top * MAX_WEIGHT))

    def _index(self, name: str) -> int:
        return next(w.index for w in self.plan.workers if w.name == name)

    def _crash(self, name: str) -> None:
        """Kill the worker process outright, as a crash would; its counters carry over."""
        process = self.processes.get(name)
        figures = self._figures.get(name)
        if figures is not None:
            self._carry[name] = figures
        self.down.add(name)
        if process is not None and process.is_alive():
            os.kill(process.pid, signal.SIGKILL)
            process.join(5)

    # -- the run --------------------------------------------------------------------------------

    async def run(
        self, cookie_for: Callable[[Request], str | None] | None = None
    ) -> tuple[list[RequestRecord], list[dict[str, object]]]:
        self._loop = asyncio.get_running_loop()
        self._halt = asyncio.Event()
        library_dir = build_library(self.build_dir).parent
        try:
            if self.start_exporter:
                # before the workers, so the first OTLP pushes find it; it sees the GPUs idle
                # until the workers are up
                self._write_state({w.name: _not_started(w.name) for w in self.plan.workers})
                self.exporter = await self._exporter_listening(library_dir)
            for name in self.configs:
                self._spawn(name)
            async with aiohttp.ClientSession() as session:
                await self._start_up(session, library_dir)
                figures = await self._poll(session)
                self.last_sample, _ = self.telemetry.sample(
                    STATE_PERIOD_SECONDS, STATE_PERIOD_SECONDS, figures, {}, self.clock, self.lost
                )
                self._write_state(figures)
                self._write_procfs()
                with self._balancer() as balancer:
                    api = haproxy.RuntimeApi(balancer.config.socket_path)
                    if self.on_ready is not None:
                        self.on_ready(self)
                    origin = time.monotonic()
                    self.telemetry.origin = time.time()
                    stop = asyncio.Event()
                    loops = [
                        asyncio.create_task(self._state_loop(session, origin, stop)),
                        *(
                            asyncio.create_task(self._event_at(e, origin, session, api))
                            for e in sorted(self.plan.scenario.events, key=lambda e: e.at)
                        ),
                    ]
                    sending = asyncio.create_task(
                        send_all(
                            [r for r in self.requests if r.arrival_seconds < self.duration_seconds],
                            f"http://127.0.0.1:{self.frontend_port}",
                            clock_origin=origin,
                            cookie_for=cookie_for or self._cookie_for(),
                        )
                    )
                    halted = asyncio.create_task(self._halt.wait())
                    await asyncio.wait({sending, halted}, return_when=asyncio.FIRST_COMPLETED)
                    records = sending.result().records if sending.done() else []
                    for task in (sending, halted, *loops):
                        task.cancel()
                    stop.set()
                    await asyncio.gather(sending, halted, *loops, return_exceptions=True)
                    del balancer
        finally:
            self._stop()
        return records, self.frames

    def halt(self) -> None:
        """Stop a run early, from any thread (the demo's Ctrl-C): requests not yet answered
        get no record. A run that has ended already is left as it is."""
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # it closed just now: nothing to stop
                self._loop.call_soon_threadsafe(self._halt.set)

    def _cookie_for(self) -> Callable[[Request], str | None]:
        if self.plan.scenario.router.policy != "sticky":
            return lambda request: None
        pools = {w.pool: [x.name for x in self.plan.workers_in(w.pool)] for w in self.plan.workers}

        def cookie(request: Request) -> str | None:
            if request.session is None:
                return None
            return sticky_target(request.session, pools[self.plan.pool_of(request.service_class)])

        return cookie

    async def _event_at(
        self, event: Event, origin: float, session: aiohttp.ClientSession, api: haproxy.RuntimeApi
    ) -> None:
        await asyncio.sleep(max(0.0, origin + event.at - time.monotonic()))
        await self._apply(event, session, api)

    async def _state_loop(
        self, session: aiohttp.ClientSession, origin: float, stop: asyncio.Event
    ) -> None:
        interval = self.plan.scenario.interval_seconds
        last_sample = 0.0
        last_busy: dict[int, float] = {}
        tick = 0
        while not stop.is_set():
            tick += 1
            await asyncio.sleep(max(0.0, origin + tick * STATE_PERIOD_SECONDS - time.monotonic()))
            now = time.monotonic() - origin
            figures = await self._poll(session)
            if now - last_sample >= interval - 1e-6 or not self.frames:
                busy = {}
                for gpu in self.plan.gpus:
                    total = sum(
                        figures[w.name].busy_seconds
                        for w in self.plan.workers
                        if w.gpu == gpu.index
                    )
                    busy[gpu.index] = max(0.0, total - last_busy.get(gpu.index, 0.0))
                    last_busy[gpu.index] = total
                period = now - last_sample if self.frames else now
                sample, frames = self.telemetry.sample(
                    now, period, figures, busy, self.clock, self.lost
                )
                self.last_sample = sample
                last_sample = now
                self.frames.extend(frames)
                if self.on_sample is not None:
                    self.on_sample(sample)
                self._write_procfs()
            self._write_state(figures)

    def _write_procfs(self) -> None:
        sample = self.last_sample
        if sample is not None and sample.host is not None:
            write_procfs(
                self.procfs, sample.host, sample.processes, boot_time_seconds=self.boot_time
            )

    def _stop(self) -> None:
        # workers first: an OTLP worker's last push still finds the exporter
        for process in self.processes.values():
            if process.is_alive():
                process.terminate()
        for process in self.processes.values():
            process.join(10)
            if process.is_alive():
                process.kill()
        if self.exporter is not None and self.exporter.process.poll() is None:
            self.exporter.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.exporter.process.wait(timeout=10)
        if not self.keep_files:
            shutil.rmtree(self.run_dir, ignore_errors=True)


def _not_started(name: str) -> WorkerFigures:
    return WorkerFigures(name, 0, False, 0.0, 0, 0, 0, 0, 0.0, 0.0, 0, 0.0, 0.0, 0, 0.0, 0)


def run_live(
    plan: Plan,
    requests: Sequence[Request],
    seed: int,
    duration_seconds: float,
    out: Path,
    on_sample: Callable[[Sample], None] | None = None,
    **options: Any,
) -> tuple[list[RequestRecord], list[dict[str, object]]]:
    lab = LiveLab(plan, requests, duration_seconds, on_sample, **options)
    return asyncio.run(lab.run())
